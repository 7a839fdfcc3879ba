//! Tracing sessions' events: one record per Python call and per native probe hit, on one
//! ring buffer shared by every tracing session (each record says which sessions it is for).

use aya_ebpf::{
    helpers::bpf_get_smp_processor_id,
    macros::map,
    maps::{Array, PerCpuArray, RingBuf},
};
use tracer_common::{loss, SessionMask, TraceEvent, MAX_TRACKED_SESSIONS, TRACE_WAKEUP_BYTES};

use crate::shared::count_loss;

#[map]
static TRACE_EVENTS: RingBuf = RingBuf::with_byte_size(64 * 1024 * 1024, 0);

/// One entry: the session slots that are tracing.
#[map]
static TRACE_SESSIONS: Array<SessionMask> = Array::with_max_entries(1, 0);

/// Events dropped because `TRACE_EVENTS` was full, per session slot: exact per-session loss.
#[map]
static TRACE_DROPS: PerCpuArray<u64> =
    PerCpuArray::with_max_entries(MAX_TRACKED_SESSIONS as u32, 0);

const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;
const BPF_RB_AVAIL_DATA: u64 = 0;

/// Those of `mask`'s sessions that are tracing.
#[inline(always)]
pub(crate) fn tracing(mask: SessionMask) -> SessionMask {
    mask & TRACE_SESSIONS.get(0).copied().unwrap_or(0)
}

/// Sends one event to its sessions (`ev.sessions`), or counts it lost for each of them.
pub(crate) fn emit(ev: &TraceEvent) {
    emit_in_place(*ev);
}

/// [`emit`], inlined: the event goes straight into the ring rather than being built on the
/// BPF stack first, for the deepest call chains (a frame popped under an unwinding loop),
/// whose stack frames together the verifier allows 512 bytes. `ev.cpu` is filled in here.
#[inline(always)]
pub(crate) fn emit_in_place(ev: TraceEvent) {
    let Some(mut entry) = TRACE_EVENTS.reserve::<TraceEvent>(0) else {
        dropped(ev.sessions);
        return;
    };
    entry.write(TraceEvent {
        // SAFETY: plain helper call.
        cpu: unsafe { bpf_get_smp_processor_id() },
        ..ev
    });
    entry.submit(wakeup());
}

/// An event the ring had no room for, counted lost for each of its sessions.
fn dropped(sessions: SessionMask) {
    count_loss(loss::TRACE_RINGBUF_FULL);
    let mut m = sessions;
    for _ in 0..MAX_TRACKED_SESSIONS {
        if m == 0 {
            break;
        }
        let slot = m.trailing_zeros();
        m &= m - 1;
        if let Some(n) = TRACE_DROPS.get_ptr_mut(slot) {
            // SAFETY: this CPU's value of a live map entry.
            unsafe { *n += 1 };
        }
    }
}

/// The reader polls; it is woken once, by the event that makes enough pile up to be worth a
/// wakeup (the pending bytes count this record and its 8-byte header already).
#[inline(always)]
fn wakeup() -> u64 {
    let avail = TRACE_EVENTS.query(BPF_RB_AVAIL_DATA);
    let record = (core::mem::size_of::<TraceEvent>() + 8) as u64;
    if avail >= TRACE_WAKEUP_BYTES && avail < TRACE_WAKEUP_BYTES + record {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    }
}
