//! The counter on CPython 3.10 and 3.11, which have no `sys.monitoring`: a C profile
//! function (`Py_tracefunc`) on every thread state, the hook cProfile counts through, with
//! the same events (a call or a generator's resumption enters, a return or a yield leaves,
//! an exception's unwinding leaves too).
//!
//! - Threads started later, by `threading` or by C code for itself (`PyGILState_Ensure`:
//!   ctypes callbacks, native thread pools): the interpreter's frame evaluation function
//!   (PEP 523) is wrapped while counting, and a thread state without the profile function
//!   is given it before its first frame runs. The wrapper compares one word a frame and
//!   jumps on to the function it replaced; it takes itself out once counting has ended.
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

/// `_PyFrameEvalFunction`: (tstate, frame, throwflag). The frame is a `PyFrameObject` on
/// 3.10 and an `_PyInterpreterFrame` on 3.11; the wrapper only passes it on.
type EvalFrame = unsafe extern "C" fn(*mut ThreadState, *mut c_void, c_int) -> *mut PyObject;

/// `PyTrace_CALL` and `PyTrace_RETURN`.
const PY_TRACE_CALL: c_int = 0;
const PY_TRACE_RETURN: c_int = 3;
/// How far into a thread state `c_profilefunc` is looked for, in words (it is the 8th on
/// 3.10 and the 9th on 3.11).
const PROFILE_FIELD_WITHIN: usize = 24;

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
    get_eval: unsafe extern "C" fn(*mut Interpreter) -> EvalFrame,
    set_eval: unsafe extern "C" fn(*mut Interpreter, EvalFrame),
    /// `_PyEval_EvalFrameDefault`: the interpreter's own.
    default_eval: EvalFrame,
    /// 3.11 (which has `Py_Version`; 3.10 has not) links a thread state made without the GIL
    /// (PyGILState_Ensure) into the list before it sets its `cframe`, the word before
    /// `c_profilefunc`; setting the function there would crash.
    linked_early: bool,
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
                get_eval: sym(c"_PyInterpreterState_GetEvalFrameFunc")?,
                set_eval: sym(c"_PyInterpreterState_SetEvalFrameFunc")?,
                default_eval: sym(c"_PyEval_EvalFrameDefault")?,
                linked_early: sym::<usize>(c"Py_Version").is_some(),
            })
        }
    })
    .as_ref()
}

/// The counter is setting a profile function itself: its own `sys.setprofile` audit events
/// are not the program's.
static OURS: AtomicBool = AtomicBool::new(false);
/// The frame evaluation function the wrapper replaced, which it calls on.
static NEXT_EVAL: AtomicUsize = AtomicUsize::new(0);
/// Where `c_profilefunc` is in a thread state (bytes), found when counting starts.
static PROFILE_FIELD: AtomicUsize = AtomicUsize::new(0);
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
    _arg: *mut PyObject,
) -> c_int {
    let enter = match what {
        PY_TRACE_CALL => true,
        PY_TRACE_RETURN => false,
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
        if counting {
            keep_wrapped(api);
        } else {
            set(api, (api.current)(), None);
        }
    }
    0
}

/// The frame evaluation wrapper: a thread state that runs a frame without the profile
/// function (one made since counting started) is given it first, so that the frame's call
/// event is counted.
unsafe extern "C" fn eval_frame(
    t: *mut ThreadState,
    f: *mut c_void,
    throw: c_int,
) -> *mut PyObject {
    let at = PROFILE_FIELD.load(Ordering::Relaxed);
    // SAFETY: the interpreter calls with the GIL held and a live thread state, whose field
    // at `at` was found to be `c_profilefunc` (`install_all`).
    unsafe {
        if t.cast::<u8>().add(at).cast::<usize>().read() != profile as *const () as usize {
            give_thread(t);
        }
        next_eval()(t, f, throw)
    }
}

/// Gives `t` the profile function while counting goes on; otherwise takes the wrapper out.
///
/// # Safety
/// The GIL is held and `t` is the current thread state.
#[cold]
unsafe fn give_thread(t: *mut ThreadState) {
    let Some(api) = api() else { return };
    // SAFETY: GIL held.
    unsafe {
        let g = counter();
        if !(g.counting() || g.pending_fork) {
            unwrap_eval(api, (api.interpreter)(t));
        } else if !set(api, t, Some(profile)) {
            // An audit hook refused: this thread cannot be counted here, the probes can.
            g.hand_over();
        }
    }
}

/// Takes the wrapper out, if it is still the interpreter's (a tool that wrapped it in turn
/// calls it on, and it passes frames through).
///
/// # Safety
/// The GIL is held.
unsafe fn unwrap_eval(api: &Api, interp: *mut Interpreter) {
    // SAFETY: GIL held.
    unsafe {
        if (api.get_eval)(interp) as usize == eval_frame as *const () as usize {
            (api.set_eval)(interp, next_eval());
        }
    }
}

/// The function the wrapper replaced.
fn next_eval() -> EvalFrame {
    // SAFETY: set before the wrapper was installed (`wrap`), to a function of this signature.
    unsafe { std::mem::transmute(NEXT_EVAL.load(Ordering::Relaxed)) }
}

/// Makes the wrapper the interpreter's frame evaluation function, calling on `current`.
///
/// # Safety
/// The GIL is held and `current` is `interp`'s function now.
unsafe fn wrap(api: &Api, interp: *mut Interpreter, current: EvalFrame) {
    NEXT_EVAL.store(current as usize, Ordering::Relaxed);
    // SAFETY: the caller's promise.
    unsafe { (api.set_eval)(interp, eval_frame) };
}

/// Puts the profile function on every thread state of the current interpreter, and wraps
/// its frame evaluation function for the thread states made later.
///
/// # Safety
/// The GIL is held.
unsafe fn install_all(api: &Api) -> Result<(), String> {
    // SAFETY: the GIL is held; a thread state is far larger than the words read.
    unsafe {
        let me = (api.current)();
        if !set(api, me, Some(profile)) {
            return Err(REFUSED.into());
        }
        let words = me.cast::<usize>();
        let mut found = (0..PROFILE_FIELD_WITHIN)
            .filter(|&i| words.add(i).read() == profile as *const () as usize);
        let (Some(field), None) = (found.next(), found.next()) else {
            return Err("the thread state's profile function was not found".into());
        };
        PROFILE_FIELD.store(field * size_of::<usize>(), Ordering::Relaxed);
        give_all(api, me)?;
        let interp = (api.interpreter)(me);
        let current = (api.get_eval)(interp);
        if current as usize != eval_frame as *const () as usize {
            wrap(api, interp, current);
        }
    }
    Ok(())
}

const REFUSED: &str = "an audit hook refused sys.setprofile";

/// Gives every thread state of `me`'s interpreter that lacks it the profile function.
///
/// # Safety
/// The GIL is held, `me` is the current thread state and `PROFILE_FIELD` is set.
unsafe fn give_all(api: &Api, me: *mut ThreadState) -> Result<(), String> {
    let field = PROFILE_FIELD.load(Ordering::Relaxed) / size_of::<usize>();
    // SAFETY: GIL held: the states listed stay while it is; their fields are words.
    unsafe {
        let mut t = (api.head)((api.interpreter)(me));
        while !t.is_null() {
            let words = t.cast::<usize>();
            // Not set up yet (`Api::linked_early`): the wrapper gives it at its first frame.
            let unready = api.linked_early && words.add(field.max(1) - 1).read() == 0;
            let has = words.add(field).read() == profile as *const () as usize;
            if !has && !unready && !set(api, t, Some(profile)) {
                return Err(REFUSED.into());
            }
            t = (api.next)(t);
        }
    }
    Ok(())
}

/// Events counted between looks at whether the interpreter still calls the wrapper.
const WRAP_CHECK_EVERY: u32 = 256;

/// Wraps the frame evaluation function again where a tool put CPython's own back (PyTorch's
/// dynamo does, once its frames are done), and gives the threads that began meanwhile the
/// profile function. Another tool's own function is left alone: it may call the wrapper on,
/// and wrapping it would make the two call each other.
///
/// # Safety
/// The GIL is held.
unsafe fn keep_wrapped(api: &Api) {
    // SAFETY: GIL held.
    unsafe {
        if !counter().ticks.is_multiple_of(WRAP_CHECK_EVERY) {
            return;
        }
        let me = (api.current)();
        let interp = (api.interpreter)(me);
        let current = (api.get_eval)(interp);
        if current as usize != api.default_eval as usize {
            return;
        }
        if give_all(api, me).is_err() {
            counter().hand_over();
            return;
        }
        wrap(api, interp, current);
    }
}

/// The audit hook, added once (hooks cannot be removed; it does nothing once counting ends).
///
/// # Safety
/// The GIL is held.
unsafe fn prepare(api: &Api) -> Result<(), String> {
    let mut added = Ok(());
    AUDIT.call_once(|| {
        // SAFETY: GIL held.
        unsafe {
            if (api.add_audit_hook)(audit, ptr::null_mut()) != 0 {
                PyErr_Clear();
                added = Err("an audit hook refused sys.addaudithook".to_owned());
            }
        }
    });
    added
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
