//! The counter on CPython 3.10 and 3.11, which have no `sys.monitoring`: a C profile
//! function (`Py_tracefunc`) on every thread state, the hook cProfile counts through, with
//! the same events (a call or a generator's resumption enters, a return or a yield leaves,
//! an exception's unwinding leaves too).
//!
//! - Threads started later: `_thread.start_new_thread` makes the new thread's state before
//!   it returns, and the thread cannot run Python before the caller lets go of the GIL. The
//!   C_RETURN event of that call puts the function on the newest thread state.
//! - A thread has one profile function. A program that sets its own (cProfile,
//!   `sys.setprofile`, a profiler's C hook) takes the counter's place: an audit hook sees
//!   `sys.setprofile` first, and the counter hands the process over to the probes
//!   (`state::HANDOVER`), holding the program until tracerd has them counting it, so that no
//!   call goes uncounted or counted twice.
//!
//! The C API used here is not all in the stable ABI (`_PyEval_SetProfile`, which sets another
//! thread's function, is CPython's own): it is looked up at run time, so that the library
//! still loads where it is missing, and this way is refused there.

use std::{
    ffi::{c_char, c_int, c_void, CStr},
    ptr,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Once, OnceLock,
    },
    time::{Duration, Instant},
};

use tracer_common::inproc::{state, HANDOVER_PREFIX, PROFILE_FUNCTION};

use crate::{counter, ffi::*, take, Counter};

type ThreadState = c_void;
type Interpreter = c_void;
/// `Py_tracefunc`: (obj, frame, what, arg).
type TraceFunc = unsafe extern "C" fn(*mut PyObject, *mut PyObject, c_int, *mut PyObject) -> c_int;
type AuditHook = unsafe extern "C" fn(*const c_char, *mut PyObject, *mut c_void) -> c_int;

/// `PyTrace_CALL`, `PyTrace_RETURN` and `PyTrace_C_RETURN`.
const PY_TRACE_CALL: c_int = 0;
const PY_TRACE_RETURN: c_int = 3;
const PY_TRACE_C_RETURN: c_int = 6;

/// How long a handover holds the program at most while tracerd lives (it attaches the
/// probes meanwhile, which may wait for an earlier session's to be released).
const HANDOVER_WAIT: Duration = Duration::from_secs(30);

struct Api {
    /// `_PyEval_SetProfile(tstate, func, obj)`: 0, or -1 with an exception (an audit hook
    /// refused `sys.setprofile`).
    set_profile: unsafe extern "C" fn(*mut ThreadState, Option<TraceFunc>, *mut PyObject) -> c_int,
    /// `PyFrame_GetCode(frame)`: a new reference.
    frame_code: unsafe extern "C" fn(*mut PyObject) -> *mut PyObject,
    current: unsafe extern "C" fn() -> *mut ThreadState,
    interpreter: unsafe extern "C" fn(*mut ThreadState) -> *mut Interpreter,
    head: unsafe extern "C" fn(*mut Interpreter) -> *mut ThreadState,
    next: unsafe extern "C" fn(*mut ThreadState) -> *mut ThreadState,
    add_audit_hook: unsafe extern "C" fn(AuditHook, *mut c_void) -> c_int,
    import: unsafe extern "C" fn(*const c_char) -> *mut PyObject,
}

/// `name` from the process's symbols, as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the C signature of `name`.
unsafe fn sym<T: Copy>(name: &CStr) -> Option<T> {
    // SAFETY: dlsym with a NUL-terminated name; RTLD_DEFAULT searches the global scope.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    // SAFETY: the caller names the type; a function pointer is pointer-sized.
    (!p.is_null()).then(|| unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

fn api() -> Option<&'static Api> {
    static API: OnceLock<Option<Api>> = OnceLock::new();
    API.get_or_init(|| {
        // SAFETY: each type is the function's C signature in CPython 3.10 and 3.11.
        unsafe {
            Some(Api {
                set_profile: sym(c"_PyEval_SetProfile")?,
                frame_code: sym(c"PyFrame_GetCode")?,
                current: sym(c"PyThreadState_Get")?,
                interpreter: sym(c"PyThreadState_GetInterpreter")?,
                head: sym(c"PyInterpreterState_ThreadHead")?,
                next: sym(c"PyThreadState_Next")?,
                add_audit_hook: sym(c"PySys_AddAuditHook")?,
                import: sym(c"PyImport_ImportModule")?,
            })
        }
    })
    .as_ref()
}

/// The counter is setting a profile function itself: its own `sys.setprofile` audit events
/// are not the program's.
static OURS: AtomicBool = AtomicBool::new(false);
/// `_thread.start_new_thread` (its address; a reference is held), whose return the profile
/// function watches for.
static START_THREAD: AtomicUsize = AtomicUsize::new(0);
static AUDIT: Once = Once::new();

/// Sets `t`'s profile function (None: takes it off). False when it could not.
///
/// # Safety
/// The GIL is held and `t` is a live thread state of this interpreter.
unsafe fn set(api: &Api, t: *mut ThreadState, f: Option<TraceFunc>) -> bool {
    OURS.store(true, Ordering::Relaxed);
    // SAFETY: the caller's promise.
    let ok = unsafe { (api.set_profile)(t, f, ptr::null_mut()) } == 0;
    OURS.store(false, Ordering::Relaxed);
    if !ok {
        // SAFETY: GIL held.
        unsafe { PyErr_Clear() };
    }
    ok
}

/// The profile function. Once counting has ended it takes itself off its thread.
unsafe extern "C" fn profile(
    _obj: *mut PyObject,
    frame: *mut PyObject,
    what: c_int,
    arg: *mut PyObject,
) -> c_int {
    let enter = match what {
        PY_TRACE_CALL => true,
        PY_TRACE_RETURN => false,
        PY_TRACE_C_RETURN
            if !arg.is_null() && arg as usize == START_THREAD.load(Ordering::Relaxed) =>
        {
            // SAFETY: GIL held; the thread just made is at the head of the list.
            unsafe { give_newest_thread() };
            return 0;
        }
        _ => return 0,
    };
    let Some(api) = api() else { return 0 };
    // SAFETY: the interpreter calls with the GIL held and a live frame; the code object
    // outlives the reference taken here (the frame holds one).
    unsafe {
        let code = (api.frame_code)(frame);
        if code.is_null() {
            PyErr_Clear();
            return 0;
        }
        let counting = counter().on_event(code, enter);
        Py_DecRef(code);
        if !counting {
            set(api, (api.current)(), None);
        }
    }
    0
}

/// A thread `_thread.start_new_thread` just made (the newest state, at the list's head)
/// gets the profile function, if counting goes on.
///
/// # Safety
/// The GIL is held.
unsafe fn give_newest_thread() {
    let Some(api) = api() else { return };
    // SAFETY: GIL held; the list does not change under it.
    unsafe {
        if !counter().counting() {
            return;
        }
        let me = (api.current)();
        let newest = (api.head)((api.interpreter)(me));
        if !newest.is_null() && newest != me {
            set(api, newest, Some(profile));
        }
    }
}

/// Puts the profile function on every thread state of the current interpreter.
///
/// # Safety
/// The GIL is held.
unsafe fn install_all(api: &Api) -> Result<(), String> {
    // SAFETY: the GIL is held, so the list of thread states does not change under us.
    unsafe {
        let interp = (api.interpreter)((api.current)());
        let mut t = (api.head)(interp);
        while !t.is_null() {
            if !set(api, t, Some(profile)) {
                return Err("an audit hook refused sys.setprofile".into());
            }
            t = (api.next)(t);
        }
    }
    Ok(())
}

/// What the counter needs besides the profile functions: `_thread.start_new_thread` and its
/// audit hook (added once: hooks cannot be removed; it does nothing once counting ends).
///
/// # Safety
/// The GIL is held.
unsafe fn prepare(api: &Api) -> Result<(), String> {
    // SAFETY: GIL held; C-API calls with their documented arguments.
    unsafe {
        if START_THREAD.load(Ordering::Relaxed) == 0 {
            let thread = (api.import)(c"_thread".as_ptr());
            if thread.is_null() {
                PyErr_Clear();
                return Err("importing _thread failed".into());
            }
            let f = PyObject_GetAttrString(thread, c"start_new_thread".as_ptr());
            Py_DecRef(thread);
            if f.is_null() {
                PyErr_Clear();
                return Err("_thread has no start_new_thread".into());
            }
            // The reference stays: the address must remain this function's.
            START_THREAD.store(f as usize, Ordering::Relaxed);
        }
        let mut added = Ok(());
        AUDIT.call_once(|| {
            if (api.add_audit_hook)(audit, ptr::null_mut()) != 0 {
                PyErr_Clear();
                added = Err("an audit hook refused sys.addaudithook".to_owned());
            }
        });
        added
    }
}

/// `start_profile(path) -> bool`: as `start`, with the profile function on every thread
/// rather than `sys.monitoring` callbacks.
pub unsafe extern "C" fn start_profile(
    _module: *mut PyObject,
    args: *const *mut PyObject,
    nargs: isize,
) -> *mut PyObject {
    // SAFETY: the interpreter calls with the GIL held and `nargs` arguments at `args`.
    unsafe {
        if nargs != 1 {
            return raise("start_profile(path) takes 1 argument");
        }
        let Some(path) = utf8(*args) else {
            return raise("start_profile: path must be a str");
        };
        let path = path.to_vec();
        let Some(api) = api() else {
            return raise(
                "start_profile: this interpreter lacks _PyEval_SetProfile or the thread-state API",
            );
        };
        if let Err(e) = prepare(api) {
            return raise(&format!("start_profile: {e}"));
        }
        match take(&path, PROFILE_FUNCTION, ptr::null_mut()) {
            Err(e) => raise(&format!("start_profile: {e}")),
            Ok(false) => PyBool_FromLong(0),
            Ok(true) => match install_all(api) {
                Ok(()) => PyBool_FromLong(1),
                Err(why) => {
                    // Threads already given the function take it off at their next event.
                    let g = counter();
                    g.shared
                        .refuse_running(&format!("starting the counter: {why}"));
                    let held = g.stop();
                    for o in held {
                        Py_DecRef(o);
                    }
                    PyBool_FromLong(0)
                }
            },
        }
    }
}

/// The audit hook: the program is about to set a profile function of its own.
unsafe extern "C" fn audit(event: *const c_char, _args: *mut PyObject, _: *mut c_void) -> c_int {
    if event.is_null() || OURS.load(Ordering::Relaxed) {
        return 0;
    }
    // SAFETY: the interpreter passes a NUL-terminated event name, with the GIL held.
    unsafe {
        if CStr::from_ptr(event).to_bytes() == b"sys.setprofile" {
            counter().hand_over();
        }
    }
    0
}

impl Counter {
    /// Counting, as a profile function, now.
    fn counting(&self) -> bool {
        self.live
            && self.tool_id == PROFILE_FUNCTION.into()
            && self.shared.state().load(Ordering::Acquire) == state::RUNNING
    }

    /// Hands the process over to the probes: RUNNING → HANDOVER, the request's file made,
    /// and the program held until tracerd answers (HANDED), gives up, or is gone. The profile
    /// functions take themselves off at their threads' next events.
    fn hand_over(&mut self) {
        if self.pending_fork {
            // A child that counted nothing yet: its own file first, for tracerd to find.
            self.take_over();
        }
        if !self.counting()
            || self
                .shared
                .state()
                .compare_exchange(
                    state::RUNNING,
                    state::HANDOVER,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            return;
        }
        // SAFETY: no preconditions.
        let pid = unsafe { libc::getpid() };
        let mut path = self.dir.clone();
        path.extend_from_slice(format!("/{HANDOVER_PREFIX}{pid}").as_bytes());
        let Ok(path) = std::ffi::CString::new(path) else {
            return;
        };
        // SAFETY: a NUL-terminated path; the descriptor is closed at once.
        let fd = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW,
                0o600,
            )
        };
        if fd < 0 {
            return;
        }
        // SAFETY: our own descriptor.
        unsafe { libc::close(fd) };
        let until = Instant::now() + HANDOVER_WAIT;
        while self.shared.state().load(Ordering::Acquire) == state::HANDOVER
            && Instant::now() < until
            && !self.orphaned()
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        if !self.orphaned() {
            // Unanswered: the loss is ours to record (an answer after this finds no
            // HANDOVER to answer).
            let _ = self.shared.state().compare_exchange(
                state::HANDOVER,
                state::GAVE_UP,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }
}
