//! Report formats other than the built-in table and JSON.

pub mod chrome;
pub mod folded;
pub mod kernels;
pub mod perfetto;
pub mod pprof;
pub mod pstats;
pub mod speedscope;
pub mod svg;

/// `ns` as a number of microseconds with nanosecond decimals, exactly (no float rounding):
/// Chrome's JSON times and the tables' µs columns.
pub(crate) fn us(ns: u64) -> String {
    format!("{}.{:03}", ns / 1000, ns % 1000)
}
