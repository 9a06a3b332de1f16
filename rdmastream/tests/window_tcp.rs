//! The sliding-window baseline over the tcp emulation, driven by its protocol machines with no
//! engine around them: WRITE WITH IMMEDIATE placed and reported to the receiver, ACKs SENT back
//! into the sender's posted receives, the work requests each side counted, a kept block
//! stalling the window, a mismatch of mechanisms refused, a write out of ring order failing the
//! connection. Waits are on conditions with generous deadlines; nothing sleeps to let things
//! settle.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmastream::Error;
use rdmastream::proto::handshake::{DataPath, Hello, Mechanism, PROTOCOL_VERSION, QpInfo};
use rdmastream::proto::window::{Immediate, WindowAction, WindowSender};
use rdmastream::proto::{BlockScanner, Delivery, status};
use rdmastream::transport::tcp::{TcpConnector, listen};
use rdmastream::transport::{
    Accepted, Connector, Lease, Listener, Region, RegionSettings, RetainedBlock, SendBlocks,
    WindowConnection,
};

const RING: usize = 4;
const BLOCK: usize = 256;
const DEADLINE: Duration = Duration::from_secs(20);

fn hello(mechanism: Mechanism) -> Hello {
    Hello {
        version: PROTOCOL_VERSION,
        sender: "window-test".into(),
        session: 7,
        block_size: BLOCK as u32,
        data_path: DataPath::Tcp,
        qp: QpInfo::default(),
        nonce: [0; 32],
        mechanism,
    }
}

fn settings(mechanism: Mechanism) -> RegionSettings {
    RegionSettings {
        mechanism,
        ..RegionSettings::plain(RING, BLOCK)
    }
}

const WINDOW: Mechanism = Mechanism::SlidingWindow { device: 3 };

/// A connected pair: the sender's connection and send blocks, the receiver's region (and its
/// listener, kept open, and the connection's lease: dropping it ends the connection).
type Connected = (
    Box<dyn WindowConnection>,
    Arc<SendBlocks>,
    Arc<dyn Region>,
    (Box<dyn Listener>, Lease),
);

fn connect() -> Connected {
    let mut listener = listen("127.0.0.1:0", settings(WINDOW)).expect("listen");
    let connector = TcpConnector::new(listener.local_addr());
    let blocks = SendBlocks::new(RING * 2, BLOCK);
    let conn = connector
        .connect_window(&hello(WINDOW), None, &blocks)
        .expect("connect");
    let accepted: Accepted = listener
        .accept_sender(DEADLINE)
        .expect("accept")
        .expect("the sender was accepted");
    assert_eq!(accepted.hello.mechanism, WINDOW);
    (
        conn,
        blocks,
        accepted.region,
        (Box::new(listener), accepted.lease),
    )
}

/// Block `k`'s content: its number in the first 8 bytes, then a pattern.
fn content(k: u64, len: usize) -> Vec<u8> {
    let mut b: Vec<u8> = (0..len).map(|i| (i as u64 * 7 + k) as u8).collect();
    b[..8].copy_from_slice(&k.to_le_bytes());
    b
}

/// Runs `turn` until it returns true, failing after the deadline.
fn until(what: &str, mut turn: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !turn() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
    }
}

/// The sending side of the test: the machine, its connection, and its send blocks.
struct Sending {
    machine: WindowSender,
    conn: Box<dyn WindowConnection>,
    acks: Box<dyn rdmastream::transport::AckQueue>,
    blocks: Arc<SendBlocks>,
    free: Vec<usize>,
    next: u64,
}

impl Sending {
    fn new(mut conn: Box<dyn WindowConnection>, blocks: Arc<SendBlocks>) -> Sending {
        let mut machine = WindowSender::new(2);
        machine.handle_connected(conn.layout());
        let acks = conn.take_ack_queue().expect("an ACK queue");
        let free = (0..blocks.count()).collect();
        Sending {
            machine,
            conn,
            acks,
            blocks,
            free,
            next: 0,
        }
    }

    /// Fills up to `total` blocks, posts what the window allows, takes completions and ACKs.
    fn turn(&mut self, total: u64) {
        while self.next < total {
            let Some(b) = self.free.pop() else { break };
            let len = 8 + (self.next as usize * 13) % (BLOCK - 8);
            let data = content(self.next, len);
            self.blocks.fill(b, |dst| dst[..len].copy_from_slice(&data));
            self.machine.handle_filled(b, len, Delivery::Unconfirmed);
            self.next += 1;
        }
        let now = Instant::now();
        while let Some(WindowAction::WriteImm {
            wr_id,
            send_block,
            imm,
        }) = self.machine.poll_action(now)
        {
            self.conn.post_write_imm(wr_id, send_block, imm).unwrap();
        }
        let mut done = Vec::new();
        self.conn
            .poll_completions(&mut done, Duration::from_millis(1))
            .unwrap();
        for id in done {
            assert!(self.machine.handle_write_completed(id));
        }
        // What the ACK receiving thread does: take the ACK, post its receive again.
        while let Some(ack) = self.acks.recv(Duration::ZERO).unwrap() {
            self.acks.post_recv(1).unwrap();
            self.machine.handle_ack(now, ack).unwrap();
        }
        self.free
            .extend(std::iter::from_fn(|| self.machine.poll_freed()));
    }
}

/// The receiver's polling: the next FULL block, taken (retained), checked against `want`.
fn take(region: &Arc<dyn Region>, scanner: &mut BlockScanner, want: u64) -> Option<RetainedBlock> {
    let j = scanner.next_full(RING, |j| region.status(j))?;
    let held = region.clone().retain(j);
    let k = u64::from_le_bytes(held[..8].try_into().unwrap());
    assert_eq!(k, want, "blocks arrive in order");
    let len = 8 + (k as usize * 13) % (BLOCK - 8);
    assert_eq!(&held[..len], &content(k, len)[..], "block {k} bit-exact");
    Some(held)
}

#[test]
fn blocks_arrive_in_order_and_every_work_request_is_counted() {
    let (conn, blocks, region, _listener) = connect();
    let mut s = Sending::new(conn, blocks);
    let mut scanner = BlockScanner::default();
    const TOTAL: u64 = 300;
    let mut got = 0;
    until("every block", || {
        s.turn(TOTAL);
        while let Some(held) = take(&region, &mut scanner, got) {
            drop(held); // processed: the ACK goes out
            got += 1;
        }
        got == TOTAL
    });
    until("the last ACKs", || {
        s.turn(TOTAL);
        s.machine.is_idle()
    });
    let tx = s.conn.work_counts();
    let rx = region
        .work_counts()
        .expect("a window region counts its work");
    assert_eq!(tx.send_wrs, TOTAL, "one WRITE WITH IMMEDIATE per block");
    assert_eq!(
        tx.recv_wrs,
        RING as u64 + TOTAL,
        "a ring of ACK receives, reposted"
    );
    assert_eq!(tx.max_recv_queue, RING as u64);
    assert!((1..=2).contains(&tx.max_send_queue), "{tx:?}");
    assert_eq!(
        tx.completions,
        2 * TOTAL,
        "a send and an ACK completion per block"
    );
    assert_eq!(tx.cqs, 2);
    assert_eq!(rx.send_wrs, TOTAL, "one ACK SEND per block");
    assert_eq!(rx.recv_wrs, RING as u64 + TOTAL);
    assert_eq!(rx.max_recv_queue, RING as u64);
    assert_eq!(
        rx.completions,
        2 * TOTAL,
        "a receive and a SEND completion per block"
    );
    assert_eq!(s.machine.stats().released, TOTAL);
}

/// The paper's Figure 1d over the wire: the receiver keeps block 1; the sender fills the ring
/// and can write nothing more until the block is let go.
#[test]
fn a_kept_block_stalls_the_window_until_released() {
    let (conn, blocks, region, _listener) = connect();
    let mut s = Sending::new(conn, blocks);
    let mut scanner = BlockScanner::default();
    let mut kept = None;
    let mut got = 0;
    // Every block after the kept one is processed and acknowledged at once.
    until("the window to fill behind the kept block", || {
        s.turn(100);
        while let Some(held) = take(&region, &mut scanner, got) {
            if got == 1 {
                kept = Some(held);
            }
            got += 1;
        }
        s.machine.in_window() == RING && s.machine.outstanding() == 0 && got == RING as u64 + 1
    });
    assert_eq!(s.machine.head(), 1, "the head waits at the kept block");
    assert_eq!(region.status(1), status::RETAINED);
    // Nothing more goes out, however long we turn: the window is full.
    for _ in 0..50 {
        s.turn(100);
    }
    assert_eq!(got, RING as u64 + 1);
    assert_eq!(s.machine.stats().writes, RING as u64 + 1);
    drop(kept);
    until("the rest", || {
        s.turn(100);
        while let Some(held) = take(&region, &mut scanner, got) {
            drop(held);
            got += 1;
        }
        got == 100
    });
}

#[test]
fn a_mechanism_mismatch_is_refused_naming_both() {
    for (receiver, sender) in [
        (Mechanism::StatusByte, WINDOW),
        (WINDOW, Mechanism::StatusByte),
    ] {
        let listener = listen("127.0.0.1:0", settings(receiver)).expect("listen");
        let connector = TcpConnector::new(listener.local_addr());
        let blocks = SendBlocks::new(2, BLOCK);
        let err = match sender {
            Mechanism::StatusByte => connector
                .connect(&hello(sender), None, &blocks)
                .err()
                .expect("refused"),
            _ => connector
                .connect_window(&hello(sender), None, &blocks)
                .err()
                .expect("refused"),
        };
        let text = err.to_string();
        assert!(matches!(err, Error::Refused { .. }), "{text}");
        assert!(
            text.contains("status-byte") && text.contains("sliding-window"),
            "{text}"
        );
    }
}

#[test]
fn a_write_out_of_ring_order_fails_the_connection() {
    let (mut conn, blocks, region, _listener) = connect();
    blocks.fill(0, |b| b[..16].fill(9));
    // Block 1 while the receiver expects block 0: a sender that broke its window.
    conn.post_write_imm(
        1,
        0,
        Immediate {
            position: 1,
            len: 16,
        },
    )
    .unwrap();
    let mut done = Vec::new();
    let mut failed = None;
    until("the connection to fail", || {
        match conn.poll_completions(&mut done, Duration::from_millis(10)) {
            Ok(()) => false,
            Err(e) => {
                failed = Some(e.to_string());
                true
            }
        }
    });
    let why = failed.unwrap();
    assert!(why.contains("out of ring order"), "{why}");
    assert!(done.is_empty());
    until("the region to close", || region.is_closed());
    assert_eq!(region.status(1), status::EMPTY, "nothing was placed");
}
