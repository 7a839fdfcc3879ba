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
    // SAFETY: binaries are replaced by rename, as package managers and linkers do, which
    // leaves a mapping intact; one shrunk in place by its owner faults past its new end, and
    // tracerd's SIGBUS handler reads those pages as zeros (`crate::sigbus`).
    unsafe { memmap2::Mmap::map(&file) }
}

/// What tells one build of a binary from another: its GNU build id and its size. Files that
/// share both are copies of one binary (another path, inode or container layer): what
/// inspecting one found holds for the others. None without a build id.
pub fn build(path: impl AsRef<Path>) -> Option<(Vec<u8>, u64)> {
    use object::Object;
    let data = map(path).ok()?;
    let file = object::File::parse(&*data).ok()?;
    let id = file.build_id().ok()??;
    Some((id.to_vec(), data.len() as u64))
}

#[cfg(test)]
mod tests {
    /// Copies share a build; a build id is read from the binary itself.
    #[test]
    fn copies_share_a_build() {
        let dir = tempfile::tempdir().unwrap();
        let copy = dir.path().join("copy");
        std::fs::copy("/proc/self/exe", &copy).unwrap();
        let own = super::build("/proc/self/exe").expect("rustc gives test binaries a build id");
        assert!(!own.0.is_empty());
        assert_eq!(super::build(&copy), Some(own.clone()));
        // Bytes appended: another file, though the id is the same.
        let mut bytes = std::fs::read(&copy).unwrap();
        bytes.extend_from_slice(b"more");
        std::fs::write(&copy, bytes).unwrap();
        assert_eq!(super::build(&copy), Some((own.0, own.1 + 4)));
        assert_eq!(super::build(dir.path().join("none")), None);
    }

    #[test]
    fn maps_what_reading_reads() {
        let exe = std::fs::read("/proc/self/exe").unwrap();
        assert_eq!(&*super::map("/proc/self/exe").unwrap(), &exe[..]);
        let empty = tempfile::NamedTempFile::new().unwrap();
        assert!(super::map(empty.path()).unwrap().is_empty());
        assert!(super::map("/nonexistent").is_err());
    }
}
