//! The one error type of this crate: a variant per failed operation, naming the peer, file or
//! setting at fault.

use std::io;
use std::path::PathBuf;

/// Everything that can fail in rdmastream.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// TCP connect to the receiver (side channel or software transport) failed.
    #[error("cannot connect to receiver {peer}: {source}")]
    Connect { peer: String, source: io::Error },
    /// The handshake with a peer failed (malformed, timed out, wrong version).
    #[error("handshake with {peer} failed: {reason}")]
    Handshake { peer: String, reason: String },
    /// The receiver answered the handshake with a refusal.
    #[error("receiver {peer} refused the connection: {reason}")]
    Refused { peer: String, reason: String },
    /// Keys do not fit: the receiver asks for one this side lacks, or cannot prove it knows
    /// this side's. Retrying cannot help.
    #[error("authenticating with {peer} failed: {reason}")]
    Auth { peer: String, reason: String },
    /// An established connection broke.
    #[error("connection to {peer} lost: {reason}")]
    Disconnected { peer: String, reason: String },
    /// Binding the listening socket failed.
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: String, source: io::Error },
    /// The selected transport cannot be used here.
    #[error("transport '{transport}' is not available: {reason}")]
    Unavailable {
        transport: &'static str,
        reason: String,
    },
    /// An image file of an `images` source could not be read or decoded.
    #[error("cannot read image {path}: {reason}")]
    Image { path: PathBuf, reason: String },
    /// A file or directory operation failed.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    /// A setting is out of range or inconsistent.
    #[error("invalid setting {key}: {reason}")]
    Invalid { key: String, reason: String },
    /// An RDMA verbs operation failed.
    #[error("RDMA: {op}: {source}")]
    Rdma {
        op: String,
        /// What the verbs layer reported (`rdmastream_verbs::ibv::VerbsError`).
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Spawning a thread failed.
    #[error("cannot start thread {name}: {source}")]
    Thread { name: String, source: io::Error },
}

impl Error {
    pub fn invalid(key: impl Into<String>, reason: impl Into<String>) -> Error {
        Error::Invalid {
            key: key.into(),
            reason: reason.into(),
        }
    }

    pub fn io(path: impl Into<PathBuf>, source: io::Error) -> Error {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// True for errors after which a sender should reconnect rather than give up.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Error::Connect { .. } | Error::Disconnected { .. } | Error::Handshake { .. }
        )
    }
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Spawns a named thread, reporting failure as [`Error::Thread`].
pub fn spawn<T: Send + 'static>(
    name: impl Into<String>,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<std::thread::JoinHandle<T>> {
    let name = name.into();
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(f)
        .map_err(|source| Error::Thread { name, source })
}
