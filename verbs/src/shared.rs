//! Memory shared between two processes on one host, for the shm transport: a memfd mapped into
//! both, handed from the receiver to the sender over a Unix socket. This module is the whole
//! unsafe part of that transport (mapping, unmapping, copying into the mapping, viewing it);
//! [`crate::shm`] builds the transport on it in safe code, except for one documented view of a
//! block the protocol keeps the sender away from.
//!
//! The memory is written by another process, so no Rust reference to its bytes may be held while
//! that process could write them, and a peer must not be able to make this one fault:
//! - the file is sealed (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`) before it is passed on, and
//!   a received file is mapped only if it carries those seals and is at least as long as the
//!   mapping: nobody can truncate it under a mapping (which would turn every access past the new
//!   end into SIGBUS);
//! - bytes are copied in with [`SharedMapping::write`] (a raw copy, no reference to the
//!   destination), status bytes go through [`SharedMapping::status`] (`AtomicU8`, which is how
//!   memory shared with another thread or process is accessed in Rust);
//! - a slice of the bytes ([`SharedMapping::bytes`]) is an `unsafe fn`: its caller states why
//!   nobody writes that range while the slice lives;
//! - a range lent to one holder to write in place ([`LentRange`], a send-side view of a
//!   receiver's memory block) is made by an `unsafe fn` whose caller states why no other holder
//!   in this process touches that range meanwhile, and [`SharedMapping::copy_in`] (a raw copy
//!   through a shared mapping) likewise.

use std::ffi::c_void;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, AtomicU32};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

/// The seals a shared region must carry before a process maps it: its size is fixed for good.
const REQUIRED_SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// A read-write shared mapping of a whole memfd. Unmapped on drop; the file descriptor is kept
/// so it can be passed on ([`SharedMapping::send_fd`]).
pub struct SharedMapping {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain memory owned by this value until drop (no thread-local state);
// moving it to another thread moves that ownership.
unsafe impl Send for SharedMapping {}
// SAFETY: through `&SharedMapping` there are only bounds-checked copies *out*, atomic views of
// single bytes, and the `unsafe fn`s `bytes`, `copy_in` and `LentRange::new` (whose callers
// promise no other writer or view of the range); safe copies *in* take `&mut self`. So threads
// sharing a `&SharedMapping` cannot race on its bytes among themselves.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// Creates a memfd of `len` bytes (zeroed), seals its size and maps it. `name` shows up in
    /// `/proc/<pid>/fd` (debugging only).
    pub fn create(name: &str, len: usize) -> io::Result<SharedMapping> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a shared region cannot be empty",
            ));
        }
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        rustix::fs::fcntl_add_seals(&fd, REQUIRED_SEALS)?;
        Self::map(fd, len)
    }

    /// Maps `len` bytes of a memfd received from a peer. Refused unless the file's size is
    /// sealed (see the module docs) and it holds at least `len` bytes.
    pub fn open(fd: OwnedFd, len: usize) -> io::Result<SharedMapping> {
        let seals = rustix::fs::fcntl_get_seals(&fd)?;
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the shared region's size is not sealed (it could be truncated under the mapping)",
            ));
        }
        let size = rustix::fs::fstat(&fd)?.st_size;
        if len == 0 || u64::try_from(size).map_or(true, |s| s < len as u64) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the shared region holds {size} bytes, {len} are needed"),
            ));
        }
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> io::Result<SharedMapping> {
        // SAFETY: a new mapping chosen by the kernel (null hint), so it overlaps no memory Rust
        // knows about; the file is at least `len` bytes and sealed against shrinking (checked by
        // the callers), so every byte of the mapping stays backed for its whole life.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )?
        };
        let ptr =
            NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(SharedMapping { ptr, len, fd })
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (an empty region is refused); for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memfd, for passing it on.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "{len} bytes at {offset} are outside the {}-byte shared mapping",
            self.len
        );
    }

    /// Copies `src` into the mapping at `offset`. Panics if the range is outside the mapping
    /// (callers check peer-supplied offsets first). `&mut self`: within this process the writer
    /// is the mapping's only user while it writes (threads cannot race on the bytes); the other
    /// process is kept apart by the protocol.
    pub fn write(&mut self, offset: usize, src: &[u8]) {
        self.check(offset, src.len());
        // SAFETY: the range is inside the mapping (checked above), which lives as long as
        // `self`; `src` is ordinary memory of this process, so it cannot overlap the mapping. No
        // reference to the destination is created: whoever else touches these bytes (the other
        // process) sees raw stores, and the protocol (a block is written only while its status
        // byte is EMPTY, and read only once it is FULL, published with release ordering after
        // this copy) keeps the two apart.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len())
        }
    }

    /// Like [`Self::write`], through a shared reference (a mapping shared with [`LentRange`]s).
    /// Panics if the range is outside the mapping.
    ///
    /// # Safety
    /// No other thread of this process may write or view these bytes while this runs (no
    /// [`LentRange`] covers them, no other `copy_in` or slice does).
    pub unsafe fn copy_in(&self, offset: usize, src: &[u8]) {
        self.check(offset, src.len());
        // SAFETY: as in `write`; the exclusive `&mut self` is replaced by the caller's promise
        // that nothing else in this process touches the range meanwhile.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len())
        }
    }

    /// The byte at `offset` as an atomic (status bytes: loads with acquire, stores with
    /// release). Panics if `offset` is outside the mapping.
    pub fn status(&self, offset: usize) -> &AtomicU8 {
        self.check(offset, 1);
        // SAFETY: inside the mapping, which outlives the returned reference (it borrows
        // `self`); AtomicU8 has the size and alignment of u8; every access to status bytes, in
        // both processes, goes through atomics.
        unsafe { AtomicU8::from_ptr(self.ptr.as_ptr().add(offset)) }
    }

    /// The 32-bit word at `offset` as an atomic (the shm transport's doorbell, a futex word).
    /// Panics if `offset` is outside the mapping or not a multiple of 4.
    pub fn word(&self, offset: usize) -> &AtomicU32 {
        self.check(offset, 4);
        assert!(
            offset.is_multiple_of(4),
            "a 32-bit word at {offset} is not aligned"
        );
        // SAFETY: inside the mapping, which outlives the returned reference (it borrows
        // `self`), and 4-byte aligned (the mapping starts on a page); every access to this word,
        // in both processes, goes through atomics.
        unsafe { AtomicU32::from_ptr(self.ptr.as_ptr().add(offset).cast::<u32>()) }
    }

    /// The `len` bytes at `offset`. Panics if they are outside the mapping.
    ///
    /// # Safety
    /// Nobody (no thread, no other process mapping the same file) may write these bytes while
    /// the returned slice lives: the caller's protocol must keep writers away from this range.
    pub unsafe fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        self.check(offset, len);
        // SAFETY: inside the mapping, which outlives the slice (it borrows `self`); no writer
        // while it lives is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) }
    }

    /// Copies the `len` bytes at `offset` out (a peer may be writing them: what comes out is
    /// whatever the bytes were, torn or not, which is why blocks carry a seal). For tests and
    /// tools.
    pub fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        self.copy_out(offset, &mut out);
        out
    }

    /// Copies the `into.len()` bytes at `offset` into `into` with volatile loads (a peer may be
    /// writing them: what comes out is whatever they were, torn or not, but it is this process's
    /// own copy, decoded and checked once). Panics if they are outside the mapping.
    pub fn copy_out(&self, offset: usize, into: &mut [u8]) {
        self.check(offset, into.len());
        // SAFETY: inside the mapping (checked), which `self` keeps mapped for the call; no
        // reference to the shared bytes is made.
        unsafe { crate::volatile::copy(self.ptr.as_ptr().add(offset), into) }
    }
}

/// A range of a shared mapping lent to one holder, which may view and write it as ordinary
/// bytes (a frame rendered straight into a receiver's memory block). Keeps the mapping alive.
pub struct LentRange {
    mapping: std::sync::Arc<SharedMapping>,
    offset: usize,
    len: usize,
}

impl LentRange {
    /// The `len` bytes at `offset` of `mapping`, lent to the returned value. Panics if they are
    /// outside the mapping.
    ///
    /// # Safety
    /// While the returned value lives, nothing else in this process may write or view these
    /// bytes, and the process the mapping is shared with must not write them (the protocol
    /// keeps the receiver away from a block whose status byte is EMPTY).
    pub unsafe fn new(mapping: std::sync::Arc<SharedMapping>, offset: usize, len: usize) -> Self {
        mapping.check(offset, len);
        LentRange {
            mapping,
            offset,
            len,
        }
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: inside the mapping (checked in `new`), which `self` keeps alive; the range is
        // this value's alone (the promise made in `new`), and `&self` excludes `bytes_mut`.
        unsafe { std::slice::from_raw_parts(self.mapping.ptr.as_ptr().add(self.offset), self.len) }
    }

    /// The bytes, to write.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; `&mut self` makes this the only view of the range.
        unsafe {
            std::slice::from_raw_parts_mut(self.mapping.ptr.as_ptr().add(self.offset), self.len)
        }
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned; every reference into the mapping
        // borrows `self`, so none outlives this call.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast::<c_void>(), self.len) };
    }
}

/// Sends `fd` over `stream` with one byte of data (SCM_RIGHTS).
pub fn send_fd(stream: &UnixStream, fd: BorrowedFd<'_>) -> io::Result<()> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let fds = [fd];
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other("no room for the file descriptor"));
    }
    // A signal before the byte went out leaves the descriptor unsent: send again, as
    // `recv_fd` receives again.
    let sent = loop {
        match rustix::net::sendmsg(
            stream,
            &[io::IoSlice::new(&[FD_MARK])],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Ok(n) => break n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    if sent != 1 {
        return Err(io::ErrorKind::WriteZero.into());
    }
    Ok(())
}

/// The data byte that carries a passed file descriptor.
const FD_MARK: u8 = b'F';

/// Receives one file descriptor sent with [`send_fd`] (blocking, within the stream's read
/// timeout). Anything else — end of stream, a byte without a descriptor, several descriptors —
/// is an error (extra descriptors are closed).
pub fn recv_fd(stream: &UnixStream) -> io::Result<OwnedFd> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut byte = [0u8; 1];
    let got = loop {
        match rustix::net::recvmsg(
            stream,
            &mut [io::IoSliceMut::new(&mut byte)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(r) => break r,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let mut fds: Vec<OwnedFd> = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            fds.extend(received);
        }
    }
    if got.bytes == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    if byte[0] != FD_MARK || fds.len() != 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "expected one file descriptor, got {} with byte {:#04x}",
                fds.len(),
                byte[0]
            ),
        ));
    }
    Ok(fds.pop().expect("one"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn two_mappings_of_one_memfd_see_each_others_bytes() {
        let a = SharedMapping::create("test", 4096).unwrap();
        let (x, y) = UnixStream::pair().unwrap();
        send_fd(&x, a.fd()).unwrap();
        let mut b = SharedMapping::open(recv_fd(&y).unwrap(), 4096).unwrap();
        b.write(100, b"hello");
        b.status(7).store(1, Ordering::Release);
        assert_eq!(a.status(7).load(Ordering::Acquire), 1);
        assert_eq!(a.read(100, 5), b"hello");
        // SAFETY: nothing writes the mapping while the slice lives (single-threaded test).
        assert_eq!(unsafe { a.bytes(100, 5) }, b"hello");
    }

    #[test]
    fn an_unsealed_or_short_file_is_not_mapped() {
        let fd = rustix::fs::memfd_create("unsealed", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 4096).unwrap();
        let e = SharedMapping::open(fd, 4096).err().unwrap();
        assert!(e.to_string().contains("not sealed"), "{e}");
        let a = SharedMapping::create("short", 4096).unwrap();
        let fd = a.fd().try_clone_to_owned().unwrap();
        let e = SharedMapping::open(fd, 8192).err().unwrap();
        assert!(e.to_string().contains("4096 bytes, 8192"), "{e}");
        // Sealed: the holder of the descriptor cannot shrink it under a mapping.
        assert!(rustix::fs::ftruncate(a.fd(), 10).is_err());
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn a_write_outside_the_mapping_panics() {
        SharedMapping::create("oob", 64)
            .unwrap()
            .write(60, b"12345");
    }

    #[test]
    fn a_byte_without_a_descriptor_is_refused() {
        let (mut x, y) = UnixStream::pair().unwrap();
        std::io::Write::write_all(&mut x, b"F").unwrap();
        assert!(recv_fd(&y).is_err());
        drop(x);
        assert_eq!(
            recv_fd(&y).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }
}
