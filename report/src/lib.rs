//! A session's report: what it measured, and what it could not. Stored as JSON; rendered as
//! a table or JSON on request.

pub mod away;
mod escape;
pub mod export;
pub mod gpu;
pub mod kernels;
pub mod profile;
pub mod trace;

/// serde's `skip_serializing_if` for counts that are mostly 0.
fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// `ns` as a number of microseconds with nanosecond decimals, exactly (no float rounding):
/// Chrome's JSON times and the tables' µs columns.
pub(crate) fn us(ns: u64) -> String {
    format!("{}.{:03}", ns / 1000, ns % 1000)
}

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use tracer_proto::{counter, Counter, Loss};

pub use escape::escape_controls;

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Report {
    pub session: Summary,
    /// perf counter totals (counting mode).
    pub counters: Vec<CounterResult>,
    /// Events that could not be recorded, by cause; empty when nothing was lost.
    pub losses: Vec<LossEntry>,
    pub processes: Processes,
    /// Python calls per function (counting mode with `--python`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub python: Option<PythonReport>,
    /// Native function calls (counting mode with `--uprobe`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub native: Option<NativeReport>,
    /// Stack samples (sampling mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<crate::profile::Profile>,
    /// Every event, with its time (tracing mode): a summary and the names; the events are in
    /// the trace file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<trace::Trace>,
    /// CUDA launches, copies and allocations (counting mode with `--cuda`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda: Option<CudaReport>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct CudaReport {
    /// CUDA libraries probed, when and in which process they were first seen.
    pub libraries: Vec<CudaLibrary>,
    /// Launches per (process, entry point, kernel, configuration), most first. Runtime
    /// launches (`cuda*`) reach the driver's `cuLaunchKernel*` too: count kernels at one layer.
    pub launches: Vec<CudaLaunch>,
    /// Copies, allocations and synchronizations per (process, entry point, direction).
    pub memory: Vec<CudaMemory>,
    /// Launch rows whose kernel handle was named before tracer probed the library.
    pub unnamed: u64,
    pub warnings: Vec<String>,
    /// GPU metrics sampled during the session (NVML).
    #[serde(default)]
    pub gpu: gpu::GpuReport,
    /// GPU time per kernel and configuration (grid, block), most first: CUPTI's records of the
    /// kernels that ran while the session did, in processes that run tracer's injection
    /// library.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_kernels: Vec<GpuKernelTime>,
    /// The injection library's own account in each process that has it: what it found and
    /// turned on, or why it could not. Empty: no process had it (no GPU times).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_times: Vec<GpuTimesStatus>,
    /// How the launches of each process asked to be counted in-process were counted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub launch_counting: Vec<LaunchCounting>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct LaunchCounting {
    pub pid: u32,
    /// "in-process" (tracer's injection library counts them, no trap a launch) or "probes"
    /// (the launch uprobes).
    pub way: String,
    /// Why that way.
    pub why: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct GpuKernelTime {
    pub pid: u32,
    pub device: u32,
    /// Demangled, from CUPTI's name.
    pub kernel: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub executions: u64,
    pub total_ns: u64,
    pub min_ns: u64,
    pub max_ns: u64,
    /// CUPTI's pointer to the name, which a trace's GPU kernel events carry.
    #[serde(skip)]
    pub name_ptr: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct GpuTimesStatus {
    pub pid: u32,
    /// "ok: CUPTI from …" or "error: …", as the library put it.
    pub status: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CudaLibrary {
    pub pid: u32,
    pub path: String,
    pub probes: u32,
    /// Time from the session's start to the look that found it mapped.
    pub found_after_ms: u64,
    /// What found it: "start" (mapped when the session started), "mmap" (the process was
    /// seen mapping it; probed right after) or "look" (a periodic look at the process's
    /// mappings, the fallback).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub found_by: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CudaLaunch {
    /// The launching thread's innermost Python frame, `qualname (file:line)`; empty when
    /// the thread was running no Python.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub call_site: String,
    /// Whose frame `call_site` is when not the launching thread's: a thread that ran no
    /// Python (autograd's, a C++ pool's) is given the frame of the thread it most likely
    /// works for, "the thread that last launched from Python" or else "the thread that last
    /// held the GIL", most often the one waiting in the call that handed it the work.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub call_site_from: String,
    pub pid: u32,
    pub api: String,
    /// Demangled device name.
    pub kernel: String,
    /// Where `kernel` came from when no naming call was seen (the handle was made before
    /// tracer probed the library): "registration code" (what the library's code registers
    /// for the host function the handle stands for), "host stub symbol" (the symbol at that
    /// host stub), "launching function" (the caller's symbol: the host stub itself in nvcc's
    /// code, but any function for hand-written launches) or "runtime launch" (a driver
    /// launch named after the runtime launch it was made in), "CUPTI" (a launch counted
    /// in-process: CUPTI's name for it). Empty: a naming call.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub named_from: String,
    /// The native function that made the call, `function (file:line)` or `binary+0xOFFSET`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub caller: String,
    pub handle: u64,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem: u32,
    pub stream: u64,
    pub launches: u64,
    /// GPU time per execution of this kernel with this grid and block, from CUPTI
    /// (`--gpu-times`): the same for every row of that kernel and configuration, whatever
    /// its call site.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_avg_ns: Option<u64>,
    /// The row's `CudaLaunchKey::row_id`, which a trace's launch events carry.
    #[serde(skip)]
    pub row_id: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CudaMemory {
    pub pid: u32,
    pub api: String,
    /// Copies: "host to device", "device to host"…; empty for the rest.
    pub direction: String,
    pub calls: u64,
    /// Bytes copied, allocated or freed (frees of allocations tracer saw).
    pub bytes: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct NativeReport {
    /// Every function probed, called or not.
    pub probes: Vec<NativeProbe>,
    /// Calls per process and function, most first; functions never called are absent.
    pub calls: Vec<NativeCalls>,
    /// Functions a spec matched that the kernel would not probe, and why ("BINARY:SYMBOL: why").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_probed: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct NativeProbe {
    /// The `--uprobe` spec that matched it.
    pub spec: String,
    pub binary: String,
    pub symbol: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct NativeCalls {
    pub pid: u32,
    pub binary: String,
    pub symbol: String,
    pub calls: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PythonReport {
    /// Sorted by ncalls, most first.
    pub functions: Vec<PyFunction>,
    /// Code objects counted whose names could not be read.
    pub unknown_names: u64,
    /// Frames left by an exception: their exit time is that of the thread's next probed
    /// event, since no probe sees the unwind itself (3.11+). Machine-wide during the session.
    pub inferred_exits: u64,
    /// What limits these numbers: interpreters that could not be probed, late attaches.
    pub warnings: Vec<String>,
    /// How each process named by pid was counted, and why: in-process (CPython 3.14+,
    /// sys.monitoring) or with uprobes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub counted: Vec<CountedWay>,
}

/// How one process's Python calls were counted.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CountedWay {
    pub pid: u32,
    /// "in-process", "uprobes", or "in-process, then uprobes" (a handover).
    pub way: String,
    /// Why that way (for uprobes: why not in-process).
    pub why: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PyFunction {
    pub pid: u32,
    pub qualname: String,
    pub filename: String,
    pub firstlineno: i32,
    /// Calls, counted as cProfile counts them: every start and every resume of the frame.
    pub ncalls: u64,
    /// Calls that were not recursive (cProfile's primitive calls).
    pub primitive_calls: u64,
    /// Time in the function itself, callees excluded.
    pub tottime_ns: u64,
    /// Time in the function and its callees, once per outermost activation.
    pub cumtime_ns: u64,
    /// The Python functions that called it, with the numbers of those calls (pstats'
    /// callers). C functions in between (`sorted`, `map`) are not seen: the caller is the
    /// nearest Python frame.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub callers: Vec<PyCaller>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PyCaller {
    pub qualname: String,
    pub filename: String,
    pub firstlineno: i32,
    pub ncalls: u64,
    /// Calls while this caller → callee pair was not already active further down.
    pub primitive_calls: u64,
    pub tottime_ns: u64,
    pub cumtime_ns: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    pub id: String,
    pub mode: String,
    /// "pid 1234" or "all".
    pub target: String,
    /// The target was launched by tracerctl and counted from its exec.
    pub launched: bool,
    pub owner_uid: u32,
    /// "uid N" (Unix socket) or "client NAME" (TCP, the access policy's name).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub started_by: String,
    pub started_unix_ms: u64,
    pub elapsed_ms: u64,
    pub state: String,
    pub end_reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct CounterResult {
    pub event: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
    pub unit: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_enabled_ns: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_running_ns: Option<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct LossEntry {
    pub cause: String,
    pub count: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Processes {
    /// Processes followed at some point (target and forked children); none for a
    /// system-wide session, which measures the machine rather than following processes.
    pub followed: u32,
    /// A system-wide session (`--all`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub system_wide: bool,
    /// System-wide sessions: processes forked on the machine while it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked: Option<u64>,
    pub exited: u32,
    /// The target's command name, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// Processes the session stopped following, and why: an exec that gained credentials
    /// (setuid, setgid, file capabilities) in a session of an unprivileged user.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unfollowed: Vec<String>,
    /// The container and pod of each process the report names that ran in one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub containers: Vec<ProcessOrigin>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ProcessOrigin {
    pub pid: u32,
    #[serde(flatten)]
    pub origin: Origin,
}

/// Which container and Kubernetes pod a process ran in, from its cgroup path and hostname.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Origin {
    /// The cgroup path that names the container (or the unified hierarchy's).
    pub cgroup: String,
    /// containerd, cri-o, docker or podman; "cri" for a kubelet cgroupfs path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// The pod's QoS class: guaranteed, burstable or besteffort.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qos: Option<String>,
    /// The container's /etc/hostname (a pod's name by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// The OpenTelemetry service name the process's environment declares.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_name: Option<String>,
}

impl Origin {
    pub fn in_container(&self) -> bool {
        self.container_id.is_some() || self.pod_uid.is_some()
    }
}

impl From<&Counter> for CounterResult {
    fn from(c: &Counter) -> Self {
        let (value, unavailable, times) = match &c.result {
            Some(counter::Result::Value(v)) => (Some(*v), None, true),
            Some(counter::Result::Unavailable(why)) => (None, Some(why.clone()), false),
            None => (None, Some("no reading".into()), false),
        };
        Self {
            event: c.event.clone(),
            value,
            unavailable,
            unit: c.unit.clone(),
            time_enabled_ns: times.then_some(c.time_enabled_ns),
            time_running_ns: times.then_some(c.time_running_ns),
        }
    }
}

impl From<&Loss> for LossEntry {
    fn from(l: &Loss) -> Self {
        Self {
            cause: l.cause.clone(),
            count: l.count,
        }
    }
}

impl Report {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("reports serialize")
    }

    pub fn from_json(s: &str) -> serde_json::Result<Self> {
        serde_json::from_str(s)
    }

    /// The terminal table, laid out like `perf stat`.
    pub fn to_table(&self) -> String {
        self.to_table_limited(0)
    }

    /// The table, with at most `limit` Python functions (0: all).
    pub fn to_table_limited(&self, limit: usize) -> String {
        let s = &self.session;
        let mut out = String::new();
        let launched = if s.launched { " (launched)" } else { "" };
        let command = self
            .processes
            .command
            .as_deref()
            .map(|c| format!(" [{}]", escape_controls(c)))
            .unwrap_or_default();
        // Every string of the report is escaped where it is printed: a report read back
        // from the store is data, whatever wrote it.
        let _ = writeln!(
            out,
            "session {} · {} · {}{launched}{command}",
            escape_controls(&s.id),
            escape_controls(&s.mode),
            escape_controls(&s.target)
        );
        let _ = writeln!(
            out,
            "{} {} after {}",
            escape_controls(&s.state),
            escape_controls(&s.end_reason),
            seconds(s.elapsed_ms)
        );
        if let Some(err) = &s.error {
            let _ = writeln!(out, "error: {}", escape_controls(err));
        }
        if let Some(c) = &self.cuda {
            kernels::table(&mut out, c, limit);
        }
        if let Some(t) = &self.trace {
            let _ = writeln!(
                out,
                "\n Trace: {} events ({} Python calls, {} native calls, {} CUDA calls, {} GPU kernels, {} counter readings) over {}",
                group(t.events),
                group(t.python_calls),
                group(t.native_calls),
                group(t.cuda_events),
                group(t.gpu_kernels),
                group(t.counter_readings),
                seconds(t.end_ns.saturating_sub(t.start_ns) / 1_000_000)
            );
            if t.exits_inferred + t.unfinished > 0 {
                let _ = writeln!(
                    out,
                    " {} calls left by an exception (exit time inferred), {} still running at the end",
                    group(t.exits_inferred),
                    group(t.unfinished)
                );
            }
            let _ = writeln!(
                out,
                " Timeline: tracerctl report {} --format chrome -o trace.json (or --format perfetto)",
                escape_controls(&s.id)
            );
        }
        if !self.counters.is_empty() {
            let _ = writeln!(out, "\n Performance counter stats:\n");
            for c in &self.counters {
                match (c.value, &c.unavailable) {
                    (Some(v), _) if c.unit == "ns" => {
                        let ms = v as f64 / 1e6;
                        let _ = writeln!(
                            out,
                            "{:>20} msec  {:<18}{}",
                            group_f(ms),
                            escape_controls(&c.event),
                            multiplex_note(c)
                        );
                    }
                    (Some(v), _) => {
                        let _ = writeln!(
                            out,
                            "{:>20}       {:<18}{}",
                            group(v),
                            escape_controls(&c.event),
                            multiplex_note(c)
                        );
                    }
                    (None, why) => {
                        let why = escape_controls(why.as_deref().unwrap_or("no reading"));
                        let _ = writeln!(
                            out,
                            "{:>20}       {:<18}{why}",
                            "<not supported>",
                            escape_controls(&c.event)
                        );
                    }
                }
            }
        }
        if let Some(py) = &self.python {
            py_table(&mut out, py, limit);
        }
        if let Some(native) = &self.native {
            native_table(&mut out, native, limit);
        }
        if let Some(profile) = &self.profile {
            profile.table(&mut out, limit);
        }
        let _ = writeln!(out);
        let p = &self.processes;
        if p.system_wide {
            let forked = p
                .forked
                .map(|n| format!(", {} forked while it ran", group(n)))
                .unwrap_or_default();
            let _ = writeln!(out, " processes: the whole machine (system-wide){forked}");
        } else {
            let _ = writeln!(
                out,
                " processes: {} followed, {} exited",
                p.followed, p.exited
            );
        }
        for u in &self.processes.unfollowed {
            let _ = writeln!(out, " not followed: {}", escape_controls(u));
        }
        if self.losses.is_empty() {
            let _ = writeln!(out, " losses: none");
        } else {
            let list: Vec<String> = self
                .losses
                .iter()
                .map(|l| format!("{} {}", group(l.count), escape_controls(&l.cause)))
                .collect();
            let _ = writeln!(out, " losses: {}", list.join(", "));
        }
        if !self.processes.containers.is_empty() {
            let _ = writeln!(out, "\n Containers: (and services the processes name)\n");
            let _ = writeln!(
                out,
                "{:>8}  {:<12}  {:<12}  {:<36}  {:<10}  {:<20}  service",
                "pid", "runtime", "container", "pod uid", "qos", "hostname"
            );
            for c in &self.processes.containers {
                let o = &c.origin;
                fn dash(v: &Option<String>) -> std::borrow::Cow<'_, str> {
                    escape_controls(v.as_deref().unwrap_or("-"))
                }
                // The short id, cut on a character boundary: a report read back may hold any.
                let id = o.container_id.as_deref().map_or("-", |i| {
                    i.char_indices().nth(12).map_or(i, |(end, _)| &i[..end])
                });
                let _ = writeln!(
                    out,
                    "{:>8}  {:<12}  {:<12}  {:<36}  {:<10}  {:<20}  {}",
                    c.pid,
                    dash(&o.runtime),
                    escape_controls(id),
                    dash(&o.pod_uid),
                    dash(&o.qos),
                    dash(&o.hostname),
                    dash(&o.service_name)
                );
            }
        }
        out
    }

    /// Every pid the report names: in its rows, stacks and trace.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids = Vec::new();
        if let Some(p) = &self.python {
            pids.extend(p.functions.iter().map(|f| f.pid));
        }
        if let Some(n) = &self.native {
            pids.extend(n.calls.iter().map(|c| c.pid));
        }
        if let Some(c) = &self.cuda {
            pids.extend(c.launches.iter().map(|l| l.pid));
            pids.extend(c.memory.iter().map(|m| m.pid));
        }
        if let Some(p) = &self.profile {
            pids.extend(p.stacks.iter().map(|s| s.pid));
        }
        if let Some(t) = &self.trace {
            pids.extend(t.processes.iter().map(|p| p.pid));
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }
}

/// funccount's table: calls per function and process, most first.
fn native_table(out: &mut String, native: &NativeReport, limit: usize) {
    let _ = writeln!(
        out,
        "\n Native calls ({} functions probed):\n",
        native.probes.len()
    );
    let _ = writeln!(out, "{:>14}  {:>8}  function (binary)", "calls", "pid");
    let shown = if limit == 0 { usize::MAX } else { limit };
    for c in native.calls.iter().take(shown) {
        let file = c.binary.rsplit('/').next().unwrap_or(&c.binary);
        let _ = writeln!(
            out,
            "{:>14}  {:>8}  {} ({})",
            group(c.calls),
            c.pid,
            escape_controls(&c.symbol),
            escape_controls(file)
        );
    }
    if native.calls.len() > shown {
        let _ = writeln!(
            out,
            "{:>14}  … {} more rows",
            "",
            native.calls.len() - shown
        );
    }
    let called: std::collections::BTreeSet<(&str, &str)> = native
        .calls
        .iter()
        .map(|c| (c.binary.as_str(), c.symbol.as_str()))
        .collect();
    let never = native
        .probes
        .iter()
        .filter(|p| !called.contains(&(p.binary.as_str(), p.symbol.as_str())))
        .count();
    if never > 0 {
        let _ = writeln!(out, " {never} probed functions were not called");
    }
    for n in &native.not_probed {
        let _ = writeln!(out, " not probed: {}", escape_controls(n));
    }
}

/// Orders of the Python table, as `python -m cProfile -s KEY` spells them.
pub const PY_SORTS: &[&str] = &[
    "tottime", "cumtime", "ncalls", "pcalls", "filename", "name", "line", "pid",
];

/// Sorts functions by `key` (one of [`PY_SORTS`]), largest first for numbers.
pub fn sort_functions(f: &mut [PyFunction], key: &str) {
    let tie = |a: &PyFunction, b: &PyFunction| {
        (&a.filename, a.firstlineno, &a.qualname).cmp(&(&b.filename, b.firstlineno, &b.qualname))
    };
    match key {
        "cumtime" => f.sort_by(|a, b| b.cumtime_ns.cmp(&a.cumtime_ns).then_with(|| tie(a, b))),
        "ncalls" => f.sort_by(|a, b| b.ncalls.cmp(&a.ncalls).then_with(|| tie(a, b))),
        "pcalls" => f.sort_by(|a, b| {
            b.primitive_calls
                .cmp(&a.primitive_calls)
                .then_with(|| tie(a, b))
        }),
        "filename" | "line" => f.sort_by(tie),
        "name" => f.sort_by(|a, b| a.qualname.cmp(&b.qualname).then_with(|| tie(a, b))),
        "pid" => f.sort_by(|a, b| a.pid.cmp(&b.pid).then_with(|| tie(a, b))),
        _ => f.sort_by(|a, b| b.tottime_ns.cmp(&a.tottime_ns).then_with(|| tie(a, b))),
    }
}

fn py_table(out: &mut String, py: &PythonReport, limit: usize) {
    let total: u64 = py.functions.iter().map(|f| f.ncalls).sum();
    let primitive: u64 = py.functions.iter().map(|f| f.primitive_calls).sum();
    let _ = writeln!(
        out,
        "\n Python: {} function calls ({} primitive calls) in {} functions\n",
        group(total),
        group(primitive),
        py.functions.len()
    );
    let _ = writeln!(
        out,
        "{:>16} {:>9} {:>9} {:>9} {:>9} {:>8}  filename:lineno(function)",
        "ncalls", "tottime", "percall", "cumtime", "percall", "pid"
    );
    let secs = |ns: u64| ns as f64 / 1e9;
    let shown = rows_shown(limit, py.functions.len());
    for f in &py.functions[..shown] {
        let ncalls = if f.primitive_calls == f.ncalls {
            f.ncalls.to_string()
        } else {
            format!("{}/{}", f.ncalls, f.primitive_calls)
        };
        let _ = writeln!(
            out,
            "{:>16} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>8}  {}:{}({})",
            ncalls,
            secs(f.tottime_ns),
            secs(f.tottime_ns) / f.ncalls.max(1) as f64,
            secs(f.cumtime_ns),
            secs(f.cumtime_ns) / f.primitive_calls.max(1) as f64,
            f.pid,
            escape_controls(&f.filename),
            f.firstlineno,
            escape_controls(&f.qualname)
        );
    }
    if shown < py.functions.len() {
        let _ = writeln!(
            out,
            "{:>16} more functions (--limit 0 shows all)",
            py.functions.len() - shown
        );
    }
    if py.unknown_names > 0 {
        let _ = writeln!(out, " {} code objects could not be named", py.unknown_names);
    }
    if py.inferred_exits > 0 {
        let _ = writeln!(
            out,
            " {} frame exits by exception were timed at the thread's next Python event",
            py.inferred_exits
        );
    }
    for c in &py.counted {
        let _ = writeln!(
            out,
            " pid {} counted {}: {}",
            c.pid,
            escape_controls(&c.way),
            escape_controls(&c.why)
        );
    }
    for w in &py.warnings {
        let _ = writeln!(out, " warning: {}", escape_controls(w));
    }
}

fn multiplex_note(c: &CounterResult) -> String {
    match (c.time_enabled_ns, c.time_running_ns) {
        (Some(e), Some(r)) if r < e && e > 0 => {
            format!("  ({:.2}% counted, scaled)", r as f64 * 100.0 / e as f64)
        }
        _ => String::new(),
    }
}

fn seconds(ms: u64) -> String {
    format!("{:.3} s", ms as f64 / 1000.0)
}

/// How many of `len` rows a table shows under `--limit` (0: all).
pub fn rows_shown(limit: usize, len: usize) -> usize {
    if limit == 0 {
        len
    } else {
        limit.min(len)
    }
}

/// 1234567 → "1,234,567".
pub fn group(v: u64) -> String {
    let digits = v.to_string();
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

fn group_f(v: f64) -> String {
    let whole = v.trunc() as u64;
    format!(
        "{}.{:02}",
        group(whole),
        ((v - v.trunc()) * 100.0).round().min(99.0) as u64
    )
}

#[cfg(test)]
mod tests;
