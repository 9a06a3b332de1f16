//! Running the binaries: what happens between loading a valid config and the exit code, so the
//! `main.rs` files keep only the command line, loading and wiring.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdmastream::engine::{FrameSink, ReceiverHandle, SenderHandle, SenderOptions, StreamKey};
use rdmastream::proto::Budget;
use rdmastream::proto::handshake::Key;
use rdmastream::stats::get;
use rdmastream::transport::Connector;

use crate::Error;
use crate::cli::{ByteSize, ConfigError, every, every_until};
use crate::config::{Device, SenderConfig, Source};
use crate::http::HttpServer;
use crate::monitor::{Engine, Monitor, ReceiverEngine, Role, SenderEngine};
use crate::sink::DirectorySink;
use crate::source::{Producer, SourceKind};
use crate::thumbs::{ThumbnailTap, Thumbnails};
use crate::watch::{LinkWatch, watched};

/// What watches a running binary: its [`Monitor`] (status line, table), the SIGUSR1 request
/// for the table, and with `--metrics` the HTTP server (and on a receiver the thumbnails).
pub struct Observer {
    pub monitor: Arc<Monitor>,
    /// Receiver with `--metrics`: the thumbnails the status page shows.
    pub thumbs: Option<Arc<Thumbnails>>,
    /// What `/readyz` reports (sender: connected; receiver: listening).
    ready: Arc<AtomicBool>,
    table: Arc<AtomicBool>,
    http: Option<HttpServer>,
}

impl Observer {
    /// Starts watching: `metrics` (`--metrics` / `metrics`) starts the HTTP server at once,
    /// so an address in use fails before anything streams.
    pub fn start(
        role: Role,
        metrics: Option<&str>,
        status_interval: f64,
    ) -> Result<Observer, Error> {
        let ready = Arc::new(AtomicBool::new(false));
        let monitor = Monitor::new(
            role,
            Duration::from_secs_f64(status_interval),
            ready.clone(),
        );
        let thumbs = (role == Role::Receiver && metrics.is_some()).then(Thumbnails::new);
        let http = match metrics {
            Some(addr) => Some(HttpServer::start(addr, monitor.clone(), thumbs.clone())?),
            None => None,
        };
        Ok(Observer {
            monitor,
            thumbs,
            ready,
            table: crate::cli::table_requests()?,
            http,
        })
    }

    /// Where the HTTP server listens, if there is one.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.http.as_ref().map(HttpServer::local_addr)
    }

    /// The receiver's sink with the thumbnail tap in front (when there is a status page).
    pub fn tap(&self, sink: Arc<dyn FrameSink>) -> Arc<dyn FrameSink> {
        match &self.thumbs {
            Some(t) => Arc::new(ThumbnailTap::new(sink, t.clone())),
            None => sink,
        }
    }

    /// Logs the short status line, and the table when SIGUSR1 asked for it.
    fn report(&self) {
        tracing::info!("status: {}", self.monitor.status_line());
        if self.table.swap(false, Ordering::AcqRel) {
            self.log_table();
        }
    }

    fn log_table(&self) {
        tracing::info!("devices:\n{}", self.monitor.table().trim_end());
    }
}

/// A device's source, ready to run on its thread.
enum Runner {
    Builtin(Producer),
    #[cfg(feature = "gstreamer")]
    Gstreamer(crate::gst::LaunchSource),
}

/// The in-place send blocks the sender adds to its `send_blocks` (which stay the filling
/// thread's): `in_place_blocks` as configured, else as many as `send_blocks` when a source's
/// frames may fit one block (a synthetic source's frames are rendered into them, an images or
/// GStreamer source's copied into them, on the source's own thread), else none.
fn in_place_blocks(cfg: &SenderConfig, devices: &[Device]) -> usize {
    cfg.in_place_blocks.unwrap_or_else(|| {
        let capacity = rdmastream::proto::payload_capacity(cfg.block_size);
        let fits = devices.iter().any(|d| match &d.kind {
            Source::Builtin(SourceKind::CameraSynthetic { width, height, .. })
            | Source::Builtin(SourceKind::Images { width, height, .. }) => {
                *width as usize * *height as usize * 3 <= capacity
            }
            Source::Builtin(SourceKind::RadarSynthetic { size, .. }) => *size <= capacity,
            // A sample's size is known only when it comes: many (compressed video, smaller
            // raw frames) fit.
            Source::Gstreamer(_) => true,
        });
        if fits { cfg.send_blocks } else { 0 }
    })
}

/// Runs a sender: builds every device's source (a source that cannot be built is a
/// [`ConfigError`] naming the device), streams through `connector` until the sources end,
/// `duration` seconds pass or `stop` is set (Ctrl-C), then delivers what is left within the
/// shutdown grace period and logs the per-device table and the summary; a short status line
/// every `status_interval`, the table on SIGUSR1, metrics with `metrics`.
/// `Err(Error::Undelivered)` when frames were left.
pub fn sender(
    cfg: &SenderConfig,
    file: &Path,
    devices: &[Device],
    key: Option<Key>,
    connector: Box<dyn Connector>,
    duration: Option<f64>,
    stop: crate::cli::Stop,
) -> Result<(), Error> {
    // Build every producer first so a bad image directory fails before anything streams.
    let mut producers = Vec::new();
    for d in devices {
        // A source that cannot be built (no images in `dir`, a pipeline that does not parse)
        // is bad input: a config error naming the device, exit 2.
        let source_key = match &d.kind {
            Source::Gstreamer(_) => "pipeline",
            Source::Builtin(SourceKind::Images { .. }) => "dir",
            Source::Builtin(_) => "source",
        };
        let bad = |why: String| {
            ConfigError::new(
                file,
                format!("device[{}].{source_key}", d.entry),
                format!("device {}: {why}", d.id),
            )
        };
        let p = match &d.kind {
            Source::Builtin(kind) => Runner::Builtin(
                Producer::new(d.id, kind)
                    .map_err(|e| bad(crate::cli::describe_error(&e)))?
                    .starting_after(d.start_after),
            ),
            #[cfg(feature = "gstreamer")]
            Source::Gstreamer(launch) => {
                Runner::Gstreamer(crate::gst::LaunchSource::new(d.id, launch).map_err(bad)?)
            }
            #[cfg(not(feature = "gstreamer"))]
            Source::Gstreamer(_) => {
                return Err(bad("this build has no GStreamer support".into()).into());
            }
        };
        producers.push((d, p));
    }
    let observer = Observer::start(Role::Sender, cfg.metrics.as_deref(), cfg.status_interval)?;
    let link = Arc::new(LinkWatch {
        connected: observer.ready.clone(),
        ..Default::default()
    });
    let connector = watched(connector, link.clone());
    // Synthetic sources render their frames on their own threads into in-place blocks
    // (`DeviceInput::push_rendering_here`), added to the filling thread's `send_blocks`.
    let in_place_blocks = in_place_blocks(cfg, devices);
    let opts = SenderOptions {
        name: cfg.name.clone(),
        key,
        send_blocks: cfg.send_blocks + in_place_blocks,
        in_place_blocks,
        block_size: cfg.block_size,
        max_outstanding: cfg.max_outstanding,
        first_packet: cfg.first_packet,
        sliding_window: cfg.mechanism == "sliding-window",
        // The baseline sends each message in its own block on its device's own connection, as
        // the paper's does; coalescing (which mixes devices in a block) is ours.
        coalesce_wait: if cfg.mechanism == "sliding-window" {
            Duration::ZERO
        } else {
            Duration::from_micros(cfg.coalesce_wait_us)
        },
        ..Default::default()
    };
    tracing::info!(
        "sender '{}' -> {} ({}, {} mechanism): {} devices, {} send blocks of {} bytes (+ {} for frames rendered in place)",
        cfg.name,
        cfg.receiver,
        cfg.transport,
        cfg.mechanism,
        devices.len(),
        cfg.send_blocks,
        cfg.block_size,
        in_place_blocks
    );
    let mut sender = SenderHandle::start(opts, connector, cfg.queue_depth)?;
    let mut sources = Vec::new();
    // Synthetic sources render each frame on their own thread straight into an in-place send
    // block when one is free (else the filling thread renders it into one of its own); a
    // GStreamer source's upstream writes into such blocks through its appsink's pool, and the
    // images source's frames (and GStreamer samples in upstream's own buffers) are copied the
    // same way (over shm into a receiver's block when one is on offer: one copy, no hand-over
    // to the filling thread). With no in-place blocks `push_writing_here` pushes every frame.
    // Sources that ended, counted before they ring the main thread awake.
    let ended = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for (d, producer) in producers {
        let input = sender.add_device(d.id, d.policy);
        let (ring, ended, frames) = (stop.clone(), ended.clone(), d.frames);
        #[cfg(feature = "gstreamer")]
        let policy = d.policy;
        let stop = stop.flag().clone();
        sources.push(
            std::thread::Builder::new()
                .name(format!("source-{}", d.id))
                .spawn(move || {
                    let push = |f| input.push_writing_here(f);
                    match producer {
                        Runner::Builtin(p) => p.run(&stop, frames, push),
                        #[cfg(feature = "gstreamer")]
                        Runner::Gstreamer(p) => {
                            if let Err(e) = p.run(&stop, &input, policy) {
                                tracing::error!("{e}; ending the device");
                            }
                        }
                    }
                    input.end();
                    // The main thread looks at once whether every source has ended.
                    ended.fetch_add(1, Ordering::AcqRel);
                    ring.ring();
                })
                .map_err(|source| Error::Io {
                    what: "starting a source thread".into(),
                    source,
                })?,
        );
    }
    let started = Instant::now();
    let deadline = duration.map(|s| started + Duration::from_secs_f64(s.max(0.0)));
    let counters = sender.counters();
    let name = cfg.name.clone();
    let tick = |sender: &SenderHandle, elapsed: Duration| {
        let devices = counters
            .all()
            .into_iter()
            .map(|(device, c)| {
                let key = StreamKey {
                    sender: name.clone(),
                    device,
                };
                (key, c)
            })
            .collect();
        let engine = SenderEngine {
            machine: sender.machine_stats(),
            connections: link.connections.load(Ordering::Relaxed),
        };
        observer
            .monitor
            .tick(devices, Engine::Sender(engine), elapsed);
    };
    // The devices are in the metrics from the start, not from the first status line.
    tick(&sender, Duration::ZERO);
    // A tick at the deadline too, so that `--duration` is kept to the moment.
    every_until(
        Duration::from_secs_f64(cfg.status_interval),
        deadline,
        &stop,
        |elapsed| {
            tick(&sender, elapsed);
            observer.report();
            if sender.is_finished() {
                return false;
            }
            // Every source ended by itself (a frame count, finite gstreamer pipelines): flush
            // and exit.
            if ended.load(Ordering::Acquire) == sources.len() {
                return false;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                stop.ask();
            }
            true
        },
    );
    // Flushing: everything the sources produced is delivered (for lossless devices: confirmed
    // by the receiver), however long that takes while nobody asked to stop; once a stop was
    // asked for (Ctrl-C, --duration), for at most the grace period, whatever the link does.
    let grace = Duration::from_secs_f64(cfg.shutdown_grace);
    sender.close();
    let mut give_up: Option<Instant> = None;
    let mut told = Instant::now();
    while !(sender.is_finished() && sources.iter().all(|s| s.is_finished())) {
        // The sending thread gave up (refused, failed): nothing more can be delivered, so the
        // sources stop too and the error is reported below.
        if sender.is_finished() {
            stop.ask();
        }
        if give_up.is_none() && stop.is_asked() {
            give_up = Some(Instant::now() + grace);
        }
        if give_up.is_some_and(|t| Instant::now() >= t) {
            break;
        }
        if told.elapsed() >= Duration::from_secs_f64(cfg.status_interval) {
            // Still ticking: /healthz stays 200 while what is left is delivered.
            tick(&sender, told.elapsed());
            told = Instant::now();
            tracing::info!(
                "stopping: delivering what is left{}",
                give_up.map_or(String::new(), |t| format!(
                    " (giving up in {:.1} s)",
                    t.saturating_duration_since(Instant::now()).as_secs_f64()
                ))
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.ask();
    tick(&sender, told.elapsed());
    observer.monitor.finish();
    let report = sender.finish(Duration::ZERO)?;
    for s in sources {
        let _ = s.join();
    }
    let all = counters.all();
    let total: u64 = all.iter().map(|(_, c)| get(&c.frames)).sum();
    let drops: u64 = all.iter().map(|(_, c)| get(&c.drops)).sum();
    let in_place: u64 = all.iter().map(|(_, c)| get(&c.in_place)).sum();
    observer.log_table();
    tracing::info!(
        "done after {:.1}s: {total} frames written ({in_place} written in place by their sources, {} of them straight into the receiver's memory), {drops} dropped, {} write chains ({} posted by the thread handing the block over, not the sending thread), {} syncs ({} found nothing free, retained-skipped {}), {} connections, {} blocks unsent",
        started.elapsed().as_secs_f64(),
        report.machine.placed,
        report.machine.writes,
        report.driven_here,
        report.machine.syncs,
        report.machine.empty_syncs,
        report.machine.retained_skipped,
        report.connections,
        report.unsent
    );
    if report.unsent > 0 || report.undelivered_frames > 0 {
        return Err(Error::Undelivered {
            frames: report.undelivered_frames,
            blocks: report.unsent as u64,
            receiver: cfg.receiver.clone(),
            grace: cfg.shutdown_grace,
        });
    }
    Ok(())
}

/// How a receiver runs, besides its engine: see [`receiver`].
pub struct ReceiverRun<'a> {
    pub files: &'a DirectorySink,
    pub status_interval: f64,
    pub exit_after_eos: bool,
    pub verify: bool,
    /// The transport's count of work requests the receiver posted (0 for the status-byte
    /// mechanism; the sliding window posts receives and ACK SENDs), read at the end.
    pub posted_work_requests: fn() -> u64,
    /// The memory budget senders take their regions and copies from.
    pub memory: Arc<Budget>,
    /// The disk budget of the output directory (`None`: none).
    pub disk_budget: Option<u64>,
    pub observer: Observer,
}

/// Runs a started receiver: a short status line every `status_interval` (the per-device table
/// on SIGUSR1; metrics and the status page with `metrics`) until `stop` is set (Ctrl-C) or,
/// with `exit_after_eos`, every sender that connected has ended its streams; then stops it,
/// logs the table and the summary and returns the exit code: 4 when frames of lossless devices
/// are missing from the output, 3 when `verify` found a frame that differs from its reference,
/// else 0.
pub fn receiver(receiver: ReceiverHandle, run: ReceiverRun<'_>, stop: crate::cli::Stop) -> i32 {
    let ReceiverRun {
        files,
        status_interval,
        exit_after_eos,
        verify,
        posted_work_requests,
        memory,
        disk_budget,
        observer,
    } = run;
    // Listening since the handle started.
    observer.ready.store(true, Ordering::Release);
    let tick = |elapsed: Duration| {
        let engine = ReceiverEngine {
            blocks: receiver.blocks(),
            idle_polls: receiver.idle_polls(),
            refused: receiver
                .refused_by_kind()
                .into_iter()
                .map(|(k, n)| (k.name(), n))
                .collect(),
            invalid: receiver
                .invalid()
                .all()
                .into_iter()
                .map(|(k, n)| (k.name(), n))
                .collect(),
            reorder: receiver.reorder_stats().into_iter().collect(),
            memory_used: memory.used() as u64,
            memory_limit: memory.limit() as u64,
            disk_used: files.disk_used(),
            disk_budget,
            evictions: files.evictions(),
        };
        observer
            .monitor
            .tick(receiver.counters().all(), Engine::Receiver(engine), elapsed);
    };
    // The budgets are in the metrics from the start, not from the first status line.
    tick(Duration::ZERO);
    let mut last = Instant::now();
    every(Duration::from_secs_f64(status_interval), &stop, |elapsed| {
        tick(elapsed);
        last = Instant::now();
        observer.report();
        !(exit_after_eos && receiver.all_senders_ended())
    });
    // The final counts, for the metrics until the server stops and for the table.
    tick(last.elapsed());
    observer.monitor.finish();
    let counters = receiver.counters().all();
    let reorder = receiver.reorder_stats();
    let invalid = receiver.invalid().all();
    let (blocks, idle, refused) = (receiver.blocks(), receiver.idle_polls(), receiver.refused());
    let refused_by_kind = receiver.refused_by_kind();
    receiver.stop();
    observer.log_table();
    let mut mismatched = 0;
    // Frames of lossless devices that never made it to the output: never a success.
    let mut lost = 0;
    for (key, c) in &counters {
        let r = reorder
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, r)| *r)
            .unwrap_or_default();
        mismatched += get(&c.mismatched);
        tracing::info!(
            "summary {key}: {} frames received, {} written{}, {} MB, verified {} mismatched {}, missing {} duplicate frames {} write errors {} unwritten {}, packets: gaps {} duplicates {} reordered {} partial {} oversized {} over-budget {}{}",
            get(&c.frames),
            get(&c.written),
            if get(&c.reliable) == 1 {
                " (lossless)"
            } else {
                ""
            },
            get(&c.bytes) / 1_000_000,
            get(&c.verified),
            get(&c.mismatched),
            get(&c.missing),
            get(&c.duplicates),
            get(&c.write_errors),
            get(&c.unwritten),
            r.gap_packets,
            r.duplicates,
            r.reordered,
            r.partial_messages,
            r.oversized,
            r.over_budget,
            if get(&c.ended) == 1 { ", ended" } else { "" }
        );
        if get(&c.reliable) == 1 {
            lost += get(&c.missing) + get(&c.unwritten);
        }
    }
    let p = observer.monitor.total_latency();
    let ms = |d: Option<std::time::Duration>| match d {
        Some(d) => format!("{:.3} ms", d.as_secs_f64() * 1e3),
        None => "- (no frames)".to_string(),
    };
    let listed = |m: Vec<(String, u64)>| {
        if m.is_empty() {
            "none".to_string()
        } else {
            m.iter()
                .map(|(k, n)| format!("{n} {k}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    tracing::info!(
        "summary: {blocks} blocks, {idle} idle polls, {refused} connections refused ({}), {} work requests posted by the receiver, invalid blocks: {}, latency p50 {} p99 {}",
        listed(
            refused_by_kind
                .iter()
                .map(|(k, n)| (k.to_string(), *n))
                .collect()
        ),
        posted_work_requests(),
        listed(invalid.iter().map(|(k, n)| (k.to_string(), *n)).collect()),
        ms(p.quantile(0.5)),
        ms(p.quantile(0.99))
    );
    let ev = files.evictions();
    tracing::info!(
        "summary: output {} on disk, {} frame files deleted for keep, {} for disk_budget",
        ByteSize(files.disk_used()),
        ev.keep,
        ev.disk_budget
    );
    if lost > 0 {
        eprintln!(
            "receiver: FAILED: {lost} frames of lossless devices are missing from the output \
             (see the summary lines: missing, unwritten)"
        );
        return 4;
    }
    if verify {
        let verified: u64 = counters.iter().map(|(_, c)| get(&c.verified)).sum();
        if mismatched > 0 {
            eprintln!(
                "receiver: verify FAILED: {mismatched} frames differ from the reference pattern"
            );
            return 3;
        }
        tracing::info!("verify: all {verified} synthetic frames match the reference pattern");
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks_for(text: &str) -> usize {
        let file = Path::new("sender.toml");
        let cfg = SenderConfig::parse(
            &format!("name = \"t\"\nreceiver = \"127.0.0.1:1\"\n{text}"),
            file,
        )
        .unwrap();
        let devices = cfg.validate(file).unwrap();
        in_place_blocks(&cfg, &devices)
    }

    #[test]
    fn in_place_blocks_default_to_send_blocks_when_a_sources_frames_fit_one_block() {
        let camera = "[[device]]\nid = 1\nsource = \"camera-synthetic\"\n";
        let radar = |size: usize| {
            format!(
                "[[device]]\nid = 9\nsource = \"radar-synthetic\"\nsize = {size}\npolicy = \"block\"\n"
            )
        };
        // Cameras (and radars) whose frames fit one block render in place.
        assert_eq!(blocks_for(camera), 8);
        assert_eq!(blocks_for(&format!("send_blocks = 5\n{camera}")), 5);
        assert_eq!(blocks_for(&radar(1000)), 8);
        assert_eq!(blocks_for(&format!("{camera}{}", radar(3_000_000))), 8);
        // Frames larger than a block: none.
        assert_eq!(blocks_for(&radar(3_000_000)), 0);
        assert_eq!(
            blocks_for("block_size = 65536\n[[device]]\nid = 1\nsource = \"camera-synthetic\"\n"),
            0
        );
        // Images and GStreamer samples are copied into them on the source's thread.
        let images = "[[device]]\nid = 2\nsource = \"images\"\ndir = \".\"\n";
        assert_eq!(blocks_for(images), 8);
        assert_eq!(blocks_for(&format!("block_size = 65536\n{images}")), 0);
        assert_eq!(
            blocks_for(
                "[[device]]\nid = 3\nsource = \"gstreamer\"\npipeline = \"videotestsrc ! appsink\"\n"
            ),
            8
        );
        // Configured: as configured, 0 included.
        assert_eq!(blocks_for(&format!("in_place_blocks = 3\n{camera}")), 3);
        assert_eq!(blocks_for(&format!("in_place_blocks = 0\n{camera}")), 0);
    }
}
