//! Helpers for tracer's end-to-end tests: a real tracerd on a temporary socket and state
//! directory, tracerctl runs against it, and guards that clean up processes.
//!
//! The binaries come from `TRACER_BIN_DIR` (set by `cargo xtask test`), else `target/release`.

pub mod fleet;
pub mod timeline;
pub mod users;

use std::{
    collections::BTreeMap,
    os::unix::{fs::PermissionsExt, process::CommandExt},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

pub fn bin_dir() -> PathBuf {
    std::env::var_os("TRACER_BIN_DIR").map_or_else(
        || {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .unwrap()
                .join("target/release")
        },
        PathBuf::from,
    )
}

pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: build with `cargo xtask build` (or run `cargo xtask test`)",
        p.display()
    );
    p
}

/// True when running as root; otherwise prints why the test is skipped.
pub fn root_or_skip() -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    tracer_testkit::skip(format_args!(
        "needs root (BPF, perf events on other processes)"
    ));
    false
}

/// The interpreter the workloads run under: the real binary, not a shim, so that runs compare.
pub fn python() -> PathBuf {
    let out = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .expect("python3 on PATH");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

pub fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts")
        .join(name)
}

/// A file of the tests crate, e.g. `cuda/build.sh`.
pub fn test_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// A child killed (and reaped) on drop.
pub struct ChildGuard(pub Child);

impl ChildGuard {
    pub fn spawn(cmd: &mut Command) -> Self {
        Self(
            cmd.spawn()
                .unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}")),
        )
    }
    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Spawns `cmd` and waits for its first line of output, which must be `ready`.
    pub fn spawn_ready(cmd: &mut Command) -> Self {
        let mut child = Self::spawn(cmd.stdout(std::process::Stdio::piped()));
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.0.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line, "ready\n", "{cmd:?}");
        child
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[derive(Default)]
pub struct DaemonOptions {
    pub group: Option<String>,
    pub state_dir: Option<PathBuf>,
    /// More tracerd arguments.
    pub args: Vec<String>,
    /// Environment of tracerd (e.g. LD_LIBRARY_PATH for a stand-in NVML).
    pub env: Vec<(String, String)>,
    /// A file tracerd's stderr (its log) is appended to, for tests that read what it said.
    pub log: Option<PathBuf>,
    /// A command tracerd is run under (`setpriv …`), which execs it.
    pub wrapper: Vec<String>,
}

/// A running tracerd; SIGTERM and reaped on drop.
pub struct Daemon {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    child: Option<Child>,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: Option<PathBuf>,
    wrapper: Vec<String>,
}

impl Daemon {
    pub fn start() -> Self {
        Self::start_with(DaemonOptions::default())
    }

    pub fn start_with(opts: DaemonOptions) -> Self {
        let dir = tempfile::tempdir().unwrap();
        // Reachable by the unprivileged users of the access tests; the socket's own mode guards it.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let socket = dir.path().join("tracerd.sock");
        let state_dir = opts.state_dir.unwrap_or_else(|| dir.path().join("state"));
        let mut d = Daemon {
            dir,
            socket,
            state_dir,
            child: None,
            args: opts.args,
            env: opts.env,
            log: opts.log,
            wrapper: opts.wrapper,
        };
        d.spawn(opts.group.as_deref());
        d
    }

    fn spawn(&mut self, group: Option<&str>) {
        let mut cmd = match self.wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(bin("tracerd"));
                c
            }
            None => Command::new(bin("tracerd")),
        };
        cmd.arg("--socket")
            .arg(&self.socket)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .args(&self.args)
            // A test's own environment may ask for more.
            .env("RUST_LOG", "warn")
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        if let Some(g) = group {
            cmd.args(["--group", g]);
        }
        if let Some(log) = &self.log {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .expect("opening tracerd's log");
            cmd.stderr(file);
        }
        let mut child = cmd.spawn().expect("starting tracerd");
        let deadline = Instant::now() + Duration::from_secs(20);
        // Connected, not only there: a killed daemon leaves its socket file behind.
        while std::os::unix::net::UnixStream::connect(&self.socket).is_err() {
            if let Some(status) = child.try_wait().unwrap() {
                panic!("tracerd exited before listening: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "tracerd did not listen within 20 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child = Some(child);
    }

    /// Stops the daemon (SIGTERM) and starts it again on the same socket and state directory.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn(None);
    }

    /// tracerd's pid, to signal it.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("tracerd running").id()
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().unwrap().is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                    panic!("tracerd did not exit within 10 s of SIGTERM");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// Kills the daemon with SIGKILL (no shutdown of its own) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn ctl(&self) -> Command {
        let mut cmd = Command::new(bin("tracerctl"));
        cmd.arg("--socket").arg(&self.socket).stdin(Stdio::null());
        cmd
    }

    /// Session `id`'s report as `report --format json` prints it.
    pub fn report_json(&self, id: &str) -> serde_json::Value {
        serde_json::from_str(&self.ok(&["report", id, "--format", "json"])).unwrap()
    }

    /// Session `id`'s report in `format`, written by `report -o` (as a user saves a trace)
    /// and read back.
    pub fn export(&self, id: &str, format: &str) -> Vec<u8> {
        let path = self.dir.path().join(format!("{id}.{format}"));
        self.ok(&[
            "report",
            id,
            "--format",
            format,
            "-o",
            path.to_str().unwrap(),
        ]);
        std::fs::read(path).unwrap()
    }

    /// Runs tracerctl with these arguments to completion.
    pub fn run(&self, args: &[&str]) -> Output {
        self.ctl().args(args).output().expect("running tracerctl")
    }

    /// Runs tracerctl and expects success; returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "tracerctl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Runs `tracerctl ARGS` while sending `list` over and over: how many lists were answered
    /// before ARGS was, and its output.
    pub fn lists_answered_during(&self, args: &[&str]) -> (usize, String) {
        let mut cmd = self
            .ctl()
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        // Only an ordering margin: ARGS is in the daemon's queue before the lists.
        std::thread::sleep(Duration::from_millis(100));
        let mut answered = 0;
        let status = loop {
            if let Some(status) = cmd.try_wait().unwrap() {
                break status;
            }
            self.ok(&["list"]);
            // A list sent before ARGS came back, and answered first.
            if cmd.try_wait().unwrap().is_none() {
                answered += 1;
            }
        };
        assert!(status.success(), "{args:?} failed");
        let mut out = String::new();
        std::io::Read::read_to_string(&mut cmd.stdout.take().unwrap(), &mut out).unwrap();
        (answered, out)
    }

    /// The id of the session `tracerctl list` shows first (the newest), or of the newest
    /// one whose row contains `filter`.
    /// Starts continuous sampling of every process at 49 Hz, pushing 1 s windows to `url`
    /// (with `extra` arguments): the session's id.
    pub fn start_pushing(&self, url: &str, extra: &[&str]) -> String {
        let args = [
            "start",
            "--mode=sampling",
            "--all",
            "--continuous",
            "--frequency",
            "49",
            "--push",
            url,
            "--push-period",
            "1s",
        ];
        self.ok(&[&args[..], extra].concat()).trim().to_owned()
    }

    pub fn newest_session(&self, filter: &str) -> String {
        let list = self.ok(&["list"]);
        list.lines()
            .skip(1)
            .find(|l| l.contains(filter))
            .and_then(|l| l.split_whitespace().next())
            .unwrap_or_else(|| panic!("no session matching '{filter}' in:\n{list}"))
            .to_owned()
    }

    /// Runs tracerctl as another user.
    pub fn run_as(&self, uid: u32, gid: u32, args: &[&str], ctl: &Path) -> Output {
        let mut cmd = Command::new(ctl);
        cmd.arg("--socket")
            .arg(&self.socket)
            .args(args)
            .stdin(Stdio::null());
        // SAFETY: only async-signal-safe syscalls between fork and exec. Groups first, then
        // gid, then uid: each later step drops the right to do the earlier ones.
        unsafe {
            cmd.pre_exec(move || {
                let gid = nix::unistd::Gid::from_raw(gid);
                nix::unistd::setgroups(&[gid])?;
                nix::unistd::setgid(gid)?;
                nix::unistd::setuid(nix::unistd::Uid::from_raw(uid))?;
                Ok(())
            });
        }
        cmd.output().expect("running tracerctl as another user")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A failed tracerctl run: non-zero exit and exactly one line on stderr, which is returned.
pub fn one_line_error(out: &Output) -> String {
    assert!(
        !out.status.success(),
        "expected failure, got success: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let err = String::from_utf8(out.stderr.clone()).unwrap();
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "expected one line on stderr, got: {err:?}"
    );
    err.trim_end().to_owned()
}

/// The JSON counters of a report, by event name: Ok(value) or Err(unavailable reason).
pub fn counters(report: &serde_json::Value) -> Vec<(String, Result<u64, String>)> {
    report["counters"]
        .as_array()
        .expect("counters array")
        .iter()
        .map(|c| {
            let name = c["event"].as_str().unwrap().to_owned();
            let v = match (c.get("value"), c.get("unavailable")) {
                (Some(v), None) => Ok(v.as_u64().unwrap()),
                (None, Some(r)) => Err(r.as_str().unwrap().to_owned()),
                other => {
                    panic!("counter {name} must have exactly one of value/unavailable: {other:?}")
                }
            };
            (name, v)
        })
        .collect()
}

pub fn counter(report: &serde_json::Value, event: &str) -> Result<u64, String> {
    counters(report)
        .into_iter()
        .find(|(n, _)| n == event)
        .unwrap_or_else(|| panic!("no counter {event}"))
        .1
}

/// Waits until `f` holds, or panics after `secs`.
pub fn wait_until(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(
            Instant::now() < deadline,
            "timed out after {secs}s waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// CPython 3.10-3.15: pyenv's 3.10-3.13 builds (shared libpython, full symbols), the
/// distribution's python3.11 (interpreter in the executable, dynamic symbols only), and
/// [`chroot_interpreters`].
pub fn interpreters() -> Vec<PathBuf> {
    let root = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".pyenv")));
    let mut out = Vec::new();
    if let Some(Ok(dirs)) = root.map(|r| std::fs::read_dir(r.join("versions"))) {
        for d in dirs.filter_map(Result::ok) {
            let name = d.file_name().to_string_lossy().into_owned();
            for minor in 10..=13 {
                if name.starts_with(&format!("3.{minor}.")) && !name.contains('t') {
                    let exe = d.path().join(format!("bin/python3.{minor}"));
                    if exe.exists() {
                        out.push(exe);
                    }
                }
            }
        }
    }
    if Path::new("/usr/bin/python3.11").exists() {
        out.push("/usr/bin/python3.11".into());
    }
    out.sort();
    // Debian's 3.14 and 3.15 (interpreter in the executable, GCC 16, JIT built in but off)
    // and their libpython builds, each in a chroot of its own mount namespace.
    out.extend(chroot_interpreters());
    out
}

/// CPython 3.14 and 3.15 from Debian's sid and experimental, chrooted in `target/cpython-root`
/// (`cargo xtask setup` makes them): `static/python3.X`, Debian's build (interpreter in the
/// executable), and `shared/python3.X`, linked to libpython3.X.so. They are wrappers that run
/// the interpreter as the same pid with the workspace and /tmp at their host paths, so
/// `PYTHON SCRIPT ARGS…` works as with a host interpreter. From `TRACER_TEST_CPYTHON_BIN` (set by
/// `cargo xtask test`), else `target/cpython-bin`; prints why (once) when they are missing.
pub fn chroot_interpreters() -> Vec<PathBuf> {
    static SKIP: std::sync::Once = std::sync::Once::new();
    let dir = cpython_bin_dir();
    let all: Vec<PathBuf> = ["static", "shared"]
        .iter()
        .flat_map(|kind| ["3.14", "3.15"].map(|v| dir.join(kind).join(format!("python{v}"))))
        .collect();
    let found: Vec<PathBuf> = all.iter().filter(|p| p.exists()).cloned().collect();
    if found.len() < all.len() {
        SKIP.call_once(|| {
            let reason = std::fs::read_to_string(dir.join("not-set-up")).map_or_else(
                |_| {
                    format!(
                        "no wrappers in {}: run `cargo xtask setup` as root",
                        dir.display()
                    )
                },
                |r| r.trim().to_owned(),
            );
            tracer_testkit::skip(format_args!("CPython 3.14/3.15 not set up ({reason})"));
        });
    }
    found
}

/// Debian's CPython 3.15 (interpreter in the executable), whose own sampling profiler is
/// ground truth; None, saying so once, where it is not set up.
pub fn cpython_3_15() -> Option<PathBuf> {
    let found = chroot_interpreters()
        .into_iter()
        .find(|p| p.ends_with("static/python3.15"));
    if found.is_none() {
        tracer_testkit::skip("Debian's CPython 3.15 is not set up (cargo xtask setup)");
    }
    found
}

/// CPython 3.15's own sampler (`python3.15 -m profiling.sampling run`) with `options` (its
/// mode), at `rate_hz`, on `script` and its `args`: its collapsed stacks
/// (`tid:N;file:func:line;… count`). The chroot sees the host's /tmp at its own path.
pub fn cpython_sampler(
    python: &Path,
    options: &[&str],
    rate_hz: u32,
    script: &Path,
    args: &[&str],
) -> String {
    let out = tempfile::NamedTempFile::new().unwrap();
    let run = Command::new(python)
        .env("LC_ALL", "C")
        .args(["-m", "profiling.sampling", "run", "--collapsed"])
        .args(options)
        .args(["-r", &rate_hz.to_string(), "-o"])
        .arg(out.path())
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "profiling.sampling: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    std::fs::read_to_string(out.path()).unwrap()
}

/// The root directory [`chroot_interpreters`] run in: paths inside it (`/usr/bin/python3.14`,
/// as a traced process's maps name them from inside) are under it on the host.
pub fn cpython_root() -> Option<PathBuf> {
    std::fs::canonicalize(cpython_bin_dir().join("root"))
        .ok()
        .filter(|p| p.is_dir())
}

fn cpython_bin_dir() -> PathBuf {
    std::env::var_os("TRACER_TEST_CPYTHON_BIN").map_or_else(
        || {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .unwrap()
                .join("target/cpython-bin")
        },
        PathBuf::from,
    )
}

/// The Python with grpcio, grpcio-reflection and grpcio-health-checking (`cargo xtask test`
/// makes it: `TRACER_TEST_PYTHON`); None without them.
pub fn grpc_python() -> Option<PathBuf> {
    let py = std::env::var_os("TRACER_TEST_PYTHON")
        .map_or_else(|| PathBuf::from("python3"), PathBuf::from);
    let ok = Command::new(&py)
        .args(["-c", "import grpc, grpc_reflection, grpc_health"])
        .status()
        .is_ok_and(|s| s.success());
    ok.then_some(py)
}

/// The requests a test endpoint wrote to `path`: each a 4-byte big-endian length and the
/// request (a last one still being written is left out).
pub fn length_prefixed(path: &Path) -> Vec<Vec<u8>> {
    let data = std::fs::read(path).unwrap_or_default();
    let mut out = Vec::new();
    let mut at = 0;
    while at + 4 <= data.len() {
        let n = u32::from_be_bytes(data[at..at + 4].try_into().unwrap()) as usize;
        if at + 4 + n > data.len() {
            break;
        }
        out.push(data[at + 4..at + 4 + n].to_vec());
        at += 4 + n;
    }
    out
}

/// A loopback address with a port nothing listens on now (for a server a test starts).
pub fn free_loopback_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("binding a loopback port");
    l.local_addr().unwrap().to_string()
}

/// `program args…` as pid 1 of a pid namespace of its own, as in a container (`unshare -p -f
/// --mount-proc`; unshare's death, when the guard drops, kills it), and its pid here once it
/// has exec'd an executable named `python…`. Its threads' tids differ between the namespace
/// and the host.
pub fn spawn_python_in_pid_namespace(
    program: &Path,
    args: &[&std::ffi::OsStr],
) -> (ChildGuard, u32) {
    let guard = ChildGuard::spawn(
        Command::new("unshare")
            .args(["-p", "-f", "--mount-proc", "--kill-child"])
            .arg(program)
            .args(args),
    );
    let launcher = guard.pid();
    let mut pid = 0;
    wait_until(20, "the namespace's Python to start", || {
        pid = std::fs::read_to_string(format!("/proc/{launcher}/task/{launcher}/children"))
            .ok()
            .and_then(|c| c.split_whitespace().next()?.parse().ok())
            .unwrap_or(0);
        // Wrappers exec their way to the interpreter.
        pid != 0
            && std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|e| {
                e.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("python"))
            })
    });
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let nspid = status.lines().find(|l| l.starts_with("NSpid:")).unwrap();
    assert!(
        nspid.split_whitespace().last() == Some("1"),
        "pid {pid} is not its namespace's init: {nspid}"
    );
    (guard, pid)
}

/// The callers of each function of `script` in the pstats file `prof`, as pstats reads them
/// (run by `python`): {"line:name": {"file:line:name": [ncalls, primitive calls]}}.
pub fn pstats_callers(python: &Path, prof: &Path, script: &Path) -> serde_json::Value {
    let read = "import pstats, sys, json; s = pstats.Stats(sys.argv[1]).stats; \
                print(json.dumps({f'{k[1]}:{k[2]}': {f'{c[0]}:{c[1]}:{c[2]}': list(v[:2]) \
                for c, v in s[k][4].items()} for k in s if k[0] == sys.argv[2]}))";
    let out = Command::new(python)
        .args(["-c", read])
        .arg(prof)
        .arg(script)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "reading {}: {}",
        prof.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The test virtualenv's python3 (`TRACER_TEST_PYTHON`), which `cargo xtask test` makes with
/// the ground-truth tools beside it (py-spy, grpcio, OpenTelemetry's classes).
pub fn venv_python() -> PathBuf {
    std::env::var_os("TRACER_TEST_PYTHON")
        .expect("TRACER_TEST_PYTHON is not set: run the suite with `cargo xtask test`")
        .into()
}

/// `py-spy record --rate HZ --format raw --nonblocking FLAGS… -- COMMAND…` with the test
/// virtualenv's py-spy: its folded stacks, and the command's own output.
pub fn py_spy_record(
    hz: &str,
    flags: &[&str],
    command: &[&std::ffi::OsStr],
) -> (Vec<(Vec<String>, u64)>, Output) {
    let py_spy = venv_python().with_file_name("py-spy");
    assert!(
        py_spy.exists(),
        "{} is missing: run the suite with `cargo xtask test`",
        py_spy.display()
    );
    let raw = tempfile::NamedTempFile::new().unwrap();
    let out = Command::new(&py_spy)
        .args(["record", "--rate", hz, "--format", "raw", "--nonblocking"])
        .args(flags)
        .arg("-o")
        .arg(raw.path())
        .arg("--")
        .args(command)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "py-spy on {command:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (
        parse_folded(&std::fs::read_to_string(raw.path()).unwrap()),
        out,
    )
}

/// Folded stacks (`frame;frame;… value` lines, as tracer and py-spy write them): (frames
/// root first, value).
pub fn parse_folded(text: &str) -> Vec<(Vec<String>, u64)> {
    text.lines()
        .filter_map(|l| {
            let (stack, n) = l.rsplit_once(' ')?;
            Some((
                stack.split(';').map(str::to_owned).collect(),
                n.parse().ok()?,
            ))
        })
        .collect()
}

/// A program's own account of its calls (`CALLS {"name": n, ...}` on a line of `stdout`,
/// as c_threads.py prints it), beside the report's ncalls of the same names in `file`.
pub fn own_calls_and_counted(
    stdout: &str,
    report: &serde_json::Value,
    file: &Path,
) -> (BTreeMap<String, u64>, BTreeMap<String, u64>) {
    let own: BTreeMap<String, u64> = stdout
        .lines()
        .find_map(|l| l.strip_prefix("CALLS "))
        .and_then(|j| serde_json::from_str(j).ok())
        .unwrap_or_else(|| panic!("no CALLS line in {stdout:?}"));
    let mut counted: BTreeMap<String, u64> = own.keys().map(|k| (k.clone(), 0)).collect();
    for f in report["python"]["functions"].as_array().expect("functions") {
        if Path::new(f["filename"].as_str().unwrap_or("")) != file {
            continue;
        }
        let name = f["qualname"].as_str().unwrap_or("");
        if let Some(n) = counted.get_mut(name) {
            *n += f["ncalls"].as_u64().unwrap_or(0);
        }
    }
    (own, counted)
}
