//! Transports: what one-sided RDMA can do and nothing more — register memory, post a chain of
//! WRITEs (optionally inline), post a READ, poll completions — behind one interface, so the
//! sending thread and the receiver's polling threads do not know which one they run on.
//!
//! - [`mem`]: in-process, for tests and for measuring the engine without a network.
//! - [`tcp`]: software emulation over TCP for machines without an RDMA NIC. On the receiver a
//!   transport thread plays the NIC: it applies WRITEs to the registered region in posting order
//!   (status byte published with release ordering after the data), answers READs, and
//!   acknowledges signaled work requests so the sender gets RC-like completions.
//! - verbs (the `rdmastream-verbs` crate): RDMA verbs through rdma-core (a NIC, or Soft-RoCE):
//!   the sender posts the WRITE chain and the sync READ on one RC queue pair; the receiver only
//!   registers its region and exchanges keys over a TCP side channel (the handshake helpers in
//!   [`tcp`]). All of the project's `unsafe` code is there.
//! - shm (the `rdmastream-verbs` crate too, because it maps memory another process writes): a
//!   sender and a receiver on one host. The receiver's region is a sealed memfd it passes to the
//!   sender over the Unix socket the handshake ran on (`unix:/path` addresses); the sender copies
//!   block bytes straight into it and then stores the status byte with release ordering, reads
//!   the status array directly for a sync, and its completions are immediate. Heartbeats and
//!   the end of the socket carry liveness.
//!
//! The receiver side of every transport is passive: the receiver's own code only reads blocks
//! and stores status bytes in its [`Region`]; it never posts anything.
//!
//! The sliding-window baseline ([`crate::proto::window`]) is the exception, by design: over
//! [`WindowConnection`] the sender posts WRITE WITH IMMEDIATE and receives ACKs into receive
//! requests it posted, and the receiver posts receive requests and SENDs the ACKs (the tcp
//! transport emulates both, see [`tcp`]; the verbs crate posts them). Both sides count what
//! they post ([`WorkCounts`]).

pub mod access;
pub mod mem;
pub mod observe;
pub mod region;
pub mod tcp;

use std::time::Duration;

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::Result;
use crate::proto::handshake::{Hello, Key, Mechanism};
use crate::proto::window::Immediate;
use crate::proto::{Placement, RemoteLayout, Reservation};

pub use access::{AccessControl, Keys, Lease};
pub use region::{
    HeldBlock, HeldBytes, LeasedBlock, Region, RegisteredBlocks, RetainedBlock, SendBlocks,
    SoftRegion,
};

/// Which remote memory region an operation targets (each has its own key and access rights:
/// blocks are remote-WRITE only, the status array remote READ and WRITE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Blocks = 0,
    Statuses = 1,
}

/// A place in the receiver's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteAddr {
    pub target: Target,
    pub offset: u64,
}

/// Where the bytes of one RDMA WRITE come from.
#[derive(Debug, Clone, Copy)]
pub enum WriteSource<'a> {
    /// The first `len` bytes of a registered send block.
    SendBlock { index: usize, len: usize },
    /// Inline data, copied at post time.
    Inline(&'a [u8]),
}

/// One RDMA WRITE work request of a chain.
#[derive(Debug, Clone, Copy)]
pub struct WriteWr<'a> {
    pub source: WriteSource<'a>,
    pub remote: RemoteAddr,
    /// Whether this request produces a completion.
    pub signaled: bool,
}

/// A completion polled from a connection: what it completes, and for a READ the bytes it read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Completion {
    /// The signaled WRITE of chain `wr_id` (every earlier request of the chain is done too).
    Write { wr_id: u64 },
    /// The READ `wr_id`, with the bytes it brought in.
    Read { wr_id: u64, data: Vec<u8> },
}

impl Completion {
    /// The id the work request was posted with.
    pub fn wr_id(&self) -> u64 {
        match self {
            Completion::Write { wr_id } | Completion::Read { wr_id, .. } => *wr_id,
        }
    }

    /// As the protocol core takes it: a write chain or a sync with its status bytes.
    pub fn completed(&self) -> crate::proto::Completed<'_> {
        match self {
            Completion::Write { wr_id } => crate::proto::Completed::WriteChain { wr_id: *wr_id },
            Completion::Read { wr_id, data } => crate::proto::Completed::Sync {
                wr_id: *wr_id,
                statuses: data,
            },
        }
    }
}

/// The sender's end of one reliable connection (the one shared queue pair).
pub trait Connection: Send {
    /// Who is on the other end, for messages.
    fn peer(&self) -> &str;
    /// The receiver's region, from the handshake.
    fn layout(&self) -> RemoteLayout;
    /// Posts a chain of WRITEs as one work-request list. Only signaled ones complete.
    fn post_write_chain(&mut self, wr_id: u64, chain: &[WriteWr<'_>]) -> Result<()>;
    /// Posts one READ of `len` bytes at `remote`; its [`Completion::Read`] carries the bytes.
    fn post_read(&mut self, wr_id: u64, remote: RemoteAddr, len: usize) -> Result<()>;
    /// Waits up to `timeout` for completions and appends them to `out`. An error means the
    /// connection is gone; posted work without a completion may or may not have happened.
    fn poll_completions(&mut self, out: &mut Vec<Completion>, timeout: Duration) -> Result<()>;
    /// Keeps the connection's liveness check going; called by the sending thread every time
    /// round its loop. Sends a heartbeat when one is due, and fails when the receiver has not
    /// been heard from for the peer timeout (a dead machine or link, a half-open connection).
    /// No default: a wrapper that forgot to pass it on would silently turn liveness off.
    fn heartbeat(&mut self) -> Result<()>;
    /// The notices the receiver sent since the last call (see [`Notice`]), oldest first. Called
    /// by the sending thread every time round its loop. No default, for the same reason as
    /// [`Connection::heartbeat`]: a wrapper that dropped them would leave a sink unaware that
    /// nobody receives its frames.
    fn take_notices(&mut self) -> Vec<Notice>;
    /// Work requests this connection posted and the queue depths it used, when the transport
    /// counts them (`None`: it does not).
    fn work_counts(&self) -> Option<WorkCounts> {
        None
    }
    /// The receiver's memory block `remote_block` itself, for a source on the sender to write a
    /// whole block into in place, when this transport can (shm maps the receiver's region;
    /// `None` on every other). Only for a block the [`crate::proto::SenderMachine`] lent
    /// ([`crate::proto::SenderMachine::lend`]): the sending thread then posts its status byte
    /// alone ([`crate::proto::Action::Status`]). No default, for the same reason as
    /// [`Connection::heartbeat`]: a wrapper that dropped it would silently turn writing in place
    /// into the receiver's memory off.
    fn lend_block(&self, remote_block: usize) -> Option<Box<dyn LeasedBlock>>;
    /// Whether the sender syncs early on this connection (asks for the status READ while the
    /// cache still shows a few free blocks, and writes on while it is on its way:
    /// [`crate::proto::SenderMachine::set_early_sync`]). Measured to help over tcp and shm; off
    /// over verbs, where Soft-RoCE showed no gain and two of five GStreamer runs at 25 fps
    /// stalled with it (none of five without), until it is measured on a real NIC. No default,
    /// so that a wrapper cannot drop it.
    fn syncs_early(&self) -> bool;
    /// Bytes of the receiver's region the sender should keep FULL at most, so that the blocks
    /// written are still cached where they are copied: shm, where the two share one host's
    /// cache and a sync costs nothing ([`shm_cache_budget`]), and tcp, whose NIC thread copies
    /// every block in on the receiving host ([`tcp_cache_budget`], enough for what a socket
    /// has on its way during the round trip of a sync). `None` over verbs, where an RNIC places
    /// the data, until a budget is measured on one. The sending thread turns it into
    /// [`crate::proto::SenderMachine::set_max_full`]. No default, for the same reason as
    /// [`Connection::syncs_early`].
    fn cache_budget(&self) -> Option<usize>;
    /// How many of its own send blocks (of `block_size` bytes) the sender keeps in use at once on
    /// this connection ([`SendLimits`]): shm's follow from its cache budget ([`SendLimits::within`]), tcp's are
    /// [`tcp_send_limits`]; none over verbs. No default, for the same reason as
    /// [`Connection::syncs_early`].
    fn send_limits(&self, block_size: usize) -> SendLimits;
    /// Whether the sender writes the receiver's lowest-numbered free block first instead of the
    /// next round-robin one ([`crate::proto::SenderMachine::set_lowest_first`]): tcp, whose
    /// NIC thread copies each block in on the receiving host, so a block written again soon is
    /// still in that host's cache (1 MiB blocks: less CPU per MB in 10 of 12 pairs, docs/benchmarks.md,
    /// "Lowest-numbered block first over tcp"). Not verbs, whose sender stays the paper's until
    /// this is measured on a real NIC; shm's cache budget implies it when it limits anything.
    /// No default, for the same reason as [`Connection::syncs_early`].
    fn writes_lowest_first(&self) -> bool;
    /// Whether work completes as it is posted: its completion is in the very next
    /// [`Connection::poll_completions`], which never waits (shm and mem, where the sender
    /// itself copies into the receiver's memory; not tcp, whose emulated NIC works on its own
    /// thread, nor verbs). Then a thread that hands the sending thread a block may drive the
    /// connection itself when the sending thread is not at work, and the block's status byte is
    /// stored without waking the sending thread (docs/protocol.md, "Who drives the
    /// connection"). No default, for the same reason as [`Connection::syncs_early`].
    fn completes_at_once(&self) -> bool;
    /// Whether a thread that hands the sending thread a block may post it itself while the link
    /// is idle (nothing queued, nothing in flight, and no post or completion for
    /// [`crate::engine::IDLE_BEFORE_POSTING_HERE`]) and the sender has one device, leaving the sending thread only the wait
    /// for its completion: tcp, where a frame at a camera's pace otherwise waited for the
    /// sending thread to be woken and given a CPU before its writev, and where a poll that may
    /// not wait does not wait for the socket either (docs/protocol.md, "Who drives the
    /// connection"). Not verbs, whose posts cost no copy and whose sender stays the paper's until
    /// this is measured on a real NIC; shm and mem go further ([`Connection::completes_at_once`]).
    /// No default, for the same reason as [`Connection::syncs_early`].
    fn posts_here_when_idle(&self) -> bool;
}

/// The address scheme of the shm transport, `unix:/path/of/the/socket`: defined here, where
/// the config checks, the elements and the transport itself all see it.
pub const UNIX_SCHEME: &str = "unix:";

/// The shm transport's [`Connection::cache_budget`] where the machine's cache size cannot be read
/// (see [`shm_cache_budget`]): an eighth of the 32 MiB last-level cache of the machine it was
/// measured on. See docs/benchmarks.md and docs/protocol.md, "The working set on one host".
pub const SHM_CACHE_BUDGET: usize = 4 << 20;

/// The tcp transport's [`Connection::cache_budget`] for remote blocks of `block_size` bytes:
/// [`TCP_CACHE_BUDGET`] for blocks up to [`TCP_BUDGET_MAX_BLOCK`] (with [`MIN_FULL_BLOCKS`], 4
/// blocks FULL at most from 2 MiB up), else none: 4 blocks of 8 MiB fill a last-level cache
/// already, and a limit there only throttles.
pub fn tcp_cache_budget(block_size: usize) -> Option<usize> {
    (block_size <= TCP_BUDGET_MAX_BLOCK).then_some(TCP_CACHE_BUDGET)
}

/// The tcp transport's [`Connection::send_limits`] for blocks of `block_size` bytes (the same on
/// the sender as on the receiver): the filling thread's own blocks within [`TCP_CACHE_BUDGET`]
/// where it holds at least [`TCP_BUDGET_MIN_BLOCKS`] of them (blocks of 1 MiB and less), and a
/// live device's in-place blocks within it, at least [`TCP_MIN_LIVE_IN_PLACE`], up to
/// [`TCP_BUDGET_MAX_BLOCK`].
pub fn tcp_send_limits(block_size: usize) -> SendLimits {
    let size = block_size.max(1);
    SendLimits {
        filling: (size.saturating_mul(TCP_BUDGET_MIN_BLOCKS) <= TCP_CACHE_BUDGET)
            .then(|| blocks_within(TCP_CACHE_BUDGET, size)),
        live_in_place: (size <= TCP_BUDGET_MAX_BLOCK)
            .then(|| (TCP_CACHE_BUDGET / size).max(TCP_MIN_LIVE_IN_PLACE)),
    }
}

/// Bytes of a tcp receiver's region FULL at once at most ([`tcp_cache_budget`]), and of a tcp
/// sender's own blocks in use ([`tcp_send_limits`]). The receiving host's NIC thread copies each
/// block in from the socket, and with 16 blocks of 1 MiB the sender otherwise keeps some 12 of
/// them FULL (it syncs when a quarter is left): the receiving copy then walks 12 MiB and cost
/// about twice per byte what it costs into a few blocks (`perf record` of `bench
/// engine-tcp-place`, docs/benchmarks.md, "A cache budget over tcp"). The sending copy, from the send
/// blocks into the socket, costs the same way: at 4 MiB it cost as much per byte as the
/// receiving one until both ends kept few blocks in use. Not less: a sync over tcp is a round
/// trip behind what is in flight, up to a loopback socket's 4 MiB send buffer (`tcp_wmem`'s
/// largest) and the block the NIC thread is copying. Blocks of 512 KiB and less never reach it
/// with 16 of them, nor do 64 KiB blocks in the 4 MiB region a tcp receiver asks for.
pub const TCP_CACHE_BUDGET: usize = 8 << 20;

/// The largest blocks a tcp connection keeps a cache budget for ([`tcp_cache_budget`],
/// [`tcp_send_limits`]): with 8 MiB blocks, 4 of them FULL and 2 of the sender's in use moved
/// no more than no limit (docs/benchmarks.md, "A cache budget over tcp").
pub const TCP_BUDGET_MAX_BLOCK: usize = 4 << 20;

/// The fewest of its own blocks a tcp sender's filling thread may keep in use under the cache
/// budget ([`tcp_send_limits`]): for larger blocks it has no limit. Its blocks include those a
/// lossless message keeps until a sync reads it delivered, and with 4 blocks of 4 MiB a lossless
/// stream moved less (1 of 8 rounds better, docs/benchmarks.md, "A cache budget over tcp").
pub const TCP_BUDGET_MIN_BLOCKS: usize = 8;

/// The fewest in-place blocks a tcp sender's live devices may keep in use under the cache budget
/// ([`tcp_send_limits`]): two, so that one is written while the other is on its way. A live
/// block is in use only until its write is acknowledged (a lossless one is kept until a sync,
/// so lossless reservations are not limited).
pub const TCP_MIN_LIVE_IN_PLACE: usize = 2;

/// How many of its own send blocks a sender keeps in use at once on a connection
/// ([`Connection::send_limits`]), so that the blocks it copies from (into a socket) or fills are
/// still in cache when they are used again. `None`: no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendLimits {
    /// The filling thread's own blocks in use (filled, queued, in flight, or kept for a
    /// lossless message until a sync) before it starts another message; it then also takes the
    /// most recently freed block first.
    pub filling: Option<usize>,
    /// In-place blocks reserved by live (lossy) devices and not yet freed (written, queued, in
    /// flight) before another reservation takes one; the most recently freed is taken first.
    /// A reservation waits for one to come back at most [`LIVE_IN_PLACE_PATIENCE`], then takes
    /// a free one anyway, so that a source that holds its buffers never waits for ever.
    pub live_in_place: Option<usize>,
}

impl SendLimits {
    /// The limits a plain [`Connection::cache_budget`] implies: the filling thread's blocks
    /// within it ([`blocks_within`]), in-place blocks unlimited (shm, where a live device's
    /// frames go into the receiver's own blocks, lent).
    pub fn within(budget: Option<usize>, block_size: usize) -> SendLimits {
        SendLimits {
            filling: budget.map(|b| blocks_within(b, block_size)),
            live_in_place: None,
        }
    }
}

/// How long a reservation waits for one of the in-place blocks in use under
/// [`SendLimits::live_in_place`] to come back before it takes a free one beyond the limit.
pub const LIVE_IN_PLACE_PATIENCE: std::time::Duration = std::time::Duration::from_millis(20);

/// The smallest and largest budget [`shm_cache_budget`] takes from the machine's cache size: a
/// cache sysfs reports as tiny or huge (a VM's made-up figures) cannot turn the limit into one
/// block at a time or into no limit at all.
pub const SHM_CACHE_BUDGET_RANGE: (usize, usize) = (2 << 20, 256 << 20);

/// The shm transport's cache budget on this machine: an eighth of the last-level cache CPU 0
/// reports (`/sys/devices/system/cpu/cpu0/cache`), within [`SHM_CACHE_BUDGET_RANGE`], or
/// [`SHM_CACHE_BUDGET`] when sysfs does not say (a container without `/sys`, another OS). Read
/// once per process.
///
/// An eighth, not more: the cache sysfs lists is the whole last-level cache, which a VM shares
/// with whatever else runs on its host's cores, and the sender's sources and the receiver's
/// pipeline use it too. On the 2-vCPU development VM (32 MiB listed) a lone copy loop over
/// 921600-byte frames slowed threefold once its destinations spanned more than 10 MiB, and
/// unthrottled rdmasink/rdmasrc over shm ran at 0.54–0.59× shmsink/shmsrc's frame rate with
/// 16 blocks of 1 MiB in use (the old budget of half the cache limited nothing there),
/// 0.87–0.95× with 8, 1.28–2.08× with 4 (docs/benchmarks.md, "The working set on one host").
pub fn shm_cache_budget() -> usize {
    static BUDGET: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BUDGET.get_or_init(|| {
        let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
        let cache = last_level_cache(dir);
        let budget = budget_from_cache(cache);
        match cache {
            Some(c) => tracing::debug!(
                "shm cache budget: {budget} bytes, from the {c}-byte last-level cache in {}",
                dir.display()
            ),
            None => tracing::debug!(
                "shm cache budget: {budget} bytes, the built-in default ({} gives no cache size)",
                dir.display()
            ),
        }
        budget
    })
}

/// The budget for a last-level cache of `cache` bytes (see [`shm_cache_budget`]).
pub fn budget_from_cache(cache: Option<usize>) -> usize {
    let (lo, hi) = SHM_CACHE_BUDGET_RANGE;
    cache.map_or(SHM_CACHE_BUDGET, |c| (c / 8).clamp(lo, hi))
}

/// The size in bytes of the highest-level data or unified cache listed under `dir` (sysfs'
/// `cpuN/cache`: `index*/level`, `type`, `size` such as `32768K`), or `None` when there is none.
/// An entry whose level, type or size does not read or parse is skipped.
pub fn last_level_cache(dir: &std::path::Path) -> Option<usize> {
    let read = |entry: &std::path::Path, name: &str| {
        std::fs::read_to_string(entry.join(name))
            .ok()
            .map(|s| s.trim().to_owned())
    };
    let mut best: Option<(u32, usize)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        if !entry.file_name().to_string_lossy().starts_with("index") {
            continue;
        }
        let (Some(level), Some(kind), Some(size)) = (
            read(&path, "level").and_then(|l| l.parse::<u32>().ok()),
            read(&path, "type"),
            read(&path, "size").and_then(|s| parse_cache_size(&s)),
        ) else {
            continue;
        };
        if kind == "Instruction" {
            continue;
        }
        if best.is_none_or(|(l, _)| level > l) {
            best = Some((level, size));
        }
    }
    best.map(|(_, size)| size)
}

/// Parses sysfs' cache size notation: a number of bytes, or with a `K`, `M` or `G` suffix.
fn parse_cache_size(s: &str) -> Option<usize> {
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let n: usize = digits.parse().ok()?;
    let shift = match unit {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        _ => return None,
    };
    n.checked_mul(1 << shift).filter(|&b| b > 0)
}

/// At least this many remote blocks may be FULL under a [`Connection::cache_budget`], however
/// large the blocks: with fewer the sender waits for the receiver at every block.
pub const MIN_FULL_BLOCKS: usize = 4;

/// How many blocks of `block_size` bytes a cache budget of `budget` bytes holds: at least
/// [`MIN_FULL_BLOCKS`]. Both ends of the sender use it: the remote blocks kept FULL
/// ([`max_full_blocks`]) and the filling thread's own blocks in use.
pub fn blocks_within(budget: usize, block_size: usize) -> usize {
    (budget / block_size.max(1)).max(MIN_FULL_BLOCKS)
}

/// The [`crate::proto::SenderMachine::set_max_full`] limit for a connection: `None` when it has
/// no cache budget or its budget holds all of the receiver's blocks anyway.
pub fn max_full_blocks(conn: &dyn Connection) -> Option<usize> {
    let layout = conn.layout();
    let n = blocks_within(conn.cache_budget()?, layout.block_size);
    (n < layout.blocks).then_some(n)
}

/// What a receiver tells a connected sender about one of its devices without ending the shared
/// connection (the other devices on it are fine): today, that another sender already streams
/// this device number to the element that receives it, so this sender's frames of it are
/// ignored. The text is the receiver's, so it is untrusted: it is cut and escaped on arrival.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// The device number the notice is about.
    pub device: u8,
    /// What the receiver says, for the sender's user.
    pub text: String,
}

/// Longest notice text a receiver sends and a sender accepts, in bytes.
pub const MAX_NOTICE_TEXT: usize = 400;

/// How many notices wait at most on either end; older ones are dropped (a notice repeats while
/// its cause lasts).
pub const MAX_NOTICES: usize = 16;

impl Notice {
    /// A notice whose text is cut (at a character boundary) to [`MAX_NOTICE_TEXT`] bytes.
    pub fn new(device: u8, text: impl Into<String>) -> Notice {
        let mut text = text.into();
        if text.len() > MAX_NOTICE_TEXT {
            let mut end = MAX_NOTICE_TEXT;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
        }
        Notice { device, text }
    }

    /// A notice as it arrived from a receiver: the text is escaped and cut.
    pub fn from_peer(device: u8, text: &[u8]) -> Notice {
        Notice {
            device,
            text: crate::logsafe::clean_bytes(text, MAX_NOTICE_TEXT),
        }
    }
}

/// On a side channel (verbs), the byte that is a heartbeat; [`SIDE_NOTICE`] starts a notice:
/// `[1][device][text length: u16 LE][text]`. Anything else is a protocol error.
pub const SIDE_HEARTBEAT: u8 = 0;
/// See [`SIDE_HEARTBEAT`].
pub const SIDE_NOTICE: u8 = 1;

impl Notice {
    /// This notice framed for a side channel.
    pub fn side_frame(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(4 + self.text.len());
        b.push(SIDE_NOTICE);
        b.push(self.device);
        b.extend_from_slice(&(self.text.len() as u16).to_le_bytes());
        b.extend_from_slice(self.text.as_bytes());
        b
    }
}

/// Splits what a receiver sends on a side channel into heartbeats and notices, however the
/// bytes were cut into reads. Holds at most one unfinished frame.
#[derive(Debug, Default)]
pub struct SideChannelReader {
    partial: Vec<u8>,
}

impl SideChannelReader {
    /// Takes the next bytes read; notices completed by them are pushed onto `out`. An error
    /// names what was wrong with the stream (the connection should then be given up).
    pub fn feed(&mut self, bytes: &[u8], out: &mut Vec<Notice>) -> std::result::Result<(), String> {
        self.partial.extend_from_slice(bytes);
        let mut at = 0;
        let result = loop {
            let rest = &self.partial[at..];
            match rest.first() {
                None => break Ok(()),
                Some(&SIDE_HEARTBEAT) => at += 1,
                Some(&SIDE_NOTICE) => {
                    if rest.len() < 4 {
                        break Ok(());
                    }
                    let len = u16::from_le_bytes([rest[2], rest[3]]) as usize;
                    if len > MAX_NOTICE_TEXT {
                        break Err(format!(
                            "a notice of {len} bytes on the side channel (at most {MAX_NOTICE_TEXT})"
                        ));
                    }
                    if rest.len() < 4 + len {
                        break Ok(());
                    }
                    out.push(Notice::from_peer(rest[1], &rest[4..4 + len]));
                    at += 4 + len;
                }
                Some(other) => break Err(format!("unknown byte {other} on the side channel")),
            }
        };
        self.partial.drain(..at);
        result
    }
}

/// A bounded queue of notices shared between the thread that produces them and the one that
/// sends or takes them.
#[derive(Debug, Clone, Default)]
pub struct NoticeQueue(std::sync::Arc<parking_lot::Mutex<std::collections::VecDeque<Notice>>>);

impl NoticeQueue {
    /// Queues `notice`, dropping the oldest when [`MAX_NOTICES`] are waiting.
    pub fn push(&self, notice: Notice) {
        let mut q = self.0.lock();
        if q.len() == MAX_NOTICES {
            q.pop_front();
        }
        q.push_back(notice);
    }

    /// Everything waiting, oldest first.
    pub fn take(&self) -> Vec<Notice> {
        self.0.lock().drain(..).collect()
    }
}

/// What one side of a connection posted and how deep its queues got: the paper's "minimum RNIC
/// resources" (Figures 16 and 17), counted where the work requests are posted, not assumed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkCounts {
    /// Work requests posted on the send queue (WRITE, WRITE WITH IMMEDIATE, READ, SEND).
    pub send_wrs: u64,
    /// Receive requests posted.
    pub recv_wrs: u64,
    /// Completion queue entries generated (all of this side's completion queues).
    pub completions: u64,
    /// Most send-queue entries outstanding at once (posted, not yet completed).
    pub max_send_queue: u64,
    /// Most receive requests posted and not yet consumed at once.
    pub max_recv_queue: u64,
    /// Completion queues this side uses.
    pub cqs: u64,
}

/// Work requests posted through any [`WorkCounter`] of this process (the sliding window's, on
/// any transport, and the tcp emulation's; the verbs crate counts its status-byte posts itself).
static POSTED: AtomicU64 = AtomicU64::new(0);

/// Work requests counted by the [`WorkCounter`]s of this process so far (send and receive).
pub fn counted_work_requests() -> u64 {
    POSTED.load(Ordering::Relaxed)
}

/// Counts [`WorkCounts`] as work is posted and completed; shared between the threads of a
/// connection.
#[derive(Debug, Default)]
pub struct WorkCounter {
    send_wrs: AtomicU64,
    recv_wrs: AtomicU64,
    completions: AtomicU64,
    send_queue: AtomicU64,
    max_send_queue: AtomicU64,
    recv_queue: AtomicU64,
    max_recv_queue: AtomicU64,
    cqs: AtomicU64,
}

impl WorkCounter {
    /// A counter for a side that uses `cqs` completion queues.
    pub fn new(cqs: u64) -> WorkCounter {
        let c = WorkCounter::default();
        c.cqs.store(cqs, Ordering::Relaxed);
        c
    }
    /// `n` work requests were posted on the send queue.
    pub fn post_send(&self, n: u64) {
        POSTED.fetch_add(n, Ordering::Relaxed);
        self.send_wrs.fetch_add(n, Ordering::Relaxed);
        let now = self.send_queue.fetch_add(n, Ordering::Relaxed) + n;
        self.max_send_queue.fetch_max(now, Ordering::Relaxed);
    }
    /// `n` send-queue entries completed.
    pub fn complete_send(&self, n: u64) {
        let _ = self
            .send_queue
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |q| {
                Some(q.saturating_sub(n))
            });
    }
    /// `n` receive requests were posted.
    pub fn post_recv(&self, n: u64) {
        POSTED.fetch_add(n, Ordering::Relaxed);
        self.recv_wrs.fetch_add(n, Ordering::Relaxed);
        let now = self.recv_queue.fetch_add(n, Ordering::Relaxed) + n;
        self.max_recv_queue.fetch_max(now, Ordering::Relaxed);
    }
    /// A receive request was consumed by an incoming message.
    pub fn consume_recv(&self) {
        let _ = self
            .recv_queue
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |q| {
                Some(q.saturating_sub(1))
            });
    }
    /// A completion queue entry was generated.
    pub fn completion(&self) {
        self.completions.fetch_add(1, Ordering::Relaxed);
    }
    /// The counts so far.
    pub fn snapshot(&self) -> WorkCounts {
        WorkCounts {
            send_wrs: self.send_wrs.load(Ordering::Relaxed),
            recv_wrs: self.recv_wrs.load(Ordering::Relaxed),
            completions: self.completions.load(Ordering::Relaxed),
            max_send_queue: self.max_send_queue.load(Ordering::Relaxed),
            max_recv_queue: self.max_recv_queue.load(Ordering::Relaxed),
            cqs: self.cqs.load(Ordering::Relaxed),
        }
    }
}

/// The sender's end of one sliding-window connection (one device): WRITE WITH IMMEDIATE on the
/// send queue, whose completions come from [`WindowConnection::poll_completions`], and ACKs from
/// the receiver on a completion queue of their own ([`AckQueue`]), served by the sender's ACK
/// receiving thread.
pub trait WindowConnection: Send {
    /// Who is on the other end, for messages.
    fn peer(&self) -> &str;
    /// The receiver's ring, from the handshake (RmInit).
    fn layout(&self) -> RemoteLayout;
    /// Posts one signaled RDMA WRITE WITH IMMEDIATE of the first `imm.len` bytes of send block
    /// `send_block` to ring block `imm.position`, immediate `imm.encode()`.
    fn post_write_imm(&mut self, wr_id: u64, send_block: usize, imm: Immediate) -> Result<()>;
    /// Waits up to `timeout` for send completions and appends their work request ids to `out`.
    /// An error means the connection is gone.
    fn poll_completions(&mut self, out: &mut Vec<u64>, timeout: Duration) -> Result<()>;
    /// The ACK completion queue, for the ACK receiving thread (taken once).
    fn take_ack_queue(&mut self) -> Option<Box<dyn AckQueue>>;
    /// Liveness, as [`Connection::heartbeat`].
    fn heartbeat(&mut self) -> Result<()>;
    /// What this side posted so far.
    fn work_counts(&self) -> WorkCounts;
}

/// The sender's ACK completion queue and the receive requests ACKs land in.
pub trait AckQueue: Send {
    /// Posts `n` receive requests for ACKs.
    fn post_recv(&mut self, n: usize) -> Result<()>;
    /// Waits up to `timeout` for the next ACK (its receive request is consumed). `Ok(None)`: none
    /// came; an error means the connection is gone.
    fn recv(&mut self, timeout: Duration) -> Result<Option<Immediate>>;
}

/// The error of a transport without the sliding-window baseline.
pub fn window_unavailable(transport: &'static str) -> crate::Error {
    crate::Error::Unavailable {
        transport,
        reason: "the sliding-window mechanism is not implemented on this transport".into(),
    }
}

/// How long a peer may stay silent before its connection is given up, unless configured.
pub const DEFAULT_PEER_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a tcp receiver's NIC thread looks for more bytes before it sleeps, unless
/// configured (the receiver's `tcp_nic_spin_us`; docs/protocol.md, "The `tcp` software
/// transport", "Waking").
pub const DEFAULT_NIC_SPIN: Duration = Duration::from_micros(300);

/// A version-3 tcp hello from `sender` in session `session`, for the transports' unit tests.
#[cfg(test)]
pub(crate) fn test_hello(sender: &str, session: u64) -> Hello {
    use crate::proto::handshake::{DataPath, PROTOCOL_VERSION};
    Hello {
        version: PROTOCOL_VERSION,
        sender: sender.into(),
        session,
        block_size: 0,
        data_path: DataPath::Tcp,
        qp: Default::default(),
        nonce: [0; 32],
        mechanism: Default::default(),
    }
}

/// How often a live connection proves it is alive, for a peer timeout of `timeout`.
pub fn heartbeat_interval(timeout: Duration) -> Duration {
    (timeout / 5).max(Duration::from_millis(50))
}

/// Makes connections for a sender (one at a time; called again to reconnect).
pub trait Connector: Send {
    /// Transport name, for logs.
    fn transport(&self) -> &'static str;
    /// Whether this transport places a block's bytes whole and in order before the status
    /// byte that follows them ([`Placement::Ordered`]: the sender then seals blocks over their
    /// header only) or not ([`Placement::Unordered`], verbs: header and payload). Fixed for
    /// the connector's life, since blocks are sealed when filled, before any connection takes
    /// them. No default: a wrapper that forgot to pass it on would seal verbs blocks weakly
    /// (refused by every verbs receiver) or pay for the full seal where it buys nothing.
    fn placement(&self) -> Placement;
    /// Peer description, for logs.
    fn peer(&self) -> String;
    /// Connects and hands the receiver `hello` (its nonce is filled in fresh), proving
    /// knowledge of `key` when the receiver asks for it (and requiring the receiver's proof
    /// when a key is given); the connection reads WRITE sources from `blocks`.
    fn connect(
        &self,
        hello: &Hello,
        key: Option<&Key>,
        blocks: &std::sync::Arc<SendBlocks>,
    ) -> Result<Box<dyn Connection>>;
    /// Connects one sliding-window connection (the device is in `hello.mechanism`). Transports
    /// that do not implement the baseline return [`window_unavailable`]. No default: a wrapper
    /// that forgot to pass it on would turn the baseline off without a word.
    fn connect_window(
        &self,
        hello: &Hello,
        key: Option<&Key>,
        blocks: &std::sync::Arc<SendBlocks>,
    ) -> Result<Box<dyn WindowConnection>>;
    /// Allocates (and registers, where the transport needs that) the sender's send blocks, once
    /// at start; [`Connector::connect`] is then given them.
    fn alloc_send_blocks(
        &self,
        count: usize,
        block_size: usize,
    ) -> Result<std::sync::Arc<SendBlocks>> {
        Ok(SendBlocks::new(count, block_size))
    }
}

/// What a receiver offers each connecting sender, and on what terms.
#[derive(Debug, Clone)]
pub struct RegionSettings {
    /// Receiver memory blocks per sender (N).
    pub blocks: usize,
    /// Bytes per block (B).
    pub block_size: usize,
    /// Blocks marked unavailable (status 2) from the start, e.g. memory kept for another use.
    pub reserved_blocks: Vec<usize>,
    /// Keys, one connection per name, the sender cap and the memory budget.
    pub access: std::sync::Arc<AccessControl>,
    /// Bytes each connected sender gets for reassembling its multi-block frames and for copies
    /// of its payloads (reserved from the budget with its region): what one sender does with
    /// its share cannot starve another.
    pub reassembly: usize,
    /// A sender not heard from for this long is gone: its connection is closed and its region
    /// freed (senders send heartbeats when idle).
    pub peer_timeout: Duration,
    /// Over tcp, how long the NIC thread looks for more bytes without waiting before it sleeps
    /// in its socket (zero: it sleeps at once). While a stream runs the next bytes come within
    /// it, so the thread is not woken for each of them ([`DEFAULT_NIC_SPIN`]).
    pub nic_spin: Duration,
    /// The mechanism this receiver runs; a sender of the other one is refused. For the sliding
    /// window only the kind counts (the device is each connecting sender's own).
    pub mechanism: Mechanism,
}

impl RegionSettings {
    /// N blocks of B bytes, anonymous access without limits (tests and tools).
    pub fn plain(blocks: usize, block_size: usize) -> RegionSettings {
        RegionSettings {
            blocks,
            block_size,
            reserved_blocks: Vec::new(),
            access: AccessControl::open(),
            reassembly: 64 << 20,
            peer_timeout: DEFAULT_PEER_TIMEOUT,
            nic_spin: DEFAULT_NIC_SPIN,
            mechanism: Mechanism::StatusByte,
        }
    }

    /// The reassembly share a sender needs so that it can never wait on itself: room to copy
    /// every block of its region (fragments waiting for a missing one) plus two frames of
    /// `max_frame` bytes (one being reassembled, one on its way to disk).
    pub fn reassembly_for(blocks: usize, block_size: usize, max_frame: usize) -> usize {
        blocks
            .saturating_mul(block_size)
            .saturating_add(max_frame.saturating_mul(2))
    }

    /// What one sender takes from the memory budget ([`RegionSettings::reserve_region`], and a
    /// receiver's config check before it starts): its region's `blocks` blocks of `block_size`
    /// bytes and its `reassembly` share. The region's status array (one byte per block, under
    /// 2 % of the blocks) is a per-sender overhead like the connection's locks, threads and page
    /// rounding, bounded by `max_senders`, and not counted: so a budget of `max_senders` times
    /// this admits exactly `max_senders` senders (the shipped 1 GiB admits the shipped 16;
    /// counting the status bytes refused the 16th).
    pub fn budget_need(blocks: usize, block_size: usize, reassembly: usize) -> usize {
        blocks.saturating_mul(block_size).saturating_add(reassembly)
    }

    /// Admits an authenticated sender: its blocks must fit this receiver's (a sender that states
    /// a larger block size is refused with a reason both ends report), then the access rules
    /// ([`AccessControl::admit`]: one connection per name, the sender cap).
    pub fn admit(
        &self,
        hello: &Hello,
        peer: &str,
    ) -> std::result::Result<access::Lease, (RefusalKind, String)> {
        if !hello.mechanism.same_kind(self.mechanism) {
            return Err((
                RefusalKind::Mechanism,
                format!(
                    "sender '{}' runs the {} mechanism and this receiver runs {}: set \
                     `mechanism` the same in both configs",
                    hello.sender, hello.mechanism, self.mechanism
                ),
            ));
        }
        if let Mechanism::SlidingWindow { .. } = hello.mechanism
            && let Err(why) = crate::proto::window::check_ring(RemoteLayout {
                blocks: self.blocks,
                block_size: self.block_size,
            })
        {
            return Err((RefusalKind::Resources, why));
        }
        if let Mechanism::SlidingWindow { .. } = hello.mechanism
            && !self.reserved_blocks.is_empty()
        {
            // The ring is written in order: a block kept from the start would stall it at once.
            return Err((
                RefusalKind::Resources,
                "reserved blocks are a status-byte feature; this receiver runs the sliding \
                 window"
                    .into(),
            ));
        }
        if hello.block_size as usize > self.block_size {
            return Err((
                RefusalKind::BlockSize,
                format!(
                    "sender '{}' uses {}-byte blocks, larger than this receiver's {}: set its \
                     block size to {} or less",
                    hello.sender, hello.block_size, self.block_size, self.block_size
                ),
            ));
        }
        self.access.admit(hello, peer)
    }

    /// Reserves one sender's memory from the budget: its region, and its share for
    /// reassembly. `Err` is the refusal.
    pub fn reserve_region(&self) -> std::result::Result<SenderMemory, (RefusalKind, String)> {
        let budget = self.access.budget();
        let need = Self::budget_need(self.blocks, self.block_size, self.reassembly);
        let mut all = budget.try_reserve(need).ok_or_else(|| {
            (
                RefusalKind::MemoryBudget,
                format!(
                    "memory budget exhausted: a sender needs {need} bytes (region and \
                     reassembly), {} of {} are in use",
                    budget.used(),
                    budget.limit()
                ),
            )
        })?;
        let share = all.split_off(self.reassembly);
        Ok(SenderMemory {
            region: all,
            reassembly: crate::proto::Budget::carved(share),
        })
    }
}

/// What a connected sender's memory is taken from.
#[derive(Debug)]
pub struct SenderMemory {
    /// The region's bytes; the region holds it until it is freed.
    pub region: Reservation,
    /// The sender's share for reassembly and copies.
    pub reassembly: std::sync::Arc<crate::proto::Budget>,
}

/// A sender that completed the handshake, with the region it writes into.
pub struct Accepted {
    pub hello: Hello,
    /// Remote address of the sender, for logs.
    pub peer: String,
    pub region: std::sync::Arc<dyn Region>,
    /// The sender's hold on its name; the receiver drops it when the connection is over.
    /// Dropping it ends the connection (the region is disconnected), so whoever takes the
    /// region keeps the lease as long as it uses the connection.
    pub lease: Lease,
    /// The sender's share of memory for reassembly and copies.
    pub memory: std::sync::Arc<crate::proto::Budget>,
}

/// The receiver's listening side.
pub trait Listener: Send {
    /// Transport name, for logs.
    fn transport(&self) -> &'static str;
    /// Where it listens, for logs.
    fn local_addr(&self) -> String;
    /// Waits up to `timeout` for the next sender that completed the handshake. Returns
    /// `Ok(None)` early when a refusal waits for [`Listener::refusals`], or when its
    /// [`Listener::waker`] is rung, so a caller can wait long and still count refusals and stop
    /// at once.
    fn accept(&mut self, timeout: Duration) -> Result<Option<Accepted>>;
    /// Rings the current or next [`Listener::accept`] wait out (it returns `Ok(None)`), from any
    /// thread.
    fn waker(&self) -> AcceptWaker;
    /// Connections turned away since the last call (bad handshake, wrong token, wrong transport,
    /// no resources, peer gone mid-handshake), oldest first. Each was logged already; this is
    /// for counters and element messages. A listener keeps at most [`MAX_REFUSALS`] of them.
    /// No default: `accept` returns early while a refusal waits, so a listener that wraps
    /// another must pass them on, or its caller would spin.
    fn refusals(&mut self) -> Vec<Refusal>;
    /// Waits up to `timeout` for the next admitted sender, setting aside the refusals and
    /// wake-ups that end [`Listener::accept`] early (for a caller that wants a sender and nothing
    /// else: a test that was refused on purpose before, say); the refusals it sets aside are not
    /// returned by [`Listener::refusals`] any more. `Ok(None)` once `timeout` is over.
    fn accept_sender(&mut self, timeout: Duration) -> Result<Option<Accepted>> {
        self.accept_sender_keeping(timeout, &mut Vec::new())
    }
    /// As [`Listener::accept_sender`], adding the refusals it sets aside to `refused` in the
    /// order they came (for a caller that counts them, or treats any as a failure).
    fn accept_sender_keeping(
        &mut self,
        timeout: Duration,
        refused: &mut Vec<Refusal>,
    ) -> Result<Option<Accepted>> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let accepted = self.accept(left)?;
            refused.extend(self.refusals());
            if accepted.is_some() || left.is_zero() {
                return Ok(accepted);
            }
        }
    }
}

/// Ends a [`Listener::accept`] wait from another thread: a receiver that stops, or one whose
/// sender just lost its last connection (its reorder timeouts are the accepting thread's now).
/// A ring before the wait ends the next wait; rings in between are merged into one.
#[derive(Clone)]
pub struct AcceptWaker(crossbeam_channel::Sender<()>);

impl AcceptWaker {
    /// Ends the listener's current or next wait.
    pub fn wake(&self) {
        let _ = self.0.try_send(());
    }
}

/// The waiting side of an [`AcceptWaker`], kept by a listener.
pub(crate) struct AcceptWake {
    ring: crossbeam_channel::Sender<()>,
    rung: crossbeam_channel::Receiver<()>,
}

impl AcceptWake {
    pub(crate) fn new() -> AcceptWake {
        let (ring, rung) = crossbeam_channel::bounded(1);
        AcceptWake { ring, rung }
    }

    pub(crate) fn waker(&self) -> AcceptWaker {
        AcceptWaker(self.ring.clone())
    }

    /// Waits up to `timeout` for the next of `accepted`, returning `None` early when `refused`
    /// holds a refusal (left there for the caller to collect) or the waker was rung.
    pub(crate) fn wait<R>(
        &self,
        accepted: &crossbeam_channel::Receiver<Accepted>,
        refused: &crossbeam_channel::Receiver<R>,
        timeout: Duration,
    ) -> Option<Accepted> {
        match accepted.try_recv() {
            Ok(a) => return Some(a),
            // Its accepting thread is gone (it panicked): nothing will come, so do not spin.
            Err(crossbeam_channel::TryRecvError::Disconnected) => {
                let _ = self.rung.recv_timeout(timeout);
                return None;
            }
            Err(crossbeam_channel::TryRecvError::Empty) => {}
        }
        // A refusal already queued or a ring already sent makes this return at once.
        let mut select = crossbeam_channel::Select::new();
        let on_accepted = select.recv(accepted);
        select.recv(refused);
        let on_rung = select.recv(&self.rung);
        match select.ready_timeout(timeout) {
            Ok(i) if i == on_accepted => accepted.try_recv().ok(),
            Ok(i) if i == on_rung => {
                let _ = self.rung.try_recv();
                None
            }
            _ => None,
        }
    }
}

/// How many refusals a listener keeps for [`Listener::refusals`]; older ones are dropped.
pub const MAX_REFUSALS: usize = 32;

/// A connection that did not become a sender.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The peer's address.
    pub peer: String,
    /// Why, as told to the peer and logged.
    pub why: String,
    /// The kind of reason, for counters.
    pub kind: RefusalKind,
}

/// Kinds of reasons a connection is refused, counted separately by receivers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum RefusalKind {
    /// Malformed, truncated, oversized or too slow handshake.
    BadHandshake,
    /// A protocol version this build does not speak.
    Version,
    /// The sender asked for another transport.
    WrongTransport,
    /// Wrong or missing key, or a replayed handshake.
    Authentication,
    /// The sender name is held by another connection.
    NameInUse,
    /// `max_senders` reached.
    SenderLimit,
    /// The memory budget has no room for another region.
    MemoryBudget,
    /// Too many handshakes in progress (in all, or from one address).
    HandshakeLimit,
    /// The peer went away during the handshake.
    Lost,
    /// The receiver could not set up what the connection needs (RDMA resources, a thread).
    Resources,
    /// The sender's blocks are larger than the receiver's.
    BlockSize,
    /// The sender runs the other transmission mechanism.
    Mechanism,
}

impl RefusalKind {
    /// Short stable name, used in logs, summaries and metrics.
    pub fn name(self) -> &'static str {
        match self {
            RefusalKind::BadHandshake => "bad-handshake",
            RefusalKind::Version => "version",
            RefusalKind::WrongTransport => "wrong-transport",
            RefusalKind::Authentication => "authentication",
            RefusalKind::NameInUse => "name-in-use",
            RefusalKind::SenderLimit => "sender-limit",
            RefusalKind::MemoryBudget => "memory-budget",
            RefusalKind::HandshakeLimit => "handshake-limit",
            RefusalKind::Lost => "lost",
            RefusalKind::Resources => "resources",
            RefusalKind::BlockSize => "block-size",
            RefusalKind::Mechanism => "mechanism",
        }
    }

    /// Every kind, for counters that list each from the start.
    pub const ALL: [RefusalKind; 12] = [
        RefusalKind::BadHandshake,
        RefusalKind::Version,
        RefusalKind::WrongTransport,
        RefusalKind::Authentication,
        RefusalKind::NameInUse,
        RefusalKind::SenderLimit,
        RefusalKind::MemoryBudget,
        RefusalKind::HandshakeLimit,
        RefusalKind::Lost,
        RefusalKind::Resources,
        RefusalKind::BlockSize,
        RefusalKind::Mechanism,
    ];
}

impl std::fmt::Display for RefusalKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which data path a sender or receiver runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Tcp,
    Verbs,
    Shm,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Tcp => "tcp",
            Kind::Verbs => "verbs",
            Kind::Shm => "shm",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake sysfs `cache` directory, removed when dropped.
    struct CacheDir(std::path::PathBuf);

    impl std::ops::Deref for CacheDir {
        type Target = std::path::Path;
        fn deref(&self) -> &std::path::Path {
            &self.0
        }
    }

    impl Drop for CacheDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A fake sysfs `cache` directory: one `index*` entry per (level, type, size).
    fn cache_dir(name: &str, entries: &[(&str, &str, &str)]) -> CacheDir {
        let dir = std::env::temp_dir().join(format!("rdmastream-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (i, (level, kind, size)) in entries.iter().enumerate() {
            let e = dir.join(format!("index{i}"));
            std::fs::create_dir_all(&e).unwrap();
            std::fs::write(e.join("level"), format!("{level}\n")).unwrap();
            std::fs::write(e.join("type"), format!("{kind}\n")).unwrap();
            std::fs::write(e.join("size"), format!("{size}\n")).unwrap();
        }
        std::fs::create_dir_all(&dir).unwrap();
        CacheDir(dir)
    }

    #[test]
    fn the_shm_cache_budget_is_an_eighth_of_the_last_level_cache_sysfs_lists() {
        // This machine's layout: L1d, L1i, L2, L3 of 32 MiB.
        let dir = cache_dir(
            "llc",
            &[
                ("1", "Data", "32K"),
                ("1", "Instruction", "32K"),
                ("2", "Unified", "512K"),
                ("3", "Unified", "32768K"),
            ],
        );
        assert_eq!(last_level_cache(&dir), Some(32 << 20));
        assert_eq!(budget_from_cache(last_level_cache(&dir)), 4 << 20);
        // An instruction cache is never the last level; M and plain bytes parse too.
        let dir = cache_dir(
            "llc-kinds",
            &[("2", "Data", "2M"), ("4", "Instruction", "1G")],
        );
        assert_eq!(last_level_cache(&dir), Some(2 << 20));
        let dir = cache_dir("llc-bytes", &[("3", "Unified", "100663296")]);
        assert_eq!(budget_from_cache(last_level_cache(&dir)), 12 << 20);
        // Clamped: a tiny or a made-up huge cache.
        assert_eq!(budget_from_cache(Some(1 << 20)), 2 << 20);
        assert_eq!(budget_from_cache(Some(8 << 30)), 256 << 20);
        assert_eq!(budget_from_cache(Some(3 << 30)), 256 << 20);
    }

    #[test]
    fn no_readable_cache_size_gives_the_built_in_budget() {
        let missing = std::env::temp_dir().join("rdmastream-no-such-cache-dir");
        assert_eq!(last_level_cache(&missing), None);
        assert_eq!(budget_from_cache(None), SHM_CACHE_BUDGET);
        // Sizes that do not parse are skipped, not read as zero.
        for bad in ["", "K", "32X", "0K", "-1", "99999999999999999999G"] {
            assert_eq!(parse_cache_size(bad), None, "{bad:?}");
            let dir = cache_dir("llc-bad", &[("3", "Unified", bad)]);
            assert_eq!(last_level_cache(&dir), None, "{bad:?}");
        }
        let dir = cache_dir("llc-bad-level", &[("three", "Unified", "32M")]);
        assert_eq!(last_level_cache(&dir), None);
        let dir = cache_dir("llc-empty", &[]);
        assert_eq!(last_level_cache(&dir), None);
    }

    fn frames(notices: &[Notice]) -> Vec<u8> {
        let mut b = vec![SIDE_HEARTBEAT];
        for n in notices {
            b.extend(n.side_frame());
            b.push(SIDE_HEARTBEAT);
        }
        b
    }

    #[test]
    fn side_channel_notices_survive_any_cut_into_reads() {
        let sent = vec![
            Notice::new(3, "device-id 3 is already taken"),
            Notice::new(200, ""),
            Notice::new(7, "ünïcode"),
        ];
        let bytes = frames(&sent);
        for cut in 1..bytes.len() {
            let mut r = SideChannelReader::default();
            let mut got = Vec::new();
            for chunk in bytes.chunks(cut) {
                r.feed(chunk, &mut got).unwrap();
            }
            assert_eq!(got, sent, "reads of {cut} bytes");
        }
    }

    #[test]
    fn side_channel_rejects_unknown_bytes_and_oversized_notices() {
        let mut r = SideChannelReader::default();
        let err = r.feed(&[0, 0, 9], &mut Vec::new()).unwrap_err();
        assert!(err.contains("unknown byte 9"), "{err}");
        let mut r = SideChannelReader::default();
        let len = (MAX_NOTICE_TEXT as u16 + 1).to_le_bytes();
        let err = r
            .feed(&[SIDE_NOTICE, 1, len[0], len[1]], &mut Vec::new())
            .unwrap_err();
        assert!(err.contains("at most"), "{err}");
    }

    #[test]
    fn notice_texts_are_cut_and_peer_texts_escaped() {
        let long = "é".repeat(MAX_NOTICE_TEXT);
        let n = Notice::new(1, long);
        assert!(n.text.len() <= MAX_NOTICE_TEXT && n.text.chars().all(|c| c == 'é'));
        let n = Notice::from_peer(1, b"bad\x1b[31m\nline");
        assert!(
            !n.text.contains('\x1b') && !n.text.contains('\n'),
            "{:?}",
            n.text
        );
    }

    #[test]
    fn a_notice_queue_keeps_the_newest() {
        let q = NoticeQueue::default();
        for i in 0..(MAX_NOTICES + 5) {
            q.push(Notice::new(i as u8, ""));
        }
        let got = q.take();
        assert_eq!(got.len(), MAX_NOTICES);
        assert_eq!(got[0].device, 5);
        assert!(q.take().is_empty());
    }
}
