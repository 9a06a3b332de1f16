//! Copies out of memory another party may be writing while it is read (a peer's process over
//! shm, the NIC over verbs): volatile loads into the caller's buffer, so the compiler neither
//! drops the copy nor reads the source again in place of it. What comes out may be torn; the
//! receiver decodes and checks only such copies (header, trailer, coalesced messages), so a check
//! and the use after it see the same bytes.

/// Copies `into.len()` bytes from `src` into `into` with volatile loads: 8-byte words where
/// `src` is aligned to them, single bytes at the ends.
///
/// # Safety
/// `src..src + into.len()` must be readable (allocated and mapped) for the whole call. Others
/// may write it meanwhile: no reference to those bytes is made.
pub(crate) unsafe fn copy(src: *const u8, into: &mut [u8]) {
    let n = into.len();
    let mut i = 0;
    // SAFETY (all three loops): `src + i` for `i < n` is inside the readable range the caller
    // promised, and so is a word at `src + i` while `n - i >= 8`; word loads are aligned.
    while i < n && !(src as usize + i).is_multiple_of(8) {
        into[i] = unsafe { src.add(i).read_volatile() };
        i += 1;
    }
    while n - i >= 8 {
        let w = unsafe { src.add(i).cast::<u64>().read_volatile() };
        into[i..i + 8].copy_from_slice(&w.to_ne_bytes());
        i += 8;
    }
    while i < n {
        into[i] = unsafe { src.add(i).read_volatile() };
        i += 1;
    }
}

#[cfg(test)]
mod tests {
    /// Every offset and length, aligned or not, copies exactly the bytes asked for.
    #[test]
    fn copies_every_range_exactly() {
        let src: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37)).collect();
        for at in 0..24 {
            for len in 0..(64 - at) {
                let mut into = vec![0xEE; len];
                // SAFETY: `at + len <= 64`, inside `src`, which nobody writes.
                unsafe { super::copy(src.as_ptr().add(at), &mut into) };
                assert_eq!(into, &src[at..at + len], "at {at}, len {len}");
            }
        }
    }
}
