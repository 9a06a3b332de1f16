//! The RDMA verbs transport: the mechanism on real one-sided RDMA (InfiniBand, RoCE, Soft-RoCE).
//!
//! This crate (`rdmastream-verbs`) holds all of the project's `unsafe` code: [`ibv`] is a small
//! safe layer over `ibverbs-sys`, and this file uses its two `unsafe fn`s (posting work
//! requests) with the protocol's argument for why the memory they name is left alone until
//! completion. It implements the `rdmastream::transport` traits; the engine does not know it
//! exists, the binaries and the GStreamer elements pick it with [`choose`].
//!
//! Connection setup runs over a TCP side channel (like perftest): the sender sends a Hello with
//! its queue pair's number, PSN, LID and GID; the receiver validates it *before* allocating
//! anything, then gives the sender its own protection domain, a status array registered for
//! remote READ and WRITE, memory blocks registered for remote WRITE only, and an RC queue pair
//! that only ever acts as responder, and answers with a Welcome carrying addresses, rkeys and
//! its queue pair. The side channel stays open: its end tells the receiver the sender is gone.
//! The receiver never posts a work request ([`posted_work_requests`] counts them per process) —
//! except for the sliding-window baseline (`mechanism = "sliding-window"`), which by design
//! posts a receive per block and SENDs an ACK per block (counted by its `WorkCounter`s).
//!
//! The shm transport ([`shm`], for a sender and a receiver on one host) lives here too: it maps
//! memory another process writes, which takes `unsafe` ([`shared`]). Both transports' regions
//! copy a block's header and trailer out with volatile loads before the receiver checks them
//! (`volatile`), since a misbehaving sender can still be writing the block.

pub mod ibv;
pub mod shared;
pub mod shm;
mod side;
mod volatile;

use std::net::{Shutdown, TcpStream};
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::ibv::{
    AccessFlags, CompletionQueue, ConnectedQp, Context, Gid, MemoryRegion, ProtectionDomain,
    QpCaps, QpConfig, QpEndpoint,
};
use rdmastream::error::{Error, Result, spawn};
use rdmastream::proto::handshake::Mechanism;
use rdmastream::proto::handshake::{DataPath, Hello, Key, QpInfo, Welcome};
use rdmastream::proto::window::{ReceiverAction, WindowReceiver};
use rdmastream::proto::{RemoteLayout, status};
use rdmastream::transport::tcp::{
    Admitted, SideChannelListener, client_handshake, server_handshake,
};
use rdmastream::transport::{
    Accepted, Completion, Connection, Connector, HeldBytes, Kind, LeasedBlock, Notice, NoticeQueue,
    Refusal, RefusalKind, Region, RegionSettings, RegisteredBlocks, RemoteAddr, RetainedBlock,
    SendBlocks, Target, WorkCounter, WorkCounts, WriteSource, WriteWr,
};

/// Work requests this process posted (RDMA WRITEs and READs). A receiver reports it: it must
/// stay 0 there.
static POSTED: AtomicU64 = AtomicU64::new(0);

/// Work requests this process has posted so far.
pub fn posted_work_requests() -> u64 {
    POSTED.load(Ordering::Relaxed)
}

/// Which device, port and GID to use.
#[derive(Debug, Clone, Default)]
pub struct VerbsSettings {
    /// Device name (e.g. `mlx5_0`, `rxe0`); the first device when `None`.
    pub device: Option<String>,
    /// Port number, from 1.
    pub port: u8,
    /// GID table index; chosen like perftest when `None` (IPv4-mapped RoCE v2, not link-local).
    pub gid_index: Option<u32>,
}

fn rdma_err(op: impl Into<String>, cause: ibv::VerbsError) -> Error {
    Error::Rdma {
        op: op.into(),
        source: Box::new(cause),
    }
}

/// Resolves a `transport` setting (`auto`, `verbs`, `tcp`, `shm`) for the address `addr` (the
/// receiver to connect to, or the address to listen on). A `unix:/path` address is the shm
/// transport: `auto` picks it, and `shm` needs such an address (tcp and verbs cannot use one).
/// For other addresses `auto` uses verbs when the configured RDMA device is usable and otherwise
/// says in one log line why it falls back to tcp; `verbs` without a usable device is an error
/// naming what was looked for.
pub fn choose(transport: &str, addr: &str, verbs: &VerbsSettings) -> Result<Kind> {
    if addr.strip_prefix(shm::SCHEME) == Some("") {
        return Err(Error::Invalid {
            key: "address".into(),
            reason: format!("{addr:?} names no socket path (unix:/path/of/the/socket)"),
        });
    }
    let unix = shm::socket_path(addr).is_some();
    match (transport, unix) {
        ("shm" | "auto", true) => {
            if transport == "auto" {
                tracing::info!(
                    "transport auto: {addr} is a Unix socket address; using shared memory (shm)"
                );
            }
            Ok(Kind::Shm)
        }
        ("shm", false) => Err(Error::Invalid {
            key: "transport".into(),
            reason: format!(
                "shm needs a unix:/path address (sender and receiver on one host), not {addr:?}"
            ),
        }),
        ("tcp" | "verbs", true) => Err(Error::Invalid {
            key: "transport".into(),
            reason: format!(
                "{transport} cannot use the Unix socket address {addr:?}: use transport = \"shm\" \
                 (or \"auto\") for it, or a host:port address"
            ),
        }),
        ("tcp", false) => Ok(Kind::Tcp),
        ("verbs", false) => probe(verbs).map(|what| {
            tracing::info!("transport verbs: {what}");
            Kind::Verbs
        }),
        ("auto", false) => match probe(verbs) {
            Ok(what) => {
                tracing::info!("transport auto: using RDMA verbs on {what}");
                Ok(Kind::Verbs)
            }
            Err(e) => {
                // One short line: this is the normal case on machines without RDMA.
                let brief = match &e {
                    Error::Rdma { source, .. } => match source.downcast_ref::<ibv::VerbsError>() {
                        Some(ibv::VerbsError::NoKernelSupport { .. }) => {
                            "this kernel has no RDMA support".to_string()
                        }
                        Some(ibv::VerbsError::NoDevice) => "no RDMA device".to_string(),
                        _ => e.to_string(),
                    },
                    _ => e.to_string(),
                };
                tracing::info!("transport auto: {brief}; using the tcp software transport");
                tracing::debug!("transport auto: {e}");
                Ok(Kind::Tcp)
            }
        },
        (other, _) => Err(Error::Invalid {
            key: "transport".into(),
            reason: format!("{other:?} is not one of auto, verbs, tcp, shm"),
        }),
    }
}

/// A connector to the receiver `peer` (`host:port`, or `unix:/path` for shm) over the transport
/// the `transport` setting (`auto`, `verbs`, `tcp`, `shm`) resolves to ([`choose`]);
/// `peer_timeout` is how long a silent receiver is given; `shm_cache_budget` is, over shm, the
/// bytes of the receiver's region kept FULL at most (`None`: no limit; see
/// [`shm::ShmConnector::with_cache_budget`]), and means nothing over tcp and verbs. The one
/// place where the setting becomes a transport, for the `sender` binary and `rdmasink` alike.
pub fn connector(
    transport: &str,
    peer: &str,
    verbs: &VerbsSettings,
    max_outstanding: usize,
    peer_timeout: Duration,
    shm_cache_budget: Option<usize>,
) -> Result<(Kind, Box<dyn Connector>)> {
    let kind = choose(transport, peer, verbs)?;
    let c: Box<dyn Connector> = match kind {
        Kind::Tcp => Box::new(
            rdmastream::transport::tcp::TcpConnector::new(peer).with_peer_timeout(peer_timeout),
        ),
        Kind::Verbs => Box::new(
            VerbsConnector::new(peer, verbs.clone(), max_outstanding)?
                .with_peer_timeout(peer_timeout),
        ),
        Kind::Shm => Box::new(
            shm::ShmConnector::new(peer)?
                .with_peer_timeout(peer_timeout)
                .with_cache_budget(shm_cache_budget),
        ),
    };
    Ok((kind, c))
}

/// A listener on `addr` (`address:port`, or `unix:/path` for shm) over the transport the
/// `transport` setting resolves to ([`choose`]), offering `region` to each sender: the
/// `receiver` binary's and `rdmasrc`'s.
pub fn listener(
    transport: &str,
    addr: &str,
    region: RegionSettings,
    verbs: &VerbsSettings,
) -> Result<(Kind, SideChannelListener)> {
    let kind = choose(transport, addr, verbs)?;
    let l = match kind {
        Kind::Tcp => rdmastream::transport::tcp::listen(addr, region)?,
        Kind::Verbs => listen(addr, region, verbs.clone())?,
        Kind::Shm => shm::listen(
            shm::socket_path(addr).expect("choose picked shm for a unix: address"),
            region,
        )?,
    };
    Ok((kind, l))
}

/// Opens the configured device and checks its port is active. `Ok` names what will be used;
/// `Err` says what was looked for and why it cannot be used.
pub fn probe(settings: &VerbsSettings) -> Result<String> {
    let ctx = open(settings)?;
    let gid = ctx
        .select_gid(settings.port, settings.gid_index)
        .map_err(|e| rdma_err("choosing a GID", e))?;
    Ok(format!(
        "{} port {} GID index {} ({})",
        ctx.name(),
        settings.port,
        gid.index,
        gid.gid
    ))
}

fn open(settings: &VerbsSettings) -> Result<Context> {
    let what = || match &settings.device {
        Some(d) => format!("opening RDMA device '{d}'"),
        None => "looking for an RDMA device".to_string(),
    };
    let ctx = Context::open(settings.device.as_deref()).map_err(|e| rdma_err(what(), e))?;
    let port = ctx.query_port(settings.port).map_err(|e| {
        rdma_err(
            format!("querying port {} of {}", settings.port, ctx.name()),
            e,
        )
    })?;
    if port.state != ibv::PortState::Active {
        return Err(Error::Unavailable {
            transport: "verbs",
            reason: format!(
                "port {} of RDMA device {} is {} (not active)",
                settings.port,
                ctx.name(),
                port.state
            ),
        });
    }
    Ok(ctx)
}

fn qp_info(e: &QpEndpoint) -> QpInfo {
    QpInfo {
        qpn: e.qpn,
        psn: e.psn,
        lid: e.lid,
        gid: e.gid.0,
    }
}

fn endpoint(q: &QpInfo) -> QpEndpoint {
    QpEndpoint {
        qpn: q.qpn,
        psn: q.psn,
        lid: q.lid,
        gid: Gid(q.gid),
    }
}

// ---------------------------------------------------------------------------------------------
// Sender side
// ---------------------------------------------------------------------------------------------

/// Send blocks in one memory region registered with no remote access at all.
struct VerbsSendBlocks {
    mr: Arc<MemoryRegion>,
    block_size: usize,
    /// One lock per block, shared with the leases of [`RegisteredBlocks::lease_block`].
    locks: Box<[Arc<Mutex<()>>]>,
}

impl VerbsSendBlocks {
    fn range(&self, i: usize, len: usize) -> Range<usize> {
        i * self.block_size..i * self.block_size + len
    }
}

impl RegisteredBlocks for VerbsSendBlocks {
    fn fill_block(&self, i: usize, f: &mut dyn FnMut(&mut [u8])) {
        let _guard = self.locks[i].lock();
        // SAFETY: the lock gives this thread the only CPU reference to block i, and the NIC
        // reads it only between the post of a chain naming it and that chain's completion —
        // during which the sending thread owns the block (local status 1) and the filling thread,
        // the only caller of `fill`, cannot have its index. Nothing remote can write: the region
        // is registered without remote access.
        f(unsafe { self.mr.range_mut(self.range(i, self.block_size)) })
    }

    fn read_block(&self, i: usize, len: usize, f: &mut dyn FnMut(&[u8])) {
        let _guard = self.locks[i].lock();
        // SAFETY: as in `fill_block`: the lock excludes the filling thread, the NIC only reads.
        f(unsafe { self.mr.range(self.range(i, len)) })
    }

    fn lease_block(&self, i: usize) -> Box<dyn LeasedBlock> {
        Box::new(VerbsLease {
            _guard: self.locks[i].lock_arc(),
            mr: self.mr.clone(),
            range: self.range(i, self.block_size),
        })
    }
}

/// Send block `range` of `mr`, taken by a source (an engine reservation) while it writes a
/// frame in place; the lock is the block's own, so `fill_block` and `read_block` wait for it.
struct VerbsLease {
    _guard: parking_lot::ArcMutexGuard<parking_lot::RawMutex, ()>,
    mr: Arc<MemoryRegion>,
    range: Range<usize>,
}

impl LeasedBlock for VerbsLease {
    fn bytes(&self) -> &[u8] {
        // SAFETY: the guard holds block `range`'s lock for the lease's whole life, so no
        // `fill_block`/`read_block` runs over it; its index was taken from the free list, so the
        // sending thread has not posted it and the NIC does not read it (it is handed to the
        // filling thread only after the lease is dropped). `mr` keeps the memory alive.
        unsafe { self.mr.range(self.range.clone()) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; `&mut self` makes this the only reference from the lease, and
        // the lock excludes every other CPU reference to the block.
        unsafe { self.mr.range_mut(self.range.clone()) }
    }
}

/// Connects a sender to a receiver over RDMA verbs, through a TCP side channel at `addr`.
pub struct VerbsConnector {
    addr: String,
    settings: VerbsSettings,
    ctx: Context,
    pd: ProtectionDomain,
    max_outstanding: usize,
    peer_timeout: Duration,
    /// The memory region of the send blocks this connector registered: connections name it
    /// as the source of their WRITEs (kept here, not recovered from the blocks by a downcast).
    send_mr: Mutex<Option<Arc<MemoryRegion>>>,
}

impl VerbsConnector {
    /// Opens the device once; `max_outstanding` write chains size the send queue.
    pub fn new(
        addr: impl Into<String>,
        settings: VerbsSettings,
        max_outstanding: usize,
    ) -> Result<VerbsConnector> {
        let ctx = open(&settings)?;
        let pd = ctx
            .alloc_pd()
            .map_err(|e| rdma_err("allocating a protection domain", e))?;
        Ok(VerbsConnector {
            addr: addr.into(),
            settings,
            ctx,
            pd,
            max_outstanding: max_outstanding.max(1),
            peer_timeout: rdmastream::transport::DEFAULT_PEER_TIMEOUT,
            send_mr: Mutex::new(None),
        })
    }

    /// Gives a connection up when the receiver's side channel has been silent for `timeout`
    /// (both ends send a heartbeat byte on it at a fifth of that).
    pub fn with_peer_timeout(mut self, timeout: Duration) -> VerbsConnector {
        self.peer_timeout = timeout;
        self
    }
}

impl Connector for VerbsConnector {
    fn transport(&self) -> &'static str {
        "verbs"
    }

    /// The NIC may place a WRITE's bytes in any order; only completion promises them all.
    fn placement(&self) -> rdmastream::proto::Placement {
        rdmastream::proto::Placement::Unordered
    }

    fn connect_window(
        &self,
        hello: &Hello,
        key: Option<&Key>,
        blocks: &Arc<SendBlocks>,
    ) -> Result<Box<dyn rdmastream::transport::WindowConnection>> {
        // The ring is at most MAX_RING blocks: room for a whole ring of ACK receives.
        let ring = rdmastream::proto::window::MAX_RING;
        let acks = self
            .ctx
            .create_cq(ring as u32 + 1)
            .map_err(|e| rdma_err("creating the ACK completion queue", e))?;
        let (inner, acks) = self.open(hello, key, blocks, Some(acks))?;
        let acks = acks.expect("asked for an ACK queue");
        rdmastream::proto::window::check_ring(inner.layout).map_err(|why| Error::Handshake {
            peer: inner.peer.clone(),
            reason: why,
        })?;
        let n = inner.layout.blocks;
        let ack_mr = Arc::new(
            self.pd
                .register(n * ACK_LEN, AccessFlags::LOCAL_WRITE)
                .map_err(|e| rdma_err("registering the ACK buffers", e))?,
        );
        // Send and ACK completion queues.
        let counts = Arc::new(WorkCounter::new(2));
        let mut queue = VerbsAckQueue {
            qp: inner.qp.clone(),
            cq: acks,
            mr: ack_mr.clone(),
            free: (0..n).collect(),
            counts: counts.clone(),
            peer: inner.peer.clone(),
            polled: vec![ibv::Completion::default(); 1],
        };
        // RmInit: a receive per ring block before the first write, so an ACK never finds none.
        rdmastream::transport::AckQueue::post_recv(&mut queue, n)?;
        Ok(Box::new(VerbsWindowConnection {
            inner,
            ack_queue: Some(Box::new(queue)),
            counts,
            _ack_mr: ack_mr,
        }))
    }

    fn peer(&self) -> String {
        self.addr.clone()
    }

    fn alloc_send_blocks(&self, count: usize, block_size: usize) -> Result<Arc<SendBlocks>> {
        // The sender's memory needs no remote access: the NIC only reads it as WRITE source.
        let mr = self
            .pd
            .register(count * block_size, AccessFlags::NONE)
            .map_err(|e| {
                rdma_err(
                    format!("registering {count} send blocks of {block_size} bytes"),
                    e,
                )
            })?;
        let locks = (0..count).map(|_| Arc::new(Mutex::new(()))).collect();
        let mr = Arc::new(mr);
        *self.send_mr.lock() = Some(mr.clone());
        Ok(SendBlocks::registered(
            count,
            block_size,
            Box::new(VerbsSendBlocks {
                mr,
                block_size,
                locks,
            }),
        ))
    }

    fn connect(
        &self,
        hello: &Hello,
        key: Option<&Key>,
        blocks: &Arc<SendBlocks>,
    ) -> Result<Box<dyn Connection>> {
        let hello = Hello {
            mechanism: Mechanism::StatusByte,
            ..hello.clone()
        };
        Ok(Box::new(self.open(&hello, key, blocks, None)?.0))
    }
}

/// Bytes of one ACK receive buffer.
const ACK_LEN: usize = rdmastream::proto::window::ACK_LEN;

impl VerbsConnector {
    /// Creates the queue pair (receives going to `acks` when given: the sliding window's ACK
    /// completion queue, else to the send queue's), handshakes and connects it: the part a
    /// status-byte and a sliding-window connection share.
    fn open(
        &self,
        hello: &Hello,
        key: Option<&Key>,
        blocks: &Arc<SendBlocks>,
        acks: Option<CompletionQueue>,
    ) -> Result<(VerbsConnection, Option<CompletionQueue>)> {
        let window = acks.is_some();
        let peer = self.addr.clone();
        let send_mr = self
            .send_mr
            .lock()
            .clone()
            .filter(|_| blocks.registration().is_some())
            .ok_or_else(|| {
                Error::invalid("send blocks", "not registered by this verbs connector")
            })?;
        let depth = self.max_outstanding;
        let cq = self
            .ctx
            .create_cq(depth as u32 + 2)
            .map_err(|e| rdma_err("creating a completion queue", e))?;
        let config = QpConfig {
            port: self.settings.port,
            gid_index: self.settings.gid_index,
            caps: QpCaps {
                // Two WRITEs per chain, plus the status READ.
                max_send_wr: 2 * depth as u32 + 2,
                // The sliding window's ACK receives: a ring's worth at most.
                max_recv_wr: if window {
                    rdmastream::proto::window::MAX_RING as u32
                } else {
                    1
                },
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 16,
            },
            access: AccessFlags::NONE,
            ..QpConfig::default()
        };
        let qp = self
            .pd
            .create_qp(&cq, acks.as_ref().unwrap_or(&cq), &config)
            .map_err(|e| rdma_err("creating the queue pair", e))?;
        let hello = Hello {
            data_path: DataPath::Verbs,
            qp: qp_info(&qp.handshake_info()),
            ..hello.clone()
        };
        let (side, welcome) = client_handshake(&peer, &hello, key)?;
        let qp = qp
            .connect(&endpoint(&welcome.qp))
            .map_err(|e| rdma_err(format!("connecting the queue pair to {peer}"), e))?;
        // Keep the side channel open: its end tells either side that the other is gone (a dead
        // receiver's queue pair just stops answering on rxe; the side channel says so at once).
        // Non-blocking, so the liveness check in poll_completions only peeks.
        side.set_nonblocking(true).map_err(|e| Error::Handshake {
            peer: peer.clone(),
            reason: e.to_string(),
        })?;
        let layout = RemoteLayout {
            blocks: welcome.blocks as usize,
            block_size: welcome.block_size as usize,
        };
        let cache = self
            .pd
            .register(layout.blocks.max(1), AccessFlags::LOCAL_WRITE)
            .map_err(|e| rdma_err("registering the status cache", e))?;
        let conn = VerbsConnection {
            peer,
            layout,
            welcome,
            qp: Arc::new(qp),
            cq,
            send_mr,
            send_block_size: blocks.block_size(),
            cache,
            side,
            side_state: side::SenderSide::new("side channel"),
            peer_timeout: self.peer_timeout,
            polled: vec![ibv::Completion::default(); 16],
            read_len: 0,
        };
        Ok((conn, acks))
    }
}

/// The sender's end of a sliding-window queue pair: the status-byte connection's queue pair,
/// send completion queue and side channel, posting WRITE WITH IMMEDIATE.
pub struct VerbsWindowConnection {
    // Dropped first: the queue pair (when the ACK queue has let go of it too) is destroyed
    // before the ACK buffers its receives name are deregistered.
    inner: VerbsConnection,
    ack_queue: Option<Box<dyn rdmastream::transport::AckQueue>>,
    counts: Arc<WorkCounter>,
    _ack_mr: Arc<MemoryRegion>,
}

impl rdmastream::transport::WindowConnection for VerbsWindowConnection {
    fn peer(&self) -> &str {
        &self.inner.peer
    }
    fn layout(&self) -> RemoteLayout {
        self.inner.layout
    }
    fn post_write_imm(
        &mut self,
        wr_id: u64,
        send_block: usize,
        imm: rdmastream::proto::window::Immediate,
    ) -> Result<()> {
        let c = &self.inner;
        let wr = ibv::WriteWr::region(
            wr_id,
            &c.send_mr,
            send_block * c.send_block_size,
            imm.len,
            c.welcome.blocks_addr + (imm.position * c.layout.block_size) as u64,
            c.welcome.blocks_rkey,
        )
        .signaled(true)
        .with_imm(imm.encode());
        // SAFETY: as for the status-byte write chain: the send block stays registered (held by
        // this connection and the SendBlocks), and the sending thread gives it back to the
        // filling thread only after this request's completion has been polled (WindowSender
        // frees a block when it handles that completion, or later for lossless messages).
        unsafe { c.qp.post_write_chain(&[wr]) }
            .map_err(|e| c.lost(format!("posting a WRITE WITH IMMEDIATE: {e}")))?;
        self.counts.post_send(1);
        Ok(())
    }
    fn poll_completions(&mut self, out: &mut Vec<u64>, timeout: Duration) -> Result<()> {
        let mut done = Vec::new();
        Connection::poll_completions(&mut self.inner, &mut done, timeout)?;
        for c in &done {
            self.counts.completion();
            self.counts.complete_send(1);
            out.push(c.wr_id());
        }
        Ok(())
    }
    fn take_ack_queue(&mut self) -> Option<Box<dyn rdmastream::transport::AckQueue>> {
        self.ack_queue.take()
    }
    fn heartbeat(&mut self) -> Result<()> {
        self.inner.check_side_channel()
    }
    fn work_counts(&self) -> WorkCounts {
        self.counts.snapshot()
    }
}

/// The sender's ACK completion queue over verbs: one 4-byte receive buffer per ring block.
struct VerbsAckQueue {
    // Dropped before `mr`: the queue pair goes (when the connection has let go of it too)
    // before the buffers its receives name.
    qp: Arc<ConnectedQp>,
    cq: CompletionQueue,
    mr: Arc<MemoryRegion>,
    /// Buffers (by index) with no receive posted.
    free: std::collections::VecDeque<usize>,
    counts: Arc<WorkCounter>,
    peer: String,
    polled: Vec<ibv::Completion>,
}

impl rdmastream::transport::AckQueue for VerbsAckQueue {
    fn post_recv(&mut self, n: usize) -> Result<()> {
        for _ in 0..n {
            let Some(k) = self.free.pop_front() else {
                return Err(Error::Disconnected {
                    peer: self.peer.clone(),
                    reason: "more ACK receives posted than the ring has blocks".into(),
                });
            };
            // SAFETY: buffer `k` is not read until this receive's completion is polled in
            // `recv` (which then moves it back to `free` before it is posted again); `mr` is
            // held here and by the connection, and outlives the queue pair (field order).
            unsafe {
                self.qp
                    .post_recv(k as u64, Some((&self.mr, k * ACK_LEN, ACK_LEN)))
            }
            .map_err(|e| rdma_err("posting an ACK receive", e))?;
            self.counts.post_recv(1);
        }
        Ok(())
    }
    fn recv(&mut self, timeout: Duration) -> Result<Option<rdmastream::proto::window::Immediate>> {
        let start = Instant::now();
        loop {
            let n = self
                .cq
                .poll(&mut self.polled)
                .map_err(|e| rdma_err("polling the ACK completion queue", e))?;
            if n == 1 {
                let c = self.polled[0];
                if let ibv::WcStatus::Error { text, .. } = c.status {
                    return Err(Error::Disconnected {
                        peer: self.peer.clone(),
                        reason: format!("ACK receive failed: {text}"),
                    });
                }
                let k = c.wr_id as usize;
                // The completion was polled: the NIC placed the ACK before it.
                let bytes: Vec<u8> = self.mr.atomic_bytes()[k * ACK_LEN..(k + 1) * ACK_LEN]
                    .iter()
                    .map(|b| b.load(Ordering::Acquire))
                    .collect();
                self.free.push_back(k);
                self.counts.consume_recv();
                self.counts.completion();
                let ack = rdmastream::proto::window::Immediate::from_ack(
                    &bytes[..c.byte_len.min(ACK_LEN as u32) as usize],
                )
                .map_err(|e| Error::Disconnected {
                    peer: self.peer.clone(),
                    reason: format!("protocol error: {e}"),
                })?;
                return Ok(Some(ack));
            }
            if start.elapsed() >= timeout {
                return Ok(None);
            }
            if start.elapsed() > Duration::from_micros(200) {
                std::thread::sleep(Duration::from_micros(100));
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// The sender's end of one RC queue pair.
pub struct VerbsConnection {
    peer: String,
    layout: RemoteLayout,
    welcome: Welcome,
    qp: Arc<ConnectedQp>,
    cq: CompletionQueue,
    send_mr: Arc<MemoryRegion>,
    send_block_size: usize,
    /// The status cache: destination of the sync READ.
    cache: MemoryRegion,
    /// Length of the last READ posted into `cache`.
    read_len: usize,
    side: TcpStream,
    /// Heartbeats and notices on the side channel.
    side_state: side::SenderSide,
    peer_timeout: Duration,
    polled: Vec<ibv::Completion>,
}

impl VerbsConnection {
    /// The bytes the last READ brought into the status cache (read once its completion was
    /// polled: the completion orders the NIC's placement before these loads).
    fn read_cache(&self) -> Vec<u8> {
        self.cache.atomic_bytes()[..self.read_len]
            .iter()
            .map(|b| b.load(Ordering::Acquire))
            .collect()
    }

    fn remote(&self, r: RemoteAddr) -> (u64, u32) {
        match r.target {
            Target::Blocks => (
                self.welcome.blocks_addr + r.offset,
                self.welcome.blocks_rkey,
            ),
            Target::Statuses => (
                self.welcome.status_addr + r.offset,
                self.welcome.status_rkey,
            ),
        }
    }

    fn lost(&self, reason: impl std::fmt::Display) -> Error {
        Error::Disconnected {
            peer: self.peer.clone(),
            reason: reason.to_string(),
        }
    }

    /// Checks (at most every 50 ms) that the receiver still holds the side channel open and
    /// has sent a heartbeat within the peer timeout; sends this side's heartbeat when due.
    fn check_side_channel(&mut self) -> Result<()> {
        self.side_state
            .check(&mut self.side, self.peer_timeout)
            .map_err(|why| self.lost(why))
    }
}

impl Connection for VerbsConnection {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn layout(&self) -> RemoteLayout {
        self.layout
    }

    fn post_write_chain(&mut self, wr_id: u64, chain: &[WriteWr<'_>]) -> Result<()> {
        let mut wrs = Vec::with_capacity(chain.len());
        for wr in chain {
            let (addr, rkey) = self.remote(wr.remote);
            let id = if wr.signaled { wr_id } else { 0 };
            let w = match wr.source {
                WriteSource::SendBlock { index, len } => ibv::WriteWr::region(
                    id,
                    &self.send_mr,
                    index * self.send_block_size,
                    len,
                    addr,
                    rkey,
                ),
                WriteSource::Inline(bytes) => ibv::WriteWr::inline(id, bytes, addr, rkey),
            };
            wrs.push(w.signaled(wr.signaled));
        }
        // SAFETY: the send-block memory stays alive (`send_mr` is held by this connection and by
        // the sender's SendBlocks). The sending thread gives a send block back to the filling
        // thread only after the signaled completion of the chain that names it has been polled
        // (SenderMachine frees blocks when it handles that write chain's completion), so its bytes are not modified
        // before then. Inline data is copied by the call.
        unsafe { self.qp.post_write_chain(&wrs) }
            .map_err(|e| self.lost(format!("posting a write chain: {e}")))?;
        POSTED.fetch_add(wrs.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn post_read(&mut self, wr_id: u64, remote: RemoteAddr, len: usize) -> Result<()> {
        let (addr, rkey) = self.remote(remote);
        // SAFETY: `cache` is owned by this connection, so it outlives the READ; it is only read
        // through its atomic view, and only after this READ's completion was polled
        // (poll_completions copies them out of the cache into the Read completion).
        unsafe {
            self.qp
                .post_read(wr_id, (&self.cache, 0, len), addr, rkey, true)
        }
        .map_err(|e| self.lost(format!("posting the status READ: {e}")))?;
        self.read_len = len;
        POSTED.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn poll_completions(&mut self, out: &mut Vec<Completion>, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(5);
        loop {
            let n = self
                .cq
                .poll(&mut self.polled)
                .map_err(|e| self.lost(format!("polling completions: {e}")))?;
            for c in &self.polled[..n] {
                if let ibv::WcStatus::Error { text, .. } = c.status {
                    return Err(self.lost(format!("work request {} failed: {text}", c.wr_id)));
                }
                out.push(match c.opcode {
                    ibv::WcOpcode::RdmaRead => Completion::Read {
                        wr_id: c.wr_id,
                        data: self.read_cache(),
                    },
                    _ => Completion::Write { wr_id: c.wr_id },
                });
            }
            if n > 0 {
                return Ok(());
            }
            if start.elapsed() >= timeout {
                return self.check_side_channel();
            }
            // Spin first (completions come within microseconds on a NIC, tens of them on rxe;
            // a sleep costs a scheduler round trip), then back off.
            if start.elapsed() > Duration::from_micros(200) {
                std::thread::sleep(pause.min(timeout.saturating_sub(start.elapsed())));
                pause = (pause * 2).min(Duration::from_micros(200));
            } else {
                std::hint::spin_loop();
            }
        }
    }

    fn heartbeat(&mut self) -> Result<()> {
        self.check_side_channel()
    }
    /// Never: the NIC writes only from registered send blocks.
    fn lend_block(
        &self,
        _remote_block: usize,
    ) -> Option<Box<dyn rdmastream::transport::LeasedBlock>> {
        None
    }
    /// None: the region is the receiver host's memory, and a sync is a round trip.
    fn cache_budget(&self) -> Option<usize> {
        None
    }
    /// None until measured on a real NIC (see the trait).
    fn send_limits(&self, _block_size: usize) -> rdmastream::transport::SendLimits {
        rdmastream::transport::SendLimits::default()
    }
    /// Off until measured on a real NIC (see the trait).
    fn syncs_early(&self) -> bool {
        false
    }
    /// The paper's round-robin, until measured on a real NIC (see the trait).
    fn writes_lowest_first(&self) -> bool {
        false
    }
    fn completes_at_once(&self) -> bool {
        false
    }
    fn posts_here_when_idle(&self) -> bool {
        false
    }
    fn take_notices(&mut self) -> Vec<Notice> {
        self.side_state.take_notices()
    }
}

// ---------------------------------------------------------------------------------------------
// Receiver side
// ---------------------------------------------------------------------------------------------

/// One sender's region on the receiver: its own protection domain, memory regions and queue
/// pair (kept alive as long as the region, and so as long as any retained block).
pub struct VerbsRegion {
    layout: RemoteLayout,
    statuses: MemoryRegion,
    blocks: MemoryRegion,
    closed: AtomicBool,
    retained: AtomicUsize,
    /// The side channel, to end the connection on [`Region::disconnect`].
    side: Mutex<Option<TcpStream>>,
    /// Notices for the sender, written on the side channel by its watching thread.
    notices: NoticeQueue,
    /// This region's share of the receiver's memory budget.
    _reservation: rdmastream::proto::Reservation,
    /// Set for a sliding-window connection: the receives it keeps posted and the ACKs it SENDs.
    window: Option<VerbsWindowSide>,
    qp: ConnectedQp,
    cq: CompletionQueue,
    _pd: ProtectionDomain,
}

/// The receiving end of a sliding-window connection over verbs (see
/// `rdmastream::transport::region` for the tcp emulation's, which this mirrors): a receive
/// request per ring block, posted again as each is consumed; a thread polling the completion
/// queue, which turns each WRITE WITH IMMEDIATE's receive completion into a FULL status byte
/// (the status array is local bookkeeping here, not remotely accessible); an inline SEND of the
/// ACK when a block is let go.
struct VerbsWindowSide {
    receiver: Mutex<WindowReceiver>,
    counts: WorkCounter,
    next_send: AtomicU64,
}

impl VerbsRegion {
    /// Posts what the window receiver asks for: receive requests (no buffer: a WRITE WITH
    /// IMMEDIATE's data goes to the address it names) and ACKs as inline SENDs.
    fn carry_out(&self, w: &VerbsWindowSide, rx: &mut WindowReceiver) -> Result<()> {
        while let Some(a) = rx.poll_action() {
            match a {
                ReceiverAction::PostRecv { count } => {
                    for _ in 0..count {
                        // SAFETY: the receive names no buffer, so no memory must be kept.
                        unsafe { self.qp.post_recv(0, None) }
                            .map_err(|e| rdma_err("posting a receive", e))?;
                        w.counts.post_recv(1);
                    }
                }
                ReceiverAction::SendAck(imm) => {
                    let id = w.next_send.fetch_add(1, Ordering::Relaxed);
                    self.qp
                        .post_send_inline(id, &imm.to_ack(), true)
                        .map_err(|e| rdma_err("posting an ACK", e))?;
                    w.counts.post_send(1);
                }
            }
        }
        Ok(())
    }

    /// The sliding window's completion thread: receive completions (a block arrived) and the
    /// ACK SENDs' completions, until the region is closed. A failed completion or an immediate
    /// that breaks the window closes the region.
    fn poll_window(self: Arc<Self>, name: String) {
        let Some(w) = &self.window else { return };
        let mut polled = vec![ibv::Completion::default(); 16];
        let mut idle = Duration::ZERO;
        let fail = |why: String| {
            tracing::warn!(sender = %name, "sliding window: {why}; closing the connection");
            self.disconnect();
        };
        while !self.closed.load(Ordering::Acquire) {
            let n = match self.cq.poll(&mut polled) {
                Ok(n) => n,
                Err(e) => return fail(format!("polling completions: {e}")),
            };
            for c in &polled[..n] {
                if let ibv::WcStatus::Error { text, .. } = c.status {
                    return fail(format!("work request {} failed: {text}", c.wr_id));
                }
                w.counts.completion();
                match (c.opcode, c.imm) {
                    (ibv::WcOpcode::RecvRdmaWithImm, Some(imm)) => {
                        let mut rx = w.receiver.lock();
                        let at = match rx.handle_received(imm) {
                            Ok(at) => at,
                            Err(e) => return fail(e.to_string()),
                        };
                        w.counts.consume_recv();
                        // The completion was polled: the NIC placed the block before it.
                        self.set_status(at.position, status::FULL);
                        if let Err(e) = self.carry_out(w, &mut rx) {
                            return fail(e.to_string());
                        }
                    }
                    (ibv::WcOpcode::Send, _) => w.counts.complete_send(1),
                    (other, _) => return fail(format!("unexpected completion {other:?}")),
                }
            }
            if n > 0 {
                idle = Duration::ZERO;
                continue;
            }
            // Spin briefly (blocks come within microseconds while streaming), then back off.
            if idle < Duration::from_micros(200) {
                std::hint::spin_loop();
                idle += Duration::from_micros(1);
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }
}

impl VerbsRegion {
    fn block_range(&self, j: usize) -> Range<usize> {
        j * self.layout.block_size..(j + 1) * self.layout.block_size
    }

    fn block_bytes(&self, j: usize) -> &[u8] {
        // SAFETY: callers only look at a block whose status byte is FULL or RETAINED. The sender
        // writes a block only while its status byte is EMPTY (docs/protocol.md: only the sender
        // turns a 0 into anything else, and the receiver turns it back to 0 only when done), so
        // no RDMA WRITE targets these bytes while the slice lives. A sender breaking the
        // protocol can only change bytes of its own region (own PD and rkeys), which the seal
        // check then rejects. Sliding window: the sender writes a ring block again only after
        // its ACK, which goes out after `release` stored EMPTY; a sender writing it earlier
        // breaks the window, which the completion thread detects and ends the connection for
        // (only this region's bytes, again, and the seal check holds).
        unsafe { self.blocks.range(self.block_range(j)) }
    }
}

impl Region for VerbsRegion {
    fn layout(&self) -> RemoteLayout {
        self.layout
    }
    /// The NIC may place a WRITE's bytes in any order: blocks must be sealed over their payload.
    fn placement(&self) -> rdmastream::proto::Placement {
        rdmastream::proto::Placement::Unordered
    }
    fn status(&self, j: usize) -> u8 {
        self.statuses.atomic_bytes()[j].load(Ordering::Acquire)
    }
    fn set_status(&self, j: usize, value: u8) {
        self.statuses.atomic_bytes()[j].store(value, Ordering::Release)
    }
    fn read_block(&self, j: usize, f: &mut dyn FnMut(&[u8])) {
        f(self.block_bytes(j))
    }
    /// A volatile copy: a sender's RDMA WRITE may be placing these bytes.
    fn copy_from_block(&self, j: usize, at: usize, into: &mut [u8]) {
        let r = self.block_range(j);
        assert_in_block(at, into.len(), r.len());
        self.blocks.copy_out(r.start + at, into);
    }
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
    fn disconnect(&self) {
        if let Some(side) = self.side.lock().take() {
            let _ = side.shutdown(Shutdown::Both);
        }
        self.closed.store(true, Ordering::Release);
    }
    fn retain(self: Arc<Self>, j: usize) -> RetainedBlock {
        self.set_status(j, status::RETAINED);
        self.retained.fetch_add(1, Ordering::Relaxed);
        RetainedBlock::new(
            self.clone(),
            j,
            Box::new(VerbsHeld {
                region: self,
                index: j,
            }),
        )
    }
    fn retained(&self) -> usize {
        self.retained.load(Ordering::Relaxed)
    }
    fn release(&self, j: usize) {
        self.retained.fetch_sub(1, Ordering::Relaxed);
        self.set_status(j, status::EMPTY);
        if let Some(w) = &self.window {
            // Empty first: the sender writes the block again only after this ACK.
            let mut rx = w.receiver.lock();
            rx.handle_processed(j, false);
            if let Err(e) = self.carry_out(w, &mut rx) {
                tracing::warn!("sliding window: {e}; closing the connection");
                drop(rx);
                self.disconnect();
            }
        }
    }
    fn abandon(&self, _j: usize) {
        self.retained.fetch_sub(1, Ordering::Relaxed);
    }
    fn notify(&self, notice: Notice) {
        if !self.is_closed() {
            self.notices.push(notice);
        }
    }
    fn work_counts(&self) -> Option<WorkCounts> {
        self.window.as_ref().map(|w| w.counts.snapshot())
    }
}

/// Panics unless `len` bytes at `at` lie inside a block of `block_size` bytes: the check of
/// both transports' `Region::copy_from_block` (the offsets are the receiver's own, so one
/// outside the block is a bug, never a peer's doing).
pub(crate) fn assert_in_block(at: usize, len: usize, block_size: usize) {
    assert!(
        at.checked_add(len).is_some_and(|end| end <= block_size),
        "{len} bytes at {at} are outside a {block_size}-byte block"
    );
}

struct VerbsHeld {
    region: Arc<VerbsRegion>,
    index: usize,
}

impl HeldBytes for VerbsHeld {
    fn bytes(&self) -> &[u8] {
        // The block stays RETAINED while this exists, so the sender skips it.
        self.region.block_bytes(self.index)
    }
    fn copy_out(&self, at: usize, into: &mut [u8]) {
        self.region.copy_from_block(self.index, at, into)
    }
}

/// Opens the RDMA device and listens for senders of the verbs transport on `addr` (the TCP side
/// channel). Each sender gets its own protection domain, registered status array and blocks, and
/// queue pair.
pub fn listen(
    addr: &str,
    region: RegionSettings,
    settings: VerbsSettings,
) -> Result<SideChannelListener> {
    let ctx = open(&settings)?;
    SideChannelListener::bind("verbs", addr, move |stream| {
        handshake(stream, &ctx, &region, &settings)
    })
}

/// The receiver's half of the handshake. Nothing is allocated or registered before the sender
/// proved its key and was admitted; any problem is logged with the peer and answered with a
/// refusal.
fn handshake(
    mut side: TcpStream,
    ctx: &Context,
    settings: &RegionSettings,
    verbs: &VerbsSettings,
) -> std::result::Result<Accepted, Refusal> {
    let Admitted {
        hello,
        peer,
        lease,
        built: (region, memory),
    } = server_handshake(
        &mut side,
        settings,
        DataPath::Verbs,
        "this receiver speaks the verbs transport; set transport = \"verbs\" or \"auto\" on the sender",
        |hello, _| {
            build_region(ctx, settings, verbs, hello)
                .map(|(region, welcome, memory)| (welcome, (region, memory)))
                .map_err(|e| match e {
                    Error::Invalid { reason, .. } => (RefusalKind::MemoryBudget, reason),
                    e => (RefusalKind::Resources, format!("cannot set up RDMA: {e}")),
                })
        },
    )?;
    if let Ok(clone) = side.try_clone() {
        *region.side.lock() = Some(clone);
    }
    let watched = region.clone();
    let name = hello.sender.clone();
    let timeout = settings.peer_timeout;
    // The side channel's end is the sender's end: then no more WRITEs will come. So is its
    // silence beyond the peer timeout (a dead machine or link leaves no FIN). Heartbeats go
    // both ways on it.
    let watcher = spawn(format!("verbs-watch-{name}"), move || {
        let _closed = MarkClosed(&watched.closed);
        side::watch(
            side,
            timeout,
            &watched.closed,
            &watched.notices,
            "sender on the side channel",
        );
    });
    let window = match region.window {
        Some(_) => {
            let polled = region.clone();
            let name = hello.sender.clone();
            spawn(format!("verbs-window-{}", hello.sender), move || {
                polled.poll_window(name)
            })
            .map(|_| ())
        }
        None => Ok(()),
    };
    if let Err(e) = watcher.and(window) {
        region.closed.store(true, Ordering::Release);
        return Err(Refusal {
            peer,
            why: format!("sender '{}': {e}", hello.sender),
            kind: RefusalKind::Resources,
        });
    }
    let region: Arc<dyn Region> = region;
    lease.attach(&region);
    Ok(Accepted {
        hello,
        peer,
        region,
        lease,
        memory,
    })
}

/// Marks a region closed when dropped: on every way out of its watching thread.
struct MarkClosed<'a>(&'a AtomicBool);

impl Drop for MarkClosed<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

fn build_region(
    ctx: &Context,
    settings: &RegionSettings,
    verbs: &VerbsSettings,
    hello: &Hello,
) -> Result<(Arc<VerbsRegion>, Welcome, Arc<rdmastream::proto::Budget>)> {
    let (n, b) = (settings.blocks, settings.block_size);
    let window = matches!(hello.mechanism, Mechanism::SlidingWindow { .. });
    let memory = settings
        .reserve_region()
        .map_err(|(_, why)| Error::invalid("memory_budget", why))?;
    let (region_memory, reassembly) = (memory.region, memory.reassembly);
    // Each sender gets its own protection domain: its rkeys are useless on any other region.
    let pd = ctx
        .alloc_pd()
        .map_err(|e| rdma_err("allocating a protection domain", e))?;
    // The sliding window's status array is the receiver's own bookkeeping: no remote access.
    let status_access = if window {
        AccessFlags::LOCAL_WRITE
    } else {
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ
    };
    let statuses = pd
        .register(n, status_access)
        .map_err(|e| rdma_err("registering the status array", e))?;
    for &j in &settings.reserved_blocks {
        statuses.atomic_bytes()[j].store(status::RETAINED, Ordering::Release);
    }
    let blocks = pd
        .register(n * b, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .map_err(|e| rdma_err(format!("registering {n} blocks of {b} bytes"), e))?;
    // The sliding window receives a block per ring slot and SENDs an ACK per block: room for a
    // ring of each, and their completions.
    let (depth, inline) = if window { (n as u32 + 1, 16) } else { (1, 0) };
    let cq = ctx
        .create_cq(if window { 2 * depth } else { 1 })
        .map_err(|e| rdma_err("creating a completion queue", e))?;
    let config = QpConfig {
        port: verbs.port,
        gid_index: verbs.gid_index,
        caps: QpCaps {
            max_send_wr: depth,
            max_recv_wr: depth,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: inline,
        },
        access: if window {
            AccessFlags::REMOTE_WRITE
        } else {
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ
        },
        ..QpConfig::default()
    };
    let qp = pd
        .create_qp(&cq, &cq, &config)
        .map_err(|e| rdma_err("creating the queue pair", e))?;
    let local = qp.handshake_info();
    let qp = qp
        .connect(&endpoint(&hello.qp))
        .map_err(|e| rdma_err("connecting the queue pair", e))?;
    let welcome = Welcome {
        blocks: n as u32,
        block_size: b as u32,
        status_addr: if window { 0 } else { statuses.addr() },
        status_rkey: if window { 0 } else { statuses.rkey() },
        blocks_addr: blocks.addr(),
        blocks_rkey: blocks.rkey(),
        qp: qp_info(&local),
        ..Welcome::refusal("")
    };
    let region = Arc::new(VerbsRegion {
        layout: RemoteLayout {
            blocks: n,
            block_size: b,
        },
        statuses,
        blocks,
        closed: AtomicBool::new(false),
        retained: AtomicUsize::new(0),
        side: Mutex::new(None),
        notices: NoticeQueue::default(),
        _reservation: region_memory,
        window: window.then(|| VerbsWindowSide {
            receiver: Mutex::new(WindowReceiver::new(RemoteLayout {
                blocks: n,
                block_size: b,
            })),
            // One completion queue for the receives and the ACK SENDs.
            counts: WorkCounter::new(1),
            next_send: AtomicU64::new(1),
        }),
        qp,
        cq,
        _pd: pd,
    });
    if let Some(w) = &region.window {
        // RmInit: every receive is posted before the Welcome lets the sender write.
        region.carry_out(w, &mut w.receiver.lock())?;
    }
    Ok((region, welcome, reassembly))
}

/// Isolation between senders on real RDMA (Soft-RoCE in `scripts/test-vm.sh`): every sender has
/// its own protection domain, so another sender's rkey is useless on its queue pair. On a host
/// without an RDMA device these tests say so and pass without checking anything; the VM runs
/// them with `RDMASTREAM_TEST_TRANSPORT=verbs`, where they must find the device.
#[cfg(test)]
mod isolation_tests {
    use super::*;
    use rdmastream::transport::Listener;

    /// A sender speaking the handshake itself, so the test can post what a hostile one would.
    struct RawSender {
        qp: ConnectedQp,
        cq: CompletionQueue,
        mr: MemoryRegion,
        welcome: Welcome,
        _pd: ProtectionDomain,
    }

    fn raw_sender(ctx: &Context, settings: &VerbsSettings, addr: &str, name: &str) -> RawSender {
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(4).unwrap();
        let config = QpConfig {
            port: settings.port,
            gid_index: settings.gid_index,
            caps: QpCaps {
                max_send_wr: 4,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 16,
            },
            access: AccessFlags::NONE,
            ..QpConfig::default()
        };
        let qp = pd.create_qp(&cq, &cq, &config).unwrap();
        let hello = Hello {
            version: rdmastream::proto::handshake::PROTOCOL_VERSION,
            sender: name.into(),
            session: 1,
            block_size: 0,
            data_path: DataPath::Verbs,
            qp: qp_info(&qp.handshake_info()),
            nonce: [0; 32],
            mechanism: Default::default(),
        };
        let (side, welcome) = client_handshake(addr, &hello, None).unwrap();
        // The side channel stays open for the connection's life.
        std::mem::forget(side);
        let qp = qp.connect(&endpoint(&welcome.qp)).unwrap();
        let mr = pd.register(64, AccessFlags::NONE).unwrap();
        RawSender {
            qp,
            cq,
            mr,
            welcome,
            _pd: pd,
        }
    }

    impl RawSender {
        /// WRITEs 64 bytes to `addr` with `rkey` and waits for the completion.
        fn write(&self, addr: u64, rkey: u32) -> ibv::WcStatus {
            let wr = ibv::WriteWr::region(9, &self.mr, 0, 64, addr, rkey).signaled(true);
            // SAFETY: `mr` is owned by `self` and not touched by the CPU until the completion
            // below has been polled (or the deadline passed and the test fails).
            unsafe { self.qp.post_write_chain(&[wr]) }.unwrap();
            let mut polled = vec![ibv::Completion::default(); 4];
            let end = Instant::now() + Duration::from_secs(20);
            while Instant::now() < end {
                let n = self.cq.poll(&mut polled).unwrap();
                if n > 0 {
                    return polled[0].status;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            panic!("no completion within 20 s");
        }
    }

    #[test]
    fn a_write_with_another_senders_rkey_fails_with_a_remote_access_error() {
        let on_rdma = std::env::var("RDMASTREAM_TEST_TRANSPORT").as_deref() == Ok("verbs");
        let settings = VerbsSettings {
            device: None,
            port: 1,
            gid_index: std::env::var("RDMASTREAM_VM_GID_INDEX")
                .ok()
                .and_then(|g| g.parse().ok()),
        };
        let ctx = match open(&settings) {
            Ok(c) => c,
            Err(e) if !on_rdma => {
                eprintln!("no RDMA device here ({e}); scripts/test-vm.sh runs this over Soft-RoCE");
                return;
            }
            Err(e) => panic!("RDMASTREAM_TEST_TRANSPORT=verbs but no usable device: {e}"),
        };
        let host = std::env::var("RDMASTREAM_TEST_HOST").unwrap_or_else(|_| "127.0.0.1".into());
        let mut listener = listen(
            &format!("{host}:0"),
            RegionSettings::plain(4, 4096),
            settings.clone(),
        )
        .unwrap();
        let addr = listener.local_addr();
        let a = raw_sender(&ctx, &settings, &addr, "a");
        let b = raw_sender(&ctx, &settings, &addr, "b");
        let accepted: Vec<_> = (0..2)
            .map(|_| {
                listener
                    .accept_sender(Duration::from_secs(10))
                    .unwrap()
                    .unwrap()
            })
            .collect();
        assert_ne!(a.welcome.blocks_rkey, b.welcome.blocks_rkey);
        for byte in b.mr.atomic_bytes() {
            byte.store(0xAB, Ordering::Relaxed);
        }
        // With its own rkey a sender's WRITE lands in its own region ...
        assert_eq!(
            a.write(a.welcome.blocks_addr, a.welcome.blocks_rkey),
            ibv::WcStatus::Success
        );
        // ... and with the other sender's address and rkey the NIC refuses it: the rkey belongs
        // to another protection domain.
        match b.write(a.welcome.blocks_addr, a.welcome.blocks_rkey) {
            ibv::WcStatus::Error { text, .. } => {
                assert!(text.contains("remote access"), "{text}")
            }
            ibv::WcStatus::Success => panic!("sender b wrote into sender a's region"),
        }
        // Sender a's region was not touched by b (a wrote 64 zero bytes; b's 0xAB never came).
        let region_a = accepted
            .iter()
            .find(|x| x.hello.sender == "a")
            .unwrap()
            .region
            .clone();
        let mut first = Vec::new();
        region_a.read_block(0, &mut |bytes| first = bytes[..64].to_vec());
        assert_eq!(first, vec![0u8; 64]);
    }
}

/// The verbs the sliding-window baseline needs, on real RDMA (Soft-RoCE in the VM): WRITE WITH
/// IMMEDIATE consuming a posted receive and reporting the immediate, an inline SEND landing in a
/// posted receive buffer (the ACK), and RNR when no receive is posted. Two queue pairs of one
/// process are connected to each other. Without a device (the host) they say so and pass.
#[cfg(test)]
mod window_verbs_tests {
    use super::*;

    struct Side {
        qp: ConnectedQp,
        cq: CompletionQueue,
        mr: MemoryRegion,
        _pd: ProtectionDomain,
    }

    /// Two connected RC queue pairs (the second one's memory remotely writable), or `None`
    /// without a device off the VM.
    fn pair(rnr_retry: u8) -> Option<(Side, Side)> {
        let on_rdma = std::env::var("RDMASTREAM_TEST_TRANSPORT").as_deref() == Ok("verbs");
        let settings = VerbsSettings {
            device: None,
            port: 1,
            gid_index: std::env::var("RDMASTREAM_VM_GID_INDEX")
                .ok()
                .and_then(|g| g.parse().ok()),
        };
        let ctx = match open(&settings) {
            Ok(c) => c,
            Err(e) if !on_rdma => {
                eprintln!("no RDMA device here ({e}); scripts/test-vm.sh runs this over Soft-RoCE");
                return None;
            }
            Err(e) => panic!("RDMASTREAM_TEST_TRANSPORT=verbs but no usable device: {e}"),
        };
        let make = |access: AccessFlags| {
            let pd = ctx.alloc_pd().unwrap();
            let cq = ctx.create_cq(16).unwrap();
            let config = QpConfig {
                port: settings.port,
                gid_index: settings.gid_index,
                caps: QpCaps {
                    max_send_wr: 8,
                    max_recv_wr: 8,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: 16,
                },
                access,
                rnr_retry,
                min_rnr_timer: 1,
                ..QpConfig::default()
            };
            let qp = pd.create_qp(&cq, &cq, &config).unwrap();
            let mr = pd
                .register(4096, AccessFlags::LOCAL_WRITE | access)
                .unwrap();
            (qp, cq, mr, pd)
        };
        let (qa, cqa, mra, pda) = make(AccessFlags::NONE);
        let (qb, cqb, mrb, pdb) = make(AccessFlags::REMOTE_WRITE);
        let (ea, eb) = (qa.handshake_info(), qb.handshake_info());
        let a = Side {
            qp: qa.connect(&eb).unwrap(),
            cq: cqa,
            mr: mra,
            _pd: pda,
        };
        let b = Side {
            qp: qb.connect(&ea).unwrap(),
            cq: cqb,
            mr: mrb,
            _pd: pdb,
        };
        Some((a, b))
    }

    /// The next completion of `cq`, within 20 s.
    fn next(cq: &CompletionQueue) -> ibv::Completion {
        let mut polled = vec![ibv::Completion::default(); 1];
        let end = Instant::now() + Duration::from_secs(20);
        while Instant::now() < end {
            if cq.poll(&mut polled).unwrap() == 1 {
                return polled[0];
            }
            std::thread::yield_now();
        }
        panic!("no completion within 20 s");
    }

    #[test]
    fn write_with_immediate_then_an_inline_ack() {
        let Some((a, b)) = pair(7) else { return };
        // The receiver posts a receive for the block (no buffer: the data goes where the
        // WRITE says), the sender one for the ACK.
        // SAFETY: the receives name no buffer (b) or bytes 0..4 of `a.mr`, which nothing
        // touches until their completion is polled below; both regions outlive the QPs.
        unsafe {
            b.qp.post_recv(1, None).unwrap();
            a.qp.post_recv(2, Some((&a.mr, 0, 4))).unwrap();
        }
        for (k, byte) in a.mr.atomic_bytes()[64..164].iter().enumerate() {
            byte.store(k as u8, Ordering::Relaxed);
        }
        let imm = rdmastream::proto::window::Immediate {
            position: 3,
            len: 100,
        };
        let wr = ibv::WriteWr::region(7, &a.mr, 64, 100, b.mr.addr() + 300, b.mr.rkey())
            .signaled(true)
            .with_imm(imm.encode());
        // SAFETY: bytes 64..164 of `a.mr` are not written again before the completion is
        // polled below.
        unsafe { a.qp.post_write_chain(&[wr]) }.unwrap();
        let sent = next(&a.cq);
        assert!(sent.is_success(), "{sent:?}");
        assert_eq!((sent.wr_id, sent.opcode), (7, ibv::WcOpcode::RdmaWrite));
        let got = next(&b.cq);
        assert!(got.is_success(), "{got:?}");
        assert_eq!(got.wr_id, 1);
        assert_eq!(got.opcode, ibv::WcOpcode::RecvRdmaWithImm);
        assert_eq!(got.imm, Some(imm.encode()), "the immediate arrives intact");
        let placed: Vec<u8> = b.mr.atomic_bytes()[300..400]
            .iter()
            .map(|x| x.load(Ordering::Relaxed))
            .collect();
        assert_eq!(placed, (0..100).map(|k| k as u8).collect::<Vec<_>>());
        // The ACK: an inline SEND of the immediate into the sender's posted receive.
        b.qp.post_send_inline(9, &imm.to_ack(), true).unwrap();
        let acked = next(&b.cq);
        assert!(acked.is_success(), "{acked:?}");
        assert_eq!((acked.wr_id, acked.opcode), (9, ibv::WcOpcode::Send));
        let ack = next(&a.cq);
        assert!(ack.is_success(), "{ack:?}");
        assert_eq!(
            (ack.wr_id, ack.opcode, ack.byte_len),
            (2, ibv::WcOpcode::Recv, 4)
        );
        let bytes: Vec<u8> = a.mr.atomic_bytes()[..4]
            .iter()
            .map(|x| x.load(Ordering::Relaxed))
            .collect();
        assert_eq!(
            rdmastream::proto::window::Immediate::from_ack(&bytes),
            Ok(imm)
        );
    }

    /// Without a posted receive a WRITE WITH IMMEDIATE is refused (RNR): with RNR retries off
    /// the sender's completion fails, as the tcp emulation fails the connection.
    #[test]
    fn a_write_with_immediate_without_a_posted_receive_is_receiver_not_ready() {
        let Some((a, b)) = pair(0) else { return };
        let wr = ibv::WriteWr::region(5, &a.mr, 0, 8, b.mr.addr(), b.mr.rkey())
            .signaled(true)
            .with_imm(1);
        // SAFETY: `a.mr` is not written before the completion is polled below.
        unsafe { a.qp.post_write_chain(&[wr]) }.unwrap();
        match next(&a.cq).status {
            ibv::WcStatus::Error { text, .. } => {
                assert!(text.to_lowercase().contains("rnr"), "{text}")
            }
            ibv::WcStatus::Success => panic!("placed without a receive posted"),
        }
    }
}
