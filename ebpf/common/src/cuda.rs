//! CUDA's probes and user space: the entry points probed and their attach cookie, the
//! launch and memory counts, GPU kernel executions from CUPTI, and the naming records.

/// CUDA entry points tracer probes; the low bits of a CUDA probe's attach cookie.
/// `CudaLaunchKey::py_elsewhere`: whose Python frame a launch's call site is.
pub mod py_from {
    /// The launching thread's own.
    pub const OWN: u32 = 0;
    /// The thread that last held the GIL.
    pub const GIL_HOLDER: u32 = 1;
    /// The thread that made the process's last CUDA launch from Python (the one that handed
    /// the work over: a backward pass after its forward pass).
    pub const LAST_LAUNCHER: u32 = 2;
}

pub mod cuda_api {
    /// libcuda `cuLaunchKernel` (and `_ptsz`): f, grid, block, shared memory, stream.
    pub const CU_LAUNCH: u32 = 1;
    /// libcuda `cuLaunchKernelEx` (and `_ptsz`): a `CUlaunchConfig` and f.
    pub const CU_LAUNCH_EX: u32 = 2;
    /// libcudart `cudaLaunchKernel` (and `_ptsz`): func, dim3 grid and block by value.
    pub const CUDA_LAUNCH: u32 = 3;
    /// libcudart `cudaLaunchKernelExC` (and `_ptsz`): a `cudaLaunchConfig_t` and func.
    pub const CUDA_LAUNCH_EX: u32 = 4;
    /// `cuGraphLaunch` / `cudaGraphLaunch`: a graph exec and a stream.
    pub const CU_GRAPH: u32 = 5;
    pub const CUDA_GRAPH: u32 = 6;
    /// Naming: `cuModuleGetFunction(&f, module, name)`.
    pub const CU_MODULE_GET_FUNCTION: u32 = 10;
    /// `cuLibraryGetKernel(&kernel, library, name)`.
    pub const CU_LIBRARY_GET_KERNEL: u32 = 11;
    /// `cuKernelGetFunction(&f, kernel)`: a function for a named kernel.
    pub const CU_KERNEL_GET_FUNCTION: u32 = 12;
    /// `__cudaGetKernel(&kernel, host_stub)`: the runtime's handle for a host stub.
    pub const CUDA_GET_KERNEL: u32 = 13;
    /// `__cudaRegisterFunction(module, host_stub, device_fun, device_name, …)`.
    pub const CUDA_REGISTER_FUNCTION: u32 = 14;
    /// `cudaGetFuncBySymbol(&f, host_stub)`: the driver's function for a host stub, which
    /// code then launches with `cuLaunchKernel*` (as cluster launches do).
    pub const CUDA_GET_FUNC_BY_SYMBOL: u32 = 15;
    /// Copies and allocations.
    pub const CUDA_MEMCPY: u32 = 20;
    pub const CUDA_MEMCPY_ASYNC: u32 = 21;
    pub const CU_MEMCPY_HTOD: u32 = 22;
    pub const CU_MEMCPY_DTOH: u32 = 23;
    pub const CUDA_MALLOC: u32 = 24;
    pub const CUDA_FREE: u32 = 25;
    pub const CU_MEM_ALLOC: u32 = 26;
    pub const CU_MEM_FREE: u32 = 27;
    pub const CUDA_DEVICE_SYNCHRONIZE: u32 = 28;
    pub const CUDA_STREAM_SYNCHRONIZE: u32 = 29;
    /// Not an entry point: a `CudaNameEvent` announcing a launch's Python call site
    /// (`handle` = code object, `other` = instruction, `extra` = names id).
    pub const CALL_SITE: u32 = 30;
    /// Not an entry point: a new launch row (`handle` = the launched handle, `other` = the
    /// native caller's return address, `extra` = the entry point), sent once per row so that
    /// user space names the caller (and an unnamed handle) while the process lives.
    pub const LAUNCH_ROW: u32 = 31;
    /// Not an entry point: a followed process mapped a file executable (`handle` = the
    /// address, `other` = the length); it may be a CUDA library to probe now. `extra` = 1:
    /// the file is one, and the process is stopped (held) until the daemon continues it.
    pub const LIBRARY_MAPPED: u32 = 32;
    /// Not an entry point: a driver launch row made inside a runtime launch that had just
    /// made a new row on the same thread (`handle` = the driver's handle, `other` = the
    /// runtime's, `extra` = the runtime call's return address): names for the one serve
    /// the other.
    pub const ROW_LINK: u32 = 33;
    /// `tracer_cupti_kernel(const CuptiKernel *)` in tracer's CUPTI injection library: a
    /// kernel's execution on the GPU. As a `CudaNameEvent`: a kernel name CUPTI gave
    /// (`handle` = its pointer).
    pub const CUPTI_KERNEL: u32 = 40;
    /// `tracer_cupti_dropped(u64 records)`: CUPTI dropped kernel records.
    pub const CUPTI_DROPPED: u32 = 41;
    /// `tracer_cupti_initialized(const char *status)`: the injection library set up CUPTI
    /// (or failed to); sent as a `CudaNameEvent` with the status line as its name.
    pub const CUPTI_STATUS: u32 = 42;
    /// `tracer_cupti_launch_elsewhere(const CudaLaunchKey *, last_tstate, last_thread_id)`:
    /// a launch counted in-process (`launches`) from a thread without a Python frame in a
    /// Python process; its probe finds the call site and counts it for the sessions that
    /// count the process in-process.
    pub const CUPTI_LAUNCH: u32 = 43;
    /// `tracer_cupti_new_row(const CudaLaunchKey *, const char *name)`: the injection
    /// library made a row in its launch table; its probe announces the row's call site,
    /// caller and CUPTI's kernel name (`handle` = the launched handle, `other` = the name's
    /// address) while the process lives, as the launch probes announce their new rows.
    pub const CUPTI_ROW: u32 = 44;
    pub const MASK: u64 = 0xff;

    /// The entry point's name as reports show it.
    pub fn name(which: u32) -> &'static str {
        match which {
            CU_LAUNCH => "cuLaunchKernel",
            CU_LAUNCH_EX => "cuLaunchKernelEx",
            CUDA_LAUNCH => "cudaLaunchKernel",
            CUDA_LAUNCH_EX => "cudaLaunchKernelExC",
            CU_GRAPH => "cuGraphLaunch",
            CUDA_GRAPH => "cudaGraphLaunch",
            CUDA_MEMCPY => "cudaMemcpy",
            CUDA_MEMCPY_ASYNC => "cudaMemcpyAsync",
            CU_MEMCPY_HTOD => "cuMemcpyHtoD",
            CU_MEMCPY_DTOH => "cuMemcpyDtoH",
            CUDA_MALLOC => "cudaMalloc",
            CUDA_FREE => "cudaFree",
            CU_MEM_ALLOC => "cuMemAlloc",
            CU_MEM_FREE => "cuMemFree",
            CUDA_DEVICE_SYNCHRONIZE => "cudaDeviceSynchronize",
            CUDA_STREAM_SYNCHRONIZE => "cudaStreamSynchronize",
            _ => "?",
        }
    }

    /// A kernel launch's entry point (graphs aside): what `--cuda-in-process` counts
    /// in-process, and what the launch probes then skip.
    pub const fn is_kernel_launch(which: u32) -> bool {
        matches!(
            which,
            CU_LAUNCH | CU_LAUNCH_EX | CUDA_LAUNCH | CUDA_LAUNCH_EX
        )
    }

    /// `cudaMemcpyKind`, as the probe folds it into a memory key's kind (× 100).
    pub fn memcpy_kind(kind: u32) -> (u32, &'static str) {
        let direction = match kind / 100 {
            0 => "host to host",
            1 => "host to device",
            2 => "device to host",
            3 => "device to device",
            4 => "default (by pointer)",
            _ => "unknown",
        };
        (kind % 100, direction)
    }

    /// Whether a memory kind is a `cudaMemcpy*` (whose kind carries a direction).
    pub fn is_memcpy(kind: u32) -> bool {
        matches!(kind % 100, CUDA_MEMCPY | CUDA_MEMCPY_ASYNC)
    }
}

/// The attach cookie of a CUDA probe: session slot, whether the session follows every
/// process, and the entry point (`cuda_api`).
pub mod cuda_cookie {
    pub const SLOT_SHIFT: u64 = 32;
    pub const ALL: u64 = 1 << 31;
    /// `--cuda-stacks`: each launch also records its stack on the sampling ring.
    pub const STACKS: u64 = 1 << 30;

    pub const fn make(slot: u8, all: bool, api: u32) -> u64 {
        ((slot as u64) << SLOT_SHIFT)
            | if all { ALL } else { 0 }
            | (api as u64 & super::cuda_api::MASK)
    }
}

/// Key of `CUDA_LAUNCHES`: launches of one kernel handle with one configuration, through one
/// entry point, in one process, for one session. The value is the count (u64).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CudaLaunchKey {
    pub slot: u32,
    pub pid: u32,
    pub api: u32,
    pub shared_mem: u32,
    /// CUfunction, runtime kernel handle (or host stub), or graph exec.
    pub func: u64,
    pub stream: u64,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Whose Python frame is below (`py_from`): the launching thread's own, or, for a thread
    /// that runs no Python, the thread's it works for.
    pub py_elsewhere: u32,
    pub _pad: u32,
    /// The launching thread's innermost Python frame: code object, current instruction and
    /// `py_names_id` (0: none, or not a Python thread).
    pub py_code: u64,
    pub py_instr: u64,
    pub py_names: u64,
    /// The return address of the probed call: the native code that launched (for nvcc's
    /// code, inside the kernel's host stub).
    pub caller: u64,
}

impl CudaLaunchKey {
    /// Names the row within its session (the slot left out), so that a trace event can carry
    /// it in one word and the exporter find the row's configuration and call sites.
    pub fn row_id(&self) -> u64 {
        let words = [
            self.pid as u64 | (self.api as u64) << 32,
            self.shared_mem as u64,
            self.func,
            self.stream,
            self.grid[0] as u64 | (self.grid[1] as u64) << 32,
            self.grid[2] as u64 | (self.block[0] as u64) << 32,
            self.block[1] as u64 | (self.block[2] as u64) << 32,
            self.py_elsewhere as u64,
            self.py_code,
            self.py_instr,
            self.py_names,
            self.caller,
        ];
        // FNV-1a over words, with a shift to spread the high bits: cheap enough for the probe.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut i = 0;
        while i < words.len() {
            h = (h ^ words[i]).wrapping_mul(0x0100_0000_01b3);
            h ^= h >> 29;
            i += 1;
        }
        h
    }
}

/// Key of `CUDA_MEMORY`: copies or allocations of one kind, in one process, for one session.
/// `kind`: the `cuda_api` entry point; for `cudaMemcpy*`, plus 100 × its `cudaMemcpyKind`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CudaMemKey {
    pub slot: u32,
    pub pid: u32,
    pub kind: u32,
    pub _pad: u32,
}

/// Value of `CUDA_MEMORY`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaMemStats {
    pub calls: u64,
    pub bytes: u64,
}

pub const CUDA_NAME_LEN: usize = 512;

/// A kernel's execution on the GPU, as tracer's CUPTI injection library (`libtracer_cupti.so`)
/// passes it to `tracer_cupti_kernel`, whose probe reads it. Times are CLOCK_MONOTONIC ns
/// (the library converts CUPTI's timestamps), the clock of every other trace event.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CuptiKernel {
    /// The kernel's name as CUPTI gives it (`const char *`, mangled; CUPTI keeps one string
    /// per kernel for the process's life).
    pub name: u64,
    pub start_ns: u64,
    pub end_ns: u64,
    pub device: u32,
    pub stream: u32,
    /// CUPTI's correlation id of the launch.
    pub correlation: u32,
    /// Static plus dynamic shared memory, bytes.
    pub shared_mem: u32,
    pub grid: [u32; 3],
    pub block: [u32; 3],
}

/// Key of `GPU_KERNELS`: executions of one kernel (by CUPTI's name pointer) with one grid and
/// block on one device, in one process, for one session.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GpuKernelKey {
    pub slot: u32,
    pub pid: u32,
    pub name: u64,
    pub device: u32,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub _pad: u32,
}

/// Value of `GPU_KERNELS`: GPU time, ns.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuKernelStats {
    pub executions: u64,
    pub total_ns: u64,
    pub min_ns: u64,
    pub max_ns: u64,
}

/// Sent on `CUDA_NAMES` when a process names a kernel handle: `handle` is what launches
/// will pass; `other` is the kernel (`CU_KERNEL_GET_FUNCTION`) or host stub
/// (`CUDA_GET_KERNEL`, `CUDA_GET_FUNC_BY_SYMBOL`, `CUDA_REGISTER_FUNCTION`) it stands for; `name` the device name when
/// the call carries one.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CudaNameEvent {
    pub pid: u32,
    pub api: u32,
    pub handle: u64,
    pub other: u64,
    pub extra: u64,
    /// `CALL_SITE`: `PySampleProc::origin` of the process (where else its code objects are).
    pub origin: u32,
    pub _pad: u32,
    pub name: [u8; CUDA_NAME_LEN],
}
