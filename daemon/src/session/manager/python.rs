//! The manager's Python counting: probing the interpreters a session's processes run, which
//! slots count Python (and hold processes at exec), the kernel maps' counts per slot, and
//! the names of code objects the probes send.

use super::{Done, Manager};
use crate::{
    error::Error,
    session::python::{
        watch::{self, exe_id, FoundPython, Met},
        PySession, ToProbe, Unprobed,
    },
};
use tracer_inspect::python::memory;

/// How a launched command is counted, until it runs CPython.
const LAUNCHED_WHY: &str = "sys.monitoring callbacks, loaded by tracer's loader (LD_PRELOAD, taken out of the environment before the program runs) just before the program's first line, where cProfile starts; the interpreter's start-up before it is not counted";

/// The same, before 3.12 (no `sys.monitoring`).
const LAUNCHED_PROFILE_WHY: &str = "a C profile function on every thread (cProfile's hook and events; CPython 3.10 and 3.11 have no sys.monitoring), started by tracer's loader (LD_PRELOAD, taken out of the environment before the program runs) just before the program's first line, where cProfile starts; the interpreter's start-up before it is not counted, nor threads that C code makes for itself (PyGILState_Ensure); a profile function the program sets hands it over to the probes";

/// Where a handover's answer goes (`Done::InprocHandover`).
pub(super) type HandoverReply = std::sync::mpsc::Sender<Result<(), String>>;

/// A handover waiting for its process's interpreter's probes, being attached off this task.
pub(super) struct WaitingHandover {
    session: String,
    pid: u32,
    reply: HandoverReply,
}

/// A process whose check waits for its interpreter's probes (`Done::LateProbed`).
#[derive(Clone, Debug)]
pub(super) struct LateCheck {
    pub(super) session: String,
    pub(super) pid: u32,
    pub(super) met: Met,
}

impl Manager {
    /// A pending in-process start settled: the report says so, and a process whose
    /// counter will not start is counted with the probes from now on.
    pub(super) fn inproc_settled(&mut self, id: &str, pid: u32, outcome: Result<u32, String>) {
        let Some(s) = self.running.get_mut(id) else {
            // Ended first: its end read what there was.
            return;
        };
        let slot = s.slot;
        let Some(mut py) = s.sources.python.take() else {
            return;
        };
        let entry = py
            .counted
            .iter_mut()
            .find(|c| c.pid == pid && c.way == "in-process");
        match (outcome, entry) {
            // A launch's reason (set at its exec) stands; an attach's pending one is told
            // the tool id.
            (Ok(tool), Some(c)) if c.why == crate::session::python::late_start_why(None) => {
                c.why = crate::session::python::late_start_why(Some(tool))
            }
            (Ok(_), Some(_)) => {}
            (Err(why), Some(c)) => {
                c.way = "uprobes".into();
                c.why = format!(
                    "in-process counting could not start ({why}): counted with uprobes from when tracer learnt of it; its calls in between were not counted"
                );
                if let Some(slot) = slot {
                    if let Err(e) = self.bpf.unset_inproc(pid, slot) {
                        tracing::warn!(%e, pid, "unmarking a process counted in-process");
                    }
                }
                tracing::info!(pid, %why, "in-process counting refused late; counting with uprobes");
                py.checked.remove(&pid);
                if let Some(s) = self.running.get_mut(id) {
                    s.sources.python = Some(py);
                }
                self.check_session_process(id, pid, Met::Late, None);
                return;
            }
            (_, None) => {}
        }
        if let Some(s) = self.running.get_mut(id) {
            s.sources.python = Some(py);
        }
    }

    /// A process of session `id` counted by a profile function (3.10, 3.11) set one of its
    /// own, which took the counter's place (HANDOVER): the probes count it from now on — its
    /// interpreter probed, its threads seeded, its in-process mark taken off — and the report
    /// says so. Its program waits for the answer meanwhile: when its interpreter's probes are
    /// being attached off this task (a sweep met a forked sibling first, say), until they are
    /// in (`handovers_probed`), for the probes must count it once it goes on.
    pub(super) fn inproc_handover(&mut self, id: String, pid: u32, reply: HandoverReply) {
        let counts_python = self
            .running
            .get(&id)
            .is_some_and(|s| s.sources.python.is_some());
        if counts_python {
            if let Some(mapped) = memory::runtime_of(pid) {
                if !self.probed_now(&mapped.path) {
                    self.scans.handovers.push(WaitingHandover {
                        session: id,
                        pid,
                        reply,
                    });
                    return;
                }
            }
        }
        let _ = reply.send(self.hand_over(&id, pid));
    }

    /// Answers the handovers that waited for their interpreters' probes, now in (or failed
    /// off this task: then `hand_to_probes` tries in place, and says why it could not).
    pub(super) fn handovers_probed(&mut self) {
        for w in std::mem::take(&mut self.scans.handovers) {
            self.inproc_handover(w.session, w.pid, w.reply);
        }
    }

    fn hand_over(&mut self, id: &str, pid: u32) -> Result<(), String> {
        let s = self.running.get_mut(id).ok_or("its session ended")?;
        let (Some(slot), Some(mut py)) = (s.slot, s.sources.python.take()) else {
            return Err("its session counts no Python".into());
        };
        let done = self.hand_to_probes(&mut py, slot, pid);
        match &done {
            Ok(()) => {
                py.handed.insert(pid);
                let why = "counted in-process until the program set a profile function of its own (cProfile, sys.setprofile, a profiler), which takes the place of tracer's on CPython 3.10 and 3.11; with uprobes from then on, the program held meanwhile: no call was missed or counted twice".to_owned();
                match py.counted.iter_mut().find(|c| c.pid == pid) {
                    Some(c) => {
                        c.way = "in-process, then uprobes".into();
                        c.why = why;
                    }
                    None => py.counted.push(tracer_report::CountedWay {
                        pid,
                        way: "in-process, then uprobes".into(),
                        why,
                    }),
                }
            }
            Err(why) => py.warnings.push(format!(
                "pid {pid}: its calls after it set a profile function of its own (which takes the place of tracer's on CPython 3.10 and 3.11) were not counted: handing it over to the probes failed: {why}"
            )),
        }
        if let Some(s) = self.running.get_mut(id) {
            s.sources.python = Some(py);
        }
        done
    }

    fn hand_to_probes(&mut self, py: &mut PySession, slot: u8, pid: u32) -> Result<(), String> {
        let targets: Vec<u32> = py.inproc.iter().map(|c| c.pid).collect();
        if !targets.contains(&pid) && !tracer_inspect::process::descends_from(pid, &targets) {
            return Err("it is not a process of the session".into());
        }
        let mapped = memory::runtime_of(pid).ok_or("it maps no CPython")?;
        self.py
            .ensure(&mut self.bpf, &mapped.path)
            .map_err(|why| why.to_string())?;
        self.py.seed_threads(&mut self.bpf, pid, &mapped)?;
        self.bpf
            .unset_inproc(pid, slot)
            .map_err(|e| format!("unmarking it: {e}"))?;
        py.checked.insert(pid, exe_id(pid));
        Ok(())
    }

    /// A launched command's exec, held (EXEC_HOLD): whether the program it now runs counts
    /// in-process (a `python3.X` executable, X >= 10: its loader starts the counter), and is
    /// then left to it; true when so. A program on the way to one (a shell, a wrapper) leaves
    /// the question to its next exec; anything else is counted with the probes.
    pub(super) fn launched_exec(&mut self, py: &mut PySession, slot: Option<u8>, pid: u32) -> bool {
        // A process carrying the loader into a root without tracer's directory (a chroot, a
        // mount namespace of its own) would have the dynamic loader print an error: the
        // loader comes out of its environment first, and it is counted with the probes.
        let unreachable = py
            .inproc
            .iter()
            .find(|c| c.launched_with_loader(pid) && !c.seen_by(pid))
            .map(|c| c.unload(pid));
        if let Some(Err(e)) = &unreachable {
            tracing::warn!(pid, %e, "taking tracer's loader out of a process's environment");
        }
        if py.launch != Some(pid) {
            return false;
        }
        let Ok(exe) = std::fs::read_link(format!("/proc/{pid}/exe")) else {
            return false;
        };
        let needed = tracer_inspect::python::discover::libpython_needed(pid, &exe);
        let name = exe.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let minor = tracer_inspect::python::runtime::minor_from_name(&exe);
        let loader = py
            .inproc
            .iter()
            .any(|c| c.pid == pid && c.launched_with_loader(pid));
        let why = match (minor, slot) {
            _ if unreachable.is_some() => {
                "its root does not hold tracer's directory (a chroot or a mount namespace of its own)".into()
            }
            (Some(_), _) if !loader => {
                "its launcher did not start it with tracer's loader (SessionInfo.launch_env)".into()
            }
            // A build with a `t` (free-threaded) is not the counter's.
            (Some(m), Some(slot)) if m >= 10 && name == format!("python3.{m}") => {
                py.launch = None;
                match self.bpf.set_inproc(pid, slot) {
                    Ok(()) => {
                        py.checked.insert(pid, exe_id(pid));
                        if m < 12 {
                            if let Some(c) = py.counted.iter_mut().find(|c| c.pid == pid) {
                                c.why = LAUNCHED_PROFILE_WHY.into();
                            }
                        }
                        return true;
                    }
                    Err(e) => format!("marking it counted in-process failed: {e}"),
                }
            }
            (Some(m), _) => format!("{name} is CPython 3.{m}, which the counter does not support (3.10+ with the GIL)"),
            // Not Python: a program on the way to it keeps the question, unless it embeds
            // libpython (no `cpython.run_*` event would start the counter).
            (None, _) if needed.is_none() => return false,
            (None, _) => format!("{name} embeds libpython rather than being python3.X"),
        };
        py.launch = None;
        if let Some(c) = py.counted.iter_mut().find(|c| c.pid == pid) {
            c.way = "uprobes".into();
            c.why = format!("launched, counted from its first instruction: {why}");
        }
        for why in self.py.ensure_known(&mut self.bpf) {
            tracing::debug!(%why, "known interpreter not probed (see capabilities)");
        }
        false
    }

    /// Probes what a Python-counting session needs before it starts counting.
    /// `inproc`: the session's slot and its target's in-process counter, else why there is
    /// none.
    pub(super) fn start_python(
        &mut self,
        pid: Option<u32>,
        launched: bool,
        inproc: Result<(u8, tracer_inspect::python::inproc::Counter), String>,
        // Every process's: those that map an interpreter, found ahead.
        scanned: Option<Vec<FoundPython>>,
    ) -> Result<PySession, Error> {
        let mut py = PySession::default();
        let way = |pid, way: &str, why: String| tracer_report::CountedWay {
            pid,
            way: way.into(),
            why,
        };
        match pid {
            // Already running: probe its interpreter and find the threads inside the eval loop.
            Some(pid) if !launched => {
                let mapped = memory::runtime_of(pid).ok_or_else(|| {
                    Error::FailedPrecondition(format!(
                        "pid {pid} does not run CPython (no libpython3.X or python3.X mapped)"
                    ))
                })?;
                match inproc {
                    Ok((slot, counter)) => {
                        if let Err(e) = self.bpf.set_inproc(pid, slot) {
                            tracing::warn!(%e, pid, "marking a process counted in-process");
                        }
                        let why = if counter.pending() {
                            crate::session::python::late_start_why(None)
                        } else {
                            counter.how()
                        };
                        py.counted.push(way(pid, "in-process", why));
                        py.inproc.push(counter);
                        py.checked.insert(pid, exe_id(pid));
                        return Ok(py);
                    }
                    Err(why) => py.counted.push(way(pid, "uprobes", why)),
                }
                self.py
                    .ensure(&mut self.bpf, &mapped.path)
                    .map_err(|why| Error::FailedPrecondition(format!("pid {pid}: {why}")))?;
                if let Err(why) = self.py.seed_threads(&mut self.bpf, pid, &mapped) {
                    py.warnings.push(why);
                }
                py.note_jit(pid, &self.py, &mapped.path);
                py.checked.insert(pid, exe_id(pid));
            }
            // Not exec'd yet, its loader prepared: whether it counts in-process is decided
            // when it execs into CPython (`launched_exec`).
            Some(pid) if inproc.is_ok() => {
                if let Ok((_, counter)) = inproc {
                    py.counted.push(way(pid, "in-process", LAUNCHED_WHY.into()));
                    py.inproc.push(counter);
                    py.launch = Some(pid);
                }
            }
            // Not exec'd yet: probe every interpreter on the machine, so the first call is counted
            // whichever it runs. One found later is probed then, with a warning (see sweep).
            Some(pid) => {
                let why = inproc.err().unwrap_or_default();
                py.counted.push(way(
                    pid,
                    "uprobes",
                    format!("launched, counted from its first instruction: {why}"),
                ));
                for why in self.py.ensure_known(&mut self.bpf) {
                    tracing::debug!(%why, "known interpreter not probed (see capabilities)");
                }
            }
            None => {
                let _ = self.py.ensure_known(&mut self.bpf);
                for found in scanned.unwrap_or_else(watch::processes) {
                    self.check_python_process(&mut py, found.pid, Met::AtStart, Some(&found));
                }
            }
        }
        Ok(py)
    }

    /// Probes the interpreter of `pid` if not yet (once per exec of the process). Returns
    /// false when that waits for its probes to be attached off this task (`LateProbed`): the
    /// caller checks again then (`recheck_late`). `found`: its executable and interpreter as
    /// a scan off this task read them, else read here.
    pub(super) fn check_python_process(
        &mut self,
        py: &mut PySession,
        pid: u32,
        met: Met,
        found: Option<&FoundPython>,
    ) -> bool {
        let exe = found.map_or_else(|| exe_id(pid), |f| f.exe);
        if py.checked.get(&pid) == Some(&exe) {
            return true;
        }
        // Not marked as checked when no interpreter is mapped yet: right after exec the dynamic
        // loader may not have mapped libpython.
        let Some(mapped) =
            found.map_or_else(|| memory::runtime_of(pid), |f| Some(f.mapped.clone()))
        else {
            return true;
        };
        // At exec, held (EXEC_HOLD): nothing has run yet. A `python3.X` that links libpython
        // has not mapped it yet; probing the file it will map counts its first call too.
        let needed = (met == Met::AtExec)
            .then(|| tracer_inspect::python::discover::libpython_needed(pid, &mapped.path))
            .flatten();
        if met != Met::AtStart && !self.probed_now(needed.as_deref().unwrap_or(&mapped.path)) {
            return false;
        }
        if met == Met::AtExec {
            // Probed before it ran anything: nothing to find later (`Late` would read its
            // threads again, on this task, for each new process a scan finds).
            if let Some(lib) = needed {
                match self.py.ensure(&mut self.bpf, &lib) {
                    Ok(_) => {
                        py.note_jit(pid, &self.py, &lib);
                        py.checked.insert(pid, exe);
                    }
                    Err(why) => py.warnings.push(format!("pid {pid}: {why}")),
                }
            } else if let Err(why) = self.py.ensure(&mut self.bpf, &mapped.path) {
                if why != Unprobed::NotRuntime {
                    py.warnings.push(format!("pid {pid}: {why}"));
                    py.checked.insert(pid, exe);
                }
            } else {
                py.note_jit(pid, &self.py, &mapped.path);
                py.checked.insert(pid, exe);
            }
            return true;
        }
        let late = matches!(met, Met::Late | Met::Unprobed);
        let attached = met != Met::Unprobed && self.py.is_attached(&mapped.path);
        let result = self.py.ensure(&mut self.bpf, &mapped.path).map(|_| ());
        if result != Err(Unprobed::NotRuntime) {
            py.checked.insert(pid, exe);
        }
        match result {
            Err(Unprobed::NotRuntime) => {}
            Ok(_) if attached && !late => {}
            Ok(_) => {
                if let Err(why) = self.py.seed_threads(&mut self.bpf, pid, &mapped) {
                    py.warnings.push(why);
                }
                if late && !attached {
                    py.warnings.push(format!(
                        "pid {pid}: {} was probed only when the process was found; its earlier calls were not counted",
                        mapped.path.display()
                    ));
                }
            }
            Err(why) => py.warnings.push(format!("pid {pid}: {why}")),
        }
        py.note_jit(pid, &self.py, &mapped.path);
        true
    }

    /// Whether `path` can be probed in place now; if not, its inspection and probes are
    /// under way off this task.
    fn probed_now(&mut self, path: &std::path::Path) -> bool {
        match self.py.to_probe(path) {
            ToProbe::Now => true,
            ToProbe::Waiting => false,
            ToProbe::Attach(job) => {
                let attacher = self.bpf.python_attacher();
                let tx = self.done.clone();
                tokio::task::spawn_blocking(move || {
                    let attached = job.run(&attacher);
                    // A manager gone (shutdown) drops the probes here, off its task.
                    let _ = tx.send(Done::LateProbed(attached));
                });
                false
            }
        }
    }

    /// Checks again the processes whose interpreter was being probed off this task; a
    /// process held at its exec goes on once no session waits for it.
    pub(super) fn recheck_late(&mut self) {
        let waited = std::mem::take(&mut self.scans.late);
        for w in &waited {
            let met = match w.met {
                Met::Late => Met::Unprobed,
                met => met,
            };
            // Waits again (kept in `scans.late`) where that binary's probes are still on their way.
            self.check_session_process(&w.session, w.pid, met, None);
        }
        for w in waited.iter().filter(|w| w.met == Met::AtExec) {
            if !self.scans.late.iter().any(|l| l.pid == w.pid) {
                self.continue_held(w.pid);
            }
        }
    }

    /// Lets a process held at its exec (EXEC_HOLD) run: continuing a process that was not
    /// stopped does nothing, and a SIGCONT that comes before the stop cancels it.
    pub(super) fn continue_held(&mut self, pid: u32) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGCONT,
        );
        self.bpf.continued(pid);
    }

    /// Tells the probes which slots count Python, and which of those count every process.
    pub(super) fn update_python_masks(&mut self) {
        let (python, all) = watch::masks(&self.running);
        if let Err(e) = self.bpf.set_python_sessions(python, all) {
            tracing::error!(%e, "updating Python session masks");
        }
        self.update_exec_hold(python & !all, all);
        if python == 0 && self.starts.python_ahead == 0 && self.starts.python_waiting.is_empty() {
            self.py.detach_all();
        }
    }

    /// A start with Python probes attached ahead (`ahead`) has started, or `failed`: then
    /// they come off if no session counts Python and no other start is about to.
    pub(super) fn python_start_done(&mut self, ahead: bool, failed: bool) {
        if !ahead {
            return;
        }
        self.starts.python_ahead = self.starts.python_ahead.saturating_sub(1);
        if failed {
            self.update_python_masks();
        }
    }

    /// Followed processes wait at exec for their interpreter to be probed (`python`: slots
    /// counting Python in followed processes; `all`: everywhere), so that no call of a program
    /// in a chroot or container (an interpreter not known beforehand) is lost; and in every
    /// session of an unprivileged user, for the daemon to check the new program's credentials
    /// before it runs an instruction; and in CUDA sessions, whose launches are located in the
    /// executable mapped then (a process may launch and exit before its rows are read).
    pub(super) fn update_exec_hold(&mut self, python: u64, all: u64) {
        let unprivileged = self
            .running
            .values()
            .filter(|s| (s.owner_uid != 0 || s.sources.cuda.is_some()) && s.follows_pid())
            .filter_map(|s| s.slot)
            .fold(0u64, |m, slot| m | 1 << slot);
        if let Err(e) = self.bpf.set_exec_hold(python | unprivileged, all) {
            tracing::error!(%e, "updating the exec hold mask");
        }
    }

    /// Names of code objects the probes met first, into their sessions.
    pub(super) fn drain_codes(&mut self, ring: &mut aya::maps::RingBuf<aya::maps::MapData>) {
        watch::drain_codes(ring, &mut self.running, &self.py);
    }
}
