//! A tracing session's result: its events, kept as fixed-size records in a file under the
//! state directory (`traces/ID.events`), and the names that go with them, kept in the report.
//!
//! Records are `tracer_common::TraceEvent`s as the kernel wrote them, in the order they were
//! drained: a Python call is written when it ends, so callees come before their callers.

use std::{
    collections::HashMap,
    fs::File,
    io::{self, BufReader, Read},
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};
use tracer_common::{trace_kind, TraceEvent, TRACE_EXIT_INFERRED, TRACE_UNFINISHED};

/// Bytes per record in a trace file.
pub const RECORD: usize = std::mem::size_of::<TraceEvent>();

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Trace {
    /// The trace file's name in the state directory's `traces/` folder.
    pub file: String,
    /// Where the file is now (set by the daemon when it serves the report; not stored).
    #[serde(skip)]
    pub path: PathBuf,
    /// CLOCK_MONOTONIC at the session's start and end, ns (the events' clock), and the Unix
    /// time of the start, ns, to place the trace in wall-clock time.
    pub start_ns: u64,
    pub end_ns: u64,
    pub start_unix_ns: u64,
    /// Records in the file, and of each kind.
    pub events: u64,
    pub python_calls: u64,
    pub native_calls: u64,
    pub counter_readings: u64,
    /// Python calls whose exit was inferred (see `TRACE_EXIT_INFERRED`).
    pub exits_inferred: u64,
    /// Python calls still running at the end, written with the session's end as their end.
    pub unfinished: u64,
    /// Names of the Python functions in the events.
    pub functions: Vec<TraceFunction>,
    /// Native probes, by the number in `NATIVE_CALL` events: "BINARY:SYMBOL".
    pub probes: Vec<String>,
    /// perf counters, by the index in `COUNTER` events.
    pub counters: Vec<TraceCounter>,
    /// CUDA launches and copies (`--cuda`).
    #[serde(default)]
    pub cuda_events: u64,
    /// The CUDA launch rows the launch events belong to (kernel, configuration, call sites),
    /// sorted by (pid, row) so that each event's row is a binary search away.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub launches: Vec<TraceLaunch>,
    /// Kernel executions on the GPU (CUPTI, through tracer's injection library).
    #[serde(default)]
    pub gpu_kernels: u64,
    /// Times threads spent off the CPU (`--off-cpu`), each at least `off_cpu_min_ns` long.
    #[serde(default)]
    pub off_cpu: u64,
    #[serde(default, skip_serializing_if = "crate::is_zero")]
    pub off_cpu_min_ns: u64,
    /// Names of the kernels in those events, by (pid, CUPTI's name pointer), sorted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_kernel_names: Vec<TraceGpuKernel>,
    /// Names of the processes and threads in the events.
    pub processes: Vec<TraceThread>,
    pub threads: Vec<TraceThread>,
}

/// A launch row of the session's CUDA report, with the id its events carry.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct TraceLaunch {
    pub row: u64,
    #[serde(flatten)]
    pub launch: crate::CudaLaunch,
}

/// A GPU kernel's name, for the events that carry CUPTI's pointer to it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct TraceGpuKernel {
    pub pid: u32,
    pub name: u64,
    pub kernel: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct TraceFunction {
    pub pid: u32,
    /// Code object address and `py_names_id`, as in the events' `a` and `b`.
    pub code: u64,
    pub names: u64,
    pub qualname: String,
    pub filename: String,
    pub firstlineno: i32,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct TraceCounter {
    /// As requested: "page-faults", "task-clock"…
    pub event: String,
    /// "ns" or "count" for perf counters; %, MiB, mW, MHz, °C for GPU metrics.
    pub unit: String,
    /// A level read at each point (GPU metrics), not a running total (perf counters, shown
    /// as what each period added).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gauge: bool,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct TraceThread {
    pub pid: u32,
    /// The thread id (equal to `pid` in `processes`).
    pub tid: u32,
    pub name: String,
}

/// What an exporter shows for one event.
pub enum Named<'a> {
    Python {
        function: Option<&'a TraceFunction>,
        code: u64,
    },
    Native(Option<&'a str>),
    Counter(Option<&'a TraceCounter>),
    /// A CUDA launch: its row (kernel, configuration, call sites), if known; the entry point.
    CudaLaunch(Option<&'a crate::CudaLaunch>, u32),
    /// A CUDA copy, allocation, free or synchronization: its `CudaMemKey::kind`.
    CudaMemory(u32),
    /// A kernel's execution on the GPU: its name, if known; device and stream.
    GpuKernel(Option<&'a str>, GpuTrack),
    /// A thread's time off the CPU: why, in words.
    OffCpu(String),
    Unknown,
}

impl Trace {
    /// Looks names up by (pid, code, names).
    pub fn function_index(&self) -> HashMap<(u32, u64, u64), &TraceFunction> {
        self.functions
            .iter()
            .map(|f| ((f.pid, f.code, f.names), f))
            .collect()
    }

    pub fn named<'a>(
        &'a self,
        functions: &HashMap<(u32, u64, u64), &'a TraceFunction>,
        ev: &TraceEvent,
    ) -> Named<'a> {
        match ev.kind {
            trace_kind::PY_CALL => Named::Python {
                function: functions.get(&(ev.pid, ev.a, ev.b)).copied(),
                code: ev.a,
            },
            trace_kind::NATIVE_CALL => {
                Named::Native(self.probes.get(ev.a as usize).map(String::as_str))
            }
            trace_kind::COUNTER => Named::Counter(self.counters.get(ev.a as usize)),
            trace_kind::CUDA_LAUNCH => Named::CudaLaunch(
                self.launches
                    .binary_search_by_key(&(ev.pid, ev.b), |l| (l.launch.pid, l.row))
                    .ok()
                    .map(|i| &self.launches[i].launch),
                u32::from(ev.flags),
            ),
            trace_kind::CUDA_MEMORY => Named::CudaMemory(u32::from(ev.flags)),
            trace_kind::GPU_KERNEL => Named::GpuKernel(
                self.gpu_kernel_names
                    .binary_search_by_key(&(ev.pid, ev.a), |k| (k.pid, k.name))
                    .ok()
                    .map(|i| self.gpu_kernel_names[i].kernel.as_str()),
                GpuTrack::of(ev),
            ),
            trace_kind::OFF_CPU => Named::OffCpu(crate::away::reason(ev)),
            _ => Named::Unknown,
        }
    }

    /// The trace's events, in file order.
    pub fn events(&self) -> io::Result<Events> {
        Events::open(&self.path)
    }
}

impl Named<'_> {
    /// The event's name: a Python qualname, a native `BINARY:SYMBOL`, a counter's event.
    pub fn name(&self) -> String {
        match self {
            Named::Python {
                function: Some(f), ..
            } => f.qualname.clone(),
            Named::Python { code, .. } => format!("[code object {code:#x}]"),
            Named::Native(Some(s)) => (*s).to_owned(),
            Named::Native(None) => "[unknown probe]".into(),
            Named::Counter(Some(c)) => c.event.clone(),
            Named::Counter(None) => "[unknown counter]".into(),
            Named::CudaLaunch(Some(l), _) => l.kernel.clone(),
            Named::CudaLaunch(None, api) => {
                format!(
                    "[{} of an unnamed kernel]",
                    tracer_common::cuda_api::name(*api)
                )
            }
            Named::CudaMemory(kind) => {
                let (api, direction) = tracer_common::cuda_api::memcpy_kind(*kind);
                let api = tracer_common::cuda_api::name(api);
                match tracer_common::cuda_api::is_memcpy(*kind) {
                    true => format!("{api} ({direction})"),
                    false => api.to_owned(),
                }
            }
            Named::GpuKernel(Some(k), _) => (*k).to_owned(),
            Named::GpuKernel(None, _) => "[GPU kernel]".into(),
            Named::OffCpu(why) => format!("off-CPU: {why}"),
            Named::Unknown => "[unknown event]".into(),
        }
    }
}

/// Where a GPU kernel ran: exporters draw a track per (process, device, stream).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GpuTrack {
    pub device: u32,
    pub stream: u32,
}

impl GpuTrack {
    pub fn of(ev: &TraceEvent) -> Self {
        Self {
            device: (ev.b >> 32) as u32,
            stream: ev.b as u32,
        }
    }

    /// The track's name.
    pub fn name(&self) -> String {
        format!("GPU {} stream {}", self.device, self.stream)
    }

    /// A thread id for viewers that draw tracks by tid (Chrome JSON): above Linux's tids
    /// (< 2^22), unique per (device, stream) for devices < 256 and streams < 2^20.
    pub fn tid(&self) -> u64 {
        1 << 40 | u64::from(self.device & 0xff) << 20 | u64::from(self.stream & 0xf_ffff)
    }
}

pub fn exit_inferred(ev: &TraceEvent) -> bool {
    ev.flags & TRACE_EXIT_INFERRED != 0
}

pub fn unfinished(ev: &TraceEvent) -> bool {
    ev.flags & TRACE_UNFINISHED != 0
}

/// Reads a trace file's records in order.
pub struct Events {
    reader: BufReader<File>,
}

impl Events {
    pub fn open(path: &Path) -> io::Result<Self> {
        Ok(Self {
            reader: BufReader::with_capacity(1 << 20, File::open(path)?),
        })
    }
}

impl Iterator for Events {
    type Item = io::Result<TraceEvent>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut buf = [0u8; RECORD];
        match self.reader.read_exact(&mut buf) {
            // SAFETY: TraceEvent is plain old data of exactly RECORD bytes.
            Ok(()) => Some(Ok(unsafe {
                std::ptr::read_unaligned(buf.as_ptr().cast::<TraceEvent>())
            })),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => None,
            Err(e) => Some(Err(e)),
        }
    }
}

/// Records as bytes, to write them to a trace file.
pub fn as_bytes(events: &[TraceEvent]) -> &[u8] {
    // SAFETY: TraceEvent is repr(C) with no padding (tested in tracer-common); any byte
    // pattern of it is valid to read.
    unsafe {
        std::slice::from_raw_parts(events.as_ptr().cast::<u8>(), std::mem::size_of_val(events))
    }
}
