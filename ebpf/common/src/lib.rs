//! Records and keys shared by the BPF programs (`ebpf/probes`) and the daemon.
//!
//! Every type is `#[repr(C)]`, `Copy`, and spells out its padding so that both compilers
//! agree on the layout byte for byte. This file holds what every program shares (followed
//! processes, losses, tracepoint globals); each probe family's records have a file of their
//! own, re-exported here so that both sides name them `tracer_common::X`.
#![no_std]

pub mod inproc;
pub mod launches;

mod cuda;
mod native;
mod python;
mod sample;
mod trace;

pub use cuda::*;
pub use native::*;
pub use python::*;
pub use sample::*;
pub use trace::*;

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
    /// A thread exited with Python frames on its shadow stack and the process-exit program
    /// in use is the variant without the unwinding loop (the kernel refused the whole):
    /// those frames' calls are not counted.
    pub const PY_THREAD_EXIT_UNWOUND: u32 = 17;
    /// Number of loss causes (size of the `LOSSES` array).
    pub const COUNT: u32 = 18;
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
    /// `sched:sched_switch`'s `prev_state`, from its tracefs format.
    pub const SWITCH_PREV_STATE_OFFSET: &str = "SWITCH_PREV_STATE_OFFSET";
    pub const SWITCH_NEXT_PID_OFFSET: &str = "SWITCH_NEXT_PID_OFFSET";
    /// From the kernel's BTF, `[u32; 6]` (`FD_OFFSETS`): what an fd is, for off-CPU events
    /// (`task_struct.files`, `files_struct.fdt`, `fdtable.max_fds`, `fdtable.fd`,
    /// `file.f_inode`, `inode.i_mode`); `u32::MAX`: not known.
    pub const FD_OFFSETS: &str = "FD_OFFSETS";
    /// From the kernel's BTF, `[u32; 2]` (`FILE_NAME_OFFSETS`): the name of a file being
    /// mapped, to hold a process that maps a CUDA library until it is probed
    /// (`file.f_path.dentry`, `dentry.d_name.name`); `u32::MAX`: not known.
    pub const FILE_NAME_OFFSETS: &str = "FILE_NAME_OFFSETS";
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
    unsafe impl aya::Pod for super::PyAsyncLayout {}
    unsafe impl aya::Pod for super::OffCpuThread {}
    unsafe impl aya::Pod for super::OffCpuConfig {}
    unsafe impl aya::Pod for super::TraceEvent {}
    unsafe impl aya::Pod for super::PyStack {}
    unsafe impl aya::Pod for super::PyStackEntry {}
    unsafe impl aya::Pod for super::CudaLaunchKey {}
    unsafe impl aya::Pod for super::CudaMemKey {}
    unsafe impl aya::Pod for super::CudaMemStats {}
    unsafe impl aya::Pod for super::GpuKernelKey {}
    unsafe impl aya::Pod for super::GpuKernelStats {}
}

#[cfg(test)]
mod tests {
    #[test]
    fn python_types_have_no_hidden_padding() {
        assert_eq!(core::mem::size_of::<super::PyLayout>(), 28 * 4);
        assert_eq!(
            core::mem::size_of::<super::SampleEvent>(),
            4 * 4
                + 8 * 6
                + 4 * 4
                + 8 * 3
                + 16
                + 24 * super::SAMPLE_PY_DEPTH
                + super::SAMPLE_STACK_BYTES
        );
        assert_eq!(
            core::mem::size_of::<super::PyStack>(),
            8 + 64 * super::PY_STACK_DEPTH
        );
        assert_eq!(core::mem::size_of::<super::PyAsyncLayout>(), 22 * 4);
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
            4 * 4 + 8 * 2 + 4 * 6 + 4 * 2 + 8 * 4
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
