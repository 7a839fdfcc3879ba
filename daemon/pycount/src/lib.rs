//! `libtracer_pycount.so`: the CPython extension module `_tracer_pycount`, which counts a
//! process's Python calls from inside it with `sys.monitoring` (PEP 669) callbacks written in
//! C (a C profile function on 3.10 and 3.11), into the file tracerd shares with it (`tracer_common::inproc`). tracerd has the
//! interpreter run a script (PEP 768) that loads the module, calls `start`, registers the six
//! callbacks below under a free tool id and turns their events on.
//!
//! Module functions (all positional):
//! - `start(path, tool_id, disable) -> bool`: takes the session's file over (PENDING →
//!   RUNNING); False when tracerd gave up on it already. `disable` is `sys.monitoring.DISABLE`.
//! - `start_profile(path) -> bool`: as `start`, for CPython 3.10 and 3.11: a C profile
//!   function on every thread state, later threads' too (`profile.rs`), rather than
//!   `sys.monitoring` callbacks.
//! - `refuse(path, why)`: PENDING → REFUSED, with the reason.
//! - `stop() -> int`: RUNNING → STOPPED, lets go of everything; returns the tool id (-1: never
//!   started).
//! - `py_start`, `py_resume`, `py_throw` (a call enters) and `py_return`, `py_yield`,
//!   `py_unwind` (it leaves): the callbacks of the events of the same names.
//!
//! Semantics are the BPF counter's (`ebpf/probes/src/python/`), which are cProfile's: a
//! call counts when it enters, primitive when its function is not active further down the
//! same thread; times count when it leaves, caller pairs too. The GIL serializes callbacks,
//! so the process-wide state needs no locks; each thread keeps its own shadow stack.

mod clock;
mod ffi;
mod file;
mod profile;

use std::{
    cell::UnsafeCell,
    collections::HashMap,
    ffi::{c_int, c_long, CStr},
    hash::{BuildHasherDefault, DefaultHasher},
    ptr,
    sync::{atomic::Ordering, Once},
};

use tracer_common::inproc::{state, StrRef};

use clock::Clock;
use ffi::*;
use file::{Shared, Slot};

/// Callbacks between checks that tracerd still holds its lock on the file.
const ORPHAN_CHECK_EVERY: u32 = 1 << 16;
/// A frame whose function has no entry (the table was full).
const NO_SLOT: u32 = u32::MAX;

/// Process-wide state. Touched with the GIL held, or by the atfork child handler, which runs
/// in the child's only thread.
struct Gil<T>(UnsafeCell<T>);
// SAFETY: see above: never touched by two threads at once.
unsafe impl<T> Sync for Gil<T> {}

struct Counter {
    /// `shared` is this process's own file and counting may go on (its state decides).
    live: bool,
    shared: Shared,
    /// A forked child, still mapping its parent's file: it takes a file of its own at its
    /// first callback (not in the atfork handler: a child that execs right away, as
    /// subprocess's do, leaves no file behind, and the handler stays async-signal-safe).
    pending_fork: bool,
    /// The file counted into, and the session's file, whose lock says whether tracerd lives
    /// (a forked child keeps its parent's open for that).
    fd: c_int,
    lock_fd: c_int,
    /// Where a forked child creates its file.
    dir: Vec<u8>,
    tool_id: c_long,
    /// `sys.monitoring.DISABLE` (a strong reference), returned once counting has ended.
    disable: *mut PyObject,
    /// The references taken to code objects listed in a table (and to their file names),
    /// private to the process: a forked child inherits them along with the objects.
    held: Vec<*mut PyObject>,
    /// File name str → where the current file holds it: each file name is stored once.
    filenames: HashMap<usize, StrRef, BuildHasherDefault<DefaultHasher>>,
    ticks: u32,
    clock: Clock,
    /// Bumped whenever the tables change (start, stop, a fork): threads' stacks that belong
    /// to another generation are emptied before use.
    generation: u64,
}

static COUNTER: Gil<Counter> = Gil(UnsafeCell::new(Counter {
    live: false,
    shared: Shared::NONE,
    pending_fork: false,
    fd: -1,
    lock_fd: -1,
    dir: Vec::new(),
    tool_id: -1,
    disable: ptr::null_mut(),
    held: Vec::new(),
    filenames: HashMap::with_hasher(BuildHasherDefault::new()),
    ticks: 0,
    clock: Clock::NEW,
    generation: 0,
}));

static ATFORK: Once = Once::new();

/// The process-wide state.
///
/// # Safety
/// The GIL is held (or the process has one thread) and no other reference to it is live.
#[allow(clippy::mut_from_ref)]
unsafe fn counter() -> &'static mut Counter {
    // SAFETY: the caller's promise.
    unsafe { &mut *COUNTER.0.get() }
}

/// One call on a thread's shadow stack.
struct Frame {
    code: u64,
    /// The code of the frame below (0: none).
    caller: u64,
    start_ns: u64,
    /// Time spent in calls it made.
    child_ns: u64,
    /// Its function's entry, or `NO_SLOT`.
    slot: u32,
    /// 1 + the index of the next frame down running the same function (0: none).
    prev_same: u32,
    /// No frame further down runs its function.
    outermost: bool,
    /// No frame further down runs its function called by the same caller.
    edge_outermost: bool,
}

struct Thread {
    generation: u64,
    stack: Vec<Frame>,
    /// Per entry slot: 1 + the index of the topmost frame running that function (0: none).
    /// Zero-allocated at the table's size, so that pages never touched cost nothing.
    top_of: Vec<u32>,
}

impl Thread {
    fn reset(&mut self, generation: u64, cap: usize) {
        if self.top_of.len() == cap {
            // Only functions on the stack have a nonzero slot.
            for f in &self.stack {
                if let Some(x) = self.top_of.get_mut(f.slot as usize) {
                    *x = 0;
                }
            }
        } else {
            self.top_of = vec![0; cap];
        }
        self.stack.clear();
        self.generation = generation;
    }
}

thread_local! {
    static THREAD: UnsafeCell<Thread> = const {
        UnsafeCell::new(Thread { generation: 0, stack: Vec::new(), top_of: Vec::new() })
    };
}

impl Counter {
    /// Counts one event: `enter` a call, or leave it. False once counting has ended (or never
    /// began), so that the callback asks the interpreter to stop calling it there.
    #[inline(always)]
    fn on_event(&mut self, code: *mut PyObject, enter: bool) -> bool {
        if !(self.live || self.pending_fork && self.take_over()) {
            return false;
        }
        let sh = self.shared;
        let busy = sh.busy();
        // Dekker with tracerd, which sets `state` then waits for `busy` to clear: the
        // locked exchange is the full fence between the two (cheaper than mfence).
        busy.swap(1, Ordering::SeqCst);
        if sh.state().load(Ordering::SeqCst) != state::RUNNING {
            busy.store(0, Ordering::Release);
            return false;
        }
        self.ticks = self.ticks.wrapping_add(1);
        if self.ticks.is_multiple_of(ORPHAN_CHECK_EVERY) {
            self.check_orphan();
            self.clock.calibrate();
        }
        let code = code as u64;
        let _ = THREAD.try_with(|t| {
            // SAFETY: this thread's own state; callbacks do not nest (the interpreter turns
            // events off while one runs).
            let t = unsafe { &mut *t.get() };
            if t.generation != self.generation {
                t.reset(self.generation, sh.entries_cap());
            }
            if enter {
                self.push(t, code);
            } else {
                self.pop(t, code);
            }
        });
        busy.store(0, Ordering::Release);
        true
    }

    #[inline(always)]
    fn push(&mut self, t: &mut Thread, code: u64) {
        let sh = self.shared;
        let slot = match sh.find(code) {
            Slot::Found(i) => i as u32,
            Slot::Free(i) => {
                self.add_function(i, code as *mut PyObject);
                i as u32
            }
            Slot::Full => {
                sh.lost_calls();
                NO_SLOT
            }
        };
        let caller = t.stack.last().map_or(0, |f| f.code);
        let (mut prev_same, mut edge_outermost) = (0, true);
        if let Some(top) = t.top_of.get_mut(slot as usize) {
            prev_same = *top;
            // The same function further down: is any of its frames called by `caller`?
            let mut j = prev_same;
            while let Some(f) = j.checked_sub(1).and_then(|i| t.stack.get(i as usize)) {
                if f.caller == caller {
                    edge_outermost = false;
                    break;
                }
                j = f.prev_same;
            }
            *top = t.stack.len() as u32 + 1;
            let e = sh.entry(slot as usize);
            // SAFETY: fields of a mapped entry.
            unsafe {
                Shared::add(&raw mut (*e).ncalls, 1);
                if prev_same == 0 {
                    Shared::add(&raw mut (*e).primitive, 1);
                }
            }
        }
        t.stack.push(Frame {
            code,
            caller,
            start_ns: self.clock.now(),
            child_ns: 0,
            slot,
            prev_same,
            outermost: prev_same == 0,
            edge_outermost,
        });
    }

    #[inline(always)]
    fn pop(&mut self, t: &mut Thread, code: u64) {
        // Not the top: a frame that began before counting did (or before this process was
        // forked) ends.
        match t.stack.last() {
            Some(f) if f.code == code => {}
            _ => return,
        }
        let now = self.clock.now();
        let Some(f) = t.stack.pop() else { return };
        let ct = now.saturating_sub(f.start_ns);
        let tt = ct.saturating_sub(f.child_ns);
        let parent_slot = t.stack.last_mut().map(|p| {
            p.child_ns += ct;
            p.slot
        });
        let Some(top) = t.top_of.get_mut(f.slot as usize) else {
            return;
        };
        *top = f.prev_same;
        let sh = self.shared;
        let e = sh.entry(f.slot as usize);
        // SAFETY: fields of a mapped entry.
        unsafe {
            Shared::add(&raw mut (*e).tottime_ns, tt);
            if f.outermost {
                Shared::add(&raw mut (*e).cumtime_ns, ct);
            }
        }
        match parent_slot {
            None => {}
            // A caller without an entry could not be named.
            Some(NO_SLOT) => sh.lost_edges(),
            Some(_) => sh.add_edge(f.caller, code, tt, ct, f.edge_outermost),
        }
    }

    /// A function's first call: list it, keeping its code object (and so its address) alive.
    #[cold]
    fn add_function(&mut self, i: usize, code: *mut PyObject) {
        // SAFETY: GIL held; `code` is the live code object the interpreter passed.
        unsafe { Py_IncRef(code) };
        self.held.push(code);
        // 3.10 has no co_qualname: named by co_name there, as cProfile does.
        let qualname = self
            .name(code, c"co_qualname", false)
            .or_else(|| self.name(code, c"co_name", false));
        let filename = self.name(code, c"co_filename", true);
        let line = firstlineno(code);
        let sh = self.shared;
        sh.insert(
            i,
            code as u64,
            qualname.unwrap_or_default(),
            filename.unwrap_or_default(),
            line.unwrap_or(0),
        );
        if qualname.is_none() || filename.is_none() || line.is_none() {
            sh.lost_names();
        }
    }

    /// A str attribute of a code object, copied into the strings area.
    fn name(&mut self, code: *mut PyObject, attr: &CStr, shared_name: bool) -> Option<StrRef> {
        // SAFETY: GIL held; a code object's attributes run no Python code.
        let o = unsafe { PyObject_GetAttrString(code, attr.as_ptr()) };
        if o.is_null() {
            // SAFETY: GIL held.
            unsafe { PyErr_Clear() };
            return None;
        }
        if shared_name {
            if let Some(&r) = self.filenames.get(&(o as usize)) {
                // SAFETY: the new reference GetAttr returned.
                unsafe { Py_DecRef(o) };
                return Some(r);
            }
        }
        // SAFETY: `o` lives until the DecRef below, after the copy.
        let r = unsafe { utf8(o) }.and_then(|s| self.shared.put_str(s));
        match r {
            // The reference is kept: the str's address stays its own while it is a key.
            Some(r) if shared_name => {
                self.filenames.insert(o as usize, r);
                self.held.push(o);
            }
            // SAFETY: the new reference GetAttr returned.
            _ => unsafe { Py_DecRef(o) },
        }
        r
    }

    /// tracerd is gone: it holds an exclusive lock on the session's file while it lives.
    fn orphaned(&self) -> bool {
        if self.lock_fd < 0 {
            return false;
        }
        // SAFETY: our own descriptor; non-blocking.
        let got = unsafe { libc::flock(self.lock_fd, libc::LOCK_SH | libc::LOCK_NB) } == 0;
        if got {
            // SAFETY: as above.
            unsafe { libc::flock(self.lock_fd, libc::LOCK_UN) };
        }
        got
    }

    #[cold]
    fn check_orphan(&self) {
        if self.orphaned() {
            let _ = self.shared.state().compare_exchange(
                state::RUNNING,
                state::ORPHANED,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }

    /// A forked child's first callback: count into a file of its own from now on, if the
    /// parent's session still runs; on any failure count nothing.
    #[cold]
    fn take_over(&mut self) -> bool {
        self.pending_fork = false;
        let parent = self.shared;
        let made = if parent.state().load(Ordering::Acquire) == state::RUNNING {
            file::create_child(&self.dir, &parent.header(), self.tool_id as u32).ok()
        } else {
            None
        };
        // The parent's file is the parent's: the child writes nothing more into it.
        self.shared.unmap();
        if self.fd != self.lock_fd {
            close(&mut self.fd);
        }
        self.fd = -1;
        match made {
            Some((fd, sh)) => {
                self.fd = fd;
                self.shared = sh;
                self.live = true;
                self.generation += 1;
                self.filenames.clear();
                true
            }
            None => {
                close(&mut self.lock_fd);
                false
            }
        }
    }

    /// Lets go of the file (unmapped, closed); callbacks do nothing from now on.
    fn release(&mut self) {
        self.live = false;
        self.pending_fork = false;
        self.shared.unmap();
        if self.fd != self.lock_fd {
            close(&mut self.fd);
        }
        self.fd = -1;
        close(&mut self.lock_fd);
        self.filenames.clear();
        self.generation += 1;
    }

    /// Ends counting: RUNNING → STOPPED in the process's own file, everything let go. Returns
    /// the references to drop, which the caller drops once it holds no `&mut Counter` (a code
    /// object's end may run Python code: weakref callbacks).
    fn stop(&mut self) -> Vec<*mut PyObject> {
        if self.live {
            let _ = self.shared.state().compare_exchange(
                state::RUNNING,
                state::STOPPED,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
        self.release();
        std::mem::take(&mut self.held)
    }
}

fn close(fd: &mut c_int) {
    if *fd >= 0 {
        // SAFETY: our own descriptor.
        unsafe { libc::close(*fd) };
    }
    *fd = -1;
}

fn firstlineno(code: *mut PyObject) -> Option<i32> {
    // SAFETY: GIL held; errors are cleared.
    unsafe {
        let o = PyObject_GetAttrString(code, c"co_firstlineno".as_ptr());
        if o.is_null() {
            PyErr_Clear();
            return None;
        }
        let v = PyLong_AsLong(o);
        Py_DecRef(o);
        if v == -1 && !PyErr_Occurred().is_null() {
            PyErr_Clear();
            return None;
        }
        i32::try_from(v).ok()
    }
}

/// The directory of `path`, absolute (a child creates its file there, whatever its working
/// directory is by then).
fn dir_of(path: &[u8]) -> Vec<u8> {
    let dir = match path.iter().rposition(|&b| b == b'/') {
        Some(0) => b"/".to_vec(),
        Some(i) => path[..i].to_vec(),
        None => b".".to_vec(),
    };
    if dir.first() == Some(&b'/') {
        return dir;
    }
    match std::env::current_dir() {
        Ok(cwd) => {
            let mut abs = std::os::unix::ffi::OsStrExt::as_bytes(cwd.as_os_str()).to_vec();
            abs.push(b'/');
            abs.extend_from_slice(&dir);
            abs
        }
        Err(_) => dir,
    }
}

/// Runs in a forked child before anything else there.
extern "C" fn forked_child() {
    // SAFETY: the child's only thread; the GIL's holder (if any) forked.
    let g = unsafe { counter() };
    if g.live {
        g.live = false;
        g.pending_fork = true;
    }
}

unsafe extern "C" fn start(
    _module: *mut PyObject,
    args: *const *mut PyObject,
    nargs: isize,
) -> *mut PyObject {
    // SAFETY: the interpreter calls with the GIL held and `nargs` arguments at `args`.
    unsafe {
        if nargs != 3 {
            return raise("start(path, tool_id, disable) takes 3 arguments");
        }
        let a = std::slice::from_raw_parts(args, 3);
        let Some(path) = utf8(a[0]) else {
            return raise("start: path must be a str");
        };
        let path = path.to_vec();
        let tool_id = PyLong_AsLong(a[1]);
        if !PyErr_Occurred().is_null() || !(0..=5).contains(&tool_id) {
            PyErr_Clear();
            return raise("start: tool_id must be an int in 0..=5");
        }
        match take(&path, tool_id as u32, a[2]) {
            Ok(won) => PyBool_FromLong(c_long::from(won)),
            Err(e) => raise(&format!("start: {e}")),
        }
    }
}

/// Takes the session's file at `path` over (PENDING → RUNNING) and makes it this process's
/// counter: `tool_id` goes into the file, `disable` (a borrowed reference, or null) is what
/// callbacks answer once counting has ended. False when tracerd gave up on it already.
///
/// # Safety
/// The GIL is held; `disable` is null or a live object.
unsafe fn take(path: &[u8], tool_id: u32, disable: *mut PyObject) -> Result<bool, String> {
    // SAFETY: the caller's promise.
    unsafe {
        let g = counter();
        if g.live && g.shared.state().load(Ordering::Acquire) == state::RUNNING {
            return Err("already counting".into());
        }
        // What an ended session left (stopped by tracerd without `stop()`, or a forked
        // child's view of its parent's) goes first, once `g` is no longer borrowed.
        let old = if g.shared.is_mapped() {
            g.stop()
        } else {
            Vec::new()
        };
        let result = file::open_session(path).map(|(fd, mut sh)| {
            // A request left pending may be taken long after tracerd died (it holds an
            // exclusive lock on the file while it lives): then nobody would read the
            // counts, and nothing starts.
            let orphaned = libc::flock(fd, libc::LOCK_SH | libc::LOCK_NB) == 0;
            if orphaned {
                libc::flock(fd, libc::LOCK_UN);
            }
            let won = !orphaned
                && sh
                    .state()
                    .compare_exchange(
                        state::PENDING,
                        state::RUNNING,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_ok();
            if won {
                ptr::write_volatile(&raw mut (*sh.hdr).tool_id, tool_id);
                ptr::write_volatile(&raw mut (*sh.hdr).pid, libc::getpid() as u32);
                g.shared = sh;
                g.fd = fd;
                g.lock_fd = fd;
                g.dir = dir_of(path);
                g.tool_id = c_long::from(tool_id);
                g.live = true;
                g.ticks = 0;
                g.clock.start();
                g.generation += 1;
                g.filenames.clear();
                let previous = std::mem::replace(&mut g.disable, disable);
                if !disable.is_null() {
                    Py_IncRef(disable);
                }
                if !previous.is_null() {
                    Py_DecRef(previous);
                }
                ATFORK.call_once(|| {
                    libc::pthread_atfork(None, None, Some(forked_child));
                });
            } else {
                sh.unmap();
                libc::close(fd);
            }
            won
        });
        for o in old {
            Py_DecRef(o);
        }
        result
    }
}

unsafe extern "C" fn refuse(
    _module: *mut PyObject,
    args: *const *mut PyObject,
    nargs: isize,
) -> *mut PyObject {
    // SAFETY: as in `start`.
    unsafe {
        if nargs != 2 {
            return raise("refuse(path, why) takes 2 arguments");
        }
        let a = std::slice::from_raw_parts(args, 2);
        let (Some(path), Some(why)) = (utf8(a[0]), utf8(a[1])) else {
            return raise("refuse: path and why must be str");
        };
        let why = String::from_utf8_lossy(why);
        match file::refuse(path, &why) {
            Ok(()) => none(),
            Err(e) => raise(&format!("refuse: {e}")),
        }
    }
}

unsafe extern "C" fn stop(
    _module: *mut PyObject,
    _args: *const *mut PyObject,
    _nargs: isize,
) -> *mut PyObject {
    // SAFETY: GIL held; the references are dropped once `counter()`'s borrow has ended.
    unsafe {
        let (id, held) = {
            let g = counter();
            (g.tool_id, g.stop())
        };
        for o in held {
            Py_DecRef(o);
        }
        PyLong_FromLong(id)
    }
}

/// A callback's common part. `local`: the event can be disabled per code location.
#[inline(always)]
unsafe fn callback(
    args: *const *mut PyObject,
    nargs: isize,
    enter: bool,
    local: bool,
) -> *mut PyObject {
    // SAFETY: called by the interpreter with the GIL held and `nargs` arguments at `args`.
    unsafe {
        let g = counter();
        let counting = nargs < 1 || g.on_event(*args, enter);
        if counting || !local || g.disable.is_null() {
            return none();
        }
        Py_IncRef(g.disable);
        g.disable
    }
}

macro_rules! callbacks {
    ($($name:ident: $enter:expr, $local:expr;)*) => {$(
        unsafe extern "C" fn $name(
            _module: *mut PyObject,
            args: *const *mut PyObject,
            nargs: isize,
        ) -> *mut PyObject {
            // SAFETY: the interpreter's call, as `callback` needs it.
            unsafe { callback(args, nargs, $enter, $local) }
        }
    )*};
}

callbacks! {
    py_start: true, true;
    py_resume: true, true;
    py_throw: true, false;
    py_return: false, true;
    py_yield: false, true;
    py_unwind: false, false;
}

static mut METHODS: [PyMethodDef; 11] = [
    PyMethodDef::fastcall(
        c"start",
        start,
        c"start(path, tool_id, disable) -> bool: take the session's file over and count",
    ),
    PyMethodDef::fastcall(
        c"refuse",
        refuse,
        c"refuse(path, why): tell tracerd why this process does not count",
    ),
    PyMethodDef::fastcall(
        c"stop",
        stop,
        c"stop() -> int: stop counting; returns the tool id used (-1: none)",
    ),
    PyMethodDef::fastcall(
        c"start_profile",
        profile::start_profile,
        c"start_profile(path) -> bool: as start, with a C profile function on every thread (3.10, 3.11)",
    ),
    PyMethodDef::fastcall(c"py_start", py_start, c"PY_START callback"),
    PyMethodDef::fastcall(c"py_resume", py_resume, c"PY_RESUME callback"),
    PyMethodDef::fastcall(c"py_throw", py_throw, c"PY_THROW callback"),
    PyMethodDef::fastcall(c"py_return", py_return, c"PY_RETURN callback"),
    PyMethodDef::fastcall(c"py_yield", py_yield, c"PY_YIELD callback"),
    PyMethodDef::fastcall(c"py_unwind", py_unwind, c"PY_UNWIND callback"),
    PyMethodDef::END,
];

static mut MODULE: PyModuleDef = PyModuleDef {
    m_base: PY_MODULE_DEF_HEAD_INIT,
    m_name: c"_tracer_pycount".as_ptr(),
    m_doc: c"Counts Python calls with sys.monitoring into a file shared with tracerd.".as_ptr(),
    // Process-wide state: no per-interpreter copies.
    m_size: -1,
    m_methods: ptr::null_mut(),
    m_slots: ptr::null_mut(),
    m_traverse: ptr::null_mut(),
    m_clear: ptr::null_mut(),
    m_free: ptr::null_mut(),
};

/// The module's entry point, called by the import machinery.
#[no_mangle]
#[allow(non_snake_case)]
pub extern "C" fn PyInit__tracer_pycount() -> *mut PyObject {
    // SAFETY: called by the import machinery (with the GIL, where there is one); the
    // definition and its methods live forever and the interpreter is their only other user.
    unsafe {
        // A free-threaded build's objects have another header than the one declared here:
        // refuse to load there rather than hand it a module definition it would misread.
        // Only those builds define `_Py_DecRefShared`.
        if !libc::dlsym(libc::RTLD_DEFAULT, c"_Py_DecRefShared".as_ptr()).is_null() {
            PyErr_SetString(
                PyExc_ImportError,
                c"_tracer_pycount needs a CPython with the GIL".as_ptr(),
            );
            return ptr::null_mut();
        }
        let def = &raw mut MODULE;
        (*def).m_methods = (&raw mut METHODS).cast();
        PyModule_Create2(def, PYTHON_ABI_VERSION)
    }
}
