//! `cargo xtask bench longevity`: what tracerd keeps as sessions come and go. Rounds of short
//! sessions (sampling, counting Python calls, tracing), each of `examples/app.py` run by a fresh
//! copy of the interpreter that is deleted once its session ends; then every session is
//! deleted. After each round: tracerd's anonymous memory (RssAnon), its open file descriptors
//! and how many of them hold deleted files, and the size of its session database.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Stdio,
    thread::sleep,
    time::Duration,
};

use anyhow::{ensure, Context, Result};

use super::{python_executable, tracerctl, Daemon};

/// Rounds unless [`ROUNDS_VAR`] asks for another number.
const ROUNDS: usize = 7;
/// Set to a number of rounds, a longer (or shorter) run: whether memory levels off.
const ROUNDS_VAR: &str = "TRACER_BENCH_ROUNDS";
/// Sessions a round, the three modes in turn.
const SESSIONS: usize = 30;
const MODES: [&[&str]; 3] = [
    &["--mode=sampling"],
    &["--mode=counting", "--python"],
    &["--mode=tracing"],
];

pub fn run() -> Result<()> {
    let rounds = match std::env::var(ROUNDS_VAR) {
        Ok(n) => n
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .with_context(|| format!("{ROUNDS_VAR}={n}: a number of rounds, 1 or more"))?,
        Err(_) => ROUNDS,
    };
    let dir = tempfile::tempdir()?;
    let daemon = Daemon::start(dir.path())?;
    let python = python_executable()?;
    let app = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/app.py");
    let db = dir.path().join("state/sessions.redb");
    println!("{rounds} rounds of {SESSIONS} sessions, each round deleted; interpreter {} (a copy a session)", python.display());
    println!("round  RssAnon MiB  fds  deleted fds  database KiB");
    report(0, &daemon, &db)?;
    for round in 1..=rounds {
        for i in 0..SESSIONS {
            let copy = dir.path().join(format!("python-{round}-{i}"));
            fs::copy(&python, &copy).context("copying the interpreter")?;
            let out = tracerctl(&daemon)
                .arg("start")
                .args(MODES[i % MODES.len()])
                .args(["--format", "json", "-o", "/dev/null", "--"])
                .arg(&copy)
                .arg(&app)
                .stdout(Stdio::null())
                .output()?;
            ensure!(
                out.status.success(),
                "session failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            fs::remove_file(&copy)?;
        }
        for id in session_ids(&daemon)? {
            let out = tracerctl(&daemon).args(["delete", &id]).output()?;
            ensure!(out.status.success(), "deleting {id} failed");
        }
        // The daemon's sweep (every second) finishes what ending sessions leave to it.
        sleep(Duration::from_secs(2));
        report(round, &daemon, &db)?;
    }
    Ok(())
}

fn session_ids(daemon: &Daemon) -> Result<Vec<String>> {
    let out = tracerctl(daemon).arg("list").output()?;
    ensure!(out.status.success(), "tracerctl list failed");
    Ok(String::from_utf8(out.stdout)?
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect())
}

fn report(round: usize, daemon: &Daemon, db: &Path) -> Result<()> {
    let pid = daemon.pid();
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .context("no RssAnon in /proc/PID/status")?;
    let fds: Vec<PathBuf> = fs::read_dir(format!("/proc/{pid}/fd"))?
        .filter_map(|e| fs::read_link(e.ok()?.path()).ok())
        .collect();
    let deleted = fds
        .iter()
        .filter(|t| t.to_string_lossy().ends_with(" (deleted)"))
        .count();
    let db_kib = fs::metadata(db).map_or(0, |m| m.len() / 1024);
    println!(
        "{round:>5}  {:>11.1}  {:>3}  {deleted:>11}  {db_kib:>12}",
        rss_kib as f64 / 1024.0,
        fds.len()
    );
    Ok(())
}
