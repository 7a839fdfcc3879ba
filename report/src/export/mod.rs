//! Report formats other than the built-in table and JSON, one function each: profiles
//! (`folded`, `pprof`, `otlp`, `speedscope`, `svg`), traces (`chrome`, `perfetto`), Python
//! counts (`pstats`).

mod chrome;
mod folded;
mod otlp;
mod perfetto;
mod pprof;
mod pstats;
mod speedscope;
mod svg;
mod table;

pub use chrome::write as chrome;
pub use folded::folded;
pub use otlp::otlp;
pub use perfetto::write as perfetto;
pub use pprof::pprof;
pub use pstats::encode as pstats;
pub use speedscope::speedscope;
pub use svg::svg;

pub(crate) use crate::us;
