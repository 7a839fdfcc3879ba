//! The session store under faults: a full state disk, a damaged database file, a daemon
//! killed with SIGKILL. Real tracerd, real filesystems, real damage.

use std::{
    io::{BufRead, BufReader, Read, Write},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use serde_json::Value;
use tracer_tests::{
    one_line_error, python, root_or_skip, wait_until, ChildGuard, Daemon, DaemonOptions,
};

/// Bytes per trace record.
const RECORD: u64 = 56;

/// A Python process calling a function in a loop until killed: a stream of trace events.
fn busy_python() -> ChildGuard {
    let mut child = ChildGuard::spawn(
        Command::new(python())
            .args([
                "-c",
                "def f(i):\n    return i\nprint('ready', flush=True)\ni = 0\nwhile True:\n    i = f(i) + 1\n",
            ])
            .stdout(Stdio::piped()),
    );
    let mut line = String::new();
    BufReader::new(child.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line, "ready\n");
    child
}

fn sleeper() -> ChildGuard {
    ChildGuard::spawn(Command::new("sleep").arg("600"))
}

fn report(d: &Daemon, id: &str) -> Value {
    d.report_json(id)
}

fn loss(report: &Value, cause: &str) -> u64 {
    report["losses"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["cause"] == cause)
        .map_or(0, |l| l["count"].as_u64().unwrap())
}

/// A counting session on its own sleeping process, started and stopped; None if the start
/// was refused (then with one line saying why).
fn counting_session(d: &Daemon) -> Option<String> {
    let s = sleeper();
    let out = d.run(&[
        "start",
        "--mode=counting",
        "--events",
        "task-clock",
        "--pid",
        &s.pid().to_string(),
    ]);
    if !out.status.success() {
        let line = one_line_error(&out);
        println!("start refused: {line}");
        return None;
    }
    let id = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    d.ok(&["stop", &id]);
    Some(id)
}

/// A tmpfs of `size`, unmounted on drop (after the daemon using it: declare it first).
struct Tmpfs(tempfile::TempDir);

impl Tmpfs {
    fn mount(size: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tracer-test"])
            .arg(dir.path())
            .status()
            .unwrap()
            .success();
        assert!(ok, "mounting a tmpfs on {}", dir.path().display());
        Self(dir)
    }

    fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0.path()).status();
    }
}

/// Writes `path` until the disk is full.
fn fill(path: &Path) {
    let mut f = std::fs::File::create(path).unwrap();
    let block = vec![0x5a_u8; 4096];
    loop {
        match f.write(&block) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
}

/// The "trace: N events, X MiB" line of `status`, as (events, MiB).
fn trace_progress(d: &Daemon, id: &str) -> (u64, f64) {
    let status = d.ok(&["status", id]);
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("trace:"))
        .unwrap_or_else(|| panic!("no trace line in:\n{status}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    (words[0].parse().unwrap(), words[2].parse().unwrap())
}

#[test]
fn a_full_state_disk_fails_writes_visibly_and_recovers_when_space_returns() {
    if !root_or_skip() {
        return;
    }
    let disk = Tmpfs::mount("5m");
    let mut d = Daemon::start_with(DaemonOptions {
        state_dir: Some(disk.path().join("state")),
        ..DaemonOptions::default()
    });
    let w = busy_python();
    let traced = d
        .ok(&[
            "start",
            "--mode=tracing",
            "--buffer-mb",
            "1",
            "--pid",
            &w.pid().to_string(),
        ])
        .trim()
        .to_owned();
    wait_until(60, "the trace to fill the disk", || {
        d.ok(&["status", &traced]).contains("trace_write_failed")
    });
    // What status claims is what is on disk, not what was attempted.
    let file = disk
        .path()
        .join("state/traces")
        .join(format!("{traced}.events"));
    let (_, mib) = trace_progress(&d, &traced);
    assert!(mib <= 5.0, "status claims {mib} MiB on a 5 MiB disk");

    // Started with room to spare, stopped on a full disk.
    let s = sleeper();
    let early = d
        .ok(&[
            "start",
            "--mode=counting",
            "--events",
            "task-clock",
            "--pid",
            &s.pid().to_string(),
        ])
        .trim()
        .to_owned();
    // Whatever room the trace left, something else takes.
    fill(&disk.path().join("filler"));
    d.ok(&["stop", &early]);
    // While the disk is full, sessions are refused in one line or kept: none is acknowledged
    // and then lost.
    let mut acknowledged: Vec<String> = (0..3).filter_map(|_| counting_session(&d)).collect();
    acknowledged.push(early);
    d.ok(&["stop", &traced]);
    drop(w);
    let r = report(&d, &traced);
    assert!(loss(&r, "trace_write_failed") > 0, "{r}");
    let in_file = r["trace"]["events"].as_u64().unwrap();
    assert_eq!(
        std::fs::metadata(&file).unwrap().len(),
        in_file * RECORD,
        "the file holds whole records, as many as the report says"
    );

    // Deleting frees the space, and the store takes writes again.
    assert_eq!(
        d.ok(&["delete", &traced]).trim(),
        format!("deleted {traced}")
    );
    assert!(!file.exists());
    acknowledged.extend((0..2).map(|_| counting_session(&d).expect("a start with space")));

    d.restart();
    let list = d.ok(&["list"]);
    assert!(!list.contains(&traced), "{list}");
    for id in &acknowledged {
        let line = list
            .lines()
            .find(|l| l.starts_with(id.as_str()))
            .unwrap_or_else(|| panic!("acknowledged session {id} lost:\n{list}"));
        assert!(line.contains("finished (stopped)"), "{line}");
    }
}

/// Overwrites about a third of the file's 4 KiB blocks after its header (at least one) with
/// random bytes, as a bad disk or a stray write would; returns how many.
fn damage(path: &Path) -> usize {
    let mut bytes = std::fs::read(path).unwrap();
    let mut random = std::fs::File::open("/dev/urandom").unwrap();
    let mut pick = vec![0u8; bytes.len() / 4096];
    random.read_exact(&mut pick).unwrap();
    let mut chosen: Vec<usize> = (1..pick.len())
        .filter(|&b| pick[b].is_multiple_of(3))
        .collect();
    if chosen.is_empty() {
        chosen.push(1 + usize::from(pick[0]) % (pick.len() - 1));
    }
    for &b in &chosen {
        random
            .read_exact(&mut bytes[b * 4096..(b + 1) * 4096])
            .unwrap();
    }
    std::fs::write(path, &bytes).unwrap();
    chosen.len()
}

#[test]
fn a_damaged_database_is_moved_aside_and_tracerd_starts() {
    if !root_or_skip() {
        return;
    }
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("tracerd.log");
    let mut d = Daemon::start_with(DaemonOptions {
        log: Some(log.clone()),
        ..DaemonOptions::default()
    });
    for _ in 0..6 {
        counting_session(&d).expect("a session");
    }
    d.stop();
    let db = d.state_dir.join("sessions.redb");
    assert!(damage(&db) > 0);

    d.restart();
    // Serving, with whatever could be kept.
    let list = d.ok(&["list"]);
    let said = std::fs::read_to_string(&log).unwrap();
    match said.lines().find(|l| l.contains("damaged")) {
        Some(line) => {
            let aside: PathBuf = line
                .split_whitespace()
                .find(|w| w.contains("sessions.redb.damaged-"))
                .unwrap_or_else(|| panic!("no path of the damaged file in: {line}"))
                .into();
            assert!(aside.is_file(), "{line}");
            assert_eq!(aside.parent(), Some(d.state_dir.as_path()));
        }
        // Only pages no longer in use were hit (rare): then nothing may be missing.
        None => assert_eq!(list.lines().count(), 1 + 6, "{list}\n{said}"),
    }
    assert!(!said.contains("panicked"), "{said}");
    // The fresh database is used from now on: a new session survives a restart.
    let id = counting_session(&d).expect("a session");
    d.restart();
    let after = d.ok(&["list"]);
    assert!(after.contains(&id), "{after}");
    assert!(after.lines().count() >= list.lines().count(), "{after}");
}

#[test]
fn sessions_running_when_tracerd_is_killed_become_failed_and_deletable() {
    if !root_or_skip() {
        return;
    }
    let mut d = Daemon::start();
    let w = busy_python();
    let traced = d
        .ok(&[
            "start",
            "--mode=tracing",
            "--buffer-mb",
            "1",
            "--pid",
            &w.pid().to_string(),
        ])
        .trim()
        .to_owned();
    let s = sleeper();
    let counted = d
        .ok(&[
            "start",
            "--mode=counting",
            "--events",
            "task-clock",
            "--pid",
            &s.pid().to_string(),
        ])
        .trim()
        .to_owned();
    let file = d.state_dir.join("traces").join(format!("{traced}.events"));
    wait_until(30, "the trace to reach its file", || {
        std::fs::metadata(&file).is_ok_and(|m| m.len() >= 1 << 20)
    });
    d.kill();
    drop(w);
    let written = std::fs::metadata(&file).unwrap().len();

    d.restart();
    let list = d.ok(&["list"]);
    for id in [&traced, &counted] {
        let line = list
            .lines()
            .find(|l| l.starts_with(id.as_str()))
            .unwrap_or_else(|| panic!("session {id} lost:\n{list}"));
        assert!(line.contains("failed"), "{line}");
        let status = d.ok(&["status", id]);
        assert!(status.contains("error:     daemon died"), "{status}");
    }
    // Whatever the trace had written is kept, whole records only.
    let r = report(&d, &traced);
    assert_eq!(r["session"]["state"], "failed");
    assert_eq!(r["session"]["error"], "daemon died");
    assert_eq!(
        r["trace"]["events"].as_u64().unwrap(),
        written / RECORD,
        "{r}"
    );
    let chrome = d.dir.path().join("trace.json");
    d.ok(&[
        "report",
        &traced,
        "--format",
        "chrome",
        "-o",
        chrome.to_str().unwrap(),
    ]);
    assert!(std::fs::metadata(&chrome).unwrap().len() > 0);

    for id in [&traced, &counted] {
        assert_eq!(d.ok(&["delete", id]).trim(), format!("deleted {id}"));
    }
    assert!(!file.exists());
    let left: Vec<_> = std::fs::read_dir(d.state_dir.join("traces"))
        .unwrap()
        .collect();
    assert!(left.is_empty(), "{left:?}");
    d.restart();
    let list = d.ok(&["list"]);
    assert!(
        !list.contains(&traced) && !list.contains(&counted),
        "{list}"
    );
}
