//! Finds the CPython interpreters on PATH (and pyenv's) and, for each, the ELF file that holds
//! its eval loop and which symbols it keeps: what Python probes will need to attach.

use std::{
    collections::BTreeSet,
    env, fs,
    path::{Path, PathBuf},
};

use object::{Object, ObjectSection, ObjectSymbol};

/// The eval loop's entry; present in every CPython 3.x, dynamic symbol table included.
const EVAL_FRAME: &str = "_PyEval_EvalFrameDefault";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interpreter {
    pub path: PathBuf,
    pub version: String,
    /// The executable itself or its libpython.
    pub runtime: PathBuf,
    /// Whether the runtime keeps its full symbol table (`.symtab`), or only dynamic symbols.
    pub full_symbols: bool,
}

/// Every distinct interpreter (by resolved path) found on PATH and under pyenv.
pub fn interpreters() -> Vec<Interpreter> {
    let mut dirs: Vec<PathBuf> = env::var_os("PATH")
        .map(|p| env::split_paths(&p).collect())
        .unwrap_or_default();
    let pyenv = env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| Path::new(&h).join(".pyenv")));
    if let Some(root) = pyenv {
        if let Ok(versions) = fs::read_dir(root.join("versions")) {
            dirs.extend(
                versions
                    .filter_map(Result::ok)
                    .map(|v| v.path().join("bin")),
            );
        }
    }
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for dir in dirs {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.filter_map(Result::ok) {
            let name = entry.file_name();
            let Some(version) = name.to_str().and_then(version_of) else {
                continue;
            };
            let Ok(real) = fs::canonicalize(entry.path()) else {
                continue;
            };
            if !seen.insert(real.clone()) {
                continue;
            }
            if let Some(interp) = inspect(&real, version) {
                out.push(interp);
            }
        }
    }
    // Numerically: 3.8 before 3.10.
    let minor = |i: &Interpreter| {
        i.version
            .split('.')
            .nth(1)
            .and_then(|m| m.parse::<u32>().ok())
    };
    out.sort_by(|a, b| (minor(a), &a.path).cmp(&(minor(b), &b.path)));
    out
}

/// "python3.12" → "3.12". Only versioned names: they say which layout to use.
fn version_of(name: &str) -> Option<String> {
    let v = name.strip_prefix("python")?;
    let (major, minor) = v.split_once('.')?;
    (major == "3" && !minor.is_empty() && minor.chars().all(|c| c.is_ascii_digit()))
        .then(|| v.to_owned())
}

fn inspect(exe: &Path, version: String) -> Option<Interpreter> {
    let data = crate::binary::map(exe).ok()?;
    let file = object::File::parse(&*data).ok()?;
    let runtime = if defines(&file, EVAL_FRAME) {
        exe.to_path_buf()
    } else {
        find_libpython(exe, &version)?
    };
    let full_symbols = if runtime == exe {
        has_symtab(&file)
    } else {
        let lib = crate::binary::map(&runtime).ok()?;
        has_symtab(&object::File::parse(&*lib).ok()?)
    };
    Some(Interpreter {
        path: exe.to_path_buf(),
        version,
        runtime,
        full_symbols,
    })
}

fn defines(file: &object::File, name: &str) -> bool {
    file.symbols()
        .chain(file.dynamic_symbols())
        .any(|s| s.is_definition() && s.name() == Ok(name))
}

fn has_symtab(file: &object::File) -> bool {
    file.section_by_name(".symtab")
        .is_some_and(|s| s.size() > 0)
}

fn find_libpython(exe: &Path, version: &str) -> Option<PathBuf> {
    let name = format!("libpython{version}.so.1.0");
    let near = exe.parent()?.parent()?.join("lib");
    [
        near.as_path(),
        Path::new("/usr/lib/x86_64-linux-gnu"),
        Path::new("/usr/lib64"),
        Path::new("/usr/lib"),
        Path::new("/usr/local/lib"),
    ]
    .iter()
    .map(|d| d.join(&name))
    .find(|p| p.exists())
}

/// The libpython a process's `python3.X` executable will map (its `DT_NEEDED` entry), found
/// where the dynamic loader would look inside the process's root: for a process stopped at
/// exec, before the loader has run. `exe`: the executable's path as the daemon reads it.
pub fn libpython_needed(pid: u32, exe: &Path) -> Option<PathBuf> {
    let data = crate::binary::map(exe).ok()?;
    let file = object::File::parse(&*data).ok()?;
    if defines(&file, EVAL_FRAME) {
        return None;
    }
    let needed = needed_libpython(&data)?;
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let near = exe.parent()?.join("../lib");
    std::iter::once(near)
        .chain(
            [
                "usr/lib/x86_64-linux-gnu",
                "lib/x86_64-linux-gnu",
                "usr/lib64",
                "lib64",
                "usr/lib",
                "lib",
                "usr/local/lib",
            ]
            .iter()
            .map(|d| root.join(d)),
        )
        .map(|d| d.join(&needed))
        .find(|p| p.is_file())
}

/// The `libpython3.X.so…` among an ELF file's `DT_NEEDED` entries.
fn needed_libpython(data: &[u8]) -> Option<String> {
    use object::read::elf::{Dyn, FileHeader, SectionHeader};

    let header = object::elf::FileHeader64::<object::Endianness>::parse(data).ok()?;
    let endian = header.endian().ok()?;
    let sections = header.sections(endian, data).ok()?;
    let (dynamic, link) = sections
        .iter()
        .find_map(|s| s.dynamic(endian, data).ok().flatten())?;
    let strings = sections.strings(endian, data, link).ok()?;
    dynamic.iter().find_map(|d| {
        if d.d_tag(endian) != u64::from(object::elf::DT_NEEDED) {
            return None;
        }
        let name = d.string(endian, strings).ok()?;
        let name = std::str::from_utf8(name).ok()?;
        name.starts_with("libpython3.").then(|| name.to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_come_from_names() {
        assert_eq!(version_of("python3.12").as_deref(), Some("3.12"));
        assert_eq!(version_of("python3"), None);
        assert_eq!(version_of("python3.12-config"), None);
        assert_eq!(version_of("python2.7"), None);
    }

    #[test]
    fn a_launcher_names_its_libpython() {
        let mut checked = 0;
        for i in interpreters().into_iter().filter(|i| i.runtime != i.path) {
            let data = fs::read(&i.path).unwrap();
            let lib =
                needed_libpython(&data).expect("a python3.X without the eval loop links libpython");
            assert!(lib.starts_with(&format!("libpython{}", i.version)), "{lib}");
            checked += 1;
        }
        if checked == 0 {
            tracer_testkit::skip(format_args!(
                "no python3.X linking libpython on this machine"
            ));
        }
    }

    #[test]
    fn interpreters_found_have_an_eval_loop() {
        for i in interpreters() {
            let data = fs::read(&i.runtime).unwrap();
            assert!(
                defines(&object::File::parse(&*data).unwrap(), EVAL_FRAME),
                "{i:?}"
            );
        }
    }
}
