//! `cargo xtask bench fleet`: what driving many tracerds as one costs as the fleet grows.
//! For N = 1, 4, 16 and 64 daemons on this machine (as many as it can start), each serving
//! mutual TLS on its own loopback port with its own certificate from one test CA:
//!
//! - `tracerctl --hosts … capabilities`: connecting, the TLS handshakes and one RPC per host
//!   (what fan-out pays before any session), median of 5;
//! - `tracerctl --hosts … start --mode=counting --all --events task-clock --duration 1s
//!   --format json`: the whole fan-out (clock reading, aligned start ≈ 0.5 s ahead, following,
//!   fetching, merging) minus the 1 s session, median of 3; with the spread of the sessions'
//!   start times and the merge time tracerctl reports.
//!
//! Every N's times are printed beside N = 1's, as ratios. The daemons share this machine's
//! CPUs: what grows with N is the client's work and the daemons' contention together.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

use super::median;
use crate::bin_dir;

const SIZES: [usize; 4] = [1, 4, 16, 64];
const BASE_PORT: u16 = 17_100;

struct Pki {
    dir: PathBuf,
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    fn new(dir: &Path) -> Result<Self> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "tracer bench CA");
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        std::fs::write(dir.join("ca.pem"), ca.pem())?;
        Ok(Pki {
            dir: dir.to_owned(),
            ca,
        })
    }

    /// (certificate, key) files for `name`.
    fn issue(&self, name: &str, file: &str) -> Result<(PathBuf, PathBuf)> {
        let mut params = CertificateParams::new(vec![name.to_owned()])?;
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.ca)?;
        let (c, k) = (
            self.dir.join(format!("{file}.pem")),
            self.dir.join(format!("{file}.key")),
        );
        std::fs::write(&c, cert.pem())?;
        std::fs::write(&k, key.serialize_pem())?;
        Ok((c, k))
    }
}

struct Host {
    child: Child,
    addr: String,
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
    }
}

/// Starts daemons `from..to`; all of them listen before it returns.
fn start_hosts(dir: &Path, pki: &Pki, from: usize, to: usize) -> Result<Vec<Host>> {
    let (cert, key) = pki.issue("127.0.0.1", "host")?;
    let access = dir.join("access.toml");
    std::fs::write(
        &access,
        "[[client]]\nname = \"bench\"\ncert = \"bench.client\"\nrole = \"trace\"\nuid = 0\n",
    )?;
    let mut hosts = Vec::new();
    let mut sockets = Vec::new();
    for i in from..to {
        let d = dir.join(format!("host{i}"));
        std::fs::create_dir_all(&d)?;
        let socket = d.join("tracerd.sock");
        let addr = format!("127.0.0.1:{}", BASE_PORT + i as u16);
        let child = Command::new(bin_dir().join("tracerd"))
            .arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(d.join("state"))
            .args(["--trace-ring-mb", "1", "--listen", &format!("tcp://{addr}")])
            .arg("--tls-cert")
            .arg(&cert)
            .arg("--tls-key")
            .arg(&key)
            .arg("--client-ca")
            .arg(dir.join("ca.pem"))
            .arg("--access")
            .arg(&access)
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .spawn()
            .context("starting tracerd (benchmarks run as root)")?;
        hosts.push(Host { child, addr });
        sockets.push(socket);
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    for (h, s) in hosts.iter_mut().zip(&sockets) {
        while !s.exists() {
            if let Some(status) = h.child.try_wait()? {
                bail!("tracerd for {} exited while starting: {status}", h.addr);
            }
            if Instant::now() > deadline {
                bail!("tracerd for {} did not listen within 120 s", h.addr);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(hosts)
}

struct Run {
    wall: f64,
    stderr: String,
}

fn ctl(dir: &Path, hosts: &[Host], args: &[&str]) -> Result<Run> {
    let list: Vec<&str> = hosts.iter().map(|h| h.addr.as_str()).collect();
    let started = Instant::now();
    let out = Command::new(bin_dir().join("tracerctl"))
        .arg("--tls-ca")
        .arg(dir.join("ca.pem"))
        .arg("--tls-cert")
        .arg(dir.join("client.pem"))
        .arg("--tls-key")
        .arg(dir.join("client.key"))
        .args(["--hosts", &list.join(",")])
        .args(args)
        .stdin(Stdio::null())
        .output()?;
    let wall = started.elapsed().as_secs_f64();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        bail!("tracerctl {args:?} on {} hosts: {stderr}", hosts.len());
    }
    Ok(Run { wall, stderr })
}

/// A number tracerctl's summary line gives after `before` (e.g. "within 3 ms").
fn reported(stderr: &str, before: &str) -> Option<f64> {
    let rest = &stderr[stderr.find(before)? + before.len()..];
    rest.split_whitespace().next()?.parse().ok()
}

struct Row {
    n: usize,
    caps_ms: f64,
    session_ms: f64,
    spread_ms: f64,
    merge_ms: f64,
}

pub fn run() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let pki = Pki::new(dir.path())?;
    pki.issue("bench.client", "client")?;
    let mut hosts: Vec<Host> = Vec::new();
    let mut rows: Vec<Row> = Vec::new();
    for n in SIZES {
        if let Err(e) = start_hosts(dir.path(), &pki, hosts.len(), n).map(|h| hosts.extend(h)) {
            println!("{n} daemons: not started on this machine: {e:#}");
            break;
        }
        // A first round trip warms the daemons up (capabilities read, code paged in).
        ctl(dir.path(), &hosts, &["capabilities"])?;
        let caps: Vec<f64> = (0..5)
            .map(|_| ctl(dir.path(), &hosts, &["capabilities"]).map(|r| r.wall * 1e3))
            .collect::<Result<_>>()?;
        let mut session = Vec::new();
        let (mut spread, mut merge) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            let r = ctl(
                dir.path(),
                &hosts,
                &[
                    "start",
                    "--mode=counting",
                    "--all",
                    "--events",
                    "task-clock",
                    "--duration",
                    "1s",
                    "--format",
                    "json",
                ],
            )?;
            session.push((r.wall - 1.0) * 1e3);
            spread.push(reported(&r.stderr, "started within ").unwrap_or(f64::NAN));
            merge.push(reported(&r.stderr, "merged in ").unwrap_or(f64::NAN));
        }
        rows.push(Row {
            n,
            caps_ms: median(caps),
            session_ms: median(session),
            spread_ms: median(spread),
            merge_ms: median(merge),
        });
    }
    let Some(base) = rows.first().map(|r| (r.caps_ms, r.session_ms)) else {
        bail!("no daemon could be started");
    };
    println!(
        "\nfan-out over N tracerds (mTLS on loopback, this machine's {} CPUs shared by all):\n",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "{:>4}  {:>16} {:>7}  {:>22} {:>7}  {:>14}  {:>10}",
        "N",
        "capabilities ms",
        "× N=1",
        "session beyond 1 s, ms",
        "× N=1",
        "start spread ms",
        "merge ms"
    );
    for r in &rows {
        println!(
            "{:>4}  {:>16.1} {:>7.2}  {:>22.1} {:>7.2}  {:>14.0}  {:>10.2}",
            r.n,
            r.caps_ms,
            r.caps_ms / base.0,
            r.session_ms,
            r.session_ms / base.1,
            r.spread_ms,
            r.merge_ms
        );
    }
    println!("\n(session beyond 1 s includes the ≈ 0.5 s tracerctl waits for the aligned start)");
    Ok(())
}
