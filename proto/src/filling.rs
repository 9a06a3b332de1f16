//! The filling thread's decisions as a state machine: which devices stream, their numbering,
//! when a device's format is (re)sent, what a device number that comes back does, and whether a
//! lossless message can be kept for resending. It plans messages (block headers); whoever
//! drives it (the engine's filling thread, the simulator) copies the payloads into send blocks.
//!
//! Rules it enforces:
//! - A device's format goes out before its first frame, again whenever it changes, and again
//!   after every connection drop (the receiver may be a new process that never saw it).
//! - A device that ended and comes back carries on numbering, so the receiver does not take its
//!   new packets for duplicates of the old stream's.
//! - A device number added again while its previous stream is still streaming waits until that
//!   stream's end is planned, then carries on its numbering.
//! - A lossless message that needs every send block could never be kept until confirmed; it is
//!   planned as an unconfirmed one and says so ([`Message::downgraded`]).

use std::collections::{BTreeMap, VecDeque};

use crate::header::BlockHeader;
use crate::packetizer::{DeviceNumbering, MessageKind, MessageTimes};

/// What [`FillingMachine::add_device`] did with a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Added {
    /// It streams now: frames and its end can be planned.
    Streaming,
    /// The same number is still streaming: it starts when that stream's end is planned.
    Waiting,
}

/// One message, planned: the headers of its blocks, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub device: u8,
    pub kind: MessageKind,
    /// One header per block; fragment k carries `fragment_range(k, len, block_size)`.
    pub headers: Vec<BlockHeader>,
    /// Kept in its send blocks until the receiver confirms it (a lossless device's message).
    pub reliable: bool,
    /// The device is lossless but the message needs at least as many blocks as the sender has:
    /// it goes out unconfirmed.
    pub downgraded: bool,
}

/// A frame's plan: its device's format first when it must be (re)sent, then the frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FramePlan {
    pub format: Option<Message>,
    /// `None` when the frame needs more than 65535 blocks (it cannot be sent).
    pub frame: Option<Message>,
}

#[derive(Debug)]
struct Streaming {
    reliable: bool,
    numbering: DeviceNumbering,
    format: Option<String>,
    /// Connection drops seen when the format was last sent.
    format_epoch: u64,
}

/// The filling state of one sender: every device's numbering and format.
#[derive(Debug)]
pub struct FillingMachine {
    block_size: usize,
    send_blocks: usize,
    first_packet: u16,
    streaming: BTreeMap<u8, Streaming>,
    ended: BTreeMap<u8, DeviceNumbering>,
    waiting: VecDeque<(u8, bool)>,
    drops: u64,
}

impl FillingMachine {
    /// Plans blocks of `block_size` bytes for a sender with `send_blocks` send blocks; every new
    /// device's first packet number is `first_packet`.
    pub fn new(block_size: usize, send_blocks: usize, first_packet: u16) -> Self {
        FillingMachine {
            block_size,
            send_blocks,
            first_packet,
            streaming: BTreeMap::new(),
            ended: BTreeMap::new(),
            waiting: VecDeque::new(),
            drops: 0,
        }
    }

    /// Adds device `device` (lossless when `reliable`).
    pub fn add_device(&mut self, device: u8, reliable: bool) -> Added {
        if self.streaming.contains_key(&device) {
            self.waiting.push_back((device, reliable));
            return Added::Waiting;
        }
        let numbering = self
            .ended
            .remove(&device)
            .unwrap_or_else(|| DeviceNumbering::starting_at(self.first_packet, 0));
        self.start(device, reliable, numbering);
        Added::Streaming
    }

    fn start(&mut self, device: u8, reliable: bool, mut numbering: DeviceNumbering) {
        numbering.set_reliable(reliable);
        self.streaming.insert(
            device,
            Streaming {
                reliable,
                numbering,
                format: None,
                format_epoch: 0,
            },
        );
    }

    /// Whether `device` streams now.
    pub fn is_streaming(&self, device: u8) -> bool {
        self.streaming.contains_key(&device)
    }

    /// Whether `device` streams and a frame of it in `format` could be planned now without
    /// its format going ahead of it ([`FramePlan::format`] would be `None`): the format was
    /// sent, is unchanged, and no connection dropped since. Changes nothing.
    pub fn frame_alone(&self, device: u8, format: &str) -> bool {
        self.streaming.get(&device).is_some_and(|dev| {
            dev.format.as_deref() == Some(format) && dev.format_epoch == self.drops
        })
    }

    /// Devices streaming now, in number order.
    pub fn streaming(&self) -> impl Iterator<Item = u8> + '_ {
        self.streaming.keys().copied()
    }

    /// Whether nothing streams and nothing waits.
    pub fn is_empty(&self) -> bool {
        self.streaming.is_empty() && self.waiting.is_empty()
    }

    /// The connection dropped: every device's format goes out again before its next frame.
    pub fn handle_disconnected(&mut self) {
        self.drops += 1;
    }

    /// Plans frame `index` of `device` (`len` payload bytes) in format `format`, with the
    /// device's format ahead of it when it must be (re)sent.
    ///
    /// # Panics
    /// If `device` is not streaming ([`Self::is_streaming`]): only a streaming device's queue
    /// is read.
    pub fn frame(
        &mut self,
        device: u8,
        format: &str,
        index: u64,
        len: usize,
        times: MessageTimes,
    ) -> FramePlan {
        let drops = self.drops;
        let dev = self.device(device);
        let resend = dev.format.as_deref() != Some(format) || dev.format_epoch != drops;
        let format_msg = if resend {
            let dev = self.streaming.get_mut(&device).expect("checked above");
            dev.format = Some(format.to_string());
            dev.format_epoch = drops;
            // A format too large to plan is not sent; the frames still go out.
            self.plan(
                device,
                MessageKind::Format,
                index,
                format.len(),
                MessageTimes::at(times.timestamp_ns),
            )
        } else {
            None
        };
        FramePlan {
            format: format_msg,
            frame: self.plan(device, MessageKind::Frame, index, len, times),
        }
    }

    /// The format of `device` planned again, with its text, when a connection dropped since it
    /// was last sent: called before the device's end, so that a receiver that is a new process
    /// learns the format of the frames the sender resent to it (a lossless device's, which go
    /// out again without their format) even when no frame follows. `None` when the format is
    /// current or the device never sent one.
    ///
    /// # Panics
    /// If `device` is not streaming.
    pub fn stale_format(&mut self, device: u8, timestamp_ns: u64) -> Option<(Message, String)> {
        let drops = self.drops;
        let dev = self
            .streaming
            .get_mut(&device)
            .expect("device is streaming");
        if dev.format_epoch == drops {
            return None;
        }
        let format = dev.format.clone()?;
        dev.format_epoch = drops;
        let msg = self.plan(
            device,
            MessageKind::Format,
            self.device(device).numbering.next_frame(),
            format.len(),
            MessageTimes::at(timestamp_ns),
        )?;
        Some((msg, format))
    }

    fn device(&self, device: u8) -> &Streaming {
        self.streaming
            .get(&device)
            .unwrap_or_else(|| panic!("device {device} is not streaming"))
    }

    /// Plans `device`'s end of stream. Returns the message and, when the same number was added
    /// again meanwhile, `Some(reliable)` of the device that streams under it from now on.
    ///
    /// # Panics
    /// If `device` is not streaming.
    pub fn end(&mut self, device: u8, timestamp_ns: u64) -> (Message, Option<bool>) {
        let next = self.device(device).numbering.next_frame();
        let msg = self
            .plan(
                device,
                MessageKind::EndOfStream,
                next,
                0,
                MessageTimes::at(timestamp_ns),
            )
            .expect("an end of stream fits one block");
        let gone = self.streaming.remove(&device).expect("checked above");
        let resumed = match self.waiting.iter().position(|(d, _)| *d == device) {
            Some(k) => {
                let (_, reliable) = self.waiting.remove(k).expect("position is in range");
                self.start(device, reliable, gone.numbering);
                Some(reliable)
            }
            None => {
                self.ended.insert(device, gone.numbering);
                None
            }
        };
        (msg, resumed)
    }

    fn plan(
        &mut self,
        device: u8,
        kind: MessageKind,
        index: u64,
        len: usize,
        times: MessageTimes,
    ) -> Option<Message> {
        let (block_size, send_blocks) = (self.block_size, self.send_blocks);
        let dev = self
            .streaming
            .get_mut(&device)
            .unwrap_or_else(|| panic!("device {device} is not streaming"));
        let headers = dev
            .numbering
            .plan(device, kind, Some(index), len, block_size, times)?;
        // A lossless message is kept whole in the send blocks until the receiver confirms it;
        // one that needs all of them could never be completed.
        let keepable = headers.len() < send_blocks;
        Some(Message {
            device,
            kind,
            headers,
            reliable: dev.reliable && keepable,
            downgraded: dev.reliable && !keepable,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::header::flags;

    const BLOCK: usize = 256;

    fn frame(m: &mut FillingMachine, dev: u8, fmt: &str, index: u64) -> FramePlan {
        m.frame(dev, fmt, index, 10, MessageTimes::at(1))
    }

    #[test]
    fn format_goes_first_then_only_on_change_or_after_a_drop() {
        let mut m = FillingMachine::new(BLOCK, 4, 0);
        assert_eq!(m.add_device(1, false), Added::Streaming);
        let p = frame(&mut m, 1, "a", 0);
        let f = p.format.expect("first frame brings its format");
        assert_eq!(f.kind, MessageKind::Format);
        assert_ne!(f.headers[0].flags & flags::STREAM_START, 0);
        assert_eq!(p.frame.unwrap().headers[0].packet, 1);
        assert!(frame(&mut m, 1, "a", 1).format.is_none());
        assert!(frame(&mut m, 1, "b", 2).format.is_some(), "changed");
        assert!(frame(&mut m, 1, "b", 3).format.is_none());
        m.handle_disconnected();
        assert!(frame(&mut m, 1, "b", 4).format.is_some(), "after a drop");
        assert!(frame(&mut m, 1, "b", 5).format.is_none());
    }

    /// Before a device's end, its format goes out again if a connection dropped since it was
    /// sent (once), and not otherwise.
    #[test]
    fn a_stale_format_goes_out_before_the_end_after_a_drop() {
        let mut m = FillingMachine::new(BLOCK, 4, 0);
        m.add_device(1, true);
        m.handle_disconnected();
        assert!(m.stale_format(1, 0).is_none(), "no format sent yet");
        frame(&mut m, 1, "a", 0);
        assert!(m.stale_format(1, 0).is_none(), "no drop since");
        m.handle_disconnected();
        let (msg, text) = m.stale_format(1, 7).expect("stale after a drop");
        assert_eq!((msg.kind, text.as_str()), (MessageKind::Format, "a"));
        assert!(
            msg.reliable,
            "a lossless device's format is kept until confirmed"
        );
        assert!(m.stale_format(1, 8).is_none(), "sent once");
        assert!(m.frame_alone(1, "a"), "the next frame needs no format");
        let (end, _) = m.end(1, 9);
        assert_eq!(end.headers[0].packet, msg.headers[0].packet.wrapping_add(1));
    }

    /// `frame_alone` says beforehand, without changing anything, what `frame` will plan.
    #[test]
    fn frame_alone_predicts_a_plan_without_a_format() {
        let mut m = FillingMachine::new(BLOCK, 4, 0);
        assert!(!m.frame_alone(1, "a"), "not streaming");
        m.add_device(1, false);
        let steps: [(&str, bool); 6] = [
            ("a", false),
            ("a", false),
            ("b", false),
            ("b", true),
            ("b", false),
            ("b", false),
        ];
        for (index, (fmt, drop_first)) in steps.into_iter().enumerate() {
            if drop_first {
                m.handle_disconnected();
            }
            let alone = m.frame_alone(1, fmt);
            assert_eq!(m.frame_alone(1, fmt), alone, "asking changes nothing");
            let p = frame(&mut m, 1, fmt, index as u64);
            assert_eq!(alone, p.format.is_none(), "step {index}");
        }
        assert!(m.frame_alone(1, "b"));
        assert!(!m.frame_alone(2, "b"), "another device");
        m.end(1, 9);
        assert!(!m.frame_alone(1, "b"), "ended");
    }

    #[test]
    fn a_returning_device_carries_on_numbering() {
        let mut m = FillingMachine::new(BLOCK, 4, 0);
        m.add_device(2, false);
        frame(&mut m, 2, "a", 0);
        let (end, resumed) = m.end(2, 5);
        assert_eq!(end.kind, MessageKind::EndOfStream);
        assert_eq!(end.headers[0].packet, 2);
        assert_eq!(resumed, None);
        assert!(!m.is_streaming(2));
        assert_eq!(m.add_device(2, false), Added::Streaming);
        let p = frame(&mut m, 2, "a", 0);
        assert_eq!(
            p.format.unwrap().headers[0].packet,
            3,
            "numbering carries on"
        );
    }

    #[test]
    fn a_number_added_while_streaming_waits_for_the_end() {
        let mut m = FillingMachine::new(BLOCK, 4, 0);
        m.add_device(3, false);
        frame(&mut m, 3, "a", 0);
        assert_eq!(m.add_device(3, true), Added::Waiting);
        let (end, resumed) = m.end(3, 0);
        assert!(!end.reliable);
        assert_eq!(resumed, Some(true));
        assert!(m.is_streaming(3));
        let p = frame(&mut m, 3, "a", 0);
        let f = p.format.expect("the new stream sends its format");
        assert_eq!(f.headers[0].packet, 3);
        assert!(f.reliable);
    }

    #[test]
    fn a_lossless_message_needing_every_send_block_is_downgraded() {
        let cap = crate::header::payload_capacity(BLOCK);
        let mut m = FillingMachine::new(BLOCK, 3, 0);
        m.add_device(1, true);
        let small = m.frame(1, "a", 0, cap * 2, MessageTimes::at(0));
        let small = small.frame.unwrap();
        assert!(small.reliable && !small.downgraded);
        let big = m.frame(1, "a", 1, cap * 3, MessageTimes::at(0));
        let big = big.frame.unwrap();
        assert!(!big.reliable && big.downgraded);
        let huge = m.frame(1, "a", 2, cap * 70_000, MessageTimes::at(0));
        assert_eq!(huge.frame, None, "more than 65535 blocks");
    }
}
