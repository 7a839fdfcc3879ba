//! `cargo xtask bench counting`: the cost of counting Python calls, measured side by side in
//! one run on the same workloads: untraced, cProfile, a bare uprobe (perf counting hits of a
//! tracefs uprobe at the very probe points tracer uses), and tracer.
//!
//! Two parts, each on every interpreter at hand: `python3` (pyenv's, resolved through its
//! shim) and, where `cargo xtask setup` made them, Debian's CPython 3.14 and 3.15 run chrooted
//! by the wrappers in `target/cpython-bin` (static: the interpreter in the executable; with
//! `TRACER_BENCH_SHARED=1`, shared too: a launcher linked to libpython, micro-loops only):
//!
//! - micro-loops (`fib`, `work`), under all four conditions;
//! - four pyperformance benchmarks (richards, go, deltablue, raytrace), untraced, under
//!   cProfile and under tracer. pyperformance and pyperf (pure Python) are downloaded with pip
//!   into `target/bench-pyperformance` and unpacked there: the chroot has no pip, and the
//!   workspace is visible inside it at its host path. A driver (counting_pyperformance.py)
//!   runs each benchmark's core function as its run_benchmark.py hands it to pyperf, in one
//!   process, and tracer's counts of the benchmark's own functions are checked against
//!   cProfile's.
//!
//! Other sessions on this machine (the tests' tracerds) probe an interpreter's binary for
//! every process that maps it, which would slow the untraced runs too: an idle interpreter of
//! each kind is watched for their probes, and runs wait for them to go (see [`BareProbes`]).

use std::{
    cell::Cell,
    ffi::OsStr,
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use super::{clock_ticks, group, median, python_executable, seconds, Daemon};
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

/// The pyperformance driver: `python DRIVER BENCHMARKS_DIR NAME plain|cprofile`.
const DRIVER: &str = include_str!("counting_pyperformance.py");

/// Pinned, so that runs compare: pure-Python wheels, unpacked rather than installed.
const PYPERFORMANCE: &str = "pyperformance==1.14.0";
const PYPERF: &str = "pyperf==2.10.0";

/// pyperformance benchmarks: (name, what the driver runs, as run_benchmark.py does).
const BENCHMARKS: &[(&str, &str)] = &[
    ("richards", "Richards().run(1)"),
    ("go", "versus_cpu(): one Go move by Monte Carlo tree search"),
    ("deltablue", "delta_blue(100)"),
    (
        "raytrace",
        "bench_raytrace(1, 50, 50): a quarter of pyperformance's 100×100 picture",
    ),
];

/// One interpreter the bench runs.
struct Interp {
    /// `3.11.7`, `3.14.10 st`, `3.14.10 sh`.
    label: String,
    /// What runs it: an executable, or a wrapper that runs one chrooted.
    python: PathBuf,
    /// Whether the pyperformance part runs on it too.
    pyperformance: bool,
}

/// Set to 1, the shared builds of 3.14 and 3.15 run the micro-loops too (≈ 50 s each).
const SHARED_VAR: &str = "TRACER_BENCH_SHARED";

/// `python3`, then the wrappers for 3.14 and 3.15 that exist: the static ones, and the shared
/// ones where [`SHARED_VAR`] asks for them.
fn interpreters() -> Result<Vec<Interp>> {
    let host = python_executable()?;
    let mut all = vec![Interp {
        label: version(&host)?,
        python: host,
        pyperformance: true,
    }];
    let shared = std::env::var_os(SHARED_VAR).is_some_and(|v| v == "1");
    let dir = crate::cpython::bin_dir();
    let mut missing = Vec::new();
    for (kind, tag, pyperformance) in [("static", "st", true), ("shared", "sh", false)] {
        if kind == "shared" && !shared {
            continue;
        }
        for v in ["3.14", "3.15"] {
            let python = dir.join(kind).join(format!("python{v}"));
            if !python.exists() {
                missing.push(format!("{kind}/python{v}"));
                continue;
            }
            match version(&python) {
                Ok(full) => all.push(Interp {
                    label: format!("{full} {tag}"),
                    python,
                    pyperformance,
                }),
                Err(e) => println!("skipping {}: {e:#}", shown(&python)),
            }
        }
    }
    if !missing.is_empty() {
        let reason = fs::read_to_string(dir.join("not-set-up")).map_or_else(
            |_| {
                format!(
                    "no {} in target/cpython-bin (`cargo xtask setup`, as root, makes them)",
                    missing.join(", ")
                )
            },
            |r| r.trim().to_owned(),
        );
        println!("skipping 3.14/3.15: {reason}");
    }
    if !shared {
        println!(
            "3.14/3.15's shared builds (a launcher linked to libpython) not run: {SHARED_VAR}=1 adds them to the micro-loops"
        );
    }
    Ok(all)
}

/// The interpreter's full version (`3.14.10`).
fn version(python: &Path) -> Result<String> {
    let out = Command::new(python)
        .args(["-c", "import platform; print(platform.python_version())"])
        .stderr(Stdio::null())
        .output()
        .with_context(|| format!("running {}", python.display()))?;
    if !out.status.success() {
        bail!("{} does not run", python.display());
    }
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

pub(super) fn run() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("bench.py");
    fs::write(&script, SCRIPT)?;
    println!("load average at the start: {}", load_average());
    let interps = interpreters()?;
    let daemon = Daemon::start(dir.path())?;
    BareProbes::remove_all();
    let probes = interps
        .iter()
        .enumerate()
        .map(|(i, interp)| BareProbes::create(&interp.python, i))
        .collect::<Result<Vec<_>>>()?;
    println!(
        "pythons (st: the interpreter in the executable; sh: a launcher linked to libpython):"
    );
    for (interp, bare) in interps.iter().zip(&probes) {
        println!(
            "  {:<11} {} (eval loop in {})",
            interp.label,
            shown(&interp.python),
            shown(&bare.binary)
        );
        println!("{}", wrap("              probe points: ", &bare.points));
    }
    println!("every run waits until no other tool's uprobes are on the interpreter's probe points");
    println!(
        "(an idle interpreter of each kind is watched for them), and is repeated if some came"
    );
    println!();
    println!(
        "== micro-loops: {} runs each, interleaved (conditions rotated from round to round), median;",
        RUNS
    );
    println!("   the workload's own time, start-up excluded");
    println!("columns: seconds and slowdown (×) untraced, under cProfile, under bare uprobes, under tracer --python;");
    println!("         ns per probe hit (bare vs tracer), ns per Python call (tracer vs cProfile), tracerd CPU per run");
    println!("bare uprobe: perf counting a tracefs uprobe at each of tracer's probe points");
    println!();
    println!(
        "{:<6} {:<11} {:>8} {:>8} {:>6} {:>8} {:>6} {:>8} {:>6} {:>8} {:>8} {:>7} {:>9} {:>10} {:>9}",
        "work",
        "python",
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
    for (interp, bare) in interps.iter().zip(&probes) {
        micro(&daemon, interp, bare, &script, dir.path())?;
    }
    println!();
    match pyperformance_dir() {
        Ok((benchmarks, pythonpath)) => {
            let driver = dir.path().join("pyperformance_driver.py");
            fs::write(&driver, DRIVER)?;
            pyperformance(
                &daemon,
                &interps,
                &probes,
                &driver,
                &benchmarks,
                &pythonpath,
                dir.path(),
            )?;
        }
        Err(e) => println!("skipping pyperformance: {e:#}"),
    }
    println!();
    let mut met = false;
    for (interp, bare) in interps.iter().zip(&probes) {
        let (retried, waited, tainted) =
            (bare.retried.get(), bare.waited.get(), bare.tainted.get());
        if retried + tainted > 0 || waited >= 1.0 {
            met = true;
            println!(
                "{}: other uprobes on its probe points: waited {waited:.0} s for them to go, {retried} runs repeated, {tainted} measured with them all the same",
                interp.label
            );
        }
    }
    if !met {
        println!("no run met other tools' uprobes on its interpreter");
    }
    println!("load average at the end: {}", load_average());
    Ok(())
}

/// `head` and the items, comma-separated, in lines of at most 100 characters, the next ones
/// indented as far as the items start.
fn wrap(head: &str, items: &[String]) -> String {
    let indent = " ".repeat(head.chars().count());
    let mut out = head.to_owned();
    let mut line = head.chars().count();
    for (i, item) in items.iter().enumerate() {
        let text = if i + 1 < items.len() {
            format!("{item},")
        } else {
            item.clone()
        };
        if i > 0 {
            if line + 1 + text.chars().count() > 100 {
                out.push('\n');
                out.push_str(&indent);
                line = indent.len();
            } else {
                out.push(' ');
                line += 1;
            }
        }
        out.push_str(&text);
        line += text.chars().count();
    }
    out
}

/// The first three fields of /proc/loadavg.
fn load_average() -> String {
    fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// A path as printed: relative to the workspace where it is inside it.
fn shown(path: &Path) -> String {
    path.strip_prefix(crate::root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// The micro-loops on one interpreter: one row per workload.
fn micro(
    daemon: &Daemon,
    interp: &Interp,
    bare: &BareProbes,
    script: &Path,
    dir: &Path,
) -> Result<()> {
    let python = &interp.python;
    let now = Duration::ZERO;
    for (name, what) in WORKLOADS {
        let plain = |mode: &str| -> Result<f64> {
            bare.quiet(now, || {
                let out = Command::new(python)
                    .arg(script)
                    .args([*name, mode])
                    .output()?;
                seconds(&out.stdout)
            })
        };
        // Interleaved: each round runs the four conditions once, in an order rotated from
        // round to round, so that the machine's other load falls on all of them alike.
        let (mut base, mut cprof, mut bare_t, mut traced_t) = (vec![], vec![], vec![], vec![]);
        let (mut hits, mut calls, mut daemon_ticks) = (0, 0, vec![]);
        for round in 0..RUNS {
            for k in 0..4 {
                match (round + k) % 4 {
                    0 => base.push(plain("plain")?),
                    1 => cprof.push(plain("cprofile")?),
                    2 => {
                        let (t, h) = bare.quiet(now, || bare.run(python, script, name))?;
                        hits = h;
                        bare_t.push(t);
                    }
                    _ => {
                        let (t, report, ticks) = bare.quiet(SETTLE, || {
                            let before = daemon.cpu_ticks();
                            let (t, report) = traced(
                                &daemon.socket,
                                python,
                                &[script.as_os_str(), name.as_ref(), "plain".as_ref()],
                                &[],
                                dir,
                            )?;
                            Ok((t, report, daemon.cpu_ticks() - before))
                        })?;
                        daemon_ticks.push(ticks as f64);
                        calls = total_calls(&report);
                        traced_t.push(t);
                    }
                }
            }
        }
        let (base, cprof, bare_t, traced) = (
            median(base),
            median(cprof),
            median(bare_t),
            median(traced_t),
        );
        let tick_ms = 1000.0 / clock_ticks();
        // Both hit the same probe points the same number of times (an entry and an exit
        // per call): per hit, they compare directly.
        let per_bare = (bare_t - base) / hits.max(1) as f64 * 1e9;
        let per_hit = (traced - base) / hits.max(1) as f64 * 1e9;
        let per_call = (traced - base) / calls.max(1) as f64 * 1e9;
        let cprof_call = (cprof - base) / calls.max(1) as f64 * 1e9;
        println!(
            "{:<6} {:<11} {:>8.3} {:>8.3} {:>6.1} {:>8.3} {:>6.1} {:>8.3} {:>6.1} {:>8.0} {:>8.0} {:>7.2} {:>9.0} {:>10.0} {:>9.0}",
            name,
            interp.label,
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

/// How long tracerd may take to take a finished session's probes off.
const SETTLE: Duration = Duration::from_secs(2);

/// pyperformance's `data-files/benchmarks` and the directory holding pyperf (for PYTHONPATH),
/// downloaded and unpacked under `target/` when they are not there yet.
fn pyperformance_dir() -> Result<(PathBuf, PathBuf)> {
    let top = crate::root().join("target").join("bench-pyperformance");
    let benchmarks = top.join("pyperformance/pyperformance/data-files/benchmarks");
    let pythonpath = top.join("pyperf");
    let done = top.join("unpacked");
    if fs::read_to_string(&done).ok().as_deref() == Some(&format!("{PYPERFORMANCE} {PYPERF}\n")) {
        return Ok((benchmarks, pythonpath));
    }
    let _ = fs::remove_dir_all(&top);
    let wheels = top.join("wheels");
    fs::create_dir_all(&wheels)?;
    let out = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
        ])
        .arg(&wheels)
        .args([PYPERFORMANCE, PYPERF])
        .output()
        .context("running python3 -m pip download")?;
    if !out.status.success() {
        bail!(
            "pip download {PYPERFORMANCE} {PYPERF} failed: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rfind(|l| !l.trim().is_empty())
                .unwrap_or("")
        );
    }
    for (spec, into) in [(PYPERFORMANCE, "pyperformance"), (PYPERF, "pyperf")] {
        let (name, v) = spec.split_once("==").context("pinned")?;
        let wheel = wheels.join(format!("{name}-{v}-py3-none-any.whl"));
        let out = Command::new("python3")
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel)
            .arg(top.join(into))
            .output()?;
        if !out.status.success() {
            bail!(
                "unpacking {}: {}",
                wheel.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
    if !benchmarks.is_dir() {
        bail!("{PYPERFORMANCE} has no data-files/benchmarks");
    }
    fs::write(&done, format!("{PYPERFORMANCE} {PYPERF}\n"))?;
    Ok((benchmarks, pythonpath))
}

/// What the driver printed under cProfile: Python calls a run, and the calls of each function
/// of run_benchmark.py over the whole process (import and all runs), by (first line, name).
struct Profiled {
    seconds: f64,
    calls_per_run: u64,
    file: Vec<(i64, String, u64)>,
}

fn profiled(out: &[u8]) -> Result<Profiled> {
    let text = String::from_utf8_lossy(out);
    let calls_per_run = text
        .lines()
        .find_map(|l| l.strip_prefix("CALLS "))
        .context("the driver printed no CALLS")?
        .trim()
        .parse()?;
    let file = text
        .lines()
        .filter_map(|l| {
            let mut f = l.strip_prefix("FILE ")?.split(' ');
            Some((
                f.next()?.parse().ok()?,
                f.next()?.to_owned(),
                f.next()?.parse().ok()?,
            ))
        })
        .collect();
    Ok(Profiled {
        seconds: seconds(out)?,
        calls_per_run,
        file,
    })
}

/// The pyperformance part: on `python3` and the static wrappers, each benchmark untraced,
/// under cProfile and under tracer, one process each (the fastest of the driver's runs).
fn pyperformance(
    daemon: &Daemon,
    interps: &[Interp],
    probes: &[BareProbes],
    driver: &Path,
    benchmarks: &Path,
    pythonpath: &Path,
    dir: &Path,
) -> Result<()> {
    println!(
        "== pyperformance: {PYPERFORMANCE}, {PYPERF} (PYTHONPATH={})",
        shown(pythonpath)
    );
    println!(
        "   each benchmark's core function run {RUNS} times in one process, fastest run; untraced,"
    );
    println!("   under cProfile, under tracer launching it (`tracerctl start … -- CMD`: uprobes), and under");
    println!(
        "   tracer attached by pid while it waits before its work (`--pid`: in-process on 3.14+)"
    );
    println!(
        "columns: seconds and slowdown (×); Python calls a run (cProfile's count, C functions"
    );
    println!("         excluded); ns per Python call added by tracer and by cProfile; tracerd CPU for the run");
    let skipped: Vec<&str> = interps
        .iter()
        .filter(|i| !i.pyperformance)
        .map(|i| i.label.as_str())
        .collect();
    if !skipped.is_empty() {
        println!(
            "         (not on {}: micro-loops only there)",
            skipped.join(", ")
        );
    }
    println!();
    println!(
        "{:<10} {:<11} {:>8} {:>8} {:>6} {:>8} {:>6} {:>8} {:>6} {:>10} {:>9} {:>9} {:>10} {:>9}",
        "work",
        "python",
        "base s",
        "cProf s",
        "×",
        "tracer s",
        "×",
        "--pid s",
        "×",
        "calls/run",
        "ours/call",
        "pid/call",
        "cProf/call",
        "daemon ms"
    );
    let mut ratios: Vec<(String, f64, f64, f64)> = Vec::new();
    for (interp, bare) in interps.iter().zip(probes) {
        if !interp.pyperformance {
            continue;
        }
        for (name, what) in BENCHMARKS {
            let args = [driver.as_os_str(), benchmarks.as_os_str(), name.as_ref()];
            let plain = |mode: &str| -> Result<Vec<u8>> {
                bare.quiet(Duration::ZERO, || {
                    let out = Command::new(&interp.python)
                        .args(args)
                        .arg(mode)
                        .env("PYTHONPATH", pythonpath)
                        .stderr(Stdio::inherit())
                        .output()?;
                    if !out.status.success() {
                        bail!("{} {name} {mode} failed", interp.label);
                    }
                    Ok(out.stdout)
                })
            };
            let base = seconds(&plain("plain")?)?;
            let cprof = profiled(&plain("cprofile")?)?;
            let (t, report, ticks) = bare.quiet(SETTLE, || {
                let before = daemon.cpu_ticks();
                let (t, report) = traced(
                    &daemon.socket,
                    &interp.python,
                    &[args[0], args[1], args[2], "plain".as_ref()],
                    &[("PYTHONPATH", pythonpath)],
                    dir,
                )?;
                Ok((t, report, daemon.cpu_ticks() - before))
            })?;
            let (pid_t, pid_report, way) = bare.quiet(SETTLE, || {
                attached(
                    &daemon.socket,
                    &interp.python,
                    &args,
                    &[("PYTHONPATH", pythonpath)],
                    dir,
                )
            })?;
            let calls = cprof.calls_per_run.max(1) as f64;
            println!(
                "{:<10} {:<11} {:>8.3} {:>8.3} {:>6.1} {:>8.3} {:>6.1} {:>8.3} {:>6.1} {:>10} {:>9.0} {:>9.0} {:>10.0} {:>9.0}",
                name,
                interp.label,
                base,
                cprof.seconds,
                cprof.seconds / base,
                t,
                t / base,
                pid_t,
                pid_t / base,
                group(cprof.calls_per_run),
                (t - base) / calls * 1e9,
                (pid_t - base) / calls * 1e9,
                (cprof.seconds - base) / calls * 1e9,
                ticks as f64 * 1000.0 / clock_ticks()
            );
            ratios.push((
                format!("{} {way}", interp.label),
                cprof.seconds / base,
                t / base,
                pid_t / base,
            ));
            let file = benchmarks
                .join(format!("bm_{name}"))
                .join("run_benchmark.py");
            println!("           {what}");
            println!("           launched: {}", compare(&report, &file, &cprof));
            println!(
                "           --pid ({way}): {}",
                compare(&pid_report, &file, &cprof)
            );
        }
    }
    // Geometric means of the slowdowns, per interpreter and way of counting.
    println!();
    println!("geomean slowdown (×)      cProfile  launched  --pid");
    let mut labels: Vec<&String> = ratios.iter().map(|r| &r.0).collect();
    labels.dedup();
    for label in labels {
        let rows: Vec<_> = ratios.iter().filter(|r| &r.0 == label).collect();
        let g = |f: fn(&(String, f64, f64, f64)) -> f64| {
            (rows.iter().map(|r| f(r).ln()).sum::<f64>() / rows.len() as f64).exp()
        };
        println!(
            "  {:<24} {:>8.2} {:>9.2} {:>6.2}",
            label,
            g(|r| r.1),
            g(|r| r.2),
            g(|r| r.3)
        );
    }
    Ok(())
}

/// tracer's counts of run_benchmark.py's functions against cProfile's, in two runs of the
/// same work (cProfile's covering the module's import too, as tracer's whole-process count
/// does), function by function: (first line, name).
fn compare(report: &serde_json::Value, file: &Path, cprof: &Profiled) -> String {
    let file = file.to_string_lossy();
    let ours: Vec<(i64, &str, u64)> = report["python"]["functions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["filename"].as_str() == Some(&*file))
        .filter_map(|f| {
            // cProfile names a function by its code's co_name, tracer by its qualified name.
            let name = f["qualname"].as_str()?;
            Some((
                f["firstlineno"].as_i64()?,
                name.rsplit('.').next().unwrap_or(name),
                f["ncalls"].as_u64()?,
            ))
        })
        .collect();
    let mut keys: Vec<(i64, &str)> = ours
        .iter()
        .map(|(l, n, _)| (*l, *n))
        .chain(cprof.file.iter().map(|(l, n, _)| (*l, n.as_str())))
        .collect();
    keys.sort_unstable();
    keys.dedup();
    let (mut ours_total, mut theirs_total) = (0, 0);
    let mut differ = Vec::new();
    for (line, name) in &keys {
        let sum = |v: &mut dyn Iterator<Item = (i64, &str, u64)>| -> u64 {
            v.filter(|(l, n, _)| l == line && n == name)
                .map(|(_, _, c)| c)
                .sum()
        };
        let counted = sum(&mut ours.iter().copied());
        let theirs = sum(&mut cprof.file.iter().map(|(l, n, c)| (*l, n.as_str(), *c)));
        ours_total += counted;
        theirs_total += theirs;
        if counted != theirs {
            differ.push(format!("{name} (line {line}) {counted} vs {theirs}"));
        }
    }
    let mut text = format!(
        "{} functions of run_benchmark.py: tracer counted {} calls, cProfile {}",
        keys.len(),
        group(ours_total),
        group(theirs_total)
    );
    if differ.is_empty() {
        text.push_str(": every function the same");
    } else {
        text.push_str(&format!(
            "; {} differ (tracer vs cProfile): {}",
            differ.len(),
            differ
                .iter()
                .take(4)
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    text
}

/// Python calls in a report, all functions.
fn total_calls(report: &serde_json::Value) -> u64 {
    report["python"]["functions"]
        .as_array()
        .map_or(0, |f| f.iter().filter_map(|f| f["ncalls"].as_u64()).sum())
}

/// Appends one line to a tracefs control file.
fn append(path: &Path, line: &str) -> std::io::Result<()> {
    use std::io::Write;
    writeln!(fs::OpenOptions::new().append(true).open(path)?, "{line}")
}

/// One traced run of `python ARGS` (with `env` added to tracerctl's environment, which the
/// program inherits): the workload's seconds and tracer's JSON report.
fn traced(
    socket: &Path,
    python: &Path,
    args: &[&OsStr],
    env: &[(&str, &Path)],
    dir: &Path,
) -> Result<(f64, serde_json::Value)> {
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
        .args(args)
        .envs(env.iter().copied())
        .stderr(Stdio::inherit())
        .output()?;
    if !out.status.success() {
        bail!("tracerctl failed");
    }
    let json = serde_json::from_str(&fs::read_to_string(&report)?)?;
    Ok((seconds(&out.stdout)?, json))
}

/// One run of `python ARGS gated:FILE` counted by pid (`tracerctl start --pid`, attached
/// while the program waits before its work, as one attaches to a running service; in-process
/// on CPython 3.14+, else with uprobes): the workload's seconds, tracer's JSON report, and
/// how the process was counted.
fn attached(
    socket: &Path,
    python: &Path,
    args: &[&OsStr],
    env: &[(&str, &Path)],
    dir: &Path,
) -> Result<(f64, serde_json::Value, String)> {
    use std::io::{BufRead, Read};
    let go = dir.join("go");
    let _ = fs::remove_file(&go);
    let mut child = Command::new(python)
        .args(args)
        .arg(format!("gated:{}", go.display()))
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let mut out = std::io::BufReader::new(child.stdout.take().context("stdout")?);
    let mut ready = String::new();
    out.read_line(&mut ready)?;
    if ready != "ready\n" {
        let _ = child.kill();
        let _ = child.wait();
        bail!("the driver did not say ready: {ready:?}");
    }
    let ctl = |args: &[&str]| -> Result<String> {
        let o = Command::new(bin_dir().join("tracerctl"))
            .arg("--socket")
            .arg(socket)
            .args(args)
            .stderr(Stdio::inherit())
            .output()?;
        if !o.status.success() {
            bail!("tracerctl {} failed", args.join(" "));
        }
        Ok(String::from_utf8(o.stdout)?)
    };
    let pid = child.id().to_string();
    let id = match ctl(&["start", "--mode=counting", "--python", "--pid", &pid]) {
        Ok(id) => id.trim().to_owned(),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
    };
    fs::write(&go, b"")?;
    let mut stdout = Vec::new();
    out.read_to_end(&mut stdout)?;
    if !child.wait()?.success() {
        bail!("the driver failed under tracer");
    }
    let started = Instant::now();
    while !ctl(&["status", &id])?.contains("target exited") {
        if started.elapsed() > Duration::from_secs(30) {
            bail!("session {id} did not end with its target");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let report: serde_json::Value =
        serde_json::from_str(&ctl(&["report", &id, "--format", "json"])?)?;
    let way = report["python"]["counted"]
        .as_array()
        .and_then(|c| c.first())
        .and_then(|c| c["way"].as_str())
        .unwrap_or("?")
        .to_owned();
    Ok((seconds(&stdout)?, report, way))
}

/// `RESUME handler +0x0: handler start (single-stepped)` as `RESUME+0x0 (single-stepped)`.
fn short(what: &str) -> String {
    let (head, tail) = what.split_once(':').unwrap_or((what, ""));
    let mut s = head.replacen(" handler +", "+", 1);
    if tail.contains("single-stepped") {
        s.push_str(" (single-stepped)");
    }
    s
}

/// Plain tracefs uprobes at tracer's probe points, counted by `perf stat`: the floor any
/// uprobe-based counter pays. Also the guard against other tools' probes: tracerd (any
/// tracerd on this machine, the tests' included) probes an interpreter's binary for every
/// process that maps it, so while another session probes the same binary every run here
/// pays for its probes. An idle interpreter kept running (the sentinel) shows them: a probed
/// instruction reads as int3 in its memory.
struct BareProbes {
    /// The file probed: libpython, or the executable holding the eval loop.
    binary: PathBuf,
    /// This interpreter's events (`tracerbench:i0p3`).
    events: Vec<String>,
    /// What each probe is, short: `RESUME_CHECK+0x26`.
    points: Vec<String>,
    sentinel: Child,
    /// Per probe point: its address in the sentinel and the file's byte there.
    watch: Vec<(u64, u8)>,
    /// Runs repeated because other probes came and went during them.
    retried: Cell<u32>,
    /// Seconds spent waiting for other probes to go.
    waited: Cell<f64>,
    /// Runs measured with other probes on the binary all the same (after waiting or
    /// retrying long enough).
    tainted: Cell<u32>,
}

const GROUP: &str = "tracerbench";

/// How long to wait for another tool's probes to go before measuring with them.
const WAIT_QUIET: Duration = Duration::from_secs(180);

impl BareProbes {
    /// `index` names this interpreter's events, apart from the other interpreters'.
    fn create(python: &Path, index: usize) -> Result<Self> {
        // An idle interpreter shows which binary holds its eval loop, and stays as the sentinel.
        let mut sentinel = Command::new(python)
            .args(["-c", "import sys; sys.stdin.read()"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()?;
        let found = Self::inspect(sentinel.id());
        let (file, path, maps) = match found {
            Ok(f) => f,
            Err(e) => {
                let _ = sentinel.kill();
                let _ = sentinel.wait();
                return Err(e);
            }
        };
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
        let image = fs::read(&path)?;
        let mut watch = Vec::new();
        for (offset, _) in &probes {
            let at = maps.iter().find_map(|(start, end, pgoff, name)| {
                (name == &file && (*pgoff..pgoff + (end - start)).contains(offset))
                    .then(|| start + offset - pgoff)
            });
            let byte = image.get(*offset as usize).copied();
            if let (Some(at), Some(byte)) = (at, byte) {
                watch.push((at, byte));
            }
        }
        let tracefs = Path::new("/sys/kernel/tracing");
        if !tracefs.join("uprobe_events").exists() {
            bail!("tracefs is not mounted at /sys/kernel/tracing");
        }
        let mut events = Vec::new();
        let mut points = Vec::new();
        for (i, (offset, what)) in probes.into_iter().enumerate() {
            let ev = format!("i{index}p{i}");
            let def = format!("p:{GROUP}/{ev} {}:{offset:#x}", path.display());
            append(&tracefs.join("uprobe_events"), &def)
                .with_context(|| format!("defining {def}"))?;
            events.push(format!("{GROUP}:{ev}"));
            points.push(short(&what));
        }
        Ok(Self {
            binary: path,
            events,
            points,
            sentinel,
            watch,
            retried: Cell::new(0),
            waited: Cell::new(0.0),
            tainted: Cell::new(0),
        })
    }

    /// The file holding an interpreter's eval loop, as its maps name it and as a host path,
    /// and its mappings (start, end, file offset, file). A wrapper execs its way to the
    /// interpreter: waits for it.
    #[allow(clippy::type_complexity)]
    fn inspect(pid: u32) -> Result<(String, PathBuf, Vec<(u64, u64, u64, String)>)> {
        let started = Instant::now();
        loop {
            let text = fs::read_to_string(format!("/proc/{pid}/maps"))?;
            let maps: Vec<(u64, u64, u64, String)> = text
                .lines()
                .filter_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    let (start, end) = f.first()?.split_once('-')?;
                    Some((
                        u64::from_str_radix(start, 16).ok()?,
                        u64::from_str_radix(end, 16).ok()?,
                        u64::from_str_radix(f.get(2)?, 16).ok()?,
                        (*f.get(5)?).to_owned(),
                    ))
                })
                .collect();
            let named = |prefix: &str| {
                maps.iter()
                    .map(|m| m.3.as_str())
                    .find(|p| p.rsplit('/').next().is_some_and(|n| n.starts_with(prefix)))
            };
            // libpython where the executable links to it, else the executable.
            if let Some(file) = named("libpython3.").or_else(|| named("python3")) {
                // A chroot's maps name the host's path; else look through the process's root.
                let path = fs::canonicalize(file)
                    .or_else(|_| fs::canonicalize(format!("/proc/{pid}/root{file}")))
                    .with_context(|| format!("finding {file}"))?;
                // Wait for libpython too, where the executable links to it.
                if named("libpython3.").is_some() || started.elapsed() > Duration::from_secs(1) {
                    return Ok((file.to_owned(), path, maps));
                }
            }
            if started.elapsed() > Duration::from_secs(10) {
                bail!("pid {pid} maps no python3 or libpython3 after 10 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether another tool's uprobe is on one of tracer's probe points now.
    fn foreign(&self) -> Result<bool> {
        use std::os::unix::fs::FileExt;
        let mem = fs::File::open(format!("/proc/{}/mem", self.sentinel.id()))?;
        for &(at, byte) in &self.watch {
            let mut b = [0u8];
            mem.read_exact_at(&mut b, at)
                .context("reading the sentinel interpreter's memory")?;
            if b[0] == 0xcc && byte != 0xcc {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Waits (up to [`WAIT_QUIET`]) until no other tool probes the binary.
    fn wait_quiet(&self) -> Result<bool> {
        let started = Instant::now();
        while self.foreign()? {
            if started.elapsed() > WAIT_QUIET {
                self.waited
                    .set(self.waited.get() + started.elapsed().as_secs_f64());
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        self.waited
            .set(self.waited.get() + started.elapsed().as_secs_f64());
        Ok(true)
    }

    /// Runs `f` with no other tool's probes on the binary before it or after it; a run they
    /// overlapped is repeated (three tries), else counted as tainted. `settle`: how long the
    /// probes of `f`'s own session may take to go once it has ended.
    fn quiet<T>(&self, settle: Duration, mut f: impl FnMut() -> Result<T>) -> Result<T> {
        for attempt in 1.. {
            let before = self.wait_quiet()?;
            let r = f()?;
            let ended = Instant::now();
            let mut after = self.foreign()?;
            while after && ended.elapsed() < settle {
                std::thread::sleep(Duration::from_millis(20));
                after = self.foreign()?;
            }
            if before && !after {
                return Ok(r);
            }
            if attempt == 3 {
                self.tainted.set(self.tainted.get() + 1);
                return Ok(r);
            }
            self.retried.set(self.retried.get() + 1);
        }
        unreachable!()
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

    /// Removes every event of the group (this bench's, left by an interrupted run too).
    fn remove_all() {
        Self::remove(|_| true);
    }

    fn remove(which: impl Fn(&str) -> bool) {
        let path = Path::new("/sys/kernel/tracing/uprobe_events");
        if let Ok(defs) = fs::read_to_string(path) {
            for line in defs.lines().filter(|l| l.contains(&format!("{GROUP}/"))) {
                if let Some((_, name)) = line
                    .split_whitespace()
                    .next()
                    .and_then(|n| n.split_once(':'))
                {
                    if which(name) {
                        let _ = append(path, &format!("-:{name}"));
                    }
                }
            }
        }
    }
}

impl Drop for BareProbes {
    fn drop(&mut self) {
        Self::remove(|name| self.events.iter().any(|e| e.replace(':', "/") == name));
        let _ = self.sentinel.kill();
        let _ = self.sentinel.wait();
    }
}
