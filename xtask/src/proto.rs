//! Generates the checked-in gRPC code, or checks that it is current.

use std::fs;

use anyhow::{bail, Context, Result};

use crate::root;

pub fn generate(check: bool) -> Result<()> {
    let proto_dir = root().join("proto/proto");
    let target = root().join("proto/src/generated");
    let out = tempfile::tempdir()?;
    // SAFETY (of intent): xtask is single-threaded here; set_var is only unsafe with threads around.
    std::env::set_var(
        "PROTOC",
        protoc_bin_vendored::protoc_bin_path().context("vendored protoc")?,
    );
    tonic_prost_build::configure()
        .out_dir(out.path())
        .file_descriptor_set_path(out.path().join("tracer_descriptor.bin"))
        .compile_protos(&[proto_dir.join("tracer.proto")], &[proto_dir])
        .context("generating code from tracer.proto")?;
    let mut stale = Vec::new();
    for name in ["tracer.v1.rs", "tracer_descriptor.bin"] {
        let fresh = fs::read(out.path().join(name))?;
        let path = target.join(name);
        if fs::read(&path).ok().as_deref() != Some(&fresh[..]) {
            stale.push(name);
            if !check {
                fs::create_dir_all(&target)?;
                fs::write(&path, &fresh)?;
            }
        }
    }
    if check && !stale.is_empty() {
        bail!(
            "proto/src/generated is out of date ({}): run `cargo xtask gen-proto`",
            stale.join(", ")
        );
    }
    if !check {
        eprintln!(
            "xtask: proto/src/generated {}",
            if stale.is_empty() {
                "unchanged"
            } else {
                "updated"
            }
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn generated_code_is_current() {
        super::generate(true).unwrap();
    }
}
