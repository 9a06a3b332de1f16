//! Helpers shared by the test binaries.

#![allow(dead_code)]

use std::time::Duration;

/// Generous: a deadline exists so a broken element fails the test instead of hanging it, never
/// to make a slow machine fail.
pub const DEADLINE: Duration = Duration::from_secs(60);

pub use rdmastream_testkit::free_port;

/// Waits until `cond` holds, polling; panics with `what` after [`DEADLINE`].
pub fn wait_for(what: &str, cond: impl FnMut() -> bool) {
    assert!(
        rdmastream_testkit::wait_for(DEADLINE, cond),
        "timed out waiting for {what}"
    );
}

/// The transport the element tests run over: `RDMASTREAM_TEST_TRANSPORT` (`tcp` unless set;
/// `mem` for the in-process transport, which scripts/test.sh runs the Harness tests over too;
/// `verbs` in the Soft-RoCE VM).
pub fn transport() -> String {
    std::env::var("RDMASTREAM_TEST_TRANSPORT").unwrap_or_else(|_| "tcp".into())
}

/// The address sinks connect to: `RDMASTREAM_TEST_HOST` (loopback unless set; over verbs, an
/// address of the RDMA interface).
pub fn host() -> String {
    std::env::var("RDMASTREAM_TEST_HOST").unwrap_or_else(|_| "127.0.0.1".into())
}

/// The key both ends use when [`host`] is not loopback (in the Soft-RoCE VM): the elements refuse
/// to listen on a non-loopback address without one.
pub const TEST_KEY: &str = "test-key-0123456789abcdef";

/// `Some(TEST_KEY)` when [`host`] is not loopback.
pub fn key() -> Option<&'static str> {
    // is_loopback takes host:port, as the elements pass it.
    (!rdmastream_app::cli::is_loopback(&format!("{}:1", host()))).then_some(TEST_KEY)
}
