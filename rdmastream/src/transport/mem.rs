//! In-process transport: a sender and a receiver in one process, joined by a [`MemFabric`]. Posting
//! a WRITE copies straight into the receiver's region, as a NIC would place it; completions are
//! immediate. Used by tests and to measure the engine without a network.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use super::{
    AcceptWake, AcceptWaker, Accepted, Completion, Connection, Connector, Listener, Refusal,
    RefusalKind, Region, RegionSettings, RemoteAddr, SendBlocks, SoftRegion, WriteSource, WriteWr,
};
use crate::error::{Error, Result};
use crate::proto::RemoteLayout;
use crate::proto::handshake::{Hello, Key};

/// The refusals the fabric keeps for a listener, and its waker, rung for each (so its accept
/// wait ends and they are counted at once, as a network listener's are).
#[derive(Clone)]
struct Refusals {
    kept: Arc<Mutex<Vec<Refusal>>>,
    waker: AcceptWaker,
}
type Endpoints = HashMap<String, (RegionSettings, Sender<Accepted>, Refusals)>;

/// Named in-process endpoints that senders can connect to.
#[derive(Clone, Default)]
pub struct MemFabric {
    listeners: Arc<Mutex<Endpoints>>,
}

impl MemFabric {
    /// A new, empty fabric.
    pub fn new() -> MemFabric {
        MemFabric::default()
    }

    /// A listener reachable as `name`, offering `settings` to each sender.
    pub fn listen(&self, name: &str, settings: RegionSettings) -> MemListener {
        let (tx, rx) = crossbeam_channel::unbounded();
        let wake = AcceptWake::new();
        let refusals = Refusals {
            kept: Arc::default(),
            waker: wake.waker(),
        };
        self.listeners
            .lock()
            .insert(name.to_string(), (settings, tx.clone(), refusals.clone()));
        MemListener {
            name: name.to_string(),
            rx,
            tx,
            refusals,
            wake,
            fabric: self.clone(),
        }
    }

    /// A connector to the listener named `name`.
    pub fn connector(&self, name: &str) -> MemConnector {
        MemConnector {
            fabric: self.clone(),
            name: name.to_string(),
        }
    }
}

/// Receiver side of the in-process transport.
pub struct MemListener {
    name: String,
    rx: Receiver<Accepted>,
    /// Connections the fabric refused on this listener's behalf (kept at most MAX_REFUSALS).
    refusals: Refusals,
    wake: AcceptWake,
    /// The sending end of `rx`, as the fabric lists it (to know the entry is this listener's).
    tx: Sender<Accepted>,
    fabric: MemFabric,
}

/// A listener that goes away takes its name off the fabric (unless a newer listener took it
/// meanwhile), and ends the connections made to it that it never accepted: a sender that
/// connected while the receiver was stopping then sees the receiver gone and connects again,
/// to the next listener of that name, instead of writing into a region nobody polls.
/// [`MemConnector::connect`] hands a connection over under the fabric's lock, so none can
/// arrive after the name is gone.
impl Drop for MemListener {
    fn drop(&mut self) {
        {
            let mut listeners = self.fabric.listeners.lock();
            if listeners
                .get(&self.name)
                .is_some_and(|(_, tx, _)| tx.same_channel(&self.tx))
            {
                listeners.remove(&self.name);
            }
        }
        for accepted in self.rx.try_iter() {
            accepted.region.disconnect();
        }
    }
}

impl Listener for MemListener {
    fn transport(&self) -> &'static str {
        "mem"
    }
    fn local_addr(&self) -> String {
        format!("mem:{}", self.name)
    }
    fn accept(&mut self, timeout: Duration) -> Result<Option<Accepted>> {
        // A refusal rings the waker; no channel of refusals to wait on.
        let none = crossbeam_channel::never::<()>();
        Ok(self.wake.wait(&self.rx, &none, timeout))
    }
    fn waker(&self) -> AcceptWaker {
        self.wake.waker()
    }
    fn refusals(&mut self) -> Vec<Refusal> {
        std::mem::take(&mut *self.refusals.kept.lock())
    }
}

/// Sender side of the in-process transport.
pub struct MemConnector {
    fabric: MemFabric,
    name: String,
}

impl Connector for MemConnector {
    fn transport(&self) -> &'static str {
        "mem"
    }
    /// Each WRITE is a copy into the region, applied in chain order.
    fn placement(&self) -> crate::proto::Placement {
        crate::proto::Placement::Ordered
    }
    fn connect_window(
        &self,
        _: &Hello,
        _: Option<&Key>,
        _: &Arc<SendBlocks>,
    ) -> Result<Box<dyn super::WindowConnection>> {
        Err(super::window_unavailable("mem"))
    }
    fn peer(&self) -> String {
        format!("mem:{}", self.name)
    }
    fn connect(
        &self,
        hello: &Hello,
        key: Option<&Key>,
        blocks: &Arc<SendBlocks>,
    ) -> Result<Box<dyn Connection>> {
        let peer = self.peer();
        let (settings, tx, refusals) = self
            .fabric
            .listeners
            .lock()
            .get(&self.name)
            .cloned()
            .ok_or_else(|| Error::Connect {
                peer: peer.clone(),
                source: std::io::ErrorKind::ConnectionRefused.into(),
            })?;
        // In one process the keys can be compared directly; the rules are the other
        // transports': a keyed receiver needs the sender's key, a keyed sender a keyed receiver.
        // Each refusal is also kept for the listener, as the network transports keep theirs.
        let refused_as = |kind: RefusalKind, reason: String| {
            let mut kept = refusals.kept.lock();
            if kept.len() >= super::MAX_REFUSALS {
                kept.remove(0);
            }
            kept.push(Refusal {
                peer: peer.clone(),
                why: reason.clone(),
                kind,
            });
            drop(kept);
            refusals.waker.wake();
            Error::Refused {
                peer: peer.clone(),
                reason,
            }
        };
        let keys = settings.access.keys();
        match (keys.is_anonymous(), key) {
            (true, None) => {}
            (true, Some(_)) => {
                return Err(Error::Auth {
                    peer,
                    reason: "the receiver does not authenticate".into(),
                });
            }
            (false, k) if k.is_some() && k == keys.key_for(&hello.sender) => {}
            (false, _) => {
                return Err(refused_as(
                    RefusalKind::Authentication,
                    format!("sender '{}': authentication failed", hello.sender),
                ));
            }
        }
        let lease = settings
            .admit(hello, &peer)
            .map_err(|(kind, why)| refused_as(kind, why))?;
        let memory = settings
            .reserve_region()
            .map_err(|(kind, why)| refused_as(kind, why))?;
        let region = SoftRegion::with_reservation(&settings, Some(memory.region));
        let dyn_region: Arc<dyn Region> = region.clone();
        lease.attach(&dyn_region);
        let accepted = Accepted {
            hello: hello.clone(),
            peer: "mem".into(),
            region: dyn_region,
            lease,
            memory: memory.reassembly,
        };
        // Handed over only while the listener is still listed (see MemListener's drop).
        let listed = {
            let listeners = self.fabric.listeners.lock();
            listeners
                .get(&self.name)
                .is_some_and(|(_, now, _)| now.same_channel(&tx))
                && tx.send(accepted).is_ok()
        };
        if !listed {
            return Err(Error::Connect {
                peer: peer.clone(),
                source: std::io::ErrorKind::ConnectionRefused.into(),
            });
        }
        Ok(Box::new(MemConnection {
            peer,
            region,
            blocks: blocks.clone(),
            done: VecDeque::new(),
        }))
    }
}

/// One in-process connection.
pub struct MemConnection {
    peer: String,
    region: Arc<SoftRegion>,
    blocks: Arc<SendBlocks>,
    done: VecDeque<Completion>,
}

impl MemConnection {
    fn access_error(&self, e: super::region::AccessError) -> Error {
        Error::Disconnected {
            peer: self.peer.clone(),
            reason: format!("remote access error: {}", e.0),
        }
    }
}

impl Drop for MemConnection {
    fn drop(&mut self) {
        self.region.close();
    }
}

impl Connection for MemConnection {
    fn cache_budget(&self) -> Option<usize> {
        None
    }
    fn send_limits(&self, _block_size: usize) -> super::SendLimits {
        super::SendLimits::default()
    }
    fn syncs_early(&self) -> bool {
        true
    }
    fn writes_lowest_first(&self) -> bool {
        false
    }
    fn completes_at_once(&self) -> bool {
        true
    }
    /// Covered by [`Connection::completes_at_once`].
    fn posts_here_when_idle(&self) -> bool {
        false
    }
    fn peer(&self) -> &str {
        &self.peer
    }
    fn layout(&self) -> RemoteLayout {
        self.region.layout()
    }
    fn post_write_chain(&mut self, wr_id: u64, chain: &[WriteWr<'_>]) -> Result<()> {
        if self.region.is_closed() {
            return Err(Error::Disconnected {
                peer: self.peer.clone(),
                reason: "the receiver went away".into(),
            });
        }
        let mut signaled = false;
        for wr in chain {
            let RemoteAddr { target, offset } = wr.remote;
            let applied = match wr.source {
                WriteSource::SendBlock { index, len } => self.blocks.read(index, len, |src| {
                    self.region.write_with(target, offset, len, |dst| {
                        dst.copy_from_slice(src);
                        Ok(())
                    })
                }),
                WriteSource::Inline(bytes) => {
                    self.region.write_with(target, offset, bytes.len(), |dst| {
                        dst.copy_from_slice(bytes);
                        Ok(())
                    })
                }
            };
            applied
                .map_err(|e| self.access_error(e))?
                .expect("in-memory copy cannot fail");
            signaled |= wr.signaled;
        }
        if signaled {
            self.done.push_back(Completion::Write { wr_id });
        }
        Ok(())
    }
    fn post_read(&mut self, wr_id: u64, remote: RemoteAddr, len: usize) -> Result<()> {
        // A sender that only syncs (waiting for a lossless message's confirmation) must see
        // the receiver go away too.
        if self.region.is_closed() {
            return Err(Error::Disconnected {
                peer: self.peer.clone(),
                reason: "the receiver went away".into(),
            });
        }
        let data = self
            .region
            .read_remote(remote.target, remote.offset, len)
            .map_err(|e| self.access_error(e))?;
        self.done.push_back(Completion::Read { wr_id, data });
        Ok(())
    }
    fn poll_completions(&mut self, out: &mut Vec<Completion>, _timeout: Duration) -> Result<()> {
        out.extend(self.done.drain(..));
        Ok(())
    }
    /// In one process the receiver cannot go silent without the region closing.
    fn heartbeat(&mut self) -> Result<()> {
        Ok(())
    }
    /// Never: the copy is what this transport measures.
    fn lend_block(&self, _remote_block: usize) -> Option<Box<dyn super::LeasedBlock>> {
        None
    }
    fn take_notices(&mut self) -> Vec<super::Notice> {
        self.region.take_notices()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::{Target, test_hello};

    fn connect(fabric: &MemFabric, name: &str) -> Result<Box<dyn Connection>> {
        fabric
            .connector(name)
            .connect(&test_hello("mem-test", 1), None, &SendBlocks::new(2, 256))
    }

    fn sync(conn: &mut dyn Connection) -> Result<()> {
        let statuses = RemoteAddr {
            target: Target::Statuses,
            offset: 0,
        };
        conn.post_read(1, statuses, 4)
    }

    /// A sender that only syncs (a lossless message waiting for its confirmation) learns that
    /// the receiver went away from the sync itself, as one that writes does from its write.
    #[test]
    fn a_sync_after_the_receiver_went_away_fails() {
        let fabric = MemFabric::new();
        let mut listener = fabric.listen("rx", RegionSettings::plain(4, 256));
        let mut conn = connect(&fabric, "rx").unwrap();
        let accepted = listener.accept(Duration::ZERO).unwrap().expect("accepted");
        sync(conn.as_mut()).unwrap();
        accepted.region.disconnect();
        let e = sync(conn.as_mut()).unwrap_err();
        assert!(e.to_string().contains("went away"), "{e}");
    }

    /// A connection a listener never accepted before it went away is ended, a connect after it
    /// is refused, and a newer listener of the same name is not unlisted by the older one.
    #[test]
    fn a_listener_that_goes_away_ends_what_it_never_accepted() {
        let fabric = MemFabric::new();
        let old = fabric.listen("rx", RegionSettings::plain(4, 256));
        let mut waiting = connect(&fabric, "rx").unwrap();
        drop(old);
        assert!(
            sync(waiting.as_mut()).is_err(),
            "the unaccepted connection ended"
        );
        assert!(connect(&fabric, "rx").is_err(), "nobody listens");
        let older = fabric.listen("rx", RegionSettings::plain(4, 256));
        let mut newer = fabric.listen("rx", RegionSettings::plain(4, 256));
        drop(older);
        let mut conn = connect(&fabric, "rx").expect("the newer listener is listed");
        let _accepted = newer.accept(Duration::ZERO).unwrap().expect("accepted");
        sync(conn.as_mut()).unwrap();
    }
}
