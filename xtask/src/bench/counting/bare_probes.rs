//! Bare uprobes for `cargo xtask bench counting`: plain tracefs uprobes at tracer's probe
//! points counted by `perf stat`, and the watch that keeps other tools' probes out of the runs.

use std::{
    cell::Cell,
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::bench::seconds;
use crate::bin_dir;

/// Appends one line to a tracefs control file.
fn append(path: &Path, line: &str) -> std::io::Result<()> {
    use std::io::Write;
    writeln!(fs::OpenOptions::new().append(true).open(path)?, "{line}")
}

/// `RESUME handler +0x0: handler start (single-stepped)` as `RESUME+0x0 (single-stepped)`.
fn short(what: &str) -> String {
    let (head, tail) = what.split_once(':').unwrap_or((what, ""));
    let mut s = head.replacen(" handler +", "+", 1);
    if tail.contains("single-stepped") {
        s.push_str(" (single-stepped)");
    }
    s
}

/// Plain tracefs uprobes at tracer's probe points, counted by `perf stat`: the floor any
/// uprobe-based counter pays. Also the guard against other tools' probes: tracerd (any
/// tracerd on this machine, the tests' included) probes an interpreter's binary for every
/// process that maps it, so while another session probes the same binary every run here
/// pays for its probes. An idle interpreter kept running (the sentinel) shows them: a probed
/// instruction reads as int3 in its memory.
pub(super) struct BareProbes {
    /// The file probed: libpython, or the executable holding the eval loop.
    pub(super) binary: PathBuf,
    /// This interpreter's events (`tracerbench:i0p3`).
    events: Vec<String>,
    /// What each probe is, short: `RESUME_CHECK+0x26`.
    pub(super) points: Vec<String>,
    sentinel: Child,
    /// Per probe point: its address in the sentinel and the file's byte there.
    watch: Vec<(u64, u8)>,
    /// Runs repeated because other probes came and went during them.
    pub(super) retried: Cell<u32>,
    /// Seconds spent waiting for other probes to go.
    pub(super) waited: Cell<f64>,
    /// Runs measured with other probes on the binary all the same (after waiting or
    /// retrying long enough).
    pub(super) tainted: Cell<u32>,
}

const GROUP: &str = "tracerbench";

/// How long to wait for another tool's probes to go before measuring with them.
const WAIT_QUIET: Duration = Duration::from_secs(180);

impl BareProbes {
    /// `index` names this interpreter's events, apart from the other interpreters'.
    pub(super) fn create(python: &Path, index: usize) -> Result<Self> {
        // An idle interpreter shows which binary holds its eval loop, and stays as the sentinel.
        let mut sentinel = Command::new(python)
            .args(["-c", "import sys; sys.stdin.read()"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()?;
        let found = Self::inspect(sentinel.id());
        let (file, path, maps) = match found {
            Ok(f) => f,
            Err(e) => {
                let _ = sentinel.kill();
                let _ = sentinel.wait();
                return Err(e);
            }
        };
        // tracerd says where it probes, so the baseline probes the very same instructions.
        let out = Command::new(bin_dir().join("tracerd"))
            .arg("--show-python-probes")
            .arg(&path)
            .output()?;
        if !out.status.success() {
            bail!(
                "tracerd --show-python-probes: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let probes: Vec<(u64, String)> = String::from_utf8(out.stdout)?
            .lines()
            .filter_map(|l| {
                let (off, what) = l.split_once(' ')?;
                Some((
                    u64::from_str_radix(off.trim_start_matches("0x"), 16).ok()?,
                    what.to_owned(),
                ))
            })
            .collect();
        let image = fs::read(&path)?;
        let mut watch = Vec::new();
        for (offset, _) in &probes {
            let at = maps.iter().find_map(|(start, end, pgoff, name)| {
                (name == &file && (*pgoff..pgoff + (end - start)).contains(offset))
                    .then(|| start + offset - pgoff)
            });
            let byte = image.get(*offset as usize).copied();
            if let (Some(at), Some(byte)) = (at, byte) {
                watch.push((at, byte));
            }
        }
        let tracefs = Path::new("/sys/kernel/tracing");
        if !tracefs.join("uprobe_events").exists() {
            bail!("tracefs is not mounted at /sys/kernel/tracing");
        }
        let mut events = Vec::new();
        let mut points = Vec::new();
        for (i, (offset, what)) in probes.into_iter().enumerate() {
            let ev = format!("i{index}p{i}");
            let def = format!("p:{GROUP}/{ev} {}:{offset:#x}", path.display());
            append(&tracefs.join("uprobe_events"), &def)
                .with_context(|| format!("defining {def}"))?;
            events.push(format!("{GROUP}:{ev}"));
            points.push(short(&what));
        }
        Ok(Self {
            binary: path,
            events,
            points,
            sentinel,
            watch,
            retried: Cell::new(0),
            waited: Cell::new(0.0),
            tainted: Cell::new(0),
        })
    }

    /// The file holding an interpreter's eval loop, as its maps name it and as a host path,
    /// and its mappings (start, end, file offset, file). A wrapper execs its way to the
    /// interpreter: waits for it.
    #[allow(clippy::type_complexity)]
    fn inspect(pid: u32) -> Result<(String, PathBuf, Vec<(u64, u64, u64, String)>)> {
        let started = Instant::now();
        loop {
            let text = fs::read_to_string(format!("/proc/{pid}/maps"))?;
            let maps: Vec<(u64, u64, u64, String)> = text
                .lines()
                .filter_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    let (start, end) = f.first()?.split_once('-')?;
                    Some((
                        u64::from_str_radix(start, 16).ok()?,
                        u64::from_str_radix(end, 16).ok()?,
                        u64::from_str_radix(f.get(2)?, 16).ok()?,
                        (*f.get(5)?).to_owned(),
                    ))
                })
                .collect();
            let named = |prefix: &str| {
                maps.iter()
                    .map(|m| m.3.as_str())
                    .find(|p| p.rsplit('/').next().is_some_and(|n| n.starts_with(prefix)))
            };
            // libpython where the executable links to it, else the executable.
            if let Some(file) = named("libpython3.").or_else(|| named("python3")) {
                // A chroot's maps name the host's path; else look through the process's root.
                let path = fs::canonicalize(file)
                    .or_else(|_| fs::canonicalize(format!("/proc/{pid}/root{file}")))
                    .with_context(|| format!("finding {file}"))?;
                // Wait for libpython too, where the executable links to it.
                if named("libpython3.").is_some() || started.elapsed() > Duration::from_secs(1) {
                    return Ok((file.to_owned(), path, maps));
                }
            }
            if started.elapsed() > Duration::from_secs(10) {
                bail!("pid {pid} maps no python3 or libpython3 after 10 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether another tool's uprobe is on one of tracer's probe points now.
    fn foreign(&self) -> Result<bool> {
        use std::os::unix::fs::FileExt;
        let mem = fs::File::open(format!("/proc/{}/mem", self.sentinel.id()))?;
        for &(at, byte) in &self.watch {
            let mut b = [0u8];
            mem.read_exact_at(&mut b, at)
                .context("reading the sentinel interpreter's memory")?;
            if b[0] == 0xcc && byte != 0xcc {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Waits (up to [`WAIT_QUIET`]) until no other tool probes the binary.
    fn wait_quiet(&self) -> Result<bool> {
        let started = Instant::now();
        while self.foreign()? {
            if started.elapsed() > WAIT_QUIET {
                self.waited
                    .set(self.waited.get() + started.elapsed().as_secs_f64());
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        self.waited
            .set(self.waited.get() + started.elapsed().as_secs_f64());
        Ok(true)
    }

    /// Runs `f` with no other tool's probes on the binary before it or after it; a run they
    /// overlapped is repeated (three tries), else counted as tainted. `settle`: how long the
    /// probes of `f`'s own session may take to go once it has ended.
    pub(super) fn quiet<T>(&self, settle: Duration, mut f: impl FnMut() -> Result<T>) -> Result<T> {
        for attempt in 1.. {
            let before = self.wait_quiet()?;
            let r = f()?;
            let ended = Instant::now();
            let mut after = self.foreign()?;
            while after && ended.elapsed() < settle {
                std::thread::sleep(Duration::from_millis(20));
                after = self.foreign()?;
            }
            if before && !after {
                return Ok(r);
            }
            if attempt == 3 {
                self.tainted.set(self.tainted.get() + 1);
                return Ok(r);
            }
            self.retried.set(self.retried.get() + 1);
        }
        unreachable!()
    }

    pub(super) fn run(&self, python: &Path, script: &Path, name: &str) -> Result<(f64, u64)> {
        let out = Command::new("perf")
            .args(["stat", "-x", ",", "-e", &self.events.join(","), "--"])
            .arg(python)
            .arg(script)
            .args([name, "plain"])
            .output()
            .context("running perf stat (Debian package linux-perf)")?;
        if !out.status.success() {
            bail!("perf stat failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let hits = String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter_map(|l| l.split(',').next()?.parse::<u64>().ok())
            .sum::<u64>();
        Ok((seconds(&out.stdout)?, hits))
    }

    /// Removes every event of the group (this bench's, left by an interrupted run too).
    pub(super) fn remove_all() {
        Self::remove(|_| true);
    }

    fn remove(which: impl Fn(&str) -> bool) {
        let path = Path::new("/sys/kernel/tracing/uprobe_events");
        if let Ok(defs) = fs::read_to_string(path) {
            for line in defs.lines().filter(|l| l.contains(&format!("{GROUP}/"))) {
                if let Some((_, name)) = line
                    .split_whitespace()
                    .next()
                    .and_then(|n| n.split_once(':'))
                {
                    if which(name) {
                        let _ = append(path, &format!("-:{name}"));
                    }
                }
            }
        }
    }
}

impl Drop for BareProbes {
    fn drop(&mut self) {
        Self::remove(|name| self.events.iter().any(|e| e.replace(':', "/") == name));
        let _ = self.sentinel.kill();
        let _ = self.sentinel.wait();
    }
}
