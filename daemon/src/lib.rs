//! tracerd's library: everything the daemon binary wires together.

pub mod access;
pub mod bpf;
pub mod btf;
pub mod capabilities;
pub mod clock;
pub mod conn;
pub mod container;
pub mod continuous;
pub mod cuda;
pub mod daemon;
pub mod error;
pub mod gpu;
pub mod guardian;
pub mod live;
pub mod metrics;
pub mod native;
pub mod perf;
pub mod plt;
pub mod process;
pub mod python;
pub mod remote;
pub mod requests;
pub mod sampler;
pub mod server;
pub mod session;
pub mod stacks;
pub mod store;
pub mod symbolize;
pub mod unwind;

// The report model and its renderers are a crate of their own, below this one.
pub use tracer_report::{self as report, export, profile};
