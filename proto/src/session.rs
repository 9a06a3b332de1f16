//! The receiver's state for one sender, as a state machine: the sender's session, its devices'
//! reorder streams, frames held back until their device's format arrives, and which devices
//! ended. The engine keeps one per sender name (behind a lock shared by that sender's polling
//! thread and the accept loop); the simulator drives the same machine.
//!
//! Rules it enforces:
//! - A connection with a new session id is a new sender process: every stream starts afresh.
//!   The same session reconnecting restarts each stream's reordering (whatever the sender sends
//!   again is taken as it comes; the sink recognises frames it already handed on by index; see
//!   [`DeviceStream::restart`]).
//! - A device's frames that arrive before its first format (the receiver joined mid-stream, or
//!   blocks filled before a reconnect overtook the resent format) are held, at most
//!   [`HELD_BEFORE_FORMAT`], and handed on right after the format. Lossless frames are never
//!   held: their blocks are only freed once handed on, so holding them could stop the sender
//!   from ever sending the format that would release them.
//! - A device is ended when its end of stream is handed on, and streams again when anything
//!   after it is.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use crate::budget::Budget;
use crate::reorder::{DeviceStream, Limits, Packet, ReorderConfig, ReorderStats, StreamEvent};

/// Frames held per device while waiting for its format; beyond that they go on without one.
pub const HELD_BEFORE_FORMAT: usize = 16;

/// What a connection of the sender meant for its streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connected {
    /// A new session (a new sender process): every stream starts afresh.
    NewSession,
    /// The same session reconnected: streams restart their reordering.
    SameSession,
}

/// Events one device's stream released, ready for the sink, in order.
#[derive(Debug)]
pub struct Released {
    pub device: u8,
    pub events: Vec<StreamEvent>,
    /// Packets the device's stream gave up on so far.
    pub gap_packets: u64,
}

/// One sender as the receiver knows it.
pub struct SenderSession {
    session: u64,
    reorder: ReorderConfig,
    limits: Limits,
    streams: BTreeMap<u8, DeviceStream>,
    ended: BTreeSet<u8>,
    before_format: BTreeMap<u8, Vec<StreamEvent>>,
    formats_seen: BTreeSet<u8>,
}

impl SenderSession {
    /// A sender first seen with session id `session`; its streams reorder with `reorder` and
    /// allocate within `limits`.
    pub fn new(session: u64, reorder: ReorderConfig, limits: Limits) -> Self {
        SenderSession {
            session,
            reorder,
            limits,
            streams: BTreeMap::new(),
            ended: BTreeSet::new(),
            before_format: BTreeMap::new(),
            formats_seen: BTreeSet::new(),
        }
    }

    /// The current session id.
    pub fn session(&self) -> u64 {
        self.session
    }

    /// The sender connected with session id `session`; its connection's memory share is
    /// `budget` (reassembly comes out of it from now on).
    pub fn handle_connected(&mut self, session: u64, budget: Arc<Budget>) -> Connected {
        self.handle_lane_connected(session, budget, None)
    }

    /// As [`SenderSession::handle_connected`], for a connection that carries only device
    /// `device` (a sliding-window sender has one per device, connected side by side): in the
    /// same session only that device's stream starts afresh; the others are not disturbed.
    pub fn handle_lane_connected(
        &mut self,
        session: u64,
        budget: Arc<Budget>,
        device: Option<u8>,
    ) -> Connected {
        self.limits.budget = budget.clone();
        if session != self.session {
            self.session = session;
            self.streams.clear();
            self.ended.clear();
            self.before_format.clear();
            self.formats_seen.clear();
            return Connected::NewSession;
        }
        for (d, stream) in self.streams.iter_mut() {
            if device.is_none_or(|lane| lane == *d) {
                stream.set_budget(budget.clone());
                stream.restart();
            }
        }
        Connected::SameSession
    }

    /// The sender's last connection closed: half-reassembled messages give their memory back.
    pub fn handle_disconnected(&mut self) {
        for stream in self.streams.values_mut() {
            stream.release_memory();
        }
    }

    /// One block's packet: what its device's stream released.
    pub fn handle_packet(&mut self, now: Instant, packet: Packet) -> Released {
        let device = packet.header.device;
        let (reorder, limits) = (self.reorder, &self.limits);
        let stream = self
            .streams
            .entry(device)
            .or_insert_with(|| DeviceStream::with_limits(reorder, limits.clone()));
        stream.handle_packet(now, packet);
        let events: Vec<_> = std::iter::from_fn(|| stream.poll_event()).collect();
        let gap_packets = stream.stats().gap_packets;
        Released {
            device,
            events: self.release(device, events),
            gap_packets,
        }
    }

    /// Gives up on missing packets whose reorder timeout passed by `now`: what each device's
    /// stream released (devices with nothing due are left out).
    pub fn handle_timeouts(&mut self, now: Instant) -> Vec<Released> {
        let mut out = Vec::new();
        for (&device, stream) in self.streams.iter_mut() {
            if stream.poll_timeout().is_some_and(|t| t <= now) {
                stream.handle_timeout(now);
                let events: Vec<_> = std::iter::from_fn(|| stream.poll_event()).collect();
                out.push((device, events, stream.stats().gap_packets));
            }
        }
        out.into_iter()
            .map(|(device, events, gap_packets)| Released {
                device,
                events: self.release(device, events),
                gap_packets,
            })
            .collect()
    }

    /// The earliest reorder timeout of any device.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.streams.values().filter_map(|s| s.poll_timeout()).min()
    }

    /// Whether every device seen has ended.
    pub fn all_ended(&self) -> bool {
        self.streams.keys().all(|d| self.ended.contains(d))
    }

    /// Bytes `device`'s stream holds in half-reassembled messages.
    pub fn assembly_bytes(&self, device: u8) -> usize {
        self.streams
            .get(&device)
            .map_or(0, DeviceStream::assembly_bytes)
    }

    /// Every device's reorder counters.
    pub fn stats(&self) -> impl Iterator<Item = (u8, ReorderStats)> + '_ {
        self.streams.iter().map(|(d, s)| (*d, s.stats()))
    }

    /// Every path that takes events from a device stream goes through here: frames are held
    /// back until the device's format, and the device is marked ended when its end of stream
    /// is among them (or not ended when it carries on).
    fn release(&mut self, device: u8, events: Vec<StreamEvent>) -> Vec<StreamEvent> {
        let events = self.order_after_format(device, events);
        if events
            .iter()
            .any(|e| matches!(e, StreamEvent::EndOfStream { .. }))
        {
            self.ended.insert(device);
        } else if !events.is_empty() {
            self.ended.remove(&device);
        }
        events
    }

    fn order_after_format(&mut self, device: u8, events: Vec<StreamEvent>) -> Vec<StreamEvent> {
        let mut out = Vec::with_capacity(events.len());
        for ev in events {
            if self.formats_seen.contains(&device) {
                out.push(ev);
                continue;
            }
            match ev {
                StreamEvent::Frame(ref f) if f.reliable => {
                    out.extend(self.before_format.remove(&device).unwrap_or_default());
                    out.push(ev);
                }
                StreamEvent::Frame(_) => {
                    let held = self.before_format.entry(device).or_default();
                    held.push(ev);
                    if held.len() >= HELD_BEFORE_FORMAT {
                        // No format is coming: stop waiting.
                        self.formats_seen.insert(device);
                        out.append(held);
                    }
                }
                StreamEvent::Format { .. } => {
                    self.formats_seen.insert(device);
                    out.push(ev);
                    out.extend(self.before_format.remove(&device).unwrap_or_default());
                }
                StreamEvent::EndOfStream { .. } => {
                    out.extend(self.before_format.remove(&device).unwrap_or_default());
                    out.push(ev);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packetizer::{DeviceNumbering, MessageKind, MessageTimes};
    use bytes::Bytes;
    use std::time::Duration;

    fn packets(n: &mut DeviceNumbering, kind: MessageKind, index: u64, body: &[u8]) -> Packet {
        let h = n
            .plan(7, kind, Some(index), body.len(), 4096, MessageTimes::at(1))
            .unwrap()[0];
        Packet {
            header: h,
            payload: Bytes::copy_from_slice(body),
            ack: None,
        }
    }

    fn kinds(r: &Released) -> Vec<&'static str> {
        r.events
            .iter()
            .map(|e| match e {
                StreamEvent::Frame(_) => "frame",
                StreamEvent::Format { .. } => "format",
                StreamEvent::EndOfStream { .. } => "end",
            })
            .collect()
    }

    #[test]
    fn frames_wait_for_their_format() {
        let now = Instant::now();
        let mut s = SenderSession::new(1, ReorderConfig::default(), Limits::default());
        let mut late = DeviceNumbering::starting_at(1, 0);
        // Packet 0 (the format) is overtaken by packet 1 (a frame): the frame is held by the
        // reorder stream anyway; here the format comes with a later number, as after a
        // reconnect where frames filled before it are delivered first.
        let f0 = packets(&mut late, MessageKind::Frame, 0, b"x");
        let r = s.handle_packet(now, f0);
        assert!(r.events.is_empty(), "held until the format");
        let fmt = packets(&mut late, MessageKind::Format, 1, b"caps");
        let r = s.handle_packet(now, fmt);
        assert_eq!(kinds(&r), ["format", "frame"]);
        assert!(!s.all_ended());
        let end = packets(&mut late, MessageKind::EndOfStream, 1, b"");
        let r = s.handle_packet(now, end);
        assert_eq!(kinds(&r), ["end"]);
        assert!(s.all_ended());
    }

    #[test]
    fn a_new_session_starts_afresh_and_the_same_one_restarts_reordering() {
        let now = Instant::now();
        let mut s = SenderSession::new(1, ReorderConfig::default(), Limits::default());
        let mut n = DeviceNumbering::starting_at(0, 0);
        s.handle_packet(now, packets(&mut n, MessageKind::Format, 0, b"caps"));
        s.handle_packet(now, packets(&mut n, MessageKind::Frame, 0, b"a"));
        // The same session: what the sender sends after the reconnect starts the stream.
        assert_eq!(
            s.handle_connected(1, Budget::unlimited()),
            Connected::SameSession
        );
        let mut again = DeviceNumbering::starting_at(1, 0);
        let mut resent = packets(&mut again, MessageKind::Frame, 0, b"a");
        resent.header.flags |= crate::header::flags::STREAM_START;
        let r = s.handle_packet(now, resent);
        assert_eq!(kinds(&r), ["frame"], "format seen already: not held");
        // A new session: the format must come again, numbering starts anew.
        assert_eq!(
            s.handle_connected(2, Budget::unlimited()),
            Connected::NewSession
        );
        assert_eq!(s.session(), 2);
        let mut fresh = DeviceNumbering::starting_at(0, 0);
        let r = s.handle_packet(now, packets(&mut fresh, MessageKind::Frame, 0, b"c"));
        assert!(
            r.events.is_empty(),
            "held: the new session sent no format yet"
        );
    }

    #[test]
    fn a_missing_packet_is_given_up_at_its_timeout() {
        let now = Instant::now();
        let cfg = ReorderConfig::default();
        let mut s = SenderSession::new(1, cfg, Limits::default());
        let mut n = DeviceNumbering::starting_at(0, 0);
        s.handle_packet(now, packets(&mut n, MessageKind::Format, 0, b"caps"));
        let _lost = packets(&mut n, MessageKind::Frame, 0, b"a");
        let r = s.handle_packet(now, packets(&mut n, MessageKind::Frame, 1, b"b"));
        assert!(r.events.is_empty(), "waits for packet 1");
        let due = s.poll_timeout().expect("a timeout is set");
        assert!(s.handle_timeouts(due - Duration::from_nanos(1)).is_empty());
        let r = s.handle_timeouts(due);
        assert_eq!(r.len(), 1);
        assert_eq!(kinds(&r[0]), ["frame"]);
        assert_eq!(r[0].gap_packets, 1);
    }
}
