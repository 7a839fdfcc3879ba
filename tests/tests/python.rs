//! Python call counting, end to end: tracer's ncalls and primitive calls for every function
//! of a workload must equal cProfile's (and, for threads, the profile hook's), on every
//! interpreter here; its tottime and cumtime must tell the same story as cProfile's.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::Value;
use tracer_tests::{interpreters, root_or_skip, script, wait_until, ChildGuard, Daemon};

/// One function's numbers: ncalls, primitive calls, tottime s, cumtime s.
type Stats = (u64, Option<u64>, Option<f64>, Option<f64>);

/// {"line:name": stats} for the functions of `script`, from CPython's own profilers.
fn ground_truth(
    python: &Path,
    mode: &str,
    script: &Path,
    args: &[&str],
) -> BTreeMap<String, Stats> {
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
    let v = ground_truth_line(&String::from_utf8(out.stdout).unwrap());
    let profiled_close = minor_version(python) >= 14;
    v.into_iter()
        .map(|(k, mut f)| {
            // From 3.14, close() of a generator suspended outside any `try` ends it without
            // running its frame, unless a profiler is on: then the interpreter throws into the
            // frame to report it, and the profiler counts a call the program never makes.
            if profiled_close && k == "17:abandoned" {
                for n in &mut f[..2] {
                    *n = n.as_u64().map_or(Value::Null, |n| (n - 1).into());
                }
            }
            (
                k,
                (
                    f[0].as_u64().unwrap(),
                    f[1].as_u64(),
                    f[2].as_f64(),
                    f[3].as_f64(),
                ),
            )
        })
        .collect()
}

/// ground_truth.py's `GROUND_TRUTH {json}` line in a program's output.
fn ground_truth_line(stdout: &str) -> BTreeMap<String, Vec<Value>> {
    let json = stdout
        .lines()
        .find_map(|l| l.strip_prefix("GROUND_TRUTH "))
        .expect("ground truth line");
    serde_json::from_str(json).unwrap()
}

/// The interpreter's minor version (14 for 3.14).
fn minor_version(python: &Path) -> u32 {
    let out = Command::new(python)
        .args(["-c", "import sys; print(sys.version_info[1])"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// `truth` (where [`ground_truth`] takes out the call a profiler adds when `main` closes
/// the suspended generator `abandoned`, from 3.14) as an in-process count has it: the
/// counter is such a profiler and counts that call, as cProfile does (docs/PYTHON.md).
fn with_close_throw<V>(
    truth: &BTreeMap<String, V>,
    plus_one: impl Fn(&V) -> V,
) -> BTreeMap<String, V>
where
    V: Clone,
{
    let mut t = truth.clone();
    if let Some(v) = t.get_mut("17:abandoned") {
        *v = plus_one(v);
    }
    t
}

/// tracer's numbers for the functions of `script`, keyed like the ground truth.
fn ours(report: &Value, script: &Path) -> BTreeMap<String, Stats> {
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
        let secs = |k: &str| f[k].as_u64().unwrap() as f64 / 1e9;
        let stats = (
            f["ncalls"].as_u64().unwrap(),
            f["primitive_calls"].as_u64(),
            Some(secs("tottime_ns")),
            Some(secs("cumtime_ns")),
        );
        let prev = out.insert(format!("{}:{name}", f["firstlineno"]), stats);
        assert!(prev.is_none(), "one function per line and name: {f}");
    }
    out
}

fn calls(m: &BTreeMap<String, Stats>) -> BTreeMap<String, u64> {
    m.iter().map(|(k, s)| (k.clone(), s.0)).collect()
}

fn calls_and_primitive(m: &BTreeMap<String, Stats>) -> BTreeMap<String, (u64, Option<u64>)> {
    m.iter().map(|(k, s)| (k.clone(), (s.0, s.1))).collect()
}

fn run_counted(d: &Daemon, python: &Path, script: &Path, args: &[&str]) -> Value {
    run_counted_with(d, python, script, args, &[], &[])
}

/// `how`: more start options (`--python-uprobes-only`).
fn run_counted_with(
    d: &Daemon,
    python: &Path,
    script: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    how: &[&str],
) -> Value {
    let out_file = d.dir.path().join("py.json");
    let out = d
        .ctl()
        .envs(env.iter().copied())
        .args([
            "start",
            "--mode=counting",
            "--python",
            "--format",
            "json",
            "-o",
        ])
        .arg(&out_file)
        .args(how)
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
        tracer_testkit::skip(format_args!("no CPython 3.10-3.15 found"));
        return;
    }
    let d = Daemon::start();
    let wl = script("py_workload.py");
    for py in &pythons {
        let truth = ground_truth(py, "cprofile", &wl, &[]);
        assert!(
            truth
                .get("8:fib")
                .is_some_and(|s| s.0 == 8361 && s.1 == Some(1)),
            "{py:?}: {truth:?}"
        );
        // In-process, and with the probes, which count every other way.
        for how in [&[][..], &["--python-uprobes-only"]] {
            let report = run_counted_with(&d, py, &wl, &[], &[], how);
            check_losses(&report);
            let got = calls_and_primitive(&ours(&report, &wl));
            let mut want = calls_and_primitive(&truth);
            if how.is_empty() && minor_version(py) >= 14 {
                want = with_close_throw(&want, |&(n, p)| (n + 1, p.map(|p| p + 1)));
            }
            assert_eq!(got, want, "{} {how:?}", py.display());
        }
        println!(
            "{}: {} functions agree with cProfile",
            py.display(),
            truth.len()
        );
    }
}

/// CPython's JIT (built into Debian's 3.14/3.15, off unless `PYTHON_JIT=1`) runs hot code
/// from traces that pass no probed handler: a process that turns it on is told, in the
/// report, that its counts are not exact; one that leaves it off is not.
#[test]
fn a_process_running_the_jit_is_told_its_counts_are_not_exact() {
    if !root_or_skip() {
        return;
    }
    let Some(py) = tracer_tests::chroot_interpreters().into_iter().next() else {
        return;
    };
    let d = Daemon::start();
    // Short: the report must say so even when the process ends before tracerd's next look.
    let wl = script("workload.py");
    let truth = calls(&ground_truth(&py, "cprofile", &wl, &["3"]));
    // Counted in-process, the JIT leaves every call to sys.monitoring's events.
    let report = run_counted_with(&d, &py, &wl, &["3"], &[("PYTHON_JIT", "1")], &[]);
    assert_eq!(report["python"]["counted"][0]["way"], "in-process");
    assert_eq!(
        calls(&ours(&report, &wl)),
        truth,
        "in-process, PYTHON_JIT=1"
    );
    for jit in ["1", "0"] {
        let report = run_counted_with(
            &d,
            &py,
            &wl,
            &["3"],
            &[("PYTHON_JIT", jit)],
            &["--python-uprobes-only"],
        );
        let warnings: Vec<&str> = report["python"]["warnings"]
            .as_array()
            .map(|w| w.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let told = warnings
            .iter()
            .any(|w| w.contains("counts are not exact") && w.contains("PYTHON_JIT=1"));
        assert_eq!(told, jit == "1", "PYTHON_JIT={jit}: {warnings:?}");
        let counted = calls(&ours(&report, &wl));
        if jit == "0" {
            assert_eq!(counted, truth);
        } else {
            let missed: u64 = truth
                .iter()
                .map(|(k, n)| n - counted.get(k).copied().unwrap_or(0).min(*n))
                .sum();
            println!("with the JIT on, {missed} of cProfile's calls were not seen by the probes");
        }
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
        let truth = calls(&ground_truth(&py, "hook", &wl, &["threads"]));
        let workers = truth.iter().find(|(k, _)| k.ends_with(":thread_work"));
        assert_eq!(workers.map(|(_, n)| *n), Some(4), "{truth:?}");
        let report = run_counted(&d, &py, &wl, &["threads"]);
        check_losses(&report);
        let got = calls(&ours(&report, &wl));
        let truth = if minor_version(&py) >= 14 {
            with_close_throw(&truth, |n| n + 1)
        } else {
            truth
        };
        assert_eq!(got, truth, "{}", py.display());
    }
}

#[test]
fn tottime_and_cumtime_agree_with_cprofile() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let wl = script("timing.py");
    for py in interpreters() {
        let truth = ground_truth(&py, "cprofile", &wl, &[]);
        let report = run_counted(&d, &py, &wl, &[]);
        check_losses(&report);
        let got = ours(&report, &wl);
        let t = |m: &BTreeMap<String, Stats>, k: &str| {
            let s = m
                .get(k)
                .unwrap_or_else(|| panic!("{}: no {k} in {m:?}", py.display()));
            (s.2.unwrap(), s.3.unwrap())
        };
        // Exact by construction: every nanosecond inside fib is some activation's own time.
        let (tt, ct) = t(&got, "23:fib");
        assert!(
            (tt - ct).abs() < 1e-6,
            "{}: fib tottime {tt} != cumtime {ct}",
            py.display()
        );
        for (k, s) in &got {
            assert!(
                s.3.unwrap() + 1e-6 >= s.2.unwrap(),
                "{}: {k} cumtime < tottime: {s:?}",
                py.display()
            );
        }
        // heavy spins four times as long as light: time goes to the right function. (A loose
        // bound: this is about attribution, not speed, on a shared machine.)
        let ratio = |m: &BTreeMap<String, Stats>| t(m, "11:heavy").1 / t(m, "15:light").1;
        let (ours_r, theirs_r) = (ratio(&got), ratio(&truth));
        assert!(
            (2.0..8.0).contains(&ours_r),
            "{}: heavy/light cumtime {ours_r:.2} (cProfile {theirs_r:.2})",
            py.display()
        );
        // both's cumtime is heavy's plus light's.
        let sum = t(&got, "11:heavy").1 + t(&got, "15:light").1;
        let (_, both) = t(&got, "19:both");
        assert!(
            both >= sum && both < sum * 1.1,
            "{}: both {both} vs heavy+light {sum}",
            py.display()
        );
        // Within both(), spin's own time is nearly all of it, as cProfile says. (Not the whole
        // run: fib's thousands of tiny calls carry each tool's own per-call overhead.)
        let share = |m: &BTreeMap<String, Stats>| t(m, "4:spin").0 / t(m, "19:both").1;
        assert!(
            share(&got) > 0.9,
            "{}: spin share {} (cProfile {})",
            py.display(),
            share(&got),
            share(&truth)
        );
        println!(
            "{}: heavy/light {ours_r:.2} (cProfile {theirs_r:.2}), spin share {:.2} ({:.2})",
            py.display(),
            share(&got),
            share(&truth)
        );
    }
}

/// Both ways: in-process (the default) and with the probes, which find the threads already
/// inside the eval loop.
#[test]
fn attaches_to_a_running_interpreter() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let ways: [&[&str]; 2] = [&[], &["--python-uprobes-only"]];
    for (py, way) in interpreters()
        .into_iter()
        .flat_map(|py| ways.map(|w| (py.clone(), w)))
    {
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
        let pid = child.pid().to_string();
        let mut args = vec!["start", "--mode=counting", "--python", "--pid", &pid];
        args.extend_from_slice(way);
        let id = d.ok(&args).trim().to_owned();
        std::fs::write(&go, b"").unwrap();
        wait_until(20, "the target to exit", || {
            d.ok(&["status", &id]).contains("target exited")
        });
        let report: Value = d.report_json(&id);
        check_losses(&report);
        let counts = calls(&ours(&report, &file));
        // fib(15) = 1973 calls, all after attach; `wait` was entered before and is never re-entered.
        assert_eq!(
            counts.get("2:fib"),
            Some(&1973),
            "{} {way:?}: {counts:?}",
            py.display()
        );
        assert_eq!(
            counts.get("4:wait"),
            None,
            "{} {way:?}: {counts:?}",
            py.display()
        );
    }
}

#[test]
fn system_wide_sessions_pick_up_new_python_processes() {
    if !root_or_skip() {
        return;
    }
    let mut pythons = interpreters();
    // One interpreter tracerd knows at start, and one in a chroot it finds as it starts.
    let chrooted = tracer_tests::chroot_interpreters();
    pythons.retain(|p| !chrooted.contains(p));
    let pythons: Vec<_> = pythons
        .into_iter()
        .last()
        .into_iter()
        .chain(chrooted.into_iter().next())
        .collect();
    if pythons.is_empty() {
        tracer_testkit::skip(format_args!("no CPython 3.10-3.15 found"));
        return;
    }
    for py in pythons {
        system_wide_session_counts(&py);
    }
}

fn system_wide_session_counts(py: &Path) {
    let d = Daemon::start();
    let id = start_system_wide(&d);
    let wl = script("py_workload.py");
    let out = Command::new(py).arg(&wl).output().unwrap();
    assert!(out.status.success());
    stop_and_compare(&d, &id, py, &wl);
}

/// A session counting Python calls in every process; its id.
fn start_system_wide(d: &Daemon) -> String {
    d.ok(&["start", "--mode=counting", "--python", "--all"])
        .trim()
        .to_owned()
}

/// Stops session `id`, whose counts of `wl`'s functions must equal cProfile's under `py`.
fn stop_and_compare(d: &Daemon, id: &str, py: &Path, wl: &Path) {
    d.ok(&["stop", id]);
    let report: Value = d.report_json(id);
    let truth = ground_truth(py, "cprofile", wl, &[]);
    assert_eq!(
        calls_and_primitive(&ours(&report, wl)),
        calls_and_primitive(&truth),
        "{}",
        py.display()
    );
}

/// A host CPython whose executable holds its eval loop (no libpython): a copy of it is a
/// new interpreter binary. None, saying so, where there is none.
fn static_interpreter() -> Option<PathBuf> {
    let chrooted = tracer_tests::chroot_interpreters();
    let found = interpreters()
        .into_iter()
        .filter(|p| !chrooted.contains(p))
        .find(|p| {
            let ldd = Command::new("ldd").arg(p).output().unwrap();
            !String::from_utf8_lossy(&ldd.stdout).contains("libpython")
        });
    if found.is_none() {
        tracer_testkit::skip(format_args!(
            "no CPython here holds its eval loop in its executable"
        ));
    }
    found
}

/// A copy of [`static_interpreter`] in a directory of its own, under its own name (a session
/// on every process looks at execs of `python…` programs), with `appended` bytes added: with
/// none, another file of a build tracerd inspected at start; with some, a build of its own.
/// The directory, the original and the copy; None where there is none (or not as root).
fn interpreter_copy(appended: usize) -> Option<(tempfile::TempDir, PathBuf, PathBuf)> {
    if !root_or_skip() {
        return None;
    }
    let py = static_interpreter()?;
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join(py.file_name().unwrap());
    let mut bytes = std::fs::read(&py).unwrap();
    bytes.resize(bytes.len() + appended, 0);
    std::fs::write(&copy, bytes).unwrap();
    std::fs::set_permissions(&copy, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    Some((dir, py, copy))
}

/// A plain copy of an interpreter tracerd inspected at start (another file of the same
/// build, as in another container's layer) is probed from what that inspection found, under
/// its own path, while it is held at its exec: every call counted as cProfile counts it.
#[test]
fn a_copy_of_a_known_interpreter_is_counted_from_its_first_call() {
    let Some((_dir, py, copy)) = interpreter_copy(0) else {
        return;
    };
    let d = Daemon::start();
    let id = start_system_wide(&d);
    let wl = script("py_workload.py");
    let out = Command::new(&copy).arg(&wl).output().unwrap();
    assert!(out.status.success());
    stop_and_compare(&d, &id, &py, &wl);
}

/// An interpreter binary no session has met (a copy, altered, of one that holds its eval
/// loop itself), exec'd under a session on every process: it is inspected and probed off the
/// daemon's task while the process is held at its exec. Lists sent meanwhile are answered
/// while it is still held (the old daemon answered none: the hold lasted as long as the
/// probing, and so did every request), and every call is counted as cProfile counts it.
#[test]
fn an_interpreter_met_at_exec_is_probed_while_requests_are_answered() {
    // Bytes appended: a build tracerd has not inspected.
    let Some((_dir, py, copy)) = interpreter_copy(16) else {
        return;
    };
    let d = Daemon::start();
    let id = start_system_wide(&d);
    let wl = script("py_workload.py");
    let mut child = ChildGuard::spawn(
        Command::new(&copy)
            .arg(&wl)
            .stdout(std::process::Stdio::null()),
    );
    let pid = child.pid();
    let stopped = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| s.rsplit(") ").next().is_some_and(|f| f.starts_with('T')))
    };
    let mut answered_held = 0;
    while child.0.try_wait().unwrap().is_none() {
        let before = stopped();
        d.ok(&["list"]);
        if before && stopped() {
            answered_held += 1;
        }
    }
    assert!(child.0.wait().unwrap().success());
    println!("{answered_held} lists answered while the new interpreter was held at its exec");
    assert!(
        answered_held >= 3,
        "{answered_held} lists answered while {} was held at its exec",
        copy.display()
    );
    stop_and_compare(&d, &id, &py, &wl);
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

/// {"line:name": {"file:line:name": [ncalls, primitive calls]}}: each function's callers.
type Callers = BTreeMap<String, BTreeMap<String, Vec<u64>>>;

fn python_json(py: &Path, code: &str, args: &[&Path]) -> Value {
    let out = Command::new(py)
        .args(["-c", code])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    serde_json::from_str(text.lines().last().unwrap_or_default()).unwrap()
}

#[test]
fn pstats_callers_agree_with_cprofile() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let wl = script("py_workload.py");
    for py in interpreters() {
        let out = Command::new(&py)
            .arg(script("ground_truth.py"))
            .args(["cprofile-callers", wl.to_str().unwrap()])
            .output()
            .unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let truth: Callers = serde_json::from_str(
            text.lines()
                .find_map(|l| l.strip_prefix("GROUND_TRUTH "))
                .unwrap(),
        )
        .unwrap();
        let report = run_counted(&d, &py, &wl, &[]);
        let id = report["session"]["id"].as_str().unwrap();
        let prof = d.dir.path().join("callers.prof");
        d.ok(&[
            "report",
            id,
            "--format",
            "pstats",
            "-o",
            prof.to_str().unwrap(),
        ]);
        let ours: Callers =
            serde_json::from_value(tracer_tests::pstats_callers(&py, &prof, &wl)).unwrap();
        // tracer sees Python frames only: compare the functions that cProfile says only
        // Python functions called (not sorted(), sum(), next(), a C event loop…).
        let mut compared = 0;
        for (f, callers) in &truth {
            if callers.keys().any(|c| c.starts_with("~:")) {
                continue;
            }
            compared += 1;
            assert_eq!(
                ours.get(f),
                Some(callers),
                "{}: callers of {f}",
                py.display()
            );
        }
        assert!(
            compared >= 10,
            "{}: only {compared} functions compared",
            py.display()
        );
    }
}

#[test]
fn pstats_files_open_in_pstats_and_tables_sort() {
    if !root_or_skip() {
        return;
    }
    let Some(py) = interpreters().into_iter().next() else {
        tracer_testkit::skip(format_args!("no CPython 3.10-3.15 found"));
        return;
    };
    let d = Daemon::start();
    let wl = script("py_workload.py");
    let report = run_counted(&d, &py, &wl, &[]);
    let id = report["session"]["id"].as_str().unwrap();
    let prof = d.dir.path().join("out.prof");
    d.ok(&[
        "report",
        id,
        "--format",
        "pstats",
        "-o",
        prof.to_str().unwrap(),
    ]);
    // Python's own pstats reads the file; its calls are cProfile's.
    let code = "import pstats, sys, json; s = pstats.Stats(sys.argv[1]).stats; \
                print(json.dumps({f'{k[1]}:{k[2]}': [v[1], v[0]] for k, v in s.items() if k[0] == sys.argv[2]}))";
    let out = Command::new(&py)
        .args(["-c", code])
        .arg(&prof)
        .arg(&wl)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let from_pstats: BTreeMap<String, (u64, Option<u64>)> =
        serde_json::from_slice::<BTreeMap<String, Vec<u64>>>(&out.stdout)
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k, (v[0], Some(v[1]))))
            .collect();
    assert_eq!(
        from_pstats,
        calls_and_primitive(&ground_truth(&py, "cprofile", &wl, &[]))
    );
    // Tables sort like `python -m cProfile -s KEY`; an unknown key is refused.
    let by_calls = d.ok(&["report", id, "--sort", "ncalls"]);
    let first = by_calls
        .lines()
        .find(|l| l.contains("py_workload.py"))
        .unwrap();
    assert!(first.contains("(fib)"), "{first}");
    let bad = d.run(&["report", id, "--sort", "bogus"]);
    assert!(tracer_tests::one_line_error(&bad).contains("unknown sort key 'bogus'"));
    let sleeper = ChildGuard::spawn(Command::new("sleep").arg("0.2"));
    let plain = d.ok(&[
        "start",
        "--mode=counting",
        "--events",
        "task-clock",
        "--pid",
        &sleeper.pid().to_string(),
        "--wait",
        "--format",
        "json",
    ]);
    let pid_id = serde_json::from_str::<Value>(&plain).unwrap()["session"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let no_python = d.run(&["report", &pid_id, "--format", "pstats"]);
    assert!(tracer_tests::one_line_error(&no_python).contains("start the session with --python"));
}

#[test]
fn snakeviz_draws_the_call_graph() {
    if !root_or_skip() {
        return;
    }
    // `cargo xtask test` installs snakeviz into the test venv and names its python here.
    let Some(viz_py) = std::env::var_os("TRACER_TEST_PYTHON") else {
        panic!("TRACER_TEST_PYTHON is not set: run the suite with `cargo xtask test`");
    };
    let py = interpreters()
        .into_iter()
        .next()
        .expect("a CPython 3.10-3.15");
    let d = Daemon::start();
    let wl = script("py_workload.py");
    let prof = d.dir.path().join("viz.prof");
    let out = d
        .ctl()
        .args([
            "start",
            "--mode=counting",
            "--python",
            "--format",
            "pstats",
            "-o",
        ])
        .arg(&prof)
        .arg("--")
        .arg(&py)
        .arg(&wl)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = python_json(
        Path::new(&viz_py),
        &std::fs::read_to_string(script("snakeviz_check.py")).unwrap(),
        &[&prof, &wl],
    );
    assert!(v["rows"].as_u64().unwrap() > 20, "{v}");
    assert_eq!(v["page_names_fib"], true, "snakeviz's page: {v}");
    let children = |name: &str| -> Vec<String> {
        let (_, c) = v["children"]
            .as_object()
            .unwrap()
            .iter()
            .find(|(k, _)| k.ends_with(&format!("({name})")))
            .unwrap_or_else(|| panic!("{name} missing from snakeviz's graph: {v}"));
        c.as_array()
            .unwrap()
            .iter()
            .map(|x| {
                x.as_str()
                    .unwrap()
                    .split('(')
                    .nth(1)
                    .unwrap()
                    .trim_end_matches(')')
                    .to_owned()
            })
            .collect()
    };
    assert_eq!(children("fib"), ["fib"]);
    for callee in ["fib", "catch", "deep", "callbacks"] {
        assert!(
            children("main").iter().any(|c| c == callee),
            "main → {callee}: {v}"
        );
    }
    for callee in ["double", "key_of", "<lambda>"] {
        assert!(
            children("callbacks").iter().any(|c| c == callee),
            "callbacks → {callee}: {v}"
        );
    }
}

/// `PID CALLS` lines of fork_workload.py: each process's own count of `f` (its profile hook).
fn hook_counts(stdout: &str) -> BTreeMap<u64, u64> {
    stdout
        .lines()
        .filter_map(|l| {
            let (pid, n) = l.split_once(' ')?;
            Some((pid.parse().ok()?, n.trim().parse().ok()?))
        })
        .collect()
}

/// tracer's calls of `f` of the script `name`, per process.
fn f_calls_per_pid(report: &Value, name: &str) -> BTreeMap<u64, u64> {
    let script = script(name);
    let mut out = BTreeMap::new();
    for f in report["python"]["functions"].as_array().unwrap() {
        if f["qualname"] == "f" && Path::new(f["filename"].as_str().unwrap()) == script {
            *out.entry(f["pid"].as_u64().unwrap()).or_default() += f["ncalls"].as_u64().unwrap();
        }
    }
    out
}

/// Forked workers inherit the forking thread's interpreter state and never enter the eval
/// loop anew: every call in every child, grandchild and great-grandchild, and in a thread
/// each of them starts, is counted, equal to each process's own profile hook, launched, by pid and system-wide, counting and tracing.
#[test]
fn forked_children_are_counted_exactly() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let wl = script("fork_workload.py");
    let wl = wl.to_str().unwrap();
    let (children, calls, depth) = ("8", "400", "3");
    for py in interpreters() {
        let py_s = py.to_str().unwrap();
        for mode in ["counting", "tracing"] {
            let out = tempfile::NamedTempFile::new().unwrap();
            let o = out.path().to_str().unwrap();
            let stdout = d.ok(&[
                "start",
                &format!("--mode={mode}"),
                "--python",
                "--format",
                "json",
                "-o",
                o,
                "--",
                py_s,
                wl,
                children,
                calls,
                depth,
            ]);
            let report: Value =
                serde_json::from_str(&std::fs::read_to_string(out.path()).unwrap()).unwrap();
            let truth = hook_counts(&stdout);
            assert_eq!(truth.len(), 24, "{}: {stdout}", py.display());
            assert_eq!(
                f_calls_per_pid(&report, "fork_workload.py"),
                truth,
                "{} {mode}: losses {}",
                py.display(),
                report["losses"]
            );
        }
        // By pid: attached while the parent waits, before it forks.
        let mut parent = ChildGuard::spawn(
            Command::new(&py)
                .args([wl, children, calls, depth, "1"])
                .stdout(std::process::Stdio::piped()),
        );
        let pid = parent.pid().to_string();
        let mut out = std::io::BufReader::new(parent.0.stdout.take().unwrap());
        let mut ready = String::new();
        std::io::BufRead::read_line(&mut out, &mut ready).unwrap();
        assert_eq!(ready, "ready\n", "{}", py.display());
        let json = d.ok(&[
            "start",
            "--mode=counting",
            "--python",
            "--pid",
            &pid,
            "--wait",
            "--format",
            "json",
        ]);
        let mut stdout = String::new();
        std::io::Read::read_to_string(&mut out, &mut stdout).unwrap();
        let report: Value = serde_json::from_str(&json).unwrap();
        assert_eq!(
            f_calls_per_pid(&report, "fork_workload.py"),
            hook_counts(&stdout),
            "{} by pid: losses {}",
            py.display(),
            report["losses"]
        );
    }
    // System-wide: one session follows no pid, and sees every interpreter's workers.
    let id = d
        .ok(&[
            "start",
            "--mode=counting",
            "--python",
            "--all",
            "--duration",
            "1h",
        ])
        .trim()
        .to_owned();
    let mut truth = BTreeMap::new();
    for py in interpreters() {
        let out = Command::new(&py)
            .args([wl, children, calls, depth])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", py.display());
        truth.extend(hook_counts(&String::from_utf8(out.stdout).unwrap()));
    }
    d.ok(&["stop", &id]);
    let report: Value = d.report_json(&id);
    assert_eq!(
        f_calls_per_pid(&report, "fork_workload.py"),
        truth,
        "--all: losses {}",
        report["losses"]
    );
}

/// The traced program profiles itself (cProfile, then a sys.setprofile hook: sys.monitoring
/// on 3.12+, which re-instruments every code object when a tool comes or goes, and runs each
/// stale RESUME twice; before 3.12 a handover from tracer's profile function to the probes):
/// tracer's counts equal the profilers' in the same process.
#[test]
fn counts_hold_while_the_program_profiles_itself() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let wl = script("py_workload.py");
    let ground_truth = script("ground_truth.py");
    for py in interpreters() {
        for mode in ["cprofile", "hook"] {
            let out = tempfile::NamedTempFile::new().unwrap();
            let stdout = d.ok(&[
                "start",
                "--mode=counting",
                "--python",
                "--format",
                "json",
                "-o",
                out.path().to_str().unwrap(),
                "--",
                py.to_str().unwrap(),
                ground_truth.to_str().unwrap(),
                mode,
                wl.to_str().unwrap(),
            ]);
            let truth: BTreeMap<String, u64> = ground_truth_line(&stdout)
                .into_iter()
                .map(|(k, f)| (k, f[0].as_u64().unwrap()))
                .collect();
            let report: Value =
                serde_json::from_str(&std::fs::read_to_string(out.path()).unwrap()).unwrap();
            assert!(truth.len() >= 10, "{}: {truth:?}", py.display());
            assert_eq!(
                calls(&ours(&report, &wl)),
                truth,
                "{} under {mode}",
                py.display()
            );
            // Before 3.12 the program's profile function takes the place of tracer's, which
            // hands the process over to the probes.
            let way = if minor_version(&py) < 12 {
                "in-process, then uprobes"
            } else {
                "in-process"
            };
            let counted = &report["python"]["counted"][0];
            assert_eq!(counted["way"], way, "{}: {counted}", py.display());
        }
    }
}

/// multiprocessing Pools and ProcessPoolExecutors with every start method (fork: forked
/// workers; forkserver: forked from a server process; spawn: new interpreters): each
/// worker's calls equal its own profile hook's.
#[test]
fn multiprocessing_workers_are_counted_exactly() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let wl = script("mp_workload.py");
    for py in interpreters() {
        for method in ["fork", "forkserver", "spawn"] {
            let out = tempfile::NamedTempFile::new().unwrap();
            let stdout = d.ok(&[
                "start",
                "--mode=counting",
                "--python",
                "--format",
                "json",
                "-o",
                out.path().to_str().unwrap(),
                "--",
                py.to_str().unwrap(),
                wl.to_str().unwrap(),
                method,
                "6",
                "300",
            ]);
            let report: Value =
                serde_json::from_str(&std::fs::read_to_string(out.path()).unwrap()).unwrap();
            let truth = hook_counts(&stdout);
            assert_eq!(truth.values().sum::<u64>(), 3600, "{stdout}");
            assert_eq!(
                f_calls_per_pid(&report, "mp_workload.py"),
                truth,
                "{} {method}: losses {}",
                py.display(),
                report["losses"]
            );
        }
    }
}

/// PyTorch's DataLoader workers on CPU tensors (torch from PyPI, installed by `cargo xtask
/// test`), forked and spawned: each worker's calls equal its own profile hook.
#[test]
fn dataloader_workers_are_counted_exactly() {
    if !root_or_skip() {
        return;
    }
    let python = std::env::var("TRACER_TEST_TORCH_PYTHON").expect(
        "TRACER_TEST_TORCH_PYTHON (a Python with torch) is not set: run the suite with `cargo xtask test`",
    );
    let d = Daemon::start();
    let wl = script("dataloader_workload.py");
    for method in ["fork", "spawn"] {
        let out = tempfile::NamedTempFile::new().unwrap();
        let stdout = d.ok(&[
            "start",
            "--mode=counting",
            "--python",
            "--format",
            "json",
            "-o",
            out.path().to_str().unwrap(),
            "--",
            &python,
            wl.to_str().unwrap(),
            "40",
            "300",
            method,
        ]);
        let report: Value =
            serde_json::from_str(&std::fs::read_to_string(out.path()).unwrap()).unwrap();
        let truth = hook_counts(&stdout);
        assert_eq!(truth.len(), 4, "{method}: {stdout}");
        assert_eq!(truth.values().sum::<u64>(), 12_000, "{method}: {stdout}");
        assert_eq!(
            f_calls_per_pid(&report, "dataloader_workload.py"),
            truth,
            "{method}: losses {}",
            report["losses"]
        );
    }
}

/// At a session's end its functions are named and its report is stored: for 150,000
/// functions that takes about a second here, and other requests do not wait for it.
#[test]
fn requests_are_answered_while_an_ended_session_is_named_and_stored() {
    if !root_or_skip() {
        return;
    }
    const FUNCTIONS: usize = 150_000;
    let d = Daemon::start();
    let python = ChildGuard::spawn_ready(
        Command::new(tracer_tests::python())
            .arg(script("many_functions.py"))
            .arg(FUNCTIONS.to_string()),
    );
    let pid = python.pid().to_string();
    let id = d.ok(&[
        "start",
        "--mode=counting",
        "--pid",
        &pid,
        "--python",
        "--python-uprobes-only",
    ]);
    let id = id.trim();
    // Several passes over every function.
    std::thread::sleep(std::time::Duration::from_secs(3));
    let stopped = std::time::Instant::now();
    let (answered, _) = d.lists_answered_during(&["stop", id]);
    println!(
        "{answered} lists answered in the {:?} the session took to end",
        stopped.elapsed()
    );
    assert!(
        answered > 2,
        "{answered} requests answered while the ended session was named and stored"
    );
    let report: Value = d.report_json(id);
    let counted = report["python"]["functions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["filename"] == "generated.py" && f["ncalls"].as_u64() > Some(0))
        .count();
    assert_eq!(counted, FUNCTIONS, "generated functions counted and named");
}
