//! `cargo xtask bench first-start`: the first start of each kind of session on a fresh
//! tracerd, until it answers. It loads that kind's BPF programs then, and the kernel's
//! verifier checks them: seconds for the largest.

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context, Result};

use super::probes::Daemon;

pub fn run() -> Result<()> {
    let dir = tempfile::tempdir()?;
    first_starts(dir.path())
}

/// Kinds of session whose first start loads BPF programs, on an idle Python process.
const FIRST_STARTS: [(&str, &[&str]); 4] = [
    ("counting --cuda", &["--mode=counting", "--cuda"]),
    (
        "counting --python (uprobes)",
        &["--mode=counting", "--python", "--python-uprobes-only"],
    ),
    ("sampling", &["--mode=sampling"]),
    ("sampling --off-cpu", &["--mode=sampling", "--off-cpu"]),
];

/// Each kind's first start on a fresh tracerd, until it answers: median of 3.
fn first_starts(dir: &Path) -> Result<()> {
    println!("the first start of each kind on a fresh tracerd (its BPF programs loaded then); ms, median of 3");
    println!("{:<28} {:>9}", "session", "start");
    for (label, args) in FIRST_STARTS {
        let mut times = Vec::new();
        for _ in 0..3 {
            let state = tempfile::tempdir_in(dir)?;
            let mut idle = Command::new("python3")
                .args([
                    "-c",
                    "import time; print('ready', flush=True); time.sleep(600)",
                ])
                .stdout(Stdio::piped())
                .spawn()?;
            let mut line = String::new();
            BufReader::new(idle.stdout.as_mut().context("stdout")?).read_line(&mut line)?;
            let pid = idle.id().to_string();
            let daemon = Daemon::start(state.path(), &[])?;
            let mut start = vec!["start", "--pid", &pid];
            start.extend_from_slice(args);
            let t = Instant::now();
            let started = daemon.ctl(&start);
            times.push(t.elapsed().as_secs_f64() * 1000.0);
            let stopped = started.and_then(|id| daemon.ctl(&["stop", id.trim()]));
            let _ = idle.kill();
            let _ = idle.wait();
            stopped?;
        }
        println!("{label:<28} {:>9.0}", super::median(times));
    }
    Ok(())
}
