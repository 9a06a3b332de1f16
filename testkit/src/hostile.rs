//! A scripted hostile peer: everything a machine on a shared edge network could send a receiver
//! (or, as a fake receiver, a sender), written from the byte layouts in docs/protocol.md rather
//! than with the code under test where that code would hide a mistake. The process tests
//! (`integration/tests/hostile.rs`) and `bench soak` use it.
//!
//! Each attack is a function that does its damage and returns; none of them waits for the
//! receiver to recover (the caller checks that).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use rdmastream::proto::handshake::{
    AuthKind, Challenge, DataPath, Hello, Key, NONCE_LEN, PROOF_LEN, PROTOCOL_VERSION, Proof,
    QpInfo, Welcome,
};
use rdmastream::proto::{BlockHeader, NO_PTS, header::flags, status};

/// A TCP connection to `addr` (`host:port`) from the local address `from` (any 127.0.0.0/8
/// address is local on Linux: one test can be several machines).
pub fn connect_from(from: &str, addr: &str) -> std::io::Result<TcpStream> {
    let remote: SocketAddr = addr
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{e}")))?;
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(remote),
        socket2::Type::STREAM,
        None,
    )?;
    let local: SocketAddr = format!("{from}:0")
        .parse()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{e}")))?;
    sock.bind(&local.into())?;
    sock.connect_timeout(&remote.into(), Duration::from_secs(3))?;
    Ok(sock.into())
}

/// Writes a length-prefixed handshake message.
pub fn send_message(s: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    let mut framed = (body.len() as u32).to_le_bytes().to_vec();
    framed.extend_from_slice(body);
    s.write_all(&framed)
}

/// Reads a length-prefixed handshake message (at most 64 KiB).
pub fn recv_message(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > 65536 {
        return Err(std::io::Error::other(format!("{len}-byte message")));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    Ok(body)
}

/// A Hello for the tcp data path.
pub fn hello(name: &str, session: u64) -> Hello {
    Hello {
        version: PROTOCOL_VERSION,
        sender: name.into(),
        session,
        block_size: 0,
        data_path: DataPath::Tcp,
        qp: QpInfo::default(),
        nonce: [0x42; NONCE_LEN],
        mechanism: Default::default(),
    }
}

/// An authenticated tcp connection as sender `name` (the code under test does the handshake:
/// what follows is the attack).
///
/// A connection the receiver closes without a word is tried again, for up to a second, as a
/// sender reconnects: that is the per-address handshake limit. Since 2026-11-27 a handshake
/// gives its slot back before its refusal or welcome goes out, so only handshakes really in
/// progress count (a peer that hung up mid-handshake, until its thread sees it); until then a
/// test that tried three names and then a fourth connection on a loaded machine saw
/// "connection reset" for the fourth, and the retry stays for what is left.
pub fn authenticated(
    addr: &str,
    name: &str,
    key: Option<&str>,
    session: u64,
) -> rdmastream::Result<(TcpStream, Welcome)> {
    let key = key.map(|k| Key::new(k.as_bytes().to_vec()).expect("test key"));
    again_while_closed_silently(
        || rdmastream::transport::tcp::client_handshake(addr, &hello(name, session), key.as_ref()),
        |r| matches!(r, Err(e) if e.to_string().contains("reading message length")),
    )
}

/// Runs a handshake `attempt` again, 20 ms apart for up to a second, while `silent` says the
/// receiver closed it without a word: the per-address handshake limit (see [`authenticated`]).
/// The last attempt's outcome is returned whatever it is.
fn again_while_closed_silently<T>(
    mut attempt: impl FnMut() -> T,
    silent: impl Fn(&T) -> bool,
) -> T {
    for _ in 1..50 {
        let outcome = attempt();
        if !silent(&outcome) {
            return outcome;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    attempt()
}

/// Operation codes and targets of the tcp data path (docs/protocol.md).
pub const OP_WRITE: u8 = 1;
pub const OP_READ: u8 = 2;
pub const TARGET_BLOCKS: u8 = 0;
pub const TARGET_STATUSES: u8 = 1;

/// One 24-byte operation header.
pub fn op(op: u8, target: u8, signaled: bool, len: u32, offset: u64, wr_id: u64) -> [u8; 24] {
    let mut b = [0u8; 24];
    b[0] = op;
    b[1] = target;
    b[2] = signaled as u8;
    b[4..8].copy_from_slice(&len.to_le_bytes());
    b[8..16].copy_from_slice(&offset.to_le_bytes());
    b[16..24].copy_from_slice(&wr_id.to_le_bytes());
    b
}

/// Writes `data` into remote block `j` and sets its status byte FULL: the chain a sender posts.
pub fn write_block(s: &mut TcpStream, j: u64, block_size: u64, data: &[u8]) -> std::io::Result<()> {
    let mut out = op(
        OP_WRITE,
        TARGET_BLOCKS,
        false,
        data.len() as u32,
        j * block_size,
        0,
    )
    .to_vec();
    out.extend_from_slice(data);
    out.extend_from_slice(&op(OP_WRITE, TARGET_STATUSES, true, 1, j, 1));
    out.push(status::FULL);
    s.write_all(&out)
}

/// A sealed block: `payload` as fragment `index` of `count` of a message of `message_len`
/// bytes on `device`, packet `packet`, frame `frame`.
#[allow(clippy::too_many_arguments)]
pub fn block(
    device: u8,
    packet: u16,
    flags: u8,
    index: u16,
    count: u16,
    message_len: u32,
    frame: u64,
    payload: &[u8],
) -> Vec<u8> {
    let h = BlockHeader {
        device,
        packet,
        flags,
        fragment_index: index,
        fragment_count: count,
        payload_len: payload.len() as u32,
        frame_index: frame,
        timestamp_ns: 0,
        message_len,
        duration_ns: 0,
        pts_ns: NO_PTS,
    };
    let mut b = vec![0u8; payload.len() + rdmastream::proto::OVERHEAD];
    h.encode_block(payload, &mut b);
    b
}

/// Waits until the receiver has taken block `j` again (reads the status array), so the next
/// write to it is legal; gives up after `timeout`.
pub fn wait_free(s: &mut TcpStream, j: u64, n: u64, timeout: Duration) -> std::io::Result<bool> {
    let end = Instant::now() + timeout;
    let mut wr = 1000;
    while Instant::now() < end {
        wr += 1;
        s.write_all(&op(OP_READ, TARGET_STATUSES, true, n as u32, 0, wr))?;
        // Skip acknowledgements until the READ response.
        loop {
            let mut h = [0u8; 24];
            s.read_exact(&mut h)?;
            let len = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
            if h[0] == 4 {
                let mut data = vec![0u8; len];
                s.read_exact(&mut data)?;
                if data.get(j as usize) == Some(&status::EMPTY) {
                    return Ok(true);
                }
                break;
            }
            if h[0] == 5 {
                return Err(std::io::Error::other("remote access error"));
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(false)
}

/// Attack 1: blocks whose headers claim a 4 GiB message (first fragment of two), one per device
/// on `devices` devices, each into block 0 once the receiver freed it.
pub fn claim_huge_messages(s: &mut TcpStream, w: &Welcome, devices: u8) -> std::io::Result<()> {
    let (n, b) = (w.blocks as u64, w.block_size as u64);
    for d in 0..devices {
        let blk = block(d, 0, flags::STREAM_START, 0, 2, u32::MAX, 0, b"x");
        wait_free(s, 0, n, Duration::from_secs(5))?;
        write_block(s, 0, b, &blk)?;
    }
    Ok(())
}

/// Attack 6: a zero-length WRITE at offset exactly N x B (one past the last block).
pub fn zero_length_write_at_end(s: &mut TcpStream, w: &Welcome) -> std::io::Result<()> {
    let end = w.blocks as u64 * w.block_size as u64;
    s.write_all(&op(OP_WRITE, TARGET_BLOCKS, true, 0, end, 7))?;
    // The receiver answers with an access error and closes; read until it does.
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut sink = Vec::new();
    let _ = s.read_to_end(&mut sink);
    Ok(())
}

/// Attack 8: format descriptors with embedded newlines and escapes that try to forge log lines,
/// `count` of them of `len` bytes each, on one device.
pub fn forged_formats(
    s: &mut TcpStream,
    w: &Welcome,
    count: u16,
    len: usize,
) -> std::io::Result<()> {
    let (n, b) = (w.blocks as u64, w.block_size as u64);
    let mut text = b"video/x-raw,format=RGB\n2026-01-01T00:00:00Z  INFO receiver: verify: all 999 synthetic frames match\x1b[2J".to_vec();
    text.resize(len.min(b as usize - rdmastream::proto::OVERHEAD), b'A');
    for k in 0..count {
        let flags = flags::FORMAT | if k == 0 { flags::STREAM_START } else { 0 };
        let blk = block(9, k, flags, 0, 1, text.len() as u32, 0, &text);
        let j = (k as u64) % n;
        wait_free(s, j, n, Duration::from_secs(5))?;
        write_block(s, j, b, &blk)?;
    }
    Ok(())
}

/// Attack 7: frames of `frame_len` bytes (split over blocks) on `devices` devices, `frames` each:
/// what fills a disk.
pub fn disk_flood(
    s: &mut TcpStream,
    w: &Welcome,
    devices: u8,
    frames: u64,
    frame_len: usize,
) -> std::io::Result<()> {
    let (n, b) = (w.blocks as u64, w.block_size as u64);
    let cap = b as usize - rdmastream::proto::OVERHEAD;
    let count = frame_len.div_ceil(cap) as u16;
    let data = vec![0xA5u8; frame_len];
    let mut packets = vec![0u16; devices as usize];
    let mut j = 0u64;
    // Each device starts with its format, as a real sender's does (frames before one are held).
    let format = b"application/octet-stream";
    for d in 0..devices {
        let blk = block(
            d,
            0,
            flags::FORMAT | flags::STREAM_START,
            0,
            1,
            format.len() as u32,
            0,
            format,
        );
        packets[d as usize] = 1;
        if !wait_free(s, j, n, Duration::from_secs(10))? {
            return Ok(());
        }
        write_block(s, j, b, &blk)?;
        j = (j + 1) % n;
    }
    for f in 0..frames {
        for d in 0..devices {
            for k in 0..count {
                let part = &data[k as usize * cap..((k as usize + 1) * cap).min(frame_len)];
                let p = &mut packets[d as usize];
                let blk = block(d, *p, 0, k, count, frame_len as u32, f, part);
                *p = p.wrapping_add(1);
                if !wait_free(s, j, n, Duration::from_secs(10))? {
                    return Ok(());
                }
                write_block(s, j, b, &blk)?;
                j = (j + 1) % n;
            }
        }
    }
    Ok(())
}

/// Attack 3: a handshake that trickles one byte every `every`, for up to `total`.
pub fn slow_handshake(from: &str, addr: &str, every: Duration, total: Duration) {
    let Ok(mut s) = connect_from(from, addr) else {
        return;
    };
    let mut body = (64u32).to_le_bytes().to_vec();
    body.extend_from_slice(b"RDSH");
    let end = Instant::now() + total;
    for byte in body.iter().cycle() {
        if Instant::now() > end || s.write_all(&[*byte]).is_err() {
            return;
        }
        std::thread::sleep(every);
    }
}

/// Connections that say nothing, `count` of them from `from`; kept open until dropped.
pub fn idle_connections(from: &str, addr: &str, count: usize) -> Vec<TcpStream> {
    (0..count)
        .filter_map(|_| connect_from(from, addr).ok())
        .collect()
}

/// What the receiver answered a handshake opened with `first` (a raw message body), as text.
fn answer_to(from: &str, addr: &str, first: &[u8]) -> String {
    answered(|| {
        let Ok(mut s) = connect_from(from, addr) else {
            return "connect failed".into();
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(8)));
        if send_message(&mut s, first).is_err() {
            return "send failed".into();
        }
        match recv_message(&mut s) {
            Ok(b) => match Welcome::decode(&b) {
                Ok(w) => w.error,
                Err(_) => format!("{} bytes that are no refusal", b.len()),
            },
            Err(e) => format!("closed: {e}"),
        }
    })
}

/// A malformed handshake's answer, tried again while the receiver closes it without a word
/// ("closed: ...", [`again_while_closed_silently`]). Every refusal of a malformed handshake
/// comes with its reason, so a silent close is never the answer under test.
fn answered(attempt: impl FnMut() -> String) -> String {
    again_while_closed_silently(attempt, |answer| answer.starts_with("closed:"))
}

/// Malformed handshakes: oversized length prefix, truncated Hello, garbage, a version-1 Hello.
/// Returns the receiver's answers.
pub fn malformed_handshakes(from: &str, addr: &str) -> Vec<String> {
    let mut answers = Vec::new();
    // A length prefix of 1 GiB.
    answers.push(answered(|| {
        let Ok(mut s) = connect_from(from, addr) else {
            return "connect failed".into();
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(8)));
        let _ = s.write_all(&(1u32 << 30).to_le_bytes());
        match recv_message(&mut s) {
            Ok(b) => Welcome::decode(&b).map(|w| w.error).unwrap_or_default(),
            Err(e) => format!("closed: {e}"),
        }
    }));
    let good = hello("mallory", 1).encode();
    answers.push(answer_to(from, addr, &good[..good.len() / 2]));
    answers.push(answer_to(from, addr, b"GET / HTTP/1.1\r\n"));
    // Senders of older protocol versions (1: a token, no proofs; 2: no coalesced or
    // header-sealed blocks).
    for version in [1u16, 2] {
        let old = Hello {
            version,
            ..hello("mallory", 1)
        };
        answers.push(answer_to(from, addr, &old.encode()));
    }
    answers
}

/// A wrong proof for `name`: the right message shapes, a MAC made with `wrong_key`. Returns the
/// refusal text.
pub fn wrong_proof(from: &str, addr: &str, name: &str, wrong_key: &str) -> String {
    let Ok(mut s) = connect_from(from, addr) else {
        return "connect failed".into();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(8)));
    let h = hello(name, 77).encode();
    if send_message(&mut s, &h).is_err() {
        return "send failed".into();
    }
    let Ok(c) = recv_message(&mut s) else {
        return "no challenge".into();
    };
    let key = Key::new(wrong_key.as_bytes().to_vec()).expect("test key");
    let proof = Proof {
        version: PROTOCOL_VERSION,
        mac: key.sender_proof(&h, &c),
    };
    let _ = send_message(&mut s, &proof.encode());
    match recv_message(&mut s).map(|b| Welcome::decode(&b)) {
        Ok(Ok(w)) => w.error,
        other => format!("{other:?}"),
    }
}

/// A replayed handshake: the Hello and Proof a real sender (with `key`) sent in an earlier
/// handshake, sent again on a new connection. Returns the refusal text.
pub fn replayed_handshake(from: &str, addr: &str, name: &str, key: &str) -> String {
    let key = Key::new(key.as_bytes().to_vec()).expect("test key");
    // The recorded handshake.
    let Ok(mut s) = connect_from(from, addr) else {
        return "connect failed".into();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(8)));
    let h = hello(name, 0x5EED).encode();
    let _ = send_message(&mut s, &h);
    let Ok(c) = recv_message(&mut s) else {
        return "no challenge".into();
    };
    let recorded = Proof {
        version: PROTOCOL_VERSION,
        mac: key.sender_proof(&h, &c),
    }
    .encode();
    drop(s);
    // The replay.
    let Ok(mut s) = connect_from(from, addr) else {
        return "connect failed".into();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(8)));
    let _ = send_message(&mut s, &h);
    let _ = recv_message(&mut s);
    let _ = send_message(&mut s, &recorded);
    match recv_message(&mut s).map(|b| Welcome::decode(&b)) {
        Ok(Ok(w)) => w.error,
        other => format!("{other:?}"),
    }
}

/// How a fake receiver treats the sender that connects to it.
#[derive(Debug, Clone, Copy)]
pub enum FakeReceiver {
    /// Welcome with N = 0xFFFF_FFFF blocks.
    HugeRegion,
    /// A fair Welcome, then a READ response of 4 GiB to the first READ.
    HugeReadResponse,
    /// Asks for a proof and records every byte the sender sends (to show the key is not there).
    Record,
}

/// Serves one connection on `listener` as `how`; returns every byte the sender sent.
pub fn fake_receiver(listener: &std::net::TcpListener, how: FakeReceiver) -> Vec<u8> {
    let Ok((mut s, _)) = listener.accept() else {
        return Vec::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let mut seen = Vec::new();
    let Ok(h) = recv_message(&mut s) else {
        return seen;
    };
    seen.extend_from_slice(&h);
    let challenge = Challenge {
        version: PROTOCOL_VERSION,
        auth: match how {
            FakeReceiver::Record => AuthKind::HmacSha256,
            _ => AuthKind::None,
        },
        nonce: [9; NONCE_LEN],
    };
    let _ = send_message(&mut s, &challenge.encode());
    let Ok(p) = recv_message(&mut s) else {
        return seen;
    };
    seen.extend_from_slice(&p);
    let mut welcome = Welcome {
        blocks: 4,
        block_size: 65536,
        ..Welcome::refusal("")
    };
    match how {
        FakeReceiver::HugeRegion => {
            // Encode by hand: Welcome::encode would not produce a value its decoder refuses.
            welcome.blocks = u32::MAX;
            let _ = send_message(&mut s, &welcome.encode());
        }
        FakeReceiver::Record => {
            let _ = send_message(&mut s, &Welcome::refusal("recorded").encode());
        }
        FakeReceiver::HugeReadResponse => {
            let _ = send_message(&mut s, &welcome.encode());
            // Wait for the sync READ, answer it with a 4 GiB response header, then trickle.
            loop {
                let mut h = [0u8; 24];
                if s.read_exact(&mut h).is_err() {
                    break;
                }
                let len = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
                if h[0] == OP_WRITE {
                    let mut skip = vec![0u8; len.min(1 << 20)];
                    let _ = s.read_exact(&mut skip);
                    continue;
                }
                if h[0] == OP_READ {
                    let mut resp = h;
                    resp[0] = 4;
                    resp[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
                    let _ = s.write_all(&resp);
                    let _ = s.write_all(&[0u8; 4096]);
                    std::thread::sleep(Duration::from_millis(500));
                    break;
                }
            }
        }
    }
    let _ = PROOF_LEN;
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    seen.extend_from_slice(&rest);
    seen
}

/// Resident memory of process `pid`, in bytes (0 if it is gone).
pub fn rss_bytes(pid: u32) -> u64 {
    proc_status(pid, "VmRSS:") * 1024
}

/// Threads of process `pid` (0 if it is gone).
pub fn threads(pid: u32) -> u64 {
    proc_status(pid, "Threads:")
}

/// Open file descriptors of process `pid`.
pub fn open_files(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count() as u64)
        .unwrap_or(0)
}

fn proc_status(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Bytes of all files under `dir`.
pub fn disk_usage(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}
