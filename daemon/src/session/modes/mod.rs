//! One session type per mode behind one interface, [`Measurement`]: what a counting,
//! sampling or tracing session measures with of its own (perf counters, the sampler, the
//! trace), how each opens (`open`, `new`), what it says while it runs, and how it ends into
//! its part of the report.
//!
//! The probes any mode may count with (Python, `--uprobe` functions, CUDA launches) are the
//! session's, not the mode's: counting and tracing share them, so they stay on the session
//! and end the same way whatever the mode.

mod counting;
mod sampling;
mod tracing;

pub use counting::CountingSession;
pub use sampling::SamplingSession;
pub use tracing::TracingSession;

use std::collections::BTreeSet;

use tracer_proto::{Mode, SessionInfo};

use super::{
    python::Probes,
    sampling::Sampling,
    slots::{Hold, Slots},
    trace_session::{TraceEnd, TraceSession},
    tracing::Tracing,
    ReportPart,
};
use tracer_bpf::bpf::Bpf;

/// A mode's own sources, from a session's start to its report.
pub trait Measurement: Send {
    fn mode(&self) -> Mode;

    /// Its trace, for tracing sessions.
    fn trace(&self) -> Option<&TraceSession> {
        None
    }

    fn trace_mut(&mut self) -> Option<&mut TraceSession> {
        None
    }

    /// Whether its counts are shown on the Prometheus endpoint while it runs.
    fn exports_prometheus(&self) -> bool {
        false
    }

    /// Readings due on the manager's timer (all of them: `force`).
    fn tick(&mut self, _force: bool) {}

    /// What it has measured so far, and its own losses, into `info`.
    fn collect(&mut self, info: &mut SessionInfo);

    /// Stops measuring at the session's end, before its final state is read: `threads` are
    /// those whose Python calls may still be running.
    fn stop(&mut self, _end: &mut Ends<'_>, _threads: Threads<'_>) {}

    /// Its last readings, and what it leaves to name off the manager's task.
    fn finish(self: Box<Self>, end: &mut Ends<'_>) -> Finished;
}

/// Where a mode opens its sources: the session, its slot, its target (None: every process)
/// and its owner.
pub struct Opening<'a> {
    pub id: &'a str,
    pub slot: u8,
    pub pid: Option<u32>,
    pub owner_uid: u32,
}

/// What an ended mode leaves for its report.
#[derive(Default)]
pub struct Finished {
    /// Its profile, named later.
    pub profile: Option<Box<dyn ReportPart>>,
    /// A trace still to close.
    pub trace: Option<TraceEnd>,
    /// Pushes the last window of the profile.
    pub continuous: Option<crate::continuous::Running>,
}

/// Threads whose Python calls may still run at a session's end.
pub enum Threads<'a> {
    /// The session counts no Python calls.
    None,
    /// Every thread of these processes.
    Of(&'a BTreeSet<u32>),
    /// Every thread the probes saw in a Python frame (system-wide sessions).
    InPython,
}

/// What a mode's end uses of the manager's kernel side, borrowed for that end.
pub struct Ends<'a> {
    pub bpf: &'a mut Bpf,
    pub sampling: &'a Sampling,
    pub tracing: &'a Tracing,
    pub py: &'a Probes,
    pub slots: &'a mut Slots,
    /// Where a [`Hold`] says it let go.
    pub counts_read: &'a tokio::sync::mpsc::UnboundedSender<u8>,
}

impl Ends<'_> {
    /// Keeps `slot` taken until the hold is dropped.
    pub fn hold(&mut self, slot: u8) -> Hold {
        self.slots.hold(slot);
        Hold::new(slot, self.counts_read.clone())
    }
}
