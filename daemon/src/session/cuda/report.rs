//! A CUDA session's report: its launch rows named (by the calls that made their handles, else
//! by what registered or keeps them, else by the code that launched them), its copies and
//! allocations, and the GPU times CUPTI handed over.

use std::collections::HashMap;

use tracer_common::{cuda_api as api, py_from};
use tracer_inspect::cuda;
use tracer_report::{CudaLaunch, CudaMemory, CudaReport, GpuKernelTime, GpuTimesStatus};

use super::{
    callers::{Named, NativeNames, ProcAddr},
    runtime_kernel_launch, CudaSession,
};

impl CudaSession {
    pub(super) fn report(
        mut self,
        counts: tracer_bpf::CudaCounts,
        times: Vec<(tracer_common::GpuKernelKey, tracer_common::GpuKernelStats)>,
    ) -> CudaReport {
        let (handles, read) = std::mem::take(&mut self.handles).finish();
        let mut native = self.callers.name_all(&read);
        native.handles = handles;
        let (mut rows, memory, unnamed) = self.rows(counts, &native);
        let gpu_kernels = self.gpu_kernels(times);
        gpu_averages(&mut rows, &gpu_kernels);
        // The latest word of each process this session found the library in.
        let mut gpu_times: Vec<GpuTimesStatus> = std::mem::take(&mut self.injected)
            .into_iter()
            .map(|(pid, read)| GpuTimesStatus {
                pid,
                status: self.announced.remove(&pid).unwrap_or(read),
            })
            .collect();
        gpu_times.sort_by_key(|g| g.pid);
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
            gpu_kernels,
            gpu_times,
            launch_counting: self.launch_counting,
        }
    }

    /// GPU time rows, named from CUPTI's names, most time first.
    pub(super) fn gpu_kernels(
        &self,
        times: Vec<(tracer_common::GpuKernelKey, tracer_common::GpuKernelStats)>,
    ) -> Vec<GpuKernelTime> {
        let mut rows: Vec<GpuKernelTime> = times
            .into_iter()
            .map(|(k, s)| GpuKernelTime {
                pid: k.pid,
                device: k.device,
                kernel: self.gpu_names.get(&(k.pid, k.name)).map_or_else(
                    || format!("[kernel name {:#x} not received]", k.name),
                    |n| cuda::demangle(n),
                ),
                grid: k.grid,
                block: k.block,
                executions: s.executions,
                total_ns: s.total_ns,
                min_ns: s.min_ns,
                max_ns: s.max_ns,
                name_ptr: k.name,
            })
            .collect();
        rows.sort_by(|a, b| {
            b.total_ns
                .cmp(&a.total_ns)
                .then_with(|| a.kernel.cmp(&b.kernel))
        });
        rows
    }

    /// A name for a launch row whose handle no naming call named: a runtime launch's from the
    /// registration code of the host function its handle leads to, else the symbol there,
    /// else its caller's; a driver launch made inside a runtime launch (`ROW_LINK`) from
    /// that runtime launch's; a driver function got by symbol from its host function's. With
    /// where it came from.
    fn fallback_name(
        &self,
        k: &tracer_common::CudaLaunchKey,
        native: &NativeNames,
    ) -> Option<(String, &'static str)> {
        // A handle that code got before the session and keeps in a static (CUDA 13's stubs).
        if let Some(name) = native.handles.get(&(k.pid, k.func)) {
            return Some((cuda::demangle(name), "registration code"));
        }
        let (func, caller) = if runtime_kernel_launch(k.api) {
            (k.func, k.caller)
        } else if let Some(&link) = self.links.get(&(k.pid, k.func)) {
            link
        } else {
            let stub = self.names.last(k.pid, k.func);
            return (stub != k.func)
                .then(|| stub_name(k.pid, stub, &native.addrs))
                .flatten();
        };
        if let Some(name) = self.names.name(k.pid, func) {
            return Some((cuda::demangle(name), "runtime launch"));
        }
        if let Some(name) = native.handles.get(&(k.pid, func)) {
            return Some((cuda::demangle(name), "registration code"));
        }
        let stub = self.names.last(k.pid, func);
        if let Some(named) = stub_name(k.pid, stub, &native.addrs) {
            return Some(named);
        }
        let c = native.addrs.get(&(k.pid, caller))?.sym.as_ref()?;
        Some((cuda::host_function_kernel(&c.name), "launching function"))
    }

    /// Launch and memory rows, named and sorted, and how many launch rows have no name.
    /// `native`: named native addresses (pid, address), for callers and host stubs.
    pub(super) fn rows(
        &self,
        (launches, memory): tracer_bpf::CudaCounts,
        native: &NativeNames,
    ) -> (Vec<CudaLaunch>, Vec<CudaMemory>, u64) {
        let mut unnamed = 0;
        let mut rows: Vec<CudaLaunch> = launches
            .into_iter()
            .map(|(k, n)| {
                let graph = matches!(k.api, api::CU_GRAPH | api::CUDA_GRAPH);
                let caller = native.addrs.get(&(k.pid, k.caller));
                let mut named_from = "";
                let named = self.names.name(k.pid, k.func);
                let kernel = match (named, self.cupti_name(k.pid, k.func)) {
                    _ if graph => format!("[graph exec {:#x}]", k.func),
                    (Some(name), _) => cuda::demangle(name),
                    // Where its naming call was not seen: CUPTI's name for a launch counted
                    // in-process.
                    (None, Some(name)) => {
                        named_from = "CUPTI";
                        cuda::demangle(name)
                    }
                    (None, None) => match self.fallback_name(&k, native) {
                        Some((name, from)) => {
                            named_from = from;
                            name
                        }
                        None => {
                            unnamed += 1;
                            format!("[kernel handle {:#x}: no name seen: named before tracer probed its library, or not a kernel]", k.func)
                        }
                    },
                };
                let call_site = match k.py_code {
                    0 => String::new(),
                    code => self
                        .call_sites
                        .get(&(k.pid, code, k.py_instr, k.py_names))
                        .cloned()
                        .unwrap_or_else(|| format!("[code object {code:#x}]")),
                };
                let call_site_from = match (k.py_code, k.py_elsewhere) {
                    (0, _) | (_, py_from::OWN) => "",
                    (_, py_from::LAST_LAUNCHER) => "the thread that last launched from Python",
                    _ => "the thread that last held the GIL",
                };
                CudaLaunch {
                    call_site,
                    call_site_from: call_site_from.into(),
                    pid: k.pid,
                    api: cuda::api_name(k.api).into(),
                    kernel,
                    named_from: named_from.into(),
                    caller: caller.map(|c| c.text.clone()).unwrap_or_default(),
                    row_id: k.row_id(),
                    handle: k.func,
                    grid: k.grid,
                    block: k.block,
                    shared_mem: k.shared_mem,
                    stream: k.stream,
                    launches: n,
                    gpu_avg_ns: None,
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

/// Each launch row's GPU time per execution, from the GPU rows of its kernel and
/// configuration (in its process, over devices).
fn gpu_averages(rows: &mut [CudaLaunch], gpu: &[GpuKernelTime]) {
    /// (pid, kernel, grid, block).
    type Config<'a> = (u32, &'a str, [u32; 3], [u32; 3]);
    let mut by: HashMap<Config, (u64, u64)> = HashMap::new();
    for g in gpu {
        let e = by
            .entry((g.pid, g.kernel.as_str(), g.grid, g.block))
            .or_default();
        e.0 += g.executions;
        e.1 += g.total_ns;
    }
    for r in rows {
        if let Some(&(n, ns)) = by.get(&(r.pid, r.kernel.as_str(), r.grid, r.block)) {
            r.gpu_avg_ns = Some(ns / n.max(1));
        }
    }
}

/// The kernel a host function stands for: the name its library's code registers for it, as
/// the runtime has it, else a symbol that starts there (nvcc names a host stub after its
/// kernel). With where it came from.
fn stub_name(
    pid: u32,
    stub: u64,
    native: &HashMap<ProcAddr, Named>,
) -> Option<(String, &'static str)> {
    let named = native.get(&(pid, stub))?;
    if let Some(name) = &named.registered {
        return Some((cuda::demangle(name), "registration code"));
    }
    let sym = named.sym.as_ref().filter(|s| s.offset == 0)?;
    Some((cuda::host_function_kernel(&sym.name), "host stub symbol"))
}
