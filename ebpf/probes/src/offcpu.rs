//! Off-CPU time (`--off-cpu`), from two tracepoints and no kprobe (kernels may have none, and
//! the scheduler's functions take no fentry):
//!
//! - `sched:sched_switch` runs as the leaving thread: a followed thread's time away starts,
//!   with the kernel stack where it waits. The same event names the thread coming back: its
//!   time away ends and, once it adds up to the sessions' minimum, a record is due (shorter
//!   periods are carried into its next one, so none of its time is dropped).
//! - The due record goes out in the returning thread's own context, where its user stack
//!   and Python frames can be read, as a timer's sample reads them: at its syscall's exit
//!   (`raw_syscalls:sys_exit`: a blocked thread waited in one), or else at its next switch
//!   (a thread preempted, or blocked on a page fault: its stacks then, not where it left).
//!
//! Tracing sessions get each time away of at least their minimum as an event of its own
//! (`trace_kind::OFF_CPU`) when the thread comes back: its state, and the system call it
//! blocked in with its first argument, read from its registers as it left.

use aya_ebpf::{
    helpers::{
        bpf_get_current_pid_tgid, bpf_get_current_task_btf, bpf_ktime_get_ns,
        bpf_probe_read_kernel, bpf_task_pt_regs,
    },
    macros::{map, tracepoint},
    maps::{Array, LruHashMap},
    programs::{tracing::StackIdContext, TracePointContext},
};
use tracer_common::{
    off_cpu_fd, sample_flag, trace_kind, OffCpuConfig, OffCpuThread, TraceEvent, OFF_CPU_FD_CALLS,
};

use crate::{
    sample::{header, python, scratch, send, user_stack, SAMPLE_KSTACKS},
    shared::{global, TRACKED},
};

/// Which sessions record off-CPU time; written by the daemon.
#[map]
static OFFCPU_SESSIONS: Array<OffCpuConfig> = Array::with_max_entries(1, 0);

/// Thread id → its off-CPU bookkeeping. LRU: exited threads' entries go by themselves.
#[map]
static OFFCPU_THREADS: LruHashMap<u32, OffCpuThread> = LruHashMap::with_max_entries(65_536, 0);

/// `sched:sched_switch`'s `prev_state` and `next_pid` offsets, from its tracefs format.
#[no_mangle]
static SWITCH_PREV_STATE_OFFSET: u32 = 32;
#[no_mangle]
static SWITCH_NEXT_PID_OFFSET: u32 = 56;

/// `task_struct.files`, `files_struct.fdt`, `fdtable.max_fds`, `fdtable.fd`, `file.f_inode`
/// and `inode.i_mode`, patched in by the loader from the kernel's BTF.
#[no_mangle]
static FD_OFFSETS: [u32; 6] = [u32::MAX; 6];

/// `TASK_UNINTERRUPTIBLE` in `prev_state`; 0 is `TASK_RUNNING` (preempted).
const TASK_UNINTERRUPTIBLE: i64 = 2;

/// `pt_regs` on x86-64: the system call number (`orig_ax`; an interrupt's is negative, an
/// exception's its error code) and the first argument (`di`).
const REGS_DI: usize = 112;
const REGS_ORIG_AX: usize = 120;

/// The sampling sessions that record `pid`'s off-CPU time, with the minimum record.
fn sessions(pid: u32) -> Option<(u64, u64)> {
    let cfg = OFFCPU_SESSIONS.get(0)?;
    let mask = cfg.all | (followed(pid) & cfg.slots);
    (mask != 0).then_some((mask, cfg.min_ns))
}

/// The tracing sessions that put `pid`'s time away on their timeline, with their minimum.
fn tracing(pid: u32) -> Option<(u64, u64)> {
    let cfg = OFFCPU_SESSIONS.get(0)?;
    let mask = cfg.trace_all | (followed(pid) & cfg.trace_slots);
    (mask != 0).then_some((mask, cfg.trace_min_ns))
}

fn followed(pid: u32) -> u64 {
    // SAFETY: map values are valid for the duration of the program.
    unsafe { TRACKED.get(&pid) }.copied().unwrap_or(0)
}

#[tracepoint]
pub fn tracer_offcpu_switch(ctx: TracePointContext) -> u32 {
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    leaves(&ctx, now);
    // SAFETY: the offset comes from this kernel's tracepoint format; a bounded probe read.
    if let Ok(next) = unsafe { ctx.read_at::<i32>(global(&SWITCH_NEXT_PID_OFFSET) as usize) } {
        back(next as u32, now);
    }
    0
}

/// The current thread leaves the CPU.
fn leaves(ctx: &TracePointContext, now: u64) {
    let pid_tgid = bpf_get_current_pid_tgid();
    let (pid, tid) = ((pid_tgid >> 32) as u32, pid_tgid as u32);
    let (sampled, traced) = (sessions(pid).is_some(), tracing(pid).is_some());
    if pid == 0 || !(sampled || traced) {
        return;
    }
    // A record due since it came back goes now, while its stacks are still its own.
    emit_due::<false>(tid, pid);
    // SAFETY: as above.
    let state: i64 =
        unsafe { ctx.read_at(global(&SWITCH_PREV_STATE_OFFSET) as usize) }.unwrap_or(1);
    let flags = match state & 0xff {
        0 => sample_flag::PREEMPTED,
        s if s & TASK_UNINTERRUPTIBLE != 0 => sample_flag::UNINTERRUPTIBLE,
        _ => 0,
    };
    // Only a sampling session's records carry the stack where the thread waits.
    let kernel_stack = match sampled {
        true => ctx
            .get_stackid(&SAMPLE_KSTACKS, 0)
            .map(|id| id as i64)
            .unwrap_or_else(|e| e as i64),
        false => -1,
    };
    // Blocked (not preempted, not in `D`): in a system call, whose number is its own;
    // otherwise `orig_ax` may be an exception's error code, not a call.
    // Only a trace's events name the call and the fd: sampling names waits from stacks.
    let (syscall, fd_kind) = if traced && state & 0xff != 0 && flags == 0 {
        // SAFETY: the current task's saved user registers, read with probe reads.
        unsafe {
            let regs = bpf_task_pt_regs(bpf_get_current_task_btf()) as *const u8;
            let nr = bpf_probe_read_kernel(regs.add(REGS_ORIG_AX) as *const i64).unwrap_or(-1);
            let kind = if OFF_CPU_FD_CALLS.contains(&(nr as u64)) {
                let fd = bpf_probe_read_kernel(regs.add(REGS_DI) as *const u64).unwrap_or(0);
                fd_kind(fd)
            } else {
                off_cpu_fd::UNKNOWN
            };
            (nr, kind)
        }
    } else {
        (-1, off_cpu_fd::UNKNOWN)
    };
    match OFFCPU_THREADS.get_ptr_mut(&tid) {
        // SAFETY: the entry is this thread's, written as it leaves or comes back.
        Some(t) => unsafe {
            (*t).since_ns = now;
            (*t).flags = flags;
            (*t).kernel_stack = kernel_stack;
            (*t).pid = pid;
            (*t).syscall = syscall;
            (*t).fd_kind = fd_kind;
        },
        None => {
            let t = OffCpuThread {
                since_ns: now,
                kernel_stack,
                flags,
                pid,
                syscall,
                fd_kind,
                ..OffCpuThread::default()
            };
            let _ = OFFCPU_THREADS.insert(&tid, &t, 0);
        }
    }
}

/// What the current thread's file descriptor `fd` is, from its fd table.
fn fd_kind(fd: u64) -> u64 {
    let kind = (|| {
        let inode = kernel_word(fd_file(fd)? + fd_offset(4)?)?;
        // SAFETY: a probe read, which fails cleanly on a bad address.
        let mode = unsafe { bpf_probe_read_kernel((inode + fd_offset(5)?) as *const u16) }.ok()?;
        Some(match mode & 0o170000 {
            0o010000 => off_cpu_fd::PIPE,
            0o140000 => off_cpu_fd::SOCKET,
            0o100000 => off_cpu_fd::FILE,
            0o020000 => off_cpu_fd::DEVICE,
            _ => off_cpu_fd::UNKNOWN,
        })
    })();
    kind.unwrap_or(off_cpu_fd::UNKNOWN)
}

/// `FD_OFFSETS[i]`, if the loader found it.
fn fd_offset(i: usize) -> Option<u64> {
    // SAFETY: reading a plain static the loader patched.
    let off = unsafe { core::ptr::read_volatile(FD_OFFSETS.as_ptr().add(i.min(5))) };
    (off != u32::MAX).then_some(u64::from(off))
}

/// A kernel word at `addr`.
pub(crate) fn kernel_word(addr: u64) -> Option<u64> {
    // SAFETY: a probe read, which fails cleanly on a bad address.
    unsafe { bpf_probe_read_kernel(addr as *const u64) }.ok()
}

/// The `struct file` behind the current thread's file descriptor `fd`, from its fd table
/// (read, never locked: a table replaced meanwhile reads as another's, at worst the wrong
/// file).
pub(crate) fn fd_file(fd: u64) -> Option<u64> {
    // SAFETY: plain helper call.
    let task = unsafe { aya_ebpf::helpers::bpf_get_current_task() };
    let files = kernel_word(task + fd_offset(0)?)?;
    let fdt = kernel_word(files + fd_offset(1)?)?;
    // SAFETY: a probe read, which fails cleanly on a bad address.
    let max = unsafe { bpf_probe_read_kernel((fdt + fd_offset(2)?) as *const u32) }.ok()?;
    if fd >= u64::from(max) {
        return None;
    }
    kernel_word(kernel_word(fdt + fd_offset(3)?)? + fd * 8)
}

/// A tracing session's event for thread `tid`'s time away, `since`..`now`.
fn trace_away(tid: u32, t: &OffCpuThread, since: u64, now: u64) {
    if t.pid == 0 {
        return;
    }
    let Some((mask, min_ns)) = tracing(t.pid) else {
        return;
    };
    let sessions = crate::trace::tracing(mask);
    if sessions == 0 || now.saturating_sub(since) < min_ns {
        return;
    }
    crate::trace::emit(&TraceEvent {
        kind: trace_kind::OFF_CPU,
        flags: t.flags as u16,
        pid: t.pid,
        tid,
        sessions,
        start_ns: since,
        end_ns: now,
        a: t.syscall as u64,
        b: t.fd_kind,
        ..TraceEvent::default()
    });
}

/// Thread `tid` gets a CPU: its time away ends, and a record is due once it adds up.
fn back(tid: u32, now: u64) {
    if tid == 0 {
        return;
    }
    let Some(t) = OFFCPU_THREADS.get_ptr_mut(&tid) else {
        return;
    };
    let Some(cfg) = OFFCPU_SESSIONS.get(0) else {
        return;
    };
    // SAFETY: as above.
    unsafe {
        let since = (*t).since_ns;
        if since == 0 {
            return;
        }
        (*t).since_ns = 0;
        trace_away(tid, &*t, since, now);
        if sessions((*t).pid).is_none() && (*t).pid != 0 {
            // Only tracing sessions follow it: nothing to carry or record.
            return;
        }
        let away = now.saturating_sub(since);
        let total = (*t).carry_ns + away;
        if total < cfg.min_ns || (*t).due_ns != 0 {
            // Short, or a record still waits to go: carried into the next.
            (*t).carry_ns = total;
            return;
        }
        (*t).carry_ns = 0;
        (*t).due_ns = total;
        (*t).due_own_ns = away;
        (*t).due_flags = (*t).flags;
        (*t).due_kernel_stack = (*t).kernel_stack;
    }
}

#[tracepoint]
pub fn tracer_offcpu_sys_exit(_ctx: TracePointContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    emit_due::<true>(pid_tgid as u32, (pid_tgid >> 32) as u32);
    0
}

/// Sends the current thread's due record, with its stacks now. `TASKS`: with the asyncio
/// tasks awaiting the running one (at a system call's exit, where a blocked thread's record
/// goes; the switch program is too large for the verifier with them).
fn emit_due<const TASKS: bool>(tid: u32, pid: u32) {
    let Some(t) = OFFCPU_THREADS.get_ptr_mut(&tid) else {
        return;
    };
    // SAFETY: as above.
    let (due, own, flags, kernel_stack) = unsafe {
        let due = (
            (*t).due_ns,
            (*t).due_own_ns,
            (*t).due_flags,
            (*t).due_kernel_stack,
        );
        (*t).due_ns = 0;
        due
    };
    if due == 0 || pid == 0 {
        return;
    }
    // A session that ended meanwhile: its time goes with it.
    let Some((mask, _)) = sessions(pid) else {
        return;
    };
    let Some(ev) = scratch() else {
        return;
    };
    // SAFETY: `ev` is this CPU's record, ours until sent.
    unsafe {
        header(ev, mask.trailing_zeros(), pid, tid);
        (*ev).flags = sample_flag::OFF_CPU | flags;
        (*ev).slots = mask;
        (*ev).weight_ns = due;
        (*ev).own_ns = own;
        (*ev).kernel_stack = kernel_stack;
        user_stack(ev);
        python::<TASKS, false>(ev, pid);
        send(ev);
    }
}
