//! The tcp transport's request decoder (the software NIC) on whatever bytes a connected peer
//! sends after the handshake: refused requests end the connection with an error reply, never a
//! panic, and a stream that ends mid-request is an error, not success.
//!
//! The first byte picks the region and how the bytes arrive: blocks of 256 bytes or of 32 KiB
//! (large enough for the NIC's direct reads of WRITEs of 16 KiB and more), and reads of 1 to
//! 32 386 bytes at a time (small reads drain the NIC's buffer, as a socket's do, so those
//! WRITEs take the direct path instead of being copied out of the buffer).
#![no_main]
use libfuzzer_sys::fuzz_target;
use rdmastream::transport::tcp::fuzzing;
use rdmastream::transport::{RegionSettings, SoftRegion};

fuzz_target!(|data: &[u8]| {
    let Some((&pick, data)) = data.split_first() else {
        return;
    };
    let block = if pick & 1 == 0 { 256 } else { 32 * 1024 };
    let chunk = 1 + usize::from(pick >> 1) * 255;
    let region = SoftRegion::new(&RegionSettings::plain(4, block));
    let (replies, end) = fuzzing::serve(&region, data, chunk);
    // Every reply is a 24-byte header, possibly followed by data.
    assert!(replies.is_empty() || replies.len() >= 24);
    // Input always runs out, so the connection always ends with a reason.
    assert!(end.is_err());
});
