//! What a sender (or anyone) sends a receiver during the handshake: the Hello and the Proof.
#![no_main]
use libfuzzer_sys::fuzz_target;
use rdmastream::proto::handshake::{Hello, Key, Proof, claimed_version, valid_sender_name};

fuzz_target!(|data: &[u8]| {
    let _ = claimed_version(data);
    if let Ok(hello) = Hello::decode(data) {
        let _ = valid_sender_name(&hello.sender);
        // What decodes re-encodes to something that decodes the same.
        assert_eq!(Hello::decode(&hello.encode()).as_ref(), Ok(&hello));
    }
    if let Ok(proof) = Proof::decode(data) {
        // A proof made without the key is never accepted.
        let key = Key::new(b"fuzz-key-0123456789abcdef".to_vec()).expect("key");
        assert!(!key.check_sender_proof(b"hello", b"challenge", &proof.mac));
    }
});
