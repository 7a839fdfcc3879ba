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

use std::{
    fs::{self, File, OpenOptions},
    io::Write,
    os::{
        fd::AsRawFd,
        unix::fs::{chown, DirBuilderExt, OpenOptionsExt},
    },
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use tracer_common::inproc::{self, state, Edge, Entry, Header, StrRef};

use super::remote_exec;

/// The counter library's file name, beside tracerd's executable.
pub const LIBRARY: &str = "libtracer_pycount.so";

/// The library beside tracerd, if it is there.
pub fn library() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("finding tracerd's executable: {e}"))?;
    let lib = exe.with_file_name(LIBRARY);
    if lib.is_file() {
        Ok(lib)
    } else {
        Err(format!("{LIBRARY} is not beside tracerd"))
    }
}

/// A whole counts file, mapped shared.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory, read and written only through atomics and
// volatile copies; nothing in it is tied to a thread.
unsafe impl Send for Mapping {}

impl Mapping {
    fn new(file: &File) -> std::io::Result<Self> {
        Self::with(file, libc::PROT_READ | libc::PROT_WRITE)
    }

    /// For looking only: states and counts are not written through it.
    fn new_read_only(file: &File) -> std::io::Result<Self> {
        Self::with(file, libc::PROT_READ)
    }

    fn with(file: &File, prot: libc::c_int) -> std::io::Result<Self> {
        let len = usize::try_from(file.metadata()?.len()).unwrap_or(0);
        if len < inproc::HEADER_SIZE {
            return Err(std::io::Error::other("counts file shorter than its header"));
        }
        // SAFETY: a fresh shared mapping of a file we hold open; checked for failure.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    fn header(&self) -> Header {
        // SAFETY: the header lies at the start of a mapping at least HEADER_SIZE long; the
        // process may write it meanwhile, hence a volatile copy.
        unsafe { std::ptr::read_volatile(self.ptr.cast::<Header>()) }
    }

    fn word(&self, offset: usize) -> &AtomicU32 {
        // SAFETY: `offset` is a 4-byte-aligned field of the header, inside the mapping;
        // AtomicU32 has u32's layout.
        unsafe { &*self.ptr.add(offset).cast::<AtomicU32>() }
    }

    fn state(&self) -> &AtomicU32 {
        self.word(std::mem::offset_of!(Header, state))
    }

    fn busy(&self) -> &AtomicU32 {
        self.word(std::mem::offset_of!(Header, busy))
    }

    /// Copies `count` records of type `T` from `offset`, if they lie inside the mapping.
    fn records<T: Copy>(&self, offset: usize, count: usize) -> Vec<T> {
        let size = std::mem::size_of::<T>();
        if offset + count * size > self.len {
            return Vec::new();
        }
        (0..count)
            // SAFETY: inside the mapping (checked above); records are plain `repr(C)` data.
            .map(|i| unsafe {
                std::ptr::read_volatile(self.ptr.add(offset + i * size).cast::<T>())
            })
            .collect()
    }

    fn string(&self, h: &Header, s: StrRef) -> String {
        let base = inproc::strings_offset(h.entries_cap as usize, h.edges_cap as usize);
        let (off, len) = (s.offset as usize, s.len as usize);
        if off + len > h.strings_cap as usize || base + off + len > self.len {
            return String::new();
        }
        // SAFETY: inside the mapping (checked above).
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr.add(base + off), len) };
        String::from_utf8_lossy(bytes).into_owned()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
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
    _file: File,
    map: Mapping,
}

/// An open directory whose files are reached as `/proc/self/fd/N/NAME`.
struct Dir {
    this: File,
    parent: File,
}

impl Dir {
    fn open(path: &Path) -> std::io::Result<Self> {
        Ok(Self {
            this: File::open(path)?,
            parent: File::open(path.parent().unwrap_or(Path::new("/")))?,
        })
    }

    fn at(&self, name: &str) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}/{name}", self.this.as_raw_fd()))
    }

    /// The directory's own path in its parent, for removing it.
    fn in_parent(&self, name: &str) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}/{name}", self.parent.as_raw_fd()))
    }

    /// Deletes its files, then itself (`name` in its parent).
    fn remove(&self, name: &str) {
        if let Ok(rd) = fs::read_dir(self.at("")) {
            for e in rd.filter_map(Result::ok) {
                let _ = fs::remove_file(self.at(&e.file_name().to_string_lossy()));
            }
        }
        let _ = fs::remove_dir(self.in_parent(name));
    }

    /// (pid, file name) of every counts file in it.
    fn counts_files(&self) -> Vec<(u32, String)> {
        fs::read_dir(self.at(""))
            .map(|rd| {
                rd.filter_map(Result::ok)
                    .filter_map(|e| {
                        let name = e.file_name().into_string().ok()?;
                        let pid = name.strip_prefix(inproc::FILE_PREFIX)?.parse().ok()?;
                        Some((pid, name))
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
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

fn create(path: &Path, mode: u32, owner: (u32, u32), bytes: &[u8]) -> Result<File, String> {
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| format!("creating {}: {e}", path.display()))?;
    f.write_all(bytes)
        .map_err(|e| format!("writing {}: {e}", path.display()))?;
    chown(path, Some(owner.0), Some(owner.1))
        .map_err(|e| format!("giving {} to the process's user: {e}", path.display()))?;
    Ok(f)
}

/// A Python string literal.
fn py_str(s: &str) -> String {
    format!("{s:?}")
}

const EVENTS: &str = "(E.PY_START, module.py_start), (E.PY_RESUME, module.py_resume), \
    (E.PY_THROW, module.py_throw), (E.PY_RETURN, module.py_return), \
    (E.PY_YIELD, module.py_yield), (E.PY_UNWIND, module.py_unwind)";

/// Runs in the process (PEP 768 runs it in a namespace of its own). It must never raise:
/// the interpreter would print the exception on the program's stderr. When it does not
/// count (tracerd gave up waiting, or it cannot), it deletes the directory's files itself:
/// tracerd has withdrawn the other threads' requests by then.
fn start_script(dir: &str, counts: &str, library: &str) -> String {
    format!(
        r#"def _tracer_pycount(directory, counts, library):
    import os, sys
    monitoring = sys.monitoring

    def cleanup():
        for name in os.listdir(directory):
            try:
                os.unlink(os.path.join(directory, name))
            except BaseException:
                pass
        try:
            os.rmdir(directory)
        except BaseException:
            pass

    # Every thread was asked: a second run finds the counter started (or given up on) and
    # leaves, calling nothing in Python (its own two frames are taken out of the report).
    try:
        with open(counts, "rb") as f:
            head = f.read(16)
        if len(head) < 16 or int.from_bytes(head[12:16], "little") != {PENDING}:
            return
    except BaseException:
        return
    try:
        from importlib.machinery import ExtensionFileLoader
        from importlib.util import module_from_spec, spec_from_loader
        loader = ExtensionFileLoader("_tracer_pycount", library)
        module = module_from_spec(spec_from_loader("_tracer_pycount", loader))
        loader.exec_module(module)
    except BaseException as e:
        try:
            with open(os.path.join(directory, "{LOAD_ERROR}"), "w") as f:
                f.write(f"loading the counter library: {{e!r}}")
        except BaseException:
            pass
        return
    tool = None
    started = False
    try:
        for t in (3, 4):
            if monitoring.get_tool(t) is None:
                monitoring.use_tool_id(t, "tracer")
                tool = t
                break
        else:
            held = ", ".join(f"{{t}}: {{monitoring.get_tool(t)}}" for t in (3, 4))
            module.refuse(counts, f"sys.monitoring tool ids 3 and 4 are taken ({{held}})")
            cleanup()
            return
        if not module.start(counts, tool, monitoring.DISABLE):
            monitoring.free_tool_id(tool)
            cleanup()
            return
        started = True
        E = monitoring.events
        for event, callback in ({EVENTS}):
            monitoring.register_callback(tool, event, callback)
        monitoring.set_events(tool, E.PY_START | E.PY_RESUME | E.PY_THROW | E.PY_RETURN | E.PY_YIELD | E.PY_UNWIND)
    except BaseException as e:
        try:
            module.refuse(counts, f"starting the counter: {{e!r}}")
            if started:
                module.stop()
            if tool is not None:
                monitoring.set_events(tool, 0)
                monitoring.free_tool_id(tool)
        except BaseException:
            pass
_tracer_pycount({}, {}, {})
"#,
        py_str(dir),
        py_str(counts),
        py_str(library)
    )
}

const PENDING: u32 = state::PENDING;

/// Written by the start script when the library does not load (a musl libc, say).
const LOAD_ERROR: &str = "load-error";

/// Frees the tool id, drops the counter's references, and deletes the process's counts file
/// last: tracerd takes the file's absence as "done".
fn remove_script(tool: u32, counts: &str) -> String {
    format!(
        r#"def _tracer_pycount_remove(tool, counts):
    import sys, os
    monitoring = sys.monitoring
    try:
        if monitoring.get_tool(tool) == "tracer":
            monitoring.set_events(tool, 0)
            E = monitoring.events
            previous = [monitoring.register_callback(tool, e, None) for e in (E.PY_START, E.PY_RESUME, E.PY_THROW, E.PY_RETURN, E.PY_YIELD, E.PY_UNWIND)]
            monitoring.free_tool_id(tool)
            # Where the callbacks answered DISABLE (between the session's end and now), the
            # interpreter would skip a later session's tool there too.
            monitoring.restart_events()
            module = getattr(previous[0], "__self__", None)
            if module is not None and hasattr(module, "stop"):
                module.stop()
    except BaseException:
        pass
    try:
        os.unlink(counts)
    except BaseException:
        pass
_tracer_pycount_remove({tool}, {})
"#,
        py_str(counts)
    )
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
    let dir = PathBuf::from(format!("/proc/{pid}/root{target_dir}"));
    fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|e| format!("creating {target_dir} in the process's root: {e}"))?;
    let fail = |why: String| {
        let _ = fs::remove_dir_all(&dir);
        why
    };
    chown(&dir, Some(owner.0), Some(owner.1))
        .map_err(|e| fail(format!("giving {target_dir} to the process's user: {e}")))?;
    let held = Dir::open(&dir).map_err(|e| fail(format!("opening {target_dir}: {e}")))?;
    let lib =
        fs::read(&library).map_err(|e| fail(format!("reading {}: {e}", library.display())))?;
    create(&dir.join("_tracer_pycount.so"), 0o644, owner, &lib).map_err(fail)?;
    // Named as the counter names its children's: by the pid its own namespace knows.
    let own = own_pid(pid).unwrap_or(pid);
    let file_name = format!("{}{own}", inproc::FILE_PREFIX);
    let size = inproc::file_size(inproc::ENTRIES, inproc::EDGES, inproc::STRINGS);
    let file = create(&dir.join(&file_name), 0o600, owner, &[]).map_err(fail)?;
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
    let header = Header {
        magic: inproc::MAGIC,
        version: inproc::VERSION,
        state: state::PENDING,
        busy: 0,
        tool_id: 0,
        pid,
        entries_cap: inproc::ENTRIES as u32,
        edges_cap: inproc::EDGES as u32,
        strings_cap: inproc::STRINGS as u32,
        entries_used: 0,
        edges_used: 0,
        strings_used: 0,
        _pad: 0,
        lost_calls: 0,
        lost_edges: 0,
        lost_names: 0,
        why: [0; 256],
    };
    // SAFETY: the mapping starts with room for a header; nobody else writes it yet.
    unsafe { std::ptr::write_volatile(map.ptr.cast::<Header>(), header) };
    let script = start_script(
        &target_dir,
        &format!("{target_dir}/{file_name}"),
        &format!("{target_dir}/_tracer_pycount.so"),
    );
    create(&dir.join("start.py"), 0o644, owner, script.as_bytes()).map_err(fail)?;
    let start_path = format!("{target_dir}/start.py");
    remote_exec::request(pid, &start_path).map_err(|e| fail(e.to_string()))?;
    let counter = Counter {
        pid,
        own,
        dir: held,
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
            _ if counter.dir.at(LOAD_ERROR).exists() => {
                let why = fs::read_to_string(counter.dir.at(LOAD_ERROR)).unwrap_or_default();
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
            if counter.map.header().state == state::CANCELLED
                && !counter.dir.at(LOAD_ERROR).exists()
            {
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
            let map = File::open(self.dir.at(&name))
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
            let path = self.dir.at(&name);
            let mapped = if own == self.own {
                None
            } else {
                File::options()
                    .read(true)
                    .write(true)
                    .open(&path)
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
            if create(
                &self.dir.at(&name),
                0o644,
                owner,
                remove_script(tool, &counts).as_bytes(),
            )
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
        let _ = fs::remove_file(self.dir.at("_tracer_pycount.so"));
        let _ = fs::remove_file(self.dir.at("start.py"));
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
                    if alive(*pid) && dir.at(&counts).exists() {
                        return true;
                    }
                    if alive(*pid) {
                        // Ran in one thread: the others' requests go, then the file.
                        let _ = remote_exec::withdraw(*pid, path);
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    let file = Path::new(path).file_name().and_then(|n| n.to_str());
                    let _ = fs::remove_file(dir.at(file.unwrap_or("")));
                    false
                });
                if pending.is_empty() || started.elapsed() > CLEANUP_WAIT {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            // Once every process that could run a script here is gone, nothing is needed.
            let live = pids.into_iter().any(alive);
            if !live && pending.is_empty() {
                dir.remove(&name);
            } else {
                // Empty once the removal scripts have run.
                let _ = fs::remove_dir(dir.in_parent(&name));
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

    #[test]
    fn scripts_are_python_with_their_paths_quoted() {
        let s = start_script("/tmp/a b", "/tmp/a b/counts.1", "/tmp/a \"b\"/lib.so");
        assert!(s.contains(
            r#"_tracer_pycount("/tmp/a b", "/tmp/a b/counts.1", "/tmp/a \"b\"/lib.so")"#
        ));
        assert!(s.contains("monitoring.set_events(tool, E.PY_START"));
        let r = remove_script(3, "/tmp/x/counts.7");
        assert!(r.ends_with("_tracer_pycount_remove(3, \"/tmp/x/counts.7\")\n"));
    }
}
