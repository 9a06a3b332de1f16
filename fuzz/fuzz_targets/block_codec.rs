//! The block codec on whatever a peer wrote into a memory block: decoding never panics, and a
//! header that decodes, once sealed, decodes to the same header and payload. Both layouts: a
//! version 2 (coalesced) block that decodes is split into messages that lie inside the block, and
//! re-encoding them gives back the same bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use rdmastream::proto::BlockHeader;
use rdmastream::proto::coalesce::{
    decode_any, decode_coalesced, encode_coalesced, reseal_coalesced,
};

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
    if let Ok(msgs) = decode_any(data, max_device) {
        assert!(!msgs.is_empty());
        for (h, r) in &msgs {
            assert!(r.end <= data.len());
            assert_eq!(r.len(), h.payload_len as usize);
            assert!(h.device <= max_device);
        }
    }
    // Sealed, so the checks behind the seal see every byte the fuzzer chose.
    let mut sealed = data.to_vec();
    if reseal_coalesced(&mut sealed).is_ok()
        && let Ok(msgs) = decode_coalesced(&sealed, max_device)
    {
        let parts: Vec<_> = msgs.iter().map(|(h, r)| (*h, &sealed[r.clone()])).collect();
        let mut block = vec![0; sealed.len()];
        let used = encode_coalesced(&parts, &mut block);
        assert_eq!(&block[..used], &sealed[..used], "re-encoding changes the block");
    }
});
