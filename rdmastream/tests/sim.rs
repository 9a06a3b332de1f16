//! Deterministic simulator tests of the protocol core (no threads, no sleeps). Every run also
//! asserts, inside the simulator, that no block is ever written while its status byte is not 0.

use std::time::Duration;

use rdmastream::proto::{HEADER_LEN, Placement};
use rdmastream::sim::{
    Pair, Retention, SimConfig, SimDevice, SimMechanism, SimPolicy, SimReport, payload, run,
};

fn dev(id: u8, frame_len: usize, frames: u64, interval_us: u64) -> SimDevice {
    SimDevice::new(id, frame_len, frames, Duration::from_micros(interval_us))
}

const LIMIT: Duration = Duration::from_secs(30);

/// The frames (index, payload) delivered for `device`, in delivery order.
fn delivered_by(r: &SimReport, device: u8) -> Vec<(u64, Vec<u8>)> {
    r.delivered
        .iter()
        .filter(|(id, _, _)| *id == device)
        .map(|(_, f, data)| (*f, data.clone()))
        .collect()
}

/// Every device: frames delivered exactly once, in order, bit-exact; then end of stream.
fn assert_complete(cfg: &SimConfig, r: &SimReport) {
    for d in &cfg.devices {
        let got: Vec<_> = r
            .delivered
            .iter()
            .filter(|(id, _, _)| *id == d.id)
            .collect();
        let indices: Vec<u64> = got.iter().map(|(_, f, _)| *f).collect();
        let want: Vec<u64> = (0..d.frames).collect();
        assert_eq!(
            indices, want,
            "device {} frames out of order, missing or repeated",
            d.id
        );
        for (_, f, data) in got {
            assert_eq!(
                data,
                &payload(d.id, *f, d.frame_len),
                "device {} frame {f} corrupted",
                d.id
            );
        }
        assert!(r.ended.contains(&d.id), "device {} never ended", d.id);
    }
    assert_eq!(r.gap_packets, 0);
}

#[test]
fn fill_send_sync_delivers_everything_in_order() {
    let cfg = SimConfig {
        devices: vec![
            dev(0, 100, 200, 10),
            dev(1, 150, 200, 13),
            dev(2, 10, 300, 7),
        ],
        ..Default::default()
    };
    let r = run(&cfg, LIMIT);
    assert_complete(&cfg, &r);
    assert!(
        r.syncs > 10,
        "the sender must have synced when the cache ran out ({} syncs)",
        r.syncs
    );
}

#[test]
fn retained_blocks_are_skipped_without_stalling() {
    let mut cfg = SimConfig {
        remote_blocks: 5,
        devices: vec![dev(0, 100, 400, 10), dev(1, 100, 400, 10)],
        retentions: vec![
            Retention {
                block: 1,
                from: Duration::ZERO,
                until: Duration::from_secs(1),
            },
            Retention {
                block: 3,
                from: Duration::from_micros(500),
                until: Duration::from_secs(1),
            },
        ],
        ..Default::default()
    };
    let r = run(&cfg, LIMIT);
    assert_complete(&cfg, &r);
    assert!(r.retained_skipped > 0, "retained blocks were never met");
    // Not stalled: everything was delivered long before the retained blocks came back.
    assert!(
        r.finished_at < Duration::from_millis(50),
        "finished at {:?}",
        r.finished_at
    );
    // Without the retention the same run must take about as long (skipping costs nothing).
    cfg.retentions.clear();
    let free = run(&cfg, LIMIT);
    assert!(
        r.finished_at < free.finished_at * 2,
        "{:?} vs {:?}",
        r.finished_at,
        free.finished_at
    );
}

/// The paper's Figure 1d, on the same workload for both mechanisms: the receiver holds block 1
/// from 1 ms to 3 ms. The sliding window writes round to it, cannot move its head past it, and
/// writes nothing more until it is released; the status-byte mechanism reads status 2, skips it
/// and keeps using the other blocks.
#[test]
fn a_held_block_stalls_the_sliding_window_but_not_the_status_bytes() {
    let hold = Retention {
        block: 1,
        from: Duration::from_millis(1),
        until: Duration::from_millis(3),
    };
    let status_byte = SimConfig {
        remote_blocks: 5,
        // More send blocks than ring blocks: the window fills before the sender runs out of
        // send blocks (lossless messages keep theirs until released).
        send_blocks: 8,
        devices: vec![dev(0, 100, 500, 10), dev(1, 100, 500, 10)],
        retentions: vec![hold],
        ..Default::default()
    };
    let window = SimConfig {
        mechanism: SimMechanism::SlidingWindow,
        ..status_byte.clone()
    };
    let sb = run(&status_byte, LIMIT);
    let sw = run(&window, LIMIT);
    assert_complete(&status_byte, &sb);
    assert_complete(&window, &sw);
    // Placements while the block is held, once the window had time to go round the ring of 5
    // (a block every few microseconds: well under 100 µs).
    let held_from = hold.from + Duration::from_micros(100);
    let during = |r: &SimReport| {
        r.placed
            .iter()
            .filter(|(t, _)| *t >= held_from && *t < hold.until)
            .count()
    };
    let after = |r: &SimReport| r.placed.iter().filter(|(t, _)| *t >= hold.until).count();
    eprintln!(
        "status byte: {} placed while held, finished at {:?}; sliding window: {} placed while held, {} after, finished at {:?}, window full {} times",
        during(&sb),
        sb.finished_at,
        during(&sw),
        after(&sw),
        sw.finished_at,
        sw.window_full
    );
    assert_eq!(during(&sw), 0, "the window wrote while its head was held");
    assert!(sw.window_full > 0);
    assert!(after(&sw) > 0, "the window never resumed after the release");
    assert!(
        during(&sb) > 100,
        "the status-byte mechanism stalled: {} blocks placed while block 1 was held",
        during(&sb)
    );
    assert!(
        sb.placed
            .iter()
            .all(|(t, b)| *b != hold.block || *t < held_from || *t >= hold.until),
        "the status-byte sender wrote the retained block"
    );
    assert!(sb.retained_skipped > 0);
    // Without the hold the window runs like the status bytes: the stall is the held block's.
    let free = run(
        &SimConfig {
            retentions: Vec::new(),
            ..window.clone()
        },
        LIMIT,
    );
    assert_complete(&window, &free);
    assert!(during(&free) > 100, "{} placed", during(&free));
}

#[test]
fn packet_numbers_wrap_past_65535_in_order() {
    // Both devices wrap: device 0 after ~79 frames of 3 blocks, device 1 after ~235 frames.
    let cfg = SimConfig {
        first_packet: 65300,
        devices: vec![dev(0, 700, 300, 10), dev(1, 50, 300, 10)],
        ..Default::default()
    };
    let r = run(&cfg, LIMIT);
    assert_complete(&cfg, &r);
}

/// The sliding window delivers a multi-device, multi-block workload whole and in order, with
/// lossless messages acknowledged only once handed on.
#[test]
fn the_sliding_window_delivers_everything_in_order() {
    for policy in [SimPolicy::Block, SimPolicy::DropOldest] {
        let cfg = SimConfig {
            mechanism: SimMechanism::SlidingWindow,
            remote_blocks: 8,
            send_blocks: 6,
            max_outstanding: 4,
            policy,
            queue_depth: 1000,
            devices: (0..4)
                .map(|i| dev(i * 3, 50 + 300 * i as usize, 150, 5 + i as u64))
                .collect(),
            ..Default::default()
        };
        let r = run(&cfg, LIMIT);
        assert_complete(&cfg, &r);
        assert_eq!(r.dropped, 0);
        // The run ends when the last frame is delivered; at most a ring's ACKs are on their way.
        assert!(r.acks as usize + cfg.remote_blocks >= r.placed.len());
    }
}

#[test]
fn interleaved_devices_with_multi_block_frames_and_random_receiver_order() {
    let cfg = SimConfig {
        remote_blocks: 8,
        send_blocks: 6,
        max_outstanding: 4,
        random_order: true,
        seed: 7,
        devices: (0..6)
            .map(|i| dev(i * 40, 50 + 300 * i as usize, 120, 5 + i as u64))
            .collect(),
        ..Default::default()
    };
    let r = run(&cfg, LIMIT);
    assert_complete(&cfg, &r);
    assert!(
        r.reordered > 0,
        "random receiver order should have needed reordering"
    );
}

#[test]
fn long_write_delay_with_many_outstanding_chains() {
    let cfg = SimConfig {
        remote_blocks: 16,
        send_blocks: 12,
        max_outstanding: 8,
        write_latency: Duration::from_micros(200),
        ack_latency: Duration::from_micros(100),
        read_latency: Duration::from_micros(300),
        devices: vec![dev(5, 1000, 200, 20), dev(6, 64, 200, 20)],
        ..Default::default()
    };
    let r = run(&cfg, LIMIT);
    assert_complete(&cfg, &r);
}

#[test]
fn slow_receiver_with_drop_oldest_drops_counted_and_stays_bounded() {
    let cfg = SimConfig {
        process_time: Duration::from_micros(100),
        policy: SimPolicy::DropOldest,
        queue_depth: 3,
        devices: vec![dev(0, 100, 500, 20), dev(1, 100, 500, 20)],
        ..Default::default()
    };
    let r = run(&cfg, LIMIT);
    assert!(
        r.dropped > 100,
        "a receiver 2.5x too slow must cause drops ({} dropped)",
        r.dropped
    );
    assert!(r.max_queue <= 3, "queue grew to {}", r.max_queue);
    for d in &cfg.devices {
        let idx: Vec<u64> = r
            .delivered
            .iter()
            .filter(|x| x.0 == d.id)
            .map(|x| x.1)
            .collect();
        assert!(
            idx.windows(2).all(|w| w[0] < w[1]),
            "device {} out of order",
            d.id
        );
        for (id, f, data) in r.delivered.iter().filter(|x| x.0 == d.id) {
            assert_eq!(data, &payload(*id, *f, d.frame_len));
        }
        // What the source queue says it dropped (counted where it drops), not a difference.
        let dropped = r.dropped_by_device.get(&d.id).copied().unwrap_or(0);
        assert_eq!(
            idx.len() as u64 + dropped,
            d.frames,
            "device {}: delivered + dropped != produced",
            d.id
        );
    }
}

#[test]
fn slow_receiver_with_block_policy_loses_nothing() {
    let cfg = SimConfig {
        process_time: Duration::from_micros(100),
        policy: SimPolicy::Block,
        queue_depth: 3,
        devices: vec![dev(0, 100, 300, 20), dev(1, 100, 300, 20)],
        ..Default::default()
    };
    let r = run(&cfg, LIMIT);
    assert_eq!(r.dropped, 0);
    assert!(r.max_queue <= 3);
    assert_complete(&cfg, &r);
}

#[test]
fn dropped_connections_resend_in_flight_work_without_duplicates() {
    let cfg = SimConfig {
        remote_blocks: 6,
        send_blocks: 5,
        max_outstanding: 3,
        write_latency: Duration::from_micros(30),
        ack_latency: Duration::from_micros(30),
        // Irregular times, so some drops fall between a placement and its completion.
        disconnects: (1..40)
            .map(|k| Duration::from_micros(k * 997 + (k * k * 37) % 61))
            .collect(),
        devices: vec![dev(0, 300, 400, 10), dev(9, 40, 400, 10)],
        ..Default::default()
    };
    let r = run(&cfg, LIMIT);
    assert_complete(&cfg, &r);
    assert!(
        r.redelivered > 0,
        "some messages were handed on but not yet confirmed at a drop: sent again, recognised by \
         index and not written twice"
    );
}

#[test]
fn sync_is_not_overtaken_by_slow_writes() {
    // READs complete much faster than WRITEs are placed: a sync posted while writes are
    // outstanding would read their blocks as still free and overwrite them.
    let cfg = SimConfig {
        remote_blocks: 2,
        send_blocks: 6,
        max_outstanding: 4,
        write_latency: Duration::from_micros(200),
        read_latency: Duration::from_micros(10),
        process_time: Duration::from_micros(50),
        devices: vec![dev(0, 100, 100, 10), dev(1, 100, 100, 10)],
        ..Default::default()
    };
    let r = run(&cfg, LIMIT);
    assert_complete(&cfg, &r);
}

/// The same with early syncs: writes posted while a sync is on its way are placed after it read
/// their status bytes (it reads them 0), and must not be written again before a later sync.
/// (Without the rule that keeps them FULL in the cache, this fails on the simulator's check that
/// no block is written while its status byte is not 0.)
#[test]
fn writes_during_an_early_sync_are_not_overwritten() {
    let cfg = SimConfig {
        remote_blocks: 8,
        block_size: 1 << 20,
        send_blocks: 24,
        max_outstanding: 8,
        write_latency: Duration::from_micros(200),
        read_latency: Duration::from_micros(10),
        process_time: Duration::from_micros(20),
        devices: vec![dev(0, 100, 400, 10), dev(1, 3000, 200, 20)],
        ..Default::default()
    };
    let r = run(&cfg, LIMIT);
    assert_complete(&cfg, &r);
    assert!(r.early_syncs > 10, "{} early syncs", r.early_syncs);
}

#[test]
fn formats_go_ahead_of_their_frames_across_changes_and_reconnects() {
    let mut d0 = dev(0, 300, 300, 10);
    d0.format_every = 40;
    let mut d1 = dev(1, 40, 300, 10);
    d1.format_every = 7;
    let cfg = SimConfig {
        remote_blocks: 6,
        send_blocks: 5,
        max_outstanding: 3,
        disconnects: (1..12).map(|k| Duration::from_micros(k * 811)).collect(),
        devices: vec![d0, d1],
        ..Default::default()
    };
    let r = run(&cfg, LIMIT);
    assert_complete(&cfg, &r);
    for ((device, index, _), format) in r.delivered.iter().zip(&r.formats) {
        let d = cfg.devices.iter().find(|d| d.id == *device).unwrap();
        assert_eq!(
            format.as_deref(),
            Some(d.format_of(*index).as_str()),
            "device {device} frame {index} was handed on under the wrong format"
        );
    }
}

#[test]
fn a_returning_device_number_carries_on_after_its_previous_stream() {
    let first = dev(3, 100, 40, 10);
    // Added while the first stream still streams: waits for its end.
    let mut second = dev(3, 100, 30, 10);
    second.start = Duration::from_micros(100);
    // Added long after the second ended.
    let mut third = dev(3, 100, 20, 10);
    third.start = Duration::from_millis(50);
    let cfg = SimConfig {
        devices: vec![first, second, third, dev(4, 50, 100, 10)],
        ..Default::default()
    };
    let r = run(&cfg, LIMIT);
    let got: Vec<u64> = r
        .delivered
        .iter()
        .filter(|(d, _, _)| *d == 3)
        .map(|(_, f, _)| *f)
        .collect();
    let want: Vec<u64> = (0..40).chain(0..30).chain(0..20).collect();
    assert_eq!(got, want, "three streams, one after the other");
    assert_eq!(r.ended.iter().filter(|&&d| d == 3).count(), 3);
    assert_eq!(r.ended.iter().filter(|&&d| d == 4).count(), 1);
    assert_eq!(
        (r.duplicates, r.gap_packets),
        (0, 0),
        "numbering carried on: nothing taken for a duplicate, nothing missing"
    );
}

#[test]
fn a_corrupted_block_is_rejected_and_its_packet_given_up_at_the_reorder_timeout() {
    let timeout = Duration::from_millis(5);
    let cfg = SimConfig {
        // Write 0 is device 0's format, write k its frame k-1: frame 9 arrives corrupted.
        corrupt_writes: vec![10],
        policy: SimPolicy::DropOldest,
        queue_depth: 1000,
        reorder: rdmastream::proto::ReorderConfig {
            window: 64,
            timeout,
        },
        devices: vec![dev(0, 100, 40, 10)],
        ..Default::default()
    };
    let mut pair = Pair::new(&cfg);
    let mut rejected_by = None;
    let mut next_at = None;
    while pair.step() {
        let r = pair.report();
        if r.invalid == 1 && rejected_by.is_none() {
            rejected_by = Some(pair.now());
        }
        if next_at.is_none() && r.delivered.iter().any(|(_, f, _)| *f == 10) {
            next_at = Some(pair.now());
        }
        if pair.is_done() {
            break;
        }
    }
    let r = pair.into_report();
    let indices: Vec<u64> = r.delivered.iter().map(|(_, f, _)| *f).collect();
    let want: Vec<u64> = (0..40).filter(|&f| f != 9).collect();
    assert_eq!(indices, want);
    assert_eq!((r.invalid, r.gap_packets), (1, 1));
    let waited = next_at.unwrap() - rejected_by.unwrap();
    assert!(
        waited >= timeout && waited < timeout * 2,
        "frame 10 waited {waited:?} for the missing packet (timeout {timeout:?})"
    );
}

#[test]
fn live_devices_across_drops_lose_at_most_what_was_held_and_never_reorder() {
    let cfg = SimConfig {
        remote_blocks: 6,
        send_blocks: 5,
        max_outstanding: 3,
        write_latency: Duration::from_micros(30),
        ack_latency: Duration::from_micros(30),
        policy: SimPolicy::DropOldest,
        queue_depth: 8,
        disconnects: (1..20).map(|k| Duration::from_micros(k * 997)).collect(),
        devices: vec![dev(0, 300, 400, 10), dev(9, 40, 400, 10)],
        ..Default::default()
    };
    let r = run(&cfg, LIMIT);
    for d in &cfg.devices {
        let got: Vec<&(u8, u64, Vec<u8>)> = r
            .delivered
            .iter()
            .filter(|(id, _, _)| *id == d.id)
            .collect();
        assert!(
            got.windows(2).all(|w| w[0].1 < w[1].1),
            "device {}: handed on out of order or twice",
            d.id
        );
        for (_, f, data) in got {
            assert_eq!(data, &payload(d.id, *f, d.frame_len));
        }
    }
    // A reconnect restarts each stream: a live device loses what the receiver held in its reorder
    // buffer (at most a window) and what was in flight. Its end of stream can be among them (it
    // is not sent again), so it is not asserted here; block devices lose nothing (above).
    let lost = 800 - r.delivered.len() as u64 - r.dropped;
    let window = cfg.reorder.window as u64;
    assert!(
        lost <= 19 * (window + cfg.max_outstanding as u64),
        "{lost} frames lost in 19 drops"
    );
    assert!(lost > 0, "the drops cost a live device something ({lost})");
}

#[test]
fn a_pair_steps_one_event_at_a_time_and_stops_when_done() {
    let cfg = SimConfig {
        devices: vec![dev(0, 10, 3, 10)],
        ..Default::default()
    };
    let mut pair = Pair::new(&cfg);
    assert_eq!(pair.now(), Duration::ZERO);
    let mut steps = 0;
    let mut last = Duration::ZERO;
    while !pair.is_done() {
        assert!(pair.step(), "events remain until the stream is delivered");
        assert!(pair.now() >= last, "time never goes back");
        last = pair.now();
        steps += 1;
    }
    assert!(steps > 3);
    assert_eq!(pair.report().delivered.len(), 3);
    assert_eq!(pair.report().ended, vec![0]);
}

/// Small lossy messages of several devices, produced together, with coalescing on.
fn coalescing(devices: Vec<SimDevice>, wait_us: u64) -> SimConfig {
    SimConfig {
        remote_blocks: 6,
        send_blocks: 4,
        policy: SimPolicy::DropOldest,
        queue_depth: 100_000,
        coalesce_wait: Duration::from_micros(wait_us),
        devices,
        ..Default::default()
    }
}

#[test]
fn coalesced_small_messages_of_mixed_devices_wrap_packet_numbers_in_order() {
    let cfg = SimConfig {
        first_packet: 65400,
        ..coalescing(
            vec![dev(0, 20, 400, 3), dev(7, 33, 400, 3), dev(200, 1, 400, 4)],
            50,
        )
    };
    let r = run(&cfg, LIMIT);
    assert_complete(&cfg, &r);
    assert_eq!(r.dropped, 0);
    assert!(
        r.coalesced_blocks > 50 && r.coalesced_messages > 2 * r.coalesced_blocks,
        "{} coalesced blocks with {} messages",
        r.coalesced_blocks,
        r.coalesced_messages
    );
    assert_eq!(r.invalid, 0);
}

#[test]
fn coalesced_blocks_next_to_fragmented_frames_with_random_receiver_order() {
    let cfg = SimConfig {
        remote_blocks: 8,
        random_order: true,
        seed: 11,
        first_packet: 65500,
        ..coalescing(
            vec![
                dev(0, 10, 300, 5),
                dev(1, 700, 100, 15), // 3 blocks per frame
                dev(2, 40, 300, 5),
                dev(3, 190, 150, 10), // one whole block: too large to share
            ],
            30,
        )
    };
    let r = run(&cfg, LIMIT);
    assert_complete(&cfg, &r);
    assert_eq!(r.dropped, 0);
    assert!(r.coalesced_blocks > 20, "{} coalesced", r.coalesced_blocks);
    assert!(
        r.reordered > 0,
        "random order should have needed reordering"
    );
}

#[test]
fn the_same_frames_arrive_bit_exact_and_in_order_with_coalescing_on_and_off() {
    let devices = vec![dev(0, 16, 300, 4), dev(1, 500, 100, 12), dev(2, 64, 300, 4)];
    let off = run(&coalescing(devices.clone(), 0), LIMIT);
    let on_cfg = coalescing(devices.clone(), 100);
    let on = run(&on_cfg, LIMIT);
    assert_complete(&on_cfg, &on);
    assert_eq!(off.coalesced_blocks, 0);
    assert!(on.coalesced_blocks > 0);
    for d in &devices {
        assert_eq!(
            delivered_by(&off, d.id),
            delivered_by(&on, d.id),
            "device {} differs",
            d.id
        );
    }
}

#[test]
fn a_corrupted_coalesced_block_is_rejected_whole_and_its_packets_given_up() {
    let timeout = Duration::from_millis(5);
    let cfg = SimConfig {
        // A write well after the formats, while both devices produce together.
        corrupt_writes: vec![30],
        reorder: rdmastream::proto::ReorderConfig {
            window: 256,
            timeout,
        },
        ..coalescing(vec![dev(0, 20, 300, 3), dev(1, 20, 300, 3)], 40)
    };
    let r = run(&cfg, LIMIT);
    assert_eq!(r.invalid, 1, "exactly the corrupted block is rejected");
    assert!(r.coalesced_blocks > 20);
    let mut missing = 0;
    for d in &cfg.devices {
        let got: Vec<_> = r
            .delivered
            .iter()
            .filter(|(id, _, _)| *id == d.id)
            .collect();
        let indices: Vec<u64> = got.iter().map(|(_, f, _)| *f).collect();
        assert!(
            indices.windows(2).all(|w| w[0] < w[1]),
            "device {} out of order",
            d.id
        );
        for (_, f, data) in got {
            assert_eq!(data, &payload(d.id, *f, d.frame_len));
        }
        missing += d.frames - indices.len() as u64;
        assert!(r.ended.contains(&d.id));
    }
    // None of the rejected block's messages was used: each is a gap, and there were several.
    assert!(missing >= 2, "the corrupted block carried {missing} frames");
    assert_eq!(r.gap_packets, missing);
    assert_eq!(r.dropped, 0);
}

#[test]
fn lossless_messages_never_share_a_block() {
    let cfg = SimConfig {
        policy: SimPolicy::Block,
        queue_depth: 4,
        ..coalescing(vec![dev(0, 20, 200, 3), dev(1, 20, 200, 3)], 100)
    };
    let r = run(&cfg, LIMIT);
    assert_complete(&cfg, &r);
    assert_eq!(r.coalesced_blocks, 0);
}

/// The header seal (tcp, shm: the CRC32C covers a block's header only) changes what the
/// receiver checks, not what it gets: multi-block frames of several devices taken in a random
/// order, retained blocks and dropped connections deliver the same frames, bit-exact and in
/// order, as with the whole block sealed (verbs).
#[test]
fn the_header_seal_delivers_the_same_frames_as_the_full_seal() {
    let workloads = [
        SimConfig {
            remote_blocks: 8,
            send_blocks: 6,
            max_outstanding: 4,
            random_order: true,
            seed: 11,
            retentions: vec![Retention {
                block: 2,
                from: Duration::from_micros(200),
                until: Duration::from_millis(3),
            }],
            devices: (0..4)
                .map(|i| dev(i * 7, 60 + 400 * i as usize, 80, 6 + i as u64))
                .collect(),
            ..Default::default()
        },
        SimConfig {
            remote_blocks: 6,
            send_blocks: 5,
            max_outstanding: 3,
            write_latency: Duration::from_micros(30),
            ack_latency: Duration::from_micros(30),
            disconnects: (1..20)
                .map(|k| Duration::from_micros(k * 1013 + (k * k * 41) % 67))
                .collect(),
            devices: vec![dev(1, 500, 200, 10), dev(2, 40, 200, 10)],
            ..Default::default()
        },
    ];
    for cfg in workloads {
        let full = run(&cfg, LIMIT);
        let header = SimConfig {
            placement: Placement::Ordered,
            ..cfg.clone()
        };
        let sealed = run(&header, LIMIT);
        assert_complete(&header, &sealed);
        assert_eq!(sealed.invalid, 0);
        assert_eq!(
            sealed.delivered, full.delivered,
            "the header seal changed what was delivered"
        );
    }
}

/// Under the header seal a torn or corrupted header is still rejected, but the payload is
/// trusted to the transport: a payload byte changed in flight arrives changed. That is why only
/// transports that place a block whole before its status byte use it, and why a verbs receiver
/// refuses a header-sealed block (docs/protocol.md, "Seal by transport").
#[test]
fn the_header_seal_rejects_a_corrupted_header_and_trusts_the_payload() {
    let at = |corrupt_offset: usize| SimConfig {
        // Write 0 is device 0's format, write k its frame k-1: frame 9 arrives corrupted.
        corrupt_writes: vec![10],
        corrupt_offset,
        placement: Placement::Ordered,
        policy: SimPolicy::DropOldest,
        queue_depth: 1000,
        reorder: rdmastream::proto::ReorderConfig {
            window: 64,
            timeout: Duration::from_millis(5),
        },
        devices: vec![dev(0, 100, 40, 10)],
        ..Default::default()
    };
    // A header byte (inside the packet number's field region): the block is rejected.
    let r = run(&at(8), LIMIT);
    let indices: Vec<u64> = r.delivered.iter().map(|(_, f, _)| *f).collect();
    assert_eq!(indices, (0..40).filter(|&f| f != 9).collect::<Vec<_>>());
    assert_eq!((r.invalid, r.gap_packets), (1, 1));
    // The first payload byte: accepted, and frame 9 arrives with that byte changed.
    let r = run(&at(HEADER_LEN), LIMIT);
    assert_eq!(r.invalid, 0);
    assert_eq!(r.delivered.len(), 40);
    let (_, f, data) = &r.delivered[9];
    let mut want = payload(0, 9, 100);
    want[0] ^= 0xff;
    assert_eq!((*f, data), (9, &want));
    // The same payload corruption with the whole block sealed (verbs) is caught.
    let r = run(
        &SimConfig {
            placement: Placement::Unordered,
            ..at(HEADER_LEN)
        },
        LIMIT,
    );
    assert_eq!((r.invalid, r.gap_packets), (1, 1));
}

/// Lossy frames written in place into remote blocks the sender lends (as over shm: a source
/// renders into the receiver's block, then only its status byte is posted) arrive as the same
/// frames, bit-exact and in order, as when every frame goes through a send block, with random
/// receiver order and a retained block; the simulator asserts on every write in place, as on
/// every placement, that the block's status byte was 0.
#[test]
fn frames_written_into_lent_blocks_arrive_as_through_send_blocks() {
    let base = SimConfig {
        remote_blocks: 8,
        send_blocks: 5,
        max_outstanding: 3,
        random_order: true,
        seed: 5,
        placement: Placement::Ordered,
        policy: SimPolicy::DropOldest,
        queue_depth: 10_000,
        retentions: vec![Retention {
            block: 3,
            from: Duration::from_micros(300),
            until: Duration::from_millis(2),
        }],
        // Multi-block frames (device 2) and small ones go around the lent blocks.
        devices: vec![
            dev(1, 200, 150, 40),
            dev(2, 700, 60, 90),
            dev(3, 30, 150, 35),
        ],
        ..Default::default()
    };
    let copied = run(&base, LIMIT);
    assert_complete(&base, &copied);
    assert_eq!(copied.in_place, 0);
    for lend_render in [0, 3, 40] {
        let cfg = SimConfig {
            lend: 3,
            lend_render: Duration::from_micros(lend_render),
            ..base.clone()
        };
        let r = run(&cfg, LIMIT);
        assert_complete(&cfg, &r);
        assert_eq!(r.dropped, 0);
        assert!(r.in_place > 50, "only {} frames went in place", r.in_place);
        assert_eq!(r.stale_in_place, 0);
        for d in &cfg.devices {
            assert_eq!(
                delivered_by(&r, d.id),
                delivered_by(&copied, d.id),
                "device {} differs",
                d.id
            );
        }
    }
}

/// A frame written into a lent block of a connection that drops before its status byte is
/// posted is never delivered (it is counted), never lands in the new connection's memory, and
/// the frames around it still arrive bit-exact, once each, in order.
#[test]
fn frames_written_into_an_old_connections_lent_blocks_are_dropped_not_delivered() {
    let cfg = SimConfig {
        remote_blocks: 6,
        send_blocks: 4,
        max_outstanding: 2,
        placement: Placement::Ordered,
        policy: SimPolicy::DropOldest,
        queue_depth: 10_000,
        lend: 3,
        // Rendering takes a while, so drops fall between lending and placing.
        lend_render: Duration::from_micros(45),
        disconnects: (1..25)
            .map(|k| Duration::from_micros(k * 701 + (k * k * 13) % 59))
            .collect(),
        devices: vec![dev(4, 300, 400, 25), dev(5, 40, 400, 30)],
        ..Default::default()
    };
    let r = run(&cfg, LIMIT);
    assert!(
        r.stale_in_place > 0,
        "no drop fell while a frame was rendered"
    );
    assert!(r.in_place > 100, "only {} frames went in place", r.in_place);
    for d in &cfg.devices {
        let got = delivered_by(&r, d.id);
        assert!(
            got.windows(2).all(|w| w[0].0 < w[1].0),
            "device {}: handed on out of order or twice",
            d.id
        );
        for (f, data) in got {
            assert_eq!(data, payload(d.id, f, d.frame_len));
        }
    }
}

/// With a cache budget (shm's `Connection::cache_budget`) the sender keeps at most that many
/// bytes of the receiver's blocks FULL and writes the lowest-numbered free ones, so a slow
/// receiver's region is worked in a few blocks instead of all of them; lossless devices with a
/// retained block and random receiver order still deliver the same frames, bit-exact and in
/// order, as without one.
#[test]
fn a_cache_budget_keeps_few_remote_blocks_full_and_reuses_the_lowest() {
    let block_size = 256;
    let without = SimConfig {
        remote_blocks: 16,
        block_size,
        send_blocks: 8,
        max_outstanding: 3,
        random_order: true,
        seed: 9,
        // The receiver is the slow side: without a budget its blocks fill up.
        process_time: Duration::from_micros(40),
        placement: Placement::Ordered,
        policy: SimPolicy::Block,
        queue_depth: 10_000,
        retentions: vec![Retention {
            block: 1,
            from: Duration::from_micros(400),
            until: Duration::from_millis(3),
        }],
        devices: vec![
            dev(1, 200, 200, 10),
            dev(2, 700, 60, 30),
            dev(3, 30, 200, 10),
        ],
        ..Default::default()
    };
    let open = run(&without, LIMIT);
    assert_complete(&without, &open);
    assert!(
        open.most_full > 4 && distinct_blocks(&open) == 16,
        "without a budget the receiver should fall behind over all blocks ({} full at most, \
         {} blocks written)",
        open.most_full,
        distinct_blocks(&open)
    );
    let cfg = SimConfig {
        cache_budget: Some(4 * block_size),
        ..without.clone()
    };
    let r = run(&cfg, LIMIT);
    assert_complete(&cfg, &r);
    assert!(r.most_full <= 4, "{} blocks full at once", r.most_full);
    // The four FULL ones and those the receiver holds (status 2: the retention, and blocks of
    // packets it keeps for reordering): never more than half of the region.
    assert!(
        distinct_blocks(&r) <= 8,
        "wrote {} different blocks",
        distinct_blocks(&r)
    );
    for d in &cfg.devices {
        assert_eq!(delivered_by(&r, d.id), delivered_by(&open, d.id));
    }
}

/// Lowest-numbered free block first (tcp's `Connection::writes_lowest_first`), with a receiver
/// that keeps up: the sender works in a few of the receiver's blocks instead of cycling through
/// all of them, and lossless devices with a retained block and random receiver order deliver
/// the same frames, bit-exact and in order, as round-robin.
#[test]
fn lowest_first_works_in_few_blocks_and_delivers_as_round_robin() {
    let round_robin = SimConfig {
        remote_blocks: 16,
        block_size: 256,
        send_blocks: 8,
        max_outstanding: 3,
        random_order: true,
        seed: 11,
        placement: Placement::Ordered,
        policy: SimPolicy::Block,
        queue_depth: 10_000,
        retentions: vec![Retention {
            block: 0,
            from: Duration::from_micros(300),
            until: Duration::from_millis(2),
        }],
        devices: vec![
            dev(1, 200, 200, 10),
            dev(2, 700, 60, 30),
            dev(3, 30, 200, 10),
        ],
        ..Default::default()
    };
    let rr = run(&round_robin, LIMIT);
    assert_complete(&round_robin, &rr);
    let cfg = SimConfig {
        lowest_first: true,
        ..round_robin.clone()
    };
    let r = run(&cfg, LIMIT);
    assert_complete(&cfg, &r);
    assert_eq!(distinct_blocks(&rr), 16, "round-robin writes every block");
    assert!(
        distinct_blocks(&r) <= 8,
        "lowest first wrote {} different blocks",
        distinct_blocks(&r)
    );
    for d in &cfg.devices {
        assert_eq!(delivered_by(&r, d.id), delivered_by(&rr, d.id));
    }
}

/// The remote blocks written, each once.
fn distinct_blocks(r: &SimReport) -> usize {
    let mut blocks: Vec<usize> = r.placed.iter().map(|&(_, j)| j).collect();
    blocks.sort_unstable();
    blocks.dedup();
    blocks.len()
}

/// Frames written in place under a cache budget: at most half of the budget's blocks are lent
/// (queued blocks take the rest), and the frames arrive as through send blocks.
#[test]
fn frames_written_in_place_under_a_cache_budget_arrive_as_without_one() {
    let block_size = 256;
    let without = SimConfig {
        remote_blocks: 16,
        block_size,
        send_blocks: 5,
        max_outstanding: 3,
        random_order: true,
        seed: 5,
        placement: Placement::Ordered,
        policy: SimPolicy::DropOldest,
        queue_depth: 10_000,
        lend: 4,
        devices: vec![
            dev(1, 200, 150, 40),
            dev(2, 700, 60, 90),
            dev(3, 30, 150, 35),
        ],
        ..Default::default()
    };
    let open = run(&without, LIMIT);
    assert_complete(&without, &open);
    let cfg = SimConfig {
        cache_budget: Some(4 * block_size),
        ..without.clone()
    };
    let r = run(&cfg, LIMIT);
    assert_complete(&cfg, &r);
    assert_eq!(r.dropped, 0);
    assert!(r.in_place > 50, "only {} frames went in place", r.in_place);
    assert!(r.most_full <= 4, "{} blocks full at once", r.most_full);
    assert!(
        distinct_blocks(&r) <= 8,
        "wrote {} blocks",
        distinct_blocks(&r)
    );
    for d in &cfg.devices {
        assert_eq!(delivered_by(&r, d.id), delivered_by(&open, d.id));
    }
}
