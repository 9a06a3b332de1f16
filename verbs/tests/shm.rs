//! The shm transport between two ends in one process (separate processes: the process tests in
//! `integration/`): the handshake and its refusals, write chains and syncs through the shared
//! region, what a torn block looks like, and liveness both ways.

use std::sync::Arc;
use std::time::Duration;

use rdmastream::proto::handshake::{DataPath, Hello, Key, PROTOCOL_VERSION, QpInfo};
use rdmastream::proto::header::BlockHeader;
use rdmastream::proto::{Budget, status};
use rdmastream::transport::{
    Accepted, AccessControl, Completion, Connection, Connector, Keys, Kind, Listener,
    RegionSettings, RemoteAddr, SendBlocks, Target, WriteSource, WriteWr,
};
use rdmastream_testkit::wait_for;
use rdmastream_verbs::shm::{self, ShmConnector};
use rdmastream_verbs::{VerbsSettings, choose};

fn hello(name: &str, block_size: u32) -> Hello {
    Hello {
        version: PROTOCOL_VERSION,
        sender: name.into(),
        session: 7,
        block_size,
        data_path: DataPath::Tcp,
        qp: QpInfo::default(),
        nonce: [0; 32],
        mechanism: Default::default(),
    }
}

fn key(text: &str) -> Key {
    Key::new(text.as_bytes().to_vec()).unwrap()
}

struct Pair {
    _dir: tempfile::TempDir,
    addr: String,
    listener: rdmastream::transport::tcp::SideChannelListener,
    /// Refusals collected while waiting for a sender in [`Pair::connect`].
    refused: Vec<rdmastream::transport::Refusal>,
}

fn listen(settings: RegionSettings) -> Pair {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rx.sock");
    let listener = shm::listen(&path, settings).unwrap();
    Pair {
        addr: format!("unix:{}", path.display()),
        _dir: dir,
        listener,
        refused: Vec::new(),
    }
}

impl Pair {
    fn connect(
        &mut self,
        name: &str,
        key: Option<&Key>,
    ) -> (Box<dyn Connection>, Accepted, Arc<SendBlocks>) {
        let blocks = SendBlocks::new(2, 4096);
        let conn = ShmConnector::new(&self.addr)
            .unwrap()
            .connect(&hello(name, 4096), key, &blocks)
            .unwrap();
        // `accept` returns early while a refusal waits: keep them for the test to look at.
        let accepted = self
            .listener
            .accept_sender_keeping(Duration::from_secs(10), &mut self.refused)
            .unwrap()
            .unwrap_or_else(|| panic!("{name} was not accepted"));
        (conn, accepted, blocks)
    }
}

/// The chain the sending thread posts: block bytes (unsignaled), then the status byte.
fn write_block(
    conn: &mut dyn Connection,
    wr_id: u64,
    send_block: usize,
    remote: usize,
    len: usize,
) {
    let block_size = conn.layout().block_size;
    conn.post_write_chain(
        wr_id,
        &[
            WriteWr {
                source: WriteSource::SendBlock {
                    index: send_block,
                    len,
                },
                remote: RemoteAddr {
                    target: Target::Blocks,
                    offset: (remote * block_size) as u64,
                },
                signaled: false,
            },
            WriteWr {
                source: WriteSource::Inline(&[status::FULL]),
                remote: RemoteAddr {
                    target: Target::Statuses,
                    offset: remote as u64,
                },
                signaled: true,
            },
        ],
    )
    .unwrap();
}

fn sync(conn: &mut dyn Connection, wr_id: u64) -> Vec<u8> {
    let n = conn.layout().blocks;
    conn.post_read(
        wr_id,
        RemoteAddr {
            target: Target::Statuses,
            offset: 0,
        },
        n,
    )
    .unwrap();
    let mut out = Vec::new();
    conn.poll_completions(&mut out, Duration::ZERO).unwrap();
    match out.as_slice() {
        [Completion::Read { wr_id: id, data }] if *id == wr_id => data.clone(),
        other => panic!("expected the sync's completion, got {other:?}"),
    }
}

#[test]
fn a_block_written_through_shared_memory_is_there_once_its_status_is_full() {
    let mut pair = listen(RegionSettings {
        reserved_blocks: vec![2],
        ..RegionSettings::plain(4, 4096)
    });
    let (mut conn, accepted, blocks) = pair.connect("edge-a", None);
    assert_eq!(accepted.hello.sender, "edge-a");
    assert_eq!(accepted.hello.data_path, DataPath::Shm);
    let region = accepted.region.clone();
    // The reserved block is unavailable from the start, and the sender's sync sees it.
    assert_eq!(sync(conn.as_mut(), 1), vec![0, 0, 2, 0]);
    blocks.fill(1, |b| b[..5].copy_from_slice(b"hello"));
    write_block(conn.as_mut(), 2, 1, 3, 5);
    // Completions are immediate: the next poll returns the chain's.
    let mut done = Vec::new();
    conn.poll_completions(&mut done, Duration::ZERO).unwrap();
    assert_eq!(done, vec![Completion::Write { wr_id: 2 }]);
    assert_eq!(region.status(3), status::FULL);
    let mut seen = Vec::new();
    region.read_block(3, &mut |b| seen = b[..5].to_vec());
    assert_eq!(seen, b"hello");
    // Retained: status 2, the bytes held without a copy; dropped: status 0, which the sender's
    // next sync sees.
    let held = region.clone().retain(3);
    assert_eq!(&held[..5], b"hello");
    assert_eq!(sync(conn.as_mut(), 3), vec![0, 0, 2, 2]);
    drop(held);
    assert_eq!(sync(conn.as_mut(), 4), vec![0, 0, 2, 0]);
}

#[test]
fn accesses_outside_the_region_or_reads_of_blocks_fail_the_connection() {
    let mut pair = listen(RegionSettings::plain(2, 4096));
    let (mut conn, _accepted, _blocks) = pair.connect("edge-a", None);
    let bad = [WriteWr {
        source: WriteSource::Inline(&[1; 8]),
        remote: RemoteAddr {
            target: Target::Blocks,
            offset: 4090,
        },
        signaled: true,
    }];
    let e = conn.post_write_chain(1, &bad).unwrap_err();
    assert!(e.to_string().contains("outside the region"), "{e}");
    let e = conn
        .post_read(
            2,
            RemoteAddr {
                target: Target::Blocks,
                offset: 0,
            },
            4,
        )
        .unwrap_err();
    assert!(e.to_string().contains("do not allow remote READ"), "{e}");
    let e = conn
        .post_read(
            3,
            RemoteAddr {
                target: Target::Statuses,
                offset: 1,
            },
            2,
        )
        .unwrap_err();
    assert!(e.to_string().contains("outside the region"), "{e}");
}

/// A sender that dies while writing a block never sets its status byte, so the receiver never
/// looks at it; and one that breaks the protocol by overwriting a FULL block part-way (what a
/// crash in the middle of a rewrite would leave) leaves bytes whose seal fails.
#[test]
fn a_block_torn_by_its_sender_fails_the_seal() {
    let mut pair = listen(RegionSettings::plain(2, 4096));
    let (mut conn, accepted, blocks) = pair.connect("edge-a", None);
    let region = accepted.region.clone();
    let header = |frame_index: u64, payload_len: u32| BlockHeader {
        device: 1,
        packet: frame_index as u16,
        flags: 0,
        fragment_index: 0,
        fragment_count: 1,
        payload_len,
        frame_index,
        timestamp_ns: 0,
        message_len: payload_len,
        duration_ns: 0,
        pts_ns: 0,
    };
    let used = blocks.fill(0, |b| header(0, 1000).encode_block(&[0xAA; 1000], b));
    write_block(conn.as_mut(), 1, 0, 0, used);
    let mut decoded = None;
    region.read_block(0, &mut |b| {
        decoded = Some(BlockHeader::decode_block(b, 255).map(|(h, p)| (h.frame_index, p.len())))
    });
    assert_eq!(decoded.unwrap(), Ok((0, 1000)));
    // The next frame's block, of which only the first half made it before the crash.
    let used = blocks.fill(1, |b| header(1, 1000).encode_block(&[0x55; 1000], b));
    let half = WriteWr {
        source: WriteSource::SendBlock {
            index: 1,
            len: used / 2,
        },
        remote: RemoteAddr {
            target: Target::Blocks,
            offset: 0,
        },
        signaled: false,
    };
    conn.post_write_chain(2, &[half]).unwrap();
    region.read_block(0, &mut |b| {
        decoded = Some(BlockHeader::decode_block(b, 255).map(|(h, p)| (h.frame_index, p.len())))
    });
    assert_eq!(
        decoded.unwrap(),
        Err(rdmastream::proto::header::BlockError::BadSeal)
    );
    // Half a block into an EMPTY block, status never set: the receiver has nothing to read.
    conn.post_write_chain(
        3,
        &[WriteWr {
            remote: RemoteAddr {
                target: Target::Blocks,
                offset: 4096,
            },
            ..half
        }],
    )
    .unwrap();
    assert_eq!(region.status(1), status::EMPTY);
}

/// The receiver's copies of a block (what it decodes and checks): the bytes the sender wrote, at
/// any offset of the block, from the region and from a retained block alike; a range past the
/// block is refused; and a header rewritten by the sender after the receiver's copy of it does
/// not change what that decode answers.
#[test]
fn the_receivers_copies_of_a_block_are_the_senders_bytes() {
    let mut pair = listen(RegionSettings::plain(2, 4096));
    let (mut conn, accepted, blocks) = pair.connect("edge-a", None);
    let region = accepted.region.clone();
    let h = BlockHeader {
        device: 1,
        packet: 9,
        flags: 0,
        fragment_index: 0,
        fragment_count: 1,
        payload_len: 1000,
        frame_index: 9,
        timestamp_ns: 0,
        message_len: 1000,
        duration_ns: 0,
        pts_ns: 0,
    }
    .sealed_for(region.placement());
    let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
    let used = blocks.fill(1, |b| h.encode_block(&payload, b));
    write_block(conn.as_mut(), 1, 1, 1, used);
    let mut written = Vec::new();
    region.read_block(1, &mut |b| written = b[..used].to_vec());
    for (at, len) in [(0, 48), (3, 1), (5, 13), (48, 1000), (1048, 12), (4000, 96)] {
        let mut copy = vec![0xEE; len];
        region.copy_from_block(1, at, &mut copy);
        let mut expected = vec![0; len];
        region.read_block(1, &mut |b| expected.copy_from_slice(&b[at..at + len]));
        assert_eq!(copy, expected, "at {at}, len {len}");
    }
    let decoded = BlockHeader::decode_block_copied(
        &written,
        &mut |at, into| region.copy_from_block(1, at, into),
        255,
        region.placement(),
    );
    assert_eq!(decoded, Ok(h));
    let past = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        region.copy_from_block(1, 4090, &mut [0; 8])
    }));
    assert!(past.is_err(), "a copy past the block must be refused");
    let held = region.clone().retain(1);
    let mut head = [0; 48];
    held.copy_out(0, &mut head);
    assert_eq!(head[..], written[..48]);
    // The sender rewrites the header's length after the copy (breaking the protocol): the
    // decode answers from its copy of the header, and the trailer is the one it wrote.
    let mut lying = h;
    lying.payload_len = 3000;
    lying.message_len = 3000;
    let lied = blocks.fill(0, |b| {
        lying.encode_block(&[0; 3000], b);
        48
    });
    let mut first = true;
    let decoded = BlockHeader::decode_block_copied(
        &written,
        &mut |at, into| {
            held.copy_out(at, into);
            if std::mem::take(&mut first) {
                write_block(conn.as_mut(), 2, 0, 1, lied);
            }
        },
        255,
        region.placement(),
    );
    assert_eq!(decoded.map(|d| d.payload_len), Ok(1000));
    // The rewrite did land: a decode copying the header now sees the lie, and refuses it.
    held.copy_out(0, &mut head);
    assert_eq!(head[12..16], 3000u32.to_le_bytes());
    let now = BlockHeader::decode_block_copied(
        &written,
        &mut |at, into| held.copy_out(at, into),
        255,
        region.placement(),
    );
    assert!(now.is_err(), "{now:?}");
}

#[test]
fn keys_block_size_and_data_path_are_checked_as_on_every_transport() {
    let access = AccessControl::new(
        Keys::shared(key("shm-test-key-0123456789")),
        8,
        Budget::unlimited(),
    );
    let mut pair = listen(RegionSettings {
        access,
        ..RegionSettings::plain(2, 4096)
    });
    let connector = ShmConnector::new(&pair.addr).unwrap();
    let blocks = SendBlocks::new(1, 4096);
    let e = connector
        .connect(&hello("edge-a", 4096), None, &blocks)
        .err()
        .unwrap();
    assert!(e.to_string().contains("requires a key"), "{e}");
    let e = connector
        .connect(
            &hello("edge-a", 4096),
            Some(&key("wrong-key-0123456789abc")),
            &blocks,
        )
        .err()
        .unwrap();
    assert!(e.to_string().contains("authentication failed"), "{e}");
    let right = key("shm-test-key-0123456789");
    let e = connector
        .connect(&hello("edge-a", 8192), Some(&right), &blocks)
        .err()
        .unwrap();
    assert!(e.to_string().contains("larger than this receiver's"), "{e}");
    // A tcp sender that reached the socket would be told which transport this is.
    let mut side =
        std::os::unix::net::UnixStream::connect(pair.addr.strip_prefix("unix:").unwrap()).unwrap();
    let e = rdmastream::transport::tcp::client_handshake_on(
        &mut side,
        &pair.addr,
        &hello("edge-b", 0),
        Some(&right),
    )
    .unwrap_err();
    assert!(e.to_string().contains("speaks the shm transport"), "{e}");
    let (conn, accepted, _) = pair.connect("edge-a", Some(&right));
    assert_eq!(conn.layout().blocks, 2);
    assert_eq!(accepted.hello.sender, "edge-a");
    // The sender without a key gives up after the challenge: the receiver sees no proof.
    let mut refused: Vec<_> = pair.refused.iter().map(|r| r.kind.name()).collect();
    assert!(wait_for(Duration::from_secs(20), || {
        refused.extend(pair.listener.refusals().iter().map(|r| r.kind.name()));
        refused.len() >= 4
    }));
    refused.sort();
    assert_eq!(
        refused,
        [
            "authentication",
            "bad-handshake",
            "block-size",
            "wrong-transport"
        ]
    );
}

#[test]
fn each_end_notices_when_the_other_is_gone() {
    let mut pair = listen(RegionSettings {
        peer_timeout: Duration::from_millis(500),
        nic_spin: rdmastream::transport::DEFAULT_NIC_SPIN,
        ..RegionSettings::plain(2, 4096)
    });
    // The sender goes (as a killed one does: its socket closes).
    let (conn, accepted, _) = pair.connect("edge-a", None);
    assert!(!accepted.region.is_closed());
    drop(conn);
    assert!(wait_for(Duration::from_secs(20), || accepted
        .region
        .is_closed()));
    // The receiver is done with a sender: the sender's next heartbeat fails.
    let (mut conn, accepted, _) = pair.connect("edge-b", None);
    conn.heartbeat().unwrap();
    accepted.region.disconnect();
    let mut failed = None;
    assert!(wait_for(Duration::from_secs(20), || {
        failed = conn.heartbeat().err();
        failed.is_some()
    }));
    let e = failed.unwrap().to_string();
    assert!(e.contains("closed the socket"), "{e}");
}

#[test]
fn a_live_socket_is_not_taken_over_and_a_stale_one_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rx.sock");
    let first = shm::listen(&path, RegionSettings::plain(2, 4096)).unwrap();
    let e = shm::listen(&path, RegionSettings::plain(2, 4096))
        .err()
        .unwrap();
    assert!(e.to_string().contains(&path.display().to_string()), "{e}");
    drop(first);
    assert!(!path.exists(), "the socket file goes with its listener");
    // Left behind by a receiver that was killed: a socket file nobody listens on.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let l = shm::listen(&path, RegionSettings::plain(2, 4096)).unwrap();
    assert_eq!(l.local_addr(), format!("unix:{}", path.display()));
}

#[test]
fn unix_addresses_pick_shm_and_other_transports_refuse_them() {
    let v = VerbsSettings::default();
    assert_eq!(choose("auto", "unix:/run/rx.sock", &v).unwrap(), Kind::Shm);
    assert_eq!(choose("shm", "unix:/run/rx.sock", &v).unwrap(), Kind::Shm);
    assert_eq!(choose("tcp", "127.0.0.1:1", &v).unwrap(), Kind::Tcp);
    let e = choose("shm", "127.0.0.1:1", &v).unwrap_err().to_string();
    assert!(e.contains("unix:/path"), "{e}");
    let e = choose("tcp", "unix:/run/rx.sock", &v)
        .unwrap_err()
        .to_string();
    assert!(e.contains("transport = \"shm\""), "{e}");
    assert!(ShmConnector::new("127.0.0.1:5").is_err());
    // "unix:" alone is a mistake on every transport, not a tcp host to retry for ever.
    for transport in ["auto", "shm", "tcp"] {
        let e = choose(transport, "unix:", &v).unwrap_err().to_string();
        assert!(e.contains("no socket path"), "{transport}: {e}");
    }
}

#[test]
fn each_sender_writes_into_its_own_region() {
    let mut pair = listen(RegionSettings::plain(2, 4096));
    let (mut a, region_a, blocks_a) = pair.connect("edge-a", None);
    let (mut b, region_b, blocks_b) = pair.connect("edge-b", None);
    blocks_a.fill(0, |x| x[..1].copy_from_slice(b"a"));
    blocks_b.fill(0, |x| x[..1].copy_from_slice(b"b"));
    write_block(a.as_mut(), 1, 0, 0, 1);
    write_block(b.as_mut(), 1, 0, 1, 1);
    let first = |acc: &Accepted, j: usize| {
        let mut byte = 0;
        acc.region.read_block(j, &mut |x| byte = x[0]);
        (acc.region.status(j), byte)
    };
    assert_eq!(first(&region_a, 0), (status::FULL, b'a'));
    assert_eq!(first(&region_a, 1), (status::EMPTY, 0));
    assert_eq!(first(&region_b, 0), (status::EMPTY, 0));
    assert_eq!(first(&region_b, 1), (status::FULL, b'b'));
}

/// A receiver that hands over memory whose size is not sealed (it could shrink it under the
/// sender's mapping and crash the sender with SIGBUS) is refused before anything is mapped.
#[test]
fn a_receiver_passing_an_unsealed_region_is_refused() {
    use rdmastream::proto::handshake::Welcome;
    use rdmastream::transport::tcp::server_handshake;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fake.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let fake = std::thread::spawn(move || {
        let (mut side, _) = listener.accept().unwrap();
        let settings = RegionSettings::plain(2, 4096);
        let admitted = server_handshake(&mut side, &settings, DataPath::Shm, "", |_, _| {
            let welcome = Welcome {
                blocks: 2,
                block_size: 4096,
                status_addr: 0,
                blocks_addr: shm::blocks_offset(2) as u64,
                ..Welcome::refusal("")
            };
            Ok((welcome, ()))
        });
        assert!(admitted.is_ok());
        let fd = rustix::fs::memfd_create("unsealed", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 1 << 20).unwrap();
        rdmastream_verbs::shared::send_fd(&side, std::os::fd::AsFd::as_fd(&fd)).unwrap();
        // Hold the socket until the sender has decided.
        let _ = std::io::Read::read(&mut side, &mut [0u8; 1]);
    });
    let e = ShmConnector::new(&format!("unix:{}", path.display()))
        .unwrap()
        .connect(&hello("edge-a", 4096), None, &SendBlocks::new(1, 4096))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("not sealed"), "{e}");
    fake.join().unwrap();
}

/// The status byte of remote block `j` alone, as the sending thread posts it for a block
/// written in place (and, with `value` 0, what a hostile sender could post to ring for nothing).
fn store_status(conn: &mut dyn Connection, wr_id: u64, j: usize, value: u8) {
    conn.post_write_chain(
        wr_id,
        &[WriteWr {
            source: WriteSource::Inline(&[value]),
            remote: RemoteAddr {
                target: Target::Statuses,
                offset: j as u64,
            },
            signaled: true,
        }],
    )
    .unwrap();
}

/// The receiver's idle wait ends when the sender stores a status byte (the doorbell), not
/// after its timeout; and a status byte stored before the wait begins ends it at once (no
/// wake-up is lost between the receiver's last scan and its wait).
#[test]
fn the_doorbell_ends_the_receivers_idle_wait_when_a_status_byte_is_stored() {
    let mut pair = listen(RegionSettings::plain(4, 4096));
    let (mut conn, accepted, blocks) = pair.connect("edge-a", None);
    let region = accepted.region.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let waiter = {
        let region = region.clone();
        std::thread::spawn(move || {
            let t0 = std::time::Instant::now();
            ready_tx.send(()).unwrap();
            region.wait(Duration::from_secs(30));
            t0.elapsed()
        })
    };
    ready_rx.recv().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    blocks.fill(0, |b| b[..5].copy_from_slice(b"hello"));
    write_block(conn.as_mut(), 1, 0, 2, 5);
    let waited = waiter.join().unwrap();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(15),
        "the wait took {waited:?}: it should end when the status byte is stored, 300 ms in"
    );
    assert_eq!(region.status(2), status::FULL);
    // Already FULL when the wait begins: it returns at once.
    let t0 = std::time::Instant::now();
    region.wait(Duration::from_secs(30));
    assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
}

/// The doorbell is the sender's word only as a hint: a sender that rings without storing a
/// FULL status byte (here it stores 0 over and over) neither ends the receiver's wait early nor
/// makes its polling thread spin.
#[test]
fn a_sender_ringing_for_nothing_cannot_make_the_receiver_spin() {
    let mut pair = listen(RegionSettings::plain(4, 4096));
    let (mut conn, accepted, _blocks) = pair.connect("edge-a", None);
    let region = accepted.region.clone();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ringer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut id = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                id += 1;
                store_status(conn.as_mut(), id, 0, status::EMPTY);
            }
            id
        })
    };
    let cpu = || {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
        Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
    };
    let (t0, cpu0) = (std::time::Instant::now(), cpu());
    region.wait(Duration::from_millis(500));
    let (waited, cpu1) = (t0.elapsed(), cpu());
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rings = ringer.join().unwrap();
    let spent = cpu1 - cpu0;
    assert!(rings > 100, "the sender rang only {rings} times");
    assert!(
        waited >= Duration::from_millis(500),
        "the wait ended early: {waited:?}"
    );
    assert!(
        spent < Duration::from_millis(50),
        "the waiting thread spent {spent:?} of CPU in a 500 ms wait"
    );
}
