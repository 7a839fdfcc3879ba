//! `tracerctl start … -- CMD`: the command is forked and held before its exec until the
//! session is attached, so nothing it does escapes the session.

use std::ffi::CString;

use anyhow::{Context, Result};
use nix::{
    sys::{
        signal::{kill, Signal},
        wait::{waitpid, WaitStatus},
    },
    unistd::{fork, pipe, read, write, ForkResult, Pid},
};

/// A forked child blocked before `execvp(cmd)`.
pub struct Held {
    pub pid: Pid,
    go: Option<std::os::fd::OwnedFd>,
}

/// Forks. Must be called while the process is single-threaded (before the tokio runtime).
pub fn hold(cmd: &[String]) -> Result<Held> {
    let args: Vec<CString> = cmd
        .iter()
        .map(|a| CString::new(a.as_str()))
        .collect::<Result<_, _>>()
        .context("command has a NUL byte")?;
    let (rx, tx) = pipe().context("pipe")?;
    // SAFETY: single-threaded here; the child only calls async-signal-safe functions before exec.
    match unsafe { fork() }.context("fork")? {
        ForkResult::Child => {
            drop(tx);
            let mut byte = [0u8; 1];
            // EOF without a byte: the parent gave up (session refused); do not run the command.
            if !matches!(read(&rx, &mut byte), Ok(1)) {
                // SAFETY: _exit is async-signal-safe.
                unsafe { libc::_exit(125) };
            }
            let err = nix::unistd::execvp(&args[0], &args).unwrap_err();
            // Forked from a single-threaded process: formatting and printing are safe here.
            eprintln!(
                "tracerctl: cannot run '{}': {}",
                cmd[0],
                std::io::Error::from(err)
            );
            // SAFETY: _exit skips the parent's atexit handlers and buffers, as a failed exec should.
            unsafe { libc::_exit(127) }
        }
        ForkResult::Parent { child } => {
            drop(rx);
            Ok(Held {
                pid: child,
                go: Some(tx),
            })
        }
    }
}

impl Held {
    /// Lets the command exec.
    pub fn release(&mut self) -> Result<()> {
        let fd = self.go.take().context("released twice")?;
        write(&fd, b"g").context("releasing the command")?;
        Ok(())
    }

    /// Kills a command that never ran.
    pub fn abandon(mut self) {
        self.go = None;
        let _ = kill(self.pid, Signal::SIGKILL);
        let _ = waitpid(self.pid, None);
    }
}

/// Waits for the command; its exit code, or 128+signal as shells report it.
pub fn wait(pid: Pid) -> i32 {
    loop {
        match waitpid(pid, None) {
            Ok(WaitStatus::Exited(_, code)) => return code,
            Ok(WaitStatus::Signaled(_, sig, _)) => return 128 + sig as i32,
            Ok(_) => continue,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return 1,
        }
    }
}
