//! Wiring: state store, BPF, the session manager and the gRPC servers (Unix socket, optional TCP).

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::Arc,
};

use tokio::{net::UnixListener, sync::watch};
use tonic::transport::Server;
use tower::layer::util::{Identity, Stack};
use tracer_proto::tracer_server::TracerServer;

use crate::{capabilities, server::Service, session::manager::Manager, store::Store};
use tracer_bpf::Bpf;

pub const DEFAULT_SOCKET: &str = "/run/tracer/tracerd.sock";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/tracer";

#[derive(Clone, Debug)]
pub struct Config {
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    /// Also serve on TCP (TLS, authenticated clients, the access policy's grants).
    pub listen: Option<crate::remote::ListenOptions>,
    /// `tcp://HOST:PORT`: serve Prometheus metrics (HTTP GET /metrics) there.
    pub metrics: Option<String>,
    /// Group allowed to use the socket besides root.
    pub group: Option<String>,
    /// Size of the kernel ring buffer tracing events pass through, in MiB (a power of two):
    /// what absorbs bursts while the daemon catches up.
    pub trace_ring_mb: u32,
    /// One perf event per uprobe even where the kernel has multi-uprobe links.
    pub per_probe_uprobes: bool,
    /// Caps on native probes (`--uprobe`), per session and per user.
    pub probe_limits: tracer_inspect::native::ProbeLimits,
    /// Caps on connections to the Unix socket, and when idle ones are closed.
    pub connections: crate::conn::Limits,
}

pub const DEFAULT_TRACE_RING_MB: u32 = 64;

/// Bounds of the numeric settings, checked before anything starts (and on the settings file's
/// values as it is read, see `bound`).
pub const MAX_TRACE_RING_MB: u32 = 1024;
pub const PROBE_LIMITS: std::ops::RangeInclusive<usize> = 1..=100_000;
pub const CONNECTIONS: std::ops::RangeInclusive<usize> = 2..=1_000_000;
/// `--idle-timeout`: 1 s to a day (longer would keep idle connections for good).
pub const IDLE_TIMEOUT_SECS: std::ops::RangeInclusive<u64> = 1..=86_400;

/// Why `n` is out of the bounds of the numeric setting `key` (a flag's name in snake case),
/// if it is; None for settings that are not numbers or have no bound of their own.
pub fn bound(key: &str, n: i64) -> Option<String> {
    let within =
        |r: std::ops::RangeInclusive<usize>| usize::try_from(n).is_ok_and(|n| r.contains(&n));
    match key {
        "trace_ring_mb"
            if !u32::try_from(n).is_ok_and(|n| n.is_power_of_two() && n <= MAX_TRACE_RING_MB) =>
        {
            Some(format!(
                "wants a power of two from 1 to {MAX_TRACE_RING_MB}, got {n}"
            ))
        }
        "max_probes_per_session" | "max_probes_per_user" if !within(PROBE_LIMITS) => Some(format!(
            "wants {} to {}, got {n}",
            PROBE_LIMITS.start(),
            PROBE_LIMITS.end()
        )),
        "max_connections" | "max_connections_per_user" if !within(CONNECTIONS) => Some(format!(
            "wants {} to {}, got {n}",
            if key == "max_connections" { 2 } else { 1 },
            CONNECTIONS.end()
        )),
        "idle_timeout" if !u64::try_from(n).is_ok_and(|n| IDLE_TIMEOUT_SECS.contains(&n)) => {
            Some(format!(
                "wants {} to {} seconds, got {n}",
                IDLE_TIMEOUT_SECS.start(),
                IDLE_TIMEOUT_SECS.end()
            ))
        }
        _ => None,
    }
}

/// Streams one HTTP/2 connection may have open at once: tonic sets none (hyper's own 200
/// included), and each may buffer a message of up to 4 MiB.
const MAX_STREAMS: u32 = 100;
/// Streams a connection may have reset for its errors before it is closed: tonic turns
/// hyper's 1024 off, which hyper warns leaves the server open to reset floods
/// (RUSTSEC-2024-0003).
const MAX_LOCAL_ERROR_RESETS: usize = 1024;
/// Request headers, all together (hyper's default, set here so that it stays).
const MAX_HEADER_LIST: u32 = 16 << 10;
/// A request message (tonic's default, set here so that it stays): a larger one is refused
/// from its length prefix, before it is buffered.
const MAX_MESSAGE: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("another tracerd is already listening on {0}")]
    SocketInUse(PathBuf),
    #[error("cannot listen on {path}: {source}")]
    Bind {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no group named '{0}'")]
    NoSuchGroup(String),
    #[error("--trace-ring-mb wants a power of two from 1 to 1024, got {0}")]
    BadTraceRing(u32),
    #[error("--max-probes-per-session and --max-probes-per-user want 1 to 100000, got {0}")]
    BadProbeLimit(usize),
    #[error("--max-connections wants 2 to 1000000 and --max-connections-per-user 1 to --max-connections, got {total} and {per_user}")]
    BadConnectionLimit { total: usize, per_user: usize },
    #[error("--idle-timeout wants 1 to 86400 seconds, got {0}")]
    BadIdleTimeout(u64),
    #[error(transparent)]
    Remote(#[from] crate::remote::RemoteError),
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error(transparent)]
    Bpf(#[from] tracer_bpf::BpfError),
    #[error(transparent)]
    Session(#[from] crate::error::Error),
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
}

impl Config {
    /// The numeric settings within their bounds.
    pub fn check(&self) -> Result<(), DaemonError> {
        let ring_mb = self.trace_ring_mb;
        if !ring_mb.is_power_of_two() || ring_mb > MAX_TRACE_RING_MB {
            return Err(DaemonError::BadTraceRing(ring_mb));
        }
        let limits = self.probe_limits;
        if let Some(bad) = [limits.per_session, limits.per_user]
            .into_iter()
            .find(|n| !PROBE_LIMITS.contains(n))
        {
            return Err(DaemonError::BadProbeLimit(bad));
        }
        let conns = self.connections;
        if !CONNECTIONS.contains(&conns.total) || !(1..=conns.total).contains(&conns.per_user) {
            return Err(DaemonError::BadConnectionLimit {
                total: conns.total,
                per_user: conns.per_user,
            });
        }
        let idle = conns.idle.as_secs();
        if !IDLE_TIMEOUT_SECS.contains(&idle) {
            return Err(DaemonError::BadIdleTimeout(idle));
        }
        Ok(())
    }
}

/// Runs the daemon until `shutdown` resolves; running sessions are then ended and their reports kept.
pub async fn run(
    config: Config,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), DaemonError> {
    // Before anything is opened or bound: a bad value leaves nothing behind.
    config.check()?;
    let tcp = config
        .listen
        .as_ref()
        .map(crate::remote::ListenOptions::resolve)
        .transpose()?;
    claim_socket(&config.socket)?;
    let metrics = match &config.metrics {
        Some(spec) => Some(crate::metrics::bind(spec).await?),
        None => None,
    };
    let store = Store::open(&config.state_dir)?;
    // In-process counters' directories are written down here; what a killed tracerd left is
    // swept off the start's path (removal scripts may take seconds to run).
    match tracer_inspect::python::inproc::set_journal(&config.state_dir.join("inproc")) {
        Ok(()) => {
            std::thread::spawn(|| {
                for line in tracer_inspect::python::inproc::sweep() {
                    tracing::info!("sweeping in-process counters left before: {line}");
                }
            });
        }
        Err(e) => {
            tracing::warn!(%e, "in-process counters' journal unavailable: a killed tracerd's files would stay")
        }
    }
    let conns = config.connections;
    match crate::conn::raise_fd_limit() {
        // Room for the connections and for sessions' perf events and BPF objects besides.
        Ok(n) if n < conns.total as u64 + 1024 => tracing::warn!(
            limit = n,
            "the open files limit leaves little room beside --max-connections {}",
            conns.total
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(%e, "raising the open files limit"),
    }
    let bpf = Bpf::load(config.trace_ring_mb << 20, config.per_probe_uprobes)?;
    // Continues the processes held at exec if tracerd dies with them stopped.
    if let Err(e) = bpf.held_fd().and_then(crate::guardian::spawn) {
        tracing::warn!(%e, "no guardian: processes held at exec stay stopped if tracerd is killed");
    }
    let gid = config
        .group
        .as_deref()
        .map(|g| match nix::unistd::Group::from_name(g) {
            Ok(Some(group)) => Ok(group.gid),
            _ => Err(DaemonError::NoSuchGroup(g.to_owned())),
        })
        .transpose()?;
    let probe_limits = config.probe_limits;
    let mut caps = tokio::task::spawn_blocking(move || capabilities::measure(true, &probe_limits))
        .await
        .expect("capabilities task");
    caps.uprobe_links = bpf.uprobe_links();
    let interpreters = caps
        .interpreters
        .iter()
        .map(|i| i.runtime_path.clone().into())
        .collect();
    let caps = Arc::new(caps);
    let (sessions, manager_task) = Manager::spawn(
        store,
        bpf,
        interpreters,
        config.state_dir.join("traces"),
        config.probe_limits,
    )?;
    // The socket appears only now that a start can be served at once: clients (and scripts
    // waiting for the file) would otherwise queue behind the loading above, while the
    // processes they mean to trace run on.
    let uds = bind(&config.socket, gid)?;
    let tcp = match tcp {
        Some(t) => {
            let listener = tokio::net::TcpListener::bind(t.addr)
                .await
                .map_err(|source| DaemonError::Listen {
                    addr: t.addr.to_string(),
                    source,
                })?;
            Some((listener, t))
        }
        None => None,
    };

    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<TracerServer<Service>>().await;
    let remote = tcp.as_ref().map(|(_, t)| t.remote.clone());
    // Both servers: requests counted (`requests`), then the gate (TCP callers identified
    // before their bodies are read), then the services.
    type Layers = Stack<crate::remote::gate::Gate, Stack<crate::requests::Layer, Identity>>;
    let layered = |builder: Server| {
        builder
            .max_concurrent_streams(MAX_STREAMS)
            .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
            .http2_max_header_list_size(MAX_HEADER_LIST)
            .layer(crate::requests::Layer)
            .layer(crate::remote::gate::Gate::new(remote.clone()))
    };
    let router = |mut builder: Server<Layers>| {
        let reflection_v1 = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(tracer_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()
            .expect("valid descriptor sets");
        let reflection_v1alpha = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(tracer_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1alpha()
            .expect("valid descriptor sets");
        builder
            .add_service(
                TracerServer::new(Service {
                    sessions: sessions.clone(),
                    capabilities: caps.clone(),
                    remote: remote.clone(),
                })
                .max_decoding_message_size(MAX_MESSAGE),
            )
            .add_service(health_service.clone())
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
    };

    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    tracing::info!(socket = %config.socket.display(), "tracerd listening");
    let uds_server = router(layered(Server::builder())).serve_with_incoming_shutdown(
        crate::conn::incoming(uds, config.connections),
        stopped(stop_rx.clone()),
    );
    let tcp_server = async {
        match tcp {
            Some((l, t)) => {
                let tls = t.tls.is_some();
                tracing::info!(addr = %l.local_addr().map(|a| a.to_string()).unwrap_or_default(), tls, "tracerd listening on TCP");
                // Keepalive pings find peers that went away without closing.
                let base = Server::builder()
                    .http2_keepalive_interval(Some(std::time::Duration::from_secs(60)))
                    .http2_keepalive_timeout(Some(std::time::Duration::from_secs(20)));
                let builder = match t.tls {
                    Some(cfg) => base.tls_config(cfg)?,
                    None => base,
                };
                router(layered(builder))
                    .serve_with_incoming_shutdown(
                        crate::conn::tcp::incoming(l, config.connections),
                        stopped(stop_rx.clone()),
                    )
                    .await
            }
            None => Ok(()),
        }
    };
    let metrics_server = async {
        if let Some(l) = metrics {
            tracing::info!(addr = %l.local_addr().map(|a| a.to_string()).unwrap_or_default(), "serving Prometheus metrics on /metrics");
            let sessions = sessions.clone();
            crate::metrics::serve(
                l,
                move || {
                    let sessions = sessions.clone();
                    async move { sessions.metrics().await }
                },
                stopped(stop_rx.clone()),
            )
            .await;
        }
    };
    let on_shutdown = async {
        shutdown.await;
        tracing::info!("shutting down: ending running sessions");
        health.set_not_serving::<TracerServer<Service>>().await;
        sessions.shutdown().await;
        let _ = stop_tx.send(true);
    };
    let (a, b, (), ()) = tokio::join!(uds_server, tcp_server, metrics_server, on_shutdown);
    let _ = manager_task.await;
    // Ended sessions' in-process counters leave files in their processes' /tmp until their
    // removal scripts have run: a little longer for them.
    tokio::task::spawn_blocking(|| {
        tracer_inspect::python::inproc::wait_cleanups(std::time::Duration::from_secs(2))
    })
    .await
    .ok();
    let _ = std::fs::remove_file(&config.socket);
    a?;
    b?;
    Ok(())
}

/// Refuses a socket another daemon serves; removes a stale one left by a daemon that died.
fn claim_socket(path: &Path) -> Result<(), DaemonError> {
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => Err(DaemonError::SocketInUse(path.to_owned())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(_) => std::fs::remove_file(path)
            .or_else(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    Ok(())
                } else {
                    Err(e)
                }
            })
            .map_err(|source| DaemonError::Bind {
                path: path.to_owned(),
                source,
            }),
    }
}

/// Binds the socket with mode 0660, owned by root and `gid`: only root and that group may connect.
fn bind(path: &Path, gid: Option<nix::unistd::Gid>) -> Result<UnixListener, DaemonError> {
    let err = |source| DaemonError::Bind {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let listener = UnixListener::bind(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(err)?;
    if let Some(gid) = gid {
        nix::unistd::chown(path, None, Some(gid)).map_err(|e| err(e.into()))?;
    }
    Ok(listener)
}
