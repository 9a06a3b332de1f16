//! The one error type of this crate: a variant per failed operation, naming the peer, file or
//! setting at fault.

use std::io;
use std::path::PathBuf;

/// Everything that can fail in rdmastream.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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
    /// Creating, sealing, passing or mapping the shared memory of the shm transport failed.
    #[error("shared memory with {peer}: {op}: {source}")]
    SharedMemory {
        peer: String,
        op: String,
        source: io::Error,
    },
    /// A thread of the engine panicked (a bug); `message` is the panic's text when it had one.
    #[error("the {thread} thread panicked: {message}")]
    Panicked { thread: String, message: String },
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

    /// True for errors after which a sender should try to connect again (with backoff) rather
    /// than give up: everything a connection attempt can fail with except a refusal and an
    /// authentication failure, which retrying cannot change.
    pub fn is_transient(&self) -> bool {
        !matches!(self, Error::Refused { .. } | Error::Auth { .. })
    }

    /// The error for a thread that panicked, from what `JoinHandle::join` returned.
    pub fn panicked(thread: &str, payload: Box<dyn std::any::Any + Send>) -> Error {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".into());
        Error::Panicked {
            thread: thread.into(),
            message,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicked_thread_is_reported_as_a_panic_with_its_message() {
        let payload = std::thread::spawn(|| panic!("block {} out of range", 7))
            .join()
            .unwrap_err();
        let e = Error::panicked("sending", payload);
        assert_eq!(
            e.to_string(),
            "the sending thread panicked: block 7 out of range"
        );
    }

    #[test]
    fn only_refusals_and_authentication_failures_end_the_retries() {
        let refused = Error::Refused {
            peer: "r".into(),
            reason: "busy".into(),
        };
        let auth = Error::Auth {
            peer: "r".into(),
            reason: "wrong key".into(),
        };
        let lost = Error::Disconnected {
            peer: "r".into(),
            reason: "reset".into(),
        };
        assert!(!refused.is_transient() && !auth.is_transient());
        assert!(lost.is_transient());
    }
}
