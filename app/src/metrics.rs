//! The Prometheus metrics of a sender or receiver: a `prometheus-client` collector that reads a
//! [`Monitor`] at each scrape and renders it in the OpenMetrics text format (which Prometheus
//! scrapes natively).
//!
//! Names follow the Prometheus conventions: `rdmastream_` prefix, counters end in `_total`,
//! durations are `_seconds`, sizes `_bytes`. Per-device series carry the labels `sender` and
//! `device`. The counters are the same ones the binaries' summaries print, so the two agree.
//!
//! What it does not do: no HTTP (see [`crate::http`]), no counters of its own.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

use rdmastream::stats::{DeviceCounters, Histogram, get};
use rdmastream::transport::RefusalKind;

use crate::monitor::{Engine, Monitor, Role};

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Upper bounds of the latency histogram's buckets, in seconds.
const LATENCY_BOUNDS: [f64; 16] = [
    0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
];

/// Renders `monitor`'s metrics as OpenMetrics text ([`CONTENT_TYPE`]).
pub fn render(monitor: &Arc<Monitor>) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(MonitorCollector(monitor.clone())));
    let mut text = String::new();
    // Writing into a String cannot fail; a collector bug would show as a cut-off text.
    let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
    text
}

/// One metric family to render with [`render_families`]: for metrics that are not a
/// [`Monitor`]'s (the GStreamer elements' `stats`).
#[derive(Debug, Clone)]
pub struct Family {
    /// Full name without `_total` (counters get it when rendered), e.g. `rdmastream_element_frames`.
    pub name: &'static str,
    pub help: &'static str,
    pub counter: bool,
    /// Each series: its labels and value.
    pub series: Vec<(Vec<(&'static str, String)>, u64)>,
}

/// Renders `families` as OpenMetrics text ([`CONTENT_TYPE`]).
pub fn render_families(families: Vec<Family>) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(FamiliesCollector(families)));
    let mut text = String::new();
    let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
    text
}

#[derive(Debug)]
struct FamiliesCollector(Vec<Family>);

impl Collector for FamiliesCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for f in &self.0 {
            let kind = if f.counter {
                MetricType::Counter
            } else {
                MetricType::Gauge
            };
            let mut family = enc.encode_descriptor(f.name, f.help, None, kind)?;
            for (labels, v) in &f.series {
                let e = family.encode_family(labels)?;
                if f.counter {
                    ConstCounter::new(*v).encode(e)?;
                } else {
                    ConstGauge::new(*v as i64).encode(e)?;
                }
            }
        }
        Ok(())
    }
}

#[derive(Debug)]
struct MonitorCollector(Arc<Monitor>);

type Labels = [(&'static str, String); 2];

/// A per-device counter: its name (without `_total`), help, unit and how to read it.
type DeviceCounter = (
    &'static str,
    &'static str,
    Option<Unit>,
    fn(&DeviceCounters) -> u64,
);

/// A per-device reorder counter: name (without `_total`), help, how to read it.
type ReorderCounter = (
    &'static str,
    &'static str,
    fn(&rdmastream::proto::ReorderStats) -> u64,
);

impl Collector for MonitorCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let m = &self.0;
        m.collect_latency();
        let devices = m.devices();
        let role = m.role();
        let labels = |k: &rdmastream::engine::StreamKey| -> Labels {
            [
                ("sender", k.sender.clone()),
                ("device", k.device.to_string()),
            ]
        };
        let frames_help = match role {
            Role::Sender => "Frames fully written to the receiver",
            Role::Receiver => "Frames received complete and in order",
        };
        let mut counters: Vec<DeviceCounter> = vec![
            ("rdmastream_frames", frames_help, None, |c| get(&c.frames)),
            (
                "rdmastream_payload",
                "Payload bytes of those frames",
                Some(Unit::Bytes),
                |c| get(&c.bytes),
            ),
            (
                "rdmastream_dropped_frames",
                "Frames dropped by the sender's drop-oldest policy (queue full)",
                None,
                |c| get(&c.drops),
            ),
            (
                "rdmastream_gap_packets",
                "Packets given up on by the receiver (never arrived within the reorder window or timeout)",
                None,
                |c| get(&c.gaps),
            ),
        ];
        if role == Role::Sender {
            counters.push((
                "rdmastream_in_place_frames",
                "Frames a source wrote straight into an in-place send block (not copied or rendered by the filling thread)",
                None,
                |c| get(&c.in_place),
            ));
        }
        if role == Role::Receiver {
            counters.extend_from_slice(&[
                (
                    "rdmastream_written_frames",
                    "Frames durably handed on (files renamed into place, buffers pushed)",
                    None,
                    |c| get(&c.written),
                ),
                (
                    "rdmastream_missing_frames",
                    "Frames of a lossless device that never arrived",
                    None,
                    |c| get(&c.missing),
                ),
                (
                    "rdmastream_duplicate_frames",
                    "Frames that arrived again after a reconnect and were already handed on",
                    None,
                    |c| get(&c.duplicates),
                ),
                (
                    "rdmastream_write_errors",
                    "Failed attempts to hand a frame on (disk full, permissions, I/O errors)",
                    None,
                    |c| get(&c.write_errors),
                ),
                (
                    "rdmastream_unwritten_frames",
                    "Frames that could not be handed on and were given up",
                    None,
                    |c| get(&c.unwritten),
                ),
                (
                    "rdmastream_verified_frames",
                    "Synthetic frames found equal to their reference pattern (--verify)",
                    None,
                    |c| get(&c.verified),
                ),
                (
                    "rdmastream_mismatched_frames",
                    "Synthetic frames that differ from their reference pattern (--verify)",
                    None,
                    |c| get(&c.mismatched),
                ),
            ]);
        }
        for (name, help, unit, read) in &counters {
            let mut family =
                enc.encode_descriptor(name, help, unit.as_ref(), MetricType::Counter)?;
            for (k, c, _) in &devices {
                let l = labels(k);
                ConstCounter::new(read(c)).encode(family.encode_family(&l)?)?;
            }
        }
        {
            let help = match role {
                Role::Sender => "Latency from capture to fully written at the receiver",
                Role::Receiver => {
                    "Latency from capture to received complete (clocks of both hosts)"
                }
            };
            let mut family = enc.encode_descriptor(
                "rdmastream_frame_latency",
                help,
                Some(&Unit::Seconds),
                MetricType::Histogram,
            )?;
            for (k, _, h) in &devices {
                let l = labels(k);
                let (sum, buckets) = prometheus_buckets(h);
                family.encode_family(&l)?.encode_histogram::<NoLabelSet>(
                    sum,
                    h.count(),
                    &buckets,
                    None,
                )?;
            }
        }
        if role == Role::Receiver {
            let mut family = enc.encode_descriptor(
                "rdmastream_stream_ended",
                "1 once the device's end of stream passed",
                None,
                MetricType::Gauge,
            )?;
            for (k, c, _) in &devices {
                let l = labels(k);
                ConstGauge::new(get(&c.ended) as i64).encode(family.encode_family(&l)?)?;
            }
        }
        match m.engine() {
            Engine::Sender(e) => {
                let s = &e.machine;
                for (name, help, v) in [
                    (
                        "rdmastream_write_chains",
                        "Write chains (data WRITE + status-byte WRITE) posted",
                        s.writes,
                    ),
                    (
                        "rdmastream_syncs",
                        "Syncs: READs of the receiver's status bytes",
                        s.syncs,
                    ),
                    (
                        "rdmastream_empty_syncs",
                        "Syncs that found no free remote block",
                        s.empty_syncs,
                    ),
                    (
                        "rdmastream_retained_skipped",
                        "Retained (status 2) remote blocks skipped while looking for a free one",
                        s.retained_skipped,
                    ),
                    (
                        "rdmastream_requeued_chains",
                        "Write chains sent again because their connection dropped",
                        s.requeued,
                    ),
                    (
                        "rdmastream_confirmed_blocks",
                        "Blocks of lossless devices the receiver confirmed",
                        s.confirmed,
                    ),
                    (
                        "rdmastream_connections",
                        "Connections made to the receiver (reconnects included)",
                        e.connections,
                    ),
                ] {
                    counter(&mut enc, name, help, None, v)?;
                }
                gauge(
                    &mut enc,
                    "rdmastream_connected",
                    "1 while connected to the receiver",
                    None,
                    m.ready() as i64,
                )?;
            }
            Engine::Receiver(e) => {
                counter(
                    &mut enc,
                    "rdmastream_blocks",
                    "Memory blocks processed (valid or not)",
                    None,
                    e.blocks,
                )?;
                counter(
                    &mut enc,
                    "rdmastream_idle_polls",
                    "Status scans that found no full block",
                    None,
                    e.idle_polls,
                )?;
                {
                    let mut family = enc.encode_descriptor(
                        "rdmastream_refused_connections",
                        "Connections (handshakes) turned away, by reason",
                        None,
                        MetricType::Counter,
                    )?;
                    // Every reason has a series from the start (a rate over a series that
                    // appears mid-run misses its first increase).
                    let all: Vec<&str> = RefusalKind::ALL.iter().map(|k| k.name()).collect();
                    let mut reasons = all.clone();
                    reasons.extend(e.refused.keys().filter(|k| !all.contains(k)));
                    for reason in reasons {
                        let l = [("reason", reason)];
                        let n = e.refused.get(reason).copied().unwrap_or(0);
                        ConstCounter::new(n).encode(family.encode_family(&l)?)?;
                    }
                }
                {
                    let mut family = enc.encode_descriptor(
                        "rdmastream_invalid_blocks",
                        "Blocks rejected by validation, by kind",
                        None,
                        MetricType::Counter,
                    )?;
                    for (kind, n) in &e.invalid {
                        let l = [("kind", *kind)];
                        ConstCounter::new(*n).encode(family.encode_family(&l)?)?;
                    }
                }
                let reorder: [ReorderCounter; 5] = [
                    (
                        "rdmastream_duplicate_packets",
                        "Packets that arrived behind the expected number",
                        |r| r.duplicates,
                    ),
                    (
                        "rdmastream_reordered_packets",
                        "Packets that arrived out of order and were held",
                        |r| r.reordered,
                    ),
                    (
                        "rdmastream_partial_messages",
                        "Messages dropped because a fragment was missing or inconsistent",
                        |r| r.partial_messages,
                    ),
                    (
                        "rdmastream_oversized_messages",
                        "Messages dropped for declaring more than max_frame_bytes",
                        |r| r.oversized,
                    ),
                    (
                        "rdmastream_over_budget_messages",
                        "Messages dropped because the memory budget had no room to reassemble them",
                        |r| r.over_budget,
                    ),
                ];
                for (name, help, read) in reorder {
                    let mut family =
                        enc.encode_descriptor(name, help, None, MetricType::Counter)?;
                    for (k, r) in &e.reorder {
                        let l = labels(k);
                        ConstCounter::new(read(r)).encode(family.encode_family(&l)?)?;
                    }
                }
                gauge(
                    &mut enc,
                    "rdmastream_memory_budget_used",
                    "Bytes of the memory budget (memory_budget) in use by senders",
                    Some(Unit::Bytes),
                    e.memory_used as i64,
                )?;
                gauge(
                    &mut enc,
                    "rdmastream_memory_budget_limit",
                    "The memory budget (memory_budget)",
                    Some(Unit::Bytes),
                    e.memory_limit as i64,
                )?;
                gauge(
                    &mut enc,
                    "rdmastream_disk_used",
                    "Bytes of frame files under the output directory",
                    Some(Unit::Bytes),
                    e.disk_used as i64,
                )?;
                if let Some(b) = e.disk_budget {
                    gauge(
                        &mut enc,
                        "rdmastream_disk_budget_limit",
                        "The disk budget (disk_budget)",
                        Some(Unit::Bytes),
                        b as i64,
                    )?;
                }
                let mut family = enc.encode_descriptor(
                    "rdmastream_deleted_files",
                    "Frame files deleted, by reason (keep, disk_budget)",
                    None,
                    MetricType::Counter,
                )?;
                for (reason, n) in [
                    ("keep", e.evictions.keep),
                    ("disk_budget", e.evictions.disk_budget),
                ] {
                    let l = [("reason", reason)];
                    ConstCounter::new(n).encode(family.encode_family(&l)?)?;
                }
            }
        }
        gauge(
            &mut enc,
            "rdmastream_ready",
            "1 while ready (sender: connected; receiver: listening)",
            None,
            m.ready() as i64,
        )?;
        gauge(
            &mut enc,
            "rdmastream_uptime",
            "Time since the process started",
            Some(Unit::Seconds),
            m.uptime().as_secs() as i64,
        )?;
        Ok(())
    }
}

fn counter(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<Unit>,
    v: u64,
) -> Result<(), std::fmt::Error> {
    let e = enc.encode_descriptor(name, help, unit.as_ref(), MetricType::Counter)?;
    ConstCounter::new(v).encode(e)
}

fn gauge(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<Unit>,
    v: i64,
) -> Result<(), std::fmt::Error> {
    let e = enc.encode_descriptor(name, help, unit.as_ref(), MetricType::Gauge)?;
    ConstGauge::new(v).encode(e)
}

/// The engine's log-bucketed histogram as Prometheus buckets ([`LATENCY_BOUNDS`] and +Inf,
/// counts per bucket, not cumulative) and an estimated sum in seconds. Each engine bucket (at
/// most 9 % wide) goes to the first bound at or above its middle, and adds its middle to the sum.
fn prometheus_buckets(h: &Histogram) -> (f64, Vec<(f64, u64)>) {
    let mut out: Vec<(f64, u64)> = LATENCY_BOUNDS
        .iter()
        .chain(&[f64::INFINITY])
        .map(|&b| (b, 0))
        .collect();
    let mut sum = 0.0;
    for (lower, upper, n) in h.buckets() {
        let mid = if upper == Duration::MAX {
            lower.as_secs_f64()
        } else {
            (lower.as_secs_f64() + upper.as_secs_f64()) / 2.0
        };
        sum += mid * n as f64;
        let slot = out
            .iter()
            .position(|(b, _)| mid <= *b)
            .unwrap_or(out.len() - 1);
        out[slot].1 += n;
    }
    (sum, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::monitor::{ReceiverEngine, SenderEngine};
    use rdmastream::engine::StreamKey;
    use std::sync::atomic::AtomicBool;

    fn scrape(text: &str) -> prometheus_parse::Scrape {
        prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap()
    }

    fn value(s: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        s.samples
            .iter()
            .find(|x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(v)))
            .map(|x| match x.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                _ => f64::NAN,
            })
    }

    #[test]
    fn receiver_metrics_parse_and_carry_the_counters() {
        let m = Monitor::new(
            Role::Receiver,
            Duration::from_secs(1),
            Arc::new(AtomicBool::new(true)),
        );
        let c = Arc::new(DeviceCounters::default());
        for ms in [1, 2, 3, 40] {
            c.frame(1000, Some(Duration::from_millis(ms)));
        }
        c.gaps.store(7, std::sync::atomic::Ordering::Relaxed);
        let key = StreamKey {
            sender: "edge-1".into(),
            device: 3,
        };
        let engine = ReceiverEngine {
            blocks: 99,
            refused: [("authentication", 2)].into(),
            invalid: [("bad-seal", 1)].into(),
            memory_used: 4096,
            memory_limit: 1 << 30,
            ..Default::default()
        };
        m.tick(
            vec![(key, c.clone())],
            Engine::Receiver(engine),
            Duration::from_secs(1),
        );
        // A frame after the tick is in the next scrape at once.
        c.frame(1000, Some(Duration::from_micros(300)));
        let text = render(&m);
        assert!(text.ends_with("# EOF\n"), "{text}");
        let s = scrape(&text);
        let dev = [("sender", "edge-1"), ("device", "3")];
        assert_eq!(
            value(&s, "rdmastream_frames_total", &dev),
            Some(5.0),
            "{text}"
        );
        assert_eq!(
            value(&s, "rdmastream_payload_bytes_total", &dev),
            Some(5000.0)
        );
        assert_eq!(value(&s, "rdmastream_gap_packets_total", &dev), Some(7.0));
        assert_eq!(
            value(&s, "rdmastream_dropped_frames_total", &dev),
            Some(0.0)
        );
        assert_eq!(value(&s, "rdmastream_blocks_total", &[]), Some(99.0));
        assert_eq!(
            value(
                &s,
                "rdmastream_refused_connections_total",
                &[("reason", "authentication")]
            ),
            Some(2.0)
        );
        assert_eq!(
            value(
                &s,
                "rdmastream_refused_connections_total",
                &[("reason", "lost")]
            ),
            Some(0.0)
        );
        assert_eq!(
            value(
                &s,
                "rdmastream_invalid_blocks_total",
                &[("kind", "bad-seal")]
            ),
            Some(1.0)
        );
        assert_eq!(
            value(&s, "rdmastream_memory_budget_used_bytes", &[]),
            Some(4096.0)
        );
        assert_eq!(value(&s, "rdmastream_ready", &[]), Some(1.0));
        let h = s
            .samples
            .iter()
            .find(|x| x.metric == "rdmastream_frame_latency_seconds")
            .expect("latency histogram");
        let prometheus_parse::Value::Histogram(buckets) = &h.value else {
            panic!("{:?}", h.value)
        };
        let le = |b: f64| buckets.iter().find(|x| x.less_than == b).unwrap().count;
        assert_eq!(
            (le(0.0005), le(0.005), le(0.05), le(f64::INFINITY)),
            (1.0, 4.0, 5.0, 5.0)
        );
        assert_eq!(
            value(&s, "rdmastream_frame_latency_seconds_count", &dev),
            Some(5.0)
        );
        let sum = value(&s, "rdmastream_frame_latency_seconds_sum", &dev).unwrap();
        assert!((sum - 0.0463).abs() < 0.0463 * 0.1, "{sum}");
    }

    #[test]
    fn sender_metrics_have_the_machine_counters() {
        let ready = Arc::new(AtomicBool::new(false));
        let m = Monitor::new(Role::Sender, Duration::from_secs(1), ready.clone());
        let mut e = SenderEngine::default();
        e.machine.syncs = 12;
        e.machine.retained_skipped = 3;
        let c = Arc::new(DeviceCounters::default());
        c.in_place.store(4, std::sync::atomic::Ordering::Relaxed);
        m.tick(
            vec![(
                StreamKey {
                    sender: "edge-1".into(),
                    device: 3,
                },
                c,
            )],
            Engine::Sender(e),
            Duration::from_secs(1),
        );
        let s = scrape(&render(&m));
        assert_eq!(value(&s, "rdmastream_syncs_total", &[]), Some(12.0));
        assert_eq!(
            value(
                &s,
                "rdmastream_in_place_frames_total",
                &[("sender", "edge-1"), ("device", "3")]
            ),
            Some(4.0)
        );
        assert_eq!(
            value(&s, "rdmastream_retained_skipped_total", &[]),
            Some(3.0)
        );
        assert_eq!(value(&s, "rdmastream_connected", &[]), Some(0.0));
        ready.store(true, std::sync::atomic::Ordering::Release);
        let s = scrape(&render(&m));
        assert_eq!(value(&s, "rdmastream_connected", &[]), Some(1.0));
        assert_eq!(value(&s, "rdmastream_blocks_total", &[]), None);
    }
}
