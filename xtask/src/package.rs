//! `cargo xtask package`: a Debian package of tracer, staged under `target/package/` and
//! built with `dpkg-deb`: tracerd and tracerctl in /usr/bin, the libraries tracerd loads into
//! processes and tracerctl's CUPTI injection in /usr/lib/tracer (where both look: beside the
//! executable, then `../lib/tracer`), the systemd unit, /etc/tracer/tracerd.toml (a conffile),
//! man pages and shell completions generated from the CLI definitions, and maintainer scripts
//! that make the `tracer` group and leave /var/lib/tracer behind until a purge.

use std::{
    fs,
    io::Write,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result};

use crate::{root, run};

const NAME: &str = "tracer";

/// Builds the package from the binaries in `bins` into `out`; returns its path.
pub fn package(bins: &Path, out: &Path) -> Result<PathBuf> {
    let version = env!("CARGO_PKG_VERSION");
    let stage = out.join(format!("{NAME}_{version}_amd64"));
    let _ = fs::remove_dir_all(&stage);
    let put = |rel: &str, bytes: &[u8], mode: u32| -> Result<()> {
        let path = stage.join(rel);
        fs::create_dir_all(path.parent().unwrap())?;
        fs::write(&path, bytes).with_context(|| path.display().to_string())?;
        fs::set_permissions(&path, fs::Permissions::from_mode(mode))?;
        Ok(())
    };
    let copy_stripped = |from: &Path, rel: &str, mode: u32| -> Result<()> {
        let to = stage.join(rel);
        fs::create_dir_all(to.parent().unwrap())?;
        run(Command::new("strip")
            .args(["--strip-debug", "-o"])
            .arg(&to)
            .arg(from))?;
        fs::set_permissions(&to, fs::Permissions::from_mode(mode))?;
        Ok(())
    };
    for bin in ["tracerd", "tracerctl"] {
        copy_stripped(&bins.join(bin), &format!("usr/bin/{bin}"), 0o755)?;
    }
    for lib in [
        "libtracer_pycount.so",
        "libtracer_pystart.so",
        "libtracer_cupti.so",
    ] {
        copy_stripped(&bins.join(lib), &format!("usr/lib/tracer/{lib}"), 0o644)?;
    }
    let unit = fs::read(root().join("deploy/systemd/tracerd.service"))?;
    put("usr/lib/systemd/system/tracerd.service", &unit, 0o644)?;
    put("etc/tracer/tracerd.toml", SETTINGS.as_bytes(), 0o644)?;

    // Man pages and completions, from the binaries themselves (their clap definitions).
    let man = stage.join("usr/share/man");
    for (section, bin, args) in [
        ("man8", "tracerd", ["--generate-man"]),
        ("man1", "tracerctl", ["manual"]),
    ] {
        let dir = man.join(section);
        fs::create_dir_all(&dir)?;
        run(Command::new(bins.join(bin)).args(args).arg(&dir))?;
        for page in fs::read_dir(&dir)? {
            let page = page?.path();
            run(Command::new("gzip").args(["-9n", "-f"]).arg(&page))?;
        }
    }
    for (shell, rel) in [
        ("bash", "usr/share/bash-completion/completions/tracerctl"),
        ("zsh", "usr/share/zsh/vendor-completions/_tracerctl"),
        ("fish", "usr/share/fish/vendor_completions.d/tracerctl.fish"),
    ] {
        let out = Command::new(bins.join("tracerctl"))
            .args(["completions", shell])
            .output()?;
        anyhow::ensure!(out.status.success(), "tracerctl completions {shell} failed");
        put(rel, &out.stdout, 0o644)?;
    }
    let readme = fs::read(root().join("README.md"))?;
    put("usr/share/doc/tracer/README.md", &readme, 0o644)?;
    put(
        "usr/share/doc/tracer/copyright",
        COPYRIGHT.as_bytes(),
        0o644,
    )?;

    // Control files.
    let size_kib = du_kib(&stage)?;
    put(
        "DEBIAN/control",
        format!(
            "Package: {NAME}\nVersion: {version}\nArchitecture: amd64\nMaintainer: tracer developers <tracer@localhost>\nInstalled-Size: {size_kib}\nDepends: libc6 (>= 2.34), adduser\nSection: devel\nPriority: optional\nDescription: system-wide eBPF and perf tracer for Python and CUDA programs\n tracerd profiles any process without a restart: Python call counts as cProfile\n gives them, sampled native and Python stacks, traces, CUDA kernels; tracerctl\n starts sessions and prints reports.\n"
        )
        .as_bytes(),
        0o644,
    )?;
    put("DEBIAN/conffiles", b"/etc/tracer/tracerd.toml\n", 0o644)?;
    put("DEBIAN/postinst", POSTINST.as_bytes(), 0o755)?;
    put("DEBIAN/prerm", PRERM.as_bytes(), 0o755)?;
    put("DEBIAN/postrm", POSTRM.as_bytes(), 0o755)?;

    let deb = out.join(format!("{NAME}_{version}_amd64.deb"));
    run(Command::new("dpkg-deb")
        .args(["--root-owner-group", "--build"])
        .arg(&stage)
        .arg(&deb))?;
    Ok(deb)
}

fn du_kib(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for e in fs::read_dir(dir)? {
        let e = e?;
        let m = e.metadata()?;
        if m.is_dir() {
            total += du_kib(&e.path())? * 1024;
        } else {
            total += m.len();
        }
    }
    Ok(total.div_ceil(1024))
}

/// `cargo xtask package [--out DIR]`: the package of the binaries just built.
pub fn main(out: Option<PathBuf>) -> Result<()> {
    let out = out.unwrap_or_else(|| root().join("target/package"));
    fs::create_dir_all(&out)?;
    let deb = package(&crate::bin_dir(), &out)?;
    let mut o = std::io::stdout();
    writeln!(o, "{}", deb.display())?;
    Ok(())
}

/// The settings file as installed: every setting commented out at its default.
const SETTINGS: &str = r#"# tracerd's settings: any tracerd flag, by the same name in snake case. Flags given on
# tracerd's command line (the unit's ExecStart) win. `tracerd --check-config` prints the
# settings in effect; `man tracerd` lists them all.

# Members of this group may use the socket besides root.
#group = "tracer"

# Serve on TCP too (TLS; see the fleet documentation).
#listen = "tcp://0.0.0.0:7070"
#tls_cert = "/etc/tracer/tls/host.pem"
#tls_key = "/etc/tracer/tls/host.key"
#client_ca = "/etc/tracer/tls/ca.pem"
#access = "/etc/tracer/access.toml"

# Prometheus metrics.
#metrics = "tcp://0.0.0.0:9464"

#trace_ring_mb = 16
#max_probes_per_session = 1000
#max_probes_per_user = 2000
#max_connections = 1024
#max_connections_per_user = 64
#idle_timeout = 300
"#;

/// Makes the `tracer` group (whose members may use the socket once the settings name it) and
/// starts the service. With DPKG_ROOT (an install into another root, as the tests make)
/// neither: they are the host's business.
const POSTINST: &str = r#"#!/bin/sh
set -e
if [ "$1" = configure ] && [ -z "$DPKG_ROOT" ]; then
    if ! getent group tracer >/dev/null; then
        addgroup --system tracer >/dev/null
    fi
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload >/dev/null || true
        systemctl enable tracerd.service >/dev/null || true
        systemctl restart tracerd.service >/dev/null || true
    fi
fi
exit 0
"#;

const PRERM: &str = r#"#!/bin/sh
set -e
if [ -z "$DPKG_ROOT" ] && [ -d /run/systemd/system ]; then
    systemctl stop tracerd.service >/dev/null 2>&1 || true
fi
exit 0
"#;

/// Purge: the state tracerd kept (reports, traces) and the group; removal keeps both, and
/// dpkg keeps the settings file until the purge.
const POSTRM: &str = r#"#!/bin/sh
set -e
if [ "$1" = purge ]; then
    rm -rf "$DPKG_ROOT/var/lib/tracer"
    if [ -z "$DPKG_ROOT" ] && getent group tracer >/dev/null; then
        delgroup --system tracer >/dev/null 2>&1 || true
    fi
fi
if [ -z "$DPKG_ROOT" ] && [ -d /run/systemd/system ]; then
    systemctl disable tracerd.service >/dev/null 2>&1 || true
    systemctl daemon-reload >/dev/null 2>&1 || true
fi
exit 0
"#;

const COPYRIGHT: &str = "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\nUpstream-Name: tracer\n\nFiles: *\nLicense: MIT or Apache-2.0\n";
