//! tracer's gRPC API. The code under `generated/` comes from `proto/tracer.proto` through
//! `cargo xtask gen-proto`; users of this crate need no `protoc`.

#[allow(clippy::all, clippy::pedantic, missing_docs)]
#[rustfmt::skip]
mod generated {
    include!("generated/tracer.v1.rs");
}

pub use generated::*;

/// The encoded `FileDescriptorSet` of tracer.proto, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!("generated/tracer_descriptor.bin");

pub mod pprof;
