//! `--gpu-times` for a running process: tracer's injection library, loaded into the process
//! with ptrace where it is not there yet, turns CUPTI's kernel records on while a session
//! asks (`tracer_inspect::cuda::Injection`; the library's side is `daemon/cupti`). Its probes
//! are attached before it is loaded or turned on, so no record goes by unseen. Sessions on
//! one process share it: the first turns records on, the last to end turns them off.
//!
//! Everything here but [`check`] waits on the process: blocking threads only.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, LazyLock, Mutex},
    time::Duration,
};

use super::super::loads::Ticket;
use tracer_inspect::{
    cuda::{self, Injection, INJECTION_LIBRARY},
    pinned::{Image, Pinned},
    process::{self, inject, MapEntry},
    unwind::ProcMaps,
};

/// How long the library may take to act on a request: it looks every 250 ms, and turning
/// CUPTI on loads it (hundreds of MB in a CUDA 13 wheel).
const ANSWER_WAIT: Duration = Duration::from_secs(10);
/// How long a thread of the process may take to stop where loading is safe.
const LOAD_WAIT: Duration = Duration::from_secs(1);

/// Per process: the sessions holding its records on (each turned on before it counts
/// here), behind a lock of its own, held while that process is asked anything (one
/// process that is slow to answer holds up no other).
static HOLDERS: LazyLock<Mutex<HashMap<u32, Arc<Mutex<usize>>>>> = LazyLock::new(Mutex::default);

/// `pid`'s holders.
fn holders(pid: u32) -> Arc<Mutex<usize>> {
    let mut all = HOLDERS.lock().unwrap_or_else(|e| e.into_inner());
    all.entry(pid).or_default().clone()
}

/// Whether the session's caller may have code loaded into a process now (ptrace's attach
/// right, Yama): asked again just before the library is loaded.
pub type MayLoad = std::sync::Arc<dyn Fn(u32) -> Result<(), String> + Send + Sync>;

/// A session's ask for GPU times in its target.
#[derive(Clone)]
pub struct Ask {
    pub pid: u32,
    /// The program it ran when checked: a load reaches that program or nothing.
    pub image: Image,
    /// The session's owner, whose loads in flight are bounded.
    pub owner: u32,
    /// The library beside tracerd: the same path in the process, whose root is tracerd's.
    pub library: PathBuf,
    pub may_load: MayLoad,
    /// `--cuda-in-process`: the library counts the process's launches.
    pub in_process: bool,
    /// `--gpu-times`: kernel records on (else launches alone).
    pub records: bool,
    /// A tracing session's: each launch counted in-process also an event.
    pub events: bool,
}

/// Where a session's ask stands.
#[derive(Default)]
pub enum State {
    #[default]
    None,
    /// Asked at the start: done by the job that probes the library.
    Asked(Ask),
    /// Records are on for the session.
    On(Ask),
    /// Being turned off before the session ends (its last records still count).
    Switching,
}

/// What a session's start made of its ask for GPU times or in-process launches.
pub enum Start {
    Ask(Ask),
    /// Launches in-process alone were asked, and `pid` cannot have them (why): its launches
    /// are counted with the probes, and nothing is loaded.
    Probes(u32, String),
    /// A launched command's launches, counted in-process where its library (set in its
    /// environment by the launcher) asks from `cuInit` (`launched.rs`).
    Launched,
}

/// What [`Enable::run`] got.
pub enum Enabled {
    /// Records turned on (or on already for another session): the status line, and what
    /// became of in-process launches.
    On(String, Launches),
    /// CUDA's driver loaded the library at the process's start (`CUDA_INJECTION64_PATH`):
    /// records are on for the process's life, nobody turns them off.
    Injected(String),
    /// Launches in-process alone were asked and cannot be had (why): nothing is on, the
    /// launches are the probes' to count.
    Probes(String),
}

/// In-process launches, where a session asked for them.
pub enum Launches {
    NotAsked,
    /// The table the library counts them in.
    Counted(InProcess),
    /// Not to be had (why): the probes count them.
    Probes(String),
}

/// Checks made at the start, before anything is loaded (the caller's right to load into
/// `pid` is checked before this): `pid` has initialized CUDA, sees tracerd's files at their
/// paths, and no other tool's injection library holds CUPTI. The ask, or why not.
pub fn check(
    pid: u32,
    owner: u32,
    may_load: MayLoad,
    in_process: bool,
    (records, events): (bool, bool),
) -> Result<Ask, String> {
    // The program as checked from here on.
    let image = Image::of(pid).map_err(|e| format!("pid {pid}: {e}"))?;
    may_load(pid)?;
    let maps = ProcMaps::read(pid).map_err(|e| format!("pid {pid}: {e}"))?;
    let maps_one = |kind: cuda::Library| {
        maps.entries()
            .iter()
            .any(|m| cuda::library(Path::new(&m.path)) == Some(kind))
    };
    // Ours mapped already (a launched command's, or a session's before): it is asked there,
    // and nothing is loaded.
    if !maps_one(cuda::Library::Cupti) {
        loadable(pid, maps_one(cuda::Library::Driver))?;
        // Nothing is loaded where CUPTI cannot be found (looked for again before "on").
        cupti_path(pid, maps.entries())?;
    }
    let library = process::beside_tracerd(INJECTION_LIBRARY)?;
    Ok(Ask {
        pid,
        image,
        owner,
        library,
        may_load,
        in_process,
        records,
        events,
    })
}

/// Whether tracerd's injection library may be loaded into `pid` (`driver`: it maps CUDA's
/// driver), or why not.
fn loadable(pid: u32, driver: bool) -> Result<(), String> {
    if !driver {
        return Err(format!(
            "pid {pid} has not loaded CUDA's driver (libcuda): --gpu-times --pid turns CUPTI on in a process that has initialized CUDA"
        ));
    }
    if secure_mode(pid)? {
        return Err(format!(
            "pid {pid} runs in the loader's secure mode (a setuid, setgid or capability-gaining program): tracer loads nothing into it"
        ));
    }
    match injection_env(pid) {
        Some(Named::Ours(path)) => {
            return Err(format!(
                "pid {pid} runs with CUDA_INJECTION64_PATH={path}, which CUDA loads when the process initializes it: a --cuda session gets its GPU times from then on, without --gpu-times"
            ))
        }
        Some(Named::Other(path)) => {
            return Err(format!(
                "pid {pid} runs with CUDA_INJECTION64_PATH={path}: another tool's injection library holds CUPTI there"
            ))
        }
        None => {}
    }
    if !process::same_root(pid) {
        return Err(format!(
            "pid {pid} runs under another root directory (a container), where tracerd's {INJECTION_LIBRARY} is not: start the program under tracer with --gpu-times -- CMD"
        ));
    }
    Ok(())
}

/// An injection library the process's environment names.
pub(super) enum Named {
    Ours(String),
    Other(String),
}

/// `name`'s value in `pid`'s (initial) environment, if set.
pub(super) fn env_value(pid: u32, name: &str) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0).find_map(|kv| {
        kv.strip_prefix(name.as_bytes())
            .and_then(|rest| rest.strip_prefix(b"="))
            .map(|v| String::from_utf8_lossy(v).into_owned())
    })
}

/// The injection library the process's (initial) environment names, if any.
pub(super) fn injection_env(pid: u32) -> Option<Named> {
    let value = env_value(pid, "CUDA_INJECTION64_PATH")?;
    if value.is_empty() {
        return None;
    }
    Some(
        if Path::new(&value).file_name() == Some(INJECTION_LIBRARY.as_ref()) {
            Named::Ours(value)
        } else {
            Named::Other(value)
        },
    )
}

/// Turning records on, after the library's probes are attached.
pub struct Enable {
    pub ask: Ask,
    /// The library is not in the process yet: load it.
    pub load: bool,
}

impl Enable {
    pub fn run(&self) -> Result<Enabled, String> {
        let pid = self.ask.pid;
        // Known before anything is loaded: where the library would read call sites.
        let python = self.ask.in_process.then(|| python_at(pid));
        if let (Some(Err(why)), false) = (&python, self.ask.records) {
            return Ok(Enabled::Probes(why.clone()));
        }
        let holders = holders(pid);
        let mut held = holders.lock().unwrap_or_else(|e| e.into_inner());
        if self.load {
            let _ticket = Ticket::take(self.ask.owner)?;
            let pin = Pinned::open(pid).map_err(|e| format!("pinning pid {pid}: {e}"))?;
            if pin.image() != self.ask.image {
                return Err(format!(
                    "pid {pid} executed another program since the session's start checked it"
                ));
            }
            // Asked again on the stopped process (ptrace's right, Yama), through this pin.
            let path = self.ask.library.to_string_lossy();
            inject::Load {
                pin: &pin,
                path: &path,
                wait: LOAD_WAIT,
                check: &*self.ask.may_load,
                cancelled: &|| false,
            }
            .run()
            .map_err(|e| format!("loading {INJECTION_LIBRARY} into pid {pid} with ptrace: {e}"))?;
        }
        let injection = find(pid)?;
        let status = injection.status()?;
        if status.starts_with("ok:") {
            return Ok(Enabled::Injected(status));
        }
        if status == cuda::REFUSED_SECURE {
            // Its serving thread never started: a request would go unanswered.
            return Err(format!("GPU times in pid {pid}: {status}"));
        }
        // Asked before "on": the library reads what it needs at it.
        let python = match python {
            Some(Ok(python)) => {
                injection
                    .ask_launches(python.map(|p| p.0), self.ask.records, self.ask.events)
                    .map_err(|e| format!("launches in pid {pid}: {e}"))?;
                Some(Ok(python.map(|p| p.1)))
            }
            Some(Err(why)) => Some(Err(why)),
            None => None,
        };
        let on_already = *held > 0 && status.starts_with("on:");
        let status = if on_already && !matches!(python, Some(Ok(_))) {
            status
        } else if on_already {
            // On for another session: asked again, it starts counting launches.
            injection.request(true, ANSWER_WAIT)?
        } else {
            // Named before asking: the library loads that file and no other.
            let maps = ProcMaps::read(pid).map_err(|e| format!("pid {pid}: {e}"))?;
            let cupti = cupti_path(pid, maps.entries())?;
            injection
                .name_cupti(&cupti)
                .map_err(|e| format!("GPU times in pid {pid}: {e}"))?;
            injection.request(true, ANSWER_WAIT)?
        };
        if !status.starts_with("on:") {
            let why = status.strip_prefix("error: ").unwrap_or(&status);
            return Err(format!("GPU times in pid {pid}: {why}"));
        }
        *held += 1;
        let python = match python {
            None => return Ok(Enabled::On(status, Launches::NotAsked)),
            Some(Err(why)) => return Ok(Enabled::On(status, Launches::Probes(why))),
            Some(Ok(python)) => python,
        };
        drop(held);
        match take_table(&injection, &status, python) {
            Ok(inproc) => Ok(Enabled::On(status, Launches::Counted(inproc))),
            Err(why) if self.ask.records => Ok(Enabled::On(status, Launches::Probes(why))),
            Err(why) => {
                // Nothing else asked of it: this session's hold let go again (the last one
                // turns CUPTI off).
                if let Err(off) = turn_off(pid) {
                    tracing::warn!(pid, %off, "turning CUPTI off after launches were refused");
                }
                Ok(Enabled::Probes(why))
            }
        }
    }
}

/// A process's launches, counted by tracer's injection library in its table.
pub struct InProcess {
    pub table: std::sync::Arc<cuda::LaunchTable>,
    /// The table when the session started: the session's launches are those counted since.
    pub base: cuda::LaunchCounts,
    /// The interpreter it runs (None: not a Python process), to name call sites.
    pub python: Option<&'static tracer_inspect::python::layout::Version>,
    /// Where the table's ring of launch events stood (a tracing session reads on from there).
    pub events: Option<cuda::EventCursor>,
}

impl InProcess {
    /// `table` as the session finds it now: its counts and events from here on.
    pub fn from_now(
        table: cuda::LaunchTable,
        python: Option<&'static tracer_inspect::python::layout::Version>,
    ) -> Self {
        let base = table.read();
        let events = Some(table.events_from_now());
        Self {
            table: std::sync::Arc::new(table),
            base,
            python,
            events,
        }
    }
}

/// Where `pid`'s library reads a launching thread's Python call site: None for a process
/// that runs no CPython; an error for one whose call sites it could not read.
pub(super) fn python_at(
    pid: u32,
) -> Result<
    Option<(
        cuda::PythonAt,
        &'static tracer_inspect::python::layout::Version,
    )>,
    String,
> {
    use tracer_inspect::python::{memory, runtime::Runtime};
    let Some(mapped) = memory::runtime_of(pid) else {
        return Ok(None);
    };
    let why = |e: String| {
        format!("pid {pid} runs CPython ({}), whose launching threads' call sites tracer's injection library cannot read: {e}", mapped.path.display())
    };
    let rt = Runtime::inspect_layout(&mapped.path).map_err(|e| why(e.to_string()))?;
    let sym = rt
        .gil_state_symbol
        .ok_or_else(|| why("no PyGILState_GetThisThreadState symbol".into()))?;
    let bias = rt
        .load_bias(mapped.start, mapped.file_offset)
        .ok_or_else(|| why("its mapping does not match the file's segments".into()))?;
    Ok(Some((
        cuda::PythonAt {
            get_tstate: sym.wrapping_add(bias),
            layout: rt.version.probe,
        },
        rt.version,
    )))
}

/// `pid`'s launch table, once its library's status line (`status`, after an "on") says it
/// counts launches: the table and its counts now; or why not.
fn take_table(
    injection: &Injection,
    status: &str,
    python: Option<&'static tracer_inspect::python::layout::Version>,
) -> Result<InProcess, String> {
    if !status.contains("launches counted in-process") {
        let why = status
            .split("; launches not counted in-process: ")
            .nth(1)
            .unwrap_or(status);
        return Err(format!("tracer's injection library could not: {why}"));
    }
    Ok(InProcess::from_now(injection.launch_table()?, python))
}

/// Lets go of a session's hold on `pid`'s records: the last one turns them off, after
/// CUPTI has handed everything over. The status line then.
pub fn turn_off(pid: u32) -> Result<String, String> {
    let holders = holders(pid);
    let mut held = holders.lock().unwrap_or_else(|e| e.into_inner());
    if *held > 1 {
        *held -= 1;
        return Ok("on: kept on for another session".into());
    }
    *held = 0;
    find(pid)?.request(false, ANSWER_WAIT)
}

/// [`turn_off`] on a thread of its own, for a session that cannot wait for it: what CUPTI
/// still holds goes nowhere.
pub fn turn_off_detached(pid: u32) {
    std::thread::spawn(move || {
        if let Err(e) = turn_off(pid) {
            tracing::warn!(pid, %e, "turning GPU times off");
        }
    });
}

/// `pid` exited: nobody holds its records any more.
pub fn gone(pid: u32) {
    let mut all = HOLDERS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(h) = all.remove(&pid) {
        *h.lock().unwrap_or_else(|e| e.into_inner()) = 0;
    }
}

/// Whether `pid` was started in the loader's secure mode (AT_SECURE in its auxiliary vector:
/// a setuid, setgid or capability-gaining exec), whose environment a less privileged user chose.
fn secure_mode(pid: u32) -> Result<bool, String> {
    const AT_SECURE: u64 = 23;
    let auxv = std::fs::read(format!("/proc/{pid}/auxv"))
        .map_err(|e| format!("reading pid {pid}'s auxiliary vector: {e}"))?;
    let word = |b: &[u8]| u64::from_ne_bytes(b.try_into().unwrap_or_default());
    Ok(auxv
        .chunks_exact(16)
        .any(|pair| word(&pair[..8]) == AT_SECURE && word(&pair[8..]) != 0))
}

/// The CUPTI for tracer's injection library to load into `pid`, as a path in the process's
/// root (tracerd's: `check` saw to it). Taken from what the process maps, never from its
/// environment or the loader's search path, which its user sets.
fn cupti_path(pid: u32, maps: &[MapEntry]) -> Result<PathBuf, String> {
    let exists = |p: &Path| Path::new(&format!("/proc/{pid}/root{}", p.display())).is_file();
    find_cupti(maps, exists).map_err(|tried| {
        if tried.is_empty() {
            return format!(
                "pid {pid} maps neither CUPTI nor a CUDA runtime (libcudart.so*) to find CUPTI beside: GPU times need CUPTI"
            );
        }
        let tried: Vec<String> = tried.iter().map(|d| d.display().to_string()).collect();
        format!(
            "no CUPTI for pid {pid}: it maps none, and none of {} is in {}",
            cuda::CUPTI_SONAMES.join(", "),
            tried.join(", ")
        )
    })
}

/// CUPTI as the process maps it (PyTorch's profiler links it), else the first of its sonames
/// that `exists` in the directories beside a CUDA runtime it maps; else the directories tried.
fn find_cupti(maps: &[MapEntry], exists: impl Fn(&Path) -> bool) -> Result<PathBuf, Vec<PathBuf>> {
    let files = || {
        maps.iter()
            .filter(|m| m.is_file() && !m.deleted())
            .map(|m| Path::new(&m.path))
    };
    if let Some(mapped) = files().find(|p| cuda::is_cupti(p) && exists(p)) {
        return Ok(mapped.to_path_buf());
    }
    let mut tried: Vec<PathBuf> = Vec::new();
    let runtimes = files().filter(|p| cuda::library(p) == Some(cuda::Library::Runtime));
    for dir in runtimes.filter_map(Path::parent) {
        for candidate in cuda::cupti_beside(dir) {
            if tried.contains(&candidate) {
                continue;
            }
            for name in cuda::CUPTI_SONAMES {
                let path = candidate.join(name);
                if exists(&path) {
                    return Ok(path);
                }
            }
            tried.push(candidate);
        }
    }
    Err(tried)
}

/// tracer's injection library in `pid`.
pub(super) fn find(pid: u32) -> Result<Injection, String> {
    let maps = ProcMaps::read(pid).map_err(|e| format!("pid {pid}: {e}"))?;
    let mine: Vec<&MapEntry> = maps
        .entries()
        .iter()
        .filter(|m| cuda::library(Path::new(&m.path)) == Some(cuda::Library::Cupti))
        .filter(|m| !m.deleted())
        .collect();
    let first = *mine
        .first()
        .ok_or_else(|| format!("pid {pid} does not map {INJECTION_LIBRARY}"))?;
    // One file: its mappings alone.
    let id = (first.dev, first.inode);
    let path = process::mapped_path(pid, first).map_err(|e| e.to_string())?;
    let mine: Vec<&MapEntry> = mine
        .into_iter()
        .filter(|m| (m.dev, m.inode) == id)
        .collect();
    Injection::find(pid, &path, &mine)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapped(path: &str) -> MapEntry {
        MapEntry {
            start: 0x1000,
            end: 0x2000,
            offset: 0,
            path: path.into(),
            executable: true,
            dev: (8, 1),
            inode: 7,
        }
    }

    #[test]
    fn cupti_is_the_mapped_one_else_the_first_beside_a_runtime() {
        let wheel = "/v/site-packages/nvidia";
        let maps = [
            mapped("/usr/bin/python3.12"),
            mapped(&format!("{wheel}/cuda_runtime/lib/libcudart.so.12")),
            mapped("/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
        ];
        let cupti12 = format!("{wheel}/cuda_cupti/lib/libcupti.so.12");
        let found = find_cupti(&maps, |p| p == Path::new(&cupti12));
        assert_eq!(found, Ok(PathBuf::from(&cupti12)));
        // The newest soname in a directory, the runtime's own directory first.
        let beside = format!("{wheel}/cuda_runtime/lib/libcupti.so.13");
        let found = find_cupti(&maps, |p| {
            p == Path::new(&cupti12) || p == Path::new(&beside)
        });
        assert_eq!(found, Ok(PathBuf::from(&beside)));
        // A CUPTI the process maps already wins (if it is still there).
        let mut with = maps.to_vec();
        with.push(mapped("/opt/torch/lib/libcupti.so.12"));
        let found = find_cupti(&with, |p| p.starts_with("/opt") || p == Path::new(&beside));
        assert_eq!(found, Ok(PathBuf::from("/opt/torch/lib/libcupti.so.12")));
        let found = find_cupti(&with, |p| p == Path::new(&beside));
        assert_eq!(found, Ok(PathBuf::from(&beside)));
        // Nothing found: the directories tried, once each.
        with.push(mapped(&format!(
            "{wheel}/cuda_runtime/lib/libcudart.so.12.8"
        )));
        assert_eq!(
            find_cupti(&with, |_| false),
            Err(vec![
                PathBuf::from(format!("{wheel}/cuda_runtime/lib")),
                PathBuf::from(format!("{wheel}/cuda_runtime/extras/CUPTI/lib64")),
                PathBuf::from(format!("{wheel}/cuda_cupti/lib")),
            ])
        );
        assert_eq!(find_cupti(&maps[..1], |_| true), Err(vec![]), "no runtime");
    }

    #[test]
    fn this_process_is_not_in_secure_mode() {
        assert_eq!(secure_mode(std::process::id()), Ok(false));
    }
}
