//! Completion queues, polled in batches.

use super::*;
use std::ffi::{CStr, c_int};
use std::fmt;
use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use ibverbs_sys as ffi;

pub(crate) struct CqInner {
    pub(crate) cq: NonNull<ffi::ibv_cq>,
    pub(crate) ctx: Arc<ContextInner>,
}

// SAFETY: polling a CQ from several threads is allowed (providers lock it); the handle is
// only destroyed in `Drop`.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: QPs using this CQ hold an `Arc<CqInner>`, so they are destroyed already;
        // the context stays open until `self.ctx` is dropped after this body.
        unsafe { ffi::ibv_destroy_cq(self.cq.as_ptr()) };
    }
}

/// A completion queue, polled without blocking.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("device", &self.inner.ctx.name)
            .finish()
    }
}

/// Outcome of a work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcStatus {
    /// Completed successfully.
    Success,
    /// Failed; the QP is now in the error state and later requests complete as flushed.
    Error {
        /// `ibv_wc_status` value.
        code: u32,
        /// Provider-specific syndrome.
        vendor_err: u32,
        /// `ibv_wc_status_str(code)`, e.g. "remote access error".
        text: &'static str,
    },
}

/// Operation of a completion (valid for successful completions only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcOpcode {
    /// RDMA WRITE.
    RdmaWrite,
    /// RDMA READ.
    RdmaRead,
    /// SEND.
    Send,
    /// Receive (of a SEND).
    Recv,
    /// Receive consumed by an RDMA WRITE WITH IMMEDIATE.
    RecvRdmaWithImm,
    /// Not meaningful (failed completions) or not used by this module.
    Other(u32),
}

/// A polled work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The `wr_id` of the work request.
    pub wr_id: u64,
    /// Success or the error status.
    pub status: WcStatus,
    /// The operation; [`WcOpcode::Other`] for failed completions, whose opcode is undefined.
    pub opcode: WcOpcode,
    /// Bytes transferred (meaningful for READ and receive completions).
    pub byte_len: u32,
    /// The immediate of a WRITE WITH IMMEDIATE (or SEND with immediate), host order.
    pub imm: Option<u32>,
}

impl Default for Completion {
    fn default() -> Self {
        Completion {
            wr_id: 0,
            status: WcStatus::Success,
            opcode: WcOpcode::Other(0),
            byte_len: 0,
            imm: None,
        }
    }
}

impl Completion {
    /// Whether the work request succeeded.
    pub fn is_success(&self) -> bool {
        self.status == WcStatus::Success
    }
}

pub(crate) fn wc_status_text(code: u32) -> &'static str {
    // SAFETY: `ibv_wc_status_str` accepts any value and returns a pointer to a static,
    // NUL-terminated string of libibverbs (or "unknown"), valid for the whole program.
    let text = unsafe { CStr::from_ptr(ffi::ibv_wc_status_str(code)) };
    text.to_str().unwrap_or("(non-UTF-8 status text)")
}

/// How many `ibv_wc` are fetched per `poll_cq` call.
pub(crate) const POLL_BATCH: usize = 32;

impl CompletionQueue {
    /// Fetches up to `out.len()` completions without blocking; returns how many were
    /// written to the front of `out` (0 when none is ready).
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        let cq = self.inner.cq.as_ptr();
        // SAFETY: `cq` and its context are alive while `self.inner` lives; `poll_cq` is the
        // provider's function that the header's static inline `ibv_poll_cq` calls.
        let poll_cq = unsafe { (*(*cq).context).ops.poll_cq }.ok_or_else(|| VerbsError::Verbs {
            op: "ibv_poll_cq",
            device: self.inner.ctx.name.clone(),
            source: io::Error::from(io::ErrorKind::Unsupported),
        })?;
        let mut wcs = [ffi::ibv_wc::default(); POLL_BATCH];
        let mut filled = 0;
        while filled < out.len() {
            let want = (out.len() - filled).min(POLL_BATCH);
            // SAFETY: `wcs` has room for `want` entries; `ibv_wc` matches the C layout
            // (checked by ibverbs-sys' layout test).
            let n = unsafe { poll_cq(cq, want as c_int, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(VerbsError::PollCq {
                    device: self.inner.ctx.name.clone(),
                    ret: n,
                });
            }
            let n = n as usize;
            for (slot, wc) in out[filled..].iter_mut().zip(&wcs[..n]) {
                *slot = convert_wc(wc);
            }
            filled += n;
            if n < want {
                break;
            }
        }
        Ok(filled)
    }
}

pub(crate) fn convert_wc(wc: &ffi::ibv_wc) -> Completion {
    match wc.error() {
        None => Completion {
            wr_id: wc.wr_id(),
            status: WcStatus::Success,
            opcode: match wc.opcode() {
                ffi::ibv_wc_opcode::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
                ffi::ibv_wc_opcode::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
                ffi::ibv_wc_opcode::IBV_WC_SEND => WcOpcode::Send,
                ffi::ibv_wc_opcode::IBV_WC_RECV => WcOpcode::Recv,
                ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
                other => WcOpcode::Other(other),
            },
            byte_len: wc.len() as u32,
            imm: wc.imm_data().map(u32::from_be),
        },
        Some((code, vendor_err)) => Completion {
            wr_id: wc.wr_id(),
            status: WcStatus::Error {
                code,
                vendor_err,
                text: wc_status_text(code),
            },
            opcode: WcOpcode::Other(wc.opcode()),
            byte_len: 0,
            imm: None,
        },
    }
}
