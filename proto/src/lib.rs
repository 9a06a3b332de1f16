//! rdmastream's protocol core, the status-byte-assisted mechanism of the paper (section 3) as
//! data and decisions: the block layout (header, trailer, status bytes), the handshake and its
//! proofs, the sender's state machine (which block, when to sync, what a completion confirms),
//! fragmentation and reassembly, the filling decisions ([`FillingMachine`]: numbering, format
//! resend, returning devices), per-device reordering, the receiver's view of one sender
//! ([`SenderSession`]: sessions, frames held until their format), and memory budgets. Beside it,
//! the sliding-window baseline the paper compares against ([`window`]), as state machines too.
//!
//! What it does not do: no IO, no threads, no sockets, no clock reads (time comes in as an
//! argument), no images, no config files, no `unsafe`. Everything here is deterministic; the
//! `rdmastream` crate drives it with real transports and its simulator (`rdmastream::sim`).
#![forbid(unsafe_code)]

pub mod ack;
pub mod budget;
pub mod coalesce;
pub mod filling;
pub mod format;
pub mod handshake;
pub mod header;
pub mod packetizer;
pub mod reorder;
pub mod sender;
pub mod session;
pub mod window;

pub use ack::Ack;
pub use budget::{Budget, Reservation};
pub use coalesce::{Batch, Coalescer, SubMessage, decode_any};
pub use filling::{Added, FillingMachine, FramePlan, Message};
pub use format::Format;
pub use header::{
    BlockError, BlockHeader, HEADER_LEN, NO_PTS, OVERHEAD, Placement, TRAILER_LEN,
    payload_capacity, status,
};
pub use packetizer::{DeviceNumbering, MessageKind, MessageTimes, fragment_range};
pub use reorder::{DeviceStream, Frame, Limits, Packet, ReorderConfig, ReorderStats, StreamEvent};
pub use sender::{Action, Completed, Delivery, Lent, RemoteLayout, SenderMachine, SenderStats};
pub use session::{Connected, Released, SenderSession};
pub use window::{
    Immediate, ReceiverAction, WindowAction, WindowError, WindowReceiver, WindowSender, WindowStats,
};

/// Scans status bytes round-robin for the next full block, like the paper's receiving thread.
#[derive(Debug, Default, Clone)]
pub struct BlockScanner {
    cursor: usize,
}

impl BlockScanner {
    /// Next block index whose status (from `status_of`) is FULL, starting after the last one
    /// found; `None` if no block is full.
    pub fn next_full(&mut self, n: usize, mut status_of: impl FnMut(usize) -> u8) -> Option<usize> {
        for k in 0..n {
            let j = (self.cursor + k) % n;
            if status_of(j) == status::FULL {
                self.cursor = (j + 1) % n;
                return Some(j);
            }
        }
        None
    }

    /// Makes block `j` the first one the next scan looks at (a block that must wait is taken
    /// before any later one, so blocks are still taken in the order they were written).
    pub fn retry(&mut self, j: usize) {
        self.cursor = j;
    }
}
