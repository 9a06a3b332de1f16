//! Whether a sender is connected: a [`Connector`] wrapper that sets a flag while a connection
//! is up (for `/readyz` and the `rdmastream_connected` metric) and counts connections. The
//! engine's sending thread connects and reconnects by itself; this only watches.
//!
//! What it does not do: it changes nothing the connection does (every call is handed on).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use rdmastream::proto::RemoteLayout;
use rdmastream::proto::handshake::{Hello, Key};
use rdmastream::transport::{Completion, Connection, Connector, RemoteAddr, SendBlocks, WriteWr};

/// What the watch saw.
#[derive(Debug, Default)]
pub struct LinkWatch {
    /// A connection is up (set on connect, cleared on its first error or when it is dropped).
    pub connected: Arc<AtomicBool>,
    /// Connections made so far.
    pub connections: AtomicU64,
}

/// Wraps `inner` so `watch` follows its connections.
pub fn watched(inner: Box<dyn Connector>, watch: Arc<LinkWatch>) -> Box<dyn Connector> {
    Box::new(WatchedConnector { inner, watch })
}

struct WatchedConnector {
    inner: Box<dyn Connector>,
    watch: Arc<LinkWatch>,
}

impl Connector for WatchedConnector {
    fn transport(&self) -> &'static str {
        self.inner.transport()
    }

    fn peer(&self) -> String {
        self.inner.peer()
    }

    fn alloc_send_blocks(
        &self,
        count: usize,
        block_size: usize,
    ) -> rdmastream::Result<Arc<SendBlocks>> {
        self.inner.alloc_send_blocks(count, block_size)
    }

    fn connect(
        &self,
        hello: &Hello,
        key: Option<&Key>,
        blocks: &Arc<SendBlocks>,
    ) -> rdmastream::Result<Box<dyn Connection>> {
        let conn = self.inner.connect(hello, key, blocks)?;
        self.watch.connections.fetch_add(1, Ordering::Relaxed);
        self.watch.connected.store(true, Ordering::Release);
        Ok(Box::new(WatchedConnection {
            inner: conn,
            watch: self.watch.clone(),
        }))
    }
}

struct WatchedConnection {
    inner: Box<dyn Connection>,
    watch: Arc<LinkWatch>,
}

impl WatchedConnection {
    fn observe<T>(&self, r: rdmastream::Result<T>) -> rdmastream::Result<T> {
        if r.is_err() {
            self.watch.connected.store(false, Ordering::Release);
        }
        r
    }
}

impl Connection for WatchedConnection {
    fn peer(&self) -> &str {
        self.inner.peer()
    }
    fn layout(&self) -> RemoteLayout {
        self.inner.layout()
    }
    fn post_write_chain(&mut self, wr_id: u64, chain: &[WriteWr<'_>]) -> rdmastream::Result<()> {
        let r = self.inner.post_write_chain(wr_id, chain);
        self.observe(r)
    }
    fn post_read(&mut self, wr_id: u64, remote: RemoteAddr, len: usize) -> rdmastream::Result<()> {
        let r = self.inner.post_read(wr_id, remote, len);
        self.observe(r)
    }
    fn poll_completions(
        &mut self,
        out: &mut Vec<Completion>,
        timeout: Duration,
    ) -> rdmastream::Result<()> {
        let r = self.inner.poll_completions(out, timeout);
        self.observe(r)
    }
    // The liveness check must reach the real connection (it sends heartbeats and notices a
    // silent peer).
    fn heartbeat(&mut self) -> rdmastream::Result<()> {
        let r = self.inner.heartbeat();
        self.observe(r)
    }
}

impl Drop for WatchedConnection {
    fn drop(&mut self) {
        self.watch.connected.store(false, Ordering::Release);
    }
}
