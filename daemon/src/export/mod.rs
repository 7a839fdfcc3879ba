//! Report formats other than the built-in table and JSON.

pub mod pstats;
