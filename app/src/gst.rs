//! GStreamer pipelines as sources and sinks of the `sender` and `receiver` binaries — how real
//! cameras come in and how received streams go on to encoders, files or screens.
//!
//! - [`LaunchSource`]: a launch string ending in `appsink` (e.g. `v4l2src ! videoconvert !
//!   video/x-raw,format=RGB ! appsink`); every sample becomes a frame of one device, its caps
//!   the frame's format.
//! - [`LaunchSinks`]: per configured device, an `appsrc` followed by a launch string (e.g.
//!   `videoconvert ! x264enc ! mp4mux ! filesink location=dev3.mp4`); the stream's caps are set
//!   on the `appsrc`, its end-of-stream becomes EOS (so muxers finish their files). Devices
//!   without a launch string go to another [`FrameSink`].

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gst::prelude::*;

use rdmastream::bytes::Bytes;
use rdmastream::engine::SourceFrame;
use rdmastream::engine::{FrameSink, StreamKey};
use rdmastream::proto::StreamEvent;
use rdmastream::stats::{DeviceCounters, unix_now_ns};

/// How long a sink pipeline may take to finish (EOS through to its sink) before it is stopped.
const FINISH_TIMEOUT: Duration = Duration::from_secs(10);

fn init() -> Result<(), String> {
    gst::init().map_err(|e| format!("cannot initialise GStreamer: {e}"))
}

/// Parses `launch` into a pipeline (a single element is put into one).
fn parse(launch: &str) -> Result<gst::Pipeline, String> {
    let element =
        gst::parse::launch(launch).map_err(|e| format!("cannot parse pipeline {launch:?}: {e}"))?;
    match element.downcast::<gst::Pipeline>() {
        Ok(p) => Ok(p),
        Err(element) => {
            let p = gst::Pipeline::new();
            p.add(&element).map_err(|e| e.to_string())?;
            Ok(p)
        }
    }
}

/// The first error message waiting on `bus`, as text.
fn bus_error(bus: &gst::Bus) -> Option<String> {
    while let Some(msg) = bus.pop_filtered(&[gst::MessageType::Error]) {
        if let gst::MessageView::Error(e) = msg.view() {
            let from = msg
                .src()
                .map(|s| s.path_string().to_string())
                .unwrap_or_default();
            return Some(match e.debug() {
                Some(d) => format!("{from}: {} ({d})", e.error()),
                None => format!("{from}: {}", e.error()),
            });
        }
    }
    None
}

/// A device source: a GStreamer pipeline ending in `appsink`.
pub struct LaunchSource {
    device: u8,
    launch: String,
    pipeline: gst::Pipeline,
    appsink: gst_app::AppSink,
}

impl LaunchSource {
    /// Parses `launch`, which must contain an `appsink` (normally its last element). An
    /// `appsink` left at `max-buffers=0` (unbounded) gets 4, so a slow link pushes back.
    pub fn new(device: u8, launch: &str) -> Result<LaunchSource, String> {
        init()?;
        let pipeline = parse(launch)?;
        let appsink = pipeline
            .iterate_sinks()
            .into_iter()
            .filter_map(Result::ok)
            .find_map(|e| e.downcast::<gst_app::AppSink>().ok())
            .ok_or_else(|| format!("pipeline {launch:?} does not end in appsink"))?;
        if appsink.max_buffers() == 0 {
            appsink.set_max_buffers(4);
        }
        Ok(LaunchSource {
            device,
            launch: launch.to_string(),
            pipeline,
            appsink,
        })
    }

    /// Plays the pipeline and pushes each sample as a frame until the pipeline ends, `stop` is
    /// set, or `push` returns false. Returns the pipeline's error, if it failed.
    pub fn run(
        self,
        stop: &AtomicBool,
        mut push: impl FnMut(SourceFrame) -> bool,
    ) -> Result<(), String> {
        let bus = self.pipeline.bus().expect("a pipeline has a bus");
        let fail = |why: String| {
            let _ = self.pipeline.set_state(gst::State::Null);
            Err(format!(
                "device {}: pipeline {:?}: {why}",
                self.device, self.launch
            ))
        };
        if let Err(e) = self.pipeline.set_state(gst::State::Playing) {
            let why = bus_error(&bus).unwrap_or_else(|| e.to_string());
            return fail(why);
        }
        let mut index = 0u64;
        let mut formats: Option<(gst::Caps, Arc<str>)> = None;
        while !stop.load(Ordering::Acquire) {
            if let Some(why) = bus_error(&bus) {
                return fail(why);
            }
            let Some(sample) = self
                .appsink
                .try_pull_sample(gst::ClockTime::from_mseconds(100))
            else {
                if self.appsink.is_eos() {
                    break;
                }
                continue;
            };
            let (Some(buffer), Some(caps)) = (sample.buffer_owned(), sample.caps_owned()) else {
                continue;
            };
            let format = match &formats {
                Some((c, text)) if *c == caps => text.clone(),
                _ => {
                    let text: Arc<str> = Arc::from(caps.to_string().as_str());
                    formats = Some((caps, text.clone()));
                    text
                }
            };
            let running = buffer.pts().and_then(|pts| {
                sample
                    .segment()
                    .and_then(|s| s.downcast_ref::<gst::ClockTime>())
                    .and_then(|s| s.to_running_time(pts))
            });
            let now = unix_now_ns();
            let timestamp_ns = match (running, self.pipeline.clock(), self.pipeline.base_time()) {
                (Some(r), Some(clock), Some(base)) => {
                    now.saturating_sub(clock.time().saturating_sub(r + base).nseconds())
                }
                _ => now,
            };
            let duration_ns = buffer
                .duration()
                .map_or(0, |d| d.nseconds().min(u32::MAX as u64) as u32);
            let Ok(data) = buffer.into_mapped_buffer_readable() else {
                continue;
            };
            let frame = SourceFrame {
                index,
                timestamp_ns,
                duration_ns,
                pts_ns: running.map(|r| r.nseconds()),
                format,
                data: Bytes::from_owner(data).into(),
            };
            index += 1;
            if !push(frame) {
                break;
            }
        }
        let _ = self.pipeline.set_state(gst::State::Null);
        Ok(())
    }
}

/// One device's running sink pipeline.
struct DevicePipeline {
    pipeline: gst::Pipeline,
    appsrc: gst_app::AppSrc,
    caps: Option<gst::Caps>,
    /// The first frame's timestamp: buffers start at 0.
    first_ns: Option<u64>,
    frames_before_caps: u64,
    failed: bool,
    /// The sender session this pipeline carries, and the newest frame index pushed.
    session: u64,
    last: Option<u64>,
}

impl DevicePipeline {
    /// Sends EOS and waits (bounded) until it went through, then stops the pipeline.
    fn finish(self, key: &StreamKey) {
        if !self.failed {
            let _ = self.appsrc.end_of_stream();
            let bus = self.pipeline.bus().expect("a pipeline has a bus");
            match bus.timed_pop_filtered(
                gst::ClockTime::from_nseconds(FINISH_TIMEOUT.as_nanos() as u64),
                &[gst::MessageType::Eos, gst::MessageType::Error],
            ) {
                Some(msg) => {
                    if let gst::MessageView::Error(e) = msg.view() {
                        tracing::error!("{key}: sink pipeline: {}", e.error());
                    }
                }
                None => tracing::warn!(
                    "{key}: sink pipeline did not finish within {FINISH_TIMEOUT:?}; stopped"
                ),
            }
        }
        let _ = self.pipeline.set_state(gst::State::Null);
    }
}

/// Per configured device, frames go into `appsrc ! <launch>`; other devices go to `fallback`.
///
/// In a launch string `{sender}` and `{device}` are replaced by the sender name and device
/// number, so that several senders' streams of one device number get separate files, and
/// `{session}` by when the stream started at this receiver (UTC, to the millisecond), so that a
/// later stream (the device ended and came back, the sender or the receiver restarted) never
/// replaces an earlier stream's file.
pub struct LaunchSinks {
    launches: HashMap<u8, String>,
    fallback: Arc<dyn FrameSink>,
    running: Mutex<HashMap<StreamKey, DevicePipeline>>,
}

impl LaunchSinks {
    /// Checks that every launch string parses (with an `appsrc` in front) before anything
    /// streams.
    pub fn new(
        launches: HashMap<u8, String>,
        fallback: Arc<dyn FrameSink>,
    ) -> Result<LaunchSinks, String> {
        init()?;
        for (device, launch) in &launches {
            let key = StreamKey {
                sender: "check".into(),
                device: *device,
            };
            let (pipeline, _) =
                Self::build(launch, &key).map_err(|e| format!("device {device}: {e}"))?;
            let _ = pipeline.set_state(gst::State::Null);
        }
        Ok(LaunchSinks {
            launches,
            fallback,
            running: Mutex::new(HashMap::new()),
        })
    }

    fn build(launch: &str, key: &StreamKey) -> Result<(gst::Pipeline, gst_app::AppSrc), String> {
        let launch = launch
            .replace("{sender}", &key.sender)
            .replace("{device}", &key.device.to_string())
            .replace("{session}", &session_stamp(unix_now_ns()));
        let pipeline = parse(&format!("appsrc name=rdmastream-in ! {launch}"))?;
        let appsrc = pipeline
            .by_name("rdmastream-in")
            .and_then(|e| e.downcast::<gst_app::AppSrc>().ok())
            .ok_or("no appsrc")?;
        appsrc.set_format(gst::Format::Time);
        appsrc.set_is_live(true);
        // Back-pressure: a slow pipeline makes the receiver (and so the sender) wait.
        appsrc.set_block(true);
        appsrc.set_max_bytes(64 << 20);
        Ok((pipeline, appsrc))
    }

    fn start(&self, launch: &str, key: &StreamKey, session: u64) -> DevicePipeline {
        let started = Self::build(launch, key).and_then(|(pipeline, appsrc)| {
            pipeline
                .set_state(gst::State::Playing)
                .map_err(|e| {
                    let bus = pipeline.bus().expect("a pipeline has a bus");
                    bus_error(&bus).unwrap_or_else(|| e.to_string())
                })
                .map(|_| (pipeline, appsrc))
        });
        match started {
            Ok((pipeline, appsrc)) => {
                tracing::info!("{key}: streaming into appsrc ! {launch}");
                DevicePipeline {
                    pipeline,
                    appsrc,
                    caps: None,
                    first_ns: None,
                    frames_before_caps: 0,
                    failed: false,
                    session,
                    last: None,
                }
            }
            Err(e) => {
                tracing::error!("{key}: cannot start sink pipeline: {e}");
                DevicePipeline {
                    pipeline: gst::Pipeline::new(),
                    appsrc: gst_app::AppSrc::builder().build(),
                    caps: None,
                    first_ns: None,
                    frames_before_caps: 0,
                    failed: true,
                    session,
                    last: None,
                }
            }
        }
    }
}

/// `YYYYMMDD-HHMMSS.mmm` (UTC) of `unix_ns`: sorts in time order, safe in file names.
pub fn session_stamp(unix_ns: u64) -> String {
    let secs = unix_ns / 1_000_000_000;
    let ms = (unix_ns / 1_000_000) % 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}.{ms:03}",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

impl FrameSink for LaunchSinks {
    fn handle(
        &self,
        key: &StreamKey,
        session: u64,
        counters: &Arc<DeviceCounters>,
        event: StreamEvent,
    ) {
        let Some(launch) = self.launches.get(&key.device) else {
            self.fallback.handle(key, session, counters, event);
            return;
        };
        let mut running = self.running.lock().unwrap();
        if let StreamEvent::EndOfStream { ack, .. } = &event {
            if let Some(p) = running.remove(key) {
                drop(running);
                p.finish(key);
            }
            rdmastream::proto::ack::settle(ack);
            return;
        }
        // A new session of the sender (it restarted without ending its streams): the earlier
        // stream's pipeline is finished, the new one gets its own.
        if running.get(key).is_some_and(|p| p.session != session)
            && let Some(old) = running.remove(key)
        {
            old.finish(key);
        }
        let p = running
            .entry(key.clone())
            .or_insert_with(|| self.start(launch, key, session));
        if p.failed {
            // Nothing can take this device's frames: a lossless one stays unconfirmed (its
            // blocks are not freed), so its sender waits instead of losing them silently.
            return;
        }
        if let Some(e) = bus_error(&p.pipeline.bus().expect("a pipeline has a bus")) {
            tracing::error!("{key}: sink pipeline failed: {e}; dropping this device's frames");
            p.failed = true;
            let _ = p.pipeline.set_state(gst::State::Null);
            return;
        }
        match event {
            StreamEvent::Format {
                descriptor, ack, ..
            } => {
                rdmastream::proto::ack::settle(&ack);
                let text = String::from_utf8_lossy(&descriptor);
                match gst::Caps::from_str(text.trim()) {
                    Ok(caps) => {
                        p.appsrc.set_caps(Some(&caps));
                        p.caps = Some(caps);
                    }
                    Err(_) => rdmastream::warn_limited!(
                        format!("caps-{key}"),
                        "{key}: format {} is not GStreamer caps",
                        rdmastream::logsafe::clean(&text, rdmastream::logsafe::MAX_PEER_TEXT)
                    ),
                }
            }
            StreamEvent::Frame(f) => {
                if p.last.is_some_and(|l| f.index <= l) {
                    // Sent again after a reconnect: already pushed.
                    counters.duplicates.fetch_add(1, Ordering::Relaxed);
                    rdmastream::proto::ack::settle(&f.ack);
                    return;
                }
                p.last = Some(f.index);
                if p.caps.is_none() {
                    if p.frames_before_caps == 0 {
                        tracing::warn!("{key}: frames before any format; dropped until one comes");
                    }
                    p.frames_before_caps += 1;
                    rdmastream::proto::ack::settle(&f.ack);
                    return;
                }
                let ts = f.pts_ns.unwrap_or(f.timestamp_ns);
                let first = *p.first_ns.get_or_insert(ts);
                let ack = f.ack.clone();
                let mut buffer = gst::Buffer::from_slice(f.data);
                {
                    let b = buffer.get_mut().expect("new buffer");
                    b.set_pts(gst::ClockTime::from_nseconds(ts.saturating_sub(first)));
                    if f.duration_ns > 0 {
                        b.set_duration(gst::ClockTime::from_nseconds(f.duration_ns as u64));
                    }
                    b.set_offset(f.index);
                }
                let appsrc = p.appsrc.clone();
                // push_buffer may wait for room; not under the map's lock.
                drop(running);
                match appsrc.push_buffer(buffer) {
                    Ok(_) => {
                        counters.written.fetch_add(1, Ordering::Relaxed);
                        rdmastream::proto::ack::settle(&ack);
                    }
                    Err(e) => {
                        counters.write_errors.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!("{key}: appsrc refused a buffer: {e:?}");
                    }
                }
            }
            StreamEvent::EndOfStream { .. } => unreachable!("handled above"),
        }
    }

    fn flush(&self) {
        let running: Vec<_> = self.running.lock().unwrap().drain().collect();
        let started = Instant::now();
        for (key, p) in running {
            p.finish(&key);
        }
        if !self.launches.is_empty() {
            tracing::debug!("sink pipelines finished in {:?}", started.elapsed());
        }
        self.fallback.flush();
    }
}
