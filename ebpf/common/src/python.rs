//! What the Python probes share with the daemon: CPython's struct offsets per version,
//! the call counts and caller pairs they keep, the threads' shadow stacks, and the names
//! of code objects sent to user space.

/// How a probe finds the running code object; `PyLayout::kind`.
pub mod py_kind {
    /// 3.10: `_PyEval_EvalFrameDefault(tstate, PyFrameObject *f, throwflag)` runs every call;
    /// the frame is its second argument.
    pub const EVAL_ARG_FRAME: u32 = 0;
    /// 3.11, 3.12: `tstate->cframe->current_frame`, at the RESUME handlers.
    pub const CFRAME: u32 = 1;
    /// 3.13: `tstate->current_frame`, at the RESUME handlers.
    pub const CURRENT_FRAME: u32 = 2;
}

/// Entries of the `PY_LAYOUTS` array: one per CPython version (see inspect/src/python/layout.rs).
pub const PY_LAYOUTS_MAX: u32 = 16;

/// Byte offsets into one CPython version's structs, as the probes need them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyLayout {
    pub kind: u32,
    pub tstate_cframe: u32,
    pub cframe_current_frame: u32,
    pub tstate_current_frame: u32,
    /// Code object within the frame (`f_code`, or `f_executable` on 3.13).
    pub frame_code: u32,
    pub code_filename: u32,
    /// `co_qualname` (3.11+) or `co_name` (3.10, which has no qualname).
    pub code_qualname: u32,
    pub code_firstlineno: u32,
    /// The caller's frame: `_PyInterpreterFrame.previous` (3.11+), `PyFrameObject.f_back` (3.10).
    pub frame_previous: u32,
    /// `_PyInterpreterFrame.owner` (3.12+; 0: no such field).
    pub frame_owner: u32,
    /// Offset of the `state` bitfield in `PyASCIIObject`.
    pub unicode_state: u32,
    /// `sizeof(PyASCIIObject)`: where a compact ASCII string's characters start.
    pub unicode_ascii_data: u32,
    /// Sampling: the frame's current instruction (`f_lasti`, an int, on 3.10;
    /// `prev_instr` on 3.11-3.12; `instr_ptr` on 3.13).
    pub frame_instr: u32,
    /// Sampling: `_PyInterpreterFrame.is_entry` (3.11 only; 0: no such field).
    pub frame_is_entry: u32,
    /// Sampling: `PyThreadState.thread_id`, `pthread_self()`, matched on the task's fs base
    /// (not `native_thread_id`: a tid in the process's own pid namespace).
    pub tstate_thread_id: u32,
    pub runtime_interpreters_head: u32,
    pub interp_threads_head: u32,
    pub tstate_next: u32,
    /// Low bits of `f_executable` that tag the reference rather than address the code
    /// object (3.14+: `_PyStackRef`); cleared before the pointer is followed.
    pub executable_tag_bits: u32,
    /// `co_flags` (0: not read). Set where a generator's code runs a RESUME before
    /// RETURN_GENERATOR makes it a generator (3.15's generator expressions evaluate their
    /// iterable first): that run is no call, and is told by a generator code object in a
    /// frame the thread still owns.
    pub code_flags: u32,
    /// `_co_instrumentation_version` (3.12+; 0: not checked). A RESUME of a code object whose
    /// version is not the interpreter's instruments it and runs again: only the second run
    /// is a call.
    pub code_instr_version: u32,
    /// 3.12: the interpreter's version is `tstate->interp->monitoring_version`.
    pub tstate_interp: u32,
    pub interp_monitoring_version: u32,
    /// 3.13+: the interpreter's version is `tstate->eval_breaker` above its event bits.
    pub tstate_eval_breaker: u32,
    /// `PyThreadState.tracing`, where RESUME skips the check inside a trace or profile
    /// function (3.13+; 0: it always checks, as 3.12 does).
    pub tstate_tracing: u32,
    /// Sampling: the GIL's `locked` (an int) and `last_holder` (a thread state), the thread
    /// holding it when both say so; 0: not read. Offsets from `_PyRuntime` (3.10–3.11:
    /// `ceval.gil`) or, where `gil_in_interp` is set, from the interpreter state (3.12+:
    /// `_gil`, each interpreter's own since PEP 684).
    pub gil_locked: u32,
    pub gil_holder: u32,
    pub gil_in_interp: u32,
}

/// Low bits of `PyThreadState.eval_breaker` that are event flags, not the version (3.13+).
pub const PY_EVAL_EVENTS_MASK: u64 = 0xff;

/// `_PyInterpreterFrame.owner` from this value up: a frame that runs no Python function of
/// its own (3.12/3.13's C-stack shim is 3; 3.14 has the interpreter's entry frame at 3 and
/// the C stack's at 4; 3.15 only the former).
pub const PY_FRAME_OWNER_NOT_PYTHON: u8 = 3;

/// `_PyInterpreterFrame.owner` of a frame on the thread's own stack (not a generator's).
pub const PY_FRAME_OWNED_BY_THREAD: u8 = 0;

/// `co_flags` bits of generators, coroutines and async generators.
pub const PY_CO_GENERATOR_LIKE: u32 = 0x20 | 0x80 | 0x200;

impl PyLayout {
    /// The code object a frame's executable field names.
    #[inline(always)]
    pub fn code_of(&self, executable: u64) -> u64 {
        executable & !u64::from(self.executable_tag_bits)
    }
}

/// Key of `PY_CALLS`: one session's count of calls of one code object in one process.
///
/// A freed code object's address is reused by later ones (modules run once at start-up free
/// theirs), so the address alone does not name a function: `names` mixes in the addresses of
/// its (interned) qualname and file name.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PyCallKey {
    pub slot: u32,
    pub pid: u32,
    pub code: u64,
    pub names: u64,
}

/// Key of `PY_EDGES`: calls of one function from one calling Python function, in one
/// process, for one session (pstats' callers). The value is a `PyCallStats` for those calls.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PyEdgeKey {
    /// The callee's key in `PY_CALLS`: the probes build one key and look both up with it.
    pub call: PyCallKey,
    pub caller_code: u64,
    pub caller_names: u64,
}

/// Capacity of `PY_EDGES` (caller → callee pairs, all sessions together).
pub const PY_EDGES_MAX: u32 = 262_144;

/// `PyCallKey::names` from the qualname and file name object addresses.
pub const fn py_names_id(qualname: u64, filename: u64) -> u64 {
    qualname ^ filename.rotate_left(29)
}

/// Value of `PY_CALLS`: cProfile's numbers for one function.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyCallStats {
    /// Starts and resumes of the function's frames.
    pub ncalls: u64,
    /// Those that were not recursive (no other activation of it on the thread's stack).
    pub primitive: u64,
    /// Time in the function itself, callees excluded.
    pub tottime_ns: u64,
    /// Time in the function and its callees, counted once per outermost activation.
    pub cumtime_ns: u64,
}

/// Frames tracked per thread for timing; deeper calls are counted but not timed. Importing
/// PyTorch nests well over 100 frames deep (six importlib frames per nested import).
pub const PY_STACK_DEPTH: usize = 256;

/// Threads with a shadow stack at once (entries are allocated on use and freed when the
/// thread exits).
pub const PY_THREADS_MAX: u32 = 16_384;

/// Sessions that may count Python calls at once. They take the lowest session slots, so the
/// probes' per-session loop stays short for the verifier.
pub const MAX_PY_SESSIONS: u32 = 8;

/// Frames left by an exception that one probe hit pops; more are popped at later hits.
pub const PY_UNWIND_PER_EVENT: usize = 16;

/// One active frame on a thread's shadow stack.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyStackEntry {
    /// The interpreter frame's address (`PyFrameObject *` on 3.10).
    pub frame: u64,
    pub code: u64,
    pub names: u64,
    pub start_ns: u64,
    /// Time spent in callees so far.
    pub sub_ns: u64,
    /// 1: no other activation of this function below it (cProfile adds cumtime then).
    pub outermost: u64,
    /// 1: its caller did not call it further down the stack either (the same for the
    /// caller → callee pair: cProfile's callers entries).
    pub edge_outermost: u64,
    /// 1: stands for an interpreter frame no probe enters (3.13's cleanup frame under
    /// `__init__`), carrying its caller's identity: counted for nobody.
    pub pseudo: u64,
}

/// A thread's shadow stack of Python frames (value of `PY_STACKS`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PyStack {
    pub depth: u64,
    pub entries: [PyStackEntry; PY_STACK_DEPTH],
}

/// `PyLayout::kind` probes' roles, passed in the attach cookie above the layout index.
pub mod py_role {
    /// A frame starts or resumes (RESUME handlers; the eval-loop entry on 3.10).
    pub const ENTRY: u64 = 0;
    /// A frame returns or yields (RETURN_VALUE, RETURN_CONST, YIELD_VALUE handlers; the
    /// eval loop's return on 3.10).
    pub const EXIT: u64 = 1;
    /// Bit position of the role in the cookie.
    pub const SHIFT: u32 = 8;
}

pub const PY_QUALNAME_LEN: usize = 128;
pub const PY_FILENAME_LEN: usize = 256;

/// `PyCodeEvent::flags`: the name was not a compact ASCII string (or could not be read).
pub const PY_CODE_QUALNAME_UNREAD: u32 = 1;
/// `PyCodeEvent::flags`: likewise for the file name.
pub const PY_CODE_FILENAME_UNREAD: u32 = 2;

/// Sent on `PY_CODES` the first time a session sees a code object in a process: its names,
/// read while the process is alive, so that counts of processes that exit can still be named.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PyCodeEvent {
    pub slot: u32,
    pub pid: u32,
    pub code: u64,
    pub names: u64,
    pub firstlineno: i32,
    pub flags: u32,
    /// NUL-terminated (or full).
    pub qualname: [u8; PY_QUALNAME_LEN],
    pub filename: [u8; PY_FILENAME_LEN],
}
