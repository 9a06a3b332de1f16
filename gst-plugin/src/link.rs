//! The sender side shared by `rdmasink` elements: one core sender (one connection, one queue
//! pair, one filling and one sending thread) per (transport, receiver, sender name) in the
//! process, the paper's multi-device shared QP. Each element leases one device number on it.
//!
//! The core's sending thread connects and reconnects by itself; to tell the elements what it is
//! doing (connected, failed, lost, refused) the connector it gets is wrapped
//! ([`rdmastream::transport::observe`]) so every outcome is recorded in a [`LinkState`].

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use rdmastream::engine::{DeviceInput, SenderHandle, SenderOptions};
use rdmastream::engine::{NotReserved, Reservation, SourceFrame};
use rdmastream::stats::DeviceCounters;
use rdmastream::transport::SendBlocks;
use rdmastream::transport::observe::{ConnectionObserver, observed};
use rdmastream_app::gst::pool::BlockLease;

use crate::transport::{self, Transport, VerbsSettings};

/// Frames queued per device between an element and the filling thread.
pub const QUEUE_DEPTH: usize = 4;

/// What identifies a shared sender.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SenderKey {
    pub transport: Transport,
    /// `host:port` of the receiver.
    pub peer: String,
    /// Sender name presented in the handshake.
    pub name: String,
}

/// A snapshot of what the connection has been doing.
#[derive(Debug, Clone, Default)]
pub struct LinkStatus {
    /// A connection is up.
    pub connected: bool,
    /// Connections made so far.
    pub connections: u64,
    /// The last connect failure or connection loss, naming the peer.
    pub error: Option<String>,
    /// Counts errors: an element notices a new one when this moves.
    pub errors: u64,
    /// A failure reconnecting cannot cure (refused handshake, unusable block size).
    pub fatal: Option<String>,
}

/// Shared between the observer (written from the sending thread) and the elements.
#[derive(Debug, Default)]
pub struct LinkState {
    status: Mutex<LinkStatus>,
    /// The newest notice from the receiver about each device (see
    /// [`rdmastream::transport::Notice`]), until the device's element takes it.
    notices: Mutex<HashMap<u8, String>>,
}

impl LinkState {
    pub fn status(&self) -> LinkStatus {
        self.status.lock().unwrap().clone()
    }

    fn connected(&self) {
        let mut s = self.status.lock().unwrap();
        s.connected = true;
        s.connections += 1;
    }

    fn failed(&self, error: String, fatal: bool) {
        let mut s = self.status.lock().unwrap();
        s.connected = false;
        s.errors += 1;
        if fatal {
            s.fatal = Some(error.clone());
        }
        s.error = Some(error);
    }

    fn closed(&self) {
        self.status.lock().unwrap().connected = false;
    }

    /// The receiver's notice about `device`, if one came since the last call.
    pub fn take_notice(&self, device: u8) -> Option<String> {
        self.notices.lock().unwrap().remove(&device)
    }
}

/// Records each outcome of the core's connections: connected, refused (fatal), lost, closed.
impl ConnectionObserver for LinkState {
    fn connected(
        &self,
        peer: &str,
        layout: rdmastream::proto::RemoteLayout,
        blocks: &SendBlocks,
    ) -> rdmastream::Result<()> {
        let (offered, own) = (layout.block_size, blocks.block_size());
        // A sender's blocks must fit the receiver's (smaller ones are fine). Refusing here stops
        // the sending thread with a message saying what to set.
        if offered < own {
            let reason = format!(
                "the receiver uses {offered}-byte blocks, smaller than this sender's {own}: set \
                 block-size={offered} or less"
            );
            let e = rdmastream::Error::Refused {
                peer: peer.to_string(),
                reason,
            };
            self.failed(e.to_string(), true);
            return Err(e);
        }
        LinkState::connected(self);
        Ok(())
    }
    fn connect_failed(&self, e: &rdmastream::Error) {
        let fatal = matches!(
            e,
            rdmastream::Error::Refused { .. } | rdmastream::Error::Auth { .. }
        );
        self.failed(e.to_string(), fatal);
    }
    fn lost(&self, e: &rdmastream::Error) {
        self.failed(e.to_string(), false);
    }
    fn closed(&self) {
        LinkState::closed(self);
    }
    fn notice(&self, notice: &rdmastream::transport::Notice) {
        self.notices
            .lock()
            .unwrap()
            .insert(notice.device, notice.text.clone());
    }
}

/// One core sender and the devices leased on it.
pub struct SharedSender {
    key: SenderKey,
    handle: Mutex<Option<SenderHandle>>,
    link: Arc<LinkState>,
    /// Device number → name of the element streaming it.
    devices: Mutex<BTreeMap<u8, String>>,
    block_size: usize,
    /// The key the connection authenticates with, and the element that opened it.
    auth: Option<rdmastream::proto::handshake::Key>,
    opened_by: String,
}

impl SharedSender {
    fn is_finished(&self) -> bool {
        self.handle
            .lock()
            .unwrap()
            .as_ref()
            .is_none_or(|h| h.is_finished())
    }
}

static SENDERS: LazyLock<Mutex<HashMap<SenderKey, Arc<SharedSender>>>> =
    LazyLock::new(Default::default);

/// One element's device on a shared sender.
pub struct DeviceLease {
    shared: Arc<SharedSender>,
    device: u8,
    input: Mutex<Option<DeviceInput>>,
    counters: Arc<DeviceCounters>,
    /// Frames pushed by this lease, plus the device's written + dropped count when it started.
    pushed: AtomicU64,
}

/// What the element asks for.
pub struct LeaseRequest<'a> {
    pub key: SenderKey,
    /// Everything but the name, which comes from `key`.
    pub opts: SenderOptions,
    pub verbs: VerbsSettings,
    pub element: &'a str,
    pub device: u8,
    /// `lossless`: the device's frames are acknowledged end to end (kept until the receiver
    /// confirms it handed them on, resent after a reconnect), as the sender binary's `block`
    /// devices are.
    pub lossless: bool,
}

impl DeviceLease {
    /// Leases `device` on the shared sender for `key`, starting the sender if there is none.
    pub fn acquire(req: LeaseRequest<'_>) -> Result<Arc<DeviceLease>, crate::Error> {
        let mut senders = SENDERS.lock().unwrap();
        let shared = match senders.get(&req.key) {
            Some(s) if !s.is_finished() => {
                if s.auth != req.opts.key {
                    return Err(crate::Error::KeyMismatch {
                        element: req.element.to_string(),
                        first: s.opened_by.clone(),
                        shared: format!("the connection to {} as '{}'", s.key.peer, s.key.name),
                        hint: "or give it another sender-name",
                    });
                }
                if s.block_size != req.opts.block_size {
                    tracing::warn!(
                        "{}: joining the connection to {} with block-size {} (this element asks \
                         for {}; the first element's settings apply)",
                        req.element,
                        req.key.peer,
                        s.block_size,
                        req.opts.block_size
                    );
                }
                s.clone()
            }
            _ => {
                let inner = transport::connector(
                    req.key.transport,
                    &req.key.peer,
                    &req.verbs,
                    req.opts.max_outstanding,
                )?;
                let link = Arc::new(LinkState::default());
                let connector = observed(inner, link.clone());
                let block_size = req.opts.block_size;
                let auth = req.opts.key.clone();
                let opts = SenderOptions {
                    name: req.key.name.clone(),
                    ..req.opts
                };
                let handle =
                    SenderHandle::start(opts, connector, QUEUE_DEPTH).map_err(|source| {
                        crate::Error::Transport {
                            what: format!("cannot start sending to {}", req.key.peer),
                            source,
                        }
                    })?;
                let shared = Arc::new(SharedSender {
                    key: req.key.clone(),
                    handle: Mutex::new(Some(handle)),
                    link,
                    devices: Mutex::new(BTreeMap::new()),
                    block_size,
                    auth,
                    opened_by: req.element.to_string(),
                });
                senders.insert(req.key.clone(), shared.clone());
                shared
            }
        };
        let mut devices = shared.devices.lock().unwrap();
        if let Some(other) = devices.get(&req.device) {
            return Err(crate::Error::DeviceTaken {
                device: req.device,
                by: other.clone(),
                peer: shared.key.peer.clone(),
                name: shared.key.name.clone(),
            });
        }
        let guard = shared.handle.lock().unwrap();
        let handle = guard.as_ref().expect("running while registered");
        // The core's queue never blocks (drop-oldest); `block` is done by the element waiting
        // for room first (see `in_flight`), which, unlike a blocked push, can be interrupted.
        // A lossless device's frames count as in flight until confirmed, so that wait also
        // keeps the queue from ever dropping one of them.
        let input = handle.add_device_with(
            req.device,
            rdmastream::engine::DropPolicy::DropOldest,
            req.lossless,
        );
        let counters = handle.counters().device(&req.device);
        drop(guard);
        devices.insert(req.device, req.element.to_string());
        drop(devices);
        // A notice about an earlier element's stream of this device is not about this one.
        shared.link.take_notice(req.device);
        let done = counters.frames.load(Ordering::Relaxed) + counters.drops.load(Ordering::Relaxed);
        Ok(Arc::new(DeviceLease {
            shared: shared.clone(),
            device: req.device,
            input: Mutex::new(Some(input)),
            counters,
            pushed: AtomicU64::new(done),
        }))
    }

    /// The receiver, for messages.
    pub fn peer(&self) -> &str {
        &self.shared.key.peer
    }

    /// The sender name used on the connection.
    pub fn sender_name(&self) -> &str {
        &self.shared.key.name
    }

    /// What the connection has been doing.
    pub fn link(&self) -> LinkStatus {
        self.shared.link.status()
    }

    /// What the receiver said about this device since the last call (another sender already
    /// streams it there, so these frames are ignored).
    pub fn take_notice(&self) -> Option<String> {
        self.shared.link.take_notice(self.device)
    }

    /// True once the core sender stopped (refused, or shut down).
    pub fn sender_stopped(&self) -> bool {
        self.shared.is_finished()
    }

    /// Frames handed over and neither fully written nor dropped yet (for a lossless device:
    /// not yet confirmed by the receiver, which includes those to be resent after a reconnect).
    pub fn in_flight(&self) -> u64 {
        let done = self.counters.frames.load(Ordering::Relaxed)
            + self.counters.drops.load(Ordering::Relaxed);
        self.pushed.load(Ordering::Relaxed).saturating_sub(done)
    }

    /// A value for [`DeviceLease::wait_progress`]: frames written or dropped so far.
    pub fn progress(&self) -> u64 {
        self.counters.progress()
    }

    /// Waits until a frame of this device is written or dropped after `seen`, or `timeout`.
    pub fn wait_progress(&self, seen: u64, timeout: Duration) {
        self.counters.wait_progress(seen, timeout);
    }

    /// Frames fully written, bytes, frames dropped.
    pub fn counts(&self) -> (u64, u64, u64) {
        (
            self.counters.frames.load(Ordering::Relaxed),
            self.counters.bytes.load(Ordering::Relaxed),
            self.counters.drops.load(Ordering::Relaxed),
        )
    }

    /// Queues a frame (never blocks: a full queue drops its oldest frame). False once ended.
    pub fn push(&self, frame: SourceFrame) -> bool {
        let input = self.input.lock().unwrap();
        let Some(input) = input.as_ref() else {
            return false;
        };
        self.pushed.fetch_add(1, Ordering::Relaxed);
        input.push(frame)
    }

    /// Counts a frame written in place as handed over (when `render` marks it; it is committed
    /// once its buffer is let go).
    pub fn count_pushed(&self) {
        self.pushed.fetch_add(1, Ordering::Relaxed);
    }

    /// Ends the device's stream: end-of-stream follows the queued frames.
    pub fn end(&self) {
        if let Some(input) = self.input.lock().unwrap().take() {
            input.end();
        }
    }

    /// Gives the device back. The last element on a sender stops it, waiting up to `linger` for
    /// what is queued (and the end-of-stream blocks) to be written.
    pub fn release(self: Arc<Self>, linger: Duration) {
        // Dropping the input ends the device's stream if `end` was not called.
        self.input.lock().unwrap().take();
        let shared = self.shared.clone();
        let handle = {
            let mut senders = SENDERS.lock().unwrap();
            let mut devices = shared.devices.lock().unwrap();
            devices.remove(&self.device);
            if !devices.is_empty() {
                return;
            }
            if senders
                .get(&shared.key)
                .is_some_and(|s| Arc::ptr_eq(s, &shared))
            {
                senders.remove(&shared.key);
            }
            shared.handle.lock().unwrap().take()
        };
        if let Some(handle) = handle {
            match handle.finish(linger) {
                Ok(report) if report.unsent > 0 => tracing::warn!(
                    "sender '{}': {} blocks to {} could not be written before stopping",
                    shared.key.name,
                    report.unsent,
                    shared.key.peer
                ),
                Ok(_) => {}
                Err(e) => tracing::warn!("sender '{}': {e}", shared.key.name),
            }
        }
    }
}

/// `rdmasink`'s pool reserves its buffers' blocks on the element's device.
impl BlockLease for DeviceLease {
    /// Send blocks the connection's sender sets aside for frames written in place (0 once
    /// the lease is ended).
    fn in_place_blocks(&self) -> usize {
        self.input
            .lock()
            .unwrap()
            .as_ref()
            .map_or(0, |i| i.in_place_blocks())
    }

    /// Takes a send block for a frame of `len` bytes written in place (see
    /// [`DeviceInput::reserve`]).
    fn reserve(&self, len: usize, timeout: Duration) -> Result<Reservation, NotReserved> {
        let input = self.input.lock().unwrap().clone();
        match input {
            Some(input) => input.reserve(len, timeout),
            None => Err(NotReserved::Stopped),
        }
    }
}

/// The default sender name: this host and process, so senders of different processes never
/// share a name (the receiver keeps per-name state).
pub fn default_sender_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(40)
        .collect::<String>();
    let host = if host.is_empty() || host == "." || host == ".." {
        "gst".to_string()
    } else {
        host
    };
    format!("{host}-{}", std::process::id())
}
