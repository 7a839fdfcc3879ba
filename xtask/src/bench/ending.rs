//! `cargo xtask bench ending`: what a session's end costs other clients. A Python program
//! with N generated functions (1,000 to 150,000, `tests/scripts/many_functions.py`) is
//! counted with uprobes for 3 s (or traced: the trace's functions are named at its end); and
//! 20 processes of `tests/native/probe_target.c` are counted system-wide with `--uprobe` on
//! its 1,000 functions (20,000 rows), stopped (SIGSTOP) before the end so that only tracerd
//! runs. Then, while `tracerctl stop` waits for the session to end (its counts read, its
//! functions named, its report stored), `tracerctl list` is sent over and over. Printed
//! side by side: the slowest list then, and the slowest of as many lists sent while the
//! session simply ran.

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{ensure, Result};
use tracer_tests::ChildGuard;

use super::probes::{build_target, Daemon, Target};

/// (mode, functions) of each Python row.
const ROWS: [(&str, usize); 5] = [
    ("counting", 1_000),
    ("counting", 20_000),
    ("counting", 150_000),
    ("tracing", 20_000),
    ("tracing", 150_000),
];

/// Processes of the native row, each with `probe_target.c`'s 1,000 functions probed.
const NATIVE_PROCESSES: usize = 20;

pub fn run() -> Result<()> {
    println!(
        "a Python program's calls counted or traced with uprobes, and {NATIVE_PROCESSES} \
         processes' native calls counted (rows: process x function), then stopped; times in ms"
    );
    println!(
        "{:>9} {:>10} {:>9} {:>22} {:>26}",
        "mode", "functions", "end", "slowest list (ending)", "slowest list (running)"
    );
    let print = |mode: &str, n: usize, row: Row| {
        println!(
            "{mode:>9} {n:>10} {:>9.0} {:>22.0} {:>26.0}",
            ms(row.end),
            ms(row.ending),
            ms(row.running)
        );
    };
    for (mode, n) in ROWS {
        print(mode, n, measure(mode, n)?);
    }
    print("native", NATIVE_PROCESSES * 1_000, measure_native()?);
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

struct Row {
    end: Duration,
    ending: Duration,
    running: Duration,
}

fn measure(mode: &str, functions: usize) -> Result<Row> {
    let dir = tempfile::tempdir()?;
    let daemon = Daemon::start(dir.path(), &[])?;
    let program = ChildGuard::spawn_ready(
        Command::new("python3")
            .arg(tracer_tests::script("many_functions.py"))
            .arg(functions.to_string()),
    );
    let pid = program.pid().to_string();
    let mode = format!("--mode={mode}");
    let start = [
        "start",
        &mode,
        "--pid",
        &pid,
        "--python",
        "--python-uprobes-only",
    ];
    let id = daemon.ctl(&start)?;
    std::thread::sleep(Duration::from_secs(3));
    stop_while_listing(&daemon, id.trim(), &start, || Ok(()))
}

fn measure_native() -> Result<Row> {
    let dir = tempfile::tempdir()?;
    let exe = build_target(dir.path())?;
    let daemon = Daemon::start(dir.path(), &[])?;
    let mut targets = (0..NATIVE_PROCESSES)
        .map(|_| Target::start(&exe))
        .collect::<Result<Vec<_>>>()?;
    let spec = format!("{}:many_*", exe.display());
    let start = ["start", "--mode=counting", "--all", "--uprobe", &spec];
    let id = daemon.ctl(&start)?;
    std::thread::sleep(Duration::from_secs(3));
    let signal = |targets: &[Target], sig| {
        for t in targets {
            // SAFETY: kill(2) on our own child, which is not reaped before `finish`.
            unsafe { libc::kill(t.pid() as i32, sig) };
        }
    };
    let row = stop_while_listing(&daemon, id.trim(), &start, || {
        signal(&targets, libc::SIGSTOP);
        Ok(())
    });
    signal(&targets, libc::SIGCONT);
    for t in &mut targets {
        t.finish()?;
    }
    row
}

/// Stops session `id` (after `before_stop`) and lists until it has ended; then starts
/// `start` again and lists as often while it runs.
fn stop_while_listing(
    daemon: &Daemon,
    id: &str,
    start: &[&str],
    before_stop: impl FnOnce() -> Result<()>,
) -> Result<Row> {
    before_stop()?;
    let t = Instant::now();
    let mut stop = daemon
        .ctl_command(&["stop", id])
        .stdout(Stdio::null())
        .spawn()?;
    let (mut ending, mut lists) = (Duration::ZERO, 0);
    while stop.try_wait()?.is_none() {
        let l = Instant::now();
        daemon.ctl(&["list"])?;
        ending = ending.max(l.elapsed());
        lists += 1;
    }
    let end = t.elapsed();
    ensure!(stop.wait()?.success(), "tracerctl stop failed");

    // As many lists with a session that only runs.
    daemon.ctl(start)?;
    std::thread::sleep(Duration::from_secs(3));
    let mut running = Duration::ZERO;
    for _ in 0..lists.max(1) {
        let l = Instant::now();
        daemon.ctl(&["list"])?;
        running = running.max(l.elapsed());
    }
    Ok(Row {
        end,
        ending,
        running,
    })
}
