//! What a Python-counting session does with the interpreters its processes run: probing
//! the one a process runs (at the start, held at its exec, or found late by a scan),
//! deciding at a launched command's exec whether it is counted in-process, and handing a
//! process counted in-process over to the probes.

use std::sync::Arc;

use tracer_bpf::Bpf;
use tracer_inspect::python::memory;

use super::{
    watch::{self, exe_id, FoundPython, Met},
    AttachedPython, Probes, PySession, ToProbe, Unprobed,
};
use crate::error::Error;

/// How a launched command is counted, until it runs CPython.
const LAUNCHED_WHY: &str = "sys.monitoring callbacks, loaded by tracer's loader (LD_PRELOAD, taken out of the environment before the program runs) just before the program's first line, where cProfile starts; the interpreter's start-up before it is not counted";

/// The same, before 3.12 (no `sys.monitoring`).
const LAUNCHED_PROFILE_WHY: &str = "a C profile function on every thread (cProfile's hook and events; CPython 3.10 and 3.11 have no sys.monitoring), started by tracer's loader (LD_PRELOAD, taken out of the environment before the program runs) just before the program's first line, where cProfile starts; the interpreter's start-up before it is not counted; threads made later, by threading or by C code, get it before their first frame; a profile function the program sets hands it over to the probes";

/// Where probes attached off the manager's task go (the manager adopts them, then checks
/// again the processes that waited for them).
pub type AttachedBack = Arc<dyn Fn(AttachedPython) + Send + Sync>;

/// The interpreters' probes and the kernel maps, lent for one piece of a session's work.
pub struct Probing<'a> {
    pub probes: &'a mut Probes,
    pub bpf: &'a mut Bpf,
    pub attached: AttachedBack,
}

impl Probing<'_> {
    pub fn hand_to_probes(&mut self, py: &mut PySession, slot: u8, pid: u32) -> Result<(), String> {
        let targets: Vec<u32> = py.inproc.iter().map(|c| c.pid).collect();
        if !targets.contains(&pid) && !tracer_inspect::process::descends_from(pid, &targets) {
            return Err("it is not a process of the session".into());
        }
        let mapped = memory::runtime_of(pid).ok_or("it maps no CPython")?;
        self.probes
            .ensure(self.bpf, &mapped.path)
            .map_err(|why| why.to_string())?;
        self.probes.seed_threads(self.bpf, pid, &mapped)?;
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
    pub fn launched_exec(&mut self, py: &mut PySession, slot: Option<u8>, pid: u32) -> bool {
        // The launched command's own execs alone are read here; every other process of the
        // session only has its loader looked at (below).
        let ours = py.launch == Some(pid);
        let exe = ours
            .then(|| std::fs::read_link(format!("/proc/{pid}/exe")).ok())
            .flatten();
        let minor = exe
            .as_deref()
            .and_then(tracer_inspect::python::runtime::minor_from_name);
        let name = exe
            .as_deref()
            .and_then(|e| e.file_name())
            .and_then(|n| n.to_str())
            .unwrap_or("")
            .to_owned();
        // A build with a `t` (free-threaded) is not the counter's.
        let countable = minor.filter(|&m| m >= 10 && name == format!("python3.{m}"));
        let loader = ours
            && py
                .inproc
                .iter()
                .any(|c| c.pid == pid && c.launched_with_loader(pid));
        // The launched command, with its loader: its counter's directory made where it finds
        // it, in whatever root it now runs (a chroot, a mount namespace of its own); exec'd
        // into CPython, counted in-process from here. Or why not.
        let launched = (loader && slot.is_some())
            .then(|| {
                let c = py.inproc.iter_mut().find(|c| c.pid == pid)?;
                Some(match countable {
                    Some(_) => c.launched(pid),
                    None => c.reach(pid),
                })
            })
            .flatten();
        // A process carrying the loader into a root without tracer's directory (a chroot, a
        // mount namespace of its own) would have the dynamic loader print an error: the
        // loader comes out of its environment first, and it is counted with the probes.
        let unreachable = py
            .inproc
            .iter()
            .find(|c| c.launched_with_loader(pid) && !c.seen_by(pid))
            .map(|c| c.unload(pid));
        // Not counted in-process though it could find the directory: its loader goes too.
        let unloaded = match (&launched, &unreachable) {
            (Some(Err(_)), None) => py
                .inproc
                .iter()
                .find(|c| c.pid == pid)
                .map(|c| c.unload(pid)),
            _ => unreachable.clone(),
        };
        if let Some(Err(e)) = &unloaded {
            tracing::warn!(pid, %e, "taking tracer's loader out of a process's environment");
        }
        if !ours {
            return false;
        }
        let Some(exe) = exe else {
            return false;
        };
        let needed = tracer_inspect::python::discover::libpython_needed(pid, &exe);
        let why = match (minor, slot, launched) {
            (_, _, Some(Err(why))) if unreachable.is_some() => format!(
                "its root does not hold tracer's directory (a chroot or a mount namespace of its own), and one could not be made there: {why}"
            ),
            (_, _, Some(Err(why))) => why,
            _ if unreachable.is_some() => {
                "its root does not hold tracer's directory (a chroot or a mount namespace of its own)".into()
            }
            (Some(_), _, _) if !loader => {
                "its launcher did not start it with tracer's loader (SessionInfo.launch_env)".into()
            }
            (Some(m), Some(slot), _) if countable.is_some() => {
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
            (Some(m), _, _) => format!("{name} is CPython 3.{m}, which the counter does not support (3.10+ with the GIL)"),
            // Not Python: a program on the way to it keeps the question, unless it embeds
            // libpython (no `cpython.run_*` event would start the counter).
            (None, _, _) if needed.is_none() => return false,
            (None, _, _) => format!("{name} embeds libpython rather than being python3.X"),
        };
        py.launch = None;
        if let Some(c) = py.counted.iter_mut().find(|c| c.pid == pid) {
            c.way = "uprobes".into();
            c.why = format!("launched, counted from its first instruction: {why}");
        }
        for why in self.probes.ensure_known(self.bpf) {
            tracing::debug!(%why, "known interpreter not probed (see capabilities)");
        }
        false
    }

    /// Probes what a Python-counting session needs before it starts counting.
    /// `inproc`: the session's slot and its target's in-process counter, else why there is
    /// none.
    pub fn open(
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
                self.probes
                    .ensure(self.bpf, &mapped.path)
                    .map_err(|why| Error::FailedPrecondition(format!("pid {pid}: {why}")))?;
                if let Err(why) = self.probes.seed_threads(self.bpf, pid, &mapped) {
                    py.warnings.push(why);
                }
                py.note_jit(pid, self.probes, &mapped.path);
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
                for why in self.probes.ensure_known(self.bpf) {
                    tracing::debug!(%why, "known interpreter not probed (see capabilities)");
                }
            }
            None => {
                let _ = self.probes.ensure_known(self.bpf);
                for found in scanned.unwrap_or_else(watch::processes) {
                    self.check(&mut py, found.pid, Met::AtStart, Some(&found));
                }
            }
        }
        Ok(py)
    }

    /// Probes the interpreter of `pid` if not yet (once per exec of the process). Returns
    /// false when that waits for its probes to be attached off this task (`LateProbed`): the
    /// caller checks again then (`recheck_late`). `found`: its executable and interpreter as
    /// a scan off this task read them, else read here.
    pub fn check(
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
                match self.probes.ensure(self.bpf, &lib) {
                    Ok(_) => {
                        py.note_jit(pid, self.probes, &lib);
                        py.checked.insert(pid, exe);
                    }
                    Err(why) => py.warnings.push(format!("pid {pid}: {why}")),
                }
            } else if let Err(why) = self.probes.ensure(self.bpf, &mapped.path) {
                if why != Unprobed::NotRuntime {
                    py.warnings.push(format!("pid {pid}: {why}"));
                    py.checked.insert(pid, exe);
                }
            } else {
                py.note_jit(pid, self.probes, &mapped.path);
                py.checked.insert(pid, exe);
            }
            return true;
        }
        let late = matches!(met, Met::Late | Met::Unprobed);
        let attached = met != Met::Unprobed && self.probes.is_attached(&mapped.path);
        let result = self.probes.ensure(self.bpf, &mapped.path).map(|_| ());
        if result != Err(Unprobed::NotRuntime) {
            py.checked.insert(pid, exe);
        }
        match result {
            Err(Unprobed::NotRuntime) => {}
            Ok(_) if attached && !late => {}
            Ok(_) => {
                if let Err(why) = self.probes.seed_threads(self.bpf, pid, &mapped) {
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
        py.note_jit(pid, self.probes, &mapped.path);
        true
    }

    /// Whether `path` can be probed in place now; if not, its inspection and probes are
    /// under way off this task.
    pub fn probed_now(&mut self, path: &std::path::Path) -> bool {
        match self.probes.to_probe(path) {
            ToProbe::Now => true,
            ToProbe::Waiting => false,
            ToProbe::Attach(job) => {
                let attacher = self.bpf.python_attacher();
                let back = self.attached.clone();
                tokio::task::spawn_blocking(move || back(job.run(&attacher)));
                false
            }
        }
    }
}
