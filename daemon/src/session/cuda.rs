//! Counting mode's CUDA source (`--cuda`): probes on each CUDA library the session's
//! processes map — found at the start and looked for again while it runs, since programs
//! map them late (`import torch`, or the runtime opening the driver at the first CUDA call)
//! — names for the kernel handles launches carry, and the report.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use tracer_common::{cuda_api as api, cuda_cookie, CudaNameEvent};

use crate::{
    bpf::{Bpf, UprobeLinks},
    cuda::{self, Names},
    report::{CudaLaunch, CudaLibrary, CudaMemory, CudaReport},
    unwind::ProcMaps,
};

/// How often GPU metrics are read unless asked otherwise.
pub const GPU_PERIOD: Duration = Duration::from_millis(100);

/// How often a session's processes are looked at for newly mapped CUDA libraries.
pub const LOOK_EVERY: Duration = Duration::from_millis(20);

pub struct CudaSession {
    slot: u8,
    all: bool,
    started: Instant,
    pub next_look: Instant,
    /// Probed libraries by (device, inode), with their probes.
    libs: HashMap<(u32, u32, u64), UprobeLinks>,
    found: Vec<CudaLibrary>,
    names: Names,
    /// (pid, code, instruction, names id) → "qualname (file:line)", read when first seen.
    call_sites: HashMap<(u32, u64, u64, u64), String>,
    warnings: Vec<String>,
    gpu: crate::gpu::GpuSampler,
}

impl CudaSession {
    /// `gpu_period`: how often GPU metrics are read; `tracks`: where a tracing session
    /// puts them on its timeline.
    pub fn new(
        slot: u8,
        all: bool,
        gpu_period: Duration,
        tracks: Option<crate::gpu::TraceTracks>,
    ) -> Self {
        Self {
            slot,
            all,
            started: Instant::now(),
            next_look: Instant::now(),
            libs: HashMap::new(),
            found: Vec::new(),
            names: Names::default(),
            call_sites: HashMap::new(),
            warnings: Vec::new(),
            gpu: crate::gpu::GpuSampler::start(gpu_period, tracks),
        }
    }

    pub fn on_name(&mut self, ev: &CudaNameEvent, sampling: &super::sampling::Sampling) {
        if ev.api != tracer_common::cuda_api::CALL_SITE {
            self.names.on_event(ev);
            return;
        }
        let key = (ev.pid, ev.handle, ev.other, ev.extra);
        if self.call_sites.contains_key(&key) {
            return;
        }
        let site = sampling
            .version(ev.pid)
            .and_then(|v| crate::stacks::python_location(ev.pid, ev.handle, ev.other, ev.extra, v))
            .map_or_else(
                || format!("[code object {:#x}]", ev.handle),
                |(q, f, line)| format!("{q} ({f}:{line})"),
            );
        self.call_sites.insert(key, site);
    }

    /// Probes the CUDA libraries `pid` maps that are not probed yet.
    /// Probes the CUDA libraries `pid` maps that are not probed yet; whether it maps any.
    pub fn look(&mut self, bpf: &mut Bpf, pid: u32) -> bool {
        crate::container::note(pid, false);
        let Ok(maps) = ProcMaps::read(pid) else {
            return false;
        };
        let mut maps_cuda = false;
        for m in maps.entries() {
            let Some(lib) = cuda::library(std::path::Path::new(&m.path)) else {
                continue;
            };
            maps_cuda = true;
            let id = (m.dev.0, m.dev.1, m.inode);
            if m.deleted() || self.libs.contains_key(&id) {
                continue;
            }
            // Through the process's root: it may live in a container.
            let path = format!("/proc/{pid}/root{}", m.path);
            let mut links = Vec::new();
            for ep in cuda::entry_points(lib) {
                let Ok(targets) = crate::native::resolve(&format!("{path}:{}", ep.symbol), None)
                else {
                    continue; // Not every version exports every variant.
                };
                let Some(t) = targets.into_iter().find(|t| t.symbol == ep.symbol) else {
                    continue;
                };
                let cookie = cuda_cookie::make(self.slot, self.all, ep.api);
                match bpf.attach_cuda(&t.binary, t.file_offset, cookie, ep.at_return) {
                    Ok(l) => links.extend(l),
                    Err(e) => {
                        // One failure says it for the library (a program that does not load
                        // fails on every entry point).
                        self.warnings
                            .push(format!("{}: {}: {e}", m.path, ep.symbol));
                        break;
                    }
                }
            }
            tracing::info!(path = %m.path, pid, probes = links.len(), "CUDA library probed");
            self.found.push(CudaLibrary {
                pid,
                path: m.path.clone(),
                probes: u32::try_from(links.len()).unwrap_or(u32::MAX),
                found_after_ms: u64::try_from(self.started.elapsed().as_millis())
                    .unwrap_or(u64::MAX),
            });
            self.libs.insert(id, links);
        }
        maps_cuda
    }

    /// A launched handle's demangled kernel name, if a naming call for it was seen.
    pub fn kernel_name(&self, pid: u32, handle: u64) -> Option<String> {
        self.names.name(pid, handle).map(cuda::demangle)
    }

    /// The launches and copies so far, named, left in the kernel (for live metrics).
    pub fn live(&self, bpf: &mut Bpf) -> CudaReport {
        let (launches, memory, unnamed) = self.rows(bpf.cuda_counts(self.slot, false));
        CudaReport {
            launches,
            memory,
            unnamed,
            ..CudaReport::default()
        }
    }

    /// Detaches the probes and takes the session's counts out of the kernel.
    pub fn finish(mut self, bpf: &mut Bpf) -> CudaReport {
        for (_, links) in std::mem::take(&mut self.libs) {
            bpf.detach_uprobes(links);
        }
        let (rows, memory, unnamed) = self.rows(bpf.cuda_counts(self.slot, true));
        let mut warnings = self.warnings;
        if self.found.is_empty() {
            warnings.push("no CUDA library (libcudart.so*, libcuda.so*) was seen mapped by the followed processes".into());
        }
        CudaReport {
            gpu: self.gpu.finish(),
            libraries: self.found,
            launches: rows,
            memory,
            unnamed,
            warnings,
        }
    }

    /// Launch and memory rows, named and sorted, and how many launch rows have no name.
    fn rows(
        &self,
        (launches, memory): crate::bpf::CudaCounts,
    ) -> (Vec<CudaLaunch>, Vec<CudaMemory>, u64) {
        let mut unnamed = 0;
        let mut rows: Vec<CudaLaunch> = launches
            .into_iter()
            .map(|(k, n)| {
                let graph = matches!(k.api, api::CU_GRAPH | api::CUDA_GRAPH);
                let kernel = match self.names.name(k.pid, k.func) {
                    _ if graph => format!("[graph exec {:#x}]", k.func),
                    Some(name) => cuda::demangle(name),
                    None => {
                        unnamed += 1;
                        format!("[kernel handle {:#x}: no name seen: named before tracer probed its library, or not a kernel]", k.func)
                    }
                };
                let call_site = match k.py_code {
                    0 => String::new(),
                    code => self
                        .call_sites
                        .get(&(k.pid, code, k.py_instr, k.py_names))
                        .cloned()
                        .unwrap_or_else(|| format!("[code object {code:#x}]")),
                };
                CudaLaunch {
                    call_site,
                    pid: k.pid,
                    api: cuda::api_name(k.api).into(),
                    kernel,
                    handle: k.func,
                    grid: k.grid,
                    block: k.block,
                    shared_mem: k.shared_mem,
                    stream: k.stream,
                    launches: n,
                }
            })
            .collect();
        rows.sort_by(|a, b| {
            b.launches
                .cmp(&a.launches)
                .then_with(|| a.kernel.cmp(&b.kernel))
                .then(a.api.cmp(&b.api))
        });
        let mut memory: Vec<CudaMemory> = memory
            .into_iter()
            .map(|(k, s)| {
                let (which, direction) = cuda::memcpy_kind(k.kind);
                let is_copy = matches!(which, api::CUDA_MEMCPY | api::CUDA_MEMCPY_ASYNC);
                let direction = match which {
                    _ if is_copy => direction,
                    api::CU_MEMCPY_HTOD => "host to device",
                    api::CU_MEMCPY_DTOH => "device to host",
                    _ => "",
                };
                CudaMemory {
                    pid: k.pid,
                    api: cuda::api_name(which).into(),
                    direction: direction.into(),
                    calls: s.calls,
                    bytes: s.bytes,
                }
            })
            .collect();
        memory.sort_by(|a, b| (a.pid, &a.api, &a.direction).cmp(&(b.pid, &b.api, &b.direction)));
        (rows, memory, unnamed)
    }
}
