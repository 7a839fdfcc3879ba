//! `libtracer_cupti.so`: a CUDA injection library. CUDA's driver loads it into a program
//! started with `CUDA_INJECTION64_PATH` naming it (`tracerctl start --cuda --gpu-times -- CMD`
//! sets that) and calls `InitializeInjection` when the program initializes CUDA. It loads CUPTI, turns on kernel
//! activity records and hands each kernel execution to `tracer_cupti_kernel`, an exported
//! function that does nothing: tracerd reads its argument with a uprobe, as it reads CUDA's
//! own entry points. Without a tracerd session the records go nowhere.
//!
//! What happened is kept in the exported `tracer_cupti_status` (a NUL-terminated line), which
//! tracerd reads from the process's memory when it finds the library mapped.
//!
//! tracerd may also load it into a running process (`--gpu-times --pid`): then it turns
//! CUPTI on and off when tracerd asks (`attach.rs`), loading the CUPTI tracerd names.
//!
//! In a process started in the loader's secure mode (setuid, setgid, file capabilities), whose
//! environment a less privileged user chose, it does nothing but say so in its status line.

mod api;
mod attach;
mod caller;
mod find;
mod launched;
mod launches;
mod under_way;
mod unwind;

use std::{
    cell::UnsafeCell,
    ffi::{c_char, c_int, c_void},
    sync::{
        atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU64, Ordering},
        OnceLock,
    },
    time::Duration,
};

use tracer_common::CuptiKernel;

use api::{kernel_record, Cupti};

/// How often CUPTI's buffers are flushed: a kernel's time reaches tracerd at most this late.
const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// Bytes per activity buffer CUPTI fills.
const BUFFER_BYTES: usize = 4 << 20;

/// A fixed-size, NUL-terminated line in `.data` (initialized, so file-backed: tracerd finds
/// it through the library's symbol table and reads it through /proc/PID/mem).
#[repr(C)]
pub struct Status(UnsafeCell<[u8; STATUS_LEN]>);
// SAFETY: written under `STATUS_LOCK` only; readers outside the process tolerate tearing.
unsafe impl Sync for Status {}
pub const STATUS_LEN: usize = 256;
/// Bytes of `tracer_cupti_path` (`attach.rs`), its NUL included.
pub const CUPTI_PATH_LEN: usize = 4096;

const fn initial_status() -> [u8; STATUS_LEN] {
    let text = b"loaded; InitializeInjection not called yet";
    let mut s = [0u8; STATUS_LEN];
    let mut i = 0;
    while i < text.len() {
        s[i] = text[i];
        i += 1;
    }
    s
}

#[no_mangle]
pub static tracer_cupti_status: Status = Status(UnsafeCell::new(initial_status()));
static STATUS_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Sets the status line (truncated to fit).
fn set_status(line: &str) {
    let _guard = STATUS_LOCK.lock();
    let bytes = line.as_bytes();
    let n = bytes.len().min(STATUS_LEN - 1);
    // SAFETY: the only writer, under the lock; the array is ours.
    unsafe {
        let s = &mut *tracer_cupti_status.0.get();
        s[..n].copy_from_slice(&bytes[..n]);
        s[n..].fill(0);
    }
}

/// The status line as it stands.
fn status() -> String {
    let _guard = STATUS_LOCK.lock();
    // SAFETY: read under the lock.
    let s = unsafe { &*tracer_cupti_status.0.get() };
    let len = s.iter().position(|&b| b == 0).unwrap_or(STATUS_LEN);
    String::from_utf8_lossy(&s[..len]).into_owned()
}

/// tracerd's probe point: one call per kernel execution record. Only counts it.
#[no_mangle]
#[inline(never)]
pub extern "C" fn tracer_cupti_kernel(kernel: *const CuptiKernel) {
    std::hint::black_box(kernel);
    // Each probe point does something of its own: identical bodies would be folded into one
    // address, and a probe on it would fire for both.
    KERNELS.fetch_add(1, Ordering::Relaxed);
}

/// tracerd's probe point: CUPTI dropped `records` kernel records (its buffers were full).
#[no_mangle]
#[inline(never)]
pub extern "C" fn tracer_cupti_dropped(records: u64) {
    std::hint::black_box(records);
    DROPPED.fetch_add(records, Ordering::Relaxed);
}

/// tracerd's probe point: CUPTI is set up (or could not be); `status` is the status line.
#[no_mangle]
#[inline(never)]
pub extern "C" fn tracer_cupti_initialized(status: *const c_char) {
    std::hint::black_box(status);
    ANNOUNCED.fetch_add(1, Ordering::Relaxed);
}

/// Status lines announced (at initialization, at exit).
static ANNOUNCED: AtomicU64 = AtomicU64::new(0);

/// Records dropped so far.
static DROPPED: AtomicU64 = AtomicU64::new(0);
/// Kernel records handed to `tracer_cupti_kernel` so far.
static KERNELS: AtomicU64 = AtomicU64::new(0);
/// CLOCK_MONOTONIC minus CUPTI's clock, ns.
static CLOCK_OFFSET: AtomicI64 = AtomicI64::new(0);
static CUPTI: OnceLock<Cupti> = OnceLock::new();
/// Held by whoever asks CUPTI to flush: the exit handler waits for a periodic flush under
/// way, whose buffers are handed over on the flushing thread, before its own.
static FLUSHING: std::sync::Mutex<()> = std::sync::Mutex::new(());
/// Set by the exit handler: the periodic flush starts no more.
static EXITING: AtomicBool = AtomicBool::new(false);
/// Kernel records are on: the exit handler has something to hand over.
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// Buffers being handed over now, on any thread (CUPTI's own included).
static COMPLETING: AtomicU64 = AtomicU64::new(0);
/// How long the exit handler waits for buffers other threads are handing over.
const EXIT_WAIT: Duration = Duration::from_secs(2);
/// The process that set CUPTI up: a child forked from it inherits the exit handler but not
/// CUPTI's threads, and must not call into CUPTI.
static OWNER: AtomicI32 = AtomicI32::new(0);

/// The status line in a secure-mode process.
const REFUSED_SECURE: &str = "error: refused in a secure-mode (setuid) process";

/// Whether the loader runs this process in secure mode (AT_SECURE: a setuid, setgid or
/// capability-gaining exec). Then the environment, which names CUDA_INJECTION64_PATH and
/// TRACER_CUPTI_PATH, is the less privileged caller's, and nothing it leads to may run.
fn secure_mode() -> bool {
    // SAFETY: reads the auxiliary vector; no environment involved.
    unsafe { libc::getauxval(libc::AT_SECURE) != 0 }
}

/// Called by CUDA's driver at `cuInit` in a process started with `CUDA_INJECTION64_PATH`
/// naming this library. Never fails the program: 1 ("initialized") either way, with what
/// went wrong in the status line and on stderr.
#[no_mangle]
pub extern "C" fn InitializeInjection() -> c_int {
    if secure_mode() {
        set_status(REFUSED_SECURE);
        announce(REFUSED_SECURE);
        return 1;
    }
    // tracerd loaded this library and turned records on first: they stay its to turn off.
    if !attach::claim(attach::Mode::Driver) || CUPTI.get().is_some() {
        return 1;
    }
    // Launches counted here (a session's launcher asked): kernel records only where
    // `--gpu-times` asked for them too.
    let launches = launched::asked();
    let records = !launches || std::env::var_os("TRACER_CUPTI_RECORDS").is_some_and(|v| v == "1");
    let mut line = match start(records) {
        Ok(line) => line,
        Err(e) => {
            eprintln!("libtracer_cupti: GPU kernel times unavailable: {e}");
            format!("error: {e}")
        }
    };
    if launches {
        line = launched::count_here(CUPTI.get(), &line);
    }
    set_status(&line);
    announce(&line);
    1
}

/// Hands a status line to tracerd's probe.
fn announce(line: &str) {
    let c = std::ffi::CString::new(line).unwrap_or_default();
    tracer_cupti_initialized(c.as_ptr());
}

fn start(records: bool) -> Result<String, String> {
    // The user's own program, not in secure mode (checked above): its environment may name
    // CUPTI.
    let (lib, path) = find::libcupti()?;
    let cupti = Cupti::load(lib)?;
    if !records {
        let _ = CUPTI.set(cupti);
        return Ok(format!(
            "ok: CUPTI from {path}; no kernel records (launches alone)"
        ));
    }
    // CUPTI stamps records with CLOCK_REALTIME on Linux. Its timestamp callback would give
    // CLOCK_MONOTONIC directly, but CUPTI 12.6 to 13.0 write zero kernel times when one is
    // registered (fixed in 13.1): an offset, measured again at each buffer, instead.
    CLOCK_OFFSET.store(clock_offset(&cupti), Ordering::Relaxed);
    cupti.register_buffers(buffer_requested, buffer_completed)?;
    let (kind, _) = cupti.enable_kernel_records()?;
    let _ = CUPTI.set(cupti);
    activate();
    std::thread::Builder::new()
        .name("tracer-cupti".into())
        .spawn(|| loop {
            std::thread::sleep(FLUSH_EVERY);
            if !flush_now() {
                return;
            }
        })
        .map_err(|e| format!("flush thread: {e}"))?;
    Ok(format!(
        "ok: CUPTI from {path}; {kind} records, flushed every {} ms",
        FLUSH_EVERY.as_millis()
    ))
}

/// Kernel records are on in this process: records still buffered at its exit are handed
/// over before it goes.
fn activate() {
    static AT_EXIT: std::sync::Once = std::sync::Once::new();
    // SAFETY: plain syscall wrapper.
    OWNER.store(unsafe { libc::getpid() }, Ordering::Relaxed);
    ACTIVE.store(true, Ordering::SeqCst);
    // SAFETY: registering a plain extern "C" function.
    AT_EXIT.call_once(|| unsafe {
        libc::atexit(flush_at_exit);
    });
}

/// The periodic flush: hands over CUPTI's full buffers, unless the process is exiting (then
/// false, and the exit handler hands the rest over).
fn flush_now() -> bool {
    let _held = FLUSHING.lock().unwrap_or_else(|e| e.into_inner());
    if EXITING.load(Ordering::SeqCst) {
        return false;
    }
    if let Some(c) = CUPTI.get() {
        c.flush(false);
    }
    true
}

/// Hands over what CUPTI still holds, then says it all again with the totals: a session that
/// attached after `InitializeInjection` (the library is probed as it is mapped, which races
/// with its initialization) still learns how CUPTI was set up.
extern "C" fn flush_at_exit() {
    // SAFETY: plain syscall wrapper.
    if OWNER.load(Ordering::Relaxed) != unsafe { libc::getpid() } || !ACTIVE.load(Ordering::SeqCst)
    {
        return;
    }
    EXITING.store(true, Ordering::SeqCst);
    flush_all();
    let (kernels, dropped) = counts();
    let line = format!(
        "{}; at exit: {kernels} kernel records handed over, {dropped} dropped",
        status()
    );
    set_status(&line);
    announce(&line);
}

/// Hands over everything CUPTI holds, waiting (bounded: a stuck flush must not hold the
/// program's exit, or tracerd, for long) for a periodic flush under way and for buffers
/// other threads are handing over, which would otherwise be lost half-way.
fn flush_all() {
    let Some(c) = CUPTI.get() else { return };
    let deadline = std::time::Instant::now() + EXIT_WAIT;
    let held = loop {
        match FLUSHING.try_lock() {
            Ok(g) => break Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => break Some(e.into_inner()),
            Err(_) if std::time::Instant::now() >= deadline => break None,
            Err(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    };
    c.flush(true);
    drop(held);
    while COMPLETING.load(Ordering::SeqCst) > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// CLOCK_MONOTONIC now, ns (the vDSO's): the probes' `bpf_ktime_get_ns`.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CLOCK_MONOTONIC minus CUPTI's clock, from the closest of a few paired readings.
fn clock_offset(c: &Cupti) -> i64 {
    let mut best = (u64::MAX, 0i64);
    for _ in 0..5 {
        let before = monotonic_ns();
        let Some(cupti) = c.timestamp() else {
            return CLOCK_OFFSET.load(Ordering::Relaxed);
        };
        let after = monotonic_ns();
        let mid = before + (after - before) / 2;
        if after - before < best.0 {
            best = (after - before, mid as i64 - cupti as i64);
        }
    }
    best.1
}

extern "C" fn buffer_requested(buffer: *mut *mut u8, size: *mut usize, max_records: *mut usize) {
    // 8-byte alignment is what CUPTI asks; the allocator gives 16.
    // SAFETY: plain allocation; CUPTI hands the buffer back to `buffer_completed`.
    let p = unsafe { libc::malloc(BUFFER_BYTES) }.cast::<u8>();
    // SAFETY: CUPTI's out-parameters.
    unsafe {
        *buffer = p;
        *size = if p.is_null() { 0 } else { BUFFER_BYTES };
        *max_records = 0;
    }
}

extern "C" fn buffer_completed(
    ctx: *mut c_void,
    stream: u32,
    buffer: *mut u8,
    _size: usize,
    valid: usize,
) {
    COMPLETING.fetch_add(1, Ordering::SeqCst);
    if let Some(c) = CUPTI.get() {
        // The wall clock may have been stepped since the last buffer.
        let offset = clock_offset(c);
        CLOCK_OFFSET.store(offset, Ordering::Relaxed);
        c.each_record(buffer, valid, |record| {
            if let Some(mut k) = kernel_record(record) {
                k.start_ns = k.start_ns.wrapping_add_signed(offset);
                k.end_ns = k.end_ns.wrapping_add_signed(offset);
                tracer_cupti_kernel(&k);
            }
        });
        let dropped = c.dropped(ctx, stream);
        if dropped > 0 {
            tracer_cupti_dropped(dropped);
        }
    }
    // SAFETY: allocated by `buffer_requested`.
    unsafe { libc::free(buffer.cast()) };
    COMPLETING.fetch_sub(1, Ordering::SeqCst);
}

/// The counts so far: kernel records handed over, records dropped.
fn counts() -> (u64, u64) {
    (
        KERNELS.load(Ordering::Relaxed),
        DROPPED.load(Ordering::Relaxed),
    )
}

/// A C string for messages.
fn c_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: a NUL-terminated string from CUPTI or the loader.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}
