//! `rdma://` URIs for both elements (the `GstURIHandler` interface), so `playbin`,
//! `uridecodebin`, `urisourcebin` and `gst_element_make_from_uri` find them:
//!
//! ```text
//! rdma://HOST:PORT?device-id=N&transport=tcp&...
//! ```
//!
//! `HOST:PORT` is the receiver's address for `rdmasink` (`host`, `port`) and the address to listen
//! on for `rdmasrc` (`address`, `port`); IPv6 literals are bracketed. Every query parameter is a
//! property of the element, set from its string form as `gst-launch-1.0` would; an unknown one
//! is an error naming it.
//!
//! The shared-memory transport's Unix socket has a scheme of its own (the path is absolute, so
//! three slashes):
//!
//! ```text
//! rdma+unix:///run/rdmastream/rx.sock?device-id=N
//! ```
//!
//! It sets `host`/`address` to `unix:/run/rdmastream/rx.sock` and `transport` to `shm` (unless
//! the query says otherwise).

use gst::glib;
use gst::prelude::*;

use crate::transport::{Transport, join_host_port};

/// The scheme both elements handle.
pub const SCHEME: &str = "rdma";
/// The scheme for a receiver's Unix socket (the `shm` transport).
pub const UNIX_SCHEME: &str = "rdma+unix";
/// Both, as the elements' URI handlers list them.
pub const SCHEMES: &[&str] = &[SCHEME, UNIX_SCHEME];

/// A parsed `rdma://` URI.
#[derive(Debug, PartialEq, Eq)]
pub struct RdmaUri {
    /// `HOST`, or `unix:/path` for `rdma+unix://`.
    pub host: String,
    /// None for a Unix socket.
    pub port: Option<u16>,
    /// Query parameters in order: property name, value.
    pub props: Vec<(String, String)>,
}

fn bad(uri: &str, why: impl std::fmt::Display) -> glib::Error {
    glib::Error::new(gst::URIError::BadUri, &format!("{uri}: {why}"))
}

/// Parses `rdma://HOST:PORT[?key=value&...]` or `rdma+unix:///PATH[?key=value&...]`.
pub fn parse(uri: &str) -> Result<RdmaUri, glib::Error> {
    if let Some(rest) = uri.strip_prefix("rdma+unix://") {
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        if !path.starts_with('/') || path.len() < 2 {
            return Err(bad(
                uri,
                "the socket path must be absolute: rdma+unix:///path/to/socket",
            ));
        }
        return Ok(RdmaUri {
            host: format!("unix:{path}"),
            port: None,
            props: query_pairs(uri, query)?,
        });
    }
    let rest = uri
        .strip_prefix("rdma://")
        .ok_or_else(|| bad(uri, "not an rdma:// or rdma+unix:// URI"))?;
    let (authority, query) = rest.split_once('?').unwrap_or((rest, ""));
    let authority = authority.trim_end_matches('/');
    let (host, port) =
        rdmastream_app::cli::split_host_port(authority).map_err(|why| bad(uri, why))?;
    Ok(RdmaUri {
        host: host.to_string(),
        port: Some(port),
        props: query_pairs(uri, query)?,
    })
}

fn query_pairs(uri: &str, query: &str) -> Result<Vec<(String, String)>, glib::Error> {
    let mut props = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair
            .split_once('=')
            .ok_or_else(|| bad(uri, format!("{pair:?} is not key=value")))?;
        props.push((key.to_string(), value.to_string()));
    }
    Ok(props)
}

/// The URI of an element aimed at (or listening on) `host:port` for `device_id` over
/// `transport`: what both elements' `uri()` give.
pub fn format(host: &str, port: u32, device_id: u32, transport: Transport) -> String {
    if let Some(path) = host.strip_prefix(rdmastream::transport::UNIX_SCHEME) {
        return format!(
            "rdma+unix://{path}?device-id={device_id}&transport={}",
            transport.nick()
        );
    }
    format!(
        "rdma://{}?device-id={device_id}&transport={}",
        join_host_port(host, port),
        transport.nick()
    )
}

/// Sets `element`'s properties from `uri`: `host_property` (`host` or `address`), `port`, and
/// each query parameter. Fails, naming the parameter, for an unknown or unparsable one, and
/// once the element is past READY (as other URI handlers do).
pub fn apply(element: &gst::Element, host_property: &str, uri: &str) -> Result<(), glib::Error> {
    if element.current_state() > gst::State::Ready {
        return Err(glib::Error::new(
            gst::URIError::BadState,
            "the URI can only be changed in the NULL or READY state",
        ));
    }
    let parsed = parse(uri)?;
    for (key, _) in &parsed.props {
        if element.find_property(key).is_none() || key == host_property || key == "port" {
            return Err(bad(
                uri,
                format!("{key:?} is not a property that can be set in the query"),
            ));
        }
    }
    element.set_property(host_property, &parsed.host);
    match parsed.port {
        Some(port) => element.set_property("port", port as u32),
        // A Unix socket is the shm transport's; the query may still say otherwise.
        None => element.set_property_from_str("transport", "shm"),
    }
    for (key, value) in &parsed.props {
        let pspec = element.find_property(key).expect("checked above");
        let value = glib::Value::deserialize(value, pspec.value_type())
            .map_err(|_| bad(uri, format!("{key}={value:?} is not a valid value")))?;
        element.set_property_from_value(key, &value);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_parse_with_ipv6_and_queries_and_fail_naming_the_problem() {
        let u = parse("rdma://10.0.0.2:7471?device-id=3&transport=tcp").unwrap();
        assert_eq!(u.host, "10.0.0.2");
        assert_eq!(u.port, Some(7471));
        assert_eq!(
            u.props,
            vec![
                ("device-id".to_string(), "3".to_string()),
                ("transport".to_string(), "tcp".to_string())
            ]
        );
        let v6 = parse("rdma://[::1]:9/").unwrap();
        assert_eq!((v6.host.as_str(), v6.port), ("::1", Some(9)));
        let unix = parse("rdma+unix:///run/rx.sock?device-id=4").unwrap();
        assert_eq!((unix.host.as_str(), unix.port), ("unix:/run/rx.sock", None));
        assert_eq!(
            format("unix:/run/rx.sock", 0, 4, Transport::Shm),
            "rdma+unix:///run/rx.sock?device-id=4&transport=shm"
        );
        assert_eq!(
            format("::1", 9, 2, Transport::Tcp),
            "rdma://[::1]:9?device-id=2&transport=tcp"
        );
        for (bad, why) in [
            ("http://x:1", "not an rdma"),
            ("rdma://x", "no port"),
            ("rdma://x:0", "not a number in 1-65535"),
            ("rdma://x:70000", "not a number in 1-65535"),
            ("rdma://:5", "no host"),
            ("rdma://::1:5", "brackets"),
            ("rdma://[::1:5", "closing ]"),
            ("rdma://[::1]5", "no port after"),
            ("rdma://user@x:5", "not a name or an address"),
            ("rdma://x:5?device-id", "not key=value"),
            ("rdma+unix://relative.sock", "must be absolute"),
            ("rdma+unix:///s?x", "not key=value"),
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(bad), "{bad}: {e}");
        }
    }
}
