//! Format descriptors: the payload of a FORMAT message, sent before the first frame of a device
//! and whenever the format changes. The text is GStreamer caps syntax
//! (`video/x-raw,format=RGB,width=640,height=480,framerate=25/1`), so the caps travel with the
//! stream; the receiver reads width/height from it for ppm/png output. Synthetic sources add
//! `pattern=camera-synthetic` or `pattern=radar-synthetic` so `--verify` knows what to check.

/// A parsed descriptor: media type and `key=value` fields in order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Format {
    pub media_type: String,
    pub fields: Vec<(String, String)>,
}

impl Format {
    /// Parses `media/type,key=value,...`. Values may carry a GStreamer type prefix like
    /// `(int)640`, which is stripped. Returns `None` for an empty or non-UTF-8 descriptor.
    pub fn parse(bytes: &[u8]) -> Option<Format> {
        let text = std::str::from_utf8(bytes).ok()?.trim();
        let mut parts = text.split(',');
        let media_type = parts.next()?.trim().to_string();
        if media_type.is_empty() {
            return None;
        }
        let fields = parts
            .filter_map(|p| {
                let (k, v) = p.split_once('=')?;
                let v = v.trim();
                let v = match v.strip_prefix('(') {
                    Some(rest) => rest.split_once(')').map(|(_, v)| v).unwrap_or(v),
                    None => v,
                };
                Some((k.trim().to_string(), v.trim().to_string()))
            })
            .collect();
        Some(Format { media_type, fields })
    }

    /// Value of field `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Value of field `key` as an integer.
    pub fn get_u32(&self, key: &str) -> Option<u32> {
        self.get(key)?.parse().ok()
    }

    /// Width and height when this is packed 8-bit RGB video.
    pub fn rgb_size(&self) -> Option<(u32, u32)> {
        if self.media_type == "video/x-raw" && self.get("format") == Some("RGB") {
            Some((self.get_u32("width")?, self.get_u32("height")?))
        } else {
            None
        }
    }

    /// Builds the descriptor of packed RGB video.
    pub fn rgb_video(width: u32, height: u32, fps_num: u32, fps_den: u32) -> Format {
        Format {
            media_type: "video/x-raw".into(),
            fields: vec![
                ("format".into(), "RGB".into()),
                ("width".into(), width.to_string()),
                ("height".into(), height.to_string()),
                ("framerate".into(), format!("{fps_num}/{fps_den}")),
            ],
        }
    }

    /// Adds or replaces a field.
    pub fn with(mut self, key: &str, value: impl ToString) -> Format {
        self.fields.retain(|(k, _)| k != key);
        self.fields.push((key.into(), value.to_string()));
        self
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.media_type)?;
        for (k, v) in &self.fields {
            write!(f, ",{k}={v}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_gst_typed_values() {
        let f = Format::rgb_video(640, 480, 25, 1).with("pattern", "camera-synthetic");
        let text = f.to_string();
        assert_eq!(
            text,
            "video/x-raw,format=RGB,width=640,height=480,framerate=25/1,pattern=camera-synthetic"
        );
        assert_eq!(Format::parse(text.as_bytes()).unwrap(), f);
        let g = Format::parse(b"video/x-raw, format=(string)RGB, width=(int)320, height=(int)240")
            .unwrap();
        assert_eq!(g.rgb_size(), Some((320, 240)));
        assert!(Format::parse(b"").is_none());
        assert!(Format::parse(&[0xff, 0xfe]).is_none());
    }
}
