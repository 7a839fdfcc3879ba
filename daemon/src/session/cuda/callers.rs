//! Native callers of CUDA launches: the return addresses launch probes read, located in
//! their process's mappings when a row is new (the binary kept open) and named with the
//! symbolizer when the session ends, also for processes gone by then.

use std::{
    collections::HashMap,
    fs::File,
    os::{fd::AsRawFd, unix::fs::MetadataExt},
    path::PathBuf,
};

use tracer_inspect::{
    cuda::Registrations,
    unwind::{MapEntry, ProcMaps},
};
use tracer_symbolize::{Sym, Symbolizer};

/// (pid, address).
pub(super) type ProcAddr = (u32, u64);

/// A code address of a process, located in a binary kept open (the process may be gone when
/// the session ends and names it).
#[derive(Clone, Copy)]
struct Located {
    binary: usize,
    file_offset: u64,
}

/// Binaries that launch addresses fall in, kept open and named at the session's end.
#[derive(Default)]
pub(super) struct Callers {
    /// (display path, open file): named through /proc/self/fd, whatever became of the path.
    binaries: Vec<(String, File)>,
    by_inode: HashMap<(u64, u64), usize>,
    /// Each process's mappings as last read.
    maps: HashMap<u32, ProcMaps>,
    /// (pid, address) → where it is; None: in no file (JIT code, or the process was gone).
    addrs: HashMap<ProcAddr, Option<Located>>,
}

impl Callers {
    /// Locates the addresses of `pid` not located yet: through the process's mappings as
    /// last read (a process may launch and exit before its rows are read), read again when
    /// an address is not in them (a handle, or code mapped since).
    pub(super) fn locate(&mut self, pid: u32, addrs: &[u64]) {
        for &a in addrs {
            if a == 0 || self.addrs.contains_key(&(pid, a)) {
                continue;
            }
            let mut found = self.locate_in_known(pid, a);
            if found.is_none() {
                // An exiting process's mappings read empty: they would hide those kept.
                if let Some(m) = ProcMaps::read(pid).ok().filter(|m| !m.entries().is_empty()) {
                    self.maps.insert(pid, m);
                    found = self.locate_in_known(pid, a);
                }
            }
            self.addrs.insert((pid, a), found);
        }
    }

    /// Keeps `pid`'s mappings as read now, and opens the binaries of its executable ones:
    /// a process that launches and exits before its new rows are read is located in them.
    pub(super) fn keep(&mut self, pid: u32, maps: &ProcMaps) {
        for m in maps
            .entries()
            .iter()
            .filter(|m| m.executable && m.is_file())
        {
            self.binary(pid, m);
        }
        self.maps.insert(pid, maps.clone());
    }

    fn locate_in_known(&mut self, pid: u32, a: u64) -> Option<Located> {
        let m = self.maps.get(&pid)?.find(a)?.clone();
        Some(Located {
            binary: self.binary(pid, &m)?,
            file_offset: a - m.start + m.offset,
        })
    }

    /// The open binary of mapping `m` of `pid`, opened through the process while it lives.
    fn binary(&mut self, pid: u32, m: &MapEntry) -> Option<usize> {
        let id = file_id(m);
        if let Some(&b) = self.by_inode.get(&id) {
            return Some(b);
        }
        let path = tracer_inspect::process::mapped_path(pid, m)
            .map_err(|e| tracing::debug!(%e, "launching binary not reachable"))
            .ok()?;
        // Code is mapped from regular files; opening anything else (a device node) as root
        // could do more than read it.
        if !std::fs::metadata(&path).is_ok_and(|meta| meta.is_file()) {
            return None;
        }
        let b = self.binaries.len();
        self.binaries
            .push((m.path.clone(), File::open(&path).ok()?));
        self.by_inode.insert(id, b);
        Some(b)
    }

    /// Names every located address, one symbolizer call per binary. `read`: binaries whose
    /// registrations were read already, by (device, inode).
    pub(super) fn name_all(&self, read: &HashMap<(u64, u64), Registrations>) -> NativeNames {
        let mut symbolizer = Symbolizer::new();
        // Binary → (pid, address) and its file offset.
        let mut per_binary: HashMap<usize, Vec<(ProcAddr, u64)>> = HashMap::new();
        for (&key, loc) in &self.addrs {
            if let Some(l) = loc {
                per_binary
                    .entry(l.binary)
                    .or_default()
                    .push((key, l.file_offset));
            }
        }
        let mut out = NativeNames::default();
        for (b, items) in per_binary {
            let (display, file) = &self.binaries[b];
            let path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
            let offsets: Vec<u64> = items.iter().map(|(_, o)| *o).collect();
            let syms = symbolizer.user(&path, &offsets);
            // Kernels registered before the session: their host functions need not have
            // symbols (a stripped library), the registration code names them.
            let id = file.metadata().map(|m| (m.dev(), m.ino()));
            let unread;
            let registered = match id.ok().and_then(|id| read.get(&id)) {
                Some(r) => r,
                None => {
                    unread = tracer_inspect::binary::map(&path)
                        .map(|data| Registrations::read(&data))
                        .unwrap_or_default();
                    &unread
                }
            };
            let base = display.rsplit('/').next().unwrap_or(display);
            for ((key, off), sym) in items.into_iter().zip(syms) {
                out.addrs.insert(
                    key,
                    Named {
                        text: describe(sym.as_ref(), base, off),
                        sym,
                        registered: registered.kernels.get(&off).cloned(),
                    },
                );
            }
        }
        out
    }

    /// The executable files `pid` maps, as last read and kept: (index, the file kept open, an
    /// address of the process in it, and that address's offset in the file), once each.
    pub(super) fn binaries_of(&self, pid: u32) -> Vec<(usize, &File, u64, u64)> {
        let mut out: Vec<(usize, &File, u64, u64)> = Vec::new();
        let Some(maps) = self.maps.get(&pid) else {
            return out;
        };
        for m in maps
            .entries()
            .iter()
            .filter(|m| m.executable && m.is_file())
        {
            let id = file_id(m);
            if let Some(&b) = self.by_inode.get(&id) {
                if !out.iter().any(|o| o.0 == b) {
                    out.push((b, &self.binaries[b].1, m.start, m.offset));
                }
            }
        }
        out
    }

    /// The binary `pid`'s address `addr` was located in (its index, and the file kept
    /// open), with the address's offset in it.
    pub(super) fn binary_of(&self, pid: u32, addr: u64) -> Option<(usize, &File, u64)> {
        let l = (*self.addrs.get(&(pid, addr))?)?;
        Some((l.binary, &self.binaries[l.binary].1, l.file_offset))
    }
}

/// A mapped file's (device, inode), as `Callers::by_inode` keys it.
fn file_id(m: &MapEntry) -> (u64, u64) {
    (u64::from(m.dev.0) << 32 | u64::from(m.dev.1), m.inode)
}

/// What a CUDA session's native addresses are, once named.
#[derive(Default)]
pub(super) struct NativeNames {
    /// (pid, address) → its name.
    pub addrs: HashMap<ProcAddr, Named>,
    /// (pid, handle) → the device name registered for the host function whose static keeps
    /// it: handles got before the session, read from the process while it ran.
    pub handles: HashMap<ProcAddr, String>,
}

/// A named address: the symbol, if any, and how reports show it.
pub(super) struct Named {
    pub sym: Option<Sym>,
    pub text: String,
    /// The device name its binary's registration code registers for a kernel whose host
    /// function starts here (`tracer_inspect::cuda::Registrations`).
    pub registered: Option<String>,
}

fn describe(sym: Option<&Sym>, binary: &str, offset: u64) -> String {
    match sym {
        Some(Sym {
            name,
            file: Some(f),
            line: Some(l),
            ..
        }) => format!("{name} ({}:{l})", f.rsplit('/').next().unwrap_or(f)),
        Some(s) => format!("{} ({binary})", s.name),
        None => format!("{binary}+{offset:#x}"),
    }
}
