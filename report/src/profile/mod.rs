//! A sampling session's result: a histogram of stacks, each stack a list of frames from the
//! root to the leaf, Python, native and kernel frames side by side. Every flame graph format
//! (`export::{folded, pprof, speedscope, svg}`) is written from this one structure.

mod gil;
mod wall;

use serde::{Deserialize, Serialize};

use crate::escape_controls;

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Profile {
    /// What was sampled: `cpu-clock`, or `cycles` where the machine has a PMU.
    pub event: String,
    pub frequency_hz: u64,
    /// Nanoseconds one sample stands for (1e9 / frequency).
    pub period_ns: u64,
    /// Wall-clock start of the session (Unix nanoseconds) and its length.
    pub start_unix_ns: u64,
    pub duration_ns: u64,
    /// Distinct stacks, most samples first.
    pub stacks: Vec<Stack>,
    /// Binaries that native frames point into; `Frame::mapping` indexes this.
    pub mappings: Vec<Mapping>,
    pub unwinding: Unwinding,
    /// Wall-clock profiles (`--off-cpu`): the time threads spent off the CPU, in
    /// `Stack::off_cpu_ns` beside the CPU samples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub off_cpu: Option<OffCpu>,
}

/// The off-CPU reason of time spent waiting to take the GIL: named by the daemon, counted
/// as waiting in the table's GIL section.
pub const WAITING_FOR_THE_GIL: &str = "waiting for the GIL";

/// What a wall-clock profile's off-CPU part holds.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct OffCpu {
    /// A thread's time away went in as a stack once it added up to this much.
    pub min_ns: u64,
    /// Off-CPU time in the stacks, and how many records brought it.
    pub total_ns: u64,
    pub records: u64,
    /// Of `total_ns`, periods shorter than `min_ns` carried into the thread's next record
    /// (and counted under that record's stack).
    pub carried_ns: u64,
    /// Time away still running, or carried, at the end (no record stands for it): not in
    /// the stacks.
    pub unfinished_ns: u64,
    pub unfinished_threads: u64,
}

/// One distinct stack and how many samples hit it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Stack {
    pub pid: u32,
    pub tid: u32,
    /// Command name of the process.
    pub comm: String,
    /// Root first: the process frame, then the thread's outermost frame … the leaf.
    pub frames: Vec<Frame>,
    /// CPU samples (launches, for launch stacks).
    pub count: u64,
    /// Off-CPU time in wall-clock profiles; its leaf frame says why.
    #[serde(default, skip_serializing_if = "crate::is_zero")]
    pub off_cpu_ns: u64,
    /// CPU samples of a Python thread whose GIL state was read: whether it held the GIL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gil_held: Option<bool>,
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum FrameKind {
    /// The root frame naming the process (`python3 (pid 1234)`).
    #[default]
    Process,
    /// A Python function: `name` is its qualname, `file` and `line` the current instruction.
    Python,
    /// A user-space native function.
    Native,
    /// A kernel function.
    Kernel,
    /// Wall-clock profiles: the leaf of off-CPU time, naming why the thread was away.
    OffCpu,
    /// An asyncio task (`name` is its name); the Python frames after it, up to the next
    /// task, are its coroutines. Task stacks start with the outermost awaiting task.
    Task,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq, Hash)]
pub struct Frame {
    pub kind: FrameKind,
    /// Function name (demangled), qualname for Python, `[unknown]` when it could not be named.
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub line: Option<u32>,
    /// Native frames: index into `Profile::mappings`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mapping: Option<usize>,
    /// Native frames: file offset within the mapping's binary; kernel frames: the address.
    #[serde(default)]
    pub address: u64,
}

impl Frame {
    /// The frame as flame graph tools label it: Python frames like py-spy's raw output
    /// (`qualname (file:line)`), kernel frames with `_[k]` as `stackcollapse-perf` does.
    pub fn label(&self) -> String {
        match self.kind {
            FrameKind::Python => match (&self.file, self.line) {
                (Some(f), Some(l)) => format!("{} ({f}:{l})", self.name),
                (Some(f), None) => format!("{} ({f})", self.name),
                _ => self.name.clone(),
            },
            FrameKind::Kernel => format!("{}_[k]", self.name),
            FrameKind::OffCpu => format!("[off-CPU: {}]", self.name),
            FrameKind::Task => format!("[task: {}]", self.name),
            FrameKind::Process | FrameKind::Native => self.name.clone(),
        }
    }
}

/// A binary mapped into a sampled process.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Mapping {
    pub path: String,
    /// GNU build id, hex; empty when the binary has none.
    pub build_id: String,
}

/// How well stacks were unwound, measured on every sample.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Unwinding {
    pub samples: u64,
    /// Samples whose native stack reached a known root (`_start`, `clone3`/`start_thread`)
    /// or, for Python threads, whose Python chain reached the thread's first frame.
    pub reached_root: u64,
    /// Samples of Python threads whose Python frames were read.
    pub python_samples: u64,
    /// Of those, samples whose whole Python chain was read (not cut, no failed read).
    pub python_complete: u64,
    /// Samples that could not be taken or unwound at all, by cause (also in the losses).
    pub failed: Vec<(String, u64)>,
    /// What limits these stacks: binaries without unwind tables, interpreters not read.
    pub notes: Vec<String>,
}

impl Profile {
    /// Total samples in the histogram.
    pub fn total(&self) -> u64 {
        self.stacks.iter().map(|s| s.count).sum()
    }

    /// What a stack weighs: samples, or nanoseconds in a wall-clock profile (samples at the
    /// period, plus off-CPU time).
    pub fn weight(&self, s: &Stack) -> u64 {
        match self.off_cpu {
            None => s.count,
            Some(_) => s
                .count
                .saturating_mul(self.period_ns)
                .saturating_add(s.off_cpu_ns),
        }
    }

    /// What flame graphs (folded stacks, SVG) weigh a stack by: samples, or microseconds
    /// in a wall-clock profile.
    pub fn flame_value(&self, s: &Stack) -> u64 {
        match self.off_cpu {
            None => s.count,
            Some(_) => self.weight(s) / 1000,
        }
    }

    /// What a flame graph's values count.
    pub fn flame_unit(&self) -> &'static str {
        match self.off_cpu {
            None => "samples",
            Some(_) => "µs",
        }
    }

    /// The sum of the stacks' weights.
    pub fn total_weight(&self) -> u64 {
        self.stacks.iter().map(|s| self.weight(s)).sum()
    }

    /// Keeps the stacks of these processes, threads and process name (empty: any).
    pub fn retain(&mut self, pids: &[u32], tids: &[u32], comm: &str) {
        self.stacks.retain(|s| {
            (pids.is_empty() || pids.contains(&s.pid))
                && (tids.is_empty() || tids.contains(&s.tid))
                && (comm.is_empty() || s.comm == comm)
        });
    }

    /// Keeps the samples taken while their thread held the GIL (`py-spy --gil`): what
    /// limits a threaded Python program. Off-CPU time is dropped too: a thread away from
    /// the CPU runs no Python.
    pub fn retain_gil_held(&mut self) {
        self.stacks.retain(|s| s.gil_held == Some(true));
    }

    /// The terminal report: functions by samples (by time, in a wall-clock profile) in
    /// themselves (leaf) and in their subtree, like `perf report --children`; then how well
    /// stacks were unwound.
    pub fn table(&self, out: &mut String, limit: usize) {
        use std::{collections::HashMap, fmt::Write as _};
        let total = self.total();
        let weight_total = self.total_weight();
        let mut by: HashMap<String, (u64, u64)> = HashMap::new();
        for s in &self.stacks {
            let w = self.weight(s);
            let mut seen = std::collections::HashSet::new();
            for (i, f) in s.frames.iter().enumerate() {
                if f.kind == FrameKind::Process {
                    continue;
                }
                let label = f.label();
                let e = by.entry(label.clone()).or_default();
                if i + 1 == s.frames.len() {
                    e.0 += w;
                }
                // Recursion: a function counts once per stack in its total.
                if seen.insert(label) {
                    e.1 += w;
                }
            }
        }
        let mut rows: Vec<(String, (u64, u64))> = by.into_iter().collect();
        rows.sort_by(|a, b| {
            b.1 .0
                .cmp(&a.1 .0)
                .then(b.1 .1.cmp(&a.1 .1))
                .then(a.0.cmp(&b.0))
        });
        let pct = |n: u64| 100.0 * n as f64 / weight_total.max(1) as f64;
        let wall = self.off_cpu.is_some();
        let _ = match self.frequency_hz {
            // Launch stacks: one a launch.
            0 => writeln!(
                out,
                "\n Stacks of {total} {}es, {} distinct (self: launched from there; total: from there or below)\n",
                escape_controls(&self.event),
                self.stacks.len()
            ),
            hz if wall => writeln!(
                out,
                "\n Wall-clock: {} on the CPU ({total} samples at {hz} Hz, {}) and {} off it, {} distinct stacks (times in ms)\n",
                wall::ms(total.saturating_mul(self.period_ns)),
                escape_controls(&self.event),
                wall::ms(weight_total.saturating_sub(total.saturating_mul(self.period_ns))),
                self.stacks.len()
            ),
            hz => writeln!(
                out,
                "\n Stack samples: {total} at {hz} Hz ({}), {} distinct stacks\n",
                escape_controls(&self.event),
                self.stacks.len()
            ),
        };
        let _ = writeln!(
            out,
            "{:>8} {:>7} {:>8} {:>7}  function",
            "self", "self%", "total", "total%"
        );
        let shown = if limit == 0 { 25 } else { limit };
        let value = |n: u64| {
            if wall {
                format!("{:.1}", n as f64 / 1e6)
            } else {
                n.to_string()
            }
        };
        for (label, (own, all)) in rows.iter().take(shown) {
            // Escaped here, not in `Frame::label`: folded stacks and the other exports keep
            // names as data.
            let _ = writeln!(
                out,
                "{:>8} {:>6.1}% {:>8} {:>6.1}%  {}",
                value(*own),
                pct(*own),
                value(*all),
                pct(*all),
                escape_controls(label)
            );
        }
        if rows.len() > shown {
            let _ = writeln!(
                out,
                "{:>8} … {} more functions (--limit)",
                "",
                rows.len() - shown
            );
        }
        if wall {
            wall::threads(self, out);
        }
        gil::threads(self, out);
        let u = &self.unwinding;
        let _ = writeln!(
            out,
            "\n unwinding: {} of {} samples reached a known root ({:.1}%); Python frames read in {} samples, whole chain in {}",
            u.reached_root,
            u.samples,
            pct_of(u.reached_root, u.samples),
            u.python_samples,
            u.python_complete
        );
        for (why, n) in &u.failed {
            let _ = writeln!(out, "   {n} stopped early: {}", escape_controls(why));
        }
        for note in &u.notes {
            let _ = writeln!(out, "   note: {}", escape_controls(note));
        }
    }
}

fn pct_of(n: u64, of: u64) -> f64 {
    100.0 * n as f64 / of.max(1) as f64
}
