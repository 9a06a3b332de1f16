//! The sending thread's decisions, as an IO-free state machine.
//!
//! Call order, for one connection at a time:
//! 1. [`SenderMachine::handle_connected`] once the handshake told us the receiver's region.
//! 2. Feed [`SenderMachine::handle_filled`] whenever the filling thread hands over a send block.
//! 3. Drain [`SenderMachine::poll_action`] and carry out every action (post the chain / the read).
//! 4. Feed completions back: [`SenderMachine::handle_write_completed`],
//!    [`SenderMachine::handle_sync_completed`] (with the status bytes that the READ brought in).
//! 5. Drain [`SenderMachine::poll_freed`] and return those send blocks to the filling thread.
//! 6. When nothing is to do, wait for new input or until [`SenderMachine::poll_timeout`].
//!
//! On a dropped connection call [`SenderMachine::handle_disconnected`]: chains whose completion
//! never arrived are queued again (in their original order) for the next connection, so numbering
//! carries on and the receiver can drop what it already had.
//!
//! Blocks of lossless devices (filled with `reliable`) are end-to-end acknowledged: after its
//! chain completed such a send block is kept ("unconfirmed") until a sync posted after that
//! completion reads its remote block's status byte as 0 — the receiver frees the block only once
//! the message is durable. On a dropped connection unconfirmed blocks are sent again with the
//! in-flight ones, oldest first; the receiver drops what it already has.
//!
//! The remote status cache (the paper's "second status byte memory block") is only ever
//! refreshed by a whole-array READ (the sync), posted when the cache shows no free block, early
//! (with the write that leaves a quarter of the blocks free, at most `max_outstanding`, for
//! blocks of [`EARLY_SYNC_MIN_BLOCK`] and more: [`SenderStats::early_syncs`]), or when nothing
//! else can move and unconfirmed blocks wait for
//! their acknowledgement. Writes go on into blocks the cache shows free while the READ is on its
//! way. The READ may overtake write chains that are still outstanding, and race those posted
//! after it (their status byte may not be placed yet, so the READ can see a stale 0): every block
//! written by a chain that had not completed when the READ was posted, or that was posted while
//! it was outstanding, stays 1 in the cache whatever the READ returned, until a later sync. A
//! block the cache shows as 0 really is free (only the sender turns a 0 into anything else — see
//! docs/protocol.md), so writes never depend on a READ that has not completed.
//!
//! **Lent remote blocks** (transports whose sender can write the receiver's memory directly, i.e.
//! shm): with [`SenderMachine::set_max_lent`] above zero the machine lends free remote blocks
//! ([`SenderMachine::lend`]) so a source can write a frame straight into the receiver's block.
//! A lent block is FULL in the cache from the moment it is lent (no write, and no sync result,
//! makes it free again) until it is given back unused ([`SenderMachine::handle_returned`]) or
//! placed ([`SenderMachine::handle_placed`]): then, in fill order with the other blocks, the
//! machine asks for its status byte alone ([`Action::Status`]). Lending never starves the
//! queue: the machine lends only blocks the queued ones do not need, at most a quarter of the
//! remote blocks (the receiver may hold another half for zero-copy hand-offs, so a quarter is
//! always left to cycle for queued blocks), and lent blocks nobody has taken yet can be given
//! back at any time. A connection's lent blocks
//! are worthless on the next one: a block placed with an old connection's [`Lent`] is reported
//! undelivered ([`SenderMachine::poll_placed`]), never written anywhere.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::header::status;

/// The receiver's region as the handshake describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteLayout {
    /// Number of receiver memory blocks (N).
    pub blocks: usize,
    /// Bytes per receiver memory block (B).
    pub block_size: usize,
}

/// What the sending thread must do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Post one chain: RDMA WRITE of `len` bytes of send block `send_block` into remote block
    /// `remote_block` (unsignaled), then an inline, signaled RDMA WRITE of status byte 1 to that
    /// block's status byte. Completes with `wr_id`.
    Write {
        wr_id: u64,
        send_block: usize,
        remote_block: usize,
        len: usize,
    },
    /// Post one RDMA READ of the whole remote status array into the status cache. Completes with
    /// `wr_id`; hand the bytes read to [`SenderMachine::handle_sync_completed`].
    Sync { wr_id: u64 },
    /// Post a chain of one inline, signaled RDMA WRITE of status byte 1 to remote block
    /// `remote_block`, whose bytes a source already wrote in place (a lent block, see
    /// [`SenderMachine::lend`]). Completes with `wr_id` like a write chain.
    Status { wr_id: u64, remote_block: usize },
}

/// A remote block lent out to be written in place, on the connection `epoch` (see
/// [`SenderMachine::lend`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lent {
    pub remote_block: usize,
    /// Which connection it belongs to: the machine counts connections.
    pub epoch: u64,
}

/// What a completion completes, as the transport reported it: the machine never guesses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completed<'a> {
    /// The write chain [`Action::Write`] `wr_id` (its block and status byte are placed).
    WriteChain { wr_id: u64 },
    /// The sync READ [`Action::Sync`] `wr_id`, with the status bytes it read.
    Sync { wr_id: u64, statuses: &'a [u8] },
}

/// Counters kept by the machine, for the status line and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SenderStats {
    /// Write chains posted.
    pub writes: u64,
    /// Status READs posted.
    pub syncs: u64,
    /// Syncs that found no free remote block.
    pub empty_syncs: u64,
    /// Retained (status 2) blocks skipped while looking for a free block.
    pub retained_skipped: u64,
    /// Chains re-queued because their connection dropped before they completed (or, for
    /// lossless devices, before the receiver confirmed them).
    pub requeued: u64,
    /// Blocks of lossless devices the receiver confirmed (freed after handing them on).
    pub confirmed: u64,
    /// Remote blocks lent out to be written in place.
    pub lent: u64,
    /// Status-only chains posted for lent blocks written in place (also counted in `writes`).
    pub placed: u64,
    /// Blocks placed in a lent block of a connection that had dropped: not delivered.
    pub stale_placed: u64,
    /// Syncs asked for while the cache still showed free blocks (at most a quarter of the
    /// receiver's), so writes go on while the READ is on its way.
    pub early_syncs: u64,
}

#[derive(Debug, Clone, Copy)]
struct Filled {
    send_block: usize,
    len: usize,
    reliable: bool,
    /// Fill order, to send again in the original order after a drop.
    seq: u64,
    /// `seq` of the first block of this block's message (blocks of one message are filled
    /// one after another).
    message: u64,
    /// The message's last block: the receiver frees it only once the whole message is durable.
    last: bool,
    /// Written in place into a lent remote block (that block, and the caller's ticket): only
    /// its status byte is left to post, and `send_block` means nothing.
    placed: Option<(usize, u64)>,
}

#[derive(Debug, Clone, Copy)]
struct InFlight {
    wr_id: u64,
    filled: Filled,
    remote_block: usize,
}

/// A lossless block whose chain completed, waiting for the receiver to free its remote block.
#[derive(Debug, Clone, Copy)]
struct Unconfirmed {
    filled: Filled,
    remote_block: usize,
    /// Syncs posted when the chain completed: only a later sync can confirm it.
    syncs_before: u64,
}

/// Whether a filled block belongs to a lossless device's message, and where in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Freed as soon as its chain completed (`drop-oldest` devices, or a message too large to
    /// keep whole in the send blocks).
    Unconfirmed,
    /// Kept until the receiver confirms the message: `last` marks the message's last block, whose
    /// remote block the receiver frees only once the whole message is durable.
    Confirmed { last: bool },
}

/// Why a sync is posted: what counts as progress when it completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SyncFor {
    /// A free remote block for the next write.
    Block,
    /// Acknowledgements of unconfirmed lossless blocks.
    Confirmations,
    /// A look at what the receiver freed, after a placed block's status byte
    /// ([`SenderMachine::set_sync_after_placed`]): nothing is waiting for it, so finding
    /// nothing free is no reason to back off.
    Look,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sync {
    /// The cache is usable.
    Idle,
    /// A sync must be posted as soon as no write is outstanding (after connect, or when the
    /// cache shows no free block).
    Needed,
    /// A [`SyncFor::Look`] is to be posted next (after a placed block's status byte,
    /// [`SenderMachine::set_sync_after_placed`]). Anything that needs a sync of its own
    /// (a connect, a write that finds no block) replaces it with [`Sync::Needed`].
    LookWanted,
    /// Backing off: the last sync found nothing free; try again at this time.
    RetryAt(Instant),
    /// Posted (with its sequence number and why); no write may be decided until it completes.
    InFlight(u64, u64, SyncFor),
}

/// Decision logic of the sending thread. See the module docs for the call order.
#[derive(Debug)]
pub struct SenderMachine {
    layout: Option<RemoteLayout>,
    /// Cached remote status bytes (the paper's second status byte memory block).
    remote: Vec<u8>,
    /// Round-robin position: the next remote block to consider.
    cursor: usize,
    /// Filled send blocks waiting for a remote block, in fill order.
    queue: VecDeque<Filled>,
    /// Chains posted and not completed, in post order.
    in_flight: VecDeque<InFlight>,
    /// Lossless blocks written and not yet confirmed, in completion order.
    unconfirmed: VecDeque<Unconfirmed>,
    next_seq: u64,
    /// First `seq` of the lossless message being filled, until its last block comes.
    open_message: Option<u64>,
    /// Send blocks whose chain completed: their local status byte is back to 0.
    freed: VecDeque<usize>,
    sync: Sync,
    /// Blocks whose status byte the sync in flight may not have seen (written by chains that had
    /// not completed when it was posted); they stay FULL in the cache.
    unsure: Vec<usize>,
    max_outstanding: usize,
    backoff: Duration,
    next_wr_id: u64,
    stats: SenderStats,
    /// Connections so far: a [`Lent`] block is good only on the connection it was lent on.
    epoch: u64,
    /// Remote blocks of this connection lent out and not yet given back or posted.
    lent: Vec<usize>,
    /// How many remote blocks may be lent out at once (at most a quarter of them).
    max_lent: usize,
    /// Placed blocks done with: (ticket, whether its status byte was written).
    placed_done: VecDeque<(u64, bool)>,
    /// Whether syncs are asked for early ([`SenderMachine::set_early_sync`]).
    early_sync: bool,
    /// At most this many remote blocks FULL at once, lowest-numbered free block first
    /// ([`SenderMachine::set_max_full`]); `None`: no limit, round-robin.
    max_full: Option<usize>,
    /// The lowest-numbered free block first, without a limit
    /// ([`SenderMachine::set_lowest_first`]).
    lowest_first: bool,
    /// Whether a placed block's status post asks for a sync at once
    /// ([`SenderMachine::set_sync_after_placed`]).
    sync_after_placed: bool,
}

/// Blocks smaller than this never sync early: writing a few of them takes far less than the
/// READ's round trip, so syncing early hides nothing, and the blocks written while the READ is
/// on its way stay FULL in the cache after it, so syncs come more often (over tcp the paper's
/// Figure 13 at 256 B moved 28.4–28.7 MB/s with early syncs against 37.2–37.3 without; 64 KiB
/// blocks written in place over shm lost about a tenth). Measured to gain from 1 MiB up.
pub const EARLY_SYNC_MIN_BLOCK: usize = 512 << 10;

/// Shortest and longest wait between two syncs that found no free block.
const MIN_BACKOFF: Duration = Duration::from_micros(20);
const MAX_BACKOFF: Duration = Duration::from_millis(2);

impl SenderMachine {
    /// A machine that keeps at most `max_outstanding` write chains posted at once (the send
    /// queue depth in chains; at least 1).
    pub fn new(max_outstanding: usize) -> Self {
        SenderMachine {
            layout: None,
            remote: Vec::new(),
            cursor: 0,
            queue: VecDeque::new(),
            in_flight: VecDeque::new(),
            unconfirmed: VecDeque::new(),
            next_seq: 0,
            open_message: None,
            freed: VecDeque::new(),
            sync: Sync::Needed,
            unsure: Vec::new(),
            max_outstanding: max_outstanding.max(1),
            backoff: MIN_BACKOFF,
            next_wr_id: 1,
            stats: SenderStats::default(),
            epoch: 0,
            lent: Vec::new(),
            max_lent: 0,
            placed_done: VecDeque::new(),
            early_sync: true,
            max_full: None,
            lowest_first: false,
            sync_after_placed: false,
        }
    }

    /// Keeps the receiver's working set small where a sync costs nothing (shm, where the
    /// receiver's region and the send blocks share the host's cache): at most `n` (at least 2)
    /// remote blocks FULL in the cache at once, lent ones included, and the lowest-numbered free
    /// block is taken first instead of the next round-robin, so the same few blocks are written
    /// again while their lines are still cached. With `n` reached the machine syncs (and backs
    /// off like a sync that found no free block). `None` (the default): no limit, round-robin,
    /// as the paper's sender. The engine's driver sets it each turn from the connection's cache
    /// budget.
    pub fn set_max_full(&mut self, n: Option<usize>) {
        self.max_full = n.map(|n| n.max(2));
    }

    /// Takes the lowest-numbered free block first instead of the next round-robin one, with no
    /// limit on how many are FULL (unlike [`Self::set_max_full`], which implies it): the
    /// receiver's blocks written last, whose lines are the likeliest still cached where it
    /// copies them in (tcp's NIC thread), are written again first. Off (the default): round-robin,
    /// as the paper's sender. The engine's driver sets it each turn from the connection.
    pub fn set_lowest_first(&mut self, on: bool) {
        self.lowest_first = on;
    }

    /// Whether posting a placed block's status byte under a FULL limit ([`Self::set_max_full`])
    /// asks for a sync at once (counted as an early sync), so the next block is lent from what
    /// the receiver has freed meanwhile instead of waiting for the cache to show none free:
    /// for connections whose syncs complete as they are posted (shm), where the READ costs a
    /// look at the status array. Off (the default), and over tcp and verbs, where a sync is a
    /// round trip. The driver sets it from the connection each turn (docs/benchmarks.md,
    /// "A sync after each placed frame over shm").
    pub fn set_sync_after_placed(&mut self, on: bool) {
        self.sync_after_placed = on;
    }

    /// Whether a write that leaves few free blocks in the cache asks for a sync at once (the
    /// default: see the module docs), or syncs wait until the cache shows none free, as the
    /// paper's sender does. The driver sets it from the connection each turn.
    pub fn set_early_sync(&mut self, on: bool) {
        self.early_sync = on;
    }

    /// Lets the machine lend up to `n` remote blocks at once to be written in place (zero, the
    /// default, lends none); never more than a quarter of the receiver's blocks. A lent block
    /// may be held for a while (by a source, or placed behind a queued block that waits for a
    /// free one), and the receiver may keep up to half of its blocks for zero-copy hand-offs:
    /// a quarter then still cycles, so a queued block always gets one eventually.
    pub fn set_max_lent(&mut self, n: usize) {
        self.max_lent = n;
    }

    /// With [`Self::set_max_full`], at most half of that limit is lent, so that queued blocks
    /// always find the other half.
    fn lend_cap(&self) -> usize {
        let cap = self.layout.map_or(0, |l| self.max_lent.min(l.blocks / 4));
        self.max_full.map_or(cap, |max| cap.min(max / 2))
    }

    /// A free remote block for a source to write a block into in place, if one can be lent now:
    /// a connection is up, the cache is usable (no sync needed or in flight), fewer than the
    /// limit are lent, and the cache shows more free blocks than the queued blocks need (they
    /// come first). The block stays FULL in the cache until it is given back or placed.
    pub fn lend(&mut self) -> Option<Lent> {
        let layout = self.layout?;
        if self.sync != Sync::Idle || self.lent.len() >= self.lend_cap() {
            return None;
        }
        // Queued blocks come first: lend only a block none of them needs.
        let needed = self.queue.iter().filter(|f| f.placed.is_none()).count();
        let free = self.usable_in_cache();
        if free <= needed {
            return None;
        }
        let j = self.find_free_block(layout.blocks)?;
        self.remote[j] = status::FULL;
        self.cursor = (j + 1) % layout.blocks;
        self.lent.push(j);
        self.stats.lent += 1;
        Some(Lent {
            remote_block: j,
            epoch: self.epoch,
        })
    }

    /// Whether lending waits on the queue: the machine lends on this connection, but blocks
    /// are queued for the receiver's free ones, which they get first, so [`Self::lend`] gives
    /// none until they are written. A source about to write a frame in place had better wait a
    /// moment for a lent block than take a send block of its own: that frame would be copied
    /// once more and queued behind the others, and while such frames keep coming the queue
    /// never empties and nothing is lent again (the engine's `LENT_PATIENCE`).
    pub fn lending_waits_on_queue(&self) -> bool {
        self.lend_cap() > 0 && self.queue.iter().any(|f| f.placed.is_none())
    }

    /// A lent block comes back unused: its status byte was never written, so it is free again.
    /// One of an old connection, or not lent, is ignored.
    pub fn handle_returned(&mut self, lent: Lent) {
        if let Some(k) = self.lent_position(lent) {
            self.lent.swap_remove(k);
            self.remote[lent.remote_block] = status::EMPTY;
        }
    }

    fn lent_position(&self, lent: Lent) -> Option<usize> {
        (lent.epoch == self.epoch && self.layout.is_some())
            .then(|| self.lent.iter().position(|&j| j == lent.remote_block))
            .flatten()
    }

    /// A source wrote a whole block (header, payload, trailer, seal) into lent block `lent`; its
    /// status byte goes out in fill order with the other blocks ([`Action::Status`]). `ticket`
    /// comes back from [`Self::poll_placed`] once that is done, or at once when the block is of
    /// an older connection (it is not delivered). Only blocks of lossy devices are placed: the
    /// sender keeps no copy to send again.
    pub fn handle_placed(&mut self, lent: Lent, ticket: u64) {
        if self.lent_position(lent).is_none() {
            self.stats.stale_placed += 1;
            self.placed_done.push_back((ticket, false));
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.queue.push_back(Filled {
            send_block: usize::MAX,
            len: 0,
            reliable: false,
            seq,
            message: seq,
            last: true,
            placed: Some((lent.remote_block, ticket)),
        });
    }

    /// A placed block is done with: its ticket, and whether its status byte was written
    /// (false: its connection dropped first).
    pub fn poll_placed(&mut self) -> Option<(u64, bool)> {
        self.placed_done.pop_front()
    }

    /// The current connection's number (what [`Lent::epoch`] of its blocks says); 0 before the
    /// first.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Remote blocks lent out now (given out, or placed and waiting for their status byte).
    pub fn lent_out(&self) -> usize {
        self.lent.len()
    }

    /// Whether the cache shows a free remote block that may be written now (within
    /// [`Self::set_max_full`]'s limit, if one is set).
    pub fn has_free_block(&self) -> bool {
        self.remote.contains(&status::EMPTY) && self.under_max_full()
    }

    /// A connection is up with a fresh receiver region. The cache is unknown until the first
    /// sync, which is the first action.
    pub fn handle_connected(&mut self, layout: RemoteLayout) {
        self.epoch += 1;
        self.lent.clear();
        self.layout = Some(layout);
        self.remote = vec![status::FULL; layout.blocks];
        self.cursor = 0;
        self.sync = Sync::Needed;
        self.unsure.clear();
        self.backoff = MIN_BACKOFF;
    }

    /// The connection dropped. Chains not known to be complete, and lossless blocks not yet
    /// confirmed, go back to the front of the queue in their original order, to be sent again on
    /// the next connection.
    pub fn handle_disconnected(&mut self) {
        self.layout = None;
        self.lent.clear();
        // Blocks placed in the receiver's memory are gone with it: the sender has no copy.
        let placed_done = &mut self.placed_done;
        let mut gone = |f: &Filled| match f.placed {
            Some((_, ticket)) => {
                placed_done.push_back((ticket, false));
                false
            }
            None => true,
        };
        self.queue.retain(&mut gone);
        let mut again: Vec<Filled> = self
            .in_flight
            .drain(..)
            .map(|f| f.filled)
            .filter(&mut gone)
            .chain(self.unconfirmed.drain(..).map(|u| u.filled))
            .collect();
        self.stats.requeued += again.len() as u64;
        again.sort_by_key(|f| f.seq);
        for f in again.into_iter().rev() {
            self.queue.push_front(f);
        }
        self.sync = Sync::Needed;
    }

    /// The filling thread filled send block `send_block` with `len` bytes (header, payload,
    /// trailer). Its local status byte is 1 from now until its chain completes — or, for a
    /// block of a lossless device's message ([`Delivery::Confirmed`]), until the receiver
    /// confirmed the whole message: every block of a message is kept until a sync reads its
    /// last block freed, so a receiver that crashes mid-message gets all of it again.
    pub fn handle_filled(&mut self, send_block: usize, len: usize, delivery: Delivery) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let (reliable, last) = match delivery {
            Delivery::Unconfirmed => (false, true),
            Delivery::Confirmed { last } => (true, last),
        };
        let message = if reliable {
            let first = *self.open_message.get_or_insert(seq);
            if last {
                self.open_message = None;
            }
            first
        } else {
            seq
        };
        self.queue.push_back(Filled {
            send_block,
            len,
            reliable,
            seq,
            message,
            last,
            placed: None,
        });
    }

    /// A posted action completed: a write chain (its signaled status WRITE) or the sync READ,
    /// which carries the status bytes it read. Returns false for a completion this machine did
    /// not post (an old connection's, or a stale id).
    pub fn handle_completed(&mut self, now: Instant, completed: Completed<'_>) -> bool {
        match completed {
            Completed::WriteChain { wr_id } => self.handle_write_completed(wr_id),
            Completed::Sync { wr_id, statuses } => self.handle_sync_completed(now, wr_id, statuses),
        }
    }

    /// The signaled status WRITE of chain `wr_id` completed: the block and its status byte are
    /// in the receiver's memory. Returns false for an unknown id.
    pub fn handle_write_completed(&mut self, wr_id: u64) -> bool {
        let Some(pos) = self.in_flight.iter().position(|f| f.wr_id == wr_id) else {
            return false;
        };
        let done = self.in_flight.remove(pos).expect("position is in range");
        if let Some((_, ticket)) = done.filled.placed {
            self.placed_done.push_back((ticket, true));
        } else if done.filled.reliable {
            self.unconfirmed.push_back(Unconfirmed {
                filled: done.filled,
                remote_block: done.remote_block,
                syncs_before: self.stats.syncs,
            });
        } else {
            self.freed.push_back(done.filled.send_block);
        }
        true
    }

    /// The sync READ `wr_id` completed and brought in `statuses` (the whole remote array).
    pub fn handle_sync_completed(&mut self, now: Instant, wr_id: u64, statuses: &[u8]) -> bool {
        let Sync::InFlight(id, seq, why) = self.sync else {
            return false;
        };
        if id != wr_id {
            return false;
        }
        let n = self.remote.len().min(statuses.len());
        self.remote[..n].copy_from_slice(&statuses[..n]);
        // A message's last block whose chain completed before this READ was posted, read as
        // free: the receiver handed the whole message on, so every block of it is confirmed.
        // (Earlier blocks of a message are freed by the receiver as soon as it copied them;
        // they say nothing about the message.)
        let before = self.unconfirmed.len();
        let remote = &self.remote;
        let durable: Vec<u64> = self
            .unconfirmed
            .iter()
            .filter(|u| {
                u.filled.last
                    && u.syncs_before < seq
                    && remote.get(u.remote_block) == Some(&status::EMPTY)
            })
            .map(|u| u.filled.message)
            .collect();
        let freed = &mut self.freed;
        self.unconfirmed.retain(|u| {
            let done = durable.contains(&u.filled.message);
            if done {
                freed.push_back(u.filled.send_block);
            }
            !done
        });
        let confirmed = (before - self.unconfirmed.len()) as u64;
        self.stats.confirmed += confirmed;
        // Lent blocks are still EMPTY in the receiver's memory (their status byte is not
        // written yet) but are the sender's: they stay FULL in the cache too.
        for &j in self.unsure.iter().chain(&self.lent) {
            self.remote[j] = status::FULL;
        }
        self.unsure.clear();
        let progress = match why {
            SyncFor::Block => self.has_free_block(),
            SyncFor::Confirmations => confirmed > 0,
            SyncFor::Look => {
                // Whatever it found, the state is as before it: a write that finds no free
                // block asks for a sync of its own, which backs off if need be.
                self.sync = Sync::Idle;
                return true;
            }
        };
        if progress {
            self.sync = Sync::Idle;
            self.backoff = MIN_BACKOFF;
        } else {
            if why == SyncFor::Block {
                self.stats.empty_syncs += 1;
            }
            self.sync = Sync::RetryAt(now + self.backoff);
            self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        }
        true
    }

    /// Next thing to post, if any. Call until it returns `None`.
    pub fn poll_action(&mut self, now: Instant) -> Option<Action> {
        let layout = self.layout?;
        match self.sync {
            // Writes go on into blocks the cache shows free while the sync is on its way.
            Sync::InFlight(..) => {}
            Sync::RetryAt(t) if now < t => return None,
            Sync::RetryAt(_) => self.sync = Sync::Needed,
            Sync::Needed | Sync::LookWanted | Sync::Idle => {}
        }
        if self.sync == Sync::LookWanted {
            return self.try_sync(SyncFor::Look);
        }
        if self.sync == Sync::Needed {
            return self.try_sync(if self.queue.is_empty() && !self.unconfirmed.is_empty() {
                SyncFor::Confirmations
            } else {
                SyncFor::Block
            });
        }
        let syncing = matches!(self.sync, Sync::InFlight(..));
        if !syncing
            && self.queue.is_empty()
            && self.in_flight.is_empty()
            && !self.unconfirmed.is_empty()
        {
            // Nothing to write and nothing in flight: only acknowledgements can free send blocks.
            return self.try_sync(SyncFor::Confirmations);
        }
        if !syncing
            && self.queue.is_empty()
            && self.in_flight.is_empty()
            && self.lent.len() < self.lend_cap()
            && !self.has_free_block()
        {
            // Blocks to lend are wanted and the cache shows none free.
            return self.try_sync(SyncFor::Block);
        }
        if self.queue.is_empty() || self.in_flight.len() >= self.max_outstanding {
            return None;
        }
        if let Some((j, _)) = self.queue.front().and_then(|f| f.placed) {
            // Written in place already: only its status byte is left (the block stays lent,
            // so FULL in the cache, until then).
            self.lent.retain(|&k| k != j);
            let (wr_id, _) = self.start_chain(j);
            self.stats.placed += 1;
            if self.sync_after_placed && self.max_full.is_some() && self.sync == Sync::Idle {
                // The next call posts it, after this status byte.
                self.sync = Sync::LookWanted;
                self.stats.early_syncs += 1;
            }
            return Some(Action::Status {
                wr_id,
                remote_block: j,
            });
        }
        match self.find_free_block(layout.blocks) {
            Some(j) => {
                self.remote[j] = status::FULL;
                self.cursor = (j + 1) % layout.blocks;
                let (wr_id, filled) = self.start_chain(j);
                let low_water = self.low_water();
                if !syncing && low_water > 0 && self.usable_in_cache() <= low_water {
                    // Few free blocks left: read the statuses now, while these are written, so
                    // that the answer is back before the cache runs dry (the next call posts
                    // the sync).
                    self.sync = Sync::Needed;
                    self.stats.early_syncs += 1;
                }
                Some(Action::Write {
                    wr_id,
                    send_block: filled.send_block,
                    remote_block: j,
                    len: filled.len,
                })
            }
            None if syncing => None,
            None => {
                self.sync = Sync::Needed;
                self.try_sync(SyncFor::Block)
            }
        }
    }

    /// Blocks the cache shows free.
    fn free_in_cache(&self) -> usize {
        self.remote.iter().filter(|&&b| b == status::EMPTY).count()
    }

    /// Free blocks the cache shows that may be written now: all of them, or with
    /// [`Self::set_max_full`] only as many as keep the FULL ones within the limit.
    fn usable_in_cache(&self) -> usize {
        let free = self.free_in_cache();
        self.max_full.map_or(free, |max| {
            free.min(max.saturating_sub(self.full_in_cache()))
        })
    }

    /// Blocks the cache shows FULL (lent ones included).
    fn full_in_cache(&self) -> usize {
        self.remote.iter().filter(|&&b| b == status::FULL).count()
    }

    /// Whether another block may be made FULL under [`Self::set_max_full`] (always without a
    /// limit: then nothing is counted, as before the limit existed).
    fn under_max_full(&self) -> bool {
        self.max_full.is_none_or(|max| self.full_in_cache() < max)
    }

    /// With this many free blocks left in the cache, a write asks for a sync at once
    /// ([`SenderStats::early_syncs`]): a quarter of the receiver's blocks, at most the chains
    /// that may be in flight; none with fewer than four blocks (a sync when none is left, as
    /// the paper's sender does).
    fn low_water(&self) -> usize {
        if !self.early_sync
            || self
                .layout
                .is_none_or(|l| l.block_size < EARLY_SYNC_MIN_BLOCK)
        {
            return 0;
        }
        (self.remote.len() / 4).min(self.max_outstanding)
    }

    /// The next queued block goes out in a chain into remote block `j`: in flight from now on.
    fn start_chain(&mut self, j: usize) -> (u64, Filled) {
        let filled = self.queue.pop_front().expect("queue is not empty");
        let wr_id = self.take_wr_id();
        if matches!(self.sync, Sync::InFlight(..)) {
            // The sync in flight may read this block's status before or after this chain
            // writes it: it stays FULL in the cache whatever the READ returns.
            self.unsure.push(j);
        }
        self.in_flight.push_back(InFlight {
            wr_id,
            filled,
            remote_block: j,
        });
        self.stats.writes += 1;
        (wr_id, filled)
    }

    fn try_sync(&mut self, why: SyncFor) -> Option<Action> {
        let remote_blocks: Vec<usize> = self.in_flight.iter().map(|f| f.remote_block).collect();
        self.unsure = remote_blocks;
        let wr_id = self.take_wr_id();
        self.stats.syncs += 1;
        self.sync = Sync::InFlight(wr_id, self.stats.syncs, why);
        Some(Action::Sync { wr_id })
    }

    fn find_free_block(&mut self, n: usize) -> Option<usize> {
        if !self.under_max_full() {
            return None;
        }
        let start = if self.max_full.is_some() || self.lowest_first {
            0
        } else {
            self.cursor
        };
        for k in 0..n {
            let j = (start + k) % n;
            match self.remote[j] {
                status::EMPTY => return Some(j),
                status::RETAINED => self.stats.retained_skipped += 1,
                _ => {}
            }
        }
        None
    }

    fn take_wr_id(&mut self) -> u64 {
        let id = self.next_wr_id;
        self.next_wr_id += 1;
        id
    }

    /// A send block whose chain completed; give it back to the filling thread.
    pub fn poll_freed(&mut self) -> Option<usize> {
        self.freed.pop_front()
    }

    /// When the machine wants to be woken although no input arrived (sync backoff).
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.sync {
            Sync::RetryAt(t) if self.layout.is_some() => Some(t),
            _ => None,
        }
    }

    /// Whether a connection is up.
    pub fn is_connected(&self) -> bool {
        self.layout.is_some()
    }

    /// Chains posted and not completed.
    pub fn outstanding(&self) -> usize {
        self.in_flight.len()
    }

    /// Whether a sync READ is posted and not completed.
    pub fn sync_in_flight(&self) -> bool {
        matches!(self.sync, Sync::InFlight(..))
    }

    /// Lossless blocks written and not yet confirmed by the receiver.
    pub fn unconfirmed(&self) -> usize {
        self.unconfirmed.len()
    }

    /// Filled send blocks not yet posted.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// True when nothing is queued, posted, unconfirmed or waiting to be freed.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty()
            && self.in_flight.is_empty()
            && self.unconfirmed.is_empty()
            && self.freed.is_empty()
            && self.placed_done.is_empty()
    }

    /// The cached remote status bytes.
    pub fn remote_cache(&self) -> &[u8] {
        &self.remote
    }

    /// Counters.
    pub fn stats(&self) -> SenderStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connected(n: usize, depth: usize) -> (SenderMachine, Instant) {
        let mut m = SenderMachine::new(depth);
        m.handle_connected(RemoteLayout {
            blocks: n,
            block_size: 1 << 20,
        });
        (m, Instant::now())
    }

    #[test]
    fn first_action_is_a_sync_and_writes_wait_for_it() {
        let (mut m, now) = connected(3, 4);
        m.handle_filled(0, 10, Delivery::Unconfirmed);
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!()
        };
        assert_eq!(
            m.poll_action(now),
            None,
            "no write while the sync is in flight"
        );
        assert!(m.handle_sync_completed(now, wr_id, &[0, 0, 0]));
        assert!(matches!(
            m.poll_action(now),
            Some(Action::Write {
                remote_block: 0,
                ..
            })
        ));
    }

    #[test]
    fn round_robin_skips_full_and_retained() {
        let (mut m, now) = connected(4, 8);
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!()
        };
        m.handle_sync_completed(now, wr_id, &[1, 0, 2, 0]);
        for i in 0..2 {
            m.handle_filled(i, 10, Delivery::Unconfirmed);
        }
        // (With one free block left the second write asks for an early sync.)
        let blocks: Vec<_> = std::iter::from_fn(|| m.poll_action(now))
            .filter_map(|a| match a {
                Action::Write { remote_block, .. } => Some(remote_block),
                Action::Sync { .. } => None,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(blocks, vec![1, 3]);
        assert!(m.stats().retained_skipped >= 1);
    }

    /// Lowest first, a block a sync found free again is written before the round-robin's next
    /// one; round-robin (the default) goes on from where it was.
    #[test]
    fn lowest_first_writes_a_freed_low_block_again_before_the_next_one() {
        for (lowest, want) in [(false, vec![0, 1, 2, 3, 4]), (true, vec![0, 1, 2, 0, 1])] {
            let (mut m, now) = connected(8, 8);
            m.set_lowest_first(lowest);
            let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
                panic!()
            };
            m.handle_sync_completed(now, wr_id, &[0; 8]);
            let mut written = Vec::new();
            let mut write = |m: &mut SenderMachine, send_block: usize, delivery: Delivery| {
                m.handle_filled(send_block, 10, delivery);
                let Some(Action::Write {
                    remote_block,
                    wr_id,
                    ..
                }) = m.poll_action(now)
                else {
                    panic!("a write")
                };
                written.push(remote_block);
                m.handle_write_completed(wr_id);
            };
            // Three lossless blocks: with nothing else to do the machine syncs to see them
            // confirmed, and the receiver has freed the first two by then.
            for i in 0..3 {
                write(&mut m, i, Delivery::Confirmed { last: true });
            }
            let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
                panic!("a sync for confirmations")
            };
            m.handle_sync_completed(now, wr_id, &[0, 0, 1, 0, 0, 0, 0, 0]);
            for i in 3..5 {
                write(&mut m, i, Delivery::Unconfirmed);
            }
            assert_eq!(written, want, "lowest first: {lowest}");
        }
    }

    /// With a quarter of the blocks (at most the chains in flight) left free in the cache, a
    /// write asks for a sync at once; writes go on into the cache's free blocks while it is on
    /// its way, and every block written before or during it stays FULL whatever it read.
    #[test]
    fn an_early_sync_lets_writes_go_on_and_keeps_their_blocks_full() {
        let (mut m, now) = connected(16, 16);
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!()
        };
        m.handle_sync_completed(now, wr_id, &[0; 16]);
        for i in 0..14 {
            m.handle_filled(i, 10, Delivery::Unconfirmed);
        }
        let actions: Vec<_> = std::iter::from_fn(|| m.poll_action(now)).collect();
        let shown: Vec<String> = actions
            .iter()
            .map(|a| match a {
                Action::Write { remote_block, .. } => format!("w{remote_block}"),
                Action::Sync { .. } => "sync".into(),
                other => panic!("{other:?}"),
            })
            .collect();
        let want: Vec<String> = (0..12)
            .map(|j| format!("w{j}"))
            .chain(["sync".to_string(), "w12".into(), "w13".into()])
            .collect();
        assert_eq!(shown, want, "the sync goes out with four blocks left");
        assert_eq!(m.stats().early_syncs, 1);
        let Action::Sync { wr_id } = actions[12] else {
            panic!()
        };
        // The chains complete. The READ reads blocks 0-5 freed by the receiver (they stay FULL
        // in the cache all the same: their chains were in flight when it was posted), and
        // 12-15 EMPTY: it overtook the writes into 12 and 13.
        for a in &actions {
            if let Action::Write { wr_id, .. } = a {
                m.handle_write_completed(*wr_id);
            }
        }
        let mut read = [1u8; 16];
        read[..6].fill(0);
        read[12..].fill(0);
        m.handle_sync_completed(now, wr_id, &read);
        let mut want = [1u8; 16];
        want[14..].fill(0);
        assert_eq!(
            m.remote_cache(),
            &want,
            "blocks written before or during the sync stay FULL"
        );
    }

    /// Without early syncs (verbs), the sender syncs only when the cache shows no free block;
    /// the same for blocks below [`EARLY_SYNC_MIN_BLOCK`].
    #[test]
    fn without_early_syncs_the_cache_runs_dry_first() {
        for small in [false, true] {
            let mut m = SenderMachine::new(32);
            m.handle_connected(RemoteLayout {
                blocks: 16,
                block_size: if small { 65536 } else { 1 << 20 },
            });
            m.set_early_sync(small);
            cache_runs_dry_first(m);
        }
    }

    fn cache_runs_dry_first(mut m: SenderMachine) {
        let now = Instant::now();
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!()
        };
        m.handle_sync_completed(now, wr_id, &[0; 16]);
        for i in 0..17 {
            m.handle_filled(i, 10, Delivery::Unconfirmed);
        }
        let actions: Vec<_> = std::iter::from_fn(|| m.poll_action(now)).collect();
        assert_eq!(actions.len(), 17, "{actions:?}");
        assert!(
            actions[..16]
                .iter()
                .all(|a| matches!(a, Action::Write { .. }))
        );
        assert!(matches!(actions[16], Action::Sync { .. }));
        assert_eq!(m.stats().early_syncs, 0);
    }

    #[test]
    fn sync_keeps_outstanding_blocks_full_then_backs_off_when_nothing_is_free() {
        let (mut m, now) = connected(1, 4);
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!()
        };
        m.handle_sync_completed(now, wr_id, &[0]);
        m.handle_filled(0, 10, Delivery::Unconfirmed);
        m.handle_filled(1, 10, Delivery::Unconfirmed);
        let Some(Action::Write { wr_id: w, .. }) = m.poll_action(now) else {
            panic!()
        };
        // The cache is exhausted: sync at once, without waiting for the write to complete.
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!()
        };
        assert_eq!(
            m.poll_action(now),
            None,
            "no write while the sync is in flight"
        );
        // The READ overtook the write and saw the block still empty: it must stay full.
        m.handle_sync_completed(now, wr_id, &[0]);
        assert_eq!(m.remote_cache(), &[1]);
        m.handle_write_completed(w);
        assert_eq!(m.poll_freed(), Some(0));
        // Nothing was free: the next sync waits for the backoff.
        assert_eq!(m.poll_action(now), None);
        let retry = m.poll_timeout().expect("backoff timer");
        let Some(Action::Sync { wr_id }) = m.poll_action(retry) else {
            panic!()
        };
        m.handle_sync_completed(retry, wr_id, &[1]);
        assert_eq!(m.poll_action(retry), None);
        let t = m.poll_timeout().expect("backoff timer");
        assert!(matches!(m.poll_action(t), Some(Action::Sync { .. })));
    }

    #[test]
    fn lossless_blocks_wait_for_a_later_sync_to_read_them_free() {
        let (mut m, now) = connected(4, 4);
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!()
        };
        m.handle_sync_completed(now, wr_id, &[0; 4]);
        m.handle_filled(0, 10, Delivery::Confirmed { last: true });
        m.handle_filled(1, 10, Delivery::Unconfirmed);
        let writes: Vec<_> = std::iter::from_fn(|| m.poll_action(now)).collect();
        let ids: Vec<u64> = writes
            .iter()
            .map(|a| match a {
                Action::Write { wr_id, .. } => *wr_id,
                other => panic!("{other:?}"),
            })
            .collect();
        for id in &ids {
            m.handle_write_completed(*id);
        }
        // The plain block is free at once; the lossless one is not.
        assert_eq!(m.poll_freed(), Some(1));
        assert_eq!(m.poll_freed(), None);
        assert_eq!(m.unconfirmed(), 1);
        assert!(!m.is_idle());
        // Nothing else to do: the machine asks for the acknowledgement itself.
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!("no confirmation sync")
        };
        // The receiver still holds it (status 2): not confirmed; the next try backs off.
        m.handle_sync_completed(now, wr_id, &[2, 1, 0, 0]);
        assert_eq!(m.poll_freed(), None);
        assert_eq!(m.poll_action(now), None);
        let t = m.poll_timeout().expect("backoff");
        let Some(Action::Sync { wr_id }) = m.poll_action(t) else {
            panic!()
        };
        m.handle_sync_completed(t, wr_id, &[0, 0, 0, 0]);
        assert_eq!(m.poll_freed(), Some(0));
        assert_eq!(m.stats().confirmed, 1);
        assert!(m.is_idle());
    }

    /// The receiver frees a lossless message's first blocks as soon as it copied them, and the
    /// last only once the whole message is durable: the first blocks read free confirm
    /// nothing, and a drop before the last is confirmed sends the whole message again.
    #[test]
    fn a_message_is_confirmed_whole_by_its_last_block() {
        let (mut m, now) = connected(4, 4);
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!()
        };
        m.handle_sync_completed(now, wr_id, &[0; 4]);
        m.handle_filled(0, 10, Delivery::Confirmed { last: false });
        m.handle_filled(1, 10, Delivery::Confirmed { last: true });
        let ids: Vec<u64> = std::iter::from_fn(|| m.poll_action(now))
            .map(|a| match a {
                Action::Write { wr_id, .. } => wr_id,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(ids.len(), 2);
        for id in &ids {
            m.handle_write_completed(*id);
        }
        // The receiver copied the first block (freed) but the message is not durable yet.
        let Some(Action::Sync { wr_id: s1 }) = m.poll_action(now) else {
            panic!()
        };
        m.handle_sync_completed(now, s1, &[0, 2, 0, 0]);
        assert_eq!(
            m.poll_freed(),
            None,
            "a first block read free confirms nothing"
        );
        assert_eq!(m.unconfirmed(), 2);
        // A crash now: both blocks go out again, in order.
        m.handle_disconnected();
        assert_eq!(m.stats().requeued, 2);
        m.handle_connected(RemoteLayout {
            blocks: 4,
            block_size: 1 << 20,
        });
        let Some(Action::Sync { wr_id: s2 }) = m.poll_action(now) else {
            panic!()
        };
        m.handle_sync_completed(now, s2, &[0; 4]);
        let again: Vec<(u64, usize)> = std::iter::from_fn(|| m.poll_action(now))
            .map(|a| match a {
                Action::Write {
                    wr_id, send_block, ..
                } => (wr_id, send_block),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(again.iter().map(|a| a.1).collect::<Vec<_>>(), vec![0, 1]);
        for (id, _) in &again {
            m.handle_write_completed(*id);
        }
        // The last block read free: the whole message is confirmed.
        let Some(Action::Sync { wr_id: s3 }) = m.poll_action(now) else {
            panic!()
        };
        m.handle_sync_completed(now, s3, &[0; 4]);
        let mut freed: Vec<usize> = std::iter::from_fn(|| m.poll_freed()).collect();
        freed.sort();
        assert_eq!(freed, vec![0, 1]);
        assert!(m.is_idle());
    }

    #[test]
    fn a_sync_posted_before_the_completion_confirms_nothing() {
        let (mut m, now) = connected(2, 4);
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!()
        };
        m.handle_sync_completed(now, wr_id, &[0, 0]);
        m.handle_filled(0, 10, Delivery::Confirmed { last: true });
        m.handle_filled(1, 10, Delivery::Confirmed { last: true });
        m.handle_filled(2, 10, Delivery::Confirmed { last: true });
        let Some(Action::Write { wr_id: w0, .. }) = m.poll_action(now) else {
            panic!()
        };
        let Some(Action::Write { .. }) = m.poll_action(now) else {
            panic!()
        };
        // Out of remote blocks: a sync goes out while both chains are in flight ...
        let Some(Action::Sync { wr_id: s }) = m.poll_action(now) else {
            panic!()
        };
        m.handle_write_completed(w0);
        // ... and overtakes the writes: it reads 0 for block 0, which must not confirm it.
        m.handle_sync_completed(now, s, &[0, 0]);
        assert_eq!(m.poll_freed(), None);
        assert_eq!(m.unconfirmed(), 1);
    }

    #[test]
    fn unconfirmed_blocks_are_sent_again_after_a_drop_in_fill_order() {
        let (mut m, now) = connected(4, 4);
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!()
        };
        m.handle_sync_completed(now, wr_id, &[0; 4]);
        for i in 0..3 {
            m.handle_filled(i, 10, Delivery::Confirmed { last: true });
        }
        // (The third write leaves one free block and asks for an early sync.)
        let ids: Vec<u64> = std::iter::from_fn(|| m.poll_action(now))
            .filter_map(|a| match a {
                Action::Write { wr_id, .. } => Some(wr_id),
                Action::Sync { .. } => None,
                other => panic!("{other:?}"),
            })
            .collect();
        // The first and the last completed (unconfirmed), the middle one did not.
        m.handle_write_completed(ids[0]);
        m.handle_write_completed(ids[2]);
        m.handle_disconnected();
        m.handle_connected(RemoteLayout {
            blocks: 4,
            block_size: 1 << 20,
        });
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!()
        };
        m.handle_sync_completed(now, wr_id, &[0; 4]);
        let again: Vec<usize> = std::iter::from_fn(|| m.poll_action(now))
            .filter_map(|a| match a {
                Action::Write { send_block, .. } => Some(send_block),
                _ => None,
            })
            .collect();
        assert_eq!(again, vec![0, 1, 2]);
        assert_eq!(m.stats().requeued, 3);
    }

    #[test]
    fn disconnect_requeues_in_order() {
        let (mut m, now) = connected(4, 4);
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!()
        };
        m.handle_sync_completed(now, wr_id, &[0; 4]);
        for i in 0..3 {
            m.handle_filled(i, 10, Delivery::Unconfirmed);
        }
        let ids: Vec<_> = std::iter::from_fn(|| m.poll_action(now))
            .filter(|a| !matches!(a, Action::Sync { .. }))
            .collect();
        assert_eq!(ids.len(), 3);
        let Action::Write { wr_id: first, .. } = ids[0] else {
            panic!()
        };
        m.handle_write_completed(first);
        m.handle_disconnected();
        assert_eq!(m.poll_action(now), None);
        m.handle_connected(RemoteLayout {
            blocks: 4,
            block_size: 1 << 20,
        });
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!()
        };
        m.handle_sync_completed(now, wr_id, &[0; 4]);
        let sent: Vec<_> = std::iter::from_fn(|| m.poll_action(now))
            .map(|a| match a {
                Action::Write { send_block, .. } => send_block,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(sent, vec![1, 2]);
        assert_eq!(m.stats().requeued, 2);
    }

    fn synced(n: usize, depth: usize, statuses: &[u8]) -> (SenderMachine, Instant) {
        let (mut m, now) = connected(n, depth);
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!()
        };
        assert!(m.handle_sync_completed(now, wr_id, statuses));
        (m, now)
    }

    /// A lent block is the sender's until its status byte is posted: no write picks it, a sync
    /// that reads it EMPTY (its status byte is not written yet) leaves it FULL in the cache,
    /// and once placed only its status byte goes out, in fill order with the other blocks.
    #[test]
    fn lent_blocks_stay_the_senders_through_syncs_and_get_only_their_status_byte() {
        let (mut m, now) = synced(8, 8, &[0; 8]);
        assert_eq!(m.lend(), None, "lends nothing unless allowed");
        m.set_max_lent(3);
        let a = m.lend().expect("a free block");
        let b = m.lend().expect("a second");
        assert_eq!((a.remote_block, b.remote_block), (0, 1));
        assert_eq!(m.lend(), None, "at most a quarter of the remote blocks");
        assert_eq!(m.lent_out(), 2);
        // Six writes go to the six other blocks, with an early sync once two are left (which
        // reads the lent blocks EMPTY: nothing was posted for them).
        for i in 5..12 {
            m.handle_filled(i, 10, Delivery::Unconfirmed);
        }
        let writes: Vec<_> = std::iter::from_fn(|| m.poll_action(now)).collect();
        let syncs: Vec<u64> = writes
            .iter()
            .filter_map(|a| match a {
                Action::Sync { wr_id } => Some(*wr_id),
                _ => None,
            })
            .collect();
        let [wr_id] = syncs[..] else {
            panic!("{writes:?}")
        };
        assert!(
            matches!(writes[4], Action::Sync { .. }),
            "early sync after four writes: {writes:?}"
        );
        let targets: Vec<usize> = writes
            .iter()
            .filter(|a| !matches!(a, Action::Sync { .. }))
            .map(|w| match w {
                Action::Write {
                    wr_id,
                    remote_block,
                    ..
                } => {
                    m.handle_write_completed(*wr_id);
                    *remote_block
                }
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(targets, vec![2, 3, 4, 5, 6, 7], "a lent block was written");
        // That sync overtook the writes posted before it and raced those posted after it (they
        // all stay FULL too); the next one, posted after they completed, finds their blocks
        // freed by the receiver, and the lent ones still FULL.
        m.handle_sync_completed(now, wr_id, &[0; 8]);
        assert_eq!(m.remote_cache(), &[1; 8], "lent blocks stay FULL");
        assert_eq!(m.poll_action(now), None, "backs off");
        let t = m.poll_timeout().expect("backoff");
        let Some(Action::Sync { wr_id }) = m.poll_action(t) else {
            panic!()
        };
        m.handle_sync_completed(t, wr_id, &[0; 8]);
        assert_eq!(
            m.remote_cache(),
            &[1, 1, 0, 0, 0, 0, 0, 0],
            "lent blocks stay FULL"
        );
        // Send block 11 goes to a block the receiver freed, never to a lent one.
        let Some(Action::Write {
            wr_id: w7,
            remote_block,
            ..
        }) = m.poll_action(now)
        else {
            panic!()
        };
        assert!(remote_block >= 2, "wrote lent block {remote_block}");
        m.handle_write_completed(w7);
        // Placed: only the status byte is posted; the ticket comes back delivered.
        m.handle_placed(b, 41);
        m.handle_placed(a, 40);
        let Some(Action::Status {
            wr_id: first,
            remote_block: 1,
        }) = m.poll_action(now)
        else {
            panic!("not the status byte of block 1 first")
        };
        let Some(Action::Status {
            wr_id: second,
            remote_block: 0,
        }) = m.poll_action(now)
        else {
            panic!()
        };
        assert!(m.handle_write_completed(first));
        assert!(m.handle_write_completed(second));
        assert_eq!(m.poll_placed(), Some((41, true)));
        assert_eq!(m.poll_placed(), Some((40, true)));
        assert_eq!(m.lent_out(), 0);
        assert_eq!((m.stats().lent, m.stats().placed), (2, 2));
        // Not freed as send blocks: they never were any.
        let freed: Vec<usize> = std::iter::from_fn(|| m.poll_freed()).collect();
        assert_eq!(freed, (5..12).collect::<Vec<_>>());
    }

    /// Queued blocks come first: nothing is lent that one of them needs; a block given back
    /// unused is free again at once (its status byte was never written).
    #[test]
    fn lending_waits_for_queued_blocks_and_a_returned_block_is_free_again() {
        let (mut m, now) = synced(4, 3, &[0; 4]);
        assert!(!m.lending_waits_on_queue(), "nothing queued");
        m.handle_filled(0, 10, Delivery::Unconfirmed);
        assert!(!m.lending_waits_on_queue(), "this machine lends nothing");
        m.set_max_lent(1);
        assert!(m.lending_waits_on_queue());
        for i in 1..4 {
            m.handle_filled(i, 10, Delivery::Unconfirmed);
        }
        assert_eq!(
            m.lend(),
            None,
            "four queued blocks need the four free blocks"
        );
        assert!(m.lending_waits_on_queue());
        let mut early = None;
        let posted: Vec<u64> = std::iter::from_fn(|| match m.poll_action(now) {
            Some(Action::Write { wr_id, .. }) => Some(Some(wr_id)),
            Some(Action::Sync { wr_id }) => {
                early = Some(wr_id);
                Some(None)
            }
            None => None,
            Some(other) => panic!("{other:?}"),
        })
        .flatten()
        .collect();
        assert_eq!(posted.len(), 3, "three chains at most are outstanding");
        let early = early.expect("an early sync with one free block left");
        assert_eq!(m.lend(), None, "one queued block needs the one free block");
        for id in posted {
            m.handle_write_completed(id);
        }
        // The last block is written while the early sync is on its way.
        let Some(Action::Write { wr_id, .. }) = m.poll_action(now) else {
            panic!()
        };
        m.handle_write_completed(wr_id);
        assert_eq!(m.poll_action(now), None, "one sync at a time");
        // Every block was written before or during that sync: all stay FULL, and with
        // nothing free it backs off.
        m.handle_sync_completed(now, early, &[0; 4]);
        assert_eq!(m.remote_cache(), &[1; 4]);
        assert!(!m.lending_waits_on_queue(), "the queue is empty");
        // Nothing queued, nothing free in the cache: a sync for blocks to lend; the receiver
        // freed block 0 meanwhile.
        assert_eq!(m.lend(), None);
        let t = m.poll_timeout().expect("backoff");
        let Some(Action::Sync { wr_id }) = m.poll_action(t) else {
            panic!()
        };
        m.handle_sync_completed(now, wr_id, &[0, 1, 1, 1]);
        let l = m.lend().expect("nothing queued now");
        assert_eq!(l.remote_block, 0);
        assert!(!m.has_free_block());
        m.handle_returned(l);
        assert!(m.has_free_block());
        assert_eq!(m.lent_out(), 0);
        // A block given back twice, or never lent, changes nothing.
        m.handle_returned(l);
        assert_eq!(m.lent_out(), 0);
    }

    /// With every remote block FULL in the cache and lending allowed, the machine syncs (with
    /// back-off) to find blocks to lend, though nothing is queued.
    #[test]
    fn the_machine_syncs_to_find_blocks_to_lend() {
        let (mut m, now) = synced(8, 4, &[0, 1, 1, 1, 1, 1, 1, 1]);
        assert_eq!(m.poll_action(now), None, "nothing to do");
        m.set_max_lent(2);
        assert_eq!(m.lend().map(|l| l.remote_block), Some(0));
        assert_eq!(m.lend(), None, "none free in the cache");
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!("no sync for blocks to lend")
        };
        m.handle_sync_completed(now, wr_id, &[0, 1, 0, 1, 1, 1, 1, 1]);
        assert_eq!(
            m.remote_cache(),
            &[1, 1, 0, 1, 1, 1, 1, 1],
            "the lent block stays FULL"
        );
        assert_eq!(m.lend().map(|l| l.remote_block), Some(2));
        assert_eq!(
            m.poll_action(now),
            None,
            "the limit is reached: no more syncs"
        );
    }

    /// Under a FULL limit, a placed block's status post is followed by a sync when the machine
    /// is told syncs cost nothing (shm), and not otherwise; with it the next lend takes a block
    /// the receiver freed meanwhile (here block 0 again) instead of the next one the cache
    /// still shows free.
    #[test]
    fn a_placed_block_is_followed_by_a_sync_only_where_syncs_are_free() {
        for on in [false, true] {
            let (mut m, now) = synced(8, 4, &[0; 8]);
            m.set_max_full(Some(4));
            m.set_max_lent(2);
            m.set_sync_after_placed(on);
            for (ticket, block) in [(1, 0), (2, 1)] {
                let lent = m.lend().expect("a free block");
                assert_eq!(lent.remote_block, block);
                m.handle_placed(lent, ticket);
                let Some(Action::Status {
                    wr_id,
                    remote_block,
                }) = m.poll_action(now)
                else {
                    panic!("the placed block's status byte first")
                };
                assert_eq!(remote_block, block);
                let next = m.poll_action(now);
                assert_eq!(
                    matches!(next, Some(Action::Sync { .. })),
                    on,
                    "sync after placed {on}: {next:?}"
                );
                if on {
                    assert_eq!(m.lend(), None, "no lending while the sync is in flight");
                }
                m.handle_write_completed(wr_id);
                if let Some(Action::Sync { wr_id }) = next {
                    // The receiver took every placed block already; the one whose status
                    // byte raced this READ stays FULL.
                    m.handle_sync_completed(now, wr_id, &[0; 8]);
                }
            }
            assert_eq!(m.stats().early_syncs, if on { 2 } else { 0 });
            let expected = if on { 0 } else { 2 };
            assert_eq!(m.lend().map(|l| l.remote_block), Some(expected), "{on}");
        }
    }

    /// The sync after a placed block is a look: when it finds nothing free under the FULL
    /// limit, the machine does not back off (nor count an empty sync), so lending and writes
    /// go on as soon as the cache shows a block again, and a write that finds none syncs at
    /// once.
    #[test]
    fn a_look_after_a_placed_block_that_finds_nothing_free_does_not_back_off() {
        let (mut m, now) = synced(8, 4, &[0; 8]);
        m.set_max_full(Some(2));
        m.set_max_lent(2);
        m.set_sync_after_placed(true);
        // Block 1 is written by a chain, block 0 placed: both FULL, the limit.
        m.handle_filled(0, 10, Delivery::Unconfirmed);
        let Some(Action::Write {
            wr_id: w,
            remote_block: 0,
            ..
        }) = m.poll_action(now)
        else {
            panic!()
        };
        m.handle_write_completed(w);
        // That write left one block under the limit: an early sync first.
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!("the early sync")
        };
        m.handle_sync_completed(now, wr_id, &[1, 0, 0, 0, 0, 0, 0, 0]);
        let lent = m.lend().expect("one block under the limit");
        assert_eq!(lent.remote_block, 1);
        m.handle_placed(lent, 1);
        let Some(Action::Status { wr_id: s, .. }) = m.poll_action(now) else {
            panic!()
        };
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!("the look")
        };
        m.handle_write_completed(s);
        // The receiver has not taken either yet.
        m.handle_sync_completed(now, wr_id, &[1, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(m.poll_timeout(), None, "no back-off after a look");
        assert_eq!(m.stats().empty_syncs, 0);
        // A block to write finds none free under the limit and syncs at once, as without it.
        m.handle_filled(1, 10, Delivery::Unconfirmed);
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!("a sync of its own")
        };
        m.handle_sync_completed(now, wr_id, &[1, 1, 0, 0, 0, 0, 0, 0]);
        assert!(m.poll_timeout().is_some(), "that one backs off");
        assert_eq!(m.stats().empty_syncs, 1);
    }

    /// A look asked for but not yet posted when the connection drops is not carried over: the
    /// next connection's first sync is an ordinary one, which backs off when it finds nothing
    /// free.
    #[test]
    fn a_look_wanted_at_a_disconnect_does_not_become_the_next_connections_first_sync() {
        let (mut m, now) = synced(8, 4, &[0; 8]);
        m.set_max_full(Some(4));
        m.set_max_lent(2);
        m.set_sync_after_placed(true);
        let lent = m.lend().expect("a free block");
        m.handle_placed(lent, 1);
        let Some(Action::Status { .. }) = m.poll_action(now) else {
            panic!("the placed block's status byte")
        };
        m.handle_disconnected();
        m.handle_connected(RemoteLayout {
            blocks: 8,
            block_size: 1 << 20,
        });
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!("the first sync of the new connection")
        };
        m.handle_sync_completed(now, wr_id, &[1; 8]);
        assert!(m.poll_timeout().is_some(), "an ordinary sync backs off");
        assert_eq!(m.stats().empty_syncs, 1);
    }

    /// A connection's lent blocks are worthless on the next: one placed after the drop, and one
    /// placed before it whose status byte was not posted, come back undelivered; the blocks
    /// queued around them go again.
    #[test]
    fn blocks_placed_in_an_old_connections_memory_are_not_delivered() {
        let (mut m, now) = synced(8, 4, &[0; 8]);
        m.set_max_lent(2);
        let a = m.lend().unwrap();
        let b = m.lend().unwrap();
        m.handle_placed(a, 1);
        m.handle_filled(3, 10, Delivery::Unconfirmed);
        m.handle_disconnected();
        assert_eq!(m.poll_placed(), Some((1, false)));
        m.handle_connected(RemoteLayout {
            blocks: 8,
            block_size: 1 << 20,
        });
        m.handle_placed(b, 2);
        assert_eq!(m.poll_placed(), Some((2, false)));
        assert_eq!(m.stats().stale_placed, 1);
        m.handle_returned(b); // ignored: of the old connection
        let Some(Action::Sync { wr_id }) = m.poll_action(now) else {
            panic!()
        };
        m.handle_sync_completed(now, wr_id, &[0; 8]);
        let Some(Action::Write {
            send_block: 3,
            remote_block: 0,
            ..
        }) = m.poll_action(now)
        else {
            panic!("the queued block goes again")
        };
        assert_eq!(m.poll_action(now), None);
    }
}
