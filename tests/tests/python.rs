//! Python call counting, end to end: tracer's ncalls for every function of a workload must
//! equal cProfile's (and, for threads, the profile hook's), on every interpreter here.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::Value;
use tracer_tests::{root_or_skip, script, wait_until, ChildGuard, Daemon};

/// CPython 3.10-3.13 on this machine: pyenv's builds (shared libpython, full symbols) and the
/// distribution's python3.11 (interpreter in the executable, dynamic symbols only).
fn interpreters() -> Vec<PathBuf> {
    let root = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".pyenv")));
    let mut out = Vec::new();
    if let Some(Ok(dirs)) = root.map(|r| std::fs::read_dir(r.join("versions"))) {
        for d in dirs.filter_map(Result::ok) {
            let name = d.file_name().to_string_lossy().into_owned();
            for minor in 10..=13 {
                if name.starts_with(&format!("3.{minor}.")) && !name.contains('t') {
                    let exe = d.path().join(format!("bin/python3.{minor}"));
                    if exe.exists() {
                        out.push(exe);
                    }
                }
            }
        }
    }
    if Path::new("/usr/bin/python3.11").exists() {
        out.push("/usr/bin/python3.11".into());
    }
    out.sort();
    out
}

/// {"line:name": ncalls} for the functions of `script`, from CPython's own profilers.
fn ground_truth(python: &Path, mode: &str, script: &Path, args: &[&str]) -> BTreeMap<String, u64> {
    let out = Command::new(python)
        .arg(tracer_tests::script("ground_truth.py"))
        .args([mode, script.to_str().unwrap()])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ground truth failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let json = text
        .lines()
        .find_map(|l| l.strip_prefix("GROUND_TRUTH "))
        .expect("ground truth line");
    serde_json::from_str(json).unwrap()
}

/// tracer's counts for the functions of `script`, keyed like the ground truth.
fn ours(report: &Value, script: &Path) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for f in report["python"]["functions"]
        .as_array()
        .expect("python functions")
    {
        if Path::new(f["filename"].as_str().unwrap()) != script {
            continue;
        }
        // cProfile names functions by co_name; tracer reports the qualname.
        let name = f["qualname"]
            .as_str()
            .unwrap()
            .rsplit('.')
            .next()
            .unwrap()
            .to_owned();
        *out.entry(format!("{}:{name}", f["firstlineno"]))
            .or_default() += f["ncalls"].as_u64().unwrap();
    }
    out
}

fn run_counted(d: &Daemon, python: &Path, script: &Path, args: &[&str]) -> Value {
    let out_file = d.dir.path().join("py.json");
    let out = d
        .ctl()
        .args([
            "start",
            "--mode=counting",
            "--python",
            "--format",
            "json",
            "-o",
        ])
        .arg(&out_file)
        .arg("--")
        .arg(python)
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tracerctl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(&out_file).unwrap()).unwrap()
}

fn check_losses(report: &Value) {
    assert_eq!(
        report["losses"],
        serde_json::json!([]),
        "{}",
        report["losses"]
    );
    assert_eq!(report["python"]["unknown_names"], 0);
}

#[test]
fn ncalls_equal_cprofiles_on_every_interpreter() {
    if !root_or_skip() {
        return;
    }
    let pythons = interpreters();
    if pythons.is_empty() {
        println!("skipping: no CPython 3.10-3.13 found");
        return;
    }
    let d = Daemon::start();
    let wl = script("py_workload.py");
    for py in &pythons {
        let truth = ground_truth(py, "cprofile", &wl, &[]);
        assert!(
            truth.get("8:fib").is_some_and(|&n| n == 8361),
            "{py:?}: {truth:?}"
        );
        let report = run_counted(&d, py, &wl, &[]);
        check_losses(&report);
        assert_eq!(ours(&report, &wl), truth, "{}", py.display());
        println!(
            "{}: {} functions agree with cProfile",
            py.display(),
            truth.len()
        );
    }
}

#[test]
fn threads_are_counted_like_the_profile_hook() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let wl = script("py_workload.py");
    for py in interpreters() {
        let truth = ground_truth(&py, "hook", &wl, &["threads"]);
        assert_eq!(truth.get("82:thread_work"), Some(&4), "{truth:?}");
        let report = run_counted(&d, &py, &wl, &["threads"]);
        check_losses(&report);
        assert_eq!(ours(&report, &wl), truth, "{}", py.display());
    }
}

#[test]
fn attaches_to_a_running_interpreter() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    for py in interpreters() {
        // The script waits (inside the eval loop) until a file appears, then works and exits.
        let go = d.dir.path().join("go");
        let _ = std::fs::remove_file(&go);
        let code = format!(
            "import os, time\n\
             def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\
             def wait():\n    while not os.path.exists({go:?}):\n        time.sleep(0.01)\n\
             wait()\nfib(15)\n"
        );
        let file = d.dir.path().join("attach.py");
        std::fs::write(&file, code).unwrap();
        let child = ChildGuard::spawn(Command::new(&py).arg(&file));
        std::thread::sleep(std::time::Duration::from_millis(300));
        let id = d
            .ok(&[
                "start",
                "--mode=counting",
                "--python",
                "--pid",
                &child.pid().to_string(),
            ])
            .trim()
            .to_owned();
        std::fs::write(&go, b"").unwrap();
        wait_until(20, "the target to exit", || {
            d.ok(&["status", &id]).contains("target exited")
        });
        let report: Value =
            serde_json::from_str(&d.ok(&["report", &id, "--format", "json"])).unwrap();
        check_losses(&report);
        let counts = ours(&report, &file);
        // fib(15) = 1973 calls, all after attach; `wait` was entered before and is never re-entered.
        assert_eq!(
            counts.get("2:fib"),
            Some(&1973),
            "{}: {counts:?}",
            py.display()
        );
        assert_eq!(counts.get("4:wait"), None, "{}: {counts:?}", py.display());
    }
}

#[test]
fn system_wide_sessions_pick_up_new_python_processes() {
    if !root_or_skip() {
        return;
    }
    let Some(py) = interpreters().into_iter().last() else {
        println!("skipping: no CPython 3.10-3.13 found");
        return;
    };
    let d = Daemon::start();
    let id = d
        .ok(&["start", "--mode=counting", "--python", "--all"])
        .trim()
        .to_owned();
    let wl = script("py_workload.py");
    let out = Command::new(&py).arg(&wl).output().unwrap();
    assert!(out.status.success());
    d.ok(&["stop", &id]);
    let report: Value = serde_json::from_str(&d.ok(&["report", &id, "--format", "json"])).unwrap();
    let truth = ground_truth(&py, "cprofile", &wl, &[]);
    assert_eq!(ours(&report, &wl), truth);
}

#[test]
fn a_process_that_is_not_python_is_refused() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let sleeper = ChildGuard::spawn(Command::new("sleep").arg("30"));
    let out = d.run(&[
        "start",
        "--mode=counting",
        "--python",
        "--pid",
        &sleeper.pid().to_string(),
    ]);
    let line = tracer_tests::one_line_error(&out);
    assert!(line.contains("does not run CPython"), "{line}");
}
