//! Sessions: what one client asked to measure, from start to report.
//!
//! [`manager`] owns every session in one task; the gRPC service talks to it through a
//! [`manager::Handle`]. A session's mode is a type of its own behind one interface
//! ([`modes::Measurement`]); the probes any mode may count with (Python, native functions,
//! CUDA launches) are the session's, each source in its own module.

mod callers;
pub mod counting;
pub mod cuda;
pub mod manager;
pub mod modes;
pub mod native;
pub mod python;
pub mod sampling;
pub mod slots;
pub mod trace_session;
pub mod tracing;

use std::{collections::BTreeSet, time::Instant};

use tokio::{sync::watch, task::JoinHandle};
use tracer_common::loss;
use tracer_proto::{EndReason, Loss, Mode, SessionInfo, SessionState, Target};

use tracer_bpf::bpf;
use tracer_report as report;

/// What one of a session's sources leaves once its last readings are taken at the session's
/// end: named off the manager's task into its part of the report.
pub trait ReportPart: Send {
    /// Names what it measured, into its part of `report`.
    fn fill(self: Box<Self>, report: &mut report::Report);
}

/// A running session.
struct Session {
    id: String,
    /// What its mode measures with of its own.
    measure: Box<dyn modes::Measurement>,
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
    /// Counting Python calls.
    python: Option<python::PySession>,
    /// Counting native function calls.
    native: Option<native::NativeSession>,
    /// Counting CUDA launches (`--cuda`).
    cuda: Option<cuda::CudaSession>,
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
    bpf: &bpf::Bpf,
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
                    cause: bpf::loss_cause_name(i).into(),
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
