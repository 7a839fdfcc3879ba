//! tracerd's guardian: a small process that outlives a killed tracerd just long enough to
//! continue the processes tracer stopped at exec (sessions that follow processes hold each
//! exec until tracerd has looked at the new program) or at their mapping of a CUDA library
//! (until tracerd has probed it).
//!
//! The BPF program records each stop in the `HELD` map, and tracerd deletes the pid as it
//! continues the process. The guardian holds the same map and waits for tracerd to exit,
//! however it goes. Only then, with every file of tracerd closed and its exec tracepoint gone
//! with them, does it continue every process the map still names: a process continued
//! earlier could exec again and be stopped again, with nobody left to continue it.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    process::{Command, Stdio},
};

/// The guardian's argument: `--guard-held TRACERD_PID,MAP_FD`.
pub const ARG: &str = "--guard-held";

/// Starts the guardian (this executable again) with `held`, an fd of the `HELD` map. It
/// lives until shortly after tracerd.
pub fn spawn(held: OwnedFd) -> io::Result<()> {
    let map_fd = held.as_raw_fd();
    let mut cmd = Command::new("/proc/self/exe");
    std::os::unix::process::CommandExt::arg0(&mut cmd, "tracerd");
    cmd.arg(ARG)
        .arg(format!("{},{map_fd}", std::process::id()))
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    // SAFETY: only async-signal-safe calls between fork and exec. The map's fd is kept
    // across the exec; a session of its own keeps a terminal's signals away.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
            if libc::fcntl(map_fd, libc::F_SETFD, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
            libc::setsid();
            Ok(())
        });
    }
    // Not waited for: it waits for tracerd. Whoever adopts it then reaps it.
    cmd.spawn()?;
    Ok(())
}

/// The guardian's life: waits for tracerd to be gone, continues what it left stopped,
/// exits; returns how many it continued. `args`: `TRACERD_PID,MAP_FD`.
pub fn run(args: &str) -> Result<usize, String> {
    let parse = |s: Option<&str>| -> Result<RawFd, String> {
        s.and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("{ARG} takes TRACERD_PID,MAP_FD, not {args:?}"))
    };
    let mut parts = args.split(',');
    let (tracerd, map_fd) = (parse(parts.next())?, parse(parts.next())?);
    // SAFETY: tracerd handed this fd over, open, to this process alone.
    let map = unsafe { OwnedFd::from_raw_fd(map_fd) };
    // SAFETY: ignoring signals has no preconditions. A service manager's SIGTERM for the
    // whole group must not end the guardian before tracerd is gone.
    unsafe {
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
    }
    wait_for_exit(tracerd)?;
    let map = aya::maps::MapData::from_fd(map).map_err(|e| e.to_string())?;
    let map = aya::maps::Map::from_map_data(map).map_err(|e| e.to_string())?;
    let held: aya::maps::HashMap<_, u32, u64> =
        aya::maps::HashMap::try_from(map).map_err(|e| e.to_string())?;
    let pids: Vec<u32> = held.keys().filter_map(Result::ok).collect();
    for &pid in &pids {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGCONT,
        );
    }
    Ok(pids.len())
}

/// Returns once process `pid`, this process's parent, has exited: its pidfd reads as ready
/// once the process is a zombie, its files closed.
fn wait_for_exit(pid: RawFd) -> Result<(), String> {
    // SAFETY: pidfd_open takes a pid and flags, and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ESRCH) {
            return Ok(());
        }
        // A kernel without pidfds: watch for being adopted.
        while nix::unistd::getppid().as_raw() == pid {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        return Ok(());
    }
    // SAFETY: the fd was just created, for this process alone.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    if nix::unistd::getppid().as_raw() != pid {
        // tracerd died before the pidfd was opened: the pid may name another process now.
        return Ok(());
    }
    let mut poll = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut poll, 1, -1) } > 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(format!("waiting for tracerd: {e}"));
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn bad_arguments_are_named_before_anything_is_done() {
        for bad in ["", "7", "7,x", "pid,3"] {
            let e = super::run(bad).unwrap_err();
            assert!(
                e.contains("--guard-held takes TRACERD_PID,MAP_FD"),
                "{bad}: {e}"
            );
        }
    }
}
