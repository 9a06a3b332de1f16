//! Safe RDMA verbs layer: the only module of the project that contains `unsafe`.
//!
//! It wraps just what rdmastream needs from libibverbs (through the `ibverbs-sys` FFI crate):
//! device listing and opening, port and GID queries with perftest-like GID selection,
//! protection domains, memory regions that own their memory, completion queues with busy
//! polling, and RC queue pairs that post chains of RDMA WRITEs (from registered memory or
//! inline) and RDMA READs.
//!
//! It deliberately does **not** offer SEND/RECV, UD/UC queue pairs, shared receive queues,
//! atomics, memory windows, completion channels (callers busy-poll with their own backoff)
//! or connection management: the [`QpEndpoint`] of each side is exchanged by the caller
//! over its own side channel (e.g. TCP) with [`QpEndpoint::to_bytes`].
//!
//! # Object lifetimes
//!
//! ```text
//! Context ◄── ProtectionDomain ◄── MemoryRegion
//!    ▲               ▲
//!    └── CompletionQueue ◄── PreparedQp / ConnectedQp ──► ProtectionDomain
//! ```
//!
//! Every object keeps an `Arc` to the inner state of its parents, so a parent is released
//! only after all its children: a queue pair is destroyed before its completion queues and
//! protection domain, a memory region is deregistered before its protection domain, and all
//! of them before the device context is closed. Users may drop the handles in any order.
//!
//! # Registered memory and soundness
//!
//! A [`MemoryRegion`] owns a page-aligned, zero-initialised heap buffer that is registered
//! for its whole life and freed only after `ibv_dereg_mr` succeeded (after which the NIC can
//! no longer touch it). The NIC reads and writes that buffer behind the compiler's back:
//! the local NIC for posted WRITE sources and READ destinations, a remote NIC for any region
//! registered with remote access. The buffer is therefore treated like memory shared with
//! another process:
//!
//! * [`MemoryRegion::atomic_bytes`] is safe. It views the buffer as `&[AtomicU8]`:
//!   `AtomicU8` has the same size, alignment and bit validity as `u8`, and — being built on
//!   `UnsafeCell` — a shared `&AtomicU8` explicitly allows the byte to change under it, be
//!   it through another `&AtomicU8` or through a DMA write by the NIC. A DMA write of one
//!   byte can never be observed torn (single bytes have no tearing), and every CPU-side
//!   access through this view is an atomic access, so no data race on the Rust side exists.
//!   This is the view to poll status bytes with while the NIC writes into them.
//! * [`MemoryRegion::as_slice`], [`MemoryRegion::as_mut_slice`], [`MemoryRegion::range`] and
//!   [`MemoryRegion::range_mut`] hand out plain `&[u8]`/`&mut [u8]`, which promise the
//!   compiler that nothing else changes (or, for `&mut`, even reads) those bytes while the
//!   reference lives. That is only true when no RDMA operation targets them and no other
//!   thread touches them, which this module cannot check — a remote peer holding the rkey
//!   may write at any time — so they are `unsafe fn` with the exact condition documented.
//!
//! Note that seeing a status byte change (even with `Ordering::Acquire`) does not by itself
//! prove that the NIC has placed the payload written before it: that relies on in-order
//! placement, which NICs provide but the verbs specification does not promise (see
//! `ibv_reg_mr(3)`, "ORDERING SEMANTICS"). Protocols should validate a block (length, seal)
//! before using it. `IBV_ACCESS_RELAXED_ORDERING` is never used by this module.
//!
//! Posting work requests is `unsafe` ([`ConnectedQp::post_write_chain`],
//! [`ConnectedQp::post_read`]): the NIC accesses the local memory asynchronously, until the
//! completion is polled, which the type system cannot follow.
//!
//! One file per verbs object: [`device`] (listing), [`context`] (opening, ports, GIDs), [`mr`]
//! (protection domains, memory regions), [`cq`] (completion queues), [`qp`] (queue pairs and
//! posting); errors and the errno helpers are here.

use std::ffi::c_int;
use std::io;

pub mod context;
pub mod cq;
pub mod device;
pub mod mr;
pub mod qp;
#[cfg(test)]
mod tests;

pub use context::*;
pub use cq::*;
pub use device::*;
pub use mr::*;
pub use qp::*;
use {context::ContextInner, cq::CqInner, device::DeviceList, mr::PdInner};

/// Result of every fallible call of this module.
///
/// Errors carry the OS error (errno) as their `source()`; print them with the chain (e.g.
/// anyhow's `{:#}`) to see it.
pub type Result<T> = std::result::Result<T, VerbsError>;

/// Alignment (and size granularity) of the memory owned by a [`MemoryRegion`].
///
/// Whole pages keep other heap data out of pinned pages and give DMA-friendly alignment.
pub const REGION_ALIGN: usize = 4096;

/// What went wrong in the verbs layer.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// libibverbs found no kernel RDMA support (`ENOSYS`), e.g. on a host kernel built
    /// without InfiniBand/RDMA.
    #[error(
        "{op} failed: the running kernel has no RDMA support \
         (no /sys/class/infiniband_verbs); run on a machine or VM with an RDMA device, \
         e.g. Soft-RoCE (rdma_rxe)"
    )]
    NoKernelSupport {
        /// The verbs call that failed.
        op: &'static str,
        /// The OS error (ENOSYS).
        #[source]
        source: io::Error,
    },
    /// The kernel supports RDMA but no device is present.
    #[error("no RDMA device found (ibv_get_device_list returned 0 devices)")]
    NoDevice,
    /// A device was asked for by name and is not there.
    #[error("RDMA device '{wanted}' not found; available: {available}")]
    DeviceNotFound {
        /// The name asked for.
        wanted: String,
        /// Comma-separated names of the devices present.
        available: String,
    },
    /// A verbs call returned an error.
    #[error("{op} failed on {device}")]
    Verbs {
        /// The verbs call (and what it was for).
        op: &'static str,
        /// The device name.
        device: String,
        /// The OS error reported by libibverbs or the provider.
        #[source]
        source: io::Error,
    },
    /// `ibv_create_qp` refused the requested capabilities.
    #[error(
        "ibv_create_qp failed on {device} (asked max_send_wr={}, max_recv_wr={}, \
         max_send_sge={}, max_recv_sge={}, max_inline_data={})",
        .asked.max_send_wr, .asked.max_recv_wr, .asked.max_send_sge, .asked.max_recv_sge,
        .asked.max_inline_data
    )]
    CreateQp {
        /// The device name.
        device: String,
        /// What was asked for.
        asked: QpCaps,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The device granted less inline data than asked for.
    #[error("{device} granted max_inline_data={granted} bytes, below the {requested} asked for")]
    InlineTooSmall {
        /// The device name.
        device: String,
        /// Bytes asked for.
        requested: u32,
        /// Bytes granted.
        granted: u32,
    },
    /// The port is not usable.
    #[error("port {port} of {device} is {state}, not ACTIVE")]
    PortNotActive {
        /// The device name.
        device: String,
        /// The port number.
        port: u8,
        /// Its state.
        state: PortState,
    },
    /// No GID entry fits (none at all, or not the explicitly asked index).
    #[error("{reason} on {device} port {port}; GID table: [{table}]")]
    NoUsableGid {
        /// The device name.
        device: String,
        /// The port number.
        port: u8,
        /// Why no entry was chosen.
        reason: String,
        /// The valid entries of the port, for the message.
        table: String,
    },
    /// A work request of a chain is invalid; nothing of the chain was posted.
    #[error("work request {wr_index} not posted: {reason}")]
    InvalidWorkRequest {
        /// Index of the offending request in the chain.
        wr_index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// `ibv_post_send` rejected a work request of the chain.
    #[error(
        "ibv_post_send failed at work request {wr_index} of {chain_len} \
         (requests before it were posted)"
    )]
    PostSend {
        /// Index in the chain of the first request not posted.
        wr_index: usize,
        /// Length of the chain.
        chain_len: usize,
        /// The OS error returned by the provider.
        #[source]
        source: io::Error,
    },
    /// `ibv_poll_cq` reported an error (the CQ is in a bad state).
    #[error("ibv_poll_cq failed on {device}: returned {ret}")]
    PollCq {
        /// The device name.
        device: String,
        /// The negative value returned.
        ret: i32,
    },
    /// An argument is out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// Turns a verbs return value (0, a positive errno, a negative errno, or -1 with `errno`
/// set) into an `io::Error`.
fn ret_error(ret: c_int) -> io::Error {
    match ret {
        -1 => {
            let last = io::Error::last_os_error();
            if last.raw_os_error().unwrap_or(0) == 0 {
                io::Error::other("returned -1 without errno")
            } else {
                last
            }
        }
        r if r < 0 => io::Error::from_raw_os_error(-r),
        r => io::Error::from_raw_os_error(r),
    }
}

/// `errno` after a call that returned NULL, with a fallback when the provider set none.
fn null_error() -> io::Error {
    let last = io::Error::last_os_error();
    if last.raw_os_error().unwrap_or(0) == 0 {
        io::Error::other("returned NULL without errno")
    } else {
        last
    }
}
