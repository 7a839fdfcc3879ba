//! Where `dlopen` is in a running process: glibc's (in libc.so.6 since 2.34, libdl.so.2
//! before), from the dynamic symbol table of the file the process mapped.

use object::{Object, ObjectSegment, ObjectSymbol};

use crate::process::{MapEntry, ProcMaps};

/// Libraries that may define `dlopen`, in the order looked at.
const LIBRARIES: [&str; 2] = ["libc", "libdl"];

/// Whether a file's basename names library `stem`: `libc.so.6`, or `libc-2.31.so` of old.
fn names(base: &str, stem: &str) -> bool {
    base.strip_prefix(stem).is_some_and(|rest| {
        rest.starts_with(".so") || rest.starts_with('-') && rest.ends_with(".so")
    })
}

/// `dlopen`'s address in `pid`, or why there is none to call.
pub(super) fn find(pid: u32, maps: &ProcMaps) -> Result<u64, String> {
    let mut seen = Vec::new();
    for stem in LIBRARIES {
        let Some(first) = maps
            .entries()
            .iter()
            .find(|e| e.is_file() && e.path.rsplit('/').next().is_some_and(|b| names(b, stem)))
        else {
            continue;
        };
        seen.push(first.path.clone());
        if let Some(addr) = in_file(pid, maps, first)? {
            return Ok(addr);
        }
    }
    if seen.is_empty() {
        Err("it maps no glibc (libc.so.6): a static or musl program".into())
    } else {
        Err(format!("no dlopen in {}", seen.join(" or ")))
    }
}

/// `dlopen`'s address through the file of `entry`, mapped by `pid`.
fn in_file(pid: u32, maps: &ProcMaps, entry: &MapEntry) -> Result<Option<u64>, String> {
    // map_files reaches the very file mapped (another mount namespace, replaced since);
    // the process's root the path it names, where map_files is not allowed.
    let via_map = format!("/proc/{pid}/map_files/{:x}-{:x}", entry.start, entry.end);
    let via_root = format!("/proc/{pid}/root{}", entry.path);
    let data = crate::binary::map(&via_map)
        .or_else(|_| crate::binary::map(&via_root))
        .map_err(|e| format!("reading {}: {e}", entry.path))?;
    let file = object::File::parse(&*data).map_err(|e| format!("{}: {e}", entry.path))?;
    if !file.is_64() || file.architecture() != object::Architecture::X86_64 {
        return Err(format!("{} is not an x86-64 library", entry.path));
    }
    let Some(vaddr) = file
        .dynamic_symbols()
        .find(|s| {
            s.is_definition() && s.kind() == object::SymbolKind::Text && s.name() == Ok("dlopen")
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
            entry.path
        ));
    };
    let mapped = maps.entries().iter().find(|e| {
        e.inode == entry.inode
            && e.dev == entry.dev
            && e.executable
            && e.offset <= offset
            && offset < e.offset + (e.end - e.start)
    });
    mapped
        .map(|e| Some(e.start + (offset - e.offset)))
        .ok_or_else(|| {
            format!(
                "{}'s code holding dlopen is not mapped executable",
                entry.path
            )
        })
}
