//! Connections on the Unix socket: capped per user and overall, with room kept for root, and
//! closed when idle. Without caps, one user's idle connections can take every file
//! descriptor tracerd has, and then nobody (root included) gets an answer.

use std::{
    collections::HashMap,
    future::Future,
    io,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{UnixListener, UnixStream},
    sync::mpsc,
    time::{Instant, Sleep},
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, UdsConnectInfo};

pub mod tcp;

/// Refused connections held open at once, to be answered why; more are closed unanswered.
const MAX_REFUSED: usize = 16;
/// How long a refused connection stays open for its answer.
const REFUSED_LIFETIME: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once, all users together.
    pub total: usize,
    /// Connections one user other than root may have open.
    pub per_user: usize,
    /// A connection with no request in flight for this long is closed.
    pub idle: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            total: 1024,
            per_user: 64,
            idle: Duration::from_secs(300),
        }
    }
}

impl Limits {
    /// Connections of the total only root may use: what lets root in when others hold the rest.
    pub fn root_reserve(&self) -> usize {
        (self.total / 16).clamp(1, 64)
    }
}

/// What a request learns of its connection (in its extensions, as tonic's connect info).
#[derive(Clone, Debug)]
pub struct PeerInfo {
    pub uds: UdsConnectInfo,
    /// Why the connection was refused: every request on it is answered RESOURCE_EXHAUSTED.
    pub refused: Option<Arc<str>>,
    pub activity: Arc<Activity>,
}

/// Requests in flight on a connection, since when there have been none, and (TCP) whether
/// a request on it has been authenticated.
#[derive(Debug)]
pub struct Activity {
    in_flight: AtomicUsize,
    idle_since: Mutex<Instant>,
    authenticated: AtomicBool,
}

impl Activity {
    fn new() -> Self {
        Activity {
            in_flight: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
            authenticated: AtomicBool::new(false),
        }
    }

    /// A request on this connection was authenticated: it is no longer held to the
    /// authentication deadline (see `tcp`).
    pub fn authenticated(&self) {
        self.authenticated.store(true, Ordering::SeqCst);
    }

    fn is_authenticated(&self) -> bool {
        self.authenticated.load(Ordering::SeqCst)
    }

    /// Counts a request until the returned guard drops (with its response's last byte).
    pub fn begin(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(self.clone())
    }

    /// When the connection becomes idle for `idle`, if nothing is in flight.
    pub(crate) fn deadline(&self, idle: Duration) -> Option<Instant> {
        let since = *self.idle_since.lock().unwrap_or_else(|e| e.into_inner());
        (self.in_flight.load(Ordering::SeqCst) == 0).then_some(since + idle)
    }
}

pub struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut since = self.0.idle_since.lock().unwrap_or_else(|e| e.into_inner());
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            *since = Instant::now();
        }
    }
}

#[derive(Default)]
struct Counts {
    total: usize,
    refused: usize,
    per_uid: HashMap<u32, usize>,
}

/// A connection's place in the counts, given back when it closes.
pub struct Permit {
    counts: Arc<Mutex<Counts>>,
    /// None for a refused connection.
    uid: Option<u32>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        match self.uid {
            Some(uid) => {
                c.total -= 1;
                if let Some(n) = c.per_uid.get_mut(&uid) {
                    *n -= 1;
                    if *n == 0 {
                        c.per_uid.remove(&uid);
                    }
                }
            }
            None => c.refused -= 1,
        }
    }
}

/// Whether a new connection is served, refused with a reason, or closed at once.
fn admit(
    counts: &Arc<Mutex<Counts>>,
    limits: &Limits,
    uid: u32,
) -> Option<(Permit, Option<String>)> {
    let mut c = counts.lock().unwrap_or_else(|e| e.into_inner());
    let held = c.per_uid.get(&uid).copied().unwrap_or(0);
    let why = if uid == 0 {
        (c.total >= limits.total).then(|| {
            format!(
                "tracerd has all its {} connections open (tracerd --max-connections)",
                limits.total
            )
        })
    } else if held >= limits.per_user {
        Some(format!(
            "too many connections from uid {uid}: {held} open, at most {} per user (tracerd --max-connections-per-user)",
            limits.per_user
        ))
    } else if c.total + limits.root_reserve() >= limits.total {
        Some(format!(
            "tracerd has {} of its {} connections open and keeps the last {} for root (tracerd --max-connections)",
            c.total,
            limits.total,
            limits.root_reserve()
        ))
    } else {
        None
    };
    let permit = |uid| Permit {
        counts: counts.clone(),
        uid,
    };
    match why {
        None => {
            c.total += 1;
            *c.per_uid.entry(uid).or_default() += 1;
            Some((permit(Some(uid)), None))
        }
        Some(why) if c.refused < MAX_REFUSED => {
            c.refused += 1;
            Some((permit(None), Some(why)))
        }
        Some(_) => None,
    }
}

/// Accepts connections on `listener` within `limits`, as tonic's incoming stream; ends when
/// the server drops it.
pub fn incoming(listener: UnixListener, limits: Limits) -> ReceiverStream<io::Result<Conn>> {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        let counts = Arc::new(Mutex::new(Counts::default()));
        let mut refusals = Refusals::default();
        loop {
            let stream = tokio::select! {
                r = listener.accept() => r,
                () = tx.closed() => return,
            };
            let stream = match stream {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of descriptors (EMFILE, ENFILE): the connection waits in the
                    // backlog; retrying at once would spin.
                    tracing::warn!(%e, "accepting a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            // No credentials: treated as a user other than root.
            let uid = stream.peer_cred().map_or(u32::MAX, |c| c.uid());
            let Some((permit, refused)) = admit(&counts, &limits, uid) else {
                refusals.note(uid, "closed unanswered: too many refused connections open");
                continue;
            };
            if let Some(why) = &refused {
                refusals.note(uid, why);
            }
            let lifetime = if refused.is_some() {
                REFUSED_LIFETIME
            } else {
                limits.idle
            };
            let activity = Arc::new(Activity::new());
            let info = PeerInfo {
                uds: stream.connect_info(),
                refused: refused.map(Arc::from),
                activity: activity.clone(),
            };
            let conn = Counted {
                stream,
                idle: IdleTimer::new(activity, lifetime),
                held: (info, permit),
            };
            if tx.send(Ok(conn)).await.is_err() {
                return;
            }
        }
    });
    ReceiverStream::new(rx)
}

/// What tracerd refused at its sockets since it started, by kind (its metrics): Unix
/// connections, TCP connections, TCP requests refused before their bodies were read, TCP
/// connections closed for not authenticating in time.
static REFUSED_TOTAL: [std::sync::atomic::AtomicU64; 4] =
    [const { std::sync::atomic::AtomicU64::new(0) }; 4];

/// A kind of refusal [`REFUSED_TOTAL`] counts.
#[derive(Clone, Copy)]
pub(crate) enum Refused {
    UnixConnection = 0,
    TcpConnection = 1,
    TcpRequest = 2,
    TcpUnauthenticated = 3,
}

impl Refused {
    pub(crate) fn count(self) {
        REFUSED_TOTAL[self as usize].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Refusals at tracerd's sockets since it started, by kind.
pub fn refused_totals() -> impl Iterator<Item = (&'static str, u64)> {
    [
        "unix_connection",
        "tcp_connection",
        "tcp_request",
        "tcp_unauthenticated_connection",
    ]
    .into_iter()
    .zip(
        REFUSED_TOTAL
            .iter()
            .map(|n| n.load(std::sync::atomic::Ordering::Relaxed)),
    )
}

/// Logs refusals: the first, then one every 10 s with how many went unsaid, so that a flood
/// of connections does not flood the log.
#[derive(Default)]
pub(crate) struct Refusals {
    last: Option<Instant>,
    unsaid: u64,
}

impl Refusals {
    pub(crate) const fn new() -> Self {
        Refusals {
            last: None,
            unsaid: 0,
        }
    }

    fn note(&mut self, uid: u32, why: &str) {
        Refused::UnixConnection.count();
        if let Some(unsaid) = self.due() {
            tracing::warn!(
                uid,
                refused_since_last_said = unsaid,
                "connection refused: {why}"
            );
        }
    }

    fn note_tcp(&mut self, address: std::net::IpAddr, why: &str) {
        Refused::TcpConnection.count();
        if let Some(unsaid) = self.due() {
            tracing::warn!(
                %address,
                refused_since_last_said = unsaid,
                "TCP connection closed: {why}"
            );
        }
    }

    /// Whether to say this one, with how many went unsaid since the last said.
    pub(crate) fn due(&mut self) -> Option<u64> {
        if self
            .last
            .is_some_and(|t| t.elapsed() < Duration::from_secs(10))
        {
            self.unsaid += 1;
            return None;
        }
        self.last = Some(Instant::now());
        Some(std::mem::take(&mut self.unsaid))
    }
}

/// Ends a connection's input once no request has been in flight on it for its limit, or
/// (TCP) once its authentication deadline has passed with no request authenticated.
struct IdleTimer {
    activity: Arc<Activity>,
    idle: Duration,
    /// Until a request is authenticated: when the connection is closed if none has been,
    /// and how long after its accept that is.
    authenticate_by: Option<(Instant, Duration)>,
    /// Once the input has been ended, it stays ended.
    closed: Option<Closed>,
    timer: Pin<Box<Sleep>>,
}

impl IdleTimer {
    fn new(activity: Arc<Activity>, idle: Duration) -> Self {
        Self {
            activity,
            idle,
            authenticate_by: None,
            closed: None,
            timer: Box::pin(tokio::time::sleep(idle)),
        }
    }

    /// Also closes the connection `within` of now unless a request on it is authenticated.
    fn with_authentication(activity: Arc<Activity>, idle: Duration, within: Duration) -> Self {
        let by = Instant::now() + within;
        Self {
            activity,
            idle,
            authenticate_by: Some((by, within)),
            closed: None,
            timer: Box::pin(tokio::time::sleep_until(by.min(Instant::now() + idle))),
        }
    }

    /// Whether the connection is to be closed; else the timer is set for the next look.
    /// Called where the server waits to read, which it always does.
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        if self.closed.is_none() {
            self.closed = self.due(cx);
            if let (Some(Closed::NotAuthenticated), Some((_, within))) =
                (self.closed, self.authenticate_by)
            {
                tcp::note_unauthenticated_close(within);
            }
        }
        self.closed.is_some()
    }

    fn due(&mut self, cx: &mut Context<'_>) -> Option<Closed> {
        while self.timer.as_mut().poll(cx).is_ready() {
            let now = Instant::now();
            if let Some((by, _)) = self.authenticate_by {
                if self.activity.is_authenticated() {
                    self.authenticate_by = None;
                } else if by <= now {
                    // Whatever is in flight is a refusal: nothing unauthenticated gets further.
                    return Some(Closed::NotAuthenticated);
                }
            }
            let idle_at = match self.activity.deadline(self.idle) {
                Some(at) if at <= now => return Some(Closed::Idle),
                Some(at) => at,
                None => now + self.idle,
            };
            let next = self
                .authenticate_by
                .map_or(idle_at, |(by, _)| by.min(idle_at));
            self.timer.as_mut().reset(next);
        }
        None
    }
}

/// Why a connection's input was ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Closed {
    Idle,
    NotAuthenticated,
}

/// An accepted connection, on the Unix socket or TCP: `held` keeps its place in the counts
/// (and what requests learn of it) while it is open, and its reads end (EOF) once it has been
/// idle too long, or (TCP) has not authenticated in time.
pub struct Counted<S, H> {
    stream: S,
    idle: IdleTimer,
    held: H,
}

/// A Unix socket connection.
pub type Conn = Counted<UnixStream, (PeerInfo, Permit)>;

impl Connected for Conn {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        self.held.0.clone()
    }
}

impl<S: AsyncRead + Unpin, H: Unpin> AsyncRead for Counted<S, H> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // Looked at before reading: a peer that never lets the reads wait is closed too.
        if this.idle.expired(cx) {
            // An end of input: the server closes the connection.
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.stream).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin, H: Unpin> AsyncWrite for Counted<S, H> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// Raises the soft limit on open files to the hard one: connections, perf events and BPF
/// objects all take descriptors. Returns the limit now in force.
pub fn raise_fd_limit() -> io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return Err(io::Error::last_os_error());
        }
        if lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
    }
    Ok(lim.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(total: usize, per_user: usize) -> Limits {
        Limits {
            total,
            per_user,
            idle: Duration::from_secs(1),
        }
    }

    #[test]
    fn users_are_capped_and_root_keeps_its_reserve() {
        let counts = Arc::new(Mutex::new(Counts::default()));
        let l = limits(8, 3);
        let served = |uid| {
            let (p, why) = admit(&counts, &l, uid).expect("answered");
            (p, why.is_none())
        };
        let a: Vec<_> = (0..3).map(|_| served(1000)).collect();
        assert!(a.iter().all(|(_, ok)| *ok));
        let (_, ok) = served(1000);
        assert!(!ok, "a fourth connection of uid 1000");
        // 7 of 8 usable by others (reserve 1): uid 1001 gets 3, uid 1002 one, then no more.
        let b: Vec<_> = (0..3).map(|_| served(1001)).collect();
        assert!(b.iter().all(|(_, ok)| *ok));
        let (_c, ok) = served(1002);
        assert!(ok);
        let (_, ok) = served(1002);
        assert!(!ok, "the reserve is root's");
        let (_r, ok) = served(0);
        assert!(ok, "root gets the reserve");
        let (_, ok) = served(0);
        assert!(!ok, "not more than the total");
        // Closing frees places.
        drop(a);
        let (_, ok) = served(1000);
        assert!(ok);
    }

    #[test]
    fn refusals_held_open_are_bounded() {
        let counts = Arc::new(Mutex::new(Counts::default()));
        let l = limits(2, 1);
        let _held = admit(&counts, &l, 1000).unwrap();
        let refused: Vec<_> = (0..MAX_REFUSED)
            .map(|_| admit(&counts, &l, 1000).expect("answered"))
            .collect();
        assert!(refused.iter().all(|(_, why)| why.is_some()));
        assert!(admit(&counts, &l, 1000).is_none(), "closed unanswered");
        drop(refused);
        assert!(admit(&counts, &l, 1000).is_some());
    }

    /// A connection held to an authentication deadline: its input ends at the deadline
    /// unless a request on it was authenticated, requests in flight or not.
    #[tokio::test(flavor = "current_thread")]
    async fn unauthenticated_connections_end_at_their_deadline() {
        use tokio::io::AsyncReadExt;
        let within = Duration::from_millis(100);
        let conn = |authenticated: bool| {
            let (near, far) = tokio::io::duplex(64);
            let activity = Arc::new(Activity::new());
            if authenticated {
                activity.authenticated();
            }
            let conn = Counted {
                stream: near,
                idle: IdleTimer::with_authentication(
                    activity.clone(),
                    Duration::from_secs(60),
                    within,
                ),
                held: (),
            };
            (conn, far, activity)
        };
        let (mut anonymous, _far, activity) = conn(false);
        // A request in flight (a refusal being answered) does not keep it open.
        let _busy = activity.begin();
        let started = Instant::now();
        let n = anonymous.read(&mut [0u8; 8]).await.unwrap();
        assert_eq!(n, 0, "the input ends");
        assert!(started.elapsed() >= within);
        assert_eq!(
            anonymous.read(&mut [0u8; 8]).await.unwrap(),
            0,
            "and stays ended"
        );

        let (mut known, _far, _) = conn(true);
        let read = tokio::time::timeout(within * 3, known.read(&mut [0u8; 8])).await;
        assert!(
            read.is_err(),
            "an authenticated connection is kept: {read:?}"
        );
    }
}
