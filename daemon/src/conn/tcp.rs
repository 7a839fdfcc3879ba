//! Connections on the TCP listener: capped overall and per client address. Without caps, a
//! host that opens connections and never finishes its TLS handshake takes every descriptor
//! tracerd has. A connection over a cap is closed at once, before any TLS: nothing on it is
//! authenticated yet, so there is nobody to answer. Connections with no request in flight
//! for the idle limit are closed, as on the Unix socket; peers that vanish mid-request are
//! found by HTTP/2 keepalive pings (set on the server).
//!
//! A connection must also carry an authenticated request within `AUTHENTICATE_WITHIN` (or
//! the idle limit, if shorter) of its accept, or it is closed. Otherwise a peer that never
//! finishes its TLS handshake, or that sends a refused request every few minutes, keeps its
//! place for as long as it likes, and a few addresses hold every place there is.

use std::{
    collections::HashMap,
    io,
    net::IpAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    net::{TcpListener, TcpStream},
    sync::mpsc,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo, TlsConnectInfo};

use super::{Activity, Counted, IdleTimer, Limits, Refusals};

/// How long a TCP connection may go without an authenticated request after its accept
/// (TLS handshake included): a client that means to call does so at once.
pub const AUTHENTICATE_WITHIN: Duration = Duration::from_secs(10);

/// Connections closed for not authenticating in time, logged a few at a time.
static UNAUTHENTICATED: Mutex<Refusals> = Mutex::new(Refusals::new());

/// Logs (rate-limited, with a count) a connection closed for not authenticating in time.
pub(super) fn note_unauthenticated_close(within: Duration) {
    super::Refused::TcpUnauthenticated.count();
    let mut r = UNAUTHENTICATED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(unsaid) = r.due() {
        tracing::warn!(
            closed_since_last_said = unsaid,
            "TCP connection closed: no authenticated request within {} s of its accept",
            within.as_secs_f32()
        );
    }
}

#[derive(Default)]
struct Counts {
    total: usize,
    per_address: HashMap<IpAddr, usize>,
}

/// A connection's place in the counts, given back when it closes.
pub struct Permit {
    counts: Arc<Mutex<Counts>>,
    address: IpAddr,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.total -= 1;
        if let Some(n) = c.per_address.get_mut(&self.address) {
            *n -= 1;
            if *n == 0 {
                c.per_address.remove(&self.address);
            }
        }
    }
}

/// Why a connection from `address` is not taken, if it is not.
fn refuse(c: &Counts, limits: &Limits, address: IpAddr) -> Option<String> {
    let held = c.per_address.get(&address).copied().unwrap_or(0);
    if c.total >= limits.total {
        Some(format!(
            "all {} TCP connections are open (tracerd --max-connections)",
            limits.total
        ))
    } else if held >= limits.per_user {
        Some(format!(
            "{held} TCP connections from {address} are open, the most one address may hold (tracerd --max-connections-per-user)"
        ))
    } else {
        None
    }
}

/// Accepts connections on `listener` within `limits` (`per_user` counts per client
/// address here), as tonic's incoming stream; ends when the server drops it.
pub fn incoming(listener: TcpListener, limits: Limits) -> ReceiverStream<io::Result<TcpConn>> {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        let counts = Arc::new(Mutex::new(Counts::default()));
        let mut refusals = Refusals::default();
        loop {
            let accepted = tokio::select! {
                r = listener.accept() => r,
                () = tx.closed() => return,
            };
            let (stream, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors: the connection waits in the backlog.
                    tracing::warn!(%e, "accepting a TCP connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let address = peer.ip();
            let permit = {
                let mut c = counts.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(why) = refuse(&c, &limits, address) {
                    drop(c);
                    refusals.note_tcp(address, &why);
                    continue;
                }
                c.total += 1;
                *c.per_address.entry(address).or_default() += 1;
                Permit {
                    counts: counts.clone(),
                    address,
                }
            };
            let _ = stream.set_nodelay(true);
            let activity = Arc::new(Activity::new());
            let conn = Counted {
                stream,
                idle: IdleTimer::with_authentication(
                    activity,
                    limits.idle,
                    AUTHENTICATE_WITHIN.min(limits.idle),
                ),
                held: permit,
            };
            if tx.send(Ok(conn)).await.is_err() {
                return;
            }
        }
    });
    ReceiverStream::new(rx)
}

/// An accepted TCP connection.
pub type TcpConn = Counted<TcpStream, Permit>;

/// What a request learns of its TCP connection: the stream's own connect info, and the
/// requests in flight on it (see `requests`). With TLS, it comes inside `TlsConnectInfo`.
#[derive(Clone, Debug)]
pub struct TcpPeer {
    pub tcp: TcpConnectInfo,
    pub activity: Arc<Activity>,
}

impl Connected for TcpConn {
    type ConnectInfo = TcpPeer;

    fn connect_info(&self) -> TcpPeer {
        TcpPeer {
            tcp: self.stream.connect_info(),
            activity: self.idle.activity.clone(),
        }
    }
}

/// The TCP connection a request came on, with or without TLS.
pub fn peer(extensions: &tonic::codegen::http::Extensions) -> Option<&TcpPeer> {
    extensions.get::<TcpPeer>().or_else(|| {
        extensions
            .get::<TlsConnectInfo<TcpPeer>>()
            .map(TlsConnectInfo::get_ref)
    })
}

/// The client's TLS certificates, when it sent some.
pub fn peer_certs(
    extensions: &tonic::codegen::http::Extensions,
) -> Option<Arc<Vec<tonic::transport::CertificateDer<'static>>>> {
    extensions
        .get::<TlsConnectInfo<TcpPeer>>()
        .and_then(TlsConnectInfo::peer_certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_the_total_are_capped() {
        let limits = Limits {
            total: 3,
            per_user: 2,
            idle: Duration::from_secs(1),
        };
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let mut c = Counts::default();
        assert!(refuse(&c, &limits, a).is_none());
        c.per_address.insert(a, 2);
        c.total = 2;
        assert!(refuse(&c, &limits, a).unwrap().contains("from 10.0.0.1"));
        assert!(refuse(&c, &limits, b).is_none());
        c.total = 3;
        assert!(refuse(&c, &limits, b)
            .unwrap()
            .contains("all 3 TCP connections"));
    }
}
