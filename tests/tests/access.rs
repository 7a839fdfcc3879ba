//! Access control: the socket admits root and one group; SO_PEERCRED decides what a caller
//! may trace. Runs tracerctl as real unprivileged users.

use std::{os::unix::fs::PermissionsExt, path::PathBuf, process::Command};

use tracer_tests::{
    one_line_error, root_or_skip,
    users::{as_user, public_ctl, GROUP, MEMBER},
    ChildGuard, Daemon, DaemonOptions,
};
const OUTSIDER: &str = "tracer-test-outsider";

/// (uid, gid) of a user.
type Ids = (u32, u32);

/// The group member's ids, the outsider's ids (a user not in the group), and the group's gid;
/// None where the tools to make them are missing.
fn users() -> Option<(Ids, Ids, u32)> {
    let (m_uid, gid) = tracer_tests::users::member()?;
    if nix::unistd::User::from_name(OUTSIDER).ok()?.is_none() {
        Command::new("useradd")
            .args(["--no-create-home", "--shell", "/usr/sbin/nologin", OUTSIDER])
            .status()
            .ok()?;
    }
    let member = nix::unistd::User::from_name(MEMBER).ok()??;
    let outsider = nix::unistd::User::from_name(OUTSIDER).ok()??;
    Some((
        (m_uid, member.gid.as_raw()),
        (outsider.uid.as_raw(), outsider.gid.as_raw()),
        gid,
    ))
}

/// tracerd admitting the test group (with `args`), tracerctl where the member can run it,
/// and the member's uid and the group's gid; None (said) where the users cannot be made.
fn member_daemon(args: &[&str]) -> Option<(Daemon, PathBuf, u32, u32)> {
    let Some(((m_uid, _), _, gid)) = users() else {
        tracer_testkit::skip(format_args!(
            "could not create test users (useradd/groupadd missing)"
        ));
        return None;
    };
    let d = Daemon::start_with(DaemonOptions {
        group: Some(GROUP.into()),
        args: args.iter().map(|a| a.to_string()).collect(),
        ..DaemonOptions::default()
    });
    let ctl = public_ctl(&d);
    Some((d, ctl, m_uid, gid))
}

#[test]
fn the_socket_and_the_callers_uid_decide() {
    if !root_or_skip() {
        return;
    }
    let Some(((m_uid, _), (o_uid, o_gid), gid)) = users() else {
        tracer_testkit::skip(format_args!(
            "could not create test users (useradd/groupadd missing)"
        ));
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

    // Root's sessions are not its business, nor is whether they exist: the answers are those
    // for an id nobody has.
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
        vec!["delete", root_session.as_str()],
    ] {
        let line = one_line_error(&member(&args));
        let made_up = "0123456789ab";
        let none = one_line_error(&member(&[args[0], made_up]));
        assert!(line.contains("no session with id"), "{line}");
        assert_eq!(line.replace(&root_session, made_up), none);
    }
    let listed = String::from_utf8(member(&["list"]).stdout).unwrap();
    assert!(!listed.contains(&root_session), "{listed}");
    assert!(d.ok(&["list"]).contains(&root_session));
}

/// A process of `uid` (sleep 60), for a member to attach to.
fn sleeper_of(uid: u32, gid: u32) -> ChildGuard {
    let mut cmd = Command::new("sleep");
    cmd.arg("60");
    ChildGuard::spawn(as_user(&mut cmd, uid, gid))
}

/// A copy of `program` in `dir` named `name`, with `mode` (setuid and setgid bits included),
/// owned by root.
fn copy_with_mode(program: &str, dir: &std::path::Path, name: &str, mode: u32) -> PathBuf {
    let path = dir.join(name);
    std::fs::copy(program, &path).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path
}

/// The kernel refuses ptrace across a gain of credentials, and so does tracer for an
/// unprivileged user: a launched command that execs a setuid or setgid program stops being
/// followed before the program runs (it runs as ever, and the report says why); a process
/// running setgid or not dumpable is refused by pid. Root may trace them all.
#[test]
fn credentials_gained_at_exec_are_not_traced() {
    if !root_or_skip() {
        return;
    }
    let Some((d, ctl, m_uid, gid)) = member_daemon(&[]) else {
        return;
    };
    let member = |args: &[&str]| d.run_as(m_uid, gid, args, &ctl);
    let dir = d.dir.path();
    // id(1) asks geteuid: counted while the program is followed.
    let programs = [
        (copy_with_mode("/usr/bin/id", dir, "id-plain", 0o755), None),
        (
            copy_with_mode("/usr/bin/id", dir, "id-setuid", 0o4755),
            Some(("euid=0", "it runs as uid 0")),
        ),
        (
            copy_with_mode("/usr/bin/id", dir, "id-setgid", 0o2755),
            Some(("egid=0", "setgid program")),
        ),
    ];
    for (program, gains) in &programs {
        let p = program.to_str().unwrap();
        let start = [
            "start",
            "--mode=counting",
            "--uprobe",
            "libc:geteuid",
            "--format",
            "json",
            "--",
            p,
        ];
        let out = member(&start);
        assert!(
            out.status.success(),
            "{p}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout).unwrap();
        // The program's own line, then the report.
        let (printed, json) = stdout.split_once("\n{").unwrap();
        let report: serde_json::Value = serde_json::from_str(&format!("{{{json}")).unwrap();
        let calls: u64 = report["native"]["calls"]
            .as_array()
            .map(|c| c.iter().map(|c| c["calls"].as_u64().unwrap()).sum())
            .unwrap_or(0);
        let unfollowed = &report["processes"]["unfollowed"];
        assert!(printed.contains(&format!("uid={m_uid}")), "{p}: {printed}");
        match gains {
            None => {
                assert!(calls >= 1, "{p}: {report}");
                assert!(unfollowed.is_null(), "{p}: {unfollowed}");
            }
            Some((privilege, why)) => {
                assert!(printed.contains(privilege), "{p}: {printed}");
                assert_eq!(calls, 0, "{p}: {report}");
                let name = program.file_name().unwrap().to_str().unwrap();
                let note = unfollowed[0].as_str().unwrap_or_default();
                assert!(
                    note.contains(&format!("exec'd {name}")) && note.contains(why),
                    "{p}: {unfollowed}"
                );
                // Root's session follows it through the exec.
                let root: serde_json::Value = {
                    let out = d.ok(&start);
                    let (_, json) = out.split_once("\n{").unwrap();
                    serde_json::from_str(&format!("{{{json}")).unwrap()
                };
                assert!(
                    root["native"]["calls"][0]["calls"].as_u64() >= Some(1),
                    "{root}"
                );
            }
        }
    }
    // By pid: a process running setgid, and one that made itself not dumpable.
    let setgid_sleep = copy_with_mode("/bin/sleep", dir, "sleep-setgid", 0o2755);
    let mut cmd = Command::new(&setgid_sleep);
    cmd.arg("60");
    let sleeper = ChildGuard::spawn(as_user(&mut cmd, m_uid, gid));
    let undumpable = "import ctypes, time\nctypes.CDLL(None).prctl(4, 0, 0, 0, 0)\nprint('ready', flush=True)\ntime.sleep(60)";
    let mut cmd = Command::new("/usr/bin/python3");
    cmd.args(["-c", undumpable]);
    let guarded = ChildGuard::spawn_ready(as_user(&mut cmd, m_uid, gid));
    for (pid, why) in [
        (sleeper.pid(), "setgid program"),
        (guarded.pid(), "not dumpable"),
    ] {
        let line = one_line_error(&member(&[
            "start",
            "--mode=counting",
            "--pid",
            &pid.to_string(),
        ]));
        assert!(
            line.contains(&format!("uid {m_uid} may not trace pid {pid}")) && line.contains(why),
            "{line}"
        );
    }
}

/// A counting session of task-clock on `sh -c CMD`, its report as JSON on stdout.
fn counting_task_clock(cmd: &str) -> [&str; 10] {
    [
        "start",
        "--mode=counting",
        "--events",
        "task-clock",
        "--format",
        "json",
        "--",
        "/bin/sh",
        "-c",
        cmd,
    ]
}

/// perf counters follow a launched command's children by inheritance, and the kernel ends a
/// task's counters, inherited ones too, when it gains credentials at exec (it calls
/// `perf_event_exit_task` when the new image is not dumpable by its user). So a member's
/// session does not count a setuid child's work while the parent it inherited from lives on,
/// and root's, for which the exec changes nothing, does.
#[test]
fn counters_stop_at_a_childs_gain_of_credentials() {
    if !root_or_skip() {
        return;
    }
    let Some((d, ctl, m_uid, gid)) = member_daemon(&[]) else {
        return;
    };
    let dir = d.dir.path();
    // yes(1) writing to /dev/null keeps a CPU busy for the second timeout(1) gives it, while
    // the shell and timeout, its followed parents, wait. tracerctl exits as the command does,
    // and timeout(1) with 124.
    let busy = |program: &PathBuf| format!("timeout 1 {} >/dev/null; exit 0", program.display());
    let task_clock = |out: std::process::Output| -> (u64, serde_json::Value) {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout).unwrap();
        let report: serde_json::Value =
            serde_json::from_str(&stdout[stdout.find('{').unwrap()..]).unwrap();
        (
            tracer_tests::counter(&report, "task-clock").unwrap(),
            report,
        )
    };
    let plain = copy_with_mode("/usr/bin/yes", dir, "yes-plain", 0o755);
    let setuid = copy_with_mode("/usr/bin/yes", dir, "yes-setuid", 0o4755);
    let (plain, setuid) = (busy(&plain), busy(&setuid));
    let (counted, _) = task_clock(d.run_as(m_uid, gid, &counting_task_clock(&plain), &ctl));
    let (uncounted, report) = task_clock(d.run_as(m_uid, gid, &counting_task_clock(&setuid), &ctl));
    let (root, _) = task_clock(d.run(&counting_task_clock(&setuid)));
    println!(
        "task-clock ns: member plain {counted}, member setuid {uncounted}, root setuid {root}"
    );
    let unfollowed = &report["processes"]["unfollowed"];
    assert!(
        unfollowed[0]
            .as_str()
            .is_some_and(|n| n.contains("exec'd yes-setuid")),
        "{unfollowed}"
    );
    // A busy second is at least 400 ms of CPU even on a loaded machine; the shell and
    // timeout(1) alone take a few ms.
    assert!(counted >= 400_000_000, "member, plain yes: {counted} ns");
    assert!(root >= 400_000_000, "root, setuid yes: {root} ns");
    assert!(
        uncounted < 150_000_000,
        "member, setuid yes: {uncounted} ns"
    );
}

/// One StartSession naming one function thousands of times (which once took ~93 s to attach
/// and stalled the machine) gets one probe; a session and a user have caps on probes.
#[test]
fn probe_floods_are_merged_and_capped() {
    if !root_or_skip() {
        return;
    }
    let Some((d, ctl, m_uid, gid)) = member_daemon(&[
        "--max-probes-per-session",
        "5",
        "--max-probes-per-user",
        "6",
    ]) else {
        return;
    };
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

/// A user other than root runs a share of the session slots (which once let a member take all
/// 8 Python slots, and all 64 following slots, and root got RESOURCE_EXHAUSTED): the quota
/// refuses it, and root still has room.
#[test]
fn a_user_cannot_take_every_session_slot() {
    if !root_or_skip() {
        return;
    }
    let Some((d, ctl, m_uid, gid)) = member_daemon(&[]) else {
        return;
    };
    let member = |args: &[&str]| d.run_as(m_uid, gid, args, &ctl);
    let mut cmd = Command::new("/usr/bin/python3");
    cmd.args(["-c", "import time; time.sleep(120)"]);
    let sleeper = ChildGuard::spawn(as_user(&mut cmd, m_uid, gid));
    let pid = sleeper.pid().to_string();
    // Past start-up: its interpreter is mapped.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let python = ["start", "--mode=counting", "--python", "--pid", &pid];
    let plain = ["start", "--mode=counting", "--pid", &pid];
    let started = |out: std::process::Output| {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    for _ in 0..4 {
        started(member(&python));
    }
    let line = one_line_error(&member(&python));
    assert!(
        line.contains(&format!(
            "uid {m_uid} runs 4 sessions counting Python already"
        )),
        "{line}"
    );
    // Root takes the other Python slots.
    for _ in 0..4 {
        d.ok(&python);
    }
    for _ in 0..12 {
        started(member(&plain));
    }
    let line = one_line_error(&member(&plain));
    assert!(
        line.contains(&format!("uid {m_uid} runs 16 sessions already")),
        "{line}"
    );
    d.ok(&plain);
    assert!(d.ok(&["capabilities"]).contains("kept for root"));
    let listed = d.ok(&["list"]);
    assert_eq!(listed.matches("running").count(), 21, "{listed}");
}

fn args(a: &[String]) -> Vec<&str> {
    a.iter().map(String::as_str).collect()
}

/// What root keeps from others stays hidden from a group member: the functions of a library
/// only root may read (and whether such a file exists at all), and kernel addresses where the
/// kernel shows the member zeros in /proc/kallsyms (names are shown).
#[test]
fn root_only_files_and_kernel_addresses_stay_hidden() {
    if !root_or_skip() {
        return;
    }
    let Some((d, ctl, m_uid, gid)) = member_daemon(&[]) else {
        return;
    };
    let member = |args: &[&str]| d.run_as(m_uid, gid, args, &ctl);
    let dir = d.dir.path();
    let libc = std::fs::canonicalize("/lib/x86_64-linux-gnu/libc.so.6").unwrap();
    let libc = libc.to_str().unwrap();
    let secret = copy_with_mode(libc, dir, "secret.so", 0o600);
    let shared = copy_with_mode(libc, dir, "shared.so", 0o644);
    let not_elf = dir.join("notelf.so");
    std::fs::write(&not_elf, b"not an ELF file").unwrap();
    std::fs::set_permissions(&not_elf, std::fs::Permissions::from_mode(0o600)).unwrap();
    let missing = dir.join("missing.so");
    let start = |lib: &std::path::Path| {
        let spec = format!("{}:getpid", lib.display());
        ["start", "--mode=counting", "--uprobe", &spec, "--", "true"].map(String::from)
    };
    // The same words for a root-only library, a root-only file that is no ELF, and no file.
    let mut refusals = Vec::new();
    for lib in [&secret, &not_elf, &missing] {
        let line = one_line_error(&member(&args(&start(lib))));
        assert!(
            line.contains(&format!("uid {m_uid} can read no library")),
            "{line}"
        );
        refusals.push(line.replace(lib.file_name().unwrap().to_str().unwrap(), "LIB"));
    }
    assert!(refusals.windows(2).all(|w| w[0] == w[1]), "{refusals:?}");
    // A file the member may read, it may probe; root may probe the secret one.
    let out = member(&args(&start(&shared)));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    d.ok(&args(&start(&secret)));

    // Kernel frames: named for both, addresses for root only (unless the member's kallsyms
    // shows them too).
    let kallsyms_for_member = {
        let sysctl = |n: &str| std::fs::read_to_string(format!("/proc/sys/kernel/{n}")).unwrap();
        sysctl("kptr_restrict").trim() == "0"
            && sysctl("perf_event_paranoid").trim().parse::<i32>().unwrap() <= 1
    };
    let busy = "import os\nfor _ in range(300000): os.stat('/')";
    let sample = [
        "start",
        "--mode=sampling",
        "--frequency",
        "499",
        "--format",
        "json",
        "--",
        "/usr/bin/python3",
        "-c",
        busy,
    ];
    let kernel_frames = |json: &[u8]| -> Vec<(String, u64)> {
        let report: serde_json::Value = serde_json::from_slice(json).unwrap();
        report["profile"]["stacks"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|s| s["frames"].as_array().unwrap().clone())
            .filter(|f| f["kind"] == "kernel")
            .map(|f| {
                (
                    f["name"].as_str().unwrap().to_owned(),
                    f["address"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let out = member(&sample);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let theirs = kernel_frames(&out.stdout);
    let ours = kernel_frames(d.ok(&sample).as_bytes());
    assert!(
        !theirs.is_empty() && !ours.is_empty(),
        "{theirs:?} {ours:?}"
    );
    assert!(
        theirs.iter().all(|(name, _)| !name.is_empty()),
        "{theirs:?}"
    );
    assert!(ours.iter().all(|&(_, a)| a != 0), "{ours:?}");
    if !kallsyms_for_member {
        assert!(theirs.iter().all(|&(_, a)| a == 0), "{theirs:?}");
    }
}

/// Losses counted in other users' processes stay out of a group member's report (its
/// sessions report those of the processes they follow; root's, the machine's).
#[test]
fn a_members_report_holds_only_its_own_losses() {
    if !root_or_skip() {
        return;
    }
    let Some((d, ctl, m_uid, gid)) = member_daemon(&[]) else {
        return;
    };
    let member = |args: &[&str]| d.run_as(m_uid, gid, args, &ctl);
    // Root's process recurses deeper than the probes' stacks: calls past their depth are
    // losses (the probes', so both count with them rather than in-process).
    let busy = "import sys\nsys.setrecursionlimit(5000)\ndef r(n): return r(n - 1) if n else 0\nprint('ready', flush=True)\nwhile True: r(400)";
    let root_busy = ChildGuard::spawn_ready(Command::new("/usr/bin/python3").args(["-c", busy]));
    let mut cmd = Command::new("/usr/bin/python3");
    cmd.args(["-c", "import time; time.sleep(60)"]);
    let idle = ChildGuard::spawn(as_user(&mut cmd, m_uid, gid));
    std::thread::sleep(std::time::Duration::from_millis(300));
    let root_id = d
        .ok(&[
            "start",
            "--mode=counting",
            "--python",
            "--pid",
            &root_busy.pid().to_string(),
            "--python-uprobes-only",
            "--duration",
            "3s",
        ])
        .trim()
        .to_owned();
    let out = member(&[
        "start",
        "--mode=counting",
        "--python",
        "--pid",
        &idle.pid().to_string(),
        "--duration",
        "1s",
        "--wait",
        "--format",
        "json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let theirs: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // A member's own running 3.11 is loaded into with ptrace, as its ptrace rule allows.
    let way = &theirs["python"]["counted"][0];
    assert_eq!(way["way"], "in-process", "{way}");
    assert!(way["why"].as_str().unwrap().contains("ptrace"), "{way}");
    d.ok(&["stop", &root_id]);
    let ours: serde_json::Value = d.report_json(&root_id);
    let too_deep = |r: &serde_json::Value| {
        r["losses"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| l["cause"] == "python_stack_too_deep_untimed")
            .map(|l| l["count"].as_u64().unwrap())
            .sum::<u64>()
    };
    assert!(too_deep(&ours) > 1000, "{}", ours["losses"]);
    assert_eq!(too_deep(&theirs), 0, "{}", theirs["losses"]);
    // Its own process's losses, it is told of.
    let mut cmd = Command::new("/usr/bin/python3");
    cmd.args(["-c", busy]);
    let deep = ChildGuard::spawn_ready(as_user(&mut cmd, m_uid, gid));
    let out = member(&[
        "start",
        "--mode=counting",
        "--python",
        "--pid",
        &deep.pid().to_string(),
        "--python-uprobes-only",
        "--duration",
        "1s",
        "--wait",
        "--format",
        "json",
    ]);
    let own: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(too_deep(&own) > 1000, "{}", own["losses"]);
}
