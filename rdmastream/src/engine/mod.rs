//! The threads around the protocol core: the sender's filling and sending threads, and the
//! receiver's polling threads, and the [`Driver`] loop the sending thread shares with the
//! benchmarks and the simulator.

pub mod driver;
pub mod receiver;
pub mod sender;

pub use driver::{Driver, Turn};
pub use receiver::{FrameSink, ReceiverHandle, ReceiverOptions, StreamKey};
pub use sender::{
    DeviceInput, DropPolicy, IDLE_BEFORE_POSTING_HERE, NotReserved, Reservation, SenderHandle,
    SenderOptions, SenderReport,
};

use std::sync::Arc;

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
    /// The frame's bytes, or how to render them straight into the send blocks.
    pub data: FrameData,
}

/// What a frame carries besides its bytes: for a frame written in place into a reserved send
/// block ([`Reservation::commit`]).
#[derive(Debug, Clone)]
pub struct FrameMeta {
    /// Per-device frame index, from 0.
    pub index: u64,
    /// Capture time, ns since the UNIX epoch.
    pub timestamp_ns: u64,
    /// Frame duration in ns (0 when unknown).
    pub duration_ns: u32,
    /// Presentation timestamp in ns, carried to the receiver.
    pub pts_ns: Option<u64>,
    /// Format descriptor (caps string) of this frame.
    pub format: Arc<str>,
}

/// A frame's contents as a source hands them over.
#[derive(Clone)]
pub enum FrameData {
    /// Bytes the source already holds (cheaply clonable: a source may hand out the same buffer
    /// again). The filling thread copies them into the send blocks.
    Bytes(bytes::Bytes),
    /// Rendered by the filling thread straight into the send blocks' payload areas: the frame is
    /// written once, into memory the transport sends from, and never exists anywhere else.
    Render(Arc<dyn FrameWriter>),
}

impl FrameData {
    /// The frame's length in bytes.
    pub fn len(&self) -> usize {
        match self {
            FrameData::Bytes(b) => b.len(),
            FrameData::Render(w) => w.len(),
        }
    }

    /// True for an empty frame.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes bytes `offset..offset + dst.len()` of the frame into `dst`.
    pub fn write(&self, offset: usize, dst: &mut [u8]) {
        match self {
            FrameData::Bytes(b) => dst.copy_from_slice(&b[offset..offset + dst.len()]),
            FrameData::Render(w) => w.write(offset, dst),
        }
    }

    /// The frame's bytes in a buffer of their own (renders a [`FrameData::Render`] frame; for
    /// tests and tools, not the sending path).
    pub fn to_bytes(&self) -> bytes::Bytes {
        match self {
            FrameData::Bytes(b) => b.clone(),
            FrameData::Render(w) => {
                let mut v = vec![0; w.len()];
                w.write(0, &mut v);
                v.into()
            }
        }
    }
}

impl std::fmt::Debug for FrameData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameData::Bytes(b) => write!(f, "Bytes({} bytes)", b.len()),
            FrameData::Render(w) => write!(f, "Render({} bytes)", w.len()),
        }
    }
}

impl From<bytes::Bytes> for FrameData {
    fn from(b: bytes::Bytes) -> Self {
        FrameData::Bytes(b)
    }
}

impl From<Vec<u8>> for FrameData {
    fn from(v: Vec<u8>) -> Self {
        FrameData::Bytes(v.into())
    }
}

impl From<&'static [u8]> for FrameData {
    fn from(v: &'static [u8]) -> Self {
        FrameData::Bytes(bytes::Bytes::from_static(v))
    }
}

/// A frame a source renders in place: the filling thread hands it each send block's payload
/// area in turn. A frame that fits in one block is rendered in one call, straight after the
/// block's header, then sealed; a frame spanning several blocks is rendered fragment by
/// fragment (one call per block, in order, offsets ascending, every byte exactly once), so it is
/// still written once and never copied. A source that can only produce the whole frame at once
/// should hand over [`FrameData::Bytes`] instead (one copy into the blocks).
///
/// `write` runs on the sender's filling thread: keep it to producing bytes (no blocking, no
/// locks shared with the source's pacing). A frame dropped from a full queue is never rendered.
pub trait FrameWriter: Send + Sync {
    /// The frame's length in bytes (fixed: the blocks are planned from it before `write`).
    fn len(&self) -> usize;

    /// True for an empty frame.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes bytes `offset..offset + dst.len()` of the frame into `dst`, setting every byte
    /// (`dst` holds whatever the block carried before).
    fn write(&self, offset: usize, dst: &mut [u8]);
}
