//! Sampling mode, end to end: stacks of real Python processes, with Python and native frames
//! together, checked against py-spy's samples of the same workloads and parsed back by
//! `go tool pprof`.

use std::{collections::BTreeMap, path::Path, process::Command};

use tracer_tests::{
    interpreters, one_line_error, parse_folded, py_spy_record, root_or_skip, script, ChildGuard,
    Daemon,
};

/// Folded stacks: (frames root first, count).
type Folded = Vec<(Vec<String>, u64)>;

/// A Python frame's function name: `qualname (file:line)` → `qualname`.
fn function(frame: &str) -> &str {
    frame.split(" (").next().unwrap_or(frame)
}

/// Samples whose stack holds `name` (once per stack, however deep it recurses).
fn samples_in(f: &Folded, name: &str) -> u64 {
    f.iter()
        .filter(|(s, _)| s.iter().any(|fr| function(fr) == name))
        .map(|(_, n)| n)
        .sum()
}

/// Each function's share of the samples taken under `main`, in percent.
fn shares(f: &Folded, names: &[&str]) -> BTreeMap<String, f64> {
    let main = samples_in(f, "main").max(1) as f64;
    names
        .iter()
        .map(|n| (n.to_string(), 100.0 * samples_in(f, n) as f64 / main))
        .collect()
}

/// The report, in `format`, of a sampling session at `hz` of `command` run under tracer.
fn sampled(d: &Daemon, hz: &str, format: &str, command: &[&str]) -> String {
    let out = tempfile::NamedTempFile::new().unwrap();
    let mut args = vec![
        "start",
        "--mode=sampling",
        "--frequency",
        hz,
        "--format",
        format,
        "-o",
        out.path().to_str().unwrap(),
        "--",
    ];
    args.extend(command);
    d.ok(&args);
    std::fs::read_to_string(out.path()).unwrap()
}

/// tracer's folded stacks for `python script args` run under a sampling session.
fn tracer_folded(d: &Daemon, python: &Path, script: &Path, args: &[&str], hz: &str) -> Folded {
    let mut command = vec![python.to_str().unwrap(), script.to_str().unwrap()];
    command.extend(args);
    parse_folded(&sampled(d, hz, "folded", &command))
}

/// tracer's JSON report of a sampling session of `command`.
fn tracer_json(d: &Daemon, hz: &str, command: &[&str]) -> serde_json::Value {
    serde_json::from_str(&sampled(d, hz, "json", command)).unwrap()
}

#[test]
fn shares_agree_with_py_spy_on_every_interpreter() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let workload = script("sample_workload.py");
    let names = ["heavy", "medium", "light", "spin"];
    for python in interpreters() {
        let ours = tracer_folded(&d, &python, &workload, &["3"], "499");
        let (theirs, _) = py_spy_record(
            "499",
            &[],
            &[python.as_os_str(), workload.as_os_str(), "3".as_ref()],
        );
        let (a, b) = (shares(&ours, &names), shares(&theirs, &names));
        println!(
            "{}: tracer {a:.1?}\n{}  py-spy {b:.1?}",
            python.display(),
            " ".repeat(python.as_os_str().len())
        );
        assert!(
            samples_in(&ours, "main") > 500,
            "{}: too few samples: {ours:?}",
            python.display()
        );
        for n in names {
            assert!(
                (a[n] - b[n]).abs() <= 6.0,
                "{}: {n} has {:.1}% of tracer's samples under main, {:.1}% of py-spy's",
                python.display(),
                a[n],
                b[n]
            );
        }
        // Python frames carry the line running: spin's samples are on its loop lines.
        let spin_lines: u64 = ours
            .iter()
            .filter_map(|(s, n)| {
                let leaf_py = s.iter().rev().find(|f| f.starts_with("spin ("))?;
                (leaf_py.ends_with("sample_workload.py:12)")
                    || leaf_py.ends_with("sample_workload.py:13)"))
                .then_some(*n)
            })
            .sum();
        let spin = samples_in(&ours, "spin");
        assert!(
            spin_lines * 10 >= spin * 9,
            "{}: only {spin_lines} of spin's {spin} samples are on its loop lines 12-13",
            python.display()
        );
        // Python frames replace the eval loop's: main sits under <module>, not under a
        // bare _PyEval_EvalFrameDefault.
        let nested = ours
            .iter()
            .filter(|(s, _)| {
                let i = s.iter().position(|f| function(f) == "main");
                i.is_some_and(|i| s[..i].iter().any(|f| function(f) == "<module>"))
            })
            .map(|(_, n)| n)
            .sum::<u64>();
        assert!(
            nested * 10 >= samples_in(&ours, "main") * 9,
            "{}: main not under <module>",
            python.display()
        );
        // ... and they sit where the eval loop ran, above the native frames that called it
        // (Py_RunMain, exported by every build), stripped binaries included: Debian's 3.14
        // and 3.15 keep the loop's body outside the exported symbol.
        let misplaced: Vec<_> = ours
            .iter()
            .filter(|(s, _)| {
                let py = s.iter().position(|f| function(f) == "main");
                let run = s.iter().position(|f| f == "Py_RunMain");
                matches!((py, run), (Some(p), Some(r)) if p < r)
            })
            .collect();
        assert!(
            misplaced.is_empty(),
            "{}: Python frames below Py_RunMain: {:?}",
            python.display(),
            misplaced.first()
        );
    }
}

/// Samples whose stack holds the Python frame of `name` in `file`.
fn python_samples_in(f: &Folded, name: &str, file: &str) -> u64 {
    let prefix = format!("{name} (");
    f.iter()
        .filter(|(s, _)| {
            s.iter()
                .any(|fr| fr.starts_with(&prefix) && fr.contains(&format!("{file}:")))
        })
        .map(|(_, n)| n)
        .sum()
}

/// In a pid namespace of its own (every container's), a thread's tid is not the host's,
/// yet its Python frames are read: attached by pid, on every interpreter.
#[test]
fn python_in_its_own_pid_namespace() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let workload = script("sample_workload.py");
    let mut pythons = interpreters();
    for p in tracer_tests::chroot_interpreters() {
        if !pythons.contains(&p) {
            pythons.push(p);
        }
    }
    for python in pythons {
        let (_guard, pid) = tracer_tests::spawn_python_in_pid_namespace(
            &python,
            &[workload.as_os_str(), "30".as_ref()],
        );
        // Past start-up: main's loop runs.
        std::thread::sleep(std::time::Duration::from_millis(500));
        let folded = parse_folded(&d.ok(&[
            "start",
            "--mode=sampling",
            "--frequency",
            "199",
            "--pid",
            &pid.to_string(),
            "--duration",
            "2s",
            "--wait",
            "--format",
            "folded",
        ]));
        let total: u64 = folded.iter().map(|(_, n)| n).sum();
        let file = "sample_workload.py";
        let main = python_samples_in(&folded, "main", file);
        println!(
            "{}: {main} of {total} samples under the Python frame main",
            python.display()
        );
        assert!(total >= 50, "{}: {folded:?}", python.display());
        assert!(
            main * 10 >= total * 9,
            "{}: only {main} of {total} samples under main: {folded:?}",
            python.display()
        );
        for f in ["heavy", "medium", "spin"] {
            assert!(
                python_samples_in(&folded, f, file) > 0,
                "{}: no samples in {f}: {folded:?}",
                python.display()
            );
        }
    }
}

#[test]
fn native_frames_sit_under_the_python_caller() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    for python in interpreters() {
        let ours = tracer_folded(&d, &python, &script("sample_native.py"), &["2"], "299");
        let total = samples_in(&ours, "compress_loop");
        // zlib's deflate (libz, or zlib linked into the interpreter) below compress_loop.
        let under: u64 = ours
            .iter()
            .filter(|(s, _)| {
                s.iter()
                    .position(|f| function(f) == "compress_loop")
                    .is_some_and(|i| s[i + 1..].iter().any(|f| f.starts_with("deflate")))
            })
            .map(|(_, n)| n)
            .sum();
        println!(
            "{}: {under} of {total} compress_loop samples are in deflate",
            python.display()
        );
        assert!(
            total > 200,
            "{}: too few samples: {ours:?}",
            python.display()
        );
        assert!(
            under * 10 >= total * 7,
            "{}: only {under} of {total} samples under compress_loop reach deflate",
            python.display()
        );
    }
}

/// Naming a profile reads the symbol tables and DWARF of every binary sampled (here tracerd's
/// own, ~100 MB of debug info, sampled while it unwinds): seconds, spent off the manager.
/// Meanwhile the session is shown running, its report is not ready, and other requests are
/// answered; the stop is answered with the final state.
#[test]
fn requests_are_answered_while_a_profile_is_named() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let mut busy = ChildGuard(
        Command::new(tracer_tests::python())
            .args([
                "-c",
                "import time\nend = time.time() + 6\nwhile time.time() < end: pass",
            ])
            .spawn()
            .unwrap(),
    );
    let id = d.ok(&["start", "--mode=sampling", "--all", "--frequency", "999"]);
    let id = id.trim();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let mut stop = d
        .ctl()
        .args(["stop", id])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (mut ending, mut listed_running, mut deleted) = (0, 0, false);
    while stop.try_wait().unwrap().is_none() {
        let out = d.run(&["delete", id]);
        if out.status.success() {
            // Ended already; the stop's client is on its way out.
            deleted = true;
            break;
        }
        if String::from_utf8_lossy(&out.stderr).contains("is ending: its profile is being named") {
            ending += 1;
            let list = d.ok(&["list"]);
            if list
                .lines()
                .any(|l| l.starts_with(id) && l.contains("running"))
            {
                listed_running += 1;
            }
        }
    }
    let stopped = stop.wait_with_output().unwrap();
    assert!(stopped.status.success(), "{stopped:?}");
    let info = String::from_utf8_lossy(&stopped.stdout);
    assert!(
        info.contains("finished"),
        "the stop answers with the final state: {info}"
    );
    println!("{ending} requests answered while the profile was named");
    assert!(
        ending > 0,
        "the stop was answered before anything else: naming held the manager"
    );
    assert!(listed_running > 0, "listed as running while ending");
    if !deleted {
        let report: serde_json::Value = d.report_json(id);
        let frames = report["profile"]["stacks"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|s| s["frames"].as_array().unwrap());
        let mut names = frames.filter_map(|f| f["name"].as_str());
        assert!(
            names.any(|n| n.contains("tracer_daemon")),
            "tracerd's own frames named"
        );
    }
    busy.0.kill().unwrap();
}

/// Stacks deeper than the 16 KiB a stack copy once held (importing PyTorch runs deeper):
/// Python frames nested through C, 24-47 KiB of native stack, unwind to the root whole.
#[test]
fn deep_native_stacks_unwind_to_the_root() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    for python in interpreters() {
        let ours = tracer_folded(
            &d,
            &python,
            &script("deep_native.py"),
            &["40", "0.5"],
            "299",
        );
        let spinning: Vec<&(Vec<String>, u64)> = ours
            .iter()
            .filter(|(s, _)| s.iter().any(|f| function(f) == "spin"))
            .collect();
        let total: u64 = spinning.iter().map(|(_, n)| n).sum();
        // Whole: from the process's entry point down through all 41 levels of `nest`.
        let whole: u64 = spinning
            .iter()
            .filter(|(s, _)| {
                s.get(1).is_some_and(|f| f == "_start")
                    && s.iter().filter(|f| function(f) == "nest").count() == 41
            })
            .map(|(_, n)| n)
            .sum();
        println!(
            "{}: {whole} of {total} spin samples whole",
            python.display()
        );
        assert!(
            total >= 50,
            "{}: too few samples: {ours:?}",
            python.display()
        );
        assert!(
            whole * 10 >= total * 9,
            "{}: {whole} of {total} spin samples whole: {:?}",
            python.display(),
            spinning
                .iter()
                .find(|(s, _)| s.get(1).is_none_or(|f| f != "_start"))
        );
    }
}

#[test]
fn every_busy_thread_is_sampled() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let python = tracer_tests::python();
    let report = tracer_json(
        &d,
        "99",
        &[
            python.to_str().unwrap(),
            script("sample_threads.py").to_str().unwrap(),
            "2",
        ],
    );
    let stacks = report["profile"]["stacks"].as_array().unwrap();
    for worker in ["worker_a", "worker_b", "worker_c"] {
        let tids: std::collections::BTreeSet<u64> = stacks
            .iter()
            .filter(|s| {
                s["frames"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|f| f["name"] == worker && f["kind"] == "python")
            })
            .map(|s| s["tid"].as_u64().unwrap())
            .collect();
        let n: u64 = stacks
            .iter()
            .filter(|s| {
                s["frames"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|f| f["name"] == worker)
            })
            .map(|s| s["count"].as_u64().unwrap())
            .sum();
        assert_eq!(tids.len(), 1, "{worker} runs on one thread: {tids:?}");
        assert!(n >= 20, "{worker}: {n} samples");
    }
}

#[test]
fn all_processes_get_root_frames_and_pprof_parses() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let python = tracer_tests::python();
    let target = ChildGuard::spawn(
        Command::new(&python)
            .arg(script("sample_workload.py"))
            .arg("30"),
    );
    let pid = target.pid();
    d.ok(&[
        "start",
        "--mode=sampling",
        "--all",
        "--duration",
        "2s",
        "--wait",
        "--format",
        "json",
        "-o",
        "/dev/null",
    ]);
    let id = d.newest_session("");
    let folded = parse_folded(&d.ok(&["report", &id, "--format", "folded"]));
    let root = format!("(pid {pid})");
    let ours: u64 = folded
        .iter()
        .filter(|(s, _)| s[0].ends_with(&root))
        .map(|(_, n)| n)
        .sum();
    assert!(
        ours >= 50,
        "pid {pid} has {ours} samples in an --all session"
    );
    // Filters keep one process.
    let only = parse_folded(&d.ok(&[
        "report",
        &id,
        "--format",
        "folded",
        "--filter-pid",
        &pid.to_string(),
    ]));
    assert!(only.iter().all(|(s, _)| s[0].ends_with(&root)) && !only.is_empty());

    let Ok(go) = Command::new("go").arg("version").output() else {
        tracer_testkit::skip(format_args!(
            "the pprof half: go is not installed (cargo xtask test installs it)"
        ));
        return;
    };
    assert!(go.status.success());
    let file = tempfile::NamedTempFile::new().unwrap();
    d.ok(&[
        "report",
        &id,
        "--format",
        "pprof",
        "-o",
        file.path().to_str().unwrap(),
    ]);
    let raw = Command::new("go")
        .args(["tool", "pprof", "-raw"])
        .arg(file.path())
        .output()
        .unwrap();
    assert!(
        raw.status.success(),
        "go tool pprof -raw: {}",
        String::from_utf8_lossy(&raw.stderr)
    );
    let top = Command::new("go")
        .args([
            "tool",
            "pprof",
            "-top",
            "-nodecount=200",
            "-tagfocus",
            &format!("pid={pid}"),
        ])
        .arg(file.path())
        .output()
        .unwrap();
    let top = String::from_utf8_lossy(&top.stdout);
    for f in ["heavy", "spin", "main"] {
        assert!(
            top.lines().any(|l| l.split_whitespace().last() == Some(f)),
            "{f} missing from pprof -top:\n{top}"
        );
    }
}

#[test]
fn attaches_to_a_running_process_and_refuses_bad_requests() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let python = tracer_tests::python();
    let target = ChildGuard::spawn(
        Command::new(&python)
            .arg(script("sample_workload.py"))
            .arg("30"),
    );
    let pid = target.pid().to_string();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let folded = parse_folded(&d.ok(&[
        "start",
        "--mode=sampling",
        "--pid",
        &pid,
        "--duration",
        "2s",
        "--wait",
        "--format",
        "folded",
    ]));
    assert!(samples_in(&folded, "heavy") > 30, "{folded:?}");
    assert!(samples_in(&folded, "main") > 100, "{folded:?}");

    let err = |args: &[&str]| {
        let out = d.run(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        one_line_error(&out)
    };
    let e = err(&[
        "start",
        "--mode=counting",
        "--frequency",
        "99",
        "--pid",
        &pid,
    ]);
    assert!(e.contains("for sampling sessions"), "{e}");
    let e = err(&["start", "--mode=sampling", "--python", "--pid", &pid]);
    assert!(e.contains("counting-mode options"), "{e}");
    let e = err(&[
        "start",
        "--mode=sampling",
        "--frequency",
        "20000",
        "--pid",
        &pid,
    ]);
    assert!(e.contains("20000 Hz"), "{e}");
    let e = err(&[
        "start",
        "--mode=sampling",
        "--frequency",
        "0",
        "--pid",
        &pid,
    ]);
    assert!(e.contains("0"), "{e}");
    // A counting session has no stacks to draw.
    d.ok(&[
        "start",
        "--mode=counting",
        "--pid",
        &pid,
        "--duration",
        "200ms",
        "--wait",
        "--format",
        "json",
        "-o",
        "/dev/null",
    ]);
    let counting = d.newest_session("counting");
    let e = err(&["report", &counting, "--format", "svg"]);
    assert!(e.contains("for sampling sessions"), "{e}");
}

#[test]
fn later_sessions_name_frames_of_binaries_seen_before() {
    if !root_or_skip() {
        return;
    }
    // A pyenv build: libpython is shared and keeps its full symbol table, so every address
    // in it has a name.
    let Some(python) = interpreters()
        .into_iter()
        .find(|p| p.to_string_lossy().contains("/versions/"))
    else {
        tracer_testkit::skip(format_args!("no pyenv CPython with a shared libpython"));
        return;
    };
    let d = Daemon::start();
    // The first process maps libpython and exits; the second one's new addresses in the same
    // binary must still be named.
    tracer_json(&d, "999", &[python.to_str().unwrap(), "-c", "pass"]);
    let report = tracer_json(
        &d,
        "499",
        &[
            python.to_str().unwrap(),
            script("sample_workload.py").to_str().unwrap(),
            "1",
        ],
    );
    let p = &report["profile"];
    let libpython: Vec<u64> = p["mappings"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .filter(|(_, m)| m["path"].as_str().unwrap().contains("libpython"))
        .map(|(i, _)| i as u64)
        .collect();
    assert!(!libpython.is_empty(), "no libpython mapping: {p}");
    let (mut named, mut unnamed) = (0, Vec::new());
    for s in p["stacks"].as_array().unwrap() {
        for f in s["frames"].as_array().unwrap() {
            if f["mapping"]
                .as_u64()
                .is_some_and(|m| libpython.contains(&m))
            {
                match f["name"].as_str().unwrap() {
                    n if n.starts_with('[') => unnamed.push(f.clone()),
                    _ => named += 1,
                }
            }
        }
    }
    assert!(
        named > 100 && unnamed.is_empty(),
        "{named} named, unnamed: {unnamed:?}"
    );
}

#[test]
fn short_lived_processes_keep_their_python_frames() {
    if !root_or_skip() {
        return;
    }
    // examples/app.py runs for 30-150 ms: the daemon must read each process (its maps, its
    // interpreter, its code objects) while it still exists.
    let d = Daemon::start();
    let app = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/app.py");
    for python in interpreters() {
        let report = tracer_json(
            &d,
            "999",
            &[python.to_str().unwrap(), app.to_str().unwrap()],
        );
        let u = &report["profile"]["unwinding"];
        let (samples, python_samples) = (
            u["samples"].as_u64().unwrap(),
            u["python_samples"].as_u64().unwrap(),
        );
        println!(
            "{}: {python_samples} of {samples} samples with Python frames: {u}",
            python.display()
        );
        assert!(samples >= 10, "{}: {u}", python.display());
        // Samples without Python frames: the interpreter's start before its first frame and
        // its finalization, and those taken before tracerd read an interpreter it had not
        // seen (a chroot's: milliseconds of reading, longer on a loaded machine).
        assert!(python_samples * 3 >= samples, "{}: {u}", python.display());
        let complete = u["python_complete"].as_u64().unwrap();
        assert!(
            complete * 10 >= python_samples * 9,
            "{}: Python chains cut or unreadable: {u}",
            python.display()
        );
        let root = u["reached_root"].as_u64().unwrap();
        assert!(
            root * 2 >= samples,
            "{}: native stacks: {u}",
            python.display()
        );
    }
}

/// Forked workers continue the parent's Python frames without entering the eval loop anew:
/// their samples carry those frames (the busy function above main), on every interpreter.
#[test]
fn forked_children_keep_their_python_frames() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let wl = script("fork_spin.py");
    let file = "fork_spin.py";
    for python in interpreters() {
        let out = tempfile::NamedTempFile::new().unwrap();
        let stdout = d.ok(&[
            "start",
            "--mode=sampling",
            "--frequency",
            "199",
            "--format",
            "folded",
            "-o",
            out.path().to_str().unwrap(),
            "--",
            python.to_str().unwrap(),
            wl.to_str().unwrap(),
            "2",
            "1.5",
        ]);
        let folded = parse_folded(&std::fs::read_to_string(out.path()).unwrap());
        let kids: Vec<&str> = stdout.lines().map(str::trim).collect();
        assert_eq!(kids.len(), 2, "{}: {stdout}", python.display());
        for kid in kids {
            let root = format!("(pid {kid})");
            let of_kid: Folded = folded
                .iter()
                .filter(|(s, _)| s.first().is_some_and(|r| r.ends_with(&root)))
                .cloned()
                .collect();
            let total: u64 = of_kid.iter().map(|(_, n)| n).sum();
            let busy = of_kid
                .iter()
                .filter(|(s, _)| {
                    let at = |name: &str| {
                        s.iter().position(|fr| {
                            fr.starts_with(&format!("{name} (")) && fr.contains(&format!("{file}:"))
                        })
                    };
                    matches!((at("main"), at("child_busy")), (Some(m), Some(b)) if m < b)
                })
                .map(|(_, n)| n)
                .sum::<u64>();
            println!(
                "{} child {kid}: {busy} of {total} samples in child_busy under main",
                python.display()
            );
            assert!(total >= 50, "{} child {kid}: {of_kid:?}", python.display());
            assert!(
                busy * 10 >= total * 9,
                "{} child {kid}: {busy} of {total}: {of_kid:?}",
                python.display()
            );
        }
    }
}

/// A loop in step with the sampling period (two functions taking turns for half a period
/// each, on an absolute schedule): samples at an exact period would land in one of them
/// nearly every time (0% or 100%, seen before the timers were jittered); the truth is 50%.
#[test]
fn samples_do_not_fall_in_step_with_a_loop() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let python = interpreters().into_iter().next().expect("an interpreter");
    let workload = script("in_step.py");
    // 250 Hz: a 4 ms period, the loop's.
    for _ in 0..2 {
        let f = tracer_folded(&d, &python, &workload, &["4", "3"], "250");
        let (first, second) = (samples_in(&f, "first"), samples_in(&f, "second"));
        let share = 100.0 * first as f64 / (first + second).max(1) as f64;
        println!("first {first}, second {second}: {share:.1}%");
        assert!(first + second >= 300, "too few samples: {f:?}");
        assert!(
            (38.0..=62.0).contains(&share),
            "first: {share:.1}% of {}",
            first + second
        );
    }
}
