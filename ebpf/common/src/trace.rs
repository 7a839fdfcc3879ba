//! Tracing's one record, the event every traced call, launch, copy or counter reading
//! becomes, and its kinds and flags.

use crate::SessionMask;

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
    /// A thread's time off the CPU (`--off-cpu`): `start_ns`..`end_ns`, `flags` = its
    /// `sample_flag::PREEMPTED`/`UNINTERRUPTIBLE` state, `a` = the system call it blocked in
    /// (x86-64 number; `u64::MAX`: none), `b` = what the fd it waited on is (`off_cpu_fd`,
    /// for `OFF_CPU_FD_CALLS`), read from the thread's fd table as it left.
    pub const OFF_CPU: u16 = 7;
    /// Kinds there are, for per-kind tables.
    pub const COUNT: usize = 8;
}

/// `TraceEvent::b` of an `OFF_CPU` event in a trace file: what the fd its call read or
/// waited on was.
pub mod off_cpu_fd {
    pub const UNKNOWN: u64 = 0;
    pub const PIPE: u64 = 1;
    pub const SOCKET: u64 = 2;
    /// A regular file.
    pub const FILE: u64 = 3;
    /// A character device: a terminal, `/dev/null`, a GPU's device file.
    pub const DEVICE: u64 = 4;
}

/// x86-64 system calls whose first argument is the fd they wait on (reads, writes, socket
/// calls): the fd's kind says more than the call.
pub const OFF_CPU_FD_CALLS: [u64; 19] = [
    0, 1, 17, 18, 19, 20, 42, 43, 44, 45, 46, 47, 288, 295, 296, 299, 307, 327, 328,
];

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
