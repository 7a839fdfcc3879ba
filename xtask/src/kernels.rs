//! `cargo xtask kernels`: the kernel matrix. Users run older kernels than this machine's, so
//! Debian's kernel packages are booted under qemu (TCG: no KVM here) over a read-only 9p view
//! of this machine's own root, and a script runs inside as root in the repository root, with
//! the binaries already built under target/ usable as they are.
//!
//! - `fetch`: each kernel's package from the machine's Debian mirror (a private apt state per
//!   suite, as `cpython` does), unpacked once into `target/kernels/NAME/root`.
//! - `boot`: virtme-ng (`vng`, in a virtualenv under `target/kernels`) boots it and runs the
//!   script: [`run_in`].

mod boot;
mod fetch;

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, SystemTime},
};

use anyhow::{bail, Context, Result};

use boot::run_in;

/// One kernel of the matrix: the image Debian's generic flavour (`linux-image-amd64`, which
/// has 9p modules; the cloud flavour lacks them) depends on in `suite`.
pub struct Kernel {
    /// What `--kernel` takes and the table shows.
    pub name: &'static str,
    /// The Debian suite whose kernel this is.
    pub suite: &'static str,
}

/// The meta package whose dependency is the suite's current kernel image.
const FLAVOUR: &str = "linux-image-amd64";

/// Users' kernels as near as Debian's suites have them: bullseye's 5.10, bookworm's 6.1,
/// trixie's 6.12, and sid's newest. (5.15 and 6.8 are Ubuntu's; no Debian suite has them.)
pub const KERNELS: &[Kernel] = &[
    Kernel {
        name: "5.10",
        suite: "bullseye",
    },
    Kernel {
        name: "6.1",
        suite: "bookworm",
    },
    Kernel {
        name: "6.12",
        suite: "trixie",
    },
    Kernel {
        name: "sid",
        suite: "sid",
    },
];

/// A booted kernel may take minutes under TCG; one that does not finish in this (or in
/// `TRACER_KERNELS_TIMEOUT_S` seconds) is killed.
const TIMEOUT: Duration = Duration::from_secs(15 * 60);

fn timeout() -> Result<Duration> {
    match std::env::var("TRACER_KERNELS_TIMEOUT_S") {
        Ok(s) => Ok(Duration::from_secs(s.parse().with_context(|| {
            format!("TRACER_KERNELS_TIMEOUT_S={s:?} is not a number of seconds")
        })?)),
        Err(_) => Ok(TIMEOUT),
    }
}

/// The modes smoke.sh checks, each with a `row: MODE ok|wrong|failed: …` line: the table's
/// columns.
const MODES: [&str; 5] = ["counting", "sampling", "tracing", "off-cpu", "cuda"];

/// For each kernel named (all when none), runs `tests/kernels/smoke.sh` inside and prints a
/// table of boot and run times, each mode's result, the overall one and the script's `row:`
/// lines. Fails if any kernel's run did.
pub fn main(names: &[String]) -> Result<()> {
    let chosen: Vec<&Kernel> = if names.is_empty() {
        KERNELS.iter().collect()
    } else {
        names.iter().map(|n| by_name(n)).collect::<Result<_>>()?
    };
    let script = crate::root().join("tests/kernels/smoke.sh");
    let timeout = timeout()?;
    // The guest's root is read-only: tests/cuda's fake CUDA is built here, and smoke.sh
    // finds it by this variable (a `cuda failed` row without it).
    let mut env = Vec::new();
    match fake_cuda() {
        Ok(dir) => env.push(("TRACER_FAKECUDA_DIR", dir.to_string_lossy().into_owned())),
        Err(e) => eprintln!("xtask: no fake CUDA for the cuda check: {e:#}"),
    }
    let mut rows = Vec::new();
    for kernel in chosen {
        eprintln!("xtask: kernel {} ({})", kernel.name, kernel.suite);
        let row = match run_in(kernel, &script, &env, timeout) {
            Ok(out) => {
                let log = fetch::dir(kernel).join("smoke.log");
                std::fs::write(&log, out.log())?;
                eprintln!("xtask: {}'s output is in {}", kernel.name, show(&log));
                Row {
                    kernel: kernel.name,
                    boot: out.boot.map(|b| b.as_secs_f64()),
                    all: Some(out.elapsed.as_secs_f64()),
                    result: out.result(),
                    ok: out.success(),
                    lines: out.rows(),
                }
            }
            Err(e) => Row {
                kernel: kernel.name,
                boot: None,
                all: None,
                result: "not run".into(),
                ok: false,
                lines: vec![format!("{e:#}")],
            },
        };
        rows.push(row);
    }
    print_table(&rows);
    let failed: Vec<&str> = rows.iter().filter(|r| !r.ok).map(|r| r.kernel).collect();
    if !failed.is_empty() {
        bail!("failed on kernel(s): {}", failed.join(", "));
    }
    Ok(())
}

fn by_name(name: &str) -> Result<&'static Kernel> {
    if let Some(k) = KERNELS.iter().find(|k| k.name == name) {
        return Ok(k);
    }
    let known: Vec<&str> = KERNELS.iter().map(|k| k.name).collect();
    bail!("no kernel {name:?}; known: {}", known.join(", "))
}

/// A path under the repository root as relative to it, for messages.
fn show(path: &Path) -> String {
    path.strip_prefix(crate::root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// tests/cuda's fake libraries and programs, built into target/kernels/fakecuda when missing
/// or older than a source there.
fn fake_cuda() -> Result<PathBuf> {
    let sources = crate::root().join("tests/cuda");
    let out = crate::root().join("target/kernels/fakecuda");
    let built = out.join("cuda_app");
    let newest = std::fs::read_dir(&sources)?
        .filter_map(|e| e.ok()?.metadata().ok()?.modified().ok())
        .max()
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let current = built
        .metadata()
        .and_then(|m| m.modified())
        .is_ok_and(|t| t >= newest);
    if !current {
        eprintln!("xtask: building tests/cuda into {}", show(&out));
        // Its `built …` line to stderr: stdout is the table's.
        crate::run(
            Command::new("sh")
                .arg(sources.join("build.sh"))
                .arg(&out)
                .stdout(std::io::stderr()),
        )?;
    }
    Ok(out)
}

struct Row {
    kernel: &'static str,
    boot: Option<f64>,
    /// The whole run: boot, script and power-off.
    all: Option<f64>,
    result: String,
    ok: bool,
    lines: Vec<String>,
}

impl Row {
    /// `mode`'s result word in the script's rows (`counting ok: …`), `-` when it has none.
    fn mode(&self, mode: &str) -> &str {
        self.lines
            .iter()
            .filter_map(|l| l.strip_prefix(mode)?.strip_prefix(' '))
            .filter_map(|l| l.split_once(':').map(|(word, _)| word))
            .find(|w| ["ok", "wrong", "failed"].contains(w))
            .unwrap_or("-")
    }
}

fn print_table(rows: &[Row]) {
    let secs = |s: Option<f64>| s.map_or_else(|| "-".into(), |s| format!("{s:.0}"));
    print!("{:<8} {:>6} {:>5}", "kernel", "boot_s", "all_s");
    for mode in MODES {
        print!(" {mode:<8}");
    }
    println!(" result");
    for row in rows {
        print!(
            "{:<8} {:>6} {:>5}",
            row.kernel,
            secs(row.boot),
            secs(row.all)
        );
        for mode in MODES {
            print!(" {:<8}", row.mode(mode));
        }
        println!(" {}", row.result);
        for line in &row.lines {
            println!("{:<21} {line}", "");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_kernel_is_named_with_the_known_ones() {
        assert_eq!(by_name("6.12").unwrap().suite, "trixie");
        let err = by_name("5.15")
            .err()
            .expect("no 5.15 in the matrix")
            .to_string();
        assert_eq!(err, r#"no kernel "5.15"; known: 5.10, 6.1, 6.12, sid"#);
    }

    #[test]
    fn mode_results() {
        let row = Row {
            kernel: "6.1",
            boot: None,
            all: None,
            result: "ok".into(),
            ok: true,
            lines: vec![
                "counting ok: f called 1000 times".into(),
                "off-cpu wrong: no [off-CPU: sleep] frame".into(),
                "cuda failed: tracerctl start: exit 1: x: y".into(),
            ],
        };
        assert_eq!(row.mode("counting"), "ok");
        assert_eq!(row.mode("off-cpu"), "wrong");
        assert_eq!(row.mode("cuda"), "failed");
        assert_eq!(row.mode("tracing"), "-");
    }
}
