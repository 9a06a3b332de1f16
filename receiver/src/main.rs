//! `receiver`: accepts senders, polls the status bytes of each sender's region, reorders frames
//! per device and writes them to per-device directories. It never posts a work request.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use serde::Deserialize;

use rdmastream::app::{ConfigError, default_config, every, init_logging, load_toml};
use rdmastream::engine::{ReceiverHandle, ReceiverOptions, StreamKey};
use rdmastream::proto::ReorderConfig;
use rdmastream::sink::{DeviceOutput, DirectorySink, DirectorySinkOptions, FileFormat};
use rdmastream::stats::{StatusLine, get};
use rdmastream::transport::verbs::{VerbsSettings, posted_work_requests};
use rdmastream::transport::{self, Kind, Listener, RegionSettings};

/// Receives frames from rdmastream senders into per-device directories.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// Config file (default: the shipped configs/receiver.toml).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Output directory (overrides `out`).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Check every synthetic camera/radar frame against its reference pattern; exit non-zero
    /// if any differs.
    #[arg(long)]
    verify: bool,
    /// Exit once every sender that connected has ended all its streams and disconnected.
    #[arg(long)]
    exit_after_eos: bool,
    /// Override `listen` (address:port).
    #[arg(long)]
    listen: Option<String>,
    /// Override `transport` (auto, verbs, tcp).
    #[arg(long)]
    transport: Option<String>,
}

/// receiver.toml; every key is documented in configs/receiver.toml.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Config {
    #[serde(default = "d_listen")]
    listen: String,
    #[serde(default = "d_transport")]
    transport: String,
    #[serde(default)]
    token: String,
    #[serde(default = "d_blocks")]
    blocks: usize,
    #[serde(default = "d_block_size")]
    block_size: usize,
    #[serde(default)]
    reserved_blocks: Vec<usize>,
    #[serde(default = "d_out")]
    out: PathBuf,
    #[serde(default = "d_format")]
    format: String,
    #[serde(default)]
    keep: usize,
    #[serde(default = "d_writers")]
    writers: usize,
    #[serde(default = "d_queue")]
    writer_queue: usize,
    #[serde(default = "d_max_device")]
    max_device: u32,
    #[serde(default = "d_window")]
    reorder_window: u32,
    #[serde(default = "d_reorder_timeout")]
    reorder_timeout_ms: u64,
    #[serde(default = "d_poll_min")]
    poll_min_us: u64,
    #[serde(default = "d_poll_max")]
    poll_max_us: u64,
    #[serde(default = "d_status")]
    status_interval: f64,
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
    format: Option<String>,
    keep: Option<usize>,
    /// Sink "gstreamer": frames go into `appsrc ! <pipeline>` instead of files.
    pipeline: Option<String>,
}

fn d_listen() -> String {
    "0.0.0.0:7471".into()
}
fn d_transport() -> String {
    "auto".into()
}
fn d_blocks() -> usize {
    16
}
fn d_block_size() -> usize {
    1 << 20
}
fn d_out() -> PathBuf {
    "out".into()
}
fn d_format() -> String {
    "raw".into()
}
fn d_writers() -> usize {
    2
}
fn d_queue() -> usize {
    16
}
fn d_max_device() -> u32 {
    255
}
fn d_window() -> u32 {
    64
}
fn d_reorder_timeout() -> u64 {
    200
}
fn d_poll_min() -> u64 {
    20
}
fn d_poll_max() -> u64 {
    500
}
fn d_status() -> f64 {
    1.0
}

fn file_format(file: &Path, key: &str, s: &str) -> Result<FileFormat, ConfigError> {
    FileFormat::parse(s)
        .ok_or_else(|| ConfigError::new(file, key, format!("{s:?} is not one of raw, ppm, png")))
}

fn validate(
    cfg: &Config,
    file: &Path,
) -> Result<(RegionSettings, ReceiverOptions, DirectorySinkOptions), ConfigError> {
    let err = |key: &str, reason: String| ConfigError::new(file, key, reason);
    if cfg.blocks == 0 || cfg.blocks > 65536 {
        return Err(err("blocks", format!("{} is not in 1..=65536", cfg.blocks)));
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
    if let Some(b) = cfg.reserved_blocks.iter().find(|&&b| b >= cfg.blocks) {
        return Err(err(
            "reserved_blocks",
            format!("block {b} does not exist (blocks = {})", cfg.blocks),
        ));
    }
    if cfg.reserved_blocks.len() >= cfg.blocks {
        return Err(err(
            "reserved_blocks",
            "would leave no block for senders".into(),
        ));
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
    if cfg.max_device > 255 {
        return Err(err("max_device", format!("{} is over 255", cfg.max_device)));
    }
    if cfg.reorder_window == 0 || cfg.reorder_window > 32768 {
        return Err(err(
            "reorder_window",
            format!("{} is not in 1..=32768", cfg.reorder_window),
        ));
    }
    if cfg.poll_min_us == 0 || cfg.poll_max_us < cfg.poll_min_us {
        return Err(err(
            "poll_max_us",
            "need 0 < poll_min_us <= poll_max_us".into(),
        ));
    }
    if cfg.writers == 0 || cfg.writers > 64 {
        return Err(err("writers", format!("{} is not in 1..=64", cfg.writers)));
    }
    if cfg.status_interval.is_nan() || cfg.status_interval <= 0.0 {
        return Err(err("status_interval", "must be > 0 seconds".into()));
    }
    let keep = |k: usize| (k > 0).then_some(k);
    let default = DeviceOutput {
        format: file_format(file, "format", &cfg.format)?,
        keep: keep(cfg.keep),
    };
    let mut devices = HashMap::new();
    for (n, d) in cfg.device.iter().enumerate() {
        if d.id > 255 {
            return Err(err(
                &format!("device[{n}].id"),
                format!("{} is over 255", d.id),
            ));
        }
        let format = match &d.format {
            Some(f) => file_format(file, &format!("device[{n}].format"), f)?,
            None => default.format,
        };
        devices.insert(
            d.id as u8,
            DeviceOutput {
                format,
                keep: d.keep.map_or(default.keep, keep),
            },
        );
    }
    Ok((
        RegionSettings {
            blocks: cfg.blocks,
            block_size: cfg.block_size,
            token: cfg.token.clone(),
            reserved_blocks: cfg.reserved_blocks.clone(),
        },
        ReceiverOptions {
            max_device: cfg.max_device as u8,
            reorder: ReorderConfig {
                window: cfg.reorder_window as u16,
                timeout: Duration::from_millis(cfg.reorder_timeout_ms),
            },
            poll_min: Duration::from_micros(cfg.poll_min_us),
            poll_max: Duration::from_micros(cfg.poll_max_us),
        },
        DirectorySinkOptions {
            out: cfg.out.clone(),
            default,
            devices,
            verify: false,
            writers: cfg.writers,
            queue: cfg.writer_queue,
        },
    ))
}

fn main() {
    init_logging();
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => std::process::exit(code),
        Err(e) if e.downcast_ref::<ConfigError>().is_some() => {
            eprintln!("receiver: bad config: {e}");
            std::process::exit(2);
        }
        Err(e) => {
            eprintln!("receiver: {e:#}");
            std::process::exit(1);
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<i32> {
    let file = cli
        .config
        .clone()
        .unwrap_or_else(|| default_config("receiver.toml"));
    let mut cfg: Config = load_toml(&file)?;
    if let Some(o) = cli.out {
        cfg.out = o;
    }
    if let Some(l) = cli.listen {
        cfg.listen = l;
    }
    if let Some(t) = cli.transport {
        cfg.transport = t;
    }
    let (region, opts, mut sink_opts) = validate(&cfg, &file)?;
    sink_opts.verify = cli.verify;
    let verbs = VerbsSettings {
        device: cfg.rdma_device.clone(),
        port: cfg.ib_port,
        gid_index: cfg.gid_index,
    };
    let listener: Box<dyn Listener> = match transport::choose(&cfg.transport, &verbs)? {
        Kind::Tcp => Box::new(rdmastream::transport::tcp::listen(&cfg.listen, region)?),
        Kind::Verbs => Box::new(rdmastream::transport::verbs::listen(
            &cfg.listen,
            region,
            verbs,
        )?),
    };
    let sink = Arc::new(
        DirectorySink::new(sink_opts)
            .with_context(|| format!("output directory {}", cfg.out.display()))?,
    );
    // Devices with a `pipeline` go to GStreamer (gst-plugin's LaunchSinks), the rest to files.
    let launches: HashMap<u8, String> = cfg
        .device
        .iter()
        .filter_map(|d| Some((d.id as u8, d.pipeline.clone()?)))
        .collect();
    let sink: Arc<dyn rdmastream::engine::FrameSink> = if launches.is_empty() {
        sink
    } else {
        Arc::new(
            gstrdma::app::LaunchSinks::new(launches, sink)
                .map_err(|e| ConfigError::new(&file, "device.pipeline", e))?,
        )
    };
    let receiver = ReceiverHandle::start(opts, listener, sink)?;
    tracing::info!(
        "receiver listening on {} ({}), {} blocks of {} bytes per sender, writing to {}",
        receiver.local_addr(),
        cfg.transport,
        cfg.blocks,
        cfg.block_size,
        cfg.out.display()
    );
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        ctrlc::set_handler(move || {
            if stop.swap(true, Ordering::AcqRel) {
                std::process::exit(130);
            }
            eprintln!("receiver: stopping, finishing the files in progress");
        })
        .context("installing the Ctrl-C handler")?;
    }
    let mut line = StatusLine::<StreamKey>::default();
    every(
        Duration::from_secs_f64(cfg.status_interval),
        &stop,
        |elapsed| {
            tracing::info!("status: {}", line.render(receiver.counters(), elapsed));
            !(cli.exit_after_eos && receiver.all_senders_ended())
        },
    );
    let counters = receiver.counters().all();
    let reorder = receiver.reorder_stats();
    let invalid = receiver.invalid().all();
    let (blocks, idle, refused) = (receiver.blocks(), receiver.idle_polls(), receiver.refused());
    receiver.stop();
    let mut mismatched = 0;
    for (key, c) in &counters {
        let r = reorder
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, r)| *r)
            .unwrap_or_default();
        mismatched += get(&c.mismatched);
        tracing::info!(
            "summary {key}: {} frames, {} MB, verified {} mismatched {}, gaps {} duplicates {} reordered {} partial {}{}",
            get(&c.frames),
            get(&c.bytes) / 1_000_000,
            get(&c.verified),
            get(&c.mismatched),
            r.gap_packets,
            r.duplicates,
            r.reordered,
            r.partial_messages,
            if get(&c.ended) == 1 { ", ended" } else { "" }
        );
    }
    let p = line.total_latency();
    tracing::info!(
        "summary: {blocks} blocks, {idle} idle polls, {refused} connections refused, {} work requests posted by the receiver, invalid blocks {:?}, latency p50 {:?} p99 {:?}",
        posted_work_requests(),
        invalid,
        p.quantile(0.5),
        p.quantile(0.99)
    );
    if cli.verify {
        let verified: u64 = counters.iter().map(|(_, c)| get(&c.verified)).sum();
        if mismatched > 0 {
            eprintln!(
                "receiver: verify FAILED: {mismatched} frames differ from the reference pattern"
            );
            return Ok(3);
        }
        tracing::info!("verify: all {verified} synthetic frames match the reference pattern");
    }
    Ok(0)
}
