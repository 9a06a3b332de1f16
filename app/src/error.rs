//! The one error type of the application crate.

use crate::cli::ConfigError;

/// What can go wrong running a binary, beyond the engine's own errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Bad input: a config file, a flag, a source that cannot be built. Binaries exit 2.
    #[error("bad config: {0}")]
    Config(#[from] ConfigError),
    /// The engine failed (connecting, a transport, a thread).
    #[error(transparent)]
    Engine(#[from] rdmastream::Error),
    /// A file, directory or thread operation failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// Stopping, frames could not be delivered within the grace period.
    #[error(
        "{frames} frames ({blocks} blocks) were not delivered to receiver {receiver} within the \
         {grace:.0} s shutdown grace period (is it unreachable?)"
    )]
    Undelivered {
        frames: u64,
        blocks: u64,
        receiver: String,
        grace: f64,
    },
}
