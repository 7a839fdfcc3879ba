//! CPython: finding interpreters on this machine and where their eval loop lives.

pub mod discover;
