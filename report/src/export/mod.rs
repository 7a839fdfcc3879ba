//! Report formats other than the built-in table and JSON.

pub mod chrome;
pub mod folded;
pub mod otlp;
pub mod perfetto;
pub mod pprof;
pub mod pstats;
pub mod speedscope;
pub mod svg;
mod table;

pub(crate) use crate::us;
