//! CPython 3.14 and 3.15 for the tests, which Debian 12 lacks: Debian's own builds from the
//! `sid` and `experimental` suites of the machine's Debian mirror, unpacked (`dpkg-deb -x`, no
//! maintainer scripts run) into `target/cpython-root` and run chrooted there.
//!
//! - `target/cpython-bin/static/python3.X` runs Debian's `/usr/bin/python3.X` (the interpreter
//!   linked into the executable); `target/cpython-bin/shared/python3.X` runs
//!   `/usr/local/bin/python3.X`, a launcher built here that calls `Py_BytesMain` in
//!   `libpython3.X.so.1.0`. Both are drop-in interpreters for the tests; see [`enter::wrapper`].
//! - `target/cpython-bin/root` links to the root; `target/cpython-bin/not-set-up` holds the reason
//!   when the setup failed, for the tests' skip message.
//! - `target/cpython-apt/`: the private apt state (its own sources, lists and downloads; the
//!   machine's apt state is never touched), the stamp recording what was installed, and the
//!   previous root until the next rebuild (processes may still run in it).
//!
//! Nothing here fails `cargo xtask setup`: without network, apt, a C compiler or root, it prints
//! one line and the tests skip with that reason.
//!
//! This file builds the root and checks its interpreters; `apt` downloads the packages and
//! `enter` makes the wrappers.

pub(crate) mod apt;
mod enter;

use std::{
    fs,
    io::Write,
    os::unix::{ffi::OsStrExt, fs::PermissionsExt},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{bail, ensure, Context, Result};

use apt::download;
use enter::{build_enter, enter_is_current, wrapper};

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
pub(crate) fn quiet(cmd: &mut Command, what: &str) -> Result<String> {
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
pub(crate) fn error_line(stderr: &str) -> String {
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
    fn mountinfo_escapes() {
        assert_eq!(unescape(r"/a\040b\134c"), r"/a b\c");
        assert_eq!(unescape(r"/plain\x"), r"/plain\x");
    }
}
