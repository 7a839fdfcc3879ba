//! Records and keys shared by the BPF programs (`ebpf/probes`) and the daemon.
//!
//! Every type is `#[repr(C)]`, `Copy`, and spells out its padding so that both compilers
//! agree on the layout byte for byte.
#![no_std]

pub mod inproc;

/// How many sessions may follow processes at once: one bit each in [`SessionMask`].
pub const MAX_TRACKED_SESSIONS: usize = 64;

/// Bit `i` set: session slot `i` follows this process.
pub type SessionMask = u64;

/// `ProcEvent::kind`: a new process was forked by a followed one.
pub const PROC_EVENT_FORK: u32 = 1;
/// `ProcEvent::kind`: the last thread of a followed process exited.
pub const PROC_EVENT_EXIT: u32 = 2;
/// `ProcEvent::kind`: a followed process exec'd a new program.
pub const PROC_EVENT_EXEC: u32 = 3;

/// Key of `SLOT_LOSSES`: a loss cause in processes followed by the sessions of `mask`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LossKey {
    pub mask: SessionMask,
    pub cause: u32,
    pub _pad: u32,
}

/// Sent on the `PROC_EVENTS` ring buffer when a followed process forks or exits.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcEvent {
    pub kind: u32,
    /// Process id (thread-group id) of the new or exiting process.
    pub pid: u32,
    /// For forks: the parent's process id. For exits: 0.
    pub parent_pid: u32,
    pub _pad: u32,
    /// The sessions that follow this process.
    pub sessions: SessionMask,
    /// `bpf_ktime_get_ns` at the event.
    pub ktime_ns: u64,
    /// The command name (`comm`) of the forking or exiting task, NUL-padded.
    pub comm: [u8; 16],
}

/// Indices into the `LOSSES` per-CPU array: why an event could not be delivered.
pub mod loss {
    /// The ring buffer was full.
    pub const RINGBUF_FULL: u32 = 0;
    /// The `TRACKED` map was full: a forked child could not be followed.
    pub const TRACKED_MAP_FULL: u32 = 1;
    /// `PY_CALLS` was full: a Python function's calls could not be counted.
    pub const PY_CALLS_FULL: u32 = 2;
    /// The `PY_CODES` ring buffer was full: a function's name was not sent.
    pub const PY_CODES_RINGBUF_FULL: u32 = 3;
    /// A call on a thread whose thread state is unknown (it never entered the eval loop
    /// while probed, and the daemon did not find it at attach).
    pub const PY_NO_THREAD_STATE: u32 = 4;
    /// Reading the interpreter's memory (frame, code object) failed.
    pub const PY_READ_FAILED: u32 = 5;
    /// A call deeper than `PY_STACK_DEPTH` on its thread: counted, but not timed.
    pub const PY_STACK_TOO_DEEP: u32 = 6;
    /// Not a loss: frames left by an exception, whose exit time is taken at the thread's
    /// next probed event (no probe sees the unwind itself).
    pub const PY_EXIT_INFERRED: u32 = 7;
    /// `PY_STACKS` was full: a thread's calls were counted, but not timed, and their
    /// primitive calls not told apart.
    pub const PY_THREADS_FULL: u32 = 8;
    /// `NATIVE_CALLS` was full: a native function's calls in a new process were not counted.
    pub const NATIVE_CALLS_FULL: u32 = 9;
    /// `PY_EDGES` was full: a call's caller was not recorded (pstats callers only).
    pub const PY_EDGES_FULL: u32 = 10;
    /// The `SAMPLES` ring buffer was full: a stack sample was dropped.
    pub const SAMPLES_RINGBUF_FULL: u32 = 11;
    /// The `TRACE_EVENTS` ring buffer was full: a tracing event was dropped (also counted
    /// per session in `TRACE_DROPS`).
    pub const TRACE_RINGBUF_FULL: u32 = 12;
    /// `CUDA_LAUNCHES` or `CUDA_MEMORY` was full: a launch or copy was not counted.
    pub const CUDA_MAP_FULL: u32 = 13;
    /// The `CUDA_NAMES` ring buffer was full: a kernel's name was not sent.
    pub const CUDA_NAMES_RINGBUF_FULL: u32 = 14;
    /// CUPTI dropped kernel activity records (its buffers were full), as tracer's injection
    /// library reported them: kernels whose GPU time is missing.
    pub const CUPTI_RECORDS_DROPPED: u32 = 15;
    /// `PY_INPROC` was full: a forked child of a process counted in-process was not marked,
    /// so another session's Python uprobes may count its calls too.
    pub const PY_INPROC_FULL: u32 = 16;
    /// Number of loss causes (size of the `LOSSES` array).
    pub const COUNT: u32 = 17;
}

/// Capacity of the `TRACKED` map (followed processes, all sessions together).
pub const TRACKED_MAX_ENTRIES: u32 = 65_536;

/// Tracepoint field offsets read from tracefs at load time, so one object fits every kernel.
/// Set as globals by the loader; `u32::MAX` means "field absent".
pub mod globals {
    pub const NEWTASK_PID_OFFSET: &str = "NEWTASK_PID_OFFSET";
    pub const NEWTASK_CLONE_FLAGS_OFFSET: &str = "NEWTASK_CLONE_FLAGS_OFFSET";
    pub const EXIT_GROUP_DEAD_OFFSET: &str = "EXIT_GROUP_DEAD_OFFSET";
    /// `task_struct.thread.fsbase`, from the kernel's BTF: `pthread_self()` of the sampled
    /// thread, which CPython stores as its thread state's `thread_id`.
    pub const TASK_FSBASE_OFFSET: &str = "TASK_FSBASE_OFFSET";
}

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
    pub slot: u32,
    pub pid: u32,
    pub code: u64,
    pub names: u64,
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

/// Python frames read per sample; deeper frames are cut (the sample says so).
pub const SAMPLE_PY_DEPTH: usize = 128;
/// Most bytes of the sampled thread's user stack copied for unwinding in user space, from
/// the start of the page holding its stack pointer (no frame pointers in distribution
/// builds); the copy ends earlier at the first unreadable page (the top of a main thread's
/// stack). 64 KiB, perf's own limit: importing PyTorch runs deeper than 16 KiB.
pub const SAMPLE_STACK_BYTES: usize = 65_536;
/// Where `SampleEvent::stack` starts: a record on the ring is this many bytes plus the
/// stack bytes copied (`stack_len`).
pub const SAMPLE_STACK_OFFSET: usize = core::mem::offset_of!(SampleEvent, stack);

/// `PySampleFrame::code` bits above any user address: this frame was the first of its
/// run of the eval loop (3.10: every frame; 3.11: `is_entry`).
pub const PY_FRAME_ENTRY: u64 = 1 << 63;
/// `PySampleFrame::code` bit: a 3.12+ frame owned by the C stack, a shim marking the start
/// of an eval-loop run (it is not a Python function).
pub const PY_FRAME_SHIM: u64 = 1 << 62;

/// One Python frame of a sample: its code object and its current instruction.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PySampleFrame {
    /// Code object address, with `PY_FRAME_ENTRY`/`PY_FRAME_SHIM` flags.
    pub code: u64,
    /// 3.10: `f_lasti` (instruction index, sign-extended); 3.11+: address of the instruction.
    pub instr: u64,
    /// `py_names_id` of the code object's qualname and file name objects when sampled: the
    /// daemon names the frame only if the code object still has them (a freed code object's
    /// address is soon reused by another one).
    pub names: u64,
}

/// `SampleEvent::flags`.
pub mod sample_flag {
    /// The process is a known Python process and its thread state was found.
    pub const PYTHON: u32 = 1;
    /// The Python chain was longer than `SAMPLE_PY_DEPTH`.
    pub const PY_TRUNCATED: u32 = 2;
    /// A Python process, but this thread has no thread state (a native thread).
    pub const PY_NO_THREAD: u32 = 4;
    /// Reading the interpreter's memory failed mid-chain.
    pub const PY_READ_FAILED: u32 = 8;
    /// The daemon has not yet told the probe whether this process runs Python.
    pub const PY_UNKNOWN_PROCESS: u32 = 16;
    /// The sample interrupted kernel code.
    pub const KERNEL_MODE: u32 = 32;
}

/// One stack sample, sent on the `SAMPLES` ring buffer up to the stack bytes copied. Kernel
/// stacks are aggregated in a stack map (`kernel_stack` is its id); user stacks travel as a
/// stack copy, unwound by the daemon with the binaries' unwind tables.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SampleEvent {
    /// The session the sample is for.
    pub slot: u32,
    pub cpu: u32,
    pub pid: u32,
    pub tid: u32,
    pub ktime_ns: u64,
    /// Id in `SAMPLE_KSTACKS`, or negative: no kernel stack (user mode) or an error.
    pub kernel_stack: i64,
    /// User registers at the sample.
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    /// Address of `stack[0]` (the page of `sp`) and how many bytes were copied.
    pub stack_base: u64,
    pub stack_len: u32,
    pub flags: u32,
    pub py_depth: u32,
    pub _pad: u32,
    pub comm: [u8; 16],
    /// Innermost first.
    pub py: [PySampleFrame; SAMPLE_PY_DEPTH],
    pub stack: [u8; SAMPLE_STACK_BYTES],
}

/// Value of `PY_SAMPLE_PROCS`: how to read a process's Python stacks.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PySampleProc {
    /// Address of `_PyRuntime` in the process.
    pub runtime: u64,
    /// Index into `PY_LAYOUTS`, or `PY_SAMPLE_NOT_PYTHON`.
    pub layout: u32,
    /// 0 for a process the daemon looked at; for a forked copy of one, that process's pid:
    /// its memory held the child's code objects first, and may still when the child is gone.
    pub origin: u32,
}

/// `PySampleProc::layout`: the daemon looked, and the process does not run a known CPython.
pub const PY_SAMPLE_NOT_PYTHON: u32 = u32::MAX;

/// The attach cookie of a sampling perf event: the session slot, and whether it samples
/// every process.
pub mod sample_cookie {
    pub const ALL: u64 = 1 << 8;
    pub const SLOT_MASK: u64 = 0xff;

    pub const fn make(slot: u8, all: bool) -> u64 {
        slot as u64 | if all { ALL } else { 0 }
    }
}

/// `TraceEvent::kind`.
pub mod trace_kind {
    /// A Python call ended (returned, yielded, or left by an exception): `start_ns`..`end_ns`,
    /// `a` = code object, `b` = its `py_names_id`.
    pub const PY_CALL: u16 = 1;
    /// A probed native function was entered: `start_ns`, `a` = the daemon's probe number.
    pub const NATIVE_CALL: u16 = 2;
    /// Daemon-made: a perf counter's reading: `start_ns`, `a` = counter index, `b` = value.
    pub const COUNTER: u16 = 3;
    /// A CUDA launch (`--cuda`): `start_ns`, `flags` = its `cuda_api` entry point, `a` = the
    /// kernel handle (or graph exec), `b` = its launch row (`CudaLaunchKey::row_id`).
    pub const CUDA_LAUNCH: u16 = 4;
    /// A CUDA copy, allocation, free or synchronization: `start_ns`, `flags` = its
    /// `CudaMemKey::kind`, `a` = bytes.
    pub const CUDA_MEMORY: u16 = 5;
    /// A kernel's execution on the GPU (CUPTI, through tracer's injection library):
    /// `start_ns`..`end_ns`, `a` = CUPTI's name pointer, `b` = device << 32 | stream;
    /// `tid` is CUPTI's thread, not the launcher's.
    pub const GPU_KERNEL: u16 = 6;
    /// Kinds there are, for per-kind tables.
    pub const COUNT: usize = 7;
}

/// `TraceEvent::flags`: the call's exit was inferred (an exception unwound it unseen).
pub const TRACE_EXIT_INFERRED: u16 = 1;
/// `TraceEvent::flags`: the call was still running when the session ended; `end_ns` is the end.
pub const TRACE_UNFINISHED: u16 = 2;

/// One tracing event, sent on the `TRACE_EVENTS` ring buffer and stored as is (with
/// `sessions` zeroed) in a session's trace file. Times are `bpf_ktime_get_ns`
/// (CLOCK_MONOTONIC).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceEvent {
    pub kind: u16,
    pub flags: u16,
    pub cpu: u32,
    pub pid: u32,
    pub tid: u32,
    /// The tracing sessions this event is for.
    pub sessions: SessionMask,
    pub start_ns: u64,
    pub end_ns: u64,
    pub a: u64,
    pub b: u64,
}

/// Wake the daemon's reader once this many bytes wait in `TRACE_EVENTS` (fewer: it polls):
/// a wakeup per event would cost more than the event.
pub const TRACE_WAKEUP_BYTES: u64 = 256 * 1024;

/// CUDA entry points tracer probes; the low bits of a CUDA probe's attach cookie.
pub mod cuda_api {
    /// libcuda `cuLaunchKernel` (and `_ptsz`): f, grid, block, shared memory, stream.
    pub const CU_LAUNCH: u32 = 1;
    /// libcuda `cuLaunchKernelEx` (and `_ptsz`): a `CUlaunchConfig` and f.
    pub const CU_LAUNCH_EX: u32 = 2;
    /// libcudart `cudaLaunchKernel` (and `_ptsz`): func, dim3 grid and block by value.
    pub const CUDA_LAUNCH: u32 = 3;
    /// libcudart `cudaLaunchKernelExC` (and `_ptsz`): a `cudaLaunchConfig_t` and func.
    pub const CUDA_LAUNCH_EX: u32 = 4;
    /// `cuGraphLaunch` / `cudaGraphLaunch`: a graph exec and a stream.
    pub const CU_GRAPH: u32 = 5;
    pub const CUDA_GRAPH: u32 = 6;
    /// Naming: `cuModuleGetFunction(&f, module, name)`.
    pub const CU_MODULE_GET_FUNCTION: u32 = 10;
    /// `cuLibraryGetKernel(&kernel, library, name)`.
    pub const CU_LIBRARY_GET_KERNEL: u32 = 11;
    /// `cuKernelGetFunction(&f, kernel)`: a function for a named kernel.
    pub const CU_KERNEL_GET_FUNCTION: u32 = 12;
    /// `__cudaGetKernel(&kernel, host_stub)`: the runtime's handle for a host stub.
    pub const CUDA_GET_KERNEL: u32 = 13;
    /// `__cudaRegisterFunction(module, host_stub, device_fun, device_name, …)`.
    pub const CUDA_REGISTER_FUNCTION: u32 = 14;
    /// Copies and allocations.
    pub const CUDA_MEMCPY: u32 = 20;
    pub const CUDA_MEMCPY_ASYNC: u32 = 21;
    pub const CU_MEMCPY_HTOD: u32 = 22;
    pub const CU_MEMCPY_DTOH: u32 = 23;
    pub const CUDA_MALLOC: u32 = 24;
    pub const CUDA_FREE: u32 = 25;
    pub const CU_MEM_ALLOC: u32 = 26;
    pub const CU_MEM_FREE: u32 = 27;
    pub const CUDA_DEVICE_SYNCHRONIZE: u32 = 28;
    pub const CUDA_STREAM_SYNCHRONIZE: u32 = 29;
    /// Not an entry point: a `CudaNameEvent` announcing a launch's Python call site
    /// (`handle` = code object, `other` = instruction, `extra` = names id).
    pub const CALL_SITE: u32 = 30;
    /// Not an entry point: a new launch row (`handle` = the launched handle, `other` = the
    /// native caller's return address, `extra` = the entry point), sent once per row so that
    /// user space names the caller (and an unnamed handle) while the process lives.
    pub const LAUNCH_ROW: u32 = 31;
    /// Not an entry point: a followed process mapped a file executable (`handle` = the
    /// address, `other` = the length); it may be a CUDA library to probe now.
    pub const LIBRARY_MAPPED: u32 = 32;
    /// Not an entry point: a driver launch row made inside a runtime launch that had just
    /// made a new row on the same thread (`handle` = the driver's handle, `other` = the
    /// runtime's, `extra` = the runtime call's return address): names for the one serve
    /// the other.
    pub const ROW_LINK: u32 = 33;
    /// `tracer_cupti_kernel(const CuptiKernel *)` in tracer's CUPTI injection library: a
    /// kernel's execution on the GPU. As a `CudaNameEvent`: a kernel name CUPTI gave
    /// (`handle` = its pointer).
    pub const CUPTI_KERNEL: u32 = 40;
    /// `tracer_cupti_dropped(u64 records)`: CUPTI dropped kernel records.
    pub const CUPTI_DROPPED: u32 = 41;
    /// `tracer_cupti_initialized(const char *status)`: the injection library set up CUPTI
    /// (or failed to); sent as a `CudaNameEvent` with the status line as its name.
    pub const CUPTI_STATUS: u32 = 42;
    pub const MASK: u64 = 0xff;

    /// The entry point's name as reports show it.
    pub fn name(which: u32) -> &'static str {
        match which {
            CU_LAUNCH => "cuLaunchKernel",
            CU_LAUNCH_EX => "cuLaunchKernelEx",
            CUDA_LAUNCH => "cudaLaunchKernel",
            CUDA_LAUNCH_EX => "cudaLaunchKernelExC",
            CU_GRAPH => "cuGraphLaunch",
            CUDA_GRAPH => "cudaGraphLaunch",
            CUDA_MEMCPY => "cudaMemcpy",
            CUDA_MEMCPY_ASYNC => "cudaMemcpyAsync",
            CU_MEMCPY_HTOD => "cuMemcpyHtoD",
            CU_MEMCPY_DTOH => "cuMemcpyDtoH",
            CUDA_MALLOC => "cudaMalloc",
            CUDA_FREE => "cudaFree",
            CU_MEM_ALLOC => "cuMemAlloc",
            CU_MEM_FREE => "cuMemFree",
            CUDA_DEVICE_SYNCHRONIZE => "cudaDeviceSynchronize",
            CUDA_STREAM_SYNCHRONIZE => "cudaStreamSynchronize",
            _ => "?",
        }
    }

    /// `cudaMemcpyKind`, as the probe folds it into a memory key's kind (× 100).
    pub fn memcpy_kind(kind: u32) -> (u32, &'static str) {
        let direction = match kind / 100 {
            0 => "host to host",
            1 => "host to device",
            2 => "device to host",
            3 => "device to device",
            4 => "default (by pointer)",
            _ => "unknown",
        };
        (kind % 100, direction)
    }

    /// Whether a memory kind is a `cudaMemcpy*` (whose kind carries a direction).
    pub fn is_memcpy(kind: u32) -> bool {
        matches!(kind % 100, CUDA_MEMCPY | CUDA_MEMCPY_ASYNC)
    }
}

/// The attach cookie of a CUDA probe: session slot, whether the session follows every
/// process, and the entry point (`cuda_api`).
pub mod cuda_cookie {
    pub const SLOT_SHIFT: u64 = 32;
    pub const ALL: u64 = 1 << 31;
    /// `--cuda-stacks`: each launch also records its stack on the sampling ring.
    pub const STACKS: u64 = 1 << 30;

    pub const fn make(slot: u8, all: bool, api: u32) -> u64 {
        ((slot as u64) << SLOT_SHIFT)
            | if all { ALL } else { 0 }
            | (api as u64 & super::cuda_api::MASK)
    }
}

/// Key of `CUDA_LAUNCHES`: launches of one kernel handle with one configuration, through one
/// entry point, in one process, for one session. The value is the count (u64).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CudaLaunchKey {
    pub slot: u32,
    pub pid: u32,
    pub api: u32,
    pub shared_mem: u32,
    /// CUfunction, runtime kernel handle (or host stub), or graph exec.
    pub func: u64,
    pub stream: u64,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// The launching thread's innermost Python frame: code object, current instruction and
    /// `py_names_id` (0: none, or not a Python thread).
    pub py_code: u64,
    pub py_instr: u64,
    pub py_names: u64,
    /// The return address of the probed call: the native code that launched (for nvcc's
    /// code, inside the kernel's host stub).
    pub caller: u64,
}

impl CudaLaunchKey {
    /// Names the row within its session (the slot left out), so that a trace event can carry
    /// it in one word and the exporter find the row's configuration and call sites.
    pub fn row_id(&self) -> u64 {
        let words = [
            self.pid as u64 | (self.api as u64) << 32,
            self.shared_mem as u64,
            self.func,
            self.stream,
            self.grid[0] as u64 | (self.grid[1] as u64) << 32,
            self.grid[2] as u64 | (self.block[0] as u64) << 32,
            self.block[1] as u64 | (self.block[2] as u64) << 32,
            self.py_code,
            self.py_instr,
            self.py_names,
            self.caller,
        ];
        // FNV-1a over words, with a shift to spread the high bits: cheap enough for the probe.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut i = 0;
        while i < words.len() {
            h = (h ^ words[i]).wrapping_mul(0x0100_0000_01b3);
            h ^= h >> 29;
            i += 1;
        }
        h
    }
}

/// Key of `CUDA_MEMORY`: copies or allocations of one kind, in one process, for one session.
/// `kind`: the `cuda_api` entry point; for `cudaMemcpy*`, plus 100 × its `cudaMemcpyKind`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CudaMemKey {
    pub slot: u32,
    pub pid: u32,
    pub kind: u32,
    pub _pad: u32,
}

/// Value of `CUDA_MEMORY`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaMemStats {
    pub calls: u64,
    pub bytes: u64,
}

pub const CUDA_NAME_LEN: usize = 512;

/// A kernel's execution on the GPU, as tracer's CUPTI injection library (`libtracer_cupti.so`)
/// passes it to `tracer_cupti_kernel`, whose probe reads it. Times are CLOCK_MONOTONIC ns
/// (the library converts CUPTI's timestamps), the clock of every other trace event.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CuptiKernel {
    /// The kernel's name as CUPTI gives it (`const char *`, mangled; CUPTI keeps one string
    /// per kernel for the process's life).
    pub name: u64,
    pub start_ns: u64,
    pub end_ns: u64,
    pub device: u32,
    pub stream: u32,
    /// CUPTI's correlation id of the launch.
    pub correlation: u32,
    /// Static plus dynamic shared memory, bytes.
    pub shared_mem: u32,
    pub grid: [u32; 3],
    pub block: [u32; 3],
}

/// Key of `GPU_KERNELS`: executions of one kernel (by CUPTI's name pointer) with one grid and
/// block on one device, in one process, for one session.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GpuKernelKey {
    pub slot: u32,
    pub pid: u32,
    pub name: u64,
    pub device: u32,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub _pad: u32,
}

/// Value of `GPU_KERNELS`: GPU time, ns.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuKernelStats {
    pub executions: u64,
    pub total_ns: u64,
    pub min_ns: u64,
    pub max_ns: u64,
}

/// Sent on `CUDA_NAMES` when a process names a kernel handle: `handle` is what launches
/// will pass; `other` is the kernel (`CU_KERNEL_GET_FUNCTION`) or host stub
/// (`CUDA_GET_KERNEL`, `CUDA_REGISTER_FUNCTION`) it stands for; `name` the device name when
/// the call carries one.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CudaNameEvent {
    pub pid: u32,
    pub api: u32,
    pub handle: u64,
    pub other: u64,
    pub extra: u64,
    /// `CALL_SITE`: `PySampleProc::origin` of the process (where else its code objects are).
    pub origin: u32,
    pub _pad: u32,
    pub name: [u8; CUDA_NAME_LEN],
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY (all): repr(C), Copy, every field an integer or byte array, no implicit padding.
    unsafe impl aya::Pod for super::ProcEvent {}
    unsafe impl aya::Pod for super::LossKey {}
    unsafe impl aya::Pod for super::PyLayout {}
    unsafe impl aya::Pod for super::PyCallKey {}
    unsafe impl aya::Pod for super::PyCodeEvent {}
    unsafe impl aya::Pod for super::PyCallStats {}
    unsafe impl aya::Pod for super::NativeCallKey {}
    unsafe impl aya::Pod for super::PyEdgeKey {}
    unsafe impl aya::Pod for super::PySampleProc {}
    unsafe impl aya::Pod for super::TraceEvent {}
    unsafe impl aya::Pod for super::PyStack {}
    unsafe impl aya::Pod for super::PyStackEntry {}
    unsafe impl aya::Pod for super::CudaLaunchKey {}
    unsafe impl aya::Pod for super::CudaMemKey {}
    unsafe impl aya::Pod for super::CudaMemStats {}
    unsafe impl aya::Pod for super::GpuKernelKey {}
    unsafe impl aya::Pod for super::GpuKernelStats {}
}

/// Key of `NATIVE_CALLS`: calls of one probed native function in one process, for one
/// session. The value is the count (u64).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NativeCallKey {
    pub slot: u32,
    pub pid: u32,
    /// The daemon's number for the probed function.
    pub probe: u32,
    pub _pad: u32,
}

/// Capacity of `NATIVE_CALLS`.
pub const NATIVE_CALLS_MAX: u32 = 65_536;

/// The attach cookie of a native-call probe: session slot, whether the session counts every
/// process, and the probe's number.
pub mod native_cookie {
    pub const SLOT_SHIFT: u64 = 32;
    pub const ALL: u64 = 1 << 31;
    pub const PROBE_MASK: u64 = (1 << 31) - 1;

    pub const fn make(slot: u8, all: bool, probe: u32) -> u64 {
        ((slot as u64) << SLOT_SHIFT) | if all { ALL } else { 0 } | (probe as u64 & PROBE_MASK)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn python_types_have_no_hidden_padding() {
        assert_eq!(core::mem::size_of::<super::PyLayout>(), 25 * 4);
        assert_eq!(
            core::mem::size_of::<super::SampleEvent>(),
            4 * 4 + 8 * 6 + 4 * 4 + 16 + 24 * super::SAMPLE_PY_DEPTH + super::SAMPLE_STACK_BYTES
        );
        assert_eq!(
            core::mem::size_of::<super::PyStack>(),
            8 + 64 * super::PY_STACK_DEPTH
        );
        assert_eq!(core::mem::size_of::<super::PyCallKey>(), 24);
        assert_eq!(core::mem::size_of::<super::PyEdgeKey>(), 40);
        assert_eq!(
            core::mem::size_of::<super::PyCodeEvent>(),
            4 + 4 + 8 + 8 + 4 + 4 + super::PY_QUALNAME_LEN + super::PY_FILENAME_LEN
        );
    }

    #[test]
    fn cuda_types_have_no_hidden_padding() {
        assert_eq!(
            core::mem::size_of::<super::CudaLaunchKey>(),
            4 * 4 + 8 * 2 + 4 * 6 + 8 * 4
        );
        assert_eq!(
            core::mem::size_of::<super::CudaNameEvent>(),
            4 * 2 + 8 * 3 + 4 * 2 + super::CUDA_NAME_LEN
        );
        assert_eq!(
            core::mem::size_of::<super::CuptiKernel>(),
            8 * 3 + 4 * 4 + 4 * 6
        );
        assert_eq!(core::mem::size_of::<super::GpuKernelKey>(), 48);
    }

    #[test]
    fn trace_event_has_no_hidden_padding() {
        assert_eq!(
            core::mem::size_of::<super::TraceEvent>(),
            2 + 2 + 4 * 3 + 8 * 5
        );
    }

    #[test]
    fn proc_event_has_no_hidden_padding() {
        assert_eq!(core::mem::size_of::<super::ProcEvent>(), 4 * 4 + 8 + 8 + 16);
        assert_eq!(core::mem::size_of::<super::LossKey>(), 16);
    }
}
