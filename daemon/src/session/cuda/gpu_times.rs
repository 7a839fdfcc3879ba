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
    sync::{LazyLock, Mutex},
    time::Duration,
};

use tracer_inspect::{
    cuda::{self, Injection, INJECTION_LIBRARY},
    process::{self, inject, MapEntry},
    unwind::ProcMaps,
};

/// How long the library may take to act on a request: it looks every 250 ms, and turning
/// CUPTI on loads it (hundreds of MB in a CUDA 13 wheel).
const ANSWER_WAIT: Duration = Duration::from_secs(10);
/// How long a thread of the process may take to stop where loading is safe.
const LOAD_WAIT: Duration = Duration::from_secs(1);

/// Sessions holding records on, per process (each turned on before it counts here).
static HOLDERS: LazyLock<Mutex<HashMap<u32, usize>>> = LazyLock::new(Mutex::default);

/// Whether the session's caller may have code loaded into a process now (ptrace's attach
/// right, Yama): asked again just before the library is loaded.
pub type MayLoad = std::sync::Arc<dyn Fn(u32) -> Result<(), String> + Send + Sync>;

/// A session's ask for GPU times in its target.
#[derive(Clone)]
pub struct Ask {
    pub pid: u32,
    /// The library beside tracerd: the same path in the process, whose root is tracerd's.
    pub library: PathBuf,
    pub may_load: MayLoad,
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

/// What [`Enable::run`] got.
pub enum Enabled {
    /// Records turned on (or on already for another session): the status line.
    On(String),
    /// CUDA's driver loaded the library at the process's start (`CUDA_INJECTION64_PATH`):
    /// records are on for the process's life, nobody turns them off.
    Injected(String),
}

/// Checks made at the start, before anything is loaded (the caller's right to load into
/// `pid` is checked before this): `pid` has initialized CUDA, sees tracerd's files at their
/// paths, and no other tool's injection library holds CUPTI. The ask, or why not.
pub fn check(pid: u32, may_load: MayLoad) -> Result<Ask, String> {
    let maps = ProcMaps::read(pid).map_err(|e| format!("pid {pid}: {e}"))?;
    let maps_one = |kind: cuda::Library| {
        maps.entries()
            .iter()
            .any(|m| cuda::library(Path::new(&m.path)) == Some(kind))
    };
    if maps_one(cuda::Library::Cupti) {
        // Ours already (a launched command's, or a session's before): it is asked there.
        let library = process::beside_tracerd(INJECTION_LIBRARY)?;
        return Ok(Ask {
            pid,
            library,
            may_load,
        });
    }
    if !maps_one(cuda::Library::Driver) {
        return Err(format!(
            "pid {pid} has not loaded CUDA's driver (libcuda): --gpu-times --pid turns CUPTI on in a process that has initialized CUDA"
        ));
    }
    if let Some(other) = other_injection(pid) {
        return Err(format!(
            "pid {pid} runs with CUDA_INJECTION64_PATH={other}: another tool's injection library holds CUPTI there"
        ));
    }
    let root = |p: &str| {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(p).map(|m| (m.dev(), m.ino())).ok()
    };
    if root(&format!("/proc/{pid}/root")) != root("/proc/self/root") {
        return Err(format!(
            "pid {pid} runs under another root directory (a container), where tracerd's {INJECTION_LIBRARY} is not: start the program under tracer with --gpu-times -- CMD"
        ));
    }
    let library = process::beside_tracerd(INJECTION_LIBRARY)?;
    Ok(Ask {
        pid,
        library,
        may_load,
    })
}

/// The injection library the process's environment names, if it is not tracer's.
fn other_injection(pid: u32) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let value = env
        .split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(b"CUDA_INJECTION64_PATH="))?;
    let value = String::from_utf8_lossy(value).into_owned();
    let ours = Path::new(&value).file_name() == Some(INJECTION_LIBRARY.as_ref());
    (!value.is_empty() && !ours).then_some(value)
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
        let mut holders = HOLDERS.lock().unwrap_or_else(|e| e.into_inner());
        if self.load {
            // Asked again: the process may have changed hands since the start's check.
            (self.ask.may_load)(pid)?;
            let path = self.ask.library.to_string_lossy();
            inject::load_library(pid, &path, LOAD_WAIT).map_err(|e| {
                format!("loading {INJECTION_LIBRARY} into pid {pid} with ptrace: {e}")
            })?;
        }
        let injection = find(pid)?;
        let status = injection.status()?;
        if status.starts_with("ok:") {
            return Ok(Enabled::Injected(status));
        }
        let held = holders.get(&pid).copied().unwrap_or(0);
        let status = if held > 0 && status.starts_with("on:") {
            status
        } else {
            injection.request(true, ANSWER_WAIT)?
        };
        if !status.starts_with("on:") {
            let why = status.strip_prefix("error: ").unwrap_or(&status);
            return Err(format!("GPU times in pid {pid}: {why}"));
        }
        holders.insert(pid, held + 1);
        Ok(Enabled::On(status))
    }
}

/// Lets go of a session's hold on `pid`'s records: the last one turns them off, after
/// CUPTI has handed everything over. The status line then.
pub fn turn_off(pid: u32) -> Result<String, String> {
    let mut holders = HOLDERS.lock().unwrap_or_else(|e| e.into_inner());
    match holders.get_mut(&pid) {
        Some(n) if *n > 1 => {
            *n -= 1;
            return Ok("on: kept on for another session".into());
        }
        _ => {
            holders.remove(&pid);
        }
    }
    find(pid)?.request(false, ANSWER_WAIT)
}

/// `pid` exited: nobody holds its records any more.
pub fn gone(pid: u32) {
    HOLDERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&pid);
}

/// tracer's injection library in `pid`.
fn find(pid: u32) -> Result<Injection, String> {
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
