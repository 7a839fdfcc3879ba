//! What tracer knows about processes and the binaries they run, read from outside them:
//! `/proc` (maps, credentials, children, containers and pods), native symbols and PLT stubs, `.eh_frame` unwinding,
//! CPython (discovery, struct layouts, probe points, line tables, memory reads, the in-process
//! counter) and CUDA's libraries and kernel names. It loads no probe and knows no session.

pub mod binary;
pub mod container;
mod creds;
pub mod cuda;
pub mod demangle;
pub mod native;
pub mod pinned;
pub mod plt;
pub mod process;
pub mod python;
pub mod sigbus;
pub mod unwind;
