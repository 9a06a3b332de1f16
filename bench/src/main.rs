//! `bench`: figures measured side by side in one run (a command, not a test).
//!
//! - `throughput`: block sizes 64 B … 8 MiB through the whole engine (filling thread, sending
//!   thread, transport, receiver polling) over `mem`, `tcp` and `shm` (a Unix socket and shared
//!   memory), next to a plain TCP loopback copy of the same bytes in the same run; prints MB/s and
//!   the tcp/plain and shm/plain ratios; then `small`.
//! - `small`: 64 B … 1 KiB messages of a live device through the whole engine with coalescing
//!   off and on, over tcp and shm, next to a plain TCP copy of the same message size (messages/s).
//! - `cameras` (`cameras-shm`): the demo scenario (12 × 640×480 RGB at 25 fps + 2 radars) with
//!   the real `sender` and `receiver` processes over `tcp` (over `shm`): CPU % per process and per
//!   thread group (the sender's filling + sending threads, its sources, the receiver's NIC
//!   emulation, polling and writers), frame latency p50/p99, drops; plus the receiver's idle
//!   polling cost.
//!
//! Usage: `cargo run --release -p rdmastream-bench -- [throughput|cameras|cameras-shm|all]
//! [--seconds S]`;
//! in the Soft-RoCE VM (`scripts/bench-vm.sh [verbs|verbs-sync]`): `verbs`, `verbs-sync [--rounds R]`.
//! `region-tcp [--block BYTES] [--rounds R] [--seconds S]`: the engine over tcp (frames written
//! in place) with the default 16 receiver blocks next to a region of at least 4 MiB, and plain
//! TCP over 16 buffers, between plain TCP copies, round after round (default 64 KiB, 8 rounds of
//! 3 s). `plain-tcp [--block BYTES] [--buffers N]`: plain TCP alone, copying from and into N
//! buffers in turn (default 1).
//! `frame-cpu`: what one 640×480 RGB frame costs the CPU outside the transport (the filling
//! copy, the CRC32C seal, the receiver's validation), here or in the VM, to compare the two;
//! with the in-place paths beside the copying one. `frame-instr [--rounds R]`: the same steps
//! alone, to count their instructions under callgrind (see `frame_instr`). `copy-cache
//! [--frame BYTES] [--block BYTES]`: a frame copy's cost against how many blocks its
//! destinations spread over (see `copy_cache`).
//! `BENCH_TOUCH=1`: the in-place source writes every byte of its frames and the sinks read
//! every byte, plain TCP's two ends too (see `touching`); by default neither end touches them.

mod paper;
mod soak;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rdmastream::engine::SourceFrame;
use rdmastream::engine::{
    Driver, DropPolicy, FrameSink, ReceiverHandle, ReceiverOptions, SenderHandle, SenderOptions,
    StreamKey,
};
use rdmastream::proto::handshake::{DataPath, Hello, PROTOCOL_VERSION, QpInfo};
use rdmastream::proto::{BlockScanner, SenderMachine, status};
use rdmastream::proto::{StreamEvent, payload_capacity};
use rdmastream::stats::DeviceCounters;
use rdmastream::transport::mem::MemFabric;
use rdmastream::transport::tcp::{self, TcpConnector};
use rdmastream::transport::{Connector, Listener, RegionSettings};
use rdmastream::transport::{RemoteAddr, Target};
use rdmastream_verbs::shm::{self, ShmConnector};
use rdmastream_verbs::{self as verbs, VerbsConnector, VerbsSettings};

const SIZES: [usize; 10] = [
    64,
    256,
    1024,
    4096,
    16384,
    65536,
    262144,
    1 << 20,
    4 << 20,
    8 << 20,
];

const USAGE: &str = "usage: bench [throughput|small|engine-tcp|engine-tcp-live|engine-tcp-place|engine-tcp-lossless-place|engine-tcp-copy|engine-tcp-lossless-copy|engine-shm|engine-shm-live|engine-shm-place|engine-shm-copy|transport-tcp|plain-tcp|region-tcp|cameras|cameras-shm|frame-cpu|frame-instr|copy-cache|verbs|verbs-sync|soak|all] \
                     [--seconds S] [--rounds R] [--minutes M] [--block BYTES] [--buffers N (plain-tcp)] [--frame BYTES (copy-cache)]\n       \
                     (the name comes first; without one, and without options, `all`)\n       \
                     bench paper [--quick] [--transport tcp|verbs] [--out DIR] [--only 10,18,...]\n       \
                     bench plot DIR";

/// `bench paper`: the paper's experiments (see [`paper`]).
fn paper_command(args: &[String]) {
    let (mut quick, mut net, mut out, mut only) = (false, paper::Net::Tcp, None, Vec::new());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match (a.as_str(), it.clone().next().map(String::as_str)) {
            ("--quick", _) => quick = true,
            ("--transport", Some("tcp")) => {
                net = paper::Net::Tcp;
                it.next();
            }
            ("--transport", Some("verbs")) => {
                net = paper::Net::Verbs;
                it.next();
            }
            ("--out", Some(dir)) => {
                out = Some(PathBuf::from(dir));
                it.next();
            }
            ("--only", Some(figs)) => {
                only = figs.split(',').map(String::from).collect();
                it.next();
            }
            _ => {
                eprintln!("bench paper: bad option {a:?}\n{USAGE}");
                std::process::exit(2);
            }
        }
    }
    let out = out.unwrap_or_else(|| {
        PathBuf::from("target/paper").join(match net {
            paper::Net::Tcp => "tcp",
            paper::Net::Verbs => "verbs",
        })
    });
    let scale = match (quick, net) {
        (true, _) => paper::Scale::QUICK,
        (false, paper::Net::Tcp) => paper::Scale::FULL,
        (false, paper::Net::Verbs) => paper::Scale::FULL_VERBS,
    };
    paper::run(net, scale, &out, &paper::Mechanism::ALL, &only);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return;
    }
    match args.first().map(String::as_str) {
        Some("paper") => return paper_command(&args[1..]),
        Some("plot") => {
            let Some(dir) = args.get(1) else {
                eprintln!("usage: bench plot DIR (a directory bench paper wrote)");
                std::process::exit(2);
            };
            if let Err(e) = paper::plot::plot(Path::new(dir)) {
                eprintln!("bench plot: {e}");
                std::process::exit(1);
            }
            return;
        }
        _ => {}
    }
    // Every option takes a number; anything else is a mistake, not something to ignore (a
    // mistyped option would otherwise start a ten-minute soak).
    let mut opts = std::collections::HashMap::new();
    for pair in args[1.min(args.len())..].chunks(2) {
        let known = [
            "--seconds",
            "--rounds",
            "--minutes",
            "--block",
            "--buffers",
            "--frame",
        ]
        .contains(&pair[0].as_str());
        match pair.get(1).and_then(|v| v.parse::<f64>().ok()) {
            Some(v) if known => opts.insert(pair[0].as_str(), v),
            _ => {
                eprintln!("bench: bad option {:?}\n{USAGE}", pair.join(" "));
                std::process::exit(2);
            }
        };
    }
    let opt = |name: &str, default: f64| opts.get(name).copied().unwrap_or(default);
    let what = args.first().map(String::as_str).unwrap_or("all");
    let seconds = opt("--seconds", 1.0);
    match what {
        "throughput" => {
            throughput(seconds);
            small_messages(seconds);
        }
        "small" => small_messages(seconds),
        // The engine over tcp alone, at one block size (default 1 MiB), for a profiler:
        // `perf record -g target/release/bench engine-tcp --block 1048576 --seconds 5`.
        "engine-tcp" => {
            let block = opt("--block", 1048576.0) as usize;
            let (l, c) = loopback_tcp(block);
            let rate = engine_rate(block, seconds, l, c);
            println!(
                "engine tcp, {} blocks: {:.1} MB/s",
                human(block),
                rate / 1e6
            );
        }
        // The transport alone over tcp (no engine), and plain TCP, at one block size:
        // `perf record -g target/release/bench transport-tcp --block 65536`.
        "transport-tcp" | "plain-tcp" => {
            let block = opt("--block", 1048576.0) as usize;
            let rate = if what == "plain-tcp" {
                plain_tcp_measured(block, seconds, opt("--buffers", 1.0) as usize).rate
            } else {
                let (l, c) = loopback_tcp(block);
                transport_rate(block, seconds, l, c)
            };
            println!("{what}, {} blocks: {:.1} MB/s", human(block), rate / 1e6);
        }
        // The same over shm: `perf record -g target/release/bench engine-shm --block 65536`.
        "engine-shm" => {
            let block = opt("--block", 1048576.0) as usize;
            let socket = ShmSocket::new("bench");
            let rate = engine_rate(block, seconds, socket.listen(block), socket.connector());
            println!(
                "engine shm, {} blocks: {:.1} MB/s",
                human(block),
                rate / 1e6
            );
        }
        // A live device's frames over tcp or shm at one block size: pushed (copied by the
        // filling thread; over shm once, into a lent receiver's block) or, `-place`, written in
        // place by the source; `engine-tcp-lossless-place`: a lossless device's, written in
        // place (`engine-tcp` is a lossless device's pushed); `-copy`: handed over as bytes and
        // copied on the source's thread (`push_writing_here`, the sender binary's images and
        // GStreamer sources).
        "engine-tcp-live"
        | "engine-tcp-place"
        | "engine-tcp-lossless-place"
        | "engine-tcp-copy"
        | "engine-tcp-lossless-copy"
        | "engine-shm-live"
        | "engine-shm-place"
        | "engine-shm-copy" => {
            let block = opt("--block", 1048576.0) as usize;
            let frames = if what.ends_with("lossless-copy") {
                Frames::LosslessCopiedHere
            } else if what.ends_with("-copy") {
                Frames::CopiedHere
            } else if what.contains("lossless") {
                Frames::LosslessPlaced
            } else if what.ends_with("-place") {
                Frames::Placed
            } else {
                Frames::Live
            };
            let socket = ShmSocket::new("bench");
            let (l, c) = if what.starts_with("engine-shm") {
                (socket.listen(block), socket.connector())
            } else {
                loopback_tcp(block)
            };
            let rate = block_rate(block, frames, seconds, l, c).rate;
            println!("{what}, {} blocks: {:.1} MB/s", human(block), rate / 1e6);
        }
        "region-tcp" => region_tcp(
            opt("--block", 65536.0) as usize,
            opt("--rounds", 8.0) as usize,
            opt("--seconds", 3.0),
        ),
        "verbs" => verbs(seconds),
        "frame-cpu" => frame_cpu(),
        "frame-instr" => frame_instr(opt("--rounds", 5.0) as usize),
        "copy-cache" => copy_cache(
            opt("--frame", 921600.0) as usize,
            opt("--block", 1048576.0) as usize,
        ),
        "verbs-sync" => {
            let rounds = opt("--rounds", 5.0) as usize;
            sync_rounds(
                &VerbsSettings {
                    device: None,
                    port: 1,
                    gid_index: None,
                },
                rounds,
            )
        }
        "cameras" => cameras(seconds.max(5.0) * 2.0, "tcp"),
        "cameras-shm" => cameras(seconds.max(5.0) * 2.0, "shm"),
        "soak" => soak::soak(opt("--minutes", 10.0)),
        "all" => {
            throughput(seconds);
            cameras(10.0, "tcp");
            cameras(10.0, "shm");
        }
        other => {
            eprintln!("bench: unknown benchmark {other:?}\n{USAGE}");
            std::process::exit(2);
        }
    }
}

/// Counts what arrives.
#[derive(Default)]
struct CountingSink {
    bytes: AtomicU64,
    frames: AtomicU64,
}

impl FrameSink for CountingSink {
    fn handle(&self, _: &StreamKey, _: u64, _: &Arc<DeviceCounters>, event: StreamEvent) {
        rdmastream::proto::ack::settle(event.ack());
        if let StreamEvent::Frame(f) = event {
            if touching() {
                std::hint::black_box(touch_read(&f.data));
            }
            self.frames.fetch_add(1, Ordering::Relaxed);
            self.bytes.fetch_add(f.data.len() as u64, Ordering::Relaxed);
        }
    }
    fn lets_frames_go(&self) -> bool {
        true
    }
}

/// Pushes frames that fill one block each, as fast as the engine takes them, for `secs`;
/// returns block bytes per second delivered.
fn engine_rate(
    block: usize,
    secs: f64,
    listener: Box<dyn Listener>,
    connector: Box<dyn Connector>,
) -> f64 {
    block_rate(block, Frames::Lossless, secs, listener, connector).rate
}

/// Block-filling frames, bytes per second (and the CPUs busy meanwhile): of a lossless device
/// ([`engine_rate`]); of a live one whose sender lends receiver's blocks where the transport can
/// (shm): its filling thread copies each frame once, straight into the receiver's memory, and
/// the receiver hands each on without a copy; or, with `Frames::Placed`, of a live one whose
/// source writes each frame in place (see [`Small::place`]): over tcp nothing copies them in
/// user space on either end.
fn block_rate(
    block: usize,
    frames: Frames,
    secs: f64,
    listener: Box<dyn Listener>,
    connector: Box<dyn Connector>,
) -> Measured {
    let lossless = matches!(
        frames,
        Frames::Lossless | Frames::LosslessPlaced | Frames::LosslessCopiedHere
    );
    let m = Small {
        len: payload_capacity(block),
        reliable: lossless,
        coalesce_wait: Duration::ZERO,
        lend: !lossless,
        place: matches!(frames, Frames::Placed | Frames::LosslessPlaced),
        copy_here: matches!(frames, Frames::CopiedHere | Frames::LosslessCopiedHere),
    };
    let per_message = engine_messages(block, m, secs, listener, connector);
    Measured {
        rate: per_message.rate * block as f64,
        ..per_message
    }
}

/// One measured window: units (bytes or messages) per second, and how many CPUs the machine
/// kept busy meanwhile ([`busy_cpu`]).
#[derive(Clone, Copy)]
struct Measured {
    rate: f64,
    cpus: f64,
}

impl Measured {
    /// CPU seconds per unit moved.
    fn cost(&self) -> f64 {
        self.cpus / self.rate
    }
}

/// CPU time the machine has been busy so far, all CPUs together: `/proc/stat`'s first line
/// (user, nice, system, irq and softirq, in the kernel's fixed 1/100 s ticks). Machine-
/// wide, so that loopback TCP's receive processing counts wherever the kernel runs it (in the
/// sending thread, or in `ksoftirqd`, which ran about twice as long beside the engine as
/// beside plain TCP); so it also counts whatever else runs: measure on a quiet machine.
fn busy_cpu() -> Duration {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return Duration::ZERO;
    };
    let ticks: u64 = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .enumerate()
        // user, nice, system, idle, iowait, irq, softirq, steal, guest, guest_nice: guest time
        // is already in user and nice; steal is another guest's.
        .filter(|(i, _)| matches!(i, 0 | 1 | 2 | 5 | 6))
        .filter_map(|(_, v)| v.parse::<u64>().ok())
        .sum();
    Duration::from_millis(ticks * 10)
}

/// Whose frames [`block_rate`] measures.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Frames {
    Lossless,
    /// A live device's frames, pushed (the filling thread copies them).
    Live,
    /// A live device's frames, written in place by the source.
    Placed,
    /// A lossless device's frames, written in place by the source.
    LosslessPlaced,
    /// A live device's frames, copied by the source's thread (`push_writing_here`).
    CopiedHere,
    /// A lossless device's frames, copied by the source's thread (`push_writing_here`).
    LosslessCopiedHere,
}

/// What the source of [`engine_messages`] pushes.
#[derive(Clone, Copy)]
struct Small {
    /// Payload bytes per message.
    len: usize,
    /// Lossless (acknowledged) messages; otherwise live ones, which may be coalesced.
    reliable: bool,
    coalesce_wait: Duration,
    /// Sets in-place blocks aside, so the sender lends receiver's blocks where it can (shm).
    lend: bool,
    /// The source writes each message in place ([`rdmastream::engine::DeviceInput::reserve`]):
    /// into a receiver's block lent over shm, into a send block otherwise; it writes only the
    /// message's index into its first bytes (as plain TCP's writer sends one buffer again and
    /// again, the source costs nothing).
    place: bool,
    /// The source hands each message over as bytes through `push_writing_here`, which copies it
    /// on the source's thread into a free in-place block (over shm a lent receiver's block) and
    /// commits it, or pushes it when none is free: the sender binary's images and GStreamer
    /// sources. Takes in-place blocks as `place` does.
    copy_here: bool,
}

/// Pushes messages of `m.len` bytes into one device as fast as the engine takes them (the
/// source waits when its queue is full, so nothing is dropped), for `secs`; returns messages
/// per second delivered (and the CPUs busy meanwhile).
fn engine_messages(
    block: usize,
    m: Small,
    secs: f64,
    listener: Box<dyn Listener>,
    connector: Box<dyn Connector>,
) -> Measured {
    let sink = Arc::new(CountingSink::default());
    // BENCH_POLL_MAX_US caps the receiver's idle sleep (default 500 µs), to see what it costs.
    let mut receiver_opts = ReceiverOptions::default();
    if let Some(us) = env_knob("BENCH_POLL_MAX_US") {
        receiver_opts.poll_max = Duration::from_micros(us);
        receiver_opts.poll_min = receiver_opts.poll_min.min(receiver_opts.poll_max);
    }
    // BENCH_POLL_SPIN_US sets how long it yields after a block before sleeping (default 50 µs).
    if let Some(us) = env_knob("BENCH_POLL_SPIN_US") {
        receiver_opts.poll_spin = Duration::from_micros(us);
    }
    let receiver = ReceiverHandle::start(receiver_opts, listener, sink.clone()).expect("receiver");
    let opts = SenderOptions {
        name: "bench".into(),
        // As many send blocks as the receiver has blocks: a lossless message keeps its send
        // block until a sync reads the receiver's block free again, so with fewer the sender
        // could never have all the receiver's blocks in use (the sender binary's defaults are
        // 8 send blocks + 8 in-place ones the filling thread borrows, against 16). The old
        // setting: BENCH_SEND_BLOCKS=8.
        send_blocks: env_knob("BENCH_SEND_BLOCKS").unwrap_or_else(region_blocks),
        block_size: block,
        max_outstanding: 8,
        coalesce_wait: m.coalesce_wait,
        // Writing in place, half the send blocks set aside for it (the sender binary's default
        // 8 + 8); lending alone needs one.
        in_place_blocks: if m.place || m.copy_here {
            env_knob("BENCH_SEND_BLOCKS").unwrap_or_else(region_blocks) / 2
        } else {
            usize::from(m.lend)
        },
        ..Default::default()
    };
    let queue = if m.reliable { 8 } else { 1024 };
    let sender = SenderHandle::start(opts, connector, queue).expect("sender");
    let input = sender.add_device_with(0, DropPolicy::Block, m.reliable);
    let len = m.len;
    let format: Arc<str> = "application/octet-stream".into();
    let stop = Arc::new(AtomicBool::new(false));
    let source = {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("bench-source".into())
            .spawn(move || {
                let mut index = 0u64;
                // One buffer handed out again and again: the source costs nothing.
                let data = rdmastream::bytes::Bytes::from(vec![0u8; len]);
                while !stop.load(Ordering::Relaxed) {
                    if m.place {
                        let mut r = match input.reserve(len, Duration::from_millis(50)) {
                            Ok(r) => r,
                            Err(rdmastream::engine::NotReserved::TimedOut) => continue,
                            Err(_) => break,
                        };
                        if touching() {
                            r.payload_mut().fill(index as u8);
                        }
                        let stamp = index.to_le_bytes();
                        let n = stamp.len().min(r.len());
                        r.payload_mut()[..n].copy_from_slice(&stamp[..n]);
                        let meta = rdmastream::engine::FrameMeta {
                            index,
                            timestamp_ns: 0,
                            duration_ns: 0,
                            pts_ns: None,
                            format: format.clone(),
                        };
                        if !r.commit(meta) {
                            break;
                        }
                        index += 1;
                        continue;
                    }
                    let f = SourceFrame {
                        index,
                        timestamp_ns: 0,
                        duration_ns: 0,
                        pts_ns: None,
                        format: format.clone(),
                        data: data.clone().into(),
                    };
                    let pushed = if m.copy_here {
                        input.push_writing_here(f)
                    } else {
                        input.push(f)
                    };
                    if !pushed {
                        break;
                    }
                    index += 1;
                }
                input.end();
            })
            .unwrap()
    };
    // Warm up, then measure delivered frames over the window.
    std::thread::sleep(Duration::from_millis(200));
    if pinning() {
        // The two threads that copy over tcp: the sending thread's writev, the NIC thread's
        // readv (a thread per connection, there by now).
        pin_threads("sending", 0);
        pin_threads("tcp-nic-", 1);
        std::thread::sleep(Duration::from_millis(100));
    }
    let (f0, t0, c0) = (
        sink.frames.load(Ordering::Relaxed),
        Instant::now(),
        busy_cpu(),
    );
    std::thread::sleep(Duration::from_secs_f64(secs));
    let (f1, t1, c1) = (
        sink.frames.load(Ordering::Relaxed),
        Instant::now(),
        busy_cpu(),
    );
    stop.store(true, Ordering::Relaxed);
    source.join().unwrap();
    let report = sender.finish(Duration::from_secs(10));
    if std::env::var("BENCH_VERBOSE").is_ok()
        && let Ok(r) = &report
    {
        eprintln!("sender: {:?}", r.machine);
    }
    receiver.stop();
    let window = (t1 - t0).as_secs_f64();
    Measured {
        rate: (f1 - f0) as f64 / window,
        cpus: (c1 - c0).as_secs_f64() / window,
    }
}

/// Small messages (64 B … 1 KiB) of a live device: messages per second through the whole
/// engine with coalescing off and on (64 KiB blocks), over tcp and shm, next to a plain TCP
/// loopback copy of the same message size, side by side in one run.
fn small_messages(secs: f64) {
    const BLOCK: usize = 64 << 10;
    let wait = Duration::from_micros(100);
    println!(
        "== small messages, {secs:.1} s per point, one run; thousands of messages/s (block {} KiB, coalesce_wait {} us) ==",
        BLOCK >> 10,
        wait.as_micros()
    );
    println!(
        "{:>6} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9} {:>9} {:>9} {:>9}",
        "msg",
        "tcp off",
        "tcp on",
        "shm off",
        "shm on",
        "plain TCP",
        "off/pl",
        "on/pl",
        "shm on/pl",
        "on/off"
    );
    let socket = ShmSocket::new("bench-small");
    for len in [64usize, 128, 256, 512, 1024] {
        let over_tcp = |coalesce_wait| {
            let (l, c) = loopback_tcp(BLOCK);
            let m = Small {
                len,
                reliable: false,
                coalesce_wait,
                lend: false,
                place: false,
                copy_here: false,
            };
            engine_messages(BLOCK, m, secs, l, c).rate
        };
        let over_shm = |coalesce_wait| {
            let m = Small {
                len,
                reliable: false,
                coalesce_wait,
                lend: false,
                place: false,
                copy_here: false,
            };
            engine_messages(BLOCK, m, secs, socket.listen(BLOCK), socket.connector()).rate
        };
        let off = over_tcp(Duration::ZERO);
        let on = over_tcp(wait);
        let shm_off = over_shm(Duration::ZERO);
        let shm_on = over_shm(wait);
        let plain = plain_tcp_rate(len, secs) / len as f64;
        println!(
            "{:>6} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>10.1} {:>8.0}% {:>8.0}% {:>8.0}% {:>8.1}x",
            human(len),
            off / 1e3,
            on / 1e3,
            shm_off / 1e3,
            shm_on / 1e3,
            plain / 1e3,
            100.0 * off / plain,
            100.0 * on / plain,
            100.0 * shm_on / plain,
            on / off
        );
    }
}

/// The transport alone: the sending-thread loop ([`SenderMachine`] + one [`Connection`]) posting
/// pre-filled send blocks (no filling copy, no seal), and a receiver thread that polls the status
/// bytes, reads each block's first bytes and frees it (no validation, no copy-out). Bytes per second.
fn transport_rate(
    block: usize,
    secs: f64,
    mut listener: Box<dyn Listener>,
    connector: Box<dyn Connector>,
) -> f64 {
    // BENCH_TRANSPORT_SEND_BLOCKS: send blocks of the transport loop (default 8).
    let sends = env_knob("BENCH_TRANSPORT_SEND_BLOCKS").unwrap_or(8);
    let blocks = connector
        .alloc_send_blocks(sends, block)
        .expect("send blocks");
    let hello = Hello {
        version: PROTOCOL_VERSION,
        sender: "bench".into(),
        nonce: [0; 32],
        mechanism: Default::default(),
        session: 1,
        block_size: 0,
        data_path: DataPath::Tcp,
        qp: QpInfo::default(),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let received = Arc::new(AtomicU64::new(0));
    let rx = {
        let (stop, received) = (stop.clone(), received.clone());
        std::thread::Builder::new()
            .name("bench-rx".into())
            .spawn(move || {
                let acc = accept_own(listener.as_mut(), || false).expect("no stop");
                let n = acc.region.layout().blocks;
                let mut scanner = BlockScanner::default();
                // The engine's idle policy: sleep 20 µs, doubling to 500 µs.
                let mut idle = Duration::from_micros(20);
                while !stop.load(Ordering::Relaxed) {
                    match scanner.next_full(n, |j| acc.region.status(j)) {
                        Some(j) => {
                            let mut first = 0u8;
                            acc.region.read_block(j, &mut |b| first = b[0]);
                            std::hint::black_box(first);
                            acc.region.set_status(j, status::EMPTY);
                            received.fetch_add(1, Ordering::Relaxed);
                            idle = Duration::from_micros(20);
                        }
                        None => {
                            std::thread::sleep(idle);
                            idle = (idle * 2).min(Duration::from_micros(500));
                        }
                    }
                }
            })
            .unwrap()
    };
    let mut conn = connector.connect(&hello, None, &blocks).expect("connect");
    let mut m = SenderMachine::new(sends);
    m.handle_connected(conn.layout());
    for i in 0..sends {
        m.handle_filled(i, block, rdmastream::proto::Delivery::Unconfirmed);
    }
    let mut driver = Driver::new();
    let (mut t0, mut r0) = (None, 0);
    let start = Instant::now();
    let warm = start + Duration::from_millis(200);
    let end = warm + Duration::from_secs_f64(secs);
    loop {
        let now = Instant::now();
        if t0.is_none() && now >= warm {
            t0 = Some(now);
            r0 = received.load(Ordering::Relaxed);
        }
        if now >= end {
            break;
        }
        driver
            .turn(
                &mut m,
                conn.as_mut(),
                &Instant::now,
                Duration::from_millis(1),
            )
            .unwrap();
        // "Refill" instantly: the block's bytes are already there.
        while let Some(i) = m.poll_freed() {
            m.handle_filled(i, block, rdmastream::proto::Delivery::Unconfirmed);
        }
    }
    let r1 = received.load(Ordering::Relaxed);
    let el = t0.map(|t| t.elapsed().as_secs_f64()).unwrap_or(1.0);
    stop.store(true, Ordering::Relaxed);
    drop(conn);
    rx.join().unwrap();
    (r1 - r0) as f64 * block as f64 / el
}

/// Plain TCP loopback copy of `block`-byte messages for `secs`; bytes per second.
fn plain_tcp_rate(block: usize, secs: f64) -> f64 {
    plain_tcp_measured(block, secs, 1).rate
}

/// [`plain_tcp_rate`] with the writer writing from `buffers` buffers of `block` bytes in turn
/// and the reader reading into as many, and the CPUs busy meanwhile: one buffer (the plain copy
/// the targets are measured against) keeps both ends' buffer in cache; the engine's send blocks
/// and receiver's region are 16 (or more) blocks each, which a copy walks through in turn as
/// well (`region-tcp`'s column).
fn plain_tcp_measured(block: usize, secs: f64, buffers: usize) -> Measured {
    let buffers = buffers.max(1);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("plain-writer".into())
            .spawn(move || {
                let mut s = std::net::TcpStream::connect(addr).unwrap();
                s.set_nodelay(true).unwrap();
                let mut bufs: Vec<Vec<u8>> = (0..buffers).map(|_| vec![7u8; block]).collect();
                let touch = touching();
                for i in 0.. {
                    let buf = &mut bufs[i % buffers];
                    if touch {
                        buf.fill(i as u8);
                    }
                    if stop.load(Ordering::Relaxed) || s.write_all(buf).is_err() {
                        break;
                    }
                }
            })
            .unwrap()
    };
    // The reader on a thread of its own too, so that BENCH_PIN pins it and not the caller.
    let reader = std::thread::Builder::new()
        .name("plain-reader".into())
        .spawn(move || {
            let (mut r, _) = listener.accept().unwrap();
            let mut bufs: Vec<Vec<u8>> = (0..buffers).map(|_| vec![0u8; block]).collect();
            let mut next = 0;
            let mut total = 0u64;
            let warm = Instant::now() + Duration::from_millis(200);
            let mut start: Option<(Instant, u64, Duration)> = None;
            let end = warm + Duration::from_secs_f64(secs);
            let touch = touching();
            loop {
                r.read_exact(&mut bufs[next]).unwrap();
                if touch {
                    std::hint::black_box(touch_read(&bufs[next]));
                }
                next = (next + 1) % buffers;
                total += block as u64;
                let now = Instant::now();
                if start.is_none() && now >= warm {
                    start = Some((now, total, busy_cpu()));
                }
                if now >= end {
                    break;
                }
            }
            let (t0, b0, c0) = start.unwrap();
            let window = t0.elapsed().as_secs_f64();
            Measured {
                rate: (total - b0) as f64 / window,
                cpus: (busy_cpu() - c0).as_secs_f64() / window,
            }
        })
        .unwrap();
    if pinning() {
        // Before the 200 ms warm-up is over, as the engine's copying threads are.
        std::thread::sleep(Duration::from_millis(20));
        pin_threads("plain-writer", 0);
        pin_threads("plain-reader", 1);
    }
    let rate = reader.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    let _ = writer.join();
    rate
}

/// `BENCH_TOUCH=1`: both ends handle every byte of their frames, as a pipeline does (a source
/// renders its frame, a consumer reads it): the in-place source of `engine-tcp-place` and
/// `region-tcp` writes the whole payload, the receiving sink reads every frame, and plain TCP's
/// writer writes each buffer before it sends it and its reader reads each after it came. By
/// default neither end touches the bytes, so that the copies the transports make are all that
/// is measured; then the engine's send blocks are cold when they are sent (nothing wrote them
/// lately), where plain TCP sends one buffer that stays in cache.
fn touching() -> bool {
    static TOUCH: std::sync::LazyLock<bool> =
        std::sync::LazyLock::new(|| std::env::var("BENCH_TOUCH").is_ok_and(|v| v == "1"));
    *TOUCH
}

/// Reads every byte of `b` (a consumer's look at a frame), folded into a word.
fn touch_read(b: &[u8]) -> u64 {
    let mut words = b.chunks_exact(8);
    let folded = words.by_ref().fold(0u64, |a, w| {
        a ^ u64::from_le_bytes(w.try_into().expect("8 bytes"))
    });
    words
        .remainder()
        .iter()
        .fold(folded, |a, &x| a ^ u64::from(x))
}

/// `BENCH_PIN=1`: the two threads that copy, in plain TCP and in the engine over tcp (the
/// sending thread and the NIC thread), each kept on a core of its own (0 and 1) for the
/// measurement, so both run as they would with sender and receiver on separate cores or hosts,
/// where the scheduler cannot put them on one core (docs/benchmarks.md, "Where the threads run").
fn pinning() -> bool {
    std::env::var("BENCH_PIN").is_ok_and(|v| v == "1")
}

/// Pins this process's threads whose name starts with `prefix` to core `cpu` (`taskset`), if
/// the machine has two cores or more; says so on stderr when it cannot.
fn pin_threads(prefix: &str, cpu: usize) {
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        eprintln!("bench: BENCH_PIN needs two cores; not pinned");
        return;
    }
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        eprintln!("bench: BENCH_PIN: /proc/self/task unreadable; not pinned");
        return;
    };
    let mut pinned = 0;
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.trim_end().starts_with(prefix) {
            continue;
        }
        let tid = task.file_name().to_string_lossy().into_owned();
        let done = Command::new("taskset")
            .args(["-p", "-c", &cpu.to_string(), &tid])
            .stdout(Stdio::null())
            .status();
        match done {
            Ok(s) if s.success() => pinned += 1,
            other => eprintln!("bench: BENCH_PIN: taskset for thread {tid} ({prefix}…): {other:?}"),
        }
    }
    if pinned == 0 {
        eprintln!("bench: BENCH_PIN: no thread named {prefix}… to pin");
    }
}

/// The one connection a benchmark's own sender makes to `listener`, or `None` once `stopped`.
/// A refusal is a bug in the benchmark (its sender was turned away); it is not waited past, as
/// `accept` returns at once while a refusal is queued.
fn accept_own(
    listener: &mut dyn Listener,
    stopped: impl Fn() -> bool,
) -> Option<rdmastream::transport::Accepted> {
    loop {
        if stopped() {
            return None;
        }
        let mut refused = Vec::new();
        let accepted = listener
            .accept_sender_keeping(Duration::from_millis(50), &mut refused)
            .unwrap();
        if let Some(r) = refused.first() {
            panic!(
                "bench: the receiver refused the benchmark's sender: {}",
                r.why
            );
        }
        if accepted.is_some() {
            return accepted;
        }
    }
}

/// A benchmark knob from the environment (`BENCH_*`), if set and parseable.
fn env_knob<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// The receiver's blocks per sender in the benchmarks (`BENCH_BLOCKS`, default 16, as
/// configs/receiver.toml), unless a benchmark sets them for its next run ([`BLOCKS_NOW`]).
fn region_blocks() -> usize {
    match BLOCKS_NOW.load(Ordering::Relaxed) {
        0 => env_knob("BENCH_BLOCKS").unwrap_or(16),
        n => n,
    }
}

/// The receiver's blocks per sender for the runs that follow (0: [`region_blocks`]'s default):
/// `region-tcp` measures two region sizes side by side in one process.
static BLOCKS_NOW: AtomicUsize = AtomicUsize::new(0);

/// The bytes a receiver's region holds in `region-tcp`'s second column (at least 16 blocks):
/// what the receiver asks a tcp sender's region to hold.
const REGION_BYTES: usize = rdmastream_app::config::TCP_REGION_BYTES;

/// `region-tcp`: at one block size, the whole engine over tcp with frames written in place and
/// a region of 16 blocks (the default) next to one of at least [`REGION_BYTES`], and plain TCP
/// copying from and into 16 buffers in turn (as the engine's send blocks and region are walked
/// through), between two plain TCP copies of one buffer, round after round; each rate ÷ the
/// mean of its round's two plain TCP rates, and the engine's ÷ the 16 buffers' too. A region
/// smaller than what the loopback holds in flight leaves the sender waiting for syncs to find a
/// block free (docs/benchmarks.md, "At 64 KiB, the region's size"); 16 buffers of 1 MiB and
/// more do not stay in cache (docs/benchmarks.md, "What one buffer saves plain TCP").
fn region_tcp(block: usize, rounds: usize, secs: f64) {
    if block < 1024 || rounds == 0 {
        eprintln!("bench region-tcp: --block must be 1024 bytes or more and --rounds at least 1");
        std::process::exit(2);
    }
    let big = (REGION_BYTES / block).max(16);
    println!(
        "== region-tcp: {} blocks, engine over tcp with frames written in place, {secs:.1} s per point; MB/s, and ÷ plain TCP of the same round ==",
        human(block)
    );
    println!(
        "   cpu ÷: CPU time per byte moved (all of the machine's CPUs), engine with 16 blocks ÷ plain TCP (one buffer)"
    );
    println!(
        "{:>5} {:>10} {:>16} {:>16} {:>13} {:>10} {:>8} {:>8} {:>8} {:>6}",
        "round",
        "plain TCP",
        format!("16 blocks ({})", human(16 * block)),
        format!("{big} blocks ({})", human(big * block)),
        "plain 16 buf",
        "plain TCP",
        "16 ÷",
        format!("{big} ÷"),
        "16 buf ÷",
        "cpu ÷"
    );
    let mut ratios = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let place = |blocks: usize| {
        BLOCKS_NOW.store(blocks, Ordering::Relaxed);
        let (l, c) = loopback_tcp(block);
        let measured = block_rate(block, Frames::Placed, secs, l, c);
        BLOCKS_NOW.store(0, Ordering::Relaxed);
        measured
    };
    for round in 1..=rounds {
        let before = plain_tcp_measured(block, secs, 1);
        // The order alternates, so no run always follows plain TCP of one buffer.
        let (small, large, spread) = if round % 2 == 1 {
            let s = place(16);
            let b = place(big);
            (s, b.rate, plain_tcp_measured(block, secs, 16).rate)
        } else {
            let r = plain_tcp_measured(block, secs, 16).rate;
            let b = place(big);
            (place(16), b.rate, r)
        };
        let after = plain_tcp_measured(block, secs, 1);
        let plain = (before.rate + after.rate) / 2.0;
        let plain_cost = (before.cost() + after.cost()) / 2.0;
        ratios.0.push(small.rate / plain);
        ratios.1.push(large / plain);
        ratios.2.push(spread / plain);
        ratios.3.push(small.rate / spread);
        ratios.4.push(small.cost() / plain_cost);
        println!(
            "{round:>5} {:>10.1} {:>16.1} {:>16.1} {:>13.1} {:>10.1} {:>7.0}% {:>7.0}% {:>7.0}% {:>6.2}",
            before.rate / 1e6,
            small.rate / 1e6,
            large / 1e6,
            spread / 1e6,
            after.rate / 1e6,
            100.0 * small.rate / plain,
            100.0 * large / plain,
            100.0 * spread / plain,
            small.cost() / plain_cost
        );
    }
    let range = |v: &[f64], mark: bool| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(0.0, f64::max);
        let at_least = v.iter().filter(|&&r| r >= 0.8).count();
        let count = if mark {
            format!(" (≥ 80 % in {at_least} of {})", v.len())
        } else {
            String::new()
        };
        format!("{:.0}–{:.0} %{count}", 100.0 * lo, 100.0 * hi)
    };
    println!("16 blocks: {}", range(&ratios.0, true));
    println!("{big} blocks: {}", range(&ratios.1, true));
    println!("plain TCP over 16 buffers: {}", range(&ratios.2, false));
    println!(
        "16 blocks ÷ plain TCP over 16 buffers: {}",
        range(&ratios.3, false)
    );
    println!(
        "CPU per byte, 16 blocks ÷ plain TCP: {}",
        range(&ratios.4, false)
    );
}

/// A Unix socket for the shm transport's benchmarks, in a directory of its own that goes away
/// with it.
struct ShmSocket {
    dir: PathBuf,
    path: PathBuf,
}

impl ShmSocket {
    fn new(tag: &str) -> ShmSocket {
        let dir = std::env::temp_dir().join(format!("rdmastream-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory for the shm socket");
        let path = dir.join("rx.sock");
        ShmSocket { dir, path }
    }

    fn listen(&self, block: usize) -> Box<dyn Listener> {
        Box::new(shm::listen(&self.path, region(block)).unwrap())
    }

    fn connector(&self) -> Box<dyn Connector> {
        Box::new(ShmConnector::new(&format!("unix:{}", self.path.display())).expect("unix:"))
    }
}

impl Drop for ShmSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A tcp receiver listening on a loopback port of its own, and a connector to it.
fn loopback_tcp(block: usize) -> (Box<dyn Listener>, Box<dyn Connector>) {
    let l = tcp::listen("127.0.0.1:0", region(block)).unwrap();
    let connector = TcpConnector::new(l.local_addr());
    (Box::new(l), Box::new(connector))
}

/// The receiver's region in the benchmarks: [`region_blocks`] blocks of `block` bytes; over
/// tcp its NIC thread looks for bytes for `BENCH_NIC_SPIN_US` before it sleeps (default the
/// receiver's, 300 µs; 0 sleeps at once, as before 2026-12-02).
fn region(block: usize) -> RegionSettings {
    let mut r = RegionSettings::plain(region_blocks(), block);
    if let Some(us) = env_knob("BENCH_NIC_SPIN_US") {
        r.nic_spin = Duration::from_micros(us);
    }
    r
}

fn human(n: usize) -> String {
    match n {
        n if n >= 1 << 20 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

fn throughput(secs: f64) {
    println!("== throughput, {secs:.1} s per point, one run; MB/s of block bytes moved ==");
    println!(
        "   engine: a lossless device: source -> filling thread (copy + seal) -> sending thread -> transport -> polling (validate; the block handed on, freed at the acknowledgement)"
    );
    println!(
        "   engine shm live: the same for a live (lossy) device over shm: the filling thread copies each frame once, into a receiver's block lent to it; no copy out"
    );
    println!(
        "   eng tcp place: a live device over tcp whose source writes each frame into a send block in place and commits it (sealed on its own thread, straight to the sending thread; no user-space copy on either end)"
    );
    println!(
        "   transport: sending-thread loop over pre-filled blocks -> transport -> polling that frees each block"
    );
    println!(
        "{:>8} {:>11} {:>11} {:>14} {:>11} {:>14} {:>14} {:>14} {:>11} {:>10} {:>10} {:>12} {:>10} {:>10} {:>12}",
        "block",
        "engine mem",
        "engine tcp",
        "eng tcp place",
        "engine shm",
        "eng shm live",
        "transport tcp",
        "transport shm",
        "plain TCP",
        "tr tcp/pl",
        "eng tcp/pl",
        "place tcp/pl",
        "tr shm/pl",
        "eng shm/pl",
        "live shm/pl"
    );
    let socket = ShmSocket::new("bench");
    let only: Option<usize> = std::env::args()
        .skip_while(|a| a != "--block")
        .nth(1)
        .and_then(|b| b.parse().ok());
    let only_tcp = std::env::var("BENCH_ONLY_TCP").is_ok();
    for block in SIZES.into_iter().filter(|b| only.is_none_or(|o| o == *b)) {
        let fabric = MemFabric::new();
        let mem = engine_rate(
            block,
            secs,
            Box::new(fabric.listen("bench", region(block))),
            Box::new(fabric.connector("bench")),
        );
        let (l, c) = loopback_tcp(block);
        let tcp = engine_rate(block, secs, l, c);
        let (l, c) = loopback_tcp(block);
        let placed = block_rate(block, Frames::Placed, secs, l, c).rate;
        let (l, c) = loopback_tcp(block);
        let transport = transport_rate(block, secs, l, c);
        let engine_shm = engine_rate(block, secs, socket.listen(block), socket.connector());
        let live_shm = block_rate(
            block,
            Frames::Live,
            secs,
            socket.listen(block),
            socket.connector(),
        )
        .rate;
        let transport_shm = transport_rate(block, secs, socket.listen(block), socket.connector());
        let plain = if only_tcp {
            1.0
        } else {
            plain_tcp_rate(block, secs)
        };
        println!(
            "{:>8} {:>11.1} {:>11.1} {:>14.1} {:>11.1} {:>14.1} {:>14.1} {:>14.1} {:>11.1} {:>9.0}% {:>9.0}% {:>11.0}% {:>9.0}% {:>9.0}% {:>11.0}%",
            human(block),
            mem / 1e6,
            tcp / 1e6,
            placed / 1e6,
            engine_shm / 1e6,
            live_shm / 1e6,
            transport / 1e6,
            transport_shm / 1e6,
            plain / 1e6,
            100.0 * transport / plain,
            100.0 * tcp / plain,
            100.0 * placed / plain,
            100.0 * transport_shm / plain,
            100.0 * engine_shm / plain,
            100.0 * live_shm / plain
        );
    }
}

/// Runs a perftest server/client pair on rxe0 and returns the client's result line's columns.
/// The client is retried while the server is still starting; a server left waiting is killed.
fn perftest(tool: &str, args: &[String]) -> Option<Vec<f64>> {
    let mut server = Command::new(tool)
        .args(["-d", "rxe0", "-F"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let mut result = None;
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(1000));
        let Ok(out) = Command::new(tool)
            .args(["-d", "rxe0", "-F"])
            .args(args)
            .arg(VM_HOST)
            .output()
        else {
            break;
        };
        let text = String::from_utf8_lossy(&out.stdout);
        // The result is the first line after the "#bytes" header.
        let line = text
            .lines()
            .skip_while(|l| !l.trim_start().starts_with("#bytes"))
            .nth(1);
        let cols: Vec<f64> = line
            .map(|l| {
                l.split_whitespace()
                    .filter_map(|c| c.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        if out.status.success() && !cols.is_empty() {
            result = Some(cols);
            break;
        }
        if server.try_wait().ok().flatten().is_some() {
            break;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = server.kill();
    let _ = server.wait();
    result
}

const VM_HOST: &str = "192.0.2.1";

/// Our sync: one RDMA READ of `n` status bytes, posted and polled to completion; median and p99
/// in microseconds over `iters` reads.
fn sync_latency(n: usize, iters: usize, settings: &VerbsSettings) -> (f64, f64) {
    let region = RegionSettings::plain(n, 4096);
    let mut listener =
        verbs::listen(&format!("{VM_HOST}:0"), region, settings.clone()).expect("listener");
    let addr = listener.local_addr();
    let connector = VerbsConnector::new(addr, settings.clone(), 4).expect("connector");
    let blocks = connector.alloc_send_blocks(1, 4096).expect("blocks");
    let hello = Hello {
        version: PROTOCOL_VERSION,
        sender: "lat".into(),
        nonce: [0; 32],
        mechanism: Default::default(),
        session: 2,
        block_size: 0,
        data_path: DataPath::Verbs,
        qp: QpInfo::default(),
    };
    let keep = std::thread::spawn(move || {
        let a = accept_own(&mut listener, || false).expect("no stop");
        std::thread::sleep(Duration::from_secs(3600));
        drop(a);
    });
    let mut conn = connector.connect(&hello, None, &blocks).expect("connect");
    let mut samples = Vec::with_capacity(iters);
    let mut done = Vec::new();
    for i in 0..iters + 50 {
        let t = Instant::now();
        conn.post_read(
            i as u64,
            RemoteAddr {
                target: Target::Statuses,
                offset: 0,
            },
            n,
        )
        .unwrap();
        loop {
            done.clear();
            conn.poll_completions(&mut done, Duration::from_millis(100))
                .unwrap();
            if !done.is_empty() {
                break;
            }
        }
        if i >= 50 {
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    drop(keep);
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (
        samples[samples.len() / 2],
        samples[samples.len() * 99 / 100],
    )
}

/// Inside the Soft-RoCE VM: our verbs data path next to ib_write_bw on the same device, in one
/// run (the sync latency is `verbs-sync`, which scripts/bench-vm.sh runs right after, pinned).
fn verbs(secs: f64) {
    let settings = VerbsSettings {
        device: None,
        port: 1,
        gid_index: None,
    };
    let what = require_verbs("verbs", &settings);
    println!(
        "== verbs on {what}, {secs:.1} s per point; perftest on the same device in the same run =="
    );
    println!(
        "-- throughput: our transport (sending-thread loop over pre-filled blocks, chain = data WRITE + inline status WRITE, sync READ when out of blocks) vs ib_write_bw -s <block>"
    );
    println!(
        "{:>8} {:>12} {:>16} {:>8}",
        "block", "ours MB/s", "ib_write_bw MB/s", "ratio"
    );
    for block in SIZES {
        eprintln!("   ... {} ours", human(block));
        let region = RegionSettings::plain(16, block);
        let l = verbs::listen(&format!("{VM_HOST}:0"), region, settings.clone()).expect("listener");
        let addr = l.local_addr();
        let ours = transport_rate(
            block,
            secs,
            Box::new(l),
            Box::new(VerbsConnector::new(addr, settings.clone(), 8).expect("connector")),
        );
        eprintln!("   ... {} ib_write_bw", human(block));
        let iters = ((64usize << 20) / block).clamp(20, 20000);
        // perftest prints bytes, iterations, BW peak, BW average (MB/s), message rate.
        let theirs = perftest(
            "ib_write_bw",
            &[
                "-s".into(),
                block.to_string(),
                "-n".into(),
                iters.to_string(),
            ],
        )
        .and_then(|c| c.get(3).copied())
        .map(|mb| mb * 1.048576); // perftest's MB is MiB
        match theirs {
            Some(t) => println!(
                "{:>8} {:>12.1} {:>16.1} {:>7.0}%",
                human(block),
                ours / 1e6,
                t,
                100.0 * ours / 1e6 / t
            ),
            None => println!(
                "{:>8} {:>12.1} {:>16} {:>8}",
                human(block),
                ours / 1e6,
                "n/a",
                "-"
            ),
        }
    }
}

/// Our sync (one status READ of N bytes, posted and polled to completion) next to
/// `ib_read_lat -s N`, alternating per N, `rounds` times; prints each round and the median.
/// Single points jump under TCG (a VM exit or a timer costs tens of microseconds), so one round
/// is not to be believed alone.
/// The RDMA device the verbs benchmarks run on; without one, says where to run them and exits.
fn require_verbs(bench: &str, settings: &VerbsSettings) -> String {
    verbs::probe(settings).unwrap_or_else(|e| {
        eprintln!("bench {bench}: {e} (run it inside the VM: scripts/bench-vm.sh)");
        std::process::exit(1);
    })
}

fn sync_rounds(settings: &VerbsSettings, rounds: usize) {
    const NS: [usize; 5] = [3, 8, 16, 32, 64];
    require_verbs("verbs-sync", settings);
    println!(
        "-- sync latency: our status READ of N bytes (post + poll to completion) vs ib_read_lat -s N, {rounds} rounds"
    );
    println!(
        "{:>6} {:>6} {:>12} {:>12} {:>16} {:>16} {:>8}",
        "round", "N", "ours p50 us", "ours p99 us", "ib_read_lat typ", "ib_read_lat 99%", "ratio"
    );
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); NS.len()];
    for round in 1..=rounds {
        for (k, n) in NS.into_iter().enumerate() {
            let (p50, p99) = sync_latency(n, 1000, settings);
            // ib_read_lat prints bytes, iterations, t_min, t_max, t_typical, t_avg, t_stdev,
            // 99%, 99.9%.
            let theirs = perftest(
                "ib_read_lat",
                &["-s".into(), n.to_string(), "-n".into(), "1000".into()],
            );
            // perftest now and then prints "inf" for a run; that run counts as no figure.
            let typical = theirs
                .as_ref()
                .and_then(|c| c.get(4).copied())
                .filter(|t| t.is_finite() && *t > 0.0);
            let p99_theirs = theirs.as_ref().and_then(|c| c.get(7).copied());
            let show = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.1}"));
            let ratio = typical.map(|t| p50 / t);
            if let Some(r) = ratio {
                ratios[k].push(r);
            }
            println!(
                "{round:>6} {n:>6} {p50:>12.1} {p99:>12.1} {:>16} {:>16} {:>8}",
                show(typical),
                show(p99_theirs),
                ratio.map_or("-".to_string(), |r| format!("{r:.2}x"))
            );
        }
    }
    println!("-- sync latency, median ratio over the rounds (ours p50 / ib_read_lat typical)");
    for (k, n) in NS.into_iter().enumerate() {
        let r = &mut ratios[k];
        r.sort_by(|a, b| a.partial_cmp(b).unwrap());
        match r.get(r.len() / 2) {
            Some(m) => println!(
                "{n:>6} {m:>7.2}x  (rounds: {})",
                r.iter()
                    .map(|x| format!("{x:.2}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
            None => println!("{n:>6} -"),
        }
    }
}

/// One 640×480 RGB frame in one block, and the sender's and receiver's per-frame steps on it.
/// Each step is its own non-inlined function so callgrind can count its instructions
/// (`bench frame-instr` under `valgrind --tool=callgrind`, see [`frame_instr`]).
struct FrameSteps {
    payload: Vec<u8>,
    block: Vec<u8>,
    copy: Vec<u8>,
    header: rdmastream::proto::BlockHeader,
    /// A block sealed as over tcp and shm (CRC32C over the header only), and its header.
    ordered_block: Vec<u8>,
    ordered_header: rdmastream::proto::BlockHeader,
    /// The synthetic camera's frame as the source hands it over: rendered in place.
    camera: rdmastream::engine::FrameData,
}

impl FrameSteps {
    fn new() -> FrameSteps {
        use rdmastream::proto::{BlockHeader, OVERHEAD};
        let payload: Vec<u8> = (0..640 * 480 * 3).map(|i| (i % 251) as u8).collect();
        let kind = rdmastream_app::source::SourceKind::CameraSynthetic {
            width: 640,
            height: 480,
            fps: 25.0,
        };
        let camera = rdmastream_app::source::Producer::new(0, &kind)
            .expect("camera")
            .frame(7)
            .data;
        let header = BlockHeader::single(0, payload.len());
        FrameSteps {
            block: vec![0u8; payload.len() + OVERHEAD],
            copy: vec![0u8; payload.len()],
            header,
            ordered_block: vec![0u8; payload.len() + OVERHEAD],
            ordered_header: header.sealed_for(rdmastream::proto::Placement::Ordered),
            payload,
            camera,
        }
    }

    /// One plain copy of the frame: the yardstick.
    #[inline(never)]
    fn plain_copy(&mut self) {
        self.copy
            .copy_from_slice(std::hint::black_box(&self.payload));
    }

    /// The copying path (a frame from bytes: GStreamer buffers, images): header + copy + seal.
    #[inline(never)]
    fn fill_copied(&mut self) {
        let used = self
            .header
            .write_header_and_payload(std::hint::black_box(&self.payload), &mut self.block);
        self.header.seal(&mut self.block[..used]);
    }

    /// In place, the payload already written by its producer (into the block): header + seal.
    #[inline(never)]
    fn fill_in_place_written(&mut self) {
        let used = self.header.write_header_with(&mut self.block, |_| {});
        self.header.seal(&mut self.block[..used]);
    }

    /// In place, the header alone: what the path costs without the CRC32C seal.
    #[inline(never)]
    fn fill_in_place_no_seal(&mut self) {
        self.header.write_header_with(&mut self.block, |_| {});
        std::hint::black_box(&self.block);
    }

    /// The synthetic camera rendered straight into the block, then sealed (the source's
    /// rendering included).
    #[inline(never)]
    fn fill_camera_in_place(&mut self) {
        let camera = &self.camera;
        let used = self
            .header
            .write_header_with(&mut self.block, |dst| camera.write(0, dst));
        self.header.seal(&mut self.block[..used]);
    }

    /// Before in-place frames: the camera rendered into a Vec of its own, then copied and sealed.
    #[inline(never)]
    fn fill_camera_via_vec(&mut self) {
        let mut v = vec![0u8; 640 * 480 * 3];
        rdmastream_app::source::camera_pattern(0, 7, 640, 480, &mut v);
        let used = self
            .header
            .write_header_and_payload(std::hint::black_box(&v), &mut self.block);
        self.header.seal(&mut self.block[..used]);
    }

    /// The receiver's validation: decode + CRC32C check.
    #[inline(never)]
    fn receiver_check(&mut self) {
        rdmastream::proto::BlockHeader::decode_block(std::hint::black_box(&self.block), 255)
            .expect("valid");
    }

    /// The copying path over tcp and shm: header + copy + seal over the header only.
    #[inline(never)]
    fn fill_copied_header_seal(&mut self) {
        let used = self
            .ordered_header
            .write_header_and_payload(std::hint::black_box(&self.payload), &mut self.ordered_block);
        self.ordered_header.seal(&mut self.ordered_block[..used]);
    }

    /// In place over tcp and shm, the payload already written: header + header seal.
    #[inline(never)]
    fn fill_in_place_header_seal(&mut self) {
        let used = self
            .ordered_header
            .write_header_with(&mut self.ordered_block, |_| {});
        self.ordered_header.seal(&mut self.ordered_block[..used]);
    }

    /// The receiver's validation over tcp and shm: decode + CRC32C over the header.
    #[inline(never)]
    fn receiver_check_header_seal(&mut self) {
        rdmastream::proto::BlockHeader::decode_block_on(
            std::hint::black_box(&self.ordered_block),
            255,
            rdmastream::proto::Placement::Ordered,
        )
        .expect("valid");
    }
}

type Step = (&'static str, fn(&mut FrameSteps));

const FRAME_STEPS: [Step; 10] = [
    ("payload copy (memcpy)", FrameSteps::plain_copy),
    (
        "filling copied: header + copy + CRC32C seal",
        FrameSteps::fill_copied,
    ),
    (
        "filling in place, payload written: header + seal",
        FrameSteps::fill_in_place_written,
    ),
    (
        "filling in place, payload written: header only",
        FrameSteps::fill_in_place_no_seal,
    ),
    (
        "camera rendered in place + header + seal",
        FrameSteps::fill_camera_in_place,
    ),
    (
        "camera rendered into a Vec + copy + seal",
        FrameSteps::fill_camera_via_vec,
    ),
    (
        "receiver: decode + CRC32C check",
        FrameSteps::receiver_check,
    ),
    (
        "filling copied, tcp/shm: header + copy + header seal",
        FrameSteps::fill_copied_header_seal,
    ),
    (
        "filling in place, tcp/shm: header + header seal",
        FrameSteps::fill_in_place_header_seal,
    ),
    (
        "receiver, tcp/shm: decode + header CRC32C check",
        FrameSteps::receiver_check_header_seal,
    ),
];

/// The per-frame CPU work around the transport for one 640×480 RGB frame in one block: a plain
/// copy of the payload, the filling thread's paths (copied, in place with the payload already
/// written, the synthetic camera rendered in place and, for comparison, rendered into a Vec
/// first as before), and the receiver's validation. Medians of 200 runs, in ms and MB/s.
fn frame_cpu() {
    let mut steps = FrameSteps::new();
    steps.fill_copied();
    steps.fill_copied_header_seal();
    let median = |steps: &mut FrameSteps, f: fn(&mut FrameSteps)| {
        let mut t: Vec<f64> = (0..200)
            .map(|_| {
                let start = Instant::now();
                f(steps);
                start.elapsed().as_secs_f64()
            })
            .collect();
        t.sort_by(|a, b| a.partial_cmp(b).unwrap());
        t[t.len() / 2]
    };
    let mb = steps.payload.len() as f64 / 1e6;
    println!(
        "-- per-frame CPU work for one 640x480 RGB frame ({} bytes), median of 200",
        steps.payload.len()
    );
    println!("{:<50} {:>10} {:>10} {:>8}", "step", "ms", "MB/s", "x copy");
    let copy = median(&mut steps, FrameSteps::plain_copy);
    for (step, f) in FRAME_STEPS {
        let secs = median(&mut steps, f);
        println!(
            "{step:<50} {:>10.3} {:>10.0} {:>8.2}",
            secs * 1e3,
            mb / secs,
            secs / copy
        );
    }
}

/// How a frame copy slows down as its destinations spread over more memory: one `frame`-byte
/// frame copied again and again into 1, 2, … 24 blocks of `block` bytes taken in turn (as the
/// sender writes into the receiver's blocks round-robin), µs per copy, median of 5 runs of
/// 2000 copies. Where the destinations stop fitting in what the last-level cache leaves this
/// process, each copy goes to memory: on the development VM beyond about 10 MiB, a third of the
/// 32 MiB its sysfs lists (the reason for shm's cache budget of an eighth:
/// docs/protocol.md, "The working set on one host").
fn copy_cache(frame: usize, block: usize) {
    let block = block.max(frame);
    let src: Vec<u8> = (0..frame).map(|i| i as u8).collect();
    println!(
        "-- one {frame}-byte frame copied into N blocks of {block} bytes in turn, us per copy (median of 5 x 2000)"
    );
    println!("{:>4} {:>10} {:>10} {:>8}", "N", "MiB", "us", "GB/s");
    for n in [1, 2, 4, 6, 8, 10, 12, 16, 24] {
        let mut dst = vec![1u8; n * block];
        let mut runs: Vec<f64> = (0..5)
            .map(|_| {
                let start = Instant::now();
                for i in 0..2000 {
                    let at = (i % n) * block;
                    dst[at..at + frame].copy_from_slice(&src);
                    std::hint::black_box(&dst);
                }
                start.elapsed().as_secs_f64() / 2000.0
            })
            .collect();
        runs.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let t = runs[2];
        println!(
            "{n:>4} {:>10.1} {:>10.1} {:>8.1}",
            (n * block) as f64 / (1 << 20) as f64,
            t * 1e6,
            frame as f64 / t / 1e9
        );
    }
}

/// Runs each of [`FRAME_STEPS`] `rounds` times and nothing else, for an instruction count per
/// step (hardware counters are often missing in VMs and containers; callgrind counts the same
/// on any machine, however busy):
/// `valgrind --tool=callgrind --callgrind-out-file=cg.out target/release/bench frame-instr --rounds 5`
/// then `callgrind_annotate --inclusive=yes cg.out | grep FrameSteps` and divide by the rounds.
fn frame_instr(rounds: usize) {
    let mut steps = FrameSteps::new();
    steps.fill_copied();
    steps.fill_copied_header_seal();
    for (step, f) in FRAME_STEPS {
        for _ in 0..rounds {
            f(&mut steps);
        }
        println!("{step}: {rounds} rounds");
    }
}

/// CPU ticks (utime + stime) per thread name of process `pid`.
fn thread_ticks(pid: u32) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].to_string();
        let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        let ticks: u64 = fields
            .get(11)
            .and_then(|u| u.parse::<u64>().ok())
            .unwrap_or(0)
            + fields
                .get(12)
                .and_then(|s| s.parse::<u64>().ok())
                .unwrap_or(0);
        *out.entry(name).or_insert(0) += ticks;
    }
    out
}

fn group(name: &str) -> &'static str {
    match name {
        n if n.starts_with("filling") || n.starts_with("sending") => "filling+sending",
        n if n.starts_with("source") => "sources",
        n if n.starts_with("tcp-nic") => "tcp NIC emulation",
        n if n.starts_with("poll") => "status polling",
        n if n.starts_with("writer") => "file writers",
        n if n.starts_with("tcp-compl") => "completions",
        n if n.starts_with("shm-watch") => "shm socket watch",
        _ => "other",
    }
}

fn cpu_by_group(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
    secs: f64,
) -> BTreeMap<&'static str, f64> {
    let hz = 100.0; // USER_HZ on Linux
    let mut out = BTreeMap::new();
    for (name, t) in after {
        let d = t - before.get(name).copied().unwrap_or(0);
        *out.entry(group(name)).or_insert(0.0) += d as f64 / hz / secs * 100.0;
    }
    out
}

fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().join(name)
}

/// The demo scenario over `transport` (`tcp` on loopback, or `shm` on a Unix socket).
fn cameras(secs: f64, transport: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = if transport == "shm" {
        format!("unix:{}", tmp.path().join("rx.sock").display())
    } else {
        format!("127.0.0.1:{port}")
    };
    let out = tmp.path().join("out");
    let rx_cfg = tmp.path().join("receiver.toml");
    // BENCH_NIC_SPIN_US sets the receiver's tcp_nic_spin_us (default 300).
    let nic_spin = env_knob::<u64>("BENCH_NIC_SPIN_US")
        .map(|us| format!("tcp_nic_spin_us = {us}\n"))
        .unwrap_or_default();
    std::fs::write(
        &rx_cfg,
        format!("blocks = 16\nblock_size = 1048576\nformat = \"raw\"\nkeep = 20\n{nic_spin}"),
    )
    .unwrap();
    let tx_cfg = tmp.path().join("sender.toml");
    // BENCH_SHM_CACHE_BUDGET sets the sender's shm_cache_budget ("auto", "off", "8 MiB").
    let budget = std::env::var("BENCH_SHM_CACHE_BUDGET")
        .map(|b| format!("shm_cache_budget = \"{b}\"\n"))
        .unwrap_or_default();
    // BENCH_CAMERA_START sets the devices' `start` ("together", the default, or "spread").
    let start = std::env::var("BENCH_CAMERA_START")
        .map(|s| format!("start = \"{s}\"\n"))
        .unwrap_or_default();
    std::fs::write(
        &tx_cfg,
        format!(
            "name = \"bench\"\nreceiver = \"{listen}\"\ntransport = \"{transport}\"\n{budget}\
             [[device]]\nid = 0\ncount = 12\nsource = \"camera-synthetic\"\n{start}\
             [[device]]\nid = 100\ncount = 2\nsource = \"radar-synthetic\"\n{start}"
        ),
    )
    .unwrap();
    println!(
        "\n== cameras: 12 x 640x480 RGB @ 25 fps + 2 radars (64 KiB @ 20 Hz), sender and receiver processes over {transport}, {secs:.0} s =="
    );
    let (sender_bin, receiver_bin) = (bin("sender"), bin("receiver"));
    if !sender_bin.exists() || !receiver_bin.exists() {
        eprintln!("build the binaries first: cargo build --release");
        std::process::exit(1);
    }
    let rx_log = tmp.path().join("rx.log");
    let tx_log = tmp.path().join("tx.log");
    let log = |p: &Path| std::fs::File::create(p).unwrap();
    let mut rx = Command::new(&receiver_bin)
        .args([
            "--config",
            rx_cfg.to_str().unwrap(),
            "--listen",
            &listen,
            "--out",
            out.to_str().unwrap(),
            "--verify",
            "--exit-after-eos",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log(&rx_log))
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let rx_idle0 = thread_ticks(rx.id());
    std::thread::sleep(Duration::from_secs(2));
    let rx_idle1 = thread_ticks(rx.id());
    let mut tx = Command::new(&sender_bin)
        .args([
            "--config",
            tx_cfg.to_str().unwrap(),
            "--duration",
            &format!("{secs}"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log(&tx_log))
        .spawn()
        .unwrap();
    // Measure the middle of the run.
    std::thread::sleep(Duration::from_secs_f64(1.5));
    let window = (secs - 3.0).max(2.0);
    let (tx0, rx0, t0) = (thread_ticks(tx.id()), thread_ticks(rx.id()), Instant::now());
    std::thread::sleep(Duration::from_secs_f64(window));
    let (tx1, rx1, el) = (
        thread_ticks(tx.id()),
        thread_ticks(rx.id()),
        t0.elapsed().as_secs_f64(),
    );
    let tx_status = tx.wait().unwrap();
    let rx_status = rx.wait().unwrap();
    let tx_cpu = cpu_by_group(&tx0, &tx1, el);
    let rx_cpu = cpu_by_group(&rx0, &rx1, el);
    let idle = cpu_by_group(&rx_idle0, &rx_idle1, 2.0);
    let tx_text = std::fs::read_to_string(&tx_log).unwrap_or_default();
    let rx_text = std::fs::read_to_string(&rx_log).unwrap_or_default();
    let total = |m: &BTreeMap<&str, f64>| m.values().sum::<f64>();
    println!("sender exit {tx_status}, receiver exit {rx_status}");
    println!(
        "sender CPU   {:6.1} % of one core: {:?}",
        total(&tx_cpu),
        fmt(&tx_cpu)
    );
    // The targets: < 5 % over shm (the zero-copy issue, with the receiver's polling < 5 % too),
    // < 25 % over tcp, where the sending thread's writev is the sending copy.
    let target = if transport == "shm" { 5 } else { 25 };
    println!(
        "  filling + sending threads: {:.1} % (target < {target} % over {transport}; the paper reports 106 % for its whole sender)",
        tx_cpu.get("filling+sending").copied().unwrap_or(0.0)
    );
    println!(
        "receiver CPU {:6.1} % of one core: {:?}",
        total(&rx_cpu),
        fmt(&rx_cpu)
    );
    if transport == "shm" {
        println!(
            "  status polling: {:.1} % (target < 5 % over shm)",
            rx_cpu.get("status polling").copied().unwrap_or(0.0)
        );
    }
    println!(
        "receiver idle (listening, no sender): {:.2} % of one core",
        total(&idle)
    );
    for line in tx_text.lines().filter(|l| l.contains("done after")) {
        println!("sender:   {}", after_level(line));
    }
    for line in rx_text
        .lines()
        .filter(|l| l.contains("summary:") || l.contains("verify"))
    {
        println!("receiver: {}", after_level(line));
    }
    idle_polling(&receiver_bin, &sender_bin, tmp.path());
}

/// CPU of the receiver's polling thread while a sender is connected but sends almost nothing
/// (one 1 KiB radar frame a second): the cost of sleeping briefly between idle status scans.
fn idle_polling(receiver_bin: &Path, sender_bin: &Path, dir: &Path) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let tx_cfg = dir.join("idle-sender.toml");
    std::fs::write(
        &tx_cfg,
        format!("name = \"idle\"\nreceiver = \"127.0.0.1:{port}\"\ntransport = \"tcp\"\n[[device]]\nid = 0\nsource = \"radar-synthetic\"\nsize = 1024\nrate = 1\n"),
    )
    .unwrap();
    let listen = format!("127.0.0.1:{port}");
    let out = dir.join("idle-out");
    let mut rx = Command::new(receiver_bin)
        .args([
            "--listen",
            &listen,
            "--out",
            out.to_str().unwrap(),
            "--exit-after-eos",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let mut tx = Command::new(sender_bin)
        .args(["--config", tx_cfg.to_str().unwrap(), "--duration", "5"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let (a, t) = (thread_ticks(rx.id()), Instant::now());
    std::thread::sleep(Duration::from_secs(3));
    let (b, el) = (thread_ticks(rx.id()), t.elapsed().as_secs_f64());
    let _ = tx.wait();
    let _ = rx.wait();
    let cpu = cpu_by_group(&a, &b, el);
    println!(
        "receiver with a connected, idle sender (poll sleeps 20 us doubling to 500 us): status polling {:.2} %, whole receiver {:.2} % of one core",
        cpu.get("status polling").copied().unwrap_or(0.0),
        cpu.values().sum::<f64>()
    );
}

fn fmt(m: &BTreeMap<&str, f64>) -> BTreeMap<String, String> {
    m.iter()
        .map(|(k, v)| (k.to_string(), format!("{v:.1}%")))
        .collect()
}

fn after_level(line: &str) -> &str {
    line.find(" INFO ")
        .map(|i| &line[i + 6..])
        .or_else(|| line.find("INFO").map(|i| &line[i + 4..]))
        .unwrap_or(line)
        .trim()
}
