//! Sets the plugin's version metadata for GStreamer (gst-plugin-version-helper).

fn main() {
    gst_plugin_version_helper::info()
}
