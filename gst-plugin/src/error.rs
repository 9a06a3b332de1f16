//! The one error type of the plugin crate: what can stop an element from starting. Elements
//! post it (its text) as the GStreamer error message.

/// Why an element cannot start streaming.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Choosing or opening the transport, or starting the core sender or receiver, failed.
    #[error("{what}: {source}")]
    Transport {
        what: String,
        #[source]
        source: rdmastream::Error,
    },
    /// `key` and `key-file` are both set, or the key is unusable.
    #[error("{0}")]
    Key(String),
    /// Another `rdmasink` of this process already streams the device on that connection.
    #[error(
        "device-id {device} is already streamed by {by} on the connection to {peer} as '{name}'"
    )]
    DeviceTaken {
        device: u8,
        by: String,
        peer: String,
        name: String,
    },
    /// An element would share a connection or listener that another element of this process
    /// opened with a different key: one connection (one listener) has one key, so the second
    /// element's key would be silently ignored.
    #[error(
        "{element} has a different key than {first}, which opened {shared}: elements sharing it \
         must use the same key ({hint})"
    )]
    KeyMismatch {
        element: String,
        first: String,
        /// "the connection to PEER as 'NAME'" or "the listener on ADDR".
        shared: String,
        /// How to avoid sharing.
        hint: &'static str,
    },
    /// Another `rdmasrc` of this process already receives that (sender, device).
    #[error("{what} is already received by {by} on {addr}")]
    RouteTaken {
        what: String,
        by: String,
        addr: String,
    },
}
