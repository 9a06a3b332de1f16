//! The tcp transport's request decoder (the software NIC) on whatever bytes a connected peer
//! sends after the handshake: refused requests end the connection with an error reply, never a
//! panic, and a stream that ends mid-request is an error, not success.
#![no_main]
use libfuzzer_sys::fuzz_target;
use rdmastream::transport::tcp::fuzzing;
use rdmastream::transport::{RegionSettings, SoftRegion};

fuzz_target!(|data: &[u8]| {
    let region = SoftRegion::new(&RegionSettings::plain(4, 256));
    let (replies, end) = fuzzing::serve(&region, data);
    // Every reply is a 24-byte header, possibly followed by data.
    assert!(replies.is_empty() || replies.len() >= 24);
    // Input always runs out, so the connection always ends with a reason.
    assert!(end.is_err());
});
