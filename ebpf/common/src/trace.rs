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
