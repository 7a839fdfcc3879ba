//! `libtracer_pystart.so`: the loader of in-process counting for a command tracerctl
//! launches (`tracerctl start --mode=counting --python -- CMD`). PEP 768 cannot reach a
//! process before its interpreter runs, nor any interpreter before 3.14; a preloaded library
//! can, the way cProfile starts: just before the program's first line.
//!
//! tracerd hands tracerctl two variables for the command's exec: `LD_PRELOAD` naming this
//! library in tracer's directory, and `TRACER_PYSTART` naming the start script there. At load
//! (an ELF constructor, before `main`):
//! - in a program that is not CPython it does nothing, and leaves the variables for the
//!   programs it execs (a shell or a chroot wrapper between tracerctl and Python);
//! - in CPython it takes both variables out of the environment (the program never sees
//!   them, and its children do not inherit them); in 3.10+ it then adds an audit hook
//!   (`PySys_AddAuditHook`, allowed before the interpreter is initialised). At the first
//!   `cpython.run_*` event (`run_file`, `run_module`, `run_command`, `run_stdin`, …: what
//!   `python` raises just before it runs the program) the hook runs the start script in a
//!   namespace of its own, as PEP 768 would; the script loads the counter
//!   (`_tracer_pycount`) and registers its `sys.monitoring` callbacks (3.12+) or has it put
//!   a C profile function on every thread (3.10, 3.11). The hook then does nothing more.
//!
//! tracerd also loads it into a running CPython 3.10–3.13 process (`--pid`), with ptrace
//! (`tracer_inspect::process::inject`): the interpreter is initialised by then and no variable
//! is set. It then runs the script beside itself of its own name (`start.so` runs
//! `start.py`, `remove.7.so` runs `remove.7.py`) on a thread of its own, which takes the GIL
//! (`PyGILState_Ensure`) the moment the program lets go of it: at once where every thread
//! waits in native code, within the switch interval (5 ms) where one runs Python. The
//! thread that loaded it goes back to the program as soon as the thread is made.
//!
//! Python's C API is looked up at run time (`dlsym`): the library links nothing of Python, so
//! it loads into any program.

use std::{
    ffi::{c_char, c_int, c_void, CStr, CString},
    sync::{
        atomic::{AtomicBool, Ordering},
        OnceLock,
    },
};

/// The variable naming the start script.
const SCRIPT_VAR: &CStr = c"TRACER_PYSTART";
/// `Py_file_input`.
const PY_FILE_INPUT: c_int = 257;

type PyObject = c_void;
type AuditHook = unsafe extern "C" fn(*const c_char, *mut PyObject, *mut c_void) -> c_int;

/// The start script's path, kept from the environment.
static SCRIPT: OnceLock<CString> = OnceLock::new();
/// The script ran (or is running: its own imports raise audit events too).
static RAN: AtomicBool = AtomicBool::new(false);

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

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

/// (major, minor) of the interpreter this process links, if any.
fn python_version() -> Option<(u32, u32)> {
    // SAFETY: `const char *Py_GetVersion(void)`, callable before initialisation (a static
    // string).
    let get: unsafe extern "C" fn() -> *const c_char = unsafe { sym(c"Py_GetVersion") }?;
    // SAFETY: as above.
    let v = unsafe { CStr::from_ptr(get()) }.to_str().ok()?;
    let mut parts = v.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// This library's own path, as the dynamic loader opened it.
fn own_path() -> Option<Vec<u8>> {
    // SAFETY: dladdr on an address inside this library; fills `info`.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let addr = init as *const c_void;
    // SAFETY: as above.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated string of the loader's.
    Some(
        unsafe { CStr::from_ptr(info.dli_fname) }
            .to_bytes()
            .to_vec(),
    )
}

/// Takes this library out of `LD_PRELOAD` (the rest stays as the user set it).
fn unpreload() {
    let Some(me) = own_path() else { return };
    // SAFETY: getenv before main, single-threaded.
    let v = unsafe { libc::getenv(c"LD_PRELOAD".as_ptr()) };
    if v.is_null() {
        return;
    }
    // SAFETY: a NUL-terminated string of the environment.
    let old = unsafe { CStr::from_ptr(v) }.to_bytes().to_vec();
    // ld.so separates entries with spaces or colons.
    let rest: Vec<&[u8]> = old
        .split(|&b| b == b':' || b == b' ')
        .filter(|e| !e.is_empty() && *e != me.as_slice())
        .collect();
    // SAFETY: single-threaded, before main: nothing reads the environment meanwhile.
    unsafe {
        if rest.is_empty() {
            libc::unsetenv(c"LD_PRELOAD".as_ptr());
        } else if let Ok(new) = CString::new(rest.join(&b':')) {
            libc::setenv(c"LD_PRELOAD".as_ptr(), new.as_ptr(), 1);
        }
    }
}

extern "C" fn init() {
    // SAFETY: getenv before main, single-threaded.
    let v = unsafe { libc::getenv(SCRIPT_VAR.as_ptr()) };
    if v.is_null() {
        attach();
        return;
    }
    let Some(version) = python_version() else {
        // Not (yet) the interpreter: a program on the way to it keeps the variables.
        return;
    };
    // SAFETY: a NUL-terminated string of the environment.
    let script = unsafe { CStr::from_ptr(v) }.to_owned();
    // SAFETY: single-threaded, before main.
    unsafe { libc::unsetenv(SCRIPT_VAR.as_ptr()) };
    unpreload();
    if version < (3, 10) {
        // tracerd counts older ones with the probes.
        return;
    }
    let _ = SCRIPT.set(script);
    // SAFETY: `int PySys_AddAuditHook(Py_AuditHookFunction, void *)`, documented as safe
    // to call before Py_Initialize.
    let add: Option<unsafe extern "C" fn(AuditHook, *mut c_void) -> c_int> =
        unsafe { sym(c"PySys_AddAuditHook") };
    if let Some(add) = add {
        // SAFETY: as above; the hook lives as long as the process.
        unsafe { add(hook, std::ptr::null_mut()) };
    }
}

/// `int Py_IsInitialized(void)`.
fn initialised() -> bool {
    // SAFETY: a plain query, callable at any time.
    let f: Option<unsafe extern "C" fn() -> c_int> = unsafe { sym(c"Py_IsInitialized") };
    f.is_some_and(|f| unsafe { f() } != 0)
}

/// Whether the interpreter is exiting: a thread taking the GIL then would be ended by it
/// (`_Py_IsFinalizing` before 3.13, `Py_IsFinalizing` since).
fn finalizing() -> bool {
    // SAFETY: plain queries, callable at any time.
    let f: Option<unsafe extern "C" fn() -> c_int> =
        unsafe { sym(c"Py_IsFinalizing").or_else(|| sym(c"_Py_IsFinalizing")) };
    f.is_some_and(|f| unsafe { f() } != 0)
}

/// Loaded into a running interpreter: runs the script of its own name (`X.so` → `X.py`) on a
/// thread of its own.
fn attach() {
    if !initialised() || python_version().is_none_or(|v| v < (3, 10)) {
        return;
    }
    let Some(me) = own_path() else { return };
    let Some(stem) = me.strip_suffix(b".so") else {
        return;
    };
    let Ok(script) = CString::new([stem, b".py"].concat()) else {
        return;
    };
    if SCRIPT.set(script).is_err() {
        return;
    }
    // SAFETY: a detached thread running `loader`, which takes no argument.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        if libc::pthread_attr_init(&mut attr) != 0 {
            return;
        }
        libc::pthread_attr_setdetachstate(&mut attr, libc::PTHREAD_CREATE_DETACHED);
        let mut thread: libc::pthread_t = 0;
        // The loader is C-unwind (CPython may end a thread taking the GIL while exiting,
        // by unwinding it): the same calling convention as what pthread_create takes.
        let start: extern "C" fn(*mut c_void) -> *mut c_void =
            std::mem::transmute(loader as extern "C-unwind" fn(*mut c_void) -> *mut c_void);
        libc::pthread_create(&mut thread, &attr, start, std::ptr::null_mut());
        libc::pthread_attr_destroy(&mut attr);
    }
}

/// The thread of [`attach`]: takes the GIL and runs the start script once.
extern "C-unwind" fn loader(_: *mut c_void) -> *mut c_void {
    // SAFETY: `PyGILState_STATE PyGILState_Ensure(void)` and its release, from a thread
    // Python did not make, the interpreter initialised and not exiting.
    unsafe {
        let ensure: Option<unsafe extern "C-unwind" fn() -> c_int> = sym(c"PyGILState_Ensure");
        let release: Option<unsafe extern "C" fn(c_int)> = sym(c"PyGILState_Release");
        let (Some(ensure), Some(release), Some(script)) = (ensure, release, SCRIPT.get()) else {
            return std::ptr::null_mut();
        };
        if finalizing() || RAN.swap(true, Ordering::SeqCst) {
            return std::ptr::null_mut();
        }
        let g = ensure();
        run(script);
        release(g);
    }
    std::ptr::null_mut()
}

/// Runs the start script at the first `cpython.run_*` event. Called with the GIL held; must
/// not fail (a non-zero return would abort what raised the event).
unsafe extern "C" fn hook(event: *const c_char, _args: *mut PyObject, _: *mut c_void) -> c_int {
    if RAN.load(Ordering::Relaxed) || event.is_null() {
        return 0;
    }
    // SAFETY: the interpreter passes a NUL-terminated event name.
    if !unsafe { CStr::from_ptr(event) }
        .to_bytes()
        .starts_with(b"cpython.run_")
    {
        return 0;
    }
    RAN.store(true, Ordering::Relaxed);
    if let Some(script) = SCRIPT.get() {
        // SAFETY: the GIL is held, the interpreter initialised.
        unsafe { run(script) };
    }
    0
}

/// Runs the file at `path` in a fresh namespace (with `__builtins__`), as PEP 768 does; any
/// exception is cleared (the script catches its own).
unsafe fn run(path: &CStr) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(source) = std::fs::read(std::ffi::OsStr::from_bytes(path.to_bytes())) else {
        return;
    };
    let Ok(source) = CString::new(source) else {
        return;
    };
    // SAFETY: C-API signatures as CPython declares them; called with the GIL held.
    unsafe {
        let dict_new: Option<unsafe extern "C" fn() -> *mut PyObject> = sym(c"PyDict_New");
        let builtins: Option<unsafe extern "C" fn() -> *mut PyObject> = sym(c"PyEval_GetBuiltins");
        let set_item: Option<
            unsafe extern "C" fn(*mut PyObject, *const c_char, *mut PyObject) -> c_int,
        > = sym(c"PyDict_SetItemString");
        let run_string: Option<
            unsafe extern "C" fn(
                *const c_char,
                c_int,
                *mut PyObject,
                *mut PyObject,
                *mut c_void,
            ) -> *mut PyObject,
        > = sym(c"PyRun_StringFlags");
        let decref: Option<unsafe extern "C" fn(*mut PyObject)> = sym(c"Py_DecRef");
        let clear: Option<unsafe extern "C" fn()> = sym(c"PyErr_Clear");
        let (
            Some(dict_new),
            Some(builtins),
            Some(set_item),
            Some(run_string),
            Some(decref),
            Some(clear),
        ) = (dict_new, builtins, set_item, run_string, decref, clear)
        else {
            return;
        };
        let globals = dict_new();
        if globals.is_null() {
            clear();
            return;
        }
        let b = builtins();
        if b.is_null() || set_item(globals, c"__builtins__".as_ptr(), b) != 0 {
            clear();
            decref(globals);
            return;
        }
        let r = run_string(
            source.as_ptr(),
            PY_FILE_INPUT,
            globals,
            globals,
            std::ptr::null_mut(),
        );
        if r.is_null() {
            clear();
        } else {
            decref(r);
        }
        decref(globals);
    }
}
