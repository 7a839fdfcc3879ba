//! Probes never outlive their session: they come off without holding up other requests, and
//! a SIGKILLed daemon leaves no breakpoint in any process for long.
//!
//! Breakpoints are seen the way a debugger would: a process's executable text, read through
//! `/proc/PID/mem`, differs from the file's bytes where the kernel put one.

use std::{
    io::{BufRead, BufReader, Read, Seek, SeekFrom},
    path::{Path, PathBuf},
    process::{ChildStdout, Command, Stdio},
    time::{Duration, Instant},
};

use tracer_tests::{root_or_skip, ChildGuard, Daemon, DaemonOptions};

/// How long the kernel may take to remove the probes of a killed daemon before the test
/// calls it stuck: far above what multi-uprobe links need (about a second here), far below
/// the tens of minutes one perf event per probe took.
const STUCK: Duration = Duration::from_secs(60);

/// `tests/native/probe_target.c`, built in a directory of its own: functions to probe in
/// groups of 1, 60 and 1,000.
fn build_target() -> Option<(tempfile::TempDir, PathBuf)> {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("probe_target");
    let built = Command::new("cc")
        .args(["-O1", "-o"])
        .arg(&exe)
        .arg(tracer_tests::test_file("native/probe_target.c"))
        .status();
    if !built.is_ok_and(|s| s.success()) {
        tracer_testkit::skip(format_args!("no C compiler (cc)"));
        return None;
    }
    Some((dir, exe))
}

struct Target {
    child: ChildGuard,
    out: BufReader<ChildStdout>,
}

impl Target {
    fn pid(&self) -> u32 {
        self.child.pid()
    }
}

/// Starts the target in its directory, waiting for it to say it runs.
fn start_target(exe: &Path) -> Target {
    let mut child = ChildGuard::spawn(
        Command::new(exe)
            .current_dir(exe.parent().unwrap())
            .stdout(Stdio::piped()),
    );
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    Target { child, out }
}

/// Lets the target finish; returns what it printed after `ready`, and whether it exited 0.
fn finish_target(mut target: Target, exe: &Path) -> (String, bool) {
    std::fs::write(exe.parent().unwrap().join("stop"), "").unwrap();
    let mut out = String::new();
    target.out.read_to_string(&mut out).unwrap();
    let status = target.child.0.wait().unwrap();
    std::fs::remove_file(exe.parent().unwrap().join("stop")).unwrap();
    (out, status.success())
}

/// Bytes of `pid`'s executable mappings that differ from the files they map: the kernel's
/// breakpoints (an `int3`, or the call of an optimized uprobe).
fn breakpoint_bytes(pid: u32) -> usize {
    let Ok(maps) = std::fs::File::open(format!("/proc/{pid}/maps")) else {
        return 0;
    };
    let Ok(mut mem) = std::fs::File::open(format!("/proc/{pid}/mem")) else {
        return 0;
    };
    let mut differ = 0;
    for line in BufReader::new(maps).lines().map_while(Result::ok) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 6 || !fields[1].contains('x') || !fields[5].starts_with('/') {
            continue;
        }
        let (start, end) = fields[0].split_once('-').unwrap();
        let start = u64::from_str_radix(start, 16).unwrap();
        let end = u64::from_str_radix(end, 16).unwrap();
        let offset = u64::from_str_radix(fields[2], 16).unwrap();
        let path = format!("/proc/{pid}/root{}", fields[5]);
        let Ok(file) = std::fs::read(&path) else {
            continue;
        };
        let from = usize::try_from(offset).unwrap().min(file.len());
        let to = usize::try_from(offset + (end - start))
            .unwrap()
            .min(file.len());
        let mut text = vec![0u8; to - from];
        if mem.seek(SeekFrom::Start(start)).is_err() || mem.read_exact(&mut text).is_err() {
            continue;
        }
        differ += text
            .iter()
            .zip(&file[from..to])
            .filter(|(a, b)| a != b)
            .count();
    }
    differ
}

/// Waits for `pids`' text to be the files' own again; returns how long that took.
fn wait_clean(pids: &[u32], what: &str) -> Duration {
    let started = Instant::now();
    while pids.iter().any(|&p| breakpoint_bytes(p) > 0) {
        assert!(
            started.elapsed() < STUCK,
            "{what}: breakpoints still in {:?} after {STUCK:?}",
            pids.iter()
                .map(|&p| (p, breakpoint_bytes(p)))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    started.elapsed()
}

#[test]
fn a_killed_daemon_leaves_no_breakpoint_behind() {
    if !root_or_skip() {
        return;
    }
    let Some((_dir, exe)) = build_target() else {
        return;
    };
    let bin = exe.display().to_string();
    let (expected, ok) = finish_target(start_target(&exe), &exe);
    assert!(ok && expected.starts_with("checksum"), "{expected}");

    let mut d = Daemon::start();
    for (pattern, probes) in [("one_*", 1), ("sixty_*", 60), ("many_*", 1000)] {
        let target = start_target(&exe);
        let pid = target.pid().to_string();
        let python = ChildGuard::spawn_ready(Command::new(tracer_tests::python()).args([
            "-c",
            "def f(): pass\nprint('ready', flush=True)\nwhile True: f()",
        ]));
        let py_pid = python.pid().to_string();
        let spec = format!("{bin}:{pattern}");
        // Every mode at once: counting and tracing with the native probes, Python counting
        // (with the probes: by default a running interpreter counts in-process), and sampling.
        for args in [
            &["--mode=counting", "--pid", &pid, "--uprobe", &spec][..],
            &["--mode=tracing", "--pid", &pid, "--uprobe", &spec][..],
            &[
                "--mode=counting",
                "--python",
                "--python-uprobes-only",
                "--pid",
                &py_pid,
            ][..],
            &["--mode=sampling", "--pid", &pid][..],
        ] {
            let mut start = vec!["start"];
            start.extend_from_slice(args);
            d.ok(&start);
        }
        let pids = [target.pid(), python.pid()];
        assert!(
            breakpoint_bytes(target.pid()) >= probes && breakpoint_bytes(python.pid()) > 0,
            "{probes} probes: no breakpoints seen while attached"
        );

        let killed = Instant::now();
        d.kill();
        let reaped = killed.elapsed();
        let clean = wait_clean(&pids, &format!("{probes} probes")) + reaped;
        d.restart();
        let serving = killed.elapsed();
        println!(
            "{probes} native probes: tracerd reaped {reaped:?} after SIGKILL, no breakpoint left after {clean:?}, a new tracerd served after {serving:?}"
        );
        let list = d.ok(&["list"]);
        assert_eq!(
            list.matches("failed").count(),
            4,
            "the killed daemon's sessions:\n{list}"
        );
        let (out, ok) = finish_target(target, &exe);
        assert!(
            ok,
            "{probes} probes: the target failed after the daemon died: {out}"
        );
        assert_eq!(
            out, expected,
            "{probes} probes: the target's output changed"
        );
        drop(python);
        for line in list.lines().skip(1) {
            if let Some(id) = line.split_whitespace().next() {
                d.ok(&["delete", id]);
            }
        }
    }
}

/// With one perf event per probe (`--per-probe-uprobes`, what kernels before 6.6 get),
/// removing 60 probes takes seconds of the kernel's grace periods: long enough to see other
/// requests answered while they come off.
#[test]
fn requests_are_answered_while_probes_come_off() {
    if !root_or_skip() {
        return;
    }
    let Some((_dir, exe)) = build_target() else {
        return;
    };
    let bin = exe.display().to_string();
    let d = Daemon::start_with(DaemonOptions {
        args: vec!["--per-probe-uprobes".into()],
        ..DaemonOptions::default()
    });
    let caps = d.ok(&["capabilities"]);
    assert!(caps.contains("--per-probe-uprobes"), "{caps}");
    let target = start_target(&exe);
    let pid = target.pid().to_string();
    let spec = format!("{bin}:sixty_*");
    let id = d.ok(&["start", "--mode=counting", "--pid", &pid, "--uprobe", &spec]);
    let id = id.trim();
    std::thread::sleep(Duration::from_millis(300));
    d.ok(&["stop", id]);
    // The stop is answered with the counts before the probes are gone; meanwhile the daemon
    // lists, reports and starts sessions.
    let list = d.ok(&["list"]);
    assert!(list.contains(id), "{list}");
    let report: serde_json::Value = d.report_json(id);
    let calls = report["native"]["calls"].as_array().unwrap();
    assert_eq!(calls.len(), 60, "one row per probed function: {calls:?}");
    assert!(
        calls.iter().all(|c| c["calls"].as_u64() > Some(0)),
        "{calls:?}"
    );
    let other = d.ok(&["start", "--mode=counting", "--pid", &pid]);
    assert!(
        breakpoint_bytes(target.pid()) > 0,
        "all the probes were gone before the daemon answered: the stop waited for them"
    );
    let took = wait_clean(&[target.pid()], "after the stop");
    println!("60 per-probe uprobes came off {took:?} after the stop was answered");
    d.ok(&["stop", other.trim()]);
    let (_, ok) = finish_target(target, &exe);
    assert!(ok);
}

/// Attaching 1,000 probes to a binary that twenty busy processes map takes a second or two
/// here: each process gets every breakpoint, and starts hitting them at once. Other requests
/// do not wait for it.
#[test]
fn requests_are_answered_while_probes_go_on() {
    if !root_or_skip() {
        return;
    }
    let Some((_dir, exe)) = build_target() else {
        return;
    };
    let d = Daemon::start();
    // The probe program loaded first, so that only attaching is timed.
    let targets: Vec<Target> = (0..20).map(|_| start_target(&exe)).collect();
    let pid = targets[0].pid().to_string();
    let one = format!("{}:one_*", exe.display());
    let id = d.ok(&["start", "--mode=counting", "--pid", &pid, "--uprobe", &one]);
    d.ok(&["stop", id.trim()]);
    let many = format!("{}:many_*", exe.display());
    let started = Instant::now();
    let (answered, id) =
        d.lists_answered_during(&["start", "--mode=counting", "--pid", &pid, "--uprobe", &many]);
    println!(
        "{answered} lists answered while 1,000 probes went on in {:?}",
        started.elapsed()
    );
    assert!(
        answered > 2,
        "{answered} requests answered while the probes were attached"
    );
    d.ok(&["stop", id.trim()]);
    let report: serde_json::Value =
        serde_json::from_str(&d.ok(&["report", id.trim(), "--format", "json"])).unwrap();
    assert_eq!(
        report["native"]["probes"].as_array().map(Vec::len),
        Some(1000),
        "{report}"
    );
    // All told to stop at once: each looks for the file only every 2 ms.
    std::fs::write(exe.parent().unwrap().join("stop"), "").unwrap();
    for mut target in targets {
        let mut out = String::new();
        target.out.read_to_string(&mut out).unwrap();
        let status = target.child.0.wait().unwrap();
        assert!(status.success() && out.starts_with("checksum"), "{out}");
    }
}

/// A Python process that waits two minutes, ready once it printed so.
fn idle_python() -> ChildGuard {
    ChildGuard::spawn_ready(Command::new(tracer_tests::python()).args([
        "-c",
        "import time; print('ready', flush=True); time.sleep(120)",
    ]))
}

/// A counting start on `pid`'s Python calls, with uprobes (never in-process).
fn python_uprobes_start(pid: &str) -> [&str; 6] {
    [
        "start",
        "--mode=counting",
        "--pid",
        pid,
        "--python",
        "--python-uprobes-only",
    ]
}

/// With one perf event per probe, the Python probes of the last Python session take a grace
/// period each to come off; a Python session started meanwhile waits for them (new probes
/// beside the old would count calls twice), and other requests do not wait with it.
#[test]
fn requests_are_answered_while_python_probes_wait_for_their_release() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start_with(DaemonOptions {
        args: vec!["--per-probe-uprobes".into()],
        ..DaemonOptions::default()
    });
    let python = idle_python();
    let pid = python.pid().to_string();
    let args = python_uprobes_start(&pid);
    let first = d.ok(&args);
    d.ok(&["stop", first.trim()]);
    let (answered, id) = d.lists_answered_during(&args);
    println!("{answered} lists answered while the old Python probes came off");
    assert!(
        answered > 2,
        "{answered} requests answered while the start waited for the old probes"
    );
    d.ok(&["stop", id.trim()]);
}

/// A start refused after its Python probes went on (here: more `--uprobe` functions than a
/// session may have) takes them off again, unless another start waits for them: that one
/// goes on with them, rather than waiting for their release and attaching them again.
#[test]
fn a_refused_python_start_takes_its_probes_off_unless_another_waits_for_them() {
    if !root_or_skip() {
        return;
    }
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("tracerd.log");
    // One perf event per probe: releasing a session's probes takes long enough for the
    // second start below to arrive while the first waits for it.
    let d = Daemon::start_with(DaemonOptions {
        args: ["--per-probe-uprobes", "--max-probes-per-session", "1"]
            .map(String::from)
            .to_vec(),
        log: Some(log.clone()),
        // Where the probes go on is said at info.
        env: vec![("RUST_LOG".into(), "info".into())],
        ..DaemonOptions::default()
    });
    let python = idle_python();
    let pid = python.pid().to_string();
    let args = python_uprobes_start(&pid);
    let refusable: Vec<&str> = args
        .iter()
        .copied()
        .chain(["--uprobe", "libc:getpid", "--uprobe", "libc:getppid"])
        .collect();
    let refused = |out: std::process::Output| {
        assert!(!out.status.success());
        let why = String::from_utf8_lossy(&out.stderr);
        assert!(why.contains("at most 1 a session"), "{why}");
    };
    // Alone: its probes come off.
    refused(d.run(&refusable));
    wait_clean(&[python.pid()], "a refused start's Python probes");
    // With a start waiting for them.
    let first = d.ok(&args);
    d.ok(&["stop", first.trim()]);
    let refusing = d
        .ctl()
        .args(&refusable)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let waited = d.ok(&args);
    refused(refusing.wait_with_output().unwrap());
    let said = std::fs::read_to_string(&log).unwrap();
    // The lone refused start's, the first session's and the second refused start's; the
    // start that waited attached none.
    let attached = said.matches("Python probes attached").count();
    assert_eq!(attached, 3, "{said}");
    d.ok(&["stop", waited.trim()]);
}

/// The first Python session of a daemon waits for its probe programs, which the kernel's
/// verifier takes seconds over; other requests do not wait with them. (The CUDA programs,
/// loaded the same way, verify in about 0.1 s since the sampling program's Python walk is
/// compiled apart for them: too short to count requests in.)
#[test]
fn requests_are_answered_while_probe_programs_load() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let python = idle_python();
    let pid = python.pid().to_string();
    let (answered, id) = d.lists_answered_during(&python_uprobes_start(&pid));
    println!("{answered} lists answered while the first start loaded its programs");
    // One list may come back between the start's answer and tracerctl's exit.
    assert!(
        answered > 2,
        "{answered} requests answered while the probe programs loaded"
    );
    d.ok(&["stop", id.trim()]);
}

/// Probe sets are per binary: one link per program on multi-uprobe kernels. Sessions that
/// share a binary get their own counts, and a stopped session's probes stop counting for a
/// session that takes its slot next.
#[test]
fn sessions_reusing_a_slot_count_only_their_own_calls() {
    if !root_or_skip() {
        return;
    }
    let Some((_dir, exe)) = build_target() else {
        return;
    };
    let bin = exe.display().to_string();
    let d = Daemon::start();
    let target = start_target(&exe);
    let pid = target.pid().to_string();
    let many = format!("{bin}:many_*");
    let one = format!("{bin}:one_*");
    for _ in 0..3 {
        let a = d.ok(&["start", "--mode=counting", "--pid", &pid, "--uprobe", &many]);
        std::thread::sleep(Duration::from_millis(200));
        d.ok(&["stop", a.trim()]);
        // Likely the slot `a` had once its probes are gone; never its counts.
        let b = d.ok(&["start", "--mode=counting", "--pid", &pid, "--uprobe", &one]);
        std::thread::sleep(Duration::from_millis(200));
        d.ok(&["stop", b.trim()]);
        let report: serde_json::Value =
            serde_json::from_str(&d.ok(&["report", b.trim(), "--format", "json"])).unwrap();
        let symbols: Vec<&str> = report["native"]["calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["symbol"].as_str().unwrap())
            .collect();
        assert_eq!(symbols, ["one_0"], "{report}");
    }
    let (_, ok) = finish_target(target, &exe);
    assert!(ok);
}

/// `pid`'s state letter in `/proc/PID/stat` (`T`: stopped), if it lives.
fn state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

/// tracerd's guardian: its child that runs `--guard-held`.
fn guardian_of(daemon: u32) -> u32 {
    let children = std::fs::read_to_string(format!("/proc/{daemon}/task/{daemon}/children"))
        .unwrap_or_default();
    children
        .split_whitespace()
        .filter_map(|p| p.parse::<u32>().ok())
        .find(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("--guard-held"))
        })
        .expect("tracerd has a guardian")
}

/// A session counting Python everywhere holds each new `python…` at its exec until tracerd
/// has looked at it. Killed right then (stopped first, to be sure it never answers),
/// tracerd leaves the process stopped; its guardian continues it.
#[test]
fn a_process_held_at_exec_runs_on_when_the_daemon_dies() {
    if !root_or_skip() {
        return;
    }
    // Found before tracerd stops: pyenv's shim runs a Python to find it.
    let python = tracer_tests::python();
    let mut d = Daemon::start();
    d.ok(&["start", "--mode=counting", "--python", "--all"]);
    let guardian = guardian_of(d.pid());
    let tracerd = nix::unistd::Pid::from_raw(d.pid() as i32);
    nix::sys::signal::kill(tracerd, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let mut py = ChildGuard::spawn(
        Command::new(&python)
            .args(["-c", "print('ran')"])
            .stdout(Stdio::piped()),
    );
    let pid = py.pid();
    tracer_tests::wait_until(20, "the new Python process to be held at exec", || {
        state(pid) == Some('T')
    });
    d.kill();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = py.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < STUCK,
            "the process tracerd held is still {:?} {STUCK:?} after tracerd died",
            state(pid)
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    println!("continued {:?} after tracerd was killed", started.elapsed());
    let mut out = String::new();
    py.0.stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(status.success() && out == "ran\n", "{status}: {out:?}");
    tracer_tests::wait_until(20, "the guardian to exit", || {
        matches!(state(guardian), None | Some('Z'))
    });
}
