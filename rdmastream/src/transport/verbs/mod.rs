//! The RDMA verbs transport: the mechanism on real one-sided RDMA (InfiniBand, RoCE, Soft-RoCE).
//!
//! All `unsafe` of the project lives in this module: [`ibv`] is a small safe layer over
//! `ibverbs-sys`, and this file uses its two `unsafe fn`s (posting work requests) with the
//! protocol's argument for why the memory they name is left alone until completion.
//!
//! Connection setup runs over a TCP side channel (like perftest): the sender sends a Hello with
//! its queue pair's number, PSN, LID and GID; the receiver validates it *before* allocating
//! anything, then gives the sender its own protection domain, a status array registered for
//! remote READ and WRITE, memory blocks registered for remote WRITE only, and an RC queue pair
//! that only ever acts as responder, and answers with a Welcome carrying addresses, rkeys and
//! its queue pair. The side channel stays open: its end tells the receiver the sender is gone.
//! The receiver never posts a work request ([`posted_work_requests`] counts them per process).
#![allow(unsafe_code)]

pub mod ibv;

use std::net::{Shutdown, TcpStream};
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use self::ibv::{
    AccessFlags, CompletionQueue, ConnectedQp, Context, Gid, MemoryRegion, ProtectionDomain,
    QpCaps, QpConfig, QpEndpoint,
};
use super::tcp::{SideChannelListener, client_handshake, lost, refuse, send_message, server_hello};
use super::{
    Accepted, Completion, Connection, Connector, HeldBytes, Refusal, Region, RegionSettings,
    RegisteredBlocks, RemoteAddr, RetainedBlock, SendBlocks, Target, WriteSource, WriteWr,
};
use crate::error::{Error, Result, spawn};
use crate::proto::handshake::{DataPath, Hello, QpInfo, Welcome};
use crate::proto::{RemoteLayout, status};

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
        cause,
    }
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
    locks: Box<[Mutex<()>]>,
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

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Connects a sender to a receiver over RDMA verbs, through a TCP side channel at `addr`.
pub struct VerbsConnector {
    addr: String,
    settings: VerbsSettings,
    ctx: Context,
    pd: ProtectionDomain,
    max_outstanding: usize,
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
        })
    }
}

impl Connector for VerbsConnector {
    fn transport(&self) -> &'static str {
        "verbs"
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
        let locks = (0..count).map(|_| Mutex::new(())).collect();
        Ok(SendBlocks::registered(
            count,
            block_size,
            Box::new(VerbsSendBlocks {
                mr: Arc::new(mr),
                block_size,
                locks,
            }),
        ))
    }

    fn connect(&self, hello: &Hello, blocks: &Arc<SendBlocks>) -> Result<Box<dyn Connection>> {
        let peer = self.addr.clone();
        let send_mr = blocks
            .registration()
            .and_then(|r| r.as_any().downcast_ref::<VerbsSendBlocks>())
            .map(|b| b.mr.clone())
            .ok_or_else(|| {
                Error::invalid("send blocks", "not registered by this verbs transport")
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
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 16,
            },
            access: AccessFlags::NONE,
            ..QpConfig::default()
        };
        let qp = self
            .pd
            .create_qp(&cq, &cq, &config)
            .map_err(|e| rdma_err("creating the queue pair", e))?;
        let hello = Hello {
            data_path: DataPath::Verbs,
            qp: qp_info(&qp.handshake_info()),
            ..hello.clone()
        };
        let (side, welcome) = client_handshake(&peer, &hello)?;
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
        Ok(Box::new(VerbsConnection {
            peer,
            layout,
            welcome,
            qp,
            cq,
            send_mr,
            send_block_size: blocks.block_size(),
            cache,
            side,
            side_checked: Instant::now(),
            polled: vec![ibv::Completion::default(); 16],
        }))
    }
}

/// The sender's end of one RC queue pair.
pub struct VerbsConnection {
    peer: String,
    layout: RemoteLayout,
    welcome: Welcome,
    qp: ConnectedQp,
    cq: CompletionQueue,
    send_mr: Arc<MemoryRegion>,
    send_block_size: usize,
    /// The status cache: destination of the sync READ.
    cache: MemoryRegion,
    side: TcpStream,
    side_checked: Instant,
    polled: Vec<ibv::Completion>,
}

impl VerbsConnection {
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

    /// Checks (at most every 50 ms) that the receiver still holds the side channel open.
    fn check_side_channel(&mut self) -> Result<()> {
        if self.side_checked.elapsed() < Duration::from_millis(50) {
            return Ok(());
        }
        self.side_checked = Instant::now();
        let mut byte = [0u8; 1];
        match self.side.peek(&mut byte) {
            Ok(0) => Err(self.lost("the receiver closed the side channel")),
            Ok(_) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(()),
            Err(e) => Err(self.lost(format!("side channel: {e}"))),
        }
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
        // (SenderMachine frees blocks on handle_write_completed), so its bytes are not modified
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
        // (SenderMachine waits for handle_sync_completed before using the bytes).
        unsafe {
            self.qp
                .post_read(wr_id, (&self.cache, 0, len), addr, rkey, true)
        }
        .map_err(|e| self.lost(format!("posting the status READ: {e}")))?;
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
                out.push(Completion { wr_id: c.wr_id });
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

    fn read_buffer(&self) -> Vec<u8> {
        self.cache.atomic_bytes()[..self.layout.blocks]
            .iter()
            .map(|b| b.load(Ordering::Acquire))
            .collect()
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
    _qp: ConnectedQp,
    _cq: CompletionQueue,
    _pd: ProtectionDomain,
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
        // check then rejects.
        unsafe { self.blocks.range(self.block_range(j)) }
    }
}

impl Region for VerbsRegion {
    fn layout(&self) -> RemoteLayout {
        self.layout
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
    }
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

/// The receiver's half of the handshake. Nothing is allocated or registered before the Hello is
/// valid; any problem is logged with the peer and answered with a refusal.
fn handshake(
    mut side: TcpStream,
    ctx: &Context,
    settings: &RegionSettings,
    verbs: &VerbsSettings,
) -> std::result::Result<Accepted, Refusal> {
    let (hello, peer) = server_hello(
        &mut side,
        settings,
        DataPath::Verbs,
        "this receiver speaks the verbs transport; set transport = \"verbs\" or \"auto\" on the sender",
    )?;
    match build_region(ctx, settings, verbs, &hello) {
        Ok((region, welcome)) => {
            if let Err(e) = send_message(&mut side, &welcome.encode()) {
                return Err(lost(&peer, &hello.sender, e));
            }
            let _ = side.set_read_timeout(None);
            if let Ok(clone) = side.try_clone() {
                *region.side.lock() = Some(clone);
            }
            let watched = region.clone();
            let name = hello.sender.clone();
            // The side channel's end is the sender's end: then no more WRITEs will come.
            let _ = spawn(format!("verbs-watch-{name}"), move || {
                let mut buf = [0u8; 64];
                while matches!(std::io::Read::read(&mut side, &mut buf), Ok(n) if n > 0) {}
                watched.closed.store(true, Ordering::Release);
            });
            Ok(Accepted {
                hello,
                peer,
                region,
            })
        }
        Err(e) => Err(refuse(
            &mut side,
            &peer,
            format!("cannot set up RDMA for sender '{}': {e}", hello.sender),
        )),
    }
}

fn build_region(
    ctx: &Context,
    settings: &RegionSettings,
    verbs: &VerbsSettings,
    hello: &Hello,
) -> Result<(Arc<VerbsRegion>, Welcome)> {
    let (n, b) = (settings.blocks, settings.block_size);
    // Each sender gets its own protection domain: its rkeys are useless on any other region.
    let pd = ctx
        .alloc_pd()
        .map_err(|e| rdma_err("allocating a protection domain", e))?;
    let statuses = pd
        .register(
            n,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )
        .map_err(|e| rdma_err("registering the status array", e))?;
    for &j in &settings.reserved_blocks {
        statuses.atomic_bytes()[j].store(status::RETAINED, Ordering::Release);
    }
    let blocks = pd
        .register(n * b, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .map_err(|e| rdma_err(format!("registering {n} blocks of {b} bytes"), e))?;
    let cq = ctx
        .create_cq(1)
        .map_err(|e| rdma_err("creating a completion queue", e))?;
    let config = QpConfig {
        port: verbs.port,
        gid_index: verbs.gid_index,
        caps: QpCaps {
            max_send_wr: 1,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        access: AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
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
        status_addr: statuses.addr(),
        status_rkey: statuses.rkey(),
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
        _qp: qp,
        _cq: cq,
        _pd: pd,
    });
    Ok((region, welcome))
}
