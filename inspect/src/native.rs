//! Native functions to count (`--uprobe BINARY_OR_LIB:SYMBOL`): which file a spec names and
//! which of its functions the symbol pattern matches, as file offsets to attach uprobes to.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use object::{Object, ObjectSegment, ObjectSymbol, SymbolKind};

/// Functions one spec may match: beyond this, a pattern is almost surely too broad (each
/// probe costs every caller a trap).
pub const MAX_PROBES_PER_SPEC: usize = 1000;

/// Distinct `--uprobe` specs one session may give: each reads its binary's symbols, on the
/// way to the session's start.
pub const MAX_SPECS: usize = 256;

/// How many native functions sessions may probe, after duplicates are merged. A probe on a
/// shared library traps in every process that maps it, traced or not, so these caps protect
/// the whole machine, not only the caller (`tracerd --max-probes-per-session/-per-user`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeLimits {
    pub per_session: usize,
    /// Summed over the running sessions of one uid (root's included).
    pub per_user: usize,
}

impl Default for ProbeLimits {
    fn default() -> Self {
        Self {
            per_session: 1000,
            per_user: 2000,
        }
    }
}

impl ProbeLimits {
    /// The caps and what a probe costs others, as `tracerctl capabilities` shows them.
    pub fn describe(&self) -> String {
        format!(
            "native probes: at most {} functions a session and {} a user across running sessions (duplicates merged; {MAX_SPECS} --uprobe specs, {MAX_PROBES_PER_SPEC} functions a pattern); a probe on a shared library traps in every process that maps it, traced or not (≈0.5–4 µs a call), until its session ends",
            self.per_session, self.per_user
        )
    }
}

/// The specs without repeats, in their first order.
pub fn distinct_specs(specs: &[String]) -> Vec<&str> {
    let mut seen = std::collections::HashSet::new();
    specs
        .iter()
        .map(String::as_str)
        .filter(|s| seen.insert(*s))
        .collect()
}

/// The targets with one probe per function: specs that name one file by different names
/// (`libc:malloc`, `libc.so.6:malloc`, its path) or overlapping patterns give each function
/// once, under the first spec that asked for it.
pub fn merge(targets: Vec<NativeTarget>) -> Vec<NativeTarget> {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::HashSet::new();
    targets
        .into_iter()
        .filter(|t| {
            let file = fs::metadata(&t.binary)
                .map(|m| (m.dev(), m.ino(), PathBuf::new()))
                .unwrap_or_else(|_| (0, 0, t.binary.clone()));
            seen.insert((file, t.file_offset))
        })
        .collect()
}

/// Where libraries named without a path are looked for, after the target's own mappings.
const LIB_DIRS: &[&str] = &[
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
    "/usr/local/lib",
];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NativeError {
    #[error(
        "--uprobe {0:?}: expected BINARY_OR_LIB:SYMBOL, e.g. libc:malloc or /usr/bin/app:'parse_*'"
    )]
    BadSpec(String),
    #[error("--uprobe {spec:?}: no library or executable named {name:?} was found (looked in the target's mappings, the system library directories and PATH)")]
    NotFound { spec: String, name: String },
    /// Said alike whether the file is missing or unreadable to the caller, so that the answer
    /// tells nothing of files the caller could not see.
    #[error("--uprobe {spec:?}: uid {uid} can read no library or executable named {name:?} (it does not exist, or uid {uid} may not read it)")]
    Unreadable {
        spec: String,
        name: String,
        uid: u32,
    },
    #[error("--uprobe {spec:?}: reading {path}: {reason}")]
    Read {
        spec: String,
        path: PathBuf,
        reason: String,
    },
    #[error("--uprobe {spec:?}: no function in {path} matches {pattern:?}")]
    NoMatch {
        spec: String,
        path: PathBuf,
        pattern: String,
    },
    #[error("--uprobe {spec:?}: {count} functions in {path} match; at most {MAX_PROBES_PER_SPEC} per pattern")]
    TooMany {
        spec: String,
        path: PathBuf,
        count: usize,
    },
}

/// One function to probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NativeTarget {
    /// The spec that asked for it, as given.
    pub spec: String,
    /// Where the daemon opens the binary (maybe through /proc/PID/...).
    pub binary: PathBuf,
    /// The binary as reports show it: as the target's maps name it, or as the spec found it.
    pub display: String,
    pub symbol: String,
    /// Where the probe goes: the function's first instruction, or the one after its leading
    /// `endbr64` (see `past_landing_pad`).
    pub file_offset: u64,
}

/// `endbr64`, the landing pad CET-built code (Ubuntu's packages, for one) starts functions
/// with.
const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];

/// The offset to probe a function at: past a leading `endbr64`, which the kernel cannot
/// emulate and would single-step on every hit (several times the cost of a probe on the
/// `push` that follows). Calls still pass there, with the same registers and stack: the landing pad
/// changes neither, and code branches to a function's start, not past its pad.
fn past_landing_pad(data: &[u8], file_offset: u64) -> u64 {
    let at = usize::try_from(file_offset).unwrap_or(usize::MAX);
    match data.get(at..at.saturating_add(4)) {
        Some(bytes) if cfg!(target_arch = "x86_64") && bytes == ENDBR64 => file_offset + 4,
        _ => file_offset,
    }
}

/// The file offsets to probe `symbols` at in `binary` (those it defines), read and parsed
/// once: CUDA's driver library is large, and its entry points many.
pub fn resolve_exact(
    binary: &std::path::Path,
    symbols: &[&str],
) -> Result<std::collections::HashMap<String, u64>, String> {
    let data = crate::binary::map(binary).map_err(|e| e.to_string())?;
    let file = object::File::parse(&*data).map_err(|e| e.to_string())?;
    let mut out = std::collections::HashMap::new();
    for (addr, name) in defined_functions(&file) {
        if out.contains_key(name) || !symbols.contains(&name) {
            continue;
        }
        if let Some(offset) = probe_offset(&file, &data, addr) {
            out.insert(name.to_owned(), offset);
        }
    }
    Ok(out)
}

/// Defined functions by (address, name); versioned names (`memcpy@@GLIBC_2.14`) by their
/// bare name. Exported ones first.
fn defined_functions<'a>(file: &'a object::File) -> impl Iterator<Item = (u64, &'a str)> {
    file.dynamic_symbols()
        .chain(file.symbols())
        .filter(|sym| sym.kind() == SymbolKind::Text && !sym.is_undefined() && sym.address() != 0)
        .filter_map(|sym| {
            let name = sym.name().ok()?;
            Some((sym.address(), name.split('@').next().unwrap_or(name)))
        })
}

/// The file offset to probe the function at `addr` at (past its landing pad), if a
/// loadable segment holds it.
fn probe_offset(file: &object::File, data: &[u8], addr: u64) -> Option<u64> {
    let offset = file.segments().find_map(|seg| {
        let (off, size) = seg.file_range();
        (addr >= seg.address() && addr < seg.address() + size).then(|| addr - seg.address() + off)
    })?;
    Some(past_landing_pad(data, offset))
}

/// Resolves a spec into the functions it names. `pid`: a running target whose mappings are
/// searched first for a library named without a path. `reader`: the uid (not root) the
/// session acts for, who must be able to read the file (a file the target maps, it could).
pub fn resolve(
    spec: &str,
    pid: Option<u32>,
    reader: Option<u32>,
) -> Result<Vec<NativeTarget>, NativeError> {
    let (name, pattern) = spec
        .rsplit_once(':')
        .filter(|(n, p)| !n.is_empty() && !p.is_empty())
        .ok_or_else(|| NativeError::BadSpec(spec.into()))?;
    let found = find_binary(name, pid);
    if let Some(uid) = reader {
        let readable = found
            .as_ref()
            .is_some_and(|(path, _, mapped)| *mapped || crate::process::readable_by(uid, path));
        if !readable {
            return Err(NativeError::Unreadable {
                spec: spec.into(),
                name: name.into(),
                uid,
            });
        }
    }
    let (binary, display, _) = found.ok_or_else(|| NativeError::NotFound {
        spec: spec.into(),
        name: name.into(),
    })?;
    let read_err = |reason: String| NativeError::Read {
        spec: spec.into(),
        path: binary.clone(),
        reason,
    };
    let data = crate::binary::map(&binary).map_err(|e| read_err(e.to_string()))?;
    let file = object::File::parse(&*data).map_err(|e| read_err(e.to_string()))?;
    let functions = matching_functions(&file, pattern);
    if functions.is_empty() {
        return Err(NativeError::NoMatch {
            spec: spec.into(),
            path: binary,
            pattern: pattern.into(),
        });
    }
    if functions.len() > MAX_PROBES_PER_SPEC {
        return Err(NativeError::TooMany {
            spec: spec.into(),
            path: binary,
            count: functions.len(),
        });
    }
    functions
        .into_iter()
        .map(|(addr, symbol)| {
            let file_offset = probe_offset(&file, &data, addr).ok_or_else(|| {
                read_err(format!("{symbol} at {addr:#x} is in no loadable segment"))
            })?;
            Ok(NativeTarget {
                spec: spec.into(),
                binary: binary.clone(),
                display: display.clone(),
                symbol,
                file_offset,
            })
        })
        .collect()
}

/// Defined functions whose name matches `pattern`, one per address (aliases such as
/// `getpid`/`__getpid` are one function: the first matching name, exported ones first).
fn matching_functions(file: &object::File, pattern: &str) -> BTreeMap<u64, String> {
    let mut out = BTreeMap::new();
    for (addr, name) in defined_functions(file) {
        if glob(pattern, name) {
            out.entry(addr).or_insert_with(|| name.to_owned());
        }
    }
    out
}

/// `*` matches any run of characters, `?` any one; everything else itself.
pub fn glob(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        match p.get(pi) {
            Some('*') => {
                star = Some((pi, ni));
                pi += 1;
            }
            Some(&c) if c == '?' || c == n[ni] => {
                pi += 1;
                ni += 1;
            }
            _ => match star {
                Some((sp, sn)) => {
                    pi = sp + 1;
                    ni = sn + 1;
                    star = Some((sp, sn + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// Whether a file name is the library or executable `name` names: itself, or `libNAME.so…`
/// / `NAME.so…` (so `c`, `libc` and `libc.so.6` all name libc).
fn names(name: &str, file: &str) -> bool {
    file == name
        || [format!("lib{name}.so"), format!("{name}.so")]
            .iter()
            .any(|stem| file == stem || file.starts_with(&format!("{stem}.")))
}

/// The binary `name` names: where the daemon opens it, and how reports show it.
/// The file `name` names: (where to read it, how to show it, whether the target maps it).
fn find_binary(name: &str, pid: Option<u32>) -> Option<(PathBuf, String, bool)> {
    let shown = |p: PathBuf| {
        let display = p.to_string_lossy().into_owned();
        (p, display, false)
    };
    if name.contains('/') {
        let p = PathBuf::from(name);
        return p.is_file().then(|| shown(p));
    }
    if let Some((path, display)) = pid.and_then(|pid| in_mappings(name, pid)) {
        return Some((path, display, true));
    }
    let dirs = pid
        .map(ld_library_path)
        .unwrap_or_default()
        .into_iter()
        .chain(LIB_DIRS.iter().map(PathBuf::from))
        .chain(ld_so_conf_dirs(Path::new("/etc/ld.so.conf"), 0));
    for dir in dirs {
        if let Some(p) = in_dir(&dir, name) {
            return Some(shown(p));
        }
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .map(shown)
}

/// A file mapped by the process whose name `name` names: where the daemon opens it (see
/// `process::mapped_path`) and its path in the process's maps.
fn in_mappings(name: &str, pid: u32) -> Option<(PathBuf, String)> {
    let maps = crate::process::ProcMaps::read(pid).ok()?;
    maps.entries()
        .iter()
        .filter(|m| m.path.starts_with('/'))
        .filter(|m| names(name, m.path.rsplit('/').next().unwrap_or(&m.path)))
        .find_map(|m| {
            let path = crate::process::mapped_path(pid, m)
                .map_err(|e| tracing::debug!(%e, "mapped library not reachable"))
                .ok()?;
            Some((path, m.path.clone()))
        })
}

/// The target's LD_LIBRARY_PATH (a launched target has tracerctl's environment, which it
/// keeps across its exec).
fn ld_library_path(pid: u32) -> Vec<PathBuf> {
    let env = fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    env.split(|&b| b == 0)
        .filter_map(|kv| kv.strip_prefix(b"LD_LIBRARY_PATH="))
        .flat_map(|v| {
            String::from_utf8_lossy(v)
                .split(':')
                .map(PathBuf::from)
                .collect::<Vec<_>>()
        })
        .filter(|p| p.is_absolute())
        .collect()
}

/// Directories the dynamic loader searches by /etc/ld.so.conf (GPU drivers often live in
/// one of them), following its `include` lines.
fn ld_so_conf_dirs(conf: &Path, depth: u32) -> Vec<PathBuf> {
    let Ok(text) = fs::read_to_string(conf) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for line in text
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
    {
        if let Some(pattern) = line.strip_prefix("include").map(str::trim) {
            if depth > 4 {
                continue;
            }
            let (dir, file_glob) = pattern.rsplit_once('/').unwrap_or(("/etc", pattern));
            let Ok(entries) = fs::read_dir(dir) else {
                continue;
            };
            let mut files: Vec<PathBuf> = entries
                .filter_map(Result::ok)
                .filter(|e| glob(file_glob, &e.file_name().to_string_lossy()))
                .map(|e| e.path())
                .collect();
            files.sort();
            for f in files {
                out.extend(ld_so_conf_dirs(&f, depth + 1));
            }
        } else if line.starts_with('/') {
            out.push(PathBuf::from(line));
        }
    }
    out
}

/// Not a linker script such as the development `libc.so`.
fn is_elf(p: &Path) -> bool {
    let mut magic = [0u8; 4];
    fs::File::open(p)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok_and(|()| magic == *b"\x7fELF")
}

/// The ELF file in `dir` that `name` names; the shortest name wins.
fn in_dir(dir: &Path, name: &str) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .filter(|e| names(name, &e.file_name().to_string_lossy()))
        .map(|e| e.path())
        .filter(|p| is_elf(p))
        .collect();
    found.sort_by_key(|p| (p.as_os_str().len(), p.clone()));
    found.into_iter().next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_go_past_a_landing_pad() {
        let code = [0x90, 0xf3, 0x0f, 0x1e, 0xfa, 0x55, 0x48, 0x89, 0xe5];
        if cfg!(target_arch = "x86_64") {
            assert_eq!(past_landing_pad(&code, 1), 5, "endbr64; push %rbp");
        }
        assert_eq!(past_landing_pad(&code, 5), 5, "push %rbp");
        assert_eq!(past_landing_pad(&code, 7), 7, "too short to be endbr64");
        assert_eq!(past_landing_pad(&code, 100), 100, "outside the file");
    }

    #[test]
    fn globs() {
        assert!(glob("getpid", "getpid"));
        assert!(!glob("getpid", "getppid"));
        assert!(glob("get*id", "getppid"));
        assert!(glob("get*id", "getid"));
        assert!(!glob("get*id", "getpids"));
        assert!(glob("cu*Launch*", "cuLaunchKernelEx"));
        assert!(glob("?etpid", "getpid"));
        assert!(glob("*", "x"));
        assert!(glob("a*b*c", "aXbYbZc"));
        assert!(!glob("a*b*c", "aXbYbZ"));
    }

    #[test]
    fn ld_so_conf_includes_are_followed() {
        let dir = std::env::temp_dir().join(format!("tracer-ldconf-{}", std::process::id()));
        fs::create_dir_all(dir.join("d")).unwrap();
        fs::write(
            dir.join("ld.so.conf"),
            format!("# comment\ninclude {}/d/*.conf\n/opt/a\n", dir.display()),
        )
        .unwrap();
        fs::write(
            dir.join("d/10-gpu.conf"),
            "/usr/local/nvidia/lib64 # driver\n",
        )
        .unwrap();
        fs::write(dir.join("d/skip.txt"), "/nope\n").unwrap();
        let dirs = ld_so_conf_dirs(&dir.join("ld.so.conf"), 0);
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            dirs,
            [
                PathBuf::from("/usr/local/nvidia/lib64"),
                PathBuf::from("/opt/a")
            ]
        );
    }

    #[test]
    fn library_names() {
        assert!(names("c", "libc.so.6"));
        assert!(names("libc", "libc.so.6"));
        assert!(names("libc.so.6", "libc.so.6"));
        assert!(!names("c", "libcrypt.so.1"));
        assert!(names("cuda", "libcuda.so.1"));
        assert!(!names("cuda", "libcudart.so.13"));
    }

    #[test]
    fn one_probe_per_function_whatever_names_it() {
        let specs: Vec<String> = [
            "libc:getpid",
            "libc:getpid",
            "libc.so.6:getp*",
            "libc:getpid",
        ]
        .map(String::from)
        .to_vec();
        let distinct = distinct_specs(&specs);
        assert_eq!(distinct, ["libc:getpid", "libc.so.6:getp*"]);
        let mut all = Vec::new();
        for spec in &distinct {
            all.extend(resolve(spec, None, None).expect("libc on this machine"));
        }
        let getpids = all.iter().filter(|t| t.symbol == "getpid").count();
        assert_eq!(getpids, 2, "both specs match getpid: {all:?}");
        let merged = merge(all.clone());
        assert_eq!(merged.len(), all.len() - 1, "{merged:?}");
        let first = merged.iter().find(|t| t.symbol == "getpid").unwrap();
        assert_eq!(first.spec, "libc:getpid");
    }

    #[test]
    fn libc_getpid_resolves_to_one_function() {
        let t = resolve("libc:getpid", None, None).expect("libc on this machine");
        assert_eq!(t.len(), 1, "{t:?}");
        assert_eq!(t[0].symbol, "getpid");
        assert!(t[0].binary.to_string_lossy().contains("libc.so"));
        assert!(matches!(
            resolve("libc:no_such_function_here", None, None),
            Err(NativeError::NoMatch { .. })
        ));
        assert!(matches!(
            resolve("libnothere:f", None, None),
            Err(NativeError::NotFound { .. })
        ));
        assert!(matches!(
            resolve("getpid", None, None),
            Err(NativeError::BadSpec(_))
        ));
    }
}
