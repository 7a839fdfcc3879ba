//! Process following: which processes belong to which session, as they fork and exit.
//!
//! `TRACKED` maps a process id to the sessions that follow it. The daemon seeds it with a
//! session's target; these programs extend it to the children the target forks and tell the
//! daemon (ring buffer) when a followed process forks or exits, so sessions end when their
//! targets do and later probes can filter on it.

use aya_ebpf::{
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns,
        generated::bpf_send_signal,
    },
    macros::{map, tracepoint},
    maps::{Array, HashMap, RingBuf},
    programs::TracePointContext,
};
use tracer_common::{
    loss, ProcEvent, SessionMask, PROC_EVENT_EXEC, PROC_EVENT_EXIT, PROC_EVENT_FORK,
};

use crate::shared::{count_loss, global, TRACKED};

#[map]
static PROC_EVENTS: RingBuf = RingBuf::with_byte_size(256 * 1024, 0);

/// Sessions whose processes stop at each exec until the daemon has looked at the new program
/// and probed it (it sends SIGCONT on the exec event): an interpreter it has not seen, in a
/// chroot say, takes longer to probe than a short program takes to run. [0]: sessions that
/// follow processes (all their execs); [1]: sessions counting Python everywhere (execs of
/// programs named `python…`).
#[map]
static EXEC_HOLD: Array<SessionMask> = Array::with_max_entries(2, 0);

const SIGSTOP: u32 = 19;
const SIGCONT: u32 = 18;

/// Processes stopped at exec, or at their mapping of a CUDA library (`cuda.rs`), and not
/// continued yet (pid → when). The daemon deletes a pid as it continues it; tracerd's
/// guardian process, which holds this map too, continues whatever is left here if tracerd
/// dies first.
#[map]
static HELD: HashMap<u32, u64> = HashMap::with_max_entries(4096, 0);

// Tracepoint field offsets, patched in by the loader from tracefs (see `tracer_common::globals`).
#[no_mangle]
static NEWTASK_PID_OFFSET: u32 = 8;
#[no_mangle]
static NEWTASK_CLONE_FLAGS_OFFSET: u32 = 32;
#[no_mangle]
static EXIT_GROUP_DEAD_OFFSET: u32 = u32::MAX;

const CLONE_THREAD: u64 = 0x0001_0000;

/// Sends the event; false when the ring is full (counted as a loss).
fn emit(event: ProcEvent) -> bool {
    match PROC_EVENTS.reserve::<ProcEvent>(0) {
        Some(mut entry) => {
            entry.write(event);
            entry.submit(0);
            true
        }
        None => {
            count_loss(loss::RINGBUF_FULL);
            false
        }
    }
}

/// `task:task_newtask`, in the parent: a followed process forked a new process (not a thread).
#[tracepoint]
pub fn tracer_task_newtask(ctx: TracePointContext) -> u32 {
    match try_task_newtask(&ctx) {
        Ok(()) => 0,
        Err(()) => 1,
    }
}

fn try_task_newtask(ctx: &TracePointContext) -> Result<(), ()> {
    let current = bpf_get_current_pid_tgid();
    let parent = (current >> 32) as u32;
    // SAFETY: offsets come from this kernel's tracepoint format; read_at is a bounded probe read.
    let flags: u64 =
        unsafe { ctx.read_at(global(&NEWTASK_CLONE_FLAGS_OFFSET) as usize) }.map_err(|_| ())?;
    if flags & CLONE_THREAD != 0 {
        return Ok(());
    }
    // SAFETY: as above.
    let child: i32 =
        unsafe { ctx.read_at(global(&NEWTASK_PID_OFFSET) as usize) }.map_err(|_| ())?;
    let child = child as u32;
    // Every fork, followed or not (`--all` sessions follow no pid).
    crate::python::forked(current as u32, child);
    crate::sample::forked(parent, child);
    crate::python::inproc_forked(parent, child);
    // SAFETY: map lookups return pointers valid for the duration of the program.
    let Some(&sessions) = (unsafe { TRACKED.get(&parent) }) else {
        return Ok(());
    };
    if TRACKED.insert(&child, &sessions, 0).is_err() {
        count_loss(loss::TRACKED_MAP_FULL);
    }
    emit(ProcEvent {
        kind: PROC_EVENT_FORK,
        pid: child,
        parent_pid: parent,
        _pad: 0,
        sessions,
        // SAFETY: plain BPF helper calls.
        ktime_ns: unsafe { bpf_ktime_get_ns() },
        comm: bpf_get_current_comm().unwrap_or([0; 16]),
    });
    Ok(())
}

/// `sched:sched_process_exit`: the last thread of a followed process is exiting.
#[tracepoint]
pub fn tracer_process_exit(ctx: TracePointContext) -> u32 {
    match try_process_exit::<true>(&ctx) {
        Ok(()) => 0,
        Err(()) => 1,
    }
}

/// `tracer_process_exit` without unwinding an exiting thread's Python frames (a
/// `bpf_loop`, Linux 5.17+): what tracerd attaches where the kernel refuses the whole, so
/// that processes are still followed; frames left on such a thread are counted lost.
#[tracepoint]
pub fn tracer_process_exit_plain(ctx: TracePointContext) -> u32 {
    match try_process_exit::<false>(&ctx) {
        Ok(()) => 0,
        Err(()) => 1,
    }
}

fn try_process_exit<const UNWIND: bool>(ctx: &TracePointContext) -> Result<(), ()> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let (tgid, tid) = ((pid_tgid >> 32) as u32, pid_tgid as u32);
    if UNWIND {
        crate::python::forget_thread(tid);
    } else {
        crate::python::drop_thread(tid);
    }
    let group_dead = match global(&EXIT_GROUP_DEAD_OFFSET) {
        // Older kernels lack `group_dead`: take the leader's exit as the process's.
        u32::MAX => tgid == tid,
        // SAFETY: offset from this kernel's tracepoint format.
        off => unsafe { ctx.read_at::<u8>(off as usize) }.map_err(|_| ())? != 0,
    };
    if !group_dead {
        return Ok(());
    }
    crate::sample::forget_process(tgid);
    crate::python::inproc_forget(tgid);
    // Killed while stopped at exec: nobody is to continue it, nor a later process given its pid.
    let _ = HELD.remove(&tgid);
    // SAFETY: see try_task_newtask.
    let Some(&sessions) = (unsafe { TRACKED.get(&tgid) }) else {
        return Ok(());
    };
    let _ = TRACKED.remove(&tgid);
    emit(ProcEvent {
        kind: PROC_EVENT_EXIT,
        pid: tgid,
        parent_pid: 0,
        _pad: 0,
        sessions,
        // SAFETY: plain BPF helper calls.
        ktime_ns: unsafe { bpf_ktime_get_ns() },
        comm: bpf_get_current_comm().unwrap_or([0; 16]),
    });
    Ok(())
}

/// `sched:sched_process_exec`: a followed process runs a new program (the daemon checks
/// whether it is an interpreter to probe). Also, while sessions count Python in every
/// process, any process that execs a `python…` (by the name it was run as, the new comm).
#[tracepoint]
pub fn tracer_process_exec(_ctx: TracePointContext) -> u32 {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    crate::sample::forget_process(tgid);
    crate::python::inproc_forget(tgid);
    let comm = bpf_get_current_comm().unwrap_or([0; 16]);
    // SAFETY: see try_task_newtask.
    let sessions = match unsafe { TRACKED.get(&tgid) } {
        Some(&followed) => followed,
        None if comm.starts_with(b"python") => EXEC_HOLD.get(1).copied().unwrap_or(0),
        None => 0,
    };
    if sessions == 0 {
        return 0;
    }
    // SAFETY: plain BPF helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    let hold_mask = EXEC_HOLD.get(0).copied().unwrap_or(0) | EXEC_HOLD.get(1).copied().unwrap_or(0);
    // Stopped, and recorded, before the daemon can hear of it: its SIGCONT always comes
    // after the stop. It deletes the pid as it continues the process; tracerd's guardian
    // continues whatever HELD names if tracerd dies first. A stop nobody could undo is not
    // made.
    // The stop takes effect before the new program's first instruction.
    let hold = hold_mask & sessions != 0 && hold(tgid, now);
    let sent = emit(ProcEvent {
        kind: PROC_EVENT_EXEC,
        pid: tgid,
        parent_pid: 0,
        _pad: 0,
        sessions,
        ktime_ns: now,
        comm,
    });
    if hold && !sent {
        unhold(tgid);
    }
    0
}

/// Stops the current process until the daemon continues it (SIGCONT), recorded in HELD
/// first: the daemon deletes the pid as it continues it, and tracerd's guardian continues
/// whatever HELD names if tracerd dies first. False, and no stop, when it could not be
/// recorded: a stop nobody could undo is not made.
pub(crate) fn hold(tgid: u32, now: u64) -> bool {
    if HELD.insert(&tgid, &now, 0).is_err() {
        return false;
    }
    // SAFETY: plain BPF helper call; the stop takes effect on the way back to user space.
    unsafe { bpf_send_signal(SIGSTOP) };
    true
}

/// Undoes `hold` when the daemon will not hear of it: a SIGCONT generated now flushes the
/// pending stop.
pub(crate) fn unhold(tgid: u32) {
    // SAFETY: plain BPF helper call.
    unsafe { bpf_send_signal(SIGCONT) };
    let _ = HELD.remove(&tgid);
}
