//! Opcode numbers from the interpreter's own standard library: `_opcode_metadata.py`
//! (3.13+, beside `opcode.py`) maps every opcode's name to its number, specialised forms
//! included. Used to check tracer's tables, and as the only source for a version it has not
//! seen.

use std::{
    collections::HashMap,
    fs,
    path::{Path, PathBuf},
};

/// Where `_opcode_metadata.py` lies for an interpreter binary: `PREFIX/lib/python3.X/` for
/// `PREFIX/bin/python3.X`, `PREFIX/lib/libpython3.X.so` and Debian's
/// `PREFIX/lib/x86_64-linux-gnu/libpython3.X.so`.
pub fn metadata_file(runtime: &Path, minor: u32) -> Option<PathBuf> {
    let dir = runtime.parent()?;
    let lib = format!("python3.{minor}");
    [
        dir.join("../lib").join(&lib),
        dir.join(&lib),
        dir.join("..").join(&lib),
    ]
    .into_iter()
    .map(|d| d.join("_opcode_metadata.py"))
    .find(|p| p.is_file())
}

/// Every `'NAME': NUMBER` pair of the file (its `opmap` and `_specialized_opmap`), or
/// `NAME=NUMBER` as 3.15 writes them (`frozendict(NAME=…)`).
pub fn parse(text: &str) -> HashMap<String, u8> {
    let mut out = HashMap::new();
    for line in text.lines() {
        let line = line.trim();
        // Entries end with a comma; top-level assignments (`HAVE_ARGUMENT = 43`) do not.
        let Some(line) = line.strip_suffix(',') else {
            continue;
        };
        let Some((name, number)) = line.split_once(':').or_else(|| line.split_once('=')) else {
            continue;
        };
        let name = name.trim().trim_matches(|c| c == '\'' || c == '"');
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_uppercase() || b == b'_') {
            continue;
        }
        if let Ok(n) = number.trim().parse::<u8>() {
            out.insert(name.to_owned(), n);
        }
    }
    out
}

/// The opcode numbers of the interpreter at `runtime`, from its standard library.
pub fn read(runtime: &Path, minor: u32) -> Result<(PathBuf, HashMap<String, u8>), String> {
    let path = metadata_file(runtime, minor).ok_or_else(|| {
        format!(
            "no python3.{minor}/_opcode_metadata.py beside {}",
            runtime.display()
        )
    })?;
    let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let map = parse(&text);
    if map.is_empty() {
        return Err(format!("{}: no opcode numbers in it", path.display()));
    }
    Ok((path, map))
}

/// The first opcode of `table` whose number `stdlib` gives otherwise, as a sentence.
pub fn disagreement(table: &[(u8, &str)], stdlib: &HashMap<String, u8>) -> Option<String> {
    table.iter().find_map(|&(n, name)| match stdlib.get(name) {
        Some(&m) if m != n => Some(format!("{name} is {m} there, {n} in tracer's table")),
        None => Some(format!("it has no {name}")),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_of_both_maps_are_read() {
        let text = "_specialized_opmap = {\n    'RESUME_CHECK': 196,\n}\n\nopmap = {\n    'CACHE': 0,\n    'RESUME': 128,\n    \"INSTRUMENTED_RESUME\": 245,\n}\nHAVE_ARGUMENT = 43\n_specializations = {\n    \"RESUME\": [\n        \"RESUME_CHECK\",\n    ],\n}\n";
        let m = parse(text);
        assert_eq!(m.get("RESUME"), Some(&128));
        assert_eq!(m.get("RESUME_CHECK"), Some(&196));
        assert_eq!(m.get("INSTRUMENTED_RESUME"), Some(&245));
        assert_eq!(m.get("HAVE_ARGUMENT"), None);
        assert_eq!(
            disagreement(&[(128, "RESUME"), (197, "RESUME_CHECK")], &m).as_deref(),
            Some("RESUME_CHECK is 196 there, 197 in tracer's table")
        );
        assert_eq!(disagreement(&[(128, "RESUME")], &m), None);
    }

    #[test]
    fn keyword_form_is_read() {
        let m = parse("opmap = frozendict(\n    RESUME=128,\n    RESUME_CHECK_JIT=201,\n)\n");
        assert_eq!(m.get("RESUME"), Some(&128));
        assert_eq!(m.get("RESUME_CHECK_JIT"), Some(&201));
    }
}
