//! Launches counted in-process by tracer's CUDA injection library (`--cuda-in-process`,
//! `tracer_common::launches`): the sessions that count a process so, whose launch probes skip
//! it, and the library's two probe points — a launch from a thread without Python, counted
//! here with the call site of the thread it works for, and a new row of its table, announced.

use aya_ebpf::{macros::map, maps::HashMap, programs::ProbeContext};
use tracer_common::{cuda_api as api, trace_kind, CudaLaunchKey, SessionMask};

use super::{announce_row, call_site, count_launch, send, trace, user};

/// pid → the sessions (slot bits) that count its kernel launches in-process, through tracer's
/// injection library (`tracer_common::launches`): their launch probes skip it, and its
/// library's `tracer_cupti_launch_elsewhere` counts for them alone.
#[map]
static CUDA_INPROC: HashMap<u32, SessionMask> = HashMap::with_max_entries(4_096, 0);

/// Whether session `slot` counts `pid`'s launches in-process.
pub(super) fn in_process(pid: u32, slot: u32) -> bool {
    // SAFETY: map values are valid for the duration of the program.
    unsafe { CUDA_INPROC.get(&pid) }.is_some_and(|m| m & (1 << (slot & 63)) != 0)
}

/// A new row in the injection library's launch table: announced as `count_launch` announces
/// the probes' new rows, with CUPTI's name for its handle.
pub(super) fn new_row(ctx: &ProbeContext, slot: u32, pid: u32, key: u64) -> Option<()> {
    if !in_process(pid, slot) {
        return None;
    }
    let mut k: CudaLaunchKey = user(key)?;
    (k.slot, k.pid) = (slot, pid);
    // SAFETY: `regs` is this program's context.
    let name = unsafe { (*ctx.regs).rsi };
    announce_row(&k);
    send(pid, api::CUPTI_ROW, k.func, name, 0, 0);
    Some(())
}

/// A launch the injection library counted in-process but could not give a call site (its
/// thread runs no Python): counted here with the site of the thread it works for, for the
/// sessions that count the process in-process (the others' launch probes saw it); for a
/// tracing session, its event, as the launch probes make it (the library's ring has only
/// the launches it counted itself).
pub(super) fn launch_elsewhere(ctx: &ProbeContext, slot: u32, pid: u32, key: u64) -> Option<()> {
    if !in_process(pid, slot) {
        return None;
    }
    let mut k: CudaLaunchKey = user(key)?;
    (k.slot, k.pid) = (slot, pid);
    // The library's own record of the last launch from Python stands for the probes'.
    // SAFETY: `regs` is this program's context.
    let (last, id) = unsafe { ((*ctx.regs).rsi, (*ctx.regs).rdx) };
    if last != 0 {
        crate::sample::set_last_launcher(pid, last, id);
    }
    if let Some((code, instr, names, from)) = call_site::<1>(pid) {
        (k.py_code, k.py_instr, k.py_names) = (code, instr, names);
        k.py_elsewhere = from;
    }
    count_launch::<1>(&k);
    trace(slot, pid, trace_kind::CUDA_LAUNCH, k.api, k.func, k.row_id());
    Some(())
}

