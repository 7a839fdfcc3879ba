//! tracer's BPF programs. One object, loaded once by tracerd; programs are attached as sessions need them.
#![no_std]
#![no_main]
// Atomic map updates: core's atomics lack read-modify-write on the BPF target.
#![allow(internal_features)]
#![feature(core_intrinsics)]

mod cuda;
mod native;
mod offcpu;
mod proc;
mod python;
pub(crate) mod sample;
mod shared;
mod tasks;
mod trace;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // BPF programs cannot panic at run time; the verifier rejects any path that would reach here.
    loop {}
}
