//! CPython: finding interpreters, their eval loops, and counting their calls.

pub mod debug_offsets;
pub mod discover;
pub mod jit;
pub mod layout;
pub mod linetable;
pub mod memory;
pub mod opcodes;
pub mod probe_point;
pub mod runtime;
