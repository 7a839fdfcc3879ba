//! Each thread's shadow stack of active Python frames: a frame pushed when it starts, popped
//! when it returns (its own and cumulative time added then), and frames left unseen (by an
//! exception, or by a thread's end) popped with their exits inferred. Scans run under
//! `bpf_loop`, so the verifier checks one step rather than the whole stack.

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_loop},
    macros::map,
    maps::{HashMap, PerCpuArray},
};
use core::ffi::c_void;
use tracer_common::{
    loss, py_names_id, trace_kind, PyCallKey, PyEdgeKey, PyLayout, PyStack, PyStackEntry,
    SessionMask, TraceEvent, MAX_PY_SESSIONS, PY_FRAME_OWNER_NOT_PYTHON, PY_STACK_DEPTH,
    PY_THREADS_MAX, PY_UNWIND_PER_EVENT, TRACE_EXIT_INFERRED,
};

use super::{
    count::{add, add_edge, count, Call, PY_CALLS},
    read, sessions, BPF_F_NO_PREALLOC, PY_TSTATE,
};
use crate::{shared::count_loss, trace};

/// Thread id → its shadow stack of active Python frames, for tottime and cumtime. Not
/// preallocated (a stack is 14 KiB): created at a thread's first call, removed at its exit.
#[map]
pub(super) static PY_STACKS: HashMap<u32, PyStack> =
    HashMap::with_max_entries(PY_THREADS_MAX, BPF_F_NO_PREALLOC);

/// A zeroed stack to start a thread's from (too big for the BPF stack).
#[map]
static PY_EMPTY_STACK: PerCpuArray<PyStack> = PerCpuArray::with_max_entries(1, 0);

/// The thread's stack, created empty on first use.
fn stack(tid: u32) -> Option<*mut PyStack> {
    if let Some(s) = PY_STACKS.get_ptr_mut(&tid) {
        return Some(s);
    }
    let empty = PY_EMPTY_STACK.get_ptr(0)?;
    // SAFETY: a per-CPU map value, never written: all zeroes.
    if PY_STACKS.insert(&tid, unsafe { &*empty }, 1).is_err() {
        count_loss(loss::PY_THREADS_FULL);
        return None;
    }
    PY_STACKS.get_ptr_mut(&tid)
}

/// A thread exits, in the process-exit program's variant without the unwinding loop: its
/// stack and thread state go with it, any frames left on it counted lost.
pub(crate) fn drop_thread(tid: u32) {
    // SAFETY: map values are valid for the duration of the program.
    if unsafe { PY_STACKS.get(&tid) }.is_some_and(|st| st.depth != 0) {
        count_loss(loss::PY_THREAD_EXIT_UNWOUND);
    }
    let _ = PY_STACKS.remove(&tid);
    let _ = PY_TSTATE.remove(&tid);
}

/// A thread exits: its stack and thread state go with it.
pub(crate) fn forget_thread(tid: u32) {
    // Frames still on its stack end with it, their exits inferred as for frames left by
    // exceptions (a thread ended mid-call, or frames whose exit no probe saw): counted and
    // traced rather than dropped.
    if let Some(st) = PY_STACKS.get_ptr_mut(&tid) {
        let who = bpf_get_current_pid_tgid();
        let mask = sessions((who >> 32) as u32);
        if mask != 0 {
            // SAFETY: this thread's map value; the thread is exiting, so no probe of it runs.
            let st = unsafe { &mut *st };
            let mut u = Unwind {
                st,
                mask,
                who,
                now: unsafe { bpf_ktime_get_ns() },
                depth: 0,
            };
            // SAFETY: as in `pop_inferred_to`.
            unsafe {
                bpf_loop(
                    PY_STACK_DEPTH as u32,
                    unwind_step as *mut c_void,
                    (&raw mut u).cast(),
                    0,
                );
            }
        }
    }
    let _ = PY_STACKS.remove(&tid);
    let _ = PY_TSTATE.remove(&tid);
}

/// `enter`'s caller when `frame` links to its caller itself (no frame is at this address).
pub(super) const LINKED: u64 = u64::MAX;

/// A frame starts or resumes: count the call, push it on the thread's stack.
/// `caller`: the calling frame where `frame`'s own link to it cannot be read yet, else
/// [`LINKED`]. Out of line: its locals would otherwise be part of the programs' own frames,
/// under which the verifier adds up `leave`'s and `pop`'s (512 bytes per call chain).
#[inline(never)]
pub(super) fn enter(
    mask: SessionMask,
    who: u64,
    frame: u64,
    layout: &PyLayout,
    caller: u64,
) -> Result<(), ()> {
    let (pid, tid) = ((who >> 32) as u32, who as u32);
    let code = layout.code_of(read(frame + u64::from(layout.frame_code))?);
    let qualname: u64 = read(code + u64::from(layout.code_qualname))?;
    let filename: u64 = read(code + u64::from(layout.code_filename))?;
    let names = py_names_id(qualname, filename);
    let now = unsafe { bpf_ktime_get_ns() };
    let mut primitive = true;
    if let Some(st) = stack(tid) {
        // SAFETY: `st` points to this thread's map value; only this thread's probes write it.
        let st = unsafe { &mut *st };
        // Frames above the caller were left by an exception (or, on 3.10, past the kernel's
        // uretprobe nesting limit): no probe saw them go.
        match caller {
            LINKED => reconcile(st, mask, who, frame, layout, now),
            0 => pop_inferred_to(st, mask, who, now, 0),
            c => {
                unwind_to(st, mask, who, c, now);
            }
        }
        let (below, pair_below) = on_stack(st, code, names);
        primitive = !below;
        let depth = st.depth as usize;
        match st.entries.get_mut(depth) {
            Some(e) => {
                *e = PyStackEntry {
                    frame,
                    code,
                    names,
                    start_ns: now,
                    sub_ns: 0,
                    outermost: u64::from(primitive),
                    edge_outermost: u64::from(!pair_below),
                    pseudo: 0,
                }
            }
            None => count_loss(loss::PY_STACK_TOO_DEEP),
        }
        st.depth += 1;
    }
    let call = Call {
        pid,
        primitive,
        code,
        names,
        qualname,
        filename,
    };
    count(mask, &call, layout);
    Ok(())
}

/// Makes the stack end with the new frame's caller before it is pushed: frames above it
/// were left unseen.
#[inline(always)]
fn reconcile(
    st: &mut PyStack,
    mask: SessionMask,
    who: u64,
    frame: u64,
    layout: &PyLayout,
    now: u64,
) {
    let prev = u64::from(layout.frame_previous);
    let Ok(previous) = read::<u64>(frame + prev) else {
        return;
    };
    if previous == 0 {
        // The thread's bottom frame: whatever is on the stack is stale.
        pop_inferred_to(st, mask, who, now, 0);
        return;
    }
    if unwind_to(st, mask, who, previous, now) {
        return;
    }
    // 3.12+: `previous` is a frame no probe entered: the eval loop's entry frame (on the C
    // stack) for a frame called from C, or 3.13's cleanup frame under `__init__`. The Python
    // caller is its previous.
    let Ok(caller) = read::<u64>(previous + prev) else {
        return;
    };
    if caller == 0 {
        pop_inferred_to(st, mask, who, now, 0);
        return;
    }
    if !unwind_to(st, mask, who, caller, now) || layout.frame_owner == 0 {
        return;
    }
    // An interpreter frame (not the C stack's) returns through the exit probes: stand in
    // for it, so that its return is not taken for its caller's.
    if read::<u8>(previous + u64::from(layout.frame_owner)).unwrap_or(PY_FRAME_OWNER_NOT_PYTHON)
        >= PY_FRAME_OWNER_NOT_PYTHON
    {
        return;
    }
    let depth = st.depth as usize;
    let Some(top) = depth
        .checked_sub(1)
        .and_then(|d| st.entries.get(opaque(d)))
        .copied()
    else {
        return;
    };
    if let Some(e) = st.entries.get_mut(opaque(depth)) {
        *e = PyStackEntry {
            frame: previous,
            start_ns: now,
            sub_ns: 0,
            pseudo: 1,
            ..top
        };
        st.depth += 1;
    }
}

/// Pops frames above `previous` (when it is on the stack), their exit time inferred as now.
/// Returns whether `previous` was on the stack.
fn unwind_to(st: &mut PyStack, mask: SessionMask, who: u64, previous: u64, now: u64) -> bool {
    let Some(target) = find(st, previous) else {
        return false;
    };
    pop_inferred_to(st, mask, who, now, target + 1);
    true
}

/// Pops frames left unseen (by an exception, or past 3.10's uretprobe nesting limit) until
/// `depth` remain, at most `PY_UNWIND_PER_EVENT` of them; the rest go at later events.
pub(super) fn pop_inferred_to(st: &mut PyStack, mask: SessionMask, who: u64, now: u64, depth: u64) {
    let mut u = Unwind {
        st,
        mask,
        who,
        now,
        depth,
    };
    // SAFETY: the callback only touches the stack through `u`, which outlives the call.
    unsafe {
        bpf_loop(
            PY_UNWIND_PER_EVENT as u32,
            unwind_step as *mut c_void,
            (&raw mut u).cast(),
            0,
        );
    }
}

/// `pop_inferred_to` run by `bpf_loop`: `pop` is verified once, not once per unrolled step.
#[repr(C)]
struct Unwind {
    st: *mut PyStack,
    mask: SessionMask,
    /// pid << 32 | tid.
    who: u64,
    now: u64,
    depth: u64,
}

#[inline(never)]
extern "C" fn unwind_step(_: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the `Unwind` that `pop_inferred_to` passed; `st` a live map value.
    let u = unsafe { &mut *ctx.cast::<Unwind>() };
    let st = unsafe { &mut *u.st };
    if st.depth <= u.depth {
        return 1;
    }
    pop(st, u.mask, u.who, u.now, TRACE_EXIT_INFERRED);
    count_loss(loss::PY_EXIT_INFERRED);
    0
}

/// A stack scan run by `bpf_loop`, so the verifier checks one iteration instead of
/// `PY_STACK_DEPTH` unrolled ones (loading would take minutes).
#[repr(C)]
struct Scan {
    st: *const PyStack,
    top: u64,
    frame: u64,
    code: u64,
    names: u64,
    /// The would-be caller (the top entry), for `scan_code`'s pair search.
    caller_code: u64,
    caller_names: u64,
    found: u64,
    pair_found: u64,
}

const NOT_FOUND: u64 = u64::MAX;

impl Scan {
    fn new(st: &PyStack) -> Self {
        let top = st.depth.min(PY_STACK_DEPTH as u64);
        Self {
            st,
            top,
            frame: 0,
            code: 0,
            names: 0,
            caller_code: 0,
            caller_names: 0,
            found: NOT_FOUND,
            pair_found: 0,
        }
    }

    fn run(&mut self, step: extern "C" fn(u64, *mut c_void) -> i64) -> u64 {
        // SAFETY: `step` only reads the stack through `self`, which outlives the call.
        unsafe {
            bpf_loop(
                self.top as u32,
                step as *mut c_void,
                (self as *mut Self).cast(),
                0,
            )
        };
        self.found
    }
}

/// Topmost first: the entry of `Scan::frame`.
#[inline(never)]
extern "C" fn scan_frame(k: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the `Scan` that `Scan::run` passed.
    let s = unsafe { &mut *ctx.cast::<Scan>() };
    let i = s.top.wrapping_sub(k + 1);
    // SAFETY: a map value that stays live for the program's run.
    match unsafe { &*s.st }.entries.get(opaque(i as usize)) {
        Some(e) if e.frame == s.frame => {
            s.found = i;
            1
        }
        Some(_) => 0,
        None => 1,
    }
}

/// Any entry of `Scan::code` (the same function further down: a recursive call), and any
/// of it called by `Scan::caller_code` (the same pair further down).
#[inline(never)]
extern "C" fn scan_code(i: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: as in `scan_frame`.
    let s = unsafe { &mut *ctx.cast::<Scan>() };
    let st = unsafe { &*s.st };
    let Some(e) = st.entries.get(opaque(i as usize)) else {
        return 1;
    };
    if e.code != s.code || e.names != s.names || e.pseudo != 0 {
        return 0;
    }
    s.found = i;
    let caller = i
        .checked_sub(1)
        .and_then(|c| st.entries.get(opaque(c as usize)));
    if caller.is_some_and(|c| c.code == s.caller_code && c.names == s.caller_names) {
        s.pair_found = 1;
        return 1;
    }
    0
}

/// Index of `frame` on the stack, topmost first. Out of line, as `on_stack`: the scan's
/// state stays out of the frames of `enter` and `leave`, which are on the deepest chains.
#[inline(never)]
fn find(st: &PyStack, frame: u64) -> Option<u64> {
    let mut s = Scan::new(st);
    s.frame = frame;
    match s.run(scan_frame) {
        NOT_FOUND => None,
        i => Some(i),
    }
}

/// Whether an activation of the function is on the stack already, and whether one called
/// by the function on top (its caller now) is.
#[inline(never)]
fn on_stack(st: &PyStack, code: u64, names: u64) -> (bool, bool) {
    let mut s = Scan::new(st);
    s.code = code;
    s.names = names;
    if let Some(top) = s
        .top
        .checked_sub(1)
        .and_then(|t| st.entries.get(opaque(t as usize)))
    {
        s.caller_code = top.code;
        s.caller_names = top.names;
    }
    let found = s.run(scan_code) != NOT_FOUND;
    (found, s.pair_found != 0)
}

/// A frame returns or yields. `frame` 0: the top one (3.10, where exits come in order).
///
/// Otherwise `frame` is the thread's current frame as the exit probe reads it: the leaving
/// frame itself, or, where the handler has already switched to the caller before the
/// probed instruction (3.12's YIELD_VALUE does), the caller. Frames above the leaving one
/// were left by an exception since the last event: their exits are inferred.
pub(super) fn leave(mask: SessionMask, who: u64, frame: u64, layout: &PyLayout) {
    let Some(st) = PY_STACKS.get_ptr_mut(&(who as u32)) else {
        return;
    };
    // SAFETY: as in `enter`.
    let st = unsafe { &mut *st };
    if st.depth == 0 {
        return;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    if frame != 0 && st.depth <= PY_STACK_DEPTH as u64 {
        let top = st
            .entries
            .get(opaque(st.depth as usize - 1))
            .map_or(0, |e| e.frame);
        if top != frame {
            let Some(i) = find(st, frame) else {
                // Not on the stack, and called by the top one: a frame no probe entered
                // returns (3.13's cleanup shim after `__init__`): none of ours leaves.
                let previous: u64 = read(frame + u64::from(layout.frame_previous)).unwrap_or(0);
                if previous == top {
                    return;
                }
                // Otherwise it is the eval loop's entry shim (3.12+ generators yielding to
                // C): the leaving frame is the top one.
                pop(st, mask, who, now, 0);
                return;
            };
            // `frame` is the caller: the leaving frame is the one above it.
            pop_inferred_to(st, mask, who, now, i + 2);
            if st.depth > i + 2 {
                // More left by exceptions than one hit unwinds: the rest go at later hits.
                return;
            }
        }
    }
    pop(st, mask, who, now, 0);
}

/// Pops the top frame at `now`: its own time and, for an outermost activation, its
/// cumulative time; a tracing session gets the call as one event. `flags`: `TraceEvent::flags`.
pub(super) fn pop(st: &mut PyStack, mask: SessionMask, who: u64, now: u64, flags: u16) {
    if st.depth == 0 {
        return;
    }
    let pid = (who >> 32) as u32;
    st.depth -= 1;
    // Read in place, not copied: this function's frame is at the bottom of the deepest call
    // chains (an unwinding loop's callback, `leave`), which the verifier allows 512 bytes.
    // `opaque`: compiled as is, the bound was checked on the depth before the decrement and
    // the entry indexed by the one after; verifiers before 6.13 do not carry a bound across
    // that subtraction and refused every Python program ("math between map_value pointer
    // and register with unbounded min value", Linux 6.1 and 6.12).
    let Some(e) = st
        .entries
        .get(opaque(st.depth as usize))
        .map(|e| e as *const PyStackEntry)
    else {
        return;
    };
    // SAFETY: an entry of this thread's stack, a live map value that only its own probes
    // write; the entries below it are the only ones written while it is read.
    let e = unsafe { &*e };
    let ct = now.saturating_sub(e.start_ns);
    let mut caller = None;
    if let Some(parent) = st
        .depth
        .checked_sub(1)
        .and_then(|d| st.entries.get_mut(opaque(d as usize)))
    {
        parent.sub_ns += ct;
        caller = Some(&*parent);
    }
    if e.pseudo != 0 {
        return;
    }
    let traced = trace::tracing(mask);
    if traced != 0 {
        trace_return(e, traced, who, now, flags);
    }
    count_return(e, caller, mask, pid, now);
}

/// A popped frame's call as one tracing event. Out of line, as `count_return`: the event
/// and the counts' keys are on the BPF stack one after the other, not together in `pop`'s
/// frame, which is at the bottom of the deepest call chains (512 bytes each).
#[inline(never)]
fn trace_return(e: &PyStackEntry, traced: SessionMask, who: u64, now: u64, flags: u16) {
    trace::emit_in_place(TraceEvent {
        kind: trace_kind::PY_CALL,
        flags,
        cpu: 0,
        pid: (who >> 32) as u32,
        tid: who as u32,
        sessions: traced,
        start_ns: e.start_ns,
        end_ns: now,
        a: e.code,
        b: e.names,
    });
}

/// A popped frame's times added to its function's counts and its caller → callee pair's,
/// for each of `mask`'s sessions. `caller`: the calling frame's entry, below it.
#[inline(never)]
fn count_return(
    e: &PyStackEntry,
    caller: Option<&PyStackEntry>,
    mask: SessionMask,
    pid: u32,
    now: u64,
) {
    // Computed again rather than taken from `pop`: `pop` would then keep it across
    // `trace_return`, and its frame, on the deepest chains, grows by 16 bytes.
    let ct = now.saturating_sub(e.start_ns);
    let tt = ct.saturating_sub(e.sub_ns);
    // One key for both maps, its slot changed per session: `PY_CALLS`' key is its prefix.
    let mut key = PyEdgeKey {
        call: PyCallKey {
            slot: 0,
            pid,
            code: e.code,
            names: e.names,
        },
        caller_code: caller.map_or(0, |c| c.code),
        caller_names: caller.map_or(0, |c| c.names),
    };
    let mut m = mask;
    for _ in 0..MAX_PY_SESSIONS {
        if m == 0 {
            break;
        }
        key.call.slot = m.trailing_zeros();
        m &= m - 1;
        if let Some(s) = PY_CALLS.get_ptr_mut(&key.call) {
            // SAFETY: a live map value.
            unsafe {
                add(&raw mut (*s).tottime_ns, tt);
                if e.outermost != 0 {
                    add(&raw mut (*s).cumtime_ns, ct);
                }
            }
        }
        if caller.is_some() {
            add_edge(&key, e, tt, ct);
        }
    }
}

/// Hides an index from the optimiser so that the bounds check on it stays in the code: the
/// verifier needs to see it, and LLVM would otherwise fold it into the loop condition.
#[inline(always)]
fn opaque(i: usize) -> usize {
    core::hint::black_box(i)
}
