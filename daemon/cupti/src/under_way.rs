//! The launch under way on this thread, found by an unwind whose frames are named by the
//! loader: for counting that starts inside `cuInit`, which a runtime launch may have run.

use std::ffi::{c_int, c_void};

use crate::unwind::{_Unwind_Backtrace, _Unwind_GetIP};

/// The runtime launch entry point (of `names`, with its tag) whose call is under way on this
/// thread, and the return address of that call (its caller, as a probe at its entry reads
/// it): for `cuInit` run from inside a runtime launch, before CUPTI's callbacks were on. An
/// unwind from here, each frame named by `dladdr1`.
pub(crate) fn under_way(names: &[(&str, u32)]) -> Option<(u32, u64)> {
    extern "C" fn trace(ctx: *mut c_void, arg: *mut c_void) -> c_int {
        // SAFETY: `arg` is the Vec passed below; `ctx` is the unwinder's.
        let ips = unsafe { &mut *arg.cast::<Vec<usize>>() };
        if ips.len() == MAX_FRAMES {
            return 4; // _URC_NORMAL_STOP
        }
        // SAFETY: as above.
        ips.push(unsafe { _Unwind_GetIP(ctx) });
        0
    }
    const MAX_FRAMES: usize = 128;
    let mut ips: Vec<usize> = Vec::with_capacity(MAX_FRAMES);
    // SAFETY: `trace` only pushes onto `ips`, which outlives the call.
    unsafe { _Unwind_Backtrace(trace, (&raw mut ips).cast()) };
    for (j, &ip) in ips.iter().enumerate().skip(1) {
        // A return address may end its function: named one byte back.
        let Some(name) = symbol_at(ip.saturating_sub(1)) else {
            continue;
        };
        if let Some(&(_, tag)) = names.iter().find(|(n, _)| n.as_bytes() == name) {
            let caller = ips.get(j + 1).copied().unwrap_or(0);
            return Some((tag, caller as u64));
        }
    }
    None
}

/// The name of the exported symbol `addr` lies in (within its size: a static function after
/// it is not it), if any.
fn symbol_at(addr: usize) -> Option<&'static [u8]> {
    // glibc's RTLD_DL_SYMENT: `extra` is the symbol's ELF entry.
    const SYMENT: c_int = 1;
    // SAFETY: dladdr1 only reads the loader's tables; the name and entry live as long as their
    // object, which holds code on this stack.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        let mut extra: *mut c_void = std::ptr::null_mut();
        if libc::dladdr1(addr as *const c_void, &mut info, &mut extra, SYMENT) == 0
            || info.dli_sname.is_null()
            || extra.is_null()
        {
            return None;
        }
        let sym = &*extra.cast::<libc::Elf64_Sym>();
        let start = info.dli_saddr as usize;
        if addr < start || addr - start >= sym.st_size as usize {
            return None;
        }
        Some(std::ffi::CStr::from_ptr(info.dli_sname).to_bytes())
    }
}
