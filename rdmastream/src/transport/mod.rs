//! Transports: what one-sided RDMA can do and nothing more — register memory, post a chain of
//! WRITEs (optionally inline), post a READ, poll completions — behind one interface, so the
//! sending thread and the receiver's polling threads do not know which one they run on.
//!
//! - [`mem`]: in-process, for tests and for measuring the engine without a network.
//! - [`tcp`]: software emulation over TCP for machines without an RDMA NIC. On the receiver a
//!   transport thread plays the NIC: it applies WRITEs to the registered region in posting order
//!   (status byte published with release ordering after the data), answers READs, and
//!   acknowledges signaled work requests so the sender gets RC-like completions.
//!
//! The receiver side of every transport is passive: the receiver's own code only reads blocks
//! and stores status bytes in its [`Region`]; it never posts anything.

pub mod mem;
pub mod region;
pub mod tcp;
pub mod verbs;

use std::time::Duration;

use crate::error::Result;
use crate::proto::RemoteLayout;
use crate::proto::handshake::Hello;

pub use region::{HeldBytes, Region, RegisteredBlocks, RetainedBlock, SendBlocks, SoftRegion};

/// Which remote memory region an operation targets (each has its own key and access rights:
/// blocks are remote-WRITE only, the status array remote READ and WRITE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Blocks = 0,
    Statuses = 1,
}

/// A place in the receiver's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteAddr {
    pub target: Target,
    pub offset: u64,
}

/// Where the bytes of one RDMA WRITE come from.
#[derive(Debug, Clone, Copy)]
pub enum WriteSource<'a> {
    /// The first `len` bytes of a registered send block.
    SendBlock { index: usize, len: usize },
    /// Inline data, copied at post time.
    Inline(&'a [u8]),
}

/// One RDMA WRITE work request of a chain.
#[derive(Debug, Clone, Copy)]
pub struct WriteWr<'a> {
    pub source: WriteSource<'a>,
    pub remote: RemoteAddr,
    /// Whether this request produces a completion.
    pub signaled: bool,
}

/// A completion polled from a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
}

/// The sender's end of one reliable connection (the one shared queue pair).
pub trait Connection: Send {
    /// Who is on the other end, for messages.
    fn peer(&self) -> &str;
    /// The receiver's region, from the handshake.
    fn layout(&self) -> RemoteLayout;
    /// Posts a chain of WRITEs as one work-request list. Only signaled ones complete.
    fn post_write_chain(&mut self, wr_id: u64, chain: &[WriteWr<'_>]) -> Result<()>;
    /// Posts one READ of `len` bytes at `remote` into this connection's read buffer; the bytes
    /// are valid in [`Connection::read_buffer`] once its completion was polled.
    fn post_read(&mut self, wr_id: u64, remote: RemoteAddr, len: usize) -> Result<()>;
    /// Waits up to `timeout` for completions and appends them to `out`. An error means the
    /// connection is gone; posted work without a completion may or may not have happened.
    fn poll_completions(&mut self, out: &mut Vec<Completion>, timeout: Duration) -> Result<()>;
    /// The local memory READs land in.
    fn read_buffer(&self) -> Vec<u8>;
}

/// Makes connections for a sender (one at a time; called again to reconnect).
pub trait Connector: Send {
    /// Transport name, for logs.
    fn transport(&self) -> &'static str;
    /// Peer description, for logs.
    fn peer(&self) -> String;
    /// Connects and hands the receiver `hello`; the connection reads WRITE sources from
    /// `blocks`.
    fn connect(
        &self,
        hello: &Hello,
        blocks: &std::sync::Arc<SendBlocks>,
    ) -> Result<Box<dyn Connection>>;
    /// Allocates (and registers, where the transport needs that) the sender's send blocks, once
    /// at start; [`Connector::connect`] is then given them.
    fn alloc_send_blocks(
        &self,
        count: usize,
        block_size: usize,
    ) -> Result<std::sync::Arc<SendBlocks>> {
        Ok(SendBlocks::new(count, block_size))
    }
}

/// What a receiver offers each connecting sender.
#[derive(Debug, Clone)]
pub struct RegionSettings {
    /// Receiver memory blocks per sender (N).
    pub blocks: usize,
    /// Bytes per block (B).
    pub block_size: usize,
    /// Required auth token; empty accepts any.
    pub token: String,
    /// Blocks marked unavailable (status 2) from the start, e.g. memory kept for another use.
    pub reserved_blocks: Vec<usize>,
}

/// A sender that completed the handshake, with the region it writes into.
pub struct Accepted {
    pub hello: Hello,
    /// Remote address of the sender, for logs.
    pub peer: String,
    pub region: std::sync::Arc<dyn Region>,
}

/// The receiver's listening side.
pub trait Listener: Send {
    /// Transport name, for logs.
    fn transport(&self) -> &'static str;
    /// Where it listens, for logs.
    fn local_addr(&self) -> String;
    /// Waits up to `timeout` for the next sender that completed the handshake.
    fn accept(&mut self, timeout: Duration) -> Result<Option<Accepted>>;
    /// Connections turned away since the last call (bad handshake, wrong token, wrong transport,
    /// no resources, peer gone mid-handshake), oldest first. Each was logged already; this is
    /// for counters and element messages. A listener keeps at most [`MAX_REFUSALS`] of them.
    fn refusals(&mut self) -> Vec<Refusal> {
        Vec::new()
    }
}

/// How many refusals a listener keeps for [`Listener::refusals`]; older ones are dropped.
pub const MAX_REFUSALS: usize = 32;

/// A connection that did not become a sender.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The peer's address.
    pub peer: String,
    /// Why, as told to the peer and logged.
    pub why: String,
}

/// Checks a Hello against the receiver's settings; `Err` is the refusal text for the peer.
pub(crate) fn check_hello(
    hello: &Hello,
    settings: &RegionSettings,
) -> std::result::Result<(), String> {
    if !settings.token.is_empty() && hello.token != settings.token {
        return Err("authentication failed: auth token does not match".into());
    }
    Ok(())
}

/// Which data path a sender or receiver runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Tcp,
    Verbs,
}

/// Resolves a `transport` setting (`auto`, `verbs`, `tcp`). `auto` uses verbs when the
/// configured RDMA device is usable and otherwise says in one log line why it falls back to
/// tcp; `verbs` without a usable device is an error naming what was looked for.
pub fn choose(transport: &str, verbs: &verbs::VerbsSettings) -> Result<Kind> {
    match transport {
        "tcp" => Ok(Kind::Tcp),
        "verbs" => verbs::probe(verbs).map(|what| {
            tracing::info!("transport verbs: {what}");
            Kind::Verbs
        }),
        "auto" => match verbs::probe(verbs) {
            Ok(what) => {
                tracing::info!("transport auto: using RDMA verbs on {what}");
                Ok(Kind::Verbs)
            }
            Err(e) => {
                tracing::info!(
                    "transport auto: no usable RDMA device ({e}); using the tcp software transport"
                );
                Ok(Kind::Tcp)
            }
        },
        other => Err(crate::Error::Invalid {
            key: "transport".into(),
            reason: format!("{other:?} is not one of auto, verbs, tcp"),
        }),
    }
}
