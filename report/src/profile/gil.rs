//! The GIL part of a profile's table: per Python thread, the share of its time (its
//! samples, in a CPU profile) holding the GIL, running without it, and waiting for it.

use std::{collections::BTreeMap, fmt::Write as _};

use super::{
    wall::{more_threads, THREADS_SHOWN},
    FrameKind, Profile, WAITING_FOR_THE_GIL,
};
use crate::escape_controls;

#[derive(Default)]
struct Thread {
    comm: String,
    held: u64,
    released: u64,
    waiting: u64,
    /// Everything else: samples whose GIL state was not read, other off-CPU time.
    other: u64,
}

impl Thread {
    fn total(&self) -> u64 {
        self.held + self.released + self.waiting + self.other
    }
}

/// Per thread of which some sample read the GIL's state: holding, running without it,
/// waiting for it (wall-clock profiles), in time or samples.
pub(crate) fn threads(p: &Profile, out: &mut String) {
    let mut by: BTreeMap<(u32, u32), Thread> = BTreeMap::new();
    let mut any = false;
    for s in &p.stacks {
        let t = by.entry((s.pid, s.tid)).or_default();
        t.comm.clone_from(&s.comm);
        // On-CPU time, or samples in a CPU profile.
        let cpu = match p.off_cpu {
            Some(_) => s.count.saturating_mul(p.period_ns),
            None => s.count,
        };
        match s.gil_held {
            Some(true) => t.held += cpu,
            Some(false) => t.released += cpu,
            None => t.other += cpu,
        }
        any |= s.gil_held.is_some();
        if s.off_cpu_ns > 0 {
            let waited = s
                .frames
                .last()
                .is_some_and(|f| f.kind == FrameKind::OffCpu && f.name == WAITING_FOR_THE_GIL);
            if waited {
                t.waiting += s.off_cpu_ns;
            } else {
                t.other += s.off_cpu_ns;
            }
        }
    }
    if !any {
        return;
    }
    let mut rows: Vec<((u32, u32), Thread)> = by
        .into_iter()
        .filter(|(_, t)| t.held + t.released > 0)
        .collect();
    rows.sort_by_key(|(k, t)| (std::cmp::Reverse(t.held), *k));
    let of = if p.off_cpu.is_some() {
        "wall time"
    } else {
        "CPU samples"
    };
    let _ = writeln!(
        out,
        "\n The GIL: each Python thread's {of} holding it, running without it, waiting for it\n\n{:>8} {:>8} {:>7} {:>8} {:>8} {:>7}",
        "pid", "tid", "held", "without", "waiting", "other"
    );
    for ((pid, tid), t) in rows.iter().take(THREADS_SHOWN) {
        let all = t.total().max(1) as f64;
        let pct = |n: u64| 100.0 * n as f64 / all;
        let _ = writeln!(
            out,
            "{pid:>8} {tid:>8} {:>6.1}% {:>7.1}% {:>7.1}% {:>6.1}%  ({})",
            pct(t.held),
            pct(t.released),
            pct(t.waiting),
            pct(t.other),
            escape_controls(&t.comm)
        );
    }
    more_threads(out, rows.len());
    if p.off_cpu.is_none() {
        let _ = writeln!(
            out,
            "   waiting: only a wall-clock profile (--off-cpu) sees time away from the CPU"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Frame, Stack};
    use super::*;

    fn stack(tid: u32, name: &str, count: u64, gil_held: Option<bool>) -> Stack {
        Stack {
            pid: 7,
            tid,
            comm: "python3".into(),
            frames: vec![Frame {
                kind: FrameKind::Python,
                name: name.into(),
                ..Frame::default()
            }],
            count,
            off_cpu_ns: 0,
            gil_held,
        }
    }

    #[test]
    fn shares_per_thread_and_the_held_flame_graph() {
        let mut p = Profile {
            frequency_hz: 100,
            period_ns: 10_000_000,
            stacks: vec![
                stack(1, "spin", 9, Some(true)),
                stack(1, "spin", 1, Some(false)),
                stack(2, "digest", 3, Some(false)),
                stack(2, "digest", 1, Some(true)),
                stack(3, "native", 5, None),
            ],
            ..Profile::default()
        };
        let mut out = String::new();
        threads(&p, &mut out);
        let row = |tid: &str| {
            out.lines()
                .find(|l| l.split_whitespace().nth(1) == Some(tid))
                .unwrap_or_else(|| panic!("no row for {tid}: {out}"))
                .split_whitespace()
                .skip(2)
                .take(4)
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        assert_eq!(row("1"), ["90.0%", "10.0%", "0.0%", "0.0%"]);
        assert_eq!(row("2"), ["25.0%", "75.0%", "0.0%", "0.0%"]);
        // A thread whose GIL state was never read has no row.
        assert!(!out
            .lines()
            .any(|l| l.split_whitespace().nth(1) == Some("3")));
        p.retain_gil_held();
        let kept: Vec<(u32, u64)> = p.stacks.iter().map(|s| (s.tid, s.count)).collect();
        assert_eq!(kept, [(1, 9), (2, 1)]);
    }
}
