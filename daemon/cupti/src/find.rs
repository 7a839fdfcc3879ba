//! Where CUPTI is: named by `TRACER_CUPTI_PATH`; already loaded (PyTorch's profiler links it);
//! beside the CUDA runtime the program loaded (a CUDA 13 wheel keeps both in
//! `nvidia/cu13/lib`, CUDA 12 wheels in sibling `nvidia/cuda_runtime` and `nvidia/cuda_cupti`
//! packages, the toolkit in `extras/CUPTI/lib64`); else wherever the loader finds its soname.

use std::{
    ffi::{c_void, CStr, CString},
    path::{Path, PathBuf},
};

const SONAMES: &[&str] = &["libcupti.so.13", "libcupti.so.12", "libcupti.so"];

fn dlopen(path: &str, flags: i32) -> Option<*mut c_void> {
    let c = CString::new(path).ok()?;
    // SAFETY: a NUL-terminated path.
    let h = unsafe { libc::dlopen(c.as_ptr(), flags) };
    (!h.is_null()).then_some(h)
}

fn dlerror() -> String {
    // SAFETY: dlerror returns a thread-local message or NULL.
    super::c_str(unsafe { libc::dlerror() })
}

/// A handle on libcupti and the path it came from.
pub fn libcupti() -> Result<(*mut c_void, String), String> {
    const FLAGS: i32 = libc::RTLD_NOW | libc::RTLD_LOCAL;
    if let Ok(path) = std::env::var("TRACER_CUPTI_PATH") {
        return dlopen(&path, FLAGS)
            .map(|h| (h, path.clone()))
            .ok_or_else(|| format!("TRACER_CUPTI_PATH={path}: {}", dlerror()));
    }
    for name in SONAMES {
        if let Some(h) = dlopen(name, FLAGS | libc::RTLD_NOLOAD) {
            return Ok((h, format!("{name} (already loaded)")));
        }
    }
    for dir in runtime_dirs() {
        for candidate in beside(&dir) {
            for name in SONAMES {
                let path = candidate.join(name);
                if path.exists() {
                    let path = path.to_string_lossy().into_owned();
                    if let Some(h) = dlopen(&path, FLAGS) {
                        return Ok((h, path));
                    }
                }
            }
        }
    }
    for name in SONAMES {
        if let Some(h) = dlopen(name, FLAGS) {
            return Ok((h, (*name).to_owned()));
        }
    }
    Err(format!(
        "libcupti not found (tried TRACER_CUPTI_PATH, {}, beside the CUDA runtime, and the loader's path): {}",
        SONAMES.join(", "),
        dlerror()
    ))
}

/// Directories where CUPTI may sit, given the CUDA runtime's directory.
pub fn beside(dir: &Path) -> Vec<PathBuf> {
    let mut dirs = vec![dir.to_path_buf()];
    if let Some(up) = dir.parent() {
        dirs.push(up.join("extras/CUPTI/lib64"));
        if let Some(pkgs) = up.parent() {
            dirs.push(pkgs.join("cuda_cupti/lib"));
        }
    }
    dirs
}

/// Directories of the CUDA runtime libraries loaded in this process.
fn runtime_dirs() -> Vec<PathBuf> {
    extern "C" fn each(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> i32 {
        // SAFETY: the loader's record for one object, and our Vec.
        let (info, dirs) = unsafe { (&*info, &mut *data.cast::<Vec<PathBuf>>()) };
        if info.dlpi_name.is_null() {
            return 0;
        }
        // SAFETY: a NUL-terminated path.
        let name = unsafe { CStr::from_ptr(info.dlpi_name) }.to_string_lossy();
        let path = Path::new(name.as_ref());
        let is_runtime = path
            .file_name()
            .and_then(|f| f.to_str())
            .is_some_and(|f| f.starts_with("libcudart.so"));
        if let (true, Some(dir)) = (is_runtime, path.parent()) {
            if !dirs.iter().any(|d| d == dir) {
                dirs.push(dir.to_path_buf());
            }
        }
        0
    }
    let mut dirs: Vec<PathBuf> = Vec::new();
    // SAFETY: `each` only reads the records and pushes onto `dirs`.
    unsafe { libc::dl_iterate_phdr(Some(each), (&raw mut dirs).cast()) };
    dirs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wheels_and_the_toolkit_are_searched() {
        let d = beside(Path::new("/v/site-packages/nvidia/cuda_runtime/lib"));
        assert!(d.contains(&PathBuf::from("/v/site-packages/nvidia/cuda_runtime/lib")));
        assert!(d.contains(&PathBuf::from("/v/site-packages/nvidia/cuda_cupti/lib")));
        let d = beside(Path::new("/usr/local/cuda/lib64"));
        assert!(d.contains(&PathBuf::from("/usr/local/cuda/extras/CUPTI/lib64")));
    }
}
