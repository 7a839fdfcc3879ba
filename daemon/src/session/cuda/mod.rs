//! Counting mode's CUDA source (`--cuda`): probes on each CUDA library the session's
//! processes map — found at the start, and when a process maps one later (`import torch`,
//! or the runtime opening the driver at its first call: the kernel announces executable
//! mappings of watched processes) — names for the kernel handles launches carry, the native
//! callers of launches, and the report.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

mod callers;
mod events;
pub mod gpu_times;
mod handles;
mod in_process;
mod launched;
pub use in_process::Adopted;
pub use launched::{handshake, launch_env, Handshaken};
mod job;
mod report;
pub mod watch;

use job::injection_status;
pub use job::{CudaJob, CudaProbed};

use tracer_common::{cuda_api as api, cuda_cookie, CudaNameEvent};

use tracer_bpf::{Bpf, CudaCounts, CudaMaps, GpuKernelTimes, ProbeSet};
use tracer_inspect::cuda::{self, Names};
use tracer_inspect::unwind::ProcMaps;
use tracer_report::{CudaLibrary, CudaReport};

use callers::{Callers, NativeNames, ProcAddr};

use super::{
    slots::LastCounts,
    source::{Ended, Ending, Named as Part, Reading, Source},
    ReportPart,
};

/// The event a launch-stacks profile (`--cuda-stacks`) counts: one sample a launch.
pub const LAUNCH_STACKS: &str = "cuda-launch";

/// How often GPU metrics are read unless asked otherwise.
pub const GPU_PERIOD: Duration = Duration::from_millis(100);

/// How often a session's followed processes are looked at for CUDA libraries anyway: a
/// fallback for mappings the kernel's announcement missed (its ring full, a loader that maps
/// with something other than mmap). `--all` sessions: every process, less often.
pub const LOOK_EVERY: Duration = Duration::from_secs(1);
pub const LOOK_ALL_EVERY: Duration = Duration::from_secs(10);

/// A mapped library by (device major, minor, inode).
type LibraryId = (u32, u32, u64);

/// How a session's launches are probed.
#[derive(Clone, Copy, Debug, Default)]
pub struct Probing {
    /// `--cuda-stacks`: the driver's launches record their stacks.
    pub stacks: bool,
    /// `--cuda-driver-only`: launches at the driver's entry points only.
    pub driver_only: bool,
}

/// A kernel launch at the runtime's entry points (whose handle may lead to a host stub).
fn runtime_kernel_launch(which: u32) -> bool {
    matches!(which, api::CUDA_LAUNCH | api::CUDA_LAUNCH_EX)
}

/// A launch at the runtime's entry points, graphs included (`--cuda-driver-only` skips them).
fn runtime_launch(which: u32) -> bool {
    runtime_kernel_launch(which) || which == api::CUDA_GRAPH
}

pub struct CudaSession {
    slot: u8,
    all: bool,
    pub probing: Probing,
    started: Instant,
    pub next_look: Instant,
    /// Probed libraries by (device, inode), with their probes.
    libs: HashMap<LibraryId, ProbeSet>,
    /// Libraries whose probes are being attached (a [`CudaJob`] out), with the processes
    /// found mapping them whose CUPTI status is read once they are in.
    probing_libs: HashMap<LibraryId, Vec<u32>>,
    found: Vec<CudaLibrary>,
    names: Names,
    /// (pid, code, instruction, names id) → "qualname (file:line)", read when first seen.
    call_sites: HashMap<(u32, u64, u64, u64), String>,
    callers: Callers,
    /// Handles got before the session, read from the statics that keep them.
    handles: handles::Handles,
    /// (pid, driver handle) → (runtime handle, runtime caller) of the runtime launch it was
    /// made in (`ROW_LINK`).
    links: HashMap<ProcAddr, (u64, u64)>,
    warnings: Vec<String>,
    gpu: crate::gpu::GpuSampler,
    /// (pid, CUPTI's name pointer) → kernel name, from tracer's injection library.
    gpu_names: HashMap<ProcAddr, String>,
    /// pid → the injection library's status line as its probe last announced it, for any
    /// process (every CUDA session gets every process's records).
    announced: HashMap<u32, String>,
    /// pid → the status line read when this session found the library in the process: the
    /// processes whose GPU times this session reports.
    injected: HashMap<u32, String>,
    /// `--gpu-times` in a running process.
    pub gpu_times: gpu_times::State,
    /// `--cuda-in-process`: the process whose launches tracer's injection library counts.
    in_process_target: Option<u32>,
    /// Its libraries probed without kernel launches (what a job for their launches needs),
    /// which another process mapping them gets launch probes on, and the target itself
    /// where its library cannot count them after all.
    launches_skipped: HashMap<LibraryId, in_process::Skipped>,
    /// Jobs attaching the target's launch probes after all, on their way.
    launch_jobs: usize,
    /// How each process's launches were asked to be counted in-process came to be counted.
    launch_counting: Vec<tracer_report::LaunchCounting>,
    /// Its launch table, once the library counts.
    in_process: Vec<in_process::Counted>,
    /// A launched command's processes counted in-process (`launched.rs`).
    launched: Option<launched::Launched>,
    /// (pid, handle) → CUPTI's kernel name, for rows of in-process tables.
    cupti_names: HashMap<ProcAddr, String>,
    /// A tracing session's: where launches counted in-process go as events (`events.rs`).
    timeline: Option<std::sync::Arc<dyn super::Timeline>>,
}

/// Where a tracing session's CUDA data goes besides its report: its GPU metrics' tracks, and
/// its timeline for launches counted in-process.
pub type TraceOutputs = (
    Option<Box<dyn crate::gpu::Tracks>>,
    Option<std::sync::Arc<dyn super::Timeline>>,
);

impl CudaSession {
    /// Opens `--cuda` (in `options`) for a session in `at.slot`: the probes are loaded
    /// before the start is answered, for loading them at the first library mapped would let
    /// the program run seconds ahead of them; launch stacks (`--cuda-stacks`) go through the
    /// sampling ring and worker, one sample a launch. `tracks`: as for `new`; `timeline`:
    /// a tracing session's, for launches counted in-process; `times`: GPU times asked in a
    /// running process (`--gpu-times --pid`), checked already.
    pub fn open(
        bpf: &mut Bpf,
        sampling: &super::sampling::Sampling,
        options: &tracer_proto::CountingOptions,
        at: &super::Opening<'_>,
        (tracks, timeline): TraceOutputs,
        times: Option<gpu_times::Start>,
    ) -> Self {
        if let Err(e) = bpf.load_cuda() {
            tracing::warn!(%e, "loading the CUDA probes (tried again at the first library)");
        }
        if options.cuda_stacks {
            sampling.add(
                at.slot,
                0,
                LAUNCH_STACKS,
                at.pid.into_iter().collect(),
                tracer_inspect::process::kernel_addresses_for(at.owner_uid),
                None,
            );
        }
        let period = match options.gpu_period_ms {
            0 => GPU_PERIOD,
            ms => Duration::from_millis(u64::from(ms)),
        };
        let probing = Probing {
            stacks: options.cuda_stacks,
            driver_only: options.cuda_driver_only,
        };
        let mut session = Self::new(at.slot, at.pid.is_none(), probing, period, tracks);
        session.timeline = timeline;
        match times {
            Some(gpu_times::Start::Ask(ask)) => {
                session.in_process_target = ask.in_process.then_some(ask.pid);
                // Done by the job that probes the injection library, at the first look.
                session.gpu_times = gpu_times::State::Asked(ask);
            }
            Some(gpu_times::Start::Probes(pid, why)) => session.counted_with_probes(pid, why),
            Some(gpu_times::Start::Launched) => session.launched = Some(Default::default()),
            None => {}
        }
        session
    }

    /// `gpu_period`: how often GPU metrics are read; `tracks`: where a tracing session
    /// puts them on its timeline.
    pub fn new(
        slot: u8,
        all: bool,
        probing: Probing,
        gpu_period: Duration,
        tracks: Option<Box<dyn crate::gpu::Tracks>>,
    ) -> Self {
        Self {
            slot,
            all,
            probing,
            started: Instant::now(),
            next_look: Instant::now(),
            libs: HashMap::new(),
            probing_libs: HashMap::new(),
            found: Vec::new(),
            names: Names::default(),
            call_sites: HashMap::new(),
            callers: Callers::default(),
            handles: handles::Handles::default(),
            links: HashMap::new(),
            warnings: Vec::new(),
            gpu: crate::gpu::GpuSampler::start(gpu_period, tracks),
            gpu_names: HashMap::new(),
            announced: HashMap::new(),
            injected: HashMap::new(),
            gpu_times: gpu_times::State::None,
            in_process_target: None,
            launches_skipped: HashMap::new(),
            launch_jobs: 0,
            launch_counting: Vec::new(),
            in_process: Vec::new(),
            launched: None,
            cupti_names: HashMap::new(),
            timeline: None,
        }
    }

    pub fn on_name(&mut self, ev: &CudaNameEvent, sampling: &super::sampling::Sampling) {
        if ev.api == api::LAUNCH_ROW {
            // The caller, and for the runtime's launches (and driver functions got by
            // symbol) what the handle leads to: a host stub's registration or symbol names a
            // kernel whose naming calls came before the probes.
            let mut addrs = vec![ev.other];
            let stub = self.names.last(ev.pid, ev.handle);
            let unnamed = self.names.name(ev.pid, ev.handle).is_none();
            if unnamed && (runtime_kernel_launch(ev.extra as u32) || stub != ev.handle) {
                addrs.push(stub);
            }
            self.callers.locate(ev.pid, &addrs);
            // A handle no call was seen making: the caller's code may keep it in a static.
            let graph = matches!(ev.extra as u32, api::CU_GRAPH | api::CUDA_GRAPH);
            if unnamed && stub == ev.handle && !graph {
                if let Some((b, file, off)) = self.callers.binary_of(ev.pid, ev.other) {
                    self.handles.ask(ev.pid, b, file, ev.other, off);
                }
            }
            return;
        }
        if ev.api == api::ROW_LINK {
            // The runtime launch above this driver row: what may name it.
            self.links.insert((ev.pid, ev.handle), (ev.other, ev.extra));
            let stub = self.names.last(ev.pid, ev.other);
            self.callers.locate(ev.pid, &[ev.extra, stub]);
            return;
        }
        if ev.api == api::CUPTI_ROW {
            // A row of the in-process table: CUPTI's name for its handle, read while the
            // process lives.
            if let std::collections::hash_map::Entry::Vacant(e) =
                self.cupti_names.entry((ev.pid, ev.handle))
            {
                if let Some(name) = cuda::name_in_process(ev.pid, ev.other) {
                    e.insert(name);
                }
            }
            return;
        }
        if matches!(ev.api, api::CUPTI_KERNEL | api::CUPTI_STATUS) {
            let text = cuda::event_name(ev);
            if ev.api == api::CUPTI_KERNEL {
                self.gpu_names.insert((ev.pid, ev.handle), text);
            } else {
                self.launched_status(ev.pid, &text);
                self.announced.insert(ev.pid, text);
            }
            return;
        }
        if ev.api != api::CALL_SITE {
            self.names.on_event(ev);
            return;
        }
        let key = (ev.pid, ev.handle, ev.other, ev.extra);
        if self.call_sites.contains_key(&key) {
            return;
        }
        // A forked child that has exited already: its code objects were its origin's first,
        // at the same addresses (the names id tells a reused address).
        let site = [ev.pid, ev.origin]
            .into_iter()
            .filter(|&pid| pid != 0)
            .find_map(|pid| {
                let v = sampling.version(pid)?;
                tracer_symbolize::python_location(pid, ev.handle, ev.other, ev.extra, v)
            })
            .map_or_else(
                || format!("[code object {:#x}]", ev.handle),
                |(q, f, line)| format!("{q} ({f}:{line})"),
            );
        self.call_sites.insert(key, site);
    }

    /// Looks at the CUDA libraries `pid` maps: whether it maps any, and the jobs that probe
    /// those not probed yet (for [`CudaJob::run`] on another thread, back through
    /// [`Self::adopt`]). `found_by`: what made this look ("start", "mmap", "look").
    pub fn look(&mut self, pid: u32, found_by: &str) -> (bool, Vec<CudaJob>) {
        crate::container::note(pid, false);
        let Ok(maps) = ProcMaps::read(pid) else {
            return (false, Vec::new());
        };
        let mut maps_cuda = false;
        let mut jobs = Vec::new();
        for m in maps.entries() {
            let Some(lib) = cuda::library(std::path::Path::new(&m.path)) else {
                continue;
            };
            maps_cuda = true;
            // An unlinked library is neither probed nor asked for its injection status.
            if m.deleted() {
                continue;
            }
            let id = (m.dev.0, m.dev.1, m.inode);
            // Chroots and containers: see `process::mapped_path`.
            let path = match tracer_inspect::process::mapped_path(pid, m) {
                Ok(p) => p,
                Err(e) => {
                    if !self.libs.contains_key(&id) && !self.probing_libs.contains_key(&id) {
                        self.warnings.push(e.to_string());
                        // Once per library, not per mapping.
                        self.libs.insert(id, ProbeSet::default());
                    }
                    continue;
                }
            };
            let cupti = lib == cuda::Library::Cupti && !self.injected.contains_key(&pid);
            let target = self.in_process_target == Some(pid)
                || self.launched_in_process(pid, lib == cuda::Library::Driver);
            if !target && self.launches_skipped.remove(&id).is_some() {
                // Another process maps the target's library: launch probes for it (they skip
                // the target). Its other probes are in already (or on their way).
                let points = in_process::Points::KernelLaunchesOnly;
                jobs.push(self.job(lib, id, path.clone(), &m.path, pid, found_by, points));
            }
            if let Some(waiting) = self.probing_libs.get_mut(&id) {
                // Its status is read once the probes are in (`adopt`).
                if cupti && !waiting.contains(&pid) {
                    waiting.push(pid);
                }
                continue;
            }
            if !self.libs.contains_key(&id) {
                self.probing_libs
                    .insert(id, cupti.then_some(pid).into_iter().collect());
                let points = if target {
                    self.launches_skipped.insert(
                        id,
                        in_process::Skipped {
                            lib,
                            path: path.clone(),
                            mapped: m.path.clone(),
                        },
                    );
                    in_process::Points::NoKernelLaunches
                } else {
                    in_process::Points::All
                };
                let mut job = self.job(lib, id, path, &m.path, pid, found_by, points);
                if lib == cuda::Library::Cupti {
                    job.enable = self.enable(pid, false);
                }
                jobs.push(job);
                continue;
            }
            if cupti {
                let status = injection_status(pid, &path, id, Some(&maps));
                self.launched_status(pid, &status);
                self.injected.insert(pid, status);
            }
        }
        // Asked for GPU times, and no injection library mapped: it is probed, then loaded.
        if let Some(enable) = self.enable(pid, true) {
            match self.injection_job(enable) {
                Ok(job) => jobs.push(job),
                Err(e) => self.warnings.push(e),
            }
        }
        if maps_cuda {
            self.callers.keep(pid, &maps);
        }
        // A process that ran CUDA before the session: handles its code keeps in statics, read
        // while it runs. (One held at its mapping of a library has made none yet.)
        if maps_cuda && found_by != "mmap" {
            for (b, file, addr, off) in self.callers.binaries_of(pid) {
                self.handles.ask(pid, b, file, addr, off);
            }
        }
        (maps_cuda, jobs)
    }

    /// The session's ask for GPU times in `pid`, taken by the job that loads (`load`) or
    /// finds the injection library.
    fn enable(&mut self, pid: u32, load: bool) -> Option<gpu_times::Enable> {
        match std::mem::take(&mut self.gpu_times) {
            gpu_times::State::Asked(ask) if ask.pid == pid => Some(gpu_times::Enable { ask, load }),
            other => {
                self.gpu_times = other;
                None
            }
        }
    }

    /// The job that probes tracer's injection library, not loaded into the process yet,
    /// then loads it and turns GPU times on.
    fn injection_job(&mut self, enable: gpu_times::Enable) -> Result<CudaJob, String> {
        use std::os::unix::fs::MetadataExt;
        let path = enable.ask.library.clone();
        let meta = std::fs::metadata(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let (major, minor) = tracer_inspect::process::device(&meta);
        let id = (major, minor, meta.ino());
        self.probing_libs.insert(id, Vec::new());
        let mapped = path.to_string_lossy().into_owned();
        let pid = enable.ask.pid;
        let points = in_process::Points::All;
        let mut job = self.job(
            cuda::Library::Cupti,
            id,
            path,
            &mapped,
            pid,
            "loaded",
            points,
        );
        job.enable = Some(enable);
        Ok(job)
    }

    /// The libraries being probed: their jobs come back to a session that may have ended.
    pub fn libraries_probing(&self) -> usize {
        self.probing_libs.len() + self.launch_jobs
    }

    /// The job that attaches `lib`'s entry points in the file `path` (`mapped` in `pid`):
    /// those `points` keeps.
    #[allow(clippy::too_many_arguments)]
    fn job(
        &self,
        lib: cuda::Library,
        id: LibraryId,
        path: std::path::PathBuf,
        mapped: &str,
        pid: u32,
        found_by: &str,
        points: in_process::Points,
    ) -> CudaJob {
        let points = cuda::entry_points(lib)
            .iter()
            .filter(|ep| points.keeps(ep.api))
            .filter(|ep| !(self.probing.driver_only && runtime_launch(ep.api)))
            .map(|ep| {
                // Stacks at the driver's launches only: every kernel launch reaches one
                // (cuBLAS's skip the runtime), once, with the runtime's frames above it.
                let driver_launch =
                    matches!(ep.api, api::CU_LAUNCH | api::CU_LAUNCH_EX | api::CU_GRAPH);
                let stacks = if self.probing.stacks && driver_launch {
                    cuda_cookie::STACKS
                } else {
                    0
                };
                let cookie = cuda_cookie::make(self.slot, self.all, ep.api) | stacks;
                (ep.symbol, cookie, ep.at_return)
            })
            .collect();
        CudaJob {
            slot: self.slot,
            id,
            path,
            mapped: mapped.to_owned(),
            pid,
            found_by: found_by.to_owned(),
            points,
            enable: None,
            launches_after_all: false,
        }
    }

    /// A library's probes, attached by its [`CudaJob`]; the CUPTI status of the processes
    /// that were found mapping it meanwhile is read now that they are in. Why GPU times
    /// could not be turned on, where the job was to; else what the manager is to do next.
    pub fn adopt(&mut self, probed: CudaProbed) -> Result<in_process::Adopted, String> {
        let CudaProbed {
            job,
            links,
            warning,
            took,
            enabled,
        } = probed;
        self.warnings.extend(warning);
        let ms = took.as_secs_f64() * 1e3;
        tracing::info!(path = %job.mapped, pid = job.pid, probes = links.len(), ms, "CUDA library probed");
        self.found.push(CudaLibrary {
            pid: job.pid,
            path: job.mapped.clone(),
            probes: u32::try_from(links.len()).unwrap_or(u32::MAX),
            found_after_ms: u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            found_by: job.found_by,
        });
        // A second job on one library (launch probes for another process) adds to the first's.
        self.libs.entry(job.id).or_default().extend(links);
        if job.launches_after_all {
            self.launch_jobs -= 1;
            return Ok(in_process::Adopted::default());
        }
        for pid in self.probing_libs.remove(&job.id).unwrap_or_default() {
            // Read once its probes are in: set up already (a warm process), or about to
            // be, and then its probe announces it (a read before the attach could miss
            // both, the announcement and the finished line).
            let status = injection_status(pid, &job.path, job.id, None);
            self.launched_status(pid, &status);
            self.injected.insert(pid, status);
        }
        let (Some(enabled), Some(enable)) = (enabled, job.enable) else {
            return Ok(in_process::Adopted::default());
        };
        self.enabled(enable.ask, enabled)
    }

    /// A warning for the report.
    pub fn warn(&mut self, warning: String) {
        self.warnings.push(warning);
    }

    /// Whether GPU times are being turned off before the session ends.
    pub fn switching_off(&self) -> bool {
        matches!(self.gpu_times, gpu_times::State::Switching)
    }

    /// The process whose GPU times this session turned on, to turn off before it ends (on a
    /// blocking thread, `gpu_times::turn_off`, then [`Self::switched_off`]); once.
    pub fn switch_off(&mut self) -> Option<u32> {
        match std::mem::take(&mut self.gpu_times) {
            // Gone: its exit handed everything over.
            gpu_times::State::On(ask) if !tracer_inspect::process::alive(ask.pid) => {
                gpu_times::gone(ask.pid);
                None
            }
            gpu_times::State::On(ask) => {
                self.gpu_times = gpu_times::State::Switching;
                Some(ask.pid)
            }
            other => {
                self.gpu_times = other;
                None
            }
        }
    }

    /// GPU times in `pid` are off (or could not be turned off: said in the report).
    pub fn switched_off(&mut self, pid: u32, status: Result<String, String>) {
        self.gpu_times = gpu_times::State::None;
        let line = match status {
            Ok(line) => line,
            // It exited between `switch_off`'s look and the request: its exit handed
            // everything over, and its library said so (`announced`).
            Err(_) if !tracer_inspect::process::alive(pid) => {
                gpu_times::gone(pid);
                return;
            }
            Err(e) => format!("error: turning GPU times off: {e}"),
        };
        self.announced.insert(pid, line);
    }

    /// The launches and copies so far, named, left in the kernel (for live metrics; native
    /// callers are named at the end only).
    pub fn live(&self, bpf: &mut Bpf) -> CudaReport {
        let mut counts = bpf.cuda_counts(self.slot, false);
        counts.0.extend(self.in_process_counts().0);
        let (launches, memory, unnamed) = self.rows(
            counts,
            &NativeNames {
                handles: self.handles.so_far(),
                ..NativeNames::default()
            },
        );
        CudaReport {
            launches,
            memory,
            unnamed,
            gpu_kernels: self.gpu_kernels(bpf.gpu_kernel_times(self.slot, false)),
            launch_counting: self.launch_counting.clone(),
            ..CudaReport::default()
        }
    }

    /// Detaches the probes and takes the session's counts out of the kernel.
    /// The probes, taken out to be detached off the manager's task.
    pub fn take_probes(&mut self) -> ProbeSet {
        let mut all = ProbeSet::default();
        for (_, set) in self.libs.drain() {
            all.extend(set);
        }
        all
    }
}

impl Source for CudaSession {
    /// Launches are located in the executable mapped at the exec: a process may launch and
    /// exit before its rows are read.
    fn holds_at_exec(&self) -> bool {
        true
    }

    /// Its launch stacks go through the sampler, one sample a launch.
    fn uses_sampler(&self) -> bool {
        true
    }

    /// Libraries found and still being probed.
    fn probing(&self) -> bool {
        self.libraries_probing() > 0
    }

    fn interim(&self, at: &mut Reading<'_>) -> Option<Box<dyn ReportPart>> {
        // Named from the kernel names received, not their native callers: those are named
        // from libraries' symbol tables of hundreds of MB, work for the end.
        let mut report = self.live(at.bpf);
        report.libraries = self.found.clone();
        report.warnings = self.warnings.clone();
        report.warnings.push(
            "interim: launches are counted so far; their native callers and GPU averages are named in the final report".into(),
        );
        Some(Box::new(Part(move |r: &mut tracer_report::Report| {
            r.cuda = Some(report)
        })))
    }

    fn exec(&mut self, pid: u32) {
        // Held before its first instruction: its mappings (the executable, the loader) are
        // kept for the callers of launches it may make and exit before they are read.
        if let Ok(maps) = ProcMaps::read(pid) {
            self.callers.keep(pid, &maps);
        }
    }

    fn end(mut self: Box<Self>, at: &mut Ending<'_, '_>) -> Ended {
        let slot = at.slot;
        if let Some(pid) = self.switch_off() {
            // Ended without its GPU times turned off first (its start refused after all).
            gpu_times::turn_off_detached(pid);
            self.warnings.push("GPU times were turned off after the session's last reading: kernels that ran since are not in this report".into());
        }
        // Its libraries still being probed come off when they come back (`CudaReleased`);
        // the slot stays taken until then.
        for _ in 0..self.libraries_probing() {
            at.ends.slots.hold(slot);
        }
        let probes = self.take_probes();
        let events_lost = self.drain_launch_events();
        // Read with the probes' counts: the table keeps counting after the session.
        let (inproc_rows, table_full, unseen) = self.in_process_rows();
        if unseen > 0 {
            self.warnings.push(format!("{unseen} runtime launches were not counted: each was under way when CUDA initialized inside it, before CUPTI's callbacks were on, and no later callback of the call came"));
        }
        if table_full > 0 {
            self.warnings.push(format!("{table_full} launches were not counted: tracer's injection library found no room for their rows in its table"));
        }
        if !self.in_process.is_empty() {
            at.ends.bpf.clear_cuda_inproc(slot);
        }
        at.ends.bpf.clear_cuda_allocs(slot);
        let silent = self.launched_silent();
        self.warnings.extend(silent);
        let maps = at.ends.bpf.cuda_maps();
        let counts = at.ends.last_counts(slot, maps, |bpf| {
            (
                bpf.cuda_counts(slot, true),
                bpf.gpu_kernel_times(slot, true),
            )
        });
        // The launch stacks recorded so far; later ones find no histogram for the slot.
        let stacks = self
            .probing
            .stacks
            .then(|| at.ends.sampling.end(slot))
            .flatten()
            .map(|p| Box::new(p) as Box<dyn ReportPart>);
        Ended {
            probes: Some(probes),
            part: Some(Box::new(CudaEnd {
                cuda: *self,
                counts,
                stacks,
                inproc_rows,
                inproc_lost: [
                    ("cuda_launch_table_full", table_full),
                    ("cuda_launch_unseen", unseen),
                    ("cuda_launch_events_lost", events_lost),
                ],
            })),
        }
    }
}

/// An ended CUDA session's counts, to be read and named where waiting is fine: native
/// callers are named from the symbol tables of libraries such as libtorch_cuda (hundreds of
/// MB).
struct CudaEnd {
    cuda: CudaSession,
    counts: LastCounts<CudaMaps, (CudaCounts, GpuKernelTimes)>,
    /// Its launch stacks (`--cuda-stacks`): the report's profile.
    stacks: Option<Box<dyn ReportPart>>,
    /// Launches counted in-process (`--cuda-in-process`), read at the end.
    inproc_rows: Vec<(tracer_common::CudaLaunchKey, u64)>,
    /// Launches the in-process tables lost, by cause: the report's losses.
    inproc_lost: [(&'static str, u64); 3],
}

impl CudaEnd {
    /// The session's CUDA report, named.
    pub fn finish(self) -> CudaReport {
        let (mut counts, times) = self.counts.get();
        counts.0.extend(self.inproc_rows);
        self.cuda.report(counts, times)
    }
}

impl ReportPart for CudaEnd {
    fn fill(mut self: Box<Self>, report: &mut tracer_report::Report) {
        if let Some(stacks) = self.stacks.take() {
            stacks.fill(report);
        }
        for (cause, count) in self.inproc_lost {
            if count > 0 {
                report.losses.push(tracer_report::LossEntry {
                    cause: cause.into(),
                    count,
                });
            }
        }
        report.cuda = Some(self.finish());
    }
}
