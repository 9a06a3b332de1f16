//! rdmastream engine: the threads that drive the IO-free protocol core ([`proto`], re-exported
//! from `rdmastream-proto`) over a transport: the filling and sending threads of a sender and
//! the polling threads of a receiver ([`engine`]), the transport traits with the `mem` and `tcp`
//! transports ([`transport`]), per-device counters ([`stats`]) and the deterministic simulator
//! ([`sim`]).
//!
//! What it does not do: no config files, command lines, image files or output directories (the
//! `rdmastream-app` crate: sources, sinks, config, GStreamer app sources and sinks), no RDMA
//! verbs (the `rdmastream-verbs` crate implements the same [`transport`] traits and holds all of
//! the project's `unsafe` code; this crate forbids it). Frames come in through
//! [`engine::DeviceInput`] and go out through an [`engine::FrameSink`].
#![forbid(unsafe_code)]

pub mod error;
pub mod logsafe;
/// The IO-free protocol core (the `rdmastream-proto` crate).
pub use rdmastream_proto as proto;
pub mod transport;

/// Re-exported: frames are [`bytes::Bytes`].
pub use bytes;
pub use error::{Error, Result};
pub mod engine;
pub mod sim;
pub mod stats;
