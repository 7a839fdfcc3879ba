//! Small faults of input (issue 21, item 10): each answered with the right status and one
//! line, and nothing started that the request did not mean.

use std::process::Command;

use serde_json::Value;
use tracer_tests::{one_line_error, root_or_skip, script, ChildGuard, Daemon};

/// One raw request (bytes as given, well-formed or not) through Python's grpcio:
/// ("OK", response hex) or (status code name, details).
fn raw(d: &Daemon, method: &str, request: &[u8]) -> Option<(String, String)> {
    raw_with(d, method, request, &[])
}

fn raw_with(
    d: &Daemon,
    method: &str,
    request: &[u8],
    env: &[(&str, &str)],
) -> Option<(String, String)> {
    let Some(py) = tracer_tests::grpc_python() else {
        tracer_testkit::skip(format_args!(
            "raw requests: no Python with grpcio (run via `cargo xtask test`)"
        ));
        return None;
    };
    let hex: String = request.iter().map(|b| format!("{b:02x}")).collect();
    let out = Command::new(py)
        .arg(script("raw_request.py"))
        .arg(&d.socket)
        .arg(method)
        .arg(hex)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    Some((v[0].as_str().unwrap().into(), v[1].as_str().unwrap().into()))
}

/// A protobuf varint.
fn varint(mut n: u64) -> Vec<u8> {
    let mut out = Vec::new();
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
    out
}

/// A length-delimited field.
fn bytes_field(field: u8, data: &[u8]) -> Vec<u8> {
    let mut out = vec![field << 3 | 2];
    out.extend(varint(data.len() as u64));
    out.extend(data);
    out
}

/// StartSessionRequest { mode: COUNTING, target: `target` }.
fn start_counting(target: &[u8]) -> Vec<u8> {
    let mut req = vec![0x08, 0x01];
    req.extend(bytes_field(2, target));
    req
}

fn no_sessions(d: &Daemon) {
    let list = d.ok(&["list"]);
    assert_eq!(list.lines().count(), 1, "a session was left:\n{list}");
}

#[test]
fn long_ids_are_named_briefly_and_not_found() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let id = "x".repeat(16 * 1024);
    for cmd in ["status", "report", "stop", "delete"] {
        let line = one_line_error(&d.run(&[cmd, &id]));
        assert!(line.contains("no session with id 'xxxx"), "{cmd}: {line}");
        assert!(
            line.len() < 300,
            "{cmd}: the id echoed whole ({} bytes)",
            line.len()
        );
    }
    let line = one_line_error(&d.run(&["start", "--mode=counting", "--events", &id, "--all"]));
    assert!(line.contains("unknown event 'xxxx"), "{line}");
    assert!(line.len() < 4096, "{} bytes", line.len());
    if let Some((code, details)) = raw(&d, "GetSession", &bytes_field(1, id.as_bytes())) {
        assert_eq!(code, "NOT_FOUND", "{details}");
        assert!(details.len() < 300, "{} bytes", details.len());
    }
}

#[test]
fn malformed_requests_and_empty_targets_are_invalid_arguments() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    // Field 1, 100 bytes long, of which 2 came.
    let Some((code, details)) = raw(&d, "GetSession", &[0x0a, 100, b'a', b'b']) else {
        return;
    };
    assert_eq!(code, "INVALID_ARGUMENT", "{details}");
    let (code, _) = raw(&d, "StartSession", &[0xff, 0xff, 0xff]).unwrap();
    assert_eq!(code, "INVALID_ARGUMENT");
    // Target { all: false }: names nothing, and must not start a machine-wide session.
    let (code, details) = raw(&d, "StartSession", &start_counting(&[0x10, 0x00])).unwrap();
    assert_eq!(code, "INVALID_ARGUMENT", "{details}");
    assert!(details.contains("a target is required"), "{details}");
    // CountingOptions { python_uprobes_only: true } without python, as tracerctl refuses it.
    let mut target = vec![0x08];
    target.extend(varint(u64::from(std::process::id())));
    let mut req = start_counting(&target);
    req.extend(bytes_field(4, &[0x48, 0x01]));
    let (code, details) = raw(&d, "StartSession", &req).unwrap();
    assert_eq!(code, "INVALID_ARGUMENT", "{details}");
    assert!(details.contains("it needs --python"), "{details}");
    no_sessions(&d);
}

#[test]
fn launched_is_only_for_a_command_held_before_its_exec() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let running = ChildGuard::spawn(Command::new("sleep").arg("60"));
    let mut target = vec![0x08];
    target.extend(varint(u64::from(running.pid())));
    target.extend([0x18, 0x01]);
    if let Some((code, details)) = raw(&d, "StartSession", &start_counting(&target)) {
        assert_eq!(code, "INVALID_ARGUMENT", "{details}");
        assert!(
            details.contains(&format!("launched: pid {}", running.pid())),
            "{details}"
        );
        no_sessions(&d);
    }
    // tracerctl's own launches still are.
    let report = d.ok(&[
        "start",
        "--mode=counting",
        "--events",
        "task-clock",
        "--",
        "true",
    ]);
    assert!(report.contains("(launched)"), "{report}");
    // A client's own child that never execs passes that check: its counters, which start at
    // the exec, say so instead of reading zero.
    let mut target = vec![0x08];
    target.extend(b"CHILD");
    target.extend([0x18, 0x01]);
    let Some((code, details)) = raw(&d, "StartSession", &start_counting(&target)) else {
        return;
    };
    assert_eq!(code, "OK", "{details}");
    let id = d.newest_session("");
    let report = d.ok(&["report", &id, "--format", "json"]);
    let report: Value = serde_json::from_str(&report).unwrap();
    assert_eq!(report["session"]["end_reason"], "target exited", "{report}");
    // The default events: hardware ones may be missing here for their own reason.
    for (event, value) in tracer_tests::counters(&report) {
        let why = value.expect_err(&event);
        assert!(
            why.contains("it has not exec'd") || why.contains("no hardware PMU"),
            "{event}: {why}"
        );
    }
    let task_clock = tracer_tests::counter(&report, "task-clock").unwrap_err();
    assert!(task_clock.contains("it has not exec'd"), "{task_clock}");
}

#[test]
fn a_command_that_cannot_run_leaves_no_session() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let out = d.run(&["start", "--mode=counting", "--", "/nonexistent/command"]);
    assert_eq!(out.status.code(), Some(127));
    let line = one_line_error(&out);
    assert!(
        line.contains("cannot run '/nonexistent/command': No such file or directory"),
        "{line}"
    );
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    no_sessions(&d);
}

#[test]
fn a_zero_frequency_is_named() {
    let d = tempfile::tempdir().unwrap();
    let out = Command::new(tracer_tests::bin("tracerctl"))
        .arg("--socket")
        .arg(d.path().join("none.sock"))
        .args(["start", "--mode=sampling", "--frequency", "0", "--all"])
        .output()
        .unwrap();
    let line = one_line_error(&out);
    assert!(
        line.contains("the frequency must be at least 1 Hz"),
        "{line}"
    );
    assert!(!line.contains("18446744073709551615"), "{line}");
}

#[test]
fn uprobes_only_is_named_as_a_python_option() {
    let d = tempfile::tempdir().unwrap();
    let out = Command::new(tracer_tests::bin("tracerctl"))
        .arg("--socket")
        .arg(d.path().join("none.sock"))
        .args([
            "start",
            "--mode=counting",
            "--python-uprobes-only",
            "--pid",
            "1",
        ])
        .output()
        .unwrap();
    let line = one_line_error(&out);
    assert!(
        line.contains("required arguments were not provided: --python"),
        "{line}"
    );
}

#[test]
fn a_system_wide_session_counts_the_forks_it_saw() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let id = d.ok(&[
        "start",
        "--mode=counting",
        "--events",
        "task-clock",
        "--all",
    ]);
    let id = id.trim();
    assert!(d
        .ok(&["status", id])
        .contains("processes: the whole machine"));
    for _ in 0..20 {
        Command::new("true").status().unwrap();
    }
    d.ok(&["stop", id]);
    let report: Value = d.report_json(id);
    let p = &report["processes"];
    assert_eq!(p["system_wide"], true, "{p}");
    assert!(p["forked"].as_u64().unwrap() >= 20, "{p}");
    let table = d.ok(&["report", id]);
    assert!(
        table.contains("processes: the whole machine (system-wide), "),
        "{table}"
    );
    assert!(!table.contains("0 followed"), "{table}");
}

#[test]
fn a_function_the_kernel_will_not_probe_is_skipped_and_named() {
    if !root_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("unprobeable");
    let built = Command::new("cc")
        .args(["-O1", "-o"])
        .arg(&exe)
        .arg(tracer_tests::test_file("native/unprobeable.c"))
        .status();
    if !built.is_ok_and(|s| s.success()) {
        tracer_testkit::skip(format_args!("no C compiler (cc)"));
        return;
    }
    let d = Daemon::start();
    // Running, so that the kernel looks at the instructions as it attaches.
    let prog = ChildGuard::spawn(&mut Command::new(&exe));
    let pid = prog.pid().to_string();
    let bin = exe.display().to_string();
    std::thread::sleep(std::time::Duration::from_millis(200));
    let id = d.ok(&[
        "start",
        "--mode=counting",
        "--pid",
        &pid,
        "--uprobe",
        &format!("{bin}:probe_*"),
    ]);
    let id = id.trim();
    std::thread::sleep(std::time::Duration::from_millis(500));
    d.ok(&["stop", id]);
    let report: Value = d.report_json(id);
    let native = &report["native"];
    let probed: Vec<&str> = native["probes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["symbol"].as_str().unwrap())
        .collect();
    assert_eq!(probed, ["probe_called"], "{native}");
    let calls = native["calls"][0]["calls"].as_u64().unwrap_or(0);
    assert!(calls > 0, "{native}");
    let skipped = native["not_probed"].to_string();
    assert!(
        skipped.contains("probe_refused") && skipped.contains("os error"),
        "{skipped}"
    );
    let table = d.ok(&["report", id]);
    assert!(
        table.contains("not probed: ") && table.contains(":probe_refused: "),
        "{table}"
    );
    // Nothing probeable: the start fails, naming the function and the errno.
    let line = one_line_error(&d.run(&[
        "start",
        "--mode=counting",
        "--pid",
        &pid,
        "--uprobe",
        &format!("{bin}:probe_refused"),
    ]));
    assert!(
        line.contains("attaching a uprobe to probe_refused in"),
        "{line}"
    );
    assert!(line.contains("os error"), "{line}");
}

/// A client that launches a command without the loader's variables (`SessionInfo.launch_env`)
/// has it counted with the probes, from its first instruction, saying why.
#[test]
fn a_launch_without_the_loader_is_counted_with_the_probes() {
    if !root_or_skip() {
        return;
    }
    let Some(py) = tracer_tests::interpreters().into_iter().find(|p| {
        p.file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("python3."))
            .and_then(|m| m.parse::<u32>().ok())
            .is_some_and(|m| m >= 12)
    }) else {
        tracer_testkit::skip(format_args!("no CPython 3.12+ found"));
        return;
    };
    let d = Daemon::start();
    let file = d.dir.path().join("calls.py");
    std::fs::write(
        &file,
        "def f(n):\n    return n\nfor i in range(1000):\n    f(i)\n",
    )
    .unwrap();
    let argv = serde_json::json!([py, file]).to_string();
    let mut target = vec![0x08];
    target.extend(b"CHILD");
    target.extend([0x18, 0x01]);
    let mut req = start_counting(&target);
    // CountingOptions { python: true }.
    req.extend(bytes_field(4, &[0x10, 0x01]));
    let Some((code, details)) = raw_with(&d, "StartSession", &req, &[("RAW_CHILD_EXEC", &argv)])
    else {
        return;
    };
    assert_eq!(code, "OK", "{details}");
    let id = d.newest_session("");
    tracer_tests::wait_until(30, "the session to end", || {
        d.ok(&["status", &id]).contains("target exited")
    });
    let report: Value = d.report_json(&id);
    let counted = &report["python"]["counted"][0];
    assert_eq!(counted["way"], "uprobes", "{counted}");
    assert!(
        counted["why"].as_str().unwrap().contains("launch_env"),
        "{counted}"
    );
    let f = report["python"]["functions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["qualname"] == "f")
        .cloned();
    assert_eq!(
        f.map(|f| f["ncalls"].clone()),
        Some(1000.into()),
        "{}",
        py.display()
    );
}
