//! Connection setup messages, exchanged over a TCP side channel before any block moves (like
//! perftest's). Byte layout in docs/protocol.md. Decoding checks every length and value, so a
//! malformed or hostile handshake is rejected before anything is allocated for it.

/// Version of the handshake and of the whole wire protocol.
pub const PROTOCOL_VERSION: u16 = 1;
/// Longest encoded handshake message accepted.
pub const MAX_MESSAGE: usize = 1024;
const HELLO_MAGIC: &[u8; 4] = b"RDSH";
const WELCOME_MAGIC: &[u8; 4] = b"RDSW";

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
}

/// Sender → receiver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub version: u16,
    /// Sender name: scopes the receiver's output (`<out>/<sender>/...`).
    pub sender: String,
    /// Shared secret; must match the receiver's when it has one.
    pub token: String,
    /// Random per sender process: a new session restarts the receiver's numbering state.
    pub session: u64,
    pub data_path: DataPath,
    pub qp: QpInfo,
}

/// Receiver → sender.
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
}

/// Why a handshake message was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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
            .get(self.at..self.at + n)
            .ok_or(HandshakeError::Truncated(self.at))?;
        self.at += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, HandshakeError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, HandshakeError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32, HandshakeError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, HandshakeError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
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
            gid: self.take(16)?.try_into().unwrap(),
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
    let s = &s.as_bytes()[..s.len().min(255)];
    out.push(s.len() as u8);
    out.extend_from_slice(s);
}

fn put_qp(out: &mut Vec<u8>, qp: &QpInfo) {
    out.extend_from_slice(&qp.qpn.to_le_bytes());
    out.extend_from_slice(&qp.psn.to_le_bytes());
    out.extend_from_slice(&qp.lid.to_le_bytes());
    out.extend_from_slice(&qp.gid);
}

fn check_header(r: &mut Reader<'_>, magic: &[u8; 4]) -> Result<u16, HandshakeError> {
    if r.b.len() > MAX_MESSAGE {
        return Err(HandshakeError::TooLong(r.b.len()));
    }
    if r.take(4)? != magic {
        return Err(HandshakeError::BadMagic);
    }
    let version = r.u16()?;
    if version != PROTOCOL_VERSION {
        return Err(HandshakeError::BadVersion(version));
    }
    Ok(version)
}

impl Hello {
    /// Encodes the message body (framing adds a u32 length in front).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(128);
        out.extend_from_slice(HELLO_MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        put_str(&mut out, &self.sender);
        put_str(&mut out, &self.token);
        out.extend_from_slice(&self.session.to_le_bytes());
        out.push(self.data_path as u8);
        put_qp(&mut out, &self.qp);
        out
    }

    /// Decodes and validates a message body.
    pub fn decode(b: &[u8]) -> Result<Hello, HandshakeError> {
        let mut r = Reader { b, at: 0 };
        let version = check_header(&mut r, HELLO_MAGIC)?;
        let sender = r.string("sender name")?;
        if !valid_sender_name(&sender) {
            return Err(HandshakeError::BadField("sender name"));
        }
        let token = r.string("auth token")?;
        let session = r.u64()?;
        let data_path = match r.u8()? {
            0 => DataPath::Tcp,
            1 => DataPath::Verbs,
            _ => return Err(HandshakeError::BadField("data path")),
        };
        let qp = r.qp()?;
        r.finish()?;
        Ok(Hello {
            version,
            sender,
            token,
            session,
            data_path,
            qp,
        })
    }
}

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
        }
    }

    /// Encodes the message body.
    pub fn encode(&self) -> Vec<u8> {
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

    /// Decodes and validates a message body.
    pub fn decode(b: &[u8]) -> Result<Welcome, HandshakeError> {
        let mut r = Reader { b, at: 0 };
        let version = check_header(&mut r, WELCOME_MAGIC)?;
        let w = Welcome {
            version,
            error: r.string("error text")?,
            blocks: r.u32()?,
            block_size: r.u32()?,
            status_addr: r.u64()?,
            status_rkey: r.u32()?,
            blocks_addr: r.u64()?,
            blocks_rkey: r.u32()?,
            qp: r.qp()?,
        };
        r.finish()?;
        if w.error.is_empty() && (w.blocks == 0 || w.block_size as usize <= super::OVERHEAD) {
            return Err(HandshakeError::BadField("region size"));
        }
        Ok(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            version: PROTOCOL_VERSION,
            sender: "edge-1".into(),
            token: "secret".into(),
            session: 42,
            data_path: DataPath::Verbs,
            qp: QpInfo {
                qpn: 17,
                psn: 99,
                lid: 3,
                gid: [7; 16],
            },
        }
    }

    #[test]
    fn round_trips() {
        let h = hello();
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        let w = Welcome {
            blocks: 16,
            block_size: 1 << 20,
            ..Welcome::refusal("")
        };
        assert_eq!(Welcome::decode(&w.encode()).unwrap(), w);
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
        assert!(Hello::decode(&vec![0; MAX_MESSAGE + 1]).is_err());
    }
}
