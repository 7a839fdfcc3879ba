//! How a session ends: its final readings and report, taken on the manager's task, then
//! what waits for naming. Reading the symbol tables and DWARF of large binaries (tracerd's
//! own, libtorch, libcuda) takes seconds: a blocking thread names the sampled stacks and
//! CUDA callers while the manager answers everything else, and the session ends when they
//! are in. Until then `list` and `get` show it running, `report` says it still is, and a
//! `stop` is answered at its end.

use super::*;
use crate::{
    profile::Profile,
    report::{trace, CudaReport, Report},
    session::{cuda::CudaEnd, sampling::Ending},
};

pub(super) struct Closing {
    /// What `list` and `get` show meanwhile.
    pub shown: SessionInfo,
    /// The final state.
    pub info: SessionInfo,
    pub report: Report,
    pub continuous: Option<crate::continuous::Running>,
    pub export_prometheus: bool,
    pub ended: watch::Sender<bool>,
    /// `stop` requests, answered at the end.
    pub stops: Vec<Reply<SessionInfo>>,
}

/// What is left to name.
pub(super) struct Pending {
    pub profile: Option<Ending>,
    pub cuda: Option<CudaEnd>,
}

/// What was named.
pub(super) struct Done {
    profile: Option<Profile>,
    cuda: Option<CudaReport>,
}

impl Pending {
    fn name(self) -> Done {
        Done {
            profile: self.profile.map(Ending::name),
            cuda: self.cuda.map(CudaEnd::finish),
        }
    }
}

impl Manager {
    /// Ends a running session: final readings, report, stored.
    pub(super) fn finish(&mut self, id: &str, reason: EndReason, error: Option<String>) {
        self.end(id, reason, error);
        self.store_report(id);
        self.release_free_memory();
    }

    /// Ends a running session: final readings, and its report, kept in memory until stored.
    pub(super) fn end(&mut self, id: &str, reason: EndReason, error: Option<String>) {
        let Some(mut s) = self.running.remove(id) else {
            return;
        };
        if let Some(task) = s.expiry.take() {
            task.abort();
        }
        let trace_end = self.close_trace(&mut s);
        let losses =
            crate::session::scoped_losses(&self.bpf, s.owner_uid, s.slot, &self.bpf.losses());
        let mut info = s.info(&losses);
        let shown = info.clone();
        // Close the counters before anything else can fail.
        s.counting = None;
        // Stop sampling; what was sampled is named off this task (`close`).
        let mut profile = match (s.sampler.take(), s.slot) {
            (Some(sampler), Some(slot)) => {
                drop(sampler);
                self.sampling.end(slot)
            }
            _ => None,
        };
        // Counts are read now, probes detached later (`release_after`).
        let mut probes = Vec::new();
        let native = match (s.native.take(), s.slot) {
            (Some(mut n), Some(slot)) => {
                probes.push(n.take_probes());
                Some(n.finish(&mut self.bpf, slot))
            }
            _ => None,
        };
        let launch_stacks = s.cuda.as_ref().is_some_and(|c| c.probing.stacks);
        let cuda = s.cuda.take().map(|mut c| {
            probes.push(c.take_probes());
            c.end(&mut self.bpf)
        });
        self.update_cuda_masks();
        if let (true, Some(slot)) = (launch_stacks, s.slot) {
            // The launch stacks recorded so far; later ones find no histogram for the slot.
            profile = self.sampling.end(slot);
        }
        self.release_after(s.slot, probes);
        if s.owner_uid != 0 {
            // Its processes no longer wait at exec.
            self.update_python_masks();
        }
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
        report.native = native;
        if let (Some(t), Some(end_ns)) = (s.trace.take(), trace_end) {
            let py = &self.py;
            let (trace, write_error) = t.finish(end_ns, |pid, code, names| {
                let mapped = memory::runtime_of(pid)?;
                let rt = py.runtime(&mapped.path)?;
                memory::checked_code_names(pid, code, names, rt.version)
            });
            if let Some(e) = write_error {
                report.session.error.get_or_insert(e);
            }
            report.trace = Some(trace);
        }
        if let (Some(py), Some(slot)) = (s.python.take(), s.slot) {
            // Stop counting for this slot before reading it out.
            self.update_python_masks();
            let counts = self.python_counts(slot, true);
            let edges = self.python_edges(slot);
            let mut py = py;
            let inproc: Vec<_> = std::mem::take(&mut py.inproc)
                .into_iter()
                .flat_map(crate::python::inproc::Counter::finish)
                .collect();
            self.bpf.clear_inproc(slot);
            let seen_interpreter = !py.checked.is_empty();
            let (mut functions, unknown_names) = py.functions(counts, edges);
            for c in &inproc {
                if c.namespace_pid {
                    py.warnings.push(format!(
                        "pid {} is a forked child's pid in its own pid namespace: it exited before tracer could tell its pid here",
                        c.pid
                    ));
                }
                if c.lost_calls + c.lost_edges + c.lost_names > 0 {
                    py.warnings.push(format!(
                        "pid {}: the in-process counter's tables were full: {} calls and {} caller pairs not counted, {} functions not named",
                        c.pid, c.lost_calls, c.lost_edges, c.lost_names
                    ));
                }
            }
            functions.extend(crate::session::python::inproc_functions(inproc));
            crate::report::sort_functions(&mut functions, "tottime");
            let inferred_exits = losses[tracer_common::loss::PY_EXIT_INFERRED as usize]
                .saturating_sub(s.loss_base[tracer_common::loss::PY_EXIT_INFERRED as usize]);
            let mut warnings = py.warnings;
            if functions.is_empty() && !seen_interpreter {
                warnings.push(
                    "no probed CPython 3.10-3.15 interpreter was seen running in the followed processes".into(),
                );
            }
            report.python = Some(PythonReport {
                inferred_exits,
                functions,
                unknown_names,
                warnings,
                counted: py.counted,
            });
        }
        // Which container and pod each process ran in (targets of pid sessions included).
        let mut pids = report.pids();
        pids.extend(profile.iter().flat_map(Ending::pids));
        pids.extend(cuda.iter().flat_map(CudaEnd::pids));
        pids.extend(s.live.iter().copied());
        if let Some(target::Kind::Pid(pid)) = s.target.kind {
            pids.push(pid);
        }
        report.processes.containers = crate::container::attribute(pids)
            .into_iter()
            .map(|(pid, origin)| crate::report::ProcessOrigin { pid, origin })
            .collect();
        if self.running.is_empty() {
            crate::container::forget_exited();
        }
        let closing = closing::Closing {
            shown,
            info,
            report,
            continuous: s.continuous.take(),
            export_prometheus: s.export_prometheus,
            ended: s.ended,
            stops: Vec::new(),
        };
        self.close(id, closing, closing::Pending { profile, cuda });
    }

    /// Stops a tracing session's events: probes off, last counter readings, calls still
    /// running written as unfinished, the kernel's last events drained. Returns the end time.
    fn close_trace(&mut self, s: &mut Session) -> Option<u64> {
        let follows_pid = s.follows_pid();
        let (t, slot) = (s.trace.as_mut()?, s.slot?);
        // `s` has left `running`: its bit goes.
        self.update_trace_masks();
        if let Some(c) = s.counting.as_mut().filter(|c| !c.is_empty()) {
            t.read_counters(|| c.read(), true);
        }
        let end_ns = crate::clock::monotonic_ns();
        if s.python.is_some() {
            let threads: Vec<(u32, u32)> = if follows_pid {
                s.live
                    .iter()
                    .flat_map(|&pid| {
                        process::threads(pid)
                            .unwrap_or_default()
                            .into_iter()
                            .map(move |tid| (pid, tid))
                    })
                    .collect()
            } else {
                self.bpf
                    .py_stacks
                    .keys()
                    .filter_map(Result::ok)
                    .filter_map(|tid| Some((process::tgid(tid)?, tid)))
                    .collect()
            };
            let mut events = Vec::new();
            for (pid, tid) in threads {
                if let Ok(stack) = self.bpf.py_stacks.get(&tid, 0) {
                    events.extend(crate::session::trace_session::unfinished(
                        pid, tid, &stack, end_ns,
                    ));
                }
            }
            crate::session::tracing::push_local(&t.spool, &events);
        }
        self.tracing.finish(slot);
        Some(end_ns)
    }

    /// Ends `id` now if nothing is left to name, else once a blocking thread named it
    /// (during shutdown, here: nobody waits for other answers then).
    pub(super) fn close(&mut self, id: &str, closing: Closing, pending: Pending) {
        if self.shutting_down || (pending.profile.is_none() && pending.cuda.is_none()) {
            self.complete(id, closing, pending.name());
            return;
        }
        let (tx, id) = (self.tx.clone(), id.to_owned());
        self.closing.insert(id.clone(), closing);
        tokio::task::spawn_blocking(move || {
            let done = Box::new(pending.name());
            let _ = tx.blocking_send(Command::Named { id, done });
        });
    }

    /// A closing session is named: it ends, and its report is stored.
    pub(super) fn named(&mut self, id: &str, done: Done) {
        if let Some(c) = self.closing.remove(id) {
            self.complete(id, c, done);
            self.store_report(id);
            self.release_free_memory();
        }
    }

    fn complete(&mut self, id: &str, mut c: Closing, done: Done) {
        c.report.profile = done.profile;
        c.report.cuda = done.cuda;
        if let Some(t) = c.report.trace.as_mut() {
            trace_cuda(t, c.report.cuda.as_ref());
        }
        if let Some(cont) = c.continuous.take() {
            cont.finish(c.report.profile.as_ref(), id);
        }
        if c.export_prometheus {
            self.exported.insert(
                id.to_owned(),
                super::metrics::Ended::new(&c.info, &c.report),
            );
        }
        self.unsaved.insert(id.to_owned(), c.report);
        tracing::info!(
            id,
            reason = crate::session::end_reason_name(c.info.end_reason),
            "session ended"
        );
        self.finished.insert(id.to_owned(), c.info.clone());
        let _ = c.ended.send(true);
        for stop in c.stops {
            let _ = stop.send(Ok(c.info.clone()));
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
