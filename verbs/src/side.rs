//! Liveness and notices on the socket beside the data path, shared by the verbs transport (a TCP
//! side channel) and the shm transport (its Unix socket): both sides send a heartbeat byte (0)
//! every heartbeat interval, the receiver also sends framed notices, and a peer silent for the
//! peer timeout, or whose socket ends, is gone. The framing is docs/protocol.md's "Notices".

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdmastream::transport::{Notice, NoticeQueue, SideChannelReader, heartbeat_interval};

/// A side socket: a TCP stream (verbs) or a Unix stream (shm).
pub(crate) trait SideSocket: Read + Write {
    fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> std::io::Result<()>;
}

impl SideSocket for TcpStream {
    fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> std::io::Result<()> {
        self.set_read_timeout(read)?;
        self.set_write_timeout(write)
    }
}

impl SideSocket for UnixStream {
    fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> std::io::Result<()> {
        self.set_read_timeout(read)?;
        self.set_write_timeout(write)
    }
}

/// The receiver's watcher of one sender's side socket: reads the sender's heartbeats and sends
/// the receiver's and its notices (within a heartbeat interval), until the socket ends, stays
/// silent for `timeout`, or `closed` is set (the receiver is done). `what` names the sender
/// in the log line.
pub(crate) fn watch<S: SideSocket>(
    mut side: S,
    timeout: Duration,
    closed: &AtomicBool,
    notices: &NoticeQueue,
    what: &str,
) {
    let interval = heartbeat_interval(timeout);
    // A sender that stops reading (stopped, not dead) must not hold this thread in a write.
    if side.set_timeouts(Some(interval), Some(timeout)).is_err() {
        return;
    }
    let (mut heard, mut sent) = (Instant::now(), Instant::now());
    let mut buf = [0u8; 64];
    while !closed.load(Ordering::Acquire) {
        match side.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => heard = Instant::now(),
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(_) => return,
        }
        if heard.elapsed() >= timeout {
            tracing::info!(
                "{what} silent for {:.1} s (peer timeout): gone",
                heard.elapsed().as_secs_f64()
            );
            return;
        }
        for n in notices.take() {
            if side.write_all(&n.side_frame()).is_err() {
                return;
            }
        }
        if sent.elapsed() >= interval {
            sent = Instant::now();
            if side.write_all(&[0]).is_err() {
                return;
            }
        }
    }
}

/// The sender's end of a side socket (set non-blocking by its owner): the receiver's
/// heartbeats and notices read, this side's heartbeat sent when due.
pub(crate) struct SenderSide {
    checked: Instant,
    /// When the receiver's last byte came, and this side's last heartbeat went out.
    heard: Instant,
    sent: Instant,
    /// Splits the receiver's bytes into heartbeats and notices.
    reader: SideChannelReader,
    /// Notices read, not yet taken.
    notices: Vec<Notice>,
    /// The socket's name in errors: "side channel", "socket".
    what: &'static str,
}

impl SenderSide {
    pub(crate) fn new(what: &'static str) -> SenderSide {
        let now = Instant::now();
        SenderSide {
            checked: now,
            heard: now,
            sent: now,
            reader: SideChannelReader::default(),
            notices: Vec::new(),
            what,
        }
    }

    /// Reads what the receiver sent (at most every 50 ms); fails, with the reason, once the
    /// socket ended, carried something that is neither a heartbeat nor a well-formed notice,
    /// or was silent for `peer_timeout`. Sends this side's heartbeat when due.
    pub(crate) fn check<S: Read + Write>(
        &mut self,
        side: &mut S,
        peer_timeout: Duration,
    ) -> std::result::Result<(), String> {
        if self.checked.elapsed() < Duration::from_millis(50) {
            return Ok(());
        }
        self.checked = Instant::now();
        let what = self.what;
        let mut bytes = [0u8; 64];
        loop {
            match side.read(&mut bytes) {
                Ok(0) => return Err(format!("the receiver closed the {what}")),
                Ok(n) => {
                    self.heard = Instant::now();
                    self.reader
                        .feed(&bytes[..n], &mut self.notices)
                        .map_err(|why| format!("protocol error: {why}"))?;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("{what}: {e}")),
            }
        }
        if self.heard.elapsed() >= peer_timeout {
            return Err(format!(
                "no heartbeat from the receiver for {:.1} s (peer timeout)",
                self.heard.elapsed().as_secs_f64()
            ));
        }
        if self.sent.elapsed() >= heartbeat_interval(peer_timeout) {
            self.sent = Instant::now();
            match side.write(&[0]) {
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(format!("{what}: {e}")),
            }
        }
        Ok(())
    }

    /// The notices read so far.
    pub(crate) fn take_notices(&mut self) -> Vec<Notice> {
        std::mem::take(&mut self.notices)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sender_side_reads_notices_fails_on_garbage_and_on_the_end() {
        let (mut ours, mut theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let mut side = SenderSide::new("socket");
        side.checked -= Duration::from_secs(1);
        let notice = Notice::new(4, "taken");
        theirs.write_all(&[0]).unwrap();
        theirs.write_all(&notice.side_frame()).unwrap();
        side.check(&mut ours, Duration::from_secs(5)).unwrap();
        assert_eq!(side.take_notices(), vec![notice]);
        assert!(side.take_notices().is_empty());
        // Checked at most every 50 ms: nothing is read in between.
        theirs.write_all(&[0xEE]).unwrap();
        side.check(&mut ours, Duration::from_secs(5)).unwrap();
        side.checked -= Duration::from_secs(1);
        let err = side.check(&mut ours, Duration::from_secs(5)).unwrap_err();
        assert!(err.starts_with("protocol error"), "{err}");
        let (mut ours, theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        drop(theirs);
        let mut side = SenderSide::new("socket");
        side.checked -= Duration::from_secs(1);
        assert_eq!(
            side.check(&mut ours, Duration::from_secs(5)).unwrap_err(),
            "the receiver closed the socket"
        );
    }

    #[test]
    fn the_sender_side_gives_up_on_a_silent_receiver_and_sends_heartbeats() {
        let (mut ours, mut theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let mut side = SenderSide::new("socket");
        side.checked -= Duration::from_secs(1);
        side.sent -= Duration::from_secs(1);
        side.check(&mut ours, Duration::from_secs(2)).unwrap();
        let mut beat = [9u8; 1];
        theirs.read_exact(&mut beat).unwrap();
        assert_eq!(beat, [0], "a heartbeat went out");
        side.checked -= Duration::from_secs(1);
        side.heard -= Duration::from_secs(3);
        let err = side.check(&mut ours, Duration::from_secs(2)).unwrap_err();
        assert!(err.contains("peer timeout"), "{err}");
    }

    #[test]
    fn the_watcher_forwards_notices_and_ends_with_the_socket() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let closed = AtomicBool::new(false);
        let notices = NoticeQueue::default();
        let notice = Notice::new(2, "device-id 2 is already taken");
        notices.push(notice.clone());
        std::thread::scope(|s| {
            let w = s.spawn(|| watch(ours, Duration::from_secs(5), &closed, &notices, "sender"));
            let mut got = vec![0u8; notice.side_frame().len()];
            // Heartbeats (0) may come first; the notice frame follows them.
            loop {
                theirs.read_exact(&mut got[..1]).unwrap();
                if got[0] != 0 {
                    break;
                }
            }
            theirs.read_exact(&mut got[1..]).unwrap();
            assert_eq!(got, notice.side_frame());
            theirs.shutdown(std::net::Shutdown::Both).unwrap();
            w.join().unwrap();
        });
    }
}
