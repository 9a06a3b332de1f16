//! `rdmasink`: streams buffers to an `rdmasrc` (or the rdmastream `receiver`) as one device of a
//! sender, over one-sided RDMA with the status-byte-assisted mechanism, its TCP emulation, or
//! shared memory on one host.
//!
//! Every buffer becomes one frame of the device: the core's filling thread copies it into send
//! blocks (or it already is one, see below) (several when it is larger than a block), the sending thread writes them into the
//! receiver's memory blocks and sets their status bytes. Caps are sent whenever they are set or
//! change; PTS (as running time) and duration travel in the block header; EOS reaches the far
//! side as end-of-stream of the device.
//!
//! ## Frames written in place
//!
//! The element answers upstream's allocation query with a buffer pool whose buffers are send
//! blocks, reserved from the `in-place-blocks` the core sender adds to `blocks` for them (default
//! half as many; 0 turns the pool off): upstream writes each frame straight into memory the
//! transport sends from, and `render` marks the buffer so its block is committed (header and seal
//! written around the payload in place) as soon as the buffer is let go, right after `render`; a
//! pooled buffer never rendered gives its block back. A pooled buffer that something else still
//! holds when it is rendered (a `tee`'s other branch, a `videorate` pushing it twice) is copied
//! instead, so a later frame never overtakes it. With `drop-policy=block` (default) acquiring a
//! buffer waits for an in-place block to come free; with `drop-oldest` it waits at most a moment,
//! 1 ms (a source faster than the link gives the sending threads their turn): with no block
//! free by then it gets an ordinary buffer, which is copied like any buffer from elsewhere. The
//! `blocks` are the filling thread's own (copied frames, caps, EOS): a
//! committed frame waiting in a queue never holds a block the filling thread needs to get to it.
//! (`drop-policy=block` alone is back-pressure; `lossless=true` registers the device with the core
//! as a lossless one, as the sender binary's `policy = "block"`: its blocks, pooled ones too, are
//! kept until the receiver confirms the frame, and what was not confirmed when a connection was
//! lost is resent on the next; the element counts such a frame in flight until then, at most 4.)
//! A frame that does not fit one block (`block-size` minus 60 bytes of header and
//! trailer) gets an ordinary buffer; any buffer not from the pool is copied: by `render` itself
//! into an in-place block when one is free (it waits up to 2 ms for one with `drop-policy=block`,
//! 1 ms with `drop-oldest` while the sink's earlier frames are still on their way; `stats`
//! counts the copies that waited, `copies-waited`), otherwise by the filling thread into one of
//! `blocks`. Over
//! `transport=shm` a pooled buffer, and the block `render` copies into, is, whenever the sending
//! thread has one on offer, a block of the receiver's memory itself: the frame is written once,
//! where `rdmasrc` reads it, and the sender posts only its status byte. The `stats` structure
//! counts `frames-in-place` (of which `frames-in-receiver-memory`) and `frames-copied` (of which
//! `frames-copied-to-receiver`), and the element logs (info) which path the frames take whenever it
//! changes. `enable-last-sample` defaults to false here: a kept last sample would hold its buffer,
//! and so its block and the frame's commit, until the next frame.
//!
//! All `rdmasink` elements of a process with the same `host`, `port`, `transport` and
//! `sender-name` share one connection (one queue pair), each with its own `device-id`.
//!
//! ## Example
//!
//! ```sh
//! gst-launch-1.0 rdmasrc port=7471 device-id=3 ! videoconvert ! autovideosink &
//! gst-launch-1.0 videotestsrc is-live=true ! \
//!     video/x-raw,format=RGB,width=640,height=480,framerate=25/1 ! \
//!     rdmasink host=127.0.0.1 port=7471 device-id=3
//! ```
//!
//! ## Connection
//!
//! With `reconnect=true` (default) a receiver that cannot be reached or goes away is retried
//! with backoff (100 ms doubling to 5 s) and a warning message is posted for each new problem;
//! meanwhile buffers wait (`drop-policy=block`) or the oldest queued ones are dropped
//! (`drop-policy=drop-oldest`). With `reconnect=false` the element connects in the
//! READY→PAUSED change and posts an error naming the receiver when that or the connection
//! later fails. With `reconnect-timeout` (ms, 0 = never) a receiver unreachable for that long is
//! an error naming it. A receiver that refuses the handshake (key) is always an error. Each
//! connection posts a `GstRdmaSinkConnected` element message (`reconnected` after a loss).
//!
//! EOS: everything queued is written before the EOS message is posted, then end-of-stream
//! follows. A sink stopped without EOS ends its device's stream as well (the receiver sees
//! end-of-stream, not a lost sender); only a lost connection leaves the receiver waiting.
//!
//! `block-size` must not exceed the receiver's: the receiver refuses a larger one, the element
//! fails saying what to set, and the receiver's side reports the refusal too (`rdmasrc` posts a
//! warning naming this sender). A smaller one leaves the rest of each receiver block unused.
//!
//! Frames dropped under `drop-policy=drop-oldest` post QoS messages; the `stats` structure is
//! posted as an element message every `stats-interval` ms (looked at after each buffer, and by a
//! small thread of the element's, `report::Ticker`, every 100 ms at most, so a sink that gets no
//! buffers or waits for its receiver posts them too), and with `metrics=127.0.0.1:9100`
//! served as Prometheus metrics at `http://127.0.0.1:9100/metrics` (one server for every
//! element of the process naming that address). The element handles
//! `rdma://HOST:PORT?device-id=N&...` URIs (every query parameter is a property), and
//! `rdma+unix:///PATH?device-id=N` for a receiver's Unix socket (the `shm` transport).

use gst::glib;
use gst::prelude::*;

mod imp;

glib::wrapper! {
    pub struct RdmaSink(ObjectSubclass<imp::RdmaSink>) @extends gst_base::BaseSink, gst::Element, gst::Object,
        @implements gst::URIHandler;
}

pub fn register(plugin: &gst::Plugin) -> Result<(), glib::BoolError> {
    gst::Element::register(
        Some(plugin),
        "rdmasink",
        gst::Rank::NONE,
        RdmaSink::static_type(),
    )
}
