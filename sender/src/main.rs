//! `sender`: runs the sources of one edge node and streams their frames to a receiver over one
//! shared connection (status-byte-assisted one-sided RDMA, or its TCP emulation).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;

use rdmastream_app::cli::{init_logging, load_config, load_key};
use rdmastream_app::config::SenderConfig;
use rdmastream_verbs::VerbsSettings;

/// The built-in defaults, used when there is no config file: the shipped example (the demo's
/// 12 cameras and 2 radars into 127.0.0.1:7471), compiled in so a copied binary has them.
const DEFAULTS: &str = include_str!("../../configs/sender.toml");

/// Streams synthetic cameras, radars or image files to an rdmastream receiver.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// Config file (default: configs/sender.toml here, else sender.toml next to the executable or
    /// in ../share/rdmastream/ beside it, else the built-in defaults, which are the shipped
    /// configs/sender.toml).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Stop cleanly after this many seconds (sources end, queued frames are flushed, every
    /// device sends end-of-stream).
    #[arg(long, value_name = "SECS")]
    duration: Option<f64>,
    /// The receiver: host:port, or unix:/path for the shm transport (overrides `receiver`; a
    /// config file may leave that key to this flag).
    #[arg(long)]
    receiver: Option<String>,
    /// This sender's name, as the receiver knows it (overrides `name`; a config file may leave
    /// that key to this flag).
    #[arg(long)]
    name: Option<String>,
    /// Override `transport` (auto, verbs, tcp, shm; auto is shm for a unix:/path address).
    #[arg(long)]
    transport: Option<String>,
    /// Override `metrics`: serve /metrics, /healthz and /readyz on this address:port.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<String>,
}

fn main() {
    init_logging();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => {}
        Err(e) => rdmastream_app::cli::exit_on_error("sender", e.as_ref()),
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let (file, mut cfg): (_, SenderConfig) =
        load_config(cli.config.clone(), "sender.toml", DEFAULTS)?;
    let flags = [
        ("receiver", "--receiver", cli.receiver.is_some()),
        ("name", "--name", cli.name.is_some()),
        ("transport", "--transport", cli.transport.is_some()),
        ("metrics", "--metrics", cli.metrics.is_some()),
    ];
    if let Some(r) = cli.receiver {
        cfg.receiver = r;
    }
    if let Some(n) = cli.name {
        cfg.name = n;
    }
    if let Some(t) = cli.transport {
        cfg.transport = t;
    }
    if let Some(m) = cli.metrics {
        cfg.metrics = Some(m);
    }
    let devices = cfg.validate(&file).map_err(|e| e.blame(&flags))?;
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
        cfg.shm_cache_budget(&file)?,
    )?;
    let stop = rdmastream_app::cli::Stop::new();
    {
        let stop = stop.clone();
        ctrlc::set_handler(move || {
            if stop.ask() {
                eprintln!("sender: second Ctrl-C, exiting now");
                std::process::exit(130);
            }
            eprintln!("sender: stopping (Ctrl-C again to exit at once)");
        })
        .context("installing the Ctrl-C handler")?;
    }
    rdmastream_app::run::sender(&cfg, &file, &devices, key, connector, cli.duration, stop)?;
    Ok(())
}
