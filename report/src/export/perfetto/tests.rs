//! The exporter's output is read back with a protobuf wire reader written here, not with
//! the prost structs that wrote it, so a wrong field number shows up as a failed check.
use std::collections::{BTreeMap, HashMap};

use super::*;
use crate::trace::{as_bytes, TraceCounter, TraceThread};

/// One field's value: varints and fixed-width numbers as integers.
#[derive(Clone, Copy, Debug)]
enum V<'a> {
    Int(u64),
    Bytes(&'a [u8]),
}

fn varint(b: &[u8], i: &mut usize) -> u64 {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = b[*i];
        *i += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return v;
        }
    }
    panic!("varint longer than 10 bytes");
}

/// A message's fields in order, as (field number, value).
fn fields(b: &[u8]) -> Vec<(u64, V<'_>)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let key = varint(b, &mut i);
        let value = match key & 7 {
            0 => V::Int(varint(b, &mut i)),
            1 => {
                i += 8;
                V::Int(u64::from_le_bytes(b[i - 8..i].try_into().unwrap()))
            }
            2 => {
                let len = varint(b, &mut i) as usize;
                i += len;
                V::Bytes(&b[i - len..i])
            }
            5 => {
                i += 4;
                V::Int(u64::from(u32::from_le_bytes(
                    b[i - 4..i].try_into().unwrap(),
                )))
            }
            t => panic!("wire type {t} at byte {i}"),
        };
        out.push((key >> 3, value));
    }
    assert_eq!(i, b.len(), "message overruns its bytes");
    out
}

fn int(f: &[(u64, V)], n: u64) -> Option<u64> {
    f.iter().rev().find_map(|(k, v)| match v {
        V::Int(x) if *k == n => Some(*x),
        _ => None,
    })
}

fn all_bytes<'a>(f: &[(u64, V<'a>)], n: u64) -> Vec<&'a [u8]> {
    f.iter()
        .filter_map(|(k, v)| match v {
            V::Bytes(b) if *k == n => Some(*b),
            _ => None,
        })
        .collect()
}

fn msg<'a>(f: &[(u64, V<'a>)], n: u64) -> Option<Vec<(u64, V<'a>)>> {
    all_bytes(f, n).last().map(|b| fields(b))
}

fn string(f: &[(u64, V)], n: u64) -> Option<String> {
    all_bytes(f, n)
        .last()
        .map(|b| String::from_utf8(b.to_vec()).unwrap())
}

/// iid → string for one kind of interned data.
fn interned(d: &[(u64, V)], n: u64, into: &mut HashMap<u64, String>) {
    for e in all_bytes(d, n) {
        let e = fields(e);
        into.insert(int(&e, 1).unwrap(), string(&e, 2).unwrap());
    }
}

#[derive(Debug, Default)]
struct Track {
    pid: Option<u64>,
    tid: Option<u64>,
    is_process: bool,
    name: Option<String>,
    parent: Option<u64>,
    unit: Option<u64>,
}

#[derive(Debug)]
struct Event {
    ts: u64,
    track: u64,
    ty: u64,
    name: Option<String>,
    categories: Vec<String>,
    counter: Option<i64>,
    args: BTreeMap<String, String>,
}

#[derive(Debug, Default)]
struct Decoded {
    tracks: HashMap<u64, Track>,
    events: Vec<Event>,
    primary_clock: Option<u64>,
    clocks: BTreeMap<u64, u64>,
}

fn decode(bytes: &[u8]) -> Decoded {
    let mut d = Decoded::default();
    let (mut names, mut cats, mut arg_names, mut strings) = Default::default();
    let mut interned_seen = false;
    for (n, p) in fields(bytes) {
        assert_eq!(n, 1, "Trace has only `packet` fields");
        let V::Bytes(p) = p else {
            panic!("packet not length-delimited")
        };
        let p = fields(p);
        assert_eq!(int(&p, 10), Some(1), "trusted_packet_sequence_id");
        if let Some(c) = msg(&p, 6) {
            d.primary_clock = int(&c, 2);
            for clock in all_bytes(&c, 1) {
                let clock = fields(clock);
                d.clocks
                    .insert(int(&clock, 1).unwrap(), int(&clock, 2).unwrap());
            }
        }
        if let Some(i) = msg(&p, 12) {
            assert_eq!(int(&p, 13), Some(1), "interned data clears the state");
            interned(&i, 1, &mut cats);
            interned(&i, 2, &mut names);
            interned(&i, 3, &mut arg_names);
            interned(&i, 29, &mut strings);
            interned_seen = true;
        }
        if let Some(t) = msg(&p, 60) {
            let process = msg(&t, 3);
            let thread = msg(&t, 4);
            let track = Track {
                pid: process
                    .as_ref()
                    .and_then(|p| int(p, 1))
                    .or(thread.as_ref().and_then(|t| int(t, 1))),
                tid: thread.as_ref().and_then(|t| int(t, 2)),
                is_process: process.is_some(),
                name: string(&t, 2)
                    .or(process.as_ref().and_then(|p| string(p, 6)))
                    .or(thread.as_ref().and_then(|t| string(t, 5))),
                parent: int(&t, 5),
                unit: msg(&t, 8).and_then(|c| int(&c, 3)),
            };
            let uuid = int(&t, 1).unwrap();
            assert!(d.tracks.insert(uuid, track).is_none(), "uuid {uuid} twice");
        }
        if let Some(e) = msg(&p, 11) {
            assert!(interned_seen, "interned data comes first");
            assert_eq!(int(&p, 58), Some(3), "events on CLOCK_MONOTONIC");
            assert_eq!(int(&p, 13), Some(2), "events need the interned state");
            let track = int(&e, 11).unwrap();
            assert!(d.tracks.contains_key(&track), "event on undeclared track");
            let mut args = BTreeMap::new();
            for a in all_bytes(&e, 4) {
                let a = fields(a);
                let value = match (int(&a, 17), int(&a, 4), int(&a, 2)) {
                    (Some(s), _, _) => strings[&s].clone(),
                    (_, Some(i), _) => (i as i64).to_string(),
                    (_, _, Some(b)) => (b != 0).to_string(),
                    _ => panic!("annotation without value"),
                };
                args.insert(arg_names[&int(&a, 1).unwrap()].clone(), value);
            }
            d.events.push(Event {
                ts: int(&p, 8).unwrap(),
                track,
                ty: int(&e, 9).unwrap(),
                name: int(&e, 10).map(|iid| names[&iid].clone()),
                // Unpacked: one varint field per category.
                categories: f_ints(&e, 3).map(|c| cats[&c].clone()).collect(),
                counter: int(&e, 30).map(|v| v as i64),
                args,
            });
        }
    }
    d
}

fn f_ints<'a>(f: &'a [(u64, V)], n: u64) -> impl Iterator<Item = u64> + 'a {
    f.iter().filter_map(move |(k, v)| match v {
        V::Int(x) if *k == n => Some(*x),
        V::Bytes(_) if *k == n => panic!("field {n} packed"),
        _ => None,
    })
}

/// A finished slice: (name, begin, end, depth, args), and instants as (name, time,
/// innermost open slice).
type Slices = Vec<(String, u64, u64, usize, Args)>;
type Instants = Vec<(String, u64, Option<String>)>;
type Args = BTreeMap<String, String>;

/// Checks each track's order and nesting; returns its slices and instants by track.
fn per_track(d: &Decoded) -> HashMap<u64, (Slices, Instants)> {
    let mut out: HashMap<u64, (Slices, Instants)> = HashMap::new();
    // Open slices per track: (name, begin, args).
    let mut open: HashMap<u64, Vec<(String, u64, Args)>> = HashMap::new();
    let mut last: HashMap<u64, u64> = HashMap::new();
    for e in &d.events {
        let prev = last.insert(e.track, e.ts).unwrap_or(0);
        assert!(e.ts >= prev, "time goes back on track {}: {e:?}", e.track);
        let stack = open.entry(e.track).or_default();
        let (slices, instants) = out.entry(e.track).or_default();
        match e.ty {
            1 => stack.push((e.name.clone().unwrap(), e.ts, e.args.clone())),
            2 => {
                let depth = stack.len() - 1;
                let (name, begin, args) = stack.pop().expect("SLICE_END with none open");
                slices.push((name, begin, e.ts, depth, args));
            }
            3 => instants.push((
                e.name.clone().unwrap(),
                e.ts,
                stack.last().map(|s| s.0.clone()),
            )),
            4 => {}
            t => panic!("event type {t}"),
        }
    }
    for (track, stack) in open {
        assert!(
            stack.is_empty(),
            "slices left open on track {track}: {stack:?}"
        );
    }
    out
}

fn py(pid: u32, tid: u32, code: u64, start: u64, end: u64, flags: u16) -> TraceEvent {
    TraceEvent {
        kind: trace_kind::PY_CALL,
        flags,
        pid,
        tid,
        start_ns: start,
        end_ns: end,
        a: code,
        b: code << 4,
        ..TraceEvent::default()
    }
}

fn other(kind: u16, pid: u32, tid: u32, ts: u64, a: u64, b: u64) -> TraceEvent {
    TraceEvent {
        kind,
        pid,
        tid,
        start_ns: ts,
        end_ns: ts,
        a,
        b,
        ..TraceEvent::default()
    }
}

fn function(pid: u32, code: u64, qualname: &str, firstlineno: i32) -> TraceFunction {
    TraceFunction {
        pid,
        code,
        names: code << 4,
        qualname: qualname.into(),
        filename: "/srv/app.py".into(),
        firstlineno,
    }
}

fn thread(pid: u32, tid: u32, name: &str) -> TraceThread {
    TraceThread {
        pid,
        tid,
        name: name.into(),
    }
}

fn export(trace: &mut Trace, events: &[TraceEvent]) -> (tempfile::TempDir, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    trace.path = dir.path().join("t.events");
    std::fs::write(&trace.path, as_bytes(events)).unwrap();
    let mut out = Vec::new();
    write(trace, &mut out).unwrap();
    (dir, out)
}

fn args(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

#[test]
fn nested_slices_instants_and_counters_read_back() {
    use tracer_common::{TRACE_EXIT_INFERRED, TRACE_UNFINISHED};
    let mut trace = Trace {
        start_ns: 1000,
        end_ns: 10_000,
        start_unix_ns: 1_700_000_000_000_000_000,
        functions: vec![
            function(10, 1, "main", 1),
            function(10, 2, "work", 10),
            function(10, 3, "helper", 20),
            function(10, 4, "raises", 30),
            function(10, 5, "worker_loop", 40),
        ],
        probes: vec!["libc.so.6:malloc".into()],
        counters: vec![
            TraceCounter {
                event: "page-faults".into(),
                unit: "count".into(),
                gauge: false,
            },
            TraceCounter {
                event: "task-clock".into(),
                unit: "ns".into(),
                gauge: false,
            },
        ],
        processes: vec![thread(10, 10, "python3"), thread(20, 20, "python3.12")],
        threads: vec![thread(10, 10, "MainThread"), thread(10, 11, "worker")],
        ..Trace::default()
    };
    // In the order calls ended: callees first.
    let events = [
        py(10, 10, 3, 1200, 1300, 0),
        other(trace_kind::NATIVE_CALL, 10, 10, 1250, 0, 0),
        // At a call's end or start: inside that call.
        other(trace_kind::NATIVE_CALL, 10, 10, 1300, 0, 0),
        other(trace_kind::NATIVE_CALL, 10, 10, 1400, 0, 0),
        py(10, 10, 4, 1400, 1500, TRACE_EXIT_INFERRED),
        other(trace_kind::COUNTER, 10, 10, 2500, 0, 25),
        py(10, 10, 2, 1100, 1600, 0),
        // Started before the session.
        py(10, 10, 1, 900, 2000, 0),
        other(trace_kind::NATIVE_CALL, 10, 10, 2500, 0, 0),
        // Outlives its caller (3000..3500): cut at 3500.
        py(10, 11, 2, 3100, 3900, 0),
        py(10, 11, 5, 3000, 3500, 0),
        other(trace_kind::COUNTER, 10, 10, 1500, 0, 10),
        other(trace_kind::COUNTER, 20, 20, 1500, 0, 7),
        other(trace_kind::COUNTER, 10, 10, 1500, 1, 1_000_000),
        py(10, 11, 5, 4000, 10_000, TRACE_UNFINISHED),
        // No name known.
        py(20, 20, 6, 5000, 5100, 0),
    ];
    let (_dir, out) = export(&mut trace, &events);
    let d = decode(&out);

    assert_eq!(d.primary_clock, Some(3));
    assert_eq!(
        d.clocks,
        BTreeMap::from([(3, 1000), (1, 1_700_000_000_000_000_000)])
    );

    // Tracks: each process and thread, under the right names.
    let find = |pid: u64, tid: Option<u64>| {
        let (uuid, t) = d
            .tracks
            .iter()
            .find(|(_, t)| t.pid == Some(pid) && t.tid == tid && (tid.is_some() || t.is_process))
            .unwrap_or_else(|| panic!("no track for {pid}/{tid:?}"));
        (*uuid, t.name.clone())
    };
    assert_eq!(find(10, None).1.as_deref(), Some("python3"));
    assert_eq!(find(20, None).1.as_deref(), Some("python3.12"));
    let (main, name) = find(10, Some(10));
    assert_eq!(name.as_deref(), Some("MainThread"));
    let (worker, name) = find(10, Some(11));
    assert_eq!(name.as_deref(), Some("worker"));
    let (other_thread, name) = find(20, Some(20));
    assert_eq!(name, None);
    for e in &d.events {
        let t = &d.tracks[&e.track];
        let pid = t
            .pid
            .or(t.parent.map(|p| d.tracks[&p].pid.unwrap()))
            .unwrap();
        find(pid, None);
    }

    let tracks = per_track(&d);
    let file = ("file", "/srv/app.py");
    let mut main_slices = tracks[&main].0.clone();
    main_slices.sort_by_key(|s| s.1);
    assert_eq!(
        main_slices,
        vec![
            (
                "main".into(),
                900,
                2000,
                0,
                args(&[file, ("line", "1"), ("began_before_session", "true")])
            ),
            ("work".into(), 1100, 1600, 1, args(&[file, ("line", "10")])),
            (
                "helper".into(),
                1200,
                1300,
                2,
                args(&[file, ("line", "20")])
            ),
            (
                "raises".into(),
                1400,
                1500,
                2,
                args(&[file, ("line", "30"), ("exit_inferred", "true")])
            ),
        ]
    );
    assert_eq!(
        tracks[&main].1,
        vec![
            ("libc.so.6:malloc".into(), 1250, Some("helper".into())),
            ("libc.so.6:malloc".into(), 1300, Some("helper".into())),
            ("libc.so.6:malloc".into(), 1400, Some("raises".into())),
            ("libc.so.6:malloc".into(), 2500, None),
        ]
    );
    let mut worker_slices = tracks[&worker].0.clone();
    worker_slices.sort_by_key(|s| s.1);
    assert_eq!(
        worker_slices,
        vec![
            (
                "worker_loop".into(),
                3000,
                3500,
                0,
                args(&[file, ("line", "40")])
            ),
            ("work".into(), 3100, 3500, 1, args(&[file, ("line", "10")])),
            (
                "worker_loop".into(),
                4000,
                10_000,
                0,
                args(&[file, ("line", "40"), ("unfinished", "true")])
            ),
        ]
    );
    assert_eq!(
        tracks[&other_thread].0,
        vec![("[code object 0x6]".into(), 5000, 5100, 0, BTreeMap::new())]
    );
    let categories: Vec<_> = d
        .events
        .iter()
        .filter(|e| e.ty == 1 || e.ty == 3)
        .map(|e| (e.ty, e.categories.clone()))
        .collect();
    assert!(categories
        .iter()
        .all(|(ty, c)| *c == [if *ty == 1 { "python" } else { "native" }]));

    // Counters: per process and counter, deltas between readings in time order.
    let counter = |pid: u64, name: &str| {
        let (&uuid, t) = d
            .tracks
            .iter()
            .find(|(_, t)| {
                t.name.as_deref() == Some(name)
                    && t.parent.is_some_and(|p| d.tracks[&p].pid == Some(pid))
            })
            .unwrap_or_else(|| panic!("no {name} track for {pid}"));
        let values: Vec<_> = d
            .events
            .iter()
            .filter(|e| e.track == uuid)
            .map(|e| {
                assert_eq!(e.ty, 4);
                (e.ts, e.counter.unwrap())
            })
            .collect();
        (t.unit, values)
    };
    assert_eq!(
        counter(10, "page-faults"),
        (Some(2), vec![(1500, 10), (2500, 15)])
    );
    assert_eq!(counter(20, "page-faults"), (Some(2), vec![(1500, 7)]));
    assert_eq!(
        counter(10, "task-clock"),
        (Some(1), vec![(1500, 1_000_000)])
    );
}

#[test]
fn equal_times_and_odd_records_stay_balanced() {
    let mut trace = Trace {
        start_ns: 0,
        functions: vec![function(1, 1, "a", 1), function(1, 2, "b", 2)],
        ..Trace::default()
    };
    let events = [
        // Zero-length calls, a sibling starting where one ends, twin records, an end
        // before its start, and overlapping calls.
        py(1, 1, 1, 100, 100, 0),
        py(1, 1, 2, 100, 200, 0),
        py(1, 1, 1, 200, 300, 0),
        py(1, 1, 1, 200, 300, 0),
        py(1, 1, 2, 350, 340, 0),
        py(1, 1, 1, 400, 600, 0),
        py(1, 1, 2, 500, 700, 0),
        py(1, 1, 2, 650, 800, 0),
        // A callee starting in the same nanosecond as its caller.
        py(1, 1, 2, 900, 950, 0),
        py(1, 1, 1, 900, 1000, 0),
        other(99, 1, 1, 10, 0, 0),
    ];
    let (_dir, out) = export(&mut trace, &events);
    let d = decode(&out);
    let tracks = per_track(&d);
    assert_eq!(tracks.len(), 1);
    let mut slices: Vec<_> = tracks
        .values()
        .next()
        .unwrap()
        .0
        .iter()
        .map(|s| (s.0.as_str(), s.1, s.2, s.3))
        .collect();
    slices.sort_by_key(|s| (s.1, s.3));
    assert_eq!(
        slices,
        [
            ("b", 100, 200, 0),
            ("a", 100, 100, 1),
            ("a", 200, 300, 0),
            ("a", 200, 300, 1),
            ("b", 350, 350, 0),
            ("a", 400, 600, 0),
            ("b", 500, 600, 1),
            ("b", 650, 800, 0),
            ("a", 900, 1000, 0),
            ("b", 900, 950, 1),
        ]
    );
}

#[test]
fn empty_trace_is_a_valid_trace() {
    let (_dir, out) = export(&mut Trace::default(), &[]);
    let d = decode(&out);
    assert!(d.events.is_empty() && d.tracks.is_empty());
    assert_eq!(d.primary_clock, Some(3));
}

#[test]
fn gpu_kernels_are_slices_on_a_track_per_stream() {
    let gpu = |start: u64, end: u64, name: u64, stream: u64| TraceEvent {
        kind: trace_kind::GPU_KERNEL,
        pid: 7,
        tid: 99, // CUPTI's thread: not where the slices go
        start_ns: start,
        end_ns: end,
        a: name,
        b: stream,
        ..TraceEvent::default()
    };
    let mut trace = Trace {
        gpu_kernel_names: vec![crate::trace::TraceGpuKernel {
            pid: 7,
            name: 0xa0,
            kernel: "relu(float*, int)".into(),
        }],
        processes: vec![thread(7, 7, "python3")],
        ..Trace::default()
    };
    let events = [
        // Out of order, and one overlapping the one before it on its stream.
        gpu(300, 400, 0xa0, 13),
        gpu(100, 250, 0xa0, 13),
        gpu(200, 260, 0xb0, 13),
        gpu(150, 180, 0xa0, 1 << 32 | 14),
    ];
    let (_dir, out) = export(&mut trace, &events);
    let d = decode(&out);
    let tracks = per_track(&d);
    let process = d.tracks.iter().find(|(_, t)| t.is_process).map(|(u, _)| *u);
    let track = |name: &str| {
        let (uuid, t) = d
            .tracks
            .iter()
            .find(|(_, t)| t.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no track {name}"));
        assert_eq!(t.parent, process, "{name} belongs to its process");
        *uuid
    };
    let slices = |uuid: u64| -> Vec<(String, u64, u64)> {
        tracks[&uuid]
            .0
            .iter()
            .map(|s| (s.0.clone(), s.1, s.2))
            .collect()
    };
    assert_eq!(
        slices(track("GPU 0 stream 13")),
        [
            ("relu(float*, int)".into(), 100, 250),
            // Cut to start where the one before ended: slices on a track must not overlap.
            ("[GPU kernel]".into(), 250, 260),
            ("relu(float*, int)".into(), 300, 400),
        ]
    );
    assert_eq!(
        slices(track("GPU 1 stream 14")),
        [("relu(float*, int)".into(), 150, 180)]
    );
    assert!(d
        .events
        .iter()
        .filter(|e| e.ty == 1)
        .all(|e| e.categories == ["gpu"]));
}
