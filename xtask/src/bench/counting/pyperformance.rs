//! The pyperformance part of `cargo xtask bench counting`: four pyperformance benchmarks,
//! downloaded and unpacked under `target/`, run by the driver untraced, under cProfile, under
//! tracer launching them and under tracer attached by pid, tracer's counts checked against
//! cProfile's.

use std::{
    ffi::OsStr,
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use super::bare_probes::BareProbes;
use super::{shown, traced, Interp, RUNS, SETTLE};
use crate::bench::{clock_ticks, group, seconds, Daemon};
use crate::bin_dir;

/// The pyperformance driver: `python DRIVER BENCHMARKS_DIR NAME plain|cprofile`.
pub(super) const DRIVER: &str = include_str!("../counting_pyperformance.py");

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

/// pyperformance's `data-files/benchmarks` and the directory holding pyperf (for PYTHONPATH),
/// downloaded and unpacked under `target/` when they are not there yet.
pub(super) fn pyperformance_dir() -> Result<(PathBuf, PathBuf)> {
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
pub(super) fn pyperformance(
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
    println!("   under cProfile, under tracer launching it (`tracerctl start … -- CMD`: in-process on 3.10+), and under");
    println!(
        "   tracer attached by pid while it waits in native code before its work (`--pid`: in-process: PEP 768 on 3.14+, ptrace before)"
    );
    println!(
        "   and, for the chrooted 3.14/3.15, under tracer launching them into another root with a /tmp of its own ({OTHER_ROOT})"
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
    let mut other_root: Vec<(String, f64)> = Vec::new();
    // The driver where a private /tmp does not hide it: beside the benchmarks.
    let root_driver = benchmarks.join("tracer_bench_driver.py");
    fs::write(&root_driver, DRIVER)?;
    for (interp, bare) in interps.iter().zip(probes) {
        if !interp.pyperformance {
            continue;
        }
        let chrooted = interp.python.starts_with(crate::cpython::bin_dir());
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
                format!("{} (--pid: {way})", interp.label),
                cprof.seconds / base,
                t / base,
                pid_t / base,
            ));
            let file = benchmarks
                .join(format!("bm_{name}"))
                .join("run_benchmark.py");
            println!("           {what}");
            let launched_way = report["python"]["counted"]
                .as_array()
                .and_then(|c| c.first())
                .and_then(|c| c["way"].as_str())
                .unwrap_or("?");
            println!(
                "           launched ({launched_way}): {}",
                compare(&report, &file, &cprof)
            );
            println!(
                "           --pid ({way}): {}",
                compare(&pid_report, &file, &cprof)
            );
            if chrooted {
                let args = [
                    "-m".as_ref(),
                    "sh".as_ref(),
                    "-c".as_ref(),
                    PRIVATE_TMP.as_ref(),
                    "sh".as_ref(),
                    interp.python.as_os_str(),
                    root_driver.as_os_str(),
                    benchmarks.as_os_str(),
                    name.as_ref(),
                    "plain".as_ref(),
                ];
                let (t, report) = bare.quiet(SETTLE, || {
                    traced(
                        &daemon.socket,
                        "unshare".as_ref(),
                        &args,
                        &[("PYTHONPATH", pythonpath)],
                        dir,
                    )
                })?;
                let way = report["python"]["counted"][0]["way"]
                    .as_str()
                    .unwrap_or("?");
                println!(
                    "           another root ({way}): {:.3} s, {:.1}×, {:.0} ns a call; {}",
                    t,
                    t / base,
                    (t - base) / calls * 1e9,
                    compare(&report, &file, &cprof)
                );
                other_root.push((interp.label.clone(), t / base));
            }
        }
    }
    // Geometric means of the slowdowns, per interpreter and way of counting.
    println!();
    println!(
        "{:<34} {:>8} {:>9} {:>6} {:>12}",
        "geomean slowdown (×)", "cProfile", "launched", "--pid", "another root"
    );
    let mut labels: Vec<&String> = ratios.iter().map(|r| &r.0).collect();
    labels.dedup();
    for label in labels {
        let rows: Vec<_> = ratios.iter().filter(|r| &r.0 == label).collect();
        let g = |f: fn(&(String, f64, f64, f64)) -> f64| {
            (rows.iter().map(|r| f(r).ln()).sum::<f64>() / rows.len() as f64).exp()
        };
        // Launched into another root, where it was run.
        let mut root_label = label.split(" (--pid").next().unwrap_or(label).to_owned();
        let other: Vec<f64> = other_root
            .iter()
            .filter(|(l, _)| *l == root_label)
            .map(|r| r.1)
            .collect();
        root_label = match other.len() {
            0 => "-".into(),
            n => format!(
                "{:.2}",
                (other.iter().map(|r| r.ln()).sum::<f64>() / n as f64).exp()
            ),
        };
        println!(
            "  {:<32} {:>8.2} {:>9.2} {:>6.2} {:>12}",
            label,
            g(|r| r.1),
            g(|r| r.2),
            g(|r| r.3),
            root_label
        );
    }
    Ok(())
}

/// How the chrooted interpreters are launched into another root with a `/tmp` of its own:
/// their wrapper (which chroots, binding the host's `/tmp` at the same path) run in a mount
/// namespace whose `/tmp` is a tmpfs, as `systemd-run -p PrivateTmp=yes` or a container
/// gives. tracer's directory for the launch, made in the host's `/tmp`, is then not the one
/// Python finds.
const OTHER_ROOT: &str =
    "`unshare -m sh -c 'mount -t tmpfs tmpfs /tmp && exec \"$@\"' sh WRAPPER …`";
const PRIVATE_TMP: &str = "mount -t tmpfs tmpfs /tmp && exec \"$@\"";

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

/// One run of `python ARGS gated:FIFO` counted by pid (`tracerctl start --pid`, attached
/// while the program waits in native code before its work, as one attaches to an idle
/// service; in-process
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
    if !Command::new("mkfifo").arg(&go).status()?.success() {
        bail!("mkfifo {} failed", go.display());
    }
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
