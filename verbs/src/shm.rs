//! The shm transport: the status-byte mechanism between a sender and a receiver on one host
//! (processes, or containers sharing a volume for the socket), with the receiver's region in
//! shared memory.
//!
//! Connection setup runs on a Unix socket (`unix:/path`): the same handshake as the other
//! transports (Hello, challenge and proofs, admission, the memory budget; data path 2). Once the
//! sender is admitted, the receiver creates its region as a memfd — the doorbell word at offset
//! 0, the status array at the Welcome's `status_addr` (64), the memory blocks from its
//! `blocks_addr` on — seals its size, sends the Welcome and then the memfd itself
//! (SCM_RIGHTS). The sender maps it and from then on plays the NIC itself: a write chain
//! copies the block's bytes straight into the receiver's block and then stores the status byte
//! with release ordering; a sync loads the status array with acquire
//! ordering; both complete at once (the completion is returned by the next poll). After storing
//! status bytes it rings the doorbell when the receiver's polling thread waits on it (a futex on
//! the shared word), so an idle receiver sees a block at once instead of after its sleep. Each
//! sender gets its own memfd, so it can reach no other sender's region.
//!
//! The socket stays open: heartbeat bytes go both ways on it, and its end (a sender killed with
//! SIGKILL included) tells the receiver the sender is gone, as the side channel does for verbs.
//! The receiver never writes a block and never posts anything; its polling threads load status
//! bytes as they do on every transport.
//!
//! A sender may also lend a free block of the receiver's region to a source, which writes a
//! frame straight into it ([`Connection::lend_block`]; the sending thread then posts only its
//! status byte): the frame is written once, into the receiver's memory.
//!
//! This module forbids `unsafe` except in three functions: [`ShmRegion::block_bytes`], which
//! views a block the protocol keeps the sender away from (the same argument as the verbs
//! transport's), and on the sender's side `ShmConnection::copy_block` and
//! `ShmConnection::lend_block`, which write blocks the protocol gives the sender; the mapping
//! itself is [`crate::shared`].
#![deny(unsafe_code)]

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering, fence};
use std::time::{Duration, Instant};

use rustix::thread::futex;

use parking_lot::Mutex;

use crate::shared::{LentRange, SharedMapping, recv_fd, send_fd};
use rdmastream::error::{Error, Result, spawn};
use rdmastream::proto::handshake::{DataPath, Hello, Key, Welcome};
use rdmastream::proto::{RemoteLayout, status};
use rdmastream::transport::tcp::{
    Admitted, HANDSHAKE_TIMEOUT, SideChannelListener, client_handshake_on, lost, server_handshake,
};
use rdmastream::transport::{
    Accepted, Completion, Connection, Connector, HeldBytes, LeasedBlock, Notice, NoticeQueue,
    Refusal, RefusalKind, Region, RegionSettings, RemoteAddr, RetainedBlock, SendBlocks, Target,
    WriteSource, WriteWr,
};

/// The address scheme of the shm transport: `unix:/path/of/the/socket`.
pub const SCHEME: &str = rdmastream::transport::UNIX_SCHEME;

/// The socket path of a `unix:` address, or `None` for any other address.
pub fn socket_path(addr: &str) -> Option<&Path> {
    addr.strip_prefix(SCHEME)
        .filter(|p| !p.is_empty())
        .map(Path::new)
}

/// The doorbell: a 32-bit futex word at offset 0 of the region, alone on its cache line. The
/// receiver's polling thread stores [`ASLEEP`] in it before it waits; the sender, after storing
/// a status byte, swaps in [`AWAKE`] and wakes it if it was asleep (docs/protocol.md, "The
/// doorbell"). A sender rings only when the Welcome puts the status array at
/// [`STATUS_AT`] or later, so the word is never a status byte or a block.
pub const DOORBELL_AT: usize = 0;
/// Where the status array starts: the cache line after the doorbell's.
pub const STATUS_AT: usize = 64;
/// Doorbell values: the polling thread is about to wait, or is not waiting.
pub const ASLEEP: u32 = 1;
pub const AWAKE: u32 = 0;
/// How often one idle wait may be woken with no FULL status byte to show for it before the
/// polling thread sleeps out the rest plainly: a sender ringing (or scribbling on the word) for
/// nothing cannot make it spin.
const EMPTY_WAKES: u32 = 8;

/// Where the memory blocks start in a region of `blocks` blocks: after the doorbell's cache
/// line and the status array, rounded up to a cache line so no block shares one with status
/// bytes.
pub fn blocks_offset(blocks: usize) -> usize {
    STATUS_AT + blocks.div_ceil(64) * 64
}

// ---------------------------------------------------------------------------------------------
// Receiver side
// ---------------------------------------------------------------------------------------------

/// Listens for senders of the shm transport on the Unix socket `path`; each gets its own region
/// in a memfd from `settings`.
pub fn listen(path: &Path, settings: RegionSettings) -> Result<SideChannelListener> {
    SideChannelListener::bind_unix("shm", path, move |stream| handshake(stream, &settings))
}

/// One sender's region: a memfd mapped here and in the sender.
pub struct ShmRegion {
    layout: RemoteLayout,
    mapping: SharedMapping,
    blocks_at: usize,
    closed: AtomicBool,
    retained: AtomicUsize,
    /// The socket, to end the connection on [`Region::disconnect`].
    side: Mutex<Option<UnixStream>>,
    /// Notices for the sender, written on the socket by its watching thread.
    notices: NoticeQueue,
    _reservation: rdmastream::proto::Reservation,
}

impl ShmRegion {
    /// Whether any block's status byte is FULL.
    fn any_full(&self) -> bool {
        (0..self.layout.blocks).any(|j| self.status(j) == status::FULL)
    }

    /// The bytes of block `j`.
    #[allow(unsafe_code)]
    fn block_bytes(&self, j: usize) -> &[u8] {
        let b = self.layout.block_size;
        // SAFETY: callers only look at a block whose status byte is FULL or RETAINED, and the
        // sender writes a block only while its status byte is EMPTY (docs/protocol.md: only the
        // sender turns a 0 into anything else, and the receiver turns it back to 0 only when it
        // is done with the block and every slice of it is gone — a retained block's slice lives
        // in its `RetainedBlock`, whose drop stores the 0). So no write reaches these bytes while
        // the slice lives. A sender that breaks the protocol can change bytes of its own region
        // only (its own memfd); the seal check rejects a header or trailer it tears (blocks over
        // shm are sealed over their header only: a payload it tears is its own, untrusted bytes,
        // and every length was taken from the checked header).
        unsafe { self.mapping.bytes(self.blocks_at + j * b, b) }
    }
}

impl Region for ShmRegion {
    fn layout(&self) -> RemoteLayout {
        self.layout
    }
    /// The sender copies a block's bytes, then stores its status byte with release ordering.
    fn placement(&self) -> rdmastream::proto::Placement {
        rdmastream::proto::Placement::Ordered
    }
    fn status(&self, j: usize) -> u8 {
        self.mapping.status(STATUS_AT + j).load(Ordering::Acquire)
    }
    fn set_status(&self, j: usize, value: u8) {
        self.mapping
            .status(STATUS_AT + j)
            .store(value, Ordering::Release)
    }
    /// The sender rings the doorbell after every status byte it stores.
    fn wakes(&self) -> bool {
        true
    }
    /// Waits on the doorbell. Before each wait the word is set to [`ASLEEP`] and, after a
    /// sequentially consistent fence, the status array is looked at once more: a status byte
    /// the sender stored before it could see the word is found here, and one it stores after
    /// finds the word set and rings (the sender fences between its store and its look at the
    /// word). The word is only a hint from the sender: a wake with nothing FULL waits again, at
    /// most [`EMPTY_WAKES`] times, then the rest is slept out plainly.
    fn wait(&self, timeout: Duration) {
        let bell = self.mapping.word(DOORBELL_AT);
        let deadline = Instant::now() + timeout;
        let mut empty_wakes = 0;
        loop {
            bell.store(ASLEEP, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            if self.any_full() {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.is_closed() {
                break;
            }
            if empty_wakes == EMPTY_WAKES {
                bell.store(AWAKE, Ordering::Relaxed);
                std::thread::sleep(left);
                return;
            }
            // Returns when woken, at the timeout, or at once when the word is no longer ASLEEP
            // (the sender rang between the store above and this call).
            let ts = futex::Timespec::try_from(left).unwrap_or(futex::Timespec {
                tv_sec: 1,
                tv_nsec: 0,
            });
            let _ = futex::wait(bell, futex::Flags::empty(), ASLEEP, Some(&ts));
            empty_wakes += 1;
        }
        bell.store(AWAKE, Ordering::Relaxed);
    }
    fn read_block(&self, j: usize, f: &mut dyn FnMut(&[u8])) {
        f(self.block_bytes(j))
    }
    /// A volatile copy: the sender's process maps these bytes too.
    fn copy_from_block(&self, j: usize, at: usize, into: &mut [u8]) {
        let b = self.layout.block_size;
        crate::assert_in_block(at, into.len(), b);
        self.mapping.copy_out(self.blocks_at + j * b + at, into);
    }
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
    fn disconnect(&self) {
        if let Some(side) = self.side.lock().take() {
            let _ = side.shutdown(std::net::Shutdown::Both);
        }
        self.closed.store(true, Ordering::Release);
    }
    fn retain(self: Arc<Self>, j: usize) -> RetainedBlock {
        self.set_status(j, status::RETAINED);
        self.retained.fetch_add(1, Ordering::Relaxed);
        RetainedBlock::new(
            self.clone(),
            j,
            Box::new(ShmHeld {
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
    fn abandon(&self, _j: usize) {
        self.retained.fetch_sub(1, Ordering::Relaxed);
    }
    fn notify(&self, notice: Notice) {
        if !self.is_closed() {
            self.notices.push(notice);
        }
    }
}

struct ShmHeld {
    region: Arc<ShmRegion>,
    index: usize,
}

impl HeldBytes for ShmHeld {
    fn bytes(&self) -> &[u8] {
        // The block stays RETAINED while this exists, so the sender skips it.
        self.region.block_bytes(self.index)
    }
    fn copy_out(&self, at: usize, into: &mut [u8]) {
        self.region.copy_from_block(self.index, at, into)
    }
}

/// The receiver's half: the handshake, then the region (memory reserved from the budget, memfd
/// created and sealed only after admission), the Welcome, the memfd, and a thread that watches
/// the socket.
fn handshake(
    mut side: UnixStream,
    settings: &RegionSettings,
) -> std::result::Result<Accepted, Refusal> {
    let (n, b) = (settings.blocks, settings.block_size);
    let blocks_at = blocks_offset(n);
    let Admitted {
        hello,
        peer,
        lease,
        built: (mapping, memory),
    } = server_handshake(
        &mut side,
        settings,
        DataPath::Shm,
        "this receiver speaks the shm transport (a unix: address); set transport = \"shm\" or \"auto\" on the sender",
        |hello, _| {
            let memory = settings.reserve_region()?;
            let len = n
                .checked_mul(b)
                .and_then(|blocks| blocks.checked_add(blocks_at))
                .ok_or((RefusalKind::Resources, "region size overflows".to_string()))?;
            let mapping = SharedMapping::create(&format!("rdmastream-{}", hello.sender), len)
                .map_err(|e| {
                    (
                        RefusalKind::Resources,
                        format!("cannot create {len} bytes of shared memory: {e}"),
                    )
                })?;
            for &j in &settings.reserved_blocks {
                mapping
                    .status(STATUS_AT + j)
                    .store(status::RETAINED, Ordering::Release);
            }
            let welcome = Welcome {
                blocks: n as u32,
                block_size: b as u32,
                status_addr: STATUS_AT as u64,
                blocks_addr: blocks_at as u64,
                ..Welcome::refusal("")
            };
            Ok((welcome, (mapping, memory)))
        },
    )?;
    if let Err(e) = send_fd(&side, mapping.fd()) {
        return Err(lost(
            &peer,
            &hello.sender,
            format!("passing the region: {e}"),
        ));
    }
    let region = Arc::new(ShmRegion {
        layout: RemoteLayout {
            blocks: n,
            block_size: b,
        },
        mapping,
        blocks_at,
        closed: AtomicBool::new(false),
        retained: AtomicUsize::new(0),
        side: Mutex::new(side.try_clone().ok()),
        notices: NoticeQueue::default(),
        _reservation: memory.region,
    });
    let watched = region.clone();
    let timeout = settings.peer_timeout;
    let watcher = spawn(format!("shm-watch-{}", hello.sender), move || {
        crate::side::watch(
            side,
            timeout,
            &watched.closed,
            &watched.notices,
            "shm sender",
        );
        watched.closed.store(true, Ordering::Release);
    });
    if let Err(e) = watcher {
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
        memory: memory.reassembly,
    })
}

// ---------------------------------------------------------------------------------------------
// Sender side
// ---------------------------------------------------------------------------------------------

/// Connects a sender to a receiver's Unix socket.
pub struct ShmConnector {
    addr: String,
    path: PathBuf,
    peer_timeout: Duration,
    cache_budget: Option<usize>,
}

impl ShmConnector {
    /// A connector to `addr` (`unix:/path`).
    pub fn new(addr: &str) -> Result<ShmConnector> {
        let path = socket_path(addr).ok_or_else(|| {
            Error::invalid(
                "receiver",
                format!("{addr:?}: the shm transport needs a unix:/path address"),
            )
        })?;
        Ok(ShmConnector {
            path: path.to_path_buf(),
            addr: addr.to_string(),
            peer_timeout: rdmastream::transport::DEFAULT_PEER_TIMEOUT,
            cache_budget: Some(rdmastream::transport::shm_cache_budget()),
        })
    }

    /// Keeps at most `budget` bytes of the receiver's region FULL at once (`None`: no limit)
    /// instead of this host's budget, [`rdmastream::transport::shm_cache_budget`] (see
    /// [`Connection::cache_budget`]).
    pub fn with_cache_budget(mut self, budget: Option<usize>) -> ShmConnector {
        self.cache_budget = budget;
        self
    }

    /// Gives a connection up when the receiver has been silent on the socket for `timeout`.
    pub fn with_peer_timeout(mut self, timeout: Duration) -> ShmConnector {
        self.peer_timeout = timeout;
        self
    }
}

impl Connector for ShmConnector {
    fn transport(&self) -> &'static str {
        "shm"
    }

    /// The sending thread copies the block, then stores its status byte with release ordering.
    fn placement(&self) -> rdmastream::proto::Placement {
        rdmastream::proto::Placement::Ordered
    }

    /// The baseline is measured over tcp and verbs, where the paper compares it; over shared
    /// memory there is no WRITE WITH IMMEDIATE or SEND to emulate it with.
    fn connect_window(
        &self,
        _: &Hello,
        _: Option<&Key>,
        _: &Arc<SendBlocks>,
    ) -> Result<Box<dyn rdmastream::transport::WindowConnection>> {
        Err(rdmastream::transport::window_unavailable("shm"))
    }

    fn peer(&self) -> String {
        self.addr.clone()
    }

    fn connect(
        &self,
        hello: &Hello,
        key: Option<&Key>,
        blocks: &Arc<SendBlocks>,
    ) -> Result<Box<dyn Connection>> {
        let peer = self.addr.clone();
        let mut side = UnixStream::connect(&self.path).map_err(|source| Error::Connect {
            peer: peer.clone(),
            source,
        })?;
        let hello = Hello {
            data_path: DataPath::Shm,
            ..hello.clone()
        };
        let welcome = client_handshake_on(&mut side, &peer, &hello, key)?;
        let hs_err = |reason: String| Error::Handshake {
            peer: peer.clone(),
            reason,
        };
        let (n, b) = (welcome.blocks as usize, welcome.block_size as usize);
        let status_at = usize::try_from(welcome.status_addr).ok();
        let blocks_at = usize::try_from(welcome.blocks_addr).ok();
        // The Welcome is the receiver's word (proved when there is a key); its offsets are
        // still checked before anything is mapped or written.
        let len = match (status_at, blocks_at) {
            (Some(s), Some(at)) if s.checked_add(n).is_some_and(|end| end <= at) => n
                .checked_mul(b)
                .and_then(|bytes| bytes.checked_add(at))
                .ok_or_else(|| hs_err("the region's size overflows".into()))?,
            _ => {
                return Err(hs_err(format!(
                    "the Welcome's status array ({}) and blocks ({}) overlap",
                    welcome.status_addr, welcome.blocks_addr
                )));
            }
        };
        side.set_read_timeout(Some(HANDSHAKE_TIMEOUT))
            .map_err(|e| hs_err(e.to_string()))?;
        let fd = recv_fd(&side).map_err(|e| hs_err(format!("receiving the region: {e}")))?;
        let mapping = SharedMapping::open(fd, len).map_err(|source| Error::SharedMemory {
            peer: peer.clone(),
            op: format!("mapping the {len}-byte region"),
            source,
        })?;
        // Non-blocking: the liveness check only looks at what has arrived.
        side.set_nonblocking(true)
            .map_err(|e| hs_err(e.to_string()))?;
        Ok(Box::new(ShmConnection {
            peer,
            layout: RemoteLayout {
                blocks: n,
                block_size: b,
            },
            mapping: Arc::new(mapping),
            status_at: status_at.expect("checked"),
            blocks_at: blocks_at.expect("checked"),
            blocks: blocks.clone(),
            done: Vec::new(),
            side,
            side_state: crate::side::SenderSide::new("socket"),
            peer_timeout: self.peer_timeout,
            cache_budget: self.cache_budget,
        }))
    }
}

/// The sender's end: the receiver's region mapped here, and the socket for liveness.
pub struct ShmConnection {
    peer: String,
    layout: RemoteLayout,
    /// Shared with the blocks lent out ([`Connection::lend_block`]), which keep it mapped.
    mapping: Arc<SharedMapping>,
    status_at: usize,
    blocks_at: usize,
    blocks: Arc<SendBlocks>,
    /// Completions of work already done, returned by the next poll.
    done: Vec<Completion>,
    side: UnixStream,
    /// Heartbeats and notices on the socket.
    side_state: crate::side::SenderSide,
    peer_timeout: Duration,
    cache_budget: Option<usize>,
}

impl ShmConnection {
    fn lost(&self, reason: impl std::fmt::Display) -> Error {
        Error::Disconnected {
            peer: self.peer.clone(),
            reason: reason.to_string(),
        }
    }

    /// Where `len` bytes at `remote` are in the mapping, checked as an RNIC checks an rkey's
    /// bounds: inside the target and, for memory blocks, inside one block. The offsets come
    /// from this process's own protocol machine, but a bad one must fail the connection like a
    /// remote access error, never write outside the region.
    fn locate(&self, remote: RemoteAddr, len: usize) -> Result<usize> {
        let (unit, count, base) = match remote.target {
            Target::Blocks => (
                self.layout.block_size as u64,
                self.layout.blocks as u64,
                self.blocks_at,
            ),
            Target::Statuses => (1, self.layout.blocks as u64, self.status_at),
        };
        let offset = remote.offset;
        let fits = offset.checked_add(len as u64).is_some_and(|end| {
            let index = offset / unit;
            index < count
                && end <= unit * count
                && (remote.target == Target::Statuses || offset % unit + len as u64 <= unit)
        });
        if !fits {
            return Err(self.lost(format!(
                "remote access error: {len} bytes at {:?}+{offset} are outside the region",
                remote.target
            )));
        }
        Ok(base + offset as usize)
    }

    /// Copies `src` into the region at `at` (inside one memory block: `locate` checked it).
    #[allow(unsafe_code)]
    fn copy_block(&self, at: usize, src: &[u8]) {
        // SAFETY: the sending thread writes a block only when its protocol machine chose it for
        // a write chain, i.e. the status cache showed it EMPTY, and a lent block is FULL in the
        // cache from the moment it is lent until its status byte is posted (`SenderMachine::
        // lend`): so no `LentRange` of this process covers a block copied into here, and the
        // sending thread is the only thread that copies.
        unsafe { self.mapping.copy_in(at, src) }
    }

    /// Stores status bytes, each with release ordering: everything this thread wrote into the
    /// region before (the block's bytes) is visible to whoever loads one with acquire.
    fn store_statuses(&self, at: usize, bytes: &[u8]) {
        for (k, &v) in bytes.iter().enumerate() {
            self.mapping.status(at + k).store(v, Ordering::Release);
        }
        self.ring();
    }

    /// Wakes the receiver's polling thread if it is waiting (or about to): the fence orders
    /// the status stores before the look at the word, as the receiver's fence orders its
    /// store of ASLEEP before its last look at the status bytes, so one of the two sees the
    /// other. While the receiver is busy the word stays AWAKE and this costs one load.
    fn ring(&self) {
        // The region has a doorbell word only when the status array leaves room for it.
        if self.status_at < STATUS_AT {
            return;
        }
        let bell = self.mapping.word(DOORBELL_AT);
        fence(Ordering::SeqCst);
        if bell.load(Ordering::Relaxed) != AWAKE && bell.swap(AWAKE, Ordering::Relaxed) != AWAKE {
            // A receiver that was asleep is woken onto a CPU of the kernel's choosing, often
            // this one, and would wait there until this thread's slice ends: in `gst-bench` at
            // 25 fps, videotestsrc went on to render its next frame (300-400 µs) while the
            // woken polling thread waited behind it (`perf sched timehist`). Yielding lets it
            // run first; with nothing else runnable here the yield returns at once. Only a
            // wake that found a sleeper yields, so a busy receiver costs nothing.
            if futex::wake(bell, futex::Flags::empty(), 1).unwrap_or(0) > 0 {
                std::thread::yield_now();
            }
        }
    }

    /// Reads the receiver's heartbeats and notices (at most every 50 ms), fails once the
    /// socket ended or was silent for the peer timeout, and sends this side's heartbeat when due.
    fn check_socket(&mut self) -> Result<()> {
        self.side_state
            .check(&mut self.side, self.peer_timeout)
            .map_err(|why| self.lost(why))
    }
}

impl Drop for ShmConnection {
    fn drop(&mut self) {
        let _ = self.side.shutdown(std::net::Shutdown::Both);
    }
}

impl Connection for ShmConnection {
    fn syncs_early(&self) -> bool {
        true
    }
    /// The cache budget takes the lowest-numbered block first whenever it limits anything.
    fn writes_lowest_first(&self) -> bool {
        false
    }
    fn completes_at_once(&self) -> bool {
        true
    }
    /// Covered by [`Connection::completes_at_once`].
    fn posts_here_when_idle(&self) -> bool {
        false
    }
    fn cache_budget(&self) -> Option<usize> {
        self.cache_budget
    }
    fn send_limits(&self, block_size: usize) -> rdmastream::transport::SendLimits {
        rdmastream::transport::SendLimits::within(self.cache_budget, block_size)
    }
    fn peer(&self) -> &str {
        &self.peer
    }

    fn layout(&self) -> RemoteLayout {
        self.layout
    }

    /// Applies the chain in order, as an RC queue pair places it: a block's bytes are copied
    /// into the receiver's block, then its status byte is stored with release ordering.
    fn post_write_chain(&mut self, wr_id: u64, chain: &[WriteWr<'_>]) -> Result<()> {
        let mut signaled = false;
        for wr in chain {
            let len = match wr.source {
                WriteSource::SendBlock { len, .. } => len,
                WriteSource::Inline(bytes) => bytes.len(),
            };
            let at = self.locate(wr.remote, len)?;
            match (wr.remote.target, wr.source) {
                (Target::Blocks, WriteSource::SendBlock { index, len }) => {
                    self.blocks.read(index, len, |src| self.copy_block(at, src))
                }
                (Target::Blocks, WriteSource::Inline(bytes)) => self.copy_block(at, bytes),
                (Target::Statuses, WriteSource::Inline(bytes)) => self.store_statuses(at, bytes),
                (Target::Statuses, WriteSource::SendBlock { index, len }) => {
                    self.blocks
                        .read(index, len, |src| self.store_statuses(at, src))
                }
            }
            signaled |= wr.signaled;
        }
        if signaled {
            self.done.push(Completion::Write { wr_id });
        }
        Ok(())
    }

    /// The sync: the status array, each byte loaded with acquire ordering. Only the status
    /// array may be read, as over RDMA.
    fn post_read(&mut self, wr_id: u64, remote: RemoteAddr, len: usize) -> Result<()> {
        if remote.target != Target::Statuses {
            return Err(self.lost("remote access error: memory blocks do not allow remote READ"));
        }
        let at = self.locate(remote, len)?;
        let data = (at..at + len)
            .map(|i| self.mapping.status(i).load(Ordering::Acquire))
            .collect();
        self.done.push(Completion::Read { wr_id, data });
        Ok(())
    }

    /// Work is done when it is posted: this returns what was posted since the last call.
    fn poll_completions(&mut self, out: &mut Vec<Completion>, _timeout: Duration) -> Result<()> {
        out.append(&mut self.done);
        Ok(())
    }

    fn heartbeat(&mut self) -> Result<()> {
        self.check_socket()
    }
    fn take_notices(&mut self) -> Vec<Notice> {
        self.side_state.take_notices()
    }

    /// The receiver's block `remote_block` itself, mapped here, for a source to write a whole
    /// block into in place.
    #[allow(unsafe_code)]
    fn lend_block(&self, remote_block: usize) -> Option<Box<dyn LeasedBlock>> {
        let b = self.layout.block_size;
        if remote_block >= self.layout.blocks {
            return None;
        }
        // SAFETY: the sending thread lends a block its protocol machine lent (`SenderMachine::
        // lend`): one its cache showed EMPTY, which so is EMPTY in the receiver's memory (only
        // the sender turns a 0 into anything else), and which stays FULL in the cache, so no
        // write chain copies into it, until it is given back or its status byte is posted —
        // after this lease is gone. Each lent block is lent once at a time. The receiver reads a
        // block only once its status byte is FULL and never writes one; a receiver that breaks
        // that can only change the bytes it is about to receive (its own memory).
        let range =
            unsafe { LentRange::new(self.mapping.clone(), self.blocks_at + remote_block * b, b) };
        Some(Box::new(LentBlock(range)))
    }
}

/// A receiver's memory block lent to a source on the sender (see [`Connection::lend_block`]).
struct LentBlock(LentRange);

impl LeasedBlock for LentBlock {
    fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.0.bytes_mut()
    }
}
