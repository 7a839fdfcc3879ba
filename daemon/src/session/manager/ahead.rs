//! What a start prepares off the manager's task before it runs there: probe programs the
//! verifier takes seconds over, `--uprobe` patterns matched against symbol tables and then
//! attached, and the processes a session on every process finds mapping CUDA or Python
//! (which the manager also has rescanned this way while such sessions run).

use tracer_proto::{target, CountingOptions, Mode, SessionInfo, StartSessionRequest};

use super::{Done, Manager, Reply};
use crate::{
    access::Caller,
    error::Error,
    session::{
        native::NativeSession,
        python::watch::{self, FoundPython},
    },
};
use tracer_inspect::native::NativeTarget;
use tracer_inspect::python::memory;

/// What a start needs that can take long, done on a blocking thread before the start runs on
/// the manager: probe programs the kernel's verifier takes seconds over (a first Python or
/// CUDA session), `--uprobe` patterns matched against symbol tables (tens of ms for a large
/// binary, more for libraries the size of libtorch's), and for sessions on every process,
/// which processes map CUDA or Python.
#[derive(Default)]
pub(super) struct Ahead {
    /// The `--uprobe` functions, resolved for the start's caller and target.
    pub(super) natives: Option<Result<Vec<NativeTarget>, Error>>,
    /// For a CUDA session on every process: the processes that map a CUDA library now
    /// (reading every process's mappings takes ~100 ms with 1,500 processes).
    pub(super) cuda_pids: Option<Vec<u32>>,
    /// For a Python session on every process: the processes that map an interpreter now.
    pub(super) python_found: Option<Vec<FoundPython>>,
    /// The interpreters a Python session's target maps (every process's, for one on every
    /// process), attached off the manager's task before the start runs.
    pub(super) python_paths: Vec<std::path::PathBuf>,
    /// The start's interpreters were looked at for attaching ahead (once).
    pub(super) python_ahead: bool,
    /// The `--uprobe` functions' probes, attached (see [`Manager::ready`]).
    pub(super) attached: Option<Attached>,
}

/// A start's `--uprobe` probes, attached off the manager's task in the slot taken for them.
pub(super) struct Attached {
    pub(super) slot: u8,
    pub(super) native: NativeSession,
}

/// A start waiting for the Python probes another start attaches.
pub(super) struct WaitingStart {
    req: StartSessionRequest,
    caller: Caller,
    reply: Reply<SessionInfo>,
    ahead: Ahead,
}

/// A start back from attaching its interpreters' Python probes.
pub(super) struct PythonAttachedStart {
    req: StartSessionRequest,
    caller: Caller,
    reply: Reply<SessionInfo>,
    ahead: Ahead,
    attached: crate::session::python::AttachedPython,
}

/// A start back from attaching its `--uprobe` probes in `slot` (taken for it, with `probes`
/// counted against `uid`'s limit meanwhile).
pub(super) struct AttachedStart {
    req: StartSessionRequest,
    caller: Caller,
    reply: Reply<SessionInfo>,
    ahead: Ahead,
    slot: u8,
    uid: u32,
    probes: usize,
    native: Result<NativeSession, Error>,
}

impl Manager {
    /// Starts `req` at once, or first makes ready on a blocking thread what would hold up
    /// the manager; the start then comes back as `Ready`.
    pub(super) fn prepare(
        &mut self,
        req: StartSessionRequest,
        caller: Caller,
        reply: Reply<SessionInfo>,
    ) {
        let asks = asks(&req);
        // The probe programs it needs that are not loaded yet (see [`Bpf::to_load`]).
        let loading = asks.as_ref().and_then(|a| {
            self.bpf
                .to_load(a.python, a.cuda, a.native, a.sampling, a.off_cpu)
        });
        let resolving = natives_to_resolve(&req, &caller);
        let scanning = asks.as_ref().is_some_and(|a| a.all && a.cuda);
        let python_all = asks.as_ref().is_some_and(|a| a.all && a.python);
        // A running process counted with uprobes: its interpreter, to attach ahead.
        let python_pid = match req
            .target
            .as_ref()
            .and_then(|t| t.kind.filter(|_| !t.launched))
        {
            Some(target::Kind::Pid(pid))
                if asks.as_ref().is_some_and(|a| a.python)
                    && super::checks::inproc_candidate(&req, &caller).is_none() =>
            {
                Some(pid)
            }
            _ => None,
        };
        if loading.is_none()
            && resolving.is_none()
            && !scanning
            && !python_all
            && python_pid.is_none()
        {
            // Still by way of `ready`: a launched program's interpreters are attached there.
            self.ready(req, caller, reply, Ahead::default());
            return;
        }
        let tx = self.done.clone();
        tokio::task::spawn_blocking(move || {
            // A program that would not load is tried again in place by the start,
            // which says why or goes on without it as it would have.
            if let Some(Err(e)) = loading.map(tracer_bpf::Loading::run) {
                tracing::warn!(%e, "loading probe programs ahead of a start");
            }
            let natives =
                resolving.map(|(specs, maps_of, uid)| resolve_natives(&specs, maps_of, uid));
            let cuda_pids = scanning.then(crate::session::cuda::watch::processes);
            let python_found = python_all.then(watch::processes);
            let mut python_paths: Vec<std::path::PathBuf> = python_found
                .iter()
                .flatten()
                .map(|f| f.mapped.path.clone())
                .chain(python_pid.and_then(memory::runtime_of).map(|m| m.path))
                .collect();
            python_paths.sort_unstable();
            python_paths.dedup();
            let ahead = Ahead {
                natives,
                cuda_pids,
                python_found,
                python_paths,
                python_ahead: false,
                attached: None,
            };
            let _ = tx.send(Done::Ready {
                req,
                caller,
                reply,
                ahead,
            });
        });
    }

    /// A start made ready ahead. Its interpreters' Python probes are attached first, then
    /// its `--uprobe` functions in a slot taken for them, each on a blocking thread: every
    /// process that maps a binary gets every breakpoint, and thousands of probes in a binary
    /// many busy processes map took seconds. The start comes back as `PythonAttached`, then
    /// `Attached`.
    pub(super) fn ready(
        &mut self,
        req: StartSessionRequest,
        caller: Caller,
        reply: Reply<SessionInfo>,
        mut ahead: Ahead,
    ) {
        // Back from `PythonAttached` (or from waiting for another start's), this runs again.
        let asked = asks(&req);
        if !ahead.python_ahead && asked.as_ref().is_some_and(|a| a.python) {
            let mut paths = ahead.python_paths.clone();
            // Counted in-process, a launched program needs none (unless that fails: the
            // start probes them then).
            let launched = req.target.as_ref().is_some_and(|t| t.launched)
                && super::checks::inproc_candidate(&req, &caller).is_none();
            if launched || asked.as_ref().is_some_and(|a| a.all) {
                // As the start does: a launched program may run any of them.
                paths.extend(self.py.known().iter().cloned());
            }
            let (job, busy) = self.py.to_attach(&paths);
            if job.is_none() && busy {
                // Being attached for another start: this one goes on once they are in.
                self.starts.python_waiting.push(WaitingStart {
                    req,
                    caller,
                    reply,
                    ahead,
                });
                return;
            }
            ahead.python_ahead = true;
            self.starts.python_ahead += 1;
            if let Some(job) = job {
                let attacher = self.bpf.python_attacher();
                let tx = self.done.clone();
                tokio::task::spawn_blocking(move || {
                    let attached = job.run(&attacher);
                    // A manager gone (shutdown) drops the probes here, off its task.
                    let _ = tx.send(Done::PythonAttached(PythonAttachedStart {
                        req,
                        caller,
                        reply,
                        ahead,
                        attached,
                    }));
                });
                return;
            }
        }
        let natives = match ahead.natives.take() {
            Some(Ok(n)) if !n.is_empty() => n,
            other => {
                ahead.natives = other;
                self.begin(req, caller, reply, ahead);
                return;
            }
        };
        // The start's other checks come after: these are the ones attaching needs first.
        let taken = caller.acting_uid("starting a session").and_then(|uid| {
            self.check_native_limits(&natives, uid)?;
            let python = asked.as_ref().is_some_and(|a| a.python);
            Ok((uid, self.slots.take(uid, python)?))
        });
        let (uid, slot) = match taken {
            Ok(t) => t,
            Err(e) => {
                self.python_start_done(ahead.python_ahead, true);
                let _ = reply.send(Err(e));
                return;
            }
        };
        let probes = natives.len();
        *self.starts.attaching.entry(uid).or_default() += probes;
        let all = asked.as_ref().is_some_and(|a| a.all);
        let attacher = self.bpf.native_attacher();
        let tx = self.done.clone();
        tokio::task::spawn_blocking(move || {
            let native = NativeSession::attach(&attacher, natives, slot, all);
            // A manager gone (shutdown) drops the probes here, off its task.
            let _ = tx.send(Done::Attached(AttachedStart {
                req,
                caller,
                reply,
                ahead,
                slot,
                uid,
                probes,
                native,
            }));
        });
    }

    /// The start goes on with its interpreters' probes in (those that failed are tried
    /// again by the start, which says why).
    pub(super) fn python_attached(&mut self, start: PythonAttachedStart) {
        let PythonAttachedStart {
            req,
            caller,
            reply,
            ahead,
            attached,
        } = start;
        self.py.adopt(attached);
        self.ready(req, caller, reply, ahead);
        self.python_probes_in();
    }

    /// Python probes attached off this task are in (`adopt`ed): starts and checks that
    /// waited for them go on.
    pub(super) fn python_probes_in(&mut self) {
        for w in std::mem::take(&mut self.starts.python_waiting) {
            self.ready(w.req, w.caller, w.reply, w.ahead);
        }
        self.recheck_late();
        self.handovers_probed();
    }

    /// The start goes on with its probes attached, or fails with why they were not.
    pub(super) fn attached(&mut self, start: AttachedStart) {
        let AttachedStart {
            req,
            caller,
            reply,
            mut ahead,
            slot,
            uid,
            probes,
            native,
        } = start;
        if let Some(n) = self.starts.attaching.get_mut(&uid) {
            *n = n.saturating_sub(probes);
        }
        self.starts.attaching.retain(|_, n| *n > 0);
        match native {
            Ok(native) => {
                ahead.attached = Some(Attached { slot, native });
                self.begin(req, caller, reply, ahead);
            }
            Err(e) => {
                self.release(Some(slot));
                self.python_start_done(ahead.python_ahead, true);
                let _ = reply.send(Err(e));
            }
        }
    }
}

/// Whether a session of `mode` with `options` follows Python calls: tracing with no source
/// named traces them.
pub(super) fn counts_python(mode: Mode, options: &CountingOptions) -> bool {
    options.python
        || mode == Mode::Tracing
            && options.uprobes.is_empty()
            && options.events.is_empty()
            && !options.cuda
}

/// The functions `--uprobe` `specs` name, in the binaries `maps_of` maps (else the paths
/// given), as `uid` may read them (0: any).
pub(super) fn resolve_natives(
    specs: &[String],
    maps_of: Option<u32>,
    uid: u32,
) -> Result<Vec<NativeTarget>, Error> {
    use tracer_inspect::native::{self, MAX_SPECS};
    let specs = native::distinct_specs(specs);
    if specs.len() > MAX_SPECS {
        return Err(Error::InvalidArgument(format!(
            "{} different --uprobe specs; at most {MAX_SPECS} a session (a pattern such as libc:'str*' names many functions in one)",
            specs.len()
        )));
    }
    let mut targets = Vec::new();
    for spec in specs {
        targets.extend(
            native::resolve(spec, maps_of, (uid != 0).then_some(uid))
                .map_err(|e| Error::InvalidArgument(e.to_string()))?,
        );
    }
    Ok(native::merge(targets))
}

/// What resolving `req`'s `--uprobe` specs ahead takes (specs, the process whose mappings
/// they are looked up in, the caller's uid), when the caller may trace the target: the start
/// computes the same, and says why when it may not.
fn natives_to_resolve(
    req: &StartSessionRequest,
    caller: &Caller,
) -> Option<(Vec<String>, Option<u32>, u32)> {
    let options = req.counting.as_ref()?;
    if options.uprobes.is_empty() {
        return None;
    }
    let target = req.target.as_ref()?;
    let maps_of = match target.kind {
        Some(target::Kind::Pid(pid)) if pid != 0 => {
            caller.may_trace_pid(pid).ok()?;
            // A launched target has not exec'd yet: its mappings are tracerctl's.
            (!target.launched).then_some(pid)
        }
        Some(target::Kind::All(true)) => {
            caller.may_trace_all().ok()?;
            None
        }
        _ => return None,
    };
    let uid = caller.acting_uid("starting a session").ok()?;
    Some((options.uprobes.clone(), maps_of, uid))
}

/// What a start asks for, as far as preparing it goes; `None` for a mode the start refuses.
struct Asks {
    python: bool,
    cuda: bool,
    native: bool,
    sampling: bool,
    /// Off-CPU time too (`--off-cpu`).
    off_cpu: bool,
    /// Of every process.
    all: bool,
}

fn asks(req: &StartSessionRequest) -> Option<Asks> {
    let mode = Mode::try_from(req.mode).ok()?;
    let default = CountingOptions::default();
    let options = req.counting.as_ref().unwrap_or(&default);
    Some(Asks {
        python: counts_python(mode, options),
        cuda: options.cuda,
        native: !options.uprobes.is_empty(),
        sampling: mode == Mode::Sampling,
        off_cpu: mode != Mode::Counting && req.sampling.as_ref().is_some_and(|s| s.off_cpu),
        all: req
            .target
            .as_ref()
            .is_some_and(|t| matches!(t.kind, Some(target::Kind::All(true)))),
    })
}
