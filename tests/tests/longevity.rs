//! What tracerd keeps as sessions come and go: rounds of short sessions of every mode, each
//! round deleted, must leave its open files where the first round left them, hold no file of
//! a deleted binary once the sessions that sampled it have ended, keep its memory small, and
//! give the database's space back once its sessions are deleted.

use std::path::{Path, PathBuf};

use tracer_tests::{python, root_or_skip, Daemon};

/// A Python program that runs long enough to be sampled.
const SPIN: &str = "import time\nt = time.time()\nwhile time.time() - t < 0.3:\n    pass\n";

const MODES: [&[&str]; 3] = [
    &["--mode=sampling", "--frequency", "499"],
    &["--mode=counting", "--python"],
    &["--mode=tracing"],
];

/// Runs `program -c SPIN` under a session of `mode` to its end.
fn session(d: &Daemon, mode: &[&str], program: &Path) {
    let mut args = vec!["start"];
    args.extend(mode);
    args.extend(["--format", "json", "-o", "/dev/null", "--"]);
    args.extend([program.to_str().unwrap(), "-c", SPIN]);
    d.ok(&args);
}

fn delete_all(d: &Daemon) {
    let list = d.ok(&["list"]);
    for id in list
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
    {
        d.ok(&["delete", id]);
    }
    assert_eq!(d.ok(&["list"]).lines().count(), 1, "sessions left");
}

/// tracerd's open files, by what they point at.
fn open_files(d: &Daemon) -> Vec<PathBuf> {
    std::fs::read_dir(format!("/proc/{}/fd", d.pid()))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .collect()
}

/// tracerd's anonymous memory (`RssAnon`), in bytes.
fn anonymous_memory(d: &Daemon) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", d.pid())).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    kib * 1024
}

/// What tracerd may hold at rest, sessions deleted: about 26 MiB here. When it read binaries
/// whole onto the heap, glibc kept 80–200 MB of freed space in its threads' arenas.
const AT_REST: u64 = 64 << 20;

/// A copy of the interpreter, a new binary to the daemon (the copy runs as the original does).
fn copy_of_python(dir: &Path, name: &str) -> PathBuf {
    let copy = dir.join(name);
    std::fs::copy(python(), &copy).unwrap();
    copy
}

#[test]
fn rounds_of_sessions_leave_no_files_behind() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let bins = tempfile::tempdir().unwrap();
    let mut first = None;
    // Sampling most (it is what keeps binaries); counting and tracing Python start slower.
    let modes = [MODES[0], MODES[1], MODES[0], MODES[2]];
    for round in 0..3 {
        for (i, mode) in modes.iter().enumerate() {
            let copy = copy_of_python(bins.path(), &format!("python-{round}-{i}"));
            session(&d, mode, &copy);
            std::fs::remove_file(&copy).unwrap();
        }
        delete_all(&d);
        let files = open_files(&d);
        let pinned: Vec<&PathBuf> = files
            .iter()
            .filter(|f| f.starts_with(bins.path()))
            .collect();
        assert!(
            pinned.is_empty(),
            "round {round}: tracerd still holds deleted binaries whose sessions ended: {pinned:?}"
        );
        let memory = anonymous_memory(&d);
        assert!(
            memory < AT_REST,
            "round {round}: tracerd holds {} MiB of anonymous memory with no session",
            memory >> 20
        );
        // The first round opens what the daemon keeps for good (kallsyms, the symbolizer's
        // thread); later rounds add nothing.
        let first = *first.get_or_insert(files.len());
        assert!(
            files.len() <= first + 2,
            "round {round}: {} open files, {first} after the first round: {files:?}",
            files.len()
        );
    }
}

#[test]
fn deleting_sessions_shrinks_the_database() {
    if !root_or_skip() {
        return;
    }
    let mut d = Daemon::start();
    let db = d.state_dir.join("sessions.redb");
    let size = || std::fs::metadata(&db).unwrap().len();
    let python = python();
    for _ in 0..12 {
        session(&d, MODES[0], &python);
    }
    let full = size();
    // Below this tracerd leaves the file as it is (1 MiB), and the test would prove nothing.
    assert!(
        full > 2 << 20,
        "12 sampling sessions make a {full}-byte database"
    );
    // All but the newest, whose pages at the end of the file keep redb from shrinking it.
    let newest = d.newest_session("");
    let list = d.ok(&["list"]);
    for id in list
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
    {
        if id != newest {
            d.ok(&["delete", id]);
        }
    }
    let emptied = size();
    assert!(
        emptied < full / 2,
        "{full} bytes with 12 sessions, {emptied} with the newest one left"
    );
    // The compacted store still serves, and takes writes, also after a restart.
    d.ok(&["report", &newest, "--format", "json"]);
    session(&d, MODES[1], &python);
    d.restart();
    assert_eq!(d.ok(&["list"]).lines().count(), 3);
    d.ok(&["report", &newest, "--format", "json"]);
}
