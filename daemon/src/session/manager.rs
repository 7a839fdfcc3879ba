//! The task that owns every session. The gRPC service sends it [`Command`]s through a
//! [`Handle`]; it also consumes process events from BPF and ends sessions on their timers.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use tokio::sync::{mpsc, oneshot, watch};
use tracer_common::{ProcEvent, MAX_TRACKED_SESSIONS, PROC_EVENT_EXIT, PROC_EVENT_FORK};
use tracer_proto::{target, EndReason, Mode, SessionInfo, SessionState, StartSessionRequest};

use super::{build_report, counting, Session};
use crate::{
    access::Caller, bpf::ProcessFollower, error::Error, perf, process, report::Report, store::Store,
};

/// Longest session a client may ask for.
pub const MAX_DURATION_MS: u64 = 24 * 60 * 60 * 1000;
/// Running sessions at once, all modes together.
pub const MAX_RUNNING: usize = 256;

type Reply<T> = oneshot::Sender<Result<T, Error>>;

enum Command {
    Start {
        req: StartSessionRequest,
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
        reply: Reply<Report>,
    },
    Expire {
        id: String,
    },
    Shutdown {
        reply: oneshot::Sender<()>,
    },
}

/// A cheap, cloneable way to talk to the manager.
#[derive(Clone)]
pub struct Handle {
    tx: mpsc::Sender<Command>,
}

impl Handle {
    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, Error> {
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
        self.call(|reply| Command::Start { req, caller, reply })
            .await
    }
    pub async fn stop(&self, id: String, caller: Caller) -> Result<SessionInfo, Error> {
        self.call(|reply| Command::Stop { id, caller, reply }).await
    }
    /// The session's state, and a receiver that turns `true` when it ends.
    pub async fn get(
        &self,
        id: String,
        caller: Caller,
    ) -> Result<(SessionInfo, watch::Receiver<bool>), Error> {
        self.call(|reply| Command::Get { id, caller, reply }).await
    }
    pub async fn list(&self, caller: Caller) -> Result<Vec<SessionInfo>, Error> {
        self.call(|reply| Command::List { caller, reply }).await
    }
    pub async fn report(&self, id: String, caller: Caller) -> Result<Report, Error> {
        self.call(|reply| Command::Report { id, caller, reply })
            .await
    }
    /// Ends every running session (their reports are kept) and stops the manager.
    pub async fn shutdown(&self) {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Command::Shutdown { reply }).await.is_ok() {
            let _ = rx.await;
        }
    }
}

pub struct Manager {
    running: HashMap<String, Session>,
    finished: HashMap<String, SessionInfo>,
    /// Reports that could not be written to the store; served from memory.
    unsaved: HashMap<String, Report>,
    store: Store,
    follower: Arc<ProcessFollower>,
    used_slots: u64,
    tx: mpsc::Sender<Command>,
}

impl Manager {
    /// Starts the manager task. Sessions left running by a daemon that died are marked failed.
    pub fn spawn(
        store: Store,
        follower: Arc<ProcessFollower>,
    ) -> Result<(Handle, tokio::task::JoinHandle<()>), Error> {
        let (tx, rx) = mpsc::channel(256);
        let mut finished = HashMap::new();
        for mut info in store.sessions()? {
            if info.state == SessionState::Running as i32 {
                info.state = SessionState::Failed.into();
                info.end_reason = EndReason::Error.into();
                info.error = "tracerd stopped unexpectedly while this session ran".into();
                store.put(&info, &build_report(&info, 0, None).to_json())?;
            }
            finished.insert(info.id.clone(), info);
        }
        let (proc_tx, proc_rx) = mpsc::unbounded_channel();
        follower
            .events(proc_tx)
            .map_err(|e| Error::io("reading BPF process events", e))?;
        let manager = Manager {
            running: HashMap::new(),
            finished,
            unsaved: HashMap::new(),
            store,
            follower,
            used_slots: 0,
            tx: tx.clone(),
        };
        let task = tokio::spawn(manager.run(rx, proc_rx));
        Ok((Handle { tx }, task))
    }

    async fn run(
        mut self,
        mut rx: mpsc::Receiver<Command>,
        mut proc_rx: mpsc::UnboundedReceiver<ProcEvent>,
    ) {
        let mut sweep = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                cmd = rx.recv() => match cmd {
                    Some(Command::Shutdown { reply }) => {
                        let ids: Vec<String> = self.running.keys().cloned().collect();
                        for id in ids {
                            self.finish(&id, EndReason::DaemonShutdown, None);
                        }
                        let _ = reply.send(());
                        return;
                    }
                    Some(cmd) => self.handle(cmd),
                    None => return,
                },
                Some(ev) = proc_rx.recv() => self.on_proc_event(ev),
                _ = sweep.tick() => self.sweep(),
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Start { req, caller, reply } => {
                let _ = reply.send(self.start(req, caller));
            }
            Command::Stop { id, caller, reply } => {
                let _ = reply.send(self.stop(&id, caller));
            }
            Command::Get { id, caller, reply } => {
                let _ = reply.send(self.get(&id, caller));
            }
            Command::List { caller, reply } => {
                let losses = self.follower.losses();
                let mut all: Vec<SessionInfo> =
                    self.running.values_mut().map(|s| s.info(&losses)).collect();
                all.extend(self.finished.values().cloned());
                all.retain(|s| caller.sees(s.owner_uid));
                all.sort_by(|a, b| {
                    b.started_unix_ms
                        .cmp(&a.started_unix_ms)
                        .then(a.id.cmp(&b.id))
                });
                let _ = reply.send(Ok(all));
            }
            Command::Report { id, caller, reply } => {
                let _ = reply.send(self.report(&id, caller));
            }
            Command::Expire { id } => self.finish(&id, EndReason::Duration, None),
            Command::Shutdown { .. } => unreachable!("handled in run"),
        }
    }

    fn start(&mut self, req: StartSessionRequest, caller: Caller) -> Result<SessionInfo, Error> {
        let mode = Mode::try_from(req.mode)
            .map_err(|_| Error::InvalidArgument(format!("unknown mode {}", req.mode)))?;
        match mode {
            Mode::Unspecified => {
                return Err(Error::InvalidArgument(
                    "a mode is required: counting, sampling or tracing".into(),
                ))
            }
            Mode::Counting => {}
            Mode::Sampling | Mode::Tracing => {
                return Err(Error::Unimplemented(format!(
                    "{} mode is not available in this tracerd yet; counting mode is",
                    super::mode_name(req.mode)
                )))
            }
        }
        let duration_ms = match req.duration_ms {
            None => 0,
            Some(0) => {
                return Err(Error::InvalidArgument(
                    "duration must be greater than 0".into(),
                ))
            }
            Some(d) if d > MAX_DURATION_MS => {
                return Err(Error::InvalidArgument(
                    "duration must be at most 24h".into(),
                ))
            }
            Some(d) => d,
        };
        let target = req
            .target
            .ok_or_else(|| Error::InvalidArgument("a target is required: a pid, or all".into()))?;
        let specs = counting::resolve(&req.counting.map(|c| c.events).unwrap_or_default())?;
        if self.running.len() >= MAX_RUNNING {
            return Err(Error::ResourceExhausted(format!(
                "{MAX_RUNNING} sessions are running already"
            )));
        }
        let (scope, pid) = match target.kind {
            Some(target::Kind::Pid(0)) | None => {
                return Err(Error::InvalidArgument(
                    "a target is required: a pid, or all".into(),
                ))
            }
            Some(target::Kind::Pid(pid)) => {
                caller.may_trace_pid(pid)?;
                if !process::alive(pid) {
                    return Err(Error::NoSuchProcess { pid });
                }
                let tids = process::threads(pid).map_err(|_| Error::NoSuchProcess { pid })?;
                (
                    perf::Scope::Threads {
                        tids,
                        on_exec: target.launched,
                    },
                    Some(pid),
                )
            }
            Some(target::Kind::All(_)) => {
                caller.may_trace_all()?;
                (
                    perf::Scope::Cpus(
                        perf::online_cpus().map_err(|e| Error::io("listing online CPUs", e))?,
                    ),
                    None,
                )
            }
        };
        let owner_uid = caller.uid.ok_or_else(|| Error::PermissionDenied {
            reason: "no caller credentials".into(),
        })?;

        let slot = match pid {
            Some(pid) => {
                let slot = self.take_slot()?;
                if let Err(e) = self.follower.follow(pid, slot) {
                    self.free_slot(slot);
                    return Err(e.into());
                }
                Some(slot)
            }
            None => None,
        };
        let loss_base = self.follower.losses();
        let counting = match counting::Counting::open(&specs, &scope, pid) {
            Ok(c) => c,
            Err(e) => {
                self.release(slot);
                return Err(e);
            }
        };
        // Followed first, checked after: an exit from here on arrives as an event.
        if let Some(pid) = pid.filter(|&p| !process::alive(p)) {
            self.release(slot);
            return Err(Error::NoSuchProcess { pid });
        }

        let id = new_id();
        let (ended, _) = watch::channel(false);
        let expiry = (duration_ms > 0).then(|| {
            let tx = self.tx.clone();
            let id = id.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(duration_ms)).await;
                let _ = tx.send(Command::Expire { id }).await;
            })
        });
        let mut session = Session {
            id: id.clone(),
            mode,
            target,
            duration_ms,
            owner_uid,
            started: Instant::now(),
            started_unix_ms: unix_ms(),
            slot,
            live: pid.into_iter().collect(),
            followed: u32::from(pid.is_some()),
            exited: 0,
            proc_events: 0,
            counting: Some(counting),
            loss_base,
            command: pid.and_then(process::comm),
            ended,
            expiry,
        };
        let info = session.info(&loss_base);
        tracing::info!(id, target = %super::target_label(Some(&target)), uid = owner_uid, "session started");
        self.running.insert(id, session);
        Ok(info)
    }

    fn take_slot(&mut self) -> Result<u8, Error> {
        let free = (0..MAX_TRACKED_SESSIONS as u8)
            .find(|i| self.used_slots & (1 << i) == 0)
            .ok_or_else(|| {
                Error::ResourceExhausted(format!(
                    "at most {MAX_TRACKED_SESSIONS} sessions may follow processes at once"
                ))
            })?;
        self.used_slots |= 1 << free;
        Ok(free)
    }

    fn free_slot(&mut self, slot: u8) {
        self.used_slots &= !(1 << slot);
    }

    fn release(&mut self, slot: Option<u8>) {
        if let Some(slot) = slot {
            if let Err(e) = self.follower.release(slot) {
                tracing::warn!(%e, slot, "releasing a BPF session slot");
            }
            self.free_slot(slot);
        }
    }

    fn stop(&mut self, id: &str, caller: Caller) -> Result<SessionInfo, Error> {
        let owner = self.owner(id)?;
        caller.may_access(owner, id)?;
        if self.running.contains_key(id) {
            self.finish(id, EndReason::Stopped, None);
        }
        Ok(self.finished[id].clone())
    }

    fn owner(&self, id: &str) -> Result<u32, Error> {
        self.running
            .get(id)
            .map(|s| s.owner_uid)
            .or_else(|| self.finished.get(id).map(|s| s.owner_uid))
            .ok_or_else(|| Error::NoSuchSession { id: id.into() })
    }

    fn get(
        &mut self,
        id: &str,
        caller: Caller,
    ) -> Result<(SessionInfo, watch::Receiver<bool>), Error> {
        caller.may_access(self.owner(id)?, id)?;
        let losses = self.follower.losses();
        if let Some(s) = self.running.get_mut(id) {
            return Ok((s.info(&losses), s.ended.subscribe()));
        }
        let (_, rx) = watch::channel(true);
        Ok((self.finished[id].clone(), rx))
    }

    fn report(&mut self, id: &str, caller: Caller) -> Result<Report, Error> {
        caller.may_access(self.owner(id)?, id)?;
        if self.running.contains_key(id) {
            return Err(Error::StillRunning { id: id.into() });
        }
        if let Some(r) = self.unsaved.get(id) {
            return Ok(r.clone());
        }
        let json = self
            .store
            .report(id)?
            .ok_or_else(|| Error::NoSuchSession { id: id.into() })?;
        Report::from_json(&json).map_err(|e| Error::io(format!("stored report of {id}"), e.into()))
    }

    /// Ends a running session: final readings, report, persisted.
    fn finish(&mut self, id: &str, reason: EndReason, error: Option<String>) {
        let Some(mut s) = self.running.remove(id) else {
            return;
        };
        if let Some(task) = s.expiry.take() {
            task.abort();
        }
        let losses = self.follower.losses();
        let mut info = s.info(&losses);
        // Close the counters before anything else can fail.
        s.counting = None;
        self.release(s.slot);
        info.state = if error.is_some() {
            SessionState::Failed
        } else {
            SessionState::Finished
        }
        .into();
        info.end_reason = reason.into();
        info.error = error.unwrap_or_default();
        let report = build_report(&info, s.followed, s.command.take());
        if let Err(e) = self.store.put(&info, &report.to_json()) {
            tracing::error!(%e, id, "could not persist the report; it is kept in memory until tracerd exits");
            self.unsaved.insert(id.to_owned(), report);
        }
        tracing::info!(
            id,
            reason = super::end_reason_name(info.end_reason),
            "session ended"
        );
        self.finished.insert(id.to_owned(), info);
        let _ = s.ended.send(true);
    }

    fn on_proc_event(&mut self, ev: ProcEvent) {
        let mut ended = Vec::new();
        for s in self.running.values_mut() {
            let Some(slot) = s.slot else { continue };
            if ev.sessions & (1 << slot) == 0 {
                continue;
            }
            s.proc_events += 1;
            match ev.kind {
                PROC_EVENT_FORK if s.live.insert(ev.pid) => s.followed += 1,
                PROC_EVENT_EXIT => {
                    // A launched target's name is only known once it has exec'd.
                    if s.target.kind == Some(target::Kind::Pid(ev.pid)) {
                        let len = ev
                            .comm
                            .iter()
                            .position(|&b| b == 0)
                            .unwrap_or(ev.comm.len());
                        s.command = Some(String::from_utf8_lossy(&ev.comm[..len]).into_owned());
                    }
                    if s.live.remove(&ev.pid) {
                        s.exited += 1;
                    }
                    if s.live.is_empty() {
                        ended.push(s.id.clone());
                    }
                }
                _ => {}
            }
        }
        for id in ended {
            self.finish(&id, EndReason::TargetExited, None);
        }
    }

    /// Backstop for exit events the kernel could not deliver (counted as losses): processes
    /// that are gone are treated as exited.
    fn sweep(&mut self) {
        let mut ended = Vec::new();
        for s in self.running.values_mut().filter(|s| s.slot.is_some()) {
            let gone: Vec<u32> = s
                .live
                .iter()
                .copied()
                .filter(|&p| !process::alive(p))
                .collect();
            for pid in gone {
                s.live.remove(&pid);
                s.exited += 1;
            }
            if s.live.is_empty() {
                ended.push(s.id.clone());
            }
        }
        for id in ended {
            self.finish(&id, EndReason::TargetExited, None);
        }
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// 12 hex digits from the kernel's random pool.
fn new_id() -> String {
    let mut bytes = [0u8; 6];
    // SAFETY: getrandom writes at most `len` bytes into the buffer we own.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != 6 {
        // getrandom cannot fail for 6 bytes once the pool is initialised; fall back to time.
        bytes.copy_from_slice(&unix_ms().to_be_bytes()[2..]);
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
