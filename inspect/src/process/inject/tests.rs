//! Real processes: threads blocked in `read` on a pipe, in `nanosleep`, in a futex and in
//! `epoll_wait` (which the kernel never restarts), with a signal handler installed, each
//! made to load a library; every call must end as it would have untouched.

use std::{
    io::{BufRead, BufReader, Read},
    process::{Command, Stdio},
    time::Duration,
};

use super::*;

/// A child killed and reaped however the test ends.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The calls the threads make through ctypes (so that an EINTR would show: Python's own
/// wrappers retry), each printed with its result and errno once done.
const TARGET: &str = r#"
import ctypes, os, signal, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
signal.signal(signal.SIGUSR1, lambda *a: None)
class ts(ctypes.Structure):
    _fields_ = [("s", ctypes.c_long), ("ns", ctypes.c_long)]
r, w = os.pipe()
out = {}
def reader():
    buf = ctypes.create_string_buffer(1)
    out["read"] = (libc.read(r, buf, 1), ctypes.get_errno())
def sleeper():
    t0 = time.monotonic()
    n = libc.nanosleep(ctypes.byref(ts(1, 500000000)), None)
    out["nanosleep"] = (n, ctypes.get_errno(), time.monotonic() - t0 >= 1.5)
def futex():
    word = ctypes.c_int(0)
    out["futex"] = (libc.syscall(202, ctypes.byref(word), 0, 0, ctypes.byref(ts(1, 500000000))), ctypes.get_errno())
def epoll():
    ep = libc.epoll_create1(0)
    events = ctypes.create_string_buffer(12 * 4)
    out["epoll_wait"] = (libc.epoll_wait(ep, events, 4, 1500), ctypes.get_errno())
threads = [threading.Thread(target=f, name=f.__name__) for f in (reader, sleeper, futex, epoll)]
for t in threads:
    t.start()
print("ready", flush=True)
time.sleep(2.0)
os.write(w, b"x")
for t in threads:
    t.join()
for k in sorted(out):
    print(k, *out[k], flush=True)
"#;

/// A library of the system's that the target has not loaded.
fn some_library(pid: u32) -> Option<String> {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    [
        "libresolv.so.2",
        "libutil.so.1",
        "libanl.so.1",
        "libnss_files.so.2",
    ]
    .iter()
    .flat_map(|n| {
        [
            "/lib/x86_64-linux-gnu/",
            "/usr/lib/x86_64-linux-gnu/",
            "/usr/lib64/",
        ]
        .map(|d| format!("{d}{n}"))
    })
    .find(|p| std::path::Path::new(p).exists() && !maps.contains(p.as_str()))
}

/// The target's thread blocked in system call `nr`.
fn blocked_in(pid: u32, nr: &[u64]) -> Option<u32> {
    super::super::threads(pid).ok()?.into_iter().find(|tid| {
        fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .is_some_and(|n| nr.contains(&n))
    })
}

fn python() -> Option<&'static str> {
    ["/usr/bin/python3", "/usr/local/bin/python3"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
}

/// TARGET, started and ready, its threads blocked in their calls.
fn target(python: &str) -> (Reaped, BufReader<std::process::ChildStdout>) {
    let mut child = Reaped(
        Command::new(python)
            .args(["-c", TARGET])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    std::thread::sleep(Duration::from_millis(300));
    (child, out)
}

/// Signals still reach TARGET's handler, it exits 0, and every call ended as it would have
/// untouched.
fn ends_untouched(mut child: Reaped, mut out: BufReader<std::process::ChildStdout>) {
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGUSR1) };
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    let status = child.0.wait().unwrap();
    assert!(status.success(), "{status}: {rest}");
    let results: Vec<&str> = rest.lines().collect();
    assert_eq!(
        results,
        [
            "epoll_wait 0 0",
            "futex -1 110",
            "nanosleep 0 0 True",
            "read 1 0"
        ],
        "a call saw the load"
    );
}

#[test]
fn blocked_threads_load_a_library_and_see_nothing() {
    let Some(python) = python() else {
        tracer_testkit::skip("no python3");
        return;
    };
    let (child, out) = target(python);
    let pid = child.0.id();
    let Some(lib) = some_library(pid) else {
        tracer_testkit::skip("no library to load");
        return;
    };
    // read, nanosleep / clock_nanosleep, futex, epoll_wait / epoll_pwait.
    for nr in [&[0][..], &[35, 230], &[202], &[232, 281]] {
        let tid = blocked_in(pid, nr).unwrap_or_else(|| panic!("no thread in syscall {nr:?}"));
        match load_on(pid, Some(tid), &lib, Duration::from_secs(2)) {
            Err(LoadError::Ptrace { source, .. }) if source.raw_os_error() == Some(libc::EPERM) => {
                tracer_testkit::skip("ptrace not permitted");
                return;
            }
            r => r.unwrap_or_else(|e| panic!("syscall {nr:?}: {e}")),
        }
    }
    assert!(fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap()
        .contains(&lib));
    ends_untouched(child, out);
}

#[test]
fn a_traced_process_is_refused() {
    let child = Reaped(Command::new("sleep").arg("5").spawn().unwrap());
    let pid = child.0.id();
    let (tx, rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    // Another thread holds it, as a debugger would.
    let holder = std::thread::spawn(move || {
        let t = Thread::seize(pid);
        tx.send(t.is_ok()).unwrap();
        let _ = done_rx.recv();
        drop(t);
    });
    if !rx.recv().unwrap() {
        tracer_testkit::skip("ptrace not permitted");
        return;
    }
    let r = load_library(pid, "/nonexistent.so", Duration::from_millis(200));
    assert!(
        matches!(&r, Err(LoadError::Traced { tracer, .. }) if *tracer == std::process::id()),
        "{r:?}"
    );
    done_tx.send(()).unwrap();
    holder.join().unwrap();
    drop(child);
}

#[test]
fn a_missing_library_is_refused_before_the_process_is_touched() {
    let child = Reaped(Command::new("sleep").arg("5").spawn().unwrap());
    std::thread::sleep(Duration::from_millis(100));
    let r = load_library(child.0.id(), "/nonexistent/lib.so", Duration::from_secs(1));
    assert!(matches!(&r, Err(LoadError::Library { .. })), "{r:?}");
}

#[test]
fn a_file_that_is_no_library_is_an_error_and_the_process_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let not_elf = dir.path().join("not.so");
    fs::write(&not_elf, "not a library\n").unwrap();
    let mut child = Reaped(Command::new("sleep").arg("1").spawn().unwrap());
    let pid = child.0.id();
    std::thread::sleep(Duration::from_millis(100));
    match load_library(pid, not_elf.to_str().unwrap(), Duration::from_secs(1)) {
        Err(LoadError::Call { what, .. }) => assert!(what.contains("did not load"), "{what}"),
        Err(LoadError::Ptrace { source, .. }) if source.raw_os_error() == Some(libc::EPERM) => {
            tracer_testkit::skip("ptrace not permitted");
        }
        r => panic!("{r:?}"),
    }
    let started = std::time::Instant::now();
    assert!(child.0.wait().unwrap().success());
    assert!(started.elapsed() < Duration::from_secs(2));
}

/// A library whose constructor takes `ms`, built with the C compiler; None without one.
fn slow_library(dir: &std::path::Path, ms: u32) -> Option<String> {
    let src = dir.join("slow.c");
    let lib = dir.join("libslow.so");
    fs::write(
        &src,
        format!(
            "#include <time.h>\n__attribute__((constructor)) static void slow(void) {{\n\
             struct timespec t = {{ {}, {} }}; nanosleep(&t, 0); }}\n",
            ms / 1000,
            (ms % 1000) * 1_000_000
        ),
    )
    .ok()?;
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .status()
        .ok()?;
    built.success().then(|| lib.to_str().unwrap().to_owned())
}

/// Run by [`a_loader_killed_mid_call_leaves_the_thread_whole`] in a process of its own, which
/// it kills while the library's constructor runs.
#[test]
#[ignore = "run by a_loader_killed_mid_call_leaves_the_thread_whole"]
fn load_for_a_parent() {
    let Ok(arg) = std::env::var("TRACER_TEST_LOAD") else {
        return;
    };
    let mut it = arg.splitn(3, ':');
    let (pid, tid, lib) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    let r = load_on(
        pid.parse().unwrap(),
        Some(tid.parse().unwrap()),
        lib,
        Duration::from_secs(2),
    );
    println!("loaded: {r:?}");
}

#[test]
fn a_loader_killed_mid_call_leaves_the_thread_whole() {
    let Some(python) = python() else {
        tracer_testkit::skip("no python3");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let Some(lib) = slow_library(dir.path(), 700) else {
        tracer_testkit::skip("no C compiler");
        return;
    };
    let (child, out) = target(python);
    let pid = child.0.id();
    let tid = blocked_in(pid, &[0]).expect("no thread in read");
    let mut loader = Reaped(
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "process::inject::tests::load_for_a_parent",
                "--ignored",
                "--nocapture",
            ])
            .env("TRACER_TEST_LOAD", format!("{pid}:{tid}:{lib}"))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // Mapped: the constructor runs now, for 700 ms. The loader dies there.
    let started = std::time::Instant::now();
    while !fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap()
        .contains(&lib)
    {
        if let Some(status) = loader.0.try_wait().unwrap() {
            let mut said = String::new();
            loader
                .0
                .stdout
                .take()
                .unwrap()
                .read_to_string(&mut said)
                .unwrap();
            if said.contains("EPERM") || said.contains("not permitted") {
                tracer_testkit::skip("ptrace not permitted");
                return;
            }
            panic!("the loader ended ({status}) before the library was mapped: {said}");
        }
        assert!(started.elapsed() < Duration::from_secs(5), "never mapped");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        loader.0.try_wait().unwrap().is_none(),
        "the call ended before the kill"
    );
    loader.0.kill().unwrap();
    loader.0.wait().unwrap();
    ends_untouched(child, out);
}

#[test]
fn the_dynamic_loader_is_locking_code() {
    for base in ["ld-linux-x86-64.so.2", "ld-2.31.so"] {
        assert!(is_loader(base) && may_hold_locks(base), "{base}");
    }
    assert!(!is_loader("libc.so.6") && may_hold_locks("libc.so.6"));
    assert!(!may_hold_locks("libpython3.12.so.1.0") && !may_hold_locks("ldconfig"));
}
