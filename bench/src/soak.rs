//! `bench soak --minutes M`: the demo's 12 cameras and 2 radars streaming into a receiver while,
//! every few seconds, a hostile peer from the test suite (testkit::hostile) attacks it. Once a
//! minute it prints the receiver's resident memory, threads, open files and the bytes in its
//! output directory; at the end the slope of each per minute (least squares over the samples after
//! the first minute, when the receiver has warmed up), which should be flat.
//!
//! A command that prints figures, not a test: it asserts nothing.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdmastream_testkit::hostile;

const HONEST_KEY: &str = "soak-honest-key-0123456789";
const MALLORY_KEY: &str = "soak-mallory-key-0123456789";
const SHARED_KEY: &str = "soak-shared-key-0123456789";

struct Sample {
    minute: f64,
    rss: u64,
    threads: u64,
    files: u64,
    disk: u64,
}

impl Sample {
    /// The receiver `pid`'s figures and the bytes under `out`, `minute` into the run.
    fn take(minute: f64, pid: u32, out: &Path) -> Sample {
        Sample {
            minute,
            rss: hostile::rss_bytes(pid),
            threads: hostile::threads(pid),
            files: hostile::open_files(pid),
            disk: hostile::disk_usage(out),
        }
    }

    /// One table row; the minute with `decimals` digits.
    fn print(&self, decimals: usize, attacks: u64) {
        println!(
            "| {:.*} | {:.1} | {} | {} | {:.0} | {attacks} |",
            decimals,
            self.minute,
            self.rss as f64 / 1048576.0,
            self.threads,
            self.files,
            self.disk as f64 / 1048576.0
        );
    }
}

fn sibling(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("own path");
    let path = exe.parent().expect("in a directory").join(name);
    if !path.exists() {
        eprintln!(
            "bench soak: {} not found; build the binaries first: cargo build --release",
            path.display()
        );
        std::process::exit(2);
    }
    path
}

fn start(bin: &Path, args: &[&str], log: &Path) -> Child {
    let out = std::fs::File::create(log).expect("log file");
    Command::new(bin)
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("log"))
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()))
}

/// One attack of the suite, chosen by `round`, against the receiver at `addr`.
fn attack(round: u64, addr: &str) -> &'static str {
    let from = format!("127.0.9.{}", round % 200 + 1);
    let mallory = || hostile::authenticated(addr, "mallory", Some(MALLORY_KEY), round);
    match round % 9 {
        0 => {
            if let Ok((mut c, w)) = mallory() {
                let _ = hostile::claim_huge_messages(&mut c, &w, 32);
            }
            "4 GiB message claims"
        }
        1 => {
            if let Ok((mut c, w)) = mallory() {
                let _ = hostile::zero_length_write_at_end(&mut c, &w);
            }
            "zero-length WRITE past the region"
        }
        2 => {
            if let Ok((mut c, w)) = mallory() {
                let _ = hostile::forged_formats(&mut c, &w, 4, 50_000);
            }
            "forged log lines"
        }
        3 => {
            hostile::malformed_handshakes(&from, addr);
            "malformed handshakes"
        }
        4 => {
            hostile::wrong_proof(&from, addr, "mallory", "wrong-key-0123456789abc");
            hostile::replayed_handshake(&from, addr, "mallory", MALLORY_KEY);
            "wrong proof, replayed handshake"
        }
        5 => {
            let idle = hostile::idle_connections(&from, addr, 8);
            std::thread::sleep(Duration::from_secs(1));
            drop(idle);
            "idle connections"
        }
        6 => {
            let held: Vec<_> = (0..8)
                .filter_map(|i| {
                    hostile::authenticated(addr, &format!("m{i}"), Some(SHARED_KEY), round).ok()
                })
                .collect();
            drop(held);
            "many peers"
        }
        7 => {
            if let Ok((mut c, w)) = mallory() {
                let _ = hostile::disk_flood(&mut c, &w, 8, 2, 1 << 20);
            }
            "disk flood"
        }
        _ => {
            hostile::slow_handshake(
                &from,
                addr,
                Duration::from_millis(500),
                Duration::from_secs(3),
            );
            "slow handshake"
        }
    }
}

/// Least-squares slope of `y` over `x`.
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let (mx, my) = (
        points.iter().map(|p| p.0).sum::<f64>() / n,
        points.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let num: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    let den: f64 = points.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
    if den == 0.0 { 0.0 } else { num / den }
}

pub fn soak(minutes: f64) {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let addr = format!("127.0.0.1:{port}");
    let out = dir.join("out");
    let rx_cfg = dir.join("receiver.toml");
    std::fs::write(
        &rx_cfg,
        format!(
            "listen = \"{addr}\"\ntransport = \"tcp\"\nkeep = 50\ndisk_budget = \"1 GiB\"\n\
             key = \"{SHARED_KEY}\"\n\
             [[sender]]\nname = \"edge-1\"\nkey = \"{HONEST_KEY}\"\n\
             [[sender]]\nname = \"mallory\"\nkey = \"{MALLORY_KEY}\"\n"
        ),
    )
    .expect("receiver config");
    let tx_cfg = dir.join("sender.toml");
    std::fs::write(
        &tx_cfg,
        format!(
            "name = \"edge-1\"\nreceiver = \"{addr}\"\ntransport = \"tcp\"\nkey = \"{HONEST_KEY}\"\n\
             [[device]]\nid = 0\ncount = 12\nsource = \"camera-synthetic\"\nwidth = 640\nheight = 480\nfps = 25\n\
             [[device]]\nid = 100\ncount = 2\nsource = \"radar-synthetic\"\nsize = 65536\nrate = 20\n"
        ),
    )
    .expect("sender config");
    let (rx_log, tx_log) = (dir.join("receiver.log"), dir.join("sender.log"));
    let mut rx = start(
        &sibling("receiver"),
        &[
            "--config",
            rx_cfg.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--verify",
        ],
        &rx_log,
    );
    let end = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(&addr).is_err() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut tx = start(
        &sibling("sender"),
        &["--config", tx_cfg.to_str().unwrap()],
        &tx_log,
    );
    let pid = rx.id();
    println!(
        "soak: 12 cameras 640x480 @25 fps + 2 radars, a hostile peer every 5 s, {minutes} min; receiver pid {pid}"
    );
    println!("| minute | resident MiB | threads | open files | output MiB | attacks so far |");
    println!("|---|---|---|---|---|---|");
    let started = Instant::now();
    let total = Duration::from_secs_f64(minutes * 60.0);
    let mut samples: Vec<Sample> = Vec::new();
    let mut next_sample = started;
    let mut round = 0u64;
    let mut kinds = std::collections::BTreeMap::<&str, u64>::new();
    while started.elapsed() < total {
        if Instant::now() >= next_sample {
            let s = Sample::take(started.elapsed().as_secs_f64() / 60.0, pid, &out);
            s.print(0, round);
            samples.push(s);
            next_sample += Duration::from_secs(60);
        }
        *kinds.entry(attack(round, &addr)).or_insert(0) += 1;
        round += 1;
        std::thread::sleep(Duration::from_secs(5));
        if let Ok(Some(status)) = rx.try_wait() {
            println!(
                "soak: the receiver exited ({status}); see {}",
                rx_log.display()
            );
            break;
        }
    }
    let s = Sample::take(started.elapsed().as_secs_f64() / 60.0, pid, &out);
    s.print(1, round);
    samples.push(s);
    let warm: Vec<&Sample> = samples.iter().filter(|s| s.minute >= 1.0).collect();
    let per_minute = |f: &dyn Fn(&Sample) -> f64| {
        slope(&warm.iter().map(|s| (s.minute, f(s))).collect::<Vec<_>>())
    };
    println!(
        "slope per minute after the first: resident {:+.2} MiB, threads {:+.2}, open files {:+.2}, output {:+.1} MiB",
        per_minute(&|s| s.rss as f64 / 1048576.0),
        per_minute(&|s| s.threads as f64),
        per_minute(&|s| s.files as f64),
        per_minute(&|s| s.disk as f64 / 1048576.0),
    );
    println!(
        "attacks: {}",
        kinds
            .iter()
            .map(|(k, n)| format!("{n}x {k}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for child in [&mut tx, &mut rx] {
        let _ = Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status();
        let end = Instant::now() + Duration::from_secs(30);
        while child.try_wait().ok().flatten().is_none() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
    }
    let log = std::fs::read_to_string(&rx_log).unwrap_or_default();
    for line in log.lines().filter(|l| {
        l.contains(" INFO summary: ")
            || l.contains(" INFO verify: ")
            || l.contains(" INFO summary edge-1/d000")
    }) {
        println!(
            "receiver: {}",
            line.split_once("  INFO ").map_or(line, |x| x.1)
        );
    }
    let tx_text = std::fs::read_to_string(&tx_log).unwrap_or_default();
    if let Some(l) = tx_text.lines().rev().find(|l| l.contains("done after")) {
        println!("sender: {}", l.split_once("  INFO ").map_or(l, |x| x.1));
    }
}
