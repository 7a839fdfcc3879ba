//! What the manager is sent: clients' requests through a [`Handle`] ([`Request`]), and
//! what the work it hands off brings back ([`Done`]), on a channel of its own.

use tokio::sync::{mpsc, oneshot, watch};
use tracer_proto::{SessionInfo, StartSessionRequest};

use super::{
    ahead::{self, Ahead},
    closing,
};
pub use crate::session::tracing::Subscription;
use crate::{access::Caller, error::Error, store::StoreError};
use tracer_report::Report;

pub(super) type Reply<T> = oneshot::Sender<Result<T, Error>>;

/// A client's request, from a [`Handle`]: answered through its `reply`.
pub(super) enum Request {
    Start {
        // Boxed: the request is far larger than any other kind's.
        req: Box<StartSessionRequest>,
        caller: Caller,
        reply: Reply<SessionInfo>,
    },
    Stop {
        id: String,
        caller: Caller,
        reply: Reply<SessionInfo>,
    },
    Get {
        id: String,
        caller: Caller,
        reply: Reply<(SessionInfo, watch::Receiver<bool>)>,
    },
    List {
        caller: Caller,
        reply: Reply<Vec<SessionInfo>>,
    },
    Report {
        id: String,
        caller: Caller,
        /// A running session's report so far, rather than a refusal.
        interim: bool,
        reply: Reply<(Fetched, std::path::PathBuf)>,
    },
    Subscribe {
        id: String,
        caller: Caller,
        reply: Reply<Subscription>,
    },
    Delete {
        id: String,
        caller: Caller,
        reply: Reply<SessionInfo>,
    },
    Metrics {
        reply: oneshot::Sender<String>,
    },
    Shutdown {
        reply: oneshot::Sender<()>,
    },
}

/// Work the manager handed off (to blocking threads, the store's writer, a timer) coming
/// back: each continues or ends something a request began.
pub(super) enum Done {
    /// A closing session's report, named and stored off the manager's task.
    Named {
        id: String,
        done: Box<closing::Settled>,
    },
    /// The machine's interpreters, inspected at start off this task.
    Inspected(crate::session::python::Inspected),
    /// The sampler has read the new program of a process held at its exec.
    SampledExec(u32),
    /// The unsaved reports the store took, written off the manager's task.
    Saved(Vec<String>),
    /// A started session's running record, written off the manager's task.
    Recorded {
        info: SessionInfo,
        stored: Result<(), StoreError>,
        reply: Reply<SessionInfo>,
    },
    /// A deleted session's trace file and stored report, removed off the manager's task.
    Deleted {
        id: String,
        stored: Result<(), StoreError>,
        reply: Reply<SessionInfo>,
    },
    /// A session's duration is up (its timer).
    Expire { id: String },
    /// GPU times in a session's process are off (`--gpu-times --pid`): the session ends now,
    /// as it was asked to, with its last records counted.
    GpuTimesOff {
        id: String,
        pid: u32,
        status: Result<String, String>,
        reason: tracer_proto::EndReason,
        error: Option<String>,
    },
    /// The processes that map a CUDA library, found off the manager's task for the CUDA
    /// sessions on every process.
    CudaScanned(Vec<u32>),
    /// A CUDA library's probes for a session, attached off the manager's task.
    CudaProbed {
        session: String,
        probed: crate::session::cuda::CudaProbed,
    },
    /// A launched process's library waiting in `cuInit` (`cuda::launched`): found and its
    /// table taken, or why launches cannot be counted there, off the manager's task.
    CudaHandshake {
        session: String,
        pid: u32,
        injection: Option<tracer_inspect::cuda::Injection>,
        counted: Result<crate::session::cuda::gpu_times::InProcess, String>,
    },
    /// Probes of a CUDA library that came back after their session ended are gone: its
    /// slot may be taken again.
    CudaReleased(u8),
    /// The processes that map a Python interpreter, found off the manager's task for the
    /// Python sessions on every process (see `sweep`).
    PythonScanned(Vec<crate::session::python::watch::FoundPython>),
    /// A start whose slow preparations (see [`Ahead`]) were made off the manager's task.
    Ready {
        req: StartSessionRequest,
        caller: Caller,
        reply: Reply<SessionInfo>,
        ahead: Ahead,
    },
    /// A start whose `--uprobe` probes were attached off the manager's task.
    Attached(ahead::AttachedStart),
    /// A start whose interpreters' Python probes were attached off the manager's task.
    PythonAttached(ahead::PythonAttachedStart),
    /// The probes of an interpreter a session met after its start, attached off the
    /// manager's task (`python::LateCheck`).
    LateProbed(crate::session::python::AttachedPython),
    /// What became of a session's in-process start left pending (the process was in native
    /// code): the counter's tool id, or why it will not count (the probes count it then).
    InprocSettled {
        session: String,
        pid: u32,
        outcome: Result<u32, String>,
    },
    /// A launched process counted by a profile function (3.10, 3.11) set a profile
    /// function of its own: the probes are to count it from now on (its program waits).
    InprocHandover {
        session: String,
        pid: u32,
        reply: super::python::HandoverReply,
    },
    /// A start whose target was asked to count in-process, off the manager's task.
    StartPrepared {
        req: StartSessionRequest,
        caller: Caller,
        reply: Reply<SessionInfo>,
        ahead: Ahead,
        prepared: Prepared,
    },
}

/// Where handed-off work sends what it brings back.
pub(super) type DoneTx = mpsc::UnboundedSender<Done>;

/// The in-process counter of a start's target, made before the session is: the session's
/// id, and the counter or why there is none.
pub(super) struct Prepared {
    pub(super) id: String,
    pub(super) counter: Result<tracer_inspect::python::inproc::Counter, String>,
    /// A launched target's: the variables its exec is to have (the counter's loader).
    pub(super) env: Vec<(String, String)>,
}

/// A cheap, cloneable way to talk to the manager.
#[derive(Clone)]
pub struct Handle {
    pub(super) tx: mpsc::Sender<Request>,
}

impl Handle {
    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Request) -> Result<T, Error> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| Error::ShuttingDown)?;
        rx.await.map_err(|_| Error::ShuttingDown)?
    }

    pub async fn start(
        &self,
        req: StartSessionRequest,
        caller: Caller,
    ) -> Result<SessionInfo, Error> {
        self.call(|reply| Request::Start {
            req: Box::new(req),
            caller,
            reply,
        })
        .await
    }
    /// The Prometheus exposition text.
    pub async fn metrics(&self) -> String {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Request::Metrics { reply }).await.is_err() {
            return String::new();
        }
        rx.await.unwrap_or_default()
    }

    pub async fn stop(&self, id: String, caller: Caller) -> Result<SessionInfo, Error> {
        self.call(|reply| Request::Stop { id, caller, reply }).await
    }
    /// The session's state, and a receiver that turns `true` when it ends.
    pub async fn get(
        &self,
        id: String,
        caller: Caller,
    ) -> Result<(SessionInfo, watch::Receiver<bool>), Error> {
        self.call(|reply| Request::Get { id, caller, reply }).await
    }
    pub async fn list(&self, caller: Caller) -> Result<Vec<SessionInfo>, Error> {
        self.call(|reply| Request::List { caller, reply }).await
    }
    pub async fn delete(&self, id: String, caller: Caller) -> Result<SessionInfo, Error> {
        self.call(|reply| Request::Delete { id, caller, reply })
            .await
    }

    /// A finished session's report. A stored one is parsed here, in the caller's task (on a
    /// blocking thread: a large profile's JSON takes a while), not in the manager's.
    pub async fn report(&self, id: String, caller: Caller, interim: bool) -> Result<Report, Error> {
        let (fetched, traces) = self
            .call(|reply| Request::Report {
                id: id.clone(),
                caller,
                interim,
                reply,
            })
            .await?;
        let mut report = match fetched {
            Fetched::Parsed(r) => *r,
            // Named here, off the manager's task, as an ending session's parts are.
            Fetched::Interim(mut r, parts) => tokio::task::spawn_blocking(move || {
                for part in parts {
                    part.fill(&mut r);
                }
                *r
            })
            .await
            .map_err(|e| Error::io("naming an interim report", std::io::Error::other(e)))?,
            // Read and parsed here: a large report takes the manager's task no time.
            Fetched::Stored(store) => {
                let key = id.clone();
                let json = tokio::task::spawn_blocking(move || {
                    store
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .report(&key)
                        .map(|json| json.map(|j| Report::from_json(&j)))
                })
                .await
                .map_err(|e| Error::io("reading a stored report", std::io::Error::other(e)))??;
                json.ok_or_else(|| Error::NoSuchSession { id: id.clone() })?
                    .map_err(|e| Error::io(format!("stored report of {id}"), e.into()))?
            }
        };
        if let Some(t) = report.trace.as_mut() {
            t.path = traces.join(&t.file);
        }
        Ok(report)
    }
    /// A running tracing session's events from now on.
    pub async fn subscribe(&self, id: String, caller: Caller) -> Result<Subscription, Error> {
        self.call(|reply| Request::Subscribe { id, caller, reply })
            .await
    }
    /// Ends every running session (their reports are kept) and stops the manager.
    pub async fn shutdown(&self) {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Request::Shutdown { reply }).await.is_ok() {
            let _ = rx.await;
        }
    }
}

/// A report as the manager hands it out: the one in memory, or the stored JSON, which the
/// caller's task parses.
pub enum Fetched {
    Parsed(Box<Report>),
    /// A running session's report so far, with what is left to name in it.
    Interim(Box<Report>, Vec<Box<dyn crate::session::ReportPart>>),
    /// In the store: read by the caller, off the manager's task.
    Stored(SharedStore),
}

/// The store, shared with the tasks that read reports out of it.
pub type SharedStore = crate::store::writer::Shared;
