//! A counts file belongs to the counted process's user, who can shrink it under tracerd's
//! mapping: touching a page past its end raises SIGBUS. For addresses inside a guarded
//! mapping, the handler puts a private zero page there and lets the access run again (the
//! counts read as zeros); any other SIGBUS goes to the handler installed before.

use std::sync::{
    atomic::{AtomicUsize, Ordering},
    Once,
};

const SLOTS: usize = 256;
/// (start, length) of guarded mappings; start 0: a free slot. Read by the handler, so atomics
/// only, no locks.
static RANGES: [(AtomicUsize, AtomicUsize); SLOTS] =
    [const { (AtomicUsize::new(0), AtomicUsize::new(0)) }; SLOTS];
static INSTALL: Once = Once::new();
static mut PREVIOUS: Option<libc::sigaction> = None;

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel hands a valid siginfo to an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    for (start, len) in &RANGES {
        let (s, l) = (start.load(Ordering::Acquire), len.load(Ordering::Acquire));
        if s != 0 && (s..s + l).contains(&addr) {
            let page = addr & !4095;
            // SAFETY: replaces one page of our own mapping with zeros; mmap is
            // async-signal-safe.
            unsafe {
                libc::mmap(
                    page as *mut libc::c_void,
                    4096,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
            }
            return;
        }
    }
    // Not ours: as the handler before would have it.
    // SAFETY: PREVIOUS is written once, before this handler is installed.
    let previous = unsafe { *std::ptr::addr_of!(PREVIOUS) };
    match previous {
        Some(p) if p.sa_sigaction != libc::SIG_DFL && p.sa_sigaction != libc::SIG_IGN => {
            if p.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: the previous SA_SIGINFO handler, called as the kernel would.
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    unsafe { std::mem::transmute(p.sa_sigaction) };
                f(sig, info, ctx);
            } else {
                // SAFETY: a plain handler, called as the kernel would.
                let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(p.sa_sigaction) };
                f(sig);
            }
        }
        _ => {
            // SAFETY: restores the default action; the faulting access runs again and kills.
            unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
        }
    }
}

/// Guards `[start, start + len)`.
pub(super) fn guard(start: usize, len: usize) {
    INSTALL.call_once(|| {
        // SAFETY: installs a handler for SIGBUS, keeping the previous one; runs once.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_sigbus as *const () as usize;
            act.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER;
            libc::sigemptyset(&raw mut act.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, &raw const act, &raw mut old) == 0 {
                *std::ptr::addr_of_mut!(PREVIOUS) = Some(old);
            }
        }
    });
    for (s, l) in &RANGES {
        if s.load(Ordering::Acquire) == 0 {
            l.store(len, Ordering::Release);
            if s.compare_exchange(0, start, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return;
            }
        }
    }
    tracing::warn!("more than {SLOTS} counts files mapped: a shrunk one would kill tracerd");
}

pub(super) fn unguard(start: usize) {
    for (s, _) in &RANGES {
        if s.compare_exchange(start, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    /// A mapped file shrunk under the mapping reads as zeros instead of killing the process.
    #[test]
    fn a_shrunk_file_reads_as_zeros() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(3 * 4096).unwrap();
        // SAFETY: a fresh mapping of our own file.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                3 * 4096,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        super::guard(p as usize, 3 * 4096);
        f.set_len(4096).unwrap();
        // SAFETY: inside the mapping; the last page is past the file's end now.
        let v = unsafe { std::ptr::read_volatile(p.cast::<u8>().add(2 * 4096 + 5)) };
        assert_eq!(v, 0);
        super::unguard(p as usize);
        // SAFETY: our mapping.
        unsafe { libc::munmap(p, 3 * 4096) };
    }
}
