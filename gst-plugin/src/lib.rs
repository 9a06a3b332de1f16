//! GStreamer plugin `rdma`: `rdmasink` and `rdmasrc` stream buffers with the status-byte-assisted
//! one-sided RDMA mechanism of the rdmastream core (or its TCP emulation on machines without an
//! RDMA NIC).
//!
//! - `rdmasink` (a `BaseSink`) hands every buffer to the core's sender: its filling thread copies
//!   it into send blocks, its sending thread writes them into the receiver's memory blocks. All
//!   `rdmasink` elements of a process aimed at the same receiver (same host, port, transport and
//!   sender name) share **one connection and one queue pair**, each with its own device-id.
//! - `rdmasrc` (a live `PushSrc`) receives the frames of one device. All `rdmasrc` elements of a
//!   process bound to the same address share one listener; a router hands each element the
//!   frames of its (sender, device). Caps travel with the stream, so no capsfilter is needed.
//!
//! It deliberately does not implement a transport: the core's transports do that; this crate only
//! maps the `transport` property onto them ([`transport`]).

use gst::glib;

pub use error::Error;

pub mod error;
mod link;
mod logging;
mod metrics;
mod props;
mod rdmasink;
mod rdmasrc;
mod report;
mod route;
pub mod transport;
pub mod uri;

fn plugin_init(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    logging::init();
    rdmasink::register(plugin)?;
    rdmasrc::register(plugin)?;
    Ok(())
}

gst::plugin_define!(
    rdma,
    env!("CARGO_PKG_DESCRIPTION"),
    plugin_init,
    concat!(env!("CARGO_PKG_VERSION"), "-", env!("COMMIT_ID")),
    // The crate is MIT OR Apache-2.0; GStreamer's name for the MIT choice:
    "MIT/X11",
    env!("CARGO_PKG_NAME"),
    env!("CARGO_PKG_NAME"),
    env!("CARGO_PKG_REPOSITORY"),
    env!("BUILD_REL_DATE")
);
