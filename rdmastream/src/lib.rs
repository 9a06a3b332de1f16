//! rdmastream core: the status-byte-assisted RDMA mechanism (paper section 3) as an IO-free
//! protocol core ([`proto`]), the transports that carry it ([`transport`]), the threads that
//! drive it ([`engine`]), and the sources and sinks of frames ([`source`], [`sink`]).
//!
//! It deliberately does not parse config files or own a command line: the `sender` and
//! `receiver` binaries (and the GStreamer plugin) do that and wire these pieces together.
#![deny(unsafe_code)]

pub mod error;
pub mod proto;
pub mod transport;

/// Re-exported: frames are [`bytes::Bytes`].
pub use bytes;
pub use error::{Error, Result};
pub mod app;
pub mod engine;
pub mod sim;
pub mod sink;
pub mod source;
pub mod stats;
