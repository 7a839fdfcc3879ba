//! Chrome's trace event JSON (the "JSON Object Format" that chrome://tracing, Perfetto UI and
//! speedscope open): a complete event ("X") per Python call, per GPU kernel execution and per
//! time a thread spent off the CPU (`--off-cpu`), an
//! instant ("i") per native probe hit or CUDA call, a counter event ("C") per perf counter
//! reading, and names for every process and thread. One track per thread, as the viewers
//! draw `tid`s, and one per (GPU, stream) for kernels as they ran.
//!
//! Times are the host's CLOCK_MONOTONIC in microseconds with nanosecond decimals, so traces
//! of one host line up with each other and with perf's.

use std::{
    collections::HashMap,
    io::{self, BufWriter, Write},
};

use tracer_common::TraceEvent;

use super::us;
use crate::trace::{exit_inferred, unfinished, GpuTrack, Named, Trace};

fn string(s: &str) -> String {
    serde_json::to_string(s).expect("strings serialize")
}

/// Writes the whole trace.
pub fn write(trace: &Trace, out: &mut dyn Write) -> io::Result<()> {
    let mut w = BufWriter::with_capacity(1 << 20, out);
    w.write_all(b"{\"displayTimeUnit\":\"ns\",\"otherData\":{\"clock\":\"CLOCK_MONOTONIC\",")?;
    write!(
        w,
        "\"start_ns\":{},\"end_ns\":{},\"start_unix_ns\":{}}},\n\"traceEvents\":[\n",
        trace.start_ns, trace.end_ns, trace.start_unix_ns
    )?;
    let mut first = true;
    let mut sep = |w: &mut BufWriter<&mut dyn Write>| -> io::Result<()> {
        if !std::mem::take(&mut first) {
            w.write_all(b",\n")?;
        }
        Ok(())
    };
    for p in &trace.processes {
        sep(&mut w)?;
        write!(
            w,
            "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{},\"tid\":{},\"args\":{{\"name\":{}}}}}",
            p.pid,
            p.pid,
            string(&p.name)
        )?;
    }
    for t in &trace.threads {
        sep(&mut w)?;
        write!(
            w,
            "{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{},\"tid\":{},\"args\":{{\"name\":{}}}}}",
            t.pid,
            t.tid,
            string(&t.name)
        )?;
    }
    let functions = trace.function_index();
    // Counters are cumulative; the tracks show what each period added.
    let mut last: HashMap<(u32, u64), u64> = HashMap::new();
    // GPU tracks named as they first appear.
    let mut gpu_tracks: std::collections::HashSet<(u32, GpuTrack)> = Default::default();
    for ev in trace.events()? {
        let ev = ev?;
        let named = trace.named(&functions, &ev);
        sep(&mut w)?;
        match named {
            Named::Python { function, .. } => {
                // A frame from before the session (stale on the stack, or entered before it
                // attached) is drawn from the session's start.
                let start = ev.start_ns.max(trace.start_ns).min(ev.end_ns);
                write!(
                    w,
                    "{{\"ph\":\"X\",\"cat\":\"python\",\"name\":{},\"pid\":{},\"tid\":{},\"ts\":{},\"dur\":{},\"args\":{{",
                    string(&named.name()),
                    ev.pid,
                    ev.tid,
                    us(start),
                    us(ev.end_ns - start)
                )?;
                match function {
                    Some(f) => write!(
                        w,
                        "\"file\":{},\"line\":{}",
                        string(&f.filename),
                        f.firstlineno
                    )?,
                    None => write!(w, "\"code\":\"{:#x}\"", ev.a)?,
                }
                flags(&mut w, &ev, trace)?;
                w.write_all(b"}}")?;
            }
            Named::Native(_) => write!(
                w,
                "{{\"ph\":\"i\",\"s\":\"t\",\"cat\":\"native\",\"name\":{},\"pid\":{},\"tid\":{},\"ts\":{}}}",
                string(&named.name()),
                ev.pid,
                ev.tid,
                us(ev.start_ns)
            )?,
            Named::Counter(c) => {
                let prev = last.insert((ev.pid, ev.a), ev.b).unwrap_or(0);
                let unit = c.map_or("", |c| c.unit.as_str());
                // Levels (GPU metrics) as read; running totals as what each period added.
                let (label, value) = match c {
                    Some(c) if c.gauge => (unit, ev.b),
                    _ if unit == "ns" => ("ns per period", ev.b.saturating_sub(prev)),
                    _ => ("per period", ev.b.saturating_sub(prev)),
                };
                write!(
                    w,
                    "{{\"ph\":\"C\",\"cat\":\"counter\",\"name\":{},\"pid\":{},\"tid\":{},\"ts\":{},\"args\":{{{}:{}}}}}",
                    string(&named.name()),
                    ev.pid,
                    ev.pid,
                    us(ev.start_ns),
                    string(label),
                    value
                )?;
            }
            Named::CudaLaunch(row, api) => {
                write!(
                    w,
                    "{{\"ph\":\"i\",\"s\":\"t\",\"cat\":\"cuda\",\"name\":{},\"pid\":{},\"tid\":{},\"ts\":{},\"args\":{{\"api\":{},\"handle\":\"{:#x}\"",
                    string(&named.name()),
                    ev.pid,
                    ev.tid,
                    us(ev.start_ns),
                    string(tracer_common::cuda_api::name(api)),
                    ev.a,
                )?;
                if let Some(l) = row {
                    launch_args(&mut w, l)?;
                }
                w.write_all(b"}}")?;
            }
            Named::CudaMemory(_) => write!(
                w,
                "{{\"ph\":\"i\",\"s\":\"t\",\"cat\":\"cuda\",\"name\":{},\"pid\":{},\"tid\":{},\"ts\":{},\"args\":{{\"bytes\":{}}}}}",
                string(&named.name()),
                ev.pid,
                ev.tid,
                us(ev.start_ns),
                ev.a
            )?,
            Named::GpuKernel(_, track) => {
                if gpu_tracks.insert((ev.pid, track)) {
                    write!(
                        w,
                        "{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{},\"tid\":{},\"args\":{{\"name\":{}}}}},",
                        ev.pid,
                        track.tid(),
                        string(&track.name())
                    )?;
                    w.write_all(b"\n")?;
                }
                write!(
                    w,
                    "{{\"ph\":\"X\",\"cat\":\"gpu\",\"name\":{},\"pid\":{},\"tid\":{},\"ts\":{},\"dur\":{},\"args\":{{\"device\":{},\"stream\":{}}}}}",
                    string(&named.name()),
                    ev.pid,
                    track.tid(),
                    us(ev.start_ns),
                    us(ev.end_ns.saturating_sub(ev.start_ns)),
                    track.device,
                    track.stream
                )?;
            }
            // Inside the call it left in: the thread ran no call's start or end meanwhile.
            Named::OffCpu(_) => write!(
                w,
                "{{\"ph\":\"X\",\"cat\":\"off-cpu\",\"name\":{},\"pid\":{},\"tid\":{},\"ts\":{},\"dur\":{},\"args\":{{\"unfinished\":{}}}}}",
                string(&named.name()),
                ev.pid,
                ev.tid,
                us(ev.start_ns),
                us(ev.end_ns.saturating_sub(ev.start_ns)),
                unfinished(&ev)
            )?,
            Named::Unknown => write!(
                w,
                "{{\"ph\":\"i\",\"s\":\"t\",\"name\":\"[unknown event kind {}]\",\"pid\":{},\"tid\":{},\"ts\":{}}}",
                ev.kind,
                ev.pid,
                ev.tid,
                us(ev.start_ns)
            )?,
        }
    }
    w.write_all(b"\n]}\n")?;
    w.flush()
}

/// A launch's configuration and call sites, from its row.
fn launch_args(w: &mut impl Write, l: &crate::CudaLaunch) -> io::Result<()> {
    let dim = |d: [u32; 3]| format!("[{},{},{}]", d[0], d[1], d[2]);
    write!(
        w,
        ",\"stream\":\"{:#x}\",\"grid\":{},\"block\":{},\"shared_mem\":{}",
        l.stream,
        dim(l.grid),
        dim(l.block),
        l.shared_mem
    )?;
    for (key, value) in [
        ("call_site", &l.call_site),
        ("caller", &l.caller),
        ("named_from", &l.named_from),
    ] {
        if !value.is_empty() {
            write!(w, ",\"{key}\":{}", string(value))?;
        }
    }
    Ok(())
}

fn flags(w: &mut impl Write, ev: &TraceEvent, trace: &Trace) -> io::Result<()> {
    if exit_inferred(ev) {
        w.write_all(b",\"exit_inferred\":true")?;
    }
    if unfinished(ev) {
        w.write_all(b",\"unfinished\":true")?;
    }
    if ev.start_ns < trace.start_ns {
        write!(
            w,
            ",\"began_before_session\":true,\"start_ns\":{}",
            ev.start_ns
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{as_bytes, TraceFunction, TraceThread};
    use tracer_common::{trace_kind, TRACE_EXIT_INFERRED};

    fn call(tid: u32, start: u64, end: u64, code: u64) -> TraceEvent {
        TraceEvent {
            kind: trace_kind::PY_CALL,
            pid: 10,
            tid,
            start_ns: start,
            end_ns: end,
            a: code,
            b: code + 1,
            ..TraceEvent::default()
        }
    }

    #[test]
    fn calls_counters_and_names_parse_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.events");
        let mut inferred = call(11, 1_500, 2_000, 0x30);
        inferred.flags = TRACE_EXIT_INFERRED;
        let events = [
            call(11, 1_200, 1_300, 0x20),
            inferred,
            call(11, 1_000, 3_000, 0x10),
            TraceEvent {
                kind: trace_kind::COUNTER,
                pid: 10,
                start_ns: 2_000,
                a: 0,
                b: 5,
                ..TraceEvent::default()
            },
            TraceEvent {
                kind: trace_kind::COUNTER,
                pid: 10,
                start_ns: 3_000,
                a: 0,
                b: 12,
                ..TraceEvent::default()
            },
            TraceEvent {
                kind: trace_kind::NATIVE_CALL,
                pid: 10,
                tid: 12,
                start_ns: 2_500,
                a: 0,
                ..TraceEvent::default()
            },
        ];
        std::fs::write(&path, as_bytes(&events)).unwrap();
        let f = |code: u64, q: &str| TraceFunction {
            pid: 10,
            code,
            names: code + 1,
            qualname: q.into(),
            filename: "a \"quoted\" file.py".into(),
            firstlineno: 3,
        };
        let trace = Trace {
            path,
            start_ns: 1_000,
            end_ns: 3_000,
            functions: vec![f(0x10, "main"), f(0x20, "leaf")],
            probes: vec!["/lib/libc.so.6:malloc".into()],
            counters: vec![crate::trace::TraceCounter {
                gauge: false,
                event: "page-faults".into(),
                unit: "count".into(),
            }],
            processes: vec![TraceThread {
                pid: 10,
                tid: 10,
                name: "python3".into(),
            }],
            threads: vec![TraceThread {
                pid: 10,
                tid: 11,
                name: "worker".into(),
            }],
            ..Trace::default()
        };
        let mut out = Vec::new();
        write(&trace, &mut out).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let evs = v["traceEvents"].as_array().unwrap();
        let by = |ph: &str| evs.iter().filter(|e| e["ph"] == ph).collect::<Vec<_>>();
        let x = by("X");
        assert_eq!(x.len(), 3);
        assert_eq!(x[0]["name"], "leaf");
        assert_eq!(x[0]["ts"].as_f64(), Some(1.2));
        assert_eq!(x[0]["dur"].as_f64(), Some(0.1));
        assert_eq!(x[0]["args"]["file"], "a \"quoted\" file.py");
        assert_eq!(x[1]["name"], "[code object 0x30]");
        assert_eq!(x[1]["args"]["exit_inferred"], true);
        assert_eq!(x[2]["name"], "main");
        let c: Vec<u64> = by("C")
            .iter()
            .map(|e| e["args"]["per period"].as_u64().unwrap())
            .collect();
        assert_eq!(c, [5, 7]);
        assert_eq!(by("i")[0]["name"], "/lib/libc.so.6:malloc");
        assert_eq!(by("M").len(), 2);
    }
}
