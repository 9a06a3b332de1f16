//! The `transport` and `drop-policy` properties, and how they map onto the core's transports.
//!
//! The elements pass the property values on; which transport a setting means is decided in one
//! place for the binaries and the elements alike (`rdmastream_verbs::connector` / `listener`).

use std::time::{Duration, Instant};

use gst::glib;

use rdmastream::transport::{Connector, Listener, RegionSettings};
pub use rdmastream_verbs::VerbsSettings;
use rdmastream_verbs::{self as verbs};

/// Which data path carries the blocks.
#[derive(Debug, Default, Eq, PartialEq, Ord, PartialOrd, Hash, Clone, Copy, glib::Enum)]
#[repr(u32)]
#[enum_type(name = "GstRdmaTransport")]
pub enum Transport {
    /// shm for a `unix:/path` address; else RDMA verbs when a usable device is present, else
    /// the tcp software transport.
    #[default]
    #[enum_value(
        name = "Auto: shm for a unix:/path address, else RDMA verbs when a usable device is present, else tcp",
        nick = "auto"
    )]
    Auto = 0,
    /// One-sided RDMA over an RDMA NIC (or Soft-RoCE).
    #[enum_value(name = "Verbs: one-sided RDMA over an RDMA device", nick = "verbs")]
    Verbs = 1,
    /// The software emulation of the one-sided data path over TCP.
    #[enum_value(
        name = "TCP: software emulation of one-sided RDMA over TCP",
        nick = "tcp"
    )]
    Tcp = 2,
    /// In-process: an `rdmasink` and an `rdmasrc` of the same process, joined in memory.
    #[enum_value(
        name = "Mem: in-process, a sink and a source of the same process (tests)",
        nick = "mem"
    )]
    Mem = 3,
    /// Shared memory with a peer on this host: the address is `unix:/path` (a Unix socket).
    #[enum_value(
        name = "Shm: shared memory with a peer on this host (address unix:/path)",
        nick = "shm"
    )]
    Shm = 4,
}

impl Transport {
    /// The property value's nick, for messages.
    pub fn nick(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Verbs => "verbs",
            Transport::Tcp => "tcp",
            Transport::Mem => "mem",
            Transport::Shm => "shm",
        }
    }
}

/// The `drop-policy` property: the GObject face of [`rdmastream::engine::DropPolicy`] (the one
/// policy the engine and the elements' queues act on), converted with `From`.
#[derive(Debug, Default, Eq, PartialEq, Hash, Clone, Copy, glib::Enum)]
#[repr(u32)]
#[enum_type(name = "GstRdmaDropPolicy")]
pub enum DropPolicyProperty {
    /// Wait for room (back-pressure): nothing is dropped while connected. End to end lossless,
    /// as the sender binary's `block` devices (frames in flight when a connection is lost are
    /// resent), only with `rdmasink`'s `lossless=true`.
    #[default]
    #[enum_value(
        name = "Block: wait for room (back-pressure, nothing dropped)",
        nick = "block"
    )]
    Block = 0,
    /// Live: drop the oldest queued frame and count it.
    #[enum_value(
        name = "Drop oldest: drop the oldest queued frame (live)",
        nick = "drop-oldest"
    )]
    DropOldest = 1,
}

impl From<DropPolicyProperty> for rdmastream::engine::DropPolicy {
    fn from(p: DropPolicyProperty) -> Self {
        match p {
            DropPolicyProperty::Block => rdmastream::engine::DropPolicy::Block,
            DropPolicyProperty::DropOldest => rdmastream::engine::DropPolicy::DropOldest,
        }
    }
}

/// A connector to `peer` (`host:port`) over `transport` (see [`rdmastream_verbs::connector`]).
pub fn connector(
    transport: Transport,
    peer: &str,
    verbs: &VerbsSettings,
    max_outstanding: usize,
) -> Result<Box<dyn Connector>, crate::Error> {
    if transport == Transport::Mem {
        return Ok(Box::new(fabric().connector(peer)));
    }
    verbs::connector(
        transport.nick(),
        peer,
        verbs,
        max_outstanding,
        rdmastream::transport::DEFAULT_PEER_TIMEOUT,
        Some(rdmastream::transport::shm_cache_budget()),
    )
    .map(|(_, c)| c)
    .map_err(|source| crate::Error::Transport {
        what: format!("transport {} to {peer}", transport.nick()),
        source,
    })
}

/// A listener on `addr` (`address:port`) over `transport`, offering `settings` to each sender
/// (see [`rdmastream_verbs::listener`]).
///
/// A listener frees its address when it is dropped, but the last `rdmasrc` of a shared listener
/// may be releasing it on another streaming thread at this moment; an address in use is retried
/// for up to a second before it is reported.
pub fn listener(
    transport: Transport,
    addr: &str,
    settings: RegionSettings,
    verbs: &VerbsSettings,
) -> Result<Box<dyn Listener>, crate::Error> {
    if transport == Transport::Mem {
        return Ok(Box::new(fabric().listen(addr, settings)));
    }
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        match verbs::listener(transport.nick(), addr, settings.clone(), verbs) {
            Ok((_, l)) => return Ok(Box::new(l)),
            Err(rdmastream::Error::Listen { source, .. })
                if source.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(source) => {
                return Err(crate::Error::Transport {
                    what: format!("transport {} on {addr}", transport.nick()),
                    source,
                });
            }
        }
    }
}

/// The process's in-memory fabric: `transport=mem` elements meet on it by address.
fn fabric() -> &'static rdmastream::transport::mem::MemFabric {
    static FABRIC: std::sync::LazyLock<rdmastream::transport::mem::MemFabric> =
        std::sync::LazyLock::new(Default::default);
    &FABRIC
}

/// `host:port`, with IPv6 literals bracketed; a `unix:/path` host (the shm transport) is the
/// whole address and the port is not used.
pub fn join_host_port(host: &str, port: u32) -> String {
    if host.starts_with(rdmastream::transport::UNIX_SCHEME) {
        host.to_string()
    } else if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The key of an element, from its `key` or `key-file` property (the file's contents, trimmed).
pub fn element_key(
    key: Option<&str>,
    key_file: Option<&str>,
) -> Result<Option<rdmastream::proto::handshake::Key>, crate::Error> {
    use rdmastream::proto::handshake::Key;
    match (key, key_file) {
        (Some(_), Some(_)) => Err(crate::Error::Key("set key or key-file, not both".into())),
        (Some(k), None) => Key::new(k.trim().as_bytes().to_vec())
            .map(Some)
            .map_err(|e| crate::Error::Key(format!("key: {e}"))),
        (None, Some(path)) => rdmastream_app::cli::read_key_file(std::path::Path::new(path))
            .map(Some)
            .map_err(|e| crate::Error::Key(format!("key-file: {e}"))),
        (None, None) => Ok(None),
    }
}
