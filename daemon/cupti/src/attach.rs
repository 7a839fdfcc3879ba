//! GPU times for a running process (`--gpu-times --pid`). tracerd loads this library into
//! the process with ptrace, so CUDA's driver never calls `InitializeInjection`; instead its
//! constructor starts a thread that turns CUPTI's kernel records on and off when tracerd asks,
//! through two words of this library's memory: tracerd writes a request to
//! `tracer_cupti_control` (odd: on, even: off; each request a larger number than the last),
//! and waits until `tracer_cupti_ack` holds it; the status line then says what came of it.
//!
//! The constructor cannot tell this case from a load by CUDA's driver without reading the
//! environment, which the process's user controls, so it starts the thread in both; whichever
//! acts first, the thread on a request or the driver's `InitializeInjection`, decides the mode
//! ([`claim`]), and the thread ends once the driver's call has.
//!
//! On: CUPTI is loaded from the path tracerd wrote into `tracer_cupti_path` and no other (an
//! empty one is refused). CUPTI's one subscriber slot is taken first, and refused when another
//! tool (torch.profiler, Nsight) holds it: their buffers would otherwise come to us. Then kernel
//! records, as in an injected process. Off: everything handed over, records off, the slot let
//! go and CUPTI detached (`cuptiFinalize`), as torch.profiler leaves a process.
//!
//! A tracerd that dies leaves nobody to turn it off, but the kernel takes its probes out: once
//! this library's probe point has gone unprobed for [`WATCHDOG`], it turns itself off.

use std::{
    cell::UnsafeCell,
    fs::File,
    os::unix::fs::FileExt,
    sync::{
        atomic::{AtomicU64, AtomicU8, Ordering},
        OnceLock,
    },
    time::Duration,
};

use super::{
    announce, api::Subscriber, buffer_completed, buffer_requested, clock_offset, counts, find,
    flush_all, flush_now, launches, set_status, Cupti, ACTIVE, CLOCK_OFFSET, CUPTI, CUPTI_PATH_LEN,
    EXITING, FLUSH_EVERY, REFUSED_SECURE,
};

/// tracerd's request: odd turns kernel records on, even turns them off.
#[no_mangle]
pub static tracer_cupti_control: AtomicU64 = AtomicU64::new(0);
/// The last request acted on (its status line set and announced before).
#[no_mangle]
pub static tracer_cupti_ack: AtomicU64 = AtomicU64::new(0);

/// A fixed-size, NUL-terminated path that tracerd writes through /proc/PID/mem.
#[repr(C)]
pub struct CuptiPath(UnsafeCell<[u8; CUPTI_PATH_LEN]>);
// SAFETY: written only by tracerd, from outside, before its "on" request; read by the serving
// thread after it sees that request (a torn path fails to load, or is refused).
unsafe impl Sync for CuptiPath {}

/// The CUPTI to load at "on", named by tracerd. Kept in `.data` (file-backed, as
/// `tracer_cupti_status`) though it starts empty: all zero, it would go to `.bss`.
#[no_mangle]
#[link_section = ".data"]
pub static tracer_cupti_path: CuptiPath = CuptiPath(UnsafeCell::new([0; CUPTI_PATH_LEN]));

/// How long the probe point may go unprobed before records turn themselves off.
const WATCHDOG: Duration = Duration::from_secs(5);
/// How often requests are looked for while records are off.
const IDLE_EVERY: Duration = Duration::from_millis(250);
/// The serving thread's stack: std's default.
const SERVE_STACK: usize = 2 << 20;

#[used]
#[link_section = ".init_array"]
static LOADED: extern "C" fn() = loaded;

/// Where CUPTI was found, for status lines.
static CUPTI_PATH: OnceLock<String> = OnceLock::new();

extern "C" fn loaded() {
    if super::secure_mode() {
        // No thread: nothing tracerd asks is done here.
        set_status(REFUSED_SECURE);
        return;
    }
    // The thread waits for the loader's lock until this dlopen returns. Its stack size is
    // given: std would read it from RUST_MIN_STACK, the process's environment.
    let _ = std::thread::Builder::new()
        .name("tracer-cupti".into())
        .stack_size(SERVE_STACK)
        .spawn(serve);
}

/// How this library came to be used, decided once.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// CUDA's driver called `InitializeInjection`: records on for the process's life, and
    /// requests are not read.
    Driver = 1,
    /// tracerd asked first: records on and off at its requests.
    Attached = 2,
}

/// 0 while undecided, else a [`Mode`].
static MODE: AtomicU8 = AtomicU8::new(0);

/// Whether this library is used `mode`'s way: decided by the first to ask.
pub fn claim(mode: Mode) -> bool {
    match MODE.compare_exchange(0, mode as u8, Ordering::SeqCst, Ordering::SeqCst) {
        Ok(_) => true,
        Err(held) => held == mode as u8,
    }
}

/// The CUPTI tracerd named, or why none.
fn named_cupti() -> Result<std::ffi::CString, String> {
    // SAFETY: a plain copy of our own array (tracerd writes it from outside, before asking).
    let buf = unsafe { std::ptr::read_volatile(tracer_cupti_path.0.get()) };
    find::named(&buf)
}

/// Kernel records on, in a running process.
struct On {
    subscriber: Subscriber,
    /// The kernel records turned on (None: launches alone).
    kind: Option<u32>,
    line: String,
    /// (kernel records, dropped) handed over before it was turned on.
    base: (u64, u64),
    probe: Option<Probe>,
    /// Launches are counted here (`launches.rs`).
    launches: bool,
}

impl On {
    fn start() -> Result<Self, String> {
        let cupti = match CUPTI.get() {
            Some(c) => c,
            None => {
                let (lib, path) = find::open(&named_cupti()?)?;
                let _ = CUPTI.set(Cupti::load(lib)?);
                let _ = CUPTI_PATH.set(path);
                CUPTI.get().ok_or("CUPTI's entry points went missing")?
            }
        };
        let subscriber = cupti.subscribe()?;
        // Launches alone (`--cuda-in-process` without `--gpu-times`): no kernel records.
        let records = !launches::launches_only();
        let (what, kind) = if records {
            CLOCK_OFFSET.store(clock_offset(cupti), Ordering::Relaxed);
            let enabled = cupti
                .register_buffers(buffer_requested, buffer_completed)
                .and_then(|()| cupti.enable_kernel_records());
            match enabled {
                Ok((name, kind)) => (
                    format!(
                        "{name} records, flushed every {} ms",
                        FLUSH_EVERY.as_millis()
                    ),
                    Some(kind),
                ),
                Err(e) => {
                    let undone = cupti.detach(None, subscriber).err();
                    return Err(undone.map_or(e.clone(), |u| format!("{e}; undoing: {u}")));
                }
            }
        } else {
            ("no kernel records (launches alone)".to_string(), None)
        };
        super::activate();
        let path = CUPTI_PATH.get().map_or("?", String::as_str);
        let mut on = Self {
            subscriber,
            kind,
            line: format!("on: CUPTI from {path}; {what}; turned on in the running process"),
            base: counts(),
            probe: Probe::find(),
            launches: false,
        };
        on.count_launches();
        Ok(on)
    }

    /// Launches counted here from now on, if tracerd asks and they are not yet; said in
    /// the status line.
    fn count_launches(&mut self) {
        if self.launches || launches::tracer_cupti_want_launches.load(Ordering::Acquire) == 0 {
            return;
        }
        let Some(cupti) = CUPTI.get() else { return };
        match launches::table().and_then(|fd| cupti.count_launches(&self.subscriber).map(|()| fd)) {
            Ok(fd) => {
                launches::start();
                self.launches = true;
                self.line
                    .push_str(&format!("; launches counted in-process (table: fd {fd})"));
            }
            Err(e) => self
                .line
                .push_str(&format!("; launches not counted in-process: {e}")),
        }
    }

    /// Hands everything over and undoes what `start` did; the status line.
    fn stop(self, why: &str) -> String {
        launches::stop();
        flush_all();
        ACTIVE.store(false, Ordering::SeqCst);
        let (kernels, dropped) = counts();
        let mut line = format!(
            "off: {why}; {} kernel records handed over, {} dropped",
            kernels - self.base.0,
            dropped - self.base.1
        );
        if self.launches {
            line.push_str(&format!(
                "; launches counted in-process, {} of them from threads without Python handed to the probe",
                launches::elsewhere()
            ));
        }
        if let Some(Err(e)) = CUPTI.get().map(|c| c.detach(self.kind, self.subscriber)) {
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
        // CUDA's driver loaded this library: records are on for the process's life.
        if MODE.load(Ordering::SeqCst) == Mode::Driver as u8 {
            return;
        }
        let want = tracer_cupti_control.load(Ordering::Acquire);
        if want != tracer_cupti_ack.load(Ordering::Acquire) {
            if !claim(Mode::Attached) {
                return;
            }
            let line = match (want & 1 == 1, on.take()) {
                (true, Some(mut o)) => {
                    o.count_launches();
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
pub(crate) struct Probe {
    addr: usize,
    file_byte: u8,
}

impl Probe {
    /// Found through the process's mapping of the function's page; None if it cannot be.
    pub(crate) fn find() -> Option<Self> {
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

    pub(crate) fn probed(&self) -> bool {
        // SAFETY: the first byte of one of our own functions, mapped for as long as we are.
        unsafe { std::ptr::read_volatile(self.addr as *const u8) != self.file_byte }
    }
}
