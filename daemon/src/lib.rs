//! tracerd's library: everything the daemon binary wires together.

pub mod access;
pub mod capabilities;
pub mod clock;
pub mod conn;
pub mod container;
pub mod continuous;
pub mod daemon;
pub mod error;
pub mod gpu;
pub mod guardian;
pub mod live;
pub mod metrics;
pub mod remote;
pub mod requests;
pub mod server;
pub mod session;
pub mod store;

// The crates below this one: the kernel side's loading, what tracer knows of processes and
// binaries, the report model with its renderers, and the naming of addresses and stacks.
pub use tracer_bpf::{bpf, btf, perf, sampler};
pub use tracer_inspect::{binary, cuda, native, plt, process, python, unwind};
pub use tracer_report::{self as report, export, profile};
pub use tracer_symbolize::{stacks, symbolize};
