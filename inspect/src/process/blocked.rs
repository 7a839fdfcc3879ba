//! What a thread is blocked in now, from `/proc/PID/task/TID/syscall`: the system call and
//! its first argument, and, where that argument is an fd, what kind of file it is. For
//! threads already away when a trace starts (the kernel saw them leave before tracer looked).

use std::os::unix::fs::FileTypeExt;

/// What an fd is, as `tracer_common::off_cpu_fd` numbers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FdKind {
    Unknown,
    Pipe,
    Socket,
    File,
    Device,
}

/// The system call `tid` of `pid` is blocked in now, with its first argument; None when it
/// runs, is not in a system call, or is gone.
pub fn blocked_in(pid: u32, tid: u32) -> Option<(i64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall")).ok()?;
    let mut fields = text.split_whitespace();
    let nr: i64 = fields.next()?.parse().ok()?;
    if nr < 0 {
        return None;
    }
    let arg0 = u64::from_str_radix(fields.next()?.trim_start_matches("0x"), 16).ok()?;
    Some((nr, arg0))
}

/// What `pid`'s file descriptor `fd` is now.
pub fn fd_kind(pid: u32, fd: u64) -> FdKind {
    let Ok(meta) = std::fs::metadata(format!("/proc/{pid}/fd/{fd}")) else {
        return FdKind::Unknown;
    };
    let t = meta.file_type();
    if t.is_fifo() {
        FdKind::Pipe
    } else if t.is_socket() {
        FdKind::Socket
    } else if t.is_file() {
        FdKind::File
    } else if t.is_char_device() {
        FdKind::Device
    } else {
        FdKind::Unknown
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_blocked_reading_a_pipe() {
        let (r, w) = nix::unistd::pipe().unwrap();
        let mut child = std::process::Command::new("cat")
            .stdin(std::process::Stdio::from(r))
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        // Until it has gone to sleep in its read.
        let mut seen = None;
        for _ in 0..200 {
            seen = blocked_in(pid, pid);
            if seen.is_some_and(|(nr, _)| nr == 0) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let permitted = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/syscall")).is_ok();
        let kind = fd_kind(pid, 0);
        // The write end is the child's too (not close-on-exec): it never sees the end.
        drop(w);
        let _ = child.kill();
        let _ = child.wait();
        if !permitted {
            return;
        }
        let (nr, fd) = seen.expect("blocked in read");
        assert_eq!((nr, fd), (0, 0), "read(0, …)");
        assert_eq!(kind, FdKind::Pipe);
        assert_eq!(fd_kind(std::process::id(), 99_999), FdKind::Unknown);
    }
}
