//! rdmastream engine: the threads that drive the IO-free protocol core ([`proto`], re-exported
//! from `rdmastream-proto`) over a transport ([`engine`], [`transport`]), and the sources and
//! sinks of frames ([`source`], [`sink`]).
//!
//! It deliberately does not define the config files or own a command line: the `sender` and
//! `receiver` binaries do that and wire these pieces together ([`app`] holds the few helpers they
//! share: TOML loading with file/key errors, logging, the status-line clock). The transports here
//! are `mem` (in-process) and `tcp` (software emulation of the one-sided operations); real RDMA
//! verbs are the `rdmastream-verbs` crate, which implements the same [`transport`] traits and
//! holds all of the project's `unsafe` code (this crate forbids it).
#![forbid(unsafe_code)]

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
