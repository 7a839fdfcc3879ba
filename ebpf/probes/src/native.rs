//! Counting calls of native functions (`--uprobe LIB:SYMBOL`), like bcc's funccount: one
//! uprobe per function and session, a counter per (session, process, function) in the kernel;
//! a tracing session also gets each call as an event.

use aya_ebpf::{
    helpers::{bpf_get_attach_cookie, bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::{map, uprobe},
    maps::HashMap,
    programs::ProbeContext,
    EbpfContext,
};
use tracer_common::{loss, native_cookie, trace_kind, NativeCallKey, TraceEvent, NATIVE_CALLS_MAX};

use crate::{
    shared::{count_loss, TRACKED},
    trace,
};

#[map]
static NATIVE_CALLS: HashMap<NativeCallKey, u64> = HashMap::with_max_entries(NATIVE_CALLS_MAX, 0);

/// BPF_NOEXIST: insert only if absent (another CPU may have inserted it meanwhile).
const NOEXIST: u64 = 1;

#[uprobe]
pub fn tracer_native_call(ctx: ProbeContext) -> u32 {
    // SAFETY: plain helper calls on this program's context.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    let pid_tgid = bpf_get_current_pid_tgid();
    let pid = (pid_tgid >> 32) as u32;
    let slot = (cookie >> native_cookie::SLOT_SHIFT) as u32 & 63;
    if cookie & native_cookie::ALL == 0 {
        // SAFETY: map values are valid for the duration of the program.
        let followed = unsafe { TRACKED.get(&pid) }.copied().unwrap_or(0);
        if followed & (1 << slot) == 0 {
            return 0;
        }
    }
    let probe = (cookie & native_cookie::PROBE_MASK) as u32;
    let traced = trace::tracing(1 << slot);
    if traced != 0 {
        // SAFETY: plain helper call.
        let now = unsafe { bpf_ktime_get_ns() };
        trace::emit(&TraceEvent {
            kind: trace_kind::NATIVE_CALL,
            pid,
            tid: pid_tgid as u32,
            sessions: traced,
            start_ns: now,
            end_ns: now,
            a: u64::from(probe),
            ..TraceEvent::default()
        });
    }
    let key = NativeCallKey {
        slot,
        pid,
        probe,
        _pad: 0,
    };
    for _ in 0..2 {
        if let Some(n) = NATIVE_CALLS.get_ptr_mut(&key) {
            crate::python::add(n, 1);
            return 0;
        }
        if NATIVE_CALLS.insert(&key, &1, NOEXIST).is_ok() {
            return 0;
        }
    }
    count_loss(loss::NATIVE_CALLS_FULL);
    0
}
