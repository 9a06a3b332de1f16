//! `receiver`: accepts senders, polls the status bytes of each sender's region, reorders frames
//! per device and writes them to per-device directories. It never posts a work request.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use clap::Parser;

use rdmastream::engine::{ReceiverHandle, StreamKey};
use rdmastream::stats::{StatusLine, get};
use rdmastream_app::cli::{ByteSize, ConfigError, every, init_logging, load_config};
use rdmastream_app::config::{ReceiverConfig, ReceiverPlan};
use rdmastream_app::sink::DirectorySink;
use rdmastream_verbs::{VerbsSettings, posted_work_requests};

/// The built-in defaults, used when there is no config file: the shipped example (listen on
/// 127.0.0.1:7471, write to ./out), compiled in so a copied binary has them.
const DEFAULTS: &str = include_str!("../../configs/receiver.toml");

/// Receives frames from rdmastream senders into per-device directories.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// Config file (default: configs/receiver.toml here or next to the executable, else the
    /// built-in defaults, which are the shipped configs/receiver.toml).
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
            eprintln!(
                "receiver: {}",
                rdmastream_app::cli::describe_error(e.as_ref())
            );
            std::process::exit(1);
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<i32> {
    let (file, mut cfg): (_, ReceiverConfig) =
        load_config(cli.config.clone(), "receiver.toml", DEFAULTS)?;
    let overridden: Vec<(&str, &str)> = [
        ("out", "--out", cli.out.is_some()),
        ("listen", "--listen", cli.listen.is_some()),
        ("transport", "--transport", cli.transport.is_some()),
    ]
    .into_iter()
    .filter_map(|(key, flag, given)| given.then_some((key, flag)))
    .collect();
    if let Some(o) = cli.out {
        cfg.out = o;
    }
    if let Some(l) = cli.listen {
        cfg.listen = l;
    }
    if let Some(t) = cli.transport {
        cfg.transport = t;
    }
    let ReceiverPlan {
        region,
        options: opts,
        sink: mut sink_opts,
        pipelines,
    } = cfg.validate(&file).map_err(|e| e.blame(&overridden))?;
    sink_opts.verify = cli.verify;
    let verbs = VerbsSettings {
        device: cfg.rdma_device.clone(),
        port: cfg.ib_port,
        gid_index: cfg.gid_index,
    };
    let (kind, listener) = rdmastream_verbs::listener(&cfg.transport, &cfg.listen, region, &verbs)?;
    let files = Arc::new(
        DirectorySink::new(sink_opts)
            .with_context(|| format!("output directory {}", cfg.out.display()))?,
    );
    let sink = files.clone();
    // Devices with a `pipeline` go to GStreamer (gst-plugin's LaunchSinks), the rest to files.
    let sink: Arc<dyn rdmastream::engine::FrameSink> = if pipelines.is_empty() {
        sink
    } else {
        Arc::new(
            rdmastream_app::gst::LaunchSinks::new(pipelines, sink)
                .map_err(|e| ConfigError::new(&file, "device.pipeline", e))?,
        )
    };
    let receiver = ReceiverHandle::start(opts, Box::new(listener), sink)?;
    tracing::info!(
        "receiver listening on {} (transport {kind}), {} blocks of {} bytes per sender, writing to {}",
        receiver.local_addr(),
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
    let refused_by_kind = receiver.refused_by_kind();
    receiver.stop();
    let mut mismatched = 0;
    // Frames of lossless devices that never made it to the output: never a success.
    let mut lost = 0;
    for (key, c) in &counters {
        let r = reorder
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, r)| *r)
            .unwrap_or_default();
        mismatched += get(&c.mismatched);
        tracing::info!(
            "summary {key}: {} frames received, {} written{}, {} MB, verified {} mismatched {}, missing {} duplicate frames {} write errors {} unwritten {}, packets: gaps {} duplicates {} reordered {} partial {} oversized {} over-budget {}{}",
            get(&c.frames),
            get(&c.written),
            if get(&c.reliable) == 1 {
                " (lossless)"
            } else {
                ""
            },
            get(&c.bytes) / 1_000_000,
            get(&c.verified),
            get(&c.mismatched),
            get(&c.missing),
            get(&c.duplicates),
            get(&c.write_errors),
            get(&c.unwritten),
            r.gap_packets,
            r.duplicates,
            r.reordered,
            r.partial_messages,
            r.oversized,
            r.over_budget,
            if get(&c.ended) == 1 { ", ended" } else { "" }
        );
        if get(&c.reliable) == 1 {
            lost += get(&c.missing) + get(&c.unwritten);
        }
    }
    let p = line.total_latency();
    let ms = |d: Option<std::time::Duration>| match d {
        Some(d) => format!("{:.3} ms", d.as_secs_f64() * 1e3),
        None => "- (no frames)".to_string(),
    };
    let listed = |m: Vec<(String, u64)>| {
        if m.is_empty() {
            "none".to_string()
        } else {
            m.iter()
                .map(|(k, n)| format!("{n} {k}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    tracing::info!(
        "summary: {blocks} blocks, {idle} idle polls, {refused} connections refused ({}), {} work requests posted by the receiver, invalid blocks: {}, latency p50 {} p99 {}",
        listed(
            refused_by_kind
                .iter()
                .map(|(k, n)| (k.to_string(), *n))
                .collect()
        ),
        posted_work_requests(),
        listed(invalid.iter().map(|(k, n)| (k.to_string(), *n)).collect()),
        ms(p.quantile(0.5)),
        ms(p.quantile(0.99))
    );
    let ev = files.evictions();
    tracing::info!(
        "summary: output {} on disk, {} frame files deleted for keep, {} for disk_budget",
        ByteSize(files.disk_used()),
        ev.keep,
        ev.disk_budget
    );
    if lost > 0 {
        eprintln!(
            "receiver: FAILED: {lost} frames of lossless devices are missing from the output \
             (see the summary lines: missing, unwritten)"
        );
        return Ok(4);
    }
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
