//! Access control: the socket admits root and one group; SO_PEERCRED decides what a caller
//! may trace. Runs tracerctl as real unprivileged users.

use std::{os::unix::fs::PermissionsExt, path::PathBuf, process::Command};

use tracer_tests::{bin, one_line_error, root_or_skip, ChildGuard, Daemon, DaemonOptions};

const GROUP: &str = "tracer-test";
const MEMBER: &str = "tracer-test-member";
const OUTSIDER: &str = "tracer-test-outsider";

fn ensure_user(name: &str, group: Option<&str>) -> Option<Ids> {
    let u = nix::unistd::User::from_name(name).ok()??;
    if let Some(g) = group {
        let _ = Command::new("usermod").args(["-a", "-G", g, name]).status();
    }
    Some((u.uid.as_raw(), u.gid.as_raw()))
}

/// Creates the test group and users when missing (useradd/groupadd, as root).
/// (uid, gid) of a user.
type Ids = (u32, u32);

/// The group member's ids, the outsider's ids, and the group's gid.
fn users() -> Option<(Ids, Ids, u32)> {
    if nix::unistd::Group::from_name(GROUP).ok()?.is_none() {
        Command::new("groupadd").arg(GROUP).status().ok()?;
    }
    for name in [MEMBER, OUTSIDER] {
        if nix::unistd::User::from_name(name).ok()?.is_none() {
            Command::new("useradd")
                .args(["--no-create-home", "--shell", "/usr/sbin/nologin", name])
                .status()
                .ok()?;
        }
    }
    let gid = nix::unistd::Group::from_name(GROUP).ok()??.gid.as_raw();
    let member = ensure_user(MEMBER, Some(GROUP))?;
    let outsider = ensure_user(OUTSIDER, None)?;
    Some((member, outsider, gid))
}

/// tracerctl copied where any user can run it (the build tree may sit under a private home).
fn public_ctl(d: &Daemon) -> PathBuf {
    let path = d.dir.path().join("tracerctl");
    std::fs::copy(bin("tracerctl"), &path).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

#[test]
fn the_socket_and_the_callers_uid_decide() {
    if !root_or_skip() {
        return;
    }
    let Some(((m_uid, _), (o_uid, o_gid), gid)) = users() else {
        println!("skipping: could not create test users (useradd/groupadd missing)");
        return;
    };
    let d = Daemon::start_with(DaemonOptions {
        group: Some(GROUP.into()),
        ..DaemonOptions::default()
    });
    let ctl = public_ctl(&d);
    let meta = std::fs::metadata(&d.socket).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    assert_eq!(std::os::unix::fs::MetadataExt::gid(&meta), gid);

    // Not in the group: the socket itself refuses.
    let line = one_line_error(&d.run_as(o_uid, o_gid, &["list"], &ctl));
    assert!(line.contains("permission denied on"), "{line}");

    // In the group: may list, but not trace the whole machine or another user's process.
    let member = |args: &[&str]| d.run_as(m_uid, gid, args, &ctl);
    assert!(member(&["list"]).status.success());
    let line = one_line_error(&member(&["start", "--mode=counting", "--all"]));
    assert!(line.contains("only root may start system-wide"), "{line}");
    let line = one_line_error(&member(&["start", "--mode=counting", "--pid", "1"]));
    assert!(
        line.contains(&format!("uid {m_uid} may not trace pid 1")),
        "{line}"
    );

    // Its own processes, yes: a command it launches runs with its uid.
    let out = member(&[
        "start",
        "--mode=counting",
        "--events",
        "task-clock",
        "--",
        "true",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("task-clock"));

    // Root's sessions are not its business.
    let sleeper = ChildGuard::spawn(Command::new("sleep").arg("60"));
    let root_session = d
        .ok(&[
            "start",
            "--mode=counting",
            "--pid",
            &sleeper.pid().to_string(),
        ])
        .trim()
        .to_owned();
    for args in [
        vec!["stop", root_session.as_str()],
        vec!["report", root_session.as_str()],
        vec!["status", root_session.as_str()],
    ] {
        let line = one_line_error(&member(&args));
        assert!(
            line.contains(&format!("session {root_session} belongs to uid 0")),
            "{line}"
        );
    }
    let listed = String::from_utf8(member(&["list"]).stdout).unwrap();
    assert!(!listed.contains(&root_session), "{listed}");
    assert!(d.ok(&["list"]).contains(&root_session));
}

/// A process of `uid` (sleep 60), for a member to attach to.
fn sleeper_of(uid: u32, gid: u32) -> ChildGuard {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new("sleep");
    cmd.arg("60");
    // SAFETY: only async-signal-safe syscalls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            nix::unistd::setgroups(&[nix::unistd::Gid::from_raw(gid)])?;
            nix::unistd::setgid(nix::unistd::Gid::from_raw(gid))?;
            nix::unistd::setuid(nix::unistd::Uid::from_raw(uid))?;
            Ok(())
        });
    }
    ChildGuard::spawn(&mut cmd)
}

/// One StartSession naming one function thousands of times (which once took ~93 s to attach
/// and stalled the machine) gets one probe; a session and a user have caps on probes.
#[test]
fn probe_floods_are_merged_and_capped() {
    if !root_or_skip() {
        return;
    }
    let Some(((m_uid, _), _, gid)) = users() else {
        println!("skipping: could not create test users (useradd/groupadd missing)");
        return;
    };
    let d = Daemon::start_with(DaemonOptions {
        group: Some(GROUP.into()),
        args: [
            "--max-probes-per-session",
            "5",
            "--max-probes-per-user",
            "6",
        ]
        .map(String::from)
        .to_vec(),
        ..DaemonOptions::default()
    });
    let ctl = public_ctl(&d);
    let member = |args: &[&str]| d.run_as(m_uid, gid, args, &ctl);
    let caps = String::from_utf8(d.ok(&["capabilities"]).into_bytes()).unwrap();
    assert!(
        caps.contains("at most 5 functions a session and 6 a user")
            && caps.contains("traps in every process that maps it"),
        "{caps}"
    );

    // 3,000 names for getpid, three spellings of its library: one probe, every call counted.
    let mut args = vec!["start", "--mode=counting", "--format", "json"];
    for i in 0..3000 {
        args.push("--uprobe");
        args.push(["libc:getpid", "libc.so.6:getpid", "c:getpid"][i % 3]);
    }
    let program = "import os\nfor _ in range(500): os.getpid()";
    args.extend(["--", "/usr/bin/python3", "-c", program]);
    let out = member(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let native = &report["native"];
    assert_eq!(native["probes"].as_array().unwrap().len(), 1, "{native}");
    let calls: u64 = native["calls"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["symbol"] == "getpid")
        .map(|c| c["calls"].as_u64().unwrap())
        .sum();
    assert!(calls >= 500, "{native}");

    // Past the session's cap: refused before anything is attached.
    let line = one_line_error(&member(&[
        "start",
        "--mode=counting",
        "--uprobe",
        "libc:getp*",
        "--",
        "true",
    ]));
    assert!(line.contains("at most 5 a session"), "{line}");

    // Past the user's cap, counting what its running sessions hold; root's are its own.
    let own = sleeper_of(m_uid, gid);
    let four = [
        "--uprobe",
        "libc:getpid",
        "--uprobe",
        "libc:getppid",
        "--uprobe",
        "libc:getuid",
        "--uprobe",
        "libc:getgid",
    ];
    let pid = own.pid().to_string();
    let mut held = vec![
        "start",
        "--mode=counting",
        "--pid",
        &pid,
        "--duration",
        "1h",
    ];
    held.extend(four);
    let out = member(&held);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    let mut more = held.clone();
    more.truncate(6);
    more.extend(&four[..6]);
    let line = one_line_error(&member(&more));
    assert!(
        line.contains("holds 4 native probes") && line.contains("the 6 a user may hold"),
        "{line}"
    );
    let roots = ChildGuard::spawn(Command::new("sleep").arg("60"));
    let root_pid = roots.pid().to_string();
    let mut by_root = vec![
        "start",
        "--mode=counting",
        "--pid",
        &root_pid,
        "--duration",
        "1h",
    ];
    by_root.extend(four);
    let root_session = d.ok(&by_root).trim().to_owned();
    assert!(member(&["stop", &first]).status.success());
    let out = member(&more);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let second = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert!(member(&["stop", &second]).status.success());
    d.ok(&["stop", &root_session]);
}
