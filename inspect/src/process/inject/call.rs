//! The call itself: the stopped thread is made to call `dlopen(path, RTLD_NOW)` on its own
//! stack, returning through the signal frame that puts it back (`frame.rs`). tracerd follows
//! its system calls until the frame's `rt_sigreturn` is entered and lets go there; whether the
//! library loaded is then read from the process's mappings.

use std::{fs::Metadata, os::unix::fs::MetadataExt, time::Instant};

use super::{dlopen::Calls, frame, LoadError, Stop, SyscallStop, Thread, CALL_WAIT, RED_ZONE};
use crate::{pinned::Pinned, process::ProcMaps};

/// `RTLD_NOW`.
const RTLD_NOW: u64 = 2;
/// `rt_sigreturn`.
const SYS_RT_SIGRETURN: u64 = 15;

pub(super) struct Call<'a> {
    pub calls: &'a Calls,
    /// The library's path as the process sees it, and the file found there.
    pub path: &'a str,
    pub lib: &'a Metadata,
}

impl Call<'_> {
    /// Makes the call on `t`, stopped with `saved` the registers it is to resume with.
    pub(super) fn make(
        &self,
        pin: &Pinned,
        t: Thread,
        saved: libc::user_regs_struct,
    ) -> Result<(), LoadError> {
        let tid = t.tid();
        let err = |what, source| LoadError::Ptrace { what, tid, source };
        let xstate = t
            .xstate()
            .map_err(|e| err("reading the extended registers of", e))?;
        let mask = t
            .sigmask()
            .map_err(|e| err("reading the signal mask of", e))?;
        let f = frame::build(
            &saved,
            mask,
            &xstate,
            saved.rsp - RED_ZONE,
            self.path,
            self.calls.restorer,
        )
        .map_err(|what| LoadError::Call { tid, what })?;
        pin.write(f.base, &f.bytes).map_err(|e| LoadError::Call {
            tid,
            what: format!("writing its stack: {e}"),
        })?;
        let mut c = saved;
        c.rip = self.calls.dlopen;
        c.rdi = f.path_at;
        c.rsi = RTLD_NOW;
        c.rax = 0;
        c.rsp = f.ret_at;
        // No system call to restart while the call runs.
        c.orig_rax = u64::MAX;
        t.set_regs(&c)
            .map_err(|e| err("setting the registers of", e))?;
        // From here on the thread ends the call whole by itself, whatever becomes of tracerd.
        t.resume_syscalls(0).map_err(|e| err("resuming", e))?;
        let started = Instant::now();
        let mut warned = false;
        let (mut entered, mut failed) = (None, None);
        loop {
            match t
                .wait(std::time::Duration::from_secs(1))
                .map_err(|e| err("waiting for", e))?
            {
                Some(Stop::Syscall) => {
                    match t.syscall().map_err(|e| err("reading", e))? {
                        SyscallStop::Entry { nr, ip, sp } => {
                            if nr == SYS_RT_SIGRETURN
                                && ip == self.calls.sigreturn_ip()
                                && sp == f.ret_at + 8
                            {
                                break;
                            }
                            entered = Some(nr);
                        }
                        SyscallStop::Exit { rval, error } => {
                            // The call's last failed system call, to say why it did not load.
                            if let (true, Some(nr)) = (error, entered.take()) {
                                failed = Some((nr, -rval as i32));
                            }
                        }
                        SyscallStop::Other => {}
                    }
                    t.resume_syscalls(0).map_err(|e| err("resuming", e))?;
                }
                Some(Stop::Signal(
                    sig @ (libc::SIGSEGV | libc::SIGBUS | libc::SIGILL | libc::SIGFPE),
                )) => {
                    // Its own fault, at a signal stop: put back as it was, by tracerd.
                    t.set_regs(&saved)
                        .map_err(|e| err("restoring the registers of", e))?;
                    t.set_xstate(&xstate)
                        .map_err(|e| err("restoring the extended registers of", e))?;
                    t.detach(0).map_err(|e| err("detaching", e))?;
                    return Err(LoadError::Call {
                        tid,
                        what: format!("dlopen raised signal {sig}"),
                    });
                }
                // The program's own signals: their handlers run over the call and return to it.
                Some(Stop::Signal(sig)) => {
                    t.resume_syscalls(sig).map_err(|e| err("resuming", e))?
                }
                Some(Stop::Interrupted | Stop::Group) => {
                    t.resume_syscalls(0).map_err(|e| err("resuming", e))?
                }
                Some(Stop::Exited) => return Err(LoadError::Gone),
                None => {
                    if !warned && started.elapsed() >= CALL_WAIT {
                        warned = true;
                        tracing::warn!(
                            tid,
                            "dlopen has not returned after {} s",
                            CALL_WAIT.as_secs()
                        );
                    }
                }
            }
        }
        // At the frame's rt_sigreturn: let go, and the kernel puts the thread back from it.
        t.detach(0).map_err(|e| err("detaching", e))?;
        if self.loaded(pin.pid()) {
            return Ok(());
        }
        let why = match failed {
            Some((nr, errno)) => format!(
                "; its last failed system call: {} ({})",
                syscall_name(nr),
                std::io::Error::from_raw_os_error(errno)
            ),
            None => "; no system call failed (not a loadable x86-64 library?)".to_owned(),
        };
        Err(LoadError::Call {
            tid,
            what: format!("dlopen did not load it{why}"),
        })
    }

    /// Whether the process maps the library now.
    fn loaded(&self, pid: u32) -> bool {
        let dev = crate::process::device(self.lib);
        ProcMaps::read(pid).is_ok_and(|maps| {
            maps.entries().iter().any(|e| {
                e.path.strip_suffix(" (deleted)").unwrap_or(&e.path) == self.path
                    || (e.dev == dev && e.inode == self.lib.ino())
            })
        })
    }
}

/// A system call's name, for the ones loading a library makes.
fn syscall_name(nr: u64) -> String {
    match nr {
        0 => "read".into(),
        2 => "open".into(),
        5 => "fstat".into(),
        9 => "mmap".into(),
        10 => "mprotect".into(),
        17 => "pread64".into(),
        257 => "openat".into(),
        262 => "newfstatat".into(),
        _ => format!("system call {nr}"),
    }
}
