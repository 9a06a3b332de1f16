//! `bench paper`: the evaluation of the status-byte paper (section 4, Figures 10–19), every
//! experiment run for each mechanism in the same run, over `tcp` on this host or over `verbs`
//! (Soft-RoCE in the VM, `scripts/paper.sh`). Writes one CSV per figure and `summary.csv`
//! (our ratio beside the paper's) into `--out`; `bench plot DIR` draws the PNGs from them.
//!
//! The experiments drive each mechanism at the level the paper measures it — blocks and
//! synchronisation on one link, no filling thread, header or seal — so a figure compares
//! mechanisms, not the rest of the engine (which both share).

pub mod link;
pub mod plot;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rdmastream::proto::handshake::{
    DataPath, Hello, Mechanism as WireMechanism, PROTOCOL_VERSION, QpInfo,
};
use rdmastream::transport::tcp::{self, TcpConnector};
use rdmastream::transport::{Connector, Listener, RegionSettings};
use rdmastream_verbs::{self as verbs, VerbsConnector, VerbsSettings};

use link::{Hold, Link, SEND_BLOCKS, SlidingWindowLink, StatusByteLink};

/// Where the links run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Net {
    Tcp,
    Verbs,
}

impl Net {
    fn name(self) -> &'static str {
        match self {
            Net::Tcp => "tcp",
            Net::Verbs => "verbs",
        }
    }
}

/// The mechanisms compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mechanism {
    StatusByte,
    SlidingWindow,
}

impl Mechanism {
    pub const ALL: [Mechanism; 2] = [Mechanism::StatusByte, Mechanism::SlidingWindow];

    pub fn name(self) -> &'static str {
        match self {
            Mechanism::StatusByte => "status-byte",
            Mechanism::SlidingWindow => "sliding-window",
        }
    }

    /// True when each device needs its own connection (the sliding window's one QP per device).
    fn link_per_device(self) -> bool {
        match self {
            Mechanism::StatusByte => false,
            Mechanism::SlidingWindow => true,
        }
    }
}

/// The Soft-RoCE VM's address for rxe0 (scripts/vm.sh).
const VM_HOST: &str = "192.0.2.1";

/// How big a run is.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    pub sync_iters: usize,
    pub latency_iters: usize,
    pub reps: usize,
    /// Bytes one throughput repetition moves at most (fewer than 1000 transmissions for the
    /// largest packets).
    pub rep_bytes: usize,
    pub max_transmissions: usize,
    pub camera_seconds: f64,
    /// Measure the ceilings (perftest over verbs, plain TCP over tcp) too.
    pub ceilings: bool,
}

impl Scale {
    pub const FULL: Scale = Scale {
        sync_iters: 1000,
        latency_iters: 200,
        reps: 10,
        rep_bytes: 256 << 20,
        max_transmissions: 1000,
        camera_seconds: 2.0,
        ceilings: true,
    };
    /// Soft-RoCE in the VM moves tens of MB/s (rxe under TCG emulation): the same experiments
    /// with fewer bytes, or the large sizes would take most of an hour.
    pub const FULL_VERBS: Scale = Scale {
        rep_bytes: 16 << 20,
        latency_iters: 100,
        ..Scale::FULL
    };
    pub const QUICK: Scale = Scale {
        sync_iters: 50,
        latency_iters: 10,
        reps: 2,
        rep_bytes: 8 << 20,
        max_transmissions: 50,
        camera_seconds: 0.3,
        ceilings: false,
    };
}

/// Connects `mechanism` over `net` with a receiver of `blocks` blocks of `block_size` bytes.
pub fn connect(net: Net, mechanism: Mechanism, blocks: usize, block_size: usize) -> Box<dyn Link> {
    connect_with(net, mechanism, blocks, block_size, SEND_BLOCKS)
}

/// [`connect`], with at most `outstanding` blocks in flight at once (the sender's window).
pub fn connect_with(
    net: Net,
    mechanism: Mechanism,
    blocks: usize,
    block_size: usize,
    outstanding: usize,
) -> Box<dyn Link> {
    let wire = match mechanism {
        Mechanism::StatusByte => WireMechanism::StatusByte,
        Mechanism::SlidingWindow => WireMechanism::SlidingWindow { device: 0 },
    };
    let region = RegionSettings {
        mechanism: wire,
        ..RegionSettings::plain(blocks, block_size)
    };
    let (listener, connector, data_path): (Box<dyn Listener>, Box<dyn Connector>, _) = match net {
        Net::Tcp => {
            let l = tcp::listen("127.0.0.1:0", region).expect("tcp listener");
            let addr = l.local_addr();
            (
                Box::new(l),
                Box::new(TcpConnector::new(addr)),
                DataPath::Tcp,
            )
        }
        Net::Verbs => {
            let settings = VerbsSettings {
                device: None,
                port: 1,
                gid_index: None,
            };
            let l = verbs::listen(&format!("{VM_HOST}:0"), region, settings.clone())
                .expect("verbs listener (run inside the Soft-RoCE VM: scripts/paper.sh)");
            let addr = l.local_addr();
            let c = VerbsConnector::new(addr, settings, SEND_BLOCKS).expect("verbs connector");
            (Box::new(l), Box::new(c), DataPath::Verbs)
        }
    };
    let hello = Hello {
        version: PROTOCOL_VERSION,
        sender: "paper".into(),
        nonce: [0; 32],
        session: 1,
        block_size: 0,
        data_path,
        qp: QpInfo::default(),
        mechanism: wire,
    };
    match mechanism {
        Mechanism::StatusByte => Box::new(StatusByteLink::connect(
            listener,
            connector.as_ref(),
            &hello,
            block_size,
            outstanding,
        )),
        Mechanism::SlidingWindow => Box::new(SlidingWindowLink::connect(
            listener,
            connector.as_ref(),
            &hello,
            block_size,
            outstanding,
        )),
    }
}

/// A CSV file being written.
struct Csv {
    path: PathBuf,
    out: std::io::BufWriter<std::fs::File>,
}

impl Csv {
    fn create(dir: &Path, name: &str, header: &str) -> Csv {
        let path = dir.join(name);
        let f = std::fs::File::create(&path)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        let mut out = std::io::BufWriter::new(f);
        writeln!(out, "{header}").unwrap();
        Csv { path, out }
    }

    fn row(&mut self, fields: &[String]) {
        writeln!(self.out, "{}", fields.join(",")).unwrap();
    }
}

impl Drop for Csv {
    fn drop(&mut self) {
        if let Err(e) = self.out.flush() {
            eprintln!("bench paper: writing {}: {e}", self.path.display());
        }
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
    (quantile(&v, 0.5), mean, quantile(&v, 0.99))
}

fn mean_cv(v: &[f64]) -> (f64, f64) {
    let n = v.len().max(1) as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    (mean, if mean > 0.0 { var.sqrt() / mean } else { 0.0 })
}

fn f(x: f64) -> String {
    format!("{x:.3}")
}

/// CPU time of this process's threads so far, in ns, by thread name (schedstat: nanosecond
/// resolution, where /proc's stat ticks are 10 ms).
fn thread_ticks() -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for t in tasks.flatten() {
        let (Ok(name), Ok(stat)) = (
            std::fs::read_to_string(t.path().join("comm")),
            std::fs::read_to_string(t.path().join("schedstat")),
        ) else {
            continue;
        };
        let ns = stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        *out.entry(name.trim().to_string()).or_insert(0) += ns;
    }
    out
}

/// Whether a thread works for the sender (the experiment's own thread, the transport's
/// completion reader, an ACK receiving thread) rather than the receiver.
fn is_sender_thread(name: &str) -> bool {
    name.starts_with("paper-sender") || name.starts_with("tcp-completion") || name.contains("ack")
}

/// CPU % of one core used by sender and receiver threads between two samples.
fn cpu_between(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
    secs: f64,
) -> (f64, f64) {
    let tick = 1e9;
    let (mut s, mut r) = (0u64, 0u64);
    for (name, t) in after {
        let d = t.saturating_sub(before.get(name).copied().unwrap_or(0));
        if is_sender_thread(name) {
            s += d;
        } else {
            r += d;
        }
    }
    (
        s as f64 / tick / secs * 100.0,
        r as f64 / tick / secs * 100.0,
    )
}

const SYNC_BLOCKS: [usize; 6] = [3, 4, 8, 16, 32, 64];
const SMALL: [usize; 7] = [64, 128, 256, 512, 1024, 2048, 4096];
const LARGE_LATENCY: [usize; 11] = [
    8 << 10,
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
    8 << 20,
];
const LARGE_THROUGHPUT: [usize; 10] = [
    8 << 10,
    32 << 10,
    128 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
    8 << 20,
    16 << 20,
    22 << 20,
];

/// What one run measured, for the summary.
#[derive(Default)]
struct Findings {
    /// (figure, metric, mechanism) → value.
    values: BTreeMap<(String, String, String), f64>,
}

impl Findings {
    fn put(&mut self, fig: &str, metric: &str, m: Mechanism, v: f64) {
        self.values
            .insert((fig.into(), metric.into(), m.name().into()), v);
    }
    /// Takes the values of an earlier run's summary.csv for every metric this run did not
    /// measure.
    fn keep_earlier(&mut self, path: &Path) {
        let Ok(text) = std::fs::read_to_string(path) else {
            return;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split(',').collect();
            if f.len() < 8 {
                continue;
            }
            for (col, m) in [(5, "status-byte"), (6, "sliding-window")] {
                let key = (f[0].to_string(), f[1].to_string(), m.to_string());
                if let (false, Ok(v)) = (self.values.contains_key(&key), f[col].parse::<f64>()) {
                    self.values.insert(key, v);
                }
            }
        }
    }

    fn get(&self, fig: &str, metric: &str, m: &str) -> Option<f64> {
        self.values
            .get(&(fig.into(), metric.into(), m.into()))
            .copied()
    }
}

/// Runs every experiment; writes the CSVs and the summary into `out`.
/// `only`: the figures to run (by number, e.g. "18"); empty runs them all.
pub fn run(net: Net, scale: Scale, out: &Path, mechanisms: &[Mechanism], only: &[String]) {
    let only = only.to_vec();
    let partial = !only.is_empty();
    let wants =
        move |figs: &[&str]| only.is_empty() || figs.iter().any(|f| only.iter().any(|o| o == f));
    std::fs::create_dir_all(out).unwrap_or_else(|e| panic!("cannot create {}: {e}", out.display()));
    let out = out.to_path_buf();
    let mechanisms = mechanisms.to_vec();
    // The experiments run on a thread of their own name, so its CPU counts as the sender's.
    std::thread::Builder::new()
        .name("paper-sender".into())
        .spawn(move || {
            let mut found = Findings::default();
            println!(
                "== bench paper over {} ({} ; mechanisms: {})",
                net.name(),
                out.display(),
                mechanisms
                    .iter()
                    .map(|m| m.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            if scale.ceilings && wants(&["10", "12", "13", "14"]) {
                ceilings(net, &out);
            }
            if wants(&["10", "11"]) {
                sync_latency(net, scale, &out, &mechanisms, &mut found);
            }
            if wants(&["12"]) {
                transmission_latency(net, scale, &out, &mechanisms, &mut found);
            }
            if wants(&["13", "14", "15"]) {
                throughput(net, scale, &out, &mechanisms, &mut found);
            }
            if wants(&["16", "17"]) {
                resources(net, scale, &out, &mechanisms, &mut found);
            }
            if wants(&["18"]) {
                held_block(net, &out, &mechanisms, &mut found);
            }
            if wants(&["19"]) {
                cameras(net, scale, &out, &mechanisms, &mut found);
            }
            // A partial run (--only) replaces its figures' rows of an existing summary.csv.
            if partial {
                found.keep_earlier(&out.join("summary.csv"));
            }
            summary(net, &out, &found, true);
        })
        .unwrap()
        .join()
        .expect("bench paper failed");
}

/// The hardware (verbs: perftest on the same device) or software (tcp: plain TCP loopback)
/// ceiling for figures 10, 12 and 13/14, into ceilings.csv: a latency or rate no mechanism
/// on the same path can beat.
fn ceilings(net: Net, out: &Path) {
    println!(
        "-- ceilings on the same path, same run ({})",
        match net {
            Net::Verbs => "perftest: ib_read_lat, ib_send_lat, ib_write_bw",
            Net::Tcp => "plain TCP loopback: request/response round trip and a stream",
        }
    );
    let mut csv = Csv::create(out, "ceilings.csv", "mechanism,figure,size,value");
    let mut put = |label: &str, fig: &str, size: usize, v: Option<f64>| {
        let show = v.map_or("n/a".to_string(), |v| format!("{v:.2}"));
        println!("{label:>22} fig {fig:>2} {:>9} {show}", crate::human(size));
        if let Some(v) = v {
            csv.row(&[label.into(), fig.into(), size.to_string(), f(v)]);
        }
    };
    let typical = |c: Option<Vec<f64>>| {
        c.and_then(|c| c.get(4).copied())
            .filter(|t| t.is_finite() && *t > 0.0)
    };
    for n in SYNC_BLOCKS {
        match net {
            Net::Verbs => put(
                "ib_read_lat",
                "10",
                n,
                typical(crate::perftest(
                    "ib_read_lat",
                    &["-s".into(), n.to_string(), "-n".into(), "1000".into()],
                )),
            ),
            Net::Tcp => put("tcp round trip", "10", n, Some(tcp_round_trip(n, 1000))),
        }
    }
    for size in SMALL.into_iter().chain(LARGE_LATENCY) {
        let iters = if size >= 1 << 20 { 100 } else { 1000 };
        match net {
            Net::Verbs => put(
                "ib_send_lat",
                "12",
                size,
                typical(crate::perftest(
                    "ib_send_lat",
                    &[
                        "-s".into(),
                        size.to_string(),
                        "-n".into(),
                        iters.to_string(),
                    ],
                )),
            ),
            Net::Tcp => put(
                "tcp round trip",
                "12",
                size,
                Some(tcp_round_trip(size, iters)),
            ),
        }
    }
    for size in SMALL.into_iter().chain(LARGE_THROUGHPUT) {
        match net {
            Net::Verbs => {
                let iters = ((64usize << 20) / size).clamp(20, 20000);
                let bw = crate::perftest(
                    "ib_write_bw",
                    &[
                        "-s".into(),
                        size.to_string(),
                        "-n".into(),
                        iters.to_string(),
                    ],
                )
                .and_then(|c| c.get(3).copied())
                .map(|mib| mib * 1.048576); // perftest's MB is MiB
                put("ib_write_bw", "13", size, bw);
            }
            Net::Tcp => put(
                "tcp stream",
                "13",
                size,
                Some(crate::plain_tcp_rate(size, 0.5) / 1e6),
            ),
        }
    }
}

/// Median round trip of `n` bytes over a plain TCP loopback connection (sent, echoed), in µs.
fn tcp_round_trip(n: usize, iters: usize) -> f64 {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let echo = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let mut buf = vec![0u8; n];
        while s.read_exact(&mut buf).is_ok() {
            if s.write_all(&buf).is_err() {
                break;
            }
        }
    });
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let mut buf = vec![7u8; n];
    let mut samples = Vec::with_capacity(iters);
    for i in 0..iters + 20 {
        let t = Instant::now();
        s.write_all(&buf).unwrap();
        s.read_exact(&mut buf).unwrap();
        if i >= 20 {
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    drop(s);
    let _ = echo.join();
    stats(samples).0
}

/// Figures 10 and 11: synchronisation latency against the number of memory blocks, and its
/// spread over the transmissions at 3 blocks.
fn sync_latency(net: Net, scale: Scale, out: &Path, ms: &[Mechanism], found: &mut Findings) {
    println!("-- Fig. 10/11: synchronisation control latency vs memory blocks (µs)");
    let mut fig10 = Csv::create(out, "fig10.csv", "mechanism,blocks,p50_us,mean_us,p99_us");
    let mut fig11 = Csv::create(out, "fig11.csv", "mechanism,transmission,latency_us");
    for &m in ms {
        for n in SYNC_BLOCKS {
            let mut link = connect(net, m, n, 4096);
            for _ in 0..20 {
                link.sync_once();
            }
            let samples: Vec<f64> = (0..scale.sync_iters).map(|_| link.sync_once()).collect();
            if n == 3 {
                for (k, s) in samples.iter().enumerate() {
                    fig11.row(&[m.name().into(), k.to_string(), f(*s)]);
                }
            }
            let (p50, mean, p99) = stats(samples);
            println!(
                "{:>15} N={n:<3} p50 {p50:>8.1}  mean {mean:>8.1}  p99 {p99:>8.1}",
                m.name()
            );
            fig10.row(&[m.name().into(), n.to_string(), f(p50), f(mean), f(p99)]);
            if n == 3 {
                found.put("10", "sync p50 µs at 3 blocks", m, p50);
            }
        }
    }
}

/// Figure 12: one block's transmission latency (post to the sender's completion) by size.
fn transmission_latency(
    net: Net,
    scale: Scale,
    out: &Path,
    ms: &[Mechanism],
    found: &mut Findings,
) {
    println!("-- Fig. 12: transmission latency vs packet size (µs)");
    let mut fig12 = Csv::create(out, "fig12.csv", "mechanism,size,p50_us,mean_us,p99_us");
    for &m in ms {
        for size in SMALL.into_iter().chain(LARGE_LATENCY) {
            let mut link = connect(net, m, SEND_BLOCKS, size);
            let iters = if size >= 1 << 20 {
                scale
                    .latency_iters
                    .min(if net == Net::Verbs { 20 } else { 50 })
            } else {
                scale.latency_iters
            };
            for _ in 0..5 {
                link.transmit_once(size);
            }
            let (p50, mean, p99) = stats((0..iters).map(|_| link.transmit_once(size)).collect());
            println!(
                "{:>15} {:>9} p50 {p50:>10.1}  mean {mean:>10.1}",
                m.name(),
                crate::human(size)
            );
            fig12.row(&[m.name().into(), size.to_string(), f(p50), f(mean), f(p99)]);
            if size == 256 {
                found.put("12", "latency p50 µs at 256 B", m, p50);
            }
            if size == 1 << 20 {
                found.put("12", "latency p50 µs at 1 MiB", m, p50);
            }
        }
    }
}

/// Figures 13–17: throughput of consecutive transmissions by size (repeated), the sender's CPU
/// during them, and the work requests and queue depths each side used.
fn throughput(net: Net, scale: Scale, out: &Path, ms: &[Mechanism], found: &mut Findings) {
    println!(
        "-- Fig. 13/14/15: throughput (MB/s) and sender CPU (% of a core) vs packet size, {SEND_BLOCKS} blocks in flight at most"
    );
    let mut fig13 = Csv::create(
        out,
        "fig13.csv",
        "mechanism,size,rep,transmissions,seconds,mb_per_s",
    );
    let mut fig15 = Csv::create(
        out,
        "fig15.csv",
        "mechanism,size,sender_cpu_percent,receiver_cpu_percent",
    );
    for &m in ms {
        let mut cpu_all = Vec::new();
        for size in SMALL.into_iter().chain(LARGE_THROUGHPUT) {
            let count = (scale.rep_bytes / size).clamp(5, scale.max_transmissions) as u64;
            let mut link = connect(net, m, SEND_BLOCKS, size);
            link.stream(size, &|_| u64::MAX, Duration::from_secs(5), count.min(20));
            let (mut rates, mut secs) = (Vec::new(), 0.0);
            let before = thread_ticks();
            for rep in 0..scale.reps {
                let (done, s) = link.stream(size, &|_| u64::MAX, Duration::from_secs(60), count);
                let rate = done as f64 * size as f64 / s / 1e6;
                fig13.row(&[
                    m.name().into(),
                    size.to_string(),
                    rep.to_string(),
                    done.to_string(),
                    f(s),
                    f(rate),
                ]);
                rates.push(rate);
                secs += s;
            }
            let (sender_cpu, receiver_cpu) = cpu_between(&before, &thread_ticks(), secs);
            cpu_all.push(sender_cpu);
            fig15.row(&[
                m.name().into(),
                size.to_string(),
                f(sender_cpu),
                f(receiver_cpu),
            ]);
            let (mean, cv) = mean_cv(&rates);
            println!(
                "{:>15} {:>9} {mean:>10.1} MB/s ±{:>4.1}%  sender CPU {sender_cpu:>5.1}%",
                m.name(),
                crate::human(size),
                cv * 100.0
            );
            if size == 256 {
                found.put("13", "MB/s at 256 B", m, mean);
            }
            if size == 1 << 20 {
                found.put("13", "MB/s at 1 MiB", m, mean);
            }
        }
        found.put(
            "15",
            "mean sender CPU %",
            m,
            cpu_all.iter().sum::<f64>() / cpu_all.len().max(1) as f64,
        );
    }
}

/// Figures 16 and 17: the least each side's RNIC needs: each mechanism run with one block in
/// flight at a time (the paper's serialised sender) over a ring of 3 blocks of 4 KiB; the work
/// requests, completions and queue depths its transports counted.
fn resources(net: Net, scale: Scale, out: &Path, ms: &[Mechanism], found: &mut Findings) {
    println!(
        "-- Fig. 16/17: RNIC resources used, one block in flight, a ring of 3 blocks of 4 KiB"
    );
    let mut fig16 = Csv::create(
        out,
        "fig16.csv",
        "mechanism,side,send_wrs,recv_wrs,completions,sq_depth,rq_depth,cqs,transmissions",
    );
    const SIZE: usize = 4096;
    let n = scale.max_transmissions as u64;
    for &m in ms {
        // A ring of 3 (the paper's smallest, and the window's three pre-posted receives).
        let mut link = connect_with(net, m, 3, SIZE, 1);
        let (done, _) = link.stream(SIZE, &|_| u64::MAX, Duration::from_secs(60), n);
        let (sender, receiver) = link.counts();
        for (side, c) in [("sender", sender), ("receiver", receiver)] {
            fig16.row(&[
                m.name().into(),
                side.into(),
                c.send_wrs.to_string(),
                c.recv_wrs.to_string(),
                c.completions.to_string(),
                c.sq_depth.to_string(),
                c.rq_depth.to_string(),
                c.cqs.to_string(),
                done.to_string(),
            ]);
            let per = |x: u64| x as f64 / done.max(1) as f64;
            println!(
                "{:>15} {side:>8}: {:.2} send WRs, {:.2} receive WRs, {:.2} completions per block; send queue {} deep, receive queue {}, {} completion queue(s)",
                m.name(),
                per(c.send_wrs),
                per(c.recv_wrs),
                per(c.completions),
                c.sq_depth,
                c.rq_depth,
                c.cqs
            );
            let key = if side == "sender" { "16" } else { "17" };
            found.put(
                key,
                "work requests per block",
                m,
                per(c.send_wrs + c.recv_wrs),
            );
            found.put(key, "completions per block", m, per(c.completions));
            found.put(key, "send queue depth", m, c.sq_depth as f64);
            found.put(key, "receive queue depth", m, c.rq_depth as f64);
            found.put(key, "completion queues", m, c.cqs as f64);
        }
    }
}

/// Throughput in `bin`s from `start` for `dur`, in MB/s.
fn binned(arrivals: &[(Instant, u32)], start: Instant, dur: Duration, bin: Duration) -> Vec<f64> {
    let n = (dur.as_secs_f64() / bin.as_secs_f64()).ceil() as usize;
    let mut bytes = vec![0u64; n];
    for (t, len) in arrivals {
        if let Some(k) = t.checked_duration_since(start)
            && let Some(b) = bytes.get_mut((k.as_secs_f64() / bin.as_secs_f64()) as usize)
        {
            *b += *len as u64;
        }
    }
    bytes
        .into_iter()
        .map(|b| b as f64 / bin.as_secs_f64() / 1e6)
        .collect()
}

/// Figure 18: throughput in 1 ms bins while the receiver keeps a block from 100 ms to 200 ms.
fn held_block(net: Net, out: &Path, ms: &[Mechanism], found: &mut Findings) {
    println!("-- Fig. 18: throughput while the receiver keeps a block (100–200 ms), 64 KiB blocks");
    let mut fig18 = Csv::create(out, "fig18.csv", "mechanism,ms,mb_per_s");
    const SIZE: usize = 64 << 10;
    let dur = Duration::from_millis(300);
    for &m in ms {
        let mut link = connect(net, m, SEND_BLOCKS, SIZE);
        link.stream(SIZE, &|_| u64::MAX, Duration::from_secs(5), 50);
        let start = Instant::now() + Duration::from_millis(1);
        link.hold(Hold {
            from: start + Duration::from_millis(100),
            until: start + Duration::from_millis(200),
        });
        link.record();
        while Instant::now() < start {}
        link.stream(SIZE, &|_| u64::MAX, dur, u64::MAX);
        let bins = binned(&link.arrivals(), start, dur, Duration::from_millis(1));
        for (k, v) in bins.iter().enumerate() {
            fig18.row(&[m.name().into(), k.to_string(), f(*v)]);
        }
        let mean = |r: std::ops::Range<usize>| {
            let s = &bins[r.clone()];
            s.iter().sum::<f64>() / s.len() as f64
        };
        let (before, during, after) = (mean(0..100), mean(100..200), mean(200..300));
        let dip = if before > 0.0 {
            (1.0 - during / before) * 100.0
        } else {
            f64::NAN
        };
        println!(
            "{:>15} before {before:>8.1}  held {during:>8.1}  after {after:>8.1} MB/s  (dip {dip:.0}%)",
            m.name()
        );
        found.put("18", "throughput dip % while held", m, dip);
    }
}

/// Figure 19: 12 cameras of 640×480×3 bytes, paced at 25 fps and unpaced: total throughput in
/// 1 ms bins (as Figure 18; a 10 ms bin holds exactly three paced frames and hides the
/// burstiness), with its mean and coefficient of variation.
fn cameras(net: Net, scale: Scale, out: &Path, ms: &[Mechanism], found: &mut Findings) {
    println!("-- Fig. 19: 12 cameras of 640×480×3 (1 ms bins over tcp, 100 ms over verbs)");
    const CAMERAS: usize = 12;
    const FRAME: usize = 640 * 480 * 3;
    let mut fig19 = Csv::create(out, "fig19.csv", "mechanism,mode,ms,mb_per_s");
    let dur = Duration::from_secs_f64(scale.camera_seconds);
    // About as many frames per bin as the paper's 1 ms bins hold at 7000 MB/s: Soft-RoCE moves
    // a frame in about 14 ms, so its bins are 100 ms (1 ms bins there are 0 or one frame).
    let bin = match net {
        Net::Tcp => Duration::from_millis(1),
        Net::Verbs => Duration::from_millis(100),
    };
    for &m in ms {
        for paced in [true, false] {
            let mode = if paced { "25fps" } else { "unpaced" };
            // Cameras are not in step: camera c's frames come at c × 40 ms / 12 + k × 40 ms.
            let period = Duration::from_millis(40);
            let due_one = move |c: usize, t: Duration| -> u64 {
                if !paced {
                    return u64::MAX / CAMERAS as u64;
                }
                let offset = period.mul_f64(c as f64 / CAMERAS as f64);
                t.checked_sub(offset)
                    .map_or(0, |t| (t.as_secs_f64() / period.as_secs_f64()) as u64 + 1)
            };
            let mut links: Vec<Box<dyn Link>> = if m.link_per_device() {
                (0..CAMERAS)
                    .map(|_| connect(net, m, SEND_BLOCKS, FRAME))
                    .collect()
            } else {
                vec![connect(net, m, SEND_BLOCKS, FRAME)]
            };
            for l in &mut links {
                // Up to 12 links at once: receivers that yield forever would take every core.
                l.relax();
                l.record();
            }
            let start = Instant::now();
            let per_device = links.len() > 1;
            std::thread::scope(|s| {
                for (c, l) in links.iter_mut().enumerate() {
                    let due = move |t: Duration| -> u64 {
                        if per_device {
                            due_one(c, t)
                        } else {
                            (0..CAMERAS).map(|c| due_one(c, t)).sum()
                        }
                    };
                    std::thread::Builder::new()
                        .name(format!("paper-sender-{c}"))
                        .spawn_scoped(s, move || {
                            l.stream(FRAME, &due, dur, u64::MAX);
                        })
                        .unwrap();
                }
            });
            let mut arrivals = Vec::new();
            for l in &mut links {
                arrivals.extend(l.arrivals());
            }
            let bins = binned(&arrivals, start, dur, bin);
            for (k, v) in bins.iter().enumerate() {
                fig19.row(&[
                    m.name().into(),
                    mode.into(),
                    (k as u128 * bin.as_millis()).to_string(),
                    f(*v),
                ]);
            }
            let (mean, cv) = mean_cv(&bins);
            println!(
                "{:>15} {mode:>8}: mean {mean:>8.1} MB/s, coefficient of variation {cv:.2}",
                m.name()
            );
            found.put("19", &format!("{mode} mean MB/s"), m, mean);
            found.put("19", &format!("{mode} CV"), m, cv);
        }
    }
}

/// The paper's figures for each compared metric: (figure, metric, status byte, sliding window,
/// which way is better). None where the paper gives no number.
/// (figure, metric, the paper's status byte, the paper's sliding window, which way is better).
type PaperRow = (&'static str, &'static str, Option<f64>, Option<f64>, Better);

const PAPER: &[PaperRow] = &[
    (
        "10",
        "sync p50 µs at 3 blocks",
        Some(5.1),
        Some(70.0),
        Better::Lower,
    ),
    ("12", "latency p50 µs at 256 B", None, None, Better::Lower),
    ("12", "latency p50 µs at 1 MiB", None, None, Better::Lower),
    ("13", "MB/s at 256 B", None, None, Better::Higher),
    ("13", "MB/s at 1 MiB", None, None, Better::Higher),
    ("15", "mean sender CPU %", None, None, Better::Lower),
    // Section 4.5: the status-byte sender needs a send queue of 2 and one completion queue
    // of 1; the window's sender pre-posts 3 receives and runs two completion queues; its
    // receiver needs 3 receives; the status-byte receiver posts nothing.
    ("16", "work requests per block", None, None, Better::Lower),
    (
        "16",
        "completions per block",
        Some(1.0),
        None,
        Better::Lower,
    ),
    ("16", "send queue depth", Some(2.0), None, Better::Lower),
    (
        "16",
        "receive queue depth",
        Some(0.0),
        Some(3.0),
        Better::Lower,
    ),
    (
        "16",
        "completion queues",
        Some(1.0),
        Some(2.0),
        Better::Lower,
    ),
    (
        "17",
        "work requests per block",
        Some(0.0),
        None,
        Better::Lower,
    ),
    (
        "17",
        "completions per block",
        Some(0.0),
        None,
        Better::Lower,
    ),
    (
        "17",
        "receive queue depth",
        Some(0.0),
        Some(3.0),
        Better::Lower,
    ),
    (
        "18",
        "throughput dip % while held",
        Some(12.0),
        Some(100.0),
        Better::Lower,
    ),
    ("19", "25fps mean MB/s", None, None, Better::Higher),
    ("19", "25fps CV", None, None, Better::Lower),
    ("19", "unpaced mean MB/s", None, None, Better::Higher),
    ("19", "unpaced CV", None, None, Better::Lower),
];

/// The paper's stated ratios where it states one in words rather than values.
const PAPER_RATIOS: &[(&str, &str, f64)] = &[
    ("13", "MB/s at 256 B", 4.6),
    // "a 20% reduction in average CPU utilization"
    ("15", "mean sender CPU %", 0.8),
];

#[derive(Debug, Clone, Copy)]
enum Better {
    Lower,
    Higher,
}

/// Writes summary.csv and prints our ratios beside the paper's: status byte ÷ sliding window
/// where higher is better, sliding window ÷ status byte where lower is better (so > 1 means the
/// status byte wins in both cases).
fn summary(net: Net, out: &Path, found: &Findings, write_csv: bool) {
    println!(
        "-- Summary over {}: ratio > 1 means the status-byte mechanism is better",
        net.name()
    );
    let mut csv = write_csv.then(|| {
        Csv::create(
            out,
            "summary.csv",
            "figure,metric,paper_status_byte,paper_sliding_window,paper_ratio,status_byte,sliding_window,ratio",
        )
    });
    let ratio = |sb: Option<f64>, sw: Option<f64>, better: Better| match (sb, sw) {
        (Some(sb), Some(sw)) => match better {
            Better::Lower if sb > 0.0 => Some(sw / sb),
            Better::Higher if sw > 0.0 => Some(sb / sw),
            _ => None,
        },
        _ => None,
    };
    let show = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
    let show_ratio = |v: Option<f64>| match v {
        // A ratio over a near-zero denominator (a dip of 0.1 %) says nothing more than "far".
        Some(v) if v > 100.0 => ">100".to_string(),
        v => show(v),
    };
    println!(
        "{:>4} {:<32} {:>10} {:>10} {:>8} | {:>10} {:>10} {:>8}",
        "fig", "metric", "paper SB", "paper SW", "ratio", "ours SB", "ours SW", "ratio"
    );
    for (fig, metric, psb, psw, better) in PAPER {
        let pr = ratio(*psb, *psw, *better).or_else(|| {
            PAPER_RATIOS
                .iter()
                .find(|(f, m, _)| f == fig && m == metric)
                .map(|(_, _, r)| match better {
                    Better::Lower => 1.0 / r,
                    Better::Higher => *r,
                })
        });
        let sb = found.get(fig, metric, "status-byte");
        let sw = found.get(fig, metric, "sliding-window");
        let ours = ratio(sb, sw, *better);
        println!(
            "{fig:>4} {metric:<32} {:>10} {:>10} {:>8} | {:>10} {:>10} {:>8}",
            show(*psb),
            show(*psw),
            show_ratio(pr),
            show(sb),
            show(sw),
            show_ratio(ours)
        );
        if let Some(csv) = csv.as_mut() {
            csv.row(&[
                fig.to_string(),
                metric.to_string(),
                show(*psb),
                show(*psw),
                show_ratio(pr),
                show(sb),
                show(sw),
                show_ratio(ours),
            ]);
        }
    }
}
