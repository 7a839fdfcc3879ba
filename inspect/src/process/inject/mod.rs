//! Loading a shared library into a running process the way debuggers do: one thread is
//! stopped with ptrace at a point where the C library holds no lock of its own, made to call
//! `dlopen` on a path, and put back exactly as it was: its registers (general, FPU, SSE,
//! AVX), and a system call it was blocked in restarted as if nothing had happened (the
//! program sees no `EINTR`).
//!
//! What was checked of the process (the caller's right to load into it) is asked again once a
//! thread is stopped, before anything is written: the pin taken before the first check must
//! still name the process, running the same program in the same address space
//! ([`Pinned::unchanged`]). A program exec'd in between (a setuid one) is never loaded into.
//! The call has a deadline ([`CALL_DEADLINE`]); no thread is left traced after it.
//!
//! The library's constructor does the rest, on a thread of its own. The thread stopped is
//! chosen among those blocked in a system call first (they hold no lock the loader needs,
//! unless blocked in the loader's own calls, which are passed over);
//! a running one is taken only where it was stopped outside the C library, the dynamic
//! loader and the C++ runtime (their code may hold the locks `dlopen` and `malloc` take).
//!
//! `dlopen` returns through a signal frame written on the thread's stack (`frame.rs`), so the
//! thread puts itself back: tracerd only watches the call's system calls, sees the
//! `rt_sigreturn` that ends it, and lets go. If tracerd dies while the thread is stopped, the
//! kernel lets it go as it was; if it dies during the call, the call ends the same way
//! without it.

mod call;
mod dlopen;
mod frame;
mod thread;

use std::{
    fs,
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use call::Call;
use frame::RESTART_CODES;
use thread::{Stop, SyscallStop, Thread};

use super::ProcMaps;
use crate::pinned::{Image, Pinned};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("loading a library with ptrace is done on x86-64 only")]
    Architecture,
    #[error("kernel.yama.ptrace_scope is 3: no process may be traced on this machine")]
    YamaForbids,
    #[error("it is already traced by pid {tracer} ({comm}): a debugger or strace holds it")]
    Traced { tracer: u32, comm: String },
    #[error(
        "it is stopped (job control, or held at an exec): a stopped process is not loaded into"
    )]
    Stopped,
    #[error("it runs with x86 shadow stacks (CET), which a call made for it would break")]
    ShadowStack,
    #[error("library {path}: {source}")]
    Library {
        path: String,
        source: std::io::Error,
    },
    #[error("it exited")]
    Gone,
    #[error("{0}")]
    NoDlopen(String),
    #[error("library path {0:?} is empty, too long or holds a NUL byte")]
    BadPath(String),
    #[error("no thread stopped where loading is safe within {0} ms (every one was in the C library or the dynamic loader)")]
    NoSafePoint(u128),
    #[error("ptrace {what} thread {tid}: {source}")]
    Ptrace {
        what: &'static str,
        tid: u32,
        source: std::io::Error,
    },
    #[error("thread {tid}: {what}")]
    Call { tid: u32, what: String },
    /// The check made on the stopped process failed: nothing was touched.
    #[error("refused once a thread of it was stopped: {0}")]
    Refused(String),
    #[error("it executed another program since it was checked")]
    Execd,
    #[error("the load was cancelled (its client went)")]
    Cancelled,
    #[error("thread {tid}: dlopen did not return within {ms} ms ({what})")]
    Deadline { tid: u32, ms: u128, what: String },
}

/// How long a thread may take to reach the stop asked of it.
const STOP_WAIT: Duration = Duration::from_millis(100);
/// How long `dlopen` may take: it waits only for locks other threads hold briefly, and the
/// libraries loaded do their work on threads of their own.
const CALL_DEADLINE: Duration = Duration::from_secs(5);
/// Bytes skipped below the thread's stack pointer: the x86-64 red zone and a margin.
const RED_ZONE: u64 = 256;
/// Basenames of code besides the dynamic loader's ([`is_loader`]) that may hold the locks
/// `dlopen` takes (malloc's) or run under them (unwinding's `dl_iterate_phdr` callbacks).
const LOCKING_CODE: [&str; 5] = ["libc.so", "libc-", "libdl", "libpthread", "libgcc_s"];

/// Whether `base` is the dynamic loader's basename: `ld-linux-*.so`, or old glibc's `ld-2.X.so`.
fn is_loader(base: &str) -> bool {
    base.starts_with("ld-linux") || base.starts_with("ld-2.")
}

/// Whether code of the file named `base` may hold the locks `dlopen` takes or run under them.
fn may_hold_locks(base: &str) -> bool {
    is_loader(base) || LOCKING_CODE.iter().any(|l| base.starts_with(l))
}

/// One load: what it is for and what bounds it.
pub struct Load<'a> {
    /// The process, pinned before the caller checked it: the load reaches that process
    /// running that program, or nothing.
    pub pin: &'a Pinned,
    /// The library's path, as the process sees it.
    pub path: &'a str,
    /// How long a thread may take to stop where loading is safe.
    pub wait: Duration,
    /// The caller's right to have code loaded into the process, asked again of the process
    /// once a thread of it is stopped, before any register or memory is touched.
    pub check: &'a (dyn Fn(u32) -> Result<(), String> + Sync),
    /// Whether the load is no longer wanted (its client went): it ends as the deadline does.
    pub cancelled: &'a (dyn Fn() -> bool + Sync),
}

/// What became of loads since tracerd started, by outcome (for its metrics): loaded; refused
/// on the stopped process (another program, or the caller's right gone); ended at the
/// deadline; ended as the client went; failed otherwise.
static OUTCOMES: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];
/// [`OUTCOMES`]' names.
const OUTCOME_NAMES: [&str; 5] = ["loaded", "refused", "deadline", "cancelled", "failed"];

/// Loads since tracerd started, by outcome.
pub fn outcomes() -> impl Iterator<Item = (&'static str, u64)> {
    OUTCOME_NAMES
        .into_iter()
        .zip(OUTCOMES.iter().map(|n| n.load(Ordering::Relaxed)))
}

impl Load<'_> {
    /// Loads the library into the pinned process.
    pub fn run(&self) -> Result<(), LoadError> {
        let r = load_on(self, None).map_err(|e| self.why(e));
        let outcome = match &r {
            Ok(()) => 0,
            Err(LoadError::Refused(_) | LoadError::Execd) => 1,
            Err(LoadError::Deadline { .. }) if !(self.cancelled)() => 2,
            Err(LoadError::Deadline { .. } | LoadError::Cancelled) => 3,
            Err(_) => 4,
        };
        OUTCOMES[outcome].fetch_add(1, Ordering::Relaxed);
        r
    }

    /// `e`, or the reason behind it where the process executed another program meanwhile
    /// (its threads killed by the exec, its libraries gone: ptrace's own errors say less).
    fn why(&self, e: LoadError) -> LoadError {
        match e {
            LoadError::Refused(_) | LoadError::Cancelled | LoadError::Deadline { .. } => e,
            e => match Image::of(self.pin.pid()) {
                Ok(now) if now != self.pin.image() => LoadError::Execd,
                _ => e,
            },
        }
    }
}

/// [`Load::run`], on thread `only` where given.
fn load_on(load: &Load, only: Option<u32>) -> Result<(), LoadError> {
    let (pin, path) = (load.pin, load.path);
    let pid = pin.pid();
    if !cfg!(target_arch = "x86_64") {
        return Err(LoadError::Architecture);
    }
    if crate::process::yama_ptrace_scope() >= 3 {
        return Err(LoadError::YamaForbids);
    }
    if path.is_empty() || path.len() >= 4096 || path.contains('\0') {
        return Err(LoadError::BadPath(path.to_owned()));
    }
    check_status(pid)?;
    if !pin.alive() {
        return Err(LoadError::Gone);
    }
    let maps = ProcMaps::read(pid).map_err(|_| LoadError::Gone)?;
    let calls = dlopen::find(pid, &maps).map_err(LoadError::NoDlopen)?;
    // The file as the process sees it, to know it loaded.
    let lib =
        fs::metadata(format!("/proc/{pid}/root{path}")).map_err(|source| LoadError::Library {
            path: path.to_owned(),
            source,
        })?;
    let started = Instant::now();
    loop {
        let tids = match only {
            Some(tid) => vec![tid],
            None => candidates(pid),
        };
        for tid in tids {
            let Some((t, regs)) = stop(pid, tid)? else {
                continue;
            };
            // Stopped: from here until it is let go, the process can change its program only
            // by another thread's exec, which kills this one (and every ptrace call after).
            if let Err(why) = pin.unchanged(regs.rip).and_then(|()| (load.check)(pid)) {
                // Said here too: the caller may fall back (to uprobes) and say less.
                tracing::warn!(pid, tid, %why, "load refused on the stopped process");
                t.detach(0).map_err(|source| LoadError::Ptrace {
                    what: "detaching",
                    tid,
                    source,
                })?;
                return Err(LoadError::Refused(why));
            }
            let Some(saved) = resumable(pin, &maps, &regs) else {
                t.detach(0).map_err(|source| LoadError::Ptrace {
                    what: "detaching",
                    tid,
                    source,
                })?;
                continue;
            };
            let call = Call {
                calls: &calls,
                path,
                lib: &lib,
                cancelled: load.cancelled,
            };
            return call.make(pin, t, saved);
        }
        if !pin.alive() {
            return Err(LoadError::Gone);
        }
        if (load.cancelled)() {
            return Err(LoadError::Cancelled);
        }
        if started.elapsed() >= load.wait {
            return Err(LoadError::NoSafePoint(load.wait.as_millis()));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Refuses a process already traced or stopped.
fn check_status(pid: u32) -> Result<(), LoadError> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).map_err(|_| LoadError::Gone)?;
    let field = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .map(str::trim)
            .unwrap_or_default()
            .to_owned()
    };
    let tracer: u32 = field("TracerPid:").parse().unwrap_or(0);
    if tracer != 0 {
        // TracerPid names the tracing thread.
        let tracer = super::tgid(tracer).unwrap_or(tracer);
        let comm = super::comm(tracer).unwrap_or_else(|| "?".into());
        return Err(LoadError::Traced { tracer, comm });
    }
    if field("State:").starts_with('T') || field("State:").starts_with('t') {
        return Err(LoadError::Stopped);
    }
    if field("x86_Thread_features:")
        .split_whitespace()
        .any(|f| f == "shstk")
    {
        return Err(LoadError::ShadowStack);
    }
    Ok(())
}

/// The threads to try, best first: sleeping ones (in a system call, holding no lock of the
/// loader's) before running ones, the main thread first of each; none in uninterruptible
/// sleep (it could not stop in time).
fn candidates(pid: u32) -> Vec<u32> {
    let mut out: Vec<(u8, bool, u32)> = super::threads(pid)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|tid| {
            let stat = fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
            let state = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .next()?
                .to_owned();
            let rank = match state.as_str() {
                "S" => 0,
                "R" => 1,
                _ => return None,
            };
            Some((rank, tid != pid, tid))
        })
        .collect();
    out.sort_unstable();
    out.into_iter().take(64).map(|(_, _, tid)| tid).collect()
}

/// Seizes and stops `tid`; None if it went meanwhile.
fn stop(pid: u32, tid: u32) -> Result<Option<(Thread, libc::user_regs_struct)>, LoadError> {
    let t = match Thread::seize(tid) {
        Ok(t) => t,
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Ok(None),
        Err(source) => {
            check_status(pid)?;
            return Err(LoadError::Ptrace {
                what: "seizing",
                tid,
                source,
            });
        }
    };
    let err = |what, source| LoadError::Ptrace { what, tid, source };
    t.interrupt().map_err(|e| err("interrupting", e))?;
    // Signals that arrive first go on to the program; the stop asked for follows them.
    for _ in 0..64 {
        match t.wait(STOP_WAIT).map_err(|e| err("waiting for", e))? {
            Some(Stop::Interrupted) => {
                let regs = t.regs().map_err(|e| err("reading the registers of", e))?;
                return Ok(Some((t, regs)));
            }
            Some(Stop::Signal(sig)) => t.resume(sig).map_err(|e| err("resuming", e))?,
            Some(Stop::Syscall) => t.resume(0).map_err(|e| err("resuming", e))?,
            Some(Stop::Group) => {
                t.detach(0).map_err(|e| err("detaching", e))?;
                return Err(LoadError::Stopped);
            }
            Some(Stop::Exited) => return Ok(None),
            Some(Stop::Exec) => {
                t.detach(0).map_err(|e| err("detaching", e))?;
                return Err(LoadError::Refused(
                    "it executed a program as it was being stopped".into(),
                ));
            }
            // Dropped: detached once it stops.
            None => return Ok(None),
        }
    }
    Ok(None)
}

/// The registers the thread is to resume with, if it stopped where loading is safe: in a
/// system call (rewound to restart where the kernel would not restart it itself, so that
/// the program sees no `EINTR`), or outside code that may hold the loader's locks.
fn resumable(
    pin: &Pinned,
    maps: &ProcMaps,
    regs: &libc::user_regs_struct,
) -> Option<libc::user_regs_struct> {
    // The basename of the file whose code it stopped in.
    let here = maps
        .find(regs.rip)
        .and_then(|e| e.path.rsplit('/').next())
        .unwrap_or_default();
    // The dynamic loader makes its own system calls (reading a library it maps): blocked
    // there, the thread holds the loader's lock, which a nested dlopen would re-enter.
    if is_loader(here) {
        return None;
    }
    let in_syscall = regs.orig_rax as i64 >= 0;
    let rax = regs.rax as i64;
    if in_syscall && RESTART_CODES.contains(&rax) {
        return Some(*regs);
    }
    if in_syscall && rax == -(libc::EINTR as i64) && after_syscall(pin, regs.rip) {
        // epoll_wait, sigtimedwait and a few others return EINTR to a stop, handler or not.
        let mut r = *regs;
        r.rax = r.orig_rax;
        r.rip -= 2;
        return Some(r);
    }
    (!may_hold_locks(here)).then_some(*regs)
}

/// Whether the two bytes before `rip` are a `syscall` instruction.
fn after_syscall(pin: &Pinned, rip: u64) -> bool {
    let mut b = [0u8; 2];
    rip >= 2 && pin.read(rip - 2, &mut b).is_ok() && b == [0x0f, 0x05]
}

#[cfg(test)]
mod tests;
