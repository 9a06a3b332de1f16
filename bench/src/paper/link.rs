//! What every experiment of the paper needs from a mechanism, and the status-byte mechanism's
//! answer: one connection, the real [`SenderMachine`] and [`Driver`] on the sender, and a
//! receiver thread that only polls status bytes (it never posts anything).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rdmastream::engine::Driver;
use rdmastream::proto::{BlockScanner, Delivery, SenderMachine, status};
use rdmastream::transport::{
    Completion, Connection, Connector, Listener, Notice, RemoteAddr, Target, WriteWr,
};
use std::sync::Mutex;

/// Work requests and queue depths one side used, as its transport saw them posted and completed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Work requests posted to the send queue (WRITEs, READs, SENDs).
    pub send_wrs: u64,
    /// Receive requests posted.
    pub recv_wrs: u64,
    /// Most send-queue entries outstanding at once.
    pub sq_depth: u64,
    /// Most receive requests outstanding at once.
    pub rq_depth: u64,
    /// Most completions outstanding at once (polled later).
    pub cq_depth: u64,
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
    /// Blocks of `len` bytes sent as fast as the mechanism allows until `due(elapsed)` (how many
    /// should have been sent by then) is reached, for `dur` or until `stop_after` have completed;
    /// returns how many completed and the seconds it took.
    fn stream(
        &mut self,
        len: usize,
        due: &dyn Fn(Duration) -> u64,
        dur: Duration,
        stop_after: u64,
    ) -> (u64, f64);
    /// Makes the receiver keep one block during `hold`.
    fn hold(&mut self, hold: Hold);
    /// Starts recording the blocks the receiver takes.
    fn record(&mut self);
    /// Blocks the receiver took since [`Link::record`]: (when, bytes); stops recording.
    fn arrivals(&mut self) -> Vec<(Instant, u32)>;
    /// What the sender's and the receiver's transports counted.
    fn counts(&self) -> (Counts, Counts);
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
            counts: Counts::default(),
            outstanding: Vec::new(),
        }
    }

    pub fn counts(&self) -> Counts {
        self.counts
    }

    fn posted(&mut self, wr_id: u64, wrs: u64, signaled: bool) {
        self.counts.send_wrs += wrs;
        // A chain's unsignaled requests complete with its signaled one.
        self.outstanding
            .push((wr_id, if signaled { wrs } else { 0 }));
        let sq: u64 = self.outstanding.iter().map(|(_, n)| n).sum();
        self.counts.sq_depth = self.counts.sq_depth.max(sq);
        let cq = self.outstanding.iter().filter(|(_, n)| *n > 0).count() as u64;
        self.counts.cq_depth = self.counts.cq_depth.max(cq);
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

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    /// Arrivals are recorded only while an experiment asks for them (bounded memory).
    record: AtomicBool,
    arrivals: Mutex<Vec<(Instant, u32)>>,
    hold: Mutex<Option<Hold>>,
    taken: AtomicU64,
}

/// Send blocks on the sender (the paper's sender ring).
pub const SEND_BLOCKS: usize = 8;

impl StatusByteLink {
    /// Connects `connector` to `listener` (whose receiver has `blocks` memory blocks of at least
    /// `block_size` bytes).
    pub fn connect(
        mut listener: Box<dyn Listener>,
        connector: &dyn Connector,
        hello: &rdmastream::proto::handshake::Hello,
        block_size: usize,
        outstanding: usize,
    ) -> StatusByteLink {
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
        let shared = Arc::new(Shared::default());
        let accept = std::thread::Builder::new()
            .name("paper-receiver".into())
            .spawn({
                let shared = shared.clone();
                move || {
                    let a = loop {
                        if let Some(a) = listener.accept(Duration::from_millis(50)).unwrap() {
                            break a;
                        }
                    };
                    poll_status_bytes(&a, &shared);
                }
            })
            .unwrap();
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

/// The receiver: polls the status bytes in order (the engine's scan), takes each FULL block
/// and hands it back (status 0), or keeps one (status 2) while a hold lasts.
fn poll_status_bytes(a: &rdmastream::transport::Accepted, shared: &Shared) {
    let n = a.region.layout().blocks;
    let mut scanner = BlockScanner::default();
    let mut held: Option<usize> = None;
    while !shared.stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        let hold = *shared.hold.lock().unwrap();
        if let (Some(j), Some(h)) = (held, hold)
            && now >= h.until
        {
            a.region.set_status(j, status::EMPTY);
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
                match hold {
                    Some(h) if held.is_none() && now >= h.from && now < h.until => {
                        a.region.set_status(j, status::RETAINED);
                        held = Some(j);
                    }
                    _ => a.region.set_status(j, status::EMPTY),
                }
            }
            // The receiver spins: the paper's receiver polls its status bytes continuously.
            None => std::hint::spin_loop(),
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
            while filled < want
                && let Some(i) = self.free.pop()
            {
                self.machine.handle_filled(i, len, Delivery::Unconfirmed);
                filled += 1;
            }
            completed += self.turn();
        }
        // What is in flight completes before the next experiment.
        while completed < filled {
            completed += self.turn();
        }
        (completed, start.elapsed().as_secs_f64())
    }

    fn hold(&mut self, hold: Hold) {
        *self.shared.hold.lock().unwrap() = Some(hold);
    }

    fn record(&mut self) {
        self.shared.record.store(true, Ordering::Relaxed);
    }

    fn arrivals(&mut self) -> Vec<(Instant, u32)> {
        self.shared.record.store(false, Ordering::Relaxed);
        std::mem::take(&mut *self.shared.arrivals.lock().unwrap())
    }

    fn counts(&self) -> (Counts, Counts) {
        // The receiver has no way to post anything: its region only has status bytes to store.
        (self.conn.counts(), Counts::default())
    }
}
