//! `rdmasink`'s implementation: properties, the BaseSink virtual methods (start, render, event,
//! stop), link checks that turn the core sender's state into bus messages, and the URI handler.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use gst::glib;
use gst::prelude::*;
use gst::subclass::prelude::*;
use gst_base::prelude::*;
use gst_base::subclass::prelude::*;

use rdmastream::bytes::Bytes;
use rdmastream::engine::SenderOptions;
use rdmastream::engine::{FrameMeta, SourceFrame};
use rdmastream::stats::unix_now_ns;
use rdmastream_app::gst::pool::{BlockLease, BlockPool, LinkCheck, Wait, Warn};

use crate::link::{self, DeviceLease, LeaseRequest, QUEUE_DEPTH, SenderKey};
use crate::props;
use crate::transport::{DropPolicyProperty, Transport, VerbsSettings, join_host_port};

static CAT: LazyLock<gst::DebugCategory> = LazyLock::new(|| {
    gst::DebugCategory::new(
        "rdmasink",
        gst::DebugColorFlags::empty(),
        Some("RDMA (status-byte) sink"),
    )
});

const DEFAULT_HOST: &str = "127.0.0.1";
const DEFAULT_PORT: u32 = 7471;
const DEFAULT_DEVICE_ID: u32 = 0;
const DEFAULT_BLOCKS: u32 = 8;
/// `in-place-blocks`: -1, half of `blocks` (added to them).
const DEFAULT_IN_PLACE_BLOCKS: i32 = -1;
const DEFAULT_BLOCK_SIZE: u32 = 1 << 20;
const DEFAULT_DROP_POLICY: DropPolicyProperty = DropPolicyProperty::Block;
const DEFAULT_RECONNECT: bool = true;
const DEFAULT_LOSSLESS: bool = false;
/// `reconnect-timeout`: 0 (retry for ever).
const DEFAULT_RECONNECT_TIMEOUT_MS: u32 = 0;

/// How long stopping after EOS waits for the last blocks (and end-of-stream) to be written.
const LINGER_AFTER_EOS: Duration = Duration::from_secs(5);
/// How long stopping without EOS waits: the pipeline was interrupted, do not hold it up.
const LINGER_INTERRUPTED: Duration = Duration::from_millis(200);
/// How long READY→PAUSED waits for the first connection with `reconnect=false` (the core's TCP
/// connect and handshake timeouts are 3 s and 5 s).
const FIRST_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long `render` waits for a block to copy a buffer from elsewhere into (`drop-policy=block`)
/// before it leaves the copy to the filling thread.
const COPY_PATIENCE: Duration = Duration::from_millis(2);

#[derive(Debug, Clone)]
struct Settings {
    host: String,
    port: u32,
    transport: Transport,
    device_id: u32,
    blocks: u32,
    in_place_blocks: i32,
    block_size: u32,
    rdma_device: Option<String>,
    ib_port: u32,
    gid_index: i32,
    key: Option<String>,
    key_file: Option<String>,
    sender_name: Option<String>,
    drop_policy: DropPolicyProperty,
    lossless: bool,
    reconnect: bool,
    reconnect_timeout_ms: u32,
    stats_interval_ms: u32,
    /// `metrics`: address:port whose /metrics lists this element.
    metrics: Option<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            host: DEFAULT_HOST.into(),
            port: DEFAULT_PORT,
            transport: props::DEFAULT_TRANSPORT,
            device_id: DEFAULT_DEVICE_ID,
            blocks: DEFAULT_BLOCKS,
            in_place_blocks: DEFAULT_IN_PLACE_BLOCKS,
            block_size: DEFAULT_BLOCK_SIZE,
            rdma_device: None,
            ib_port: props::DEFAULT_IB_PORT,
            gid_index: props::DEFAULT_GID_INDEX,
            key: None,
            key_file: None,
            sender_name: None,
            drop_policy: DEFAULT_DROP_POLICY,
            lossless: DEFAULT_LOSSLESS,
            reconnect: DEFAULT_RECONNECT,
            reconnect_timeout_ms: DEFAULT_RECONNECT_TIMEOUT_MS,
            stats_interval_ms: crate::report::DEFAULT_STATS_INTERVAL_MS,
            metrics: None,
        }
    }
}

struct Started {
    /// Listed on the `metrics` address while started.
    _metrics: Option<crate::metrics::Listed>,
    lease: Arc<DeviceLease>,
    drop_policy: DropPolicyProperty,
    reconnect: bool,
    /// `reconnect-timeout` (zero: for ever), and since when the receiver has been unreachable.
    reconnect_timeout: Duration,
    down_since: Option<Instant>,
    reporter: crate::report::Reporter,
    /// Connections already announced with a `GstRdmaSinkConnected` message.
    connections_seen: u64,
    /// Caps text of the current caps: it travels as the device's format (the core sends it
    /// when it changes and again after every reconnect).
    caps: Option<Arc<str>>,
    next_index: u64,
    /// Link errors seen so far (counting from the element's start), and the text of the one
    /// last warned about while the link is down.
    errors_seen: u64,
    warned: Option<String>,
    eos: bool,
    /// An error was posted: the element does not go on.
    failed: bool,
    /// The pool proposed upstream (made at the first allocation query), whose buffers are
    /// send blocks.
    pool: Option<BlockPool>,
}

/// A frame's capture time (ns since the UNIX epoch), duration (ns) and PTS as running time.
type Times = (u64, u32, Option<u64>);

impl Started {
    /// The next frame's metadata with these times (the caller counts `next_index` on once the
    /// frame is handed over); None before caps.
    fn next_meta(&self, (timestamp_ns, duration_ns, pts_ns): Times) -> Option<FrameMeta> {
        Some(FrameMeta {
            index: self.next_index,
            timestamp_ns,
            duration_ns,
            pts_ns,
            format: self.caps.clone()?,
        })
    }
}

#[derive(Default)]
enum State {
    #[default]
    Stopped,
    Started(Started),
}

#[derive(Default)]
pub struct RdmaSink {
    settings: Mutex<Settings>,
    state: Mutex<State>,
    /// Posts the stats message while no buffer is rendered (idle, or waiting for the link).
    ticker: Mutex<Option<crate::report::Ticker>>,
    /// Set between `unlock` and `unlock_stop`: every wait gives up.
    flushing: AtomicBool,
    /// Frames rendered in place (buffers of our pool), those of them rendered straight into
    /// the receiver's memory (shm), and frames copied (any other buffer), since start; and the
    /// path of the last frame (0 none, then [`Path`]), to log changes.
    in_place: AtomicU64,
    in_receiver: AtomicU64,
    copied: AtomicU64,
    /// Of the copied frames, those `render` copied straight into the receiver's memory (shm).
    copied_to_receiver: AtomicU64,
    /// Copies for which `render` found no block free at once and waited for one.
    copies_waited: AtomicU64,
    last_path: AtomicU8,
}

/// Which way a frame went (see [`RdmaSink::count_path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// Upstream wrote it into one of the sender's send blocks.
    SendBlock = 1,
    /// Upstream wrote it into a block of the receiver's memory (shm).
    Receiver = 3,
    /// Copied from a buffer that is not one of this element's blocks, by the filling thread.
    Copied = 2,
    /// Copied by `render` into a send block it reserved.
    CopiedHere = 4,
    /// Copied by `render` into a block of the receiver's memory (shm).
    CopiedToReceiver = 5,
}

#[glib::object_subclass]
impl ObjectSubclass for RdmaSink {
    const NAME: &'static str = "GstRdmaSink";
    type Type = super::RdmaSink;
    type ParentType = gst_base::BaseSink;
    type Interfaces = (gst::URIHandler,);
}

impl URIHandlerImpl for RdmaSink {
    const URI_TYPE: gst::URIType = gst::URIType::Sink;

    fn protocols() -> &'static [&'static str] {
        crate::uri::SCHEMES
    }

    fn uri(&self) -> Option<String> {
        let s = self.settings.lock().unwrap();
        Some(crate::uri::format(
            &s.host,
            s.port,
            s.device_id,
            s.transport,
        ))
    }

    fn set_uri(&self, uri: &str) -> Result<(), glib::Error> {
        crate::uri::apply(self.obj().upcast_ref(), "host", uri)
    }
}

/// Why the element cannot go on.
enum Stop {
    Flushing,
    Error,
}

impl From<Stop> for gst::FlowError {
    fn from(s: Stop) -> Self {
        match s {
            Stop::Flushing => gst::FlowError::Flushing,
            Stop::Error => gst::FlowError::Error,
        }
    }
}

impl RdmaSink {
    /// Posts an error or warning for link problems the sending thread met since the last call.
    fn check_link(&self) -> Result<(), Stop> {
        let mut state = self.state.lock().unwrap();
        let State::Started(s) = &mut *state else {
            return Err(Stop::Flushing);
        };
        if s.failed {
            // Already reported.
            return Err(Stop::Error);
        }
        let link = s.lease.link();
        let peer = s.lease.peer().to_string();
        if let Some(fatal) = link.fatal {
            s.failed = true;
            drop(state);
            gst::element_imp_error!(
                self,
                gst::ResourceError::OpenWrite,
                ("Cannot stream to receiver {peer}"),
                ["{fatal}"]
            );
            return Err(Stop::Error);
        }
        if let Some(notice) = s.lease.take_notice() {
            // The connection is shared with other devices and stays up; only this element's
            // frames go nowhere.
            s.failed = true;
            drop(state);
            gst::element_imp_error!(
                self,
                gst::ResourceError::Busy,
                ("Receiver {peer} ignores this device-id: another sender streams it there"),
                ["{notice}"]
            );
            return Err(Stop::Error);
        }
        if link.connected {
            s.down_since = None;
        } else if link.errors > s.errors_seen {
            s.down_since.get_or_insert_with(Instant::now);
        }
        if let Some(since) = s.down_since
            && !s.reconnect_timeout.is_zero()
            && since.elapsed() >= s.reconnect_timeout
        {
            s.failed = true;
            let (limit, error) = (s.reconnect_timeout, link.error.clone().unwrap_or_default());
            drop(state);
            gst::element_imp_error!(
                self,
                gst::ResourceError::OpenWrite,
                (
                    "Receiver {peer} unreachable for {:.1} s; giving up",
                    limit.as_secs_f64()
                ),
                ["{error} (reconnect-timeout={} ms)", limit.as_millis()]
            );
            return Err(Stop::Error);
        }
        if link.errors > s.errors_seen {
            s.errors_seen = link.errors;
            let error = link.error.unwrap_or_default();
            if !s.reconnect {
                s.failed = true;
                drop(state);
                gst::element_imp_error!(
                    self,
                    gst::ResourceError::Write,
                    ("Connection to receiver {peer} failed"),
                    ["{error} (reconnect=false)"]
                );
                return Err(Stop::Error);
            }
            // One warning message per outage, and again only when the reason changes (the
            // sending thread retries every 100 ms to 5 s).
            if s.warned.as_deref() != Some(error.as_str()) {
                s.warned = Some(error.clone());
                drop(state);
                gst::element_imp_warning!(
                    self,
                    gst::ResourceError::Write,
                    ("Connection to receiver {peer} failed; reconnecting"),
                    ["{error}"]
                );
            }
            return Ok(());
        }
        if link.connected && s.warned.take().is_some() {
            gst::info!(CAT, imp = self, "connected to {peer} again");
        }
        if link.connections > s.connections_seen {
            // Connected, or connected again after a loss: an element message the application
            // (or `gst-launch-1.0 -m`) can see.
            s.connections_seen = link.connections;
            let (count, sender) = (link.connections, s.lease.sender_name().to_string());
            drop(state);
            let msg = gst::message::Element::builder(
                gst::Structure::builder("GstRdmaSinkConnected")
                    .field("peer", &peer)
                    .field("sender-name", sender)
                    .field("connections", count)
                    .field("reconnected", count > 1)
                    .build(),
            )
            .src(&*self.obj())
            .build();
            let _ = self.obj().post_message(msg);
            // The next check looks at the rest.
            return Ok(());
        }
        if s.lease.sender_stopped() {
            s.failed = true;
            drop(state);
            gst::element_imp_error!(
                self,
                gst::ResourceError::Write,
                ("Sending to receiver {peer} stopped"),
                ["the sending thread ended; see the rdmastream debug category"]
            );
            return Err(Stop::Error);
        }
        Ok(())
    }

    /// Waits until the device has fewer than `limit` frames in flight, giving up on flushing
    /// or a link error.
    fn wait_in_flight(&self, lease: &DeviceLease, limit: u64) -> Result<(), Stop> {
        let mut next_check = Instant::now();
        loop {
            // Read before the check, so a frame written in between ends the wait at once.
            let seen = lease.progress();
            if lease.in_flight() < limit {
                return Ok(());
            }
            if self.flushing.load(Ordering::Acquire) {
                return Err(Stop::Flushing);
            }
            if Instant::now() >= next_check {
                self.check_link()?;
                next_check = Instant::now() + Duration::from_millis(20);
            }
            // Woken when the core writes or drops a frame of this device; the timeout bounds
            // how late a flush (unlock) or a link error is noticed.
            lease.wait_progress(seen, Duration::from_millis(10));
        }
    }

    /// After a frame was handed over: stats and QoS messages when due.
    fn after_push(
        &self,
        lease: &DeviceLease,
        buffer: &gst::Buffer,
    ) -> Result<gst::FlowSuccess, gst::FlowError> {
        let due = match &mut *self.state.lock().unwrap() {
            State::Started(s) => {
                let (frames, _, dropped) = lease.counts();
                s.reporter.check(frames, dropped)
            }
            State::Stopped => Default::default(),
        };
        if due.qos.is_some() {
            gst::debug!(
                CAT,
                imp = self,
                "frames dropped (drop-policy=drop-oldest): {due:?}"
            );
        }
        crate::report::post(self.obj().upcast_ref(), due, buffer.pts());
        Ok(gst::FlowSuccess::Ok)
    }

    /// Sends `buffer` in place when it is one of our pool's send blocks: marks it to be
    /// committed with its frame's metadata once it is let go (right after `render`). False for
    /// any other buffer, which the caller copies, and for a pool buffer something else still
    /// holds (a `tee`'s other branch, a `videorate` about to push it again): its commit would
    /// wait for that holder, and a later frame would overtake it.
    fn render_in_place(
        &self,
        buffer: &gst::Buffer,
        lease: &DeviceLease,
        times: Times,
    ) -> Result<bool, gst::FlowError> {
        let mut state = self.state.lock().unwrap();
        let State::Started(s) = &mut *state else {
            return Err(gst::FlowError::Flushing);
        };
        let (Some(pool), Some(_)) = (&s.pool, &s.caps) else {
            return Ok(false);
        };
        // Only this sink holds the buffer and its memory: let go right after render.
        let meta = s.next_meta(times).expect("caps checked above");
        let Some(remote) = pool.outstanding().mark_buffer(buffer, meta) else {
            return Ok(false);
        };
        s.next_index += 1;
        lease.count_pushed();
        drop(state);
        self.count_path(if remote {
            Path::Receiver
        } else {
            Path::SendBlock
        });
        Ok(true)
    }

    /// Copies a buffer from elsewhere into a block reserved here, on the streaming thread, and
    /// commits it: over shm into a block of the receiver's memory whenever the sending thread
    /// has one on offer (the frame's only copy, as shmsink's), otherwise into a free in-place
    /// send block. With `drop-policy=block` it waits for one up to [`COPY_PATIENCE`] (over shm
    /// the reservation's own wait for a receiver's block is part of it), with `drop-oldest` a
    /// moment (`DROP_OLDEST_PATIENCE`) while this device's earlier frames are still on their
    /// way (`DeviceLease::in_flight`): a source faster than the link that never waited here
    /// kept its core while the frames went the long way, queued and copied twice. With them
    /// all through, the blocks are busy with other sinks' frames on the shared connection
    /// (cameras falling due together), and a drop-oldest frame does not wait. False when it got
    /// none (no in-place blocks, a frame larger than one block, all in use): the caller pushes
    /// the buffer and the filling thread copies it, as before.
    fn render_copied_here(
        &self,
        buffer: &gst::Buffer,
        lease: &DeviceLease,
        policy: DropPolicyProperty,
        times: Times,
    ) -> Result<bool, gst::FlowError> {
        let timeout = match policy {
            DropPolicyProperty::Block => COPY_PATIENCE,
            _ if lease.in_flight() > 0 => rdmastream::engine::sender::DROP_OLDEST_PATIENCE,
            _ => Duration::ZERO,
        };
        let reserved = lease.reserve(buffer.size(), timeout);
        let waited = match &reserved {
            Ok(r) => r.waited(),
            Err(rdmastream::engine::NotReserved::TimedOut) => !timeout.is_zero(),
            Err(_) => false,
        };
        if waited {
            self.copies_waited.fetch_add(1, Ordering::Relaxed);
        }
        gst::trace!(
            CAT,
            imp = self,
            "a block to copy into: {} (waited: {waited}; patience {timeout:?}, {} in flight)",
            if reserved.is_ok() { "reserved" } else { "none" },
            lease.in_flight()
        );
        let mut r = match reserved {
            Ok(r) => r,
            Err(rdmastream::engine::NotReserved::Stopped) => return Err(gst::FlowError::Flushing),
            Err(_) => return Ok(false),
        };
        let Ok(map) = buffer.map_readable() else {
            return Ok(false); // the reservation's block goes back unsent
        };
        r.payload_mut().copy_from_slice(&map);
        drop(map);
        let remote = r.is_remote();
        let meta = {
            let mut state = self.state.lock().unwrap();
            let State::Started(s) = &mut *state else {
                return Err(gst::FlowError::Flushing);
            };
            // Without caps the caller posts the error (its own path checks them too).
            let Some(meta) = s.next_meta(times) else {
                return Ok(false);
            };
            s.next_index += 1;
            meta
        };
        lease.count_pushed();
        if !lease.commit(r, meta) {
            return Err(gst::FlowError::Flushing);
        }
        self.count_path(if remote {
            Path::CopiedToReceiver
        } else {
            Path::CopiedHere
        });
        Ok(true)
    }

    /// Counts a frame's path, and says so in the debug log when it changes.
    fn count_path(&self, path: Path) {
        let (counter, text) = match path {
            Path::SendBlock => (
                &self.in_place,
                "in place: upstream wrote the frame into a send block",
            ),
            Path::Receiver => (
                &self.in_receiver,
                "in place: upstream wrote the frame straight into the receiver's memory (shm)",
            ),
            Path::Copied => (
                &self.copied,
                "copied: the buffer is not one of this element's send blocks (the filling thread copies it)",
            ),
            Path::CopiedHere => (
                &self.copied,
                "copied: the buffer is not one of this element's send blocks (copied into one here)",
            ),
            Path::CopiedToReceiver => (
                &self.copied_to_receiver,
                "copied: the buffer is not one of this element's send blocks (copied straight into the receiver's memory, shm)",
            ),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        match path {
            Path::Receiver => {
                self.in_place.fetch_add(1, Ordering::Relaxed);
            }
            Path::CopiedToReceiver => {
                self.copied.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        let path = path as u8;
        if self.last_path.swap(path, Ordering::Relaxed) != path {
            gst::info!(CAT, imp = self, "frames sent {text}");
        }
    }

    /// The capture time of `buffer` in ns since the UNIX epoch: now, minus how long ago the
    /// pipeline clock passed the buffer's running time (a live source's buffers carry their
    /// capture time as running time). Also returns the running time of its PTS.
    fn times(&self, buffer: &gst::BufferRef) -> (u64, Option<u64>) {
        let now = unix_now_ns();
        let obj = self.obj();
        let segment = obj.segment();
        let running = buffer.pts().and_then(|pts| {
            segment
                .downcast_ref::<gst::ClockTime>()
                .and_then(|s| s.to_running_time(pts))
        });
        let capture = match (running, obj.clock(), obj.base_time()) {
            (Some(running), Some(clock), Some(base)) => {
                let age = clock.time().saturating_sub(running + base).nseconds();
                now.saturating_sub(age)
            }
            _ => now,
        };
        (capture, running.map(|r| r.nseconds()))
    }

    fn settings(&self) -> Settings {
        self.settings.lock().unwrap().clone()
    }
}

/// Caps in the text form that travels.
fn caps_text(caps: &gst::CapsRef) -> Arc<str> {
    Arc::from(caps.to_string().as_str())
}

impl ObjectImpl for RdmaSink {
    fn constructed(&self) {
        self.parent_constructed();
        // A last sample would keep the last buffer, and with the send-block pool its block
        // (and the frame's commit), until the next one: off, so in-place frames go at once.
        self.obj().set_enable_last_sample(false);
    }

    fn properties() -> &'static [glib::ParamSpec] {
        static PROPERTIES: LazyLock<Vec<glib::ParamSpec>> = LazyLock::new(|| {
            vec![
                glib::ParamSpecString::builder("host")
                    .nick("Host")
                    .blurb("Receiver host name or address, or unix:/path of a receiver on this host (the shm transport; port unused)")
                    .default_value(Some(DEFAULT_HOST))
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("port")
                    .nick("Port")
                    .blurb("Receiver port")
                    .minimum(1)
                    .maximum(65535)
                    .default_value(DEFAULT_PORT)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("device-id")
                    .nick("Device ID")
                    .blurb("Device number of this stream (0-255); unique among the sinks sharing a connection")
                    .maximum(255)
                    .default_value(DEFAULT_DEVICE_ID)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("blocks")
                    .nick("Send blocks")
                    .blurb("Local send blocks of the connection (set by the first sink of a shared connection)")
                    .minimum(1)
                    .maximum(4096)
                    .default_value(DEFAULT_BLOCKS)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecInt::builder("in-place-blocks")
                    .nick("In-place send blocks")
                    .blurb("Send blocks for the buffer pool upstream writes frames into, added to `blocks` (which carry caps, EOS and the frames copied when no in-place block is free): a frame waiting in place never holds up a copied one; -1: half of `blocks`; 0: no pool, every frame is copied. Over tcp with blocks of 2 to 4 MiB a live stream keeps at most 8 MiB of them in use (a buffer beyond waits up to 20 ms). With drop-policy=block upstream that needs more buffers at once is refused with a warning naming the value to set (v4l2src io-mode=userptr wants 4); with drop-oldest a buffer waits at most 1 ms for a block (none free by then: an ordinary buffer, copied). Set by the first sink of a shared connection")
                    .minimum(-1)
                    .maximum(4096)
                    .default_value(DEFAULT_IN_PLACE_BLOCKS)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("block-size")
                    .nick("Block size")
                    .blurb("Bytes per block including the 60-byte header and trailer; must not exceed the receiver's. Larger buffers span several blocks. (Not the inherited `blocksize`, a BaseSink setting for pull mode that this element does not use)")
                    .minimum(rdmastream::proto::OVERHEAD as u32 + 1)
                    .maximum(1 << 30)
                    .default_value(DEFAULT_BLOCK_SIZE)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecString::builder("key")
                    .nick("Key")
                    .blurb("This sender's key (at least 16 bytes; the receiver lists it for sender-name): both ends prove they know it, it never crosses the wire. NULL: the receiver must be anonymous")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecString::builder("key-file")
                    .nick("Key file")
                    .blurb("File holding this sender's key (instead of key)")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecString::builder("sender-name")
                    .nick("Sender name")
                    .blurb("Name of this sender at the receiver (1-64 of A-Z a-z 0-9 . _ -); NULL: <hostname>-<pid>")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecEnum::builder_with_default("drop-policy", DEFAULT_DROP_POLICY)
                    .nick("Drop policy")
                    .blurb("When the link is slower than the stream: block (wait: nothing is dropped while connected; frames in flight when a connection is lost are resent only with lossless=true) or drop-oldest (live; drops are counted in stats)")
                    .mutable_ready()
                    .build(),
                glib::ParamSpecBoolean::builder("lossless")
                    .nick("Lossless")
                    .blurb("Acknowledged end to end, as the sender binary's policy = \"block\": every frame is kept until the receiver confirms it handed the frame on (rdmasrc: downstream took the buffer; the receiver binary: the frame file is in place), and what was not confirmed is resent after a reconnect, so nothing is lost when the link drops or the receiver restarts (a restarted rdmasrc may get the last frame twice). Needs drop-policy=block; at most 4 frames unconfirmed at once")
                    .default_value(DEFAULT_LOSSLESS)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecBoolean::builder("reconnect")
                    .nick("Reconnect")
                    .blurb("Retry an unreachable or lost receiver with backoff (posting warnings) instead of posting an error")
                    .default_value(DEFAULT_RECONNECT)
                    .mutable_ready()
                    .build(),
                glib::ParamSpecUInt::builder("reconnect-timeout")
                    .nick("Reconnect timeout")
                    .blurb("With reconnect=true: post an error after the receiver has been unreachable for this many ms (0 = retry for ever)")
                    .default_value(DEFAULT_RECONNECT_TIMEOUT_MS)
                    .mutable_ready()
                    .build(),
            ]
            .into_iter()
            .chain(crate::props::link())
            .chain(crate::props::reporting("frames-written, bytes-written, frames-dropped, in-flight, frames-in-place, frames-in-receiver-memory, frames-copied, frames-copied-to-receiver, copies-waited, connected, connections, sender-name"))
            .collect()
        });
        PROPERTIES.as_ref()
    }

    fn set_property(&self, _id: usize, value: &glib::Value, pspec: &glib::ParamSpec) {
        let mut s = self.settings.lock().unwrap();
        match pspec.name() {
            "host" => {
                s.host = value
                    .get::<Option<String>>()
                    .expect("type checked upstream")
                    .unwrap_or_else(|| DEFAULT_HOST.into())
            }
            "port" => s.port = value.get().expect("type checked upstream"),
            "transport" => s.transport = value.get().expect("type checked upstream"),
            "device-id" => s.device_id = value.get().expect("type checked upstream"),
            "blocks" => s.blocks = value.get().expect("type checked upstream"),
            "in-place-blocks" => s.in_place_blocks = value.get().expect("type checked upstream"),
            "block-size" => s.block_size = value.get().expect("type checked upstream"),
            "rdma-device" => s.rdma_device = value.get().expect("type checked upstream"),
            "ib-port" => s.ib_port = value.get().expect("type checked upstream"),
            "gid-index" => s.gid_index = value.get().expect("type checked upstream"),
            "key" => s.key = value.get().expect("type checked upstream"),
            "key-file" => s.key_file = value.get().expect("type checked upstream"),
            "sender-name" => s.sender_name = value.get().expect("type checked upstream"),
            "drop-policy" => s.drop_policy = value.get().expect("type checked upstream"),
            "lossless" => s.lossless = value.get().expect("type checked upstream"),
            "reconnect" => s.reconnect = value.get().expect("type checked upstream"),
            "stats-interval" => s.stats_interval_ms = value.get().expect("type checked upstream"),
            "metrics" => s.metrics = value.get().expect("type checked upstream"),
            "reconnect-timeout" => {
                s.reconnect_timeout_ms = value.get().expect("type checked upstream")
            }
            other => unimplemented!("property {other}"),
        }
    }

    fn property(&self, _id: usize, pspec: &glib::ParamSpec) -> glib::Value {
        let s = self.settings.lock().unwrap();
        match pspec.name() {
            "host" => s.host.to_value(),
            "port" => s.port.to_value(),
            "transport" => s.transport.to_value(),
            "device-id" => s.device_id.to_value(),
            "blocks" => s.blocks.to_value(),
            "in-place-blocks" => s.in_place_blocks.to_value(),
            "block-size" => s.block_size.to_value(),
            "rdma-device" => s.rdma_device.to_value(),
            "ib-port" => s.ib_port.to_value(),
            "gid-index" => s.gid_index.to_value(),
            // A key is write-only: reading it back gives NULL.
            "key" => None::<String>.to_value(),
            "key-file" => s.key_file.to_value(),
            "sender-name" => s.sender_name.to_value(),
            "drop-policy" => s.drop_policy.to_value(),
            "lossless" => s.lossless.to_value(),
            "reconnect" => s.reconnect.to_value(),
            "reconnect-timeout" => s.reconnect_timeout_ms.to_value(),
            "stats-interval" => s.stats_interval_ms.to_value(),
            "metrics" => s.metrics.to_value(),
            "stats" => {
                drop(s);
                let state = self.state.lock().unwrap();
                let mut b = gst::Structure::builder("application/x-rdmasink-stats");
                if let State::Started(st) = &*state {
                    let (frames, bytes, dropped) = st.lease.counts();
                    let link = st.lease.link();
                    b = b
                        .field("frames-written", frames)
                        .field("bytes-written", bytes)
                        .field("frames-dropped", dropped)
                        .field("in-flight", st.lease.in_flight())
                        .field("frames-in-place", self.in_place.load(Ordering::Relaxed))
                        .field(
                            "frames-in-receiver-memory",
                            self.in_receiver.load(Ordering::Relaxed),
                        )
                        .field("frames-copied", self.copied.load(Ordering::Relaxed))
                        .field(
                            "frames-copied-to-receiver",
                            self.copied_to_receiver.load(Ordering::Relaxed),
                        )
                        .field("copies-waited", self.copies_waited.load(Ordering::Relaxed))
                        .field("connected", link.connected)
                        .field("connections", link.connections)
                        .field("sender-name", st.lease.sender_name());
                }
                b.build().to_value()
            }
            other => unimplemented!("property {other}"),
        }
    }
}

impl GstObjectImpl for RdmaSink {}

impl ElementImpl for RdmaSink {
    fn metadata() -> Option<&'static gst::subclass::ElementMetadata> {
        static ELEMENT_METADATA: LazyLock<gst::subclass::ElementMetadata> = LazyLock::new(|| {
            gst::subclass::ElementMetadata::new(
                "RDMA sink",
                "Sink/Network",
                "Streams buffers as one device of a sender to an rdmasrc or rdmastream receiver \
                 over one-sided RDMA (status-byte-assisted), its TCP emulation, or shared memory \
                 on one host",
                "rdmastream developers",
            )
        });
        Some(&*ELEMENT_METADATA)
    }

    fn pad_templates() -> &'static [gst::PadTemplate] {
        static PAD_TEMPLATES: LazyLock<Vec<gst::PadTemplate>> = LazyLock::new(|| {
            vec![
                gst::PadTemplate::new(
                    "sink",
                    gst::PadDirection::Sink,
                    gst::PadPresence::Always,
                    &gst::Caps::new_any(),
                )
                .expect("valid template"),
            ]
        });
        PAD_TEMPLATES.as_ref()
    }
}

impl BaseSinkImpl for RdmaSink {
    fn start(&self) -> Result<(), gst::ErrorMessage> {
        let settings = self.settings();
        if settings.lossless && settings.drop_policy == DropPolicyProperty::DropOldest {
            return Err(gst::error_msg!(
                gst::ResourceError::Settings,
                ("lossless=true keeps every frame, so it cannot drop the oldest: set drop-policy=block (the default) or lossless=false")
            ));
        }
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
        let name = settings
            .sender_name
            .clone()
            .unwrap_or_else(link::default_sender_name);
        if !rdmastream::proto::handshake::valid_sender_name(&name) {
            return Err(gst::error_msg!(
                gst::ResourceError::Settings,
                ("sender-name {name:?} is not 1-64 characters of A-Z a-z 0-9 . _ -")
            ));
        }
        let key =
            crate::transport::element_key(settings.key.as_deref(), settings.key_file.as_deref())
                .map_err(|e| gst::error_msg!(gst::ResourceError::Settings, ("{e}")))?;
        let peer = join_host_port(&settings.host, settings.port);
        let element = self.obj().name().to_string();
        let in_place_blocks = match settings.in_place_blocks {
            -1 => settings.blocks / 2,
            n => n as u32,
        };
        let lease = DeviceLease::acquire(LeaseRequest {
            key: SenderKey {
                transport: settings.transport,
                peer: peer.clone(),
                name,
            },
            opts: SenderOptions {
                name: String::new(),
                key,
                send_blocks: (settings.blocks + in_place_blocks) as usize,
                block_size: settings.block_size as usize,
                in_place_blocks: in_place_blocks as usize,
                ..Default::default()
            },
            verbs: VerbsSettings {
                device: settings.rdma_device.clone(),
                port: settings.ib_port as u8,
                gid_index: u32::try_from(settings.gid_index).ok(),
            },
            element: &element,
            device: settings.device_id as u8,
            lossless: settings.lossless,
        })
        .map_err(|e| {
            gst::error_msg!(
                gst::ResourceError::OpenWrite,
                (
                    "Cannot stream to receiver {peer} ({})",
                    settings.transport.nick()
                ),
                ["{e}"]
            )
        })?;
        let link = lease.link();
        if !settings.reconnect {
            // Connect now, so that an unreachable receiver fails the state change.
            let deadline = Instant::now() + FIRST_CONNECT_TIMEOUT;
            let mut link = lease.link();
            while link.connections == 0
                && link.errors == 0
                && !lease.sender_stopped()
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(2));
                link = lease.link();
            }
            if link.connections == 0 {
                let why = link
                    .fatal
                    .or(link.error)
                    .unwrap_or_else(|| "no connection within 10 s".into());
                lease.release(Duration::ZERO);
                return Err(gst::error_msg!(
                    gst::ResourceError::OpenWrite,
                    (
                        "Cannot connect to receiver {peer} ({})",
                        settings.transport.nick()
                    ),
                    ["{why} (reconnect=false)"]
                ));
            }
        }
        gst::info!(
            CAT,
            imp = self,
            "device {} of sender '{}' to {peer}{}",
            settings.device_id,
            lease.sender_name(),
            if settings.lossless {
                " (lossless: every frame kept until the receiver confirms it)"
            } else {
                ""
            }
        );
        *self.state.lock().unwrap() = State::Started(Started {
            _metrics: metrics,
            lease,
            drop_policy: settings.drop_policy,
            reconnect: settings.reconnect,
            reconnect_timeout: Duration::from_millis(settings.reconnect_timeout_ms as u64),
            down_since: None,
            reporter: crate::report::Reporter::new(settings.stats_interval_ms),
            connections_seen: 0,
            caps: None,
            next_index: 0,
            errors_seen: link.errors,
            warned: None,
            eos: false,
            failed: false,
            pool: None,
        });
        self.in_place.store(0, Ordering::Relaxed);
        self.in_receiver.store(0, Ordering::Relaxed);
        self.copied.store(0, Ordering::Relaxed);
        self.copied_to_receiver.store(0, Ordering::Relaxed);
        self.copies_waited.store(0, Ordering::Relaxed);
        self.last_path.store(0, Ordering::Relaxed);
        *self.ticker.lock().unwrap() = crate::report::Ticker::start(
            self.obj().upcast_ref(),
            settings.stats_interval_ms,
            |element| {
                let Some(sink) = element.downcast_ref::<super::RdmaSink>() else {
                    return false;
                };
                match &mut *sink.imp().state.lock().unwrap() {
                    State::Started(s) => s.reporter.stats_due(),
                    State::Stopped => false,
                }
            },
        );
        Ok(())
    }

    fn stop(&self) -> Result<(), gst::ErrorMessage> {
        // Joined before the state goes: the ticker reads it.
        drop(self.ticker.lock().unwrap().take());
        let state = std::mem::take(&mut *self.state.lock().unwrap());
        if let State::Started(s) = state {
            let linger = if s.eos {
                LINGER_AFTER_EOS
            } else {
                LINGER_INTERRUPTED
            };
            if let Some(pool) = &s.pool {
                pool.detach();
            }
            s.lease.release(linger);
        }
        Ok(())
    }

    fn set_caps(&self, caps: &gst::Caps) -> Result<(), gst::LoggableError> {
        gst::debug!(CAT, imp = self, "caps {caps}");
        if let State::Started(s) = &mut *self.state.lock().unwrap() {
            s.caps = Some(caps_text(caps));
        }
        Ok(())
    }

    fn render(&self, buffer: &gst::Buffer) -> Result<gst::FlowSuccess, gst::FlowError> {
        self.check_link()?;
        let (lease, policy) = match &*self.state.lock().unwrap() {
            State::Started(s) => (s.lease.clone(), s.drop_policy),
            State::Stopped => return Err(gst::FlowError::Flushing),
        };
        if policy == DropPolicyProperty::Block {
            self.wait_in_flight(&lease, QUEUE_DEPTH as u64)?;
        }
        let (timestamp_ns, pts_ns) = self.times(buffer);
        let duration_ns = buffer
            .duration()
            .map_or(0, |d| d.nseconds().min(u32::MAX as u64) as u32);
        let times = (timestamp_ns, duration_ns, pts_ns);
        if self.render_in_place(buffer, &lease, times)? {
            return self.after_push(&lease, buffer);
        }
        if self.render_copied_here(buffer, &lease, policy, times)? {
            return self.after_push(&lease, buffer);
        }
        let data = buffer.clone().into_mapped_buffer_readable().map_err(|_| {
            gst::element_imp_error!(self, gst::ResourceError::Read, ("Cannot map buffer"));
            gst::FlowError::Error
        })?;
        let frame = {
            let mut state = self.state.lock().unwrap();
            let State::Started(s) = &mut *state else {
                return Err(gst::FlowError::Flushing);
            };
            let Some(caps) = &s.caps else {
                drop(state);
                gst::element_imp_error!(
                    self,
                    gst::CoreError::Negotiation,
                    ("No caps before the first buffer")
                );
                return Err(gst::FlowError::NotNegotiated);
            };
            let index = s.next_index;
            s.next_index += 1;
            SourceFrame {
                index,
                timestamp_ns,
                duration_ns,
                pts_ns,
                format: caps.clone(),
                // No copy here: the filling thread copies straight from the buffer's memory.
                data: Bytes::from_owner(data).into(),
            }
        };
        gst::trace!(
            CAT,
            imp = self,
            "frame {} of {} bytes",
            frame.index,
            frame.data.len()
        );
        if !lease.push(frame) {
            return Err(gst::FlowError::Flushing);
        }
        self.count_path(Path::Copied);
        self.after_push(&lease, buffer)
    }

    fn event(&self, event: gst::Event) -> bool {
        if let gst::EventView::Eos(_) = event.view() {
            let lease = match &*self.state.lock().unwrap() {
                State::Started(s) => Some(s.lease.clone()),
                State::Stopped => None,
            };
            if let Some(lease) = lease {
                // Everything before EOS is written (lossless: confirmed by the receiver) before
                // the EOS message is posted, so a pipeline that exits on it loses nothing.
                match self.wait_in_flight(&lease, 1) {
                    Ok(()) => {}
                    Err(Stop::Flushing) => return false,
                    Err(Stop::Error) => return false,
                }
                lease.end();
                if let State::Started(s) = &mut *self.state.lock().unwrap() {
                    s.eos = true;
                }
                gst::debug!(CAT, imp = self, "end of stream sent to {}", lease.peer());
            }
        }
        self.parent_event(event)
    }

    fn propose_allocation(
        &self,
        query: &mut gst::query::Allocation,
    ) -> Result<(), gst::LoggableError> {
        let (_, need_pool) = query.get();
        let mut state = self.state.lock().unwrap();
        // Only when no last sample keeps a buffer, and so its block, past render. With
        // drop-policy=block acquiring a buffer waits for a free send block (upstream waits
        // anyway); with drop-oldest it waits a moment: no block free by then, a plain buffer,
        // copied.
        if let State::Started(s) = &mut *state
            && need_pool
            && !self.obj().enables_last_sample()
            && s.lease.in_place_blocks() > 0
        {
            let wait = Wait::for_policy(s.drop_policy.into());
            let pool = s.pool.get_or_insert_with(|| {
                let element = self.obj().downgrade();
                let check: LinkCheck = std::sync::Arc::new(move || match element.upgrade() {
                    Some(sink) => Ok(sink.imp().check_link()?),
                    None => Err(gst::FlowError::Flushing),
                });
                let element = self.obj().downgrade();
                let warn: Warn = std::sync::Arc::new(move |min, blocks| {
                    if let Some(sink) = element.upgrade() {
                        gst::element_imp_warning!(
                            sink.imp(),
                            gst::ResourceError::Settings,
                            (
                                "upstream wants {} buffers of the send-block pool at once, but \
                                 the sender has {} in-place blocks: set in-place-blocks={} or \
                                 more (the pool refuses upstream's configuration until then)",
                                min,
                                blocks,
                                min
                            )
                        );
                    }
                });
                let lease: std::sync::Arc<dyn BlockLease> = s.lease.clone();
                BlockPool::new(lease, wait, check, warn)
            });
            // At most the sender's in-place blocks out at once (lent blocks of the receiver's
            // memory come on top over shm, but not always), or no limit for a pool that waits
            // only a moment (past its blocks it hands out plain buffers): `BlockPool::max_buffers`.
            query.add_allocation_pool(Some(pool), 0, 0, pool.max_buffers());
            gst::debug!(CAT, imp = self, "proposing the send-block pool");
        }
        Ok(())
    }

    fn unlock(&self) -> Result<(), gst::ErrorMessage> {
        self.flushing.store(true, Ordering::Release);
        Ok(())
    }

    fn unlock_stop(&self) -> Result<(), gst::ErrorMessage> {
        self.flushing.store(false, Ordering::Release);
        Ok(())
    }
}
