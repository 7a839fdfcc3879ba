//! `cargo xtask bench counting`: the cost of counting Python calls, measured side by side in
//! one run on the same workloads: untraced, cProfile, a bare uprobe (perf counting hits of a
//! tracefs uprobe at the very probe points tracer uses), and tracer.

use std::{
    fs,
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{bail, Context, Result};

use super::{clock_ticks, median, python_executable, seconds, Daemon};
use crate::bin_dir;

const RUNS: usize = 3;

/// Workloads: (name, what one unit of work is, Python statement run N times).
const WORKLOADS: &[(&str, &str)] = &[
    ("fib", "recursive fib(25): 242,785 calls of a tiny function"),
    ("work", "200,000 calls of a function doing ~2 µs of work"),
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
def run(name):
    if name == "fib":
        fib(25)
    else:
        work()
name, mode = sys.argv[1], sys.argv[2]
if mode == "cprofile":
    import cProfile
    p = cProfile.Profile()
    t = time.perf_counter(); p.enable(); run(name); p.disable(); t = time.perf_counter() - t
else:
    t = time.perf_counter(); run(name); t = time.perf_counter() - t
print(f"SECONDS {t:.6f}")
"#;

pub(super) fn run() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("bench.py");
    fs::write(&script, SCRIPT)?;
    let python = python_executable()?;
    let daemon = Daemon::start(dir.path())?;
    let socket = &daemon.socket;
    let bare = BareProbes::create(&python)?;
    println!(
        "python: {}  ({} runs each, median; the workload's own time, start-up excluded)",
        python.display(),
        RUNS
    );
    println!("columns: seconds and slowdown (×) untraced, under cProfile, under bare uprobes, under tracer --python;");
    println!("         ns per probe hit (bare vs tracer), ns per Python call (tracer vs cProfile), tracerd CPU per run");
    println!(
        "bare uprobe: perf counting a tracefs uprobe at each of tracer's probe points ({})",
        bare.points.join(", ")
    );
    println!();
    println!(
        "{:<6} {:>8} {:>8} {:>6} {:>8} {:>6} {:>8} {:>6} {:>8} {:>8} {:>7} {:>9} {:>10} {:>9}",
        "work",
        "base s",
        "cProf s",
        "×",
        "bare s",
        "×",
        "tracer s",
        "×",
        "bare/hit",
        "ours/hit",
        "vs bare",
        "ours/call",
        "cProf/call",
        "daemon ms"
    );
    for (name, what) in WORKLOADS {
        let plain = |mode: &str| -> Result<f64> {
            let out = Command::new(&python)
                .arg(&script)
                .args([*name, mode])
                .output()?;
            seconds(&out.stdout)
        };
        let base = median((0..RUNS).map(|_| plain("plain")).collect::<Result<_>>()?);
        let cprof = median(
            (0..RUNS)
                .map(|_| plain("cprofile"))
                .collect::<Result<_>>()?,
        );
        let mut hits = 0;
        let bare_t = median(
            (0..RUNS)
                .map(|_| {
                    let (t, h) = bare.run(&python, &script, name)?;
                    hits = h;
                    Ok(t)
                })
                .collect::<Result<_>>()?,
        );
        let mut calls = 0;
        let mut daemon_ticks = Vec::new();
        let traced = median(
            (0..RUNS)
                .map(|_| {
                    let before = daemon.cpu_ticks();
                    let (t, c) = traced(socket, &python, &script, name, dir.path())?;
                    daemon_ticks.push((daemon.cpu_ticks() - before) as f64);
                    calls = c;
                    Ok(t)
                })
                .collect::<Result<_>>()?,
        );
        let tick_ms = 1000.0 / clock_ticks();
        // Both hit the same probe points the same number of times (an entry and an exit
        // per call): per hit, they compare directly.
        let per_bare = (bare_t - base) / hits.max(1) as f64 * 1e9;
        let per_hit = (traced - base) / hits.max(1) as f64 * 1e9;
        let per_call = (traced - base) / calls.max(1) as f64 * 1e9;
        let cprof_call = (cprof - base) / calls.max(1) as f64 * 1e9;
        println!(
            "{:<6} {:>8.3} {:>8.3} {:>6.1} {:>8.3} {:>6.1} {:>8.3} {:>6.1} {:>8.0} {:>8.0} {:>7.2} {:>9.0} {:>10.0} {:>9.0}",
            name,
            base,
            cprof,
            cprof / base,
            bare_t,
            bare_t / base,
            traced,
            traced / base,
            per_bare,
            per_hit,
            per_hit / per_bare,
            per_call,
            cprof_call,
            median(daemon_ticks) * tick_ms
        );
        println!("       {what}; tracer counted {calls} calls, the bare probes {hits} hits");
    }
    Ok(())
}

/// Appends one line to a tracefs control file.
fn append(path: &Path, line: &str) -> std::io::Result<()> {
    use std::io::Write;
    writeln!(fs::OpenOptions::new().append(true).open(path)?, "{line}")
}

/// One traced run: (workload seconds, Python calls tracer counted in total).
fn traced(
    socket: &Path,
    python: &Path,
    script: &Path,
    name: &str,
    dir: &Path,
) -> Result<(f64, u64)> {
    let report = dir.join("report.json");
    let out = Command::new(bin_dir().join("tracerctl"))
        .arg("--socket")
        .arg(socket)
        .args([
            "start",
            "--mode=counting",
            "--python",
            "--format",
            "json",
            "-o",
        ])
        .arg(&report)
        .arg("--")
        .arg(python)
        .arg(script)
        .args([name, "plain"])
        .stderr(Stdio::inherit())
        .output()?;
    if !out.status.success() {
        bail!("tracerctl failed");
    }
    let json: serde_json::Value = serde_json::from_str(&fs::read_to_string(&report)?)?;
    let calls = json["python"]["functions"]
        .as_array()
        .map_or(0, |f| f.iter().filter_map(|f| f["ncalls"].as_u64()).sum());
    Ok((seconds(&out.stdout)?, calls))
}

/// Plain tracefs uprobes at tracer's probe points, counted by `perf stat`: the floor any
/// uprobe-based counter pays.
struct BareProbes {
    events: Vec<String>,
    points: Vec<String>,
}

const GROUP: &str = "tracerbench";

impl BareProbes {
    fn create(python: &Path) -> Result<Self> {
        // Start the interpreter to see which binary holds its eval loop.
        let mut child = Command::new(python)
            .args(["-c", "import time; time.sleep(2)"])
            .spawn()?;
        std::thread::sleep(Duration::from_millis(500));
        let maps = fs::read_to_string(format!("/proc/{}/maps", child.id()))?;
        let _ = child.kill();
        let _ = child.wait();
        let lib = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .find(|p| p.contains("/libpython3."));
        let path = fs::canonicalize(lib.map_or(python, Path::new))?;
        // tracerd says where it probes, so the baseline probes the very same instructions.
        let out = Command::new(bin_dir().join("tracerd"))
            .arg("--show-python-probes")
            .arg(&path)
            .output()?;
        if !out.status.success() {
            bail!(
                "tracerd --show-python-probes: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let probes: Vec<(u64, String)> = String::from_utf8(out.stdout)?
            .lines()
            .filter_map(|l| {
                let (off, what) = l.split_once(' ')?;
                Some((
                    u64::from_str_radix(off.trim_start_matches("0x"), 16).ok()?,
                    what.to_owned(),
                ))
            })
            .collect();
        let tracefs = Path::new("/sys/kernel/tracing");
        if !tracefs.join("uprobe_events").exists() {
            bail!("tracefs is not mounted at /sys/kernel/tracing");
        }
        Self::remove();
        let mut events = Vec::new();
        let mut points = Vec::new();
        for (i, (offset, what)) in probes.into_iter().enumerate() {
            let ev = format!("p{i}");
            let def = format!("p:{GROUP}/{ev} {}:{offset:#x}", path.display());
            append(&tracefs.join("uprobe_events"), &def)
                .with_context(|| format!("defining {def}"))?;
            events.push(format!("{GROUP}:{ev}"));
            points.push(what);
        }
        Ok(Self { events, points })
    }

    fn run(&self, python: &Path, script: &Path, name: &str) -> Result<(f64, u64)> {
        let out = Command::new("perf")
            .args(["stat", "-x", ",", "-e", &self.events.join(","), "--"])
            .arg(python)
            .arg(script)
            .args([name, "plain"])
            .output()
            .context("running perf stat (Debian package linux-perf)")?;
        if !out.status.success() {
            bail!("perf stat failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let hits = String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter_map(|l| l.split(',').next()?.parse::<u64>().ok())
            .sum::<u64>();
        Ok((seconds(&out.stdout)?, hits))
    }

    fn remove() {
        let path = Path::new("/sys/kernel/tracing/uprobe_events");
        if let Ok(defs) = fs::read_to_string(path) {
            for line in defs.lines().filter(|l| l.contains(&format!("{GROUP}/"))) {
                if let Some((_, name)) = line
                    .split_whitespace()
                    .next()
                    .and_then(|n| n.split_once(':'))
                {
                    let _ = append(path, &format!("-:{name}"));
                }
            }
        }
    }
}

impl Drop for BareProbes {
    fn drop(&mut self) {
        Self::remove();
    }
}
