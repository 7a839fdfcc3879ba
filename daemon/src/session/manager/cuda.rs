//! The manager's CUDA: what `session::cuda::watch` finds across the sessions, probed off
//! this task (reading libcuda's symbol table and attaching its probes would hold every
//! request meanwhile), and the probes that come back.

use aya::maps::{MapData, RingBuf};

use tracer_proto::EndReason;

use super::{Done, Manager};
use crate::session::{
    cuda::{self, gpu_times, watch, CudaProbed, CudaSession},
    source::Source,
};
use crate::{access::Caller, error::Error};

impl Manager {
    pub(super) fn drain_kernel_names(&mut self, ring: &mut RingBuf<MapData>) {
        let mapped = watch::drain_names(ring, &mut self.running, &self.sampling);
        // Looked at now, before the process gets far (the ring's reader is woken per
        // mapping); the probes go on as soon as a blocking thread has attached them. A
        // process the kernel stopped at its mapping of a CUDA library goes on then.
        for m in mapped {
            if tracer_inspect::cuda::mapped_library(m.pid, m.start, m.len) {
                let followers = self.bpf.followers(m.pid);
                let jobs =
                    watch::look_at(m.pid, followers, "mmap", &mut self.running, &self.sampling);
                self.probe_cuda(jobs);
            }
            if m.held {
                self.cuda_held.push(m.pid);
            }
        }
        self.continue_cuda_held();
        self.cuda_handshakes();
    }

    /// Continues the processes stopped at their mapping of a CUDA library once no CUDA
    /// session has a library's probes on their way: each process's library is probed by
    /// then, whichever session it was for. Called after each mapping drained and each
    /// library's probes come back.
    pub(super) fn continue_cuda_held(&mut self) {
        if self.cuda_held.is_empty()
            || self
                .running
                .values()
                .filter_map(|s| s.sources.get::<CudaSession>())
                .any(Source::probing)
        {
            return;
        }
        for pid in std::mem::take(&mut self.cuda_held) {
            self.continue_held(pid);
        }
    }

    /// Attaches libraries' probes on blocking threads; each comes back as `CudaProbed`.
    fn probe_cuda(&self, jobs: watch::Jobs) {
        for (session, job) in jobs {
            let attacher = self.bpf.cuda_attacher();
            let tx = self.done.clone();
            tokio::task::spawn_blocking(move || {
                let probed = job.run(&attacher);
                // A manager gone (shutdown) drops the probes here, off its task.
                let _ = tx.send(Done::CudaProbed { session, probed });
            });
        }
    }

    /// A library's probes are in: the session's, if it still runs (and its start is answered
    /// once its libraries are probed); else they come off, and the slot it held is let go
    /// once they are (`CudaReleased`).
    pub(super) fn cuda_probed(&mut self, session: &str, probed: CudaProbed) {
        if let Some(c) = self
            .running
            .get_mut(session)
            .and_then(|s| s.sources.get_mut::<CudaSession>())
        {
            let adopted = match c.adopt(probed) {
                Err(why) => {
                    self.gpu_times_refused(session, why);
                    return;
                }
                Ok(adopted) => adopted,
            };
            // Its launch probes skip the process from now on, its library counting them.
            if let Some((pid, slot)) = adopted.mark {
                if let Err(e) = self.bpf.set_cuda_inproc(pid, slot) {
                    self.gpu_times_refused(session, format!("--cuda-in-process: {e}"));
                    return;
                }
            }
            // The launch probes a process goes without where its library counts them,
            // attached after all: the start waits for them.
            self.probe_session_jobs(session, adopted.jobs);
            self.cuda_handshakes();
            self.answer_launched(session);
            // Answered once none of its sources' probes is on its way.
            if !self.running.get(session).is_some_and(|s| s.probing()) {
                if let Some(start) = self.starts.probing.remove(session) {
                    self.record(start.info, start.record, start.reply);
                }
            }
            return;
        }
        if let Some(pid) = probed.turned_on() {
            // Its session ended while they were being turned on: off again.
            gpu_times::turn_off_detached(pid);
        }
        let slot = probed.job.slot;
        if probed.links.is_empty() {
            // Nothing to wait for (`release` would call back on this task).
            self.cuda_released(slot);
            return;
        }
        let tx = self.done.clone();
        tracer_bpf::release(vec![probed.links], move || {
            let _ = tx.send(Done::CudaReleased(slot));
        });
    }

    /// GPU times could not be turned on in a session's process: its start, waiting for its
    /// CUDA libraries, is refused with the reason, and the session goes.
    fn gpu_times_refused(&mut self, session: &str, why: String) {
        let Some(start) = self.starts.probing.remove(session) else {
            // Answered already: the report says why.
            if let Some(c) = self
                .running
                .get_mut(session)
                .and_then(|s| s.sources.get_mut::<CudaSession>())
            {
                c.warn(why);
            }
            return;
        };
        drop(self.end(session, tracer_proto::EndReason::Error, Some(why.clone())));
        self.discard(session);
        let _ = start
            .reply
            .send(Err(crate::error::Error::FailedPrecondition(why)));
    }

    /// Probes that came back after their session ended are off: what they counted goes
    /// once the slot is free, and the slot is let go.
    pub(super) fn cuda_released(&mut self, slot: u8) {
        self.to_drain |= 1 << slot;
        self.let_go(slot);
    }

    /// Probes the CUDA libraries the sessions' processes map (`watch::look`); a scan of
    /// every process, when one is due, runs off this task and comes back as `CudaScanned`.
    pub(super) fn look_for_cuda(&mut self, force: bool, scanned: Option<&[u32]>) {
        let (jobs, scan) = watch::look(force, scanned, &mut self.running, &self.sampling);
        self.probe_cuda(jobs);
        self.cuda_handshakes();
        if scan && !self.scans.cuda {
            self.scans.cuda = true;
            let tx = self.done.clone();
            tokio::task::spawn_blocking(move || {
                let _ = tx.send(Done::CudaScanned(watch::processes()));
            });
        }
    }

    /// Which slots' processes have their executable mappings announced (CUDA sessions).
    pub(super) fn update_cuda_masks(&mut self) {
        let (cuda, all) = watch::masks(&self.running);
        if let Err(e) = self.bpf.set_cuda_sessions(cuda, all) {
            tracing::error!(%e, "updating CUDA session masks");
        }
    }

    /// Whether `id`'s end waits for the GPU times it turned on in its process to go off
    /// (`gpu_times_off` ends it then, as first asked).
    pub(super) fn gpu_times_off_first(
        &mut self,
        id: &str,
        reason: EndReason,
        error: &Option<String>,
    ) -> bool {
        let Some(c) = self
            .running
            .get_mut(id)
            .and_then(|s| s.sources.get_mut::<CudaSession>())
        else {
            return false;
        };
        if c.switching_off() && !self.shutting_down {
            return true;
        }
        let Some(pid) = c.switch_off() else {
            return false;
        };
        if self.shutting_down {
            c.switched_off(pid, gpu_times::turn_off(pid));
            return false;
        }
        let (tx, id, error) = (self.done.clone(), id.to_owned(), error.clone());
        tokio::task::spawn_blocking(move || {
            let status = gpu_times::turn_off(pid);
            let _ = tx.send(Done::GpuTimesOff {
                id,
                pid,
                status,
                reason,
                error,
            });
        });
        true
    }

    /// A session's GPU times are off: it ends as it was asked to.
    pub(super) fn gpu_times_off(
        &mut self,
        id: &str,
        pid: u32,
        status: Result<String, String>,
        reason: EndReason,
        error: Option<String>,
    ) {
        let cuda = self
            .running
            .get_mut(id)
            .and_then(|s| s.sources.get_mut::<CudaSession>());
        if let Some(c) = cuda {
            c.switched_off(pid, status);
            self.finish(id, reason, error);
        }
    }
}

impl Manager {
    /// A start's ask for GPU times or in-process launches in `pid`, checked before anything
    /// is taken (loading into the process is ptrace's to allow). Launches alone that cannot
    /// be counted in-process are counted with the probes (the report says why); GPU times
    /// that cannot be had refuse the start. `events`: a tracing session's, each launch
    /// counted in-process also an event.
    pub(super) fn gpu_times_start(
        &self,
        pid: u32,
        owner_uid: u32,
        (options, events): (&tracer_proto::CountingOptions, bool),
        caller: &Caller,
    ) -> Result<gpu_times::Start, Error> {
        let may = caller.may_load_into(pid);
        if options.gpu_times {
            may?;
        } else if let Err(e) = may {
            return Ok(gpu_times::Start::Probes(pid, e.to_string()));
        }
        let who = caller.clone();
        let may_load: gpu_times::MayLoad =
            std::sync::Arc::new(move |p| who.may_load_into(p).map_err(|e| e.to_string()));
        let checked = gpu_times::check(
            pid,
            owner_uid,
            may_load,
            options.cuda_in_process,
            (options.gpu_times, events),
        );
        match checked {
            Ok(ask) => Ok(gpu_times::Start::Ask(ask)),
            Err(why) if !options.gpu_times => Ok(gpu_times::Start::Probes(pid, why)),
            Err(why) => Err(Error::FailedPrecondition(why)),
        }
    }
}

/// Launched commands' processes waiting in `cuInit` (`session::cuda::launched`).
impl Manager {
    /// Session `id`'s CUDA source, while it runs.
    fn cuda_of(&mut self, id: &str) -> Option<&mut CudaSession> {
        self.running
            .get_mut(id)
            .and_then(|s| s.sources.get_mut::<CudaSession>())
    }

    /// Attaches `jobs`, one session's, off this task.
    fn probe_session_jobs(&self, session: &str, jobs: Vec<cuda::CudaJob>) {
        self.probe_cuda(jobs.into_iter().map(|j| (session.to_owned(), j)).collect());
    }

    /// Starts the handshakes the sessions' libraries asked for, off this task.
    fn cuda_handshakes(&mut self) {
        for (id, s) in &mut self.running {
            let Some(c) = s.sources.get_mut::<CudaSession>() else {
                continue;
            };
            let events = c.traces_launches();
            for pid in c.take_handshakes() {
                let (tx, session) = (self.done.clone(), id.clone());
                tokio::task::spawn_blocking(move || {
                    let (injection, counted) = cuda::handshake(pid, events);
                    let _ = tx.send(Done::CudaHandshake {
                        session,
                        pid,
                        injection,
                        counted,
                    });
                });
            }
        }
    }

    /// A handshake is back: the process is marked and told to count, or the launch probes
    /// it went without are attached, and it is told so once they are in. A session gone
    /// meanwhile: told that nothing counts there.
    pub(super) fn cuda_handshaken(
        &mut self,
        session: &str,
        pid: u32,
        injection: Option<tracer_inspect::cuda::Injection>,
        counted: Result<gpu_times::InProcess, String>,
    ) {
        let Some(c) = self.cuda_of(session) else {
            answer(injection, false, pid);
            return;
        };
        let mut done = c.handshaken(pid, injection, counted);
        if let Some((pid, slot)) = done.adopted.mark {
            // Marked before the answer: the probes skip it from its first launch on.
            match self.bpf.set_cuda_inproc(pid, slot) {
                Ok(()) => answer(done.count.take(), true, pid),
                Err(e) => {
                    if let Some(c) = self.cuda_of(session) {
                        let why = format!("marking it for the probes to skip: {e}");
                        done.adopted = c.not_in_process(pid, why, done.count.take());
                    }
                }
            }
        }
        self.probe_session_jobs(session, done.adopted.jobs);
        self.answer_launched(session);
    }

    /// Tells the libraries waiting for the launch probes of `session` that they are in.
    fn answer_launched(&mut self, session: &str) {
        let Some(c) = self.cuda_of(session) else {
            return;
        };
        for i in c.answers_due() {
            answer(Some(i), false, 0);
        }
    }
}

/// Writes a waiting library's answer (one word in its memory).
fn answer(injection: Option<tracer_inspect::cuda::Injection>, count: bool, pid: u32) {
    if let Some(i) = injection {
        if let Err(e) = i.answer(count) {
            tracing::warn!(pid, %e, "answering a launched process's injection library");
        }
    }
}
