//! Sampling mode: perf events drive the sampling program; the worker keeps the session's
//! histogram, and continuous profiling pushes windows of it.

use std::{os::fd::AsFd, sync::atomic::Ordering, time::Duration};

use tracer_proto::{Mode, SessionInfo};

mod reason;
mod worker;

pub use worker::{Ending, Sampling, Windows};

use super::{Ends, Finished, Measurement, Opening};
use crate::{
    continuous::{Endpoint, Running},
    error::Error,
};
use tracer_bpf::sampler::Sampler;
use tracer_bpf::Bpf;
use tracer_inspect::process;

pub struct SamplingSession {
    sampler: Sampler,
    slot: u8,
    /// Windows pushed to an endpoint (`--push`).
    continuous: Option<Running>,
    /// Wall-clock sessions (`--off-cpu`): the target whose threads' unfinished off-CPU
    /// time is told at the end (None: every process, or no off-CPU time).
    off_cpu: Option<Option<u32>>,
}

impl SamplingSession {
    /// Starts sampling at `hz` on each CPU: the perf events that drive the sampling
    /// program, the session's histogram in the worker, and its pusher if it `push`es.
    pub fn open(
        bpf: &mut Bpf,
        sampling: &Sampling,
        at: &Opening<'_>,
        hz: u64,
        push: Option<(Endpoint, Duration)>,
        off_cpu_min_ns: Option<u64>,
        tasks: bool,
    ) -> Result<Self, Error> {
        let (program, refused) = bpf.sample_program()?;
        let sampler = Sampler::start(program.as_fd(), at.slot, at.pid.is_none(), hz)?;
        sampling.add(
            at.slot,
            hz,
            sampler.event,
            at.pid.map_or_else(process::pids, |p| vec![p]),
            process::kernel_addresses_for(at.owner_uid),
            off_cpu_min_ns,
        );
        match (tasks, refused) {
            (true, Some(why)) => sampling.note(
                at.slot,
                format!("no asyncio task stacks: this kernel refused the program that walks them ({why})"),
            ),
            (true, None) => sampling.show_tasks(at.slot),
            (false, _) => {}
        }
        if let Some(min_ns) = off_cpu_min_ns {
            let how = tracer_bpf::OffCpuSession {
                all: at.pid.is_none(),
                min_ns,
                tracing: false,
            };
            if let Err(e) = bpf.off_cpu_add(at.slot, how) {
                // The histogram goes with the refusal.
                drop(sampling.end(at.slot));
                return Err(e.into());
            }
            if let Some(pid) = at.pid {
                // Threads blocked since before the start count from the start.
                bpf.off_cpu_begin(pid, &process::threads(pid).unwrap_or_default());
            }
        }
        let continuous = push.map(|(endpoint, period)| {
            let (windows, slot) = (sampling.windows(), at.slot);
            Running::start(
                endpoint,
                period,
                std::sync::Arc::new(move || windows.take(slot)),
                at.id.to_owned(),
            )
        });
        Ok(Self {
            sampler,
            slot: at.slot,
            continuous,
            off_cpu: off_cpu_min_ns.map(|_| at.pid),
        })
    }
}

impl Measurement for SamplingSession {
    fn mode(&self) -> Mode {
        Mode::Sampling
    }

    fn interim(&self, sampling: &super::Sampling) -> Option<Box<dyn super::ReportPart>> {
        let part = sampling.windows().peek(self.slot)?;
        Some(Box::new(part))
    }

    fn collect(&mut self, info: &mut SessionInfo) {
        let Some(c) = &self.continuous else {
            return;
        };
        let stats = c.stats();
        info.profiles_pushed = stats.pushed.load(Ordering::Relaxed);
        info.push_failures = stats.failed.load(Ordering::Relaxed);
        info.profiles_dropped = stats.dropped.load(Ordering::Relaxed);
        info.last_push_error = stats
            .last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
    }

    /// Sampling stops; what was sampled is named off the manager's task.
    fn finish(self: Box<Self>, end: &mut Ends<'_>) -> Finished {
        let Self {
            sampler,
            slot,
            continuous,
            off_cpu,
        } = *self;
        if let Some(target) = off_cpu {
            if let Some(pid) = target {
                let tids = process::threads(pid).unwrap_or_default();
                end.sampling
                    .off_cpu_unfinished(slot, &end.bpf.off_cpu_unfinished(&tids));
            }
            end.bpf.off_cpu_remove(slot);
        }
        // The histogram ends once its perf events are closed.
        drop(sampler);
        Finished {
            profile: end
                .sampling
                .end(slot)
                .map(|p| Box::new(p) as Box<dyn crate::session::ReportPart>),
            trace: None,
            continuous,
        }
    }
}
