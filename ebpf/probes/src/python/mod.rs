//! Counting Python calls. Uprobes on each interpreter's eval loop find the code object being
//! entered and count it per (session, process, code object) in `PY_CALLS`. The first time a
//! session sees a code object, its names go to user space on `PY_CODES`.
//!
//! The attach cookie of every probe is the index of the interpreter's `PyLayout`.
//!
//! Here: the maps every part reads, which sessions count a process, and the thread state's
//! current frame; the probes are in `eval`, the threads' shadow stacks (timing, unwinding)
//! in `stack`, the counts and names sent in `count`.

use aya_ebpf::{
    helpers::{bpf_get_attach_cookie, bpf_probe_read_user},
    macros::map,
    maps::{Array, HashMap, LruHashMap},
    EbpfContext,
};
use tracer_common::{
    loss, py_kind, py_role, PyLayout, SessionMask, MAX_PY_SESSIONS, PY_LAYOUTS_MAX,
};

use crate::shared::{count_loss, TRACKED};

mod count;
mod eval;
mod stack;

pub(crate) use count::add;
pub(crate) use stack::{drop_thread, forget_thread};

const BPF_F_NO_PREALLOC: u32 = 1;

#[map]
static PY_LAYOUTS: Array<PyLayout> = Array::with_max_entries(PY_LAYOUTS_MAX, 0);

/// Thread id → its `PyThreadState *`, recorded when the thread enters the eval loop (or seeded
/// by the daemon for threads already inside it).
#[map]
static PY_TSTATE: LruHashMap<u32, u64> = LruHashMap::with_max_entries(65_536, 0);

/// One entry: [sessions counting Python calls, those of them that count every process,
/// those with processes counted in-process (`PY_INPROC`)].
#[map]
static PY_SESSIONS: Array<[SessionMask; 3]> = Array::with_max_entries(1, 0);

/// Processes counted in-process (CPython 3.14+, `libtracer_pycount.so`) → the sessions that
/// count them that way: those sessions' probes skip them. Copied to forked children (the
/// counter goes on in the child); dropped at exec (the new program has no counter).
#[map]
static PY_INPROC: HashMap<u32, SessionMask> = HashMap::with_max_entries(4096, 0);

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
