//! Reading exported traces back in tests: Chrome JSON with serde_json, Perfetto's protobuf
//! with a small wire-format reader written here from the format's documentation (not the
//! exporter's code).

use std::collections::HashMap;

use serde_json::Value;

/// A Python call as a Chrome trace shows it.
#[derive(Clone, Debug)]
pub struct Slice {
    pub name: String,
    pub file: String,
    pub line: i64,
    pub pid: u64,
    pub tid: u64,
    pub start_ns: u64,
    pub end_ns: u64,
    pub before_session: bool,
}

fn ns(us: &Value) -> u64 {
    (us.as_f64().expect("a number of microseconds") * 1000.0).round() as u64
}

/// The complete ("X") events of a Chrome trace.
pub fn chrome_slices(trace: &Value) -> Vec<Slice> {
    trace["traceEvents"]
        .as_array()
        .expect("traceEvents")
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            let start_ns = ns(&e["ts"]);
            Slice {
                name: e["name"].as_str().unwrap().to_owned(),
                file: e["args"]["file"].as_str().unwrap_or("").to_owned(),
                line: e["args"]["line"].as_i64().unwrap_or(0),
                pid: e["pid"].as_u64().unwrap(),
                tid: e["tid"].as_u64().unwrap(),
                start_ns,
                end_ns: start_ns + ns(&e["dur"]),
                before_session: e["args"]["began_before_session"] == true,
            }
        })
        .collect()
}

/// Asserts that each thread's slices nest: any two are disjoint or one holds the other.
pub fn assert_nested(slices: &[Slice]) {
    let mut by_thread: HashMap<u64, Vec<&Slice>> = HashMap::new();
    for s in slices {
        by_thread.entry(s.tid).or_default().push(s);
    }
    for (tid, mut list) in by_thread {
        list.sort_by_key(|s| (s.start_ns, std::cmp::Reverse(s.end_ns)));
        let mut open: Vec<&Slice> = Vec::new();
        for s in list {
            while open.last().is_some_and(|top| top.end_ns <= s.start_ns) {
                open.pop();
            }
            if let Some(top) = open.last() {
                assert!(
                    s.end_ns <= top.end_ns,
                    "thread {tid}: {} [{}, {}] overlaps its caller {} [{}, {}] without nesting",
                    s.name,
                    s.start_ns,
                    s.end_ns,
                    top.name,
                    top.start_ns,
                    top.end_ns
                );
            }
            open.push(s);
        }
    }
}

/// One protobuf field: its number and either a varint or bytes.
enum Field<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

fn varint(buf: &[u8], pos: &mut usize) -> u64 {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = buf[*pos];
        *pos += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            break;
        }
    }
    v
}

fn fields(buf: &[u8]) -> Vec<(u64, Field<'_>)> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < buf.len() {
        let key = varint(buf, &mut pos);
        let field = match key & 7 {
            0 => Field::Varint(varint(buf, &mut pos)),
            2 => {
                let len = varint(buf, &mut pos) as usize;
                pos += len;
                Field::Bytes(&buf[pos - len..pos])
            }
            1 => {
                pos += 8;
                Field::Fixed
            }
            5 => {
                pos += 4;
                Field::Fixed
            }
            t => panic!("wire type {t} at byte {pos}"),
        };
        out.push((key >> 3, field));
    }
    out
}

/// What a Perfetto trace holds, per track: slice begins and ends, instants, counter values,
/// and the descriptors of the tracks.
#[derive(Default, Debug)]
pub struct PerfettoSummary {
    pub begins: u64,
    pub ends: u64,
    pub instants: u64,
    pub counter_values: u64,
    /// Track uuid → (pid, tid) of thread tracks.
    pub thread_tracks: HashMap<u64, (u64, u64)>,
    /// Deepest nesting seen on any track.
    pub max_depth: usize,
}

/// Reads a Perfetto `Trace` (TracePacket = 1; in a packet timestamp = 8, track_event = 11,
/// track_descriptor = 60; TrackEvent type = 9, track_uuid = 11; TrackDescriptor uuid = 1,
/// thread = 4 with pid = 1, tid = 2) and checks that each track's slices are balanced and
/// in time order.
pub fn perfetto_summary(bytes: &[u8]) -> PerfettoSummary {
    let mut s = PerfettoSummary::default();
    let mut open: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut last_ts: HashMap<u64, u64> = HashMap::new();
    for (n, f) in fields(bytes) {
        let Field::Bytes(packet) = f else { continue };
        assert_eq!(n, 1, "a Trace holds packets only");
        let mut ts = None;
        for (n, f) in fields(packet) {
            match (n, f) {
                (8, Field::Varint(t)) => ts = Some(t),
                (60, Field::Bytes(desc)) => {
                    let mut uuid = 0;
                    let mut thread = None;
                    for (n, f) in fields(desc) {
                        match (n, f) {
                            (1, Field::Varint(u)) => uuid = u,
                            (4, Field::Bytes(t)) => {
                                let (mut pid, mut tid) = (0, 0);
                                for (n, f) in fields(t) {
                                    match (n, f) {
                                        (1, Field::Varint(v)) => pid = v,
                                        (2, Field::Varint(v)) => tid = v,
                                        _ => {}
                                    }
                                }
                                thread = Some((pid, tid));
                            }
                            _ => {}
                        }
                    }
                    if let Some(t) = thread {
                        s.thread_tracks.insert(uuid, t);
                    }
                }
                (11, Field::Bytes(ev)) => {
                    let (mut kind, mut track) = (0, 0);
                    for (n, f) in fields(ev) {
                        match (n, f) {
                            (9, Field::Varint(k)) => kind = k,
                            (11, Field::Varint(u)) => track = u,
                            _ => {}
                        }
                    }
                    let ts = ts.expect("track events carry a timestamp");
                    let last = last_ts.entry(track).or_insert(0);
                    assert!(
                        ts >= *last,
                        "track {track}: time went back from {last} to {ts}"
                    );
                    *last = ts;
                    let stack = open.entry(track).or_default();
                    match kind {
                        1 => {
                            s.begins += 1;
                            stack.push(ts);
                            s.max_depth = s.max_depth.max(stack.len());
                        }
                        2 => {
                            s.ends += 1;
                            let begun = stack.pop().unwrap_or_else(|| {
                                panic!("track {track}: a slice ends at {ts} that never began")
                            });
                            assert!(begun <= ts);
                        }
                        3 => s.instants += 1,
                        4 => s.counter_values += 1,
                        k => panic!("unknown track event type {k}"),
                    }
                }
                _ => {}
            }
        }
    }
    for (track, stack) in open {
        assert!(
            stack.is_empty(),
            "track {track}: {} slices never end",
            stack.len()
        );
    }
    s
}
