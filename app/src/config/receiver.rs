//! receiver.toml: the receiver's config file as data, its defaults, and its validation into
//! what the receiver runs with ([`ReceiverPlan`]). Every key is documented in the shipped
//! configs/receiver.toml.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::cli::{ByteSize, ConfigError, is_loopback, load_key};
use crate::sink::{DeviceOutput, DirectorySinkOptions, FileFormat};
use rdmastream::engine::ReceiverOptions;
use rdmastream::proto::{Budget, Limits, ReorderConfig};
use rdmastream::transport::{AccessControl, Keys, RegionSettings};

/// receiver.toml; every key is documented in configs/receiver.toml.
#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct ReceiverConfig {
    #[serde(default = "d_listen")]
    pub listen: String,
    #[serde(default = "d_transport")]
    pub transport: String,
    #[serde(default = "d_mechanism")]
    pub mechanism: String,
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    #[serde(default)]
    pub allow_anonymous: bool,
    #[serde(default)]
    pub sender: Vec<SenderKeyConfig>,
    #[serde(default = "d_peer_timeout")]
    pub peer_timeout: f64,
    #[serde(default = "d_sender_gone_after")]
    pub sender_gone_after: f64,
    #[serde(default = "d_max_senders")]
    pub max_senders: usize,
    #[serde(default = "d_memory_budget")]
    pub memory_budget: ByteSize,
    #[serde(default = "d_max_frame_bytes")]
    pub max_frame_bytes: ByteSize,
    #[serde(default = "d_disk_budget")]
    pub disk_budget: ByteSize,
    #[serde(default = "d_blocks")]
    pub blocks: usize,
    #[serde(default = "d_block_size")]
    pub block_size: usize,
    #[serde(default)]
    pub reserved_blocks: Vec<usize>,
    #[serde(default = "d_out")]
    pub out: PathBuf,
    #[serde(default = "d_format")]
    pub format: String,
    #[serde(default = "d_keep")]
    pub keep: usize,
    #[serde(default = "d_writers")]
    pub writers: usize,
    #[serde(default = "d_queue")]
    pub writer_queue: usize,
    #[serde(default = "d_max_device")]
    pub max_device: u32,
    #[serde(default = "d_window")]
    pub reorder_window: u32,
    #[serde(default = "d_reorder_timeout")]
    pub reorder_timeout_ms: u64,
    #[serde(default = "d_poll_min")]
    pub poll_min_us: u64,
    #[serde(default = "d_poll_max")]
    pub poll_max_us: u64,
    #[serde(default = "d_poll_spin")]
    pub poll_spin_us: u64,
    #[serde(default = "d_nic_spin")]
    pub tcp_nic_spin_us: u64,
    #[serde(default = "d_status")]
    pub status_interval: f64,
    /// `address:port` to serve /metrics, /healthz, /readyz (and the receiver's status page)
    /// on; `None`: no HTTP server.
    #[serde(default)]
    pub metrics: Option<String>,
    #[serde(default)]
    pub rdma_device: Option<String>,
    #[serde(default = "d_port")]
    pub ib_port: u8,
    #[serde(default)]
    pub gid_index: Option<u32>,
    #[serde(default)]
    pub device: Vec<ReceiverDeviceConfig>,
}

fn d_port() -> u8 {
    1
}

/// A `[[sender]]` entry: a sender name allowed in, and its key.
#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct SenderKeyConfig {
    pub name: String,
    pub key: Option<String>,
    pub key_file: Option<PathBuf>,
}

fn d_peer_timeout() -> f64 {
    5.0
}
fn d_sender_gone_after() -> f64 {
    30.0
}
fn d_max_senders() -> usize {
    16
}
fn d_memory_budget() -> ByteSize {
    ByteSize(1 << 30)
}
fn d_max_frame_bytes() -> ByteSize {
    ByteSize(16 << 20)
}
fn d_disk_budget() -> ByteSize {
    ByteSize(8 << 30)
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct ReceiverDeviceConfig {
    pub id: u32,
    pub format: Option<String>,
    pub keep: Option<usize>,
    /// Sink "gstreamer": frames go into `appsrc ! <pipeline>` instead of files.
    pub pipeline: Option<String>,
}

fn d_keep() -> usize {
    50
}

fn d_listen() -> String {
    "127.0.0.1:7471".into()
}
fn d_transport() -> String {
    "auto".into()
}
fn d_mechanism() -> String {
    "status-byte".into()
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
fn d_poll_spin() -> u64 {
    50
}
fn d_nic_spin() -> u64 {
    rdmastream::transport::DEFAULT_NIC_SPIN.as_micros() as u64
}
fn d_status() -> f64 {
    1.0
}

fn file_format(file: &Path, key: &str, s: &str) -> Result<FileFormat, ConfigError> {
    FileFormat::parse(s)
        .ok_or_else(|| ConfigError::new(file, key, format!("{s:?} is not one of raw, ppm, png")))
}

/// The bytes a tcp sender's region holds at least for the sender not to wait for syncs at full
/// rate (docs/protocol.md, "How many blocks"; docs/benchmarks.md, "At 64 KiB, the region's size").
pub const TCP_REGION_BYTES: usize = 4 << 20;

/// Over tcp, a line for the log when each sender's region (`blocks` × `block_size`) is smaller
/// than [`TCP_REGION_BYTES`], naming the setting that would reach it (`setting(n)` for `n`
/// blocks: "`blocks = 64`" in receiver.toml, "blocks=64" on rdmasrc); `None` otherwise. A hint,
/// not an error: a sender that never streams at full rate does not need more.
pub fn tcp_region_hint(
    blocks: usize,
    block_size: usize,
    setting: &dyn Fn(usize) -> String,
) -> Option<String> {
    let region = blocks.saturating_mul(block_size);
    if region >= TCP_REGION_BYTES || block_size == 0 {
        return None;
    }
    Some(format!(
        "each sender's region is {} KiB ({blocks} blocks of {block_size} bytes): over tcp a sender streaming at full rate waits for syncs below 4 MiB; {} would hold that",
        region >> 10,
        setting(TCP_REGION_BYTES.div_ceil(block_size))
    ))
}

impl ReceiverConfig {
    /// Over tcp (`tcp`), [`tcp_region_hint`] for this config's `blocks` and `block_size`.
    pub fn tcp_region_hint(&self, tcp: bool) -> Option<String> {
        if !tcp {
            return None;
        }
        tcp_region_hint(self.blocks, self.block_size, &|n| format!("`blocks = {n}`"))
    }

    /// Parses receiver.toml text (`file` names it in errors).
    pub fn parse(text: &str, file: &Path) -> Result<ReceiverConfig, ConfigError> {
        crate::cli::parse_toml(text, file)
    }

    /// Reads and parses a receiver.toml.
    pub fn load(file: &Path) -> Result<ReceiverConfig, ConfigError> {
        crate::cli::load_toml(file)
    }

    /// Checks every value and builds what the receiver runs with; `file` names the config in
    /// errors (keys are named too).
    pub fn validate(&self, file: &Path) -> Result<ReceiverPlan, ConfigError> {
        validate(self, file)
    }
}

/// What a valid receiver.toml becomes.
#[derive(Debug, Clone)]
pub struct ReceiverPlan {
    pub region: RegionSettings,
    pub options: ReceiverOptions,
    pub sink: DirectorySinkOptions,
    /// Devices whose frames go to `appsrc ! <pipeline>` instead of files.
    pub pipelines: HashMap<u8, String>,
}

fn validate(cfg: &ReceiverConfig, file: &Path) -> Result<ReceiverPlan, ConfigError> {
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
    super::check_transport(&cfg.transport, &cfg.listen, "listen")
        .map_err(|(key, why)| err(key, why))?;
    let window = super::check_mechanism(file, &cfg.mechanism)?;
    if window {
        if !cfg.reserved_blocks.is_empty() {
            return Err(err(
                "reserved_blocks",
                "reserved blocks are a status-byte feature: the sliding window writes its ring \
                 in order and would stall at the first one"
                    .into(),
            ));
        }
        rdmastream::proto::window::check_ring(rdmastream::proto::RemoteLayout {
            blocks: cfg.blocks,
            block_size: cfg.block_size,
        })
        .map_err(|why| err("blocks", why))?;
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
    // A spin is a busy wait (the polling thread's, the tcp NIC thread's): bounded, so a typo
    // cannot burn a core.
    for (key, us) in [
        ("poll_spin_us", cfg.poll_spin_us),
        ("tcp_nic_spin_us", cfg.tcp_nic_spin_us),
    ] {
        if us > 100_000 {
            return Err(err(key, format!("{us} is not in 0..=100000")));
        }
    }
    if cfg.writers == 0 || cfg.writers > 64 {
        return Err(err("writers", format!("{} is not in 1..=64", cfg.writers)));
    }
    if cfg.status_interval.is_nan() || cfg.status_interval <= 0.0 {
        return Err(err("status_interval", "must be > 0 seconds".into()));
    }
    super::check_metrics(file, cfg.metrics.as_deref())?;
    super::seconds_within(cfg.peer_timeout, 0.2..=3600.0)
        .map_err(|why| err("peer_timeout", why))?;
    super::seconds_within(cfg.sender_gone_after, 0.0..=86400.0)
        .map_err(|why| err("sender_gone_after", why))?;
    if cfg.max_senders == 0 || cfg.max_senders > 4096 {
        return Err(err(
            "max_senders",
            format!("{} is not in 1..=4096", cfg.max_senders),
        ));
    }
    if cfg.max_frame_bytes.0 == 0 || cfg.max_frame_bytes.0 > u32::MAX as u64 {
        return Err(err(
            "max_frame_bytes",
            format!("{} is not in 1 B..=4 GiB", cfg.max_frame_bytes),
        ));
    }
    let reassembly =
        RegionSettings::reassembly_for(cfg.blocks, cfg.block_size, cfg.max_frame_bytes.0 as usize);
    let per_sender = RegionSettings::budget_need(cfg.blocks, cfg.block_size, reassembly) as u64;
    if cfg.memory_budget.0 < per_sender {
        return Err(err(
            "memory_budget",
            format!(
                "{} is less than what one sender takes ({}: its region of {} blocks of {} \
                 bytes, and as much again plus 2 x max_frame_bytes for reassembly)",
                cfg.memory_budget,
                ByteSize(per_sender),
                cfg.blocks,
                cfg.block_size,
            ),
        ));
    }
    if crate::cli::unix_socket(&cfg.listen).is_none()
        && let Err(e) = std::net::ToSocketAddrs::to_socket_addrs(cfg.listen.as_str())
    {
        return Err(err(
            "listen",
            format!(
                "{:?} is not an address:port (or unix:/path) to listen on ({e})",
                cfg.listen
            ),
        ));
    }
    let keys = receiver_keys(cfg, file)?;
    if keys.is_anonymous() && !cfg.allow_anonymous && !is_loopback(&cfg.listen) {
        return Err(err(
            "listen",
            format!(
                "{} is not a loopback address and no sender keys are configured, so anyone who \
                 can reach it could stream here. Add a [[sender]] entry with name and key_file \
                 for each sender (make a key with `openssl rand -hex 32 > edge-1.key`), or set \
                 allow_anonymous = true to accept anyone",
                cfg.listen
            ),
        ));
    }
    let budget = Budget::new(usize::try_from(cfg.memory_budget.0).unwrap_or(usize::MAX));
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
        if let Some(p) = &d.pipeline
            && p.contains("location")
            && !p.contains("{session}")
        {
            return Err(err(
                &format!("device[{n}].pipeline"),
                "put {session} into the file name (e.g. location=dev{device}-{sender}-{session}.mp4) \
                 so that a later stream of this device does not replace an earlier one's file"
                    .into(),
            ));
        }
        devices.insert(
            d.id as u8,
            DeviceOutput {
                format,
                keep: d.keep.map_or(default.keep, keep),
            },
        );
    }
    let pipelines = cfg
        .device
        .iter()
        .filter_map(|d| Some((d.id as u8, d.pipeline.clone()?)))
        .collect();
    Ok(ReceiverPlan {
        region: RegionSettings {
            blocks: cfg.blocks,
            block_size: cfg.block_size,
            reserved_blocks: cfg.reserved_blocks.clone(),
            access: AccessControl::new(keys, cfg.max_senders, budget.clone()),
            reassembly,
            peer_timeout: Duration::from_secs_f64(cfg.peer_timeout),
            nic_spin: Duration::from_micros(cfg.tcp_nic_spin_us),
            mechanism: if cfg.mechanism == "sliding-window" {
                // The receiver's side of every device's connection; the device is the sender's.
                rdmastream::proto::handshake::Mechanism::SlidingWindow { device: 0 }
            } else {
                rdmastream::proto::handshake::Mechanism::StatusByte
            },
        },
        options: ReceiverOptions {
            max_device: cfg.max_device as u8,
            reorder: ReorderConfig {
                window: cfg.reorder_window as u16,
                timeout: Duration::from_millis(cfg.reorder_timeout_ms),
            },
            limits: Limits {
                budget,
                max_message: cfg.max_frame_bytes.0 as usize,
            },
            poll_min: Duration::from_micros(cfg.poll_min_us),
            poll_max: Duration::from_micros(cfg.poll_max_us),
            poll_spin: Duration::from_micros(cfg.poll_spin_us),
            gone_after: Duration::from_secs_f64(cfg.sender_gone_after),
        },
        sink: DirectorySinkOptions {
            out: cfg.out.clone(),
            default,
            devices,
            verify: false,
            writers: cfg.writers,
            queue: cfg.writer_queue,
            disk_budget: (cfg.disk_budget.0 > 0).then_some(cfg.disk_budget.0),
        },
        pipelines,
    })
}

/// The keys of `[[sender]]` entries and the shared `key`/`key_file`.
fn receiver_keys(cfg: &ReceiverConfig, file: &Path) -> Result<Keys, ConfigError> {
    let mut keys = match load_key(file, "", cfg.key.as_deref(), cfg.key_file.as_deref())? {
        Some(k) => Keys::shared(k),
        None => Keys::anonymous(),
    };
    let mut seen = std::collections::BTreeSet::new();
    for (n, s) in cfg.sender.iter().enumerate() {
        let what = format!("sender[{n}].");
        if !rdmastream::proto::handshake::valid_sender_name(&s.name) {
            return Err(ConfigError::new(
                file,
                format!("{what}name"),
                format!("{:?} is not 1-64 characters of A-Z a-z 0-9 . _ -", s.name),
            ));
        }
        if !seen.insert(s.name.clone()) {
            return Err(ConfigError::new(
                file,
                format!("{what}name"),
                format!("sender {:?} is listed twice", s.name),
            ));
        }
        match load_key(file, &what, s.key.as_deref(), s.key_file.as_deref())? {
            Some(k) => keys = keys.with_sender(s.name.clone(), k),
            None => {
                return Err(ConfigError::new(
                    file,
                    format!("{what}key_file"),
                    "each [[sender]] needs `key_file` (or `key`)",
                ));
            }
        }
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The defaults (which the shipped configs/receiver.toml states) give `max_senders` senders
    /// room in `memory_budget`, and not one more: while the budget counted each region's status
    /// bytes, 16 senders needed 256 bytes more than 1 GiB and the 16th was refused.
    #[test]
    fn the_default_budget_admits_max_senders_senders_and_no_more() {
        let file = Path::new("r.toml");
        let cfg = ReceiverConfig::parse("", file).unwrap();
        let plan = cfg.validate(file).unwrap();
        let held: Vec<_> = (1..=cfg.max_senders)
            .map(|n| {
                plan.region
                    .reserve_region()
                    .unwrap_or_else(|(_, why)| panic!("sender {n} of {}: {why}", cfg.max_senders))
            })
            .collect();
        let (kind, _) = plan
            .region
            .reserve_region()
            .expect_err("one sender too many fits");
        assert_eq!(kind, rdmastream::transport::RefusalKind::MemoryBudget);
        drop(held);
        assert!(
            plan.region.reserve_region().is_ok(),
            "the memory comes back"
        );
    }

    /// Over tcp a region under 4 MiB gets a hint naming the `blocks` that would hold 4 MiB;
    /// 4 MiB or more, or another transport, none.
    #[test]
    fn a_small_tcp_region_gets_a_hint() {
        let file = Path::new("r.toml");
        let cfg = |text: &str| ReceiverConfig::parse(text, file).unwrap();
        let small = cfg("blocks = 16\nblock_size = 65536\n");
        let hint = small
            .tcp_region_hint(true)
            .expect("1 MiB over tcp gets a hint");
        assert!(
            hint.contains("1024 KiB") && hint.contains("`blocks = 64`"),
            "{hint}"
        );
        assert_eq!(small.tcp_region_hint(false), None, "only over tcp");
        assert_eq!(
            cfg("blocks = 64\nblock_size = 65536\n").tcp_region_hint(true),
            None
        );
        // The shipped default, 16 blocks of 1 MiB.
        assert_eq!(cfg("").tcp_region_hint(true), None);
        let odd = cfg("blocks = 4\nblock_size = 100000\n")
            .tcp_region_hint(true)
            .unwrap();
        assert!(odd.contains("`blocks = 42`"), "{odd}");
        // rdmasrc names its property.
        let element = tcp_region_hint(16, 65536, &|n| format!("blocks={n}")).unwrap();
        assert!(element.contains("blocks=64"), "{element}");
        assert_eq!(tcp_region_hint(16, 1 << 20, &|n| n.to_string()), None);
        assert_eq!(tcp_region_hint(16, 0, &|n| n.to_string()), None);
    }
}
