//! What a receiver (or anyone listening on its address) answers a sender: the Challenge and the
//! Welcome, including the Welcome's proof check.
#![no_main]
use libfuzzer_sys::fuzz_target;
use rdmastream::proto::handshake::{Challenge, Key, PROTOCOL_VERSION, Welcome};

fuzz_target!(|data: &[u8]| {
    let _ = Challenge::decode(data);
    if let Ok(welcome) = Welcome::decode(data) {
        let key = Key::new(b"fuzz-key-0123456789abcdef".to_vec()).expect("key");
        // A Welcome nobody with the key signed is never accepted.
        assert!(!key.check_welcome(b"hello", b"challenge", &welcome));
        // (A version 1 refusal decodes too, for a clear message; only current Welcomes are
        // re-encoded.)
        if welcome.version == PROTOCOL_VERSION {
            assert_eq!(Welcome::decode(&welcome.encode()).as_ref(), Ok(&welcome));
        }
    }
});
