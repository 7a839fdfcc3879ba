//! The bench's floor: two bare uprobes made with `perf probe`, counted by `perf stat`.

use std::{
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{ensure, Context, Result};

/// `perf probe` uprobes at the entries of tests/cuda's `cudaLaunchKernel` and
/// `cuLaunchKernel`, counted by `perf stat`: what two uprobe traps a launch cost alone. Like
/// tracer's, they sit past an `endbr64` landing pad (the CET-built driver's), which the kernel
/// would otherwise single-step on every hit.
pub(super) struct BareProbes;

const GROUP: &str = "tracerbench_cuda";

impl BareProbes {
    pub(super) const EVENTS: [&'static str; 2] = [
        "tracerbench_cuda:cudaLaunchKernel",
        "tracerbench_cuda:cuLaunchKernel",
    ];

    pub(super) fn create(libs: &Path) -> Result<Self> {
        Self::remove();
        let probes = Self;
        for (lib, sym) in [
            ("libcudart.so.13", "cudaLaunchKernel"),
            ("libcuda.so.1", "cuLaunchKernel"),
        ] {
            let at = if starts_with_endbr64(&libs.join(lib), sym)? {
                format!("{sym}+4")
            } else {
                sym.to_owned()
            };
            let out = Command::new("perf")
                .args(["probe", "-q", "-x"])
                .arg(libs.join(lib))
                .args(["-a", &format!("{GROUP}:{sym}={at}")])
                .output()
                .context("running perf probe (Debian package linux-perf)")?;
            ensure!(
                out.status.success(),
                "perf probe {sym}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(probes)
    }

    /// `perf stat` counting both probes' hits in `pid`, its output on stderr.
    pub(super) fn stat(&self, pid: u32) -> Result<std::process::Child> {
        Command::new("perf")
            .args(["stat", "-x", ",", "-e", &Self::EVENTS.join(","), "-p"])
            .arg(pid.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("running perf stat")
    }

    /// (runtime, driver) hits in `perf stat -x ,`'s output.
    pub(super) fn hits(out: &str) -> (u64, u64) {
        let count = |event: &str| {
            out.lines()
                .find(|l| l.split(',').nth(2) == Some(event))
                .and_then(|l| l.split(',').next()?.parse().ok())
                .unwrap_or(0)
        };
        (count(Self::EVENTS[0]), count(Self::EVENTS[1]))
    }

    fn remove() {
        let _ = Command::new("perf")
            .args(["probe", "-q", "-d", &format!("{GROUP}:*")])
            .stderr(Stdio::null())
            .status();
    }
}

/// Whether `sym` in `lib` starts with `endbr64` (objdump, from binutils like perf's tools).
fn starts_with_endbr64(lib: &Path, sym: &str) -> Result<bool> {
    let out = Command::new("objdump")
        .args(["-d", "--no-show-raw-insn", &format!("--disassemble={sym}")])
        .arg(lib)
        .output()
        .context("running objdump (binutils)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let first = text
        .lines()
        .skip_while(|l| !l.ends_with(&format!("<{sym}>:")))
        .nth(1)
        .unwrap_or("");
    Ok(first.trim_end().ends_with("endbr64"))
}

impl Drop for BareProbes {
    fn drop(&mut self) {
        Self::remove();
    }
}
