//! Live thumbnails for the receiver's status page: a [`FrameSink`] in front of the real one
//! that keeps, per sender and device, one small picture of a recent frame, and hands every
//! event on unchanged.
//!
//! Raw RGB video (`video/x-raw,format=RGB`) is scaled down; JPEG frames (`image/jpeg`) are
//! decoded and scaled down; anything else (radar, unknown formats) is drawn as a heat map of
//! its bytes, row by row. Memory stays bounded: one thumbnail of at most [`MAX_W`]×[`MAX_H`]
//! pixels per device, made at most every [`EVERY`] per device, so the receiver's polling
//! thread spends little time here. PNG encoding happens when the page asks
//! ([`Thumbnails::png`]), on the HTTP thread.
//!
//! What it does not do: no files, no waiting; it never changes what the inner sink gets.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use rdmastream::engine::{FrameSink, StreamKey};
use rdmastream::proto::{Format, StreamEvent};
use rdmastream::stats::DeviceCounters;

/// Largest thumbnail, in pixels.
pub const MAX_W: u32 = 192;
pub const MAX_H: u32 = 144;
/// Shortest time between two thumbnails of one device (JPEG frames, which must be decoded:
/// [`EVERY_DECODED`]).
pub const EVERY: Duration = Duration::from_millis(250);
pub const EVERY_DECODED: Duration = Duration::from_secs(1);
/// Devices with a thumbnail at most (about 80 KiB each); beyond that the one updated longest
/// ago is forgotten, so sender names a peer makes up cannot grow the receiver's memory.
pub const MAX_DEVICES: usize = 512;
/// Largest JPEG frame decoded for a thumbnail (larger ones are drawn as bytes).
const MAX_JPEG: usize = 4 << 20;

/// One thumbnail: RGB pixels, and which frame it shows.
#[derive(Debug, Clone)]
pub struct Thumbnail {
    pub width: u32,
    pub height: u32,
    pub rgb: Vec<u8>,
    /// The frame index it was made from.
    pub frame: u64,
    /// How it was drawn: "rgb", "jpeg" or "bytes".
    pub kind: &'static str,
}

#[derive(Default)]
struct Slot {
    format: Option<Format>,
    /// The format descriptor as text (what the page shows).
    format_text: String,
    made: Option<Instant>,
    thumb: Option<Arc<Thumbnail>>,
}

/// The newest thumbnail of every device.
#[derive(Default)]
pub struct Thumbnails {
    slots: Mutex<HashMap<StreamKey, Slot>>,
}

impl Thumbnails {
    /// An empty store.
    pub fn new() -> Arc<Thumbnails> {
        Arc::new(Thumbnails::default())
    }

    /// The newest thumbnail of `key`.
    pub fn get(&self, key: &StreamKey) -> Option<Arc<Thumbnail>> {
        self.slots.lock().get(key).and_then(|s| s.thumb.clone())
    }

    /// The format descriptor `key` announced, as text (empty before one came).
    pub fn format(&self, key: &StreamKey) -> String {
        self.slots
            .lock()
            .get(key)
            .map(|s| s.format_text.clone())
            .unwrap_or_default()
    }

    /// The newest thumbnail of `key` as PNG bytes.
    pub fn png(&self, key: &StreamKey) -> Option<Vec<u8>> {
        let t = self.get(key)?;
        let mut out = Vec::new();
        let enc = image::codecs::png::PngEncoder::new_with_quality(
            &mut out,
            image::codecs::png::CompressionType::Fast,
            image::codecs::png::FilterType::Sub,
        );
        image::ImageEncoder::write_image(
            enc,
            &t.rgb,
            t.width,
            t.height,
            image::ExtendedColorType::Rgb8,
        )
        .ok()?;
        Some(out)
    }

    /// The slot of `key`, made room for.
    fn slot<'a>(slots: &'a mut HashMap<StreamKey, Slot>, key: &StreamKey) -> &'a mut Slot {
        if !slots.contains_key(key) && slots.len() >= MAX_DEVICES {
            let oldest = slots
                .iter()
                .min_by_key(|(_, s)| s.made)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                slots.remove(&k);
            }
        }
        slots.entry(key.clone()).or_default()
    }

    /// Looks at one event on its way to the sink.
    pub fn observe(&self, key: &StreamKey, event: &StreamEvent) {
        match event {
            StreamEvent::Format { descriptor, .. } => {
                let mut slots = self.slots.lock();
                let slot = Self::slot(&mut slots, key);
                slot.format = Format::parse(descriptor);
                slot.format_text = slot
                    .format
                    .as_ref()
                    .map(|f| f.to_string())
                    .unwrap_or_default();
                // Peer text: keep it short.
                slot.format_text.truncate(200);
            }
            StreamEvent::Frame(frame) => {
                let format = {
                    let mut slots = self.slots.lock();
                    let slot = Self::slot(&mut slots, key);
                    let every = match &slot.format {
                        Some(f) if f.media_type == "image/jpeg" => EVERY_DECODED,
                        _ => EVERY,
                    };
                    if slot.made.is_some_and(|t| t.elapsed() < every) {
                        return;
                    }
                    slot.made = Some(Instant::now());
                    slot.format.clone()
                };
                // Drawn without the lock: the page can read other devices meanwhile.
                let thumb = draw(format.as_ref(), &frame.data, frame.index);
                if let Some(slot) = self.slots.lock().get_mut(key) {
                    slot.thumb = Some(Arc::new(thumb));
                }
            }
            StreamEvent::EndOfStream { .. } => {}
        }
    }
}

/// A [`FrameSink`] that keeps thumbnails and hands every event to `inner`.
pub struct ThumbnailTap {
    inner: Arc<dyn FrameSink>,
    thumbs: Arc<Thumbnails>,
}

impl ThumbnailTap {
    /// Taps the events on their way to `inner` into `thumbs`.
    pub fn new(inner: Arc<dyn FrameSink>, thumbs: Arc<Thumbnails>) -> ThumbnailTap {
        ThumbnailTap { inner, thumbs }
    }
}

impl FrameSink for ThumbnailTap {
    fn handle(
        &self,
        key: &StreamKey,
        session: u64,
        counters: &Arc<DeviceCounters>,
        event: StreamEvent,
    ) {
        self.thumbs.observe(key, &event);
        self.inner.handle(key, session, counters, event);
    }

    fn stopping(&self) {
        self.inner.stopping();
    }

    /// A thumbnail is drawn while the event passes; no frame is kept.
    fn lets_frames_go(&self) -> bool {
        self.inner.lets_frames_go()
    }

    fn flush(&self) {
        self.inner.flush();
    }
}

/// The thumbnail of one frame.
pub fn draw(format: Option<&Format>, data: &[u8], frame: u64) -> Thumbnail {
    if let Some((w, h)) = format.and_then(Format::rgb_size)
        && (w as usize)
            .checked_mul(h as usize)
            .and_then(|n| n.checked_mul(3))
            == Some(data.len())
        && w > 0
        && h > 0
    {
        return scaled(data, w, h, frame, "rgb");
    }
    if format.is_some_and(|f| f.media_type == "image/jpeg")
        && data.len() <= MAX_JPEG
        && let Ok(img) = image::load_from_memory_with_format(data, image::ImageFormat::Jpeg)
    {
        let img = img.thumbnail(MAX_W, MAX_H).to_rgb8();
        return Thumbnail {
            width: img.width(),
            height: img.height(),
            rgb: img.into_raw(),
            frame,
            kind: "jpeg",
        };
    }
    heat_map(data, frame)
}

/// Nearest-neighbour scaling of packed RGB `w`×`h` into the thumbnail box (cheap: it reads
/// only the pixels it keeps).
fn scaled(data: &[u8], w: u32, h: u32, frame: u64, kind: &'static str) -> Thumbnail {
    let scale = (MAX_W as f64 / w as f64)
        .min(MAX_H as f64 / h as f64)
        .min(1.0);
    let (tw, th) = (
        ((w as f64 * scale).round() as u32).max(1),
        ((h as f64 * scale).round() as u32).max(1),
    );
    let mut rgb = Vec::with_capacity((tw * th * 3) as usize);
    for y in 0..th {
        let sy = (y as u64 * h as u64 / th as u64) as usize;
        for x in 0..tw {
            let sx = (x as u64 * w as u64 / tw as u64) as usize;
            let i = (sy * w as usize + sx) * 3;
            rgb.extend_from_slice(&data[i..i + 3]);
        }
    }
    Thumbnail {
        width: tw,
        height: th,
        rgb,
        frame,
        kind,
    }
}

/// The bytes of a frame of unknown layout (radar, ...) as a heat map: the frame is laid out in
/// rows of `ceil(sqrt(len))` bytes, sampled into at most [`MAX_H`]×[`MAX_H`] pixels, each byte
/// value coloured from black through blue, red and yellow to white.
fn heat_map(data: &[u8], frame: u64) -> Thumbnail {
    let side = (data.len() as f64).sqrt().ceil().max(1.0) as usize;
    let cells = side.min(MAX_H as usize).max(1);
    let mut rgb = Vec::with_capacity(cells * cells * 3);
    for y in 0..cells {
        let row = y * side / cells;
        for x in 0..cells {
            let col = x * side / cells;
            let v = data.get(row * side + col).copied().unwrap_or(0);
            rgb.extend_from_slice(&heat(v));
        }
    }
    Thumbnail {
        width: cells as u32,
        height: cells as u32,
        rgb,
        frame,
        kind: "bytes",
    }
}

/// A byte value on the heat scale.
fn heat(v: u8) -> [u8; 3] {
    let t = v as f32 / 255.0;
    let ramp = |a: f32, b: f32| (((t - a) / (b - a)).clamp(0.0, 1.0) * 255.0) as u8;
    // Blue rises first and falls back, red follows, then green, then blue again to white.
    let blue = if t < 0.25 {
        ramp(0.0, 0.25)
    } else if t < 0.75 {
        255 - ramp(0.25, 0.5)
    } else {
        ramp(0.75, 1.0)
    };
    [ramp(0.2, 0.5), ramp(0.5, 0.8), blue]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rgb_frames_are_scaled_into_the_box_and_keep_their_colours() {
        let (w, h) = (640u32, 480u32);
        let mut data = vec![0u8; (w * h * 3) as usize];
        // Left half red, right half blue.
        for px in data.chunks_mut(3).enumerate() {
            let x = px.0 as u32 % w;
            px.1.copy_from_slice(if x < w / 2 {
                &[255, 0, 0]
            } else {
                &[0, 0, 255]
            });
        }
        let f = Format::rgb_video(w, h, 25, 1);
        let t = draw(Some(&f), &data, 7);
        assert_eq!(
            (t.width, t.height, t.kind, t.frame),
            (MAX_W, MAX_H, "rgb", 7)
        );
        assert_eq!(&t.rgb[..3], &[255, 0, 0]);
        assert_eq!(&t.rgb[t.rgb.len() - 3..], &[0, 0, 255]);
        // Small frames are not blown up.
        let small = draw(Some(&Format::rgb_video(4, 2, 25, 1)), &[9; 24], 0);
        assert_eq!((small.width, small.height), (4, 2));
    }

    #[test]
    fn other_frames_are_heat_maps_and_a_wrong_size_is_not_rgb() {
        let radar = Format::parse(b"application/x-radar,size=65536,rate=20").unwrap();
        let data: Vec<u8> = (0..65536).map(|i| (i % 251) as u8).collect();
        let t = draw(Some(&radar), &data, 1);
        assert_eq!((t.width, t.height, t.kind), (MAX_H, MAX_H, "bytes"));
        assert!(t.rgb.iter().any(|&b| b > 200) && t.rgb.iter().any(|&b| b < 50));
        // RGB caps but a payload of another size (a truncated frame): drawn as bytes.
        let t = draw(Some(&Format::rgb_video(640, 480, 25, 1)), &[1, 2, 3], 0);
        assert_eq!((t.kind, t.width), ("bytes", 2));
        assert_eq!(draw(None, &[], 0).width, 1);
    }

    #[test]
    fn a_jpeg_frame_is_decoded() {
        let img = image::RgbImage::from_pixel(320, 240, image::Rgb([0, 200, 0]));
        let mut jpeg = Vec::new();
        img.write_to(
            &mut std::io::Cursor::new(&mut jpeg),
            image::ImageFormat::Jpeg,
        )
        .unwrap();
        let f = Format::parse(b"image/jpeg,width=320,height=240").unwrap();
        let t = draw(Some(&f), &jpeg, 3);
        assert_eq!((t.kind, t.width, t.height), ("jpeg", 192, 144));
        assert!(t.rgb[1] > 150 && t.rgb[0] < 50, "{:?}", &t.rgb[..3]);
    }

    #[test]
    fn the_store_keeps_one_thumbnail_per_device_at_a_bounded_rate() {
        let store = Thumbnails::new();
        let key = StreamKey {
            sender: "s".into(),
            device: 1,
        };
        let fmt = Format::rgb_video(2, 2, 25, 1).to_string();
        store.observe(
            &key,
            &StreamEvent::Format {
                frame_index: 0,
                descriptor: fmt.clone().into_bytes(),
                ack: None,
            },
        );
        let frame = |index| {
            StreamEvent::Frame(rdmastream::proto::Frame {
                device: 1,
                index,
                timestamp_ns: 0,
                duration_ns: 0,
                pts_ns: None,
                data: vec![index as u8; 12].into(),
                reliable: false,
                ack: None,
            })
        };
        store.observe(&key, &frame(0));
        // Within EVERY of the first: not redrawn.
        store.observe(&key, &frame(1));
        assert_eq!(store.get(&key).unwrap().frame, 0);
        assert_eq!(store.format(&key), fmt);
        let png = store.png(&key).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        assert!(
            store
                .png(&StreamKey {
                    sender: "t".into(),
                    device: 1
                })
                .is_none()
        );
        // Made-up sender names do not grow the store beyond MAX_DEVICES; the newest stay.
        for n in 0..MAX_DEVICES + 10 {
            let k = StreamKey {
                sender: format!("s{n}"),
                device: 1,
            };
            store.observe(&k, &frame(0));
        }
        assert_eq!(store.slots.lock().len(), MAX_DEVICES);
        let newest = StreamKey {
            sender: format!("s{}", MAX_DEVICES + 9),
            device: 1,
        };
        assert!(store.get(&newest).is_some());
    }
}
