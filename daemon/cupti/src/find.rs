//! Where CUPTI is. Loaded by CUDA's driver (the program was started with
//! `CUDA_INJECTION64_PATH` naming this library, by its user): named by `TRACER_CUPTI_PATH`;
//! already loaded (PyTorch's profiler links it); beside the CUDA runtime the program loaded (a
//! CUDA 13 wheel keeps both in `nvidia/cu13/lib`, CUDA 12 wheels in sibling
//! `nvidia/cuda_runtime` and `nvidia/cuda_cupti` packages, the toolkit in
//! `extras/CUPTI/lib64`); else wherever the loader finds its soname ([`libcupti`]). Loaded by
//! tracerd with ptrace: only the absolute path tracerd wrote ([`named`], [`open`]), since
//! whatever the process's user controls (its environment, the loader's search path) must not
//! choose what runs in a process tracerd reached.

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

const FLAGS: i32 = libc::RTLD_NOW | libc::RTLD_LOCAL;

/// The path in `buf` (tracerd's `tracer_cupti_path`, NUL-terminated), or why none.
pub fn named(buf: &[u8]) -> Result<CString, String> {
    let len = buf
        .iter()
        .position(|&b| b == 0)
        .ok_or("tracerd's CUPTI path is not NUL-terminated")?;
    let path = &buf[..len];
    if path.is_empty() {
        return Err("tracerd named no CUPTI".into());
    }
    // A name without a slash would be looked for along the loader's search path, which the
    // process's environment (LD_LIBRARY_PATH) sets.
    if !path.starts_with(b"/") {
        return Err(format!(
            "tracerd named CUPTI by a relative path: {}",
            String::from_utf8_lossy(path)
        ));
    }
    CString::new(path).map_err(|e| e.to_string())
}

/// A handle on the CUPTI at `path` exactly, and that path.
pub fn open(path: &CStr) -> Result<(*mut c_void, String), String> {
    let shown = path.to_string_lossy().into_owned();
    // SAFETY: a NUL-terminated path.
    let h = unsafe { libc::dlopen(path.as_ptr(), FLAGS) };
    if h.is_null() {
        return Err(format!("{shown}: {}", dlerror()));
    }
    Ok((h, shown))
}

/// A handle on libcupti and the path it came from, in a process whose CUDA driver loaded this
/// library (its user's own program, outside the loader's secure mode: the caller checks).
pub fn libcupti() -> Result<(*mut c_void, String), String> {
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

/// Directories where CUPTI may sit, given the CUDA runtime's directory. tracerd searches the
/// same ones for a process it loads this library into (`tracer_inspect::cuda::cupti_beside`:
/// this crate, loaded into programs, does not depend on that one; the tests below check that
/// the two agree).
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

    #[test]
    fn tracerd_searches_where_the_driver_loaded_library_does() {
        use tracer_inspect::cuda;
        for dir in [
            "/v/site-packages/nvidia/cuda_runtime/lib",
            "/v/site-packages/nvidia/cu13/lib",
            "/usr/local/cuda/lib64",
            "/lib",
            "/",
        ] {
            assert_eq!(
                beside(Path::new(dir)),
                cuda::cupti_beside(Path::new(dir)),
                "{dir}"
            );
        }
        assert_eq!(SONAMES, cuda::CUPTI_SONAMES);
        // And reads the library's memory as it is laid out.
        assert_eq!(crate::STATUS_LEN, cuda::STATUS_LEN);
        assert_eq!(crate::CUPTI_PATH_LEN, cuda::CUPTI_PATH_LEN);
        assert_eq!(crate::REFUSED_SECURE, cuda::REFUSED_SECURE);
    }

    #[test]
    fn only_an_absolute_path_tracerd_wrote_is_taken() {
        let mut buf = [0u8; 64];
        assert_eq!(named(&buf).unwrap_err(), "tracerd named no CUPTI");
        buf[..22].copy_from_slice(b"/w/lib/libcupti.so.13\0");
        assert_eq!(named(&buf).unwrap().as_bytes(), b"/w/lib/libcupti.so.13");
        buf[..15].copy_from_slice(b"libcupti.so.13\0");
        assert!(named(&buf).unwrap_err().contains("relative path"));
        assert!(named(&[b'/'; 8])
            .unwrap_err()
            .contains("not NUL-terminated"));
    }

    #[test]
    fn a_missing_cupti_is_said_with_its_path() {
        let path = CString::new("/nonexistent/libcupti.so.13").unwrap();
        let e = open(&path).unwrap_err();
        assert!(e.starts_with("/nonexistent/libcupti.so.13: "), "{e}");
    }
}
