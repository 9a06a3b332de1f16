//! Where the receiver puts frames: per-device directories
//! `<out>/<sender>/device-<ddd>/<frame index>.<ext>` for container processing.
//!
//! Files are written to a hidden temporary name in the same directory and renamed, so a
//! watcher never sees a partial frame. Writing happens on writer threads (a device always on
//! the same one, so its files appear in order); their queues are bounded, so a slow disk pushes
//! back on the receiver instead of growing memory.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crossbeam_channel::{Receiver, Sender};
use image::ImageEncoder;
use parking_lot::Mutex;

use crate::source::verify_frame;
use rdmastream::engine::{FrameSink, StreamKey};
use rdmastream::error::{Error, Result, spawn};
use rdmastream::proto::{Format, Frame, StreamEvent};
use rdmastream::stats::DeviceCounters;

mod ledger;
pub use ledger::Evictions;
use ledger::Ledger;

/// File format of written frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FileFormat {
    /// The payload bytes as received.
    #[default]
    Raw,
    /// Binary PPM (P6) for RGB video; raw for anything else.
    Ppm,
    /// PNG for RGB video (slow: about 10 ms a 640×480 frame); raw for anything else.
    Png,
}

impl FileFormat {
    /// Parses `raw`, `ppm` or `png`.
    pub fn parse(s: &str) -> Option<FileFormat> {
        match s {
            "raw" => Some(FileFormat::Raw),
            "ppm" => Some(FileFormat::Ppm),
            "png" => Some(FileFormat::Png),
            _ => None,
        }
    }
}

/// Output of one device.
#[derive(Debug, Clone, Copy, Default)]
pub struct DeviceOutput {
    pub format: FileFormat,
    /// Keep only the newest `keep` files of the device (`None`: keep all).
    pub keep: Option<usize>,
}

/// Settings of the directory sink.
#[derive(Debug, Clone)]
pub struct DirectorySinkOptions {
    pub out: PathBuf,
    /// Output of devices without an entry in `devices`.
    pub default: DeviceOutput,
    pub devices: HashMap<u8, DeviceOutput>,
    /// Check synthetic frames against their reference pattern.
    pub verify: bool,
    /// Writer threads.
    pub writers: usize,
    /// Frames queued per writer before the receiver waits.
    pub queue: usize,
    /// Bytes of frame files allowed under `out` in all (`None`: no limit); beyond it the oldest
    /// frames are deleted, and counted.
    pub disk_budget: Option<u64>,
}

enum Job {
    Event(StreamKey, u64, Arc<DeviceCounters>, StreamEvent),
    Flush(Sender<()>),
}

/// Writes frames to per-device directories.
pub struct DirectorySink {
    writers: Vec<Sender<Job>>,
    handles: Mutex<Vec<std::thread::JoinHandle<()>>>,
    ledger: Arc<Mutex<Ledger>>,
    /// Set when the receiver stops: a failing write of a lossless frame is no longer retried.
    stopping: Arc<std::sync::atomic::AtomicBool>,
}

impl DirectorySink {
    /// Creates `out` and starts the writer threads.
    pub fn new(opts: DirectorySinkOptions) -> Result<DirectorySink> {
        std::fs::create_dir_all(&opts.out).map_err(|e| {
            // `create_dir_all` on a file says only "File exists".
            if opts.out.exists() && !opts.out.is_dir() {
                let why = std::io::Error::other("exists and is not a directory");
                return Error::io(&opts.out, why);
            }
            Error::io(&opts.out, e)
        })?;
        let ledger = Arc::new(Mutex::new(Ledger::scan(&opts.out, opts.disk_budget)));
        let opts = Arc::new(opts);
        let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut writers = Vec::new();
        let mut handles = Vec::new();
        for w in 0..opts.writers.max(1) {
            let (tx, rx) = crossbeam_channel::bounded(opts.queue.max(1));
            let (opts, ledger, stopping) = (opts.clone(), ledger.clone(), stopping.clone());
            handles.push(spawn(format!("writer-{w}"), move || {
                writer_thread(opts, ledger, stopping, rx)
            })?);
            writers.push(tx);
        }
        Ok(DirectorySink {
            writers,
            handles: Mutex::new(handles),
            ledger,
            stopping,
        })
    }

    /// Frame files deleted so far (`keep`, `disk_budget`).
    pub fn evictions(&self) -> Evictions {
        self.ledger.lock().evictions()
    }

    /// Bytes of frame files under the output directory.
    pub fn disk_used(&self) -> u64 {
        self.ledger.lock().used()
    }

    fn writer_for(&self, key: &StreamKey) -> &Sender<Job> {
        let h = std::hash::BuildHasher::hash_one(
            &std::hash::BuildHasherDefault::<std::hash::DefaultHasher>::default(),
            key,
        );
        &self.writers[(h % self.writers.len() as u64) as usize]
    }
}

impl FrameSink for DirectorySink {
    fn handle(
        &self,
        key: &StreamKey,
        session: u64,
        counters: &Arc<DeviceCounters>,
        event: StreamEvent,
    ) {
        let _ =
            self.writer_for(key)
                .send(Job::Event(key.clone(), session, counters.clone(), event));
    }

    fn stopping(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    fn flush(&self) {
        let acks: Vec<_> = self
            .writers
            .iter()
            .filter_map(|w| {
                let (tx, rx) = crossbeam_channel::bounded(1);
                w.send(Job::Flush(tx)).ok().map(|_| rx)
            })
            .collect();
        for a in acks {
            let _ = a.recv();
        }
    }

    /// A writer drops a frame once its file is written and renamed into place, right after it
    /// settles the acknowledgement (or gives the frame up).
    fn lets_frames_go(&self) -> bool {
        true
    }
}

impl Drop for DirectorySink {
    fn drop(&mut self) {
        self.writers.clear();
        for h in self.handles.lock().drain(..) {
            let _ = h.join();
        }
    }
}

/// Directory of `key`'s frames under `out`.
pub fn device_dir(out: &Path, key: &StreamKey) -> PathBuf {
    out.join(&key.sender)
        .join(format!("device-{:03}", key.device))
}

/// Name of the file that records which sender session a device directory's newest frames
/// belong to, and where that session's file numbering starts.
const SESSION_FILE: &str = ".session";

#[derive(Default)]
struct DeviceWriter {
    format: Option<Format>,
    /// The newest frame index handed on in this session (from the files there after a
    /// restart): a frame at or below it is a duplicate.
    last: Option<u64>,
    /// The sender session the directory is set up for, and the file number its frame 0 gets.
    session: Option<u64>,
    base: u64,
    warned_format: bool,
    warned_mismatch: bool,
}

impl DeviceWriter {
    /// Makes the device directory ready for frames of `session`: created, stale temporaries of a
    /// killed receiver removed, the files already there taken into account for `keep`, and the
    /// file numbering chosen. A session seen before (the receiver restarted, the sender did not)
    /// carries on where it was; a new one starts after the newest file there, so a restarted
    /// sender's frames are new files and never replace an earlier stream's.
    fn enter_session(&mut self, dir: &Path, session: u64, ledger: &Mutex<Ledger>) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        if self.session.is_none() {
            remove_stale_temporaries(dir);
        }
        let newest = ledger.lock().newest(dir);
        let record = dir.join(SESSION_FILE);
        let recorded = std::fs::read_to_string(&record).ok().and_then(|t| {
            let mut it = t.split_whitespace().map(|w| w.parse::<u64>().ok());
            Some((it.next()??, it.next()??))
        });
        self.last = None;
        self.base = match recorded {
            Some((s, base)) if s == session => {
                // The same session carries on: its newest file is where it stands.
                self.last = newest.filter(|&n| n >= base).map(|n| n - base);
                base
            }
            _ => {
                let base = newest.map_or(0, |n| n + 1);
                let tmp = dir.join(format!("{SESSION_FILE}.tmp"));
                std::fs::write(&tmp, format!("{session} {base}\n"))
                    .and_then(|_| std::fs::rename(&tmp, &record))
                    .map_err(|e| Error::io(&record, e))?;
                if newest.is_some() {
                    tracing::info!(dir = %dir.display(), "a new session of this sender: its frames are numbered from {base:08}");
                }
                base
            }
        };
        self.session = Some(session);
        Ok(())
    }
}

/// Longest wait between two attempts to write a lossless frame that failed.
const RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(1);

fn writer_thread(
    opts: Arc<DirectorySinkOptions>,
    ledger: Arc<Mutex<Ledger>>,
    stopping: Arc<std::sync::atomic::AtomicBool>,
    rx: Receiver<Job>,
) {
    let mut devices: HashMap<StreamKey, DeviceWriter> = HashMap::new();
    let mut scratch = Vec::new();
    for job in rx {
        let (key, session, counters, event) = match job {
            Job::Flush(ack) => {
                let _ = ack.send(());
                continue;
            }
            Job::Event(k, s, c, e) => (k, s, c, e),
        };
        let dev = devices.entry(key.clone()).or_default();
        let dir = device_dir(&opts.out, &key);
        if dev.session != Some(session)
            && let Err(e) = dev.enter_session(&dir, session, &ledger)
        {
            rdmastream::warn_limited!(
                format!("session-{key}"),
                "{key}: cannot prepare {}: {e}",
                dir.display()
            );
        }
        match event {
            StreamEvent::Format {
                descriptor, ack, ..
            } => {
                dev.format = Format::parse(&descriptor);
                if let Some(n) = rdmastream::logsafe::limiter().allow(&format!("format-{key}")) {
                    tracing::info!(stream = %key, "format: {}{}", rdmastream::logsafe::clean_bytes(&descriptor, rdmastream::logsafe::MAX_PEER_TEXT), rdmastream::logsafe::suppressed(n));
                }
                rdmastream::proto::ack::settle(&ack);
            }
            StreamEvent::EndOfStream { frame_index, ack } => {
                tracing::info!(stream = %key, "end of stream after frame index {}", frame_index.saturating_sub(1));
                rdmastream::proto::ack::settle(&ack);
            }
            StreamEvent::Frame(frame) => {
                if frame.reliable {
                    counters.reliable.store(1, Ordering::Relaxed);
                }
                // A frame handed on before (sent again after a reconnect or a receiver restart):
                // it is already durable, or queued before this one on this thread.
                if dev.last.is_some_and(|last| frame.index <= last) {
                    counters.duplicates.fetch_add(1, Ordering::Relaxed);
                    rdmastream::proto::ack::settle(&frame.ack);
                    continue;
                }
                let expected = dev.last.map_or(0, |l| l + 1);
                if frame.reliable && frame.index > expected {
                    let lost = frame.index - expected;
                    counters.missing.fetch_add(lost, Ordering::Relaxed);
                    rdmastream::warn_limited!(
                        format!("missing-{key}"),
                        "{key}: lossless device is missing {lost} frames ({expected}..{})",
                        frame.index - 1
                    );
                }
                if opts.verify {
                    let verdict = dev.format.as_ref().and_then(|f| {
                        verify_frame(f, key.device, frame.index, &frame.data, &mut scratch)
                    });
                    match verdict {
                        Some(true) => {
                            counters.verified.fetch_add(1, Ordering::Relaxed);
                        }
                        Some(false) => {
                            counters.mismatched.fetch_add(1, Ordering::Relaxed);
                            if !std::mem::replace(&mut dev.warned_mismatch, true) {
                                tracing::error!(stream = %key, index = frame.index, "frame does not match the reference pattern");
                            }
                        }
                        None => {}
                    }
                }
                let out = opts
                    .devices
                    .get(&key.device)
                    .copied()
                    .unwrap_or(opts.default);
                // A lossless frame is retried until it is written (its block, and so the
                // sender, waits meanwhile) or the receiver stops; a lossy one is dropped.
                let mut pause = std::time::Duration::from_millis(10);
                loop {
                    match write_frame(&dir, &key, dev, out, &frame, &ledger) {
                        Ok(()) => {
                            counters.written.fetch_add(1, Ordering::Relaxed);
                            rdmastream::proto::ack::settle(&frame.ack);
                            break;
                        }
                        Err(e) => {
                            counters.write_errors.fetch_add(1, Ordering::Relaxed);
                            let giving_up = !frame.reliable || stopping.load(Ordering::Acquire);
                            rdmastream::warn_limited!(
                                format!("write-{key}"),
                                "{key}: cannot write frame {}: {e}; {}",
                                frame.index,
                                if giving_up {
                                    "dropped"
                                } else {
                                    "retrying (the sender waits)"
                                }
                            );
                            if giving_up {
                                counters.unwritten.fetch_add(1, Ordering::Relaxed);
                                break;
                            }
                            std::thread::sleep(pause);
                            pause = (pause * 2).min(RETRY_MAX);
                        }
                    }
                }
                dev.last = Some(frame.index);
            }
        }
    }
}

/// Removes temporary files a killed receiver left behind (they were never renamed, so no
/// watcher saw them as frames).
fn remove_stale_temporaries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') && name.ends_with(".tmp") {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

fn write_frame(
    dir: &Path,
    key: &StreamKey,
    dev: &mut DeviceWriter,
    output: DeviceOutput,
    frame: &Frame,
    ledger: &Mutex<Ledger>,
) -> Result<()> {
    let rgb = dev
        .format
        .as_ref()
        .and_then(|f| f.rgb_size())
        .filter(|(w, h)| {
            (*w as usize)
                .checked_mul(*h as usize)
                .and_then(|n| n.checked_mul(3))
                == Some(frame.data.len())
        });
    let (format, ext) = match (output.format, rgb) {
        (FileFormat::Ppm, Some(_)) => (FileFormat::Ppm, "ppm"),
        (FileFormat::Png, Some(_)) => (FileFormat::Png, "png"),
        (FileFormat::Raw, _) => (FileFormat::Raw, "raw"),
        (_, None) => {
            if !std::mem::replace(&mut dev.warned_format, true) {
                tracing::warn!(stream = %key, "not RGB video; writing raw files instead of {:?}", output.format);
            }
            (FileFormat::Raw, "raw")
        }
    };
    let number = dev.base.saturating_add(frame.index);
    let path = dir.join(format!("{number:08}.{ext}"));
    let tmp = dir.join(format!(".{number:08}.{ext}.tmp"));
    let write = || -> std::io::Result<u64> {
        let mut f = std::io::BufWriter::with_capacity(64 * 1024, std::fs::File::create(&tmp)?);
        match format {
            FileFormat::Raw => f.write_all(&frame.data)?,
            FileFormat::Ppm => {
                let (w, h) = rgb.expect("checked above");
                write!(f, "P6\n{w} {h}\n255\n")?;
                f.write_all(&frame.data)?;
            }
            FileFormat::Png => {
                let (w, h) = rgb.expect("checked above");
                image::codecs::png::PngEncoder::new(&mut f)
                    .write_image(&frame.data, w, h, image::ExtendedColorType::Rgb8)
                    .map_err(std::io::Error::other)?;
            }
        }
        let file = f.into_inner().map_err(|e| e.into_error())?;
        let bytes = file.metadata()?.len();
        std::fs::rename(&tmp, &path)?;
        Ok(bytes)
    };
    let bytes = match write() {
        Ok(b) => b,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(Error::io(&path, e));
        }
    };
    let gone = ledger.lock().written(dir, number, bytes, ext, output.keep);
    for old in gone {
        let _ = std::fs::remove_file(old);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmastream::stats::DeviceCounters;

    fn sink(out: &Path, format: FileFormat, keep: Option<usize>) -> DirectorySink {
        DirectorySink::new(DirectorySinkOptions {
            out: out.to_path_buf(),
            default: DeviceOutput { format, keep },
            devices: HashMap::new(),
            verify: true,
            writers: 1,
            queue: 4,
            disk_budget: None,
        })
        .unwrap()
    }

    /// An output path that is a file is named as such, not as "File exists".
    #[test]
    fn an_output_path_that_is_a_file_is_refused_as_not_a_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("frames");
        std::fs::write(&file, b"x").unwrap();
        let e = DirectorySink::new(DirectorySinkOptions {
            out: file.clone(),
            default: DeviceOutput {
                format: FileFormat::Raw,
                keep: None,
            },
            devices: HashMap::new(),
            verify: false,
            writers: 1,
            queue: 4,
            disk_budget: None,
        })
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains(&file.display().to_string()) && e.contains("not a directory"),
            "{e}"
        );
    }

    fn feed(s: &DirectorySink, key: &StreamKey, counters: &Arc<DeviceCounters>, frames: u64) {
        feed_session(s, key, counters, 1, 0..frames);
    }

    fn feed_session(
        s: &DirectorySink,
        key: &StreamKey,
        counters: &Arc<DeviceCounters>,
        session: u64,
        frames: std::ops::Range<u64>,
    ) {
        let fmt = Format::rgb_video(8, 4, 25, 1)
            .with("pattern", "camera-synthetic")
            .to_string();
        s.handle(
            key,
            session,
            counters,
            StreamEvent::Format {
                frame_index: frames.start,
                descriptor: fmt.into_bytes(),
                ack: None,
            },
        );
        for f in frames {
            let mut data = vec![0; 8 * 4 * 3];
            crate::source::camera_pattern(key.device, f, 8, 4, &mut data);
            s.handle(
                key,
                session,
                counters,
                StreamEvent::Frame(Frame {
                    device: key.device,
                    index: f,
                    timestamp_ns: 0,
                    duration_ns: 0,
                    pts_ns: None,
                    data: data.into(),
                    reliable: false,
                    ack: None,
                }),
            );
        }
        s.flush();
    }

    fn numbers(dir: &Path) -> Vec<u64> {
        let mut v: Vec<u64> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| ledger::frame_file(e.unwrap().file_name().to_str()?).map(|(n, _)| n))
            .collect();
        v.sort();
        v
    }

    /// Issue 7 (one name, one owner) and issue 12 items 5 and 6: a restarted sender's frames
    /// are new files after the earlier ones; a restarted receiver carries on a sender's session
    /// where it was; `keep` counts the files an earlier receiver wrote.
    #[test]
    fn a_new_session_never_replaces_earlier_files_and_keep_spans_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let key = StreamKey {
            sender: "s".into(),
            device: 4,
        };
        let dev = dir.path().join("s/device-004");
        let c = Arc::new(DeviceCounters::default());
        feed_session(
            &sink(dir.path(), FileFormat::Raw, Some(5)),
            &key,
            &c,
            7,
            0..3,
        );
        assert_eq!(numbers(&dev), vec![0, 1, 2]);
        let first = std::fs::read(dev.join("00000002.raw")).unwrap();
        // The receiver restarts; the sender (same session) carries on.
        feed_session(
            &sink(dir.path(), FileFormat::Raw, Some(5)),
            &key,
            &c,
            7,
            3..5,
        );
        assert_eq!(numbers(&dev), vec![0, 1, 2, 3, 4]);
        // The sender restarts: its frames 0.. become files 5.., and keep = 5 counts the files
        // of the earlier receiver processes.
        feed_session(
            &sink(dir.path(), FileFormat::Raw, Some(5)),
            &key,
            &c,
            8,
            0..2,
        );
        assert_eq!(numbers(&dev), vec![2, 3, 4, 5, 6]);
        assert_eq!(std::fs::read(dev.join("00000002.raw")).unwrap(), first);
        let mut want = vec![0; 8 * 4 * 3];
        crate::source::camera_pattern(4, 0, 8, 4, &mut want);
        assert_eq!(std::fs::read(dev.join("00000005.raw")).unwrap(), want);
        assert_eq!(rdmastream::stats::get(&c.mismatched), 0);
    }

    #[test]
    fn the_disk_budget_deletes_the_oldest_frames_of_the_heaviest_sender() {
        let dir = tempfile::tempdir().unwrap();
        let c = Arc::new(DeviceCounters::default());
        let frame = 8 * 4 * 3;
        let s = DirectorySink::new(DirectorySinkOptions {
            out: dir.path().to_path_buf(),
            default: DeviceOutput::default(),
            devices: HashMap::new(),
            verify: false,
            writers: 1,
            queue: 4,
            disk_budget: Some(5 * frame as u64),
        })
        .unwrap();
        let a = StreamKey {
            sender: "a".into(),
            device: 0,
        };
        let b = StreamKey {
            sender: "b".into(),
            device: 1,
        };
        feed_session(&s, &a, &c, 1, 0..2);
        feed_session(&s, &b, &c, 1, 0..5);
        // Five frames fit; b, holding the most, lost its own two oldest, a lost nothing.
        assert_eq!(numbers(&dir.path().join("a/device-000")), vec![0, 1]);
        assert_eq!(numbers(&dir.path().join("b/device-001")), vec![2, 3, 4]);
        assert_eq!(s.evictions().disk_budget, 2);
        assert_eq!(s.disk_used(), 5 * frame as u64);
    }

    #[test]
    fn ppm_and_png_decode_back_to_the_frame_and_retention_keeps_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let key = StreamKey {
            sender: "s".into(),
            device: 2,
        };
        let counters = Arc::new(DeviceCounters::default());
        for (format, ext) in [(FileFormat::Ppm, "ppm"), (FileFormat::Png, "png")] {
            let out = dir.path().join(ext);
            let s = sink(&out, format, Some(3));
            feed(&s, &key, &counters, 10);
            let mut names: Vec<String> = std::fs::read_dir(out.join("s/device-002"))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n != SESSION_FILE)
                .collect();
            names.sort();
            assert_eq!(
                names,
                vec![
                    format!("00000007.{ext}"),
                    format!("00000008.{ext}"),
                    format!("00000009.{ext}")
                ]
            );
            let img = image::open(out.join(format!("s/device-002/00000009.{ext}")))
                .unwrap()
                .to_rgb8();
            let mut want = vec![0; 8 * 4 * 3];
            crate::source::camera_pattern(2, 9, 8, 4, &mut want);
            assert_eq!(img.into_raw(), want);
        }
        assert_eq!(rdmastream::stats::get(&counters.verified), 20);
        assert_eq!(rdmastream::stats::get(&counters.mismatched), 0);
    }

    #[test]
    fn a_killed_writers_temporaries_are_cleaned_up() {
        let dir = tempfile::tempdir().unwrap();
        let dev = dir.path().join("s/device-002");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join(".00000003.raw.tmp"), b"partial").unwrap();
        let s = sink(dir.path(), FileFormat::Raw, None);
        feed(
            &s,
            &StreamKey {
                sender: "s".into(),
                device: 2,
            },
            &Arc::new(DeviceCounters::default()),
            1,
        );
        let names: Vec<_> = std::fs::read_dir(&dev)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n != SESSION_FILE)
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("00000000.raw")]);
    }
}
