//! Installs, only when missing, what building the BPF programs needs, and the tests' CPython
//! 3.14/3.15 (see `cpython`).

use std::process::Command;

use anyhow::{Context, Result};

use crate::run;

/// bpf-linker 0.10.x links with the nightly rustc's own LLVM; later versions need a system LLVM.
const BPF_LINKER_VERSION: &str = "0.10.3";

pub fn setup() -> Result<()> {
    let installed = output(Command::new("rustup").args([
        "component",
        "list",
        "--toolchain",
        "nightly",
        "--installed",
    ]))
    .context("rustup must be installed with a nightly toolchain")?;
    if !installed.lines().any(|l| l.starts_with("rust-src")) {
        eprintln!("xtask: installing rust-src for nightly");
        run(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            "nightly",
        ]))?;
    }
    let have = output(Command::new("bpf-linker").arg("--version")).unwrap_or_default();
    if !have.contains(BPF_LINKER_VERSION) {
        eprintln!("xtask: installing bpf-linker {BPF_LINKER_VERSION}");
        run(Command::new("cargo").args([
            "install",
            "bpf-linker",
            "--version",
            BPF_LINKER_VERSION,
            "--locked",
            "--force",
        ]))?;
    }
    crate::cpython::setup();
    Ok(())
}

/// Go's toolchain, for `go tool pprof` (the pprof tests' ground truth), iproute2's `ip`, for
/// the fleet tests' network namespaces, bpftool, LLVM's objdump, and a Prometheus server to
/// scrape the daemons: from Debian's packages.
pub fn ensure_test_tools() -> Result<()> {
    ensure_package("go", &["version"], "golang-go")?;
    ensure_package("ip", &["-V"], "iproute2")?;
    // btf.rs's check of the kernel's BTF against bpftool's own reading.
    ensure_package("bpftool", &["version"], "bpftool")?;
    // `cargo xtask verifier`'s stack chains (`frames`) read the BPF object's code with it.
    ensure_package("llvm-objdump", &["--version"], "llvm")?;
    ensure_package("prometheus", &["--version"], "prometheus")
}

fn ensure_package(command: &str, args: &[&str], package: &str) -> Result<()> {
    if Command::new(command)
        .args(args)
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return Ok(());
    }
    let install = || {
        run(Command::new("apt-get")
            .args(["install", "-y", "-q", package])
            .env("DEBIAN_FRONTEND", "noninteractive"))
    };
    // A fresh machine may have no package lists yet.
    install().or_else(|_| {
        run(Command::new("apt-get").args(["update", "-q"]))?;
        install()
    })
}

/// A virtualenv under target/ with the third-party Python tools the tests use as ground truth
/// (gRPC clients, snakeviz, py-spy, OpenTelemetry's protobuf classes).
pub fn python_test_env() -> Result<std::path::PathBuf> {
    let venv = crate::root().join("target").join("test-venv");
    let python = venv.join("bin/python3");
    let want = [
        "grpcio",
        "grpcio-reflection",
        "grpcio-health-checking",
        "protobuf",
        "opentelemetry-proto",
        "snakeviz",
        "py-spy",
    ];
    if !python.exists() {
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    }
    let ok = venv.join("bin/py-spy").exists()
        && Command::new(&python)
            .args([
                "-c",
                "import grpc, grpc_reflection, grpc_health, snakeviz, opentelemetry.proto",
            ])
            .status()
            .is_ok_and(|s| s.success());
    if !ok {
        run(Command::new(&python)
            .args(["-m", "pip", "install", "--quiet"])
            .args(want))?;
    }
    Ok(venv)
}

/// A virtualenv under target/ with PyTorch from PyPI, for the DataLoader workers' test (its
/// own: ~5 GiB that no other test needs; ~1.5 minutes to install on a fresh machine).
pub fn torch_test_env() -> Result<std::path::PathBuf> {
    let venv = crate::root().join("target").join("torch-venv");
    let python = venv.join("bin/python3");
    if !python.exists() {
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    }
    let ok = Command::new(&python)
        .args(["-c", "import torch.utils.data"])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        run(Command::new(&python).args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-cache-dir",
            "torch",
        ]))?;
    }
    Ok(venv)
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    anyhow::ensure!(out.status.success(), "{cmd:?} failed");
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
