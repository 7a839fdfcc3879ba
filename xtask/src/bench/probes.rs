//! `cargo xtask bench probes`: what attaching and removing uprobes costs, with multi-uprobe
//! links (one per program and binary) next to one perf event per probe (`tracerd
//! --per-probe-uprobes`, what kernels before 6.6 get), in one run, for 1, 10, 100 and 1,000
//! probes on `tests/native/probe_target.c`'s functions:
//!
//! - attach: `tracerctl start` until it answers, the probes in place;
//! - detach: from `tracerctl stop` until the target's text (read through `/proc/PID/mem`) is
//!   the file's own again, and the slowest `tracerctl list` sent meanwhile;
//! - SIGKILL: from killing tracerd with the probes attached until the text is clean.

use std::{
    io::{BufRead, BufReader, Read, Seek, SeekFrom},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};

use crate::bin_dir;

const SIZES: [(usize, &str); 4] = [
    (1, "many_000"),
    (10, "many_00*"),
    (100, "many_0*"),
    (1000, "many_*"),
];

pub fn run() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let exe = build_target(dir.path())?;
    println!("counting sessions with --uprobe on functions of one binary; times in ms");
    println!(
        "{:<28} {:>6} {:>9} {:>9} {:>14} {:>9}",
        "path", "probes", "attach", "detach", "slowest list", "SIGKILL"
    );
    for (label, args) in [
        ("multi-uprobe links", &[][..]),
        ("one perf event per probe", &["--per-probe-uprobes"][..]),
    ] {
        for (n, pattern) in SIZES {
            let row = measure(dir.path(), &exe, args, pattern)?;
            println!(
                "{label:<28} {n:>6} {:>9.0} {:>9.0} {:>14.0} {:>9.0}",
                ms(row.attach),
                ms(row.detach),
                ms(row.slowest_list),
                ms(row.killed)
            );
        }
    }
    Ok(())
}

/// `tests/native/probe_target.c`, built into `dir`.
pub(super) fn build_target(dir: &Path) -> Result<PathBuf> {
    let exe = dir.join("probe_target");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/native/probe_target.c");
    let built = Command::new("cc")
        .args(["-O1", "-o"])
        .arg(&exe)
        .arg(&src)
        .status()
        .context("running cc")?;
    ensure!(built.success(), "building {}", src.display());
    Ok(exe)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

struct Row {
    attach: Duration,
    detach: Duration,
    slowest_list: Duration,
    killed: Duration,
}

fn measure(dir: &Path, exe: &Path, daemon_args: &[&str], pattern: &str) -> Result<Row> {
    let state = tempfile::tempdir_in(dir)?;
    let mut target = Target::start(exe)?;
    let spec = format!("{}:{pattern}", exe.display());
    let pid = target.child.id().to_string();
    let start = ["start", "--mode=counting", "--pid", &pid, "--uprobe", &spec];

    let mut daemon = Daemon::start(state.path(), daemon_args)?;
    let t = Instant::now();
    let id = daemon.ctl(&start)?;
    let attach = t.elapsed();
    ensure!(breakpoints(target.child.id()) > 0, "no probe in place");
    let t = Instant::now();
    daemon.ctl(&["stop", id.trim()])?;
    let mut slowest_list = Duration::ZERO;
    loop {
        let l = Instant::now();
        daemon.ctl(&["list"])?;
        slowest_list = slowest_list.max(l.elapsed());
        if breakpoints(target.child.id()) == 0 {
            break;
        }
    }
    let detach = t.elapsed();

    daemon.ctl(&start)?;
    let t = Instant::now();
    daemon.child.kill()?;
    while breakpoints(target.child.id()) > 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    let killed = t.elapsed();
    daemon.child.wait()?;
    target.finish()?;
    Ok(Row {
        attach,
        detach,
        slowest_list,
        killed,
    })
}

pub(super) struct Daemon {
    child: Child,
    socket: PathBuf,
}

impl Daemon {
    pub(super) fn start(dir: &Path, args: &[&str]) -> Result<Self> {
        let socket = dir.join("tracerd.sock");
        let mut child = Command::new(bin_dir().join("tracerd"))
            .arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .args(args)
            .env("RUST_LOG", "warn")
            .spawn()
            .context("starting tracerd (benchmarks run as root)")?;
        crate::wait_for_socket(&socket, &mut child)?;
        Ok(Self { child, socket })
    }

    /// tracerctl with these arguments, not run yet.
    pub(super) fn ctl_command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(bin_dir().join("tracerctl"));
        cmd.arg("--socket").arg(&self.socket).args(args);
        cmd
    }

    pub(super) fn ctl(&self, args: &[&str]) -> Result<String> {
        let out = self.ctl_command(args).output()?;
        ensure!(
            out.status.success(),
            "tracerctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8(out.stdout)?)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The probed program, started in its own directory (it stops when a file `stop` appears
/// there).
pub(super) struct Target {
    child: Child,
    dir: PathBuf,
}

impl Target {
    pub(super) fn start(exe: &Path) -> Result<Self> {
        let dir = exe.parent().context("target directory")?.to_owned();
        let mut child = Command::new(exe)
            .current_dir(&dir)
            .stdout(Stdio::piped())
            .spawn()?;
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().context("stdout")?).read_line(&mut line)?;
        ensure!(line == "ready\n", "target said {line:?}");
        Ok(Self { child, dir })
    }

    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(super) fn finish(&mut self) -> Result<()> {
        std::fs::write(self.dir.join("stop"), "")?;
        let status = self.child.wait()?;
        std::fs::remove_file(self.dir.join("stop"))?;
        ensure!(status.success(), "the target failed: {status}");
        Ok(())
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Bytes of `pid`'s executable mappings that differ from the files they map.
fn breakpoints(pid: u32) -> usize {
    let (Ok(maps), Ok(mut mem)) = (
        std::fs::read_to_string(format!("/proc/{pid}/maps")),
        std::fs::File::open(format!("/proc/{pid}/mem")),
    ) else {
        return 0;
    };
    let mut differ = 0;
    for line in maps.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 6 || !f[1].contains('x') || !f[5].starts_with('/') {
            continue;
        }
        let Some((start, end)) = f[0].split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end), Ok(offset)) = (
            u64::from_str_radix(start, 16),
            u64::from_str_radix(end, 16),
            usize::from_str_radix(f[2], 16),
        ) else {
            continue;
        };
        let Ok(file) = std::fs::read(f[5]) else {
            continue;
        };
        let from = offset.min(file.len());
        let to = (offset + (end - start) as usize).min(file.len());
        let mut text = vec![0u8; to - from];
        if mem.seek(SeekFrom::Start(start)).is_ok() && mem.read_exact(&mut text).is_ok() {
            differ += text
                .iter()
                .zip(&file[from..to])
                .filter(|(a, b)| a != b)
                .count();
        }
    }
    differ
}
