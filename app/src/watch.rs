//! Whether a sender is connected: a [`ConnectionObserver`] that sets a flag while a connection
//! is up (for `/readyz` and the `rdmastream_connected` metric) and counts connections. The
//! engine's sending thread connects and reconnects by itself; this only watches.
//!
//! What it does not do: it changes nothing the connection does (every call is handed on).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rdmastream::transport::observe::{ConnectionObserver, observed};
use rdmastream::transport::{Connector, SendBlocks};

/// What the watch saw.
#[derive(Debug, Default)]
pub struct LinkWatch {
    /// A connection is up (set on connect, cleared on its first error or when it is dropped).
    pub connected: Arc<AtomicBool>,
    /// Connections made so far.
    pub connections: AtomicU64,
}

impl ConnectionObserver for LinkWatch {
    fn connected(
        &self,
        _: &str,
        _: rdmastream::proto::RemoteLayout,
        _: &SendBlocks,
    ) -> rdmastream::Result<()> {
        self.connections.fetch_add(1, Ordering::Relaxed);
        self.connected.store(true, Ordering::Release);
        Ok(())
    }
    fn connect_failed(&self, _: &rdmastream::Error) {}
    fn lost(&self, _: &rdmastream::Error) {
        self.connected.store(false, Ordering::Release);
    }
    fn closed(&self) {
        self.connected.store(false, Ordering::Release);
    }
}

/// Wraps `inner` so `watch` follows its connections.
pub fn watched(inner: Box<dyn Connector>, watch: Arc<LinkWatch>) -> Box<dyn Connector> {
    observed(inner, watch)
}
