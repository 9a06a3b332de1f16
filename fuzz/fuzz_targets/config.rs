//! The receiver and sender config parsers and validation on arbitrary text: an error naming the
//! file, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use rdmastream_app::config::{ReceiverConfig, SenderConfig};
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let file = Path::new("fuzz.toml");
    if let Ok(cfg) = ReceiverConfig::parse(text, file) {
        let _ = cfg.validate(file);
    }
    if let Ok(cfg) = SenderConfig::parse(text, file) {
        let _ = cfg.validate(file);
    }
});
