//! sender.toml: the sender's config file as data, its defaults, and its validation into the
//! devices the sender runs. Every key is documented in the shipped configs/sender.toml.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::cli::ConfigError;
use crate::source::SourceKind;
use rdmastream::engine::DropPolicy;

/// sender.toml; every key is documented in configs/sender.toml.
#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct SenderConfig {
    /// Required, from the file or `--name` (empty: not given; `validate` says so).
    #[serde(default)]
    pub name: String,
    /// Required, from the file or `--receiver` (empty: not given; `validate` says so).
    #[serde(default)]
    pub receiver: String,
    #[serde(default = "d_transport")]
    pub transport: String,
    #[serde(default = "d_mechanism")]
    pub mechanism: String,
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    #[serde(default = "d_send_blocks")]
    pub send_blocks: usize,
    /// Send blocks for frames the sources write in place (rendered or copied on their own
    /// threads), on top of `send_blocks`; `None`: as many as `send_blocks` when a source's frames
    /// may fit one block, else 0.
    #[serde(default)]
    pub in_place_blocks: Option<usize>,
    #[serde(default = "d_block_size")]
    pub block_size: usize,
    #[serde(default = "d_outstanding")]
    pub max_outstanding: usize,
    #[serde(default = "d_queue")]
    pub queue_depth: usize,
    #[serde(default = "d_status")]
    pub status_interval: f64,
    /// `address:port` to serve /metrics, /healthz, /readyz (and the receiver's status page)
    /// on; `None`: no HTTP server.
    #[serde(default)]
    pub metrics: Option<String>,
    #[serde(default = "d_peer_timeout")]
    pub peer_timeout: f64,
    #[serde(default = "d_shutdown_grace")]
    pub shutdown_grace: f64,
    #[serde(default)]
    pub first_packet: u16,
    /// Microseconds a small lossy message may wait for others to share its block (0: off).
    #[serde(default = "d_coalesce_wait_us")]
    pub coalesce_wait_us: u64,
    /// Over shm: `"auto"` (an eighth of this host's last-level cache), `"off"`, or a byte count
    /// such as `"8 MiB"` ([`SenderConfig::shm_cache_budget`]).
    #[serde(default = "d_shm_cache_budget")]
    pub shm_cache_budget: String,
    #[serde(default)]
    pub rdma_device: Option<String>,
    #[serde(default = "d_port")]
    pub ib_port: u8,
    #[serde(default)]
    pub gid_index: Option<u32>,
    #[serde(default)]
    pub device: Vec<SenderDeviceConfig>,
}

fn d_port() -> u8 {
    1
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct SenderDeviceConfig {
    pub id: u32,
    #[serde(default = "d_count")]
    pub count: u32,
    pub source: String,
    pub width: Option<u32>,
    pub height: Option<u32>,
    pub fps: Option<f64>,
    pub size: Option<usize>,
    pub rate: Option<f64>,
    pub dir: Option<PathBuf>,
    /// source = "gstreamer": a launch string ending in appsink.
    pub pipeline: Option<String>,
    #[serde(default = "d_policy")]
    pub policy: String,
    /// Built-in sources: end the device after this many frames (default: run until stopped).
    pub frames: Option<u64>,
    /// Built-in sources: `"together"` (default: the `count` devices' frames fall due at the
    /// same moments) or `"spread"` (device k of the entry starts k/count of a period late, as
    /// independent cameras would).
    #[serde(default = "d_start")]
    pub start: String,
}

fn d_transport() -> String {
    "auto".into()
}
fn d_mechanism() -> String {
    "status-byte".into()
}
fn d_send_blocks() -> usize {
    8
}
fn d_block_size() -> usize {
    1 << 20
}
fn d_coalesce_wait_us() -> u64 {
    100
}
fn d_shm_cache_budget() -> String {
    "auto".into()
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
fn d_peer_timeout() -> f64 {
    5.0
}
fn d_shutdown_grace() -> f64 {
    5.0
}
fn d_count() -> u32 {
    1
}
fn d_policy() -> String {
    "drop-oldest".into()
}
fn d_start() -> String {
    "together".into()
}

/// Where a device's frames come from.
#[derive(Clone)]
pub enum Source {
    Builtin(SourceKind),
    /// A GStreamer launch string ending in appsink (`crate::gst::LaunchSource`).
    Gstreamer(String),
}

pub struct Device {
    pub id: u8,
    /// Which `[[device]]` entry of the file it came from (0-based): errors about its source
    /// name the key, `device[entry].dir`.
    pub entry: usize,
    pub kind: Source,
    pub policy: DropPolicy,
    pub frames: Option<u64>,
    /// How long after the others of its entry a built-in source starts its schedule
    /// (`start = "spread"`); zero otherwise.
    pub start_after: Duration,
}

impl SenderConfig {
    /// Parses sender.toml text (`file` names it in errors).
    pub fn parse(text: &str, file: &Path) -> Result<SenderConfig, ConfigError> {
        crate::cli::parse_toml(text, file)
    }

    /// Reads and parses a sender.toml.
    pub fn load(file: &Path) -> Result<SenderConfig, ConfigError> {
        crate::cli::load_toml(file)
    }

    /// Checks every value and lists the devices to run; `file` names the config in errors.
    pub fn validate(&self, file: &Path) -> Result<Vec<Device>, ConfigError> {
        validate(self, file)
    }

    /// `shm_cache_budget` as the shm connector takes it: the bytes of the receiver's region the
    /// sender keeps FULL at most (`auto`: [`rdmastream::transport::shm_cache_budget`], an eighth
    /// of this host's last-level cache), or `None` for `off` (every block may be FULL). The
    /// budget keeps an unthrottled stream's working set in the cache both ends share; a burst of
    /// frames that fall due together waits for it (docs/benchmarks.md, "The working set on one host").
    pub fn shm_cache_budget(&self, file: &Path) -> Result<Option<usize>, ConfigError> {
        let text = self.shm_cache_budget.trim();
        match text {
            "auto" => Ok(Some(rdmastream::transport::shm_cache_budget())),
            "off" => Ok(None),
            _ => {
                let bytes = crate::cli::ByteSize::parse(text).map_err(|e| {
                    ConfigError::new(
                        file,
                        "shm_cache_budget",
                        format!("{e}; or \"auto\", or \"off\""),
                    )
                })?;
                if bytes.0 == 0 {
                    return Err(ConfigError::new(
                        file,
                        "shm_cache_budget",
                        "0 bytes would let no block be FULL; \"off\" means no limit",
                    ));
                }
                Ok(Some(usize::try_from(bytes.0).unwrap_or(usize::MAX)))
            }
        }
    }
}

fn validate(cfg: &SenderConfig, file: &Path) -> Result<Vec<Device>, ConfigError> {
    let err = |key: &str, reason: String| ConfigError::new(file, key, reason);
    // Not required by the parser: a file may leave them to `--name` and `--receiver`.
    if cfg.name.is_empty() {
        return Err(err(
            "name",
            "missing: this sender's name, as the receiver knows it (name = \"edge-1\" in the \
             file, or --name edge-1)"
                .into(),
        ));
    }
    if cfg.receiver.is_empty() {
        return Err(err(
            "receiver",
            "missing: the receiver's host:port, or unix:/path on this host (receiver = \
             \"10.0.0.2:7471\" in the file, or --receiver 10.0.0.2:7471)"
                .into(),
        ));
    }
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
    if let Some(n) = cfg.in_place_blocks
        && n > 4096
    {
        return Err(err("in_place_blocks", format!("{n} is not in 0..=4096")));
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
    if cfg.coalesce_wait_us > 100_000 {
        return Err(err(
            "coalesce_wait_us",
            format!("{} is not in 0..=100000", cfg.coalesce_wait_us),
        ));
    }
    if cfg.queue_depth == 0 {
        return Err(err("queue_depth", "must be at least 1".into()));
    }
    cfg.shm_cache_budget(file)?;
    if cfg.status_interval.is_nan() || cfg.status_interval <= 0.0 {
        return Err(err("status_interval", "must be > 0 seconds".into()));
    }
    super::check_metrics(file, cfg.metrics.as_deref())?;
    super::seconds_within(cfg.peer_timeout, 0.2..=3600.0)
        .map_err(|why| err("peer_timeout", why))?;
    super::seconds_within(cfg.shutdown_grace, 0.0..=3600.0)
        .map_err(|why| err("shutdown_grace", why))?;
    if cfg.ib_port == 0 {
        return Err(err("ib_port", "ports are numbered from 1".into()));
    }
    super::check_transport(&cfg.transport, &cfg.receiver, "receiver")
        .map_err(|(key, why)| err(key, why))?;
    super::check_mechanism(file, &cfg.mechanism)?;
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
                // A relative directory: from the current directory, else from the config
                // file's directory or its parent (the shipped configs/ sits beside assets/).
                let dir = if dir.is_relative() && !dir.exists() {
                    let base = file.parent().unwrap_or(Path::new("."));
                    [base.join(&dir), base.join("..").join(&dir)]
                        .into_iter()
                        .find(|d| d.is_dir())
                        .unwrap_or(dir)
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
        // The schedule's period of a built-in source, for `start = "spread"`.
        let period = match &kind {
            Source::Builtin(
                SourceKind::CameraSynthetic { fps, .. } | SourceKind::Images { fps, .. },
            ) => Some(1.0 / fps),
            Source::Builtin(SourceKind::RadarSynthetic { rate, .. }) => Some(1.0 / rate),
            Source::Gstreamer(_) => None,
        };
        let spread = match (d.start.as_str(), period) {
            ("together", _) => None,
            ("spread", Some(period)) => Some(period),
            ("spread", None) => {
                return Err(err(
                    &key("start"),
                    "source \"gstreamer\" is paced by its pipeline: \"spread\" is for the built-in sources".into(),
                ));
            }
            (other, _) => {
                return Err(err(
                    &key("start"),
                    format!("{other:?} is not one of together, spread"),
                ));
            }
        };
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
        for (k, id) in (d.id..d.id + d.count).enumerate() {
            if !seen.insert(id) {
                return Err(err(&key("id"), format!("device {id} is configured twice")));
            }
            devices.push(Device {
                id: id as u8,
                entry: n,
                kind: kind.clone(),
                policy,
                frames: d.frames,
                start_after: spread.map_or(Duration::ZERO, |period| {
                    Duration::from_secs_f64(period * k as f64 / d.count as f64)
                }),
            });
        }
    }
    if devices.is_empty() {
        return Err(err("device", "no devices configured".into()));
    }
    Ok(devices)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(value: &str) -> Result<Option<usize>, ConfigError> {
        let cfg = SenderConfig::parse(
            &format!("name = \"a\"\nreceiver = \"unix:/x\"\nshm_cache_budget = \"{value}\"\n"),
            Path::new("s.toml"),
        )
        .unwrap();
        cfg.shm_cache_budget(Path::new("s.toml"))
    }

    #[test]
    fn the_shm_cache_budget_is_auto_off_or_a_byte_count() {
        let auto = Some(rdmastream::transport::shm_cache_budget());
        assert_eq!(budget("auto").unwrap(), auto);
        let default = SenderConfig::parse(
            "name = \"a\"\nreceiver = \"unix:/x\"\n",
            Path::new("s.toml"),
        )
        .unwrap();
        assert_eq!(default.shm_cache_budget(Path::new("s.toml")).unwrap(), auto);
        assert_eq!(budget("off").unwrap(), None);
        assert_eq!(budget("8 MiB").unwrap(), Some(8 << 20));
        for bad in ["0", "lots", "-1 MiB"] {
            let e = budget(bad).unwrap_err().to_string();
            assert!(
                e.contains("s.toml") && e.contains("shm_cache_budget"),
                "{bad}: {e}"
            );
        }
    }

    /// A file may leave `name` and `receiver` to `--name` and `--receiver`: it parses, and
    /// only validation (after the flags were applied) asks for them, by key.
    #[test]
    fn name_and_receiver_may_come_from_the_flags() {
        let file = Path::new("s.toml");
        let text = "[[device]]\nid = 1\nsource = \"radar-synthetic\"\n";
        let mut cfg = SenderConfig::parse(text, file).unwrap();
        let e = cfg.validate(file).err().unwrap().to_string();
        assert!(e.contains("s.toml") && e.contains("`name`: missing"), "{e}");
        cfg.name = "edge-1".into();
        let e = cfg.validate(file).err().unwrap().to_string();
        assert!(e.contains("`receiver`: missing"), "{e}");
        cfg.receiver = "127.0.0.1:7471".into();
        assert_eq!(cfg.validate(file).unwrap().len(), 1);
    }

    fn devices(entry: &str) -> Result<Vec<Device>, ConfigError> {
        let file = Path::new("s.toml");
        SenderConfig::parse(
            &format!("name = \"a\"\nreceiver = \"unix:/x\"\n[[device]]\nid = 4\n{entry}"),
            file,
        )
        .unwrap()
        .validate(file)
    }

    /// `start = "spread"` starts device k of an entry k/count of a period late; `together`
    /// (the default) starts them all at once.
    #[test]
    fn spread_devices_start_a_fraction_of_a_period_apart() {
        let starts = |entry: &str| -> Vec<Duration> {
            devices(entry)
                .unwrap()
                .iter()
                .map(|d| d.start_after)
                .collect()
        };
        let ms =
            |v: &[u64]| -> Vec<Duration> { v.iter().map(|&m| Duration::from_millis(m)).collect() };
        let cameras = "count = 4\nsource = \"camera-synthetic\"\nfps = 25\n";
        assert_eq!(starts(cameras), ms(&[0, 0, 0, 0]));
        assert_eq!(
            starts(&format!("{cameras}start = \"together\"\n")),
            ms(&[0, 0, 0, 0])
        );
        assert_eq!(
            starts(&format!("{cameras}start = \"spread\"\n")),
            ms(&[0, 10, 20, 30])
        );
        assert_eq!(
            starts("count = 2\nsource = \"radar-synthetic\"\nrate = 20\nstart = \"spread\"\n"),
            ms(&[0, 25])
        );
        let bad = |entry: &str| {
            let e = devices(entry).map(|_| ()).unwrap_err();
            assert_eq!(e.key, "device[0].start", "{e}");
            e.to_string()
        };
        let e = bad(&format!("{cameras}start = \"staggered\"\n"));
        assert!(
            e.contains("s.toml") && e.contains("together, spread"),
            "{e}"
        );
        let e = bad(
            "source = \"gstreamer\"\npipeline = \"videotestsrc ! appsink\"\nstart = \"spread\"\n",
        );
        assert!(e.contains("paced by its pipeline"), "{e}");
    }
}
