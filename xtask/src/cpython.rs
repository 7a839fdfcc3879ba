//! CPython 3.14 and 3.15 for the tests, which Debian 12 lacks: Debian's own builds from the
//! `sid` and `experimental` suites of the machine's Debian mirror, unpacked (`dpkg-deb -x`, no
//! maintainer scripts run) into `target/cpython-root` and run chrooted there.
//!
//! - `target/cpython-bin/static/python3.X` runs Debian's `/usr/bin/python3.X` (the interpreter
//!   linked into the executable); `target/cpython-bin/shared/python3.X` runs
//!   `/usr/local/bin/python3.X`, a launcher built here that calls `Py_BytesMain` in
//!   `libpython3.X.so.1.0`. Both are drop-in interpreters for the tests; see [`wrapper`].
//! - `target/cpython-bin/root` links to the root; `target/cpython-bin/not-set-up` holds the reason
//!   when the setup failed, for the tests' skip message.
//! - `target/cpython-apt/`: the private apt state (its own sources, lists and downloads; the
//!   machine's apt state is never touched), the stamp recording what was installed, and the
//!   previous root until the next rebuild (processes may still run in it).
//!
//! Nothing here fails `cargo xtask setup`: without network, apt, a C compiler or root, it prints
//! one line and the tests skip with that reason.

use std::{
    fs,
    io::Write,
    os::unix::{ffi::OsStrExt, fs::PermissionsExt},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{bail, ensure, Context, Result};

const VERSIONS: [&str; 2] = ["3.14", "3.15"];

/// Besides each version's python3.X-minimal, libpython3.X-minimal, libpython3.X-stdlib and
/// libpython3.X: every library those executables, libpython3.X.so and the stdlib's extension
/// modules link to (the Depends of the four, first alternatives, libraries only). No data
/// packages (tzdata, netbase, media-types): the wrappers show the host's /etc files instead.
const LIBRARIES: [&str; 15] = [
    "libc6",
    "libgcc-s1",
    "libexpat1",
    "zlib1g",
    "libzstd1",
    "libssl3t64",
    "libffi8",
    "libbz2-1.0",
    "liblzma5",
    "libsqlite3-0",
    "libuuid1",
    "libncursesw6",
    "libtinfo6",
    "libreadline8t64",
    "libdb5.3t64",
];

/// Files of the host's /etc that the wrappers show inside the root (when the host has them),
/// for name lookups, users and the local time zone.
const ETC_FILES: [&str; 8] = [
    "hosts",
    "resolv.conf",
    "nsswitch.conf",
    "passwd",
    "group",
    "services",
    "protocols",
    "localtime",
];

/// What the launcher of the shared-library builds runs: CPython's own `main`, from libpython.
const LAUNCHER: &str = "\
/* python3.X linked to libpython3.X.so.1.0, made by `cargo xtask setup` (xtask/src/cpython.rs). */
int Py_BytesMain(int argc, char **argv);

int main(int argc, char **argv) { return Py_BytesMain(argc, argv); }
";

/// The wrappers' one helper, `cpython-bin/enter`: a private mount namespace, the binds, the
/// chroot and the exec in one process. Done by `sh`, `unshare` and a `mount` process per bind,
/// it took ~20 ms a start: a third of a short test program's samples. `@ETC_FILES@`: [`ETC_FILES`].
const ENTER: &str = r#"/* enter ROOT WORKSPACE EXE ARGS...: runs EXE chrooted in ROOT, in a mount namespace of its
 * own where WORKSPACE, /tmp, /proc, /dev and a few /etc files are the host's, at the same
 * paths. One process and one exec: the pid, the descriptors, the environment and the exit
 * status are the caller's. Made by `cargo xtask setup` (xtask/src/cpython.rs). */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *const etc_files[] = {@ETC_FILES@ 0};

static void fail(const char *what, const char *path) {
    fprintf(stderr, "enter: %s %s: %s\n", what, path, strerror(errno));
    exit(127);
}

/* Binds the host's `path` at the same path inside `root`. */
static void show(const char *root, const char *path, unsigned long flags) {
    char at[PATH_MAX];
    if (snprintf(at, sizeof at, "%s%s", root, path) >= (int)sizeof at) {
        errno = ENAMETOOLONG;
        fail("mounting", path);
    }
    if (mount(path, at, NULL, MS_BIND | flags, NULL) != 0) fail("mounting", path);
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: enter ROOT WORKSPACE EXE [ARG...]\n");
        return 127;
    }
    const char *root = argv[1], *workspace = argv[2], *exe = argv[3];
    char cwd[PATH_MAX];
    int have_cwd = getcwd(cwd, sizeof cwd) != NULL;
    if (unshare(CLONE_NEWNS) != 0) fail("unsharing", "the mount namespace");
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) fail("making private", "/");
    show(root, workspace, MS_REC);
    show(root, "/tmp", MS_REC);
    show(root, "/proc", MS_REC);
    show(root, "/dev", MS_REC);
    for (const char *const *f = etc_files; *f; f++) {
        char path[64];
        snprintf(path, sizeof path, "/etc/%s", *f);
        if (access(path, F_OK) == 0) show(root, path, 0);
    }
    if (chroot(root) != 0) fail("chroot to", root);
    /* The working directory stays where its path is a directory inside the root, else /. */
    struct stat st;
    if (!(have_cwd && stat(cwd, &st) == 0 && S_ISDIR(st.st_mode) && chdir(cwd) == 0) &&
        chdir("/") != 0)
        fail("chdir to", "/");
    argv[3] = (char *)exe;
    execv(exe, argv + 3);
    fail("running", exe);
}
"#;

/// Run by every new interpreter before it is put in place: the modules the test workloads
/// import (and the stdlib's other shared libraries), then its pid, version and the libpython
/// it maps.
const CHECK: &str = "\
import os, sys, threading, json, cProfile, pstats, multiprocessing, ctypes, asyncio, socket
import subprocess, zlib, bz2, lzma, sqlite3, decimal, uuid, ssl, hashlib, readline, curses
ctypes.CDLL(None)
multiprocessing.Lock()
maps = {l.split('/')[-1].strip() for l in open('/proc/self/maps') if 'libpython' in l}
print(os.getpid(), sys.version.split()[0], *sorted(maps))
";

/// How an interpreter holds CPython.
#[derive(Clone, Copy)]
enum Kind {
    /// Debian's python3.X: the interpreter linked into the executable.
    Static,
    /// The launcher linked to libpython3.X.so.1.0.
    Shared,
}

impl Kind {
    const ALL: [Kind; 2] = [Kind::Static, Kind::Shared];

    fn dir(self) -> &'static str {
        match self {
            Kind::Static => "static",
            Kind::Shared => "shared",
        }
    }

    /// The executable, inside the root.
    fn exe(self, version: &str) -> String {
        match self {
            Kind::Static => format!("/usr/bin/python{version}"),
            Kind::Shared => format!("/usr/local/bin/python{version}"),
        }
    }
}

fn root_dir() -> PathBuf {
    crate::root().join("target").join("cpython-root")
}

/// Where the wrappers are: `static/python3.X` and `shared/python3.X`.
pub fn bin_dir() -> PathBuf {
    crate::root().join("target").join("cpython-bin")
}

fn apt_dir() -> PathBuf {
    crate::root().join("target").join("cpython-apt")
}

/// [`bin_dir`] when all four wrappers are there.
pub fn installed_bin_dir() -> Option<PathBuf> {
    let dir = bin_dir();
    wrappers(&dir)
        .iter()
        .all(|(_, _, p)| p.exists())
        .then_some(dir)
}

fn wrappers(dir: &Path) -> Vec<(&'static str, Kind, PathBuf)> {
    Kind::ALL
        .iter()
        .flat_map(|&kind| {
            VERSIONS.map(|v| (v, kind, dir.join(kind.dir()).join(format!("python{v}"))))
        })
        .collect()
}

/// Makes the interpreters unless the stamp says they are there and they run; never fails.
pub fn setup() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        // Nothing touched: the wrappers need root to run, so they cannot be checked either.
        eprintln!("xtask: CPython 3.14/3.15 not set up: needs root (chroot, mount namespaces)");
        return;
    }
    if let Err(e) = try_setup() {
        let reason = format!("{e:#}").replace('\n', " ");
        if probe_all(&bin_dir()).is_ok() {
            eprintln!(
                "xtask: CPython 3.14/3.15 not refreshed: {reason} (the ones in target/cpython-root still run)"
            );
            return;
        }
        eprintln!("xtask: CPython 3.14/3.15 not set up: {reason}");
        let dir = bin_dir();
        for kind in Kind::ALL {
            let _ = fs::remove_dir_all(dir.join(kind.dir()));
        }
        let _ = fs::remove_file(dir.join("root"));
        let _ = fs::create_dir_all(&dir)
            .and_then(|()| fs::write(dir.join("not-set-up"), format!("{reason}\n")));
    }
}

fn try_setup() -> Result<()> {
    if is_set_up() {
        return Ok(());
    }
    let apt = apt_dir();
    fs::create_dir_all(&apt)?;
    // One setup at a time: another `cargo xtask setup` may be building the same root.
    let lock = fs::File::create(apt.join("lock"))?;
    // SAFETY: the descriptor is open for the whole call; flock only blocks until the lock is ours.
    if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error()).context("locking target/cpython-apt");
    }
    if is_set_up() {
        return Ok(());
    }
    let started = Instant::now();
    eprintln!(
        "xtask: setting up CPython 3.14 and 3.15 from Debian sid/experimental in target/cpython-root"
    );
    let versions = build()?;
    eprintln!(
        "xtask: CPython {} ready in target/cpython-root ({:.0?})",
        versions.join(" and "),
        started.elapsed()
    );
    drop(lock);
    Ok(())
}

/// The stamp's first lines: what the root is made from. A stamp that starts otherwise is stale.
fn stamp_inputs() -> String {
    let packages = packages().join(" ");
    format!(
        "# What `cargo xtask setup` installed in target/cpython-root (xtask/src/cpython.rs);\n\
         # delete this file to rebuild it.\n\
         workspace {}\n\
         packages {packages}\n",
        crate::root().display()
    )
}

fn packages() -> Vec<String> {
    let mut out = Vec::new();
    for v in VERSIONS {
        for p in [
            "python{}-minimal",
            "libpython{}-minimal",
            "libpython{}-stdlib",
            "libpython{}",
        ] {
            out.push(p.replace("{}", v));
        }
    }
    out.extend(LIBRARIES.iter().map(|s| (*s).to_owned()));
    out
}

/// The stamp is current, the wrappers are the ones this code writes, and they run.
fn is_set_up() -> bool {
    let stamp_ok =
        fs::read_to_string(apt_dir().join("stamp")).is_ok_and(|s| s.starts_with(&stamp_inputs()));
    let dir = bin_dir();
    let enter = dir.join("enter");
    stamp_ok
        && enter_is_current(&dir)
        && wrappers(&dir).iter().all(|(v, kind, path)| {
            fs::read_to_string(path).is_ok_and(|s| s == wrapper(&enter, &root_dir(), v, *kind))
        })
        && probe_all(&dir).is_ok()
}

/// Starts every wrapper in `dir` at once and checks each prints its version.
fn probe_all(dir: &Path) -> Result<()> {
    let running: Vec<_> = wrappers(dir)
        .into_iter()
        .map(|(v, _, path)| {
            let child = Command::new(&path)
                .args(["-c", "import sys; print(sys.version.split()[0])"])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn();
            (v, path, child)
        })
        .collect();
    // Every child is waited for, failed or not.
    let mut result = Ok(());
    for (v, path, child) in running {
        let checked = child
            .and_then(std::process::Child::wait_with_output)
            .with_context(|| format!("running {}", path.display()))
            .and_then(|out| {
                let version = String::from_utf8_lossy(&out.stdout);
                ensure!(
                    out.status.success() && version.starts_with(&format!("{v}.")),
                    "{} does not run: {}",
                    path.display(),
                    error_line(&String::from_utf8_lossy(&out.stderr))
                );
                Ok(())
            });
        result = result.and(checked);
    }
    result
}

/// Downloads, unpacks, checks and puts in place; returns the versions installed.
fn build() -> Result<Vec<String>> {
    let apt = apt_dir();
    let build = apt.join("build");
    remove_tree(&build)?;
    remove_tree(&apt.join("retired"))?;
    let debs = download(&apt)?;

    let root = build.join("root");
    fs::create_dir_all(&root)?;
    for deb in &debs {
        quiet(
            Command::new("dpkg-deb").arg("-x").arg(deb).arg(&root),
            "dpkg-deb -x",
        )?;
    }
    for dir in ["bin", "lib", "lib64", "sbin"] {
        if fs::symlink_metadata(root.join(dir)).is_err() {
            std::os::unix::fs::symlink(format!("usr/{dir}"), root.join(dir))?;
        }
    }
    // Mount points of what the wrappers show inside.
    let workspace = crate::root();
    for dir in [
        workspace.as_path(),
        Path::new("/tmp"),
        Path::new("/proc"),
        Path::new("/dev"),
    ] {
        fs::create_dir_all(inside(&root, dir))?;
    }
    fs::create_dir_all(root.join("etc"))?;
    for file in ETC_FILES {
        let path = root.join("etc").join(file);
        if fs::symlink_metadata(&path).is_err() {
            fs::write(&path, "")?;
        }
    }
    build_launchers(&build, &root)?;

    // Every interpreter passes the checks in the new root before it replaces the old one.
    let versions = check(&build.join("bin"), &root)?;
    replace(&root, &root_dir(), &apt.join("retired"))?;

    let dir = bin_dir();
    let enter = build_enter(&dir)?;
    for (v, kind, path) in wrappers(&dir) {
        write_executable(&path, &wrapper(&enter, &root_dir(), v, kind))?;
    }
    let link = dir.join("root");
    if fs::read_link(&link).ok().as_deref() != Some(Path::new("../cpython-root")) {
        let tmp = dir.join("root.tmp");
        let _ = fs::remove_file(&tmp);
        std::os::unix::fs::symlink("../cpython-root", &tmp)?;
        fs::rename(&tmp, &link)?;
    }
    let _ = fs::remove_file(dir.join("not-set-up"));
    probe_all(&dir)?;

    let mut stamp = stamp_inputs();
    for deb in &debs {
        let name = deb.file_name().unwrap_or_default().to_string_lossy();
        let mut parts = name.trim_end_matches(".deb").split('_');
        let (package, version) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        stamp += &format!("installed {package} {}\n", version.replace("%3a", ":"));
    }
    fs::write(apt.join("stamp"), stamp)?;
    remove_tree(&build)?;
    Ok(versions)
}

/// The machine's Debian mirror, with sid and experimental instead of its own suites: updates
/// the private lists, downloads [`packages`] (apt's candidates: sid's, else experimental's) and
/// returns the .deb files.
fn download(apt: &Path) -> Result<Vec<PathBuf>> {
    let source = machine_source()?;
    for dir in [
        "lists/partial",
        "cache/archives/partial",
        "state",
        "sources.list.d",
        "preferences.d",
        "debs",
    ] {
        fs::create_dir_all(apt.join(dir))?;
    }
    let arch = quiet(
        Command::new("dpkg").arg("--print-architecture"),
        "dpkg --print-architecture",
    )?;
    let mut sources = format!(
        "Types: deb\nURIs: {}\nSuites: sid experimental\nComponents: main\nArchitectures: {}\nTargets: Packages\n",
        source.uri,
        arch.trim()
    );
    if let Some(key) = &source.signed_by {
        sources += &format!("Signed-By: {key}\n");
    }
    fs::write(apt.join("sources.list.d/tracer-cpython.sources"), sources)?;

    // apt-get update warns and exits 0 when fetches fail, keeping the lists it had.
    let update = apt_get(apt)
        .arg("update")
        .stdin(Stdio::null())
        .output()
        .context("apt-get update: running apt-get")?;
    let stderr = String::from_utf8_lossy(&update.stderr);
    if !update.status.success() || stderr.contains("Failed to fetch") {
        let failed = format!("apt-get update failed: {}", error_line(&stderr));
        let have_lists = fs::read_dir(apt.join("lists"))?
            .filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().contains("_Packages"));
        ensure!(have_lists, "{failed}");
        eprintln!("xtask: {failed}; using the package lists already in target/cpython-apt");
    }
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
    let mut cmd = Command::new("apt-get");
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

struct Source {
    uri: String,
    /// As the machine's source gives it: a keyring's path, or a key inline (deb822).
    signed_by: Option<String>,
}

/// The machine's main Debian archive (suites like `bookworm`, not `bookworm-security`), from
/// deb822 `.sources` files or one-line `.list` ones.
fn machine_source() -> Result<Source> {
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

/// `ROOT/usr/local/bin/python3.X`: the launcher, built with the host's C compiler and linked to
/// the root's libpython3.X.so.1.0. It runs only inside the root, so it needs no rpath, and the
/// libraries libpython links to are the root's, newer than the host's: left unresolved here.
fn build_launchers(build: &Path, root: &Path) -> Result<()> {
    let src = build.join("launcher.c");
    fs::write(&src, LAUNCHER)?;
    let bin = root.join("usr/local/bin");
    fs::create_dir_all(&bin)?;
    for v in VERSIONS {
        let lib = format!("libpython{v}.so.1.0");
        let libdir = fs::read_dir(root.join("usr/lib"))?
            .filter_map(|e| Some(e.ok()?.path()))
            .find(|d| d.join(&lib).exists())
            .with_context(|| format!("no usr/lib/*/{lib} in the packages"))?;
        quiet(
            Command::new("cc")
                .args(["-O2", "-o"])
                .arg(bin.join(format!("python{v}")))
                .arg(&src)
                .arg("-L")
                .arg(&libdir)
                .arg(format!("-l:{lib}"))
                .arg("-Wl,--allow-shlib-undefined"),
            "cc (the launcher of libpython)",
        )?;
    }
    Ok(())
}

/// Wrappers for `root` in `bin`, each run with [`CHECK`]: it must import the workloads'
/// modules, keep the pid it was started with (exec all the way), be the right version and map
/// libpython only when shared. Returns the versions.
fn check(bin: &Path, root: &Path) -> Result<Vec<String>> {
    let enter = build_enter(bin)?;
    let mut versions = Vec::new();
    for (v, kind, path) in wrappers(bin) {
        write_executable(&path, &wrapper(&enter, root, v, kind))?;
        let child = Command::new(&path)
            .args(["-c", CHECK])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("running {}", path.display()))?;
        let pid = child.id().to_string();
        let out = child.wait_with_output()?;
        let what = format!("{} python{v}", kind.dir());
        ensure!(
            out.status.success(),
            "{what} fails its check: {}",
            error_line(&String::from_utf8_lossy(&out.stderr))
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let words: Vec<&str> = stdout.split_whitespace().collect();
        let libpython = format!("libpython{v}.so.1.0");
        let want_maps: &[&str] = match kind {
            Kind::Static => &[],
            Kind::Shared => &[&libpython],
        };
        ensure!(
            words.first() == Some(&pid.as_str()),
            "{what} runs as another process than the one started (pid {pid}, it says {stdout:?})"
        );
        ensure!(
            words
                .get(1)
                .is_some_and(|w| w.starts_with(&format!("{v}."))),
            "{what} is not CPython {v}: {stdout:?}"
        );
        ensure!(
            words.get(2..) == Some(want_maps),
            "{what} maps {:?}, not {want_maps:?}",
            words.get(2..).unwrap_or_default()
        );
        if matches!(kind, Kind::Static) {
            versions.push(words[1].to_owned());
            // What Debian's own install does (py3compile): without it every start compiles
            // the stdlib modules it imports, and tests (under PYTHONDONTWRITEBYTECODE) time
            // an interpreter no one runs.
            quiet(
                Command::new(&path).args([
                    "-m",
                    "compileall",
                    "-q",
                    "-j0",
                    "-x",
                    "/(test|idlelib|tkinter|turtledemo)/",
                    &format!("/usr/lib/python{v}"),
                ]),
                "compiling the stdlib",
            )?;
        }
    }
    Ok(versions)
}

/// The wrapper script: `python3.X ARGS…` for the tests, as the host's interpreter would run.
///
/// [`ENTER`] (at `enter`) runs `kind.exe(version)` chrooted in `root`, in a private mount
/// namespace where the workspace, /tmp, /proc and /dev (recursively, so /dev/shm too) and
/// [`ETC_FILES`] are the host's, at the same paths. Both steps exec, so the pid the caller
/// started is the interpreter's and stdin, stdout, stderr, the environment and the exit status
/// are the caller's. The working directory stays when its path is a directory inside the root
/// (the workspace, /tmp, but also the root's own /usr), else it is `/`.
fn wrapper(enter: &Path, root: &Path, version: &str, kind: Kind) -> String {
    let exe = kind.exe(version);
    let what = match kind {
        Kind::Static => "as Debian builds it (the interpreter in the executable)",
        Kind::Shared => "linked to libpython (a launcher calling Py_BytesMain)",
    };
    format!(
        "#!/bin/sh\n\
         # CPython {version} {what},\n\
         # from target/cpython-root; written by `cargo xtask setup` (xtask/src/cpython.rs).\n\
         # Runs {exe} chrooted there, in a mount namespace of its own where the\n\
         # workspace, /tmp, /proc, /dev and a few files of /etc are the host's, at the same paths.\n\
         # Every step execs: the pid, stdin, stdout, stderr, the environment and the exit status\n\
         # are the caller's. The working directory stays when its path is a directory inside the\n\
         # root, else it is /.\n\
         exec {} {} {} {exe} \"$@\"\n",
        q(&enter.display().to_string()),
        q(&root.display().to_string()),
        q(&crate::root().display().to_string()),
    )
}

/// Compiles [`ENTER`] to `dir/enter`, with its source beside it (`enter.c`, which
/// [`is_set_up`] compares).
fn build_enter(dir: &Path) -> Result<PathBuf> {
    let etc: String = ETC_FILES.iter().map(|f| format!("\"{f}\", ")).collect();
    let source = ENTER.replace("@ETC_FILES@", &etc);
    fs::create_dir_all(dir)?;
    let src = dir.join("enter.c");
    let exe = dir.join("enter");
    let tmp = dir.join(".enter.tmp");
    fs::write(&src, &source)?;
    quiet(
        Command::new("cc")
            .args(["-O2", "-Wall", "-o"])
            .arg(&tmp)
            .arg(&src),
        "cc (the wrappers' helper)",
    )?;
    fs::rename(&tmp, &exe)?;
    Ok(exe)
}

/// Whether `dir/enter` was built from today's [`ENTER`].
fn enter_is_current(dir: &Path) -> bool {
    let etc: String = ETC_FILES.iter().map(|f| format!("\"{f}\", ")).collect();
    dir.join("enter").exists()
        && fs::read_to_string(dir.join("enter.c"))
            .is_ok_and(|s| s == ENTER.replace("@ETC_FILES@", &etc))
}

/// A word for sh: as it is when it has no special characters, else single-quoted.
fn q(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._+-,:@%=".contains(c));
    if plain {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// `dir`, a host path, inside `root`.
fn inside(root: &Path, dir: &Path) -> PathBuf {
    root.join(dir.strip_prefix("/").unwrap_or(dir))
}

/// Writes an executable by renaming a finished file over the old one.
fn write_executable(path: &Path, text: &str) -> Result<()> {
    if fs::read_to_string(path).is_ok_and(|t| t == text) {
        return Ok(());
    }
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        bail!("{} is not a file's path", path.display());
    };
    fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    let mut f = fs::File::create(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.set_permissions(fs::Permissions::from_mode(0o755))?;
    drop(f);
    fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

/// Puts `new` at `dest` in one step (processes starting there see the old root or the new
/// one, never none), and moves the old one to `retired`: processes may still run in it.
fn replace(new: &Path, dest: &Path, retired: &Path) -> Result<()> {
    if fs::symlink_metadata(dest).is_err() {
        return fs::rename(new, dest).with_context(|| format!("renaming to {}", dest.display()));
    }
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes());
    let (a, b) = (c(new)?, c(dest)?);
    // SAFETY: both are NUL-terminated paths that live across the call; AT_FDCWD needs no fd.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("exchanging {} with the new root", dest.display()));
    }
    fs::create_dir_all(retired)?;
    fs::rename(new, retired.join("root"))?;
    Ok(())
}

/// Removes a tree of ours, unless something is mounted in it: the wrappers' mounts live in
/// their own namespaces, but a removal must never follow a mount into the workspace or /tmp.
fn remove_tree(path: &Path) -> Result<()> {
    if fs::symlink_metadata(path).is_err() {
        return Ok(());
    }
    let mounts = fs::read_to_string("/proc/self/mountinfo")?;
    for line in mounts.lines() {
        let point = unescape(line.split(' ').nth(4).unwrap_or(""));
        ensure!(
            !Path::new(&point).starts_with(path),
            "{point} is mounted inside {}; not removing it",
            path.display()
        );
    }
    fs::remove_dir_all(path).with_context(|| format!("removing {}", path.display()))
}

/// mountinfo's octal escapes (`\040` for a space).
fn unescape(s: &str) -> String {
    let mut out = Vec::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) if b[i] == b'\\' => {
                out.push(d.iter().fold(0u8, |n, c| n.wrapping_mul(8) + (c - b'0')));
                i += 4;
            }
            _ => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Runs a command with its output captured; fails with `what` and the most telling line of its
/// stderr. Returns stdout.
fn quiet(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("{what}: running {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            error_line(&String::from_utf8_lossy(&out.stderr))
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// apt's "Failed to fetch" line, else its first error, else the last line.
fn error_line(stderr: &str) -> String {
    let lines: Vec<&str> = stderr
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let line = lines
        .iter()
        .find(|l| l.contains("Failed to fetch"))
        .or_else(|| lines.iter().find(|l| l.starts_with("E:")))
        .or(lines.last())
        .copied()
        .unwrap_or("no error output");
    line.split_whitespace().collect::<Vec<_>>().join(" ")
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

    #[test]
    fn sh_words() {
        assert_eq!(q("/work/a-b/c_d.e"), "/work/a-b/c_d.e");
        assert_eq!(q("/a b"), "'/a b'");
        assert_eq!(q("it's"), r"'it'\''s'");
        assert_eq!(q(""), "''");
    }

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape(r"/a\040b\134c"), r"/a b\c");
        assert_eq!(unescape(r"/plain\x"), r"/plain\x");
    }
}
