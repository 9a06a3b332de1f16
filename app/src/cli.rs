//! Small pieces both binaries need: loading a TOML config with errors that name the file and
//! key, logging set-up, the status-line clock and the SIGUSR1 request for the per-device table.

use std::path::{Path, PathBuf};
use std::sync::Arc;
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

    /// Names the command-line flag instead of the file when the problem is with a key a flag
    /// overrode: `flags` lists config keys, their flags and whether each was given
    /// (`("listen", "--listen", true)`).
    pub fn blame(self, flags: &[(&str, &str, bool)]) -> ConfigError {
        match flags
            .iter()
            .find(|(key, _, given)| *given && *key == self.key)
        {
            Some((_, flag, _)) => ConfigError {
                file: PathBuf::from(*flag),
                key: String::new(),
                reason: self.reason,
            },
            None => self,
        }
    }
}

/// Reads and deserializes a TOML file. Unknown keys are errors (the config structs deny them).
pub fn load_toml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::new(path, "", format!("cannot read: {e}")))?;
    parse_toml(&text, path)
}

/// Deserializes TOML `text` read from `path` (named in errors).
pub fn parse_toml<T: serde::de::DeserializeOwned>(
    text: &str,
    path: &Path,
) -> Result<T, ConfigError> {
    toml::from_str(text).map_err(|e| {
        let at = e.span().map(|s| s.start.min(text.len()));
        let reason = e.message().to_string();
        let field = reason.split('`').nth(1).unwrap_or("");
        // An unknown or missing field is named with the table it is in (`device[1].id`).
        let key = if reason.starts_with("unknown field") || reason.starts_with("missing field") {
            match at.map(|at| table_at(text, at)).unwrap_or_default() {
                table if table.is_empty() => field.to_string(),
                table => format!("{table}.{field}"),
            }
        } else {
            String::new()
        };
        let reason = match at {
            Some(at) => format!("line {}: {reason}", line_of(text, at)),
            None => reason,
        };
        ConfigError {
            file: path.to_path_buf(),
            key,
            reason,
        }
    })
}

/// The 1-based line of byte `at` of `text` (a byte offset, so no char boundary is needed).
fn line_of(text: &str, at: usize) -> usize {
    text.as_bytes()[..at]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// The table that the line holding byte `at` of `text` opens or lies in, as a key path:
/// `device[1]` for the second `[[device]]`, `metrics` for `[metrics]`, empty at the top level.
fn table_at(text: &str, at: usize) -> String {
    let end = text.as_bytes()[at..]
        .iter()
        .position(|&b| b == b'\n')
        .map_or(text.len(), |n| at + n);
    let mut table = String::new();
    let mut seen: std::collections::HashMap<String, usize> = Default::default();
    // `end` is a newline's offset or the end of `text`: a char boundary.
    for line in text[..end].lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if let Some(name) = line.strip_prefix("[[").and_then(|l| l.strip_suffix("]]")) {
            let name = name.trim().to_string();
            let n = seen.entry(name.clone()).or_insert(0);
            table = format!("{name}[{n}]");
            *n += 1;
        } else if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            table = name.trim().to_string();
        }
    }
    table
}

/// The config file to use when none is given: `configs/NAME` in the current directory, else
/// next to the executable (`<exe dir>/NAME`, an installed `<exe dir>/../share/rdmastream/NAME`, or
/// the source tree's `configs/` for a binary in `target/<profile>/`). Looked up at run time, so a
/// copied binary does not depend on where it was built; `None` when there is none (the binary
/// then runs on its built-in defaults and says so).
pub fn default_config(name: &str) -> Option<PathBuf> {
    let mut candidates = vec![Path::new("configs").join(name)];
    if let Some(dir) = std::env::current_exe().ok().and_then(|e| {
        e.canonicalize()
            .ok()
            .and_then(|e| e.parent().map(Path::to_path_buf))
    }) {
        candidates.push(dir.join(name));
        candidates.push(dir.join("../share/rdmastream").join(name));
        candidates.push(dir.join("../../configs").join(name));
    }
    candidates.into_iter().find(|p| p.is_file())
}

/// Loads the config file `given` (from `--config`), else [`default_config`]`(name)`, else the
/// built-in defaults `builtin` (TOML text; the binary's documented example), with a notice;
/// returns the file that errors should name.
pub fn load_config<T: serde::de::DeserializeOwned>(
    given: Option<PathBuf>,
    name: &str,
    builtin: &str,
) -> Result<(PathBuf, T), ConfigError> {
    match given.or_else(|| default_config(name)) {
        Some(file) => {
            let cfg = load_toml(&file)?;
            Ok((file, cfg))
        }
        None => {
            tracing::info!(
                "no --config and no configs/{name} here or next to the executable: \
                 built-in defaults (those of the shipped configs/{name})"
            );
            let file = PathBuf::from(format!("(built-in defaults for {name})"));
            let cfg = parse_toml(builtin, &file)?;
            Ok((file, cfg))
        }
    }
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

/// The binaries' stop (Ctrl-C, `--duration`, a sender whose link gave up): a flag the sources
/// look at between frames, and a condition variable the main thread sleeps on between status
/// lines, so it wakes when a stop is asked for instead of looking every few milliseconds (an
/// idle receiver's main thread woke 50 times a second for that).
#[derive(Clone, Default)]
pub struct Stop {
    flag: Arc<AtomicBool>,
    /// Something the main thread waits for happened (a sender's source ended): [`every`] ticks
    /// at once instead of at the end of its interval.
    rung: Arc<AtomicBool>,
    bell: Arc<(parking_lot::Mutex<()>, parking_lot::Condvar)>,
}

impl Stop {
    pub fn new() -> Stop {
        Stop::default()
    }

    /// Asks for the stop and wakes [`Stop::sleep`]; returns whether it had been asked already.
    pub fn ask(&self) -> bool {
        let was = self.flag.swap(true, Ordering::AcqRel);
        // Under the lock: a sleeper that saw the flag clear is already waiting, and is woken.
        let _held = self.bell.0.lock();
        self.bell.1.notify_all();
        was
    }

    pub fn is_asked(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// The flag itself, for sources that take an `AtomicBool`.
    pub fn flag(&self) -> &Arc<AtomicBool> {
        &self.flag
    }

    /// Wakes [`Stop::sleep`] without asking for the stop, so that [`every`] ticks now (a
    /// finite source ended: the sender need not wait out its status interval to see it).
    pub fn ring(&self) {
        self.rung.store(true, Ordering::Release);
        let _held = self.bell.0.lock();
        self.bell.1.notify_all();
    }

    /// Sleeps for `d`, or until the stop is asked for or [`Stop::ring`] rings, if that comes
    /// first.
    pub fn sleep(&self, d: Duration) {
        let mut held = self.bell.0.lock();
        self.bell.1.wait_while_for(
            &mut held,
            |_| !self.is_asked() && !self.rung.load(Ordering::Acquire),
            d,
        );
    }
}

/// Calls `tick` every `interval` until `stop` is asked for or `tick` returns false, sleeping in
/// between (a stop ends the sleep at once; a [`Stop::ring`] makes the next tick come now).
/// Returns when it stopped.
pub fn every(interval: Duration, stop: &Stop, tick: impl FnMut(Duration) -> bool) {
    every_until(interval, None, stop, tick)
}

/// [`every`], with one extra tick at `moment` if it comes between two (the sender's
/// `--duration` deadline, kept to the moment instead of to the next status line: with
/// `status_interval = 10` a `--duration 1` run stopped after 10 s).
pub fn every_until(
    interval: Duration,
    mut moment: Option<Instant>,
    stop: &Stop,
    mut tick: impl FnMut(Duration) -> bool,
) {
    let mut last = Instant::now();
    let mut next = last + interval;
    while !stop.is_asked() {
        let now = Instant::now();
        let at_moment = moment.is_some_and(|m| now >= m);
        if now >= next || at_moment || stop.rung.swap(false, Ordering::AcqRel) {
            if at_moment {
                moment = None;
            }
            if !tick(now - last) {
                return;
            }
            last = now;
            next = now + interval;
        }
        let wake = moment.map_or(next, |m| m.min(next));
        stop.sleep(wake.saturating_duration_since(Instant::now()));
    }
}

/// A flag that SIGUSR1 sets: the binaries print their per-device table when they find it set
/// (and clear it).
pub fn table_requests() -> Result<Arc<AtomicBool>, crate::Error> {
    let flag = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGUSR1, flag.clone()).map_err(|source| {
        crate::Error::Io {
            what: "installing the SIGUSR1 handler".into(),
            source,
        }
    })?;
    Ok(flag)
}

/// A byte count in a config file: an integer, or a string with a unit (`"64 MiB"`, `"8 GiB"`,
/// `"1.5 GB"`; KiB/MiB/GiB/TiB are powers of 1024, kB/MB/GB/TB of 1000).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Parses `"<number> [unit]"`.
    pub fn parse(text: &str) -> Result<ByteSize, String> {
        let t = text.trim();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = (t[..split].trim(), t[split..].trim());
        let n: f64 = num
            .parse()
            .map_err(|_| format!("{text:?} is not a byte count like 64 MiB"))?;
        let mult: f64 = match unit {
            "" | "B" | "b" => 1.0,
            "KiB" | "K" | "k" => 1024.0,
            "MiB" | "M" => 1024.0 * 1024.0,
            "GiB" | "G" => 1024.0 * 1024.0 * 1024.0,
            "TiB" | "T" => 1024.0f64.powi(4),
            "kB" | "KB" => 1e3,
            "MB" => 1e6,
            "GB" => 1e9,
            "TB" => 1e12,
            other => {
                return Err(format!(
                    "unknown unit {other:?} in {text:?} (use B, KiB, MiB, GiB, TiB, kB, MB, GB, TB)"
                ));
            }
        };
        let v = n * mult;
        if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 {
            return Err(format!("{text:?} is out of range"));
        }
        Ok(ByteSize(v.round() as u64))
    }
}

impl std::fmt::Display for ByteSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = self.0;
        for (unit, size) in [
            ("TiB", 1u64 << 40),
            ("GiB", 1 << 30),
            ("MiB", 1 << 20),
            ("KiB", 1 << 10),
        ] {
            if b >= size && b.is_multiple_of(size) {
                return write!(f, "{} {unit}", b / size);
            }
            if b >= size {
                return write!(f, "{:.1} {unit}", b as f64 / size as f64);
            }
        }
        write!(f, "{b} B")
    }
}

impl<'de> serde::Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a byte count: an integer or a string like \"64 MiB\"")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("{v} is negative")))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ByteSize, E> {
                ByteSize::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A key given inline (`key`) or in a file (`key_file`, relative to the config file's
/// directory), checked and read. `what` names the config table for messages (`""` for the top
/// level, `"sender[2]."` for an entry).
pub fn load_key(
    file: &Path,
    what: &str,
    key: Option<&str>,
    key_file: Option<&Path>,
) -> Result<Option<rdmastream::proto::handshake::Key>, ConfigError> {
    use rdmastream::proto::handshake::Key;
    match (key, key_file) {
        (Some(_), Some(_)) => Err(ConfigError::new(
            file,
            format!("{what}key"),
            "give `key` or `key_file`, not both",
        )),
        (Some(k), None) => Key::new(k.trim().as_bytes().to_vec())
            .map(Some)
            .map_err(|e| ConfigError::new(file, format!("{what}key"), e)),
        (None, Some(p)) => {
            let path = if p.is_relative() {
                file.parent().unwrap_or(Path::new(".")).join(p)
            } else {
                p.to_path_buf()
            };
            read_key_file(&path)
                .map(Some)
                .map_err(|e| ConfigError::new(file, format!("{what}key_file"), e))
        }
        (None, None) => Ok(None),
    }
}

/// Reads a key file: its content without surrounding whitespace. Reads at most a few KiB, so a
/// key file pointing at a device or a huge file is an error, not an unbounded read; `Err` names
/// the path and says why.
pub fn read_key_file(path: &Path) -> Result<rdmastream::proto::handshake::Key, String> {
    use rdmastream::proto::handshake::{Key, MAX_KEY_LEN};
    use std::io::Read;
    // Room for the longest key as hex with whitespace around it.
    let limit = 2 * MAX_KEY_LEN + 1024;
    let mut text = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(limit as u64 + 1).read_to_end(&mut text))
        .map_err(|e| format!("cannot read {}: {}", path.display(), describe_error(&e)))?;
    if text.len() > limit {
        return Err(format!(
            "{}: longer than {limit} bytes, not a key file",
            path.display()
        ));
    }
    Key::new(text.trim_ascii().to_vec()).map_err(|e| format!("{}: {e}", path.display()))
}

/// Splits a `host:port` address into its host (an IPv6 address without its brackets) and its
/// port, or says, in a phrase the caller puts after the address, what is wrong with it. Both the
/// binaries' config check and the elements' `rdma://HOST:PORT` URIs use it, so the two accept
/// the same addresses: a name, an IPv4 address or a bracketed IPv6 one (RFC 3986), and a port
/// 1–65535. Whether a name resolves is left to the connection.
pub fn split_host_port(addr: &str) -> Result<(&str, u16), String> {
    let (host, port) = if let Some(v6) = addr.strip_prefix('[') {
        let (host, after) = v6
            .split_once(']')
            .ok_or("an IPv6 address needs its closing ]")?;
        let port = after.strip_prefix(':').ok_or("no port after the address")?;
        (host, port)
    } else {
        let (host, port) = addr.rsplit_once(':').ok_or("no port")?;
        if host.contains(':') {
            return Err("an IPv6 address goes in brackets, e.g. [::1]:7471".into());
        }
        (host, port)
    };
    if host.is_empty() {
        return Err("no host".into());
    }
    if host.trim() != host || host.contains(['[', ']', '/', '?', '#', '@']) {
        return Err(format!("the host {host:?} is not a name or an address"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok((host, p)),
        _ => Err(format!("port {port:?} is not a number in 1-65535")),
    }
}

/// The socket path of a `unix:/path` address (the shm transport), or `None` for any other. Unlike
/// the shm transport's `socket_path`, `unix:` alone gives an empty path, so that the config
/// checks can name it as a missing path rather than as a host:port without a port.
pub fn unix_socket(addr: &str) -> Option<&std::path::Path> {
    addr.strip_prefix(rdmastream::transport::UNIX_SCHEME)
        .map(std::path::Path::new)
}

/// True when every address `addr` (`host:port`) resolves to is a loopback address, or when it
/// is a `unix:/path` socket (reachable from this host only, like loopback).
pub fn is_loopback(addr: &str) -> bool {
    use std::net::ToSocketAddrs;
    if unix_socket(addr).is_some() {
        return true;
    }
    match addr.to_socket_addrs() {
        Ok(mut it) => {
            let all: Vec<_> = it.by_ref().collect();
            !all.is_empty() && all.iter().all(|a| a.ip().is_loopback())
        }
        Err(_) => false,
    }
}

/// The bad-input part of a binary's error, if that is what it is: a [`ConfigError`] directly or
/// inside [`crate::Error::Config`]. Binaries print it as "bad config" and exit 2.
pub fn config_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a ConfigError> {
    e.downcast_ref::<ConfigError>()
        .or_else(|| match e.downcast_ref::<crate::Error>() {
            Some(crate::Error::Config(c)) => Some(c),
            _ => None,
        })
}

/// An error and its causes on one line, `a: b: c`, leaving out a cause whose text the line
/// already holds (many errors put their source into their own message).
pub fn describe_error(e: &(dyn std::error::Error + 'static)) -> String {
    let mut line = String::new();
    let mut next = Some(e);
    while let Some(cause) = next {
        let text = cause.to_string();
        if !line.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
        next = cause.source();
    }
    line
}

/// Ends a binary that failed: bad input (a [`ConfigError`], see [`config_error`]) is printed as
/// "bad config" with exit code 2, anything else as its error chain on one line with exit code 1.
pub fn exit_on_error(program: &str, e: &(dyn std::error::Error + 'static)) -> ! {
    match config_error(e) {
        Some(c) => {
            eprintln!("{program}: bad config: {c}");
            std::process::exit(2)
        }
        None => {
            eprintln!("{program}: {}", describe_error(e));
            std::process::exit(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stop ends the wait between status lines at once: the main thread does not look at the
    /// flag every few milliseconds, nor sleep out the interval.
    #[test]
    fn a_stop_ends_the_wait_between_status_lines_at_once() {
        let stop = Stop::new();
        let asker = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                let asked_at = Instant::now();
                assert!(!stop.ask(), "asked twice");
                asked_at
            })
        };
        let mut ticks = 0;
        every(Duration::from_secs(30), &stop, |_| {
            ticks += 1;
            true
        });
        let returned = Instant::now();
        let asked_at = asker.join().unwrap();
        assert_eq!(ticks, 0, "a tick before the 30 s interval");
        let late = returned.saturating_duration_since(asked_at);
        assert!(
            late < Duration::from_secs(10),
            "every returned {late:?} after the stop"
        );
        assert!(stop.is_asked() && stop.flag().load(Ordering::Acquire));
        assert!(stop.ask(), "the second ask says it was asked already");
        // Asked already: a sleep returns at once.
        let t = Instant::now();
        stop.sleep(Duration::from_secs(30));
        assert!(t.elapsed() < Duration::from_secs(10));
    }

    /// A ring makes `every` tick at once, without stopping it.
    #[test]
    fn a_ring_makes_every_tick_now_without_a_stop() {
        let stop = Stop::new();
        let ringer = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                stop.ring();
            })
        };
        let t = Instant::now();
        let mut ticks = 0;
        every(Duration::from_secs(30), &stop, |_| {
            ticks += 1;
            false
        });
        ringer.join().unwrap();
        assert_eq!(ticks, 1);
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no tick until {:?}",
            t.elapsed()
        );
        assert!(!stop.is_asked(), "a ring asked for the stop");
    }

    #[test]
    fn a_sleep_without_a_stop_lasts_its_time() {
        let stop = Stop::new();
        let t = Instant::now();
        stop.sleep(Duration::from_millis(50));
        assert!(t.elapsed() >= Duration::from_millis(50));
        assert!(!stop.is_asked());
    }

    /// A TOML error names the line it is on (a key at the start of a line counted as that
    /// line, not the one before) and, for an unknown or missing field, the key with its table.
    #[test]
    fn a_toml_error_names_its_line_and_the_key_with_its_table() {
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Device {
            id: u32,
            fps: Option<f64>,
        }
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct File {
            name: Option<String>,
            #[serde(default)]
            device: Vec<Device>,
        }
        let err = |text: &str| {
            let e = parse_toml::<File>(text, Path::new("x.toml")).unwrap_err();
            (e.key.clone(), e.reason.clone(), e.to_string())
        };
        let (key, reason, shown) = err("name = \"a\"\nname_typo = 3\n");
        assert_eq!(key, "name_typo");
        assert!(reason.starts_with("line 2: unknown field"), "{reason}");
        assert!(
            shown.starts_with("x.toml: key `name_typo`: line 2:"),
            "{shown}"
        );
        let (key, reason, _) =
            err("name = \"a\"\n[[device]]\nid = 1\n\n[[device]] # the second\nfps = 25.0\n");
        assert_eq!(key, "device[1].id");
        // The line of the second `[[device]]`, the table that lacks the field.
        assert!(reason.starts_with("line 5: missing field `id`"), "{reason}");
        let (key, reason, _) = err("[[device]]\nid = 1\nfpss = 3\n");
        assert_eq!(key, "device[0].fpss");
        assert!(reason.starts_with("line 3: unknown field"), "{reason}");
        let (key, reason, _) = err("[[device]]\nid = \"x\"\n");
        assert_eq!(key, "", "only unknown and missing fields name a key here");
        assert!(reason.starts_with("line 2: invalid type"), "{reason}");
        let (_, reason, _) = err("name = 3");
        assert!(reason.starts_with("line 1: "), "{reason}");
    }

    #[test]
    fn byte_sizes_parse_with_units() {
        assert_eq!(ByteSize::parse("64 MiB"), Ok(ByteSize(64 << 20)));
        assert_eq!(ByteSize::parse("1.5GB"), Ok(ByteSize(1_500_000_000)));
        assert_eq!(ByteSize::parse("4096"), Ok(ByteSize(4096)));
        assert!(ByteSize::parse("12 parsecs").is_err());
        assert!(ByteSize::parse("-1 MiB").is_err());
        assert_eq!(ByteSize(8 << 30).to_string(), "8 GiB");
        assert!(is_loopback("127.0.0.1:7471") && is_loopback("[::1]:1"));
        assert!(!is_loopback("0.0.0.0:7471"));
        assert!(is_loopback("unix:/run/rdmastream/rx.sock"));
    }

    #[test]
    fn a_key_file_is_read_bounded_and_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.key");
        std::fs::write(&good, "  0123456789abcdef0123456789abcdef\n").unwrap();
        let key = read_key_file(&good).unwrap();
        let want = rdmastream::proto::handshake::Key::new(*b"0123456789abcdef0123456789abcdef");
        assert!(
            key == want.unwrap(),
            "whitespace around the key is not part of it"
        );
        let huge = dir.path().join("huge.key");
        std::fs::write(&huge, vec![b'a'; 1 << 20]).unwrap();
        let e = read_key_file(&huge).unwrap_err();
        assert!(
            e.contains("huge.key") && e.contains("not a key file"),
            "{e}"
        );
        // An endless device is not read to the end.
        let e = read_key_file(Path::new("/dev/zero")).unwrap_err();
        assert!(e.contains("/dev/zero"), "{e}");
        let e = read_key_file(&dir.path().join("missing.key")).unwrap_err();
        assert!(
            e.contains("missing.key") && e.contains("cannot read"),
            "{e}"
        );
    }

    #[test]
    fn a_source_already_in_the_message_is_not_repeated() {
        let e = rdmastream::Error::Listen {
            addr: "127.0.0.1:1".into(),
            source: std::io::Error::from(std::io::ErrorKind::AddrInUse),
        };
        let line = describe_error(&e);
        assert_eq!(line.matches("in use").count(), 1, "{line}");
    }
}
