//! The gRPC service: validates requests, asks the session manager, maps errors to statuses.

use std::{pin::Pin, sync::Arc, time::Duration};

use tokio::sync::mpsc;
use tokio_stream::{wrappers::ReceiverStream, Stream};
use tonic::{Request, Response, Status};
use tracer_proto::{
    tracer_server::Tracer, Capabilities, EventBatch, GetCapabilitiesRequest, GetReportRequest,
    ListSessionsRequest, ListSessionsResponse, ReportChunk, ReportFormat, SessionInfo, SessionRef,
    SessionState, StartSessionRequest, StreamEventsRequest, WatchSessionRequest,
};

use crate::{
    access::Caller,
    conn::PeerInfo,
    remote::{gate::Identified, Remote},
    session::manager::Handle,
};

/// Reports are streamed in pieces of this size.
const CHUNK: usize = 64 * 1024;

/// An aligned start (fan-out) may be this far ahead of the daemon's clock.
const MAX_START_DELAY: Duration = Duration::from_secs(60);

pub struct Service {
    pub sessions: Handle,
    pub capabilities: Arc<Capabilities>,
    /// TCP clients' authentication and grants (with `--listen`).
    pub remote: Option<Arc<Remote>>,
}

impl Service {
    /// The caller: SO_PEERCRED on the Unix socket; over TCP, its certificate or token's
    /// grant in the access policy.
    fn caller<T>(&self, req: &Request<T>) -> Result<Caller, Status> {
        if let Some(info) = req.extensions().get::<PeerInfo>() {
            return Ok(Caller {
                uid: info.uds.peer_cred.map(|cred| cred.uid()),
                pid: info
                    .uds
                    .peer_cred
                    .and_then(|cred| cred.pid())
                    .and_then(|pid| u32::try_from(pid).ok()),
                remote: None,
            });
        }
        // Identified by the gate before the body was read.
        if let Some(id) = req.extensions().get::<Identified>() {
            return Ok(Caller::remote(id.0.clone()));
        }
        match &self.remote {
            Some(remote) => Ok(Caller::remote(remote.identify(req)?)),
            None => Err(Status::unauthenticated("no credentials")),
        }
    }
}

/// Bounds on what a request may hold, checked before anything is looked up or started. A
/// message is at most 4 MiB (tonic's limit), but that is a million uprobes (0.3 s of work
/// before their refusal, part of it on the session manager's task, which every request waits
/// on), a 4 MiB push URL or uprobe pattern, or a million pids whose filter costs a look
/// through them for every stack of a report. Each bound is well past what a client
/// has a use for. What costs only its length once (a session id, an event name) is left to
/// the checks that answer it, which echo it clipped.
mod bounds {
    use tonic::Status;
    use tracer_proto::{GetReportRequest, StartSessionRequest};

    /// `--uprobe` specs, duplicates included (they are merged, up to 256 distinct).
    pub const UPROBES: usize = 16_384;
    /// `--events` entries (each may name several, comma-separated).
    pub const EVENTS: usize = 1024;
    /// A spec, URL or process name: a path and a symbol fit.
    pub const TEXT: usize = 4096;
    /// Each PEM of `push_tls`: a CA bundle fits (the system's is ~200 KiB).
    pub const PEM: usize = 1 << 20;
    /// Report filters' pids and tids, each.
    pub const IDS: usize = 4096;

    fn count(what: &str, n: usize, max: usize) -> Result<(), Status> {
        if n > max {
            return Err(Status::invalid_argument(format!(
                "{n} {what}; at most {max} a request"
            )));
        }
        Ok(())
    }

    fn text(what: &str, s: &[u8], max: usize) -> Result<(), Status> {
        if s.len() > max {
            return Err(Status::invalid_argument(format!(
                "{what} is {} bytes; at most {max}",
                s.len()
            )));
        }
        Ok(())
    }

    pub fn start(req: &StartSessionRequest) -> Result<(), Status> {
        if let Some(c) = &req.counting {
            count("--uprobe specs", c.uprobes.len(), UPROBES)?;
            count("--events entries", c.events.len(), EVENTS)?;
            for s in &c.uprobes {
                text("an --uprobe spec", s.as_bytes(), TEXT)?;
            }
        }
        if let Some(o) = &req.sampling {
            text("the push URL", o.push_url.as_bytes(), TEXT)?;
            if let Some(t) = &o.push_tls {
                text("the push CA", &t.ca_pem, PEM)?;
                text("the push certificate", &t.cert_pem, PEM)?;
                text("the push key", &t.key_pem, PEM)?;
            }
        }
        Ok(())
    }

    pub fn report(req: &GetReportRequest) -> Result<(), Status> {
        count("pids", req.pids.len(), IDS)?;
        count("tids", req.tids.len(), IDS)?;
        text("the process name", req.comm.as_bytes(), TEXT)?;
        text("the sort key", req.sort.as_bytes(), TEXT)
    }
}

/// Waits for an aligned start time (wall clock, ms since the epoch) given by a fan-out client.
async fn wait_for_start(start_at_unix_ms: u64) -> Result<(), Status> {
    if start_at_unix_ms == 0 {
        return Ok(());
    }
    let now = Duration::from_nanos(crate::clock::unix_ns());
    let delay = Duration::from_millis(start_at_unix_ms).saturating_sub(now);
    if delay > MAX_START_DELAY {
        return Err(Status::invalid_argument(format!(
            "the start time is {} s ahead of this host's clock (at most {} s)",
            delay.as_secs(),
            MAX_START_DELAY.as_secs()
        )));
    }
    tokio::time::sleep(delay).await;
    Ok(())
}

fn id_of(id: &str) -> Result<String, Status> {
    if id.is_empty() {
        return Err(Status::invalid_argument("a session id is required"));
    }
    Ok(id.to_owned())
}

type Stream2<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl Tracer for Service {
    async fn start_session(
        &self,
        req: Request<StartSessionRequest>,
    ) -> Result<Response<SessionInfo>, Status> {
        let who = self.caller(&req)?;
        bounds::start(req.get_ref())?;
        wait_for_start(req.get_ref().start_at_unix_ms).await?;
        Ok(Response::new(
            self.sessions.start(req.into_inner(), who).await?,
        ))
    }

    async fn stop_session(
        &self,
        req: Request<SessionRef>,
    ) -> Result<Response<SessionInfo>, Status> {
        let who = self.caller(&req)?;
        let id = id_of(&req.get_ref().id)?;
        Ok(Response::new(self.sessions.stop(id, who).await?))
    }

    async fn delete_session(
        &self,
        req: Request<SessionRef>,
    ) -> Result<Response<SessionInfo>, Status> {
        let who = self.caller(&req)?;
        let id = id_of(&req.get_ref().id)?;
        Ok(Response::new(self.sessions.delete(id, who).await?))
    }

    async fn get_session(&self, req: Request<SessionRef>) -> Result<Response<SessionInfo>, Status> {
        let who = self.caller(&req)?;
        let id = id_of(&req.get_ref().id)?;
        Ok(Response::new(self.sessions.get(id, who).await?.0))
    }

    type WatchSessionStream = Stream2<SessionInfo>;

    async fn watch_session(
        &self,
        req: Request<WatchSessionRequest>,
    ) -> Result<Response<Self::WatchSessionStream>, Status> {
        let who = self.caller(&req)?;
        let id = id_of(&req.get_ref().id)?;
        let interval = Duration::from_millis(u64::from(match req.get_ref().interval_ms {
            0 => 1000,
            ms => ms.max(50),
        }));
        // Fails here, before the stream starts, for an unknown or foreign session.
        let (first, mut ended) = self.sessions.get(id.clone(), who.clone()).await?;
        let (tx, rx) = mpsc::channel(4);
        let sessions = self.sessions.clone();
        tokio::spawn(async move {
            let mut info = first;
            loop {
                let done = info.state != SessionState::Running as i32;
                // A client that went away ends this task; nothing else depends on it.
                if tx.send(Ok(info)).await.is_err() || done {
                    return;
                }
                tokio::select! {
                    _ = tokio::time::sleep(interval) => {}
                    _ = ended.changed() => {}
                }
                info = match sessions.get(id.clone(), who.clone()).await {
                    Ok((i, _)) => i,
                    Err(e) => {
                        let _ = tx.send(Err(e.into())).await;
                        return;
                    }
                };
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn list_sessions(
        &self,
        req: Request<ListSessionsRequest>,
    ) -> Result<Response<ListSessionsResponse>, Status> {
        let who = self.caller(&req)?;
        Ok(Response::new(ListSessionsResponse {
            sessions: self.sessions.list(who).await?,
        }))
    }

    type GetReportStream = Stream2<ReportChunk>;

    async fn get_report(
        &self,
        req: Request<GetReportRequest>,
    ) -> Result<Response<Self::GetReportStream>, Status> {
        let who = self.caller(&req)?;
        bounds::report(req.get_ref())?;
        let id = id_of(&req.get_ref().id)?;
        let format = ReportFormat::try_from(req.get_ref().format).map_err(|_| {
            Status::invalid_argument(format!("unknown report format {}", req.get_ref().format))
        })?;
        let sort = match req.get_ref().sort.as_str() {
            "" => "tottime",
            s if tracer_report::PY_SORTS.contains(&s) => s,
            s => {
                return Err(Status::invalid_argument(format!(
                    "unknown sort key '{}' (known: {})",
                    crate::error::clip(s, 64),
                    tracer_report::PY_SORTS.join(", ")
                )))
            }
        };
        let mut report = self.sessions.report(id, who, req.get_ref().interim).await?;
        if let Some(py) = report.python.as_mut() {
            tracer_report::sort_functions(&mut py.functions, sort);
        }
        let limit = req.get_ref().limit as usize;
        if let Some(p) = report.profile.as_mut() {
            let r = req.get_ref();
            p.retain(&r.pids, &r.tids, &r.comm);
            if r.gil_held {
                p.retain_gil_held();
            }
        }
        if matches!(format, ReportFormat::Chrome | ReportFormat::Perfetto) {
            let Some(trace) = report.trace.take() else {
                return Err(Status::failed_precondition(
                    "chrome and perfetto are for tracing sessions; this one recorded no trace",
                ));
            };
            return Ok(Response::new(stream_export(move |w| match format {
                ReportFormat::Chrome => tracer_report::export::chrome(&trace, w),
                _ => tracer_report::export::perfetto(&trace, w),
            })));
        }
        let bytes = match format {
            ReportFormat::Unspecified | ReportFormat::Table => {
                report.to_table_limited(limit).into_bytes()
            }
            ReportFormat::Json => report.to_json().into_bytes(),
            ReportFormat::Pstats => match &report.python {
                Some(py) => tracer_report::export::pstats(&py.functions),
                None => {
                    return Err(Status::failed_precondition(
                        "pstats needs Python results: start the session with --python",
                    ))
                }
            },
            ReportFormat::Chrome | ReportFormat::Perfetto => unreachable!("streamed above"),
            ReportFormat::Kernels => match &report.cuda {
                Some(c) => {
                    let mut out = String::new();
                    tracer_report::kernels::table(&mut out, c, limit);
                    out.into_bytes()
                }
                None => {
                    return Err(Status::failed_precondition(
                        "kernels needs CUDA results: start the session with --cuda",
                    ))
                }
            },
            ReportFormat::Folded
            | ReportFormat::Pprof
            | ReportFormat::Otlp
            | ReportFormat::Speedscope
            | ReportFormat::Svg => {
                let Some(p) = &report.profile else {
                    return Err(Status::failed_precondition(
                        "folded, pprof, otlp, speedscope and svg are for sampling sessions; this one has no stack samples",
                    ));
                };
                let title = format!("tracer {} ({})", report.session.id, report.session.target);
                match format {
                    ReportFormat::Folded => tracer_report::export::folded(p).into_bytes(),
                    ReportFormat::Pprof => {
                        tracer_report::export::pprof(p, &report.processes.containers)
                    }
                    ReportFormat::Otlp => tracer_report::export::otlp(
                        p,
                        &report.processes.containers,
                        &crate::container::host_name(),
                    ),
                    ReportFormat::Speedscope => {
                        tracer_report::export::speedscope(p, &title).into_bytes()
                    }
                    _ => tracer_report::export::svg(p, &title).into_bytes(),
                }
            }
        };
        let chunks: Vec<Result<ReportChunk, Status>> = bytes
            .chunks(CHUNK)
            .map(|c| Ok(ReportChunk { data: c.to_vec() }))
            .collect();
        Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
    }

    type StreamEventsStream = Stream2<EventBatch>;

    async fn stream_events(
        &self,
        req: Request<StreamEventsRequest>,
    ) -> Result<Response<Self::StreamEventsStream>, Status> {
        let who = self.caller(&req)?;
        let id = id_of(&req.get_ref().id)?;
        let sub = self.sessions.subscribe(id, who).await?;
        Ok(Response::new(crate::live::stream(sub)))
    }

    async fn get_capabilities(
        &self,
        req: Request<GetCapabilitiesRequest>,
    ) -> Result<Response<Capabilities>, Status> {
        self.caller(&req)?;
        let mut caps = (*self.capabilities).clone();
        caps.now_unix_ns = crate::clock::unix_ns();
        Ok(Response::new(caps))
    }
}

/// Runs an exporter on a blocking thread, streaming what it writes in chunks: a large trace
/// is never held whole in memory, and a client that stops reading stops the export.
fn stream_export(
    export: impl FnOnce(&mut dyn std::io::Write) -> std::io::Result<()> + Send + 'static,
) -> Stream2<ReportChunk> {
    let (tx, rx) = mpsc::channel(8);
    tokio::task::spawn_blocking(move || {
        let mut w = ChunkWriter {
            tx: tx.clone(),
            buf: Vec::with_capacity(CHUNK),
        };
        let result = export(&mut w).and_then(|()| w.send());
        if let Err(e) = result {
            if e.kind() != std::io::ErrorKind::BrokenPipe {
                let _ =
                    tx.blocking_send(Err(Status::internal(format!("exporting the trace: {e}"))));
            }
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

struct ChunkWriter {
    tx: mpsc::Sender<Result<ReportChunk, Status>>,
    buf: Vec<u8>,
}

impl ChunkWriter {
    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let data = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK));
        self.tx
            .blocking_send(Ok(ReportChunk { data }))
            .map_err(|_| std::io::ErrorKind::BrokenPipe.into())
    }
}

impl std::io::Write for ChunkWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            self.send()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
