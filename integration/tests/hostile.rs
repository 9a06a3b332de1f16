//! A hostile peer against a real receiver process while an honest sender streams (issue 7).
//!
//! Every test starts a receiver with keys for an honest sender and for `mallory` (an
//! authenticated but malicious sender) plus a key shared by any other name, under an address-
//! space limit of 3 GiB (so reserving what a header claims would abort it), and an honest sender
//! with cameras and a multi-block radar, all `block`. While the honest sender streams, one attack
//! runs. Then each test checks that the receiver is still up, that every honest frame arrived
//! bit-exact and in order (and nothing else was written under its name), that resident memory
//! and threads stayed within what the config allows (read from /proc while the attack ran), and
//! that the summary says what was refused and why. Over tcp on loopback (the attacks speak the
//! tcp data path); several attackers use other 127.0.0.0/8 source addresses.

mod common;

use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use rdmastream_testkit::hostile::{self, FakeReceiver};

const HONEST: &str = "edge-honest";
const HONEST_KEY: &str = "honest-key-0123456789abcdef";
const MALLORY_KEY: &str = "mallory-key-0123456789abcdef";
const SHARED_KEY: &str = "shared-key-0123456789abcdef";
const MAX_SENDERS: u64 = 4;
const MEMORY_BUDGET: u64 = 64 << 20;
const BLOCK: u64 = 262_144;
const BLOCKS: u64 = 8;
const DISK_BUDGET: u64 = 64 << 20;
const CAM_FRAMES: u64 = 100;
const RADAR_FRAMES: u64 = 20;
const RADAR: usize = 300_000;
/// Handshakes a receiver runs at once at most (rdmastream::transport::tcp::MAX_HANDSHAKES).
const MAX_HANDSHAKES: u64 = 64;

/// The highest of a process's resident memory, threads and open files, sampled every 20 ms.
struct Peak {
    stop: Arc<AtomicBool>,
    rss: Arc<AtomicU64>,
    threads: Arc<AtomicU64>,
    files: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Peak {
    fn watch(pid: u32) -> Peak {
        let stop = Arc::new(AtomicBool::new(false));
        let (rss, threads, files) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
        );
        let thread = {
            let (stop, rss, threads, files) =
                (stop.clone(), rss.clone(), threads.clone(), files.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    rss.fetch_max(hostile::rss_bytes(pid), Ordering::Relaxed);
                    threads.fetch_max(hostile::threads(pid), Ordering::Relaxed);
                    files.fetch_max(hostile::open_files(pid), Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        };
        Peak {
            stop,
            rss,
            threads,
            files,
            thread: Some(thread),
        }
    }

    fn end(mut self) -> (u64, u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        (
            self.rss.load(Ordering::Relaxed),
            self.threads.load(Ordering::Relaxed),
            self.files.load(Ordering::Relaxed),
        )
    }
}

struct Scenario {
    tmp: tempfile::TempDir,
    out: PathBuf,
    addr: String,
    rx: Child,
    rx_log: PathBuf,
    honest: Child,
    honest_log: PathBuf,
    /// Resident memory and threads of the receiver before any sender connected.
    idle_rss: u64,
    idle_threads: u64,
    peak: Option<Peak>,
}

/// A test that fails midway leaves no receiver or sender behind (they ran on, orphaned, after
/// a failed assertion). After `finish` both have exited, and this does nothing.
impl Drop for Scenario {
    fn drop(&mut self) {
        for child in [&mut self.rx, &mut self.honest] {
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

fn receiver_pid(s: &Scenario) -> u32 {
    s.rx.id()
}

impl Scenario {
    /// A receiver (with `extra` config) and the honest sender, streaming.
    fn start(extra: &str) -> Scenario {
        let tmp = tempfile::tempdir().unwrap();
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let out = tmp.path().join("out");
        let cfg = write(
            tmp.path(),
            "receiver.toml",
            &format!(
                "listen = \"{addr}\"\ntransport = \"tcp\"\nblocks = {BLOCKS}\nblock_size = {BLOCK}\n\
                 format = \"raw\"\nkeep = 0\nwriters = 2\nmax_senders = {MAX_SENDERS}\n\
                 memory_budget = {MEMORY_BUDGET}\nmax_frame_bytes = \"4 MiB\"\n\
                 disk_budget = {DISK_BUDGET}\nkey = \"{SHARED_KEY}\"\n{extra}\n\
                 [[sender]]\nname = \"{HONEST}\"\nkey = \"{HONEST_KEY}\"\n\
                 [[sender]]\nname = \"mallory\"\nkey = \"{MALLORY_KEY}\"\n"
            ),
        );
        let rx_log = tmp.path().join("rx.log");
        // Under an address-space limit: a receiver that reserved what a header claims would
        // abort instead of only looking big.
        let rx = spawn(
            Path::new("prlimit"),
            &[
                "--as=3221225472",
                "--",
                bin("receiver").to_str().unwrap(),
                "--config",
                cfg.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
                "--verify",
            ],
            &rx_log,
        );
        assert!(
            wait_for(Duration::from_secs(30), || std::net::TcpStream::connect(
                &addr
            )
            .is_ok()),
            "receiver did not start listening: {}",
            tail(&rx_log)
        );
        let pid = rx.id();
        // The idle baseline is taken once the receiver's threads and memory stopped changing
        // (the same over 20 samples 5 ms apart).
        let (mut last, mut same) = ((0, 0), 0);
        assert!(
            wait_for(Duration::from_secs(10), || {
                let now = (hostile::rss_bytes(pid) >> 16, hostile::threads(pid));
                same = if now == last { same + 1 } else { 0 };
                last = now;
                same >= 20
            }),
            "the idle receiver's memory or threads kept changing"
        );
        let (idle_rss, idle_threads) = (hostile::rss_bytes(pid), hostile::threads(pid));
        let peak = Peak::watch(pid);
        let tx_cfg = write(
            tmp.path(),
            "honest.toml",
            &format!(
                "name = \"{HONEST}\"\nreceiver = \"{addr}\"\ntransport = \"tcp\"\nkey = \"{HONEST_KEY}\"\n\
                 block_size = {BLOCK}\nsend_blocks = 4\n\
                 [[device]]\nid = 0\ncount = 2\nsource = \"camera-synthetic\"\nwidth = 160\nheight = 120\nfps = 50\npolicy = \"block\"\nframes = {CAM_FRAMES}\n\
                 [[device]]\nid = 9\nsource = \"radar-synthetic\"\nsize = {RADAR}\nrate = 10\npolicy = \"block\"\nframes = {RADAR_FRAMES}\n"
            ),
        );
        let honest_log = tmp.path().join("honest.log");
        let honest = spawn(
            &bin("sender"),
            &["--config", tx_cfg.to_str().unwrap()],
            &honest_log,
        );
        Scenario {
            tmp,
            out,
            addr,
            rx,
            rx_log,
            honest,
            honest_log,
            idle_rss,
            idle_threads,
            peak: Some(peak),
        }
    }

    /// Waits up to 20 s until the honest sender's first camera has written `frames` files.
    fn wait_for_honest_frames(&self, frames: usize) {
        let dir = self.out.join(format!("{HONEST}/device-000"));
        assert!(
            wait_for(Duration::from_secs(20), || frame_files(&dir).len()
                >= frames),
            "honest sender never streamed"
        );
    }

    /// Waits for the honest sender, stops the receiver (Ctrl-C) and checks everything that
    /// must hold whatever the attack was. Returns the receiver's log.
    fn finish(mut self) -> String {
        exits_ok(
            &mut self.honest,
            Duration::from_secs(120),
            "honest sender",
            &self.honest_log,
        );
        assert!(
            self.rx.try_wait().unwrap().is_none(),
            "the receiver died: {}",
            tail(&self.rx_log)
        );
        // Every honest frame, bit-exact and in order, and nothing else under its name.
        let dir = |d: u8| self.out.join(format!("{HONEST}/device-{d:03}"));
        assert!(
            wait_for(Duration::from_secs(60), || {
                frame_files(&dir(0)).len() as u64 == CAM_FRAMES
                    && frame_files(&dir(1)).len() as u64 == CAM_FRAMES
                    && frame_files(&dir(9)).len() as u64 == RADAR_FRAMES
            }),
            "honest frames missing: {}",
            tail(&self.rx_log)
        );
        for d in [0u8, 1] {
            let files = frame_files(&dir(d));
            let idx: Vec<u64> = files.iter().map(|(i, _)| *i).collect();
            assert_eq!(idx, (0..CAM_FRAMES).collect::<Vec<_>>(), "device {d}");
            for (i, p) in &files {
                check_camera_file(p, d, *i, 160, 120);
            }
        }
        for (i, p) in &frame_files(&dir(9)) {
            check_radar_file(p, 9, *i, RADAR);
        }
        let honest_dirs: Vec<_> = std::fs::read_dir(self.out.join(HONEST))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(honest_dirs.len(), 3, "{honest_dirs:?}");
        let (rss, threads, files) = self.peak.take().unwrap().end();
        // Regions and reassembly are in the budget; the rest is the process itself plus writer
        // queues of frames that point into regions.
        let slack = 64 << 20;
        assert!(
            rss <= self.idle_rss + MEMORY_BUDGET + slack,
            "resident memory peaked at {} MiB (idle {} MiB, budget {} MiB)",
            rss >> 20,
            self.idle_rss >> 20,
            MEMORY_BUDGET >> 20
        );
        // Two threads per connected sender, the handshakes in progress, and a few that come and
        // go (GStreamer's, the Ctrl-C handler).
        let thread_bound = self.idle_threads + 2 * MAX_SENDERS + MAX_HANDSHAKES + 4;
        assert!(
            threads <= thread_bound,
            "threads peaked at {threads} (idle {}, bound {thread_bound})",
            self.idle_threads
        );
        assert!(files < 1000, "open files peaked at {files}");
        let _ = std::process::Command::new("kill")
            .args(["-INT", &self.rx.id().to_string()])
            .status();
        exits_ok(
            &mut self.rx,
            Duration::from_secs(30),
            "receiver",
            &self.rx_log,
        );
        let log = std::fs::read_to_string(&self.rx_log).unwrap();
        assert!(log.contains("summary:"), "{}", tail(&self.rx_log));
        let _ = &self.tmp;
        log
    }
}

fn mallory(s: &Scenario) -> (std::net::TcpStream, rdmastream::proto::handshake::Welcome) {
    hostile::authenticated(&s.addr, "mallory", Some(MALLORY_KEY), 0xBAD).expect("mallory connects")
}

/// Attack 1: one block per device claiming a 4 GiB message. Nothing is reserved for what a
/// header declares (the receiver runs under a 3 GiB address-space limit), and the summary counts
/// the oversized messages.
#[test]
fn headers_claiming_4_gib_reserve_nothing() {
    let s = Scenario::start("");
    let (mut conn, w) = mallory(&s);
    hostile::claim_huge_messages(&mut conn, &w, 255).unwrap();
    drop(conn);
    let log = s.finish();
    assert!(
        log.contains("mallory/d254") && log.contains("oversized 1"),
        "{log}"
    );
}

/// Attack 2: many peers. Unauthenticated ones are refused; authenticated ones beyond
/// `max_senders` too (the honest sender holds one of the four places), so regions, threads and
/// memory stay bounded. The attack starts once the honest sender streams: on a loaded machine
/// its process may connect after the first peers took every place.
#[test]
fn many_peers_are_bounded_by_keys_and_max_senders() {
    let mut s = Scenario::start("");
    s.wait_for_honest_frames(1);
    let mut held = Vec::new();
    for i in 0..48 {
        // Without a key (the receiver asks for a proof this peer cannot give).
        let _ = hostile::authenticated(&s.addr, &format!("peer{i}"), None, i);
        // With the shared key: admitted while there is room.
        if let Ok(c) = hostile::authenticated(&s.addr, &format!("m{i}"), Some(SHARED_KEY), i) {
            held.push(c);
        }
    }
    // The honest sender streams for about 2 s; a loaded machine may take longer than that over
    // the 96 handshakes, and once it is done its place is free for one more peer.
    let admitted = held.len() as u64;
    if s.honest.try_wait().unwrap().is_some() {
        assert!(
            (MAX_SENDERS - 1..=MAX_SENDERS).contains(&admitted),
            "{admitted} admitted beside an honest sender that finished meanwhile"
        );
    } else {
        assert_eq!(
            admitted,
            MAX_SENDERS - 1,
            "admitted beyond max_senders (the honest sender holds a place)"
        );
    }
    let log = s.finish();
    drop(held);
    assert!(log.contains("sender-limit"), "{log}");
}

/// Attack 3 and floods: 32 handshakes trickling a byte every 300 ms from 8 other addresses,
/// and idle connections beyond the per-address limit. The honest sender gets in at once, and the
/// slow handshakes are cut at the 5 s deadline although they keep sending.
#[test]
fn slow_and_idle_handshakes_do_not_lock_honest_senders_out() {
    let s = Scenario::start("");
    let addr = s.addr.clone();
    let slow: Vec<_> = (0..32)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let t = std::time::Instant::now();
                hostile::slow_handshake(
                    &format!("127.0.3.{}", i / 4 + 1),
                    &addr,
                    Duration::from_millis(300),
                    Duration::from_secs(30),
                );
                t.elapsed()
            })
        })
        .collect();
    let idle = hostile::idle_connections("127.0.4.1", &addr, 12);
    let held = slow.into_iter().map(|t| t.join().unwrap()).max().unwrap();
    assert!(
        held < Duration::from_secs(12),
        "a slow handshake was held for {held:?}"
    );
    drop(idle);
    let log = s.finish();
    assert!(
        log.contains("handshake-limit") && log.contains("bad-handshake"),
        "{log}"
    );
}

/// Attack 4: nobody takes the honest sender's name — not without a key, not with another
/// sender's key; a second connection under a name in use is refused ("name in use").
#[test]
fn a_sender_name_cannot_be_taken() {
    let s = Scenario::start("");
    s.wait_for_honest_frames(6);
    for key in [None, Some(MALLORY_KEY), Some(SHARED_KEY)] {
        let e = hostile::authenticated(&s.addr, HONEST, key, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("authentication") || e.contains("key"), "{e}");
    }
    let first = hostile::authenticated(&s.addr, "m1", Some(SHARED_KEY), 1).unwrap();
    let e = hostile::authenticated(&s.addr, "m1", Some(SHARED_KEY), 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("in use"), "{e}");
    drop(first);
    let log = s.finish();
    assert!(
        log.contains("authentication") && log.contains("name-in-use"),
        "{log}"
    );
}

/// Attack 6, a hundred times: a zero-length WRITE one past the region. Each connection is
/// closed with an access error, and afterwards the receiver's threads and open files are back
/// where they were.
#[test]
fn a_hundred_malformed_writes_leak_nothing() {
    let s = Scenario::start("");
    let pid = receiver_pid(&s);
    let before = (hostile::threads(pid), hostile::open_files(pid));
    for _ in 0..100 {
        let (mut conn, w) = mallory(&s);
        hostile::zero_length_write_at_end(&mut conn, &w).unwrap();
    }
    // Back to where it was once the honest sender is done too.
    let s_pid = pid;
    let honest_done = |s: &mut Scenario| s.honest.try_wait().unwrap().is_some();
    let mut s = s;
    assert!(
        wait_for(Duration::from_secs(120), || honest_done(&mut s)),
        "honest sender did not finish"
    );
    assert!(
        wait_for(Duration::from_secs(20), || {
            hostile::threads(s_pid) <= before.0 && hostile::open_files(s_pid) <= before.1
        }),
        "threads {} (before {}), open files {} (before {})",
        hostile::threads(s_pid),
        before.0,
        hostile::open_files(s_pid),
        before.1
    );
    s.finish();
}

/// Attack 7: an authenticated sender floods 32 devices with 1 MiB frames. The output directory
/// stays within disk_budget, and the flooder's own oldest frames are deleted first: the honest
/// sender's files are all there.
#[test]
fn a_disk_flood_stays_within_the_budget() {
    let s = Scenario::start("");
    let (mut conn, w) = mallory(&s);
    hostile::disk_flood(&mut conn, &w, 32, 4, 1 << 20).unwrap();
    drop(conn);
    let out = s.out.clone();
    let log = s.finish();
    let used = hostile::disk_usage(&out);
    assert!(
        used <= DISK_BUDGET + (2 << 20),
        "output holds {} MiB, budget {} MiB",
        used >> 20,
        DISK_BUDGET >> 20
    );
    assert!(
        log.contains("for disk_budget") && !log.contains(" 0 for disk_budget"),
        "{log}"
    );
}

/// Attack 8: format descriptors with newlines and terminal escapes, 20 of 200 KiB. No forged line
/// reaches the log, and the log stays small.
#[test]
fn peer_text_cannot_forge_or_flood_the_log() {
    let s = Scenario::start("");
    let (mut conn, w) = mallory(&s);
    hostile::forged_formats(&mut conn, &w, 20, 200_000).unwrap();
    drop(conn);
    let log = s.finish();
    assert!(
        !log.lines()
            .any(|l| l.starts_with("2026-01-01T00:00:00Z") || l.contains('\x1b')),
        "a peer wrote a line into the log"
    );
    assert!(log.len() < 1 << 20, "the log grew to {} bytes", log.len());
}

/// Malformed, oversized, truncated, old-version, wrong-proof and replayed handshakes are refused
/// with a reason each, and counted by kind.
#[test]
fn malformed_and_replayed_handshakes_are_refused() {
    let s = Scenario::start("");
    let answers = hostile::malformed_handshakes("127.0.5.1", &s.addr);
    assert_eq!(answers.len(), 5, "{answers:?}");
    assert!(
        answers[0].contains("over the 1024-byte limit"),
        "{answers:?}"
    );
    assert!(answers[1].contains("bad handshake"), "{answers:?}");
    assert!(answers[2].contains("bad handshake"), "{answers:?}");
    for (old, answer) in [(1, &answers[3]), (2, &answers[4])] {
        assert!(
            answer.contains(&format!(
                "protocol version {old} is not supported: this receiver speaks version 3; \
                 upgrade the sender"
            )),
            "{answers:?}"
        );
    }
    let e = hostile::wrong_proof("127.0.5.2", &s.addr, "mallory", "not-mallorys-key-000000");
    assert!(e.contains("authentication failed"), "{e}");
    let e = hostile::replayed_handshake("127.0.5.3", &s.addr, "mallory", MALLORY_KEY);
    assert!(e.contains("authentication failed"), "{e}");
    let log = s.finish();
    assert!(
        log.contains("bad-handshake") && log.contains("version") && log.contains("authentication"),
        "{log}"
    );
}

/// Attack 9: a hostile receiver. A Welcome announcing 0xFFFFFFFF blocks, and a READ response
/// of 4 GiB, each end the sender's connection with a message naming the receiver, without the
/// sender allocating what they claim.
#[test]
fn a_hostile_receiver_cannot_make_a_sender_allocate() {
    for (how, want) in [
        (FakeReceiver::HugeRegion, "region size"),
        (
            FakeReceiver::HugeReadResponse,
            "READ response of 4294967295 bytes",
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let fake = std::thread::spawn(move || {
            // The sender reconnects after a lost connection: serve it a few times.
            for _ in 0..3 {
                hostile::fake_receiver(&listener, how);
            }
        });
        let cfg = write(
            tmp.path(),
            "tx.toml",
            &format!(
                "name = \"victim\"\nreceiver = \"{addr}\"\ntransport = \"tcp\"\nblock_size = 65536\n\
                 [[device]]\nid = 0\nsource = \"radar-synthetic\"\nsize = 1000\nrate = 50\n"
            ),
        );
        let log = tmp.path().join("tx.log");
        let mut tx = spawn(
            &bin("sender"),
            &["--config", cfg.to_str().unwrap(), "--duration", "3"],
            &log,
        );
        let pid = tx.id();
        let peak = Peak::watch(pid);
        let code = wait(&mut tx, Duration::from_secs(60), "sender", &log);
        let (rss, _, _) = peak.end();
        let _ = fake.join();
        let text = std::fs::read_to_string(&log).unwrap();
        assert_ne!(code, 0, "{}", tail(&log));
        assert!(
            text.contains(want) && text.contains(&addr),
            "{how:?}: {}",
            tail(&log)
        );
        assert!(
            rss < 256 << 20,
            "{how:?}: the sender grew to {} MiB",
            rss >> 20
        );
    }
}

/// Issue 7, item 5: the key never crosses the wire (a fake receiver that asks for a proof records
/// every byte the sender sends).
#[test]
fn the_key_never_crosses_the_wire() {
    let tmp = tempfile::tempdir().unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let fake = std::thread::spawn(move || hostile::fake_receiver(&listener, FakeReceiver::Record));
    let key = "this-key-must-stay-home-4711";
    let cfg = write(
        tmp.path(),
        "tx.toml",
        &format!(
            "name = \"edge-1\"\nreceiver = \"{addr}\"\ntransport = \"tcp\"\nkey = \"{key}\"\n\
             [[device]]\nid = 0\nsource = \"radar-synthetic\"\nsize = 1000\n"
        ),
    );
    let log = tmp.path().join("tx.log");
    let mut tx = spawn(&bin("sender"), &["--config", cfg.to_str().unwrap()], &log);
    let seen = fake.join().unwrap();
    let code = wait(&mut tx, Duration::from_secs(30), "sender", &log);
    assert_ne!(code, 0);
    assert!(seen.len() > 100, "recorded only {} bytes", seen.len());
    let hex: String = key.bytes().map(|b| format!("{b:02x}")).collect();
    for needle in [key.as_bytes(), &key.as_bytes()[..12], hex.as_bytes()] {
        assert!(
            !seen.windows(needle.len()).any(|w| w == needle),
            "the key (or part of it) crossed the wire"
        );
    }
}
