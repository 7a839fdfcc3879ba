//! Names native addresses: file offsets within user-space ELF binaries and kernel addresses.
//!
//! blazesym does the lookups (ELF symbols, DWARF line info, demangling). Its `Symbolizer` is
//! neither `Send` nor `Sync` (it caches through `Rc`/`RefCell`), so it lives on a thread of its
//! own and [`Symbolizer`] talks to it over channels. That thread keeps parsed binaries cached
//! (blazesym keys them by dev+inode+size+mtime, so one library reached through many
//! `/proc/PID/root/...` paths is parsed once); this side caches the answers per binary identity
//! and offset, so names stay known after the process is gone.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread;

use blazesym::symbolize::source::{Elf, Kernel, Source};
use blazesym::symbolize::{Input, Symbolized};
use blazesym::MaybeDefault;
use object::elf::PF_X;
use object::{Object, ObjectSegment, SegmentFlags};

/// A named address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sym {
    /// Function name, demangled (C++/Rust). For an address inside inlined code this is the
    /// outermost (non-inlined) function.
    pub name: String,
    /// Source file (DWARF line info), when the binary has it.
    pub file: Option<String>,
    /// Line in `file`: the line of the address itself, or for inlined code the call site within
    /// the outermost function, so that `name`, `file` and `line` describe the same function.
    pub line: Option<u32>,
    /// How far into the function (its outermost one) the address is: 0 at its first byte.
    pub offset: u64,
}

/// What a binary's cached names are keyed by.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum BinaryKey {
    BuildId(String),
    File(FileMeta),
}

/// dev, inode, size, mtime (s, ns): identifies a file's contents well enough without reading it.
type FileMeta = (u64, u64, u64, i64, i64);

enum Job {
    User(PathBuf, Vec<u64>),
    Kernel(Vec<u64>),
    /// Drop what is cached of these paths (closing blazesym's files of them).
    Evict(Vec<PathBuf>),
}

/// Names kept per kind before the cache starts afresh: the answers are cheap to ask again,
/// and a daemon that sees many short-lived programs must not keep them all.
const MAX_NAMES: usize = 1 << 18;
const MAX_BUILD_IDS: usize = 4096;

type Reply = Result<Vec<Option<Sym>>, String>;

/// The thread that owns the blazesym symbolizer.
struct Worker {
    jobs: Sender<Job>,
    replies: Receiver<Reply>,
}

/// Caching symbolizer for user-space binaries and the kernel. `Send`, not `Sync`.
pub struct Symbolizer {
    worker: Option<Worker>,
    user: HashMap<BinaryKey, HashMap<u64, Option<Sym>>>,
    kernel: HashMap<u64, Option<Sym>>,
    build_ids: HashMap<FileMeta, Option<String>>,
    /// Binaries whose failure was already logged.
    logged: HashSet<PathBuf>,
}

impl Default for Symbolizer {
    fn default() -> Self {
        Self::new()
    }
}

impl Symbolizer {
    pub fn new() -> Self {
        Self {
            worker: None,
            user: HashMap::new(),
            kernel: HashMap::new(),
            build_ids: HashMap::new(),
            logged: HashSet::new(),
        }
    }

    /// Names file offsets within one binary. `binary` is a path the daemon can open (callers
    /// pass "/proc/PID/root/usr/lib/...", so processes in containers work). Results are cached
    /// per binary identity (GNU build id when present, else dev+inode+size+mtime) and offset.
    /// Returns one entry per offset; `None` where the offset cannot be named.
    pub fn user(&mut self, binary: &Path, file_offsets: &[u64]) -> Vec<Option<Sym>> {
        let key = match std::fs::metadata(binary) {
            Ok(meta) => {
                let meta = file_meta(&meta);
                match self.build_id_of(binary, meta) {
                    Some(id) => BinaryKey::BuildId(id),
                    None => BinaryKey::File(meta),
                }
            }
            Err(err) => {
                self.log_once(binary, &err.to_string());
                return vec![None; file_offsets.len()];
            }
        };
        if self.user.values().map(HashMap::len).sum::<usize>() >= MAX_NAMES {
            self.user.clear();
        }
        let worker = &mut self.worker;
        let cache = self.user.entry(key).or_default();
        let path = binary.to_path_buf();
        let (syms, result) = lookup(cache, file_offsets, |missing| {
            ask(worker, Job::User(path, missing))
        });
        if let Err(err) = result {
            self.log_once(binary, &err);
        }
        syms
    }

    /// Names kernel addresses through /proc/kallsyms (its addresses are only visible to root).
    pub fn kernel(&mut self, addrs: &[u64]) -> Vec<Option<Sym>> {
        if self.kernel.len() >= MAX_NAMES {
            self.kernel.clear();
        }
        let worker = &mut self.worker;
        let (syms, result) = lookup(&mut self.kernel, addrs, |missing| {
            ask(worker, Job::Kernel(missing))
        });
        if let Err(err) = result {
            self.log_once(Path::new("[kernel]"), &err);
        }
        syms
    }

    /// Hex GNU build id of a binary, cached per file identity; `None` when it has none or
    /// cannot be read.
    pub fn build_id(&mut self, binary: &Path) -> Option<String> {
        let meta = file_meta(&std::fs::metadata(binary).ok()?);
        self.build_id_of(binary, meta)
    }

    /// Forgets the parsed files behind these paths (blazesym keeps each open); their names
    /// stay cached here. Call before the paths go (a `/proc/self/fd/N` is reused).
    pub fn evict(&mut self, paths: Vec<PathBuf>) {
        if paths.is_empty() || self.worker.is_none() {
            return;
        }
        if let Err(err) = ask(&mut self.worker, Job::Evict(paths)) {
            tracing::debug!("evicting symbolizer files: {err}");
        }
    }

    fn build_id_of(&mut self, binary: &Path, meta: FileMeta) -> Option<String> {
        if self.build_ids.len() >= MAX_BUILD_IDS {
            self.build_ids.clear();
        }
        self.build_ids
            .entry(meta)
            .or_insert_with(|| read_build_id(binary))
            .clone()
    }

    fn log_once(&mut self, binary: &Path, err: &str) {
        // Paths under /proc/PID come and go with processes; forget old ones rather than grow.
        if self.logged.len() >= 4096 {
            self.logged.clear();
        }
        if self.logged.insert(binary.to_path_buf()) {
            tracing::debug!(binary = %binary.display(), "cannot symbolize: {err}");
        }
    }
}

/// Answers `addrs` from `cache`, asking `resolve` once for all the misses. Answers are cached
/// only when the lookup itself worked, so a passing failure (e.g. out of file descriptors) is
/// retried next time.
fn lookup(
    cache: &mut HashMap<u64, Option<Sym>>,
    addrs: &[u64],
    resolve: impl FnOnce(Vec<u64>) -> Reply,
) -> (Vec<Option<Sym>>, Result<(), String>) {
    let mut missing: Vec<u64> = addrs
        .iter()
        .copied()
        .filter(|a| !cache.contains_key(a))
        .collect();
    missing.sort_unstable();
    missing.dedup();
    let mut result = Ok(());
    if !missing.is_empty() {
        match resolve(missing.clone()) {
            Ok(syms) => cache.extend(missing.into_iter().zip(syms)),
            Err(err) => result = Err(err),
        }
    }
    let syms = addrs
        .iter()
        .map(|a| cache.get(a).cloned().flatten())
        .collect();
    (syms, result)
}

/// Runs one job on the worker thread, starting it if needed.
fn ask(worker: &mut Option<Worker>, job: Job) -> Reply {
    if worker.is_none() {
        *worker = Worker::spawn();
    }
    let w = worker
        .as_ref()
        .ok_or("cannot start the symbolizer thread")?;
    let reply = w.jobs.send(job).ok().and_then(|()| w.replies.recv().ok());
    // No reply means the thread died (a panic inside blazesym): start a fresh one next time.
    reply.unwrap_or_else(|| {
        *worker = None;
        Err("the symbolizer thread died".into())
    })
}

impl Worker {
    fn spawn() -> Option<Worker> {
        let (jobs, job_rx) = mpsc::channel::<Job>();
        let (reply_tx, replies) = mpsc::channel();
        thread::Builder::new()
            .name("symbolize".into())
            .spawn(move || {
                // Defaults: DWARF code info, inlined functions, demangling all on.
                let mut blaze = blazesym::symbolize::Symbolizer::new();
                // kallsyms only: a vmlinux blazesym might find would cost seconds and hundreds of
                // MB of DWARF parsing for line numbers we do not need.
                let kallsyms = Kernel {
                    vmlinux: MaybeDefault::None,
                    ..Kernel::default()
                };
                // Ends when the `Symbolizer` holding `jobs` is dropped.
                for job in job_rx {
                    let reply = match job {
                        Job::User(path, offsets) => user_syms(&blaze, &path, &offsets),
                        Job::Kernel(addrs) => blaze
                            .symbolize(&Source::Kernel(kallsyms.clone()), Input::AbsAddr(&addrs))
                            .map(|found| {
                                found
                                    .into_iter()
                                    .map(|f| to_sym(f, &[]).ok().flatten())
                                    .collect()
                            }),
                        Job::Evict(paths) => {
                            for path in paths {
                                let evict = blazesym::symbolize::evict::Elf::new(path);
                                let _ = blaze.evict(&evict.into());
                            }
                            Ok(Vec::new())
                        }
                    };
                    if reply_tx
                        .send(reply.map_err(|err| format!("{err:#}")))
                        .is_err()
                    {
                        break;
                    }
                }
            })
            .ok()?;
        Some(Worker { jobs, replies })
    }
}

fn user_syms(
    blaze: &blazesym::symbolize::Symbolizer,
    path: &Path,
    offsets: &[u64],
) -> Result<Vec<Option<Sym>>, blazesym::Error> {
    let code = code_ranges(path);
    let found = blaze.symbolize(&Source::Elf(Elf::new(path)), Input::FileOffset(offsets))?;
    let mut syms = Vec::with_capacity(found.len());
    let mut retry = Vec::new();
    for (i, found) in found.into_iter().enumerate() {
        let sym = to_sym(found, &code);
        if sym == Err(Rejected) {
            retry.push(i);
        }
        syms.push(sym.ok().flatten());
    }
    // DWARF keeps entries for functions the linker discarded, with their start set to 0 (or
    // near it); those can cover real addresses. Ask the ELF symbol table for those instead
    // (no line info then).
    if !retry.is_empty() {
        let elf_only = Elf {
            debug_syms: false,
            ..Elf::new(path)
        };
        let again: Vec<u64> = retry.iter().map(|&i| offsets[i]).collect();
        let found = blaze.symbolize(&Source::Elf(elf_only), Input::FileOffset(&again))?;
        for (i, found) in retry.into_iter().zip(found) {
            syms[i] = to_sym(found, &code).ok().flatten();
        }
    }
    Ok(syms)
}

/// A name blazesym gave for a symbol that cannot be code.
#[derive(Debug, PartialEq)]
struct Rejected;

/// Converts blazesym's answer; `Ok(None)` when it has no name. `code` lists the virtual address
/// ranges of executable segments; a symbol starting outside them is rejected (empty: no check).
fn to_sym(found: Symbolized<'_>, code: &[Range<u64>]) -> Result<Option<Sym>, Rejected> {
    let Some(sym) = found.into_sym() else {
        return Ok(None);
    };
    if !code.is_empty() && !code.iter().any(|r| r.contains(&sym.addr)) {
        return Err(Rejected);
    }
    // blazesym already bounds symbols that have a size; checking again keeps a far-away
    // preceding symbol from being reported. Sizeless ELF symbols (size None) are trusted.
    if sym.size.is_some_and(|size| sym.offset >= size) || sym.name.is_empty() {
        return Ok(None);
    }
    // With inlined functions, `sym.code_info` is the call site inside the outermost function;
    // the `sym.inlined` frames (outermost first) are dropped for now.
    let code = sym.code_info.as_deref();
    Ok(Some(Sym {
        // blazesym demangles with cpp_demangle: spelled as c++filt and perf spell it.
        name: tracer_inspect::demangle::literals(&sym.name),
        file: code.map(|c| c.to_path().display().to_string()),
        line: code.and_then(|c| c.line),
        offset: sym.offset as u64,
    }))
}

/// Virtual address ranges of a binary's executable PT_LOAD segments; empty when unreadable.
fn code_ranges(binary: &Path) -> Vec<Range<u64>> {
    let Ok(file) = File::open(binary) else {
        return Vec::new();
    };
    let data = object::ReadCache::new(file);
    let Ok(obj) = object::File::parse(&data) else {
        return Vec::new();
    };
    obj.segments()
        .filter(|seg| matches!(seg.flags(), SegmentFlags::Elf { p_flags } if p_flags & PF_X != 0))
        .map(|seg| seg.address()..seg.address() + seg.size())
        .collect()
}

fn file_meta(meta: &std::fs::Metadata) -> FileMeta {
    (
        meta.dev(),
        meta.ino(),
        meta.size(),
        meta.mtime(),
        meta.mtime_nsec(),
    )
}

/// Reads the GNU build id note through a read cache, so only the headers and the note are read.
fn read_build_id(binary: &Path) -> Option<String> {
    let data = object::ReadCache::new(File::open(binary).ok()?);
    let id = object::File::parse(&data).ok()?.build_id().ok()??;
    Some(id.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use object::read::elf::{ElfFile64, ProgramHeader};

    #[inline(never)]
    fn symbolize_me_please(x: u64) -> u64 {
        std::hint::black_box(x).wrapping_mul(31)
    }

    /// Maps an address of this process to (mapped file, file offset) through /proc/self/maps.
    fn file_offset(addr: u64) -> (PathBuf, u64) {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        for line in maps.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (start, end) = fields[0].split_once('-').unwrap();
            let start = u64::from_str_radix(start, 16).unwrap();
            let end = u64::from_str_radix(end, 16).unwrap();
            if (start..end).contains(&addr) {
                let offset = u64::from_str_radix(fields[2], 16).unwrap();
                return (PathBuf::from(fields[5]), addr - start + offset);
            }
        }
        panic!("{addr:#x} is not mapped");
    }

    #[test]
    fn names_own_function_with_line_info() {
        assert_eq!(symbolize_me_please(1), 31);
        let (_, offset) = file_offset(symbolize_me_please as fn(u64) -> u64 as usize as u64);
        let mut s = Symbolizer::new();
        let exe = Path::new("/proc/self/exe");
        // Offset 1 lies in the ELF header; DWARF names functions the linker discarded there
        // (start 0), which must be rejected.
        let syms = s.user(exe, &[offset, 1, offset]);
        let sym = syms[0].clone().expect("own function named");
        assert!(sym.name.contains("symbolize_me_please"), "{sym:?}");
        assert!(
            sym.file.as_deref().unwrap().ends_with("symbolize.rs"),
            "{sym:?}"
        );
        assert!(sym.line.is_some(), "{sym:?}");
        assert_eq!(syms[1], None);
        assert_eq!(syms[2], syms[0]);
        // Served from the cache, which is keyed by the build id, not the path.
        assert_eq!(
            s.user(&std::env::current_exe().unwrap(), &[offset]),
            vec![Some(sym)]
        );
    }

    #[test]
    fn names_libc_function() {
        let addr = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"getpid".as_ptr()) } as u64;
        assert_ne!(addr, 0);
        let (path, offset) = file_offset(addr);
        let sym = Symbolizer::new().user(&path, &[offset]).remove(0);
        assert!(sym.as_ref().unwrap().name.contains("getpid"), "{sym:?}");
    }

    #[test]
    fn names_kernel_address() {
        let kallsyms = std::fs::read_to_string("/proc/kallsyms").unwrap();
        let entries: Vec<(u64, &str)> = kallsyms
            .lines()
            .filter_map(|line| {
                let mut fields = line.split_whitespace();
                let addr = u64::from_str_radix(fields.next()?, 16).ok()?;
                Some((addr, fields.nth(1)?))
            })
            .collect();
        let &(addr, _) = entries
            .iter()
            .find(|(_, name)| *name == "__x64_sys_getpid" || *name == "do_sys_openat2")
            .expect("syscall symbol in kallsyms");
        assert_ne!(addr, 0, "kernel addresses hidden (not root?)");
        // Aliases share an address; any of them is a right answer.
        let names: Vec<&str> = entries
            .iter()
            .filter(|(a, _)| *a == addr)
            .map(|(_, n)| *n)
            .collect();
        let sym = Symbolizer::new().kernel(&[addr]).remove(0).unwrap();
        assert!(names.contains(&sym.name.as_str()), "{sym:?} vs {names:?}");
    }

    #[test]
    fn build_id_matches_note() {
        let data = std::fs::read("/proc/self/exe").unwrap();
        let elf = ElfFile64::<object::Endianness>::parse(&*data).unwrap();
        let endian = elf.endian();
        let mut expected = None;
        for phdr in elf.elf_program_headers() {
            let Some(mut notes) = phdr.notes(endian, &*data).unwrap() else {
                continue;
            };
            while let Some(note) = notes.next().unwrap() {
                if note.name() == object::elf::ELF_NOTE_GNU
                    && note.n_type(endian) == object::elf::NT_GNU_BUILD_ID
                {
                    expected = Some(note.desc().iter().map(|b| format!("{b:02x}")).collect());
                }
            }
        }
        assert!(expected.is_some(), "test binary has no build id");
        assert_eq!(
            Symbolizer::new().build_id(Path::new("/proc/self/exe")),
            expected
        );
    }

    #[test]
    fn bad_binaries_give_none() {
        let mut s = Symbolizer::new();
        let text = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(text.path(), "not an ELF file").unwrap();
        assert_eq!(s.user(text.path(), &[0, 8]), vec![None, None]);
        assert_eq!(s.build_id(text.path()), None);
        assert_eq!(s.user(Path::new("/nonexistent/lib.so"), &[1]), vec![None]);
        fn assert_send<T: Send>() {}
        assert_send::<Symbolizer>();
    }
}
