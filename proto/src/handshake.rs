//! Connection setup messages, exchanged over a TCP side channel before any block moves (like
//! perftest's), and the challenge-response that authenticates both ends. Byte layout in
//! docs/protocol.md. Decoding checks every length and value, so a malformed or hostile handshake
//! is rejected before anything is allocated for it.
//!
//! The exchange (version 3; the same messages as version 2):
//!
//! ```text
//! sender                                   receiver
//!   Hello (name, session, transport, nonce_s)  ->
//!                                          <-  Challenge (auth kind, nonce_r)   | Welcome(refusal)
//!   Proof (HMAC(key, "sender" | Hello | Challenge))  ->
//!                                          <-  Welcome (region, queue pair,
//!                                                 HMAC(key, "receiver" | Hello | Challenge | Welcome))
//! ```
//!
//! Both proofs cover both nonces, so neither can be replayed into another handshake, and they
//! cover the whole messages: the sender name, the protocol version and every transport parameter
//! (queue pair, region addresses and keys) are bound to the key. The key itself never travels.
//! Computing and checking proofs is pure computation (HMAC-SHA256); where the nonces come from
//! (the OS's random source) is the caller's business.

use hmac::{KeyInit, Mac};

/// Version of the handshake and of the whole wire protocol. 3: blocks may be coalesced (layout
/// version 2) or sealed over their header only (HEADER_SEAL), which a version-2 receiver would
/// count as invalid blocks after admitting the sender; the handshake is version 2's.
pub const PROTOCOL_VERSION: u16 = 3;
/// Longest encoded handshake message accepted.
pub const MAX_MESSAGE: usize = 1024;
/// Bytes of a nonce and of a proof.
pub const NONCE_LEN: usize = 32;
pub const PROOF_LEN: usize = 32;
/// Shortest key accepted (bytes).
pub const MIN_KEY_LEN: usize = 16;
/// Longest key accepted (bytes).
pub const MAX_KEY_LEN: usize = 1024;
const HELLO_MAGIC: &[u8; 4] = b"RDSH";
const CHALLENGE_MAGIC: &[u8; 4] = b"RDSC";
const PROOF_MAGIC: &[u8; 4] = b"RDSP";
const WELCOME_MAGIC: &[u8; 4] = b"RDSW";
/// The mechanism byte of a sliding-window Hello.
const MECHANISM_SLIDING_WINDOW: u8 = 1;
const SENDER_LABEL: &[u8] = b"rdmastream v2 sender proof";
const RECEIVER_LABEL: &[u8] = b"rdmastream v2 receiver proof";

/// Addressing of one RC queue pair, for the verbs transport (all zero for software transports).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpInfo {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
}

/// Which data path the sender wants after the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataPath {
    /// The software transport: operations travel on this same TCP connection.
    Tcp = 0,
    /// RDMA verbs: the receiver connects an RC queue pair to `QpInfo`.
    Verbs = 1,
    /// Shared memory on one host: the receiver passes its region (a memfd) over the Unix socket
    /// the handshake ran on, and the sender writes into it directly.
    Shm = 2,
}

/// Which transmission mechanism a connection runs. Sender and receiver must agree: a receiver
/// refuses a Hello of the other mechanism, naming both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mechanism {
    /// The paper's status-byte-assisted mechanism: one connection shared by every device.
    #[default]
    StatusByte,
    /// The sliding-window baseline ([`crate::window`]): one connection per device, this one
    /// carrying device `device`.
    SlidingWindow { device: u8 },
}

impl Mechanism {
    /// The name used in config files and messages.
    pub fn name(self) -> &'static str {
        match self {
            Mechanism::StatusByte => "status-byte",
            Mechanism::SlidingWindow { .. } => "sliding-window",
        }
    }

    /// Whether both are the same mechanism (whatever device a sliding window carries).
    pub fn same_kind(self, other: Mechanism) -> bool {
        self.name() == other.name()
    }
}

impl std::fmt::Display for Mechanism {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Sender → receiver, first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub version: u16,
    /// Sender name: scopes the receiver's output (`<out>/<sender>/...`) and picks the key.
    pub sender: String,
    /// Random per sender process: a new session is a new stream of frames at the receiver.
    pub session: u64,
    /// The sender's block size: a receiver whose blocks are smaller refuses it, so both ends
    /// know why. 0: not stated (tools and tests that never write a block).
    pub block_size: u32,
    pub data_path: DataPath,
    pub qp: QpInfo,
    /// Fresh random bytes of this handshake (makes the receiver's proof fresh).
    pub nonce: [u8; NONCE_LEN],
    /// The mechanism this connection runs. Encoded after the nonce only when it is not the
    /// status-byte mechanism, so a status-byte Hello is byte for byte what it always was.
    pub mechanism: Mechanism,
}

/// How the receiver wants the sender to prove who it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthKind {
    /// Anonymous receiver: proofs are all zero, nothing is checked.
    None = 0,
    /// HMAC-SHA256 proofs with the sender's key.
    HmacSha256 = 1,
}

/// Receiver → sender, answering a valid Hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    pub version: u16,
    pub auth: AuthKind,
    /// Fresh random bytes of this handshake (makes the sender's proof fresh).
    pub nonce: [u8; NONCE_LEN],
}

/// Sender → receiver: the sender's proof over Hello and Challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proof {
    pub version: u16,
    pub mac: [u8; PROOF_LEN],
}

/// Receiver → sender, last: the region, or why the connection is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Welcome {
    pub version: u16,
    /// Empty on success; otherwise why the connection is refused.
    pub error: String,
    /// Receiver memory blocks (N) and their size (B).
    pub blocks: u32,
    pub block_size: u32,
    pub status_addr: u64,
    pub status_rkey: u32,
    pub blocks_addr: u64,
    pub blocks_rkey: u32,
    pub qp: QpInfo,
    /// The receiver's proof over Hello, Challenge and this Welcome (with this field zero).
    pub mac: [u8; PROOF_LEN],
}

/// Why a handshake message was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    #[error("message truncated at byte {0}")]
    Truncated(usize),
    #[error("bad magic (not an rdmastream handshake)")]
    BadMagic,
    #[error("protocol version {0} not supported (this build speaks {PROTOCOL_VERSION})")]
    BadVersion(u16),
    #[error("{0} is not valid")]
    BadField(&'static str),
    #[error("message of {0} bytes is over the limit")]
    TooLong(usize),
}

/// Checks a sender name: 1–64 characters of `[A-Za-z0-9._-]`, not `.` or `..` (it becomes a
/// directory name on the receiver).
pub fn valid_sender_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], HandshakeError> {
        let s = self
            .b
            .get(self.at..self.at.saturating_add(n))
            .ok_or(HandshakeError::Truncated(self.at))?;
        self.at += n;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], HandshakeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, HandshakeError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, HandshakeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, HandshakeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, HandshakeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn string(&mut self, what: &'static str) -> Result<String, HandshakeError> {
        let n = self.u8()? as usize;
        let s = self.take(n)?;
        String::from_utf8(s.to_vec()).map_err(|_| HandshakeError::BadField(what))
    }
    fn qp(&mut self) -> Result<QpInfo, HandshakeError> {
        Ok(QpInfo {
            qpn: self.u32()?,
            psn: self.u32()?,
            lid: self.u16()?,
            gid: self.array()?,
        })
    }
    fn finish(self) -> Result<(), HandshakeError> {
        if self.at == self.b.len() {
            Ok(())
        } else {
            Err(HandshakeError::BadField("trailing bytes"))
        }
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    // At most 255 bytes, cut at a character boundary so the text stays valid UTF-8.
    let mut end = s.len().min(255);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.push(end as u8);
    out.extend_from_slice(&s.as_bytes()[..end]);
}

fn put_qp(out: &mut Vec<u8>, qp: &QpInfo) {
    out.extend_from_slice(&qp.qpn.to_le_bytes());
    out.extend_from_slice(&qp.psn.to_le_bytes());
    out.extend_from_slice(&qp.lid.to_le_bytes());
    out.extend_from_slice(&qp.gid);
}

/// Reads magic and version. Accepts the versions in `also` (older ones some message kinds still
/// decode, to turn an old peer away with words it understands) besides [`PROTOCOL_VERSION`].
fn check_header(
    r: &mut Reader<'_>,
    magic: &[u8; 4],
    also: std::ops::Range<u16>,
) -> Result<u16, HandshakeError> {
    if r.b.len() > MAX_MESSAGE {
        return Err(HandshakeError::TooLong(r.b.len()));
    }
    if r.take(4)? != magic {
        return Err(HandshakeError::BadMagic);
    }
    let version = r.u16()?;
    if version != PROTOCOL_VERSION && !also.contains(&version) {
        return Err(HandshakeError::BadVersion(version));
    }
    Ok(version)
}

/// The version a handshake message claims, if it starts like one of ours (any kind). Lets a
/// receiver answer an older sender in the older format, so it sees a refusal it can read.
pub fn claimed_version(b: &[u8]) -> Option<u16> {
    (b.len() >= 6 && &b[..4] == HELLO_MAGIC).then(|| u16::from_le_bytes([b[4], b[5]]))
}

impl Hello {
    /// Encodes the message body (framing adds a u32 length in front).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(128);
        out.extend_from_slice(HELLO_MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        put_str(&mut out, &self.sender);
        out.extend_from_slice(&self.session.to_le_bytes());
        out.extend_from_slice(&self.block_size.to_le_bytes());
        out.push(self.data_path as u8);
        put_qp(&mut out, &self.qp);
        out.extend_from_slice(&self.nonce);
        if let Mechanism::SlidingWindow { device } = self.mechanism {
            out.extend_from_slice(&[MECHANISM_SLIDING_WINDOW, device]);
        }
        out
    }

    /// Decodes and validates a message body.
    pub fn decode(b: &[u8]) -> Result<Hello, HandshakeError> {
        let mut r = Reader { b, at: 0 };
        let version = check_header(&mut r, HELLO_MAGIC, 0..0)?;
        let sender = r.string("sender name")?;
        if !valid_sender_name(&sender) {
            return Err(HandshakeError::BadField("sender name"));
        }
        let session = r.u64()?;
        let block_size = r.u32()?;
        let data_path = match r.u8()? {
            0 => DataPath::Tcp,
            1 => DataPath::Verbs,
            2 => DataPath::Shm,
            _ => return Err(HandshakeError::BadField("data path")),
        };
        let qp = r.qp()?;
        let nonce = r.array()?;
        // Absent: the status-byte mechanism (one encoding per Hello: it is never spelled out).
        let mechanism = if r.at == r.b.len() {
            Mechanism::StatusByte
        } else {
            match r.u8()? {
                MECHANISM_SLIDING_WINDOW => Mechanism::SlidingWindow { device: r.u8()? },
                _ => return Err(HandshakeError::BadField("mechanism")),
            }
        };
        r.finish()?;
        Ok(Hello {
            version,
            sender,
            session,
            block_size,
            data_path,
            qp,
            nonce,
            mechanism,
        })
    }
}

impl Challenge {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + 2 + 1 + NONCE_LEN);
        out.extend_from_slice(CHALLENGE_MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.push(self.auth as u8);
        out.extend_from_slice(&self.nonce);
        out
    }

    pub fn decode(b: &[u8]) -> Result<Challenge, HandshakeError> {
        let mut r = Reader { b, at: 0 };
        let version = check_header(&mut r, CHALLENGE_MAGIC, 0..0)?;
        let auth = match r.u8()? {
            0 => AuthKind::None,
            1 => AuthKind::HmacSha256,
            _ => return Err(HandshakeError::BadField("authentication kind")),
        };
        let nonce = r.array()?;
        r.finish()?;
        Ok(Challenge {
            version,
            auth,
            nonce,
        })
    }
}

impl Proof {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + 2 + PROOF_LEN);
        out.extend_from_slice(PROOF_MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.mac);
        out
    }

    pub fn decode(b: &[u8]) -> Result<Proof, HandshakeError> {
        let mut r = Reader { b, at: 0 };
        let version = check_header(&mut r, PROOF_MAGIC, 0..0)?;
        let mac = r.array()?;
        r.finish()?;
        Ok(Proof { version, mac })
    }
}

/// Largest region a sender accepts from a receiver: at most this many blocks ...
pub const MAX_REMOTE_BLOCKS: u32 = 65536;
/// ... of at most this many bytes each.
pub const MAX_REMOTE_BLOCK_SIZE: u32 = 1 << 30;

impl Welcome {
    /// A refusal carrying `error`.
    pub fn refusal(error: impl Into<String>) -> Welcome {
        Welcome {
            version: PROTOCOL_VERSION,
            error: error.into(),
            blocks: 0,
            block_size: 0,
            status_addr: 0,
            status_rkey: 0,
            blocks_addr: 0,
            blocks_rkey: 0,
            qp: QpInfo::default(),
            mac: [0; PROOF_LEN],
        }
    }

    /// Encodes the message body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.encode_unproven();
        out.extend_from_slice(&self.mac);
        out
    }

    /// The body without the proof: what the receiver's proof covers.
    fn encode_unproven(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(128);
        out.extend_from_slice(WELCOME_MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        put_str(&mut out, &self.error);
        out.extend_from_slice(&self.blocks.to_le_bytes());
        out.extend_from_slice(&self.block_size.to_le_bytes());
        out.extend_from_slice(&self.status_addr.to_le_bytes());
        out.extend_from_slice(&self.status_rkey.to_le_bytes());
        out.extend_from_slice(&self.blocks_addr.to_le_bytes());
        out.extend_from_slice(&self.blocks_rkey.to_le_bytes());
        put_qp(&mut out, &self.qp);
        out
    }

    /// A refusal for a sender that speaks the older `version` (1 or 2), in the layout it reads
    /// (version 1: no proof field; version 2: this one), so it shows `error` to its user.
    pub fn encode_old_refusal(version: u16, error: &str) -> Vec<u8> {
        let mut w = Welcome::refusal(error);
        w.version = version;
        if version == 1 {
            w.encode_unproven()
        } else {
            w.encode()
        }
    }

    /// Decodes and validates a message body. A refusal of an older version (an old receiver
    /// turning this sender away) decodes too, as a refusal, so its reason reaches the user; an
    /// older version's acceptance does not.
    pub fn decode(b: &[u8]) -> Result<Welcome, HandshakeError> {
        let mut r = Reader { b, at: 0 };
        let version = check_header(&mut r, WELCOME_MAGIC, 1..PROTOCOL_VERSION)?;
        let mut w = Welcome {
            version,
            error: r.string("error text")?,
            blocks: r.u32()?,
            block_size: r.u32()?,
            status_addr: r.u64()?,
            status_rkey: r.u32()?,
            blocks_addr: r.u64()?,
            blocks_rkey: r.u32()?,
            qp: r.qp()?,
            mac: [0; PROOF_LEN],
        };
        if version == 1 {
            r.finish()?;
            if w.error.is_empty() {
                return Err(HandshakeError::BadVersion(1));
            }
            return Ok(w);
        }
        w.mac = r.array()?;
        r.finish()?;
        if w.error.is_empty() && version != PROTOCOL_VERSION {
            return Err(HandshakeError::BadVersion(version));
        }
        if w.error.is_empty()
            && (!(1..=MAX_REMOTE_BLOCKS).contains(&w.blocks)
                || w.block_size as usize <= super::OVERHEAD
                || w.block_size > MAX_REMOTE_BLOCK_SIZE)
        {
            return Err(HandshakeError::BadField("region size"));
        }
        Ok(w)
    }
}

/// A key that authenticates one sender name (or every name, when shared). Its bytes are never
/// printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Key(Vec<u8>);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Key(<{} bytes>)", self.0.len())
    }
}

impl Key {
    /// A key of [`MIN_KEY_LEN`]..=[`MAX_KEY_LEN`] bytes; `Err` says why not.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Key, String> {
        let bytes = bytes.into();
        if bytes.len() < MIN_KEY_LEN {
            return Err(format!(
                "a key needs at least {MIN_KEY_LEN} bytes (this one has {}); make one with \
                 `openssl rand -hex 32`",
                bytes.len()
            ));
        }
        if bytes.len() > MAX_KEY_LEN {
            return Err(format!("a key has at most {MAX_KEY_LEN} bytes"));
        }
        Ok(Key(bytes))
    }

    fn mac(&self, label: &[u8], parts: &[&[u8]]) -> hmac::Hmac<sha2::Sha256> {
        let mut m = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(&self.0)
            .expect("HMAC takes keys of any length");
        m.update(label);
        for p in parts {
            // Length-prefixed, so no two different message sequences hash the same.
            m.update(&(p.len() as u32).to_le_bytes());
            m.update(p);
        }
        m
    }

    /// The sender's proof over the encoded Hello and Challenge.
    pub fn sender_proof(&self, hello: &[u8], challenge: &[u8]) -> [u8; PROOF_LEN] {
        self.mac(SENDER_LABEL, &[hello, challenge])
            .finalize()
            .into_bytes()
            .into()
    }

    /// Checks a sender's proof in constant time.
    pub fn check_sender_proof(&self, hello: &[u8], challenge: &[u8], proof: &[u8]) -> bool {
        self.mac(SENDER_LABEL, &[hello, challenge])
            .verify_slice(proof)
            .is_ok()
    }

    /// Sets `welcome.mac` to the receiver's proof over Hello, Challenge and the Welcome.
    pub fn prove_welcome(&self, hello: &[u8], challenge: &[u8], welcome: &mut Welcome) {
        let body = welcome.encode_unproven();
        welcome.mac = self
            .mac(RECEIVER_LABEL, &[hello, challenge, &body])
            .finalize()
            .into_bytes()
            .into();
    }

    /// Checks the receiver's proof on a decoded Welcome, in constant time.
    pub fn check_welcome(&self, hello: &[u8], challenge: &[u8], welcome: &Welcome) -> bool {
        let body = welcome.encode_unproven();
        self.mac(RECEIVER_LABEL, &[hello, challenge, &body])
            .verify_slice(&welcome.mac)
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            version: PROTOCOL_VERSION,
            sender: "edge-1".into(),
            session: 42,
            block_size: 4096,
            data_path: DataPath::Verbs,
            qp: QpInfo {
                qpn: 17,
                psn: 99,
                lid: 3,
                gid: [7; 16],
            },
            nonce: [5; NONCE_LEN],
            mechanism: Mechanism::StatusByte,
        }
    }

    fn welcome() -> Welcome {
        Welcome {
            blocks: 16,
            block_size: 1 << 20,
            status_addr: 0x1000,
            status_rkey: 9,
            blocks_addr: 0x20000,
            blocks_rkey: 10,
            ..Welcome::refusal("")
        }
    }

    #[test]
    fn round_trips() {
        let h = hello();
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        let w = welcome();
        assert_eq!(Welcome::decode(&w.encode()).unwrap(), w);
        let c = Challenge {
            version: PROTOCOL_VERSION,
            auth: AuthKind::HmacSha256,
            nonce: [1; NONCE_LEN],
        };
        assert_eq!(Challenge::decode(&c.encode()).unwrap(), c);
        let p = Proof {
            version: PROTOCOL_VERSION,
            mac: [3; PROOF_LEN],
        };
        assert_eq!(Proof::decode(&p.encode()).unwrap(), p);
    }

    #[test]
    fn rejects_malformed() {
        let good = hello().encode();
        for n in 0..good.len() {
            assert!(
                Hello::decode(&good[..n]).is_err(),
                "truncated at {n} accepted"
            );
        }
        let mut bad = good.clone();
        bad[0] = b'X';
        assert_eq!(Hello::decode(&bad), Err(HandshakeError::BadMagic));
        let mut bad = good.clone();
        bad[4] = 9;
        assert_eq!(Hello::decode(&bad), Err(HandshakeError::BadVersion(9)));
        let mut bad = good.clone();
        bad.push(0);
        assert!(Hello::decode(&bad).is_err());
        for name in ["..", ".", "a/b", "", "x".repeat(65).as_str(), "ä"] {
            let h = Hello {
                sender: name.into(),
                ..hello()
            };
            assert_eq!(
                Hello::decode(&h.encode()),
                Err(HandshakeError::BadField("sender name")),
                "{name}"
            );
        }
        assert!(
            Welcome::decode(&Welcome::refusal("").encode()).is_err(),
            "empty region accepted"
        );
        for (blocks, size) in [(0, 4096), (65537, 4096), (4, 60), (4, (1 << 30) + 1)] {
            let w = Welcome {
                blocks,
                block_size: size,
                ..welcome()
            };
            assert!(Welcome::decode(&w.encode()).is_err(), "{blocks} x {size}");
        }
        assert!(Hello::decode(&vec![0; MAX_MESSAGE + 1]).is_err());
        let good = welcome().encode();
        for n in 0..good.len() {
            assert!(Welcome::decode(&good[..n]).is_err(), "welcome cut at {n}");
        }
    }

    #[test]
    fn the_mechanism_travels_after_the_nonce_only_for_the_sliding_window() {
        let plain = hello().encode();
        assert_eq!(
            plain.len(),
            4 + 2 + 1 + 6 + 8 + 4 + 1 + 26 + NONCE_LEN,
            "a status-byte Hello is unchanged"
        );
        let window = Hello {
            mechanism: Mechanism::SlidingWindow { device: 7 },
            ..hello()
        };
        let bytes = window.encode();
        assert_eq!(&bytes[plain.len()..], &[1, 7]);
        assert_eq!(Hello::decode(&bytes).unwrap(), window);
        // Spelling out the default, an unknown mechanism, or a missing device: refused.
        for tail in [&[0u8, 0][..], &[2, 0], &[1], &[1, 7, 0]] {
            let mut b = plain.clone();
            b.extend_from_slice(tail);
            assert!(Hello::decode(&b).is_err(), "{tail:?}");
        }
        // The mechanism is covered by the sender's proof like the rest of the Hello.
        let key = Key::new(b"0123456789abcdef0123".to_vec()).unwrap();
        let proof = key.sender_proof(&plain, b"challenge");
        assert!(!key.check_sender_proof(&bytes, b"challenge", &proof));
        assert!(
            Mechanism::SlidingWindow { device: 1 }
                .same_kind(Mechanism::SlidingWindow { device: 2 })
        );
        assert!(!Mechanism::StatusByte.same_kind(Mechanism::SlidingWindow { device: 0 }));
    }

    #[test]
    fn an_old_peer_gets_a_refusal_it_can_read() {
        // What a version-1 sender decodes: magic, version 1, the reason, then the region fields.
        let v1 = Welcome::encode_old_refusal(1, "protocol version 1 is not supported");
        assert_eq!(&v1[4..6], &1u16.to_le_bytes());
        let w = Welcome::decode(&v1).unwrap();
        assert_eq!(w.error, "protocol version 1 is not supported");
        let old_hello = Hello {
            version: 1,
            ..hello()
        }
        .encode();
        assert_eq!(claimed_version(&old_hello), Some(1));
        assert_eq!(
            Hello::decode(&old_hello),
            Err(HandshakeError::BadVersion(1))
        );
    }

    #[test]
    fn a_version_2_peer_is_turned_away_both_ways_with_a_reason() {
        // A version-2 sender (no coalesced or header-sealed blocks, the same handshake) gets a
        // refusal in its own layout: version 2, the error, the region fields, a proof field.
        let v2 = Welcome::encode_old_refusal(2, "protocol version 2 is not supported");
        assert_eq!(&v2[4..6], &2u16.to_le_bytes());
        let mut same = Welcome::refusal("protocol version 2 is not supported");
        same.version = 2;
        assert_eq!(v2, same.encode(), "the layout version 2 decodes");
        let old_hello = Hello {
            version: 2,
            ..hello()
        }
        .encode();
        assert_eq!(claimed_version(&old_hello), Some(2));
        assert_eq!(
            Hello::decode(&old_hello),
            Err(HandshakeError::BadVersion(2))
        );
        // This sender, refused by a version-2 receiver, shows the receiver's reason ...
        let w = Welcome::decode(&v2).unwrap();
        assert_eq!(w.error, "protocol version 2 is not supported");
        // ... and never takes a version-2 receiver's acceptance for its own.
        let mut accepted = Welcome {
            version: 2,
            ..welcome()
        };
        assert_eq!(
            Welcome::decode(&accepted.encode()),
            Err(HandshakeError::BadVersion(2))
        );
        accepted.version = PROTOCOL_VERSION;
        assert!(Welcome::decode(&accepted.encode()).is_ok());
    }

    #[test]
    fn proofs_bind_key_nonces_name_and_transport_parameters() {
        let key = Key::new(b"0123456789abcdef0123".to_vec()).unwrap();
        let other = Key::new(b"0123456789abcdef0124".to_vec()).unwrap();
        let h = hello().encode();
        let c = Challenge {
            version: PROTOCOL_VERSION,
            auth: AuthKind::HmacSha256,
            nonce: [1; NONCE_LEN],
        }
        .encode();
        let proof = key.sender_proof(&h, &c);
        assert!(key.check_sender_proof(&h, &c, &proof));
        assert!(!other.check_sender_proof(&h, &c, &proof), "another key");
        // A replay into a handshake with a fresh challenge nonce fails.
        let c2 = Challenge {
            version: PROTOCOL_VERSION,
            auth: AuthKind::HmacSha256,
            nonce: [2; NONCE_LEN],
        }
        .encode();
        assert!(!key.check_sender_proof(&h, &c2, &proof), "replayed proof");
        // Another name or queue pair in the Hello fails.
        let renamed = Hello {
            sender: "edge-2".into(),
            ..hello()
        }
        .encode();
        assert!(!key.check_sender_proof(&renamed, &c, &proof));
        let other_qp = Hello {
            qp: QpInfo::default(),
            ..hello()
        }
        .encode();
        assert!(!key.check_sender_proof(&other_qp, &c, &proof));
        assert!(!key.check_sender_proof(&h, &c, &proof[..31]), "short proof");

        let mut w = welcome();
        key.prove_welcome(&h, &c, &mut w);
        let decoded = Welcome::decode(&w.encode()).unwrap();
        assert!(key.check_welcome(&h, &c, &decoded));
        assert!(!other.check_welcome(&h, &c, &decoded));
        let forged = Welcome {
            blocks_rkey: 11,
            ..decoded.clone()
        };
        assert!(!key.check_welcome(&h, &c, &forged), "changed rkey");
        assert!(!key.check_welcome(&h, &c2, &decoded), "other challenge");
        assert!(Key::new(b"short".to_vec()).is_err());
        assert!(!format!("{key:?}").contains("0123"), "keys are not printed");
    }
}
