//! The call itself: the stopped thread is made to call `dlopen(path, RTLD_NOW)` on its own
//! stack, returning through the signal frame that puts it back (`frame.rs`). tracerd follows
//! its system calls until the frame's `rt_sigreturn` is entered and lets go there; whether the
//! library loaded is then read from the process's mappings.
//!
//! A call that has not returned by [`CALL_DEADLINE`] (or whose client went) is ended: where
//! it has only waited for a lock (futex waits, no other system call: it holds nothing of the
//! loader's yet), the thread is put back as it was (registers, extended registers, signal
//! mask); where it had begun loading, and so holds the loader's lock, putting it back would
//! leave that lock held for good, so it is let go to finish by itself and return through its
//! frame. Either way no thread stays traced and the load is refused with the reason.

use std::{fs::Metadata, os::unix::fs::MetadataExt, time::Instant};

use super::{
    dlopen::Calls, frame, LoadError, Stop, SyscallStop, Thread, CALL_DEADLINE, RED_ZONE, STOP_WAIT,
};
use crate::{pinned::Pinned, process::ProcMaps};

/// `RTLD_NOW`.
const RTLD_NOW: u64 = 2;
/// `rt_sigreturn`.
const SYS_RT_SIGRETURN: u64 = 15;
/// `futex`.
const SYS_FUTEX: u64 = 202;

pub(super) struct Call<'a> {
    pub calls: &'a Calls,
    /// The library's path as the process sees it, and the file found there.
    pub path: &'a str,
    pub lib: &'a Metadata,
    /// Whether the load is no longer wanted.
    pub cancelled: &'a (dyn Fn() -> bool + Sync),
}

/// The thread as it was before the call, to put it back.
struct Before<'a> {
    regs: &'a libc::user_regs_struct,
    xstate: &'a [u8],
    mask: u64,
}

/// What the thread did in the call so far.
#[derive(Default)]
struct Progress {
    /// The last system call entered, not yet left.
    entered: Option<u64>,
    /// The call's last failed system call and its errno, to say why it did not load.
    failed: Option<(u64, i32)>,
    /// It entered a system call other than a futex wait: it has begun loading.
    begun: bool,
    /// The last futex it waited on.
    futex: Option<u64>,
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
        let before = Before {
            regs: &saved,
            xstate: &xstate,
            mask,
        };
        let started = Instant::now();
        let mut p = Progress::default();
        let returned = |nr, ip, sp| {
            nr == SYS_RT_SIGRETURN && ip == self.calls.sigreturn_ip() && sp == f.ret_at + 8
        };
        loop {
            match t.wait(STOP_WAIT).map_err(|e| err("waiting for", e))? {
                Some(Stop::Syscall) => {
                    if let Some((nr, ip, sp)) = p.note(&t).map_err(|e| err("reading", e))? {
                        if returned(nr, ip, sp) {
                            break;
                        }
                    }
                    t.resume_syscalls(0).map_err(|e| err("resuming", e))?;
                }
                Some(Stop::Signal(
                    sig @ (libc::SIGSEGV | libc::SIGBUS | libc::SIGILL | libc::SIGFPE),
                )) => {
                    // Its own fault, at a signal stop: put back as it was, by tracerd.
                    put_back(t, &before, 0)?;
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
                Some(Stop::Exited | Stop::Exec) => return Err(LoadError::Gone),
                None => {
                    let cancelled = (self.cancelled)();
                    if cancelled || started.elapsed() >= CALL_DEADLINE {
                        let e = self.end(t, &before, p, cancelled, &returned);
                        tracing::warn!(pid = pin.pid(), %e, "a load into a process was ended");
                        return Err(e);
                    }
                }
            }
        }
        // At the frame's rt_sigreturn: let go, and the kernel puts the thread back from it.
        t.detach(0).map_err(|e| err("detaching", e))?;
        if self.loaded(pin.pid()) {
            return Ok(());
        }
        let why = match p.failed {
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

    /// Ends a call that overran its deadline or was cancelled: the thread stopped, and put
    /// back or let go to finish by itself (see the module's doc). The error to answer with.
    fn end(
        &self,
        t: Thread,
        before: &Before,
        mut p: Progress,
        cancelled: bool,
        returned: &dyn Fn(u64, u64, u64) -> bool,
    ) -> LoadError {
        let tid = t.tid();
        let deadline = |what: String| LoadError::Deadline {
            tid,
            ms: CALL_DEADLINE.as_millis(),
            what,
        };
        let why = if cancelled {
            "its client went"
        } else {
            "a thread of the process holds a lock dlopen needs"
        };
        if let Err(e) = t.interrupt() {
            return deadline(format!("{why}; interrupting it: {e}"));
        }
        // Up to a second for a stop where its registers may be set: the interrupt's, or a
        // signal's (delivered once it is let go). Not a system-call stop: at an entry the
        // kernel would make the call the registers name, and at an exit (which is how the
        // interrupt shows under PTRACE_SYSCALL) it would not restart the call interrupted.
        // From there it is asked again and let run to that stop.
        let mut stopped = None;
        for _ in 0..10 {
            match t.wait(STOP_WAIT) {
                Ok(Some(Stop::Interrupted | Stop::Group)) => {
                    stopped = Some(0);
                    break;
                }
                Ok(Some(Stop::Signal(sig))) => {
                    stopped = Some(sig);
                    break;
                }
                Ok(Some(Stop::Syscall)) => match p.note(&t) {
                    Ok(Some((nr, ip, sp))) if returned(nr, ip, sp) => {
                        // It returned just now: let go at its own rt_sigreturn.
                        let _ = t.detach(0);
                        return deadline(format!("{why}; it returned as it was ended"));
                    }
                    _ => {
                        let _ = t.interrupt();
                        let _ = t.resume(0);
                    }
                },
                Ok(Some(Stop::Exited | Stop::Exec)) | Err(_) => return LoadError::Gone,
                Ok(None) => {}
            }
        }
        let Some(sig) = stopped else {
            // Dropping it detaches it at its next stop.
            return deadline(format!("{why}; it did not stop when asked"));
        };
        let futex = p
            .futex
            .map_or(String::new(), |a| format!(" (futex {a:#x})"));
        if p.begun {
            return match t.detach(sig) {
                Ok(()) => deadline(format!(
                    "{why}{futex}; it had begun loading, so it holds the loader's lock: it is let go to finish by itself and return to where it was"
                )),
                Err(e) => deadline(format!("{why}; detaching: {e}")),
            };
        }
        match put_back(t, before, sig) {
            Ok(()) => deadline(format!(
                "{why}{futex}; it had only waited for that lock, and is put back as it was"
            )),
            Err(e) => deadline(format!("{why}; putting it back: {e}")),
        }
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

impl Progress {
    /// Notes a system-call stop of the call: the entry's (number, ip, sp), None at an exit.
    fn note(&mut self, t: &Thread) -> std::io::Result<Option<(u64, u64, u64)>> {
        Ok(match t.syscall()? {
            SyscallStop::Entry { nr, ip, sp, arg0 } => {
                if nr == SYS_FUTEX {
                    self.futex = Some(arg0);
                } else if nr != SYS_RT_SIGRETURN {
                    self.begun = true;
                }
                self.entered = Some(nr);
                Some((nr, ip, sp))
            }
            SyscallStop::Exit { rval, error } => {
                if let (true, Some(nr)) = (error, self.entered.take()) {
                    self.failed = Some((nr, -rval as i32));
                }
                None
            }
            SyscallStop::Other => None,
        })
    }
}

/// Puts the stopped thread back as it was before the call and lets it go with `signal`.
fn put_back(t: Thread, before: &Before, signal: i32) -> Result<(), LoadError> {
    let tid = t.tid();
    let err = |what, source| LoadError::Ptrace { what, tid, source };
    t.set_regs(before.regs)
        .map_err(|e| err("restoring the registers of", e))?;
    t.set_xstate(before.xstate)
        .map_err(|e| err("restoring the extended registers of", e))?;
    t.set_sigmask(before.mask)
        .map_err(|e| err("restoring the signal mask of", e))?;
    t.detach(signal).map_err(|e| err("detaching", e))
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
