//! `cargo xtask bench off-cpu` (also the last part of `bench sampling`): what recording
//! off-CPU time costs at a high context-switch rate. `perf bench sched pipe` (two processes
//! passing a token through pipes, about two switches a round) runs untraced, under
//! `perf sched record` (the kernel's own switch tracer, to a file), and under tracer:
//! sampling alone, with `--off-cpu` on the benchmark itself, with `--off-cpu --all`, and with
//! `--off-cpu` on another process (what every other program pays while a session runs: the
//! programs run at each switch and syscall exit on the machine). Rounds are interleaved.

use std::{fs, process::Command};

use anyhow::{bail, Context, Result};

use super::{group, losses, median, tracerctl, Daemon};

/// Rounds of each condition.
const RUNS: usize = 5;
/// Token round trips a run.
const LOOPS: &str = "300000";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Condition {
    Untraced,
    PerfSched,
    Sampling,
    OffCpu,
    OffCpuAll,
    OffCpuElsewhere,
}

const CONDITIONS: [(Condition, &str); 6] = [
    (Condition::Untraced, "untraced"),
    (
        Condition::PerfSched,
        "perf sched record (every switch, to a file)",
    ),
    (Condition::Sampling, "tracer: sampling at 99 Hz, launched"),
    (Condition::OffCpu, "tracer: sampling --off-cpu, launched"),
    (Condition::OffCpuAll, "tracer: sampling --off-cpu --all"),
    (
        Condition::OffCpuElsewhere,
        "tracer: sampling --off-cpu of another process",
    ),
];

pub(super) fn run() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let daemon = Daemon::start(dir.path())?;
    println!("off-CPU time at a high switch rate: perf bench sched pipe -l {LOOPS}, {RUNS} interleaved rounds");
    let mut ops: Vec<Vec<f64>> = vec![Vec::new(); CONDITIONS.len()];
    let mut switches: Vec<f64> = Vec::new();
    let mut lost = 0;
    for _ in 0..RUNS {
        for (i, (c, _)) in CONDITIONS.iter().enumerate() {
            let ctxt = context_switches();
            let (n, l) = run_one(&daemon, dir.path(), *c)?;
            if *c == Condition::Untraced {
                switches.push((context_switches() - ctxt) as f64);
            }
            ops[i].push(n);
            lost += l;
        }
    }
    let base = median(ops[0].clone());
    let untraced_secs = LOOPS.parse::<f64>()? / base;
    println!(
        "untraced: {} context switches a second on the machine (median run)",
        group((median(switches) / untraced_secs) as u64)
    );
    println!(
        "{:>12} {:>9} {:>19}  condition",
        "rounds/s", "slowdown", "min–max"
    );
    for ((_, what), runs) in CONDITIONS.iter().zip(&ops) {
        let m = median(runs.clone());
        let min = runs.iter().copied().fold(f64::INFINITY, f64::min);
        let max = runs.iter().copied().fold(0.0, f64::max);
        println!(
            "{:>12} {:>8.1}% {:>19}  {what}",
            group(m as u64),
            100.0 * (base / m - 1.0),
            format!("{}–{}", group(min as u64), group(max as u64)),
        );
    }
    println!("tracer's sessions lost {lost} events in all (losses in their reports)");
    Ok(())
}

/// The machine's context switches since boot.
fn context_switches() -> u64 {
    fs::read_to_string("/proc/stat")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("ctxt "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

fn bench_command() -> [&'static str; 5] {
    ["perf", "bench", "sched", "pipe", "-l"]
}

/// One run: the benchmark's rounds a second, and the events tracer's session lost.
fn run_one(daemon: &Daemon, dir: &std::path::Path, c: Condition) -> Result<(f64, u64)> {
    let report = dir.join("report.json");
    let mut bench: Vec<&str> = bench_command().to_vec();
    bench.push(LOOPS);
    let start = |extra: &[&str]| -> Result<String> {
        let out = tracerctl(daemon)
            .args(["start", "--mode=sampling"])
            .args(extra)
            .output()?;
        if !out.status.success() {
            bail!("tracerctl start: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    let stop = |id: &str| -> Result<u64> {
        let stopped = tracerctl(daemon).args(["stop", id]).output()?;
        let out = tracerctl(daemon)
            .args(["report", id, "--format", "json", "-o"])
            .arg(&report)
            .output()?;
        for (what, o) in [("stop", &stopped), ("report", &out)] {
            if !o.status.success() {
                bail!("tracerctl {what}: {}", String::from_utf8_lossy(&o.stderr));
            }
        }
        Ok(losses(&serde_json::from_str(&fs::read_to_string(
            &report,
        )?)?))
    };
    let launched = |extra: &[&str]| -> Result<(String, u64)> {
        let out = tracerctl(daemon)
            .args(["start", "--mode=sampling"])
            .args(extra)
            .args(["--format", "json", "-o"])
            .arg(&report)
            .arg("--")
            .args(&bench)
            .output()?;
        if !out.status.success() {
            bail!("tracerctl start: {}", String::from_utf8_lossy(&out.stderr));
        }
        let lost = losses(&serde_json::from_str(&fs::read_to_string(&report)?)?);
        Ok((String::from_utf8_lossy(&out.stdout).into_owned(), lost))
    };
    let plain = || -> Result<String> {
        let out = Command::new(bench[0]).args(&bench[1..]).output()?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let (text, lost) = match c {
        Condition::Untraced => (plain()?, 0),
        Condition::PerfSched => {
            let out = Command::new("perf")
                .args(["sched", "record", "-o"])
                .arg(dir.join("sched.data"))
                .arg("--")
                .args(&bench)
                .output()?;
            (String::from_utf8_lossy(&out.stdout).into_owned(), 0)
        }
        Condition::Sampling => launched(&[])?,
        Condition::OffCpu => launched(&["--off-cpu"])?,
        Condition::OffCpuAll => {
            let id = start(&["--off-cpu", "--all"])?;
            let text = plain()?;
            (text, stop(&id)?)
        }
        Condition::OffCpuElsewhere => {
            let mut sleeper = Command::new("sleep").arg("600").spawn()?;
            let pid = sleeper.id().to_string();
            let id = start(&["--off-cpu", "--pid", &pid]);
            let text = plain();
            let lost = id.and_then(|id| stop(&id));
            let _ = sleeper.kill();
            let _ = sleeper.wait();
            (text?, lost?)
        }
    };
    let ops = text
        .lines()
        .find_map(|l| l.trim().strip_suffix("ops/sec"))
        .and_then(|n| n.trim().parse::<f64>().ok())
        .with_context(|| format!("perf bench printed no ops/sec: {text}"))?;
    Ok((ops, lost))
}
