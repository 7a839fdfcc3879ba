//! `tracerctl start … -- CMD`: the command is forked and held before its exec until the
//! session is attached, so nothing it does escapes the session.

use std::ffi::CString;

use anyhow::{bail, Context, Result};
use nix::{
    fcntl::OFlag,
    sys::{
        signal::{kill, Signal},
        wait::{waitpid, WaitStatus},
    },
    unistd::{fork, pipe, pipe2, read, write, ForkResult, Pid},
};

/// A forked child blocked before `execvp(cmd)`.
pub struct Held {
    pub pid: Pid,
    go: Option<std::os::fd::OwnedFd>,
    /// Closed by a successful exec; a failed one writes its errno there first.
    exec_error: std::os::fd::OwnedFd,
    program: String,
}

/// Forks. Must be called while the process is single-threaded (before the tokio runtime).
pub fn hold(cmd: &[String]) -> Result<Held> {
    let args: Vec<CString> = cmd
        .iter()
        .map(|a| CString::new(a.as_str()))
        .collect::<Result<_, _>>()
        .context("command has a NUL byte")?;
    let (rx, tx) = pipe().context("pipe")?;
    let (err_rx, err_tx) = pipe2(OFlag::O_CLOEXEC).context("pipe")?;
    // SAFETY: single-threaded here; the child only calls async-signal-safe functions before exec.
    match unsafe { fork() }.context("fork")? {
        ForkResult::Child => {
            drop(tx);
            drop(err_rx);
            let mut byte = [0u8; 1];
            // EOF without a byte: the parent gave up (session refused); do not run the command.
            if !matches!(read(&rx, &mut byte), Ok(1)) {
                // SAFETY: _exit is async-signal-safe.
                unsafe { libc::_exit(125) };
            }
            let err = nix::unistd::execvp(&args[0], &args).unwrap_err();
            // The parent says it, in its one line of error.
            let _ = write(&err_tx, &(err as i32).to_ne_bytes());
            // SAFETY: _exit skips the parent's atexit handlers and buffers, as a failed exec should.
            unsafe { libc::_exit(127) }
        }
        ForkResult::Parent { child } => {
            drop(rx);
            drop(err_tx);
            Ok(Held {
                pid: child,
                go: Some(tx),
                exec_error: err_rx,
                program: cmd[0].clone(),
            })
        }
    }
}

impl Held {
    /// Lets the command exec, and waits to learn whether it could.
    pub fn release(&mut self) -> Result<()> {
        let fd = self.go.take().context("released twice")?;
        write(&fd, b"g").context("releasing the command")?;
        let mut errno = [0u8; 4];
        let n = loop {
            match read(&self.exec_error, &mut errno) {
                Err(nix::errno::Errno::EINTR) => continue,
                r => break r.unwrap_or(0),
            }
        };
        if n == errno.len() {
            let _ = waitpid(self.pid, None);
            let e = std::io::Error::from_raw_os_error(i32::from_ne_bytes(errno));
            bail!("cannot run '{}': {e}", self.program);
        }
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

/// The file CUDA's driver loads into a process whose environment names it.
const INJECTION: &str = "libtracer_cupti.so";

/// `--gpu-times`: the command will run with tracer's CUPTI injection library, found beside
/// tracerctl (as `cargo build` leaves it) or in `../lib/tracer/` (an installed layout).
/// Called before the fork, while single-threaded, so that the command inherits the variable.
pub fn inject_cupti(cmd: &[String]) -> Result<()> {
    const VAR: &str = "CUDA_INJECTION64_PATH";
    if cmd.is_empty() {
        bail!("--gpu-times needs a command to start (-- CMD ARGS…): CUDA loads the injection library only at a process's start");
    }
    let exe = std::env::current_exe().context("finding tracerctl's own path")?;
    let dir = exe.parent().context("tracerctl's directory")?;
    let candidates = [
        dir.join(INJECTION),
        dir.join("../lib/tracer").join(INJECTION),
    ];
    let Some(lib) = candidates.iter().find(|p| p.is_file()) else {
        bail!(
            "--gpu-times: {INJECTION} not found at {} or {} (cargo build --release builds it beside tracerctl)",
            candidates[0].display(),
            candidates[1].display()
        );
    };
    let lib = lib
        .canonicalize()
        .context("resolving the injection library's path")?;
    match std::env::var_os(VAR) {
        Some(v) if std::path::Path::new(&v) != lib => bail!(
            "--gpu-times: {VAR} is already set ({}): a process takes one injection library",
            v.to_string_lossy()
        ),
        _ => {}
    }
    // Before any other thread exists: nothing reads the environment meanwhile.
    std::env::set_var(VAR, &lib);
    Ok(())
}
