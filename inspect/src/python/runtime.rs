//! An interpreter binary (libpython or a `python3.X` with the interpreter linked in): where its
//! eval loop is, and where the handlers of the opcodes that start frames are.
//!
//! The handlers' addresses sit in the eval loop's `opcode_targets` table (computed gotos). With
//! a full symbol table the table is the local symbol `opcode_targets.N`; distribution builds
//! keep only dynamic symbols, and the table is found as the run of 256 code pointers that
//! fall mostly inside `_PyEval_EvalFrameDefault`.

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
};

use object::{
    elf, Object, ObjectSection, ObjectSegment, ObjectSymbol, RelocationFlags, SectionKind,
};

use super::{
    debug_offsets::DebugOffsets,
    layout::{self, Version},
    opcodes, probe_point,
};

const EVAL_FRAME: &str = "_PyEval_EvalFrameDefault";

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum RuntimeError {
    #[error("cannot read {path}: {reason}")]
    Read { path: PathBuf, reason: String },
    #[error("{path} has no {EVAL_FRAME}: not a CPython runtime")]
    NoEvalLoop { path: PathBuf },
    #[error("CPython 3.{minor} ({path}) is not supported: tracer knows 3.10 to 3.15, and later versions through their debug offsets")]
    Unsupported { path: PathBuf, minor: u32 },
    #[error("{path} is a free-threaded CPython build, which tracer cannot read yet")]
    FreeThreaded { path: PathBuf },
    #[error("{path}: {why}")]
    BadOffsets { path: PathBuf, why: String },
    #[error("{path}: calls cannot be counted: {why} (sampling works)")]
    NoCounting { path: PathBuf, why: String },
    #[error("cannot tell the CPython version of {path} from its name")]
    UnknownVersion { path: PathBuf },
    #[error("{path}: no opcode_targets table found (built without computed gotos?), so Python calls cannot be counted exactly")]
    NoOpcodeTable { path: PathBuf },
    #[error("{path} is a tail-calling interpreter build (each opcode handler a function of its own, no opcode table): tracer cannot count its calls yet (sampling works)")]
    TailCalling { path: PathBuf },
}

/// A probe location: file offset in the binary, and what it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbePoint {
    pub file_offset: u64,
    pub what: String,
}

#[derive(Clone, Debug)]
pub struct Runtime {
    pub path: PathBuf,
    pub version: &'static Version,
    pub eval_entry: ProbePoint,
    /// Handlers of RESUME and friends (empty on 3.10, where every call enters the eval loop).
    pub resume: Vec<ProbePoint>,
    /// Handlers of returns and yields (empty on 3.10, where every frame's exit is the eval
    /// loop's return).
    pub exit: Vec<ProbePoint>,
    /// Link-time address of `_PyRuntime`, for walking the thread list.
    pub runtime_symbol: Option<u64>,
    /// Link-time address of `PyGILState_GetThisThreadState`, which tracer's CUDA injection
    /// library calls to find a launching thread's state.
    pub gil_state_symbol: Option<u64>,
    /// (vaddr, file offset, file size) of each loadable segment, to turn mappings into load biases.
    pub segments: Vec<(u64, u64, u64)>,
    /// How the opcode table was found: "symbol" or "scan".
    pub table_found_by: &'static str,
    /// Whether the binary has CPython's experimental JIT built in.
    pub jit_built_in: bool,
    /// Sampling: how to read its processes' asyncio tasks, or why they cannot be read
    /// (not looked for when only probes were asked for).
    pub asyncio: Result<tracer_common::PyAsyncLayout, String>,
}

/// `libpython3.12.so.1.0` or `python3.12` → 12.
pub fn minor_from_name(path: &Path) -> Option<u32> {
    let name = path.file_name()?.to_str()?;
    let rest = name
        .strip_prefix("libpython3.")
        .or_else(|| name.strip_prefix("python3."))?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

impl Runtime {
    pub fn inspect(path: &Path) -> Result<Self, RuntimeError> {
        Self::inspect_with(path, true)
    }

    /// What reading its stacks needs (version, `_PyRuntime`, segments), without looking for
    /// the opcode handlers to probe: quick enough for a process sampled for the first time.
    pub fn inspect_layout(path: &Path) -> Result<Self, RuntimeError> {
        Self::inspect_with(path, false)
    }

    fn inspect_with(path: &Path, probes: bool) -> Result<Self, RuntimeError> {
        let read_err = |reason: String| RuntimeError::Read {
            path: path.to_owned(),
            reason,
        };
        let data = crate::binary::map(path).map_err(|e| read_err(e.to_string()))?;
        let file = object::File::parse(&*data).map_err(|e| read_err(e.to_string()))?;
        let (eval_addr, eval_size) =
            symbol(&file, |n| n == EVAL_FRAME).ok_or_else(|| RuntimeError::NoEvalLoop {
                path: path.to_owned(),
            })?;
        let version = resolve_version(path, &file)?;
        if probes {
            if let Some(why) = version.no_counting {
                return Err(RuntimeError::NoCounting {
                    path: path.to_owned(),
                    why: why.to_owned(),
                });
            }
        }
        let segments = segments(&file);
        let to_offset = |vaddr: u64| file_offset(&segments, vaddr);
        let no_table = || RuntimeError::NoOpcodeTable {
            path: path.to_owned(),
        };
        let eval_entry = ProbePoint {
            file_offset: to_offset(eval_addr).ok_or_else(no_table)?,
            what: EVAL_FRAME.into(),
        };
        let (mut resume, mut exit, mut table_found_by) = (Vec::new(), Vec::new(), "not needed");
        if probes && !version.resume_opcodes.is_empty() {
            let relocs = relative_relocations(&file);
            let (table, how) = match symbol(&file, |n| n.starts_with("opcode_targets")) {
                Some((addr, 2048)) => (read_table(&file, &relocs, addr), "symbol"),
                _ => (scan_table(&file, &relocs, eval_addr, eval_size), "scan"),
            };
            let table = match table {
                Some(t) => t,
                None if tail_calling(&file, &relocs) => {
                    return Err(RuntimeError::TailCalling {
                        path: path.to_owned(),
                    })
                }
                None => return Err(no_table()),
            };
            table_found_by = how;
            let code = probe_point::Code {
                regions: file
                    .sections()
                    .filter(|s| s.kind() == SectionKind::Text)
                    .filter_map(|s| Some((s.address(), s.data().ok()?)))
                    .collect(),
            };
            let mut joins = code.branch_targets();
            joins.extend(table.iter().copied());
            for (ops, points) in [
                (version.resume_opcodes, &mut resume),
                (version.exit_opcodes, &mut exit),
            ] {
                for &(op, name) in ops {
                    let handler = table[usize::from(op)];
                    let (at, how) = probe_point::choose(&code, handler, &joins);
                    points.push(ProbePoint {
                        file_offset: to_offset(at).ok_or_else(no_table)?,
                        what: format!("{name} handler +{:#x}: {how}", at - handler),
                    });
                }
            }
        }
        Ok(Self {
            path: path.to_owned(),
            version,
            eval_entry,
            resume,
            exit,
            runtime_symbol: symbol(&file, |n| n == "_PyRuntime").map(|(a, _)| a),
            gil_state_symbol: symbol(&file, |n| n == "PyGILState_GetThisThreadState")
                .map(|(a, _)| a),
            segments,
            table_found_by,
            jit_built_in: super::jit::built_in_bytes(&data),
            asyncio: if probes {
                Err("not looked for".into())
            } else {
                super::asyncio::layout(path, &file, version.minor).map_err(|e| e.to_string())
            },
        })
    }

    /// The load bias of this binary in a process, from one of its mappings.
    pub fn load_bias(&self, map_start: u64, map_file_offset: u64) -> Option<u64> {
        let (vaddr, off, _) = self.segments.iter().find(|(_, off, size)| {
            map_file_offset >= *off && map_file_offset < off + size.max(&1)
        })?;
        Some(map_start.wrapping_sub(vaddr + (map_file_offset - off)))
    }
}

/// The eval loop's code in this binary, as sorted file-offset ranges: the exported
/// `_PyEval_EvalFrameDefault`, and every part of the function its opcode handlers lie in
/// (by their unwind entries). GCC 16 moves the loop's body out of the symbol, and PGO builds
/// move cold handlers away: a stripped binary names none of those parts, so sampling finds
/// its eval-loop frames by these ranges. Empty for a binary that is no CPython runtime.
pub fn eval_ranges(data: &[u8]) -> Vec<(u64, u64)> {
    let Ok(file) = object::File::parse(data) else {
        return Vec::new();
    };
    let Some((eval, size)) = symbol(&file, |n| n == EVAL_FRAME) else {
        return Vec::new();
    };
    let mut ranges = vec![(eval, eval + size.max(1))];
    let relocs = relative_relocations(&file);
    let table = match symbol(&file, |n| n.starts_with("opcode_targets")) {
        Some((addr, 2048)) => read_table(&file, &relocs, addr),
        _ => scan_table(&file, &relocs, eval, size),
    };
    let mut handlers: Vec<u64> = table.unwrap_or_default();
    handlers.sort_unstable();
    handlers.dedup();
    for h in handlers {
        if ranges.iter().any(|&(a, b)| h >= a && h < b) {
            continue;
        }
        if let Some(part) = crate::unwind::function_range(data, h) {
            ranges.push(part);
        }
    }
    let segments = segments(&file);
    let mut out: Vec<(u64, u64)> = ranges
        .into_iter()
        .filter_map(|(a, b)| {
            let start = file_offset(&segments, a)?;
            Some((start, start + (b - a)))
        })
        .collect();
    out.sort_unstable();
    out
}

/// The layout of the interpreter in `file`: from its own debug offsets (3.13+), checked
/// against tracer's table where it has one; from the file's name for older versions.
fn resolve_version(path: &Path, file: &object::File) -> Result<&'static Version, RuntimeError> {
    let offsets = match DebugOffsets::read(file) {
        Ok(Some(d)) => d,
        // 3.10-3.12 publish no offsets.
        Ok(None) | Err(_) => {
            let minor = minor_from_name(path).ok_or_else(|| RuntimeError::UnknownVersion {
                path: path.to_owned(),
            })?;
            return layout::version(minor).ok_or(RuntimeError::Unsupported {
                path: path.to_owned(),
                minor,
            });
        }
    };
    let minor = offsets.minor();
    if offsets.free_threaded {
        return Err(RuntimeError::FreeThreaded {
            path: path.to_owned(),
        });
    }
    let derived = layout::from_debug_offsets(&offsets).map_err(|why| RuntimeError::BadOffsets {
        path: path.to_owned(),
        why,
    })?;
    let stdlib = opcodes::read(path, minor);
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    let v = match layout::version(minor) {
        Some(table) => {
            let derived = Version {
                probe: layout::with_table_extras(derived.probe, &table.probe),
                ..derived
            };
            if derived.probe != table.probe {
                tracing::warn!(path = %path.display(), "this CPython's debug offsets differ from tracer's 3.{minor} table: using the interpreter's");
            }
            let mut v = Version {
                resume_opcodes: table.resume_opcodes,
                exit_opcodes: table.exit_opcodes,
                ..derived
            };
            if let Ok((file, numbers)) = &stdlib {
                let ours: Vec<(u8, &str)> = table
                    .resume_opcodes
                    .iter()
                    .chain(table.exit_opcodes)
                    .copied()
                    .collect();
                if let Some(d) = opcodes::disagreement(&ours, numbers) {
                    v.no_counting = Some(leak(format!(
                        "its opcode numbers differ from CPython 3.{minor}'s ({}: {d})",
                        file.display()
                    )));
                }
            }
            v
        }
        // A version newer than tracer's tables: its offsets for reading, its standard
        // library for the opcodes to probe.
        None => {
            let mut v = derived;
            v.source = leak(format!(
                "CPython {}'s debug offsets (a version newer than tracer's tables)",
                offsets.version()
            ));
            match stdlib {
                Ok((file, numbers)) => {
                    let pick = |names: &[&'static str]| -> &'static [(u8, &'static str)] {
                        let found: Vec<(u8, &'static str)> = names
                            .iter()
                            .filter_map(|&n| Some((*numbers.get(n)?, n)))
                            .collect();
                        Box::leak(found.into_boxed_slice())
                    };
                    v.resume_opcodes = pick(layout::RESUME_NAMES);
                    v.exit_opcodes = pick(layout::EXIT_NAMES);
                    if v.resume_opcodes.is_empty() || v.exit_opcodes.is_empty() {
                        v.no_counting = Some(leak(format!(
                            "{} names no RESUME or RETURN_VALUE opcode",
                            file.display()
                        )));
                    } else {
                        v.source = leak(format!(
                            "CPython {}'s debug offsets, opcode numbers from {} (a version newer than tracer's tables: counts unverified)",
                            offsets.version(),
                            file.display()
                        ));
                    }
                }
                Err(why) => {
                    v.no_counting = Some(leak(format!(
                        "CPython {} is newer than tracer's tables, and its opcode numbers cannot be read ({why})",
                        offsets.version()
                    )));
                }
            }
            v
        }
    };
    layout::intern(v).map_err(|why| RuntimeError::BadOffsets {
        path: path.to_owned(),
        why,
    })
}

/// A tail-calling build (3.14+, clang): its handlers are functions named `_TAIL_CALL_…`
/// where symbols are kept, and its dispatch table points at them rather than into the
/// eval loop.
fn tail_calling(file: &object::File, relocs: &HashMap<u64, u64>) -> bool {
    if symbol(file, |n| n.starts_with("_TAIL_CALL_")).is_some() {
        return true;
    }
    symbol(file, |n| n.starts_with("INSTRUCTION_TABLE"))
        .is_some_and(|(addr, size)| size == 2048 && read_table(file, relocs, addr).is_some())
}

/// (vaddr, file offset, file size) of each loadable segment.
fn segments(file: &object::File) -> Vec<(u64, u64, u64)> {
    file.segments()
        .map(|s| {
            let (off, size) = s.file_range();
            (s.address(), off, size)
        })
        .collect()
}

/// The file offset of a link-time address, through the segment holding it.
fn file_offset(segments: &[(u64, u64, u64)], vaddr: u64) -> Option<u64> {
    segments
        .iter()
        .find(|(va, _, size)| vaddr >= *va && vaddr < va + size)
        .map(|(va, off, _)| vaddr - va + off)
}

/// Address and size of the first defined symbol (full table first, then dynamic) whose name matches.
fn symbol(file: &object::File, matches: impl Fn(&str) -> bool) -> Option<(u64, u64)> {
    file.symbols()
        .chain(file.dynamic_symbols())
        .find(|s| s.is_definition() && s.name().is_ok_and(&matches))
        .map(|s| (s.address(), s.size()))
}

/// R_X86_64_RELATIVE relocations: slot address → value the loader writes there.
fn relative_relocations(file: &object::File) -> HashMap<u64, u64> {
    let mut out = HashMap::new();
    if let Some(relocs) = file.dynamic_relocations() {
        for (offset, r) in relocs {
            if let RelocationFlags::Elf {
                r_type: elf::R_X86_64_RELATIVE,
            } = r.flags()
            {
                out.insert(offset, r.addend() as u64);
            }
        }
    }
    out
}

/// The pointer stored at `vaddr` once loaded: its relocation's value, or the file's bytes.
fn pointer_at(file: &object::File, relocs: &HashMap<u64, u64>, vaddr: u64) -> Option<u64> {
    if let Some(&v) = relocs.get(&vaddr) {
        return Some(v);
    }
    file.sections().find_map(|s| {
        let start = s.address();
        if vaddr < start || vaddr + 8 > start + s.size() {
            return None;
        }
        let data = s.data().ok()?;
        let at = usize::try_from(vaddr - start).ok()?;
        Some(u64::from_le_bytes(data.get(at..at + 8)?.try_into().ok()?))
    })
}

fn read_table(file: &object::File, relocs: &HashMap<u64, u64>, addr: u64) -> Option<Vec<u64>> {
    (0..256)
        .map(|i| pointer_at(file, relocs, addr + 8 * i))
        .collect()
}

/// Finds the opcode table without symbols: 256 consecutive pointers into executable code with
/// the most distinct targets (a handler each; unused opcodes share one), preferring those
/// inside the eval loop. PGO builds move cold handlers out of the function, so not all of them
/// are inside.
fn scan_table(
    file: &object::File,
    relocs: &HashMap<u64, u64>,
    eval: u64,
    eval_size: u64,
) -> Option<Vec<u64>> {
    // `.text` only: the GOT of a lazily bound executable is also a long run of distinct
    // pointers into code (its PLT stubs).
    let text: Vec<(u64, u64)> = file
        .sections()
        .filter(|s| s.kind() == SectionKind::Text && s.name().is_ok_and(|n| n.starts_with(".text")))
        .map(|s| (s.address(), s.address() + s.size()))
        .collect();
    let in_text = |p: u64| text.iter().any(|&(a, b)| p >= a && p < b);
    let in_eval = |p: u64| p >= eval && p < eval + eval_size.max(1);
    let mut best: Option<((usize, usize), u64)> = None;
    for s in file
        .sections()
        .filter(|s| matches!(s.kind(), SectionKind::Data | SectionKind::ReadOnlyData))
    {
        let start = s.address() & !7;
        let slots = usize::try_from(s.size() / 8).ok()?;
        let ptrs: Vec<u64> = (0..slots as u64)
            .map(|i| pointer_at(file, relocs, start + 8 * i).unwrap_or(0))
            .collect();
        let mut run = 0usize;
        for i in 0..ptrs.len() {
            run = if in_text(ptrs[i]) { run + 1 } else { 0 };
            // Compilers align a 2 KiB array to 32 bytes at least: windows starting elsewhere
            // straddle two tables (3.15 keeps its tracing table right beside this one).
            if run >= 256 && (start + 8 * (i + 1 - 256) as u64).is_multiple_of(32) {
                let first = i + 1 - 256;
                let table = &ptrs[first..=i];
                let distinct: HashSet<u64> = table.iter().copied().collect();
                let inside = distinct.iter().filter(|&&p| in_eval(p)).count();
                // Distinct handlers, not entries: 3.15's JIT builds also keep a tracing table
                // whose 256 entries all lead to one label inside the eval loop. GCC 16 moves
                // the loop's body out of the exported symbol, so entries outside it count too,
                // behind those inside.
                let score = (distinct.len(), inside);
                if distinct.len() >= 128 && best.is_none_or(|(n, _)| score > n) {
                    best = Some((score, start + 8 * first as u64));
                }
            }
        }
    }
    best.and_then(|(_, addr)| read_table(file, relocs, addr))
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    #[test]
    fn versions_from_names() {
        assert_eq!(
            minor_from_name(Path::new("/x/libpython3.12.so.1.0")),
            Some(12)
        );
        assert_eq!(minor_from_name(Path::new("/usr/bin/python3.11")), Some(11));
        assert_eq!(minor_from_name(Path::new("/usr/bin/python3")), None);
    }

    /// Debian's 3.15 from `cargo xtask setup`'s chroot, if there.
    fn debian_315() -> Option<PathBuf> {
        let p =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/cpython-root/usr/bin/python3.15");
        p.exists().then_some(p)
    }

    /// A version tracer has never seen: 3.15 with its debug offsets' version word made 3.16.
    /// Its layout comes from the offsets; counting needs its standard library's opcode table.
    #[test]
    fn a_newer_version_is_read_from_its_debug_offsets() {
        let Some(src) = debian_315() else {
            tracer_testkit::skip(format_args!("CPython 3.15 not set up (cargo xtask setup)"));
            return;
        };
        let mut data = fs::read(&src).unwrap();
        let at = data
            .windows(16)
            .position(|w| &w[..8] == b"xdebugpy" && w[8..16] == 0x030f_02f0u64.to_le_bytes())
            .expect("3.15.2's debug offsets");
        data[at + 8..at + 16].copy_from_slice(&0x0310_00a1u64.to_le_bytes());
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        fs::create_dir_all(&bin).unwrap();
        let exe = bin.join("python3.16");
        fs::write(&exe, &data).unwrap();

        let sampled = Runtime::inspect_layout(&exe).unwrap();
        assert_eq!(sampled.version.minor, 16);
        assert!(sampled.version.index as usize >= layout::VERSIONS.len());
        // All but what no debug offset gives (instrumentation versions: not checked, so a
        // RESUME of stale code counts twice there).
        let v15 = layout::version(15).unwrap();
        assert_eq!(sampled.version.probe.code_instr_version, 0);
        assert_eq!(
            layout::with_table_extras(sampled.version.probe, &v15.probe),
            v15.probe
        );
        let refused = Runtime::inspect(&exe).unwrap_err().to_string();
        assert!(
            refused.contains("newer than tracer's tables")
                && refused.contains("_opcode_metadata.py"),
            "{refused}"
        );

        let lib = dir.path().join("lib/python3.16");
        fs::create_dir_all(&lib).unwrap();
        fs::copy(
            src.parent()
                .unwrap()
                .join("../lib/python3.15/_opcode_metadata.py"),
            lib.join("_opcode_metadata.py"),
        )
        .unwrap();
        let counted = Runtime::inspect(&exe).unwrap();
        let known = Runtime::inspect(&src).unwrap();
        let points = |rt: &Runtime| -> Vec<u64> {
            rt.resume
                .iter()
                .chain(&rt.exit)
                .map(|p| p.file_offset)
                .collect()
        };
        assert_eq!(points(&counted), points(&known));
        assert!(counted.version.source.contains("counts unverified"));
    }

    /// tracer's tables for 3.13+ say what the interpreters' own debug offsets say.
    #[test]
    fn the_tables_agree_with_the_interpreters_debug_offsets() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/cpython-root");
        let mut binaries: Vec<PathBuf> = super::super::discover::interpreters()
            .into_iter()
            .map(|i| i.runtime)
            .collect();
        for v in ["3.14", "3.15"] {
            binaries.push(root.join(format!("usr/bin/python{v}")));
            binaries.push(root.join(format!("usr/lib/x86_64-linux-gnu/libpython{v}.so.1.0")));
        }
        let mut checked = 0;
        for path in binaries.iter().filter(|p| p.exists()) {
            let data = fs::read(path).unwrap();
            let file = object::File::parse(&*data).unwrap();
            let Some(d) = DebugOffsets::read(&file).ok().flatten() else {
                continue;
            };
            let table = layout::version(d.minor()).expect("a table for every version here");
            let derived = layout::from_debug_offsets(&d).unwrap();
            assert_eq!(
                layout::with_table_extras(derived.probe, &table.probe),
                table.probe,
                "{}",
                path.display()
            );
            assert_eq!(
                (
                    derived.code_adaptive,
                    derived.code_linetable,
                    derived.tstate_native_thread_id
                ),
                (
                    table.code_adaptive,
                    table.code_linetable,
                    table.tstate_native_thread_id
                ),
                "{}",
                path.display()
            );
            checked += 1;
        }
        if checked == 0 {
            tracer_testkit::skip(format_args!("no CPython 3.13+ on this machine"));
        }
    }

    /// The scan must find what the symbol table says, on every interpreter that has one.
    #[test]
    fn the_scan_finds_the_symbol_tables_answer() {
        let mut checked = 0;
        for interp in super::super::discover::interpreters() {
            let Some(minor) = minor_from_name(&interp.runtime) else {
                continue;
            };
            let Some(v) = layout::version(minor) else {
                continue;
            };
            if !interp.full_symbols || v.resume_opcodes.is_empty() {
                continue;
            }
            let data = fs::read(&interp.runtime).unwrap();
            let file = object::File::parse(&*data).unwrap();
            let relocs = relative_relocations(&file);
            let (addr, _) = symbol(&file, |n| n.starts_with("opcode_targets")).unwrap();
            let (eval, size) = symbol(&file, |n| n == EVAL_FRAME).unwrap();
            assert_eq!(
                scan_table(&file, &relocs, eval, size),
                read_table(&file, &relocs, addr),
                "{interp:?}"
            );
            checked += 1;
        }
        if checked == 0 {
            tracer_testkit::skip(format_args!(
                "no CPython 3.11+ with a full symbol table on this machine"
            ));
        }
    }
}
