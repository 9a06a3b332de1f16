//! Where the receiver puts frames: per-device directories
//! `<out>/<sender>/device-<ddd>/<frame index>.<ext>` for container processing.
//!
//! Files are written to a hidden temporary name in the same directory and renamed, so a
//! watcher never sees a partial frame. Writing happens on writer threads (a device always on
//! the same one, so its files appear in order); their queues are bounded, so a slow disk pushes
//! back on the receiver instead of growing memory.

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crossbeam_channel::{Receiver, Sender};
use image::ImageEncoder;
use parking_lot::Mutex;

use crate::engine::{FrameSink, StreamKey};
use crate::error::{Error, Result, spawn};
use crate::proto::{Format, Frame, StreamEvent};
use crate::source::verify_frame;
use crate::stats::DeviceCounters;

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
}

enum Job {
    Event(StreamKey, Arc<DeviceCounters>, StreamEvent),
    Flush(Sender<()>),
}

/// Writes frames to per-device directories.
pub struct DirectorySink {
    writers: Vec<Sender<Job>>,
    handles: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl DirectorySink {
    /// Creates `out` and starts the writer threads.
    pub fn new(opts: DirectorySinkOptions) -> Result<DirectorySink> {
        std::fs::create_dir_all(&opts.out).map_err(|e| Error::io(&opts.out, e))?;
        let opts = Arc::new(opts);
        let mut writers = Vec::new();
        let mut handles = Vec::new();
        for w in 0..opts.writers.max(1) {
            let (tx, rx) = crossbeam_channel::bounded(opts.queue.max(1));
            let opts = opts.clone();
            handles.push(spawn(format!("writer-{w}"), move || {
                writer_thread(opts, rx)
            })?);
            writers.push(tx);
        }
        Ok(DirectorySink {
            writers,
            handles: Mutex::new(handles),
        })
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
    fn handle(&self, key: &StreamKey, counters: &Arc<DeviceCounters>, event: StreamEvent) {
        let _ = self
            .writer_for(key)
            .send(Job::Event(key.clone(), counters.clone(), event));
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
}

impl Drop for DirectorySink {
    fn drop(&mut self) {
        self.writers.clear();
        for h in self.handles.lock().drain(..) {
            let _ = h.join();
        }
    }
}

/// Path of frame `index` of `key` under `out`.
pub fn frame_path(out: &Path, key: &StreamKey, index: u64, ext: &str) -> PathBuf {
    out.join(&key.sender)
        .join(format!("device-{:03}", key.device))
        .join(format!("{index:08}.{ext}"))
}

#[derive(Default)]
struct DeviceWriter {
    format: Option<Format>,
    written: VecDeque<PathBuf>,
    dir_ready: bool,
    warned_format: bool,
    warned_mismatch: bool,
    warned_io: bool,
}

fn writer_thread(opts: Arc<DirectorySinkOptions>, rx: Receiver<Job>) {
    let mut devices: HashMap<StreamKey, DeviceWriter> = HashMap::new();
    let mut scratch = Vec::new();
    for job in rx {
        let (key, counters, event) = match job {
            Job::Flush(ack) => {
                let _ = ack.send(());
                continue;
            }
            Job::Event(k, c, e) => (k, c, e),
        };
        let dev = devices.entry(key.clone()).or_default();
        match event {
            StreamEvent::Format { descriptor, .. } => {
                dev.format = Format::parse(&descriptor);
                tracing::info!(stream = %key, "format: {}", String::from_utf8_lossy(&descriptor));
            }
            StreamEvent::EndOfStream { frame_index } => {
                tracing::info!(stream = %key, "end of stream after frame index {}", frame_index.saturating_sub(1));
            }
            StreamEvent::Frame(frame) => {
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
                if let Err(e) = write_frame(&opts.out, &key, dev, out, &frame)
                    && !std::mem::replace(&mut dev.warned_io, true)
                {
                    tracing::error!(stream = %key, "cannot write frame: {e}");
                }
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
    out: &Path,
    key: &StreamKey,
    dev: &mut DeviceWriter,
    output: DeviceOutput,
    frame: &Frame,
) -> Result<()> {
    let rgb = dev
        .format
        .as_ref()
        .and_then(|f| f.rgb_size())
        .filter(|(w, h)| (*w as usize) * (*h as usize) * 3 == frame.data.len());
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
    let path = frame_path(out, key, frame.index, ext);
    let dir = path.parent().expect("frame path has a directory");
    if !dev.dir_ready {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        remove_stale_temporaries(dir);
        dev.dir_ready = true;
    }
    let tmp = dir.join(format!(".{:08}.{ext}.tmp", frame.index));
    let write = || -> std::io::Result<()> {
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
        f.into_inner().map_err(|e| e.into_error())?;
        std::fs::rename(&tmp, &path)
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(&path, e));
    }
    dev.written.push_back(path);
    if let Some(keep) = output.keep {
        while dev.written.len() > keep {
            if let Some(old) = dev.written.pop_front() {
                let _ = std::fs::remove_file(old);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::DeviceCounters;

    fn sink(out: &Path, format: FileFormat, keep: Option<usize>) -> DirectorySink {
        DirectorySink::new(DirectorySinkOptions {
            out: out.to_path_buf(),
            default: DeviceOutput { format, keep },
            devices: HashMap::new(),
            verify: true,
            writers: 1,
            queue: 4,
        })
        .unwrap()
    }

    fn feed(s: &DirectorySink, key: &StreamKey, counters: &Arc<DeviceCounters>, frames: u64) {
        let fmt = Format::rgb_video(8, 4, 25, 1)
            .with("pattern", "camera-synthetic")
            .to_string();
        s.handle(
            key,
            counters,
            StreamEvent::Format {
                frame_index: 0,
                descriptor: fmt.into_bytes(),
            },
        );
        for f in 0..frames {
            let mut data = vec![0; 8 * 4 * 3];
            crate::source::camera_pattern(key.device, f, 8, 4, &mut data);
            s.handle(
                key,
                counters,
                StreamEvent::Frame(Frame {
                    device: key.device,
                    index: f,
                    timestamp_ns: 0,
                    duration_ns: 0,
                    pts_ns: None,
                    data: data.into(),
                }),
            );
        }
        s.flush();
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
        assert_eq!(crate::stats::get(&counters.verified), 20);
        assert_eq!(crate::stats::get(&counters.mismatched), 0);
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
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("00000000.raw")]);
    }
}
