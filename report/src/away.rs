//! What a thread was doing off the CPU, in words, from a tracing session's `OFF_CPU` event:
//! its state as it left, the system call it blocked in (x86-64 numbers), and what the fd
//! that call waited on was. The same words as a wall-clock profile's reasons where they
//! mean the same.

use tracer_common::{off_cpu_fd, sample_flag, TraceEvent, OFF_CPU_FD_CALLS};

/// x86-64 system calls a thread blocks in, and how a reader says each.
const CALLS: &[(u64, &str)] = &[
    (0, "read"),
    (1, "write"),
    (7, "poll"),
    (17, "read"),
    (18, "write"),
    (19, "read"),
    (20, "write"),
    (23, "select"),
    (34, "pause"),
    (35, "sleep"),
    (42, "connect"),
    (43, "accept"),
    (44, "send"),
    (45, "recv"),
    (46, "send"),
    (47, "recv"),
    (61, "waiting for a child"),
    (72, "fcntl lock"),
    (73, "flock"),
    (74, "fsync"),
    (75, "fsync"),
    (128, "waiting for a signal"),
    (130, "waiting for a signal"),
    (202, "futex: a lock or condition"),
    (230, "sleep"),
    (232, "epoll"),
    (247, "waiting for a child"),
    (270, "select"),
    (271, "poll"),
    (281, "epoll"),
    (288, "accept"),
    (295, "read"),
    (296, "write"),
    (299, "recv"),
    (307, "send"),
    (327, "read"),
    (328, "write"),
    (441, "epoll"),
    (449, "futex: a lock or condition"),
];

/// The words for an `OFF_CPU` event.
pub fn reason(ev: &TraceEvent) -> String {
    let flags = u32::from(ev.flags);
    if flags & sample_flag::PREEMPTED != 0 {
        return "preempted: runnable, waiting for a CPU".into();
    }
    if flags & sample_flag::UNINTERRUPTIBLE != 0 {
        return "uninterruptible: disk I/O, a page fault or a kernel lock".into();
    }
    if ev.a == u64::MAX {
        return "blocked".into();
    }
    let Some(&(_, call)) = CALLS.iter().find(|(nr, _)| *nr == ev.a) else {
        return format!("system call {}", ev.a);
    };
    if !OFF_CPU_FD_CALLS.contains(&ev.a) {
        return call.into();
    }
    // A pipe or a socket says more than the call: the sampling reasons' words.
    match ev.b {
        off_cpu_fd::PIPE => "pipe".into(),
        off_cpu_fd::SOCKET => format!("socket ({call})"),
        off_cpu_fd::FILE => format!("file {call}"),
        off_cpu_fd::DEVICE => format!("device ({call})"),
        _ => call.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracer_common::trace_kind;

    fn away(flags: u32, a: u64, b: u64) -> String {
        reason(&TraceEvent {
            kind: trace_kind::OFF_CPU,
            flags: flags as u16,
            a,
            b,
            ..TraceEvent::default()
        })
    }

    #[test]
    fn states_calls_and_fds_in_words() {
        assert_eq!(
            away(sample_flag::PREEMPTED, 0, 0),
            "preempted: runnable, waiting for a CPU"
        );
        assert!(away(sample_flag::UNINTERRUPTIBLE, 0, 0).starts_with("uninterruptible"));
        assert_eq!(away(0, 202, 0), "futex: a lock or condition");
        assert_eq!(away(0, 230, 0), "sleep");
        assert_eq!(away(0, 0, off_cpu_fd::PIPE), "pipe");
        assert_eq!(away(0, 45, off_cpu_fd::SOCKET), "socket (recv)");
        assert_eq!(away(0, 0, off_cpu_fd::UNKNOWN), "read");
        assert_eq!(away(0, u64::MAX, 0), "blocked");
        assert_eq!(away(0, 9999, 0), "system call 9999");
    }
}
