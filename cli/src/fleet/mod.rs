//! Fan-out: the same session on many hosts (`--hosts`), started at one instant, followed
//! together, and their reports merged. A host that is down or fails is named in the result;
//! the others still complete.

pub mod command;
pub mod merge;
pub mod pprof;
pub mod timeline;

use std::{
    path::Path,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{bail, Context, Result};
use tokio::task::JoinSet;
use tokio_stream::StreamExt;
use tracer_proto::{
    GetCapabilitiesRequest, GetReportRequest, ReportFormat, SessionInfo, StartSessionRequest,
    WatchSessionRequest,
};
use tracer_report::escape_controls as esc;

use crate::client::{self, Client, Remote};

/// Exit status when some hosts failed and the result covers the others.
pub const PARTIAL: u8 = 3;

/// Hosts from `--hosts` and `--hosts-file` (one per line, `#` comments), in order, once each.
pub fn hosts(list: &[String], file: Option<&Path>) -> Result<Vec<String>> {
    let mut all: Vec<String> = list.iter().map(|h| h.trim().to_owned()).collect();
    if let Some(f) = file {
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("reading the hosts file {}", f.display()))?;
        all.extend(
            text.lines()
                .map(|l| l.split('#').next().unwrap_or("").trim().to_owned()),
        );
    }
    let mut seen = std::collections::HashSet::new();
    all.retain(|h| !h.is_empty() && seen.insert(h.clone()));
    if all.is_empty() {
        bail!("--hosts/--hosts-file named no host");
    }
    for h in &all {
        if !h.contains(':') {
            bail!("host '{h}' needs a port: HOST:PORT");
        }
    }
    Ok(all)
}

/// A connected host and its clock relative to ours.
struct Peer {
    host: String,
    client: Client,
    /// Host's wall clock minus ours, estimated at the middle of the round trip.
    offset_ns: i64,
    rtt: Duration,
    /// Its answer to the clock reading.
    caps: tracer_proto::Capabilities,
}

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64)
}

async fn reach(host: String, remote: Remote) -> (String, Result<Peer>) {
    let r = async {
        let mut client = client::connect(&format!("tcp://{host}"), &remote).await?;
        let t0 = now_ns();
        let started = std::time::Instant::now();
        let caps = tokio::time::timeout(
            Duration::from_secs(10),
            client.get_capabilities(GetCapabilitiesRequest {}),
        )
        .await
        .context("no answer within 10 s")?
        .map_err(crate::status_err)?
        .into_inner();
        let rtt = started.elapsed();
        let t1 = now_ns();
        Ok(Peer {
            host: host.clone(),
            client,
            offset_ns: caps.now_unix_ns as i64 - (t0 + t1) / 2,
            rtt,
            caps,
        })
    }
    .await;
    (host, r)
}

/// Connects to every host at once; the failures are returned beside the peers.
async fn reach_all(hosts: &[String], remote: &Remote) -> (Vec<Peer>, Vec<(String, String)>) {
    let mut set = JoinSet::new();
    for h in hosts {
        set.spawn(reach(h.clone(), remote.clone()));
    }
    let (mut peers, mut failed) = (Vec::new(), Vec::new());
    while let Some(joined) = set.join_next().await {
        let (host, r) = joined.expect("connect task");
        match r {
            Ok(p) => peers.push(p),
            Err(e) => failed.push((host, format!("{e:#}"))),
        }
    }
    (peers, failed)
}

/// What to fetch from each host once its session ends.
pub struct Fetch {
    pub format: ReportFormat,
    pub template: GetReportRequest,
    pub limit: usize,
    pub output: Option<std::path::PathBuf>,
}

/// Starts `req` on every host, at the same instant on each (clock differences accounted
/// for), waits for the sessions to end, and writes the merged report.
pub async fn start(
    hosts: &[String],
    remote: &Remote,
    req: StartSessionRequest,
    fetch: Fetch,
) -> Result<std::process::ExitCode> {
    // Ctrl-C from here on stops every session that started (once they have).
    let (interrupted_tx, mut interrupted) = tokio::sync::watch::channel(false);
    let listener = tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            let _ = interrupted_tx.send(true);
        }
    });
    let (peers, mut failed) = reach_all(hosts, remote).await;
    let max_rtt = peers.iter().map(|p| p.rtt).max().unwrap_or_default();
    // Far enough ahead that every start request arrives before its host's start time.
    let start_at = now_ns() + (Duration::from_millis(500) + max_rtt * 4).as_nanos() as i64;
    let mut set = JoinSet::new();
    for mut p in peers {
        let mut req = req.clone();
        req.start_at_unix_ms = ((start_at + p.offset_ns) / 1_000_000) as u64;
        set.spawn(async move {
            let r = p.client.start_session(req).await.map_err(crate::status_err);
            (p, r.map(|r| r.into_inner()))
        });
    }
    let mut running = Vec::new();
    while let Some(joined) = set.join_next().await {
        match joined.expect("start task") {
            (p, Ok(info)) => running.push((p, info)),
            (p, Err(e)) => failed.push((p.host, format!("starting the session: {e:#}"))),
        }
    }
    running.sort_by_key(|(p, _)| hosts.iter().position(|h| *h == p.host));
    eprintln!(
        "tracerctl: session running on {} of {} hosts{}",
        running.len(),
        hosts.len(),
        running
            .iter()
            .map(|(p, i)| format!("; {} {}", p.host, esc(&i.id)))
            .collect::<String>()
    );
    // Ctrl-C stops every host's session; the reports are then merged as usual.
    let stoppers: Vec<(Client, String)> = running
        .iter()
        .map(|(p, info)| (p.client.clone(), info.id.clone()))
        .collect();
    let interrupt = tokio::spawn(async move {
        if interrupted.wait_for(|&i| i).await.is_err() {
            return;
        }
        eprintln!("tracerctl: interrupted: stopping the sessions");
        let mut set = JoinSet::new();
        for (mut client, id) in stoppers {
            set.spawn(async move {
                let _ = client.stop_session(tracer_proto::SessionRef { id }).await;
            });
        }
        while set.join_next().await.is_some() {}
    });
    // Follow each to its end, then fetch its report.
    let mut set = JoinSet::new();
    for (p, info) in running {
        let template = GetReportRequest {
            id: info.id.clone(),
            ..fetch.template.clone()
        };
        set.spawn(async move {
            let Peer {
                host,
                mut client,
                offset_ns,
                ..
            } = p;
            let r = async {
                let last = follow(&mut client, &info.id).await?;
                let data = crate::fetch_report(&mut client, template).await?;
                Ok::<_, anyhow::Error>((last, data))
            }
            .await;
            (host, info.id, offset_ns, r)
        });
    }
    let mut done = Vec::new();
    while let Some(joined) = set.join_next().await {
        let (host, id, offset_ns, r) = joined.expect("follow task");
        match r {
            Ok((last, data)) => done.push((host, id, offset_ns, last, data)),
            Err(e) => failed.push((host, format!("session {id}: {e:#}"))),
        }
    }
    interrupt.abort();
    listener.abort();
    done.sort_by_key(|d| hosts.iter().position(|h| *h == d.0));
    failed.sort_by_key(|f| hosts.iter().position(|h| *h == f.0));
    for (host, e) in &failed {
        eprintln!("tracerctl: {host}: {}", esc(e));
    }
    if done.is_empty() {
        bail!("no host completed the session");
    }
    // How aligned the starts were, on this machine's clock (ms resolution).
    let starts: Vec<i64> = done
        .iter()
        .map(|(_, _, offset_ns, last, _)| last.started_unix_ms as i64 * 1_000_000 - offset_ns)
        .collect();
    let spread_ms =
        (starts.iter().max().unwrap_or(&0) - starts.iter().min().unwrap_or(&0)) / 1_000_000;
    let completed = done.len();
    let merging = std::time::Instant::now();
    let bytes = match fetch.format {
        ReportFormat::Json | ReportFormat::Table => {
            let mut results = Vec::new();
            for (host, id, offset_ns, last, data) in done {
                let report: serde_json::Value = serde_json::from_slice(&data)
                    .with_context(|| format!("{host}'s report is not JSON"))?;
                results.push(merge::HostResult {
                    host,
                    session: Some(id),
                    state: Some(crate::render::state(&last)),
                    clock_offset_ms: Some(offset_ns as f64 / 1e6),
                    error: None,
                    report: Some(report),
                });
            }
            results.extend(failed.iter().map(|(host, e)| merge::HostResult {
                host: host.clone(),
                session: None,
                state: None,
                clock_offset_ms: None,
                error: Some(e.clone()),
                report: None,
            }));
            let merged = merge::merge(&results);
            if fetch.format == ReportFormat::Json {
                serde_json::to_vec_pretty(&merged)?
            } else {
                merge::table(&merged, fetch.limit).into_bytes()
            }
        }
        ReportFormat::Pprof => {
            let mut profiles = Vec::new();
            for (host, .., data) in done {
                let p = pprof::decode(&data).with_context(|| format!("{host}'s profile"))?;
                profiles.push((host, p));
            }
            pprof::merge(&profiles)?
        }
        ReportFormat::Folded => {
            let texts: Vec<(String, String)> = done
                .into_iter()
                .map(|(host, .., data)| (host, String::from_utf8_lossy(&data).into_owned()))
                .collect();
            pprof::folded(&texts).into_bytes()
        }
        ReportFormat::Chrome => {
            let traces: Vec<timeline::HostTrace> = done
                .into_iter()
                .map(|(host, _, offset_ns, _, json)| timeline::HostTrace {
                    host,
                    offset_ns,
                    json,
                })
                .collect();
            timeline::chrome(&traces)?
        }
        other => bail!("{other:?} reports are not merged across hosts"),
    };
    eprintln!(
        "tracerctl: {completed} of {} hosts completed; their sessions started within {spread_ms} ms of each other; reports merged in {:.1} ms",
        hosts.len(),
        merging.elapsed().as_secs_f64() * 1e3
    );
    crate::write_output(&bytes, fetch.output.as_deref())?;
    Ok(if failed.is_empty() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::from(PARTIAL)
    })
}

/// Waits for a session to end; the last state seen.
async fn follow(client: &mut Client, id: &str) -> Result<SessionInfo> {
    let mut stream = client
        .watch_session(WatchSessionRequest {
            id: id.to_owned(),
            interval_ms: 1000,
        })
        .await
        .map_err(crate::status_err)?
        .into_inner();
    let mut last = None;
    while let Some(info) = stream.next().await {
        last = Some(info.map_err(crate::status_err)?);
    }
    let last = last.context("the daemon closed the session stream without a state")?;
    if last.state == tracer_proto::SessionState::Running as i32 {
        bail!("the connection ended while the session was running");
    }
    Ok(last)
}

/// `capabilities` on every host: one line each, with its clock difference.
pub async fn capabilities(hosts: &[String], remote: &Remote) -> Result<std::process::ExitCode> {
    let (mut peers, failed) = reach_all(hosts, remote).await;
    peers.sort_by_key(|p| hosts.iter().position(|h| *h == p.host));
    for p in &peers {
        let c = &p.caps;
        out!(
            "{}: tracerd {}, kernel {}, bpf {}, clock {:+.3} ms (round trip {:.3} ms)\n",
            p.host,
            c.daemon_version,
            c.kernel_release,
            if c.bpf { "yes" } else { "no" },
            p.offset_ns as f64 / 1e6,
            p.rtt.as_secs_f64() * 1e3
        );
    }
    for (host, e) in &failed {
        out!("{host}: FAILED: {e}\n");
    }
    Ok(if failed.is_empty() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::from(PARTIAL)
    })
}
