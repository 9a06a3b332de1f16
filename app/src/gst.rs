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

pub mod pool;

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gst::prelude::*;

use rdmastream::bytes::Bytes;
use rdmastream::engine::{DeviceInput, DropPolicy, FrameMeta, SourceFrame};
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
    /// Parses `launch`, which must contain an `appsink` (normally its last element).
    pub fn new(device: u8, launch: &str) -> Result<LaunchSource, String> {
        init()?;
        let pipeline = parse(launch)?;
        let appsink = pipeline
            .iterate_sinks()
            .into_iter()
            .filter_map(Result::ok)
            .find_map(|e| e.downcast::<gst_app::AppSink>().ok())
            .ok_or_else(|| format!("pipeline {launch:?} does not end in appsink"))?;
        // It queues only the frames' empty stand-ins (see `run`): still, bounded.
        if appsink.max_buffers() == 0 {
            appsink.set_max_buffers(4);
        }
        if appsink.is_drop() {
            tracing::warn!(
                "device {device}: the pipeline's appsink drop=true drops nothing: the sender takes each frame before the appsink queues it; policy = \"drop-oldest\" drops frames the link cannot take"
            );
        }
        Ok(LaunchSource {
            device,
            launch: launch.to_string(),
            pipeline,
            appsink,
        })
    }

    /// Plays the pipeline and hands each buffer reaching the `appsink` to `input` as a frame
    /// until the pipeline ends, `stop` is set, or the sender shut down. Returns the pipeline's
    /// error, if it failed.
    ///
    /// The frames are taken on the pipeline's streaming thread, by a probe on the `appsink`'s
    /// sink pad, before `appsink` queues them: `appsink` keeps the last sample pulled (so a
    /// frame's block, written in place, would wait there for the next one). It gets an empty
    /// buffer with the frame's timestamps instead, and still does what a sink does for the
    /// pipeline (preroll, `sync` to the clock, end-of-stream); its `max-buffers` and `drop`
    /// no longer matter, the device's `policy` does.
    ///
    /// When the sender has in-place blocks, the probe also answers upstream's allocation
    /// query with a pool of send blocks ([`pool::BlockPool`]; `appsink` itself proposes none
    /// before GStreamer 1.24), so an upstream that writes into downstream's buffers
    /// (`videotestsrc`, `videoconvert`, `v4l2src io-mode=userptr`) writes each frame straight
    /// into a send block, over shm into the receiver's memory, and the frame is committed
    /// without a copy. For a `drop-oldest` device an acquire waits only a moment
    /// (`DROP_OLDEST_PATIENCE`): with no block free by then it gets a plain buffer. Any other
    /// buffer is copied ([`DeviceInput::push_writing_here`]). The log says how many went which way.
    pub fn run(
        self,
        stop: &Arc<AtomicBool>,
        input: &DeviceInput,
        policy: DropPolicy,
    ) -> Result<(), String> {
        let bus = self.pipeline.bus().expect("a pipeline has a bus");
        let fail = |why: String| {
            let _ = self.pipeline.set_state(gst::State::Null);
            Err(format!(
                "device {}: pipeline {:?}: {why}",
                self.device, self.launch
            ))
        };
        let pool = (input.in_place_blocks() > 0).then(|| self.propose_pool(stop, input, policy));
        let taker = Arc::new(FrameTaker {
            input: input.clone(),
            outstanding: pool.as_ref().map(|p| p.outstanding()),
            format: Mutex::new(None),
            taken: AtomicU64::new(0),
            in_place: AtomicU64::new(0),
            in_receiver: AtomicU64::new(0),
            ended: AtomicBool::new(false),
        });
        self.take_frames(taker.clone());
        if let Err(e) = self.pipeline.set_state(gst::State::Playing) {
            let why = bus_error(&bus).unwrap_or_else(|| e.to_string());
            return fail(why);
        }
        while !stop.load(Ordering::Acquire) && !taker.ended.load(Ordering::Acquire) {
            if let Some(why) = bus_error(&bus) {
                return fail(why);
            }
            // Only the stand-ins of frames taken already come out of the appsink.
            if self
                .appsink
                .try_pull_sample(gst::ClockTime::from_mseconds(100))
                .is_none()
                && self.appsink.is_eos()
            {
                break;
            }
        }
        let _ = self.pipeline.set_state(gst::State::Null);
        if let Some(pool) = pool {
            pool.detach();
        }
        let (taken, in_place, in_receiver) = (
            taker.taken.load(Ordering::Relaxed),
            taker.in_place.load(Ordering::Relaxed),
            taker.in_receiver.load(Ordering::Relaxed),
        );
        tracing::info!(
            "device {}: {taken} frames from the pipeline: {in_place} written by it straight into send blocks ({in_receiver} of them the receiver's memory), {} copied",
            self.device,
            taken - in_place
        );
        Ok(())
    }

    /// Takes every buffer (and every buffer of a list) reaching the `appsink` as a frame,
    /// passing an empty stand-in on.
    fn take_frames(&self, taker: Arc<FrameTaker>) {
        let element = self.appsink.clone().upcast::<gst::Element>().downgrade();
        let pad = self
            .appsink
            .static_pad("sink")
            .expect("appsink has a sink pad");
        pad.add_probe(
            gst::PadProbeType::BUFFER | gst::PadProbeType::BUFFER_LIST,
            move |pad, info| {
                let Some(element) = element.upgrade() else {
                    return gst::PadProbeReturn::Ok;
                };
                match info.data.take() {
                    Some(gst::PadProbeData::Buffer(buffer)) => {
                        let stand_in = stand_in(&buffer);
                        taker.take(pad, &element, buffer);
                        info.data = Some(gst::PadProbeData::Buffer(stand_in));
                    }
                    Some(gst::PadProbeData::BufferList(list)) => {
                        let mut stand_ins = gst::BufferList::new_sized(list.len());
                        let writable = stand_ins.get_mut().expect("a new list");
                        for buffer in list.iter_owned() {
                            writable.add(stand_in(&buffer));
                            taker.take(pad, &element, buffer);
                        }
                        info.data = Some(gst::PadProbeData::BufferList(stand_ins));
                    }
                    other => info.data = other,
                }
                gst::PadProbeReturn::Ok
            },
        );
    }

    /// Makes the `appsink` answer upstream's allocation query with a pool of `input`'s send
    /// blocks (for a lossless device at most its in-place blocks out at once).
    fn propose_pool(
        &self,
        stop: &Arc<AtomicBool>,
        input: &DeviceInput,
        policy: DropPolicy,
    ) -> pool::BlockPool {
        let device = self.device;
        let stopped = stop.clone();
        let check: pool::LinkCheck = Arc::new(move || {
            if stopped.load(Ordering::Acquire) {
                Err(gst::FlowError::Flushing)
            } else {
                Ok(())
            }
        });
        let warn: pool::Warn = Arc::new(move |min, blocks| {
            tracing::warn!(
                "device {device}: the pipeline wants {min} buffers of the send-block pool at once, but the sender has {blocks} in-place blocks: set in_place_blocks = {min} or more"
            );
        });
        let lease: Arc<dyn pool::BlockLease> = Arc::new(input.clone());
        let pool = pool::BlockPool::new(lease, pool::Wait::for_policy(policy), check, warn);
        let max = pool.max_buffers();
        let proposed = pool.clone();
        let pad = self
            .appsink
            .static_pad("sink")
            .expect("appsink has a sink pad");
        pad.add_probe(gst::PadProbeType::QUERY_DOWNSTREAM, move |_, info| {
            let Some(gst::PadProbeData::Query(query)) = info.data.as_mut() else {
                return gst::PadProbeReturn::Ok;
            };
            let gst::QueryViewMut::Allocation(allocation) = query.view_mut() else {
                return gst::PadProbeReturn::Ok;
            };
            if !allocation.get().1 {
                return gst::PadProbeReturn::Ok;
            }
            allocation.add_allocation_pool(Some(&proposed), 0, 0, max);
            tracing::debug!("device {device}: proposing the send-block pool upstream");
            gst::PadProbeReturn::Handled
        });
        pool
    }
}

/// An empty buffer with `buffer`'s timestamps and flags, for the `appsink` to sync on.
fn stand_in(buffer: &gst::BufferRef) -> gst::Buffer {
    let mut stand_in = gst::Buffer::new();
    {
        let b = stand_in.get_mut().expect("a new buffer");
        b.set_pts(buffer.pts());
        b.set_dts(buffer.dts());
        b.set_duration(buffer.duration());
        b.set_offset(buffer.offset());
        b.set_offset_end(buffer.offset_end());
        b.set_flags(buffer.flags());
    }
    stand_in
}

/// Hands the buffers reaching a source's `appsink` to the device, on the streaming thread.
struct FrameTaker {
    input: DeviceInput,
    /// The send-block pool's memories not yet let go (when it was proposed).
    outstanding: Option<Arc<pool::Outstanding>>,
    /// The caps last seen, and their text (every frame's format).
    format: Mutex<Option<(gst::Caps, Arc<str>)>>,
    /// Frames taken; of them committed in place; of those, in blocks of the receiver's memory.
    taken: AtomicU64,
    in_place: AtomicU64,
    in_receiver: AtomicU64,
    /// The sender shut down: nothing more is taken.
    ended: AtomicBool,
}

impl FrameTaker {
    /// Takes one buffer as the next frame: in place when it is a block of the pool that nothing
    /// else holds, else copied.
    fn take(&self, pad: &gst::Pad, element: &gst::Element, buffer: gst::Buffer) {
        if self.ended.load(Ordering::Acquire) {
            return;
        }
        let Some(caps) = pad.current_caps() else {
            return;
        };
        let format = {
            let mut last = self.format.lock().unwrap();
            match &*last {
                Some((c, text)) if *c == caps => text.clone(),
                _ => {
                    let text: Arc<str> = Arc::from(caps.to_string().as_str());
                    *last = Some((caps, text.clone()));
                    text
                }
            }
        };
        let running = buffer.pts().and_then(|pts| {
            pad.sticky_event::<gst::event::Segment>(0)
                .and_then(|e| e.segment().downcast_ref::<gst::ClockTime>().cloned())
                .and_then(|s| s.to_running_time(pts))
        });
        let now = unix_now_ns();
        let timestamp_ns = match (running, element.clock(), element.base_time()) {
            (Some(r), Some(clock), Some(base)) => {
                now.saturating_sub(clock.time().saturating_sub(r + base).nseconds())
            }
            _ => now,
        };
        let meta = FrameMeta {
            index: self.taken.fetch_add(1, Ordering::Relaxed),
            timestamp_ns,
            duration_ns: buffer
                .duration()
                .map_or(0, |d| d.nseconds().min(u32::MAX as u64) as u32),
            pts_ns: running.map(|r| r.nseconds()),
            format,
        };
        // `mark_buffer` takes the metadata only when the buffer is ours: a copy for the other
        // case. Marked, its block is committed when `buffer` goes, at the return.
        if let Some(remote) = self
            .outstanding
            .as_ref()
            .and_then(|o| o.mark_buffer(&buffer, meta.clone()))
        {
            self.in_place.fetch_add(1, Ordering::Relaxed);
            if remote {
                self.in_receiver.fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        let Ok(data) = buffer.into_mapped_buffer_readable() else {
            return;
        };
        let sent = self.input.push_writing_here(SourceFrame {
            index: meta.index,
            timestamp_ns: meta.timestamp_ns,
            duration_ns: meta.duration_ns,
            pts_ns: meta.pts_ns,
            format: meta.format,
            data: Bytes::from_owner(data).into(),
        });
        if !sent {
            self.ended.store(true, Ordering::Release);
        }
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

/// Launch strings of [`LaunchSinks`] that parsed ([`LaunchSinks::check`]).
pub struct CheckedLaunches(HashMap<u8, String>);

impl CheckedLaunches {
    /// No device has a pipeline.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
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
    /// Checks that every launch string parses (with an `appsrc` in front), without starting
    /// anything: the receiver calls it before it listens, so a bad pipeline is reported before
    /// any port is taken. An error names the device whose pipeline failed (`None`: GStreamer
    /// itself).
    pub fn check(launches: HashMap<u8, String>) -> Result<CheckedLaunches, (Option<u8>, String)> {
        if !launches.is_empty() {
            init().map_err(|e| (None, e))?;
        }
        for (device, launch) in &launches {
            let key = StreamKey {
                sender: "check".into(),
                device: *device,
            };
            let (pipeline, _) = Self::build(launch, &key)
                .map_err(|e| (Some(*device), format!("device {device}: {e}")))?;
            let _ = pipeline.set_state(gst::State::Null);
        }
        Ok(CheckedLaunches(launches))
    }

    /// The sinks of launch strings [`Self::check`] passed (so each is parsed once at start-up).
    pub fn new(launches: CheckedLaunches, fallback: Arc<dyn FrameSink>) -> LaunchSinks {
        LaunchSinks {
            launches: launches.0,
            fallback,
            running: Mutex::new(HashMap::new()),
        }
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
