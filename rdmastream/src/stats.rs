//! Counters and latency histograms shared between the worker threads and the status line.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::{Condvar, Mutex};

/// Nanoseconds since the UNIX epoch now (capture timestamps use this clock, so latency across
/// hosts is only as good as their clock sync).
pub fn unix_now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Log-bucketed latency histogram: 8 buckets per power of two (≤ 9 % relative error), from 1 µs
/// to about 70 s. Fixed size, so memory stays bounded on long runs.
#[derive(Clone)]
pub struct Histogram {
    buckets: Vec<u64>,
    count: u64,
}

const SUB: u32 = 8;
const BUCKETS: usize = 27 * SUB as usize;

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: vec![0; BUCKETS],
            count: 0,
        }
    }
}

impl Histogram {
    fn index(us: u64) -> usize {
        let us = us.max(1);
        let log = 63 - us.leading_zeros();
        let frac = ((us << SUB.trailing_zeros()) >> log) & (SUB as u64 - 1);
        ((log * SUB) as usize + frac as usize).min(BUCKETS - 1)
    }

    /// Lower bound of bucket `index`, in microseconds.
    fn value(index: usize) -> u64 {
        let log = index as u32 / SUB;
        let frac = index as u64 % SUB as u64;
        ((SUB as u64 + frac) << log) >> SUB.trailing_zeros()
    }

    /// Records one latency.
    pub fn record(&mut self, d: Duration) {
        self.buckets[Self::index(d.as_micros() as u64)] += 1;
        self.count += 1;
    }

    /// Number of samples.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The `q` quantile (0..=1), or `None` without samples.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        if self.count == 0 {
            return None;
        }
        let rank = ((q * self.count as f64).ceil() as u64).clamp(1, self.count);
        let mut seen = 0;
        for (i, &c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(Duration::from_micros(Self::value(i)));
            }
        }
        None
    }

    /// The non-empty buckets in order: each bucket's lower and upper bound (a sample `d` is in
    /// it when `lower <= d < upper`, to microsecond resolution) and its count. For exporting
    /// the histogram (e.g. as Prometheus buckets); quantiles are [`Histogram::quantile`].
    pub fn buckets(&self) -> impl Iterator<Item = (Duration, Duration, u64)> + '_ {
        self.buckets
            .iter()
            .enumerate()
            .filter(|(_, c)| **c > 0)
            .map(|(i, &c)| {
                // Below 8 µs neighbouring buckets share a bound: the next larger one is the end.
                let upper = (i + 1..BUCKETS)
                    .map(Self::value)
                    .find(|&v| v > Self::value(i))
                    .map_or(Duration::MAX, Duration::from_micros);
                (Duration::from_micros(Self::value(i)), upper, c)
            })
    }

    /// Adds another histogram's samples.
    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a += b;
        }
        self.count += other.count;
    }
}

/// Counters of one device (on the sender or the receiver).
#[derive(Default)]
pub struct DeviceCounters {
    /// Frames handed on (sender: fully written; receiver: delivered in order).
    pub frames: AtomicU64,
    /// Payload bytes of those frames.
    pub bytes: AtomicU64,
    /// Frames dropped (sender: drop-oldest policy).
    pub drops: AtomicU64,
    /// Sender: frames a source wrote straight into an in-place send block and committed
    /// (`DeviceInput::reserve`), rather than handing them to the filling thread.
    pub in_place: AtomicU64,
    /// Sender: of those, frames sealed on the committing thread and handed straight to the
    /// sending thread (the filling thread had nothing to do for them).
    pub direct: AtomicU64,
    /// Packets given up on (receiver: gaps in packet numbers).
    pub gaps: AtomicU64,
    /// Frames checked against the synthetic reference and found equal / different.
    pub verified: AtomicU64,
    pub mismatched: AtomicU64,
    /// Set once the device's end of stream passed.
    pub ended: AtomicU64,
    /// Receiver: frames durably handed on (files renamed into place, buffers pushed).
    pub written: AtomicU64,
    /// Receiver: frames that arrived again after a reconnect or restart and were already
    /// handed on (dropped, not written twice).
    pub duplicates: AtomicU64,
    /// Receiver: frame indices of a lossless device that never arrived (an error).
    pub missing: AtomicU64,
    /// Receiver: failed attempts to hand a frame on (disk full, permissions, I/O errors).
    pub write_errors: AtomicU64,
    /// Receiver: frames that could not be handed on and were given up (a lossy device's frame
    /// after a failed write, or a lossless one still failing when the receiver stopped).
    pub unwritten: AtomicU64,
    /// Set when the device is lossless (`block`).
    pub reliable: AtomicU64,
    /// Sender: the newest capture timestamp (`timestamp_ns`) among the frames fully written or
    /// dropped, for a device input to tell whether its previous frame is through (the link
    /// keeps up with this device) or still on its way.
    pub done_ts: AtomicU64,
    latency: Mutex<Histogram>,
    /// Frames handed on or dropped so far, for [`DeviceCounters::wait_progress`], and when
    /// frames were handed on.
    progress: Mutex<Progress>,
    progressed: Condvar,
}

#[derive(Default)]
struct Progress {
    /// Frames handed on or dropped.
    count: u64,
    span: Option<FrameSpan>,
}

/// When a device handed frames on: the first and the last, and how many in between (both
/// counted), for rates over the time a device was active rather than over status ticks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FrameSpan {
    pub first: std::time::Instant,
    pub last: std::time::Instant,
    pub frames: u64,
    pub bytes: u64,
}

impl FrameSpan {
    /// Frames per second and bytes per second from the first frame to the last (`None` before
    /// a second frame, or if both came at the same instant).
    pub fn rates(&self) -> Option<(f64, f64)> {
        let secs = (self.last - self.first).as_secs_f64();
        if self.frames < 2 || secs <= 0.0 {
            return None;
        }
        // n frames span n - 1 periods; so do all their bytes but one frame's, on average.
        let fps = (self.frames - 1) as f64 / secs;
        Some((fps, fps * self.bytes as f64 / self.frames as f64))
    }
}

impl DeviceCounters {
    /// Records a frame of `bytes` payload and its latency.
    pub fn frame(&self, bytes: usize, latency: Option<Duration>) {
        self.frames.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        if let Some(l) = latency {
            self.latency.lock().record(l);
        }
        let now = std::time::Instant::now();
        let mut p = self.progress.lock();
        p.count += 1;
        let span = p.span.get_or_insert(FrameSpan {
            first: now,
            last: now,
            frames: 0,
            bytes: 0,
        });
        span.last = now;
        span.frames += 1;
        span.bytes += bytes as u64;
        drop(p);
        self.progressed.notify_all();
    }

    /// Sender: a frame of `bytes` captured at `ts` (ns since the UNIX epoch) is fully written:
    /// counts it with its latency capture → written, and moves `done_ts`.
    pub fn written_at(&self, bytes: usize, ts: u64) {
        self.done_ts.fetch_max(ts, Ordering::Release);
        let latency = Duration::from_nanos(unix_now_ns().saturating_sub(ts));
        self.frame(bytes, Some(latency));
    }

    /// Sender: a frame captured at `ts` is dropped: counts it and moves `done_ts`.
    pub fn dropped_at(&self, ts: u64) {
        self.done_ts.fetch_max(ts, Ordering::Release);
        self.dropped();
    }

    /// Records a dropped frame.
    pub fn dropped(&self) {
        self.drops.fetch_add(1, Ordering::Relaxed);
        self.note_progress();
    }

    fn note_progress(&self) {
        self.progress.lock().count += 1;
        self.progressed.notify_all();
    }

    /// How many frames were handed on or dropped so far (a value for `wait_progress`).
    pub fn progress(&self) -> u64 {
        self.progress.lock().count
    }

    /// When this device handed frames on, first to last (`None` before the first).
    pub fn span(&self) -> Option<FrameSpan> {
        self.progress.lock().span
    }

    /// Waits until a frame is handed on or dropped after `seen` (a value of `progress` read
    /// before deciding to wait, so nothing in between is missed), or `timeout` passed. Returns
    /// the progress now. Lets a producer wait for room without polling.
    pub fn wait_progress(&self, seen: u64, timeout: Duration) -> u64 {
        let mut p = self.progress.lock();
        if p.count == seen {
            self.progressed.wait_for(&mut p, timeout);
        }
        p.count
    }

    /// Takes the latency samples gathered since the last call.
    pub fn take_latency(&self) -> Histogram {
        std::mem::take(&mut *self.latency.lock())
    }
}

/// Reads a counter.
pub fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

/// Counters per stream key (device number, or sender name + device number).
pub struct Registry<K: Ord + Clone> {
    devices: Mutex<BTreeMap<K, std::sync::Arc<DeviceCounters>>>,
}

impl<K: Ord + Clone> Default for Registry<K> {
    fn default() -> Self {
        Registry {
            devices: Mutex::new(BTreeMap::new()),
        }
    }
}

impl<K: Ord + Clone> Registry<K> {
    /// The counters of `key`, created on first use.
    pub fn device(&self, key: &K) -> std::sync::Arc<DeviceCounters> {
        let mut devices = self.devices.lock();
        // The key is copied only when it is new.
        if let Some(c) = devices.get(key) {
            return c.clone();
        }
        devices.entry(key.clone()).or_default().clone()
    }

    /// All keys and counters, in key order.
    pub fn all(&self) -> Vec<(K, std::sync::Arc<DeviceCounters>)> {
        self.devices
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waiter_for_progress_is_woken_by_a_frame_and_never_misses_one() {
        let c = std::sync::Arc::new(DeviceCounters::default());
        let seen = c.progress();
        let waiter = {
            let c = c.clone();
            std::thread::spawn(move || c.wait_progress(seen, Duration::from_secs(60)))
        };
        c.frame(10, None);
        // Woken by the frame (a missed wakeup would return `seen` after a minute).
        assert_eq!(waiter.join().unwrap(), seen + 1);
        // Progress made before the wait began is seen at once.
        c.dropped();
        assert_eq!(c.wait_progress(seen, Duration::from_secs(60)), seen + 2);
        assert_eq!((get(&c.frames), get(&c.drops)), (1, 1));
    }

    #[test]
    fn quantiles_are_within_bucket_error() {
        let mut h = Histogram::default();
        for us in 1..=10_000u64 {
            h.record(Duration::from_micros(us));
        }
        let p50 = h.quantile(0.5).unwrap().as_micros() as f64;
        let p99 = h.quantile(0.99).unwrap().as_micros() as f64;
        assert!((p50 - 5000.0).abs() / 5000.0 < 0.1, "p50 {p50}");
        assert!((p99 - 9900.0).abs() / 9900.0 < 0.1, "p99 {p99}");
        assert_eq!(Histogram::default().quantile(0.5), None);
        // Every sample is in the bucket that claims it.
        for us in [1u64, 7, 9, 100, 4095, 4096, 65_000_000] {
            let mut one = Histogram::default();
            one.record(Duration::from_micros(us));
            let b: Vec<_> = one.buckets().collect();
            let d = Duration::from_micros(us);
            assert!(
                b.len() == 1 && b[0].0 <= d && d < b[0].1 && b[0].2 == 1,
                "{us}: {b:?}"
            );
        }
        assert_eq!(h.buckets().map(|b| b.2).sum::<u64>(), 10_000);
    }
}
