//! Processes in other roots and mount namespaces: a chroot, `unshare --root`, and a
//! container-like namespace made with pivot_root. /proc/PID/maps names their files as tracerd
//! sees them where it can (with the chroot in the path) and as the process sees them where
//! it cannot (the container's own paths), so tracerd must pick, per mapping, the path that is
//! the mapped file. Each is run under tracer (`-- CMD`), attached to (`--pid`) and seen by a
//! machine-wide session (`--all`), in counting, sampling and tracing modes, with CPython 3.14
//! from `target/cpython-root`.
//!
//! Two layers of checks: what holds whatever tracer knows of 3.14 (no missing-path warning,
//! the interpreter found, native frames named, binaries shown by their real paths), checked
//! first; and Python-level results (functions and their calls), collected and checked last.
//!
//! Last, a host Python alone in a pid namespace: counted by pid from threads already running.

use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use serde_json::Value;
use tracer_tests::{root_or_skip, wait_until, ChildGuard, Daemon};

/// A CPython 3.14 of the root, by its paths inside it.
#[derive(Clone, Copy, Debug)]
struct Interp {
    exe: &'static str,
    /// The binary holding the interpreter.
    runtime: &'static str,
}

/// Debian's build: the interpreter in the executable.
const STATIC: Interp = Interp {
    exe: "/usr/bin/python3.14",
    runtime: "/usr/bin/python3.14",
};

/// An executable linked to Debian's libpython3.14.
const SHARED: Interp = Interp {
    exe: "/usr/local/bin/python3.14",
    runtime: "/usr/lib/x86_64-linux-gnu/libpython3.14.so.1.0",
};

/// fib(18) five times (5 × 8361 calls of fib) and getpid 100 times, or fib for a second.
/// With `cue`, waits for a line on stdin first (after saying `ready`), so that a session
/// attached meanwhile sees every call. Launched, it has no wait: tracerd holds a followed
/// process at its exec until it has probed the new program.
const WORKLOAD: &str = r#"import os, sys, time

def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)

def work():
    for _ in range(5):
        fib(18)
    for _ in range(100):
        os.getpid()

def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        fib(15)

if sys.argv[1] == "cue":
    print("ready", flush=True)
    sys.stdin.readline()
if sys.argv[2] == "spin":
    spin(1.0)
else:
    work()
"#;

const FIB_CALLS: u64 = 5 * 8361;

/// Sets up the container (as its pid 1, in new mount and pid namespaces) with the host's
/// Python, the root holding no shell or mount tools: binds the root on itself, pivots into
/// it, drops the old root, mounts a /proc, then execs the command.
const CONTAINER_INIT: &str = r#"import ctypes, os, sys
root, inner, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
libc = ctypes.CDLL(None, use_errno=True)
def check(ret, what):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
MS_BIND, MNT_DETACH, SYS_PIVOT_ROOT = 0x1000, 2, 155
check(libc.mount(root.encode(), root.encode(), None, MS_BIND, None), "bind mount")
os.chdir(root)
old = inner[1:] + "/old"
os.makedirs(old, exist_ok=True)
check(libc.syscall(SYS_PIVOT_ROOT, b".", old.encode()), "pivot_root")
os.chdir("/")
check(libc.umount2(("/" + old).encode(), MNT_DETACH), "umount")
os.makedirs(inner + "/proc", exist_ok=True)
check(libc.mount(b"proc", (inner + "/proc").encode(), b"proc", 0, None), "mount proc")
os.execv(argv[0], argv)
"#;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `chroot ROOT python`: same mount namespace, another root.
    Chroot,
    /// `unshare -m -R ROOT python`: another mount namespace, chrooted into a copy of ROOT.
    UnshareRoot,
    /// pivot_root in new mount and pid namespaces: ROOT's mount is unreachable from the host.
    PivotRoot,
}

/// A root and this test's directory inside it (the workload's script), removed on drop.
struct Jail {
    kind: Kind,
    root: PathBuf,
    interp: Interp,
    /// The directory as the jailed process sees it, `/tracer-ns-…`.
    inner: String,
}

impl Jail {
    fn new(kind: Kind, root: &Path, interp: Interp) -> Self {
        let inner = format!(
            "/tracer-ns-{}-{kind:?}-{}",
            std::process::id(),
            interp.exe.replace('/', "_")
        );
        Jail {
            kind,
            root: root.to_owned(),
            interp,
            inner,
        }
    }

    /// Writes the script, before each run: `cargo xtask setup` makes the root anew.
    fn write_script(&self) {
        std::fs::create_dir_all(self.host_dir()).unwrap();
        std::fs::write(self.host_dir().join("work.py"), WORKLOAD).unwrap();
    }

    fn host_dir(&self) -> PathBuf {
        self.root.join(&self.inner[1..])
    }

    /// The script as the jailed process names it.
    fn script(&self) -> String {
        format!("{}/work.py", self.inner)
    }

    /// The interpreter's binary on the host.
    fn host_runtime(&self) -> String {
        format!("{}{}", self.root.display(), self.interp.runtime)
    }

    /// The command running the workload in the jail.
    fn command(&self, args: &[&str]) -> Vec<String> {
        let root = self.root.to_string_lossy().into_owned();
        let mut cmd: Vec<String> = match self.kind {
            Kind::Chroot => vec!["chroot".into(), root],
            Kind::UnshareRoot => vec!["unshare".into(), "-m".into(), "-R".into(), root],
            Kind::PivotRoot => vec![
                "unshare".into(),
                "-m".into(),
                "-p".into(),
                "-f".into(),
                "--mount-proc".into(),
                "--kill-child".into(),
                tracer_tests::python().to_string_lossy().into_owned(),
                "-c".into(),
                CONTAINER_INIT.into(),
                root,
                self.inner.clone(),
            ],
        };
        cmd.extend([self.interp.exe.to_owned(), self.script()]);
        cmd.extend(args.iter().map(|a| a.to_string()));
        cmd
    }
}

impl Drop for Jail {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(self.host_dir());
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    Launched,
    Pid,
    All,
}

/// A workload started in its jail, holding until cued.
struct Held {
    child: ChildGuard,
    /// The Python process (the launcher's child in a container).
    pid: u32,
}

impl Held {
    fn start(jail: &Jail, task: &str) -> Self {
        let cmd = jail.command(&["cue", task]);
        let mut child = ChildGuard::spawn(
            Command::new(&cmd[0])
                .args(&cmd[1..])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped()),
        );
        let mut line = String::new();
        BufReader::new(child.0.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(
            line.trim(),
            "ready",
            "{:?}: the workload did not start",
            jail.kind
        );
        let launcher = child.pid();
        let pid = match jail.kind {
            Kind::PivotRoot => {
                let children =
                    std::fs::read_to_string(format!("/proc/{launcher}/task/{launcher}/children"))
                        .unwrap();
                children.split_whitespace().next().unwrap().parse().unwrap()
            }
            _ => launcher,
        };
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
        assert!(exe.ends_with(&jail.interp.exe[1..]), "{}", exe.display());
        Held { child, pid }
    }

    /// Lets the workload run to its end.
    fn cue(mut self) {
        self.child
            .0
            .stdin
            .take()
            .unwrap()
            .write_all(b"go\n")
            .unwrap();
        assert!(self.child.0.wait().unwrap().success());
    }
}

/// One session of `mode` on the workload (`task`: `count` or `spin`) in `jail`, and its JSON
/// report. `opts`: more `start` options. None when the session was refused: the error is
/// checked, and recorded in `later`.
fn session(
    d: &Daemon,
    jail: &Jail,
    target: Target,
    mode: &str,
    opts: &[&str],
    task: &str,
    later: &mut Vec<String>,
) -> Option<(Value, Option<u32>)> {
    let what = format!("{:?} {target:?} {mode} {opts:?}", jail.kind);
    jail.write_script();
    let mut args = vec!["start".to_owned(), format!("--mode={mode}")];
    args.extend(opts.iter().map(|o| o.to_string()));
    if mode == "sampling" {
        args.extend(["--frequency".into(), "499".into()]);
    }
    if target == Target::Launched {
        let file = d.dir.path().join("report.json");
        args.extend(["--format".into(), "json".into(), "-o".into()]);
        args.push(file.to_string_lossy().into_owned());
        args.push("--".into());
        args.extend(jail.command(&["go", task]));
        let out = d.ctl().args(&args).output().unwrap();
        assert!(
            out.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        return Some((report, None));
    }
    let held = Held::start(jail, task);
    let pid = held.pid;
    match target {
        Target::Pid => args.extend(["--pid".into(), pid.to_string()]),
        _ => args.push("--all".into()),
    }
    let out = d.ctl().args(&args).output().unwrap();
    if !out.status.success() {
        // Refused: only Python counting may refuse, for an interpreter it cannot count, and
        // must then name it, not a path it failed to open.
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            opts.contains(&"--python")
                && err.contains("python3.14")
                && !err.contains("No such file"),
            "{what}: {err}"
        );
        later.push(format!("{what}: refused: {}", err.trim()));
        held.cue();
        return None;
    }
    let id = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    held.cue();
    if target == Target::All {
        d.ok(&["stop", &id]);
    }
    wait_until(20, "the session to end", || {
        d.ok(&["status", &id]).contains("finished")
    });
    let report = d.report_json(&id);
    Some((report, Some(pid)))
}

/// Every string in a JSON value.
fn strings<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
    match v {
        Value::String(s) => out.push(s),
        Value::Array(a) => a.iter().for_each(|v| strings(v, out)),
        Value::Object(o) => o.values().for_each(|v| strings(v, out)),
        _ => {}
    }
}

/// What must hold whatever tracer knows of 3.14: no file of our process was looked for where
/// it is not (the chroot twice in a path), in any warning of the report; and where the host
/// reaches the process's files by a path of its own (not a container's), reports name them
/// by it, not through /proc.
fn check_paths(what: &str, jail: &Jail, report: &Value, pid: Option<u32>, all: bool) {
    let doubled = format!("root{}", jail.root.display());
    let mut all_strings = Vec::new();
    strings(report, &mut all_strings);
    for s in all_strings {
        // A machine-wide session also reports on other people's processes.
        let ours = !all
            || pid.is_some_and(|p| s.contains(&format!("pid {p}:")))
            || s.contains(&jail.root.to_string_lossy()[..]);
        assert!(!s.contains(&doubled), "{what}: {s}");
        if !ours {
            continue;
        }
        assert!(!s.contains("No such file"), "{what}: {s}");
        // Only /proc/PID/root reaches a container's files, and Python's warnings name an
        // interpreter by the path it was opened by.
        if jail.kind != Kind::PivotRoot {
            let via_proc =
                s.contains("/proc/") && (s.contains("/root/") || s.contains("/map_files/"));
            assert!(!via_proc, "{what}: {s}");
        }
    }
}

/// Python functions of our script: (qualname, pid, ncalls).
fn script_functions(report: &Value, script: &str) -> Vec<(String, u64, u64)> {
    report["python"]["functions"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|f| f["filename"] == script)
                .map(|f| {
                    (
                        f["qualname"].as_str().unwrap_or("").to_owned(),
                        f["pid"].as_u64().unwrap_or(0),
                        f["ncalls"].as_u64().unwrap_or(0),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Python counting or tracing: the interpreter was found: our script's functions were
/// counted, or a warning names the interpreter (an unsupported version, say) — not a path that
/// does not exist (checked by `check_paths`).
fn check_python(
    what: &str,
    report: &Value,
    script: &str,
    pid: Option<u32>,
    later: &mut Vec<String>,
) {
    let python = &report["python"];
    assert!(python.is_object(), "{what}: no python section: {report}");
    let warnings: Vec<&str> = python["warnings"]
        .as_array()
        .map(|w| w.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let functions = script_functions(report, script);
    let named = warnings
        .iter()
        .any(|w| w.contains("python3.14") && pid.is_none_or(|p| w.contains(&format!("pid {p}"))));
    assert!(
        !functions.is_empty() || named,
        "{what}: neither our functions nor a warning about python3.14: {python}"
    );
    // Python level: every call of fib, once (the workload starts after the probes are in).
    let fib: u64 = functions
        .iter()
        .filter(|(q, p, _)| q == "fib" && pid.is_none_or(|want| *p == u64::from(want)))
        .map(|(_, _, n)| n)
        .sum();
    if fib != FIB_CALLS {
        later.push(format!(
            "{what}: fib has {fib} calls, not {FIB_CALLS}; warnings: {warnings:?}"
        ));
    }
}

/// Sampling: the interpreter's executable is a mapping shown by its real path, and the
/// samples' native frames in it are named.
fn check_samples(
    what: &str,
    jail: &Jail,
    report: &Value,
    pid: Option<u32>,
    later: &mut Vec<String>,
) {
    let p = &report["profile"];
    let mappings = p["mappings"].as_array().unwrap();
    // As maps names it: the host's path for a chroot, the container's own inside a
    // container whose root the host does not reach.
    let want = match jail.kind {
        Kind::Chroot => vec![jail.host_runtime()],
        Kind::UnshareRoot | Kind::PivotRoot => {
            vec![jail.host_runtime(), jail.interp.runtime.to_owned()]
        }
    };
    let exe: Vec<u64> = mappings
        .iter()
        .enumerate()
        .filter(|(_, m)| {
            m["path"]
                .as_str()
                .is_some_and(|s| s.ends_with(jail.interp.runtime))
        })
        .map(|(i, m)| {
            let path = m["path"].as_str().unwrap();
            assert!(
                want.iter().any(|w| w == path),
                "{what}: mapping {path}, want one of {want:?}"
            );
            i as u64
        })
        .collect();
    assert!(
        !exe.is_empty(),
        "{what}: no {} mapping: {mappings:?}",
        jail.interp.runtime
    );
    let stacks: Vec<&Value> = p["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| pid.is_none_or(|want| s["pid"] == want))
        .filter(|s| {
            s["frames"]
                .as_array()
                .unwrap()
                .iter()
                .any(|f| f["mapping"].as_u64().is_some_and(|m| exe.contains(&m)))
        })
        .collect();
    let samples: u64 = stacks.iter().map(|s| s["count"].as_u64().unwrap()).sum();
    assert!(
        samples >= 100,
        "{what}: {samples} samples in the interpreter"
    );
    // The binary was read: every stack goes through Py_BytesMain. Debian strips the static
    // symbols, so frames of static functions are `[python3.14]` (or `[libpython…]`) by right.
    let through_main: u64 = stacks
        .iter()
        .filter(|s| {
            s["frames"].as_array().unwrap().iter().any(|f| {
                f["name"] == "Py_BytesMain"
                    && f["mapping"].as_u64().is_some_and(|m| exe.contains(&m))
            })
        })
        .map(|s| s["count"].as_u64().unwrap())
        .sum();
    assert!(
        through_main * 10 >= samples * 9,
        "{what}: {through_main} of {samples} samples go through a named Py_BytesMain: {stacks:?}"
    );
    // Python level: the workload's functions as Python frames.
    let python_names: std::collections::BTreeSet<&str> = stacks
        .iter()
        .flat_map(|s| s["frames"].as_array().unwrap())
        .filter(|f| f["kind"] == "python")
        .filter_map(|f| f["name"].as_str())
        .collect();
    if !python_names.contains("spin") || !python_names.contains("fib") {
        later.push(format!(
            "{what}: Python frames {python_names:?} lack spin or fib; unwinding: {}",
            p["unwinding"]
        ));
    }
}

/// Native call counting in a process of the jail: the libc it maps is probed (not the
/// host's), and shown by a real path.
fn check_uprobe(what: &str, report: &Value, pid: u32) {
    let native = &report["native"];
    let probes = native["probes"].as_array().unwrap();
    for p in probes {
        let binary = p["binary"].as_str().unwrap();
        assert!(
            binary.ends_with("libc.so.6") && !binary.starts_with("/proc/"),
            "{what}: {p}"
        );
    }
    let calls: u64 = native["calls"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["pid"] == pid && c["symbol"] == "getpid")
        .map(|c| c["calls"].as_u64().unwrap())
        .sum();
    assert!(
        calls >= 100,
        "{what}: getpid called {calls} times: {native}"
    );
}

/// One session of `mode` on `target` in `jail`, checked.
fn run_one(d: &Daemon, jail: &Jail, target: Target, mode: &str, later: &mut Vec<String>) {
    let what = format!("{:?} {} {target:?} {mode}", jail.kind, jail.interp.exe);
    let (opts, task): (&[&str], _) = match mode {
        "counting" => (&["--python"], "count"),
        "sampling" => (&[], "spin"),
        _ => (&[], "count"),
    };
    let t0 = std::time::Instant::now();
    let Some((report, pid)) = session(d, jail, target, mode, opts, task, later) else {
        return;
    };
    check_paths(&what, jail, &report, pid, target == Target::All);
    match mode {
        "sampling" => check_samples(&what, jail, &report, pid, later),
        _ => check_python(&what, &report, &jail.script(), pid, later),
    }
    println!("{what}: checked ({:?})", t0.elapsed());
}

/// Every target and mode with Debian's build; with the libpython one, where the interpreter
/// is a library, a launched counting and an attached sampling session.
fn run_jail(kind: Kind) {
    if !root_or_skip() {
        return;
    }
    let Some(root) = tracer_tests::cpython_root().filter(|r| r.join(&STATIC.exe[1..]).exists())
    else {
        tracer_testkit::skip(format_args!(
            "no CPython root with {} (`cargo xtask setup` makes it)",
            STATIC.exe
        ));
        return;
    };
    let d = Daemon::start();
    // A Python session held open on an idle host Python for the whole test: the probes on
    // the machine's interpreters then stay attached between the sessions below, instead of
    // being attached again (seconds) by each launched or machine-wide one.
    let keeper = ChildGuard::spawn(
        Command::new(tracer_tests::python()).args(["-c", "import time; time.sleep(600)"]),
    );
    wait_until(10, "the idle Python", || {
        std::fs::read_to_string(format!("/proc/{}/maps", keeper.pid()))
            .is_ok_and(|m| m.contains("python"))
    });
    d.ok(&[
        "start",
        "--mode=counting",
        "--python",
        "--pid",
        &keeper.pid().to_string(),
    ]);
    let mut later = Vec::new();
    let jail = Jail::new(kind, &root, STATIC);
    for target in [Target::Launched, Target::Pid, Target::All] {
        for mode in ["counting", "sampling", "tracing"] {
            run_one(&d, &jail, target, mode, &mut later);
        }
    }
    // A library the process maps, named without a path, is the jail's.
    let what = format!("{kind:?} Pid counting --uprobe");
    let (report, pid) = session(
        &d,
        &jail,
        Target::Pid,
        "counting",
        &["--uprobe", "c:getpid"],
        "count",
        &mut later,
    )
    .unwrap();
    check_paths(&what, &jail, &report, pid, false);
    check_uprobe(&what, &report, pid.unwrap());
    if root.join(&SHARED.exe[1..]).exists() {
        let jail = Jail::new(kind, &root, SHARED);
        run_one(&d, &jail, Target::Launched, "counting", &mut later);
        run_one(&d, &jail, Target::Pid, "sampling", &mut later);
    } else {
        println!("{kind:?}: no {} in the root, not run", SHARED.exe);
    }
    assert!(
        later.is_empty(),
        "Python-level results:\n{}",
        later.join("\n")
    );
}

#[test]
fn chrooted_python() {
    run_jail(Kind::Chroot);
}

#[test]
fn python_under_unshare_root() {
    run_jail(Kind::UnshareRoot);
}

#[test]
fn python_in_a_pivot_root_container() {
    run_jail(Kind::PivotRoot);
}

/// Counting by pid, attached to a host Python in a pid namespace of its own: threads already
/// inside a function when the session starts never pass the eval loop's entry again, so the
/// daemon finds their thread states, which know them by their tids in the namespace. Both
/// ways: in-process (the default) and with the probes.
#[test]
fn python_in_its_own_pid_namespace_counts_running_threads() {
    if !root_or_skip() {
        return;
    }
    let d = Daemon::start();
    let mut pythons = tracer_tests::interpreters();
    for p in tracer_tests::chroot_interpreters() {
        if !pythons.contains(&p) {
            pythons.push(p);
        }
    }
    let ways: [&[&str]; 2] = [&[], &["--python-uprobes-only"]];
    for (python, way) in pythons
        .into_iter()
        .flat_map(|py| ways.map(|w| (py.clone(), w)))
    {
        let dir = d.dir.path();
        for f in ["go", "ready-main", "ready-thread"] {
            let _ = std::fs::remove_file(dir.join(f));
        }
        // Two threads wait inside `wait` until cued, then call fib(15) (1973 calls) each.
        let code = format!(
            "import os, threading, time\n\
             def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\
             def wait(name):\n    open(os.path.join({dir:?}, name), 'w').close()\n    \
             while not os.path.exists(os.path.join({dir:?}, 'go')):\n        time.sleep(0.01)\n    \
             fib(15)\n\
             t = threading.Thread(target=wait, args=('ready-thread',))\n\
             t.start()\n\
             wait('ready-main')\n\
             t.join()\n"
        );
        let file = dir.join("attach.py");
        std::fs::write(&file, code).unwrap();
        let (mut guard, pid) =
            tracer_tests::spawn_python_in_pid_namespace(&python, &[file.as_os_str()]);
        wait_until(20, "both threads to wait", || {
            dir.join("ready-main").exists() && dir.join("ready-thread").exists()
        });
        let pid_s = pid.to_string();
        let mut args = vec!["start", "--mode=counting", "--python", "--pid", &pid_s];
        args.extend_from_slice(way);
        let id = d.ok(&args).trim().to_owned();
        std::fs::write(dir.join("go"), b"").unwrap();
        assert!(guard.0.wait().unwrap().success(), "{}", python.display());
        wait_until(20, "the session to end", || {
            d.ok(&["status", &id]).contains("finished")
        });
        let report: Value = d.report_json(&id);
        let script = file.to_string_lossy();
        let functions = script_functions(&report, &script);
        let calls = |name: &str| -> u64 {
            functions
                .iter()
                .filter(|(q, p, _)| q == name && *p == u64::from(pid))
                .map(|(_, _, n)| n)
                .sum()
        };
        println!("{}: {functions:?}", python.display());
        assert_eq!(
            calls("fib"),
            2 * 1973,
            "{} {way:?}: {functions:?}; warnings: {}; losses: {}",
            python.display(),
            report["python"]["warnings"],
            report["losses"]
        );
        // Entered before the session started, never again.
        assert_eq!(calls("wait"), 0, "{}: {functions:?}", python.display());
    }
}
