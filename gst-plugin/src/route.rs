//! The receiver side shared by `rdmasrc` elements: one core receiver (one listener; per
//! connected sender a region and a polling thread) per (transport, bind address) in the process,
//! and a [`Router`] that hands each element the frames of its (sender, device) through a bounded
//! [`FrameQueue`].
//!
//! A router call runs on a sender's polling thread. When an element's queue is full under the
//! `block` policy the call waits, so the blocks stay full and the sender waits (back-pressure);
//! every device of that sender waits with it, as they share the connection.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Condvar, LazyLock, Mutex};
use std::time::{Duration, Instant};

use rdmastream::engine::{FrameSink, ReceiverHandle, ReceiverOptions, StreamKey};
use rdmastream::proto::{Budget, Frame, Limits, StreamEvent};
use rdmastream::stats::DeviceCounters;
use rdmastream::transport::{Accepted, Listener, MAX_REFUSALS, Refusal, Region, RegionSettings};

use crate::transport::{self, Transport, VerbsSettings};
use rdmastream::engine::DropPolicy;

/// What an element receives, in order.
#[derive(Debug)]
pub enum Item {
    /// A caps string for the frames that follow.
    Format(Vec<u8>),
    Frame(Frame),
    EndOfStream,
}

impl Item {
    /// Handed on (or deliberately dropped): a lossless frame's block may go back to the sender.
    pub fn settle(&self) {
        if let Item::Frame(f) = self {
            rdmastream::proto::ack::settle(&f.ack);
        }
    }
}

/// What [`FrameQueue::pop`] found.
#[derive(Debug)]
pub enum Popped {
    Item(Item),
    /// Nothing arrived within the timeout.
    Timeout,
    /// The element is flushing (unlock): give up now.
    Flushing,
}

#[derive(Default)]
struct QueueState {
    items: VecDeque<Item>,
    frames: usize,
    flushing: bool,
    closed: bool,
    dropped: u64,
    /// Threads waiting in [`FrameQueue::pop`] for an item, and in [`FrameQueue::push`] for
    /// room: a push or pop wakes the other side only when someone waits there.
    poppers: usize,
    pushers: usize,
}

/// A bounded queue of one element's items. Only frames count towards the bound; formats and
/// end-of-stream are never dropped.
///
/// It sits between the receiver's polling thread and the element's streaming thread, once per
/// frame, so a hand-off costs as little as it can: the other side is woken only when it waits
/// (a condvar's notify is a futex syscall whether or not anyone waits), and after the lock is
/// let go (woken under the lock, the streaming thread spun on the lock its waker still held: 1.5 %
/// of the samples of an unthrottled `gst-bench` run).
pub struct FrameQueue {
    state: Mutex<QueueState>,
    /// An item came (or the queue closed or flushes).
    not_empty: Condvar,
    /// A frame left (or the queue closed or flushes).
    not_full: Condvar,
    max_frames: usize,
    policy: DropPolicy,
}

impl FrameQueue {
    fn new(max_frames: usize, policy: DropPolicy) -> FrameQueue {
        FrameQueue {
            state: Mutex::new(QueueState::default()),
            not_empty: Condvar::new(),
            not_full: Condvar::new(),
            max_frames: max_frames.max(1),
            policy,
        }
    }

    /// Wakes both sides (closing, flushing: rare).
    fn wake_all(&self) {
        self.not_empty.notify_all();
        self.not_full.notify_all();
    }

    /// Adds an item; under `block` waits while the queue is full (until room or close).
    fn push(&self, item: Item) {
        let mut s = self.state.lock().unwrap();
        if matches!(item, Item::Frame(_)) {
            while !s.closed && s.frames >= self.max_frames {
                match self.policy {
                    DropPolicy::DropOldest => {
                        if let Some(pos) = s.items.iter().position(|i| matches!(i, Item::Frame(_)))
                            && let Some(dropped) = s.items.remove(pos)
                        {
                            // Dropped on purpose (drop-oldest): the sender may reuse the block.
                            dropped.settle();
                            s.frames -= 1;
                            s.dropped += 1;
                        }
                    }
                    DropPolicy::Block => {
                        s.pushers += 1;
                        s = self
                            .not_full
                            .wait_timeout(s, Duration::from_millis(100))
                            .unwrap()
                            .0;
                        s.pushers -= 1;
                    }
                }
            }
            if s.closed {
                return;
            }
            s.frames += 1;
        } else if s.closed {
            return;
        }
        s.items.push_back(item);
        let wake = s.poppers > 0;
        drop(s);
        if wake {
            self.not_empty.notify_all();
        }
    }

    /// Takes the next item, waiting up to `timeout`.
    pub fn pop(&self, timeout: Duration) -> Popped {
        let deadline = Instant::now() + timeout;
        let mut s = self.state.lock().unwrap();
        loop {
            if s.flushing || s.closed {
                return Popped::Flushing;
            }
            if let Some(item) = s.items.pop_front() {
                let mut wake = false;
                if matches!(item, Item::Frame(_)) {
                    s.frames -= 1;
                    wake = s.pushers > 0;
                }
                drop(s);
                if wake {
                    self.not_full.notify_all();
                }
                return Popped::Item(item);
            }
            let now = Instant::now();
            if now >= deadline {
                return Popped::Timeout;
            }
            s.poppers += 1;
            s = self.not_empty.wait_timeout(s, deadline - now).unwrap().0;
            s.poppers -= 1;
        }
    }

    /// Starts or stops flushing: a waiting [`Self::pop`] returns at once.
    pub fn set_flushing(&self, flushing: bool) {
        self.state.lock().unwrap().flushing = flushing;
        self.wake_all();
    }

    /// Frames dropped because the queue was full (`drop-oldest`).
    pub fn dropped(&self) -> u64 {
        self.state.lock().unwrap().dropped
    }

    /// Frames waiting.
    pub fn queued(&self) -> usize {
        self.state.lock().unwrap().frames
    }

    /// No more items: drops what is queued (releasing retained blocks) and wakes every waiter.
    fn close(&self) {
        let items = {
            let mut s = self.state.lock().unwrap();
            s.closed = true;
            s.frames = 0;
            std::mem::take(&mut s.items)
        };
        self.wake_all();
        drop(items);
    }
}

/// One element's subscription: the frames of `device` from `sender` (or from whichever sender
/// streams that device, when `sender` is `None`).
pub struct Route {
    pub device: u8,
    pub sender: Option<String>,
    element: String,
    pub queue: FrameQueue,
    /// The sender whose stream this route follows.
    current: Mutex<Option<String>>,
    /// Other senders of the same device already warned about.
    ignored: Mutex<HashSet<String>>,
    /// Newly ignored senders, with the one followed, for the element to post warnings about.
    conflicts: Mutex<Vec<(String, String)>>,
    /// When each ignored sender was last told so (a notice on its connection).
    told: Mutex<HashMap<String, Instant>>,
    /// The newest frame queued: sender, session and frame index (for duplicates).
    last: Mutex<Option<(String, u64, u64)>>,
}

impl Route {
    /// The sender whose stream the element receives, once one streamed.
    pub fn current_sender(&self) -> Option<String> {
        self.current.lock().unwrap().clone()
    }

    /// Senders of this device that are ignored since the last call (another sender is being
    /// followed): (ignored, followed).
    pub fn take_conflicts(&self) -> Vec<(String, String)> {
        std::mem::take(&mut *self.conflicts.lock().unwrap())
    }

    fn describe(&self) -> String {
        match &self.sender {
            Some(s) => format!("device-id {} of sender '{s}'", self.device),
            None => format!("device-id {} (from any sender)", self.device),
        }
    }
}

/// One accepted connection, as the listener saw it.
struct Connection {
    sender: String,
    peer: String,
    region: Arc<dyn Region>,
}

/// The connections a listener accepted: whether a sender is connected, and from where.
#[derive(Default)]
pub struct SenderTable {
    connections: Mutex<Vec<Connection>>,
    accepted: std::sync::atomic::AtomicU64,
    /// The newest refusals, numbered from 1 in order; at most `MAX_REFUSALS`.
    refusals: Mutex<VecDeque<(u64, Refusal)>>,
}

impl SenderTable {
    /// The number of the newest refusal so far (0: none).
    pub fn last_refusal(&self) -> u64 {
        self.refusals.lock().unwrap().back().map_or(0, |(n, _)| *n)
    }

    /// The refusals numbered after `seen`, oldest first (older ones may have been forgotten).
    pub fn refusals_after(&self, seen: u64) -> Vec<(u64, Refusal)> {
        self.refusals
            .lock()
            .unwrap()
            .iter()
            .filter(|(n, _)| *n > seen)
            .cloned()
            .collect()
    }

    fn record_refusal(&self, r: Refusal) {
        let mut q = self.refusals.lock().unwrap();
        let n = q.back().map_or(0, |(n, _)| *n) + 1;
        if q.len() == MAX_REFUSALS {
            q.pop_front();
        }
        q.push_back((n, r));
    }

    /// True while `sender` has a connection whose region is still open.
    pub fn is_connected(&self, sender: &str) -> bool {
        self.connections
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.sender == sender && !c.region.is_closed())
    }

    /// Where `sender` last connected from.
    pub fn peer_of(&self, sender: &str) -> Option<String> {
        self.connections
            .lock()
            .unwrap()
            .iter()
            .rev()
            .find(|c| c.sender == sender)
            .map(|c| c.peer.clone())
    }

    /// Sends `notice` to `sender` on its open connection, if it has one.
    pub fn notify(&self, sender: &str, notice: rdmastream::transport::Notice) {
        if let Some(c) = self
            .connections
            .lock()
            .unwrap()
            .iter()
            .rev()
            .find(|c| c.sender == sender && !c.region.is_closed())
        {
            c.region.notify(notice);
        }
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn record(&self, a: &Accepted) {
        let mut c = self.connections.lock().unwrap();
        // Forget closed connections; keep the newest one of each sender for its peer address
        // (of at most MAX_GONE_SENDERS senders that are gone).
        let mut seen = HashSet::new();
        let mut kept: Vec<Connection> = Vec::new();
        for conn in c.drain(..).rev() {
            if !conn.region.is_closed()
                || (seen.len() < MAX_GONE_SENDERS && seen.insert(conn.sender.clone()))
            {
                kept.push(conn);
            }
        }
        kept.reverse();
        *c = kept;
        c.push(Connection {
            sender: a.hello.sender.clone(),
            peer: a.peer.clone(),
            region: a.region.clone(),
        });
        self.accepted
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Wraps the core's listener to record who connected.
struct ObservedListener {
    inner: Box<dyn Listener>,
    table: Arc<SenderTable>,
}

impl Listener for ObservedListener {
    fn transport(&self) -> &'static str {
        self.inner.transport()
    }
    fn local_addr(&self) -> String {
        self.inner.local_addr()
    }
    fn accept(&mut self, timeout: Duration) -> rdmastream::Result<Option<Accepted>> {
        let r = self.inner.accept(timeout);
        if let Ok(Some(a)) = &r {
            self.table.record(a);
        }
        r
    }
    fn waker(&self) -> rdmastream::transport::AcceptWaker {
        self.inner.waker()
    }
    fn refusals(&mut self) -> Vec<Refusal> {
        let refused = self.inner.refusals();
        for r in &refused {
            self.table.record_refusal(r.clone());
        }
        refused
    }
}

/// How long after the listener started frames of a device no element asked for (yet) are held
/// for it: elements of one pipeline start one after the other, and a sender may be quicker.
const HOLD_WINDOW: Duration = Duration::from_secs(3);
/// Frames held per (sender, device) meanwhile, and (sender, device)s held for at most.
const HOLD_FRAMES: usize = 8;
const HOLD_STREAMS: usize = 64;
/// Newest caps remembered for (sender, device)s at most, and the longest caps string kept:
/// what peers send cannot grow the router without bound.
const MAX_FORMATS: usize = 1024;
const MAX_FORMAT_BYTES: usize = 64 * 1024;
/// Senders no longer connected whose last address is remembered at most.
const MAX_GONE_SENDERS: usize = 256;
/// How often a sender whose frames of a device are ignored is told so again.
const TELL_EVERY: Duration = Duration::from_secs(1);

#[derive(Default)]
struct RouterState {
    routes: Vec<Arc<Route>>,
    /// The newest caps of every (sender, device), for elements that start later.
    formats: HashMap<StreamKey, Vec<u8>>,
    held: HashMap<StreamKey, VecDeque<Item>>,
}

enum Pick {
    Route(Arc<Route>, Option<Vec<u8>>),
    Hold,
    Drop,
}

/// Hands each (sender, device) to the element that asked for it.
pub struct Router {
    state: Mutex<RouterState>,
    table: Arc<SenderTable>,
    started: Instant,
    /// Held frames are copies taken from the receiver's memory budget.
    budget: Arc<Budget>,
}

impl Router {
    fn pick(&self, s: &mut RouterState, key: &StreamKey) -> Pick {
        if let Some(r) = s
            .routes
            .iter()
            .find(|r| r.device == key.device && r.sender.as_deref() == Some(&key.sender))
        {
            return Pick::Route(r.clone(), None);
        }
        let Some(r) = s
            .routes
            .iter()
            .find(|r| r.device == key.device && r.sender.is_none())
        else {
            return if self.started.elapsed() < HOLD_WINDOW {
                Pick::Hold
            } else {
                Pick::Drop
            };
        };
        let mut current = r.current.lock().unwrap();
        match current.as_deref() {
            None => {
                *current = Some(key.sender.clone());
                Pick::Route(r.clone(), None)
            }
            Some(c) if c == key.sender => Pick::Route(r.clone(), None),
            Some(c) if self.table.is_connected(c) => {
                if r.ignored.lock().unwrap().insert(key.sender.clone()) {
                    r.conflicts
                        .lock()
                        .unwrap()
                        .push((key.sender.clone(), c.to_string()));
                    tracing::warn!(
                        "{}: ignoring device {} of sender '{}' while following sender '{c}'; set \
                         sender-name to choose",
                        r.element,
                        key.device,
                        key.sender
                    );
                }
                self.tell_ignored(r, key, c);
                Pick::Drop
            }
            Some(c) => {
                tracing::info!(
                    "{}: sender '{c}' is gone; now receiving device {} of sender '{}'",
                    r.element,
                    key.device,
                    key.sender
                );
                *current = Some(key.sender.clone());
                Pick::Route(r.clone(), s.formats.get(key).cloned())
            }
        }
    }

    /// Tells the sender of `key`, on its own connection, that its frames of this device are
    /// ignored because `followed` streams it (its `rdmasink` fails with that); at most once
    /// every [`TELL_EVERY`] per sender while it keeps sending.
    fn tell_ignored(&self, r: &Route, key: &StreamKey, followed: &str) {
        {
            let mut told = r.told.lock().unwrap();
            if told.len() > MAX_GONE_SENDERS {
                told.retain(|_, at| at.elapsed() < TELL_EVERY);
            }
            match told.get(&key.sender) {
                Some(at) if at.elapsed() < TELL_EVERY => return,
                _ => told.insert(key.sender.clone(), Instant::now()),
            };
        }
        let by = match self.table.peer_of(followed) {
            Some(peer) => format!("sender '{followed}' ({peer})"),
            None => format!("sender '{followed}'"),
        };
        let text = format!(
            "device-id {} is already taken at this receiver: {} receives it from {by}, so this \
             sender's frames of it are ignored; use another device-id, or set sender-name on \
             the receiving element",
            key.device, r.element
        );
        self.table.notify(
            &key.sender,
            rdmastream::transport::Notice::new(key.device, text),
        );
    }

    /// Adds `route` (of the listener on `addr`); refused when an element already receives the
    /// same (sender, device).
    fn register(&self, route: Arc<Route>, addr: &str) -> Result<(), crate::Error> {
        let mut s = self.state.lock().unwrap();
        if let Some(other) = s
            .routes
            .iter()
            .find(|r| r.device == route.device && r.sender == route.sender)
        {
            return Err(crate::Error::RouteTaken {
                what: route.describe(),
                by: other.element.clone(),
                addr: addr.to_string(),
            });
        }
        s.routes.push(route.clone());
        // Hand over what arrived for it before it asked, starting with its caps.
        let mut candidates: Vec<StreamKey> = s
            .held
            .keys()
            .chain(s.formats.keys())
            .filter(|k| {
                k.device == route.device
                    && route.sender.as_ref().is_none_or(|name| *name == k.sender)
            })
            .cloned()
            .collect();
        candidates.sort_by_key(|k| (!s.held.contains_key(k), !self.table.is_connected(&k.sender)));
        let Some(key) = candidates.into_iter().next() else {
            return Ok(());
        };
        if route.sender.is_none() {
            *route.current.lock().unwrap() = Some(key.sender.clone());
        }
        if let Some(f) = s.formats.get(&key) {
            route.queue.push(Item::Format(f.clone()));
        }
        for item in s.held.remove(&key).unwrap_or_default() {
            route.queue.push(item);
        }
        Ok(())
    }

    fn unregister(&self, route: &Arc<Route>) {
        self.state
            .lock()
            .unwrap()
            .routes
            .retain(|r| !Arc::ptr_eq(r, route));
        route.queue.close();
    }
}

impl FrameSink for Router {
    fn handle(
        &self,
        key: &StreamKey,
        session: u64,
        _counters: &Arc<DeviceCounters>,
        event: StreamEvent,
    ) {
        // Formats and ends of stream are handed on when queued; a frame when its element takes
        // it (rdmasrc's create), or when it is deliberately dropped.
        let item = match event {
            StreamEvent::Frame(f) => Item::Frame(f),
            StreamEvent::Format {
                descriptor, ack, ..
            } => {
                rdmastream::proto::ack::settle(&ack);
                Item::Format(descriptor)
            }
            StreamEvent::EndOfStream { ack, .. } => {
                rdmastream::proto::ack::settle(&ack);
                Item::EndOfStream
            }
        };
        let (route, format) = {
            let mut s = self.state.lock().unwrap();
            if let Item::Format(d) = &item
                && d.len() <= MAX_FORMAT_BYTES
            {
                if s.formats.len() >= MAX_FORMATS && !s.formats.contains_key(key) {
                    let table = &self.table;
                    s.formats.retain(|k, _| table.is_connected(&k.sender));
                }
                if s.formats.len() < MAX_FORMATS || s.formats.contains_key(key) {
                    s.formats.insert(key.clone(), d.clone());
                }
            }
            match self.pick(&mut s, key) {
                Pick::Route(r, format) => (r, format),
                Pick::Hold => {
                    if s.held.len() >= HOLD_STREAMS && !s.held.contains_key(key) {
                        tracing::debug!("{key}: too many streams held for elements; dropped");
                        item.settle();
                        return;
                    }
                    let item = match item {
                        // Held frames are copied: a retained block must not wait for an element
                        // that may never come. The copy comes out of the memory budget.
                        Item::Frame(mut f) => {
                            match rdmastream::proto::budget::reserved_copy(&self.budget, &f.data) {
                                Some(copy) => f.data = copy,
                                None => {
                                    rdmastream::proto::ack::settle(&f.ack);
                                    return;
                                }
                            }
                            Item::Frame(f)
                        }
                        other => other,
                    };
                    let held = s.held.entry(key.clone()).or_default();
                    held.push_back(item);
                    let frames = held.iter().filter(|i| matches!(i, Item::Frame(_))).count();
                    if frames > HOLD_FRAMES
                        && let Some(pos) = held.iter().position(|i| matches!(i, Item::Frame(_)))
                        && let Some(dropped) = held.remove(pos)
                    {
                        dropped.settle();
                    }
                    return;
                }
                Pick::Drop => {
                    tracing::debug!("no rdmasrc receives {key}; dropped");
                    item.settle();
                    return;
                }
            }
        };
        // A frame this element already had (sent again after a reconnect): drop it.
        if let Item::Frame(f) = &item {
            let mut last = route.last.lock().unwrap();
            match &*last {
                Some((sender, s, index))
                    if *sender == key.sender && *s == session && f.index <= *index =>
                {
                    drop(last);
                    item.settle();
                    return;
                }
                _ => *last = Some((key.sender.clone(), session, f.index)),
            }
        }
        // Outside the router lock: this may wait for room.
        if let Some(f) = format {
            route.queue.push(Item::Format(f));
        }
        route.queue.push(item);
    }
}

/// What identifies a shared receiver.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ListenKey {
    pub transport: Transport,
    /// `address:port` to bind.
    pub addr: String,
}

/// One core receiver and its router.
pub struct SharedReceiver {
    key: ListenKey,
    handle: Mutex<Option<ReceiverHandle>>,
    router: Arc<Router>,
    table: Arc<SenderTable>,
    local_addr: String,
    /// The transport the listener resolved to (`auto` picks one).
    transport: &'static str,
    settings: RegionSettings,
    /// `poll_spin` and `poll_max` of the receiver.
    poll: (Duration, Duration),
    /// The element that opened the listener.
    opened_by: String,
}

static RECEIVERS: LazyLock<Mutex<HashMap<ListenKey, Arc<SharedReceiver>>>> =
    LazyLock::new(Default::default);

/// What an element asks for.
pub struct RouteRequest<'a> {
    pub key: ListenKey,
    pub region: RegionSettings,
    /// Reassembly memory and the largest frame accepted.
    pub limits: Limits,
    pub verbs: VerbsSettings,
    pub element: &'a str,
    pub device: u8,
    pub sender: Option<String>,
    pub max_buffers: usize,
    pub policy: DropPolicy,
    /// How long the receiver's polling thread keeps looking (yielding) after a block before it
    /// sleeps ([`ReceiverOptions::poll_spin`]), and its longest sleep
    /// ([`ReceiverOptions::poll_max`]).
    pub poll_spin: Duration,
    pub poll_max: Duration,
}

/// One element's route on a shared receiver.
pub struct RouteLease {
    shared: Arc<SharedReceiver>,
    pub route: Arc<Route>,
}

impl RouteLease {
    /// Subscribes to a device, starting the receiver (binding the address) if there is none.
    pub fn acquire(req: RouteRequest<'_>) -> Result<RouteLease, crate::Error> {
        let mut receivers = RECEIVERS.lock().unwrap();
        let shared = match receivers.get(&req.key) {
            Some(s) => {
                if s.settings.access.keys() != req.region.access.keys() {
                    return Err(crate::Error::KeyMismatch {
                        element: req.element.to_string(),
                        first: s.opened_by.clone(),
                        shared: format!("the listener on {}", s.local_addr),
                        hint: "or listen on another port",
                    });
                }
                if s.settings.blocks != req.region.blocks
                    || s.settings.block_size != req.region.block_size
                    || s.poll != (req.poll_spin, req.poll_max)
                {
                    tracing::warn!(
                        "{}: sharing the listener on {} with the blocks, block-size, \
                         poll-spin, poll-max and limits of the first element",
                        req.element,
                        s.local_addr
                    );
                }
                s.clone()
            }
            None => {
                let inner = transport::listener(
                    req.key.transport,
                    &req.key.addr,
                    req.region.clone(),
                    &req.verbs,
                )?;
                let transport = inner.transport();
                let table = Arc::new(SenderTable::default());
                let router = Arc::new(Router {
                    state: Mutex::new(RouterState::default()),
                    table: table.clone(),
                    started: Instant::now(),
                    budget: req.limits.budget.clone(),
                });
                let listener = ObservedListener {
                    inner,
                    table: table.clone(),
                };
                let handle = ReceiverHandle::start(
                    ReceiverOptions {
                        limits: req.limits.clone(),
                        poll_spin: req.poll_spin,
                        poll_max: req.poll_max,
                        poll_min: ReceiverOptions::default().poll_min.min(req.poll_max),
                        ..ReceiverOptions::default()
                    },
                    Box::new(listener),
                    router.clone(),
                )
                .map_err(|source| crate::Error::Transport {
                    what: format!("cannot start receiving on {}", req.key.addr),
                    source,
                })?;
                let shared = Arc::new(SharedReceiver {
                    key: req.key.clone(),
                    local_addr: handle.local_addr().to_string(),
                    transport,
                    handle: Mutex::new(Some(handle)),
                    router,
                    table,
                    settings: req.region.clone(),
                    poll: (req.poll_spin, req.poll_max),
                    opened_by: req.element.to_string(),
                });
                receivers.insert(req.key.clone(), shared.clone());
                shared
            }
        };
        let route = Arc::new(Route {
            device: req.device,
            sender: req.sender,
            element: req.element.to_string(),
            queue: FrameQueue::new(req.max_buffers, req.policy),
            current: Mutex::new(None),
            ignored: Mutex::new(HashSet::new()),
            conflicts: Mutex::new(Vec::new()),
            told: Mutex::new(HashMap::new()),
            last: Mutex::new(None),
        });
        shared.router.register(route.clone(), &shared.local_addr)?;
        Ok(RouteLease { shared, route })
    }

    /// Where the shared listener listens.
    pub fn local_addr(&self) -> &str {
        &self.shared.local_addr
    }

    /// The transport the shared listener runs (tcp, shm or verbs).
    pub fn transport(&self) -> &'static str {
        self.shared.transport
    }

    /// The listener's blocks and block size per sender (the first element's).
    pub fn region(&self) -> (usize, usize) {
        (self.shared.settings.blocks, self.shared.settings.block_size)
    }

    /// The listener's connections.
    pub fn senders(&self) -> Arc<SenderTable> {
        self.shared.table.clone()
    }

    /// Unsubscribes; the last element stops the receiver and frees the address.
    pub fn release(self) {
        self.shared.router.unregister(&self.route);
        let mut receivers = RECEIVERS.lock().unwrap();
        if !self.shared.router.state.lock().unwrap().routes.is_empty() {
            return;
        }
        if receivers
            .get(&self.shared.key)
            .is_some_and(|s| Arc::ptr_eq(s, &self.shared))
        {
            receivers.remove(&self.shared.key);
        }
        // Joins the accepting and polling threads (their calls into the router return at once:
        // every route is closed). Under the registry lock, so that an element starting on the
        // same address meanwhile waits for it.
        let handle = self.shared.handle.lock().unwrap().take();
        drop(handle);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(index: u64) -> Item {
        Item::Frame(Frame {
            device: 1,
            index,
            timestamp_ns: 0,
            duration_ns: 0,
            pts_ns: None,
            data: rdmastream::bytes::Bytes::from(vec![index as u8; 4]),
            reliable: false,
            ack: None,
        })
    }

    fn index(p: Popped) -> u64 {
        match p {
            Popped::Item(Item::Frame(f)) => f.index,
            other => panic!("expected a frame, got {other:?}"),
        }
    }

    /// A pop that waits is woken by the push (the push wakes only a waiting popper, so a push
    /// that forgot to would leave it to its 60 s timeout; half of that is the bound here); one
    /// that comes later finds the item queued.
    #[test]
    fn a_waiting_pop_is_woken_by_a_push_and_a_later_pop_finds_it_queued() {
        let q = Arc::new(FrameQueue::new(4, DropPolicy::Block));
        let popper = {
            let q = q.clone();
            std::thread::spawn(move || index(q.pop(Duration::from_secs(60))))
        };
        // Until the popper waits (it registers under the lock before it sleeps).
        while q.state.lock().unwrap().poppers == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let started = Instant::now();
        q.push(frame(7));
        assert_eq!(popper.join().unwrap(), 7);
        assert!(started.elapsed() < Duration::from_secs(30));
        q.push(frame(8));
        assert_eq!(q.queued(), 1);
        assert_eq!(index(q.pop(Duration::ZERO)), 8);
        assert!(matches!(q.pop(Duration::ZERO), Popped::Timeout));
    }

    /// Under `block`, a push into a full queue waits until a pop takes a frame, and the frames
    /// come out in order; nothing is dropped.
    #[test]
    fn a_push_into_a_full_queue_waits_for_a_pop_under_block() {
        let q = Arc::new(FrameQueue::new(2, DropPolicy::Block));
        q.push(frame(0));
        q.push(frame(1));
        let pusher = {
            let q = q.clone();
            std::thread::spawn(move || q.push(frame(2)))
        };
        while q.state.lock().unwrap().pushers == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(q.queued(), 2, "the third frame waits");
        assert_eq!(index(q.pop(Duration::ZERO)), 0);
        pusher.join().unwrap();
        assert_eq!(index(q.pop(Duration::ZERO)), 1);
        assert_eq!(index(q.pop(Duration::ZERO)), 2);
        assert_eq!(q.dropped(), 0);
    }

    /// Flushing ends a waiting pop at once, and closing ends a push waiting for room (its frame
    /// goes nowhere); formats are never counted against the bound.
    #[test]
    fn flushing_and_closing_wake_whoever_waits() {
        let q = Arc::new(FrameQueue::new(1, DropPolicy::Block));
        let popper = {
            let q = q.clone();
            std::thread::spawn(move || q.pop(Duration::from_secs(30)))
        };
        while q.state.lock().unwrap().poppers == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        q.set_flushing(true);
        assert!(matches!(popper.join().unwrap(), Popped::Flushing));
        q.set_flushing(false);

        q.push(Item::Format(b"video/x-raw".to_vec()));
        q.push(frame(0));
        assert_eq!(q.queued(), 1, "a format does not count");
        let pusher = {
            let q = q.clone();
            std::thread::spawn(move || q.push(frame(1)))
        };
        while q.state.lock().unwrap().pushers == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        q.close();
        pusher.join().unwrap();
        assert_eq!(q.queued(), 0);
        assert!(matches!(q.pop(Duration::ZERO), Popped::Flushing));
    }

    /// Under `drop-oldest`, a push into a full queue drops the oldest frame instead of waiting.
    #[test]
    fn a_push_into_a_full_queue_drops_the_oldest_under_drop_oldest() {
        let q = FrameQueue::new(2, DropPolicy::DropOldest);
        for i in 0..3 {
            q.push(frame(i));
        }
        assert_eq!(q.dropped(), 1);
        assert_eq!(index(q.pop(Duration::ZERO)), 1);
        assert_eq!(index(q.pop(Duration::ZERO)), 2);
    }
}
