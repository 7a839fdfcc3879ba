//! The manager's side of Python counting, where the session table is needed: which
//! processes' interpreters are checked (at their exec, by the sweep, from a scan of every
//! process), in-process starts that settle late, handovers to the probes, processes waiting
//! for probes attached off this task, which slots count Python (and hold processes at exec),
//! and the names of code objects the probes send. What is done with one process's
//! interpreter is `session::python::probing`.

use super::{Done, Manager};
use crate::session::python::{
    probing::Probing,
    watch::{self, FoundPython, Met},
    Probes, PySession,
};
use tracer_bpf::Bpf;
use tracer_inspect::python::memory;

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
    /// The interpreters' probes and the kernel maps, lent to a Python session's work;
    /// probes it attaches off this task come back as `Done::LateProbed`.
    pub(super) fn probing(&mut self) -> Probing<'_> {
        probing(&mut self.py, &mut self.bpf, &self.done)
    }

    /// Lends session `id`'s Python source to `work`, with the interpreters' probes; None
    /// where the session has ended or counts no Python.
    pub(super) fn with_python<T>(
        &mut self,
        id: &str,
        work: impl FnOnce(&mut PySession, Option<u8>, &mut Probing<'_>) -> T,
    ) -> Option<T> {
        let s = self.running.get_mut(id)?;
        let py = s.sources.get_mut::<PySession>()?;
        Some(work(
            py,
            s.slot,
            &mut probing(&mut self.py, &mut self.bpf, &self.done),
        ))
    }

    /// A process exec'd, held there (EXEC_HOLD) for the sessions of `sessions` (slots) that
    /// follow it, `heard` the ones that follow it by pid: its new program is checked for
    /// those that count Python, and for those counting Python everywhere. Whether every check
    /// is done: otherwise it waits for probes attached off this task (`scans.late`).
    pub(super) fn python_exec(&mut self, pid: u32, sessions: u64, heard: Vec<String>) -> bool {
        let mut ids: Vec<String> = heard
            .into_iter()
            .filter(|id| {
                self.running
                    .get(id)
                    .is_some_and(|s| s.sources.has::<PySession>())
            })
            .collect();
        // Sessions counting Python everywhere hear of execs of `python…` programs.
        ids.extend(
            self.running
                .values()
                .filter(|s| !s.follows_pid() && s.sources.has::<PySession>())
                .filter(|s| s.slot.is_some_and(|slot| sessions & (1 << slot) != 0))
                .map(|s| s.id.clone()),
        );
        let mut done = true;
        for id in ids {
            done &= self.check_session_process(&id, pid, Met::AtExec, None);
        }
        done
    }

    /// The sweep's look for Python processes that appeared, or exec'd an interpreter, since
    /// the last: a session's own now, and for sessions on every process, those a scan of
    /// every process's mappings off this task finds (`PythonScanned`).
    pub(super) fn python_sweep(&mut self) {
        let ids: Vec<String> = self
            .running
            .iter()
            .filter(|(_, s)| s.sources.has::<PySession>() && s.follows_pid())
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            let Some(s) = self.running.get(&id) else {
                continue;
            };
            let pids: Vec<u32> = s.live.iter().copied().collect();
            for pid in pids {
                self.check_session_process(&id, pid, Met::Late, None);
            }
        }
        let everyone = self
            .running
            .values()
            .any(|s| s.sources.has::<PySession>() && !s.follows_pid());
        if everyone && !self.scans.python {
            self.scans.python = true;
            let tx = self.done.clone();
            tokio::task::spawn_blocking(move || {
                let _ = tx.send(Done::PythonScanned(watch::processes()));
            });
        }
    }

    /// A scan's Python processes, looked at for the sessions on every process.
    pub(super) fn python_scanned(&mut self, found: &[FoundPython]) {
        self.scans.python = false;
        let ids: Vec<String> = self
            .running
            .iter()
            .filter(|(_, s)| s.sources.has::<PySession>() && !s.follows_pid())
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            for f in found {
                self.check_session_process(&id, f.pid, Met::Late, Some(f));
            }
        }
    }

    /// Probes the interpreter `pid` runs for session `id` (`found`: as a scan read it).
    /// False when that waits for its probes to be attached off this task: the check is kept
    /// in `scans.late` until then.
    pub(super) fn check_session_process(
        &mut self,
        id: &str,
        pid: u32,
        met: Met,
        found: Option<&FoundPython>,
    ) -> bool {
        let Some(s) = self.running.get_mut(id) else {
            return true;
        };
        let slot = s.slot;
        // Forked by a process counted in-process, it counts so too (the kernel marked it):
        // its interpreter is probed if a handover hands it to the probes, not now, when the
        // report would say that its calls so far went uncounted.
        let inproc = slot.is_some_and(|slot| self.bpf.inproc_of(pid) & 1 << slot != 0);
        if inproc && matches!(met, Met::Late | Met::Unprobed) {
            return true;
        }
        let checked = self.with_python(id, |py, slot, probing| {
            (met == Met::AtExec && probing.launched_exec(py, slot, pid))
                || probing.check(py, pid, met, found)
        });
        let Some(done) = checked else {
            return true;
        };
        if !done {
            match self
                .scans
                .late
                .iter_mut()
                .find(|l| l.session == id && l.pid == pid)
            {
                // A sweep may have found the process first (`Late`) while its exec event was
                // still on its way: held at its exec now, it must be continued once checked
                // (`recheck_late`), or it stays stopped.
                Some(l) if met == Met::AtExec => l.met = Met::AtExec,
                Some(_) => {}
                None => self.scans.late.push(LateCheck {
                    session: id.to_owned(),
                    pid,
                    met,
                }),
            }
        }
        done
    }

    /// A pending in-process start settled: the report says so, and a process whose
    /// counter will not start is counted with the probes from now on.
    pub(super) fn inproc_settled(&mut self, id: &str, pid: u32, outcome: Result<u32, String>) {
        let Some(s) = self.running.get_mut(id) else {
            // Ended first: its end read what there was.
            return;
        };
        let slot = s.slot;
        let Some(py) = s.sources.get_mut::<PySession>() else {
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
                self.check_session_process(id, pid, Met::Late, None);
            }
            (_, None) => {}
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
            .is_some_and(|s| s.sources.has::<PySession>());
        if counts_python {
            if let Some(mapped) = memory::runtime_of(pid) {
                if !self.probing().probed_now(&mapped.path) {
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
        if !self.running.contains_key(id) {
            return Err("its session ended".into());
        }
        self.with_python(id, |py, slot, probing| {
            let slot = slot.ok_or("its session counts no Python")?;
            let done = probing.hand_to_probes(py, slot, pid);
            handed(py, pid, &done);
            done
        })
        .unwrap_or_else(|| Err("its session counts no Python".into()))
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
            if !self.scans.holding(w.pid) {
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
    /// before it runs an instruction; in CUDA sessions, whose launches are located in the
    /// executable mapped then (a process may launch and exit before its rows are read); and
    /// in sampling sessions, whose first samples of a new program need its interpreter read.
    pub(super) fn update_exec_hold(&mut self, python: u64, all: u64) {
        let unprivileged = self
            .running
            .values()
            .filter(|s| s.waits_at_exec() && s.follows_pid())
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

/// What a handover of `pid` to the probes did (`done`), into the session's Python report.
fn handed(py: &mut PySession, pid: u32, done: &Result<(), String>) {
    match done {
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
}

/// The interpreters' probes and the kernel maps, lent; probes attached off the manager's
/// task come back as `Done::LateProbed`.
fn probing<'a>(
    probes: &'a mut Probes,
    bpf: &'a mut Bpf,
    done: &tokio::sync::mpsc::UnboundedSender<Done>,
) -> Probing<'a> {
    let tx = done.clone();
    Probing {
        probes,
        bpf,
        // A manager gone (shutdown) drops the probes there, off its task.
        attached: std::sync::Arc::new(move |a| {
            let _ = tx.send(Done::LateProbed(a));
        }),
    }
}
