//! Counting a CPython 3.14+ process's calls in the process itself: a uprobe trap costs
//! ~1 µs a call, a `sys.monitoring` C callback tens of nanoseconds.
//!
//! tracerd makes a directory in the process's `/tmp` (reached through `/proc/PID/root`, so
//! chroots and containers see it at the same path), puts the counter library
//! (`libtracer_pycount.so`, built from `daemon/pycount`) and a counts file there
//! (`tracer_common::inproc`), and asks the interpreter to run a start script (PEP 768,
//! [`super::remote_exec`]). The script loads the library as an extension module, takes a
//! free `sys.monitoring` tool id and registers the library's callbacks; the library takes
//! the file over (PENDING → RUNNING). At the end tracerd stops the counter (RUNNING →
//! STOPPED), reads the file, and asks the interpreter to run a removal script, which frees
//! the tool id and deletes the process's counts file; the scripts and the directory are
//! deleted once they have run. A process that cannot do this is counted with uprobes, and
//! [`start`]'s error says why.

mod files;
mod scripts;
mod sigbus;

use std::{
    fs,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use tracer_common::inproc::{self, state, Edge, Entry, Header};

use super::remote_exec;
use files::{Dir, Mapping};
use scripts::{remove_script, start_script, LOAD_ERROR};

/// The counter library's file name, beside tracerd's executable.
pub const LIBRARY: &str = "libtracer_pycount.so";

/// The library beside tracerd, if it is there.
pub fn library() -> Result<PathBuf, String> {
    files::beside_tracerd(LIBRARY)
}

/// One function's counts in one process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Function {
    pub code: u64,
    pub qualname: String,
    pub filename: String,
    pub firstlineno: i32,
    pub ncalls: u64,
    pub primitive: u64,
    pub tottime_ns: u64,
    pub cumtime_ns: u64,
}

/// What one process's counter counted.
#[derive(Clone, Debug, Default)]
pub struct Counts {
    pub pid: u32,
    pub functions: Vec<Function>,
    /// (caller code, callee code, the pair's numbers as a [`Function`] without names).
    pub edges: Vec<Edge>,
    pub lost_calls: u64,
    pub lost_edges: u64,
    pub lost_names: u64,
    /// The counter's state when read (`tracer_common::inproc::state`).
    pub state: u32,
    /// `pid` is the process's pid in its own pid namespace: it exited, in another namespace
    /// than tracerd's, before it could be told by its pid here.
    pub namespace_pid: bool,
}

/// Takes out the start script's own frames: a thread that runs it after the counter started
/// (every thread was asked) is counted entering its function and module code, which are
/// nobody's calls. They are the `_tracer_pycount` functions of `<string>` and the module code
/// objects that called them.
fn drop_script_frames(c: &mut Counts) {
    let script: Vec<u64> = c
        .functions
        .iter()
        .filter(|f| f.filename == "<string>" && f.qualname == "_tracer_pycount")
        .map(|f| f.code)
        .collect();
    if script.is_empty() {
        return;
    }
    let modules: Vec<u64> = c
        .edges
        .iter()
        .filter(|e| script.contains(&e.callee))
        .map(|e| e.caller)
        .collect();
    let own = |code: &u64| script.contains(code) || modules.contains(code);
    c.functions.retain(|f| !own(&f.code));
    c.edges.retain(|e| !own(&e.caller) && !own(&e.callee));
}

/// The counts in a file; `edges`: the caller pairs too.
fn read_counts(map: &Mapping, edges: bool) -> Counts {
    let h = map.header();
    let entries = h.entries_cap as usize;
    let functions = map
        .records::<Entry>(inproc::entries_offset(), entries)
        .into_iter()
        .filter(|e| e.code != 0)
        .map(|e| Function {
            code: e.code,
            qualname: map.string(&h, e.qualname),
            filename: map.string(&h, e.filename),
            firstlineno: e.firstlineno,
            ncalls: e.ncalls,
            primitive: e.primitive,
            tottime_ns: e.tottime_ns,
            cumtime_ns: e.cumtime_ns,
        })
        .collect();
    let edges = if edges {
        map.records::<Edge>(inproc::edges_offset(entries), h.edges_cap as usize)
            .into_iter()
            .filter(|e| e.callee != 0)
            .collect()
    } else {
        Vec::new()
    };
    Counts {
        pid: h.pid,
        functions,
        edges,
        lost_calls: h.lost_calls,
        lost_edges: h.lost_edges,
        lost_names: h.lost_names,
        state: h.state,
        namespace_pid: false,
    }
}

/// A process counted in-process, and the directory its counter works in.
pub struct Counter {
    pub pid: u32,
    /// Its pid in its own pid namespace.
    own: u32,
    /// The directory and the process's `/tmp`, held open: a chrooted process's root, through
    /// which tracerd reached them, goes when the process does. And the directory's name.
    dir: Dir,
    name: String,
    /// The process's counts file, locked (`LOCK_EX`) while tracerd holds it: a counter that
    /// can lock it knows tracerd died and stops.
    _file: fs::File,
    map: Mapping,
}

/// Whether `pid` can still run a script: not gone, not a zombie.
fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the command name's closing parenthesis.
        let state = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next());
        !matches!(state, Some('Z' | 'X') | None)
    })
}

/// The pid a process knows itself by (in its own pid namespace).
fn own_pid(pid: u32) -> Option<u32> {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// Pids as a counted process's pid namespace knows them → pids here.
enum Pids {
    /// The daemon's own namespace.
    Same,
    /// Another: the live processes of that namespace.
    Map(std::collections::HashMap<u32, u32>),
}

impl Pids {
    fn of(pid: u32) -> Self {
        let Some(own) = own_pid(pid) else {
            return Self::Same;
        };
        if own == pid {
            return Self::Same;
        }
        let ns = |p: u32| fs::read_link(format!("/proc/{p}/ns/pid")).ok();
        let mine = ns(pid);
        let mut out = std::collections::HashMap::from([(own, pid)]);
        for e in fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
        {
            let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if ns(p) == mine {
                if let Some(o) = own_pid(p) {
                    out.insert(o, p);
                }
            }
        }
        Self::Map(out)
    }

    /// The pid here; unknown for a process of another namespace that is gone.
    fn host(&self, own: u32) -> Option<u32> {
        match self {
            Self::Same => Some(own),
            Self::Map(m) => m.get(&own).copied(),
        }
    }
}

/// Cleanups still waiting for removal scripts.
static CLEANUPS: AtomicU32 = AtomicU32::new(0);

/// Waits up to `limit` for the cleanups of ended sessions (tracerd is exiting).
pub fn wait_cleanups(limit: Duration) {
    let started = Instant::now();
    while CLEANUPS.load(Ordering::SeqCst) > 0 && started.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The file-system uid and gid `pid` creates and opens files as.
fn fs_ids(pid: u32) -> Result<(u32, u32), String> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("reading pid {pid}'s status: {e}"))?;
    let field = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().nth(3))
            .and_then(|v| v.parse().ok())
    };
    field("Uid:")
        .zip(field("Gid:"))
        .ok_or_else(|| format!("pid {pid}'s status has no Uid/Gid lines"))
}

/// How long the counters of an ended session may take to leave the last callback.
const BUSY_WAIT: Duration = Duration::from_millis(200);
/// How long the removal scripts may take to run before their files are left behind.
const CLEANUP_WAIT: Duration = Duration::from_secs(30);

/// Has `pid` load the counter and start counting; waits up to `wait` for it. `tag` makes the
/// directory's name unique (the session id). On error the process is to be counted with
/// uprobes; the error says why, in words for the report.
pub fn start(pid: u32, tag: &str, wait: Duration) -> Result<Counter, String> {
    remote_exec::remote_debugging(pid).map_err(|e| e.to_string())?;
    let library = library()?;
    let owner = fs_ids(pid)?;
    let name = format!("tracer-{tag}-{pid}");
    let target_dir = format!("/tmp/{name}");
    let dir = Dir::make(pid, &name)
        .map_err(|e| format!("creating {target_dir} in the process's root: {e}"))?;
    let fail = |why: String| {
        dir.remove(&name);
        why
    };
    let lib =
        fs::read(&library).map_err(|e| fail(format!("reading {}: {e}", library.display())))?;
    dir.create("_tracer_pycount.so", 0o644, owner, &lib)
        .map_err(fail)?;
    // Named as the counter names its children's: by the pid its own namespace knows.
    let own = own_pid(pid).unwrap_or(pid);
    let file_name = format!("{}{own}", inproc::FILE_PREFIX);
    let size = inproc::file_size(inproc::ENTRIES, inproc::EDGES, inproc::STRINGS);
    let file = dir.create(&file_name, 0o600, owner, &[]).map_err(fail)?;
    file.set_len(size as u64)
        .map_err(|e| fail(format!("sizing the counts file: {e}")))?;
    // SAFETY: plain syscall on our own descriptor.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(fail(format!(
            "locking the counts file: {}",
            std::io::Error::last_os_error()
        )));
    }
    let map = Mapping::new(&file).map_err(|e| fail(format!("mapping the counts file: {e}")))?;
    let header = Header::new(pid, state::PENDING, inproc::CAPS);
    // SAFETY: the mapping starts with room for a header; nobody else writes it yet.
    unsafe { std::ptr::write_volatile(map.ptr.cast::<Header>(), header) };
    let script = start_script(
        &target_dir,
        &format!("{target_dir}/{file_name}"),
        &format!("{target_dir}/_tracer_pycount.so"),
    );
    dir.create("start.py", 0o644, owner, script.as_bytes())
        .map_err(fail)?;
    // Only now the process's user's: tracerd's files are in place.
    dir.give(owner)
        .map_err(|e| fail(format!("giving {target_dir} to the process's user: {e}")))?;
    let start_path = format!("{target_dir}/start.py");
    remote_exec::request(pid, &start_path).map_err(|e| fail(e.to_string()))?;
    let counter = Counter {
        pid,
        own,
        dir,
        name,
        _file: file,
        map,
    };
    let started = Instant::now();
    let outcome = loop {
        match counter.map.state().load(Ordering::SeqCst) {
            state::RUNNING => break Ok(()),
            state::REFUSED => {
                let why = counter.map.header().why;
                let len = why.iter().position(|&b| b == 0).unwrap_or(why.len());
                break Err(String::from_utf8_lossy(&why[..len]).into_owned());
            }
            _ if counter.dir.exists(LOAD_ERROR) => {
                let why = counter.dir.read_text(LOAD_ERROR).unwrap_or_default();
                let _ = counter.map.state().compare_exchange(
                    state::PENDING,
                    state::CANCELLED,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                );
                break Err(why);
            }
            _ if started.elapsed() >= wait => {
                // Exactly one of tracerd and the counter decides.
                match counter.map.state().compare_exchange(
                    state::PENDING,
                    state::CANCELLED,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                ) {
                    Ok(_) => {
                        break Err(format!(
                            "the interpreter did not run tracer's start script within {} ms (no thread reached a safe point, or remote execution is compiled out)",
                            wait.as_millis()
                        ))
                    }
                    Err(_) => continue,
                }
            }
            _ => std::thread::sleep(Duration::from_millis(1)),
        }
    };
    // Threads that have not taken the request yet need not.
    let _ = remote_exec::withdraw(pid, &start_path);
    match outcome {
        Ok(()) => Ok(counter),
        Err(why) => {
            if counter.map.header().state == state::CANCELLED && !counter.dir.exists(LOAD_ERROR) {
                // The files stay while a thread may still run the start script, which then
                // deletes them (or the cleanup does, once the process is gone).
                counter.leave_behind();
            } else {
                // The script ran: nothing will open these files again.
                std::thread::sleep(Duration::from_millis(50));
                counter.dir.remove(&counter.name);
            }
            Err(why)
        }
    }
}

impl Counter {
    /// The tool id the counter took.
    pub fn tool_id(&self) -> u32 {
        self.map.header().tool_id
    }

    /// Lets the directory outlive this handle: a pending request may still name a script.
    fn leave_behind(self) {
        let pid = self.pid;
        cleanup_later(self.dir, self.name, Vec::new(), vec![pid]);
    }

    /// The functions counted so far in the process and its forked children (Prometheus'
    /// live view), without stopping anything; children by the pid their namespace knows.
    pub fn peek(&self) -> Vec<Counts> {
        let mut out = vec![read_counts(&self.map, false)];
        out[0].pid = self.pid;
        for (own, name) in self.dir.counts_files() {
            if own == self.own {
                continue;
            }
            let map = self
                .dir
                .open(&name, false)
                .ok()
                .and_then(|f| Mapping::new_read_only(&f).ok());
            if let Some(map) = map.filter(|m| m.header().magic == inproc::MAGIC) {
                out.push(read_counts(&map, false));
            }
        }
        for c in &mut out {
            drop_script_frames(c);
        }
        out
    }

    /// Stops the counters of the process and of the children it forked, reads them, and has
    /// each live one removed. Cleaning up the files waits for the removal scripts, on a thread
    /// of its own.
    pub fn finish(self) -> Vec<Counts> {
        let mut out = Vec::new();
        let mut removals = Vec::new();
        let mut pids = vec![self.pid];
        // Files are named by the pid the process knows itself by (its pid namespace's).
        let hosts = Pids::of(self.pid);
        for (own, name) in self.dir.counts_files() {
            let host = if own == self.own {
                Some(self.pid)
            } else {
                hosts.host(own)
            };
            // A child of another pid namespace that is gone: known by that namespace's pid.
            let pid = host.unwrap_or(own);
            if host.is_some() {
                pids.push(pid);
            }
            let mapped = if own == self.own {
                None
            } else {
                self.dir
                    .open(&name, true)
                    .ok()
                    .and_then(|f| Mapping::new(&f).ok())
            };
            let map = mapped.as_ref().unwrap_or(&self.map);
            if map.header().magic != inproc::MAGIC {
                continue;
            }
            let _ = map.state().compare_exchange(
                state::RUNNING,
                state::STOPPED,
                Ordering::SeqCst,
                Ordering::SeqCst,
            );
            let since = Instant::now();
            while map.busy().load(Ordering::SeqCst) != 0 && since.elapsed() < BUSY_WAIT {
                std::thread::yield_now();
            }
            let mut counts = read_counts(map, true);
            drop_script_frames(&mut counts);
            counts.pid = pid;
            counts.namespace_pid = host.is_none();
            let tool = map.header().tool_id;
            if host.is_some() && (counts.state == state::RUNNING || counts.state == state::STOPPED)
            {
                removals.push((pid, own, tool));
            }
            out.push(counts);
        }
        let mut scripts = Vec::new();
        let target_dir = format!("/tmp/{}", self.name);
        for (pid, own, tool) in removals {
            if !alive(pid) {
                continue;
            }
            let counts = format!("{target_dir}/{}{own}", inproc::FILE_PREFIX);
            let name = format!("remove.{own}.py");
            let owner = fs_ids(pid).unwrap_or((0, 0));
            let script = remove_script(tool, &counts);
            if self
                .dir
                .create(&name, 0o644, owner, script.as_bytes())
                .is_ok()
            {
                let path = format!("{target_dir}/{name}");
                match remote_exec::request(pid, &path) {
                    Ok(_) => scripts.push((pid, own, path)),
                    Err(e) => tracing::debug!(pid, %e, "asking for the counter's removal"),
                }
            }
        }
        // The library is loaded where it will be; the start script has run or been withdrawn.
        self.dir.unlink("_tracer_pycount.so");
        self.dir.unlink("start.py");
        cleanup_later(self.dir, self.name, scripts, pids);
        out
    }
}

/// Deletes the session's files once nothing can still run them: a removal script once the
/// counts file it deletes is gone (it ran) or its process is; everything once the processes
/// are. Gives up after [`CLEANUP_WAIT`], leaving what is left.
/// `pids`: the processes (pids here) that could still run something in the directory.
fn cleanup_later(dir: Dir, name: String, scripts: Vec<(u32, u32, String)>, pids: Vec<u32>) {
    CLEANUPS.fetch_add(1, Ordering::SeqCst);
    let spawned = std::thread::Builder::new()
        .name("pycount-cleanup".into())
        .spawn(move || {
            struct Done;
            impl Drop for Done {
                fn drop(&mut self) {
                    CLEANUPS.fetch_sub(1, Ordering::SeqCst);
                }
            }
            let _done = Done;
            let started = Instant::now();
            let mut pending = scripts;
            loop {
                pending.retain(|(pid, own, path)| {
                    let counts = format!("{}{own}", inproc::FILE_PREFIX);
                    if alive(*pid) && dir.exists(&counts) {
                        return true;
                    }
                    if alive(*pid) {
                        // Ran in one thread: the others' requests go, then the file.
                        let _ = remote_exec::withdraw(*pid, path);
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    let file = Path::new(path).file_name().and_then(|n| n.to_str());
                    dir.unlink(file.unwrap_or(""));
                    false
                });
                // Once every process that could run something here is gone, nothing is
                // needed; while one lives, only an empty directory goes.
                if !pids.iter().any(|&p| alive(p)) {
                    dir.remove(&name);
                    break;
                }
                if pending.is_empty() && dir.remove_if_empty(&name) {
                    break;
                }
                if started.elapsed() > CLEANUP_WAIT {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
    if let Err(e) = spawned {
        CLEANUPS.fetch_sub(1, Ordering::SeqCst);
        tracing::warn!(%e, "starting the in-process counter's cleanup");
    }
}

/// What `capabilities` says about in-process counting.
pub fn describe() -> String {
    match library() {
        Ok(lib) => format!(
            "running CPython 3.14+ processes named by pid are counted in-process (sys.monitoring, {} loaded through PEP 768 remote execution, removed at the session's end); --python-uprobes-only counts them with uprobes",
            lib.file_name().unwrap_or_default().to_string_lossy()
        ),
        Err(why) => format!("unavailable: {why}; every process is counted with uprobes"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_run_of_the_start_script_is_not_counted() {
        let f = |code, qualname: &str, filename: &str| Function {
            code,
            qualname: qualname.into(),
            filename: filename.into(),
            ncalls: 1,
            ..Function::default()
        };
        let edge = |caller, callee| Edge {
            caller,
            callee,
            ncalls: 1,
            ..Edge::default()
        };
        let mut c = Counts {
            functions: vec![
                f(1, "<module>", "<string>"),
                f(2, "_tracer_pycount", "<string>"),
                f(3, "<module>", "<string>"),
                f(4, "work", "app.py"),
            ],
            edges: vec![edge(1, 2), edge(3, 4)],
            ..Counts::default()
        };
        drop_script_frames(&mut c);
        let left: Vec<u64> = c.functions.iter().map(|f| f.code).collect();
        assert_eq!(left, [3, 4], "a program's own exec'd code stays");
        assert_eq!(c.edges.len(), 1);
    }
}
