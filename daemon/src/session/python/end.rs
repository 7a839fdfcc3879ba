//! A Python session's end: its counts read out of the kernel (off the manager's task where
//! the maps can be opened again), its in-process counters stopped and read, and all of it
//! named into the report's Python part; and its part of a running session's report.

use std::collections::HashSet;

use tracer_common::{PyCallStats, PyEdgeKey};
use tracer_report::{PythonReport, Report};

use super::{counts, edges, inproc_functions, late_start_why, merge_handed, PySession, MAX_GONE};
use crate::session::{
    slots::Hold,
    source::{Ended, Ending, Named, Reading, Source},
    ReportPart,
};

impl Source for PySession {
    /// Its kernel counts are read once the other sources' probes are off.
    fn ends_last(&self) -> bool {
        true
    }

    fn counts_python_calls(&self) -> bool {
        true
    }

    /// A new program's interpreter is probed before it runs (a chroot's or container's,
    /// not known beforehand), so that none of its calls is lost.
    fn holds_at_exec(&self) -> bool {
        true
    }

    fn exited(&mut self, pid: u32) {
        // Its in-process counter's file is read at the end: the pid is kept for that.
        if !self.inproc.is_empty() && self.gone.len() < MAX_GONE {
            self.gone.insert(pid);
        }
    }

    fn interim(&self, at: &mut Reading<'_>) -> Option<Box<dyn ReportPart>> {
        let (mut functions, unknown_names) =
            self.functions(counts(at.bpf, at.slot, false), Vec::new());
        let followed: HashSet<u32> = at.live.iter().chain(&self.gone).copied().collect();
        for c in &self.inproc {
            functions.extend(inproc_functions(&c.peek(followed.clone())).0);
        }
        tracer_report::sort_functions(&mut functions, "tottime");
        let python = PythonReport {
            functions,
            unknown_names,
            warnings: vec![
                "interim: calls still running are not in these times until they return; in-process counts are those read last (about once a second, from the first report asked)".into(),
            ],
            counted: self.counted.clone(),
            ..PythonReport::default()
        };
        Some(Box::new(Named(move |r: &mut Report| {
            r.python = Some(python)
        })))
    }

    fn end(self: Box<Self>, at: &mut Ending<'_, '_>) -> Ended {
        let slot = at.slot;
        // Read off the manager's task (`FinalCounts`): the slot stays taken until then.
        let later = match at.ends.bpf.python_maps() {
            Ok(maps) => Some(FinalCounts::new(maps, at.ends.hold(slot))),
            Err(e) => {
                tracing::warn!(%e, "reading a session's Python counts here instead");
                None
            }
        };
        let (counts, edges) = match later {
            Some(_) => Default::default(),
            None => (counts(at.ends.bpf, slot, true), edges(at.ends.bpf, slot)),
        };
        let mut py = *self;
        // In-process counters are stopped and read with the rest, off this task: their
        // files are their processes' users' to fill.
        let mut followed = std::mem::take(&mut py.gone);
        followed.extend(at.live.iter().copied());
        followed.extend(py.inproc.iter().map(|c| c.pid));
        at.ends.bpf.clear_inproc(slot);
        Ended {
            probes: None,
            part: Some(Box::new(PythonEnd {
                py,
                counts,
                edges,
                later,
                followed,
                inferred_exits: at.inferred_exits,
            })),
        }
    }
}

/// A session's Python counts still in the kernel maps at its end, read and taken out of
/// them off the manager's task (300,000 entries took ~60 ms). Its slot stays held until
/// then; dropped unread, the entries are taken out all the same.
struct FinalCounts {
    maps: Option<tracer_bpf::PythonMaps>,
    /// The slot, taken until they are read.
    hold: Hold,
}

impl FinalCounts {
    pub fn new(maps: tracer_bpf::PythonMaps, hold: Hold) -> Self {
        Self {
            maps: Some(maps),
            hold,
        }
    }

    /// The session's counts (pid, code, names, stats) and caller pairs.
    #[allow(clippy::type_complexity)]
    pub fn take(
        mut self,
    ) -> (
        Vec<(u32, u64, u64, PyCallStats)>,
        Vec<(PyEdgeKey, PyCallStats)>,
    ) {
        let slot = self.hold.slot();
        let (calls, edges) = self
            .maps
            .take()
            .map(|mut m| m.take(slot))
            .unwrap_or_default();
        let calls = calls
            .into_iter()
            .map(|(k, n)| (k.pid, k.code, k.names, n))
            .collect();
        (calls, edges)
    }
}

impl Drop for FinalCounts {
    /// Unread, they are taken out all the same: a later session in the slot would count
    /// them as its own. The slot is let go after (`hold` drops then).
    fn drop(&mut self) {
        if let Some(mut m) = self.maps.take() {
            m.take(self.hold.slot());
        }
    }
}

/// A Python session's counts, read out at its end: named into the report off the manager.
struct PythonEnd {
    pub py: PySession,
    pub counts: Vec<(u32, u64, u64, PyCallStats)>,
    pub edges: Vec<(PyEdgeKey, PyCallStats)>,
    /// The counts and caller pairs, when they are read at `fill` rather than at the end.
    pub later: Option<FinalCounts>,
    /// The processes the session followed, now or before: whose counts files its
    /// in-process counters (`py.inproc`) read at the end.
    pub followed: HashSet<u32>,
    /// Calls whose return the probes inferred rather than saw.
    pub inferred_exits: u64,
}

impl PythonEnd {
    /// The report's Python part: every function named, most time first.
    pub fn report(self) -> PythonReport {
        let Self {
            mut py,
            mut counts,
            mut edges,
            later,
            followed,
            inferred_exits,
        } = self;
        let mut refused = Vec::new();
        // Children forked before the kernel followed the target (its counter started as
        // soon as a safe point came) are its descendants all the same.
        let targets: Vec<u32> = py.inproc.iter().map(|c| c.pid).collect();
        let follows =
            |p| followed.contains(&p) || tracer_inspect::process::descends_from(p, &targets);
        let inproc: Vec<_> = std::mem::take(&mut py.inproc)
            .into_iter()
            .flat_map(|c| {
                // Started late, maybe too late for the manager to hear of it.
                let pending = late_start_why(None);
                if let Some(w) = py
                    .counted
                    .iter_mut()
                    .find(|w| w.pid == c.pid && w.why == pending)
                {
                    if !c.pending() {
                        w.why = late_start_why(Some(c.tool_id()));
                    }
                }
                let f = c.finish(&follows);
                refused.extend(f.refused);
                f.counts
            })
            .collect();
        if let Some(later) = later {
            (counts, edges) = later.take();
        }
        let seen_interpreter = !py.checked.is_empty();
        let (mut functions, unknown_names) = py.functions(counts, edges);
        let mut warnings = py.warnings;
        for c in &inproc {
            let pending = c.state == tracer_common::inproc::state::CANCELLED
                && py
                    .counted
                    .iter()
                    .any(|w| w.pid == c.pid && w.way == "in-process");
            if pending {
                warnings.push(format!(
                    "pid {}: its in-process counter never started (no thread reached a safe point while the session ran, or a launched command never ran a python3.X program of its own), so nothing was counted in it",
                    c.pid
                ));
            }
            if c.state == tracer_common::inproc::state::HANDOVER {
                warnings.push(format!(
                    "pid {}: its program set a profile function of its own, which took the place of tracer's (CPython 3.10, 3.11), and tracer did not take it over with the probes: its calls after that were not counted",
                    c.pid
                ));
            }
            if c.state == tracer_common::inproc::state::GAVE_UP {
                warnings.push(format!(
                    "pid {}: its program set a profile function of its own, which took the place of tracer's (CPython 3.10, 3.11), and tracer did not answer its handover within 30 s: its calls after that were not counted",
                    c.pid
                ));
            }
            if let Some(why) = &c.handover_failed {
                warnings.push(format!(
                    "pid {}: its program set a profile function of its own, which took the place of tracer's (CPython 3.10, 3.11), and its calls after that may not have been counted: {why}",
                    c.pid
                ));
            }
            if c.namespace_pid {
                warnings.push(format!(
                    "pid {} is a forked child's pid in its own pid namespace: it exited before tracer could tell its pid here",
                    c.pid
                ));
            }
            if c.lost_calls + c.lost_edges + c.lost_names > 0 {
                warnings.push(format!(
                    "pid {}: the in-process counter's tables were full: {} calls and {} caller pairs not counted, {} functions not named",
                    c.pid, c.lost_calls, c.lost_edges, c.lost_names
                ));
            }
        }
        warnings.extend(refused);
        let (inproc, unnamed) = inproc_functions(&inproc);
        if unnamed > 0 {
            warnings.push(format!(
                "{unnamed} callers of in-process counted functions are shown by code object: their names were over tracer's budget"
            ));
        }
        functions.extend(inproc);
        merge_handed(&mut functions, &py.handed);
        tracer_report::sort_functions(&mut functions, "tottime");
        if functions.is_empty() && !seen_interpreter {
            warnings.push(
                "no probed CPython 3.10-3.15 interpreter was seen running in the followed processes".into(),
            );
        }
        PythonReport {
            inferred_exits,
            functions,
            unknown_names,
            warnings,
            counted: py.counted,
        }
    }
}

impl ReportPart for PythonEnd {
    fn fill(self: Box<Self>, report: &mut tracer_report::Report) {
        report.python = Some(self.report());
    }
}
