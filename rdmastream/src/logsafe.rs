//! Logging what peers send without letting them write the log: peer-controlled text (format
//! descriptors, refusal reasons, names in errors) is cut to a length and its control characters
//! are shown escaped, never printed; repeated warnings of one kind are rate-limited, with a
//! count of what was suppressed.

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Longest peer-controlled text put into one log line or error message.
pub const MAX_PEER_TEXT: usize = 200;

/// `text` with control characters (newlines, escapes, ...) and other non-printing characters
/// escaped, cut to `max` characters (with `…(N bytes)` saying how long it was).
pub fn clean(text: &str, max: usize) -> String {
    clean_counted(text, max, text.len())
}

/// [`clean`] for bytes that may not be UTF-8.
pub fn clean_bytes(bytes: &[u8], max: usize) -> String {
    // Only the start can be shown: decode no more than that (a character is at most 4 bytes).
    let head = &bytes[..bytes.len().min(4 * max + 4)];
    clean_counted(&String::from_utf8_lossy(head), max, bytes.len())
}

fn clean_counted(text: &str, max: usize, total: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max) + 16);
    for (shown, c) in text.chars().enumerate() {
        if shown >= max {
            out.push_str(&format!("…({total} bytes)"));
            return out;
        }
        if c.is_control() || matches!(c, '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{202e}') {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Kinds of rate-limited messages remembered at most (beyond that, the oldest is forgotten).
const MAX_KINDS: usize = 4096;

struct Window {
    last: Instant,
    suppressed: u64,
}

/// Allows one message per `interval` for each kind.
pub struct RateLimit {
    interval: Duration,
    kinds: Mutex<HashMap<String, Window>>,
}

impl RateLimit {
    /// One message per kind per `interval`.
    pub fn new(interval: Duration) -> RateLimit {
        RateLimit {
            interval,
            kinds: Mutex::new(HashMap::new()),
        }
    }

    /// `Some(n)` when a message of `kind` may be logged now (`n` were suppressed since the last
    /// one), `None` when it must be suppressed.
    pub fn allow(&self, kind: &str) -> Option<u64> {
        self.allow_at(kind, Instant::now())
    }

    fn allow_at(&self, kind: &str, now: Instant) -> Option<u64> {
        let mut kinds = self.kinds.lock();
        if let Some(w) = kinds.get_mut(kind) {
            if now.saturating_duration_since(w.last) < self.interval {
                w.suppressed += 1;
                return None;
            }
            let n = std::mem::take(&mut w.suppressed);
            w.last = now;
            return Some(n);
        }
        if kinds.len() >= MAX_KINDS {
            let oldest = kinds
                .iter()
                .min_by_key(|(_, w)| w.last)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                kinds.remove(&k);
            }
        }
        kinds.insert(
            kind.to_string(),
            Window {
                last: now,
                suppressed: 0,
            },
        );
        Some(0)
    }
}

/// The process-wide limiter of warnings caused by peers: one line per kind per second.
pub fn limiter() -> &'static RateLimit {
    static LIMIT: LazyLock<RateLimit> = LazyLock::new(|| RateLimit::new(Duration::from_secs(1)));
    &LIMIT
}

/// ` (N more since the last one)` for a count of suppressed messages, or nothing.
pub fn suppressed(n: u64) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(" ({n} more like it suppressed)")
    }
}

/// Logs a warning at most once per second per `kind` (a static category plus whatever
/// distinguishes the source, e.g. the sender name), saying how many were suppressed.
#[macro_export]
macro_rules! warn_limited {
    ($kind:expr, $($arg:tt)+) => {
        if let Some(n) = $crate::logsafe::limiter().allow(&$kind) {
            tracing::warn!("{}{}", format_args!($($arg)+), $crate::logsafe::suppressed(n));
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_text_is_cut() {
        let forged = "caps\n2026-11-22T00:00:00Z  INFO receiver: all good\x1b[2J";
        let c = clean(forged, 200);
        assert!(!c.contains('\n') && !c.contains('\x1b'), "{c}");
        assert!(c.contains("\\n") && c.contains("\\u{1b}"), "{c}");
        let long = "x".repeat(10_000);
        let c = clean(&long, 50);
        assert!(c.len() < 80 && c.ends_with("…(10000 bytes)"), "{c}");
        let b = clean_bytes(&[0xff, b'a', b'\r', 0], 10);
        assert!(!b.contains('\r') && !b.contains('\0'), "{b}");
        assert_eq!(
            clean_bytes(&[b'x'; 100], 10),
            format!("{}…(100 bytes)", "x".repeat(10))
        );
    }

    #[test]
    fn one_message_per_kind_per_interval_with_a_count_of_the_rest() {
        let r = RateLimit::new(Duration::from_secs(1));
        let t = Instant::now();
        assert_eq!(r.allow_at("a", t), Some(0));
        assert_eq!(r.allow_at("a", t + Duration::from_millis(10)), None);
        assert_eq!(r.allow_at("a", t + Duration::from_millis(20)), None);
        assert_eq!(r.allow_at("b", t + Duration::from_millis(20)), Some(0));
        assert_eq!(r.allow_at("a", t + Duration::from_secs(2)), Some(2));
    }
}
