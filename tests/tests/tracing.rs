//! Tracing mode end to end: a real tracerd records every Python call of real interpreters;
//! traces are checked against counting mode's ncalls (themselves checked against cProfile in
//! python.rs), read back from Chrome JSON and Perfetto protobuf, streamed live, and pushed
//! past the kernel ring buffer and the trace file's limits with the losses counted exactly.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Read, Write},
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use serde_json::Value;
use tracer_tests::{
    interpreters, python, root_or_skip, script,
    timeline::{assert_nested, chrome_slices, perfetto_summary},
    wait_until, ChildGuard, Daemon, DaemonOptions,
};

fn json(d: &Daemon, id: &str) -> Value {
    d.report_json(id)
}

/// Runs `tracerctl start --mode=MODE ARGS -- PYTHON SCRIPT ARGS` to its end; returns the session id.
fn run(d: &Daemon, mode: &str, opts: &[&str], cmd: &[&Path], args: &[&str]) -> String {
    let file = d.dir.path().join("report.json");
    let out = d
        .ctl()
        .args(["start", mode])
        .args(opts)
        .args(["--format", "json", "-o"])
        .arg(&file)
        .arg("--")
        .args(cmd)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    report["session"]["id"].as_str().unwrap().to_owned()
}

/// ncalls per "line:qualname" of `script`'s functions in a report's Python table.
fn ncalls(report: &Value, script: &Path) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for f in report["python"]["functions"].as_array().unwrap() {
        if Path::new(f["filename"].as_str().unwrap()) == script {
            let key = format!("{}:{}", f["firstlineno"], f["qualname"].as_str().unwrap());
            *out.entry(key).or_default() += f["ncalls"].as_u64().unwrap();
        }
    }
    out
}

fn total_ncalls(report: &Value) -> u64 {
    report["python"]["functions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["ncalls"].as_u64().unwrap())
        .sum()
}

fn loss(report: &Value, cause: &str) -> u64 {
    report["losses"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["cause"] == cause)
        .map(|l| l["count"].as_u64().unwrap())
        .sum()
}

#[test]
fn traced_calls_equal_counting_ncalls_on_every_interpreter() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let wl = script("py_workload.py");
    for py in interpreters() {
        // The probes both ways (counting in-process counts close()'s throw, see python.rs).
        let counted = run(
            &d,
            "--mode=counting",
            &["--python", "--python-uprobes-only"],
            &[&py, &wl],
            &["threads"],
        );
        let want = ncalls(&json(&d, &counted), &wl);
        let traced = run(&d, "--mode=tracing", &[], &[&py, &wl], &["threads"]);
        let report = json(&d, &traced);
        assert_eq!(report["losses"], serde_json::json!([]), "{}", py.display());
        let chrome: Value = serde_json::from_slice(&d.export(&traced, "chrome")).unwrap();
        let slices = chrome_slices(&chrome);
        assert_nested(&slices);
        let mut got: BTreeMap<String, u64> = BTreeMap::new();
        for s in slices.iter().filter(|s| Path::new(&s.file) == wl) {
            *got.entry(format!("{}:{}", s.line, s.name)).or_default() += 1;
        }
        assert_eq!(
            got,
            want,
            "{}: trace events vs counting's ncalls",
            py.display()
        );
        // Within the session too: every counted call is in the trace, nothing else is.
        assert_eq!(
            slices.len() as u64,
            total_ncalls(&report),
            "{}",
            py.display()
        );
        assert_eq!(report["trace"]["python_calls"], slices.len() as u64);
        let threads: std::collections::BTreeSet<u64> = slices.iter().map(|s| s.tid).collect();
        assert!(threads.len() >= 5, "main thread and 4 workers: {threads:?}");
    }
}

#[test]
fn perfetto_traces_balance_every_slice() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let wl = script("py_workload.py");
    let id = run(&d, "--mode=tracing", &[], &[&python(), &wl], &["threads"]);
    let report = json(&d, &id);
    let p = perfetto_summary(&d.export(&id, "perfetto"));
    let calls = report["trace"]["python_calls"].as_u64().unwrap();
    assert_eq!((p.begins, p.ends), (calls, calls));
    assert!(
        p.max_depth > 200,
        "deep(200) nests over 200 calls: {}",
        p.max_depth
    );
    let tids: std::collections::BTreeSet<u64> = p.thread_tracks.values().map(|t| t.1).collect();
    assert!(tids.len() >= 5, "a track per thread: {tids:?}");
}

/// A workload held before its cue, with a tracing session on it.
struct Cued {
    child: ChildGuard,
    out: BufReader<std::process::ChildStdout>,
}

impl Cued {
    fn start(py: &Path, args: &[&str]) -> Self {
        let mut child = ChildGuard::spawn(
            Command::new(py)
                .arg(script("trace_workload.py"))
                .args(args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped()),
        );
        let mut out = BufReader::new(child.0.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line, "ready\n");
        Self { child, out }
    }

    fn go(&mut self) {
        self.child
            .0
            .stdin
            .as_mut()
            .unwrap()
            .write_all(b"go\n")
            .unwrap();
        self.child.0.stdin.as_mut().unwrap().flush().unwrap();
    }

    fn wait_done(&mut self) {
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        assert_eq!(line, "done\n");
    }

    /// Lets it exit; a session following it ends.
    fn exit(mut self) {
        drop(self.child.0.stdin.take());
        let _ = self.child.0.wait();
    }
}

fn start_session(d: &Daemon, pid: u32, opts: &[&str]) -> String {
    let pid = pid.to_string();
    let mut args = vec!["start", "--mode=tracing", "--pid", &pid];
    args.extend_from_slice(opts);
    d.ok(&args).trim().to_owned()
}

fn wait_finished(d: &Daemon, id: &str) {
    wait_until(20, "the session to end", || {
        !d.ok(&["status", id]).contains("running")
    });
}

#[test]
fn an_overflowing_ring_buffer_loses_exactly_what_it_reports() {
    if !root_or_skip() {
        return;
    }
    // 1 MiB holds about 16,000 events; the workload makes 100,000 calls while tracerd is
    // stopped and cannot drain.
    let d = Daemon::start_with(DaemonOptions {
        args: vec!["--trace-ring-mb".into(), "1".into()],
        ..DaemonOptions::default()
    });
    let mut w = Cued::start(&python(), &["100000"]);
    let id = start_session(&d, w.child.pid(), &[]);
    let daemon = nix::unistd::Pid::from_raw(d.pid() as i32);
    nix::sys::signal::kill(daemon, nix::sys::signal::Signal::SIGSTOP).unwrap();
    w.go();
    w.wait_done();
    nix::sys::signal::kill(daemon, nix::sys::signal::Signal::SIGCONT).unwrap();
    w.exit();
    wait_finished(&d, &id);
    let report = json(&d, &id);
    let lost = loss(&report, "trace_ringbuf_full");
    let delivered = report["trace"]["python_calls"].as_u64().unwrap();
    assert!(lost > 50_000, "most calls cannot fit: {lost} lost");
    assert_eq!(
        delivered + lost,
        total_ncalls(&report),
        "produced = delivered + lost"
    );
    let status = d.ok(&["status", &id]);
    assert!(
        status.contains(&format!("{lost} trace_ringbuf_full")),
        "{status}"
    );
    let tick = report["python"]["functions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["qualname"] == "tick")
        .unwrap()["ncalls"]
        .clone();
    assert_eq!(tick, 100_000);
}

fn trace_events(d: &Daemon, id: &str) -> u64 {
    d.ok(&["status", id])
        .lines()
        .find_map(|l| l.strip_prefix("trace:"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .expect("a trace line in status")
}

#[test]
fn watchers_see_events_live_and_slow_ones_are_told_what_they_missed() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    for (calls, slow) in [(2_000u64, false), (400_000, true)] {
        let mut w = Cued::start(&python(), &[&calls.to_string()]);
        let id = start_session(&d, w.child.pid(), &[]);
        // Until the cue the workload makes no calls: once the count settles, every event
        // from here on is one the watcher must show or say it missed.
        let mut before = trace_events(&d, &id);
        wait_until(10, "the trace to settle", || {
            std::thread::sleep(Duration::from_millis(100));
            let now = trace_events(&d, &id);
            std::mem::replace(&mut before, now) == now
        });
        let mut watch = ChildGuard::spawn(
            d.ctl()
                .args(["watch", &id])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped()),
        );
        let mut err = BufReader::new(watch.0.stderr.take().unwrap());
        let mut line = String::new();
        err.read_line(&mut line).unwrap();
        assert!(line.contains("watching session"), "{line}");
        let out = watch.0.stdout.take().unwrap();
        let read = |mut out: std::process::ChildStdout| {
            let mut s = String::new();
            out.read_to_string(&mut s).unwrap();
            s
        };
        // A slow watcher: nothing reads its output until the session is over.
        let (reader, out) = if slow {
            (None, Some(out))
        } else {
            (Some(std::thread::spawn(move || read(out))), None)
        };
        w.go();
        w.wait_done();
        w.exit();
        wait_finished(&d, &id);
        let report = json(&d, &id);
        assert_eq!(
            report["losses"],
            serde_json::json!([]),
            "the watcher held nothing up"
        );
        let printed = match reader {
            Some(r) => r.join().unwrap(),
            None => read(out.unwrap()),
        };
        let mut rest = String::new();
        err.read_to_string(&mut rest).unwrap();
        assert!(watch.0.wait().unwrap().success(), "{rest}");
        let missed: u64 = rest
            .split_whitespace()
            .find_map(|w| w.parse().ok())
            .unwrap_or(0);
        let shown = printed.lines().count() as u64;
        let after = report["trace"]["python_calls"].as_u64().unwrap() - before;
        assert_eq!(
            shown + missed,
            after,
            "shown + missed = recorded since watching ({rest})"
        );
        let ticks = printed
            .lines()
            .filter(|l| l.contains(" py ") && l.contains(" tick ("))
            .count();
        if slow {
            assert!(missed > 0, "a watcher that reads nothing misses events");
        } else {
            let others: Vec<&str> = printed
                .lines()
                .filter(|l| !l.contains(" tick ("))
                .take(5)
                .collect();
            assert_eq!(
                (missed, ticks as u64),
                (0, calls),
                "other lines: {others:#?}"
            );
        }
    }
}

#[test]
fn a_small_buffer_spills_to_the_file_and_its_limit_counts_losses() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    // 60,000 calls: 3.2 MiB of events through a 1 MiB buffer into a 2 MiB file.
    let mut w = Cued::start(&python(), &["60000"]);
    let id = start_session(
        &d,
        w.child.pid(),
        &["--buffer-mb", "1", "--max-file-mb", "2"],
    );
    w.go();
    w.wait_done();
    // Spilled while running: the file grows before the session ends.
    let file = d.state_dir.join("traces").join(format!("{id}.events"));
    wait_until(10, "the buffer to spill", || {
        std::fs::metadata(&file).is_ok_and(|m| m.len() >= 1 << 20)
    });
    w.exit();
    wait_finished(&d, &id);
    let report = json(&d, &id);
    let in_file = report["trace"]["events"].as_u64().unwrap();
    let record = 56;
    assert_eq!(std::fs::metadata(&file).unwrap().len(), in_file * record);
    assert_eq!(in_file, (2 << 20) / record);
    let over = loss(&report, "trace_file_limit");
    assert_eq!(
        in_file + over,
        total_ncalls(&report),
        "kept + over the limit = produced"
    );
    // The session's final state says what its report says, the last buffer's events included.
    let status = d.ok(&["status", &id]);
    assert!(
        status.contains(&format!("{over} trace_file_limit")),
        "{status}"
    );
    // The trace outlives the daemon, like the report.
    let mut d = d;
    d.restart();
    let chrome: Value = serde_json::from_slice(&d.export(&id, "chrome")).unwrap();
    assert_eq!(chrome_slices(&chrome).len() as u64, in_file);
    // Deleting the session takes its trace file with it, for good.
    let running = d.ok(&[
        "start",
        "--mode=counting",
        "--all",
        "--events",
        "task-clock",
        "--duration",
        "30s",
    ]);
    let running = running.trim();
    let line = tracer_tests::one_line_error(&d.run(&["delete", running]));
    assert!(line.contains("is running: stop it first"), "{line}");
    d.ok(&["stop", running]);
    assert_eq!(d.ok(&["delete", &id]).trim(), format!("deleted {id}"));
    assert!(!file.exists());
    let line = tracer_tests::one_line_error(&d.run(&["report", &id]));
    assert!(line.contains("no session with id"), "{line}");
    d.restart();
    assert!(!d.ok(&["list"]).contains(&id));
}

#[test]
fn native_calls_and_counters_share_the_timeline() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let mut w = Cued::start(&python(), &["1000", "500"]);
    let id = start_session(
        &d,
        w.child.pid(),
        &[
            "--python",
            "--uprobe",
            "libc:getpid",
            "--events",
            "task-clock,page-faults",
            "--interval",
            "20ms",
        ],
    );
    w.go();
    w.wait_done();
    std::thread::sleep(Duration::from_millis(100));
    w.exit();
    wait_finished(&d, &id);
    let report = json(&d, &id);
    let counted: u64 = report["native"]["calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["calls"].as_u64().unwrap())
        .sum();
    assert!(counted >= 500, "os.getpid() 500 times: {counted}");
    let chrome: Value = serde_json::from_slice(&d.export(&id, "chrome")).unwrap();
    let events = chrome["traceEvents"].as_array().unwrap();
    let instants = events
        .iter()
        .filter(|e| e["ph"] == "i" && e["name"].as_str().unwrap().ends_with(":getpid"))
        .count() as u64;
    assert_eq!(instants, counted, "one instant per counted call");
    for counter in ["task-clock", "page-faults"] {
        let readings = events
            .iter()
            .filter(|e| e["ph"] == "C" && e["name"] == counter)
            .count();
        assert!(readings >= 3, "{counter}: {readings} readings");
    }
    let ticks = chrome_slices(&chrome)
        .iter()
        .filter(|s| s.name == "tick")
        .count();
    assert_eq!(ticks, 1000);
}
