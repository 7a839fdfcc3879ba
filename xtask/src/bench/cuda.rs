//! `cargo xtask bench cuda`: the time tracer adds to each CUDA kernel launch, measured side
//! by side in one run on a launch-bound loop: untraced, under bare uprobes (`perf stat`
//! counting `perf probe` uprobes on the same two entry points: the floor any uprobe-based
//! counter pays), under `--mode=counting --cuda` and under `--mode=tracing --cuda`, each by
//! default (launches counted in-process) and with the launch probes.
//!
//! The loop is tests/cuda's `launch_loop`, against tests/cuda's libcudart/libcuda (CUDA's ABI,
//! no GPU needed): each `cudaLaunchKernel` goes on to the driver's `cuLaunchKernel`, as the
//! real runtime's launches do, so a launch crosses two probed entry points. The sessions
//! attach with `--pid` while the loop waits for its cue, its libraries already mapped, and
//! the report's launch counts are checked against the loop's own, and each row's kernel name,
//! configuration and callers against what it launched, so the figures are known to come from
//! probed launches reported as ever. Where PyTorch sees a GPU, a PyTorch loop of small in-place adds
//! runs too, untraced and under counting.

use std::{
    io::{BufRead, BufReader, Read, Write},
    path::Path,
    process::{Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};

use super::{clock_ticks, group, median, python_executable, tracerctl, Daemon};
use crate::root;

mod bare;
use bare::BareProbes;

/// Launches per timed round, and rounds per run (the run's figure is its median round).
const N: u64 = 200_000;
const ROUNDS: u64 = 5;
/// Runs of each condition, interleaved.
const RUNS: usize = 5;
/// The project's targets: time added per launch, counting and tracing (issue 59).
const TARGET_NS: f64 = 1000.0;
const TRACING_TARGET_NS: f64 = 1200.0;

/// PyTorch part: `x.add_(1)` calls per round, rounds per run, runs per condition.
const TORCH_N: u64 = 20_000;
const TORCH_ROUNDS: u64 = 3;
const TORCH_RUNS: usize = 3;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Cond {
    Untraced,
    Bare,
    Counting,
    /// Tracing as `--cuda --pid` does by default: launches counted and stamped in-process.
    Tracing,
    /// Tracing with `--cuda-uprobes-only`: an event a probe hit.
    TracingProbes,
    /// Counting with `--cuda-stacks`: every launch's stack recorded too.
    Stacks,
    /// Counting with `--cuda-driver-only`: one probe a launch.
    DriverOnly,
    /// Counting as `--cuda --pid` does by default: launches counted inside the loop by
    /// tracer's injection library, from CUPTI's callbacks: no probe a launch.
    InProcess,
}

impl Cond {
    fn name(self) -> &'static str {
        match self {
            Cond::Untraced => "untraced",
            Cond::Bare => "bare",
            Cond::Counting => "probes",
            Cond::Tracing => "tracing",
            Cond::TracingProbes => "tr-probes",
            Cond::Stacks => "stacks",
            Cond::DriverOnly => "driver",
            Cond::InProcess => "default",
        }
    }

    /// `tracerctl start` arguments besides `--cuda --pid PID`.
    fn mode(self) -> Option<&'static [&'static str]> {
        match self {
            Cond::Untraced | Cond::Bare => None,
            Cond::Counting => Some(&["--mode=counting", "--cuda-uprobes-only"]),
            Cond::Tracing => Some(&["--mode=tracing"]),
            Cond::TracingProbes => Some(&["--mode=tracing", "--cuda-uprobes-only"]),
            Cond::Stacks => Some(&["--mode=counting", "--cuda-stacks"]),
            Cond::DriverOnly => Some(&["--mode=counting", "--cuda-driver-only"]),
            Cond::InProcess => Some(&["--mode=counting"]),
        }
    }
}

const CONDS: [Cond; 8] = [
    Cond::Untraced,
    Cond::Bare,
    Cond::Counting,
    Cond::Tracing,
    Cond::Stacks,
    Cond::DriverOnly,
    Cond::InProcess,
    Cond::TracingProbes,
];

/// One run of a loop.
#[derive(Default)]
struct Run {
    /// Seconds of the median round.
    seconds: f64,
    /// Launches the loop made after its cue (timed and warm-up).
    launches: u64,
    /// The session's launches at the runtime's entry points (`cuda*`) and at the driver's
    /// (`cu*`), graphs aside; bare: the hits of the uprobe on each.
    runtime: u64,
    driver: u64,
    /// Tracing: the trace's CUDA events; all sessions: events lost.
    events: u64,
    /// Copies, allocations and synchronizations the session counted.
    memory: u64,
    lost: u64,
    /// tracerd's CPU time over the run, in clock ticks.
    daemon_ticks: u64,
    /// Launch rows that differ from what the loop launched (name, configuration, callers).
    wrong: Vec<String>,
}

/// The one launch `launch_loop` makes, as each of a session's rows must show it: what the
/// figures are known to measure beside the counts.
const LOOP_KERNEL: &str = "step(float*, int)";
const LOOP_GRID: [u64; 3] = [64, 1, 1];
const LOOP_BLOCK: [u64; 3] = [256, 1, 1];
/// The native caller of each entry point: the host stub for the runtime's, tests/cuda's
/// runtime for the driver's.
const LOOP_CALLERS: [(&str, &str); 2] = [
    ("cudaLaunchKernel", "step (launch_loop.c:"),
    ("cuLaunchKernel", "launch (fake_cudart.c:"),
];

/// What a run's launch rows are checked against.
#[derive(Clone, Copy)]
enum Rows {
    /// Not checked (the PyTorch loop).
    Unchecked,
    /// `launch_loop`'s one launch, with no Python call site: the C loop runs no Python.
    Loop,
    /// `launch_loop`'s one launch made under `launch_loop.py`'s `main()`: the call site every
    /// row must name.
    FromPython,
}

/// The Python call site of every launch `launch_loop.py` makes.
const PY_CALL_SITE: &str = "main (";
const PY_CALL_SITE_FILE: &str = "launch_loop.py:";

/// Where a session's launch rows differ from `launch_loop`'s one launch: each row has its
/// kernel's name, configuration (default stream, no shared memory), its entry point's native
/// caller, and the Python call site `rows` says; one row per entry point probed.
fn loop_rows_wrong(launches: &[serde_json::Value], cond: Cond, rows: Rows) -> Vec<String> {
    let mut wrong = Vec::new();
    let dims = |v: &serde_json::Value| -> Vec<u64> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(serde_json::Value::as_u64)
            .collect()
    };
    for (api, caller) in LOOP_CALLERS {
        let found: Vec<&serde_json::Value> = launches.iter().filter(|l| l["api"] == api).collect();
        let want_rows = usize::from(!(cond == Cond::DriverOnly && api.starts_with("cuda")));
        if found.len() != want_rows {
            wrong.push(format!("{} {api} rows, not {want_rows}", found.len()));
        }
        for l in found {
            let site = l["call_site"].as_str().unwrap_or("");
            let site_ok = match rows {
                Rows::FromPython => {
                    site.starts_with(PY_CALL_SITE) && site.contains(PY_CALL_SITE_FILE)
                }
                _ => site.is_empty(),
            };
            let ok = l["kernel"] == LOOP_KERNEL
                && dims(&l["grid"]) == LOOP_GRID
                && dims(&l["block"]) == LOOP_BLOCK
                && l["shared_mem"] == 0
                && l["stream"] == 0
                && l["caller"].as_str().is_some_and(|c| c.starts_with(caller))
                && site_ok;
            if !ok {
                wrong.push(format!("{api} row {l}"));
            }
        }
    }
    if let Some(other) = launches
        .iter()
        .find(|l| !LOOP_CALLERS.iter().any(|(api, _)| l["api"] == *api))
    {
        wrong.push(format!("a row the loop did not launch: {other}"));
    }
    wrong
}

pub(super) fn run() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let libs = dir.path().join("cuda");
    let out = Command::new("sh")
        .arg(root().join("tests/cuda/build.sh"))
        .arg(&libs)
        .output()
        .context("running tests/cuda/build.sh")?;
    if !out.status.success() {
        bail!(
            "tests/cuda/build.sh failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let daemon = Daemon::start(dir.path())?;
    let bare = BareProbes::create(&libs)?;
    let program = libs.join("launch_loop");
    let args = [N.to_string(), ROUNDS.to_string()];

    println!("loop: tests/cuda/launch_loop {N} {ROUNDS}: step<<<64, 256>>>(x, n) the way nvcc 13 compiles it");
    println!("      (__cudaPushCallConfiguration, the host stub's __cudaPopCallConfiguration and");
    println!("      cudaLaunchKernel), against tests/cuda's libcudart.so.13/libcuda.so.1 (CUDA's ABI, no GPU);");
    println!("      each cudaLaunchKernel calls the driver's cuLaunchKernel, as the real runtime's launches do:");
    println!("      a launch crosses two probed entry points");
    println!("sessions: tracerctl start --mode=counting|tracing --cuda [probes, tr-probes: --cuda-uprobes-only; stacks: --cuda-stacks;");
    println!("      driver: --cuda-driver-only; default, tracing: nothing more, counted in-process] --pid PID, started while the loop waits");
    println!("      for its cue with both libraries mapped; 1,000 untimed warm-up launches, then {ROUNDS} timed");
    println!(
        "      rounds of {} launches; a run's figure is its median round; {RUNS} runs of each",
        group(N)
    );
    println!("      condition, interleaved, median (min–max of the runs beneath)");
    println!(
        "bare: perf stat -e {} -p PID, uprobes",
        BareProbes::EVENTS.join(",")
    );
    println!(
        "      made by perf probe at both functions' entries (past endbr64, as tracer's), same cue"
    );
    println!("columns: ns per launch; ns added per launch over untraced; ×: over untraced; vs bare: added");
    println!("      over bare's added; launches the session counted (bare: hits) at the runtime's entry point");
    println!("      and at the driver's, against the loop's own count; tracing: CUDA events in the trace;");
    println!("      events lost; tracerd's CPU per run");
    println!();

    let mut runs: Vec<Vec<Run>> = (0..CONDS.len()).map(|_| Vec::new()).collect();
    for round in 0..RUNS {
        for k in 0..CONDS.len() {
            let i = (k + round) % CONDS.len();
            runs[i].push(one_run(
                &daemon,
                Some(&bare),
                Command::new(&program).args(&args),
                CONDS[i],
                Rows::Loop,
            )?);
        }
    }
    let per_launch = |r: &Run| r.seconds / N as f64 * 1e9;
    let ns = |i: usize| median(runs[i].iter().map(per_launch).collect());
    let range = |i: usize| {
        let v: Vec<f64> = runs[i].iter().map(per_launch).collect();
        let (lo, hi) = v.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        });
        format!("{lo:.0}–{hi:.0}")
    };
    let tick_ms = 1000.0 / clock_ticks();
    let base = ns(0);
    let bare_added = ns(1) - base;
    println!(
        "{:<9} {:>9} {:>9} {:>7} {:>7} {:>12} {:>12} {:>12} {:>5} {:>12} {:>5} {:>10}",
        "condition",
        "ns/launch",
        "added ns",
        "×",
        "vs bare",
        "runtime",
        "driver",
        "loop",
        "",
        "events",
        "lost",
        "tracerd ms"
    );
    let mut mismatches = Vec::new();
    for (i, cond) in CONDS.iter().enumerate() {
        let name = cond.name();
        let t = ns(i);
        if *cond == Cond::Untraced {
            println!("{name:<9} {t:>9.0} {:>9} {:>7.2}", "-", 1.0);
        } else {
            // Every run must have counted every launch at both layers (driver-only: at the
            // driver's alone).
            let runtime_want = |r: &Run| {
                if *cond == Cond::DriverOnly {
                    0
                } else {
                    r.launches
                }
            };
            let mut bad: Vec<String> = runs[i]
                .iter()
                .filter(|r| r.runtime != runtime_want(r) || r.driver != r.launches)
                .map(|r| {
                    format!(
                        "{name}: runtime {} driver {} loop {}",
                        r.runtime, r.driver, r.launches
                    )
                })
                .collect();
            // A traced run has an event for each launch it counted, at each layer, and each
            // copy or synchronization, or counts it lost.
            let traced = matches!(cond, Cond::Tracing | Cond::TracingProbes);
            bad.extend(
                runs[i]
                    .iter()
                    .filter(|r| traced && r.events + r.lost != r.runtime + r.driver + r.memory)
                    .map(|r| {
                        format!(
                            "{name}: {} events and {} lost for {} launches and {} other calls counted",
                            r.events,
                            r.lost,
                            r.runtime + r.driver,
                            r.memory
                        )
                    }),
            );
            // And every row names the kernel, configuration and callers the loop launched.
            bad.extend(
                runs[i]
                    .iter()
                    .flat_map(|r| r.wrong.iter().map(|w| format!("{name}: {w}"))),
            );
            let last = runs[i].last().expect("RUNS > 0");
            println!(
                "{name:<9} {t:>9.0} {:>9.0} {:>7.2} {:>7.2} {:>12} {:>12} {:>12} {:>5} {:>12} {:>5} {:>10}",
                t - base,
                t / base,
                (t - base) / bare_added,
                group(last.runtime),
                group(last.driver),
                group(last.launches),
                if bad.is_empty() { "ok" } else { "BAD" },
                if traced {
                    group(median(runs[i].iter().map(|r| r.events as f64).collect()) as u64)
                } else {
                    "-".to_owned()
                },
                if *cond == Cond::Bare {
                    "-".to_owned()
                } else {
                    group(runs[i].iter().map(|r| r.lost).sum())
                },
                if *cond == Cond::Bare {
                    "-".to_owned()
                } else {
                    format!(
                        "{:.0}",
                        median(runs[i].iter().map(|r| r.daemon_ticks as f64).collect()) * tick_ms
                    )
                }
            );
            mismatches.extend(bad);
        }
        println!("{:<9} {:>9}", "", range(i));
    }
    let (counting, tracing, stacks, driver, inproc, tracing_probes) = (
        ns(2) - base,
        ns(3) - base,
        ns(4) - base,
        ns(5) - base,
        ns(6) - base,
        ns(7) - base,
    );
    let verdict = |added: f64, target: f64| {
        if added <= target {
            "met"
        } else {
            "NOT met"
        }
    };
    println!(
        "added per launch: counting with the probes {counting:.0} ns, tracing with the probes {tracing_probes:.0} ns, counting with launch stacks {stacks:.0} ns,"
    );
    println!("      bare uprobes {bare_added:.0} ns (two probe hits");
    println!(
        "      each: cudaLaunchKernel and cuLaunchKernel), counting at the driver only {driver:.0} ns (one hit),"
    );
    println!("      counting by default {inproc:.0} ns, tracing by default {tracing:.0} ns (in-process, no hit: CUPTI's callbacks in");
    println!("      tracer's injection library, each launch also stamped into its table's ring when tracing)");
    println!(
        "      target ≤ {TARGET_NS:.0} ns counting, ≤ {TRACING_TARGET_NS:.0} ns tracing: counting by default {}, tracing {}, counting with the probes {}, at the driver only {}",
        verdict(inproc, TARGET_NS),
        verdict(tracing, TRACING_TARGET_NS),
        verdict(counting, TARGET_NS),
        verdict(driver, TARGET_NS),
    );
    println!();
    mismatches.extend(python_part(
        &daemon,
        &libs,
        [counting, tracing, driver, inproc],
    )?);
    torch_part(&daemon)?;
    if !mismatches.is_empty() {
        bail!(
            "sessions counted other launches than the loop made: {}",
            mismatches.join("; ")
        );
    }
    Ok(())
}

/// Runs `cmd` (a loop that prints `ready`, waits for a line, prints `SECONDS` per round and
/// `LAUNCHES`), under a session of `cond` started on its pid between the two.
fn one_run(
    daemon: &Daemon,
    bare: Option<&BareProbes>,
    cmd: &mut Command,
    cond: Cond,
    rows: Rows,
) -> Result<Run> {
    let before = daemon.cpu_ticks();
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the loop")?;
    let mut stdout = BufReader::new(child.stdout.take().expect("piped"));
    let mut line = String::new();
    stdout.read_line(&mut line)?;
    if line.trim() != "ready" {
        let _ = child.kill();
        let _ = child.wait();
        bail!("the loop printed {line:?} instead of \"ready\"");
    }
    let mut perf = None;
    let id = match cond.mode() {
        None if cond == Cond::Bare => {
            match bare
                .context("no bare probes")
                .and_then(|b| b.stat(child.id()))
            {
                Ok(p) => perf = Some(p),
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(e);
                }
            }
            // perf stat opens its events on the pid at start: well within this.
            sleep(Duration::from_millis(500));
            None
        }
        None => None,
        Some(mode) => {
            let out = tracerctl(daemon)
                .arg("start")
                .args(mode)
                .args(["--cuda", "--pid", &child.id().to_string()])
                .output()?;
            if !out.status.success() {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "tracerctl start: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            // Both libraries are mapped already: probed as the session starts, well within
            // this.
            sleep(Duration::from_millis(500));
            Some(String::from_utf8(out.stdout)?.trim().to_owned())
        }
    };
    let mut stdin = child.stdin.take().expect("piped");
    stdin.write_all(b"go\n")?;
    drop(stdin);
    let mut rest = String::new();
    stdout.read_to_string(&mut rest)?;
    let status = child.wait()?;
    ensure!(status.success(), "the loop failed ({status}): {rest}");
    let mut rounds = Vec::new();
    let mut run = Run::default();
    for l in rest.lines() {
        if let Some(s) = l.strip_prefix("SECONDS ") {
            rounds.push(s.trim().parse::<f64>().context("bad time")?);
        } else if let Some(n) = l.strip_prefix("LAUNCHES ") {
            run.launches = n.trim().parse().context("bad launch count")?;
        }
    }
    ensure!(!rounds.is_empty(), "the loop printed no time");
    run.seconds = median(rounds);
    if let Some(perf) = perf {
        // perf stat -p ends when its process does.
        let out = perf.wait_with_output()?;
        ensure!(
            out.status.success(),
            "perf stat failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        (run.runtime, run.driver) = BareProbes::hits(&String::from_utf8_lossy(&out.stderr));
    }
    if let Some(id) = id {
        let json = report(daemon, &id)?;
        for l in json["cuda"]["launches"].as_array().into_iter().flatten() {
            let api = l["api"].as_str().unwrap_or("");
            let n = l["launches"].as_u64().unwrap_or(0);
            if api.contains("Graph") {
                continue;
            }
            if api.starts_with("cuda") {
                run.runtime += n;
            } else {
                run.driver += n;
            }
        }
        if !matches!(rows, Rows::Unchecked) {
            let launches = json["cuda"]["launches"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            run.wrong = loop_rows_wrong(&launches, cond, rows);
        }
        // The default's figure is the in-process route's only where it was taken.
        let way = &json["cuda"]["launch_counting"][0]["way"];
        if matches!(cond, Cond::InProcess | Cond::Tracing) && way != "in-process" {
            run.wrong.push(format!(
                "counted with probes, not in-process: {}",
                json["cuda"]["launch_counting"][0]["why"]
            ));
        }
        run.events = json["trace"]["cuda_events"].as_u64().unwrap_or(0);
        run.memory = json["cuda"]["memory"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| m["calls"].as_u64().unwrap_or(0))
            .sum();
        run.lost = super::losses(&json);
        // Gone once read: a traced run's file holds two events per launch.
        let _ = tracerctl(daemon).args(["delete", &id]).output();
    }
    run.daemon_ticks = daemon.cpu_ticks() - before;
    Ok(run)
}

/// The report of session `id`, once it has ended (it ends when its target exits).
fn report(daemon: &Daemon, id: &str) -> Result<serde_json::Value> {
    let start = Instant::now();
    loop {
        let out = tracerctl(daemon).args(["status", id]).output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        if out.status.success()
            && !text
                .lines()
                .any(|l| l.starts_with("state:") && l.contains("running"))
        {
            break;
        }
        ensure!(
            start.elapsed() < Duration::from_secs(30),
            "session {id} did not end within 30 s of its target"
        );
        sleep(Duration::from_millis(50));
    }
    let out = tracerctl(daemon)
        .args(["report", id, "--format", "json"])
        .output()?;
    ensure!(
        out.status.success(),
        "tracerctl report {id}: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    serde_json::from_slice(&out.stdout).context("tracer's JSON report")
}

/// The same loop made from one Python line (`launch_loop.py`), untraced and under each
/// session kind but stacks: what reading each launch's Python call site adds. `c_added`: the
/// C loop's added ns (counting, tracing, driver), for the difference. The runs whose counts or
/// rows differ from the loop's.
fn python_part(daemon: &Daemon, libs: &Path, c_added: [f64; 4]) -> Result<Vec<String>> {
    let python = python_executable()?;
    let script = root().join("tests/cuda/launch_loop.py");
    let args = [
        script.display().to_string(),
        libs.join("liblaunch_loop.so").display().to_string(),
        N.to_string(),
        ROUNDS.to_string(),
    ];
    println!("== the same loop under a Python frame ==");
    println!(
        "python: {}; tests/cuda/launch_loop.py calls the loop (liblaunch_loop.so) from its main():",
        python.display()
    );
    println!("      every launch's call site is that line, read in the probe at each entry point (default: by the");
    println!("      injection library, in the launching thread); {RUNS} runs");
    println!("      of each, interleaved, median; \"over C\": added ns over the C loop's in the same condition");
    println!();
    let conds = [
        Cond::Untraced,
        Cond::Counting,
        Cond::Tracing,
        Cond::DriverOnly,
        Cond::InProcess,
    ];
    let mut runs: Vec<Vec<Run>> = conds.iter().map(|_| Vec::new()).collect();
    for round in 0..RUNS {
        for k in 0..conds.len() {
            let i = (k + round) % conds.len();
            runs[i].push(one_run(
                daemon,
                None,
                Command::new(&python).args(&args),
                conds[i],
                Rows::FromPython,
            )?);
        }
    }
    let ns = |i: usize| median(runs[i].iter().map(|r| r.seconds / N as f64 * 1e9).collect());
    let base = ns(0);
    println!(
        "{:<9} {:>9} {:>9} {:>9} {:>12} {:>12} {:>12} {:>5}",
        "condition", "ns/launch", "added ns", "over C", "runtime", "driver", "loop", ""
    );
    println!("{:<9} {base:>9.0} {:>9}", "untraced", "-");
    let mut mismatches = Vec::new();
    for (i, cond) in conds.iter().enumerate().skip(1) {
        let name = cond.name();
        let runtime_want = |r: &Run| {
            if *cond == Cond::DriverOnly {
                0
            } else {
                r.launches
            }
        };
        let mut bad: Vec<String> = runs[i]
            .iter()
            .filter(|r| r.runtime != runtime_want(r) || r.driver != r.launches)
            .map(|r| {
                format!(
                    "python {name}: runtime {} driver {} loop {}",
                    r.runtime, r.driver, r.launches
                )
            })
            .collect();
        bad.extend(
            runs[i]
                .iter()
                .flat_map(|r| r.wrong.iter().map(|w| format!("python {name}: {w}"))),
        );
        let last = runs[i].last().expect("RUNS > 0");
        let added = ns(i) - base;
        println!(
            "{name:<9} {:>9.0} {added:>9.0} {:>9.0} {:>12} {:>12} {:>12} {:>5}",
            ns(i),
            added - c_added[i - 1],
            group(last.runtime),
            group(last.driver),
            group(last.launches),
            if bad.is_empty() { "ok" } else { "BAD" },
        );
        mismatches.extend(bad);
    }
    println!();
    Ok(mismatches)
}

/// The PyTorch loop, untraced and under counting `--cuda`, where PyTorch sees a GPU.
fn torch_part(daemon: &Daemon) -> Result<()> {
    let python = python_executable()?;
    let probe = Command::new(&python)
        .args([
            "-c",
            "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)",
        ])
        .output()
        .context("running python3")?;
    if !probe.status.success() {
        let why = if probe.status.code() == Some(3) {
            "torch.cuda.is_available() is False (no GPU or no driver)".to_owned()
        } else if String::from_utf8_lossy(&probe.stderr).contains("No module named") {
            format!("PyTorch is not installed for {}", python.display())
        } else {
            format!(
                "importing torch failed: {}",
                String::from_utf8_lossy(&probe.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            )
        };
        println!("GPU part skipped: {why}");
        return Ok(());
    }
    // Also run by hand on GPU machines without a build tree: tests/gpu/bench_cuda.sh.
    let script = root().join("tests/gpu/torch_launch_loop.py");
    let args = [
        script.display().to_string(),
        TORCH_N.to_string(),
        TORCH_ROUNDS.to_string(),
    ];
    println!("== GPU: PyTorch ==");
    println!(
        "python: {}; {TORCH_ROUNDS} rounds of {} × x.add_(1) on a 1024-float CUDA tensor, then",
        python.display(),
        group(TORCH_N)
    );
    println!("      torch.cuda.synchronize(); a run's figure is its median round; {TORCH_RUNS} runs of each, interleaved, median");
    println!("columns: ns per add_; ns added over untraced; ×; launches the session counted at the runtime's");
    println!("      entry points and at the driver's (the whole session, warm-up excluded), against the adds made");
    println!();
    let conds = [Cond::Untraced, Cond::Counting, Cond::InProcess];
    let mut runs: Vec<Vec<Run>> = conds.iter().map(|_| Vec::new()).collect();
    for round in 0..TORCH_RUNS {
        for k in 0..conds.len() {
            let i = (k + round) % conds.len();
            runs[i].push(one_run(
                daemon,
                None,
                Command::new(&python).args(&args),
                conds[i],
                Rows::Unchecked,
            )?);
        }
    }
    let ns = |i: usize| {
        median(
            runs[i]
                .iter()
                .map(|r| r.seconds / TORCH_N as f64 * 1e9)
                .collect(),
        )
    };
    let base = ns(0);
    println!(
        "{:<9} {:>9} {:>9} {:>7} {:>12} {:>12} {:>12}",
        "condition", "ns/add_", "added ns", "×", "runtime", "driver", "adds"
    );
    println!("{:<9} {base:>9.0} {:>9} {:>7.2}", "untraced", "-", 1.0);
    for (i, cond) in conds.iter().enumerate().skip(1) {
        let (counted, last) = (ns(i), runs[i].last().expect("TORCH_RUNS > 0"));
        println!(
            "{:<9} {counted:>9.0} {:>9.0} {:>7.2} {:>12} {:>12} {:>12} {}",
            cond.name(),
            counted - base,
            counted / base,
            group(last.runtime),
            group(last.driver),
            group(last.launches),
            last.wrong.join("; ")
        );
    }
    Ok(())
}
