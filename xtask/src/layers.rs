//! The import checks `cargo xtask test` runs:
//!
//! - crates by layer: a workspace crate depends (for its build, not its tests) only on
//!   crates of lower layers, read from `cargo metadata`;
//! - no circle of modules in a crate, read from the `crate::…` and `super::…` paths each file
//!   names, grouped `use` trees included. A module may use its ancestors (a child is part of
//!   its parent); any other circle means two modules can no longer be read, tested or moved
//!   one without the other;
//! - no source file over [`MAX_LINES`] lines outside tests and generated code: a file should
//!   be readable in one sitting.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::Path,
};

use anyhow::{bail, Result};

/// The crates' source roots checked, relative to the repository.
pub const ROOTS: [&str; 15] = [
    "daemon/src",
    "daemon/pycount/src",
    "daemon/pystart/src",
    "daemon/cupti/src",
    "bpf/src",
    "inspect/src",
    "report/src",
    "symbolize/src",
    "ebpf/common/src",
    "ebpf/probes/src",
    "proto/src",
    "cli/src",
    "tests/src",
    "tests/kit/src",
    "xtask/src",
];

/// The longest a source file may be, tests and generated code aside.
const MAX_LINES: usize = 800;

/// Workspace crates by layer, lowest first. A crate missing here fails the check: a new
/// crate is given its place.
const CRATE_LAYERS: [(&str, u32); 14] = [
    // Shared with the BPF programs, and the wire format; what tests do where something
    // they need is missing.
    ("tracer-common", 0),
    ("tracer-proto", 0),
    ("tracer-testkit", 0),
    // What tracer knows of processes and binaries; what a session's results are and how
    // they are rendered. Neither knows a probe or a session.
    ("tracer-inspect", 1),
    ("tracer-report", 1),
    // Loaded into traced processes.
    ("tracer-cupti", 1),
    ("tracer-pycount", 1),
    ("tracer-pystart", 1),
    // The kernel side's loading (knows the binaries it probes), and the naming of what it
    // sends (into the report's frames); neither knows a session.
    ("tracer-bpf", 2),
    ("tracer-symbolize", 2),
    // The daemon, and the CLI that speaks only proto (and escapes names as `report` does).
    ("tracer-daemon", 3),
    ("tracerctl", 3),
    ("tracer-tests", 4),
    // Its benchmarks reuse the tests' helpers.
    ("xtask", 5),
];

pub fn check(repo: &Path) -> Result<()> {
    check_crates(repo)?;
    let mut found = Vec::new();
    for root in ROOTS {
        for circle in circles(&repo.join(root))? {
            found.push(format!("{root}: {}", circle.join(" → ")));
        }
    }
    if !found.is_empty() {
        bail!(
            "modules that import each other in a circle:\n  {}",
            found.join("\n  ")
        );
    }
    println!("xtask: no import circles in {}", ROOTS.join(", "));
    let mut long = Vec::new();
    for root in ROOTS {
        long.extend(too_long(&repo.join(root))?.into_iter().map(|(path, n)| {
            format!(
                "{}: {n} lines",
                path.strip_prefix(repo).unwrap_or(&path).display()
            )
        }));
    }
    if !long.is_empty() {
        bail!(
            "source files over {MAX_LINES} lines (split them by job):\n  {}",
            long.join("\n  ")
        );
    }
    Ok(())
}

/// Files under `root` over [`MAX_LINES`] lines, but for tests (`tests.rs`, a `tests`
/// folder) and generated code (a `generated` folder).
fn too_long(root: &Path) -> Result<Vec<(std::path::PathBuf, usize)>> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_owned()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir)? {
            let path = entry?.path();
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            if path.is_dir() {
                if name != "tests" && name != "generated" {
                    dirs.push(path);
                }
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") || name == "tests.rs" {
                continue;
            }
            let n = fs::read_to_string(&path)?.lines().count();
            if n > MAX_LINES {
                out.push((path, n));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Every workspace crate's build dependencies on other workspace crates go to a lower layer.
fn check_crates(repo: &Path) -> Result<()> {
    let out = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--offline",
        ])
        .current_dir(repo)
        .output()?;
    if !out.status.success() {
        bail!(
            "cargo metadata: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let wrong = out_of_layer(&meta);
    if !wrong.is_empty() {
        bail!("crates out of their layers:\n  {}", wrong.join("\n  "));
    }
    println!("xtask: the workspace crates depend only on lower layers");
    Ok(())
}

/// What `cargo metadata` shows out of [`CRATE_LAYERS`]' order, one line each.
fn out_of_layer(meta: &serde_json::Value) -> Vec<String> {
    let layer = |name: &str| CRATE_LAYERS.iter().find(|(n, _)| *n == name).map(|l| l.1);
    let packages = meta["packages"].as_array().cloned().unwrap_or_default();
    let ours: BTreeSet<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let mut wrong = Vec::new();
    for p in &packages {
        let name = p["name"].as_str().unwrap_or_default();
        let Some(own) = layer(name) else {
            wrong.push(format!("{name} has no layer in xtask/src/layers.rs"));
            continue;
        };
        for d in p["dependencies"].as_array().into_iter().flatten() {
            let dep = d["name"].as_str().unwrap_or_default();
            // Tests may use anything; only what a crate is built from is layered.
            if !ours.contains(dep) || d["kind"].as_str() == Some("dev") {
                continue;
            }
            match layer(dep) {
                Some(l) if l < own => {}
                _ => wrong.push(format!(
                    "{name} (layer {own}) depends on {dep}, not below it"
                )),
            }
        }
    }
    wrong
}

/// Module path (`session::manager`) → its source, for every file under `root`.
fn modules(root: &Path) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![root.to_owned()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(root)?.with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(
                parts.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                parts.pop();
            }
            out.insert(parts.join("::"), fs::read_to_string(&path)?);
        }
    }
    Ok(out)
}

/// The paths a `use` tree or an inline path names, from just after `crate::` (or the
/// module `super::` stands for): `a::{b, c::d}` gives `a::b` and `a::c::d`.
fn paths(prefix: &str, text: &str, out: &mut Vec<String>) -> usize {
    let mut path = prefix.to_owned();
    let mut i = 0;
    let bytes = text.as_bytes();
    loop {
        let start = i;
        while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
            i += 1;
        }
        if i > start {
            if !path.is_empty() {
                path.push_str("::");
            }
            path.push_str(&text[start..i]);
        }
        // `a::{…}`, or a group right after the prefix (`crate::{…}`, `super::{…}`).
        let group = if text[i..].starts_with("::{") {
            Some(3)
        } else if i == start && text[i..].starts_with('{') {
            Some(1)
        } else {
            None
        };
        if let Some(skip) = group {
            i += skip;
            loop {
                while i < bytes.len() && (bytes[i] as char).is_whitespace() {
                    i += 1;
                }
                if i >= bytes.len() || bytes[i] == b'}' {
                    return i + 1;
                }
                i += paths(&path, &text[i..], out);
                while i < bytes.len() && matches!(bytes[i], b',' | b' ' | b'\n' | b'\t' | b'\r') {
                    i += 1;
                }
            }
        } else if text[i..].starts_with("::") {
            i += 2;
        } else {
            out.push(path);
            // Past an ` as name` or whatever ends the path.
            while i < bytes.len() && !matches!(bytes[i], b',' | b'}' | b';') {
                i += 1;
            }
            return i;
        }
    }
}

/// Module → the other modules it names (ancestors left out).
fn graph(mods: &BTreeMap<String, String>) -> BTreeMap<String, BTreeSet<String>> {
    let resolve = |path: &str| -> Option<String> {
        let segs: Vec<&str> = path.split("::").collect();
        (1..=segs.len())
            .rev()
            .map(|n| segs[..n].join("::"))
            .find(|m| mods.contains_key(m))
    };
    let mut g = BTreeMap::new();
    for (m, src) in mods {
        let parent = m.rsplit_once("::").map_or("", |(p, _)| p);
        let mut named = Vec::new();
        for (needle, base) in [("crate::", ""), ("super::", parent)] {
            let mut at = 0;
            while let Some(k) = src[at..].find(needle) {
                let mut from = at + k + needle.len();
                // `crate::` inside a longer name (`tracer_crate::`) is not this crate.
                let before = src[..at + k].chars().next_back();
                let mut base = base;
                // `super::super::`: each one more step up.
                while needle == "super::" && src[from..].starts_with("super::") {
                    base = base.rsplit_once("::").map_or("", |(p, _)| p);
                    from += needle.len();
                }
                at = from;
                if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                    continue;
                }
                paths(base, &src[from..], &mut named);
            }
        }
        let edges: &mut BTreeSet<String> = g.entry(m.clone()).or_default();
        for path in named {
            if let Some(target) = resolve(&path) {
                let ancestor = target.is_empty() || m.starts_with(&format!("{target}::"));
                if target != *m && !ancestor {
                    edges.insert(target);
                }
            }
        }
    }
    g
}

/// Circles of two or more modules (strongly connected components, Tarjan's).
fn circles(root: &Path) -> Result<Vec<Vec<String>>> {
    let g = graph(&modules(root)?);
    struct Walk<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        out: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            for w in self.g.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if self.stack.contains(&w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = Vec::new();
                while let Some(w) = self.stack.pop() {
                    comp.push(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                if comp.len() > 1 {
                    comp.sort();
                    self.out.push(comp);
                }
            }
        }
    }
    let mut walk = Walk {
        g: &g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    Ok(walk.out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn use_trees_give_every_path() {
        let mut out = Vec::new();
        paths("", "a::{b, c::{d, e as f}, g::*};", &mut out);
        out.sort();
        assert_eq!(out, ["a::b", "a::c::d", "a::c::e", "a::g"]);
    }

    #[test]
    fn grouped_uses_right_after_the_prefix_give_every_path() {
        let mut out = Vec::new();
        paths("p", "{a::X, b};", &mut out);
        paths("", "{c::{d::Y, e}, f as g};", &mut out);
        out.sort();
        assert_eq!(out, ["c::d::Y", "c::e", "f", "p::a::X", "p::b"]);
    }

    #[test]
    fn grouped_and_nested_uses_make_circles_too() {
        let dir = tempfile::tempdir().unwrap();
        let w = |p: &str, s: &str| {
            let path = dir.path().join(p);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, s).unwrap();
        };
        w("lib.rs", "mod m; mod top;");
        w("m/mod.rs", "mod a; mod b; mod c;");
        w("m/a.rs", "use super::{b::X, c};");
        w("m/b.rs", "use crate::{m::{c::Y}, top};");
        w("m/c.rs", "use super::super::m::a::Z;");
        w("top.rs", "pub struct T;");
        assert_eq!(circles(dir.path()).unwrap(), [["m::a", "m::b", "m::c"]]);
    }

    #[test]
    fn long_files_are_found_but_tests_and_generated_code_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let w = |p: &str, n: usize| {
            let path = dir.path().join(p);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, "//\n".repeat(n)).unwrap();
        };
        w("lib.rs", MAX_LINES);
        w("big.rs", MAX_LINES + 1);
        w("a/tests.rs", 2 * MAX_LINES);
        w("a/tests/x.rs", 2 * MAX_LINES);
        w("generated/g.rs", 2 * MAX_LINES);
        let long = too_long(dir.path()).unwrap();
        assert_eq!(long, [(dir.path().join("big.rs"), MAX_LINES + 1)]);
    }

    #[test]
    fn a_circle_is_found_and_a_parent_is_not_one() {
        let dir = tempfile::tempdir().unwrap();
        let w = |p: &str, s: &str| {
            let path = dir.path().join(p);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, s).unwrap();
        };
        w("lib.rs", "mod a; mod b; mod p;");
        w("a.rs", "use crate::b::X;");
        w("b.rs", "fn f() { crate::a::y(); }");
        w("p/mod.rs", "mod c; pub use c::Z;");
        w("p/c.rs", "use super::W; use crate::p::V;");
        assert_eq!(circles(dir.path()).unwrap(), [["a", "b"]]);
    }

    #[test]
    fn a_crate_using_a_higher_one_is_out_of_layer() {
        let dep = |name: &str, kind: Option<&str>| serde_json::json!({"name": name, "kind": kind});
        let meta = serde_json::json!({"packages": [
            {"name": "tracer-report", "dependencies": [dep("tracer-daemon", None), dep("serde", None)]},
            {"name": "tracer-daemon", "dependencies": [dep("tracer-report", None), dep("tracer-tests", Some("dev"))]},
            {"name": "tracer-tests", "dependencies": []},
            {"name": "newcomer", "dependencies": []},
        ]});
        assert_eq!(
            out_of_layer(&meta),
            [
                "tracer-report (layer 1) depends on tracer-daemon, not below it",
                "newcomer has no layer in xtask/src/layers.rs",
            ]
        );
    }
}

#[cfg(test)]
mod repository {
    #[test]
    fn keeps_its_layers_and_has_no_import_circles() {
        super::check(&crate::root()).unwrap();
    }
}
