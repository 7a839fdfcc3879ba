//! tracer's CUPTI injection library (`libtracer_cupti.so`) in a process, as tracerd reads and
//! drives it: its status line, and the requests that turn its kernel records on and off in a
//! running process (`--gpu-times --pid`; the library's side is `daemon/cupti/src/attach.rs`),
//! with the CUPTI they load named by tracerd (`tracer_cupti_path`), never by the process.
//! The process may have written anything there: what is read is bounded and checked, and a
//! request that gets no answer in time fails.

use std::{
    os::unix::ffi::OsStrExt,
    path::Path,
    time::{Duration, Instant},
};

use crate::pinned::Pinned;

/// Bytes of `tracer_cupti_status`, its NUL included.
pub const STATUS_LEN: usize = 256;
/// Bytes of `tracer_cupti_path`, its NUL included.
pub const CUPTI_PATH_LEN: usize = 4096;
/// The whole status line of a library in a process started in the loader's secure mode
/// (setuid, setgid, file capabilities): it does nothing there, and answers no request.
pub const REFUSED_SECURE: &str = "error: refused in a secure-mode (setuid) process";

/// The library's words in one process.
pub struct Injection {
    pid: u32,
    status: u64,
    control: u64,
    ack: u64,
    /// `tracer_cupti_path`: 0 in a library from before tracerd named CUPTI.
    cupti_path: u64,
    /// `tracer_cupti_want_launches`, `tracer_cupti_python` and `tracer_cupti_launch_fd`
    /// (in-process launch counts): 0 in a library from before them.
    want_launches: u64,
    python: u64,
    launch_fd: u64,
    /// `tracer_cupti_go`: the answer a launched command's library waits for in `cuInit`.
    go: u64,
}

/// What the library needs to read a launching thread's Python call site: the address of
/// `PyGILState_GetThisThreadState` in the process and the interpreter's layout.
#[derive(Clone, Copy)]
pub struct PythonAt {
    pub get_tstate: u64,
    pub layout: tracer_common::PyLayout,
}

impl Injection {
    /// The library's words in `pid`, from `file` (the library, through the process's root)
    /// and the process's mappings of it.
    pub fn find(pid: u32, file: &Path, maps: &[&crate::process::MapEntry]) -> Result<Self, String> {
        use object::{Object, ObjectSegment, ObjectSymbol};
        let data = crate::binary::map(file).map_err(|e| format!("{}: {e}", file.display()))?;
        let elf = object::File::parse(&*data).map_err(|e| e.to_string())?;
        let at = |name: &str| {
            elf.dynamic_symbols()
                .find(|s| s.name() == Ok(name))
                .map(|s| s.address())
        };
        let status = at("tracer_cupti_status")
            .ok_or("no tracer_cupti_status symbol: not tracer's injection library")?;
        // The load bias, from the mapping of the file's start: the first loadable segment's.
        // (File offsets are ambiguous: a data page's bytes may be mapped by two segments.)
        let first = elf
            .segments()
            .find(|seg| seg.file_range().0 == 0)
            .ok_or("no segment maps the file's start")?;
        let bias = maps
            .iter()
            .find(|m| m.offset == 0)
            .map(|m| m.start.wrapping_sub(first.address() & !0xfff))
            .ok_or("the library's first page is not mapped")?;
        // Libraries from before requests were read have neither word: 0 says so.
        let word = |name| at(name).map_or(0, |a| bias.wrapping_add(a));
        Ok(Self {
            pid,
            status: bias.wrapping_add(status),
            control: word("tracer_cupti_control"),
            ack: word("tracer_cupti_ack"),
            cupti_path: word("tracer_cupti_path"),
            want_launches: word("tracer_cupti_want_launches"),
            python: word("tracer_cupti_python"),
            launch_fd: word("tracer_cupti_launch_fd"),
            go: word("tracer_cupti_go"),
        })
    }

    /// The status line as it stands.
    pub fn status(&self) -> Result<String, String> {
        let pid = self.pid;
        let line = super::c_string(pid, self.status, STATUS_LEN)
            .map_err(|e| format!("reading pid {pid}'s memory: {e}"))?;
        // Mid-dlopen the address may still show other bytes of the file.
        if line.is_empty() || line.chars().any(|c| c.is_control() || c == '\u{fffd}') {
            return Err("the library was still being loaded".into());
        }
        Ok(line)
    }

    /// Names the CUPTI the library loads at its next "on" (an absolute path in the process's
    /// root): the library loads that file and no other, so what the process's user controls
    /// (its environment, the loader's search path) does not choose it.
    pub fn name_cupti(&self, path: &Path) -> Result<(), String> {
        let pid = self.pid;
        if self.cupti_path == 0 {
            return Err(
                "this injection library cannot be told where CUPTI is (an older build): install tracerd's own libtracer_cupti.so"
                    .into(),
            );
        }
        let bytes = cupti_path_bytes(path)?;
        let pin = Pinned::open(pid).map_err(|e| format!("pid {pid}: {e}"))?;
        pin.write(self.cupti_path, &bytes)
            .map_err(|e| format!("writing pid {pid}'s memory: {e}"))
    }

    /// Asks the library to count launches in-process from its next "on" (or now, if on
    /// already), reading Python call sites as `python` says (None: not a Python process);
    /// `records`: with kernel records (GPU times) if it turns on now; `events`: each launch
    /// also an event in the table's ring (a tracing session).
    pub fn ask_launches(
        &self,
        python: Option<PythonAt>,
        records: bool,
        events: bool,
    ) -> Result<(), String> {
        let pid = self.pid;
        if self.want_launches == 0 || self.python == 0 || self.launch_fd == 0 {
            return Err("this injection library cannot count launches (an older build): install tracerd's own libtracer_cupti.so".into());
        }
        let pin = Pinned::open(pid).map_err(|e| format!("pid {pid}: {e}"))?;
        let write = |addr: u64, bytes: &[u8]| {
            pin.write(addr, bytes)
                .map_err(|e| format!("writing pid {pid}'s memory: {e}"))
        };
        // `PythonAt` in the library: set, get_tstate, then the layout's bytes.
        let mut bytes = Vec::with_capacity(16 + std::mem::size_of::<tracer_common::PyLayout>());
        let (set, get, layout) = match python {
            Some(p) => (1u64, p.get_tstate, p.layout),
            // SAFETY: a plain-data struct of integers.
            None => (0, 0, unsafe { std::mem::zeroed() }),
        };
        bytes.extend_from_slice(&set.to_ne_bytes());
        bytes.extend_from_slice(&get.to_ne_bytes());
        // SAFETY: `PyLayout` is `repr(C)` integers, read as its bytes.
        bytes.extend_from_slice(unsafe {
            std::slice::from_raw_parts(
                std::ptr::addr_of!(layout).cast::<u8>(),
                std::mem::size_of::<tracer_common::PyLayout>(),
            )
        });
        write(self.python, &bytes)?;
        use tracer_common::launches::want;
        let want = if records { want::RECORDS } else { want::ONLY }
            | if events { want::EVENTS } else { 0 };
        write(self.want_launches, &want.to_ne_bytes())
    }

    /// Answers a launched command's library waiting in `cuInit`: count launches there
    /// (`count`), or not (the probes count them).
    pub fn answer(&self, count: bool) -> Result<(), String> {
        let pid = self.pid;
        if self.go == 0 {
            return Err("this injection library waits for no answer (an older build)".into());
        }
        let word: u64 = if count { 1 } else { 2 };
        Pinned::open(pid)
            .and_then(|pin| pin.write(self.go, &word.to_ne_bytes()))
            .map_err(|e| format!("writing pid {pid}'s memory: {e}"))
    }

    /// The library's launch table, taken from the process and mapped here.
    pub fn launch_table(&self) -> Result<super::LaunchTable, String> {
        let pid = self.pid;
        if self.launch_fd == 0 {
            return Err("this injection library has no launch table (an older build)".into());
        }
        let mut b = [0u8; 4];
        Pinned::open(pid)
            .and_then(|pin| pin.read(self.launch_fd, &mut b))
            .map_err(|e| format!("reading pid {pid}'s memory: {e}"))?;
        let fd = i32::from_ne_bytes(b);
        if fd < 0 {
            return Err(format!(
                "pid {pid}'s injection library made no launch table"
            ));
        }
        super::LaunchTable::take(pid, fd)
    }

    /// Asks the library to turn kernel records on (or off) and waits up to `wait` for it to
    /// act: its status line then (`on: …`, `off: …` or `error: …`).
    pub fn request(&self, on: bool, wait: Duration) -> Result<String, String> {
        let pid = self.pid;
        if self.control == 0 || self.ack == 0 {
            return Err("this injection library takes no requests (an older build)".into());
        }
        let pin = Pinned::open(pid).map_err(|e| format!("pid {pid}: {e}"))?;
        let word = |addr: u64| -> Result<u64, String> {
            let mut b = [0u8; 8];
            pin.read(addr, &mut b)
                .map_err(|e| format!("reading pid {pid}'s memory: {e}"))?;
            Ok(u64::from_ne_bytes(b))
        };
        // Each request a larger number than the last, odd for on.
        let mut next = word(self.control)?.wrapping_add(1);
        if (next & 1 == 1) != on {
            next = next.wrapping_add(1);
        }
        pin.write(self.control, &next.to_ne_bytes())
            .map_err(|e| format!("writing pid {pid}'s memory: {e}"))?;
        let began = Instant::now();
        while word(self.ack)? != next {
            if !pin.alive() {
                return Err(format!("pid {pid} exited"));
            }
            if began.elapsed() >= wait {
                return Err(format!(
                    "the injection library in pid {pid} did not answer within {} ms",
                    wait.as_millis()
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.status()
    }
}

/// `tracer_cupti_path`'s whole contents naming `path`: the path, then NULs. Refused: a path
/// that is not absolute (the loader would search for it), holds a NUL, or does not fit.
fn cupti_path_bytes(path: &Path) -> Result<Vec<u8>, String> {
    let raw = path.as_os_str().as_bytes();
    if !raw.starts_with(b"/") {
        return Err(format!("CUPTI's path {path:?} is not absolute"));
    }
    if raw.contains(&0) {
        return Err(format!("CUPTI's path {path:?} holds a NUL"));
    }
    if raw.len() >= CUPTI_PATH_LEN {
        return Err(format!(
            "CUPTI's path is {} bytes long, more than the library's {} can hold",
            raw.len(),
            CUPTI_PATH_LEN - 1
        ));
    }
    let mut bytes = vec![0u8; CUPTI_PATH_LEN];
    bytes[..raw.len()].copy_from_slice(raw);
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{ffi::OsStr, path::PathBuf};

    #[test]
    fn cupti_paths_fill_the_buffer_and_stay_inside_it() {
        let b = cupti_path_bytes(Path::new("/w/nvidia/cu13/lib/libcupti.so.13")).unwrap();
        assert_eq!(b.len(), CUPTI_PATH_LEN);
        assert!(b.starts_with(b"/w/nvidia/cu13/lib/libcupti.so.13\0"));
        assert!(b.iter().skip(33).all(|&c| c == 0), "the rest cleared");
        // The longest that fits leaves its NUL; one more byte does not fit.
        let longest = PathBuf::from(format!("/{}", "a".repeat(CUPTI_PATH_LEN - 2)));
        let b = cupti_path_bytes(&longest).unwrap();
        assert_eq!((b.len(), b[CUPTI_PATH_LEN - 1]), (CUPTI_PATH_LEN, 0));
        let too_long = PathBuf::from(format!("/{}", "a".repeat(CUPTI_PATH_LEN - 1)));
        assert!(cupti_path_bytes(&too_long)
            .unwrap_err()
            .contains("more than"));
        let nul = Path::new(OsStr::from_bytes(b"/x/libcupti.so\0/evil.so"));
        assert!(cupti_path_bytes(nul).unwrap_err().contains("NUL"));
        for relative in ["libcupti.so.13", "", "./libcupti.so"] {
            assert!(
                cupti_path_bytes(Path::new(relative))
                    .unwrap_err()
                    .contains("not absolute"),
                "{relative}"
            );
        }
    }
}
