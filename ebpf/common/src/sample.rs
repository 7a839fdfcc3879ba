//! Stack sampling's records: the sample sent on the ring (Python frames and a copy of the
//! user stack), how to read a process's Python stacks, and the sampler's attach cookie.

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

/// `PySampleFrame::code` bit: not a frame but an asyncio task (3.14+), whose address the
/// rest of `code` is, `instr` its name object's; frames after it, up to the next task, are
/// its coroutine chain, outermost first. The first task is the one running.
pub const PY_FRAME_TASK: u64 = 1 << 61;

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
    /// Off-CPU time (`--off-cpu`), not a timer's sample: the thread just came back to a CPU
    /// after `SampleEvent::weight_ns` away; its stacks are where it left.
    pub const OFF_CPU: u32 = 64;
    /// Off-CPU: it left the CPU runnable (preempted), not blocked.
    pub const PREEMPTED: u32 = 128;
    /// Off-CPU: it left in uninterruptible sleep (`D`: disk I/O, page faults, some locks).
    pub const UNINTERRUPTIBLE: u32 = 256;
    /// A Python thread's sample that read the GIL's state: `GIL_HELD` says whether this
    /// thread held it.
    pub const GIL_KNOWN: u32 = 512;
    pub const GIL_HELD: u32 = 1024;
    /// A CUDA launch's stack on a thread that runs no Python (no thread state, or no
    /// frame): its Python frames are those of the thread it works for (`py_from`).
    pub const PY_ELSEWHERE: u32 = 2048;
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
    /// 1 + index in `py` of the running asyncio task's coroutine frame, where the thread's
    /// frames stop and the task's begin; 0: none found.
    pub py_task: u32,
    /// Off-CPU records: every session they are for (`slot` is the lowest of them).
    pub slots: u64,
    /// Off-CPU records: the nanoseconds they stand for: the period that just ended and the
    /// thread's shorter ones before it that no record stood for yet (`own_ns`: the last).
    pub weight_ns: u64,
    pub own_ns: u64,
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

/// Value of `PY_ASYNC_PROCS`: how to read a process's asyncio tasks. On 3.14+, from its
/// `_asyncio` module's `.AsyncioDebug` section and the interpreter's `_Py_DebugOffsets`; on
/// 3.11–3.13 (`legacy`), from tracer's table of their private structs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PyAsyncLayout {
    /// Within the thread state: the running loop and task (NULL: none).
    pub tstate_running_loop: u32,
    pub tstate_running_task: u32,
    /// Within a task: its coroutine, name, and who awaits it (a task, or a set of them).
    pub task_coro: u32,
    pub task_name: u32,
    pub task_awaited_by: u32,
    pub task_awaited_by_is_set: u32,
    /// Within a coroutine: its embedded frame and the frame's state.
    pub gen_iframe: u32,
    pub gen_frame_state: u32,
    /// `_PyInterpreterFrame.stackpointer`: a coroutine suspended in an await has what it
    /// awaits two slots below. Legacy: `stacktop`, an `int` counting slots from `localsplus`.
    pub frame_stackpointer: u32,
    pub ob_type: u32,
    /// `PySetObject`: its table of (key, hash) entries.
    pub set_table: u32,
    pub set_mask: u32,
    /// `gi_frame_state` (an `int8_t`) of a coroutine suspended inside an `await`: -1 on
    /// 3.14, 2 from 3.15 (renumbered).
    pub yield_from_state: u32,
    /// 1 on 3.11–3.13, whose thread state names no running task and whose tasks keep no
    /// `awaited_by`: the running task is found from the frames (the `Handle._run` below a
    /// task's coroutine holds a callback bound to it), and who awaits a task from its
    /// done-callbacks (a task's wakeup, or `gather`'s `_done_callback`), each candidate
    /// checked against the task's own fields (`task_coro`, `task_fut_waiter`). The fields
    /// below are read only then.
    pub legacy: u32,
    /// `_PyInterpreterFrame.localsplus`: a method's `self` is its first slot.
    pub frame_localsplus: u32,
    /// `co_flags` in a code object (a coroutine's has `CO_COROUTINE`).
    pub code_flags: u32,
    /// `events.Handle`'s `_callback` slot.
    pub handle_callback: u32,
    /// Within a future: its first done-callback and the list of the others.
    pub fut_callback0: u32,
    pub fut_callbacks: u32,
    /// Within a task: the future it awaits (NULL: none).
    pub task_fut_waiter: u32,
    /// `PyFunctionObject.func_closure`: a tuple of cells; and which of `gather`'s
    /// `_done_callback` holds its future (`outer`; free variables are sorted by name).
    pub func_closure: u32,
    pub gather_outer: u32,
}
/// Tasks followed from the running one to the outermost awaiting it.
pub const PY_ASYNC_TASKS_MAX: u32 = 16;

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

/// One thread's off-CPU bookkeeping (`OFFCPU_THREADS`): the period under way, the time of
/// its earlier short periods that no record carried yet, and a record due: the thread is
/// back, and the record goes out in its own context (where its user stack can be read) at
/// its next syscall exit or switch.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffCpuThread {
    /// `bpf_ktime_get_ns` when it left; 0 while it runs.
    pub since_ns: u64,
    pub carry_ns: u64,
    /// Kernel stack id where it left (`SAMPLE_KSTACKS`), or negative.
    pub kernel_stack: i64,
    /// `sample_flag::PREEMPTED`/`UNINTERRUPTIBLE` of the period under way.
    pub flags: u32,
    pub due_flags: u32,
    /// The record due: nanoseconds (0: none), of which its own period's, and where it left.
    pub due_ns: u64,
    pub due_own_ns: u64,
    pub due_kernel_stack: i64,
    /// Tracing sessions' thread states: its process, the system call it left in (-1: it left
    /// outside one, or not blocked) and what the fd that call waited on is (`off_cpu_fd`).
    pub pid: u32,
    pub _pad: u32,
    pub syscall: i64,
    pub fd_kind: u64,
}

/// `OFFCPU_SESSIONS`' one value: which sessions record off-CPU time.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffCpuConfig {
    /// Sessions following processes (their threads, by `TRACKED`).
    pub slots: u64,
    /// Sessions of every process.
    pub all: u64,
    /// A thread's off-CPU time goes out as a record once it adds up to this much; shorter
    /// periods are carried into its next record.
    pub min_ns: u64,
    /// Tracing sessions following processes, and of every process: each time away of at
    /// least `trace_min_ns` is an event on their timeline (`trace_kind::OFF_CPU`).
    pub trace_slots: u64,
    pub trace_all: u64,
    pub trace_min_ns: u64,
}
