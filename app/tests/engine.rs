//! End-to-end through the real threads: sources → filling → sending → transport → polling →
//! reorder → directory sink, over `mem`, over `tcp` on loopback and over `shm`.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use rdmastream::engine::{
    DropPolicy, ReceiverHandle, ReceiverOptions, SenderHandle, SenderOptions,
};
use rdmastream::proto::handshake::Key;
use rdmastream::proto::status;
use rdmastream::proto::{BlockError, BlockHeader, Budget, NO_PTS, Placement};
use rdmastream::stats::get;
use rdmastream::transport::mem::MemFabric;
use rdmastream::transport::tcp::{self, TcpConnector};
use rdmastream::transport::{AccessControl, Completion, Connector, Keys, Listener, RegionSettings};
use rdmastream_app::sink::{DirectorySink, DirectorySinkOptions};
use rdmastream_app::source::{Producer, SourceKind};

/// The key every test sender proves it knows, and the receivers require.
fn key() -> Key {
    Key::new(b"engine-test-key-0123".to_vec()).unwrap()
}

fn settings(blocks: usize, block_size: usize, reserved: Vec<usize>) -> RegionSettings {
    RegionSettings {
        blocks,
        block_size,
        reserved_blocks: reserved,
        access: AccessControl::new(Keys::shared(key()), 64, Budget::unlimited()),
        reassembly: 64 << 20,
        peer_timeout: rdmastream::transport::DEFAULT_PEER_TIMEOUT,
        nic_spin: rdmastream::transport::DEFAULT_NIC_SPIN,
        mechanism: Default::default(),
    }
}

use rdmastream_testkit::wait_for as wait_until;

/// Streams `frames` frames from a small camera and a radar, checks every frame arrived
/// verified, in order, and nothing was dropped.
fn run_session(
    listener: Box<dyn Listener>,
    connector: Box<dyn Connector>,
    block_size: usize,
    frames: u64,
) -> rdmastream::engine::SenderReport {
    run_session_with(listener, connector, block_size, frames, false)
}

/// [`run_session`], with the sliding-window baseline when `sliding_window` (the receiver's
/// settings must say so too).
fn run_session_with(
    listener: Box<dyn Listener>,
    connector: Box<dyn Connector>,
    block_size: usize,
    frames: u64,
    sliding_window: bool,
) -> rdmastream::engine::SenderReport {
    let dir = tempfile::tempdir().unwrap();
    let sink = Arc::new(
        DirectorySink::new(DirectorySinkOptions {
            out: dir.path().to_path_buf(),
            default: Default::default(),
            devices: Default::default(),
            verify: true,
            writers: 2,
            queue: 8,
            disk_budget: None,
        })
        .unwrap(),
    );
    let receiver = ReceiverHandle::start(ReceiverOptions::default(), listener, sink).unwrap();
    let opts = SenderOptions {
        name: "edge-a".into(),
        key: Some(key()),
        send_blocks: 4,
        block_size,
        sliding_window,
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
    let report = finish_delivered(sender, &receiver, Duration::from_secs(20));
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
        .filter(|e| {
            !e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with('.')
        })
        .count();
    assert_eq!(files as u64, frames);
    let first = std::fs::read(dir.path().join("edge-a/device-200/00000000.raw")).unwrap();
    assert_eq!(first.len(), 10_000);
    let _ = status::EMPTY;
    report
}

#[test]
fn mem_transport_delivers_every_frame_verified() {
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(4, 4096, vec![]));
    // 64×48×3 = 9216 bytes: each camera frame spans 3 blocks.
    let report = run_session(
        Box::new(listener),
        Box::new(fabric.connector("rx")),
        4096,
        60,
    );
    // Pushed frames in send blocks: the filling thread leaves their copies into the receiver's
    // memory to the sending thread (it copies the next frame meanwhile), over mem as anywhere.
    assert_eq!(report.driven_here, 0, "{report:?}");
}

#[test]
fn tcp_transport_delivers_every_frame_verified_with_a_retained_block() {
    let listener = tcp::listen("127.0.0.1:0", settings(6, 16384, vec![2])).unwrap();
    let addr = listener.local_addr();
    let report = run_session(
        Box::new(listener),
        Box::new(TcpConnector::new(addr)),
        16384,
        60,
    );
    // The tcp transport counts what the status-byte sender posted: a WRITE chain of two work
    // requests per block and one READ per sync, on one completion queue.
    let (m, w) = (report.machine, report.work);
    // Pushed frames go through the filling thread, which leaves their posts to the sending
    // thread (a committing source's frame on an idle link is posted where it was made:
    // `a_frame_committed_on_an_idle_tcp_link_is_posted_by_the_committing_thread`).
    assert_eq!(report.driven_here, 0);
    assert_eq!(w.send_wrs, 2 * m.writes + m.syncs, "{w:?} {m:?}");
    assert_eq!(w.recv_wrs, 0);
    assert_eq!(w.cqs, 1);
    assert!(w.max_send_queue >= 2, "{w:?}");
    assert!(
        w.max_send_queue <= 2 * 4 + 1,
        "at most max_outstanding chains and a READ: {w:?}"
    );
    assert_eq!(w.completions, m.writes + m.syncs);
}

/// The sliding-window baseline through the engine over tcp: the same frames, sources and sink,
/// each device over its own connection; the counts are the baseline's (one WRITE WITH
/// IMMEDIATE and one ACK receive per block, two completion queues per connection).
#[test]
fn tcp_sliding_window_delivers_every_frame_verified() {
    let window = RegionSettings {
        mechanism: rdmastream::proto::handshake::Mechanism::SlidingWindow { device: 0 },
        ..settings(6, 16384, vec![])
    };
    let listener = tcp::listen("127.0.0.1:0", window).unwrap();
    let addr = listener.local_addr();
    let report = run_session_with(
        Box::new(listener),
        Box::new(TcpConnector::new(addr)),
        16384,
        60,
        true,
    );
    let (win, w) = (report.window, report.work);
    assert_eq!(report.connections, 2, "one connection per device");
    assert_eq!(win.writes, win.released, "every block released: {win:?}");
    assert_eq!(w.send_wrs, win.writes, "{w:?}");
    assert_eq!(
        w.recv_wrs,
        2 * 6 + win.acks,
        "a ring of ACK receives per connection: {w:?}"
    );
    assert_eq!(w.cqs, 2 * 2);
    assert_eq!(w.completions, win.writes + win.acks);
}

#[test]
fn shm_transport_delivers_every_frame_verified_with_a_retained_block() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rx.sock");
    let listener = rdmastream_verbs::shm::listen(&path, settings(6, 16384, vec![2])).unwrap();
    let addr = listener.local_addr();
    run_session(
        Box::new(listener),
        Box::new(rdmastream_verbs::shm::ShmConnector::new(&addr).unwrap()),
        16384,
        60,
    );
}

/// Collects events per stream, for tests.
#[derive(Default)]
struct Collect {
    frames: std::sync::Mutex<Vec<(String, u8, u64, usize)>>,
}

impl rdmastream::engine::FrameSink for Collect {
    fn handle(
        &self,
        key: &rdmastream::engine::StreamKey,
        _: u64,
        _: &Arc<rdmastream::stats::DeviceCounters>,
        event: rdmastream::proto::StreamEvent,
    ) {
        // Handed on as soon as it is here: lossless devices' blocks may be freed.
        rdmastream::proto::ack::settle(event.ack());
        if let rdmastream::proto::StreamEvent::Frame(f) = event {
            self.frames.lock().unwrap().push((
                key.sender.clone(),
                key.device,
                f.index,
                f.data.len(),
            ));
        }
    }
}

fn stream_frames(
    sender: &SenderHandle,
    device: u8,
    kind: SourceKind,
    frames: u64,
) -> std::thread::JoinHandle<()> {
    let input = sender.add_device(device, DropPolicy::Block);
    let producer = Producer::new(device, &kind).unwrap();
    std::thread::spawn(move || {
        producer.run(&AtomicBool::new(false), Some(frames), |f| input.push(f));
        input.end();
    })
}

#[test]
fn two_senders_into_one_receiver_each_get_their_own_region_and_output() {
    let listener = tcp::listen("127.0.0.1:0", settings(4, 8192, vec![])).unwrap();
    let addr = listener.local_addr();
    let sink = Arc::new(Collect::default());
    let receiver =
        ReceiverHandle::start(ReceiverOptions::default(), Box::new(listener), sink.clone())
            .unwrap();
    let mut senders = Vec::new();
    for name in ["edge-a", "edge-b"] {
        let opts = SenderOptions {
            name: name.into(),
            key: Some(key()),
            send_blocks: 3,
            block_size: 8192,
            ..Default::default()
        };
        let s = SenderHandle::start(opts, Box::new(TcpConnector::new(addr.clone())), 4).unwrap();
        // Same device number on both senders: output must stay apart.
        let t = stream_frames(
            &s,
            7,
            SourceKind::RadarSynthetic {
                size: 20_000,
                rate: 1000.0,
            },
            40,
        );
        senders.push((s, t));
    }
    for (s, t) in senders {
        t.join().unwrap();
        assert_eq!(s.finish(Duration::from_secs(20)).unwrap().unsent, 0);
    }
    assert!(wait_until(Duration::from_secs(20), || receiver.all_senders_ended()));
    receiver.stop();
    let frames = sink.frames.lock().unwrap();
    for name in ["edge-a", "edge-b"] {
        let idx: Vec<u64> = frames
            .iter()
            .filter(|f| f.0 == name && f.1 == 7)
            .map(|f| f.2)
            .collect();
        assert_eq!(idx, (0..40).collect::<Vec<_>>(), "{name}");
    }
}

#[test]
fn a_wrong_key_is_refused_with_the_reason() {
    let listener = tcp::listen("127.0.0.1:0", settings(4, 8192, vec![])).unwrap();
    let addr = listener.local_addr();
    let receiver = ReceiverHandle::start(
        ReceiverOptions::default(),
        Box::new(listener),
        Arc::new(Collect::default()),
    )
    .unwrap();
    let opts = SenderOptions {
        name: "intruder".into(),
        key: Some(Key::new(b"not-the-engine-test-key".to_vec()).unwrap()),
        block_size: 8192,
        ..Default::default()
    };
    let s = SenderHandle::start(opts, Box::new(TcpConnector::new(addr.clone())), 4).unwrap();
    let input = s.add_device(0, DropPolicy::DropOldest);
    input.end();
    drop(input);
    let err = s.finish(Duration::from_secs(10)).unwrap_err().to_string();
    assert!(
        err.contains("refused") && err.contains("authentication failed") && err.contains(&addr),
        "{err}"
    );
    // The sender gives up after the first refusal; the receiver counted it.
    assert!(
        wait_until(Duration::from_secs(5), || receiver.refused() == 1),
        "refused: {}",
        receiver.refused()
    );
    assert!(receiver.counters().all().is_empty());
}

#[test]
fn images_source_streams_the_shipped_assets() {
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(4, 1 << 16, vec![]));
    let sink = Arc::new(Collect::default());
    let receiver =
        ReceiverHandle::start(ReceiverOptions::default(), Box::new(listener), sink.clone())
            .unwrap();
    let opts = SenderOptions {
        name: "img".into(),
        key: Some(key()),
        block_size: 1 << 16,
        ..Default::default()
    };
    let s = SenderHandle::start(opts, Box::new(fabric.connector("rx")), 4).unwrap();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets");
    let t = stream_frames(
        &s,
        1,
        SourceKind::Images {
            dir,
            width: 64,
            height: 48,
            fps: 500.0,
        },
        6,
    );
    t.join().unwrap();
    s.finish(Duration::from_secs(10)).unwrap();
    assert!(wait_until(Duration::from_secs(10), || receiver.all_senders_ended()));
    receiver.stop();
    let frames = sink.frames.lock().unwrap();
    assert_eq!(frames.len(), 6);
    assert!(frames.iter().all(|f| f.3 == 64 * 48 * 3));
    let missing = Producer::new(
        0,
        &SourceKind::Images {
            dir: "/nonexistent-dir".into(),
            width: 8,
            height: 8,
            fps: 1.0,
        },
    );
    assert!(
        missing
            .err()
            .unwrap()
            .to_string()
            .contains("/nonexistent-dir")
    );
}

/// A block that fails validation (here: garbage with status 1, as a buggy or hostile peer could
/// leave) is counted per kind, freed, and the receiver carries on.
/// The Hello of a hand-made connection named `sender` (tests that write blocks themselves).
fn raw_hello(sender: &str) -> rdmastream::proto::handshake::Hello {
    rdmastream::proto::handshake::Hello {
        version: rdmastream::proto::handshake::PROTOCOL_VERSION,
        sender: sender.into(),
        nonce: [0; 32],
        mechanism: Default::default(),
        session: 9,
        block_size: 0,
        data_path: rdmastream::proto::handshake::DataPath::Tcp,
        qp: Default::default(),
    }
}

/// Writes `data` into remote block `j` (of `block_size` bytes) and sets its status byte to FULL,
/// as one chain: what a sender does, without a sender's checks.
fn write_raw_block(
    conn: &mut dyn rdmastream::transport::Connection,
    j: usize,
    block_size: usize,
    data: &[u8],
) {
    use rdmastream::transport::{RemoteAddr, Target, WriteSource, WriteWr};
    let chain = [
        WriteWr {
            source: WriteSource::Inline(data),
            remote: RemoteAddr {
                target: Target::Blocks,
                offset: (j * block_size) as u64,
            },
            signaled: false,
        },
        WriteWr {
            source: WriteSource::Inline(&[status::FULL]),
            remote: RemoteAddr {
                target: Target::Statuses,
                offset: j as u64,
            },
            signaled: true,
        },
    ];
    conn.post_write_chain(j as u64, &chain).unwrap();
}

/// A receiver over mem whose reorder timeout is `timeout`, with one sender (`name`) that wrote a
/// stream of `device` with a lost packet and hung up: packet 0 starts it with a frame, packet 1
/// is lost, packet 2 ends it. Only the reorder timeout can release the end. Returns the
/// receiver and when the blocks were written.
fn lossy_stream_then_gone(
    name: &str,
    device: u8,
    timeout: Duration,
) -> (ReceiverHandle, std::time::Instant) {
    use rdmastream::proto::header::flags;
    use rdmastream::transport::SendBlocks;
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(4, 256, vec![]));
    let receiver = ReceiverHandle::start(
        ReceiverOptions {
            reorder: rdmastream::proto::ReorderConfig {
                window: 64,
                timeout,
            },
            ..Default::default()
        },
        Box::new(listener),
        Arc::new(Collect::default()),
    )
    .unwrap();
    // The accepting thread is in its wait before anything happens.
    std::thread::sleep(Duration::from_millis(200));
    let blocks = SendBlocks::new(1, 256);
    let mut conn = fabric
        .connector("rx")
        .connect(&raw_hello(name), Some(&key()), &blocks)
        .unwrap();
    let header = |packet: u16, flags: u8, frame_index: u64, len: u32| BlockHeader {
        device,
        packet,
        flags,
        fragment_index: 0,
        fragment_count: 1,
        payload_len: len,
        frame_index,
        timestamp_ns: 0,
        message_len: len,
        duration_ns: 0,
        pts_ns: NO_PTS,
    };
    let written = std::time::Instant::now();
    for (j, h, payload) in [
        (0, header(0, flags::STREAM_START, 0, 3), &b"abc"[..]),
        (1, header(2, flags::END_OF_STREAM, 2, 0), &b""[..]),
    ] {
        let mut block = vec![0u8; 256];
        let used = h.encode_block(payload, &mut block);
        write_raw_block(conn.as_mut(), j, 256, &block[..used]);
    }
    drop(conn);
    (receiver, written)
}

/// An end of stream that waited behind a lost packet is released by the reorder timeout, not by
/// a block: the device still counts as ended, so `--exit-after-eos` can finish.
#[test]
fn an_end_of_stream_released_by_the_reorder_timeout_ends_the_device() {
    let (receiver, _) = lossy_stream_then_gone("lossy", 3, Duration::from_millis(50));
    assert!(
        wait_until(Duration::from_secs(20), || receiver.all_senders_ended()),
        "the device's end of stream did not count"
    );
    assert_eq!(receiver.reorder_stats()[0].1.gap_packets, 1);
}

/// The receiver's accepting thread waits for events, not on a clock (an idle receiver's woke 20
/// times a second): a sender's last disconnection wakes it, and it then wakes again when that
/// sender's next reorder timeout is due. Here the timeout (1 s) falls after the sender is gone,
/// so only the accepting thread can give up the lost packet and release the end of stream; it
/// must do so soon after the timeout, not at its 5 s backstop.
#[test]
fn a_departed_senders_reorder_timeout_is_kept_without_polling() {
    let (receiver, written) = lossy_stream_then_gone("departed", 5, Duration::from_secs(1));
    assert!(
        wait_until(Duration::from_secs(20), || receiver.all_senders_ended()),
        "the end of stream was never released"
    );
    let took = written.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "released {took:?} after the blocks were written (reorder timeout 1 s, backstop 5 s)"
    );
    let started = std::time::Instant::now();
    receiver.stop();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "stop took {:?}",
        started.elapsed()
    );
}

/// An idle receiver stops at once, and counts a refusal as it happens: both end the accepting
/// thread's wait (up to 5 s) instead of waiting it out. Over mem (the fabric rings the waker)
/// and tcp (the listener's channel of refusals).
#[test]
fn an_idle_receiver_counts_refusals_and_stops_without_waiting_out_its_accept_wait() {
    let fabric = MemFabric::new();
    let over_tcp = tcp::listen("127.0.0.1:0", settings(4, 8192, vec![])).unwrap();
    let tcp_addr = over_tcp.local_addr();
    let cases: [Transport; 2] = [
        (
            "mem",
            Box::new(fabric.listen("rx", settings(4, 8192, vec![]))),
            Box::new(fabric.connector("rx")),
        ),
        (
            "tcp",
            Box::new(over_tcp),
            Box::new(TcpConnector::new(tcp_addr)),
        ),
    ];
    for (transport, listener, connector) in cases {
        let receiver = ReceiverHandle::start(
            ReceiverOptions::default(),
            listener,
            Arc::new(Collect::default()),
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let opts = SenderOptions {
            name: "intruder".into(),
            key: Some(Key::new(b"not-the-engine-test-key".to_vec()).unwrap()),
            block_size: 8192,
            ..Default::default()
        };
        let s = SenderHandle::start(opts, connector, 4).unwrap();
        let input = s.add_device(0, DropPolicy::DropOldest);
        input.end();
        drop(input);
        assert!(s.finish(Duration::from_secs(10)).is_err(), "{transport}");
        let refused = std::time::Instant::now();
        assert!(
            wait_until(Duration::from_secs(20), || receiver.refused() == 1),
            "{transport}: refused {}",
            receiver.refused()
        );
        assert!(
            refused.elapsed() < Duration::from_secs(2),
            "{transport}: the refusal was counted {:?} after the sender read it",
            refused.elapsed()
        );
        std::thread::sleep(Duration::from_millis(200));
        let started = std::time::Instant::now();
        receiver.stop();
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{transport}: stop took {:?}",
            started.elapsed()
        );
    }
}

#[test]
fn invalid_blocks_are_counted_freed_and_survived() {
    use rdmastream::transport::{Connector, RemoteAddr, SendBlocks, Target};
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(4, 256, vec![]));
    let sink = Arc::new(Collect::default());
    let receiver = ReceiverHandle::start(
        ReceiverOptions {
            max_device: 10,
            ..Default::default()
        },
        Box::new(listener),
        sink,
    )
    .unwrap();
    let blocks = SendBlocks::new(1, 256);
    blocks.fill(0, |b| b.fill(0xAB));
    let mut conn = fabric
        .connector("rx")
        .connect(&raw_hello("evil"), Some(&key()), &blocks)
        .unwrap();
    // A well-formed block for device 200 (> max_device 10), then garbage, into blocks 0 and 1.
    let h = rdmastream::proto::BlockHeader {
        device: 200,
        packet: 0,
        flags: 0,
        fragment_index: 0,
        fragment_count: 1,
        payload_len: 3,
        frame_index: 0,
        timestamp_ns: 0,
        message_len: 3,
        duration_ns: 0,
        pts_ns: rdmastream::proto::NO_PTS,
    };
    let valid_elsewhere = SendBlocks::new(1, 256);
    let used = valid_elsewhere.fill(0, |b| h.encode_block(b"abc", b));
    for (j, (src, len)) in [(&valid_elsewhere, used), (&blocks, 256)]
        .into_iter()
        .enumerate()
    {
        let data: Vec<u8> = src.read(0, len, |b| b.to_vec());
        write_raw_block(conn.as_mut(), j, 256, &data);
    }
    assert!(wait_until(Duration::from_secs(5), || receiver
        .invalid()
        .total()
        == 2));
    let kinds = receiver.invalid().all();
    assert_eq!(
        kinds.get(&rdmastream::proto::BlockError::DeviceOutOfRange),
        Some(&1),
        "{kinds:?}"
    );
    assert_eq!(
        kinds.get(&rdmastream::proto::BlockError::BadVersion),
        Some(&1),
        "{kinds:?}"
    );
    // Both blocks were freed: a sync sees them empty again.
    conn.post_read(
        9,
        RemoteAddr {
            target: Target::Statuses,
            offset: 0,
        },
        4,
    )
    .unwrap();
    let mut done = Vec::new();
    conn.poll_completions(&mut done, Duration::ZERO).unwrap();
    assert_eq!(
        done.last(),
        Some(&Completion::Read {
            wr_id: 9,
            data: vec![0, 0, 0, 0]
        })
    );
    drop(conn);
    receiver.stop();
}

/// A sink that keeps every frame it gets (as a slow consumer would): blocks handed on without
/// copying stay retained, but the receiver stops retaining at half the region and copies, so the
/// sender is never starved and every frame arrives.
#[test]
fn a_sink_holding_every_frame_does_not_starve_the_sender() {
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(4, 4096, vec![]));
    let (sink, receiver) = hoarding(Box::new(listener));
    let opts = SenderOptions {
        name: "h".into(),
        key: Some(key()),
        send_blocks: 2,
        block_size: 4096,
        ..Default::default()
    };
    let s = SenderHandle::start(opts, Box::new(fabric.connector("rx")), 4).unwrap();
    let t = stream_frames(
        &s,
        0,
        SourceKind::RadarSynthetic {
            size: 1000,
            rate: 2000.0,
        },
        50,
    );
    assert!(
        wait_until(Duration::from_secs(30), || t.is_finished()),
        "sender starved: the source never got rid of its frames"
    );
    assert_eq!(
        s.finish(Duration::from_secs(20)).unwrap().unsent,
        0,
        "sender starved"
    );
    assert!(wait_until(Duration::from_secs(10), || receiver.all_senders_ended()));
    let held = sink.0.lock().unwrap();
    assert_eq!(held.len(), 50);
    for (f, (_, data)) in held.iter().enumerate() {
        let mut want = vec![0; 1000];
        rdmastream_app::source::radar_pattern(0, f as u64, &mut want);
        assert_eq!(&data[..], &want[..], "frame {f}");
    }
    drop(held);
    receiver.stop();
}

/// Over shm, a receiver whose sender's memory share is taken by frames a sink holds waits for
/// memory without spinning: the block that waits is FULL already, so the doorbell's wait would
/// return at once (it did, and the polling thread took a whole core behind a slow downstream).
/// It sleeps as over tcp instead: a few thousand polls a second at most, however slow the host.
#[test]
fn a_shm_receiver_waiting_for_memory_does_not_spin() {
    // Two blocks may stay retained (half the region); after that payloads are copied into a
    // share of 8 KiB, which eight 1000-byte frames fill.
    let mut small_share = settings(4, 4096, vec![]);
    small_share.reassembly = 8192;
    let (_dir, listener, connector) = shm_endpoints(small_share);
    let (sink, receiver) = hoarding(listener);
    let opts = SenderOptions {
        name: "slow-downstream".into(),
        key: Some(key()),
        send_blocks: 2,
        block_size: 4096,
        ..Default::default()
    };
    let s = SenderHandle::start(opts, connector, 4).unwrap();
    let _t = stream_frames(
        &s,
        0,
        SourceKind::RadarSynthetic {
            size: 1000,
            rate: 2000.0,
        },
        40,
    );
    // Stuck: nothing more arrives for half a second.
    let mut last = (u64::MAX, std::time::Instant::now());
    assert!(
        wait_until(Duration::from_secs(30), || {
            let now = receiver.blocks();
            if now != last.0 {
                last = (now, std::time::Instant::now());
            }
            last.1.elapsed() > Duration::from_millis(500)
        }),
        "the receiver never stopped taking blocks"
    );
    let held = sink.0.lock().unwrap().len();
    assert!(
        held < 40,
        "every frame was taken ({held}): the share never ran out"
    );
    let (polls, t0) = (receiver.idle_polls(), std::time::Instant::now());
    std::thread::sleep(Duration::from_millis(300));
    let (polls, waited) = (receiver.idle_polls() - polls, t0.elapsed());
    // At most one look per 100 µs of the time waited (it sleeps from `poll_min`, 20 µs,
    // doubling to `poll_max`, 500 µs, between looks).
    let bound = waited.as_micros() as u64 / 100;
    assert!(
        polls <= bound,
        "{polls} polls in {waited:?} waiting for memory (at most {bound}): the polling thread spins"
    );
    receiver.stop();
}

/// Records every event per stream, in order: sender, device, what ("format", "frame i",
/// "end") and its detail (the format's descriptor, the frame's [`digest`]).
#[derive(Default)]
struct Events(std::sync::Mutex<Vec<(String, u8, String, String)>>);

/// A frame payload's length and hash, to compare frames briefly.
fn digest(bytes: &[u8]) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    bytes.hash(&mut h);
    format!("{} bytes, digest {:016x}", bytes.len(), h.finish())
}

impl rdmastream::engine::FrameSink for Events {
    fn handle(
        &self,
        key: &rdmastream::engine::StreamKey,
        _: u64,
        _: &Arc<rdmastream::stats::DeviceCounters>,
        event: rdmastream::proto::StreamEvent,
    ) {
        rdmastream::proto::ack::settle(event.ack());
        use rdmastream::proto::StreamEvent as E;
        let (what, detail) = match event {
            E::Format { descriptor, .. } => (
                "format".to_string(),
                String::from_utf8_lossy(&descriptor).into_owned(),
            ),
            E::Frame(f) => (format!("frame {}", f.index), digest(&f.data)),
            E::EndOfStream { .. } => ("end".to_string(), String::new()),
        };
        self.0
            .lock()
            .unwrap()
            .push((key.sender.clone(), key.device, what, detail));
    }
}

#[test]
fn a_sender_with_smaller_blocks_than_the_receiver_writes_at_the_receivers_offsets() {
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(4, 8192, vec![]));
    let sink = Arc::new(Collect::default());
    let receiver =
        ReceiverHandle::start(ReceiverOptions::default(), Box::new(listener), sink.clone())
            .unwrap();
    let opts = SenderOptions {
        name: "small".into(),
        key: Some(key()),
        send_blocks: 2,
        block_size: 4096,
        ..Default::default()
    };
    let s = SenderHandle::start(opts, Box::new(fabric.connector("rx")), 4).unwrap();
    stream_frames(
        &s,
        1,
        SourceKind::RadarSynthetic {
            size: 10_000,
            rate: 1000.0,
        },
        20,
    )
    .join()
    .unwrap();
    s.finish(Duration::from_secs(10)).unwrap();
    assert!(wait_until(Duration::from_secs(10), || receiver.all_senders_ended()));
    assert_eq!(receiver.invalid().total(), 0);
    receiver.stop();
    assert_eq!(sink.frames.lock().unwrap().len(), 20);
}

#[test]
fn a_device_that_ends_and_comes_back_carries_on_numbering() {
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(4, 4096, vec![]));
    let sink = Arc::new(Events::default());
    let receiver =
        ReceiverHandle::start(ReceiverOptions::default(), Box::new(listener), sink.clone())
            .unwrap();
    let opts = SenderOptions {
        name: "again".into(),
        key: Some(key()),
        send_blocks: 2,
        block_size: 4096,
        ..Default::default()
    };
    let s = SenderHandle::start(opts, Box::new(fabric.connector("rx")), 4).unwrap();
    for _ in 0..2 {
        stream_frames(
            &s,
            3,
            SourceKind::RadarSynthetic {
                size: 100,
                rate: 1000.0,
            },
            5,
        )
        .join()
        .unwrap();
    }
    s.finish(Duration::from_secs(10)).unwrap();
    assert!(wait_until(Duration::from_secs(10), || receiver.all_senders_ended()));
    receiver.stop();
    let events: Vec<String> = sink.0.lock().unwrap().iter().map(|e| e.2.clone()).collect();
    let once = [
        "format", "frame 0", "frame 1", "frame 2", "frame 3", "frame 4", "end",
    ];
    let want: Vec<String> = once
        .iter()
        .chain(once.iter())
        .map(|s| s.to_string())
        .collect();
    assert_eq!(events, want);
}

/// A receiver that stops closes its connections; the sender reconnects to the next receiver on
/// the same address, which gets each live device's format again before any frame. (A lossless
/// device's frames are not held for the format: see docs/protocol.md, "Lossless delivery".)
#[test]
fn a_new_receiver_gets_the_format_again_after_a_reconnect() {
    let listener = tcp::listen("127.0.0.1:0", settings(4, 8192, vec![])).unwrap();
    let addr = listener.local_addr();
    let first = Arc::new(Events::default());
    let receiver = ReceiverHandle::start(
        ReceiverOptions::default(),
        Box::new(listener),
        first.clone(),
    )
    .unwrap();
    let opts = SenderOptions {
        name: "moving".into(),
        key: Some(key()),
        send_blocks: 2,
        block_size: 8192,
        reconnect_min: Duration::from_millis(20),
        reconnect_max: Duration::from_millis(100),
        ..Default::default()
    };
    let s = SenderHandle::start(opts, Box::new(TcpConnector::new(addr.clone())), 4).unwrap();
    let input = s.add_device(2, DropPolicy::DropOldest);
    let mut producer = Producer::new(
        2,
        &SourceKind::RadarSynthetic {
            size: 500,
            rate: 100.0,
        },
    )
    .unwrap();
    let mut index = 0;
    let mut push_until = |sink: &Events, frames: usize, index: &mut u64| {
        let target = sink.0.lock().unwrap().len() + frames;
        assert!(
            wait_until(Duration::from_secs(20), || {
                input.push(producer.frame(*index));
                *index += 1;
                sink.0.lock().unwrap().len() >= target
            }),
            "frames did not arrive within 20 s ({} pushed; sender: {:?}); the receiver has: {:?}",
            *index,
            s.machine_stats(),
            sink.0
                .lock()
                .unwrap()
                .iter()
                .map(|e| &e.2)
                .collect::<Vec<_>>()
        );
    };
    push_until(&first, 5, &mut index);
    receiver.stop();
    let listener = tcp::listen(&addr, settings(4, 8192, vec![])).unwrap();
    let second = Arc::new(Events::default());
    let receiver = ReceiverHandle::start(
        ReceiverOptions::default(),
        Box::new(listener),
        second.clone(),
    )
    .unwrap();
    push_until(&second, 5, &mut index);
    drop(input);
    s.finish(Duration::from_secs(10)).unwrap();
    receiver.stop();
    let events = second.0.lock().unwrap();
    let first_frame = events
        .iter()
        .position(|e| e.2.starts_with("frame"))
        .unwrap();
    assert!(
        events[..first_frame].iter().any(|e| e.2 == "format"),
        "no format before the first frame: {events:?}"
    );
}

/// A connector whose connections fail one post (a write chain or a sync): the `n`-th over all
/// its connections, as a transport that completes work as it is posted may fail one under a
/// handing thread.
struct FailingPost {
    inner: Box<dyn Connector>,
    left: Arc<std::sync::atomic::AtomicUsize>,
}

struct FailingConnection {
    inner: Box<dyn rdmastream::transport::Connection>,
    left: Arc<std::sync::atomic::AtomicUsize>,
}

impl FailingConnection {
    /// Fails once the count runs out (that once only).
    fn check(&self) -> rdmastream::Result<()> {
        use std::sync::atomic::Ordering::{AcqRel, Acquire};
        match self
            .left
            .fetch_update(AcqRel, Acquire, |n| n.checked_sub(1))
        {
            Ok(1) => Err(rdmastream::Error::Disconnected {
                peer: self.inner.peer().to_string(),
                reason: "a post failed (injected by the test)".into(),
            }),
            _ => Ok(()),
        }
    }
}

impl Connector for FailingPost {
    fn transport(&self) -> &'static str {
        self.inner.transport()
    }
    fn placement(&self) -> Placement {
        self.inner.placement()
    }
    fn peer(&self) -> String {
        self.inner.peer()
    }
    fn connect(
        &self,
        hello: &rdmastream::proto::handshake::Hello,
        key: Option<&Key>,
        blocks: &Arc<rdmastream::transport::SendBlocks>,
    ) -> rdmastream::Result<Box<dyn rdmastream::transport::Connection>> {
        Ok(Box::new(FailingConnection {
            inner: self.inner.connect(hello, key, blocks)?,
            left: self.left.clone(),
        }))
    }
    fn connect_window(
        &self,
        hello: &rdmastream::proto::handshake::Hello,
        key: Option<&Key>,
        blocks: &Arc<rdmastream::transport::SendBlocks>,
    ) -> rdmastream::Result<Box<dyn rdmastream::transport::WindowConnection>> {
        self.inner.connect_window(hello, key, blocks)
    }
    fn alloc_send_blocks(
        &self,
        count: usize,
        block_size: usize,
    ) -> rdmastream::Result<Arc<rdmastream::transport::SendBlocks>> {
        self.inner.alloc_send_blocks(count, block_size)
    }
}

impl rdmastream::transport::Connection for FailingConnection {
    fn peer(&self) -> &str {
        self.inner.peer()
    }
    fn layout(&self) -> rdmastream::proto::RemoteLayout {
        self.inner.layout()
    }
    fn post_write_chain(
        &mut self,
        wr_id: u64,
        chain: &[rdmastream::transport::WriteWr<'_>],
    ) -> rdmastream::Result<()> {
        self.check()?;
        self.inner.post_write_chain(wr_id, chain)
    }
    fn post_read(
        &mut self,
        wr_id: u64,
        remote: rdmastream::transport::RemoteAddr,
        len: usize,
    ) -> rdmastream::Result<()> {
        self.check()?;
        self.inner.post_read(wr_id, remote, len)
    }
    fn poll_completions(
        &mut self,
        out: &mut Vec<Completion>,
        timeout: Duration,
    ) -> rdmastream::Result<()> {
        self.inner.poll_completions(out, timeout)
    }
    fn heartbeat(&mut self) -> rdmastream::Result<()> {
        self.inner.heartbeat()
    }
    fn take_notices(&mut self) -> Vec<rdmastream::transport::Notice> {
        self.inner.take_notices()
    }
    fn lend_block(
        &self,
        remote_block: usize,
    ) -> Option<Box<dyn rdmastream::transport::LeasedBlock>> {
        self.inner.lend_block(remote_block)
    }
    fn syncs_early(&self) -> bool {
        self.inner.syncs_early()
    }
    fn writes_lowest_first(&self) -> bool {
        self.inner.writes_lowest_first()
    }
    fn cache_budget(&self) -> Option<usize> {
        self.inner.cache_budget()
    }
    fn send_limits(&self, block_size: usize) -> rdmastream::transport::SendLimits {
        self.inner.send_limits(block_size)
    }
    fn completes_at_once(&self) -> bool {
        self.inner.completes_at_once()
    }
    fn posts_here_when_idle(&self) -> bool {
        self.inner.posts_here_when_idle()
    }
}

/// Over shm the thread that commits a frame written into a receiver's block posts its status
/// byte itself while the sending thread waits (`SenderReport::driven_here`). When such a post
/// fails, that thread hands the error to the sending thread and wakes it, and the sending
/// thread reconnects; the frames after it arrive over the new connection, in order and
/// bit-exact. A handing thread that swallowed the error and left the sending thread asleep
/// would leave a chain that never completes on a connection nobody renews (checked: this test
/// then fails, one connection in the report and that block unsent).
#[test]
fn a_post_that_fails_on_a_committing_thread_is_reconnected_by_the_sending_thread() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rx.sock");
    let listener = rdmastream_verbs::shm::listen(&path, settings(8, 4096, vec![])).unwrap();
    let connector = FailingPost {
        inner: Box::new(rdmastream_verbs::shm::ShmConnector::new(&listener.local_addr()).unwrap()),
        left: Arc::new(std::sync::atomic::AtomicUsize::new(40)),
    };
    let (sink, receiver) = hoarding(Box::new(listener));
    let opts = SenderOptions {
        name: "failing".into(),
        key: Some(key()),
        send_blocks: 4,
        block_size: 4096,
        in_place_blocks: 2,
        reconnect_min: Duration::from_millis(20),
        reconnect_max: Duration::from_millis(100),
        ..Default::default()
    };
    let s = SenderHandle::start(opts, Box::new(connector), 64).unwrap();
    let input = s.add_device(3, DropPolicy::DropOldest);
    let mut index = 0u64;
    let mut sent = std::collections::HashMap::new();
    assert!(
        wait_until(Duration::from_secs(20), || {
            if let Ok(mut r) = input.reserve(100, Duration::from_millis(20)) {
                let bytes = Rendered::bytes(index as u8, 100);
                r.payload_mut().copy_from_slice(&bytes);
                assert!(r.commit(meta(index)));
                sent.insert(index, bytes);
                index += 1;
                if index.is_multiple_of(8) {
                    // A pause now and then, so the sending thread goes back to sleep and the
                    // next commit is posted here (back to back, every hand-over may find it at
                    // work on a loaded machine).
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            sink.0.lock().unwrap().len() >= 80
        }),
        "frames stopped arriving ({index} committed, {} arrived; sender: {:?})",
        sink.0.lock().unwrap().len(),
        s.machine_stats()
    );
    input.end();
    let report = s.finish(Duration::from_secs(10)).unwrap();
    receiver.stop();
    assert_eq!(report.connections, 2, "{report:?}");
    assert_eq!(report.unsent, 0, "{report:?}");
    assert!(report.driven_here > 0, "{report:?}");
    let got = sink.0.lock().unwrap();
    let mut last = None;
    for (i, data) in got.iter() {
        assert!(last < Some(*i), "frame {i} after frame {last:?}");
        assert_eq!(data[..], sent[i][..], "frame {i}");
        last = Some(*i);
    }
}

/// A dropped listener has closed its socket by the time the drop returns, so a receiver
/// restarted in the same process can bind the same address at once, even while a sender keeps
/// knocking on it.
#[test]
fn a_dropped_listener_frees_its_address_at_once() {
    let first = tcp::listen("127.0.0.1:0", settings(2, 4096, vec![])).unwrap();
    let addr = first.local_addr();
    drop(first);
    let knocking = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let knocker = {
        let (knocking, addr) = (knocking.clone(), addr.clone());
        std::thread::spawn(move || {
            while knocking.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = std::net::TcpStream::connect(&addr);
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    for round in 0..50 {
        let l = tcp::listen(&addr, settings(2, 4096, vec![]))
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        drop(l);
    }
    knocking.store(false, std::sync::atomic::Ordering::Relaxed);
    knocker.join().unwrap();
}

/// A TCP connection to `addr` from the loopback address `from` (any 127.0.0.0/8 address is
/// local on Linux): lets one test be several remote machines.
fn connect_from(from: &str, addr: &str) -> std::net::TcpStream {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    let local: std::net::SocketAddr = format!("{from}:0").parse().unwrap();
    sock.bind(&local.into()).unwrap();
    let remote: std::net::SocketAddr = addr.parse().unwrap();
    sock.connect(&remote.into()).unwrap();
    sock.into()
}

/// Idle connections that never say Hello hold a handshake thread each, up to a bound per remote
/// address (4) and in all (64): beyond it connections are closed at once and reported as
/// refusals. One machine trickling handshakes does not lock out another, and once the idle ones
/// go away a sender from anywhere gets in.
#[test]
fn a_flood_of_idle_connections_is_bounded_and_does_not_lock_senders_out() {
    let mut listener = tcp::listen("127.0.0.1:0", settings(2, 4096, vec![])).unwrap();
    let addr = listener.local_addr();
    let mut refusals = Vec::new();
    let mut turned_away =
        |listener: &mut dyn Listener, what: &str, connect: &dyn Fn() -> std::net::TcpStream| {
            let mut extra = Vec::new();
            let found = wait_until(Duration::from_secs(20), || {
                extra.push(connect());
                refusals.extend(listener.refusals());
                refusals.iter().any(|r| r.why.contains(what))
            });
            assert!(
                found,
                "no connection was turned away with {what:?}: {refusals:?}"
            );
            extra
        };
    // One address: its fifth handshake is turned away.
    let one: Vec<_> = (0..4).map(|_| connect_from("127.0.0.2", &addr)).collect();
    let extra = turned_away(&mut listener, "4 handshakes from 127.0.0.2", &|| {
        connect_from("127.0.0.2", &addr)
    });
    drop(extra);
    drop(one);
    // Sixteen addresses with four each: every slot is taken.
    let many: Vec<_> = (0..64)
        .map(|i| connect_from(&format!("127.0.1.{}", i / 4 + 1), &addr))
        .collect();
    let extra = turned_away(&mut listener, "64 handshakes already in progress", &|| {
        connect_from("127.0.2.1", &addr)
    });
    drop(many);
    drop(extra);
    let opts = SenderOptions {
        name: "after-flood".into(),
        key: Some(key()),
        block_size: 4096,
        ..Default::default()
    };
    let receiver = ReceiverHandle::start(
        ReceiverOptions::default(),
        Box::new(listener),
        Arc::new(Collect::default()),
    )
    .unwrap();
    let s = SenderHandle::start(opts, Box::new(TcpConnector::new(addr)), 4).unwrap();
    let input = s.add_device(0, DropPolicy::Block);
    assert!(input.push(rdmastream::engine::SourceFrame {
        index: 0,
        timestamp_ns: 1,
        duration_ns: 0,
        pts_ns: None,
        format: "".into(),
        data: vec![1u8; 100].into(),
    }));
    input.end();
    drop(input);
    s.finish(Duration::from_secs(30)).unwrap();
    assert!(
        wait_until(Duration::from_secs(20), || receiver.all_senders_ended()),
        "the sender's stream did not arrive"
    );
}

/// A notice the receiver gives a connection's region reaches the sender's end of it, over tcp
/// (a NOTICE operation behind the next answer) and in process, and the connection carries on.
#[test]
fn a_receivers_notice_reaches_the_sender_and_ends_nothing() {
    use rdmastream::transport::{Connector, Listener, Notice, SendBlocks};
    let fabric = MemFabric::new();
    let mem_listener = fabric.listen("rx", settings(4, 256, vec![]));
    let tcp_listener = tcp::listen("127.0.0.1:0", settings(4, 256, vec![])).unwrap();
    let tcp_addr = tcp_listener.local_addr();
    let cases: Vec<(Box<dyn Listener>, Box<dyn Connector>)> = vec![
        (Box::new(mem_listener), Box::new(fabric.connector("rx"))),
        (
            Box::new(tcp_listener),
            Box::new(TcpConnector::new(tcp_addr).with_peer_timeout(Duration::from_millis(500))),
        ),
    ];
    for (mut listener, connector) in cases {
        let blocks = SendBlocks::new(1, 256);
        let mut conn = connector
            .connect(&raw_hello("told"), Some(&key()), &blocks)
            .unwrap();
        let accepted = listener
            .accept_sender(Duration::from_secs(5))
            .unwrap()
            .expect("the sender was accepted");
        let sent = Notice::new(7, "device-id 7 is already taken at this receiver");
        accepted.region.notify(sent.clone());
        let mut got = Vec::new();
        let arrived = wait_until(Duration::from_secs(20), || {
            conn.heartbeat().unwrap();
            got.extend(conn.take_notices());
            !got.is_empty()
        });
        assert!(arrived, "no notice at the {} sender", connector.transport());
        assert_eq!(got, vec![sent], "{}", connector.transport());
        write_raw_block(conn.as_mut(), 0, 256, b"still connected");
        let mut done = Vec::new();
        assert!(
            wait_until(Duration::from_secs(20), || {
                conn.poll_completions(&mut done, Duration::from_millis(1))
                    .unwrap();
                done.contains(&Completion::Write { wr_id: 0 })
            }),
            "no block after the notice ({})",
            connector.transport()
        );
        assert!(!accepted.region.is_closed());
    }
}

/// A frame rendered in place: byte i is a function of (seed, i), so any range can be produced
/// on its own. Records the ranges it was asked for, and which thread rendered each.
struct Rendered {
    seed: u8,
    len: usize,
    calls: std::sync::Mutex<Vec<std::ops::Range<usize>>>,
    threads: std::sync::Mutex<Vec<Option<String>>>,
}

impl Rendered {
    fn byte(seed: u8, i: usize) -> u8 {
        (i as u8).wrapping_mul(31) ^ (i >> 8) as u8 ^ seed
    }
    fn bytes(seed: u8, len: usize) -> Vec<u8> {
        (0..len).map(|i| Self::byte(seed, i)).collect()
    }
}

impl rdmastream::engine::FrameWriter for Rendered {
    fn len(&self) -> usize {
        self.len
    }
    fn write(&self, offset: usize, dst: &mut [u8]) {
        self.calls.lock().unwrap().push(offset..offset + dst.len());
        let thread = std::thread::current().name().map(str::to_string);
        self.threads.lock().unwrap().push(thread);
        for (k, b) in dst.iter_mut().enumerate() {
            *b = Self::byte(self.seed, offset + k);
        }
    }
}

#[test]
fn frames_written_in_place_and_copied_arrive_bit_exact_including_fragmented_ones() {
    use rdmastream::engine::{FrameData, SourceFrame};
    const BLOCK: usize = 4096;
    let cap = rdmastream::proto::payload_capacity(BLOCK);
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(4, BLOCK, vec![]));
    let (sink, receiver) = hoarding(Box::new(listener));
    let opts = SenderOptions {
        name: "in-place".into(),
        key: Some(key()),
        send_blocks: 4,
        block_size: BLOCK,
        ..Default::default()
    };
    let s = SenderHandle::start(opts, Box::new(fabric.connector("rx")), 4).unwrap();
    let input = s.add_device(9, DropPolicy::Block);
    // One block exactly, less than one, three blocks and a bit, and empty: each once rendered
    // in place and once copied from bytes with the same contents.
    let lens = [cap, 1000, 3 * cap + 17, 0];
    let mut writers = Vec::new();
    let mut index = 0;
    for (k, &len) in lens.iter().enumerate() {
        let seed = k as u8 * 17;
        let w = Arc::new(Rendered {
            seed,
            len,
            calls: Default::default(),
            threads: Default::default(),
        });
        writers.push(w.clone());
        for data in [
            FrameData::Render(w),
            FrameData::Bytes(Rendered::bytes(seed, len).into()),
        ] {
            assert!(input.push(SourceFrame {
                index,
                timestamp_ns: 1,
                duration_ns: 0,
                pts_ns: None,
                format: "application/octet-stream".into(),
                data,
            }));
            index += 1;
        }
    }
    input.end();
    assert_eq!(s.finish(Duration::from_secs(20)).unwrap().unsent, 0);
    assert!(wait_until(Duration::from_secs(10), || receiver.all_senders_ended()));
    let held = sink.0.lock().unwrap();
    assert_eq!(held.len(), 2 * lens.len());
    for (i, (index, data)) in held.iter().enumerate() {
        assert_eq!(*index, i as u64);
        let k = i / 2;
        let how = if i % 2 == 0 { "in place" } else { "copied" };
        assert_eq!(
            &data[..],
            &Rendered::bytes(k as u8 * 17, lens[k])[..],
            "frame {i} ({how}, {} bytes)",
            lens[k]
        );
    }
    drop(held);
    receiver.stop();
    // Each rendered frame was written once, fragment by fragment, straight into the blocks.
    for (w, &len) in writers.iter().zip(&lens) {
        let calls = w.calls.lock().unwrap().clone();
        let want: Vec<_> = (0..len.div_ceil(cap).max(1))
            .map(|k| rdmastream::proto::fragment_range(k, len, BLOCK))
            .collect();
        assert_eq!(calls, want, "{len}-byte frame");
    }
}

/// Small messages of live devices share blocks (layout version 2) through the real threads,
/// beside a lossless camera whose frames span several blocks: every frame arrives verified and
/// in order, and fewer blocks than messages were taken.
#[test]
fn coalesced_small_messages_arrive_verified_beside_fragmented_frames_over_mem() {
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(8, 4096, vec![]));
    run_coalesced(Box::new(listener), Box::new(fabric.connector("rx")));
}

#[test]
fn coalesced_small_messages_arrive_verified_over_tcp_and_shm() {
    let listener = tcp::listen("127.0.0.1:0", settings(8, 4096, vec![])).unwrap();
    let addr = listener.local_addr();
    run_coalesced(Box::new(listener), Box::new(TcpConnector::new(addr)));
    let (_dir, listener, connector) = shm_endpoints(settings(8, 4096, vec![]));
    run_coalesced(listener, connector);
}

/// A shm receiver's listener on a fresh socket in the returned directory, and a connector to it.
fn shm_endpoints(
    settings: RegionSettings,
) -> (tempfile::TempDir, Box<dyn Listener>, Box<dyn Connector>) {
    shm_endpoints_with_budget(settings, Some(rdmastream::transport::shm_cache_budget()))
}

/// [`shm_endpoints`] with the sender's cache budget pinned instead of this host's.
fn shm_endpoints_with_budget(
    settings: RegionSettings,
    budget: Option<usize>,
) -> (tempfile::TempDir, Box<dyn Listener>, Box<dyn Connector>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rx.sock");
    let listener = rdmastream_verbs::shm::listen(&path, settings).unwrap();
    let connector = rdmastream_verbs::shm::ShmConnector::new(&listener.local_addr())
        .unwrap()
        .with_cache_budget(budget);
    (dir, Box::new(listener), Box::new(connector))
}

fn run_coalesced(listener: Box<dyn Listener>, connector: Box<dyn Connector>) {
    let dir = tempfile::tempdir().unwrap();
    let sink = Arc::new(
        DirectorySink::new(DirectorySinkOptions {
            out: dir.path().to_path_buf(),
            default: Default::default(),
            devices: Default::default(),
            verify: true,
            writers: 2,
            queue: 64,
            disk_budget: None,
        })
        .unwrap(),
    );
    let receiver = ReceiverHandle::start(ReceiverOptions::default(), listener, sink).unwrap();
    let opts = SenderOptions {
        name: "edge-c".into(),
        key: Some(key()),
        send_blocks: 6,
        block_size: 4096,
        coalesce_wait: Duration::from_micros(300),
        ..Default::default()
    };
    let sender = SenderHandle::start(opts, connector, 10_000).unwrap();
    let frames = 300u64;
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    let radar = |size| SourceKind::RadarSynthetic { size, rate: 2000.0 };
    let camera = SourceKind::CameraSynthetic {
        width: 64,
        height: 48,
        fps: 500.0,
    };
    for (device, kind, policy) in [
        (1u8, radar(64), DropPolicy::DropOldest),
        (2, radar(200), DropPolicy::DropOldest),
        (3, radar(1000), DropPolicy::DropOldest),
        (9, camera, DropPolicy::Block),
    ] {
        let input = sender.add_device(device, policy);
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
    finish_delivered(sender, &receiver, Duration::from_secs(20));
    let counters = receiver.counters().all();
    let reorder = receiver.reorder_stats();
    let invalid = receiver.invalid().total();
    let blocks = receiver.blocks();
    receiver.stop();
    assert_eq!(invalid, 0);
    assert_eq!(counters.len(), 4);
    for (key, c) in counters {
        assert_eq!(get(&c.frames), frames, "{key}");
        assert_eq!(get(&c.verified), frames, "{key}");
        assert_eq!(get(&c.mismatched), 0, "{key}");
    }
    for (key, r) in reorder {
        assert_eq!(r.gap_packets + r.duplicates, 0, "{key}: {r:?}");
    }
    // Three radars' frames (and formats, ends) alone would take at least this many blocks,
    // besides the camera's three per frame.
    let alone = 3 * (frames + 2) + 3 * frames + 2;
    eprintln!("{blocks} blocks taken; without coalescing at least {alone}");
    assert!(blocks < alone, "{blocks} blocks: nothing was coalesced");
}

/// A receiver as it runs over a transport whose placement order is not guaranteed (verbs): every
/// region its listener hands out says [`Placement::Unordered`], as a verbs region does, and
/// otherwise is the inner transport's.
struct UnorderedListener(Box<dyn Listener>);

/// A frame as [`Collect`] records it: sender, device, frame index, bytes.
type Delivered = (String, u8, u64, usize);

/// A transport to try, by name: its listener and a connector to it.
type Transport = (&'static str, Box<dyn Listener>, Box<dyn Connector>);

struct UnorderedRegion(Arc<dyn rdmastream::transport::Region>);

impl Listener for UnorderedListener {
    fn transport(&self) -> &'static str {
        self.0.transport()
    }
    fn local_addr(&self) -> String {
        self.0.local_addr()
    }
    fn accept(
        &mut self,
        timeout: Duration,
    ) -> rdmastream::Result<Option<rdmastream::transport::Accepted>> {
        Ok(self.0.accept(timeout)?.map(|mut a| {
            a.region = Arc::new(UnorderedRegion(a.region));
            a
        }))
    }
    fn waker(&self) -> rdmastream::transport::AcceptWaker {
        self.0.waker()
    }
    fn refusals(&mut self) -> Vec<rdmastream::transport::Refusal> {
        self.0.refusals()
    }
}

impl rdmastream::transport::Region for UnorderedRegion {
    fn layout(&self) -> rdmastream::proto::RemoteLayout {
        self.0.layout()
    }
    fn placement(&self) -> Placement {
        Placement::Unordered
    }
    fn status(&self, j: usize) -> u8 {
        self.0.status(j)
    }
    fn set_status(&self, j: usize, value: u8) {
        self.0.set_status(j, value)
    }
    fn read_block(&self, j: usize, f: &mut dyn FnMut(&[u8])) {
        self.0.read_block(j, f)
    }
    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
    fn disconnect(&self) {
        self.0.disconnect()
    }
    fn retain(self: Arc<Self>, j: usize) -> rdmastream::transport::RetainedBlock {
        self.0.clone().retain(j)
    }
    fn retained(&self) -> usize {
        self.0.retained()
    }
    fn release(&self, j: usize) {
        self.0.release(j)
    }
    fn abandon(&self, j: usize) {
        self.0.abandon(j)
    }
    fn notify(&self, notice: rdmastream::transport::Notice) {
        self.0.notify(notice)
    }
}

/// Writes, by hand, blocks sealed over their header only and one whose header was changed after
/// such a seal, waits until `want` of them were delivered or refused, and returns what the
/// receiver made of them: frames delivered and invalid blocks by kind.
fn header_sealed_blocks_into(
    listener: Box<dyn Listener>,
    connector: Box<dyn Connector>,
    want: u64,
) -> (Vec<Delivered>, std::collections::BTreeMap<BlockError, u64>) {
    use rdmastream::proto::header::flags;
    let sink = Arc::new(Collect::default());
    let receiver =
        ReceiverHandle::start(ReceiverOptions::default(), listener, sink.clone()).unwrap();
    let blocks = rdmastream::transport::SendBlocks::new(1, 256);
    let mut conn = connector
        .connect(&raw_hello("sealed"), Some(&key()), &blocks)
        .unwrap();
    let header = |packet: u16, flags: u8, len: u32| BlockHeader {
        device: 1,
        packet,
        flags,
        fragment_index: 0,
        fragment_count: 1,
        payload_len: len,
        frame_index: packet as u64,
        timestamp_ns: 0,
        message_len: len,
        duration_ns: 0,
        pts_ns: NO_PTS,
    };
    // A format, then a frame, both sealed over their header only; then a frame whose header
    // was changed after such a seal.
    let format = b"application/octet-stream";
    for (j, h, payload) in [
        (
            0,
            header(0, flags::STREAM_START | flags::FORMAT, format.len() as u32),
            &format[..],
        ),
        (1, header(1, 0, 3), &b"abc"[..]),
    ] {
        let mut block = vec![0u8; 256];
        let used = h
            .sealed_for(Placement::Ordered)
            .encode_block(payload, &mut block);
        write_raw_block(conn.as_mut(), j, 256, &block[..used]);
    }
    let mut torn = vec![0u8; 256];
    let used = header(2, 0, 3)
        .sealed_for(Placement::Ordered)
        .encode_block(b"def", &mut torn);
    torn[16] ^= 1; // the frame index, after the seal
    write_raw_block(conn.as_mut(), 2, 256, &torn[..used]);
    // Over tcp small writes wait in the connection until it is polled.
    let mut done = Vec::new();
    assert!(wait_until(Duration::from_secs(10), || {
        conn.poll_completions(&mut done, Duration::from_millis(10))
            .unwrap();
        done.len() == 3
    }));
    let delivered = || !sink.frames.lock().unwrap().is_empty();
    assert!(
        wait_until(Duration::from_secs(10), || receiver.invalid().total()
            + delivered() as u64
            == want),
        "{:?} {:?}",
        receiver.invalid().all(),
        sink.frames.lock().unwrap()
    );
    drop(conn);
    let invalid = receiver.invalid().all();
    receiver.stop();
    let frames = sink.frames.lock().unwrap().clone();
    (frames, invalid)
}

#[test]
fn header_sealed_blocks_are_taken_over_tcp_shm_and_mem() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rx.sock");
    let fabric = MemFabric::new();
    let tcp_listener = tcp::listen("127.0.0.1:0", settings(4, 256, vec![])).unwrap();
    let tcp_addr = tcp_listener.local_addr();
    let shm_listener = rdmastream_verbs::shm::listen(&path, settings(4, 256, vec![])).unwrap();
    let shm_addr = shm_listener.local_addr();
    let transports: Vec<Transport> = vec![
        (
            "mem",
            Box::new(fabric.listen("rx", settings(4, 256, vec![]))),
            Box::new(fabric.connector("rx")),
        ),
        (
            "tcp",
            Box::new(tcp_listener),
            Box::new(TcpConnector::new(tcp_addr)),
        ),
        (
            "shm",
            Box::new(shm_listener),
            Box::new(rdmastream_verbs::shm::ShmConnector::new(&shm_addr).unwrap()),
        ),
    ];
    for (name, listener, connector) in transports {
        assert_eq!(connector.placement(), Placement::Ordered, "{name}");
        let (frames, invalid) = header_sealed_blocks_into(listener, connector, 2);
        assert_eq!(frames, vec![("sealed".into(), 1, 1, 3)], "{name}");
        // A header changed after its seal is still caught: the CRC32C covers the header.
        assert_eq!(
            invalid.into_iter().collect::<Vec<_>>(),
            vec![(BlockError::BadSeal, 1)],
            "{name}"
        );
    }
}

#[test]
fn header_sealed_blocks_are_refused_where_placement_is_not_ordered() {
    let fabric = MemFabric::new();
    let listener = UnorderedListener(Box::new(fabric.listen("rx", settings(4, 256, vec![]))));
    let (frames, invalid) =
        header_sealed_blocks_into(Box::new(listener), Box::new(fabric.connector("rx")), 3);
    assert_eq!(frames, vec![]);
    assert_eq!(
        invalid.into_iter().collect::<Vec<_>>(),
        vec![(BlockError::WeakSeal, 3)]
    );
}

#[test]
fn a_sender_over_an_ordered_transport_seals_over_the_header_only() {
    // The sender over mem seals as tcp and shm do; a receiver that allows only full seals (as
    // over verbs) refuses its blocks by kind, which shows the sender's seal is the cheap one.
    // (The other tests over mem, tcp and shm show those receivers take such blocks.)
    let fabric = MemFabric::new();
    let listener = UnorderedListener(Box::new(fabric.listen("rx", settings(4, 8192, vec![]))));
    let sink = Arc::new(Collect::default());
    let receiver =
        ReceiverHandle::start(ReceiverOptions::default(), Box::new(listener), sink.clone())
            .unwrap();
    let opts = SenderOptions {
        name: "edge-a".into(),
        key: Some(key()),
        send_blocks: 3,
        block_size: 8192,
        ..Default::default()
    };
    let connector = fabric.connector("rx");
    assert_eq!(connector.placement(), Placement::Ordered);
    let s = SenderHandle::start(opts, Box::new(connector), 4).unwrap();
    let t = stream_frames(
        &s,
        7,
        SourceKind::RadarSynthetic {
            size: 20_000,
            rate: 1000.0,
        },
        3,
    );
    assert!(wait_until(Duration::from_secs(10), || {
        receiver
            .invalid()
            .all()
            .get(&BlockError::WeakSeal)
            .is_some_and(|&n| n >= 3)
    }));
    let invalid = receiver.invalid().all();
    drop(s);
    let _ = t.join();
    receiver.stop();
    assert_eq!(sink.frames.lock().unwrap().len(), 0);
    assert_eq!(invalid.len(), 1, "only weak seals: {invalid:?}");
}

/// Frames written into reserved send blocks ([`DeviceInput::reserve`]) and committed arrive
/// bit-exact and in order between frames pushed as bytes; an abandoned reservation frees its
/// block; a reservation beyond one block is refused, one beyond the in-place blocks waits, and
/// pushed frames still go while every in-place block is held.
///
/// [`DeviceInput::reserve`]: rdmastream::engine::DeviceInput::reserve
#[test]
fn reserved_frames_arrive_bit_exact_in_order_with_pushed_ones_over_mem() {
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(4, 4096, vec![]));
    run_reserved(Box::new(listener), Box::new(fabric.connector("rx")));
}

#[test]
fn reserved_frames_arrive_bit_exact_in_order_with_pushed_ones_over_tcp() {
    let listener = tcp::listen("127.0.0.1:0", settings(4, 4096, vec![])).unwrap();
    let addr = listener.local_addr();
    run_reserved(Box::new(listener), Box::new(TcpConnector::new(addr)));
}

/// Collects every frame (index, bytes) a receiver hands on.
#[derive(Default)]
struct Hoard(std::sync::Mutex<Vec<(u64, rdmastream::bytes::Bytes)>>);

/// A receiver on `listener` that hands every frame to a [`Hoard`].
fn hoarding(listener: Box<dyn Listener>) -> (Arc<Hoard>, ReceiverHandle) {
    let sink = Arc::new(Hoard::default());
    let receiver =
        ReceiverHandle::start(ReceiverOptions::default(), listener, sink.clone()).unwrap();
    (sink, receiver)
}

/// Frame `index` of `data`, pushed as opaque bytes (no PTS).
fn octets(
    index: u64,
    data: impl Into<rdmastream::engine::FrameData>,
) -> rdmastream::engine::SourceFrame {
    rdmastream::engine::SourceFrame {
        index,
        timestamp_ns: 1,
        duration_ns: 0,
        pts_ns: None,
        format: "application/octet-stream".into(),
        data: data.into(),
    }
}

impl rdmastream::engine::FrameSink for Hoard {
    fn handle(
        &self,
        _: &rdmastream::engine::StreamKey,
        _: u64,
        _: &Arc<rdmastream::stats::DeviceCounters>,
        event: rdmastream::proto::StreamEvent,
    ) {
        rdmastream::proto::ack::settle(event.ack());
        if let rdmastream::proto::StreamEvent::Frame(f) = event {
            self.0.lock().unwrap().push((f.index, f.data));
        }
    }
}

fn meta(index: u64) -> rdmastream::engine::FrameMeta {
    rdmastream::engine::FrameMeta {
        index,
        timestamp_ns: 1,
        duration_ns: 0,
        pts_ns: Some(index * 10),
        format: "application/octet-stream".into(),
    }
}

fn run_reserved(listener: Box<dyn Listener>, connector: Box<dyn Connector>) {
    use rdmastream::engine::NotReserved;
    const BLOCK: usize = 4096;
    const BLOCKS: usize = 4;
    const IN_PLACE: usize = 2;
    let cap = rdmastream::proto::payload_capacity(BLOCK);
    let (sink, receiver) = hoarding(listener);
    let opts = SenderOptions {
        name: "reserved".into(),
        key: Some(key()),
        send_blocks: BLOCKS,
        block_size: BLOCK,
        in_place_blocks: IN_PLACE,
        ..Default::default()
    };
    let s = SenderHandle::start(opts, connector, 4).unwrap();
    let input = s.add_device(3, DropPolicy::Block);
    let other = s.add_device(4, DropPolicy::Block);
    let wait = Duration::from_secs(10);
    assert_eq!(
        input.reserve(cap + 1, wait).unwrap_err(),
        NotReserved::TooLarge
    );
    // The in-place blocks can all be reserved at once; then reserving waits.
    let held: Vec<_> = (0..IN_PLACE)
        .map(|_| input.reserve(100, wait).unwrap())
        .collect();
    assert_eq!(
        input.reserve(100, Duration::from_millis(50)).unwrap_err(),
        NotReserved::TimedOut
    );
    assert!(
        held.iter().all(|r| !r.waited()),
        "free blocks were reserved without a wait"
    );
    // A reservation that waits for one to come back says so (`rdmasink` counts those).
    let mut held = held;
    let back = held.pop().unwrap();
    let giver = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        drop(back);
    });
    let r = input.reserve(100, wait).unwrap();
    giver.join().unwrap();
    assert!(r.waited(), "the reservation that waited for a block");
    held.push(r);
    // Meanwhile pushed frames still go, in the filling thread's own blocks (one of them
    // fragmented over both).
    let pushed = Rendered::bytes(9, cap + 10);
    assert!(other.push(octets(0, pushed.clone())));
    assert!(wait_until(Duration::from_secs(10), || {
        sink.0
            .lock()
            .unwrap()
            .iter()
            .any(|(_, d)| d[..] == pushed[..])
    }));
    sink.0.lock().unwrap().clear();
    other.end();
    drop(held);
    let (want, _) = reserve_and_push(&input, 30, 3, cap);
    input.end();
    assert_eq!(s.finish(Duration::from_secs(20)).unwrap().unsent, 0);
    assert!(wait_until(Duration::from_secs(10), || receiver.all_senders_ended()));
    assert_hoarded(&sink, &want);
    receiver.stop();
}

/// Streams `frames` frames of sizes up to `cap` into `input`: every `push_every`-th pushed as
/// bytes, the others written into reservations and committed, and every fifth of those after a
/// reservation abandoned (its block must come back, or the sender runs out of blocks). Returns
/// the frames (index, bytes) in order and how many reservations were of the receiver's memory.
fn reserve_and_push(
    input: &rdmastream::engine::DeviceInput,
    frames: u64,
    push_every: u64,
    cap: usize,
) -> (Vec<(u64, Vec<u8>)>, usize) {
    let wait = Duration::from_secs(10);
    let lens = [cap, 1000, 0, 1, cap - 1, 333];
    let mut want = Vec::new();
    let mut remote = 0;
    for index in 0..frames {
        let len = lens[index as usize % lens.len()];
        let bytes = Rendered::bytes(index as u8, len);
        if index % push_every == 0 {
            assert!(input.push(rdmastream::engine::SourceFrame {
                index,
                timestamp_ns: 1,
                duration_ns: 0,
                pts_ns: Some(index * 10),
                format: "application/octet-stream".into(),
                data: bytes.clone().into(),
            }));
        } else {
            if index % 5 == 0 {
                let mut r = input.reserve(len, wait).unwrap();
                r.payload_mut().fill(0xEE);
            }
            let mut r = input.reserve(len, wait).unwrap();
            assert_eq!(r.payload().len(), len);
            remote += usize::from(r.is_remote());
            r.payload_mut().copy_from_slice(&bytes);
            assert!(r.commit(meta(index)));
        }
        want.push((index, bytes));
    }
    (want, remote)
}

/// Finishes `sender` (within 20 s) with nothing left unsent, and waits up to `wait` for
/// `receiver` to see every sender's streams end; the sender's report.
fn finish_delivered(
    sender: SenderHandle,
    receiver: &ReceiverHandle,
    wait: Duration,
) -> rdmastream::engine::SenderReport {
    let report = sender.finish(Duration::from_secs(20)).unwrap();
    assert_eq!(report.unsent, 0);
    assert!(
        wait_until(wait, || receiver.all_senders_ended()),
        "the receiver never saw every sender's streams end"
    );
    report
}

/// The hoard holds exactly `want`, in order and bit-exact.
fn assert_hoarded(sink: &Hoard, want: &[(u64, Vec<u8>)]) {
    let got = sink.0.lock().unwrap();
    let order = || got.iter().map(|(i, _)| *i).collect::<Vec<_>>();
    assert_eq!(got.len(), want.len(), "frames arrived: {:?}", order());
    for ((index, data), (want_index, want_bytes)) in got.iter().zip(want) {
        assert_eq!(
            index,
            want_index,
            "frames arrived in this order: {:?}",
            order()
        );
        assert_eq!(&data[..], &want_bytes[..], "frame {index}");
    }
}

/// Over tcp with 4 MiB blocks a live device's reservations keep at most two in-place blocks in
/// use (`tcp_send_limits`: the blocks written are still cached when the socket copies them out),
/// take the block freed last first, and pass the limit after `LIVE_IN_PLACE_PATIENCE` rather
/// than wait for ever (a source that holds its buffers); a lossless device's reservations, which
/// keep their blocks until a sync, are not limited.
#[test]
fn a_tcp_senders_live_reservations_keep_two_4_mib_blocks_in_use() {
    use rdmastream::engine::NotReserved;
    use rdmastream::transport::LIVE_IN_PLACE_PATIENCE;
    const BLOCK: usize = 4 << 20;
    assert_eq!(
        rdmastream::transport::tcp_send_limits(BLOCK).live_in_place,
        Some(2)
    );
    let listener = tcp::listen("127.0.0.1:0", settings(4, BLOCK, vec![])).unwrap();
    let addr = listener.local_addr();
    let (sink, receiver) = hoarding(Box::new(listener));
    let opts = SenderOptions {
        name: "limited".into(),
        key: Some(key()),
        send_blocks: 7,
        block_size: BLOCK,
        // One more than the test holds at once, for the committed frame's block until its
        // write completes.
        in_place_blocks: 5,
        ..Default::default()
    };
    let s = SenderHandle::start(opts, Box::new(TcpConnector::new(addr)), 4).unwrap();
    let live = s.add_device(1, DropPolicy::DropOldest);
    let lossless = s.add_device_with(2, DropPolicy::Block, true);
    // The limits are set on connecting: connected once a frame has arrived.
    let mut r = live.reserve(10, Duration::from_secs(10)).unwrap();
    r.payload_mut().copy_from_slice(b"0123456789");
    assert!(r.commit(meta(0)));
    assert!(wait_until(Duration::from_secs(20), || {
        sink.0.lock().unwrap().len() == 1
    }));
    let a = live.reserve(10, Duration::from_secs(10)).unwrap();
    let b = live.reserve(10, Duration::from_secs(10)).unwrap();
    // Two in use: a live reservation that waits less than its patience finds free blocks but
    // may not take one ...
    assert_eq!(
        live.reserve(10, LIVE_IN_PLACE_PATIENCE / 4).unwrap_err(),
        NotReserved::TimedOut
    );
    // ... a lossless one may.
    drop(lossless.reserve(10, Duration::ZERO).unwrap());
    // A live one that waits takes a free block beyond the limit once out of patience.
    let started = std::time::Instant::now();
    let c = live.reserve(10, Duration::from_secs(10)).unwrap();
    assert!(started.elapsed() >= LIVE_IN_PLACE_PATIENCE);
    // One that would not wait at all takes a free block at once, beyond the limit (its caller
    // would copy the frame instead: `push_rendering_here`).
    let d = live.reserve(10, Duration::ZERO).unwrap();
    // The block freed last is taken first (FIFO would give back the oldest free one).
    let last = b.block();
    drop(d);
    drop(c);
    drop(a);
    drop(b);
    assert_eq!(live.reserve(10, Duration::ZERO).unwrap().block(), last);
    live.end();
    lossless.end();
    assert_eq!(s.finish(Duration::from_secs(20)).unwrap().unsent, 0);
    receiver.stop();
}

/// A reservation still outstanding when its device ends does not hold the sender up: it
/// finishes, the late commit is refused, and reserving after the stop says so.
#[test]
fn a_sender_finishes_with_a_reservation_outstanding() {
    use rdmastream::engine::NotReserved;
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(4, 4096, vec![]));
    let (sink, receiver) = hoarding(Box::new(listener));
    let opts = SenderOptions {
        name: "outstanding".into(),
        key: Some(key()),
        send_blocks: 4,
        block_size: 4096,
        in_place_blocks: 2,
        ..Default::default()
    };
    let s = SenderHandle::start(opts, Box::new(fabric.connector("rx")), 4).unwrap();
    let input = s.add_device(1, DropPolicy::Block);
    let mut first = input.reserve(10, Duration::from_secs(10)).unwrap();
    first.payload_mut().copy_from_slice(b"0123456789");
    assert!(first.commit(meta(0)));
    let outstanding = input.reserve(10, Duration::from_secs(10)).unwrap();
    input.end();
    let started = std::time::Instant::now();
    assert_eq!(s.finish(Duration::from_secs(20)).unwrap().unsent, 0);
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(wait_until(Duration::from_secs(10), || receiver.all_senders_ended()));
    assert_eq!(sink.0.lock().unwrap().len(), 1);
    assert!(!outstanding.commit(meta(1)));
    assert_eq!(
        input.reserve(10, Duration::from_secs(1)).unwrap_err(),
        NotReserved::Stopped
    );
    receiver.stop();
}

/// `push_rendering_here` renders a one-block frame on the source's own thread into a reserved
/// block (not on the filling thread), a frame of several blocks falls back to the filling
/// thread, and both arrive bit-exact and in order with a frame pushed as bytes between them.
#[test]
fn frames_rendered_on_the_sources_thread_arrive_bit_exact_in_order() {
    use rdmastream::engine::{FrameData, SourceFrame};
    const BLOCK: usize = 4096;
    let cap = rdmastream::proto::payload_capacity(BLOCK);
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(4, BLOCK, vec![]));
    let (sink, receiver) = hoarding(Box::new(listener));
    let opts = SenderOptions {
        name: "render-here".into(),
        key: Some(key()),
        // More in-place blocks than the stream's one-block rendered frames (3), and more filling
        // blocks than the rest takes (10), so an in-place block is always free when a one-block
        // frame comes (the filling thread borrows one only when none of its own is): which
        // thread renders it does not depend on timing.
        send_blocks: 32,
        in_place_blocks: 16,
        block_size: BLOCK,
        ..Default::default()
    };
    let s = SenderHandle::start(opts, Box::new(fabric.connector("rx")), 4).unwrap();
    let input = s.add_device(2, DropPolicy::Block);
    let lens = [cap, 100, 3 * cap + 5, cap - 1];
    let writers: Vec<Arc<Rendered>> = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            Arc::new(Rendered {
                seed: i as u8,
                len,
                calls: Default::default(),
                threads: Default::default(),
            })
        })
        .collect();
    let source = {
        let (input, writers) = (input.clone(), writers.clone());
        std::thread::Builder::new()
            .name("camera-7".into())
            .spawn(move || {
                let frame = |index: u64, data: FrameData| SourceFrame {
                    index,
                    timestamp_ns: 1,
                    duration_ns: 0,
                    pts_ns: None,
                    format: "x".into(),
                    data,
                };
                let mut index = 0;
                for w in writers {
                    assert!(input.push_rendering_here(frame(index, FrameData::Render(w))));
                    index += 1;
                    // A copied frame between the rendered ones keeps its place.
                    let bytes = Rendered::bytes(200 + index as u8, 77);
                    assert!(input.push_rendering_here(frame(index, bytes.into())));
                    index += 1;
                }
                input.end();
            })
            .unwrap()
    };
    source.join().unwrap();
    drop(input);
    // The three one-block rendered frames went in place, counted as such.
    assert_eq!(get(&s.counters().device(&2).in_place), 3);
    s.finish(Duration::from_secs(20)).unwrap();
    assert!(wait_until(Duration::from_secs(20), || {
        receiver.all_senders_ended()
    }));
    receiver.stop();
    let got = sink.0.lock().unwrap().clone();
    assert_eq!(
        got.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        (0..8).collect::<Vec<_>>()
    );
    for (k, w) in writers.iter().enumerate() {
        assert_eq!(
            got[2 * k].1,
            Rendered::bytes(w.seed, w.len),
            "frame {}",
            2 * k
        );
        assert_eq!(
            got[2 * k + 1].1,
            Rendered::bytes(200 + (2 * k + 1) as u8, 77)
        );
        let threads = w.threads.lock().unwrap().clone();
        if w.len <= cap {
            assert_eq!(
                threads,
                vec![Some("camera-7".to_string())],
                "frame {}",
                2 * k
            );
        } else {
            assert!(
                threads.iter().all(|t| t.as_deref() == Some("filling")),
                "a frame of several blocks is rendered by the filling thread: {threads:?}"
            );
        }
    }
}

/// Sources holding every in-place block (reserved, then committed late) never starve the
/// filling thread: a lossless device's two-block frames, which the sender keeps until the
/// receiver confirms them, still go meanwhile, and everything arrives once the reservations
/// are committed. (With one free list, reservations could take all blocks but one; the
/// filling thread then waited for ever for the second block of such a frame, while the
/// committed frames that would have freed blocks sat in a queue behind it.)
#[test]
fn reservations_never_starve_a_lossless_device_of_send_blocks() {
    use rdmastream::engine::NotReserved;
    const BLOCK: usize = 4096;
    let cap = rdmastream::proto::payload_capacity(BLOCK);
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(4, BLOCK, vec![]));
    let (sink, receiver) = hoarding(Box::new(listener));
    let opts = SenderOptions {
        name: "starve".into(),
        key: Some(key()),
        send_blocks: 6,
        in_place_blocks: 3,
        block_size: BLOCK,
        ..Default::default()
    };
    let s = SenderHandle::start(opts, Box::new(fabric.connector("rx")), 8).unwrap();
    let reserving = s.add_device(1, DropPolicy::Block);
    let pushing = s.add_device(2, DropPolicy::Block);
    let mut held = Vec::new();
    loop {
        match reserving.reserve(100, Duration::from_millis(200)) {
            Ok(r) => held.push(r),
            Err(e) => {
                assert_eq!(e, NotReserved::TimedOut);
                break;
            }
        }
    }
    assert_eq!(held.len(), 3, "every in-place block, and no other");
    let big = |i: u64| Rendered::bytes(50 + i as u8, cap + 100);
    for i in 0..6 {
        assert!(pushing.push(octets(i, big(i))));
    }
    pushing.end();
    assert!(
        wait_until(Duration::from_secs(10), || sink.0.lock().unwrap().len()
            == 6),
        "the lossless device's frames went while the in-place blocks were held"
    );
    for (k, mut r) in held.into_iter().enumerate() {
        r.payload_mut()
            .copy_from_slice(&Rendered::bytes(k as u8, 100));
        assert!(r.commit(meta(k as u64)));
    }
    reserving.end();
    let report = s.finish(Duration::from_secs(20)).unwrap();
    assert_eq!((report.unsent, report.undelivered_frames), (0, 0));
    assert!(wait_until(Duration::from_secs(10), || receiver.all_senders_ended()));
    receiver.stop();
    let got = sink.0.lock().unwrap().clone();
    let want: Vec<_> = (0..6u64)
        .map(|i| (i, big(i)))
        .chain((0..3u64).map(|k| (k, Rendered::bytes(k as u8, 100))))
        .collect();
    assert_eq!(got.len(), want.len());
    for ((i, d), (wi, wd)) in got.iter().zip(&want) {
        assert_eq!((i, &d[..]), (wi, &wd[..]));
    }
}

/// A sender without in-place blocks (the default) refuses reservations, and
/// `push_rendering_here` then pushes: the filling thread renders the frame.
#[test]
fn without_in_place_blocks_frames_are_rendered_by_the_filling_thread() {
    use rdmastream::engine::{FrameData, NotReserved};
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(4, 4096, vec![]));
    let (sink, receiver) = hoarding(Box::new(listener));
    let opts = SenderOptions {
        name: "no-in-place".into(),
        key: Some(key()),
        send_blocks: 4,
        block_size: 4096,
        ..Default::default()
    };
    let s = SenderHandle::start(opts, Box::new(fabric.connector("rx")), 4).unwrap();
    let input = s.add_device(1, DropPolicy::Block);
    assert_eq!(
        input.reserve(10, Duration::from_secs(1)).unwrap_err(),
        NotReserved::Unavailable
    );
    let w = Arc::new(Rendered {
        seed: 7,
        len: 1000,
        calls: Default::default(),
        threads: Default::default(),
    });
    let source = {
        let (input, w) = (input.clone(), w.clone());
        std::thread::Builder::new()
            .name("camera-1".into())
            .spawn(move || {
                assert!(input.push_rendering_here(octets(0, FrameData::Render(w))));
                input.end();
            })
            .unwrap()
    };
    source.join().unwrap();
    drop(input);
    assert_eq!(get(&s.counters().device(&1).in_place), 0);
    s.finish(Duration::from_secs(20)).unwrap();
    assert!(wait_until(Duration::from_secs(10), || receiver.all_senders_ended()));
    receiver.stop();
    assert_eq!(
        sink.0.lock().unwrap()[0].1[..],
        Rendered::bytes(7, 1000)[..]
    );
    let threads = w.threads.lock().unwrap().clone();
    assert!(
        !threads.contains(&Some("camera-1".to_string())),
        "rendered by the filling thread: {threads:?}"
    );
}

/// A drop-oldest device whose queue is full drops a committed reservation like any frame: it
/// is counted as dropped, never sent, and its in-place block comes back (once everything else is
/// delivered the device reserves it again).
#[test]
fn a_dropped_committed_frame_gives_its_in_place_block_back() {
    let fabric = MemFabric::new();
    let opts = SenderOptions {
        name: "drop-committed".into(),
        key: Some(key()),
        send_blocks: 2,
        in_place_blocks: 1,
        block_size: 4096,
        reconnect_min: Duration::from_millis(20),
        reconnect_max: Duration::from_millis(50),
        ..Default::default()
    };
    // No receiver yet: nothing is sent, so the filling thread soon waits for a block.
    let s = SenderHandle::start(opts, Box::new(fabric.connector("rx")), 2).unwrap();
    let pushing = s.add_device(2, DropPolicy::DropOldest);
    let reserving = s.add_device(1, DropPolicy::DropOldest);
    let frame = |index: u64, byte: u8| octets(index, vec![byte; 100]);
    let mut r = reserving.reserve(100, Duration::from_secs(5)).unwrap();
    r.payload_mut().fill(0xAA);
    // The filling thread takes its one block for device 2's format and then waits for a block
    // for its first frame (the other is reserved), so what comes next stays queued...
    assert!(pushing.push(frame(0, 1)));
    assert!(pushing.push(frame(1, 2)));
    std::thread::sleep(Duration::from_millis(300));
    assert!(r.commit(meta(0)));
    assert!(reserving.push(frame(1, 3)));
    // ...and this frame pushes the committed one out of the two-deep queue.
    assert!(reserving.push(frame(2, 4)));
    let counters = s.counters().device(&1);
    assert!(wait_until(Duration::from_secs(5), || get(&counters.drops) == 1));
    let listener = fabric.listen("rx", settings(4, 4096, vec![]));
    let (sink, receiver) = hoarding(Box::new(listener));
    let delivered = wait_until(Duration::from_secs(10), || {
        sink.0.lock().unwrap().len() == 4
    });
    let mut got: Vec<u8> = sink.0.lock().unwrap().iter().map(|(_, d)| d[0]).collect();
    got.sort();
    assert!(delivered, "{got:?}");
    assert_eq!(
        got,
        vec![1, 2, 3, 4],
        "the dropped frame (0xAA) is not sent"
    );
    // Every block is back: the in-place one can be reserved again.
    let again = reserving.reserve(100, Duration::from_secs(5));
    assert!(again.is_ok(), "{:?}", again.err());
    drop(again);
    reserving.end();
    pushing.end();
    s.finish(Duration::from_secs(10)).unwrap();
    receiver.stop();
}

/// A frame pushed into a drop-oldest device's full queue waits a moment for room
/// (`DROP_OLDEST_PATIENCE`) before the oldest queued frame is dropped for it: a source faster
/// than the link leaves the threads that empty the queue their turn instead of taking their
/// core (docs/benchmarks.md, "A moment's wait under drop-oldest").
#[test]
fn a_frame_pushed_into_a_full_drop_oldest_queue_waits_a_moment_before_one_is_dropped() {
    let fabric = MemFabric::new();
    let opts = SenderOptions {
        name: "drop-moment".into(),
        key: Some(key()),
        send_blocks: 1,
        block_size: 4096,
        reconnect_min: Duration::from_millis(20),
        reconnect_max: Duration::from_millis(50),
        ..Default::default()
    };
    // No receiver: the filling thread fills its one block and then waits for another, so the
    // two-deep queue fills and stays full.
    let s = SenderHandle::start(opts, Box::new(fabric.connector("rx")), 2).unwrap();
    let input = s.add_device(1, DropPolicy::DropOldest);
    let frame = |index: u64| octets(index, vec![index as u8; 100]);
    for i in 0..4 {
        assert!(input.push(frame(i)));
    }
    let counters = s.counters().device(&1);
    std::thread::sleep(Duration::from_millis(300));
    // The filling thread holds two frames now (one in its block, one waiting for another), and
    // the queue two more, unless the filling thread took the device in only after the pushes
    // above: then two of them were dropped meanwhile, it took the other two, and the queue has
    // room for two (a loaded CI run once pushed into it without waiting). Two more pushes fill
    // it either way; the next one finds it full.
    for i in 4..6 {
        assert!(input.push(frame(i)));
    }
    let dropped = get(&counters.drops);
    let started = std::time::Instant::now();
    assert!(input.push(frame(6)));
    let waited = started.elapsed();
    let moment = rdmastream::engine::sender::DROP_OLDEST_PATIENCE;
    assert!(
        waited >= moment,
        "the push waited {waited:?}, not {moment:?}"
    );
    assert_eq!(
        get(&counters.drops),
        dropped + 1,
        "one queued frame dropped for it"
    );
    input.end();
    drop(input);
    drop(s);
}

/// Frame `index` of 100 bytes of `byte`, captured at `ts` (ns).
fn stamped(index: u64, ts: u64, byte: u8) -> rdmastream::engine::SourceFrame {
    rdmastream::engine::SourceFrame {
        timestamp_ns: ts,
        ..octets(index, vec![byte; 100])
    }
}

/// A sender with 3 send blocks of 4096 bytes, one of them in place (so the filling thread has
/// two: a device's format and its first frame), and a two-deep queue, on `connector`.
fn one_in_place(name: &str, connector: Box<dyn Connector>) -> SenderHandle {
    let opts = SenderOptions {
        name: name.into(),
        key: Some(key()),
        send_blocks: 3,
        in_place_blocks: 1,
        block_size: 4096,
        reconnect_min: Duration::from_millis(20),
        reconnect_max: Duration::from_millis(50),
        ..Default::default()
    };
    SenderHandle::start(opts, connector, 2).unwrap()
}

/// A drop-oldest frame a source writes itself (`push_writing_here`) while the device's previous
/// frame is still on its way (the link is behind this source) waits a moment
/// (`DROP_OLDEST_PATIENCE`) for a block before it is pushed for the filling thread to copy: a
/// source faster than the link leaves the threads that free blocks their turn.
#[test]
fn a_drop_oldest_frame_written_here_waits_a_moment_while_its_previous_frame_is_on_its_way() {
    let fabric = MemFabric::new();
    // No receiver: nothing is ever written, so device 1's first frame stays on its way.
    let s = one_in_place("behind", Box::new(fabric.connector("rx")));
    let input = s.add_device(1, DropPolicy::DropOldest);
    let other = s.add_device(2, DropPolicy::DropOldest);
    // The one in-place block, held by another device: none is free for device 1's frames.
    let held = other.reserve(100, Duration::from_secs(5)).unwrap();
    let started = std::time::Instant::now();
    assert!(input.push_writing_here(stamped(0, 10, 1)));
    let first = started.elapsed();
    // The filling thread copies it (after the device's format) into its blocks, so nothing of
    // device 1 waits in its queue, and hands them to the sending thread, which has no
    // connection.
    std::thread::sleep(Duration::from_millis(300));
    let started = std::time::Instant::now();
    assert!(input.push_writing_here(stamped(1, 20, 2)));
    let waited = started.elapsed();
    let moment = rdmastream::engine::sender::DROP_OLDEST_PATIENCE;
    assert!(
        waited >= moment,
        "the frame waited {waited:?} for a block, not {moment:?} (the first, with nothing \
         before it, {first:?})"
    );
    drop(held);
    input.end();
    other.end();
    drop((input, other));
    drop(s);
}

/// When the device's previous frame is through and the blocks are busy with another device's
/// frames (cameras falling due together), a drop-oldest frame written here does not wait for a
/// block: it is pushed at once, for the filling thread. Timed against the same device's frames
/// while the block was free (the fastest of five each, so a slow machine or a stall does not
/// decide it): a frame that waited its moment is slower than those by at least that.
#[test]
fn a_drop_oldest_frame_written_here_is_pushed_at_once_when_its_previous_frame_is_through() {
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(4, 4096, vec![]));
    let (sink, receiver) = hoarding(Box::new(listener));
    let s = one_in_place("through", Box::new(fabric.connector("rx")));
    let input = s.add_device(1, DropPolicy::DropOldest);
    let other = s.add_device(2, DropPolicy::DropOldest);
    let counters = s.counters().device(&1);
    let moment = rdmastream::engine::sender::DROP_OLDEST_PATIENCE;
    // Hands in five frames, each once the one before is through; how long each took.
    let frames = |first: u64| -> Vec<Duration> {
        (first..first + 5)
            .map(|i| {
                let started = std::time::Instant::now();
                assert!(input.push_writing_here(stamped(i, 10 + 10 * i, i as u8)));
                let took = started.elapsed();
                assert!(
                    wait_until(Duration::from_secs(10), || get(&counters.frames) == i + 1),
                    "frame {i} of device 1 never got through"
                );
                took
            })
            .collect()
    };
    let free = frames(0);
    // The one in-place block, held by another device from here on.
    let held = other.reserve(100, Duration::from_secs(5)).unwrap();
    let busy = frames(5);
    let fastest = |t: &[Duration]| *t.iter().min().unwrap();
    assert!(
        fastest(&busy) < fastest(&free) + moment / 2,
        "the frames that found no block free took {busy:?}, those with one free {free:?}: they \
         waited for a block although the previous frame was through"
    );
    drop(held);
    input.end();
    other.end();
    s.finish(Duration::from_secs(10)).unwrap();
    receiver.stop();
    assert_eq!(sink.0.lock().unwrap().len(), 10);
}

/// A sender over shm with 4 send blocks of 4096 bytes, `in_place_blocks` of them in place (so it
/// lends the receiver's blocks), and a receiver handing every frame to `sink` (a [`Hoard`] by
/// default) on a fresh socket (`path`, inside `_dir`) with 8 blocks.
struct LendingPair<S = Hoard> {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    sink: Arc<S>,
    receiver: ReceiverHandle,
    sender: SenderHandle,
}

fn lending_over_shm(name: &str, in_place_blocks: usize) -> LendingPair {
    lending_over_shm_into(name, in_place_blocks)
}

/// [`lending_over_shm`] with a sink of type `S`.
fn lending_over_shm_into<S: rdmastream::engine::FrameSink + Default + 'static>(
    name: &str,
    in_place_blocks: usize,
) -> LendingPair<S> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rx.sock");
    let listener = rdmastream_verbs::shm::listen(&path, settings(8, 4096, vec![])).unwrap();
    let addr = listener.local_addr();
    let sink = Arc::new(S::default());
    let receiver =
        ReceiverHandle::start(ReceiverOptions::default(), Box::new(listener), sink.clone())
            .unwrap();
    let opts = SenderOptions {
        name: name.into(),
        key: Some(key()),
        send_blocks: 4,
        block_size: 4096,
        in_place_blocks,
        reconnect_min: Duration::from_millis(20),
        reconnect_max: Duration::from_millis(100),
        ..Default::default()
    };
    let connector = rdmastream_verbs::shm::ShmConnector::new(&addr).unwrap();
    let sender = SenderHandle::start(opts, Box::new(connector), 1024).unwrap();
    LendingPair {
        _dir: dir,
        path,
        sink,
        receiver,
        sender,
    }
}

/// Waits until the sending thread offers `input` a block of the receiver's memory (once
/// connected over shm it lends); the reservation taken to see it is let go, so the block is on
/// offer again.
fn await_lending(input: &rdmastream::engine::DeviceInput) {
    assert!(
        wait_until(Duration::from_secs(10), || input
            .reserve(10, Duration::from_millis(20))
            .is_ok_and(|r| r.is_remote())),
        "no block of the receiver's memory was ever offered"
    );
}

/// Over shm a lossy device's reservations are blocks of the receiver's memory itself
/// (`Reservation::is_remote`): the frame is written once, there, and the sender posts only its
/// status byte. Such frames arrive bit-exact and in order between pushed ones (which take the
/// ordinary path); an abandoned one is offered again; a lossless device never gets one (the
/// sender keeps no copy to send again); and the machine counts one status-only chain per frame.
#[test]
fn reserved_frames_over_shm_are_written_into_the_receivers_blocks() {
    let cap = rdmastream::proto::payload_capacity(4096);
    // `_dir` bound, so the socket's directory lives as long as the test.
    let LendingPair {
        _dir,
        sink,
        receiver,
        sender: s,
        ..
    } = lending_over_shm("lent", 2);
    let input = s.add_device(3, DropPolicy::DropOldest);
    let lossless = s.add_device(4, DropPolicy::Block);
    let wait = Duration::from_secs(10);
    await_lending(&input);
    for _ in 0..5 {
        let r = lossless.reserve(10, wait).unwrap();
        assert!(!r.is_remote(), "a lossless device got a receiver's block");
    }
    lossless.end();
    // An abandoned receiver's block is offered again, or reservations would run out of them.
    let (want, remote) = reserve_and_push(&input, 60, 4, cap);
    input.end();
    let report = finish_delivered(s, &receiver, wait);
    assert_hoarded(&sink, &want);
    // Reservations got a receiver's block when one was on offer (otherwise an in-place send
    // block, as when none is free the moment after a commit), and each such frame cost one
    // status-only chain instead of a copy; so may pushed frames, which the filling thread then
    // writes straight into a receiver's block.
    assert!(remote > 0, "no frame went into the receiver's blocks");
    assert!(report.machine.placed >= remote as u64);
    assert!(report.machine.placed <= 60);
    assert_eq!(report.machine.stale_placed, 0);
    receiver.stop();
}

/// `push_writing_here` copies a frame handed over as bytes (as the sender binary's GStreamer
/// sources hand their samples over) on the caller's thread into a reserved block (over shm a
/// block of the receiver's memory when one is on offer) and commits it; a frame larger than a
/// block is pushed, and the filling thread splits it. Every frame arrives bit-exact and in order.
#[test]
fn frames_of_bytes_are_copied_on_the_sources_thread_into_reserved_blocks() {
    let cap = rdmastream::proto::payload_capacity(4096);
    let LendingPair {
        _dir,
        sink,
        receiver,
        sender: s,
        ..
    } = lending_over_shm("copy-here", 2);
    let input = s.add_device(5, DropPolicy::DropOldest);
    let wait = Duration::from_secs(10);
    await_lending(&input);
    let mut want = Vec::new();
    for index in 0..40u64 {
        let len = if index % 10 == 5 {
            3 * cap + 7
        } else {
            [cap, 100, 1, cap - 1][index as usize % 4]
        };
        let bytes = Rendered::bytes(index as u8, len);
        assert!(input.push_writing_here(octets(index, bytes.clone())));
        want.push((index, bytes));
    }
    input.end();
    let in_place = get(&s.counters().device(&5).in_place);
    let report = finish_delivered(s, &receiver, wait);
    assert_hoarded(&sink, &want);
    assert!(in_place > 0, "no frame was copied into a reserved block");
    assert!(
        in_place <= 36,
        "a frame larger than a block was reserved: {in_place}"
    );
    assert!(
        report.machine.placed > 0,
        "nothing went into the receiver's blocks"
    );
    receiver.stop();
}

/// A [`Hoard`] whose receiver can be held back: while the gate is shut, `handle` waits (so the
/// receiver frees no block).
#[derive(Default)]
struct GatedHoard {
    hoard: Hoard,
    shut: std::sync::Mutex<bool>,
    opened: std::sync::Condvar,
}

impl GatedHoard {
    fn set_shut(&self, shut: bool) {
        *self.shut.lock().unwrap() = shut;
        self.opened.notify_all();
    }
}

impl rdmastream::engine::FrameSink for GatedHoard {
    fn handle(
        &self,
        key: &rdmastream::engine::StreamKey,
        sender: u64,
        counters: &Arc<rdmastream::stats::DeviceCounters>,
        event: rdmastream::proto::StreamEvent,
    ) {
        let mut shut = self.shut.lock().unwrap();
        while *shut {
            shut = self.opened.wait(shut).unwrap();
        }
        drop(shut);
        self.hoard.handle(key, sender, counters, event);
    }
}

/// Over shm, while the sending thread lends no receiver's block because blocks queued before
/// wait for the receiver's free ones, a lossy device's reservation waits a moment
/// (`LENT_PATIENCE`) for one before it takes a send block of its own, which would be copied and
/// queued behind the others (a stream that had fallen behind once stayed on send blocks for
/// 10–40 ms, docs/benchmarks.md, "Back to the receiver's blocks after a stall"); with a zero timeout it takes
/// the send block at once. Once the receiver catches up, reservations get receiver's blocks
/// again, and every frame arrives in order, bit-exact.
#[test]
fn a_reservation_waits_a_moment_for_a_receivers_block_while_the_sender_is_behind() {
    let patience = rdmastream::engine::sender::LENT_PATIENCE;
    let LendingPair {
        _dir,
        sink,
        receiver,
        sender: s,
        ..
    } = lending_over_shm_into::<GatedHoard>("behind", 2);
    let input = s.add_device(1, DropPolicy::DropOldest);
    let wait = Duration::from_secs(10);
    // Frame i is the i-th sent, 100 bytes of i.
    let mut want = Vec::new();
    let commit = |mut r: rdmastream::engine::Reservation, want: &mut Vec<(u64, Vec<u8>)>| {
        let index = want.len() as u64;
        let bytes = vec![index as u8; 100];
        r.payload_mut().copy_from_slice(&bytes);
        assert!(r.commit(meta(index)));
        want.push((index, bytes));
    };
    // Connected and lending.
    let mut first = None;
    assert!(wait_until(wait, || {
        first = input
            .reserve(100, Duration::from_millis(20))
            .ok()
            .filter(|r| r.is_remote());
        first.is_some()
    }));
    commit(first.take().unwrap(), &mut want);
    assert!(wait_until(wait, || sink.hoard.0.lock().unwrap().len() == 1));
    // The receiver held back: pushed frames fill its 8 blocks, then two of the filling thread's
    // 4 send blocks wait in the queue for a free one (with more it would borrow the in-place
    // blocks too).
    sink.set_shut(true);
    // Opened again however the test ends, so that the receiver can stop.
    struct Reopen<'a>(&'a GatedHoard);
    impl Drop for Reopen<'_> {
        fn drop(&mut self) {
            self.0.set_shut(false);
        }
    }
    let _reopen = Reopen(&sink);
    for _ in 0..10 {
        let index = want.len() as u64;
        let bytes = vec![index as u8; 100];
        assert!(input.push(octets(index, bytes.clone())));
        want.push((index, bytes));
    }
    std::thread::sleep(Duration::from_millis(100));
    // Receiver's blocks still on offer from before go to frames first.
    loop {
        let r = input
            .reserve(100, Duration::ZERO)
            .expect("an in-place block is free");
        if !r.is_remote() {
            // Back to the free list: the next reservation finds it free.
            drop(r);
            break;
        }
        commit(r, &mut want);
    }
    let t0 = std::time::Instant::now();
    let r = input.reserve(100, wait).expect("an in-place block is free");
    let waited = t0.elapsed();
    assert!(
        !r.is_remote(),
        "nothing can be lent while the receiver is held back"
    );
    assert!(
        waited >= patience,
        "took a send block after {waited:?}, without waiting {patience:?} for a receiver's block"
    );
    drop(r);
    let r = input
        .reserve(100, Duration::ZERO)
        .expect("a zero timeout takes a free block");
    assert!(!r.is_remote());
    commit(r, &mut want);
    // The receiver catches up: receiver's blocks are lent again.
    sink.set_shut(false);
    let mut remote = false;
    assert!(wait_until(wait, || {
        let r = input.reserve(100, Duration::from_millis(20)).unwrap();
        remote = r.is_remote();
        commit(r, &mut want);
        remote
    }));
    input.end();
    let report = s.finish(Duration::from_secs(20)).unwrap();
    assert_eq!(report.unsent, 0);
    assert!(wait_until(wait, || receiver.all_senders_ended()));
    assert_hoarded(&sink.hoard, &want);
    receiver.stop();
}

/// Over shm a frame a source wrote into a receiver's block and commits while the sending thread
/// sleeps has its status byte stored by the committing thread itself (counted in
/// `SenderReport::driven_here`), without a wake-up of the sending thread, and arrives. Frames
/// are committed one at a time, each once the one before arrived, so the sending thread has
/// gone back to sleep in between (under a burst, hand-overs that find it at work, or its
/// channel not empty, go through it, as they must).
#[test]
fn a_frame_committed_while_the_sending_thread_sleeps_is_posted_by_the_committing_thread() {
    let cap = rdmastream::proto::payload_capacity(4096);
    let LendingPair {
        _dir,
        sink,
        receiver,
        sender: s,
        ..
    } = lending_over_shm("here", 2);
    let input = s.add_device(3, DropPolicy::DropOldest);
    let wait = Duration::from_secs(10);
    let want = commit_one_at_a_time(&input, cap, &sink, wait);
    input.end();
    let report = finish_delivered(s, &receiver, wait);
    assert_hoarded(&sink, &want);
    receiver.stop();
    assert!(
        report.driven_here >= 10,
        "of 20 frames committed one at a time, {} were posted on the committing thread: {report:?}",
        report.driven_here
    );
}

/// Over tcp a frame committed on an idle link (nothing queued or in flight, nothing moved for
/// `IDLE_BEFORE_POSTING_HERE`) by a sender's lone device is posted by the committing thread
/// itself, without waiting for the sending thread to be woken first
/// (`SenderReport::driven_here`), and arrives. Frames come one at a time, each once the one
/// before arrived, 5 ms apart, as a camera's would.
#[test]
fn a_frame_committed_on_an_idle_tcp_link_is_posted_by_the_committing_thread() {
    assert!(rdmastream::engine::IDLE_BEFORE_POSTING_HERE < Duration::from_millis(5));
    let report = one_at_a_time_over_tcp(1, false);
    assert!(
        report.driven_here >= 10,
        "of 20 frames committed one at a time, {} were posted on the committing thread: {report:?}",
        report.driven_here
    );
}

/// The same with a second device on the sender (silent here): no frame is posted on the
/// committing thread. With a dozen cameras each posting on its own thread, one held the
/// connection through its writev while the others' frames waited, and the demo's p99 rose
/// (docs/benchmarks.md, "Posting on the handing thread over tcp").
#[test]
fn with_two_devices_no_frame_is_posted_by_the_committing_thread_over_tcp() {
    let report = one_at_a_time_over_tcp(2, false);
    assert_eq!(report.driven_here, 0, "{report:?}");
}

/// A lossless device's pushed frames go through the filling thread, which copies them into send
/// blocks and leaves every post to the sending thread, also on an idle tcp link with one device
/// (tried and reverted: `Handoff::send`), and every frame arrives.
#[test]
fn a_lone_lossless_devices_pushed_frames_are_posted_by_the_sending_thread() {
    let report = one_at_a_time_over_tcp(1, true);
    assert_eq!(report.driven_here, 0, "{report:?}");
    let report = one_at_a_time_over_tcp(2, true);
    assert_eq!(report.driven_here, 0, "{report:?}");
}

/// Sends 20 frames from the first of `devices` devices over tcp, one at a time, each once the
/// one before arrived, 5 ms apart (committed in place by a live device; pushed, copied by the
/// filling thread, by a lossless one if `lossless_pushed`), checks they all arrived intact and
/// returns the report.
fn one_at_a_time_over_tcp(devices: u8, lossless_pushed: bool) -> rdmastream::engine::SenderReport {
    const BLOCK: usize = 64 << 10;
    let cap = rdmastream::proto::payload_capacity(BLOCK);
    let listener = tcp::listen("127.0.0.1:0", settings(8, BLOCK, vec![])).unwrap();
    let addr = listener.local_addr();
    let (sink, receiver) = hoarding(Box::new(listener));
    let opts = SenderOptions {
        name: "idle".into(),
        key: Some(key()),
        send_blocks: 4,
        block_size: BLOCK,
        in_place_blocks: 2,
        ..Default::default()
    };
    let s = SenderHandle::start(opts, Box::new(TcpConnector::new(addr)), 4).unwrap();
    let inputs: Vec<_> = (0..devices)
        .map(|d| match lossless_pushed {
            true => s.add_device_with(3 + d, DropPolicy::Block, true),
            false => s.add_device(3 + d, DropPolicy::DropOldest),
        })
        .collect();
    let input = &inputs[0];
    let wait = Duration::from_secs(10);
    let want = match lossless_pushed {
        true => push_one_at_a_time(input, cap, &sink, wait),
        false => commit_one_at_a_time(input, cap, &sink, wait),
    };
    for input in &inputs {
        input.end();
    }
    let report = finish_delivered(s, &receiver, wait);
    assert_hoarded(&sink, &want);
    receiver.stop();
    report
}

/// Commits 20 frames of `cap` bytes from `input`, one at a time, each once the one before
/// arrived at `sink` (within `wait`), 5 ms apart, so the sending thread has gone back to sleep
/// in between; returns them as [`assert_hoarded`] wants them.
fn commit_one_at_a_time(
    input: &rdmastream::engine::DeviceInput,
    cap: usize,
    sink: &Hoard,
    wait: Duration,
) -> Vec<(u64, Vec<u8>)> {
    one_at_a_time(cap, sink, wait, |index, bytes| {
        let mut r = input.reserve(cap, wait).unwrap();
        r.payload_mut().copy_from_slice(bytes);
        assert!(r.commit(meta(index)));
    })
}

/// As [`commit_one_at_a_time`], with the frames pushed (copied into a send block by the filling
/// thread).
fn push_one_at_a_time(
    input: &rdmastream::engine::DeviceInput,
    cap: usize,
    sink: &Hoard,
    wait: Duration,
) -> Vec<(u64, Vec<u8>)> {
    one_at_a_time(cap, sink, wait, |index, bytes| {
        assert!(input.push(octets(index, bytes.to_vec())));
    })
}

/// Sends 20 frames of `cap` bytes with `send`, each once the one before arrived at `sink`, 5 ms
/// apart; returns them as [`assert_hoarded`] wants them.
fn one_at_a_time(
    cap: usize,
    sink: &Hoard,
    wait: Duration,
    mut send: impl FnMut(u64, &[u8]),
) -> Vec<(u64, Vec<u8>)> {
    let mut want = Vec::new();
    for index in 0..20u64 {
        let bytes = Rendered::bytes(index as u8, cap);
        send(index, &bytes);
        want.push((index, bytes));
        assert!(
            wait_until(wait, || sink.0.lock().unwrap().len() == want.len()),
            "frame {index} did not arrive"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    want
}

/// Frames pushed and frames committed in turn, from one thread, keep their order: a committed
/// frame goes straight to the sending thread only once every frame pushed before it is
/// planned. The filling thread's select takes a pushed frame out of the queue before it
/// takes the lock to plan it, so "the queue is empty" did not mean "planned", and a committed
/// frame could be numbered ahead of the frame pushed just before it (`QueueState::unplanned`).
#[test]
fn pushed_and_committed_frames_keep_their_order() {
    let cap = rdmastream::proto::payload_capacity(4096);
    let LendingPair {
        _dir,
        sink,
        receiver,
        sender: s,
        ..
    } = lending_over_shm("turns", 2);
    let input = s.add_device(5, DropPolicy::DropOldest);
    let (want, _) = reserve_and_push(&input, 1500, 2, cap);
    input.end();
    finish_delivered(s, &receiver, Duration::from_secs(20));
    assert_hoarded(&sink, &want);
    receiver.stop();
}

/// Over shm the filling thread writes the blocks of pushed lossy frames (fragments of frames
/// larger than a block included) straight into receiver's blocks the sending thread offers,
/// copying each frame once; a lossless device's frames never go there (they are kept until
/// confirmed). Both arrive bit-exact and in order.
#[test]
fn pushed_lossy_frames_over_shm_are_copied_once_into_the_receivers_blocks() {
    let cap = rdmastream::proto::payload_capacity(4096);
    // `_dir` bound, so the socket's directory lives as long as the test.
    let LendingPair {
        _dir,
        sink,
        receiver,
        sender: s,
        ..
    } = lending_over_shm("pushed", 1);
    let live = s.add_device(1, DropPolicy::DropOldest);
    let lossless = s.add_device(2, DropPolicy::Block);
    // Live frames carry even indices, lossless ones odd, so the hoard tells them apart.
    let lens = [cap, 2 * cap + 5, 0, 1, 700];
    let mut live_blocks = 0;
    let mut want = std::collections::BTreeMap::new();
    for k in 0..80u64 {
        let (input, index) = if k % 4 == 3 {
            (&lossless, 2 * k + 1)
        } else {
            (&live, 2 * k)
        };
        let len = lens[k as usize % lens.len()];
        if index % 2 == 0 {
            live_blocks += len.div_ceil(cap).max(1) as u64;
        }
        let bytes = Rendered::bytes(k as u8, len);
        assert!(input.push(octets(index, bytes.clone())));
        want.insert(index, bytes);
        if k % 8 == 0 {
            // Now and then the source waits, so the sending thread has blocks on offer.
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    live.end();
    lossless.end();
    let report = finish_delivered(s, &receiver, Duration::from_secs(10));
    let got = sink.0.lock().unwrap();
    let indices: Vec<u64> = got.iter().map(|(i, _)| *i).collect();
    for parity in [0, 1] {
        let of: Vec<u64> = indices
            .iter()
            .copied()
            .filter(|i| i % 2 == parity)
            .collect();
        let expect: Vec<u64> = want.keys().copied().filter(|i| i % 2 == parity).collect();
        assert_eq!(
            of, expect,
            "frames of parity {parity} missing or out of order"
        );
    }
    for (index, data) in got.iter() {
        assert_eq!(&data[..], &want[index][..], "frame {index}");
    }
    drop(got);
    assert!(
        report.machine.placed > 0,
        "no block went into the receiver's memory"
    );
    assert!(
        report.machine.placed <= live_blocks,
        "{} blocks placed, but the live device had only {live_blocks}",
        report.machine.placed
    );
    receiver.stop();
}

/// A receiver's block lent to a reservation belongs to its connection: when that receiver goes
/// away and another takes its place, a frame committed into the old block is counted as dropped
/// and never delivered anywhere, and the frames after it reach the new receiver.
#[test]
fn a_frame_written_into_a_gone_receivers_block_is_dropped_and_the_stream_goes_on() {
    let LendingPair {
        _dir,
        path,
        sink: first_sink,
        receiver: first,
        sender: s,
    } = lending_over_shm("epochs", 1);
    let input = s.add_device(1, DropPolicy::DropOldest);
    let wait = Duration::from_secs(10);
    let mut old = None;
    assert!(wait_until(wait, || {
        old = input
            .reserve(10, Duration::from_millis(20))
            .ok()
            .filter(|r| r.is_remote());
        old.is_some()
    }));
    let mut old = old.expect("a block of the first receiver's memory");
    old.payload_mut().copy_from_slice(b"old-region");
    first.stop();
    // The same path, a new receiver. Live frames pushed until one arrives there: from then on
    // the sender is on the new connection (earlier ones may have gone to the old region).
    let listener = rdmastream_verbs::shm::listen(&path, settings(8, 4096, vec![])).unwrap();
    let (sink, receiver) = hoarding(Box::new(listener));
    let mut next = 0u64;
    assert!(wait_until(wait, || {
        next += 1;
        assert!(input.push(octets(next, vec![next as u8; 100])));
        std::thread::sleep(Duration::from_millis(10));
        !sink.0.lock().unwrap().is_empty()
    }));
    let stale = next + 1;
    assert!(old.commit(meta(stale)), "the sender is running");
    for index in stale + 1..stale + 4 {
        assert!(input.push(octets(index, vec![index as u8; 100])));
    }
    input.end();
    let counters = s.counters().device(&1);
    let report = s.finish(Duration::from_secs(20)).unwrap();
    assert!(report.machine.stale_placed >= 1);
    assert!(counters.drops.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    assert!(wait_until(wait, || receiver.all_senders_ended()));
    let got: Vec<u64> = sink.0.lock().unwrap().iter().map(|(i, _)| *i).collect();
    assert!(
        !got.contains(&stale),
        "the frame of the old block arrived: {got:?}"
    );
    assert!(
        got.ends_with(&[stale + 1, stale + 2, stale + 3]),
        "the frames after it did not all arrive: {got:?}"
    );
    assert!(
        !first_sink
            .0
            .lock()
            .unwrap()
            .iter()
            .any(|(i, _)| *i == stale),
        "the frame of the old block reached the old receiver"
    );
    receiver.stop();
}

/// A lossy device's committed frame skips the filling thread when nothing needs it there: no
/// format due, nothing of the device queued before it, no small messages held. It is sealed on
/// the committing thread and handed straight to the sending thread, and still arrives in order
/// with the pushed frames around it and behind the format changes it needs (those frames go
/// through the filling thread). Over mem (in-place send blocks) and shm (the receiver's own
/// blocks, lent). Four of the frames are committed once everything before them arrived, so at
/// least those find the sending thread asleep whatever the machine's load.
#[test]
fn committed_frames_skip_the_filling_thread_and_keep_order_and_formats() {
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(8, 4096, vec![]));
    skip_the_filling_thread(Box::new(listener), Box::new(fabric.connector("rx")), false);
    let (_dir, listener, connector) = shm_endpoints(settings(8, 4096, vec![]));
    skip_the_filling_thread(listener, connector, false);
}

/// The same for a lossless device: its committed frames skip the filling thread too (its blocks
/// are kept until confirmed by the sending machine, not by the filling thread), over mem, shm
/// and tcp. Until 2026-11-29 every one went through the filling thread: one wake-up more per
/// frame (docs/benchmarks.md, "A lossless device's committed frames skip the filling
/// thread").
#[test]
fn committed_frames_of_a_lossless_device_skip_the_filling_thread_too() {
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(8, 4096, vec![]));
    skip_the_filling_thread(Box::new(listener), Box::new(fabric.connector("rx")), true);
    let (_dir, listener, connector) = shm_endpoints(settings(8, 4096, vec![]));
    skip_the_filling_thread(listener, connector, true);
    let listener = tcp::listen("127.0.0.1:0", settings(8, 4096, vec![])).unwrap();
    let addr = listener.local_addr();
    skip_the_filling_thread(Box::new(listener), Box::new(TcpConnector::new(addr)), true);
}

fn skip_the_filling_thread(
    listener: Box<dyn Listener>,
    connector: Box<dyn Connector>,
    reliable: bool,
) {
    let log = Arc::new(Events::default());
    let receiver =
        ReceiverHandle::start(ReceiverOptions::default(), listener, log.clone()).unwrap();
    let opts = SenderOptions {
        name: "direct".into(),
        key: Some(key()),
        send_blocks: 4,
        block_size: 4096,
        in_place_blocks: 2,
        ..Default::default()
    };
    let s = SenderHandle::start(opts, connector, 64).unwrap();
    // Waiting rather than dropping when its queue is full (lossy unless `reliable`): every
    // frame arrives.
    let input = s.add_device_with(5, DropPolicy::Block, reliable);
    let wait = Duration::from_secs(10);
    // What the receiver must hand on, in order: (what, detail) as `Events` records them.
    let mut want: Vec<(String, String)> = Vec::new();
    let frame = |index: u64, bytes: &[u8]| (format!("frame {index}"), digest(bytes));
    let commit = |index: u64, format: &str, want: &mut Vec<_>| {
        let bytes = Rendered::bytes(index as u8, 100 + index as usize);
        let mut r = input.reserve(bytes.len(), wait).unwrap();
        r.payload_mut().copy_from_slice(&bytes);
        let mut m = meta(index);
        m.format = format.into();
        assert!(r.commit(m));
        want.push(frame(index, &bytes));
    };
    for index in 0..40 {
        // A new format every 10 frames: its frame goes through the filling thread, which sends
        // the format ahead of it.
        let format = format!("application/x-test-{}", index / 10);
        if index % 10 == 0 {
            want.push(("format".into(), format.clone()));
        }
        if index % 7 == 3 {
            // A pushed frame, and at once a committed one behind it.
            let bytes = Rendered::bytes(index as u8, 50);
            let mut pushed = octets(index, bytes.clone());
            pushed.format = format.as_str().into();
            assert!(input.push(pushed));
            want.push(frame(index, &bytes));
        } else {
            if index % 10 == 5 {
                // Now and then everything so far arrives first and the sending thread goes back
                // to sleep, so this frame finds it asleep and goes direct, posted on this thread
                // (in a burst, or behind a backlog a slow connect left, every hand-over may find
                // it at work or its channel not empty: a loaded CI run once saw none driven here).
                assert!(
                    wait_until(wait, || handed_on(&log).len() == want.len()),
                    "frames before {index} did not arrive"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            commit(index, &format, &mut want);
        }
    }
    let direct = get(&s.counters().device(&5).direct);
    input.end();
    let report = s.finish(Duration::from_secs(20)).unwrap();
    assert_eq!(report.unsent, 0);
    // Over mem and shm work completes as it is posted: a committing source whose frame went
    // direct also posted it itself, whenever the sending thread was not at work; over tcp (a
    // lone device) at least the frames committed on an idle link were.
    assert!(report.driven_here > 0, "{report:?}");
    assert!(wait_until(wait, || receiver.all_senders_ended()));
    assert_eq!(handed_on(&log), want);
    // 31 of the 34 committed frames had no format due (0, 20 and 30 had); they went direct
    // unless the filling thread was busy the moment they were committed.
    assert!(direct > 0, "no committed frame skipped the filling thread");
    assert!(
        direct <= 31,
        "{direct} frames went direct, some with a format due"
    );
    receiver.stop();
}

/// The frames and formats the receiver handed on so far, in order, as (what, detail) (ends
/// left out).
fn handed_on(log: &Events) -> Vec<(String, String)> {
    log.0
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.2 != "end")
        .map(|e| (e.2.clone(), e.3.clone()))
        .collect()
}

/// A frame whose rendering panics, on the filling thread.
struct Exploding;

impl rdmastream::engine::FrameWriter for Exploding {
    fn len(&self) -> usize {
        100
    }
    fn write(&self, _: usize, _: &mut [u8]) {
        panic!("a source's frame writer failed");
    }
}

/// When the filling thread dies (here a source's frame writer panics on it), the sending thread
/// finishes what it has and stops by itself, as it did when the filling thread's end closed its
/// channel: the devices' inputs, which hand committed frames straight to the sending thread,
/// hold that channel open now.
#[test]
fn the_sending_thread_stops_when_the_filling_thread_dies() {
    let fabric = MemFabric::new();
    let listener = fabric.listen("rx", settings(4, 4096, vec![]));
    let (_sink, receiver) = hoarding(Box::new(listener));
    let opts = SenderOptions {
        name: "dies".into(),
        key: Some(key()),
        send_blocks: 4,
        block_size: 4096,
        in_place_blocks: 1,
        ..Default::default()
    };
    let s = SenderHandle::start(opts, Box::new(fabric.connector("rx")), 4).unwrap();
    // Kept alive: it holds a sender of the filling → sending channel.
    let input = s.add_device_with(1, DropPolicy::Block, false);
    let mut frame = octets(0, vec![1u8; 10]);
    frame.data = rdmastream::engine::FrameData::Render(Arc::new(Exploding));
    assert!(input.push(frame));
    assert!(
        wait_until(Duration::from_secs(10), || s.is_finished()),
        "the sending thread still runs after the filling thread died"
    );
    drop(input);
    receiver.stop();
}

/// Keeps each frame's index and [`digest`] and lets the frame itself go, so it
/// pins no receiver block and no reassembly memory (a [`Hoard`] of 20 MiB frames would hold
/// the receiver's whole reassembly budget and stall it, as it should).
#[derive(Default)]
struct Digests(std::sync::Mutex<Vec<(u64, String)>>);

impl rdmastream::engine::FrameSink for Digests {
    fn handle(
        &self,
        _: &rdmastream::engine::StreamKey,
        _: u64,
        _: &Arc<rdmastream::stats::DeviceCounters>,
        event: rdmastream::proto::StreamEvent,
    ) {
        rdmastream::proto::ack::settle(event.ack());
        if let rdmastream::proto::StreamEvent::Frame(f) = event {
            self.0.lock().unwrap().push((f.index, digest(&f.data)));
        }
    }
}

/// Over shm, blocks too large for the cache budget (4 MiB: four of them) make the sender keep
/// at most four of the receiver's eight blocks FULL and start messages in at most four of its
/// six send blocks (docs/protocol.md, "The working set on one host"). A lossless message of
/// five or six blocks still gets all of its blocks (only its first waits for the limit), and
/// every frame of two lossless devices arrives bit-exact and in order.
#[test]
fn lossless_messages_longer_than_the_shm_cache_budget_still_get_through() {
    let block_size = 4 << 20;
    let cap = rdmastream::proto::payload_capacity(block_size);
    // A 16 MiB budget whatever this host's cache: a limit of 4 blocks, fewer than a message's.
    let (_dir, listener, connector) =
        shm_endpoints_with_budget(settings(8, block_size, vec![]), Some(16 << 20));
    let sink = Arc::new(Digests::default());
    let receiver =
        ReceiverHandle::start(ReceiverOptions::default(), listener, sink.clone()).unwrap();
    let opts = SenderOptions {
        name: "budget".into(),
        key: Some(key()),
        send_blocks: 6,
        block_size,
        ..Default::default()
    };
    let s = SenderHandle::start(opts, connector, 64).unwrap();
    let long = s.add_device(1, DropPolicy::Block);
    let short = s.add_device(2, DropPolicy::Block);
    // Device 1's frames carry odd indices, device 2's even ones.
    let lens = [5 * cap - 3, 1000, 6 * cap, 3 * cap + 1];
    let mut want = std::collections::BTreeMap::new();
    for k in 0..12u64 {
        let bytes = Rendered::bytes(k as u8, lens[k as usize % lens.len()]);
        want.insert(2 * k + 1, digest(&bytes));
        assert!(long.push(octets(2 * k + 1, bytes)));
        let small = Rendered::bytes(100 + k as u8, 4096);
        want.insert(2 * k, digest(&small));
        assert!(short.push(octets(2 * k, small)));
    }
    long.end();
    short.end();
    finish_delivered(s, &receiver, Duration::from_secs(30));
    let got = sink.0.lock().unwrap();
    for parity in [0, 1] {
        let of: Vec<u64> = got
            .iter()
            .map(|d| d.0)
            .filter(|i| i % 2 == parity)
            .collect();
        let expect: Vec<u64> = want.keys().copied().filter(|i| i % 2 == parity).collect();
        assert_eq!(
            of, expect,
            "frames of parity {parity} missing or out of order"
        );
    }
    for (index, digest) in got.iter() {
        assert_eq!(digest, &want[index], "frame {index} differs");
    }
    drop(got);
    receiver.stop();
}
