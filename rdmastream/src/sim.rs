//! A deterministic simulator of one sender and one receiver region, driving the real protocol
//! core ([`SenderMachine`], the packetizer, the block codec and [`DeviceStream`]) through
//! simulated time. It can delay writes, reads and completions, retain blocks (status 2), make
//! the receiver process blocks in a random order, slow the receiver down, and drop the
//! connection. No threads, no sleeps: events are taken from a time-ordered queue.
//!
//! The simulator checks the mechanism's safety property on every placement — a block is only
//! ever written while its receiver status byte is 0 — and records everything the receiver
//! delivered so tests can check order, completeness and contents.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::{Duration, Instant};

use crate::proto::{
    Action, BlockHeader, DeviceNumbering, DeviceStream, MessageKind, MessageTimes, Packet,
    RemoteLayout, ReorderConfig, SenderMachine, StreamEvent, fragment_range, status,
};

/// A simulated device.
#[derive(Debug, Clone)]
pub struct SimDevice {
    pub id: u8,
    /// Payload bytes per frame.
    pub frame_len: usize,
    pub frames: u64,
    /// Time between frames.
    pub interval: Duration,
    /// First packet number (to exercise wrap-around).
    pub first_packet: u16,
}

/// A block the receiver keeps unavailable (status 2) for a while.
#[derive(Debug, Clone, Copy)]
pub struct Retention {
    pub block: usize,
    pub from: Duration,
    pub until: Duration,
}

/// Queue policy at the sources when the link is slower than they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimPolicy {
    DropOldest,
    Block,
}

/// Everything the simulation is made of.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub remote_blocks: usize,
    pub block_size: usize,
    pub send_blocks: usize,
    pub max_outstanding: usize,
    /// Post → data and status byte placed in receiver memory.
    pub write_latency: Duration,
    /// Placement → completion seen by the sender.
    pub ack_latency: Duration,
    /// Post of the status READ → its completion (the snapshot is taken half way).
    pub read_latency: Duration,
    /// Receiver time to process one block, and its idle poll interval.
    pub process_time: Duration,
    pub poll_interval: Duration,
    pub retentions: Vec<Retention>,
    /// Receiver picks a random full block instead of scanning round-robin.
    pub random_order: bool,
    pub seed: u64,
    pub devices: Vec<SimDevice>,
    pub policy: SimPolicy,
    /// Frames queued per device before the policy applies.
    pub queue_depth: usize,
    /// Drop the connection at these times; the sender reconnects to a fresh region.
    pub disconnects: Vec<Duration>,
    pub reorder: ReorderConfig,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            remote_blocks: 4,
            block_size: 256,
            send_blocks: 3,
            max_outstanding: 2,
            write_latency: Duration::from_micros(5),
            ack_latency: Duration::from_micros(5),
            read_latency: Duration::from_micros(10),
            process_time: Duration::from_micros(3),
            poll_interval: Duration::from_micros(2),
            retentions: Vec::new(),
            random_order: false,
            seed: 1,
            devices: Vec::new(),
            policy: SimPolicy::Block,
            queue_depth: 4,
            disconnects: Vec::new(),
            reorder: ReorderConfig::default(),
        }
    }
}

/// What a run produced.
#[derive(Debug, Default)]
pub struct SimReport {
    /// Per device: frame indices delivered, in delivery order, with their payloads.
    pub delivered: Vec<(u8, u64, Vec<u8>)>,
    pub ended: Vec<u8>,
    pub dropped: u64,
    /// Per device: frames dropped at the source queue (they add up to `dropped`).
    pub dropped_by_device: std::collections::BTreeMap<u8, u64>,
    pub syncs: u64,
    pub retained_skipped: u64,
    pub gap_packets: u64,
    pub duplicates: u64,
    pub reordered: u64,
    /// Largest number of frames queued at one device.
    pub max_queue: usize,
    pub finished_at: Duration,
}

/// The reference payload of frame `f` of device `d`.
pub fn payload(d: u8, f: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(31).wrapping_add(f * 7 + d as u64) as u8)
        .collect()
}

#[derive(Debug)]
enum Ev {
    Source(usize),
    Placed {
        conn: u64,
        block: usize,
        bytes: Vec<u8>,
    },
    WriteDone {
        conn: u64,
        wr_id: u64,
    },
    ReadSnapshot {
        conn: u64,
        wr_id: u64,
    },
    ReadDone {
        conn: u64,
        wr_id: u64,
        snapshot: Vec<u8>,
    },
    Poll,
    Processed {
        block: usize,
        region: u64,
    },
    RetainStart(usize),
    RetainEnd(usize),
    Disconnect,
    /// Wakes the sender for its sync backoff timer.
    Wake,
}

/// Receiver: hands one block's packet to its device stream and records what comes out.
fn deliver(
    streams: &mut Vec<(u8, DeviceStream)>,
    report: &mut SimReport,
    reorder: ReorderConfig,
    now: Instant,
    bytes: &[u8],
) {
    let (h, p) = BlockHeader::decode_block(bytes, 255).expect("simulated blocks are valid");
    let packet = Packet {
        header: h,
        payload: bytes::Bytes::copy_from_slice(p),
        ack: None,
    };
    let pos = match streams.iter().position(|(d, _)| *d == h.device) {
        Some(p) => p,
        None => {
            streams.push((h.device, DeviceStream::new(reorder)));
            streams.len() - 1
        }
    };
    let s = &mut streams[pos].1;
    s.handle_packet(now, packet);
    while let Some(e) = s.poll_event() {
        match e {
            StreamEvent::Frame(f) => report.delivered.push((f.device, f.index, f.data.to_vec())),
            StreamEvent::EndOfStream { .. } => report.ended.push(h.device),
            StreamEvent::Format { .. } => {}
        }
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

enum Queued {
    Frame(u64),
    End,
}

/// Runs a simulation to completion (every device ended and delivered, or `limit` of simulated
/// time passed). Panics if the sender ever writes a block whose status byte is not 0.
pub fn run(cfg: &SimConfig, limit: Duration) -> SimReport {
    let t0 = Instant::now();
    let at = |d: Duration| t0 + d;
    let mut queue: BinaryHeap<Reverse<(Duration, u64, usize)>> = BinaryHeap::new();
    let mut events: Vec<Option<Ev>> = Vec::new();
    let mut seq = 0u64;
    let mut push =
        |queue: &mut BinaryHeap<_>, events: &mut Vec<Option<Ev>>, t: Duration, ev: Ev| {
            events.push(Some(ev));
            queue.push(Reverse((t, seq, events.len() - 1)));
            seq += 1;
        };
    let mut rng = Rng(cfg.seed.max(1));
    let layout = RemoteLayout {
        blocks: cfg.remote_blocks,
        block_size: cfg.block_size,
    };

    // Receiver memory: status bytes and blocks, renewed per connection (region id).
    let mut region_id = 0u64;
    let mut statuses = vec![status::EMPTY; cfg.remote_blocks];
    let mut blocks: Vec<Vec<u8>> = vec![Vec::new(); cfg.remote_blocks];
    let mut busy = false; // receiver processing a block
    let mut cursor = 0usize;
    let mut streams: Vec<(u8, DeviceStream)> = Vec::new();

    // Sender side.
    let mut machine = SenderMachine::new(cfg.max_outstanding);
    let mut conn = 0u64;
    machine.handle_connected(layout);
    let mut free: VecDeque<usize> = (0..cfg.send_blocks).collect();
    let mut send_mem: Vec<Vec<u8>> = vec![vec![0; cfg.block_size]; cfg.send_blocks];
    let mut queues: Vec<VecDeque<Queued>> = cfg.devices.iter().map(|_| VecDeque::new()).collect();
    let mut produced = vec![0u64; cfg.devices.len()];
    let mut numbering: Vec<DeviceNumbering> = cfg
        .devices
        .iter()
        .map(|d| DeviceNumbering::starting_at(d.first_packet, 0))
        .collect();
    // The message being filled: fragments left (index, header), payload.
    type Fragments = VecDeque<(usize, BlockHeader)>;
    let mut filling: Option<(Fragments, Vec<u8>)> = None;
    let mut rr_device = 0usize;

    let mut report = SimReport::default();
    for (i, _) in cfg.devices.iter().enumerate() {
        push(&mut queue, &mut events, Duration::ZERO, Ev::Source(i));
    }
    for r in &cfg.retentions {
        push(&mut queue, &mut events, r.from, Ev::RetainStart(r.block));
        push(&mut queue, &mut events, r.until, Ev::RetainEnd(r.block));
    }
    for d in &cfg.disconnects {
        push(&mut queue, &mut events, *d, Ev::Disconnect);
    }
    push(&mut queue, &mut events, Duration::ZERO, Ev::Poll);
    let mut retained_now: Vec<usize> = Vec::new();
    let mut wake_at: Option<Duration> = None;

    while let Some(Reverse((now, _, idx))) = queue.pop() {
        if now > limit {
            break;
        }
        let ev = events[idx].take().expect("each event runs once");
        match ev {
            Ev::Source(i) => {
                let d = &cfg.devices[i];
                if produced[i] < d.frames {
                    let blocked =
                        cfg.policy == SimPolicy::Block && queues[i].len() >= cfg.queue_depth;
                    if blocked {
                        // The source waits: try again a little later.
                        push(
                            &mut queue,
                            &mut events,
                            now + d.interval / 4 + Duration::from_nanos(1),
                            Ev::Source(i),
                        );
                        continue;
                    }
                    if queues[i].len() >= cfg.queue_depth {
                        queues[i].pop_front();
                        report.dropped += 1;
                        *report.dropped_by_device.entry(d.id).or_default() += 1;
                    }
                    queues[i].push_back(Queued::Frame(produced[i]));
                    produced[i] += 1;
                    report.max_queue = report.max_queue.max(queues[i].len());
                    push(&mut queue, &mut events, now + d.interval, Ev::Source(i));
                } else if produced[i] == d.frames {
                    queues[i].push_back(Queued::End);
                    produced[i] += 1;
                }
            }
            Ev::Placed {
                conn: c,
                block,
                bytes,
            } => {
                if c == region_id {
                    assert_eq!(
                        statuses[block],
                        status::EMPTY,
                        "at {now:?}: sender wrote block {block} while its status byte was {}",
                        statuses[block]
                    );
                    blocks[block] = bytes;
                    statuses[block] = status::FULL;
                }
            }
            Ev::WriteDone { conn: c, wr_id } => {
                if c == conn {
                    machine.handle_write_completed(wr_id);
                }
            }
            Ev::ReadSnapshot { conn: c, wr_id } => {
                if c == conn {
                    let snapshot = statuses.clone();
                    push(
                        &mut queue,
                        &mut events,
                        now + cfg.read_latency / 2,
                        Ev::ReadDone {
                            conn: c,
                            wr_id,
                            snapshot,
                        },
                    );
                }
            }
            Ev::ReadDone {
                conn: c,
                wr_id,
                snapshot,
            } => {
                if c == conn {
                    machine.handle_sync_completed(at(now), wr_id, &snapshot);
                }
            }
            Ev::Wake => wake_at = None,
            Ev::Poll => {
                if !busy {
                    let full: Vec<usize> = (0..cfg.remote_blocks)
                        .filter(|&j| statuses[j] == status::FULL)
                        .collect();
                    let pick = if full.is_empty() {
                        None
                    } else if cfg.random_order {
                        Some(full[(rng.next() % full.len() as u64) as usize])
                    } else {
                        (0..cfg.remote_blocks)
                            .map(|k| (cursor + k) % cfg.remote_blocks)
                            .find(|j| full.contains(j))
                    };
                    match pick {
                        Some(j) => {
                            cursor = (j + 1) % cfg.remote_blocks;
                            busy = true;
                            push(
                                &mut queue,
                                &mut events,
                                now + cfg.process_time,
                                Ev::Processed {
                                    block: j,
                                    region: region_id,
                                },
                            );
                        }
                        None => push(&mut queue, &mut events, now + cfg.poll_interval, Ev::Poll),
                    }
                }
            }
            Ev::Processed { block, region } => {
                busy = false;
                if region == region_id {
                    deliver(
                        &mut streams,
                        &mut report,
                        cfg.reorder,
                        at(now),
                        &blocks[block],
                    );
                    statuses[block] = if retained_now.contains(&block) {
                        status::RETAINED
                    } else {
                        status::EMPTY
                    };
                }
                push(&mut queue, &mut events, now, Ev::Poll);
            }
            Ev::RetainStart(j) => {
                // The receiver may only retain a block it holds (1 → 2 when processed), or one the
                // sender has not synced yet (a fresh region): turning a 0 into 2 could race with a
                // write the sender already decided from its cache.
                retained_now.push(j);
                if now == Duration::ZERO && statuses[j] == status::EMPTY {
                    statuses[j] = status::RETAINED;
                }
            }
            Ev::RetainEnd(j) => {
                retained_now.retain(|&b| b != j);
                if statuses[j] == status::RETAINED {
                    statuses[j] = status::EMPTY;
                }
            }
            Ev::Disconnect => {
                // The receiver finishes the full blocks of the old region, then frees it; work in
                // flight is lost (or was placed without its completion arriving) and is resent.
                for k in 0..cfg.remote_blocks {
                    let j = (cursor + k) % cfg.remote_blocks;
                    if statuses[j] == status::FULL {
                        deliver(&mut streams, &mut report, cfg.reorder, at(now), &blocks[j]);
                    }
                }
                busy = false;
                machine.handle_disconnected();
                conn += 1;
                region_id = conn;
                statuses = vec![status::EMPTY; cfg.remote_blocks];
                for j in &retained_now {
                    statuses[*j] = status::RETAINED;
                }
                machine.handle_connected(layout);
            }
        }

        // Filling thread: one message at a time, blocks as they become free.
        loop {
            if filling.is_none() {
                let n = cfg.devices.len();
                let next = (0..n)
                    .map(|k| (rr_device + k) % n)
                    .find(|&i| !queues[i].is_empty());
                let Some(i) = next else { break };
                rr_device = (i + 1) % n;
                let d = &cfg.devices[i];
                let (kind, index, data) = match queues[i].pop_front().expect("not empty") {
                    Queued::Frame(f) => {
                        (MessageKind::Frame, Some(f), payload(d.id, f, d.frame_len))
                    }
                    Queued::End => (MessageKind::EndOfStream, None, Vec::new()),
                };
                let hs = numbering[i]
                    .plan(
                        d.id,
                        kind,
                        index,
                        data.len(),
                        cfg.block_size,
                        MessageTimes::at(now.as_nanos() as u64),
                    )
                    .expect("fits");
                filling = Some((hs.into_iter().enumerate().collect(), data));
            }
            let Some((headers, data)) = filling.as_mut() else {
                break;
            };
            let Some(b) = free.front().copied() else {
                break;
            };
            let Some((k, h)) = headers.pop_front() else {
                filling = None;
                continue;
            };
            free.pop_front();
            let used = h.encode_block(
                &data[fragment_range(k, data.len(), cfg.block_size)],
                &mut send_mem[b],
            );
            machine.handle_filled(b, used, crate::proto::Delivery::Unconfirmed);
        }

        // Sending thread.
        while let Some(a) = machine.poll_action(at(now)) {
            match a {
                Action::Write {
                    wr_id,
                    send_block,
                    remote_block,
                    len,
                } => {
                    let bytes = send_mem[send_block][..len].to_vec();
                    let placed = now + cfg.write_latency;
                    push(
                        &mut queue,
                        &mut events,
                        placed,
                        Ev::Placed {
                            conn,
                            block: remote_block,
                            bytes,
                        },
                    );
                    push(
                        &mut queue,
                        &mut events,
                        placed + cfg.ack_latency,
                        Ev::WriteDone { conn, wr_id },
                    );
                }
                Action::Sync { wr_id } => {
                    push(
                        &mut queue,
                        &mut events,
                        now + cfg.read_latency / 2,
                        Ev::ReadSnapshot { conn, wr_id },
                    );
                }
            }
        }
        while let Some(b) = machine.poll_freed() {
            free.push_back(b);
        }
        if let Some(t) = machine.poll_timeout() {
            let due = now + t.saturating_duration_since(at(now));
            if wake_at != Some(due) {
                wake_at = Some(due);
                push(&mut queue, &mut events, due, Ev::Wake);
            }
        }
        report.finished_at = now;
        if report.ended.len() == cfg.devices.len() {
            break;
        }
    }
    let stats = machine.stats();
    report.syncs = stats.syncs;
    report.retained_skipped = stats.retained_skipped;
    for (_, s) in &streams {
        report.gap_packets += s.stats().gap_packets;
        report.duplicates += s.stats().duplicates;
        report.reordered += s.stats().reordered;
    }
    report
}
