//! `cargo xtask bench fleet`: what driving many tracerds as one costs as the fleet grows.
//! For N = 1, 4, 16 and 64 daemons on this machine (as many as it can start), each in its
//! own network namespace behind a veth pair (the fleet tests' hosts, `tracer_tests::fleet`),
//! serving mutual TLS with its own certificate from one test CA:
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
    path::Path,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{bail, Result};
use tracer_tests::fleet::{Host, Pki};

use super::median;
use crate::bin_dir;

const SIZES: [usize; 4] = [1, 4, 16, 64];

/// Starts hosts until there are `n`.
fn grow(dir: &Path, pki: &Pki, hosts: &mut Vec<Host>, n: usize) -> Result<()> {
    let access = dir.join("access.toml");
    std::fs::write(
        &access,
        "[[client]]\nname = \"bench\"\ncert = \"bench.client\"\nrole = \"trace\"\nuid = 0\n",
    )?;
    while hosts.len() < n {
        // Host::start panics with the reason when a daemon cannot start.
        let host = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Host::start(dir, |ip| {
                let (cert, key) = pki.issue(ip);
                [
                    "--trace-ring-mb",
                    "1",
                    "--tls-cert",
                    &cert.to_string_lossy(),
                    "--tls-key",
                    &key.to_string_lossy(),
                    "--client-ca",
                    &pki.ca.to_string_lossy(),
                    "--access",
                    &access.to_string_lossy(),
                ]
                .map(String::from)
                .to_vec()
            })
        }));
        match host {
            Ok(h) => hosts.push(h),
            Err(e) => bail!(
                "{}",
                e.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "tracerd did not start".into())
            ),
        }
    }
    Ok(())
}

struct Run {
    wall: f64,
    stderr: String,
}

fn ctl(pki: &Pki, hosts: &[Host], args: &[&str]) -> Result<Run> {
    let list: Vec<&str> = hosts.iter().map(|h| h.addr.as_str()).collect();
    let (cert, key) = (
        pki.dir.join("bench.client.cert.pem"),
        pki.dir.join("bench.client.key.pem"),
    );
    let started = Instant::now();
    let out = Command::new(bin_dir().join("tracerctl"))
        .arg("--tls-ca")
        .arg(&pki.ca)
        .arg("--tls-cert")
        .arg(cert)
        .arg("--tls-key")
        .arg(key)
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
    let pki = Pki::new(&dir.path().join("pki"), "tracer-bench-ca");
    pki.issue("bench.client");
    let mut hosts: Vec<Host> = Vec::new();
    let mut rows: Vec<Row> = Vec::new();
    for n in SIZES {
        if let Err(e) = grow(dir.path(), &pki, &mut hosts, n) {
            println!("{n} daemons: not started on this machine: {e:#}");
            break;
        }
        // A first round trip warms the daemons up (capabilities read, code paged in).
        ctl(&pki, &hosts, &["capabilities"])?;
        let caps: Vec<f64> = (0..5)
            .map(|_| ctl(&pki, &hosts, &["capabilities"]).map(|r| r.wall * 1e3))
            .collect::<Result<_>>()?;
        let mut session = Vec::new();
        let (mut spread, mut merge) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            let r = ctl(
                &pki,
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
        "\nfan-out over N tracerds (each in its network namespace, mTLS; this machine's {} CPUs shared by all):\n",
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
