//! What a running sender or receiver knows about itself, gathered in one place for everyone who
//! reads it: the short status line each interval, the per-device table (at the end and on
//! SIGUSR1), the Prometheus metrics ([`crate::metrics`]) and the status page ([`crate::http`]).
//!
//! The run loop calls [`Monitor::tick`] once per status interval with the engine's per-device
//! counters and a copy of its engine-wide counters ([`Engine`]); readers never touch the engine.
//! Per-device counters are kept as the engine's own atomics, so a scrape reads them live; the
//! latency samples are taken from the engine once (by whoever comes first, a tick or a scrape)
//! into a histogram per interval and one over the whole run.
//!
//! What it does not do: no IO of its own (no printing, no sockets), no decisions.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use rdmastream::engine::StreamKey;
use rdmastream::proto::{ReorderStats, SenderStats};
use rdmastream::stats::{DeviceCounters, Histogram, get};

use crate::sink::Evictions;

/// Which binary this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Sender,
    Receiver,
}

/// The longest status line [`Monitor::status_line`] returns, in characters.
pub const STATUS_LINE_MAX: usize = 160;

/// Engine-wide counters, copied from the engine handle by the run loop at each tick.
#[derive(Debug, Clone)]
pub enum Engine {
    Sender(SenderEngine),
    Receiver(ReceiverEngine),
}

/// A sender's engine-wide counters.
#[derive(Debug, Clone, Default)]
pub struct SenderEngine {
    /// The sending state machine's counters (write chains, syncs, retained skipped, ...).
    pub machine: SenderStats,
    /// Connections made to the receiver so far (reconnects included).
    pub connections: u64,
}

/// A receiver's engine-wide counters.
#[derive(Debug, Clone, Default)]
pub struct ReceiverEngine {
    /// Blocks processed (valid or not).
    pub blocks: u64,
    /// Status scans that found nothing.
    pub idle_polls: u64,
    /// Connections turned away, by reason (`RefusalKind::name`).
    pub refused: BTreeMap<&'static str, u64>,
    /// Invalid blocks, by kind (`BlockError::name`).
    pub invalid: BTreeMap<&'static str, u64>,
    /// Reorder counters per sender/device.
    pub reorder: BTreeMap<StreamKey, ReorderStats>,
    /// Memory budget for senders: bytes in use and the limit.
    pub memory_used: u64,
    pub memory_limit: u64,
    /// Bytes of frame files under the output directory, and the disk budget (`None`: none).
    pub disk_used: u64,
    pub disk_budget: Option<u64>,
    /// Frame files deleted for `keep` and `disk_budget`.
    pub evictions: Evictions,
}

/// One device as the last tick saw it: rates over the last interval, counts over the run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceRow {
    pub sender: String,
    pub device: u8,
    /// Frames and megabytes (10^6 bytes) per second over the last interval.
    pub fps: f64,
    pub mbps: f64,
    pub frames: u64,
    pub bytes: u64,
    pub drops: u64,
    pub gaps: u64,
    /// Latency quantiles over the last interval, in milliseconds (`None`: no frame in it).
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    /// Receiver faults (0 on a sender): lossless frames missing, failed writes, given up.
    pub missing: u64,
    pub write_errors: u64,
    pub unwritten: u64,
    /// The device's end of stream passed.
    pub ended: bool,
    /// Drops and gaps that happened during the last interval (what makes a device "worst").
    #[serde(skip)]
    new_faults: u64,
}

struct Device {
    counters: Arc<DeviceCounters>,
    /// Frames, bytes, drops + gaps at the last tick.
    last: (u64, u64, u64),
    /// Latency since the last tick, and over the run.
    window: Histogram,
    total: Histogram,
}

struct State {
    devices: BTreeMap<StreamKey, Device>,
    rows: Vec<DeviceRow>,
    engine: Engine,
    last_tick: Instant,
    /// The latency of all devices over the last interval.
    window: Histogram,
}

/// The shared view of a running binary. See the module docs for who calls what.
pub struct Monitor {
    role: Role,
    started: Instant,
    interval: Duration,
    state: Mutex<State>,
    /// Sender: connected to the receiver; receiver: listening. Shared with what knows.
    ready: Arc<AtomicBool>,
    /// Set once the run loop ended (stopping, flushing): not live any more.
    finished: AtomicBool,
}

impl Monitor {
    /// A monitor for a binary whose status loop ticks every `interval`; `ready` is the flag
    /// `/readyz` reports.
    pub fn new(role: Role, interval: Duration, ready: Arc<AtomicBool>) -> Arc<Monitor> {
        let now = Instant::now();
        Arc::new(Monitor {
            role,
            started: now,
            interval,
            state: Mutex::new(State {
                devices: BTreeMap::new(),
                rows: Vec::new(),
                engine: match role {
                    Role::Sender => Engine::Sender(SenderEngine::default()),
                    Role::Receiver => Engine::Receiver(ReceiverEngine::default()),
                },
                last_tick: now,
                window: Histogram::default(),
            }),
            ready,
            finished: AtomicBool::new(false),
        })
    }

    /// Which binary this is.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Time since start.
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// Whether `/readyz` answers 200: connected (sender) or listening (receiver), and running.
    pub fn ready(&self) -> bool {
        self.ready.load(Ordering::Acquire) && !self.finished.load(Ordering::Acquire)
    }

    /// Whether `/healthz` answers 200: the run loop is running and ticked recently (a hung
    /// loop stops ticking).
    pub fn alive(&self) -> bool {
        let late = (self.interval * 3).max(Duration::from_secs(5));
        !self.finished.load(Ordering::Acquire) && self.state.lock().last_tick.elapsed() < late
    }

    /// The run loop ended: health and readiness turn 503.
    pub fn finish(&self) {
        self.finished.store(true, Ordering::Release);
    }

    /// One status interval passed: takes the latency samples, computes every device's rates
    /// over `elapsed` and stores `engine`.
    pub fn tick(
        &self,
        devices: Vec<(StreamKey, Arc<DeviceCounters>)>,
        engine: Engine,
        elapsed: Duration,
    ) {
        let secs = elapsed.as_secs_f64();
        // A first tick (elapsed 0) only registers the devices: no rates yet.
        let rate = |n: u64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
        let mut s = self.state.lock();
        for (key, counters) in devices {
            s.devices.entry(key).or_insert_with(|| Device {
                counters,
                last: (0, 0, 0),
                window: Histogram::default(),
                total: Histogram::default(),
            });
        }
        let mut rows = Vec::with_capacity(s.devices.len());
        let mut window = Histogram::default();
        let now_t = Instant::now();
        for (key, d) in s.devices.iter_mut() {
            d.take_latency();
            let c = &d.counters;
            let now = (get(&c.frames), get(&c.bytes), get(&c.drops) + get(&c.gaps));
            let ms = |q| {
                d.window
                    .quantile(q)
                    .map(|l: Duration| l.as_secs_f64() * 1e3)
            };
            rows.push(DeviceRow {
                sender: key.sender.clone(),
                device: key.device,
                fps: rate(now.0.saturating_sub(d.last.0)),
                mbps: rate(now.1.saturating_sub(d.last.1)) / 1e6,
                frames: now.0,
                bytes: now.1,
                drops: get(&c.drops),
                gaps: get(&c.gaps),
                p50_ms: ms(0.5),
                p99_ms: ms(0.99),
                missing: get(&c.missing),
                write_errors: get(&c.write_errors),
                unwritten: get(&c.unwritten),
                ended: get(&c.ended) == 1,
                new_faults: now.2.saturating_sub(d.last.2),
            });
            window.merge(&d.window);
            d.window = Histogram::default();
            d.last = now;
        }
        s.rows = rows;
        s.window = window;
        s.engine = engine;
        s.last_tick = now_t;
    }

    /// Takes the latency samples gathered since the last tick or scrape (so the histograms a
    /// scrape reads are current).
    pub fn collect_latency(&self) {
        for d in self.state.lock().devices.values_mut() {
            d.take_latency();
        }
    }

    /// Every device as of the last tick, in key order.
    pub fn rows(&self) -> Vec<DeviceRow> {
        self.state.lock().rows.clone()
    }

    /// The engine-wide counters as of the last tick.
    pub fn engine(&self) -> Engine {
        self.state.lock().engine.clone()
    }

    /// Each device's key, live counters and latency over the run, for the metrics.
    pub fn devices(&self) -> Vec<(StreamKey, Arc<DeviceCounters>, Histogram)> {
        self.state
            .lock()
            .devices
            .iter()
            .map(|(k, d)| (k.clone(), d.counters.clone(), d.total.clone()))
            .collect()
    }

    /// Latency of all devices over the whole run.
    pub fn total_latency(&self) -> Histogram {
        let mut all = Histogram::default();
        for d in self.state.lock().devices.values() {
            all.merge(&d.total);
        }
        all
    }

    /// The short status line of the last interval: totals and the worst device, at most
    /// [`STATUS_LINE_MAX`] characters.
    pub fn status_line(&self) -> String {
        let s = self.state.lock();
        status_line(self.role, &s.rows, &s.window, &s.engine, self.ready())
    }

    /// The per-device table: counts, rates and latency over the run so far (rates from each
    /// device's first frame to its last, `-` before its second). One line per device, with a
    /// header.
    pub fn table(&self) -> String {
        let s = self.state.lock();
        let mut out = format!(
            "{:<24} {:>9} {:>10} {:>7} {:>7} {:>7} {:>7} {:>8} {:>8}\n",
            "device", "frames", "MB", "fps", "MB/s", "drops", "gaps", "p50 ms", "p99 ms"
        );
        for (row, d) in s.rows.iter().zip(s.devices.values()) {
            let ms = |q| {
                d.total
                    .quantile(q)
                    .map_or("-".to_string(), |l| format!("{:.2}", l.as_secs_f64() * 1e3))
            };
            let (fps, mbps) = match d.counters.span().and_then(|s| s.rates()) {
                Some((fps, bps)) => (format!("{fps:.1}"), format!("{:.1}", bps / 1e6)),
                None => ("-".to_string(), "-".to_string()),
            };
            out.push_str(&format!(
                "{:<24} {:>9} {:>10.1} {:>7} {:>7} {:>7} {:>7} {:>8} {:>8}{}\n",
                truncate(&key_text(self.role, &row.sender, row.device), 24),
                row.frames,
                row.bytes as f64 / 1e6,
                fps,
                mbps,
                row.drops,
                row.gaps,
                ms(0.5),
                ms(0.99),
                if row.ended { " ended" } else { "" }
            ));
        }
        out
    }
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor")
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

impl Device {
    fn take_latency(&mut self) {
        let h = self.counters.take_latency();
        if h.count() > 0 {
            self.window.merge(&h);
            self.total.merge(&h);
        }
    }
}

/// How a device is named in lines: `sender/d003` on a receiver, `d003` on a sender (it is the
/// only sender).
fn key_text(role: Role, sender: &str, device: u8) -> String {
    match role {
        Role::Sender => format!("d{device:03}"),
        Role::Receiver => format!("{sender}/d{device:03}"),
    }
}

/// `text` cut to at most `max` characters (ending in `~` when cut).
fn truncate(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_string()
    } else {
        let mut t: String = text.chars().take(max.saturating_sub(1)).collect();
        t.push('~');
        t
    }
}

fn ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{:.1}", d.as_secs_f64() * 1e3))
}

/// The status line (see [`Monitor::status_line`]).
fn status_line(
    role: Role,
    rows: &[DeviceRow],
    window: &Histogram,
    engine: &Engine,
    ready: bool,
) -> String {
    let sum = |f: fn(&DeviceRow) -> u64| rows.iter().map(f).fold(0u64, u64::saturating_add);
    let (fps, mbps) = rows
        .iter()
        .fold((0.0, 0.0), |(f, m), r| (f + r.fps, m + r.mbps));
    let mut line = format!(
        "{} dev {fps:.1} fps {mbps:.1} MB/s drops {} gaps {} p50/p99 {}/{} ms",
        rows.len(),
        sum(|r| r.drops),
        sum(|r| r.gaps),
        ms(window.quantile(0.5)),
        ms(window.quantile(0.99)),
    );
    for (name, n) in [
        ("missing", sum(|r| r.missing)),
        ("write-errors", sum(|r| r.write_errors)),
        ("unwritten", sum(|r| r.unwritten)),
    ] {
        if n > 0 {
            line.push_str(&format!(" {name} {n}"));
        }
    }
    match engine {
        Engine::Sender(e) => line.push_str(&format!(
            " syncs {} {}",
            e.machine.syncs,
            if ready { "connected" } else { "connecting" }
        )),
        Engine::Receiver(e) => {
            let refused: u64 = e.refused.values().fold(0, |a, b| a.saturating_add(*b));
            let invalid: u64 = e.invalid.values().fold(0, |a, b| a.saturating_add(*b));
            if refused > 0 {
                line.push_str(&format!(" refused {refused}"));
            }
            if invalid > 0 {
                line.push_str(&format!(" invalid {invalid}"));
            }
        }
    }
    // The worst device: the most new drops and gaps, then the highest p99, then the lowest fps.
    let worst = rows.iter().max_by(|a, b| {
        a.new_faults
            .cmp(&b.new_faults)
            .then(a.p99_ms.unwrap_or(0.0).total_cmp(&b.p99_ms.unwrap_or(0.0)))
            .then(b.fps.total_cmp(&a.fps))
    });
    if let Some(w) = worst.filter(|_| rows.len() > 1) {
        let tail = format!(
            ": {:.1} fps drops {} gaps {} p99 {} ms",
            w.fps,
            w.drops,
            w.gaps,
            w.p99_ms.map_or("-".into(), |p| format!("{p:.1}"))
        );
        let room =
            STATUS_LINE_MAX.saturating_sub(line.chars().count() + " | worst ".len() + tail.len());
        if room >= 6 {
            line.push_str(" | worst ");
            line.push_str(&truncate(&key_text(role, &w.sender, w.device), room));
            line.push_str(&tail);
        }
    }
    truncate(&line, STATUS_LINE_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmastream::stats::FrameSpan;

    fn key(sender: &str, device: u8) -> StreamKey {
        StreamKey {
            sender: sender.into(),
            device,
        }
    }

    fn monitor_with(role: Role, sender: &str, n: u8) -> (Arc<Monitor>, Vec<Arc<DeviceCounters>>) {
        let m = Monitor::new(
            role,
            Duration::from_secs(1),
            Arc::new(AtomicBool::new(true)),
        );
        let counters: Vec<_> = (0..n)
            .map(|_| Arc::new(DeviceCounters::default()))
            .collect();
        let devices = counters
            .iter()
            .enumerate()
            .map(|(d, c)| (key(sender, d as u8), c.clone()))
            .collect();
        m.tick(
            devices,
            Engine::Receiver(Default::default()),
            Duration::from_secs(1),
        );
        (m, counters)
    }

    #[test]
    fn the_status_line_is_short_whatever_the_names_and_numbers() {
        let long = "x".repeat(64);
        let (m, counters) = monitor_with(Role::Receiver, &long, 255);
        for (i, c) in counters.iter().enumerate() {
            for _ in 0..(i % 7) {
                c.frame(123_456_789, Some(Duration::from_millis(i as u64 + 1)));
            }
            c.drops.store(u64::MAX / 3, Ordering::Relaxed);
            c.gaps.store(u64::MAX / 5, Ordering::Relaxed);
            c.missing.store(u64::MAX / 7, Ordering::Relaxed);
            c.write_errors.store(99_999_999, Ordering::Relaxed);
            c.unwritten.store(99_999_999, Ordering::Relaxed);
        }
        m.tick(
            vec![],
            Engine::Receiver(ReceiverEngine {
                refused: [("lost", 5)].into(),
                ..Default::default()
            }),
            Duration::from_millis(1),
        );
        let line = m.status_line();
        assert!(
            line.chars().count() <= STATUS_LINE_MAX,
            "{} chars: {line}",
            line.len()
        );
        assert!(line.starts_with("255 dev "), "{line}");
        for sender in [Role::Sender, Role::Receiver] {
            let (m, counters) = monitor_with(sender, "edge-1", 14);
            counters[3].frame(1000, Some(Duration::from_millis(40)));
            counters[5].dropped();
            for c in &counters {
                c.frame(921_600, Some(Duration::from_millis(2)));
            }
            m.tick(vec![], m.engine(), Duration::from_secs(1));
            let line = m.status_line();
            assert!(line.chars().count() <= STATUS_LINE_MAX, "{line}");
            // Device 5 dropped a frame in this interval: it is the worst, although device 3
            // had the higher latency.
            let worst = if sender == Role::Sender {
                "d005"
            } else {
                "edge-1/d005"
            };
            assert!(line.contains(&format!("| worst {worst}: ")), "{line}");
            assert!(line.contains("drops 1 gaps 0"), "{line}");
        }
    }

    #[test]
    fn rates_are_per_interval_and_counts_per_run() {
        let (m, counters) = monitor_with(Role::Receiver, "a", 2);
        for _ in 0..10 {
            counters[0].frame(2_000_000, Some(Duration::from_millis(5)));
        }
        m.tick(vec![], m.engine(), Duration::from_secs(2));
        let rows = m.rows();
        assert_eq!((rows[0].frames, rows[0].fps, rows[0].mbps), (10, 5.0, 10.0));
        assert_eq!((rows[1].frames, rows[1].p50_ms), (0, None));
        m.tick(vec![], m.engine(), Duration::from_secs(1));
        let rows = m.rows();
        assert_eq!(
            (rows[0].frames, rows[0].fps, rows[0].p99_ms),
            (10, 0.0, None)
        );
        // The run's latency stays.
        assert_eq!(m.total_latency().count(), 10);
        let table = m.table();
        assert_eq!(table.lines().count(), 3, "{table}");
        assert!(
            table.lines().nth(1).unwrap().starts_with("a/d000 "),
            "{table}"
        );
        // Rates over the device's own frames, not the ticks: device 1, with none, has none.
        let cols: Vec<&str> = table.lines().nth(2).unwrap().split_whitespace().collect();
        assert_eq!(&cols[..5], ["a/d001", "0", "0.0", "-", "-"], "{table}");
    }

    #[test]
    fn the_tables_rates_run_from_a_devices_first_frame_to_its_last() {
        let first = Instant::now();
        let span = |frames, secs: f64| FrameSpan {
            first,
            last: first + Duration::from_secs_f64(secs),
            frames,
            bytes: frames * 1_000_000,
        };
        // 81 radar frames at 20 fps span 4 s, whichever status ticks they fall between.
        let (fps, bps) = span(81, 4.0).rates().unwrap();
        assert!(
            (fps - 20.0).abs() < 1e-9 && (bps - 20e6).abs() < 1e-3,
            "{fps} {bps}"
        );
        assert_eq!(span(1, 0.0).rates(), None, "one frame has no rate");
        assert_eq!(span(5, 0.0).rates(), None, "nor frames at one instant");
    }
}
