//! Frame sources: synthetic cameras and radars with reference patterns anyone can check, and
//! image files looped at a rate. Each source runs on its own thread, paced by the clock, and
//! pushes into its device's input queue (see [`rdmastream::engine::DeviceInput`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdmastream::error::{Error, Result};
use rdmastream::proto::Format;
use rdmastream::stats::unix_now_ns;

pub use rdmastream::engine::{FrameData, FrameWriter, SourceFrame};

/// The synthetic camera reference: pixel (x, y) of frame `f` of device `d` is
/// R = (x + 2f + 7d) mod 256, G = (y + 3f) mod 256, B = (x ^ y ^ f ^ d) mod 256.
pub fn camera_pattern(device: u8, f: u64, width: usize, height: usize, out: &mut [u8]) {
    assert_eq!(out.len(), width * height * 3);
    camera_pattern_range(device, f, width, 0, out);
}

/// Bytes `offset..offset + out.len()` of [`camera_pattern`]'s frame (any range, so a frame can
/// be rendered fragment by fragment straight into send blocks).
pub fn camera_pattern_range(device: u8, f: u64, width: usize, offset: usize, out: &mut [u8]) {
    let d = device as u64;
    let r0 = (2 * f + 7 * d) as u8;
    let g0 = (3 * f) as u8;
    let bx = (f ^ d) as u8;
    let row_len = width * 3;
    let (mut pos, mut out) = (offset, out);
    while !out.is_empty() {
        let (y, in_row) = (pos / row_len, pos % row_len);
        let n = (row_len - in_row).min(out.len());
        let (chunk, rest) = out.split_at_mut(n);
        let g = (y as u8).wrapping_add(g0);
        let by = (y as u8) ^ bx;
        if in_row == 0 && n == row_len {
            for (x, px) in chunk.chunks_exact_mut(3).enumerate() {
                px[0] = (x as u8).wrapping_add(r0);
                px[1] = g;
                px[2] = (x as u8) ^ by;
            }
        } else {
            // A row cut by a block boundary: byte by byte.
            for (k, b) in chunk.iter_mut().enumerate() {
                let i = in_row + k;
                let x = (i / 3) as u8;
                *b = match i % 3 {
                    0 => x.wrapping_add(r0),
                    1 => g,
                    _ => x ^ by,
                };
            }
        }
        pos += n;
        out = rest;
    }
}

/// The synthetic radar reference: byte i of frame `f` of device `d` is
/// ((i mod 251) + 13f + 29d) mod 256.
pub fn radar_pattern(device: u8, f: u64, out: &mut [u8]) {
    radar_pattern_range(device, f, 0, out);
}

/// Bytes `offset..offset + out.len()` of [`radar_pattern`]'s frame.
pub fn radar_pattern_range(device: u8, f: u64, offset: usize, out: &mut [u8]) {
    let base = (13 * f + 29 * device as u64) as u8;
    let mut i = offset % 251;
    for b in out {
        *b = (i as u8).wrapping_add(base);
        i += 1;
        if i == 251 {
            i = 0;
        }
    }
}

/// Frame `f` of a synthetic camera, rendered by the sender's filling thread straight into the
/// send blocks.
struct CameraFrame {
    device: u8,
    f: u64,
    width: usize,
    height: usize,
}

impl FrameWriter for CameraFrame {
    fn len(&self) -> usize {
        self.width * self.height * 3
    }
    fn write(&self, offset: usize, dst: &mut [u8]) {
        camera_pattern_range(self.device, self.f, self.width, offset, dst);
    }
}

/// Frame `f` of a synthetic radar, rendered straight into the send blocks.
struct RadarFrame {
    device: u8,
    f: u64,
    size: usize,
}

impl FrameWriter for RadarFrame {
    fn len(&self) -> usize {
        self.size
    }
    fn write(&self, offset: usize, dst: &mut [u8]) {
        radar_pattern_range(self.device, self.f, offset, dst);
    }
}

/// Checks a received frame against the reference pattern named in its format
/// (`pattern=camera-synthetic` / `pattern=radar-synthetic`). `None` when the format names no
/// pattern (nothing to check), else whether it matches.
pub fn verify_frame(
    format: &Format,
    device: u8,
    index: u64,
    data: &[u8],
    scratch: &mut Vec<u8>,
) -> Option<bool> {
    match format.get("pattern")? {
        "camera-synthetic" => {
            let (w, h) = format.rgb_size()?;
            let (w, h) = (w as usize, h as usize);
            if data.len() != w * h * 3 {
                return Some(false);
            }
            scratch.resize(data.len(), 0);
            camera_pattern(device, index, w, h, scratch);
            Some(scratch[..] == *data)
        }
        "radar-synthetic" => {
            scratch.resize(data.len(), 0);
            radar_pattern(device, index, scratch);
            Some(format.get_u32("size") == Some(data.len() as u32) && scratch[..] == *data)
        }
        _ => None,
    }
}

/// What a source produces.
#[derive(Debug, Clone)]
pub enum SourceKind {
    /// width×height×3 RGB reference pattern at `fps`.
    CameraSynthetic { width: u32, height: u32, fps: f64 },
    /// Frames of `size` bytes at `rate` Hz.
    RadarSynthetic { size: usize, rate: f64 },
    /// The image files of `dir`, decoded, converted to RGB width×height, looped at `fps`.
    Images {
        dir: PathBuf,
        width: u32,
        height: u32,
        fps: f64,
    },
}

/// A frame producer: called with the frame index, returns the frame's contents. Synthetic
/// frames are rendered in place ([`FrameData::Render`]): by the sender binary's source threads
/// into in-place send blocks, or by the filling thread when none is free; decoded
/// images are shared buffers, copied once into the send blocks. No source builds a buffer per
/// frame.
pub struct Producer {
    format: Arc<str>,
    period: Duration,
    make: Box<dyn FnMut(u64) -> FrameData + Send>,
    /// How long [`Producer::run`] waits before its first frame ([`Producer::starting_after`]).
    start_after: Duration,
}

impl Producer {
    /// Builds the producer for `kind` on device `device`. Loads and decodes images up front, so
    /// a bad file is reported before streaming starts.
    pub fn new(device: u8, kind: &SourceKind) -> Result<Producer> {
        let rate_of = |key: &str, r: f64| {
            if r.is_finite() && r > 0.0 && r <= 10_000.0 {
                Ok(Duration::from_secs_f64(1.0 / r))
            } else {
                Err(Error::invalid(
                    key,
                    format!("{r} is not a rate in (0, 10000] per second"),
                ))
            }
        };
        Ok(match kind.clone() {
            SourceKind::CameraSynthetic { width, height, fps } => {
                let (w, h) = (width as usize, height as usize);
                Producer {
                    format: Format::rgb_video(width, height, fps.round() as u32, 1)
                        .with("pattern", "camera-synthetic")
                        .to_string()
                        .into(),
                    period: rate_of("fps", fps)?,
                    start_after: Duration::ZERO,
                    make: Box::new(move |f| {
                        FrameData::Render(Arc::new(CameraFrame {
                            device,
                            f,
                            width: w,
                            height: h,
                        }))
                    }),
                }
            }
            SourceKind::RadarSynthetic { size, rate } => Producer {
                format: format!(
                    "application/x-radar,size={size},rate={rate},pattern=radar-synthetic"
                )
                .into(),
                period: rate_of("rate", rate)?,
                start_after: Duration::ZERO,
                make: Box::new(move |f| {
                    FrameData::Render(Arc::new(RadarFrame { device, f, size }))
                }),
            },
            SourceKind::Images {
                dir,
                width,
                height,
                fps,
            } => {
                let images: Vec<rdmastream::bytes::Bytes> = load_images(&dir, width, height)?
                    .into_iter()
                    .map(Into::into)
                    .collect();
                Producer {
                    format: Format::rgb_video(width, height, fps.round() as u32, 1)
                        .to_string()
                        .into(),
                    period: rate_of("fps", fps)?,
                    start_after: Duration::ZERO,
                    make: Box::new(move |f| {
                        FrameData::Bytes(images[(f % images.len() as u64) as usize].clone())
                    }),
                }
            }
        })
    }

    /// Starts [`Producer::run`]'s schedule `delay` late: devices started together whose
    /// frames should not all fall due at the same moments (sender.toml `start = "spread"`).
    pub fn starting_after(mut self, delay: Duration) -> Producer {
        self.start_after = delay;
        self
    }

    /// Format descriptor of the frames.
    pub fn format(&self) -> Arc<str> {
        self.format.clone()
    }

    /// Time between frames.
    pub fn period(&self) -> Duration {
        self.period
    }

    /// Produces frame `index`.
    pub fn frame(&mut self, index: u64) -> SourceFrame {
        SourceFrame {
            index,
            timestamp_ns: unix_now_ns(),
            duration_ns: self.period.as_nanos().min(u32::MAX as u128) as u32,
            pts_ns: Some(index * self.period.as_nanos() as u64),
            format: self.format.clone(),
            data: (self.make)(index),
        }
    }

    /// Runs the paced loop until `stop` is set or `frames` frames were produced, calling
    /// `push` for each frame (which may block under the `block` policy). If the loop falls behind
    /// (a blocked push), it does not burst to catch up: the schedule restarts from now.
    pub fn run(
        mut self,
        stop: &AtomicBool,
        frames: Option<u64>,
        mut push: impl FnMut(SourceFrame) -> bool,
    ) {
        let mut next = Instant::now() + self.start_after;
        let mut index = 0u64;
        while !stop.load(Ordering::Relaxed) && frames.is_none_or(|n| index < n) {
            let now = Instant::now();
            if next > now {
                // Sleep in short steps so a stop request is seen quickly.
                std::thread::sleep((next - now).min(Duration::from_millis(50)));
                continue;
            }
            if !push(self.frame(index)) {
                break;
            }
            index += 1;
            next += self.period;
            let now = Instant::now();
            if now > next + self.period {
                next = now;
            }
        }
    }
}

/// Decodes every image file in `dir` (sorted by name) to RGB at width×height.
pub fn load_images(dir: &Path, width: u32, height: u32) -> Result<Vec<Vec<u8>>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().and_then(|e| e.to_str()).is_some_and(|e| {
                matches!(
                    e.to_ascii_lowercase().as_str(),
                    "png" | "jpg" | "jpeg" | "ppm" | "pnm"
                )
            })
        })
        .collect();
    paths.sort();
    if paths.is_empty() {
        return Err(Error::Image {
            path: dir.to_path_buf(),
            reason: "no .png/.jpg/.ppm files in this directory".into(),
        });
    }
    paths
        .iter()
        .map(|p| {
            let img = image::open(p).map_err(|e| Error::Image {
                path: p.clone(),
                reason: e.to_string(),
            })?;
            let rgb = img
                .resize_exact(width, height, image::imageops::FilterType::Triangle)
                .to_rgb8();
            Ok(rgb.into_raw())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A producer started late waits before its first frame, then keeps its period.
    #[test]
    fn a_producer_starting_after_a_delay_waits_before_its_first_frame() {
        let kind = SourceKind::RadarSynthetic {
            size: 16,
            rate: 100.0,
        };
        let delay = Duration::from_millis(120);
        let p = Producer::new(1, &kind).unwrap().starting_after(delay);
        let started = Instant::now();
        let mut at = Vec::new();
        p.run(&AtomicBool::new(false), Some(3), |_| {
            at.push(started.elapsed());
            true
        });
        assert_eq!(at.len(), 3);
        assert!(
            at[0] >= delay,
            "first frame after {:?}, not {delay:?}",
            at[0]
        );
        // The schedule starts at the delay: frame 2 is due 20 ms after frame 0.
        assert!(at[2] >= delay + Duration::from_millis(20), "{at:?}");
    }

    #[test]
    fn camera_pattern_matches_the_formula() {
        let (w, h) = (300, 7);
        let mut v = vec![0; w * h * 3];
        camera_pattern(5, 1000, w, h, &mut v);
        for y in 0..h {
            for x in 0..w {
                let p = &v[(y * w + x) * 3..][..3];
                let (f, d) = (1000usize, 5usize);
                assert_eq!(p[0] as usize, (x + 2 * f + 7 * d) % 256);
                assert_eq!(p[1] as usize, (y + 3 * f) % 256);
                assert_eq!(p[2] as usize, (x ^ y ^ f ^ d) % 256);
            }
        }
    }

    #[test]
    fn radar_pattern_matches_the_formula() {
        let mut v = vec![0; 1000];
        radar_pattern(3, 77, &mut v);
        for (i, b) in v.iter().enumerate() {
            assert_eq!(*b as usize, ((i % 251) + 13 * 77 + 29 * 3) % 256);
        }
    }

    #[test]
    fn synthetic_frames_rendered_in_any_fragments_match_the_whole_frame() {
        let (w, h) = (37, 5);
        let mut whole = vec![0; w * h * 3];
        camera_pattern(4, 300, w, h, &mut whole);
        let mut radar = vec![0; 2000];
        radar_pattern(4, 300, &mut radar);
        let camera = Producer::new(
            4,
            &SourceKind::CameraSynthetic {
                width: w as u32,
                height: h as u32,
                fps: 25.0,
            },
        )
        .unwrap()
        .frame(300)
        .data;
        let radar_frame = Producer::new(
            4,
            &SourceKind::RadarSynthetic {
                size: 2000,
                rate: 25.0,
            },
        )
        .unwrap()
        .frame(300)
        .data;
        assert!(matches!(camera, FrameData::Render(_)));
        assert!(matches!(radar_frame, FrameData::Render(_)));
        // Fragment sizes that cut rows and pixels anywhere, a whole row, and the whole frame.
        for frag in [1, 2, 7, 100, w * 3, 1000, whole.len()] {
            for (data, want) in [(&camera, &whole), (&radar_frame, &radar)] {
                assert_eq!(data.len(), want.len());
                let mut got = vec![0xAA; want.len()];
                for (k, dst) in got.chunks_mut(frag).enumerate() {
                    data.write(k * frag, dst);
                }
                assert_eq!(&got, want, "fragments of {frag}");
            }
        }
    }

    #[test]
    fn verify_catches_a_wrong_frame_index_and_a_flipped_byte() {
        let fmt = Format::parse(
            b"video/x-raw,format=RGB,width=16,height=4,framerate=25/1,pattern=camera-synthetic",
        )
        .unwrap();
        let mut v = vec![0; 16 * 4 * 3];
        camera_pattern(2, 9, 16, 4, &mut v);
        let mut s = Vec::new();
        assert_eq!(verify_frame(&fmt, 2, 9, &v, &mut s), Some(true));
        assert_eq!(verify_frame(&fmt, 2, 10, &v, &mut s), Some(false));
        v[100] ^= 1;
        assert_eq!(verify_frame(&fmt, 2, 9, &v, &mut s), Some(false));
        let plain = Format::rgb_video(16, 4, 25, 1);
        assert_eq!(verify_frame(&plain, 2, 9, &v, &mut s), None);
    }
}
