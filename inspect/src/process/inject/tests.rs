//! Real processes: threads blocked in `read` on a pipe, in `nanosleep`, in a futex and in
//! `epoll_wait` (which the kernel never restarts), with a signal handler installed, each
//! made to load a library; every call must end as it would have untouched.

use std::{
    io::{BufRead, BufReader, Read},
    process::{Command, Stdio},
    time::Duration,
};

use super::*;

/// Loads `lib` into `pid` (on thread `only` where given), for a caller who may.
fn load(pid: u32, only: Option<u32>, lib: &str, wait: Duration) -> Result<(), LoadError> {
    let pin = Pinned::open(pid).map_err(|_| LoadError::Gone)?;
    let load = Load {
        pin: &pin,
        path: lib,
        wait,
        check: &|_| Ok(()),
        cancelled: &|| false,
    };
    load_on(&load, only)
}

/// The tracer of thread `tid` of `pid` (0: none).
fn tracer_of(pid: u32, tid: u32) -> u32 {
    fs::read_to_string(format!("/proc/{pid}/task/{tid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("TracerPid:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

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
        match load(pid, Some(tid), &lib, Duration::from_secs(2)) {
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
    let r = load(pid, None, "/nonexistent.so", Duration::from_millis(200));
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
    let r = load(
        child.0.id(),
        None,
        "/nonexistent/lib.so",
        Duration::from_secs(1),
    );
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
    match load(pid, None, not_elf.to_str().unwrap(), Duration::from_secs(1)) {
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
    cc(
        dir,
        &format!(
            "#include <time.h>\n__attribute__((constructor)) static void slow(void) {{\n\
             struct timespec t = {{ {}, {} }}; nanosleep(&t, 0); }}\n",
            ms / 1000,
            (ms % 1000) * 1_000_000
        ),
        "libslow.so",
        &["-shared", "-fPIC"],
    )
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
    let r = load(
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

/// The check made on the stopped process refuses: nothing is written, the thread is let go
/// untraced, and every call ends as it would have.
#[test]
fn a_check_refused_on_the_stopped_process_touches_nothing() {
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
    let pin = Pinned::open(pid).unwrap();
    let asked = std::sync::atomic::AtomicUsize::new(0);
    let load = Load {
        pin: &pin,
        path: &lib,
        wait: Duration::from_secs(2),
        check: &|p| {
            asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            // Asked while a thread of `p` is stopped (traced, by a thread of this process).
            let stopped = crate::process::threads(p)
                .unwrap()
                .into_iter()
                .any(|t| tracer_of(p, t) != 0);
            Err(format!("no (a thread stopped: {stopped})"))
        },
        cancelled: &|| false,
    };
    match load.run() {
        Err(LoadError::Refused(why)) => assert_eq!(why, "no (a thread stopped: true)"),
        Err(LoadError::Ptrace { source, .. }) if source.raw_os_error() == Some(libc::EPERM) => {
            tracer_testkit::skip("ptrace not permitted");
            return;
        }
        r => panic!("{r:?}"),
    }
    assert_eq!(asked.into_inner(), 1);
    assert!(!fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap()
        .contains(&lib));
    for tid in crate::process::threads(pid).unwrap() {
        assert_eq!(tracer_of(pid, tid), 0, "thread {tid} left traced");
    }
    ends_untouched(child, out);
}

/// A process that executed another program after it was pinned (as a setuid one would be,
/// between the checks and the load) is never loaded into.
#[test]
fn a_program_executed_after_the_pin_is_not_loaded_into() {
    let Some(python) = python() else {
        tracer_testkit::skip("no python3");
        return;
    };
    let mut child = Reaped(
        Command::new(python)
            .args([
                "-c",
                "import os, sys; sys.stdin.readline(); os.execv('/bin/sleep', ['sleep', '5'])",
            ])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let pid = child.0.id();
    std::thread::sleep(Duration::from_millis(300));
    let pin = Pinned::open(pid).unwrap();
    use std::io::Write;
    child.0.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let exe = |p: u32| fs::read_link(format!("/proc/{p}/exe")).unwrap_or_default();
    let started = std::time::Instant::now();
    while !exe(pid).to_string_lossy().contains("sleep") {
        assert!(started.elapsed() < Duration::from_secs(5), "never exec'd");
        std::thread::sleep(Duration::from_millis(5));
    }
    let Some(lib) = some_library(pid) else {
        tracer_testkit::skip("no library to load");
        return;
    };
    let load = Load {
        pin: &pin,
        path: &lib,
        wait: Duration::from_secs(2),
        check: &|_| Ok(()),
        cancelled: &|| false,
    };
    match load.run() {
        Err(LoadError::Refused(why)) => assert!(why.contains("another program"), "{why}"),
        Err(LoadError::Ptrace { source, .. }) if source.raw_os_error() == Some(libc::EPERM) => {
            tracer_testkit::skip("ptrace not permitted");
            return;
        }
        r => panic!("{r:?}"),
    }
    assert!(!fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap()
        .contains(&lib));
    assert_eq!(tracer_of(pid, pid), 0);
}

/// Builds C source `code` into `out` with the C compiler (`flags` added); false without one.
fn cc(dir: &std::path::Path, code: &str, out: &str, flags: &[&str]) -> Option<String> {
    let src = dir.join(format!("{out}.c"));
    let bin = dir.join(out);
    fs::write(&src, code).ok()?;
    let built = Command::new("cc")
        .args(flags)
        .arg("-o")
        .arg(&bin)
        .arg(&src)
        .status()
        .ok()?;
    built.success().then(|| bin.to_str().unwrap().to_owned())
}

/// A library whose constructor blocks until a byte can be read from the FIFO `fifo`, and a
/// program whose second thread loads it (holding the dynamic loader's lock meanwhile) while
/// its main thread reads a byte from its standard input, printing the result and errno.
fn holds_the_loaders_lock(dir: &std::path::Path, fifo: &str) -> Option<(String, String)> {
    let lib = cc(
        dir,
        &format!(
            "#include <fcntl.h>\n#include <unistd.h>\n\
             __attribute__((constructor)) static void block(void) {{\n\
             char c; int fd = open(\"{fifo}\", O_RDONLY); read(fd, &c, 1); close(fd); }}\n"
        ),
        "libblock.so",
        &["-shared", "-fPIC"],
    )?;
    let program = cc(
        dir,
        &format!(
            "#include <dlfcn.h>\n#include <errno.h>\n#include <pthread.h>\n#include <stdio.h>\n\
             #include <unistd.h>\n\
             static void *hold(void *a) {{ (void)a; return dlopen(\"{lib}\", RTLD_NOW); }}\n\
             int main(void) {{ pthread_t t; pthread_create(&t, 0, hold, 0);\n\
             printf(\"ready\\n\"); fflush(stdout); char c;\n\
             long n = read(0, &c, 1); int e = errno; printf(\"read %ld %d\\n\", n, e);\n\
             void *h; pthread_join(t, &h); printf(\"done %d\\n\", h != 0); return 0; }}\n"
        ),
        "holder",
        &["-pthread"],
    )?;
    Some((lib, program))
}

/// A thread of the process holds the dynamic loader's lock (a library's constructor that
/// does not return): the call waits for that lock, is ended at its deadline, and the thread
/// is put back as it was; a cancelled load ends the same way at once. No thread stays
/// traced, and once the lock is let go the program runs on and sees nothing.
#[test]
fn a_call_waiting_for_the_loaders_lock_ends_at_its_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let Some((_, holder)) = holds_the_loaders_lock(dir.path(), fifo.to_str().unwrap()) else {
        tracer_testkit::skip("no C compiler");
        return;
    };
    let mut child = Reaped(
        Command::new(&holder)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let pid = child.0.id();
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    // The second thread is in the constructor (opening the FIFO), the main one in read.
    std::thread::sleep(Duration::from_millis(300));
    let Some(lib) = some_library(pid) else {
        tracer_testkit::skip("no library to load");
        return;
    };
    let started = std::time::Instant::now();
    match load(pid, Some(pid), &lib, Duration::from_secs(2)) {
        Err(LoadError::Deadline { what, .. }) => {
            assert!(what.contains("put back as it was"), "{what}")
        }
        Err(LoadError::Ptrace { source, .. }) if source.raw_os_error() == Some(libc::EPERM) => {
            tracer_testkit::skip("ptrace not permitted");
            return;
        }
        r => panic!("{r:?}"),
    }
    let took = started.elapsed();
    assert!(took < CALL_DEADLINE + Duration::from_secs(3), "{took:?}");
    assert_eq!(tracer_of(pid, pid), 0, "left traced");
    // Cancelled: ended at once, the same way.
    let pin = Pinned::open(pid).unwrap();
    let asked_at = std::time::Instant::now();
    let cancelled = || asked_at.elapsed() >= Duration::from_millis(300);
    let r = Load {
        pin: &pin,
        path: &lib,
        wait: Duration::from_secs(2),
        check: &|_| Ok(()),
        cancelled: &cancelled,
    };
    match load_on(&r, Some(pid)) {
        Err(LoadError::Deadline { what, .. }) => {
            assert!(
                what.contains("client went") && what.contains("put back"),
                "{what}"
            )
        }
        r => panic!("{r:?}"),
    }
    assert!(asked_at.elapsed() < Duration::from_secs(3));
    assert_eq!(tracer_of(pid, pid), 0, "left traced");
    // Let the constructor return: the program goes on, its read undisturbed.
    let mut w = fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    use std::io::Write;
    w.write_all(b"x").unwrap();
    child.0.stdin.take().unwrap().write_all(b"y").unwrap();
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    assert!(child.0.wait().unwrap().success(), "{rest}");
    assert_eq!(rest, "read 1 0\ndone 1\n");
    assert!(!fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|m| m.contains(&lib)));
}
