//! Coalesced blocks (block layout version 2): several whole small messages in one memory block,
//! sealed once, so small messages (radar, metadata) do not pay one write chain each. The layout
//! is specified in docs/protocol.md ("Coalesced blocks"); keep the two in step.
//!
//! A block with one message keeps layout version 1 ([`BlockHeader`]); only blocks with at least
//! two messages use version 2. Every message in a coalesced block is whole (fragment 0 of 1),
//! lossy (never RELIABLE: a lossless message's block is its acknowledgement, so it travels
//! alone), and keeps its own device, packet number, frame index, timestamps and flags: the
//! receiver hands each one to its device's reordering exactly as if it had come in a block of
//! its own.
//!
//! [`Coalescer`] is the IO-free decision: which ready messages share a block, and until when a
//! lone small message may wait for company.

use std::ops::Range;
use std::time::{Duration, Instant};

use crate::header::{BlockError, BlockHeader, TRAILER_LEN, flags};

/// Layout version of a coalesced block.
pub const COALESCED_VERSION: u8 = 2;
/// Bytes of a coalesced block's own header.
pub const COALESCED_HEADER_LEN: usize = 16;
/// Bytes of the sub-header in front of each message of a coalesced block.
pub const SUB_HEADER_LEN: usize = 36;
/// Flags a message inside a coalesced block may carry (RELIABLE may not).
pub const SUB_FLAGS: u8 = flags::END_OF_STREAM | flags::FORMAT | flags::STREAM_START;
/// Offset of the layout version byte, the same in every version.
pub const VERSION_OFFSET: usize = 3;
/// Same as the v1 trailer's last byte but one.
const TRAILER_MAGIC: u8 = 0x5A;

/// Bytes a coalesced block of messages with these payload lengths uses (header, sub-headers,
/// payloads, trailer).
pub fn coalesced_len(payload_lens: impl IntoIterator<Item = usize>) -> usize {
    COALESCED_HEADER_LEN
        + TRAILER_LEN
        + payload_lens
            .into_iter()
            .map(|l| SUB_HEADER_LEN + l)
            .sum::<usize>()
}

/// The layout version a block claims (byte 3), without validating anything else; `None` for a
/// block too short to have one.
pub fn block_version(block: &[u8]) -> Option<u8> {
    block.get(VERSION_OFFSET).copied()
}

/// Whether a planned block header may go into a coalesced block: a whole message (one
/// fragment) of a lossy device with only the flags a sub-header carries.
pub fn can_share(h: &BlockHeader) -> bool {
    h.fragment_count == 1
        && h.fragment_index == 0
        && h.flags & !SUB_FLAGS == 0
        && h.message_len == h.payload_len
}

/// Writes a coalesced block of `msgs` (at least two, each [`can_share`], and messages of one
/// device in consecutive packet order) into `block` and returns the bytes used. Panics on
/// misuse (the caller plans blocks with [`Coalescer`], so that is a bug, not bad input).
pub fn encode_coalesced<P: AsRef<[u8]>>(msgs: &[(BlockHeader, P)], block: &mut [u8]) -> usize {
    assert!(
        msgs.len() >= 2,
        "a coalesced block carries at least two messages"
    );
    assert!(msgs.len() <= u16::MAX as usize, "too many messages");
    let used = coalesced_len(msgs.iter().map(|(_, p)| p.as_ref().len()));
    assert!(
        used <= block.len(),
        "block too small for coalesced messages"
    );
    let body = used - COALESCED_HEADER_LEN - TRAILER_LEN;
    let body32 = u32::try_from(body).expect("body fits u32");
    let first = &msgs[0].0;
    let b = &mut block[..used];
    b[0] = first.device;
    b[1..3].copy_from_slice(&first.packet.to_le_bytes());
    b[3] = COALESCED_VERSION;
    b[4] = 0;
    b[5] = 0;
    b[6..8].copy_from_slice(&(msgs.len() as u16).to_le_bytes());
    b[8..10].copy_from_slice(&[0, 0]);
    b[10..12].copy_from_slice(&(COALESCED_HEADER_LEN as u16).to_le_bytes());
    b[12..16].copy_from_slice(&body32.to_le_bytes());
    let mut o = COALESCED_HEADER_LEN;
    for (h, p) in msgs {
        let p = p.as_ref();
        assert!(can_share(h), "message cannot share a block");
        assert_eq!(p.len(), h.payload_len as usize, "payload_len mismatch");
        let s = &mut b[o..o + SUB_HEADER_LEN];
        s[0] = h.device;
        s[1] = h.flags;
        s[2..4].copy_from_slice(&h.packet.to_le_bytes());
        s[4..8].copy_from_slice(&h.payload_len.to_le_bytes());
        s[8..16].copy_from_slice(&h.frame_index.to_le_bytes());
        s[16..24].copy_from_slice(&h.timestamp_ns.to_le_bytes());
        s[24..28].copy_from_slice(&h.duration_ns.to_le_bytes());
        s[28..36].copy_from_slice(&h.pts_ns.to_le_bytes());
        o += SUB_HEADER_LEN;
        b[o..o + p.len()].copy_from_slice(p);
        o += p.len();
    }
    let end = o;
    let crc = crc32c::crc32c(&b[..end]);
    let t = &mut b[end..end + TRAILER_LEN];
    t[0..4].copy_from_slice(&body32.to_le_bytes());
    t[4..6].copy_from_slice(&first.packet.to_le_bytes());
    t[6] = first.device;
    t[7] = TRAILER_MAGIC;
    t[8..12].copy_from_slice(&crc.to_le_bytes());
    used
}

/// One message of a decoded coalesced block: its header (as a single-block message would have
/// it) and where its payload lies in the block.
pub type SubMessage = (BlockHeader, Range<usize>);

/// The body length a coalesced block's header claims, after checking the header's fixed
/// fields and bounds (no seal check, no walk of the messages): what a receiver must be ready to
/// copy. Errors as [`decode_coalesced`].
pub fn coalesced_body_len(block: &[u8]) -> Result<usize, BlockError> {
    if block.len() < COALESCED_HEADER_LEN + TRAILER_LEN {
        return Err(BlockError::TooShort);
    }
    let head: &[u8; COALESCED_HEADER_LEN] = block[..COALESCED_HEADER_LEN]
        .try_into()
        .expect("COALESCED_HEADER_LEN bytes");
    coalesced_body_len_of(head, block.len())
}

/// [`coalesced_body_len`] of a header copied out of a block of `block_len` bytes.
pub fn coalesced_body_len_of(
    head: &[u8; COALESCED_HEADER_LEN],
    block_len: usize,
) -> Result<usize, BlockError> {
    if block_len < COALESCED_HEADER_LEN + TRAILER_LEN {
        return Err(BlockError::TooShort);
    }
    let b = head;
    if b[3] != COALESCED_VERSION {
        return Err(BlockError::BadVersion);
    }
    if u16::from_le_bytes([b[10], b[11]]) as usize != COALESCED_HEADER_LEN {
        return Err(BlockError::BadHeaderLen);
    }
    if b[4] != 0 || b[5] != 0 || b[8] != 0 || b[9] != 0 {
        return Err(BlockError::BadFlags);
    }
    let body = u32::from_le_bytes(b[12..16].try_into().expect("4 bytes")) as usize;
    if body > block_len - COALESCED_HEADER_LEN - TRAILER_LEN {
        return Err(BlockError::LengthOverBlock);
    }
    Ok(body)
}

/// Writes the trailer (the seal) of a coalesced block whose header is already in `block`, over
/// whatever body it has. For tests and fuzzing: it lets a mutated block reach the checks behind
/// the seal. Fails as [`coalesced_body_len`] does when the header's fields are out of bounds.
pub fn reseal_coalesced(block: &mut [u8]) -> Result<(), BlockError> {
    let body = coalesced_body_len(block)?;
    let end = COALESCED_HEADER_LEN + body;
    let (first, packet) = (block[0], [block[1], block[2]]);
    let crc = crc32c::crc32c(&block[..end]);
    let t = &mut block[end..end + TRAILER_LEN];
    t[0..4].copy_from_slice(&(body as u32).to_le_bytes());
    t[4..6].copy_from_slice(&packet);
    t[6] = first;
    t[7] = TRAILER_MAGIC;
    t[8..12].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// Decodes and checks a coalesced block, treating every byte as hostile: header fields, body
/// length within the block, the seal (trailer repeats body length, first packet and device;
/// CRC32C over header and body), then every sub-header: in bounds, known flags (never
/// RELIABLE), device within `max_device`, payload within the body, exactly the announced count
/// of messages filling exactly the body, the block header naming the first message, and a
/// device's messages in consecutive packet order. Returns the messages in block order.
pub fn decode_coalesced(block: &[u8], max_device: u8) -> Result<Vec<SubMessage>, BlockError> {
    let body = coalesced_body_len(block)?;
    let b = block;
    let count = u16::from_le_bytes([b[6], b[7]]) as usize;
    let end = COALESCED_HEADER_LEN + body;
    let t = &b[end..end + TRAILER_LEN];
    let crc = crc32c::crc32c(&b[..end]);
    if t[0..4] != (body as u32).to_le_bytes()
        || t[4..6] != b[1..3]
        || t[6] != b[0]
        || t[7] != TRAILER_MAGIC
        || t[8..12] != crc.to_le_bytes()
    {
        return Err(BlockError::BadSeal);
    }
    // Sealed, so written by a sender; still checked as if it were not.
    if count < 2 || count > body / SUB_HEADER_LEN {
        return Err(BlockError::BadCoalesced);
    }
    let mut out: Vec<SubMessage> = Vec::with_capacity(count);
    let mut last_packet: [Option<u16>; 256] = [None; 256];
    let mut o = COALESCED_HEADER_LEN;
    for _ in 0..count {
        if end - o < SUB_HEADER_LEN {
            return Err(BlockError::BadCoalesced);
        }
        let s = &b[o..o + SUB_HEADER_LEN];
        let u64_at = |k: usize| u64::from_le_bytes(s[k..k + 8].try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(s[4..8].try_into().expect("4 bytes"));
        let h = BlockHeader {
            device: s[0],
            packet: u16::from_le_bytes([s[2], s[3]]),
            flags: s[1],
            fragment_index: 0,
            fragment_count: 1,
            payload_len: len,
            frame_index: u64_at(8),
            timestamp_ns: u64_at(16),
            message_len: len,
            duration_ns: u32::from_le_bytes(s[24..28].try_into().expect("4 bytes")),
            pts_ns: u64_at(28),
        };
        if h.flags & !SUB_FLAGS != 0 {
            return Err(BlockError::BadFlags);
        }
        if h.device > max_device {
            return Err(BlockError::DeviceOutOfRange);
        }
        o += SUB_HEADER_LEN;
        if len as usize > end - o {
            return Err(BlockError::BadCoalesced);
        }
        let prev = &mut last_packet[h.device as usize];
        if prev.is_some_and(|p| p.wrapping_add(1) != h.packet) {
            return Err(BlockError::BadCoalesced);
        }
        *prev = Some(h.packet);
        out.push((h, o..o + len as usize));
        o += len as usize;
    }
    if o != end || out[0].0.device != b[0] || out[0].0.packet.to_le_bytes() != b[1..3] {
        return Err(BlockError::BadCoalesced);
    }
    Ok(out)
}

/// Decodes a block of either layout: a version 1 block as its one message, a version 2 block as
/// its messages in order. Payload ranges index into `block`.
pub fn decode_any(block: &[u8], max_device: u8) -> Result<Vec<SubMessage>, BlockError> {
    match block_version(block) {
        Some(COALESCED_VERSION) => decode_coalesced(block, max_device),
        _ => {
            let (h, p) = BlockHeader::decode_block(block, max_device)?;
            let start = crate::header::HEADER_LEN;
            Ok(vec![(h, start..start + p.len())])
        }
    }
}

/// What [`Coalescer`] hands out: the messages of one block, in the order they were offered.
/// One message is written as a version 1 block, several as a coalesced one.
pub type Batch<P> = Vec<(BlockHeader, P)>;

/// The IO-free coalescing decision for one sender. Single-block lossy messages are held for at
/// most `wait` after the first of them was offered, and go out together in one block as soon
/// as the next would not fit, a message that cannot share arrives (it goes after them, so fill
/// order and per-device packet order are kept), or the wait is over ([`Self::handle_timeout`]).
/// A `wait` of zero turns coalescing off: every message is its own block at once.
#[derive(Debug)]
pub struct Coalescer<P> {
    block_size: usize,
    wait: Duration,
    pending: Batch<P>,
    /// Bytes the pending messages would use as a coalesced block.
    used: usize,
    deadline: Option<Instant>,
}

impl<P: AsRef<[u8]>> Coalescer<P> {
    /// Plans blocks of `block_size` bytes, holding small messages at most `wait`.
    pub fn new(block_size: usize, wait: Duration) -> Self {
        Coalescer {
            block_size,
            wait,
            pending: Vec::new(),
            used: COALESCED_HEADER_LEN + TRAILER_LEN,
            deadline: None,
        }
    }

    /// Whether coalescing is on.
    pub fn enabled(&self) -> bool {
        !self.wait.is_zero()
    }

    /// Whether a message with this header and payload can wait for company.
    fn shareable(&self, h: &BlockHeader, payload: &P) -> bool {
        self.enabled()
            && can_share(h)
            && coalesced_len([payload.as_ref().len()]) + SUB_HEADER_LEN <= self.block_size
    }

    /// A message's block (one of a planned message's blocks, in order) is ready at `now`.
    /// Returns the batches to write now, in order (possibly none: the message waits).
    pub fn handle_message(&mut self, now: Instant, h: BlockHeader, payload: P) -> Vec<Batch<P>> {
        let mut out = Vec::new();
        if !self.shareable(&h, &payload) {
            out.extend(self.flush());
            out.push(vec![(h, payload)]);
            return out;
        }
        let grow = SUB_HEADER_LEN + payload.as_ref().len();
        if self.used + grow > self.block_size || self.pending.len() == u16::MAX as usize {
            out.extend(self.flush());
        }
        self.used += grow;
        self.pending.push((h, payload));
        self.deadline.get_or_insert(now + self.wait);
        out
    }

    /// When the held messages must go out; `None` when none is held.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadline
    }

    /// Time passed: the held messages go out once their wait is over.
    pub fn handle_timeout(&mut self, now: Instant) -> Option<Batch<P>> {
        if self.deadline.is_some_and(|d| now >= d) {
            self.flush()
        } else {
            None
        }
    }

    /// The held messages go out now (nothing else is coming, or the sender stops).
    pub fn flush(&mut self) -> Option<Batch<P>> {
        self.deadline = None;
        self.used = COALESCED_HEADER_LEN + TRAILER_LEN;
        (!self.pending.is_empty()).then(|| std::mem::take(&mut self.pending))
    }

    /// Number of messages held.
    pub fn held(&self) -> usize {
        self.pending.len()
    }
}

/// Writes one batch from [`Coalescer`] into `block`: a lone message as a version 1 block, several
/// as a coalesced block. Returns the bytes used.
pub fn encode_batch<P: AsRef<[u8]>>(batch: &[(BlockHeader, P)], block: &mut [u8]) -> usize {
    match batch {
        [(h, p)] => h.encode_block(p.as_ref(), block),
        _ => encode_coalesced(batch, block),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::header::{HEADER_LEN, NO_PTS, OVERHEAD};

    fn msg(
        device: u8,
        packet: u16,
        frame: u64,
        flags: u8,
        payload: &[u8],
    ) -> (BlockHeader, Vec<u8>) {
        let len = payload.len() as u32;
        (
            BlockHeader {
                device,
                packet,
                flags,
                fragment_index: 0,
                fragment_count: 1,
                payload_len: len,
                frame_index: frame,
                timestamp_ns: 1_700_000_000_000_000_000 + frame,
                message_len: len,
                duration_ns: 40_000_000,
                pts_ns: if frame.is_multiple_of(2) {
                    NO_PTS
                } else {
                    frame * 1000
                },
            },
            payload.to_vec(),
        )
    }

    fn sample() -> Vec<(BlockHeader, Vec<u8>)> {
        vec![
            msg(3, 65535, 10, flags::STREAM_START, b"radar-a"),
            msg(1, 7, 0, flags::FORMAT, b"application/x-radar"),
            msg(3, 0, 11, 0, b""),
            msg(1, 8, 0, 0, b"xyz"),
            msg(3, 1, 12, flags::END_OF_STREAM, b""),
        ]
    }

    fn encoded(msgs: &[(BlockHeader, Vec<u8>)], size: usize) -> Vec<u8> {
        let mut block = vec![0xEE; size];
        let used = encode_coalesced(msgs, &mut block);
        assert_eq!(used, coalesced_len(msgs.iter().map(|(_, p)| p.len())));
        block
    }

    #[test]
    fn round_trip_with_mixed_devices_and_wrapping_packets() {
        let msgs = sample();
        let block = encoded(&msgs, 512);
        let got = decode_any(&block, 255).unwrap();
        assert_eq!(got.len(), msgs.len());
        for ((h, r), (want, p)) in got.iter().zip(&msgs) {
            assert_eq!(h, want);
            assert_eq!(&block[r.clone()], &p[..]);
        }
    }

    #[test]
    fn layout_is_little_endian_at_documented_offsets() {
        let msgs = sample();
        let block = encoded(&msgs, 512);
        assert_eq!(block[0], 3);
        assert_eq!(&block[1..3], &[0xFF, 0xFF]);
        assert_eq!(block[3], 2);
        assert_eq!(&block[4..6], &[0, 0]);
        assert_eq!(&block[6..8], &[5, 0]);
        assert_eq!(&block[10..12], &[16, 0]);
        let body = 5 * SUB_HEADER_LEN + 7 + 19 + 3;
        assert_eq!(&block[12..16], &(body as u32).to_le_bytes());
        // First sub-header.
        let s = &block[16..16 + SUB_HEADER_LEN];
        assert_eq!(s[0], 3);
        assert_eq!(s[1], flags::STREAM_START);
        assert_eq!(&s[2..4], &[0xFF, 0xFF]);
        assert_eq!(&s[4..8], &[7, 0, 0, 0]);
        assert_eq!(&s[8..16], &10u64.to_le_bytes());
        assert_eq!(&s[24..28], &40_000_000u32.to_le_bytes());
        assert_eq!(&s[28..36], &NO_PTS.to_le_bytes());
        assert_eq!(&block[52..59], b"radar-a");
        // Trailer.
        let t = 16 + body;
        assert_eq!(&block[t..t + 4], &(body as u32).to_le_bytes());
        assert_eq!(&block[t + 4..t + 6], &[0xFF, 0xFF]);
        assert_eq!(block[t + 6], 3);
        assert_eq!(block[t + 7], 0x5A);
        assert_eq!(
            &block[t + 8..t + 12],
            &crc32c::crc32c(&block[..t]).to_le_bytes()
        );
    }

    #[test]
    fn every_flipped_byte_rejects_the_whole_block() {
        let msgs = sample();
        let used = coalesced_len(msgs.iter().map(|(_, p)| p.len()));
        let block = encoded(&msgs, used);
        for i in 0..used {
            for bit in [0x01, 0x10, 0x80] {
                let mut bad = block.clone();
                bad[i] ^= bit;
                assert!(
                    decode_any(&bad, 255).is_err(),
                    "flip {bit:#x} at byte {i} not caught"
                );
            }
        }
    }

    #[test]
    fn every_truncation_is_rejected() {
        let msgs = sample();
        let used = coalesced_len(msgs.iter().map(|(_, p)| p.len()));
        let block = encoded(&msgs, used);
        for n in 0..used {
            assert!(decode_any(&block[..n], 255).is_err(), "{n} bytes accepted");
        }
    }

    /// Re-seals a block after a mutation, so the structural checks behind the seal are reached.
    fn reseal(b: &mut [u8]) {
        let _ = reseal_coalesced(b);
    }

    #[test]
    fn sealed_but_malformed_blocks_are_rejected_by_kind() {
        let msgs = sample();
        let block = encoded(&msgs, 512);
        let check = |mutate: &dyn Fn(&mut Vec<u8>), want: BlockError, max_dev: u8| {
            let mut b = block.clone();
            mutate(&mut b);
            reseal(&mut b);
            assert_eq!(decode_coalesced(&b, max_dev).unwrap_err(), want);
            assert_eq!(decode_any(&b, max_dev).unwrap_err(), want);
        };
        let sub = |k: usize| -> usize {
            let mut o = COALESCED_HEADER_LEN;
            for (_, p) in &msgs[..k] {
                o += SUB_HEADER_LEN + p.len();
            }
            o
        };
        check(&|b| b.truncate(20), BlockError::TooShort, 255);
        check(&|b| b[10] = 48, BlockError::BadHeaderLen, 255);
        check(&|b| b[4] = 1, BlockError::BadFlags, 255);
        check(&|b| b[9] = 1, BlockError::BadFlags, 255);
        check(
            &|b| b[12..16].copy_from_slice(&600u32.to_le_bytes()),
            BlockError::LengthOverBlock,
            255,
        );
        check(
            &|b| b[12..16].copy_from_slice(&u32::MAX.to_le_bytes()),
            BlockError::LengthOverBlock,
            255,
        );
        // Counts: fewer than two, more than the body holds, one more or one less than written.
        for n in [0u16, 1, 4, 6, 100, u16::MAX] {
            check(
                &|b| b[6..8].copy_from_slice(&n.to_le_bytes()),
                BlockError::BadCoalesced,
                255,
            );
        }
        // A message's length running past the body, or short of it.
        let s2 = sub(2);
        check(
            &|b| b[s2 + 4..s2 + 8].copy_from_slice(&1000u32.to_le_bytes()),
            BlockError::BadCoalesced,
            255,
        );
        let s4 = sub(4);
        check(
            &|b| b[s4 + 4..s4 + 8].copy_from_slice(&u32::MAX.to_le_bytes()),
            BlockError::BadCoalesced,
            255,
        );
        // The body claims one byte more than the messages fill.
        check(
            &|b| {
                let body = u32::from_le_bytes(b[12..16].try_into().unwrap()) + 1;
                b[12..16].copy_from_slice(&body.to_le_bytes());
            },
            BlockError::BadCoalesced,
            255,
        );
        // RELIABLE (or an unknown flag) inside a coalesced block.
        let s1 = sub(1);
        check(&|b| b[s1 + 1] = flags::RELIABLE, BlockError::BadFlags, 255);
        check(&|b| b[s1 + 1] = 0x40, BlockError::BadFlags, 255);
        // A device beyond the receiver's limit, in the first or a later message.
        check(&|_| {}, BlockError::DeviceOutOfRange, 2);
        check(&|b| b[s1] = 200, BlockError::DeviceOutOfRange, 100);
        // A device's packets not consecutive (a duplicate, a gap, backwards).
        for p in [65535u16, 1, 2] {
            check(
                &|b| b[s2 + 2..s2 + 4].copy_from_slice(&p.to_le_bytes()),
                BlockError::BadCoalesced,
                255,
            );
        }
        // The block header not naming its first message.
        check(&|b| b[0] = 1, BlockError::BadCoalesced, 255);
        check(&|b| b[1] = 0, BlockError::BadCoalesced, 255);
        // A zeroed block is not a valid block of either version.
        assert!(decode_any(&[0u8; 512], 255).is_err());
    }

    #[test]
    fn a_version_1_block_still_decodes_as_one_message() {
        let (h, p) = msg(9, 4, 2, 0, b"hello");
        let mut block = vec![0; 128];
        h.encode_block(&p, &mut block);
        let got = decode_any(&block, 255).unwrap();
        assert_eq!(got, vec![(h, HEADER_LEN..HEADER_LEN + 5)]);
        // And a v2 block is refused by the v1 decoder (an old receiver counts it bad-version).
        let v2 = encoded(&sample(), 512);
        assert_eq!(
            BlockHeader::decode_block(&v2, 255).unwrap_err(),
            BlockError::BadVersion
        );
    }

    #[test]
    fn what_may_share_a_block() {
        let (h, _) = msg(1, 0, 0, flags::FORMAT | flags::STREAM_START, b"x");
        assert!(can_share(&h));
        assert!(!can_share(&BlockHeader {
            flags: flags::RELIABLE,
            ..h
        }));
        assert!(!can_share(&BlockHeader {
            fragment_count: 2,
            message_len: 2,
            ..h
        }));
    }

    fn t0() -> Instant {
        Instant::now()
    }

    #[test]
    fn coalescer_holds_small_messages_until_the_wait_is_over() {
        let now = t0();
        let wait = Duration::from_micros(200);
        let mut c = Coalescer::new(1024, wait);
        let msgs = sample();
        for (h, p) in &msgs[..3] {
            assert!(c.handle_message(now, *h, p.clone()).is_empty());
        }
        assert_eq!(c.poll_timeout(), Some(now + wait));
        assert!(c.handle_timeout(now + wait / 2).is_none());
        let batch = c.handle_timeout(now + wait).unwrap();
        assert_eq!(batch, msgs[..3].to_vec());
        assert_eq!(c.poll_timeout(), None);
        assert_eq!(c.held(), 0);
    }

    #[test]
    fn coalescer_sends_a_full_block_at_once_and_never_overfills() {
        let now = t0();
        let size = OVERHEAD + 200;
        let mut c = Coalescer::new(size, Duration::from_millis(1));
        let mut batches = Vec::new();
        for k in 0..40u16 {
            let (h, p) = msg((k % 3) as u8, k / 3, k as u64, 0, &[k as u8; 30]);
            batches.extend(c.handle_message(now, h, p));
        }
        batches.extend(c.flush());
        let mut seen = 0;
        for b in &batches {
            let used = coalesced_len(b.iter().map(|(_, p)| p.len()));
            assert!(b.len() == 1 || used <= size, "{used} > {size}");
            let mut block = vec![0; size];
            let n = encode_batch(b, &mut block);
            let got = decode_any(&block[..n], 255).unwrap();
            for (h, _) in got {
                assert_eq!(h.frame_index, seen);
                seen += 1;
            }
        }
        assert_eq!(seen, 40);
        // Three 30-byte messages fill a block: every block but the flushed remainder is full.
        let sizes: Vec<usize> = batches.iter().map(Vec::len).collect();
        assert_eq!(sizes[..13], [3; 13]);
        assert_eq!(sizes[13..], [1]);
    }

    #[test]
    fn coalescer_lets_what_cannot_share_go_after_the_held_ones() {
        let now = t0();
        let mut c = Coalescer::new(4096, Duration::from_millis(1));
        let (a, pa) = msg(1, 0, 0, 0, b"a");
        let (b, pb) = msg(2, 0, 0, 0, b"b");
        let reliable = BlockHeader {
            flags: flags::RELIABLE,
            ..msg(4, 0, 0, 0, b"r").0
        };
        let frag = BlockHeader {
            fragment_count: 2,
            message_len: 2,
            ..msg(1, 1, 1, 0, b"f").0
        };
        assert!(c.handle_message(now, a, pa.clone()).is_empty());
        assert!(c.handle_message(now, b, pb.clone()).is_empty());
        let out = c.handle_message(now, frag, b"f".to_vec());
        assert_eq!(
            out,
            vec![vec![(a, pa), (b, pb)], vec![(frag, b"f".to_vec())]]
        );
        let out = c.handle_message(now, reliable, b"r".to_vec());
        assert_eq!(out, vec![vec![(reliable, b"r".to_vec())]]);
        // A message too large to share a block with anything goes alone, at once.
        let (big, pbig) = msg(5, 0, 0, 0, &[0; 4096 - OVERHEAD]);
        assert_eq!(
            c.handle_message(now, big, pbig.clone()),
            vec![vec![(big, pbig)]]
        );
        assert_eq!(c.poll_timeout(), None);
    }

    #[test]
    fn coalescer_with_no_wait_is_off() {
        let mut c = Coalescer::new(4096, Duration::ZERO);
        assert!(!c.enabled());
        for (h, p) in sample() {
            assert_eq!(c.handle_message(t0(), h, p.clone()), vec![vec![(h, p)]]);
        }
        assert_eq!(c.poll_timeout(), None);
    }
}
