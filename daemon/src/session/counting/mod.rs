//! Counting mode: perf counters read at the end, besides the calls its probes count.

use tracer_proto::{Mode, SessionInfo};

mod counters;

pub use counters::{resolve, Counting};

use super::{Ends, Finished, Measurement};

pub struct CountingSession {
    counters: Counting,
    /// Its counts are shown on the Prometheus endpoint (`--export prometheus`).
    export_prometheus: bool,
}

impl CountingSession {
    pub fn new(counters: Counting, export_prometheus: bool) -> Self {
        Self {
            counters,
            export_prometheus,
        }
    }
}

impl Measurement for CountingSession {
    fn mode(&self) -> Mode {
        Mode::Counting
    }

    fn exports_prometheus(&self) -> bool {
        self.export_prometheus
    }

    fn collect(&mut self, info: &mut SessionInfo) {
        info.counters = self.counters.read();
    }

    /// The counters close here; the final reading is the session's state, read before.
    fn finish(self: Box<Self>, _end: &mut Ends<'_>) -> Finished {
        Finished::default()
    }
}
