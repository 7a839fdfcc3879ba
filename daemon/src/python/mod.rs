//! CPython: finding interpreters, their eval loops, and counting their calls.

pub mod discover;
pub mod layout;
pub mod linetable;
pub mod memory;
pub mod probe_point;
pub mod runtime;
