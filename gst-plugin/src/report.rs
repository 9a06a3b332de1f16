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
        due.stats = self.stats_due();
        due
    }

    /// Whether the stats message is due now (and if so, when the next one is). The streaming
    /// thread asks through [`Self::check`]; a [`Ticker`] asks while no buffer comes.
    pub fn stats_due(&mut self) -> bool {
        let now = Instant::now();
        if self.interval.is_zero() || now < self.next_stats {
            return false;
        }
        self.next_stats = now + self.interval;
        true
    }
}

/// A thread that posts `element`'s stats message when it is due and nothing else posted it
/// (a sink that gets no buffers, or waits for the link): so an application watching the bus
/// sees a stalled or idle element's counters and `connected` too. `due` answers from the
/// element's own [`Reporter`], shared with the streaming thread, so the two never post one
/// interval's message twice. Stopped and joined on drop.
pub struct Ticker {
    stop: std::sync::Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// How often a [`Ticker`] asks whether stats are due, at most.
const TICK: Duration = Duration::from_millis(100);

impl Ticker {
    /// Starts the thread for `element` (held weakly) if `interval_ms` is not 0.
    pub fn start(
        element: &gst::Element,
        interval_ms: u32,
        due: impl Fn(&gst::Element) -> bool + Send + 'static,
    ) -> Option<Ticker> {
        if interval_ms == 0 {
            return None;
        }
        let tick = TICK.min(Duration::from_millis(interval_ms as u64));
        let stop = std::sync::Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let weak = element.downgrade();
        let thread = std::thread::Builder::new()
            .name("rdma-stats".into())
            .spawn({
                let stop = stop.clone();
                move || {
                    let (lock, cv) = &*stop;
                    let mut stopped = lock.lock().unwrap();
                    loop {
                        stopped = cv.wait_timeout(stopped, tick).unwrap().0;
                        if *stopped {
                            return;
                        }
                        let Some(element) = weak.upgrade() else {
                            return;
                        };
                        drop(stopped);
                        if due(&element) {
                            post(
                                &element,
                                Due {
                                    qos: None,
                                    stats: true,
                                },
                                None,
                            );
                        }
                        stopped = lock.lock().unwrap();
                    }
                }
            })
            .ok()?;
        Some(Ticker {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        *self.stop.0.lock().unwrap() = true;
        self.stop.1.notify_all();
        if let Some(t) = self.thread.take() {
            // A ticker dropped on its own thread (it held the last element ref) cannot join it.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
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
