//! The daemon's errors, and the one place they become gRPC statuses.

use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("no process with pid {pid}")]
    NoSuchProcess { pid: u32 },
    #[error("permission denied: {reason}")]
    PermissionDenied { reason: String },
    #[error("no session with id '{}'", clip(id, 64))]
    NoSuchSession { id: String },
    #[error("session {id} is still running; its report is available once it ends (stop it with `tracerctl stop {id}`)")]
    StillRunning { id: String },
    #[error("{0}")]
    Unimplemented(String),
    /// The request is valid but the target cannot be measured that way (e.g. not a supported CPython).
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error(transparent)]
    Bpf(#[from] tracer_bpf::BpfError),
    #[error(transparent)]
    Sampler(#[from] tracer_bpf::sampler::SamplerError),
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the daemon is shutting down")]
    ShuttingDown,
}

impl Error {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }

    pub fn code(&self) -> Code {
        match self {
            Error::InvalidArgument(_) => Code::InvalidArgument,
            Error::NoSuchProcess { .. } | Error::NoSuchSession { .. } => Code::NotFound,
            Error::PermissionDenied { .. } => Code::PermissionDenied,
            Error::StillRunning { .. } | Error::FailedPrecondition(_) => Code::FailedPrecondition,
            Error::Unimplemented(_) => Code::Unimplemented,
            Error::ResourceExhausted(_) => Code::ResourceExhausted,
            Error::ShuttingDown => Code::Unavailable,
            Error::Bpf(_) | Error::Store(_) | Error::Io { .. } => Code::Internal,
            // Perf events refused: a limit of the machine (perf_event_paranoid, the
            // maximum sample rate), not a bug of the daemon.
            Error::Sampler(_) => Code::FailedPrecondition,
        }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        Status::new(e.code(), clip(&e.to_string(), MAX_MESSAGE))
    }
}

/// A status message travels in a header, which clients cap (16 KiB, percent-encoded): one
/// that echoes a long input must not turn into a transport error.
pub const MAX_MESSAGE: usize = 2048;

/// `s` cut to at most `max` bytes (on a character boundary), saying how long it was.
pub fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &s[..end], s.len())
}
