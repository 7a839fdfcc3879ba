//! What tracer knows of CUDA's libraries: which entry points to probe in libcudart (the
//! runtime API) and libcuda (the driver API), and how launches' kernel handles get names
//! from the calls that create them.

mod injection;
mod launch_events;
mod launch_table;
mod registered;

pub use injection::{Injection, PythonAt, CUPTI_PATH_LEN, REFUSED_SECURE, STATUS_LEN};
pub use launch_events::{EventCursor, LaunchEvent};
pub use launch_table::{Counts as LaunchCounts, LaunchTable, Row as LaunchRow};
pub use registered::Registrations;

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use tracer_common::{cuda_api as api, CudaNameEvent};

/// Which of CUDA's libraries a binary is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    Runtime,
    Driver,
    /// tracer's CUPTI injection library (`libtracer_cupti.so`): GPU kernel times.
    Cupti,
}

/// The file name of tracer's CUPTI injection library.
pub const INJECTION_LIBRARY: &str = "libtracer_cupti.so";

/// `libcudart.so*` (the runtime, often inside a wheel), `libcuda.so*` (the driver's) or
/// tracer's CUPTI injection library.
pub fn library(path: &Path) -> Option<Library> {
    let name = path.file_name()?.to_str()?;
    if name.starts_with("libcudart.so") {
        Some(Library::Runtime)
    } else if name.starts_with("libcuda.so") {
        Some(Library::Driver)
    } else if name == INJECTION_LIBRARY {
        Some(Library::Cupti)
    } else {
        None
    }
}

/// CUPTI's file names, newest first: what is looked for beside the CUDA runtime.
pub const CUPTI_SONAMES: &[&str] = &["libcupti.so.13", "libcupti.so.12", "libcupti.so"];

/// Whether `path` is CUPTI itself (`libcupti.so*`), not tracer's injection library. Kept out
/// of [`library`]: CUPTI is not probed, only found.
pub fn is_cupti(path: &Path) -> bool {
    path.file_name()
        .and_then(|f| f.to_str())
        .is_some_and(|f| f.starts_with("libcupti.so"))
}

/// Directories where CUPTI may sit, given the directory of the CUDA runtime (`libcudart.so*`):
/// that directory (a CUDA 13 wheel keeps both in `nvidia/cu13/lib`), the toolkit's
/// `extras/CUPTI/lib64` beside its `lib64`, and CUDA 12 wheels' sibling
/// `nvidia/cuda_cupti/lib` beside `nvidia/cuda_runtime/lib`. The injection library searches
/// the same directories when CUDA's driver loads it (`daemon/cupti/src/find.rs`, which cannot
/// depend on this crate: its unit tests check the two agree).
pub fn cupti_beside(runtime_dir: &Path) -> Vec<PathBuf> {
    let mut dirs = vec![runtime_dir.to_path_buf()];
    if let Some(up) = runtime_dir.parent() {
        dirs.push(up.join("extras/CUPTI/lib64"));
        if let Some(pkgs) = up.parent() {
            dirs.push(pkgs.join("cuda_cupti/lib"));
        }
    }
    dirs
}

/// An entry point: its symbol, what the probe decodes, and whether its result is read at
/// the return (handles and pointers written through the first argument).
pub struct EntryPoint {
    pub symbol: &'static str,
    pub api: u32,
    pub at_return: bool,
}

const fn entry(symbol: &'static str, api: u32, at_return: bool) -> EntryPoint {
    EntryPoint {
        symbol,
        api,
        at_return,
    }
}

pub const RUNTIME: &[EntryPoint] = &[
    entry("cudaLaunchKernel", api::CUDA_LAUNCH, false),
    entry("cudaLaunchKernel_ptsz", api::CUDA_LAUNCH, false),
    entry("cudaLaunchKernelExC", api::CUDA_LAUNCH_EX, false),
    entry("cudaLaunchKernelExC_ptsz", api::CUDA_LAUNCH_EX, false),
    entry("cudaGraphLaunch", api::CUDA_GRAPH, false),
    entry("cudaGraphLaunch_ptsz", api::CUDA_GRAPH, false),
    entry("cudaMemcpy", api::CUDA_MEMCPY, false),
    entry("cudaMemcpy_ptds", api::CUDA_MEMCPY, false),
    entry("cudaMemcpyAsync", api::CUDA_MEMCPY_ASYNC, false),
    entry("cudaMemcpyAsync_ptsz", api::CUDA_MEMCPY_ASYNC, false),
    entry("cudaMalloc", api::CUDA_MALLOC, true),
    entry("cudaFree", api::CUDA_FREE, false),
    entry("cudaDeviceSynchronize", api::CUDA_DEVICE_SYNCHRONIZE, false),
    entry("cudaStreamSynchronize", api::CUDA_STREAM_SYNCHRONIZE, false),
    entry("__cudaGetKernel", api::CUDA_GET_KERNEL, true),
    entry("cudaGetKernel", api::CUDA_GET_KERNEL, true),
    entry("cudaGetFuncBySymbol", api::CUDA_GET_FUNC_BY_SYMBOL, true),
    entry("__cudaRegisterFunction", api::CUDA_REGISTER_FUNCTION, false),
];

pub const DRIVER: &[EntryPoint] = &[
    entry("cuLaunchKernel", api::CU_LAUNCH, false),
    entry("cuLaunchKernel_ptsz", api::CU_LAUNCH, false),
    entry("cuLaunchKernelEx", api::CU_LAUNCH_EX, false),
    entry("cuLaunchKernelEx_ptsz", api::CU_LAUNCH_EX, false),
    entry("cuGraphLaunch", api::CU_GRAPH, false),
    entry("cuGraphLaunch_ptsz", api::CU_GRAPH, false),
    entry("cuMemcpyHtoD_v2", api::CU_MEMCPY_HTOD, false),
    entry("cuMemcpyDtoH_v2", api::CU_MEMCPY_DTOH, false),
    entry("cuMemAlloc_v2", api::CU_MEM_ALLOC, true),
    entry("cuMemFree_v2", api::CU_MEM_FREE, false),
    entry("cuModuleGetFunction", api::CU_MODULE_GET_FUNCTION, true),
    entry("cuLibraryGetKernel", api::CU_LIBRARY_GET_KERNEL, true),
    entry("cuKernelGetFunction", api::CU_KERNEL_GET_FUNCTION, true),
];

/// The injection library's probe points: a kernel record, dropped records, its setup's outcome.
pub const CUPTI: &[EntryPoint] = &[
    entry("tracer_cupti_kernel", api::CUPTI_KERNEL, false),
    entry("tracer_cupti_dropped", api::CUPTI_DROPPED, false),
    entry("tracer_cupti_initialized", api::CUPTI_STATUS, false),
    entry("tracer_cupti_launch_elsewhere", api::CUPTI_LAUNCH, false),
    entry("tracer_cupti_new_row", api::CUPTI_ROW, false),
];

pub fn entry_points(lib: Library) -> &'static [EntryPoint] {
    match lib {
        Library::Runtime => RUNTIME,
        Library::Driver => DRIVER,
        Library::Cupti => CUPTI,
    }
}

/// The status line tracer's injection library keeps in `tracer_cupti_status` (what it found
/// and turned on, or why it could not), read from process `pid`'s memory. `file`: the
/// library (through the process's root); `maps`: the process's mappings of it.
pub fn injection_status(
    pid: u32,
    file: &Path,
    maps: &[&crate::process::MapEntry],
) -> Result<String, String> {
    Injection::find(pid, file, maps)?.status()
}

/// A kernel name CUPTI keeps in process `pid`'s memory at `addr` (live views name GPU
/// executions with it before the session's end), demangled.
pub fn name_in_process(pid: u32, addr: u64) -> Option<String> {
    let name = c_string(pid, addr, tracer_common::CUDA_NAME_LEN).ok()?;
    Some(demangle(&name))
}

/// A NUL-terminated string in process `pid`'s memory, at most `max` bytes of it, read a page
/// at a time: a string may end just before an unmapped page.
pub(crate) fn c_string(pid: u32, addr: u64, max: usize) -> std::io::Result<String> {
    const PAGE: u64 = 4096;
    let mut out = Vec::new();
    let mut at = addr;
    while out.len() < max {
        let chunk = (PAGE - at % PAGE).min((max - out.len()) as u64) as usize;
        let mut buf = vec![0u8; chunk];
        crate::python::memory::read(pid, at, &mut buf)?;
        if let Some(n) = buf.iter().position(|&b| b == 0) {
            out.extend_from_slice(&buf[..n]);
            break;
        }
        out.extend_from_slice(&buf);
        at += chunk as u64;
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

pub use tracer_common::cuda_api::{is_memcpy, memcpy_kind, name as api_name};

/// A name record's string (up to its NUL).
pub fn event_name(ev: &CudaNameEvent) -> String {
    let len = ev
        .name
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(ev.name.len());
    String::from_utf8_lossy(&ev.name[..len]).into_owned()
}

/// Kernel handles → names, per process, from the naming calls seen.
#[derive(Default)]
pub struct Names {
    /// (pid, handle) → device name: functions and kernels named at load, host stubs at
    /// registration.
    named: HashMap<(u32, u64), String>,
    /// (pid, handle) → the handle it stands for: a function for its kernel, a runtime
    /// kernel or a function got by symbol for its host stub.
    stands_for: HashMap<(u32, u64), u64>,
}

impl Names {
    pub fn on_event(&mut self, ev: &CudaNameEvent) {
        let name = event_name(ev);
        match ev.api {
            api::CU_MODULE_GET_FUNCTION
            | api::CU_LIBRARY_GET_KERNEL
            | api::CUDA_REGISTER_FUNCTION => {
                self.named.insert((ev.pid, ev.handle), name);
            }
            api::CU_KERNEL_GET_FUNCTION | api::CUDA_GET_KERNEL | api::CUDA_GET_FUNC_BY_SYMBOL => {
                self.stands_for.insert((ev.pid, ev.handle), ev.other);
            }
            _ => {}
        }
    }

    /// The last handle `handle` stands for (itself when nothing was seen): for the runtime's
    /// handles, the host stub when `__cudaGetKernel` was seen.
    pub fn last(&self, pid: u32, handle: u64) -> u64 {
        let mut h = handle;
        for _ in 0..4 {
            match self.stands_for.get(&(pid, h)) {
                Some(&next) => h = next,
                None => break,
            }
        }
        h
    }

    /// The device name of a launched handle, following what it stands for. The runtime's
    /// handles may also be the kernels (`CUkernel`) it got from the driver.
    pub fn name(&self, pid: u32, handle: u64) -> Option<&str> {
        let mut h = handle;
        for _ in 0..4 {
            if let Some(n) = self.named.get(&(pid, h)) {
                return Some(n);
            }
            h = *self.stands_for.get(&(pid, h))?;
        }
        None
    }
}

/// Whether the executable mapping a process just made at `addr` (`len` bytes) is one of
/// CUDA's libraries: one readlink, so that only those cost a look at all its mappings.
pub fn mapped_library(pid: u32, addr: u64, len: u64) -> bool {
    const PAGE: u64 = 4096;
    let end = addr.saturating_add(len.div_ceil(PAGE) * PAGE);
    std::fs::read_link(format!("/proc/{pid}/map_files/{addr:x}-{end:x}"))
        // Unreadable (gone already, or a kernel without map_files): look anyway.
        .map_or(true, |p| library(&p).is_some())
}

/// The kernel a host-side function stands for, from its symbol: nvcc names a kernel's host
/// stub after the kernel (demangled by the symbolizer already) and its launch helper
/// `__device_stub__` + the kernel's mangled name without its `_`.
pub fn host_function_kernel(symbol: &str) -> String {
    match symbol.strip_prefix("__device_stub__") {
        Some(rest) if rest.starts_with('Z') => demangle(&format!("_{rest}")),
        _ => symbol.to_owned(),
    }
}

/// A C++ device name demangled as c++filt does (`_Z6matmulPfS_S_i` → `matmul(float*,
/// float*, float*, int)`); other names as they are.
pub fn demangle(name: &str) -> String {
    crate::demangle::cpp(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(api: u32, handle: u64, other: u64, name: &str) -> CudaNameEvent {
        let mut e = CudaNameEvent {
            pid: 7,
            api,
            handle,
            other,
            extra: 0,
            origin: 0,
            _pad: 0,
            name: [0; tracer_common::CUDA_NAME_LEN],
        };
        e.name[..name.len()].copy_from_slice(name.as_bytes());
        e
    }

    #[test]
    fn handles_are_named_through_what_they_stand_for() {
        let mut n = Names::default();
        n.on_event(&ev(api::CUDA_REGISTER_FUNCTION, 0x1000, 0, "_Z4reluPfi"));
        n.on_event(&ev(api::CUDA_GET_KERNEL, 0xa0, 0x1000, ""));
        n.on_event(&ev(api::CU_LIBRARY_GET_KERNEL, 0xb0, 0, "_Z4reluPfi"));
        n.on_event(&ev(api::CU_KERNEL_GET_FUNCTION, 0xc0, 0xb0, ""));
        n.on_event(&ev(
            api::CU_MODULE_GET_FUNCTION,
            0xd0,
            0,
            "triton_poi_fused_add_0",
        ));
        assert_eq!(n.name(7, 0xa0), Some("_Z4reluPfi"));
        assert_eq!(n.name(7, 0xc0), Some("_Z4reluPfi"));
        assert_eq!(n.name(7, 0xd0), Some("triton_poi_fused_add_0"));
        n.on_event(&ev(api::CUDA_GET_FUNC_BY_SYMBOL, 0xf0, 0x1000, ""));
        assert_eq!(
            n.name(7, 0xf0),
            Some("_Z4reluPfi"),
            "a function got by symbol"
        );
        assert_eq!(n.name(8, 0xd0), None, "handles are per process");
        assert_eq!(demangle("_Z4reluPfi"), "relu(float*, int)");
        assert_eq!(demangle("triton_poi_fused_add_0"), "triton_poi_fused_add_0");
        assert_eq!(
            n.last(7, 0xa0),
            0x1000,
            "a runtime handle leads to its host stub"
        );
        assert_eq!(n.last(7, 0xe0), 0xe0);
        assert_eq!(
            host_function_kernel("__device_stub__Z4reluPfi"),
            "relu(float*, int)"
        );
        assert_eq!(
            host_function_kernel("relu(float*, int)"),
            "relu(float*, int)"
        );
    }

    #[test]
    fn names_are_read_from_a_process() {
        let name = std::ffi::CString::new("_Z4reluPfi").unwrap();
        let got = name_in_process(std::process::id(), name.as_ptr() as u64);
        assert_eq!(got.as_deref(), Some("relu(float*, int)"));
        assert_eq!(name_in_process(std::process::id(), 8), None, "unmapped");
    }

    #[test]
    fn libraries_are_told_apart() {
        assert_eq!(
            library(Path::new("/x/nvidia/cu13/lib/libcudart.so.13")),
            Some(Library::Runtime)
        );
        assert_eq!(
            library(Path::new("/usr/lib/x86_64-linux-gnu/libcuda.so.580.1")),
            Some(Library::Driver)
        );
        assert_eq!(library(Path::new("/usr/lib/libcudnn.so.9")), None);
        assert!(is_cupti(Path::new("/x/nvidia/cu13/lib/libcupti.so.13")));
        assert!(!is_cupti(Path::new("/x/libtracer_cupti.so")));
        assert_eq!(
            library(Path::new("/x/libcupti.so.13")),
            None,
            "found, not probed"
        );
    }

    #[test]
    fn cupti_is_looked_for_where_wheels_and_the_toolkit_put_it() {
        let d = cupti_beside(Path::new("/v/site-packages/nvidia/cuda_runtime/lib"));
        assert!(d.contains(&PathBuf::from("/v/site-packages/nvidia/cuda_runtime/lib")));
        assert!(d.contains(&PathBuf::from("/v/site-packages/nvidia/cuda_cupti/lib")));
        let d = cupti_beside(Path::new("/usr/local/cuda/lib64"));
        assert!(d.contains(&PathBuf::from("/usr/local/cuda/extras/CUPTI/lib64")));
        assert_eq!(cupti_beside(Path::new("/")), [PathBuf::from("/")]);
    }
}
