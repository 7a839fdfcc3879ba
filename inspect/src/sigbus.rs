//! Files tracerd maps that a traced process's user can shrink under the mapping: counts files
//! (theirs), and binaries tracerd parses or blazesym keeps open for symbols (a library in
//! their home directory). Touching a page past a shrunk file's end raises SIGBUS, which would
//! kill tracerd and every session in it. The handler puts a private zero page there instead
//! and lets the access run again: the counts or symbols read as zeros (parsers of binaries
//! check what they read), and each such page is counted ([`zeroed_pages`]).
//!
//! Which addresses are ours: ranges guarded explicitly (counts files, checked first and
//! without a system call), then any file mapping that is not executable, as
//! `/proc/self/maps` lists it (blazesym's and memmap2's, which tracerd does not see made).
//! Anything else, or a SIGBUS that is not a read past a file's end (a machine check), goes to
//! the handler installed before.

use std::sync::{
    atomic::{AtomicU64, AtomicUsize, Ordering},
    Once,
};

const SLOTS: usize = 256;
/// (start, length) of guarded mappings; start 0: a free slot. Read by the handler, so atomics
/// only, no locks.
static RANGES: [(AtomicUsize, AtomicUsize); SLOTS] =
    [const { (AtomicUsize::new(0), AtomicUsize::new(0)) }; SLOTS];
static INSTALL: Once = Once::new();
static mut PREVIOUS: Option<libc::sigaction> = None;
static ZEROED: AtomicU64 = AtomicU64::new(0);

/// `si_code` of a SIGBUS for an access past a file mapping's end.
const BUS_ADRERR: libc::c_int = 2;

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel hands a valid siginfo to an SA_SIGINFO handler.
    let (addr, code) = unsafe { ((*info).si_addr() as usize, (*info).si_code) };
    if code == BUS_ADRERR {
        let guarded = RANGES.iter().any(|(start, len)| {
            let (s, l) = (start.load(Ordering::Acquire), len.load(Ordering::Acquire));
            s != 0 && (s..s + l).contains(&addr)
        });
        let prot = if guarded {
            Some(libc::PROT_READ | libc::PROT_WRITE)
        } else {
            own_file_mapping(addr).then_some(libc::PROT_READ)
        };
        if let Some(prot) = prot {
            let page = addr & !4095;
            // SAFETY: replaces one page of our own mapping with zeros; mmap is
            // async-signal-safe.
            let p = unsafe {
                libc::mmap(
                    page as *mut libc::c_void,
                    4096,
                    prot,
                    libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED {
                ZEROED.fetch_add(1, Ordering::Relaxed);
                return;
            }
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

/// Whether `addr` is in a file mapping of this process that is not executable, read from
/// `/proc/self/maps` with async-signal-safe calls only (open, read, close; no allocation).
fn own_file_mapping(addr: usize) -> bool {
    // SAFETY: a NUL-terminated path; the descriptor is closed below.
    let fd = unsafe {
        libc::open(
            c"/proc/self/maps".as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return false;
    }
    let mut line = MapsLine::new(addr);
    let mut buf = [0u8; 4096];
    let found = loop {
        // SAFETY: reads into our buffer, at most its length.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            break false;
        }
        if buf[..n as usize].iter().any(|&b| line.push(b)) {
            break true;
        }
    };
    // SAFETY: our descriptor.
    unsafe { libc::close(fd) };
    found
}

/// `/proc/PID/maps`, a byte at a time: `start-end perms offset dev inode [path]` per line.
/// Only the fields up to the inode matter; the path may be any length.
struct MapsLine {
    addr: usize,
    field: u8,
    start: usize,
    end: usize,
    perm: u8,
    exec: bool,
    inode: u64,
}

impl MapsLine {
    fn new(addr: usize) -> Self {
        Self {
            addr,
            field: 0,
            start: 0,
            end: 0,
            perm: 0,
            exec: false,
            inode: 0,
        }
    }

    /// Takes one byte; true once a line ends that is a non-executable file mapping holding
    /// `addr`.
    fn push(&mut self, b: u8) -> bool {
        match (self.field, b) {
            (_, b'\n') => {
                let hit =
                    (self.start..self.end).contains(&self.addr) && !self.exec && self.inode != 0;
                *self = Self::new(self.addr);
                return hit;
            }
            (0, b'-') => self.field = 1,
            (0, _) => self.start = hex(self.start, b),
            (1, b' ') => self.field = 2,
            (1, _) => self.end = hex(self.end, b),
            (2, b' ') => self.field = 3,
            (2, _) => {
                self.exec |= self.perm == 2 && b == b'x';
                self.perm += 1;
            }
            (3 | 4, b' ') => self.field += 1,
            (5, b' ') => self.field = 6,
            (5, b'0'..=b'9') => self.inode = self.inode * 10 + u64::from(b - b'0'),
            _ => {}
        }
        false
    }
}

/// `acc` with the hex digit `b` appended.
fn hex(acc: usize, b: u8) -> usize {
    let d = char::from(b).to_digit(16).unwrap_or(0) as usize;
    acc.wrapping_mul(16).wrapping_add(d)
}

/// Installs the handler (once; the handler before it is kept for SIGBUS that is not ours).
/// tracerd calls this at start, before it maps any file.
pub fn install() {
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
}

/// Pages of mapped files read as zeros since tracerd started, their files having shrunk
/// under it.
pub fn zeroed_pages() -> u64 {
    ZEROED.load(Ordering::Relaxed)
}

static REPORTED: AtomicU64 = AtomicU64::new(0);

/// Pages zeroed since the last call: for a warning when there are any.
pub fn newly_zeroed() -> u64 {
    let now = zeroed_pages();
    now - REPORTED.swap(now, Ordering::Relaxed).min(now)
}

/// Guards `[start, start + len)` (a writable shared mapping: counts files); false where every
/// slot is taken, and the range is not guarded: the caller must not keep such a mapping, as
/// the fallback for other file mappings puts a read-only page there, and a write to a shrunk
/// file's page would then kill tracerd all the same.
#[must_use]
pub(crate) fn guard(start: usize, len: usize) -> bool {
    install();
    for (s, l) in &RANGES {
        if s.load(Ordering::Acquire) == 0 {
            l.store(len, Ordering::Release);
            if s.compare_exchange(0, start, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return true;
            }
        }
    }
    tracing::warn!(
        "more than {SLOTS} counts files mapped: no more are mapped until some are let go"
    );
    false
}

/// Held by tests that map counts files or fill [`RANGES`]: one test taking every slot would
/// fail another's mapping.
#[cfg(test)]
pub(crate) static TEST_SLOTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub(crate) fn unguard(start: usize) {
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

    /// Maps `pages` of a fresh file of that size.
    fn mapped(f: &std::fs::File, pages: usize, prot: libc::c_int, flags: libc::c_int) -> *mut u8 {
        f.set_len((pages * 4096) as u64).unwrap();
        // SAFETY: a fresh mapping of our own file.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                pages * 4096,
                prot,
                flags,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p.cast()
    }

    /// A guarded mapping shrunk under it reads as zeros instead of killing the process.
    #[test]
    fn a_shrunk_file_reads_as_zeros() {
        let _slots = super::TEST_SLOTS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let f = tempfile::tempfile().unwrap();
        let p = mapped(&f, 3, libc::PROT_READ, libc::MAP_SHARED);
        assert!(super::guard(p as usize, 3 * 4096));
        f.set_len(4096).unwrap();
        let before = super::zeroed_pages();
        // SAFETY: inside the mapping; the last page is past the file's end now.
        let v = unsafe { std::ptr::read_volatile(p.add(2 * 4096 + 5)) };
        assert_eq!(v, 0);
        assert!(super::zeroed_pages() > before);
        super::unguard(p as usize);
        // SAFETY: our mapping.
        unsafe { libc::munmap(p.cast(), 3 * 4096) };
    }

    /// With every slot taken, a range is not guarded, and the caller is told so.
    #[test]
    fn a_range_past_the_last_slot_is_refused() {
        let _slots = super::TEST_SLOTS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Addresses of the first page, which nothing maps.
        let taken: Vec<usize> = (1..).take_while(|&a| super::guard(a, 1)).collect();
        assert!(!taken.is_empty() && taken.len() <= super::SLOTS);
        assert!(!super::guard(4000, 1), "a range guarded past the last slot");
        for a in &taken {
            super::unguard(*a);
        }
        assert!(super::guard(4000, 1), "a slot let go is taken again");
        super::unguard(4000);
    }

    /// A binary mapped by a library (read-only, private, never guarded: as blazesym maps
    /// one) and truncated by its owner: its pages past the end read as zeros too.
    #[test]
    fn a_truncated_binary_mapped_elsewhere_reads_as_zeros() {
        super::install();
        let f = tempfile::tempfile().unwrap();
        let p = mapped(&f, 4, libc::PROT_READ, libc::MAP_PRIVATE);
        // SAFETY: inside the mapping, before the truncation.
        assert_eq!(unsafe { std::ptr::read_volatile(p.add(3 * 4096)) }, 0);
        f.set_len(0).unwrap();
        let before = super::zeroed_pages();
        // SAFETY: inside the mapping; every page is past the file's end now.
        let v = unsafe { std::ptr::read_volatile(p.add(3 * 4096 + 100)) };
        assert_eq!(v, 0);
        assert!(super::zeroed_pages() > before);
        // SAFETY: our mapping.
        unsafe { libc::munmap(p.cast(), 4 * 4096) };
    }

    /// The handler's reading of /proc/PID/maps: a file mapping's range, its exec bit, its
    /// inode; a path of any length.
    #[test]
    fn maps_lines_are_read_a_byte_at_a_time() {
        let long = "x".repeat(5000);
        let maps = format!(
            "7f00-7f10 r--p 00000000 fd:01 1234 /lib/a.so\n\
             7f10-7f20 r-xp 00010000 fd:01 1234 /lib/a.so\n\
             7f20-7f30 rw-p 00000000 00:00 0 \n\
             7f30-7f40 r--s 00000000 fd:01 99 /home/u/{long}\n"
        );
        let hit = |addr| {
            let mut line = super::MapsLine::new(addr);
            maps.bytes().any(|b| line.push(b))
        };
        assert!(hit(0x7f05));
        assert!(!hit(0x7f15), "executable");
        assert!(!hit(0x7f25), "anonymous");
        assert!(hit(0x7f3f));
        assert!(!hit(0x7f40));
    }
}
