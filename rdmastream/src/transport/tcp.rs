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

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;

use super::{
    Accepted, Completion, Connection, Connector, Listener, Refusal, RegionSettings, RemoteAddr,
    SendBlocks, SoftRegion, Target, WriteSource, WriteWr, check_hello,
};
use crate::error::{Error, Result, spawn};
use crate::proto::RemoteLayout;
use crate::proto::handshake::{DataPath, Hello, MAX_MESSAGE, Welcome};

const OP_WRITE: u8 = 1;
const OP_READ: u8 = 2;
const OP_ACK: u8 = 3;
const OP_READ_RESP: u8 = 4;
const OP_ERROR: u8 = 5;
const OP_HEADER: usize = 24;
/// How long a peer may take to complete the handshake.
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

/// Writes one length-prefixed handshake message.
pub(crate) fn send_message(stream: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    let mut framed = Vec::with_capacity(4 + body.len());
    framed.extend_from_slice(&(body.len() as u32).to_le_bytes());
    framed.extend_from_slice(body);
    stream.write_all(&framed)
}

/// Reads one length-prefixed handshake message (bounded by [`MAX_MESSAGE`]).
pub(crate) fn recv_message(stream: &mut TcpStream) -> std::result::Result<Vec<u8>, String> {
    let mut len = [0u8; 4];
    stream
        .read_exact(&mut len)
        .map_err(|e| format!("reading message length: {e}"))?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE {
        return Err(format!(
            "message of {len} bytes is over the {MAX_MESSAGE}-byte limit"
        ));
    }
    let mut body = vec![0u8; len];
    stream
        .read_exact(&mut body)
        .map_err(|e| format!("reading {len}-byte message: {e}"))?;
    Ok(body)
}

/// The sender's half of the handshake on a new side-channel connection to `peer`: sends
/// `hello`, returns the stream (read timeout cleared) and the receiver's Welcome; a refusal is
/// [`Error::Refused`] with the receiver's reason.
pub(crate) fn client_handshake(peer: &str, hello: &Hello) -> Result<(TcpStream, Welcome)> {
    let connect_err = |source| Error::Connect {
        peer: peer.to_string(),
        source,
    };
    let sock = resolve(peer).map_err(connect_err)?;
    let mut stream =
        TcpStream::connect_timeout(&sock, Duration::from_secs(3)).map_err(connect_err)?;
    stream.set_nodelay(true).map_err(connect_err)?;
    let hs_err = |reason: String| Error::Handshake {
        peer: peer.to_string(),
        reason,
    };
    stream
        .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .map_err(|e| hs_err(e.to_string()))?;
    send_message(&mut stream, &hello.encode())
        .map_err(|e| hs_err(format!("sending hello: {e}")))?;
    let body = recv_message(&mut stream).map_err(hs_err)?;
    let welcome = Welcome::decode(&body).map_err(|e| hs_err(format!("bad welcome: {e}")))?;
    if !welcome.error.is_empty() {
        return Err(Error::Refused {
            peer: peer.to_string(),
            reason: welcome.error,
        });
    }
    stream
        .set_read_timeout(None)
        .map_err(|e| hs_err(e.to_string()))?;
    Ok((stream, welcome))
}

/// Refuses a connection: logs why with the peer, answers with a refusal, closes.
pub(crate) fn refuse(stream: &mut TcpStream, peer: &str, why: String) -> Refusal {
    tracing::warn!(%peer, "rejected connection: {why}");
    let _ = send_message(stream, &Welcome::refusal(why.clone()).encode());
    let _ = stream.shutdown(Shutdown::Both);
    Refusal {
        peer: peer.to_string(),
        why,
    }
}

/// A sender that went away after its Hello was accepted, before the handshake completed.
pub(crate) fn lost(peer: &str, sender: &str, e: impl std::fmt::Display) -> Refusal {
    let why = format!("sender '{sender}' closed the connection during the handshake: {e}");
    tracing::warn!(%peer, "{why}");
    Refusal {
        peer: peer.to_string(),
        why,
    }
}

/// The receiver's first half of the handshake: reads and validates the Hello (format, data
/// path, token). On any problem the connection is refused and the refusal returned; nothing has
/// been allocated for it yet. Returns the peer's address too, for logs.
pub(crate) fn server_hello(
    stream: &mut TcpStream,
    settings: &RegionSettings,
    path: DataPath,
    wrong_path: &str,
) -> std::result::Result<(Hello, String), Refusal> {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "unknown peer".into());
    let _ = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let _ = stream.set_nodelay(true);
    let hello = recv_message(stream).and_then(|b| Hello::decode(&b).map_err(|e| e.to_string()));
    let hello = match hello {
        Ok(h) => h,
        Err(e) => return Err(refuse(stream, &peer, format!("bad handshake: {e}"))),
    };
    if hello.data_path != path {
        return Err(refuse(stream, &peer, wrong_path.to_string()));
    }
    if let Err(why) = check_hello(&hello, settings) {
        return Err(refuse(
            stream,
            &peer,
            format!("sender '{}': {why}", hello.sender),
        ));
    }
    Ok((hello, peer))
}

pub(crate) fn resolve(addr: &str) -> std::io::Result<SocketAddr> {
    addr.to_socket_addrs()?.next().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::NotFound, "address resolves to nothing")
    })
}

/// Connects senders to a receiver over TCP.
pub struct TcpConnector {
    addr: String,
}

impl TcpConnector {
    /// A connector to `host:port`.
    pub fn new(addr: impl Into<String>) -> TcpConnector {
        TcpConnector { addr: addr.into() }
    }
}

impl Connector for TcpConnector {
    fn transport(&self) -> &'static str {
        "tcp"
    }
    fn peer(&self) -> String {
        self.addr.clone()
    }
    fn connect(&self, hello: &Hello, blocks: &Arc<SendBlocks>) -> Result<Box<dyn Connection>> {
        let peer = self.addr.clone();
        let hello = Hello {
            data_path: DataPath::Tcp,
            ..hello.clone()
        };
        let (stream, welcome) = client_handshake(&peer, &hello)?;
        let connect_err = |source| Error::Connect {
            peer: peer.clone(),
            source,
        };
        let layout = RemoteLayout {
            blocks: welcome.blocks as usize,
            block_size: welcome.block_size as usize,
        };
        let (tx, rx) = crossbeam_channel::unbounded();
        let read_buffer = Arc::new(Mutex::new(Vec::new()));
        let reader = stream.try_clone().map_err(connect_err)?;
        let buf = read_buffer.clone();
        let reader_peer = peer.clone();
        spawn(format!("tcp-completions-{peer}"), move || {
            completion_reader(reader, reader_peer, tx, buf)
        })?;
        Ok(Box::new(TcpConnection {
            peer,
            layout,
            stream,
            pending: Vec::with_capacity(2 * SMALL_WRITE),
            blocks: blocks.clone(),
            completions: rx,
            read_buffer,
        }))
    }
}

enum Event {
    Done(Completion),
    Failed(String),
}

fn completion_reader(
    stream: TcpStream,
    peer: String,
    tx: Sender<Event>,
    read_buffer: Arc<Mutex<Vec<u8>>>,
) {
    let mut r = BufReader::with_capacity(16 * 1024, stream);
    let fail = |tx: &Sender<Event>, why: String| {
        let _ = tx.send(Event::Failed(why));
    };
    loop {
        let mut hb = [0u8; OP_HEADER];
        if let Err(e) = r.read_exact(&mut hb) {
            return fail(&tx, format!("receiver closed the connection ({e})"));
        }
        let h = OpHeader::decode(&hb);
        match h.op {
            OP_ACK => {}
            OP_READ_RESP => {
                let mut data = vec![0u8; h.len as usize];
                if let Err(e) = r.read_exact(&mut data) {
                    return fail(&tx, format!("reading READ response: {e}"));
                }
                *read_buffer.lock() = data;
            }
            OP_ERROR => {
                let mut text = vec![0u8; (h.len as usize).min(4096)];
                let _ = r.read_exact(&mut text);
                return fail(
                    &tx,
                    format!("remote access error: {}", String::from_utf8_lossy(&text)),
                );
            }
            other => {
                return fail(
                    &tx,
                    format!("protocol error from {peer}: unknown operation {other}"),
                );
            }
        }
        if tx.send(Event::Done(Completion { wr_id: h.wr_id })).is_err() {
            return;
        }
    }
}

/// The sender's end of a TCP-emulated connection.
pub struct TcpConnection {
    peer: String,
    layout: RemoteLayout,
    stream: TcpStream,
    /// Operation headers and small data not yet written.
    pending: Vec<u8>,
    blocks: Arc<SendBlocks>,
    completions: Receiver<Event>,
    read_buffer: Arc<Mutex<Vec<u8>>>,
}

impl TcpConnection {
    fn lost(&self, reason: impl std::fmt::Display) -> Error {
        Error::Disconnected {
            peer: self.peer.clone(),
            reason: reason.to_string(),
        }
    }

    fn flush(&mut self) -> Result<()> {
        if !self.pending.is_empty() {
            let r = self.stream.write_all(&self.pending);
            self.pending.clear();
            r.map_err(|e| self.lost(format!("sending: {e}")))?;
        }
        Ok(())
    }

    fn handle(&mut self, event: Event, out: &mut Vec<Completion>) -> Result<()> {
        match event {
            Event::Done(c) => {
                out.push(c);
                Ok(())
            }
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

/// Writes `head` then `data` with as few system calls as possible, then empties `head`.
fn write_both(stream: &mut TcpStream, head: &mut Vec<u8>, data: &[u8]) -> std::io::Result<()> {
    let (mut h, mut d) = (&head[..], data);
    while !h.is_empty() || !d.is_empty() {
        let n = stream.write_vectored(&[std::io::IoSlice::new(h), std::io::IoSlice::new(d)])?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        let from_h = n.min(h.len());
        h = &h[from_h..];
        d = &d[n - from_h..];
    }
    head.clear();
    Ok(())
}

impl Connection for TcpConnection {
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
                signaled: wr.signaled,
                len: len as u32,
                offset: wr.remote.offset,
                wr_id,
            };
            self.pending.extend_from_slice(&h.encode());
            let r = match wr.source {
                // Small data is batched; large data goes out with what is batched in one writev,
                // straight from the send block (no extra user-space copy).
                WriteSource::SendBlock { index, len } if len >= SMALL_WRITE => {
                    let pending = &mut self.pending;
                    let stream = &mut self.stream;
                    self.blocks
                        .read(index, len, |b| write_both(stream, pending, b))
                }
                WriteSource::SendBlock { index, len } => {
                    self.blocks
                        .read(index, len, |b| self.pending.extend_from_slice(b));
                    Ok(())
                }
                WriteSource::Inline(b) => {
                    self.pending.extend_from_slice(b);
                    Ok(())
                }
            };
            r.map_err(|e| self.lost(format!("sending WRITE: {e}")))?;
        }
        if self.pending.len() >= SMALL_WRITE {
            self.flush()?;
        }
        Ok(())
    }
    fn post_read(&mut self, wr_id: u64, remote: RemoteAddr, len: usize) -> Result<()> {
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
        self.flush()?;
        match self.completions.recv_timeout(timeout) {
            Ok(ev) => self.handle(ev, out)?,
            Err(RecvTimeoutError::Timeout) => return Ok(()),
            Err(RecvTimeoutError::Disconnected) => return Err(self.lost("completion thread ended")),
        }
        while let Ok(ev) = self.completions.try_recv() {
            self.handle(ev, out)?;
        }
        Ok(())
    }
    fn read_buffer(&self) -> Vec<u8> {
        self.read_buffer.lock().clone()
    }
}

/// The receiver's listening side of a transport whose connections start on a TCP side channel
/// (tcp itself, and verbs): a thread accepts connections and runs each handshake on a thread of
/// its own, queueing the senders that completed it and the connections refused.
///
/// Dropping it stops the accepting thread and waits for it, so the listening socket is closed
/// and the address can be bound again as soon as the drop returns (a receiver restarted in the
/// same process must not see "address in use").
pub struct SideChannelListener {
    transport: &'static str,
    local: String,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    accepted: Receiver<Accepted>,
    refused: Receiver<Refusal>,
}

/// How long the accepting thread sleeps when no connection is pending; bounds how late a drop
/// returns and how late a connection is picked up.
const ACCEPT_POLL: Duration = Duration::from_millis(5);

/// Handshakes in progress at most (each on its own thread, for up to `HANDSHAKE_TIMEOUT`);
/// connections beyond are closed at once.
const MAX_HANDSHAKES: usize = 64;

impl SideChannelListener {
    /// Binds `addr` and accepts on it in a thread named after `transport` until dropped; each
    /// connection (blocking again) goes to `handshake` on a thread of its own.
    pub(crate) fn bind(
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
        let (accepted_tx, accepted) = crossbeam_channel::unbounded();
        let (refused_tx, refused) = crossbeam_channel::bounded(super::MAX_REFUSALS);
        let handshake = Arc::new(handshake);
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let handshakes = Arc::new(AtomicUsize::new(0));
        let thread_name = format!("{transport}-accept");
        let thread = spawn(thread_name, move || {
            while !stopping.load(Ordering::Acquire) {
                match listener.accept() {
                    Ok((stream, peer)) => {
                        if handshakes.load(Ordering::Acquire) >= MAX_HANDSHAKES {
                            // A flood of idle connections must not become a flood of threads.
                            tracing::debug!(%peer, "too many handshakes in progress; closed");
                            let _ = refused_tx.try_send(Refusal {
                                peer: peer.to_string(),
                                why: format!(
                                    "closed at once: {MAX_HANDSHAKES} handshakes already in progress"
                                ),
                            });
                            continue;
                        }
                        if stream.set_nonblocking(false).is_err() {
                            continue;
                        }
                        let (handshake, accepted_tx, refused_tx, handshakes) = (
                            handshake.clone(),
                            accepted_tx.clone(),
                            refused_tx.clone(),
                            handshakes.clone(),
                        );
                        handshakes.fetch_add(1, Ordering::AcqRel);
                        let _ = spawn(format!("{transport}-handshake"), move || {
                            let result = handshake(stream);
                            handshakes.fetch_sub(1, Ordering::AcqRel);
                            match result {
                                Ok(a) => {
                                    let _ = accepted_tx.send(a);
                                }
                                // Full: nobody reads them; they were logged anyway.
                                Err(r) => {
                                    let _ = refused_tx.try_send(r);
                                }
                            }
                        });
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(ACCEPT_POLL)
                    }
                    Err(e) => {
                        // Out of descriptors and the like: say so, keep serving.
                        tracing::debug!("accept failed: {e}");
                        std::thread::sleep(ACCEPT_POLL);
                    }
                }
            }
        })?;
        Ok(SideChannelListener {
            transport,
            local,
            stop,
            thread: Some(thread),
            accepted,
            refused,
        })
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
        Ok(self.accepted.recv_timeout(timeout).ok())
    }
    fn refusals(&mut self) -> Vec<Refusal> {
        self.refused.try_iter().collect()
    }
}

impl Drop for SideChannelListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Listens for senders of the tcp transport on `addr`; each gets a region from `settings`, and a
/// thread that plays the NIC for its connection.
pub fn listen(addr: &str, settings: RegionSettings) -> Result<SideChannelListener> {
    SideChannelListener::bind("tcp", addr, move |stream| handshake(stream, &settings))
}

/// Runs the receiver's half of the handshake. On any problem logs one line naming the peer,
/// closes the connection and returns why; nothing is allocated before the Hello is valid.
fn handshake(
    mut stream: TcpStream,
    settings: &RegionSettings,
) -> std::result::Result<Accepted, Refusal> {
    let (hello, peer) = server_hello(
        &mut stream,
        settings,
        DataPath::Tcp,
        "this receiver speaks the tcp transport only",
    )?;
    let region = SoftRegion::new(settings);
    let welcome = Welcome {
        blocks: settings.blocks as u32,
        block_size: settings.block_size as u32,
        ..Welcome::refusal("")
    };
    if let Err(e) = send_message(&mut stream, &welcome.encode()) {
        return Err(lost(&peer, &hello.sender, e));
    }
    if let Err(e) = stream.set_read_timeout(None) {
        return Err(lost(&peer, &hello.sender, e));
    }
    if let Ok(link) = stream.try_clone() {
        region.attach_link(link);
    }
    let nic_region = region.clone();
    let nic_peer = peer.clone();
    spawn(format!("tcp-nic-{}", hello.sender), move || {
        if let Err(why) = emulate_nic(stream, &nic_region) {
            tracing::debug!(peer = %nic_peer, "connection ended: {why}");
        }
        nic_region.close();
    })
    .map_err(|e| {
        let why = format!("sender '{}': {e}", hello.sender);
        tracing::warn!(%peer, "dropped connection: {why}");
        Refusal {
            peer: peer.clone(),
            why,
        }
    })?;
    Ok(Accepted {
        hello,
        peer,
        region,
    })
}

/// Plays the NIC for one connection until it ends.
fn emulate_nic(stream: TcpStream, region: &SoftRegion) -> std::result::Result<(), String> {
    let mut out =
        BufWriter::with_capacity(16 * 1024, stream.try_clone().map_err(|e| e.to_string())?);
    let mut r = BufReader::with_capacity(256 * 1024, stream);
    loop {
        let mut hb = [0u8; OP_HEADER];
        if let Err(e) = r.read_exact(&mut hb) {
            let _ = out.flush();
            return Err(format!("sender closed the connection ({e})"));
        }
        let h = OpHeader::decode(&hb);
        let target = target_of(h.target);
        let access_error = |out: &mut BufWriter<TcpStream>, why: String| {
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
            (OP_WRITE, Some(target)) => {
                let len = h.len as usize;
                match region.write_with(target, h.offset, len, |dst| r.read_exact(dst)) {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(format!("reading WRITE data: {e}")),
                    Err(e) => return access_error(&mut out, e.0),
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
                Err(e) => return access_error(&mut out, e.0),
            },
            _ => {
                return access_error(
                    &mut out,
                    format!("unknown operation {} on target {}", h.op, h.target),
                );
            }
        }
        // Acknowledge in batches: flush once no more requests are already buffered.
        if r.buffer().is_empty() {
            out.flush().map_err(|e| e.to_string())?;
        }
    }
}
