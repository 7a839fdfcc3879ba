//! Connections to the Unix socket: one user's idle connections cannot starve the others or
//! root, refusals are answered at once, and idle connections are closed.

use std::{
    io::{BufRead, BufReader, Read},
    os::unix::net::UnixStream,
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use tracer_tests::{
    one_line_error, root_or_skip,
    users::{self, as_user, public_ctl},
    wait_until, ChildGuard, Daemon, DaemonOptions,
};

/// Runs `cmd` to completion, failing the test if it takes more than `secs`: a refusal must
/// be an answer, never a hang.
fn output_within(cmd: &mut Command, secs: u64) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(secs);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{cmd:?} did not finish within {secs} s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// `n` idle connections to the daemon, held by a process of `uid` until the guard drops.
fn hold_connections(d: &Daemon, uid: u32, gid: u32, n: usize) -> ChildGuard {
    let code = format!(
        "import socket, sys, time\n\
         s = [socket.socket(socket.AF_UNIX) for _ in range({n})]\n\
         [c.connect(sys.argv[1]) for c in s]\n\
         print('held', flush=True)\n\
         time.sleep(120)"
    );
    let mut cmd = Command::new("python3");
    cmd.args(["-c", &code])
        .arg(&d.socket)
        .stdout(Stdio::piped());
    let mut holder = ChildGuard::spawn(as_user(&mut cmd, uid, gid));
    let mut line = String::new();
    BufReader::new(holder.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "held", "the holder could not connect");
    holder
}

fn daemon(max: &str, per_user: &str) -> Daemon {
    Daemon::start_with(DaemonOptions {
        group: Some(users::GROUP.into()),
        args: [
            "--max-connections",
            max,
            "--max-connections-per-user",
            per_user,
        ]
        .map(String::from)
        .to_vec(),
        ..DaemonOptions::default()
    })
}

#[test]
fn a_user_at_its_cap_is_refused_and_root_still_served() {
    if !root_or_skip() {
        return;
    }
    let Some((uid, gid)) = users::member() else {
        tracer_testkit::skip(format_args!(
            "could not create test users (useradd/groupadd missing)"
        ));
        return;
    };
    let d = daemon("8", "3");
    let ctl = public_ctl(&d);
    let member = |args: &[&str]| {
        let mut cmd = Command::new(&ctl);
        cmd.arg("--socket").arg(&d.socket).args(args);
        output_within(as_user(&mut cmd, uid, gid), 20)
    };
    // A refusal said once, not "permission denied: permission denied: …".
    let line = one_line_error(&member(&["start", "--mode=counting", "--pid", "1"]));
    assert!(
        line.contains(&format!("uid {uid} may not trace pid 1")),
        "{line}"
    );
    assert_eq!(line.matches("permission denied").count(), 1, "{line}");

    let holder = hold_connections(&d, uid, gid, 3);
    let line = one_line_error(&member(&["list"]));
    assert!(
        line.contains(&format!(
            "too many connections from uid {uid}: 3 open, at most 3 per user"
        )),
        "{line}"
    );
    let root = output_within(d.ctl().arg("list"), 20);
    assert!(root.status.success(), "{root:?}");
    // Closed connections are given back.
    drop(holder);
    wait_until(20, "the member to be served again", || {
        member(&["list"]).status.success()
    });
}

#[test]
fn the_last_connections_are_kept_for_root() {
    if !root_or_skip() {
        return;
    }
    let Some((uid, gid)) = users::member() else {
        tracer_testkit::skip(format_args!(
            "could not create test users (useradd/groupadd missing)"
        ));
        return;
    };
    // 4 in all, the last one root's: the member may hold 3.
    let d = daemon("4", "4");
    let ctl = public_ctl(&d);
    let _holder = hold_connections(&d, uid, gid, 3);
    let mut cmd = Command::new(&ctl);
    cmd.arg("--socket").arg(&d.socket).arg("list");
    let line = one_line_error(&output_within(as_user(&mut cmd, uid, gid), 20));
    assert!(
        line.contains("tracerd has 3 of its 4 connections open and keeps the last 1 for root"),
        "{line}"
    );
    let root = output_within(d.ctl().arg("list"), 20);
    assert!(root.status.success(), "{root:?}");
}

#[test]
fn idle_connections_are_closed_and_busy_ones_kept() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start_with(DaemonOptions {
        args: vec!["--idle-timeout".into(), "1".into()],
        ..DaemonOptions::default()
    });
    let mut idle = UnixStream::connect(&d.socket).unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut buf = [0u8; 64];
    // The server's HTTP/2 preface may come first; then the end of the stream.
    let closed = loop {
        match idle.read(&mut buf) {
            Ok(0) => break true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break true,
            Err(_) => break false,
        }
    };
    assert!(closed, "an idle connection was not closed within 20 s");
    // A request in flight for longer than the idle timeout is not cut.
    let sleeper = ChildGuard::spawn(Command::new("sleep").arg("60"));
    let report = d.ok(&[
        "start",
        "--mode=counting",
        "--events",
        "task-clock",
        "--pid",
        &sleeper.pid().to_string(),
        "--duration",
        "3s",
        "--wait",
    ]);
    assert!(report.contains("duration reached"), "{report}");
}

#[test]
fn bad_connection_flags_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (flag, value, want) in [
        (
            "--max-connections",
            "1",
            "--max-connections wants 2 to 1000000",
        ),
        (
            "--max-connections-per-user",
            "0",
            "--max-connections-per-user 1 to",
        ),
        (
            "--idle-timeout",
            "0",
            "--idle-timeout wants 1 to 86400 seconds, got 0",
        ),
    ] {
        let out = Command::new(tracer_tests::bin("tracerd"))
            .arg("--socket")
            .arg(dir.path().join("s.sock"))
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args([flag, value])
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{flag}: {err}");
    }
}
