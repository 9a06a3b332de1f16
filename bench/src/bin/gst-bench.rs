//! `gst-bench`: rdmasink/rdmasrc (over the tcp software transport, or `--transport verbs`, or
//! `--transport shm` on a Unix socket)
//! against tcpserversink/tcpclientsrc (with gdppay/gdpdepay) and shmsink/shmsrc, side by side in
//! one run: 640×480 RGB at 25 fps (live) and unthrottled. Prints frames per second at the
//! receiver, latency p50/p99 (sender's sink input → receiver's sink input) and CPU of each
//! process. A benchmark, not a test: it prints figures and asserts nothing.
//!
//! Each run starts a sending and a receiving process (this binary in a child role), so CPU is
//! measured per side. A pad probe before the sending element writes a magic, the monotonic
//! clock and a sequence number into the first bytes of each frame; a probe at the receiver's
//! sink reads them (both processes read the same CLOCK_MONOTONIC). Figures are taken over a
//! window that starts after a warm-up, at the same instant in both processes.
//!
//! Each sink copies every frame (`identity drop-allocation=true` before it); with `--in-place`
//! videotestsrc writes straight into rdmasink's buffer pool of send blocks instead.
//!
//! ```sh
//! cargo run --release -p rdmastream-bench --bin gst-bench -- [--seconds 5] [--warmup 1]
//! ```
//!
//! The rdma elements are the plugin built into this binary (`GST_PLUGIN_PATH` does not change
//! them); `GST_BENCH_PLUGIN=/path/libgstrdma.so` runs another build of the plugin instead, to
//! compare two builds under one `gst-bench`. The first line printed says which ran.
//!
//! `GST_BENCH_TRACE=/tmp/trace` writes, for each measured pipeline, every frame's arrival (ns
//! into the window) and latency (ns), one frame per line after a first line that gives the
//! window's start on CLOCK_MONOTONIC, to `/tmp/trace.<receiver's pid>`:
//! to see whether a run's slow frames come in bursts (and when) or are spread out. Beside it,
//! for rdmasink, the sending process writes `/tmp/trace.<receiver's pid>.paths`: every
//! millisecond of the window, rdmasink's `stats` counts of frames upstream wrote into its own send
//! blocks and into the receiver's memory (shm), so `scripts/trace-spells.py` can say which
//! blocks the frames of a slow spell went through.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gst::prelude::*;

const WIDTH: u32 = 640;
const HEIGHT: u32 = 480;
const MAGIC: [u8; 8] = *b"RDSBENCH";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Rdma,
    Tcp,
    Shm,
}

impl Variant {
    fn parse(s: &str) -> Variant {
        match s {
            "rdma" => Variant::Rdma,
            "tcp" => Variant::Tcp,
            "shm" => Variant::Shm,
            other => panic!("unknown variant {other}"),
        }
    }
    fn name(self) -> &'static str {
        match self {
            Variant::Rdma => "rdma",
            Variant::Tcp => "tcp",
            Variant::Shm => "shm",
        }
    }
    fn label(self, transport: &str) -> String {
        match self {
            Variant::Rdma => format!("rdmasink/rdmasrc ({transport})"),
            Variant::Tcp => "gdppay ! tcpserversink / tcpclientsrc ! gdpdepay".into(),
            Variant::Shm => "shmsink/shmsrc".into(),
        }
    }
    /// Which side must be up first (the other connects to it).
    fn sender_is_server(self) -> bool {
        self != Variant::Rdma
    }
}

struct Run {
    variant: Variant,
    live: bool,
    transport: String,
    port: u16,
    socket: String,
    /// rdmasink's allocation query reaches videotestsrc, which then writes each frame into a
    /// buffer of the sink's pool (a send block). Otherwise, and always for the other sinks,
    /// `identity drop-allocation=true` stands before the sink: upstream allocates its own
    /// buffers and the sink copies each frame (shmsink's own allocator, let through, stalls
    /// this pipeline: its 8-frame area never comes free while the probe holds a frame).
    in_place: bool,
    /// rdmasrc's `poll-spin` and `poll-max`, µs.
    poll_spin: u32,
    poll_max: u32,
    /// rdmasrc's `blocks` (0: not set, its default 16).
    blocks: u32,
    /// rdmasrc's `max-buffers` (0: not set, its default 8).
    max_buffers: u32,
    /// rdmasink's `drop-policy` (block or drop-oldest), or `lossless` (block, `lossless=true`).
    drop_policy: String,
    /// `--pin`: the sending process on core 0 and the receiving one on core 1 (`taskset`), as
    /// with sender and receiver on two hosts, where neither takes the other's CPU.
    pin: bool,
}

fn caps() -> String {
    format!("video/x-raw,format=RGB,width={WIDTH},height={HEIGHT},framerate=25/1")
}

impl Run {
    /// Where rdmasrc listens and rdmasink connects: a Unix socket for `--transport shm`.
    fn rdma_host(&self) -> String {
        if self.transport == "shm" {
            format!("unix:{}", self.socket)
        } else {
            "127.0.0.1".into()
        }
    }

    fn send_pipeline(&self) -> String {
        let (port, socket, transport) = (self.port, &self.socket, &self.transport);
        // Unthrottled: not live and nobody syncs to the clock, so frames go as fast as the
        // slowest element allows. Black frames keep the source's own cost small.
        let src = format!(
            "videotestsrc is-live={} pattern=black ! {} ! identity name=stamp drop-allocation={}",
            self.live,
            caps(),
            !(self.in_place && self.variant == Variant::Rdma)
        );
        let sink = match self.variant {
            Variant::Rdma => format!(
                "rdmasink host={} port={port} transport={transport} sync=false {}",
                self.rdma_host(),
                match self.drop_policy.as_str() {
                    "lossless" => "drop-policy=block lossless=true".to_string(),
                    other => format!("drop-policy={other}"),
                }
            ),
            // A bounded client queue that skips to the newest buffer when the client lags,
            // instead of growing without limit.
            Variant::Tcp => format!(
                "gdppay ! tcpserversink host=127.0.0.1 port={port} sync=false \
                 buffers-soft-max=16 recover-policy=latest"
            ),
            Variant::Shm => format!(
                "shmsink socket-path={socket} shm-size={} wait-for-connection=true sync=false",
                8 * WIDTH * HEIGHT * 3
            ),
        };
        format!("{src} ! {sink}")
    }

    fn recv_pipeline(&self) -> String {
        let (port, socket, transport) = (self.port, &self.socket, &self.transport);
        let src = match self.variant {
            Variant::Rdma => format!(
                "rdmasrc address={} port={port} transport={transport} poll-spin={} poll-max={}{}",
                self.rdma_host(),
                self.poll_spin,
                self.poll_max,
                match self.blocks {
                    0 => String::new(),
                    n => format!(" blocks={n}"),
                } + &match self.max_buffers {
                    0 => String::new(),
                    n => format!(" max-buffers={n}"),
                }
            ),
            Variant::Tcp => format!("tcpclientsrc host=127.0.0.1 port={port} ! gdpdepay"),
            // shmsrc carries no caps: they have to be known in advance.
            Variant::Shm => format!("shmsrc socket-path={socket} is-live=true ! {}", caps()),
        };
        format!("{src} ! fakesink name=out sync=false")
    }
}

/// CPU time of this process so far (user + system), from /proc.
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // utime and stime are fields 14 and 15; USER_HZ is 100 on Linux.
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}

/// Names a `libgstrdma.so` for the children to load instead of the plugin built into this
/// binary: to compare two builds of the elements under one `gst-bench`.
const PLUGIN_ENV: &str = "GST_BENCH_PLUGIN";

/// Registers the rdma elements in a child: the plugin file named by [`PLUGIN_ENV`], or the one
/// built in. Exits naming both when the elements that would run come from elsewhere (a plugin
/// of the same name found first on `GST_PLUGIN_PATH`).
fn register_rdma_plugin() {
    let wanted = std::env::var(PLUGIN_ENV).ok();
    match &wanted {
        Some(path) => {
            if let Err(e) = gst::Plugin::load_file(path) {
                eprintln!("gst-bench: cannot load {path} ({PLUGIN_ENV}): {e}");
                std::process::exit(1);
            }
        }
        None => gstrdma::plugin_register_static().unwrap(),
    }
    let used = gst::ElementFactory::find("rdmasink")
        .and_then(|f| f.plugin())
        .and_then(|p| p.filename())
        .map(|f| f.display().to_string());
    let same = match (&wanted, &used) {
        (None, None) => true,
        (Some(w), Some(u)) => std::fs::canonicalize(w).ok() == std::fs::canonicalize(u).ok(),
        _ => false,
    };
    if !same {
        eprintln!(
            "gst-bench: rdmasink would come from {} instead of {}",
            used.as_deref().unwrap_or("the built-in plugin"),
            wanted.as_deref().unwrap_or("the built-in plugin")
        );
        std::process::exit(1);
    }
}

fn now_ns() -> u64 {
    gst::get_timestamp().nseconds()
}

fn sleep_until(t_ns: u64) {
    let now = now_ns();
    if t_ns > now {
        std::thread::sleep(Duration::from_nanos(t_ns - now));
    }
}

#[derive(Default)]
struct Received {
    frames: u64,
    latencies_ns: Vec<u64>,
    arrivals_ns: Vec<u64>,
}

/// One side of a run: plays its pipeline, measures over [start, end], prints one RESULT line.
fn child(args: &[String]) {
    let get = |k: &str| {
        args.windows(2)
            .find(|w| w[0] == k)
            .map(|w| w[1].clone())
            .unwrap_or_else(|| panic!("missing {k}"))
    };
    let role = get("--role");
    let run = Run {
        variant: Variant::parse(&get("--variant")),
        live: get("--live") == "true",
        transport: get("--transport"),
        port: get("--port").parse().unwrap(),
        socket: get("--socket"),
        in_place: get("--in-place") == "true",
        poll_spin: get("--poll-spin").parse().unwrap(),
        poll_max: get("--poll-max").parse().unwrap(),
        blocks: get("--blocks").parse().unwrap(),
        max_buffers: get("--max-buffers").parse().unwrap(),
        drop_policy: get("--drop-policy"),
        // Pinned (or not) by the parent, before this process started.
        pin: false,
    };
    let start: u64 = get("--start").parse().unwrap();
    let end: u64 = get("--end").parse().unwrap();
    gst::init().unwrap();
    register_rdma_plugin();
    let launch = if role == "send" {
        run.send_pipeline()
    } else {
        run.recv_pipeline()
    };
    let pipeline = gst::parse::launch(&launch)
        .unwrap_or_else(|e| panic!("{launch}: {e}"))
        .downcast::<gst::Pipeline>()
        .unwrap();
    let received = Arc::new(Mutex::new(Received::default()));
    if role == "send" {
        let seq = Arc::new(AtomicU64::new(0));
        let pad = pipeline
            .by_name("stamp")
            .unwrap()
            .static_pad("src")
            .unwrap();
        pad.add_probe(gst::PadProbeType::BUFFER, move |_, info| {
            if let Some(gst::PadProbeData::Buffer(buffer)) = &mut info.data {
                let buffer = buffer.make_mut();
                if let Ok(mut map) = buffer.map_writable() {
                    let n = seq.fetch_add(1, Ordering::Relaxed);
                    map[0..8].copy_from_slice(&MAGIC);
                    map[8..16].copy_from_slice(&now_ns().to_le_bytes());
                    map[16..24].copy_from_slice(&n.to_le_bytes());
                }
            }
            gst::PadProbeReturn::Ok
        });
    } else {
        let received = received.clone();
        let pad = pipeline.by_name("out").unwrap().static_pad("sink").unwrap();
        pad.add_probe(gst::PadProbeType::BUFFER, move |_, info| {
            if let Some(gst::PadProbeData::Buffer(buffer)) = &info.data {
                let now = now_ns();
                if (start..end).contains(&now)
                    && let Ok(map) = buffer.map_readable()
                    && map.len() >= 24
                    && map[0..8] == MAGIC
                {
                    let sent = u64::from_le_bytes(map[8..16].try_into().unwrap());
                    let mut r = received.lock().unwrap();
                    r.frames += 1;
                    r.latencies_ns.push(now.saturating_sub(sent));
                    r.arrivals_ns.push(now - start);
                }
            }
            gst::PadProbeReturn::Ok
        });
    }
    let sampler = (role == "send")
        .then(|| args.windows(2).find(|w| w[0] == "--trace-paths"))
        .flatten()
        .map(|w| sample_paths(&pipeline, w[1].clone(), start, end));
    pipeline.set_state(gst::State::Playing).unwrap();
    let bus = pipeline.bus().unwrap();
    let check_bus = || {
        while let Some(msg) = bus.pop_filtered(&[gst::MessageType::Error]) {
            if let gst::MessageView::Error(e) = msg.view() {
                eprintln!("{role} ({launch}): {} ({:?})", e.error(), e.debug());
                std::process::exit(1);
            }
        }
    };
    while now_ns() < start {
        check_bus();
        std::thread::sleep(Duration::from_millis(20));
    }
    let cpu0 = cpu_time();
    sleep_until(end);
    let cpu = cpu_time().saturating_sub(cpu0);
    check_bus();
    if let Some(sampler) = sampler {
        let _ = sampler.join();
    }
    let window = Duration::from_nanos(end - start);
    let mut r = received.lock().unwrap();
    if let Some(path) = trace_prefix()
        && !r.arrivals_ns.is_empty()
    {
        let mut out = format!("# window start {start} ns (CLOCK_MONOTONIC)\n");
        for (a, l) in r.arrivals_ns.iter().zip(&r.latencies_ns) {
            out.push_str(&format!("{a} {l}\n"));
        }
        let _ = std::fs::write(format!("{path}.{}", std::process::id()), out);
    }
    r.latencies_ns.sort_unstable();
    let q = |p: f64| -> u64 {
        if r.latencies_ns.is_empty() {
            0
        } else {
            let i = ((r.latencies_ns.len() - 1) as f64 * p).round() as usize;
            r.latencies_ns[i] / 1000
        }
    };
    println!(
        "RESULT frames={} p50_us={} p99_us={} cpu_pct={:.1}",
        r.frames,
        q(0.5),
        q(0.99),
        100.0 * cpu.as_secs_f64() / window.as_secs_f64()
    );
    // Tearing down may wait for a peer that is already gone; the figures are out.
    std::process::exit(0);
}

/// For `GST_BENCH_TRACE`: samples the rdmasink's `stats` every millisecond of [start, end] and
/// then writes `path`, one line per sample: "ns into the window, frames upstream wrote into a
/// send block, frames it wrote into the receiver's memory, frames copied". Nothing for a
/// pipeline without rdmasink. Reading the property takes the element's state lock, which
/// `render` takes once per frame: a thousand short reads a second.
fn sample_paths(
    pipeline: &gst::Pipeline,
    path: String,
    start: u64,
    end: u64,
) -> std::thread::JoinHandle<()> {
    let sink = pipeline
        .iterate_elements()
        .into_iter()
        .flatten()
        .find(|e| e.factory().is_some_and(|f| f.name() == "rdmasink"));
    std::thread::spawn(move || {
        let Some(sink) = sink else { return };
        let mut out = String::new();
        sleep_until(start);
        let mut next = start;
        while next < end {
            let now = now_ns();
            let stats = sink.property::<gst::Structure>("stats");
            let n = |k: &str| stats.get::<u64>(k).unwrap_or(0);
            let in_receiver = n("frames-in-receiver-memory");
            out.push_str(&format!(
                "{} {} {in_receiver} {}\n",
                now.saturating_sub(start),
                n("frames-in-place").saturating_sub(in_receiver),
                n("frames-copied")
            ));
            next += 1_000_000;
            sleep_until(next);
        }
        let _ = std::fs::write(path, out);
    })
}

fn spawn_role(role: &str, run: &Run, start: u64, end: u64) -> Child {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = if run.pin {
        let mut c = Command::new("taskset");
        let core = if role == "send" { "0" } else { "1" };
        c.args(["-c", core]).arg(&exe);
        c
    } else {
        Command::new(&exe)
    };
    cmd.args([
        "--role",
        role,
        "--variant",
        run.variant.name(),
        "--live",
        if run.live { "true" } else { "false" },
        "--transport",
        &run.transport,
        "--port",
        &run.port.to_string(),
        "--socket",
        &run.socket,
        "--in-place",
        if run.in_place { "true" } else { "false" },
        "--poll-spin",
        &run.poll_spin.to_string(),
        "--poll-max",
        &run.poll_max.to_string(),
        "--blocks",
        &run.blocks.to_string(),
        "--max-buffers",
        &run.max_buffers.to_string(),
        "--drop-policy",
        &run.drop_policy,
        "--start",
        &start.to_string(),
        "--end",
        &end.to_string(),
    ])
    .args(
        trace_paths()
            .filter(|_| role == "send")
            .map(|p| ["--trace-paths".to_string(), p])
            .into_iter()
            .flatten(),
    )
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit())
    .spawn()
    .expect("starting a benchmark process")
}

/// Where the sending process writes its samples of rdmasink's paths under `GST_BENCH_TRACE`,
/// until the run is over and they go beside the receiver's trace (`PREFIX.<receiver's pid>`).
fn trace_paths() -> Option<String> {
    trace_prefix().map(|p| format!("{p}.sending.{}", std::process::id()))
}

/// `GST_BENCH_TRACE`'s prefix; unset or empty means no traces.
fn trace_prefix() -> Option<String> {
    std::env::var("GST_BENCH_TRACE")
        .ok()
        .filter(|p| !p.is_empty())
}

/// The RESULT line of a finished child, as key → value; else what became of the child (its
/// own error went to stderr, which it shares with this process).
fn result(role: &str, child: Child) -> Result<std::collections::HashMap<String, f64>, String> {
    let out = child
        .wait_with_output()
        .map_err(|e| format!("{role}: waiting for it: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("RESULT "))
        .ok_or_else(|| format!("{role}: {}, no result", out.status))?;
    Ok(line
        .split_whitespace()
        .skip(1)
        .filter_map(|kv| kv.split_once('='))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits (bounded) until the server side is reachable, so the client does not fail to connect.
fn wait_ready(run: &Run) {
    for _ in 0..500 {
        let ready = match run.variant {
            Variant::Rdma => true,
            Variant::Tcp => std::net::TcpStream::connect(("127.0.0.1", run.port)).is_ok(),
            Variant::Shm => std::path::Path::new(&run.socket).exists(),
        };
        if ready {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--role") {
        child(&args);
        return;
    }
    let opt = |k: &str, default: &str| {
        args.windows(2)
            .find(|w| w[0] == k)
            .map(|w| w[1].clone())
            .unwrap_or_else(|| default.to_string())
    };
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!(
            "gst-bench [--seconds 5] [--warmup 1] [--transport tcp|verbs|auto|shm] [--only rdma,tcp,shm] [--in-place] [--poll-spin 50] [--poll-max 500] [--blocks 0] [--max-buffers 0] [--drop-policy block|drop-oldest|lossless] [--pin]\n\
             Compares rdmasink/rdmasrc, tcpserversink/tcpclientsrc (gdp) and shmsink/shmsrc \
             for 640x480 RGB at 25 fps and unthrottled. --in-place: videotestsrc writes into \
             rdmasink's pool of send blocks (otherwise every sink copies each frame). --poll-spin, \
             --poll-max: rdmasrc's poll-spin and poll-max (µs). --blocks: rdmasrc's blocks \
             (0: its default, 16). --max-buffers: rdmasrc's max-buffers (0: its default, 8). \
             --drop-policy: rdmasink's (block or drop-oldest; lossless: block with \
             lossless=true). --pin: the sending process \
             on core 0, the receiving one on core 1 (taskset), as on two hosts."
        );
        return;
    }
    let seconds: f64 = opt("--seconds", "5").parse().expect("--seconds");
    let warmup: f64 = opt("--warmup", "1").parse().expect("--warmup");
    let transport = opt("--transport", "tcp");
    let only = opt("--only", "rdma,tcp,shm");
    let in_place = args.iter().any(|a| a == "--in-place");
    let poll_spin: u32 = opt("--poll-spin", "50").parse().expect("--poll-spin");
    let poll_max: u32 = opt("--poll-max", "500").parse().expect("--poll-max");
    let blocks: u32 = opt("--blocks", "0").parse().expect("--blocks");
    let max_buffers: u32 = opt("--max-buffers", "0").parse().expect("--max-buffers");
    let drop_policy = opt("--drop-policy", "block");
    let pin = args.iter().any(|a| a == "--pin");
    if pin && std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        panic!("--pin needs two cores");
    }
    assert!(
        ["block", "drop-oldest", "lossless"].contains(&drop_policy.as_str()),
        "--drop-policy is block, drop-oldest or lossless, not {drop_policy}"
    );
    gst::init().unwrap();
    let dir = std::env::temp_dir().join(format!("gst-bench-{}", std::process::id()));
    match std::env::var(PLUGIN_ENV) {
        Ok(path) => println!("rdmasink/rdmasrc: the plugin {path} ({PLUGIN_ENV})"),
        Err(_) => println!(
            "rdmasink/rdmasrc: the plugin built into this gst-bench (GST_PLUGIN_PATH does not \
             change it; {PLUGIN_ENV}=/path/libgstrdma.so runs another build)"
        ),
    }
    std::fs::create_dir_all(&dir).unwrap();
    println!(
        "640x480 RGB (921600-byte frames); sender and receiver in separate processes on this \
         machine; {seconds} s measured per run after {warmup} s warm-up"
    );
    println!(
        "latency: sender's sink input -> receiver's sink input; CPU: % of one core per process\n"
    );
    println!("| elements | rate | fps | latency p50 | latency p99 | CPU sender | CPU receiver |");
    println!("|---|---|---|---|---|---|---|");
    let mut unthrottled_fps = Vec::new();
    for live in [true, false] {
        for variant in [Variant::Rdma, Variant::Tcp, Variant::Shm] {
            if !only.split(',').any(|v| v == variant.name()) {
                continue;
            }
            let run = Run {
                variant,
                live,
                transport: transport.clone(),
                port: free_port(),
                in_place,
                poll_spin,
                poll_max,
                blocks,
                max_buffers,
                drop_policy: drop_policy.clone(),
                pin,
                socket: dir
                    .join(format!("shm-{}-{live}", variant.name()))
                    .display()
                    .to_string(),
            };
            let _ = std::fs::remove_file(&run.socket);
            let start = now_ns() + Duration::from_secs_f64(2.0 + warmup).as_nanos() as u64;
            let end = start + Duration::from_secs_f64(seconds).as_nanos() as u64;
            let (server, client) = if variant.sender_is_server() {
                ("send", "recv")
            } else {
                ("recv", "send")
            };
            let first = spawn_role(server, &run, start, end);
            wait_ready(&run);
            let second = spawn_role(client, &run, start, end);
            let recv_pid = if server == "send" {
                second.id()
            } else {
                first.id()
            };
            let (send, recv) = if server == "send" {
                (result("sender", first), result("receiver", second))
            } else {
                let recv = result("receiver", first);
                (result("sender", second), recv)
            };
            if let (Some(from), Some(prefix)) = (trace_paths(), trace_prefix()) {
                let _ = std::fs::rename(from, format!("{prefix}.{recv_pid}.paths"));
            }
            let rate = if live { "25 fps" } else { "unthrottled" };
            let (send, recv) = match (send, recv) {
                (Ok(send), Ok(recv)) => (send, recv),
                (send, recv) => {
                    let why: Vec<String> = [send.err(), recv.err()].into_iter().flatten().collect();
                    println!(
                        "| {} | {rate} | failed ({}) | | | | |",
                        variant.label(&transport),
                        why.join("; ")
                    );
                    continue;
                }
            };
            let fps = recv["frames"] / seconds;
            if !live {
                unthrottled_fps.push((variant, fps));
            }
            println!(
                "| {} | {rate} | {fps:.1} | {:.2} ms | {:.2} ms | {:.0} % | {:.0} % |",
                variant.label(&transport),
                recv["p50_us"] / 1000.0,
                recv["p99_us"] / 1000.0,
                send["cpu_pct"],
                recv["cpu_pct"],
            );
        }
    }
    let fps_of = |v| {
        unthrottled_fps
            .iter()
            .find(|(x, _)| *x == v)
            .map(|(_, f)| *f)
    };
    if let (Some(r), Some(t)) = (fps_of(Variant::Rdma), fps_of(Variant::Tcp)) {
        println!(
            "\nunthrottled throughput rdmasink/rdmasrc ÷ tcpserversink/tcpclientsrc: {:.2}",
            r / t
        );
    }
    if let (Some(r), Some(s)) = (fps_of(Variant::Rdma), fps_of(Variant::Shm)) {
        println!(
            "unthrottled throughput rdmasink/rdmasrc ÷ shmsink/shmsrc: {:.2}",
            r / s
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
