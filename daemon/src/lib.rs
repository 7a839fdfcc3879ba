//! tracerd's library: everything the daemon binary wires together.

pub mod access;
pub mod bpf;
pub mod capabilities;
pub mod daemon;
pub mod error;
pub mod export;
pub mod native;
pub mod perf;
pub mod process;
pub mod python;
pub mod report;
pub mod server;
pub mod session;
pub mod store;
