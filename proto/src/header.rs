//! Block header and trailer (the "seal"): the bytes at the start and right after the payload of
//! every memory block. The layout is specified in docs/protocol.md; keep the two in step.
//!
//! All integers are little-endian. A block is `HEADER_LEN` bytes of header, `payload_len` bytes of
//! payload and `TRAILER_LEN` bytes of trailer; the rest of the memory block is unused.

/// Version of the block layout written into every header.
pub const BLOCK_VERSION: u8 = 1;
/// Bytes of header at the start of every memory block.
pub const HEADER_LEN: usize = 48;
/// Bytes of trailer right after the payload.
pub const TRAILER_LEN: usize = 12;
/// Header + trailer: what a block costs besides its payload.
pub const OVERHEAD: usize = HEADER_LEN + TRAILER_LEN;
/// Last byte of the trailer; a zeroed or half-written block does not end in it.
const TRAILER_MAGIC: u8 = 0x5A;

/// Status byte of a receiver memory block (paper section 3.2.1).
pub mod status {
    /// The block holds no data; the sender may write it.
    pub const EMPTY: u8 = 0;
    /// The block holds data the receiver has not processed yet.
    pub const FULL: u8 = 1;
    /// The block is unavailable (retained by the receiver); the sender skips it.
    pub const RETAINED: u8 = 2;
}

/// Header flags.
pub mod flags {
    /// The device's stream ends with this message (its payload is empty).
    pub const END_OF_STREAM: u8 = 0x01;
    /// The payload is a format descriptor (see [`crate::Format`]), not frame data.
    pub const FORMAT: u8 = 0x02;
    /// First block of the device's stream: the receiver starts reordering at this packet number.
    pub const STREAM_START: u8 = 0x04;
    /// The device is lossless (`block` policy): the receiver frees the message's last block only
    /// once the message is durably handed on, and the sender keeps the message until then.
    pub const RELIABLE: u8 = 0x08;
    /// The trailer's CRC32C covers the 48-byte header only, not the payload (the trailer still
    /// repeats length, packet and device and ends in the magic). A sender sets it only where its
    /// transport places a block's bytes whole and in order before the status byte
    /// ([`super::Placement::Ordered`]: tcp, shm); a receiver on a transport that does not
    /// guarantee that (verbs) rejects such a block ([`super::BlockError::WeakSeal`]). A property
    /// of the block, not of the message: see docs/protocol.md, "Seal by transport".
    pub const HEADER_SEAL: u8 = 0x10;
    /// All flags this version knows; a header with any other bit set is rejected.
    pub const KNOWN: u8 = END_OF_STREAM | FORMAT | STREAM_START | RELIABLE | HEADER_SEAL;
}

/// What a transport guarantees about a memory block's bytes once its status byte reads FULL,
/// and with it which seals are worth computing (sender) and accepted (receiver).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// The bytes of the data WRITE may be placed in any order, and a torn or half-placed block
    /// can be seen (RDMA verbs: the spec promises visibility only at completion). Only blocks
    /// sealed over header and payload are accepted.
    Unordered,
    /// The whole block is placed, in order, before the status byte that says FULL (tcp: the
    /// receiver's transport thread applies each WRITE whole and in stream order; shm and mem:
    /// the bytes are copied, then the status byte is stored with release ordering). Blocks sealed
    /// over the header only ([`flags::HEADER_SEAL`]) are accepted too, and a sender seals so.
    Ordered,
}

/// Decoded block header. One frame (or format descriptor, or end of stream) is a message of
/// `fragment_count` blocks with consecutive packet numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    /// Device number (paper: 1 byte).
    pub device: u8,
    /// Packet number, per device, counting blocks and wrapping at 65536 (paper: 2 bytes).
    pub packet: u16,
    /// [`flags`] bits.
    pub flags: u8,
    /// Index of this block within its message, from 0.
    pub fragment_index: u16,
    /// Number of blocks in the message (at least 1).
    pub fragment_count: u16,
    /// Payload bytes in this block.
    pub payload_len: u32,
    /// Per-device frame index (from 0); for a format or end-of-stream message, the index the
    /// next frame will have.
    pub frame_index: u64,
    /// Capture time, nanoseconds since the UNIX epoch (0 when unknown).
    pub timestamp_ns: u64,
    /// Payload bytes of the whole message, over all fragments.
    pub message_len: u32,
    /// Duration of the frame in nanoseconds (0 when unknown).
    pub duration_ns: u32,
    /// Presentation timestamp in nanoseconds (the GStreamer PTS), or [`NO_PTS`].
    pub pts_ns: u64,
}

/// `pts_ns` of a frame without a presentation timestamp.
pub const NO_PTS: u64 = u64::MAX;

/// Why a block was rejected. Each kind is counted separately by the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BlockError {
    /// The block is shorter than a header.
    TooShort,
    /// The header carries a layout version this build does not speak.
    BadVersion,
    /// The header length field is not `HEADER_LEN`.
    BadHeaderLen,
    /// Unknown flag bits.
    BadFlags,
    /// Payload length does not fit in the block.
    LengthOverBlock,
    /// Fragment index/count inconsistent, or payload bigger than the message.
    BadFragment,
    /// Device number not accepted by the receiver.
    DeviceOutOfRange,
    /// Trailer does not repeat the header or its CRC32C does not match: a torn or stale block.
    BadSeal,
    /// Sealed over the header only ([`flags::HEADER_SEAL`]) on a connection whose transport does
    /// not place blocks whole and in order (verbs): its payload is not checked, so it is refused.
    WeakSeal,
    /// A coalesced block (layout version 2) whose messages do not add up: count, lengths, a
    /// device's packets out of order, or a header that does not name its first message.
    BadCoalesced,
    /// Valid, but its payload had to be copied and the receiver's memory budget had no room.
    OverBudget,
}

impl BlockError {
    /// Short stable name, used in logs and stats.
    pub fn name(self) -> &'static str {
        match self {
            BlockError::TooShort => "too-short",
            BlockError::BadVersion => "bad-version",
            BlockError::BadHeaderLen => "bad-header-len",
            BlockError::BadFlags => "bad-flags",
            BlockError::LengthOverBlock => "length-over-block",
            BlockError::BadFragment => "bad-fragment",
            BlockError::DeviceOutOfRange => "device-out-of-range",
            BlockError::BadSeal => "bad-seal",
            BlockError::WeakSeal => "weak-seal",
            BlockError::BadCoalesced => "bad-coalesced",
            BlockError::OverBudget => "over-memory-budget",
        }
    }
}

impl std::fmt::Display for BlockError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Largest payload a memory block of `block_size` bytes can carry.
pub fn payload_capacity(block_size: usize) -> usize {
    block_size.saturating_sub(OVERHEAD)
}

impl BlockHeader {
    /// The header of frame 0 of `device` whose `len` payload bytes fit one block: no flags, no
    /// times, no PTS (for tests and benchmarks; the filling thread sets every field itself).
    pub fn single(device: u8, len: usize) -> BlockHeader {
        BlockHeader {
            device,
            packet: 0,
            flags: 0,
            fragment_index: 0,
            fragment_count: 1,
            payload_len: len as u32,
            frame_index: 0,
            timestamp_ns: 0,
            message_len: len as u32,
            duration_ns: 0,
            pts_ns: NO_PTS,
        }
    }

    /// Writes header, `payload` and trailer into `block` and returns the number of bytes used
    /// (what the sending thread must WRITE). Panics if the block is too small: the filling
    /// thread sizes fragments with [`payload_capacity`], so that is a bug, not bad input.
    pub fn encode_block(&self, payload: &[u8], block: &mut [u8]) -> usize {
        let used = self.write_header_and_payload(payload, block);
        self.seal(block);
        used
    }

    /// Writes the header and copies `payload` after it, without the trailer; [`Self::seal`]
    /// must follow. Split so a caller can produce the payload in place.
    pub fn write_header_and_payload(&self, payload: &[u8], block: &mut [u8]) -> usize {
        assert_eq!(
            payload.len(),
            self.payload_len as usize,
            "payload_len mismatch"
        );
        self.write_header_with(block, |dst| dst.copy_from_slice(payload))
    }

    /// Writes the header and hands `write` the payload area (exactly `payload_len` bytes, right
    /// after the header) to produce the payload in place — a source rendering a frame straight
    /// into the block it is sent from, with no copy. `write` must set every byte of the area
    /// (it holds whatever the block carried before). Returns the bytes used, like
    /// [`Self::write_header_and_payload`]; [`Self::seal`] must follow.
    pub fn write_header_with(&self, block: &mut [u8], write: impl FnOnce(&mut [u8])) -> usize {
        let len = self.payload_len as usize;
        let used = OVERHEAD + len;
        assert!(used <= block.len(), "block too small for payload");
        self.write_header(&mut block[..HEADER_LEN]);
        write(&mut block[HEADER_LEN..HEADER_LEN + len]);
        used
    }

    fn write_header(&self, h: &mut [u8]) {
        h[0] = self.device;
        h[1..3].copy_from_slice(&self.packet.to_le_bytes());
        h[3] = BLOCK_VERSION;
        h[4] = self.flags;
        h[5] = 0;
        h[6..8].copy_from_slice(&self.fragment_index.to_le_bytes());
        h[8..10].copy_from_slice(&self.fragment_count.to_le_bytes());
        h[10..12].copy_from_slice(&(HEADER_LEN as u16).to_le_bytes());
        h[12..16].copy_from_slice(&self.payload_len.to_le_bytes());
        h[16..24].copy_from_slice(&self.frame_index.to_le_bytes());
        h[24..32].copy_from_slice(&self.timestamp_ns.to_le_bytes());
        h[32..36].copy_from_slice(&self.message_len.to_le_bytes());
        h[36..40].copy_from_slice(&self.duration_ns.to_le_bytes());
        h[40..48].copy_from_slice(&self.pts_ns.to_le_bytes());
    }

    /// Writes the trailer after a header and payload already in `block`. The CRC32C covers
    /// header and payload, or the header alone when the header carries [`flags::HEADER_SEAL`]
    /// (see [`Self::sealed_for`]).
    pub fn seal(&self, block: &mut [u8]) {
        let end = HEADER_LEN + self.payload_len as usize;
        let crc = crc32c::crc32c(&block[..self.crc_end()]);
        let t = &mut block[end..end + TRAILER_LEN];
        t[0..4].copy_from_slice(&self.payload_len.to_le_bytes());
        t[4..6].copy_from_slice(&self.packet.to_le_bytes());
        t[6] = self.device;
        t[7] = TRAILER_MAGIC;
        t[8..12].copy_from_slice(&crc.to_le_bytes());
    }

    /// This header as a sender over a transport with `placement` writes it: with
    /// [`flags::HEADER_SEAL`] where the transport places blocks whole and in order (the payload
    /// then goes unchecksummed), without it elsewhere.
    pub fn sealed_for(mut self, placement: Placement) -> BlockHeader {
        match placement {
            Placement::Ordered => self.flags |= flags::HEADER_SEAL,
            Placement::Unordered => self.flags &= !flags::HEADER_SEAL,
        }
        self
    }

    /// True when the trailer's CRC32C covers the header only.
    pub fn is_header_sealed(&self) -> bool {
        self.flags & flags::HEADER_SEAL != 0
    }

    /// End of the bytes the CRC32C covers.
    fn crc_end(&self) -> usize {
        if self.is_header_sealed() {
            HEADER_LEN
        } else {
            HEADER_LEN + self.payload_len as usize
        }
    }

    /// Decodes and checks a block as a receiver on a transport without ordered placement
    /// (verbs) must: header fields, bounds, and the seal (trailer repeats length, packet and
    /// device; CRC32C over header and payload). A block sealed over its header only is refused
    /// ([`BlockError::WeakSeal`]). Returns the header and the payload slice. `max_device` is the
    /// highest device number the receiver accepts.
    pub fn decode_block(block: &[u8], max_device: u8) -> Result<(BlockHeader, &[u8]), BlockError> {
        Self::decode_block_on(block, max_device, Placement::Unordered)
    }

    /// [`Self::decode_block`] for a receiver whose transport guarantees `placement`: with
    /// [`Placement::Ordered`] a block sealed over its header only is accepted too (its CRC32C
    /// then covers the header, and the trailer still repeats length, packet and device).
    pub fn decode_block_on(
        block: &[u8],
        max_device: u8,
        placement: Placement,
    ) -> Result<(BlockHeader, &[u8]), BlockError> {
        let h = Self::decode_block_copied(
            block,
            &mut |at, into| into.copy_from_slice(&block[at..at + into.len()]),
            max_device,
            placement,
        )?;
        Ok((h, &block[HEADER_LEN..HEADER_LEN + h.payload_len as usize]))
    }

    /// [`Self::decode_block_on`] for a block whose bytes a misbehaving sender may still be
    /// changing (a receiver's memory block over shm or verbs): the header and the trailer are
    /// each taken once, by `copy(at, into)` (which copies the block's bytes `at..at + into.len()`
    /// into `into`, for the transport a copy a peer can no longer change), and every check and
    /// every length handed back is of those copies. `block` itself is read only for its length
    /// and, where the seal covers the payload, for the payload's CRC32C. Returns the header; the
    /// payload is the block's bytes `HEADER_LEN..HEADER_LEN + payload_len`.
    pub fn decode_block_copied(
        block: &[u8],
        copy: &mut dyn FnMut(usize, &mut [u8]),
        max_device: u8,
        placement: Placement,
    ) -> Result<BlockHeader, BlockError> {
        if block.len() < OVERHEAD {
            return Err(BlockError::TooShort);
        }
        let mut head = [0u8; HEADER_LEN];
        copy(0, &mut head);
        let h = Self::decode_header_of(&head, block.len(), max_device)?;
        if h.is_header_sealed() && placement == Placement::Unordered {
            return Err(BlockError::WeakSeal);
        }
        let end = HEADER_LEN + h.payload_len as usize;
        let mut t = [0u8; TRAILER_LEN];
        copy(end, &mut t);
        let mut crc = crc32c::crc32c(&head);
        if !h.is_header_sealed() {
            crc = crc32c::crc32c_append(crc, &block[HEADER_LEN..end]);
        }
        if t[0..4] != h.payload_len.to_le_bytes()
            || t[4..6] != h.packet.to_le_bytes()
            || t[6] != h.device
            || t[7] != TRAILER_MAGIC
            || t[8..12] != crc.to_le_bytes()
        {
            return Err(BlockError::BadSeal);
        }
        Ok(h)
    }

    /// Decodes and range-checks the header only (no seal check).
    pub fn decode_header(block: &[u8], max_device: u8) -> Result<BlockHeader, BlockError> {
        if block.len() < OVERHEAD {
            return Err(BlockError::TooShort);
        }
        let head: &[u8; HEADER_LEN] = block[..HEADER_LEN].try_into().expect("HEADER_LEN bytes");
        Self::decode_header_of(head, block.len(), max_device)
    }

    /// [`Self::decode_header`] of a header copied out of a block of `block_len` bytes.
    pub fn decode_header_of(
        head: &[u8; HEADER_LEN],
        block_len: usize,
        max_device: u8,
    ) -> Result<BlockHeader, BlockError> {
        if block_len < OVERHEAD {
            return Err(BlockError::TooShort);
        }
        let b = head;
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        if b[3] != BLOCK_VERSION {
            return Err(BlockError::BadVersion);
        }
        if u16_at(10) as usize != HEADER_LEN {
            return Err(BlockError::BadHeaderLen);
        }
        let h = BlockHeader {
            device: b[0],
            packet: u16_at(1),
            flags: b[4],
            fragment_index: u16_at(6),
            fragment_count: u16_at(8),
            payload_len: u32_at(12),
            frame_index: u64_at(16),
            timestamp_ns: u64_at(24),
            message_len: u32_at(32),
            duration_ns: u32_at(36),
            pts_ns: u64_at(40),
        };
        if h.flags & !flags::KNOWN != 0 {
            return Err(BlockError::BadFlags);
        }
        if h.payload_len as usize > payload_capacity(block_len) {
            return Err(BlockError::LengthOverBlock);
        }
        if h.fragment_count == 0
            || h.fragment_index >= h.fragment_count
            || h.payload_len > h.message_len
        {
            return Err(BlockError::BadFragment);
        }
        if h.device > max_device {
            return Err(BlockError::DeviceOutOfRange);
        }
        Ok(h)
    }

    /// True for the block that ends a device's stream.
    pub fn is_end_of_stream(&self) -> bool {
        self.flags & flags::END_OF_STREAM != 0
    }

    /// True on the first block a device ever sends.
    pub fn is_stream_start(&self) -> bool {
        self.flags & flags::STREAM_START != 0
    }

    /// True when the payload is a format descriptor.
    pub fn is_format(&self) -> bool {
        self.flags & flags::FORMAT != 0
    }

    /// True for blocks of a lossless device (acknowledged end to end).
    pub fn is_reliable(&self) -> bool {
        self.flags & flags::RELIABLE != 0
    }

    /// True for the last block of its message (where a lossless message's ack is held).
    pub fn is_last_fragment(&self) -> bool {
        self.fragment_index + 1 == self.fragment_count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> BlockHeader {
        BlockHeader {
            device: 7,
            packet: 65535,
            flags: 0,
            fragment_index: 1,
            fragment_count: 3,
            payload_len: 5,
            frame_index: 1 << 40,
            timestamp_ns: 1_700_000_000_123_456_789,
            message_len: 15,
            duration_ns: 40_000_000,
            pts_ns: 123_456,
        }
    }

    #[test]
    fn round_trip() {
        let h = sample();
        let mut block = vec![0xEE; 128];
        let used = h.encode_block(b"hello", &mut block);
        assert_eq!(used, OVERHEAD + 5);
        let (d, p) = BlockHeader::decode_block(&block, 255).unwrap();
        assert_eq!(d, h);
        assert_eq!(p, b"hello");
    }

    #[test]
    fn a_payload_written_in_place_makes_the_same_block_as_a_copied_one() {
        let h = sample();
        let mut copied = vec![0xEE; 128];
        let used = h.write_header_and_payload(b"hello", &mut copied);
        h.seal(&mut copied);
        let mut in_place = vec![0x11; 128];
        let mut area_len = 0;
        let used2 = h.write_header_with(&mut in_place, |dst| {
            area_len = dst.len();
            dst.copy_from_slice(b"hello");
        });
        h.seal(&mut in_place);
        assert_eq!((used, used2, area_len), (OVERHEAD + 5, OVERHEAD + 5, 5));
        assert_eq!(&copied[..used], &in_place[..used]);
        assert_eq!(
            BlockHeader::decode_block(&in_place, 255).unwrap().1,
            b"hello"
        );
    }

    #[test]
    fn layout_is_little_endian_at_documented_offsets() {
        let h = sample();
        let mut block = vec![0; 128];
        h.encode_block(b"hello", &mut block);
        assert_eq!(block[0], 7);
        assert_eq!(&block[1..3], &[0xFF, 0xFF]);
        assert_eq!(block[3], BLOCK_VERSION);
        assert_eq!(&block[6..8], &[1, 0]);
        assert_eq!(&block[8..10], &[3, 0]);
        assert_eq!(&block[10..12], &[48, 0]);
        assert_eq!(&block[12..16], &[5, 0, 0, 0]);
        assert_eq!(&block[16..24], &(1u64 << 40).to_le_bytes());
        assert_eq!(&block[40..48], &123_456u64.to_le_bytes());
        assert_eq!(&block[48..53], b"hello");
        assert_eq!(&block[53..57], &[5, 0, 0, 0]);
        assert_eq!(block[60], 0x5A);
    }

    #[test]
    fn every_flipped_byte_is_caught() {
        let h = sample();
        let mut block = vec![0; OVERHEAD + 5];
        h.encode_block(b"hello", &mut block);
        for i in 0..block.len() {
            let mut bad = block.clone();
            bad[i] ^= 0x10;
            assert!(
                BlockHeader::decode_block(&bad, 255).is_err(),
                "flip at byte {i} not caught"
            );
        }
    }

    #[test]
    fn malformed_headers_are_rejected_by_kind() {
        let h = sample();
        let mut block = vec![0; 72];
        h.encode_block(b"hello", &mut block);
        let check = |mutate: &dyn Fn(&mut Vec<u8>), want: BlockError, max_dev: u8| {
            let mut b = block.clone();
            mutate(&mut b);
            assert_eq!(BlockHeader::decode_block(&b, max_dev).unwrap_err(), want);
        };
        check(&|b| b.truncate(20), BlockError::TooShort, 255);
        check(&|b| b[3] = 9, BlockError::BadVersion, 255);
        check(&|b| b[10] = 40, BlockError::BadHeaderLen, 255);
        check(&|b| b[4] = 0x80, BlockError::BadFlags, 255);
        check(
            &|b| b[12..16].copy_from_slice(&1000u32.to_le_bytes()),
            BlockError::LengthOverBlock,
            255,
        );
        check(
            &|b| b[8..10].copy_from_slice(&0u16.to_le_bytes()),
            BlockError::BadFragment,
            255,
        );
        check(
            &|b| b[6..8].copy_from_slice(&3u16.to_le_bytes()),
            BlockError::BadFragment,
            255,
        );
        check(
            &|b| b[32..36].copy_from_slice(&2u32.to_le_bytes()),
            BlockError::BadFragment,
            255,
        );
        check(&|_| {}, BlockError::DeviceOutOfRange, 6);
        check(&|b| b[53] ^= 1, BlockError::BadSeal, 255);
        // A zeroed block (never written) is not a valid block.
        assert!(BlockHeader::decode_block(&[0u8; 72], 255).is_err());
    }

    #[test]
    fn a_header_sealed_block_is_accepted_only_where_placement_is_ordered() {
        let h = sample().sealed_for(Placement::Ordered);
        assert!(h.is_header_sealed());
        let mut block = vec![0xEE; 128];
        h.encode_block(b"hello", &mut block);
        assert_eq!(block[4], flags::HEADER_SEAL);
        // The CRC32C covers the 48 header bytes only.
        assert_eq!(
            &block[56 + 5..60 + 5],
            &crc32c::crc32c(&block[..HEADER_LEN]).to_le_bytes()
        );
        let (d, p) = BlockHeader::decode_block_on(&block, 255, Placement::Ordered).unwrap();
        assert_eq!((d, p), (h, &b"hello"[..]));
        assert_eq!(
            BlockHeader::decode_block_on(&block, 255, Placement::Unordered).unwrap_err(),
            BlockError::WeakSeal
        );
        assert_eq!(
            BlockHeader::decode_block(&block, 255).unwrap_err(),
            BlockError::WeakSeal
        );
        // A fully sealed block is accepted under both policies.
        let full = sample().sealed_for(Placement::Unordered);
        let mut block = vec![0xEE; 128];
        full.encode_block(b"hello", &mut block);
        for placement in [Placement::Ordered, Placement::Unordered] {
            assert_eq!(
                BlockHeader::decode_block_on(&block, 255, placement)
                    .unwrap()
                    .1,
                b"hello"
            );
        }
    }

    #[test]
    fn a_header_sealed_block_catches_every_flip_outside_the_payload() {
        let h = sample().sealed_for(Placement::Ordered);
        let mut block = vec![0; OVERHEAD + 5];
        h.encode_block(b"hello", &mut block);
        let payload = HEADER_LEN..HEADER_LEN + 5;
        for i in 0..block.len() {
            let mut bad = block.clone();
            bad[i] ^= 0x10;
            let r = BlockHeader::decode_block_on(&bad, 255, Placement::Ordered);
            if payload.contains(&i) {
                // What the ordered transports make unnecessary: the payload is not checksummed.
                assert_eq!(
                    r.unwrap().1[i - HEADER_LEN],
                    b"hello"[i - HEADER_LEN] ^ 0x10
                );
            } else {
                assert!(r.is_err(), "flip at byte {i} not caught");
            }
        }
        // Clearing the flag (a header-sealed block passed off as fully sealed) fails the CRC.
        let mut bad = block.clone();
        bad[4] &= !flags::HEADER_SEAL;
        assert_eq!(
            BlockHeader::decode_block_on(&bad, 255, Placement::Unordered).unwrap_err(),
            BlockError::BadSeal
        );
    }

    #[test]
    fn a_header_sealed_block_with_a_lying_length_stays_in_bounds() {
        // Lengths come from the (checked) header, never from the payload: a header whose payload
        // length runs past the block is refused before anything is read, sealed or not.
        let mut h = sample().sealed_for(Placement::Ordered);
        h.payload_len = 1000;
        h.message_len = 1000;
        let mut block = vec![0; 2000];
        h.encode_block(&[7; 1000], &mut block);
        block.truncate(200);
        assert_eq!(
            BlockHeader::decode_block_on(&block, 255, Placement::Ordered).unwrap_err(),
            BlockError::LengthOverBlock
        );
    }

    #[test]
    fn stale_block_with_other_packet_number_fails_the_seal() {
        // Header of a new message over the trailer of an old one: the torn-write case.
        let mut old = vec![0; 72];
        sample().encode_block(b"hello", &mut old);
        let mut newer = sample();
        newer.packet = 3;
        let mut torn = old.clone();
        newer.write_header_and_payload(b"hello", &mut torn);
        assert_eq!(
            BlockHeader::decode_block(&torn, 255).unwrap_err(),
            BlockError::BadSeal
        );
    }

    /// What a receiver checks is what it uses: a block's header and trailer are each taken once,
    /// in one copy, whatever the seal covers, so a sender that changes them meanwhile cannot make
    /// a check and the use after it see different bytes.
    #[test]
    fn header_and_trailer_are_each_copied_once() {
        for placement in [Placement::Unordered, Placement::Ordered] {
            let h = sample().sealed_for(placement);
            let mut block = vec![0xEE; 128];
            h.encode_block(b"hello", &mut block);
            let mut copies = Vec::new();
            let got = BlockHeader::decode_block_copied(
                &block,
                &mut |at, into| {
                    copies.push((at, into.len()));
                    into.copy_from_slice(&block[at..at + into.len()]);
                },
                255,
                placement,
            );
            assert_eq!(got, Ok(h));
            assert_eq!(copies, [(0, HEADER_LEN), (HEADER_LEN + 5, TRAILER_LEN)]);
        }
    }

    /// The header the decode returns is its copy's, not the block's bytes read again: here the
    /// block's bytes claim a payload past the block (as a sender could store after the copy),
    /// and the decode still answers from the honest copy, within bounds.
    #[test]
    fn a_header_changed_after_its_copy_is_not_read_again() {
        let h = sample().sealed_for(Placement::Ordered);
        let mut honest = vec![0; 128];
        h.encode_block(b"hello", &mut honest);
        let mut changed = honest.clone();
        changed[12..16].copy_from_slice(&100_000u32.to_le_bytes());
        let got = BlockHeader::decode_block_copied(
            &changed,
            &mut |at, into| into.copy_from_slice(&honest[at..at + into.len()]),
            255,
            Placement::Ordered,
        );
        assert_eq!(got.map(|g| g.payload_len), Ok(5));
    }
}
