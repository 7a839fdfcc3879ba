//! What a loading thread calls in a running process, from the C library it mapped: glibc's
//! `dlopen` (in libc.so.6 since 2.34, libdl.so.2 before), and the signal restorer glibc gives
//! every handler (`mov $15, %rax; syscall`), which `dlopen` returns through.

use object::{Object, ObjectSegment, ObjectSymbol};

use crate::process::{MapEntry, ProcMaps};

/// Libraries that may define `dlopen`, in the order looked at.
const LIBRARIES: [&str; 2] = ["libc", "libdl"];
/// `mov $15, %rax; syscall`: `rt_sigreturn`, as glibc's `__restore_rt` makes it.
const RESTORER: [u8; 9] = [0x48, 0xc7, 0xc0, 0x0f, 0x00, 0x00, 0x00, 0x0f, 0x05];

/// Addresses in the process.
pub(super) struct Calls {
    pub dlopen: u64,
    /// The restorer's first byte; `rt_sigreturn` is entered from its end.
    pub restorer: u64,
}

impl Calls {
    /// The instruction pointer at the restorer's `rt_sigreturn` entry.
    pub(super) fn sigreturn_ip(&self) -> u64 {
        self.restorer + RESTORER.len() as u64
    }
}

/// Whether a file's basename names library `stem`: `libc.so.6`, or `libc-2.31.so` of old.
fn names(base: &str, stem: &str) -> bool {
    base.strip_prefix(stem).is_some_and(|rest| {
        rest.starts_with(".so") || rest.starts_with('-') && rest.ends_with(".so")
    })
}

/// The first file mapped by `pid` that is library `stem`.
fn library<'m>(maps: &'m ProcMaps, stem: &str) -> Option<&'m MapEntry> {
    maps.entries()
        .iter()
        .find(|e| e.is_file() && e.path.rsplit('/').next().is_some_and(|b| names(b, stem)))
}

/// `dlopen` and the restorer in `pid`, or why there are none to call.
pub(super) fn find(pid: u32, maps: &ProcMaps) -> Result<Calls, String> {
    let Some(libc) = library(maps, "libc") else {
        return Err("it maps no glibc (libc.so.6): a static or musl program".into());
    };
    let mut seen = Vec::new();
    let mut dlopen = None;
    for stem in LIBRARIES {
        let Some(entry) = library(maps, stem) else {
            continue;
        };
        seen.push(entry.path.clone());
        let file = Library::open(pid, maps, entry)?;
        if let Some(addr) = file.dlopen()? {
            dlopen = Some(addr);
            break;
        }
    }
    let Some(dlopen) = dlopen else {
        return Err(format!("no dlopen in {}", seen.join(" or ")));
    };
    let restorer = Library::open(pid, maps, libc)?
        .restorer()?
        .ok_or_else(|| format!("no signal restorer in {}", libc.path))?;
    Ok(Calls { dlopen, restorer })
}

/// A library's file, as mapped by a process.
struct Library<'m> {
    data: crate::binary::Mapped,
    entry: &'m MapEntry,
    maps: &'m ProcMaps,
}

impl<'m> Library<'m> {
    fn open(pid: u32, maps: &'m ProcMaps, entry: &'m MapEntry) -> Result<Self, String> {
        // map_files reaches the very file mapped (another mount namespace, replaced since);
        // the process's root the path it names, where map_files is not allowed.
        let via_map = format!("/proc/{pid}/map_files/{:x}-{:x}", entry.start, entry.end);
        let via_root = format!("/proc/{pid}/root{}", entry.path);
        let data = crate::binary::map(&via_map)
            .or_else(|_| crate::binary::map(&via_root))
            .map_err(|e| format!("reading {}: {e}", entry.path))?;
        Ok(Self { data, entry, maps })
    }

    fn parse(&self) -> Result<object::File<'_>, String> {
        let file = object::File::parse(&*self.data).map_err(|e| format!("{}: {e}", self.path()))?;
        if !file.is_64() || file.architecture() != object::Architecture::X86_64 {
            return Err(format!("{} is not an x86-64 library", self.path()));
        }
        Ok(file)
    }

    fn path(&self) -> &str {
        &self.entry.path
    }

    fn dlopen(&self) -> Result<Option<u64>, String> {
        let file = self.parse()?;
        let Some(vaddr) = file
            .dynamic_symbols()
            .find(|s| {
                s.is_definition()
                    && s.kind() == object::SymbolKind::Text
                    && s.name() == Ok("dlopen")
            })
            .map(|s| s.address())
        else {
            return Ok(None);
        };
        // The file offset of the symbol, then the mapping of that offset.
        let Some(offset) = file.segments().find_map(|seg| {
            let (off, size) = seg.file_range();
            let a = seg.address();
            (a <= vaddr && vaddr < a + size).then(|| vaddr - a + off)
        }) else {
            return Err(format!(
                "dlopen in {} lies in no loaded segment",
                self.path()
            ));
        };
        self.address(offset).map(Some)
    }

    /// The restorer's address: the byte pattern, found in the file's executable mapping.
    fn restorer(&self) -> Result<Option<u64>, String> {
        for e in self.mappings().filter(|e| e.executable) {
            let (from, len) = (e.offset as usize, (e.end - e.start) as usize);
            let Some(code) = self.data.get(from..(from + len).min(self.data.len())) else {
                continue;
            };
            if let Some(i) = code.windows(RESTORER.len()).position(|w| w == RESTORER) {
                return Ok(Some(e.start + i as u64));
            }
        }
        Ok(None)
    }

    /// The process's mappings of this file.
    fn mappings(&self) -> impl Iterator<Item = &'m MapEntry> + '_ {
        let (dev, inode) = (self.entry.dev, self.entry.inode);
        self.maps
            .entries()
            .iter()
            .filter(move |e| e.inode == inode && e.dev == dev)
    }

    /// The address of file offset `offset`, in the process's executable mapping of it.
    fn address(&self, offset: u64) -> Result<u64, String> {
        self.mappings()
            .find(|e| e.executable && e.offset <= offset && offset < e.offset + (e.end - e.start))
            .map(|e| e.start + (offset - e.offset))
            .ok_or_else(|| {
                format!(
                    "{}'s code holding dlopen is not mapped executable",
                    self.path()
                )
            })
    }
}
