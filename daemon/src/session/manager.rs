//! The task that owns every session. The gRPC service sends it [`Request`]s through a
//! [`Handle`]; work it hands off comes back as [`Done`]; it also consumes process events
//! from BPF and ends sessions on their timers.

use std::{collections::HashMap, time::Duration};

use aya::maps::{MapData, RingBuf};
use tokio::{
    io::unix::AsyncFd,
    sync::{mpsc, watch},
};
use tracer_common::ProcEvent;
use tracer_proto::{target, EndReason, SessionInfo, SessionState};

use super::{build_report, python::Probes, Session};
mod ahead;
mod checks;
mod closing;
mod commands;
mod cuda;
mod follow;
mod interim;
mod metrics;
mod persist;
mod python;
mod start;
use ahead::counts_python;
use commands::{Done, DoneTx, Prepared, Reply, Request};
pub use commands::{Fetched, Handle, SharedStore, Subscription};

use crate::{
    access::Caller,
    error::Error,
    store::{Store, StoreError},
};
use tracer_bpf::{Bpf, ProbeSet};
use tracer_inspect::native::ProbeLimits;
use tracer_inspect::process;
use tracer_report::Report;

/// Longest session a client may ask for.
pub const MAX_DURATION_MS: u64 = 24 * 60 * 60 * 1000;
/// Running sessions at once, all modes together.
pub const MAX_RUNNING: usize = 256;

pub struct Manager {
    probe_limits: ProbeLimits,
    running: HashMap<String, Session>,
    /// Sessions end in place during shutdown.
    shutting_down: bool,
    finished: HashMap<String, SessionInfo>,
    /// Final counts of exported sessions that ended lately, for the Prometheus endpoint.
    exported: HashMap<String, metrics::Ended>,
    store: SharedStore,
    /// Every write to the store, in turn, off this task.
    writer: crate::store::writer::Writer,
    bpf: Bpf,
    py: Probes,
    sampling: super::sampling::Sampling,
    tracing: super::tracing::Tracing,
    slots: super::slots::Slots,
    /// Where work handed off to other threads and tasks comes back.
    done: DoneTx,
    /// Slots whose ended session's probes are now gone (see `release`).
    detached: mpsc::UnboundedSender<u8>,
    /// Held slots let go (`Hold`: an ended session's last counts read).
    counts_read: mpsc::UnboundedSender<u8>,
    /// Starts not answered yet, by what they wait for.
    starts: Starts,
    /// Ended sessions whose reports are being named, stored or removed.
    ending: Ending,
    /// Looks for processes that run off this task.
    scans: Scans,
    /// Slots whose ended session's probes may have counted after its last reading: their
    /// native and CUDA maps are emptied of them once the slot is free (`drain`).
    to_drain: u64,
    /// Processes left stopped at exec on purpose: they gained credentials and could not be
    /// unfollowed (the guardian continues them if tracerd dies).
    kept_stopped: Vec<u32>,
    /// Processes the kernel stopped at their mapping of a CUDA library, continued once its
    /// probes are in (`continue_cuda_held`).
    cuda_held: Vec<u32>,
}

/// Starts taken but not answered yet, by what they wait for. Each is answered once the
/// work it waits for comes back as a [`Done`].
#[derive(Default)]
struct Starts {
    /// Native probes being attached off this task, by uid (counted against the user's limit
    /// as if held).
    attaching: HashMap<u32, usize>,
    /// Starts waiting for the Python probes another start attaches (`PythonAttached`).
    python_waiting: Vec<ahead::WaitingStart>,
    /// Starts whose Python probes were attached ahead and that have not started or failed
    /// yet: no other start's failure may take those probes off meanwhile.
    python_ahead: usize,
    /// Started sessions answered once their sources' probes are on (`Source::probing`: a
    /// CUDA session's libraries its processes map, `CudaProbed`), by session.
    probing: HashMap<String, start::Answer>,
    /// Started sessions whose running record is being written (`Recorded`).
    recording: usize,
}

/// Ended sessions whose reports are on their way to the store, or out of it.
#[derive(Default)]
struct Ending {
    /// Ended sessions whose profile is being named (`Named`).
    closing: HashMap<String, closing::Closing>,
    /// Finished sessions whose trace file and report are being removed (`Deleted`).
    deleting: std::collections::HashSet<String>,
    /// Reports of ended sessions not in the store (yet): served from memory, and stored once
    /// the store takes writes again.
    unsaved: HashMap<String, std::sync::Arc<Report>>,
    /// The unsaved reports are being written (`Saved`).
    saving: bool,
    /// `stop` requests for sessions still running until their GPU times are off
    /// (`GpuTimesOff`), answered at their end.
    stops: HashMap<String, Vec<Reply<SessionInfo>>>,
}

/// Looks for processes that run off this task.
#[derive(Default)]
struct Scans {
    /// For processes that map CUDA (`CudaScanned`).
    cuda: bool,
    /// For processes that map Python (`PythonScanned`).
    python: bool,
    /// Processes whose interpreter's probes are being attached, to check again then (those
    /// held at exec go on after; `LateProbed`).
    late: Vec<python::LateCheck>,
    /// Handovers to the probes waiting for theirs likewise (answered then).
    handovers: Vec<python::WaitingHandover>,
    /// Processes held at exec while the sampler reads their new program (`SampledExec`).
    sampled: Vec<u32>,
}

impl Scans {
    /// Whether something still holds `pid` at its exec: its interpreter's probes, or the
    /// sampler's read of its program.
    fn holding(&self, pid: u32) -> bool {
        self.late.iter().any(|l| l.pid == pid) || self.sampled.contains(&pid)
    }
}

type CodeRing = AsyncFd<RingBuf<MapData>>;

/// What the manager's task waits on besides its timers.
struct Inputs {
    rx: mpsc::Receiver<Request>,
    done_rx: mpsc::UnboundedReceiver<Done>,
    proc_rx: mpsc::UnboundedReceiver<ProcEvent>,
    detached_rx: mpsc::UnboundedReceiver<u8>,
    counts_read_rx: mpsc::UnboundedReceiver<u8>,
    codes: CodeRing,
    kernel_names: CodeRing,
}

impl Manager {
    /// Starts the manager task. Sessions left running by a daemon that died are marked failed.
    /// `interpreters`: the Python runtimes on this machine, probed when a session counts Python calls.
    pub fn spawn(
        mut store: Store,
        mut bpf: Bpf,
        interpreters: Vec<std::path::PathBuf>,
        traces: std::path::PathBuf,
        probe_limits: ProbeLimits,
    ) -> Result<(Handle, tokio::task::JoinHandle<()>), Error> {
        let (tx, rx) = mpsc::channel(256);
        let (done, done_rx) = mpsc::unbounded_channel();
        let persist::Recovered { finished, unsaved } = persist::recover(&mut store, &traces)?;
        let (proc_tx, proc_rx) = mpsc::unbounded_channel();
        let (detached, detached_rx) = mpsc::unbounded_channel();
        let (counts_read, counts_read_rx) = mpsc::unbounded_channel();
        bpf.events(proc_tx)
            .map_err(|e| Error::io("reading BPF process events", e))?;
        let ring = bpf.take_py_codes().expect("PY_CODES taken once");
        // SAFETY: the ring buffer owns its fd and lives inside the AsyncFd.
        let codes = unsafe { AsyncFd::register(ring) }
            .map_err(|e| Error::io("reading BPF Python names", e.into()))?;
        let ring = bpf.take_cuda_names().expect("CUDA_NAMES taken once");
        // SAFETY: as above.
        let kernel_names = unsafe { AsyncFd::register(ring) }
            .map_err(|e| Error::io("reading BPF CUDA names", e.into()))?;
        let sampling = super::sampling::Sampling::spawn(bpf.take_sampling()?, interpreters.clone());
        let tracing = super::tracing::Tracing::spawn(bpf.take_tracing()?, traces);
        let store = std::sync::Arc::new(std::sync::Mutex::new(store));
        let writer = crate::store::writer::Writer::spawn(store.clone())
            .map_err(|e| Error::io("starting the state database's writer", e))?;
        let manager = Manager {
            probe_limits,
            running: HashMap::new(),
            shutting_down: false,
            finished,
            exported: HashMap::new(),
            store: store.clone(),
            writer,
            bpf,
            py: Probes::new(interpreters.clone()),
            sampling,
            tracing,
            slots: super::slots::Slots::default(),
            done: done.clone(),
            detached,
            counts_read,
            starts: Starts::default(),
            ending: Ending {
                unsaved,
                ..Ending::default()
            },
            scans: Scans::default(),
            to_drain: 0,
            kept_stopped: Vec::new(),
            cuda_held: Vec::new(),
        };
        tokio::task::spawn_blocking(move || {
            let found = super::python::Inspected::read(&interpreters);
            let _ = done.send(Done::Inspected(found));
        });
        let task = tokio::spawn(manager.run(Inputs {
            rx,
            done_rx,
            proc_rx,
            detached_rx,
            counts_read_rx,
            codes,
            kernel_names,
        }));
        Ok((Handle { tx }, task))
    }

    async fn run(mut self, inputs: Inputs) {
        let Inputs {
            mut rx,
            mut done_rx,
            mut proc_rx,
            mut detached_rx,
            mut counts_read_rx,
            mut codes,
            mut kernel_names,
        } = inputs;
        let mut sweep = tokio::time::interval(Duration::from_secs(1));
        // Tracing sessions' perf counter readings; each session keeps its own period.
        let mut readings = tokio::time::interval(Duration::from_millis(10));
        readings.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                // Readiness is cleared before draining: a record submitted after the drain
                // wakes the reader again only if it was caught up, so clearing it after the
                // drain could lose that wakeup and leave records waiting.
                guard = codes.readable_mut() => {
                    if let Ok(mut g) = guard {
                        g.clear_ready();
                        self.drain_codes(g.get_inner_mut());
                    }
                    continue;
                }
                guard = kernel_names.readable_mut() => {
                    if let Ok(mut g) = guard {
                        g.clear_ready();
                        self.drain_kernel_names(g.get_inner_mut());
                    }
                    continue;
                }
                // Names first, for both: a session that ends now must have every name it
                // was sent.
                Some(done) = done_rx.recv() => {
                    self.drain_codes(codes.get_mut());
                    self.drain_kernel_names(kernel_names.get_mut());
                    self.on_done(done);
                }
                request = rx.recv() => {
                    self.drain_codes(codes.get_mut());
                    self.drain_kernel_names(kernel_names.get_mut());
                    match request {
                    Some(Request::Shutdown { reply }) => {
                        self.shutting_down = true;
                        let ids: Vec<String> = self.running.keys().cloned().collect();
                        for id in ids {
                            self.finish(&id, EndReason::DaemonShutdown, None);
                        }
                        // Reports being named and stored, or deleted, and starts being
                        // recorded when the shutdown came are waited for.
                        while !self.ending.closing.is_empty() || !self.ending.deleting.is_empty() || self.starts.recording > 0 {
                            match done_rx.recv().await {
                                Some(Done::Named { id, done }) => self.named(&id, *done),
                                Some(Done::Recorded { info, stored, reply }) => {
                                    self.recorded(info, stored, reply);
                                }
                                Some(Done::Deleted { id, stored, reply }) => {
                                    self.deleted(&id, stored, reply);
                                }
                                Some(_) => {}
                                None => break,
                            }
                        }
                        self.save_unsaved_now();
                        // Held at exec for probes that will not come now.
                        for held in std::mem::take(&mut self.scans.late) {
                            self.continue_held(held.pid);
                        }
                        let _ = reply.send(());
                        return;
                    }
                    Some(request) => self.on_request(request),
                    None => return,
                }},
                Some(slot) = detached_rx.recv() => self.free_slot(slot),
                Some(slot) = counts_read_rx.recv() => self.let_go(slot),
                Some(ev) = proc_rx.recv() => {
                    self.drain_codes(codes.get_mut());
                    self.drain_kernel_names(kernel_names.get_mut());
                    self.on_proc_event(ev);
                }
                // The sweep ends sessions whose processes are gone: their names first.
                _ = sweep.tick() => {
                    self.drain_codes(codes.get_mut());
                    self.drain_kernel_names(kernel_names.get_mut());
                    self.sweep();
                }
                _ = readings.tick() => {
                    self.drain_kernel_names(kernel_names.get_mut());
                    self.read_trace_counters(false);
                    self.look_for_cuda(false, None);
                }
            }
        }
    }

    /// A client's request: answered now, or once the work it starts comes back.
    fn on_request(&mut self, request: Request) {
        match request {
            Request::Start { req, caller, reply } => self.prepare(*req, caller, reply),
            Request::Stop { id, caller, reply } => match self.stop(&id, caller) {
                Ok(None) => match self.ending.closing.get_mut(&id) {
                    Some(c) => c.stops.push(reply),
                    None => self.ending.stops.entry(id).or_default().push(reply),
                },
                done => {
                    let _ = reply.send(done.map(|info| info.expect("answered")));
                }
            },
            Request::Get { id, caller, reply } => {
                let _ = reply.send(self.get(&id, caller));
            }
            Request::List { caller, reply } => {
                let _ = reply.send(Ok(self.list(&caller)));
            }
            Request::Report {
                id,
                caller,
                interim,
                reply,
            } => {
                let _ = reply.send(self.report(&id, caller, interim));
            }
            Request::Subscribe { id, caller, reply } => {
                let _ = reply.send(self.subscribe(&id, caller));
            }
            Request::Delete { id, caller, reply } => self.delete(id, caller, reply),
            Request::Metrics { reply } => {
                let _ = reply.send(self.metrics());
            }
            Request::Shutdown { .. } => unreachable!("handled in run"),
        }
    }

    /// Handed-off work come back: the start, end or scan it belongs to goes on.
    fn on_done(&mut self, done: Done) {
        match done {
            Done::Ready {
                req,
                caller,
                reply,
                ahead,
            } => self.ready(req, caller, reply, ahead),
            Done::Attached(start) => self.attached(start),
            Done::PythonAttached(start) => self.python_attached(start),
            Done::StartPrepared {
                req,
                caller,
                reply,
                ahead,
                prepared,
            } => {
                let mut prepared = Some(prepared);
                self.start(req, caller, ahead, &mut prepared, reply);
                // Refused after all (bad options, no slot): the counter goes again.
                if let Some(Prepared { counter: Ok(c), .. }) = prepared {
                    std::thread::spawn(move || {
                        let pid = c.pid;
                        c.finish(&|p| p == pid)
                    });
                }
            }
            Done::InprocSettled {
                session,
                pid,
                outcome,
            } => self.inproc_settled(&session, pid, outcome),
            Done::InprocHandover {
                session,
                pid,
                reply,
            } => self.inproc_handover(session, pid, reply),
            Done::Recorded {
                info,
                stored,
                reply,
            } => self.recorded(info, stored, reply),
            Done::LateProbed(attached) => {
                self.py.adopt(attached);
                self.python_probes_in();
                // The sessions that needed them may have ended meanwhile.
                self.update_python_masks();
            }
            Done::CudaProbed { session, probed } => {
                self.cuda_probed(&session, probed);
                self.continue_cuda_held();
            }
            Done::CudaHandshake {
                session,
                pid,
                injection,
                counted,
            } => self.cuda_handshaken(&session, pid, injection, counted),
            Done::CudaReleased(slot) => self.cuda_released(slot),
            Done::CudaScanned(pids) => {
                self.scans.cuda = false;
                self.look_for_cuda(false, Some(&pids));
            }
            Done::PythonScanned(pids) => self.python_scanned(&pids),
            Done::Inspected(found) => self.py.add_inspected(found),
            Done::SampledExec(pid) => self.sampled_exec(pid),
            Done::Expire { id } => self.finish(&id, EndReason::Duration, None),
            Done::GpuTimesOff {
                id,
                pid,
                status,
                reason,
                error,
            } => self.gpu_times_off(&id, pid, status, reason, error),
            Done::Named { id, done } => self.named(&id, *done),
            Done::Saved(ids) => self.saved(ids),
            Done::Deleted { id, stored, reply } => self.deleted(&id, stored, reply),
        }
    }

    /// Tells the probes which slots are tracing.
    fn update_trace_masks(&mut self) {
        let mask = self
            .running
            .values()
            .filter(|s| s.measure.records_calls())
            .filter_map(|s| s.slot)
            .fold(0u64, |m, slot| m | 1 << slot);
        if let Err(e) = self.bpf.set_tracing_sessions(mask) {
            tracing::error!(%e, "updating tracing session masks");
        }
    }

    /// Tracing sessions' perf counter readings, for those whose period has come (all: `force`).
    fn read_trace_counters(&mut self, force: bool) {
        for s in self.running.values_mut() {
            s.measure.tick(force);
        }
    }

    fn subscribe(&mut self, id: &str, caller: Caller) -> Result<Subscription, Error> {
        caller.may_read(self.owner(id)?, id)?;
        self.running
            .get(id)
            .and_then(|s| s.measure.subscribe())
            .ok_or_else(|| {
                Error::FailedPrecondition(format!("session {id} is not a running tracing session"))
            })
    }

    fn release(&mut self, slot: Option<u8>) {
        self.release_after(slot, Vec::new());
    }

    /// A refused start's slot, with the probes attached ahead into it (if not yet taken).
    fn abandon(&mut self, slot: Option<u8>, attached: &mut Option<ahead::Attached>) {
        let probes = attached.take().map(|mut a| a.native.take_probes());
        self.release_after(slot, probes.into_iter().collect());
    }

    /// Frees an ended session's slot once `probes` (the session's own) are detached. That
    /// waits for the kernel's grace periods, on a thread of its own: nobody waits for it.
    /// Until then the slot stays taken, so that what the old probes still count cannot
    /// reach a new session.
    fn release_after(&mut self, slot: Option<u8>, probes: Vec<ProbeSet>) {
        let Some(slot) = slot else {
            return;
        };
        if let Err(e) = self.bpf.release(slot) {
            tracing::warn!(%e, slot, "releasing a BPF session slot");
        }
        if probes.iter().all(ProbeSet::is_empty) {
            if self.slots.free(slot) {
                self.drain(slot);
            }
            return;
        }
        let detached = self.detached.clone();
        tracer_bpf::release(probes, move || {
            let _ = detached.send(slot);
        });
    }

    /// A slot whose session's probes are gone: free once its last counts are read too.
    fn free_slot(&mut self, slot: u8) {
        self.to_drain |= 1 << slot;
        if self.slots.free(slot) {
            self.drain(slot);
        }
    }

    /// A held slot let go (`Hold`, `CudaReleased`).
    fn let_go(&mut self, slot: u8) {
        if self.slots.unhold(slot) {
            self.drain(slot);
        }
    }

    /// A slot just freed: what its ended session's probes counted after its last counts
    /// were read is dropped before another session takes it.
    fn drain(&mut self, slot: u8) {
        if self.to_drain & (1 << slot) == 0 {
            return;
        }
        self.to_drain &= !(1 << slot);
        self.bpf.native_counts(slot, true);
        self.bpf.cuda_counts(slot, true);
        self.bpf.gpu_kernel_times(slot, true);
    }

    /// What a mode's end uses of the kernel side.
    fn ends(&mut self) -> super::Ends<'_> {
        super::Ends {
            bpf: &mut self.bpf,
            sampling: &self.sampling,
            tracing: &self.tracing,
            py: &self.py,
            slots: &mut self.slots,
            counts_read: &self.counts_read,
        }
    }

    /// The session's final state, or None while its profile is named (answered then).
    fn stop(&mut self, id: &str, caller: Caller) -> Result<Option<SessionInfo>, Error> {
        let owner = self.owner(id)?;
        caller.may_stop(owner, id)?;
        if self.running.contains_key(id) {
            self.finish(id, EndReason::Stopped, None);
        }
        // Ending (or about to: its GPU times being turned off first): answered at its end.
        if self.ending.closing.contains_key(id) || self.running.contains_key(id) {
            return Ok(None);
        }
        Ok(Some(self.finished[id].clone()))
    }

    /// Every session `caller` may see, newest first: running, ending and finished.
    fn list(&mut self, caller: &Caller) -> Vec<SessionInfo> {
        let losses = self.bpf.losses();
        let bpf = &self.bpf;
        let mut all: Vec<SessionInfo> = self
            .running
            .values_mut()
            .map(|s| s.info(&super::scoped_losses(bpf, s.owner_uid, s.slot, &losses)))
            .collect();
        all.extend(self.ending.closing.values().map(|c| c.shown.clone()));
        all.extend(self.finished.values().cloned());
        all.retain(|s| caller.sees(s.owner_uid));
        all.sort_by(|a, b| {
            b.started_unix_ms
                .cmp(&a.started_unix_ms)
                .then(a.id.cmp(&b.id))
        });
        all
    }

    fn owner(&self, id: &str) -> Result<u32, Error> {
        self.running
            .get(id)
            .map(|s| s.owner_uid)
            .or_else(|| self.ending.closing.get(id).map(|c| c.shown.owner_uid))
            .or_else(|| self.finished.get(id).map(|s| s.owner_uid))
            .ok_or_else(|| Error::NoSuchSession { id: id.into() })
    }

    fn get(
        &mut self,
        id: &str,
        caller: Caller,
    ) -> Result<(SessionInfo, watch::Receiver<bool>), Error> {
        caller.may_read(self.owner(id)?, id)?;
        let losses = self.bpf.losses();
        if let Some(s) = self.running.get_mut(id) {
            let losses = super::scoped_losses(&self.bpf, s.owner_uid, s.slot, &losses);
            return Ok((s.info(&losses), s.ended.subscribe()));
        }
        if let Some(c) = self.ending.closing.get(id) {
            return Ok((c.shown.clone(), c.ended.subscribe()));
        }
        let (_, rx) = watch::channel(true);
        Ok((self.finished[id].clone(), rx))
    }

    /// Forgets a finished session: state, report, trace file. Removing them (a delete may
    /// compact the store) happens on the store's writer; it is answered then (`deleted`).
    fn delete(&mut self, id: String, caller: Caller, reply: Reply<SessionInfo>) {
        if let Err(e) = self.may_delete(&id, caller) {
            let _ = reply.send(Err(e));
            return;
        }
        self.ending.deleting.insert(id.clone());
        let (trace, tx) = (self.trace_path(&id), self.done.clone());
        self.writer.then(move |store| {
            // The trace first: on a full disk, its space is what lets the store write again.
            persist::remove_trace_file(&trace);
            let stored = store.delete(&id);
            let _ = tx.send(Done::Deleted { id, stored, reply });
        });
    }

    fn may_delete(&self, id: &str, caller: Caller) -> Result<(), Error> {
        let owner = self.owner(id)?;
        caller.may_stop(owner, id)?;
        if self.running.contains_key(id) {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is running: stop it first"
            )));
        }
        if self.ending.closing.contains_key(id) {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is ending: its profile is being named"
            )));
        }
        if self.ending.deleting.contains(id) {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is being deleted"
            )));
        }
        Ok(())
    }

    /// A session's trace file and stored report are removed: it is forgotten. If the store
    /// could not, it stays listed, to be deleted again.
    fn deleted(&mut self, id: &str, stored: Result<(), StoreError>, reply: Reply<SessionInfo>) {
        self.ending.deleting.remove(id);
        if let Err(e) = stored {
            let _ = reply.send(Err(e.into()));
            return;
        }
        self.ending.unsaved.remove(id);
        self.exported.remove(id);
        tracing::info!(id, "session deleted");
        let info = self
            .finished
            .remove(id)
            .ok_or_else(|| Error::NoSuchSession { id: id.into() });
        self.release_free_memory();
        let _ = reply.send(info);
    }

    /// Gives the allocator's free memory back to the system when no session runs: glibc
    /// otherwise keeps what ended sessions freed, and the daemon's memory never comes down.
    /// Trimming a heap that just freed a large report takes tens of ms: not on this task.
    fn release_free_memory(&self) {
        if self.running.is_empty() {
            #[cfg(target_env = "gnu")]
            tokio::task::spawn_blocking(|| {
                // SAFETY: malloc_trim has no preconditions.
                unsafe { libc::malloc_trim(0) };
            });
        }
    }

    /// A finished session's report (or the store that holds it), and where its trace files
    /// are.
    fn report(
        &mut self,
        id: &str,
        caller: Caller,
        interim: bool,
    ) -> Result<(Fetched, std::path::PathBuf), Error> {
        caller.may_read(self.owner(id)?, id)?;
        if interim && self.running.contains_key(id) {
            return Ok((self.interim(id)?, self.tracing.dir().to_owned()));
        }
        if self.running.contains_key(id) || self.ending.closing.contains_key(id) {
            return Err(Error::StillRunning { id: id.into() });
        }
        if self.ending.deleting.contains(id) {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is being deleted"
            )));
        }
        let fetched = match self.ending.unsaved.get(id) {
            Some(r) => Fetched::Parsed(Box::new((**r).clone())),
            None => Fetched::Stored(self.store.clone()),
        };
        Ok((fetched, self.tracing.dir().to_owned()))
    }
}

/// How long a process may take to start its in-process counter (a thread must reach a safe
/// point of the eval loop) before it is counted with uprobes instead.
const INPROC_WAIT: Duration = Duration::from_millis(200);

/// 12 hex digits from the kernel's random pool.
fn new_id() -> String {
    let mut bytes = [0u8; 6];
    // SAFETY: getrandom writes at most `len` bytes into the buffer we own.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != 6 {
        // getrandom cannot fail for 6 bytes once the pool is initialised; fall back to time.
        bytes.copy_from_slice(&crate::clock::unix_ms().to_be_bytes()[2..]);
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
