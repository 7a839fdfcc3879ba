//! What a session does with the probes any mode may count with (Python calls, `--uprobe`
//! functions, CUDA launches), whatever their kind. Each kind is a folder of its own
//! (`python/`, `native/`, `cuda/`) whose session-side type is a [`Source`]: the session
//! tells it of the processes it follows, asks it for its part of a report so far, and ends
//! it, the same way for every kind. What only one kind does (handing a process counted
//! in-process to the probes, probing a CUDA library a process maps) stays that type's own.

use std::collections::BTreeSet;

use tracer_bpf::{Bpf, ProbeSet};

use super::{Ends, ReportPart};

/// One kind of probe a session counts with, from the session's start to its report.
pub trait Source: Send {
    /// A followed process exec'd: stopped at its exec (EXEC_HOLD), its new program not run.
    fn exec(&mut self, _pid: u32) {}

    /// A followed process is gone.
    fn exited(&mut self, _pid: u32) {}

    /// Whether the processes the session follows stop at each exec for it (EXEC_HOLD), so
    /// that it looks at the new program before that runs an instruction.
    fn holds_at_exec(&self) -> bool {
        false
    }

    /// Whether it names what it counts with what the sampler read of the processes (which
    /// must then hear of their exits).
    fn uses_sampler(&self) -> bool {
        false
    }

    /// Its part of a running session's report so far, read without taking anything out of
    /// the kernel's maps.
    fn interim(&self, _at: &mut Reading<'_>) -> Option<Box<dyn ReportPart>> {
        None
    }

    /// The session ended: its last readings (or the maps to read them from off the
    /// manager's task, the slot held until then), and its probes to detach.
    fn end(self: Box<Self>, at: &mut Ending<'_, '_>) -> Ended;
}

/// What a running session's source reads its interim part with.
pub struct Reading<'a> {
    pub bpf: &'a mut Bpf,
    pub slot: u8,
    /// The processes the session follows now.
    pub live: &'a BTreeSet<u32>,
}

/// What an ended session's source ends with.
pub struct Ending<'a, 'b> {
    pub ends: &'a mut Ends<'b>,
    pub slot: u8,
    /// The processes the session followed until its end.
    pub live: &'a BTreeSet<u32>,
    /// Calls whose return the probes inferred rather than saw while the session ran.
    pub inferred_exits: u64,
}

/// A part named already (a report so far), set into the report as it is.
pub struct Named<F>(pub F);

impl<F: FnOnce(&mut tracer_report::Report) + Send> ReportPart for Named<F> {
    fn fill(self: Box<Self>, report: &mut tracer_report::Report) {
        (self.0)(report);
    }
}

/// What an ended source leaves.
#[derive(Default)]
pub struct Ended {
    /// Its probes, detached off the manager's task.
    pub probes: Option<ProbeSet>,
    /// What it counted, named off the manager's task.
    pub part: Option<Box<dyn ReportPart>>,
}
