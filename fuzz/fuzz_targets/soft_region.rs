//! Remote WRITEs and READs with peer-chosen targets, offsets and lengths against a soft region
//! (what the tcp transport's NIC thread applies): out-of-bounds accesses are refused, never a
//! panic, and an accepted access lands exactly where it was asked to.
#![no_main]
use libfuzzer_sys::fuzz_target;
use rdmastream::transport::{RegionSettings, SoftRegion, Target};

fuzz_target!(|data: &[u8]| {
    let region = SoftRegion::new(&RegionSettings::plain(4, 64));
    // Each 10-byte record: op/target, offset (u32 LE), length (u32 LE), fill byte.
    for r in data.chunks_exact(10) {
        let target = if r[0] & 1 == 0 { Target::Blocks } else { Target::Statuses };
        let offset = u32::from_le_bytes(r[1..5].try_into().unwrap()) as u64 % 512;
        let len = u32::from_le_bytes(r[5..9].try_into().unwrap()) as usize % 512;
        if r[0] & 2 == 0 {
            let written = region.write_with(target, offset, len, |dst| {
                assert_eq!(dst.len(), len);
                dst.fill(r[9]);
                Ok(())
            });
            if written.is_ok() {
                let limit = match target {
                    Target::Blocks => 64,
                    Target::Statuses => 4,
                };
                assert!(offset + len as u64 <= 4 * limit);
            }
        } else if let Ok(bytes) = region.read_remote(target, offset, len) {
            assert_eq!(target, Target::Statuses);
            assert_eq!(bytes.len(), len);
        }
    }
});
