//! rdmastream's application layer: what turns the engine into the `sender` and `receiver`
//! binaries and feeds the GStreamer elements.
//!
//! - [`source`]: frame sources (synthetic cameras and radars with checkable reference
//!   patterns, image files looped at a rate), each on its own thread.
//! - [`sink`]: the receiver's per-device output directories (atomic files, `keep`,
//!   `disk_budget`, the durable-frame ledger of lossless devices).
//! - [`config`]: sender.toml and receiver.toml as serde structs, their defaults and validation.
//! - [`cli`]: what the binaries share: config loading with file/key errors, keys, logging, the
//!   status-line clock, error lines.
//! - [`gst`] (feature `gstreamer`): GStreamer pipelines as sources and sinks of the binaries.
//! - [`run`]: what a binary does between a valid config and its exit code.
//! - [`monitor`], [`metrics`], [`http`], [`thumbs`], [`watch`]: what a running binary tells
//!   about itself: the short status line and the per-device table, Prometheus metrics, health
//!   and readiness, and the receiver's live status page with thumbnails (`--metrics ADDR`).
//! - [`Error`]: this crate's one error type.
//!
//! What it does not do: no protocol decisions (`rdmastream-proto`), no threads that move blocks
//! (`rdmastream`), no RDMA (`rdmastream-verbs`), no GStreamer elements (`gst-plugin-rdma`).
#![forbid(unsafe_code)]

pub mod cli;
pub mod config;
pub mod error;
#[cfg(feature = "gstreamer")]
pub mod gst;
pub mod http;
pub mod metrics;
pub mod monitor;
pub mod run;
pub mod sink;
pub mod source;
pub mod thumbs;
pub mod watch;

pub use error::Error;
