//! The private apt of `cargo xtask setup`: the machine's Debian archive read from its apt
//! sources, and the CPython packages downloaded from its sid and experimental suites with
//! state of its own under `target/cpython-apt`.

use std::{
    fs,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, ensure, Context, Result};

use super::{error_line, packages, quiet};

/// A private apt state in `apt` whose one source is the machine's Debian mirror with
/// `suites` (its own sources list, `NAME.sources`), its lists updated; where the update
/// fails, the lists an earlier one left serve, with a warning.
pub(crate) fn update(apt: &Path, suites: &str, arch: &str, name: &str) -> Result<()> {
    let source = machine_source()?;
    for dir in [
        "lists/partial",
        "cache/archives/partial",
        "state",
        "sources.list.d",
        "preferences.d",
    ] {
        fs::create_dir_all(apt.join(dir))?;
    }
    let mut sources = format!(
        "Types: deb\nURIs: {}\nSuites: {suites}\nComponents: main\nArchitectures: {arch}\nTargets: Packages\n",
        source.uri,
    );
    if let Some(key) = &source.signed_by {
        sources += &format!("Signed-By: {key}\n");
    }
    fs::write(apt.join(format!("sources.list.d/{name}.sources")), sources)?;
    // apt-get update warns and exits 0 when fetches fail, keeping the lists it had.
    let update = apt_tool("apt-get", apt)
        .arg("update")
        .stdin(Stdio::null())
        .output()
        .context("apt-get update: running apt-get")?;
    let stderr = String::from_utf8_lossy(&update.stderr);
    if !update.status.success() || stderr.contains("Failed to fetch") {
        let failed = format!("apt-get update ({suites}) failed: {}", error_line(&stderr));
        let have_lists = fs::read_dir(apt.join("lists"))?
            .filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().contains("_Packages"));
        ensure!(have_lists, "{failed}");
        let shown = apt.strip_prefix(crate::root()).unwrap_or(apt);
        eprintln!(
            "xtask: {failed}; using the package lists already in {}",
            shown.display()
        );
    }
    Ok(())
}

/// The machine's Debian mirror, with sid and experimental instead of its own suites: updates
/// the private lists, downloads [`packages`] (apt's candidates: sid's, else experimental's) and
/// returns the .deb files.
pub(super) fn download(apt: &Path) -> Result<Vec<PathBuf>> {
    let arch = quiet(
        Command::new("dpkg").arg("--print-architecture"),
        "dpkg --print-architecture",
    )?;
    update(apt, "sid experimental", arch.trim(), "tracer-cpython")?;
    fs::create_dir_all(apt.join("debs"))?;
    let debs_dir = apt.join("debs");
    let uris = quiet(
        apt_get(apt)
            .args(["download", "--print-uris"])
            .args(packages()),
        "apt-get download",
    )?;
    // `'URI' FILE SIZE HASH` per package.
    let files: Vec<String> = uris
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1).map(str::to_owned))
        .collect();
    ensure!(
        files.len() == packages().len(),
        "apt-get download --print-uris named {} files for {} packages",
        files.len(),
        packages().len()
    );
    // Files already there are kept (apt checks them), others' versions dropped.
    for entry in fs::read_dir(&debs_dir)? {
        let entry = entry?;
        if entry.file_type()?.is_file()
            && !files
                .iter()
                .any(|f| entry.file_name().as_bytes() == f.as_bytes())
        {
            fs::remove_file(entry.path())?;
        }
    }
    quiet(
        apt_get(apt)
            .arg("download")
            .args(packages())
            .current_dir(&debs_dir),
        "apt-get download",
    )?;
    Ok(files.iter().map(|f| debs_dir.join(f)).collect())
}

/// apt-get with the private state under `apt`: the machine's sources, lists, preferences and
/// package status are not read, and nothing of its own is written.
fn apt_get(apt: &Path) -> Command {
    apt_tool("apt-get", apt)
}

/// `program` (apt-get, apt-cache) with the private state under `apt`, as [`apt_get`]; also
/// the kernel matrix's (`kernels`).
pub(crate) fn apt_tool(program: &str, apt: &Path) -> Command {
    let mut cmd = Command::new(program);
    cmd.arg("-q");
    for (key, value) in [
        ("Dir::Etc::sourcelist", PathBuf::from("/dev/null")),
        ("Dir::Etc::sourceparts", apt.join("sources.list.d")),
        ("Dir::Etc::preferences", PathBuf::from("/dev/null")),
        ("Dir::Etc::preferencesparts", apt.join("preferences.d")),
        ("Dir::State", apt.join("state")),
        ("Dir::State::Lists", apt.join("lists")),
        ("Dir::State::status", PathBuf::from("/dev/null")),
        ("Dir::Cache", apt.join("cache")),
        // Downloads into target/, which the unprivileged _apt user may not be able to write.
        ("APT::Sandbox::User", PathBuf::from("root")),
    ] {
        cmd.arg("-o").arg(format!("{key}={}", value.display()));
    }
    cmd.env("DEBIAN_FRONTEND", "noninteractive");
    cmd
}

pub(crate) struct Source {
    pub(crate) uri: String,
    /// As the machine's source gives it: a keyring's path, or a key inline (deb822).
    pub(crate) signed_by: Option<String>,
}

/// The machine's main Debian archive (suites like `bookworm`, not `bookworm-security`), from
/// deb822 `.sources` files or one-line `.list` ones.
pub(crate) fn machine_source() -> Result<Source> {
    let etc = Path::new("/etc/apt");
    let mut files = vec![etc.join("sources.list")];
    if let Ok(dir) = fs::read_dir(etc.join("sources.list.d")) {
        let mut more: Vec<PathBuf> = dir.filter_map(|e| Some(e.ok()?.path())).collect();
        more.sort();
        files.extend(more);
    }
    for file in files {
        let Ok(text) = fs::read_to_string(&file) else {
            continue;
        };
        let entries = match file.extension().and_then(|e| e.to_str()) {
            Some("sources") => parse_deb822(&text),
            Some("list") => parse_one_line(&text),
            _ if file.ends_with("sources.list") => parse_one_line(&text),
            _ => continue,
        };
        if let Some(entry) = entries.into_iter().find(Entry::is_main_archive) {
            return Ok(Source {
                uri: entry.uris.into_iter().next().unwrap_or_default(),
                signed_by: entry.signed_by,
            });
        }
    }
    bail!("no Debian archive with a main component in the machine's apt sources")
}

struct Entry {
    types: Vec<String>,
    uris: Vec<String>,
    suites: Vec<String>,
    components: Vec<String>,
    signed_by: Option<String>,
    enabled: bool,
}

impl Entry {
    fn is_main_archive(&self) -> bool {
        self.enabled
            && self.uris.first().is_some_and(|u| !u.starts_with("cdrom:"))
            && self.types.iter().any(|t| t == "deb")
            && self.components.iter().any(|c| c == "main")
            && self
                .suites
                .iter()
                .any(|s| !s.is_empty() && !s.contains(['-', '/']))
    }
}

/// Stanzas of `Field: value` lines; continuation lines (a leading space) stay in the value.
fn parse_deb822(text: &str) -> Vec<Entry> {
    let mut stanzas: Vec<Vec<(String, String)>> = vec![Vec::new()];
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        if line.trim().is_empty() {
            stanzas.push(Vec::new());
        } else if line.starts_with([' ', '\t']) {
            if let Some((_, value)) = stanzas.last_mut().and_then(|s| s.last_mut()) {
                value.push('\n');
                value.push_str(line);
            }
        } else if let Some((key, value)) = line.split_once(':') {
            if let Some(s) = stanzas.last_mut() {
                s.push((key.trim().to_ascii_lowercase(), value.trim().to_owned()));
            }
        }
    }
    stanzas
        .into_iter()
        .filter(|s| !s.is_empty())
        .map(|fields| {
            let get = |key: &str| {
                fields
                    .iter()
                    .find(|(k, _)| k == key)
                    .map(|(_, v)| v.clone())
            };
            let words = |key: &str| {
                get(key)
                    .unwrap_or_default()
                    .split_whitespace()
                    .map(str::to_owned)
                    .collect()
            };
            Entry {
                types: words("types"),
                uris: words("uris"),
                suites: words("suites"),
                components: words("components"),
                signed_by: get("signed-by"),
                enabled: get("enabled").is_none_or(|v| v != "no"),
            }
        })
        .collect()
}

/// `deb [signed-by=KEYRING …] URI SUITE COMPONENT…` lines.
fn parse_one_line(text: &str) -> Vec<Entry> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        let Some((kind, mut rest)) = line.split_once(char::is_whitespace) else {
            continue;
        };
        let mut signed_by = None;
        rest = rest.trim_start();
        if let Some(options) = rest.strip_prefix('[') {
            let Some((options, after)) = options.split_once(']') else {
                continue;
            };
            signed_by = options
                .split_whitespace()
                .find_map(|o| o.strip_prefix("signed-by="))
                .map(str::to_owned);
            rest = after;
        }
        let mut words = rest.split_whitespace().map(str::to_owned);
        let (Some(uri), Some(suite)) = (words.next(), words.next()) else {
            continue;
        };
        out.push(Entry {
            types: vec![kind.to_owned()],
            uris: vec![uri],
            suites: vec![suite],
            components: words.collect(),
            signed_by,
            enabled: true,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deb822_main_archive_not_security() {
        let text = "Types: deb\n# a mirror\nURIs: http://mirror.example/debian\n\
                    Suites: bookworm bookworm-updates\nComponents: main\n\
                    Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n\
                    Types: deb\nURIs: http://mirror.example/debian-security\n\
                    Suites: bookworm-security\nComponents: main\n";
        let entries = parse_deb822(text);
        assert_eq!(entries.len(), 2);
        assert!(entries[0].is_main_archive());
        assert!(!entries[1].is_main_archive());
        assert_eq!(entries[0].uris, ["http://mirror.example/debian"]);
        assert_eq!(
            entries[0].signed_by.as_deref(),
            Some("/usr/share/keyrings/debian-archive-keyring.gpg")
        );
    }

    #[test]
    fn deb822_inline_key_and_disabled() {
        let text =
            "Enabled: no\nTypes: deb\nURIs: http://a/debian\nSuites: sid\nComponents: main\n\n\
                    Types: deb\nURIs: http://b/debian\nSuites: trixie\nComponents: main contrib\n\
                    Signed-By:\n -----BEGIN PGP PUBLIC KEY BLOCK-----\n .\n xyz\n";
        let entries = parse_deb822(text);
        assert!(!entries[0].is_main_archive());
        assert!(entries[1].is_main_archive());
        assert_eq!(
            entries[1].signed_by.as_deref(),
            Some("\n -----BEGIN PGP PUBLIC KEY BLOCK-----\n .\n xyz")
        );
    }

    #[test]
    fn one_line_sources() {
        let text = "# deb http://old/debian buster main\n\
                    deb-src http://src/debian bookworm main\n\
                    deb http://security/debian-security bookworm-security main\n\
                    deb [arch=amd64 signed-by=/k.gpg] http://main/debian bookworm main non-free\n";
        let main: Vec<Entry> = parse_one_line(text)
            .into_iter()
            .filter(Entry::is_main_archive)
            .collect();
        assert_eq!(main.len(), 1);
        assert_eq!(main[0].uris, ["http://main/debian"]);
        assert_eq!(main[0].signed_by.as_deref(), Some("/k.gpg"));
    }
}
