//! In-process counting: a running CPython 3.14+ process named by pid loads tracer's counter
//! (PEP 768 remote execution, sys.monitoring callbacks) instead of paying a uprobe trap per
//! call. Its counts must equal cProfile's in a separate run of the same program, its output
//! and exit status must not change, nothing of the counter may stay after the session but a
//! freed tool id, and processes that forbid it are counted with uprobes, saying why.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Read},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use serde_json::Value;
use tracer_tests::{
    chroot_interpreters, interpreters, own_calls_and_counted, root_or_skip, script, wait_until,
    ChildGuard, Daemon,
};

/// `GROUND_TRUTH` of ground_truth.py: {"line:name": [ncalls, primitive, tottime, cumtime]}.
fn ground_truth(python: &Path, mode: &str, wl: &Path, args: &[&str]) -> BTreeMap<String, Value> {
    let out = Command::new(python)
        .arg(script("ground_truth.py"))
        .args([mode, wl.to_str().unwrap()])
        .args(args)
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
    serde_json::from_str(json).unwrap()
}

/// (ncalls, primitive calls) per "line:name" of the functions of `wl` in the report.
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

fn truth_calls(t: &BTreeMap<String, Value>, primitive: bool) -> BTreeMap<String, (u64, u64)> {
    t.iter()
        .map(|(k, v)| {
            let p = if primitive { v[1].as_u64().unwrap() } else { 0 };
            (k.clone(), (v[0].as_u64().unwrap(), p))
        })
        .collect()
}

/// The program under a gate: started, attached to by pid, then let go.
struct Gated {
    child: ChildGuard,
    out: BufReader<std::process::ChildStdout>,
    go: PathBuf,
}

impl Gated {
    fn spawn(
        d: &Daemon,
        python: &Path,
        pre: &[&str],
        wl: &Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let go = d.dir.path().join(format!("go-{}", rand_suffix()));
        let mut child = ChildGuard::spawn(
            Command::new(python)
                .args(pre)
                .arg(script("attach_gate.py"))
                .arg(&go)
                .arg(wl)
                .args(args)
                .envs(env.iter().copied())
                .stdout(Stdio::piped()),
        );
        let mut out = BufReader::new(child.0.stdout.take().unwrap());
        let mut ready = String::new();
        out.read_line(&mut ready).unwrap();
        assert_eq!(ready, "ready\n", "{}", python.display());
        Self { child, out, go }
    }

    fn pid(&self) -> String {
        self.child.pid().to_string()
    }

    /// Lets it run to its end: its output after `ready`, and whether it exited 0.
    fn finish(mut self) -> (String, bool) {
        std::fs::write(&self.go, b"").unwrap();
        let mut rest = String::new();
        self.out.read_to_string(&mut rest).unwrap();
        let ok = self.child.0.wait().unwrap().success();
        (rest, ok)
    }
}

/// Runs `code` (saved as `name` in the daemon's directory), which prints `ready` first and
/// nothing after: the child, its pid, the script's path.
fn script_ready(d: &Daemon, py: &Path, name: &str, code: &str) -> (ChildGuard, String, PathBuf) {
    let file = d.dir.path().join(name);
    std::fs::write(&file, code).unwrap();
    let child = ChildGuard::spawn_ready(Command::new(py).arg(&file));
    let pid = child.pid().to_string();
    (child, pid, file)
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// The same program untraced: its output after `ready`.
fn untraced(python: &Path, wl: &Path, args: &[&str]) -> String {
    let go = tempfile::NamedTempFile::new().unwrap();
    let out = Command::new(python)
        .arg(script("attach_gate.py"))
        .arg(go.path())
        .arg(wl)
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .replacen("ready\n", "", 1)
}

fn start(d: &Daemon, pid: &str, extra: &[&str]) -> String {
    let mut args = vec!["start", "--mode=counting", "--python", "--pid", pid];
    args.extend_from_slice(extra);
    d.ok(&args).trim().to_owned()
}

fn ended_report(d: &Daemon, id: &str) -> Value {
    wait_until(30, "the session to end", || {
        d.ok(&["status", id]).contains("target exited")
    });
    d.report_json(id)
}

/// (way, why) the report gives for `pid`.
fn counted(report: &Value, pid: &str) -> (String, String) {
    let c = report["python"]["counted"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["pid"].as_u64() == pid.parse().ok()))
        .unwrap_or_else(|| panic!("no counted entry for {pid}: {}", report["python"]));
    (
        c["way"].as_str().unwrap().to_owned(),
        c["why"].as_str().unwrap().to_owned(),
    )
}

/// `wl` (py_workload.py) run by `py`, attached to by pid while it runs: whole functions,
/// recursion, generators, exceptions, coroutines counted in-process with cProfile's numbers,
/// the output unchanged, nothing lost. The report's reason for the way.
fn busy_counted_like_cprofile(d: &Daemon, py: &Path, wl: &Path) -> String {
    let truth = truth_calls(&ground_truth(py, "cprofile", wl, &[]), true);
    let expected_out = untraced(py, wl, &[]);
    let g = Gated::spawn(d, py, &[], wl, &[], &[]);
    let pid = g.pid();
    let id = start(d, &pid, &[]);
    let (out, ok) = g.finish();
    assert!(ok, "{}: the program failed", py.display());
    assert_eq!(out, expected_out, "{}: output changed", py.display());
    let report = ended_report(d, &id);
    let (way, why) = counted(&report, &pid);
    assert_eq!(way, "in-process", "{}: {why}", py.display());
    assert_eq!(ours(&report, wl), truth, "{}", py.display());
    assert_eq!(report["losses"], serde_json::json!([]));
    why
}

/// Threads `wl` starts after the attach: every call counted in-process, as the profile hook
/// in each thread sees it.
fn threads_counted_like_the_hook(d: &Daemon, py: &Path, wl: &Path) {
    let truth = truth_calls(&ground_truth(py, "hook", wl, &["threads"]), false);
    let g = Gated::spawn(d, py, &[], wl, &["threads"], &[]);
    let pid = g.pid();
    let id = start(d, &pid, &[]);
    let (_, ok) = g.finish();
    assert!(ok, "{} threads: the program failed", py.display());
    let report = ended_report(d, &id);
    assert_eq!(counted(&report, &pid).0, "in-process", "{}", py.display());
    let got: BTreeMap<String, (u64, u64)> = ours(&report, wl)
        .into_iter()
        .map(|(k, (n, _))| (k, (n, 0)))
        .collect();
    assert_eq!(got, truth, "{} threads", py.display());
}

#[test]
fn running_314_processes_are_counted_in_process_like_cprofile() {
    if !root_or_skip() {
        return;
    }
    let pythons = chroot_interpreters();
    if pythons.is_empty() {
        return;
    }
    let d = Daemon::start();
    let wl = script("py_workload.py");
    for py in &pythons {
        busy_counted_like_cprofile(&d, py, &wl);
        threads_counted_like_the_hook(&d, py, &wl);
        println!(
            "{}: counted in-process, equal to cProfile and the hook",
            py.display()
        );
    }
}

/// CPython 3.10-3.13 (pyenv's shared builds, Debian's stripped 3.11): no PEP 768, so tracer's
/// loader goes in with ptrace; a profile function counts on 3.10 and 3.11, sys.monitoring on
/// 3.12 and 3.13. Busy (a sleep loop in Python) and blocked in native code (every thread in
/// a read or a join), counts equal cProfile's and the hook's, output unchanged.
#[test]
fn running_310_to_313_processes_are_counted_in_process_with_ptrace() {
    if !root_or_skip() {
        return;
    }
    let chrooted = chroot_interpreters();
    let pythons: Vec<PathBuf> = interpreters()
        .into_iter()
        .filter(|p| !chrooted.contains(p))
        .collect();
    let d = Daemon::start();
    let wl = script("py_workload.py");
    for py in &pythons {
        let why = busy_counted_like_cprofile(&d, py, &wl);
        assert!(why.contains("ptrace"), "{why}");
        threads_counted_like_the_hook(&d, py, &wl);

        // Blocked: the loader's thread takes the free GIL at once; nothing is pending.
        let (mut child, pid, id) = start_blocked(&d, py, &[]);
        go(&mut child);
        let mut err = String::new();
        child
            .0
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        assert!(child.0.wait().unwrap().success(), "{}: {err}", py.display());
        assert_eq!(err, "", "{}", py.display());
        let report = ended_report(&d, &id);
        let (way, why) = counted(&report, &pid);
        assert_eq!(
            (way.as_str(), why.contains("ptrace")),
            ("in-process", true),
            "{why}"
        );
        let file = d.dir.path().join("blocked.py");
        assert_eq!(
            ours(&report, &file).get("2:fib").map(|c| c.0),
            Some(1973 + 177),
            "{}",
            py.display()
        );
        println!("{}: counted in-process ({why})", py.display());
    }
}

/// Threads that C code makes for itself after the attach (pthreads whose start routine is a
/// ctypes callback) on every interpreter: counted from their first frame (on 3.10 and 3.11
/// the frame evaluation wrapper gives them the profile function), equal to the program's own
/// account, its output otherwise unchanged.
#[test]
fn threads_c_code_makes_after_the_attach_are_counted() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let wl = script("c_threads.py");
    for py in interpreters() {
        let g = Gated::spawn(&d, &py, &[], &wl, &["8", "4"], &[]);
        let pid = g.pid();
        let id = start(&d, &pid, &[]);
        let (out, ok) = g.finish();
        assert!(ok, "{}: the program failed", py.display());
        let report = ended_report(&d, &id);
        let (way, why) = counted(&report, &pid);
        assert_eq!(way, "in-process", "{}: {why}", py.display());
        let (own, got) = own_calls_and_counted(&out, &report, &wl);
        assert_eq!(got, own, "{}", py.display());
        assert_eq!(report["losses"], serde_json::json!([]), "{}", py.display());
    }
}

/// A 3.10-3.13 process a debugger holds is not loaded into: counted with uprobes, the report
/// naming the tracer, and the process runs as before.
#[test]
fn a_traced_process_is_counted_with_uprobes_saying_by_whom() {
    if !root_or_skip() {
        return;
    }
    let chrooted = chroot_interpreters();
    let Some(py) = interpreters().into_iter().find(|p| !chrooted.contains(p)) else {
        return;
    };
    let d = Daemon::start();
    let wl = script("workload.py");
    let truth = ground_truth(&py, "cprofile", &wl, &["1"])["5:fib"][0]
        .as_u64()
        .unwrap();
    let g = Gated::spawn(&d, &py, &[], &wl, &["1"], &[]);
    let pid = g.pid();
    // A debugger of sorts: PTRACE_SEIZE (0x4206) from another process, held.
    let hold = format!(
        "import ctypes, time\n\
         libc = ctypes.CDLL(None, use_errno=True)\n\
         if libc.ptrace(0x4206, {pid}, None, None) != 0:\n\
         \x20   raise OSError(ctypes.get_errno(), 'seize')\n\
         print('ready', flush=True)\n\
         time.sleep(60)\n"
    );
    let holder = ChildGuard::spawn_ready(Command::new(&py).args(["-c", &hold]));
    let id = start(&d, &pid, &[]);
    drop(holder);
    let (_, ok) = g.finish();
    assert!(ok);
    let report = ended_report(&d, &id);
    let (way, why) = counted(&report, &pid);
    assert_eq!(way, "uprobes", "{why}");
    assert!(why.contains("already traced by pid"), "{why}");
    assert_eq!(ours(&report, &wl).get("5:fib").map(|c| c.0), Some(truth));
}

/// A 3.10-3.13 process stopped by job control (SIGSTOP) is not loaded into, and the start
/// does not wait for it: counted with uprobes, the report saying why, and once continued it
/// runs as before.
#[test]
fn a_stopped_process_is_counted_with_uprobes_saying_so() {
    if !root_or_skip() {
        return;
    }
    let chrooted = chroot_interpreters();
    let pythons: Vec<PathBuf> = interpreters()
        .into_iter()
        .filter(|p| !chrooted.contains(p))
        .collect();
    // 3.12 where pyenv has it (sys.monitoring once loaded); any 3.10-3.13 else.
    let Some(py) = pythons
        .iter()
        .find(|p| p.ends_with("python3.12"))
        .or(pythons.first())
        .cloned()
    else {
        return;
    };
    let d = Daemon::start();
    let wl = script("workload.py");
    let truth = ground_truth(&py, "cprofile", &wl, &["1"])["5:fib"][0]
        .as_u64()
        .unwrap();
    let expected_out = untraced(&py, &wl, &["1"]);
    let g = Gated::spawn(&d, &py, &[], &wl, &["1"], &[]);
    let pid = g.pid();
    let target = nix::unistd::Pid::from_raw(g.child.pid() as i32);
    nix::sys::signal::kill(target, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let status = format!("/proc/{pid}/status");
    wait_until(10, "the program to stop", || {
        std::fs::read_to_string(&status).is_ok_and(|s| s.contains("State:\tT"))
    });
    let started = std::time::Instant::now();
    let id = start(&d, &pid, &[]);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "the start took {:?}",
        started.elapsed()
    );
    nix::sys::signal::kill(target, nix::sys::signal::Signal::SIGCONT).unwrap();
    let (out, ok) = g.finish();
    assert!(ok, "{}: the program failed", py.display());
    assert_eq!(out, expected_out, "{}: output changed", py.display());
    let report = ended_report(&d, &id);
    let (way, why) = counted(&report, &pid);
    assert_eq!(way, "uprobes", "{why}");
    assert!(
        why.contains(
            "it is stopped (job control, or held at an exec): a stopped process is not loaded into"
        ),
        "{why}"
    );
    assert_eq!(ours(&report, &wl).get("5:fib").map(|c| c.0), Some(truth));
    println!("{}: counted with uprobes ({why})", py.display());
}

/// Removed at the end, through PEP 768 on 3.14+ and tracer's loader loaded with ptrace on
/// 3.12 and 3.13 (3.10 and 3.11 have no tool id to free).
#[test]
fn callers_equal_cprofiles_and_the_counter_leaves_with_the_session() {
    if !root_or_skip() {
        return;
    }
    let with_monitoring = interpreters().into_iter().filter(|p| {
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        name.ends_with("3.12") || name.ends_with("3.13")
    });
    for py in chroot_interpreters()
        .into_iter()
        .take(1)
        .chain(with_monitoring)
    {
        callers_and_removal(&py);
    }
}

fn callers_and_removal(py: &Path) {
    let d = Daemon::start();
    let wl = script("py_workload.py");
    let after = d.dir.path().join("after");
    let after_s = after.to_str().unwrap();
    let g = Gated::spawn(&d, py, &[], &wl, &[], &[("GATE_AFTER", after_s)]);
    let pid = g.pid();
    let id = start(&d, &pid, &["--duration", "1h"]);
    std::fs::write(&g.go, b"").unwrap();
    // The workload ends with the gate waiting for `after`: stop the session meanwhile.
    let Gated {
        mut child, mut out, ..
    } = g;
    loop {
        let mut l = String::new();
        assert!(out.read_line(&mut l).unwrap() > 0, "the gate ended early");
        if l == "script done\n" {
            break;
        }
    }
    d.ok(&["stop", &id]);
    std::fs::write(&after, b"").unwrap();
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    assert!(child.0.wait().unwrap().success());
    // The removal script ran: tool ids 3 and 4 are free again.
    assert!(
        rest.contains("tools after: None None"),
        "{}: {rest}",
        py.display()
    );

    // Callers, through the pstats export, as cProfile records them (Python callers only).
    let prof = d.dir.path().join("inproc.prof");
    d.ok(&[
        "report",
        &id,
        "--format",
        "pstats",
        "-o",
        prof.to_str().unwrap(),
    ]);
    let ours: BTreeMap<String, BTreeMap<String, Value>> =
        serde_json::from_value(tracer_tests::pstats_callers(py, &prof, &wl)).unwrap();
    let truth = ground_truth(py, "cprofile-callers", &wl, &[]);
    let mut compared = 0;
    for (f, callers) in &truth {
        let callers = callers.as_object().unwrap();
        // The runpy frames that call the script's top level differ between the two runs.
        if callers
            .keys()
            .any(|c| c.starts_with("~:") || c.contains("runpy"))
        {
            continue;
        }
        compared += 1;
        let expected: BTreeMap<String, Value> = callers
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert_eq!(
            ours.get(f),
            Some(&expected),
            "{}: callers of {f}",
            py.display()
        );
    }
    assert!(compared >= 10, "only {compared} functions compared");
}

#[test]
fn processes_that_forbid_it_are_counted_with_uprobes_saying_why() {
    if !root_or_skip() {
        return;
    }
    let Some(py) = chroot_interpreters().into_iter().next() else {
        return;
    };
    let d = Daemon::start();
    let wl = script("workload.py");
    let fib = |r: &Value| ours(r, &wl).get("5:fib").map(|c| c.0);
    let truth = ground_truth(&py, "cprofile", &wl, &["1"])["5:fib"][0]
        .as_u64()
        .unwrap();
    // (what, interpreter options, environment, tracerctl options, the reason says).
    type Case<'a> = (
        &'a str,
        &'a [&'a str],
        &'a [(&'a str, &'a str)],
        &'a [&'a str],
        &'a str,
    );
    let cases: [Case; 3] = [
        (
            "remote debugging disabled",
            &["-X", "disable-remote-debug"],
            &[],
            &[],
            "disabled",
        ),
        (
            "tool ids taken",
            &[],
            &[("GATE_TAKE_TOOLS", "1")],
            &[],
            "taken",
        ),
        (
            "asked for",
            &[],
            &[],
            &["--python-uprobes-only"],
            "uprobes-only",
        ),
    ];
    for (what, pre, env, extra, says) in cases {
        let g = Gated::spawn(&d, &py, pre, &wl, &["1"], env);
        let pid = g.pid();
        let id = start(&d, &pid, extra);
        let (_, ok) = g.finish();
        assert!(ok, "{what}");
        let report = ended_report(&d, &id);
        let (way, why) = counted(&report, &pid);
        assert_eq!(way, "uprobes", "{what}: {why}");
        assert!(why.to_lowercase().contains(says), "{what}: {why}");
        assert_eq!(fib(&report), Some(truth), "{what}");
        println!("{what}: counted with uprobes ({why})");
    }
}

/// tracerd SIGKILLed mid-session: the program runs on, its output and exit status unchanged,
/// and the counter, finding tracerd's lock free, stops counting (ORPHANED).
#[test]
fn a_killed_daemon_leaves_the_program_running_as_before() {
    if !root_or_skip() {
        return;
    }
    let Some(py) = chroot_interpreters().into_iter().next() else {
        return;
    };
    let mut d = Daemon::start();
    let wl = script("workload.py");
    let expected = untraced(&py, &wl, &["6"]);
    let g = Gated::spawn(&d, &py, &[], &wl, &["6"], &[]);
    let pid = g.pid();
    let id = start(&d, &pid, &[]);
    let counts = PathBuf::from(format!("/tmp/tracer-{id}-{pid}/counts.{pid}"));
    assert!(counts.exists(), "{}", counts.display());
    d.kill();
    let (out, ok) = g.finish();
    assert!(ok);
    assert_eq!(out, expected);
    let state = std::fs::read(&counts)
        .map(|b| u32::from_le_bytes(b[12..16].try_into().unwrap()))
        .unwrap_or(0);
    // 5: ORPHANED (tracer_common::inproc::state).
    assert_eq!(state, 5, "counter state");
    // What the next tracerd would sweep (a_restarted_daemon_sweeps_what_a_killed_one_left).
    let _ = std::fs::remove_dir_all(counts.parent().unwrap());
    let _ = std::fs::remove_dir_all(format!("/tmp/tracer-{id}-{pid}-code"));
}

/// `--export prometheus`: while the session runs, tracerd's endpoint shows the in-process
/// counts as they grow, read from the counter's file without stopping it.
#[test]
fn live_counts_reach_prometheus() {
    if !root_or_skip() {
        return;
    }
    let Some(py) = chroot_interpreters().into_iter().next() else {
        return;
    };
    let addr = tracer_tests::free_loopback_addr();
    let d = Daemon::start_with(tracer_tests::DaemonOptions {
        args: vec!["--metrics".into(), format!("tcp://{addr}")],
        ..Default::default()
    });
    // fib(20) (21,891 calls) until a file appears.
    let stop = d.dir.path().join("stop");
    let code = format!(
        "import os\n\
         def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\
         print('ready', flush=True)\n\
         while not os.path.exists({stop:?}):\n    fib(20)\n"
    );
    let (mut child, pid, file) = script_ready(&d, &py, "spin.py", &code);
    let id = start(&d, &pid, &["--export", "prometheus"]);
    let series = format!(
        "tracer_python_calls_total{{session=\"{id}\",function=\"fib\",file=\"{}\",line=\"2\"}} ",
        file.display()
    );
    let calls = || -> u64 {
        let text = tracer_tests::fleet::http_get(&addr, "/metrics").unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(&series))
            .map_or(0, |n| n.trim().parse().unwrap())
    };
    wait_until(10, "fib's calls on the endpoint", || calls() > 0);
    let first = calls();
    wait_until(10, "the count to grow", || calls() > first);
    std::fs::write(&stop, b"").unwrap();
    assert!(child.0.wait().unwrap().success());
    let report = ended_report(&d, &id);
    assert_eq!(counted(&report, &pid).0, "in-process");
    assert!(ours(&report, &file)["2:fib"].0 > first);
}

/// The counts file belongs to the counted process's user, who may shrink it under tracerd's
/// mapping: tracerd reads zeros there instead of dying of SIGBUS, and goes on serving.
#[test]
fn a_counts_file_shrunk_by_its_process_does_not_harm_tracerd() {
    if !root_or_skip() {
        return;
    }
    let Some(py) = chroot_interpreters().into_iter().next() else {
        return;
    };
    let d = Daemon::start();
    let go = d.dir.path().join("go");
    let code = format!(
        "import glob, os, time\n\
         print('ready', flush=True)\n\
         while not os.path.exists({go:?}):\n    time.sleep(0.005)\n\
         for f in glob.glob(f'/tmp/tracer-*-{{os.getpid()}}/counts.*'):\n    os.truncate(f, 0)\n\
         os._exit(0)\n"
    );
    let (mut child, pid, _) = script_ready(&d, &py, "shrink.py", &code);
    let id = start(&d, &pid, &[]);
    std::fs::write(&go, b"").unwrap();
    // Killed by its own counter's SIGBUS, or exited: either way tracerd reads the file.
    let _ = child.0.wait();
    let report = ended_report(&d, &id);
    assert_eq!(counted(&report, &pid).0, "in-process");
    assert!(d.ok(&["list"]).contains(&id), "tracerd still serves");
}

/// A program whose every thread sits in native code when the session starts: the worker in
/// `read` on a pipe, the main thread on a futex (`Event.wait`), a signal handler installed.
/// `GATED_TOOLS=1` takes sys.monitoring's tool ids 3 and 4 first. It prints `ready` and
/// nothing after; it exits 0 only if its own checks hold.
const BLOCKED: &str = r#"import os, signal, sys, threading, time
def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)
if os.environ.get("GATED_TOOLS") == "1":
    sys.monitoring.use_tool_id(3, "gate-a")
    sys.monitoring.use_tool_id(4, "gate-b")
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append("usr1"))
done = threading.Event()
def worker():
    got.append(sys.stdin.buffer.readline())
    time.sleep(float(os.environ.get("GATED_PAUSE", "0")))
    fib(15)
    done.set()
t = threading.Thread(target=worker)
t.start()
print("ready", flush=True)
done.wait()
t.join()
fib(10)
sys.exit(0 if got == [b"go\n"] else 3)
"#;

/// Starts a session on a BLOCKED program: it is answered while the program still waits for
/// its line (nothing holds the start until a safe point comes); then the line goes.
fn start_blocked(d: &Daemon, py: &Path, env: &[(&str, &str)]) -> (ChildGuard, String, String) {
    let file = d.dir.path().join("blocked.py");
    std::fs::write(&file, BLOCKED).unwrap();
    let child = ChildGuard::spawn_ready(
        Command::new(py)
            .arg(&file)
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let pid = child.pid().to_string();
    let id = start(d, &pid, &[]);
    let info = d.ok(&["status", &id]);
    assert!(!info.contains("target exited"), "{info}");
    (child, pid, id)
}

/// Sends a BLOCKED program its line.
fn go(child: &mut ChildGuard) {
    let mut stdin = child.0.stdin.take().unwrap();
    std::io::Write::write_all(&mut stdin, b"go\n").unwrap();
}

/// Every thread in native code at the start: counted in-process all the same, from the first
/// safe point a thread reaches, every call of both threads, and the program sees nothing.
#[test]
fn a_process_blocked_in_native_code_is_counted_in_process_from_its_first_safe_point() {
    if !root_or_skip() {
        return;
    }
    for py in chroot_interpreters() {
        let d = Daemon::start();
        let (mut child, pid, id) = start_blocked(&d, &py, &[]);
        go(&mut child);
        assert!(child.0.wait().unwrap().success(), "{}", py.display());
        let report = ended_report(&d, &id);
        let (way, why) = counted(&report, &pid);
        assert_eq!(way, "in-process", "{}: {why}", py.display());
        assert!(why.contains("first chance"), "{why}");
        assert!(why.contains("tool id 3"), "{why}");
        // fib(15) in the worker, fib(10) in the main thread.
        let file = d.dir.path().join("blocked.py");
        assert_eq!(
            ours(&report, &file).get("2:fib").map(|c| c.0),
            Some(1973 + 177),
            "{}",
            py.display()
        );
        let dir = PathBuf::from(format!("/tmp/tracer-{id}-{pid}"));
        wait_until(10, "the session's files to go", || !dir.exists());
    }
}

/// A counter refused at the late safe point (another tool holds both tool ids) leaves the
/// process to the probes from then on, and the report says so.
#[test]
fn a_late_refusal_is_counted_with_uprobes_from_then_on() {
    if !root_or_skip() {
        return;
    }
    let Some(py) = chroot_interpreters().into_iter().next() else {
        return;
    };
    let d = Daemon::start();
    // The pause after the refusal lets the probes be attached before fib runs.
    let env = [("GATED_TOOLS", "1"), ("GATED_PAUSE", "3")];
    let (mut child, pid, id) = start_blocked(&d, &py, &env);
    go(&mut child);
    assert!(child.0.wait().unwrap().success());
    let report = ended_report(&d, &id);
    let (way, why) = counted(&report, &pid);
    assert_eq!(way, "uprobes", "{why}");
    assert!(why.contains("tool ids 3 and 4 are taken"), "{why}");
    let file = d.dir.path().join("blocked.py");
    assert_eq!(
        ours(&report, &file).get("2:fib").map(|c| c.0),
        Some(1973 + 177)
    );
    let dir = PathBuf::from(format!("/tmp/tracer-{id}-{pid}"));
    wait_until(10, "the session's files to go", || !dir.exists());
}

/// A session that ends before the program reaches a safe point counted nothing and says so;
/// the request it left is withdrawn, or the script it runs later finds the session gone and
/// deletes its files, and the program neither prints nor fails.
#[test]
fn a_session_that_ends_before_any_safe_point_leaves_nothing() {
    if !root_or_skip() {
        return;
    }
    let Some(py) = chroot_interpreters().into_iter().next() else {
        return;
    };
    let d = Daemon::start();
    let (mut child, pid, id) = start_blocked(&d, &py, &[]);
    d.ok(&["stop", &id]);
    let report: Value = d.report_json(&id);
    let warnings = report["python"]["warnings"].to_string();
    assert!(
        warnings.contains("no thread reached a safe point"),
        "{warnings}"
    );
    assert_eq!(counted(&report, &pid).0, "in-process");
    go(&mut child);
    let mut err = String::new();
    child
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(child.0.wait().unwrap().success());
    assert_eq!(err, "");
    let dir = PathBuf::from(format!("/tmp/tracer-{id}-{pid}"));
    wait_until(10, "the session's files to go", || !dir.exists());
}

/// A program that sets its own profile function (taking the place of tracer's counter, on
/// 3.10) while tracerd cannot answer the handover (stopped, here): after 30 s the counter
/// lets it go on, and says so in its file, so that the answer tracerd makes once it runs
/// again does not hide the calls nobody counted in between.
#[test]
fn an_unanswered_handover_is_reported_as_a_loss() {
    if !root_or_skip() {
        return;
    }
    let Some(py) = interpreters()
        .into_iter()
        .find(|p| p.to_string_lossy().contains("/versions/3.10."))
    else {
        tracer_testkit::skip("no pyenv CPython 3.10");
        return;
    };
    let mut d = Daemon::start();
    let file = d.dir.path().join("gives_up.py");
    let code = "import sys\ndef f(): pass\nprint('ready', flush=True)\nsys.stdin.readline()\n\
                f()\nsys.setprofile(lambda *a: None)\nfor _ in range(100): f()\n";
    std::fs::write(&file, code).unwrap();
    let mut child = ChildGuard::spawn_ready(Command::new(&py).arg(&file).stdin(Stdio::piped()));
    let pid = child.pid().to_string();
    let id = start(&d, &pid, &[]);
    let stopped = d.pid().to_string();
    let signal = |sig: &str| {
        assert!(Command::new("kill")
            .args([sig, &stopped])
            .status()
            .unwrap()
            .success())
    };
    signal("-STOP");
    go(&mut child);
    // The counter holds the program for 30 s, then lets it go.
    std::thread::sleep(std::time::Duration::from_secs(33));
    signal("-CONT");
    assert!(child.0.wait().unwrap().success());
    let report = ended_report(&d, &id);
    let warnings = report["python"]["warnings"].to_string();
    assert!(
        warnings.contains("did not answer its handover within 30 s"),
        "{warnings}"
    );
    d.stop();
}
