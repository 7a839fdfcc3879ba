//! asyncio tasks in a sample (`--asyncio`): after the thread's frames, the running task
//! and each task awaiting the one before, with the coroutines where each awaits, up to the
//! outermost. 3.14+ name the running task in the thread state and keep who awaits a task
//! (`awaited_by`). 3.11–3.13 (`PyAsyncLayout::legacy`) keep neither: the running task is
//! the one whose step or wakeup the `Handle._run` below its coroutine calls, and who awaits
//! a task is found among its done-callbacks. Each candidate there is checked against the
//! task's own fields (its coroutine, the future it awaits), so that no stray pointer is
//! taken for a task.

use core::ffi::c_void;

use aya_ebpf::{helpers::bpf_loop, macros::map, maps::HashMap};
use tracer_common::{
    py_names_id, sample_flag, PyAsyncLayout, PyLayout, PySampleFrame, SampleEvent,
    PY_ASYNC_TASKS_MAX, PY_FRAME_TASK, SAMPLE_PY_DEPTH,
};

use crate::shared::read;

/// Process id → how to read its asyncio tasks (3.11+ processes whose offsets the daemon
/// found). Removed with the process's `PY_SAMPLE_PROCS` entry.
#[map]
pub(crate) static PY_ASYNC_PROCS: HashMap<u32, PyAsyncLayout> =
    HashMap::with_max_entries(16_384, 0);

/// `co_flags` of a coroutine's code (`CO_COROUTINE`, `CO_ITERABLE_COROUTINE`).
const CO_COROUTINE_LIKE: u32 = 0x80 | 0x100;
/// The same on every version 3.11–3.13 (x86-64): a bound C function's `m_self` (a task's
/// wakeup), a `TaskStepMethWrapper`'s `sw_task`, a cell's `ob_ref`, and a tuple's or a
/// list's size and items.
const BOUND_SELF: u64 = 24;
const STEP_TASK: u64 = 16;
const CELL_REF: u64 = 16;
const VAR_SIZE: u64 = 16;
const ITEMS: u64 = 24;

/// Legacy: whether `code` is a coroutine's (`co_flags` at `code_flags`).
pub(crate) fn is_coroutine(code: u64, code_flags: u32) -> bool {
    read::<u32>(code + u64::from(code_flags)).is_some_and(|f| f & CO_COROUTINE_LIKE != 0)
}

/// Legacy: the task of process `pid` whose coroutine runs in `coro_frame`, if `frame`, its
/// caller, is the `Handle._run` that stepped it: the handle's callback is the task's first
/// step (`TaskStepMethWrapper`) or its wakeup (a method bound to the task).
pub(crate) fn stepped_task(pid: u32, frame: u64, coro_frame: u64) -> u64 {
    // SAFETY: map values are valid for the duration of the program.
    let Some(a) = (unsafe { PY_ASYNC_PROCS.get(&pid) }) else {
        return 0;
    };
    let coro = coro_frame.wrapping_sub(u64::from(a.gen_iframe));
    let handle = read::<u64>(frame + u64::from(a.frame_localsplus)).unwrap_or(0);
    if handle == 0 {
        return 0;
    }
    let callback = read::<u64>(handle + u64::from(a.handle_callback)).unwrap_or(0);
    if callback == 0 {
        return 0;
    }
    for at in [STEP_TASK, BOUND_SELF] {
        let task = read::<u64>(callback + at).unwrap_or(0);
        if task != 0 && read::<u64>(task + u64::from(a.task_coro)) == Some(coro) {
            return task;
        }
    }
    0
}

/// The task the thread runs now (0: none), if it runs an event loop (3.14+).
pub(crate) fn running_task(tstate: u64, a: &PyAsyncLayout) -> u64 {
    match read::<u64>(tstate + u64::from(a.tstate_running_loop)) {
        Some(l) if l != 0 => read(tstate + u64::from(a.tstate_running_task)).unwrap_or(0),
        _ => 0,
    }
}

struct Tasks {
    ev: *mut SampleEvent,
    layout: *const PyLayout,
    asyncio: *const PyAsyncLayout,
    /// The task last written, and the coroutine of its chain to write next (0: go on to
    /// the task awaiting it).
    task: u64,
    coro: u64,
    depth: u32,
    tasks: u32,
}

/// After the thread's frames: the running task, then each task awaiting the one before,
/// with its coroutine chain (where it awaits), up to the outermost.
pub(crate) unsafe fn tasks(
    ev: *mut SampleEvent,
    layout: &PyLayout,
    a: &PyAsyncLayout,
    task: u64,
    depth: u32,
) {
    if depth as usize >= SAMPLE_PY_DEPTH {
        return;
    }
    let mut t = Tasks {
        ev,
        layout,
        asyncio: a,
        task,
        coro: 0,
        depth,
        tasks: 1,
    };
    put(&mut t, task_marker(task, a));
    // SAFETY: `task_step` only touches `t`, which outlives the call.
    unsafe {
        bpf_loop(
            SAMPLE_PY_DEPTH as u32,
            task_step as *mut c_void,
            (&mut t as *mut Tasks).cast(),
            0,
        );
        (*ev).py_depth = t.depth;
    }
}

fn task_marker(task: u64, a: &PyAsyncLayout) -> PySampleFrame {
    PySampleFrame {
        code: task | PY_FRAME_TASK,
        instr: read(task + u64::from(a.task_name)).unwrap_or(0),
        names: 0,
    }
}

fn put(t: &mut Tasks, f: PySampleFrame) {
    let i = (t.depth as usize) & (SAMPLE_PY_DEPTH - 1);
    // SAFETY: `ev` is this CPU's record; `i` is masked into the array.
    unsafe { (*t.ev).py[i] = f };
    t.depth += 1;
}

#[inline(never)]
extern "C" fn task_step(_: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the `Tasks` that `tasks` passed; the layouts are map values.
    let t = unsafe { &mut *ctx.cast::<Tasks>() };
    let (l, a) = unsafe { (&*t.layout, &*t.asyncio) };
    if t.depth as usize >= SAMPLE_PY_DEPTH {
        // SAFETY: `ev` is this CPU's record.
        unsafe { (*t.ev).flags |= sample_flag::PY_TRUNCATED };
        return 1;
    }
    if t.coro == 0 {
        if t.tasks >= PY_ASYNC_TASKS_MAX {
            // SAFETY: as above.
            unsafe { (*t.ev).flags |= sample_flag::PY_TRUNCATED };
            return 1;
        }
        let next = match a.legacy {
            0 => awaiter(t.task, a),
            _ => legacy_awaiter(t.task, a),
        };
        if next == 0 {
            return 1;
        }
        put(t, task_marker(next, a));
        t.task = next;
        t.coro = read(next + u64::from(a.task_coro)).unwrap_or(0);
        t.tasks += 1;
        return 0;
    }
    let frame = t.coro + u64::from(a.gen_iframe);
    let Some(code) = read::<u64>(frame + u64::from(l.frame_code)).map(|e| l.code_of(e)) else {
        t.coro = 0;
        return 0;
    };
    let qualname = read::<u64>(code + u64::from(l.code_qualname)).unwrap_or(0);
    let filename = read::<u64>(code + u64::from(l.code_filename)).unwrap_or(0);
    put(
        t,
        PySampleFrame {
            code,
            instr: read::<u64>(frame + u64::from(l.frame_instr)).unwrap_or(0),
            names: py_names_id(qualname, filename),
        },
    );
    let state = read::<i8>(t.coro + u64::from(a.gen_frame_state)).unwrap_or(0);
    t.coro = if state as u8 as u32 == a.yield_from_state {
        awaited(t.coro, frame, l, a)
    } else {
        0
    };
    0
}

/// What a coroutine suspended in an `await` awaits, if that is a coroutine too (not a
/// future or another awaitable, where its chain ends): at the top of its frame's stack
/// (3.11–3.14), or one slot below (later versions keep another value above it). Whichever
/// holds an object of the coroutine's own type.
fn awaited(coro: u64, frame: u64, l: &PyLayout, a: &PyAsyncLayout) -> u64 {
    let sp = match a.legacy {
        0 => l.code_of(read::<u64>(frame + u64::from(a.frame_stackpointer)).unwrap_or(0)),
        // `stacktop` counts slots from `localsplus`.
        _ => match read::<i32>(frame + u64::from(a.frame_stackpointer)) {
            Some(top) if top > 0 && top < 1 << 16 => {
                frame + u64::from(a.frame_localsplus) + (top as u64) * 8
            }
            _ => 0,
        },
    };
    if sp < 16 {
        return 0;
    }
    let ty = u64::from(a.ob_type);
    let Some(own) = read::<u64>(coro + ty) else {
        return 0;
    };
    let mut below = 8;
    while below <= 16 {
        let next = read::<u64>(sp - below).map_or(0, |r| l.code_of(r));
        if next != 0 && read::<u64>(next + ty) == Some(own) {
            return next;
        }
        below += 8;
    }
    0
}

/// The task awaiting `task` (0: none): its `awaited_by`, a task or a set of tasks, of
/// which the first in the set's table is taken.
fn awaiter(task: u64, a: &PyAsyncLayout) -> u64 {
    let by = read::<u64>(task + u64::from(a.task_awaited_by)).unwrap_or(0);
    if by == 0 || read::<u8>(task + u64::from(a.task_awaited_by_is_set)).unwrap_or(0) == 0 {
        return by;
    }
    let ty = u64::from(a.ob_type);
    let Some(task_type) = read::<u64>(task + ty) else {
        return 0;
    };
    let table = read::<u64>(by + u64::from(a.set_table)).unwrap_or(0);
    let mask = read::<i64>(by + u64::from(a.set_mask)).unwrap_or(-1);
    // A small set's table has 8 entries of (key, hash); a dummy (deleted) key is no task.
    let mut i = 0;
    while i < 8 {
        if i > mask {
            break;
        }
        let key = read::<u64>(table + (i as u64) * 16).unwrap_or(0);
        if key != 0 && read::<u64>(key + ty) == Some(task_type) {
            return key;
        }
        i += 1;
    }
    0
}

/// Legacy: the task awaiting `task` (0: none). A task awaiting another has its wakeup among
/// that one's done-callbacks: the first, or the first two of the list of the others, as
/// (callback, context) pairs. Through `gather`, a callback is `_done_callback`, whose
/// closure holds the gathering future, whose own first callback wakes the awaiting task.
/// No loops: the verifier would follow each round's branches into the next.
fn legacy_awaiter(task: u64, a: &PyAsyncLayout) -> u64 {
    let first = read::<u64>(task + u64::from(a.fut_callback0)).unwrap_or(0);
    let found = awaiter_by(first, task, a);
    if found != 0 {
        return found;
    }
    let list = read::<u64>(task + u64::from(a.fut_callbacks)).unwrap_or(0);
    let n = match list {
        0 => 0,
        _ => read::<i64>(list + VAR_SIZE).unwrap_or(0),
    };
    let items = read::<u64>(list + ITEMS).unwrap_or(0);
    let nth = |i: u64| {
        let pair = read::<u64>(items + i * 8).unwrap_or(0);
        read::<u64>(pair + ITEMS).unwrap_or(0)
    };
    if n >= 1 {
        let found = awaiter_by(nth(0), task, a);
        if found != 0 || n == 1 {
            return found;
        }
        return awaiter_by(nth(1), task, a);
    }
    0
}

/// The task that done-callback `callback` of `fut` wakes, directly or through `gather`
/// (whose `_done_callback` holds the gathering future in closure cell `gather_outer`).
fn awaiter_by(callback: u64, fut: u64, a: &PyAsyncLayout) -> u64 {
    if callback == 0 {
        return 0;
    }
    let task = woken(callback, fut, a);
    if task != 0 {
        return task;
    }
    let closure = read::<u64>(callback + u64::from(a.func_closure)).unwrap_or(0);
    let cells = read::<i64>(closure + VAR_SIZE).unwrap_or(0);
    if closure == 0 || cells <= i64::from(a.gather_outer) {
        return 0;
    }
    let cell = read::<u64>(closure + ITEMS + u64::from(a.gather_outer) * 8).unwrap_or(0);
    let outer = read::<u64>(cell + CELL_REF).unwrap_or(0);
    if outer == 0 {
        return 0;
    }
    let first = read::<u64>(outer + u64::from(a.fut_callback0)).unwrap_or(0);
    woken(first, outer, a)
}

/// The task `callback` is a wakeup of, if that task awaits `fut`.
fn woken(callback: u64, fut: u64, a: &PyAsyncLayout) -> u64 {
    let task = read::<u64>(callback + BOUND_SELF).unwrap_or(0);
    match task != 0 && read::<u64>(task + u64::from(a.task_fut_waiter)) == Some(fut) {
        true => task,
        false => 0,
    }
}
