//! `cargo xtask bench interpreters`: what meeting an interpreter nobody probed yet costs other
//! clients. A session counts Python on every process; then copies of the machine's python3
//! (each a file never seen, probed when it execs, while it is held) run a short program one
//! after another, while `tracerctl list` is sent over and over: plain copies (a build tracerd
//! inspected at start: only probed) and altered ones (bytes appended: a build to inspect).
//! Printed side by side: the slowest list then, the slowest of as many lists with no new
//! interpreter, and how long each copy took to run, next to the same copy run again.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};

use super::probes::Daemon;

const COPIES: usize = 4;
const PROGRAM: &str = "def f():\n    pass\nfor _ in range(1000):\n    f()\n";

pub fn run() -> Result<()> {
    let python = static_python()?;
    let dir = tempfile::tempdir()?;
    let daemon = Arc::new(Daemon::start(dir.path(), &[])?);
    daemon.ctl(&["start", "--mode=counting", "--python", "--all"])?;
    std::thread::sleep(Duration::from_secs(2));

    let copies: Vec<PathBuf> = (0..2 * COPIES)
        .map(|i| {
            let d = dir.path().join(format!("copy{i}"));
            std::fs::create_dir(&d)?;
            // Its own name: a session on every process looks at execs of `python…` programs.
            let to = d.join(python.file_name().context("interpreter file name")?);
            std::fs::copy(&python, &to)?;
            if i >= COPIES {
                let mut f = std::fs::OpenOptions::new().append(true).open(&to)?;
                // A size of its own: each is a build of its own.
                std::io::Write::write_all(&mut f, &vec![0; i])?;
            }
            Ok(to)
        })
        .collect::<Result<_>>()?;

    let done = Arc::new(AtomicBool::new(false));
    let lists = {
        let (daemon, done) = (daemon.clone(), done.clone());
        std::thread::spawn(move || -> Result<(Duration, usize)> {
            let (mut slowest, mut n) = (Duration::ZERO, 0);
            while !done.load(Ordering::Relaxed) {
                let t = Instant::now();
                daemon.ctl(&["list"])?;
                slowest = slowest.max(t.elapsed());
                n += 1;
            }
            Ok((slowest, n))
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    let first: Vec<Duration> = copies.iter().map(|c| run_once(c)).collect::<Result<_>>()?;
    std::thread::sleep(Duration::from_millis(200));
    done.store(true, Ordering::Relaxed);
    let (meeting, n) = lists.join().expect("list thread")?;
    let again: Vec<Duration> = copies.iter().map(|c| run_once(c)).collect::<Result<_>>()?;

    let mut idle = Duration::ZERO;
    for _ in 0..n.max(1) {
        let t = Instant::now();
        daemon.ctl(&["list"])?;
        idle = idle.max(t.elapsed());
    }
    println!(
        "a session on every process meets {} copies of {}; times in ms",
        2 * COPIES,
        python.display()
    );
    println!("slowest list while they exec: {:.0}", ms(meeting));
    println!("slowest of as many lists with none: {:.0}", ms(idle));
    println!(
        "{:>6} {:>10} {:>14} {:>14}",
        "copy", "build", "first run", "probed run"
    );
    for (i, (a, b)) in first.iter().zip(&again).enumerate() {
        let build = if i < COPIES { "same" } else { "altered" };
        println!("{i:>6} {build:>10} {:>14.0} {:>14.0}", ms(*a), ms(*b));
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn run_once(python: &Path) -> Result<Duration> {
    let t = Instant::now();
    let status = Command::new(python).args(["-c", PROGRAM]).status()?;
    ensure!(status.success(), "{} failed", python.display());
    Ok(t.elapsed())
}

/// The machine's python3, as a file that holds the eval loop itself: a copy of one that
/// loads libpython would probe the library every copy shares.
fn static_python() -> Result<PathBuf> {
    let out = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .context("running python3")?;
    let named = PathBuf::from(String::from_utf8(out.stdout)?.trim());
    for candidate in [named, PathBuf::from("/usr/bin/python3")] {
        let Ok(path) = candidate.canonicalize() else {
            continue;
        };
        let ldd = Command::new("ldd").arg(&path).output()?;
        if !String::from_utf8_lossy(&ldd.stdout).contains("libpython") {
            return Ok(path);
        }
    }
    bail!("no python3 here holds its eval loop itself (each loads libpython)")
}
