//! One thread under ptrace (`PTRACE_SEIZE`): stopped, its registers read and written, and let
//! go. Every call must come from the thread that seized it (ptrace binds a tracee to one
//! tracer thread). Dropping it detaches: a thread is never left stopped by an error path, and
//! if tracerd dies the kernel detaches it.

use std::{io, time::Duration, time::Instant};

use libc::{c_long, c_void, pid_t, user_regs_struct};

/// `NT_X86_XSTATE`: the FPU, SSE, AVX and later register state, which a call clobbers.
const NT_X86_XSTATE: c_long = 0x202;
/// Room for the largest XSAVE area (AMX tiles included).
const XSTATE_BYTES: usize = 16 << 10;

/// How a wait for a stop ended.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Stop {
    /// `PTRACE_INTERRUPT`'s stop.
    Interrupted,
    /// A group stop (the process was stopped by SIGSTOP or the like).
    Group,
    /// A signal about to be delivered.
    Signal(i32),
    /// Entering or leaving a system call (after [`Thread::resume_syscalls`]).
    Syscall,
    /// It executed a program (`PTRACE_EVENT_EXEC`): what was checked of it is stale.
    Exec,
    Exited,
}

/// What a [`Stop::Syscall`] stopped at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SyscallStop {
    /// Entering system call `nr`, from the instruction before `ip`, with stack pointer `sp`.
    Entry {
        nr: u64,
        ip: u64,
        sp: u64,
        /// Its first argument.
        arg0: u64,
    },
    /// Leaving one, with `rval` (a negated errno where `error`).
    Exit {
        rval: i64,
        error: bool,
    },
    Other,
}

pub(super) struct Thread {
    tid: pid_t,
    attached: bool,
}

fn ptrace(req: libc::c_uint, tid: pid_t, addr: usize, data: usize) -> io::Result<c_long> {
    // SAFETY: ptrace requests whose pointers, where there are any, are valid for the call.
    let r = unsafe { libc::ptrace(req, tid, addr as *mut c_void, data as *mut c_void) };
    if r == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

impl Thread {
    /// Seizes `tid` without stopping it.
    pub(super) fn seize(tid: u32) -> io::Result<Self> {
        let tid = tid as pid_t;
        // TRACESYSGOOD: system-call stops are told apart from a real SIGTRAP. TRACEEXEC: an
        // exec between the seize and the stop shows as a stop of its own.
        ptrace(
            libc::PTRACE_SEIZE,
            tid,
            0,
            (libc::PTRACE_O_TRACESYSGOOD | libc::PTRACE_O_TRACEEXEC) as usize,
        )?;
        Ok(Self {
            tid,
            attached: true,
        })
    }

    pub(super) fn tid(&self) -> u32 {
        self.tid as u32
    }

    /// Asks it to stop (it stops at its next return to user space, a blocking system call
    /// being interrupted for it).
    pub(super) fn interrupt(&self) -> io::Result<()> {
        ptrace(libc::PTRACE_INTERRUPT, self.tid, 0, 0).map(drop)
    }

    /// Waits for its next stop, up to `limit`; Ok(None) when none came.
    pub(super) fn wait(&self, limit: Duration) -> io::Result<Option<Stop>> {
        let started = Instant::now();
        loop {
            let mut status = 0;
            // SAFETY: waitpid on a traced thread, with a valid status pointer.
            let r = unsafe { libc::waitpid(self.tid, &mut status, libc::__WALL | libc::WNOHANG) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return Err(e);
            }
            if r == self.tid {
                if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
                    return Ok(Some(Stop::Exited));
                }
                if libc::WIFSTOPPED(status) {
                    let sig = libc::WSTOPSIG(status);
                    return Ok(Some(if status >> 16 == libc::PTRACE_EVENT_EXEC {
                        Stop::Exec
                    } else if status >> 16 == libc::PTRACE_EVENT_STOP {
                        if sig == libc::SIGTRAP {
                            Stop::Interrupted
                        } else {
                            Stop::Group
                        }
                    } else if sig == libc::SIGTRAP | 0x80 {
                        Stop::Syscall
                    } else {
                        Stop::Signal(sig)
                    }));
                }
                continue;
            }
            if started.elapsed() >= limit {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Resumes it, delivering `signal` (0: none).
    pub(super) fn resume(&self, signal: i32) -> io::Result<()> {
        ptrace(libc::PTRACE_CONT, self.tid, 0, signal as usize).map(drop)
    }

    /// Resumes it up to its next system-call entry or exit, delivering `signal` (0: none).
    pub(super) fn resume_syscalls(&self, signal: i32) -> io::Result<()> {
        ptrace(libc::PTRACE_SYSCALL, self.tid, 0, signal as usize).map(drop)
    }

    /// At a [`Stop::Syscall`]: which one, and where.
    pub(super) fn syscall(&self) -> io::Result<SyscallStop> {
        // struct ptrace_syscall_info: op, pad, arch, ip, sp, then entry {nr, args}
        // or exit {rval, is_error}.
        let mut info = [0u64; 11];
        ptrace(
            libc::PTRACE_GET_SYSCALL_INFO,
            self.tid,
            std::mem::size_of_val(&info),
            info.as_mut_ptr() as usize,
        )?;
        let (ip, sp) = (info[1], info[2]);
        Ok(match info[0] & 0xff {
            1 => SyscallStop::Entry {
                nr: info[3],
                ip,
                sp,
                arg0: info[4],
            },
            2 => SyscallStop::Exit {
                rval: info[3] as i64,
                error: info[4] & 0xff != 0,
            },
            _ => SyscallStop::Other,
        })
    }

    /// The signals it blocks.
    pub(super) fn sigmask(&self) -> io::Result<u64> {
        let mut mask = 0u64;
        ptrace(
            libc::PTRACE_GETSIGMASK,
            self.tid,
            std::mem::size_of::<u64>(),
            &mut mask as *mut u64 as usize,
        )?;
        Ok(mask)
    }

    /// Sets the signals it blocks.
    pub(super) fn set_sigmask(&self, mask: u64) -> io::Result<()> {
        ptrace(
            libc::PTRACE_SETSIGMASK,
            self.tid,
            std::mem::size_of::<u64>(),
            &mask as *const u64 as usize,
        )
        .map(drop)
    }

    pub(super) fn regs(&self) -> io::Result<user_regs_struct> {
        // SAFETY: all-zero is a valid user_regs_struct; the kernel fills it.
        let mut r: user_regs_struct = unsafe { std::mem::zeroed() };
        ptrace(
            libc::PTRACE_GETREGS,
            self.tid,
            0,
            &mut r as *mut user_regs_struct as usize,
        )?;
        Ok(r)
    }

    pub(super) fn set_regs(&self, r: &user_regs_struct) -> io::Result<()> {
        ptrace(
            libc::PTRACE_SETREGS,
            self.tid,
            0,
            r as *const user_regs_struct as usize,
        )
        .map(drop)
    }

    /// The extended register state (x87, SSE, AVX, ...), as big as this CPU's.
    pub(super) fn xstate(&self) -> io::Result<Vec<u8>> {
        let mut buf = vec![0u8; XSTATE_BYTES];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        ptrace(
            libc::PTRACE_GETREGSET,
            self.tid,
            NT_X86_XSTATE as usize,
            &mut iov as *mut libc::iovec as usize,
        )?;
        buf.truncate(iov.iov_len);
        Ok(buf)
    }

    pub(super) fn set_xstate(&self, state: &[u8]) -> io::Result<()> {
        let mut iov = libc::iovec {
            iov_base: state.as_ptr() as *mut c_void,
            iov_len: state.len(),
        };
        ptrace(
            libc::PTRACE_SETREGSET,
            self.tid,
            NT_X86_XSTATE as usize,
            &mut iov as *mut libc::iovec as usize,
        )
        .map(drop)
    }

    /// Lets it go from a stop, delivering `signal` (0: none).
    pub(super) fn detach(mut self, signal: i32) -> io::Result<()> {
        self.attached = false;
        ptrace(libc::PTRACE_DETACH, self.tid, 0, signal as usize).map(drop)
    }
}

impl Drop for Thread {
    fn drop(&mut self) {
        if !self.attached {
            return;
        }
        // Running, it cannot be detached: it is let go at its next stop (a thread in
        // uninterruptible sleep stops when that ends). A thread that exited needs nothing.
        if ptrace(libc::PTRACE_DETACH, self.tid, 0, 0).is_ok()
            || ptrace(libc::PTRACE_INTERRUPT, self.tid, 0, 0).is_err()
        {
            return;
        }
        for _ in 0..60 {
            match self.wait(Duration::from_secs(1)) {
                Ok(Some(Stop::Signal(sig))) => {
                    let _ = ptrace(libc::PTRACE_DETACH, self.tid, 0, sig as usize);
                    return;
                }
                Ok(Some(Stop::Exited)) | Err(_) => return,
                Ok(Some(_)) => {
                    let _ = ptrace(libc::PTRACE_DETACH, self.tid, 0, 0);
                    return;
                }
                Ok(None) => {}
            }
        }
        tracing::warn!(
            tid = self.tid,
            "a thread tracer stopped has not stopped in 60 s"
        );
    }
}
