//! Thread states on a tracing session's timeline (`--mode=tracing --off-cpu`): each time a
//! thread spent off the CPU is a slice inside the Python call it left in, named for what it
//! waited on, and their lengths add up to what the program timed itself.

use std::collections::BTreeMap;

use serde_json::Value;
use tracer_tests::{
    one_line_error, root_or_skip, script,
    timeline::{assert_nested, chrome_slices, perfetto_summary, Slice},
    venv_python, Daemon,
};

/// (Python function of the phase, the off-CPU slice's name there, the phase's own name).
const WAITS: [(&str, &str, &str); 3] = [
    ("sleep_phase", "off-CPU: sleep", "sleep"),
    ("pipe_phase", "off-CPU: pipe", "pipe"),
    ("lock_phase", "off-CPU: futex: a lock or condition", "lock"),
];

#[test]
fn off_cpu_times_are_slices_inside_the_calls_that_waited() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let file = d.dir.path().join("report.json");
    let out = d
        .ctl()
        .args([
            "start",
            "--mode=tracing",
            "--python",
            "--off-cpu",
            "--format",
            "json",
            "-o",
        ])
        .arg(&file)
        .arg("--")
        .arg(venv_python())
        .arg(script("off_cpu_workload.py"))
        .args(["0.3", "2"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    let took: BTreeMap<String, f64> = serde_json::from_str(
        printed
            .lines()
            .find(|l| l.starts_with('{'))
            .unwrap_or_else(|| panic!("no timing printed: {printed}")),
    )
    .unwrap();
    let report: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    let id = report["session"]["id"].as_str().unwrap().to_owned();
    assert!(
        report["trace"]["off_cpu"].as_u64().unwrap_or(0) >= 6,
        "{}",
        report["trace"]
    );

    let chrome: Value = serde_json::from_slice(&d.export(&id, "chrome")).unwrap();
    let slices = chrome_slices(&chrome);
    // Off-CPU slices nest among the calls like calls do.
    assert_nested(&slices);
    let pid = slices
        .iter()
        .find(|s| s.name == "sleep_phase")
        .map(|s| s.pid)
        .expect("sleep_phase traced");
    let on_main = |s: &&Slice| s.pid == pid && s.tid == pid;
    for (function, away, phase) in WAITS {
        let calls: Vec<&Slice> = slices
            .iter()
            .filter(on_main)
            .filter(|s| s.name == function)
            .collect();
        assert_eq!(calls.len(), 2, "{function} calls: {calls:?}");
        // The time away inside each call, by name.
        let mut inside: BTreeMap<&str, u64> = BTreeMap::new();
        for s in slices
            .iter()
            .filter(on_main)
            .filter(|s| s.name.starts_with("off-CPU: "))
        {
            if calls
                .iter()
                .any(|c| c.start_ns <= s.start_ns && s.end_ns <= c.end_ns)
            {
                *inside.entry(s.name.as_str()).or_default() += s.end_ns - s.start_ns;
            }
        }
        let named = inside.get(away).copied().unwrap_or(0) as f64 / 1e9;
        let truth = took[phase];
        println!("{function}: {inside:?}, the program timed {truth:.3} s");
        // The wait itself, less the call's few instructions around it.
        assert!(
            named <= truth && named >= truth * 0.9,
            "{function}: {named:.3} s named {away}, the program timed {truth:.3} s: {inside:?}"
        );
    }

    // Perfetto draws the same slices, balanced on each thread's track.
    let summary = perfetto_summary(&d.export(&id, "perfetto"));
    assert_eq!(summary.begins, slices.len() as u64, "{summary:?}");

    // Counting sessions have no timeline to put them on.
    let refused = d.run(&["start", "--mode=counting", "--off-cpu", "--", "true"]);
    assert!(
        one_line_error(&refused).contains("sampling and tracing"),
        "{}",
        one_line_error(&refused)
    );
}

/// A process asleep through a whole session attached by pid: its main thread's time away is
/// one slice from the session's start to its end, marked unfinished.
#[test]
fn a_thread_away_for_the_whole_session_is_one_unfinished_slice() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let sleeper =
        tracer_tests::ChildGuard::spawn_ready(std::process::Command::new(venv_python()).args([
            "-c",
            "import time; print('ready', flush=True); time.sleep(60)",
        ]));
    let pid = sleeper.pid().to_string();
    let id = d
        .ok(&["start", "--mode=tracing", "--off-cpu", "--pid", &pid])
        .trim()
        .to_owned();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    d.ok(&["stop", &id]);
    let chrome: Value = serde_json::from_slice(&d.export(&id, "chrome")).unwrap();
    let away: Vec<&Value> = chrome["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["cat"] == "off-cpu" && e["tid"].as_u64() == Some(sleeper.pid().into()))
        .collect();
    assert_eq!(away.len(), 1, "{away:?}");
    let e = away[0];
    assert_eq!(e["name"], "off-CPU: sleep", "{e}");
    assert_eq!(e["args"]["unfinished"], true, "{e}");
    let ms = e["dur"].as_f64().unwrap() / 1000.0;
    assert!((1400.0..3000.0).contains(&ms), "{ms} ms away: {e}");
}
