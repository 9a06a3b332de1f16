//! Memory on both ends: the receiver's region (status bytes + memory blocks) and the sender's
//! send blocks. These are the software-transport versions; the verbs transport registers its own
//! memory with the NIC and offers the same access.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

use parking_lot::{Mutex, RawMutex, lock_api::ArcMutexGuard};

use super::{Notice, NoticeQueue, RegionSettings, Target, WorkCounter, WorkCounts};
use crate::proto::ack::{Ack, Settle};
use crate::proto::handshake::Mechanism;
use crate::proto::window::{ReceiverAction, WindowReceiver};
use crate::proto::{RemoteLayout, Reservation, status};

/// The receiver's view of one sender's region. Status bytes are read with acquire and written
/// with release ordering: a block's bytes are visible once its status byte reads FULL, and the
/// receiver is done with a block before it stores EMPTY.
pub trait Region: Send + Sync {
    /// Number and size of the memory blocks.
    fn layout(&self) -> RemoteLayout;
    /// What the transport guarantees about a block's bytes once its status byte reads FULL,
    /// and with it which seals the receiver accepts (see [`crate::proto::Placement`]). No
    /// default: a region that forgot to say would either refuse every tcp/shm block or let
    /// verbs blocks through with their payload unchecked.
    fn placement(&self) -> crate::proto::Placement;
    /// Status byte of block `j` (acquire).
    fn status(&self, j: usize) -> u8;
    /// Stores the status byte of block `j` (release).
    fn set_status(&self, j: usize, value: u8);
    /// Runs `f` over the bytes of block `j`. Only call while its status is FULL or RETAINED:
    /// then the sender does not write it.
    fn read_block(&self, j: usize, f: &mut dyn FnMut(&[u8]));
    /// Copies bytes `at..at + into.len()` of block `j` into `into`: a copy a misbehaving sender
    /// can no longer change, for what the receiver checks and then relies on (a block's header
    /// and trailer, a coalesced block's messages). Same rule as [`Self::read_block`]; panics if
    /// the range is outside the block. The default copies what `read_block` shows (a software
    /// region's block does not change while it is read: the emulated NIC writes it under the
    /// same lock); regions whose bytes a sender's process or NIC reaches directly (shm, verbs)
    /// copy with volatile loads.
    fn copy_from_block(&self, j: usize, at: usize, into: &mut [u8]) {
        self.read_block(j, &mut |b| into.copy_from_slice(&b[at..at + into.len()]));
    }
    /// True once the sender's connection is gone: nothing will be written any more.
    fn is_closed(&self) -> bool;
    /// The receiver is done with this sender (it is shutting down): end the connection so the
    /// sender notices at once instead of writing into a region nobody polls.
    fn disconnect(&self);
    /// Keeps block `j`, which must be FULL, for the caller: its status byte becomes RETAINED (2),
    /// so the sender skips it, until the returned handle is dropped; then it becomes EMPTY. This is
    /// how a receiver hands a block on without copying it.
    fn retain(self: Arc<Self>, j: usize) -> RetainedBlock;
    /// Blocks currently retained.
    fn retained(&self) -> usize;
    /// Ends a retention: the block becomes EMPTY. Called by [`RetainedBlock`]'s drop.
    fn release(&self, j: usize);
    /// Ends a retention without freeing the block: it stays RETAINED (unavailable) for the rest
    /// of the connection. For a lossless message that was not durably handed on: telling the
    /// sender it is safe would lose it.
    fn abandon(&self, j: usize);
    /// Sends `notice` to the sender of this region (on its connection's own channel, within a
    /// heartbeat interval); nothing happens once the connection is gone.
    fn notify(&self, notice: Notice);
    /// Work requests the receiver side posted, when it posts any and the transport counts them
    /// (the status-byte receiver posts none: `None`).
    fn work_counts(&self) -> Option<WorkCounts> {
        None
    }
    /// The polling thread's idle wait: it found no FULL status byte and waits up to `timeout`
    /// before it scans again. The default sleeps the whole time; a region that can be rung
    /// returns as soon as a FULL status byte is stored (shm's doorbell on every wait, the soft
    /// region's on its longest ones). Returning early is only ever a hint: the caller scans
    /// again either way.
    fn wait(&self, timeout: std::time::Duration) {
        std::thread::sleep(timeout);
    }
    /// Whether [`wait`](Self::wait) ends when the sender stores a status byte: the polling
    /// thread then waits its longest sleep at once instead of doubling up to it.
    fn wakes(&self) -> bool {
        false
    }
}

/// The bytes of a retained block, however the region stores them.
pub trait HeldBytes: Send + Sync {
    fn bytes(&self) -> &[u8];
    /// Copies bytes `at..at + into.len()` into `into` (see [`Region::copy_from_block`]).
    fn copy_out(&self, at: usize, into: &mut [u8]) {
        into.copy_from_slice(&self.bytes()[at..at + into.len()]);
    }
}

/// A receiver memory block kept with status RETAINED; dereferences to the block's bytes and
/// frees the block (status EMPTY) when dropped.
pub struct RetainedBlock {
    region: Arc<dyn Region>,
    index: usize,
    held: Option<Box<dyn HeldBytes>>,
    /// For the last block of a lossless message: set once the message is durable; until then
    /// the block is not freed.
    settled: Option<Arc<AtomicBool>>,
}

impl RetainedBlock {
    /// Wraps bytes held for block `index` of `region` (whose status byte the region already set
    /// to RETAINED); [`Region::release`] runs once they are let go.
    pub fn new(region: Arc<dyn Region>, index: usize, held: Box<dyn HeldBytes>) -> Self {
        RetainedBlock {
            region,
            index,
            held: Some(held),
            settled: None,
        }
    }

    /// Which block this is.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Copies bytes `at..at + into.len()` of the block into `into`, as a copy a misbehaving
    /// sender can no longer change (see [`Region::copy_from_block`]). Panics if the range is
    /// outside the block.
    pub fn copy_out(&self, at: usize, into: &mut [u8]) {
        self.held
            .as_ref()
            .expect("held until drop")
            .copy_out(at, into)
    }

    /// Makes the block wait for an acknowledgement: it is freed (status 0, which the sender
    /// takes as "durable") only once the returned [`Ack`] was settled and every holder (the
    /// returned block, the ack) is gone. Dropped unsettled, it stays unavailable.
    pub fn with_ack(mut self) -> (Arc<RetainedBlock>, Ack) {
        let settled = Arc::new(AtomicBool::new(false));
        self.settled = Some(settled.clone());
        let block = Arc::new(self);
        let ack = Ack::new(Arc::new(BlockAck {
            settled,
            _block: block.clone(),
        }));
        (block, ack)
    }
}

/// The acknowledgement of a retained block (see [`RetainedBlock::with_ack`]).
struct BlockAck {
    settled: Arc<AtomicBool>,
    _block: Arc<RetainedBlock>,
}

impl Settle for BlockAck {
    fn settle(&self) {
        self.settled.store(true, Ordering::Release);
    }
}

/// A shared retained block's bytes, for `Bytes::from_owner`.
pub struct HeldBlock(pub Arc<RetainedBlock>);

impl AsRef<[u8]> for HeldBlock {
    fn as_ref(&self) -> &[u8] {
        self.0.as_ref()
    }
}

impl AsRef<[u8]> for RetainedBlock {
    fn as_ref(&self) -> &[u8] {
        self.held.as_ref().expect("held until drop").bytes()
    }
}

impl std::ops::Deref for RetainedBlock {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_ref()
    }
}

impl Drop for RetainedBlock {
    fn drop(&mut self) {
        // Let go of the bytes first, then tell the sender the block is free.
        self.held.take();
        match &self.settled {
            Some(s) if !s.load(Ordering::Acquire) => {
                crate::warn_limited!(
                    "ack-abandoned",
                    "a lossless message was dropped before it was handed on; its block stays unavailable so the sender sends it again after a reconnect"
                );
                self.region.abandon(self.index)
            }
            _ => self.region.release(self.index),
        }
    }
}

struct SoftHeld(ArcMutexGuard<RawMutex, Box<[u8]>>);

impl HeldBytes for SoftHeld {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// One memory block, lockable from a retained-block handle too.
type SharedBlock = Arc<Mutex<Box<[u8]>>>;

/// Where a sliding-window region SENDs its ACKs: the connection, however the transport carries
/// a SEND.
pub trait AckLink: Send + Sync {
    /// SENDs one ACK message (work request `wr_id`).
    fn send_ack(&self, wr_id: u64, ack: [u8; crate::proto::window::ACK_LEN])
    -> std::io::Result<()>;
}

/// The receiving end of a sliding-window connection: the receive requests it keeps posted, the
/// blocks that arrived, and the ACKs it SENDs when the receiver is done with a block.
///
/// The region's status bytes are then the receiver's own bookkeeping, never remotely accessible:
/// a receive completion marks its block FULL (that is how the polling thread learns of it, in
/// arrival order, since blocks arrive in ring order), taking the block makes it RETAINED, and
/// letting it go makes it EMPTY and SENDs its ACK. A block kept downstream is acknowledged only
/// when it is let go — the sliding window's head waits for it (the paper's Figure 1d).
struct WindowSide {
    receiver: Mutex<WindowReceiver>,
    link: Mutex<Option<Arc<dyn AckLink>>>,
    counts: WorkCounter,
    next_send: std::sync::atomic::AtomicU64,
}

impl WindowSide {
    fn new(layout: RemoteLayout) -> WindowSide {
        let side = WindowSide {
            receiver: Mutex::new(WindowReceiver::new(layout)),
            link: Mutex::new(None),
            // One completion queue for the receives and the SENDs.
            counts: WorkCounter::new(1),
            next_send: std::sync::atomic::AtomicU64::new(1),
        };
        side.carry_out(&mut side.receiver.lock());
        side
    }

    /// Posts what the receiver machine asks for: receive requests, and ACKs as SENDs.
    fn carry_out(&self, r: &mut WindowReceiver) {
        while let Some(a) = r.poll_action() {
            match a {
                ReceiverAction::PostRecv { count } => self.counts.post_recv(count as u64),
                ReceiverAction::SendAck(imm) => {
                    let wr_id = self
                        .next_send
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    self.counts.post_send(1);
                    let link = self.link.lock().clone();
                    // A connection that is gone takes its ACKs with it; the polling thread
                    // sees the region closed.
                    if let Some(link) = link
                        && link.send_ack(wr_id, imm.to_ack()).is_ok()
                    {
                        // Emulated: the SEND completes once the connection took it.
                        self.counts.complete_send(1);
                        self.counts.completion();
                    }
                }
            }
        }
    }
}

/// A receiver region in ordinary memory, written by a software "NIC" (the `mem` transport's
/// poster or the `tcp` transport's receiving thread).
pub struct SoftRegion {
    layout: RemoteLayout,
    statuses: Box<[AtomicU8]>,
    blocks: Box<[SharedBlock]>,
    closed: AtomicBool,
    retained: AtomicUsize,
    /// The connection carrying this region's WRITEs, to end it on [`Region::disconnect`].
    link: Mutex<Option<std::net::TcpStream>>,
    /// Notices for the sender, sent by the tcp transport's NIC thread or taken by the in-process
    /// connection.
    notices: NoticeQueue,
    /// This region's share of the receiver's memory budget, given back when it is freed.
    _reservation: Option<Reservation>,
    /// Set when the region is the ring of a sliding-window connection.
    window: Option<WindowSide>,
    /// The receiver's polling thread waits here when idle ([`Region::wait`]); the NIC rings it
    /// after storing a FULL status byte (see [`SoftRegion::ring`]).
    bell: Doorbell,
}

/// The shortest sleep of the polling thread that the NIC's ring ends early. Shorter ones are
/// the backoff of a busy stream, whose next block is close behind: ringing those cost the NIC
/// thread a wake-up per block (at 1 MiB blocks the engine over tcp leaned lower against plain
/// TCP). The longest ones, `poll_max` (500 µs by default), are a live stream's wait between
/// frames, where the ring takes up to a sleep off each frame's latency.
const RING_AFTER: std::time::Duration = std::time::Duration::from_micros(500);

/// A polling thread's idle wait that a FULL status byte ends early, as shm's futex word does,
/// built from a flag, a lock and a condition variable.
///
/// Why no wake-up is lost: the waiter takes the lock, sets `asleep`, fences, and only then looks
/// at the status bytes once more before it waits (which lets go of the lock atomically). The
/// NIC stores the status byte, fences, then loads `asleep`: of the two fences one is first, so
/// either the waiter's look sees the FULL byte, or the NIC sees `asleep` and takes the lock,
/// which it gets only once the waiter waits, and notifies it.
#[derive(Default)]
struct Doorbell {
    asleep: AtomicBool,
    lock: std::sync::Mutex<()>,
    rung: std::sync::Condvar,
}

impl SoftRegion {
    /// Wakes the polling thread if it waits its longest sleeps (after a FULL status byte was
    /// stored). Unlike shm's sender this does not yield: the NIC thread yielding to the poller
    /// cost a third of the unthrottled rate of rdmasink/rdmasrc over tcp.
    fn ring(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.bell.asleep.load(Ordering::Relaxed) {
            drop(self.bell.lock.lock());
            self.bell.rung.notify_one();
        }
    }
}

/// A remote access that the region's access rights or bounds forbid (what an RNIC reports as a
/// remote access error).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessError(pub String);

impl SoftRegion {
    /// The notices waiting to go to the sender, oldest first.
    pub fn take_notices(&self) -> Vec<Notice> {
        self.notices.take()
    }

    /// Allocates N blocks of B bytes, all EMPTY except the reserved ones (RETAINED), outside any
    /// budget (tests, tools).
    pub fn new(settings: &RegionSettings) -> Arc<SoftRegion> {
        Self::with_reservation(settings, None)
    }

    /// Allocates a region whose memory `reservation` accounts for (see
    /// [`RegionSettings::reserve_region`]); it is given back when the region is freed.
    pub fn with_reservation(
        settings: &RegionSettings,
        reservation: Option<Reservation>,
    ) -> Arc<SoftRegion> {
        let statuses: Box<[AtomicU8]> = (0..settings.blocks)
            .map(|j| {
                let s = if settings.reserved_blocks.contains(&j) {
                    status::RETAINED
                } else {
                    status::EMPTY
                };
                AtomicU8::new(s)
            })
            .collect();
        let window = matches!(settings.mechanism, Mechanism::SlidingWindow { .. }).then(|| {
            WindowSide::new(RemoteLayout {
                blocks: settings.blocks,
                block_size: settings.block_size,
            })
        });
        let blocks = (0..settings.blocks)
            .map(|_| {
                Arc::new(Mutex::new(
                    vec![0u8; settings.block_size].into_boxed_slice(),
                ))
            })
            .collect();
        Arc::new(SoftRegion {
            layout: RemoteLayout {
                blocks: settings.blocks,
                block_size: settings.block_size,
            },
            statuses,
            blocks,
            closed: AtomicBool::new(false),
            retained: AtomicUsize::new(0),
            link: Mutex::new(None),
            notices: NoticeQueue::default(),
            _reservation: reservation,
            window,
            bell: Doorbell::default(),
        })
    }

    /// Remembers the connection that writes into this region (see [`Region::disconnect`]).
    pub fn attach_link(&self, link: std::net::TcpStream) {
        *self.link.lock() = Some(link);
    }

    /// Whether this is the ring of a sliding-window connection.
    pub fn is_window(&self) -> bool {
        self.window.is_some()
    }

    /// Where a sliding-window region SENDs its ACKs.
    pub fn attach_ack_link(&self, link: Arc<dyn AckLink>) {
        if let Some(w) = &self.window {
            *w.link.lock() = Some(link);
        }
    }

    /// Applies an RDMA WRITE WITH IMMEDIATE: checks that the immediate describes this write and
    /// that the receiver can take it (next block in ring order, not held, a receive posted),
    /// lets `fill` place the bytes, then consumes the receive request and reports the
    /// completion (the block turns FULL for the polling thread).
    pub fn write_imm(
        &self,
        offset: u64,
        len: usize,
        imm: u32,
        fill: impl FnOnce(&mut [u8]) -> std::io::Result<()>,
    ) -> Result<std::io::Result<()>, AccessError> {
        let Some(w) = &self.window else {
            return Err(AccessError(
                "WRITE WITH IMMEDIATE on a status-byte connection".into(),
            ));
        };
        let at = w
            .receiver
            .lock()
            .check_arrival(imm)
            .map_err(|e| AccessError(e.to_string()))?;
        if offset != (at.position * self.layout.block_size) as u64 || len != at.len {
            return Err(AccessError(format!(
                "WRITE WITH IMMEDIATE of {len} bytes at offset {offset} does not match its \
                 immediate (block {}, {} bytes)",
                at.position, at.len
            )));
        }
        // The block is not held (checked): nobody else touches it until it turns FULL.
        let r = fill(&mut self.blocks[at.position].lock()[..len]);
        if r.is_ok() {
            let mut rx = w.receiver.lock();
            rx.handle_received(imm)
                .map_err(|e| AccessError(e.to_string()))?;
            w.counts.consume_recv();
            w.counts.completion();
            self.statuses[at.position].store(status::FULL, Ordering::Release);
            w.carry_out(&mut rx);
            drop(rx);
            self.ring();
        }
        Ok(r)
    }

    /// Marks the connection gone.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// Checks an access of `len` bytes at `offset` like an RNIC checks an rkey's bounds: the
    /// whole range inside the target and, for memory blocks, inside one block. Returns the
    /// block (or first status byte) index and the offset within it. Every value here comes from
    /// the peer, so nothing is assumed: a zero-length access at the very end is refused too.
    fn locate(
        &self,
        target: Target,
        offset: u64,
        len: usize,
    ) -> Result<(usize, usize), AccessError> {
        let (unit, count) = match target {
            Target::Blocks => (self.layout.block_size as u64, self.layout.blocks as u64),
            Target::Statuses => (1, self.layout.blocks as u64),
        };
        let outside = || {
            AccessError(format!(
                "{len} bytes at {target:?}+{offset} are outside the region"
            ))
        };
        let end = offset.checked_add(len as u64).ok_or_else(outside)?;
        let index = offset / unit;
        let within = offset % unit;
        let fits = index < count
            && end <= unit * count
            && (target == Target::Statuses || within + len as u64 <= unit);
        if !fits {
            return Err(outside());
        }
        Ok((index as usize, within as usize))
    }

    /// Applies an RDMA WRITE whose bytes `fill` produces into the destination slice. Status bytes
    /// are stored with release ordering, after everything written before them.
    pub fn write_with(
        &self,
        target: Target,
        offset: u64,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> std::io::Result<()>,
    ) -> Result<std::io::Result<()>, AccessError> {
        if self.window.is_some() {
            return Err(AccessError(
                "a sliding-window connection writes only with WRITE WITH IMMEDIATE".into(),
            ));
        }
        let (index, within) = self.locate(target, offset, len)?;
        match target {
            Target::Blocks => {
                let mut block = self.blocks[index].lock();
                Ok(fill(&mut block[within..within + len]))
            }
            Target::Statuses => {
                let mut bytes = vec![0u8; len];
                let r = fill(&mut bytes);
                if r.is_ok() {
                    let mut full = false;
                    for (k, b) in bytes.into_iter().enumerate() {
                        self.statuses[index + k].store(b, Ordering::Release);
                        full |= b == status::FULL;
                    }
                    if full {
                        self.ring();
                    }
                }
                Ok(r)
            }
        }
    }

    /// Applies an RDMA READ. Only the status array allows remote reads.
    pub fn read_remote(
        &self,
        target: Target,
        offset: u64,
        len: usize,
    ) -> Result<Vec<u8>, AccessError> {
        if target != Target::Statuses {
            return Err(AccessError("memory blocks do not allow remote READ".into()));
        }
        if self.window.is_some() {
            return Err(AccessError(
                "a sliding-window connection has no remote status array".into(),
            ));
        }
        let (index, _) = self.locate(target, offset, len)?;
        Ok(self.statuses[index..index + len]
            .iter()
            .map(|s| s.load(Ordering::Acquire))
            .collect())
    }
}

impl Region for SoftRegion {
    fn layout(&self) -> RemoteLayout {
        self.layout
    }
    /// tcp and mem: every WRITE is applied whole (under the block's lock) before the next
    /// operation of the connection, and the status byte is stored with release ordering after.
    fn placement(&self) -> crate::proto::Placement {
        crate::proto::Placement::Ordered
    }
    fn status(&self, j: usize) -> u8 {
        self.statuses[j].load(Ordering::Acquire)
    }
    fn set_status(&self, j: usize, value: u8) {
        self.statuses[j].store(value, Ordering::Release)
    }
    fn read_block(&self, j: usize, f: &mut dyn FnMut(&[u8])) {
        f(&self.blocks[j].lock())
    }
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
    fn disconnect(&self) {
        if let Some(link) = self.link.lock().take() {
            let _ = link.shutdown(std::net::Shutdown::Both);
        }
        self.close();
    }
    fn retain(self: Arc<Self>, j: usize) -> RetainedBlock {
        let guard = self.blocks[j].lock_arc();
        self.statuses[j].store(status::RETAINED, Ordering::Release);
        self.retained.fetch_add(1, Ordering::Relaxed);
        RetainedBlock::new(self, j, Box::new(SoftHeld(guard)))
    }
    fn retained(&self) -> usize {
        self.retained.load(Ordering::Relaxed)
    }
    fn release(&self, j: usize) {
        self.retained.fetch_sub(1, Ordering::Relaxed);
        self.statuses[j].store(status::EMPTY, Ordering::Release);
        if let Some(w) = &self.window {
            // Empty first: the sender writes the block again only after this ACK.
            let mut rx = w.receiver.lock();
            rx.handle_processed(j, false);
            w.carry_out(&mut rx);
        }
    }
    fn abandon(&self, _j: usize) {
        self.retained.fetch_sub(1, Ordering::Relaxed);
    }
    /// Sleeps up to `timeout`, or, for a sleep of [`RING_AFTER`] or more, until the NIC stores a
    /// FULL status byte ([`Doorbell`]).
    fn wait(&self, timeout: std::time::Duration) {
        if timeout < RING_AFTER {
            std::thread::sleep(timeout);
            return;
        }
        let bell = &self.bell;
        let guard = bell.lock.lock().unwrap_or_else(|e| e.into_inner());
        bell.asleep.store(true, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::SeqCst);
        // Looked at first with the lock held, and again after every wake-up, so a spurious one
        // does not end the wait early.
        let idle = |_: &mut ()| {
            !self.is_closed()
                && !self
                    .statuses
                    .iter()
                    .any(|s| s.load(Ordering::Acquire) == status::FULL)
        };
        drop(bell.rung.wait_timeout_while(guard, timeout, idle));
        bell.asleep.store(false, Ordering::Relaxed);
    }
    fn notify(&self, notice: Notice) {
        if !self.is_closed() {
            self.notices.push(notice);
        }
    }
    /// What a sliding-window region posted (receives, ACK SENDs); `None` for a status-byte
    /// region, whose receiver posts nothing.
    fn work_counts(&self) -> Option<WorkCounts> {
        self.window.as_ref().map(|w| w.counts.snapshot())
    }
}

/// Send blocks in memory a transport registered itself (the verbs transport registers one
/// memory region for all of them, once, at start).
pub trait RegisteredBlocks: Send + Sync {
    /// Runs `f` with block `i` mutably.
    fn fill_block(&self, i: usize, f: &mut dyn FnMut(&mut [u8]));
    /// Runs `f` over the first `len` bytes of block `i`.
    fn read_block(&self, i: usize, len: usize, f: &mut dyn FnMut(&[u8]));
    /// Takes block `i` for as long as the returned lease lives (a source writing a frame into
    /// it before handing it over): [`Self::fill_block`] and [`Self::read_block`] wait for it.
    fn lease_block(&self, i: usize) -> Box<dyn LeasedBlock>;
}

/// Owned access to one send block (see [`SendBlocks::lease`]), movable between threads.
pub trait LeasedBlock: Send {
    /// The whole block.
    fn bytes(&self) -> &[u8];
    /// The whole block, mutably.
    fn bytes_mut(&mut self) -> &mut [u8];
}

/// A send block in ordinary memory, locked for its lease.
struct PlainLease(ArcMutexGuard<RawMutex, Box<[u8]>>);

impl LeasedBlock for PlainLease {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

enum SendMemory {
    Plain(Box<[SharedBlock]>),
    Registered(Box<dyn RegisteredBlocks>),
}

/// The sender's S send blocks (the paper's sending memory blocks). A block belongs to the filling
/// thread while its local status is 0 and to the sending thread (and the NIC) while it is 1; the
/// hand-over is by block index over channels, so the per-block lock is never contended.
pub struct SendBlocks {
    block_size: usize,
    count: usize,
    memory: SendMemory,
}

impl SendBlocks {
    /// Allocates `count` blocks of `block_size` bytes in ordinary memory, once, at start.
    pub fn new(count: usize, block_size: usize) -> Arc<SendBlocks> {
        let blocks = (0..count)
            .map(|_| Arc::new(Mutex::new(vec![0u8; block_size].into_boxed_slice())))
            .collect();
        Arc::new(SendBlocks {
            block_size,
            count,
            memory: SendMemory::Plain(blocks),
        })
    }

    /// Send blocks in transport-registered memory.
    pub fn registered(
        count: usize,
        block_size: usize,
        memory: Box<dyn RegisteredBlocks>,
    ) -> Arc<SendBlocks> {
        Arc::new(SendBlocks {
            block_size,
            count,
            memory: SendMemory::Registered(memory),
        })
    }

    /// The transport registration, if any.
    pub fn registration(&self) -> Option<&dyn RegisteredBlocks> {
        match &self.memory {
            SendMemory::Registered(r) => Some(r.as_ref()),
            SendMemory::Plain(_) => None,
        }
    }

    /// Number of send blocks.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Bytes per send block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Runs `f` with block `i` mutably (the filling thread).
    pub fn fill<R>(&self, i: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
        match &self.memory {
            SendMemory::Plain(blocks) => f(&mut blocks[i].lock()),
            SendMemory::Registered(r) => {
                let (mut f, mut out) = (Some(f), None);
                r.fill_block(i, &mut |b| out = f.take().map(|f| f(b)));
                out.expect("fill_block calls back once")
            }
        }
    }

    /// Takes block `i` until the lease is dropped: a source writes a frame's payload into it
    /// straight after the header (the engine's reservations). Only for a block whose index the
    /// caller owns (taken from the free list); [`Self::fill`] and [`Self::read`] of it wait.
    pub fn lease(&self, i: usize) -> Box<dyn LeasedBlock> {
        match &self.memory {
            SendMemory::Plain(blocks) => Box::new(PlainLease(blocks[i].lock_arc())),
            SendMemory::Registered(r) => r.lease_block(i),
        }
    }

    /// Runs `f` over the first `len` bytes of block `i` (a transport posting a WRITE).
    pub fn read<R>(&self, i: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        match &self.memory {
            SendMemory::Plain(blocks) => f(&blocks[i].lock()[..len]),
            SendMemory::Registered(r) => {
                let (mut f, mut out) = (Some(f), None);
                r.read_block(i, len, &mut |b| out = f.take().map(|f| f(b)));
                out.expect("read_block calls back once")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region() -> Arc<SoftRegion> {
        SoftRegion::new(&RegionSettings {
            reserved_blocks: vec![2],
            ..RegionSettings::plain(4, 64)
        })
    }

    /// A long idle wait (a live stream's, between frames) ends when the NIC stores a FULL status
    /// byte, not at its timeout; a FULL byte already there ends it at once. The instants are
    /// compared, not a duration the waiting thread measured: on a loaded machine that thread
    /// may start its clock well after this one (the check once read 296 ms for a 300 ms pause).
    #[test]
    fn a_full_status_byte_ends_a_long_idle_wait() {
        let r = region();
        let waiter = {
            let r = r.clone();
            std::thread::spawn(move || {
                r.wait(std::time::Duration::from_secs(30));
                std::time::Instant::now()
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(300));
        let storing = std::time::Instant::now();
        r.write_with(Target::Statuses, 1, 1, |b| {
            b[0] = status::FULL;
            Ok(())
        })
        .unwrap()
        .unwrap();
        let ended = waiter.join().unwrap();
        assert!(
            ended >= storing,
            "the wait ended {:?} before the status byte was stored",
            storing - ended
        );
        assert!(
            ended - storing < std::time::Duration::from_secs(15),
            "the wait ended {:?} after the status byte was stored, not at once",
            ended - storing
        );
        let t0 = std::time::Instant::now();
        r.wait(std::time::Duration::from_secs(30));
        assert!(t0.elapsed() < std::time::Duration::from_secs(15));
    }

    #[test]
    fn reserved_blocks_start_retained() {
        let r = region();
        assert_eq!(
            (0..4).map(|j| r.status(j)).collect::<Vec<_>>(),
            vec![0, 0, 2, 0]
        );
    }

    #[test]
    fn a_retained_block_is_status_2_until_dropped() {
        let r = region();
        r.set_status(1, status::FULL);
        let held = r.clone().retain(1);
        assert_eq!(r.status(1), status::RETAINED);
        assert_eq!(r.retained(), 1);
        assert_eq!(held.len(), 64);
        let bytes = bytes::Bytes::from_owner(held).slice(3..5);
        let clone = bytes.clone();
        drop(bytes);
        assert_eq!(r.status(1), status::RETAINED, "a clone still holds it");
        drop(clone);
        assert_eq!(r.status(1), status::EMPTY);
        assert_eq!(r.retained(), 0);
    }

    #[test]
    fn access_rights_and_bounds_are_enforced() {
        let r = region();
        assert!(
            r.read_remote(Target::Blocks, 0, 4).is_err(),
            "blocks must not be remotely readable"
        );
        assert!(
            r.write_with(Target::Blocks, 60, 8, |_| Ok(())).is_err(),
            "write across a block end"
        );
        assert!(
            r.write_with(Target::Blocks, 256, 1, |_| Ok(())).is_err(),
            "write past the region"
        );
        assert!(
            r.read_remote(Target::Statuses, 2, 4).is_err(),
            "read past the status array"
        );
        // Issue 7, attack 6: a zero-length WRITE at exactly N x B used to index past the end.
        assert!(r.write_with(Target::Blocks, 256, 0, |_| Ok(())).is_err());
        assert!(r.write_with(Target::Statuses, 4, 0, |_| Ok(())).is_err());
        assert!(r.read_remote(Target::Statuses, 4, 0).is_err());
        assert!(
            r.write_with(Target::Blocks, u64::MAX, 1, |_| Ok(()))
                .is_err()
        );
        r.write_with(Target::Blocks, 64 + 3, 2, |b| {
            b.copy_from_slice(b"hi");
            Ok(())
        })
        .unwrap()
        .unwrap();
        r.write_with(Target::Statuses, 1, 1, |b| {
            b[0] = 1;
            Ok(())
        })
        .unwrap()
        .unwrap();
        assert_eq!(
            r.read_remote(Target::Statuses, 0, 4).unwrap(),
            vec![0, 1, 2, 0]
        );
        let mut seen = Vec::new();
        r.read_block(1, &mut |b| seen.extend_from_slice(&b[3..5]));
        assert_eq!(seen, b"hi");
    }
}
