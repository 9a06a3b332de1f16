//! Reassembly and per-device reordering fed blocks in whatever order and shape a peer chooses,
//! under a small memory budget: nothing panics, and the budget is never exceeded.
#![no_main]
use libfuzzer_sys::fuzz_target;
use rdmastream::bytes::Bytes;
use rdmastream::proto::{
    BlockHeader, Budget, DeviceStream, Limits, NO_PTS, Packet, ReorderConfig, StreamEvent,
};
use std::time::{Duration, Instant};

const BUDGET: usize = 64 * 1024;

fuzz_target!(|data: &[u8]| {
    let budget = Budget::new(BUDGET);
    let mut stream = DeviceStream::with_limits(
        ReorderConfig { window: 8, timeout: Duration::from_millis(50) },
        Limits { budget: budget.clone(), max_message: 16 * 1024 },
    );
    let start = Instant::now();
    let mut now = start;
    // Each 12-byte record: packet, flags, fragment index/count, payload length, message length,
    // milliseconds to advance.
    for r in data.chunks_exact(12) {
        let u16_at = |o: usize| u16::from_le_bytes([r[o], r[o + 1]]);
        let payload_len = (u16_at(7) % 4096) as u32;
        let header = BlockHeader {
            device: 0,
            packet: u16_at(0) % 64,
            flags: r[2] & 0x0f,
            fragment_index: u16_at(3) % 8,
            fragment_count: u16_at(5) % 8 + 1,
            payload_len,
            frame_index: r[11] as u64,
            timestamp_ns: 0,
            message_len: payload_len.saturating_add(u16_at(9) as u32 * 4),
            duration_ns: 0,
            pts_ns: NO_PTS,
        };
        let payload = Bytes::from(vec![r[11]; payload_len as usize]);
        stream.handle_packet(now, Packet { header, payload, ack: None });
        now += Duration::from_millis((r[11] % 64) as u64);
        if stream.poll_timeout().is_some_and(|t| t <= now) {
            stream.handle_timeout(now);
        }
        while let Some(event) = stream.poll_event() {
            if let StreamEvent::Frame(frame) = &event {
                assert!(frame.data.len() <= 16 * 1024);
            }
        }
        assert!(budget.used() <= BUDGET);
        assert!(stream.held() <= 16);
    }
    stream.release_memory();
    drop(stream);
    assert_eq!(budget.used(), 0, "every reserved byte is given back");
});
