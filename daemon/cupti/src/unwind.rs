//! libgcc_s's unwinder, which std links on linux-gnu: the calls the caller search and the
//! launch under way at `cuInit` walk this thread's stack with.

use std::ffi::{c_int, c_void};

extern "C" {
    pub(crate) fn _Unwind_Backtrace(
        trace: extern "C" fn(*mut c_void, *mut c_void) -> c_int,
        arg: *mut c_void,
    ) -> c_int;
    pub(crate) fn _Unwind_GetIP(ctx: *mut c_void) -> usize;
    pub(crate) fn _Unwind_GetCFA(ctx: *mut c_void) -> usize;
}
