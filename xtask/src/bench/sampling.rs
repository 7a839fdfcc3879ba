//! `cargo xtask bench sampling`: how much a sampling profiler slows the program it samples,
//! measured side by side in one run on the same workloads and the same interpreter: untraced,
//! tracer (`tracerctl start --mode=sampling`), py-spy (`py-spy record`, blocking as by
//! default, and `--nonblocking`) and `perf record -g`, each at 99 and 999 Hz.

use std::{
    fs,
    path::PathBuf,
    process::{Command, Output, Stdio},
};

use anyhow::{bail, ensure, Context, Result};

use super::{clock_ticks, median, python_executable, seconds, Daemon};
use crate::bin_dir;

/// Runs of each condition; a round runs every condition once, and rounds are interleaved.
const RUNS: usize = 3;

const RATES: [u64; 2] = [99, 999];

/// Workloads: (name, what it does).
const WORKLOADS: &[(&str, &str)] = &[
    (
        "pyloop",
        "pure Python: 1,200 rounds of for-loops summing squares (60,000 iterations a round)",
    ),
    (
        "zlib",
        "in C: zlib.compress (level 6) of 2.6 MB of generated text, 60 times",
    ),
];

/// Each workload does a fixed amount of work and prints the seconds it took, start-up (and
/// the zlib workload's input generation) excluded.
const SCRIPT: &str = r#"
import random, sys, time, zlib

def spin(n):
    s = 0
    for i in range(n):
        s += i * i
    return s

def pyloop():
    for _ in range(1200):
        spin(30_000)
        spin(20_000)
        spin(10_000)

def text():
    r = random.Random(42)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(r.choice(letters) for _ in range(r.randint(2, 9))) for _ in range(2000)]
    return " ".join(r.choice(words) for _ in range(400_000)).encode()

name = sys.argv[1]
if name == "pyloop":
    work = pyloop
else:
    data = text()
    def work():
        for _ in range(60):
            zlib.compress(data, 6)
t = time.perf_counter(); work(); t = time.perf_counter() - t
print(f"SECONDS {t:.6f}")
"#;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tool {
    Tracer,
    PySpy,
    PySpyNonblocking,
    Perf,
}

const TOOLS: [Tool; 4] = [
    Tool::Tracer,
    Tool::PySpy,
    Tool::PySpyNonblocking,
    Tool::Perf,
];

impl Tool {
    /// Column header (six characters at most).
    fn header(self) -> &'static str {
        match self {
            Tool::Tracer => "tracer",
            Tool::PySpy => "py-spy",
            Tool::PySpyNonblocking => "spy-nb",
            Tool::Perf => "perf",
        }
    }
}

/// What one run is measured under: untraced (`tool` None) or a profiler at a rate.
#[derive(Clone, Copy)]
struct Condition {
    tool: Option<Tool>,
    hz: u64,
}

/// One run's measurements.
#[derive(Clone, Copy)]
struct Outcome {
    seconds: f64,
    /// Samples the tool took over the whole process (start-up included).
    samples: Option<u64>,
    /// tracerd's CPU time during the run (tracer only).
    daemon_ticks: Option<u64>,
}

struct Bench {
    dir: PathBuf,
    script: PathBuf,
    python: PathBuf,
    py_spy: PathBuf,
    daemon: Daemon,
}

pub(super) fn run() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("bench.py");
    fs::write(&script, SCRIPT)?;
    let python = python_executable()?;
    // py-spy from PyPI, in the virtualenv the tests use it from.
    let py_spy = crate::toolchain::python_test_env()?.join("bin/py-spy");
    ensure!(
        Command::new("perf")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success()),
        "perf is needed (Debian package linux-perf)"
    );
    let bench = Bench {
        dir: dir.path().to_path_buf(),
        script,
        python,
        py_spy,
        daemon: Daemon::start(dir.path())?,
    };

    let mut conditions = vec![Condition { tool: None, hz: 0 }];
    for hz in RATES {
        conditions.extend(TOOLS.map(|tool| Condition {
            tool: Some(tool),
            hz,
        }));
    }

    println!(
        "python: {}; {} runs of each condition, interleaved (one of each per round)",
        bench.python.display(),
        RUNS
    );
    println!(
        "columns: the workload's own time (start-up excluded), median of the runs, untraced (base)"
    );
    println!("         and under each profiler at each rate, with the slowdown against base in %;");
    println!("         the min–max of the runs beneath");
    println!("tracer: tracerctl start --mode=sampling --frequency HZ -- python3 …");
    println!("py-spy: py-spy record --rate HZ --format raw -- python3 … (blocking: stops the process for each sample)");
    println!("spy-nb: the same with --nonblocking (reads the process while it runs)");
    println!("perf:   perf record -F HZ -g -- python3 …");
    println!("load average at the start: {}", load_average());
    println!();

    let mut results = Vec::new();
    for (name, _) in WORKLOADS {
        let mut runs: Vec<Vec<Outcome>> = vec![Vec::new(); conditions.len()];
        for round in 0..RUNS {
            // Rotate the order each round, so that no condition always runs first or last.
            for k in 0..conditions.len() {
                let i = (k + round * 3) % conditions.len();
                runs[i].push(bench.run(name, conditions[i])?);
            }
        }
        results.push(runs);
    }

    let cell = 13;
    let header = |hz: u64| {
        let label = format!(" {hz} Hz ");
        let width = cell * TOOLS.len() - 1;
        let dashes = width.saturating_sub(label.len());
        format!(
            " {}{label}{}",
            "-".repeat(dashes / 2),
            "-".repeat(dashes - dashes / 2)
        )
    };
    println!(
        "{:<19}{}",
        "",
        RATES.iter().map(|&hz| header(hz)).collect::<String>()
    );
    print!("{:<7} {:>11}", "work", "base s");
    for _ in RATES {
        for tool in TOOLS {
            print!(" {:>6} {:>5}", tool.header(), "%");
        }
    }
    println!();
    for ((name, _), runs) in WORKLOADS.iter().zip(&results) {
        let secs = |i: usize| runs[i].iter().map(|o| o.seconds).collect::<Vec<_>>();
        let base = median(secs(0));
        print!("{name:<7} {base:>11.3}");
        for i in 1..conditions.len() {
            let t = median(secs(i));
            print!(" {t:>6.3} {:>+5.1}", (t / base - 1.0) * 100.0);
        }
        println!();
        print!("{:<7} {:>11}", "min–max", spread(&secs(0)));
        for i in 1..conditions.len() {
            print!(" {:>12}", spread(&secs(i)));
        }
        println!();
    }

    println!();
    println!("samples each tool took (median run; the whole process, start-up included),");
    println!(
        "and tracerd's CPU time per run (utime+stime, median run, in {:.0} ms ticks)",
        1000.0 / clock_ticks()
    );
    print!("{:<7}", "work");
    for hz in RATES {
        for tool in TOOLS {
            print!(" {:>12}", format!("{} {hz}", tool.header()));
        }
    }
    for hz in RATES {
        print!(" {:>13}", format!("tracerd {hz} ms"));
    }
    println!();
    for ((name, what), runs) in WORKLOADS.iter().zip(&results) {
        print!("{name:<7}");
        for profiled in &runs[1..] {
            let samples: Option<Vec<f64>> = profiled
                .iter()
                .map(|o| o.samples.map(|s| s as f64))
                .collect();
            match samples {
                Some(s) => print!(" {:>12.0}", median(s)),
                None => print!(" {:>12}", "-"),
            }
        }
        for hz in RATES {
            let i = conditions
                .iter()
                .position(|c| c.tool == Some(Tool::Tracer) && c.hz == hz)
                .expect("tracer runs at every rate");
            let ticks = runs[i]
                .iter()
                .map(|o| o.daemon_ticks.unwrap_or(0) as f64)
                .collect();
            print!(" {:>13.0}", median(ticks) * 1000.0 / clock_ticks());
        }
        println!();
        println!("        {what}");
    }
    println!("load average at the end: {}", load_average());
    drop(bench);
    println!();
    super::offcpu::run()
}

/// The 1, 5 and 15 minute load averages: how busy the machine was besides the bench.
fn load_average() -> String {
    let avg = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    avg.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

/// `min–max` of some seconds.
fn spread(v: &[f64]) -> String {
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{min:.3}–{max:.3}")
}

impl Bench {
    fn run(&self, workload: &str, c: Condition) -> Result<Outcome> {
        let hz = c.hz.to_string();
        let mut outcome = Outcome {
            seconds: 0.0,
            samples: None,
            daemon_ticks: None,
        };
        let out = match c.tool {
            None => Command::new(&self.python)
                .arg(&self.script)
                .arg(workload)
                .output()?,
            Some(Tool::Tracer) => {
                let report = self.dir.join("report.json");
                let before = self.daemon.cpu_ticks();
                let out = checked(
                    "tracerctl",
                    Command::new(bin_dir().join("tracerctl"))
                        .arg("--socket")
                        .arg(&self.daemon.socket)
                        .args(["start", "--mode=sampling", "--frequency", &hz])
                        .args(["--format", "json", "-o"])
                        .arg(&report)
                        .arg("--")
                        .args(self.command(workload)),
                )?;
                outcome.daemon_ticks = Some(self.daemon.cpu_ticks() - before);
                let json: serde_json::Value = serde_json::from_str(&fs::read_to_string(&report)?)
                    .context("tracer's JSON report")?;
                outcome.samples = json["profile"]["unwinding"]["samples"].as_u64();
                out
            }
            Some(tool @ (Tool::PySpy | Tool::PySpyNonblocking)) => {
                let raw = self.dir.join("py-spy.txt");
                let _ = fs::remove_file(&raw);
                let mut cmd = Command::new(&self.py_spy);
                cmd.args(["record", "--rate", &hz, "--format", "raw", "-o"])
                    .arg(&raw);
                if tool == Tool::PySpyNonblocking {
                    cmd.arg("--nonblocking");
                }
                let out = checked("py-spy", cmd.arg("--").args(self.command(workload)))?;
                // Raw output is folded stacks: `frame;frame;… COUNT` per line.
                outcome.samples = Some(
                    fs::read_to_string(&raw)?
                        .lines()
                        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
                        .sum(),
                );
                out
            }
            Some(Tool::Perf) => {
                let data = self.dir.join("perf.data");
                let _ = fs::remove_file(&data);
                let out = checked(
                    "perf record",
                    Command::new("perf")
                        .args(["record", "-F", &hz, "-g", "-o"])
                        .arg(&data)
                        .arg("--")
                        .args(self.command(workload)),
                )?;
                // perf record ends with `[ perf record: Captured and wrote … (N samples) ]`.
                outcome.samples = String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .find_map(|l| l.split_once(" (")?.1.strip_suffix(" samples) ]"))
                    .and_then(|n| n.parse().ok());
                out
            }
        };
        outcome.seconds = seconds(&out.stdout)
            .with_context(|| String::from_utf8_lossy(&out.stderr).into_owned())?;
        Ok(outcome)
    }

    /// The profiled command, the same interpreter binary for every tool.
    fn command<'a>(&'a self, workload: &'a str) -> [&'a std::ffi::OsStr; 3] {
        [
            self.python.as_os_str(),
            self.script.as_os_str(),
            workload.as_ref(),
        ]
    }
}

/// Runs a profiler, its stderr captured; fails with that stderr when it fails.
fn checked(what: &str, cmd: &mut Command) -> Result<Output> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out)
}
