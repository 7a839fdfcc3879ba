//! What every program shares: which sessions follow which process, and the loss counters.

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user},
    macros::map,
    maps::{HashMap, PerCpuArray, PerCpuHashMap},
};
use tracer_common::{loss, LossKey, SessionMask, TRACKED_MAX_ENTRIES};

/// Process id → sessions following it.
#[map]
pub(crate) static TRACKED: HashMap<u32, SessionMask> =
    HashMap::with_max_entries(TRACKED_MAX_ENTRIES, 0);

/// Per-CPU loss counters, indexed by `tracer_common::loss::*`.
#[map]
pub(crate) static LOSSES: PerCpuArray<u64> = PerCpuArray::with_max_entries(loss::COUNT, 0);

/// The same, by the sessions following the process the loss happened in: what a session of
/// a user other than root reports (the machine's counters would tell it of other users'
/// work). Few keys: a cause and a set of sessions.
#[map]
static SLOT_LOSSES: PerCpuHashMap<LossKey, u64> = PerCpuHashMap::with_max_entries(4096, 0);

/// A `T` at user address `addr`, if it can be read.
pub(crate) fn read<T>(addr: u64) -> Option<T> {
    // SAFETY: bpf_probe_read_user copes with any address; a bad one is an error, not a fault.
    unsafe { bpf_probe_read_user(addr as *const T) }.ok()
}

pub(crate) fn global(v: &u32) -> u32 {
    // SAFETY: reading a plain static; volatile so the loader's patched value is used, not the default.
    unsafe { core::ptr::read_volatile(v) }
}

pub(crate) fn count_loss(cause: u32) {
    count_losses(cause, 1);
}

pub(crate) fn count_losses(cause: u32, n: u64) {
    if let Some(slot) = LOSSES.get_ptr_mut(cause) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU while the program runs.
        unsafe { *slot += n };
    }
    let pid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // SAFETY: map values are valid for the duration of the program.
    let Some(&mask) = (unsafe { TRACKED.get(&pid) }) else {
        return;
    };
    let key = LossKey {
        mask,
        cause,
        _pad: 0,
    };
    match SLOT_LOSSES.get_ptr_mut(&key) {
        // SAFETY: as above.
        Some(c) => unsafe { *c += n },
        // Full: the machine's counter above has it; the session's report falls short.
        None => {
            let _ = SLOT_LOSSES.insert(&key, &n, 0);
        }
    }
}
