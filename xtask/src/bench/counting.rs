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
//!
//! This file runs the bench and its micro-loops; `pyperformance` the pyperformance part,
//! `bare_probes` the bare uprobes and the watch for other tools' probes.

mod bare_probes;
mod pyperformance;

use std::{
    ffi::OsStr,
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{bail, Context, Result};

use super::{clock_ticks, median, python_executable, seconds, Daemon};
use crate::bin_dir;
use bare_probes::BareProbes;
use pyperformance::{pyperformance, pyperformance_dir, DRIVER};

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
/// Versions to run (`3.12,3.14`); all at hand when unset.
const PYTHONS_VAR: &str = "TRACER_BENCH_PYTHONS";

/// `python3`, pyenv's other 3.10-3.13 and the distribution's python3.11, then the wrappers
/// for 3.14 and 3.15 that exist: the static ones, and the shared ones where [`SHARED_VAR`]
/// asks for them.
fn interpreters() -> Result<Vec<Interp>> {
    let host = python_executable()?;
    let mut all = vec![Interp {
        label: version(&host)?,
        python: host,
        pyperformance: true,
    }];
    // The issue's matrix: pyenv's other builds, and the distribution's stripped python3.11.
    let pyenv = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".pyenv")))
        .map(|r| r.join("versions"));
    let mut others: Vec<PathBuf> = pyenv
        .and_then(|d| fs::read_dir(d).ok())
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|d| {
            let name = d.file_name().to_string_lossy().into_owned();
            let minor = (10..=13).find(|m| name.starts_with(&format!("3.{m}.")))?;
            let exe = d.path().join(format!("bin/python3.{minor}"));
            (!name.contains('t') && exe.exists()).then_some(exe)
        })
        .collect();
    others.sort();
    others.push("/usr/bin/python3.11".into());
    for python in others.into_iter().filter(|p| p.exists()) {
        let Ok(full) = version(&python) else { continue };
        if all.iter().any(|i| i.label == full) {
            continue;
        }
        let tag = if python.starts_with("/usr") {
            " deb"
        } else {
            ""
        };
        all.push(Interp {
            label: format!("{full}{tag}"),
            python,
            pyperformance: true,
        });
    }
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
    // A shorter run: `TRACER_BENCH_PYTHONS=3.12,3.14` keeps the interpreters whose version
    // starts so.
    if let Some(only) = std::env::var_os(PYTHONS_VAR) {
        let only = only.to_string_lossy().into_owned();
        let keep: Vec<&str> = only.split(',').map(str::trim).collect();
        all.retain(|i| keep.iter().any(|k| i.label.starts_with(&format!("{k}."))));
        println!("{PYTHONS_VAR}={only}: {} interpreters", all.len());
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

/// Python calls in a report, all functions.
fn total_calls(report: &serde_json::Value) -> u64 {
    report["python"]["functions"]
        .as_array()
        .map_or(0, |f| f.iter().filter_map(|f| f["ncalls"].as_u64()).sum())
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
