//! What both elements tell the application besides buffers: a QoS message whenever frames were
//! dropped (as sinks do for late buffers: `gst-launch-1.0 -m` and `GST_DEBUG` show them), and
//! an element message carrying the `stats` structure every `stats-interval` ms.

use std::time::{Duration, Instant};

use gst::prelude::*;

/// `stats-interval` default: one stats message a second.
pub const DEFAULT_STATS_INTERVAL_MS: u32 = 1000;

/// Per running element: the drops already reported and when stats are due.
#[derive(Debug)]
pub struct Reporter {
    drops_reported: u64,
    interval: Duration,
    next_stats: Instant,
}

/// What is due now.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Due {
    /// New drops to report: (frames processed, frames dropped so far).
    pub qos: Option<(u64, u64)>,
    pub stats: bool,
}

impl Reporter {
    /// `interval_ms` 0: no stats messages.
    pub fn new(interval_ms: u32) -> Reporter {
        let interval = Duration::from_millis(interval_ms as u64);
        Reporter {
            drops_reported: 0,
            interval,
            next_stats: Instant::now() + interval,
        }
    }

    /// What to post, given the frames processed and dropped so far.
    pub fn check(&mut self, processed: u64, dropped: u64) -> Due {
        let mut due = Due::default();
        if dropped > self.drops_reported {
            self.drops_reported = dropped;
            due.qos = Some((processed, dropped));
        }
        let now = Instant::now();
        if !self.interval.is_zero() && now >= self.next_stats {
            self.next_stats = now + self.interval;
            due.stats = true;
        }
        due
    }
}

/// Posts what `due` says on `element`'s bus: a QoS message (live, with the buffer's times when
/// known) and the element's `stats` property as an element message. Call without holding the
/// element's locks (reading `stats` takes them).
pub fn post(element: &gst::Element, due: Due, timestamp: Option<gst::ClockTime>) {
    if let Some((processed, dropped)) = due.qos {
        let msg = gst::message::Qos::builder(true)
            .timestamp(timestamp)
            .stats(
                gst::format::Buffers::from_u64(processed),
                gst::format::Buffers::from_u64(dropped),
            )
            .src(element)
            .build();
        let _ = element.post_message(msg);
    }
    if due.stats {
        let stats = element.property::<gst::Structure>("stats");
        let _ = element.post_message(gst::message::Element::builder(stats).src(element).build());
    }
}
