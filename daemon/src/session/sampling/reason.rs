//! Why a thread was off the CPU, in words, from the frames where it left: the kernel
//! function it waited in (what the kernel stack says it waited for), and for a few waits
//! that look alike in the kernel (a futex is a lock, a condition, the GIL, or a CUDA
//! synchronization), the user-space function that asked.

use tracer_report::profile::{Frame, FrameKind};

/// Kernel functions a switch passes through on every path, and the tracepoint's own: not
/// a reason, and dropped from the stack's leaf end.
fn scheduler(name: &str) -> bool {
    [
        "finish_task_switch",
        "perf_trace",
        "__traceiter",
        "__bpf_trace",
        "trace_call_bpf",
        "bpf_",
    ]
    .iter()
    .any(|p| name.starts_with(p))
        || matches!(
            name,
            "__schedule"
                | "schedule"
                | "preempt_schedule"
                | "preempt_schedule_common"
                | "preempt_schedule_irq"
                | "preempt_schedule_notrace"
                | "__cond_resched"
                | "schedule_preempt_disabled"
        )
}

/// The leaf-end scheduler frames go; the rest stay.
pub(super) fn trim(frames: &mut Vec<Frame>) {
    while frames
        .last()
        .is_some_and(|f| f.kind == FrameKind::Kernel && scheduler(&f.name))
    {
        frames.pop();
    }
}

/// Kernel waits by the function names on their path, checked leaf first.
const KERNEL: &[(&[&str], &str)] = &[
    (
        &[
            "do_nanosleep",
            "hrtimer_nanosleep",
            "clock_nanosleep",
            "msleep",
        ],
        "sleep",
    ),
    (
        &[
            "pipe_read",
            "pipe_write",
            "pipe_wait",
            "anon_pipe_read",
            "anon_pipe_write",
        ],
        "pipe",
    ),
    (
        &[
            "sock_recvmsg",
            "sock_sendmsg",
            "sk_wait_data",
            "unix_stream_read",
            "unix_stream_recvmsg",
            "unix_dgram_recvmsg",
            "tcp_recvmsg",
            "tcp_sendmsg",
            "inet_csk_accept",
            "inet_accept",
            "unix_accept",
            "__sys_accept",
            "sk_stream_wait",
            "__sys_connect",
            "udp_recvmsg",
        ],
        "socket",
    ),
    (
        &[
            "ep_poll",
            "do_epoll_wait",
            "do_sys_poll",
            "do_select",
            "core_sys_select",
            "do_pselect",
            "io_uring_enter",
            "io_cqring_wait",
        ],
        "poll, epoll or select",
    ),
    (&["n_tty_read", "tty_read", "tty_write"], "terminal"),
    (
        &["do_wait", "kernel_wait4", "__do_sys_wait4", "kernel_waitid"],
        "waiting for a child process",
    ),
    (
        &[
            "shrink_node",
            "try_to_free_pages",
            "__alloc_pages_slowpath",
            "shrink_lruvec",
            "balance_dirty_pages",
            "mem_cgroup_handle_over_high",
        ],
        "memory reclaim",
    ),
    (
        &[
            "handle_mm_fault",
            "exc_page_fault",
            "do_user_addr_fault",
            "filemap_fault",
            "do_swap_page",
        ],
        "page fault",
    ),
    (
        &[
            "io_schedule",
            "folio_wait_bit",
            "wait_on_page_bit",
            "blk_mq_get_tag",
            "submit_bio_wait",
            "jbd2_log_wait_commit",
            "filemap_read",
            "generic_file_read_iter",
            "ext4_file_read_iter",
            "xfs_file_read_iter",
            "vfs_read",
            "vfs_write",
            "do_fsync",
            "file_write_and_wait_range",
        ],
        "file or disk I/O",
    ),
    (
        &[
            "futex_wait",
            "futex_wait_queue",
            "futex_do_wait",
            "__futex_wait",
            "futex_lock_pi",
            "do_futex",
        ],
        "futex: a lock or condition",
    ),
    (
        &[
            "rwsem_down_read_slowpath",
            "rwsem_down_write_slowpath",
            "__mutex_lock",
            "mutex_lock",
        ],
        "kernel lock",
    ),
    (
        &["do_sigtimedwait", "sys_pause", "sigsuspend"],
        "signal wait",
    ),
];

/// User-space callers that name a wait the kernel sees only as a futex or a poll.
const USER: &[(&[&str], &str)] = &[
    (
        &[
            "cuCtxSynchronize",
            "cuStreamSynchronize",
            "cuEventSynchronize",
            "cudaDeviceSynchronize",
            "cudaStreamSynchronize",
            "cudaEventSynchronize",
            "cuMemcpyDtoH",
            "cudaMemcpy",
        ],
        "CUDA synchronization",
    ),
    (
        &[
            "take_gil",
            "PyEval_RestoreThread",
            "PyEval_AcquireThread",
            "_PyEval_AcquireLock",
        ],
        tracer_report::profile::WAITING_FOR_THE_GIL,
    ),
];

/// State at the switch (`state`: 1 preempted, 2 blocked, 3 uninterruptible) and where the
/// thread waited: why, in words.
pub(super) fn reason(frames: &[Frame], state: u8) -> &'static str {
    if state == 1 {
        return "preempted: runnable, waiting for a CPU";
    }
    let kernel = frames
        .iter()
        .rev()
        .filter(|f| f.kind == FrameKind::Kernel)
        .find_map(|f| matching(KERNEL, &f.name));
    let user = frames
        .iter()
        .rev()
        .filter(|f| f.kind == FrameKind::Native)
        .take(12)
        .find_map(|f| matching(USER, &f.name));
    match (kernel, user) {
        // The thread sleeps in a futex or poll for these; its caller says which.
        (Some("futex: a lock or condition" | "poll, epoll or select") | None, Some(u)) => u,
        (Some(k), _) => k,
        (None, None) if state == 3 => "uninterruptible wait",
        (None, None) => "other wait",
    }
}

fn matching(table: &[(&[&str], &'static str)], name: &str) -> Option<&'static str> {
    // Compilers suffix specialized copies (`futex_wait.constprop.0`).
    let base = name.split('.').next().unwrap_or(name);
    table
        .iter()
        .find(|(names, _)| names.contains(&base))
        .map(|(_, why)| *why)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(kind: FrameKind, name: &str) -> Frame {
        Frame {
            kind,
            name: name.into(),
            ..Frame::default()
        }
    }

    #[test]
    fn waits_are_named_from_their_frames() {
        let k = |n| f(FrameKind::Kernel, n);
        let n = |n| f(FrameKind::Native, n);
        let sleep = [
            n("main"),
            n("clock_nanosleep"),
            k("__x64_sys_clock_nanosleep"),
            k("hrtimer_nanosleep"),
            k("do_nanosleep"),
        ];
        assert_eq!(reason(&sleep, 2), "sleep");
        assert_eq!(reason(&sleep, 1), "preempted: runnable, waiting for a CPU");
        let pipe = [n("read"), k("vfs_read"), k("pipe_read")];
        assert_eq!(reason(&pipe, 2), "pipe");
        let gil = [
            n("take_gil"),
            n("pthread_cond_timedwait"),
            k("do_futex"),
            k("futex_wait.constprop.0"),
        ];
        assert_eq!(reason(&gil, 2), "waiting for the GIL");
        let lock = [
            n("PyThread_acquire_lock_timed"),
            n("sem_clock_wait"),
            k("__futex_wait"),
        ];
        assert_eq!(reason(&lock, 2), "futex: a lock or condition");
        assert_eq!(reason(&[n("x")], 3), "uninterruptible wait");
        let mut frames = vec![
            k("do_nanosleep"),
            k("schedule"),
            k("__schedule"),
            k("finish_task_switch.isra.0"),
        ];
        trim(&mut frames);
        assert_eq!(frames.len(), 1);
    }
}
