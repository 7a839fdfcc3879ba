//! The wall-clock part of a profile's table: each thread's time on and off the CPU, off-CPU
//! time by reason, and what the off-CPU figures leave out.

use std::{collections::BTreeMap, fmt::Write as _};

use super::{FrameKind, Profile};
use crate::escape_controls;

/// Threads listed at most, in each per-thread section of the table.
pub(crate) const THREADS_SHOWN: usize = 20;

/// The line that says how many threads a per-thread section left out, if any.
pub(crate) fn more_threads(out: &mut String, threads: usize) {
    if threads > THREADS_SHOWN {
        let _ = writeln!(out, "{:>8} … {} more threads", "", threads - THREADS_SHOWN);
    }
}

/// `ns` for a reader: milliseconds, or seconds past ten of them.
pub(crate) fn ms(ns: u64) -> String {
    if ns >= 10_000_000_000 {
        format!("{:.2} s", ns as f64 / 1e9)
    } else {
        format!("{:.1} ms", ns as f64 / 1e6)
    }
}

#[derive(Default)]
struct Thread {
    comm: String,
    on_ns: u64,
    off_ns: u64,
    /// Off-CPU time by reason.
    why: BTreeMap<String, u64>,
}

/// Per thread: its wall time in the profile, how much on the CPU, off it, and why.
pub(crate) fn threads(p: &Profile, out: &mut String) {
    let mut by: BTreeMap<(u32, u32), Thread> = BTreeMap::new();
    for s in &p.stacks {
        let t = by.entry((s.pid, s.tid)).or_default();
        t.comm.clone_from(&s.comm);
        t.on_ns += s.count.saturating_mul(p.period_ns);
        if s.off_cpu_ns > 0 {
            t.off_ns += s.off_cpu_ns;
            let why = s
                .frames
                .last()
                .filter(|f| f.kind == FrameKind::OffCpu)
                .map_or("unknown", |f| f.name.as_str());
            *t.why.entry(why.to_owned()).or_default() += s.off_cpu_ns;
        }
    }
    let mut rows: Vec<((u32, u32), Thread)> = by.into_iter().collect();
    rows.sort_by_key(|(k, t)| (std::cmp::Reverse(t.on_ns + t.off_ns), *k));
    let _ = writeln!(
        out,
        "\n Threads: wall time in the profile, on and off the CPU\n\n{:>8} {:>8} {:>10} {:>6} {:>10} {:>6}  off the CPU, by reason",
        "pid", "tid", "on CPU", "%", "off CPU", "%"
    );
    for ((pid, tid), t) in rows.iter().take(THREADS_SHOWN) {
        let wall = (t.on_ns + t.off_ns).max(1) as f64;
        let mut why: Vec<(&String, &u64)> = t.why.iter().collect();
        why.sort_by_key(|(w, ns)| (std::cmp::Reverse(**ns), *w));
        let reasons: Vec<String> = why
            .iter()
            .take(4)
            .map(|(w, ns)| format!("{} {:.0}%", escape_controls(w), 100.0 * **ns as f64 / wall))
            .collect();
        let _ = writeln!(
            out,
            "{pid:>8} {tid:>8} {:>10} {:>5.1}% {:>10} {:>5.1}%  {} ({})",
            ms(t.on_ns),
            100.0 * t.on_ns as f64 / wall,
            ms(t.off_ns),
            100.0 * t.off_ns as f64 / wall,
            reasons.join(", "),
            escape_controls(&t.comm)
        );
    }
    more_threads(out, rows.len());
    let Some(o) = &p.off_cpu else {
        return;
    };
    let _ = writeln!(
        out,
        "\n off-CPU: {} in {} records; a thread's shorter times away than {} ({} in all) went in with its next record",
        ms(o.total_ns),
        o.records,
        ms(o.min_ns),
        ms(o.carried_ns)
    );
    if o.unfinished_threads > 0 {
        let _ = writeln!(
            out,
            "   not in the stacks: {} of {} threads still away (or carried) at the end",
            ms(o.unfinished_ns),
            o.unfinished_threads
        );
    }
}
