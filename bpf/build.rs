//! Builds the BPF programs (ebpf/probes) with nightly for bpfel-unknown-none and hands the
//! object to the daemon, which embeds it. Needs what `cargo xtask setup` installs.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

fn main() {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest.parent().unwrap();
    let probes = root.join("ebpf/probes");
    for dir in ["ebpf/probes/src", "ebpf/common/src"] {
        println!("cargo:rerun-if-changed={}", root.join(dir).display());
    }
    for file in [
        "ebpf/probes/Cargo.toml",
        "ebpf/probes/Cargo.lock",
        "ebpf/common/Cargo.toml",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(file).display());
    }
    // Its own target dir: the nested build must not wait on the lock of the outer one.
    let target_dir = env::var_os("TRACER_EBPF_TARGET_DIR")
        .map_or_else(|| root.join("target").join("ebpf"), PathBuf::from);

    let mut cmd = Command::new("rustup");
    cmd.args(["run", "nightly", "cargo", "build", "--release", "--locked"])
        .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
        .arg("--target-dir")
        .arg(&target_dir)
        .current_dir(&probes);
    // The outer build's compiler settings (clippy's wrapper, host rustflags, the stable toolchain) must not leak in.
    for (key, _) in env::vars_os() {
        let key = key.to_string_lossy();
        if (key.starts_with("CARGO_") && key != "CARGO_HOME")
            || key.starts_with("RUSTC")
            || key == "RUSTFLAGS"
            || key == "RUSTUP_TOOLCHAIN"
        {
            cmd.env_remove(key.as_ref());
        }
    }
    // BTF in the object: the verifier needs its function info for `bpf_loop` callbacks.
    cmd.env(
        "CARGO_TARGET_BPFEL_UNKNOWN_NONE_RUSTFLAGS",
        "-C debuginfo=2 -C link-arg=--btf",
    );
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("running `rustup run nightly cargo`: {e}"));
    assert!(
        status.success(),
        "building the BPF programs failed ({status}); run `cargo xtask setup` to install nightly rust-src and bpf-linker"
    );
    let object = target_dir.join("bpfel-unknown-none/release/tracer");
    let out = PathBuf::from(env::var_os("OUT_DIR").unwrap()).join("tracer.bpf.o");
    copy(&object, &out);
}

fn copy(from: &Path, to: &Path) {
    std::fs::copy(from, to)
        .unwrap_or_else(|e| panic!("copying {} to {}: {e}", from.display(), to.display()));
}
