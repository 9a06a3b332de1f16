//! The threads around the protocol core: the sender's filling and sending threads, and the
//! receiver's polling threads, and the [`Driver`] loop the sending thread shares with the
//! benchmarks and the simulator.

pub mod driver;
pub mod receiver;
pub mod sender;

pub use driver::{Driver, Turn};
pub use receiver::{FrameSink, ReceiverHandle, ReceiverOptions, StreamKey};
pub use sender::{DeviceInput, DropPolicy, SenderHandle, SenderOptions, SenderReport};

/// One frame from a source.
#[derive(Debug, Clone)]
pub struct SourceFrame {
    /// Per-device frame index, from 0 (the reference patterns' `f`).
    pub index: u64,
    /// Capture time, ns since the UNIX epoch.
    pub timestamp_ns: u64,
    /// Frame duration in ns (0 when unknown).
    pub duration_ns: u32,
    /// Presentation timestamp in ns (e.g. a GStreamer PTS), carried to the receiver.
    pub pts_ns: Option<u64>,
    /// Format descriptor (caps string) of this frame.
    pub format: std::sync::Arc<str>,
    /// The frame's bytes (cheaply clonable: a source may hand out the same buffer again).
    pub data: bytes::Bytes,
}
