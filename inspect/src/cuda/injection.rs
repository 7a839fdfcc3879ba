//! tracer's CUPTI injection library (`libtracer_cupti.so`) in a process, as tracerd reads and
//! drives it: its status line, and the requests that turn its kernel records on and off in a
//! running process (`--gpu-times --pid`; the library's side is `daemon/cupti/src/attach.rs`).
//! The process may have written anything there: what is read is bounded and checked, and a
//! request that gets no answer in time fails.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use crate::pinned::Pinned;

/// Bytes of `tracer_cupti_status`, its NUL included.
const STATUS_LEN: usize = 256;

/// The library's words in one process.
pub struct Injection {
    pid: u32,
    status: u64,
    control: u64,
    ack: u64,
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
