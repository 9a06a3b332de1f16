//! The block codec on whatever a peer wrote into a memory block: decoding never panics, under
//! either seal policy, and a header that decodes, once sealed, decodes to the same header and
//! payload (a header-sealed one only where placement is ordered). Both layouts: a
//! version 2 (coalesced) block that decodes is split into messages that lie inside the block, and
//! re-encoding them gives back the same bytes. A block that changes between the receiver's two
//! copies (header, then trailer: a sender rewriting it) never panics the decode either, and a
//! header it accepts keeps its payload inside the block.
#![no_main]
use libfuzzer_sys::fuzz_target;
use rdmastream::proto::{BlockError, BlockHeader, OVERHEAD, Placement};
use rdmastream::proto::coalesce::{
    decode_any, decode_coalesced, encode_coalesced, reseal_coalesced,
};

fuzz_target!(|data: &[u8]| {
    let max_device = data.first().copied().unwrap_or(0);
    let _ = BlockHeader::decode_block(data, max_device);
    let _ = BlockHeader::decode_block_on(data, max_device, Placement::Ordered);
    if let Ok(h) = BlockHeader::decode_header(data, max_device) {
        let mut block = data.to_vec();
        h.seal(&mut block);
        let (again, payload) = BlockHeader::decode_block_on(&block, max_device, Placement::Ordered)
            .expect("a sealed valid header decodes");
        assert_eq!(again, h);
        assert_eq!(payload.len(), h.payload_len as usize);
        let strict = BlockHeader::decode_block(&block, max_device);
        if h.is_header_sealed() {
            assert_eq!(strict.unwrap_err(), BlockError::WeakSeal);
        } else {
            assert_eq!(strict.expect("a fully sealed valid header decodes").0, h);
        }
    }
    // The first half as the block was when its header was copied, the second as it was later.
    let (first, later) = data.split_at(data.len() / 2);
    let later = &later[..first.len()];
    for placement in [Placement::Ordered, Placement::Unordered] {
        let mut copies = 0;
        let got = BlockHeader::decode_block_copied(
            first,
            &mut |at, into| {
                let from = if copies == 0 { first } else { later };
                copies += 1;
                into.copy_from_slice(&from[at..at + into.len()]);
            },
            max_device,
            placement,
        );
        if let Ok(h) = got {
            assert!(OVERHEAD + h.payload_len as usize <= first.len());
        }
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
