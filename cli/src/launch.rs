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
            // Forked from a single-threaded process: allocating and setting variables is safe.
            for (name, value) in read_env(&rx) {
                let value = match std::env::var_os(&name) {
                    // Another tool's injection library, set by the user, stays: tracerd then
                    // counts the command's launches with its probes.
                    Some(old) if name == "CUDA_INJECTION64_PATH" && !old.is_empty() => continue,
                    Some(old) if name == "LD_PRELOAD" && !old.is_empty() => {
                        let mut v = std::ffi::OsString::from(value);
                        v.push(":");
                        v.push(old);
                        v
                    }
                    _ => value.into(),
                };
                std::env::set_var(name, value);
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

/// The most bytes of variables the command is handed.
const ENV_BYTES: usize = 64 << 10;

/// The variables after the go byte: a u32 length, then `NAME=VALUE\0` each.
fn read_env(rx: &std::os::fd::OwnedFd) -> Vec<(String, String)> {
    let fill = |buf: &mut [u8]| {
        let mut at = 0;
        while at < buf.len() {
            match read(rx, &mut buf[at..]) {
                Ok(0) | Err(_) => return false,
                Ok(n) => at += n,
            }
        }
        true
    };
    let mut len = [0u8; 4];
    if !fill(&mut len) {
        return Vec::new();
    }
    let len = u32::from_ne_bytes(len) as usize;
    let mut buf = vec![0u8; len.min(ENV_BYTES)];
    if len > ENV_BYTES || !fill(&mut buf) {
        return Vec::new();
    }
    buf.split(|&b| b == 0)
        .filter_map(|e| std::str::from_utf8(e).ok()?.split_once('='))
        .filter(|(n, _)| !n.is_empty())
        .map(|(n, v)| (n.to_owned(), v.to_owned()))
        .collect()
}

impl Held {
    /// Lets the command exec with `env` set (LD_PRELOAD prepended to its own), and waits to
    /// learn whether it could.
    pub fn release(&mut self, env: &[tracer_proto::EnvVar]) -> Result<()> {
        let fd = self.go.take().context("released twice")?;
        let mut msg = b"g".to_vec();
        let mut vars = Vec::new();
        for v in env {
            if v.name.is_empty() || v.name.contains(['=', '\0']) || v.value.contains('\0') {
                bail!("the daemon sent a malformed variable name {:?}", v.name);
            }
            vars.extend_from_slice(format!("{}={}\0", v.name, v.value).as_bytes());
        }
        if vars.len() > ENV_BYTES {
            bail!("the daemon sent {} bytes of variables", vars.len());
        }
        msg.extend_from_slice(&(vars.len() as u32).to_ne_bytes());
        msg.extend_from_slice(&vars);
        // Into a pipe the child reads: 64 KiB at most fits its buffer, or it reads as we go.
        let mut at = 0;
        while at < msg.len() {
            at += write(&fd, &msg[at..]).context("releasing the command")?;
        }
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
        bail!("--gpu-times needs a process: a command to start (-- CMD ARGS…) or a running one (--pid PID)");
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
    // Before any other thread exists: nothing reads the environment meanwhile. Records on
    // (the library counts launches alone where a session asks only for those).
    std::env::set_var(VAR, &lib);
    std::env::set_var("TRACER_CUPTI_RECORDS", "1");
    Ok(())
}
