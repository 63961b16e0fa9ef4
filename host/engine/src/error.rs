//! What stops an engine from starting, and which of it is the command line's fault.

use std::net::SocketAddr;

use switchyard_kv::KvError;

/// Why the engine could not start or keep running.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid engine option --{flag}: {reason}")]
    BadArg { flag: &'static str, reason: String },
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("cannot listen for HTTP on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot load the model {model}: {reason}")]
    Model { model: String, reason: String },
    #[error("cannot bind the KV-events {what} socket on tcp://{addr}: {source}")]
    KvEvents {
        what: &'static str,
        addr: SocketAddr,
        source: zeromq::ZmqError,
    },
    #[error("cannot start the engine's {what}: {source}")]
    Start {
        what: &'static str,
        source: std::io::Error,
    },
}

impl EngineError {
    /// Whether the command line is at fault (the process exits with a usage code).
    pub fn is_usage(&self) -> bool {
        matches!(self, EngineError::BadArg { .. })
    }
}
