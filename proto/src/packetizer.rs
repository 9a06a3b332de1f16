//! Per-device numbering for the filling thread: packet numbers (per block, wrapping at 65536),
//! frame indices, and the split of a message into fragments that fit a memory block.

use super::header::{BlockHeader, flags, payload_capacity};

/// What the filling thread is about to put into send blocks for one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageKind {
    /// A frame: consumes a frame index.
    Frame,
    /// A format descriptor (caps string) that applies to the frames after it.
    Format,
    /// End of the device's stream.
    EndOfStream,
}

/// Times a message carries in every one of its block headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageTimes {
    /// Capture time, ns since the UNIX epoch (0 when unknown).
    pub timestamp_ns: u64,
    /// Frame duration in ns (0 when unknown).
    pub duration_ns: u32,
    /// Presentation timestamp in ns, or [`super::header::NO_PTS`].
    pub pts_ns: u64,
}

impl MessageTimes {
    /// Only a capture time.
    pub fn at(timestamp_ns: u64) -> MessageTimes {
        MessageTimes {
            timestamp_ns,
            duration_ns: 0,
            pts_ns: super::header::NO_PTS,
        }
    }
}

/// Numbering state of one device on the sender. Survives reconnects: numbering carries on.
#[derive(Debug, Clone, Default)]
pub struct DeviceNumbering {
    next_packet: u16,
    next_frame: u64,
    started: bool,
    /// Blocks of this device carry the RELIABLE flag (a `block` device).
    reliable: bool,
}

impl DeviceNumbering {
    /// Starts at packet `packet` and frame `frame` (both 0 for a new stream).
    pub fn starting_at(packet: u16, frame: u64) -> Self {
        DeviceNumbering {
            next_packet: packet,
            next_frame: frame,
            started: false,
            reliable: false,
        }
    }

    /// Marks the device lossless (or not): its blocks carry the RELIABLE flag from now on.
    pub fn set_reliable(&mut self, reliable: bool) {
        self.reliable = reliable;
    }

    /// Next packet number to be used.
    pub fn next_packet(&self) -> u16 {
        self.next_packet
    }

    /// Next frame index to be used.
    pub fn next_frame(&self) -> u64 {
        self.next_frame
    }

    /// Headers for one message of `len` payload bytes split over blocks of `block_size`, in
    /// order. The payload of fragment k is `payload[k*cap .. min(len, (k+1)*cap)]` where
    /// `cap = payload_capacity(block_size)`. Returns `None` if the message needs more than
    /// 65535 blocks (the fragment count is 16 bits) or the block cannot hold any payload.
    /// `frame_index` overrides the frame index (a source numbers its frames itself, so frames it
    /// dropped leave a visible gap); `None` uses the next one.
    pub fn plan(
        &mut self,
        device: u8,
        kind: MessageKind,
        frame_index: Option<u64>,
        len: usize,
        block_size: usize,
        times: MessageTimes,
    ) -> Option<Vec<BlockHeader>> {
        let cap = payload_capacity(block_size);
        if cap == 0 || len > u32::MAX as usize {
            return None;
        }
        let count = len.div_ceil(cap).max(1);
        if count > u16::MAX as usize {
            return None;
        }
        let flag_bits = match kind {
            MessageKind::Frame => 0,
            MessageKind::Format => flags::FORMAT,
            MessageKind::EndOfStream => flags::END_OF_STREAM,
        } | if self.reliable { flags::RELIABLE } else { 0 };
        if let Some(index) = frame_index {
            self.next_frame = index;
        }
        let headers = (0..count)
            .map(|k| {
                let start = k * cap;
                let payload_len = (len - start).min(cap);
                let start = if self.started { 0 } else { flags::STREAM_START };
                self.started = true;
                let h = BlockHeader {
                    device,
                    packet: self.next_packet,
                    flags: flag_bits | start,
                    fragment_index: k as u16,
                    fragment_count: count as u16,
                    payload_len: payload_len as u32,
                    frame_index: self.next_frame,
                    timestamp_ns: times.timestamp_ns,
                    message_len: len as u32,
                    duration_ns: times.duration_ns,
                    pts_ns: times.pts_ns,
                };
                self.next_packet = self.next_packet.wrapping_add(1);
                h
            })
            .collect();
        if kind == MessageKind::Frame {
            self.next_frame += 1;
        }
        Some(headers)
    }
}

/// Byte range of fragment `k` of a message of `len` bytes in blocks of `block_size`.
pub fn fragment_range(k: usize, len: usize, block_size: usize) -> std::ops::Range<usize> {
    let cap = payload_capacity(block_size);
    let start = (k * cap).min(len);
    start..(start + cap).min(len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::header::OVERHEAD;
    use crate::packetizer::MessageTimes;

    #[test]
    fn splits_and_numbers() {
        let mut n = DeviceNumbering::starting_at(65534, 0);
        let hs = n
            .plan(
                3,
                MessageKind::Frame,
                None,
                250,
                100 + OVERHEAD,
                MessageTimes::at(5),
            )
            .unwrap();
        assert_eq!(hs.len(), 3);
        assert_eq!(
            hs.iter().map(|h| h.packet).collect::<Vec<_>>(),
            vec![65534, 65535, 0]
        );
        assert_eq!(
            hs.iter().map(|h| h.payload_len).collect::<Vec<_>>(),
            vec![100, 100, 50]
        );
        assert!(
            hs.iter()
                .all(|h| h.frame_index == 0 && h.fragment_count == 3)
        );
        assert_eq!(fragment_range(2, 250, 100 + OVERHEAD), 200..250);
        assert_eq!(n.next_frame(), 1);
        let eos = n
            .plan(
                3,
                MessageKind::EndOfStream,
                None,
                0,
                100 + OVERHEAD,
                MessageTimes::at(0),
            )
            .unwrap();
        assert_eq!(eos.len(), 1);
        assert!(eos[0].is_end_of_stream());
        assert_eq!(eos[0].frame_index, 1);
        assert_eq!(n.next_frame(), 1);
        assert_eq!(n.next_packet(), 2);
    }

    #[test]
    fn refuses_what_cannot_be_numbered() {
        let mut n = DeviceNumbering::default();
        assert!(
            n.plan(
                0,
                MessageKind::Frame,
                None,
                10,
                OVERHEAD,
                MessageTimes::at(0)
            )
            .is_none()
        );
        assert!(
            n.plan(
                0,
                MessageKind::Frame,
                None,
                70_000,
                OVERHEAD + 1,
                MessageTimes::at(0)
            )
            .is_none()
        );
    }
}
