//! In-process counting under attack from the counted process's own user (docs/SECURITY.md,
//! "Code tracer loads into a process"): everything in the counter's directory is that user's
//! to change, so tracerd must ask no other process to run anything from it, must read it
//! within bounds and off the task that answers everyone, must make nothing outside the
//! process's own `/tmp`, and must leave nothing behind, a SIGKILL included. Each case runs as
//! the test group's member, or as root counting the member's process.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use serde_json::Value;
use tracer_tests::{
    chroot_interpreters, interpreters, root_or_skip,
    users::{member, public_ctl, GROUP},
    wait_until, ChildGuard, Daemon, DaemonOptions,
};

/// Python that becomes `uid`:`gid` and stays dumpable (as a program started by that user
/// is), so that the member may trace it; run as root through the chroot's wrapper.
fn become_user(uid: u32, gid: u32) -> String {
    format!(
        "import os, ctypes\n\
         os.setgroups([{gid}]); os.setgid({gid}); os.setuid({uid})\n\
         ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)\n"
    )
}

/// Python run as `uid`:`gid` that calls `fib(10)` until `go` exists (printing `ready` first),
/// then runs `then`.
fn member_script(uid: u32, gid: u32, go: &Path, then: &str) -> String {
    format!(
        "{become}\
         import glob, os, time\n\
         def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\
         print('ready', flush=True)\n\
         while not os.path.exists({go:?}):\n    fib(10); time.sleep(0.001)\n\
         {then}",
        become = become_user(uid, gid),
    )
}

/// A directory in the daemon's where the member's processes may write (their signals to the
/// test).
fn shared_dir(d: &Daemon) -> PathBuf {
    let dir = d.dir.path().join("shared");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    dir
}

/// A CPython 3.14+ running `code`, which prints `ready` once set: the child and its pid.
fn spawn_ready(py: &Path, code: &str) -> (ChildGuard, u32) {
    let child = ChildGuard::spawn_ready(Command::new(py).arg("-c").arg(code));
    let pid = child.pid();
    (child, pid)
}

/// The session's JSON report once it has ended.
fn report(d: &Daemon, id: &str) -> Value {
    wait_until(30, "the session to end", || {
        let s = d.ok(&["status", id]);
        s.contains("finished") || s.contains("failed")
    });
    d.report_json(id)
}

fn warnings(report: &Value) -> Vec<String> {
    report["python"]["warnings"]
        .as_array()
        .map(|w| {
            w.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn counted_way(report: &Value, pid: u32) -> (String, String) {
    let c = report["python"]["counted"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["pid"].as_u64() == Some(u64::from(pid))))
        .unwrap_or_else(|| panic!("no counted entry for {pid}: {}", report["python"]));
    (
        c["way"].as_str().unwrap().to_owned(),
        c["why"].as_str().unwrap().to_owned(),
    )
}

/// The 3.14+ interpreter and the member's (uid, gid); None (said) where either is missing.
fn setup() -> Option<(PathBuf, u32, u32)> {
    if !root_or_skip() {
        return None;
    }
    let py = chroot_interpreters().into_iter().next()?;
    let Some((uid, gid)) = member() else {
        tracer_testkit::skip(format_args!(
            "could not create test users (useradd/groupadd missing)"
        ));
        return None;
    };
    Some((py, uid, gid))
}

/// Starts a counting session on `pid`, as the member (`as_member`) or as root.
fn start(d: &Daemon, ctl: &Path, ids: (u32, u32), as_member: bool, pid: u32) -> String {
    let pid = pid.to_string();
    let args = ["start", "--mode=counting", "--python", "--pid", &pid];
    let out = if as_member {
        d.run_as(ids.0, ids.1, &args, ctl)
    } else {
        d.run(&args)
    };
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// The member's process plants, in its own counter directory, a counts file naming a root
/// process it may not trace and a payload where the removal script for that process would
/// go. Neither the root process nor any other runs the payload; the report says what was
/// refused.
#[test]
fn a_forged_child_file_runs_nothing_anywhere() {
    let Some((py, uid, gid)) = setup() else {
        return;
    };
    let d = Daemon::start_with(DaemonOptions {
        group: Some(GROUP.into()),
        ..DaemonOptions::default()
    });
    let ctl = public_ctl(&d);
    for as_member in [true, false] {
        let marker = d.dir.path().join(format!("payload-ran-{as_member}"));
        let stop = d.dir.path().join(format!("stop-{as_member}"));
        // The victim: root's, busy, taking requests at every safe point.
        let victim_code = format!(
            "import os\n\
             def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\
             print('ready', flush=True)\n\
             while not os.path.exists({stop:?}):\n    fib(12)\n"
        );
        let (mut victim, victim_pid) = spawn_ready(&py, &victim_code);
        let plant = shared_dir(&d).join(format!("plant-{as_member}"));
        let planted = shared_dir(&d).join(format!("planted-{as_member}"));
        let attacker_code = format!(
            "{become}\
             import glob, os, time\n\
             def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\
             print('ready', flush=True)\n\
             while not os.path.exists({plant:?}):\n    fib(10); time.sleep(0.001)\n\
             me = glob.glob(f'/tmp/tracer-*-{{os.getpid()}}/counts.{{os.getpid()}}')[0]\n\
             d = os.path.dirname(me)\n\
             with open(me, 'rb') as f:\n    head = bytearray(f.read(4096))\n\
             head[12:16] = (1).to_bytes(4, 'little')\n\
             head[24:28] = ({victim_pid}).to_bytes(4, 'little')\n\
             forged = os.path.join(d, 'counts.{victim_pid}')\n\
             with open(forged, 'wb') as f:\n    f.write(head)\n\
             os.truncate(forged, os.path.getsize(me))\n\
             with open(os.path.join(d, 'remove.{victim_pid}.py'), 'w') as f:\n    f.write('open({marker:?}, \"w\").close()\\n')\n\
             open({planted:?}, 'w').close()\n\
             while not os.path.exists({stop:?}):\n    fib(10); time.sleep(0.001)\n",
            become = become_user(uid, gid),
            marker = marker.display().to_string(),
            planted = planted.display().to_string(),
        );
        let (mut attacker, attacker_pid) = spawn_ready(&py, &attacker_code);
        let id = start(&d, &ctl, (uid, gid), as_member, attacker_pid);
        std::fs::write(&plant, b"").unwrap();
        wait_until(10, "the forged file", || planted.exists());
        let out = if as_member {
            d.run_as(uid, gid, &["stop", &id], &ctl)
        } else {
            d.run(&["stop", &id])
        };
        assert!(out.status.success(), "{out:?}");
        // The victim keeps taking safe points: long enough for a request to be run.
        std::thread::sleep(Duration::from_secs(2));
        assert!(
            !marker.exists(),
            "the payload ran (member's session: {as_member})"
        );
        let r = report(&d, &id);
        assert_eq!(counted_way(&r, attacker_pid).0, "in-process");
        let said = warnings(&r);
        assert!(
            said.iter().any(|w| w.contains("does not follow")
                && w.contains(&format!("counts.{victim_pid} names pid {victim_pid}"))),
            "{said:?}"
        );
        std::fs::write(&stop, b"").unwrap();
        assert!(victim.0.wait().unwrap().success());
        assert!(attacker.0.wait().unwrap().success());
        assert!(!marker.exists());
    }
}

/// tracerd's peak resident memory, in KiB.
fn peak_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

/// The member's process points every name of its counts file at the whole strings area (a
/// terabyte of names, read naively), leaves its busy flag set, and fills its directory with
/// two thousand copies (files of processes that exited, as far as tracerd can tell), busy
/// too. tracerd reads within its bounds (its memory grows by far less than a gigabyte),
/// answers `list` while the session ends, and says what it did not read.
#[test]
fn forged_names_and_busy_flags_cost_tracerd_little() {
    let Some((py, uid, gid)) = setup() else {
        return;
    };
    let d = Daemon::start_with(DaemonOptions {
        group: Some(GROUP.into()),
        ..DaemonOptions::default()
    });
    let ctl = public_ctl(&d);
    let plant = shared_dir(&d).join("plant");
    let planted = shared_dir(&d).join("planted");
    // Header: busy at 16; entries from 4096, 56 bytes each, names (offset, len) at 40 and 48.
    let then = format!(
        "me = glob.glob(f'/tmp/tracer-*-{{os.getpid()}}/counts.{{os.getpid()}}')[0]\n\
         d = os.path.dirname(me)\n\
         size = os.path.getsize(me)\n\
         big = (8 << 20) - 65536\n\
         fd = os.open(me, os.O_RDWR)\n\
         os.pwrite(fd, (1).to_bytes(4, 'little'), 16)\n\
         rec = bytearray(56)\n\
         for i in range(65536):\n\
         \x20   rec[0:8] = (0x1000 + 16 * i).to_bytes(8, 'little')\n\
         \x20   rec[8:16] = (1).to_bytes(8, 'little')\n\
         \x20   rec[40:48] = i.to_bytes(4, 'little') + big.to_bytes(4, 'little')\n\
         \x20   rec[48:56] = (i + 1).to_bytes(4, 'little') + big.to_bytes(4, 'little')\n\
         \x20   os.pwrite(fd, bytes(rec), 4096 + 56 * i)\n\
         head = bytearray(os.pread(fd, 4096, 0))\n\
         head[16:20] = (1).to_bytes(4, 'little')\n\
         for n in range(2000):\n\
         \x20   p = os.path.join(d, f'counts.{{4000000 + n}}')\n\
         \x20   with open(p, 'wb') as f:\n        f.write(head)\n\
         \x20   os.truncate(p, size)\n\
         open({planted:?}, 'w').close()\n\
         while True:\n    time.sleep(1)\n",
        planted = planted.display().to_string(),
    );
    let code = member_script(uid, gid, &plant, &then);
    let (_attacker, pid) = spawn_ready(&py, &code);
    let id = start(&d, &ctl, (uid, gid), true, pid);
    std::fs::write(&plant, b"").unwrap();
    wait_until(60, "the forged files", || planted.exists());
    let before = peak_kib(d.pid());
    let started = std::time::Instant::now();
    let (answered, _) = d.lists_answered_during(&["stop", &id]);
    println!(
        "stop took {:?}; {answered} lists answered meanwhile; tracerd's peak RSS {} -> {} KiB",
        started.elapsed(),
        before,
        peak_kib(d.pid())
    );
    assert!(answered > 0, "no list was answered while the session ended");
    let grown = peak_kib(d.pid()).saturating_sub(before);
    assert!(grown < 1 << 20, "tracerd's peak memory grew by {grown} KiB");
    let r = report(&d, &id);
    let said = warnings(&r);
    // Files of processes gone are read (a child that exited leaves one), within bounds.
    assert!(
        said.iter()
            .any(|w| w.contains("counts files past the first 1024") && w.contains("not read")),
        "{said:?}"
    );
    assert!(
        said.iter()
            .any(|w| w.contains("functions not named") || w.contains("over tracer's budget")),
        "{said:?}"
    );
    assert!(d.ok(&["list"]).contains(&id), "tracerd still serves");
}

/// A process in a user and mount namespace of its user's own, with a root-owned directory
/// bound over its `/tmp`: tracerd makes nothing there (the user could not) and counts the
/// process with uprobes, saying why.
#[test]
fn a_tmp_bound_in_a_user_namespace_gets_nothing() {
    let Some((py, uid, gid)) = setup() else {
        return;
    };
    let d = Daemon::start();
    let guarded = d.dir.path().join("root-owned");
    std::fs::create_dir(&guarded).unwrap();
    let probe = Command::new("unshare")
        .args(["-Urm", "true"])
        .stdin(Stdio::null())
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        tracer_testkit::skip(format_args!("unshare -Urm is not allowed here"));
        return;
    }
    // As the member, in a user and mount namespace of its own, where it may bind what it
    // can see over its /tmp: done by the program itself once running, so that its
    // interpreter (and the workspace, wherever it lies) was found first.
    let code = format!(
        "import ctypes, os, time\n\
         libc = ctypes.CDLL(None, use_errno=True)\n\
         if libc.mount({guarded:?}.encode(), b'/tmp', None, 4096, None) != 0:\n\
         \x20   raise OSError(ctypes.get_errno(), 'binding over /tmp')\n\
         def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\
         print('ready', flush=True)\n\
         for _ in range(3000):\n    fib(10); time.sleep(0.001)\n",
        guarded = guarded.display().to_string()
    );
    let mut cmd = Command::new("unshare");
    cmd.args(["-Urm"]).arg(&py).arg("-c").arg(&code);
    tracer_tests::users::as_user(&mut cmd, uid, gid);
    let mut child = ChildGuard::spawn_ready(&mut cmd);
    let pid = child.pid();
    let id = start(&d, Path::new(""), (uid, gid), false, pid);
    let _ = child.0.wait();
    let r = report(&d, &id);
    let (way, why) = counted_way(&r, pid);
    assert_eq!(way, "uprobes", "{why}");
    assert!(why.contains("as uid") || why.contains("/tmp"), "{why}");
    let left: Vec<_> = std::fs::read_dir(&guarded).unwrap().collect();
    assert!(
        left.is_empty(),
        "tracerd made {left:?} in a root-owned directory"
    );
}

/// tracerd SIGKILLed mid-session, then started again on the same state directory: the
/// counter's directory goes, the process's tool id is free again, and `_tracer_pycount` is
/// not left in its `sys.modules`; the program's output is its own.
#[test]
fn a_restarted_daemon_sweeps_what_a_killed_one_left() {
    let Some((py, uid, gid)) = setup() else {
        return;
    };
    let mut d = Daemon::start();
    let go = d.dir.path().join("go");
    let code = format!(
        "{become}\
         import os, sys, time\n\
         def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\
         print('ready', flush=True)\n\
         while not os.path.exists({go:?}):\n    fib(10); time.sleep(0.001)\n\
         print(sys.monitoring.get_tool(3), sys.monitoring.get_tool(4), '_tracer_pycount' in sys.modules, flush=True)\n",
        become = become_user(uid, gid),
    );
    let mut child = ChildGuard::spawn(
        Command::new(&py)
            .arg("-c")
            .arg(&code)
            .stdout(Stdio::piped()),
    );
    let mut out = std::io::BufReader::new(child.0.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line, "ready\n");
    let pid = child.pid();
    let id = start(&d, Path::new(""), (uid, gid), false, pid);
    let dir = PathBuf::from(format!("/tmp/tracer-{id}-{pid}"));
    assert!(dir.exists(), "{}", dir.display());
    let code_dir = PathBuf::from(format!("/tmp/tracer-{id}-{pid}-code"));
    assert!(code_dir.exists(), "{}", code_dir.display());
    d.kill();
    d.restart();
    wait_until(20, "the killed daemon's directories to go", || {
        !dir.exists() && !code_dir.exists()
    });
    std::fs::write(&go, b"").unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert!(child.0.wait().unwrap().success());
    assert_eq!(
        rest, "None None False\n",
        "tool ids 3 and 4, and sys.modules"
    );
}

/// A clean session leaves no `_tracer_pycount` in `sys.modules`, and its tool id free.
#[test]
fn a_clean_session_leaves_no_module_behind() {
    let Some((py, _, _)) = setup() else {
        return;
    };
    let d = Daemon::start();
    let go = d.dir.path().join("go");
    let ended = d.dir.path().join("ended");
    let code = format!(
        "import os, sys, time\n\
         def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\
         print('ready', flush=True)\n\
         while not os.path.exists({go:?}):\n    fib(10); time.sleep(0.001)\n\
         while not os.path.exists({ended:?}):\n    fib(10); time.sleep(0.001)\n\
         for _ in range(200):\n    fib(5); time.sleep(0.005)\n\
         print(sys.monitoring.get_tool(3), sys.monitoring.get_tool(4), '_tracer_pycount' in sys.modules, flush=True)\n"
    );
    let mut child = ChildGuard::spawn(
        Command::new(&py)
            .arg("-c")
            .arg(&code)
            .stdout(Stdio::piped()),
    );
    let mut out = std::io::BufReader::new(child.0.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    let pid = child.pid();
    let id = start(&d, Path::new(""), (0, 0), false, pid);
    std::fs::write(&go, b"").unwrap();
    d.ok(&["stop", &id]);
    std::fs::write(&ended, b"").unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert!(child.0.wait().unwrap().success());
    assert_eq!(rest, "None None False\n");
}

/// The code the counted process runs for tracer (the start script, the counter library) lies
/// in a directory of root's beside the user's: the process's user can neither change, delete
/// nor rename it, nor add a file there, between its writing and its loading; the session
/// counts as usual, and both directories go at its end.
#[test]
fn the_user_cannot_replace_the_code_it_runs() {
    let Some((py, uid, gid)) = setup() else {
        return;
    };
    let d = Daemon::start();
    let go = shared_dir(&d).join("go");
    let done = shared_dir(&d).join("tried");
    let then = format!(
        "code = glob.glob(f'/tmp/tracer-*-{{os.getpid()}}-code')[0]\n\
         st = os.stat(code)\n\
         tried = [f'{{st.st_uid}} {{oct(st.st_mode & 0o7777)}} {{sorted(os.listdir(code))}}']\n\
         def attempt(what, f):\n\
         \x20   try:\n        f(); tried.append(what + ': done')\n\
         \x20   except PermissionError:\n        tried.append(what + ': refused')\n\
         start = os.path.join(code, 'start.py')\n\
         attempt('write', lambda: open(start, 'a').close())\n\
         attempt('unlink', lambda: os.unlink(start))\n\
         attempt('create', lambda: open(os.path.join(code, 'x.py'), 'w').close())\n\
         attempt('rename', lambda: os.rename(code, code + '-moved'))\n\
         with open({done:?}, 'w') as f:\n    f.write('\\n'.join(tried))\n\
         for _ in range(100):\n    fib(10); time.sleep(0.001)\n",
        done = done.display().to_string(),
    );
    let code = member_script(uid, gid, &go, &then);
    let mut child = ChildGuard::spawn_ready(Command::new(&py).arg("-c").arg(&code));
    let pid = child.pid();
    let id = start(&d, Path::new(""), (uid, gid), false, pid);
    std::fs::write(&go, b"").unwrap();
    assert!(child.0.wait().unwrap().success());
    let tried = std::fs::read_to_string(&done).unwrap();
    assert_eq!(
        tried,
        "0 0o755 ['_tracer_pycount.so', 'start.py']\n\
         write: refused\nunlink: refused\ncreate: refused\nrename: refused",
    );
    let r = report(&d, &id);
    let (way, why) = counted_way(&r, pid);
    assert_eq!(way, "in-process", "{why}");
    // At least the 100 fib(10) after the attempts: 177 calls each.
    let fib: u64 = r["python"]["functions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["qualname"] == "fib")
        .map(|f| f["ncalls"].as_u64().unwrap())
        .sum();
    assert!(fib >= 100 * 177, "{fib}: {}", r["python"]);
    for dir in [
        format!("/tmp/tracer-{id}-{pid}"),
        format!("/tmp/tracer-{id}-{pid}-code"),
    ] {
        wait_until(10, "the session's directories to go", || {
            !Path::new(&dir).exists()
        });
    }
}

/// A CPython 3.10-3.13 outside the chroots, into which tracer's loader goes with ptrace: the
/// distribution's where there is one (the member may read its library, while pyenv's lie in
/// root's home), else pyenv's; None (said) where there is none.
fn ptrace_python() -> Option<PathBuf> {
    let chrooted = chroot_interpreters();
    let found: Vec<PathBuf> = interpreters()
        .into_iter()
        .filter(|p| !chrooted.contains(p))
        .filter(|p| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            (10..=13).any(|m| name == format!("python3.{m}"))
        })
        .collect();
    let py = found
        .iter()
        .find(|p| p.starts_with("/usr"))
        .or(found.first())
        .cloned();
    if py.is_none() {
        tracer_testkit::skip("no CPython 3.10-3.13");
    }
    py
}

/// On the 3.10-3.13 path (tracer's loader loaded with ptrace), the member's process puts, at
/// the names of counts files of children gone, a FIFO, a symbolic link to a file of root's
/// and a socket, and a hard link to that file of root's (made here, as the member could
/// where `fs.protected_hardlinks` is 0) and a device are put there too. The file of root's
/// is a counts file, running, and world-writable: only tracerd's own checks keep it from
/// being stopped and read, as they must for a file of a group tracerd is in. The session
/// ends at once, counted in-process; the file of root's is neither changed nor reported;
/// the report names what was refused and why; the directory goes with the process, and the
/// file of root's stays.
#[test]
fn links_fifos_and_devices_at_counts_files_names_are_refused() {
    let Some((_, uid, gid)) = setup() else {
        return;
    };
    let Some(py) = ptrace_python() else {
        return;
    };
    let d = Daemon::start();
    let (plant, planted, stop) = {
        let shared = shared_dir(&d);
        (
            shared.join("plant"),
            shared.join("planted"),
            shared.join("stop"),
        )
    };
    let vault = tempfile::Builder::new()
        .prefix("victim-")
        .tempdir_in("/tmp")
        .unwrap();
    let victim = vault.path().join("counts");
    let code = format!(
        "import glob, os, socket, time\n\
         {become}\
         def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\
         print('ready', flush=True)\n\
         while not os.path.exists({plant:?}):\n    fib(10); time.sleep(0.001)\n\
         d = glob.glob(f'/tmp/tracer-*-{{os.getpid()}}')[0]\n\
         os.mkfifo(os.path.join(d, 'counts.4100001'))\n\
         os.symlink({victim:?}, os.path.join(d, 'counts.4100002'))\n\
         s = socket.socket(socket.AF_UNIX)\n\
         s.bind(os.path.join(d, 'counts.4100003'))\n\
         open({planted:?}, 'w').close()\n\
         while not os.path.exists({stop:?}):\n    fib(10); time.sleep(0.001)\n",
        become = become_user(uid, gid),
        victim = victim.display().to_string(),
    );
    let mut child = ChildGuard::spawn_ready(Command::new(&py).arg("-c").arg(&code));
    let pid = child.pid();
    let id = start(&d, Path::new(""), (uid, gid), false, pid);
    let dir = PathBuf::from(format!("/tmp/tracer-{id}-{pid}"));
    // Root's copy of the running counter's file: a well-formed counts file, running.
    std::thread::sleep(Duration::from_millis(300));
    std::fs::copy(dir.join(format!("counts.{pid}")), &victim).unwrap();
    std::fs::set_permissions(&victim, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    let before = std::fs::read(&victim).unwrap();
    assert_eq!(
        u32::from_le_bytes(before[12..16].try_into().unwrap()),
        1,
        "running"
    );
    std::fs::write(&plant, b"").unwrap();
    wait_until(10, "the member's planted files", || planted.exists());
    std::fs::hard_link(&victim, dir.join("counts.4100004")).unwrap();
    let device = std::ffi::CString::new(dir.join("counts.4100005").to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path; /dev/null's numbers.
    let device =
        unsafe { libc::mknod(device.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) } == 0;
    let started = std::time::Instant::now();
    d.ok(&["stop", &id]);
    let r = report(&d, &id);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the end took {:?}",
        started.elapsed()
    );
    let (way, why) = counted_way(&r, pid);
    assert_eq!(way, "in-process", "{why}");
    let said = warnings(&r);
    eprintln!("{} ({way}: {why}): {said:#?}", py.display());
    let mut refusals = vec![
        ("counts.4100001", "a FIFO"),
        ("counts.4100002", "a symbolic link"),
        ("counts.4100003", "a socket"),
        ("counts.4100004", "belongs to uid 0"),
    ];
    if device {
        refusals.push(("counts.4100005", "a character device"));
    }
    for (name, what) in refusals {
        assert!(
            said.iter()
                .any(|w| w.contains(name) && w.contains(what) && w.contains("refused")),
            "{name} ({what}) not said refused: {said:?}"
        );
    }
    let counted: Vec<u64> = r["python"]["counted"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["pid"].as_u64())
        .collect();
    assert!(
        !counted.iter().any(|&p| p >= 4_100_001),
        "a refused file was read: {counted:?}"
    );
    let after = std::fs::read(&victim).unwrap();
    assert!(before == after, "tracerd changed root's file");
    std::fs::write(&stop, b"").unwrap();
    assert!(child.0.wait().unwrap().success());
    wait_until(20, "the counter's directory to go", || !dir.exists());
    let m = std::fs::metadata(&victim).unwrap();
    assert_eq!(
        (
            std::os::unix::fs::MetadataExt::uid(&m),
            std::os::unix::fs::MetadataExt::nlink(&m)
        ),
        (0, 1)
    );
    assert!(std::fs::read(&victim).unwrap() == before);
}
