//! The task that owns every session. The gRPC service sends it [`Command`]s through a
//! [`Handle`]; it also consumes process events from BPF and ends sessions on their timers.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use aya::maps::{MapData, RingBuf};
use tokio::{
    io::unix::AsyncFd,
    sync::{mpsc, oneshot, watch},
};
use tracer_common::{ProcEvent, PyCodeEvent, PROC_EVENT_EXEC, PROC_EVENT_EXIT, PROC_EVENT_FORK};
use tracer_proto::{target, EndReason, Mode, SessionInfo, SessionState, StartSessionRequest};

use super::{build_report, counting, native::NativeSession, python::Probes, Session};
mod ahead;
mod checks;
mod closing;
mod cuda;
mod metrics;
mod persist;
mod python;
use ahead::{counts_python, cuda_processes, python_processes, resolve_natives, Ahead};
use checks::{check_launched, inproc_candidate};

use crate::{
    access::Caller,
    bpf::{Bpf, ProbeSet},
    error::Error,
    native::{NativeTarget, ProbeLimits},
    perf, process,
    python::memory,
    report::Report,
    store::Store,
};

/// Longest session a client may ask for.
pub const MAX_DURATION_MS: u64 = 24 * 60 * 60 * 1000;
/// Running sessions at once, all modes together.
pub const MAX_RUNNING: usize = 256;

type Reply<T> = oneshot::Sender<Result<T, Error>>;

enum Command {
    /// A closing session's report, named and stored off the manager's task.
    Named {
        id: String,
        done: Box<closing::Done>,
    },
    /// The machine's interpreters, inspected at start off this task.
    Inspected(super::python::Inspected),
    Start {
        req: StartSessionRequest,
        caller: Caller,
        reply: Reply<SessionInfo>,
    },
    Stop {
        id: String,
        caller: Caller,
        reply: Reply<SessionInfo>,
    },
    Get {
        id: String,
        caller: Caller,
        reply: Reply<(SessionInfo, watch::Receiver<bool>)>,
    },
    List {
        caller: Caller,
        reply: Reply<Vec<SessionInfo>>,
    },
    Report {
        id: String,
        caller: Caller,
        reply: Reply<(Fetched, std::path::PathBuf)>,
    },
    Subscribe {
        id: String,
        caller: Caller,
        reply: Reply<Subscription>,
    },
    Delete {
        id: String,
        caller: Caller,
        reply: Reply<SessionInfo>,
    },
    Expire {
        id: String,
    },
    Metrics {
        reply: oneshot::Sender<String>,
    },
    Shutdown {
        reply: oneshot::Sender<()>,
    },
    /// The processes that map a CUDA library, found off the manager's task for the CUDA
    /// sessions on every process.
    CudaScanned(Vec<u32>),
    /// The processes that map a Python interpreter, found off the manager's task for the
    /// Python sessions on every process (see `sweep`).
    PythonScanned(Vec<u32>),
    /// A start whose slow preparations (see [`Ahead`]) were made off the manager's task.
    Ready {
        req: StartSessionRequest,
        caller: Caller,
        reply: Reply<SessionInfo>,
        ahead: Ahead,
    },
    /// A start whose `--uprobe` probes were attached off the manager's task.
    Attached(ahead::AttachedStart),
    /// A start whose interpreters' Python probes were attached off the manager's task.
    PythonAttached(ahead::PythonAttachedStart),
    /// A start whose target was asked to count in-process, off the manager's task.
    StartPrepared {
        req: StartSessionRequest,
        caller: Caller,
        reply: Reply<SessionInfo>,
        ahead: Ahead,
        prepared: Prepared,
    },
}

/// The in-process counter of a start's target, made before the session is: the session's
/// id, and the counter or why there is none.
struct Prepared {
    id: String,
    counter: Result<crate::python::inproc::Counter, String>,
}

/// A cheap, cloneable way to talk to the manager.
#[derive(Clone)]
pub struct Handle {
    tx: mpsc::Sender<Command>,
}

impl Handle {
    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, Error> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| Error::ShuttingDown)?;
        rx.await.map_err(|_| Error::ShuttingDown)?
    }

    pub async fn start(
        &self,
        req: StartSessionRequest,
        caller: Caller,
    ) -> Result<SessionInfo, Error> {
        self.call(|reply| Command::Start { req, caller, reply })
            .await
    }
    /// The Prometheus exposition text.
    pub async fn metrics(&self) -> String {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Command::Metrics { reply }).await.is_err() {
            return String::new();
        }
        rx.await.unwrap_or_default()
    }

    pub async fn stop(&self, id: String, caller: Caller) -> Result<SessionInfo, Error> {
        self.call(|reply| Command::Stop { id, caller, reply }).await
    }
    /// The session's state, and a receiver that turns `true` when it ends.
    pub async fn get(
        &self,
        id: String,
        caller: Caller,
    ) -> Result<(SessionInfo, watch::Receiver<bool>), Error> {
        self.call(|reply| Command::Get { id, caller, reply }).await
    }
    pub async fn list(&self, caller: Caller) -> Result<Vec<SessionInfo>, Error> {
        self.call(|reply| Command::List { caller, reply }).await
    }
    pub async fn delete(&self, id: String, caller: Caller) -> Result<SessionInfo, Error> {
        self.call(|reply| Command::Delete { id, caller, reply })
            .await
    }

    /// A finished session's report. A stored one is parsed here, in the caller's task (on a
    /// blocking thread: a large profile's JSON takes a while), not in the manager's.
    pub async fn report(&self, id: String, caller: Caller) -> Result<Report, Error> {
        let (fetched, traces) = self
            .call(|reply| Command::Report {
                id: id.clone(),
                caller,
                reply,
            })
            .await?;
        let mut report = match fetched {
            Fetched::Parsed(r) => *r,
            // Read and parsed here: a large report takes the manager's task no time.
            Fetched::Stored(store) => {
                let key = id.clone();
                let json = tokio::task::spawn_blocking(move || {
                    store
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .report(&key)
                        .map(|json| json.map(|j| Report::from_json(&j)))
                })
                .await
                .map_err(|e| Error::io("reading a stored report", std::io::Error::other(e)))??;
                json.ok_or_else(|| Error::NoSuchSession { id: id.clone() })?
                    .map_err(|e| Error::io(format!("stored report of {id}"), e.into()))?
            }
        };
        if let Some(t) = report.trace.as_mut() {
            t.path = traces.join(&t.file);
        }
        Ok(report)
    }
    /// A running tracing session's events from now on.
    pub async fn subscribe(&self, id: String, caller: Caller) -> Result<Subscription, Error> {
        self.call(|reply| Command::Subscribe { id, caller, reply })
            .await
    }
    /// Ends every running session (their reports are kept) and stops the manager.
    pub async fn shutdown(&self) {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Command::Shutdown { reply }).await.is_ok() {
            let _ = rx.await;
        }
    }
}

/// What a live watcher of a tracing session needs: its events, and their names.
pub struct Subscription {
    pub events: tokio::sync::broadcast::Receiver<std::sync::Arc<super::tracing::Batch>>,
    /// Number of the first event the receiver will see.
    pub next_seq: u64,
    pub names: super::trace_session::Names,
    pub probes: std::sync::Arc<Vec<String>>,
    pub counters: Vec<crate::report::trace::TraceCounter>,
}

/// A report as the manager hands it out: the one in memory, or the stored JSON, which the
/// caller's task parses.
pub enum Fetched {
    Parsed(Box<Report>),
    /// In the store: read by the caller, off the manager's task.
    Stored(SharedStore),
}

/// The store, shared with the tasks that read reports out of it.
pub type SharedStore = std::sync::Arc<std::sync::Mutex<Store>>;

pub struct Manager {
    probe_limits: ProbeLimits,
    running: HashMap<String, Session>,
    /// Ended sessions whose profile is being named (`closing`).
    closing: HashMap<String, closing::Closing>,
    /// Sessions end in place during shutdown.
    shutting_down: bool,
    finished: HashMap<String, SessionInfo>,
    /// Reports of ended sessions not in the store (yet): served from memory, and stored once
    /// the store takes writes again.
    unsaved: HashMap<String, Report>,
    /// Final counts of exported sessions that ended lately, for the Prometheus endpoint.
    exported: HashMap<String, metrics::Ended>,
    store: SharedStore,
    bpf: Bpf,
    py: Probes,
    sampling: super::sampling::Sampling,
    tracing: super::tracing::Tracing,
    slots: super::slots::Slots,
    tx: mpsc::Sender<Command>,
    /// Slots whose ended session's probes are now gone (see `release`).
    detached: mpsc::UnboundedSender<u8>,
    /// A scan for processes that map CUDA is under way (`CudaScanned`).
    cuda_scanning: bool,
    /// A scan for processes that map Python is under way (`PythonScanned`).
    python_scanning: bool,
    /// Native probes being attached off this task for starts not answered yet, by uid
    /// (counted against the user's limit as if held).
    attaching: HashMap<u32, usize>,
    /// Starts waiting for the Python probes another start attaches (`PythonAttached`).
    python_waiting: Vec<ahead::WaitingStart>,
    /// Starts whose Python probes were attached ahead and that have not started or failed
    /// yet: no other start's failure may take those probes off meanwhile.
    python_starts: usize,
}

type CodeRing = AsyncFd<RingBuf<MapData>>;

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
        let persist::Recovered { finished, unsaved } = persist::recover(&mut store, &traces)?;
        let (proc_tx, proc_rx) = mpsc::unbounded_channel();
        let (detached, detached_rx) = mpsc::unbounded_channel();
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
        let manager = Manager {
            probe_limits,
            running: HashMap::new(),
            closing: HashMap::new(),
            shutting_down: false,
            finished,
            unsaved,
            exported: HashMap::new(),
            store: std::sync::Arc::new(std::sync::Mutex::new(store)),
            bpf,
            py: Probes::new(interpreters.clone()),
            sampling,
            tracing,
            slots: super::slots::Slots::default(),
            tx: tx.clone(),
            detached,
            cuda_scanning: false,
            python_scanning: false,
            attaching: HashMap::new(),
            python_waiting: Vec::new(),
            python_starts: 0,
        };
        let ahead = tx.clone();
        tokio::task::spawn_blocking(move || {
            let found = super::python::Inspected::read(&interpreters);
            let _ = ahead.blocking_send(Command::Inspected(found));
        });
        let task = tokio::spawn(manager.run(rx, proc_rx, detached_rx, codes, kernel_names));
        Ok((Handle { tx }, task))
    }

    async fn run(
        mut self,
        mut rx: mpsc::Receiver<Command>,
        mut proc_rx: mpsc::UnboundedReceiver<ProcEvent>,
        mut detached_rx: mpsc::UnboundedReceiver<u8>,
        mut codes: CodeRing,
        mut kernel_names: CodeRing,
    ) {
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
                cmd = rx.recv() => {
                    // Names first: a session that ends now must have every name it was sent.
                    self.drain_codes(codes.get_mut());
                    self.drain_kernel_names(kernel_names.get_mut());
                    match cmd {
                    Some(Command::Shutdown { reply }) => {
                        self.shutting_down = true;
                        let ids: Vec<String> = self.running.keys().cloned().collect();
                        for id in ids {
                            self.finish(&id, EndReason::DaemonShutdown, None);
                        }
                        // Reports being named and stored when the shutdown came are waited for.
                        while !self.closing.is_empty() {
                            match rx.recv().await {
                                Some(Command::Named { id, done }) => self.named(&id, *done),
                                Some(_) => {}
                                None => break,
                            }
                        }
                        self.save_unsaved();
                        let _ = reply.send(());
                        return;
                    }
                    Some(cmd) => self.handle(cmd),
                    None => return,
                }},
                Some(slot) = detached_rx.recv() => self.free_slot(slot),
                Some(ev) = proc_rx.recv() => {
                    self.drain_codes(codes.get_mut());
                    self.drain_kernel_names(kernel_names.get_mut());
                    self.on_proc_event(ev);
                }
                _ = sweep.tick() => {
                    self.drain_codes(codes.get_mut());
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

    fn drain_codes(&mut self, ring: &mut RingBuf<MapData>) {
        while let Some(item) = ring.next() {
            if item.len() < std::mem::size_of::<PyCodeEvent>() {
                continue;
            }
            // SAFETY: written as a PyCodeEvent by the BPF side; read unaligned.
            let ev = unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<PyCodeEvent>()) };
            let slot = ev.slot;
            let Some(s) = self
                .running
                .values_mut()
                .find(|s| s.slot.is_some_and(|x| u32::from(x) == slot))
            else {
                continue;
            };
            if let Some(py) = s.python.as_mut() {
                py.on_code(&ev, &self.py);
                if let (Some(t), Some((q, f, line))) =
                    (&s.trace, py.name(ev.pid, ev.code, ev.names))
                {
                    let function = crate::report::trace::TraceFunction {
                        pid: ev.pid,
                        code: ev.code,
                        names: ev.names,
                        qualname: q.to_owned(),
                        filename: f.to_owned(),
                        firstlineno: line,
                    };
                    t.names
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert((ev.pid, ev.code, ev.names), function);
                }
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Start { req, caller, reply } => self.prepare(req, caller, reply),
            Command::Ready {
                req,
                caller,
                reply,
                ahead,
            } => self.ready(req, caller, reply, ahead),
            Command::Attached(start) => self.attached(start),
            Command::PythonAttached(start) => self.python_attached(start),
            Command::CudaScanned(pids) => {
                self.cuda_scanning = false;
                self.look_for_cuda(false, Some(&pids));
            }
            Command::PythonScanned(pids) => self.python_scanned(&pids),
            Command::StartPrepared {
                req,
                caller,
                reply,
                ahead,
                prepared,
            } => {
                let mut prepared = Some(prepared);
                let _ = reply.send(self.start(req, caller, ahead, &mut prepared));
                // Refused after all (bad options, no slot): the counter goes again.
                if let Some(Prepared { counter: Ok(c), .. }) = prepared {
                    std::thread::spawn(move || c.finish());
                }
            }
            Command::Named { id, done } => self.named(&id, *done),
            Command::Inspected(found) => self.py.add_inspected(found),
            Command::Stop { id, caller, reply } => match self.stop(&id, caller) {
                Ok(None) => {
                    if let Some(c) = self.closing.get_mut(&id) {
                        c.stops.push(reply);
                    }
                }
                done => {
                    let _ = reply.send(done.map(|info| info.expect("answered")));
                }
            },
            Command::Get { id, caller, reply } => {
                let _ = reply.send(self.get(&id, caller));
            }
            Command::List { caller, reply } => {
                let losses = self.bpf.losses();
                let bpf = &self.bpf;
                let mut all: Vec<SessionInfo> = self
                    .running
                    .values_mut()
                    .map(|s| s.info(&super::scoped_losses(bpf, s.owner_uid, s.slot, &losses)))
                    .collect();
                all.extend(self.closing.values().map(|c| c.shown.clone()));
                all.extend(self.finished.values().cloned());
                all.retain(|s| caller.sees(s.owner_uid));
                all.sort_by(|a, b| {
                    b.started_unix_ms
                        .cmp(&a.started_unix_ms)
                        .then(a.id.cmp(&b.id))
                });
                let _ = reply.send(Ok(all));
            }
            Command::Report { id, caller, reply } => {
                let _ = reply.send(self.report(&id, caller));
            }
            Command::Subscribe { id, caller, reply } => {
                let _ = reply.send(self.subscribe(&id, caller));
            }
            Command::Delete { id, caller, reply } => {
                let _ = reply.send(self.delete(&id, caller));
            }
            Command::Expire { id } => self.finish(&id, EndReason::Duration, None),
            Command::Metrics { reply } => {
                let _ = reply.send(self.metrics());
            }
            Command::Shutdown { .. } => unreachable!("handled in run"),
        }
    }

    /// A start made ready ahead: counting in-process is tried first where it may replace the
    /// probes.
    fn begin(
        &mut self,
        req: StartSessionRequest,
        caller: Caller,
        reply: Reply<SessionInfo>,
        ahead: Ahead,
    ) {
        match inproc_candidate(&req, &caller) {
            // Waiting for the process to reach a safe point (up to INPROC_WAIT) must not
            // hold up other requests: the attempt runs on a blocking thread and the start
            // comes back as StartPrepared.
            Some(pid) => {
                let tx = self.tx.clone();
                let id = new_id();
                tokio::task::spawn_blocking(move || {
                    let counter = crate::python::inproc::start(pid, &id, INPROC_WAIT);
                    let prepared = Prepared { id, counter };
                    let cmd = Command::StartPrepared {
                        req,
                        caller,
                        reply,
                        ahead,
                        prepared,
                    };
                    if let Err(mpsc::error::SendError(Command::StartPrepared {
                        prepared: Prepared { counter: Ok(c), .. },
                        ..
                    })) = tx.blocking_send(cmd)
                    {
                        c.finish();
                    }
                });
            }
            None => {
                let _ = reply.send(self.start(req, caller, ahead, &mut None));
            }
        }
    }

    /// `ahead`: what was made ready off this task; `prepared`: the target's in-process counter,
    /// made before (taken when the session uses it).
    fn start(
        &mut self,
        req: StartSessionRequest,
        caller: Caller,
        mut ahead: Ahead,
        prepared: &mut Option<Prepared>,
    ) -> Result<SessionInfo, Error> {
        let mut attached = ahead.attached.take();
        let python_ahead = ahead.python_ahead;
        let started = self.start_with(req, caller, ahead, &mut attached, prepared);
        if let Some(ahead::Attached { slot, mut native }) = attached {
            // Refused before the slot was used: its probes come off, the slot after them.
            self.release_after(Some(slot), vec![native.take_probes()]);
        }
        self.python_start_done(python_ahead, started.is_err());
        started
    }

    /// `attached`: `--uprobe` probes attached ahead, in their slot; taken once the session
    /// uses the slot (every refusal after that releases both).
    fn start_with(
        &mut self,
        req: StartSessionRequest,
        caller: Caller,
        ahead: Ahead,
        attached: &mut Option<ahead::Attached>,
        prepared: &mut Option<Prepared>,
    ) -> Result<SessionInfo, Error> {
        let checks::Asked {
            mode,
            frequency,
            push,
            trace_limits,
            duration_ms,
            target,
            options,
            python,
            specs,
        } = checks::asked(req)?;
        let sampling = mode == Mode::Sampling;
        let trace_mode = mode == Mode::Tracing;
        if self.running.len() >= MAX_RUNNING {
            return Err(Error::ResourceExhausted(format!(
                "{MAX_RUNNING} sessions are running already"
            )));
        }
        let (scope, pid) = match target.kind {
            Some(target::Kind::Pid(0)) | None => {
                return Err(Error::InvalidArgument(
                    "a target is required: a pid, or all".into(),
                ))
            }
            Some(target::Kind::All(false)) => {
                return Err(Error::InvalidArgument(
                    "a target is required: a pid, or all = true (all = false names nothing)".into(),
                ))
            }
            Some(target::Kind::Pid(pid)) => {
                caller.may_trace_pid(pid)?;
                if !process::alive(pid) {
                    return Err(Error::NoSuchProcess { pid });
                }
                if target.launched {
                    check_launched(pid, &caller)?;
                }
                let tids = process::threads(pid).map_err(|_| Error::NoSuchProcess { pid })?;
                crate::container::note(pid, true);
                (
                    perf::Scope::Threads {
                        tids,
                        on_exec: target.launched,
                    },
                    Some(pid),
                )
            }
            Some(target::Kind::All(true)) => {
                if target.launched {
                    return Err(Error::InvalidArgument(
                        "launched is for a pid tracerctl started, not a system-wide session".into(),
                    ));
                }
                caller.may_trace_all()?;
                (
                    perf::Scope::Cpus(
                        perf::online_cpus().map_err(|e| Error::io("listing online CPUs", e))?,
                    ),
                    None,
                )
            }
        };
        let owner_uid = caller.acting_uid("starting a session")?;

        // A launched target has not exec'd yet: its mappings are tracerctl's.
        let maps_of = pid.filter(|_| !target.launched);
        let Ahead {
            natives,
            cuda_pids,
            python_pids,
            ..
        } = ahead;
        let natives = match (attached.is_some(), natives) {
            (true, _) => Vec::new(),
            (false, Some(resolved)) => resolved?,
            (false, None) => resolve_natives(&options.uprobes, maps_of, owner_uid)?,
        };
        self.check_native_limits(&natives, owner_uid)?;

        let slot = if let Some(a) = attached.as_ref() {
            // From here on, a refusal releases the probes with the slot (`abandon`).
            Some(a.slot)
        } else if sampling
            || trace_mode
            || pid.is_some()
            || python
            || options.cuda
            || !natives.is_empty()
        {
            Some(self.slots.take(owner_uid, python)?)
        } else {
            None
        };
        if let (Some(pid), Some(slot)) = (pid, slot) {
            if let Err(e) = self.bpf.follow(pid, slot) {
                self.abandon(Some(slot), attached);
                return Err(e.into());
            }
        }
        let loss_base = super::scoped_losses(&self.bpf, owner_uid, slot, &self.bpf.losses());
        // Sampling sessions count nothing.
        let counting = match (!sampling)
            .then(|| counting::Counting::open(&specs, &scope, pid))
            .transpose()
        {
            Ok(c) => c,
            Err(e) => {
                self.abandon(slot, attached);
                return Err(e);
            }
        };
        // Followed first, checked after: an exit from here on arrives as an event.
        if let Some(pid) = pid.filter(|&p| !process::alive(p)) {
            self.abandon(slot, attached);
            return Err(Error::NoSuchProcess { pid });
        }
        let sampler = match (frequency, slot) {
            (Some(hz), Some(slot)) => match self.start_sampler(slot, pid, hz, owner_uid) {
                Ok(s) => Some(s),
                Err(e) => {
                    self.abandon(Some(slot), attached);
                    return Err(e);
                }
            },
            _ => None,
        };
        if let (true, Some(slot)) = (options.cuda_stacks, slot) {
            // Launch stacks go through the sampling ring and worker, one sample a launch.
            self.sampling.add(
                slot,
                0,
                super::cuda::LAUNCH_STACKS,
                pid.into_iter().collect(),
                process::kernel_addresses_for(owner_uid),
            );
        }
        let id = prepared.as_ref().map_or_else(new_id, |p| p.id.clone());
        // In-process counting replaces the probes only where they would count calls alone.
        let inproc = match (mode, slot) {
            _ if options.python_uprobes_only => {
                Err("--python-uprobes-only asked for uprobes".into())
            }
            (Mode::Counting, Some(slot)) => match prepared.take() {
                Some(p) => p.counter.map(|c| (slot, c)),
                None => Err("not a running process the caller may trace".into()),
            },
            _ => Err("tracing sessions time every call with the probes".into()),
        };
        let python = if python {
            match self.start_python(pid, target.launched, inproc, python_pids) {
                Ok(py) => Some(py),
                Err(e) => {
                    self.abandon(slot, attached);
                    return Err(e);
                }
            }
        } else {
            None
        };
        let native = match (attached.take(), slot.filter(|_| !natives.is_empty())) {
            (Some(a), _) => Some(a.native),
            (None, None) => None,
            (None, Some(slot)) => {
                let attacher = self.bpf.native_attacher();
                match NativeSession::attach(&attacher, natives, slot, pid.is_none()) {
                    Ok(n) => Some(n),
                    Err(e) => {
                        self.abandon(Some(slot), attached);
                        return Err(e);
                    }
                }
            }
        };

        // Before the start is answered: loading them when the first library is mapped would
        // let the program run seconds ahead of its probes.
        if options.cuda {
            if let Err(e) = self.bpf.load_cuda() {
                tracing::warn!(%e, "loading the CUDA probes (tried again at the first library)");
            }
        }
        let trace = match (trace_limits, slot) {
            (Some((limits, interval)), Some(slot)) => match self.tracing.add(slot, &id, limits) {
                Ok(spool) => {
                    let probes = native
                        .as_ref()
                        .map(NativeSession::labels)
                        .unwrap_or_default();
                    let counter_pid = pid.unwrap_or(0);
                    Some(super::trace_session::TraceSession::new(
                        spool,
                        &id,
                        probes,
                        interval,
                        counter_pid,
                    ))
                }
                Err(e) => {
                    let probes = native.map(|mut n| n.take_probes());
                    self.release_after(Some(slot), probes.into_iter().collect());
                    return Err(Error::io("creating the trace file", e));
                }
            },
            _ => None,
        };
        let (ended, _) = watch::channel(false);
        let expiry = (duration_ms > 0).then(|| {
            let tx = self.tx.clone();
            let id = id.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(duration_ms)).await;
                let _ = tx.send(Command::Expire { id }).await;
            })
        });
        let gpu_tracks = trace
            .as_ref()
            .map(super::trace_session::TraceSession::gpu_tracks);
        let mut session = Session {
            id: id.clone(),
            mode,
            target,
            duration_ms,
            owner_uid,
            started_by: caller.describe(),
            started: Instant::now(),
            started_unix_ms: crate::clock::unix_ms(),
            slot,
            live: pid.into_iter().collect(),
            followed: u32::from(pid.is_some()),
            unfollowed: Vec::new(),
            exited: 0,
            proc_events: 0,
            forks_at_start: pid.is_none().then(process::forks_since_boot).flatten(),
            counting,
            python,
            native,
            sampler,
            trace,
            cuda: slot.filter(|_| options.cuda).map(|slot| {
                let period = match options.gpu_period_ms {
                    0 => super::cuda::GPU_PERIOD,
                    ms => Duration::from_millis(u64::from(ms)),
                };
                super::cuda::CudaSession::new(
                    slot,
                    pid.is_none(),
                    super::cuda::Probing {
                        stacks: options.cuda_stacks,
                        driver_only: options.cuda_driver_only,
                    },
                    period,
                    gpu_tracks,
                )
            }),
            loss_base,
            command: pid.filter(|_| !target.launched).and_then(process::comm),
            export_prometheus: options.export_prometheus,
            continuous: match (push, slot) {
                (Some((endpoint, period)), Some(slot)) => Some(crate::continuous::Running::start(
                    endpoint,
                    period,
                    self.sampling.windows(),
                    slot,
                    id.clone(),
                )),
                _ => None,
            },
            ended,
            expiry,
        };
        let info = session.info(&loss_base);
        let record = persist::running_report(&info, session.trace.as_ref());
        self.running.insert(id.clone(), session);
        // Recorded as running, so that a daemon killed now leaves it behind as failed: a
        // session that could not be recorded does not start.
        let stored = self.store().put(&info, &record);
        if let Err(e) = stored {
            // Nothing of it is kept: its report is neither named nor stored.
            drop(self.end(&id, EndReason::Error, Some(e.to_string())));
            self.discard(&id);
            return Err(e.into());
        }
        tracing::info!(id, target = %super::target_label(Some(&target)), uid = owner_uid, by = %caller.describe(), "session started");
        self.update_python_masks();
        if options.cuda {
            self.update_cuda_masks();
            self.look_for_cuda(true, cuda_pids.as_deref());
        }
        if trace_mode {
            self.update_trace_masks();
            if let Some(t) = self.running.get_mut(&id).and_then(|s| s.trace.as_mut()) {
                // Calls that started before this are not the session's own.
                t.start_ns = crate::clock::monotonic_ns();
            }
            self.read_trace_counters(true);
        }
        Ok(info)
    }

    /// Tells the probes which slots are tracing.
    fn update_trace_masks(&mut self) {
        let mask = self
            .running
            .values()
            .filter(|s| s.trace.is_some())
            .filter_map(|s| s.slot)
            .fold(0u64, |m, slot| m | 1 << slot);
        if let Err(e) = self.bpf.set_tracing_sessions(mask) {
            tracing::error!(%e, "updating tracing session masks");
        }
    }

    /// Tracing sessions' perf counter readings, for those whose period has come (all: `force`).
    fn read_trace_counters(&mut self, force: bool) {
        for s in self.running.values_mut() {
            let (Some(t), Some(c)) = (s.trace.as_mut(), s.counting.as_mut()) else {
                continue;
            };
            if c.is_empty() {
                continue;
            }
            t.read_counters(|| c.read(), force);
        }
    }

    fn subscribe(&mut self, id: &str, caller: Caller) -> Result<Subscription, Error> {
        caller.may_read(self.owner(id)?, id)?;
        let Some(t) = self.running.get(id).and_then(|s| s.trace.as_ref()) else {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is not a running tracing session"
            )));
        };
        let (events, next_seq) = super::tracing::locked(&t.spool).subscribe();
        Ok(Subscription {
            events,
            next_seq,
            names: t.names.clone(),
            probes: t.probes.clone(),
            counters: t.counters.snapshot(),
        })
    }

    /// Starts a sampling session's perf events and its histogram.
    fn start_sampler(
        &mut self,
        slot: u8,
        pid: Option<u32>,
        hz: u64,
        owner_uid: u32,
    ) -> Result<crate::sampler::Sampler, Error> {
        let program = self.bpf.sample_program()?;
        let sampler = crate::sampler::Sampler::start(
            std::os::fd::AsFd::as_fd(&program),
            slot,
            pid.is_none(),
            hz,
        )?;
        let pids = pid.map_or_else(all_pids, |p| vec![p]);
        self.sampling.add(
            slot,
            hz,
            sampler.event,
            pids,
            process::kernel_addresses_for(owner_uid),
        );
        Ok(sampler)
    }

    /// Refuses `--uprobe` `targets` (one probe per function) beyond the caps: a session's,
    /// and what `uid`'s running sessions hold already.
    fn check_native_limits(&self, targets: &[NativeTarget], uid: u32) -> Result<(), Error> {
        let limits = self.probe_limits;
        if targets.len() > limits.per_session {
            return Err(Error::InvalidArgument(format!(
                "--uprobe names {} functions (duplicates merged); at most {} a session",
                targets.len(),
                limits.per_session
            )));
        }
        let held: usize = self
            .running
            .values()
            .filter(|s| s.owner_uid == uid)
            .filter_map(|s| s.native.as_ref())
            .map(NativeSession::probes)
            .sum::<usize>()
            + self.attaching.get(&uid).copied().unwrap_or(0);
        if !targets.is_empty() && held + targets.len() > limits.per_user {
            return Err(Error::ResourceExhausted(format!(
                "uid {uid} holds {held} native probes in running sessions; {} more would pass the {} a user may hold (stop a session first)",
                targets.len(),
                limits.per_user
            )));
        }
        Ok(())
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
            self.slots.free(slot);
            return;
        }
        let detached = self.detached.clone();
        crate::bpf::release(probes, move || {
            let _ = detached.send(slot);
        });
    }

    /// A slot whose session's probes are gone: what they counted since the session ended
    /// is dropped, and the slot taken again.
    fn free_slot(&mut self, slot: u8) {
        self.bpf.native_counts(slot, true);
        self.bpf.cuda_counts(slot, true);
        self.bpf.gpu_kernel_times(slot, true);
        self.slots.free(slot);
    }

    /// The session's final state, or None while its profile is named (answered then).
    fn stop(&mut self, id: &str, caller: Caller) -> Result<Option<SessionInfo>, Error> {
        let owner = self.owner(id)?;
        caller.may_stop(owner, id)?;
        if self.running.contains_key(id) {
            self.finish(id, EndReason::Stopped, None);
        }
        if self.closing.contains_key(id) {
            return Ok(None);
        }
        Ok(Some(self.finished[id].clone()))
    }

    fn owner(&self, id: &str) -> Result<u32, Error> {
        self.running
            .get(id)
            .map(|s| s.owner_uid)
            .or_else(|| self.closing.get(id).map(|c| c.shown.owner_uid))
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
        if let Some(c) = self.closing.get(id) {
            return Ok((c.shown.clone(), c.ended.subscribe()));
        }
        let (_, rx) = watch::channel(true);
        Ok((self.finished[id].clone(), rx))
    }

    /// Forgets a finished session: state, report, trace file.
    fn delete(&mut self, id: &str, caller: Caller) -> Result<SessionInfo, Error> {
        let owner = self.owner(id)?;
        caller.may_stop(owner, id)?;
        if self.running.contains_key(id) {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is running: stop it first"
            )));
        }
        if self.closing.contains_key(id) {
            return Err(Error::FailedPrecondition(format!(
                "session {id} is ending: its profile is being named"
            )));
        }
        // The trace first: on a full disk, its space is what lets the store write again. If the
        // store cannot, the session stays listed, to be deleted again.
        self.remove_trace(id);
        self.store().delete(id)?;
        self.unsaved.remove(id);
        self.exported.remove(id);
        tracing::info!(id, "session deleted");
        let info = self
            .finished
            .remove(id)
            .ok_or_else(|| Error::NoSuchSession { id: id.into() });
        self.release_free_memory();
        info
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

    /// The store, for the manager's writes (a reader may hold it for the milliseconds a
    /// report takes to read).
    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A finished session's report (or the store that holds it), and where its trace files
    /// are.
    fn report(&mut self, id: &str, caller: Caller) -> Result<(Fetched, std::path::PathBuf), Error> {
        caller.may_read(self.owner(id)?, id)?;
        if self.running.contains_key(id) || self.closing.contains_key(id) {
            return Err(Error::StillRunning { id: id.into() });
        }
        let fetched = match self.unsaved.get(id) {
            Some(r) => Fetched::Parsed(Box::new(r.clone())),
            None => Fetched::Stored(self.store.clone()),
        };
        Ok((fetched, self.tracing.dir().to_owned()))
    }

    fn on_proc_event(&mut self, ev: ProcEvent) {
        let mut ended = Vec::new();
        let mut execs = Vec::new();
        let mut crossed = Vec::new();
        let mut exited_sampled = false;
        for s in self.running.values_mut().filter(|s| s.follows_pid()) {
            let Some(slot) = s.slot else { continue };
            if ev.sessions & (1 << slot) == 0 {
                continue;
            }
            s.proc_events += 1;
            let is_target = s.target.kind == Some(target::Kind::Pid(ev.pid));
            let comm = || {
                let len = ev
                    .comm
                    .iter()
                    .position(|&b| b == 0)
                    .unwrap_or(ev.comm.len());
                String::from_utf8_lossy(&ev.comm[..len]).into_owned()
            };
            // The target's name: what it exec'd (a launched target is tracerctl before), else
            // what it was at exit. Exits come from the last thread, which may have another name.
            if is_target
                && (ev.kind == PROC_EVENT_EXEC
                    || (ev.kind == PROC_EVENT_EXIT && s.command.is_none()))
            {
                s.command = Some(comm());
            }
            match ev.kind {
                PROC_EVENT_FORK if s.live.insert(ev.pid) => {
                    s.followed += 1;
                    crate::container::note(ev.pid, true);
                }
                PROC_EVENT_EXIT => {
                    if s.sampler.is_some() || s.cuda.is_some() {
                        exited_sampled = true;
                    }
                    if s.live.remove(&ev.pid) {
                        s.exited += 1;
                    }
                    if s.live.is_empty() {
                        ended.push(s.id.clone());
                    }
                }
                // Held at exec (EXEC_HOLD): the new program has not run yet.
                PROC_EVENT_EXEC if s.owner_uid != 0 => {
                    match crate::process::ptrace_boundary(ev.pid, s.owner_uid) {
                        Ok(Some(why)) => {
                            crossed.push((slot, why.clone()));
                            s.live.remove(&ev.pid);
                            s.unfollowed.push(format!(
                                "pid {} exec'd {}: {why}, so it is not traced, as the kernel would refuse ptrace",
                                ev.pid,
                                comm()
                            ));
                            if s.live.is_empty() {
                                ended.push(s.id.clone());
                            }
                        }
                        _ if s.python.is_some() => execs.push(s.id.clone()),
                        _ => {}
                    }
                }
                PROC_EVENT_EXEC if s.python.is_some() => execs.push(s.id.clone()),
                _ => {}
            }
        }
        for (slot, why) in crossed {
            if let Err(e) = self.bpf.unfollow(ev.pid, slot) {
                // Still followed: the process must not run on. It stays stopped; killing it
                // would change what the user ran.
                tracing::error!(%e, pid = ev.pid, %why, "cannot stop following a process that gained credentials; it stays stopped");
                return;
            }
        }
        if ev.kind == PROC_EVENT_EXEC {
            // Sessions counting Python everywhere hear of execs of `python…` programs.
            execs.extend(
                self.running
                    .values()
                    .filter(|s| !s.follows_pid() && s.python.is_some())
                    .filter(|s| s.slot.is_some_and(|slot| ev.sessions & (1 << slot) != 0))
                    .map(|s| s.id.clone()),
            );
        }
        for id in execs {
            self.check_session_process(&id, ev.pid, true);
        }
        if ev.kind == PROC_EVENT_EXEC {
            // The probe stopped it if a Python session follows it (EXEC_HOLD); continuing a
            // process that was not stopped does nothing, and a SIGCONT that comes before the
            // stop cancels it.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(ev.pid as i32),
                nix::sys::signal::Signal::SIGCONT,
            );
            self.bpf.continued(ev.pid);
        }
        if exited_sampled {
            self.sampling.exited(ev.pid);
        }
        for id in ended {
            self.finish(&id, EndReason::TargetExited, None);
        }
    }

    fn check_session_process(&mut self, id: &str, pid: u32, at_exec: bool) {
        let Some(mut py) = self.running.get_mut(id).and_then(|s| s.python.take()) else {
            return;
        };
        self.check_python_process(&mut py, pid, !at_exec, at_exec);
        if let Some(s) = self.running.get_mut(id) {
            s.python = Some(py);
        }
    }

    /// Backstop for exit events the kernel could not deliver (counted as losses): processes
    /// that are gone are treated as exited.
    fn sweep(&mut self) {
        let mut ended = Vec::new();
        for s in self
            .running
            .values_mut()
            .filter(|s| s.slot.is_some() && s.follows_pid())
        {
            let gone: Vec<u32> = s
                .live
                .iter()
                .copied()
                .filter(|&p| !process::alive(p))
                .collect();
            for pid in gone {
                s.live.remove(&pid);
                s.exited += 1;
            }
            if s.live.is_empty() {
                ended.push(s.id.clone());
            }
        }
        for id in ended {
            self.finish(&id, EndReason::TargetExited, None);
        }
        self.save_unsaved();
        // Python processes that appeared, or exec'd an interpreter, since the last look: a
        // session's own now, and for sessions on every process, those a scan of every
        // process's mappings off this task finds (`PythonScanned`).
        let ids: Vec<String> = self
            .running
            .iter()
            .filter(|(_, s)| s.python.is_some() && s.follows_pid())
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            let Some(s) = self.running.get(&id) else {
                continue;
            };
            let pids: Vec<u32> = s.live.iter().copied().collect();
            for pid in pids {
                self.check_session_process(&id, pid, false);
            }
        }
        let everyone = self
            .running
            .values()
            .any(|s| s.python.is_some() && !s.follows_pid());
        if everyone && !self.python_scanning {
            self.python_scanning = true;
            let tx = self.tx.clone();
            tokio::task::spawn_blocking(move || {
                let _ = tx.blocking_send(Command::PythonScanned(python_processes()));
            });
        }
    }
}

/// How long a process may take to start its in-process counter (a thread must reach a safe
/// point of the eval loop) before it is counted with uprobes instead.
const INPROC_WAIT: Duration = Duration::from_millis(1000);

/// Identity of the executable a process runs now (changes on exec).
fn exe_id(pid: u32) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/exe")).map_or((0, 0), |m| (m.dev(), m.ino()))
}

fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

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
