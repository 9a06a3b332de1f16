//! The sender's threads: one filling thread (frames → send blocks, numbered per device) and one
//! sending thread (drives [`SenderMachine`] over one [`Connection`] shared by all devices,
//! reconnecting with backoff). Sources push into per-device queues ([`DeviceInput`]). Over
//! connections whose work completes as it is posted (shm, mem) a source committing a frame, or
//! the filling thread handing over a block already in the receiver's memory, drives the
//! connection itself while the sending thread is not at work (`SendState`, `Handoff`).
//!
//! With [`SenderOptions::sliding_window`] the sending thread runs the sliding-window baseline
//! instead ([`window`]): one connection per device, over the same filling thread and send blocks.

mod window;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Select, SendTimeoutError, Sender, TryRecvError, TrySendError};
use parking_lot::MutexGuard;

use super::{FrameData, FrameMeta, SourceFrame};
use crate::error::{Error, Result, spawn};
use crate::proto::coalesce::{self, Batch, Coalescer};
use crate::proto::handshake::{DataPath, Hello, Key, NONCE_LEN, PROTOCOL_VERSION, QpInfo};
use crate::proto::{
    Added, Delivery, FillingMachine, HEADER_LEN, Lent, Message, MessageKind, MessageTimes, NO_PTS,
    Placement, SenderMachine, SenderStats, fragment_range,
};
use crate::stats::{DeviceCounters, Registry, unix_now_ns};
use crate::transport::{Connection, Connector, LeasedBlock, SendBlocks};

/// What happens when a device's queue is full because the link or the receiver is slower than
/// the source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DropPolicy {
    /// Live: drop the oldest queued frame, count it, keep the newest (default). A frame that
    /// finds the queue full waits at most [`DROP_OLDEST_PATIENCE`] for room first.
    #[default]
    DropOldest,
    /// Lossless: the source waits.
    Block,
}

/// Sender settings.
#[derive(Debug, Clone)]
pub struct SenderOptions {
    /// Scopes this sender's output on the receiver.
    pub name: String,
    /// The key this sender proves it knows (and requires the receiver to prove); `None` for an
    /// anonymous receiver.
    pub key: Option<Key>,
    /// Number of local send blocks (S).
    pub send_blocks: usize,
    /// Bytes per send block; must not exceed the receiver's block size.
    pub block_size: usize,
    /// Write chains posted at once before waiting for completions.
    pub max_outstanding: usize,
    /// First and longest wait between reconnect attempts.
    pub reconnect_min: Duration,
    pub reconnect_max: Duration,
    /// First packet number of every device (0 normally; tests start near 65535 to see the
    /// numbers wrap).
    pub first_packet: u16,
    /// Run the sliding-window baseline (one connection per device, WRITE WITH IMMEDIATE and
    /// ACKs) instead of the status-byte mechanism; the receiver must run it too.
    pub sliding_window: bool,
    /// How long a small lossy message may wait for others to share its block (layout version
    /// 2, docs/protocol.md "Coalesced blocks"); zero turns coalescing off. Ignored for the
    /// sliding window.
    pub coalesce_wait: Duration,
    /// Send blocks set aside for frames sources write in place ([`DeviceInput::reserve`]):
    /// the last `in_place_blocks` of them. Reservations never take one of the others, and the
    /// filling thread borrows one only when none of its own is free, never waiting for it: a
    /// committed frame waiting in a queue can never hold a block the filling thread needs to
    /// get to it (docs/protocol.md, "Frames written in place"). Zero (the default): `reserve`
    /// answers [`NotReserved::Unavailable`]. Must leave at least one block for the filling
    /// thread.
    ///
    /// When it is not zero, and the transport maps the receiver's memory (shm), the sending
    /// thread also lends up to a quarter of the receiver's blocks, while free, to reservations of
    /// lossy devices, which take those first, and to the filling thread for lossy messages: the
    /// frame is written straight into the receiver's block and only its status byte is posted
    /// (docs/protocol.md, "Frames written into the receiver's memory").
    pub in_place_blocks: usize,
}

impl Default for SenderOptions {
    fn default() -> Self {
        SenderOptions {
            name: "sender".into(),
            key: None,
            send_blocks: 8,
            block_size: 1 << 20,
            max_outstanding: 4,
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(5),
            first_packet: 0,
            sliding_window: false,
            coalesce_wait: Duration::ZERO,
            in_place_blocks: 0,
        }
    }
}

enum Msg {
    Frame(SourceFrame),
    /// A frame a source wrote into a reserved send block (see [`DeviceInput::reserve`]).
    Reserved(Committed),
    End,
}

/// A committed reservation on its way to the filling thread: send block `block` (one of the
/// in-place blocks), or the lent receiver's block in `lent`, holds the frame's `len` payload
/// bytes after the header room.
struct Committed {
    block: usize,
    len: usize,
    meta: FrameMeta,
    lent: Option<LentBlock>,
}

impl Committed {
    /// The frame's times, as the filling machine plans them.
    fn times(&self) -> MessageTimes {
        MessageTimes {
            timestamp_ns: self.meta.timestamp_ns,
            duration_ns: self.meta.duration_ns,
            pts_ns: self.meta.pts_ns.unwrap_or(NO_PTS),
        }
    }
}

/// A receiver's memory block the sending thread lent out (shm): the source writes the payload
/// into it, the filling (or committing) thread the header and seal, and whoever drives the
/// connection ([`SendState`]) posts its status byte.
struct LentBlock {
    lent: Lent,
    lease: Box<dyn LeasedBlock>,
}

/// The lent receiver's blocks nobody has taken yet, shared by the sending thread (which offers
/// and takes back) and the devices' reservations (which take, and give back unused ones).
#[derive(Clone)]
struct LentBlocks {
    tx: Sender<LentBlock>,
    rx: Receiver<LentBlock>,
    /// The connection the offered blocks belong to (`Lent::epoch`); 0 while disconnected.
    epoch: Arc<AtomicU64>,
    /// The sending thread lends on this connection, but none now: blocks queued before need
    /// the receiver's free blocks first ([`crate::proto::sender::SenderMachine::lending_waits_on_queue`],
    /// as of its last turn). A reservation then waits a moment for a lent block
    /// ([`LENT_PATIENCE`]).
    waits_on_queue: Arc<AtomicBool>,
}

impl LentBlocks {
    fn new() -> LentBlocks {
        let (tx, rx) = crossbeam_channel::unbounded();
        LentBlocks {
            tx,
            rx,
            epoch: Arc::new(AtomicU64::new(0)),
            waits_on_queue: Arc::new(AtomicBool::new(false)),
        }
    }

    /// A block lent on the current connection, if one is on offer (older ones are dropped:
    /// their connection is gone).
    fn take(&self) -> Option<LentBlock> {
        let epoch = self.epoch.load(Ordering::Acquire);
        self.rx.try_iter().find(|b| b.lent.epoch == epoch)
    }

    /// Offers a lent block (again).
    fn offer(&self, block: LentBlock) {
        let _ = self.tx.send(block);
    }
}

/// Where a send block goes once it is free again: the filling thread's free list, or (for the
/// last `in_place` blocks, [`SenderOptions::in_place_blocks`]) the reservations' one.
#[derive(Clone)]
struct FreeLists {
    filling: Sender<usize>,
    in_place: Sender<usize>,
    /// The first in-place block (the block count when there are none).
    first_in_place: usize,
    /// How many of the filling thread's own blocks it starts messages in while others are in
    /// use (filled, queued, in flight or waiting for a confirmation): all of them, or fewer
    /// under the connection's cache budget ([`crate::transport::SendLimits::filling`], set by
    /// the sending thread on connecting), so that the blocks it fills are still cached when
    /// they are sent;
    /// it then also takes the most recently freed block first.
    in_use_limit: Arc<AtomicUsize>,
    /// How many in-place blocks a live device's reservations keep in use at most
    /// ([`crate::transport::SendLimits::live_in_place`]; `usize::MAX`: no limit), set by the
    /// sending thread on connecting.
    live_in_place_limit: Arc<AtomicUsize>,
}

impl FreeLists {
    fn release(&self, block: usize) {
        let list = if block >= self.first_in_place {
            &self.in_place
        } else {
            &self.filling
        };
        let _ = list.send(block);
    }
}

/// What [`take_within`] found.
enum FreeBlock {
    Taken(usize),
    /// The limit's worth in use.
    Limited,
    /// None free.
    None,
}

/// Takes a block off a free list under a limit on blocks in use, the rule both limited lists
/// share (the filling thread's own blocks, [`FreeLists::in_use_limit`]; a live device's in-place
/// blocks, [`FreeLists::live_in_place_limit`]): `free` holds the free ones of `total`, oldest
/// first. Without a limit (`usize::MAX`) the oldest is taken; under one the most recently freed
/// (the one most likely still cached), and none while the limit's worth is in use and the taker
/// `holds` to it.
fn take_within(
    free: &mut std::collections::VecDeque<usize>,
    total: usize,
    limit: usize,
    holds: bool,
) -> FreeBlock {
    if holds && total.saturating_sub(free.len()) >= limit {
        return FreeBlock::Limited;
    }
    let next = if limit == usize::MAX {
        free.pop_front()
    } else {
        free.pop_back()
    };
    next.map_or(FreeBlock::None, FreeBlock::Taken)
}

/// Why [`DeviceInput::reserve`] gave no send block; the source copies the frame instead
/// ([`DeviceInput::push`]), or tries again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotReserved {
    /// The frame does not fit in one send block with its header and trailer.
    TooLarge,
    /// The sender sets no send blocks aside for frames written in place
    /// ([`SenderOptions::in_place_blocks`] is zero).
    Unavailable,
    /// No in-place block came free within the timeout (they are all held by sources, or by
    /// frames on their way: the link is slower than the sources).
    TimedOut,
    /// The sender stopped: nothing will be sent any more.
    Stopped,
}

/// One send block taken for a source to write a frame's payload straight into (the memory the
/// transport sends from), then [`commit`](Reservation::commit) it: the header and seal are
/// written around it in place (by the filling thread, or by `commit` itself), so the frame is
/// never copied. Dropped uncommitted, the block goes back to the free list.
pub struct Reservation {
    block: usize,
    len: usize,
    lease: Option<Box<dyn LeasedBlock>>,
    /// A receiver's block lent over shm (then `lease` maps it), not one of the send blocks.
    lent: Option<Lent>,
    input: DeviceInput,
    /// The reservation found no block free at once and waited for one.
    waited: bool,
}

impl Reservation {
    /// Which send block this is (for a block of the receiver's memory, which remote block).
    pub fn block(&self) -> usize {
        self.block
    }

    /// True when this is a block of the receiver's memory itself (over shm): the frame is
    /// written once, straight where the receiver reads it.
    pub fn is_remote(&self) -> bool {
        self.lent.is_some()
    }

    /// True when [`DeviceInput::reserve`] found no block free at once and waited for this one
    /// (a zero timeout never waits).
    pub fn waited(&self) -> bool {
        self.waited
    }

    /// The payload's length in bytes (as reserved).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty payload.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The payload area: bytes `HEADER_LEN..HEADER_LEN + len` of the block.
    pub fn payload(&self) -> &[u8] {
        let lease = self.lease.as_ref().expect("held until commit or drop");
        &lease.bytes()[HEADER_LEN..HEADER_LEN + self.len]
    }

    /// The payload area, to write the frame into (holds whatever the block carried before).
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let lease = self.lease.as_mut().expect("held until commit or drop");
        &mut lease.bytes_mut()[HEADER_LEN..HEADER_LEN + self.len]
    }

    /// Hands the written frame on, in order with the device's other frames: straight to the
    /// sending thread, sealed here, when the filling thread has nothing to do for it (a lossy
    /// device, no format due, nothing of the device queued; see `DeviceInput::commit_direct`),
    /// otherwise to the filling thread under the device's queue policy (like
    /// [`DeviceInput::push`]). False once the sender has shut down (the block is then simply
    /// let go).
    pub fn commit(mut self, meta: FrameMeta) -> bool {
        // Let go of a send block first: the filling thread locks it to write header and seal.
        // A lent receiver's block goes along with the frame.
        let lease = self.lease.take();
        let committed = Committed {
            block: self.block,
            len: self.len,
            meta,
            lent: self
                .lent
                .zip(lease)
                .map(|(lent, lease)| LentBlock { lent, lease }),
        };
        if self.input.stopped.load(Ordering::Acquire) {
            return false; // nothing will be taken any more
        }
        let sent = match self.input.commit_direct(committed) {
            Ok(sent) => {
                if sent {
                    self.input.counters.direct.fetch_add(1, Ordering::Relaxed);
                }
                sent
            }
            Err(committed) => self.input.send(Msg::Reserved(committed)),
        };
        if sent {
            self.input.counters.in_place.fetch_add(1, Ordering::Relaxed);
        }
        sent
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            // Abandoned: the block was never handed over, it is free again (a lent receiver's
            // block is offered again; its status byte was never written).
            match self.lent {
                Some(lent) => self.input.lent.offer(LentBlock { lent, lease }),
                None => {
                    let _ = self.input.free_tx.send(self.block);
                }
            }
        }
    }
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Reservation(block {}, {} bytes)", self.block, self.len)
    }
}

/// A device's input queue. Clone it into the source thread.
#[derive(Clone)]
pub struct DeviceInput {
    device: u8,
    policy: DropPolicy,
    tx: Sender<Msg>,
    rx: Receiver<Msg>,
    counters: Arc<DeviceCounters>,
    /// Set once the sender stopped (finished, failed or aborted): nothing will be taken any more.
    stopped: Arc<AtomicBool>,
    /// The send blocks, and the free list of the in-place ones, for reservations.
    blocks: Arc<SendBlocks>,
    free_rx: Receiver<usize>,
    free_tx: Sender<usize>,
    /// Free in-place blocks taken off `free_rx` by reservations, oldest first: under the
    /// connection's limit on a live device's in-place blocks, all of them (to take the most
    /// recently freed); else at most the one a waiting reservation received
    /// ([`DeviceInput::take_free`]).
    stash: Arc<parking_lot::Mutex<std::collections::VecDeque<usize>>>,
    /// How many blocks are set aside for reservations.
    in_place_blocks: usize,
    /// Receiver's blocks lent out (shm), taken first by reservations of a lossy device.
    lent: LentBlocks,
    /// A lossless device: its frames are kept until confirmed, so never written into a lent
    /// receiver's block (the sender would hold no copy to send again).
    reliable: bool,
    /// For sealing a committed frame here and handing it straight to the sending thread.
    direct: Direct,
    /// What this input and the filling thread share about its queue.
    queue: Arc<QueueState>,
}

/// What a device input and the filling thread share about the input's queue.
#[derive(Default)]
struct QueueState {
    /// Set by the filling thread while it reads this input's queue (false before, while the
    /// device's number still streams for an earlier input, and after its end).
    admitted: AtomicBool,
    /// Messages of this input on their way to the filling thread and not yet planned by it:
    /// counted up before a message goes into the queue, down once the filling thread has
    /// planned it (under the filler lock), dropped it from the queue, or it never went in. A
    /// committed frame goes straight to the sending thread only while this is 0. The queue's
    /// own emptiness cannot say so: the filling thread's select claims a message before it
    /// takes the lock to plan it, so the queue looks empty while that message is still
    /// unplanned, and a frame committed in that moment was numbered before a frame pushed
    /// ahead of it (delivered out of order: 1 run in 40–100 of
    /// `reserved_frames_over_shm_are_written_into_the_receivers_blocks` beside CPU hogs).
    unplanned: AtomicUsize,
    /// The capture timestamp of the frame a `drop-oldest` device handed in last through
    /// [`DeviceInput::push_writing_here`] (0 before the first).
    last_ts: AtomicU64,
}

impl QueueState {
    /// Counts a message unplanned for as long as `enqueue` takes to put it in the queue, and
    /// for good if it went in (`enqueue` returns whether it did).
    fn counted(&self, enqueue: impl FnOnce() -> bool) -> bool {
        self.unplanned.fetch_add(1, Ordering::AcqRel);
        let queued = enqueue();
        if !queued {
            self.planned();
        }
        queued
    }

    fn planned(&self) {
        self.unplanned.fetch_sub(1, Ordering::Release);
    }
}

/// The filling thread's planning state, shared with committing sources: a lossy device's
/// committed frame whose plan needs nothing of the filling thread (no format ahead of it, no
/// message of the device queued before it, no small messages held) is sealed on the committing
/// thread and handed straight to the sending thread, one thread hand-over less per frame
/// (docs/protocol.md, "Frames written in place").
struct Filler {
    machine: FillingMachine,
    /// Connection drops the machine has been told of.
    drops_seen: u64,
    /// The coalescer holds small messages, which a committed frame must follow.
    holding: bool,
}

/// What a committing source needs for the direct hand-over (see [`Filler`]).
#[derive(Clone)]
struct Direct {
    filler: Arc<parking_lot::Mutex<Filler>>,
    filled: Handoff,
    free: FreeLists,
    placement: Placement,
    /// Connection drops so far (the filling thread's `drops`).
    drops: Arc<AtomicU64>,
}

impl DeviceInput {
    /// Device number.
    pub fn device(&self) -> u8 {
        self.device
    }

    /// Send blocks the sender sets aside for frames written in place
    /// ([`SenderOptions::in_place_blocks`]); zero: [`reserve`](Self::reserve) refuses.
    pub fn in_place_blocks(&self) -> usize {
        self.in_place_blocks
    }

    /// Queues a frame under the device's policy. Returns false once the sender has shut down.
    pub fn push(&self, frame: SourceFrame) -> bool {
        self.send(Msg::Frame(frame))
    }

    /// Like [`push`](Self::push), but a frame the source renders ([`FrameData::Render`]) is
    /// rendered here, on the caller's thread, straight into a reserved send block, and
    /// committed: so several sources render side by side instead of in turn on the filling
    /// thread, and still without a copy. When no in-place block is free right now (or the
    /// sender sets none aside, or the frame needs more than one block) the frame is pushed and
    /// the filling thread renders it once one of its blocks comes free: a source never waits
    /// here longer than a push would make it. Returns false once the sender has shut down.
    pub fn push_rendering_here(&self, frame: SourceFrame) -> bool {
        if !matches!(frame.data, FrameData::Render(_)) {
            return self.push(frame);
        }
        self.push_writing_here(frame)
    }

    /// Like [`push_rendering_here`](Self::push_rendering_here) for any frame: one the source
    /// renders is rendered here, one it hands over as bytes (a GStreamer sample) is copied here,
    /// straight into a reserved block, and committed; so over shm, whenever the sending thread
    /// has a receiver's block on offer, the frame is copied once, into the receiver's memory,
    /// without a hand-over to the filling thread. When no block is free right now (or none are
    /// set aside, or the frame needs more than one block) the frame is pushed; so is a frame of
    /// bytes while earlier messages of the device still wait in its queue: a source that runs
    /// ahead of the sender keeps the filling thread copying beside it (copying here then, each
    /// commit queued behind the pushed frames, took 1.6× the CPU per MB at 1 MiB over shm).
    ///
    /// A `drop-oldest` device's frame that comes while the device's previous frame is still on
    /// its way (neither fully written nor dropped: the link is behind this source) waits up to
    /// [`DROP_OLDEST_PATIENCE`] for a block before it is pushed, so a source faster than the link
    /// leaves the threads that free blocks their turn instead of filling the queue. When the
    /// previous frame is through and the blocks are busy with other devices' frames (cameras
    /// falling due together), the frame is pushed at once, as a `block` device's is. Returns
    /// false once the sender has shut down.
    pub fn push_writing_here(&self, frame: SourceFrame) -> bool {
        // Only a drop-oldest device asks (and keeps `last_ts`).
        let behind = self.policy == DropPolicy::DropOldest && self.behind(frame.timestamp_ns);
        if matches!(frame.data, FrameData::Bytes(_))
            && self.queue.unplanned.load(Ordering::Acquire) != 0
        {
            return self.push(frame);
        }
        let patience = if behind {
            DROP_OLDEST_PATIENCE
        } else {
            Duration::ZERO
        };
        match self.reserve(frame.data.len(), patience) {
            Ok(mut r) => {
                frame.data.write(0, r.payload_mut());
                r.commit(FrameMeta {
                    index: frame.index,
                    timestamp_ns: frame.timestamp_ns,
                    duration_ns: frame.duration_ns,
                    pts_ns: frame.pts_ns,
                    format: frame.format,
                })
            }
            Err(NotReserved::Stopped) => false,
            Err(_) => self.push(frame),
        }
    }

    /// Notes `ts` as the capture timestamp of the frame handed in last, and says whether the
    /// one handed in before it (at an earlier timestamp) is still on its way: no frame of this
    /// device captured at or after it is fully written or dropped yet (`done_ts`). A frame lost
    /// without being counted (a connection that went) holds this for one frame at most: the
    /// next one through moves `done_ts` past it. Frames with equal timestamps count as through
    /// together; a source that gives none (0) is never behind.
    fn behind(&self, ts: u64) -> bool {
        let previous = self.queue.last_ts.swap(ts, Ordering::AcqRel);
        previous != 0 && self.counters.done_ts.load(Ordering::Acquire) < previous
    }

    /// Takes a free in-place send block ([`SenderOptions::in_place_blocks`]) for a frame of
    /// `len` bytes that the caller writes in place ([`Reservation::payload_mut`]) and then
    /// commits, instead of pushing a copy. Waits up to `timeout` for one to come free (zero:
    /// takes one only if one is free now). Only for frames that fit in one block.
    ///
    /// Over shm a lossy device's reservation takes one of the receiver's own blocks first, when
    /// the sending thread has one on offer ([`Reservation::is_remote`]): the frame is then
    /// written once, into the receiver's memory. When it has none on offer because blocks
    /// queued before wait for the receiver's free blocks, the reservation waits for one at most
    /// [`LENT_PATIENCE`] (and `timeout`) before it takes a send block.
    ///
    /// Under the connection's limit on a live device's in-place blocks in use
    /// ([`crate::transport::SendLimits::live_in_place`], tcp from 2 to 4 MiB blocks), a live
    /// device's reservation that finds the limit's worth in use waits for one to come back, at
    /// most [`crate::transport::LIVE_IN_PLACE_PATIENCE`] (and `timeout`), then takes a free one
    /// anyway; with a zero timeout it takes a free one at once.
    pub fn reserve(&self, len: usize, timeout: Duration) -> Result<Reservation, NotReserved> {
        if self.in_place_blocks == 0 {
            return Err(NotReserved::Unavailable);
        }
        if len > crate::proto::payload_capacity(self.blocks.block_size()) {
            return Err(NotReserved::TooLarge);
        }
        let deadline = Instant::now() + timeout;
        // Since when a free block waits for one in use to come back (the limit).
        let mut limited_since: Option<Instant> = None;
        // Whether this reservation has waited its moment for a lent block.
        let mut waited_for_lent = false;
        // Whether it blocked at all (for `Reservation::waited`).
        let mut waited = false;
        loop {
            if self.stopped.load(Ordering::Acquire) {
                return Err(NotReserved::Stopped);
            }
            // A block free now is taken even with a zero timeout.
            if let Some(mut r) = self.take_lent(len) {
                r.waited = waited;
                return Ok(r);
            }
            // The sending thread lends none while blocks queued before wait for the receiver's
            // free ones: a moment's wait for a lent block beats one more copied and queued.
            if !self.reliable
                && !waited_for_lent
                && self.lent.waits_on_queue.load(Ordering::Relaxed)
            {
                waited_for_lent = true;
                let wait = LENT_PATIENCE.min(deadline.saturating_duration_since(Instant::now()));
                if !wait.is_zero() {
                    waited = true;
                    if let Ok(b) = self.lent.rx.recv_timeout(wait) {
                        // Offer it again: `take_lent` checks its connection.
                        self.lent.offer(b);
                    }
                    continue;
                }
            }
            // Under a limit on in-place blocks in use, a reservation that would not wait takes a
            // free block at once too: rendering in place beats the copy its caller falls back to.
            let patience = crate::transport::LIVE_IN_PLACE_PATIENCE;
            let patient =
                !timeout.is_zero() && limited_since.is_none_or(|t| t.elapsed() < patience);
            match self.take_free(patient) {
                FreeBlock::Taken(block) => {
                    let mut r = self.local(block, len);
                    r.waited = waited;
                    return Ok(r);
                }
                FreeBlock::Limited => {
                    limited_since.get_or_insert_with(Instant::now);
                }
                FreeBlock::None => limited_since = None,
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(NotReserved::TimedOut);
            }
            let mut wait = (deadline - now).min(Duration::from_millis(50));
            if let Some(t) = limited_since {
                wait = wait.min(patience.saturating_sub(t.elapsed()));
            }
            waited = true;
            let mut sel = Select::new();
            sel.recv(&self.free_rx);
            if !self.reliable {
                sel.recv(&self.lent.rx);
            }
            match sel.select_timeout(wait) {
                Ok(op) if op.index() == 0 => {
                    if let Ok(block) = op.recv(&self.free_rx) {
                        self.stash.lock().push_back(block);
                    }
                }
                Ok(op) => {
                    if let Ok(b) = op.recv(&self.lent.rx) {
                        // Offer it again: `take_lent` checks its connection.
                        self.lent.offer(b);
                    }
                }
                Err(_) => {}
            }
        }
    }

    /// Seals committed frame `c` here and hands it straight to the sending thread, when nothing
    /// needs the filling thread first (see [`Filler`]): Ok(false) once the sender stops. Gives
    /// `c` back otherwise (the planning state busy, a message of this device queued, small
    /// messages held, a format due, a connection drop not yet planned for), and the caller
    /// queues it. A lossless device's frame goes direct too: its block is kept until confirmed
    /// by the sending machine ([`Filled::reliable`]), which the filling thread has no part in.
    fn commit_direct(&self, mut c: Committed) -> Result<bool, Committed> {
        // Busy means the filling thread is at work, maybe on this device: queue behind it.
        let Some(mut f) = self.direct.filler.try_lock() else {
            return Err(c);
        };
        // The filling thread plans a message only while it holds the lock and counts it
        // planned before it lets go, so 0 here means every earlier message of this device is
        // planned (see `QueueState::unplanned`).
        if !self.queue.admitted.load(Ordering::Acquire)
            || self.queue.unplanned.load(Ordering::Acquire) != 0
            || f.holding
            || f.drops_seen != self.direct.drops.load(Ordering::Acquire)
            || !f.machine.frame_alone(self.device, &c.meta.format)
        {
            return Err(c);
        }
        let plan = f
            .machine
            .frame(self.device, &c.meta.format, c.meta.index, c.len, c.times());
        debug_assert!(plan.format.is_none(), "frame_alone said no format is due");
        let d = &self.direct;
        // Handed over under the lock, so the sending thread gets this device's blocks in
        // packet order.
        Ok(seal_committed(
            &self.blocks,
            &d.filled,
            &d.free,
            plan.frame,
            &mut c,
            d.placement,
        ))
    }

    /// A free in-place block, if one may be taken now: without a limit the one freed first;
    /// under the connection's [`crate::transport::SendLimits::live_in_place`] (a live device
    /// only: a lossless one keeps its blocks until a sync), the one freed last (still cached),
    /// and only while fewer than the limit are in use, unless the reservation is out of
    /// `patience` (then the limit is passed: a source holding its buffers never waits for ever).
    fn take_free(&self, patient: bool) -> FreeBlock {
        let limit = if self.reliable {
            usize::MAX
        } else {
            self.direct.free.live_in_place_limit.load(Ordering::Relaxed)
        };
        let mut stash = self.stash.lock();
        if limit == usize::MAX {
            // One at a time: the others stay on the list, for the filling thread to borrow.
            if stash.is_empty()
                && let Ok(block) = self.free_rx.try_recv()
            {
                stash.push_back(block);
            }
        } else {
            stash.extend(self.free_rx.try_iter());
        }
        // Held by the limit only while a block is free (the patience counts from then).
        if stash.is_empty() {
            return FreeBlock::None;
        }
        take_within(&mut stash, self.in_place_blocks, limit, patient)
    }

    /// A reservation of in-place send block `block`.
    fn local(&self, block: usize, len: usize) -> Reservation {
        Reservation {
            block,
            len,
            lease: Some(self.blocks.lease(block)),
            lent: None,
            input: self.clone(),
            waited: false,
        }
    }

    /// A reservation of a receiver's block the sending thread has on offer, for a lossy device.
    fn take_lent(&self, len: usize) -> Option<Reservation> {
        if self.reliable {
            return None;
        }
        let LentBlock { lent, lease } = self.lent.take()?;
        Some(Reservation {
            block: lent.remote_block,
            len,
            lease: Some(lease),
            lent: Some(lent),
            input: self.clone(),
            waited: false,
        })
    }

    /// Drops the oldest queued message to make room (drop-oldest); a committed reservation's
    /// block goes back to the free list.
    fn drop_oldest(&self) {
        let dropped = self.rx.try_recv();
        if dropped.is_ok() {
            self.queue.planned();
        }
        match dropped {
            // Only frames are ever queued before End, so this drops a frame.
            Ok(Msg::Frame(f)) => self.counters.dropped_at(f.timestamp_ns),
            Ok(Msg::Reserved(c)) => {
                match c.lent {
                    Some(b) => self.lent.offer(b),
                    None => {
                        let _ = self.free_tx.send(c.block);
                    }
                }
                self.counters.dropped_at(c.meta.timestamp_ns);
            }
            Ok(Msg::End) | Err(_) => {}
        }
    }

    fn send(&self, msg: Msg) -> bool {
        self.queue.counted(|| self.enqueue(msg))
    }

    /// Puts `msg` in the queue under the device's policy (see [`send`](Self::send)).
    fn enqueue(&self, msg: Msg) -> bool {
        match self.policy {
            DropPolicy::Block => {
                let mut msg = msg;
                loop {
                    match self.tx.send_timeout(msg, Duration::from_millis(50)) {
                        Ok(()) => return true,
                        Err(SendTimeoutError::Disconnected(_)) => return false,
                        Err(SendTimeoutError::Timeout(m))
                            if !self.stopped.load(Ordering::Acquire) =>
                        {
                            msg = m
                        }
                        Err(SendTimeoutError::Timeout(_)) => return false,
                    }
                }
            }
            DropPolicy::DropOldest => {
                // A moment's wait for room before a queued frame is dropped for this one
                // (`DROP_OLDEST_PATIENCE`): the source gives the threads emptying the queue
                // their turn.
                let mut msg = match self.tx.send_timeout(msg, DROP_OLDEST_PATIENCE) {
                    Ok(()) => return true,
                    Err(SendTimeoutError::Disconnected(_)) => return false,
                    Err(SendTimeoutError::Timeout(m)) => m,
                };
                loop {
                    match self.tx.try_send(msg) {
                        Ok(()) => return true,
                        Err(TrySendError::Disconnected(_)) => return false,
                        Err(TrySendError::Full(m)) => {
                            msg = m;
                            self.drop_oldest();
                        }
                    }
                }
            }
        }
    }

    /// Ends the device's stream: the receiver gets end-of-stream after the queued frames. Never
    /// waits long: under `drop-oldest` it drops a queued frame to make room; under `block` it
    /// waits up to a second (then the stream still ends once every clone of this input is
    /// dropped, after the queued frames).
    pub fn end(&self) {
        self.queue.counted(|| self.enqueue_end());
    }

    /// Puts the end of stream in the queue (see [`end`](Self::end)); false if it did not go in.
    fn enqueue_end(&self) -> bool {
        let mut msg = Msg::End;
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        loop {
            if self.stopped.load(Ordering::Acquire) {
                return false; // nothing will be sent any more
            }
            match self.tx.try_send(msg) {
                Ok(()) => return true,
                Err(TrySendError::Disconnected(_)) => return false,
                Err(TrySendError::Full(m)) => {
                    msg = m;
                    if self.policy == DropPolicy::DropOldest {
                        self.drop_oldest();
                    } else if std::time::Instant::now() >= deadline {
                        tracing::warn!(
                            device = self.device,
                            "queue still full after 1 s; the stream ends when the input is dropped"
                        );
                        return false;
                    } else {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
        }
    }
}

/// One filled send block, on its way from the filling to the sending thread.
#[derive(Debug, Clone, Copy)]
struct Filled {
    index: usize,
    len: usize,
    device: u8,
    /// A lossless device's block: kept until the receiver confirms its message.
    reliable: bool,
    /// The last block of its message.
    last: bool,
    /// Set on the last block of a frame: payload bytes and capture time, for stats.
    frame_end: Option<(usize, u64)>,
}

enum ToSending {
    Block(Filled),
    /// A lent receiver's block holds a whole block now (header, payload, seal): post its
    /// status byte, in order with the blocks around it. `frame_end` as in [`Filled`].
    Placed {
        lent: Lent,
        device: u8,
        frame_end: Option<(usize, u64)>,
    },
    /// A lent receiver's block the filling thread could not use: free again.
    Returned(Lent),
    /// The frames (device, payload bytes, capture time) of the coalesced block about to come
    /// in this send block, for stats; sent just before its `Block`.
    Frames(usize, Vec<(u8, usize, u64)>),
    /// Every device ended: finish what is queued, then close.
    Done,
}

/// The sending thread's state: the protocol machine with what it keeps about the blocks, the
/// connection, the driver. The sending thread holds it while it works and lets go of it while
/// it waits. A thread handing a block over that finds it free, on a connection whose work
/// completes as it is posted ([`Connection::completes_at_once`]: shm, mem), drives the
/// connection itself ([`Handoff::send`]): the block's status byte (and, for a block in a send
/// block, its copy) is then written on that thread, and the sending thread is woken only when
/// something is left for it. Over tcp ([`Connection::posts_here_when_idle`]) it does so only
/// for a sender's lone device on an idle link, and the sending thread is then woken to wait for
/// the completion. One machine, one connection, one driver either way: only which thread turns
/// it changes (docs/protocol.md, "Who drives the connection").
struct SendState {
    s: Sending,
    conn: Option<Box<dyn Connection>>,
    driver: super::Driver,
    /// Every device ended (the filling thread said so).
    done: bool,
    /// What a handing thread ran into while it drove the connection: the connection is gone,
    /// and the sending thread reconnects.
    failed: Option<Error>,
    /// Hand-overs taken in and driven on the handing thread ([`SenderReport::driven_here`]).
    driven_here: u64,
    /// When a turn last posted or completed something: the link is idle for a handing thread
    /// to post on ([`Connection::posts_here_when_idle`]) once that is
    /// [`IDLE_BEFORE_POSTING_HERE`] ago.
    busy_at: Instant,
    /// Devices added to this sender ([`SenderHandle::add_device_with`]): over tcp a handing
    /// thread posts only for a lone device ([`SendState::drives_here`]).
    devices: Arc<AtomicUsize>,
}

/// How long a link ([`Connection::posts_here_when_idle`]: tcp) must have posted and completed
/// nothing before a thread handing a block of a sender's lone device over may post it itself. A
/// frame at a camera's pace then goes out on the thread that made it, without waiting for the
/// sending thread to be woken and given a CPU: `rdmasink`/`rdmasrc` over tcp at 25 fps, p50
/// 1.19–1.70 → 0.95–1.23 ms, lower in 10 of 10 runs in turn (docs/benchmarks.md, "Posting on
/// the handing thread over tcp"). A busy link, whose blocks come faster than this, stays with
/// the sending thread, which writes while the source makes the next frame; so do senders of
/// several devices, where a source holding the connection through its writev held the others'
/// frames up (the demo's twelve cameras).
pub const IDLE_BEFORE_POSTING_HERE: Duration = Duration::from_millis(1);

/// Turns a handing thread takes at most on the connection before it lets go (each posts what
/// the machine has, hands back what completed and lends freed blocks again).
const TURNS_HERE: usize = 4;

/// How long a `drop-oldest` device's frame waits for room before something gives way: a frame
/// pushed into a full queue, before the oldest queued frame is dropped for it; an acquire from
/// the GStreamer buffer pool of send blocks, before upstream gets a plain buffer (copied) instead
/// of a block; `rdmasink`'s reservation of a block to copy a buffer from elsewhere into, before
/// it leaves the copy to the filling thread. Without it a source faster than the link never
/// waited: it took the core the filling and sending threads needed to empty the queue, and
/// frames went the long way (queued, copied) at a fraction of the rate: `rdmasink
/// drop-policy=drop-oldest` under an unthrottled `videotestsrc`, the sending process on one
/// core, moved 600–1250 frames/s at a p99 of 16–23 ms (docs/benchmarks.md, "A moment's wait under
/// drop-oldest"). A live source waits at most this per frame, a small part of any frame
/// interval. In [`DeviceInput::push_writing_here`] (a frame the source renders or copies itself)
/// only while the device's previous frame is still on its way: waiting there whenever no block
/// was free also held up 12 synthetic cameras falling due together, each with its previous frame
/// long through, and `bench cameras-shm`'s p50 rose from 0.35–0.48 to up to 1.02 ms.
pub const DROP_OLDEST_PATIENCE: Duration = Duration::from_millis(1);

/// How long a lossy device's reservation waits for a lent receiver's block while the sending
/// thread lends none because blocks queued before need the receiver's free ones
/// ([`crate::proto::sender::SenderMachine::lending_waits_on_queue`]; shm), before it takes a
/// send block of its own. Without the wait, a stream that fell behind once (a stall of a few
/// milliseconds) went on in send blocks, each copied into the receiver's memory by the sending
/// thread and queued behind the others, so the queue never emptied and the sender lent
/// nothing again for 10–40 ms at half the frame rate (docs/benchmarks.md, "Back to the receiver's blocks
/// after a stall"). Once per reservation, and never longer than its timeout (a zero timeout
/// does not wait).
pub const LENT_PATIENCE: Duration = Duration::from_millis(1);

impl SendState {
    fn intake(&mut self, ev: ToSending) {
        self.s.intake(ev, &mut self.done);
    }

    /// Takes in what waits in the sending thread's channel. Only with the state held: a
    /// handing thread puts a block into the state only when the channel is empty, so a block
    /// taken out of the channel must be in the machine before anyone can see the channel empty
    /// (else a block handed over after it could overtake it). A channel nobody can send to any
    /// more means every device ended.
    fn take_in(&mut self, rx: &Receiver<ToSending>) {
        loop {
            match rx.try_recv() {
                Ok(ev) => self.intake(ev),
                Err(TryRecvError::Empty) => return,
                Err(TryRecvError::Disconnected) => {
                    self.done = true;
                    return;
                }
            }
        }
    }

    /// One turn of the connection, whichever thread drives it: posts what the machine has,
    /// waits up to `wait` for completions, gives freed blocks back and, when the turn went well,
    /// lends receiver's blocks again. With `heartbeat` the connection's liveness is checked
    /// first (the sending thread's turns: a receiver or link that died without a word is noticed
    /// within the peer timeout). Only while connected.
    fn turn(&mut self, lent: &LentBlocks, wait: Duration, heartbeat: bool) -> Result<super::Turn> {
        let c = self.conn.as_mut().expect("connected");
        let alive = if heartbeat { c.heartbeat() } else { Ok(()) };
        let turn = alive.and_then(|()| {
            self.driver
                .turn(&mut self.s.machine, c.as_mut(), &Instant::now, wait)
        });
        self.s.release_freed();
        if let Ok(t) = &turn
            && (t.posted > 0 || t.completed > 0)
        {
            self.busy_at = Instant::now();
        }
        if turn.is_ok() {
            self.s.lend(c.as_ref(), lent);
        }
        turn
    }

    /// Whether a handing thread may drive the connection now: always on a connection whose
    /// work completes as it is posted, on one that posts there when idle only for a sender of
    /// one device, while nothing is queued or in flight and nothing moved for
    /// [`IDLE_BEFORE_POSTING_HERE`].
    fn drives_here(&self) -> bool {
        let Some(c) = self.conn.as_ref().filter(|_| self.failed.is_none()) else {
            return false;
        };
        let m = &self.s.machine;
        c.completes_at_once()
            || (c.posts_here_when_idle()
                && m.queued() == 0
                && m.outstanding() == 0
                && !m.sync_in_flight()
                && m.poll_timeout().is_none()
                && self.devices.load(Ordering::Relaxed) <= 1
                && self.busy_at.elapsed() >= IDLE_BEFORE_POSTING_HERE)
    }

    /// Drives the connection on this (handing) thread: turns until nothing more is posted or
    /// completed, gives freed blocks back and lends receiver's blocks. True when the sending
    /// thread has something to do: an error to act on, a retry or a completion to wait for,
    /// queued blocks, the end.
    fn drive_here(&mut self, lent: &LentBlocks) -> bool {
        if self.conn.is_none() {
            return true;
        }
        for _ in 0..TURNS_HERE {
            match self.turn(lent, Duration::ZERO, false) {
                Ok(turn) => {
                    if turn.posted == 0 && turn.completed == 0 {
                        break;
                    }
                }
                Err(e) => {
                    self.failed = Some(e);
                    return true;
                }
            }
        }
        let m = &self.s.machine;
        self.done
            || m.queued() > 0
            || m.outstanding() > 0
            || m.sync_in_flight()
            || m.poll_timeout().is_some()
    }
}

/// Waits up to `wait` for something in the sending thread's channel, letting go of the state
/// meanwhile (handing threads may drive the connection: see [`SendState`]), then takes it in
/// with the state held again ([`SendState::take_in`]).
///
/// The wake channel ([`Handoff::wake`]) is waited on only where a handing thread can drive the
/// connection (shm, mem; tcp when idle): over verbs nothing is ever sent on it, and a second
/// channel in every idle wait of the sending thread cost the small messages there (`bench
/// verbs` in the Soft-RoCE VM, 64 B–1 KiB, lower in 5 of 6 points in one boot).
fn wait_for_input(st: &mut MutexGuard<'_, SendState>, t: &SendingThread, wait: Duration) {
    let drivable = st
        .conn
        .as_ref()
        .is_some_and(|c| c.completes_at_once() || c.posts_here_when_idle());
    MutexGuard::unlocked(st, || {
        let mut sel = Select::new();
        sel.recv(&t.filled);
        if drivable {
            sel.recv(&t.wake);
        }
        let _ = sel.ready_timeout(wait);
    });
    if drivable {
        // Woken: whatever was left for this thread is in the state it now holds again.
        while t.wake.try_recv().is_ok() {}
    }
    st.take_in(&t.filled);
}

/// How filled and placed blocks reach the sending state: through the sending thread's channel,
/// or, when nothing waits in it and the state is free on a connection that completes at once,
/// straight into the state, driven on this thread ([`SendState`]). Blocks are handed over by
/// threads that hold the filler lock (the filling thread's held small messages, sent when their
/// wait is over, without it, but then no committed frame may skip it: `Filler::holding`), and
/// the sending thread takes them out of the channel only with the state held
/// ([`SendState::take_in`]), so the machine takes them in the order they were filled either
/// way.
#[derive(Clone)]
struct Handoff {
    tx: Sender<ToSending>,
    /// Wakes the sending thread when a thread that drove the connection left something for it
    /// (a retry on its timer, an error, the end), which it then sees. A channel of its own,
    /// holding one wake at most: when the wake went through `tx`, a hand-over that found it
    /// still there had to queue behind it (`tx` not empty) and wait for the sending thread to
    /// be woken and given a CPU, and so did every one after it until then. Over shm unthrottled
    /// (640×480 frames from `videotestsrc` into the pool), 1.3–7.3 % of the hand-overs went
    /// that way, 6.2–20 % beside a third runnable process (docs/benchmarks.md, "A wake that
    /// held frames up").
    wake: Sender<()>,
    state: Arc<parking_lot::Mutex<SendState>>,
    lent: LentBlocks,
    /// Whether this thread also makes the copies the sending thread would make: a block in a
    /// send block copied into the receiver's memory. Committing sources do (they copied
    /// nothing to write the frame); the filling thread does not: it copies the next frame
    /// meanwhile, and two copies in a row on one thread, where they went side by side on two,
    /// cost the lossless engine over shm 12–25 % at 8 MiB and 64 KiB. It hands over blocks
    /// already in the receiver's memory itself only while the machine has nothing queued (so
    /// its turns post status bytes and syncs, no copy).
    copies_here: bool,
}

impl Handoff {
    /// Hands `ev` over. False once the sender stopped.
    ///
    /// The filling thread posts only blocks already in the receiver's memory, while nothing is
    /// queued (no second copy in a row on it). It does not even try the state's lock for a
    /// block it filled: posting a lone device's block on an idle tcp link there lowered p50 in
    /// only 11 of 23 pairs for up to 1 % of a core more, and in the Soft-RoCE VM the copies
    /// handed to the filling thread got slower (docs/benchmarks.md, "The filling thread's
    /// post reverted").
    fn send(&self, ev: ToSending) -> bool {
        let needs_no_copy = matches!(ev, ToSending::Placed { .. } | ToSending::Returned(_));
        if (self.copies_here || needs_no_copy)
            && self.tx.is_empty()
            && let Some(mut state) = self.state.try_lock()
            && state.drives_here()
            && (self.copies_here || state.s.machine.queued() == 0)
        {
            state.intake(ev);
            state.driven_here += 1;
            if state.drive_here(&self.lent) {
                // Not through `tx`: a wake there made the next frames queue behind it until
                // the sending thread got a CPU (see `Handoff::wake`).
                let _ = self.wake.try_send(());
            }
            return true;
        }
        self.tx.send(ev).is_ok()
    }
}

enum Control {
    /// A device, its queue, whether it is lossless, and what its input shares about the queue
    /// ([`QueueState`]).
    Device(u8, Receiver<Msg>, bool, Arc<QueueState>),
}

/// What a finished sender reports.
#[derive(Debug, Clone, Copy, Default)]
pub struct SenderReport {
    pub machine: SenderStats,
    pub connections: u64,
    /// Send blocks not delivered when the sender had to give up at shutdown (not written, or
    /// written but not confirmed by the receiver for lossless devices).
    pub unsent: usize,
    /// Frames not delivered when the sender had to give up: in those blocks, and still queued
    /// at the devices.
    pub undelivered_frames: u64,
    /// The sliding window's counters, summed over its connections (zero for the status-byte
    /// mechanism).
    pub window: crate::proto::window::WindowStats,
    /// Work requests the sender posted and the queue depths it used, summed over its
    /// connections (as far as the transport counts them).
    pub work: crate::transport::WorkCounts,
    /// Blocks (and other hand-overs) that the thread handing them over took into the sending
    /// state and posted itself: on connections whose work completes as it is posted (shm, mem;
    /// see [`Connection::completes_at_once`]) without waking the sending thread, over tcp for a
    /// sender's lone device on an idle link ([`Connection::posts_here_when_idle`]), the sending
    /// thread woken afterwards to wait for the completion.
    pub driven_here: u64,
}

/// A running sender.
pub struct SenderHandle {
    control: Option<Sender<Control>>,
    counters: Arc<Registry<u8>>,
    abort: Arc<AtomicBool>,
    filling: Option<JoinHandle<u64>>,
    sending: Option<JoinHandle<Result<SenderReport>>>,
    queue_depth: usize,
    live: Arc<parking_lot::Mutex<SenderStats>>,
    /// Every device queue, to count the frames left in them at shutdown.
    queues: parking_lot::Mutex<Vec<Receiver<Msg>>>,
    /// For the devices' reservations: the send blocks, the in-place blocks' free list.
    blocks: Arc<SendBlocks>,
    free_rx: Receiver<usize>,
    free_tx: Sender<usize>,
    stash: Arc<parking_lot::Mutex<std::collections::VecDeque<usize>>>,
    in_place_blocks: usize,
    lent: LentBlocks,
    direct: Direct,
    /// Devices added ([`SendState::devices`]).
    devices: Arc<AtomicUsize>,
}

impl SenderHandle {
    /// Starts the filling and sending threads. Devices are added with [`Self::add_device`].
    pub fn start(
        opts: SenderOptions,
        connector: Box<dyn Connector>,
        queue_depth: usize,
    ) -> Result<SenderHandle> {
        if opts.send_blocks == 0 {
            return Err(Error::invalid("send_blocks", "must be at least 1"));
        }
        if crate::proto::payload_capacity(opts.block_size) == 0 {
            return Err(Error::invalid(
                "block_size",
                format!("must be larger than {} bytes", crate::proto::OVERHEAD),
            ));
        }
        if opts.in_place_blocks >= opts.send_blocks {
            return Err(Error::invalid(
                "in_place_blocks",
                format!(
                    "{} of {} send blocks leaves none for the filling thread (at most {})",
                    opts.in_place_blocks,
                    opts.send_blocks,
                    opts.send_blocks - 1
                ),
            ));
        }
        let blocks = connector.alloc_send_blocks(opts.send_blocks, opts.block_size)?;
        // Two free lists: the filling thread's blocks, then the in-place ones.
        let first_in_place = opts.send_blocks - opts.in_place_blocks;
        let (free_tx, free_rx) = crossbeam_channel::unbounded();
        let (reserve_tx, reserve_rx) = crossbeam_channel::unbounded();
        let free_lists = FreeLists {
            filling: free_tx,
            in_place: reserve_tx.clone(),
            first_in_place,
            in_use_limit: Arc::new(AtomicUsize::new(usize::MAX)),
            live_in_place_limit: Arc::new(AtomicUsize::new(usize::MAX)),
        };
        for i in 0..opts.send_blocks {
            free_lists.release(i);
        }
        let (filled_tx, filled_rx) = crossbeam_channel::unbounded();
        let (wake_tx, wake_rx) = crossbeam_channel::bounded(1);
        let (control_tx, control_rx) = crossbeam_channel::unbounded();
        let abort = Arc::new(AtomicBool::new(false));
        let drops = Arc::new(AtomicU64::new(0));
        let live = Arc::new(parking_lot::Mutex::new(SenderStats::default()));
        let lent = LentBlocks::new();
        // Lossless messages are kept in the filling thread's blocks only (the in-place ones
        // are the reservations'): one that needs them all could never be completed.
        let filler = Arc::new(parking_lot::Mutex::new(Filler {
            machine: FillingMachine::new(blocks.block_size(), first_in_place, opts.first_packet),
            drops_seen: 0,
            holding: false,
        }));
        // Blocks are sealed when filled, for whichever connection takes them: the
        // connector's transport decides how (docs/protocol.md, "Seal by transport").
        let placement = connector.placement();
        let counters = Arc::new(Registry::default());
        let devices = Arc::new(AtomicUsize::new(0));
        let state = Arc::new(parking_lot::Mutex::new(SendState {
            s: Sending {
                machine: SenderMachine::new(opts.max_outstanding),
                meta: vec![None; opts.send_blocks],
                coalesced: vec![Vec::new(); opts.send_blocks],
                placed: std::collections::HashMap::new(),
                next_ticket: 0,
                free: free_lists.clone(),
                counters: counters.clone(),
            },
            conn: None,
            driver: super::Driver::new(),
            done: false,
            failed: None,
            driven_here: 0,
            busy_at: Instant::now(),
            devices: devices.clone(),
        }));
        let handoff = Handoff {
            tx: filled_tx,
            wake: wake_tx,
            state: state.clone(),
            lent: lent.clone(),
            copies_here: false,
        };
        let direct = Direct {
            filler: filler.clone(),
            filled: Handoff {
                copies_here: true,
                ..handoff.clone()
            },
            free: free_lists.clone(),
            placement,
            drops: drops.clone(),
        };
        let filling = {
            let (blocks, abort, drops, free_lists, in_place, lent) = (
                blocks.clone(),
                abort.clone(),
                drops.clone(),
                free_lists.clone(),
                reserve_rx.clone(),
                lent.clone(),
            );
            // The sliding-window baseline keeps each device on its own connection, so its
            // messages never share a block.
            let coalesce_wait = if opts.sliding_window {
                Duration::ZERO
            } else {
                opts.coalesce_wait
            };
            spawn("filling", move || {
                filling_thread(
                    blocks,
                    control_rx,
                    (free_rx, in_place, free_lists),
                    handoff,
                    abort,
                    filler,
                    drops,
                    coalesce_wait,
                    (placement, lent),
                )
            })?
        };
        let reserve_blocks = blocks.clone();
        let in_place_blocks = opts.in_place_blocks;
        let sending = {
            let t = SendingThread {
                opts,
                connector,
                blocks,
                filled: filled_rx,
                wake: wake_rx,
                abort: abort.clone(),
                live: live.clone(),
                drops,
                lent: lent.clone(),
                state,
            };
            let stopped = abort.clone();
            spawn("sending", move || {
                let report = sending_thread(t);
                // Whatever ended the sending thread, nothing more will be sent: release the
                // filling thread and any source waiting in a full queue.
                stopped.store(true, Ordering::Release);
                report
            })?
        };
        Ok(SenderHandle {
            control: Some(control_tx),
            counters,
            abort,
            filling: Some(filling),
            sending: Some(sending),
            queue_depth: queue_depth.max(1),
            live,
            queues: parking_lot::Mutex::new(Vec::new()),
            blocks: reserve_blocks,
            free_rx: reserve_rx,
            free_tx: reserve_tx,
            stash: Arc::default(),
            in_place_blocks,
            lent,
            direct,
            devices,
        })
    }

    /// Registers device `device` and returns its input queue.
    pub fn add_device(&self, device: u8, policy: DropPolicy) -> DeviceInput {
        self.add_device_with(device, policy, policy == DropPolicy::Block)
    }

    /// Registers device `device` with its queue policy, and whether it is lossless
    /// (acknowledged end to end: the receiver confirms every message once it is durably handed
    /// on, and the sender keeps it until then; `block` devices are, by [`Self::add_device`]).
    pub fn add_device_with(&self, device: u8, policy: DropPolicy, reliable: bool) -> DeviceInput {
        self.devices.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = crossbeam_channel::bounded(self.queue_depth);
        let queue = Arc::new(QueueState::default());
        if let Some(c) = &self.control {
            let _ = c.send(Control::Device(device, rx.clone(), reliable, queue.clone()));
        }
        self.queues.lock().push(rx.clone());
        DeviceInput {
            device,
            policy,
            tx,
            rx,
            counters: self.counters.device(&device),
            stopped: self.abort.clone(),
            blocks: self.blocks.clone(),
            free_rx: self.free_rx.clone(),
            free_tx: self.free_tx.clone(),
            stash: self.stash.clone(),
            in_place_blocks: self.in_place_blocks,
            lent: self.lent.clone(),
            reliable,
            direct: self.direct.clone(),
            queue,
        }
    }

    /// Per-device counters (frames fully written, bytes, drops, latency capture→written).
    pub fn counters(&self) -> Arc<Registry<u8>> {
        self.counters.clone()
    }

    /// The sending state machine's counters.
    pub fn machine_stats(&self) -> SenderStats {
        *self.live.lock()
    }

    /// No more devices will be added: once every device has ended, the sending thread delivers
    /// what is left and stops ([`SenderHandle::is_finished`]). [`SenderHandle::finish`] implies this.
    pub fn close(&mut self) {
        self.control.take();
    }

    /// Waits until every device has ended and everything queued is written, or until
    /// `timeout`, then stops. Devices must have been ended ([`DeviceInput::end`]) or dropped.
    pub fn finish(mut self, timeout: Duration) -> Result<SenderReport> {
        self.control.take();
        let deadline = Instant::now() + timeout;
        let sending = self.sending.take().expect("joined once");
        while !sending.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.abort.store(true, Ordering::Release);
        let mut report = sending
            .join()
            .unwrap_or_else(|p| Err(Error::panicked("sending", p)));
        // Frames the filling thread held to share a block and could not send.
        let held = self.filling.take().map_or(0, |f| f.join().unwrap_or(0));
        let queued: u64 = self
            .queues
            .lock()
            .iter()
            .map(|q| {
                q.try_iter()
                    .filter(|m| matches!(m, Msg::Frame(_) | Msg::Reserved(_)))
                    .count() as u64
            })
            .sum();
        if let Ok(r) = &mut report {
            r.undelivered_frames += queued + held;
        }
        report
    }

    /// True once the sending thread stopped (finished or failed).
    pub fn is_finished(&self) -> bool {
        self.sending.as_ref().is_none_or(|s| s.is_finished())
    }
}

impl Drop for SenderHandle {
    fn drop(&mut self) {
        self.abort.store(true, Ordering::Release);
    }
}

/// The filling thread. Returns the frames it took from the queues but never handed to the
/// sending thread (held to share a block, or in a coalesced block without a send block, when
/// the sender stopped).
#[allow(clippy::too_many_arguments)]
fn filling_thread(
    blocks: Arc<SendBlocks>,
    control: Receiver<Control>,
    free: (Receiver<usize>, Receiver<usize>, FreeLists),
    filled: Handoff,
    abort: Arc<AtomicBool>,
    filler: Arc<parking_lot::Mutex<Filler>>,
    drops: Arc<AtomicU64>,
    coalesce_wait: Duration,
    (placement, lent): (Placement, LentBlocks),
) -> u64 {
    // However this thread ends (a panic included), the sending thread finishes what it has and
    // closes: committing sources hold senders of the channel too, so its disconnection no
    // longer says so.
    struct DoneOnExit(Sender<ToSending>);
    impl Drop for DoneOnExit {
        fn drop(&mut self) {
            let _ = self.0.send(ToSending::Done);
        }
    }
    let _done = DoneOnExit(filled.tx.clone());
    let mut coalescer = Coalescer::new(blocks.block_size(), coalesce_wait);
    let lost = std::cell::Cell::new(0);
    filling_loop(
        blocks,
        control,
        free,
        filled,
        abort,
        &filler,
        drops,
        &mut coalescer,
        &lost,
        (placement, &lent),
    );
    let held = coalescer.flush().unwrap_or_default();
    lost.get() + frames_in(&held).len() as u64
}

#[allow(clippy::too_many_arguments)]
fn filling_loop(
    blocks: Arc<SendBlocks>,
    control: Receiver<Control>,
    (free, in_place, free_lists): (Receiver<usize>, Receiver<usize>, FreeLists),
    filled: Handoff,
    abort: Arc<AtomicBool>,
    filler: &parking_lot::Mutex<Filler>,
    drops: Arc<AtomicU64>,
    coalescer: &mut Coalescer<Vec<u8>>,
    lost: &std::cell::Cell<u64>,
    (placement, lent): (Placement, &LentBlocks),
) {
    let block_size = blocks.block_size();
    // The queues of streaming devices, and of devices waiting for their number's stream to end,
    // with what their inputs share about them.
    let mut queues: Vec<(u8, Receiver<Msg>, Arc<QueueState>)> = Vec::new();
    let mut waiting: Vec<(u8, Receiver<Msg>, Arc<QueueState>)> = Vec::new();
    let mut control_open = true;
    // Takes a free send block; gives up only on abort.
    // Its own blocks first, in the order they were freed; with none free, an in-place block
    // that is free borrowed (so a sender whose sources do not reserve still fills with every
    // block). It never depends on an in-place block: it takes whichever comes free first
    // (docs/protocol.md, "Frames written in place").
    // Under a cache budget (`in_use_limit` set) the most recently freed block comes first (the
    // one most likely still cached), and a message's first block (`starts`) waits while that
    // many of its own blocks are in use; the later blocks of a message never do, so a message
    // larger than the limit still gets all of its blocks.
    let stash = std::cell::RefCell::new(std::collections::VecDeque::<usize>::new());
    let own = free_lists.first_in_place;
    let take_free = |starts: bool| {
        loop {
            let mut free_now = stash.borrow_mut();
            free_now.extend(free.try_iter());
            let limit = free_lists.in_use_limit.load(Ordering::Relaxed);
            let limited = match take_within(&mut free_now, own, limit, starts) {
                FreeBlock::Taken(i) => return Some(i),
                FreeBlock::Limited => true,
                FreeBlock::None => {
                    if let Ok(i) = in_place.try_recv() {
                        return Some(i);
                    }
                    false
                }
            };
            drop(free_now);
            let mut sel = Select::new();
            sel.recv(&free);
            if !limited {
                sel.recv(&in_place);
            }
            match sel.select_timeout(Duration::from_millis(50)) {
                Ok(op) => {
                    let own_block = op.index() == 0;
                    let list = if own_block { &free } else { &in_place };
                    match op.recv(list) {
                        Ok(i) if own_block => stash.borrow_mut().push_back(i),
                        Ok(i) => return Some(i),
                        Err(_) => return None, // disconnected: the sender is gone
                    }
                }
                Err(_) if !abort.load(Ordering::Acquire) => continue,
                Err(_) => return None,
            }
        }
    };
    // Copies one planned message into send blocks and hands them to the sending thread.
    // The payload is written in place (`FrameData::write` renders or copies each fragment
    // straight into the block's payload area, after the header); a small message held for
    // coalescing is taken as bytes (it shares a block with others once they are ready).
    let fill = |coalescer: &mut Coalescer<Vec<u8>>,
                msg: Option<Message>,
                device: u8,
                payload: &FrameData,
                timestamp_ns: u64|
     -> bool {
        let Some(msg) = msg else {
            tracing::error!(
                device,
                len = payload.len(),
                "message too large for 65535 blocks; dropped"
            );
            return true;
        };
        if msg.downgraded {
            crate::warn_limited!(
                "message-over-send-blocks",
                "device {}: a {}-byte frame needs {} send blocks, but the sender fills {} (of {}; the others are in-place blocks): it is not kept for resending after a receiver crash (raise send_blocks or block_size)",
                msg.device,
                payload.len(),
                msg.headers.len(),
                free_lists.first_in_place,
                blocks.count()
            );
        }
        let count = msg.headers.len();
        if coalescer.enabled() {
            // Small lossy messages wait for company; anything else goes after the held ones.
            let (batches, taken) = match &msg.headers[..] {
                [h] if coalesce::can_share(h) => (
                    coalescer.handle_message(Instant::now(), *h, payload.to_bytes().to_vec()),
                    true,
                ),
                _ => (coalescer.flush().into_iter().collect(), false),
            };
            for b in batches {
                if !write_batch(&blocks, &take_free, &filled, b, lost) {
                    return false;
                }
            }
            if taken {
                return true;
            }
        }
        for (k, h) in msg.headers.into_iter().enumerate() {
            let range = fragment_range(k, payload.len(), block_size);
            // Over tcp and shm the CRC32C covers the header only: those transports place the
            // whole block before its status byte (coalesced blocks, small, keep the full seal).
            let h = h.sealed_for(placement);
            let frame_end = (msg.kind == MessageKind::Frame && k + 1 == count)
                .then_some((payload.len(), timestamp_ns));
            // Over shm a lossy message's block is written straight into a block of the
            // receiver's memory when the sending thread has one on offer: one copy, not two
            // (docs/protocol.md, "Frames written into the receiver's memory").
            if !msg.reliable
                && let Some(b) = lent.take()
            {
                let write = |dst: &mut [u8]| payload.write(range.start, dst);
                if !place(&filled, b, &h, write, msg.device, frame_end) {
                    return false;
                }
                continue;
            }
            let Some(i) = take_free(k == 0) else {
                return false;
            };
            let len = blocks.fill(i, |b| {
                let used = h.write_header_with(b, |dst| payload.write(range.start, dst));
                h.seal(b);
                used
            });
            if !filled.send(ToSending::Block(Filled {
                index: i,
                len,
                device: msg.device,
                reliable: msg.reliable,
                last: k + 1 == count,
                frame_end,
            })) {
                return false;
            }
        }
        true
    };
    loop {
        if abort.load(Ordering::Acquire) {
            return;
        }
        // Held small messages whose wait is over go out.
        if let Some(b) = coalescer.handle_timeout(Instant::now()) {
            if !write_batch(&blocks, &take_free, &filled, b, lost) {
                return;
            }
            // Committing sources may hand their frames over directly only while nothing is
            // held (set after each message below, which is when the coalescer takes some).
            filler.lock().holding = coalescer.held() > 0;
        }
        if !control_open && queues.is_empty() {
            if let Some(b) = coalescer.flush()
                && !write_batch(&blocks, &take_free, &filled, b, lost)
            {
                return;
            }
            let _ = filled.send(ToSending::Done);
            return;
        }
        let mut sel = Select::new();
        let control_op = control_open.then(|| sel.recv(&control));
        for (_, rx, _) in &queues {
            sel.recv(rx);
        }
        let wait = coalescer
            .poll_timeout()
            .map_or(Duration::from_millis(50), |t| {
                t.saturating_duration_since(Instant::now())
            });
        let Ok(op) = sel.select_timeout(wait) else {
            continue;
        };
        let index = op.index();
        // Held from taking the message until it is planned, handed on and the coalescer's
        // state is known: a source committing meanwhile queues its frame behind it
        // (`DeviceInput::commit_direct`).
        let mut guard = filler.lock();
        let f = &mut *guard;
        if Some(index) == control_op {
            match op.recv(&control) {
                Ok(Control::Device(device, rx, reliable, queue)) => {
                    match f.machine.add_device(device, reliable) {
                        Added::Streaming => {
                            queue.admitted.store(true, Ordering::Release);
                            queues.push((device, rx, queue));
                        }
                        Added::Waiting => waiting.push((device, rx, queue)),
                    }
                }
                Err(_) => control_open = false,
            }
            continue;
        }
        let pos = index - control_op.map_or(0, |_| 1);
        let received = op.recv(&queues[pos].1);
        // Counted planned below, still under the lock (`QueueState::unplanned`).
        let taken = received.is_ok().then(|| queues[pos].2.clone());
        let msg = received.unwrap_or(Msg::End);
        let device = queues[pos].0;
        // After a connection drop the receiver may be a new process: formats go out again.
        let now_drops = drops.load(Ordering::Acquire);
        if now_drops != f.drops_seen {
            f.drops_seen = now_drops;
            f.machine.handle_disconnected();
        }
        let machine = &mut f.machine;
        let ok = match msg {
            Msg::Frame(f) => {
                let times = MessageTimes {
                    timestamp_ns: f.timestamp_ns,
                    duration_ns: f.duration_ns,
                    pts_ns: f.pts_ns.unwrap_or(NO_PTS),
                };
                let plan = machine.frame(device, &f.format, f.index, f.data.len(), times);
                plan.format.is_none_or(|m| {
                    let format = bytes::Bytes::copy_from_slice(f.format.as_bytes());
                    fill(
                        coalescer,
                        Some(m),
                        device,
                        &FrameData::Bytes(format),
                        f.timestamp_ns,
                    )
                }) && fill(coalescer, plan.frame, device, &f.data, f.timestamp_ns)
            }
            Msg::Reserved(mut c) => {
                let plan = machine.frame(device, &c.meta.format, c.meta.index, c.len, c.times());
                let format_ok = plan.format.is_none_or(|m| {
                    let format = bytes::Bytes::copy_from_slice(c.meta.format.as_bytes());
                    fill(
                        coalescer,
                        Some(m),
                        device,
                        &FrameData::Bytes(format),
                        c.meta.timestamp_ns,
                    )
                });
                format_ok && {
                    // Held small messages go first: a reserved frame never shares its block.
                    let held = coalescer.flush();
                    held.is_none_or(|b| write_batch(&blocks, &take_free, &filled, b, lost))
                        && seal_committed(
                            &blocks,
                            &filled,
                            &free_lists,
                            plan.frame,
                            &mut c,
                            placement,
                        )
                }
            }
            Msg::End => {
                let (_, _, queue) = queues.remove(pos);
                queue.admitted.store(false, Ordering::Release);
                // After a drop, the format first: the frames resent to a new receiver process
                // went without it, and no frame follows to bring it.
                let now = unix_now_ns();
                let format_ok = machine.stale_format(device, now).is_none_or(|(m, text)| {
                    fill(
                        coalescer,
                        Some(m),
                        device,
                        &FrameData::Bytes(bytes::Bytes::from(text.into_bytes())),
                        now,
                    )
                });
                if !format_ok {
                    return;
                }
                let (end, resumed) = machine.end(device, now);
                if resumed.is_some()
                    && let Some(k) = waiting.iter().position(|(d, _, _)| *d == device)
                {
                    let next = waiting.remove(k);
                    next.2.admitted.store(true, Ordering::Release);
                    queues.push(next);
                }
                fill(
                    coalescer,
                    Some(end),
                    device,
                    &FrameData::Bytes(bytes::Bytes::new()),
                    0,
                )
            }
        };
        if !ok {
            return;
        }
        f.holding = coalescer.held() > 0;
        if let Some(queue) = taken {
            queue.planned();
        }
    }
}

/// The plan of committed frame `c`, which `reserve` admitted only if it fits in one block; any
/// other plan is logged and `None` (the frame is dropped).
fn one_block(msg: Option<Message>, c: &Committed) -> Option<Message> {
    let msg = msg.filter(|m| m.headers.len() == 1);
    if msg.is_none() {
        tracing::error!(
            frame = c.meta.index,
            len = c.len,
            "a reserved frame planned as more than one block; dropped"
        );
    }
    msg
}

/// Writes header and seal around committed frame `c` (planned as `msg`), in its lent receiver's
/// block or its reserved send block, and hands it to the sending thread. False once the sender
/// stops.
fn seal_committed(
    blocks: &SendBlocks,
    filled: &Handoff,
    free: &FreeLists,
    msg: Option<Message>,
    c: &mut Committed,
    placement: Placement,
) -> bool {
    match c.lent.take() {
        Some(lent) => seal_placed(filled, msg, lent, c, placement),
        None => seal_reserved(blocks, filled, free, msg, c, placement),
    }
}

/// Writes header and seal around the payload a source wrote into reserved send block
/// `c.block` and hands the block to the sending thread. False once the sender stops.
fn seal_reserved(
    blocks: &SendBlocks,
    filled: &Handoff,
    free: &FreeLists,
    msg: Option<Message>,
    c: &Committed,
    placement: Placement,
) -> bool {
    let Some(msg) = one_block(msg, c) else {
        free.release(c.block);
        return true;
    };
    // Sealed by transport, as `fill` seals (docs/protocol.md, "Seal by transport").
    let h = msg.headers[0].sealed_for(placement);
    let len = blocks.fill(c.block, |b| {
        // The payload is in place already: only the header goes before it.
        let used = h.write_header_with(b, |_| {});
        h.seal(b);
        used
    });
    let frame_end = (msg.kind == MessageKind::Frame).then_some((c.len, c.meta.timestamp_ns));
    filled.send(ToSending::Block(Filled {
        index: c.block,
        len,
        device: msg.device,
        reliable: msg.reliable,
        last: true,
        frame_end,
    }))
}

/// Writes header and seal around the payload a source wrote into a lent receiver's block (over
/// shm: the block is in the receiver's memory) and has the sending thread post its status byte.
/// False once the sender stops.
fn seal_placed(
    filled: &Handoff,
    msg: Option<Message>,
    block: LentBlock,
    c: &Committed,
    placement: Placement,
) -> bool {
    let Some(msg) = one_block(msg, c) else {
        return filled.send(ToSending::Returned(block.lent));
    };
    let h = msg.headers[0].sealed_for(placement);
    let frame_end = (msg.kind == MessageKind::Frame).then_some((c.len, c.meta.timestamp_ns));
    // The payload is in place already: only the header goes before it.
    place(filled, block, &h, |_| {}, msg.device, frame_end)
}

/// Writes header `h`, the payload (`payload` fills the payload area) and the seal into lent
/// receiver's block `block`, lets go of it, and has the sending thread post its status byte.
/// False once the sender stops.
fn place(
    filled: &Handoff,
    mut block: LentBlock,
    h: &crate::proto::BlockHeader,
    payload: impl FnOnce(&mut [u8]),
    device: u8,
    frame_end: Option<(usize, u64)>,
) -> bool {
    let b = block.lease.bytes_mut();
    h.write_header_with(b, payload);
    h.seal(b);
    // The lease goes here, before the status byte is posted.
    let LentBlock { lent, .. } = block;
    filled.send(ToSending::Placed {
        lent,
        device,
        frame_end,
    })
}

/// Writes one batch of the coalescer into a free send block (a lone message as a version 1
/// block, several as a coalesced one) and hands it to the sending thread. False once the sender
/// stops.
fn write_batch(
    blocks: &SendBlocks,
    take_free: &dyn Fn(bool) -> Option<usize>,
    filled: &Handoff,
    batch: Batch<Vec<u8>>,
    lost: &std::cell::Cell<u64>,
) -> bool {
    let frames = frames_in(&batch);
    let Some(i) = take_free(true) else {
        lost.set(lost.get() + frames.len() as u64);
        return false;
    };
    let len = blocks.fill(i, |b| coalesce::encode_batch(&batch, b));
    // Only lossy, whole messages are ever held: no block here waits for a confirmation.
    if !frames.is_empty() && !filled.send(ToSending::Frames(i, frames)) {
        return false;
    }
    filled.send(ToSending::Block(Filled {
        index: i,
        len,
        device: batch[0].0.device,
        reliable: false,
        last: true,
        frame_end: None,
    }))
}

/// The frames (device, payload bytes, capture time) among a batch's messages.
fn frames_in(batch: &[(crate::proto::BlockHeader, Vec<u8>)]) -> Vec<(u8, usize, u64)> {
    batch
        .iter()
        .filter(|(h, _)| !h.is_format() && !h.is_end_of_stream())
        .map(|(h, p)| (h.device, p.len(), h.timestamp_ns))
        .collect()
}

struct Sending {
    machine: SenderMachine,
    meta: Vec<Option<Filled>>,
    /// Frames of the coalesced (or held and then sent alone) message in each send block.
    coalesced: Vec<Vec<(u8, usize, u64)>>,
    /// Blocks placed in lent receiver's blocks, by the machine's ticket: device and frame end.
    placed: std::collections::HashMap<u64, (u8, Option<(usize, u64)>)>,
    next_ticket: u64,
    free: FreeLists,
    counters: Arc<Registry<u8>>,
}

impl Sending {
    fn intake(&mut self, ev: ToSending, done: &mut bool) {
        match ev {
            ToSending::Placed {
                lent,
                device,
                frame_end,
            } => {
                let ticket = self.next_ticket;
                self.next_ticket += 1;
                self.placed.insert(ticket, (device, frame_end));
                self.machine.handle_placed(lent, ticket);
            }
            ToSending::Returned(lent) => self.machine.handle_returned(lent),
            ToSending::Block(f) => {
                self.meta[f.index] = Some(f);
                let delivery = if f.reliable {
                    Delivery::Confirmed { last: f.last }
                } else {
                    Delivery::Unconfirmed
                };
                self.machine.handle_filled(f.index, f.len, delivery);
            }
            ToSending::Frames(i, frames) => self.coalesced[i] = frames,
            ToSending::Done => *done = true,
        }
    }

    fn release_freed(&mut self) {
        while let Some(i) = self.machine.poll_freed() {
            self.release(i);
        }
        // Frames written into the receiver's memory: delivered once their status byte is, and
        // lost (counted as dropped) when their connection went first.
        while let Some((ticket, delivered)) = self.machine.poll_placed() {
            let Some((device, frame_end)) = self.placed.remove(&ticket) else {
                continue;
            };
            let counters = self.counters.device(&device);
            match frame_end {
                Some((bytes, ts)) if delivered => counters.written_at(bytes, ts),
                Some((_, ts)) => counters.dropped_at(ts),
                None => {}
            }
        }
    }

    /// Takes back the lent receiver's blocks nobody has taken, when queued blocks wait for a
    /// free one (lending never starves the queue); offers the free ones the queued blocks do not
    /// need to reservations and the filling thread, up to the machine's limit, while the
    /// connection can lend.
    fn lend(&mut self, conn: &dyn Connection, lent: &LentBlocks) {
        if self.machine.queued() > 0 && !self.machine.has_free_block() {
            for b in lent.rx.try_iter() {
                self.machine.handle_returned(b.lent);
            }
        }
        while let Some(l) = self.machine.lend() {
            match conn.lend_block(l.remote_block) {
                Some(lease) => lent.offer(LentBlock { lent: l, lease }),
                None => {
                    // This transport cannot: lend nothing on this connection.
                    self.machine.handle_returned(l);
                    self.machine.set_max_lent(0);
                }
            }
        }
        lent.waits_on_queue
            .store(self.machine.lending_waits_on_queue(), Ordering::Relaxed);
    }

    /// Send block `i` is delivered: count its frame (if it ends one) or the frames coalesced
    /// into it, give it back to filling.
    fn release(&mut self, i: usize) {
        if let Some(Filled {
            device,
            frame_end: Some((bytes, ts)),
            ..
        }) = self.meta[i].take()
        {
            self.counters.device(&device).written_at(bytes, ts);
        }
        for (device, bytes, ts) in std::mem::take(&mut self.coalesced[i]) {
            self.counters.device(&device).written_at(bytes, ts);
        }
        self.free.release(i);
    }
}

struct SendingThread {
    opts: SenderOptions,
    connector: Box<dyn Connector>,
    blocks: Arc<SendBlocks>,
    filled: Receiver<ToSending>,
    /// [`Handoff::wake`].
    wake: Receiver<()>,
    abort: Arc<AtomicBool>,
    live: Arc<parking_lot::Mutex<SenderStats>>,
    /// Connection drops so far (the filling thread resends formats after one).
    drops: Arc<AtomicU64>,
    /// The receiver's blocks lent out to reservations and the filling thread (shm).
    lent: LentBlocks,
    /// Held by this thread while it works (see [`SendState`]).
    state: Arc<parking_lot::Mutex<SendState>>,
}

fn sending_thread(t: SendingThread) -> Result<SenderReport> {
    let state = t.state.clone();
    let mut st = state.lock();
    if t.opts.sliding_window {
        // Held for good: the baseline's connections are this thread's alone.
        return window::window_sending_thread(t, &mut st.s);
    }
    let hello = Hello {
        version: PROTOCOL_VERSION,
        sender: t.opts.name.clone(),
        session: u64::from_le_bytes(crate::transport::tcp::random_bytes()),
        block_size: t.blocks.block_size() as u32,
        data_path: DataPath::Tcp,
        qp: QpInfo::default(),
        nonce: [0; NONCE_LEN],
        mechanism: crate::proto::handshake::Mechanism::StatusByte,
    };
    let block_size = t.blocks.block_size();
    let mut report = SenderReport::default();
    let mut backoff = t.opts.reconnect_min;
    let mut next_attempt = Instant::now();
    let mut last_error = String::new();
    loop {
        *t.live.lock() = st.s.machine.stats();
        if t.abort.load(Ordering::Acquire) {
            // Whatever the machine still holds was not delivered: queued, in flight, or (for
            // lossless devices) written but not confirmed; blocks the filling thread sent since.
            st.take_in(&t.filled);
            let s = &st.s;
            report.unsent = s.machine.queued() + s.machine.outstanding() + s.machine.unconfirmed();
            report.undelivered_frames = s
                .meta
                .iter()
                .filter(|m| m.is_some_and(|f| f.frame_end.is_some()))
                .count() as u64
                + s.coalesced.iter().map(|f| f.len() as u64).sum::<u64>()
                + s.placed.values().filter(|(_, f)| f.is_some()).count() as u64;
            break;
        }
        st.take_in(&t.filled);
        let now = Instant::now();
        if st.conn.is_none() {
            if st.done && st.s.machine.is_idle() {
                break;
            }
            if now >= next_attempt {
                match t.connector.connect(&hello, t.opts.key.as_ref(), &t.blocks) {
                    Ok(c) => {
                        let layout = c.layout();
                        if layout.block_size < block_size {
                            return Err(Error::invalid(
                                "block_size",
                                format!(
                                    "receiver {} offers {}-byte blocks, smaller than this sender's {block_size}",
                                    c.peer(),
                                    layout.block_size
                                ),
                            ));
                        }
                        tracing::info!(
                            peer = c.peer(),
                            transport = t.connector.transport(),
                            "connected: {} remote blocks of {} bytes",
                            layout.blocks,
                            layout.block_size
                        );
                        if let (Some(k), Some(budget)) = (
                            crate::transport::max_full_blocks(c.as_ref()),
                            c.cache_budget(),
                        ) {
                            tracing::info!(
                                peer = c.peer(),
                                "at most {k} of the {} remote blocks full at once, so that the blocks written are still cached where they are copied (a budget of {budget} bytes)",
                                layout.blocks
                            );
                        }
                        let s = &mut st.s;
                        s.machine.handle_connected(layout);
                        // Under a cache budget the filling thread keeps as few of its blocks
                        // in use as the budget holds.
                        let limits = c.send_limits(block_size);
                        s.free
                            .in_use_limit
                            .store(limits.filling.unwrap_or(usize::MAX), Ordering::Relaxed);
                        let live = limits.live_in_place.unwrap_or(usize::MAX);
                        s.free.live_in_place_limit.store(live, Ordering::Relaxed);
                        if live < t.opts.in_place_blocks {
                            tracing::info!(
                                peer = c.peer(),
                                "a live device's frames written in place keep at most {live} of the {} in-place send blocks in use, so that they are still cached when they are sent",
                                t.opts.in_place_blocks
                            );
                        }
                        // Lent blocks cost the sender no memory: when sources write in
                        // place at all, up to a quarter of the receiver's blocks (the machine's limit).
                        s.machine.set_max_lent(if t.opts.in_place_blocks > 0 {
                            usize::MAX
                        } else {
                            0
                        });
                        t.lent.epoch.store(s.machine.epoch(), Ordering::Release);
                        report.connections += 1;
                        backoff = t.opts.reconnect_min;
                        last_error.clear();
                        st.conn = Some(c);
                    }
                    Err(e) if !e.is_transient() => return Err(e),
                    Err(e) => {
                        let text = e.to_string();
                        if text != last_error {
                            tracing::warn!(
                                "{text}; retrying every {:?} at most",
                                t.opts.reconnect_max
                            );
                            last_error = text;
                        }
                        next_attempt = now + backoff;
                        backoff = (backoff * 2).min(t.opts.reconnect_max);
                    }
                }
            }
            if st.conn.is_none() {
                let wait = next_attempt
                    .saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(50));
                wait_for_input(&mut st, &t, wait);
            }
            continue;
        }
        // A handing thread that drove the connection found it gone: reconnect as below.
        let result = match st.failed.take() {
            Some(e) => Err(e),
            None => {
                let c = st.conn.as_mut().expect("connected");
                // What the receiver says about a device (another sender streams it there,
                // ...): the connection and the other devices carry on.
                for n in c.take_notices() {
                    tracing::warn!(
                        peer = c.peer(),
                        device = n.device,
                        "receiver says: {}",
                        n.text
                    );
                }
                match st.turn(&t.lent, Duration::from_millis(1), true) {
                    Ok(turn) if !turn.in_flight => {
                        if st.done && st.s.machine.is_idle() {
                            let peer = st.conn.as_ref().map(|c| c.peer().to_string());
                            tracing::info!(
                                peer,
                                "all devices ended and every block is written; closing"
                            );
                            break;
                        }
                        if turn.posted > 0 || turn.completed > 0 {
                            // Completions may have made the next action ready (a sync for
                            // confirmations, a write into a block just freed): go round at once.
                            continue;
                        }
                        // Nothing in flight: wait for the filling thread or the sync backoff
                        // timer, letting go of the state meanwhile (handing threads may drive
                        // the connection: see `SendState`).
                        let now = Instant::now();
                        let wait =
                            st.s.machine
                                .poll_timeout()
                                .map_or(Duration::from_millis(50), |t| {
                                    t.saturating_duration_since(now)
                                })
                                .min(Duration::from_millis(50));
                        wait_for_input(&mut st, &t, wait);
                        Ok(())
                    }
                    Ok(_) => Ok(()),
                    Err(e) => Err(e),
                }
            }
        };
        if let Err(e) = result {
            tracing::warn!("{e}; reconnecting");
            if let Some(w) = st.conn.take().and_then(|c| c.work_counts()) {
                window::add_work(&mut report.work, w);
            }
            let s = &mut st.s;
            s.machine.handle_disconnected();
            // Blocks lent on this connection are worthless now (reservations holding one
            // find out when they commit: their frame is counted as dropped).
            t.lent.epoch.store(0, Ordering::Release);
            t.lent.waits_on_queue.store(false, Ordering::Relaxed);
            t.lent.rx.try_iter().for_each(drop);
            s.release_freed();
            t.drops.fetch_add(1, Ordering::Release);
            next_attempt = Instant::now() + backoff;
        }
    }
    // Taken, so handing threads drive nothing any more.
    if let Some(w) = st.conn.take().and_then(|c| c.work_counts()) {
        window::add_work(&mut report.work, w);
    }
    report.machine = st.s.machine.stats();
    report.driven_here = st.driven_here;
    *t.live.lock() = report.machine;
    Ok(report)
}
