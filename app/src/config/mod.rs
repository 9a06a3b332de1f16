//! The config files of the `sender` and `receiver` binaries as data: one serde struct per file
//! with its defaults, and validation that names the file, the key and the reason.

mod receiver;
mod sender;

pub use receiver::{ReceiverConfig, ReceiverDeviceConfig, ReceiverPlan, SenderKeyConfig};
pub use sender::{Device, SenderConfig, SenderDeviceConfig, Source};

/// Checks a duration in seconds against its allowed range; the error text says the range.
pub(crate) fn seconds_within(
    value: f64,
    range: std::ops::RangeInclusive<f64>,
) -> Result<(), String> {
    if value.is_finite() && range.contains(&value) {
        Ok(())
    } else {
        Err(format!(
            "{value} is not in {}..={} seconds",
            range.start(),
            range.end()
        ))
    }
}
