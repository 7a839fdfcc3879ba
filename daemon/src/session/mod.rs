//! Sessions: what one client asked to measure, from start to report.
//!
//! [`manager`] owns every session in one task; the gRPC service talks to it through a
//! [`manager::Handle`]. A session's mode is a type of its own behind one interface,
//! [`Measurement`] (one folder per mode): what a counting, sampling or tracing session
//! measures with of its own (perf counters, the sampler, the trace), how each opens, what it
//! says while it runs, and how it ends into its part of the report. The probes any mode may
//! count with (Python, `--uprobe` functions, CUDA launches) are the session's, not the
//! mode's: counting and tracing share them, so they stay on the session and end the same way
//! whatever the mode.

pub mod counting;
pub mod cuda;
pub mod loads;
pub mod manager;
pub mod native;
pub mod python;
mod ring;
pub mod sampling;
pub mod slots;
pub mod source;
pub mod tracing;

use std::{collections::BTreeSet, time::Instant};

use python::Probes;
use sampling::Sampling;
use slots::{Hold, Slots};
use source::{Source, Sources};
use tracing::{TraceEnd, Tracing};

use tokio::{sync::watch, task::JoinHandle};
use tracer_common::loss;
use tracer_proto::{EndReason, Loss, Mode, SessionInfo, SessionState, Target};

use tracer_bpf::Bpf;
use tracer_report as report;

/// A tracing session's events, for those read in user space.
pub trait Timeline: Send + Sync {
    fn push(&self, events: &[tracer_common::TraceEvent]);
}

/// What one of a session's sources leaves once its last readings are taken at the session's
/// end: named off the manager's task into its part of the report.
pub trait ReportPart: Send {
    /// Names what it measured, into its part of `report`.
    fn fill(self: Box<Self>, report: &mut report::Report);
}

/// A mode's own sources, from a session's start to its report.
pub trait Measurement: Send {
    fn mode(&self) -> Mode;

    /// Whether the probes write each call it sees as an event (the tracing mask), besides
    /// counting it.
    fn records_calls(&self) -> bool {
        false
    }

    /// It runs from now (the session is in the manager's table): what started before is not
    /// its own.
    fn begin(&mut self) {}

    /// Its part of the record stored while it runs (a trace's file, so that a killed
    /// tracerd's trace is still found).
    fn running_record(&self, _report: &mut report::Report) {}

    /// Where GPU metrics go while it runs besides the report (a trace's counter tracks).
    fn gpu_tracks(&self) -> Option<Box<dyn crate::gpu::Tracks>> {
        None
    }

    /// Where events read outside the kernel's ring go (a trace's), for sources that read
    /// them (launches counted in-process).
    fn timeline(&self) -> Option<std::sync::Arc<dyn Timeline>> {
        None
    }

    /// A Python function its probes met, `(pid, code, names)`, named `(qualname, filename,
    /// first line)`: for events that need the name. Borrowed: most modes keep nothing.
    fn named(&self, _key: (u32, u64, u64), _name: (&str, &str, i32)) {}

    /// What it has measured so far, to name into a running session's interim report,
    /// where it can tell without stopping (a sampling profile so far).
    fn interim(&self, _sampling: &Sampling) -> Option<Box<dyn ReportPart>> {
        None
    }

    /// A live view of what it measures from now on, where it has one (a trace's events).
    fn subscribe(&self) -> Option<tracing::Subscription> {
        None
    }

    /// Whether its counts are shown on the Prometheus endpoint while it runs.
    fn exports_prometheus(&self) -> bool {
        false
    }

    /// Readings due on the manager's timer (all of them: `force`).
    fn tick(&mut self, _force: bool) {}

    /// What it has measured so far, and its own losses, into `info`.
    fn collect(&mut self, info: &mut SessionInfo);

    /// Stops measuring at the session's end, before its final state is read: `threads` are
    /// those whose Python calls may still be running.
    fn stop(&mut self, _end: &mut Ends<'_>, _threads: Threads<'_>) {}

    /// Its last readings, and what it leaves to name off the manager's task.
    fn finish(self: Box<Self>, end: &mut Ends<'_>) -> Finished;
}

/// Where a mode opens its sources: the session, its slot, its target (None: every process)
/// and its owner.
pub struct Opening<'a> {
    pub id: &'a str,
    pub slot: u8,
    pub pid: Option<u32>,
    pub owner_uid: u32,
}

/// What an ended mode leaves for its report.
#[derive(Default)]
pub struct Finished {
    /// Its profile, named later.
    pub profile: Option<Box<dyn ReportPart>>,
    /// A trace still to close.
    pub trace: Option<TraceEnd>,
    /// Pushes the last window of the profile.
    pub continuous: Option<crate::continuous::Running>,
}

/// Threads whose Python calls may still run at a session's end.
pub enum Threads<'a> {
    /// The session counts no Python calls.
    None,
    /// Every thread of these processes.
    Of(&'a BTreeSet<u32>),
    /// Every thread the probes saw in a Python frame (system-wide sessions).
    InPython,
}

/// What a mode's end uses of the manager's kernel side, borrowed for that end.
pub struct Ends<'a> {
    pub bpf: &'a mut Bpf,
    pub sampling: &'a Sampling,
    pub tracing: &'a Tracing,
    pub py: &'a Probes,
    pub slots: &'a mut Slots,
    /// Where a [`Hold`] says it let go.
    pub counts_read: &'a tokio::sync::mpsc::UnboundedSender<u8>,
}

impl Ends<'_> {
    /// Keeps `slot` taken until the hold is dropped.
    pub fn hold(&mut self, slot: u8) -> Hold {
        self.slots.hold(slot);
        Hold::new(slot, self.counts_read.clone())
    }

    /// An ended session's counts in `maps` (opened again), read later with `slot` held;
    /// read here with `now` if they could not be opened.
    pub fn last_counts<M, T>(
        &mut self,
        slot: u8,
        maps: Result<M, tracer_bpf::BpfError>,
        now: impl FnOnce(&mut Bpf) -> T,
    ) -> slots::LastCounts<M, T> {
        match maps {
            Ok(maps) => slots::LastCounts::Later(maps, self.hold(slot)),
            Err(e) => {
                ::tracing::warn!(%e, "reading a session's last counts on the manager's task instead");
                slots::LastCounts::Read(now(self.bpf))
            }
        }
    }
}

/// A running session.
struct Session {
    id: String,
    /// What its mode measures with of its own.
    measure: Box<dyn Measurement>,
    target: Target,
    duration_ms: u64,
    owner_uid: u32,
    /// The caller that started it, as `SessionInfo.started_by` says it.
    started_by: String,
    started: Instant,
    started_unix_ms: u64,
    /// Bit in the BPF `TRACKED` masks, for sessions that follow processes.
    slot: Option<u8>,
    /// Followed processes that are alive.
    live: BTreeSet<u32>,
    followed: u32,
    exited: u32,
    /// Processes no longer followed, and why (an exec that gained credentials).
    unfollowed: Vec<String>,
    proc_events: u64,
    /// System-wide sessions: the machine's fork count (since boot) at the start.
    forks_at_start: Option<u64>,
    /// The probes it counts with besides its mode's own: Python calls, native function
    /// calls, CUDA launches (`--cuda`).
    sources: Sources,
    /// Kernel loss counters at start: a session reports what was lost while it ran.
    loss_base: [u64; loss::COUNT as usize],
    command: Option<String>,
    ended: watch::Sender<bool>,
    expiry: Option<JoinHandle<()>>,
}

/// The loss counters a session of `owner_uid` on `slot` reports: the machine's for root's; for
/// another user's, those counted in the processes its session follows (other users' losses
/// are none of its business).
fn scoped_losses(
    bpf: &Bpf,
    owner_uid: u32,
    slot: Option<u8>,
    machine: &[u64; loss::COUNT as usize],
) -> [u64; loss::COUNT as usize] {
    match (owner_uid, slot) {
        (0, _) | (_, None) => *machine,
        (_, Some(slot)) => bpf.slot_losses(slot),
    }
}

impl Session {
    /// Whether the session follows a process tree (and ends when it exits), rather than the machine.
    fn follows_pid(&self) -> bool {
        matches!(self.target.kind, Some(tracer_proto::target::Kind::Pid(_)))
    }

    /// Whether the processes it follows stop at each exec for the daemon (EXEC_HOLD): an
    /// unprivileged owner's, to check the new program's credentials; its sources' (Python's,
    /// to probe a new interpreter; CUDA's, to locate launches in the executable mapped then);
    /// sampling's, to read the new interpreter before its first sample.
    fn waits_at_exec(&self) -> bool {
        self.owner_uid != 0 || self.sources.all().any(Source::holds_at_exec) || self.samples()
    }

    /// Whether probes of its sources are still being attached: its start is answered once
    /// none is.
    fn probing(&self) -> bool {
        self.sources.all().any(Source::probing)
    }

    /// Whether the sampler reads its processes (for samples, or for its sources' names).
    fn uses_sampler(&self) -> bool {
        self.samples() || self.sources.all().any(Source::uses_sampler)
    }

    fn samples(&self) -> bool {
        self.measure.mode() == tracer_proto::Mode::Sampling
    }

    /// Its sources' parts of a report so far, read without taking anything out of the
    /// kernel's maps (`Source::interim`).
    fn sources_so_far(&mut self, bpf: &mut Bpf) -> Vec<Box<dyn ReportPart>> {
        let Some(slot) = self.slot else {
            return Vec::new();
        };
        let mut at = source::Reading {
            bpf,
            slot,
            live: &self.live,
        };
        self.sources
            .each()
            .filter_map(|source| source.interim(&mut at))
            .collect()
    }

    fn losses(&self, now: &[u64; loss::COUNT as usize]) -> Vec<Loss> {
        if self.slot.is_none() {
            return Vec::new();
        }
        (0..loss::COUNT)
            // Not a loss: reported with the Python results. Trace losses: counted per session.
            .filter(|&i| i != loss::PY_EXIT_INFERRED && i != loss::TRACE_RINGBUF_FULL)
            .filter_map(|i| {
                let n = now[i as usize].saturating_sub(self.loss_base[i as usize]);
                (n > 0).then(|| Loss {
                    cause: tracer_bpf::loss_cause_name(i).into(),
                    count: n,
                })
            })
            .collect()
    }

    /// Its state now; its mode adds what it measured and its own losses.
    fn info(&mut self, losses: &[u64; loss::COUNT as usize]) -> SessionInfo {
        let mut info = SessionInfo {
            id: self.id.clone(),
            mode: self.measure.mode().into(),
            target: Some(self.target),
            state: SessionState::Running.into(),
            end_reason: EndReason::Unspecified.into(),
            started_unix_ms: self.started_unix_ms,
            elapsed_ms: u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            duration_ms: self.duration_ms,
            live_processes: u32::try_from(self.live.len()).unwrap_or(u32::MAX),
            exited_processes: self.exited,
            losses: self.losses(losses),
            owner_uid: self.owner_uid,
            started_by: self.started_by.clone(),
            events: self.proc_events,
            ..SessionInfo::default()
        };
        self.measure.collect(&mut info);
        info
    }
}

pub fn target_label(t: Option<&Target>) -> String {
    match t.and_then(|t| t.kind) {
        Some(tracer_proto::target::Kind::Pid(pid)) => format!("pid {pid}"),
        Some(tracer_proto::target::Kind::All(_)) => "all".into(),
        None => "none".into(),
    }
}

pub fn mode_name(mode: i32) -> &'static str {
    match Mode::try_from(mode) {
        Ok(Mode::Counting) => "counting",
        Ok(Mode::Sampling) => "sampling",
        Ok(Mode::Tracing) => "tracing",
        _ => "unspecified",
    }
}

pub fn state_name(state: i32) -> &'static str {
    match SessionState::try_from(state) {
        Ok(SessionState::Running) => "running",
        Ok(SessionState::Finished) => "finished",
        Ok(SessionState::Failed) => "failed",
        _ => "unspecified",
    }
}

pub fn end_reason_name(reason: i32) -> &'static str {
    match EndReason::try_from(reason) {
        Ok(EndReason::Stopped) => "stopped",
        Ok(EndReason::Duration) => "duration reached",
        Ok(EndReason::TargetExited) => "target exited",
        Ok(EndReason::DaemonShutdown) => "daemon shut down",
        Ok(EndReason::Error) => "error",
        _ => "",
    }
}

/// The report of an ended session, from its final state.
fn build_report(info: &SessionInfo, followed: u32, command: Option<String>) -> report::Report {
    report::Report {
        session: report::Summary {
            id: info.id.clone(),
            mode: mode_name(info.mode).into(),
            target: target_label(info.target.as_ref()),
            launched: info.target.is_some_and(|t| t.launched),
            owner_uid: info.owner_uid,
            started_by: info.started_by.clone(),
            started_unix_ms: info.started_unix_ms,
            elapsed_ms: info.elapsed_ms,
            state: state_name(info.state).into(),
            end_reason: end_reason_name(info.end_reason).into(),
            error: (!info.error.is_empty()).then(|| info.error.clone()),
        },
        counters: info
            .counters
            .iter()
            .map(report::CounterResult::from)
            .collect(),
        losses: info.losses.iter().map(report::LossEntry::from).collect(),
        processes: report::Processes {
            followed,
            system_wide: matches!(
                info.target.and_then(|t| t.kind),
                Some(tracer_proto::target::Kind::All(_))
            ),
            forked: None,
            exited: info.exited_processes,
            command,
            unfollowed: Vec::new(),
            containers: Vec::new(),
        },
        python: None,
        native: None,
        profile: None,
        trace: None,
        cuda: None,
    }
}
