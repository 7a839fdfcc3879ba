//! One tracing session's state beside its spool: when it started on the events' clock, the
//! names its events need, its perf counter readings, and how its trace is closed.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tracer_common::{trace_kind, TraceEvent, PY_STACK_DEPTH, TRACE_UNFINISHED};
use tracer_proto::{counter, Counter, Loss, SessionInfo, TracingOptions};

use super::spool::{self as worker, Limits, Spool};
use crate::{clock::monotonic_ns, error::Error};
use tracer_report::trace::{Trace, TraceCounter, TraceFunction, TraceThread};

pub const DEFAULT_BUFFER_MB: u32 = 64;
pub const MAX_BUFFER_MB: u32 = 4096;
pub const DEFAULT_FILE_MB: u32 = 4096;
pub const DEFAULT_COUNTER_INTERVAL_MS: u32 = 100;

/// The causes of a trace's own losses ([`TraceSession::losses`]).
const TRACE_LOSSES: [&str; 3] = [
    "trace_ringbuf_full",
    "trace_file_limit",
    "trace_write_failed",
];

/// Names of the session's Python functions, as the kernel sends them; shared with live watchers.
pub type Names = Arc<Mutex<HashMap<(u32, u64, u64), TraceFunction>>>;

pub struct TraceSession {
    pub spool: Arc<Mutex<Spool>>,
    pub file: String,
    /// CLOCK_MONOTONIC when the probes started tracing for it.
    pub start_ns: u64,
    pub start_unix_ns: u64,
    pub names: Names,
    pub probes: Arc<Vec<String>>,
    /// Counter tracks by the index in COUNTER events: perf counters, GPU metrics.
    pub counters: Counters,
    counter_interval: Duration,
    next_reading: Instant,
    /// The pid counter readings are attributed to (0: the whole machine).
    counter_pid: u32,
    /// Threads' times off the CPU this long or longer are events (`--off-cpu`; 0: none).
    pub off_cpu_min_ns: u64,
}

/// A trace's counter tracks, shared by the perf counter readings and the GPU sampler.
#[derive(Clone, Default)]
pub struct Counters(Arc<Mutex<Vec<TraceCounter>>>);

impl Counters {
    /// The track's index in COUNTER events, registered on first use. `gauge`: readings are
    /// levels, not running totals.
    pub fn index(&self, event: &str, unit: &str, gauge: bool) -> u64 {
        let mut v = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match v.iter().position(|c| c.event == event && c.unit == unit) {
            Some(i) => i as u64,
            None => {
                v.push(TraceCounter {
                    event: event.to_owned(),
                    unit: unit.to_owned(),
                    gauge,
                });
                v.len() as u64 - 1
            }
        }
    }

    pub fn snapshot(&self) -> Vec<TraceCounter> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Checks a request's tracing options: limits, and counter period.
pub fn limits(o: &TracingOptions) -> Result<(Limits, Duration), Error> {
    let buffer_mb = match o.buffer_mb {
        0 => DEFAULT_BUFFER_MB,
        mb if mb > MAX_BUFFER_MB => {
            return Err(Error::InvalidArgument(format!(
                "a trace buffer of {mb} MiB is over the {MAX_BUFFER_MB} MiB allowed"
            )))
        }
        mb => mb,
    };
    let file_mb = match o.max_file_mb {
        0 => DEFAULT_FILE_MB,
        mb => mb,
    };
    let interval = match o.counter_interval_ms {
        0 => DEFAULT_COUNTER_INTERVAL_MS,
        ms => ms,
    };
    Ok((
        Limits {
            buffer_bytes: (buffer_mb as usize) << 20,
            file_bytes: u64::from(file_mb) << 20,
        },
        Duration::from_millis(u64::from(interval)),
    ))
}

impl TraceSession {
    pub fn new(
        spool: Arc<Mutex<Spool>>,
        id: &str,
        probes: Vec<String>,
        counter_interval: Duration,
        counter_pid: u32,
    ) -> Self {
        let start_unix_ns = crate::clock::unix_ns();
        Self {
            spool,
            file: worker::file_name(id),
            start_ns: monotonic_ns(),
            start_unix_ns,
            names: Names::default(),
            probes: Arc::new(probes),
            counters: Counters::default(),
            counter_interval,
            next_reading: Instant::now(),
            counter_pid,
            off_cpu_min_ns: 0,
        }
    }

    /// Where the GPU sampler puts its readings, as counter tracks of this trace.
    pub fn gpu_tracks(&self) -> Box<dyn crate::gpu::Tracks> {
        Box::new(GpuTracks {
            spool: self.spool.clone(),
            counters: self.counters.clone(),
            pid: self.counter_pid,
        })
    }

    /// Where events read in user space join the kernel's.
    pub fn timeline(&self) -> Arc<dyn crate::session::Timeline> {
        Arc::new(SpoolTimeline(self.spool.clone()))
    }

    /// Records the counters' values as COUNTER events, if their period has come (or `now`).
    pub fn read_counters(&mut self, read: impl FnOnce() -> Vec<Counter>, force: bool) {
        if !force && Instant::now() < self.next_reading {
            return;
        }
        self.next_reading = Instant::now() + self.counter_interval;
        let at = monotonic_ns();
        let readings = read();
        let events: Vec<TraceEvent> = readings
            .iter()
            .filter_map(|c| match c.result {
                Some(counter::Result::Value(v)) => Some(TraceEvent {
                    kind: trace_kind::COUNTER,
                    pid: self.counter_pid,
                    start_ns: at,
                    end_ns: at,
                    a: self.counters.index(&c.event, &c.unit, false),
                    b: v,
                    ..TraceEvent::default()
                }),
                _ => None,
            })
            .collect();
        if !events.is_empty() {
            worker::push_local(&self.spool, &events);
        }
    }

    /// The session's trace-specific losses so far.
    pub fn losses(&self) -> Vec<Loss> {
        let sp = worker::locked(&self.spool);
        let [full, limit, failed] = TRACE_LOSSES;
        [
            (full, sp.kernel_drops),
            (limit, sp.over_file_limit),
            (failed, sp.write_failed().0),
        ]
        .into_iter()
        .filter(|&(_, n)| n > 0)
        .map(|(cause, count)| Loss {
            cause: cause.into(),
            count,
        })
        .collect()
    }

    /// (events recorded, bytes they take).
    pub fn progress(&self) -> (u64, u64) {
        let sp = worker::locked(&self.spool);
        (sp.events, sp.bytes())
    }

    /// The report's trace, once the spool is closed. `name`: names of functions the kernel
    /// never named (frames entered before the session), read from live processes.
    pub fn finish(
        self,
        end_ns: u64,
        mut name: impl FnMut(u32, u64, u64) -> Option<(String, String, i32)>,
    ) -> (Trace, Option<String>) {
        let sp = worker::locked(&self.spool);
        // Copied, not taken: watchers still converting the last batches read the same map.
        let known = self.names.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut functions: Vec<TraceFunction> = sp
            .codes
            .iter()
            .map(|&(pid, code, names)| {
                known.get(&(pid, code, names)).cloned().unwrap_or_else(|| {
                    let (qualname, filename, firstlineno) =
                        name(pid, code, names).unwrap_or_else(|| {
                            (
                                format!("[unknown: code object {code:#x}]"),
                                String::new(),
                                0,
                            )
                        });
                    TraceFunction {
                        pid,
                        code,
                        names,
                        qualname,
                        filename,
                        firstlineno,
                    }
                })
            })
            .collect();
        functions.sort_by(|a, b| (a.pid, &a.qualname, a.code).cmp(&(b.pid, &b.qualname, b.code)));
        let mut threads: Vec<TraceThread> = sp.threads.values().cloned().collect();
        threads.sort_by_key(|t| (t.pid, t.tid));
        let mut processes: Vec<TraceThread> = sp
            .processes
            .iter()
            .map(|(&pid, name)| TraceThread {
                pid,
                tid: pid,
                name: name.clone(),
            })
            .collect();
        processes.sort_by_key(|t| t.pid);
        let trace = Trace {
            file: self.file.clone(),
            path: Default::default(),
            start_ns: self.start_ns,
            end_ns,
            start_unix_ns: self.start_unix_ns,
            events: sp.in_file(),
            python_calls: sp.by_kind[usize::from(trace_kind::PY_CALL)],
            native_calls: sp.by_kind[usize::from(trace_kind::NATIVE_CALL)],
            counter_readings: sp.by_kind[usize::from(trace_kind::COUNTER)],
            cuda_events: sp.by_kind[usize::from(trace_kind::CUDA_LAUNCH)]
                + sp.by_kind[usize::from(trace_kind::CUDA_MEMORY)],
            launches: Vec::new(),
            gpu_kernels: sp.by_kind[usize::from(trace_kind::GPU_KERNEL)],
            gpu_kernel_names: Vec::new(),
            off_cpu: sp.by_kind[usize::from(trace_kind::OFF_CPU)],
            off_cpu_min_ns: self.off_cpu_min_ns,
            exits_inferred: sp.exits_inferred,
            unfinished: sp.unfinished,
            functions,
            probes: self.probes.to_vec(),
            counters: self.counters.snapshot(),
            processes,
            threads,
        };
        (trace, sp.write_failed().1)
    }
}

/// What a code object's names are read with at the end: (pid, code, names id) →
/// (qualname, filename, firstlineno).
pub type NameReader = Box<dyn FnMut(u32, u64, u64) -> Option<(String, String, i32)> + Send>;

/// An ended trace, closed and made into the report's on the naming thread: draining the
/// kernel's last events and waiting for the file took ~25 ms for a busy program, copying and
/// sorting many functions' names a quarter of a second.
pub struct TraceEnd {
    pub session: TraceSession,
    pub end_ns: u64,
    /// Names of code objects the kernel never named.
    pub name: NameReader,
    /// Stops the spool; the slot is held until then.
    pub closer: worker::Closer,
    pub hold: super::super::slots::Hold,
}

impl TraceEnd {
    /// The report's trace, and what the session's final state says of it: its last losses
    /// (the kernel's last drops, what went past the file's limit) and its size.
    pub fn fill(self, report: &mut tracer_report::Report, info: &mut SessionInfo) {
        let TraceEnd {
            session,
            end_ns,
            name,
            closer,
            hold,
        } = self;
        closer.close();
        drop(hold);
        info.losses
            .retain(|l| !TRACE_LOSSES.contains(&l.cause.as_str()));
        info.losses.extend(session.losses());
        (info.trace_events, info.trace_bytes) = session.progress();
        // The report's own losses (its parts', such as launches counted in-process whose
        // events were lost) stay beside the session's.
        let parts: Vec<tracer_report::LossEntry> = std::mem::take(&mut report.losses)
            .into_iter()
            .filter(|l| !TRACE_LOSSES.contains(&l.cause.as_str()))
            .filter(|l| !info.losses.iter().any(|i| i.cause == l.cause))
            .collect();
        report.losses = info.losses.iter().map(Into::into).chain(parts).collect();
        let (trace, write_error) = session.finish(end_ns, name);
        if let Some(e) = write_error {
            report.session.error.get_or_insert(e);
        }
        report.trace = Some(trace);
    }
}

/// Calls still on a thread's shadow stack at the end, as events ending at `end_ns`.
pub fn unfinished(
    pid: u32,
    tid: u32,
    stack: &tracer_common::PyStack,
    end_ns: u64,
) -> Vec<TraceEvent> {
    let depth = usize::try_from(stack.depth)
        .unwrap_or(usize::MAX)
        .min(PY_STACK_DEPTH);
    stack.entries[..depth]
        .iter()
        .filter(|e| e.pseudo == 0 && e.start_ns != 0)
        .map(|e| TraceEvent {
            kind: trace_kind::PY_CALL,
            flags: TRACE_UNFINISHED,
            pid,
            tid,
            start_ns: e.start_ns,
            end_ns,
            a: e.code,
            b: e.names,
            ..TraceEvent::default()
        })
        .collect()
}

/// A trace's spool, taking events read in user space beside the kernel's.
struct SpoolTimeline(Arc<std::sync::Mutex<Spool>>);

impl crate::session::Timeline for SpoolTimeline {
    fn push(&self, events: &[TraceEvent]) {
        worker::push_local(&self.0, events);
    }
}

/// A trace's counter tracks for GPU readings: each becomes a COUNTER event.
struct GpuTracks {
    spool: Arc<std::sync::Mutex<Spool>>,
    counters: Counters,
    /// The pid the tracks are shown under (the target, or 0 for the machine).
    pid: u32,
}

impl crate::gpu::Tracks for GpuTracks {
    fn record(&self, device: u32, readings: &[(&'static str, &'static str, u64)]) {
        let at = monotonic_ns();
        let events: Vec<tracer_common::TraceEvent> = readings
            .iter()
            .map(|&(name, unit, value)| tracer_common::TraceEvent {
                kind: tracer_common::trace_kind::COUNTER,
                pid: self.pid,
                start_ns: at,
                end_ns: at,
                a: self
                    .counters
                    .index(&format!("GPU {device} {name}"), unit, true),
                b: value,
                ..Default::default()
            })
            .collect();
        worker::push_local(&self.spool, &events);
    }
}
