//! A tracing session's launches counted in-process: the events tracer's injection library
//! writes in its table's ring (`tracer_common::launches::Event`), drained into the trace by
//! a thread of their own as the launch probes' events are made — the same kind, entry point,
//! handle and row — so that a timeline does not tell the two ways apart. (Launches from
//! threads without Python, which the library hands to its probe point, get their event from
//! that probe.) A thread, not the manager's task: a launch-bound program fills the ring at
//! millions of events a second, which must be read every millisecond or so.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::Duration,
};

use tracer_common::{trace_kind, TraceEvent};
use tracer_inspect::cuda::{EventCursor, LaunchTable};

use super::super::Timeline;

/// How often the ring is read while launches come: it holds `launches::EVENTS` events, 26 ms
/// of ten million a second (the fake libraries' launch rate; a real GPU's is a tenth of it at
/// most).
const DRAIN_EVERY: Duration = Duration::from_millis(1);
/// How long a read waits at most once the ring was found empty (doubling from
/// `DRAIN_EVERY`): a process between launches costs a wakeup every 8 ms, and a burst that
/// starts meanwhile fills a third of the ring at most before it is read.
const IDLE_EVERY: Duration = Duration::from_millis(8);

/// The thread that moves one table's events into the trace, until told to stop.
pub(super) struct Drainer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<u64>>,
}

impl Drainer {
    /// Drains `pid`'s `table` from `from` into `timeline`.
    pub(super) fn start(
        pid: u32,
        table: Arc<LaunchTable>,
        from: EventCursor,
        timeline: Arc<dyn Timeline>,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let told = stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("launches-{pid}"))
            .spawn(move || {
                let mut ring = Ring {
                    pid,
                    table,
                    at: from,
                    rows: HashMap::new(),
                };
                let mut wait = DRAIN_EVERY;
                loop {
                    let last = told.load(Ordering::Acquire);
                    let events = ring.read(last);
                    wait = if events.is_empty() {
                        (wait * 2).min(IDLE_EVERY)
                    } else {
                        timeline.push(&events);
                        DRAIN_EVERY
                    };
                    if last {
                        return ring.at.lost;
                    }
                    std::thread::sleep(wait);
                }
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops the thread after a last read of everything published: the events lost.
    pub(super) fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Release);
        self.thread.take().and_then(|t| t.join().ok()).unwrap_or(0)
    }
}

impl Drop for Drainer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

struct Ring {
    pid: u32,
    table: Arc<LaunchTable>,
    at: EventCursor,
    /// Entry → (entry point, handle, row id), read once per row.
    rows: HashMap<u32, (u32, u64, u64)>,
}

impl Ring {
    /// The events published since the last read, as the trace keeps them (all of them, an
    /// unpublished place counted lost: `last`).
    fn read(&mut self, last: bool) -> Vec<TraceEvent> {
        let read = self.table.events(&mut self.at, last);
        let mut out = Vec::with_capacity(read.len());
        for e in read {
            let row = match self.rows.get(&e.entry) {
                Some(&row) => Some(row),
                None => self.table.key_at(e.entry).map(|mut key| {
                    key.pid = self.pid;
                    let row = (key.api, key.func, key.row_id());
                    self.rows.insert(e.entry, row);
                    row
                }),
            };
            let Some((api, func, row_id)) = row else {
                self.at.lost += 1;
                continue;
            };
            out.push(TraceEvent {
                kind: trace_kind::CUDA_LAUNCH,
                flags: api as u16,
                cpu: e.cpu,
                pid: self.pid,
                tid: e.tid,
                start_ns: e.start_ns,
                end_ns: e.start_ns,
                a: func,
                b: row_id,
                ..TraceEvent::default()
            });
        }
        out
    }
}
