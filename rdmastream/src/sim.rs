//! A deterministic simulator of one sender and one receiver, driving the real protocol core
//! through simulated time: the sender's [`FillingMachine`] and [`SenderMachine`] (through the
//! same [`Driver`] loop as the engine's sending thread, over a simulated [`Connection`]), the
//! block codec, and the receiver's [`SenderSession`] with its reorder streams. No threads, no
//! sleeps: events are taken from a time-ordered queue, one per [`Pair::step`].
//!
//! What it can do to the pair: delay writes, reads and completions; retain blocks (status 2);
//! make the receiver take blocks in a random order or slowly; drop the connection (the sender
//! reconnects to a fresh region, resends its formats, the receiver restarts its streams);
//! corrupt the data of chosen writes (the receiver rejects the block and its device's stream
//! gives the packet up at its reorder timeout); seal blocks as a sender over a transport that
//! places them whole before their status byte does ([`SimConfig::placement`]: tcp, shm — the
//! header seal); change formats; bring a device number back after (or while) its previous
//! stream ends; and write lossy frames in place into remote blocks the sender machine lends
//! ([`SimConfig::lend`], as over shm), a while after they were lent ([`SimConfig::lend_render`]),
//! so a connection can drop in between.
//!
//! The receiver side ends in a sink that, like the engine's, recognises a frame it already
//! wrote by its index.
//!
//! It checks the mechanism's safety property on every placement — a block is only ever written
//! while its receiver status byte is 0 — and records everything the receiver delivered, with
//! the format it had for each frame, so tests can check order, completeness and contents.
//!
//! The same pair can run the sliding-window baseline instead ([`SimMechanism::SlidingWindow`],
//! [`crate::proto::window`]) over the same workload: the sender's [`WindowSender`] writes with
//! immediates, the receiver takes blocks from its receive completions in arrival order and
//! acknowledges each after processing it — a block it retains (or a lossless message's last
//! block before its message is handed on) is acknowledged only when released. Its safety check:
//! a block is only ever written at the position the receiver expects, never over a block it
//! has not acknowledged. Dropped connections are simulated for the status-byte mechanism only.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::engine::Driver;
use crate::error::Result;
use crate::proto::ack::{Ack, Settle};
use crate::proto::coalesce;
use crate::proto::window::{Immediate, ReceiverAction, WindowAction, WindowReceiver, WindowSender};
use crate::proto::{
    Added, Batch, BlockHeader, Budget, Coalescer, Delivery, FillingMachine, Limits, Message,
    MessageTimes, Packet, Placement, RemoteLayout, ReorderConfig, SenderMachine, SenderSession,
    StreamEvent, fragment_range, status,
};
use crate::transport::{
    Completion, Connection, RemoteAddr, SendBlocks, Target, WriteSource, WriteWr,
};

/// A simulated device (a source). The same `id` listed twice is a device number that comes
/// back: the second source starts at its `start` and streams once the first one's end is out.
#[derive(Debug, Clone)]
pub struct SimDevice {
    pub id: u8,
    /// Payload bytes per frame.
    pub frame_len: usize,
    pub frames: u64,
    /// Time between frames.
    pub interval: Duration,
    /// When the source is added.
    pub start: Duration,
    /// The format changes every this many frames (0: never).
    pub format_every: u64,
}

impl SimDevice {
    /// A device streaming `frames` frames of `frame_len` bytes every `interval`, from time 0.
    pub fn new(id: u8, frame_len: usize, frames: u64, interval: Duration) -> Self {
        SimDevice {
            id,
            frame_len,
            frames,
            interval,
            start: Duration::ZERO,
            format_every: 0,
        }
    }

    /// The format descriptor of frame `f`.
    pub fn format_of(&self, f: u64) -> String {
        let epoch = f.checked_div(self.format_every).unwrap_or(0);
        format!("sim/device-{},epoch={epoch}", self.id)
    }
}

/// A block the receiver keeps unavailable (status 2) for a while.
#[derive(Debug, Clone, Copy)]
pub struct Retention {
    pub block: usize,
    pub from: Duration,
    pub until: Duration,
}

/// Queue policy at the sources when the link is slower than they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimPolicy {
    DropOldest,
    Block,
}

/// Which transmission mechanism the pair runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SimMechanism {
    /// The paper's status-byte-assisted mechanism (the project's own).
    #[default]
    StatusByte,
    /// The sliding-window baseline of Tu et al.: WRITE WITH IMMEDIATE, ACKs, in-order release.
    SlidingWindow,
}

/// Everything the simulation is made of.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub mechanism: SimMechanism,
    pub remote_blocks: usize,
    pub block_size: usize,
    pub send_blocks: usize,
    pub max_outstanding: usize,
    /// First packet number of every device (near 65535 to see the numbers wrap).
    pub first_packet: u16,
    /// Post → data and status byte placed in receiver memory.
    pub write_latency: Duration,
    /// Placement → completion seen by the sender.
    pub ack_latency: Duration,
    /// Post of the status READ → its completion (the snapshot is taken half way).
    pub read_latency: Duration,
    /// Receiver time to process one block, and its idle poll interval.
    pub process_time: Duration,
    pub poll_interval: Duration,
    pub retentions: Vec<Retention>,
    /// Receiver picks a random full block instead of scanning round-robin.
    pub random_order: bool,
    pub seed: u64,
    pub devices: Vec<SimDevice>,
    pub policy: SimPolicy,
    /// Frames queued per device before the policy applies.
    pub queue_depth: usize,
    /// Drop the connection at these times; the sender reconnects to a fresh region.
    pub disconnects: Vec<Duration>,
    /// Write chains (numbered from 0 in posting order) whose data arrives corrupted: the byte
    /// at `corrupt_offset` of the block flipped (default the first payload byte).
    pub corrupt_writes: Vec<u64>,
    pub corrupt_offset: usize,
    /// What the simulated transport guarantees about placement, and so how the sender seals a
    /// block and what the receiver accepts: `Unordered` (verbs, the default) seals the whole
    /// block; `Ordered` (tcp, shm) seals the header of a single-message block only.
    pub placement: Placement,
    pub reorder: ReorderConfig,
    /// The sender's `coalesce_wait_us`: how long a small lossy message may wait to share a
    /// block with others (zero: coalescing off).
    pub coalesce_wait: Duration,
    /// Remote blocks the sender machine may lend at once for frames written in place, as over
    /// shm ([`SenderMachine::set_max_lent`]); zero: none. A lossy frame ready while one can be
    /// lent is written straight into the remote block `lend_render` later, then only its status
    /// byte is posted.
    pub lend: usize,
    pub lend_render: Duration,
    /// The connection's [`Connection::cache_budget`] (shm's keeps the receiver's working set
    /// small): at most that many bytes of remote blocks FULL at once, lowest-numbered first.
    /// `None` (the default): none, round-robin.
    pub cache_budget: Option<usize>,
    /// The connection's [`Connection::writes_lowest_first`] (tcp's): the lowest-numbered free
    /// block first, with no limit. False (the default): round-robin.
    pub lowest_first: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            mechanism: SimMechanism::StatusByte,
            remote_blocks: 4,
            block_size: 256,
            send_blocks: 3,
            max_outstanding: 2,
            first_packet: 0,
            write_latency: Duration::from_micros(5),
            ack_latency: Duration::from_micros(5),
            read_latency: Duration::from_micros(10),
            process_time: Duration::from_micros(3),
            poll_interval: Duration::from_micros(2),
            retentions: Vec::new(),
            random_order: false,
            seed: 1,
            devices: Vec::new(),
            policy: SimPolicy::Block,
            queue_depth: 4,
            disconnects: Vec::new(),
            corrupt_writes: Vec::new(),
            corrupt_offset: crate::proto::HEADER_LEN,
            placement: Placement::Unordered,
            reorder: ReorderConfig::default(),
            coalesce_wait: Duration::ZERO,
            lend: 0,
            lend_render: Duration::from_micros(2),
            cache_budget: None,
            lowest_first: false,
        }
    }
}

/// What a run produced.
#[derive(Debug, Default)]
pub struct SimReport {
    /// Frames delivered, in delivery order: device, frame index, payload.
    pub delivered: Vec<(u8, u64, Vec<u8>)>,
    /// For each delivered frame (same order), the format the receiver had for its device.
    pub formats: Vec<Option<String>>,
    /// Devices whose end of stream was delivered, in order (a returning device twice).
    pub ended: Vec<u8>,
    pub dropped: u64,
    /// Per device: frames dropped at the source queue (they add up to `dropped`).
    pub dropped_by_device: BTreeMap<u8, u64>,
    pub syncs: u64,
    /// Syncs asked for while the cache still showed free blocks (the sender's `early_syncs`).
    pub early_syncs: u64,
    pub retained_skipped: u64,
    pub gap_packets: u64,
    pub duplicates: u64,
    pub reordered: u64,
    /// Blocks the receiver rejected as invalid (and freed).
    pub invalid: u64,
    /// Valid coalesced blocks (layout version 2) the receiver took, and the messages in them.
    pub coalesced_blocks: u64,
    pub coalesced_messages: u64,
    /// Frames the stream handed on again after a reconnect, recognised by index and not
    /// written twice.
    pub redelivered: u64,
    /// Largest number of frames queued at one source.
    pub max_queue: usize,
    pub finished_at: Duration,
    /// When each block was placed in receiver memory, and at which block, in placement order.
    pub placed: Vec<(Duration, usize)>,
    /// Sliding window: times the window was full while blocks waited (the tail had caught up
    /// with the head), and ACKs the sender received.
    pub window_full: u64,
    pub acks: u64,
    /// Frames written in place into lent remote blocks whose status byte was posted, and those
    /// written into a block of a connection that had dropped (never delivered).
    pub in_place: u64,
    pub stale_in_place: u64,
    /// Most status bytes FULL in the receiver's region at once.
    pub most_full: usize,
}

/// The reference payload of frame `f` of device `d`.
pub fn payload(d: u8, f: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(31).wrapping_add(f * 7 + d as u64) as u8)
        .collect()
}

#[derive(Debug)]
enum Ev {
    Start(usize),
    Source(usize),
    /// A write chain reaches the receiver's memory: the block's bytes (none for a status byte
    /// alone: the bytes were written in place already), then its status byte.
    Placed {
        conn: u64,
        block: usize,
        bytes: Option<Vec<u8>>,
        status: u8,
    },
    /// A frame written in place into lent remote block `lent` of region `region` is complete.
    Rendered {
        lent: crate::proto::Lent,
        region: u64,
        bytes: Vec<u8>,
    },
    /// Sliding window: a WRITE WITH IMMEDIATE is placed; its receive completion is queued.
    PlacedImm {
        block: usize,
        bytes: Vec<u8>,
        imm: u32,
    },
    /// Sliding window: an ACK reaches the sender's ACK completion queue.
    AckArrived(Immediate),
    Completed {
        conn: u64,
        completion: Completion,
    },
    ReadSnapshot {
        conn: u64,
        wr_id: u64,
    },
    Poll,
    Processed {
        block: usize,
        region: u64,
    },
    ReorderTimeout,
    RetainStart(usize),
    RetainEnd(usize),
    Disconnect,
    /// Wakes the sender for its sync backoff timer.
    Wake,
    /// Wakes the filling side when held small messages must go out.
    CoalesceWake,
}

/// One block's worth of a message on its way through the [`Coalescer`]: its payload and how the
/// sender must treat its block.
#[derive(Debug, Clone)]
struct SimPart {
    data: Vec<u8>,
    delivery: Delivery,
}

impl AsRef<[u8]> for SimPart {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

enum Queued {
    Frame(u64),
    End,
}

/// What a post on the simulated connection asks the network to do.
enum Posted {
    Write {
        wr_id: u64,
        block: usize,
        bytes: Option<Vec<u8>>,
        status: u8,
    },
    Read {
        wr_id: u64,
    },
}

/// The sender's end of the simulated queue pair: posts are collected for the event queue,
/// completions delivered by it are handed out by `poll_completions`.
struct SimConnection {
    layout: RemoteLayout,
    cache_budget: Option<usize>,
    lowest_first: bool,
    blocks: Arc<SendBlocks>,
    posted: Vec<Posted>,
    completions: VecDeque<Completion>,
}

impl Connection for SimConnection {
    fn cache_budget(&self) -> Option<usize> {
        self.cache_budget
    }
    fn send_limits(&self, block_size: usize) -> crate::transport::SendLimits {
        crate::transport::SendLimits::within(self.cache_budget, block_size)
    }
    fn syncs_early(&self) -> bool {
        true
    }
    fn writes_lowest_first(&self) -> bool {
        self.lowest_first
    }
    fn completes_at_once(&self) -> bool {
        false
    }
    fn posts_here_when_idle(&self) -> bool {
        false
    }
    fn peer(&self) -> &str {
        "simulated receiver"
    }
    fn layout(&self) -> RemoteLayout {
        self.layout
    }
    fn post_write_chain(&mut self, wr_id: u64, chain: &[WriteWr<'_>]) -> Result<()> {
        let (mut block, mut bytes, mut status_byte) = (0, None, status::EMPTY);
        for wr in chain {
            match (wr.source, wr.remote.target) {
                (WriteSource::SendBlock { index, len }, Target::Blocks) => {
                    block = wr.remote.offset as usize / self.layout.block_size;
                    bytes = Some(self.blocks.read(index, len, |b| b.to_vec()));
                }
                (WriteSource::Inline(b), Target::Statuses) => {
                    if bytes.is_none() {
                        block = wr.remote.offset as usize;
                    }
                    status_byte = b[0]
                }
                other => panic!("the sender posted an unexpected write: {other:?}"),
            }
        }
        self.posted.push(Posted::Write {
            wr_id,
            block,
            bytes,
            status: status_byte,
        });
        Ok(())
    }
    fn post_read(&mut self, wr_id: u64, remote: RemoteAddr, len: usize) -> Result<()> {
        assert_eq!((remote.target, remote.offset), (Target::Statuses, 0));
        assert_eq!(
            len, self.layout.blocks,
            "a sync reads the whole status array"
        );
        self.posted.push(Posted::Read { wr_id });
        Ok(())
    }
    fn poll_completions(&mut self, out: &mut Vec<Completion>, _: Duration) -> Result<()> {
        out.extend(self.completions.drain(..));
        Ok(())
    }
    /// Drops are scheduled events, not silences.
    fn heartbeat(&mut self) -> Result<()> {
        Ok(())
    }
    /// Never: the simulator models verbs.
    fn lend_block(&self, _remote_block: usize) -> Option<Box<dyn crate::transport::LeasedBlock>> {
        None
    }
    fn take_notices(&mut self) -> Vec<crate::transport::Notice> {
        Vec::new()
    }
}

/// Frees a lossless message's last block once the sink handed the message on.
struct SimSettle {
    region: u64,
    block: usize,
    settled: Arc<Mutex<Vec<(u64, usize)>>>,
}

impl Settle for SimSettle {
    fn settle(&self) {
        self.settled.lock().push((self.region, self.block));
    }
}

/// The sliding window's two ends, when the pair runs that mechanism.
struct Window {
    sender: WindowSender,
    receiver: WindowReceiver,
    /// The receiver's completion queue: blocks arrived, in arrival order.
    arrived: VecDeque<Immediate>,
    /// Kept blocks whose lossless message is not handed on yet.
    unsettled: Vec<usize>,
}

/// One sender and one receiver, stepped through simulated time.
pub struct Pair {
    window: Option<Window>,
    cfg: SimConfig,
    t0: Instant,
    now: Duration,
    queue: BinaryHeap<Reverse<(Duration, u64, usize)>>,
    events: Vec<Option<Ev>>,
    seq: u64,
    rng: Rng,
    report: SimReport,
    // Receiver: status bytes and blocks, renewed per connection (region id).
    region_id: u64,
    statuses: Vec<u8>,
    remote: Vec<Vec<u8>>,
    busy: bool,
    cursor: usize,
    session: SenderSession,
    formats: BTreeMap<u8, String>,
    /// Blocks (region, index) whose lossless message was handed on, to free.
    settled: Arc<Mutex<Vec<(u64, usize)>>>,
    /// Frame indices the sink wrote, per device, in its current stream.
    written: BTreeMap<u8, std::collections::BTreeSet<u64>>,
    retained_now: Vec<usize>,
    timeout_at: Option<Duration>,
    // Sender.
    filling: FillingMachine,
    machine: SenderMachine,
    driver: Driver,
    conn: SimConnection,
    conn_id: u64,
    writes_posted: u64,
    free: VecDeque<usize>,
    queues: Vec<VecDeque<Queued>>,
    produced: Vec<u64>,
    /// The source streaming under each device number, and sources waiting for theirs.
    streaming: BTreeMap<u8, usize>,
    waiting: Vec<usize>,
    /// Messages planned and not yet in send blocks: message, payload, next fragment.
    pending: VecDeque<(Message, Vec<u8>, usize)>,
    /// Small messages held to share a block, and blocks' worth of messages ready to fill.
    coalescer: Coalescer<SimPart>,
    ready: VecDeque<Batch<SimPart>>,
    coalesce_wake_at: Option<Duration>,
    rr_source: usize,
    wake_at: Option<Duration>,
    ended_sources: usize,
}

impl Pair {
    /// A pair at time 0, connected, every source and fault scheduled.
    pub fn new(cfg: &SimConfig) -> Pair {
        let cfg = cfg.clone();
        let layout = RemoteLayout {
            blocks: cfg.remote_blocks,
            block_size: cfg.block_size,
        };
        let blocks = SendBlocks::new(cfg.send_blocks, cfg.block_size);
        let mut machine = SenderMachine::new(cfg.max_outstanding);
        machine.handle_connected(layout);
        machine.set_max_lent(cfg.lend);
        let n = cfg.devices.len();
        let window = (cfg.mechanism == SimMechanism::SlidingWindow).then(|| {
            assert!(
                cfg.disconnects.is_empty(),
                "dropped connections are simulated for the status-byte mechanism only"
            );
            let mut sender = WindowSender::new(cfg.max_outstanding);
            sender.handle_connected(layout);
            Window {
                sender,
                receiver: WindowReceiver::new(layout),
                arrived: VecDeque::new(),
                unsettled: Vec::new(),
            }
        });
        let mut pair = Pair {
            window,
            t0: Instant::now(),
            now: Duration::ZERO,
            queue: BinaryHeap::new(),
            events: Vec::new(),
            seq: 0,
            rng: Rng(cfg.seed.max(1)),
            report: SimReport::default(),
            region_id: 0,
            statuses: vec![status::EMPTY; cfg.remote_blocks],
            remote: vec![Vec::new(); cfg.remote_blocks],
            busy: false,
            cursor: 0,
            session: SenderSession::new(0, cfg.reorder, Limits::default()),
            formats: BTreeMap::new(),
            written: BTreeMap::new(),
            settled: Default::default(),
            retained_now: Vec::new(),
            timeout_at: None,
            filling: FillingMachine::new(cfg.block_size, cfg.send_blocks, cfg.first_packet),
            machine,
            driver: Driver::new(),
            conn: SimConnection {
                layout,
                cache_budget: cfg.cache_budget,
                lowest_first: cfg.lowest_first,
                blocks,
                posted: Vec::new(),
                completions: VecDeque::new(),
            },
            conn_id: 0,
            writes_posted: 0,
            free: (0..cfg.send_blocks).collect(),
            queues: (0..n).map(|_| VecDeque::new()).collect(),
            produced: vec![0; n],
            streaming: BTreeMap::new(),
            waiting: Vec::new(),
            pending: VecDeque::new(),
            coalescer: Coalescer::new(cfg.block_size, cfg.coalesce_wait),
            ready: VecDeque::new(),
            coalesce_wake_at: None,
            rr_source: 0,
            wake_at: None,
            ended_sources: 0,
            cfg,
        };
        pair.session.handle_connected(0, Budget::unlimited());
        for i in 0..n {
            let start = pair.cfg.devices[i].start;
            pair.push(start, Ev::Start(i));
        }
        for r in pair.cfg.retentions.clone() {
            pair.push(r.from, Ev::RetainStart(r.block));
            pair.push(r.until, Ev::RetainEnd(r.block));
        }
        for d in pair.cfg.disconnects.clone() {
            pair.push(d, Ev::Disconnect);
        }
        pair.push(Duration::ZERO, Ev::Poll);
        pair
    }

    fn push(&mut self, t: Duration, ev: Ev) {
        self.events.push(Some(ev));
        self.queue
            .push(Reverse((t, self.seq, self.events.len() - 1)));
        self.seq += 1;
    }

    fn at(&self, d: Duration) -> Instant {
        self.t0 + d
    }

    /// Simulated time now.
    pub fn now(&self) -> Duration {
        self.now
    }

    /// Whether every source's end of stream was delivered.
    pub fn is_done(&self) -> bool {
        self.report.ended.len() == self.cfg.devices.len()
    }

    /// The sender's state machine, to look at between steps.
    pub fn sender(&self) -> &SenderMachine {
        &self.machine
    }

    /// The sliding-window sender, when the pair runs that mechanism.
    pub fn window_sender(&self) -> Option<&WindowSender> {
        self.window.as_ref().map(|w| &w.sender)
    }

    /// The receiver's status bytes now.
    pub fn statuses(&self) -> &[u8] {
        &self.statuses
    }

    /// What happened so far.
    pub fn report(&self) -> &SimReport {
        &self.report
    }

    /// Runs the next event and everything it sets off on both sides. Returns false when
    /// nothing is left to run.
    pub fn step(&mut self) -> bool {
        let Some(Reverse((now, _, idx))) = self.queue.pop() else {
            return false;
        };
        self.now = now;
        let ev = self.events[idx].take().expect("each event runs once");
        self.handle(ev);
        // Blocks a turn frees are filled and sent at once, as the engine's threads would.
        loop {
            self.fill();
            if !self.send() {
                break;
            }
        }
        self.report.finished_at = now;
        true
    }

    /// Steps until every source ended and was delivered, nothing is left to run, or simulated
    /// time passes `limit`.
    pub fn drive(&mut self, limit: Duration) -> &SimReport {
        while !self.is_done() {
            match self.queue.peek() {
                Some(Reverse((t, _, _))) if *t <= limit => {
                    self.step();
                }
                _ => break,
            }
        }
        self.finish_stats();
        &self.report
    }

    /// The report, with the machines' counters.
    pub fn into_report(mut self) -> SimReport {
        self.finish_stats();
        self.report
    }

    fn finish_stats(&mut self) {
        let stats = self.machine.stats();
        self.report.syncs = stats.syncs;
        self.report.early_syncs = stats.early_syncs;
        self.report.retained_skipped = stats.retained_skipped;
        if let Some(w) = &self.window {
            self.report.window_full = w.sender.stats().window_full;
            self.report.acks = w.sender.stats().acks;
        }
        let (mut gaps, mut dups, mut reordered) = (0, 0, 0);
        for (_, s) in self.session.stats() {
            gaps += s.gap_packets;
            dups += s.duplicates;
            reordered += s.reordered;
        }
        self.report.gap_packets = gaps;
        self.report.duplicates = dups;
        self.report.reordered = reordered;
    }

    fn handle(&mut self, ev: Ev) {
        let now = self.now;
        match ev {
            Ev::Start(i) => {
                let id = self.cfg.devices[i].id;
                // `block` devices are lossless, as in the engine: kept until confirmed.
                let reliable = self.cfg.policy == SimPolicy::Block;
                match self.filling.add_device(id, reliable) {
                    Added::Streaming => {
                        self.streaming.insert(id, i);
                    }
                    Added::Waiting => self.waiting.push(i),
                }
                self.push(now, Ev::Source(i));
            }
            Ev::Source(i) => self.produce(i),
            Ev::Placed {
                conn,
                block,
                bytes,
                status: byte,
            } => {
                if conn == self.region_id {
                    assert_eq!(
                        self.statuses[block],
                        status::EMPTY,
                        "at {now:?}: sender wrote block {block} while its status byte was {}",
                        self.statuses[block]
                    );
                    match bytes {
                        Some(bytes) => self.remote[block] = bytes,
                        None => assert!(
                            !self.remote[block].is_empty(),
                            "at {now:?}: status byte of block {block} posted before its frame was written in place"
                        ),
                    }
                    self.statuses[block] = byte;
                    self.report.placed.push((now, block));
                    let full = self.statuses.iter().filter(|&&b| b == status::FULL).count();
                    self.report.most_full = self.report.most_full.max(full);
                }
            }
            Ev::Rendered {
                lent,
                region,
                bytes,
            } => {
                let j = lent.remote_block;
                if region == self.region_id {
                    // The safety property again: a source writes a lent block only while the
                    // receiver's status byte says it is free.
                    assert_eq!(
                        self.statuses[j],
                        status::EMPTY,
                        "at {now:?}: a source wrote lent block {j} while its status byte was {}",
                        self.statuses[j]
                    );
                    self.remote[j] = bytes;
                    self.report.placed.push((now, j));
                }
                let ticket = self.report.placed.len() as u64;
                self.machine.handle_placed(lent, ticket);
            }
            Ev::PlacedImm { block, bytes, imm } => {
                let w = self.window.as_mut().expect("sliding window");
                // The safety check of the window: blocks arrive in ring order, never over a
                // block the receiver has not acknowledged, always into a posted receive.
                let got = w
                    .receiver
                    .handle_received(imm)
                    .unwrap_or_else(|e| panic!("at {now:?}: {e}"));
                while let Some(a) = w.receiver.poll_action() {
                    assert!(matches!(a, ReceiverAction::PostRecv { .. }));
                }
                w.arrived.push_back(got);
                self.remote[block] = bytes;
                self.report.placed.push((now, block));
            }
            Ev::AckArrived(imm) => {
                let w = self.window.as_mut().expect("sliding window");
                w.sender
                    .handle_ack(self.t0 + now, imm)
                    .unwrap_or_else(|e| panic!("at {now:?}: {e}"));
            }
            Ev::Completed { conn, completion } => {
                if conn == self.conn_id {
                    self.conn.completions.push_back(completion);
                }
            }
            Ev::ReadSnapshot { conn, wr_id } => {
                if conn == self.conn_id {
                    let data = self.statuses.clone();
                    self.push(
                        now + self.cfg.read_latency / 2,
                        Ev::Completed {
                            conn,
                            completion: Completion::Read { wr_id, data },
                        },
                    );
                }
            }
            Ev::Wake => self.wake_at = None,
            Ev::CoalesceWake => self.coalesce_wake_at = None,
            Ev::Poll => self.poll(),
            Ev::Processed { block, region } if self.window.is_some() => {
                self.busy = false;
                let bytes = std::mem::take(&mut self.remote[block]);
                let held = self.deliver(region, block, &bytes);
                let retained = self.retained_now.contains(&block);
                let w = self.window.as_mut().expect("sliding window");
                if held {
                    w.unsettled.push(block);
                }
                w.receiver.handle_processed(block, held || retained);
                self.free_settled();
                self.send_acks();
                self.push(now, Ev::Poll);
            }
            Ev::Processed { block, region } => {
                self.busy = false;
                if region == self.region_id {
                    let bytes = std::mem::take(&mut self.remote[block]);
                    let held = self.deliver(region, block, &bytes);
                    self.statuses[block] = if held || self.retained_now.contains(&block) {
                        status::RETAINED
                    } else {
                        status::EMPTY
                    };
                    self.free_settled();
                }
                self.push(now, Ev::Poll);
            }
            Ev::ReorderTimeout => {
                self.timeout_at = None;
                let released = self.session.handle_timeouts(self.at(now));
                for r in released {
                    self.record(r.device, r.events);
                }
                self.free_settled();
                self.schedule_reorder_timeout();
            }
            Ev::RetainStart(j) if self.window.is_some() => self.retained_now.push(j),
            Ev::RetainStart(j) => {
                // The receiver may only retain a block it holds (1 → 2 when processed), or one
                // the sender has not synced yet (a fresh region): turning a 0 into 2 could race
                // with a write the sender already decided from its cache.
                self.retained_now.push(j);
                if now == Duration::ZERO && self.statuses[j] == status::EMPTY {
                    self.statuses[j] = status::RETAINED;
                }
            }
            Ev::RetainEnd(j) if self.window.is_some() => {
                self.retained_now.retain(|&b| b != j);
                let w = self.window.as_mut().expect("sliding window");
                if !w.unsettled.contains(&j) {
                    w.receiver.handle_released(j);
                }
                self.send_acks();
            }
            Ev::RetainEnd(j) => {
                self.retained_now.retain(|&b| b != j);
                if self.statuses[j] == status::RETAINED {
                    self.statuses[j] = status::EMPTY;
                }
            }
            Ev::Disconnect => self.reconnect(),
        }
    }

    /// A source produces its next frame (or its end) under the queue policy.
    fn produce(&mut self, i: usize) {
        let now = self.now;
        let d = &self.cfg.devices[i];
        let (frames, interval, id) = (d.frames, d.interval, d.id);
        if self.produced[i] < frames {
            let full = self.queues[i].len() >= self.cfg.queue_depth;
            if full && self.cfg.policy == SimPolicy::Block {
                // The source waits: try again a little later.
                self.push(now + interval / 4 + Duration::from_nanos(1), Ev::Source(i));
                return;
            }
            if full {
                self.queues[i].pop_front();
                self.report.dropped += 1;
                *self.report.dropped_by_device.entry(id).or_default() += 1;
            }
            self.queues[i].push_back(Queued::Frame(self.produced[i]));
            self.produced[i] += 1;
            self.report.max_queue = self.report.max_queue.max(self.queues[i].len());
            self.push(now + interval, Ev::Source(i));
        } else if self.produced[i] == frames {
            self.queues[i].push_back(Queued::End);
            self.produced[i] += 1;
        }
    }

    /// The receiver's polling: takes the next full block (round-robin or random).
    fn poll(&mut self) {
        if self.busy {
            return;
        }
        if let Some(w) = self.window.as_mut() {
            // The window's receiver takes blocks from its completion queue, in arrival order.
            match w.arrived.pop_front() {
                Some(imm) => {
                    self.busy = true;
                    let region = self.region_id;
                    self.push(
                        self.now + self.cfg.process_time,
                        Ev::Processed {
                            block: imm.position,
                            region,
                        },
                    );
                }
                None => self.push(self.now + self.cfg.poll_interval, Ev::Poll),
            }
            return;
        }
        let n = self.cfg.remote_blocks;
        let full: Vec<usize> = (0..n)
            .filter(|&j| self.statuses[j] == status::FULL)
            .collect();
        let pick = if full.is_empty() {
            None
        } else if self.cfg.random_order {
            Some(full[(self.rng.next() % full.len() as u64) as usize])
        } else {
            (0..n)
                .map(|k| (self.cursor + k) % n)
                .find(|j| full.contains(j))
        };
        match pick {
            Some(j) => {
                self.cursor = (j + 1) % n;
                self.busy = true;
                let region = self.region_id;
                self.push(
                    self.now + self.cfg.process_time,
                    Ev::Processed { block: j, region },
                );
            }
            None => self.push(self.now + self.cfg.poll_interval, Ev::Poll),
        }
    }

    /// The receiver validates one block and hands its packet to the sender's session.
    /// The receiver validates block `block` of region `region` and hands its packet to the
    /// sender's session. Returns whether the block stays unavailable until its message is
    /// handed on (the last block of a lossless message carries an [`Ack`]).
    fn deliver(&mut self, region: u64, block: usize, bytes: &[u8]) -> bool {
        if crate::proto::coalesce::block_version(bytes)
            == Some(crate::proto::coalesce::COALESCED_VERSION)
        {
            // Several lossy messages: each goes to the session as if it had come alone.
            let Ok(msgs) = crate::proto::coalesce::decode_coalesced(bytes, 255) else {
                self.report.invalid += 1;
                return false;
            };
            self.report.coalesced_blocks += 1;
            self.report.coalesced_messages += msgs.len() as u64;
            for (header, range) in msgs {
                let packet = Packet {
                    header,
                    payload: bytes::Bytes::copy_from_slice(&bytes[range]),
                    ack: None,
                };
                let r = self.session.handle_packet(self.at(self.now), packet);
                self.record(r.device, r.events);
            }
            self.schedule_reorder_timeout();
            return false;
        }
        let Ok((h, p)) = BlockHeader::decode_block_on(bytes, 255, self.cfg.placement) else {
            self.report.invalid += 1;
            return false;
        };
        let held = h.is_reliable() && h.is_last_fragment();
        let packet = Packet {
            header: h,
            payload: bytes::Bytes::copy_from_slice(p),
            ack: held.then(|| {
                Ack::new(Arc::new(SimSettle {
                    region,
                    block,
                    settled: self.settled.clone(),
                }))
            }),
        };
        let r = self.session.handle_packet(self.at(self.now), packet);
        self.record(r.device, r.events);
        self.schedule_reorder_timeout();
        held
    }

    /// Blocks whose message was handed on go back to the sender (status 0, or their ACK).
    fn free_settled(&mut self) {
        if let Some(w) = self.window.as_mut() {
            for (_, block) in std::mem::take(&mut *self.settled.lock()) {
                w.unsettled.retain(|&b| b != block);
                if !self.retained_now.contains(&block) {
                    w.receiver.handle_released(block);
                }
            }
            return;
        }
        for (region, block) in std::mem::take(&mut *self.settled.lock()) {
            if region == self.region_id && self.statuses[block] == status::RETAINED {
                self.statuses[block] = if self.retained_now.contains(&block) {
                    status::RETAINED
                } else {
                    status::EMPTY
                };
            }
        }
    }

    /// Sliding window: the receiver SENDs the ACKs it has; each reaches the sender's ACK
    /// completion queue after a write and a completion latency.
    fn send_acks(&mut self) {
        let Some(w) = self.window.as_mut() else {
            return;
        };
        let mut acks = Vec::new();
        while let Some(a) = w.receiver.poll_action() {
            if let ReceiverAction::SendAck(imm) = a {
                acks.push(imm);
            }
        }
        let at = self.now + self.cfg.write_latency + self.cfg.ack_latency;
        for imm in acks {
            self.push(at, Ev::AckArrived(imm));
        }
    }

    /// The sink: writes what a device's stream handed on, and settles each acknowledgement once
    /// its message is written (or recognised as written already).
    fn record(&mut self, device: u8, events: Vec<StreamEvent>) {
        for e in events {
            crate::proto::ack::settle(e.ack());
            match e {
                StreamEvent::Frame(f) => {
                    // The sink recognises a frame it already wrote by its index (a reconnect
                    // restarts the stream at what the sender sends again), as the engine's do.
                    if !self.written.entry(device).or_default().insert(f.index) {
                        self.report.redelivered += 1;
                        continue;
                    }
                    self.report
                        .delivered
                        .push((f.device, f.index, f.data.to_vec()));
                    self.report.formats.push(self.formats.get(&device).cloned());
                }
                StreamEvent::EndOfStream { .. } => {
                    self.written.remove(&device);
                    self.report.ended.push(device)
                }
                StreamEvent::Format { descriptor, .. } => {
                    self.formats
                        .insert(device, String::from_utf8_lossy(&descriptor).into_owned());
                }
            }
        }
    }

    fn schedule_reorder_timeout(&mut self) {
        let Some(t) = self.session.poll_timeout() else {
            return;
        };
        let due = t.saturating_duration_since(self.t0);
        if self.timeout_at.is_none_or(|at| due < at) {
            self.timeout_at = Some(due);
            self.push(due.max(self.now), Ev::ReorderTimeout);
        }
    }

    /// The connection drops: the receiver finishes the full blocks of the old region, then
    /// frees it; work in flight is lost (or was placed without its completion arriving) and is
    /// resent. The sender reconnects at once to a fresh region in the same session.
    fn reconnect(&mut self) {
        let n = self.cfg.remote_blocks;
        for k in 0..n {
            let j = (self.cursor + k) % n;
            if self.statuses[j] == status::FULL {
                let bytes = std::mem::take(&mut self.remote[j]);
                let region = self.region_id;
                self.deliver(region, j, &bytes);
            }
        }
        self.busy = false;
        self.session.handle_disconnected();
        self.machine.handle_disconnected();
        self.filling.handle_disconnected();
        self.conn.completions.clear();
        self.conn_id += 1;
        self.region_id = self.conn_id;
        self.statuses = vec![status::EMPTY; n];
        for &j in &self.retained_now {
            self.statuses[j] = status::RETAINED;
        }
        let session = self.session.session();
        self.session.handle_connected(session, Budget::unlimited());
        self.machine.handle_connected(self.conn.layout);
        self.machine.set_max_lent(self.cfg.lend);
    }

    /// The filling thread: plans messages from the sources (round-robin over streaming
    /// devices) and fills free send blocks with them.
    fn fill(&mut self) {
        loop {
            let now = self.at(self.now);
            if let Some(batch) = self.coalescer.handle_timeout(now) {
                self.ready.push_back(batch);
            }
            if self.ready.is_empty() {
                // Hand the next block of the next planned message to the coalescer.
                if self.pending.is_empty() && !self.plan_next() {
                    if let Some(t) = self.coalescer.poll_timeout() {
                        let due = t.saturating_duration_since(self.t0);
                        if self.coalesce_wake_at != Some(due) {
                            self.coalesce_wake_at = Some(due);
                            self.push(due, Ev::CoalesceWake);
                        }
                    }
                    return;
                }
                let (msg, data, k) = self.pending.front_mut().expect("not empty");
                let h = msg.headers[*k];
                let range = fragment_range(*k, data.len(), self.cfg.block_size);
                *k += 1;
                let done = *k == msg.headers.len();
                let delivery = if msg.reliable {
                    Delivery::Confirmed { last: done }
                } else {
                    Delivery::Unconfirmed
                };
                let part = SimPart {
                    data: data[range].to_vec(),
                    delivery,
                };
                if done {
                    self.pending.pop_front();
                }
                let batches = self.coalescer.handle_message(now, h, part);
                self.ready.extend(batches);
                continue;
            }
            if self.lend_next() {
                continue;
            }
            let Some(b) = self.free.front().copied() else {
                return;
            };
            let mut batch = self.ready.pop_front().expect("not empty");
            // As the engine's filling thread: a block of one message is sealed for the
            // transport's placement (a coalesced block keeps the full seal).
            if let [(h, _)] = &mut batch[..] {
                *h = h.sealed_for(self.cfg.placement);
            }
            let used = self
                .conn
                .blocks
                .fill(b, |block| coalesce::encode_batch(&batch, block));
            self.free.pop_front();
            // Only lossy messages share a block; a lone message keeps its own delivery.
            let delivery = match &batch[..] {
                [(_, part)] => part.delivery,
                _ => Delivery::Unconfirmed,
            };
            match self.window.as_mut() {
                Some(w) => w.sender.handle_filled(b, used, delivery),
                None => self.machine.handle_filled(b, used, delivery),
            }
        }
    }

    /// As a source writing a frame in place over shm: the next ready block, when it is one
    /// lossy frame alone and the machine lends a remote block now, is written straight into
    /// that block `lend_render` later ([`Ev::Rendered`]). True when it took the block.
    fn lend_next(&mut self) -> bool {
        if self.cfg.lend == 0 || self.window.is_some() {
            return false;
        }
        let Some([(h, part)]) = self.ready.front().map(|b| &b[..]) else {
            return false;
        };
        if part.delivery != Delivery::Unconfirmed || h.is_format() || h.is_end_of_stream() {
            return false;
        }
        let Some(lent) = self.machine.lend() else {
            return false;
        };
        let mut batch = self.ready.pop_front().expect("not empty");
        batch[0].0 = batch[0].0.sealed_for(self.cfg.placement);
        let mut bytes = vec![0; self.cfg.block_size];
        let used = coalesce::encode_batch(&batch, &mut bytes);
        bytes.truncate(used);
        let region = self.region_id;
        self.push(
            self.now + self.cfg.lend_render,
            Ev::Rendered {
                lent,
                region,
                bytes,
            },
        );
        true
    }

    /// Plans the next message of the next source that has one. False when none has.
    fn plan_next(&mut self) -> bool {
        let n = self.cfg.devices.len();
        let next = (0..n).map(|k| (self.rr_source + k) % n).find(|&i| {
            self.streaming.get(&self.cfg.devices[i].id) == Some(&i) && !self.queues[i].is_empty()
        });
        let Some(i) = next else { return false };
        self.rr_source = (i + 1) % n;
        let d = self.cfg.devices[i].clone();
        let ts = self.now.as_nanos() as u64;
        match self.queues[i].pop_front().expect("not empty") {
            Queued::Frame(f) => {
                let format = d.format_of(f);
                let plan = self
                    .filling
                    .frame(d.id, &format, f, d.frame_len, MessageTimes::at(ts));
                if let Some(m) = plan.format {
                    self.pending.push_back((m, format.into_bytes(), 0));
                }
                let frame = plan.frame.expect("simulated frames fit");
                self.pending
                    .push_back((frame, payload(d.id, f, d.frame_len), 0));
            }
            Queued::End => {
                if let Some((m, text)) = self.filling.stale_format(d.id, ts) {
                    self.pending.push_back((m, text.into_bytes(), 0));
                }
                let (end, resumed) = self.filling.end(d.id, ts);
                self.pending.push_back((end, Vec::new(), 0));
                self.streaming.remove(&d.id);
                self.ended_sources += 1;
                if resumed.is_some() {
                    let k = self
                        .waiting
                        .iter()
                        .position(|&w| self.cfg.devices[w].id == d.id)
                        .expect("a waiting source");
                    let w = self.waiting.remove(k);
                    self.streaming.insert(d.id, w);
                }
            }
        }
        true
    }

    /// The sending thread: one [`Driver`] turn, posts turned into network events, freed
    /// blocks back to the filling side, and a wake-up for the sync backoff timer. Returns
    /// whether blocks were freed while messages wait for them.
    fn send(&mut self) -> bool {
        if self.window.is_some() {
            return self.send_window();
        }
        let (t0, now) = (self.t0, self.now);
        self.driver
            .turn(
                &mut self.machine,
                &mut self.conn,
                &|| t0 + now,
                Duration::ZERO,
            )
            .expect("the simulated connection does not fail");
        let conn = self.conn_id;
        for p in std::mem::take(&mut self.conn.posted) {
            match p {
                Posted::Write {
                    wr_id,
                    block,
                    mut bytes,
                    status,
                } => {
                    if self.cfg.corrupt_writes.contains(&self.writes_posted)
                        && let Some(b) = bytes
                            .as_mut()
                            .and_then(|b| b.get_mut(self.cfg.corrupt_offset))
                    {
                        *b ^= 0xff;
                    }
                    self.writes_posted += 1;
                    let placed = now + self.cfg.write_latency;
                    self.push(
                        placed,
                        Ev::Placed {
                            conn,
                            block,
                            bytes,
                            status,
                        },
                    );
                    self.push(
                        placed + self.cfg.ack_latency,
                        Ev::Completed {
                            conn,
                            completion: Completion::Write { wr_id },
                        },
                    );
                }
                Posted::Read { wr_id } => {
                    self.push(
                        now + self.cfg.read_latency / 2,
                        Ev::ReadSnapshot { conn, wr_id },
                    );
                }
            }
        }
        let mut freed = false;
        while let Some(b) = self.machine.poll_freed() {
            self.free.push_back(b);
            freed = true;
        }
        while let Some((_, delivered)) = self.machine.poll_placed() {
            if delivered {
                self.report.in_place += 1;
            } else {
                self.report.stale_in_place += 1;
            }
        }
        if let Some(t) = self.machine.poll_timeout() {
            let due = now + t.saturating_duration_since(t0 + now);
            if self.wake_at != Some(due) {
                self.wake_at = Some(due);
                self.push(due, Ev::Wake);
            }
        }
        freed && !(self.pending.is_empty() && self.ready.is_empty())
    }
}

impl Pair {
    /// The sliding window's sending thread: completions handed to the machine, every write it
    /// allows posted as a WRITE WITH IMMEDIATE (placed, then completed at the sender), freed
    /// blocks back to the filling side. ACKs arrive as their own events (the ACK thread).
    fn send_window(&mut self) -> bool {
        let now = self.now;
        let w = self.window.as_mut().expect("sliding window");
        for c in self.conn.completions.drain(..) {
            w.sender.handle_write_completed(c.wr_id());
        }
        let mut posted = Vec::new();
        while let Some(WindowAction::WriteImm {
            wr_id,
            send_block,
            imm,
        }) = w.sender.poll_action(self.t0 + now)
        {
            let bytes = self.conn.blocks.read(send_block, imm.len, |b| b.to_vec());
            posted.push((wr_id, imm, bytes));
        }
        let mut freed = false;
        while let Some(b) = w.sender.poll_freed() {
            self.free.push_back(b);
            freed = true;
        }
        let conn = self.conn_id;
        for (wr_id, imm, mut bytes) in posted {
            if self.cfg.corrupt_writes.contains(&self.writes_posted)
                && let Some(b) = bytes.get_mut(self.cfg.corrupt_offset)
            {
                *b ^= 0xff;
            }
            self.writes_posted += 1;
            let placed = now + self.cfg.write_latency;
            self.push(
                placed,
                Ev::PlacedImm {
                    block: imm.position,
                    bytes,
                    imm: imm.encode(),
                },
            );
            self.push(
                placed + self.cfg.ack_latency,
                Ev::Completed {
                    conn,
                    completion: Completion::Write { wr_id },
                },
            );
        }
        freed && !self.pending.is_empty()
    }
}

/// Runs a simulation to completion (every source ended and delivered, or `limit` of simulated
/// time passed). Panics if the sender ever writes a block whose status byte is not 0.
pub fn run(cfg: &SimConfig, limit: Duration) -> SimReport {
    let mut pair = Pair::new(cfg);
    pair.drive(limit);
    pair.into_report()
}
