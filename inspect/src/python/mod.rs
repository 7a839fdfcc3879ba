//! CPython: finding interpreters, their eval loops, and counting their calls.

mod asyncio;
mod debug_offsets;
pub mod discover;
pub mod inproc;
pub mod jit;
pub mod layout;
pub mod linetable;
pub mod memory;
mod opcodes;
mod probe_point;
mod remote_exec;
pub mod runtime;
