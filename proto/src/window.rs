//! The sliding-window baseline (Tu et al., the paper's section 2.3 and Figure 1), as IO-free
//! state machines: what the status-byte mechanism is measured against. It is kept faithful on
//! purpose, including the weakness the paper points out (Figure 1d): blocks are released strictly
//! in order, so one block the receiver keeps stalls the whole window.
//!
//! The mechanism, in the paper's words:
//! - **RmInit**: the receiver announces a ring of `n` memory blocks (address, length, key); the
//!   sender keeps a *head* (oldest block not yet released) and a *tail* (next block to write).
//! - **RmWrite**: the sender writes the block at the tail with RDMA WRITE WITH IMMEDIATE; the
//!   32-bit immediate ([`Immediate`]) carries the block's position and length. The receiver must
//!   have posted a receive request for it and gets one completion per block.
//! - **ACK**: after processing a block the receiver SENDs an acknowledgement (4 bytes: the
//!   immediate of the block, see [`Immediate::to_ack`]); the sender receives it on its own
//!   completion queue, into receives it posted beforehand.
//! - **RmFree**: the head advances only past acknowledged blocks, in ring order.
//!
//! Call order on the sender ([`WindowSender`]), for one connection at a time:
//! 1. [`WindowSender::handle_connected`] with the ring the receiver announced (RmInit).
//! 2. [`WindowSender::handle_filled`] for each send block the filling thread hands over.
//! 3. Drain [`WindowSender::poll_action`] and post every [`WindowAction::WriteImm`].
//! 4. Feed [`WindowSender::handle_write_completed`] (the WRITE WITH IMMEDIATE's completion) and
//!    [`WindowSender::handle_ack`] (an ACK that arrived on the ACK completion queue).
//! 5. Drain [`WindowSender::poll_freed`] and return those send blocks to the filling thread.
//!
//! On the receiver ([`WindowReceiver`]): post the receives of [`WindowReceiver::poll_action`]
//! at once, feed every receive completion to [`WindowReceiver::handle_received`], process the
//! block, then [`WindowReceiver::handle_processed`] (or, for a block it keeps, later
//! [`WindowReceiver::handle_released`]); post the SENDs and receives it asks for.
//!
//! Lossless (`block` policy) messages are kept by the sender until the head moved past their
//! last block: the receiver acknowledges a lossless message's last block only once the message
//! is durable — exactly the "block kept by the receiver" of Figure 1d. On a dropped connection
//! blocks whose write did not complete, and lossless messages not released, are sent again in
//! fill order to the next connection's ring (whose head and tail start at 0).
//!
//! What it deliberately does not do: skip a kept block (that is the status-byte mechanism's
//! status 2), or share one connection between devices — the baseline uses one connection (queue
//! pair) per device, as the paper describes.

use std::collections::VecDeque;
use std::time::Instant;

use crate::sender::{Delivery, RemoteLayout};

/// Bits of the immediate that carry the block length (the low bits).
pub const IMM_LEN_BITS: u32 = 25;
/// Largest block length an immediate can carry (32 MiB − 1).
pub const MAX_IMM_LEN: usize = (1 << IMM_LEN_BITS) - 1;
/// Largest ring an immediate can address (positions 0 ..= 127 in the high 7 bits).
pub const MAX_RING: usize = 1 << (32 - IMM_LEN_BITS);
/// Bytes of an ACK message.
pub const ACK_LEN: usize = 4;

/// The 32-bit immediate of one RmWrite: block position in the ring (high 7 bits) and the bytes
/// written (low 25 bits). Also the payload of the ACK that acknowledges the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Immediate {
    /// Position of the block in the receiver's ring.
    pub position: usize,
    /// Bytes written at the start of the block.
    pub len: usize,
}

/// Why an immediate or an ACK does not make sense for this ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WindowError {
    /// The position is outside the ring.
    #[error("block position {position} outside the ring of {ring} blocks")]
    PositionOutOfRing { position: usize, ring: usize },
    /// The length is larger than a block.
    #[error("length {len} larger than a {block_size}-byte block")]
    LengthOverBlock { len: usize, block_size: usize },
    /// A block arrived at a position that already holds an unacknowledged block, or not at
    /// the position the ring order expects.
    #[error("block at position {position} arrived out of ring order (expected {expected})")]
    OutOfOrder { position: usize, expected: usize },
    /// A block arrived but no receive request was posted (RNR: receiver not ready).
    #[error("write with immediate for position {position} found no posted receive")]
    NoReceivePosted { position: usize },
    /// An ACK for a block that is not written and unacknowledged.
    #[error("ACK for position {position}, which holds no unacknowledged block")]
    UnexpectedAck { position: usize },
    /// An ACK of the wrong size.
    #[error("ACK of {0} bytes (expected {ACK_LEN})")]
    BadAckLen(usize),
}

impl Immediate {
    /// Packs the immediate. Position and length must fit ([`MAX_RING`], [`MAX_IMM_LEN`]);
    /// [`check_ring`] is how a connection makes sure they do.
    pub fn encode(self) -> u32 {
        debug_assert!(self.position < MAX_RING && self.len <= MAX_IMM_LEN);
        ((self.position as u32) << IMM_LEN_BITS) | (self.len as u32 & MAX_IMM_LEN as u32)
    }

    /// Unpacks an immediate.
    pub fn decode(imm: u32) -> Immediate {
        Immediate {
            position: (imm >> IMM_LEN_BITS) as usize,
            len: (imm & MAX_IMM_LEN as u32) as usize,
        }
    }

    /// The ACK message acknowledging this block: the immediate, little-endian.
    pub fn to_ack(self) -> [u8; ACK_LEN] {
        self.encode().to_le_bytes()
    }

    /// Parses an ACK message.
    pub fn from_ack(bytes: &[u8]) -> Result<Immediate, WindowError> {
        let b: [u8; ACK_LEN] = bytes
            .try_into()
            .map_err(|_| WindowError::BadAckLen(bytes.len()))?;
        Ok(Immediate::decode(u32::from_le_bytes(b)))
    }

    fn check(self, layout: RemoteLayout) -> Result<(), WindowError> {
        if self.position >= layout.blocks {
            return Err(WindowError::PositionOutOfRing {
                position: self.position,
                ring: layout.blocks,
            });
        }
        if self.len > layout.block_size {
            return Err(WindowError::LengthOverBlock {
                len: self.len,
                block_size: layout.block_size,
            });
        }
        Ok(())
    }
}

/// Whether a ring of this shape can be addressed by immediates: `Err` says why not.
pub fn check_ring(layout: RemoteLayout) -> Result<(), String> {
    if layout.blocks == 0 || layout.blocks > MAX_RING {
        return Err(format!(
            "the sliding window addresses 1 to {MAX_RING} blocks with its immediate, not {}",
            layout.blocks
        ));
    }
    if layout.block_size > MAX_IMM_LEN {
        return Err(format!(
            "the sliding window's immediate carries lengths up to {MAX_IMM_LEN} bytes; blocks of \
             {} bytes are too large",
            layout.block_size
        ));
    }
    Ok(())
}

/// What the sender must post next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowAction {
    /// RDMA WRITE WITH IMMEDIATE of the first `imm.len` bytes of send block `send_block` to
    /// ring block `imm.position`, immediate `imm.encode()`, signaled with `wr_id`.
    WriteImm {
        wr_id: u64,
        send_block: usize,
        imm: Immediate,
    },
}

/// Counters of the sliding-window sender.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WindowStats {
    /// WRITE WITH IMMEDIATE requests posted.
    pub writes: u64,
    /// ACKs received.
    pub acks: u64,
    /// Blocks released by RmFree (head advances).
    pub released: u64,
    /// Times a filled block waited because the tail had caught up with the head (the window
    /// was full), counted once per stall.
    pub window_full: u64,
    /// Blocks queued again because their connection dropped.
    pub requeued: u64,
}

#[derive(Debug, Clone, Copy)]
struct Filled {
    send_block: usize,
    len: usize,
    reliable: bool,
    last: bool,
    seq: u64,
}

/// One ring slot between tail and head.
#[derive(Debug, Clone, Copy)]
struct Slot {
    filled: Filled,
    wr_id: u64,
    /// The WRITE WITH IMMEDIATE completed (the send block may be reused unless lossless).
    written: bool,
    acked: bool,
}

/// The sliding-window sender: head and tail over the receiver's ring. See the module docs for
/// the call order.
#[derive(Debug)]
pub struct WindowSender {
    layout: Option<RemoteLayout>,
    /// Blocks written and not released, from head to tail (`slots[0]` is at the head).
    slots: VecDeque<Slot>,
    /// Ring position of the head.
    head: usize,
    queue: VecDeque<Filled>,
    /// Lossless blocks past the head whose message's last block the head has not passed.
    kept: Vec<Filled>,
    freed: VecDeque<usize>,
    max_outstanding: usize,
    next_seq: u64,
    next_wr_id: u64,
    stalled: bool,
    stats: WindowStats,
}

impl WindowSender {
    /// A sender that keeps at most `max_outstanding` writes without completion (at least 1).
    pub fn new(max_outstanding: usize) -> Self {
        WindowSender {
            layout: None,
            slots: VecDeque::new(),
            head: 0,
            queue: VecDeque::new(),
            kept: Vec::new(),
            freed: VecDeque::new(),
            max_outstanding: max_outstanding.max(1),
            next_seq: 0,
            next_wr_id: 1,
            stalled: false,
            stats: WindowStats::default(),
        }
    }

    /// RmInit: a connection is up with a fresh ring; head and tail start at position 0.
    pub fn handle_connected(&mut self, layout: RemoteLayout) {
        self.layout = Some(layout);
        self.head = 0;
        self.slots.clear();
        self.stalled = false;
    }

    /// The connection dropped: blocks whose write did not complete, and lossless messages not
    /// yet released, go back to the front of the queue in fill order.
    pub fn handle_disconnected(&mut self) {
        self.layout = None;
        let mut again: Vec<Filled> = self.kept.drain(..).collect();
        for s in self.slots.drain(..) {
            if !s.written || s.filled.reliable {
                again.push(s.filled);
            }
        }
        self.stats.requeued += again.len() as u64;
        again.sort_by_key(|f| f.seq);
        for f in again.into_iter().rev() {
            self.queue.push_front(f);
        }
    }

    /// The filling thread filled send block `send_block` with `len` bytes.
    pub fn handle_filled(&mut self, send_block: usize, len: usize, delivery: Delivery) {
        let (reliable, last) = match delivery {
            Delivery::Unconfirmed => (false, true),
            Delivery::Confirmed { last } => (true, last),
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        self.queue.push_back(Filled {
            send_block,
            len,
            reliable,
            last,
            seq,
        });
    }

    /// The next write to post, if the window has room: the tail is not a whole ring ahead of
    /// the head, and fewer than `max_outstanding` writes wait for their completion.
    pub fn poll_action(&mut self, _now: Instant) -> Option<WindowAction> {
        let layout = self.layout?;
        if self.queue.is_empty() {
            return None;
        }
        if self.slots.len() >= layout.blocks {
            if !self.stalled {
                self.stalled = true;
                self.stats.window_full += 1;
            }
            return None;
        }
        if self.slots.iter().filter(|s| !s.written).count() >= self.max_outstanding {
            return None;
        }
        self.stalled = false;
        let filled = self.queue.pop_front().expect("queue is not empty");
        let imm = Immediate {
            position: (self.head + self.slots.len()) % layout.blocks,
            len: filled.len,
        };
        let wr_id = self.next_wr_id;
        self.next_wr_id += 1;
        self.slots.push_back(Slot {
            filled,
            wr_id,
            written: false,
            acked: false,
        });
        self.stats.writes += 1;
        Some(WindowAction::WriteImm {
            wr_id,
            send_block: filled.send_block,
            imm,
        })
    }

    /// The WRITE WITH IMMEDIATE `wr_id` completed: the block is in the receiver's memory. Its
    /// send block is free unless it belongs to a lossless message. False for an unknown id.
    pub fn handle_write_completed(&mut self, wr_id: u64) -> bool {
        let Some(slot) = self
            .slots
            .iter_mut()
            .find(|s| s.wr_id == wr_id && !s.written)
        else {
            return false;
        };
        slot.written = true;
        if !slot.filled.reliable {
            self.freed.push_back(slot.filled.send_block);
        }
        self.release();
        true
    }

    /// An ACK arrived (its 4 bytes parsed by [`Immediate::from_ack`]). RmFree: the head moves
    /// past every acknowledged block at its front, in ring order; an acknowledged block behind
    /// an unacknowledged one stays in the window.
    pub fn handle_ack(&mut self, _now: Instant, ack: Immediate) -> Result<(), WindowError> {
        let layout = self.layout.ok_or(WindowError::UnexpectedAck {
            position: ack.position,
        })?;
        ack.check(layout)?;
        let offset = (ack.position + layout.blocks - self.head) % layout.blocks;
        let slot = self
            .slots
            .get_mut(offset)
            .filter(|s| !s.acked && s.filled.len == ack.len)
            .ok_or(WindowError::UnexpectedAck {
                position: ack.position,
            })?;
        slot.acked = true;
        self.stats.acks += 1;
        self.release();
        Ok(())
    }

    /// Advances the head past acknowledged blocks whose write completed.
    fn release(&mut self) {
        let Some(layout) = self.layout else { return };
        while let Some(s) = self.slots.front() {
            if !(s.acked && s.written) {
                break;
            }
            let s = self.slots.pop_front().expect("front exists");
            self.head = (self.head + 1) % layout.blocks;
            self.stats.released += 1;
            if s.filled.reliable {
                self.kept.push(s.filled);
                if s.filled.last {
                    // The head passed the message's last block: the whole message is durable.
                    self.freed.extend(self.kept.drain(..).map(|f| f.send_block));
                }
            }
        }
    }

    /// A send block that may be filled again.
    pub fn poll_freed(&mut self) -> Option<usize> {
        self.freed.pop_front()
    }

    /// Whether a connection is up.
    pub fn is_connected(&self) -> bool {
        self.layout.is_some()
    }

    /// Ring position of the head (oldest block not released).
    pub fn head(&self) -> usize {
        self.head
    }

    /// Ring position of the tail (next block to write).
    pub fn tail(&self) -> usize {
        match self.layout {
            Some(l) => (self.head + self.slots.len()) % l.blocks,
            None => self.head,
        }
    }

    /// Blocks written and not released (between head and tail).
    pub fn in_window(&self) -> usize {
        self.slots.len()
    }

    /// Send blocks of a lossless message the head has passed, kept until it passes the
    /// message's last block.
    pub fn kept(&self) -> usize {
        self.kept.len()
    }

    /// Writes posted whose completion has not arrived.
    pub fn outstanding(&self) -> usize {
        self.slots.iter().filter(|s| !s.written).count()
    }

    /// Filled send blocks not yet written.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// True when nothing is queued, in the window, kept or waiting to be freed.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty()
            && self.slots.is_empty()
            && self.kept.is_empty()
            && self.freed.is_empty()
    }

    /// Counters.
    pub fn stats(&self) -> WindowStats {
        self.stats
    }
}

/// What the receiver must post next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReceiverAction {
    /// Post `count` receive requests (for the senders' WRITE WITH IMMEDIATE).
    PostRecv { count: usize },
    /// SEND the ACK of this block ([`Immediate::to_ack`]).
    SendAck(Immediate),
}

/// Counters of the sliding-window receiver.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WindowReceiverStats {
    /// Receive completions (blocks arrived).
    pub received: u64,
    /// Receive requests posted.
    pub recvs_posted: u64,
    /// ACKs sent.
    pub acks: u64,
    /// Blocks processed but kept (their ACK waits for [`WindowReceiver::handle_released`]).
    pub kept: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Empty,
    /// Arrived, not processed yet.
    Filled(usize),
    /// Processed and kept: its ACK waits.
    Kept(usize),
}

/// The sliding-window receiver: which ring blocks hold data, the receive requests it keeps
/// posted, and which ACKs to send. Blocks arrive in ring order (the sender writes at its tail
/// over one reliable connection); ACKs go in the order the receiver finishes with blocks.
#[derive(Debug)]
pub struct WindowReceiver {
    layout: RemoteLayout,
    blocks: Vec<Block>,
    /// Ring position the next block must arrive at.
    expected: usize,
    /// Receive requests posted and not consumed.
    posted: usize,
    actions: VecDeque<ReceiverAction>,
    stats: WindowReceiverStats,
}

impl WindowReceiver {
    /// A receiver for a ring of `layout.blocks` blocks. It posts one receive request per ring
    /// block at once: the sender can have at most that many blocks unacknowledged, so a block
    /// never finds the receive queue empty, and a consumed receive is posted again at once.
    pub fn new(layout: RemoteLayout) -> Self {
        let mut r = WindowReceiver {
            layout,
            blocks: vec![Block::Empty; layout.blocks],
            expected: 0,
            posted: 0,
            actions: VecDeque::new(),
            stats: WindowReceiverStats::default(),
        };
        r.post(layout.blocks);
        r
    }

    fn post(&mut self, count: usize) {
        self.posted += count;
        self.stats.recvs_posted += count as u64;
        self.actions.push_back(ReceiverAction::PostRecv { count });
    }

    /// Whether a WRITE WITH IMMEDIATE `imm` may be placed now: its block is the next in ring
    /// order, not held, and a receive request is posted. Changes nothing (a transport checks
    /// before it lets the data in, then reports the arrival with
    /// [`WindowReceiver::handle_received`]).
    pub fn check_arrival(&self, imm: u32) -> Result<Immediate, WindowError> {
        let imm = Immediate::decode(imm);
        imm.check(self.layout)?;
        if self.posted == 0 {
            return Err(WindowError::NoReceivePosted {
                position: imm.position,
            });
        }
        if imm.position != self.expected || self.blocks[imm.position] != Block::Empty {
            return Err(WindowError::OutOfOrder {
                position: imm.position,
                expected: self.expected,
            });
        }
        Ok(imm)
    }

    /// A receive completion with immediate `imm`: the block is in memory. Returns which block
    /// and how many bytes to process. An immediate out of ring order, at a block still held,
    /// or with no receive posted is a protocol violation: the connection must be closed.
    pub fn handle_received(&mut self, imm: u32) -> Result<Immediate, WindowError> {
        let imm = self.check_arrival(imm)?;
        self.posted -= 1;
        self.post(1);
        self.blocks[imm.position] = Block::Filled(imm.len);
        self.expected = (imm.position + 1) % self.layout.blocks;
        self.stats.received += 1;
        Ok(imm)
    }

    /// The block at `position` was processed. Unless `keep`, its ACK goes out now; a kept
    /// block is acknowledged by [`WindowReceiver::handle_released`].
    pub fn handle_processed(&mut self, position: usize, keep: bool) {
        let Some(&Block::Filled(len)) = self.blocks.get(position) else {
            return;
        };
        if keep {
            self.blocks[position] = Block::Kept(len);
            self.stats.kept += 1;
        } else {
            self.ack(position, len);
        }
    }

    /// A kept block is released: its ACK goes out now.
    pub fn handle_released(&mut self, position: usize) {
        if let Some(&Block::Kept(len)) = self.blocks.get(position) {
            self.ack(position, len);
        }
    }

    fn ack(&mut self, position: usize, len: usize) {
        self.blocks[position] = Block::Empty;
        self.stats.acks += 1;
        self.actions
            .push_back(ReceiverAction::SendAck(Immediate { position, len }));
    }

    /// The next receive or SEND to post.
    pub fn poll_action(&mut self) -> Option<ReceiverAction> {
        self.actions.pop_front()
    }

    /// Receive requests posted and not consumed.
    pub fn posted_receives(&self) -> usize {
        self.posted
    }

    /// Blocks arrived and not yet acknowledged (processed or not).
    pub fn holding(&self) -> usize {
        self.blocks.iter().filter(|b| **b != Block::Empty).count()
    }

    /// Counters.
    pub fn stats(&self) -> WindowReceiverStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RING: RemoteLayout = RemoteLayout {
        blocks: 4,
        block_size: 64,
    };

    fn sender(depth: usize) -> (WindowSender, Instant) {
        let mut s = WindowSender::new(depth);
        s.handle_connected(RING);
        (s, Instant::now())
    }

    fn writes(s: &mut WindowSender, now: Instant) -> Vec<(u64, usize, Immediate)> {
        std::iter::from_fn(|| s.poll_action(now))
            .map(
                |WindowAction::WriteImm {
                     wr_id,
                     send_block,
                     imm,
                 }| (wr_id, send_block, imm),
            )
            .collect()
    }

    #[test]
    fn immediate_round_trips_and_acks_echo_it() {
        for (position, len) in [(0, 0), (1, 60), (127, MAX_IMM_LEN), (5, 921_600)] {
            let imm = Immediate { position, len };
            assert_eq!(Immediate::decode(imm.encode()), imm);
            assert_eq!(Immediate::from_ack(&imm.to_ack()), Ok(imm));
        }
        assert_eq!(
            Immediate {
                position: 3,
                len: 7
            }
            .encode(),
            (3 << 25) | 7
        );
        assert_eq!(Immediate::from_ack(&[1, 2]), Err(WindowError::BadAckLen(2)));
        assert!(
            check_ring(RemoteLayout {
                blocks: 129,
                block_size: 64
            })
            .is_err()
        );
        assert!(
            check_ring(RemoteLayout {
                blocks: 128,
                block_size: MAX_IMM_LEN + 1
            })
            .is_err()
        );
        assert!(
            check_ring(RemoteLayout {
                blocks: 128,
                block_size: MAX_IMM_LEN
            })
            .is_ok()
        );
    }

    #[test]
    fn writes_go_to_the_tail_in_ring_order_until_the_window_is_full() {
        let (mut s, now) = sender(8);
        for b in 0..6 {
            s.handle_filled(b, 10 + b, Delivery::Unconfirmed);
        }
        let w = writes(&mut s, now);
        let positions: Vec<usize> = w.iter().map(|x| x.2.position).collect();
        assert_eq!(positions, vec![0, 1, 2, 3], "a ring of 4 takes 4 blocks");
        assert_eq!(w[2].2.len, 12);
        assert_eq!(s.stats().window_full, 1);
        // Completions free the send blocks but not the ring: only ACKs do.
        for (id, _, _) in &w {
            assert!(s.handle_write_completed(*id));
        }
        assert_eq!(std::iter::from_fn(|| s.poll_freed()).count(), 4);
        assert!(writes(&mut s, now).is_empty());
        s.handle_ack(now, w[0].2).unwrap();
        assert_eq!(s.head(), 1);
        let next = writes(&mut s, now);
        assert_eq!(next.len(), 1);
        assert_eq!(
            next[0].2.position, 0,
            "the tail wraps round to the freed block"
        );
    }

    #[test]
    fn an_unacknowledged_block_holds_the_head_and_stalls_the_window() {
        let (mut s, now) = sender(8);
        for b in 0..4 {
            s.handle_filled(b, 10, Delivery::Unconfirmed);
        }
        let w = writes(&mut s, now);
        for (id, _, _) in &w {
            s.handle_write_completed(*id);
        }
        // The receiver keeps block 1 and acknowledges the others, out of order.
        for k in [3, 2, 0] {
            s.handle_ack(now, w[k].2).unwrap();
        }
        assert_eq!(s.head(), 1, "the head stops at the kept block");
        assert_eq!(s.in_window(), 3);
        s.handle_filled(9, 10, Delivery::Unconfirmed);
        s.handle_filled(10, 10, Delivery::Unconfirmed);
        let one = writes(&mut s, now);
        assert_eq!(
            one.len(),
            1,
            "only the block freed before the kept one is reused"
        );
        assert!(writes(&mut s, now).is_empty());
        // Releasing the kept block moves the head past everything acknowledged behind it.
        s.handle_ack(now, w[1].2).unwrap();
        assert_eq!(s.head(), 0);
        assert_eq!(s.stats().released, 4);
        assert_eq!(writes(&mut s, now).len(), 1);
    }

    #[test]
    fn acks_are_checked_against_the_window() {
        let (mut s, now) = sender(8);
        s.handle_filled(0, 10, Delivery::Unconfirmed);
        let w = writes(&mut s, now);
        assert_eq!(
            s.handle_ack(
                now,
                Immediate {
                    position: 1,
                    len: 10
                }
            ),
            Err(WindowError::UnexpectedAck { position: 1 })
        );
        assert!(
            s.handle_ack(
                now,
                Immediate {
                    position: 0,
                    len: 11
                }
            )
            .is_err()
        );
        assert!(
            s.handle_ack(
                now,
                Immediate {
                    position: 9,
                    len: 10
                }
            )
            .is_err()
        );
        s.handle_ack(now, w[0].2).unwrap();
        assert!(s.handle_ack(now, w[0].2).is_err(), "twice");
        // Acknowledged before its completion arrived: released only once it completes.
        assert_eq!(s.head(), 0);
        s.handle_write_completed(w[0].0);
        assert_eq!(s.head(), 1);
        assert_eq!(s.poll_freed(), Some(0));
        assert!(s.is_idle());
    }

    #[test]
    fn outstanding_writes_are_bounded() {
        let (mut s, now) = sender(2);
        for b in 0..4 {
            s.handle_filled(b, 10, Delivery::Unconfirmed);
        }
        let w = writes(&mut s, now);
        assert_eq!(w.len(), 2);
        s.handle_write_completed(w[0].0);
        assert_eq!(writes(&mut s, now).len(), 1);
    }

    #[test]
    fn lossless_messages_are_kept_until_the_head_passes_their_last_block() {
        let (mut s, now) = sender(8);
        s.handle_filled(0, 10, Delivery::Confirmed { last: false });
        s.handle_filled(1, 10, Delivery::Confirmed { last: true });
        let w = writes(&mut s, now);
        for (id, _, _) in &w {
            s.handle_write_completed(*id);
        }
        s.handle_ack(now, w[0].2).unwrap();
        assert_eq!(
            s.poll_freed(),
            None,
            "the first block alone confirms nothing"
        );
        s.handle_ack(now, w[1].2).unwrap();
        let mut freed: Vec<usize> = std::iter::from_fn(|| s.poll_freed()).collect();
        freed.sort();
        assert_eq!(freed, vec![0, 1]);
        assert!(s.is_idle());
    }

    #[test]
    fn a_drop_sends_unfinished_work_again_in_fill_order_into_a_fresh_ring() {
        let (mut s, now) = sender(8);
        s.handle_filled(0, 10, Delivery::Unconfirmed);
        s.handle_filled(1, 10, Delivery::Confirmed { last: true });
        s.handle_filled(2, 10, Delivery::Unconfirmed);
        let w = writes(&mut s, now);
        // Block 0 and the lossless block 1 completed; block 2 did not; nothing acknowledged.
        s.handle_write_completed(w[0].0);
        s.handle_write_completed(w[1].0);
        assert_eq!(s.poll_freed(), Some(0));
        s.handle_disconnected();
        assert_eq!(s.stats().requeued, 2);
        s.handle_connected(RING);
        let again = writes(&mut s, now);
        let blocks: Vec<(usize, usize)> = again.iter().map(|x| (x.1, x.2.position)).collect();
        assert_eq!(blocks, vec![(1, 0), (2, 1)]);
    }

    #[test]
    fn receiver_posts_a_receive_per_block_and_acks_in_its_own_order() {
        let mut r = WindowReceiver::new(RING);
        assert_eq!(r.poll_action(), Some(ReceiverAction::PostRecv { count: 4 }));
        assert_eq!(r.posted_receives(), 4);
        let imms: Vec<u32> = (0..3)
            .map(|p| {
                Immediate {
                    position: p,
                    len: 20,
                }
                .encode()
            })
            .collect();
        for imm in &imms {
            r.handle_received(*imm).unwrap();
            assert_eq!(r.poll_action(), Some(ReceiverAction::PostRecv { count: 1 }));
        }
        assert_eq!(
            r.posted_receives(),
            4,
            "each consumed receive is posted again"
        );
        r.handle_processed(1, true);
        r.handle_processed(2, false);
        r.handle_processed(0, false);
        let acks: Vec<usize> = std::iter::from_fn(|| r.poll_action())
            .map(|a| match a {
                ReceiverAction::SendAck(i) => i.position,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(acks, vec![2, 0], "the kept block is not acknowledged");
        assert_eq!(r.holding(), 1);
        r.handle_released(1);
        assert_eq!(
            r.poll_action(),
            Some(ReceiverAction::SendAck(Immediate {
                position: 1,
                len: 20
            }))
        );
        assert_eq!(r.stats().acks, 3);
    }

    #[test]
    fn receiver_refuses_blocks_out_of_ring_order_or_into_a_held_block() {
        let mut r = WindowReceiver::new(RemoteLayout {
            blocks: 2,
            block_size: 64,
        });
        let at = |p| {
            Immediate {
                position: p,
                len: 8,
            }
            .encode()
        };
        assert_eq!(
            r.handle_received(at(1)),
            Err(WindowError::OutOfOrder {
                position: 1,
                expected: 0
            })
        );
        r.handle_received(at(0)).unwrap();
        r.handle_received(at(1)).unwrap();
        // Block 0 is not acknowledged: a sender writing it again broke the window.
        assert!(r.handle_received(at(0)).is_err());
        assert!(
            r.handle_received(
                Immediate {
                    position: 0,
                    len: 65
                }
                .encode()
            )
            .is_err()
        );
    }

    #[test]
    fn sender_and_receiver_run_a_ring_together() {
        let (mut s, now) = sender(3);
        let mut r = WindowReceiver::new(RING);
        let mut delivered = Vec::new();
        let mut next = 0usize;
        let mut free: VecDeque<usize> = (0..3).collect();
        while delivered.len() < 40 {
            while let Some(b) = free.pop_front() {
                if next < 40 {
                    s.handle_filled(b, next % 50, Delivery::Unconfirmed);
                    next += 1;
                }
            }
            let w = writes(&mut s, now);
            for (id, _, imm) in &w {
                let got = r.handle_received(imm.encode()).unwrap();
                delivered.push(got.len);
                s.handle_write_completed(*id);
                r.handle_processed(got.position, false);
            }
            while let Some(a) = r.poll_action() {
                if let ReceiverAction::SendAck(imm) = a {
                    s.handle_ack(now, Immediate::from_ack(&imm.to_ack()).unwrap())
                        .unwrap();
                }
            }
            free.extend(std::iter::from_fn(|| s.poll_freed()));
        }
        assert_eq!(delivered, (0..40).map(|k| k % 50).collect::<Vec<_>>());
        assert!(s.is_idle());
        assert_eq!(r.holding(), 0);
    }
}
