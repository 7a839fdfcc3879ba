//! Tracing mode: every call its probes see is an event in the session's trace file, with
//! its perf counters read as counter events on a period.

use std::time::Duration;

use tracer_proto::{Mode, SessionInfo};

mod spool;
mod trace;

pub use spool::{file_name, locked, push_local, Batch, Closer, Limits, Spool, Tracing};
pub use trace::{
    limits, Counters, NameReader, Names, TraceEnd, TraceSession, DEFAULT_BUFFER_MB,
    DEFAULT_COUNTER_INTERVAL_MS, DEFAULT_FILE_MB, MAX_BUFFER_MB,
};

use super::{counting::Counting, Ends, Finished, Measurement, Opening, Threads};
use crate::error::Error;
use tracer_bpf::Bpf;

/// What a live watcher of a tracing session needs: its events, and their names.
pub struct Subscription {
    pub events: tokio::sync::broadcast::Receiver<std::sync::Arc<Batch>>,
    /// Number of the first event the receiver will see.
    pub next_seq: u64,
    pub names: Names,
    pub probes: std::sync::Arc<Vec<String>>,
    pub counters: Vec<tracer_report::trace::TraceCounter>,
}

use tracer_inspect::process;
use tracer_inspect::python::memory;

pub struct TracingSession {
    counters: Counting,
    trace: TraceSession,
    slot: u8,
    /// Its threads' times off the CPU this long or longer are events (`--off-cpu`).
    off_cpu: Option<u64>,
    /// It follows every process.
    all: bool,
    /// When its events stopped (`stop`).
    end_ns: Option<u64>,
}

impl TracingSession {
    /// Starts the trace: its spool in the tracing worker and its file, within `limits`, its
    /// `counters` read every `interval`. `probes`: the `--uprobe` functions' labels.
    /// `off_cpu_min_ns`: its threads' times off the CPU this long or longer are events.
    pub fn open(
        (tracing, bpf): (&Tracing, &mut Bpf),
        counters: Counting,
        at: &Opening<'_>,
        (limits, interval): (Limits, Duration),
        probes: Vec<String>,
        off_cpu_min_ns: Option<u64>,
    ) -> Result<Self, Error> {
        if let Some(min_ns) = off_cpu_min_ns {
            let how = tracer_bpf::OffCpuSession {
                all: at.pid.is_none(),
                min_ns,
                tracing: true,
            };
            bpf.off_cpu_add(at.slot, how)?;
            if let Some(pid) = at.pid {
                // Threads blocked since before the start are away from the start.
                bpf.off_cpu_begin(pid, &process::threads(pid).unwrap_or_default());
            }
        }
        let spool = tracing.add(at.slot, at.id, limits).map_err(|e| {
            bpf.off_cpu_remove(at.slot);
            Error::io("creating the trace file", e)
        })?;
        let mut trace = TraceSession::new(spool, at.id, probes, interval, at.pid.unwrap_or(0));
        trace.off_cpu_min_ns = off_cpu_min_ns.unwrap_or(0);
        Ok(Self {
            counters,
            trace,
            slot: at.slot,
            off_cpu: off_cpu_min_ns,
            all: at.pid.is_none(),
            end_ns: None,
        })
    }
}

/// The session's threads off the CPU at its end (`end_ns`) for `min_ns` or longer, as
/// unfinished `OFF_CPU` events.
fn away_at_end(
    bpf: &Bpf,
    slot: u8,
    all: bool,
    min_ns: u64,
    end_ns: u64,
) -> Vec<tracer_common::TraceEvent> {
    bpf.off_cpu_away()
        .into_iter()
        .filter(|(_, t)| t.pid != 0 && (all || bpf.followers(t.pid) & 1 << slot != 0))
        .filter(|(_, t)| end_ns.saturating_sub(t.since_ns) >= min_ns)
        .map(|(tid, t)| tracer_common::TraceEvent {
            kind: tracer_common::trace_kind::OFF_CPU,
            flags: t.flags as u16 | tracer_common::TRACE_UNFINISHED,
            pid: t.pid,
            tid,
            start_ns: t.since_ns,
            end_ns,
            a: t.syscall as u64,
            b: t.fd_kind,
            ..Default::default()
        })
        .collect()
}

impl Measurement for TracingSession {
    fn mode(&self) -> Mode {
        Mode::Tracing
    }

    fn records_calls(&self) -> bool {
        true
    }

    /// Calls that started before this are not the session's own; the counters' first
    /// reading.
    fn begin(&mut self) {
        self.trace.start_ns = crate::clock::monotonic_ns();
        self.tick(true);
    }

    fn running_record(&self, report: &mut tracer_report::Report) {
        let t = &self.trace;
        report.trace = Some(tracer_report::trace::Trace {
            file: t.file.clone(),
            start_ns: t.start_ns,
            end_ns: t.start_ns,
            start_unix_ns: t.start_unix_ns,
            probes: t.probes.to_vec(),
            ..Default::default()
        });
    }

    fn gpu_tracks(&self) -> Option<Box<dyn crate::gpu::Tracks>> {
        Some(self.trace.gpu_tracks())
    }

    fn timeline(&self) -> Option<std::sync::Arc<dyn super::Timeline>> {
        Some(self.trace.timeline())
    }

    fn named(&self, (pid, code, names): (u32, u64, u64), (q, f, line): (&str, &str, i32)) {
        let function = tracer_report::trace::TraceFunction {
            pid,
            code,
            names,
            qualname: q.to_owned(),
            filename: f.to_owned(),
            firstlineno: line,
        };
        self.trace
            .names
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((pid, code, names), function);
    }

    fn subscribe(&self) -> Option<Subscription> {
        let t = &self.trace;
        let (events, next_seq) = locked(&t.spool).subscribe();
        Some(Subscription {
            events,
            next_seq,
            names: t.names.clone(),
            probes: t.probes.clone(),
            counters: t.counters.snapshot(),
        })
    }

    /// The counters' readings, once their period has come.
    fn tick(&mut self, force: bool) {
        if !self.counters.is_empty() {
            let c = &mut self.counters;
            self.trace.read_counters(|| c.read(), force);
        }
    }

    fn collect(&mut self, info: &mut SessionInfo) {
        info.counters = self.counters.read();
        (info.trace_events, info.trace_bytes) = self.trace.progress();
        info.losses.extend(self.trace.losses());
    }

    /// Its probes are off the slot already (the tracing mask): the last counter readings,
    /// and calls still running written as unfinished. The kernel's last events are drained
    /// later (`TraceEnd`).
    fn stop(&mut self, end: &mut Ends<'_>, threads: Threads<'_>) {
        self.tick(true);
        let end_ns = crate::clock::monotonic_ns();
        if let Some(min_ns) = self.off_cpu {
            // Times away still running: drawn to the end, as calls still running are.
            let events = away_at_end(end.bpf, self.slot, self.all, min_ns, end_ns);
            push_local(&self.trace.spool, &events);
            end.bpf.off_cpu_remove(self.slot);
        }
        self.end_ns = Some(end_ns);
        let threads: Vec<(u32, u32)> = match threads {
            Threads::None => return,
            Threads::Of(pids) => pids
                .iter()
                .flat_map(|&pid| {
                    process::threads(pid)
                        .unwrap_or_default()
                        .into_iter()
                        .map(move |tid| (pid, tid))
                })
                .collect(),
            Threads::InPython => end
                .bpf
                .py_stacks
                .keys()
                .filter_map(Result::ok)
                .filter_map(|tid| Some((process::tgid(tid)?, tid)))
                .collect(),
        };
        let mut events = Vec::new();
        for (pid, tid) in threads {
            if let Ok(stack) = end.bpf.py_stacks.get(&tid, 0) {
                events.extend(trace::unfinished(pid, tid, &stack, end_ns));
            }
        }
        push_local(&self.trace.spool, &events);
    }

    /// The trace is closed and its table of functions made off the manager's task; the
    /// slot stays taken until then.
    fn finish(self: Box<Self>, end: &mut Ends<'_>) -> Finished {
        let Self {
            trace,
            slot,
            end_ns,
            ..
        } = *self;
        let versions = end.py.versions();
        let trace = TraceEnd {
            session: trace,
            end_ns: end_ns.unwrap_or_else(crate::clock::monotonic_ns),
            closer: end.tracing.closer(slot),
            hold: end.hold(slot),
            name: Box::new(move |pid, code, names| {
                let mapped = memory::runtime_of(pid)?;
                memory::checked_code_names(pid, code, names, versions.of(&mapped.path)?)
            }),
        };
        Finished {
            trace: Some(trace),
            ..Finished::default()
        }
    }
}
