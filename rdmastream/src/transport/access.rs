//! Who may connect to a receiver, and with how much: the keys senders prove they know, one
//! connection per sender name, a cap on connected senders and the memory budget their regions
//! are taken from. Every transport's listener asks [`AccessControl`] before it allocates a
//! region, so the same rules hold over tcp, verbs and in-process.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{RefusalKind, Region};
use crate::proto::Budget;
use crate::proto::handshake::{Hello, Key};

/// The keys of a receiver: one per sender name, and optionally one shared by every name.
/// Without any key the receiver is anonymous (anyone may connect under any free name).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Keys {
    per_sender: HashMap<String, Key>,
    shared: Option<Key>,
}

impl Keys {
    /// No keys: anonymous.
    pub fn anonymous() -> Keys {
        Keys::default()
    }

    /// One key for every sender name.
    pub fn shared(key: Key) -> Keys {
        Keys {
            per_sender: HashMap::new(),
            shared: Some(key),
        }
    }

    /// Adds the key of sender `name` (it takes precedence over a shared key).
    pub fn with_sender(mut self, name: impl Into<String>, key: Key) -> Keys {
        self.per_sender.insert(name.into(), key);
        self
    }

    /// True when no key is configured.
    pub fn is_anonymous(&self) -> bool {
        self.per_sender.is_empty() && self.shared.is_none()
    }

    /// The key sender `name` must prove, if any may connect under that name.
    pub fn key_for(&self, name: &str) -> Option<&Key> {
        self.per_sender.get(name).or(self.shared.as_ref())
    }

    /// Names with a key of their own.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.per_sender.keys().map(String::as_str)
    }
}

struct Holder {
    session: u64,
    peer: String,
    id: u64,
    since: Instant,
    region: Option<Weak<dyn Region>>,
}

/// Admission rules shared by a receiver's listener(s).
pub struct AccessControl {
    keys: Keys,
    max_senders: usize,
    budget: Arc<Budget>,
    names: Mutex<HashMap<String, Holder>>,
    released: Condvar,
    next_id: AtomicU64,
}

impl std::fmt::Debug for AccessControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessControl")
            .field("keys", &self.keys)
            .field("max_senders", &self.max_senders)
            .field("budget", &self.budget)
            .finish()
    }
}

/// How long a sender that reconnects in the same session waits for its previous connection to
/// be wound down before its new one is refused.
const TAKEOVER_WAIT: Duration = Duration::from_secs(3);

impl AccessControl {
    /// Rules: `keys` (empty: anonymous), at most `max_senders` connected at once, regions and
    /// reassembly taken from `budget`.
    pub fn new(keys: Keys, max_senders: usize, budget: Arc<Budget>) -> Arc<AccessControl> {
        Arc::new(AccessControl {
            keys,
            max_senders: max_senders.max(1),
            budget,
            names: Mutex::new(HashMap::new()),
            released: Condvar::new(),
            next_id: AtomicU64::new(1),
        })
    }

    /// Anonymous, 64 senders, no memory limit: for tests and tools.
    pub fn open() -> Arc<AccessControl> {
        AccessControl::new(Keys::anonymous(), 64, Budget::unlimited())
    }

    /// The keys.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// The memory budget regions and reassembly come from.
    pub fn budget(&self) -> &Arc<Budget> {
        &self.budget
    }

    /// Senders connected now.
    pub fn connected(&self) -> usize {
        self.names.lock().len()
    }

    /// Admits an authenticated sender: its name must be free (or held by an earlier connection
    /// of the same session, which is then ended: the sender reconnected before the receiver saw
    /// the old connection die), and fewer than `max_senders` may be connected. `Err` is the
    /// refusal.
    pub fn admit(
        self: &Arc<Self>,
        hello: &Hello,
        peer: &str,
    ) -> Result<Lease, (RefusalKind, String)> {
        let deadline = Instant::now() + TAKEOVER_WAIT;
        // A sliding-window sender has one connection per device: each holds its own place.
        let held = match hello.mechanism {
            crate::proto::handshake::Mechanism::SlidingWindow { device } => {
                format!("{}/d{device:03}", hello.sender)
            }
            crate::proto::handshake::Mechanism::StatusByte => hello.sender.clone(),
        };
        let mut names = self.names.lock();
        while let Some(h) = names.get(&held) {
            if h.session != hello.session {
                return Err((
                    RefusalKind::NameInUse,
                    format!(
                        "sender name '{}' is in use by another connection (from {}, for {} s)",
                        hello.sender,
                        h.peer,
                        h.since.elapsed().as_secs()
                    ),
                ));
            }
            // The same sender process again: its old connection is dead or dying. End it and
            // wait for its region to be wound down.
            if let Some(region) = h.region.as_ref().and_then(Weak::upgrade) {
                tracing::info!(sender = %hello.sender, %peer, old = %h.peer, "sender reconnected in the same session; ending its previous connection");
                region.disconnect();
            }
            if self.released.wait_until(&mut names, deadline).timed_out()
                && names.contains_key(&held)
            {
                return Err((
                    RefusalKind::NameInUse,
                    format!(
                        "sender '{}': its previous connection is still being wound down; try again",
                        hello.sender
                    ),
                ));
            }
        }
        if names.len() >= self.max_senders {
            return Err((
                RefusalKind::SenderLimit,
                format!(
                    "this receiver already has its limit of {} senders connected",
                    self.max_senders
                ),
            ));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        names.insert(
            held.clone(),
            Holder {
                session: hello.session,
                peer: peer.to_string(),
                id,
                since: Instant::now(),
                region: None,
            },
        );
        Ok(Lease {
            access: self.clone(),
            name: held,
            id,
        })
    }
}

/// A sender's hold on its name (and its place among `max_senders`), for as long as its
/// connection lasts. Dropping it frees the name.
pub struct Lease {
    access: Arc<AccessControl>,
    name: String,
    id: u64,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lease({})", self.name)
    }
}

impl Lease {
    /// Remembers the connection's region, so a reconnect of the same session can end it.
    pub fn attach(&self, region: &Arc<dyn Region>) {
        if let Some(h) = self.access.names.lock().get_mut(&self.name)
            && h.id == self.id
        {
            h.region = Some(Arc::downgrade(region));
        }
    }
}

/// The lease ends the connection it was attached to: a connection is over once its lease is
/// gone. Normally the receiver's polling thread has disconnected the region already; but an
/// accepted connection that no polling thread ever took (the listener dropped with it still
/// queued, or its handshake finished after the receiver stopped accepting) would otherwise keep
/// its NIC thread answering the sender's heartbeats and syncs from a region nobody polls, and
/// the sender would wait on it forever instead of reconnecting.
impl Drop for Lease {
    fn drop(&mut self) {
        let mut names = self.access.names.lock();
        let region = match names.get(&self.name) {
            Some(h) if h.id == self.id => names
                .remove(&self.name)
                .and_then(|h| h.region)
                .and_then(|r| r.upgrade()),
            _ => None,
        };
        drop(names);
        if let Some(region) = region {
            region.disconnect();
        }
        self.access.released.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::transport::test_hello as hello;

    #[test]
    fn one_name_one_owner_and_a_cap_on_senders() {
        let a = AccessControl::new(Keys::anonymous(), 2, Budget::unlimited());
        let l1 = a.admit(&hello("edge-1", 1), "p1").unwrap();
        let (kind, err) = a.admit(&hello("edge-1", 2), "p2").unwrap_err();
        assert_eq!(kind, RefusalKind::NameInUse, "{err}");
        let _l2 = a.admit(&hello("edge-2", 3), "p3").unwrap();
        let (kind, err) = a.admit(&hello("edge-3", 4), "p4").unwrap_err();
        assert_eq!(kind, RefusalKind::SenderLimit, "{err}");
        drop(l1);
        assert_eq!(a.connected(), 1);
        let _l3 = a.admit(&hello("edge-1", 2), "p2").unwrap();
    }

    #[test]
    fn a_reconnect_in_the_same_session_ends_the_old_connection() {
        let a = AccessControl::new(Keys::anonymous(), 4, Budget::unlimited());
        let old = a.admit(&hello("edge-1", 7), "p1").unwrap();
        let region: Arc<dyn Region> =
            crate::transport::SoftRegion::new(&crate::transport::RegionSettings::plain(2, 128));
        old.attach(&region);
        // Whoever winds the old connection down drops its lease once the region is closed.
        let watcher = std::thread::spawn(move || {
            while !region.is_closed() {
                std::thread::sleep(Duration::from_millis(1));
            }
            drop(old);
        });
        let new = a.admit(&hello("edge-1", 7), "p2").unwrap();
        watcher.join().unwrap();
        assert_eq!(a.connected(), 1);
        drop(new);
        assert_eq!(a.connected(), 0);
    }
}
