//! `sender`: runs the sources of one edge node and streams their frames to a receiver over one
//! shared connection (status-byte-assisted one-sided RDMA, or its TCP emulation).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;

use rdmastream::engine::{SenderHandle, SenderOptions};
use rdmastream::stats::StatusLine;
use rdmastream_app::cli::{ConfigError, every, init_logging, load_config, load_key};
use rdmastream_app::config::{SenderConfig, Source};
use rdmastream_app::source::Producer;
use rdmastream_verbs::VerbsSettings;

/// The built-in defaults, used when there is no config file: the shipped example (the demo's
/// 12 cameras and 2 radars into 127.0.0.1:7471), compiled in so a copied binary has them.
const DEFAULTS: &str = include_str!("../../configs/sender.toml");

/// Streams synthetic cameras, radars or image files to an rdmastream receiver.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// Config file (default: configs/sender.toml here or next to the executable, else the
    /// built-in defaults, which are the shipped configs/sender.toml).
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

/// A device's source, ready to run on its thread.
enum Runner {
    Builtin(Producer),
    Gstreamer(rdmastream_app::gst::LaunchSource),
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
            eprintln!(
                "sender: {}",
                rdmastream_app::cli::describe_error(e.as_ref())
            );
            std::process::exit(1);
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let (file, mut cfg): (_, SenderConfig) =
        load_config(cli.config.clone(), "sender.toml", DEFAULTS)?;
    let overridden: Vec<(&str, &str)> = [
        ("receiver", "--receiver", cli.receiver.is_some()),
        ("name", "--name", cli.name.is_some()),
        ("transport", "--transport", cli.transport.is_some()),
    ]
    .into_iter()
    .filter_map(|(key, flag, given)| given.then_some((key, flag)))
    .collect();
    if let Some(r) = cli.receiver {
        cfg.receiver = r;
    }
    if let Some(n) = cli.name {
        cfg.name = n;
    }
    if let Some(t) = cli.transport {
        cfg.transport = t;
    }
    let devices = cfg.validate(&file).map_err(|e| e.blame(&overridden))?;
    let key = load_key(&file, "", cfg.key.as_deref(), cfg.key_file.as_deref())?;
    let verbs = VerbsSettings {
        device: cfg.rdma_device.clone(),
        port: cfg.ib_port,
        gid_index: cfg.gid_index,
    };
    let (_, connector) = rdmastream_verbs::connector(
        &cfg.transport,
        &cfg.receiver,
        &verbs,
        cfg.max_outstanding,
        Duration::from_secs_f64(cfg.peer_timeout),
    )?;
    // Build every producer first so a bad image directory fails before anything streams.
    let mut producers = Vec::new();
    for d in &devices {
        // A source that cannot be built (no images in `dir`, a pipeline that does not parse)
        // is bad input: a config error naming the device, exit 2.
        let bad = |why: String| ConfigError::new(&file, "", format!("device {}: {why}", d.id));
        let p = match &d.kind {
            Source::Builtin(kind) => Runner::Builtin(
                Producer::new(d.id, kind)
                    .map_err(|e| bad(rdmastream_app::cli::describe_error(&e)))?,
            ),
            Source::Gstreamer(launch) => Runner::Gstreamer(
                rdmastream_app::gst::LaunchSource::new(d.id, launch).map_err(bad)?,
            ),
        };
        producers.push((d, p));
    }
    let opts = SenderOptions {
        name: cfg.name.clone(),
        key,
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
    let mut sender = SenderHandle::start(opts, connector, cfg.queue_depth)?;
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
            // Every source ended by itself (a frame count, finite gstreamer pipelines): flush
            // and exit.
            if sources.iter().all(|s| s.is_finished()) {
                return false;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                stop.store(true, Ordering::Release);
            }
            true
        },
    );
    // Flushing: everything the sources produced is delivered (for lossless devices: confirmed
    // by the receiver), however long that takes while nobody asked to stop; once a stop was
    // asked for (Ctrl-C, --duration), for at most the grace period, whatever the link does.
    let grace = Duration::from_secs_f64(cfg.shutdown_grace);
    sender.close();
    let mut give_up: Option<Instant> = None;
    let mut told = Instant::now();
    while !(sender.is_finished() && sources.iter().all(|s| s.is_finished())) {
        // The sending thread gave up (refused, failed): nothing more can be delivered, so the
        // sources stop too and the error is reported below.
        if sender.is_finished() {
            stop.store(true, Ordering::Release);
        }
        if give_up.is_none() && stop.load(Ordering::Acquire) {
            give_up = Some(Instant::now() + grace);
        }
        if give_up.is_some_and(|t| Instant::now() >= t) {
            break;
        }
        if told.elapsed() >= Duration::from_secs_f64(cfg.status_interval) {
            told = Instant::now();
            tracing::info!(
                "stopping: delivering what is left{}",
                give_up.map_or(String::new(), |t| format!(
                    " (giving up in {:.1} s)",
                    t.saturating_duration_since(Instant::now()).as_secs_f64()
                ))
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Release);
    let report = sender.finish(Duration::ZERO)?;
    for s in sources {
        let _ = s.join();
    }
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
    if report.unsent > 0 || report.undelivered_frames > 0 {
        anyhow::bail!(
            "{} frames ({} blocks) were not delivered to receiver {} within the {:.0} s \
             shutdown grace period (is it unreachable?)",
            report.undelivered_frames,
            report.unsent,
            cfg.receiver,
            cfg.shutdown_grace
        );
    }
    Ok(())
}
