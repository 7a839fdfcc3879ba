//! How a session ends: its final readings, taken on the manager's task, then what takes
//! time, on a blocking thread: naming what was counted and sampled (reading the symbol
//! tables and DWARF of large binaries, tracerd's own, libtorch, libcuda, takes seconds;
//! 20,000 Python functions, tens of ms), and writing the report to the store. The manager
//! answers everything else meanwhile, and the session ends when its report is stored.
//! Until then `list` and `get` show it running, `report` says it still is, and a `stop` is
//! answered at its end.

use super::*;
use crate::{
    session::{
        source::{Ending, Source},
        tracing::TraceEnd,
        Finished, ReportPart, Threads,
    },
    store::{writer::Writer, StoreError},
};
use tracer_report::{trace, CudaReport, Report};

pub(super) struct Closing {
    /// What `list` and `get` show meanwhile.
    pub shown: SessionInfo,
    pub ended: watch::Sender<bool>,
    /// `stop` requests, answered at the end.
    pub stops: Vec<Reply<SessionInfo>>,
}

/// The report, what is left to name in it, and where else it goes.
pub(super) struct Pending {
    /// The final state, but for what `trace` adds.
    pub info: SessionInfo,
    pub report: Report,
    /// What each source left to name.
    pub parts: Vec<Box<dyn ReportPart>>,
    /// A trace still to close.
    pub trace: Option<TraceEnd>,
    /// Pushes the last window of the profile.
    pub continuous: Option<crate::continuous::Running>,
    /// Shown on the Prometheus endpoint.
    pub export_prometheus: bool,
    /// Processes the session followed, besides those its report names: with those, the
    /// processes whose container and pod the report says.
    pub pids: Vec<u32>,
}

/// What the manager keeps of an ended session's report.
pub(super) struct Settled {
    /// The final state.
    info: SessionInfo,
    /// The report, if the store did not take it.
    unsaved: Option<(Report, StoreError)>,
    exported: Option<super::metrics::Ended>,
}

impl Pending {
    /// Names what is left, and stores the report with the session's final state (a large
    /// report is freed here too).
    fn settle(self, id: &str, writer: &Writer) -> Settled {
        let (mut report, mut info) = (self.report, self.info);
        for part in self.parts {
            part.fill(&mut report);
        }
        if let Some(t) = self.trace {
            t.fill(&mut report, &mut info);
        }
        let pids = report.pids().into_iter().chain(self.pids);
        report.processes.containers = crate::container::attribute(pids);
        if let Some(t) = report.trace.as_mut() {
            trace_cuda(t, report.cuda.as_ref());
        }
        if let Some(cont) = self.continuous {
            cont.finish(report.profile.as_ref(), id);
        }
        let exported = self
            .export_prometheus
            .then(|| super::metrics::Ended::new(&info, &report));
        let (json, record) = (report.to_json(), info.clone());
        // After the session's running record, which was asked for first.
        let stored = writer
            .wait(move |store| store.put(&record, &json))
            .unwrap_or_else(|| Err(StoreError::Panicked));
        Settled {
            info,
            unsaved: stored.err().map(|e| (report, e)),
            exported,
        }
    }
}

impl Manager {
    /// Ends a running session: final readings here, the report named and stored off this
    /// task (`close`).
    pub(super) fn finish(&mut self, id: &str, reason: EndReason, error: Option<String>) {
        // GPU times the session turned on in its process go off first, while it still
        // counts: CUPTI hands its last records over then.
        if self.gpu_times_off_first(id, reason, &error) {
            return;
        }
        if let Some((closing, pending)) = self.end(id, reason, error) {
            self.close(id, closing, pending);
        }
    }

    /// Ends a running session: final readings, and what is left to make its report. Its
    /// mode stops and finishes first; then the probes it counted with, which every mode
    /// ends the same way.
    pub(super) fn end(
        &mut self,
        id: &str,
        reason: EndReason,
        error: Option<String>,
    ) -> Option<(Closing, Pending)> {
        let mut s = self.running.remove(id)?;
        if let Some(a) = self.starts.probing.remove(id) {
            // Recorded running before it is recorded ended: the store's writes keep order.
            self.record(a.info, a.record, a.reply);
        }
        if let Some(task) = s.expiry.take() {
            task.abort();
        }
        if s.measure.records_calls() {
            // `s` has left `running`: its bit goes.
            self.update_trace_masks();
        }
        let python = s.sources.all().any(Source::counts_python_calls);
        let threads = match (python, s.follows_pid()) {
            (false, _) => Threads::None,
            (true, true) => Threads::Of(&s.live),
            (true, false) => Threads::InPython,
        };
        s.measure.stop(&mut self.ends(), threads);
        let losses =
            crate::session::scoped_losses(&self.bpf, s.owner_uid, s.slot, &self.bpf.losses());
        let mut info = s.info(&losses);
        let shown = info.clone();
        let export_prometheus = s.measure.exports_prometheus();
        let held_at_exec = s.waits_at_exec();
        // Counters close, sampling stops, a trace is left to close; what they measured is
        // named off this task (`close`).
        let Finished {
            profile,
            trace,
            continuous,
        } = s.measure.finish(&mut self.ends());
        // Each source stops counting for the slot, then its counts are read off this task
        // from the maps opened again, the slot held until then; probes detached later
        // (`release_after`). `s` has left `running`: its bits go from the masks first.
        self.update_cuda_masks();
        if held_at_exec {
            // Its processes no longer wait at exec either.
            self.update_python_masks();
        }
        let exits = tracer_common::loss::PY_EXIT_INFERRED as usize;
        let mut probes = Vec::new();
        let mut parts: Vec<Box<dyn ReportPart>> = profile.into_iter().collect();
        if let Some(slot) = s.slot {
            let mut ends = self.ends();
            let mut at = Ending {
                ends: &mut ends,
                slot,
                live: &s.live,
                inferred_exits: losses[exits].saturating_sub(s.loss_base[exits]),
            };
            for source in s.sources.take() {
                let ended = source.end(&mut at);
                probes.extend(ended.probes);
                parts.extend(ended.part);
            }
        }
        self.release_after(s.slot, probes);
        info.state = if error.is_some() {
            SessionState::Failed
        } else {
            SessionState::Finished
        }
        .into();
        info.end_reason = reason.into();
        info.error = error.unwrap_or_default();
        let mut report = build_report(&info, s.followed, s.command.take());
        report.processes.unfollowed = std::mem::take(&mut s.unfollowed);
        report.processes.forked = s
            .forks_at_start
            .zip(process::forks_since_boot())
            .map(|(start, now)| now.saturating_sub(start));
        // Targets of pid sessions too: which container and pod each ran in.
        let mut pids: Vec<u32> = s.live.iter().copied().collect();
        if let Some(target::Kind::Pid(pid)) = s.target.kind {
            pids.push(pid);
        }
        let closing = Closing {
            shown,
            ended: s.ended,
            stops: Vec::new(),
        };
        let pending = Pending {
            info,
            report,
            parts,
            trace,
            continuous,
            export_prometheus,
            pids,
        };
        Some((closing, pending))
    }

    /// Names and stores `id`'s report on a blocking thread, and ends it when that is done
    /// (during shutdown, here: nobody waits for other answers then).
    pub(super) fn close(&mut self, id: &str, closing: Closing, pending: Pending) {
        if self.shutting_down {
            let done = pending.settle(id, &self.writer);
            self.complete(id, closing, done);
            return;
        }
        let (tx, id, writer) = (self.done.clone(), id.to_owned(), self.writer.clone());
        let mut closing = closing;
        closing
            .stops
            .extend(self.ending.stops.remove(&id).unwrap_or_default());
        self.ending.closing.insert(id.clone(), closing);
        tokio::task::spawn_blocking(move || {
            let done = Box::new(pending.settle(&id, &writer));
            let _ = tx.send(Done::Named { id, done });
        });
    }

    /// A closing session's report is named and stored: it ends.
    pub(super) fn named(&mut self, id: &str, done: Settled) {
        if let Some(c) = self.ending.closing.remove(id) {
            self.complete(id, c, done);
            self.release_free_memory();
        }
    }

    fn complete(&mut self, id: &str, c: Closing, done: Settled) {
        if let Some(exported) = done.exported {
            self.exported.insert(id.to_owned(), exported);
        }
        if let Some((report, e)) = done.unsaved {
            tracing::error!(%e, id, "could not store the report; it is kept in memory and stored once the state database takes writes again");
            self.ending
                .unsaved
                .insert(id.to_owned(), std::sync::Arc::new(report));
        }
        tracing::info!(
            id,
            reason = crate::session::end_reason_name(done.info.end_reason),
            "session ended"
        );
        self.finished.insert(id.to_owned(), done.info.clone());
        if self.running.is_empty() {
            // Named in the report now: what is noted of processes gone can go.
            crate::container::forget_exited();
        }
        let _ = c.ended.send(true);
        for stop in c.stops {
            let _ = stop.send(Ok(done.info.clone()));
        }
    }
}

/// Launch events carry their row: the trace keeps the rows to name and describe them, and
/// CUPTI's kernel names.
fn trace_cuda(t: &mut trace::Trace, cuda: Option<&CudaReport>) {
    let mut launches: Vec<trace::TraceLaunch> = cuda
        .iter()
        .flat_map(|c| &c.launches)
        .map(|l| trace::TraceLaunch {
            row: l.row_id,
            launch: l.clone(),
        })
        .collect();
    launches.sort_unstable_by_key(|l| (l.launch.pid, l.row));
    let mut gpu_kernel_names: Vec<trace::TraceGpuKernel> = cuda
        .iter()
        .flat_map(|c| &c.gpu_kernels)
        .map(|k| trace::TraceGpuKernel {
            pid: k.pid,
            name: k.name_ptr,
            kernel: k.kernel.clone(),
        })
        .collect();
    gpu_kernel_names.sort_unstable_by_key(|k| (k.pid, k.name));
    gpu_kernel_names.dedup_by_key(|k| (k.pid, k.name));
    t.launches = launches;
    t.gpu_kernel_names = gpu_kernel_names;
}
