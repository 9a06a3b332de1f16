//! A connector that tells an observer how its connections fare (connected, refused, lost,
//! closed) and otherwise hands every call on unchanged. The binaries use it for readiness and
//! the `rdmastream_connected` metric, the elements for their link state and bus messages.
//!
//! What it does not do: it never retries or changes a call's result, except that an observer
//! may refuse a connection that came up ([`ConnectionObserver::connected`]).

use std::sync::Arc;
use std::time::Duration;

use super::{
    AckQueue, Completion, Connection, Connector, Notice, RemoteAddr, SendBlocks, WindowConnection,
    WorkCounts, WriteWr,
};
use crate::error::{Error, Result};
use crate::proto::RemoteLayout;
use crate::proto::handshake::{Hello, Key};
use crate::proto::window::Immediate;

/// What a watcher of a connector's connections is told.
pub trait ConnectionObserver: Send + Sync {
    /// A connection to `peer` came up with the receiver's `layout` and send blocks `blocks`; an
    /// error refuses it (the connect fails with that error, and [`Self::connect_failed`] is not
    /// called for it).
    fn connected(&self, peer: &str, layout: RemoteLayout, blocks: &SendBlocks) -> Result<()>;
    /// Connecting failed.
    fn connect_failed(&self, error: &Error);
    /// A call on an up connection failed: it is gone.
    fn lost(&self, error: &Error);
    /// The connection was dropped.
    fn closed(&self);
    /// The receiver sent a notice about one device (the sending thread logs it as well).
    fn notice(&self, _notice: &Notice) {}
}

/// Wraps `inner` so `observer` follows its connections.
pub fn observed(
    inner: Box<dyn Connector>,
    observer: Arc<dyn ConnectionObserver>,
) -> Box<dyn Connector> {
    Box::new(ObservedConnector { inner, observer })
}

struct ObservedConnector {
    inner: Box<dyn Connector>,
    observer: Arc<dyn ConnectionObserver>,
}

impl Connector for ObservedConnector {
    fn transport(&self) -> &'static str {
        self.inner.transport()
    }
    fn placement(&self) -> crate::proto::Placement {
        self.inner.placement()
    }
    fn peer(&self) -> String {
        self.inner.peer()
    }
    fn alloc_send_blocks(&self, count: usize, block_size: usize) -> Result<Arc<SendBlocks>> {
        self.inner.alloc_send_blocks(count, block_size)
    }
    fn connect_window(
        &self,
        hello: &Hello,
        key: Option<&Key>,
        blocks: &Arc<SendBlocks>,
    ) -> Result<Box<dyn WindowConnection>> {
        self.connect_window_observed(hello, key, blocks)
    }
    fn connect(
        &self,
        hello: &Hello,
        key: Option<&Key>,
        blocks: &Arc<SendBlocks>,
    ) -> Result<Box<dyn Connection>> {
        match self.inner.connect(hello, key, blocks) {
            Ok(conn) => {
                self.observer
                    .connected(conn.peer(), conn.layout(), blocks)?;
                Ok(Box::new(ObservedConnection {
                    inner: conn,
                    observer: self.observer.clone(),
                }))
            }
            Err(e) => {
                self.observer.connect_failed(&e);
                Err(e)
            }
        }
    }
}

impl ObservedConnector {
    fn connect_window_observed(
        &self,
        hello: &Hello,
        key: Option<&Key>,
        blocks: &Arc<SendBlocks>,
    ) -> Result<Box<dyn WindowConnection>> {
        match self.inner.connect_window(hello, key, blocks) {
            Ok(conn) => {
                self.observer
                    .connected(conn.peer(), conn.layout(), blocks)?;
                Ok(Box::new(ObservedWindow {
                    inner: conn,
                    observer: self.observer.clone(),
                }))
            }
            Err(e) => {
                self.observer.connect_failed(&e);
                Err(e)
            }
        }
    }
}

/// A sliding-window connection, observed like [`ObservedConnection`].
struct ObservedWindow {
    inner: Box<dyn WindowConnection>,
    observer: Arc<dyn ConnectionObserver>,
}

impl ObservedWindow {
    fn observe<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            self.observer.lost(e);
        }
        r
    }
}

impl WindowConnection for ObservedWindow {
    fn peer(&self) -> &str {
        self.inner.peer()
    }
    fn layout(&self) -> RemoteLayout {
        self.inner.layout()
    }
    fn post_write_imm(&mut self, wr_id: u64, send_block: usize, imm: Immediate) -> Result<()> {
        let r = self.inner.post_write_imm(wr_id, send_block, imm);
        self.observe(r)
    }
    fn poll_completions(&mut self, out: &mut Vec<u64>, timeout: Duration) -> Result<()> {
        let r = self.inner.poll_completions(out, timeout);
        self.observe(r)
    }
    fn take_ack_queue(&mut self) -> Option<Box<dyn AckQueue>> {
        self.inner.take_ack_queue()
    }
    fn heartbeat(&mut self) -> Result<()> {
        let r = self.inner.heartbeat();
        self.observe(r)
    }
    fn work_counts(&self) -> WorkCounts {
        self.inner.work_counts()
    }
}

impl Drop for ObservedWindow {
    fn drop(&mut self) {
        self.observer.closed();
    }
}

struct ObservedConnection {
    inner: Box<dyn Connection>,
    observer: Arc<dyn ConnectionObserver>,
}

impl ObservedConnection {
    fn observe<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            self.observer.lost(e);
        }
        r
    }
}

impl Connection for ObservedConnection {
    fn peer(&self) -> &str {
        self.inner.peer()
    }
    fn layout(&self) -> RemoteLayout {
        self.inner.layout()
    }
    fn post_write_chain(&mut self, wr_id: u64, chain: &[WriteWr<'_>]) -> Result<()> {
        let r = self.inner.post_write_chain(wr_id, chain);
        self.observe(r)
    }
    fn post_read(&mut self, wr_id: u64, remote: RemoteAddr, len: usize) -> Result<()> {
        let r = self.inner.post_read(wr_id, remote, len);
        self.observe(r)
    }
    fn poll_completions(&mut self, out: &mut Vec<Completion>, timeout: Duration) -> Result<()> {
        let r = self.inner.poll_completions(out, timeout);
        self.observe(r)
    }
    // The liveness check must reach the real connection: it sends the heartbeats and notices
    // a receiver (or link) that went silent.
    fn heartbeat(&mut self) -> Result<()> {
        let r = self.inner.heartbeat();
        self.observe(r)
    }
    fn take_notices(&mut self) -> Vec<Notice> {
        let notices = self.inner.take_notices();
        for n in &notices {
            self.observer.notice(n);
        }
        notices
    }
    fn work_counts(&self) -> Option<WorkCounts> {
        self.inner.work_counts()
    }
    fn lend_block(&self, remote_block: usize) -> Option<Box<dyn crate::transport::LeasedBlock>> {
        self.inner.lend_block(remote_block)
    }
    fn cache_budget(&self) -> Option<usize> {
        self.inner.cache_budget()
    }
    fn send_limits(&self, block_size: usize) -> super::SendLimits {
        self.inner.send_limits(block_size)
    }
    fn syncs_early(&self) -> bool {
        self.inner.syncs_early()
    }
    fn writes_lowest_first(&self) -> bool {
        self.inner.writes_lowest_first()
    }
    fn completes_at_once(&self) -> bool {
        self.inner.completes_at_once()
    }
    fn posts_here_when_idle(&self) -> bool {
        self.inner.posts_here_when_idle()
    }
}

impl Drop for ObservedConnection {
    fn drop(&mut self) {
        self.observer.closed();
    }
}
