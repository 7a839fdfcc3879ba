//! The slice of CUPTI's activity API this library calls, loaded with dlsym (CUPTI's location
//! varies: a wheel's `nvidia/…/lib`, the toolkit's `extras/CUPTI/lib64`), and the layout of
//! its kernel records. Prototypes, enum values and offsets are those of NVIDIA's
//! `cupti_activity.h` and `cupti_result.h` (CUDA 12.x and 13.0).

use std::ffi::{c_char, c_void};

use tracer_common::CuptiKernel;

type CuptiResult = u32;
const CUPTI_SUCCESS: CuptiResult = 0;
/// `CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED`: another tool (torch.profiler's kineto,
/// Nsight Systems or Compute, cuda-gdb) holds CUPTI's one subscriber slot in this process.
pub const ERROR_MULTIPLE_SUBSCRIBERS: CuptiResult = 39;

/// `CUpti_ActivityKind`: `CUPTI_ACTIVITY_KIND_KERNEL` serializes kernels;
/// `CONCURRENT_KERNEL` lets them overlap as they would untraced, so it is tried first.
pub const ACTIVITY_KIND_KERNEL: u32 = 3;
pub const ACTIVITY_KIND_CONCURRENT_KERNEL: u32 = 10;
/// `CUPTI_ACTIVITY_FLAG_FLUSH_FORCED`: also hand over buffers not full yet.
const FLUSH_FORCED: u32 = 1;

/// Byte offsets in `CUpti_ActivityKernel*`: versions 3 to 13 (CUDA 12's Kernel9, 13.0's
/// Kernel10, 13.1's Kernel11…) agree on everything read here and only append fields (packed,
/// aligned to 8, every field at its natural alignment).
mod kernel {
    pub const KIND: usize = 0;
    pub const START: usize = 16;
    pub const END: usize = 24;
    pub const DEVICE_ID: usize = 40;
    pub const STREAM_ID: usize = 48;
    pub const GRID_X: usize = 52;
    pub const BLOCK_X: usize = 64;
    pub const STATIC_SHARED: usize = 76;
    pub const DYNAMIC_SHARED: usize = 80;
    pub const CORRELATION_ID: usize = 92;
    pub const NAME: usize = 104;
    /// Bytes up to and including `name`: a record must be at least this long.
    pub const READ: usize = NAME + 8;
}

type BufferRequested = extern "C" fn(*mut *mut u8, *mut usize, *mut usize);
type BufferCompleted = extern "C" fn(*mut c_void, u32, *mut u8, usize, usize);
/// `CUpti_CallbackFunc`: (userdata, domain, callback id, callback data).
type Callback = extern "C" fn(*mut c_void, u32, u32, *const c_void);
/// `CUpti_SubscriberHandle`.
pub(crate) struct Subscriber(*mut c_void);
// SAFETY: an opaque handle CUPTI hands out, used from whichever thread holds it.
unsafe impl Send for Subscriber {}

/// What attaching to a running process adds: CUPTI's one subscriber slot, taken to learn
/// that no other tool holds it (and to keep one from starting meanwhile), and the calls that
/// undo everything at the end.
pub(crate) struct Attach {
    subscribe: unsafe extern "C" fn(*mut *mut c_void, Callback, *mut c_void) -> CuptiResult,
    enable_callback: unsafe extern "C" fn(u32, *mut c_void, u32, u32) -> CuptiResult,
    unsubscribe: unsafe extern "C" fn(*mut c_void) -> CuptiResult,
    disable: unsafe extern "C" fn(u32) -> CuptiResult,
    finalize: unsafe extern "C" fn() -> CuptiResult,
}

/// CUPTI's entry points, from dlsym.
pub(crate) struct Cupti {
    register_callbacks: unsafe extern "C" fn(BufferRequested, BufferCompleted) -> CuptiResult,
    enable: unsafe extern "C" fn(u32) -> CuptiResult,
    next_record: unsafe extern "C" fn(*mut u8, usize, *mut *mut u8) -> CuptiResult,
    flush_all: unsafe extern "C" fn(u32) -> CuptiResult,
    get_timestamp: unsafe extern "C" fn(*mut u64) -> CuptiResult,
    dropped: unsafe extern "C" fn(*mut c_void, u32, *mut usize) -> CuptiResult,
    result_string: Option<unsafe extern "C" fn(CuptiResult, *mut *const c_char) -> CuptiResult>,
    /// The calls only attaching needs; `None` where this CUPTI lacks one (said when used).
    attach: Result<Attach, String>,
}

/// dlsym of `name` in `lib`, as a function pointer type `F`.
fn sym<F: Copy>(lib: *mut c_void, name: &str) -> Option<F> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: a valid handle and a NUL-terminated name.
    let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
    if p.is_null() {
        return None;
    }
    debug_assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: `F` is the function pointer type of the symbol's C prototype.
    Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

impl Cupti {
    /// CUPTI's entry points in the dlopen()ed `lib`.
    pub fn load(lib: *mut c_void) -> Result<Self, String> {
        fn need<F: Copy>(lib: *mut c_void, name: &str) -> Result<F, String> {
            sym(lib, name).ok_or_else(|| format!("libcupti has no {name}"))
        }
        Ok(Self {
            register_callbacks: need(lib, "cuptiActivityRegisterCallbacks")?,
            enable: need(lib, "cuptiActivityEnable")?,
            next_record: need(lib, "cuptiActivityGetNextRecord")?,
            flush_all: need(lib, "cuptiActivityFlushAll")?,
            get_timestamp: need(lib, "cuptiGetTimestamp")?,
            dropped: need(lib, "cuptiActivityGetNumDroppedRecords")?,
            result_string: sym(lib, "cuptiGetResultString"),
            attach: (|| {
                Ok(Attach {
                    subscribe: need(lib, "cuptiSubscribe")?,
                    enable_callback: need(lib, "cuptiEnableCallback")?,
                    unsubscribe: need(lib, "cuptiUnsubscribe")?,
                    disable: need(lib, "cuptiActivityDisable")?,
                    finalize: need(lib, "cuptiFinalize")?,
                })
            })(),
        })
    }

    fn attach(&self) -> Result<&Attach, String> {
        self.attach.as_ref().map_err(Clone::clone)
    }

    /// Takes CUPTI's subscriber slot; the error says who may hold it.
    pub fn subscribe(&self) -> Result<Subscriber, String> {
        let a = self.attach()?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: CUPTI fills `handle`; the callback has CUPTI's prototype. It is called only
        // for the callbacks turned on ([`Self::count_launches`]).
        let r =
            unsafe { (a.subscribe)(&mut handle, super::launches::on_api, std::ptr::null_mut()) };
        if r == ERROR_MULTIPLE_SUBSCRIBERS {
            return Err("another CUPTI subscriber holds this process (torch.profiler, Nsight Systems or Compute, cuda-gdb): tracer does not take CUPTI from it".into());
        }
        self.check("cuptiSubscribe", r)?;
        Ok(Subscriber(handle))
    }

    /// Turns on the subscriber's callbacks for kernel launches (`launches::CALLBACKS`); on
    /// an error, those turned on are turned off again.
    pub fn count_launches(&self, subscriber: &Subscriber) -> Result<(), String> {
        let a = self.attach()?;
        for (i, &(domain, cbid, _)) in super::launches::CALLBACKS.iter().enumerate() {
            // SAFETY: plain calls with the handle CUPTI gave.
            let r = unsafe { (a.enable_callback)(1, subscriber.0, domain, cbid) };
            if let Err(e) = self.check("cuptiEnableCallback", r) {
                for &(domain, cbid, _) in &super::launches::CALLBACKS[..i] {
                    // SAFETY: as above.
                    unsafe { (a.enable_callback)(0, subscriber.0, domain, cbid) };
                }
                return Err(format!("{e} (domain {domain}, callback {cbid})"));
            }
        }
        Ok(())
    }

    /// Lets the subscriber slot go (its callbacks with it), CUPTI left attached.
    pub fn let_go(&self, subscriber: Subscriber) -> Result<(), String> {
        let a = self.attach()?;
        // SAFETY: a plain call with the handle CUPTI gave.
        self.check("cuptiUnsubscribe", unsafe { (a.unsubscribe)(subscriber.0) })
    }

    /// Turns kernel records of `kind` (if any) off, lets the subscriber slot go and detaches CUPTI
    /// from the process (`cuptiFinalize`), as a profiler that ends does. Errors are said,
    /// and every step is tried.
    pub fn detach(&self, kind: Option<u32>, subscriber: Subscriber) -> Result<(), String> {
        let a = self.attach()?;
        // SAFETY (each): plain calls with a kind and the handle CUPTI gave.
        let steps = [
            (
                "cuptiActivityDisable",
                kind.map_or(CUPTI_SUCCESS, |k| unsafe { (a.disable)(k) }),
            ),
            ("cuptiUnsubscribe", unsafe { (a.unsubscribe)(subscriber.0) }),
            ("cuptiFinalize", unsafe { (a.finalize)() }),
        ];
        let errors: Vec<String> = steps
            .into_iter()
            .filter_map(|(what, r)| self.check(what, r).err())
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    fn check(&self, what: &str, r: CuptiResult) -> Result<(), String> {
        if r == CUPTI_SUCCESS {
            return Ok(());
        }
        let mut text: *const c_char = std::ptr::null();
        if let Some(f) = self.result_string {
            // SAFETY: CUPTI writes a static string's address.
            unsafe { f(r, &mut text) };
        }
        Err(format!("{what}: CUPTI error {r} {}", super::c_str(text)))
    }

    pub fn register_buffers(
        &self,
        requested: BufferRequested,
        completed: BufferCompleted,
    ) -> Result<(), String> {
        // SAFETY: two functions with CUPTI's callback prototypes.
        let r = unsafe { (self.register_callbacks)(requested, completed) };
        self.check("cuptiActivityRegisterCallbacks", r)
    }

    /// Turns on kernel records: concurrent ones, else serialized ones. Which it got, in
    /// words and as the kind.
    pub fn enable_kernel_records(&self) -> Result<(&'static str, u32), String> {
        // SAFETY: plain calls.
        if unsafe { (self.enable)(ACTIVITY_KIND_CONCURRENT_KERNEL) } == CUPTI_SUCCESS {
            return Ok(("concurrent kernel", ACTIVITY_KIND_CONCURRENT_KERNEL));
        }
        let r = unsafe { (self.enable)(ACTIVITY_KIND_KERNEL) };
        self.check("cuptiActivityEnable(KERNEL)", r)?;
        Ok(("kernel (serialized)", ACTIVITY_KIND_KERNEL))
    }

    pub fn flush(&self, forced: bool) {
        // SAFETY: plain call.
        unsafe { (self.flush_all)(if forced { FLUSH_FORCED } else { 0 }) };
    }

    pub fn timestamp(&self) -> Option<u64> {
        let mut t = 0;
        // SAFETY: CUPTI fills `t`.
        (unsafe { (self.get_timestamp)(&mut t) } == CUPTI_SUCCESS).then_some(t)
    }

    /// Records CUPTI dropped from this context's stream's buffers.
    pub fn dropped(&self, ctx: *mut c_void, stream: u32) -> u64 {
        let mut n = 0usize;
        // SAFETY: CUPTI fills `n`.
        if unsafe { (self.dropped)(ctx, stream, &mut n) } != CUPTI_SUCCESS {
            return 0;
        }
        n as u64
    }

    /// Calls `f` with each record of a completed buffer, as a byte slice of at least
    /// `kernel::READ` bytes (or up to the buffer's end).
    pub fn each_record(&self, buffer: *mut u8, valid: usize, mut f: impl FnMut(&[u8])) {
        if buffer.is_null() || valid == 0 {
            return;
        }
        let end = buffer as usize + valid;
        let mut record: *mut u8 = std::ptr::null_mut();
        // SAFETY: CUPTI walks its own buffer; `record` points inside it.
        while unsafe { (self.next_record)(buffer, valid, &mut record) } == CUPTI_SUCCESS {
            let len = (end - record as usize).min(kernel::READ);
            // SAFETY: `record` .. `record + len` lies inside the valid part of the buffer.
            f(unsafe { std::slice::from_raw_parts(record, len) });
        }
    }
}

fn u32_at(r: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(r.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(r: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_ne_bytes(r.get(at..at + 8)?.try_into().ok()?))
}

/// A kernel record's fields, in CUPTI's clock; `None` for other kinds of record.
pub(crate) fn kernel_record(r: &[u8]) -> Option<CuptiKernel> {
    let kind = u32_at(r, kernel::KIND)?;
    if kind != ACTIVITY_KIND_KERNEL && kind != ACTIVITY_KIND_CONCURRENT_KERNEL {
        return None;
    }
    let dims = |at: usize| -> Option<[u32; 3]> {
        Some([u32_at(r, at)?, u32_at(r, at + 4)?, u32_at(r, at + 8)?])
    };
    Some(CuptiKernel {
        name: u64_at(r, kernel::NAME)?,
        start_ns: u64_at(r, kernel::START)?,
        end_ns: u64_at(r, kernel::END)?,
        device: u32_at(r, kernel::DEVICE_ID)?,
        stream: u32_at(r, kernel::STREAM_ID)?,
        correlation: u32_at(r, kernel::CORRELATION_ID)?,
        shared_mem: u32_at(r, kernel::STATIC_SHARED)?
            .saturating_add(u32_at(r, kernel::DYNAMIC_SHARED)?),
        grid: dims(kernel::GRID_X)?,
        block: dims(kernel::BLOCK_X)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CUpti_ActivityKernel10 record as CUDA 13.0 lays it out (216 bytes), written field by
    /// field at the header's offsets.
    fn record(kind: u32) -> Vec<u8> {
        let mut r = vec![0u8; 216];
        let mut put = |at: usize, bytes: &[u8]| r[at..at + bytes.len()].copy_from_slice(bytes);
        put(0, &kind.to_ne_bytes());
        put(6, &32u16.to_ne_bytes()); // registersPerThread
        put(16, &1_000u64.to_ne_bytes());
        put(24, &4_500u64.to_ne_bytes());
        put(32, &4_600u64.to_ne_bytes()); // completed
        put(40, &1u32.to_ne_bytes());
        put(44, &9u32.to_ne_bytes()); // contextId
        put(48, &13u32.to_ne_bytes());
        for (i, v) in [8u32, 4, 2, 32, 4, 1].iter().enumerate() {
            put(52 + 4 * i, &v.to_ne_bytes());
        }
        put(76, &256u32.to_ne_bytes());
        put(80, &1024u32.to_ne_bytes());
        put(92, &77u32.to_ne_bytes());
        put(96, &5i64.to_ne_bytes()); // gridId
        put(104, &0xdead_beefu64.to_ne_bytes());
        r
    }

    #[test]
    fn kernel_records_are_read_at_the_headers_offsets() {
        let k = kernel_record(&record(ACTIVITY_KIND_CONCURRENT_KERNEL)).unwrap();
        assert_eq!(
            k,
            CuptiKernel {
                name: 0xdead_beef,
                start_ns: 1_000,
                end_ns: 4_500,
                device: 1,
                stream: 13,
                correlation: 77,
                shared_mem: 1280,
                grid: [8, 4, 2],
                block: [32, 4, 1],
            }
        );
        assert!(kernel_record(&record(ACTIVITY_KIND_KERNEL)).is_some());
        // Another kind, and a record cut short, are not kernels.
        assert_eq!(kernel_record(&record(1)), None);
        assert_eq!(kernel_record(&record(ACTIVITY_KIND_KERNEL)[..100]), None);
    }
}
