//! Kernel launches counted in this process, from CUPTI's launch callbacks, where tracerd
//! asks (`tracer_cupti_want_launches`, before its "on" request): no trap a launch. The
//! counts go to a table in a sealed memfd (`tracer_common::launches`) that tracerd takes and
//! maps, so they outlive the process.
//!
//! Each launch's row is the one the launch probes would make (`ebpf/probes/src/cuda.rs`):
//! the entry point, handle, grid, block, shared memory, stream, native caller and Python call
//! site. The call site is read here when the launching thread runs Python itself (its own
//! frames, alive under the call); a launch from a thread without a Python frame in a Python
//! process goes to `tracer_cupti_launch_elsewhere`, whose probe finds the thread it works
//! for as the launch probes do (one trap, for those launches alone).

use std::{
    cell::UnsafeCell,
    ffi::{c_char, c_void},
    sync::atomic::{AtomicI32, AtomicPtr, AtomicU32, AtomicU64, Ordering},
};

use tracer_common::{
    cuda_api as api,
    launches::{self, state, want, Entry, Event, Header},
    py_from, py_kind, py_names_id, CudaLaunchKey, PyLayout, PY_FRAME_OWNER_NOT_PYTHON,
};

/// CUPTI's callback domains and sites (`cupti_callbacks.h`).
pub const DOMAIN_DRIVER: u32 = 1;
pub const DOMAIN_RUNTIME: u32 = 2;
const SITE_ENTER: u32 = 0;

/// The launch callbacks turned on: (domain, callback id, tracer's entry point).
pub const CALLBACKS: [(u32, u32, u32); 8] = [
    (DOMAIN_RUNTIME, 211, api::CUDA_LAUNCH), // cudaLaunchKernel_v7000
    (DOMAIN_RUNTIME, 214, api::CUDA_LAUNCH), // cudaLaunchKernel_ptsz_v7000
    (DOMAIN_RUNTIME, 430, api::CUDA_LAUNCH_EX), // cudaLaunchKernelExC_v11060
    (DOMAIN_RUNTIME, 431, api::CUDA_LAUNCH_EX), // cudaLaunchKernelExC_ptsz_v11060
    (DOMAIN_DRIVER, 307, api::CU_LAUNCH),    // cuLaunchKernel
    (DOMAIN_DRIVER, 442, api::CU_LAUNCH),    // cuLaunchKernel_ptsz
    (DOMAIN_DRIVER, 652, api::CU_LAUNCH_EX), // cuLaunchKernelEx
    (DOMAIN_DRIVER, 653, api::CU_LAUNCH_EX), // cuLaunchKernelEx_ptsz
];

/// The exported functions a call entering each callback's function targets, for the caller's
/// check (`caller.rs`).
fn entry_names(cbid: u32) -> &'static [&'static str] {
    match cbid {
        // nvcc 13's host stubs call `__cudaLaunchKernel*`, which jumps on to these.
        211 => &["cudaLaunchKernel", "__cudaLaunchKernel"],
        214 => &["cudaLaunchKernel_ptsz", "__cudaLaunchKernel_ptsz"],
        430 => &["cudaLaunchKernelExC", "__cudaLaunchKernelExC"],
        431 => &["cudaLaunchKernelExC_ptsz", "__cudaLaunchKernelExC_ptsz"],
        307 => &["cuLaunchKernel"],
        442 => &["cuLaunchKernel_ptsz"],
        652 => &["cuLaunchKernelEx"],
        653 => &["cuLaunchKernelEx_ptsz"],
        _ => &[],
    }
}

/// tracerd's ask: count launches here at the next "on" (`want::RECORDS`, or `want::ONLY`:
/// without kernel records, where no session asked for GPU times; 0: not asked), with
/// `want::EVENTS` for a tracing session.
#[no_mangle]
pub static tracer_cupti_want_launches: AtomicU64 = AtomicU64::new(0);

/// Whether tracerd asked for launches without kernel records.
pub fn launches_only() -> bool {
    tracer_cupti_want_launches.load(Ordering::Acquire) & (want::RECORDS | want::ONLY) == want::ONLY
}

/// The table's memfd in this process (-1: none yet), for tracerd to take.
#[no_mangle]
pub static tracer_cupti_launch_fd: AtomicI32 = AtomicI32::new(-1);

/// Where Python's state is, written by tracerd before "on" for a CPython process: the
/// address of `PyGILState_GetThisThreadState` and the interpreter's layout, as the probes
/// have them. `set` = 1 once written; 0: not a Python process (no call sites).
#[repr(C)]
pub struct PythonAt {
    pub set: u64,
    pub get_tstate: u64,
    pub layout: PyLayout,
}

pub struct PythonCell(UnsafeCell<PythonAt>);
// SAFETY: written by tracerd from outside before its "on" request, copied once after it.
unsafe impl Sync for PythonCell {}

#[no_mangle]
#[link_section = ".data"]
pub static tracer_cupti_python: PythonCell = PythonCell(UnsafeCell::new(PythonAt {
    set: 0,
    get_tstate: 0,
    layout: unsafe { std::mem::zeroed() },
}));

/// The copy taken at "on" (null: no Python); never freed (launches in flight may read it).
static PYTHON: AtomicPtr<PythonAt> = AtomicPtr::new(std::ptr::null_mut());
/// The table (null until made).
static TABLE: AtomicPtr<u8> = AtomicPtr::new(std::ptr::null_mut());
/// Counting is on: the callback counts.
static COUNTING: AtomicU32 = AtomicU32::new(0);
/// Each launch counted is also an event in the table's ring (a tracing session's).
static EVENTS: AtomicU32 = AtomicU32::new(0);
/// The thread that made the process's last launch from Python: its thread state and
/// `thread_id`, handed to the probe of a launch made elsewhere (as the probes'
/// `PY_LAST_LAUNCHER`).
static LAST_LAUNCHER: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// tracerd's probe point: a launch from a thread without a Python frame in a Python process.
/// The probe reads `key` (its call site left empty), finds the thread it works for (the last
/// launcher, else the GIL's holder) and counts it as the launch probes would.
#[no_mangle]
#[inline(never)]
pub extern "C" fn tracer_cupti_launch_elsewhere(
    key: *const CudaLaunchKey,
    last_tstate: u64,
    last_thread_id: u64,
) {
    std::hint::black_box((key, last_tstate, last_thread_id));
    ELSEWHERE.fetch_add(1, Ordering::Relaxed);
}
static ELSEWHERE: AtomicU64 = AtomicU64::new(0);

/// tracerd's probe point: a new row in the table (`key` as counted, `name` CUPTI's kernel
/// name), announced so that tracerd names its call site, caller and kernel while the
/// process lives. Once per row.
#[no_mangle]
#[inline(never)]
pub extern "C" fn tracer_cupti_new_row(key: *const CudaLaunchKey, name: u64) {
    std::hint::black_box((key, name));
    ROWS.fetch_add(1, Ordering::Relaxed);
}
static ROWS: AtomicU64 = AtomicU64::new(0);

/// Makes the table (once): a sealed memfd, mapped. Its fd, or why not.
pub fn table() -> Result<i32, String> {
    let fd = tracer_cupti_launch_fd.load(Ordering::Acquire);
    if fd >= 0 {
        return Ok(fd);
    }
    let name = std::ffi::CString::new(launches::MEMFD_NAME).unwrap_or_default();
    // SAFETY: plain syscalls on a file of our own.
    unsafe {
        let fd = libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
        if fd < 0 {
            return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
        }
        let fail = |what: &str| {
            let e = format!("{what}: {}", std::io::Error::last_os_error());
            libc::close(fd);
            Err(e)
        };
        if libc::ftruncate(fd, launches::BYTES as libc::off_t) != 0 {
            return fail("ftruncate");
        }
        let p = libc::mmap(
            std::ptr::null_mut(),
            launches::BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        );
        if p == libc::MAP_FAILED {
            return fail("mmap");
        }
        // Its size fixed for good: tracerd's mapping can never fault past the end.
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        if libc::fcntl(fd, libc::F_ADD_SEALS, seals) != 0 {
            libc::munmap(p, launches::BYTES);
            return fail("sealing");
        }
        let h = p.cast::<Header>();
        (*h).version = launches::VERSION;
        (*h).slots = launches::SLOTS as u32;
        // The magic last: tracerd reads nothing without it.
        AtomicU64::from_ptr(std::ptr::addr_of_mut!((*h).magic))
            .store(launches::MAGIC, Ordering::Release);
        TABLE.store(p.cast(), Ordering::Release);
        tracer_cupti_launch_fd.store(fd, Ordering::Release);
        Ok(fd)
    }
}

thread_local! {
    /// A runtime launch under way on this thread when counting started (inside the `cuInit` it
    /// ran): its entry point and caller, made into its row by its driver launch's callback.
    static UNDER_WAY: std::cell::Cell<Option<(u32, u64)>> = const { std::cell::Cell::new(None) };
}

/// The runtime's launch entry points (exported names) and theirs in tracer's terms.
const RUNTIME_ENTRIES: [(&str, u32); 4] = [
    ("cudaLaunchKernel", api::CUDA_LAUNCH),
    ("cudaLaunchKernel_ptsz", api::CUDA_LAUNCH),
    ("cudaLaunchKernelExC", api::CUDA_LAUNCH_EX),
    ("cudaLaunchKernelExC_ptsz", api::CUDA_LAUNCH_EX),
];

/// Called where counting starts inside `cuInit` (a launched command's): a runtime launch
/// that ran it entered before its callback was on, and is counted with its driver launch.
pub fn catch_launch_under_way() {
    if let Some(found) = crate::under_way::under_way(&RUNTIME_ENTRIES) {
        // A loss until a later callback of the call makes its row.
        if let Some(u) = unseen() {
            u.fetch_add(1, Ordering::Relaxed);
        }
        UNDER_WAY.with(|u| u.set(Some(found)));
    }
}

/// Starts counting: the Python layout tracerd wrote is taken now.
pub fn start() {
    // SAFETY: tracerd wrote it before asking; read once here.
    let at = unsafe { std::ptr::read_volatile(tracer_cupti_python.0.get()) };
    if at.set == 1 && at.get_tstate != 0 && PYTHON.load(Ordering::Acquire).is_null() {
        PYTHON.store(Box::into_raw(Box::new(at)), Ordering::Release);
    }
    let events = tracer_cupti_want_launches.load(Ordering::Acquire) & want::EVENTS != 0;
    EVENTS.store(u32::from(events), Ordering::Release);
    COUNTING.store(1, Ordering::Release);
}

/// Stops counting (the callbacks are being turned off).
pub fn stop() {
    COUNTING.store(0, Ordering::Release);
}

/// Launches handed to `tracer_cupti_launch_elsewhere` so far.
pub fn elsewhere() -> u64 {
    ELSEWHERE.load(Ordering::Relaxed)
}

/// `CUpti_CallbackData`'s fields read here (LP64).
#[repr(C)]
struct CallbackData {
    site: u32,
    function_name: *const c_char,
    params: *const c_void,
    return_value: *mut c_void,
    symbol_name: *const c_char,
}

/// CUPTI's callback for the subscriber: counts kernel launches at their entry.
pub extern "C" fn on_api(_: *mut c_void, domain: u32, cbid: u32, data: *const c_void) {
    if data.is_null() || COUNTING.load(Ordering::Acquire) == 0 {
        return;
    }
    let marker = 0u8;
    let sp = std::ptr::addr_of!(marker) as usize;
    // A tracing session's: the launch's time, as near its entry as the callback gets.
    let at = (EVENTS.load(Ordering::Relaxed) != 0).then(crate::monotonic_ns);
    // SAFETY: CUPTI's callback data for an API callback.
    let d = unsafe { &*data.cast::<CallbackData>() };
    let Some(&(_, _, which)) = CALLBACKS.iter().find(|c| c.0 == domain && c.1 == cbid) else {
        return;
    };
    let name = d.symbol_name as u64;
    if d.site != SITE_ENTER {
        // The exit of a runtime launch under way when counting started, which made no
        // driver launch (refused): its row from its own parameters.
        let under_way = UNDER_WAY.with(std::cell::Cell::get);
        if let Some((_, caller)) = under_way.filter(|u| domain == DOMAIN_RUNTIME && u.0 == which) {
            UNDER_WAY.with(|u| u.set(None));
            // SAFETY: the parameters struct of the call `cbid` names.
            if let Some(mut key) = unsafe { read_params(which, d.params) } {
                key.caller = caller;
                seen_after_all();
                finish(key, None, name, at);
            }
        }
        return;
    }
    // SAFETY: the parameters struct of the call `cbid` names.
    let Some(mut key) = (unsafe { read_params(which, d.params) }) else {
        return;
    };
    let caller_domain = if domain == DOMAIN_RUNTIME {
        crate::caller::Domain::Runtime
    } else {
        crate::caller::Domain::Driver
    };
    key.caller = crate::caller::launch_caller(caller_domain, cbid, entry_names(cbid), sp);
    // The runtime launch this driver launch is made in, if its own callback came before
    // counting did: its row, with the driver call's handle, configuration and name.
    let runtime = if domain == DOMAIN_DRIVER {
        UNDER_WAY.with(std::cell::Cell::take).map(|(api, caller)| {
            seen_after_all();
            let mut k = key;
            (k.api, k.caller) = (api, caller);
            k
        })
    } else {
        None
    };
    finish(key, runtime, name, at);
}

/// Counts `key` (and `also`, a row of the same launch) with the launching thread's Python
/// call site, each an event made `at` for a tracing session; from a thread without a Python
/// frame in a Python process, hands them to the probe point that finds the thread it works
/// for (whose program makes their events).
fn finish(mut key: CudaLaunchKey, also: Option<CudaLaunchKey>, name: u64, at: Option<u64>) {
    let python = PYTHON.load(Ordering::Acquire);
    if !python.is_null() {
        // SAFETY: set once, never freed.
        let at = unsafe { &*python };
        match own_site(at) {
            Some((code, instr, names, tstate)) => {
                (key.py_code, key.py_instr, key.py_names) = (code, instr, names);
                key.py_elsewhere = py_from::OWN;
                // SAFETY: this thread's own state, as in `own_site`.
                let id = unsafe { read::<u64>(tstate + u64::from(at.layout.tstate_thread_id)) };
                LAST_LAUNCHER[0].store(tstate, Ordering::Relaxed);
                LAST_LAUNCHER[1].store(id, Ordering::Relaxed);
            }
            None => {
                for k in also.iter().chain(std::iter::once(&key)) {
                    tracer_cupti_launch_elsewhere(
                        k,
                        LAST_LAUNCHER[0].load(Ordering::Relaxed),
                        LAST_LAUNCHER[1].load(Ordering::Relaxed),
                    );
                }
                return;
            }
        }
    }
    if let Some(mut r) = also {
        (r.py_code, r.py_instr, r.py_names, r.py_elsewhere) =
            (key.py_code, key.py_instr, key.py_names, key.py_elsewhere);
        if let (Some(entry), Some(at)) = (count(&r, name), at) {
            event(entry, at);
        }
    }
    if let (Some(entry), Some(at)) = (count(&key, name), at) {
        event(entry, at);
    }
}

thread_local! {
    /// This thread's id, asked of the kernel once.
    static TID: u32 = {
        // SAFETY: a plain syscall.
        unsafe { libc::gettid() as u32 }
    };
}

/// Writes a launch of table entry `entry` at `start_ns` as an event in the ring: its place
/// claimed, its fields written, then its number published.
fn event(entry: u32, start_ns: u64) {
    let base = TABLE.load(Ordering::Acquire);
    if base.is_null() {
        return;
    }
    // SAFETY: a plain call (glibc reads it from rseq or the vDSO).
    let cpu = unsafe { libc::sched_getcpu() };
    // SAFETY: the table is mapped for the process's life, `BYTES` long; the ring follows the
    // entries, `EVENTS` places of it.
    unsafe {
        let header = base.cast::<Header>();
        let n = AtomicU64::from_ptr(std::ptr::addr_of_mut!((*header).events))
            .fetch_add(1, Ordering::Relaxed);
        let place = base
            .add(launches::RING_AT)
            .cast::<Event>()
            .add(n as usize & (launches::EVENTS - 1));
        let seq = AtomicU64::from_ptr(std::ptr::addr_of_mut!((*place).seq));
        // A reader that copies the place while this writes sees `seq` change under it.
        seq.store(launches::WRITING, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        std::ptr::addr_of_mut!((*place).start_ns).write_volatile(start_ns);
        std::ptr::addr_of_mut!((*place).tid).write_volatile(TID.with(|t| *t));
        std::ptr::addr_of_mut!((*place).cpu).write_volatile(cpu.max(0) as u32);
        std::ptr::addr_of_mut!((*place).entry).write_volatile(entry);
        seq.store(n + 1, Ordering::Release);
    }
}

/// The table's `unseen` word (null without a table).
fn unseen() -> Option<&'static AtomicU64> {
    let base = TABLE.load(Ordering::Acquire);
    // SAFETY: the table is mapped for the process's life; the header is its start.
    (!base.is_null()).then(|| unsafe {
        AtomicU64::from_ptr(std::ptr::addr_of_mut!((*base.cast::<Header>()).unseen))
    })
}

/// The launch under way when counting started has its row after all.
fn seen_after_all() {
    if let Some(u) = unseen() {
        let _ = u.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }
}

/// A plain read of this process's memory at `addr`.
///
/// # Safety
/// `addr` must be readable for `T`.
unsafe fn read<T: Copy>(addr: u64) -> T {
    // SAFETY: the caller's.
    unsafe { std::ptr::read_unaligned(addr as *const T) }
}

/// A launch key from a launch call's parameters (`cupti_runtime_cbid.h`'s and
/// `cupti_driver_cbid.h`'s `*_params` structs: the call's arguments in order).
///
/// # Safety
/// `params` must point to the parameters of a call of `which`'s kind.
unsafe fn read_params(which: u32, params: *const c_void) -> Option<CudaLaunchKey> {
    if params.is_null() {
        return None;
    }
    // SAFETY: the caller's: every read is inside the parameters (or the config they name).
    unsafe {
        let p = params as u64;
        let mut key = CudaLaunchKey {
            api: which,
            ..CudaLaunchKey::default()
        };
        let dims = |at: u64| [read::<u32>(at), read::<u32>(at + 4), read::<u32>(at + 8)];
        match which {
            // { func, dim3 grid, dim3 block, args, size_t shmem, stream }
            api::CUDA_LAUNCH => {
                key.func = read(p);
                key.grid = dims(p + 8);
                key.block = dims(p + 20);
                key.shared_mem = read::<u64>(p + 40) as u32;
                key.stream = read(p + 48);
            }
            // { f, gridX..Z, blockX..Z, shmem, stream, params, extra }
            api::CU_LAUNCH => {
                key.func = read(p);
                key.grid = dims(p + 8);
                key.block = dims(p + 20);
                key.shared_mem = read(p + 32);
                key.stream = read(p + 40);
            }
            // { const config *, func / f, … }: the configs as the probes read them.
            api::CUDA_LAUNCH_EX | api::CU_LAUNCH_EX => {
                let config: u64 = read(p);
                if config == 0 {
                    return None;
                }
                key.func = read(p + 8);
                let c: [u32; 10] = read(config);
                key.grid = [c[0], c[1], c[2]];
                key.block = [c[3], c[4], c[5]];
                key.shared_mem = c[6];
                key.stream = u64::from(c[8]) | u64::from(c[9]) << 32;
            }
            _ => return None,
        }
        Some(key)
    }
}

/// This thread's innermost Python frame's (code object, instruction, names id) and its
/// thread state; None when it runs no Python.
fn own_site(at: &PythonAt) -> Option<(u64, u64, u64, u64)> {
    // SAFETY: `PyGILState_GetThisThreadState`, found by tracerd in this process's CPython:
    // no arguments, no GIL needed.
    let get: extern "C" fn() -> u64 = unsafe { std::mem::transmute(at.get_tstate as usize) };
    let tstate = get();
    if tstate == 0 {
        return None;
    }
    let l = &at.layout;
    // SAFETY (each read): this thread's own state and the frames under this call, alive
    // until it returns; offsets as the probes read them.
    unsafe {
        let mut frame: u64 = if l.kind == py_kind::CFRAME {
            let cframe: u64 = read(tstate + u64::from(l.tstate_cframe));
            if cframe == 0 {
                return None;
            }
            read(cframe + u64::from(l.cframe_current_frame))
        } else {
            read(tstate + u64::from(l.tstate_current_frame))
        };
        if frame != 0
            && l.frame_owner != 0
            && read::<u8>(frame + u64::from(l.frame_owner)) >= PY_FRAME_OWNER_NOT_PYTHON
        {
            frame = read(frame + u64::from(l.frame_previous));
        }
        if frame == 0 {
            return None;
        }
        let code = l.code_of(read(frame + u64::from(l.frame_code)));
        if code == 0 {
            return None;
        }
        let instr = if l.kind == py_kind::EVAL_ARG_FRAME {
            read::<i32>(frame + u64::from(l.frame_instr)) as i64 as u64
        } else {
            read::<u64>(frame + u64::from(l.frame_instr))
        };
        let qualname: u64 = read(code + u64::from(l.code_qualname));
        let filename: u64 = read(code + u64::from(l.code_filename));
        Some((code, instr, py_names_id(qualname, filename), tstate))
    }
}

/// Adds one launch of `key` to the table: the entry counted, if there was room.
fn count(key: &CudaLaunchKey, name: u64) -> Option<u32> {
    let base = TABLE.load(Ordering::Acquire);
    if base.is_null() {
        return None;
    }
    // SAFETY: the table is mapped for the process's life, `BYTES` long.
    unsafe {
        let header = base.cast::<Header>();
        let entries = base.add(std::mem::size_of::<Header>()).cast::<Entry>();
        let first = launches::first_slot(key);
        for i in 0..launches::PROBES {
            let at = (first + i) & (launches::SLOTS - 1);
            let e = entries.add(at);
            let st = AtomicU32::from_ptr(std::ptr::addr_of_mut!((*e).state));
            let mut s = st.load(Ordering::Acquire);
            if s == state::EMPTY {
                match st.compare_exchange(
                    state::EMPTY,
                    state::FILLING,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {
                        (*e).key = *key;
                        (*e).name = name;
                        AtomicU64::from_ptr(std::ptr::addr_of_mut!((*e).count))
                            .store(1, Ordering::Relaxed);
                        st.store(state::READY, Ordering::Release);
                        tracer_cupti_new_row(key, name);
                        return Some(at as u32);
                    }
                    Err(now) => s = now,
                }
            }
            // Another thread filling it: its key is known in a moment. (One that does not
            // finish in time is passed: the key may then get a second entry, which tracerd
            // adds to the first.)
            let mut spins = 0;
            while s == state::FILLING && spins < FILL_SPINS {
                std::hint::spin_loop();
                s = st.load(Ordering::Acquire);
                spins += 1;
            }
            if s == state::READY && (*e).key == *key {
                AtomicU64::from_ptr(std::ptr::addr_of_mut!((*e).count))
                    .fetch_add(1, Ordering::Relaxed);
                return Some(at as u32);
            }
        }
        AtomicU64::from_ptr(std::ptr::addr_of_mut!((*header).full)).fetch_add(1, Ordering::Relaxed);
        None
    }
}

/// How long a launch waits for another thread to finish writing an entry's key.
const FILL_SPINS: u32 = 10_000;
