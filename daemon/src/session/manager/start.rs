//! Starting a session: what it asks is checked, the target's scope found and a slot taken;
//! then its sources are opened in turn. A refusal after the slot was taken gives the slot
//! back with every probe attached into it (`abandon`); a start that is answered is in the
//! session table and in the store.

use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tracer_common::loss;
use tracer_proto::{EndReason, Mode, SessionInfo, StartSessionRequest};

use super::{
    ahead::{self, resolve_natives, Ahead},
    checks::{self, inproc_candidate, Asked},
    new_id, persist, Done, Manager, Prepared, Reply, INPROC_WAIT, MAX_RUNNING,
};
use crate::session::{loads::Ticket, python::watch::FoundPython};
use crate::{
    access::Caller,
    error::Error,
    session::{
        counting::{self, CountingSession},
        cuda::{self, CudaSession},
        native::NativeSession,
        sampling::SamplingSession,
        source::{Source, Sources},
        tracing::TracingSession,
        Measurement, Opening, Session,
    },
    store::StoreError,
};
use tracer_bpf::perf;
use tracer_inspect::native::NativeTarget;
use tracer_inspect::process;

/// How long a handover waits for the manager (the counter holds the program 30 s at most).
const HANDOVER_ANSWER: std::time::Duration = std::time::Duration::from_secs(25);

/// A place for a load into a running process made for `caller`.
fn load_ticket(caller: &Caller) -> Result<Ticket, Error> {
    let uid = caller.acting_uid("starting a session")?;
    Ticket::take(uid).map_err(Error::ResourceExhausted)
}

/// Where a start's session runs, known once its slot is taken.
#[derive(Clone, Copy)]
struct Place {
    slot: Option<u8>,
    /// The target; None for every process.
    pid: Option<u32>,
    owner_uid: u32,
}

/// What a start's sources are opened for.
struct Plan<'a> {
    id: &'a str,
    asked: &'a Asked,
    place: Place,
    scope: &'a perf::Scope,
}

/// A started session's answer, given once it is recorded (`record`).
pub(super) struct Answer {
    pub(super) info: SessionInfo,
    pub(super) record: String,
    pub(super) reply: Reply<SessionInfo>,
}

/// What a session measures with, opened at its start: its mode's own sources, and the
/// probes any mode may count with.
struct Opened {
    measure: Box<dyn Measurement>,
    sources: Sources,
}

impl Manager {
    /// A start made ready ahead: counting in-process is tried first where it may replace the
    /// probes.
    pub(super) fn begin(
        &mut self,
        req: StartSessionRequest,
        caller: Caller,
        reply: Reply<SessionInfo>,
        ahead: Ahead,
    ) {
        match inproc_candidate(&req, &caller) {
            // Waiting for the process to reach a safe point (up to INPROC_WAIT) must not
            // hold up other requests: the attempt runs on a blocking thread and the start
            // comes back as StartPrepared.
            Some((pid, launched)) => {
                // A launch loads nothing into a running process.
                let ticket = match (!launched).then(|| load_ticket(&caller)).transpose() {
                    Ok(t) => t,
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return;
                    }
                };
                let tx = self.done.clone();
                let id = new_id();
                // Asked again before every request to run code in a process.
                let who = caller.clone();
                let may_trace: tracer_inspect::python::inproc::MayTrace =
                    std::sync::Arc::new(move |p| who.may_load_into(p).map_err(|e| e.to_string()));
                // What becomes of a request left pending goes to the manager after the start
                // itself, on the same channel.
                let (sent, started) = std::sync::mpsc::channel::<()>();
                let (late_tx, session) = (tx.clone(), id.clone());
                let late: tracer_inspect::python::inproc::Late = Box::new(move |outcome| {
                    let _ = started.recv();
                    let _ = late_tx.send(Done::InprocSettled {
                        session,
                        pid,
                        outcome,
                    });
                });
                // A launched 3.10/3.11 program that sets a profile function of its own is
                // handed to the probes by the manager, which answers on `reply`.
                let (handover_tx, session) = (tx.clone(), id.clone());
                let handover: tracer_inspect::python::inproc::Handover =
                    std::sync::Arc::new(move |pid| {
                        let (reply, answer) = std::sync::mpsc::channel();
                        handover_tx
                            .send(Done::InprocHandover {
                                session: session.clone(),
                                pid,
                                reply,
                            })
                            .map_err(|_| "tracerd is stopping".to_owned())?;
                        answer
                            .recv_timeout(HANDOVER_ANSWER)
                            .unwrap_or_else(|_| Err("tracerd did not answer in time".into()))
                    });
                tokio::task::spawn_blocking(move || {
                    use tracer_inspect::python::inproc;
                    let (counter, env) = if launched {
                        match inproc::launch(pid, &id, may_trace, late, handover) {
                            Ok((c, env)) => (Ok(c), env),
                            Err(e) => (Err(e), Vec::new()),
                        }
                    } else {
                        (
                            // A client gone while its process is loaded into ends the load.
                            inproc::start(
                                pid,
                                &id,
                                INPROC_WAIT,
                                may_trace,
                                late,
                                handover,
                                &|| reply.is_closed(),
                            ),
                            Vec::new(),
                        )
                    };
                    drop(ticket);
                    let prepared = Prepared { id, counter, env };
                    let cmd = Done::StartPrepared {
                        req,
                        caller,
                        reply,
                        ahead,
                        prepared,
                    };
                    if let Err(mpsc::error::SendError(Done::StartPrepared {
                        prepared: Prepared { counter: Ok(c), .. },
                        ..
                    })) = tx.send(cmd)
                    {
                        c.finish(&|p| p == pid);
                    }
                    drop(sent);
                });
            }
            None => {
                self.start(req, caller, ahead, &mut None, reply);
            }
        }
    }

    /// `ahead`: what was made ready off this task; `prepared`: the target's in-process counter,
    /// made before (taken when the session uses it).
    pub(super) fn start(
        &mut self,
        req: StartSessionRequest,
        caller: Caller,
        mut ahead: Ahead,
        prepared: &mut Option<Prepared>,
        reply: Reply<SessionInfo>,
    ) {
        let mut attached = ahead.attached.take();
        let python_ahead = ahead.python_ahead;
        let env = prepared.as_ref().map(|p| p.env.clone());
        let started = self
            .start_with(req, caller, ahead, &mut attached, prepared)
            .map(|(mut info, record)| {
                // The counter was taken: the launcher sets its loader's variables.
                if let (Some(env), None) = (env, prepared.as_ref()) {
                    info.launch_env.extend(
                        env.into_iter()
                            .map(|(name, value)| tracer_proto::EnvVar { name, value }),
                    );
                }
                (info, record)
            });
        if let Some(ahead::Attached { slot, mut native }) = attached {
            // Refused before the slot was used: its probes come off, the slot after them.
            self.release_after(Some(slot), vec![native.take_probes()]);
        }
        self.python_start_done(python_ahead, started.is_err());
        match started {
            // What the caller does before its probes are on would be lost to it, and it
            // goes on once answered (`cuda_probed` records it then).
            Ok((info, record)) if self.running.get(&info.id).is_some_and(Session::probing) => {
                let id = info.id.clone();
                let answer = Answer {
                    info,
                    record,
                    reply,
                };
                self.starts.probing.insert(id, answer);
            }
            Ok((info, record)) => self.record(info, record, reply),
            Err(e) => {
                let _ = reply.send(Err(e));
            }
        }
    }

    /// Records a started session as running, so that a daemon killed now leaves it behind as
    /// failed; the start is answered once that is durable (`recorded`). Written in turn with
    /// the store's other writes, off this task: a large report being stored takes hundreds
    /// of ms.
    pub(super) fn record(&mut self, info: SessionInfo, record: String, reply: Reply<SessionInfo>) {
        self.starts.recording += 1;
        let tx = self.done.clone();
        self.writer.then(move |store| {
            let stored = store.put(&info, &record);
            let _ = tx.send(Done::Recorded {
                info,
                stored,
                reply,
            });
        });
    }

    /// A started session's running record is written, or could not be: a session that could
    /// not be recorded does not start. One that has ended already (its target exited within
    /// those milliseconds) ends as it did; its report is stored, or kept in memory, as any.
    pub(super) fn recorded(
        &mut self,
        info: SessionInfo,
        stored: Result<(), StoreError>,
        reply: Reply<SessionInfo>,
    ) {
        self.starts.recording -= 1;
        let answer = match stored {
            Ok(()) => Ok(info),
            Err(e) => {
                if self.running.contains_key(&info.id) {
                    // Nothing of it is kept: its report is neither named nor stored.
                    drop(self.end(&info.id, EndReason::Error, Some(e.to_string())));
                    self.discard(&info.id);
                }
                Err(e.into())
            }
        };
        let _ = reply.send(answer);
    }

    /// `attached`: `--uprobe` probes attached into a slot and not yet the session's (ahead,
    /// or here); every refusal after the slot is taken releases them with it.
    fn start_with(
        &mut self,
        req: StartSessionRequest,
        caller: Caller,
        ahead: Ahead,
        attached: &mut Option<ahead::Attached>,
        prepared: &mut Option<Prepared>,
    ) -> Result<(SessionInfo, String), Error> {
        let asked = checks::asked(req)?;
        if self.running.len() >= MAX_RUNNING {
            return Err(Error::ResourceExhausted(format!(
                "{MAX_RUNNING} sessions are running already"
            )));
        }
        let (scope, pid) = checks::scope(&asked.target, &caller)?;
        let owner_uid = caller.acting_uid("starting a session")?;
        // Checked before anything is taken: loading into the process is ptrace's to allow.
        let in_process = asked.options.gpu_times || asked.options.cuda_in_process;
        // A launched command's: its launcher sets the variables that have CUDA load tracer's
        // library into it.
        let (gpu_times, cuda_env) = match pid.filter(|_| in_process) {
            Some(_) if asked.target.launched => match cuda::launch_env() {
                Ok(env) => (Some(cuda::gpu_times::Start::Launched), env),
                Err(why) => (
                    pid.map(|p| cuda::gpu_times::Start::Probes(p, why)),
                    Vec::new(),
                ),
            },
            Some(pid) => (
                Some(self.gpu_times_start(
                    pid,
                    owner_uid,
                    (&asked.options, asked.mode == Mode::Tracing),
                    &caller,
                )?),
                Vec::new(),
            ),
            None => (None, Vec::new()),
        };

        // A launched target has not exec'd yet: its mappings are tracerctl's.
        let maps_of = pid.filter(|_| !asked.target.launched);
        let Ahead {
            natives,
            cuda_pids,
            python_found,
            ..
        } = ahead;
        let natives = match (attached.is_some(), natives) {
            (true, _) => Vec::new(),
            (false, Some(resolved)) => resolved?,
            (false, None) => resolve_natives(&asked.options.uprobes, maps_of, owner_uid)?,
        };
        self.check_native_limits(&natives, owner_uid)?;

        let slot = if let Some(a) = attached.as_ref() {
            Some(a.slot)
        } else if asked.mode != Mode::Counting
            || pid.is_some()
            || asked.python
            || asked.options.cuda
            || !natives.is_empty()
        {
            Some(self.slots.take(owner_uid, asked.python)?)
        } else {
            None
        };
        if let (Some(pid), Some(slot)) = (pid, slot) {
            if let Err(e) = self.bpf.follow(pid, slot) {
                self.abandon(Some(slot), attached);
                return Err(e.into());
            }
        }
        let loss_base =
            crate::session::scoped_losses(&self.bpf, owner_uid, slot, &self.bpf.losses());
        let id = prepared.as_ref().map_or_else(new_id, |p| p.id.clone());
        let place = Place {
            slot,
            pid,
            owner_uid,
        };
        let plan = Plan {
            id: &id,
            asked: &asked,
            place,
            scope: &scope,
        };
        let opened = self.open_sources(&plan, natives, attached, prepared, python_found, gpu_times);
        let sources = match opened {
            Ok(s) => s,
            Err(e) => {
                self.abandon(slot, attached);
                return Err(e);
            }
        };
        let mut session = self.session(id.clone(), asked, place, sources, loss_base, &caller);
        let (cuda, records_calls) = (
            session.sources.has::<CudaSession>(),
            session.measure.records_calls(),
        );
        let mut info = session.info(&loss_base);
        info.launch_env.extend(
            cuda_env
                .into_iter()
                .map(|(name, value)| tracer_proto::EnvVar { name, value }),
        );
        let record = persist::running_report(&info, session.measure.as_ref());
        let target = session.target;
        self.running.insert(id.clone(), session);
        tracing::info!(id, target = %crate::session::target_label(Some(&target)), uid = owner_uid, by = %caller.describe(), "session started");
        self.update_python_masks();
        if cuda {
            self.update_cuda_masks();
            self.look_for_cuda(true, cuda_pids.as_deref());
        }
        if records_calls {
            self.update_trace_masks();
        }
        if let Some(s) = self.running.get_mut(&id) {
            s.measure.begin();
        }
        Ok((info, record))
    }

    /// Opens what the session measures with, in the order each needs the one before: perf
    /// counters, the target checked alive (it is followed by now), a sampling session,
    /// Python, the native probes (into `attached`, released with the slot on a later
    /// refusal), the mode's type (a tracing session's trace names those probes), and CUDA,
    /// whose GPU metrics go on that trace's tracks. Each source opens in its own folder.
    fn open_sources(
        &mut self,
        plan: &Plan<'_>,
        natives: Vec<NativeTarget>,
        attached: &mut Option<ahead::Attached>,
        prepared: &mut Option<Prepared>,
        python_found: Option<Vec<FoundPython>>,
        gpu_times: Option<cuda::gpu_times::Start>,
    ) -> Result<Opened, Error> {
        let Plan {
            id,
            asked,
            place:
                Place {
                    slot,
                    pid,
                    owner_uid,
                },
            scope,
        } = *plan;
        let options = &asked.options;
        // Sampling sessions count nothing.
        let counting = (asked.mode != Mode::Sampling)
            .then(|| counting::Counting::open(&asked.specs, scope, pid))
            .transpose()?;
        // Followed first, checked after: an exit from here on arrives as an event.
        if let Some(pid) = pid.filter(|&p| !process::alive(p)) {
            return Err(Error::NoSuchProcess { pid });
        }
        let opening = |slot| Opening {
            id,
            slot,
            pid,
            owner_uid,
        };
        let sampling = match (asked.frequency, slot) {
            (Some(hz), Some(slot)) => Some(SamplingSession::open(
                &mut self.bpf,
                &self.sampling,
                &opening(slot),
                hz,
                asked.push.clone(),
                asked.off_cpu,
                asked.tasks,
            )?),
            _ => None,
        };
        // In-process counting replaces the probes only where they would count calls alone.
        let inproc = match (asked.mode, slot) {
            _ if options.python_uprobes_only => {
                Err("--python-uprobes-only asked for uprobes".into())
            }
            (Mode::Counting, Some(slot)) => match prepared.take() {
                Some(p) => p.counter.map(|c| (slot, c)),
                None => Err("not a running process the caller may trace".into()),
            },
            _ => Err("tracing sessions time every call with the probes".into()),
        };
        let python = asked
            .python
            .then(|| {
                self.probing()
                    .open(pid, asked.target.launched, inproc, python_found)
            })
            .transpose()?;
        if let (None, Some(slot)) = (attached.as_ref(), slot.filter(|_| !natives.is_empty())) {
            let attacher = self.bpf.native_attacher();
            let native = NativeSession::attach(&attacher, natives, slot, pid.is_none())?;
            *attached = Some(ahead::Attached { slot, native });
        }
        let measure: Box<dyn Measurement> = match (counting, sampling, asked.trace_limits, slot) {
            (Some(counters), None, None, _) => {
                Box::new(CountingSession::new(counters, options.export_prometheus))
            }
            (None, Some(sampling), None, _) => Box::new(sampling),
            (Some(counters), None, Some(limits), Some(slot)) => {
                let probes = attached
                    .as_ref()
                    .map(|a| a.native.labels())
                    .unwrap_or_default();
                Box::new(TracingSession::open(
                    (&self.tracing, &mut self.bpf),
                    counters,
                    &opening(slot),
                    limits,
                    probes,
                    asked.off_cpu,
                )?)
            }
            // Not met: each mode opens its own (counters for counting and tracing, a sampler
            // for sampling, a trace for tracing) and every mode but counting has a slot.
            _ => {
                return Err(Error::FailedPrecondition(format!(
                    "a {} session's sources do not fit its mode",
                    crate::session::mode_name(asked.mode.into())
                )))
            }
        };
        let cuda = slot.filter(|_| options.cuda).map(|slot| {
            let outputs = (measure.gpu_tracks(), measure.timeline());
            CudaSession::open(
                &mut self.bpf,
                &self.sampling,
                options,
                &opening(slot),
                outputs,
                gpu_times,
            )
        });
        Ok(Opened {
            measure,
            sources: Sources::new([
                python.map(|s| Box::new(s) as Box<dyn Source>),
                attached
                    .take()
                    .map(|a| Box::new(a.native) as Box<dyn Source>),
                cuda.map(|s| Box::new(s) as Box<dyn Source>),
            ]),
        })
    }

    /// The session table's entry for a start whose sources are open.
    fn session(
        &self,
        id: String,
        asked: Asked,
        Place {
            slot,
            pid,
            owner_uid,
        }: Place,
        sources: Opened,
        loss_base: [u64; loss::COUNT as usize],
        caller: &Caller,
    ) -> Session {
        let Opened { measure, sources } = sources;
        let (ended, _) = watch::channel(false);
        let expiry = (asked.duration_ms > 0).then(|| {
            let tx = self.done.clone();
            let id = id.clone();
            let after = Duration::from_millis(asked.duration_ms);
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                let _ = tx.send(Done::Expire { id });
            })
        });
        Session {
            command: pid
                .filter(|_| !asked.target.launched)
                .and_then(process::comm),
            id,
            target: asked.target,
            duration_ms: asked.duration_ms,
            owner_uid,
            started_by: caller.describe(),
            started: Instant::now(),
            started_unix_ms: crate::clock::unix_ms(),
            slot,
            live: pid.into_iter().collect(),
            followed: u32::from(pid.is_some()),
            unfollowed: Vec::new(),
            exited: 0,
            proc_events: 0,
            forks_at_start: pid.is_none().then(process::forks_since_boot).flatten(),
            measure,
            sources,
            loss_base,
            ended,
            expiry,
        }
    }

    /// Refuses `--uprobe` `targets` (one probe per function) beyond the caps: a session's,
    /// and what `uid`'s running sessions hold already.
    pub(super) fn check_native_limits(
        &self,
        targets: &[NativeTarget],
        uid: u32,
    ) -> Result<(), Error> {
        let limits = self.probe_limits;
        if targets.len() > limits.per_session {
            return Err(Error::InvalidArgument(format!(
                "--uprobe names {} functions (duplicates merged); at most {} a session",
                targets.len(),
                limits.per_session
            )));
        }
        let held: usize = self
            .running
            .values()
            .filter(|s| s.owner_uid == uid)
            .flat_map(|s| s.sources.all())
            .map(Source::user_probes)
            .sum::<usize>()
            + self.starts.attaching.get(&uid).copied().unwrap_or(0);
        if !targets.is_empty() && held + targets.len() > limits.per_user {
            return Err(Error::ResourceExhausted(format!(
                "uid {uid} holds {held} native probes in running sessions; {} more would pass the {} a user may hold (stop a session first)",
                targets.len(),
                limits.per_user
            )));
        }
        Ok(())
    }
}
