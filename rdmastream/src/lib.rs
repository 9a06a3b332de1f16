//! rdmastream core: the status-byte-assisted RDMA mechanism (paper section 3) as an IO-free
//! protocol core ([`proto`]), the transports that carry it ([`transport`]), the threads that
//! drive it ([`engine`]), and the sources and sinks of frames ([`source`], [`sink`]).
//!
//! It deliberately does not define the config files or own a command line: the `sender` and
//! `receiver` binaries do that and wire these pieces together ([`app`] holds the few helpers they
//! share: TOML loading with file/key errors, logging, the status-line clock). The transports are
//! `mem` (in-process), `tcp` (software emulation of the one-sided operations) and `verbs` (real
//! RDMA through rdma-core; the only `unsafe` code, in `transport::verbs`).
#![deny(unsafe_code)]

pub mod error;
pub mod logsafe;
/// The IO-free protocol core (the `rdmastream-proto` crate).
pub use rdmastream_proto as proto;
pub mod transport;

/// Re-exported: frames are [`bytes::Bytes`].
pub use bytes;
pub use error::{Error, Result};
pub mod app;
pub mod config;
pub mod engine;
pub mod sim;
pub mod sink;
pub mod source;
pub mod stats;
