//! The file shared with tracerd (layout: `tracer_common::inproc`), mapped into the process.

use std::{
    ffi::{c_int, CString},
    mem::size_of,
    ptr,
    sync::atomic::{fence, AtomicU32, AtomicU64, Ordering},
};

use tracer_common::inproc::{self, state, why_bytes, Edge, Entry, Header, StrRef};

/// Inserts stop at 7/8 of a table: a lookup then always meets an empty slot soon, even when
/// the table counts as full.
const fn max_used(cap: usize) -> usize {
    cap - cap / 8
}

const MAX_ENTRIES: u32 = 1 << 24;

/// One mapping of a counts file. `hdr` null: nothing mapped.
#[derive(Clone, Copy)]
pub struct Shared {
    base: *mut u8,
    len: usize,
    pub hdr: *mut Header,
    entries: *mut Entry,
    entries_mask: usize,
    edges: *mut Edge,
    edges_mask: usize,
    strings: *mut u8,
    strings_cap: usize,
}

/// Where an entry for a code object is, or would go.
pub enum Slot {
    Found(usize),
    Free(usize),
    Full,
}

impl Shared {
    pub const NONE: Self = Self {
        base: ptr::null_mut(),
        len: 0,
        hdr: ptr::null_mut(),
        entries: ptr::null_mut(),
        entries_mask: 0,
        edges: ptr::null_mut(),
        edges_mask: 0,
        strings: ptr::null_mut(),
        strings_cap: 0,
    };

    pub fn is_mapped(&self) -> bool {
        !self.hdr.is_null()
    }

    pub fn entries_cap(&self) -> usize {
        self.entries_mask + 1
    }

    /// Maps the whole file, `len` bytes as `h`'s capacities say.
    fn map(fd: c_int, h: &Header) -> Result<Self, String> {
        let (ne, nd, ns) = (
            h.entries_cap as usize,
            h.edges_cap as usize,
            h.strings_cap as usize,
        );
        let len = inproc::file_size(ne, nd, ns);
        // SAFETY: fstat writes into the buffer it is given.
        let size = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut st) != 0 {
                return Err(format!("fstat: {}", std::io::Error::last_os_error()));
            }
            st.st_size as usize
        };
        if size < len {
            return Err(format!("file has {size} bytes, its header says {len}"));
        }
        // SAFETY: a fresh shared mapping of an open file; nothing else is placed there.
        let base = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        let base = base.cast::<u8>();
        // SAFETY: all offsets lie inside the `len` bytes just mapped.
        unsafe {
            Ok(Self {
                base,
                len,
                hdr: base.cast(),
                entries: base.add(inproc::entries_offset()).cast(),
                entries_mask: ne - 1,
                edges: base.add(inproc::edges_offset(ne)).cast(),
                edges_mask: nd - 1,
                strings: base.add(inproc::strings_offset(ne, nd)),
                strings_cap: ns,
            })
        }
    }

    /// Unmaps, leaving `NONE`.
    pub fn unmap(&mut self) {
        if !self.base.is_null() {
            // SAFETY: our own mapping; nothing refers into it once `self` is NONE (the GIL
            // keeps callbacks out meanwhile).
            unsafe { libc::munmap(self.base.cast(), self.len) };
        }
        *self = Self::NONE;
    }

    /// The word both sides compare-and-swap.
    pub fn state(&self) -> &AtomicU32 {
        // SAFETY: mapped, aligned, shared with tracerd, which also accesses it atomically.
        unsafe { AtomicU32::from_ptr(&raw mut (*self.hdr).state) }
    }

    pub fn busy(&self) -> &AtomicU32 {
        // SAFETY: as in `state`.
        unsafe { AtomicU32::from_ptr(&raw mut (*self.hdr).busy) }
    }

    pub fn header(&self) -> Header {
        // SAFETY: mapped; a plain copy (tracerd writes only `state`).
        unsafe { ptr::read_volatile(self.hdr) }
    }

    /// Adds to a counter of the header or the tables.
    ///
    /// # Safety
    /// `p` points into this mapping.
    #[inline(always)]
    pub unsafe fn add(p: *mut u64, v: u64) {
        // Only this process writes it: a load and a store, no locked instruction. Atomic
        // so that tracerd's concurrent reads see whole values.
        // SAFETY: aligned, inside the mapping (caller).
        let a = unsafe { AtomicU64::from_ptr(p) };
        a.store(a.load(Ordering::Relaxed).wrapping_add(v), Ordering::Relaxed);
    }

    /// Bumps one of the header's `u32` fields (`*_used`).
    ///
    /// # Safety
    /// `p` points into this mapping's header.
    unsafe fn bump32(p: *mut u32) {
        // SAFETY: as in `add`.
        let a = unsafe { AtomicU32::from_ptr(p) };
        a.store(a.load(Ordering::Relaxed).wrapping_add(1), Ordering::Release);
    }

    pub fn lost_calls(&self) {
        // SAFETY: the header is mapped.
        unsafe { Self::add(&raw mut (*self.hdr).lost_calls, 1) }
    }

    pub fn lost_edges(&self) {
        // SAFETY: as above.
        unsafe { Self::add(&raw mut (*self.hdr).lost_edges, 1) }
    }

    pub fn lost_names(&self) {
        // SAFETY: as above.
        unsafe { Self::add(&raw mut (*self.hdr).lost_names, 1) }
    }

    /// The entry at `i` (< capacity).
    #[inline(always)]
    pub fn entry(&self, i: usize) -> *mut Entry {
        // SAFETY: `i` is masked into the table.
        unsafe { self.entries.add(i & self.entries_mask) }
    }

    /// Finds `code`'s entry, or the free slot it would take.
    #[inline(always)]
    pub fn find(&self, code: u64) -> Slot {
        let mut i = inproc::slot(code, self.entries_mask + 1);
        // Bounded even if the file came with a table without a free slot.
        for _ in 0..=self.entries_mask {
            // SAFETY: masked into the table; only this process writes `code`.
            let k = unsafe { (*self.entry(i)).code };
            if k == code {
                return Slot::Found(i);
            }
            if k == 0 {
                // SAFETY: the header is mapped.
                let used = unsafe { (*self.hdr).entries_used } as usize;
                return if used < max_used(self.entries_mask + 1) {
                    Slot::Free(i)
                } else {
                    Slot::Full
                };
            }
            i = (i + 1) & self.entries_mask;
        }
        Slot::Full
    }

    /// Fills the free slot `i` with a function; its key goes in last, so that a reader that
    /// sees the key sees the rest.
    pub fn insert(&self, i: usize, code: u64, qualname: StrRef, filename: StrRef, line: i32) {
        let e = self.entry(i);
        // SAFETY: a free slot of the mapped table; tracerd reads only slots with a key.
        unsafe {
            (*e).qualname = qualname;
            (*e).filename = filename;
            (*e).firstlineno = line;
            fence(Ordering::Release);
            AtomicU64::from_ptr(&raw mut (*e).code).store(code, Ordering::Release);
            Self::bump32(&raw mut (*self.hdr).entries_used);
        }
    }

    /// Copies a name into the strings area, or None when it does not fit.
    pub fn put_str(&self, s: &[u8]) -> Option<StrRef> {
        // SAFETY: the header is mapped.
        let used = unsafe { (*self.hdr).strings_used } as usize;
        let end = used.checked_add(s.len())?;
        if end > self.strings_cap {
            return None;
        }
        // SAFETY: `used..end` lies inside the strings area, which no other slice aliases.
        unsafe {
            ptr::copy_nonoverlapping(s.as_ptr(), self.strings.add(used), s.len());
            fence(Ordering::Release);
            AtomicU32::from_ptr(&raw mut (*self.hdr).strings_used)
                .store(end as u32, Ordering::Release);
        }
        Some(StrRef {
            offset: used as u32,
            len: s.len() as u32,
        })
    }

    /// Adds one ended call of `callee` from `caller` to the pair table.
    #[inline(always)]
    pub fn add_edge(&self, caller: u64, callee: u64, tt: u64, ct: u64, outermost: bool) {
        // Private to this side (tracerd scans the table): both keys feed the start slot.
        let mut i = inproc::slot(callee ^ caller.rotate_left(32), self.edges_mask + 1);
        for _ in 0..=self.edges_mask {
            // SAFETY: masked into the mapped table.
            let e = unsafe { self.edges.add(i) };
            // SAFETY: as above; only this process writes the keys.
            let (k, c) = unsafe { ((*e).callee, (*e).caller) };
            if k == callee && c == caller {
                // SAFETY: fields of a mapped slot.
                unsafe {
                    Self::add(&raw mut (*e).ncalls, 1);
                    Self::add(&raw mut (*e).tottime_ns, tt);
                    if outermost {
                        Self::add(&raw mut (*e).primitive, 1);
                        Self::add(&raw mut (*e).cumtime_ns, ct);
                    }
                }
                return;
            }
            if k == 0 {
                // SAFETY: the header is mapped.
                let used = unsafe { (*self.hdr).edges_used } as usize;
                if used >= max_used(self.edges_mask + 1) {
                    break;
                }
                // SAFETY: a free slot; its key goes in last, as in `insert`.
                unsafe {
                    (*e).caller = caller;
                    (*e).ncalls = 1;
                    (*e).primitive = u64::from(outermost);
                    (*e).tottime_ns = tt;
                    (*e).cumtime_ns = if outermost { ct } else { 0 };
                    fence(Ordering::Release);
                    AtomicU64::from_ptr(&raw mut (*e).callee).store(callee, Ordering::Release);
                    Self::bump32(&raw mut (*self.hdr).edges_used);
                }
                return;
            }
            i = (i + 1) & self.edges_mask;
        }
        self.lost_edges();
    }
}

/// Closes an fd on drop unless taken.
struct Fd(c_int);

impl Fd {
    fn take(mut self) -> c_int {
        std::mem::replace(&mut self.0, -1)
    }
}

impl Drop for Fd {
    fn drop(&mut self) {
        if self.0 >= 0 {
            // SAFETY: our own descriptor.
            unsafe { libc::close(self.0) };
        }
    }
}

fn cpath(path: &[u8]) -> Result<CString, String> {
    CString::new(path).map_err(|_| "path contains NUL".to_string())
}

/// Reads and checks the header of the file open at `fd`.
fn read_header(fd: c_int) -> Result<Header, String> {
    // SAFETY: a zeroed Header is valid (integers and bytes only).
    let mut h: Header = unsafe { std::mem::zeroed() };
    // SAFETY: reads at most size_of::<Header>() bytes into `h`.
    let n = unsafe { libc::pread(fd, (&raw mut h).cast(), size_of::<Header>(), 0) };
    if n != size_of::<Header>() as isize {
        return Err("file too short for a header".into());
    }
    if h.magic != inproc::MAGIC {
        return Err("not a counts file (bad magic)".into());
    }
    if h.version != inproc::VERSION {
        return Err(format!(
            "counts file version {}, this counter writes {}",
            h.version,
            inproc::VERSION
        ));
    }
    if !h.entries_cap.is_power_of_two() || !h.edges_cap.is_power_of_two() {
        return Err("table capacities are not powers of two".into());
    }
    // Every thread that runs Python keeps a word per function slot.
    if h.entries_cap > MAX_ENTRIES {
        return Err(format!(
            "{} function slots, at most {MAX_ENTRIES}",
            h.entries_cap
        ));
    }
    Ok(h)
}

fn open(path: &[u8]) -> Result<Fd, String> {
    let c = cpath(path)?;
    // SAFETY: a NUL-terminated path.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(format!(
            "open {}: {}",
            String::from_utf8_lossy(path),
            std::io::Error::last_os_error()
        ));
    }
    Ok(Fd(fd))
}

/// Opens and maps a session's file; the caller then tries to take it over.
pub fn open_session(path: &[u8]) -> Result<(c_int, Shared), String> {
    let fd = open(path)?;
    let h = read_header(fd.0)?;
    let shared = Shared::map(fd.0, &h)?;
    Ok((fd.take(), shared))
}

/// PENDING → REFUSED, with the reason (cut at a character boundary to fit, NUL-padded).
pub fn refuse(path: &[u8], why: &str) -> Result<(), String> {
    let fd = open(path)?;
    read_header(fd.0)?;
    // Only the header is written: the tables need not be mapped.
    // SAFETY: a fresh shared mapping of the open file's first page(s).
    let base = unsafe {
        libc::mmap(
            ptr::null_mut(),
            inproc::HEADER_SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.0,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(format!("mmap: {}", std::io::Error::last_os_error()));
    }
    let hdr = base.cast::<Header>();
    // SAFETY: mapped and aligned; tracerd accesses `state` atomically too.
    let st = unsafe { AtomicU32::from_ptr(&raw mut (*hdr).state) };
    if st.load(Ordering::Acquire) == state::PENDING {
        let buf = why_bytes(why);
        // The reason goes in first: whoever sees REFUSED sees why. Were the file cancelled
        // meanwhile, `why` of a cancelled file means nothing.
        // SAFETY: inside the mapped header.
        unsafe { ptr::write_volatile(&raw mut (*hdr).why, buf) };
        let _ = st.compare_exchange(
            state::PENDING,
            state::REFUSED,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }
    // SAFETY: the mapping made above.
    unsafe { libc::munmap(base, inproc::HEADER_SIZE) };
    Ok(())
}

impl Shared {
    /// A counter that took its file but could not go on counting: RUNNING → REFUSED, with
    /// the reason, which goes in first.
    pub fn refuse_running(&self, why: &str) {
        // SAFETY: inside the mapped header.
        unsafe { ptr::write_volatile(&raw mut (*self.hdr).why, why_bytes(why)) };
        let _ = self.state().compare_exchange(
            state::RUNNING,
            state::REFUSED,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }
}

/// A forked child's own file, `<dir>/counts.<pid>`, shaped like `parent`, RUNNING.
pub fn create_child(dir: &[u8], parent: &Header, tool_id: u32) -> Result<(c_int, Shared), String> {
    // SAFETY: no preconditions.
    let pid = unsafe { libc::getpid() } as u32;
    let mut path = dir.to_vec();
    path.push(b'/');
    path.extend_from_slice(inproc::FILE_PREFIX.as_bytes());
    path.extend_from_slice(pid.to_string().as_bytes());
    let c = cpath(&path)?;
    // SAFETY: a NUL-terminated path.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC,
            0o600 as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(format!("create: {}", std::io::Error::last_os_error()));
    }
    let fd = Fd(fd);
    let made = fill_child(fd.0, parent, tool_id, pid);
    if made.is_err() {
        // SAFETY: the path just created; a half-made file would only mislead tracerd.
        unsafe { libc::unlink(c.as_ptr()) };
    }
    Ok((fd.take(), made?))
}

fn fill_child(fd: c_int, parent: &Header, tool_id: u32, pid: u32) -> Result<Shared, String> {
    let len = inproc::file_size(
        parent.entries_cap as usize,
        parent.edges_cap as usize,
        parent.strings_cap as usize,
    );
    // SAFETY: our own descriptor.
    if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
        return Err(format!("ftruncate: {}", std::io::Error::last_os_error()));
    }
    let shared = Shared::map(fd, parent)?;
    let h = Header {
        magic: 0,
        tool_id,
        ..Header::new(
            pid,
            state::RUNNING,
            (parent.entries_cap, parent.edges_cap, parent.strings_cap),
        )
    };
    // SAFETY: the new mapping's header; the magic goes in last, so that tracerd, finding the
    // file, reads a whole header once it sees the magic.
    unsafe {
        ptr::write(shared.hdr, h);
        fence(Ordering::Release);
        AtomicU64::from_ptr(&raw mut (*shared.hdr).magic).store(inproc::MAGIC, Ordering::Release);
    }
    Ok(shared)
}
