//! Native call counting (`--uprobe LIB:SYMBOL`), end to end: tracer's per-function counts
//! must equal what `perf probe` + `perf stat` count for the same command.

use std::{collections::BTreeMap, path::PathBuf, process::Command, time::Duration};

use serde_json::Value;
use tracer_tests::{one_line_error, python, root_or_skip, wait_until, ChildGuard, Daemon};

/// The libc this test process maps: the one the Python workloads map too.
fn libc() -> PathBuf {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            p.rsplit('/')
                .next()
                .is_some_and(|n| n.starts_with("libc.so"))
        })
        .map(PathBuf::from)
        .expect("libc in /proc/self/maps")
}

/// A deterministic workload: 1000 getpid() and 300 getppid() calls.
const WORK: &str =
    "import os\nfor _ in range(1000): os.getpid()\nfor _ in range(300): os.getppid()\n";

/// perf's own uprobes on the same functions, removed on drop.
struct PerfProbes;

impl PerfProbes {
    fn add(lib: &PathBuf, funcs: &[&str]) -> Self {
        let _ = Command::new("perf")
            .args(["probe", "-q", "-d", "tracertest:*"])
            .output();
        for f in funcs {
            let out = Command::new("perf")
                .args(["probe", "-q", "-x"])
                .arg(lib)
                .args(["-a", &format!("tracertest:{f}={f}")])
                .output()
                .expect("perf (Debian package linux-perf)");
            assert!(
                out.status.success(),
                "perf probe {f}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        PerfProbes
    }
}

impl Drop for PerfProbes {
    fn drop(&mut self) {
        let _ = Command::new("perf")
            .args(["probe", "-q", "-d", "tracertest:*"])
            .output();
    }
}

/// `perf stat` counts of the probes for one run of `cmd`.
fn perf_counts(funcs: &[&str], cmd: &[&str]) -> BTreeMap<String, u64> {
    let events: Vec<String> = funcs.iter().map(|f| format!("tracertest:{f}")).collect();
    let out = Command::new("perf")
        .args(["stat", "-x,", "-e", &events.join(","), "--"])
        .args(cmd)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            let name = f.get(2)?.strip_prefix("tracertest:")?;
            Some((name.to_owned(), f[0].parse().ok()?))
        })
        .collect()
}

/// Calls per symbol in a report, summed over processes.
fn ours(report: &Value) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for c in report["native"]["calls"].as_array().expect("native calls") {
        *out.entry(c["symbol"].as_str().unwrap().to_owned())
            .or_default() += c["calls"].as_u64().unwrap();
    }
    out
}

#[test]
fn native_calls_equal_perf_probe_counts() {
    if !root_or_skip() {
        return;
    }
    let py = python();
    let py = py.to_str().unwrap();
    let funcs = ["getpid", "getppid"];
    let _probes = PerfProbes::add(&libc(), &funcs);
    let truth = perf_counts(&funcs, &[py, "-c", WORK]);
    assert!(
        truth["getpid"] >= 1000 && truth["getppid"] >= 300,
        "{truth:?}"
    );

    let d = Daemon::start();
    let out = d.dir.path().join("r.json");
    // A glob and a library named without "lib": both as bcc's funccount takes them.
    let args = [
        "start",
        "--mode=counting",
        "--uprobe",
        "libc:getp*id",
        "--uprobe",
        "c:getuid",
    ];
    d.ok(&[
        &args[..],
        &[
            "--format",
            "json",
            "-o",
            out.to_str().unwrap(),
            "--",
            py,
            "-c",
            WORK,
        ],
    ]
    .concat());
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(report["losses"], serde_json::json!([]));
    let probed: Vec<&str> = report["native"]["probes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["symbol"].as_str().unwrap())
        .collect();
    for f in ["getpid", "getppid", "getpgid", "getuid"] {
        assert!(probed.contains(&f), "{f} not probed: {probed:?}");
    }
    let got = ours(&report);
    for f in funcs {
        assert_eq!(
            got.get(f),
            truth.get(f),
            "{f}: tracer {got:?}, perf {truth:?}"
        );
    }
    // No perf counters unless asked for, as with --python.
    assert_eq!(report["counters"], serde_json::json!([]));
    // Named for what it exec'd, not for tracerctl that launched it.
    let exe: String = std::path::Path::new(py)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .chars()
        .take(15)
        .collect();
    assert_eq!(report["processes"]["command"], exe.as_str());
}

#[test]
fn attaches_to_a_running_process() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let go = d.dir.path().join("go");
    let code = format!(
        "import os, time\nwhile not os.path.exists({go:?}): time.sleep(0.01)\n\
         for _ in range(500): os.getppid()\n"
    );
    let child = ChildGuard::spawn(Command::new(python()).args(["-c", &code]));
    std::thread::sleep(Duration::from_millis(300));
    let id = d
        .ok(&[
            "start",
            "--mode=counting",
            "--uprobe",
            "libc:getppid",
            "--pid",
            &child.pid().to_string(),
        ])
        .trim()
        .to_owned();
    std::fs::write(&go, b"").unwrap();
    wait_until(20, "the target to exit", || {
        d.ok(&["status", &id]).contains("target exited")
    });
    let report: Value = d.report_json(&id);
    let rows = report["native"]["calls"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["pid"], child.pid());
    assert_eq!(rows[0]["calls"], 500);
    let table = d.ok(&["report", &id]);
    assert!(table.contains("getppid (libc.so"), "{table}");
}

#[test]
fn system_wide_sessions_count_every_process_and_only_then() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let all = d
        .ok(&[
            "start",
            "--mode=counting",
            "--all",
            "--uprobe",
            "libc:getppid",
        ])
        .trim()
        .to_owned();
    // A --pid session on another process must not see this one's calls.
    let mut idle = ChildGuard::spawn(Command::new("sleep").arg("30"));
    let one = d
        .ok(&[
            "start",
            "--mode=counting",
            "--uprobe",
            "libc:getppid",
            "--pid",
            &idle.pid().to_string(),
        ])
        .trim()
        .to_owned();
    let code = "import os\nfor _ in range(300): os.getppid()\n";
    let mut workers = Vec::new();
    for _ in 0..2 {
        let mut c = Command::new(python()).args(["-c", code]).spawn().unwrap();
        workers.push(c.id());
        assert!(c.wait().unwrap().success());
    }
    d.ok(&["stop", &all]);
    let _ = idle.0.kill();
    let _ = idle.0.wait();
    wait_until(20, "the --pid session to end", || {
        d.ok(&["status", &one]).contains("target exited")
    });
    let report: Value = d.report_json(&all);
    let by_pid: BTreeMap<u64, u64> = report["native"]["calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["pid"].as_u64().unwrap(), c["calls"].as_u64().unwrap()))
        .collect();
    for w in workers {
        assert_eq!(by_pid.get(&u64::from(w)), Some(&300), "{by_pid:?}");
    }
    let report: Value = d.report_json(&one);
    assert_eq!(report["native"]["calls"], serde_json::json!([]), "{report}");
}

#[test]
fn bad_specs_are_refused_in_one_line() {
    let d = Daemon::start();
    for (spec, says) in [
        ("getpid", "expected BINARY_OR_LIB:SYMBOL"),
        ("libc:no_such_function_at_all", "no function in"),
        ("libdoesnotexist:f", "no library or executable named"),
        ("libc:*", "at most 1000 per pattern"),
    ] {
        let out = d.run(&["start", "--mode=counting", "--uprobe", spec, "--", "true"]);
        let err = one_line_error(&out);
        assert!(err.contains(says), "{spec}: {err}");
        assert!(
            err.contains("invalid argument") || err.contains(spec),
            "{spec}: {err}"
        );
    }
}
