//! Merging counting reports (their JSON form) from many hosts: totals per function, kernel
//! and counter, with each host's share beside them.

use std::{collections::BTreeMap, fmt::Write as _};

use serde_json::{json, Map, Value};
use tracer_report::escape_controls as esc;

/// How one section of a report merges: where its rows are, which fields identify a row
/// across hosts, and which are summed.
struct Section {
    name: &'static str,
    path: &'static [&'static str],
    keys: &'static [&'static str],
    sums: &'static [&'static str],
}

const SECTIONS: &[Section] = &[
    Section {
        name: "counters",
        path: &["counters"],
        keys: &["event", "unit"],
        sums: &["value"],
    },
    Section {
        name: "python",
        path: &["python", "functions"],
        keys: &["qualname", "filename", "firstlineno"],
        sums: &["ncalls", "primitive_calls", "tottime_ns", "cumtime_ns"],
    },
    Section {
        name: "native",
        path: &["native", "calls"],
        keys: &["binary", "symbol"],
        sums: &["calls"],
    },
    Section {
        name: "cuda_launches",
        path: &["cuda", "launches"],
        keys: &[
            "call_site",
            "call_site_from",
            "api",
            "kernel",
            "grid",
            "block",
            "shared_mem",
        ],
        sums: &["launches"],
    },
    Section {
        name: "cuda_memory",
        path: &["cuda", "memory"],
        keys: &["api", "direction"],
        sums: &["calls", "bytes"],
    },
    Section {
        name: "losses",
        path: &["losses"],
        keys: &["cause"],
        sums: &["count"],
    },
];

/// A merged row: its identifying fields, its totals, and each host's sums.
type Row = (Map<String, Value>, Vec<u64>, BTreeMap<String, Vec<u64>>);

/// One host's outcome, as the merged report states it.
pub struct HostResult {
    pub host: String,
    pub session: Option<String>,
    pub state: Option<String>,
    pub clock_offset_ms: Option<f64>,
    pub error: Option<String>,
    pub report: Option<Value>,
}

/// The merged report: `hosts`, then each section's rows with totals and a `hosts` map of
/// each host's values, largest first.
pub fn merge(results: &[HostResult]) -> Value {
    let mut out = Map::new();
    out.insert(
        "hosts".into(),
        results
            .iter()
            .map(|r| {
                json!({
                    "host": r.host,
                    "session": r.session,
                    "state": r.state,
                    "clock_offset_ms": r.clock_offset_ms,
                    "error": r.error,
                })
            })
            .collect(),
    );
    for s in SECTIONS {
        // Key (as JSON text) → (identifying fields, totals, per host sums).
        let mut rows: BTreeMap<String, Row> = BTreeMap::new();
        for r in results {
            let Some(report) = &r.report else { continue };
            let Some(items) = s
                .path
                .iter()
                .try_fold(report, |v, p| v.get(p))
                .and_then(Value::as_array)
            else {
                continue;
            };
            for item in items {
                let ident: Map<String, Value> = s
                    .keys
                    .iter()
                    .map(|k| (k.to_string(), item.get(*k).cloned().unwrap_or(Value::Null)))
                    .collect();
                let key = Value::Object(ident.clone()).to_string();
                let vals: Vec<u64> = s
                    .sums
                    .iter()
                    .map(|f| item.get(*f).and_then(Value::as_u64).unwrap_or(0))
                    .collect();
                let row = rows
                    .entry(key)
                    .or_insert_with(|| (ident, vec![0; s.sums.len()], BTreeMap::new()));
                let per_host = row
                    .2
                    .entry(r.host.clone())
                    .or_insert_with(|| vec![0; s.sums.len()]);
                for (i, v) in vals.iter().enumerate() {
                    row.1[i] += v;
                    per_host[i] += v;
                }
            }
        }
        let mut merged: Vec<Value> = rows
            .into_values()
            .map(|(mut ident, totals, hosts)| {
                for (f, v) in s.sums.iter().zip(&totals) {
                    ident.insert(f.to_string(), (*v).into());
                }
                let hosts: Map<String, Value> = hosts
                    .into_iter()
                    .map(|(h, vals)| {
                        let m: Map<String, Value> = s
                            .sums
                            .iter()
                            .zip(vals)
                            .map(|(f, v)| (f.to_string(), v.into()))
                            .collect();
                        (h, Value::Object(m))
                    })
                    .collect();
                ident.insert("hosts".into(), Value::Object(hosts));
                Value::Object(ident)
            })
            .collect();
        let first = s.sums[0];
        merged.sort_by_key(|v| std::cmp::Reverse(v[first].as_u64().unwrap_or(0)));
        if !merged.is_empty() {
            out.insert(s.name.into(), Value::Array(merged));
        }
    }
    Value::Object(out)
}

/// The merged report as text: the hosts, then each section's rows with a column per host.
pub fn table(merged: &Value, limit: usize) -> String {
    let mut out = String::new();
    let hosts: Vec<&Value> = merged["hosts"]
        .as_array()
        .map(|a| a.iter().collect())
        .unwrap_or_default();
    let names: Vec<String> = hosts
        .iter()
        .filter(|h| h["error"].is_null())
        .filter_map(|h| h["host"].as_str().map(str::to_owned))
        .collect();
    let _ = writeln!(
        out,
        "Merged report of {} of {} hosts",
        names.len(),
        hosts.len()
    );
    // Hosts' reports are data: every string is escaped where it is printed.
    let s = |v: &Value| esc(v.as_str().unwrap_or("")).into_owned();
    for h in &hosts {
        let name = esc(h["host"].as_str().unwrap_or("?"));
        match h["error"].as_str() {
            Some(e) => {
                let _ = writeln!(out, "  {name}: FAILED: {}", esc(e));
            }
            None => {
                let _ = writeln!(
                    out,
                    "  {name}: session {} {}, clock {:+.3} ms from this machine's",
                    esc(h["session"].as_str().unwrap_or("-")),
                    esc(h["state"].as_str().unwrap_or("?")),
                    h["clock_offset_ms"].as_f64().unwrap_or(0.0)
                );
            }
        }
    }
    let section = |out: &mut String,
                   title: &str,
                   rows: &Value,
                   label: &dyn Fn(&Value) -> String,
                   value: &str| {
        let Some(rows) = rows.as_array() else { return };
        let _ = writeln!(out, "\n{title}");
        let _ = write!(out, "{:>14}", "total");
        for n in &names {
            let _ = write!(out, " {:>14}", truncate(&esc(n), 14));
        }
        let _ = writeln!(out, "  what");
        let shown = if limit == 0 {
            rows.len()
        } else {
            limit.min(rows.len())
        };
        for r in &rows[..shown] {
            let _ = write!(out, "{:>14}", r[value].as_u64().unwrap_or(0));
            for n in &names {
                let v = r["hosts"][n.as_str()][value].as_u64().unwrap_or(0);
                let _ = write!(out, " {v:>14}");
            }
            let _ = writeln!(out, "  {}", label(r));
        }
        if shown < rows.len() {
            let _ = writeln!(out, "  … {} more (--limit 0 shows all)", rows.len() - shown);
        }
    };
    section(
        &mut out,
        "perf counters",
        &merged["counters"],
        &|r| format!("{} ({})", s(&r["event"]), s(&r["unit"])),
        "value",
    );
    section(
        &mut out,
        "Python calls (ncalls)",
        &merged["python"],
        &|r| {
            format!(
                "{} ({}:{})",
                s(&r["qualname"]),
                s(&r["filename"]),
                r["firstlineno"]
            )
        },
        "ncalls",
    );
    section(
        &mut out,
        "Python time in the function itself (tottime, ns)",
        &merged["python"],
        &|r| s(&r["qualname"]),
        "tottime_ns",
    );
    section(
        &mut out,
        "native calls",
        &merged["native"],
        &|r| format!("{}:{}", s(&r["binary"]), s(&r["symbol"])),
        "calls",
    );
    section(
        &mut out,
        "CUDA launches",
        &merged["cuda_launches"],
        &|r| {
            format!(
                "{} {} grid {} block {}",
                s(&r["api"]),
                s(&r["kernel"]),
                r["grid"],
                r["block"]
            )
        },
        "launches",
    );
    section(
        &mut out,
        "CUDA memory (bytes)",
        &merged["cuda_memory"],
        &|r| format!("{} {}", s(&r["api"]), s(&r["direction"])),
        "bytes",
    );
    section(
        &mut out,
        "lost events",
        &merged["losses"],
        &|r| s(&r["cause"]),
        "count",
    );
    out
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_owned()
    } else {
        let tail: String = s
            .chars()
            .rev()
            .take(n - 1)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        format!("…{tail}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(name: &str, report: Value) -> HostResult {
        HostResult {
            host: name.into(),
            session: Some("s".into()),
            state: Some("finished".into()),
            clock_offset_ms: Some(0.0),
            error: None,
            report: Some(report),
        }
    }

    #[test]
    fn rows_are_summed_across_hosts_and_kept_per_host() {
        let a = json!({"python": {"functions": [
            {"pid": 1, "qualname": "f", "filename": "x.py", "firstlineno": 1, "ncalls": 10, "primitive_calls": 10, "tottime_ns": 5, "cumtime_ns": 7},
            {"pid": 2, "qualname": "f", "filename": "x.py", "firstlineno": 1, "ncalls": 1, "primitive_calls": 1, "tottime_ns": 1, "cumtime_ns": 1}
        ]}, "counters": [{"event": "task-clock", "unit": "ns", "value": 100}]});
        let b = json!({"python": {"functions": [
            {"pid": 9, "qualname": "f", "filename": "x.py", "firstlineno": 1, "ncalls": 4, "primitive_calls": 4, "tottime_ns": 2, "cumtime_ns": 3},
            {"pid": 9, "qualname": "g", "filename": "x.py", "firstlineno": 5, "ncalls": 20, "primitive_calls": 20, "tottime_ns": 2, "cumtime_ns": 3}
        ]}, "counters": [{"event": "task-clock", "unit": "ns", "value": 50}]});
        let mut down = host("c", Value::Null);
        down.report = None;
        down.error = Some("unreachable".into());
        let m = merge(&[host("a", a), host("b", b), down]);
        let py = m["python"].as_array().unwrap();
        assert_eq!(py.len(), 2);
        assert_eq!(py[0]["qualname"], "g");
        assert_eq!(py[1]["ncalls"], 15);
        assert_eq!(py[1]["hosts"]["a"]["ncalls"], 11);
        assert_eq!(py[1]["hosts"]["b"]["tottime_ns"], 2);
        assert_eq!(m["counters"][0]["value"], 150);
        assert_eq!(m["hosts"][2]["error"], "unreachable");
        let t = table(&m, 0);
        assert!(t.contains("Merged report of 2 of 3 hosts"), "{t}");
        assert!(t.contains("c: FAILED: unreachable"), "{t}");
        assert!(
            t.lines()
                .any(|l| l.split_whitespace().take(3).eq(["15", "11", "4"])),
            "{t}"
        );
    }
}
