//! The properties `rdmasink` and `rdmasrc` share (the transport, the RDMA device, the stats and
//! metrics), defined once: their defaults and their `gst-inspect-1.0` text cannot drift apart.

use gst::glib;
use gst::prelude::*;

use crate::transport::Transport;

/// `transport`'s default.
pub const DEFAULT_TRANSPORT: Transport = Transport::Auto;
/// `ib-port`'s default.
pub const DEFAULT_IB_PORT: u32 = 1;
/// `gid-index`'s default: chosen as perftest chooses.
pub const DEFAULT_GID_INDEX: i32 = -1;

/// The shared property specs, in the order both elements list them after their own address and
/// port properties: `transport`, `rdma-device`, `ib-port`, `gid-index`.
pub fn link() -> [glib::ParamSpec; 4] {
    [
        glib::ParamSpecEnum::builder_with_default("transport", DEFAULT_TRANSPORT)
            .nick("Transport")
            .blurb("Data path: auto (shm for a unix:/path address, else verbs when an RDMA device is usable, else tcp), verbs, tcp (software emulation), shm (shared memory with a peer on this host), or mem (a sink and a source of one process)")
            .mutable_ready()
            .build(),
        glib::ParamSpecString::builder("rdma-device")
            .nick("RDMA device")
            .blurb("RDMA device for transport=verbs (e.g. rxe0, mlx5_0); NULL: the first one")
            .mutable_ready()
            .build(),
        glib::ParamSpecUInt::builder("ib-port")
            .nick("IB port")
            .blurb("Port of the RDMA device for transport=verbs, from 1")
            .minimum(1)
            .maximum(255)
            .default_value(DEFAULT_IB_PORT)
            .mutable_ready()
            .build(),
        glib::ParamSpecInt::builder("gid-index")
            .nick("GID index")
            .blurb("GID table index for transport=verbs; -1: chosen like perftest (IPv4-mapped RoCE v2, not link-local)")
            .minimum(-1)
            .maximum(1023)
            .default_value(DEFAULT_GID_INDEX)
            .mutable_ready()
            .build(),
    ]
}

/// `stats-interval` and `metrics`, then the read-only `stats` whose fields `stats_fields` names.
pub fn reporting(stats_fields: &str) -> [glib::ParamSpec; 3] {
    [
        glib::ParamSpecUInt::builder("stats-interval")
            .nick("Stats interval")
            .blurb("Post the stats structure as an element message every this many ms (0 = never); drops also post QoS messages")
            .default_value(crate::report::DEFAULT_STATS_INTERVAL_MS)
            .mutable_ready()
            .build(),
        glib::ParamSpecString::builder("metrics")
            .nick("Metrics address")
            .blurb("Serve the stats as Prometheus metrics on this address:port (GET /metrics), shared by every element of the process that names it; NULL = none")
            .mutable_ready()
            .build(),
        glib::ParamSpecBoxed::builder::<gst::Structure>("stats")
            .nick("Statistics")
            .blurb(stats_fields)
            .read_only()
            .build(),
    ]
}
