//! The counts: calls per function and per caller → callee pair in `PY_CALLS` and
//! `PY_EDGES`, and a function's names sent on `PY_CODES` the first time a session counts it.

use aya_ebpf::{
    helpers::bpf_probe_read_user_str_bytes,
    macros::map,
    maps::{HashMap, RingBuf},
};
use tracer_common::{
    loss, PyCallKey, PyCallStats, PyCodeEvent, PyEdgeKey, PyLayout, PyStackEntry, SessionMask,
    MAX_PY_SESSIONS, PY_CODE_FILENAME_UNREAD, PY_CODE_QUALNAME_UNREAD, PY_EDGES_MAX,
};

use super::{read, BPF_F_NO_PREALLOC};
use crate::shared::count_loss;

#[map]
pub(super) static PY_CALLS: HashMap<PyCallKey, PyCallStats> = HashMap::with_max_entries(262_144, 0);

/// Calls per (session, process, function, calling function): pstats' callers. Allocated
/// on use: most pairs are never seen.
#[map]
static PY_EDGES: HashMap<PyEdgeKey, PyCallStats> =
    HashMap::with_max_entries(PY_EDGES_MAX, BPF_F_NO_PREALLOC);

#[map]
static PY_CODES: RingBuf = RingBuf::with_byte_size(4 * 1024 * 1024, 0);

/// `PyASCIIObject.state` bits: compact (5) and ascii (6), the same from 3.10 to 3.13.
const COMPACT_ASCII: u32 = (1 << 5) | (1 << 6);

/// One call of `e` from its caller ended: pstats' callers entry, counted as lsprof counts
/// its sub-entries (cumtime only when the pair is not active further down).
pub(super) fn add_edge(key: &PyEdgeKey, e: &PyStackEntry, tt: u64, ct: u64) {
    let outer = e.edge_outermost != 0;
    let first = PyCallStats {
        ncalls: 1,
        primitive: u64::from(outer),
        tottime_ns: tt,
        cumtime_ns: if outer { ct } else { 0 },
    };
    for _ in 0..2 {
        if let Some(s) = PY_EDGES.get_ptr_mut(key) {
            bump(s, outer);
            // SAFETY: a live map value.
            unsafe {
                add(&raw mut (*s).tottime_ns, tt);
                if outer {
                    add(&raw mut (*s).cumtime_ns, ct);
                }
            }
            return;
        }
        // BPF_NOEXIST: another CPU may insert the same pair meanwhile; then add to it.
        if PY_EDGES.insert(key, &first, 1).is_ok() {
            return;
        }
    }
    count_loss(loss::PY_EDGES_FULL);
}

/// A call to count: what [`count`] needs of it (BPF functions take at most five arguments).
pub(super) struct Call {
    pub pid: u32,
    pub primitive: bool,
    pub code: u64,
    pub names: u64,
    pub qualname: u64,
    pub filename: u64,
}

/// Counts a call for each of `mask`'s sessions, and names its function on its first call.
/// Out of line: its locals stay out of `enter`'s frame, under which the verifier adds up the
/// frames of an unwinding loop's `pop` (512 bytes per call chain).
#[inline(never)]
pub(super) fn count(mut mask: SessionMask, call: &Call, layout: &PyLayout) {
    let &Call {
        pid,
        primitive,
        code,
        names,
        qualname,
        filename,
    } = call;
    let first = PyCallStats {
        ncalls: 1,
        primitive: u64::from(primitive),
        tottime_ns: 0,
        cumtime_ns: 0,
    };
    // One iteration per session following this process: almost always one.
    for _ in 0..MAX_PY_SESSIONS {
        if mask == 0 {
            return;
        }
        let slot = mask.trailing_zeros();
        mask &= mask - 1;
        let key = PyCallKey {
            slot,
            pid,
            code,
            names,
        };
        if let Some(s) = PY_CALLS.get_ptr_mut(&key) {
            bump(s, primitive);
            continue;
        }
        // BPF_NOEXIST: of two CPUs racing on a first call, one inserts and names it.
        match PY_CALLS.insert(&key, &first, 1) {
            Ok(()) => send_names(&key, qualname, filename, layout),
            Err(_) => match PY_CALLS.get_ptr_mut(&key) {
                Some(s) => bump(s, primitive),
                None => count_loss(loss::PY_CALLS_FULL),
            },
        }
    }
}

fn bump(s: *mut PyCallStats, primitive: bool) {
    // SAFETY: a live map value.
    unsafe {
        add(&raw mut (*s).ncalls, 1);
        if primitive {
            add(&raw mut (*s).primitive, 1);
        }
    }
}

/// Atomic add (BPF_ATOMIC): threads of one process run the same function on several CPUs.
pub(crate) fn add(n: *mut u64, v: u64) {
    // SAFETY: `n` points to a live map value.
    unsafe {
        core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
            n, v,
        )
    };
}

fn send_names(key: &PyCallKey, qualname: u64, filename: u64, layout: &PyLayout) {
    let Some(mut entry) = PY_CODES.reserve::<PyCodeEvent>(0) else {
        count_loss(loss::PY_CODES_RINGBUF_FULL);
        return;
    };
    let ev = entry.as_mut_ptr();
    // SAFETY: `ev` points to the reserved record, which we fill completely before submitting.
    unsafe {
        (*ev).slot = key.slot;
        (*ev).pid = key.pid;
        (*ev).code = key.code;
        (*ev).names = key.names;
        (*ev).firstlineno = read::<i32>(key.code + u64::from(layout.code_firstlineno)).unwrap_or(0);
        let mut flags = 0;
        if !read_str(qualname, layout, &mut (*ev).qualname) {
            flags |= PY_CODE_QUALNAME_UNREAD;
        }
        if !read_str(filename, layout, &mut (*ev).filename) {
            flags |= PY_CODE_FILENAME_UNREAD;
        }
        (*ev).flags = flags;
    }
    entry.submit(0);
}

/// Reads the `str` object `obj` into `out`, if it is compact ASCII (nearly every identifier
/// and path is); otherwise user space reads it.
fn read_str(obj: u64, layout: &PyLayout, out: &mut [u8]) -> bool {
    out[0] = 0;
    let Ok(state) = read::<u32>(obj + u64::from(layout.unicode_state)) else {
        return false;
    };
    if state & COMPACT_ASCII != COMPACT_ASCII {
        return false;
    }
    let data = (obj + u64::from(layout.unicode_ascii_data)) as *const u8;
    // SAFETY: reads at most out.len() bytes of user memory, stopping at the string's NUL.
    unsafe { bpf_probe_read_user_str_bytes(data, out) }.is_ok()
}
