//! A running session's report so far, end to end: `report --interim` (the gRPC call's
//! `interim` flag) for a sampling and a counting session on one running program, growing
//! while they run and leaving them running; and `tracerctl top` in a terminal (tmux),
//! refreshing until the session ends, then showing its final report.

use std::{
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;
use tracer_tests::{bin, one_line_error, root_or_skip, script, venv_python, ChildGuard, Daemon};

fn interim(d: &Daemon, id: &str) -> Value {
    serde_json::from_str(&d.ok(&["report", id, "--interim", "--format", "json"])).unwrap()
}

/// Samples under `busy` in a profile.
fn busy_samples(report: &Value) -> u64 {
    report["profile"]["stacks"]
        .as_array()
        .unwrap_or_else(|| panic!("no profile: {report}"))
        .iter()
        .filter(|s| {
            s["frames"]
                .as_array()
                .is_some_and(|f| f.iter().any(|f| f["name"] == "busy"))
        })
        .map(|s| s["count"].as_u64().unwrap_or(0))
        .sum()
}

/// Calls of the libc function the counting session probes (`time.monotonic`'s).
fn clock_calls(report: &Value) -> u64 {
    report["native"]["calls"]
        .as_array()
        .unwrap_or_else(|| panic!("no native part: {report}"))
        .iter()
        .filter(|c| c["symbol"] == "clock_gettime")
        .map(|c| c["calls"].as_u64().unwrap_or(0))
        .sum()
}

/// Calls of `step` counted.
fn step_calls(report: &Value) -> u64 {
    report["python"]["functions"]
        .as_array()
        .unwrap_or_else(|| panic!("no Python part: {report}"))
        .iter()
        .filter(|f| f["qualname"] == "step")
        .map(|f| f["ncalls"].as_u64().unwrap_or(0))
        .sum()
}

#[test]
fn interim_reports_grow_while_sessions_run() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let target = ChildGuard::spawn_ready(
        Command::new(venv_python())
            .arg(script("steady.py"))
            .arg("60"),
    );
    let pid = target.pid().to_string();
    let start = |args: &[&str]| {
        let mut all = vec!["start"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--pid", &pid]);
        d.ok(&all).trim().to_owned()
    };
    let sampling = start(&["--mode=sampling", "--frequency", "200"]);
    let counting = start(&[
        "--mode=counting",
        "--python",
        "--uprobe",
        "libc:clock_gettime",
    ]);
    std::thread::sleep(Duration::from_secs(2));

    let s1 = interim(&d, &sampling);
    assert_eq!(s1["session"]["state"], "running", "{s1}");
    let busy1 = busy_samples(&s1);
    // In-process counts are read about once a second, off the manager's task, from the
    // first time they are asked for: the first readings may be empty.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (step1, clock1) = loop {
        let c1 = interim(&d, &counting);
        let n = step_calls(&c1);
        if n > 0 || Instant::now() > deadline {
            break (n, clock_calls(&c1));
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    std::thread::sleep(Duration::from_millis(2500));
    let (s2, c2) = (interim(&d, &sampling), interim(&d, &counting));
    let (busy2, step2, clock2) = (busy_samples(&s2), step_calls(&c2), clock_calls(&c2));
    println!(
        "busy samples {busy1} then {busy2}; step calls {step1} then {step2}; clock_gettime {clock1} then {clock2}"
    );
    assert!(busy1 > 0 && busy2 > busy1, "samples {busy1} then {busy2}");
    assert!(step1 > 0 && step2 > step1, "calls {step1} then {step2}");
    // Native calls, counted in the kernel, read without being taken.
    assert!(
        clock1 > 0 && clock2 > clock1,
        "clock_gettime {clock1} then {clock2}"
    );

    // The sessions run on; a plain report still waits for the end.
    assert!(one_line_error(&d.run(&["report", &sampling])).contains("still running"));
    for id in [&sampling, &counting] {
        assert!(d.ok(&["stop", id]).contains("finished (stopped)"));
    }
    // After the end, the final report (which has at least what the interim one had).
    let final_calls = step_calls(
        &serde_json::from_str(&d.ok(&["report", &counting, "--interim", "--format", "json"]))
            .unwrap(),
    );
    assert!(final_calls >= step2, "final {final_calls}, interim {step2}");
}

/// A tmux session killed on drop.
struct Tmux(String);

impl Tmux {
    fn pane(&self) -> String {
        let out = Command::new("tmux")
            .args(["capture-pane", "-p", "-t", &self.0])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The pane once it shows `what`, within `secs`.
    fn wait_for(&self, what: &str, secs: u64) -> String {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let pane = self.pane();
            if pane.contains(what) || Instant::now() > deadline {
                return pane;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.0])
            .status();
    }
}

#[test]
fn top_refreshes_in_a_terminal_until_the_session_ends() {
    if !root_or_skip() {
        return;
    }
    if Command::new("tmux").arg("-V").output().is_err() {
        tracer_testkit::skip("tmux is not installed");
        return;
    }
    let d = Daemon::start();
    let target = ChildGuard::spawn_ready(
        Command::new(venv_python())
            .arg(script("steady.py"))
            .arg("60"),
    );
    let pid = target.pid().to_string();
    let id = d
        .ok(&["start", "--mode=sampling", "--pid", &pid])
        .trim()
        .to_owned();
    let top = format!(
        "{} --socket {} top {id} --limit 10; echo top exited $?; sleep 60",
        bin("tracerctl").display(),
        d.socket.display()
    );
    let tmux = Tmux(format!("tracer-top-{}", std::process::id()));
    let made = Command::new("tmux")
        .args(["new-session", "-d", "-s", &tmux.0, "-x", "160", "-y", "60"])
        .arg(&top)
        .status()
        .unwrap();
    assert!(made.success(), "tmux new-session failed");

    // Refreshes replace each other on the screen, and show where the time goes.
    let pane = tmux.wait_for("refresh 4 ", 20);
    println!("{pane}");
    assert!(pane.contains(&format!("tracerctl top {id}")), "{pane}");
    assert!(pane.contains("busy ("), "no busy frame: {pane}");
    assert_eq!(
        pane.matches("tracerctl top").count(),
        1,
        "refreshes did not replace each other: {pane}"
    );

    d.ok(&["stop", &id]);
    let pane = tmux.wait_for("top exited", 20);
    println!("{pane}");
    assert!(pane.contains("the session ended"), "{pane}");
    assert!(pane.contains("top exited 0"), "{pane}");
    assert!(pane.contains("stopped"), "{pane}");
}

/// Bad input: an unknown session, a bad interval; one line each.
#[test]
fn top_refuses_what_it_cannot_show() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    for args in [
        &["top", "000000000000"][..],
        &["report", "000000000000", "--interim"][..],
    ] {
        let e = one_line_error(&d.run(args));
        assert!(
            e.contains("no session with id '000000000000'"),
            "{args:?}: {e}"
        );
    }
    let e = one_line_error(&d.run(&["top", "000000000000", "--interval", "5x"]));
    assert!(e.contains("invalid duration unit 'x'"), "{e}");
}
