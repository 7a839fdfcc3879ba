//! Counting Python calls. Uprobes on each interpreter's eval loop find the code object being
//! entered and count it per (session, process, code object) in `PY_CALLS`. The first time a
//! session sees a code object, its names go to user space on `PY_CODES`.
//!
//! The attach cookie of every probe is the index of the interpreter's `PyLayout`.

use aya_ebpf::{
    helpers::{
        bpf_get_attach_cookie, bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_loop,
        bpf_probe_read_user, bpf_probe_read_user_str_bytes,
    },
    macros::{map, uprobe, uretprobe},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::{ProbeContext, RetProbeContext},
    EbpfContext,
};
use tracer_common::{
    loss, py_kind, py_names_id, py_role, trace_kind, PyCallKey, PyCallStats, PyCodeEvent,
    PyEdgeKey, PyLayout, PyStack, PyStackEntry, SessionMask, TraceEvent, MAX_PY_SESSIONS,
    PY_CODE_FILENAME_UNREAD, PY_CODE_QUALNAME_UNREAD, PY_CO_GENERATOR_LIKE, PY_EDGES_MAX,
    PY_EVAL_EVENTS_MASK, PY_FRAME_OWNED_BY_THREAD, PY_FRAME_OWNER_NOT_PYTHON, PY_LAYOUTS_MAX,
    PY_STACK_DEPTH, PY_THREADS_MAX, PY_UNWIND_PER_EVENT, TRACE_EXIT_INFERRED,
};

const BPF_F_NO_PREALLOC: u32 = 1;

use core::ffi::c_void;

use crate::{
    shared::{count_loss, TRACKED},
    trace,
};

#[map]
static PY_LAYOUTS: Array<PyLayout> = Array::with_max_entries(PY_LAYOUTS_MAX, 0);

/// Thread id → its `PyThreadState *`, recorded when the thread enters the eval loop (or seeded
/// by the daemon for threads already inside it).
#[map]
static PY_TSTATE: LruHashMap<u32, u64> = LruHashMap::with_max_entries(65_536, 0);

#[map]
static PY_CALLS: HashMap<PyCallKey, PyCallStats> = HashMap::with_max_entries(262_144, 0);

/// Thread id → its shadow stack of active Python frames, for tottime and cumtime. Not
/// preallocated (a stack is 14 KiB): created at a thread's first call, removed at its exit.
#[map]
static PY_STACKS: HashMap<u32, PyStack> =
    HashMap::with_max_entries(PY_THREADS_MAX, BPF_F_NO_PREALLOC);

/// A zeroed stack to start a thread's from (too big for the BPF stack).
#[map]
static PY_EMPTY_STACK: PerCpuArray<PyStack> = PerCpuArray::with_max_entries(1, 0);

/// Calls per (session, process, function, calling function): pstats' callers. Allocated
/// on use: most pairs are never seen.
#[map]
static PY_EDGES: HashMap<PyEdgeKey, PyCallStats> =
    HashMap::with_max_entries(PY_EDGES_MAX, BPF_F_NO_PREALLOC);

#[map]
static PY_CODES: RingBuf = RingBuf::with_byte_size(4 * 1024 * 1024, 0);

/// One entry: [sessions counting Python calls, those of them that count every process,
/// those with processes counted in-process (`PY_INPROC`)].
#[map]
static PY_SESSIONS: Array<[SessionMask; 3]> = Array::with_max_entries(1, 0);

/// Processes counted in-process (CPython 3.14+, `libtracer_pycount.so`) → the sessions that
/// count them that way: those sessions' probes skip them. Copied to forked children (the
/// counter goes on in the child); dropped at exec (the new program has no counter).
#[map]
static PY_INPROC: HashMap<u32, SessionMask> = HashMap::with_max_entries(4096, 0);

/// `PyASCIIObject.state` bits: compact (5) and ascii (6), the same from 3.10 to 3.13.
const COMPACT_ASCII: u32 = (1 << 5) | (1 << 6);

/// The sessions that count this process's calls, if any.
fn sessions(pid: u32) -> SessionMask {
    let [python, all, inproc_slots] = PY_SESSIONS.get(0).copied().unwrap_or([0, 0, 0]);
    if python == 0 {
        return 0;
    }
    // SAFETY: map values are valid for the duration of the program.
    let followed = unsafe { TRACKED.get(&pid) }.copied().unwrap_or(0);
    let counting = (followed | all) & python & ((1 << MAX_PY_SESSIONS) - 1);
    if counting & inproc_slots == 0 {
        // No lookup on the hot path while nobody counts in-process.
        return counting;
    }
    // SAFETY: as above.
    let inproc = unsafe { PY_INPROC.get(&pid) }.copied().unwrap_or(0);
    counting & !inproc
}

/// A process forked: a child of a process counted in-process is counted so too.
pub(crate) fn inproc_forked(parent: u32, child: u32) {
    // SAFETY: map values are valid for the duration of the program.
    if let Some(&mask) = unsafe { PY_INPROC.get(&parent) } {
        if PY_INPROC.insert(&child, &mask, 0).is_err() {
            count_loss(loss::PY_INPROC_FULL);
        }
    }
}

/// A process exec'd or exited: whatever counted it in-process is gone.
pub(crate) fn inproc_forget(pid: u32) {
    let _ = PY_INPROC.remove(&pid);
}

/// The probe's interpreter layout and role, from its attach cookie.
fn cookie<C: EbpfContext>(ctx: &C) -> Option<(&'static PyLayout, u64)> {
    // SAFETY: plain helper call on this program's context.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    Some((
        PY_LAYOUTS.get((cookie & 0xff) as u32)?,
        cookie >> py_role::SHIFT,
    ))
}

fn read<T>(addr: u64) -> Result<T, ()> {
    // SAFETY: bpf_probe_read_user copes with any address; a bad one is an error, not a fault.
    unsafe { bpf_probe_read_user(addr as *const T) }.map_err(|_| count_loss(loss::PY_READ_FAILED))
}

/// `_PyEval_EvalFrameDefault` entry. 3.10: a frame starts. 3.11+: remembers the thread's
/// state for the opcode probes, and catches frames resumed by a thrown exception.
#[uprobe]
pub fn tracer_py_eval_entry(ctx: ProbeContext) -> u32 {
    let _ = try_eval_entry(&ctx);
    0
}

fn try_eval_entry(ctx: &ProbeContext) -> Result<(), ()> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let pid = (pid_tgid >> 32) as u32;
    let Some((layout, _)) = cookie(ctx) else {
        return Ok(());
    };
    let tstate: u64 = ctx.arg(0).ok_or(())?;
    // Recorded for every process: cheap, and a session that starts later finds it.
    let _ = PY_TSTATE.insert(&(pid_tgid as u32), &tstate, 0);
    if layout.kind != py_kind::EVAL_ARG_FRAME {
        // An exception thrown into a suspended generator or coroutine (throw(), close())
        // resumes its frame without passing RESUME; profilers count that as a call too.
        let throwflag: u64 = ctx.arg(2).ok_or(())?;
        if throwflag as u32 == 0 {
            return Ok(());
        }
    }
    let mask = sessions(pid);
    if mask == 0 {
        return Ok(());
    }
    let frame: u64 = ctx.arg(1).ok_or(())?;
    // 3.11+ (a throw): the frame's `previous` is only linked inside the eval loop, so the
    // caller is the frame current now.
    let caller = match layout.kind {
        py_kind::EVAL_ARG_FRAME => None,
        _ => Some(current_frame(tstate, layout)?),
    };
    enter(mask, pid_tgid, frame, layout, caller)
}

/// 3.10: `_PyEval_EvalFrameDefault` returns, by `return`, `yield` or exception. The thread
/// state's frame is the caller's again, so frames above the caller are left. (The kernel
/// runs at most 64 nested uretprobes per thread: deeper frames return unseen, and are
/// popped here or at the next entry, their exits inferred.)
#[uretprobe]
pub fn tracer_py_eval_return(ctx: RetProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let (pid, tid) = ((pid_tgid >> 32) as u32, pid_tgid as u32);
    let mask = sessions(pid);
    if mask == 0 {
        return 0;
    }
    // SAFETY: map values are valid for the duration of the program.
    let tstate = unsafe { PY_TSTATE.get(&tid) }.copied();
    let Some((layout, _)) = cookie(&ctx) else {
        return 0;
    };
    let caller =
        tstate.and_then(|ts| read::<u64>(ts + u64::from(layout.tstate_current_frame)).ok());
    match caller {
        // The thread's bottom frame returned: everything above it went unseen.
        Some(0) => {
            if let Some(st) = PY_STACKS.get_ptr_mut(&tid) {
                // SAFETY: this thread's map value; only its own probes write it.
                let st = unsafe { &mut *st };
                let now = unsafe { bpf_ktime_get_ns() };
                pop_inferred_to(st, mask, pid_tgid, now, 1);
                pop(st, mask, pid_tgid, now, TRACE_EXIT_INFERRED);
            }
        }
        Some(caller) => leave(mask, pid_tgid, caller, layout),
        // Thread state unknown: frames leave in order.
        None => leave(mask, pid_tgid, 0, layout),
    }
    0
}

/// An opcode handler of the eval loop (3.11+): RESUME and friends (a frame starts or
/// resumes: what cProfile counts as a call), or a return or yield (the frame is left).
#[uprobe]
pub fn tracer_py_opcode(ctx: ProbeContext) -> u32 {
    let _ = try_opcode(&ctx);
    0
}

fn try_opcode(ctx: &ProbeContext) -> Result<(), ()> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let pid = (pid_tgid >> 32) as u32;
    let mask = sessions(pid);
    if mask == 0 {
        return Ok(());
    }
    let (layout, role) = cookie(ctx).ok_or(())?;
    // SAFETY: map values are valid for the duration of the program.
    let Some(&tstate) = (unsafe { PY_TSTATE.get(&(pid_tgid as u32)) }) else {
        count_loss(loss::PY_NO_THREAD_STATE);
        return Ok(());
    };
    let frame = current_frame(tstate, layout)?;
    if role == py_role::EXIT {
        leave(mask, pid_tgid, frame, layout);
        return Ok(());
    }
    if layout.code_flags != 0 && creating_generator(frame, layout) {
        return Ok(());
    }
    if layout.code_instr_version != 0 && runs_again(tstate, frame, layout) {
        return Ok(());
    }
    enter(mask, pid_tgid, frame, layout, None)
}

/// 3.12+: this RESUME finds its code object's instrumentation stale (a profiler, tracer or
/// sys.monitoring tool came or went since it last ran), so it instruments the code and runs
/// again: only the second run is the call.
#[inline(always)]
fn runs_again(tstate: u64, frame: u64, layout: &PyLayout) -> bool {
    if layout.tstate_tracing != 0
        && read::<i32>(tstate + u64::from(layout.tstate_tracing)).is_ok_and(|t| t != 0)
    {
        return false;
    }
    let Ok(executable) = read::<u64>(frame + u64::from(layout.frame_code)) else {
        return false;
    };
    let code = layout.code_of(executable);
    let Ok(code_version) = read::<u64>(code + u64::from(layout.code_instr_version)) else {
        return false;
    };
    let global = if layout.interp_monitoring_version != 0 {
        let Ok(interp) = read::<u64>(tstate + u64::from(layout.tstate_interp)) else {
            return false;
        };
        read::<u64>(interp + u64::from(layout.interp_monitoring_version))
    } else {
        read::<u64>(tstate + u64::from(layout.tstate_eval_breaker))
            .map(|b| b & !PY_EVAL_EVENTS_MASK)
    };
    global.is_ok_and(|g| g != code_version)
}

/// A generator's code running before RETURN_GENERATOR has made its frame the generator's
/// (3.15's generator expressions): profilers count no call for it.
#[inline(always)]
fn creating_generator(frame: u64, layout: &PyLayout) -> bool {
    let Ok(executable) = read::<u64>(frame + u64::from(layout.frame_code)) else {
        return false;
    };
    let Ok(flags) = read::<u32>(layout.code_of(executable) + u64::from(layout.code_flags)) else {
        return false;
    };
    flags & PY_CO_GENERATOR_LIKE != 0
        && read::<u8>(frame + u64::from(layout.frame_owner))
            .is_ok_and(|o| o == PY_FRAME_OWNED_BY_THREAD)
}

/// Layout `index` of `PY_LAYOUTS` (for the sampler).
pub(crate) fn layout(index: u32) -> Option<&'static PyLayout> {
    PY_LAYOUTS.get(index)
}

/// The thread's current frame, without counting a failed read as a loss (the sampler
/// reports its own failures). 3.10: `tstate->frame`.
pub(crate) fn current_frame_quiet(tstate: u64, layout: &PyLayout) -> Result<u64, ()> {
    // SAFETY: as in `read`.
    frame_of(tstate, layout, |a| {
        unsafe { bpf_probe_read_user(a as *const u64) }.map_err(|_| ())
    })
}

/// The thread's current interpreter frame (3.11+).
fn current_frame(tstate: u64, layout: &PyLayout) -> Result<u64, ()> {
    frame_of(tstate, layout, read)
}

#[inline(always)]
fn frame_of(
    tstate: u64,
    layout: &PyLayout,
    read: impl Fn(u64) -> Result<u64, ()>,
) -> Result<u64, ()> {
    if layout.kind == py_kind::CFRAME {
        let cframe = read(tstate + u64::from(layout.tstate_cframe))?;
        read(cframe + u64::from(layout.cframe_current_frame))
    } else {
        read(tstate + u64::from(layout.tstate_current_frame))
    }
}

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

/// A thread forked a process: the child's only thread is a copy of it, inside the same eval
/// loop with the same `PyThreadState` (a forked Python worker never enters the loop anew: it
/// returns from `os.fork()` into it), so it inherits the thread state the probes know. Not
/// its shadow stack: the frames on it are the parent's calls, counted and timed there.
pub(crate) fn forked(thread: u32, child: u32) {
    // SAFETY: map values are valid for the duration of the program.
    if let Some(&tstate) = unsafe { PY_TSTATE.get(&thread) } {
        let _ = PY_TSTATE.insert(&child, &tstate, 0);
    }
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

/// A frame starts or resumes: count the call, push it on the thread's stack.
/// `caller`: the calling frame where `frame`'s own link to it cannot be read yet.
/// (Inlined: BPF functions take at most five arguments.)
#[inline(always)]
fn enter(
    mask: SessionMask,
    who: u64,
    frame: u64,
    layout: &PyLayout,
    caller: Option<u64>,
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
            Some(0) => pop_inferred_to(st, mask, who, now, 0),
            Some(c) => {
                unwind_to(st, mask, who, c, now);
            }
            None => reconcile(st, mask, who, frame, layout, now),
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
    count(
        mask, pid, code, names, qualname, filename, layout, primitive,
    );
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
fn pop_inferred_to(st: &mut PyStack, mask: SessionMask, who: u64, now: u64, depth: u64) {
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

/// Index of `frame` on the stack, topmost first.
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
fn leave(mask: SessionMask, who: u64, frame: u64, layout: &PyLayout) {
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
fn pop(st: &mut PyStack, mask: SessionMask, who: u64, now: u64, flags: u16) {
    if st.depth == 0 {
        return;
    }
    let pid = (who >> 32) as u32;
    st.depth -= 1;
    let Some(&e) = st.entries.get(st.depth as usize) else {
        return;
    };
    let ct = now.saturating_sub(e.start_ns);
    let tt = ct.saturating_sub(e.sub_ns);
    let mut caller = None;
    if let Some(parent) = st
        .depth
        .checked_sub(1)
        .and_then(|d| st.entries.get_mut(opaque(d as usize)))
    {
        parent.sub_ns += ct;
        caller = Some((parent.code, parent.names));
    }
    if e.pseudo != 0 {
        return;
    }
    let traced = trace::tracing(mask);
    if traced != 0 {
        trace::emit(&TraceEvent {
            kind: trace_kind::PY_CALL,
            flags,
            cpu: 0,
            pid,
            tid: who as u32,
            sessions: traced,
            start_ns: e.start_ns,
            end_ns: now,
            a: e.code,
            b: e.names,
        });
    }
    let mut m = mask;
    for _ in 0..MAX_PY_SESSIONS {
        if m == 0 {
            break;
        }
        let slot = m.trailing_zeros();
        m &= m - 1;
        let key = PyCallKey {
            slot,
            pid,
            code: e.code,
            names: e.names,
        };
        if let Some(s) = PY_CALLS.get_ptr_mut(&key) {
            // SAFETY: a live map value.
            unsafe {
                add(&raw mut (*s).tottime_ns, tt);
                if e.outermost != 0 {
                    add(&raw mut (*s).cumtime_ns, ct);
                }
            }
        }
        if let Some((caller_code, caller_names)) = caller {
            let edge = PyEdgeKey {
                slot,
                pid,
                code: e.code,
                names: e.names,
                caller_code,
                caller_names,
            };
            add_edge(&edge, &e, tt, ct);
        }
    }
}

/// One call of `e` from its caller ended: pstats' callers entry, counted as lsprof counts
/// its sub-entries (cumtime only when the pair is not active further down).
fn add_edge(key: &PyEdgeKey, e: &PyStackEntry, tt: u64, ct: u64) {
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

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn count(
    mut mask: SessionMask,
    pid: u32,
    code: u64,
    names: u64,
    qualname: u64,
    filename: u64,
    layout: &PyLayout,
    primitive: bool,
) {
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

/// Hides an index from the optimiser so that the bounds check on it stays in the code: the
/// verifier needs to see it, and LLVM would otherwise fold it into the loop condition.
#[inline(always)]
fn opaque(i: usize) -> usize {
    core::hint::black_box(i)
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
