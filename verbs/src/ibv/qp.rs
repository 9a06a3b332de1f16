//! RC queue pairs: creating, connecting, and posting WRITE chains and READs.

use super::*;
use std::collections::hash_map::RandomState;
use std::ffi::c_int;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::mem::{self};
use std::ptr::{self, NonNull};
use std::sync::Arc;

use ibverbs_sys as ffi;

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

pub(crate) struct QpInner {
    pub(crate) qp: NonNull<ffi::ibv_qp>,
    pub(crate) pd: Arc<PdInner>,
    // Kept only so the CQs outlive the QP.
    pub(crate) _send_cq: Arc<CqInner>,
    pub(crate) _recv_cq: Arc<CqInner>,
    pub(crate) config: QpConfig,
    pub(crate) granted: QpCaps,
    pub(crate) port: PortAttr,
    pub(crate) gid: GidEntry,
    pub(crate) psn: u32,
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
    pub(crate) inner: QpInner,
}

/// A connected (RTS) reliable-connected queue pair.
pub struct ConnectedQp {
    pub(crate) inner: QpInner,
    pub(crate) remote: QpEndpoint,
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

pub(crate) fn random_psn(qpn: u32) -> u32 {
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
    /// RDMA WRITE WITH IMMEDIATE carrying this 32-bit value (host order here; sent in network
    /// order): the peer must have posted a receive request, which it gets back as a
    /// completion with the value ([`Completion::imm`]).
    pub imm: Option<u32>,
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
            imm: None,
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
            imm: None,
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

    /// Makes this a WRITE WITH IMMEDIATE carrying `imm` (see [`imm`](Self::imm)).
    pub fn with_imm(mut self, imm: u32) -> Self {
        self.imm = Some(imm);
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
                opcode: match wr.imm {
                    Some(_) => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
                    None => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                },
                send_flags: flags,
                ..Default::default()
            };
            if let Some(imm) = wr.imm {
                // The wire carries the immediate in network order (`__be32`).
                w.__bindgen_anon_1.imm_data = imm.to_be();
            }
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

    /// Posts one SEND of `data` as inline data (copied during the call, so nothing is to be
    /// kept alive): the peer receives it into a receive request it posted. `data` must fit the
    /// granted `max_inline_data`.
    pub fn post_send_inline(&self, wr_id: u64, data: &[u8], signaled: bool) -> Result<()> {
        if data.len() > self.inner.granted.max_inline_data as usize {
            return Err(VerbsError::InvalidWorkRequest {
                wr_index: 0,
                reason: format!(
                    "{} inline bytes exceed the granted max_inline_data {}",
                    data.len(),
                    self.inner.granted.max_inline_data
                ),
            });
        }
        let mut flags = ffi::ibv_send_flags::IBV_SEND_INLINE.0;
        if signaled {
            flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        let w = ffi::ibv_send_wr {
            wr_id,
            opcode: ffi::ibv_wr_opcode::IBV_WR_SEND,
            send_flags: flags,
            ..Default::default()
        };
        let mut sges = [ffi::ibv_sge {
            addr: data.as_ptr() as u64,
            length: data.len() as u32,
            lkey: 0,
        }];
        // SAFETY: the only sge is inline data, which the provider copies before `post_send`
        // returns; no memory has to outlive the call.
        unsafe { self.post_list(&mut [w], &mut sges) }
    }

    /// Posts one receive request: for a SEND, its bytes land in `buf` (`mr`, offset, length;
    /// `mr` needs `LOCAL_WRITE`); for a WRITE WITH IMMEDIATE, which carries its data to the
    /// address it names, `buf` may be `None`. The receive completes on the receive CQ.
    ///
    /// # Safety
    ///
    /// The bytes of `buf` must stay alive and must not be read or written (except through
    /// [`MemoryRegion::atomic_bytes`]) until this request's completion has been polled from
    /// the receive CQ, or the QP is destroyed: keep the `MemoryRegion` alive meanwhile.
    pub unsafe fn post_recv(
        &self,
        wr_id: u64,
        buf: Option<(&MemoryRegion, usize, usize)>,
    ) -> Result<()> {
        let mut sge = match buf {
            Some((mr, offset, len)) => {
                if !mr.access.contains(AccessFlags::LOCAL_WRITE) {
                    return Err(VerbsError::InvalidWorkRequest {
                        wr_index: 0,
                        reason: format!(
                            "receive buffer region has access {:?}, lacks LOCAL_WRITE",
                            mr.access
                        ),
                    });
                }
                Some(self.check_local(0, mr, offset, len)?)
            }
            None => None,
        };
        let mut w = ffi::ibv_recv_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: ptr::null_mut(),
            num_sge: 0,
        };
        if let Some(sge) = sge.as_mut() {
            w.sg_list = sge;
            w.num_sge = 1;
        }
        let qp = self.inner.qp.as_ptr();
        // SAFETY: the QP and its context are alive while `self` lives; `post_recv` is the
        // provider's function the header's static inline `ibv_post_recv` calls.
        let post_recv =
            unsafe { (*(*qp).context).ops.post_recv }.ok_or_else(|| VerbsError::Verbs {
                op: "ibv_post_recv",
                device: self.inner.device().to_owned(),
                source: io::Error::from(io::ErrorKind::Unsupported),
            })?;
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        // SAFETY: `w` is a single NULL-terminated request whose sge (if any) lives on this
        // stack frame for the call and describes in-bounds bytes of a live region of this PD,
        // which the caller keeps valid until the completion.
        let ret = unsafe { post_recv(qp, &mut w, &mut bad) };
        if ret != 0 {
            return Err(VerbsError::PostSend {
                wr_index: 0,
                chain_len: 1,
                source: ret_error(ret),
            });
        }
        Ok(())
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
