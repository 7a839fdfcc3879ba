//! The counter's directory and files, as tracerd touches them. The directory lies in the
//! counted process's `/tmp` and is handed to the process's user, who may change anything in
//! it: every operation is relative to a held descriptor and follows no symbolic link, files
//! tracerd reads must be regular files, and what it reads is bounds-checked. A mapping whose
//! file the user shrinks reads as zeros ([`super::sigbus`]) instead of killing tracerd.

use std::{
    ffi::CString,
    fs::File,
    io::{Read, Write},
    os::{
        fd::{AsRawFd, FromRawFd},
        unix::fs::OpenOptionsExt,
    },
    path::{Path, PathBuf},
    sync::atomic::AtomicU32,
};

use tracer_common::inproc::{self, Header, StrRef};

fn c_name(name: &str) -> std::io::Result<CString> {
    if name.contains('/') {
        return Err(std::io::Error::other("a file name holds a slash"));
    }
    CString::new(name).map_err(std::io::Error::other)
}

fn check(ret: libc::c_int) -> std::io::Result<libc::c_int> {
    if ret < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// An open directory, and the one holding it.
pub(super) struct Dir {
    this: File,
    parent: File,
}

impl Dir {
    /// Makes `name` in `/tmp` of `pid`'s root (which must be a directory, not a link), mode
    /// 0700, root's until [`Dir::give`].
    pub(super) fn make(pid: u32, name: &str) -> std::io::Result<Self> {
        let tmp = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(format!("/proc/{pid}/root/tmp"))?;
        let c = c_name(name)?;
        // SAFETY: plain syscalls on a descriptor we hold and a NUL-terminated name.
        check(unsafe { libc::mkdirat(tmp.as_raw_fd(), c.as_ptr(), 0o700) })?;
        // SAFETY: as above; the descriptor returned is owned by the File.
        let fd = check(unsafe {
            libc::openat(
                tmp.as_raw_fd(),
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        })?;
        Ok(Self {
            // SAFETY: a fresh descriptor nobody else owns.
            this: unsafe { File::from_raw_fd(fd) },
            parent: tmp,
        })
    }

    /// Hands the directory to `owner` (the process's user), once tracerd's files are in it.
    pub(super) fn give(&self, owner: (u32, u32)) -> std::io::Result<()> {
        std::os::unix::fs::fchown(&self.this, Some(owner.0), Some(owner.1))
    }

    /// Creates `name` (not there before), writes `bytes`, gives it to `owner`.
    pub(super) fn create(
        &self,
        name: &str,
        mode: u32,
        owner: (u32, u32),
        bytes: &[u8],
    ) -> Result<File, String> {
        let open = || -> std::io::Result<File> {
            let c = c_name(name)?;
            // SAFETY: plain syscall; the descriptor returned is owned by the File.
            let fd = check(unsafe {
                libc::openat(
                    self.this.as_raw_fd(),
                    c.as_ptr(),
                    libc::O_RDWR
                        | libc::O_CREAT
                        | libc::O_EXCL
                        | libc::O_NOFOLLOW
                        | libc::O_CLOEXEC,
                    mode,
                )
            })?;
            // SAFETY: a fresh descriptor nobody else owns.
            let mut f = unsafe { File::from_raw_fd(fd) };
            f.write_all(bytes)?;
            std::os::unix::fs::fchown(&f, Some(owner.0), Some(owner.1))?;
            Ok(f)
        };
        open().map_err(|e| format!("creating {name}: {e}"))
    }

    /// Opens `name` if it is a regular file (no link, FIFO or device).
    pub(super) fn open(&self, name: &str, write: bool) -> std::io::Result<File> {
        let c = c_name(name)?;
        let access = if write { libc::O_RDWR } else { libc::O_RDONLY };
        // SAFETY: plain syscall; the descriptor returned is owned by the File.
        let fd = check(unsafe {
            libc::openat(
                self.this.as_raw_fd(),
                c.as_ptr(),
                access | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC,
            )
        })?;
        // SAFETY: a fresh descriptor nobody else owns.
        let f = unsafe { File::from_raw_fd(fd) };
        if !f.metadata()?.is_file() {
            return Err(std::io::Error::other("not a regular file"));
        }
        Ok(f)
    }

    pub(super) fn exists(&self, name: &str) -> bool {
        let Ok(c) = c_name(name) else { return false };
        // SAFETY: `st` is written by the call; plain syscall.
        let mut st = unsafe { std::mem::zeroed::<libc::stat>() };
        // SAFETY: as above.
        unsafe {
            libc::fstatat(
                self.this.as_raw_fd(),
                c.as_ptr(),
                &raw mut st,
                libc::AT_SYMLINK_NOFOLLOW,
            ) == 0
        }
    }

    /// The first KiB of a small text file the process wrote.
    pub(super) fn read_text(&self, name: &str) -> Option<String> {
        let mut text = String::new();
        self.open(name, false)
            .ok()?
            .take(1024)
            .read_to_string(&mut text)
            .ok()?;
        Some(text)
    }

    pub(super) fn unlink(&self, name: &str) {
        if let Ok(c) = c_name(name) {
            // SAFETY: plain syscall; unlinkat never follows a link.
            unsafe { libc::unlinkat(self.this.as_raw_fd(), c.as_ptr(), 0) };
        }
    }

    fn names(&self) -> Vec<String> {
        let listing = PathBuf::from(format!("/proc/self/fd/{}", self.this.as_raw_fd()));
        std::fs::read_dir(listing)
            .map(|rd| {
                rd.filter_map(Result::ok)
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Deletes its files, then itself (`name` in its parent).
    pub(super) fn remove(&self, name: &str) {
        for f in self.names() {
            self.unlink(&f);
        }
        if let Ok(c) = c_name(name) {
            // SAFETY: plain syscall.
            unsafe { libc::unlinkat(self.parent.as_raw_fd(), c.as_ptr(), libc::AT_REMOVEDIR) };
        }
    }

    /// Removes the directory if it is empty; whether it did.
    pub(super) fn remove_if_empty(&self, name: &str) -> bool {
        c_name(name).is_ok_and(|c| {
            // SAFETY: plain syscall; fails on a directory that is not empty.
            unsafe { libc::unlinkat(self.parent.as_raw_fd(), c.as_ptr(), libc::AT_REMOVEDIR) == 0 }
        })
    }

    /// (pid, file name) of every counts file in it.
    pub(super) fn counts_files(&self) -> Vec<(u32, String)> {
        self.names()
            .into_iter()
            .filter_map(|name| {
                let pid = name.strip_prefix(inproc::FILE_PREFIX)?.parse().ok()?;
                Some((pid, name))
            })
            .collect()
    }
}

/// A whole counts file, mapped shared.
pub(super) struct Mapping {
    pub(super) ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory, read and written only through atomics and
// volatile copies; nothing in it is tied to a thread.
unsafe impl Send for Mapping {}

impl Mapping {
    pub(super) fn new(file: &File) -> std::io::Result<Self> {
        Self::with(file, libc::PROT_READ | libc::PROT_WRITE)
    }

    /// For looking only: states and counts are not written through it.
    pub(super) fn new_read_only(file: &File) -> std::io::Result<Self> {
        Self::with(file, libc::PROT_READ)
    }

    fn with(file: &File, prot: libc::c_int) -> std::io::Result<Self> {
        let len = usize::try_from(file.metadata()?.len()).unwrap_or(0);
        let most = inproc::file_size(inproc::ENTRIES, inproc::EDGES, inproc::STRINGS);
        if !(inproc::HEADER_SIZE..=most).contains(&len) {
            return Err(std::io::Error::other("a counts file of the wrong size"));
        }
        // SAFETY: a fresh shared mapping of a file we hold open; checked for failure.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        super::sigbus::guard(ptr as usize, len);
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    pub(super) fn header(&self) -> Header {
        // SAFETY: the header lies at the start of a mapping at least HEADER_SIZE long; the
        // process may write it meanwhile, hence a volatile copy.
        unsafe { std::ptr::read_volatile(self.ptr.cast::<Header>()) }
    }

    fn word(&self, offset: usize) -> &AtomicU32 {
        // SAFETY: `offset` is a 4-byte-aligned field of the header, inside the mapping;
        // AtomicU32 has u32's layout.
        unsafe { &*self.ptr.add(offset).cast::<AtomicU32>() }
    }

    pub(super) fn state(&self) -> &AtomicU32 {
        self.word(std::mem::offset_of!(Header, state))
    }

    pub(super) fn busy(&self) -> &AtomicU32 {
        self.word(std::mem::offset_of!(Header, busy))
    }

    /// Copies `count` records of type `T` from `offset`, if they lie inside the mapping.
    pub(super) fn records<T: Copy>(&self, offset: usize, count: usize) -> Vec<T> {
        let size = std::mem::size_of::<T>();
        let end = count.checked_mul(size).and_then(|n| n.checked_add(offset));
        if end.is_none_or(|end| end > self.len) {
            return Vec::new();
        }
        (0..count)
            // SAFETY: inside the mapping (checked above); records are plain `repr(C)` data.
            .map(|i| unsafe {
                std::ptr::read_volatile(self.ptr.add(offset + i * size).cast::<T>())
            })
            .collect()
    }

    pub(super) fn string(&self, h: &Header, s: StrRef) -> String {
        let (entries, edges) = (h.entries_cap as usize, h.edges_cap as usize);
        let sizes = (
            std::mem::size_of::<inproc::Entry>(),
            std::mem::size_of::<inproc::Edge>(),
        );
        let base = entries
            .checked_mul(sizes.0)
            .zip(edges.checked_mul(sizes.1))
            .and_then(|(a, b)| a.checked_add(b)?.checked_add(inproc::HEADER_SIZE));
        let (off, len) = (s.offset as usize, s.len as usize);
        let Some(start) = base.and_then(|b| b.checked_add(off)) else {
            return String::new();
        };
        if off + len > h.strings_cap as usize || start + len > self.len {
            return String::new();
        }
        // SAFETY: inside the mapping (checked above).
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr.add(start), len) };
        String::from_utf8_lossy(bytes).into_owned()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        super::sigbus::unguard(self.ptr as usize);
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// The library beside tracerd's executable, if it is there.
pub(super) fn beside_tracerd(name: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("finding tracerd's executable: {e}"))?;
    let lib = exe.with_file_name(name);
    if Path::new(&lib).is_file() {
        Ok(lib)
    } else {
        Err(format!("{name} is not beside tracerd"))
    }
}
