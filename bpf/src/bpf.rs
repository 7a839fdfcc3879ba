//! Loading tracer's BPF object and the process-following programs it holds.
//!
//! One object is loaded at daemon start. The `TRACKED` map says which sessions follow which
//! processes; the tracepoint programs extend it on fork and report forks and exits on the
//! `PROC_EVENTS` ring buffer, which [`ProcessFollower::events`] drains.

mod cuda_allocs;
mod cuda_inproc;
mod maps;
mod offcpu;
mod programs;
mod tracepoints;
mod uprobes;
mod verifier;

pub use maps::GpuKernelTimes;
use maps::{cuda_counts, gpu_kernel_times, native_counts, reopen};
pub use maps::{
    slot_entries, CudaCounts, CudaMaps, NativeMaps, PythonMaps, SamplingMaps, TracingMaps,
};
pub use offcpu::OffCpuSession;
pub use programs::perf_link;
pub use tracepoints::ensure_tracefs;
use tracepoints::{attach, TracepointFormat};
use uprobes::load_all;
pub use uprobes::{release, CudaAttacher, Loading, NativeAttacher, ProbeSet, PythonAttacher};
pub use verifier::{Figures, INSN_LIMIT};

use std::{os::fd::OwnedFd, path::Path};

use aya::{
    maps::{Array, HashMap, MapData, MapError, PerCpuArray, RingBuf, StackTraceMap},
    Ebpf, EbpfError, EbpfLoader,
};
use tokio::{io::unix::AsyncFd, sync::mpsc};
use tracer_common::{
    globals, loss, CudaLaunchKey, CudaMemKey, CudaMemStats, GpuKernelKey, GpuKernelStats,
    NativeCallKey, OffCpuConfig, OffCpuThread, ProcEvent, PyAsyncLayout, PyCallKey, PyCallStats,
    PyEdgeKey, PyLayout, PySampleProc, PyStack, SessionMask,
};

use tracer_inspect::python::{
    layout::{Version, VERSIONS},
    runtime::Runtime,
};

const CUDA_CALL: &str = "tracer_cuda_call";
const CUDA_RETURN: &str = "tracer_cuda_return";
/// The probe points of tracer's CUPTI injection library.
const CUPTI_CALL: &str = "tracer_cupti_call";
const NATIVE_CALL: &str = "tracer_native_call";
/// The uprobe programs that run at a function's return (uretprobes).
const PY_ENTRY: &str = "tracer_py_eval_entry";
const PY_RETURN: &str = "tracer_py_eval_return";
const PY_OPCODE: &str = "tracer_py_opcode";
const PY_OPCODE_EXIT: &str = "tracer_py_opcode_exit";
const AT_RETURN: [&str; 2] = [PY_RETURN, CUDA_RETURN];
/// The programs each kind of probe needs, loaded at its first use.
const PY_PROGRAMS: [&str; 4] = [PY_ENTRY, PY_RETURN, PY_OPCODE, PY_OPCODE_EXIT];
const CUDA_PROGRAMS: [&str; 3] = [CUDA_CALL, CUDA_RETURN, CUPTI_CALL];
const NATIVE_PROGRAMS: [&str; 1] = [NATIVE_CALL];
const SAMPLE: &str = "tracer_sample";
/// The sampling program without the asyncio task walk, for kernels that refuse the whole.
const SAMPLE_PLAIN: &str = "tracer_sample_plain";
const SAMPLE_PROGRAMS: [&str; 1] = [SAMPLE];

/// The probes' layout array, for layouts found after loading (an interpreter's own debug
/// offsets): whoever hands a probe a layout index publishes its layout first.
static PY_LAYOUTS_MAP: std::sync::Mutex<Option<Array<MapData, PyLayout>>> =
    std::sync::Mutex::new(None);

/// Makes `v`'s layout readable by the probes under its index (tracer's own table is written
/// at load; this is for the others).
pub fn publish_layout(v: &Version) -> Result<(), BpfError> {
    if (v.index as usize) < VERSIONS.len() {
        return Ok(());
    }
    let mut map = PY_LAYOUTS_MAP
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    match map.as_mut() {
        Some(m) => m.set(v.index, v.probe, 0).map_err(map_err("PY_LAYOUTS")),
        None => Ok(()),
    }
}

/// The object built from ebpf/probes by build.rs.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/tracer.bpf.o"));

pub const TRACEFS: &str = "/sys/kernel/tracing";

#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    #[error("loading tracer's BPF object: {0}")]
    Load(#[source] Box<EbpfError>),
    #[error("BPF program {name}: {source}")]
    Program {
        name: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("attaching {name} at {probes} offsets: {source}")]
    Attach {
        name: &'static str,
        probes: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("BPF map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: Box<MapError>,
    },
    #[error("tracer's probe programs: {0}")]
    Programs(#[source] programs::ProgramsError),
    #[error("tracefs is not available at {TRACEFS} and could not be mounted: {0}")]
    Tracefs(String),
}

fn map_err(name: &'static str) -> impl FnOnce(MapError) -> BpfError {
    move |e| BpfError::Map {
        name,
        source: Box::new(e),
    }
}

/// tracer's loaded BPF object: process following and the Python probes' maps.
pub struct Bpf {
    tracked: HashMap<MapData, u32, SessionMask>,
    losses: PerCpuArray<MapData, u64>,
    slot_losses: aya::maps::PerCpuHashMap<MapData, tracer_common::LossKey, u64>,
    events: Option<RingBuf<MapData>>,
    pub py_tstate: HashMap<MapData, u32, u64>,
    pub py_calls: HashMap<MapData, PyCallKey, PyCallStats>,
    pub py_edges: HashMap<MapData, PyEdgeKey, PyCallStats>,
    py_codes: Option<RingBuf<MapData>>,
    py_sessions: Array<MapData, [SessionMask; 3]>,
    /// What `PY_SESSIONS` holds: Python slots, those counting every process, those with
    /// processes counted in-process.
    py_masks: [SessionMask; 3],
    /// Processes counted in-process → the slots counting them so (their probes skip them).
    py_inproc: HashMap<MapData, u32, SessionMask>,
    /// Threads' shadow stacks of Python frames, read when a tracing session ends.
    pub py_stacks: HashMap<MapData, u32, PyStack>,
    trace_sessions: Array<MapData, SessionMask>,
    // Kept open: programs loaded later refer to every map by fd.
    native_calls: HashMap<MapData, NativeCallKey, u64>,
    cuda_launches: HashMap<MapData, CudaLaunchKey, u64>,
    cuda_memory: HashMap<MapData, CudaMemKey, CudaMemStats>,
    gpu_kernels: HashMap<MapData, GpuKernelKey, GpuKernelStats>,
    cuda_names: Option<RingBuf<MapData>>,
    cuda_watch: Array<MapData, [SessionMask; 2]>,
    /// Processes whose launches sessions count in-process (`cuda_inproc.rs`).
    cuda_inproc: HashMap<MapData, u32, SessionMask>,
    /// Sessions' records of allocations not yet freed (`cuda_allocs.rs`).
    cuda_allocs: HashMap<MapData, [u64; 2], u64>,
    exec_hold: Array<MapData, SessionMask>,
    /// Processes stopped at exec or at a CUDA library mapping, until continued (see `guardian`).
    held: HashMap<MapData, u32, u64>,
    offcpu_sessions: Array<MapData, OffCpuConfig>,
    offcpu_threads: HashMap<MapData, u32, OffCpuThread>,
    /// Sessions recording off-CPU time, and their programs.
    off_cpu: offcpu::OffCpu,
    /// The uprobe and sampling programs, loaded and attached by tracer itself.
    programs: programs::Programs,
    /// Why uprobes are attached one by one, when they are.
    multi_missing: Option<String>,
    /// Why Python 3.10 threads cannot be told apart when sampling, if they cannot.
    pub fsbase_error: Option<String>,
    /// The process-following tracepoints' links and events.
    _tracepoints: Vec<OwnedFd>,
    // Owns the maps.
    ebpf: Ebpf,
}

/// Takes a map out of the object, typed.
fn take<T: TryFrom<aya::maps::Map, Error = MapError>>(
    ebpf: &mut Ebpf,
    name: &'static str,
) -> Result<T, BpfError> {
    let map = ebpf
        .take_map(name)
        .unwrap_or_else(|| panic!("{name} in object"));
    T::try_from(map).map_err(map_err(name))
}

/// tracer's object with its maps created and its globals set for this kernel; no program
/// loaded. Also why Python 3.10 threads cannot be told apart when sampling, if they cannot.
fn load_object(trace_ring_bytes: u32) -> Result<(Ebpf, Option<String>), BpfError> {
    ensure_tracefs()?;
    let newtask = TracepointFormat::read("task", "task_newtask");
    let exit = TracepointFormat::read("sched", "sched_process_exit");
    let pid_off = newtask.offset("pid").unwrap_or(8);
    let flags_off = newtask.offset("clone_flags").unwrap_or(32);
    let group_dead_off = exit.offset("group_dead").unwrap_or(u32::MAX);
    let switch = TracepointFormat::read("sched", "sched_switch");
    let prev_state_off = switch.offset("prev_state").unwrap_or(32);
    let next_pid_off = switch.offset("next_pid").unwrap_or(56);
    // Without them off-CPU events name the call, not the kind of fd it waited on.
    let fd_offsets = crate::btf::fd_offsets().unwrap_or_else(|e| {
        tracing::warn!(%e, "off-CPU events will not say what an fd is");
        [u32::MAX; 6]
    });
    // Without them a process that maps a CUDA library is not held until it is probed.
    let file_name_offsets = crate::btf::file_name_offsets().unwrap_or_else(|e| {
        tracing::warn!(%e, "launches right after a CUDA library is mapped may be missed");
        [u32::MAX; 2]
    });
    let (fsbase_off, fsbase_error) = match crate::btf::task_fsbase_offset() {
        Ok(off) => (off, None),
        Err(e) => (u32::MAX, Some(e.to_string())),
    };
    // One sample record under construction per CPU (`SAMPLE_SCRATCH`).
    let cpus = aya::util::nr_cpus().map_err(|(what, e)| {
        BpfError::Load(Box::new(EbpfError::FileError {
            path: what.into(),
            error: e,
        }))
    })?;
    let ebpf = EbpfLoader::new()
        .map_max_entries("TRACE_EVENTS", trace_ring_bytes)
        .map_max_entries("SAMPLE_SCRATCH", u32::try_from(cpus).unwrap_or(u32::MAX))
        .override_global(globals::TASK_FSBASE_OFFSET, &fsbase_off, true)
        .override_global(globals::NEWTASK_PID_OFFSET, &pid_off, true)
        .override_global(globals::NEWTASK_CLONE_FLAGS_OFFSET, &flags_off, true)
        .override_global(globals::EXIT_GROUP_DEAD_OFFSET, &group_dead_off, true)
        .override_global(globals::SWITCH_PREV_STATE_OFFSET, &prev_state_off, true)
        .override_global(globals::SWITCH_NEXT_PID_OFFSET, &next_pid_off, true)
        .override_global(globals::FD_OFFSETS, &fd_offsets, true)
        .override_global(globals::FILE_NAME_OFFSETS, &file_name_offsets, true)
        .load(OBJECT)
        .map_err(|e| BpfError::Load(Box::new(e)))?;
    Ok((ebpf, fsbase_error))
}

/// One program of the object as this kernel's verifier took it.
pub struct Verified {
    pub name: String,
    /// The verifier's figures, where it printed them.
    pub figures: Option<Figures>,
    /// Why it was refused, if it was.
    pub refused: Option<String>,
}

/// Loads every program of tracer's object on this kernel, as the daemon would, and returns
/// what the verifier said of each; nothing is attached.
pub fn verify_all() -> Result<Vec<Verified>, BpfError> {
    let (ebpf, _) = load_object(1 << 20)?;
    let programs = programs::Programs::new(&ebpf, OBJECT, programs::supported())
        .map_err(BpfError::Programs)?;
    Ok(programs
        .names()
        .into_iter()
        .map(|name| {
            let refused = programs.load(&name).err().map(|e| e.to_string());
            Verified {
                figures: programs.figures(&name),
                name,
                refused,
            }
        })
        .collect())
}

impl Bpf {
    /// `trace_ring_bytes`: size of the tracing ring buffer (a power of two, at least a page).
    /// `per_probe`: one perf event per uprobe even where multi-uprobe links exist.
    pub fn load(trace_ring_bytes: u32, per_probe: bool) -> Result<Self, BpfError> {
        let (mut ebpf, fsbase_error) = load_object(trace_ring_bytes)?;
        let multi_missing = if per_probe {
            Some("tracerd was started with --per-probe-uprobes")
        } else if !programs::supported() {
            Some("this kernel has no multi-uprobe links (Linux 6.6+)")
        } else {
            None
        };
        let programs = programs::Programs::new(&ebpf, OBJECT, multi_missing.is_none())
            .map_err(BpfError::Programs)?;
        let mut tracepoints = Vec::new();
        for (prog, category, name) in [
            ("tracer_task_newtask", "task", "task_newtask"),
            ("tracer_process_exec", "sched", "sched_process_exec"),
            // Libraries mapped by processes CUDA sessions watch (filtered in the kernel:
            // idle while no CUDA session runs).
            ("tracer_cuda_mmap_enter", "syscalls", "sys_enter_mmap"),
            ("tracer_cuda_mmap_exit", "syscalls", "sys_exit_mmap"),
        ] {
            tracepoints.extend(attach(&programs, prog, category, name)?);
        }
        // Without the exit program no process is followed: where the kernel refuses it, its
        // variant without the Python unwinding loop serves, and the loss is counted.
        let exit = ("sched", "sched_process_exit");
        let exit_fds = attach(&programs, "tracer_process_exit", exit.0, exit.1).or_else(|e| {
            tracing::warn!(%e, "process exits go without unwinding Python frames");
            attach(&programs, "tracer_process_exit_plain", exit.0, exit.1)
        })?;
        tracepoints.extend(exit_fds);
        let mut layouts: Array<MapData, PyLayout> = take(&mut ebpf, "PY_LAYOUTS")?;
        for v in VERSIONS {
            layouts
                .set(v.index, v.probe, 0)
                .map_err(map_err("PY_LAYOUTS"))?;
        }
        *PY_LAYOUTS_MAP
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(layouts);
        Ok(Self {
            tracked: take(&mut ebpf, "TRACKED")?,
            losses: take(&mut ebpf, "LOSSES")?,
            slot_losses: take(&mut ebpf, "SLOT_LOSSES")?,
            events: Some(take(&mut ebpf, "PROC_EVENTS")?),
            py_tstate: take(&mut ebpf, "PY_TSTATE")?,
            py_calls: take(&mut ebpf, "PY_CALLS")?,
            py_edges: take(&mut ebpf, "PY_EDGES")?,
            py_codes: Some(take(&mut ebpf, "PY_CODES")?),
            py_sessions: take(&mut ebpf, "PY_SESSIONS")?,
            py_masks: [0; 3],
            py_inproc: take(&mut ebpf, "PY_INPROC")?,
            py_stacks: take(&mut ebpf, "PY_STACKS")?,
            trace_sessions: take(&mut ebpf, "TRACE_SESSIONS")?,
            native_calls: take(&mut ebpf, "NATIVE_CALLS")?,
            cuda_launches: take(&mut ebpf, "CUDA_LAUNCHES")?,
            cuda_memory: take(&mut ebpf, "CUDA_MEMORY")?,
            gpu_kernels: take(&mut ebpf, "GPU_KERNELS")?,
            cuda_names: Some(take(&mut ebpf, "CUDA_NAMES")?),
            cuda_watch: take(&mut ebpf, "CUDA_WATCH")?,
            cuda_inproc: take(&mut ebpf, "CUDA_INPROC")?,
            cuda_allocs: take(&mut ebpf, "CUDA_ALLOCS")?,
            exec_hold: take(&mut ebpf, "EXEC_HOLD")?,
            held: take(&mut ebpf, "HELD")?,
            offcpu_sessions: take(&mut ebpf, "OFFCPU_SESSIONS")?,
            offcpu_threads: take(&mut ebpf, "OFFCPU_THREADS")?,
            off_cpu: offcpu::OffCpu::default(),
            programs,
            multi_missing: multi_missing.map(str::to_owned),
            fsbase_error,
            _tracepoints: tracepoints,
            ebpf,
        })
    }

    /// Sets which session slots count Python calls, and which of those count every process.
    pub fn set_python_sessions(
        &mut self,
        python: SessionMask,
        all: SessionMask,
    ) -> Result<(), BpfError> {
        self.write_py_masks([python, all, self.py_masks[2]])
    }

    fn write_py_masks(&mut self, masks: [SessionMask; 3]) -> Result<(), BpfError> {
        self.py_sessions
            .set(0, masks, 0)
            .map_err(map_err("PY_SESSIONS"))?;
        self.py_masks = masks;
        Ok(())
    }

    /// Marks `pid` as counted in-process by `slot`: that slot's probes skip it (and its
    /// forked children, which the kernel marks as they fork). The slot's in-process bit is
    /// set first, so that the probes look the process up from then on.
    pub fn set_inproc(&mut self, pid: u32, slot: u8) -> Result<(), BpfError> {
        let [python, all, inproc] = self.py_masks;
        self.write_py_masks([python, all, inproc | 1 << slot])?;
        maps::add_slot(&mut self.py_inproc, pid, slot).map_err(map_err("PY_INPROC"))
    }

    /// The slots that count `pid` in-process (marked by the daemon, or by the kernel as its
    /// counted parent forked it).
    pub fn inproc_of(&self, pid: u32) -> SessionMask {
        self.py_inproc.get(&pid, 0).unwrap_or(0)
    }

    /// Unmarks `pid` for `slot` (its counter could not start: the probes count it now).
    pub fn unset_inproc(&mut self, pid: u32, slot: u8) -> Result<(), BpfError> {
        let mask = self.py_inproc.get(&pid, 0).unwrap_or(0) & !(1 << slot);
        if mask == 0 {
            let _ = self.py_inproc.remove(&pid);
            Ok(())
        } else {
            self.py_inproc
                .insert(pid, mask, 0)
                .map_err(map_err("PY_INPROC"))
        }
    }

    /// Forgets `slot` everywhere in `PY_INPROC` (its session ended).
    pub fn clear_inproc(&mut self, slot: u8) {
        maps::clear_slot(&mut self.py_inproc, slot);
        let [python, all, inproc] = self.py_masks;
        if let Err(e) = self.write_py_masks([python, all, inproc & !(1 << slot)]) {
            tracing::error!(%e, "updating Python session masks");
        }
    }

    /// Sets which session slots stop their processes at each exec until the daemon has
    /// handled the exec event (and continues them: see `session::manager`).
    /// `followed`: all execs of their processes; `everywhere`: execs of `python…` anywhere.
    pub fn set_exec_hold(
        &mut self,
        followed: SessionMask,
        everywhere: SessionMask,
    ) -> Result<(), BpfError> {
        self.exec_hold
            .set(0, followed, 0)
            .and_then(|()| self.exec_hold.set(1, everywhere, 0))
            .map_err(map_err("EXEC_HOLD"))
    }

    /// `pid`, stopped at exec or at a CUDA library mapping, is continued: the guardian need not.
    pub fn continued(&mut self, pid: u32) {
        let _ = self.held.remove(&pid);
    }

    /// Processes stopped (at exec, or at a CUDA library mapping) and not continued yet, with when they were stopped
    /// (CLOCK_MONOTONIC ns).
    pub fn held(&self) -> Vec<(u32, u64)> {
        self.held.iter().filter_map(Result::ok).collect()
    }

    /// Another fd of the map of processes stopped by the probes, for the guardian.
    pub fn held_fd(&self) -> std::io::Result<OwnedFd> {
        use aya::maps::IterableMap;
        use std::os::fd::AsFd;
        self.held.map().fd().as_fd().try_clone_to_owned()
    }

    /// Sets which session slots are CUDA sessions, and which of those follow every process:
    /// the executable mappings of their processes are announced on the names ring.
    pub fn set_cuda_sessions(
        &mut self,
        cuda: SessionMask,
        all: SessionMask,
    ) -> Result<(), BpfError> {
        self.cuda_watch
            .set(0, [cuda, all], 0)
            .map_err(map_err("CUDA_WATCH"))
    }

    /// Sets which session slots are tracing (their probes emit events).
    pub fn set_tracing_sessions(&mut self, mask: SessionMask) -> Result<(), BpfError> {
        self.trace_sessions
            .set(0, mask, 0)
            .map_err(map_err("TRACE_SESSIONS"))
    }

    /// The maps trace events come through, for the tracing worker; taken once.
    pub fn take_tracing(&mut self) -> Result<TracingMaps, BpfError> {
        Ok(TracingMaps {
            events: take(&mut self.ebpf, "TRACE_EVENTS")?,
            drops: take(&mut self.ebpf, "TRACE_DROPS")?,
        })
    }

    /// The maps the sampling program fills, for the sampling worker; taken once.
    pub fn take_sampling(&mut self) -> Result<SamplingMaps, BpfError> {
        Ok(SamplingMaps {
            samples: take(&mut self.ebpf, "SAMPLES")?,
            kernel_stacks: take::<StackTraceMap<MapData>>(&mut self.ebpf, "SAMPLE_KSTACKS")?,
            python_procs: take::<HashMap<MapData, u32, PySampleProc>>(
                &mut self.ebpf,
                "PY_SAMPLE_PROCS",
            )?,
            async_procs: take::<HashMap<MapData, u32, PyAsyncLayout>>(
                &mut self.ebpf,
                "PY_ASYNC_PROCS",
            )?,
        })
    }

    /// The sampling program (loaded at once where a start loaded it ahead), and what is
    /// missing when this kernel refused it and its smaller variant serves instead.
    pub fn sample_program(&mut self) -> Result<(OwnedFd, Option<String>), BpfError> {
        let fd = |name: &'static str| {
            self.programs.fd(name).map_err(|e| BpfError::Program {
                name,
                source: Box::new(e),
            })
        };
        let refused = match self.load_programs(&SAMPLE_PROGRAMS) {
            Ok(()) => return Ok((fd(SAMPLE)?, None)),
            Err(e) => e,
        };
        tracing::warn!(%refused, "sampling goes on without asyncio task stacks");
        self.load_programs(&[SAMPLE_PLAIN])?;
        Ok((fd(SAMPLE_PLAIN)?, Some(refused.to_string())))
    }

    /// The ring buffer of first-seen code objects; taken once by its reader.
    pub fn take_py_codes(&mut self) -> Option<RingBuf<MapData>> {
        self.py_codes.take()
    }

    /// Attaches the Python probes to one interpreter binary, for every process that maps it.
    /// `path`: where the binary is reachable now (the runtime may have been inspected through
    /// a process that has exited since, and its `/proc/PID/root` path with it).
    pub fn attach_python(&mut self, rt: &Runtime, path: &Path) -> Result<ProbeSet, BpfError> {
        self.python_attacher().attach(rt, path)
    }

    /// What attaches the Python probes, on any thread: a start that follows the last
    /// Python session first waits for that session's probes to come off (with one perf
    /// event per probe, ~100 ms each).
    pub fn python_attacher(&self) -> PythonAttacher {
        PythonAttacher {
            programs: self.programs.clone(),
        }
    }

    /// How uprobes are attached here, in one line (for `capabilities`).
    pub fn uprobe_links(&self) -> String {
        match &self.multi_missing {
            None => "multi-uprobe links: one link per program and binary, attached and detached in one step".into(),
            Some(why) => format!("one perf event per probe, each detached after its own grace period: {why}"),
        }
    }

    /// The programs that sessions counting `python`, `cuda` launches or `native` calls, or
    /// `sampling` (with `off_cpu` time), need and that are not loaded yet, as work for
    /// another thread: the verifier takes seconds over the Python and CUDA ones, a quarter
    /// of one over the sampling one, and the thread that asks serves every client. `None`
    /// when all are loaded.
    pub fn to_load(
        &self,
        python: bool,
        cuda: bool,
        native: bool,
        sampling: bool,
        off_cpu: bool,
    ) -> Option<Loading> {
        let groups: [(bool, &[&'static str]); 5] = [
            (python, &PY_PROGRAMS),
            (cuda, &CUDA_PROGRAMS),
            (native, &NATIVE_PROGRAMS),
            (sampling, &SAMPLE_PROGRAMS),
            (off_cpu, &offcpu::PROGRAMS),
        ];
        let names: Vec<&'static str> = groups
            .into_iter()
            .filter(|(wanted, _)| *wanted)
            .flat_map(|(_, names)| names.iter().copied())
            .filter(|name| !self.programs.is_settled(name))
            .collect();
        (!names.is_empty()).then(|| Loading {
            programs: self.programs.clone(),
            names,
        })
    }

    /// Loads programs once (at once where they are loaded already); after a failed attempt
    /// some are loaded already, so the error names the one that fails.
    fn load_programs(&self, names: &[&'static str]) -> Result<(), BpfError> {
        load_all(&self.programs, names)
    }

    /// The Python counting maps, for another thread ([`PythonMaps`]).
    pub fn python_maps(&self) -> Result<PythonMaps, BpfError> {
        Ok(PythonMaps {
            calls: reopen(&self.py_calls, "PY_CALLS")?,
            edges: reopen(&self.py_edges, "PY_EDGES")?,
        })
    }

    /// The native-call counts map, for another thread ([`NativeMaps`]).
    pub fn native_maps(&self) -> Result<NativeMaps, BpfError> {
        Ok(NativeMaps {
            calls: reopen(&self.native_calls, "NATIVE_CALLS")?,
        })
    }

    /// The CUDA launch, memory and GPU-time maps, for another thread ([`CudaMaps`]).
    pub fn cuda_maps(&self) -> Result<CudaMaps, BpfError> {
        Ok(CudaMaps {
            launches: reopen(&self.cuda_launches, "CUDA_LAUNCHES")?,
            memory: reopen(&self.cuda_memory, "CUDA_MEMORY")?,
            gpu_kernels: reopen(&self.gpu_kernels, "GPU_KERNELS")?,
        })
    }

    /// What attaches native-call counters, on any thread: attaching thousands of probes,
    /// to a binary many processes map, takes long.
    pub fn native_attacher(&self) -> NativeAttacher {
        NativeAttacher {
            programs: self.programs.clone(),
        }
    }

    /// The ring buffer of CUDA kernel names; taken once by its reader.
    pub fn take_cuda_names(&mut self) -> Option<RingBuf<MapData>> {
        self.cuda_names.take()
    }

    /// Loads the CUDA probes' programs (once). Their verification takes seconds (they hold
    /// the Python frame walk of launch stacks): a CUDA session has them loaded before it
    /// starts (ahead, through [`Bpf::to_load`]), so that a library mapped later is probed at
    /// once.
    pub fn load_cuda(&mut self) -> Result<(), BpfError> {
        self.load_programs(&CUDA_PROGRAMS)
    }

    /// What attaches CUDA entry points, on any thread: a library's symbols are resolved and
    /// its probes attached as processes map it, while the manager answers requests.
    pub fn cuda_attacher(&self) -> CudaAttacher {
        CudaAttacher {
            programs: self.programs.clone(),
        }
    }

    /// A session's CUDA launch counts and memory totals, taken out of the kernel maps with
    /// `take`.
    pub fn cuda_counts(&mut self, slot: u8, take: bool) -> CudaCounts {
        cuda_counts(&mut self.cuda_launches, &mut self.cuda_memory, slot, take)
    }

    /// A session's GPU kernel times (CUPTI), taken out of the map with `take`.
    pub fn gpu_kernel_times(&mut self, slot: u8, take: bool) -> GpuKernelTimes {
        gpu_kernel_times(&mut self.gpu_kernels, slot, take)
    }

    /// A session's native call counts (pid, probe, calls), taken out of the map with `take`.
    pub fn native_counts(&mut self, slot: u8, take: bool) -> Vec<(u32, u32, u64)> {
        native_counts(&mut self.native_calls, slot, take)
    }

    /// The sessions following `pid`, as the kernel has them (children join at fork, before
    /// the daemon hears of it).
    pub fn followers(&self, pid: u32) -> SessionMask {
        self.tracked.get(&pid, 0).unwrap_or(0)
    }

    /// Adds `slot` to the sessions following `pid`.
    pub fn follow(&mut self, pid: u32, slot: u8) -> Result<(), BpfError> {
        let map = &mut self.tracked;
        let mask = match map.get(&pid, 0) {
            Ok(m) => m,
            Err(MapError::KeyNotFound) => 0,
            Err(e) => return Err(map_err("TRACKED")(e)),
        };
        map.insert(pid, mask | (1 << slot), 0)
            .map_err(map_err("TRACKED"))
    }

    /// Removes `slot` from the sessions following `pid` (and so from its later children).
    pub fn unfollow(&mut self, pid: u32, slot: u8) -> Result<(), BpfError> {
        let map = &mut self.tracked;
        let mask = match map.get(&pid, 0) {
            Ok(m) => m & !(1 << slot),
            Err(MapError::KeyNotFound) => return Ok(()),
            Err(e) => return Err(map_err("TRACKED")(e)),
        };
        let res = if mask == 0 {
            map.remove(&pid)
        } else {
            map.insert(pid, mask, 0)
        };
        match res {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(map_err("TRACKED")(e)),
        }
    }

    /// Removes `slot` from every process; entries no session follows any more are deleted.
    pub fn release(&mut self, slot: u8) -> Result<(), BpfError> {
        let map = &mut self.tracked;
        let entries: Vec<(u32, SessionMask)> = map.iter().filter_map(Result::ok).collect();
        for (pid, mask) in entries {
            if mask & (1 << slot) == 0 {
                continue;
            }
            let rest = mask & !(1 << slot);
            let res = if rest == 0 {
                map.remove(&pid)
            } else {
                map.insert(pid, rest, 0)
            };
            match res {
                Ok(()) | Err(MapError::KeyNotFound) => {}
                Err(e) => return Err(map_err("TRACKED")(e)),
            }
        }
        Ok(())
    }

    /// Totals of the kernel-side loss counters, indexed by `tracer_common::loss`.
    pub fn losses(&self) -> [u64; loss::COUNT as usize] {
        let mut out = [0; loss::COUNT as usize];
        for (i, slot) in out.iter_mut().enumerate() {
            if let Ok(values) = self.losses.get(&(i as u32), 0) {
                *slot = values.iter().sum();
            }
        }
        out
    }

    /// The loss counters of the processes `slot`'s session follows (since the BPF programs
    /// were loaded: sessions subtract what they found at their start).
    pub fn slot_losses(&self, slot: u8) -> [u64; loss::COUNT as usize] {
        let mut out = [0; loss::COUNT as usize];
        for (key, values) in self.slot_losses.iter().filter_map(Result::ok) {
            if key.mask & (1 << slot) != 0 {
                if let Some(n) = out.get_mut(key.cause as usize) {
                    *n += values.iter().sum::<u64>();
                }
            }
        }
        out
    }

    /// Starts draining fork/exit events into `tx`. Call once.
    pub fn events(
        &mut self,
        tx: mpsc::UnboundedSender<ProcEvent>,
    ) -> std::io::Result<tokio::task::JoinHandle<()>> {
        let ring = self.events.take().expect("events() called once");
        // SAFETY: the ring buffer owns its fd and lives inside the AsyncFd, which deregisters it
        // before dropping it.
        let mut fd = unsafe { AsyncFd::register(ring) }.map_err(std::io::Error::from)?;
        Ok(tokio::spawn(async move {
            loop {
                let Ok(mut guard) = fd.readable_mut().await else {
                    return;
                };
                let ring = guard.get_inner_mut();
                while let Some(item) = ring.next() {
                    if item.len() >= std::mem::size_of::<ProcEvent>() {
                        // SAFETY: the record was written as a ProcEvent by the BPF side; read unaligned.
                        let ev =
                            unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<ProcEvent>()) };
                        if tx.send(ev).is_err() {
                            return;
                        }
                    }
                }
                guard.clear_ready();
            }
        }))
    }
}

pub fn loss_cause_name(index: u32) -> &'static str {
    match index {
        loss::RINGBUF_FULL => "proc_events_ringbuf_full",
        loss::TRACKED_MAP_FULL => "tracked_map_full",
        loss::PY_CALLS_FULL => "python_calls_map_full",
        loss::PY_CODES_RINGBUF_FULL => "python_names_ringbuf_full",
        loss::PY_NO_THREAD_STATE => "python_thread_state_unknown",
        loss::PY_READ_FAILED => "python_memory_read_failed",
        loss::PY_STACK_TOO_DEEP => "python_stack_too_deep_untimed",
        loss::PY_EXIT_INFERRED => "python_exits_inferred",
        loss::PY_THREADS_FULL => "python_threads_map_full_untimed",
        loss::NATIVE_CALLS_FULL => "native_calls_map_full",
        loss::PY_EDGES_FULL => "python_callers_map_full",
        loss::SAMPLES_RINGBUF_FULL => "samples_ringbuf_full",
        loss::TRACE_RINGBUF_FULL => "trace_ringbuf_full",
        loss::CUDA_MAP_FULL => "cuda_maps_full",
        loss::CUDA_NAMES_RINGBUF_FULL => "cuda_names_ringbuf_full",
        loss::CUPTI_RECORDS_DROPPED => "cupti_records_dropped",
        loss::PY_INPROC_FULL => "python_inproc_map_full",
        loss::PY_THREAD_EXIT_UNWOUND => "python_frames_of_exited_threads_uncounted",
        _ => "unknown",
    }
}
