//! `receiver`: accepts senders, polls the status bytes of each sender's region, reorders frames
//! per device and writes them to per-device directories. It never posts a work request.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;

use rdmastream::engine::ReceiverHandle;
use rdmastream::transport::Kind;
use rdmastream_app::cli::{ConfigError, init_logging, load_config};
use rdmastream_app::config::{ReceiverConfig, ReceiverPlan};
use rdmastream_app::monitor::Role;
use rdmastream_app::run::{Observer, ReceiverRun};
use rdmastream_app::sink::DirectorySink;
use rdmastream_verbs::{VerbsSettings, posted_work_requests};

/// The built-in defaults, used when there is no config file: the shipped example (listen on
/// 127.0.0.1:7471, write to ./out), compiled in so a copied binary has them.
const DEFAULTS: &str = include_str!("../../configs/receiver.toml");

/// Receives frames from rdmastream senders into per-device directories.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// Config file (default: configs/receiver.toml here, else receiver.toml next to the executable or
    /// in ../share/rdmastream/ beside it, else the built-in defaults, which are the shipped
    /// configs/receiver.toml).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Output directory (overrides `out`).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Check every synthetic camera/radar frame against its reference pattern; exit non-zero
    /// if any differs.
    #[arg(long)]
    verify: bool,
    /// Exit once every sender that connected has ended all its streams and disconnected, or has
    /// been gone for `sender_gone_after` seconds without ending them (killed, or its link died).
    #[arg(long)]
    exit_after_eos: bool,
    /// Override `listen` (address:port, or unix:/path for the shm transport).
    #[arg(long)]
    listen: Option<String>,
    /// Override `transport` (auto, verbs, tcp, shm; auto is shm for a unix:/path address).
    #[arg(long)]
    transport: Option<String>,
    /// Override `metrics`: serve /metrics, /healthz, /readyz and the status page at / on this
    /// address:port.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
}

fn main() {
    init_logging();
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => std::process::exit(code),
        Err(e) => rdmastream_app::cli::exit_on_error("receiver", e.as_ref()),
    }
}

fn run(cli: Cli) -> anyhow::Result<i32> {
    let (file, mut cfg): (_, ReceiverConfig) =
        load_config(cli.config.clone(), "receiver.toml", DEFAULTS)?;
    let flags = [
        ("out", "--out", cli.out.is_some()),
        ("listen", "--listen", cli.listen.is_some()),
        ("transport", "--transport", cli.transport.is_some()),
        ("metrics", "--metrics", cli.metrics.is_some()),
    ];
    if let Some(o) = cli.out {
        cfg.out = o;
    }
    if let Some(l) = cli.listen {
        cfg.listen = l;
    }
    if let Some(t) = cli.transport {
        cfg.transport = t;
    }
    if let Some(m) = cli.metrics {
        cfg.metrics = Some(m);
    }
    let ReceiverPlan {
        region,
        options: opts,
        sink: mut sink_opts,
        pipelines,
    } = cfg.validate(&file).map_err(|e| e.blame(&flags))?;
    sink_opts.verify = cli.verify;
    // Devices with a `pipeline` go to GStreamer (rdmastream_app::gst::LaunchSinks), the rest to
    // files. The pipelines are checked first, before any port is taken: a typo in one is the
    // error reported, not a busy port, and nothing has listened when it is.
    let pipelines = rdmastream_app::gst::LaunchSinks::check(pipelines).map_err(|(device, e)| {
        // Named as the file names it: the `[[device]]` entry of that device.
        let entry = device.and_then(|d| cfg.device.iter().position(|c| c.id == d as u32));
        let key = match entry {
            Some(n) => format!("device[{n}].pipeline"),
            None => "device.pipeline".to_string(),
        };
        ConfigError::new(&file, key, e)
    })?;
    let (memory, disk_budget) = (opts.limits.budget.clone(), sink_opts.disk_budget);
    let observer = Observer::start(Role::Receiver, cfg.metrics.as_deref(), cfg.status_interval)?;
    let verbs = VerbsSettings {
        device: cfg.rdma_device.clone(),
        port: cfg.ib_port,
        gid_index: cfg.gid_index,
    };
    let (kind, listener) = rdmastream_verbs::listener(&cfg.transport, &cfg.listen, region, &verbs)
        .context("the listen address (`listen`, --listen)")?;
    let files =
        Arc::new(DirectorySink::new(sink_opts).context("the output directory (`out`, --out)")?);
    let sink = files.clone();
    let sink: Arc<dyn rdmastream::engine::FrameSink> = if pipelines.is_empty() {
        sink
    } else {
        Arc::new(rdmastream_app::gst::LaunchSinks::new(pipelines, sink))
    };
    let receiver = ReceiverHandle::start(opts, Box::new(listener), observer.tap(sink))?;
    tracing::info!(
        "receiver listening on {} (transport {kind}), {} blocks of {} bytes per sender, writing to {}",
        receiver.local_addr(),
        cfg.blocks,
        cfg.block_size,
        cfg.out.display()
    );
    if let Some(hint) = cfg.tcp_region_hint(kind == Kind::Tcp) {
        tracing::info!("{hint}");
    }
    let stop = rdmastream_app::cli::Stop::new();
    {
        let stop = stop.clone();
        ctrlc::set_handler(move || {
            if stop.ask() {
                std::process::exit(130);
            }
            eprintln!("receiver: stopping, finishing the files in progress");
        })
        .context("installing the Ctrl-C handler")?;
    }
    let run = ReceiverRun {
        files: &files,
        status_interval: cfg.status_interval,
        exit_after_eos: cli.exit_after_eos,
        verify: cli.verify,
        // The verbs crate's status-byte posts, and every WorkCounter's (the sliding window's
        // receives and ACKs, over either transport).
        posted_work_requests: || {
            posted_work_requests() + rdmastream::transport::counted_work_requests()
        },
        memory,
        disk_budget,
        observer,
    };
    Ok(rdmastream_app::run::receiver(receiver, run, stop))
}
