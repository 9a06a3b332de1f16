//! Protection domains, memory regions (that own their memory) and remote regions.

use super::*;
use std::ffi::c_int;
use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::{BitOr, Range};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::AtomicU8;

use ibverbs_sys as ffi;

pub(crate) struct PdInner {
    pub(crate) pd: NonNull<ffi::ibv_pd>,
    pub(crate) ctx: Arc<ContextInner>,
}

// SAFETY: a PD is an immutable handle after allocation; verbs using it are thread safe.
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: MRs and QPs hold an `Arc<PdInner>`, so none is left; freed once. The
        // context is still open because `self.ctx` is dropped after this body.
        unsafe { ffi::ibv_dealloc_pd(self.pd.as_ptr()) };
    }
}

/// A protection domain: memory regions and queue pairs of one PD can work together.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("device", &self.inner.ctx.name)
            .finish()
    }
}

/// Access rights of a memory region or of a queue pair's responder side.
///
/// Only the flags this project may use exist here; in particular there is no relaxed
/// ordering, so the in-order placement that status-byte polling relies on is never given up.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct AccessFlags(pub(crate) u32);

impl AccessFlags {
    /// Local access only (the NIC may read the region as a WRITE source).
    pub const NONE: Self = Self(0);
    /// The local NIC may write (READ destination). Required with any remote write.
    pub const LOCAL_WRITE: Self = Self(ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0);
    /// Peers may RDMA WRITE.
    pub const REMOTE_WRITE: Self = Self(ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0);
    /// Peers may RDMA READ.
    pub const REMOTE_READ: Self = Self(ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0);
    /// Peers may run atomics.
    pub const REMOTE_ATOMIC: Self = Self(ffi::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0);

    /// Whether every flag of `other` is set in `self`.
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether a peer can change the memory (remote write or atomic).
    pub const fn remotely_writable(self) -> bool {
        self.0 & (Self::REMOTE_WRITE.0 | Self::REMOTE_ATOMIC.0) != 0
    }

    fn bits(self) -> c_int {
        // The flags defined above all fit in the low bits.
        self.0 as c_int
    }
}

impl BitOr for AccessFlags {
    type Output = Self;

    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

impl fmt::Debug for AccessFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Self::LOCAL_WRITE, "LOCAL_WRITE"),
            (Self::REMOTE_WRITE, "REMOTE_WRITE"),
            (Self::REMOTE_READ, "REMOTE_READ"),
            (Self::REMOTE_ATOMIC, "REMOTE_ATOMIC"),
        ];
        let set: Vec<_> = names
            .iter()
            .filter(|(flag, _)| self.contains(*flag))
            .map(|(_, name)| *name)
            .collect();
        if set.is_empty() {
            f.write_str("NONE")
        } else {
            f.write_str(&set.join("|"))
        }
    }
}

/// Zero-initialised heap memory aligned to [`REGION_ALIGN`], sized in whole pages.
pub(crate) struct PageBuf {
    pub(crate) ptr: NonNull<u8>,
    pub(crate) layout: std::alloc::Layout,
}

impl PageBuf {
    pub(crate) fn zeroed(len: usize) -> Result<PageBuf> {
        let size = len
            .checked_next_multiple_of(REGION_ALIGN)
            .filter(|&s| s > 0)
            .ok_or_else(|| VerbsError::InvalidArgument(format!("region length {len}")))?;
        let layout = std::alloc::Layout::from_size_align(size, REGION_ALIGN)
            .map_err(|e| VerbsError::InvalidArgument(format!("region length {len}: {e}")))?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            std::alloc::handle_alloc_error(layout)
        };
        Ok(PageBuf { ptr, layout })
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this very layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Registered memory that owns its buffer (page-aligned, zero-initialised).
///
/// Share it between threads and queue pairs with `Arc<MemoryRegion>`. The buffer lives until
/// the region is dropped, and is freed only after `ibv_dereg_mr` succeeded. See the module
/// docs for which accessors are safe and why.
pub struct MemoryRegion {
    pub(crate) mr: NonNull<ffi::ibv_mr>,
    /// Not dropped if deregistration fails: the NIC might still access it, so it is leaked.
    pub(crate) buf: ManuallyDrop<PageBuf>,
    pub(crate) len: usize,
    pub(crate) access: AccessFlags,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
    pub(crate) pd: Arc<PdInner>,
}

// SAFETY: the `ibv_mr` handle is immutable after registration and deregistered only in
// `Drop`. The buffer is only reachable through `atomic_bytes` (atomics, fine across
// threads) and the `unsafe` accessors whose contracts exclude concurrent conflicting access.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above: every `&self` method is either read-only metadata, atomics, or `unsafe`
// with a contract that rules out data races.
unsafe impl Sync for MemoryRegion {}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("lkey", &format_args!("{:#x}", self.lkey))
            .field("rkey", &format_args!("{:#x}", self.rkey))
            .field("access", &self.access)
            .finish()
    }
}

impl ProtectionDomain {
    /// Allocates `len` zeroed bytes (page aligned) and registers them with exactly `access`.
    ///
    /// `REMOTE_WRITE` and `REMOTE_ATOMIC` need `LOCAL_WRITE` too (verbs rule); this is
    /// checked here rather than silently added, so the caller states every right it grants.
    pub fn register(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        if access.remotely_writable() && !access.contains(AccessFlags::LOCAL_WRITE) {
            return Err(VerbsError::InvalidArgument(format!(
                "access {access:?}: REMOTE_WRITE/REMOTE_ATOMIC require LOCAL_WRITE"
            )));
        }
        let buf = PageBuf::zeroed(len)?;
        // SAFETY: the PD is alive; `buf` is a valid allocation of at least `len` bytes that
        // outlives the registration (it is freed only after `ibv_dereg_mr` in `Drop`). The
        // exported `ibv_reg_mr` is the plain registration the header macro calls when no
        // optional flag is given; `access` never holds optional flags.
        let mr = unsafe {
            ffi::ibv_reg_mr(
                self.inner.pd.as_ptr(),
                buf.ptr.as_ptr().cast(),
                len,
                access.bits(),
            )
        };
        let mr = NonNull::new(mr).ok_or_else(|| VerbsError::Verbs {
            op: "ibv_reg_mr",
            device: self.inner.ctx.name.clone(),
            source: null_error(),
        })?;
        // SAFETY: `mr` was just returned by `ibv_reg_mr`; its keys never change afterwards.
        let (lkey, rkey) = unsafe { ((*mr.as_ptr()).lkey, (*mr.as_ptr()).rkey) };
        Ok(MemoryRegion {
            mr,
            buf: ManuallyDrop::new(buf),
            len,
            access,
            lkey,
            rkey,
            pd: Arc::clone(&self.inner),
        })
    }
}

impl MemoryRegion {
    /// Length in bytes (as registered; never 0).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Copies the `into.len()` bytes at `at` into `into` with volatile loads: safe whoever
    /// writes them meanwhile (a peer's RDMA WRITE), as no reference to them is made; what comes
    /// out may be torn, which is what a block's seal is checked for. Panics if they are out of
    /// bounds.
    pub fn copy_out(&self, at: usize, into: &mut [u8]) {
        self.check_range(&(at..at + into.len()));
        // SAFETY: in bounds (checked); the buffer is allocated and owned by `self` for the call.
        unsafe { crate::volatile::copy(self.buf.ptr.as_ptr().add(at), into) }
    }

    /// Always `false`: empty regions cannot be registered.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start address: the `remote_addr` peers use for byte 0 of this region.
    pub fn addr(&self) -> u64 {
        self.buf.ptr.as_ptr() as u64
    }

    /// Local key, for scatter/gather entries of local work requests.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// Remote key, for peers' RDMA operations on this region.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// The access rights it was registered with.
    pub fn access(&self) -> AccessFlags {
        self.access
    }

    /// What a peer needs to address this region.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            addr: self.addr(),
            len: self.len as u64,
            rkey: self.rkey,
        }
    }

    /// The whole region as atomic bytes: safe at any time, also while the NIC writes into
    /// it (see the module docs for the argument). Poll status bytes through this view;
    /// use `Ordering::Acquire` loads to order later reads after the observed byte.
    pub fn atomic_bytes(&self) -> &[AtomicU8] {
        // SAFETY: the buffer is valid, initialised and `len` bytes long while `self` lives;
        // `AtomicU8` has the size, alignment and bit validity of `u8`, and its interior
        // mutability makes concurrent changes (other threads' atomic stores, NIC DMA)
        // permitted under a shared reference.
        unsafe { std::slice::from_raw_parts(self.buf.ptr.as_ptr().cast::<AtomicU8>(), self.len) }
    }

    fn check_range(&self, range: &Range<usize>) {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "range {range:?} outside memory region of {} bytes",
            self.len
        );
    }

    /// The whole region as bytes.
    ///
    /// # Safety
    ///
    /// While the returned slice lives, nothing may write these bytes: no RDMA READ posted
    /// into them may be outstanding (completion not yet polled), no peer may RDMA WRITE or
    /// run atomics on them (guaranteed if the region lacks `REMOTE_WRITE`/`REMOTE_ATOMIC`,
    /// otherwise by the protocol), and no thread may store to them through
    /// [`atomic_bytes`](Self::atomic_bytes) or [`range_mut`](Self::range_mut).
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the caller upholds the contract above; the buffer is valid for `len`.
        unsafe { self.range(0..self.len) }
    }

    /// The whole region as mutable bytes.
    ///
    /// # Safety
    ///
    /// While the returned slice lives, nothing else may read or write these bytes: no
    /// posted RDMA WRITE may still use them as source, no RDMA READ may target them, no
    /// peer may access them remotely (guaranteed if the region has no remote access,
    /// otherwise by the protocol), and no other view
    /// ([`atomic_bytes`](Self::atomic_bytes), `range`, `range_mut` on another handle of the
    /// same `Arc`) may be used on them.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the caller upholds the contract above; `&mut self` excludes other views
        // through this handle; the buffer is valid for `len`.
        unsafe { self.range_mut(0..self.len) }
    }

    /// Bytes `range` of the region. Panics if `range` is out of bounds.
    ///
    /// # Safety
    ///
    /// Same as [`as_slice`](Self::as_slice), restricted to the bytes in `range`.
    pub unsafe fn range(&self, range: Range<usize>) -> &[u8] {
        self.check_range(&range);
        // SAFETY: in bounds (checked); the bytes are initialised; no concurrent writes by
        // the caller's contract.
        unsafe { std::slice::from_raw_parts(self.buf.ptr.as_ptr().add(range.start), range.len()) }
    }

    /// Bytes `range` of the region, mutable, through a shared handle (so that a filling
    /// thread can fill block *i* while block *j* of the same `Arc<MemoryRegion>` is being
    /// sent). Panics if `range` is out of bounds.
    ///
    /// # Safety
    ///
    /// Same as [`as_mut_slice`](Self::as_mut_slice), restricted to the bytes in `range`; in
    /// particular no other live reference (from any thread) may overlap `range`.
    #[allow(clippy::mut_from_ref)] // interior mutability of DMA memory; contract above.
    pub unsafe fn range_mut(&self, range: Range<usize>) -> &mut [u8] {
        self.check_range(&range);
        // SAFETY: in bounds (checked); the buffer was allocated mutable and is owned by
        // `self`; exclusivity over `range` is the caller's contract.
        unsafe {
            std::slice::from_raw_parts_mut(self.buf.ptr.as_ptr().add(range.start), range.len())
        }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered in `register`, deregistered once. The PD is alive (`self.pd`
        // is dropped after this body). Posted work that still refers to the region fails
        // with a protection error afterwards instead of touching freed memory.
        let ret = unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
        if ret == 0 {
            // SAFETY: deregistered, so the NIC no longer accesses the buffer; dropped once.
            unsafe { ManuallyDrop::drop(&mut self.buf) };
        }
        // On failure the buffer is deliberately leaked: the NIC may still DMA into it.
    }
}

/// The address, length and rkey a peer needs to reach a registered region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteRegion {
    /// Address of byte 0.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

impl RemoteRegion {
    /// The remote address of byte `offset`. Panics if `offset` is beyond the region.
    pub fn addr_at(&self, offset: u64) -> u64 {
        assert!(
            offset <= self.len,
            "offset {offset} beyond {} bytes",
            self.len
        );
        self.addr + offset
    }
}
