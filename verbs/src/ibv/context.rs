//! A device context: opening it, ports, GIDs and the perftest-like GID choice.

use super::*;
use std::ffi::c_int;
use std::fmt;
use std::io;
use std::mem::{self};
use std::net::Ipv6Addr;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use ibverbs_sys as ffi;

pub(crate) struct ContextInner {
    pub(crate) ctx: NonNull<ffi::ibv_context>,
    pub(crate) name: String,
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
    pub(crate) inner: Arc<ContextInner>,
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

    pub(crate) fn raw(self) -> ffi::ibv_mtu {
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
