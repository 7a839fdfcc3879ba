//! Part 2 of `cargo xtask bench tracing`: a Python workload's slowdown untraced, counted
//! and traced, interleaved.

use std::{
    fs,
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{ensure, Context, Result};

use super::check;
use crate::bench::{group, median, python_executable, seconds, tracerctl, Daemon};

/// Runs of each condition of part 2, interleaved.
const RUNS: usize = 5;

/// Part 2's workloads: (name, what, calls the timed work makes).
const WORKLOADS: &[(&str, &str, u64)] = &[
    (
        "fib",
        "recursive fib(25): 242,785 calls of a tiny function",
        242_785,
    ),
    (
        "work",
        "200,000 calls of a function doing ~2 µs of work",
        200_001,
    ),
];

const SCRIPT: &str = r#"
import sys, time
def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)
def unit(i):
    s = 0
    for j in range(60):
        s += j * i
    return s
def work():
    for i in range(200_000):
        unit(i)
t = time.perf_counter()
fib(25) if sys.argv[1] == "fib" else work()
t = time.perf_counter() - t
print(f"SECONDS {t:.6f}")
"#;

/// Conditions of part 2.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cond {
    Untraced,
    Counting,
    Tracing,
}

const CONDS: [Cond; 3] = [Cond::Untraced, Cond::Counting, Cond::Tracing];

/// One run of part 2: seconds, and (tracing) events in the trace and events lost.
struct PyRun {
    seconds: f64,
    events: u64,
    lost: u64,
}

pub(super) fn python_part(dir: &Path) -> Result<()> {
    let script = dir.join("bench.py");
    fs::write(&script, SCRIPT)?;
    let python = python_executable()?;
    let sub = dir.join("python");
    fs::create_dir_all(&sub)?;
    let daemon = Daemon::start(&sub)?;
    println!("== Part 2: the traced program's slowdown, tracing next to counting ==");
    println!(
        "python: {}; {RUNS} runs of each condition, interleaved, median; the workload's own time",
        python.display()
    );
    println!("counting: tracerctl start --mode=counting --python -- python3 …");
    println!("tracing:  tracerctl start --mode=tracing --python -- python3 …");
    println!(
        "columns: seconds and slowdown (×) untraced, counting and tracing; the cost of each call"
    );
    println!(
        "         (µs, over untraced); events in the trace (the whole process, start-up included),"
    );
    println!("         events/s over the timed work (its calls / its traced time), events lost");
    println!();
    println!(
        "{:<5} {:>9} {:>9} {:>6} {:>9} {:>6} {:>10} {:>10} {:>7} {:>9} {:>9} {:>5}",
        "work",
        "untraced",
        "counting",
        "×",
        "tracing",
        "×",
        "count µs",
        "trace µs",
        "tr/cnt",
        "events",
        "events/s",
        "lost"
    );
    let mut notes = Vec::new();
    for &(name, what, calls) in WORKLOADS {
        let mut runs: Vec<Vec<PyRun>> = vec![Vec::new(), Vec::new(), Vec::new()];
        for round in 0..RUNS {
            for k in 0..CONDS.len() {
                let i = (k + round) % CONDS.len();
                runs[i].push(py_run(&daemon, &sub, &python, &script, name, CONDS[i])?);
            }
        }
        let secs = |i: usize| median(runs[i].iter().map(|r| r.seconds).collect());
        let (base, counted, traced) = (secs(0), secs(1), secs(2));
        let per_call = |t: f64| (t - base) / calls as f64 * 1e6;
        let events = median(runs[2].iter().map(|r| r.events as f64).collect());
        let lost: u64 = runs[2].iter().map(|r| r.lost).sum();
        println!(
            "{:<5} {:>9.3} {:>9.3} {:>6.1} {:>9.3} {:>6.1} {:>10.2} {:>10.2} {:>7.2} {:>9} {:>9} {:>5}",
            name,
            base,
            counted,
            counted / base,
            traced,
            traced / base,
            per_call(counted),
            per_call(traced),
            per_call(traced) / per_call(counted),
            group(events as u64),
            group((calls as f64 / traced) as u64),
            group(lost)
        );
        println!("      {what}");
        notes.push((name, per_call(counted), per_call(traced), lost));
    }
    for (name, c, t, lost) in notes {
        println!(
            "{name}: tracing costs {t:.2} µs a call, counting {c:.2} µs ({:+.2} µs, {:.2}×); {}",
            t - c,
            t / c,
            if lost == 0 {
                "no event lost".to_owned()
            } else {
                format!("{} events LOST over {RUNS} runs", group(lost))
            }
        );
    }
    Ok(())
}

fn py_run(
    daemon: &Daemon,
    dir: &Path,
    python: &Path,
    script: &Path,
    name: &str,
    cond: Cond,
) -> Result<PyRun> {
    let report = dir.join("report.json");
    let mut cmd = match cond {
        Cond::Untraced => Command::new(python),
        Cond::Counting | Cond::Tracing => {
            let mut c = tracerctl(daemon);
            c.args([
                "start",
                if cond == Cond::Counting {
                    "--mode=counting"
                } else {
                    "--mode=tracing"
                },
                "--python",
                "--format",
                "json",
                "-o",
            ])
            .arg(&report)
            .arg("--")
            .arg(python);
            c
        }
    };
    let out = cmd
        .arg(script)
        .arg(name)
        .stdin(Stdio::null())
        .output()
        .context("running the workload")?;
    check(&out, "the workload")?;
    let mut run = PyRun {
        seconds: seconds(&out.stdout)?,
        events: 0,
        lost: 0,
    };
    if cond == Cond::Tracing {
        let json: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&report)?).context("tracer's JSON report")?;
        run.events = json["trace"]["python_calls"]
            .as_u64()
            .context("no trace.python_calls in the report")?;
        run.lost = crate::bench::losses(&json);
        ensure!(run.events > 0, "the trace holds no Python call");
    }
    Ok(run)
}
