//! In-process counting of a launched command (`tracerctl start --mode=counting --python --
//! PY SCRIPT`): tracer's loader starts the counter just before the script's first line, where
//! `python -m cProfile SCRIPT` starts: with sys.monitoring on CPython 3.12+, with a C
//! profile function on 3.10 and 3.11. Counts must equal cProfile's, the program's output must
//! not change, and the program must not see the loader's variables.

use std::{collections::BTreeMap, path::Path, process::Command};

use serde_json::Value;
use tracer_tests::{interpreters, own_calls_and_counted, root_or_skip, script, Daemon};

/// (ncalls, primitive) per "line:name" of cProfile's run of `wl`.
fn cprofile(python: &Path, wl: &Path) -> BTreeMap<String, (u64, u64)> {
    let out = Command::new(python)
        .arg(script("ground_truth.py"))
        .args(["cprofile", wl.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let json = text
        .lines()
        .find_map(|l| l.strip_prefix("GROUND_TRUTH "))
        .expect("ground truth line");
    let t: BTreeMap<String, Value> = serde_json::from_str(json).unwrap();
    t.into_iter()
        .map(|(k, v)| (k, (v[0].as_u64().unwrap(), v[1].as_u64().unwrap())))
        .collect()
}

fn ours(report: &Value, wl: &Path) -> BTreeMap<String, (u64, u64)> {
    let mut out = BTreeMap::new();
    for f in report["python"]["functions"].as_array().expect("functions") {
        if Path::new(f["filename"].as_str().unwrap()) != wl {
            continue;
        }
        let name = f["qualname"].as_str().unwrap().rsplit('.').next().unwrap();
        let e = out
            .entry(format!("{}:{name}", f["firstlineno"]))
            .or_insert((0, 0));
        e.0 += f["ncalls"].as_u64().unwrap();
        e.1 += f["primitive_calls"].as_u64().unwrap();
    }
    out
}

/// The launched program's stdout and the session's JSON report.
fn launched(d: &Daemon, python: &Path, args: &[&str]) -> (String, Value) {
    let out = d.dir.path().join("report.json");
    let mut all = vec![
        "start",
        "--mode=counting",
        "--python",
        "--format",
        "json",
        "-o",
        out.to_str().unwrap(),
        "--",
        python.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    let stdout = d.ok(&all);
    let report = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    (stdout, report)
}

#[test]
fn launched_commands_count_in_process_like_cprofile() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let wl = script("py_workload.py");
    let env = d.dir.path().join("env.py");
    std::fs::write(
        &env,
        "import os\nprint([k for k in os.environ if k in ('LD_PRELOAD', 'TRACER_PYSTART')])\n",
    )
    .unwrap();
    for py in interpreters() {
        let untraced = Command::new(&py).arg(&wl).output().unwrap();
        assert!(untraced.status.success());
        let (stdout, report) = launched(&d, &py, &[wl.to_str().unwrap()]);
        assert_eq!(
            stdout,
            String::from_utf8(untraced.stdout).unwrap(),
            "{}",
            py.display()
        );
        let counted = &report["python"]["counted"][0];
        assert_eq!(counted["way"], "in-process", "{}: {counted}", py.display());
        let why = counted["why"].as_str().unwrap();
        assert!(why.contains("tracer's loader"), "{}: {why}", py.display());
        assert_eq!(ours(&report, &wl), cprofile(&py, &wl), "{}", py.display());
        let (stdout, _) = launched(&d, &py, &[env.to_str().unwrap()]);
        assert_eq!(stdout, "[]\n", "{}", py.display());
        println!("{}: in-process, equal to cProfile", py.display());
    }
}

/// Threads that C code makes for itself (pthreads whose start routine is a ctypes callback):
/// each thread's first frame runs with the counter already on, on every interpreter (a
/// profile function on 3.10 and 3.11, reaching such threads through the frame evaluation
/// wrapper), also after the program put CPython's own evaluation function back as PyTorch's
/// dynamo does. Counts equal the program's own account.
#[test]
fn threads_c_code_makes_are_counted_from_their_first_frame() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let wl = script("c_threads.py");
    for py in interpreters() {
        for args in [&["8", "4"][..], &["8", "3", "reset"]] {
            let mut all = vec![wl.to_str().unwrap()];
            all.extend_from_slice(args);
            let (stdout, report) = launched(&d, &py, &all);
            let what = format!("{} {args:?}", py.display());
            assert_eq!(
                report["python"]["counted"][0]["way"], "in-process",
                "{what}"
            );
            let (own, counted) = own_calls_and_counted(&stdout, &report, &wl);
            assert_eq!(counted, own, "{what}");
            assert_eq!(report["losses"], serde_json::json!([]), "{what}");
        }
    }
}
