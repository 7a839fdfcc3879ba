//! CPython: finding interpreters, their eval loops, and counting their calls.

pub mod asyncio;
pub mod debug_offsets;
pub mod discover;
pub mod inproc;
pub mod jit;
pub mod layout;
pub mod linetable;
pub mod memory;
pub mod opcodes;
pub mod probe_point;
pub mod remote_exec;
pub mod runtime;
