//! Small pieces both binaries need: loading a TOML config with errors that name the file and
//! key, logging set-up, and the once-per-second status line.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A config problem: which file, which key, why. Binaries exit with code 2 on it.
#[derive(Debug)]
pub struct ConfigError {
    pub file: PathBuf,
    pub key: String,
    pub reason: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.key.is_empty() {
            write!(f, "{}: {}", self.file.display(), self.reason)
        } else {
            write!(
                f,
                "{}: key `{}`: {}",
                self.file.display(),
                self.key,
                self.reason
            )
        }
    }
}

impl std::error::Error for ConfigError {}

impl ConfigError {
    /// A problem with `key` in `file`.
    pub fn new(file: &Path, key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
        ConfigError {
            file: file.to_path_buf(),
            key: key.into(),
            reason: reason.into(),
        }
    }
}

/// Reads and deserializes a TOML file. Unknown keys are errors (the config structs deny them).
pub fn load_toml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::new(path, "", format!("cannot read: {e}")))?;
    toml::from_str(&text).map_err(|e| {
        let line = e.span().map(|s| text[..s.start].lines().count().max(1));
        let reason = e.message().to_string();
        let key = reason.split('`').nth(1).unwrap_or("").to_string();
        let reason = match line {
            Some(l) => format!("line {l}: {reason}"),
            None => reason,
        };
        ConfigError {
            file: path.to_path_buf(),
            key: if reason.contains("unknown field") {
                key
            } else {
                String::new()
            },
            reason,
        }
    })
}

/// The shipped example config `name` (in `configs/`): found relative to the current directory,
/// else next to the source tree this binary was built from.
pub fn default_config(name: &str) -> PathBuf {
    let local = Path::new("configs").join(name);
    if local.exists() {
        return local;
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("configs")
        .join(name)
}

/// Logs to stderr, honouring RUST_LOG (default `info`).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

/// Calls `tick` every `interval` until `stop` is set or `tick` returns false. Returns when it
/// stopped.
pub fn every(interval: Duration, stop: &AtomicBool, mut tick: impl FnMut(Duration) -> bool) {
    let mut last = Instant::now();
    let mut next = last + interval;
    while !stop.load(Ordering::Acquire) {
        let now = Instant::now();
        if now >= next {
            if !tick(now - last) {
                return;
            }
            last = now;
            next = now + interval;
        }
        std::thread::sleep(
            (next.saturating_duration_since(Instant::now())).min(Duration::from_millis(20)),
        );
    }
}
