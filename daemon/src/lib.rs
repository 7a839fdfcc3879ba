//! tracerd's library: everything the daemon binary wires together.

pub mod access;
pub mod bpf;
pub mod btf;
pub mod capabilities;
pub mod cuda;
pub mod daemon;
pub mod error;
pub mod export;
pub mod gpu;
pub mod live;
pub mod native;
pub mod perf;
pub mod plt;
pub mod process;
pub mod profile;
pub mod python;
pub mod remote;
pub mod report;
pub mod sampler;
pub mod server;
pub mod session;
pub mod stacks;
pub mod store;
pub mod symbolize;
pub mod trace;
pub mod unwind;
