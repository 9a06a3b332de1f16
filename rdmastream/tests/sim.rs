//! Deterministic simulator tests of the protocol core (no threads, no sleeps). Every run also
//! asserts, inside the simulator, that no block is ever written while its status byte is not 0.

use std::time::Duration;

use rdmastream::sim::{Retention, SimConfig, SimDevice, SimPolicy, SimReport, payload, run};

fn dev(id: u8, frame_len: usize, frames: u64, interval_us: u64) -> SimDevice {
    SimDevice {
        id,
        frame_len,
        frames,
        interval: Duration::from_micros(interval_us),
        first_packet: 0,
    }
}

const LIMIT: Duration = Duration::from_secs(30);

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

#[test]
fn packet_numbers_wrap_past_65535_in_order() {
    let mut d0 = dev(0, 700, 300, 10); // 3 blocks per frame
    d0.first_packet = 65000;
    let mut d1 = dev(1, 50, 300, 10);
    d1.first_packet = 65500;
    let cfg = SimConfig {
        devices: vec![d0, d1],
        ..Default::default()
    };
    let r = run(&cfg, LIMIT);
    assert_complete(&cfg, &r);
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
        r.duplicates > 0,
        "some chains were placed but not acknowledged before a drop"
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
