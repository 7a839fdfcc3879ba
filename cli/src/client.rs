//! Connecting to tracerd, with one-line reasons when that is not possible.

use std::path::Path;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};
use tracer_proto::tracer_client::TracerClient;

pub type Client = TracerClient<Channel>;

/// `addr` is a Unix socket path, or `tcp://HOST:PORT`.
pub async fn connect(addr: &str) -> anyhow::Result<Client> {
    if let Some(hostport) = addr.strip_prefix("tcp://") {
        let channel = Endpoint::from_shared(format!("http://{hostport}"))?
            .connect()
            .await
            .map_err(|e| anyhow::anyhow!("cannot reach tracerd at {addr}: {}", root_cause(&e)))?;
        return Ok(TracerClient::new(channel));
    }
    let path = Path::new(addr).to_owned();
    // Connect once by hand: its error says plainly what is wrong, where tonic's would not.
    if let Err(e) = std::os::unix::net::UnixStream::connect(&path) {
        let p = path.display();
        anyhow::bail!(match e.kind() {
            std::io::ErrorKind::NotFound => format!("tracerd is not running (no socket at {p}; start tracerd, or point --socket/TRACER_SOCKET at its socket)"),
            std::io::ErrorKind::ConnectionRefused => format!("tracerd is not running (nothing listens on {p})"),
            std::io::ErrorKind::PermissionDenied => format!("permission denied on {p}: only root and the daemon's --group may use it"),
            _ => format!("cannot connect to {p}: {e}"),
        });
    }
    let channel = Endpoint::try_from("http://tracerd.local")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect to tracerd at {addr}: {}", root_cause(&e)))?;
    Ok(TracerClient::new(channel))
}

fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}
