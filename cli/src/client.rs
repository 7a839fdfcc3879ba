//! Connecting to tracerd, with one-line reasons when that is not possible.

use std::path::{Path, PathBuf};

use anyhow::Context;
use hyper_util::rt::TokioIo;
use tonic::{
    metadata::MetadataValue,
    service::interceptor::InterceptedService,
    transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity, Uri},
};
use tracer_proto::tracer_client::TracerClient;

pub type Client = TracerClient<InterceptedService<Channel, Bearer>>;

/// How to reach a daemon over TCP: TLS trust and identity, or a bearer token.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct Remote {
    /// TCP: the CA certificate that signed tracerd's certificate (PEM).
    #[arg(long, env = "TRACER_TLS_CA", value_name = "PEM", global = true)]
    pub tls_ca: Option<PathBuf>,
    /// TCP with mTLS: this client's certificate (PEM).
    #[arg(long, env = "TRACER_TLS_CERT", value_name = "PEM", global = true)]
    pub tls_cert: Option<PathBuf>,
    /// TCP with mTLS: this client's private key (PEM).
    #[arg(long, env = "TRACER_TLS_KEY", value_name = "PEM", global = true)]
    pub tls_key: Option<PathBuf>,
    /// TCP with token authentication: a file holding the token.
    #[arg(long, env = "TRACER_TOKEN_FILE", value_name = "FILE", global = true)]
    pub token_file: Option<PathBuf>,
    /// TCP without TLS (a daemon started with --insecure-plaintext on loopback).
    #[arg(long, global = true)]
    pub insecure_plaintext: bool,
}

/// Adds `authorization: Bearer TOKEN` to every request when a token is set.
#[derive(Clone, Default)]
pub struct Bearer(Option<MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

impl Remote {
    fn bearer(&self) -> anyhow::Result<Bearer> {
        let Some(path) = &self.token_file else {
            return Ok(Bearer::default());
        };
        let token = std::fs::read_to_string(path)
            .with_context(|| format!("reading the token file {}", path.display()))?;
        let value = format!("Bearer {}", token.trim()).parse().map_err(|_| {
            anyhow::anyhow!("the token in {} is not printable ASCII", path.display())
        })?;
        Ok(Bearer(Some(value)))
    }

    fn tls(&self, host: &str) -> anyhow::Result<ClientTlsConfig> {
        let read = |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
        let ca = self.tls_ca.as_deref().ok_or_else(|| {
            anyhow::anyhow!("TCP needs --tls-ca: the CA that signed tracerd's certificate (or --insecure-plaintext for a loopback test daemon)")
        })?;
        let mut tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read(ca)?))
            .domain_name(host.trim_start_matches('[').trim_end_matches(']'));
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                tls = tls.identity(Identity::from_pem(read(cert)?, read(key)?));
            }
            (None, None) => {}
            _ => anyhow::bail!("--tls-cert and --tls-key go together"),
        }
        Ok(tls)
    }
}

/// `addr` is a Unix socket path, `tcp://HOST:PORT`, or (fan-out) `HOST:PORT`.
pub async fn connect(addr: &str, remote: &Remote) -> anyhow::Result<Client> {
    let bearer = remote.bearer()?;
    if let Some(hostport) = addr.strip_prefix("tcp://") {
        let host = hostport
            .rsplit_once(':')
            .map_or(hostport, |(h, _)| h)
            .to_owned();
        let endpoint = if remote.insecure_plaintext {
            Endpoint::from_shared(format!("http://{hostport}"))?
        } else {
            Endpoint::from_shared(format!("https://{hostport}"))?.tls_config(remote.tls(&host)?)?
        };
        // Keepalives: a host that vanishes mid-session is noticed, not waited on forever.
        let channel = endpoint
            .connect_timeout(std::time::Duration::from_secs(5))
            .http2_keep_alive_interval(std::time::Duration::from_secs(5))
            .keep_alive_timeout(std::time::Duration::from_secs(10))
            .keep_alive_while_idle(true)
            .connect()
            .await
            .map_err(|e| anyhow::anyhow!("cannot reach tracerd at {addr}: {}", root_cause(&e)))?;
        return Ok(TracerClient::with_interceptor(channel, bearer));
    }
    let path = Path::new(addr).to_owned();
    // Connect by hand: its error says plainly what is wrong, where tonic's would not. The
    // channel then uses this connection: a second one would count against the daemon's
    // per-user cap while the first is still being closed.
    let first = std::os::unix::net::UnixStream::connect(&path)
        .and_then(|s| s.set_nonblocking(true).map(|()| s))
        .map_err(|e| {
            let p = path.display();
            anyhow::anyhow!(match e.kind() {
                std::io::ErrorKind::NotFound => format!("tracerd is not running (no socket at {p}; start tracerd, or point --socket/TRACER_SOCKET at its socket)"),
                std::io::ErrorKind::ConnectionRefused => format!("tracerd is not running (nothing listens on {p})"),
                std::io::ErrorKind::PermissionDenied => format!("permission denied on {p}: only root and the daemon's --group may use it"),
                _ => format!("cannot connect to {p}: {e}"),
            })
        })?;
    let first = std::sync::Arc::new(std::sync::Mutex::new(Some(first)));
    let channel = Endpoint::try_from("http://tracerd.local")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            let first = first.lock().unwrap_or_else(|e| e.into_inner()).take();
            async move {
                let stream = match first {
                    Some(s) => tokio::net::UnixStream::from_std(s)?,
                    // Reconnecting (after the daemon closed an idle connection, say).
                    None => tokio::net::UnixStream::connect(path).await?,
                };
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }))
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect to tracerd at {addr}: {}", root_cause(&e)))?;
    Ok(TracerClient::with_interceptor(channel, bearer))
}

pub fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}
