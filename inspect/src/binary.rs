//! A binary's bytes, mapped rather than read. Binaries run to tens or hundreds of MB (a
//! libpython with symbols is 23–31 MB, libcuda more), and tracer parses them often: reading
//! them whole onto the heap left glibc's per-thread arenas holding that much for good, a
//! different thread each time (tracerd's memory grew with every session that way).
//! Mapped, the pages are the page cache's, and only those parsed are touched.

use std::{fs::File, io, path::Path};

/// A file mapped read-only; unmapped on drop.
pub type Mapped = memmap2::Mmap;

/// Maps `path` whole.
pub fn map(path: impl AsRef<Path>) -> io::Result<Mapped> {
    let file = File::open(path)?;
    // SAFETY: a file rewritten in place while mapped could fault (SIGBUS); binaries are
    // replaced by rename, as package managers and linkers do, which leaves a mapping intact.
    unsafe { memmap2::Mmap::map(&file) }
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
