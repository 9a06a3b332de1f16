//! The end-to-end acknowledgement of lossless (`block`) devices.
//!
//! In the status-byte mechanism a block's status byte goes back to 0 only when the receiver is
//! done with it. For a message of a lossless device "done" means durably handed on (the frame
//! file renamed into place, the buffer pushed into a GStreamer pipeline): the receiver keeps the
//! message's last block unavailable until then, and the sender keeps the message until a sync
//! shows that block free (see docs/protocol.md, "Lossless delivery").
//!
//! An [`Ack`] travels with the message from the block to whoever hands it on, who calls
//! [`Ack::done`] once it is durable. An ack that is dropped without `done` never frees its block:
//! the receiver must not tell the sender a message is safe when it is not. What the ack does is
//! up to the transport ([`Settle`]); this module only carries it.

use std::sync::Arc;

/// What settling an acknowledgement does (implemented by the receiver's transport side).
pub trait Settle: Send + Sync {
    /// The message is durable: the block may be given back.
    fn settle(&self);
}

/// The acknowledgement of one message of a lossless device; clones share it.
#[derive(Clone)]
pub struct Ack(Arc<dyn Settle>);

impl Ack {
    /// An acknowledgement settled by `s`.
    pub fn new(s: Arc<dyn Settle>) -> Ack {
        Ack(s)
    }

    /// The message is durably handed on.
    pub fn done(&self) {
        self.0.settle();
    }
}

impl std::fmt::Debug for Ack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ack")
    }
}

/// Acks do not take part in comparing events.
impl PartialEq for Ack {
    fn eq(&self, _: &Ack) -> bool {
        true
    }
}

impl Eq for Ack {}

/// Settles `ack` if there is one.
pub fn settle(ack: &Option<Ack>) {
    if let Some(a) = ack {
        a.done();
    }
}
