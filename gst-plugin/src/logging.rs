//! The core logs with `tracing`; inside a GStreamer application those lines belong in the
//! GStreamer debug log (category `rdmastream`, e.g. `GST_DEBUG=rdmastream:4`). When the host
//! program has not installed a `tracing` subscriber of its own (the `sender`/`receiver` binaries
//! do), the plugin installs one that forwards each event at its level.

use std::io::Write;
use std::sync::LazyLock;

use tracing_subscriber::fmt::MakeWriter;

static CAT: LazyLock<gst::DebugCategory> = LazyLock::new(|| {
    gst::DebugCategory::new(
        "rdmastream",
        gst::DebugColorFlags::empty(),
        Some("rdmastream core: filling, sending, polling and transport threads"),
    )
});

/// Installs the forwarding subscriber unless the process already has one.
pub fn init() {
    if tracing::dispatcher::has_been_set() {
        return;
    }
    // The threshold is read once: formatting events nobody will see costs time on the data path.
    let max = match CAT.threshold() {
        gst::DebugLevel::None | gst::DebugLevel::Error => tracing::Level::ERROR,
        gst::DebugLevel::Warning | gst::DebugLevel::Fixme => tracing::Level::WARN,
        gst::DebugLevel::Info => tracing::Level::INFO,
        gst::DebugLevel::Debug => tracing::Level::DEBUG,
        _ => tracing::Level::TRACE,
    };
    let subscriber = tracing_subscriber::fmt()
        .with_writer(GstWriters)
        .with_max_level(max)
        .with_ansi(false)
        .without_time()
        .with_level(false)
        .with_target(false)
        .finish();
    let _ = tracing::subscriber::set_global_default(subscriber);
}

struct GstWriters;

/// Collects one formatted event and logs it when dropped.
struct GstWriter {
    level: gst::DebugLevel,
    text: Vec<u8>,
}

impl Write for GstWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for GstWriter {
    fn drop(&mut self) {
        let text = String::from_utf8_lossy(&self.text);
        let text = text.trim_end();
        if !text.is_empty() {
            gst::log_with_level!(CAT, self.level, "{}", text);
        }
    }
}

impl<'a> MakeWriter<'a> for GstWriters {
    type Writer = GstWriter;

    fn make_writer(&'a self) -> GstWriter {
        GstWriter {
            level: gst::DebugLevel::Info,
            text: Vec::new(),
        }
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> GstWriter {
        let level = match *meta.level() {
            tracing::Level::ERROR => gst::DebugLevel::Error,
            tracing::Level::WARN => gst::DebugLevel::Warning,
            tracing::Level::INFO => gst::DebugLevel::Info,
            tracing::Level::DEBUG => gst::DebugLevel::Debug,
            tracing::Level::TRACE => gst::DebugLevel::Trace,
        };
        GstWriter {
            level,
            text: Vec::new(),
        }
    }
}
