//! Merging tracing sessions' Chrome traces from many hosts onto one timeline: each host's
//! processes become process groups named after the host, and each host's CLOCK_MONOTONIC
//! times move onto this machine's wall clock (through the trace's own monotonic/wall pair
//! and the host's measured clock difference).

use anyhow::{Context, Result};
use serde_json::{json, Value};

pub struct HostTrace {
    pub host: String,
    /// The host's wall clock minus this machine's, ns.
    pub offset_ns: i64,
    /// Its Chrome trace JSON, as tracerd exports it.
    pub json: Vec<u8>,
}

/// Processes of host `i` get pids `(i + 1) * PID_BASE + pid`: Linux pids stay below 2^22.
const PID_BASE: u64 = 10_000_000;

pub fn chrome(traces: &[HostTrace]) -> Result<Vec<u8>> {
    let mut parsed = Vec::new();
    for t in traces {
        let v: Value = serde_json::from_slice(&t.json)
            .with_context(|| format!("{}'s trace is not Chrome JSON", t.host))?;
        let other = &v["otherData"];
        let (Some(start_ns), Some(start_unix_ns)) =
            (other["start_ns"].as_i64(), other["start_unix_ns"].as_i64())
        else {
            anyhow::bail!("{}'s trace does not say when it started", t.host);
        };
        // Monotonic ns on that host → wall-clock ns on this machine.
        let shift = start_unix_ns - start_ns - t.offset_ns;
        parsed.push((t, v, start_unix_ns - t.offset_ns, shift));
    }
    // The merged timeline starts at the earliest host's start, on this machine's clock.
    let base = parsed.iter().map(|p| p.2).min().unwrap_or(0);
    let mut events = Vec::new();
    let mut hosts = Vec::new();
    for (i, (t, v, start, shift)) in parsed.into_iter().enumerate() {
        let pid_base = (i as u64 + 1) * PID_BASE;
        hosts.push(json!({
            "host": t.host,
            "clock_offset_ms": t.offset_ns as f64 / 1e6,
            "pid_base": pid_base,
            "start_ns": start - base,
        }));
        let Some(list) = v.get("traceEvents").and_then(Value::as_array) else {
            continue;
        };
        for e in list {
            let mut e = e.clone();
            if let Some(pid) = e["pid"].as_u64() {
                e["pid"] = (pid_base + pid).into();
                if e["ph"] == "M" && e["name"] == "process_name" {
                    let name = e["args"]["name"].as_str().unwrap_or("").to_owned();
                    e["args"]["name"] = format!("{}: {name} (pid {pid})", t.host).into();
                }
            }
            if let Some(ts) = e["ts"].as_f64() {
                let ns = (ts * 1000.0).round() as i64 + shift - base;
                e["ts"] = json!(ns as f64 / 1000.0);
            }
            events.push(e);
        }
    }
    let merged = json!({
        "displayTimeUnit": "ns",
        "otherData": {
            "clock": "each host's CLOCK_MONOTONIC moved onto tracerctl's wall clock; ts 0 = start_unix_ns",
            "start_unix_ns": base,
            "hosts": hosts,
        },
        "traceEvents": events,
    });
    Ok(serde_json::to_vec(&merged)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(start_ns: i64, start_unix_ns: i64, ts_us: f64) -> Vec<u8> {
        json!({
            "otherData": {"start_ns": start_ns, "start_unix_ns": start_unix_ns},
            "traceEvents": [
                {"ph": "M", "name": "process_name", "pid": 42, "tid": 42, "args": {"name": "python3"}},
                {"ph": "X", "name": "f", "pid": 42, "tid": 43, "ts": ts_us, "dur": 1.5},
            ]
        })
        .to_string()
        .into_bytes()
    }

    #[test]
    fn hosts_land_on_one_clock_with_their_own_process_groups() {
        // Host a started at wall 1_000_000_000_000 (its clock = ours); host b's clock runs
        // 2 ms ahead of ours and it started 1 ms after a, by our clock.
        let a = HostTrace {
            host: "a:1".into(),
            offset_ns: 0,
            json: trace(5_000_000, 1_000_000_000_000, 5_000.5),
        };
        let b = HostTrace {
            host: "b:1".into(),
            offset_ns: 2_000_000,
            json: trace(9_000_000, 1_000_003_000_000, 9_010.0),
        };
        let m: Value = serde_json::from_slice(&chrome(&[a, b]).unwrap()).unwrap();
        let ev = m["traceEvents"].as_array().unwrap();
        assert_eq!(ev[0]["args"]["name"], "a:1: python3 (pid 42)");
        assert_eq!(ev[1]["pid"], 10_000_042);
        assert_eq!(ev[1]["ts"], 0.5);
        assert_eq!(ev[3]["pid"], 20_000_042);
        // b's event: 10 µs after its start, which was 1 ms after a's.
        assert_eq!(ev[3]["ts"], 1010.0);
        assert_eq!(ev[3]["dur"], 1.5);
        assert_eq!(m["otherData"]["hosts"][1]["start_ns"], 1_000_000);
    }
}
