//! GPU times for a running process (`--gpu-times --pid`). tracerd loads this library into
//! the process with ptrace, so CUDA's driver never calls `InitializeInjection`; instead its
//! constructor starts a thread that turns CUPTI's kernel records on and off when tracerd asks,
//! through two words of this library's memory: tracerd writes a request to
//! `tracer_cupti_control` (odd: on, even: off; each request a larger number than the last),
//! and waits until `tracer_cupti_ack` holds it; the status line then says what came of it.
//!
//! On: CUPTI's one subscriber slot is taken first, and refused when another tool
//! (torch.profiler, Nsight) holds it: their buffers would otherwise come to us. Then kernel
//! records, as in an injected process. Off: everything handed over, records off, the slot let
//! go and CUPTI detached (`cuptiFinalize`), as torch.profiler leaves a process.
//!
//! A tracerd that dies leaves nobody to turn it off, but the kernel takes its probes out: once
//! this library's probe point has gone unprobed for [`WATCHDOG`], it turns itself off.

use std::{
    ffi::{c_void, CStr},
    fs::File,
    os::unix::fs::FileExt,
    sync::{
        atomic::{AtomicU64, Ordering},
        OnceLock,
    },
    time::Duration,
};

use super::{
    announce, api::Subscriber, buffer_completed, buffer_requested, clock_offset, counts, find,
    flush_all, flush_now, set_status, Cupti, ACTIVE, CLOCK_OFFSET, CUPTI, EXITING, FLUSH_EVERY,
};

/// tracerd's request: odd turns kernel records on, even turns them off.
#[no_mangle]
pub static tracer_cupti_control: AtomicU64 = AtomicU64::new(0);
/// The last request acted on (its status line set and announced before).
#[no_mangle]
pub static tracer_cupti_ack: AtomicU64 = AtomicU64::new(0);

/// How long the probe point may go unprobed before records turn themselves off.
const WATCHDOG: Duration = Duration::from_secs(5);
/// How often requests are looked for while records are off.
const IDLE_EVERY: Duration = Duration::from_millis(250);

#[used]
#[link_section = ".init_array"]
static LOADED: extern "C" fn() = loaded;

/// Where CUPTI was found, for status lines.
static CUPTI_PATH: OnceLock<String> = OnceLock::new();

extern "C" fn loaded() {
    if injected_by_driver() {
        return;
    }
    // The thread waits for the loader's lock until this dlopen returns.
    let _ = std::thread::Builder::new()
        .name("tracer-cupti".into())
        .spawn(serve);
}

/// Whether CUDA's driver loads this library (`CUDA_INJECTION64_PATH` names this file): then
/// `InitializeInjection` turns records on for the process's life, and requests are not read.
fn injected_by_driver() -> bool {
    use std::os::unix::fs::MetadataExt;
    let Some(named) = std::env::var_os("CUDA_INJECTION64_PATH") else {
        return false;
    };
    // SAFETY: an all-zero Dl_info is valid; dladdr fills it for an address of ours.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let me = loaded as extern "C" fn() as *const c_void;
    // SAFETY: as above.
    if unsafe { libc::dladdr(me, &mut info) } == 0 || info.dli_fname.is_null() {
        return false;
    }
    // SAFETY: the loader's NUL-terminated path of this object.
    let mine = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy();
    match (std::fs::metadata(named), std::fs::metadata(mine.as_ref())) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// Kernel records on, in a running process.
struct On {
    subscriber: Subscriber,
    kind: u32,
    line: String,
    /// (kernel records, dropped) handed over before it was turned on.
    base: (u64, u64),
    probe: Option<Probe>,
}

impl On {
    fn start() -> Result<Self, String> {
        let cupti = match CUPTI.get() {
            Some(c) => c,
            None => {
                let (lib, path) = find::libcupti()?;
                let _ = CUPTI.set(Cupti::load(lib)?);
                let _ = CUPTI_PATH.set(path);
                CUPTI.get().ok_or("CUPTI's entry points went missing")?
            }
        };
        let subscriber = cupti.subscribe()?;
        CLOCK_OFFSET.store(clock_offset(cupti), Ordering::Relaxed);
        let enabled = cupti
            .register_buffers(buffer_requested, buffer_completed)
            .and_then(|()| cupti.enable_kernel_records());
        let (kind_name, kind) = match enabled {
            Ok(k) => k,
            Err(e) => {
                let undone = cupti.detach(None, subscriber).err();
                return Err(undone.map_or(e.clone(), |u| format!("{e}; undoing: {u}")));
            }
        };
        super::activate();
        let path = CUPTI_PATH.get().map_or("?", String::as_str);
        Ok(Self {
            subscriber,
            kind,
            line: format!(
                "on: CUPTI from {path}; {kind_name} records, flushed every {} ms; turned on in the running process",
                FLUSH_EVERY.as_millis()
            ),
            base: counts(),
            probe: Probe::find(),
        })
    }

    /// Hands everything over and undoes what `start` did; the status line.
    fn stop(self, why: &str) -> String {
        flush_all();
        ACTIVE.store(false, Ordering::SeqCst);
        let (kernels, dropped) = counts();
        let mut line = format!(
            "off: {why}; {} kernel records handed over, {} dropped",
            kernels - self.base.0,
            dropped - self.base.1
        );
        if let Some(Err(e)) = CUPTI
            .get()
            .map(|c| c.detach(Some(self.kind), self.subscriber))
        {
            line.push_str(&format!("; detaching CUPTI: {e}"));
        }
        line
    }
}

/// Acts on tracerd's requests, flushes CUPTI's buffers while records are on, and turns them
/// off once tracerd's probes are gone.
fn serve() {
    let mut on: Option<On> = None;
    let mut unprobed = Duration::ZERO;
    loop {
        std::thread::sleep(if on.is_some() {
            FLUSH_EVERY
        } else {
            IDLE_EVERY
        });
        if EXITING.load(Ordering::SeqCst) {
            // The exit handler hands the rest over.
            return;
        }
        let want = tracer_cupti_control.load(Ordering::Acquire);
        if want != tracer_cupti_ack.load(Ordering::Acquire) {
            let line = match (want & 1 == 1, on.take()) {
                (true, Some(o)) => {
                    let line = o.line.clone();
                    on = Some(o);
                    line
                }
                (true, None) => match On::start() {
                    Ok(o) => {
                        unprobed = Duration::ZERO;
                        let line = o.line.clone();
                        on = Some(o);
                        line
                    }
                    Err(e) => format!("error: {e}"),
                },
                (false, Some(o)) => o.stop("turned off at the session's end"),
                (false, None) => super::status(),
            };
            set_status(&line);
            announce(&line);
            tracer_cupti_ack.store(want, Ordering::Release);
            continue;
        }
        let Some(o) = on.as_ref() else { continue };
        if !flush_now() {
            return;
        }
        if o.probe.as_ref().is_none_or(Probe::probed) {
            unprobed = Duration::ZERO;
            continue;
        }
        unprobed += FLUSH_EVERY;
        if unprobed >= WATCHDOG {
            if let Some(o) = on.take() {
                let line =
                    o.stop("tracerd's probes went away (tracerd ended without turning it off)");
                set_status(&line);
                announce(&line);
            }
        }
    }
}

/// The first byte of `tracer_cupti_kernel` as the file has it: a uprobe replaces it in the
/// process's copy of the page (a breakpoint, or a jump where the instruction allows one).
struct Probe {
    addr: usize,
    file_byte: u8,
}

impl Probe {
    /// Found through the process's mapping of the function's page; None if it cannot be.
    fn find() -> Option<Self> {
        let addr = super::tracer_cupti_kernel as extern "C" fn(_) as usize;
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        maps.lines().find_map(|line| {
            let mut fields = line.split_whitespace();
            let (start, end) = fields.next()?.split_once('-')?;
            let (start, end) = (
                usize::from_str_radix(start, 16).ok()?,
                usize::from_str_radix(end, 16).ok()?,
            );
            if !(start..end).contains(&addr) {
                return None;
            }
            let offset = u64::from_str_radix(fields.nth(1)?, 16).ok()?;
            let path = fields.nth(2)?;
            let mut byte = [0u8];
            File::open(path)
                .ok()?
                .read_exact_at(&mut byte, offset + (addr - start) as u64)
                .ok()?;
            Some(Self {
                addr,
                file_byte: byte[0],
            })
        })
    }

    fn probed(&self) -> bool {
        // SAFETY: the first byte of one of our own functions, mapped for as long as we are.
        unsafe { std::ptr::read_volatile(self.addr as *const u8) != self.file_byte }
    }
}
