//! Loading tracer's code into a running CPython 3.10–3.13 with ptrace (docs/SECURITY.md, "Code
//! tracer loads into a process"), against a process that fights back: one that execs a
//! setuid-root program the moment tracer's loader appears in its code directory, and one
//! whose other thread holds the dynamic loader's lock for good. tracer's code never reaches a
//! root process, every start is answered within the call's deadline, and no thread is left
//! traced.

use std::{
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;
use tracer_tests::{
    chroot_interpreters, interpreters, root_or_skip,
    users::{member, public_ctl, GROUP},
    wait_until, ChildGuard, Daemon, DaemonOptions,
};

/// A host CPython 3.10–3.13 (loaded into with ptrace); None, said, where there is none.
fn ptrace_python() -> Option<PathBuf> {
    let found = interpreters().into_iter().find(|p| {
        let name = p.file_name().unwrap_or_default().to_string_lossy();
        ["3.12", "3.11", "3.13", "3.10"]
            .iter()
            .any(|v| name == format!("python{v}"))
    });
    if found.is_none() {
        tracer_testkit::skip("no CPython 3.10-3.13");
    }
    found
}

/// Whether `dir` lies on a mount where set-user-ID bits are ignored.
fn nosuid(dir: &std::path::Path) -> bool {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path and a zeroed statvfs the call fills.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    unsafe { libc::statvfs(c.as_ptr(), &mut st) == 0 && st.f_flag & libc::ST_NOSUID != 0 }
}

/// The session's JSON report once stopped.
fn stopped_report(d: &Daemon, id: &str) -> Value {
    d.ok(&["stop", id]);
    wait_until(30, "the session to end", || {
        let s = d.ok(&["status", id]);
        s.contains("finished") || s.contains("failed")
    });
    d.report_json(id)
}

/// What the report says of how `pid` was counted, and why: ("", "") where it names nothing.
fn counted(report: &Value, pid: u32) -> (String, String) {
    report["python"]["counted"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["pid"].as_u64() == Some(u64::from(pid))))
        .map(|c| {
            (
                c["way"].as_str().unwrap_or_default().to_owned(),
                c["why"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .unwrap_or_default()
}

/// `field` of `/proc/PID/status` (or of one of its threads' `task/TID/status`).
fn status_field(path: &str, field: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .map(|v| v.trim().to_owned())
}

/// Threads of `pid` that a tracer holds.
fn traced_threads(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| t.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|tid| {
            status_field(&format!("/proc/{pid}/task/{tid}/status"), "TracerPid:")
                .is_some_and(|t| t != "0")
        })
        .collect()
}

/// Whether `pid` maps any file of tracer's (its loader, its counter, a code directory's).
fn maps_tracer_code(pid: u32) -> Option<String> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    maps.lines()
        .find(|l| l.contains("/tracer-") || l.contains("_tracer_pycount") || l.contains("start.so"))
        .map(str::to_owned)
}

/// The member's process, started by root and become the member, watches its code directory
/// and, a delay after tracer's start script or loader appears there (after tracerd's checks,
/// before or about its load), execs a setuid-root program (a root
/// copy of `sleep`, mode 4755), which sleeps as euid 0 (as `su` waiting for a password
/// would). Tried eight times with different delays around the load on 3.10–3.13, and four
/// times around PEP 768's request on 3.14: tracer's code is never
/// mapped in the root process, no thread of it stays traced, and a start refused says why.
#[test]
fn a_setuid_program_execd_as_the_loader_appears_is_never_loaded_into() {
    if !root_or_skip() {
        return;
    }
    let Some(py) = ptrace_python() else {
        return;
    };
    let Some((uid, gid)) = member() else {
        tracer_testkit::skip("could not create test users (useradd/groupadd missing)");
        return;
    };
    let log = tempfile::NamedTempFile::new().unwrap();
    let d = Daemon::start_with(DaemonOptions {
        group: Some(GROUP.into()),
        log: Some(log.path().to_owned()),
        ..DaemonOptions::default()
    });
    let ctl = public_ctl(&d);
    let shared = d.dir.path().join("shared");
    std::fs::create_dir_all(&shared).unwrap();
    let setuid = shared.join("rootsleep");
    std::fs::copy("/bin/sleep", &setuid).unwrap();
    std::fs::set_permissions(
        &setuid,
        std::os::unix::fs::PermissionsExt::from_mode(0o4755),
    )
    .unwrap();
    std::fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    if nosuid(&shared) {
        tracer_testkit::skip(
            "the test's directory is on a nosuid mount: no setuid program runs there",
        );
        return;
    }
    let (mut refused, mut root_at_answer) = (0, 0);
    // 3.10–3.13, loaded with ptrace: triggered by the start script (written after the
    // checks, well before the load) or by the loader itself (the moment before the load),
    // with delays around the load. 3.14+, asked through PEP 768 by a write into the pinned
    // process's memory: triggered by the start script, written just before the request.
    let mut tries = vec![
        (py.clone(), "start.py", 0u32),
        (py.clone(), "start.so", 0),
        (py.clone(), "start.py", 500),
        (py.clone(), "start.so", 100),
        (py.clone(), "start.py", 2_000),
        (py.clone(), "start.so", 1_000),
        (py.clone(), "start.so", 5_000),
        (py.clone(), "start.so", 20_000),
    ];
    if let Some(py314) = chroot_interpreters().into_iter().next() {
        for delay in [0, 0, 200, 1_000] {
            tries.push((py314.clone(), "start.py", delay));
        }
    }
    let n = tries.len();
    for (attempt, (py, trigger, delay_us)) in tries.into_iter().enumerate() {
        let code = format!(
            "import ctypes, glob, os, time\n\
             os.setgroups([{gid}]); os.setgid({gid}); os.setuid({uid})\n\
             ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)\n\
             print('ready', flush=True)\n\
             while not (dirs := glob.glob(f'/tmp/tracer-*-{{os.getpid()}}-code')):\n    time.sleep(0.0002)\n\
             trigger = os.path.join(dirs[0], {trigger:?})\n\
             while not os.path.exists(trigger):\n    pass\n\
             time.sleep({delay})\n\
             os.execv({setuid:?}, ['rootsleep', '30'])\n",
            delay = f64::from(delay_us) / 1e6,
            setuid = setuid.display().to_string(),
        );
        let child = ChildGuard::spawn_ready(Command::new(&py).arg("-c").arg(&code));
        let pid = child.pid();
        let out = d.run_as(
            uid,
            gid,
            &[
                "start",
                "--mode=counting",
                "--python",
                "--pid",
                &pid.to_string(),
            ],
            &ctl,
        );
        let answer = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        let said = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        let euid = |pid: u32| {
            status_field(&format!("/proc/{pid}/status"), "Uid:")
                .and_then(|u| u.split_whitespace().nth(1).map(str::to_owned))
        };
        // The exec ends the spin within the delay: wait until it has happened.
        wait_until(10, "the setuid program to run", || {
            euid(pid).as_deref() == Some("0")
        });
        if euid(pid).as_deref() == Some("0") && out.status.success() {
            root_at_answer += 1;
        }
        for when in ["at the answer", "half a second later"] {
            assert_eq!(
                maps_tracer_code(pid),
                None,
                "try {attempt} ({trigger} + {delay_us} us): tracer's code mapped in the root process {when}"
            );
            assert_eq!(
                traced_threads(pid),
                Vec::<u32>::new(),
                "try {attempt}: left traced"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        let why = if out.status.success() {
            counted(&stopped_report(&d, &answer), pid).1
        } else {
            said
        };
        // A start refused names the reason. One answered counted the member's program before
        // it exec'd (the exec took the counter with it: nothing of tracer's is in the root
        // program, checked above).
        let named = [
            "executed another program",
            "executed a program",
            "replaced its address space",
            "refused once a thread of it was stopped",
            "runs as uid 0",
            "may not trace",
        ]
        .iter()
        .any(|w| why.contains(w));
        assert!(out.status.success() || named, "try {attempt}: {why}");
        refused += usize::from(named);
        eprintln!("try {attempt} ({trigger} + {delay_us} us): {why}");
        drop(child);
    }
    // Loads that found the process stopped in another program than the one checked.
    let on_stopped = std::fs::read_to_string(log.path())
        .unwrap()
        .lines()
        .filter(|l| l.contains("load refused on the stopped process"))
        .count();
    eprintln!(
        "{refused} of {n} starts refused with the reason named ({on_stopped} loads refused on the stopped process); the target was root at {root_at_answer} answers"
    );
    // The exec comes at once in the first tries, after the checks, before any load.
    assert!(on_stopped >= 1, "the race's window was never hit");
}

/// A CPython process whose second thread holds the dynamic loader's lock until `fifo` (made
/// here) is written to: it loads that FIFO as a library, and the dynamic loader's own `open`
/// blocks, the lock held. Its output once `ready`: `done` when it ends.
fn lock_holder(
    py: &std::path::Path,
    fifo: &std::path::Path,
) -> (ChildGuard, std::io::BufReader<std::process::ChildStdout>) {
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let code = format!(
        "import ctypes, threading\n\
         def hold():\n\
         \x20   try:\n        ctypes.CDLL({fifo:?})\n\
         \x20   except OSError:\n        pass\n\
         print('ready', flush=True)\n\
         t = threading.Thread(target=hold)\n\
         t.start(); t.join()\n\
         print('done', flush=True)\n",
        fifo = fifo.display().to_string(),
    );
    let mut child = ChildGuard::spawn(Command::new(py).arg("-c").arg(&code).stdout(Stdio::piped()));
    let mut out = std::io::BufReader::new(child.0.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line, "ready\n");
    let pid = child.pid();
    // In the dynamic loader's open of the FIFO (openat), holding its lock.
    wait_until(10, "the loading thread to block", || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .any(|t| {
                std::fs::read_to_string(t.path().join("syscall"))
                    .is_ok_and(|s| s.starts_with("257 "))
            })
    });
    (child, out)
}

/// A counting start on `pid` (tracerctl, running), once its load is under way: a thread of
/// the process traced by tracerd.
fn loading(d: &Daemon, pid: u32) -> std::process::Child {
    let start = d
        .ctl()
        .args(["start", "--mode=counting", "--python", "--pid"])
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_until(10, "tracerd's load to begin", || {
        !traced_threads(pid).is_empty()
    });
    start
}

/// Lets [`lock_holder`]'s thread go (what it loads is no library: its dlopen fails) and
/// checks that the program then runs to its end, its output its own.
fn let_go(
    mut child: ChildGuard,
    mut out: std::io::BufReader<std::process::ChildStdout>,
    fifo: &std::path::Path,
) {
    use std::io::{Read, Write};
    std::fs::OpenOptions::new()
        .write(true)
        .open(fifo)
        .unwrap()
        .write_all(&[0; 64])
        .unwrap();
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    assert_eq!(rest, "done\n");
    assert!(child.0.wait().unwrap().success());
}

/// Five CPython processes whose second thread holds the dynamic loader's lock for good (it
/// loads a "library" that is a FIFO nobody writes: the dynamic loader's own `open` blocks,
/// the lock held, so that thread is never the one loaded on), started on together: four
/// starts are answered within the call's deadline, their loads ended with the thread put
/// back, counted with uprobes instead and saying why; the fifth finds four loads of its user
/// in flight and is refused at once (RESOURCE_EXHAUSTED); tracerd's metrics count both. No
/// thread stays traced, and once the lock is let go each program runs on to its end.
#[test]
fn a_process_holding_the_loaders_lock_gets_an_answer_and_runs_on() {
    if !root_or_skip() {
        return;
    }
    let Some(py) = ptrace_python() else {
        return;
    };
    let metrics = tracer_tests::free_loopback_addr();
    let d = Daemon::start_with(DaemonOptions {
        args: vec!["--metrics".into(), format!("tcp://{metrics}")],
        ..DaemonOptions::default()
    });
    let mut targets = Vec::new();
    for i in 0..5 {
        let fifo = d.dir.path().join(format!("fifo-{i}"));
        let (child, out) = lock_holder(&py, &fifo);
        targets.push((child, out, fifo));
    }
    let began = Instant::now();
    let starts: Vec<_> = targets
        .iter()
        .map(|(c, _, _)| {
            d.ctl()
                .args(["start", "--mode=counting", "--python", "--pid"])
                .arg(c.pid().to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let answers: Vec<_> = starts
        .into_iter()
        .map(|s| s.wait_with_output().unwrap())
        .collect();
    let took = began.elapsed();
    let refused: Vec<String> = answers
        .iter()
        .filter(|a| !a.status.success())
        .map(|a| String::from_utf8_lossy(&a.stderr).trim().to_owned())
        .collect();
    assert_eq!(refused.len(), 1, "{answers:?}");
    assert!(
        refused[0].contains("loads into processes in flight"),
        "{}",
        refused[0]
    );
    // Each start: the 5 s call deadline and a second to find a thread, with room to spare.
    assert!(took < Duration::from_secs(30), "answered after {took:?}");
    for (c, _, _) in &targets {
        assert_eq!(traced_threads(c.pid()), Vec::<u32>::new(), "left traced");
    }
    // Counted where an operator looks.
    let text = tracer_tests::fleet::http_get(&metrics, "/metrics").unwrap();
    for series in [
        "tracer_process_loads_total{outcome=\"deadline\"} 4",
        "tracer_process_loads_total{outcome=\"busy\"} 1",
        "tracer_process_loads_total{outcome=\"loaded\"} 0",
    ] {
        assert!(
            text.lines().any(|l| l == series),
            "{series} not in:\n{text}"
        );
    }
    let ids: Vec<String> = answers
        .iter()
        .filter(|a| a.status.success())
        .map(|a| String::from_utf8_lossy(&a.stdout).trim().to_owned())
        .collect();
    for (c, out, fifo) in targets {
        let_go(c, out, &fifo);
    }
    let mut ended = 0;
    for id in ids {
        let r = stopped_report(&d, &id);
        let whys: Vec<String> = r["python"]["counted"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["why"].as_str().map(str::to_owned))
            .collect();
        assert!(
            whys.iter()
                .any(|w| w.contains("dlopen did not return within 5000 ms")
                    && w.contains("put back as it was")),
            "{whys:?}"
        );
        ended += 1;
    }
    assert_eq!(ended, 4);
}

/// tracerd SIGKILLed while its call waits in a process for the loader's lock: the kernel lets
/// the thread go, the call goes on by itself and, once the lock is let go, returns through
/// its frame to where the thread was. The program runs on to its end, its output its own, and
/// nothing of tracer's stays traced or counting (the loader, loaded late, finds tracerd gone);
/// the next tracerd sweeps the directories the killed one made.
#[test]
fn a_tracerd_killed_mid_load_leaves_the_process_running_and_whole() {
    if !root_or_skip() {
        return;
    }
    let Some(py) = ptrace_python() else {
        return;
    };
    let mut d = Daemon::start();
    let fifo = d.dir.path().join("fifo");
    let (child, out) = lock_holder(&py, &fifo);
    let pid = child.pid();
    let mut start = loading(&d, pid);
    std::thread::sleep(Duration::from_millis(200));
    d.kill();
    let _ = start.wait();
    wait_until(10, "the kernel to let the thread go", || {
        traced_threads(pid).is_empty()
    });
    let_go(child, out, &fifo);
    // The next tracerd sweeps the directories the killed one made for the load.
    let made = || {
        std::fs::read_dir("/tmp")
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.starts_with("tracer-")
                    && (name.ends_with(&format!("-{pid}"))
                        || name.ends_with(&format!("-{pid}-code")))
            })
            .count()
    };
    // The code directory at least (root's: the start script, run late, may have deleted the
    // counter's own directory on finding tracerd gone).
    assert!(
        made() >= 1,
        "the load's directories, before the next tracerd"
    );
    d.restart();
    wait_until(20, "the killed tracerd's directories to go", || made() == 0);
}

/// A start whose client goes (`tracerctl` killed) while its load waits in the process for the
/// loader's lock: the load ends then, for that reason, the thread put back and let go.
#[test]
fn a_load_ends_when_its_client_goes() {
    if !root_or_skip() {
        return;
    }
    let Some(py) = ptrace_python() else {
        return;
    };
    let log = tempfile::NamedTempFile::new().unwrap();
    let d = Daemon::start_with(DaemonOptions {
        log: Some(log.path().to_owned()),
        ..DaemonOptions::default()
    });
    let fifo = d.dir.path().join("fifo");
    let (child, out) = lock_holder(&py, &fifo);
    let pid = child.pid();
    let mut start = loading(&d, pid);
    start.kill().unwrap();
    start.wait().unwrap();
    wait_until(10, "the load to end", || traced_threads(pid).is_empty());
    let_go(child, out, &fifo);
    // Why it ended, in tracerd's log: the client, not the deadline.
    let said = std::fs::read_to_string(log.path()).unwrap();
    assert!(
        said.lines()
            .any(|l| l.contains("a load into a process was ended")
                && l.contains("its client went")
                && l.contains("put back as it was")),
        "{said}"
    );
    // tracerd answers others meanwhile and after.
    d.ok(&["list"]);
}
