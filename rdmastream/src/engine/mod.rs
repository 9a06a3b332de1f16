//! The threads around the protocol core: the sender's filling and sending threads, and the
//! receiver's polling threads.

pub mod receiver;
pub mod sender;

pub use receiver::{FrameSink, ReceiverHandle, ReceiverOptions, StreamKey};
pub use sender::{DeviceInput, DropPolicy, SenderHandle, SenderOptions, SenderReport, post_action};
