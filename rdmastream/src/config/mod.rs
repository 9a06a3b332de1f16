//! The config files of the `sender` and `receiver` binaries as data: one serde struct per file
//! with its defaults, and validation that names the file, the key and the reason.

mod receiver;
mod sender;

pub use receiver::{ReceiverConfig, ReceiverDeviceConfig, ReceiverPlan, SenderKeyConfig};
pub use sender::{Device, SenderConfig, SenderDeviceConfig, Source};
