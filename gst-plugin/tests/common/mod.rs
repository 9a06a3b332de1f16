//! Helpers shared by the test binaries.

#![allow(dead_code)]

use std::time::{Duration, Instant};

/// Generous: a deadline exists so a broken element fails the test instead of hanging it, never
/// to make a slow machine fail.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// A free TCP port on loopback.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits until `cond` holds, polling; panics with `what` after [`DEADLINE`].
pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + DEADLINE;
    while !cond() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The transport the element tests run over: `RDMASTREAM_TEST_TRANSPORT` (`tcp` unless set;
/// `verbs` in the Soft-RoCE VM).
pub fn transport() -> String {
    std::env::var("RDMASTREAM_TEST_TRANSPORT").unwrap_or_else(|_| "tcp".into())
}

/// The address sinks connect to: `RDMASTREAM_TEST_HOST` (loopback unless set; over verbs, an
/// address of the RDMA interface).
pub fn host() -> String {
    std::env::var("RDMASTREAM_TEST_HOST").unwrap_or_else(|_| "127.0.0.1".into())
}
