//! `rdmasrc`: a live source receiving one device of an `rdmasink` (or of the rdmastream
//! `sender`) over one-sided RDMA with the status-byte-assisted mechanism, its TCP emulation, or
//! shared memory on one host.
//!
//! The receiver never posts a work request: it polls the status bytes of its memory blocks,
//! validates each block, reorders per device and reassembles frames. Each frame becomes one
//! buffer that wraps the receiver's memory block itself when it can (zero copy: the block stays
//! RETAINED, status 2, until the buffer is freed; the sender skips it meanwhile).
//!
//! Caps travel with the stream: the element sets the caps the sender sent, and changes them
//! when the sender's change, so no capsfilter is needed. It pushes EOS when the sender ends the
//! device's stream, answers latency queries (one frame duration plus `latency`), and keeps the
//! sender's timestamps (`timestamp-mode=sender`, mapped once so the first buffer lands at its
//! arrival; a backlog keeps its spacing, and the mapping only ever moves forward, so PTS never go
//! back) or stamps buffers on arrival (`timestamp-mode=arrival`).
//!
//! All `rdmasrc` elements of a process with the same `address`, `port` and `transport` share
//! one listener: each sender that connects gets one region, and each element receives the
//! frames of its `device-id` (from `sender-name`, or from whichever sender streams it).
//!
//! ## Example
//!
//! ```sh
//! gst-launch-1.0 rdmasrc port=7471 device-id=3 ! videoconvert ! autovideosink &
//! gst-launch-1.0 videotestsrc is-live=true ! \
//!     video/x-raw,format=RGB,width=640,height=480,framerate=25/1 ! \
//!     rdmasink host=127.0.0.1 port=7471 device-id=3
//! ```
//!
//! ## A sender that goes away
//!
//! With `wait-for-sender=true` (default) a sender whose connection is lost before it ended the
//! stream is waited for (a warning message is posted); when it reconnects the stream goes on.
//! With `wait-for-sender=false` the element posts an error naming the sender and its address.
//!
//! ## A sender that is refused
//!
//! A connection the shared listener turns away (wrong or missing `key`, wrong transport, a sender
//! whose `block-size` is larger than this listener's, a malformed handshake) is a warning message on every `rdmasrc` of that listener, naming the peer's address
//! and the reason. It is not an error: the other senders keep streaming. A second sender of the
//! element's `device-id` (without `sender-name`) is a warning too, naming both senders: the
//! element follows the first.
//!
//! ## Messages and URIs
//!
//! `timeout` (ns, 0 = off) posts a `GstRdmaSrcTimeout` element message each time nothing arrived
//! for that long, as udpsrc does. Frames dropped under `drop-policy=drop-oldest` post QoS
//! messages; the `stats` structure is posted as an element message every `stats-interval` ms,
//! and with `metrics=ADDR` served as Prometheus metrics on `http://ADDR/metrics` (as `rdmasink`).
//! The element handles `rdma://ADDRESS:PORT?device-id=N&...` URIs (every query parameter is a
//! property), and `rdma+unix:///PATH?device-id=N` to listen on a Unix socket (the `shm`
//! transport), so `playbin` and `uridecodebin` can use it.

use gst::glib;
use gst::prelude::*;

mod imp;

glib::wrapper! {
    pub struct RdmaSrc(ObjectSubclass<imp::RdmaSrc>) @extends gst_base::PushSrc, gst_base::BaseSrc, gst::Element, gst::Object,
        @implements gst::URIHandler;
}

/// How buffers are timestamped.
#[derive(Debug, Default, Eq, PartialEq, Hash, Clone, Copy, glib::Enum)]
#[repr(u32)]
#[enum_type(name = "GstRdmaTimestampMode")]
pub enum TimestampMode {
    /// The sender's PTS (running time), shifted by one constant so the first buffer lands at
    /// its arrival running time: the sender's spacing and durations are kept exactly.
    #[default]
    #[enum_value(
        name = "Sender: keep the sender's timestamps (shifted once to this pipeline's running time)",
        nick = "sender"
    )]
    Sender = 0,
    /// The running time at which each frame arrived.
    #[enum_value(
        name = "Arrival: running time at which each frame arrived",
        nick = "arrival"
    )]
    Arrival = 1,
}

pub fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    gst::Element::register(
        Some(plugin),
        "rdmasrc",
        gst::Rank::NONE,
        RdmaSrc::static_type(),
    )
}
