//! A byte budget shared by everything a receiver allocates on behalf of its peers: the regions of
//! connected senders and the buffers that reassemble multi-block frames. A reservation is taken
//! before memory is allocated and given back when that memory is freed ([`Reservation`]'s
//! drop), so the sum never exceeds the limit however many peers push at once.
//!
//! It is plain bookkeeping (an atomic counter): no allocation, no IO, usable from the IO-free
//! core and from every thread.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A limit on bytes in use, and what is in use now.
#[derive(Debug)]
pub struct Budget {
    limit: usize,
    used: AtomicUsize,
    /// For a budget carved out of a larger one: the bytes taken from it, given back when this
    /// budget (and so everything reserved from it) is gone.
    _backing: Option<Reservation>,
}

impl Budget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<Budget> {
        Arc::new(Budget {
            limit,
            used: AtomicUsize::new(0),
            _backing: None,
        })
    }

    /// A budget of the bytes `backing` took from another budget (one sender's share of the
    /// receiver's): they go back to it when the last user of this one is gone.
    pub fn carved(backing: Reservation) -> Arc<Budget> {
        Arc::new(Budget {
            limit: backing.bytes,
            used: AtomicUsize::new(0),
            _backing: Some(backing),
        })
    }

    /// Bytes that could still be reserved.
    pub fn available(&self) -> usize {
        self.limit.saturating_sub(self.used())
    }

    /// A budget that never refuses (tests, tools).
    pub fn unlimited() -> Arc<Budget> {
        Budget::new(usize::MAX)
    }

    /// The limit in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes reserved now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Reserves `bytes` if they fit, else `None` (nothing reserved).
    pub fn try_reserve(self: &Arc<Self>, bytes: usize) -> Option<Reservation> {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let new = used.checked_add(bytes).filter(|&n| n <= self.limit)?;
            match self
                .used
                .compare_exchange_weak(used, new, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    return Some(Reservation {
                        budget: self.clone(),
                        bytes,
                    });
                }
                Err(now) => used = now,
            }
        }
    }
}

/// Bytes taken from a [`Budget`]; given back when dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<Budget>,
    bytes: usize,
}

impl Reservation {
    /// An empty reservation on `budget`, to [`Self::grow`] later.
    pub fn empty(budget: &Arc<Budget>) -> Reservation {
        Reservation {
            budget: budget.clone(),
            bytes: 0,
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Splits `bytes` off into a reservation of their own (at most what this one holds).
    pub fn split_off(&mut self, bytes: usize) -> Reservation {
        let bytes = bytes.min(self.bytes);
        self.bytes -= bytes;
        Reservation {
            budget: self.budget.clone(),
            bytes,
        }
    }

    /// Takes `more` bytes as well; false (and nothing taken) if they do not fit.
    pub fn grow(&mut self, more: usize) -> bool {
        match self.budget.try_reserve(more) {
            Some(mut r) => {
                // Move the bytes over; `r` then drops empty (forgetting it would leak its
                // reference to the budget — found by fuzz/reassembly_reorder).
                self.bytes += std::mem::take(&mut r.bytes);
                true
            }
            None => false,
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Bytes that keep their reservation until the last clone of them is dropped
/// (`Bytes::from_owner`).
pub struct Reserved {
    data: Vec<u8>,
    _reservation: Reservation,
}

impl Reserved {
    /// Wraps `data`, accounted for by `reservation`.
    pub fn new(data: Vec<u8>, reservation: Reservation) -> Reserved {
        Reserved {
            data,
            _reservation: reservation,
        }
    }
}

impl AsRef<[u8]> for Reserved {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

/// Copies `bytes` into memory reserved from `budget`, or `None` when the budget has no room.
pub fn reserved_copy(budget: &Arc<Budget>, bytes: &[u8]) -> Option<bytes::Bytes> {
    let r = budget.try_reserve(bytes.len())?;
    Some(bytes::Bytes::from_owner(Reserved::new(bytes.to_vec(), r)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Growing a reservation keeps no extra reference to the budget (a forgotten temporary
    /// reservation used to leak one per grow: the budget was never freed).
    #[test]
    fn growing_leaks_no_reference_to_the_budget() {
        let b = Budget::new(100);
        let mut r = Reservation::empty(&b);
        for _ in 0..10 {
            assert!(r.grow(5));
        }
        assert_eq!(Arc::strong_count(&b), 2);
        drop(r);
        assert_eq!((Arc::strong_count(&b), b.used()), (1, 0));
    }

    #[test]
    fn reservations_never_exceed_the_limit_and_come_back_on_drop() {
        let b = Budget::new(100);
        let r1 = b.try_reserve(60).unwrap();
        assert!(b.try_reserve(41).is_none());
        let mut r2 = b.try_reserve(40).unwrap();
        assert_eq!(b.used(), 100);
        assert!(!r2.grow(1));
        drop(r1);
        assert!(r2.grow(50));
        assert_eq!(b.used(), 90);
        let copy = reserved_copy(&b, &[7; 10]).unwrap();
        assert!(reserved_copy(&b, &[7; 1]).is_none());
        let clone = copy.clone();
        drop(copy);
        assert_eq!(b.used(), 100, "a clone still holds the copy");
        drop(clone);
        drop(r2);
        assert_eq!(b.used(), 0);
        assert!(Budget::new(10).try_reserve(usize::MAX).is_none());
    }

    #[test]
    fn a_carved_budget_gives_its_bytes_back_when_its_last_user_is_gone() {
        let all = Budget::new(100);
        let mut r = all.try_reserve(70).unwrap();
        let share = Budget::carved(r.split_off(30));
        assert_eq!((r.bytes(), share.limit(), all.used()), (40, 30, 70));
        let copy = reserved_copy(&share, &[0; 30]).unwrap();
        assert!(reserved_copy(&share, &[0; 1]).is_none());
        drop(share);
        drop(r);
        assert_eq!(all.used(), 30, "the copy still holds its share");
        drop(copy);
        assert_eq!(all.used(), 0);
    }
}
