//! `cargo xtask …`: everything a developer or CI runs, as one Rust program.

mod bench;
mod cpython;
mod frames;
mod kernels;
mod layers;
mod package;
mod proto;
mod suite;
mod toolchain;
mod verifier;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "tracer's developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what the BPF build needs (nightly rust-src, bpf-linker 0.10.3) and the tests'
    /// CPython 3.14/3.15 (Debian sid/experimental, in target/cpython-root), only what is missing.
    Setup,
    /// Set up, then build tracerd and tracerctl (release), BPF programs included.
    Build,
    /// Regenerate proto/src/generated from proto/proto/tracer.proto.
    GenProto {
        /// Fail instead of writing when the checked-in code differs from a fresh generation.
        #[arg(long)]
        check: bool,
    },
    /// Print CPython struct offsets from each installed 3.10-3.13's own headers (gcc needed),
    /// to check or extend inspect/src/python/layout.rs.
    PyLayouts,
    /// The main job: build, start tracerd, profile examples/app.py in counting mode, print the report.
    Demo,
    /// The whole test suite: formatting, lints, generated code, unit and end-to-end tests (needs root).
    Test,
    /// Only the layout checks `test` starts with: crate layers, import circles, file sizes.
    Layers,
    /// Build, then print each BPF program's deepest stack (the verifier allows 512 bytes a
    /// call chain) and the functions on it.
    Frames,
    /// Build, then load every BPF program on this kernel and print the verifier's figures
    /// for each; fails over a quarter of its instruction limit or over 448 stack bytes.
    Verifier,
    /// Build, then a Debian package (tracerd, tracerctl, their libraries, the systemd unit,
    /// /etc/tracer/tracerd.toml, man pages, completions) in target/package/ or --out.
    Package {
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Benchmarks that print ratios measured side by side in one run (needs root and perf).
    Bench {
        #[arg(value_enum)]
        which: bench::Which,
    },
    /// Boot Debian's kernels (5.10, 6.1, 6.12, sid's) under qemu over a read-only view of this
    /// machine and run tests/kernels/smoke.sh in each with the binaries already built; print a
    /// table (needs root; downloads cached in target/kernels).
    Kernels {
        /// Only these kernels (repeatable); all when none.
        #[arg(long)]
        kernel: Vec<String>,
    },
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::Setup => toolchain::setup(),
        Task::Build => build(),
        Task::GenProto { check } => proto::generate(check),
        Task::Demo => demo(),
        Task::PyLayouts => py_layouts(),
        Task::Test => test(),
        Task::Layers => layers::check(&root()),
        Task::Frames => {
            build()?;
            frames::print()
        }
        Task::Verifier => {
            build()?;
            verifier::check()
        }
        Task::Package { out } => {
            build()?;
            package::main(out)
        }
        Task::Bench { which } => {
            build()?;
            bench::run(which)
        }
        Task::Kernels { kernel } => kernels::main(&kernel),
    }
}

/// The workspace root (this crate lives one level below it).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask has a parent")
        .to_path_buf()
}

/// Where release binaries land.
pub fn bin_dir() -> PathBuf {
    root().join("target").join("release")
}

/// Runs a command to completion, failing with its name when it fails.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(root());
    cmd
}

fn build() -> Result<()> {
    toolchain::setup()?;
    build_binaries()
}

/// tracerd and tracerctl, and beside them the CUPTI injection library tracerctl's
/// `--gpu-times` puts (target/release/libtracer_cupti.so) and the in-process Python counter
/// tracerd loads into CPython 3.12+ processes (libtracer_pycount.so) with the loader it
/// preloads into launched commands (libtracer_pystart.so).
fn build_binaries() -> Result<()> {
    run(cargo().args([
        "build",
        "--release",
        "--bin",
        "tracerd",
        "--bin",
        "tracerctl",
    ]))?;
    run(cargo().args([
        "build",
        "--release",
        "-p",
        "tracer-cupti",
        "-p",
        "tracer-pycount",
        "-p",
        "tracer-pystart",
    ]))
}

fn demo() -> Result<()> {
    build()?;
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("tracerd.sock");
    let bin = bin_dir();
    let mut daemon = Command::new(bin.join("tracerd"))
        .arg("--socket")
        .arg(&socket)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env("RUST_LOG", "warn")
        .spawn()
        .context("starting tracerd (the demo must run as root)")?;
    let result = (|| {
        wait_for_socket(&socket, &mut daemon)?;
        let events = "task-clock,page-faults,context-switches,cycles";
        println!("$ tracerctl start --mode=counting --python --events {events} --limit 15 -- python3 examples/app.py");
        run(Command::new(bin.join("tracerctl"))
            .arg("--socket")
            .arg(&socket)
            .args([
                "start",
                "--mode=counting",
                "--python",
                "--events",
                events,
                "--limit",
                "15",
                "--",
                "python3",
            ])
            .arg(root().join("examples/app.py")))?;
        // Sampling: where the time goes, Python and native frames in one stack.
        println!("\n$ tracerctl start --mode=sampling --frequency 999 --limit 15 -- python3 examples/app.py");
        let out = Command::new(bin.join("tracerctl"))
            .arg("--socket")
            .arg(&socket)
            .args([
                "start",
                "--mode=sampling",
                "--frequency",
                "999",
                "--limit",
                "15",
                "--",
                "python3",
            ])
            .arg(root().join("examples/app.py"))
            .output()
            .context("running tracerctl")?;
        print!("{}", String::from_utf8_lossy(&out.stdout));
        if !out.status.success() {
            bail!("sampling failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let id = session_id(&out.stdout)?;
        let svg = root().join("target").join("demo-flame.svg");
        run(Command::new(bin.join("tracerctl"))
            .arg("--socket")
            .arg(&socket)
            .args(["report", &id, "--format", "svg", "-o"])
            .arg(&svg))?;
        println!("flame graph: {}", svg.display());
        // Tracing: every call with its time, as a timeline for Perfetto UI.
        println!("\n$ tracerctl start --mode=tracing --limit 5 -- python3 examples/app.py");
        let out = Command::new(bin.join("tracerctl"))
            .arg("--socket")
            .arg(&socket)
            .args(["start", "--mode=tracing", "--limit", "5", "--", "python3"])
            .arg(root().join("examples/app.py"))
            .output()
            .context("running tracerctl")?;
        print!("{}", String::from_utf8_lossy(&out.stdout));
        if !out.status.success() {
            bail!("tracing failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let id = session_id(&out.stdout)?;
        let trace = root().join("target").join("demo-trace.pftrace");
        run(Command::new(bin.join("tracerctl"))
            .arg("--socket")
            .arg(&socket)
            .args(["report", &id, "--format", "perfetto", "-o"])
            .arg(&trace))?;
        println!("timeline (open in ui.perfetto.dev): {}", trace.display());
        // The same command under perf stat, for comparison, where perf is installed.
        if Command::new("perf")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            println!("\n$ perf stat -e {events} -- python3 examples/app.py");
            run(Command::new("perf")
                .args(["stat", "-e", events, "--", "python3"])
                .arg(root().join("examples/app.py")))?;
        }
        Ok(())
    })();
    // SIGTERM lets the daemon close sessions and persist their reports.
    let _ = Command::new("kill").arg(daemon.id().to_string()).status();
    let _ = daemon.wait();
    result
}

/// The session id in the first line of a report table (`session ID · …`).
fn session_id(report: &[u8]) -> Result<String> {
    Ok(String::from_utf8_lossy(report)
        .lines()
        .find_map(|l| l.strip_prefix("session "))
        .and_then(|l| l.split_whitespace().next())
        .context("no session id in tracerctl's report")?
        .to_owned())
}

pub fn wait_for_socket(socket: &Path, daemon: &mut std::process::Child) -> Result<()> {
    for _ in 0..200 {
        if socket.exists() {
            return Ok(());
        }
        if let Some(status) = daemon.try_wait()? {
            bail!("tracerd exited before listening: {status}");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    bail!("tracerd did not create {} within 10 s", socket.display())
}

fn test() -> Result<()> {
    toolchain::setup()?;
    run(cargo().args(["fmt", "--all", "--check"]))?;
    proto::generate(true)?;
    layers::check(&root())?;
    run(cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--release",
        "--",
        "-D",
        "warnings",
    ]))?;
    let venv = toolchain::python_test_env()?;
    let torch = toolchain::torch_test_env()?;
    toolchain::ensure_test_tools()?;
    build_binaries()?;
    // Every program loads here with a margin the verifier of another kernel still allows.
    verifier::check()?;
    // And on the oldest kernel tracer supports and the newest, booted under qemu: a few
    // minutes each (docs/KERNELS.md); the others on demand.
    kernels::main(&["6.1".into(), "sid".into()])?;
    // The package the service tests install (tests/tests/service.rs).
    let package_dir = root().join("target/package");
    std::fs::create_dir_all(&package_dir)?;
    let deb = package::package(&bin_dir(), &package_dir)?;
    let mut test = cargo();
    test.args([
        "test",
        "--workspace",
        "--release",
        "--no-fail-fast",
        "--",
        "--test-threads=1",
    ])
    .env("TRACER_BIN_DIR", bin_dir())
    .env("TRACER_TEST_PYTHON", venv.join("bin/python3"))
    .env("TRACER_TEST_TORCH_PYTHON", torch.join("bin/python3"))
    .env("TRACER_TEST_DEB", &deb);
    if let Some(dir) = cpython::installed_bin_dir() {
        test.env("TRACER_TEST_CPYTHON_BIN", dir);
    }
    suite::run(&mut test, &root().join("target").join("skipped-tests.log"))
}

/// Compiles xtask/c/cpython_layout.c against every pyenv CPython 3.10-3.13 and runs it.
fn py_layouts() -> Result<()> {
    let out = Command::new("pyenv")
        .arg("root")
        .output()
        .context("pyenv is needed to find interpreters' headers")?;
    let versions = Path::new(String::from_utf8(out.stdout)?.trim()).join("versions");
    let src = root().join("xtask/c/cpython_layout.c");
    let dir = tempfile::tempdir()?;
    let mut found: Vec<PathBuf> = std::fs::read_dir(&versions)?
        .filter_map(|e| Some(e.ok()?.path()))
        .collect();
    found.sort();
    for prefix in found {
        let name = prefix
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let Some(minor) = ["3.10.", "3.11.", "3.12.", "3.13."]
            .iter()
            .find(|m| name.starts_with(**m))
        else {
            continue;
        };
        let include = prefix
            .join("include")
            .join(format!("python{}", minor.trim_end_matches('.')));
        let exe = dir.path().join(&name);
        run(Command::new("gcc")
            .arg("-I")
            .arg(&include)
            .arg("-I")
            .arg(include.join("internal"))
            .arg("-o")
            .arg(&exe)
            .arg(&src))?;
        run(&mut Command::new(&exe))?;
    }
    Ok(())
}
