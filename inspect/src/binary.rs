//! A binary's bytes, mapped rather than read. Binaries run to tens or hundreds of MB (a
//! libpython with symbols is 23–31 MB, libcuda more), and tracer parses them often: reading
//! them whole onto the heap left glibc's per-thread arenas holding that much for good, a
//! different thread each time (tracerd's memory grew with every session that way).
//! Mapped, the pages are the page cache's, and only those parsed are touched.

use std::{fs::File, io, ops::Deref, os::fd::AsRawFd, path::Path, ptr::NonNull};

/// A file mapped read-only and private; unmapped on drop.
pub struct Mapped {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is read-only and owned by this value alone.
unsafe impl Send for Mapped {}
unsafe impl Sync for Mapped {}

/// Maps `path` whole. A file rewritten in place while mapped could fault (SIGBUS); binaries
/// are replaced by rename, as package managers and linkers do, which leaves a mapping intact.
pub fn map(path: impl AsRef<Path>) -> io::Result<Mapped> {
    let file = File::open(path)?;
    let len = usize::try_from(file.metadata()?.len())
        .map_err(|_| io::Error::from(io::ErrorKind::FileTooLarge))?;
    if len == 0 {
        return Ok(Mapped {
            ptr: NonNull::dangling(),
            len: 0,
        });
    }
    // SAFETY: a fresh read-only private mapping of an open file; checked for failure.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(Mapped {
        ptr: NonNull::new(ptr.cast()).ok_or_else(|| io::Error::from(io::ErrorKind::Other))?,
        len,
    })
}

impl Deref for Mapped {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `len` readable bytes at `ptr` for as long as self lives (or none).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: the mapping made in `map`, unmapped once.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn maps_what_reading_reads() {
        let exe = std::fs::read("/proc/self/exe").unwrap();
        assert_eq!(&*super::map("/proc/self/exe").unwrap(), &exe[..]);
        let empty = tempfile::NamedTempFile::new().unwrap();
        assert!(super::map(empty.path()).unwrap().is_empty());
        assert!(super::map("/nonexistent").is_err());
    }
}
