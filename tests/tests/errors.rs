//! Bad input: every case gets a one-line message naming the problem, a non-zero exit, and
//! the daemon keeps serving the other sessions with nothing lost.

use std::{process::Command, time::Duration};

use tracer_tests::{bin, one_line_error, root_or_skip, wait_until, ChildGuard, Daemon};

#[test]
fn bad_requests_get_one_line_each_and_the_daemon_keeps_serving() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    // A session that must survive everything below untouched.
    let bystander = ChildGuard::spawn(Command::new("sleep").arg("60"));
    let keep = d
        .ok(&[
            "start",
            "--mode=counting",
            "--events",
            "task-clock",
            "--pid",
            &bystander.pid().to_string(),
        ])
        .trim()
        .to_owned();
    let sleeper = ChildGuard::spawn(Command::new("sleep").arg("60"));
    let pid = sleeper.pid().to_string();

    let cases: &[(&[&str], &str)] = &[
        (
            &["start", "--mode=bogus", "--pid", &pid],
            "invalid value 'bogus'",
        ),
        (
            &[
                "start",
                "--mode=counting",
                "--events",
                "task-clock,bogus",
                "--pid",
                &pid,
            ],
            "unknown event 'bogus'",
        ),
        (
            &["start", "--mode=counting", "--pid", "999999999"],
            "no process with pid 999999999",
        ),
        (
            &["start", "--mode=counting", "--duration", "0", "--pid", &pid],
            "duration must be greater than 0",
        ),
        (
            &[
                "start",
                "--mode=counting",
                "--duration",
                "25h",
                "--pid",
                &pid,
            ],
            "duration must be at most 24h",
        ),
        (
            &[
                "start",
                "--mode=counting",
                "--duration",
                "soon",
                "--pid",
                &pid,
            ],
            "invalid duration 'soon'",
        ),
        (&["start", "--mode=counting"], "a target is required"),
        (
            &[
                "start",
                "--mode=counting",
                "--buffer-mb",
                "8",
                "--pid",
                &pid,
            ],
            "are for tracing sessions",
        ),
        (
            &[
                "start",
                "--mode=tracing",
                "--buffer-mb",
                "99999",
                "--pid",
                &pid,
            ],
            "over the 4096 MiB allowed",
        ),
        (
            &["watch", "nosuchsession"],
            "no session with id 'nosuchsession'",
        ),
        (
            &[
                "start",
                "--mode=sampling",
                "--cuda",
                "--cuda-stacks",
                "--pid",
                &pid,
            ],
            "--cuda-stacks is for counting and tracing sessions",
        ),
        (
            &["start", "--mode=counting", "--gpu-times", "--pid", &pid],
            "--cuda",
        ),
        (
            &[
                "start",
                "--mode=counting",
                "--cuda",
                "--gpu-times",
                "--pid",
                &pid,
            ],
            "has not loaded CUDA's driver (libcuda)",
        ),
        (
            &["start", "--mode=counting", "--cuda", "--gpu-times", "--all"],
            "--gpu-times needs a process",
        ),
        (
            &[
                "start",
                "--mode=counting",
                "--gpu-period",
                "50ms",
                "--pid",
                &pid,
            ],
            "--cuda",
        ),
        (
            &["start", "--mode=counting", "--cuda-stacks", "--pid", &pid],
            "--cuda",
        ),
        (
            &[
                "start",
                "--mode=counting",
                "--cuda-uprobes-only",
                "--pid",
                &pid,
            ],
            "--cuda",
        ),
        (
            &[
                "start",
                "--mode=counting",
                "--cuda",
                "--cuda-uprobes-only",
                "--cuda-in-process",
                "--pid",
                &pid,
            ],
            "cannot be used with",
        ),
        (
            &[
                "start",
                "--mode=counting",
                "--cuda-driver-only",
                "--pid",
                &pid,
            ],
            "--cuda",
        ),
        (&["watch", &keep], "is not a running tracing session"),
        (
            &["status", "nosuchsession"],
            "no session with id 'nosuchsession'",
        ),
        (
            &["report", "nosuchsession"],
            "no session with id 'nosuchsession'",
        ),
        (
            &["stop", "nosuchsession"],
            "no session with id 'nosuchsession'",
        ),
        (&["frobnicate"], "unrecognized subcommand 'frobnicate'"),
    ];
    for (args, want) in cases {
        let line = one_line_error(&d.run(args));
        assert!(line.starts_with("tracerctl: "), "{args:?}: {line}");
        assert!(
            line.contains(want),
            "{args:?}: expected '{want}' in '{line}'"
        );
    }
    // --gpu-times: another injection library already in the environment; and a tracerctl with
    // no injection library beside it.
    let gpu_times = [
        "start",
        "--mode=counting",
        "--cuda",
        "--gpu-times",
        "--",
        "true",
    ];
    let other = d
        .ctl()
        .args(gpu_times)
        .env("CUDA_INJECTION64_PATH", "/opt/other/libinject.so")
        .output()
        .unwrap();
    let line = one_line_error(&other);
    assert!(
        line.contains("CUDA_INJECTION64_PATH is already set (/opt/other/libinject.so)"),
        "{line}"
    );
    let lonely = tempfile::tempdir().unwrap();
    let ctl = lonely.path().join("tracerctl");
    std::fs::copy(bin("tracerctl"), &ctl).unwrap();
    let alone = Command::new(&ctl)
        .arg("--socket")
        .arg(&d.socket)
        .args(gpu_times)
        .env_remove("CUDA_INJECTION64_PATH")
        .output()
        .unwrap();
    let line = one_line_error(&alone);
    assert!(line.contains("libtracer_cupti.so not found at"), "{line}");
    // Nothing above disturbed the bystander session.
    let status = d.ok(&["status", &keep]);
    assert!(status.contains("state:     running"), "{status}");
    assert!(d.ok(&["stop", &keep]).contains("finished (stopped)"));
    // Formats for what this session did not record.
    for (format, want) in [
        ("chrome", "chrome and perfetto are for tracing sessions"),
        ("perfetto", "chrome and perfetto are for tracing sessions"),
        ("kernels", "kernels needs CUDA results"),
    ] {
        let line = one_line_error(&d.run(&["report", &keep, "--format", format]));
        assert!(line.contains(want), "{format}: {line}");
    }
}

#[test]
fn a_target_that_exits_mid_session_ends_it_with_a_report() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let short = ChildGuard::spawn(Command::new("sleep").arg("0.4"));
    let id = d
        .ok(&[
            "start",
            "--mode=counting",
            "--events",
            "task-clock",
            "--pid",
            &short.pid().to_string(),
            "--duration",
            "1h",
        ])
        .trim()
        .to_owned();
    wait_until(10, "the session to end", || {
        d.ok(&["status", &id]).contains("finished (target exited)")
    });
    assert!(d.ok(&["report", &id]).contains("task-clock"));
}

#[test]
fn the_daemon_not_running_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("none.sock");
    let out = Command::new(bin("tracerctl"))
        .arg("--socket")
        .arg(&socket)
        .arg("list")
        .output()
        .unwrap();
    let line = one_line_error(&out);
    assert!(line.contains("tracerd is not running"), "{line}");
    // A stale socket file with nobody behind it.
    let _ = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let out = Command::new(bin("tracerctl"))
        .arg("--socket")
        .arg(&socket)
        .arg("list")
        .env_remove("TRACER_SOCKET")
        .output()
        .unwrap();
    assert!(one_line_error(&out).contains("tracerd is not running"));
    // TRACER_SOCKET is honoured.
    let out = Command::new(bin("tracerctl"))
        .arg("list")
        .env("TRACER_SOCKET", dir.path().join("env.sock"))
        .output()
        .unwrap();
    assert!(one_line_error(&out).contains("env.sock"));
}

fn daemon_error(args: &[&std::ffi::OsStr]) -> String {
    let out = Command::new(bin("tracerd"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    err.trim_end().to_owned()
}

#[test]
fn a_second_daemon_and_a_bad_state_dir_are_refused() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let other_state = d.dir.path().join("other-state");
    let line = daemon_error(&[
        "--socket".as_ref(),
        d.socket.as_os_str(),
        "--state-dir".as_ref(),
        other_state.as_os_str(),
    ]);
    assert!(
        line.contains("another tracerd is already listening on"),
        "{line}"
    );
    // Same state directory, other socket: the database is locked.
    let other_socket = d.dir.path().join("other.sock");
    let line = daemon_error(&[
        "--socket".as_ref(),
        other_socket.as_os_str(),
        "--state-dir".as_ref(),
        d.state_dir.as_os_str(),
    ]);
    assert!(line.contains("is in use by another tracerd"), "{line}");
    // A state directory that cannot be created.
    let file = d.dir.path().join("a-file");
    std::fs::write(&file, b"").unwrap();
    let line = daemon_error(&[
        "--socket".as_ref(),
        other_socket.as_os_str(),
        "--state-dir".as_ref(),
        file.join("state").as_os_str(),
    ]);
    assert!(line.contains("cannot use state directory"), "{line}");
    // The first daemon is unaffected.
    d.ok(&["list"]);
}

#[test]
fn a_client_killed_mid_stream_harms_nothing() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let sleeper = ChildGuard::spawn(Command::new("sleep").arg("60"));
    let pid = sleeper.pid().to_string();
    // `--wait` follows the session over a server stream; kill the client while it does.
    let mut watcher = ChildGuard::spawn(d.ctl().args([
        "start",
        "--mode=counting",
        "--events",
        "task-clock",
        "--pid",
        &pid,
        "--wait",
    ]));
    wait_until(10, "the session to start", || {
        d.ok(&["list"]).contains("running")
    });
    std::thread::sleep(Duration::from_millis(300));
    watcher.0.kill().unwrap();
    watcher.0.wait().unwrap();
    let id = d.newest_session("");
    // The session goes on, and another one works alongside it.
    assert!(d.ok(&["status", &id]).contains("state:     running"));
    let report = d.ok(&[
        "start",
        "--mode=counting",
        "--events",
        "task-clock",
        "--",
        "true",
    ]);
    assert!(report.contains("task-clock"), "{report}");
    assert!(d.ok(&["stop", &id]).contains("finished (stopped)"));
    assert!(d.ok(&["report", &id]).contains("task-clock"));
}

#[test]
fn unknown_groups_and_listen_addresses_are_refused() {
    if !root_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let state = dir.path().join("state");
    let line = daemon_error(&[
        "--socket".as_ref(),
        sock.as_os_str(),
        "--state-dir".as_ref(),
        state.as_os_str(),
        "--group".as_ref(),
        "no-such-group-xyz".as_ref(),
    ]);
    assert!(
        line.contains("no group named 'no-such-group-xyz'"),
        "{line}"
    );
    let line = daemon_error(&[
        "--socket".as_ref(),
        sock.as_os_str(),
        "--state-dir".as_ref(),
        state.as_os_str(),
        "--listen".as_ref(),
        "localhost".as_ref(),
    ]);
    assert!(line.contains("--listen wants tcp://HOST:PORT"), "{line}");
    let line = daemon_error(&[
        "--socket".as_ref(),
        sock.as_os_str(),
        "--state-dir".as_ref(),
        state.as_os_str(),
        "--trace-ring-mb".as_ref(),
        "3".as_ref(),
    ]);
    assert!(
        line.contains("--trace-ring-mb wants a power of two from 1 to 1024, got 3"),
        "{line}"
    );
    for flag in ["--max-probes-per-session", "--max-probes-per-user"] {
        let line = daemon_error(&[
            "--socket".as_ref(),
            sock.as_os_str(),
            "--state-dir".as_ref(),
            state.as_os_str(),
            flag.as_ref(),
            "0".as_ref(),
        ]);
        assert!(
            line.contains(
                "--max-probes-per-session and --max-probes-per-user want 1 to 100000, got 0"
            ),
            "{flag}: {line}"
        );
    }
}
