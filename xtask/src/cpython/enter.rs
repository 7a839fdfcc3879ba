//! The wrappers `target/cpython-bin/{static,shared}/python3.X` and their one helper,
//! `enter` (C, built here): what runs an interpreter chrooted in the root, as a drop-in for
//! the host's.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Result;

use super::{quiet, Kind, ETC_FILES};

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

/// The wrapper script: `python3.X ARGS…` for the tests, as the host's interpreter would run.
///
/// [`ENTER`] (at `enter`) runs `kind.exe(version)` chrooted in `root`, in a private mount
/// namespace where the workspace, /tmp, /proc and /dev (recursively, so /dev/shm too) and
/// [`ETC_FILES`] are the host's, at the same paths. Both steps exec, so the pid the caller
/// started is the interpreter's and stdin, stdout, stderr, the environment and the exit status
/// are the caller's. The working directory stays when its path is a directory inside the root
/// (the workspace, /tmp, but also the root's own /usr), else it is `/`.
pub(super) fn wrapper(enter: &Path, root: &Path, version: &str, kind: Kind) -> String {
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
/// [`super::is_set_up`] compares).
pub(super) fn build_enter(dir: &Path) -> Result<PathBuf> {
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
pub(super) fn enter_is_current(dir: &Path) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sh_words() {
        assert_eq!(q("/work/a-b/c_d.e"), "/work/a-b/c_d.e");
        assert_eq!(q("/a b"), "'/a b'");
        assert_eq!(q("it's"), r"'it'\''s'");
        assert_eq!(q(""), "''");
    }
}
