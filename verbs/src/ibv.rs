//! Safe RDMA verbs layer: the only module of the project that contains `unsafe`.
//!
//! It wraps just what rdmastream needs from libibverbs (through the `ibverbs-sys` FFI crate):
//! device listing and opening, port and GID queries with perftest-like GID selection,
//! protection domains, memory regions that own their memory, completion queues with busy
//! polling, and RC queue pairs that post chains of RDMA WRITEs (from registered memory or
//! inline) and RDMA READs.
//!
//! It deliberately does **not** offer SEND/RECV, UD/UC queue pairs, shared receive queues,
//! atomics, memory windows, completion channels (callers busy-poll with their own backoff)
//! or connection management: the [`QpEndpoint`] of each side is exchanged by the caller
//! over its own side channel (e.g. TCP) with [`QpEndpoint::to_bytes`].
//!
//! # Object lifetimes
//!
//! ```text
//! Context ◄── ProtectionDomain ◄── MemoryRegion
//!    ▲               ▲
//!    └── CompletionQueue ◄── PreparedQp / ConnectedQp ──► ProtectionDomain
//! ```
//!
//! Every object keeps an `Arc` to the inner state of its parents, so a parent is released
//! only after all its children: a queue pair is destroyed before its completion queues and
//! protection domain, a memory region is deregistered before its protection domain, and all
//! of them before the device context is closed. Users may drop the handles in any order.
//!
//! # Registered memory and soundness
//!
//! A [`MemoryRegion`] owns a page-aligned, zero-initialised heap buffer that is registered
//! for its whole life and freed only after `ibv_dereg_mr` succeeded (after which the NIC can
//! no longer touch it). The NIC reads and writes that buffer behind the compiler's back:
//! the local NIC for posted WRITE sources and READ destinations, a remote NIC for any region
//! registered with remote access. The buffer is therefore treated like memory shared with
//! another process:
//!
//! * [`MemoryRegion::atomic_bytes`] is safe. It views the buffer as `&[AtomicU8]`:
//!   `AtomicU8` has the same size, alignment and bit validity as `u8`, and — being built on
//!   `UnsafeCell` — a shared `&AtomicU8` explicitly allows the byte to change under it, be
//!   it through another `&AtomicU8` or through a DMA write by the NIC. A DMA write of one
//!   byte can never be observed torn (single bytes have no tearing), and every CPU-side
//!   access through this view is an atomic access, so no data race on the Rust side exists.
//!   This is the view to poll status bytes with while the NIC writes into them.
//! * [`MemoryRegion::as_slice`], [`MemoryRegion::as_mut_slice`], [`MemoryRegion::range`] and
//!   [`MemoryRegion::range_mut`] hand out plain `&[u8]`/`&mut [u8]`, which promise the
//!   compiler that nothing else changes (or, for `&mut`, even reads) those bytes while the
//!   reference lives. That is only true when no RDMA operation targets them and no other
//!   thread touches them, which this module cannot check — a remote peer holding the rkey
//!   may write at any time — so they are `unsafe fn` with the exact condition documented.
//!
//! Note that seeing a status byte change (even with `Ordering::Acquire`) does not by itself
//! prove that the NIC has placed the payload written before it: that relies on in-order
//! placement, which NICs provide but the verbs specification does not promise (see
//! `ibv_reg_mr(3)`, "ORDERING SEMANTICS"). Protocols should validate a block (length, seal)
//! before using it. `IBV_ACCESS_RELAXED_ORDERING` is never used by this module.
//!
//! Posting work requests is `unsafe` ([`ConnectedQp::post_write_chain`],
//! [`ConnectedQp::post_read`]): the NIC accesses the local memory asynchronously, until the
//! completion is polled, which the type system cannot follow.

use std::collections::hash_map::RandomState;
use std::ffi::{CStr, c_int};
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::mem::{self, ManuallyDrop};
use std::net::Ipv6Addr;
use std::ops::{BitOr, Range};
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::sync::atomic::AtomicU8;

use ibverbs_sys as ffi;

/// Result of every fallible call of this module.
///
/// Errors carry the OS error (errno) as their `source()`; print them with the chain (e.g.
/// anyhow's `{:#}`) to see it.
pub type Result<T> = std::result::Result<T, VerbsError>;

/// Alignment (and size granularity) of the memory owned by a [`MemoryRegion`].
///
/// Whole pages keep other heap data out of pinned pages and give DMA-friendly alignment.
pub const REGION_ALIGN: usize = 4096;

/// What went wrong in the verbs layer.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// libibverbs found no kernel RDMA support (`ENOSYS`), e.g. on a host kernel built
    /// without InfiniBand/RDMA.
    #[error(
        "{op} failed: the running kernel has no RDMA support \
         (no /sys/class/infiniband_verbs); run on a machine or VM with an RDMA device, \
         e.g. Soft-RoCE (rdma_rxe)"
    )]
    NoKernelSupport {
        /// The verbs call that failed.
        op: &'static str,
        /// The OS error (ENOSYS).
        #[source]
        source: io::Error,
    },
    /// The kernel supports RDMA but no device is present.
    #[error("no RDMA device found (ibv_get_device_list returned 0 devices)")]
    NoDevice,
    /// A device was asked for by name and is not there.
    #[error("RDMA device '{wanted}' not found; available: {available}")]
    DeviceNotFound {
        /// The name asked for.
        wanted: String,
        /// Comma-separated names of the devices present.
        available: String,
    },
    /// A verbs call returned an error.
    #[error("{op} failed on {device}")]
    Verbs {
        /// The verbs call (and what it was for).
        op: &'static str,
        /// The device name.
        device: String,
        /// The OS error reported by libibverbs or the provider.
        #[source]
        source: io::Error,
    },
    /// `ibv_create_qp` refused the requested capabilities.
    #[error(
        "ibv_create_qp failed on {device} (asked max_send_wr={}, max_recv_wr={}, \
         max_send_sge={}, max_recv_sge={}, max_inline_data={})",
        .asked.max_send_wr, .asked.max_recv_wr, .asked.max_send_sge, .asked.max_recv_sge,
        .asked.max_inline_data
    )]
    CreateQp {
        /// The device name.
        device: String,
        /// What was asked for.
        asked: QpCaps,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The device granted less inline data than asked for.
    #[error("{device} granted max_inline_data={granted} bytes, below the {requested} asked for")]
    InlineTooSmall {
        /// The device name.
        device: String,
        /// Bytes asked for.
        requested: u32,
        /// Bytes granted.
        granted: u32,
    },
    /// The port is not usable.
    #[error("port {port} of {device} is {state}, not ACTIVE")]
    PortNotActive {
        /// The device name.
        device: String,
        /// The port number.
        port: u8,
        /// Its state.
        state: PortState,
    },
    /// No GID entry fits (none at all, or not the explicitly asked index).
    #[error("{reason} on {device} port {port}; GID table: [{table}]")]
    NoUsableGid {
        /// The device name.
        device: String,
        /// The port number.
        port: u8,
        /// Why no entry was chosen.
        reason: String,
        /// The valid entries of the port, for the message.
        table: String,
    },
    /// A work request of a chain is invalid; nothing of the chain was posted.
    #[error("work request {wr_index} not posted: {reason}")]
    InvalidWorkRequest {
        /// Index of the offending request in the chain.
        wr_index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// `ibv_post_send` rejected a work request of the chain.
    #[error(
        "ibv_post_send failed at work request {wr_index} of {chain_len} \
         (requests before it were posted)"
    )]
    PostSend {
        /// Index in the chain of the first request not posted.
        wr_index: usize,
        /// Length of the chain.
        chain_len: usize,
        /// The OS error returned by the provider.
        #[source]
        source: io::Error,
    },
    /// `ibv_poll_cq` reported an error (the CQ is in a bad state).
    #[error("ibv_poll_cq failed on {device}: returned {ret}")]
    PollCq {
        /// The device name.
        device: String,
        /// The negative value returned.
        ret: i32,
    },
    /// An argument is out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// Turns a verbs return value (0, a positive errno, a negative errno, or -1 with `errno`
/// set) into an `io::Error`.
fn ret_error(ret: c_int) -> io::Error {
    match ret {
        -1 => {
            let last = io::Error::last_os_error();
            if last.raw_os_error().unwrap_or(0) == 0 {
                io::Error::other("returned -1 without errno")
            } else {
                last
            }
        }
        r if r < 0 => io::Error::from_raw_os_error(-r),
        r => io::Error::from_raw_os_error(r),
    }
}

/// `errno` after a call that returned NULL, with a fallback when the provider set none.
fn null_error() -> io::Error {
    let last = io::Error::last_os_error();
    if last.raw_os_error().unwrap_or(0) == 0 {
        io::Error::other("returned NULL without errno")
    } else {
        last
    }
}

// ---------------------------------------------------------------------------------------
// Devices
// ---------------------------------------------------------------------------------------

/// An RDMA device as listed by `ibv_get_device_list`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name, e.g. `rxe0`, `mlx5_0`.
    pub name: String,
    /// Node GUID in host byte order.
    pub guid: u64,
}

impl DeviceInfo {
    /// The GUID the way `ibv_devices` prints it (16 hex digits).
    pub fn guid_hex(&self) -> String {
        format!("{:016x}", self.guid)
    }
}

/// The array returned by `ibv_get_device_list`, freed on drop.
struct DeviceList {
    list: NonNull<*mut ffi::ibv_device>,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<DeviceList> {
        let mut num: c_int = 0;
        // SAFETY: `num` is a valid out-pointer; the call has no other preconditions.
        let list = unsafe { ffi::ibv_get_device_list(&mut num) };
        let Some(list) = NonNull::new(list) else {
            let err = null_error();
            return Err(if err.raw_os_error() == Some(38) {
                VerbsError::NoKernelSupport {
                    op: "ibv_get_device_list",
                    source: err,
                }
            } else {
                VerbsError::Verbs {
                    op: "ibv_get_device_list",
                    device: "(none)".into(),
                    source: err,
                }
            });
        };
        let list = DeviceList {
            list,
            len: usize::try_from(num).unwrap_or(0),
        };
        if list.len == 0 {
            return Err(VerbsError::NoDevice);
        }
        Ok(list)
    }

    fn devices(&self) -> impl Iterator<Item = *mut ffi::ibv_device> + '_ {
        // SAFETY: libibverbs returns an array of `len` valid device pointers (followed by a
        // NULL) that stays valid until `ibv_free_device_list`, i.e. while `self` lives.
        (0..self.len).map(|i| unsafe { *self.list.as_ptr().add(i) })
    }

    fn info(dev: *mut ffi::ibv_device) -> DeviceInfo {
        // SAFETY: `dev` comes from a live device list; the name is a NUL-terminated string
        // owned by the device structure, copied out before the list is freed.
        let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: `dev` comes from a live device list.
        let guid = u64::from_be(unsafe { ffi::ibv_get_device_guid(dev) });
        DeviceInfo { name, guid }
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the pointer came from `ibv_get_device_list` and is freed exactly once.
        // Contexts opened from it stay valid (see ibv_get_device_list(3)).
        unsafe { ffi::ibv_free_device_list(self.list.as_ptr()) }
    }
}

/// Lists the RDMA devices of this machine.
///
/// Fails with [`VerbsError::NoKernelSupport`] when the kernel has no RDMA at all and with
/// [`VerbsError::NoDevice`] when it has but no device exists.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    let list = DeviceList::get()?;
    Ok(list.devices().map(DeviceList::info).collect())
}

// ---------------------------------------------------------------------------------------
// Context, ports and GIDs
// ---------------------------------------------------------------------------------------

struct ContextInner {
    ctx: NonNull<ffi::ibv_context>,
    name: String,
}

// SAFETY: an `ibv_context` may be used from any thread; libibverbs and its providers
// serialise what needs it internally (verbs are thread safe, see ibv_open_device(3) and the
// rdma-core threading notes). The pointer is only freed in `Drop`.
unsafe impl Send for ContextInner {}
// SAFETY: as above; `&ContextInner` only allows calls libibverbs documents as thread safe.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: every child (PD, CQ, and through them MRs and QPs) holds an `Arc` to this
        // inner state, so all of them are released already; the context is closed once.
        unsafe { ffi::ibv_close_device(self.ctx.as_ptr()) };
    }
}

/// An open RDMA device (`ibv_context`). Cheap to clone.
#[derive(Clone)]
pub struct Context {
    inner: Arc<ContextInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.inner.name)
            .finish()
    }
}

impl Context {
    /// Opens the device called `name`, or the first device when `name` is `None`.
    pub fn open(name: Option<&str>) -> Result<Context> {
        let list = DeviceList::get()?;
        let dev = match name {
            None => list.devices().next().ok_or(VerbsError::NoDevice)?,
            Some(wanted) => list
                .devices()
                .find(|&d| DeviceList::info(d).name == wanted)
                .ok_or_else(|| VerbsError::DeviceNotFound {
                    wanted: wanted.to_owned(),
                    available: list
                        .devices()
                        .map(|d| DeviceList::info(d).name)
                        .collect::<Vec<_>>()
                        .join(", "),
                })?,
        };
        let name = DeviceList::info(dev).name;
        // SAFETY: `dev` is a valid device of the live list `list`.
        let ctx = unsafe { ffi::ibv_open_device(dev) };
        let ctx = NonNull::new(ctx).ok_or_else(|| VerbsError::Verbs {
            op: "ibv_open_device",
            device: name.clone(),
            source: null_error(),
        })?;
        Ok(Context {
            inner: Arc::new(ContextInner { ctx, name }),
        })
    }

    /// The device name, e.g. `rxe0`.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    fn err(&self, op: &'static str, source: io::Error) -> VerbsError {
        VerbsError::Verbs {
            op,
            device: self.inner.name.clone(),
            source,
        }
    }

    /// Queries port `port` (ports count from 1).
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: `ibv_query_port` is the exported compat symbol (the header's macro wraps
        // it); it fills only the leading, older part of `ibv_port_attr` — which holds every
        // field read here — and the rest stays as zeroed by `default()`. The context is open.
        let ret = unsafe {
            ffi::ibv_query_port(
                self.inner.ctx.as_ptr(),
                port,
                (&raw mut attr).cast::<ffi::_compat_ibv_port_attr>(),
            )
        };
        if ret != 0 {
            return Err(self.err("ibv_query_port", ret_error(ret)));
        }
        Ok(PortAttr {
            state: PortState::from_raw(attr.state),
            lid: attr.lid,
            active_mtu: Mtu::from_raw(attr.active_mtu),
            link_layer: LinkLayer::from_raw(attr.link_layer),
            gid_tbl_len: u32::try_from(attr.gid_tbl_len).unwrap_or(0),
        })
    }

    /// The valid (non-empty) GID entries of port `port`, with their RoCE type.
    ///
    /// Uses `ibv_query_gid_table`, one ioctl for the whole table. Where that fails (old
    /// kernels, or more valid entries than fit one ioctl), it asks entry by entry with
    /// `ibv_query_gid_ex`, which itself falls back to sysfs `ports/<p>/gids/<i>` and
    /// `gid_attrs/types/<i>` (the file that says "RoCE v2").
    pub fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        let port_attr = self.query_port(port)?;
        let entry_size = mem::size_of::<ffi::ibv_gid_entry>();
        // The kernel takes the output buffer length as a u16: at most 65535 bytes.
        let max = (port_attr.gid_tbl_len as usize).clamp(1, usize::from(u16::MAX) / entry_size);
        let mut raw = vec![ffi::ibv_gid_entry::default(); max];
        // SAFETY: `raw` has room for `max` entries of `entry_size` bytes; flags must be 0.
        let n = unsafe {
            ffi::_ibv_query_gid_table(
                self.inner.ctx.as_ptr(),
                raw.as_mut_ptr(),
                max,
                0,
                entry_size,
            )
        };
        let raw = match usize::try_from(n) {
            Ok(n) => {
                raw.truncate(n);
                raw
            }
            Err(_) => self.gid_entries_one_by_one(port, port_attr.gid_tbl_len)?,
        };
        Ok(raw
            .iter()
            .filter(|e| e.port_num == u32::from(port))
            .map(|e| GidEntry {
                index: e.gid_index,
                // SAFETY: every bit pattern is a valid `[u8; 16]`; `raw` is the union's
                // byte view of the GID.
                gid: Gid(unsafe { e.gid.raw }),
                gid_type: GidType::from_raw(e.gid_type),
            })
            .filter(|e| !e.gid.is_zero())
            .collect())
    }

    fn gid_entries_one_by_one(&self, port: u8, len: u32) -> Result<Vec<ffi::ibv_gid_entry>> {
        let mut out = Vec::new();
        for index in 0..len {
            let mut entry = ffi::ibv_gid_entry::default();
            // SAFETY: `entry` is a valid out-pointer of the size passed; flags must be 0.
            let ret = unsafe {
                ffi::_ibv_query_gid_ex(
                    self.inner.ctx.as_ptr(),
                    u32::from(port),
                    index,
                    &mut entry,
                    0,
                    mem::size_of::<ffi::ibv_gid_entry>(),
                )
            };
            match ret {
                0 => out.push(entry),
                // ENODATA: an empty slot.
                61 => {}
                ret => return Err(self.err("ibv_query_gid_ex", ret_error(ret))),
            }
        }
        Ok(out)
    }

    /// Chooses the GID to use on `port`, like perftest: an explicit index when given
    /// (it must exist), else for RoCE the best entry by [`choose_gid`] (RoCE v2,
    /// IPv4-mapped, not link-local), for InfiniBand the lowest index.
    pub fn select_gid(&self, port: u8, explicit: Option<u32>) -> Result<GidEntry> {
        let attr = self.query_port(port)?;
        let table = self.gid_table(port)?;
        choose_gid(&table, attr.link_layer, explicit).ok_or_else(|| VerbsError::NoUsableGid {
            device: self.inner.name.clone(),
            port,
            reason: match explicit {
                Some(i) => format!("GID index {i} is empty or out of range"),
                None => "no valid GID entry".into(),
            },
            table: table
                .iter()
                .map(|e| format!("{}: {} {}", e.index, e.gid, e.gid_type))
                .collect::<Vec<_>>()
                .join(", "),
        })
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        // SAFETY: the context is open for as long as `self.inner` lives.
        let pd = unsafe { ffi::ibv_alloc_pd(self.inner.ctx.as_ptr()) };
        let pd = NonNull::new(pd).ok_or_else(|| self.err("ibv_alloc_pd", null_error()))?;
        Ok(ProtectionDomain {
            inner: Arc::new(PdInner {
                pd,
                ctx: Arc::clone(&self.inner),
            }),
        })
    }

    /// Creates a completion queue with room for at least `size` completions.
    pub fn create_cq(&self, size: u32) -> Result<CompletionQueue> {
        let cqe = c_int::try_from(size.max(1))
            .map_err(|_| VerbsError::InvalidArgument(format!("CQ size {size} too large")))?;
        // SAFETY: the context is open; no completion channel, no user context.
        let cq = unsafe {
            ffi::ibv_create_cq(
                self.inner.ctx.as_ptr(),
                cqe,
                ptr::null_mut(),
                ptr::null_mut(),
                0,
            )
        };
        let cq = NonNull::new(cq).ok_or_else(|| self.err("ibv_create_cq", null_error()))?;
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                cq,
                ctx: Arc::clone(&self.inner),
            }),
        })
    }
}

/// Attributes of a port (a subset of `ibv_port_attr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortAttr {
    /// Logical port state.
    pub state: PortState,
    /// Base LID (0 on RoCE).
    pub lid: u16,
    /// Active MTU, used as the path MTU of queue pairs on this port.
    pub active_mtu: Mtu,
    /// InfiniBand or Ethernet (RoCE).
    pub link_layer: LinkLayer,
    /// Length of the port's GID table.
    pub gid_tbl_len: u32,
}

/// Logical port state (`ibv_port_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortState {
    /// No state change.
    Nop,
    /// Link down.
    Down,
    /// Initialising.
    Init,
    /// Armed.
    Armed,
    /// Usable.
    Active,
    /// Active, deferring.
    ActiveDefer,
    /// A value this module does not know.
    Other(u32),
}

impl PortState {
    fn from_raw(raw: ffi::ibv_port_state::Type) -> Self {
        use ffi::ibv_port_state as s;
        match raw {
            s::IBV_PORT_NOP => Self::Nop,
            s::IBV_PORT_DOWN => Self::Down,
            s::IBV_PORT_INIT => Self::Init,
            s::IBV_PORT_ARMED => Self::Armed,
            s::IBV_PORT_ACTIVE => Self::Active,
            s::IBV_PORT_ACTIVE_DEFER => Self::ActiveDefer,
            other => Self::Other(other),
        }
    }
}

impl fmt::Display for PortState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Nop => f.write_str("NOP"),
            Self::Down => f.write_str("DOWN"),
            Self::Init => f.write_str("INIT"),
            Self::Armed => f.write_str("ARMED"),
            Self::Active => f.write_str("ACTIVE"),
            Self::ActiveDefer => f.write_str("ACTIVE_DEFER"),
            Self::Other(v) => write!(f, "state {v}"),
        }
    }
}

/// Path MTU (`ibv_mtu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256,
    /// 512 bytes.
    Mtu512,
    /// 1024 bytes.
    Mtu1024,
    /// 2048 bytes.
    Mtu2048,
    /// 4096 bytes.
    Mtu4096,
}

impl Mtu {
    fn from_raw(raw: ffi::ibv_mtu) -> Self {
        match raw {
            ffi::IBV_MTU_256 => Self::Mtu256,
            ffi::IBV_MTU_512 => Self::Mtu512,
            ffi::IBV_MTU_2048 => Self::Mtu2048,
            ffi::IBV_MTU_4096 => Self::Mtu4096,
            // 1024 is what every RoCE device supports; an unknown value falls back to it.
            _ => Self::Mtu1024,
        }
    }

    fn raw(self) -> ffi::ibv_mtu {
        match self {
            Self::Mtu256 => ffi::IBV_MTU_256,
            Self::Mtu512 => ffi::IBV_MTU_512,
            Self::Mtu1024 => ffi::IBV_MTU_1024,
            Self::Mtu2048 => ffi::IBV_MTU_2048,
            Self::Mtu4096 => ffi::IBV_MTU_4096,
        }
    }

    /// The MTU in bytes.
    pub fn bytes(self) -> u32 {
        match self {
            Self::Mtu256 => 256,
            Self::Mtu512 => 512,
            Self::Mtu1024 => 1024,
            Self::Mtu2048 => 2048,
            Self::Mtu4096 => 4096,
        }
    }
}

/// Link layer of a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkLayer {
    /// Not reported (old drivers; InfiniBand).
    Unspecified,
    /// InfiniBand: addressed by LID.
    InfiniBand,
    /// Ethernet (RoCE): addressed by GID.
    Ethernet,
}

impl LinkLayer {
    fn from_raw(raw: u8) -> Self {
        match u32::from(raw) {
            ffi::IBV_LINK_LAYER_INFINIBAND => Self::InfiniBand,
            ffi::IBV_LINK_LAYER_ETHERNET => Self::Ethernet,
            _ => Self::Unspecified,
        }
    }
}

/// A 128-bit GID in network byte order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// All zero: an empty table entry.
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// `fe80::/10`.
    pub fn is_link_local(&self) -> bool {
        self.0[0] == 0xfe && self.0[1] & 0xc0 == 0x80
    }

    /// `::ffff:a.b.c.d`, the form RoCE uses for an IPv4 address.
    pub fn is_ipv4_mapped(&self) -> bool {
        self.0[..10] == [0; 10] && self.0[10] == 0xff && self.0[11] == 0xff
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&Ipv6Addr::from(self.0), f)
    }
}

/// Type of a GID entry (`ibv_gid_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GidType {
    /// InfiniBand.
    Ib,
    /// RoCE v1 (Ethernet, not routable).
    RoceV1,
    /// RoCE v2 (UDP/IP, routable).
    RoceV2,
    /// A value this module does not know.
    Other(u32),
}

impl GidType {
    fn from_raw(raw: u32) -> Self {
        match raw {
            ffi::IBV_GID_TYPE_IB => Self::Ib,
            ffi::IBV_GID_TYPE_ROCE_V1 => Self::RoceV1,
            ffi::IBV_GID_TYPE_ROCE_V2 => Self::RoceV2,
            other => Self::Other(other),
        }
    }
}

impl fmt::Display for GidType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ib => f.write_str("IB"),
            Self::RoceV1 => f.write_str("RoCE v1"),
            Self::RoceV2 => f.write_str("RoCE v2"),
            Self::Other(v) => write!(f, "type {v}"),
        }
    }
}

/// One valid entry of a port's GID table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the table (the `sgid_index` of a queue pair).
    pub index: u32,
    /// The GID.
    pub gid: Gid,
    /// Its type.
    pub gid_type: GidType,
}

/// Picks a GID entry like perftest does. Pure, so it can be tested without a device.
///
/// * `explicit = Some(i)`: the entry with index `i`, or `None` if it is not in `entries`.
/// * InfiniBand link layer: the lowest index.
/// * Ethernet (RoCE): the entry scoring best on, in this order of weight, RoCE v2 (routable,
///   what RoCE peers expect), IPv4-mapped (`::ffff:a.b.c.d`, the address the netdev carries)
///   and not link-local; ties go to the lowest index. A wrong choice gives a QP that
///   connects but never completes, hence the care.
pub fn choose_gid(
    entries: &[GidEntry],
    link_layer: LinkLayer,
    explicit: Option<u32>,
) -> Option<GidEntry> {
    let valid = entries.iter().filter(|e| !e.gid.is_zero());
    if let Some(index) = explicit {
        return entries.iter().find(|e| e.index == index).copied();
    }
    if link_layer != LinkLayer::Ethernet {
        return valid.min_by_key(|e| e.index).copied();
    }
    let score = |e: &GidEntry| {
        u8::from(e.gid_type == GidType::RoceV2) * 4
            + u8::from(e.gid.is_ipv4_mapped()) * 2
            + u8::from(!e.gid.is_link_local())
    };
    valid
        .max_by(|a, b| score(a).cmp(&score(b)).then(b.index.cmp(&a.index)))
        .copied()
}

// ---------------------------------------------------------------------------------------
// Protection domain and memory regions
// ---------------------------------------------------------------------------------------

struct PdInner {
    pd: NonNull<ffi::ibv_pd>,
    ctx: Arc<ContextInner>,
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
    inner: Arc<PdInner>,
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
pub struct AccessFlags(u32);

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
struct PageBuf {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

impl PageBuf {
    fn zeroed(len: usize) -> Result<PageBuf> {
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
    mr: NonNull<ffi::ibv_mr>,
    /// Not dropped if deregistration fails: the NIC might still access it, so it is leaked.
    buf: ManuallyDrop<PageBuf>,
    len: usize,
    access: AccessFlags,
    lkey: u32,
    rkey: u32,
    pd: Arc<PdInner>,
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

// ---------------------------------------------------------------------------------------
// Completion queue
// ---------------------------------------------------------------------------------------

struct CqInner {
    cq: NonNull<ffi::ibv_cq>,
    ctx: Arc<ContextInner>,
}

// SAFETY: polling a CQ from several threads is allowed (providers lock it); the handle is
// only destroyed in `Drop`.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: QPs using this CQ hold an `Arc<CqInner>`, so they are destroyed already;
        // the context stays open until `self.ctx` is dropped after this body.
        unsafe { ffi::ibv_destroy_cq(self.cq.as_ptr()) };
    }
}

/// A completion queue, polled without blocking.
#[derive(Clone)]
pub struct CompletionQueue {
    inner: Arc<CqInner>,
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("device", &self.inner.ctx.name)
            .finish()
    }
}

/// Outcome of a work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcStatus {
    /// Completed successfully.
    Success,
    /// Failed; the QP is now in the error state and later requests complete as flushed.
    Error {
        /// `ibv_wc_status` value.
        code: u32,
        /// Provider-specific syndrome.
        vendor_err: u32,
        /// `ibv_wc_status_str(code)`, e.g. "remote access error".
        text: &'static str,
    },
}

/// Operation of a completion (valid for successful completions only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcOpcode {
    /// RDMA WRITE.
    RdmaWrite,
    /// RDMA READ.
    RdmaRead,
    /// SEND.
    Send,
    /// Receive.
    Recv,
    /// Not meaningful (failed completions) or not used by this module.
    Other(u32),
}

/// A polled work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The `wr_id` of the work request.
    pub wr_id: u64,
    /// Success or the error status.
    pub status: WcStatus,
    /// The operation; [`WcOpcode::Other`] for failed completions, whose opcode is undefined.
    pub opcode: WcOpcode,
    /// Bytes transferred (meaningful for READ completions).
    pub byte_len: u32,
}

impl Default for Completion {
    fn default() -> Self {
        Completion {
            wr_id: 0,
            status: WcStatus::Success,
            opcode: WcOpcode::Other(0),
            byte_len: 0,
        }
    }
}

impl Completion {
    /// Whether the work request succeeded.
    pub fn is_success(&self) -> bool {
        self.status == WcStatus::Success
    }
}

fn wc_status_text(code: u32) -> &'static str {
    // SAFETY: `ibv_wc_status_str` accepts any value and returns a pointer to a static,
    // NUL-terminated string of libibverbs (or "unknown"), valid for the whole program.
    let text = unsafe { CStr::from_ptr(ffi::ibv_wc_status_str(code)) };
    text.to_str().unwrap_or("(non-UTF-8 status text)")
}

/// How many `ibv_wc` are fetched per `poll_cq` call.
const POLL_BATCH: usize = 32;

impl CompletionQueue {
    /// Fetches up to `out.len()` completions without blocking; returns how many were
    /// written to the front of `out` (0 when none is ready).
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        let cq = self.inner.cq.as_ptr();
        // SAFETY: `cq` and its context are alive while `self.inner` lives; `poll_cq` is the
        // provider's function that the header's static inline `ibv_poll_cq` calls.
        let poll_cq = unsafe { (*(*cq).context).ops.poll_cq }.ok_or_else(|| VerbsError::Verbs {
            op: "ibv_poll_cq",
            device: self.inner.ctx.name.clone(),
            source: io::Error::from(io::ErrorKind::Unsupported),
        })?;
        let mut wcs = [ffi::ibv_wc::default(); POLL_BATCH];
        let mut filled = 0;
        while filled < out.len() {
            let want = (out.len() - filled).min(POLL_BATCH);
            // SAFETY: `wcs` has room for `want` entries; `ibv_wc` matches the C layout
            // (checked by ibverbs-sys' layout test).
            let n = unsafe { poll_cq(cq, want as c_int, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(VerbsError::PollCq {
                    device: self.inner.ctx.name.clone(),
                    ret: n,
                });
            }
            let n = n as usize;
            for (slot, wc) in out[filled..].iter_mut().zip(&wcs[..n]) {
                *slot = convert_wc(wc);
            }
            filled += n;
            if n < want {
                break;
            }
        }
        Ok(filled)
    }
}

fn convert_wc(wc: &ffi::ibv_wc) -> Completion {
    match wc.error() {
        None => Completion {
            wr_id: wc.wr_id(),
            status: WcStatus::Success,
            opcode: match wc.opcode() {
                ffi::ibv_wc_opcode::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
                ffi::ibv_wc_opcode::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
                ffi::ibv_wc_opcode::IBV_WC_SEND => WcOpcode::Send,
                ffi::ibv_wc_opcode::IBV_WC_RECV => WcOpcode::Recv,
                other => WcOpcode::Other(other),
            },
            byte_len: wc.len() as u32,
        },
        Some((code, vendor_err)) => Completion {
            wr_id: wc.wr_id(),
            status: WcStatus::Error {
                code,
                vendor_err,
                text: wc_status_text(code),
            },
            opcode: WcOpcode::Other(wc.opcode()),
            byte_len: 0,
        },
    }
}

// ---------------------------------------------------------------------------------------
// Queue pairs
// ---------------------------------------------------------------------------------------

/// Work queue capacities of a queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Outstanding send work requests.
    pub max_send_wr: u32,
    /// Outstanding receive work requests (RDMA WRITE/READ need none; keep it small).
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send request (this module uses 1).
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive request.
    pub max_recv_sge: u32,
    /// Bytes of inline data per send request.
    pub max_inline_data: u32,
}

/// How to create and connect an RC queue pair. Defaults follow perftest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpConfig {
    /// Port to use (from 1).
    pub port: u8,
    /// GID index to use instead of [`choose_gid`]'s pick.
    pub gid_index: Option<u32>,
    /// Queue capacities asked for; `max_inline_data` must be granted in full.
    pub caps: QpCaps,
    /// What peers may do through this QP: `REMOTE_WRITE | REMOTE_READ` on the side whose
    /// memory the peer writes and reads, `NONE` on a pure initiator (least privilege).
    pub access: AccessFlags,
    /// RNR NAK timer code (12 = 0.64 ms).
    pub min_rnr_timer: u8,
    /// Local ACK timeout code: 4.096 µs × 2^timeout (14 ≈ 67 ms).
    pub timeout: u8,
    /// Transport retries (7 = max).
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// Outstanding RDMA READs/atomics this QP may initiate (≥ 1).
    pub max_rd_atomic: u8,
    /// Outstanding RDMA READs/atomics this QP accepts as responder (≥ 1).
    pub max_dest_rd_atomic: u8,
    /// IP TTL / hop limit for RoCE v2 packets.
    pub hop_limit: u8,
}

impl Default for QpConfig {
    fn default() -> Self {
        QpConfig {
            port: 1,
            gid_index: None,
            caps: QpCaps {
                max_send_wr: 128,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 64,
            },
            access: AccessFlags::NONE,
            min_rnr_timer: 12,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
            max_dest_rd_atomic: 1,
            hop_limit: 64,
        }
    }
}

/// What the peer needs to connect to a queue pair: exchange it over a side channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpEndpoint {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number (24 bits).
    pub psn: u32,
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Source GID of the QP.
    pub gid: Gid,
}

impl QpEndpoint {
    /// Size of [`to_bytes`](Self::to_bytes).
    pub const WIRE_LEN: usize = 26;

    /// Fixed 26-byte big-endian encoding: qpn u32, psn u32, lid u16, gid [u8; 16].
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut b = [0; Self::WIRE_LEN];
        b[0..4].copy_from_slice(&self.qpn.to_be_bytes());
        b[4..8].copy_from_slice(&self.psn.to_be_bytes());
        b[8..10].copy_from_slice(&self.lid.to_be_bytes());
        b[10..26].copy_from_slice(&self.gid.0);
        b
    }

    /// Decodes [`to_bytes`](Self::to_bytes).
    pub fn from_bytes(b: &[u8]) -> Result<QpEndpoint> {
        let b: &[u8; Self::WIRE_LEN] = b.try_into().map_err(|_| {
            VerbsError::InvalidArgument(format!(
                "QP endpoint must be {} bytes, got {}",
                Self::WIRE_LEN,
                b.len()
            ))
        })?;
        let ep = QpEndpoint {
            qpn: u32::from_be_bytes([b[0], b[1], b[2], b[3]]),
            psn: u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
            lid: u16::from_be_bytes([b[8], b[9]]),
            gid: Gid(b[10..26].try_into().expect("16 bytes")),
        };
        if ep.qpn > 0xff_ffff || ep.psn > 0xff_ffff {
            return Err(VerbsError::InvalidArgument(format!(
                "QP endpoint qpn {:#x} / psn {:#x} exceed 24 bits",
                ep.qpn, ep.psn
            )));
        }
        Ok(ep)
    }
}

struct QpInner {
    qp: NonNull<ffi::ibv_qp>,
    pd: Arc<PdInner>,
    // Kept only so the CQs outlive the QP.
    _send_cq: Arc<CqInner>,
    _recv_cq: Arc<CqInner>,
    config: QpConfig,
    granted: QpCaps,
    port: PortAttr,
    gid: GidEntry,
    psn: u32,
}

// SAFETY: posting to and modifying a QP is thread safe in libibverbs (providers lock the
// send queue); the handle is destroyed only in `Drop`.
unsafe impl Send for QpInner {}
// SAFETY: as above.
unsafe impl Sync for QpInner {}

impl Drop for QpInner {
    fn drop(&mut self) {
        // SAFETY: created in `create_qp`, destroyed once, before its CQs and PD (whose
        // `Arc`s are fields dropped after this body).
        unsafe { ffi::ibv_destroy_qp(self.qp.as_ptr()) };
    }
}

impl QpInner {
    fn device(&self) -> &str {
        &self.pd.ctx.name
    }

    fn qp_num(&self) -> u32 {
        // SAFETY: the QP is alive; `qp_num` is set at creation and never changes.
        unsafe { (*self.qp.as_ptr()).qp_num }
    }

    fn endpoint(&self) -> QpEndpoint {
        QpEndpoint {
            qpn: self.qp_num(),
            psn: self.psn,
            lid: self.port.lid,
            gid: self.gid.gid,
        }
    }

    fn modify(
        &self,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
        op: &'static str,
    ) -> Result<()> {
        // SAFETY: the QP is alive; `attr` is a valid, initialised attribute struct and
        // `mask` names only fields set by the caller.
        let ret = unsafe { ffi::ibv_modify_qp(self.qp.as_ptr(), attr, mask.0 as c_int) };
        if ret != 0 {
            return Err(VerbsError::Verbs {
                op,
                device: self.device().to_owned(),
                source: ret_error(ret),
            });
        }
        Ok(())
    }
}

/// A reliable-connected queue pair that has been created but not connected.
///
/// Call order: [`ProtectionDomain::create_qp`] → [`handshake_info`](Self::handshake_info),
/// sent to the peer → [`connect`](Self::connect) with the peer's info → post on the
/// returned [`ConnectedQp`]. Work cannot be posted before the QP is connected.
pub struct PreparedQp {
    inner: QpInner,
}

/// A connected (RTS) reliable-connected queue pair.
pub struct ConnectedQp {
    inner: QpInner,
    remote: QpEndpoint,
}

impl fmt::Debug for PreparedQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreparedQp")
            .field("device", &self.inner.device())
            .field("local", &self.inner.endpoint())
            .field("caps", &self.inner.granted)
            .finish()
    }
}

impl fmt::Debug for ConnectedQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectedQp")
            .field("device", &self.inner.device())
            .field("local", &self.inner.endpoint())
            .field("remote", &self.remote)
            .field("caps", &self.inner.granted)
            .finish()
    }
}

fn random_psn(qpn: u32) -> u32 {
    let mut h = RandomState::new().build_hasher();
    h.write_u32(qpn);
    (h.finish() as u32) & 0xff_ffff
}

impl ProtectionDomain {
    /// Creates an RC queue pair on `config.port` and chooses its GID.
    ///
    /// Fails if the port is not active, if no GID fits, if the device rejects the
    /// capabilities, or if it grants less inline data than `config.caps.max_inline_data`.
    pub fn create_qp(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        config: &QpConfig,
    ) -> Result<PreparedQp> {
        let ctx = Context {
            inner: Arc::clone(&self.inner.ctx),
        };
        for cq in [send_cq, recv_cq] {
            if !Arc::ptr_eq(&cq.inner.ctx, &self.inner.ctx) {
                return Err(VerbsError::InvalidArgument(
                    "completion queue belongs to another device context".into(),
                ));
            }
        }
        if config.max_rd_atomic == 0 || config.max_dest_rd_atomic == 0 {
            return Err(VerbsError::InvalidArgument(
                "max_rd_atomic and max_dest_rd_atomic must be at least 1 (RDMA READ)".into(),
            ));
        }
        let port = ctx.query_port(config.port)?;
        if !matches!(port.state, PortState::Active | PortState::ActiveDefer) {
            return Err(VerbsError::PortNotActive {
                device: ctx.name().to_owned(),
                port: config.port,
                state: port.state,
            });
        }
        let gid = ctx.select_gid(config.port, config.gid_index)?;
        if gid.index > u32::from(u8::MAX) {
            return Err(VerbsError::InvalidArgument(format!(
                "GID index {} does not fit the 8-bit sgid_index of a QP",
                gid.index
            )));
        }

        let asked = config.caps;
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: send_cq.inner.cq.as_ptr(),
            recv_cq: recv_cq.inner.cq.as_ptr(),
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: asked.max_send_wr,
                max_recv_wr: asked.max_recv_wr,
                max_send_sge: asked.max_send_sge,
                max_recv_sge: asked.max_recv_sge,
                max_inline_data: asked.max_inline_data,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            // Only requests flagged signaled produce completions.
            sq_sig_all: 0,
        };
        // SAFETY: PD and CQs are alive (and kept alive by the `Arc`s stored below); `init`
        // is fully initialised. On success libibverbs writes the granted caps into it.
        let qp = unsafe { ffi::ibv_create_qp(self.inner.pd.as_ptr(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(|| VerbsError::CreateQp {
            device: ctx.name().to_owned(),
            asked,
            source: null_error(),
        })?;
        let granted = QpCaps {
            max_send_wr: init.cap.max_send_wr,
            max_recv_wr: init.cap.max_recv_wr,
            max_send_sge: init.cap.max_send_sge,
            max_recv_sge: init.cap.max_recv_sge,
            max_inline_data: init.cap.max_inline_data,
        };
        // SAFETY: `qp` was just created; `qp_num` is set by then.
        let qpn = unsafe { (*qp.as_ptr()).qp_num };
        let inner = QpInner {
            qp,
            pd: Arc::clone(&self.inner),
            _send_cq: Arc::clone(&send_cq.inner),
            _recv_cq: Arc::clone(&recv_cq.inner),
            config: *config,
            granted,
            port,
            gid,
            psn: random_psn(qpn),
        };
        // Checked after `inner` exists so that the QP is destroyed on this error path.
        if granted.max_inline_data < asked.max_inline_data {
            return Err(VerbsError::InlineTooSmall {
                device: ctx.name().to_owned(),
                requested: asked.max_inline_data,
                granted: granted.max_inline_data,
            });
        }
        Ok(PreparedQp { inner })
    }
}

impl PreparedQp {
    /// What the peer needs to connect to this QP.
    pub fn handshake_info(&self) -> QpEndpoint {
        self.inner.endpoint()
    }

    /// Capacities the device granted (may exceed what was asked).
    pub fn caps(&self) -> QpCaps {
        self.inner.granted
    }

    /// The GID entry this QP uses.
    pub fn gid(&self) -> GidEntry {
        self.inner.gid
    }

    /// Moves the QP through INIT → RTR → RTS towards `remote`.
    ///
    /// RTR uses the port's active MTU as path MTU and, on RoCE (or when the peer has no
    /// LID), a global route with the chosen `sgid_index`. On error the QP is destroyed.
    pub fn connect(self, remote: &QpEndpoint) -> Result<ConnectedQp> {
        let q = &self.inner;
        let c = &q.config;
        type M = ffi::ibv_qp_attr_mask;

        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: c.port,
            qp_access_flags: c.access.0,
            ..Default::default()
        };
        q.modify(
            &mut attr,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            "ibv_modify_qp(RESET->INIT)",
        )?;

        let global = q.port.link_layer == LinkLayer::Ethernet || remote.lid == 0;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: q.port.active_mtu.raw(),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: c.max_dest_rd_atomic,
            min_rnr_timer: c.min_rnr_timer,
            ah_attr: ffi::ibv_ah_attr {
                grh: ffi::ibv_global_route {
                    dgid: ffi::ibv_gid { raw: remote.gid.0 },
                    flow_label: 0,
                    sgid_index: q.gid.index as u8,
                    hop_limit: c.hop_limit,
                    traffic_class: 0,
                },
                dlid: remote.lid,
                sl: 0,
                src_path_bits: 0,
                static_rate: 0,
                is_global: u8::from(global),
                port_num: c.port,
            },
            ..Default::default()
        };
        q.modify(
            &mut attr,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
            "ibv_modify_qp(INIT->RTR)",
        )?;

        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            timeout: c.timeout,
            retry_cnt: c.retry_cnt,
            rnr_retry: c.rnr_retry,
            sq_psn: q.psn,
            max_rd_atomic: c.max_rd_atomic,
            ..Default::default()
        };
        q.modify(
            &mut attr,
            M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
            "ibv_modify_qp(RTR->RTS)",
        )?;
        Ok(ConnectedQp {
            inner: self.inner,
            remote: *remote,
        })
    }
}

/// Where the bytes of an RDMA WRITE come from.
#[derive(Clone, Copy, Debug)]
pub enum WriteSource<'a> {
    /// `len` bytes at `offset` of a registered region (same protection domain as the QP).
    Region {
        /// The source region.
        mr: &'a MemoryRegion,
        /// Offset of the first byte.
        offset: usize,
        /// Number of bytes.
        len: usize,
    },
    /// Bytes copied into the work request at post time (`IBV_SEND_INLINE`); at most the
    /// QP's granted `max_inline_data`. The buffer may be reused as soon as the post returns.
    Inline(&'a [u8]),
}

/// One RDMA WRITE of a chain.
#[derive(Clone, Copy, Debug)]
pub struct WriteWr<'a> {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Source bytes.
    pub source: WriteSource<'a>,
    /// Remote address of the first byte written.
    pub remote_addr: u64,
    /// Remote key of the target region.
    pub rkey: u32,
    /// Produce a completion (`IBV_SEND_SIGNALED`). Post a signaled request regularly:
    /// unsignaled ones leave the send queue only when a later signaled one completes.
    pub signaled: bool,
    /// Wait for earlier RDMA READs/atomics of this QP to complete first (`IBV_SEND_FENCE`).
    pub fence: bool,
}

impl<'a> WriteWr<'a> {
    /// An unsignaled, unfenced WRITE of `mr[offset..offset + len]` to `remote_addr`.
    pub fn region(
        wr_id: u64,
        mr: &'a MemoryRegion,
        offset: usize,
        len: usize,
        remote_addr: u64,
        rkey: u32,
    ) -> Self {
        WriteWr {
            wr_id,
            source: WriteSource::Region { mr, offset, len },
            remote_addr,
            rkey,
            signaled: false,
            fence: false,
        }
    }

    /// An unsignaled, unfenced inline WRITE of `data` to `remote_addr`.
    pub fn inline(wr_id: u64, data: &'a [u8], remote_addr: u64, rkey: u32) -> Self {
        WriteWr {
            wr_id,
            source: WriteSource::Inline(data),
            remote_addr,
            rkey,
            signaled: false,
            fence: false,
        }
    }

    /// Sets [`signaled`](Self::signaled).
    pub fn signaled(mut self, signaled: bool) -> Self {
        self.signaled = signaled;
        self
    }

    /// Sets [`fence`](Self::fence).
    pub fn fence(mut self, fence: bool) -> Self {
        self.fence = fence;
        self
    }
}

impl ConnectedQp {
    /// This QP's own endpoint.
    pub fn local(&self) -> QpEndpoint {
        self.inner.endpoint()
    }

    /// The peer's endpoint it is connected to.
    pub fn remote(&self) -> QpEndpoint {
        self.remote
    }

    /// Capacities the device granted.
    pub fn caps(&self) -> QpCaps {
        self.inner.granted
    }

    fn check_local(
        &self,
        wr_index: usize,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
    ) -> Result<ffi::ibv_sge> {
        let invalid = |reason: String| VerbsError::InvalidWorkRequest { wr_index, reason };
        if !Arc::ptr_eq(&mr.pd, &self.inner.pd) {
            return Err(invalid(
                "memory region belongs to another protection domain than the QP".into(),
            ));
        }
        offset
            .checked_add(len)
            .filter(|&end| end <= mr.len)
            .ok_or_else(|| {
                invalid(format!(
                    "bytes {offset}..+{len} outside memory region of {} bytes",
                    mr.len
                ))
            })?;
        let length = u32::try_from(len).map_err(|_| invalid(format!("length {len} > 4 GiB")))?;
        Ok(ffi::ibv_sge {
            addr: mr.addr() + offset as u64,
            length,
            lkey: mr.lkey,
        })
    }

    /// Posts `wrs` as one linked list of RDMA WRITEs with a single `ibv_post_send`.
    ///
    /// Everything is validated first (bounds, protection domain, inline size, queue depth),
    /// so an `InvalidWorkRequest` error means nothing was posted. A `PostSend` error names
    /// the first request the provider rejected; those before it were posted.
    ///
    /// # Safety
    ///
    /// For every [`WriteSource::Region`] request, the source bytes must stay alive and
    /// unmodified until the completion of that request — or of a later signaled request of
    /// the same chain or posted later on the same QP — has been polled from the send CQ:
    /// keep the `MemoryRegion` alive (hold an `Arc` clone) and do not write those bytes
    /// meanwhile. Inline sources are copied during the call and have no such requirement.
    pub unsafe fn post_write_chain(&self, wrs: &[WriteWr<'_>]) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        if wrs.len() > self.inner.granted.max_send_wr as usize {
            return Err(VerbsError::InvalidWorkRequest {
                wr_index: 0,
                reason: format!(
                    "chain of {} requests exceeds the send queue ({} entries)",
                    wrs.len(),
                    self.inner.granted.max_send_wr
                ),
            });
        }
        let mut list = Vec::with_capacity(wrs.len());
        let mut sges = Vec::with_capacity(wrs.len());
        for (i, wr) in wrs.iter().enumerate() {
            let mut flags = 0;
            let sge = match wr.source {
                WriteSource::Region { mr, offset, len } => self.check_local(i, mr, offset, len)?,
                WriteSource::Inline(data) => {
                    if data.len() > self.inner.granted.max_inline_data as usize {
                        return Err(VerbsError::InvalidWorkRequest {
                            wr_index: i,
                            reason: format!(
                                "{} inline bytes exceed the granted max_inline_data {}",
                                data.len(),
                                self.inner.granted.max_inline_data
                            ),
                        });
                    }
                    flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
                    ffi::ibv_sge {
                        addr: data.as_ptr() as u64,
                        length: data.len() as u32,
                        lkey: 0,
                    }
                }
            };
            if wr.signaled {
                flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            if wr.fence {
                flags |= ffi::ibv_send_flags::IBV_SEND_FENCE.0;
            }
            let mut w = ffi::ibv_send_wr {
                wr_id: wr.wr_id,
                opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                send_flags: flags,
                ..Default::default()
            };
            w.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                remote_addr: wr.remote_addr,
                rkey: wr.rkey,
            };
            list.push(w);
            sges.push(sge);
        }
        // SAFETY: `sges` describe in-bounds bytes of live regions of this PD or the caller's
        // inline bytes (copied during the post); the region bytes stay valid afterwards by
        // the caller's contract.
        unsafe { self.post_list(&mut list, &mut sges) }
    }

    /// Posts one RDMA READ of `len` bytes from `remote_addr` into `local.0[offset..]`.
    ///
    /// `local` must have `LOCAL_WRITE` access and belong to the QP's protection domain.
    ///
    /// # Safety
    ///
    /// The destination bytes must stay alive and must not be read or written (except
    /// through [`MemoryRegion::atomic_bytes`]) until the completion of this request — or
    /// of a later signaled request on the same QP — has been polled from the send CQ: keep
    /// the `MemoryRegion` alive (hold an `Arc` clone) meanwhile. Before that completion
    /// their content is undefined.
    pub unsafe fn post_read(
        &self,
        wr_id: u64,
        local: (&MemoryRegion, usize, usize),
        remote_addr: u64,
        rkey: u32,
        signaled: bool,
    ) -> Result<()> {
        let (mr, offset, len) = local;
        if !mr.access.contains(AccessFlags::LOCAL_WRITE) {
            return Err(VerbsError::InvalidWorkRequest {
                wr_index: 0,
                reason: format!(
                    "READ destination region has access {:?}, lacks LOCAL_WRITE",
                    mr.access
                ),
            });
        }
        let mut sges = vec![self.check_local(0, mr, offset, len)?];
        let mut w = ffi::ibv_send_wr {
            wr_id,
            opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_READ,
            send_flags: if signaled {
                ffi::ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            },
            ..Default::default()
        };
        w.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
        // SAFETY: the WR points into `sges`; the destination's validity is the caller's
        // contract.
        unsafe { self.post_list(&mut [w], &mut sges) }
    }

    /// Links `list[i]` to `sges[i]` and `list[i + 1]`, then posts it.
    ///
    /// # Safety
    ///
    /// Every sge must describe memory that stays valid as the work request requires.
    unsafe fn post_list(
        &self,
        list: &mut [ffi::ibv_send_wr],
        sges: &mut [ffi::ibv_sge],
    ) -> Result<()> {
        debug_assert_eq!(list.len(), sges.len());
        let n = list.len();
        for (w, sge) in list.iter_mut().zip(sges.iter_mut()) {
            // A zero-length transfer carries no data segment (a zero sge length means 2 GiB
            // on some devices).
            w.num_sge = c_int::from(sge.length != 0);
            w.sg_list = sge;
            w.next = ptr::null_mut();
        }
        // From here on `list` is only accessed through `base`, which the provider gets too.
        let base = list.as_mut_ptr();
        for i in 1..n {
            // SAFETY: `i - 1` and `i` are below `n`, so both pointers are inside `list`.
            unsafe { (*base.add(i - 1)).next = base.add(i) };
        }
        let qp = self.inner.qp.as_ptr();
        // SAFETY: the QP and its context are alive while `self` lives; `post_send` is the
        // provider's function the header's static inline `ibv_post_send` calls.
        let post_send =
            unsafe { (*(*qp).context).ops.post_send }.ok_or_else(|| VerbsError::Verbs {
                op: "ibv_post_send",
                device: self.inner.device().to_owned(),
                source: io::Error::from(io::ErrorKind::Unsupported),
            })?;
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: `list` is a well-formed NULL-terminated chain whose sges point at `sges`
        // (alive for this call) and at memory the caller keeps valid; inline data is copied
        // by the provider before it returns.
        let ret = unsafe { post_send(qp, base, &mut bad) };
        if ret != 0 {
            let wr_index = if bad.is_null() {
                0
            } else {
                (bad as usize - base as usize) / mem::size_of::<ffi::ibv_send_wr>()
            };
            return Err(VerbsError::PostSend {
                wr_index,
                chain_len: n,
                source: ret_error(ret),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u32, gid: &str, gid_type: GidType) -> GidEntry {
        GidEntry {
            index,
            gid: Gid(gid.parse::<Ipv6Addr>().unwrap().octets()),
            gid_type,
        }
    }

    /// The table rxe shows for a netdev with 192.0.2.1 and an IPv6 link-local address.
    fn rxe_table() -> Vec<GidEntry> {
        vec![
            entry(0, "fe80::5054:ff:fe12:3456", GidType::RoceV1),
            entry(1, "fe80::5054:ff:fe12:3456", GidType::RoceV2),
            entry(2, "::ffff:192.0.2.1", GidType::RoceV1),
            entry(3, "::ffff:192.0.2.1", GidType::RoceV2),
        ]
    }

    #[test]
    fn roce_prefers_v2_ipv4_mapped() {
        let got = choose_gid(&rxe_table(), LinkLayer::Ethernet, None).unwrap();
        assert_eq!(got.index, 3);
        assert_eq!(got.gid.to_string(), "::ffff:192.0.2.1");
    }

    #[test]
    fn roce_without_ipv4_takes_v2_link_local() {
        let table = &rxe_table()[..2];
        assert_eq!(
            choose_gid(table, LinkLayer::Ethernet, None).unwrap().index,
            1
        );
    }

    #[test]
    fn roce_v2_global_ipv6_beats_v1_ipv4() {
        let table = vec![
            entry(0, "::ffff:10.0.0.1", GidType::RoceV1),
            entry(5, "2001:db8::1", GidType::RoceV2),
        ];
        assert_eq!(
            choose_gid(&table, LinkLayer::Ethernet, None).unwrap().index,
            5
        );
    }

    #[test]
    fn ties_go_to_lowest_index() {
        let table = vec![
            entry(7, "::ffff:192.0.2.2", GidType::RoceV2),
            entry(4, "::ffff:192.0.2.1", GidType::RoceV2),
        ];
        assert_eq!(
            choose_gid(&table, LinkLayer::Ethernet, None).unwrap().index,
            4
        );
    }

    #[test]
    fn explicit_index_overrides_and_must_exist() {
        let table = rxe_table();
        assert_eq!(
            choose_gid(&table, LinkLayer::Ethernet, Some(0))
                .unwrap()
                .index,
            0
        );
        assert_eq!(choose_gid(&table, LinkLayer::Ethernet, Some(9)), None);
    }

    #[test]
    fn infiniband_takes_lowest_index() {
        let table = vec![
            entry(1, "fe80::2", GidType::Ib),
            entry(0, "fe80::1", GidType::Ib),
        ];
        assert_eq!(
            choose_gid(&table, LinkLayer::InfiniBand, None)
                .unwrap()
                .index,
            0
        );
        assert_eq!(choose_gid(&[], LinkLayer::Ethernet, None), None);
    }

    #[test]
    fn gid_classification() {
        let g = |s: &str| Gid(s.parse::<Ipv6Addr>().unwrap().octets());
        assert!(g("fe80::1").is_link_local());
        assert!(!g("fe80::1").is_ipv4_mapped());
        assert!(g("::ffff:192.0.2.1").is_ipv4_mapped());
        assert!(!g("::ffff:192.0.2.1").is_link_local());
        assert!(g("::").is_zero());
    }

    #[test]
    fn endpoint_round_trips() {
        let ep = QpEndpoint {
            qpn: 0x11,
            psn: 0xab_cdef,
            lid: 7,
            gid: Gid([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 0, 2, 1]),
        };
        let bytes = ep.to_bytes();
        assert_eq!(QpEndpoint::from_bytes(&bytes).unwrap(), ep);
        assert!(QpEndpoint::from_bytes(&bytes[..25]).is_err());
        let mut bad = bytes;
        bad[0] = 0x01; // qpn > 24 bits
        assert!(QpEndpoint::from_bytes(&bad).is_err());
    }

    #[test]
    fn access_flags_compose() {
        let rw = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        assert!(rw.contains(AccessFlags::REMOTE_WRITE));
        assert!(!rw.contains(AccessFlags::REMOTE_READ));
        assert!(rw.remotely_writable());
        assert!(!AccessFlags::REMOTE_READ.remotely_writable());
        assert_eq!(format!("{rw:?}"), "LOCAL_WRITE|REMOTE_WRITE");
        assert_eq!(format!("{:?}", AccessFlags::NONE), "NONE");
    }

    #[test]
    fn page_buf_is_aligned_zeroed_and_rounded() {
        let buf = PageBuf::zeroed(10).unwrap();
        assert_eq!(buf.ptr.as_ptr() as usize % REGION_ALIGN, 0);
        assert_eq!(buf.layout.size(), REGION_ALIGN);
        // SAFETY: the buffer holds `layout.size()` initialised bytes.
        let bytes = unsafe { std::slice::from_raw_parts(buf.ptr.as_ptr(), buf.layout.size()) };
        assert!(bytes.iter().all(|&b| b == 0));
        assert!(PageBuf::zeroed(0).is_err());
    }

    #[test]
    fn status_text_comes_from_libibverbs() {
        assert_eq!(
            wc_status_text(ffi::ibv_wc_status::IBV_WC_SUCCESS),
            "success"
        );
        assert_eq!(
            wc_status_text(ffi::ibv_wc_status::IBV_WC_REM_ACCESS_ERR),
            "remote access error"
        );
    }

    /// On a kernel without RDMA (this project's build host) the error must say so.
    #[test]
    fn device_list_error_is_clear() {
        match devices() {
            Ok(list) => assert!(!list.is_empty()),
            Err(e @ VerbsError::NoKernelSupport { .. }) => {
                assert!(e.to_string().contains("no RDMA support"), "{e}");
            }
            Err(VerbsError::NoDevice) => {}
            Err(e) => panic!("unexpected error: {e}"),
        }
        if let Err(e) = Context::open(Some("no_such_dev0")) {
            let msg = e.to_string();
            assert!(
                msg.contains("no_such_dev0") || msg.contains("no RDMA"),
                "{msg}"
            );
        }
    }
}
