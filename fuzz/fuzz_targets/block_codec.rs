//! The block codec on whatever a peer wrote into a memory block: decoding never panics, and a
//! header that decodes, once sealed, decodes to the same header and payload.
#![no_main]
use libfuzzer_sys::fuzz_target;
use rdmastream::proto::BlockHeader;

fuzz_target!(|data: &[u8]| {
    let max_device = data.first().copied().unwrap_or(0);
    let _ = BlockHeader::decode_block(data, max_device);
    if let Ok(h) = BlockHeader::decode_header(data, max_device) {
        let mut block = data.to_vec();
        h.seal(&mut block);
        let (again, payload) =
            BlockHeader::decode_block(&block, max_device).expect("a sealed valid header decodes");
        assert_eq!(again, h);
        assert_eq!(payload.len(), h.payload_len as usize);
    }
});
