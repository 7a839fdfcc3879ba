//! In-process counting of a launched command (`tracerctl start --mode=counting --python --
//! PY SCRIPT`): tracer's loader starts the counter just before the script's first line, where
//! `python -m cProfile SCRIPT` starts: with sys.monitoring on CPython 3.12+, with a C
//! profile function on 3.10 and 3.11. Counts must equal cProfile's, the program's output must
//! not change, and the program must not see the loader's variables. A command that runs
//! Python in another root (a chroot, a mount namespace with a `/tmp` of its own) counts
//! in-process too, its counter's directory made in that root.

use std::{collections::BTreeMap, path::Path, process::Command};

use serde_json::Value;
use tracer_tests::{interpreters, own_calls_and_counted, root_or_skip, script, Daemon};

/// (ncalls, primitive) per "line:name" of cProfile's run of `wl`.
fn cprofile(python: &Path, wl: &Path) -> BTreeMap<String, (u64, u64)> {
    cprofile_of(Command::new(python).arg(script("ground_truth.py")), wl)
}

/// The same, `python` being a command that runs ground_truth.py (`wl`: as it names it).
fn cprofile_of(python: &mut Command, wl: &Path) -> BTreeMap<String, (u64, u64)> {
    let out = python
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
    let mut all = vec![python.to_str().unwrap()];
    all.extend_from_slice(args);
    launched_command(d, &all)
}

/// The same for any command.
fn launched_command(d: &Daemon, command: &[&str]) -> (String, Value) {
    let (run, report) = launched_output(d, command);
    assert!(run.status.success(), "{command:?}: {run:?}");
    (String::from_utf8(run.stdout).unwrap(), report)
}

/// tracerctl's output for `command` launched under a counting session, and the report.
fn launched_output(d: &Daemon, command: &[&str]) -> (std::process::Output, Value) {
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
    ];
    all.extend_from_slice(command);
    let run = d.run(&all);
    let report =
        serde_json::from_slice(&std::fs::read(&out).unwrap_or_default()).unwrap_or(Value::Null);
    (run, report)
}

/// The tests' CPython root and the interpreters of 3.14 and 3.15 it holds (their paths
/// inside it); None, saying why, where there is none.
fn root_pythons() -> Option<(std::path::PathBuf, Vec<String>)> {
    let Some(root) = tracer_tests::cpython_root() else {
        tracer_testkit::skip("no CPython root (`cargo xtask setup` makes it)");
        return None;
    };
    let pythons: Vec<String> = ["3.14", "3.15"]
        .iter()
        .map(|v| format!("/usr/bin/python{v}"))
        .filter(|p| root.join(&p[1..]).exists())
        .collect();
    if pythons.is_empty() {
        tracer_testkit::skip("no python3.14 or python3.15 in the CPython root");
        return None;
    }
    Some((root, pythons))
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

/// Each host interpreter in a mount namespace whose `/tmp` is a tmpfs of its own (what
/// `systemd-run -p PrivateTmp=yes` gives): counted in-process, equal to cProfile.
#[test]
fn commands_launched_with_a_private_tmp_count_in_process_like_cprofile() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    // Where the private /tmp does not hide it (a checkout may lie under /tmp).
    let dir = tempfile::Builder::new()
        .prefix("tracer-private-tmp-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let wl = dir.path().join("py_workload.py");
    std::fs::copy(script("py_workload.py"), &wl).unwrap();
    let chrooted = tracer_tests::chroot_interpreters();
    for py in interpreters().iter().filter(|p| !chrooted.contains(p)) {
        let what = format!("{} with a private /tmp", py.display());
        let private = "mount -t tmpfs tmpfs /tmp && exec \"$@\"";
        let cmd = ["unshare", "-m", "sh", "-c", private, "sh"];
        let mut cmd = cmd.to_vec();
        cmd.extend([py.to_str().unwrap(), wl.to_str().unwrap()]);
        let (_, report) = launched_command(&d, &cmd);
        let counted = &report["python"]["counted"][0];
        assert_eq!(counted["way"], "in-process", "{what}: {counted}");
        assert_eq!(ours(&report, &wl), cprofile(py, &wl), "{what}");
        println!("{what}: in-process, equal to cProfile");
    }
}

/// Debian's 3.14 and 3.15 in the tests' CPython root, launched into it through `chroot` (its
/// own `/tmp`), and through `unshare -m` with a private `/tmp` (a tmpfs over the root's, as
/// `PrivateTmp=` or a container gives): counted in-process, every ncalls equal to cProfile's
/// in the same root, and the counter's directories gone afterwards from every `/tmp`.
#[test]
fn commands_launched_into_another_root_count_in_process_like_cprofile() {
    if !root_or_skip() {
        return;
    }
    let Some((root, pythons)) = root_pythons() else {
        return;
    };
    // The scripts inside the root, where both ways see them.
    let dir = tempfile::Builder::new()
        .prefix("tracer-launch-root-")
        .tempdir_in(&root)
        .unwrap();
    let inner = Path::new("/").join(dir.path().file_name().unwrap());
    for s in ["py_workload.py", "ground_truth.py"] {
        std::fs::copy(script(s), dir.path().join(s)).unwrap();
    }
    // A program on the way to Python, in the new root: the directory is made there for it.
    std::fs::copy("/usr/bin/env", dir.path().join("env")).unwrap();
    let env = inner.join("env");
    let (wl, truth) = (inner.join("py_workload.py"), inner.join("ground_truth.py"));
    let d = Daemon::start();
    let root_s = root.to_str().unwrap();
    let private_tmp = format!("mount -t tmpfs tmpfs {root_s}/tmp && exec chroot \"$@\"");
    for py in &pythons {
        let ways: [(&str, Vec<&str>); 3] = [
            ("chroot", vec!["chroot", root_s]),
            (
                "chroot, then env",
                vec!["chroot", root_s, env.to_str().unwrap()],
            ),
            (
                "unshare -m, private /tmp",
                vec!["unshare", "-m", "sh", "-c", &private_tmp, "sh", root_s],
            ),
        ];
        let want = cprofile_of(
            Command::new("chroot").args([root_s, py, truth.to_str().unwrap()]),
            &wl,
        );
        for (way, prefix) in ways {
            let what = format!("{py} launched through {way}");
            let mut cmd = prefix.clone();
            cmd.extend([py.as_str(), wl.to_str().unwrap()]);
            let untraced = Command::new(cmd[0]).args(&cmd[1..]).output().unwrap();
            assert!(untraced.status.success(), "{what}: {untraced:?}");
            let (stdout, report) = launched_command(&d, &cmd);
            assert_eq!(stdout, String::from_utf8_lossy(&untraced.stdout), "{what}");
            let counted = &report["python"]["counted"][0];
            assert_eq!(counted["way"], "in-process", "{what}: {counted}");
            assert_eq!(ours(&report, &wl), want, "{what}");
            let id = report["session"]["id"].as_str().unwrap().to_owned();
            let left = || {
                [Path::new("/tmp"), &root.join("tmp")]
                    .iter()
                    .flat_map(|t| std::fs::read_dir(t).into_iter().flatten().flatten())
                    .map(|e| e.path())
                    .filter(|p| p.to_string_lossy().contains(&format!("tracer-{id}-")))
                    .collect::<Vec<_>>()
            };
            tracer_tests::wait_until(20, "the counter's directories to go", || left().is_empty());
            println!("{what}: in-process, equal to cProfile");
        }
        // Where no directory can be made (a read-only /tmp), the probes count it, the report
        // says why, and the program's output is its own (no dynamic loader's error).
        let what = format!("{py} launched with a read-only /tmp");
        let read_only = format!("mount -t tmpfs -o ro tmpfs {root_s}/tmp && exec chroot \"$@\"");
        let cmd = [
            "unshare",
            "-m",
            "sh",
            "-c",
            &read_only,
            "sh",
            root_s,
            py,
            wl.to_str().unwrap(),
        ];
        let (run, report) = launched_output(&d, &cmd);
        assert!(run.status.success(), "{what}: {run:?}");
        assert!(
            !String::from_utf8_lossy(&run.stderr).contains("LD_PRELOAD"),
            "{what}: {run:?}"
        );
        let counted = &report["python"]["counted"][0];
        let why = counted["why"].as_str().unwrap_or("");
        assert_eq!(counted["way"], "uprobes", "{what}: {counted}");
        assert!(
            why.contains("could not be made there") && why.contains("Read-only"),
            "{what}: {why}"
        );
        // The probes count on through the interpreter's exit, where the generator the
        // program abandons is closed once more (cProfile has stopped by then).
        let but_exit = |mut m: BTreeMap<String, (u64, u64)>| {
            m.retain(|k, _| !k.ends_with(":abandoned"));
            m
        };
        assert_eq!(
            but_exit(ours(&report, &wl)),
            but_exit(want.clone()),
            "{what}"
        );
        println!("{what}: uprobes, saying why, equal to cProfile");
    }
}

/// A tracerd killed while a command it launched into a chroot counts in-process: the next
/// tracerd sweeps the directory made in the chroot's `/tmp` (reached through the process's
/// root), and the program runs on to its end (tracerctl itself reports the lost tracerd).
#[test]
fn a_killed_daemon_leaves_nothing_in_a_launched_commands_root() {
    if !root_or_skip() {
        return;
    }
    let Some((root, pythons)) = root_pythons() else {
        return;
    };
    let py = &pythons[0];
    let dir = tempfile::Builder::new()
        .prefix("tracer-launch-killed-")
        .tempdir_in(&root)
        .unwrap();
    let inner = Path::new("/").join(dir.path().file_name().unwrap());
    let go = inner.join("go");
    let code = format!(
        "import os, time\n\
         def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\
         print('ready', flush=True)\n\
         while not os.path.exists({go:?}):\n    fib(10); time.sleep(0.001)\n\
         print('done', flush=True)\n"
    );
    let mut d = Daemon::start();
    let root_s = root.to_str().unwrap();
    let mut ctl = tracer_tests::ChildGuard::spawn(
        d.ctl()
            .args([
                "start",
                "--mode=counting",
                "--python",
                "--",
                "chroot",
                root_s,
            ])
            .args([py.as_str(), "-c", &code])
            .stdout(std::process::Stdio::piped()),
    );
    // The directories made in the chroot's /tmp, once the counter runs there.
    let made = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(root.join("tmp"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("tracer-"))
            })
            .collect()
    };
    // The program's first line has run: its counter counts (one killed before that stays
    // with its directory until the process exits: the next tracerd has nothing to remove).
    let mut out = std::io::BufReader::new(ctl.0.stdout.take().unwrap());
    let mut ready = String::new();
    std::io::BufRead::read_line(&mut out, &mut ready).unwrap();
    assert_eq!(ready, "ready\n");
    assert_eq!(made().len(), 2, "the counter's directories in the chroot");
    d.kill();
    d.restart();
    tracer_tests::wait_until(20, "the killed daemon's directories to go", || {
        made().is_empty()
    });
    std::fs::write(dir.path().join("go"), b"").unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    // tracerctl says its tracerd went; the program it launched ran on.
    let _ = ctl.0.wait();
    assert_eq!(rest, "done\n");
}
