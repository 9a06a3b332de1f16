//! The receiver's threads: an accepting thread, and per connected sender one polling thread that
//! scans the status bytes of that sender's region, validates each full block, copies it out,
//! frees it (status 0) and feeds the per-device reorder buffers. It never posts a work request.
//! Complete frames go to a [`FrameSink`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::{Result, spawn};
use bytes::Bytes;

use crate::proto::coalesce;
use crate::proto::{
    BlockError, BlockHeader, BlockScanner, Budget, HEADER_LEN, Limits, Packet, Released,
    ReorderConfig, SenderSession, StreamEvent, TRAILER_LEN,
};
use crate::stats::{DeviceCounters, Registry, unix_now_ns};
use crate::transport::{AcceptWaker, Accepted, Listener, RefusalKind, Region, RetainedBlock};

/// A device of a sender: what the receiver's output and stats are keyed by.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamKey {
    pub sender: String,
    pub device: u8,
}

impl std::fmt::Display for StreamKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/d{:03}", self.sender, self.device)
    }
}

/// Where complete frames go.
pub trait FrameSink: Send + Sync {
    /// One event of one device, in order. `session` is the sender process's random session id:
    /// a new one means a new stream of frames (a restarted sender), whose files must not replace
    /// the earlier ones. May block (back-pressure: blocks stay full and the sender waits or
    /// drops at its sources).
    fn handle(
        &self,
        key: &StreamKey,
        session: u64,
        counters: &Arc<DeviceCounters>,
        event: StreamEvent,
    );
    /// The receiver is stopping: stop retrying what keeps failing (what cannot be handed on now
    /// is given up, counted, and — for lossless devices — left unconfirmed, so the sender keeps it).
    fn stopping(&self) {}
    /// Waits until everything handed over is done (files written).
    fn flush(&self) {}
    /// Whether this sink lets go of a frame's bytes as soon as it settles the frame's
    /// acknowledgement (the directory output: a file written, renamed, then dropped). A
    /// lossless one-block frame is then handed on as the receiver's block itself instead of a
    /// copy: the block is freed at the same moment either way. A sink that may keep a frame's
    /// memory after acknowledging it (a GStreamer pipeline, a test that collects frames) says
    /// no, the default: holding the block would hold back the acknowledgement, and with it the
    /// sender's send blocks (docs/protocol.md, "Lossless delivery").
    fn lets_frames_go(&self) -> bool {
        false
    }
}

/// The shortest idle sleep of a polling thread whose region rings when a block comes (shm):
/// the ring ends the sleep, so this only bounds how often an idle receiver wakes to check its
/// reorder timeouts (every 10 ms, as a busy one does) and whether it is stopping.
pub const RINGING_IDLE: Duration = Duration::from_millis(10);

/// Receiver settings.
#[derive(Debug, Clone)]
pub struct ReceiverOptions {
    /// Highest device number accepted; blocks from others are invalid.
    pub max_device: u8,
    pub reorder: ReorderConfig,
    /// Memory for reassembly and copied payloads (the same budget regions come from), and the
    /// largest message accepted.
    pub limits: Limits,
    /// Sleep between status scans when idle: starts at `poll_min`, doubles up to `poll_max`.
    /// Over shm the sender's doorbell ends the sleep when a block comes, so the sleep only
    /// bounds how often an idle receiver looks at its timeouts: `poll_max`, but at least
    /// [`RINGING_IDLE`], from the start.
    pub poll_min: Duration,
    pub poll_max: Duration,
    /// For this long after a block was taken, the polling thread yields instead of sleeping
    /// (the next block of a busy stream is usually close behind, and a sleep of even `poll_min`
    /// costs the kernel's timer slack on top); zero: sleep at once. Not over shm, whose
    /// doorbell ends the sleep when a block comes ([`crate::transport::Region::wakes`]).
    pub poll_spin: Duration,
    /// A sender without a connection for this long counts as gone (it will not end its
    /// streams): see [`ReceiverHandle::all_senders_ended`].
    pub gone_after: Duration,
}

impl Default for ReceiverOptions {
    fn default() -> Self {
        ReceiverOptions {
            max_device: 255,
            reorder: ReorderConfig::default(),
            limits: Limits::default(),
            poll_min: Duration::from_micros(20),
            poll_max: Duration::from_micros(500),
            poll_spin: Duration::from_micros(50),
            gone_after: crate::transport::DEFAULT_PEER_TIMEOUT,
        }
    }
}

struct SenderState {
    /// The protocol's view of this sender: session, streams, formats, ends.
    session: SenderSession,
    connections: usize,
    /// Since when no connection of this sender is up (`None` while one is).
    idle_since: Option<Instant>,
}

/// Senders without a connection whose numbering state is kept at most (for a reconnect in the
/// same session); beyond that the longest idle is forgotten, so names a peer makes up cannot
/// grow the receiver's memory.
const MAX_IDLE_SENDERS: usize = 64;

/// Counts of invalid blocks, per kind.
#[derive(Default)]
pub struct InvalidCounts {
    counts: Mutex<BTreeMap<BlockError, u64>>,
}

impl InvalidCounts {
    fn record(&self, e: BlockError, sender: &str, peer: &str) {
        *self.counts.lock().entry(e).or_insert(0) += 1;
        if e == BlockError::WeakSeal {
            // Not a torn block: a sender that seals for an ordered transport (tcp, shm) on one
            // that is not (verbs) — a broken or hostile peer. Say so, once per sender.
            crate::warn_limited!(
                format!("invalid-{e}-{sender}"),
                "invalid block ({e}) from sender '{sender}' at {peer}: sealed over its header only, which this transport does not allow (its placement order is not guaranteed); freed and counted"
            );
            return;
        }
        crate::warn_limited!(
            format!("invalid-{e}-{sender}"),
            "invalid block ({e}) from sender '{sender}' at {peer}; freed and counted"
        );
    }

    /// All counts.
    pub fn all(&self) -> BTreeMap<BlockError, u64> {
        self.counts.lock().clone()
    }

    /// Sum over kinds.
    pub fn total(&self) -> u64 {
        self.counts.lock().values().sum()
    }
}

struct Shared {
    opts: ReceiverOptions,
    sink: Arc<dyn FrameSink>,
    senders: Mutex<HashMap<String, SenderState>>,
    counters: Registry<StreamKey>,
    invalid: InvalidCounts,
    /// Blocks processed (valid or not).
    blocks: AtomicU64,
    /// Status scans that found nothing (idle polls).
    idle_polls: AtomicU64,
    /// Connections the listener turned away, in all and by kind of reason.
    refused: AtomicU64,
    refused_by_kind: Mutex<BTreeMap<RefusalKind, u64>>,
    stop: AtomicBool,
    /// Ends the accepting thread's wait: at a stop, and when a sender's last connection is gone
    /// (its reorder timeouts are the accepting thread's to check from then on).
    waker: AcceptWaker,
}

/// A running receiver.
pub struct ReceiverHandle {
    shared: Arc<Shared>,
    accepting: Option<JoinHandle<()>>,
    pollers: Arc<Mutex<Vec<JoinHandle<()>>>>,
    local_addr: String,
}

impl ReceiverHandle {
    /// Starts accepting senders on `listener`.
    pub fn start(
        opts: ReceiverOptions,
        listener: Box<dyn Listener>,
        sink: Arc<dyn FrameSink>,
    ) -> Result<ReceiverHandle> {
        let shared = Arc::new(Shared {
            opts,
            sink,
            senders: Mutex::new(HashMap::new()),
            counters: Registry::default(),
            invalid: InvalidCounts::default(),
            blocks: AtomicU64::new(0),
            idle_polls: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            refused_by_kind: Mutex::new(BTreeMap::new()),
            stop: AtomicBool::new(false),
            waker: listener.waker(),
        });
        let pollers = Arc::new(Mutex::new(Vec::new()));
        let local_addr = listener.local_addr();
        let accepting = {
            let (shared, pollers) = (shared.clone(), pollers.clone());
            spawn("accept", move || accept_loop(listener, shared, pollers))?
        };
        Ok(ReceiverHandle {
            shared,
            accepting: Some(accepting),
            pollers,
            local_addr,
        })
    }

    /// Where the listener listens.
    pub fn local_addr(&self) -> &str {
        &self.local_addr
    }

    /// Per sender/device counters.
    pub fn counters(&self) -> &Registry<StreamKey> {
        &self.shared.counters
    }

    /// Invalid blocks per kind.
    pub fn invalid(&self) -> &InvalidCounts {
        &self.shared.invalid
    }

    /// Blocks processed so far.
    pub fn blocks(&self) -> u64 {
        self.shared.blocks.load(Ordering::Relaxed)
    }

    /// Connections turned away so far (bad handshake, wrong token, ...).
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
    }

    /// Connections turned away so far, by kind of reason.
    pub fn refused_by_kind(&self) -> BTreeMap<RefusalKind, u64> {
        self.shared.refused_by_kind.lock().clone()
    }

    /// Idle status scans so far.
    pub fn idle_polls(&self) -> u64 {
        self.shared.idle_polls.load(Ordering::Relaxed)
    }

    /// Reorder counters summed per sender/device.
    pub fn reorder_stats(&self) -> Vec<(StreamKey, crate::proto::ReorderStats)> {
        let senders = self.shared.senders.lock();
        let mut out: Vec<_> = senders
            .iter()
            .flat_map(|(name, s)| {
                s.session.stats().map(move |(device, st)| {
                    (
                        StreamKey {
                            sender: name.clone(),
                            device,
                        },
                        st,
                    )
                })
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// True when at least one sender connected, and every sender seen has closed its
    /// connections after ending every device it sent — or has been gone (no connection) for
    /// longer than `gone_after` (killed, or its link died: it will not end its streams).
    pub fn all_senders_ended(&self) -> bool {
        let gone_after = self.shared.opts.gone_after;
        let senders = self.shared.senders.lock();
        !senders.is_empty()
            && senders.values().all(|s| {
                s.connections == 0
                    && (s.session.all_ended()
                        || s.idle_since.is_some_and(|t| t.elapsed() >= gone_after))
            })
    }

    /// Stops accepting and polling, and flushes the sink.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.waker.wake();
        if let Some(a) = self.accepting.take() {
            let _ = a.join();
        }
        for p in self.pollers.lock().drain(..) {
            let _ = p.join();
        }
        self.shared.sink.stopping();
        self.shared.sink.flush();
    }
}

impl Drop for ReceiverHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The accepting thread's longest wait. Every event it handles ends its wait early, so this is
/// only a backstop: an idle receiver's accepting thread wakes once in this long.
const ACCEPT_WAIT: Duration = Duration::from_secs(5);
/// Its shortest wait for an idle sender's reorder timeout, so a timeout that is due again at
/// once cannot make it spin.
const ACCEPT_WAIT_MIN: Duration = Duration::from_millis(5);

fn accept_loop(
    mut listener: Box<dyn Listener>,
    shared: Arc<Shared>,
    pollers: Arc<Mutex<Vec<JoinHandle<()>>>>,
) {
    while !shared.stop.load(Ordering::Acquire) {
        // Each refusal was logged where it happened; here it is counted.
        let refusals = listener.refusals();
        if !refusals.is_empty() {
            shared
                .refused
                .fetch_add(refusals.len() as u64, Ordering::Relaxed);
            let mut by_kind = shared.refused_by_kind.lock();
            for r in &refusals {
                *by_kind.entry(r.kind).or_insert(0) += 1;
            }
        }
        // A sender's reorder timeouts are checked by its polling thread; once its last
        // connection is gone they are checked here, so what waited behind a lost packet (an end
        // of stream, say) is still given up and delivered. No poller of that sender is running
        // (connections are counted here, in this thread), so nothing is delivered twice at once.
        let idle: Vec<String> = shared
            .senders
            .lock()
            .iter()
            .filter(|(_, s)| s.connections == 0)
            .map(|(name, _)| name.clone())
            .collect();
        let now = Instant::now();
        // Wait for a sender, a refusal, a stop or a sender's last disconnection (the listener
        // returns early for each), or until the next reorder timeout of an idle sender.
        let next_timeout = idle
            .iter()
            .filter_map(|name| check_timeouts(&shared, &mut Streams::new(name), now))
            .min();
        let wait = next_timeout.map_or(ACCEPT_WAIT, |t| {
            t.saturating_duration_since(now)
                .clamp(ACCEPT_WAIT_MIN, ACCEPT_WAIT)
        });
        match listener.accept(wait) {
            Ok(Some(accepted)) => {
                let name = accepted.hello.sender.clone();
                tracing::info!(sender = %name, peer = %accepted.peer, transport = listener.transport(), "sender connected");
                {
                    let mut senders = shared.senders.lock();
                    forget_idle_senders(&mut senders, &name);
                    let state = senders.entry(name.clone()).or_insert_with(|| SenderState {
                        session: SenderSession::new(
                            accepted.hello.session,
                            shared.opts.reorder,
                            Limits {
                                budget: accepted.memory.clone(),
                                max_message: shared.opts.limits.max_message,
                            },
                        ),
                        connections: 0,
                        idle_since: None,
                    });
                    // A new session starts every stream afresh; the same one carries on.
                    // A sliding-window connection carries one device: only its stream
                    // starts afresh.
                    let lane = match accepted.hello.mechanism {
                        crate::proto::handshake::Mechanism::SlidingWindow { device } => {
                            Some(device)
                        }
                        crate::proto::handshake::Mechanism::StatusByte => None,
                    };
                    state.session.handle_lane_connected(
                        accepted.hello.session,
                        accepted.memory.clone(),
                        lane,
                    );
                    state.connections += 1;
                    state.idle_since = None;
                }
                let shared = shared.clone();
                match spawn(format!("poll-{name}"), move || {
                    poll_region(accepted, shared)
                }) {
                    Ok(h) => {
                        let mut p = pollers.lock();
                        p.retain(|h| !h.is_finished());
                        p.push(h);
                    }
                    Err(e) => tracing::error!("{e}"),
                }
            }
            Ok(None) => {}
            Err(e) => {
                tracing::error!("accepting: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Forgets the longest-idle senders (no connection, nothing held) beyond [`MAX_IDLE_SENDERS`],
/// keeping `keep` (about to connect).
fn forget_idle_senders(senders: &mut HashMap<String, SenderState>, keep: &str) {
    let mut idle: Vec<(Instant, String)> = senders
        .iter()
        .filter(|(n, s)| n.as_str() != keep && s.connections == 0)
        .filter_map(|(n, s)| Some((s.idle_since?, n.clone())))
        .collect();
    if idle.len() < MAX_IDLE_SENDERS {
        return;
    }
    idle.sort();
    for (_, name) in &idle[..idle.len() + 1 - MAX_IDLE_SENDERS] {
        senders.remove(name);
    }
}

/// Ends a connection's bookkeeping however its polling thread ends (unwinding included): the
/// region is disconnected, the sender's connection count goes down and, when it was the last,
/// the memory its half-reassembled messages held is given back.
struct ConnectionGuard {
    shared: Arc<Shared>,
    name: String,
    region: Arc<dyn Region>,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.region.disconnect();
        if let Some(s) = self.shared.senders.lock().get_mut(&self.name) {
            s.connections = s.connections.saturating_sub(1);
            if s.connections == 0 {
                s.idle_since = Some(Instant::now());
                s.session.handle_disconnected();
                self.shared.waker.wake();
            }
        }
    }
}

/// The receiving thread of one connection: poll status bytes, validate, copy out, free, route.
fn poll_region(accepted: Accepted, shared: Arc<Shared>) {
    let Accepted {
        hello,
        peer,
        region,
        lease,
        memory,
    } = accepted;
    let name = hello.sender.clone();
    let session = hello.session;
    let mut memory_wait: Option<Instant> = None;
    // Dropped last (after the guard): the name is free only once this connection is wound down.
    let _lease = lease;
    let _guard = ConnectionGuard {
        shared: shared.clone(),
        name: name.clone(),
        region: region.clone(),
    };
    let n = region.layout().blocks;
    let mut scanner = BlockScanner::default();
    // A region whose sender rings when it stores a status byte (shm) is waited on for the
    // longest sleep at once, and without the yielding spin: the wait ends when a block comes,
    // not after the sleep. (Measured with the doorbell: without the spin the engine over shm
    // moved as much, and unthrottled rdmasink/rdmasrc ran at 17.2-18.3k instead of 14.9-17.1k
    // frames/s, p99 0.25-0.34 instead of 0.39-0.55 ms: the yields took CPU from the sender.)
    //
    // That sleep is at least RINGING_IDLE: it ends early whenever a block comes, so all it
    // bounds is how often an idle receiver wakes for its timeouts. (Measured, `gst-bench
    // --transport shm --in-place`, four runs each way: with 500 µs the receiver took 46-48 %
    // of a core unthrottled and 3-5 % at 25 fps, with 10 ms 27-31 % and 1 %, p99 the same.)
    let (poll_min, poll_spin, poll_max) = if region.wakes() {
        let sleep = shared.opts.poll_max.max(RINGING_IDLE);
        (sleep, Duration::ZERO, sleep)
    } else {
        (
            shared.opts.poll_min,
            shared.opts.poll_spin,
            shared.opts.poll_max,
        )
    };
    let mut idle = poll_min;
    // The sleep while waiting for memory: as over tcp, from `poll_min` doubling to `poll_max`.
    let mut memory_idle = shared.opts.poll_min;
    let mut last_block = Instant::now();
    // Keep at least half the blocks for the sender: beyond that, payloads are copied. Lossless
    // frames go to the sink as their blocks too when it lets them go at once.
    let zero_copy_limit = n / 2;
    let zero_copy = (zero_copy_limit, shared.sink.lets_frames_go());
    let mut copy_logged = false;
    let mut next_timeout_check = Instant::now();
    let mut streams = Streams::new(&name);
    loop {
        // Read `closed` before scanning: a block written before the close is then seen.
        let closed = region.is_closed();
        let full = scanner.next_full(n, |j| region.status(j));
        let room = full.is_none_or(|j| has_room(&shared, &name, &region, j, zero_copy, &memory));
        if let (Some(j), true) = (full, room) {
            memory_wait = None;
            memory_idle = shared.opts.poll_min;
            let over = region.retained() >= zero_copy_limit;
            if over && !copy_logged {
                tracing::debug!(sender = %name, "{} of {n} blocks are held downstream; copying payloads until some are released", region.retained());
            }
            copy_logged = over;
            let packets = take_block(&region, j, shared.opts.max_device, zero_copy, &memory);
            shared.blocks.fetch_add(1, Ordering::Relaxed);
            match packets {
                // A coalesced block's messages, in block order, each as if it came alone.
                Ok(ps) => route(&shared, &mut streams, session, ps),
                Err(e) => shared.invalid.record(e, &name, &peer),
            }
            idle = poll_min;
            last_block = Instant::now();
            continue;
        }
        if let (Some(j), false) = (full, room) {
            // Back-pressure: this sender's memory share is taken by frames still on their way
            // to disk (or held by a GStreamer pipeline). Its blocks stay full, so it waits; the
            // block is taken first once there is room, so nothing is taken out of order.
            scanner.retry(j);
            let since = *memory_wait.get_or_insert_with(Instant::now);
            if since.elapsed() > Duration::from_secs(2) {
                crate::warn_limited!(
                    format!("memory-wait-{name}"),
                    "sender '{name}': waiting {:.1} s for memory ({} of its {} bytes in use by frames not yet written)",
                    since.elapsed().as_secs_f64(),
                    memory.used(),
                    memory.limit()
                );
            }
        }
        if closed {
            break;
        }
        if shared.stop.load(Ordering::Acquire) {
            region.disconnect();
            break;
        }
        shared.idle_polls.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        // While it waits for memory, nothing of this sender is missing: it is in the region.
        // Its reorder timeouts wait too.
        if memory_wait.is_none() && now >= next_timeout_check {
            check_timeouts(&shared, &mut streams, now);
            next_timeout_check = now + Duration::from_millis(10);
        }
        if now.duration_since(last_block) < poll_spin {
            std::thread::yield_now();
            continue;
        }
        if memory_wait.is_some() {
            // Waiting for memory, not for a block: the block that waits is FULL already, so a
            // ringing region's wait would return at once and this thread would spin (over shm
            // it took a whole core behind a slow downstream). Sleep, as over tcp: from
            // `poll_min`, doubling to `poll_max`.
            std::thread::sleep(memory_idle);
            memory_idle = (memory_idle * 2).min(shared.opts.poll_max);
        } else {
            // Over shm the sender's doorbell cuts this short when it stores a status byte.
            region.wait(idle);
        }
        idle = (idle * 2).min(poll_max);
    }
    tracing::info!(sender = %name, %peer, "sender disconnected; region freed");
}

/// Whether this sender's memory share has room for what taking block `j` costs: nothing for a
/// single-block frame handed on as the block itself; for a copy, its payload; for a fragment of
/// a larger frame, its copy plus what the reassembly buffer may grow by (`zero_copy` as for
/// [`take_block`], so the two agree on what is copied). An invalid block costs
/// nothing (it is freed at once).
fn has_room(
    shared: &Shared,
    name: &str,
    region: &Arc<dyn Region>,
    j: usize,
    (zero_copy_limit, lossless_in_place): (usize, bool),
    memory: &Budget,
) -> bool {
    // Decoded from a copy of the header, as `take_block` does (a sender may change its bytes).
    let block_len = region.layout().block_size;
    let mut head = [0u8; HEADER_LEN];
    let (mut header, mut coalesced) = (None, None);
    if block_len >= head.len() {
        region.copy_from_block(j, 0, &mut head);
        if head[coalesce::VERSION_OFFSET] == coalesce::COALESCED_VERSION {
            let first = head[..coalesce::COALESCED_HEADER_LEN]
                .try_into()
                .expect("16 bytes");
            coalesced = coalesce::coalesced_body_len_of(first, block_len).ok();
        } else {
            header = BlockHeader::decode_header_of(&head, block_len, shared.opts.max_device).ok();
        }
    }
    if let Some(body) = coalesced {
        // A coalesced block's used bytes are copied out whole (see `take_block`).
        return memory.available() >= coalesced_copy_len(body);
    }
    let Some(h) = header else { return true };
    let payload = h.payload_len as usize;
    let need = if h.fragment_count > 1 {
        let assembling = shared
            .senders
            .lock()
            .get(name)
            .map_or(0, |s| s.session.assembly_bytes(h.device));
        payload + assembling.max(payload)
    } else if (h.is_reliable() && !lossless_in_place) || region.retained() >= zero_copy_limit {
        payload
    } else {
        0
    };
    need == 0 || memory.available() >= need
}

/// Bytes of the copy `take_block` makes of a coalesced block whose body is `body` bytes: its
/// header, body and trailer.
fn coalesced_copy_len(body: usize) -> usize {
    coalesce::COALESCED_HEADER_LEN + body + TRAILER_LEN
}

/// Takes block `j`: retains it (status 2), validates it, and either hands its payload on as is
/// (zero copy; the block is freed when the last user drops it) or, when `zero_copy_limit` blocks
/// of this region are already retained, copies the payload and frees the block at once. An
/// invalid block is freed at once. `zero_copy`: the limit, and whether lossless frames may be
/// handed on without a copy too ([`FrameSink::lets_frames_go`]).
fn take_block(
    region: &Arc<dyn Region>,
    j: usize,
    max_device: u8,
    zero_copy: (usize, bool),
    memory: &Arc<Budget>,
) -> std::result::Result<Vec<Packet>, BlockError> {
    let held = region.clone().retain(j);
    let mut head = [0u8; coalesce::COALESCED_HEADER_LEN];
    if held.len() >= head.len() {
        held.copy_out(0, &mut head);
    }
    if head[coalesce::VERSION_OFFSET] == coalesce::COALESCED_VERSION {
        // Several small lossy messages: the used bytes copied out of the block once (the block
        // is freed at once, when `held` drops), then validated and split from that copy, so
        // what is handed on is what was checked. The messages are slices of that one copy,
        // which holds its reservation (the whole copy, as `has_room` checked) until the last
        // of them is dropped: one copy per block, not one more per message.
        let body = coalesce::coalesced_body_len_of(&head, held.len())?;
        let used = coalesced_copy_len(body);
        let reservation = memory.try_reserve(used).ok_or(BlockError::OverBudget)?;
        let mut copy = vec![0u8; used];
        held.copy_out(0, &mut copy);
        drop(held);
        let msgs = coalesce::decode_coalesced(&copy, max_device)?;
        let copy = Bytes::from_owner(crate::proto::budget::Reserved::new(copy, reservation));
        return Ok(msgs
            .into_iter()
            .map(|(header, range)| Packet {
                header,
                payload: copy.slice(range),
                ack: None,
            })
            .collect());
    }
    take_single(held, region, j, max_device, zero_copy, memory).map(|p| vec![p])
}

/// Takes a version 1 block (one message, or one fragment of one).
fn take_single(
    held: RetainedBlock,
    region: &Arc<dyn Region>,
    j: usize,
    max_device: u8,
    (zero_copy_limit, lossless_in_place): (usize, bool),
    memory: &Arc<Budget>,
) -> std::result::Result<Packet, BlockError> {
    let (header, range) = {
        // Over tcp and shm a block may be sealed over its header only; over verbs it may not.
        // Header and trailer are checked as copied out of the block, and every length used
        // below is the copy's (a sender that changes its block after the check changes only
        // its own payload).
        let h = BlockHeader::decode_block_copied(
            &held,
            &mut |at, into| held.copy_out(at, into),
            max_device,
            region.placement(),
        )?;
        (h, HEADER_LEN..HEADER_LEN + h.payload_len as usize)
    };
    let zero_copy = region.retained() <= zero_copy_limit && header.fragment_count == 1;
    if header.is_reliable() && header.is_last_fragment() {
        // Lossless: the message's last block stays unavailable until the message is durably
        // handed on (the sender keeps the whole message until it reads this block free). To a
        // sink that lets a frame's bytes go when it acknowledges it (the directory output), a
        // one-block message is handed on as the block itself, like a live frame, while fewer
        // than `zero_copy_limit` blocks are held: the block is freed once the message is
        // acknowledged and its bytes are gone, which for such a sink is the same moment.
        // Otherwise the payload is copied, so the block waits only for the acknowledgement,
        // never for a sink that keeps the frame's memory.
        let (block, ack) = held.with_ack();
        let payload = if zero_copy && lossless_in_place {
            Bytes::from_owner(crate::transport::HeldBlock(block)).slice(range)
        } else {
            crate::proto::budget::reserved_copy(memory, &block[range])
                .ok_or(BlockError::OverBudget)?
        };
        return Ok(Packet {
            header,
            payload,
            ack: Some(ack),
        });
    }
    let payload = if zero_copy {
        Bytes::from_owner(held).slice(range)
    } else {
        tracing::trace!(
            block = j,
            retained = region.retained(),
            "copying block payload"
        );
        // A copy takes memory from the budget; without room the block cannot be kept.
        crate::proto::budget::reserved_copy(memory, &held[range]).ok_or(BlockError::OverBudget)?
    };
    Ok(Packet {
        header,
        payload,
        ack: None,
    })
}

/// One sender's streams as its polling thread hands their events on: each device's key and
/// counters, looked up in the registry once per device rather than once per message (the
/// lookup, which copied the key, and a copy of the sender's name for each message's key were
/// about a fifth of the receiver's instructions per small message).
struct Streams<'a> {
    name: &'a str,
    devices: Vec<Option<(StreamKey, Arc<DeviceCounters>)>>,
}

impl<'a> Streams<'a> {
    fn new(name: &'a str) -> Streams<'a> {
        Streams {
            name,
            devices: Vec::new(),
        }
    }

    /// The key and counters of `device` (the registry never drops a key's counters, so what
    /// is kept here stays the registry's).
    fn get(&mut self, shared: &Shared, device: u8) -> &(StreamKey, Arc<DeviceCounters>) {
        let i = device as usize;
        if self.devices.len() <= i {
            self.devices.resize_with(i + 1, || None);
        }
        self.devices[i].get_or_insert_with(|| {
            let key = StreamKey {
                sender: self.name.to_string(),
                device,
            };
            let counters = shared.counters.device(&key);
            (key, counters)
        })
    }
}

fn deliver(
    shared: &Shared,
    key: &StreamKey,
    counters: &Arc<DeviceCounters>,
    session: u64,
    events: Vec<StreamEvent>,
) {
    for ev in events {
        match &ev {
            StreamEvent::Frame(f) => {
                let latency = Duration::from_nanos(unix_now_ns().saturating_sub(f.timestamp_ns));
                counters.frame(f.data.len(), (f.timestamp_ns != 0).then_some(latency));
            }
            StreamEvent::EndOfStream { .. } => counters.ended.store(1, Ordering::Relaxed),
            StreamEvent::Format { .. } => {}
        }
        shared.sink.handle(key, session, counters, ev);
    }
}

/// Hands the packets of one block (one, or a coalesced block's messages in block order) to
/// their sender's session under one lock, then their released events to the sink in the same
/// order.
fn route(shared: &Shared, streams: &mut Streams, session: u64, packets: Vec<Packet>) {
    let released: Vec<Released> = {
        let mut senders = shared.senders.lock();
        let Some(state) = senders.get_mut(streams.name) else {
            return;
        };
        let now = Instant::now();
        packets
            .into_iter()
            .map(|p| state.session.handle_packet(now, p))
            .collect()
    };
    // The sink may block; the sender lock is not held here.
    for r in released {
        publish(shared, streams, session, r);
    }
}

/// Hands a device's released events to the sink and publishes its gap count.
fn publish(shared: &Shared, streams: &mut Streams, session: u64, released: Released) {
    let (key, counters) = streams.get(shared, released.device);
    counters.gaps.store(released.gap_packets, Ordering::Relaxed);
    deliver(shared, key, counters, session, released.events);
}

/// Gives up what is due of the sender's reorder timeouts; returns its next one, if any.
fn check_timeouts(shared: &Shared, streams: &mut Streams, now: Instant) -> Option<Instant> {
    let (session, released, next) = {
        let mut senders = shared.senders.lock();
        let state = senders.get_mut(streams.name)?;
        let released = state.session.handle_timeouts(now);
        (
            state.session.session(),
            released,
            state.session.poll_timeout(),
        )
    };
    for r in released {
        publish(shared, streams, session, r);
    }
    next
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::header::{BlockHeader, flags};
    use crate::proto::{Budget, status};
    use crate::transport::{RegionSettings, SoftRegion, Target};

    /// A lossless one-block frame written into block `j` of `region` (as a tcp NIC would) with
    /// its status byte FULL.
    fn lossless_block(region: &SoftRegion, j: usize, payload: &[u8]) {
        let header = BlockHeader {
            flags: flags::RELIABLE,
            ..BlockHeader::single(1, payload.len())
        }
        .sealed_for(region.placement());
        let size = region.layout().block_size;
        region
            .write_with(Target::Blocks, (j * size) as u64, size, |b| {
                header.encode_block(payload, b);
                Ok(())
            })
            .unwrap()
            .unwrap();
        region
            .write_with(Target::Statuses, j as u64, 1, |b| {
                b[0] = status::FULL;
                Ok(())
            })
            .unwrap()
            .unwrap();
    }

    /// To a sink that lets frames go, a lossless frame is the block itself: no budget taken,
    /// the block RETAINED while its bytes live even after the acknowledgement, freed when both
    /// are done. To any other sink it is a copy, and the block is freed once it is acknowledged.
    /// Unacknowledged, it stays RETAINED either way (the sender keeps the frame).
    #[test]
    fn a_lossless_frame_is_handed_on_without_a_copy_only_to_a_sink_that_lets_it_go() {
        let settings = RegionSettings::plain(4, 4096);
        let soft = SoftRegion::new(&settings);
        let region: Arc<dyn Region> = soft.clone();
        let memory = Budget::new(1 << 20);
        let payload = vec![7u8; 1000];

        // Zero copy: the payload is the block's memory.
        lossless_block(&soft, 0, &payload);
        let mut p = take_block(&region, 0, 8, (2, true), &memory).unwrap();
        let p = p.pop().unwrap();
        assert_eq!(&p.payload[..], &payload[..]);
        assert_eq!(memory.used(), 0, "a zero-copy frame takes no budget");
        let (data, ack) = (p.payload, p.ack.expect("a lossless frame has an ack"));
        ack.done();
        drop(ack);
        assert_eq!(region.status(0), status::RETAINED, "its bytes still live");
        drop(data);
        assert_eq!(region.status(0), status::EMPTY);

        // A copy: the block waits only for the acknowledgement.
        lossless_block(&soft, 1, &payload);
        let mut p = take_block(&region, 1, 8, (2, false), &memory).unwrap();
        let p = p.pop().unwrap();
        assert_eq!(memory.used(), payload.len(), "a copy takes budget");
        let (data, ack) = (p.payload, p.ack.unwrap());
        ack.done();
        drop(ack);
        assert_eq!(
            region.status(1),
            status::EMPTY,
            "freed at the acknowledgement"
        );
        assert_eq!(&data[..], &payload[..]);
        drop(data);

        // Never acknowledged: the block stays unavailable, with or without a copy.
        for (j, lets_go) in [(2, true), (3, false)] {
            lossless_block(&soft, j, &payload);
            let p = take_block(&region, j, 8, (2, lets_go), &memory).unwrap();
            drop(p);
            assert_eq!(region.status(j), status::RETAINED, "block {j}");
        }
    }

    /// A coalesced block's messages are slices of one copy: the block is freed as it is taken,
    /// the copy holds exactly the reservation `has_room` checked until the last message is
    /// dropped, and a budget without room for the whole copy takes none of it.
    #[test]
    fn a_coalesced_block_is_one_reserved_copy_shared_by_its_messages() {
        let settings = RegionSettings::plain(2, 4096);
        let soft = SoftRegion::new(&settings);
        let region: Arc<dyn Region> = soft.clone();
        let msgs: Vec<(BlockHeader, Vec<u8>)> = (0..3u8)
            .map(|d| {
                let payload = vec![d + 1; 100 + d as usize];
                (BlockHeader::single(d + 1, payload.len()), payload)
            })
            .collect();
        let used = coalesce::coalesced_len(msgs.iter().map(|(_, p)| p.len()));
        let write = |j: usize| {
            soft.write_with(Target::Blocks, (j * 4096) as u64, 4096, |b| {
                coalesce::encode_coalesced(&msgs, b);
                Ok(())
            })
            .unwrap()
            .unwrap();
            soft.write_with(Target::Statuses, j as u64, 1, |b| {
                b[0] = status::FULL;
                Ok(())
            })
            .unwrap()
            .unwrap();
        };

        // What `has_room` asks for is what is reserved.
        let body = used - coalesce::COALESCED_HEADER_LEN - TRAILER_LEN;
        assert_eq!(coalesced_copy_len(body), used);

        // One byte short of the whole copy: nothing reserved (`has_room` would have waited).
        let memory = Budget::new(used - 1);
        write(0);
        assert_eq!(
            take_block(&region, 0, 8, (1, false), &memory).unwrap_err(),
            BlockError::OverBudget
        );
        assert_eq!((memory.used(), region.status(0)), (0, status::EMPTY));

        let memory = Budget::new(used);
        write(1);
        let mut got = take_block(&region, 1, 8, (1, false), &memory).unwrap();
        assert_eq!(region.status(1), status::EMPTY, "freed once copied");
        assert_eq!(memory.used(), used, "one reservation: the whole copy");
        assert_eq!(got.len(), 3);
        for (p, (h, payload)) in got.iter().zip(&msgs) {
            assert_eq!((p.header.device, &p.payload[..]), (h.device, &payload[..]));
        }
        got.truncate(1);
        assert_eq!(memory.used(), used, "held while one message lives");
        drop(got);
        assert_eq!(memory.used(), 0);
    }
}
