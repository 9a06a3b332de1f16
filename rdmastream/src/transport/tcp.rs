//! Software emulation of the one-sided data path over TCP, for machines without an RDMA NIC.
//!
//! After the handshake (u32 little-endian length + [`Hello`] / [`Welcome`] body), the same socket
//! carries operations, each a 24-byte header (layout in docs/protocol.md) plus data:
//! sender → receiver WRITE (with data) and READ; receiver → sender ACK (completion of a signaled
//! request), READ_RESP (with data) and ERROR (a remote access error, with text).
//!
//! On the receiver a transport thread per connection plays the NIC: it applies WRITEs to the
//! region in the order they were posted (a status byte is stored with release ordering after the
//! block bytes written before it), answers READs with acquire loads of the status bytes, and
//! acknowledges signaled requests after applying them. The receiver's own threads never touch
//! the socket.
//!
//! The sliding-window baseline adds two operations: WRITE_IMM (sender → receiver: a WRITE into
//! one ring block carrying a 32-bit immediate; the NIC thread checks it against the receiver's
//! window, places the data, consumes one of the receive requests the region keeps posted and
//! reports the receive completion) and SEND (receiver → sender: an ACK, which the sender's
//! completion thread places into one of the receive requests its ACK receiving thread posted and
//! queues on the ACK completion queue). A message that finds no receive request posted (RNR,
//! "receiver not ready") ends the connection with an error instead of waiting: both ends post a
//! receive per ring block before anything can arrive and post it again when it is consumed, so
//! an RNR can only come from a peer that broke the window, and a failure shows it where a wait
//! (an RC queue pair's RNR retries) would hide it. On the receiver an ACK is written to the
//! socket by whichever thread lets the block go, under the lock the NIC thread writes its
//! answers with, so the two never interleave.

use std::io::{BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;

use super::region::AckLink;
use super::{
    Accepted, AckQueue, Completion, Connection, Connector, Lease, Listener, MAX_NOTICE_TEXT,
    Notice, NoticeQueue, Refusal, RefusalKind, Region, RegionSettings, RemoteAddr, SendBlocks,
    SoftRegion, Target, WindowConnection, WorkCounter, WorkCounts, WriteSource, WriteWr,
};
use crate::error::{Error, Result, spawn};
use crate::logsafe;
use crate::proto::RemoteLayout;
use crate::proto::handshake::{
    AuthKind, Challenge, DataPath, Hello, Key, MAX_MESSAGE, PROOF_LEN, PROTOCOL_VERSION, Proof,
    Welcome, claimed_version,
};
use crate::proto::window::{ACK_LEN, Immediate};

const OP_WRITE: u8 = 1;
const OP_READ: u8 = 2;
const OP_ACK: u8 = 3;
const OP_READ_RESP: u8 = 4;
const OP_ERROR: u8 = 5;
/// Sender → receiver: nothing to do, answered with an ACK (the heartbeat of an idle link).
const OP_NOP: u8 = 6;
/// Sender → receiver: WRITE WITH IMMEDIATE (header, u32 immediate, data).
const OP_WRITE_IMM: u8 = 7;
/// Receiver → sender: SEND of a sliding-window ACK (header, 4 bytes).
const OP_SEND: u8 = 8;
/// The work request id of heartbeats (never a chain's or a sync's).
const NOP_WR_ID: u64 = u64::MAX;
/// Receiver → sender, unsolicited: a [`Notice`] about device `target`, its text (`len` bytes,
/// at most [`MAX_NOTICE_TEXT`]) after the header. Completes nothing.
const OP_NOTICE: u8 = 9;
const OP_HEADER: usize = 24;
/// How long a peer may take to complete the whole handshake (not each read).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy)]
struct OpHeader {
    op: u8,
    target: u8,
    signaled: bool,
    len: u32,
    offset: u64,
    wr_id: u64,
}

impl OpHeader {
    fn encode(&self) -> [u8; OP_HEADER] {
        let mut b = [0u8; OP_HEADER];
        b[0] = self.op;
        b[1] = self.target;
        b[2] = self.signaled as u8;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.offset.to_le_bytes());
        b[16..24].copy_from_slice(&self.wr_id.to_le_bytes());
        b
    }
    fn decode(b: &[u8; OP_HEADER]) -> OpHeader {
        OpHeader {
            op: b[0],
            target: b[1],
            signaled: b[2] != 0,
            len: u32::from_le_bytes(b[4..8].try_into().unwrap()),
            offset: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            wr_id: u64::from_le_bytes(b[16..24].try_into().unwrap()),
        }
    }
}

fn target_of(code: u8) -> Option<Target> {
    match code {
        0 => Some(Target::Blocks),
        1 => Some(Target::Statuses),
        _ => None,
    }
}

/// A stream a handshake runs on: the TCP side channel (tcp, verbs) or the Unix socket of the
/// shm transport.
pub trait SideStream: Read + Write {
    /// As [`TcpStream::set_read_timeout`].
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()>;
    /// Ends the connection both ways (errors ignored: it may be gone already).
    fn shutdown_both(&self);
    /// Who is on the other end, for messages.
    fn peer_name(&self) -> String;
    /// Per-socket tuning before the handshake (TCP: no Nagle delay).
    fn tune(&self) {}
}

impl SideStream for TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
    fn shutdown_both(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
    fn peer_name(&self) -> String {
        self.peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "unknown peer".into())
    }
    fn tune(&self) {
        let _ = self.set_nodelay(true);
    }
}

impl SideStream for UnixStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        UnixStream::set_read_timeout(self, timeout)
    }
    fn shutdown_both(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
    /// A connecting Unix socket has no name of its own: the socket path it came in on (or went
    /// out to) is what tells one receiver's peers from another's.
    fn peer_name(&self) -> String {
        let named = |a: std::os::unix::net::SocketAddr| {
            a.as_pathname().map(|p| format!("unix:{}", p.display()))
        };
        self.peer_addr()
            .ok()
            .and_then(named)
            .or_else(|| self.local_addr().ok().and_then(named))
            .unwrap_or_else(|| "unix peer".into())
    }
}

/// Writes one length-prefixed handshake message.
pub fn send_message<S: Write>(stream: &mut S, body: &[u8]) -> std::io::Result<()> {
    let mut framed = Vec::with_capacity(4 + body.len());
    framed.extend_from_slice(&(body.len() as u32).to_le_bytes());
    framed.extend_from_slice(body);
    stream.write_all(&framed)
}

/// Reads exactly `buf.len()` bytes, giving up at `deadline`: the read timeout is set to what is
/// left before every read, so a peer that trickles one byte every few seconds cannot stretch a
/// handshake past its deadline.
fn read_until<S: SideStream>(
    stream: &mut S,
    buf: &mut [u8],
    deadline: Instant,
) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "handshake deadline passed",
            ));
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "handshake deadline passed",
                ));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Why a handshake message could not be read: the reason (for the log, and for the peer in a
/// refusal), and whether the peer closed the connection before the whole message came.
#[derive(Debug)]
pub struct RecvError {
    pub why: String,
    pub hung_up: bool,
}

impl std::fmt::Display for RecvError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.why)
    }
}

impl RecvError {
    fn io(e: &std::io::Error, why: String) -> RecvError {
        RecvError {
            why,
            hung_up: e.kind() == std::io::ErrorKind::UnexpectedEof,
        }
    }
}

/// Reads one length-prefixed handshake message (bounded by [`MAX_MESSAGE`]) before `deadline`.
pub fn recv_message<S: SideStream>(
    stream: &mut S,
    deadline: Instant,
) -> std::result::Result<Vec<u8>, RecvError> {
    // The hints name the likely cause for whoever reads the log: a peer at this address that
    // is not an rdmastream sender or receiver (an HTTP or SSH server, a port scanner). Its bytes
    // are quoted escaped: they are the peer's.
    const NOT_OURS: &str = "is the peer an rdmastream sender or receiver?";
    let mut first = [0u8; 4];
    read_until(stream, &mut first, deadline).map_err(|e| {
        let why = if e.kind() == std::io::ErrorKind::TimedOut {
            format!("reading message length: {e} (no handshake message in time: {NOT_OURS})")
        } else {
            format!("reading message length: {e}")
        };
        RecvError::io(&e, why)
    })?;
    let len = u32::from_le_bytes(first) as usize;
    if len > MAX_MESSAGE {
        return Err(RecvError {
            why: format!(
                "message of {len} bytes is over the {MAX_MESSAGE}-byte limit (its first bytes, \
                 {:?}, are no rdmastream handshake: {NOT_OURS})",
                String::from_utf8_lossy(&first)
            ),
            hung_up: false,
        });
    }
    let mut body = vec![0u8; len];
    read_until(stream, &mut body, deadline)
        .map_err(|e| RecvError::io(&e, format!("reading {len}-byte message: {e}")))?;
    Ok(body)
}

/// Fresh random bytes from the operating system (nonces, session ids).
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    // The OS random source does not fail on Linux once booted; if it ever did, a handshake with
    // a predictable nonce must not happen.
    getrandom::fill(&mut b).expect("the operating system's random source failed");
    b
}

/// The sender's half of the handshake on a new side-channel connection to `peer`: Hello,
/// Challenge, Proof, Welcome (see [`crate::proto::handshake`]). Returns the stream (read timeout
/// cleared) and the receiver's Welcome, whose values the decoder has already bounded. A refusal
/// is [`Error::Refused`] with the receiver's reason (escaped: it is the peer's text); a receiver
/// that asks for a key this sender lacks, or that cannot prove it knows this sender's key, is
/// [`Error::Auth`].
///
/// Public for tools and tests that speak the tcp data path themselves (with `hello.data_path`
/// set to [`DataPath::Tcp`], the stream then carries operations as docs/protocol.md lays out).
pub fn client_handshake(
    peer: &str,
    hello: &Hello,
    key: Option<&Key>,
) -> Result<(TcpStream, Welcome)> {
    let connect_err = |source| Error::Connect {
        peer: peer.to_string(),
        source,
    };
    let sock = resolve(peer).map_err(connect_err)?;
    let mut stream =
        TcpStream::connect_timeout(&sock, Duration::from_secs(3)).map_err(connect_err)?;
    stream.set_nodelay(true).map_err(connect_err)?;
    let welcome = client_handshake_on(&mut stream, peer, hello, key)?;
    Ok((stream, welcome))
}

/// [`client_handshake`] on a stream already connected to `peer` (the shm transport's Unix
/// socket). The read timeout is cleared when it returns `Ok`.
pub fn client_handshake_on<S: SideStream>(
    stream: &mut S,
    peer: &str,
    hello: &Hello,
    key: Option<&Key>,
) -> Result<Welcome> {
    let hs_err = |reason: String| Error::Handshake {
        peer: peer.to_string(),
        reason,
    };
    let auth_err = |reason: String| Error::Auth {
        peer: peer.to_string(),
        reason,
    };
    let refused = |w: Welcome| Error::Refused {
        peer: peer.to_string(),
        reason: logsafe::clean(&w.error, logsafe::MAX_PEER_TEXT),
    };
    let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    let hello = Hello {
        nonce: random_bytes(),
        ..hello.clone()
    };
    let hello_bytes = hello.encode();
    send_message(stream, &hello_bytes).map_err(|e| hs_err(format!("sending hello: {e}")))?;
    let body = recv_message(stream, deadline).map_err(|e| hs_err(e.why))?;
    if let Ok(w) = Welcome::decode(&body) {
        return Err(if w.error.is_empty() {
            hs_err("welcome before the challenge".into())
        } else {
            refused(w)
        });
    }
    let challenge = Challenge::decode(&body).map_err(|e| hs_err(format!("bad challenge: {e}")))?;
    let mac = match (challenge.auth, key) {
        (AuthKind::HmacSha256, Some(k)) => k.sender_proof(&hello_bytes, &body),
        (AuthKind::HmacSha256, None) => {
            return Err(auth_err(format!(
                "the receiver requires a key for sender '{}': set `key_file` (or `key`)",
                hello.sender
            )));
        }
        (AuthKind::None, Some(_)) => {
            return Err(auth_err(format!(
                "the receiver does not authenticate (it has no key for sender '{}'), so it \
                 cannot prove it is the receiver this sender's key is for; refusing to stream to it",
                hello.sender
            )));
        }
        (AuthKind::None, None) => [0; PROOF_LEN],
    };
    let proof = Proof {
        version: PROTOCOL_VERSION,
        mac,
    };
    send_message(stream, &proof.encode()).map_err(|e| hs_err(format!("sending proof: {e}")))?;
    let welcome_bytes = recv_message(stream, deadline).map_err(|e| hs_err(e.why))?;
    let welcome =
        Welcome::decode(&welcome_bytes).map_err(|e| hs_err(format!("bad welcome: {e}")))?;
    if !welcome.error.is_empty() {
        return Err(refused(welcome));
    }
    if let Some(k) = key
        && !k.check_welcome(&hello_bytes, &body, &welcome)
    {
        return Err(auth_err(
            "the receiver could not prove it knows this sender's key; refusing to stream to it"
                .into(),
        ));
    }
    stream
        .set_read_timeout(None)
        .map_err(|e| hs_err(e.to_string()))?;
    Ok(welcome)
}

/// Refuses a connection: logs why with the peer (rate-limited), answers with a refusal, closes.
pub fn refuse<S: SideStream>(
    stream: &mut S,
    peer: &str,
    kind: RefusalKind,
    why: String,
) -> Refusal {
    crate::warn_limited!(
        format!("refused-{kind}"),
        "refused connection from {peer} ({kind}): {}",
        logsafe::clean(&why, logsafe::MAX_PEER_TEXT)
    );
    // Over before the answer goes out: a sender that reconnects the moment it reads it must
    // not find its address's handshake slots still held by this one.
    Slot::release_current();
    let _ = send_message(stream, &Welcome::refusal(why.clone()).encode());
    stream.shutdown_both();
    Refusal {
        peer: peer.to_string(),
        why,
        kind,
    }
}

/// A sender that went away after it was admitted, before the handshake completed.
pub fn lost(peer: &str, sender: &str, e: impl std::fmt::Display) -> Refusal {
    let why = format!("sender '{sender}' closed the connection during the handshake: {e}");
    crate::warn_limited!("refused-lost", "{peer}: {why}");
    Refusal {
        peer: peer.to_string(),
        why,
        kind: RefusalKind::Lost,
    }
}

/// What a receiver's handshake produced: the sender, where it is, its hold on its name, and
/// whatever the transport built for it.
pub struct Admitted<T> {
    pub hello: Hello,
    pub peer: String,
    pub lease: Lease,
    pub built: T,
}

/// The receiver's half of the handshake, for every transport that starts on a TCP side channel:
/// reads and validates the Hello (format, version, data path), challenges the sender, checks its
/// proof, admits it (name, sender cap), and only then calls `build` to allocate what the
/// transport needs and produce the Welcome, which it proves and sends. The whole exchange must
/// finish within [`HANDSHAKE_TIMEOUT`]. On any problem the connection is refused and the refusal
/// returned; nothing is allocated before the sender proved its key.
pub fn server_handshake<T, S: SideStream>(
    stream: &mut S,
    settings: &RegionSettings,
    path: DataPath,
    wrong_path: &str,
    build: impl FnOnce(&Hello, &Lease) -> std::result::Result<(Welcome, T), (RefusalKind, String)>,
) -> std::result::Result<Admitted<T>, Refusal> {
    let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    let peer = stream.peer_name();
    stream.tune();
    let hello_bytes = match recv_message(stream, deadline) {
        Ok(b) => b,
        Err(e) => {
            // A peer that hangs up before its first message is most often not a sender at
            // all: a port probe, or a second receiver checking whether this address is taken.
            let hint = if e.hung_up {
                " (the peer hung up before its first message: a port probe, or another \
                 receiver checking whether this address is in use?)"
            } else {
                ""
            };
            return Err(refuse(
                stream,
                &peer,
                RefusalKind::BadHandshake,
                format!("bad handshake: {e}{hint}"),
            ));
        }
    };
    let hello = match Hello::decode(&hello_bytes) {
        Ok(h) => h,
        Err(e) => {
            if let Some(v) = claimed_version(&hello_bytes).filter(|&v| v < PROTOCOL_VERSION) {
                // An older sender: answer in the layout it reads, so its user sees why.
                let why = format!(
                    "protocol version {v} is not supported: this receiver speaks version \
                     {PROTOCOL_VERSION}; upgrade the sender"
                );
                crate::warn_limited!("refused-version", "refused connection from {peer}: {why}");
                let _ = send_message(stream, &Welcome::encode_old_refusal(v, &why));
                stream.shutdown_both();
                return Err(Refusal {
                    peer,
                    why,
                    kind: RefusalKind::Version,
                });
            }
            let kind = if matches!(e, crate::proto::handshake::HandshakeError::BadVersion(_)) {
                RefusalKind::Version
            } else {
                RefusalKind::BadHandshake
            };
            return Err(refuse(stream, &peer, kind, format!("bad handshake: {e}")));
        }
    };
    if hello.data_path != path {
        return Err(refuse(
            stream,
            &peer,
            RefusalKind::WrongTransport,
            wrong_path.to_string(),
        ));
    }
    let keys = settings.access.keys();
    let challenge = Challenge {
        version: PROTOCOL_VERSION,
        auth: if keys.is_anonymous() {
            AuthKind::None
        } else {
            AuthKind::HmacSha256
        },
        nonce: random_bytes(),
    };
    let challenge_bytes = challenge.encode();
    if let Err(e) = send_message(stream, &challenge_bytes) {
        return Err(lost(&peer, &hello.sender, e));
    }
    let bad_proof =
        |e: &dyn std::fmt::Display| format!("sender '{}': bad proof: {e}", hello.sender);
    let proof = recv_message(stream, deadline)
        .map_err(|e| {
            // A sender without a key hangs up when the challenge asks for one (it says so on
            // its side); say so here too, for whoever reads this receiver's log.
            if e.hung_up && !keys.is_anonymous() {
                format!(
                    "sender '{}' hung up at the key challenge (no key on its side?): {e}",
                    hello.sender
                )
            } else {
                bad_proof(&e)
            }
        })
        .and_then(|b| Proof::decode(&b).map_err(|e| bad_proof(&e)));
    let proof = match proof {
        Ok(p) => p,
        Err(why) => return Err(refuse(stream, &peer, RefusalKind::BadHandshake, why)),
    };
    let key = if keys.is_anonymous() {
        None
    } else {
        // A name without a key fails exactly like a wrong key: no telling which names exist.
        match keys.key_for(&hello.sender) {
            Some(k) if k.check_sender_proof(&hello_bytes, &challenge_bytes, &proof.mac) => {
                Some(k.clone())
            }
            _ => {
                return Err(refuse(
                    stream,
                    &peer,
                    RefusalKind::Authentication,
                    format!(
                        "sender '{}': authentication failed (wrong or missing key, or a replayed handshake)",
                        hello.sender
                    ),
                ));
            }
        }
    };
    let lease = match settings.admit(&hello, &peer) {
        Ok(l) => l,
        Err((kind, why)) => return Err(refuse(stream, &peer, kind, why)),
    };
    let (mut welcome, built) = match build(&hello, &lease) {
        Ok(b) => b,
        Err((kind, why)) => {
            return Err(refuse(
                stream,
                &peer,
                kind,
                format!("sender '{}': {why}", hello.sender),
            ));
        }
    };
    if let Some(k) = &key {
        k.prove_welcome(&hello_bytes, &challenge_bytes, &mut welcome);
    }
    // Admitted: from here the sender counts against `max_senders`, not the handshake limits, so
    // its slot is given back before the welcome goes out (as a refusal's is).
    Slot::release_current();
    if let Err(e) = send_message(stream, &welcome.encode()) {
        return Err(lost(&peer, &hello.sender, e));
    }
    if let Err(e) = stream.set_read_timeout(None) {
        return Err(lost(&peer, &hello.sender, e));
    }
    Ok(Admitted {
        hello,
        peer,
        lease,
        built,
    })
}

pub fn resolve(addr: &str) -> std::io::Result<SocketAddr> {
    addr.to_socket_addrs()?.next().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::NotFound, "address resolves to nothing")
    })
}

/// Connects senders to a receiver over TCP.
pub struct TcpConnector {
    addr: String,
    peer_timeout: Duration,
}

impl TcpConnector {
    /// A connector to `host:port`.
    pub fn new(addr: impl Into<String>) -> TcpConnector {
        TcpConnector {
            addr: addr.into(),
            peer_timeout: super::DEFAULT_PEER_TIMEOUT,
        }
    }

    /// Gives a connection up when the receiver has not answered for `timeout` (heartbeats
    /// go out at a fifth of it when the link is idle).
    pub fn with_peer_timeout(mut self, timeout: Duration) -> TcpConnector {
        self.peer_timeout = timeout;
        self
    }
}

impl Connector for TcpConnector {
    fn transport(&self) -> &'static str {
        "tcp"
    }
    /// The receiver's transport thread applies a WRITE only from the whole of its data, in
    /// stream order, so the status WRITE after it lands after every byte of the block.
    fn placement(&self) -> crate::proto::Placement {
        crate::proto::Placement::Ordered
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
        let hello = Hello {
            mechanism: crate::proto::handshake::Mechanism::StatusByte,
            ..hello.clone()
        };
        Ok(Box::new(self.open(&hello, key, blocks, None)?))
    }

    fn connect_window(
        &self,
        hello: &Hello,
        key: Option<&Key>,
        blocks: &Arc<SendBlocks>,
    ) -> Result<Box<dyn WindowConnection>> {
        let (acks_tx, acks_rx) = crossbeam_channel::unbounded();
        let route = AckRoute {
            posted: Arc::new(AtomicUsize::new(0)),
            counts: Arc::new(WorkCounter::new(2)),
            acks: acks_tx,
        };
        let (posted, counts) = (route.posted.clone(), route.counts.clone());
        let inner = self.open(hello, key, blocks, Some(route))?;
        if let Err(why) = crate::proto::window::check_ring(inner.layout) {
            return Err(Error::Handshake {
                peer: inner.peer.clone(),
                reason: why,
            });
        }
        let mut ack_queue = TcpAckQueue {
            peer: inner.peer.clone(),
            posted,
            counts: counts.clone(),
            acks: acks_rx,
        };
        // RmInit: a receive request per ring block before the first write, so an ACK never
        // finds none (the ACK receiving thread posts each consumed one again).
        ack_queue.post_recv(inner.layout.blocks)?;
        Ok(Box::new(TcpWindowConnection {
            ack_queue: Some(Box::new(ack_queue)),
            counts,
            inner,
        }))
    }
}

/// Where a sliding-window connection's completion thread puts the ACKs it receives.
struct AckRoute {
    /// ACK receive requests posted and not consumed.
    posted: Arc<AtomicUsize>,
    /// The sender side's counts (send and ACK completion queues).
    counts: Arc<WorkCounter>,
    /// The ACK completion queue ([`TcpAckQueue`] holds its other end).
    acks: Sender<Immediate>,
}

impl TcpConnector {
    /// Handshakes and starts the completion thread: the shared part of a status-byte and a
    /// sliding-window connection (`acks` set for the latter).
    fn open(
        &self,
        hello: &Hello,
        key: Option<&Key>,
        blocks: &Arc<SendBlocks>,
        acks: Option<AckRoute>,
    ) -> Result<TcpConnection> {
        let peer = self.addr.clone();
        let hello = Hello {
            data_path: DataPath::Tcp,
            ..hello.clone()
        };
        let (stream, welcome) = client_handshake(&peer, &hello, key)?;
        let connect_err = |source| Error::Connect {
            peer: peer.clone(),
            source,
        };
        let layout = RemoteLayout {
            blocks: welcome.blocks as usize,
            block_size: welcome.block_size as usize,
        };
        let expected_read = Arc::new(AtomicUsize::new(NO_READ));
        let reader = stream.try_clone().map_err(connect_err)?;
        let started = Instant::now();
        let heard = Arc::new(AtomicU64::new(0));
        let notices = NoticeQueue::default();
        let (expected, reader_peer, reader_heard, reader_notices) = (
            expected_read.clone(),
            peer.clone(),
            heard.clone(),
            notices.clone(),
        );
        let counts = match &acks {
            Some(route) => route.counts.clone(),
            None => Arc::new(WorkCounter::new(1)),
        };
        // Bounded: a receiver that floods acknowledgements is read no faster than the sending
        // thread takes them.
        let (tx, rx) = crossbeam_channel::bounded(COMPLETION_QUEUE);
        spawn(format!("tcp-completions-{peer}"), move || {
            completion_reader(
                reader,
                reader_peer,
                tx,
                expected,
                (started, reader_heard),
                reader_notices,
                acks,
            )
        })?;
        // A write that cannot get out for a whole peer timeout (the link is down, the receiver
        // stopped reading) fails the connection instead of blocking the sending thread, so a
        // stop or a reconnect is never held up by a dead link.
        stream
            .set_write_timeout(Some(self.peer_timeout))
            .map_err(|e| Error::Disconnected {
                peer: peer.clone(),
                reason: e.to_string(),
            })?;
        Ok(TcpConnection {
            peer,
            layout,
            stream,
            pending: Vec::with_capacity(2 * SMALL_WRITE),
            deferred: Vec::with_capacity(MAX_DEFERRED),
            written: 0,
            blocks: blocks.clone(),
            completions: rx,
            expected_read,
            started,
            heard,
            nop_sent: started,
            peer_timeout: self.peer_timeout,
            notices,
            counts,
            unsignaled: 0,
            posted: std::collections::VecDeque::new(),
            acks: WireAcks::default(),
        })
    }
}

/// Completions queued between the reading thread and the sending thread at most.
const COMPLETION_QUEUE: usize = 4096;
/// `expected_read` when no READ is outstanding.
const NO_READ: usize = usize::MAX;

enum Event {
    Done(Completion),
    Failed(String),
}

/// What [`read_answer`] needs besides the socket: the connection's shared state.
struct AnswerCtx<'a> {
    peer: &'a str,
    /// Length of the READ outstanding ([`NO_READ`]: none).
    expected_read: &'a AtomicUsize,
    started: Instant,
    heard: &'a AtomicU64,
    notices: &'a NoticeQueue,
    /// A sliding-window connection's ACK route.
    acks: Option<&'a AckRoute>,
}

/// Reads one of the receiver's answers. Nothing the receiver says is trusted: a READ response
/// must be exactly as long as the READ that is outstanding, error texts are cut and escaped, and
/// any other operation ends the connection. Returns the event for the sending thread (a
/// completion, or the failure that ends the connection), or `None` for an answer handled here
/// (a heartbeat's ACK, a notice, a sliding-window ACK).
fn read_answer<R: Read>(r: &mut BufReader<R>, cx: &AnswerCtx<'_>) -> Option<Event> {
    let peer = cx.peer;
    let fail = |why: String| Some(Event::Failed(why));
    let mut hb = [0u8; OP_HEADER];
    if let Err(e) = r.read_exact(&mut hb) {
        return fail(format!("receiver closed the connection ({e})"));
    }
    cx.heard
        .store(cx.started.elapsed().as_millis() as u64, Ordering::Release);
    let h = OpHeader::decode(&hb);
    match h.op {
        // The answer to a heartbeat: the receiver is alive; nothing completes.
        OP_ACK if h.wr_id == NOP_WR_ID => None,
        OP_ACK => Some(Event::Done(Completion::Write { wr_id: h.wr_id })),
        OP_READ_RESP => {
            let want = cx.expected_read.swap(NO_READ, Ordering::AcqRel);
            if want == NO_READ || h.len as usize != want {
                return fail(format!(
                    "protocol error from {peer}: a READ response of {} bytes where {} were asked for",
                    h.len,
                    if want == NO_READ {
                        "none".to_string()
                    } else {
                        want.to_string()
                    }
                ));
            }
            let mut data = vec![0u8; want];
            if let Err(e) = r.read_exact(&mut data) {
                return fail(format!("reading READ response: {e}"));
            }
            Some(Event::Done(Completion::Read {
                wr_id: h.wr_id,
                data,
            }))
        }
        OP_NOTICE => {
            if h.len as usize > MAX_NOTICE_TEXT {
                return fail(format!(
                    "protocol error from {peer}: a notice of {} bytes (at most {MAX_NOTICE_TEXT})",
                    h.len
                ));
            }
            let mut text = vec![0u8; h.len as usize];
            if let Err(e) = r.read_exact(&mut text) {
                return fail(format!("reading a notice: {e}"));
            }
            cx.notices.push(Notice::from_peer(h.target, &text));
            None
        }
        OP_SEND => {
            let Some(AckRoute {
                posted,
                counts,
                acks,
            }) = cx.acks
            else {
                return fail(format!(
                    "protocol error from {peer}: a SEND on a status-byte connection"
                ));
            };
            if h.len as usize != ACK_LEN {
                return fail(format!(
                    "protocol error from {peer}: a SEND of {} bytes",
                    h.len
                ));
            }
            let mut ack = [0u8; ACK_LEN];
            if let Err(e) = r.read_exact(&mut ack) {
                return fail(format!("reading SEND: {e}"));
            }
            // Consume one posted receive request, or fail: receiver not ready (RNR).
            if posted
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .is_err()
            {
                return fail(format!(
                    "RNR: an ACK from {peer} found no receive request posted (the \
                     receiver acknowledged more blocks than the window holds)"
                ));
            }
            counts.consume_recv();
            counts.completion();
            match Immediate::from_ack(&ack) {
                Ok(imm) => match acks.send(imm) {
                    Ok(()) => None,
                    Err(_) => fail("the ACK completion queue is gone".into()),
                },
                Err(e) => fail(format!("protocol error from {peer}: {e}")),
            }
        }
        OP_ERROR => {
            let mut text = vec![0u8; (h.len as usize).min(4096)];
            let _ = r.read_exact(&mut text);
            fail(format!(
                "remote access error: {}",
                logsafe::clean_bytes(&text, logsafe::MAX_PEER_TEXT)
            ))
        }
        other => fail(format!(
            "protocol error from {peer}: unknown operation {other}"
        )),
    }
}

/// A connection's completion thread: reads the receiver's answers and hands the completions to
/// the sending thread (a sliding-window connection's ACKs go on its ACK completion queue, which
/// another thread of the sender waits on), until the connection ends.
fn completion_reader(
    stream: TcpStream,
    peer: String,
    tx: Sender<Event>,
    expected_read: Arc<AtomicUsize>,
    (started, heard): (Instant, Arc<AtomicU64>),
    notices: NoticeQueue,
    acks: Option<AckRoute>,
) {
    let mut r = BufReader::with_capacity(ANSWER_BUFFER, stream);
    let cx = AnswerCtx {
        peer: &peer,
        expected_read: &expected_read,
        started,
        heard: &heard,
        notices: &notices,
        acks: acks.as_ref(),
    };
    loop {
        let Some(ev) = read_answer(&mut r, &cx) else {
            continue;
        };
        let end = matches!(ev, Event::Failed(_));
        if tx.send(ev).is_err() || end {
            return;
        }
    }
}

/// Bytes of the receiver's answers read at once.
const ANSWER_BUFFER: usize = 16 * 1024;

/// The sender's end of a TCP-emulated connection.
pub struct TcpConnection {
    peer: String,
    layout: RemoteLayout,
    stream: TcpStream,
    /// Operation headers and small data not yet written.
    pending: Vec<u8>,
    /// Send blocks' data that goes out at `pending[at]` on the next flush, in order.
    deferred: Vec<Deferred>,
    /// Bytes of what `pending` and `deferred` make up that a flush which could not wait
    /// already wrote ([`TcpConnection::flush_with`]); 0 when nothing was.
    written: usize,
    blocks: Arc<SendBlocks>,
    completions: Receiver<Event>,
    /// Length of the READ outstanding (`NO_READ`: none), for the completion reader's check.
    expected_read: Arc<AtomicUsize>,
    /// When the receiver was last heard from (ms since `started`), and when the last
    /// heartbeat went out.
    started: Instant,
    heard: Arc<AtomicU64>,
    nop_sent: Instant,
    peer_timeout: Duration,
    /// Notices the completion reader received.
    notices: NoticeQueue,
    /// Work requests posted and completed, and the queue depths used.
    counts: Arc<WorkCounter>,
    /// Unsignaled work requests posted since the last signaled one (they complete with it).
    unsignaled: u64,
    /// Signaled work requests in posting order, with how many queue entries each completes.
    posted: std::collections::VecDeque<(u64, u64)>,
    /// Which signaled requests the receiver acknowledges on the wire.
    acks: WireAcks,
}

/// A write chain's status WRITE is acknowledged on the wire only every [`ACK_EVERY`] chains:
/// the receiver's NIC thread answers requests in order, so one ACK completes the chains posted
/// before it too, and the sending connection reports each of them complete when it comes (the
/// sender's machine still sees one completion per chain, in posting order). An ACK is a small
/// message back through the loopback and a wake-up of the completion thread and the sending
/// thread; one per block cost about a fifth of the transport's CPU at 64 KiB blocks.
const ACK_EVERY: usize = 4;

/// The signaled requests of a [`TcpConnection`] not yet complete, in posting order, and which of
/// them the receiver acknowledges on the wire.
#[derive(Default)]
struct WireAcks {
    /// `(wr_id, acknowledged on the wire)`.
    waiting: std::collections::VecDeque<(u64, bool)>,
    /// Chains posted since the last request acknowledged on the wire, not acknowledged
    /// themselves: their acknowledgement rides on a later one.
    riding: usize,
    /// Requests acknowledged on the wire whose answer has not come.
    on_wire: usize,
}

impl WireAcks {
    /// Registers signaled request `wr_id`; whether the receiver is to acknowledge it (a chain
    /// whose acknowledgement may ride on a later one is `deferrable`).
    fn post(&mut self, wr_id: u64, deferrable: bool) -> bool {
        let wire = !deferrable || self.riding + 1 >= ACK_EVERY;
        if wire {
            self.riding = 0;
            self.on_wire += 1;
        } else {
            self.riding += 1;
        }
        self.waiting.push_back((wr_id, wire));
        wire
    }

    /// When chains wait for an acknowledgement that nothing on the wire will bring (no
    /// acknowledged request is outstanding), the last of them, for the NOP that asks for it.
    fn ask(&mut self) -> Option<u64> {
        if self.riding == 0 || self.on_wire > 0 {
            return None;
        }
        let last = self.waiting.back_mut()?;
        last.1 = true;
        self.riding = 0;
        self.on_wire = 1;
        Some(last.0)
    }

    /// The receiver answered `wr_id`: the requests posted before it complete first, in order
    /// (passed to `done`). An answer for anything but the next request acknowledged on the wire
    /// is a protocol error: the NIC answers in posting order.
    fn answered(
        &mut self,
        wr_id: u64,
        mut done: impl FnMut(u64),
    ) -> std::result::Result<(), String> {
        match self.waiting.iter().find(|(_, wire)| *wire) {
            Some(&(next, _)) if next == wr_id => {}
            Some(&(next, _)) => {
                return Err(format!(
                    "an answer to request {wr_id} where {next} was next"
                ));
            }
            None => {
                return Err(format!(
                    "an answer to request {wr_id}, which is not waiting"
                ));
            }
        }
        while let Some((id, wire)) = self.waiting.pop_front() {
            if wire {
                self.on_wire -= 1;
                return Ok(());
            }
            done(id);
        }
        Ok(())
    }

    /// The completions an answer `c` brings, in order, onto `out`: the requests posted before
    /// it that rode on it ([`WireAcks::answered`]), then `c` itself.
    fn complete(
        &mut self,
        c: Completion,
        out: &mut Vec<Completion>,
    ) -> std::result::Result<(), String> {
        self.answered(c.wr_id(), |wr_id| out.push(Completion::Write { wr_id }))?;
        out.push(c);
        Ok(())
    }
}

impl TcpConnection {
    /// Counts `n` work requests posted, the last signaled with `wr_id` when `signaled`.
    fn count_post(&mut self, wr_id: u64, n: u64, signaled: bool) {
        self.counts.post_send(n);
        if signaled {
            self.posted.push_back((wr_id, self.unsignaled + n));
            self.unsignaled = 0;
        } else {
            self.unsignaled += n;
        }
    }

    /// Counts the completion of `wr_id`: it and every request posted before it are done
    /// (completions of one queue pair come in posting order).
    fn count_completion(&mut self, wr_id: u64) {
        self.counts.completion();
        while let Some((id, n)) = self.posted.pop_front() {
            self.counts.complete_send(n);
            if id == wr_id {
                break;
            }
        }
    }

    /// Queues one operation: its header, `extra` bytes, then the bytes of `source`.
    fn push_op(&mut self, h: OpHeader, extra: &[u8], source: WriteSource<'_>) -> Result<()> {
        if let WriteSource::SendBlock { len, .. } = source
            && len >= SMALL_WRITE
            && !gathers(&self.deferred, len)
        {
            self.flush()?;
        }
        self.pending.extend_from_slice(&h.encode());
        self.pending.extend_from_slice(extra);
        match source {
            // Large data is not copied: it goes out in one writev with what is queued around
            // it (the chain's status byte, the chains posted with it), straight from the send
            // block.
            WriteSource::SendBlock { index, len } if len >= SMALL_WRITE => {
                self.deferred.push(Deferred {
                    at: self.pending.len(),
                    index,
                    len,
                });
            }
            WriteSource::SendBlock { index, len } => {
                self.blocks
                    .read(index, len, |b| self.pending.extend_from_slice(b));
            }
            WriteSource::Inline(b) => self.pending.extend_from_slice(b),
        }
        let behind = self.deferred.last().map_or(0, |d| d.at);
        if self.pending.len() - behind >= SMALL_WRITE {
            self.flush()?;
        }
        Ok(())
    }

    /// Queues a NOP, which the receiver answers with an ACK of `wr_id`: a heartbeat
    /// ([`NOP_WR_ID`]), or the request for the acknowledgement of chains ([`WireAcks::ask`]).
    fn queue_nop(&mut self, wr_id: u64) {
        let h = OpHeader {
            op: OP_NOP,
            target: 0,
            signaled: true,
            len: 0,
            offset: 0,
            wr_id,
        };
        self.pending.extend_from_slice(&h.encode());
    }

    fn lost(&self, reason: impl std::fmt::Display) -> Error {
        Error::Disconnected {
            peer: self.peer.clone(),
            reason: reason.to_string(),
        }
    }

    /// Writes what is queued, the deferred send blocks' data in their places, in one writev
    /// when the socket takes it all. With `wait` false only what the socket takes at once
    /// (`MSG_DONTWAIT`): the rest stays queued, [`TcpConnection::written`] bytes on, for the
    /// next flush, which a poll that may wait makes (a thread handing a block over posts on an
    /// idle link and must not be held up by the network; docs/protocol.md, "Who drives the
    /// connection").
    fn flush_with(&mut self, wait: bool) -> Result<()> {
        if self.pending.is_empty() && self.deferred.is_empty() {
            return Ok(());
        }
        let (pending, stream, skip) = (&self.pending, &self.stream, self.written);
        let r = if self.deferred.is_empty() {
            // Only small operations (status bytes, READs, NOPs): no block to gather.
            write_slices(stream, &mut [std::io::IoSlice::new(pending)], skip, wait)
        } else {
            with_blocks(&self.blocks, &self.deferred, &[], &mut |data| {
                let mut slices = Vec::with_capacity(2 * data.len() + 1);
                let mut from = 0;
                for (d, b) in self.deferred.iter().zip(data) {
                    slices.push(std::io::IoSlice::new(&pending[from..d.at]));
                    slices.push(std::io::IoSlice::new(b));
                    from = d.at;
                }
                slices.push(std::io::IoSlice::new(&pending[from..]));
                write_slices(stream, &mut slices, skip, wait)
            })
        };
        match r {
            Ok(Written::Partly(n)) => {
                self.written = n;
                Ok(())
            }
            done => {
                self.pending.clear();
                self.deferred.clear();
                self.written = 0;
                done.map(|_| ())
                    .map_err(|e| self.lost(format!("sending: {e}")))
            }
        }
    }

    /// Writes everything queued, waiting for the socket as long as it takes (up to the write
    /// timeout, the peer timeout).
    fn flush(&mut self) -> Result<()> {
        self.flush_with(true)
    }

    fn handle(&mut self, event: Event, out: &mut Vec<Completion>) -> Result<()> {
        match event {
            Event::Done(c) => self
                .acks
                .complete(c, out)
                .map_err(|e| self.lost(format!("protocol error from {}: {e}", self.peer))),
            Event::Failed(why) => Err(self.lost(why)),
        }
    }
}

impl Drop for TcpConnection {
    fn drop(&mut self) {
        let _ = self.flush();
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

/// Data at least this large is written straight from the send block instead of being batched.
const SMALL_WRITE: usize = 16 * 1024;

/// Chains whose block data one flush writes at most.
const MAX_DEFERRED: usize = 8;

/// Block data one flush gathers at most (unless a single block is larger): what a loopback
/// socket's send buffer holds at most by default (`tcp_wmem`'s 4 MiB). A writev holds every send
/// block in it until its last byte is taken, and past what the socket holds it saves no system
/// call, only sleeps inside one: eight 4 MiB blocks in one writev kept the filling side waiting
/// for 32 MiB to drain, then refilling eight blocks while the link ran dry (docs/benchmarks.md,
/// "Gathering at most 4 MiB per `writev`").
const MAX_GATHER: usize = 4 << 20;

/// Whether a send block of `len` bytes joins the blocks already `deferred` in the next flush,
/// instead of that flush going first: while fewer than [`MAX_DEFERRED`] wait and together they
/// stay within [`MAX_GATHER`] bytes (a first block always joins).
fn gathers(deferred: &[Deferred], len: usize) -> bool {
    let queued: usize = deferred.iter().map(|d| d.len).sum();
    deferred.is_empty() || (deferred.len() < MAX_DEFERRED && queued + len <= MAX_GATHER)
}

/// Where a send block's data goes in the queued bytes ([`TcpConnection::flush`]).
#[derive(Clone, Copy)]
struct Deferred {
    at: usize,
    index: usize,
    len: usize,
}

/// Runs `f` over the data of every block in `list` (after `got`, the blocks' data already
/// taken), each send block held for the whole call.
fn with_blocks(
    blocks: &SendBlocks,
    list: &[Deferred],
    got: &[&[u8]],
    f: &mut dyn FnMut(&[&[u8]]) -> std::io::Result<Written>,
) -> std::io::Result<Written> {
    match list.split_first() {
        None => f(got),
        Some((d, rest)) => blocks.read(d.index, d.len, |b| {
            let mut more = got.to_vec();
            more.push(b);
            with_blocks(blocks, rest, &more, f)
        }),
    }
}

/// How far a flush got.
#[derive(Debug, PartialEq, Eq)]
enum Written {
    All,
    /// The socket took this many bytes of the queue (counted from its start) and no more
    /// without waiting.
    Partly(usize),
}

/// What a flush writes to: a socket, written with a writev that waits (up to the socket's write
/// timeout) or with a send that does not.
trait Outlet: Write {
    /// Writes what the socket takes without waiting (`MSG_DONTWAIT`); `WouldBlock` when it
    /// takes nothing.
    fn write_now(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize>;
}

impl Outlet for &TcpStream {
    fn write_now(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        use rustix::net::{SendAncillaryBuffer, SendFlags, sendmsg};
        let flags = SendFlags::DONTWAIT | SendFlags::NOSIGNAL;
        Ok(sendmsg(
            &**self,
            bufs,
            &mut SendAncillaryBuffer::default(),
            flags,
        )?)
    }
}

/// Writes `slices` after their first `skip` bytes (written by an earlier flush) with as few
/// system calls as possible; with `wait` false only what the socket takes without waiting.
/// A write a signal interrupted before it took a byte is tried again: with a write timeout
/// set on the socket even a handler installed with `SA_RESTART` (the binaries' SIGUSR1 for the
/// per-device table) interrupts a writev that waits (signal(7)), and that must not end the
/// connection.
fn write_slices(
    mut stream: impl Outlet,
    slices: &mut [std::io::IoSlice<'_>],
    skip: usize,
    wait: bool,
) -> std::io::Result<Written> {
    let total: usize = slices.iter().map(|s| s.len()).sum();
    let mut rest = slices;
    std::io::IoSlice::advance_slices(&mut rest, skip);
    let mut done = skip;
    while done < total {
        let r = if wait {
            stream.write_vectored(rest)
        } else {
            stream.write_now(rest)
        };
        let n = match r {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if !wait && e.kind() == std::io::ErrorKind::WouldBlock => {
                return Ok(Written::Partly(done));
            }
            Err(e) => return Err(e),
        };
        done += n;
        std::io::IoSlice::advance_slices(&mut rest, n);
    }
    Ok(Written::All)
}

impl Connection for TcpConnection {
    fn cache_budget(&self) -> Option<usize> {
        super::tcp_cache_budget(self.layout.block_size)
    }
    fn send_limits(&self, block_size: usize) -> super::SendLimits {
        super::tcp_send_limits(block_size)
    }
    fn syncs_early(&self) -> bool {
        true
    }
    fn writes_lowest_first(&self) -> bool {
        true
    }
    fn completes_at_once(&self) -> bool {
        false
    }
    fn posts_here_when_idle(&self) -> bool {
        true
    }
    fn peer(&self) -> &str {
        &self.peer
    }
    fn layout(&self) -> RemoteLayout {
        self.layout
    }
    fn post_write_chain(&mut self, wr_id: u64, chain: &[WriteWr<'_>]) -> Result<()> {
        for wr in chain {
            let len = match wr.source {
                WriteSource::SendBlock { len, .. } => len,
                WriteSource::Inline(b) => b.len(),
            };
            let h = OpHeader {
                op: OP_WRITE,
                target: wr.remote.target as u8,
                signaled: wr.signaled && self.acks.post(wr_id, true),
                len: len as u32,
                offset: wr.remote.offset,
                wr_id,
            };
            self.count_post(wr_id, 1, wr.signaled);
            self.push_op(h, &[], wr.source)?;
        }
        Ok(())
    }
    fn post_read(&mut self, wr_id: u64, remote: RemoteAddr, len: usize) -> Result<()> {
        self.expected_read.store(len, Ordering::Release);
        self.count_post(wr_id, 1, true);
        self.acks.post(wr_id, false);
        let h = OpHeader {
            op: OP_READ,
            target: remote.target as u8,
            signaled: true,
            len: len as u32,
            offset: remote.offset,
            wr_id,
        };
        self.pending.extend_from_slice(&h.encode());
        Ok(())
    }
    fn poll_completions(&mut self, out: &mut Vec<Completion>, timeout: Duration) -> Result<()> {
        if let Some(wr_id) = self.acks.ask() {
            self.queue_nop(wr_id);
        }
        // A poll that may not wait does not wait for the socket either: what it does not take
        // at once goes with the next poll (the sending thread's, which waits).
        self.flush_with(!timeout.is_zero())?;
        let from = out.len();
        match self.completions.recv_timeout(timeout) {
            Ok(ev) => self.handle(ev, out)?,
            Err(RecvTimeoutError::Timeout) => return Ok(()),
            Err(RecvTimeoutError::Disconnected) => return Err(self.lost("completion thread ended")),
        }
        while let Ok(ev) = self.completions.try_recv() {
            self.handle(ev, out)?;
        }
        let ids: Vec<u64> = out[from..].iter().map(Completion::wr_id).collect();
        for id in ids {
            self.count_completion(id);
        }
        Ok(())
    }

    fn work_counts(&self) -> Option<WorkCounts> {
        Some(self.counts.snapshot())
    }

    fn heartbeat(&mut self) -> Result<()> {
        let now = self.started.elapsed();
        let heard = Duration::from_millis(self.heard.load(Ordering::Acquire));
        let interval = super::heartbeat_interval(self.peer_timeout);
        if now.saturating_sub(heard) >= self.peer_timeout
            && self.nop_sent.elapsed() < now.saturating_sub(heard)
        {
            return Err(self.lost(format!(
                "no answer from the receiver for {:.1} s (peer timeout)",
                now.saturating_sub(heard).as_secs_f64()
            )));
        }
        if self.nop_sent.elapsed() >= interval {
            self.nop_sent = Instant::now();
            self.queue_nop(NOP_WR_ID);
            self.flush()?;
        }
        Ok(())
    }
    /// Never: the receiver's memory is in another process.
    fn lend_block(&self, _remote_block: usize) -> Option<Box<dyn super::LeasedBlock>> {
        None
    }
    fn take_notices(&mut self) -> Vec<Notice> {
        self.notices.take()
    }
}

/// The sender's end of a TCP-emulated sliding-window connection: the status-byte connection's
/// socket and completion thread, posting WRITE WITH IMMEDIATE instead of write chains and READs.
pub struct TcpWindowConnection {
    inner: TcpConnection,
    ack_queue: Option<Box<dyn AckQueue>>,
    counts: Arc<WorkCounter>,
}

impl WindowConnection for TcpWindowConnection {
    fn peer(&self) -> &str {
        &self.inner.peer
    }
    fn layout(&self) -> RemoteLayout {
        self.inner.layout
    }
    fn post_write_imm(&mut self, wr_id: u64, send_block: usize, imm: Immediate) -> Result<()> {
        let h = OpHeader {
            op: OP_WRITE_IMM,
            target: Target::Blocks as u8,
            signaled: true,
            len: imm.len as u32,
            offset: (imm.position * self.inner.layout.block_size) as u64,
            wr_id,
        };
        self.inner.count_post(wr_id, 1, true);
        self.inner.acks.post(wr_id, false);
        self.inner.push_op(
            h,
            &imm.encode().to_le_bytes(),
            WriteSource::SendBlock {
                index: send_block,
                len: imm.len,
            },
        )
    }
    fn poll_completions(&mut self, out: &mut Vec<u64>, timeout: Duration) -> Result<()> {
        // The window's one thread polls every lane without waiting and only then waits on one:
        // its writes go out whole here, as they always did (only the status-byte sender's
        // handing threads post without waiting for the socket).
        self.inner.flush()?;
        let mut done = Vec::new();
        Connection::poll_completions(&mut self.inner, &mut done, timeout)?;
        out.extend(done.iter().map(Completion::wr_id));
        Ok(())
    }
    fn take_ack_queue(&mut self) -> Option<Box<dyn AckQueue>> {
        self.ack_queue.take()
    }
    fn heartbeat(&mut self) -> Result<()> {
        Connection::heartbeat(&mut self.inner)
    }
    fn work_counts(&self) -> WorkCounts {
        self.counts.snapshot()
    }
}

/// The sender's ACK completion queue of a TCP-emulated sliding-window connection.
struct TcpAckQueue {
    peer: String,
    posted: Arc<AtomicUsize>,
    counts: Arc<WorkCounter>,
    acks: Receiver<Immediate>,
}

impl AckQueue for TcpAckQueue {
    fn post_recv(&mut self, n: usize) -> Result<()> {
        self.posted.fetch_add(n, Ordering::AcqRel);
        self.counts.post_recv(n as u64);
        Ok(())
    }
    fn recv(&mut self, timeout: Duration) -> Result<Option<Immediate>> {
        match self.acks.recv_timeout(timeout) {
            Ok(imm) => Ok(Some(imm)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(Error::Disconnected {
                peer: self.peer.clone(),
                reason: "connection ended".into(),
            }),
        }
    }
}

/// The receiver's side of the socket, shared by the NIC thread (its answers, buffered and written
/// whole at each flush) and the threads that SEND ACKs: one lock, so messages never interleave.
struct LinkWriter {
    stream: Arc<Mutex<TcpStream>>,
    buf: Vec<u8>,
}

impl Write for LinkWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        if !self.buf.is_empty() {
            let r = self.stream.lock().write_all(&self.buf);
            self.buf.clear();
            r?;
        }
        Ok(())
    }
}

/// SENDs a sliding-window region's ACKs on its connection.
struct TcpAckLink(Arc<Mutex<TcpStream>>);

impl AckLink for TcpAckLink {
    fn send_ack(&self, wr_id: u64, ack: [u8; ACK_LEN]) -> std::io::Result<()> {
        let h = OpHeader {
            op: OP_SEND,
            target: 0,
            signaled: true,
            len: ACK_LEN as u32,
            offset: 0,
            wr_id,
        };
        let mut msg = [0u8; OP_HEADER + ACK_LEN];
        msg[..OP_HEADER].copy_from_slice(&h.encode());
        msg[OP_HEADER..].copy_from_slice(&ack);
        self.0.lock().write_all(&msg)
    }
}

/// The receiver's listening side of a transport whose connections start on a side channel (a
/// TCP one for tcp itself and verbs, a Unix socket for shm): a thread accepts connections and runs each handshake on a thread of
/// its own, queueing the senders that completed it and the connections refused.
///
/// Dropping it stops the accepting thread and waits for it, so the listening socket is closed
/// and the address can be bound again as soon as the drop returns (a receiver restarted in the
/// same process must not see "address in use").
pub struct SideChannelListener {
    transport: &'static str,
    local: String,
    /// The Unix socket this listener bound (device and inode), removed again on drop if it is
    /// still that socket.
    socket_file: Option<(PathBuf, (u64, u64))>,
    stop: Arc<AtomicBool>,
    /// Dropped to wake the accepting thread from its wait (the other end of this pair hangs up).
    wake: Option<UnixStream>,
    thread: Option<std::thread::JoinHandle<()>>,
    accepted: Receiver<Accepted>,
    refused: Receiver<Refusal>,
    /// Ends [`Listener::accept`]'s wait early (a receiver that stops, say).
    accept_wake: super::AcceptWake,
}

/// How long the accepting thread sleeps after an accept failed (out of descriptors and the
/// like) or when it cannot wait on its sockets, before it tries again. When nothing is pending
/// it waits in `poll(2)` for a connection or for the drop, without a timeout.
const ACCEPT_RETRY: Duration = Duration::from_millis(5);

/// Handshakes in progress at most (each on its own thread, for up to `HANDSHAKE_TIMEOUT`);
/// connections beyond are closed at once.
pub const MAX_HANDSHAKES: usize = 64;
/// Handshakes in progress from one remote address at most: one machine trickling bytes into
/// slow handshakes cannot take every slot.
pub const MAX_HANDSHAKES_PER_ADDRESS: usize = 4;

/// Handshakes in progress, in all and per remote address.
#[derive(Default)]
struct InProgress {
    total: usize,
    per_address: std::collections::HashMap<std::net::IpAddr, usize>,
}

thread_local! {
    /// The slot of the handshake this thread runs ([`Slot::hold_while`]), for [`refuse`] to
    /// give back before it answers.
    static CURRENT_SLOT: std::cell::RefCell<Option<Slot>> = const { std::cell::RefCell::new(None) };
}

/// A handshake slot, given back when dropped (also when the handshake thread panics).
struct Slot {
    table: Arc<Mutex<InProgress>>,
    /// The remote address (none on a Unix socket: every peer is on this host, and only the
    /// total limit applies).
    ip: Option<std::net::IpAddr>,
}

impl Slot {
    /// Takes a slot for a connection from `ip`, or says why not.
    fn take(
        table: &Arc<Mutex<InProgress>>,
        ip: Option<std::net::IpAddr>,
    ) -> std::result::Result<Slot, String> {
        let mut t = table.lock();
        if t.total >= MAX_HANDSHAKES {
            return Err(format!(
                "closed at once: {MAX_HANDSHAKES} handshakes already in progress"
            ));
        }
        let Some(ip) = ip else {
            t.total += 1;
            return Ok(Slot {
                table: table.clone(),
                ip: None,
            });
        };
        let n = t.per_address.entry(ip).or_insert(0);
        if *n >= MAX_HANDSHAKES_PER_ADDRESS {
            return Err(format!(
                "closed at once: {MAX_HANDSHAKES_PER_ADDRESS} handshakes from {ip} already in progress"
            ));
        }
        *n += 1;
        t.total += 1;
        Ok(Slot {
            table: table.clone(),
            ip: Some(ip),
        })
    }

    /// Runs `handshake` on this thread holding the slot, which is given back when it returns,
    /// or earlier, by [`Slot::release_current`].
    fn hold_while<T>(self, handshake: impl FnOnce() -> T) -> T {
        CURRENT_SLOT.with(|c| *c.borrow_mut() = Some(self));
        let result = handshake();
        Self::release_current();
        result
    }

    /// Gives back the slot of the handshake running on this thread, if it still holds one:
    /// once its refusal or its admission is decided, the handshake no longer counts against
    /// the limits.
    fn release_current() {
        let slot = CURRENT_SLOT.with(|c| c.borrow_mut().take());
        drop(slot);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut t = self.table.lock();
        t.total -= 1;
        if let Some(ip) = self.ip
            && let Some(n) = t.per_address.get_mut(&ip)
        {
            *n -= 1;
            if *n == 0 {
                t.per_address.remove(&ip);
            }
        }
    }
}

impl SideChannelListener {
    /// Binds `addr` and accepts on it in a thread named after `transport` until dropped; each
    /// connection (blocking again) goes to `handshake` on a thread of its own, within the
    /// handshake limits above.
    pub fn bind(
        transport: &'static str,
        addr: &str,
        handshake: impl Fn(TcpStream) -> std::result::Result<Accepted, Refusal> + Send + Sync + 'static,
    ) -> Result<SideChannelListener> {
        let listen_err = |source| Error::Listen {
            addr: addr.to_string(),
            source,
        };
        let listener = TcpListener::bind(addr).map_err(listen_err)?;
        let local = listener.local_addr().map_err(listen_err)?.to_string();
        listener.set_nonblocking(true).map_err(listen_err)?;
        let accept = |listener: &TcpListener| {
            let (stream, peer) = listener.accept()?;
            stream.set_nonblocking(false)?;
            Ok((stream, Some(peer.ip()), peer.to_string()))
        };
        Self::serve(transport, local, listener, accept, handshake)
    }

    /// Binds the Unix socket `path` (the shm transport) like [`SideChannelListener::bind`]. A
    /// socket file left behind by a receiver that was killed is replaced; one that another
    /// receiver still listens on is "address in use". The socket file is removed on drop.
    pub fn bind_unix(
        transport: &'static str,
        path: &Path,
        handshake: impl Fn(UnixStream) -> std::result::Result<Accepted, Refusal> + Send + Sync + 'static,
    ) -> Result<SideChannelListener> {
        let local = format!("unix:{}", path.display());
        let listen_err = |source| Error::Listen {
            addr: local.clone(),
            source,
        };
        let listener = bind_unix_socket(path).map_err(listen_err)?;
        listener.set_nonblocking(true).map_err(listen_err)?;
        let identity = {
            use std::os::unix::fs::MetadataExt;
            let m = std::fs::metadata(path).map_err(listen_err)?;
            (m.dev(), m.ino())
        };
        let peer = local.clone();
        let accept = move |listener: &UnixListener| {
            let (stream, _) = listener.accept()?;
            stream.set_nonblocking(false)?;
            Ok((stream, None, peer.clone()))
        };
        let mut l = Self::serve(transport, local, listener, accept, handshake)?;
        l.socket_file = Some((path.to_path_buf(), identity));
        Ok(l)
    }

    /// Runs the accepting thread on the non-blocking `listener`: `accept` yields a pending
    /// connection (or `WouldBlock`), its remote IP address for the per-address limit, and its
    /// peer name for messages. With nothing pending the thread sleeps in `poll(2)` on the
    /// listener and on a socket the drop hangs up, so an idle receiver's accepting thread never
    /// wakes, a connection is taken the moment it comes, and the drop returns at once.
    fn serve<L: std::os::fd::AsFd + Send + 'static, S: Send + 'static>(
        transport: &'static str,
        local: String,
        listener: L,
        mut accept: impl FnMut(&L) -> std::io::Result<(S, Option<std::net::IpAddr>, String)>
        + Send
        + 'static,
        handshake: impl Fn(S) -> std::result::Result<Accepted, Refusal> + Send + Sync + 'static,
    ) -> Result<SideChannelListener> {
        let (woken, wake) = UnixStream::pair().map_err(|source| Error::Listen {
            addr: local.clone(),
            source,
        })?;
        let (accepted_tx, accepted) = crossbeam_channel::unbounded();
        let (refused_tx, refused) = crossbeam_channel::bounded(super::MAX_REFUSALS);
        let handshake = Arc::new(handshake);
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let in_progress = Arc::new(Mutex::new(InProgress::default()));
        let thread_name = format!("{transport}-accept");
        let thread = spawn(thread_name, move || {
            while !stopping.load(Ordering::Acquire) {
                match accept(&listener) {
                    Ok((stream, ip, peer)) => {
                        let slot = match Slot::take(&in_progress, ip) {
                            Ok(s) => s,
                            Err(why) => {
                                // A flood of idle connections must not become a flood of threads.
                                crate::warn_limited!("handshake-slots", "{peer}: {why}");
                                let _ = refused_tx.try_send(Refusal {
                                    peer,
                                    why,
                                    kind: RefusalKind::HandshakeLimit,
                                });
                                continue;
                            }
                        };
                        let (handshake, accepted_tx, refused_tx) =
                            (handshake.clone(), accepted_tx.clone(), refused_tx.clone());
                        let spawned = spawn(format!("{transport}-handshake"), move || {
                            match slot.hold_while(|| handshake(stream)) {
                                Ok(a) => {
                                    let _ = accepted_tx.send(a);
                                }
                                // Full: nobody reads them; they were logged anyway.
                                Err(r) => {
                                    let _ = refused_tx.try_send(r);
                                }
                            }
                        });
                        if let Err(e) = spawned {
                            crate::warn_limited!("handshake-thread", "{peer}: {e}");
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        wait_for_connection(&listener, &woken)
                    }
                    Err(e) => {
                        // Out of descriptors and the like: say so, keep serving.
                        crate::warn_limited!("accept", "accept failed: {e}");
                        std::thread::sleep(ACCEPT_RETRY);
                    }
                }
            }
        })?;
        Ok(SideChannelListener {
            transport,
            local,
            socket_file: None,
            stop,
            wake: Some(wake),
            thread: Some(thread),
            accepted,
            refused,
            accept_wake: super::AcceptWake::new(),
        })
    }
}

/// Sleeps until `listener` has a connection pending or the other end of `woken` hangs up (the
/// listener's drop). A signal ends the wait early, as does any failure of `poll(2)` (after a
/// short sleep): the caller just tries `accept` again.
fn wait_for_connection(listener: &impl std::os::fd::AsFd, woken: &UnixStream) {
    use rustix::event::{PollFd, PollFlags, poll};
    let mut fds = [
        PollFd::new(listener, PollFlags::IN),
        PollFd::new(woken, PollFlags::IN),
    ];
    match poll(&mut fds, None) {
        Ok(_) | Err(rustix::io::Errno::INTR) => {}
        Err(e) => {
            crate::warn_limited!("accept-poll", "waiting for connections failed: {e}");
            std::thread::sleep(ACCEPT_RETRY);
        }
    }
}

/// Binds a Unix socket at `path`, replacing a socket file nobody listens on any more (left by a
/// receiver that was killed) but never one a live receiver holds, nor a file that is not a
/// socket.
fn bind_unix_socket(path: &Path) -> std::io::Result<UnixListener> {
    match UnixListener::bind(path) {
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            use std::os::unix::fs::FileTypeExt;
            let is_socket = std::fs::symlink_metadata(path)
                .map(|m| m.file_type().is_socket())
                .unwrap_or(false);
            let why = if !is_socket {
                "a file that is not a socket is in the way (remove it or pick another path)".into()
            } else {
                match UnixStream::connect(path) {
                    // Nobody listens: a killed receiver's socket file.
                    Err(c) if c.kind() == std::io::ErrorKind::ConnectionRefused => String::new(),
                    Ok(_) => "something is already listening there (another receiver?)".into(),
                    Err(c) => format!("the socket there cannot be tried: {c}"),
                }
            };
            if !why.is_empty() {
                return Err(std::io::Error::new(e.kind(), format!("{e}: {why}")));
            }
            std::fs::remove_file(path)?;
            UnixListener::bind(path)
        }
        r => r,
    }
}

impl Listener for SideChannelListener {
    fn transport(&self) -> &'static str {
        self.transport
    }
    fn local_addr(&self) -> String {
        self.local.clone()
    }
    fn accept(&mut self, timeout: Duration) -> Result<Option<Accepted>> {
        Ok(self
            .accept_wake
            .wait(&self.accepted, &self.refused, timeout))
    }
    fn waker(&self) -> super::AcceptWaker {
        self.accept_wake.waker()
    }
    fn refusals(&mut self) -> Vec<Refusal> {
        self.refused.try_iter().collect()
    }
}

impl Drop for SideChannelListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Hangs up on the accepting thread's wait, after the flag it then sees.
        drop(self.wake.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // The listening socket is closed now; its file goes too, unless another receiver has
        // bound the path since (then the file is that one's).
        if let Some((path, identity)) = self.socket_file.take() {
            use std::os::unix::fs::MetadataExt;
            if std::fs::metadata(&path).is_ok_and(|m| (m.dev(), m.ino()) == identity) {
                let _ = std::fs::remove_file(&path);
            }
        }
    }
}

/// Listens for senders of the tcp transport on `addr`; each gets a region from `settings`, and a
/// thread that plays the NIC for its connection.
pub fn listen(addr: &str, settings: RegionSettings) -> Result<SideChannelListener> {
    SideChannelListener::bind("tcp", addr, move |stream| handshake(stream, &settings))
}

/// Runs the receiver's half of the handshake, then gives the sender a region (its memory
/// reserved from the budget) and a thread that plays the NIC for its connection.
fn handshake(
    mut stream: TcpStream,
    settings: &RegionSettings,
) -> std::result::Result<Accepted, Refusal> {
    let admitted = server_handshake(
        &mut stream,
        settings,
        DataPath::Tcp,
        "this receiver speaks the tcp transport only",
        |_, _| {
            let memory = settings.reserve_region()?;
            let region = SoftRegion::with_reservation(settings, Some(memory.region));
            let welcome = Welcome {
                blocks: settings.blocks as u32,
                block_size: settings.block_size as u32,
                ..Welcome::refusal("")
            };
            Ok((welcome, (region, memory.reassembly)))
        },
    )?;
    let Admitted {
        hello,
        peer,
        lease,
        built: (region, memory),
    } = admitted;
    if let Ok(link) = stream.try_clone() {
        region.attach_link(link);
    }
    let nic_region = region.clone();
    let nic_peer = peer.clone();
    let nic_timeout = settings.peer_timeout;
    let nic_spin = settings.nic_spin;
    spawn(format!("tcp-nic-{}", hello.sender), move || {
        // Whatever ends this thread (the peer, an access error, a panic), the region is marked
        // closed, so its polling thread finishes it and frees it.
        let _close = CloseOnDrop(&nic_region);
        if let Err(why) = emulate_nic(stream, &nic_region, nic_timeout, nic_spin) {
            let why = logsafe::clean(&why, logsafe::MAX_PEER_TEXT);
            if why.contains("peer timeout") {
                // A half-open connection: the operator should know the peer vanished.
                crate::warn_limited!("peer-timeout", "connection from {nic_peer} ended: {why}");
            } else {
                tracing::debug!(peer = %nic_peer, "connection ended: {why}");
            }
        }
    })
    .map_err(|e| {
        let why = format!("sender '{}': {e}", hello.sender);
        crate::warn_limited!("nic-thread", "dropped connection from {peer}: {why}");
        Refusal {
            peer: peer.clone(),
            why,
            kind: RefusalKind::Resources,
        }
    })?;
    let region: Arc<dyn super::Region> = region;
    lease.attach(&region);
    Ok(Accepted {
        hello,
        peer,
        region,
        lease,
        memory,
    })
}

/// Closes a region when dropped: on every way out of a NIC thread, unwinding included.
struct CloseOnDrop<'a>(&'a SoftRegion);

impl Drop for CloseOnDrop<'_> {
    fn drop(&mut self) {
        self.0.disconnect();
    }
}

/// Plays the NIC for one connection until it ends; `spin`: how long it looks for more bytes
/// before it sleeps ([`RegionSettings::nic_spin`]).
fn emulate_nic(
    stream: TcpStream,
    region: &SoftRegion,
    peer_timeout: Duration,
    spin: Duration,
) -> std::result::Result<(), String> {
    // A live sender sends heartbeats when it has nothing else to send: silence this long means
    // it (or the link) is gone, although no FIN or RST came (a half-open connection).
    stream
        .set_read_timeout(Some(peer_timeout))
        .map_err(|e| e.to_string())?;
    let writer = Arc::new(Mutex::new(stream.try_clone().map_err(|e| e.to_string())?));
    region.attach_ack_link(Arc::new(TcpAckLink(writer.clone())));
    let mut out = LinkWriter {
        stream: writer,
        buf: Vec::with_capacity(16 * 1024),
    };
    let mut r = NicReader::new(stream).spinning(spin);
    let end = serve_requests(&mut r, &mut out, region, peer_timeout);
    tracing::debug!(
        looked = r.looked,
        slept = r.slept,
        "tcp NIC: reads that found their bytes within the spin, and reads that slept"
    );
    end
}

/// What the NIC thread reads from: a socket, which can also be read without waiting.
trait NicSource: Read {
    /// A `readv` that does not wait: `None` when nothing has arrived.
    fn read_now(&mut self, bufs: &mut [std::io::IoSliceMut<'_>]) -> Option<std::io::Result<usize>>;
}

impl NicSource for TcpStream {
    fn read_now(&mut self, bufs: &mut [std::io::IoSliceMut<'_>]) -> Option<std::io::Result<usize>> {
        use rustix::net::{RecvAncillaryBuffer, RecvFlags, recvmsg};
        let mut control = RecvAncillaryBuffer::default();
        match recvmsg(&*self, bufs, &mut control, RecvFlags::DONTWAIT) {
            Ok(m) => Some(Ok(m.bytes)),
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => None,
            Err(e) => Some(Err(e.into())),
        }
    }
}

/// The NIC thread's reader. Requests come out of a buffer that one system call fills with as
/// many as have arrived; the data of a large WRITE is read straight into the region, past the
/// buffer, so the receiving side copies each byte once (out of the kernel), as a plain TCP
/// reader does. While large WRITEs come, buffer fills are kept short, since what follows one in
/// the socket is often the next, whose data would otherwise be copied into the buffer and again
/// into the region.
struct NicReader<R> {
    inner: R,
    buf: Box<[u8]>,
    pos: usize,
    end: usize,
    /// Fills left that bring in at most [`NIC_SHORT_FILL`] bytes: set to
    /// [`NIC_SHORT_FILLS`] by each payload read past the buffer.
    short_fills: u32,
    /// How long a read looks for bytes without waiting before it sleeps in the socket
    /// ([`RegionSettings::nic_spin`]; zero: it sleeps at once).
    spin: Duration,
    /// Reads that found bytes while looking, and reads that slept in the socket.
    looked: u64,
    slept: u64,
}

/// The NIC's buffer: as many small requests (status bytes, small blocks, READs) as one system
/// call brings in.
const NIC_BUFFER: usize = 256 * 1024;
/// Payload left to read at least this large is read straight into the region.
const NIC_DIRECT: usize = 16 * 1024;
/// A fill while large WRITEs come brings in at most this much: the next request's header, the
/// short requests chained behind a block (its status byte), or a few hundred status bytes.
const NIC_SHORT_FILL: usize = 4 * 1024;
/// How many fills stay short after a large WRITE.
const NIC_SHORT_FILLS: u32 = 16;

impl<R: NicSource> NicReader<R> {
    fn new(inner: R) -> NicReader<R> {
        NicReader {
            inner,
            buf: vec![0u8; NIC_BUFFER].into_boxed_slice(),
            pos: 0,
            end: 0,
            short_fills: 0,
            spin: Duration::ZERO,
            looked: 0,
            slept: 0,
        }
    }

    /// This reader, looking for bytes for up to `spin` before each sleep.
    fn spinning(mut self, spin: Duration) -> NicReader<R> {
        self.spin = spin;
        self
    }

    /// Whether no request is buffered (the NIC flushes its answers then).
    fn drained(&self) -> bool {
        self.pos == self.end
    }

    /// Reads more into an empty buffer; `Ok(0)` at the end of the stream.
    fn fill(&mut self) -> std::io::Result<usize> {
        debug_assert!(self.drained());
        let limit = if self.short_fills > 0 {
            self.short_fills -= 1;
            NIC_SHORT_FILL
        } else {
            self.buf.len()
        };
        loop {
            let mut bufs = [std::io::IoSliceMut::new(&mut self.buf[..limit])];
            match read_spinning(
                &mut self.inner,
                self.spin,
                &mut bufs,
                (&mut self.looked, &mut self.slept),
            ) {
                Ok(n) => {
                    (self.pos, self.end) = (0, n);
                    return Ok(n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Fills `dst` exactly: first from the buffer, then, when at least [`NIC_DIRECT`] bytes are
    /// missing, straight from the stream.
    fn read_exact(&mut self, dst: &mut [u8]) -> std::io::Result<()> {
        let mut done = 0;
        while done < dst.len() {
            if self.drained() {
                if dst.len() - done >= NIC_DIRECT {
                    self.short_fills = NIC_SHORT_FILLS;
                    return self.read_direct(&mut dst[done..]);
                }
                if self.fill()? == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
            }
            let n = (self.end - self.pos).min(dst.len() - done);
            dst[done..done + n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
            self.pos += n;
            done += n;
        }
        Ok(())
    }

    /// Fills `dst` exactly from the stream (the buffer is drained), each read bringing in, past
    /// the end of `dst`, up to [`NIC_SHORT_FILL`] bytes of what follows into the buffer: the
    /// status WRITE chained behind a block and the next request's header then come with the
    /// block's last bytes, not with a read of their own.
    fn read_direct(&mut self, dst: &mut [u8]) -> std::io::Result<()> {
        debug_assert!(self.drained());
        let mut done = 0;
        while done < dst.len() {
            let left = dst.len() - done;
            let mut bufs = [
                std::io::IoSliceMut::new(&mut dst[done..]),
                std::io::IoSliceMut::new(&mut self.buf[..NIC_SHORT_FILL]),
            ];
            match read_spinning(
                &mut self.inner,
                self.spin,
                &mut bufs,
                (&mut self.looked, &mut self.slept),
            ) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) if n > left => {
                    (self.pos, self.end) = (0, n - left);
                    done = dst.len();
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// One read from `source` into `bufs` (the socket's `readv`). While a stream runs, bytes come
/// every few microseconds, so for up to `spin` it looks for them without waiting, yielding the
/// CPU between looks, and only then sleeps: a NIC thread that sleeps is woken by the sender's
/// `writev`, and over loopback the scheduler then tends to queue it on the sending thread's
/// core while the other idles (docs/protocol.md, "The `tcp` software transport", "Waking").
fn read_spinning<R: NicSource>(
    source: &mut R,
    spin: Duration,
    bufs: &mut [std::io::IoSliceMut<'_>],
    (looked, slept): (&mut u64, &mut u64),
) -> std::io::Result<usize> {
    if !spin.is_zero() {
        // The clock is read only once a look finds nothing: a running stream's reads mostly
        // find their bytes at the first look.
        let mut start = None;
        loop {
            if let Some(got) = source.read_now(bufs) {
                *looked += 1;
                return got;
            }
            if start.get_or_insert_with(Instant::now).elapsed() >= spin {
                break;
            }
            std::thread::yield_now();
        }
    }
    *slept += 1;
    source.read_vectored(bufs)
}

/// Applies the requests (WRITE, READ, heartbeat) read from `r` to `region` and writes the
/// replies to `out`, until the stream ends or a request is refused. Every field of a request
/// comes from the peer and is checked by the region before it is used.
fn serve_requests<R: NicSource, W: Write>(
    r: &mut NicReader<R>,
    out: &mut W,
    region: &SoftRegion,
    peer_timeout: Duration,
) -> std::result::Result<(), String> {
    loop {
        let mut hb = [0u8; OP_HEADER];
        if let Err(e) = r.read_exact(&mut hb) {
            let _ = out.flush();
            return Err(match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                    "sender silent for {:.1} s (peer timeout): gone",
                    peer_timeout.as_secs_f64()
                ),
                _ => format!("sender closed the connection ({e})"),
            });
        }
        let h = OpHeader::decode(&hb);
        let target = target_of(h.target);
        let access_error = |out: &mut W, why: String| {
            let reply = OpHeader {
                op: OP_ERROR,
                target: 0,
                signaled: false,
                len: why.len() as u32,
                offset: 0,
                wr_id: h.wr_id,
            };
            let _ = out
                .write_all(&reply.encode())
                .and_then(|_| out.write_all(why.as_bytes()))
                .and_then(|_| out.flush());
            Err(format!("remote access error: {why}"))
        };
        match (h.op, target) {
            (OP_NOP, _) => {
                let ack = OpHeader {
                    op: OP_ACK,
                    len: 0,
                    ..h
                };
                out.write_all(&ack.encode()).map_err(|e| e.to_string())?;
            }
            (OP_WRITE, Some(target)) => {
                let len = h.len as usize;
                match region.write_with(target, h.offset, len, |dst| r.read_exact(dst)) {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(format!("reading WRITE data: {e}")),
                    Err(e) => return access_error(out, e.0),
                }
                if h.signaled {
                    let ack = OpHeader {
                        op: OP_ACK,
                        len: 0,
                        ..h
                    };
                    out.write_all(&ack.encode()).map_err(|e| e.to_string())?;
                }
            }
            (OP_WRITE_IMM, Some(Target::Blocks)) => {
                let mut imm = [0u8; 4];
                r.read_exact(&mut imm)
                    .map_err(|e| format!("reading WRITE WITH IMMEDIATE: {e}"))?;
                let imm = u32::from_le_bytes(imm);
                match region.write_imm(h.offset, h.len as usize, imm, |dst| r.read_exact(dst)) {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(format!("reading WRITE WITH IMMEDIATE data: {e}")),
                    Err(e) => return access_error(out, e.0),
                }
                if h.signaled {
                    let ack = OpHeader {
                        op: OP_ACK,
                        len: 0,
                        ..h
                    };
                    out.write_all(&ack.encode()).map_err(|e| e.to_string())?;
                }
            }
            (OP_READ, Some(target)) => match region.read_remote(target, h.offset, h.len as usize) {
                Ok(data) => {
                    let resp = OpHeader {
                        op: OP_READ_RESP,
                        ..h
                    };
                    out.write_all(&resp.encode())
                        .and_then(|_| out.write_all(&data))
                        .map_err(|e| e.to_string())?;
                }
                Err(e) => return access_error(out, e.0),
            },
            _ => {
                return access_error(
                    out,
                    format!("unknown operation {} on target {}", h.op, h.target),
                );
            }
        }
        // Notices ride behind the answers; a live sender sends something at least every
        // heartbeat interval, so one waits no longer than that.
        for n in region.take_notices() {
            let head = OpHeader {
                op: OP_NOTICE,
                target: n.device,
                signaled: false,
                len: n.text.len() as u32,
                offset: 0,
                wr_id: NOP_WR_ID,
            };
            out.write_all(&head.encode())
                .and_then(|_| out.write_all(n.text.as_bytes()))
                .map_err(|e| e.to_string())?;
        }
        // Acknowledge in batches: flush once no more requests are already buffered.
        if r.drained() {
            out.flush().map_err(|e| e.to_string())?;
        }
    }
}

/// Hands out at most `chunk` bytes per read, as a socket does when data trickles in;
/// counts the reads and the bytes that went anywhere but into the NIC's buffer (whose fills
/// ask for exactly `NIC_BUFFER` or `NIC_SHORT_FILL` bytes).
#[cfg(any(test, feature = "fuzzing"))]
struct Trickle<'a> {
    data: &'a [u8],
    chunk: usize,
    reads: usize,
    past_buffer: usize,
}

#[cfg(any(test, feature = "fuzzing"))]
impl Read for Trickle<'_> {
    /// One read into one slice: a readv of it alone.
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.read_vectored(&mut [std::io::IoSliceMut::new(buf)])
    }

    /// As a socket's readv: one read fills the slices in turn with what has arrived.
    fn read_vectored(&mut self, bufs: &mut [std::io::IoSliceMut<'_>]) -> std::io::Result<usize> {
        self.reads += 1;
        let mut total = 0;
        for buf in bufs.iter_mut() {
            let n = buf.len().min(self.chunk - total).min(self.data.len());
            if buf.len() != NIC_BUFFER && buf.len() != NIC_SHORT_FILL {
                self.past_buffer += n;
            }
            buf[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            total += n;
        }
        Ok(total)
    }
}

#[cfg(any(test, feature = "fuzzing"))]
impl NicSource for Trickle<'_> {
    /// Bytes are always there.
    fn read_now(&mut self, bufs: &mut [std::io::IoSliceMut<'_>]) -> Option<std::io::Result<usize>> {
        Some(self.read_vectored(bufs))
    }
}

/// Entry points for `fuzz/` (feature `fuzzing`): the tcp NIC's request decoder and the sender's
/// reading of the answers, on raw bytes.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    use super::*;

    /// Feeds `input` to a NIC thread serving `region` as if a peer had sent it, at most `chunk`
    /// bytes per read (as a socket brings them in: small chunks drain the NIC's buffer, so
    /// WRITEs of [`NIC_DIRECT`] bytes and more are read straight into the region); returns what
    /// the NIC answered and how the connection ended.
    pub fn serve(
        region: &SoftRegion,
        input: &[u8],
        chunk: usize,
    ) -> (Vec<u8>, std::result::Result<(), String>) {
        let mut r = NicReader::new(Trickle {
            data: input,
            chunk: chunk.max(1),
            reads: 0,
            past_buffer: 0,
        });
        let mut out = Vec::new();
        let end = serve_requests(&mut r, &mut out, region, Duration::from_secs(1));
        (out, end)
    }

    /// What [`answers`] made of a receiver's bytes.
    pub struct Answered {
        /// Requests reported complete, those whose acknowledgement rode on a later one included.
        pub completed: usize,
        /// Notices kept.
        pub notices: usize,
        /// Sliding-window ACKs put on the ACK completion queue.
        pub window_acks: usize,
        /// Why the connection ended.
        pub end: String,
    }

    /// Feeds `input`, at most `chunk` bytes per read, to the sender's side as the receiver's
    /// answers, as a connection does: `chains` write chains (work requests 0, 1, ...)
    /// acknowledged on the wire every [`ACK_EVERY`] and asked for by a NOP at the end, then,
    /// with `read`, a READ of that many bytes; `window`: a sliding-window connection with that
    /// many ACK receive requests posted. Reads until the connection ends (input always runs
    /// out).
    pub fn answers(
        input: &[u8],
        chunk: usize,
        chains: usize,
        read: Option<usize>,
        window: Option<usize>,
    ) -> Answered {
        let mut acks = WireAcks::default();
        for id in 0..chains {
            acks.post(id as u64, true);
        }
        if read.is_some() {
            acks.post(chains as u64, false);
        }
        acks.ask();
        let expected_read = AtomicUsize::new(read.unwrap_or(NO_READ));
        let heard = AtomicU64::new(0);
        let notices = NoticeQueue::default();
        let (ack_tx, ack_rx) = crossbeam_channel::unbounded();
        let route = window.map(|n| AckRoute {
            posted: Arc::new(AtomicUsize::new(n)),
            counts: Arc::new(WorkCounter::new(2)),
            acks: ack_tx,
        });
        let cx = AnswerCtx {
            peer: "fuzz",
            expected_read: &expected_read,
            started: Instant::now(),
            heard: &heard,
            notices: &notices,
            acks: route.as_ref(),
        };
        let mut r = BufReader::with_capacity(
            ANSWER_BUFFER,
            Trickle {
                data: input,
                chunk: chunk.max(1),
                reads: 0,
                past_buffer: 0,
            },
        );
        let mut completed = 0;
        let end = loop {
            match read_answer(&mut r, &cx) {
                None => {}
                Some(Event::Failed(why)) => break why,
                Some(Event::Done(c)) => {
                    if let Completion::Read { data, .. } = &c {
                        assert_eq!(Some(data.len()), read, "a READ response of another length");
                    }
                    // As the connection does (`TcpConnection::handle`).
                    let mut out = Vec::new();
                    match acks.complete(c, &mut out) {
                        Ok(()) => completed += out.len(),
                        Err(e) => break e,
                    }
                }
            }
        };
        Answered {
            completed,
            notices: notices.take().len(),
            window_acks: ack_rx.try_iter().count(),
            end,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer like a socket under signals: every other write is interrupted before it takes
    /// a byte, and the others take at most `step` bytes, so writes end inside slices. Without
    /// waiting it takes at most `room` bytes in all, then would block.
    struct Interrupting {
        got: Vec<u8>,
        step: usize,
        room: usize,
        calls: usize,
        interrupted: usize,
    }

    impl Interrupting {
        fn take(&mut self, bufs: &[std::io::IoSlice<'_>], most: usize) -> std::io::Result<usize> {
            self.calls += 1;
            if self.calls % 2 == 1 {
                self.interrupted += 1;
                return Err(std::io::ErrorKind::Interrupted.into());
            }
            let mut left = most;
            for b in bufs {
                let n = b.len().min(left);
                self.got.extend_from_slice(&b[..n]);
                left -= n;
            }
            Ok(most - left)
        }
    }

    impl Write for &mut Interrupting {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.write_vectored(&[std::io::IoSlice::new(buf)])
        }
        fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
            let step = self.step;
            self.take(bufs, step)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Outlet for &mut Interrupting {
        fn write_now(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
            let most = self.step.min(self.room - self.got.len());
            if most == 0 {
                return Err(std::io::ErrorKind::WouldBlock.into());
            }
            self.take(bufs, most)
        }
    }

    #[test]
    fn a_gathered_write_interrupted_by_signals_still_sends_every_byte_in_order() {
        let parts: Vec<Vec<u8>> = (0..5u8)
            .map(|i| {
                (0..(17 * usize::from(i) + 3))
                    .map(|j| i ^ j as u8)
                    .collect()
            })
            .collect();
        let want: Vec<u8> = parts.concat();
        for step in [1, 7, 64, 1000] {
            // A write that waits takes everything, whatever the signals do.
            let mut w = Interrupting {
                got: Vec::new(),
                step,
                room: 0,
                calls: 0,
                interrupted: 0,
            };
            let mut slices: Vec<_> = parts.iter().map(|p| std::io::IoSlice::new(p)).collect();
            let done = write_slices(&mut w, &mut slices, 0, true);
            assert_eq!(
                done.expect("an interrupted writev is tried again"),
                Written::All
            );
            assert_eq!(w.got, want, "step {step}");
            assert!(w.interrupted > 0, "step {step}: nothing was interrupted");
            // One that may not wait stops where the socket is full and says how far it got; a
            // flush that waits goes on from there, each byte once.
            for room in [0, 1, 50, want.len() - 1] {
                let mut w = Interrupting {
                    got: Vec::new(),
                    step,
                    room,
                    calls: 0,
                    interrupted: 0,
                };
                let mut slices: Vec<_> = parts.iter().map(|p| std::io::IoSlice::new(p)).collect();
                let first = write_slices(&mut w, &mut slices, 0, false).unwrap();
                assert_eq!(first, Written::Partly(room), "step {step}, room {room}");
                let mut slices: Vec<_> = parts.iter().map(|p| std::io::IoSlice::new(p)).collect();
                let rest = write_slices(&mut w, &mut slices, room, true).unwrap();
                assert_eq!(rest, Written::All);
                assert_eq!(w.got, want, "step {step}, room {room}");
            }
        }
    }

    /// A handshake read from a peer that is not ours says so, quoting its first bytes escaped
    /// (an SSH server's banner, with a control byte a peer could use on a terminal), and one
    /// that says nothing (an HTTP server waiting for a request) is named too.
    #[test]
    fn a_peer_that_is_not_rdmastream_is_named_as_such() {
        let (mut ours, mut theirs) = UnixStream::pair().unwrap();
        theirs.write_all(b"S\x1bH-2.0-OpenSSH_9.2\r\n").unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let e = recv_message(&mut ours, deadline).unwrap_err().why;
        assert!(
            e.contains(r#""S\u{1b}H-""#) && e.contains("rdmastream sender or receiver"),
            "{e}"
        );
        let (mut ours, _silent) = UnixStream::pair().unwrap();
        let deadline = Instant::now() + Duration::from_millis(50);
        let e = recv_message(&mut ours, deadline).unwrap_err().why;
        assert!(
            e.contains("in time") && e.contains("rdmastream sender or receiver"),
            "{e}"
        );
    }

    #[test]
    fn a_flush_gathers_up_to_eight_blocks_and_at_most_4_mib() {
        let gathered = |len: usize| {
            let mut deferred: Vec<Deferred> = Vec::new();
            while gathers(&deferred, len) {
                deferred.push(Deferred {
                    at: 0,
                    index: deferred.len(),
                    len,
                });
                assert!(
                    deferred.len() <= 64,
                    "{len}-byte blocks are gathered without end"
                );
            }
            deferred.len()
        };
        assert_eq!(gathered(64 << 10), 8, "64 KiB blocks");
        assert_eq!(gathered(512 << 10), 8, "512 KiB blocks");
        assert_eq!(gathered(1 << 20), 4, "1 MiB blocks");
        assert_eq!(gathered(3 << 20), 1, "3 MiB blocks");
        assert_eq!(gathered(4 << 20), 1, "4 MiB blocks");
        assert_eq!(
            gathered(16 << 20),
            1,
            "a block larger than the limit still goes out"
        );
    }

    fn key() -> Key {
        Key::new(b"tcp-notice-test-key-01".to_vec()).unwrap()
    }

    /// Runs the real handshake on `stream` as a receiver of `blocks` blocks of `block_size`
    /// bytes, and admits the sender.
    fn admit(stream: &mut TcpStream, blocks: u32, block_size: u32) {
        let settings = RegionSettings {
            access: super::super::AccessControl::new(
                super::super::Keys::shared(key()),
                4,
                crate::proto::Budget::unlimited(),
            ),
            ..RegionSettings::plain(blocks as usize, block_size as usize)
        };
        let admitted = server_handshake(stream, &settings, DataPath::Tcp, "tcp only", |_, _| {
            let welcome = Welcome {
                blocks,
                block_size,
                ..Welcome::refusal("")
            };
            Ok((welcome, ()))
        });
        assert!(admitted.is_ok(), "the handshake failed");
    }

    /// A peer that connects and hangs up without a word (a port probe, or a second receiver
    /// checking whether the address is taken) is refused as a bad handshake whose reason says
    /// so, rather than as a bare end of file; a peer that sends something else (an HTTP
    /// request) is told what it sent instead.
    #[test]
    fn a_peer_that_hangs_up_before_its_hello_is_named_a_probe() {
        // The peer sends `send` and hangs up.
        let refused = |send: &'static [u8]| {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let peer = std::thread::spawn(move || {
                let mut s = TcpStream::connect(addr).unwrap();
                s.write_all(send).unwrap();
            });
            let (mut stream, _) = listener.accept().unwrap();
            let settings = RegionSettings::plain(4, 256);
            let got = server_handshake(&mut stream, &settings, DataPath::Tcp, "", |_, _| {
                Ok((Welcome::refusal(""), ()))
            });
            drop(stream);
            peer.join().unwrap();
            match got {
                Err(r) => (r.kind, r.why),
                Ok(_) => panic!("admitted a peer that sent no hello"),
            }
        };
        let (kind, why) = refused(b"");
        assert_eq!(kind, RefusalKind::BadHandshake);
        assert!(why.contains("hung up before its first message"), "{why}");
        let (kind, why) = refused(b"\x10\x00");
        assert_eq!(kind, RefusalKind::BadHandshake);
        assert!(why.contains("hung up before its first message"), "{why}");
        let (kind, why) = refused(b"GET / HTTP/1.1\r\n\r\n");
        assert_eq!(kind, RefusalKind::BadHandshake);
        assert!(
            why.contains("no rdmastream handshake") && !why.contains("hung up"),
            "{why}"
        );
    }

    /// A receiver that runs the real handshake, then writes `after` raw onto the connection:
    /// what a hostile or broken receiver could send.
    fn hostile_receiver(after: Vec<u8>, then_close: bool) -> String {
        receiver_of(4, 256, after, then_close)
    }

    /// [`hostile_receiver`] with a region of `blocks` blocks of `block_size` bytes.
    fn receiver_of(blocks: u32, block_size: u32, after: Vec<u8>, then_close: bool) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            admit(&mut stream, blocks, block_size);
            stream.write_all(&after).unwrap();
            if then_close {
                return;
            }
            // Keep the connection open until the sender gave up on it.
            let mut sink = [0u8; 256];
            while matches!(stream.read(&mut sink), Ok(n) if n > 0) {}
        });
        addr
    }

    /// A receiver that runs the real handshake for a region of `blocks` blocks of `block_size`
    /// bytes, then reads nothing until told to (the `Sender`), and then every byte to the end of
    /// the connection, which come back on the `Receiver`.
    fn silent_receiver(
        blocks: u32,
        block_size: u32,
    ) -> (
        String,
        std::sync::mpsc::Sender<()>,
        std::sync::mpsc::Receiver<Vec<u8>>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (go, wait) = std::sync::mpsc::channel();
        let (count, counted) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            admit(&mut stream, blocks, block_size);
            let _ = wait.recv();
            let mut got = Vec::new();
            let _ = stream.read_to_end(&mut got);
            let _ = count.send(got);
        });
        (addr, go, counted)
    }

    /// A poll that may not wait (a thread handing a block over posts on an idle link) writes
    /// only what the socket takes at once, even when the receiver reads nothing: it returns at
    /// once, and the connection stays up. The next poll that may wait writes the rest, each byte
    /// once. Before, it waited in the socket for the whole peer timeout and failed.
    #[test]
    fn a_poll_that_may_not_wait_leaves_what_the_socket_does_not_take_to_the_next() {
        const BLOCK: usize = 32 << 20;
        let blocks = SendBlocks::new(1, BLOCK);
        blocks.fill(0, |b| b.fill(0x5A));
        let (addr, go, counted) = silent_receiver(2, BLOCK as u32);
        let mut conn = TcpConnector::new(addr)
            .with_peer_timeout(Duration::from_secs(3))
            .connect(&hello(), Some(&key()), &blocks)
            .unwrap();
        let chain = [
            WriteWr {
                source: WriteSource::SendBlock {
                    index: 0,
                    len: BLOCK,
                },
                remote: RemoteAddr {
                    target: Target::Blocks,
                    offset: 0,
                },
                signaled: false,
            },
            WriteWr {
                source: WriteSource::Inline(&[crate::proto::status::FULL]),
                remote: RemoteAddr {
                    target: Target::Statuses,
                    offset: 0,
                },
                signaled: true,
            },
        ];
        conn.post_write_chain(1, &chain).unwrap();
        let mut done = Vec::new();
        // 32 MiB is more than a loopback socket's buffers on both ends hold.
        conn.poll_completions(&mut done, Duration::ZERO)
            .expect("a poll that may not wait does not wait for the socket");
        assert!(done.is_empty());
        go.send(()).unwrap();
        // This receiver answers nothing: the poll only writes.
        conn.poll_completions(&mut done, Duration::from_millis(20))
            .unwrap();
        drop(conn);
        // On the wire: the chain, each byte once, then at most NOPs (the ask for its
        // acknowledgement).
        let wire = counted.recv_timeout(Duration::from_secs(20)).unwrap();
        let op = |at: usize| OpHeader::decode(wire[at..at + OP_HEADER].try_into().unwrap());
        let (write, data) = (op(0), &wire[OP_HEADER..OP_HEADER + BLOCK]);
        assert_eq!((write.op, write.len as usize), (OP_WRITE, BLOCK));
        assert!(data.iter().all(|&b| b == 0x5A), "the block's data");
        let status = op(OP_HEADER + BLOCK);
        assert_eq!((status.op, status.len), (OP_WRITE, 1));
        let mut at = 2 * OP_HEADER + BLOCK;
        assert_eq!(wire[at], crate::proto::status::FULL);
        at += 1;
        while at < wire.len() {
            assert_eq!(
                op(at).op,
                OP_NOP,
                "after the chain, at byte {at} of {}",
                wire.len()
            );
            at += OP_HEADER;
        }
        assert_eq!(at, wire.len());
    }

    fn notice(device: u8, len: usize) -> Vec<u8> {
        let mut b = OpHeader {
            op: OP_NOTICE,
            target: device,
            signaled: false,
            len: len as u32,
            offset: 0,
            wr_id: 0,
        }
        .encode()
        .to_vec();
        b.extend(std::iter::repeat_n(b'n', len));
        b
    }

    fn hello() -> Hello {
        crate::transport::test_hello("told", 1)
    }

    /// Polls until the connection yields notices or fails.
    fn poll(conn: &mut dyn Connection) -> std::result::Result<Vec<Notice>, String> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut done = Vec::new();
        while Instant::now() < deadline {
            conn.poll_completions(&mut done, Duration::from_millis(20))
                .map_err(|e| e.to_string())?;
            let got = conn.take_notices();
            if !got.is_empty() {
                return Ok(got);
            }
        }
        Err("nothing within 20 s".into())
    }

    #[test]
    fn a_notice_at_the_bound_arrives_and_one_over_it_fails_the_connection() {
        let blocks = SendBlocks::new(1, 256);
        let addr = hostile_receiver(notice(3, MAX_NOTICE_TEXT), false);
        let mut conn = TcpConnector::new(addr)
            .connect(&hello(), Some(&key()), &blocks)
            .unwrap();
        let got = poll(conn.as_mut()).expect("a notice of the largest size arrives");
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].device, 3);

        let addr = hostile_receiver(notice(3, MAX_NOTICE_TEXT + 1), false);
        let mut conn = TcpConnector::new(addr.clone())
            .connect(&hello(), Some(&key()), &blocks)
            .unwrap();
        let err = poll(conn.as_mut()).expect_err("an oversized notice ends the connection");
        assert!(
            err.contains(&format!("a notice of {} bytes", MAX_NOTICE_TEXT + 1))
                && err.contains(&addr),
            "the error names the peer and the size: {err}"
        );
        assert!(conn.take_notices().is_empty(), "nothing of it is kept");
    }

    /// The sender keeps at most 8 MiB of a tcp receiver's region FULL, at least 4 blocks, for
    /// blocks up to 4 MiB ([`tcp_cache_budget`]): 8 of 16 blocks of 1 MiB, 32 of 64 of 256 KiB,
    /// 4 of 16 of 2 and 4 MiB; no limit where the region is no larger than the budget (16 blocks
    /// of 512 KiB, 64 of 64 KiB) or the blocks are larger than 4 MiB (16 of 8 MiB). Without the
    /// budget the sending thread sets no limit and every case says `None`.
    #[test]
    fn a_tcp_sender_keeps_at_most_8_mib_of_the_receivers_blocks_full() {
        let blocks = SendBlocks::new(1, 256);
        for (n, size, limit) in [
            (16, 1 << 20, Some(8)),
            (64, 256 << 10, Some(32)),
            (16, 2 << 20, Some(4)),
            (16, 4 << 20, Some(4)),
            (16, 8 << 20, None),
            (16, 512 << 10, None),
            (64, 64 << 10, None),
        ] {
            let addr = receiver_of(n, size, Vec::new(), false);
            let conn = TcpConnector::new(addr)
                .connect(&hello(), Some(&key()), &blocks)
                .unwrap();
            assert_eq!(
                conn.cache_budget(),
                super::super::tcp_cache_budget(size as usize)
            );
            assert_eq!(
                super::super::max_full_blocks(conn.as_ref()),
                limit,
                "{n} blocks of {size} bytes"
            );
        }
        // The block size is the receiver's word (a u32 on the wire): a huge one gets no budget.
        assert_eq!(super::super::tcp_cache_budget(usize::MAX), None);
    }

    /// The sender's own blocks under the tcp budget ([`tcp_send_limits`], by the sender's block
    /// size): the filling thread's within 8 MiB where that is 8 blocks or more (none above 1 MiB:
    /// its blocks include lossless ones kept until a sync), a live device's in-place blocks
    /// within 8 MiB, at least 2, up to 4 MiB blocks; nothing above. A size whose product would
    /// wrap round to a few bytes gets no limit either.
    #[test]
    fn a_tcp_sender_keeps_8_mib_of_its_own_blocks_in_use() {
        use super::super::{SendLimits, TCP_BUDGET_MIN_BLOCKS, tcp_send_limits};
        for (size, filling, live) in [
            (64 << 10, Some(128), Some(128)),
            (1 << 20, Some(8), Some(8)),
            (2 << 20, None, Some(4)),
            (4 << 20, None, Some(2)),
            (8 << 20, None, None),
        ] {
            assert_eq!(
                tcp_send_limits(size),
                SendLimits {
                    filling,
                    live_in_place: live
                },
                "{size}-byte blocks"
            );
            let conn_limits = {
                let addr = receiver_of(16, size as u32, Vec::new(), false);
                TcpConnector::new(addr)
                    .connect(&hello(), Some(&key()), &SendBlocks::new(1, 256))
                    .unwrap()
                    .send_limits(size)
            };
            assert_eq!(conn_limits, tcp_send_limits(size));
        }
        let wraps = usize::MAX / TCP_BUDGET_MIN_BLOCKS + 2;
        assert_eq!(tcp_send_limits(wraps), SendLimits::default());
    }

    #[test]
    fn a_notice_cut_short_by_the_receiver_fails_the_connection() {
        let blocks = SendBlocks::new(1, 256);
        let mut cut = notice(1, 100);
        cut.truncate(OP_HEADER + 40);
        // The receiver writes part of the notice, then closes.
        let addr = hostile_receiver(cut, true);
        let mut conn = TcpConnector::new(addr)
            .connect(&hello(), Some(&key()), &blocks)
            .unwrap();
        let err = poll(conn.as_mut()).expect_err("a cut notice ends the connection");
        assert!(err.contains("notice"), "{err}");
    }

    /// A sender whose handshake a listener completed, but whose connection no receiver took
    /// before the listener was dropped (a receiver stopping while the sender reconnects), is
    /// disconnected, so it goes on to reconnect. It used to stay connected to a NIC thread that
    /// answered its heartbeats from a region nobody polled: a flake of the engine's reconnect
    /// test, whose sender synced that region thousands of times and never got a block free.
    #[test]
    fn a_connection_no_receiver_took_ends_with_its_listener() {
        let blocks = SendBlocks::new(1, 256);
        let listener = listen("127.0.0.1:0", RegionSettings::plain(4, 256)).unwrap();
        let mut conn = TcpConnector::new(listener.local_addr())
            .connect(&hello(), None, &blocks)
            .unwrap();
        drop(listener);
        // As the sending thread does when idle: heartbeats, so only the receiver's side can
        // end the connection (the NIC thread's peer timeout does not).
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut done = Vec::new();
        let err = loop {
            assert!(
                Instant::now() < deadline,
                "the connection lived on for 20 s"
            );
            if let Err(e) = conn
                .heartbeat()
                .and_then(|()| conn.poll_completions(&mut done, Duration::from_millis(20)))
            {
                break e.to_string();
            }
        };
        assert!(
            !err.contains("timeout"),
            "ended by the receiver, not a timeout: {err}"
        );
    }

    /// How often the thread of this process named `name` (at most 15 bytes, as Linux keeps
    /// it) gave up the CPU of its own accord so far: one per sleep it woke from.
    fn voluntary_switches(name: &str) -> u64 {
        let task = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .map(|t| t.unwrap().path())
            .find(|t| std::fs::read_to_string(t.join("comm")).is_ok_and(|c| c.trim() == name))
            .unwrap_or_else(|| panic!("no thread named {name}"));
        let status = std::fs::read_to_string(task.join("status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// An idle listener's accepting thread sleeps until a connection comes or the listener is
    /// dropped: it does not wake to look (it slept 5 ms at a time, 200 wake-ups a second for an
    /// idle receiver), it takes a connection at once, and the drop ends it at once.
    #[test]
    fn an_idle_listener_sleeps_until_a_connection_or_its_drop() {
        let listener = SideChannelListener::bind("idle", "127.0.0.1:0", |mut stream| {
            stream.write_all(b"hi").unwrap();
            Err(Refusal {
                peer: "test".into(),
                why: "only greeted".into(),
                kind: RefusalKind::BadHandshake,
            })
        })
        .unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let before = voluntary_switches("idle-accept");
        std::thread::sleep(Duration::from_millis(300));
        let woken = voluntary_switches("idle-accept") - before;
        assert!(
            woken <= 2,
            "the idle accepting thread woke {woken} times in 300 ms"
        );
        // Still serving: a connection is taken and handed to the handshake.
        let mut stream = TcpStream::connect(listener.local_addr()).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut hi = [0u8; 2];
        stream.read_exact(&mut hi).unwrap();
        assert_eq!(&hi, b"hi");
        // On a thread of its own, so a drop that never returns fails the test, not hangs it.
        let (dropped_tx, dropped) = crossbeam_channel::bounded(1);
        std::thread::spawn(move || {
            drop(listener);
            let _ = dropped_tx.send(());
        });
        assert!(
            dropped.recv_timeout(Duration::from_secs(20)).is_ok(),
            "the drop did not return in 20 s"
        );
    }

    /// A refused handshake gives its slot back before the refusal goes out: a sender that
    /// reconnects the moment it reads one is answered again, with a reason, however long the
    /// refused handshake's thread takes to end (here 300 ms each, so without that five of them
    /// would hold the address's four slots and the fifth would be closed without a word).
    #[test]
    fn refused_handshakes_from_one_address_do_not_hold_its_slots() {
        let listener = SideChannelListener::bind("slots", "127.0.0.1:0", |mut stream| {
            let r = refuse(
                &mut stream,
                "test",
                RefusalKind::BadHandshake,
                "refused for the test".into(),
            );
            std::thread::sleep(Duration::from_millis(300));
            Err(r)
        })
        .unwrap();
        for attempt in 1..=2 * MAX_HANDSHAKES_PER_ADDRESS {
            let mut stream = TcpStream::connect(listener.local_addr()).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(20)))
                .unwrap();
            let mut answer = Vec::new();
            let _ = stream.read_to_end(&mut answer);
            assert!(
                String::from_utf8_lossy(&answer).contains("refused for the test"),
                "connection {attempt} was closed without the refusal ({} bytes)",
                answer.len()
            );
        }
    }

    fn ack(wr_id: u64) -> Vec<u8> {
        OpHeader {
            op: OP_ACK,
            target: 0,
            signaled: true,
            len: 0,
            offset: 0,
            wr_id,
        }
        .encode()
        .to_vec()
    }

    #[test]
    fn an_answer_to_a_request_never_posted_fails_the_connection() {
        let blocks = SendBlocks::new(1, 256);
        let addr = hostile_receiver(ack(99), false);
        let mut conn = TcpConnector::new(addr.clone())
            .connect(&hello(), Some(&key()), &blocks)
            .unwrap();
        let err = poll(conn.as_mut()).expect_err("a stray ACK ends the connection");
        assert!(
            err.contains("an answer to request 99, which is not waiting") && err.contains(&addr),
            "{err}"
        );
    }

    #[test]
    fn one_wire_ack_completes_the_chains_before_it_in_order() {
        let mut acks = WireAcks::default();
        let wire: Vec<bool> = (1..=8).map(|id| acks.post(id, true)).collect();
        assert_eq!(
            wire,
            [false, false, false, true, false, false, false, true],
            "every ACK_EVERY-th chain is acknowledged on the wire"
        );
        assert_eq!(acks.ask(), None, "an acknowledgement is on its way");
        let mut done = Vec::new();
        acks.answered(4, |id| done.push(id)).unwrap();
        assert_eq!(
            done,
            [1, 2, 3],
            "the chains before 4 complete first, in order"
        );
        // Out of order: 8 is next on the wire, not 7.
        let err = acks.answered(7, |_| {}).unwrap_err();
        assert!(err.contains("request 7 where 8 was next"), "{err}");
        done.clear();
        acks.answered(8, |id| done.push(id)).unwrap();
        assert_eq!(done, [5, 6, 7]);
        // A chain alone, then a READ (always acknowledged): the READ's answer completes it.
        assert!(!acks.post(9, true));
        assert!(acks.post(10, false));
        done.clear();
        acks.answered(10, |id| done.push(id)).unwrap();
        assert_eq!(done, [9]);
        // Chains nothing on the wire will acknowledge: the last is asked for.
        assert!(!acks.post(11, true) && !acks.post(12, true));
        assert_eq!(acks.ask(), Some(12));
        assert_eq!(acks.ask(), None, "asked once");
        done.clear();
        acks.answered(12, |id| done.push(id)).unwrap();
        assert_eq!(done, [11]);
        assert!(acks.answered(12, |_| {}).is_err(), "nothing waits any more");
    }

    fn op(op: u8, target: Target, offset: u64, len: usize, wr_id: u64) -> Vec<u8> {
        OpHeader {
            op,
            target: target as u8,
            signaled: true,
            len: len as u32,
            offset,
            wr_id,
        }
        .encode()
        .to_vec()
    }

    /// The NIC tests' blocks (of [`NIC_TEST_BLOCK`] bytes) and what is written into them: a
    /// large block, a small one, the large one again into another block (what follows a large
    /// WRITE is often the next).
    const NIC_TEST_BLOCK: usize = 256 * 1024;
    fn nic_test_writes() -> Vec<(usize, Vec<u8>)> {
        let big: Vec<u8> = (0..200_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let small: Vec<u8> = (0..1000u32).map(|i| (i * 13) as u8).collect();
        vec![(0, big.clone()), (1, small), (2, big)]
    }

    /// Each of `writes` as a WRITE of its block followed by the WRITE of its status byte (FULL).
    fn writes_with_statuses(writes: &[(usize, Vec<u8>)]) -> Vec<u8> {
        let mut input = Vec::new();
        for (block, data) in writes {
            input.extend(op(
                OP_WRITE,
                Target::Blocks,
                (block * NIC_TEST_BLOCK) as u64,
                data.len(),
                1,
            ));
            input.extend(data.iter());
            input.extend(op(OP_WRITE, Target::Statuses, *block as u64, 1, 2));
            input.push(1);
        }
        input
    }

    /// Every one of `writes` is in its block, byte for byte, and its status FULL; block 3 was
    /// not written.
    fn assert_placed(region: &SoftRegion, writes: &[(usize, Vec<u8>)], how: &str) {
        for (block, data) in writes {
            let mut got = Vec::new();
            region.read_block(*block, &mut |b| got = b[..data.len()].to_vec());
            assert!(got == *data, "block {block} placed exactly ({how})");
            assert_eq!(region.status(*block), 1);
        }
        assert_eq!(region.status(3), 0);
    }

    #[test]
    fn the_nic_places_large_and_small_writes_exactly_however_the_bytes_arrive() {
        let writes = nic_test_writes();
        // The writes with their statuses, then a READ.
        let mut input = writes_with_statuses(&writes);
        input.extend(op(OP_READ, Target::Statuses, 0, 4, 3));
        for chunk in [1, 7, 4000, 70_000, usize::MAX] {
            let region = SoftRegion::new(&RegionSettings::plain(4, NIC_TEST_BLOCK));
            let mut r = NicReader::new(Trickle {
                data: &input,
                chunk,
                reads: 0,
                past_buffer: 0,
            });
            let mut out = Vec::new();
            let end = serve_requests(&mut r, &mut out, &region, Duration::from_secs(1));
            assert!(end.unwrap_err().contains("closed"), "the input ran out");
            assert_placed(&region, &writes, &format!("chunks of {chunk}"));
            // Six ACKs, then the READ's answer with the four status bytes.
            let read = &out[6 * OP_HEADER..];
            assert_eq!(read.len(), OP_HEADER + 4, "chunks of {chunk}");
            assert_eq!(&read[OP_HEADER..], [1, 1, 1, 0]);
            if chunk == usize::MAX {
                // Large data goes past the buffer: few reads, each request not read apart. The
                // first fill takes in the first 256 KiB whole; most of the second large WRITE,
                // which follows it, is read straight into the region.
                // Three reads: the first fill; the rest of the second large WRITE straight into
                // the region, with everything after it in the same read; the end of the stream
                // (four when the requests after a large WRITE need a read of their own).
                assert!(r.inner.reads <= 3, "{} reads", r.inner.reads);
                assert!(
                    r.inner.past_buffer >= 100_000,
                    "only {} bytes read past the buffer",
                    r.inner.past_buffer
                );
            }
        }
    }

    /// Over a real socket, with the NIC looking for bytes for 500 µs before it sleeps: bytes
    /// that come within the spin, and after it (so the NIC sleeps in `readv` and is woken), are
    /// placed exactly as without it, and the end of the stream ends it as before.
    #[test]
    fn a_spinning_nic_places_writes_exactly_whether_the_bytes_come_within_its_spin_or_after() {
        let writes = nic_test_writes();
        let input = writes_with_statuses(&writes);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let writer = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_nodelay(true).unwrap();
            // Pauses well within the spin, and well past it, in turn.
            for (i, piece) in input.chunks(9_000).enumerate() {
                s.write_all(piece).unwrap();
                let pause = if i % 4 == 3 { 5_000 } else { 50 };
                std::thread::sleep(Duration::from_micros(pause));
            }
        });
        let (stream, _) = listener.accept().unwrap();
        let region = SoftRegion::new(&RegionSettings::plain(4, NIC_TEST_BLOCK));
        let mut r = NicReader::new(stream).spinning(Duration::from_micros(500));
        let mut out = Vec::new();
        let end = serve_requests(&mut r, &mut out, &region, Duration::from_secs(5));
        writer.join().unwrap();
        assert!(end.unwrap_err().contains("closed"), "the stream ended");
        assert_placed(&region, &writes, "over a socket, spinning");
        assert_eq!(out.len(), 6 * OP_HEADER, "six ACKs");
        // Both ways were taken: reads that found their bytes while looking, and reads that slept
        // through a long pause (36 and 11 on the development machine; the bounds leave room for
        // a loaded one, where a pause may pass while the NIC thread is not running at all).
        assert!(
            r.looked >= 5,
            "{} reads found bytes while looking",
            r.looked
        );
        assert!(r.slept >= 1, "{} reads slept", r.slept);
    }

    /// A receiver restarted after a kill -9 finds its old socket file: nobody listens on it, so
    /// it is replaced. A socket a live receiver holds, or a file that is not a socket, is left
    /// alone, and the error says which of the two is in the way.
    #[test]
    fn a_stale_socket_is_replaced_but_never_a_live_one_or_another_file() {
        let dir = std::env::temp_dir().join(format!("rdmastream-bind-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rx.sock");
        let _ = std::fs::remove_file(&path);

        drop(UnixListener::bind(&path).unwrap());
        assert!(
            path.exists(),
            "a dropped listener leaves its file, as a killed receiver does"
        );
        let live = bind_unix_socket(&path).expect("a stale socket is replaced");
        UnixStream::connect(&path).expect("the new listener answers");

        let err = bind_unix_socket(&path).expect_err("a live receiver's socket is kept");
        assert!(
            err.to_string()
                .contains("something is already listening there"),
            "{err}"
        );
        UnixStream::connect(&path).expect("and it still answers");
        drop(live);

        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, b"notes").unwrap();
        let err = bind_unix_socket(&path).expect_err("a regular file is kept");
        assert!(err.to_string().contains("not a socket"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"notes");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
