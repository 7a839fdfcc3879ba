//! The probes on CPython's eval loop: its entry (and 3.10's return), and the opcode
//! handlers where frames start, resume, return or yield (3.11+). They find the frame and
//! hand it to the shadow stack (`stack`).

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use tracer_common::{
    loss, py_kind, PyLayout, SessionMask, PY_CO_GENERATOR_LIKE, PY_EVAL_EVENTS_MASK,
    PY_FRAME_OWNED_BY_THREAD, TRACE_EXIT_INFERRED,
};

use super::{
    cookie, current_frame, read, sessions,
    stack::{enter, leave, pop, pop_inferred_to, LINKED, PY_STACKS},
    PY_TSTATE,
};
use crate::shared::count_loss;

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
        py_kind::EVAL_ARG_FRAME => LINKED,
        _ => current_frame(tstate, layout)?,
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

/// An opcode handler of the eval loop (3.11+) where a frame starts or resumes: RESUME and
/// friends (what cProfile counts as a call).
#[uprobe]
pub fn tracer_py_opcode(ctx: ProbeContext) -> u32 {
    let _ = try_opcode(&ctx);
    0
}

/// An opcode handler of the eval loop (3.11+) where a frame is left: a return or a yield.
/// A program apart from the entries': one holding both took the verifier their two costs
/// together (25% of its instruction limit, `cargo xtask verifier`).
#[uprobe]
pub fn tracer_py_opcode_exit(ctx: ProbeContext) -> u32 {
    if let Ok((mask, pid_tgid, layout, _, frame)) = opcode_frame(&ctx) {
        leave(mask, pid_tgid, frame, layout);
    }
    0
}

/// The sessions counting the current process, its thread, the layout, the thread's state
/// and its current frame.
#[inline(always)]
fn opcode_frame(ctx: &ProbeContext) -> Result<(SessionMask, u64, &'static PyLayout, u64, u64), ()> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let mask = sessions((pid_tgid >> 32) as u32);
    if mask == 0 {
        return Err(());
    }
    let (layout, _) = cookie(ctx).ok_or(())?;
    // SAFETY: map values are valid for the duration of the program.
    let Some(&tstate) = (unsafe { PY_TSTATE.get(&(pid_tgid as u32)) }) else {
        count_loss(loss::PY_NO_THREAD_STATE);
        return Err(());
    };
    Ok((
        mask,
        pid_tgid,
        layout,
        tstate,
        current_frame(tstate, layout)?,
    ))
}

fn try_opcode(ctx: &ProbeContext) -> Result<(), ()> {
    let (mask, pid_tgid, layout, tstate, frame) = opcode_frame(ctx)?;
    if layout.code_flags != 0 && creating_generator(frame, layout) {
        return Ok(());
    }
    if layout.code_instr_version != 0 && runs_again(tstate, frame, layout) {
        return Ok(());
    }
    enter(mask, pid_tgid, frame, layout, LINKED)
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
