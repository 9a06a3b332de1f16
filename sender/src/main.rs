//! `sender`: runs the sources of one edge node and streams their frames to a receiver over one
//! shared connection (status-byte-assisted one-sided RDMA, or its TCP emulation).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use serde::Deserialize;

use rdmastream::app::{ConfigError, default_config, every, init_logging, load_toml};
use rdmastream::engine::{DropPolicy, SenderHandle, SenderOptions};
use rdmastream::source::{Producer, SourceKind};
use rdmastream::stats::StatusLine;
use rdmastream::transport::tcp::TcpConnector;
use rdmastream::transport::verbs::{VerbsConnector, VerbsSettings};
use rdmastream::transport::{self, Connector, Kind};

/// Streams synthetic cameras, radars or image files to an rdmastream receiver.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// Config file (default: the shipped configs/sender.toml).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Stop cleanly after this many seconds (sources end, queued frames are flushed, every
    /// device sends end-of-stream).
    #[arg(long, value_name = "SECS")]
    duration: Option<f64>,
    /// Override `receiver` (host:port).
    #[arg(long)]
    receiver: Option<String>,
    /// Override `name`.
    #[arg(long)]
    name: Option<String>,
    /// Override `transport` (auto, verbs, tcp).
    #[arg(long)]
    transport: Option<String>,
}

/// sender.toml; every key is documented in configs/sender.toml.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Config {
    name: String,
    receiver: String,
    #[serde(default = "d_transport")]
    transport: String,
    #[serde(default)]
    token: String,
    #[serde(default = "d_send_blocks")]
    send_blocks: usize,
    #[serde(default = "d_block_size")]
    block_size: usize,
    #[serde(default = "d_outstanding")]
    max_outstanding: usize,
    #[serde(default = "d_queue")]
    queue_depth: usize,
    #[serde(default = "d_status")]
    status_interval: f64,
    #[serde(default)]
    first_packet: u16,
    #[serde(default)]
    rdma_device: Option<String>,
    #[serde(default = "d_port")]
    ib_port: u8,
    #[serde(default)]
    gid_index: Option<u32>,
    #[serde(default)]
    device: Vec<DeviceConfig>,
}

fn d_port() -> u8 {
    1
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct DeviceConfig {
    id: u32,
    #[serde(default = "d_count")]
    count: u32,
    source: String,
    width: Option<u32>,
    height: Option<u32>,
    fps: Option<f64>,
    size: Option<usize>,
    rate: Option<f64>,
    dir: Option<PathBuf>,
    /// source = "gstreamer": a launch string ending in appsink.
    pipeline: Option<String>,
    #[serde(default = "d_policy")]
    policy: String,
    /// Built-in sources: end the device after this many frames (default: run until stopped).
    frames: Option<u64>,
}

fn d_transport() -> String {
    "auto".into()
}
fn d_send_blocks() -> usize {
    8
}
fn d_block_size() -> usize {
    1 << 20
}
fn d_outstanding() -> usize {
    4
}
fn d_queue() -> usize {
    4
}
fn d_status() -> f64 {
    1.0
}
fn d_count() -> u32 {
    1
}
fn d_policy() -> String {
    "drop-oldest".into()
}

/// Where a device's frames come from.
#[derive(Clone)]
enum Source {
    Builtin(SourceKind),
    /// A GStreamer launch string ending in appsink (gst-plugin's `LaunchSource`).
    Gstreamer(String),
}

struct Device {
    id: u8,
    kind: Source,
    policy: DropPolicy,
    frames: Option<u64>,
}

/// A device's source, ready to run on its thread.
enum Runner {
    Builtin(Producer),
    Gstreamer(gstrdma::app::LaunchSource),
}

fn validate(cfg: &Config, file: &Path) -> Result<Vec<Device>, ConfigError> {
    let err = |key: &str, reason: String| ConfigError::new(file, key, reason);
    if !rdmastream::proto::handshake::valid_sender_name(&cfg.name) {
        return Err(err(
            "name",
            format!("{:?} is not 1-64 characters of A-Z a-z 0-9 . _ -", cfg.name),
        ));
    }
    if cfg.send_blocks == 0 || cfg.send_blocks > 4096 {
        return Err(err(
            "send_blocks",
            format!("{} is not in 1..=4096", cfg.send_blocks),
        ));
    }
    if cfg.block_size <= rdmastream::proto::OVERHEAD || cfg.block_size > 1 << 30 {
        return Err(err(
            "block_size",
            format!(
                "{} is not in {}..=1 GiB",
                cfg.block_size,
                rdmastream::proto::OVERHEAD + 1
            ),
        ));
    }
    if cfg.max_outstanding == 0 || cfg.max_outstanding > 1024 {
        return Err(err(
            "max_outstanding",
            format!("{} is not in 1..=1024", cfg.max_outstanding),
        ));
    }
    if cfg.queue_depth == 0 {
        return Err(err("queue_depth", "must be at least 1".into()));
    }
    if cfg.status_interval.is_nan() || cfg.status_interval <= 0.0 {
        return Err(err("status_interval", "must be > 0 seconds".into()));
    }
    if cfg.ib_port == 0 {
        return Err(err("ib_port", "ports are numbered from 1".into()));
    }
    if !matches!(cfg.transport.as_str(), "auto" | "tcp" | "verbs") {
        return Err(err(
            "transport",
            format!("{:?} is not one of auto, tcp, verbs", cfg.transport),
        ));
    }
    let mut devices = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for (n, d) in cfg.device.iter().enumerate() {
        let key = |k: &str| format!("device[{n}].{k}");
        let positive = |k: &str, v: Option<f64>, default: f64| -> Result<f64, ConfigError> {
            let v = v.unwrap_or(default);
            if v.is_finite() && v > 0.0 && v <= 10_000.0 {
                Ok(v)
            } else {
                Err(err(&key(k), format!("{v} is not in (0, 10000]")))
            }
        };
        let dims = |default_w, default_h| -> Result<(u32, u32), ConfigError> {
            let (w, h) = (d.width.unwrap_or(default_w), d.height.unwrap_or(default_h));
            if w == 0 || h == 0 || (w as u64) * (h as u64) * 3 > 256 << 20 {
                return Err(err(
                    &key("width"),
                    format!("{w}x{h} is not a frame size up to 256 MiB"),
                ));
            }
            Ok((w, h))
        };
        let kind = match d.source.as_str() {
            "camera-synthetic" => {
                let (width, height) = dims(640, 480)?;
                Source::Builtin(SourceKind::CameraSynthetic {
                    width,
                    height,
                    fps: positive("fps", d.fps, 25.0)?,
                })
            }
            "radar-synthetic" => {
                let size = d.size.unwrap_or(65536);
                if size == 0 || size > 256 << 20 {
                    return Err(err(&key("size"), format!("{size} is not in 1..=256 MiB")));
                }
                Source::Builtin(SourceKind::RadarSynthetic {
                    size,
                    rate: positive("rate", d.rate, 20.0)?,
                })
            }
            "images" => {
                let (width, height) = dims(640, 480)?;
                let dir = d.dir.clone().unwrap_or_else(|| PathBuf::from("assets"));
                let dir = if dir.is_relative() && !dir.exists() {
                    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(&dir)
                } else {
                    dir
                };
                Source::Builtin(SourceKind::Images {
                    dir,
                    width,
                    height,
                    fps: positive("fps", d.fps, 25.0)?,
                })
            }
            "gstreamer" => match d.pipeline.as_deref().map(str::trim) {
                Some(p) if !p.is_empty() => Source::Gstreamer(p.to_string()),
                _ => {
                    return Err(err(
                        &key("pipeline"),
                        "source \"gstreamer\" needs a launch string ending in appsink".into(),
                    ));
                }
            },
            other => {
                return Err(err(
                    &key("source"),
                    format!(
                        "{other:?} is not one of camera-synthetic, radar-synthetic, images, gstreamer"
                    ),
                ));
            }
        };
        if d.pipeline.is_some() && !matches!(kind, Source::Gstreamer(_)) {
            return Err(err(
                &key("pipeline"),
                "only source \"gstreamer\" takes a pipeline".into(),
            ));
        }
        let policy = match d.policy.as_str() {
            "drop-oldest" => DropPolicy::DropOldest,
            "block" => DropPolicy::Block,
            other => {
                return Err(err(
                    &key("policy"),
                    format!("{other:?} is not one of drop-oldest, block"),
                ));
            }
        };
        match (d.frames, &kind) {
            (Some(0), _) => {
                return Err(err(
                    &key("frames"),
                    "0 frames: leave the key out to run until stopped".into(),
                ));
            }
            (Some(_), Source::Gstreamer(_)) => {
                return Err(err(
                    &key("frames"),
                    "source \"gstreamer\" ends with its pipeline: put num-buffers=N on its source element".into(),
                ));
            }
            _ => {}
        }
        if d.count == 0 || d.id + d.count > 256 {
            return Err(err(
                &key("id"),
                format!(
                    "devices {}..{} are not within 0..=255",
                    d.id,
                    d.id + d.count
                ),
            ));
        }
        for id in d.id..d.id + d.count {
            if !seen.insert(id) {
                return Err(err(&key("id"), format!("device {id} is configured twice")));
            }
            devices.push(Device {
                id: id as u8,
                kind: kind.clone(),
                policy,
                frames: d.frames,
            });
        }
    }
    if devices.is_empty() {
        return Err(err("device", "no devices configured".into()));
    }
    Ok(devices)
}

fn main() {
    init_logging();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => {}
        Err(e) if e.downcast_ref::<ConfigError>().is_some() => {
            eprintln!("sender: bad config: {e}");
            std::process::exit(2);
        }
        Err(e) => {
            eprintln!("sender: {e:#}");
            std::process::exit(1);
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let file = cli
        .config
        .clone()
        .unwrap_or_else(|| default_config("sender.toml"));
    let mut cfg: Config = load_toml(&file)?;
    if let Some(r) = cli.receiver {
        cfg.receiver = r;
    }
    if let Some(n) = cli.name {
        cfg.name = n;
    }
    if let Some(t) = cli.transport {
        cfg.transport = t;
    }
    let devices = validate(&cfg, &file)?;
    let verbs = VerbsSettings {
        device: cfg.rdma_device.clone(),
        port: cfg.ib_port,
        gid_index: cfg.gid_index,
    };
    let connector: Box<dyn Connector> = match transport::choose(&cfg.transport, &verbs)? {
        Kind::Tcp => Box::new(TcpConnector::new(cfg.receiver.clone())),
        Kind::Verbs => Box::new(VerbsConnector::new(
            cfg.receiver.clone(),
            verbs,
            cfg.max_outstanding,
        )?),
    };
    // Build every producer first so a bad image directory fails before anything streams.
    let mut producers = Vec::new();
    for d in &devices {
        let p = match &d.kind {
            Source::Builtin(kind) => Runner::Builtin(
                Producer::new(d.id, kind)
                    .with_context(|| format!("device {} in {}", d.id, file.display()))?,
            ),
            Source::Gstreamer(launch) => Runner::Gstreamer(
                gstrdma::app::LaunchSource::new(d.id, launch)
                    .map_err(anyhow::Error::msg)
                    .with_context(|| format!("device {} in {}", d.id, file.display()))?,
            ),
        };
        producers.push((d, p));
    }
    let opts = SenderOptions {
        name: cfg.name.clone(),
        token: cfg.token.clone(),
        send_blocks: cfg.send_blocks,
        block_size: cfg.block_size,
        max_outstanding: cfg.max_outstanding,
        first_packet: cfg.first_packet,
        ..Default::default()
    };
    tracing::info!(
        "sender '{}' -> {} ({}): {} devices, {} send blocks of {} bytes",
        cfg.name,
        cfg.receiver,
        cfg.transport,
        devices.len(),
        cfg.send_blocks,
        cfg.block_size
    );
    let sender = SenderHandle::start(opts, connector, cfg.queue_depth)?;
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        ctrlc::set_handler(move || {
            if stop.swap(true, Ordering::AcqRel) {
                eprintln!("sender: second Ctrl-C, exiting now");
                std::process::exit(130);
            }
            eprintln!("sender: stopping (Ctrl-C again to exit at once)");
        })
        .context("installing the Ctrl-C handler")?;
    }
    let mut sources = Vec::new();
    for (d, producer) in producers {
        let input = sender.add_device(d.id, d.policy);
        let (stop, frames) = (stop.clone(), d.frames);
        sources.push(
            std::thread::Builder::new()
                .name(format!("source-{}", d.id))
                .spawn(move || {
                    match producer {
                        Runner::Builtin(p) => p.run(&stop, frames, |f| input.push(f)),
                        Runner::Gstreamer(p) => {
                            if let Err(e) = p.run(&stop, |f| input.push(f)) {
                                tracing::error!("{e}; ending the device");
                            }
                        }
                    }
                    input.end();
                })
                .context("starting a source thread")?,
        );
    }
    let started = Instant::now();
    let deadline = cli
        .duration
        .map(|s| started + Duration::from_secs_f64(s.max(0.0)));
    let counters = sender.counters();
    let mut line = StatusLine::<u8>::default();
    every(
        Duration::from_secs_f64(cfg.status_interval),
        &stop,
        |elapsed| {
            let m = sender.machine_stats();
            tracing::info!(
                "status: {} | syncs {} retained-skipped {}",
                line.render(&counters, elapsed),
                m.syncs,
                m.retained_skipped
            );
            if sender.is_finished() {
                return false;
            }
            // Every source ended by itself (finite gstreamer pipelines): finish and exit.
            if sources.iter().all(|s| s.is_finished()) {
                return false;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                stop.store(true, Ordering::Release);
            }
            true
        },
    );
    stop.store(true, Ordering::Release);
    for s in sources {
        let _ = s.join();
    }
    let report = sender.finish(Duration::from_secs(10))?;
    let total: u64 = counters
        .all()
        .iter()
        .map(|(_, c)| rdmastream::stats::get(&c.frames))
        .sum();
    let drops: u64 = counters
        .all()
        .iter()
        .map(|(_, c)| rdmastream::stats::get(&c.drops))
        .sum();
    tracing::info!(
        "done after {:.1}s: {total} frames written, {drops} dropped, {} write chains, {} syncs ({} found nothing free), {} connections, {} blocks unsent",
        started.elapsed().as_secs_f64(),
        report.machine.writes,
        report.machine.syncs,
        report.machine.empty_syncs,
        report.connections,
        report.unsent
    );
    if report.unsent > 0 {
        anyhow::bail!(
            "{} blocks could not be delivered before shutdown (receiver {} unreachable?)",
            report.unsent,
            cfg.receiver
        );
    }
    Ok(())
}
