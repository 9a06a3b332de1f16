//! `rdmasrc`'s implementation: properties, the PushSrc virtual methods (start, create, stop),
//! timestamping, caps from the stream's format, bus messages (refusals, conflicts, a vanished
//! sender, timeouts, QoS, stats) and the URI handler.

use std::str::FromStr;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::prelude::*;
use gst_base::subclass::base_src::CreateSuccess;
use gst_base::subclass::prelude::*;

use rdmastream::proto::Frame;
use rdmastream::proto::{Budget, Limits};
use rdmastream::transport::{AccessControl, Keys, RegionSettings};

use super::TimestampMode;
use crate::props;
use crate::route::{Item, ListenKey, Popped, Route, RouteLease, RouteRequest, SenderTable};
use crate::transport::{DropPolicyProperty, Transport, VerbsSettings, join_host_port};

static CAT: LazyLock<gst::DebugCategory> = LazyLock::new(|| {
    gst::DebugCategory::new(
        "rdmasrc",
        gst::DebugColorFlags::empty(),
        Some("RDMA (status-byte) source"),
    )
});

const DEFAULT_ADDRESS: &str = "127.0.0.1";
const DEFAULT_PORT: u32 = 7471;
const DEFAULT_DEVICE_ID: u32 = 0;
const DEFAULT_BLOCKS: u32 = 16;
const DEFAULT_BLOCK_SIZE: u32 = 1 << 20;
const DEFAULT_TIMESTAMP_MODE: TimestampMode = TimestampMode::Sender;
const DEFAULT_LATENCY_MS: u32 = 0;
const DEFAULT_MAX_BUFFERS: u32 = 8;
const DEFAULT_DROP_POLICY: DropPolicyProperty = DropPolicyProperty::Block;
const DEFAULT_WAIT_FOR_SENDER: bool = true;
/// Frames held at most while no caps have come (see `Started::held`, `RdmaSrc::frame_buffer`): more than a lossless
/// `rdmasink` keeps unconfirmed (4) and than a sender binary's default send blocks hold. Each is
/// a copy from the memory budget or one of the receiver's retained blocks (at most half of
/// them are retained before frames are copied), so holding them cannot starve the region.
const FRAMES_HELD_FOR_CAPS: usize = 16;
/// `timeout`: 0 (never), as udpsrc.
const DEFAULT_TIMEOUT_NS: u64 = 0;
const DEFAULT_MAX_SENDERS: u32 = 16;
const DEFAULT_MEMORY_BUDGET: u64 = 1 << 30;
const DEFAULT_MAX_FRAME_BYTES: u64 = 16 << 20;
/// `poll-spin`, µs: the receiver's default (`ReceiverOptions::poll_spin`, the receiver binary's
/// `poll_spin_us`).
const DEFAULT_POLL_SPIN_US: u32 = 50;
/// `poll-max`, µs: the receiver's default longest sleep between status scans
/// (`ReceiverOptions::poll_max`, `poll_max_us`).
const DEFAULT_POLL_MAX_US: u32 = 500;

/// How often a waiting `create` looks at whether its sender is still connected.
const IDLE_CHECK: Duration = Duration::from_millis(50);
/// In `sender` mode, a buffer whose shifted PTS is behind its arrival by more than this starts a
/// new mapping, forward (the sender was away or stalled): marked DISCONT. A buffer ahead of its
/// arrival (a backlog) keeps the mapping.
const RESYNC_THRESHOLD: gst::ClockTime = gst::ClockTime::from_seconds(1);

#[derive(Debug, Clone)]
struct Settings {
    address: String,
    port: u32,
    transport: Transport,
    device_id: u32,
    sender_name: Option<String>,
    blocks: u32,
    block_size: u32,
    rdma_device: Option<String>,
    ib_port: u32,
    gid_index: i32,
    key: Option<String>,
    key_file: Option<String>,
    allow_anonymous: bool,
    max_senders: u32,
    memory_budget: u64,
    max_frame_bytes: u64,
    timestamp_mode: TimestampMode,
    latency_ms: u32,
    max_buffers: u32,
    drop_policy: DropPolicyProperty,
    wait_for_sender: bool,
    timeout_ns: u64,
    stats_interval_ms: u32,
    poll_spin_us: u32,
    poll_max_us: u32,
    /// `metrics`: address:port whose /metrics lists this element.
    metrics: Option<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            address: DEFAULT_ADDRESS.into(),
            port: DEFAULT_PORT,
            transport: props::DEFAULT_TRANSPORT,
            device_id: DEFAULT_DEVICE_ID,
            sender_name: None,
            blocks: DEFAULT_BLOCKS,
            block_size: DEFAULT_BLOCK_SIZE,
            rdma_device: None,
            ib_port: props::DEFAULT_IB_PORT,
            gid_index: props::DEFAULT_GID_INDEX,
            key: None,
            key_file: None,
            allow_anonymous: false,
            max_senders: DEFAULT_MAX_SENDERS,
            memory_budget: DEFAULT_MEMORY_BUDGET,
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            timestamp_mode: DEFAULT_TIMESTAMP_MODE,
            latency_ms: DEFAULT_LATENCY_MS,
            max_buffers: DEFAULT_MAX_BUFFERS,
            drop_policy: DEFAULT_DROP_POLICY,
            wait_for_sender: DEFAULT_WAIT_FOR_SENDER,
            timeout_ns: DEFAULT_TIMEOUT_NS,
            stats_interval_ms: crate::report::DEFAULT_STATS_INTERVAL_MS,
            poll_spin_us: DEFAULT_POLL_SPIN_US,
            poll_max_us: DEFAULT_POLL_MAX_US,
            metrics: None,
        }
    }
}

struct Started {
    /// Listed on the `metrics` address while started.
    _metrics: Option<crate::metrics::Listed>,
    lease: RouteLease,
    route: Arc<Route>,
    senders: Arc<SenderTable>,
    timestamp_mode: TimestampMode,
    wait_for_sender: bool,
    caps: Option<gst::Caps>,
    /// From the caps' framerate, else the last buffer's duration.
    frame_duration: Option<gst::ClockTime>,
    /// `sender` mode: added to the sender's timestamp (ns, signed).
    offset: Option<i128>,
    /// The last PTS pushed (ns): timestamps never go back.
    last_pts: Option<u64>,
    next_index: Option<u64>,
    frames: u64,
    bytes: u64,
    frames_before_caps: u64,
    /// Frames that came before any caps, held until the caps come (at most
    /// [`FRAMES_HELD_FOR_CAPS`]): a lossless sender resends its unconfirmed frames to a restarted
    /// receiver before it resends the format.
    held: std::collections::VecDeque<Frame>,
    /// Idle checks in a row that found the sender gone, and whether that was reported.
    gone_checks: u32,
    gone_reported: bool,
    /// The newest refusal of the listener this element already warned about.
    refusals_seen: u64,
    /// `timeout` (0: off), and when the last item (frame, caps, end) or timeout message was.
    timeout: Duration,
    last_activity: std::time::Instant,
    reporter: crate::report::Reporter,
}

#[derive(Default)]
enum State {
    #[default]
    Stopped,
    Started(Box<Started>),
}

#[derive(Default)]
pub struct RdmaSrc {
    settings: Mutex<Settings>,
    state: Mutex<State>,
    /// The acknowledgement of the frame last handed downstream (a lossless sender's: see
    /// [`RdmaSrc::settle_handed`]).
    handed: Mutex<Option<rdmastream::proto::ack::Ack>>,
}

#[glib::object_subclass]
impl ObjectSubclass for RdmaSrc {
    const NAME: &'static str = "GstRdmaSrc";
    type Type = super::RdmaSrc;
    type ParentType = gst_base::PushSrc;
    type Interfaces = (gst::URIHandler,);
}

impl URIHandlerImpl for RdmaSrc {
    const URI_TYPE: gst::URIType = gst::URIType::Src;

    fn protocols() -> &'static [&'static str] {
        crate::uri::SCHEMES
    }

    fn uri(&self) -> Option<String> {
        let s = self.settings.lock().unwrap();
        Some(crate::uri::format(
            &s.address,
            s.port,
            s.device_id,
            s.transport,
        ))
    }

    fn set_uri(&self, uri: &str) -> Result<(), glib::Error> {
        crate::uri::apply(self.obj().upcast_ref(), "address", uri)
    }
}

impl RdmaSrc {
    fn settings(&self) -> Settings {
        self.settings.lock().unwrap().clone()
    }

    /// Sets new caps from a FORMAT message.
    fn handle_format(&self, descriptor: &[u8]) -> Result<(), gst::FlowError> {
        let text = String::from_utf8_lossy(descriptor);
        let text = text.trim();
        let caps = match gst::Caps::from_str(text) {
            Ok(mut c) if !c.is_empty() && !c.is_any() => {
                c.fixate();
                c
            }
            _ => {
                gst::element_imp_warning!(
                    self,
                    gst::StreamError::Format,
                    ("The sender's format is not GStreamer caps; using application/octet-stream"),
                    ["format: {text:?}"]
                );
                gst::Caps::new_empty_simple("application/octet-stream")
            }
        };
        {
            let mut state = self.state.lock().unwrap();
            let State::Started(s) = &mut *state else {
                return Err(gst::FlowError::Flushing);
            };
            if s.caps.as_ref() == Some(&caps) {
                return Ok(());
            }
            s.caps = Some(caps.clone());
            let framerate = caps
                .structure(0)
                .and_then(|st| st.get::<gst::Fraction>("framerate").ok())
                .filter(|f| f.numer() > 0 && f.denom() > 0);
            if let Some(f) = framerate {
                s.frame_duration =
                    gst::ClockTime::SECOND.mul_div_floor(f.denom() as u64, f.numer() as u64);
            }
        }
        gst::info!(CAT, imp = self, "caps {caps}");
        self.obj().set_caps(&caps).map_err(|_| {
            gst::element_imp_error!(
                self,
                gst::CoreError::Negotiation,
                ("Downstream does not accept the sender's caps {caps}")
            );
            gst::FlowError::NotNegotiated
        })?;
        let _ = self
            .obj()
            .post_message(gst::message::Latency::builder().src(&*self.obj()).build());
        Ok(())
    }

    /// The running time now, if the element has a clock.
    fn running_time_now(&self) -> Option<gst::ClockTime> {
        let obj = self.obj();
        let clock = obj.clock()?;
        let base = obj.base_time()?;
        Some(clock.time().saturating_sub(base))
    }

    /// Makes the buffer of a frame; `None` when there are no caps yet: then the frame is held
    /// until they come (at most [`FRAMES_HELD_FOR_CAPS`]; beyond, the oldest is dropped and
    /// counted as `frames-before-caps`, so the caps that follow them always get through).
    ///
    /// A held frame is settled at once: a lossless `rdmasink` sends its caps with the frame
    /// after the ones it resends to a restarted receiver, and it waits for those to be
    /// confirmed before it takes that frame. So the frames a restarted `rdmasrc` holds before
    /// its first caps are the one case where a frame is confirmed before it went downstream;
    /// they are lost only if this process dies too within the round trip that brings the caps.
    fn frame_buffer(&self, mut frame: Frame) -> Result<Option<gst::Buffer>, gst::FlowError> {
        let arrival = self.running_time_now();
        let mut state = self.state.lock().unwrap();
        let State::Started(s) = &mut *state else {
            return Err(gst::FlowError::Flushing);
        };
        if s.caps.is_none() {
            gst::debug!(
                CAT,
                imp = self,
                "frame {} arrived before any caps; held until they come",
                frame.index
            );
            // Taken out and dropped too: the block is freed once its ack is settled and gone.
            rdmastream::proto::ack::settle(&frame.ack.take());
            s.held.push_back(frame);
            if s.held.len() > FRAMES_HELD_FOR_CAPS
                && let Some(old) = s.held.pop_front()
            {
                s.frames_before_caps += 1;
                gst::debug!(
                    CAT,
                    imp = self,
                    "frame {} held before caps dropped: {FRAMES_HELD_FOR_CAPS} newer ones are held",
                    old.index
                );
            }
            return Ok(None);
        }
        let mut discont = s.next_index != Some(frame.index);
        let duration = (frame.duration_ns > 0)
            .then(|| gst::ClockTime::from_nseconds(frame.duration_ns as u64));
        if duration.is_some() && s.frame_duration.is_none() {
            s.frame_duration = duration;
        }
        let pts = match s.timestamp_mode {
            TimestampMode::Arrival => arrival,
            TimestampMode::Sender => {
                // The sender's PTS as its running time; frames of senders without one are
                // spaced by their capture times. Mapped once (the first frame lands at its
                // arrival) and kept, so a backlog keeps its spacing (its frames are ahead of
                // the running time, as they were at the sender); re-mapped only forward: when
                // frames fall behind the running time by more than the threshold (a stall), or
                // when the sender's times go back (a restarted sender).
                let sender_ns = frame.pts_ns.unwrap_or(frame.timestamp_ns) as i128;
                match arrival {
                    Some(arrival) => {
                        let arrival_ns = arrival.nseconds() as i128;
                        let threshold = RESYNC_THRESHOLD.nseconds() as i128;
                        let last = s.last_pts.map(|l| l as i128);
                        let mapped = s.offset.map(|o| sender_ns + o);
                        let remap = match mapped {
                            None => true,
                            Some(m) => arrival_ns - m > threshold || last.is_some_and(|l| m < l),
                        };
                        if remap {
                            if s.offset.is_some() {
                                gst::debug!(CAT, imp = self, "re-mapping sender timestamps");
                            }
                            let start = arrival_ns.max(last.map_or(0, |l| l + 1));
                            s.offset = Some(start - sender_ns);
                            discont = true;
                        }
                        let o = s.offset.expect("set above");
                        let pts = (sender_ns + o).max(0) as u64;
                        s.last_pts = Some(pts);
                        Some(gst::ClockTime::from_nseconds(pts))
                    }
                    None => None,
                }
            }
        };
        s.next_index = Some(frame.index + 1);
        s.frames += 1;
        s.bytes += frame.data.len() as u64;
        drop(state);
        // Wraps the frame's memory without copying: when the core hands over a retained memory
        // block, it goes back to the sender (status 0) when the last reference is dropped.
        let mut buffer = gst::Buffer::from_slice(frame.data);
        {
            let b = buffer.get_mut().expect("new buffer");
            b.set_pts(pts);
            b.set_duration(duration);
            b.set_offset(frame.index);
            b.set_offset_end(frame.index + 1);
            if discont {
                b.set_flags(gst::BufferFlags::DISCONT);
            }
        }
        Ok(Some(buffer))
    }

    /// Posts a warning for each connection the shared listener refused since the last check: a
    /// sender with the wrong token or transport must be visible on the bus, not only in a log.
    /// A warning, not an error: the refused peer does not stop the streams of the others.
    fn report_refusals(&self) {
        let fresh = {
            let mut state = self.state.lock().unwrap();
            let State::Started(s) = &mut *state else {
                return;
            };
            let fresh = s.senders.refusals_after(s.refusals_seen);
            if let Some((n, _)) = fresh.last() {
                s.refusals_seen = *n;
            }
            fresh
        };
        for (_, r) in fresh {
            gst::element_imp_warning!(
                self,
                gst::ResourceError::OpenRead,
                ("Refused a connection from {}", r.peer),
                ["{}", r.why]
            );
        }
    }

    /// After each wait for an item: keeps the time of the last one and posts what is due, under
    /// one look at the state: the `GstRdmaSrcTimeout` element message when nothing arrived for
    /// `timeout` (again after each further `timeout`), QoS for new drops, and the stats.
    fn after_pop(&self, route: &Route, arrived: bool) {
        let (timeout, due) = {
            let mut state = self.state.lock().unwrap();
            let State::Started(s) = &mut *state else {
                return;
            };
            let now = std::time::Instant::now();
            let mut timeout = None;
            if arrived {
                s.last_activity = now;
            } else if !s.timeout.is_zero() && now.duration_since(s.last_activity) >= s.timeout {
                s.last_activity = now;
                timeout = Some(s.timeout.as_nanos() as u64);
            }
            (timeout, s.reporter.check(s.frames, route.queue.dropped()))
        };
        if let Some(timeout) = timeout {
            gst::debug!(CAT, imp = self, "nothing arrived for {timeout} ns");
            let msg = gst::message::Element::builder(
                gst::Structure::builder("GstRdmaSrcTimeout")
                    .field("timeout", timeout)
                    .build(),
            )
            .src(&*self.obj())
            .build();
            let _ = self.obj().post_message(msg);
        }
        crate::report::post(self.obj().upcast_ref(), due, None);
    }

    /// Posts a warning for each sender streaming this element's device-id that is ignored
    /// because another one is followed: its frames would otherwise vanish without a word.
    fn report_conflicts(&self, route: &Route) {
        for (ignored, followed) in route.take_conflicts() {
            let peer = match &*self.state.lock().unwrap() {
                State::Started(s) => s.senders.peer_of(&ignored).unwrap_or_default(),
                State::Stopped => String::new(),
            };
            gst::element_imp_warning!(
                self,
                gst::StreamError::Failed,
                (
                    "Sender '{ignored}' ({peer}) also streams device-id {}; its frames are ignored while sender '{followed}' is followed",
                    route.device
                ),
                ["set sender-name to choose which sender this element receives"]
            );
        }
    }

    /// Called when nothing arrived for a while: is the sender still there?
    fn check_sender(&self) -> Result<(), gst::FlowError> {
        let mut state = self.state.lock().unwrap();
        let State::Started(s) = &mut *state else {
            return Err(gst::FlowError::Flushing);
        };
        let Some(sender) = s.route.current_sender() else {
            return Ok(());
        };
        if s.senders.is_connected(&sender) {
            s.gone_checks = 0;
            s.gone_reported = false;
            return Ok(());
        }
        // The polling thread finishes a closed connection's full blocks first: only a second
        // idle check in a row means nothing more is coming.
        s.gone_checks += 1;
        if s.gone_checks < 2 || s.gone_reported {
            return Ok(());
        }
        s.gone_reported = true;
        let peer = s.senders.peer_of(&sender).unwrap_or_default();
        let wait = s.wait_for_sender;
        drop(state);
        if wait {
            gst::element_imp_warning!(
                self,
                gst::ResourceError::Read,
                ("Sender '{sender}' ({peer}) went away before the end of the stream; waiting for it")
            );
            Ok(())
        } else {
            gst::element_imp_error!(
                self,
                gst::ResourceError::Read,
                ("Sender '{sender}' ({peer}) went away before the end of the stream"),
                ["wait-for-sender=false"]
            );
            Err(gst::FlowError::Error)
        }
    }

    fn latency(&self) -> (gst::ClockTime, Option<gst::ClockTime>) {
        let extra = gst::ClockTime::from_mseconds(self.settings.lock().unwrap().latency_ms as u64);
        let max_buffers = self.settings.lock().unwrap().max_buffers as u64;
        let frame = match &*self.state.lock().unwrap() {
            State::Started(s) => s.frame_duration,
            State::Stopped => None,
        };
        match frame {
            Some(d) => (d + extra, Some(d + extra + d * max_buffers)),
            None => (extra, None),
        }
    }
}

impl ObjectImpl for RdmaSrc {
    fn properties() -> &'static [glib::ParamSpec] {
        static PROPERTIES: LazyLock<Vec<glib::ParamSpec>> = LazyLock::new(|| {
            vec![
                glib::ParamSpecString::builder("address")
                    .nick("Address")
                    .blurb("Address to accept senders on, or unix:/path of a Unix socket for senders on this host (the shm transport; port unused)")
                    .default_value(Some(DEFAULT_ADDRESS))
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("port")
                    .nick("Port")
                    .blurb("Port to accept senders on; 0 picks a free port (read it from stats: local-address)")
                    .maximum(65535)
                    .default_value(DEFAULT_PORT)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("device-id")
                    .nick("Device ID")
                    .blurb("Device number to receive (0-255)")
                    .maximum(255)
                    .default_value(DEFAULT_DEVICE_ID)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecString::builder("sender-name")
                    .nick("Sender name")
                    .blurb("Receive the device from this sender only; NULL: from whichever sender streams it (the first one, until it goes away)")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("blocks")
                    .nick("Memory blocks")
                    .blurb("Receiver memory blocks per connected sender (set by the first source sharing the listener); over tcp give each sender about 4 MiB (blocks x block-size)")
                    .minimum(1)
                    .maximum(65536)
                    .default_value(DEFAULT_BLOCKS)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("block-size")
                    .nick("Block size")
                    .blurb("Bytes per memory block including the 60-byte header and trailer; senders' block-size must not exceed it. (Not the inherited `blocksize`, BaseSrc's read size, which this element does not use: a buffer is one whole frame)")
                    .minimum(rdmastream::proto::OVERHEAD as u32 + 1)
                    .maximum(1 << 30)
                    .default_value(DEFAULT_BLOCK_SIZE)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecString::builder("key")
                    .nick("Key")
                    .blurb("Key every sender must prove it knows (at least 16 bytes; it never crosses the wire). NULL: anonymous, which only a loopback address allows unless allow-anonymous is set")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecString::builder("key-file")
                    .nick("Key file")
                    .blurb("File holding the key (instead of key)")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecBoolean::builder("allow-anonymous")
                    .nick("Allow anonymous")
                    .blurb("Accept senders without a key on a non-loopback address (anyone who can reach it may stream)")
                    .default_value(false)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("max-senders")
                    .nick("Max senders")
                    .blurb("Senders connected at once at most (set by the first source sharing the listener)")
                    .minimum(1)
                    .maximum(4096)
                    .default_value(DEFAULT_MAX_SENDERS)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt64::builder("memory-budget")
                    .nick("Memory budget")
                    .blurb("Bytes of memory for senders at most: each connected sender takes its region (blocks x block-size) plus its reassembly share (the region again plus 2 x max-frame-bytes); set by the first source sharing the listener")
                    .minimum(1 << 20)
                    .default_value(DEFAULT_MEMORY_BUDGET)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt64::builder("max-frame-bytes")
                    .nick("Max frame bytes")
                    .blurb("Largest frame accepted; larger ones are dropped and counted (set by the first source sharing the listener)")
                    .minimum(1)
                    .maximum(u32::MAX as u64)
                    .default_value(DEFAULT_MAX_FRAME_BYTES)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("timestamp-mode", DEFAULT_TIMESTAMP_MODE)
                    .nick("Timestamp mode")
                    .blurb("sender: keep the sender's timestamps (shifted once so the first buffer lands at its arrival); arrival: running time of arrival")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("latency")
                    .nick("Latency")
                    .blurb("Extra latency in ms reported on top of one frame duration (covers transport jitter in timestamp-mode=sender)")
                    .maximum(60_000)
                    .default_value(DEFAULT_LATENCY_MS)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("poll-spin")
                    .nick("Poll spin")
                    .blurb("Microseconds the receiver keeps looking for the next block (yielding the CPU) after one arrived, before it sleeps (20 us, doubling up to poll-max): a lower latency for streams whose frames come close together, paid in CPU; 0 sleeps at once. Not over shm, where the sender's doorbell wakes the receiver. Shared by the elements on one address (the first one's value)")
                    .maximum(100_000)
                    .default_value(DEFAULT_POLL_SPIN_US)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("poll-max")
                    .nick("Poll max")
                    .blurb("Longest sleep in microseconds between two scans of the status bytes when no block arrives (the sleep starts at 20 us, or this if lower, and doubles up to this): the latency a frame of a slow stream can wait to be seen, against the wake-ups of an idle receiver (over shm the sender's doorbell ends the sleep when a frame arrives, so there an idle receiver sleeps at least 10 ms). Shared by the elements on one address (the first one's value)")
                    .minimum(1)
                    .maximum(100_000)
                    .default_value(DEFAULT_POLL_MAX_US)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("max-buffers")
                    .nick("Max buffers")
                    .blurb("Frames queued between the receiver and this element's streaming thread")
                    .minimum(1)
                    .maximum(1024)
                    .default_value(DEFAULT_MAX_BUFFERS)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("drop-policy", DEFAULT_DROP_POLICY)
                    .nick("Drop policy")
                    .blurb("When the queue is full: block (the sender waits; every device of that sender with it) or drop-oldest")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecBoolean::builder("wait-for-sender")
                    .nick("Wait for sender")
                    .blurb("Wait for a sender that went away before ending the stream (posting a warning) instead of posting an error")
                    .default_value(DEFAULT_WAIT_FOR_SENDER)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt64::builder("timeout")
                    .nick("Timeout")
                    .blurb("Post a GstRdmaSrcTimeout element message (field `timeout`, ns) each time nothing arrived for this many ns (0 = never), like udpsrc")
                    .default_value(DEFAULT_TIMEOUT_NS)
                    .mutable_ready()
                    .build(),
            ]
            .into_iter()
            .chain(crate::props::link())
            .chain(crate::props::reporting("frames, bytes, frames-dropped, frames-before-caps, queued, sender, peer, connections, local-address"))
            .collect()
        });
        PROPERTIES.as_ref()
    }

    fn set_property(&self, _id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
        let mut s = self.settings.lock().unwrap();
        match pspec.name() {
            "address" => {
                s.address = value
                    .get::<Option<String>>()
                    .expect("type checked upstream")
                    .unwrap_or_else(|| DEFAULT_ADDRESS.into())
            }
            "port" => s.port = value.get().expect("type checked upstream"),
            "transport" => s.transport = value.get().expect("type checked upstream"),
            "device-id" => s.device_id = value.get().expect("type checked upstream"),
            "sender-name" => s.sender_name = value.get().expect("type checked upstream"),
            "blocks" => s.blocks = value.get().expect("type checked upstream"),
            "block-size" => s.block_size = value.get().expect("type checked upstream"),
            "rdma-device" => s.rdma_device = value.get().expect("type checked upstream"),
            "ib-port" => s.ib_port = value.get().expect("type checked upstream"),
            "gid-index" => s.gid_index = value.get().expect("type checked upstream"),
            "key" => s.key = value.get().expect("type checked upstream"),
            "key-file" => s.key_file = value.get().expect("type checked upstream"),
            "allow-anonymous" => s.allow_anonymous = value.get().expect("type checked upstream"),
            "max-senders" => s.max_senders = value.get().expect("type checked upstream"),
            "memory-budget" => s.memory_budget = value.get().expect("type checked upstream"),
            "max-frame-bytes" => s.max_frame_bytes = value.get().expect("type checked upstream"),
            "timestamp-mode" => s.timestamp_mode = value.get().expect("type checked upstream"),
            "latency" => s.latency_ms = value.get().expect("type checked upstream"),
            "max-buffers" => s.max_buffers = value.get().expect("type checked upstream"),
            "poll-spin" => s.poll_spin_us = value.get().expect("type checked upstream"),
            "poll-max" => s.poll_max_us = value.get().expect("type checked upstream"),
            "drop-policy" => s.drop_policy = value.get().expect("type checked upstream"),
            "wait-for-sender" => s.wait_for_sender = value.get().expect("type checked upstream"),
            "timeout" => s.timeout_ns = value.get().expect("type checked upstream"),
            "stats-interval" => s.stats_interval_ms = value.get().expect("type checked upstream"),
            "metrics" => s.metrics = value.get().expect("type checked upstream"),
            other => unimplemented!("property {other}"),
        }
    }

    fn property(&self, _id: usize, pspec: &glib::ParamSpec) -> glib::Value {
        let s = self.settings.lock().unwrap();
        match pspec.name() {
            "address" => s.address.to_value(),
            "port" => s.port.to_value(),
            "transport" => s.transport.to_value(),
            "device-id" => s.device_id.to_value(),
            "sender-name" => s.sender_name.to_value(),
            "blocks" => s.blocks.to_value(),
            "block-size" => s.block_size.to_value(),
            "rdma-device" => s.rdma_device.to_value(),
            "ib-port" => s.ib_port.to_value(),
            "gid-index" => s.gid_index.to_value(),
            "key" => None::<String>.to_value(),
            "key-file" => s.key_file.to_value(),
            "allow-anonymous" => s.allow_anonymous.to_value(),
            "max-senders" => s.max_senders.to_value(),
            "memory-budget" => s.memory_budget.to_value(),
            "max-frame-bytes" => s.max_frame_bytes.to_value(),
            "timestamp-mode" => s.timestamp_mode.to_value(),
            "latency" => s.latency_ms.to_value(),
            "max-buffers" => s.max_buffers.to_value(),
            "poll-spin" => s.poll_spin_us.to_value(),
            "poll-max" => s.poll_max_us.to_value(),
            "drop-policy" => s.drop_policy.to_value(),
            "wait-for-sender" => s.wait_for_sender.to_value(),
            "timeout" => s.timeout_ns.to_value(),
            "stats-interval" => s.stats_interval_ms.to_value(),
            "metrics" => s.metrics.to_value(),
            "stats" => {
                drop(s);
                let state = self.state.lock().unwrap();
                let mut b = gst::Structure::builder("application/x-rdmasrc-stats");
                if let State::Started(st) = &*state {
                    let sender = st.route.current_sender();
                    let peer = sender.as_deref().and_then(|n| st.senders.peer_of(n));
                    b = b
                        .field("frames", st.frames)
                        .field("bytes", st.bytes)
                        .field("frames-dropped", st.route.queue.dropped())
                        .field("frames-before-caps", st.frames_before_caps)
                        .field("queued", st.route.queue.queued() as u64)
                        .field("sender", sender.unwrap_or_default())
                        .field("peer", peer.unwrap_or_default())
                        .field("connections", st.senders.accepted())
                        .field("local-address", st.lease.local_addr());
                }
                b.build().to_value()
            }
            other => unimplemented!("property {other}"),
        }
    }

    fn constructed(&self) {
        self.parent_constructed();
        let obj = self.obj();
        obj.set_live(true);
        obj.set_format(gst::Format::Time);
    }
}

impl GstObjectImpl for RdmaSrc {}

impl ElementImpl for RdmaSrc {
    fn metadata() -> Option<&'static gst::subclass::ElementMetadata> {
        static ELEMENT_METADATA: LazyLock<gst::subclass::ElementMetadata> = LazyLock::new(|| {
            gst::subclass::ElementMetadata::new(
                "RDMA source",
                "Source/Network",
                "Receives one device of an rdmasink or rdmastream sender over one-sided RDMA \
                 (status-byte-assisted), its TCP emulation, or shared memory on one host; caps \
                 travel with the stream",
                "rdmastream developers",
            )
        });
        Some(&*ELEMENT_METADATA)
    }

    fn pad_templates() -> &'static [gst::PadTemplate] {
        static PAD_TEMPLATES: LazyLock<Vec<gst::PadTemplate>> = LazyLock::new(|| {
            vec![
                gst::PadTemplate::new(
                    "src",
                    gst::PadDirection::Src,
                    gst::PadPresence::Always,
                    &gst::Caps::new_any(),
                )
                .expect("valid template"),
            ]
        });
        PAD_TEMPLATES.as_ref()
    }
}

impl BaseSrcImpl for RdmaSrc {
    fn start(&self) -> Result<(), gst::ErrorMessage> {
        let settings = self.settings();
        // Listed first: an address in use fails the start before anything connects.
        let metrics = match &settings.metrics {
            Some(addr) => Some(crate::metrics::list(addr, self.obj().upcast_ref()).map_err(
                |e| {
                    gst::error_msg!(
                        gst::ResourceError::Settings,
                        ("Cannot serve metrics on {addr}"),
                        ["{e}"]
                    )
                },
            )?),
            None => None,
        };
        if let Some(name) = &settings.sender_name
            && !rdmastream::proto::handshake::valid_sender_name(name)
        {
            return Err(gst::error_msg!(
                gst::ResourceError::Settings,
                ("sender-name {name:?} is not 1-64 characters of A-Z a-z 0-9 . _ -")
            ));
        }
        let addr = join_host_port(&settings.address, settings.port);
        let key =
            crate::transport::element_key(settings.key.as_deref(), settings.key_file.as_deref())
                .map_err(|e| gst::error_msg!(gst::ResourceError::Settings, ("{e}")))?;
        if key.is_none() && !settings.allow_anonymous && !rdmastream_app::cli::is_loopback(&addr) {
            return Err(gst::error_msg!(
                gst::ResourceError::Settings,
                (
                    "address {} is not a loopback address and no key is set, so anyone who can \
                     reach it could stream here: set key-file (make one with `openssl rand -hex \
                     32`) and give the same key to the senders, or set allow-anonymous=true",
                    settings.address
                )
            ));
        }
        let budget = Budget::new(usize::try_from(settings.memory_budget).unwrap_or(usize::MAX));
        let keys = key.map_or_else(Keys::anonymous, Keys::shared);
        let element = self.obj().name().to_string();
        let lease = RouteLease::acquire(RouteRequest {
            key: ListenKey {
                transport: settings.transport,
                addr: addr.clone(),
            },
            region: RegionSettings {
                blocks: settings.blocks as usize,
                block_size: settings.block_size as usize,
                reserved_blocks: Vec::new(),
                access: AccessControl::new(keys, settings.max_senders as usize, budget.clone()),
                reassembly: RegionSettings::reassembly_for(
                    settings.blocks as usize,
                    settings.block_size as usize,
                    settings.max_frame_bytes as usize,
                ),
                peer_timeout: rdmastream::transport::DEFAULT_PEER_TIMEOUT,
                nic_spin: rdmastream::transport::DEFAULT_NIC_SPIN,
                mechanism: Default::default(),
            },
            limits: Limits {
                budget,
                max_message: settings.max_frame_bytes as usize,
            },
            verbs: VerbsSettings {
                device: settings.rdma_device.clone(),
                port: settings.ib_port as u8,
                gid_index: u32::try_from(settings.gid_index).ok(),
            },
            element: &element,
            device: settings.device_id as u8,
            sender: settings.sender_name.clone(),
            max_buffers: settings.max_buffers as usize,
            poll_spin: Duration::from_micros(settings.poll_spin_us.into()),
            poll_max: Duration::from_micros(settings.poll_max_us.into()),
            policy: settings.drop_policy.into(),
        })
        .map_err(|e| {
            gst::error_msg!(
                gst::ResourceError::OpenRead,
                ("Cannot receive on {addr} ({})", settings.transport.nick()),
                ["{e}"]
            )
        })?;
        gst::info!(
            CAT,
            imp = self,
            "receiving device {} on {}",
            settings.device_id,
            lease.local_addr()
        );
        if lease.transport() == "tcp" {
            let (blocks, block_size) = lease.region();
            if let Some(hint) = rdmastream_app::config::tcp_region_hint(blocks, block_size, &|n| {
                format!("blocks={n}")
            }) {
                gst::info!(CAT, imp = self, "{hint}");
            }
        }
        let route = lease.route.clone();
        let senders = lease.senders();
        // Refusals from before this element started were reported by the elements of that time.
        let refusals_seen = senders.last_refusal();
        *self.state.lock().unwrap() = State::Started(Box::new(Started {
            _metrics: metrics,
            lease,
            route,
            senders,
            timestamp_mode: settings.timestamp_mode,
            wait_for_sender: settings.wait_for_sender,
            caps: None,
            frame_duration: None,
            offset: None,
            last_pts: None,
            next_index: None,
            frames: 0,
            bytes: 0,
            frames_before_caps: 0,
            held: Default::default(),
            gone_checks: 0,
            gone_reported: false,
            refusals_seen,
            timeout: Duration::from_nanos(settings.timeout_ns),
            last_activity: std::time::Instant::now(),
            reporter: crate::report::Reporter::new(settings.stats_interval_ms),
        }));
        Ok(())
    }

    fn stop(&self) -> Result<(), gst::ErrorMessage> {
        // Not settled: the base class may have held the last buffer without pushing it (a live
        // source paused after `create`), so a lossless sender sends it again to the next
        // receiver. After EOS it was settled already (by the `create` that found the end).
        self.handed.lock().unwrap().take();
        let state = std::mem::take(&mut *self.state.lock().unwrap());
        if let State::Started(s) = state {
            // Queued frames are dropped here: their retained blocks go back to the sender.
            s.lease.release();
        }
        Ok(())
    }

    fn is_seekable(&self) -> bool {
        false
    }

    fn query(&self, query: &mut gst::QueryRef) -> bool {
        if let gst::QueryViewMut::Latency(q) = query.view_mut() {
            let (min, max) = self.latency();
            gst::debug!(CAT, imp = self, "latency min {min} max {}", max.display());
            q.set(true, min, max);
            return true;
        }
        BaseSrcImplExt::parent_query(self, query)
    }

    fn unlock(&self) -> Result<(), gst::ErrorMessage> {
        if let State::Started(s) = &*self.state.lock().unwrap() {
            s.route.queue.set_flushing(true);
        }
        Ok(())
    }

    fn unlock_stop(&self) -> Result<(), gst::ErrorMessage> {
        if let State::Started(s) = &*self.state.lock().unwrap() {
            s.route.queue.set_flushing(false);
        }
        Ok(())
    }
}

impl RdmaSrc {
    /// The oldest frame held before caps, once there are caps.
    fn take_held(&self) -> Option<Frame> {
        match &mut *self.state.lock().unwrap() {
            State::Started(s) if s.caps.is_some() => s.held.pop_front(),
            _ => None,
        }
    }

    /// `frame` as a buffer to push, remembering its acknowledgement for [`Self::settle_handed`];
    /// None for a frame held until caps come (settled where it is held). A frame that cannot
    /// be handed on (flushing) is not settled: a lossless sender sends it again.
    fn hand_on(&self, frame: Frame) -> Result<Option<gst::Buffer>, gst::FlowError> {
        let ack = frame.ack.clone();
        let buffer = self.frame_buffer(frame)?;
        if buffer.is_some() {
            *self.handed.lock().unwrap() = ack;
        }
        Ok(buffer)
    }

    /// Settles the acknowledgement of the frame last handed downstream. A lossless sender keeps
    /// a frame until then, so it is called once downstream is done with the buffer's push: at
    /// the next `create` (the base class calls it only after a push returned OK: synchronous
    /// elements such as filesink have written the frame by then). A frame that never got that
    /// far (the process was killed, the element stopped first) stays unconfirmed, and the
    /// sender resends it to the next receiver: at most that one frame may arrive twice.
    fn settle_handed(&self) {
        if let Some(ack) = self.handed.lock().unwrap().take() {
            ack.done();
        }
    }
}

impl PushSrcImpl for RdmaSrc {
    fn create(
        &self,
        _buffer: Option<&mut gst::BufferRef>,
    ) -> Result<CreateSuccess, gst::FlowError> {
        self.settle_handed();
        let route = match &*self.state.lock().unwrap() {
            State::Started(s) => s.route.clone(),
            State::Stopped => return Err(gst::FlowError::Flushing),
        };
        loop {
            if let Some(frame) = self.take_held() {
                if let Some(buffer) = self.hand_on(frame)? {
                    return Ok(CreateSuccess::NewBuffer(buffer));
                }
                continue;
            }
            self.report_refusals();
            self.report_conflicts(&route);
            let popped = route.queue.pop(IDLE_CHECK);
            self.after_pop(&route, matches!(popped, Popped::Item(_)));
            match popped {
                Popped::Flushing => return Err(gst::FlowError::Flushing),
                Popped::Timeout => self.check_sender()?,
                Popped::Item(Item::Format(descriptor)) => self.handle_format(&descriptor)?,
                Popped::Item(Item::EndOfStream) => {
                    gst::info!(CAT, imp = self, "the sender ended the stream");
                    return Err(gst::FlowError::Eos);
                }
                Popped::Item(Item::Frame(frame)) => {
                    if let Some(buffer) = self.hand_on(frame)? {
                        return Ok(CreateSuccess::NewBuffer(buffer));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_spin_and_poll_max_default_to_the_receivers() {
        assert_eq!(
            Duration::from_micros(DEFAULT_POLL_SPIN_US.into()),
            rdmastream::engine::ReceiverOptions::default().poll_spin
        );
        assert_eq!(
            Duration::from_micros(DEFAULT_POLL_MAX_US.into()),
            rdmastream::engine::ReceiverOptions::default().poll_max
        );
    }
}
