//! `cargo xtask bench …`: benchmarks that measure tracer side by side with other tools in one
//! run, on the same workloads, and print ratios.
//!
//! - `counting` (counting.rs): the cost of counting Python calls, against cProfile and bare
//!   uprobes;
//! - `sampling` (sampling.rs): the slowdown of a program sampled at 99 and 999 Hz, against
//!   py-spy and perf; then `off-cpu`;
//! - `off-cpu` (offcpu.rs): what recording off-CPU time costs at ~100,000 context switches
//!   a second, next to `perf sched record`;
//! - `tracing` (tracing.rs): the highest event rate tracerd drains with no loss, and the
//!   slowdown of a traced Python program next to counting mode's;
//! - `fleet` (fleet.rs): fan-out latency and merge time over 1, 4, 16 and 64 daemons;
//! - `cuda` (cuda.rs): the time tracer adds to each CUDA kernel launch, counting and tracing,
//!   next to an untraced run;
//! - `probes` (probes.rs): attaching and removing 1 to 1,000 uprobes, multi-uprobe links next
//!   to one perf event per probe, and what a SIGKILLed tracerd leaves behind;
//! - `first-start` (startup.rs): the first start of each kind of session on a fresh tracerd,
//!   which loads (and the kernel verifies) that kind's BPF programs;
//! - `ending` (ending.rs): the slowest request while a counting or tracing session with
//!   1,000 to 150,000 Python functions, or one counting 1,000 native functions in 20
//!   processes, ends (counts read, named, stored), next to the slowest while it runs;
//! - `interpreters` (interpreters.rs): the slowest request while a session on every process
//!   meets interpreters not probed yet, next to the slowest with none, and what their hold
//!   at exec costs those programs;
//! - `longevity` (longevity.rs): tracerd's memory, open files and database size over rounds of
//!   sessions, each round deleted.

mod counting;
mod cuda;
mod ending;
mod fleet;
mod interpreters;
mod longevity;
mod offcpu;
mod probes;
mod sampling;
mod startup;
mod tracing;

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command},
};

use anyhow::{Context, Result};

use crate::bin_dir;

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Which {
    Counting,
    Sampling,
    Tracing,
    Fleet,
    Cuda,
    Longevity,
    Probes,
    Ending,
    Interpreters,
    OffCpu,
    FirstStart,
}

pub fn run(which: Which) -> Result<()> {
    match which {
        Which::Counting => counting::run(),
        Which::Sampling => sampling::run(),
        Which::Tracing => tracing::run(),
        Which::Fleet => fleet::run(),
        Which::Cuda => cuda::run(),
        Which::Longevity => longevity::run(),
        Which::Probes => probes::run(),
        Which::Ending => ending::run(),
        Which::Interpreters => interpreters::run(),
        Which::OffCpu => offcpu::run(),
        Which::FirstStart => startup::run(),
    }
}

/// The time a workload printed for its own work (`SECONDS x.xxxxxx`).
fn seconds(out: &[u8]) -> Result<f64> {
    let text = String::from_utf8_lossy(out);
    text.lines()
        .find_map(|l| l.strip_prefix("SECONDS "))
        .context("workload printed no time")?
        .trim()
        .parse()
        .context("bad time")
}

/// `1234567` as `1,234,567`.
fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Events a session lost, all causes, from its JSON report.
fn losses(report: &serde_json::Value) -> u64 {
    report["losses"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| l["count"].as_u64())
        .sum()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// utime + stime of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    // utime, stime: fields 14 and 15 of stat, 12 and 13 after the command name.
    f.get(11).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// The interpreter `python3` runs (through pyenv's shim, where there is one), so that every
/// tool runs the very same binary.
fn python_executable() -> Result<PathBuf> {
    let out = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()?;
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
}

/// A tracerd serving a socket in `dir`, stopped with SIGTERM when dropped.
struct Daemon {
    child: Child,
    socket: PathBuf,
}

impl Daemon {
    fn start(dir: &Path) -> Result<Self> {
        let socket = dir.join("tracerd.sock");
        let child = Command::new(bin_dir().join("tracerd"))
            .arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .env("RUST_LOG", "warn")
            .spawn()
            .context("starting tracerd (benchmarks run as root)")?;
        let mut daemon = Self { child, socket };
        crate::wait_for_socket(&daemon.socket, &mut daemon.child)?;
        Ok(daemon)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The daemon's CPU time so far, in clock ticks.
    fn cpu_ticks(&self) -> u64 {
        cpu_ticks(self.pid())
    }
}

/// tracerctl talking to `daemon`.
fn tracerctl(daemon: &Daemon) -> Command {
    let mut cmd = Command::new(bin_dir().join("tracerctl"));
    cmd.arg("--socket").arg(&daemon.socket);
    cmd
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg(self.pid().to_string()).status();
        let _ = self.child.wait();
    }
}
