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
//! refreshed by a whole-array READ (the sync), posted when the cache shows no free block, or when
//! nothing else can move and unconfirmed blocks wait for their acknowledgement. The READ
//! may overtake write chains that are still outstanding (their status byte may not be placed yet,
//! so the READ can see a stale 0): every block written by a chain that had not completed when the
//! READ was posted stays 1 in the cache whatever the READ returned, until a later sync. A block
//! the cache shows as 0 really is free (only the sender turns a 0 into anything else — see
//! docs/protocol.md), so writes never depend on a READ that has not completed.

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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sync {
    /// The cache is usable.
    Idle,
    /// A sync must be posted as soon as no write is outstanding (after connect, or when the
    /// cache shows no free block).
    Needed,
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
}

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
        }
    }

    /// A connection is up with a fresh receiver region. The cache is unknown until the first
    /// sync, which is the first action.
    pub fn handle_connected(&mut self, layout: RemoteLayout) {
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
        let mut again: Vec<Filled> = self
            .in_flight
            .drain(..)
            .map(|f| f.filled)
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
        if done.filled.reliable {
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
        for &j in &self.unsure {
            self.remote[j] = status::FULL;
        }
        self.unsure.clear();
        let progress = match why {
            SyncFor::Block => self.remote.contains(&status::EMPTY),
            SyncFor::Confirmations => confirmed > 0,
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
            Sync::InFlight(..) => return None,
            Sync::RetryAt(t) if now < t => return None,
            Sync::RetryAt(_) => self.sync = Sync::Needed,
            Sync::Needed | Sync::Idle => {}
        }
        if self.sync == Sync::Needed {
            return self.try_sync(if self.queue.is_empty() && !self.unconfirmed.is_empty() {
                SyncFor::Confirmations
            } else {
                SyncFor::Block
            });
        }
        if self.queue.is_empty() && self.in_flight.is_empty() && !self.unconfirmed.is_empty() {
            // Nothing to write and nothing in flight: only acknowledgements can free send blocks.
            return self.try_sync(SyncFor::Confirmations);
        }
        if self.queue.is_empty() || self.in_flight.len() >= self.max_outstanding {
            return None;
        }
        match self.find_free_block(layout.blocks) {
            Some(j) => {
                let filled = self.queue.pop_front().expect("queue is not empty");
                self.remote[j] = status::FULL;
                self.cursor = (j + 1) % layout.blocks;
                let wr_id = self.take_wr_id();
                self.in_flight.push_back(InFlight {
                    wr_id,
                    filled,
                    remote_block: j,
                });
                self.stats.writes += 1;
                Some(Action::Write {
                    wr_id,
                    send_block: filled.send_block,
                    remote_block: j,
                    len: filled.len,
                })
            }
            None => {
                self.sync = Sync::Needed;
                self.try_sync(SyncFor::Block)
            }
        }
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
        for k in 0..n {
            let j = (self.cursor + k) % n;
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
            block_size: 64,
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
        let blocks: Vec<_> = std::iter::from_fn(|| m.poll_action(now))
            .map(|a| match a {
                Action::Write { remote_block, .. } => remote_block,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(blocks, vec![1, 3]);
        assert!(m.stats().retained_skipped >= 1);
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
            block_size: 64,
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
        let ids: Vec<u64> = std::iter::from_fn(|| m.poll_action(now))
            .map(|a| match a {
                Action::Write { wr_id, .. } => wr_id,
                other => panic!("{other:?}"),
            })
            .collect();
        // The first and the last completed (unconfirmed), the middle one did not.
        m.handle_write_completed(ids[0]);
        m.handle_write_completed(ids[2]);
        m.handle_disconnected();
        m.handle_connected(RemoteLayout {
            blocks: 4,
            block_size: 64,
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
        let ids: Vec<_> = std::iter::from_fn(|| m.poll_action(now)).collect();
        assert_eq!(ids.len(), 3);
        let Action::Write { wr_id: first, .. } = ids[0] else {
            panic!()
        };
        m.handle_write_completed(first);
        m.handle_disconnected();
        assert_eq!(m.poll_action(now), None);
        m.handle_connected(RemoteLayout {
            blocks: 4,
            block_size: 64,
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
}
