//! Booting a kernel with virtme-ng and running a script inside: `vng --run IMAGE
//! --disable-kvm --force-9p` shows the guest this machine's root read-only over 9p (Debian's
//! generic kernels load the 9p and virtio modules from their package's tree, which virtme-ng
//! puts in its initramfs), with tmpfs or overlays on /tmp, /run, /var and /etc; the script's
//! stdout, stderr and exit status come back on virtio serial ports.

use std::{
    fs::File,
    io::{Read, Seek},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use super::{fetch, Kernel};
use crate::run;

/// virtme-ng's version, pinned: its guest init and command line change between releases.
const VNG_VERSION: &str = "1.42";

/// What the wrapper around the script prints to stderr after it: the guest's uptime before
/// and after the script, so that the boot time is the rest.
const MARK: &str = "xtask-kernels: uptime";

/// Modules for qemu's machine that the guest need not load: KVM (no nested guests), the
/// SATA controller and its CD drive, watchdogs, SMBus.
const SKIPPED_MODULES: [&str; 10] = [
    "kvm",
    "kvm_amd",
    "kvm_intel",
    "ahci",
    "sr_mod",
    "cdrom",
    "iTCO_wdt",
    "i6300esb",
    "i2c_i801",
    "lpc_ich",
];

/// Host variables the script also gets inside, where set.
const FORWARDED: [&str; 3] = ["TRACER_BIN_DIR", "RUST_LOG", "TRACER_SMOKE_LIMIT_S"];

/// A script's run in a booted kernel.
pub struct Output {
    /// `vng`'s status: the script's exit status, 255 when the guest ended without one (a
    /// panic), or the kill's when timed out.
    pub status: ExitStatus,
    pub timed_out: bool,
    pub stdout: String,
    pub stderr: String,
    /// The guest kernel's messages and its init's (`[   1.234] …` lines, which `vng --verbose`
    /// sends to stderr), from boot to power-off: where a panic or a BPF warning shows.
    pub console: String,
    /// From starting qemu to the script's start (the whole run less the script's time, so
    /// the guest's power-off is in it too); none when the script did not finish.
    pub boot: Option<Duration>,
    pub elapsed: Duration,
}

impl Output {
    pub fn success(&self) -> bool {
        !self.timed_out && self.status.success()
    }

    pub fn result(&self) -> String {
        if self.timed_out {
            return format!("timed out after {:.0} s", self.elapsed.as_secs_f64());
        }
        match self.status.code() {
            Some(0) => "ok".into(),
            Some(255) => "guest ended without a status (panic?)".into(),
            Some(code) => format!("failed: exit {code}"),
            None => format!("failed: {}", self.status),
        }
    }

    /// The script's own summary: its stdout lines that start with `row:`.
    pub fn rows(&self) -> Vec<String> {
        self.stdout
            .lines()
            .filter_map(|l| l.strip_prefix("row:"))
            .map(|l| l.trim().to_owned())
            .collect()
    }

    /// Everything, for a log file.
    pub fn log(&self) -> String {
        format!(
            "# {} (boot {} s, all {:.1} s)\n## stdout\n{}\n## stderr\n{}\n## console\n{}",
            self.result(),
            self.boot
                .map_or_else(|| "-".into(), |b| format!("{:.1}", b.as_secs_f64())),
            self.elapsed.as_secs_f64(),
            self.stdout,
            self.stderr,
            self.console
        )
    }
}

/// Boots `kernel` (downloading it the first time) and runs `script` with bash as root inside,
/// in the repository root (the same path as here), with `env` set besides the [`FORWARDED`]
/// host variables; qemu is killed after `timeout`.
pub fn run_in(
    kernel: &Kernel,
    script: &Path,
    env: &[(&str, String)],
    timeout: Duration,
) -> Result<Output> {
    let vng = vng()?;
    let image = fetch::image(kernel)?;
    let root = crate::root();
    let script = root.join(script);
    let mut command = String::new();
    let forwarded = FORWARDED
        .iter()
        .filter_map(|&key| Some((key, std::env::var(key).ok()?)));
    for (key, value) in forwarded.chain(env.iter().cloned()) {
        command += &format!("export {key}={}; ", quote(&value));
    }
    command += &format!(
        "s=$(cut -d' ' -f1 /proc/uptime); bash {}; rc=$?; \
         echo \"{MARK} $s $(cut -d' ' -f1 /proc/uptime)\" >&2; exit $rc",
        quote(&script.to_string_lossy())
    );
    let mut stdout = tempfile::tempfile()?;
    let mut stderr = tempfile::tempfile()?;
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![vng.parent().context("vng has a directory")?.to_path_buf()];
    paths.extend(std::env::split_paths(&path));
    let mut cmd = Command::new(&vng);
    cmd.arg("--run")
        .arg(&image)
        // KVM does not work on these machines (its device is there): TCG everywhere, so
        // timings compare.
        .args([
            "--disable-kvm",
            "--force-9p",
            "--cpus",
            "2",
            "--memory",
            "3G",
        ])
        // One host thread runs both vCPUs in turn: with a thread each (QEMU's default),
        // sid's kernel at times ran a text page the other vCPU had just patched, an int3
        // its handler no longer expected ("Oops: int3" in do_user_addr_fault, a panic).
        .arg("--qemu-opts=-accel tcg,thread=single")
        // udev's coldplug loads a module for each emulated device before the script starts;
        // these take seconds each under TCG and nothing here needs them (modprobe's own
        // blacklist: the kernel's module_blacklist would still read and unpack each).
        .args([
            "--append",
            &format!("modprobe.blacklist={}", SKIPPED_MODULES.join(",")),
        ])
        // The repository shared again at its own path: the guest puts a tmpfs or an overlay
        // on /tmp, /run, /var and /etc, which would hide a checkout under one of them.
        .arg(format!("--rodir={}", root.display()))
        .args(["--verbose", "--user", "root", "--cwd"])
        .arg(&root)
        .arg("--exec")
        .arg(&command)
        // vng runs virtme-run from PATH.
        .env("PATH", std::env::join_paths(paths)?)
        .stdin(Stdio::null())
        .stdout(stdout.try_clone()?)
        .stderr(stderr.try_clone()?)
        // Its own group, so that a timeout kills qemu (vng's child) with it.
        .process_group(0);
    let start = Instant::now();
    let mut child = cmd.spawn().context("starting vng")?;
    let mut timed_out = false;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if start.elapsed() > timeout {
            timed_out = true;
            let group = i32::try_from(child.id())?;
            // SAFETY: kill(2) on the process group the child leads; no memory is touched.
            unsafe { libc::kill(-group, libc::SIGKILL) };
            break child.wait()?;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let elapsed = start.elapsed();
    let stdout = read_all(&mut stdout)?;
    let (stderr, console, script_time) = split_stderr(&read_all(&mut stderr)?);
    Ok(Output {
        status,
        timed_out,
        stdout,
        stderr,
        console,
        boot: script_time.map(|t| elapsed.saturating_sub(t)),
        elapsed,
    })
}

fn read_all(file: &mut File) -> Result<String> {
    let mut bytes = Vec::new();
    file.rewind()?;
    file.read_to_end(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// vng's stderr as the script's, the console's, and the script's time that the wrapper's line
/// gives.
fn split_stderr(stderr: &str) -> (String, String, Option<Duration>) {
    let mut time = None;
    let mut rest = String::new();
    let mut console = String::new();
    for line in stderr.lines() {
        if is_console(line) {
            console += line;
            console.push('\n');
        } else if let Some(times) = line.strip_prefix(MARK) {
            let t: Vec<f64> = times
                .split_whitespace()
                .filter_map(|t| t.parse().ok())
                .collect();
            if let [start, end] = t[..] {
                time = Some(Duration::from_secs_f64((end - start).max(0.0)));
            }
        } else {
            rest += line;
            rest.push('\n');
        }
    }
    (rest, console, time)
}

/// A kernel message: `[` seconds `.` micros `] `.
fn is_console(line: &str) -> bool {
    line.strip_prefix('[')
        .and_then(|l| l.split_once("] "))
        .is_some_and(|(t, _)| {
            t.trim_start()
                .split_once('.')
                .is_some_and(|(s, us)| s.parse::<u64>().is_ok() && us.parse::<u64>().is_ok())
        })
}

/// A shell word: single quotes, each inner one closed, escaped and reopened.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The host's tools virtme-ng drives, installed from Debian's packages when missing, and
/// `vng` itself in a virtualenv under target/kernels.
fn vng() -> Result<PathBuf> {
    for (command, package) in [
        ("qemu-system-x86_64", "qemu-system-x86"),
        // virtme-ng's initramfs is busybox.
        ("busybox", "busybox-static"),
        // depmod: modules.dep for an unpacked package's modules.
        ("depmod", "kmod"),
        // The guest's init finds its script's serial ports by udev's /dev/virtio-ports links.
        ("udevadm", "udev"),
    ] {
        ensure_package(command, package)?;
    }
    let venv = crate::root().join("target/kernels/vng-venv");
    let vng = venv.join("bin/vng");
    let current = Command::new(&vng)
        .arg("--version")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(VNG_VERSION));
    if !current {
        eprintln!("xtask: installing virtme-ng {VNG_VERSION} in target/kernels/vng-venv");
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
        run(Command::new(venv.join("bin/pip")).args([
            "install",
            "-q",
            &format!("virtme-ng=={VNG_VERSION}"),
        ]))?;
    }
    Ok(vng)
}

/// Installs `package` unless `command` is on PATH.
fn ensure_package(command: &str, package: &str) -> Result<()> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    if std::env::split_paths(&path).any(|d| d.join(command).is_file()) {
        return Ok(());
    }
    eprintln!("xtask: installing {package} (for {command})");
    let install = || {
        run(Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends", package])
            .env("DEBIAN_FRONTEND", "noninteractive"))
    };
    // A fresh machine may have no package lists yet.
    install().or_else(|_| {
        run(Command::new("apt-get").args(["update", "-q"]))?;
        install()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stderr_split() {
        let (rest, console, time) = split_stderr(
            "a\n[    4.133153] Run /init as init process\nxtask-kernels: uptime 12.50 20.75\n\
             [x] b\n",
        );
        assert_eq!(rest, "a\n[x] b\n");
        assert_eq!(console, "[    4.133153] Run /init as init process\n");
        assert_eq!(time, Some(Duration::from_secs_f64(8.25)));
        assert_eq!(split_stderr("a\n"), ("a\n".into(), String::new(), None));
    }

    #[test]
    fn quoting() {
        assert_eq!(quote("a b"), "'a b'");
        assert_eq!(quote("it's"), r"'it'\''s'");
    }
}
