//! The tcp transport's sender side on whatever bytes a hostile receiver answers with after the
//! handshake: ACKs, READ responses, notices, sliding-window SENDs and errors, in any order and
//! length. The connection ends with a reason, never a panic; it never reports more requests
//! complete than were posted, a READ response of any but the asked length, or more window ACKs
//! than receive requests were posted.
//!
//! The first four bytes pick the setting: how many bytes arrive per read (1 to 16 321), how
//! many write chains are outstanding (0 to 63), whether a READ is outstanding and of how many
//! bytes, and whether the connection is a sliding window's and how many receive requests it
//! has posted.
#![no_main]
use libfuzzer_sys::fuzz_target;
use rdmastream::transport::tcp::fuzzing;

fuzz_target!(|data: &[u8]| {
    let Some((head, data)) = data.split_first_chunk::<4>() else {
        return;
    };
    let chunk = 1 + usize::from(head[0]) * 64;
    let chains = usize::from(head[1] % 64);
    let read = (head[2] & 0x80 != 0).then(|| 1 + usize::from(head[2] & 0x7f) * 16);
    let window = (head[3] & 1 != 0).then(|| usize::from(head[3] >> 1));
    let a = fuzzing::answers(data, chunk, chains, read, window);
    assert!(a.completed <= chains + usize::from(read.is_some()));
    assert!(a.window_acks <= window.unwrap_or(0));
    assert!(a.notices <= rdmastream::transport::MAX_NOTICES);
    assert!(!a.end.is_empty());
});
