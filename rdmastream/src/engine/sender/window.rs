//! The sending thread of the sliding-window baseline ([`crate::proto::window`]): the same
//! filling thread, send blocks and devices as the status-byte sender, but one connection per
//! device (a "lane"), as the paper says the baseline needs, each with its own [`WindowSender`]
//! (head and tail over that connection's ring) and its own ACK receiving thread, which waits on
//! the connection's ACK completion queue, posts each consumed receive request again and hands
//! the ACK to this thread. Lanes connect when their device's first block is filled and
//! reconnect on their own.
//!
//! Send blocks are shared by all lanes, as in the status-byte sender: a lane whose window is
//! stalled by a block the receiver keeps holds the send blocks filled for it.

use std::collections::BTreeMap;

use crossbeam_channel::Select;

use super::*;
use crate::proto::handshake::Mechanism;
use crate::proto::window::{Immediate, WindowAction, WindowSender, WindowStats};
use crate::transport::{AckQueue, WindowConnection, WorkCounts};

enum AckEvent {
    Ack(Immediate),
    Failed(String),
}

/// A lane's ACK receiving thread; stopped and joined when dropped.
struct AckThread {
    acks: Receiver<AckEvent>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl AckThread {
    fn start(device: u8, mut queue: Box<dyn AckQueue>) -> Result<AckThread> {
        let (tx, acks) = crossbeam_channel::unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let handle = spawn(format!("acks-d{device}"), move || {
            loop {
                match queue.recv(Duration::from_millis(50)) {
                    Ok(Some(imm)) => {
                        // The receive request the ACK used is posted again before the ACK is
                        // handed on: the receiver can never find the queue short.
                        if let Err(e) = queue.post_recv(1) {
                            let _ = tx.send(AckEvent::Failed(e.to_string()));
                            return;
                        }
                        if tx.send(AckEvent::Ack(imm)).is_err() {
                            return;
                        }
                    }
                    Ok(None) if stopping.load(Ordering::Acquire) => return,
                    Ok(None) => {}
                    Err(e) => {
                        let _ = tx.send(AckEvent::Failed(e.to_string()));
                        return;
                    }
                }
            }
        })?;
        Ok(AckThread {
            acks,
            stop,
            handle: Some(handle),
        })
    }
}

impl Drop for AckThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// One device's connection and window.
struct Lane {
    device: u8,
    machine: WindowSender,
    // Field order matters: the connection is dropped (closed) before the ACK thread is joined,
    // so the thread sees the queue end at once.
    conn: Option<Box<dyn WindowConnection>>,
    ack: Option<AckThread>,
    backoff: Duration,
    next_attempt: Instant,
    last_error: String,
    /// Work counted by this lane's earlier connections.
    work: WorkCounts,
}

impl Lane {
    fn disconnect(&mut self) {
        if let Some(c) = self.conn.take() {
            add_work(&mut self.work, c.work_counts());
        }
        self.ack = None;
        self.machine.handle_disconnected();
    }

    fn work(&self) -> WorkCounts {
        let mut w = self.work;
        if let Some(c) = &self.conn {
            add_work(&mut w, c.work_counts());
        }
        w
    }
}

/// Sums counts of connections side by side (or one after another): posts and completions add
/// up, and so do queue depths (each connection has its own queues).
pub(super) fn add_work(total: &mut WorkCounts, w: WorkCounts) {
    total.send_wrs += w.send_wrs;
    total.recv_wrs += w.recv_wrs;
    total.completions += w.completions;
    total.max_send_queue += w.max_send_queue;
    total.max_recv_queue += w.max_recv_queue;
    total.cqs += w.cqs;
}

fn add_stats(total: &mut WindowStats, s: WindowStats) {
    total.writes += s.writes;
    total.acks += s.acks;
    total.released += s.released;
    total.window_full += s.window_full;
    total.requeued += s.requeued;
}

pub(super) fn window_sending_thread(t: SendingThread, s: &mut Sending) -> Result<SenderReport> {
    let session = u64::from_le_bytes(crate::transport::tcp::random_bytes());
    let block_size = t.blocks.block_size();
    let mut lanes: BTreeMap<u8, Lane> = BTreeMap::new();
    let mut report = SenderReport::default();
    let mut done = false;
    let mut completions = Vec::new();
    let intake =
        |ev: ToSending, s: &mut Sending, lanes: &mut BTreeMap<u8, Lane>, done: &mut bool| {
            match ev {
                ToSending::Block(f) => {
                    s.meta[f.index] = Some(f);
                    let lane = lanes.entry(f.device).or_insert_with(|| Lane {
                        device: f.device,
                        machine: WindowSender::new(t.opts.max_outstanding),
                        conn: None,
                        ack: None,
                        backoff: t.opts.reconnect_min,
                        next_attempt: Instant::now(),
                        last_error: String::new(),
                        work: WorkCounts::default(),
                    });
                    let delivery = if f.reliable {
                        Delivery::Confirmed { last: f.last }
                    } else {
                        Delivery::Unconfirmed
                    };
                    lane.machine.handle_filled(f.index, f.len, delivery);
                }
                // Not produced: the baseline runs without coalescing (see `SenderHandle::start`).
                ToSending::Frames(i, frames) => s.coalesced[i] = frames,
                // Not produced: the baseline lends no receiver's blocks (nothing is offered).
                ToSending::Placed { .. } | ToSending::Returned(_) => {}
                ToSending::Done => *done = true,
            }
        };
    loop {
        let mut stats = WindowStats::default();
        for l in lanes.values() {
            add_stats(&mut stats, l.machine.stats());
        }
        t.live.lock().writes = stats.writes;
        if t.abort.load(Ordering::Acquire) {
            while let Ok(ev) = t.filled.try_recv() {
                intake(ev, s, &mut lanes, &mut done);
            }
            report.unsent = lanes
                .values()
                .map(|l| l.machine.queued() + l.machine.in_window() + l.machine.kept())
                .sum();
            report.undelivered_frames = s
                .meta
                .iter()
                .filter(|m| m.is_some_and(|f| f.frame_end.is_some()))
                .count() as u64;
            break;
        }
        while let Ok(ev) = t.filled.try_recv() {
            intake(ev, s, &mut lanes, &mut done);
        }
        if done && lanes.values().all(|l| l.machine.is_idle()) {
            tracing::info!("all devices ended and every block is acknowledged; closing");
            break;
        }
        let mut progress = false;
        for lane in lanes.values_mut() {
            let now = Instant::now();
            if lane.conn.is_none() && now >= lane.next_attempt && !lane.machine.is_idle() {
                connect(&t, session, block_size, lane, &mut report)?;
            }
            let Some(c) = lane.conn.as_mut() else {
                continue;
            };
            let turn = (|| -> Result<bool> {
                c.heartbeat()?;
                let mut did = false;
                while let Some(WindowAction::WriteImm {
                    wr_id,
                    send_block,
                    imm,
                }) = lane.machine.poll_action(now)
                {
                    c.post_write_imm(wr_id, send_block, imm)?;
                    did = true;
                }
                if lane.machine.outstanding() > 0 {
                    completions.clear();
                    c.poll_completions(&mut completions, Duration::ZERO)?;
                    for id in &completions {
                        did |= lane.machine.handle_write_completed(*id);
                    }
                }
                if let Some(a) = &lane.ack {
                    while let Ok(ev) = a.acks.try_recv() {
                        let lost = |reason: String| Error::Disconnected {
                            peer: c.peer().to_string(),
                            reason,
                        };
                        match ev {
                            AckEvent::Ack(imm) => {
                                lane.machine
                                    .handle_ack(now, imm)
                                    .map_err(|e| lost(format!("protocol error: {e}")))?;
                                did = true;
                            }
                            AckEvent::Failed(why) => return Err(lost(why)),
                        }
                    }
                }
                Ok(did)
            })();
            match turn {
                Ok(did) => progress |= did,
                Err(e) => {
                    tracing::warn!(device = lane.device, "{e}; reconnecting");
                    lane.disconnect();
                    t.drops.fetch_add(1, Ordering::Release);
                    lane.next_attempt = Instant::now() + lane.backoff;
                }
            }
            while let Some(i) = lane.machine.poll_freed() {
                s.release(i);
                progress = true;
            }
        }
        if progress {
            continue;
        }
        // Nothing moved: wait for a completion, an ACK, a filled block or a reconnect time.
        if let Some(lane) = lanes
            .values_mut()
            .find(|l| l.conn.is_some() && l.machine.outstanding() > 0)
        {
            let c = lane.conn.as_mut().expect("connected");
            completions.clear();
            match c.poll_completions(&mut completions, Duration::from_micros(200)) {
                Ok(()) => {
                    for id in &completions {
                        lane.machine.handle_write_completed(*id);
                    }
                }
                Err(e) => {
                    tracing::warn!(device = lane.device, "{e}; reconnecting");
                    lane.disconnect();
                    t.drops.fetch_add(1, Ordering::Release);
                    lane.next_attempt = Instant::now() + lane.backoff;
                }
            }
            continue;
        }
        let now = Instant::now();
        let wait = lanes
            .values()
            .filter(|l| l.conn.is_none() && !l.machine.is_idle())
            .map(|l| l.next_attempt.saturating_duration_since(now))
            .min()
            .unwrap_or(Duration::from_millis(50))
            .min(Duration::from_millis(50));
        let mut sel = Select::new();
        sel.recv(&t.filled);
        for l in lanes.values() {
            if let Some(a) = &l.ack {
                sel.recv(&a.acks);
            }
        }
        let _ = sel.ready_timeout(wait);
    }
    let mut stats = WindowStats::default();
    for l in lanes.values() {
        add_stats(&mut stats, l.machine.stats());
        add_work(&mut report.work, l.work());
    }
    report.window = stats;
    report.machine.writes = stats.writes;
    report.machine.requeued = stats.requeued;
    *t.live.lock() = report.machine;
    Ok(report)
}

/// Connects `lane` (RmInit: the receiver's ring comes with the Welcome) and starts its ACK
/// receiving thread. A refusal or an authentication failure ends the sender, as for the
/// status-byte mechanism; anything else is retried with backoff.
fn connect(
    t: &SendingThread,
    session: u64,
    block_size: usize,
    lane: &mut Lane,
    report: &mut SenderReport,
) -> Result<()> {
    let hello = Hello {
        version: PROTOCOL_VERSION,
        sender: t.opts.name.clone(),
        session,
        block_size: block_size as u32,
        data_path: DataPath::Tcp,
        qp: QpInfo::default(),
        nonce: [0; NONCE_LEN],
        mechanism: Mechanism::SlidingWindow {
            device: lane.device,
        },
    };
    let attempt = t
        .connector
        .connect_window(&hello, t.opts.key.as_ref(), &t.blocks)
        .and_then(|mut c| {
            let layout = c.layout();
            if layout.block_size < block_size {
                return Err(Error::invalid(
                    "block_size",
                    format!(
                        "receiver {} offers {}-byte blocks, smaller than this sender's \
                         {block_size}",
                        c.peer(),
                        layout.block_size
                    ),
                ));
            }
            let queue = c.take_ack_queue().ok_or_else(|| Error::Disconnected {
                peer: c.peer().to_string(),
                reason: "the connection has no ACK queue".into(),
            })?;
            let ack = AckThread::start(lane.device, queue)?;
            Ok((c, ack))
        });
    match attempt {
        Ok((c, ack)) => {
            let layout = c.layout();
            tracing::info!(
                peer = c.peer(),
                device = lane.device,
                transport = t.connector.transport(),
                "sliding window connected: a ring of {} blocks of {} bytes",
                layout.blocks,
                layout.block_size
            );
            lane.machine.handle_connected(layout);
            lane.conn = Some(c);
            lane.ack = Some(ack);
            lane.backoff = t.opts.reconnect_min;
            lane.last_error.clear();
            report.connections += 1;
            Ok(())
        }
        Err(e)
            if !e.is_transient()
                || matches!(e, Error::Invalid { .. } | Error::Unavailable { .. }) =>
        {
            Err(e)
        }
        Err(e) => {
            let text = e.to_string();
            if text != lane.last_error {
                tracing::warn!(
                    device = lane.device,
                    "{text}; retrying every {:?} at most",
                    t.opts.reconnect_max
                );
                lane.last_error = text;
            }
            lane.next_attempt = Instant::now() + lane.backoff;
            lane.backoff = (lane.backoff * 2).min(t.opts.reconnect_max);
            Ok(())
        }
    }
}
