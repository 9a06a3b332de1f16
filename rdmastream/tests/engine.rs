//! End-to-end through the real threads: sources → filling → sending → transport → polling →
//! reorder → directory sink, over `mem` and over `tcp` on loopback.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use rdmastream::engine::{
    DropPolicy, ReceiverHandle, ReceiverOptions, SenderHandle, SenderOptions,
};
use rdmastream::proto::status;
use rdmastream::sink::{DirectorySink, DirectorySinkOptions};
use rdmastream::source::{Producer, SourceKind};
use rdmastream::stats::get;
use rdmastream::transport::mem::MemFabric;
use rdmastream::transport::tcp::{TcpConnector, TcpListenerTransport};
use rdmastream::transport::{Connector, Listener, RegionSettings};

fn settings(blocks: usize, block_size: usize, reserved: Vec<usize>) -> RegionSettings {
    RegionSettings {
        blocks,
        block_size,
        token: "t0k".into(),
        reserved_blocks: reserved,
    }
}

fn wait_until(deadline: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + deadline;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}

/// Streams `frames` frames from a small camera and a radar, checks every frame arrived
/// verified, in order, and nothing was dropped.
fn run_session(
    listener: Box<dyn Listener>,
    connector: Box<dyn Connector>,
    block_size: usize,
    frames: u64,
) {
    let dir = tempfile::tempdir().unwrap();
    let sink = Arc::new(
        DirectorySink::new(DirectorySinkOptions {
            out: dir.path().to_path_buf(),
            default: Default::default(),
            devices: Default::default(),
            verify: true,
            writers: 2,
            queue: 8,
        })
        .unwrap(),
    );
    let receiver = ReceiverHandle::start(ReceiverOptions::default(), listener, sink).unwrap();
    let opts = SenderOptions {
        name: "edge-a".into(),
        token: "t0k".into(),
        send_blocks: 4,
        block_size,
        ..Default::default()
    };
    let sender = SenderHandle::start(opts, connector, 4).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for (device, kind) in [
        (
            3u8,
            SourceKind::CameraSynthetic {
                width: 64,
                height: 48,
                fps: 500.0,
            },
        ),
        (
            200u8,
            SourceKind::RadarSynthetic {
                size: 10_000,
                rate: 500.0,
            },
        ),
    ] {
        let input = sender.add_device(device, DropPolicy::Block);
        let producer = Producer::new(device, &kind).unwrap();
        let stop = stop.clone();
        threads.push(std::thread::spawn(move || {
            producer.run(&stop, Some(frames), |f| input.push(f));
            input.end();
        }));
    }
    for t in threads {
        t.join().unwrap();
    }
    let report = sender.finish(Duration::from_secs(20)).unwrap();
    assert_eq!(report.unsent, 0);
    assert!(
        wait_until(Duration::from_secs(20), || receiver.all_senders_ended()),
        "receiver never saw both streams end"
    );
    let counters = receiver.counters().all();
    let reorder = receiver.reorder_stats();
    let invalid = receiver.invalid().total();
    receiver.stop();
    assert_eq!(invalid, 0);
    assert_eq!(counters.len(), 2);
    for (key, c) in counters {
        assert_eq!(get(&c.frames), frames, "{key}");
        assert_eq!(get(&c.verified), frames, "{key}");
        assert_eq!(get(&c.mismatched), 0, "{key}");
        assert_eq!(get(&c.gaps), 0, "{key}");
    }
    for (key, r) in reorder {
        assert_eq!(
            r.gap_packets + r.duplicates + r.partial_messages,
            0,
            "{key}: {r:?}"
        );
    }
    let files = std::fs::read_dir(dir.path().join("edge-a/device-003"))
        .unwrap()
        .count();
    assert_eq!(files as u64, frames);
    let first = std::fs::read(dir.path().join("edge-a/device-200/00000000.raw")).unwrap();
    assert_eq!(first.len(), 10_000);
    let _ = status::EMPTY;
}

#[test]
fn mem_transport_delivers_every_frame_verified() {
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(4, 4096, vec![]));
    // 64×48×3 = 9216 bytes: each camera frame spans 3 blocks.
    run_session(
        Box::new(listener),
        Box::new(fabric.connector("rx")),
        4096,
        60,
    );
}

#[test]
fn tcp_transport_delivers_every_frame_verified_with_a_retained_block() {
    let listener = TcpListenerTransport::bind("127.0.0.1:0", settings(6, 16384, vec![2])).unwrap();
    let addr = listener.local_addr();
    run_session(
        Box::new(listener),
        Box::new(TcpConnector::new(addr)),
        16384,
        60,
    );
}
