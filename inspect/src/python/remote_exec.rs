//! PEP 768 remote execution: asking a running CPython 3.14+ to run a Python script file, as
//! `sys.remote_exec(pid, path)` does, from outside (the daemon, as root, writing the
//! target's memory).
//!
//! Every `PyThreadState` holds a `_PyRemoteDebuggerSupport`: a pending flag (int32) and a
//! path buffer. A request writes the NUL-terminated path, sets the flag, and sets the
//! please-stop bit of that thread's `eval_breaker`; at the thread's next eval-breaker check
//! (loop back edges, most calls) the interpreter clears the flag and runs the file, if its
//! `config.remote_debug` is 1. Where these lie comes from the interpreter's own
//! `_Py_DebugOffsets`, read from the live process's `_PyRuntime`.

use std::io;

use crate::pinned::Pinned;

use super::{
    debug_offsets::DebugOffsets,
    memory::{self, read},
    runtime::{Runtime, RuntimeError},
};

/// `_PY_EVAL_PLEASE_STOP_BIT`: makes the thread's next eval-breaker check handle pending
/// work, the remote request among it.
const PLEASE_STOP_BIT: u64 = 1 << 5;

/// Enough of `_PyRuntime` for every declaration tracer knows (111 words in 3.15), with room
/// for a newer version's growth; `_PyRuntime` itself is hundreds of KiB.
const OFFSETS_READ: usize = 4096;

/// Bounds against a corrupt or changing list.
const MAX_INTERPRETERS: usize = 256;
const MAX_THREADS: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum RemoteExecError {
    #[error("process {pid} runs no CPython interpreter tracer can find")]
    NotPython { pid: u32 },
    #[error(transparent)]
    Runtime(RuntimeError),
    #[error("process {pid} runs CPython {version}: remote execution (PEP 768) came with 3.14")]
    Unsupported { pid: u32, version: String },
    #[error("process {pid} runs a free-threaded CPython build, which tracer does not ask to run scripts")]
    FreeThreaded { pid: u32 },
    #[error("process {pid} has remote debugging disabled (-X disable-remote-debug, PYTHON_DISABLE_REMOTE_DEBUG, or a build without it)")]
    Disabled { pid: u32 },
    #[error(
        "process {pid}'s main interpreter has no live threads (not initialised yet, or finalising)"
    )]
    NoThreads { pid: u32 },
    #[error("script path {path:?} is {len} bytes; the interpreter takes fewer than {max}")]
    PathTooLong { path: String, len: usize, max: u64 },
    #[error("script path {path:?} is empty or holds a NUL byte")]
    BadPath { path: String },
    #[error("process {pid}: CPython's debug offsets {why}")]
    BadOffsets { pid: u32, why: String },
    #[error("process {pid} exited while it was being asked")]
    Gone { pid: u32 },
    #[error("process {pid}: cannot {what}: {source}")]
    Memory {
        pid: u32,
        what: &'static str,
        #[source]
        source: io::Error,
    },
}

/// A request written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Requested {
    /// Thread states asked (each runs the script at its own next safe point, until withdrawn).
    pub threads: usize,
    /// The interpreter's version, "3.14.10".
    pub version: String,
}

/// Asks the pinned process to run the script at `script`, the path as the process sees it
/// (its root and mount namespace): every live thread of its main interpreter is asked, so
/// the first to reach a safe point runs it, and so may each of the others later unless
/// [`withdraw`]n. The script must therefore be idempotent. Whatever the caller checked about
/// the process since pinning it holds for the process written to: the writes go to its
/// memory only, and only once its pid is seen to be still its own.
pub fn request(p: &Pinned, script: &str) -> Result<Requested, RemoteExecError> {
    request_more(p, script, &mut Vec::new())
}

/// As [`request`], asking only the thread states not in `asked`, which it extends: a
/// request left pending while a process sits in native code reaches the threads it starts
/// meanwhile. `threads` counts those asked now.
pub fn request_more(
    p: &Pinned,
    script: &str,
    asked: &mut Vec<u64>,
) -> Result<Requested, RemoteExecError> {
    if script.is_empty() || script.contains('\0') {
        return Err(RemoteExecError::BadPath {
            path: script.to_owned(),
        });
    }
    let pid = p.pid();
    let target = Target::open(pid)?.pinned(p)?;
    target.check_enabled()?;
    let o = &target.offsets;
    if script.len() as u64 >= o.path_size {
        return Err(RemoteExecError::PathTooLong {
            path: script.to_owned(),
            len: script.len(),
            max: o.path_size,
        });
    }
    let all = target.thread_states()?;
    if all.is_empty() {
        return Err(RemoteExecError::NoThreads { pid });
    }
    // A thread state freed and made again at the same address is a new thread that was not
    // asked: the ones gone are forgotten first.
    asked.retain(|t| all.contains(t));
    let threads: Vec<u64> = all.into_iter().filter(|t| !asked.contains(t)).collect();
    let mut path = script.as_bytes().to_vec();
    path.push(0);
    for &tstate in &threads {
        // The interpreter reads the path only once it sees the flag, and the flag only once
        // the eval breaker sends it there: written in that order.
        target.write(tstate + o.support + o.path, &path, "write the script path")?;
        target.write(
            tstate + o.support + o.pending,
            &1i32.to_le_bytes(),
            "set the pending flag",
        )?;
        // Not atomic against the interpreter's own updates of the word: a bit it sets or
        // clears in that instant may be undone, the chance CPython's `sys.remote_exec`
        // takes too (no atomic update of another process's memory without stopping it).
        let breaker = target.read_u64(tstate + o.eval_breaker, "read the eval breaker")?;
        target.write(
            tstate + o.eval_breaker,
            &(breaker | PLEASE_STOP_BIT).to_le_bytes(),
            "set the eval breaker",
        )?;
        asked.push(tstate);
    }
    Ok(Requested {
        threads: threads.len(),
        version: target.version,
    })
}

/// Withdraws a [`request`] for `script` from every thread that has not taken it yet (its
/// flag still set, its buffer still holding `script`: another debugger's request stays).
/// The eval-breaker bit stays, a harmless extra check. Returns how many were withdrawn.
pub fn withdraw(p: &Pinned, script: &str) -> Result<usize, RemoteExecError> {
    let target = Target::open(p.pid())?.pinned(p)?;
    let o = &target.offsets;
    let mut want = script.as_bytes().to_vec();
    want.push(0);
    let mut withdrawn = 0;
    for tstate in target.thread_states()? {
        let mut pending = [0u8; 4];
        target.read(
            tstate + o.support + o.pending,
            &mut pending,
            "read the pending flag",
        )?;
        if i32::from_le_bytes(pending) != 1 || want.len() as u64 > o.path_size {
            continue;
        }
        let mut held = vec![0u8; want.len()];
        target.read(
            tstate + o.support + o.path,
            &mut held,
            "read the script path",
        )?;
        if held == want {
            target.write(
                tstate + o.support + o.pending,
                &0i32.to_le_bytes(),
                "clear the pending flag",
            )?;
            withdrawn += 1;
        }
    }
    Ok(withdrawn)
}

/// Whether [`request`] could ask process `pid` at all: its version, build, setting and
/// threads (the reason, if not, for a user).
pub fn remote_debugging(pid: u32) -> Result<(), RemoteExecError> {
    let target = Target::open(pid)?;
    target.check_enabled()?;
    if target.thread_states()?.is_empty() {
        return Err(RemoteExecError::NoThreads { pid });
    }
    Ok(())
}

/// The offsets remote execution uses, checked to lie inside their structs.
#[derive(Clone, Copy, Debug)]
struct Offsets {
    interpreters_head: u64,
    interp_id: u64,
    interp_next: u64,
    threads_head: u64,
    remote_debugging_enabled: u64,
    tstate_next: u64,
    native_thread_id: u64,
    eval_breaker: u64,
    /// `_PyRemoteDebuggerSupport` in `PyThreadState`; `pending` and `path` inside it.
    support: u64,
    pending: u64,
    path: u64,
    path_size: u64,
}

impl Offsets {
    fn from_debug_offsets(d: &DebugOffsets) -> Result<Self, String> {
        let get = |name: &str| d.get(name).ok_or_else(|| format!("have no {name}"));
        for name in [
            "runtime_state.interpreters_head",
            "interpreter_state.id",
            "interpreter_state.next",
            "interpreter_state.threads_head",
            "thread_state.next",
            "thread_state.native_thread_id",
        ] {
            if !d.plausible(name) {
                return Err(format!("give no sensible {name}"));
            }
        }
        let o = Self {
            interpreters_head: get("runtime_state.interpreters_head")?,
            interp_id: get("interpreter_state.id")?,
            interp_next: get("interpreter_state.next")?,
            threads_head: get("interpreter_state.threads_head")?,
            remote_debugging_enabled: get("debugger_support.remote_debugging_enabled")?,
            tstate_next: get("thread_state.next")?,
            native_thread_id: get("thread_state.native_thread_id")?,
            eval_breaker: get("debugger_support.eval_breaker")?,
            support: get("debugger_support.remote_debugger_support")?,
            pending: get("debugger_support.debugger_pending_call")?,
            path: get("debugger_support.debugger_script_path")?,
            path_size: get("debugger_support.debugger_script_path_size")?,
        };
        // These say where the daemon writes: each must lie inside its struct, and a newer
        // version read with an older declaration (whose words may be miscounted) must show
        // 3.14's and 3.15's `_PyRemoteDebuggerSupport` where that declaration has it.
        let tstate = get("thread_state.size")?;
        let interp = get("interpreter_state.size")?;
        let inside =
            |off: u64, len: u64, size: u64| off.checked_add(len).is_some_and(|e| e <= size);
        let sane = (2..=4096).contains(&o.path_size)
            && inside(o.eval_breaker, 8, tstate)
            && inside(o.remote_debugging_enabled, 4, interp)
            && o.support
                .checked_add(o.pending)
                .is_some_and(|p| inside(p, 4, tstate))
            && o.support
                .checked_add(o.path)
                .is_some_and(|p| inside(p, o.path_size, tstate))
            && (o.pending + 4 <= o.path || o.path + o.path_size <= o.pending)
            && (d.exact_declaration || (o.pending, o.path, o.path_size) == (0, 4, 512));
        if !sane {
            return Err(format!(
                "of CPython {} give no sensible debugger_support ({o:?})",
                d.version()
            ));
        }
        Ok(o)
    }
}

/// A process's main interpreter, ready to be asked.
struct Target<'a> {
    pid: u32,
    /// Where writes go; reads, by pid, are checked against it before any write.
    pinned: Option<&'a Pinned>,
    version: String,
    offsets: Offsets,
    /// The main interpreter's `PyInterpreterState *`.
    interp: u64,
}

impl<'a> Target<'a> {
    fn open(pid: u32) -> Result<Self, RemoteExecError> {
        let mapped = memory::runtime_of(pid).ok_or(RemoteExecError::NotPython { pid })?;
        let rt = Runtime::inspect_layout(&mapped.path).map_err(|e| match e {
            RuntimeError::FreeThreaded { .. } => RemoteExecError::FreeThreaded { pid },
            RuntimeError::Unsupported { minor, .. } => RemoteExecError::Unsupported {
                pid,
                version: format!("3.{minor}"),
            },
            e => RemoteExecError::Runtime(e),
        })?;
        // 3.10-3.12 have no debug offsets to read.
        if rt.version.minor < 13 {
            return Err(RemoteExecError::Unsupported {
                pid,
                version: format!("3.{}", rt.version.minor),
            });
        }
        let bad = |why: &str| RemoteExecError::BadOffsets {
            pid,
            why: why.to_owned(),
        };
        let runtime = rt
            .runtime_symbol
            .zip(rt.load_bias(mapped.start, mapped.file_offset))
            .map(|(sym, bias)| sym.wrapping_add(bias))
            .ok_or_else(|| bad("cannot be found: no _PyRuntime symbol, or no load bias"))?;
        // The live copy: what the running interpreter itself uses.
        let mut bytes = vec![0u8; OFFSETS_READ];
        read(pid, runtime, &mut bytes).map_err(|source| RemoteExecError::Memory {
            pid,
            what: "read _PyRuntime",
            source,
        })?;
        let d = DebugOffsets::parse(&bytes)
            .map_err(|e| bad(&e.to_string()))?
            .ok_or_else(|| bad("are missing: no xdebugpy cookie at _PyRuntime"))?;
        if d.minor() < 14 {
            return Err(RemoteExecError::Unsupported {
                pid,
                version: d.version(),
            });
        }
        if d.free_threaded {
            return Err(RemoteExecError::FreeThreaded { pid });
        }
        let offsets = Offsets::from_debug_offsets(&d).map_err(|why| bad(&why))?;
        let mut target = Self {
            pid,
            pinned: None,
            version: d.version(),
            offsets,
            interp: 0,
        };
        target.interp = target.main_interpreter(runtime)?;
        Ok(target)
    }

    /// Writes go to `p`'s memory; what was read by pid so far was read from it (it still
    /// holds its pid).
    fn pinned(mut self, p: &'a Pinned) -> Result<Self, RemoteExecError> {
        if !p.alive() {
            return Err(RemoteExecError::Gone { pid: self.pid });
        }
        self.pinned = Some(p);
        Ok(self)
    }

    /// The main interpreter (id 0, the first created, so the list's last): the list's head
    /// is the newest subinterpreter.
    fn main_interpreter(&self, runtime: u64) -> Result<u64, RemoteExecError> {
        let o = &self.offsets;
        let mut interp =
            self.read_u64(runtime + o.interpreters_head, "read the interpreter list")?;
        for _ in 0..MAX_INTERPRETERS {
            if interp == 0 {
                break;
            }
            if self.read_u64(interp + o.interp_id, "read an interpreter's id")? == 0 {
                return Ok(interp);
            }
            interp = self.read_u64(interp + o.interp_next, "read the interpreter list")?;
        }
        Err(RemoteExecError::NoThreads { pid: self.pid })
    }

    fn check_enabled(&self) -> Result<(), RemoteExecError> {
        let mut enabled = [0u8; 4];
        self.read(
            self.interp + self.offsets.remote_debugging_enabled,
            &mut enabled,
            "read config.remote_debug",
        )?;
        // The interpreter runs a request only when it is exactly 1.
        if i32::from_le_bytes(enabled) != 1 {
            return Err(RemoteExecError::Disabled { pid: self.pid });
        }
        Ok(())
    }

    /// The main interpreter's thread states whose threads live: one whose thread has
    /// exited is being freed, and no place to write. (A thread exiting between this walk and
    /// the writes that follow is a window of microseconds, as in CPython's own client.)
    fn thread_states(&self) -> Result<Vec<u64>, RemoteExecError> {
        let o = &self.offsets;
        let live = crate::process::tids_by_own_tid(self.pid).map_err(|source| {
            RemoteExecError::Memory {
                pid: self.pid,
                what: "list its threads",
                source,
            }
        })?;
        let mut out = Vec::new();
        let mut tstate = self.read_u64(self.interp + o.threads_head, "read the thread list")?;
        for _ in 0..MAX_THREADS {
            if tstate == 0 {
                break;
            }
            // `native_thread_id` is the tid in the process's own pid namespace; 0 until
            // the thread state is bound to a thread.
            let own = self.read_u64(tstate + o.native_thread_id, "read a thread's id")?;
            if u32::try_from(own).is_ok_and(|own| own != 0 && live.contains_key(&own)) {
                out.push(tstate);
            }
            tstate = self.read_u64(tstate + o.tstate_next, "read the thread list")?;
        }
        Ok(out)
    }

    fn read(&self, addr: u64, buf: &mut [u8], what: &'static str) -> Result<(), RemoteExecError> {
        match self.pinned {
            Some(p) => p.read(addr, buf),
            None => read(self.pid, addr, buf),
        }
        .map_err(|source| RemoteExecError::Memory {
            pid: self.pid,
            what,
            source,
        })
    }

    fn read_u64(&self, addr: u64, what: &'static str) -> Result<u64, RemoteExecError> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b, what)?;
        Ok(u64::from_le_bytes(b))
    }

    fn write(&self, addr: u64, bytes: &[u8], what: &'static str) -> Result<(), RemoteExecError> {
        let err = |source| RemoteExecError::Memory {
            pid: self.pid,
            what,
            source,
        };
        // Only into a pinned process: the one the caller checked.
        let p = self
            .pinned
            .ok_or_else(|| err(io::Error::other("the process is not pinned")))?;
        p.write(addr, bytes).map_err(err)
    }
}

#[cfg(test)]
mod tests {
    use std::{
        fs,
        io::Read,
        path::{Path, PathBuf},
        process::{Child, Command, Stdio},
        thread::sleep,
        time::{Duration, Instant},
    };

    use nix::{
        sys::signal::{kill, Signal},
        unistd::Pid,
    };

    use super::*;

    fn pin(pid: u32) -> Pinned {
        Pinned::open(pid).unwrap()
    }

    /// Debian's 3.14 or 3.15, chrooted by `cargo xtask setup`'s wrapper (which execs: the
    /// child's pid is the interpreter's; /tmp is the host's at the same path): `static`, the
    /// interpreter in the executable, or `shared`, in libpython.
    fn chroot_python(kind: &str, minor: u32) -> Option<PathBuf> {
        let dir = std::env::var_os("TRACER_TEST_CPYTHON_BIN").map_or_else(
            || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/cpython-bin"),
            PathBuf::from,
        );
        let p = dir.join(format!("{kind}/python3.{minor}"));
        if p.exists() {
            Some(p)
        } else {
            tracer_testkit::skip(format_args!(
                "no {} (cargo xtask setup, as root)",
                p.display()
            ));
            None
        }
    }

    fn pyenv_3_13() -> Option<PathBuf> {
        let root = std::env::var_os("PYENV_ROOT")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".pyenv")))?;
        let found = fs::read_dir(root.join("versions"))
            .ok()?
            .filter_map(Result::ok)
            .map(|d| d.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("3.13.") && !n.ends_with('t'))
            })
            .map(|p| p.join("bin/python3"))
            .find(|p| p.exists());
        if found.is_none() {
            tracer_testkit::skip(format_args!("no pyenv CPython 3.13"));
        }
        found
    }

    /// Spins until `stop` exists (`spin`: in the main thread; `sleep`: in a thread named
    /// `spinner`, the main thread asleep in `time.sleep` meanwhile), then prints "done" and
    /// exits 3. `ready` once the loop is about to start.
    const PROGRAM: &str = r#"
import os, sys, threading, time
d, mode = sys.argv[1], sys.argv[2]
stop = os.path.join(d, "stop")
def spin():
    while not os.path.exists(stop):
        pass
if mode == "spin":
    open(os.path.join(d, "ready"), "w").close()
    spin()
    print("done")
    sys.exit(3)
def spinner():
    spin()
    print("done", flush=True)
    os._exit(3)
threading.Thread(target=spinner, name="spinner").start()
open(os.path.join(d, "ready"), "w").close()
time.sleep(3600)
"#;

    struct Target {
        child: Child,
        dir: tempfile::TempDir,
    }

    impl Target {
        fn spawn(python: &Path, args: &[&str], env: &[(&str, &str)], mode: &str) -> Self {
            // Under /tmp whatever TMPDIR says: the chroot sees the host's /tmp only.
            let dir = tempfile::Builder::new()
                .prefix("remote-exec")
                .tempdir_in("/tmp")
                .unwrap();
            let program = dir.path().join("target.py");
            fs::write(&program, PROGRAM).unwrap();
            let script = dir.path().join("script.py");
            fs::write(
                &script,
                format!(
                    "import threading\nwith open({:?}, 'a') as f:\n    f.write(threading.current_thread().name + '\\n')\n",
                    dir.path().join("marker")
                ),
            )
            .unwrap();
            let child = Command::new(python)
                .args(args)
                .arg(&program)
                .arg(dir.path())
                .arg(mode)
                .envs(env.iter().copied())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let t = Self { child, dir };
            t.wait_for("ready", || t.dir.path().join("ready").exists());
            t
        }

        fn pid(&self) -> u32 {
            self.child.id()
        }

        fn script(&self) -> String {
            self.dir
                .path()
                .join("script.py")
                .to_str()
                .unwrap()
                .to_owned()
        }

        /// Who ran the script, one line each time.
        fn marker(&self) -> Option<String> {
            fs::read_to_string(self.dir.path().join("marker")).ok()
        }

        fn wait_for(&self, what: &str, mut done: impl FnMut() -> bool) {
            let start = Instant::now();
            while !done() {
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "timed out waiting for {what}"
                );
                sleep(Duration::from_millis(20));
            }
        }

        /// Stops it: (stdout, stderr, exit code).
        fn finish(mut self) -> (String, String, Option<i32>) {
            fs::write(self.dir.path().join("stop"), "").unwrap();
            let start = Instant::now();
            let status = loop {
                if let Some(s) = self.child.try_wait().unwrap() {
                    break s;
                }
                assert!(start.elapsed() < Duration::from_secs(30), "it did not exit");
                sleep(Duration::from_millis(20));
            };
            let (mut out, mut err) = (String::new(), String::new());
            self.child
                .stdout
                .take()
                .unwrap()
                .read_to_string(&mut out)
                .unwrap();
            self.child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            (out, err, status.code())
        }
    }

    impl Drop for Target {
        fn drop(&mut self) {
            // A failed test's process: stopped ones too (SIGKILL ends those).
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// Untouched but for the script: its own output and exit status.
    fn assert_unchanged(t: Target) {
        assert_eq!(t.finish(), ("done\n".into(), String::new(), Some(3)));
    }

    fn runs_the_script(kind: &str, minor: u32) {
        let Some(python) = chroot_python(kind, minor) else {
            return;
        };
        let t = Target::spawn(&python, &[], &[], "spin");
        let pid = t.pid();
        assert!(matches!(
            request(&pin(pid), &"/x".repeat(300)),
            Err(RemoteExecError::PathTooLong { max: 512, .. })
        ));
        assert!(matches!(
            request(&pin(pid), ""),
            Err(RemoteExecError::BadPath { .. })
        ));
        remote_debugging(pid).unwrap();
        let asked = request(&pin(pid), &t.script()).unwrap();
        assert_eq!(asked.threads, 1);
        assert!(
            asked.version.starts_with(&format!("3.{minor}.")),
            "{asked:?}"
        );
        t.wait_for("the script to run", || t.marker().is_some());
        assert_eq!(t.marker().unwrap(), "MainThread\n");
        // Taken: nothing left to withdraw.
        assert_eq!(withdraw(&pin(pid), &t.script()).unwrap(), 0);
        assert_unchanged(t);
    }

    #[test]
    fn a_spinning_3_14_runs_the_script() {
        runs_the_script("static", 14);
    }

    #[test]
    fn a_spinning_3_15_runs_the_script() {
        runs_the_script("static", 15);
    }

    #[test]
    fn a_spinning_3_14_with_libpython_runs_the_script() {
        runs_the_script("shared", 14);
    }

    #[test]
    fn a_spinning_3_15_with_libpython_runs_the_script() {
        runs_the_script("shared", 15);
    }

    /// The main thread blocked in `time.sleep`: another thread takes the request.
    fn any_thread_takes_it(minor: u32) {
        let Some(python) = chroot_python("static", minor) else {
            return;
        };
        let t = Target::spawn(&python, &[], &[], "sleep");
        let pid = t.pid();
        let asked = request(&pin(pid), &t.script()).unwrap();
        assert_eq!(asked.threads, 2);
        t.wait_for("the script to run", || t.marker().is_some());
        assert_eq!(t.marker().unwrap(), "spinner\n");
        // The sleeping main thread's request is still there.
        assert_eq!(withdraw(&pin(pid), &t.script()).unwrap(), 1);
        assert_unchanged(t);
    }

    #[test]
    fn any_thread_of_3_14_takes_it() {
        any_thread_takes_it(14);
    }

    #[test]
    fn any_thread_of_3_15_takes_it() {
        any_thread_takes_it(15);
    }

    fn refused_when_disabled(minor: u32, args: &[&str], env: &[(&str, &str)]) {
        let Some(python) = chroot_python("static", minor) else {
            return;
        };
        let t = Target::spawn(&python, args, env, "spin");
        let pid = t.pid();
        assert!(matches!(
            remote_debugging(pid),
            Err(RemoteExecError::Disabled { .. })
        ));
        assert!(matches!(
            request(&pin(pid), &t.script()),
            Err(RemoteExecError::Disabled { .. })
        ));
        sleep(Duration::from_secs(1));
        assert_eq!(t.marker(), None);
        assert_unchanged(t);
    }

    #[test]
    fn disabled_by_option_on_3_14() {
        refused_when_disabled(14, &["-X", "disable-remote-debug"], &[]);
    }

    #[test]
    fn disabled_by_environment_on_3_15() {
        refused_when_disabled(15, &[], &[("PYTHON_DISABLE_REMOTE_DEBUG", "1")]);
    }

    /// Withdrawn while the process is stopped, before any thread could take it.
    fn withdrawn_before_taken(minor: u32) {
        let Some(python) = chroot_python("static", minor) else {
            return;
        };
        let t = Target::spawn(&python, &[], &[], "spin");
        let pid = t.pid();
        let stopped = || {
            fs::read_dir(format!("/proc/{pid}/task"))
                .unwrap()
                .all(|task| {
                    let stat =
                        fs::read_to_string(task.unwrap().path().join("stat")).unwrap_or_default();
                    stat.rsplit_once(')')
                        .is_some_and(|(_, rest)| rest.trim_start().starts_with('T'))
                })
        };
        kill(Pid::from_raw(pid as i32), Signal::SIGSTOP).unwrap();
        t.wait_for("the process to stop", stopped);
        let asked = request(&pin(pid), &t.script()).unwrap();
        assert_eq!(withdraw(&pin(pid), &t.script()).unwrap(), asked.threads);
        // Another path's request is not ours to withdraw: none left anyway.
        assert_eq!(withdraw(&pin(pid), "/elsewhere.py").unwrap(), 0);
        kill(Pid::from_raw(pid as i32), Signal::SIGCONT).unwrap();
        // Many eval-breaker checks of the spinning loop.
        sleep(Duration::from_secs(1));
        assert_eq!(t.marker(), None);
        assert_unchanged(t);
    }

    #[test]
    fn withdrawn_on_3_14_before_taken() {
        withdrawn_before_taken(14);
    }

    #[test]
    fn withdrawn_on_3_15_before_taken() {
        withdrawn_before_taken(15);
    }

    #[test]
    fn no_remote_execution_before_3_14() {
        let Some(python) = pyenv_3_13() else {
            return;
        };
        let t = Target::spawn(&python, &[], &[], "spin");
        let pid = t.pid();
        for refused in [
            request(&pin(pid), &t.script()).map(|_| ()),
            remote_debugging(pid),
        ] {
            match refused {
                Err(RemoteExecError::Unsupported { version, .. }) => {
                    assert!(version.starts_with("3.13"), "{version}");
                }
                other => panic!("{other:?}"),
            }
        }
        assert_unchanged(t);
    }
}
