//! Tracing sessions' data path. A worker thread drains the `TRACE_EVENTS` ring buffer (the
//! kernel wakes it once a quarter MiB waits; otherwise it looks every few milliseconds) and
//! hands each session its events ([`Spool`]): kept in memory up to the session's buffer
//! size, then appended to its trace file; live watchers get them in batches through a
//! broadcast channel that never waits for them.

use std::{
    collections::{HashMap, HashSet},
    fs::File,
    io::Write,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, MutexGuard,
    },
    thread,
    time::Duration,
};

use tokio::sync::broadcast;
use tracer_common::{trace_kind, TraceEvent, TRACE_EXIT_INFERRED, TRACE_UNFINISHED};

use tracer_report::trace::{as_bytes, TraceThread, RECORD};

/// How long the worker waits for a wakeup before it drains anyway.
const DRAIN_EVERY: Duration = Duration::from_millis(10);
/// Events per live batch: a watcher that falls behind misses whole batches.
const BATCH: usize = 4096;
/// Batches a watcher may fall behind (at most 64 × 4096 events, 15 MiB held) before it
/// misses some.
const WATCH_BACKLOG: usize = 64;

use super::super::ring::{lock, RingWorker};
use tracer_bpf::TracingMaps;

/// Limits of one session's storage.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub buffer_bytes: usize,
    pub file_bytes: u64,
}

/// A batch of one session's events for live watchers; `first_seq` numbers its first event
/// (the session's events are numbered from 0), so a watcher counts what it missed.
pub struct Batch {
    pub first_seq: u64,
    pub events: Vec<TraceEvent>,
}

/// One session's events: in memory, then in its trace file.
pub struct Spool {
    buf: Vec<TraceEvent>,
    limits: Limits,
    /// Events per chunk handed to the writer.
    chunk: usize,
    /// Bytes handed to the writer so far.
    queued: u64,
    writer: Writer,
    /// Events recorded (in memory or in the file).
    pub events: u64,
    pub by_kind: [u64; trace_kind::COUNT],
    pub exits_inferred: u64,
    pub unfinished: u64,
    /// Events past the file size limit, dropped.
    pub over_file_limit: u64,
    /// Events the kernel dropped for this session (ring buffer full).
    pub kernel_drops: u64,
    drops_base: u64,
    seq: u64,
    live: broadcast::Sender<Arc<Batch>>,
    /// (pid, code, names) of the Python functions seen, to be named at the end.
    pub codes: HashSet<(u32, u64, u64)>,
    /// Threads and processes seen, named when first seen (they may be gone at the end).
    pub threads: HashMap<u32, TraceThread>,
    pub processes: HashMap<u32, String>,
    last_tid: u32,
}

impl Spool {
    fn create(path: PathBuf, limits: Limits, drops_base: u64) -> std::io::Result<Self> {
        let file = File::create(&path)?;
        let chunk_bytes = limits.buffer_bytes.clamp(RECORD, CHUNK_BYTES);
        let in_flight = (limits.buffer_bytes / chunk_bytes).saturating_sub(1).max(1);
        Ok(Self {
            writer: Writer::spawn(file, path, in_flight)?,
            buf: Vec::new(),
            limits,
            chunk: chunk_bytes / RECORD,
            queued: 0,
            events: 0,
            by_kind: [0; trace_kind::COUNT],
            exits_inferred: 0,
            unfinished: 0,
            over_file_limit: 0,
            kernel_drops: 0,
            drops_base,
            seq: 0,
            live: broadcast::channel(WATCH_BACKLOG).0,
            codes: HashSet::new(),
            threads: HashMap::new(),
            processes: HashMap::new(),
            last_tid: 0,
        })
    }

    /// A live view of the events recorded from now on.
    pub fn subscribe(&self) -> (broadcast::Receiver<Arc<Batch>>, u64) {
        (self.live.subscribe(), self.seq)
    }

    /// Bytes in the file, and those on their way to it while it takes writes: after a failed
    /// write (a full disk) nothing more reaches it.
    pub fn bytes(&self) -> u64 {
        let stats = &self.writer.stats;
        let written = stats.written.load(Ordering::Relaxed) * RECORD as u64;
        if stats.failed.load(Ordering::Relaxed) > 0 || lock(&stats.error).is_some() {
            return written;
        }
        self.queued + (self.buf.len() * RECORD) as u64
    }

    pub fn push(&mut self, events: &[TraceEvent]) {
        if self.live.receiver_count() > 0 {
            for (i, chunk) in events.chunks(BATCH).enumerate() {
                let batch = Batch {
                    first_seq: self.seq + (i * BATCH) as u64,
                    events: chunk.to_vec(),
                };
                // No receiver left is not an error: watchers come and go.
                let _ = self.live.send(Arc::new(batch));
            }
        }
        self.seq += events.len() as u64;
        for ev in events {
            self.note(ev);
        }
        let mut rest = events;
        while !rest.is_empty() {
            let take = rest.len().min(self.chunk - self.buf.len());
            self.buf.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if self.buf.len() >= self.chunk {
                self.spill();
            }
        }
    }

    fn note(&mut self, ev: &TraceEvent) {
        self.events += 1;
        if let Some(n) = self.by_kind.get_mut(usize::from(ev.kind)) {
            *n += 1;
        }
        if ev.kind == trace_kind::PY_CALL {
            self.codes.insert((ev.pid, ev.a, ev.b));
            if ev.flags & TRACE_EXIT_INFERRED != 0 {
                self.exits_inferred += 1;
            }
            if ev.flags & TRACE_UNFINISHED != 0 {
                self.unfinished += 1;
            }
        }
        if ev.tid != self.last_tid && ev.tid != 0 {
            self.last_tid = ev.tid;
            let (pid, tid) = (ev.pid, ev.tid);
            self.threads.entry(tid).or_insert_with(|| TraceThread {
                pid,
                tid,
                name: thread_name(pid, tid).unwrap_or_default(),
            });
            self.processes.entry(pid).or_insert_with(|| {
                crate::container::note(pid, false);
                tracer_inspect::process::comm(pid).unwrap_or_default()
            });
        }
    }

    /// Hands the buffered events to the writer, up to the file's size limit. Waits when
    /// `buffer_bytes` are already waiting to be written: memory stays bounded, and the
    /// kernel's ring buffer takes the delay.
    fn spill(&mut self) {
        let room = self.limits.file_bytes.saturating_sub(self.queued) / RECORD as u64;
        let fits = self
            .buf
            .len()
            .min(usize::try_from(room).unwrap_or(usize::MAX));
        self.over_file_limit += (self.buf.len() - fits) as u64;
        self.buf.truncate(fits);
        if !self.buf.is_empty() {
            self.queued += (fits * RECORD) as u64;
            let full = std::mem::replace(&mut self.buf, Vec::with_capacity(self.chunk));
            self.writer.send(full);
        }
        self.buf.clear();
    }

    /// Writes what is left and waits for the writer; the file then holds every event kept.
    fn close(&mut self) {
        // Watchers learn the final count, and so what they missed at the very end.
        let _ = self.live.send(Arc::new(Batch {
            first_seq: self.seq,
            events: Vec::new(),
        }));
        self.spill();
        self.writer.finish();
    }

    /// Events in the file (those past its limit, or whose write failed, are not).
    pub fn in_file(&self) -> u64 {
        self.writer.stats.written.load(Ordering::Relaxed)
    }

    /// Events that could not be written, and why.
    pub fn write_failed(&self) -> (u64, Option<String>) {
        (
            self.writer.stats.failed.load(Ordering::Relaxed),
            lock(&self.writer.stats.error).clone(),
        )
    }
}

/// Bytes per write: large enough for few syscalls, small enough to stay in the CPU cache.
const CHUNK_BYTES: usize = 1 << 20;

#[derive(Default)]
struct WriteStats {
    written: AtomicU64,
    failed: AtomicU64,
    error: Mutex<Option<String>>,
}

/// A spool's file, written on a thread of its own so that draining never waits on the disk.
struct Writer {
    tx: Option<std::sync::mpsc::SyncSender<Vec<TraceEvent>>>,
    thread: Option<thread::JoinHandle<()>>,
    stats: Arc<WriteStats>,
}

impl Writer {
    fn spawn(mut file: File, path: PathBuf, in_flight: usize) -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<TraceEvent>>(in_flight);
        let stats = Arc::new(WriteStats::default());
        let st = stats.clone();
        let thread = thread::Builder::new()
            .name("tracer-trace-file".into())
            .spawn(move || {
                for chunk in rx {
                    if lock(&st.error).is_some() {
                        st.failed.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                        continue;
                    }
                    match file.write_all(as_bytes(&chunk)) {
                        Ok(()) => st.written.fetch_add(chunk.len() as u64, Ordering::Relaxed),
                        Err(e) => {
                            *lock(&st.error) = Some(format!("writing {}: {e}", path.display()));
                            // A partial write leaves part of a chunk: the file keeps whole
                            // records, as many as counted written.
                            let written = st.written.load(Ordering::Relaxed) * RECORD as u64;
                            let _ = file.set_len(written);
                            st.failed.fetch_add(chunk.len() as u64, Ordering::Relaxed)
                        }
                    };
                }
                if let Err(e) = file.flush().and_then(|()| file.sync_data()) {
                    lock(&st.error).get_or_insert(format!("writing {}: {e}", path.display()));
                }
            })?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            stats,
        })
    }

    fn send(&mut self, chunk: Vec<TraceEvent>) {
        let n = chunk.len() as u64;
        if self.tx.as_ref().is_none_or(|tx| tx.send(chunk).is_err()) {
            self.stats.failed.fetch_add(n, Ordering::Relaxed);
        }
    }

    fn finish(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.finish();
    }
}

fn thread_name(pid: u32, tid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_owned())
}

struct State {
    maps: TracingMaps,
    sessions: HashMap<u32, Arc<Mutex<Spool>>>,
    /// Per-slot batches of one drain, reused.
    pending: HashMap<u32, Vec<TraceEvent>>,
    drops_read: std::time::Instant,
}

/// How often the worker reads the kernel's per-session drop counters.
const DROPS_EVERY: Duration = Duration::from_millis(200);

pub struct Tracing {
    /// The worker's state, shared.
    state: Arc<Mutex<State>>,
    dir: PathBuf,
    /// Stopped and joined when the manager drops it.
    _worker: RingWorker<State>,
}

impl Tracing {
    /// `dir`: where trace files go (created if needed).
    pub fn spawn(maps: TracingMaps, dir: PathBuf) -> Self {
        let fd = maps.events.as_raw_fd();
        let state = State {
            maps,
            sessions: HashMap::new(),
            pending: HashMap::new(),
            drops_read: std::time::Instant::now(),
        };
        let worker = RingWorker::spawn("tracer-tracing", fd, DRAIN_EVERY, state, |st| {
            st.drain(false)
        });
        Self {
            state: worker.state().clone(),
            dir,
            _worker: worker,
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Starts recording session `slot`'s events into `traces/ID.events`.
    pub fn add(&self, slot: u8, id: &str, limits: Limits) -> std::io::Result<Arc<Mutex<Spool>>> {
        std::fs::create_dir_all(&self.dir)?;
        let mut st = lock(&self.state);
        // Events of an earlier session in this slot must not reach this one.
        st.drain(false);
        let base = st.drops(u32::from(slot));
        let spool = Arc::new(Mutex::new(Spool::create(
            self.dir.join(file_name(id)),
            limits,
            base,
        )?));
        st.sessions.insert(u32::from(slot), spool.clone());
        Ok(spool)
    }

    /// What stops recording `slot` once its probes are off ([`Closer::close`]), to be run
    /// where waiting is fine; the slot must stay taken until then.
    pub fn closer(&self, slot: u8) -> Closer {
        Closer {
            state: self.state.clone(),
            slot,
        }
    }
}

/// Stops recording one slot: see [`Tracing::closer`].
pub struct Closer {
    state: Arc<Mutex<State>>,
    slot: u8,
}

impl Closer {
    /// Drains what the kernel still holds, then writes the rest of the slot's events to its
    /// file and waits for the disk: the file then holds every event kept.
    pub fn close(self) {
        let mut st = lock(&self.state);
        st.drain(true);
        let spool = st.sessions.remove(&u32::from(self.slot));
        // The worker goes on draining other sessions while this file is finished.
        drop(st);
        if let Some(spool) = spool {
            lock(&spool).close();
        }
    }
}

/// A trace file's name in the traces directory.
pub fn file_name(id: &str) -> String {
    format!("{id}.events")
}

impl State {
    fn drops(&self, slot: u32) -> u64 {
        self.maps
            .drops
            .get(&slot, 0)
            .map(|v| v.iter().sum())
            .unwrap_or(0)
    }

    /// `force`: also read the kernel's drop counters now.
    fn drain(&mut self, force: bool) {
        let State {
            maps,
            sessions,
            pending,
            ..
        } = self;
        // Bounded per call so that one flood cannot hold the lock for long, and handed to the
        // spools in batches so that what waits here stays small.
        const PER_BATCH: usize = 1 << 16;
        for _ in 0..16 {
            let mut n = 0;
            while n < PER_BATCH {
                let Some(item) = maps.events.next() else {
                    break;
                };
                n += 1;
                if item.len() < RECORD {
                    continue;
                }
                // SAFETY: written as a TraceEvent by the BPF side; read unaligned.
                let mut ev =
                    unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<TraceEvent>()) };
                drop(item);
                let mut mask = std::mem::take(&mut ev.sessions);
                while mask != 0 {
                    let slot = mask.trailing_zeros();
                    mask &= mask - 1;
                    if sessions.contains_key(&slot) {
                        pending.entry(slot).or_default().push(ev);
                    }
                }
            }
            for (slot, events) in pending.iter_mut().filter(|(_, e)| !e.is_empty()) {
                if let Some(spool) = sessions.get(slot) {
                    lock(spool).push(events);
                }
                events.clear();
            }
            if n < PER_BATCH {
                break;
            }
        }
        // A map read per session costs a syscall: a few times a second is enough for status.
        if force || self.drops_read.elapsed() >= DROPS_EVERY {
            self.drops_read = std::time::Instant::now();
            for (slot, spool) in self.sessions.iter() {
                let now: u64 = self.maps.drops.get(slot, 0).map_or(0, |v| v.iter().sum());
                let mut spool = lock(spool);
                spool.kernel_drops = now.saturating_sub(spool.drops_base);
            }
        }
    }
}

/// Events the daemon makes itself (counter readings, calls still running at the end) go
/// through here, in the same spool.
pub fn push_local(spool: &Mutex<Spool>, events: &[TraceEvent]) {
    lock(spool).push(events);
}

pub fn locked(spool: &Mutex<Spool>) -> MutexGuard<'_, Spool> {
    lock(spool)
}
