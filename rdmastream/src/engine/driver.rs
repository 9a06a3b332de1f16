//! The one poll → post → complete loop of a sender, shared by the engine's sending thread, the
//! benchmarks and the simulator: every action the [`SenderMachine`] has is posted on the
//! [`Connection`], then, while anything is in flight, completions are polled and handed back,
//! each saying what it completes (a write chain, or a sync with the status bytes it read).

use std::time::{Duration, Instant};

use crate::error::Result;
use crate::proto::{Action, SenderMachine, status};
use crate::transport::{Completion, Connection, RemoteAddr, Target, WriteSource, WriteWr};

/// What one [`Driver::turn`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Turn {
    /// Actions posted.
    pub posted: usize,
    /// Completions handed to the machine.
    pub completed: usize,
    /// Whether anything is still in flight (a write chain or a sync): the caller has nothing
    /// to wait for on the connection when this is false.
    pub in_flight: bool,
}

/// Drives one [`SenderMachine`] over one [`Connection`]. Keeps its completion buffer between
/// turns.
#[derive(Debug, Default)]
pub struct Driver {
    completions: Vec<Completion>,
}

impl Driver {
    pub fn new() -> Self {
        Driver::default()
    }

    /// One turn: posts every action the machine has at `now()`, then, if anything is in
    /// flight, waits up to `wait` for completions and hands each to the machine (at `now()`
    /// again). Blocks the machine freed are then in [`SenderMachine::poll_freed`]. An error
    /// means the connection is gone (the caller tells the machine, and reconnects).
    ///
    /// Completions can make an action ready (a sync for confirmations): after a turn that
    /// posted or completed anything, turn again before waiting for new input. Posting that
    /// action within the same turn was tried and is worse: it syncs before the filling side
    /// has refilled the freed blocks (engine over tcp lost about a third of its small-block
    /// throughput, and the retained-block simulation took three times as long).
    pub fn turn(
        &mut self,
        machine: &mut SenderMachine,
        conn: &mut dyn Connection,
        now: &dyn Fn() -> Instant,
        wait: Duration,
    ) -> Result<Turn> {
        // Remote blocks are the receiver's size, which may exceed the sender's blocks.
        let block_size = conn.layout().block_size;
        machine.set_early_sync(conn.syncs_early());
        machine.set_max_full(crate::transport::max_full_blocks(conn));
        machine.set_lowest_first(conn.writes_lowest_first());
        machine.set_sync_after_placed(conn.completes_at_once());
        let mut turn = Turn::default();
        let t = now();
        while let Some(action) = machine.poll_action(t) {
            post_action(conn, action, block_size)?;
            turn.posted += 1;
        }
        if machine.outstanding() > 0 || machine.sync_in_flight() {
            self.completions.clear();
            conn.poll_completions(&mut self.completions, wait)?;
            let t = now();
            for c in &self.completions {
                if machine.handle_completed(t, c.completed()) {
                    turn.completed += 1;
                }
            }
        }
        turn.in_flight = machine.outstanding() > 0 || machine.sync_in_flight();
        Ok(turn)
    }
}

/// Posts one action of the [`SenderMachine`] on `conn`: a write chain (data WRITE unsignaled,
/// then the status byte 1 inline and signaled) or the sync READ of the whole status array.
/// `block_size` is the receiver's (remote offsets are `remote_block × block_size`).
fn post_action(conn: &mut dyn Connection, action: Action, block_size: usize) -> Result<()> {
    match action {
        Action::Write {
            wr_id,
            send_block,
            remote_block,
            len,
        } => {
            let chain = [
                WriteWr {
                    source: WriteSource::SendBlock {
                        index: send_block,
                        len,
                    },
                    remote: RemoteAddr {
                        target: Target::Blocks,
                        offset: (remote_block * block_size) as u64,
                    },
                    signaled: false,
                },
                WriteWr {
                    source: WriteSource::Inline(&[status::FULL]),
                    remote: RemoteAddr {
                        target: Target::Statuses,
                        offset: remote_block as u64,
                    },
                    signaled: true,
                },
            ];
            conn.post_write_chain(wr_id, &chain)
        }
        Action::Status {
            wr_id,
            remote_block,
        } => conn.post_write_chain(
            wr_id,
            &[WriteWr {
                source: WriteSource::Inline(&[status::FULL]),
                remote: RemoteAddr {
                    target: Target::Statuses,
                    offset: remote_block as u64,
                },
                signaled: true,
            }],
        ),
        Action::Sync { wr_id } => {
            let n = conn.layout().blocks;
            conn.post_read(
                wr_id,
                RemoteAddr {
                    target: Target::Statuses,
                    offset: 0,
                },
                n,
            )
        }
    }
}
