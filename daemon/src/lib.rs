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
