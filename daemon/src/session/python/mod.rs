//! Counting mode's Python source: the probes on interpreter binaries (shared by sessions),
//! and each session's view: names of the code objects it saw, and its counts.

use std::{
    collections::HashMap,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use tracer_common::{
    PyCallStats, PyCodeEvent, PyEdgeKey, PY_CODE_FILENAME_UNREAD, PY_CODE_QUALNAME_UNREAD,
};

mod end;
mod inproc;
pub mod probing;
pub mod watch;

pub use inproc::{inproc_functions, late_start_why, merge_handed};

use tracer_bpf::Bpf;
use tracer_inspect::python::{
    memory::{self, Mapped},
    runtime::{Runtime, RuntimeError},
};
use tracer_report::{PyCaller, PyFunction};

type FileId = (u64, u64);

/// The versions of the interpreters [`Probes`] probed, by file ([`Probes::versions`]).
pub struct Versions(HashMap<FileId, &'static tracer_inspect::python::layout::Version>);

impl Versions {
    /// The version of the interpreter at `path`, if it was probed.
    pub fn of(&self, path: &Path) -> Option<&'static tracer_inspect::python::layout::Version> {
        self.0.get(&file_id(path).ok()?).copied()
    }
}

/// A binary's build id and size ([`tracer_inspect::binary::build`]).
type Build = (Vec<u8>, u64);

/// Interpreter binaries and their probes, keyed by (device, inode) so that one file seen
/// through several paths is probed once.
#[derive(Default)]
pub struct Probes {
    /// What inspecting each binary found (a replaced binary is a new inode). Kept while
    /// Python is counted; then only the machine's own interpreters' stay.
    inspected: HashMap<FileId, Result<Runtime, Unprobed>>,
    /// Probes attached now.
    links: HashMap<FileId, tracer_bpf::ProbeSet>,
    /// Interpreter runtimes found on this machine at start.
    known: Vec<PathBuf>,
    /// Answers once the probes `detach_all` removed are gone. New ones are not attached
    /// beside them: a call would count twice.
    releasing: Option<std::sync::Arc<Released>>,
    /// Binaries whose probes are being attached off the manager's task ([`Self::to_attach`],
    /// [`Self::to_probe`]).
    attaching: std::collections::HashSet<FileId>,
    /// Binaries whose probes could not be attached off the manager's task: tried in place.
    failed: std::collections::HashSet<FileId>,
    /// What inspecting a build found, for its copies: another container's, or a program's
    /// own copy of an interpreter, is a new file of a build seen before.
    builds: HashMap<Build, Runtime>,
}

/// The release `detach_all` started, waited for by whoever attaches next, on any thread.
pub struct Released(std::sync::Mutex<Option<std::sync::mpsc::Receiver<()>>>);

impl Released {
    /// Waits (a few grace periods); at once when done before.
    pub fn wait(&self) {
        let mut rx = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(r) = rx.take() {
            let _ = r.recv();
        }
    }
}

/// Python probes to attach off the manager's task ([`Probes::to_attach`],
/// [`Probes::to_probe`]), and what came of it ([`Probes::adopt`]).
pub struct Attaching {
    /// Each binary, with what inspecting it found where that was done already.
    jobs: Vec<(FileId, PathBuf, Option<Runtime>)>,
    releasing: Option<std::sync::Arc<Released>>,
}

/// What [`Attaching::run`] found of one binary.
struct Probed {
    id: FileId,
    path: PathBuf,
    /// What inspecting it found, where that was done there.
    inspected: Option<Result<Runtime, Unprobed>>,
    /// Its build, where it was inspected there.
    build: Option<Build>,
    /// Its probes, or why not; None when it cannot be probed.
    links: Option<Result<tracer_bpf::ProbeSet, String>>,
}

/// The probes [`Attaching::run`] attached, by binary, or why not.
pub struct AttachedPython(Vec<Probed>);

impl Attaching {
    pub fn run(self, attacher: &tracer_bpf::PythonAttacher) -> AttachedPython {
        if let Some(r) = &self.releasing {
            r.wait();
        }
        let attach =
            |rt: &Runtime, path: &Path| attacher.attach(rt, path).map_err(|e| e.to_string());
        AttachedPython(
            self.jobs
                .into_iter()
                .map(|(id, path, rt)| {
                    let (inspected, build, links) = match rt {
                        Some(rt) => (None, None, Some(attach(&rt, &path))),
                        None => {
                            let found = inspect(&path);
                            let links = found.as_ref().ok().map(|rt| attach(rt, &path));
                            (Some(found), tracer_inspect::binary::build(&path), links)
                        }
                    };
                    Probed {
                        id,
                        path,
                        inspected,
                        build,
                        links,
                    }
                })
                .collect(),
        )
    }
}

/// Whether a binary met after its session started can be probed in place.
pub enum ToProbe {
    /// At once: probed already, or why not is known.
    Now,
    /// Once the probes being attached off the manager's task are in.
    Waiting,
    /// Once these are inspected and attached off the manager's task.
    Attach(Attaching),
}

/// Why a binary has no probes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unprobed {
    /// It holds no eval loop (a `python3.X` that links libpython, say).
    NotRuntime,
    Failed(String),
}

impl std::fmt::Display for Unprobed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unprobed::NotRuntime => f.write_str("not a CPython runtime"),
            Unprobed::Failed(why) => f.write_str(why),
        }
    }
}

/// The machine's interpreters, inspected ahead (tens of milliseconds each: symbol tables,
/// opcode tables) so that the first Python session's start does not wait for it.
pub struct Inspected(Vec<(FileId, Option<Build>, Result<Runtime, Unprobed>)>);

impl Inspected {
    pub fn read(paths: &[PathBuf]) -> Self {
        Self(
            paths
                .iter()
                .filter_map(|p| {
                    Some((
                        file_id(p).ok()?,
                        tracer_inspect::binary::build(p),
                        inspect(p),
                    ))
                })
                .collect(),
        )
    }
}

fn inspect(path: &Path) -> Result<Runtime, Unprobed> {
    Runtime::inspect(path).map_err(|e| match e {
        RuntimeError::NoEvalLoop { .. } => Unprobed::NotRuntime,
        e => Unprobed::Failed(e.to_string()),
    })
}

fn file_id(path: &Path) -> Result<(u64, u64), String> {
    let m = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok((m.dev(), m.ino()))
}

impl Probes {
    pub fn new(known: Vec<PathBuf>) -> Self {
        Self {
            known,
            ..Self::default()
        }
    }

    /// Takes in what [`Inspected::read`] found ahead, for binaries not looked at since.
    pub fn add_inspected(&mut self, found: Inspected) {
        for (id, build, rt) in found.0 {
            self.learn(build, &rt);
            self.inspected.entry(id).or_insert(rt);
        }
    }

    /// Keeps what inspecting a build found, for its copies.
    fn learn(&mut self, build: Option<Build>, rt: &Result<Runtime, Unprobed>) {
        if let (Some(build), Ok(rt)) = (build, rt) {
            self.builds.entry(build).or_insert_with(|| rt.clone());
        }
    }

    /// Probes `path` (once). Returns the runtime, or why it cannot be probed.
    pub fn ensure(&mut self, bpf: &mut Bpf, path: &Path) -> Result<&Runtime, Unprobed> {
        let id = file_id(path).map_err(Unprobed::Failed)?;
        let rt = self
            .inspected
            .entry(id)
            .or_insert_with(|| inspect(path))
            .as_ref()
            .map_err(Clone::clone)?;
        // Being attached off the manager's task for a start: its probes are in within moments.
        if self.attaching.contains(&id) {
            return Ok(rt);
        }
        if let std::collections::hash_map::Entry::Vacant(slot) = self.links.entry(id) {
            if let Some(released) = self.releasing.take() {
                wait_released(&released);
            }
            let links = bpf.attach_python(rt, path).map_err(|e| {
                Unprobed::Failed(format!("attaching probes to {}: {e}", path.display()))
            })?;
            tracing::info!(path = %path.display(), version = rt.version.minor, table = rt.table_found_by, "Python probes attached");
            slot.insert(links);
        }
        Ok(rt)
    }

    /// Which of `paths` (interpreters a start will probe) are to be attached off the
    /// manager's task, now marked as being attached; `None` when none is. `busy`: some are
    /// being attached for another start already.
    pub fn to_attach(&mut self, paths: &[PathBuf]) -> (Option<Attaching>, bool) {
        let mut jobs: Vec<(FileId, PathBuf, Option<Runtime>)> = Vec::new();
        let mut busy = false;
        for path in paths {
            let Ok(id) = file_id(path) else { continue };
            if self.attaching.contains(&id) {
                busy = true;
                continue;
            }
            if self.links.contains_key(&id) || jobs.iter().any(|j| j.0 == id) {
                continue;
            }
            // Inspected here (at daemon start for the machine's own): one that cannot be
            // probed is left to the start, which says why.
            if let Ok(rt) = self.inspected.entry(id).or_insert_with(|| inspect(path)) {
                jobs.push((id, path.clone(), Some(rt.clone())));
            }
        }
        if jobs.is_empty() {
            return (None, busy);
        }
        self.attaching.extend(jobs.iter().map(|j| j.0));
        let releasing = self.releasing.clone();
        (Some(Attaching { jobs, releasing }), busy)
    }

    /// A binary a session met after its start (a process found running, or held at its
    /// exec): inspecting and probing one not seen yet takes tens to hundreds of ms, which
    /// happens off the manager's task.
    pub fn to_probe(&mut self, path: &Path) -> ToProbe {
        let Ok(id) = file_id(path) else {
            return ToProbe::Now;
        };
        if self.attaching.contains(&id) {
            return ToProbe::Waiting;
        }
        if self.links.contains_key(&id) || self.failed.contains(&id) {
            return ToProbe::Now;
        }
        let rt = match self.inspected.get(&id) {
            Some(Err(_)) => return ToProbe::Now,
            Some(Ok(rt)) => Some(rt.clone()),
            // A copy of a build inspected before: only its probes are left to attach.
            None => self.copy_of_known_build(id, path),
        };
        self.attaching.insert(id);
        ToProbe::Attach(Attaching {
            jobs: vec![(id, path.to_owned(), rt)],
            releasing: self.releasing.clone(),
        })
    }

    /// What inspecting `path` would find, if it is a copy of a build inspected before
    /// (reading its build id maps the file and parses its headers, not its symbols).
    fn copy_of_known_build(&mut self, id: FileId, path: &Path) -> Option<Runtime> {
        let mut rt = self
            .builds
            .get(&tracer_inspect::binary::build(path)?)?
            .clone();
        rt.path = path.to_owned();
        self.inspected.insert(id, Ok(rt.clone()));
        Some(rt)
    }

    /// Takes in the probes attached off the manager's task; one that failed is tried again
    /// in place by whoever needs it, which says why.
    pub fn adopt(&mut self, attached: AttachedPython) {
        for p in attached.0 {
            self.attaching.remove(&p.id);
            let failed = matches!(p.links, Some(Err(_))) || matches!(p.inspected, Some(Err(_)));
            if failed && !p.path.exists() {
                // The path went with its process (`/proc/PID/root/…` of one that exited
                // meanwhile): nothing is known of the binary, and the next process that
                // maps it tries again with its own path.
                tracing::debug!(path = %p.path.display(), "interpreter's path gone before its probes");
                continue;
            }
            if let Some(found) = p.inspected {
                self.learn(p.build, &found);
                self.inspected.insert(p.id, found);
            }
            match p.links {
                None => {}
                Some(Ok(links)) => {
                    tracing::info!(path = %p.path.display(), "Python probes attached");
                    if self.links.insert(p.id, links).is_some() {
                        tracing::warn!(path = %p.path.display(), "Python probes attached twice");
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(%e, path = %p.path.display(), "attaching Python probes");
                    self.failed.insert(p.id);
                }
            }
        }
    }

    /// Interpreters found on this machine at start.
    pub fn known(&self) -> &[PathBuf] {
        &self.known
    }

    pub fn is_attached(&self, path: &Path) -> bool {
        file_id(path).is_ok_and(|id| self.links.contains_key(&id))
    }

    /// The probed interpreters' versions, to read code objects with on another thread.
    pub fn versions(&self) -> Versions {
        Versions(
            self.links
                .keys()
                .filter_map(|id| Some((*id, self.inspected.get(id)?.as_ref().ok()?.version)))
                .collect(),
        )
    }

    /// The runtime of an attached binary.
    pub fn runtime(&self, path: &Path) -> Option<&Runtime> {
        let id = file_id(path).ok()?;
        self.links
            .contains_key(&id)
            .then(|| self.inspected.get(&id)?.as_ref().ok())
            .flatten()
    }

    /// Probes every interpreter found on the machine; returns what could not be probed.
    pub fn ensure_known(&mut self, bpf: &mut Bpf) -> Vec<Unprobed> {
        let known = self.known.clone();
        known
            .iter()
            .filter_map(|p| self.ensure(bpf, p).err())
            .collect()
    }

    /// Removes every probe (no session counts Python any more): processes stop paying for them.
    /// The kernel's grace periods are waited for on a thread of their own.
    pub fn detach_all(&mut self) {
        let sets: Vec<_> = self.links.drain().map(|(_, set)| set).collect();
        self.failed.clear();
        let (done, released) = std::sync::mpsc::sync_channel(1);
        tracer_bpf::release(sets, move || {
            let _ = done.send(());
        });
        self.releasing = Some(std::sync::Arc::new(Released(std::sync::Mutex::new(Some(
            released,
        )))));
        // Copies, containers' and chroots' interpreters seen once must not pile up.
        let known: Vec<FileId> = self.known.iter().filter_map(|p| file_id(p).ok()).collect();
        self.inspected.retain(|id, _| known.contains(id));
        let known = &self.known;
        self.builds.retain(|_, rt| known.contains(&rt.path));
    }

    /// Makes the probes see a running process's threads: those already inside the eval loop
    /// never pass its entry again.
    pub fn seed_threads(&self, bpf: &mut Bpf, pid: u32, mapped: &Mapped) -> Result<usize, String> {
        let rt = self.runtime(&mapped.path).ok_or("interpreter not probed")?;
        let states = memory::thread_states(pid, rt, mapped)
            .map_err(|e| format!("reading pid {pid}'s thread states: {e}"))?;
        for &(tid, tstate) in &states {
            bpf.py_tstate
                .insert(tid, tstate, 0)
                .map_err(|e| e.to_string())?;
        }
        Ok(states.len())
    }
}

/// Waits for the release `detach_all` started (a few grace periods); an error means it is
/// done. Other tasks of this worker move to another thread meanwhile: a connection's task
/// left waiting here would miss its client's keepalive pings.
fn wait_released(released: &Released) {
    let multi_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if multi_thread {
        tokio::task::block_in_place(|| released.wait());
    } else {
        released.wait();
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Name {
    qualname: String,
    filename: String,
    firstlineno: i32,
}

/// One session's Python state.
#[derive(Default)]
pub struct PySession {
    names: HashMap<(u32, u64, u64), Name>,
    /// Processes already checked for an interpreter, with the executable they ran then.
    pub checked: HashMap<u32, (u64, u64)>,
    pub warnings: Vec<String>,
    /// Processes counted in-process (CPython 3.14+, see `python::inproc`).
    pub inproc: Vec<tracer_inspect::python::inproc::Counter>,
    /// Followed processes that exited, while some are counted in-process: their children's
    /// counts files are read at the end only for processes the session followed.
    pub gone: std::collections::HashSet<u32>,
    /// How each process named by pid is counted, and why.
    pub counted: Vec<tracer_report::CountedWay>,
    /// A launched command with its counter's loader, until it execs into CPython (see the
    /// manager's `launched_exec`).
    pub launch: Option<u32>,
    /// Processes handed over from their in-process counter to the probes (3.10, 3.11: the
    /// program set a profile function of its own): counted by both, one after the other.
    pub handed: std::collections::HashSet<u32>,
}

/// Exited processes kept in [`PySession::gone`], at most.
const MAX_GONE: usize = 65_536;

fn c_str(bytes: &[u8]) -> String {
    let len = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..len]).into_owned()
}

impl PySession {
    /// Says in the report when `pid` runs CPython's JIT, which makes its counts inexact.
    pub fn note_jit(&mut self, pid: u32, probes: &Probes, runtime: &Path) {
        let built_in = probes.runtime(runtime).is_some_and(|rt| rt.jit_built_in);
        if let Some(w) = tracer_inspect::python::jit::warning(pid, built_in) {
            if !self.warnings.contains(&w) {
                self.warnings.push(w);
            }
        }
    }

    /// Records the names the kernel sent; reads from the process those it could not.
    pub fn on_code(&mut self, ev: &PyCodeEvent, probes: &Probes) {
        crate::container::note(ev.pid, false);
        let mut name = Name {
            qualname: c_str(&ev.qualname),
            filename: c_str(&ev.filename),
            firstlineno: ev.firstlineno,
        };
        if ev.flags & (PY_CODE_QUALNAME_UNREAD | PY_CODE_FILENAME_UNREAD) != 0 {
            let read = memory::runtime_of(ev.pid)
                .and_then(|m| probes.runtime(&m.path).map(|rt| rt.version))
                .and_then(|v| memory::code_names(ev.pid, ev.code, v).ok());
            if let Some((q, f)) = read {
                if ev.flags & PY_CODE_QUALNAME_UNREAD != 0 {
                    name.qualname = q;
                }
                if ev.flags & PY_CODE_FILENAME_UNREAD != 0 {
                    name.filename = f;
                }
            }
        }
        self.names.insert((ev.pid, ev.code, ev.names), name);
    }

    /// A code object's names as the kernel sent them: (qualname, filename, firstlineno).
    pub fn name(&self, pid: u32, code: u64, names: u64) -> Option<(&str, &str, i32)> {
        self.names
            .get(&(pid, code, names))
            .map(|n| (n.qualname.as_str(), n.filename.as_str(), n.firstlineno))
    }

    /// Names this session's counts, sorted by tottime, with their callers. Code objects whose
    /// names never arrived are reported as unknown.
    pub fn functions(
        &self,
        counts: Vec<(u32, u64, u64, PyCallStats)>,
        edges: Vec<(PyEdgeKey, PyCallStats)>,
    ) -> (Vec<PyFunction>, u64) {
        let mut callers: HashMap<(u32, u64, u64), Vec<PyCaller>> = HashMap::new();
        for (k, st) in edges {
            let (qualname, filename, firstlineno) =
                match self.names.get(&(k.call.pid, k.caller_code, k.caller_names)) {
                    Some(n) => (n.qualname.clone(), n.filename.clone(), n.firstlineno),
                    // Entered before the session attached: never counted, so never named.
                    None => (
                        format!("[unknown: code object {:#x}]", k.caller_code),
                        String::new(),
                        0,
                    ),
                };
            callers
                .entry((k.call.pid, k.call.code, k.call.names))
                .or_default()
                .push(PyCaller {
                    qualname,
                    filename,
                    firstlineno,
                    ncalls: st.ncalls,
                    primitive_calls: st.primitive,
                    tottime_ns: st.tottime_ns,
                    cumtime_ns: st.cumtime_ns,
                });
        }
        let mut unknown = 0;
        let mut out: Vec<PyFunction> = counts
            .into_iter()
            .map(|(pid, code, names, st)| {
                let (qualname, filename, firstlineno) = match self.names.get(&(pid, code, names)) {
                    Some(n) if n.qualname.is_empty() => (
                        format!("[unreadable name: code object {code:#x}]"),
                        n.filename.clone(),
                        n.firstlineno,
                    ),
                    Some(n) => (n.qualname.clone(), n.filename.clone(), n.firstlineno),
                    None => {
                        unknown += 1;
                        (
                            format!("[unknown: code object {code:#x}]"),
                            String::new(),
                            0,
                        )
                    }
                };
                let mut callers = callers.remove(&(pid, code, names)).unwrap_or_default();
                callers.sort_by(|a, b| {
                    b.ncalls
                        .cmp(&a.ncalls)
                        .then_with(|| a.qualname.cmp(&b.qualname))
                });
                PyFunction {
                    callers,
                    pid,
                    qualname,
                    filename,
                    firstlineno,
                    ncalls: st.ncalls,
                    primitive_calls: st.primitive,
                    tottime_ns: st.tottime_ns,
                    cumtime_ns: st.cumtime_ns,
                }
            })
            .collect();
        tracer_report::sort_functions(&mut out, "tottime");
        (out, unknown)
    }
}

/// A session's Python counts in the kernel map (pid, code, names, stats), taken out of it
/// with `take`.
pub fn counts(bpf: &mut Bpf, slot: u8, take: bool) -> Vec<(u32, u64, u64, PyCallStats)> {
    let slot = u32::from(slot);
    tracer_bpf::slot_entries(&mut bpf.py_calls, |k| k.slot == slot, take)
        .into_iter()
        .map(|(k, n)| (k.pid, k.code, k.names, n))
        .collect()
}

/// Takes a session's calls per (caller, callee) out of the kernel map.
fn edges(bpf: &mut Bpf, slot: u8) -> Vec<(PyEdgeKey, PyCallStats)> {
    let slot = u32::from(slot);
    tracer_bpf::slot_entries(&mut bpf.py_edges, |k| k.call.slot == slot, true)
}
