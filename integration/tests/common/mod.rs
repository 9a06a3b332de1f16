//! What the process tests share: where they run, and checks of the frames written.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// Where and how the tests run: `RDMASTREAM_IT_TRANSPORT` (tcp, verbs, shm), `RDMASTREAM_IT_HOST`
/// (the address the receiver listens on), `RDMASTREAM_IT_SMALL` (fewer and smaller frames, for
/// the Soft-RoCE VM under software CPU emulation; implied by verbs).
pub struct It {
    pub transport: String,
    pub host: String,
    pub small: bool,
}

/// The test environment.
pub fn it() -> It {
    let transport = std::env::var("RDMASTREAM_IT_TRANSPORT").unwrap_or_else(|_| "tcp".into());
    let small = std::env::var_os("RDMASTREAM_IT_SMALL").is_some() || transport == "verbs";
    let host = std::env::var("RDMASTREAM_IT_HOST").unwrap_or_else(|_| "127.0.0.1".into());
    It {
        transport,
        host,
        small,
    }
}

/// The key both ends use when the host is not loopback (in the Soft-RoCE VM): the receiver
/// refuses to listen on a non-loopback address without keys.
pub const TEST_KEY: &str = "test-key-0123456789abcdef";

impl It {
    /// A `key = ...` line for a config file when the host is not loopback, else nothing.
    pub fn key_line(&self, already: &str) -> String {
        // is_loopback takes host:port (or unix:/path), as the binaries pass it.
        if rdmastream_app::cli::is_loopback(&self.addr(1)) || already.contains("key =") {
            String::new()
        } else {
            format!("key = \"{TEST_KEY}\"\n")
        }
    }

    /// The environment's settings over the shm transport (sender and receiver on this host,
    /// `unix:` addresses), for the tests that run over it whatever the environment says.
    pub fn shm() -> It {
        It {
            transport: "shm".into(),
            ..it()
        }
    }

    /// `host:port` on the test host; over shm, a Unix socket in the temporary directory named
    /// after `port` (a free port number keeps concurrent tests apart).
    pub fn addr(&self, port: u16) -> String {
        if self.transport == "shm" {
            let path = std::env::temp_dir().join(format!("rdmastream-it-{port}.sock"));
            return format!("unix:{}", path.display());
        }
        format!("{}:{port}", self.host)
    }
}

/// A receiver.toml in `dir` for the test environment (`extra`: more keys).
pub fn receiver_config(dir: &Path, it: &It, extra: &str) -> PathBuf {
    let blocks = if it.small {
        "blocks = 8\nblock_size = 262144"
    } else {
        "blocks = 16\nblock_size = 1048576"
    };
    write(
        dir,
        "receiver.toml",
        &format!(
            "transport = \"{}\"\n{}{blocks}\nformat = \"raw\"\nkeep = 0\nwriters = 2\n{extra}\n",
            it.transport,
            it.key_line(extra)
        ),
    )
}

/// A sender config file `file` in `dir`: sender `name` to the test host's `port`, `devices`
/// (keys and [[device]] tables) appended.
pub fn sender_config(
    dir: &Path,
    it: &It,
    file: &str,
    name: &str,
    port: u16,
    devices: &str,
) -> PathBuf {
    let block = if it.small { 262144 } else { 1048576 };
    write(
        dir,
        file,
        &format!(
            "name = \"{name}\"\nreceiver = \"{}\"\ntransport = \"{}\"\nblock_size = {block}\nsend_blocks = 4\n{}{devices}",
            it.addr(port),
            it.transport,
            it.key_line(devices)
        ),
    )
}

/// The receiver's arguments: config, listen address, output directory, --verify and
/// --exit-after-eos.
pub fn receiver_args<'a>(cfg: &'a Path, listen: &'a str, out: &'a Path) -> Vec<&'a str> {
    vec![
        "--config",
        cfg.to_str().unwrap(),
        "--listen",
        listen,
        "--out",
        out.to_str().unwrap(),
        "--verify",
        "--exit-after-eos",
    ]
}

#[allow(unused_imports)]
pub use rdmastream_testkit::{bin, exits_ok, free_port, spawn, tail, wait, wait_for};

/// Frame indices of the files in `dir` (sorted), ignoring temporaries.
pub fn frame_files(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut v: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| {
                    let p = e.path();
                    let stem = p.file_stem()?.to_str()?.to_string();
                    if stem.starts_with('.') {
                        return None;
                    }
                    Some((stem.parse().ok()?, p))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Checks one written file against the reference pattern, independently of the receiver.
pub fn check_camera_file(path: &Path, device: u8, index: u64, w: usize, h: usize) {
    let data = std::fs::read(path).unwrap();
    let mut want = vec![0u8; w * h * 3];
    rdmastream_app::source::camera_pattern(device, index, w, h, &mut want);
    assert!(
        data == want,
        "{} is not frame {index} of camera {device}",
        path.display()
    );
}

/// Checks one radar file.
pub fn check_radar_file(path: &Path, device: u8, index: u64, size: usize) {
    let data = std::fs::read(path).unwrap();
    let mut want = vec![0u8; size];
    rdmastream_app::source::radar_pattern(device, index, &mut want);
    assert!(
        data == want,
        "{} is not frame {index} of radar {device}",
        path.display()
    );
}

/// Writes a file and returns its path.
pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// The number of frames the sender's summary says it wrote ("...: N frames written"), from its
/// log.
pub fn frames_written(log: &Path) -> u64 {
    let text = String::from_utf8_lossy(&std::fs::read(log).unwrap()).into_owned();
    text.lines()
        .find_map(|l| {
            l.split_once("s: ")?
                .1
                .split_once(" frames written")?
                .0
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no 'frames written' in the sender's log:\n{}", tail(log)))
}

/// `GET path` from the HTTP server at `addr` (HTTP/1.0, so the server closes when done): the
/// status code and the body; `None` when nothing answers (not started yet, or gone).
pub fn http_get(addr: &str, path: &str) -> Option<(u16, Vec<u8>)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut all = Vec::new();
    s.read_to_end(&mut all).ok()?;
    let split = all.windows(4).position(|w| w == b"\r\n\r\n")?;
    let code = String::from_utf8_lossy(&all[..split])
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some((code, all[split + 4..].to_vec()))
}

/// Scrapes `/metrics` at `addr` and parses it with a Prometheus text parser.
pub fn scrape(addr: &str) -> prometheus_parse::Scrape {
    let (code, body) = http_get(addr, "/metrics").expect("metrics server answers");
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    let text = String::from_utf8(body).expect("metrics are UTF-8");
    prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).expect("parses")
}

/// The value of the sample `name` whose labels include `labels` (counters, gauges).
pub fn metric(s: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    s.samples
        .iter()
        .find(|x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(v)))
        .and_then(|x| match x.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => Some(v),
            _ => None,
        })
}

/// The sum of `name` over every sample of it.
pub fn metric_sum(s: &prometheus_parse::Scrape, name: &str) -> f64 {
    s.samples
        .iter()
        .filter(|x| x.metric == name)
        .filter_map(|x| match x.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => Some(v),
            _ => None,
        })
        .sum()
}

/// One device's line of the receiver's end-of-run summary
/// (`summary edge-1/d003: 96 frames received, 96 written, ...`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSummary {
    pub received: u64,
    pub written: u64,
    pub missing: u64,
    pub duplicate_frames: u64,
    pub write_errors: u64,
    pub unwritten: u64,
    pub gaps: u64,
}

/// Every device's summary line in the receiver's `log`, by stream key (`edge-1/d003`).
pub fn receiver_device_summary(log: &Path) -> std::collections::BTreeMap<String, DeviceSummary> {
    let text = String::from_utf8_lossy(&std::fs::read(log).unwrap()).into_owned();
    let number_after = |line: &str, label: &str| -> u64 {
        let at = line
            .find(label)
            .unwrap_or_else(|| panic!("no {label:?} in {line}"));
        line[at + label.len()..]
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no number after {label:?} in {line}"))
    };
    text.lines()
        .filter_map(|l| {
            let rest = &l[l.find("summary ")? + "summary ".len()..];
            let (key, counts) = rest.split_once(": ")?;
            let summary = DeviceSummary {
                received: number_after(counts, ""),
                written: number_after(counts, "received, "),
                missing: number_after(counts, "missing "),
                duplicate_frames: number_after(counts, "duplicate frames "),
                write_errors: number_after(counts, "write errors "),
                unwritten: number_after(counts, "unwritten "),
                gaps: number_after(counts, "gaps "),
            };
            Some((key.to_string(), summary))
        })
        .collect()
}

/// A number from the receiver's overall summary line (`summary: 1372 blocks, ...`): the one
/// right before ` <label>`, e.g. `blocks` or `connections refused`.
pub fn receiver_total(log: &Path, label: &str) -> u64 {
    let text = String::from_utf8_lossy(&std::fs::read(log).unwrap()).into_owned();
    let line = text
        .lines()
        .find(|l| l.contains("summary: ") && l.contains(&format!(" {label}")))
        .unwrap_or_else(|| panic!("no summary line with {label:?}:\n{}", tail(log)));
    let before = &line[..line.find(&format!(" {label}")).unwrap()];
    before
        .rsplit(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number before {label:?} in {line}"))
}

/// A child process that is killed when dropped, so a failing test leaves nothing running
/// (a receiver writing into the test's removed temporary directory would retry for ever).
pub struct KillOnDrop(pub std::process::Child);

impl std::ops::Deref for KillOnDrop {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for KillOnDrop {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // Already exited: both fail harmlessly.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
