//! Sampling sessions' data path. A worker thread drains the `SAMPLES` ring buffer every
//! few milliseconds — while the sampled processes are alive, so their memory and binaries
//! can still be read — turns each sample into a named stack ([`tracer_symbolize::Resolver`]) and counts
//! it in its session's histogram. The manager adds a session when its perf events start
//! and takes its samples when they stop ([`Sampling::end`]), to be named off its task.

use std::{
    collections::{BTreeMap, HashMap},
    os::unix::fs::MetadataExt,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use std::os::fd::AsRawFd;

use tracer_common::{
    sample_flag, PyAsyncLayout, PySampleProc, SampleEvent, PY_SAMPLE_NOT_PYTHON,
    SAMPLE_STACK_OFFSET,
};

use tracer_inspect::python::{
    layout::Version,
    memory,
    runtime::{Runtime, RuntimeError},
};
use tracer_inspect::unwind::End;
use tracer_report::profile::{Frame, FrameKind, Mapping, OffCpu, Profile, Stack, Unwinding};
use tracer_symbolize::{Naming, RawStack, Resolver, Symbolizer};

/// How long the worker waits for samples before it looks for a stop request.
const DRAIN_EVERY: Duration = Duration::from_millis(20);
/// Interpreter binaries whose layout is kept at most.
const MAX_RUNTIMES: usize = 64;

use super::super::ring::{lock, RingWorker};
use tracer_bpf::SamplingMaps;

type Key = (u32, u32, u32, RawStack, u8);

/// A histogram state: a CPU sample of a Python thread that held the GIL, or did not.
const ON_GIL_HELD: u8 = 4;
const ON_GIL_RELEASED: u8 = 5;

/// One session's histogram.
#[derive(Clone)]
struct Histogram {
    frequency_hz: u64,
    event: &'static str,
    /// Whether the session's owner may see kernel addresses (else its frames keep names only).
    kernel_addresses: bool,
    started: Instant,
    start_unix_ns: u64,
    /// (pid, tid, process frame, stack as captured, state) → samples (state 0: nothing
    /// known of the GIL, `ON_GIL_RELEASED`, `ON_GIL_HELD`) or off-CPU nanoseconds (1
    /// preempted, 2 blocked, 3 uninterruptible).
    stacks: HashMap<Key, u64>,
    /// Wall-clock sessions: their off-CPU tally.
    off_cpu: Option<OffCpu>,
    comms: HashMap<u32, String>,
    unwinding: Unwinding,
    failed: BTreeMap<String, u64>,
    notes: std::collections::BTreeSet<String>,
    /// Samples in asyncio tasks start with the tasks awaiting them (`--asyncio`).
    tasks: bool,
}

struct State {
    maps: SamplingMaps,
    resolver: Resolver,
    sessions: HashMap<u32, Histogram>,
    /// pid → its CPython version, None for processes that run none.
    versions: HashMap<u32, Option<&'static Version>>,
    /// Interpreter binaries by (device, inode); the error says whether to look again later.
    runtimes: HashMap<(u64, u64), Result<Arc<Runtime>, bool>>,
    /// Python processes whose asyncio tasks cannot be read, and why (for `--asyncio`).
    no_tasks: HashMap<u32, String>,
    kernel_stacks: HashMap<u32, Vec<u64>>,
    /// Profiles being named off the lock ([`Ending`]): the resolver's ids must hold still
    /// (no compaction) until they are in.
    naming: usize,
}

pub struct Sampling {
    /// The worker's state, shared.
    state: Arc<Mutex<State>>,
    /// Stopped and joined when the manager drops it.
    _worker: RingWorker<State>,
}

/// An ended session's samples, to be named where waiting is fine ([`Ending::name`]): reading
/// symbol tables and DWARF of large binaries takes seconds.
pub struct Ending {
    state: Arc<Mutex<State>>,
    namer: Arc<Mutex<Symbolizer>>,
    work: Option<(Histogram, Naming)>,
}

impl Ending {
    /// The session's profile, named.
    pub fn name(mut self) -> Profile {
        let (h, naming) = self.work.take().expect("named once");
        let named = naming.run(&mut lock(&self.namer));
        let mut st = lock(&self.state);
        st.resolver.apply(named);
        let profile = st.named_profile(h);
        st.naming -= 1;
        st.tidy();
        profile
    }
}

impl super::super::ReportPart for Ending {
    fn fill(self: Box<Self>, report: &mut tracer_report::Report) {
        report.profile = Some(self.name());
    }
}

impl Drop for Ending {
    fn drop(&mut self) {
        if self.work.take().is_some() {
            lock(&self.state).naming -= 1;
        }
    }
}

/// Takes windows of a session's samples while it runs (continuous profiling).
#[derive(Clone)]
pub struct Windows(Arc<Mutex<State>>);

impl Windows {
    /// The samples since the last window (or the start), named (without the sampling
    /// lock, as at a session's end); the session goes on.
    pub fn take(&self, slot: u8) -> Option<Profile> {
        let ending = {
            let mut st = lock(&self.0);
            st.drain();
            let h = st.sessions.get_mut(&u32::from(slot))?;
            let min_ns = h.off_cpu.as_ref().map(|o| o.min_ns);
            let fresh = Histogram {
                tasks: h.tasks,
                ..Histogram::new(h.frequency_hz, h.event, h.kernel_addresses, min_ns)
            };
            let window = std::mem::replace(h, fresh);
            st.ending(window, &self.0)
        };
        Some(ending.name())
    }

    /// The samples since the start (or the last window), named; nothing is taken.
    pub fn peek(&self, slot: u8) -> Option<Ending> {
        let mut st = lock(&self.0);
        st.drain();
        let h = st.sessions.get(&u32::from(slot))?.clone();
        Some(st.ending(h, &self.0))
    }
}

impl Histogram {
    fn new(
        frequency_hz: u64,
        event: &'static str,
        kernel_addresses: bool,
        off_cpu_min_ns: Option<u64>,
    ) -> Self {
        Histogram {
            frequency_hz,
            event,
            kernel_addresses,
            started: Instant::now(),
            start_unix_ns: crate::clock::unix_ns(),
            stacks: HashMap::new(),
            off_cpu: off_cpu_min_ns.map(|min_ns| OffCpu {
                min_ns,
                ..OffCpu::default()
            }),
            comms: HashMap::new(),
            unwinding: Unwinding::default(),
            failed: BTreeMap::new(),
            notes: Default::default(),
            tasks: false,
        }
    }
}

impl Sampling {
    pub fn windows(&self) -> Windows {
        Windows(self.state.clone())
    }

    /// `interpreters`: the Python runtime binaries on this machine, read ahead so that the
    /// first samples of a short-lived process already find its interpreter known.
    pub fn spawn(maps: SamplingMaps, interpreters: Vec<std::path::PathBuf>) -> Self {
        let fd = maps.samples.as_raw_fd();
        let mut state = State {
            maps,
            resolver: Resolver::new(),
            sessions: HashMap::new(),
            versions: HashMap::new(),
            runtimes: HashMap::new(),
            no_tasks: HashMap::new(),
            kernel_stacks: HashMap::new(),
            naming: 0,
        };
        let started = Instant::now();
        for path in &interpreters {
            state.runtime(path);
        }
        tracing::debug!(elapsed = ?started.elapsed(), "interpreters read for sampling");
        let worker = RingWorker::spawn("tracer-sampling", fd, DRAIN_EVERY, state, State::drain);
        Self {
            state: worker.state().clone(),
            _worker: worker,
        }
    }

    /// Makes the probes able to read `pid`'s Python stacks (`PY_SAMPLE_PROCS`), if not yet
    /// or no more (an exec removes it): CUDA launches read their Python call site there.
    pub fn watch(&self, pid: u32) {
        lock(&self.state).watch(pid);
    }

    /// A handle that reads a process's new program for the probes off the manager's task
    /// (reading an interpreter binary not seen before takes tens of milliseconds).
    pub fn looker(&self) -> Looker {
        Looker(Arc::clone(&self.state))
    }

    /// The CPython version `pid` runs, if it is known to run one.
    pub fn version(&self, pid: u32) -> Option<&'static Version> {
        lock(&self.state).version(pid)
    }

    /// Starts a histogram for `slot`. `pids`: processes to look at, so that their first
    /// samples already have Python frames: the target, now; or every process for `--all`,
    /// on a thread of their own, one at a time (reading 1,500 processes' mappings takes
    /// ~70 ms), those not known yet. Samples of a process not looked at yet are looked at as
    /// they come. `kernel_addresses`: whether its owner may see them
    /// (`process::kernel_addresses_for`). `off_cpu_min_ns`: wall-clock sessions' shortest
    /// off-CPU record.
    pub fn add(
        &self,
        slot: u8,
        frequency_hz: u64,
        event: &'static str,
        pids: Vec<u32>,
        kernel_addresses: bool,
        off_cpu_min_ns: Option<u64>,
    ) {
        let mut st = lock(&self.state);
        if let [pid] = pids[..] {
            let _ = st.check_process(pid);
        }
        st.sessions.insert(
            u32::from(slot),
            Histogram::new(frequency_hz, event, kernel_addresses, off_cpu_min_ns),
        );
        drop(st);
        self.look(pids);
    }

    /// Sample stacks in asyncio tasks start with the tasks awaiting them, as
    /// `python -m asyncio pstree` shows them, without the event loop's frames.
    pub fn show_tasks(&self, slot: u8) {
        if let Some(h) = lock(&self.state).sessions.get_mut(&u32::from(slot)) {
            h.tasks = true;
        }
    }

    /// A line `slot`'s report shows whatever it sampled: what it lacks and why.
    pub fn note(&self, slot: u8, line: String) {
        if let Some(h) = lock(&self.state).sessions.get_mut(&u32::from(slot)) {
            h.notes.insert(line);
        }
    }

    /// Looks at the processes a new session samples, on a thread of its own for many.
    fn look(&self, pids: Vec<u32>) {
        if pids.len() > 1 {
            let state = Arc::clone(&self.state);
            let looked = std::thread::Builder::new()
                .name("sampling-look".into())
                .spawn(move || {
                    for pid in pids {
                        lock(&state).watch(pid);
                    }
                });
            if let Err(e) = looked {
                tracing::warn!(%e, "no thread to look at every process on");
            }
        }
    }

    /// Ends `slot`'s histogram (its perf events must be closed already); quick. Naming it
    /// is [`Ending::name`]'s work.
    pub fn end(&self, slot: u8) -> Option<Ending> {
        let mut st = lock(&self.state);
        st.drain();
        let h = st.sessions.remove(&u32::from(slot))?;
        if st.sessions.is_empty() {
            st.forget_kernel_stacks();
        }
        Some(st.ending(h, &self.state))
    }

    /// Off-CPU time of `slot`'s threads that no record stands for at its end (`(tid, ns)`).
    pub fn off_cpu_unfinished(&self, slot: u8, threads: &[(u32, u64)]) {
        let mut st = lock(&self.state);
        if let Some(o) = st
            .sessions
            .get_mut(&u32::from(slot))
            .and_then(|h| h.off_cpu.as_mut())
        {
            o.unfinished_threads += threads.len() as u64;
            o.unfinished_ns += threads.iter().map(|t| t.1).sum::<u64>();
        }
    }

    /// A process exited: what was per process goes (its samples are already counted).
    pub fn exited(&self, pid: u32) {
        let mut st = lock(&self.state);
        st.drain();
        st.versions.remove(&pid);
        st.no_tasks.remove(&pid);
        st.resolver.forget(pid);
    }
}

/// Reads a process's program for the sampling probes, on any thread ([`Sampling::looker`]).
pub struct Looker(Arc<Mutex<State>>);

impl Looker {
    /// [`Sampling::watch`], on a thread of the caller's.
    pub fn look(&self, pid: u32) {
        lock(&self.0).watch(pid);
    }
}

impl State {
    /// Reads `pid`'s program for the probes unless its entry is there already (an exec
    /// removes it; a drain may have read the new program first).
    fn watch(&mut self, pid: u32) {
        if self.maps.python_procs.get(&pid, 0).is_err() {
            self.check_process(pid);
        }
    }

    fn drain(&mut self) {
        // pid → when it was last looked at in this batch: once for a definite answer; a
        // process whose libpython is not mapped yet again every millisecond.
        let mut checked: HashMap<u32, Option<Instant>> = HashMap::new();
        // One record's room (≈ 67 KiB), reused: a record holds only the stack bytes copied.
        let mut ev: Box<SampleEvent> = {
            // SAFETY: SampleEvent is plain integers and arrays: all zeros is a valid value.
            unsafe { Box::new_zeroed().assume_init() }
        };
        loop {
            {
                let Some(item) = self.maps.samples.next() else {
                    break;
                };
                let n = item.len().min(std::mem::size_of::<SampleEvent>());
                if n < SAMPLE_STACK_OFFSET {
                    continue;
                }
                // SAFETY: written as a SampleEvent's first `n` bytes by the BPF side; the
                // rest of `ev` is never read (`stack_len` covers the bytes sent).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        item.as_ptr(),
                        (&mut *ev as *mut SampleEvent).cast::<u8>(),
                        n,
                    );
                }
                ev.stack_len = ev.stack_len.min((n - SAMPLE_STACK_OFFSET) as u32);
            }
            if ev.flags & sample_flag::PY_UNKNOWN_PROCESS != 0 {
                let due = match checked.get(&ev.pid) {
                    None => true,
                    Some(None) => false,
                    Some(Some(at)) => at.elapsed() >= Duration::from_millis(1),
                };
                if due {
                    let later = self.check_process(ev.pid);
                    checked.insert(ev.pid, later.then(Instant::now));
                }
            }
            self.count(&ev);
        }
    }

    fn count(&mut self, ev: &SampleEvent) {
        let off = ev.flags & sample_flag::OFF_CPU != 0;
        // Off-CPU records are for every session in their mask; a timer's sample, for one.
        let slots: Vec<u32> = (0..64u32)
            .filter(|&b| ev.slots & (1u64 << b) != 0)
            .filter(|b| {
                self.sessions
                    .get(b)
                    .is_some_and(|h| !off || h.off_cpu.is_some())
            })
            .collect();
        if slots.is_empty() {
            // A sample of a session that just ended.
            return;
        }
        let kernel = match u32::try_from(ev.kernel_stack) {
            Ok(id) => self.kernel_stack(id),
            Err(_) => Vec::new(),
        };
        let version = self.version(ev.pid);
        let outcome = self.resolver.capture(ev, kernel, version);
        let comm = {
            let h = &self.sessions[&slots[0]];
            h.comms.get(&ev.pid).cloned()
        }
        .unwrap_or_else(|| {
            // First sample of this process in the session.
            crate::container::note(ev.pid, false);
            process_comm(ev.pid, &ev.comm)
        });
        let root = self.resolver.process_frame(&comm, ev.pid);
        let notes = std::mem::take(&mut self.resolver.notes);
        let (state, value) = match off {
            false if ev.flags & sample_flag::GIL_HELD != 0 => (ON_GIL_HELD, 1),
            false if ev.flags & sample_flag::GIL_KNOWN != 0 => (ON_GIL_RELEASED, 1),
            false => (0, 1),
            true if ev.flags & sample_flag::PREEMPTED != 0 => (1, ev.weight_ns),
            true if ev.flags & sample_flag::UNINTERRUPTIBLE != 0 => (3, ev.weight_ns),
            true => (2, ev.weight_ns),
        };
        let no_tasks = self.no_tasks.get(&ev.pid);
        for slot in slots {
            let h = self.sessions.get_mut(&slot).expect("checked above");
            h.notes.extend(notes.iter().cloned());
            if let (true, Some(why)) = (h.tasks, no_tasks) {
                h.notes
                    .insert(format!("no asyncio task stacks for {comm}: {why}"));
            }
            h.comms.entry(ev.pid).or_insert_with(|| comm.clone());
            *h.stacks
                .entry((ev.pid, ev.tid, root, outcome.raw.clone(), state))
                .or_default() += value;
            if let (true, Some(o)) = (off, h.off_cpu.as_mut()) {
                o.total_ns += ev.weight_ns;
                o.records += 1;
                o.carried_ns += ev.weight_ns.saturating_sub(ev.own_ns);
            }
            h.unwinding.samples += 1;
            match &outcome.end {
                End::Root => h.unwinding.reached_root += 1,
                other => *h.failed.entry(end_reason(other)).or_default() += 1,
            }
            if outcome.python {
                h.unwinding.python_samples += 1;
            }
            if outcome.python_complete {
                h.unwinding.python_complete += 1;
            }
        }
    }

    fn kernel_stack(&mut self, id: u32) -> Vec<u64> {
        if let Some(s) = self.kernel_stacks.get(&id) {
            return s.clone();
        }
        let ips: Vec<u64> = self
            .maps
            .kernel_stacks
            .get(&id, 0)
            .map(|s| s.frames().iter().map(|f| f.ip).collect())
            .unwrap_or_default();
        self.kernel_stacks.insert(id, ips.clone());
        ips
    }

    /// Keeps of the resolver only what the running sessions' samples refer to: binaries
    /// (and their open files) and names of programs gone do not pile up over the daemon's life.
    /// `h`, to be named off the lock.
    fn ending(&mut self, h: Histogram, state: &Arc<Mutex<State>>) -> Ending {
        let naming = self.resolver.to_name(h.stacks.keys().map(|k| &k.3));
        self.naming += 1;
        Ending {
            state: state.clone(),
            namer: self.resolver.namer(),
            work: Some((h, naming)),
        }
    }

    /// What ended sessions no longer need goes.
    fn tidy(&mut self) {
        self.resolver.forget_exited();
        self.versions
            .retain(|&pid, _| tracer_inspect::process::alive(pid));
        self.no_tasks
            .retain(|&pid, _| tracer_inspect::process::alive(pid));
        self.compact();
    }

    fn compact(&mut self) {
        if self.naming > 0 {
            // Ids in flight; the last profile named compacts.
            return;
        }
        let live = self
            .sessions
            .values()
            .flat_map(|h| h.stacks.keys().map(|(_, _, root, raw, _)| (*root, raw)));
        let map = self.resolver.compact(live);
        for h in self.sessions.values_mut() {
            h.stacks = std::mem::take(&mut h.stacks)
                .into_iter()
                .map(|((pid, tid, root, raw, state), n)| {
                    ((pid, tid, map.frame(root), map.stack(raw), state), n)
                })
                .collect();
        }
        if self.runtimes.len() > MAX_RUNTIMES {
            // Read again on demand (milliseconds each); copies of interpreters come and go.
            self.runtimes.clear();
        }
    }

    /// Stack ids are deduplicated by the kernel and reused across sessions; once no
    /// session samples, the map is emptied so it cannot fill up over the daemon's life.
    fn forget_kernel_stacks(&mut self) {
        for id in std::mem::take(&mut self.kernel_stacks).into_keys() {
            let _ = self.maps.kernel_stacks.remove(&id);
        }
    }

    /// Tells the probe how to read `pid`'s Python stacks, or that it runs no known CPython.
    /// The CPython `pid` runs, if known: looked at, or inherited at a fork (the fork
    /// tracepoint copies the parent's entry to the child, whose memory is the parent's).
    fn version(&mut self, pid: u32) -> Option<&'static Version> {
        if let Some(&v) = self.versions.get(&pid) {
            return v;
        }
        let entry = self.maps.python_procs.get(&pid, 0).ok()?;
        let v = tracer_inspect::python::layout::by_index(entry.layout)?;
        self.versions.insert(pid, Some(v));
        Some(v)
    }

    /// Called for a process's first samples, and again after each exec (the exec
    /// tracepoint removes the process's entry), so what was read of its old program goes.
    /// True when the answer may change without an exec (libpython not mapped yet).
    fn check_process(&mut self, pid: u32) -> bool {
        self.resolver.forget(pid);
        let found = self.python_runtime(pid);
        let entry = match found {
            Lookup::Python(runtime, v, asyncio) => {
                if let Err(e) = tracer_bpf::publish_layout(v) {
                    tracing::warn!(%e, pid, "this process's Python frames cannot be read");
                }
                match asyncio {
                    Ok(a) => {
                        self.no_tasks.remove(&pid);
                        if let Err(e) = self.maps.async_procs.insert(pid, a, 0) {
                            tracing::warn!(%e, pid, "PY_ASYNC_PROCS is full: this process's asyncio tasks are not read");
                        }
                    }
                    Err(why) => {
                        self.no_tasks.insert(pid, why);
                    }
                }
                self.versions.insert(pid, Some(v));
                PySampleProc {
                    runtime,
                    layout: v.index,
                    origin: 0,
                }
            }
            Lookup::NotYet => {
                // A python executable whose libpython is not loaded yet: its samples stay
                // "unknown process" and it is looked at again.
                self.versions.remove(&pid);
                return true;
            }
            Lookup::NotPython => {
                self.versions.insert(pid, None);
                PySampleProc {
                    runtime: 0,
                    layout: PY_SAMPLE_NOT_PYTHON,
                    origin: 0,
                }
            }
        };
        if let Err(e) = self.maps.python_procs.insert(pid, entry, 0) {
            tracing::warn!(%e, pid, "PY_SAMPLE_PROCS is full: this process's Python frames are not read");
        }
        false
    }

    /// An interpreter binary's layout, read once per (device, inode); the error says
    /// whether to look again later. None: the file cannot be read now.
    fn runtime(&mut self, path: &std::path::Path) -> Option<Result<Arc<Runtime>, bool>> {
        let key = std::fs::metadata(path).map(|m| (m.dev(), m.ino())).ok()?;
        let rt = self
            .runtimes
            .entry(key)
            .or_insert_with(|| match Runtime::inspect_layout(path) {
                Ok(rt) => Ok(Arc::new(rt)),
                Err(e) => {
                    tracing::debug!(%e, "not sampling Python frames of this interpreter");
                    // An executable without the eval loop links libpython, mapped later.
                    Err(matches!(e, RuntimeError::NoEvalLoop { .. }))
                }
            });
        Some(rt.clone())
    }

    fn python_runtime(&mut self, pid: u32) -> Lookup {
        let Some(mapped) = memory::runtime_of(pid) else {
            return Lookup::NotPython;
        };
        let Some(rt) = self.runtime(&mapped.path) else {
            return Lookup::NotYet;
        };
        match rt {
            Ok(rt) => match (
                rt.runtime_symbol,
                rt.load_bias(mapped.start, mapped.file_offset),
            ) {
                (Some(sym), Some(bias)) => {
                    Lookup::Python(sym.wrapping_add(bias), rt.version, rt.asyncio.clone())
                }
                _ => Lookup::NotPython,
            },
            Err(true) => Lookup::NotYet,
            Err(false) => Lookup::NotPython,
        }
    }

    /// The profile of `h`, whose addresses are named.
    fn named_profile(&mut self, h: Histogram) -> Profile {
        let mut named: HashMap<(u32, u32, Vec<u32>, u8), u64> = HashMap::new();
        for ((pid, tid, root, raw, state), count) in &h.stacks {
            let mut ids = vec![*root];
            ids.extend(self.resolver.frames(raw, h.tasks));
            *named.entry((*pid, *tid, ids, *state)).or_default() += count;
        }
        // Only the binaries this profile's frames point into, renumbered.
        let mut mappings: Vec<Mapping> = Vec::new();
        let mut renumber: HashMap<usize, usize> = HashMap::new();
        let mut stacks: Vec<Stack> = named
            .into_iter()
            .map(|((pid, tid, ids, state), count)| {
                let mut frames: Vec<Frame> = ids
                    .iter()
                    .map(|&id| {
                        let mut f: Frame = self.resolver.frame(id).clone();
                        if f.kind == FrameKind::Kernel && !h.kernel_addresses {
                            f.address = 0;
                        }
                        if let Some(m) = f.mapping {
                            let n = *renumber.entry(m).or_insert_with(|| {
                                mappings.push(self.resolver.mapping(m).clone());
                                mappings.len() - 1
                            });
                            f.mapping = Some(n);
                        }
                        f
                    })
                    .collect();
                let off = !matches!(state, 0 | ON_GIL_HELD | ON_GIL_RELEASED);
                if off {
                    super::reason::trim(&mut frames);
                    let why = super::reason::reason(&frames, state);
                    frames.push(Frame {
                        kind: FrameKind::OffCpu,
                        name: why.into(),
                        ..Frame::default()
                    });
                }
                let (count, off_cpu_ns) = if off { (0, count) } else { (count, 0) };
                Stack {
                    pid,
                    tid,
                    comm: h.comms.get(&pid).cloned().unwrap_or_default(),
                    frames,
                    count,
                    off_cpu_ns,
                    gil_held: match state {
                        ON_GIL_HELD => Some(true),
                        ON_GIL_RELEASED => Some(false),
                        _ => None,
                    },
                }
            })
            .collect();
        let period = match h.frequency_hz {
            0 => 0,
            hz => 1_000_000_000 / hz,
        };
        let weight = |s: &Stack| s.count.saturating_mul(period.max(1)) + s.off_cpu_ns;
        stacks.sort_by(|a, b| {
            weight(b)
                .cmp(&weight(a))
                .then_with(|| a.frames.len().cmp(&b.frames.len()))
        });
        let mut unwinding = h.unwinding;
        unwinding.failed = h.failed.into_iter().collect();
        unwinding.notes = h.notes.into_iter().collect();
        // Launch stacks (frequency 0) stand for launches, not for time.
        let period_ns = match h.frequency_hz {
            0 => 0,
            hz => 1_000_000_000 / hz,
        };
        Profile {
            event: h.event.into(),
            frequency_hz: h.frequency_hz,
            period_ns,
            start_unix_ns: h.start_unix_ns,
            duration_ns: h.started.elapsed().as_nanos() as u64,
            stacks,
            mappings,
            unwinding,
            off_cpu: h.off_cpu,
        }
    }
}

enum Lookup {
    /// `_PyRuntime`'s address, the version, and how to read its asyncio tasks (or why not).
    Python(u64, &'static Version, Result<PyAsyncLayout, String>),
    NotYet,
    NotPython,
}

/// The process's name (not the sampled thread's, which threads may rename).
fn process_comm(pid: u32, thread_comm: &[u8; 16]) -> String {
    tracer_inspect::process::comm(pid).unwrap_or_else(|| {
        let len = thread_comm.iter().position(|&b| b == 0).unwrap_or(16);
        String::from_utf8_lossy(&thread_comm[..len]).into_owned()
    })
}

fn end_reason(end: &End) -> String {
    match end {
        End::Root => "reached the root".into(),
        // Seen here mostly for samples taken while the kernel handled a page fault: only the
        // stack pointer's page could be read then.
        End::StackCopyExhausted => {
            "the stack copy ended first (deeper than 64 KiB, or pages unreadable at the sample)"
                .into()
        }
        End::NoUnwindInfo(path) => format!("code without unwind entries in {path}"),
        End::UnmappedAddress(_) => "an address outside any code mapping".into(),
        End::BadFrame => "an unwind rule not supported, or a corrupt frame".into(),
        End::MaxFrames => "more frames than tracer unwinds".into(),
    }
}
