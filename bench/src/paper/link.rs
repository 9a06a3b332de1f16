//! What every experiment of the paper needs from a mechanism, and the status-byte mechanism's
//! answer: one connection, the real [`SenderMachine`] and [`Driver`] on the sender, and a
//! receiver thread that only polls status bytes (it never posts anything).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rdmastream::engine::Driver;
use rdmastream::proto::window::{Immediate, WindowAction, WindowSender};
use rdmastream::proto::{BlockScanner, Delivery, SenderMachine};
use rdmastream::transport::{
    Completion, Connection, Connector, Listener, Notice, RemoteAddr, RetainedBlock, Target,
    WindowConnection, WorkCounts, WriteWr,
};
use std::sync::Mutex;

/// Work requests and queues one side used, as its transport counted them while posting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Work requests posted to the send queue (WRITEs, READs, WRITE WITH IMMEDIATE, SENDs).
    pub send_wrs: u64,
    /// Receive requests posted.
    pub recv_wrs: u64,
    /// Completion queue entries generated.
    pub completions: u64,
    /// Most send-queue entries outstanding at once.
    pub sq_depth: u64,
    /// Most receive requests outstanding at once.
    pub rq_depth: u64,
    /// Completion queues used.
    pub cqs: u64,
}

impl From<WorkCounts> for Counts {
    fn from(w: WorkCounts) -> Counts {
        Counts {
            send_wrs: w.send_wrs,
            recv_wrs: w.recv_wrs,
            completions: w.completions,
            sq_depth: w.max_send_queue,
            rq_depth: w.max_recv_queue,
            cqs: w.cqs,
        }
    }
}

/// When the receiver keeps a block instead of handing it back (Figure 18).
#[derive(Debug, Clone, Copy)]
pub struct Hold {
    pub from: Instant,
    pub until: Instant,
}

/// A mechanism's sender and receiver, connected, in this process.
pub trait Link: Send {
    /// One synchronisation as the mechanism does it, in µs: the status-byte sender's READ of
    /// the whole status array; the sliding window's ACK (receiver SEND → sender RECV).
    fn sync_once(&mut self) -> f64;
    /// One block of `len` bytes, from posting to the sender's completion, in µs.
    fn transmit_once(&mut self, len: usize) -> f64;
    /// Hands the mechanism one block of `len` bytes if a send block is free; false if none is.
    fn offer(&mut self, len: usize) -> bool;
    /// Posts what the mechanism allows and takes completions; returns the send blocks that came
    /// back (their write completed).
    fn advance(&mut self) -> u64;
    /// What the sender's transport counted.
    fn sender_counts(&self) -> Counts;
    /// The receiver thread's side of the link.
    fn shared(&self) -> &Shared;

    /// Blocks of `len` bytes sent as fast as the mechanism allows until `due(elapsed)` (how many
    /// should have been sent by then) is reached, for `dur` or until `stop_after` have completed;
    /// returns how many completed and the seconds it took.
    fn stream(
        &mut self,
        len: usize,
        due: &dyn Fn(Duration) -> u64,
        dur: Duration,
        stop_after: u64,
    ) -> (u64, f64) {
        let start = Instant::now();
        let (mut filled, mut completed) = (0u64, 0u64);
        loop {
            let el = start.elapsed();
            if el >= dur || completed >= stop_after {
                break;
            }
            let want = due(el).min(stop_after);
            while filled < want && self.offer(len) {
                filled += 1;
            }
            completed += self.advance();
        }
        // What is in flight completes before the next experiment (bounded: a link that stops
        // completing must not hang the whole run).
        let drain = Instant::now() + Duration::from_secs(30);
        while completed < filled && Instant::now() < drain {
            completed += self.advance();
        }
        (completed, start.elapsed().as_secs_f64())
    }
    /// Makes the receiver keep one block during `hold`.
    fn hold(&mut self, hold: Hold) {
        *self.shared().hold.lock().unwrap() = Some(hold);
    }
    /// Makes the receiver sleep when idle (20 µs doubling to 200 µs after 50 µs without a
    /// block), as the engine's receiver does, instead of yielding: for experiments that run
    /// many links at once on few cores.
    fn relax(&mut self) {
        self.shared().relaxed.store(true, Ordering::Relaxed);
    }
    /// Starts recording the blocks the receiver takes.
    fn record(&mut self) {
        self.shared().record.store(true, Ordering::Relaxed);
    }
    /// Blocks the receiver took since [`Link::record`]: (when, bytes); stops recording.
    fn arrivals(&mut self) -> Vec<(Instant, u32)> {
        self.shared().record.store(false, Ordering::Relaxed);
        std::mem::take(&mut *self.shared().arrivals.lock().unwrap())
    }
    /// What the sender's and the receiver's transports counted.
    fn counts(&self) -> (Counts, Counts) {
        let receiver = self.shared().receiver_counts.lock().unwrap();
        (self.sender_counts(), receiver.unwrap_or_default().into())
    }
}

/// A connection wrapper that counts what is posted and how much is outstanding.
pub struct Counted {
    inner: Box<dyn Connection>,
    counts: Counts,
    /// Send-queue entries posted and not yet known complete, per chain id.
    outstanding: Vec<(u64, u64)>,
}

impl Counted {
    pub fn new(inner: Box<dyn Connection>) -> Counted {
        Counted {
            inner,
            counts: Counts {
                cqs: 1,
                ..Counts::default()
            },
            outstanding: Vec::new(),
        }
    }

    /// What the transport counted, or (a transport that does not count, verbs for the
    /// status-byte mechanism) what this wrapper saw posted and completed.
    pub fn counts(&self) -> Counts {
        self.inner
            .work_counts()
            .map(Counts::from)
            .unwrap_or(self.counts)
    }

    fn posted(&mut self, wr_id: u64, wrs: u64, signaled: bool) {
        self.counts.send_wrs += wrs;
        // A chain's unsignaled requests complete with its signaled one.
        self.outstanding
            .push((wr_id, if signaled { wrs } else { 0 }));
        let sq: u64 = self.outstanding.iter().map(|(_, n)| n).sum();
        self.counts.sq_depth = self.counts.sq_depth.max(sq);
    }
}

impl Connection for Counted {
    fn peer(&self) -> &str {
        self.inner.peer()
    }
    fn layout(&self) -> rdmastream::proto::RemoteLayout {
        self.inner.layout()
    }
    fn post_write_chain(&mut self, wr_id: u64, chain: &[WriteWr<'_>]) -> rdmastream::Result<()> {
        self.inner.post_write_chain(wr_id, chain)?;
        let signaled = chain.iter().any(|w| w.signaled);
        self.posted(wr_id, chain.len() as u64, signaled);
        Ok(())
    }
    fn post_read(&mut self, wr_id: u64, remote: RemoteAddr, len: usize) -> rdmastream::Result<()> {
        self.inner.post_read(wr_id, remote, len)?;
        self.posted(wr_id, 1, true);
        Ok(())
    }
    fn poll_completions(
        &mut self,
        out: &mut Vec<Completion>,
        timeout: Duration,
    ) -> rdmastream::Result<()> {
        let from = out.len();
        self.inner.poll_completions(out, timeout)?;
        for c in &out[from..] {
            self.counts.completions += 1;
            if let Some(k) = self.outstanding.iter().position(|(id, _)| *id == c.wr_id()) {
                self.outstanding.remove(k);
            }
        }
        Ok(())
    }
    fn heartbeat(&mut self) -> rdmastream::Result<()> {
        self.inner.heartbeat()
    }
    fn take_notices(&mut self) -> Vec<Notice> {
        self.inner.take_notices()
    }
    fn work_counts(&self) -> Option<WorkCounts> {
        self.inner.work_counts()
    }
    fn lend_block(
        &self,
        remote_block: usize,
    ) -> Option<Box<dyn rdmastream::transport::LeasedBlock>> {
        self.inner.lend_block(remote_block)
    }
    fn cache_budget(&self) -> Option<usize> {
        None
    }
    fn send_limits(&self, _block_size: usize) -> rdmastream::transport::SendLimits {
        rdmastream::transport::SendLimits::default()
    }
    fn syncs_early(&self) -> bool {
        self.inner.syncs_early()
    }
    fn writes_lowest_first(&self) -> bool {
        self.inner.writes_lowest_first()
    }
    fn completes_at_once(&self) -> bool {
        self.inner.completes_at_once()
    }
    fn posts_here_when_idle(&self) -> bool {
        self.inner.posts_here_when_idle()
    }
}

/// The status-byte mechanism between a connector and a listener.
pub struct StatusByteLink {
    conn: Counted,
    machine: SenderMachine,
    driver: Driver,
    free: Vec<usize>,
    blocks: usize,
    receiver: Option<std::thread::JoinHandle<()>>,
    shared: Arc<Shared>,
}

/// What a link's receiver thread shares with the experiment driving the sender.
#[derive(Default)]
pub struct Shared {
    stop: AtomicBool,
    /// Arrivals are recorded only while an experiment asks for them (bounded memory).
    record: AtomicBool,
    /// Sleep when idle instead of yielding (see [`Link::relax`]).
    relaxed: AtomicBool,
    arrivals: Mutex<Vec<(Instant, u32)>>,
    hold: Mutex<Option<Hold>>,
    taken: AtomicU64,
    /// What the receiver's side of the transport counted (the sliding window's receives and
    /// ACKs; the status-byte receiver posts nothing).
    receiver_counts: Mutex<Option<WorkCounts>>,
}

/// Send blocks on the sender (the paper's sender ring).
pub const SEND_BLOCKS: usize = 8;

impl StatusByteLink {
    /// Connects `connector` to `listener` (whose receiver has `blocks` memory blocks of at least
    /// `block_size` bytes).
    pub fn connect(
        listener: Box<dyn Listener>,
        connector: &dyn Connector,
        hello: &rdmastream::proto::handshake::Hello,
        block_size: usize,
        outstanding: usize,
    ) -> StatusByteLink {
        let send = send_blocks(connector, block_size);
        let shared = Arc::new(Shared::default());
        let accept = spawn_receiver(listener, shared.clone());
        let conn = connector
            .connect(hello, None, &send)
            .expect("connecting the status-byte link");
        let layout = conn.layout();
        let mut machine = SenderMachine::new(outstanding);
        machine.handle_connected(layout);
        StatusByteLink {
            conn: Counted::new(conn),
            machine,
            driver: Driver::new(),
            free: (0..SEND_BLOCKS).rev().collect(),
            blocks: layout.blocks,
            receiver: Some(accept),
            shared,
        }
    }

    /// Turns the driver once; takes back the send blocks whose write completed.
    fn turn(&mut self) -> u64 {
        self.driver
            .turn(
                &mut self.machine,
                &mut self.conn,
                &Instant::now,
                Duration::from_millis(1),
            )
            .expect("status-byte link failed");
        let mut done = 0;
        while let Some(i) = self.machine.poll_freed() {
            self.free.push(i);
            done += 1;
        }
        done
    }
}

/// The receiver: polls the status bytes in order (the engine's scan), takes each FULL block and
/// lets it go at once — status 0 for the status-byte mechanism, an ACK for the sliding window —
/// or keeps one while a hold lasts (status 2; no ACK). It never posts anything itself.
fn poll_status_bytes(a: &rdmastream::transport::Accepted, shared: &Shared) {
    let n = a.region.layout().blocks;
    let mut scanner = BlockScanner::default();
    let mut held: Option<RetainedBlock> = None;
    *shared.receiver_counts.lock().unwrap() = a.region.work_counts();
    let (mut idle_since, mut nap) = (Instant::now(), Duration::from_micros(20));
    while !shared.stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        let hold = *shared.hold.lock().unwrap();
        if held.is_some() && hold.is_none_or(|h| now >= h.until) {
            held = None;
            *shared.hold.lock().unwrap() = None;
        }
        match scanner.next_full(n, |j| a.region.status(j)) {
            Some(j) => {
                let mut len = 0u32;
                a.region.read_block(j, &mut |b| {
                    len = b.len() as u32;
                    std::hint::black_box(b[0]);
                });
                if shared.record.load(Ordering::Relaxed) {
                    shared.arrivals.lock().unwrap().push((now, len));
                }
                shared.taken.fetch_add(1, Ordering::Relaxed);
                let block = a.region.clone().retain(j);
                match hold {
                    Some(h) if held.is_none() && now >= h.from && now < h.until => {
                        held = Some(block);
                    }
                    _ => drop(block),
                }
                *shared.receiver_counts.lock().unwrap() = a.region.work_counts();
                (idle_since, nap) = (now, Duration::from_micros(20));
            }
            None if shared.relaxed.load(Ordering::Relaxed)
                && now.duration_since(idle_since) > Duration::from_micros(50) =>
            {
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_micros(200));
            }
            // The paper's receiver polls its status bytes continuously; yielding between scans
            // keeps it from starving the transport's threads on a machine with few cores.
            None => std::thread::yield_now(),
        }
    }
}

impl Drop for StatusByteLink {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(r) = self.receiver.take() {
            let _ = r.join();
        }
    }
}

impl Link for StatusByteLink {
    fn sync_once(&mut self) -> f64 {
        let mut done = Vec::new();
        let t = Instant::now();
        self.conn
            .post_read(
                u64::MAX - 1,
                RemoteAddr {
                    target: Target::Statuses,
                    offset: 0,
                },
                self.blocks,
            )
            .expect("status READ");
        while !done
            .iter()
            .any(|c: &Completion| matches!(c, Completion::Read { .. }))
        {
            self.conn
                .poll_completions(&mut done, Duration::from_millis(100))
                .expect("status READ completion");
        }
        t.elapsed().as_secs_f64() * 1e6
    }

    fn transmit_once(&mut self, len: usize) -> f64 {
        let i = self.free.pop().expect("a free send block");
        let t = Instant::now();
        self.machine.handle_filled(i, len, Delivery::Unconfirmed);
        while self.turn() == 0 {}
        t.elapsed().as_secs_f64() * 1e6
    }

    fn offer(&mut self, len: usize) -> bool {
        let Some(i) = self.free.pop() else {
            return false;
        };
        self.machine.handle_filled(i, len, Delivery::Unconfirmed);
        true
    }

    fn advance(&mut self) -> u64 {
        self.turn()
    }

    fn sender_counts(&self) -> Counts {
        self.conn.counts()
    }

    fn shared(&self) -> &Shared {
        &self.shared
    }
}

/// The sender's ring, filled once with a pattern (the experiments measure the mechanism, not
/// the filling).
fn send_blocks(
    connector: &dyn Connector,
    block_size: usize,
) -> Arc<rdmastream::transport::SendBlocks> {
    let send = connector
        .alloc_send_blocks(SEND_BLOCKS, block_size)
        .expect("send blocks");
    for i in 0..SEND_BLOCKS {
        send.fill(i, |b| {
            for (k, x) in b.iter_mut().enumerate() {
                *x = k as u8;
            }
        });
    }
    send
}

/// Accepts the one connection of `listener` and runs the receiver on it, on a thread of its own.
fn spawn_receiver(
    mut listener: Box<dyn Listener>,
    shared: Arc<Shared>,
) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name("paper-receiver".into())
        .spawn(move || {
            let Some(a) =
                crate::accept_own(listener.as_mut(), || shared.stop.load(Ordering::Relaxed))
            else {
                return;
            };
            poll_status_bytes(&a, &shared);
        })
        .unwrap()
}

/// The sliding-window baseline between a connector and a listener: one connection (one
/// device), the real [`WindowSender`] (head and tail over the receiver's ring), WRITE WITH
/// IMMEDIATE, and an ACK receiving thread of its own on the connection's ACK completion queue,
/// as the paper describes.
pub struct SlidingWindowLink {
    conn: Box<dyn WindowConnection>,
    machine: WindowSender,
    /// ACKs with the moment the ACK thread got them.
    acks: crossbeam_channel::Receiver<Result<(Instant, Immediate), String>>,
    /// When the newest write completion was polled, and the newest ACK arrived.
    last_write: Option<Instant>,
    last_ack: Option<Instant>,
    ack_stop: Arc<AtomicBool>,
    ack_thread: Option<std::thread::JoinHandle<()>>,
    free: Vec<usize>,
    completions: Vec<u64>,
    receiver: Option<std::thread::JoinHandle<()>>,
    shared: Arc<Shared>,
}

impl SlidingWindowLink {
    pub fn connect(
        listener: Box<dyn Listener>,
        connector: &dyn Connector,
        hello: &rdmastream::proto::handshake::Hello,
        block_size: usize,
        outstanding: usize,
    ) -> SlidingWindowLink {
        let send = send_blocks(connector, block_size);
        let shared = Arc::new(Shared::default());
        let receiver = spawn_receiver(listener, shared.clone());
        let mut conn = connector
            .connect_window(hello, None, &send)
            .expect("connecting the sliding-window link");
        let mut queue = conn.take_ack_queue().expect("an ACK queue");
        let (tx, acks) = crossbeam_channel::unbounded();
        let ack_stop = Arc::new(AtomicBool::new(false));
        let stop = ack_stop.clone();
        // The paper's ACK receiving thread: waits on the ACK completion queue, posts each
        // consumed receive request again, hands the ACK to the sending thread.
        let ack_thread = std::thread::Builder::new()
            .name("paper-acks".into())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match queue.recv(Duration::from_millis(50)) {
                        Ok(Some(imm)) => {
                            let at = Instant::now();
                            let r = queue
                                .post_recv(1)
                                .map(|()| (at, imm))
                                .map_err(|e| e.to_string());
                            let failed = r.is_err();
                            if tx.send(r).is_err() || failed {
                                return;
                            }
                        }
                        Ok(None) => {}
                        Err(e) => {
                            let _ = tx.send(Err(e.to_string()));
                            return;
                        }
                    }
                }
            })
            .unwrap();
        let mut machine = WindowSender::new(outstanding);
        machine.handle_connected(conn.layout());
        SlidingWindowLink {
            conn,
            machine,
            acks,
            ack_stop,
            ack_thread: Some(ack_thread),
            free: (0..SEND_BLOCKS).rev().collect(),
            completions: Vec::new(),
            last_write: None,
            last_ack: None,
            receiver: Some(receiver),
            shared,
        }
    }

    /// Posts what the window allows, takes write completions and ACKs; returns the send blocks
    /// given back (acknowledged, in order).
    fn turn(&mut self, wait: Duration) -> u64 {
        let now = Instant::now();
        while let Some(WindowAction::WriteImm {
            wr_id,
            send_block,
            imm,
        }) = self.machine.poll_action(now)
        {
            self.conn
                .post_write_imm(wr_id, send_block, imm)
                .expect("WRITE WITH IMMEDIATE");
        }
        if self.machine.outstanding() > 0 {
            self.completions.clear();
            self.conn
                .poll_completions(&mut self.completions, wait)
                .expect("sliding-window link failed");
            if !self.completions.is_empty() {
                self.last_write = Some(Instant::now());
            }
            for id in &self.completions {
                self.machine.handle_write_completed(*id);
            }
        } else if let Ok(ack) = self.acks.recv_timeout(wait) {
            self.ack(ack);
        }
        while let Ok(ack) = self.acks.try_recv() {
            self.ack(ack);
        }
        let mut done = 0;
        while let Some(i) = self.machine.poll_freed() {
            self.free.push(i);
            done += 1;
        }
        done
    }

    fn ack(&mut self, ack: Result<(Instant, Immediate), String>) {
        let (at, imm) = ack.expect("ACK receiving thread failed");
        self.last_ack = Some(at);
        self.machine
            .handle_ack(Instant::now(), imm)
            .expect("a valid ACK");
    }
}

impl Drop for SlidingWindowLink {
    fn drop(&mut self) {
        self.ack_stop.store(true, Ordering::Relaxed);
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.ack_thread.take() {
            let _ = t.join();
        }
        if let Some(r) = self.receiver.take() {
            let _ = r.join();
        }
    }
}

impl Link for SlidingWindowLink {
    /// The window's synchronisation: from the block's write completion at the sender to its ACK
    /// arriving at the sender's ACK thread (the receiver's receive completion, its processing,
    /// its SEND, the sender's receive completion).
    fn sync_once(&mut self) -> f64 {
        let i = self.free.pop().expect("a free send block");
        self.machine.handle_filled(i, 64, Delivery::Unconfirmed);
        (self.last_write, self.last_ack) = (None, None);
        // The send block comes back with the write's completion; the ring block with the ACK.
        while self.last_ack.is_none() || self.free.len() < SEND_BLOCKS {
            self.turn(Duration::from_micros(50));
        }
        let (w, a) = (
            self.last_write.expect("a write completion"),
            self.last_ack.expect("an ACK"),
        );
        a.saturating_duration_since(w).as_secs_f64() * 1e6
    }

    /// Post to the write's completion at the sender (the ACK is waited for before the next).
    fn transmit_once(&mut self, len: usize) -> f64 {
        let i = self.free.pop().expect("a free send block");
        self.last_write = None;
        let t = Instant::now();
        self.machine.handle_filled(i, len, Delivery::Unconfirmed);
        while self.free.len() < SEND_BLOCKS {
            self.turn(Duration::from_micros(50));
        }
        self.last_write
            .expect("a write completion")
            .duration_since(t)
            .as_secs_f64()
            * 1e6
    }

    fn offer(&mut self, len: usize) -> bool {
        let Some(i) = self.free.pop() else {
            return false;
        };
        self.machine.handle_filled(i, len, Delivery::Unconfirmed);
        true
    }

    fn advance(&mut self) -> u64 {
        self.turn(Duration::from_millis(1))
    }

    fn sender_counts(&self) -> Counts {
        self.conn.work_counts().into()
    }

    fn shared(&self) -> &Shared {
        &self.shared
    }
}
