//! `cargo xtask bench tracing`: how fast tracerd drains tracing events, and what tracing
//! costs a traced Python program next to counting mode, measured side by side in one run.
//!
//! Part 1 drives native uprobe events (Python calls cannot reach a million a second here): a
//! small C program, compiled at bench time, calls a function `tick` in a loop, paced to a
//! target rate, under `tracerctl start --mode=tracing --uprobe GEN:tick -- GEN …`. Each step of
//! a ramp records what the generator produced, what the trace holds, what the kernel dropped
//! (`trace_ringbuf_full`), the rate tracerd drained at mid-run (from `tracerctl status`), and
//! tracerd's CPU time. The ramp runs on the default 64 MiB ring and again on an 8 MiB one,
//! whose headroom (131,072 events) is too small to hide a drain slower than production;
//! there its fastest steps are repeated with the session writing its file a MiB at a time
//! (`--buffer-mb 1`).
//!
//! Part 2 times a Python workload of many small calls untraced, under
//! `--mode=counting --python` and under `--mode=tracing --python`, interleaved.
//!
//! This file runs part 1's ramp; `generator` builds and reads the generator, `python` runs
//! part 2.

mod generator;
mod python;

use std::{
    fs,
    path::Path,
    process::{Child, Command, Output, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use super::{clock_ticks, group, tracerctl, Daemon};
use crate::bin_dir;
use generator::{compile_generator, generated, untraced_rate};
use python::python_part;

/// Seconds of each step of the ramp, and of the long step on the default ring.
const STEP_SECONDS: f64 = 3.0;
const LONG_SECONDS: f64 = 6.0;

/// The ramp: (calls a second in all, 0 for as fast as it can; generator threads). One thread
/// tops out near 1.4 million traced hits a second here, so the higher targets take two.
const RAMP: &[(u64, u32)] = &[
    (250_000, 1),
    (500_000, 1),
    (1_000_000, 1),
    (1_500_000, 2),
    (2_000_000, 2),
    (0, 1),
    (0, 2),
];

/// The target, events a second drained with no loss.
const TARGET: f64 = 1_000_000.0;

/// tracerd's default ring, and the small one.
const RING_DEFAULT_MB: u64 = 64;
const RING_SMALL_MB: u64 = 8;

/// tracerctl's default `--buffer-mb`, and the small one tried on the small ring.
const DEFAULT_BUFFER_MB: u64 = 64;
const SMALL_BUFFER_MB: u64 = 1;

/// Bytes an event takes in the ring: the 56-byte record and the ring's 8-byte header.
const RING_RECORD: u64 = 64;

pub(super) fn run() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let gen = compile_generator(dir.path())?;
    println!("== Part 1: the highest event rate tracerd drains with no loss ==");
    println!("generator: a C program calling tick() in a loop, paced to a target rate (the clock checked");
    println!("           every 1000 calls), under tracerctl start --mode=tracing --uprobe GEN:tick -- GEN …");
    println!("columns: target/s, thr: the rate asked, shared by the generator's threads; s: the step's length;");
    println!("         buf: the session's --buffer-mb (what it keeps in memory before writing to its file);");
    println!(
        "         achieved/s: the generator's own rate over the step; drained/s: the rate tracerd"
    );
    println!("         recorded at mid-run (tracerctl status every 250 ms, from 0.5 s to the end, slope);");
    println!(
        "         produced (the generator's count) = recorded (report trace.native_calls) + lost"
    );
    println!("         (trace_ringbuf_full): sum; ×ring: events produced / the ring's capacity;");
    println!(
        "         cpu %: tracerd's CPU time (utime+stime) at mid-run, in % of one CPU; ns/ev: all"
    );
    println!(
        "         its CPU time over the session (attach, drain, write, report) per event recorded"
    );
    println!(
        "untraced, the generator makes {} calls/s on one thread",
        group(untraced_rate(&gen)?)
    );

    for ring_mb in [RING_DEFAULT_MB, RING_SMALL_MB] {
        let sub = dir.path().join(format!("ring{ring_mb}"));
        fs::create_dir_all(&sub)?;
        let daemon = start_daemon(&sub, ring_mb)?;
        let capacity = ring_mb * 1024 * 1024 / RING_RECORD;
        println!();
        if ring_mb == RING_DEFAULT_MB {
            println!(
                "ring {ring_mb} MiB (tracerd's default): room for {} events",
                group(capacity)
            );
        } else {
            println!(
                "ring {ring_mb} MiB (tracerd --trace-ring-mb {ring_mb}): room for {} events",
                group(capacity)
            );
        }
        println!(
            "{:>10} {:>3} {:>4} {:>4} {:>11} {:>11} {:>11} {:>11} {:>9} {:>4} {:>6} {:>6} {:>6}",
            "target/s",
            "thr",
            "s",
            "buf",
            "achieved/s",
            "drained/s",
            "produced",
            "recorded",
            "lost",
            "sum",
            "×ring",
            "cpu %",
            "ns/ev"
        );
        let mut specs: Vec<Spec> = RAMP
            .iter()
            .map(|&(rate, threads)| Spec {
                rate,
                threads,
                secs: STEP_SECONDS,
                buffer_mb: DEFAULT_BUFFER_MB,
            })
            .collect();
        if ring_mb == RING_DEFAULT_MB {
            // Long enough to pass the ring's capacity several times over.
            specs.push(Spec {
                rate: 0,
                threads: 2,
                secs: LONG_SECONDS,
                buffer_mb: DEFAULT_BUFFER_MB,
            });
        } else {
            // The ramp's fastest steps again, the session writing its file a MiB at a time.
            for rate in [1_500_000, 0] {
                specs.push(Spec {
                    rate,
                    threads: 2,
                    secs: STEP_SECONDS,
                    buffer_mb: SMALL_BUFFER_MB,
                });
            }
        }
        // A first session costs tracerd more (first attach, first report): not measured.
        step(
            &daemon,
            &sub,
            &gen,
            Spec {
                rate: 100_000,
                threads: 1,
                secs: 0.5,
                buffer_mb: DEFAULT_BUFFER_MB,
            },
            "tracing",
        )?;
        let mut steps = Vec::new();
        for spec in specs {
            let s = step(&daemon, &sub, &gen, spec, "tracing")?;
            print_row(&s, capacity);
            steps.push(s);
        }
        for buffer_mb in [DEFAULT_BUFFER_MB, SMALL_BUFFER_MB] {
            let of: Vec<&Step> = steps
                .iter()
                .filter(|s| s.spec.buffer_mb == buffer_mb)
                .collect();
            if !of.is_empty() {
                verdict(ring_mb, buffer_mb, capacity, &of);
            }
        }
        if ring_mb == RING_DEFAULT_MB {
            // What the probe alone costs the generator: the same loop counted, not traced.
            let counting = step(
                &daemon,
                &sub,
                &gen,
                Spec {
                    rate: 0,
                    threads: 1,
                    secs: STEP_SECONDS,
                    buffer_mb: DEFAULT_BUFFER_MB,
                },
                "counting",
            )?;
            let c = counting.achieved;
            if let Some(t) = steps
                .iter()
                .find(|s| s.spec.rate == 0 && s.spec.threads == 1)
                .map(|s| s.achieved)
            {
                println!(
                    "producer's ceiling, unpaced on one thread: {} calls/s under --mode=counting --uprobe ({:.2} µs a",
                    group(c as u64),
                    1e6 / c
                );
                println!(
                    "                    hit: the uprobe trap), {} calls/s under tracing ({:.2} µs a hit)",
                    group(t as u64),
                    1e6 / t
                );
            }
        }
    }

    println!();
    python_part(dir.path())
}

/// One step of part 1: calls a second in all (0: as fast as it can), generator threads, its
/// length, and the session's `--buffer-mb`.
#[derive(Clone, Copy)]
struct Spec {
    rate: u64,
    threads: u32,
    secs: f64,
    buffer_mb: u64,
}

/// One step's measurements.
struct Step {
    spec: Spec,
    /// The generator's calls and its rate.
    produced: u64,
    achieved: f64,
    /// Events in the trace, and dropped on a full ring.
    recorded: u64,
    lost: u64,
    /// Other losses, as `cause count`.
    other_losses: Vec<String>,
    /// Events a second tracerd recorded, and the share of a CPU it used, mid-run.
    mid: Mid,
    /// tracerd's CPU seconds over the whole session.
    daemon_cpu: f64,
}

impl Step {
    fn clean(&self) -> bool {
        self.lost == 0 && self.other_losses.is_empty() && self.produced == self.recorded
    }
}

fn print_row(s: &Step, capacity: u64) {
    let sum_ok = s.produced == s.recorded + s.lost;
    println!(
        "{:>10} {:>3} {:>4.0} {:>4} {:>11} {:>11} {:>11} {:>11} {:>9} {:>4} {:>6.1} {:>6} {:>6.0}",
        if s.spec.rate == 0 {
            "unpaced".to_owned()
        } else {
            group(s.spec.rate)
        },
        s.spec.threads,
        s.spec.secs,
        s.spec.buffer_mb,
        group(s.achieved as u64),
        s.mid.rate.map_or("-".to_owned(), |d| group(d as u64)),
        group(s.produced),
        group(s.recorded),
        group(s.lost),
        if sum_ok { "ok" } else { "BAD" },
        s.produced as f64 / capacity as f64,
        s.mid
            .cpu
            .map_or("-".to_owned(), |c| format!("{:.1}", c * 100.0)),
        s.daemon_cpu * 1e9 / s.recorded.max(1) as f64
    );
    if !s.other_losses.is_empty() {
        println!("{:>10} other losses: {}", "", s.other_losses.join(", "));
    }
}

/// The result line for one ring and buffer size: the highest rate with no loss below the
/// slowest step that lost events.
fn verdict(ring_mb: u64, buffer_mb: u64, capacity: u64, steps: &[&Step]) {
    let first_loss = steps
        .iter()
        .filter(|s| !s.clean())
        .map(|s| s.achieved)
        .fold(f64::INFINITY, f64::min);
    let top = steps
        .iter()
        .filter(|s| s.clean() && s.achieved < first_loss)
        .max_by(|a, b| a.achieved.total_cmp(&b.achieved));
    let what = format!("{ring_mb} MiB ring, --buffer-mb {buffer_mb}");
    match top {
        Some(t) => println!(
            "highest rate with zero loss ({what}): {} events/s ({}, {} thread{}, {:.0} s, {:.1}× the ring) — target {}/s {}",
            group(t.achieved as u64),
            if t.spec.rate == 0 {
                "unpaced".to_owned()
            } else {
                format!("asked {}", group(t.spec.rate))
            },
            t.spec.threads,
            if t.spec.threads == 1 { "" } else { "s" },
            t.spec.secs,
            t.produced as f64 / capacity as f64,
            group(TARGET as u64),
            if t.achieved >= TARGET { "met" } else { "NOT met" }
        ),
        None => println!("highest rate with zero loss ({what}): none"),
    }
    let lossy: Vec<String> = steps
        .iter()
        .filter(|s| !s.clean())
        .map(|s| {
            format!(
                "{}/s ({} lost)",
                group(s.achieved as u64),
                group(s.produced.saturating_sub(s.recorded))
            )
        })
        .collect();
    if lossy.is_empty() {
        println!("    no step lost an event: the highest rate is the generator's here, not tracerd's limit");
    } else {
        println!("    steps that lost events: {}", lossy.join(", "));
    }
}

/// A tracerd on `dir` with a tracing ring of `ring_mb` MiB.
fn start_daemon(dir: &Path, ring_mb: u64) -> Result<Daemon> {
    if ring_mb == RING_DEFAULT_MB {
        return Daemon::start(dir);
    }
    let socket = dir.join("tracerd.sock");
    let child = Command::new(bin_dir().join("tracerd"))
        .arg("--socket")
        .arg(&socket)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args(["--trace-ring-mb", &ring_mb.to_string()])
        .env("RUST_LOG", "warn")
        .spawn()
        .context("starting tracerd (benchmarks run as root)")?;
    let mut daemon = Daemon { child, socket };
    crate::wait_for_socket(&daemon.socket, &mut daemon.child)?;
    Ok(daemon)
}

/// One step: the generator as `spec` says, under `mode`.
fn step(daemon: &Daemon, dir: &Path, gen: &Path, spec: Spec, mode: &str) -> Result<Step> {
    let report = dir.join("report.json");
    let _ = fs::remove_file(&report);
    let before = daemon.cpu_ticks();
    let mut cmd = tracerctl(daemon);
    cmd.args(["start", &format!("--mode={mode}"), "--uprobe"])
        .arg(format!("{}:tick", gen.display()));
    if mode == "tracing" {
        cmd.args(["--buffer-mb", &spec.buffer_mb.to_string()]);
    }
    let child = cmd
        .args(["--format", "json", "-o"])
        .arg(&report)
        .arg("--")
        .arg(gen)
        .args([
            spec.rate.to_string(),
            spec.secs.to_string(),
            spec.threads.to_string(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running tracerctl")?;
    let (mid, child) = mid_run(daemon, child, spec.secs)?;
    let out = child.wait_with_output()?;
    let daemon_cpu = (daemon.cpu_ticks() - before) as f64 / clock_ticks();
    check(&out, "tracerctl")?;
    let (produced, gen_secs) = generated(&out.stdout)?;
    let json: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&report)?).context("tracer's JSON report")?;
    let mut lost = 0;
    let mut other_losses = Vec::new();
    for l in json["losses"].as_array().into_iter().flatten() {
        let (cause, count) = (l["cause"].as_str().unwrap_or("?"), l["count"].as_u64());
        match cause {
            "trace_ringbuf_full" => lost = count.unwrap_or(0),
            _ => other_losses.push(format!("{cause} {}", count.unwrap_or(0))),
        }
    }
    let recorded = if mode == "tracing" {
        json["trace"]["native_calls"]
            .as_u64()
            .context("no trace.native_calls in the report")?
    } else {
        produced
    };
    // Trace files take 56 bytes an event: gone once counted, so the disk does not fill.
    if let Ok(files) = fs::read_dir(dir.join("state").join("traces")) {
        for f in files.flatten() {
            let _ = fs::remove_file(f.path());
        }
    }
    Ok(Step {
        spec,
        produced,
        achieved: produced as f64 / gen_secs,
        recorded,
        lost,
        other_losses,
        mid,
        daemon_cpu,
    })
}

/// What tracerd did at mid-run: events recorded a second, and its share of a CPU.
struct Mid {
    rate: Option<f64>,
    cpu: Option<f64>,
}

/// While `child` (a `tracerctl start -- GEN` of `secs`) runs: the session's event count
/// (`tracerctl status`) and tracerd's CPU time, read every 250 ms from 0.5 s after the
/// session started to shortly before the generator ends; the rate is the least-squares
/// slope of the counts.
fn mid_run(daemon: &Daemon, mut child: Child, secs: f64) -> Result<(Mid, Child)> {
    let mut mid = Mid {
        rate: None,
        cpu: None,
    };
    let start = Instant::now();
    let id = loop {
        if child.try_wait()?.is_some() || start.elapsed() > Duration::from_secs(10) {
            return Ok((mid, child));
        }
        if let Some(id) = running_session(daemon)? {
            break id;
        }
        sleep(Duration::from_millis(20));
    };
    let found = Instant::now();
    // (seconds since the session was found, events, tracerd's CPU ticks)
    let mut samples: Vec<(f64, f64, u64)> = Vec::new();
    while found.elapsed().as_secs_f64() < secs - 0.25 {
        if child.try_wait()?.is_some() {
            break;
        }
        if found.elapsed().as_secs_f64() >= 0.5 {
            // The count is taken when the daemon answers: the end of the call is closer to
            // it than the start (the daemon may answer late while it writes a trace file).
            if let Some(n) = trace_events(daemon, &id)? {
                samples.push((found.elapsed().as_secs_f64(), n as f64, daemon.cpu_ticks()));
            }
        }
        sleep(Duration::from_millis(250));
    }
    if let (Some(a), Some(b)) = (samples.first(), samples.last()) {
        if b.0 > a.0 {
            let k = samples.len() as f64;
            let (mt, mn) = (
                samples.iter().map(|s| s.0).sum::<f64>() / k,
                samples.iter().map(|s| s.1).sum::<f64>() / k,
            );
            let num: f64 = samples.iter().map(|s| (s.0 - mt) * (s.1 - mn)).sum();
            let den: f64 = samples.iter().map(|s| (s.0 - mt).powi(2)).sum();
            mid.rate = Some(num / den);
            mid.cpu = Some((b.2 - a.2) as f64 / clock_ticks() / (b.0 - a.0));
        }
    }
    Ok((mid, child))
}

/// The id of the daemon's running session (`tracerctl list`).
fn running_session(daemon: &Daemon) -> Result<Option<String>> {
    let out = tracerctl(daemon).arg("list").output()?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .find(|l| l.trim_end().ends_with("running"))
        .and_then(|l| l.split_whitespace().next())
        .map(str::to_owned))
}

/// Events recorded so far (`trace:     N events, X MiB` in `tracerctl status`).
fn trace_events(daemon: &Daemon, id: &str) -> Result<Option<u64>> {
    let out = tracerctl(daemon).args(["status", id]).output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !text
        .lines()
        .any(|l| l.starts_with("state:") && l.contains("running"))
    {
        return Ok(None);
    }
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix("trace:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.replace(',', "").parse().ok()))
}

fn check(out: &Output, what: &str) -> Result<()> {
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
