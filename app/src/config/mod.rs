//! The config files of the `sender` and `receiver` binaries as data: one serde struct per file
//! with its defaults, and validation that names the file, the key and the reason.

mod receiver;
mod sender;

pub use receiver::{
    ReceiverConfig, ReceiverDeviceConfig, ReceiverPlan, SenderKeyConfig, TCP_REGION_BYTES,
    tcp_region_hint,
};
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

/// Checks `transport` against the address it is used with (`addr_key`: `listen` or
/// `receiver`): one of auto, tcp, verbs, shm; a `unix:/path` address is the shm transport's
/// (auto picks it), and shm takes nothing else. Returns the key at fault and why.
pub(crate) fn check_transport(
    transport: &str,
    addr: &str,
    addr_key: &'static str,
) -> Result<(), (&'static str, String)> {
    let unix = crate::cli::unix_socket(addr);
    match (transport, unix) {
        ("auto" | "shm", Some(path)) if path.as_os_str().is_empty() => Err((
            addr_key,
            format!("{addr:?} names no socket path (unix:/path/of/the/socket)"),
        )),
        ("auto" | "shm", Some(_)) => Ok(()),
        ("shm", None) => Err((
            "transport",
            format!(
                "shm (sender and receiver on one host) needs a unix:/path address, and \
                 {addr_key} is {addr:?}"
            ),
        )),
        ("tcp" | "verbs", Some(_)) => Err((
            "transport",
            format!(
                "{transport} cannot use the Unix socket address {addr:?} ({addr_key}): set \
                 transport = \"shm\" (or \"auto\"), or use a host:port address"
            ),
        )),
        ("auto" | "tcp" | "verbs", None) => check_host_port(addr).map_err(|why| (addr_key, why)),
        (other, _) => Err((
            "transport",
            format!("{other:?} is not one of auto, tcp, verbs, shm"),
        )),
    }
}

/// Checks that `addr` has the form `host:port` ([`crate::cli::split_host_port`]), so a typo is
/// a config error at start rather than a connection retried forever. Whether the name resolves
/// is left to the connection: a receiver's name may appear later (a Kubernetes service, for
/// one).
fn check_host_port(addr: &str) -> Result<(), String> {
    crate::cli::split_host_port(addr)
        .map(|_| ())
        .map_err(|why| format!("{addr:?}: {why} (host:port, or unix:/path for shm)"))
}

/// Checks the `mechanism` key (either runs over every transport); returns whether it is the
/// sliding window.
pub(crate) fn check_mechanism(
    file: &std::path::Path,
    mechanism: &str,
) -> Result<bool, crate::cli::ConfigError> {
    match mechanism {
        "status-byte" => Ok(false),
        "sliding-window" => Ok(true),
        other => Err(crate::cli::ConfigError::new(
            file,
            "mechanism",
            format!("{other:?} is not one of status-byte, sliding-window"),
        )),
    }
}

/// Checks the `metrics` key (`--metrics`): an `address:port` to serve metrics on.
pub(crate) fn check_metrics(
    file: &std::path::Path,
    metrics: Option<&str>,
) -> Result<(), crate::cli::ConfigError> {
    let Some(addr) = metrics else {
        return Ok(());
    };
    match std::net::ToSocketAddrs::to_socket_addrs(addr).map(|mut a| a.next()) {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(crate::cli::ConfigError::new(
            file,
            "metrics",
            format!("{addr:?} resolves to no address"),
        )),
        Err(e) => Err(crate::cli::ConfigError::new(
            file,
            "metrics",
            format!(
                "{addr:?} is not an address:port to serve metrics on, like 127.0.0.1:9090 or \
                 0.0.0.0:8080 ({e})"
            ),
        )),
    }
}

#[cfg(test)]
mod shipped_tests {
    use super::*;
    use std::path::Path;

    const RECEIVER: &str = include_str!("../../../configs/receiver.toml");
    const SENDER: &str = include_str!("../../../configs/sender.toml");

    /// `metrics` is an address:port; anything else is an error naming the key.
    #[test]
    fn a_metrics_address_is_checked() {
        let file = Path::new("r.toml");
        let ok = ReceiverConfig::parse("metrics = \"127.0.0.1:9090\"", file).unwrap();
        assert_eq!(ok.metrics.as_deref(), Some("127.0.0.1:9090"));
        ok.validate(file).unwrap();
        let bad = ReceiverConfig::parse("metrics = \"9090\"", file).unwrap();
        let e = bad.validate(file).unwrap_err();
        assert_eq!(e.key, "metrics", "{e}");
        let sender = "name = \"a\"\nreceiver = \"127.0.0.1:1\"\nmetrics = \"::nonsense\"\n\
                      [[device]]\nid = 0\nsource = \"radar-synthetic\"\n";
        let Err(e) = SenderConfig::parse(sender, file).unwrap().validate(file) else {
            panic!("a bad metrics address is accepted")
        };
        assert!(e.key == "metrics" && e.reason.contains("::nonsense"), "{e}");
        // The default is no HTTP server.
        assert_eq!(ReceiverConfig::parse("", file).unwrap().metrics, None);
    }

    /// `unix:/path` addresses are the shm transport's: `auto` and `shm` take them (anonymous is
    /// fine, as on loopback), `tcp`/`verbs` do not, and `shm` takes nothing else.
    #[test]
    fn unix_addresses_go_with_the_shm_transport() {
        let file = Path::new("r.toml");
        for transport in ["auto", "shm"] {
            let text = format!("listen = \"unix:/run/rx.sock\"\ntransport = \"{transport}\"");
            ReceiverConfig::parse(&text, file)
                .unwrap()
                .validate(file)
                .unwrap();
        }
        let text = "listen = \"unix:/run/rx.sock\"\ntransport = \"tcp\"";
        let e = ReceiverConfig::parse(text, file)
            .unwrap()
            .validate(file)
            .unwrap_err();
        assert!(e.key == "transport" && e.reason.contains("shm"), "{e}");
        let text = "transport = \"shm\"";
        let e = ReceiverConfig::parse(text, file)
            .unwrap()
            .validate(file)
            .unwrap_err();
        assert!(
            e.key == "transport" && e.reason.contains("unix:/path"),
            "{e}"
        );
        let sender = |receiver: &str, transport: &str| {
            let text = format!(
                "name = \"a\"\nreceiver = \"{receiver}\"\ntransport = \"{transport}\"\n\
                 [[device]]\nid = 0\nsource = \"radar-synthetic\"\n"
            );
            SenderConfig::parse(&text, file).unwrap().validate(file)
        };
        assert!(sender("unix:/run/rx.sock", "auto").is_ok());
        assert!(sender("unix:/run/rx.sock", "shm").is_ok());
        let Err(e) = sender("unix:/run/rx.sock", "verbs") else {
            panic!("verbs to a unix: address is accepted")
        };
        assert!(e.key == "transport" && e.reason.contains("receiver"), "{e}");
        let Err(e) = sender("127.0.0.1:1", "shm") else {
            panic!("shm to host:port is accepted")
        };
        assert_eq!(e.key, "transport", "{e}");
        let Err(e) = sender("127.0.0.1:1", "udp") else {
            panic!("an unknown transport is accepted")
        };
        assert!(e.reason.contains("auto, tcp, verbs, shm"), "{e}");
        // Each reason reads as one sentence (no line break's indentation inside it).
        let Err(e) = sender("unix:/run/rx.sock", "tcp") else {
            panic!("tcp to a unix: address is accepted")
        };
        assert!(!e.reason.contains("  "), "{e}");
        let Err(e) = sender("127.0.0.1:1", "shm") else {
            panic!("shm to host:port is accepted")
        };
        assert!(!e.reason.contains("  "), "{e}");
    }

    /// A receiver address with a bad port is a config error naming the key, not a connection
    /// retried forever; a name that may resolve later is left to the connection.
    #[test]
    fn a_host_port_address_is_checked() {
        let file = Path::new("s.toml");
        let sender = |receiver: &str| {
            let text = format!(
                "name = \"a\"\nreceiver = \"{receiver}\"\n\
                 [[device]]\nid = 0\nsource = \"radar-synthetic\"\n"
            );
            SenderConfig::parse(&text, file).unwrap().validate(file)
        };
        for ok in ["10.0.0.2:7471", "edge-2.local:7471", "[::1]:7471", "rx:1"] {
            assert!(sender(ok).is_ok(), "{ok} is refused");
        }
        for (bad, why) in [
            ("nohost:99999", "port"),
            ("10.0.0.2", "no port"),
            ("10.0.0.2:", "port"),
            (":7471", "no host"),
            ("::1:7471", "brackets"),
            ("rx:0", "port"),
            ("rx:http", "port"),
        ] {
            let Err(e) = sender(bad) else {
                panic!("{bad} is accepted")
            };
            assert!(e.key == "receiver" && e.reason.contains(why), "{bad}: {e}");
        }
        let listen = "listen = \"0.0.0.0:70000\"";
        let e = ReceiverConfig::parse(listen, file)
            .unwrap()
            .validate(file)
            .unwrap_err();
        assert!(e.key == "listen" && e.reason.contains("70000"), "{e}");
    }

    /// `mechanism` is one of the two, and a sliding-window receiver's ring must fit the
    /// immediate and have no reserved blocks.
    #[test]
    fn the_mechanism_is_checked() {
        let file = Path::new("s.toml");
        let sender = |extra: &str| {
            let text = format!(
                "name = \"a\"\nreceiver = \"127.0.0.1:1\"\n{extra}\n\
                 [[device]]\nid = 0\nsource = \"radar-synthetic\"\n"
            );
            SenderConfig::parse(&text, file).unwrap().validate(file)
        };
        assert!(sender("mechanism = \"sliding-window\"\ntransport = \"tcp\"").is_ok());
        assert!(sender("mechanism = \"sliding-window\"\ntransport = \"verbs\"").is_ok());
        assert!(sender("").is_ok());
        for bad in ["mechanism = \"window\"", "mechanism = \"Sliding-Window\""] {
            let Err(e) = sender(bad) else {
                panic!("{bad} accepted")
            };
            assert_eq!(e.key, "mechanism", "{e}");
        }
        let receiver = |extra: &str| {
            let text = format!("mechanism = \"sliding-window\"\ntransport = \"tcp\"\n{extra}");
            ReceiverConfig::parse(&text, file).unwrap().validate(file)
        };
        assert!(receiver("").is_ok());
        let Err(e) = receiver("reserved_blocks = [1]") else {
            panic!("reserved blocks accepted")
        };
        assert_eq!(e.key, "reserved_blocks", "{e}");
        let Err(e) = receiver("blocks = 129") else {
            panic!("a ring the immediate cannot address accepted")
        };
        assert_eq!(e.key, "blocks", "{e}");
    }

    /// `in_place_blocks`, `poll_spin_us` and `tcp_nic_spin_us` are bounded; the errors name the
    /// key. `tcp_nic_spin_us` reaches the receiver's region settings.
    #[test]
    fn in_place_blocks_and_poll_spin_are_bounded() {
        let file = Path::new("s.toml");
        let sender = |extra: &str| {
            let text = format!(
                "name = \"a\"\nreceiver = \"127.0.0.1:1\"\nsend_blocks = 4\n{extra}\n\
                 [[device]]\nid = 0\nsource = \"radar-synthetic\"\n"
            );
            SenderConfig::parse(&text, file).unwrap().validate(file)
        };
        assert!(sender("in_place_blocks = 4096").is_ok());
        assert!(sender("in_place_blocks = 0").is_ok());
        let Err(e) = sender("in_place_blocks = 4097") else {
            panic!("in_place_blocks = 4097 accepted")
        };
        assert!(
            e.key == "in_place_blocks" && e.reason.contains("0..=4096"),
            "{e}"
        );
        let receiver = |text: &str| ReceiverConfig::parse(text, file).unwrap().validate(file);
        assert!(receiver("poll_spin_us = 100000").is_ok());
        let Err(e) = receiver("poll_spin_us = 100001") else {
            panic!("a spin of more than 0.1 s accepted")
        };
        assert_eq!(e.key, "poll_spin_us", "{e}");
        let spin = |text: &str| receiver(text).map(|plan| plan.region.nic_spin);
        assert_eq!(
            spin("").unwrap(),
            std::time::Duration::from_micros(300),
            "the default"
        );
        assert_eq!(
            spin("tcp_nic_spin_us = 0").unwrap(),
            std::time::Duration::ZERO
        );
        let Err(e) = spin("tcp_nic_spin_us = 100001") else {
            panic!("a NIC spin of more than 0.1 s accepted")
        };
        assert!(
            e.key == "tcp_nic_spin_us" && e.reason.contains("0..=100000"),
            "{e}"
        );
    }

    /// The configs the compose demo and the Kubernetes manifests mount parse and validate as
    /// the binaries would take them: a key misspelt or a value out of range there fails here,
    /// not on a cluster. (What needs the deployment itself, a key file or an image directory
    /// inside the container, is checked when the binaries start.)
    #[test]
    fn the_deployment_configs_are_valid() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        // The key files are the deployment's secrets: a key of the same form stands in.
        let tmp = tempfile::tempdir().unwrap();
        let key = tmp.path().join("stand-in.key");
        std::fs::write(&key, "ab".repeat(32)).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        let stand_in = |text: &str| -> String {
            text.lines()
                .map(|l| {
                    if l.trim_start().starts_with("key_file") {
                        format!("key_file = {:?}", key.display().to_string())
                    } else {
                        l.to_string()
                    }
                })
                .collect::<Vec<_>>()
                .join("\n")
        };
        for name in [
            "deploy/compose/receiver.toml",
            "deploy/k8s/base/receiver.toml",
        ] {
            let file = root.join(name);
            let text = std::fs::read_to_string(&file).unwrap();
            let cfg =
                ReceiverConfig::parse(&stand_in(&text), &file).unwrap_or_else(|e| panic!("{e}"));
            if let Err(e) = cfg.validate(&file) {
                panic!("{e}");
            }
        }
        for name in [
            "deploy/compose/edge-1.toml",
            "deploy/compose/edge-2.toml",
            "deploy/k8s/base/sender.toml",
        ] {
            let file = root.join(name);
            let mut cfg = SenderConfig::load(&file).unwrap_or_else(|e| panic!("{e}"));
            // The Kubernetes pods give their node's name by flag (`--name`, sender.yaml).
            if name.starts_with("deploy/k8s/") {
                assert!(
                    cfg.name.is_empty(),
                    "{name}: the pod's --name would override it"
                );
                cfg.name = "node-1".into();
            }
            let devices = cfg.validate(&file).unwrap_or_else(|e| panic!("{e}"));
            assert!(!devices.is_empty(), "{name}: no devices");
        }
    }

    /// The shipped configs document the defaults: every key they set has the value the code
    /// uses when the key is left out (their device lists are examples, not defaults).
    #[test]
    fn the_shipped_configs_state_the_code_defaults() {
        let file = Path::new("configs/receiver.toml");
        let mut shipped = ReceiverConfig::parse(RECEIVER, file).unwrap();
        let mut defaults = ReceiverConfig::parse("", file).unwrap();
        shipped.device.clear();
        defaults.device.clear();
        assert_eq!(format!("{shipped:#?}"), format!("{defaults:#?}"));

        let file = Path::new("configs/sender.toml");
        let mut shipped = SenderConfig::parse(SENDER, file).unwrap();
        // `name` and `receiver` have no default: a sender must say who it is and where to go
        // (in its file or with --name and --receiver).
        let required = format!(
            "name = {:?}\nreceiver = {:?}\n",
            shipped.name, shipped.receiver
        );
        let mut defaults = SenderConfig::parse(&required, file).unwrap();
        shipped.device.clear();
        defaults.device.clear();
        assert_eq!(format!("{shipped:#?}"), format!("{defaults:#?}"));
    }
}
