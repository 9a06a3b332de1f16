//! Per-device reordering by packet number and reassembly of fragments into messages, as an
//! IO-free state machine (one per sender and device on the receiver).
//!
//! Call order: [`DeviceStream::handle_packet`] for every valid block of this device (any
//! order); drain [`DeviceStream::poll_event`]; when [`DeviceStream::poll_timeout`] passes, call
//! [`DeviceStream::handle_timeout`] and drain again.
//!
//! Packet numbers are compared with serial-number arithmetic (RFC 1982 style, 16 bits): a packet
//! less than half the number space ahead of the expected one is ahead, otherwise behind (a
//! duplicate or a packet given up on). Memory is bounded: at most `window` packets are held.
//!
//! Where a stream starts: the first block a device sends carries the STREAM_START flag, and the
//! stream starts at its packet number even if later packets were processed first. A receiver
//! that joins mid-stream (it restarted) sees no such flag; it holds the first packets until the
//! window fills or the timeout passes and starts at the oldest of them.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::ack::Ack;
use super::budget::{Budget, Reservation, Reserved};
use super::header::{BlockHeader, NO_PTS};

/// Reordering limits.
#[derive(Debug, Clone, Copy)]
pub struct ReorderConfig {
    /// Most packets held while waiting for a missing one; a packet further ahead forces the
    /// missing ones to be given up (counted as a gap).
    pub window: u16,
    /// How long a missing packet is waited for while later ones are held.
    pub timeout: Duration,
}

impl Default for ReorderConfig {
    fn default() -> Self {
        ReorderConfig {
            window: 64,
            timeout: Duration::from_millis(200),
        }
    }
}

/// One valid block's header and payload. The payload is either a copy or the receiver memory
/// block itself, kept (retained) until the last clone of it is dropped.
#[derive(Debug, Clone)]
pub struct Packet {
    pub header: BlockHeader,
    pub payload: Bytes,
    /// For the last block of a lossless device's message: settled once the message is durable.
    pub ack: Option<Ack>,
}

/// A complete frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub device: u8,
    pub index: u64,
    pub timestamp_ns: u64,
    pub duration_ns: u32,
    /// Presentation timestamp in ns, if the sender had one.
    pub pts_ns: Option<u64>,
    pub data: Bytes,
    /// The device is lossless: a missing frame index is an error, and `ack` must be settled
    /// once the frame is durably handed on.
    pub reliable: bool,
    pub ack: Option<Ack>,
}

/// What comes out of a device stream, in packet order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    Frame(Frame),
    /// A new format descriptor for the frames that follow (first frame index given).
    Format {
        frame_index: u64,
        descriptor: Vec<u8>,
        ack: Option<Ack>,
    },
    /// The sender ended this device's stream.
    EndOfStream {
        frame_index: u64,
        ack: Option<Ack>,
    },
}

impl StreamEvent {
    /// The event's acknowledgement (lossless devices), to settle once it is handed on.
    pub fn ack(&self) -> &Option<Ack> {
        match self {
            StreamEvent::Frame(f) => &f.ack,
            StreamEvent::Format { ack, .. } | StreamEvent::EndOfStream { ack, .. } => ack,
        }
    }
}

/// Counters of one device stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReorderStats {
    /// Packets given up on (never arrived within window/timeout).
    pub gap_packets: u64,
    /// Packets that arrived behind the expected number (already delivered or given up).
    pub duplicates: u64,
    /// Packets that arrived out of order and were held.
    pub reordered: u64,
    /// Messages dropped because a fragment was missing or inconsistent.
    pub partial_messages: u64,
    /// Messages dropped because they declared more than the largest message accepted.
    pub oversized: u64,
    /// Messages dropped because the receiver's memory budget had no room to reassemble them.
    pub over_budget: u64,
}

/// Where reassembly memory comes from, and how much one message may take.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Shared with everything else the receiver allocates for its peers.
    pub budget: Arc<Budget>,
    /// Largest message (payload bytes over all fragments) accepted; larger ones are dropped
    /// and counted before anything is allocated for them.
    pub max_message: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            budget: Budget::unlimited(),
            max_message: u32::MAX as usize,
        }
    }
}

/// A message being reassembled. Its buffer grows with the fragments that arrive (never with
/// what a header declares) and every byte of its capacity is reserved from the budget.
struct Assembly {
    first: BlockHeader,
    next_fragment: u16,
    data: Vec<u8>,
    reservation: Reservation,
}

/// Reorder buffer and reassembler of one device.
pub struct DeviceStream {
    cfg: ReorderConfig,
    limits: Limits,
    /// Packet number of `slots[0]`; `None` until the first packet.
    expected: Option<u16>,
    /// `slots[k]` holds packet `expected + k` if it arrived.
    slots: VecDeque<Option<Packet>>,
    /// Before the start is known: packets held, and since when.
    settling: Vec<Packet>,
    settling_since: Option<Instant>,
    /// Since when the head of the buffer is missing while later packets wait.
    stalled_since: Option<Instant>,
    assembly: Option<Assembly>,
    /// A message was already counted as lost: skip its remaining fragments silently.
    discarding: bool,
    events: VecDeque<StreamEvent>,
    stats: ReorderStats,
}

impl DeviceStream {
    /// A stream that starts at whatever packet arrives first, without memory limits.
    pub fn new(cfg: ReorderConfig) -> Self {
        Self::with_limits(cfg, Limits::default())
    }

    /// A stream whose reassembly takes memory from `limits.budget`.
    pub fn with_limits(cfg: ReorderConfig, limits: Limits) -> Self {
        DeviceStream {
            cfg: ReorderConfig {
                window: cfg.window.clamp(1, 32768),
                ..cfg
            },
            limits,
            expected: None,
            slots: VecDeque::new(),
            settling: Vec::new(),
            settling_since: None,
            stalled_since: None,
            assembly: None,
            discarding: false,
            events: VecDeque::new(),
            stats: ReorderStats::default(),
        }
    }

    /// Feeds one packet of this device.
    pub fn handle_packet(&mut self, now: Instant, packet: Packet) {
        if self.expected.is_none() {
            if packet.header.is_stream_start() {
                self.start_at(now, packet.header.packet);
            } else {
                self.settling.push(packet);
                self.settling_since.get_or_insert(now);
                if self.settling.len() >= self.cfg.window as usize {
                    self.start_at_oldest(now);
                }
                return;
            }
        }
        self.insert(now, packet);
    }

    /// Starts the stream at `number` and replays what was held.
    fn start_at(&mut self, now: Instant, number: u16) {
        self.expected = Some(number);
        self.settling_since = None;
        for p in std::mem::take(&mut self.settling) {
            self.insert(now, p);
        }
    }

    /// Starts at the oldest held packet (serial-number order).
    fn start_at_oldest(&mut self, now: Instant) {
        let numbers: Vec<u16> = self.settling.iter().map(|p| p.header.packet).collect();
        let oldest = numbers
            .iter()
            .copied()
            .find(|&c| numbers.iter().all(|&o| o.wrapping_sub(c) < 0x8000))
            .unwrap_or(numbers[0]);
        self.start_at(now, oldest);
    }

    fn insert(&mut self, now: Instant, packet: Packet) {
        let number = packet.header.packet;
        let expected = self.expected.expect("started");
        let ahead = number.wrapping_sub(expected);
        if ahead >= 0x8000 {
            self.stats.duplicates += 1;
            return;
        }
        let window = self.cfg.window as usize;
        let mut ahead = ahead as usize;
        if ahead >= window {
            // Too far ahead: give up on the oldest missing packets to make room.
            let skip = ahead + 1 - window;
            for _ in 0..skip {
                self.advance_head();
            }
            ahead -= skip;
        }
        if self.slots.len() <= ahead {
            self.slots.resize_with(ahead + 1, || None);
        }
        if self.slots[ahead].is_some() {
            self.stats.duplicates += 1;
            return;
        }
        if ahead > 0 {
            self.stats.reordered += 1;
        }
        self.slots[ahead] = Some(packet);
        self.drain_in_order();
        self.update_stall(now);
    }

    /// Gives up on missing packets that were waited for longer than the timeout.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self
            .settling_since
            .is_some_and(|t| now.saturating_duration_since(t) >= self.cfg.timeout)
        {
            self.start_at_oldest(now);
        }
        if let Some(since) = self.stalled_since
            && now.saturating_duration_since(since) >= self.cfg.timeout
        {
            while matches!(self.slots.front(), Some(None)) {
                self.advance_head();
            }
            self.drain_in_order();
            self.stalled_since = None;
            self.update_stall(now);
        }
    }

    /// When [`Self::handle_timeout`] should next be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let settle = self.settling_since.map(|t| t + self.cfg.timeout);
        let stall = self.stalled_since.map(|t| t + self.cfg.timeout);
        settle.into_iter().chain(stall).min()
    }

    /// Next event in order.
    pub fn poll_event(&mut self) -> Option<StreamEvent> {
        self.events.pop_front()
    }

    /// Counters.
    pub fn stats(&self) -> ReorderStats {
        self.stats
    }

    /// Packets currently held waiting for a missing one.
    pub fn held(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count() + self.settling.len()
    }

    /// The packet number expected next, once known.
    pub fn expected(&self) -> Option<u16> {
        self.expected
    }

    /// From now on, reassembly takes memory from `budget` (a new connection's share).
    pub fn set_budget(&mut self, budget: Arc<Budget>) {
        self.limits.budget = budget;
    }

    /// Bytes of the message being reassembled (what this stream holds besides its packets).
    pub fn assembly_bytes(&self) -> usize {
        self.assembly.as_ref().map_or(0, |a| a.reservation.bytes())
    }

    /// A new connection of the same sender: it sends again, from the first block of the oldest
    /// message the receiver did not confirm, what the old connection may have lost. Starts the
    /// stream afresh at what comes (as a receiver that joins mid-stream does); whatever was held
    /// is given up (counted as partial) and its memory given back — held packets keep memory of
    /// the old connection's share, which the new one needs — and frames that arrive twice are
    /// recognised by their frame index downstream. A lossless device loses nothing by this: its
    /// held packets' blocks were not freed, so the sender sends them again.
    pub fn restart(&mut self) {
        self.release_memory();
        self.expected = None;
        self.slots.clear();
        self.settling.clear();
        self.settling_since = None;
        self.stalled_since = None;
        self.discarding = false;
    }

    /// The sender is gone: frees a half-reassembled message (counted as partial) and the held
    /// packets' memory. Numbering is kept, so a resent packet is still known as a duplicate.
    pub fn release_memory(&mut self) {
        if self.assembly.take().is_some() {
            self.stats.partial_messages += 1;
            self.discarding = true;
        }
    }

    fn update_stall(&mut self, now: Instant) {
        if self.slots.is_empty() {
            self.stalled_since = None;
        } else if self.stalled_since.is_none() {
            self.stalled_since = Some(now);
        }
    }

    /// Moves past the head slot, delivering it if present or counting it as a gap.
    fn advance_head(&mut self) {
        let head = self.slots.pop_front().flatten();
        self.expected = self.expected.map(|e| e.wrapping_add(1));
        match head {
            Some(p) => self.assemble(p),
            None => {
                self.stats.gap_packets += 1;
                self.lose_message();
            }
        }
    }

    fn drain_in_order(&mut self) {
        while matches!(self.slots.front(), Some(Some(_))) {
            self.advance_head();
        }
        if self.slots.is_empty() {
            self.stalled_since = None;
        }
    }

    fn assemble(&mut self, p: Packet) {
        let h = p.header;
        if h.fragment_index == 0 {
            if self.assembly.take().is_some() {
                self.stats.partial_messages += 1;
            }
            self.discarding = false;
            if h.message_len as usize > self.limits.max_message {
                self.stats.oversized += 1;
                self.discarding = true;
                return;
            }
            if h.fragment_count == 1 {
                if p.payload.len() == h.message_len as usize {
                    self.emit(h, p.payload, p.ack);
                } else {
                    self.stats.partial_messages += 1;
                }
                return;
            }
            let mut a = Assembly {
                first: h,
                next_fragment: 1,
                data: Vec::new(),
                reservation: Reservation::empty(&self.limits.budget),
            };
            if !self.append(&mut a, &p.payload) {
                return;
            }
            self.assembly = Some(a);
            return;
        }
        let Some(mut a) = self.assembly.take() else {
            self.lose_message();
            return;
        };
        let consistent = a.next_fragment == h.fragment_index
            && a.first.fragment_count == h.fragment_count
            && a.first.frame_index == h.frame_index
            && (a.first.flags ^ h.flags)
                & !(crate::header::flags::STREAM_START | crate::header::flags::HEADER_SEAL)
                == 0
            && a.first.message_len == h.message_len
            && a.data.len() + p.payload.len() <= h.message_len as usize;
        if !consistent {
            self.assembly = Some(a);
            self.lose_message();
            return;
        }
        if !self.append(&mut a, &p.payload) {
            return;
        }
        a.next_fragment += 1;
        if a.next_fragment == a.first.fragment_count {
            if a.data.len() == a.first.message_len as usize {
                let data = Bytes::from_owner(Reserved::new(a.data, a.reservation));
                self.emit(a.first, data, p.ack);
            } else {
                self.stats.partial_messages += 1;
            }
        } else {
            self.assembly = Some(a);
        }
    }

    /// Appends a fragment's payload, reserving whatever capacity the buffer grows by. When the
    /// budget has no room the message is dropped (counted) and false returned.
    fn append(&mut self, a: &mut Assembly, payload: &[u8]) -> bool {
        let needed = a.data.len() + payload.len();
        if needed > a.data.capacity() {
            // Grow geometrically (no quadratic copying for many-fragment frames), but never past
            // what the header says the whole message needs.
            let target = (a.data.capacity() * 2)
                .max(needed)
                .min(a.first.message_len as usize);
            let more = target - a.data.capacity();
            if !a.reservation.grow(more) {
                self.stats.over_budget += 1;
                self.discarding = true;
                return false;
            }
            a.data.reserve_exact(target - a.data.len());
        }
        a.data.extend_from_slice(payload);
        true
    }

    /// The message in progress (or the one whose first fragment went missing) cannot complete;
    /// count it once and skip the rest of its fragments.
    fn lose_message(&mut self) {
        let had_assembly = self.assembly.take().is_some();
        if had_assembly || !self.discarding {
            self.stats.partial_messages += 1;
        }
        self.discarding = true;
    }

    fn emit(&mut self, h: BlockHeader, data: Bytes, ack: Option<Ack>) {
        let event = if h.is_end_of_stream() {
            StreamEvent::EndOfStream {
                frame_index: h.frame_index,
                ack,
            }
        } else if h.is_format() {
            StreamEvent::Format {
                frame_index: h.frame_index,
                descriptor: data.to_vec(),
                ack,
            }
        } else {
            StreamEvent::Frame(Frame {
                device: h.device,
                index: h.frame_index,
                timestamp_ns: h.timestamp_ns,
                duration_ns: h.duration_ns,
                pts_ns: (h.pts_ns != NO_PTS).then_some(h.pts_ns),
                data,
                reliable: h.is_reliable(),
                ack,
            })
        };
        self.events.push_back(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::Budget;
    use crate::header::OVERHEAD;
    use crate::packetizer::{DeviceNumbering, MessageKind, MessageTimes, fragment_range};

    fn packets(n: &mut DeviceNumbering, frames: usize, len: usize, block: usize) -> Vec<Packet> {
        let mut out = Vec::new();
        for f in 0..frames {
            let data: Vec<u8> = (0..len).map(|i| (i + f) as u8).collect();
            let hs = n
                .plan(
                    1,
                    MessageKind::Frame,
                    Some(f as u64),
                    len,
                    block,
                    MessageTimes::at(f as u64),
                )
                .unwrap();
            for (k, h) in hs.into_iter().enumerate() {
                let payload = Bytes::copy_from_slice(&data[fragment_range(k, len, block)]);
                out.push(Packet {
                    header: h,
                    payload,
                    ack: None,
                });
            }
        }
        out
    }

    fn frames(s: &mut DeviceStream) -> Vec<u64> {
        std::iter::from_fn(|| s.poll_event())
            .map(|e| match e {
                StreamEvent::Frame(f) => f.index,
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn reorders_and_reassembles_across_wrap() {
        let now = Instant::now();
        let mut n = DeviceNumbering::starting_at(65530, 0);
        let mut ps = packets(&mut n, 6, 100, OVERHEAD + 8);
        // 8 payload bytes per block: 13 fragments per frame.
        assert_eq!(ps[0].header.fragment_count, 13);
        // Swap neighbours pairwise: every packet arrives out of order.
        for pair in ps.chunks_mut(2) {
            pair.reverse();
        }
        let mut s = DeviceStream::new(ReorderConfig::default());
        for p in ps {
            s.handle_packet(now, p);
        }
        assert_eq!(frames(&mut s), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(s.stats().gap_packets, 0);
        assert_eq!(s.held(), 0);
    }

    #[test]
    fn joining_mid_stream_starts_at_the_oldest_after_settling() {
        let now = Instant::now();
        let mut n = DeviceNumbering::starting_at(65533, 0);
        let mut ps = packets(&mut n, 8, 5, OVERHEAD + 12);
        ps.remove(0); // the STREAM_START block was consumed by a receiver that then restarted
        ps.swap(0, 3);
        let cfg = ReorderConfig {
            window: 16,
            timeout: Duration::from_millis(50),
        };
        let mut s = DeviceStream::new(cfg);
        for p in ps {
            s.handle_packet(now, p);
        }
        assert_eq!(
            frames(&mut s),
            Vec::<u64>::new(),
            "nothing before the start is known"
        );
        s.handle_timeout(now + Duration::from_millis(50));
        assert_eq!(frames(&mut s), vec![1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(s.stats().duplicates, 0);
    }

    #[test]
    fn missing_packet_is_given_up_after_timeout_and_counted() {
        let now = Instant::now();
        let mut n = DeviceNumbering::default();
        let ps = packets(&mut n, 4, 5, OVERHEAD + 12);
        let mut s = DeviceStream::new(ReorderConfig {
            window: 8,
            timeout: Duration::from_millis(10),
        });
        for (i, p) in ps.into_iter().enumerate() {
            if i != 1 {
                s.handle_packet(now, p);
            }
        }
        assert_eq!(frames(&mut s), vec![0]);
        let t = s.poll_timeout().unwrap();
        s.handle_timeout(t - Duration::from_millis(1));
        assert_eq!(frames(&mut s), Vec::<u64>::new());
        s.handle_timeout(t);
        assert_eq!(frames(&mut s), vec![2, 3]);
        assert_eq!(s.stats().gap_packets, 1);
    }

    #[test]
    fn window_bounds_memory_and_duplicates_are_dropped() {
        let now = Instant::now();
        let mut n = DeviceNumbering::default();
        let ps = packets(&mut n, 20, 5, OVERHEAD + 12);
        let mut s = DeviceStream::new(ReorderConfig {
            window: 4,
            timeout: Duration::from_secs(60),
        });
        s.handle_packet(now, ps[0].clone());
        for p in &ps[2..] {
            s.handle_packet(now, p.clone());
            assert!(s.held() <= 4);
        }
        assert_eq!(frames(&mut s).len(), 19);
        assert_eq!(s.stats().gap_packets, 1);
        s.handle_packet(now, ps[1].clone());
        s.handle_packet(now, ps[5].clone());
        assert_eq!(s.stats().duplicates, 2);
    }

    #[test]
    fn a_header_declaring_4_gib_reserves_only_what_arrives() {
        // Issue 7, attack 1: one small block whose header claims a 4 GiB message.
        let now = Instant::now();
        let budget = Budget::new(1 << 20);
        let lie = |max_message| {
            let mut s = DeviceStream::with_limits(
                ReorderConfig::default(),
                Limits {
                    budget: budget.clone(),
                    max_message,
                },
            );
            let header = BlockHeader {
                device: 1,
                packet: 0,
                flags: crate::header::flags::STREAM_START,
                fragment_index: 0,
                fragment_count: 2,
                payload_len: 1,
                frame_index: 0,
                timestamp_ns: 0,
                message_len: u32::MAX,
                duration_ns: 0,
                pts_ns: NO_PTS,
            };
            s.handle_packet(
                now,
                Packet {
                    header,
                    payload: Bytes::from_static(b"x"),
                    ack: None,
                },
            );
            s
        };
        let s = lie(64 << 20);
        assert_eq!(s.stats().oversized, 1);
        assert_eq!(budget.used(), 0);
        let mut s = lie(usize::MAX);
        assert_eq!(
            s.assembly_bytes(),
            1,
            "reserved what arrived, not what was declared"
        );
        assert_eq!(budget.used(), 1);
        s.release_memory();
        assert_eq!(budget.used(), 0, "a gone sender's partial message is freed");
        assert_eq!(s.stats().partial_messages, 1);
    }

    #[test]
    fn reassembly_beyond_the_budget_drops_the_message_and_counts_it() {
        let now = Instant::now();
        let budget = Budget::new(250);
        let mut n = DeviceNumbering::default();
        let ps = packets(&mut n, 3, 100, OVERHEAD + 40); // 3 fragments of a 100-byte frame each
        let mut s = DeviceStream::with_limits(
            ReorderConfig::default(),
            Limits {
                budget: budget.clone(),
                max_message: 1000,
            },
        );
        // 90 bytes left: a 100-byte frame cannot be reassembled.
        let hog = budget.try_reserve(160).unwrap();
        for p in ps.iter().take(3).cloned() {
            s.handle_packet(now, p);
        }
        assert_eq!(frames(&mut s), Vec::<u64>::new());
        assert_eq!(s.stats().over_budget, 1);
        drop(hog);
        for p in ps.into_iter().skip(3) {
            s.handle_packet(now, p);
        }
        let got = frames(&mut s);
        assert_eq!(got, vec![1, 2]);
        assert_eq!(
            budget.used(),
            0,
            "delivered frames were dropped by the test"
        );
    }

    #[test]
    fn lost_fragment_drops_only_its_message() {
        let now = Instant::now();
        let mut n = DeviceNumbering::default();
        let ps = packets(&mut n, 3, 20, OVERHEAD + 8); // 3 fragments each
        let mut s = DeviceStream::new(ReorderConfig {
            window: 2,
            timeout: Duration::from_secs(60),
        });
        for (i, p) in ps.into_iter().enumerate() {
            if i != 4 {
                s.handle_packet(now, p);
            }
        }
        assert_eq!(frames(&mut s), vec![0, 2]);
        assert_eq!(s.stats().partial_messages, 1);
    }
}
