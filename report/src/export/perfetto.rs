//! Perfetto's protobuf trace format: a `perfetto.protos.Trace` (protos/perfetto/trace/
//! trace.proto in github.com/google/perfetto), as Perfetto UI and trace_processor open it.
//! The messages are written here with prost's derive, only the fields tracer fills, numbered
//! as in Perfetto's .proto files, so no `protoc` or generated code is needed.
//!
//! Layout: a clock snapshot that makes CLOCK_MONOTONIC (the events' clock) the trace's
//! clock, one packet of interned names, a track per process, thread, (process, counter) and
//! (process, GPU, stream), then GPU kernels' slices, each thread's slices and instants and
//! each counter's readings. Every packet is `Trace.packet` (field 1), so they are streamed
//! one by one; trace_processor sorts them.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{self, Write};
use std::iter::Peekable;

use prost::encoding::{encode_key, WireType};
use prost::Message;
use tracer_common::{trace_kind, TraceEvent};

use crate::trace::{exit_inferred, unfinished, GpuTrack, Named, Trace, TraceFunction};

mod pb {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TracePacket {
        #[prost(message, optional, tag = "6")]
        pub clock_snapshot: Option<ClockSnapshot>,
        #[prost(uint64, optional, tag = "8")]
        pub timestamp: Option<u64>,
        #[prost(uint32, optional, tag = "10")]
        pub trusted_packet_sequence_id: Option<u32>,
        #[prost(message, optional, tag = "11")]
        pub track_event: Option<TrackEvent>,
        #[prost(message, optional, tag = "12")]
        pub interned_data: Option<InternedData>,
        #[prost(uint32, optional, tag = "13")]
        pub sequence_flags: Option<u32>,
        #[prost(uint32, optional, tag = "58")]
        pub timestamp_clock_id: Option<u32>,
        #[prost(message, optional, tag = "60")]
        pub track_descriptor: Option<TrackDescriptor>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ClockSnapshot {
        #[prost(message, repeated, tag = "1")]
        pub clocks: Vec<Clock>,
        #[prost(int32, optional, tag = "2")]
        pub primary_trace_clock: Option<i32>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Clock {
        #[prost(uint32, optional, tag = "1")]
        pub clock_id: Option<u32>,
        #[prost(uint64, optional, tag = "2")]
        pub timestamp: Option<u64>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct InternedData {
        #[prost(message, repeated, tag = "1")]
        pub event_categories: Vec<Interned>,
        #[prost(message, repeated, tag = "2")]
        pub event_names: Vec<Interned>,
        #[prost(message, repeated, tag = "3")]
        pub debug_annotation_names: Vec<Interned>,
        /// `InternedString`, whose `str` is `bytes`: the same wire format as a string.
        #[prost(message, repeated, tag = "29")]
        pub debug_annotation_string_values: Vec<Interned>,
    }

    /// EventCategory, EventName, DebugAnnotationName, InternedString: iid = 1, name = 2.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Interned {
        #[prost(uint64, optional, tag = "1")]
        pub iid: Option<u64>,
        #[prost(string, optional, tag = "2")]
        pub name: Option<String>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TrackDescriptor {
        #[prost(uint64, optional, tag = "1")]
        pub uuid: Option<u64>,
        #[prost(string, optional, tag = "2")]
        pub name: Option<String>,
        #[prost(message, optional, tag = "3")]
        pub process: Option<ProcessDescriptor>,
        #[prost(message, optional, tag = "4")]
        pub thread: Option<ThreadDescriptor>,
        #[prost(uint64, optional, tag = "5")]
        pub parent_uuid: Option<u64>,
        #[prost(message, optional, tag = "8")]
        pub counter: Option<CounterDescriptor>,
        #[prost(string, optional, tag = "14")]
        pub description: Option<String>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ProcessDescriptor {
        #[prost(int32, optional, tag = "1")]
        pub pid: Option<i32>,
        #[prost(string, optional, tag = "6")]
        pub process_name: Option<String>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ThreadDescriptor {
        #[prost(int32, optional, tag = "1")]
        pub pid: Option<i32>,
        #[prost(int64, optional, tag = "2")]
        pub tid: Option<i64>,
        #[prost(string, optional, tag = "5")]
        pub thread_name: Option<String>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct CounterDescriptor {
        #[prost(int32, optional, tag = "3")]
        pub unit: Option<i32>,
        #[prost(string, optional, tag = "6")]
        pub unit_name: Option<String>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TrackEvent {
        /// proto2 repeated scalars are unpacked; Perfetto's decoder expects them so.
        #[prost(uint64, repeated, packed = "false", tag = "3")]
        pub category_iids: Vec<u64>,
        #[prost(message, repeated, tag = "4")]
        pub debug_annotations: Vec<DebugAnnotation>,
        #[prost(int32, optional, tag = "9")]
        pub r#type: Option<i32>,
        #[prost(uint64, optional, tag = "10")]
        pub name_iid: Option<u64>,
        #[prost(uint64, optional, tag = "11")]
        pub track_uuid: Option<u64>,
        #[prost(int64, optional, tag = "30")]
        pub counter_value: Option<i64>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct DebugAnnotation {
        #[prost(uint64, optional, tag = "1")]
        pub name_iid: Option<u64>,
        #[prost(bool, optional, tag = "2")]
        pub bool_value: Option<bool>,
        #[prost(int64, optional, tag = "4")]
        pub int_value: Option<i64>,
        #[prost(uint64, optional, tag = "17")]
        pub string_value_iid: Option<u64>,
    }
}

/// `BuiltinClock`: the events' clock, and the wall clock the session's start is known in.
const CLOCK_REALTIME: u32 = 1;
const CLOCK_MONOTONIC: u32 = 3;
/// `TracePacket.SequenceFlags`.
const SEQ_INCREMENTAL_STATE_CLEARED: u32 = 1;
const SEQ_NEEDS_INCREMENTAL_STATE: u32 = 2;
/// `TrackEvent.Type`.
const SLICE_BEGIN: i32 = 1;
const SLICE_END: i32 = 2;
const INSTANT: i32 = 3;
const COUNTER: i32 = 4;
/// `CounterDescriptor.Unit`.
const UNIT_TIME_NS: i32 = 1;
const UNIT_COUNT: i32 = 2;
/// All packets come from one writer, so they share one sequence (and its interned data).
const SEQUENCE: u32 = 1;
/// Bytes gathered before a write to `out`.
const CHUNK: usize = 1 << 20;

/// Interned category ids.
const CAT_PYTHON: u64 = 1;
const CAT_NATIVE: u64 = 2;
const CAT_GPU: u64 = 3;
const CAT_OFF_CPU: u64 = 4;
/// Interned debug annotation names, by iid (index + 1).
const ANNOTATIONS: [&str; 5] = [
    "file",
    "line",
    "exit_inferred",
    "unfinished",
    "began_before_session",
];
const ARG_FILE: u64 = 1;
const ARG_LINE: u64 = 2;
const ARG_EXIT_INFERRED: u64 = 3;
const ARG_UNFINISHED: u64 = 4;
const ARG_BEFORE_SESSION: u64 = 5;

/// `Slice::flags`.
const F_EXIT_INFERRED: u8 = 1;
const F_UNFINISHED: u8 = 2;
/// A time off the CPU, not a call.
const F_OFF_CPU: u8 = 4;

/// Writes the trace as Perfetto's protobuf `Trace`.
pub fn write(trace: &Trace, out: &mut dyn Write) -> io::Result<()> {
    let mut ev = Collected::read(trace)?;
    let mut w = Packets {
        out,
        buf: Vec::with_capacity(CHUNK + (CHUNK >> 4)),
    };
    w.packet(&clock_snapshot(trace))?;
    w.packet(&pb::TracePacket {
        interned_data: Some(ev.interned_data()),
        sequence_flags: Some(SEQ_INCREMENTAL_STATE_CLEARED),
        ..packet()
    })?;
    let tracks = Tracks::new(trace, &ev);
    for d in tracks.descriptors(trace) {
        w.packet(&pb::TracePacket {
            track_descriptor: Some(d),
            ..packet()
        })?;
    }
    // Kernels on one stream run one after another; an overlap (clock noise) is cut so that
    // the slices stay balanced.
    for (key, kernels) in &mut ev.gpu {
        let track = tracks.gpu[key];
        kernels.sort_unstable();
        let mut free_from = 0;
        for &(start, end, name) in kernels.iter() {
            let start = start.max(free_from);
            let end = end.max(start);
            w.event(
                start,
                pb::TrackEvent {
                    r#type: Some(SLICE_BEGIN),
                    category_iids: vec![CAT_GPU],
                    name_iid: Some(name),
                    track_uuid: Some(track),
                    ..Default::default()
                },
            )?;
            w.end(track, end)?;
            free_from = end;
        }
    }
    // Each thread's calls are dropped once written.
    while let Some((key, mut t)) = ev.threads.pop_first() {
        emit_thread(&mut w, trace, &ev.functions, tracks.threads[&key], &mut t)?;
    }
    for (key, readings) in &mut ev.counters {
        // Readings of one perf counter in one process, as deltas between readings (a reading
        // below the one before, which should not happen, shows as a negative delta); GPU
        // metrics, levels, as read.
        let gauge = usize::try_from(key.1)
            .ok()
            .and_then(|i| trace.counters.get(i))
            .is_some_and(|c| c.gauge);
        readings.sort_by_key(|r| r.0);
        let mut prev = 0u64;
        for &(ts, value) in readings.iter() {
            let delta = if gauge {
                value as i64
            } else {
                value.wrapping_sub(prev) as i64
            };
            prev = value;
            w.event(
                ts,
                pb::TrackEvent {
                    r#type: Some(COUNTER),
                    track_uuid: Some(tracks.counters[key]),
                    counter_value: Some(delta),
                    ..Default::default()
                },
            )?;
        }
    }
    w.finish()
}

/// One Python call, as little as the export needs of it.
struct Slice {
    start: u64,
    end: u64,
    /// Index into `Collected::functions`.
    func: u32,
    flags: u8,
}

/// A kernel's execution: (start, end, interned name).
type GpuSlice = (u64, u64, u64);

/// A Python function's interned name and, when known, file and first line.
struct Func {
    name: u64,
    file: Option<u64>,
    line: Option<i32>,
}

#[derive(Default)]
struct ThreadEvents {
    slices: Vec<Slice>,
    /// Native calls: (time, interned name).
    instants: Vec<(u64, u64)>,
}

/// The trace file read once, grouped by thread and by (process, counter).
#[derive(Default)]
struct Collected {
    threads: BTreeMap<(u32, u32), ThreadEvents>,
    /// (pid, counter index) → (time, cumulative value).
    counters: BTreeMap<(u32, u64), Vec<(u64, u64)>>,
    /// GPU kernel executions per (pid, device and stream).
    gpu: BTreeMap<(u32, GpuTrack), Vec<GpuSlice>>,
    functions: Vec<Func>,
    names: Interner,
    files: Interner,
}

impl Collected {
    fn read(trace: &Trace) -> io::Result<Self> {
        let index = trace.function_index();
        let mut funcs: HashMap<(u32, u64, u64), u32> = HashMap::new();
        let mut probes: HashMap<u64, u64> = HashMap::new();
        let mut cuda: HashMap<(u16, u32, u64), u64> = HashMap::new();
        let mut away: HashMap<String, u32> = HashMap::new();
        let mut c = Collected::default();
        for ev in trace.events()? {
            let ev = ev?;
            match ev.kind {
                trace_kind::PY_CALL => {
                    let func = match funcs.get(&(ev.pid, ev.a, ev.b)) {
                        Some(&f) => f,
                        None => {
                            let f = c.function(trace, &index, &ev);
                            funcs.insert((ev.pid, ev.a, ev.b), f);
                            f
                        }
                    };
                    let flags = if exit_inferred(&ev) {
                        F_EXIT_INFERRED
                    } else {
                        0
                    } | if unfinished(&ev) { F_UNFINISHED } else { 0 };
                    c.thread(&ev).slices.push(Slice {
                        start: ev.start_ns,
                        end: ev.end_ns,
                        func,
                        flags,
                    });
                }
                trace_kind::NATIVE_CALL => {
                    let names = &mut c.names;
                    let name = *probes
                        .entry(ev.a)
                        .or_insert_with(|| names.id(&trace.named(&index, &ev).name()));
                    c.thread(&ev).instants.push((ev.start_ns, name));
                }
                // CUDA launches and copies: instants named after the kernel or the call.
                trace_kind::CUDA_LAUNCH | trace_kind::CUDA_MEMORY => {
                    let key = match ev.kind {
                        // Launches are named by their row (the kernel's name or its fallback).
                        trace_kind::CUDA_LAUNCH => (ev.kind, ev.pid, ev.b),
                        _ => (ev.kind, 0, u64::from(ev.flags)),
                    };
                    let names = &mut c.names;
                    let name = *cuda
                        .entry(key)
                        .or_insert_with(|| names.id(&trace.named(&index, &ev).name()));
                    c.thread(&ev).instants.push((ev.start_ns, name));
                }
                trace_kind::COUNTER => {
                    let readings = c.counters.entry((ev.pid, ev.a)).or_default();
                    readings.push((ev.start_ns, ev.b));
                }
                trace_kind::GPU_KERNEL => {
                    let names = &mut c.names;
                    let name = *cuda
                        .entry((ev.kind, ev.pid, ev.a))
                        .or_insert_with(|| names.id(&trace.named(&index, &ev).name()));
                    let on = c.gpu.entry((ev.pid, GpuTrack::of(&ev))).or_default();
                    on.push((ev.start_ns, ev.end_ns, name));
                }
                // A slice among the thread's calls, inside the one it left in.
                trace_kind::OFF_CPU => {
                    let name = trace.named(&index, &ev).name();
                    let func = match away.get(&name) {
                        Some(&f) => f,
                        None => {
                            c.functions.push(Func {
                                name: c.names.id(&name),
                                file: None,
                                line: None,
                            });
                            let f = u32::try_from(c.functions.len() - 1)
                                .expect("fewer than 2^32 functions");
                            away.insert(name, f);
                            f
                        }
                    };
                    let flags = match unfinished(&ev) {
                        true => F_OFF_CPU | F_UNFINISHED,
                        false => F_OFF_CPU,
                    };
                    c.thread(&ev).slices.push(Slice {
                        start: ev.start_ns,
                        end: ev.end_ns,
                        func,
                        flags,
                    });
                }
                // A kind this export does not know: nothing to show for it.
                _ => {}
            }
        }
        Ok(c)
    }

    fn thread(&mut self, ev: &TraceEvent) -> &mut ThreadEvents {
        self.threads.entry((ev.pid, ev.tid)).or_default()
    }

    fn function(
        &mut self,
        trace: &Trace,
        index: &HashMap<(u32, u64, u64), &TraceFunction>,
        ev: &TraceEvent,
    ) -> u32 {
        let named = trace.named(index, ev);
        let known = match named {
            Named::Python { function, .. } => function,
            _ => None,
        };
        self.functions.push(Func {
            name: self.names.id(&named.name()),
            file: known.map(|f| self.files.id(&f.filename)),
            line: known.map(|f| f.firstlineno),
        });
        u32::try_from(self.functions.len() - 1).expect("fewer than 2^32 functions")
    }

    fn interned_data(&self) -> pb::InternedData {
        let interned = |pairs: Vec<(u64, &str)>| -> Vec<pb::Interned> {
            pairs
                .into_iter()
                .map(|(iid, name)| pb::Interned {
                    iid: Some(iid),
                    name: Some(name.to_owned()),
                })
                .collect()
        };
        pb::InternedData {
            event_categories: interned(vec![
                (CAT_PYTHON, "python"),
                (CAT_NATIVE, "native"),
                (CAT_GPU, "gpu"),
                (CAT_OFF_CPU, "off-cpu"),
            ]),
            event_names: interned(self.names.all()),
            debug_annotation_names: interned((1..).zip(ANNOTATIONS).collect()),
            debug_annotation_string_values: interned(self.files.all()),
        }
    }
}

/// Strings by iid, from 1 (0 means "not set" to Perfetto).
#[derive(Default)]
struct Interner {
    ids: HashMap<String, u64>,
}

impl Interner {
    fn id(&mut self, s: &str) -> u64 {
        if let Some(&id) = self.ids.get(s) {
            return id;
        }
        let id = self.ids.len() as u64 + 1;
        self.ids.insert(s.to_owned(), id);
        id
    }

    fn all(&self) -> Vec<(u64, &str)> {
        let mut all: Vec<_> = self.ids.iter().map(|(s, &id)| (id, s.as_str())).collect();
        all.sort_unstable();
        all
    }
}

/// Track uuids: any distinct non-zero numbers; these count up from 1.
struct Tracks {
    processes: BTreeMap<u32, u64>,
    threads: BTreeMap<(u32, u32), u64>,
    counters: BTreeMap<(u32, u64), u64>,
    gpu: BTreeMap<(u32, GpuTrack), u64>,
}

impl Tracks {
    /// A track for every process and thread named or seen in the events.
    fn new(trace: &Trace, ev: &Collected) -> Self {
        let threads: BTreeSet<(u32, u32)> = trace
            .threads
            .iter()
            .map(|t| (t.pid, t.tid))
            .chain(ev.threads.keys().copied())
            .collect();
        let pids: BTreeSet<u32> = trace
            .processes
            .iter()
            .map(|p| p.pid)
            .chain(threads.iter().map(|t| t.0))
            .chain(ev.counters.keys().map(|c| c.0))
            .chain(ev.gpu.keys().map(|g| g.0))
            .collect();
        let mut next = 0u64;
        let mut uuid = || {
            next += 1;
            next
        };
        Self {
            processes: pids.into_iter().map(|p| (p, uuid())).collect(),
            threads: threads.into_iter().map(|t| (t, uuid())).collect(),
            counters: ev.counters.keys().map(|&c| (c, uuid())).collect(),
            gpu: ev.gpu.keys().map(|&g| (g, uuid())).collect(),
        }
    }

    fn descriptors(&self, trace: &Trace) -> Vec<pb::TrackDescriptor> {
        let process_names: HashMap<u32, &str> = trace
            .processes
            .iter()
            .map(|p| (p.pid, p.name.as_str()))
            .collect();
        let thread_names: HashMap<(u32, u32), &str> = trace
            .threads
            .iter()
            .map(|t| ((t.pid, t.tid), t.name.as_str()))
            .collect();
        let named = |n: Option<&&str>| n.filter(|n| !n.is_empty()).map(|n| (*n).to_owned());
        // Linux pids and tids are below 2^22, so they fit Perfetto's int32 pid.
        let pid = |p: u32| Some(p as i32);
        let processes = self
            .processes
            .iter()
            .map(|(&p, &uuid)| pb::TrackDescriptor {
                uuid: Some(uuid),
                process: Some(pb::ProcessDescriptor {
                    pid: pid(p),
                    process_name: named(process_names.get(&p)),
                }),
                ..Default::default()
            });
        let threads = self
            .threads
            .iter()
            .map(|(&(p, t), &uuid)| pb::TrackDescriptor {
                uuid: Some(uuid),
                thread: Some(pb::ThreadDescriptor {
                    pid: pid(p),
                    tid: Some(i64::from(t)),
                    thread_name: named(thread_names.get(&(p, t))),
                }),
                ..Default::default()
            });
        let counters = self.counters.iter().map(|(&(p, c), &uuid)| {
            let counter = usize::try_from(c).ok().and_then(|c| trace.counters.get(c));
            let event = counter.map_or("[unknown counter]", |c| c.event.as_str());
            let (unit, unit_name) = match counter.map(|c| c.unit.as_str()) {
                Some("ns") => (Some(UNIT_TIME_NS), None),
                Some("count") => (Some(UNIT_COUNT), None),
                Some(other) => (None, Some(other.to_owned())),
                None => (None, None),
            };
            pb::TrackDescriptor {
                uuid: Some(uuid),
                name: Some(event.to_owned()),
                parent_uuid: Some(self.processes[&p]),
                counter: Some(pb::CounterDescriptor { unit, unit_name }),
                description: Some(if counter.is_some_and(|c| c.gauge) {
                    format!("{event} (NVML)")
                } else {
                    format!("{event} since the previous reading (perf counter)")
                }),
                ..Default::default()
            }
        });
        let gpu = self
            .gpu
            .iter()
            .map(|(&(p, track), &uuid)| pb::TrackDescriptor {
                uuid: Some(uuid),
                name: Some(track.name()),
                parent_uuid: Some(self.processes[&p]),
                description: Some("kernels as they ran on the GPU (CUPTI)".into()),
                ..Default::default()
            });
        processes
            .chain(threads)
            .chain(counters)
            .chain(gpu)
            .collect()
    }
}

/// Makes CLOCK_MONOTONIC the trace's clock (Perfetto's default is BOOTTIME, which the events
/// cannot be converted to), tied to the wall clock at the session's start.
fn clock_snapshot(trace: &Trace) -> pb::TracePacket {
    let mut clocks = vec![pb::Clock {
        clock_id: Some(CLOCK_MONOTONIC),
        timestamp: Some(trace.start_ns),
    }];
    if trace.start_unix_ns > 0 {
        clocks.push(pb::Clock {
            clock_id: Some(CLOCK_REALTIME),
            timestamp: Some(trace.start_unix_ns),
        });
    }
    pb::TracePacket {
        clock_snapshot: Some(pb::ClockSnapshot {
            clocks,
            primary_trace_clock: Some(CLOCK_MONOTONIC as i32),
        }),
        ..packet()
    }
}

/// A packet on tracer's sequence.
fn packet() -> pb::TracePacket {
    pb::TracePacket {
        trusted_packet_sequence_id: Some(SEQUENCE),
        ..Default::default()
    }
}

/// One thread's calls as nested slices, and its native calls as instants among them.
fn emit_thread(
    w: &mut Packets,
    trace: &Trace,
    functions: &[Func],
    track: u64,
    t: &mut ThreadEvents,
) -> io::Result<()> {
    // Records come in the order calls ended; callers must begin before their callees, and
    // of two calls starting together the longer is the caller.
    t.slices
        .sort_by(|a, b| a.start.cmp(&b.start).then(b.end.cmp(&a.end)));
    t.instants.sort_by_key(|i| i.0);
    let mut instants = t.instants.iter().copied().peekable();
    // An instant at a call's start or end goes inside that call. trace_processor keeps the
    // file's order among packets of equal time, so this order is the one it shows.
    // Ends of the open slices, innermost last.
    let mut open: Vec<u64> = Vec::new();
    for s in &t.slices {
        while let Some(&end) = open.last().filter(|&&end| end <= s.start) {
            w.instants_until(track, &mut instants, |ts| ts <= end)?;
            w.end(track, end)?;
            open.pop();
        }
        // A call outliving its caller would unbalance the slices: cut it at the caller's end.
        let end = s
            .end
            .max(s.start)
            .min(open.last().copied().unwrap_or(u64::MAX));
        w.instants_until(track, &mut instants, |ts| ts < s.start)?;
        w.event(s.start, begin(trace, functions, track, s))?;
        open.push(end);
    }
    while let Some(end) = open.pop() {
        w.instants_until(track, &mut instants, |ts| ts <= end)?;
        w.end(track, end)?;
    }
    w.instants_until(track, &mut instants, |_| true)
}

fn begin(trace: &Trace, functions: &[Func], track: u64, s: &Slice) -> pb::TrackEvent {
    let f = &functions[s.func as usize];
    let flag = |iid| pb::DebugAnnotation {
        name_iid: Some(iid),
        bool_value: Some(true),
        ..Default::default()
    };
    let mut args = Vec::new();
    if let Some(file) = f.file {
        args.push(pb::DebugAnnotation {
            name_iid: Some(ARG_FILE),
            string_value_iid: Some(file),
            ..Default::default()
        });
    }
    if let Some(line) = f.line {
        args.push(pb::DebugAnnotation {
            name_iid: Some(ARG_LINE),
            int_value: Some(i64::from(line)),
            ..Default::default()
        });
    }
    if s.flags & F_EXIT_INFERRED != 0 {
        args.push(flag(ARG_EXIT_INFERRED));
    }
    if s.flags & F_UNFINISHED != 0 {
        args.push(flag(ARG_UNFINISHED));
    }
    if s.start < trace.start_ns {
        args.push(flag(ARG_BEFORE_SESSION));
    }
    let category = match s.flags & F_OFF_CPU {
        0 => CAT_PYTHON,
        _ => CAT_OFF_CPU,
    };
    pb::TrackEvent {
        category_iids: vec![category],
        debug_annotations: args,
        r#type: Some(SLICE_BEGIN),
        name_iid: Some(f.name),
        track_uuid: Some(track),
        ..Default::default()
    }
}

/// Packets gathered into chunks for `out`.
struct Packets<'a> {
    out: &'a mut dyn Write,
    buf: Vec<u8>,
}

impl Packets<'_> {
    /// Appends `Trace.packet` (field 1, length-delimited).
    fn packet(&mut self, p: &pb::TracePacket) -> io::Result<()> {
        encode_key(1, WireType::LengthDelimited, &mut self.buf);
        p.encode_length_delimited(&mut self.buf)
            .expect("a Vec grows as needed");
        if self.buf.len() >= CHUNK {
            self.out.write_all(&self.buf)?;
            self.buf.clear();
        }
        Ok(())
    }

    fn event(&mut self, ts: u64, e: pb::TrackEvent) -> io::Result<()> {
        self.packet(&pb::TracePacket {
            timestamp: Some(ts),
            timestamp_clock_id: Some(CLOCK_MONOTONIC),
            track_event: Some(e),
            sequence_flags: Some(SEQ_NEEDS_INCREMENTAL_STATE),
            ..packet()
        })
    }

    fn end(&mut self, track: u64, ts: u64) -> io::Result<()> {
        self.event(
            ts,
            pb::TrackEvent {
                r#type: Some(SLICE_END),
                track_uuid: Some(track),
                ..Default::default()
            },
        )
    }

    /// Writes the next instants while `before` holds for their times.
    fn instants_until(
        &mut self,
        track: u64,
        instants: &mut Peekable<impl Iterator<Item = (u64, u64)>>,
        before: impl Fn(u64) -> bool,
    ) -> io::Result<()> {
        while let Some((ts, name)) = instants.next_if(|i| before(i.0)) {
            let e = pb::TrackEvent {
                category_iids: vec![CAT_NATIVE],
                r#type: Some(INSTANT),
                name_iid: Some(name),
                track_uuid: Some(track),
                ..Default::default()
            };
            self.event(ts, e)?;
        }
        Ok(())
    }

    fn finish(self) -> io::Result<()> {
        self.out.write_all(&self.buf)?;
        self.out.flush()
    }
}

#[cfg(test)]
mod tests;
