//! The small HTTP server behind `--metrics ADDR` (config key `metrics`): Prometheus metrics,
//! health and readiness probes for both binaries, and on the receiver the live status page.
//!
//! | path | what |
//! | --- | --- |
//! | `GET /metrics` | [`crate::metrics::render`] (OpenMetrics text) |
//! | `GET /healthz` | 200 while the run loop runs and ticks, else 503 |
//! | `GET /readyz` | 200 once ready (sender: connected to the receiver; receiver: listening), else 503 |
//! | `GET /api/status` | the devices' rates, counts and latency as JSON (what the page shows) |
//! | `GET /` | receiver: the status page (`status_page.html`: inline CSS and JS, no external assets) |
//! | `GET /thumb/<sender>/<device>.png` | receiver: the device's newest thumbnail ([`crate::thumbs`]) |
//!
//! [`HttpServer::start_metrics`] serves only `/metrics` (and 200 probes) from a function: the
//! GStreamer elements' `metrics` property uses it.
//!
//! Every connection gets its own thread (at most [`MAX_CONNECTIONS`] at once; beyond that a
//! connection is answered 503 and closed), reads one request of at most [`MAX_REQUEST`] bytes
//! within [`IO_TIMEOUT`], and is closed after the answer (`Connection: close`). A client that
//! holds a connection open therefore ties up one thread and nothing else. Every answer is
//! computed from the [`Monitor`] and the thumbnail store, never from the engine, so a slow
//! client cannot slow frames down. Stopped (and joined) when the [`HttpServer`] is dropped.
//!
//! It was `tiny_http` until 2026-11: its thread pool can leave a new connection queued behind
//! kept-alive ones (a wake-up lost between two connections arriving together), so a browser's
//! request could sit unread for minutes (seen as headless Chromium hanging on the status page).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use rdmastream::engine::StreamKey;

use crate::Error;
use crate::monitor::{Monitor, Role};
use crate::thumbs::Thumbnails;

/// The status page.
const PAGE: &str = include_str!("status_page.html");

/// Connections served at once at most.
pub const MAX_CONNECTIONS: usize = 32;
/// The largest request (request line and headers) read; longer ones are answered 431.
pub const MAX_REQUEST: usize = 8192;
/// How long a client may take to send its request, and to take the answer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// A running HTTP server; stops when dropped.
pub struct HttpServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HttpServer {
    /// Binds `addr` and starts answering. `thumbs` (receiver) adds the status page and the
    /// thumbnails. Binding fails with [`Error::Io`] naming the address.
    pub fn start(
        addr: &str,
        monitor: Arc<Monitor>,
        thumbs: Option<Arc<Thumbnails>>,
    ) -> Result<HttpServer, Error> {
        Self::serve(addr, Site::Binary { monitor, thumbs })
    }

    /// Binds `addr` and answers `/metrics` with what `render` returns (OpenMetrics text),
    /// `/healthz` and `/readyz` with 200: for metrics that are not a binary's (the GStreamer
    /// elements').
    pub fn start_metrics(addr: &str, render: MetricsFn) -> Result<HttpServer, Error> {
        Self::serve(addr, Site::Metrics(render))
    }

    fn serve(addr: &str, site: Site) -> Result<HttpServer, Error> {
        let io = |source| Error::Io {
            what: format!("serving metrics on {addr} (--metrics / `metrics`)"),
            source,
        };
        let listener = TcpListener::bind(addr).map_err(io)?;
        let local = listener.local_addr().map_err(io)?;
        let stop = Arc::new(AtomicBool::new(false));
        let site = Arc::new(site);
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("http".into())
                .spawn(move || accept_loop(listener, &stop, &site))
                .map_err(|source| Error::Io {
                    what: "starting the metrics server thread".into(),
                    source,
                })?
        };
        tracing::info!("metrics on http://{local}/metrics");
        Ok(HttpServer {
            addr: local,
            stop,
            thread: Some(thread),
        })
    }

    /// The address it listens on (the port chosen when `addr` said 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop with a connection of our own (to loopback when it listens on
        // every address).
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let woken = TcpStream::connect_timeout(&wake, Duration::from_secs(1)).is_ok();
        if let Some(t) = self.thread.take()
            && woken
        {
            let _ = t.join();
        }
    }
}

/// Accepts connections until `stop`, one thread each.
fn accept_loop(listener: TcpListener, stop: &AtomicBool, site: &Arc<Site>) {
    let open = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let mut conn = match conn {
            Ok(c) => c,
            Err(e) => {
                rdmastream::warn_limited!("http", "metrics server: accepting: {e}");
                // Out of file descriptors and the like: do not spin.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let _ = conn.set_read_timeout(Some(IO_TIMEOUT));
        let _ = conn.set_write_timeout(Some(IO_TIMEOUT));
        let n = open.fetch_add(1, Ordering::AcqRel);
        if n >= MAX_CONNECTIONS {
            open.fetch_sub(1, Ordering::AcqRel);
            let _ = conn.set_write_timeout(Some(Duration::from_millis(100)));
            let _ = write_reply(
                &mut conn,
                &Reply::text(503, "too many connections\n"),
                false,
            );
            close(&mut conn, Duration::from_millis(50));
            continue;
        }
        let (site, open2) = (site.clone(), open.clone());
        let spawned = std::thread::Builder::new()
            .name("http-conn".into())
            .spawn(move || {
                serve_one(&mut conn, &site);
                open2.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            open.fetch_sub(1, Ordering::AcqRel);
            rdmastream::warn_limited!("http", "metrics server: starting a thread: {e}");
        }
    }
}

/// Reads one request from `conn` and answers it.
fn serve_one(conn: &mut TcpStream, site: &Site) {
    let reply_to = match read_request(conn) {
        Ok(Some(request)) => request,
        Ok(None) => return,
        Err(reply) => {
            let _ = write_reply(conn, &reply, false);
            close(conn, Duration::from_secs(1));
            return;
        }
    };
    let (method, path) = reply_to;
    let reply = match (method.as_str(), site) {
        ("GET" | "HEAD", Site::Binary { monitor, thumbs }) => {
            answer(&path, monitor, thumbs.as_deref())
        }
        ("GET" | "HEAD", Site::Metrics(render)) => answer_metrics(&path, render),
        _ => Reply::text(405, "only GET\n"),
    };
    let _ = write_reply(conn, &reply, method == "HEAD");
    close(conn, Duration::from_secs(1));
}

/// Ends the answer and reads what the client still sends (at most [`MAX_REQUEST`] bytes, for at
/// most `linger`) before the socket closes: closing it with unread bytes would send a reset,
/// which can reach the client before it read the answer.
fn close(conn: &mut TcpStream, linger: Duration) {
    let _ = conn.shutdown(std::net::Shutdown::Write);
    let _ = conn.set_read_timeout(Some(linger));
    let mut sink = [0u8; 1024];
    let mut left = MAX_REQUEST;
    while left > 0 {
        match conn.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => left = left.saturating_sub(n),
        }
    }
}

/// The method and path (query string cut off) of the request on `conn`; `Ok(None)` when the
/// client went away or timed out before a whole request; `Err` with the answer for a request
/// that is malformed or too long.
fn read_request(conn: &mut TcpStream) -> Result<Option<(String, String)>, Reply> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at;
        }
        if buf.len() >= MAX_REQUEST {
            return Err(Reply::text(431, "request too long\n"));
        }
        match conn.read(&mut chunk) {
            Ok(0) | Err(_) => return Ok(None),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    parse_request_line(&buf[..end])
        .map(Some)
        .ok_or_else(|| Reply::text(400, "bad request\n"))
}

/// `METHOD PATH HTTP/1.x` → method and path without its query.
fn parse_request_line(head: &[u8]) -> Option<(String, String)> {
    let line = head.split(|&b| b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?.trim_end_matches('\r');
    let mut parts = line.split(' ');
    let (method, target, version) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return None;
    }
    let path = target.split('?').next().unwrap_or("");
    Some((method.to_string(), path.to_string()))
}

/// An answer: status, content type and body.
struct Reply {
    code: u16,
    content_type: &'static str,
    body: Vec<u8>,
}

impl Reply {
    fn text(code: u16, body: &str) -> Reply {
        Reply {
            code,
            content_type: "text/plain; charset=utf-8",
            body: body.as_bytes().to_vec(),
        }
    }

    fn ok(content_type: &'static str, body: impl Into<Vec<u8>>) -> Reply {
        Reply {
            code: 200,
            content_type,
            body: body.into(),
        }
    }
}

/// Writes `reply` (without its body for HEAD), never cached, closing the connection.
fn write_reply(conn: &mut TcpStream, reply: &Reply, head_only: bool) -> std::io::Result<()> {
    let reason = match reply.code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "",
    };
    let mut out = format!(
        "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\n\
         Cache-Control: no-store\r\nConnection: close\r\n\r\n",
        reply.code,
        reply.content_type,
        reply.body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(&reply.body);
    }
    conn.write_all(&out)?;
    conn.flush()
}

/// What [`HttpServer::start_metrics`] serves at `/metrics`.
pub type MetricsFn = Arc<dyn Fn() -> String + Send + Sync>;

/// What a server answers for.
enum Site {
    /// A sender or receiver: its monitor, and on a receiver the thumbnails.
    Binary {
        monitor: Arc<Monitor>,
        thumbs: Option<Arc<Thumbnails>>,
    },
    /// Metrics only.
    Metrics(MetricsFn),
}

/// Answers a GET of `path` on a metrics-only server.
fn answer_metrics(path: &str, render: &MetricsFn) -> Reply {
    match path {
        "/metrics" => Reply::ok(crate::metrics::CONTENT_TYPE, render()),
        "/healthz" | "/readyz" => Reply::text(200, "ok\n"),
        _ => Reply::text(404, "not found\n"),
    }
}

/// Answers a GET of `path` on a binary's server.
fn answer(path: &str, monitor: &Arc<Monitor>, thumbs: Option<&Thumbnails>) -> Reply {
    match path {
        "/metrics" => Reply::ok(
            crate::metrics::CONTENT_TYPE,
            crate::metrics::render(monitor),
        ),
        "/healthz" => match monitor.alive() {
            true => Reply::text(200, "ok\n"),
            false => Reply::text(503, "not running\n"),
        },
        "/readyz" => match (monitor.ready(), monitor.role()) {
            (true, _) => Reply::text(200, "ready\n"),
            (false, Role::Sender) => Reply::text(503, "not connected to the receiver\n"),
            (false, Role::Receiver) => Reply::text(503, "not listening\n"),
        },
        "/api/status" => Reply::ok("application/json", status_json(monitor, thumbs).to_string()),
        "/" if thumbs.is_some() => Reply::ok("text/html; charset=utf-8", PAGE),
        "/" => Reply::text(
            200,
            "rdmastream sender: /metrics /healthz /readyz /api/status (the status page is the receiver's)\n",
        ),
        p if p.starts_with("/thumb/") => match (thumb_key(p), thumbs) {
            (Some(key), Some(t)) => match t.png(&key) {
                Some(png) => Reply::ok("image/png", png),
                None => Reply::text(404, "no thumbnail (yet) for this device\n"),
            },
            _ => Reply::text(404, "not found\n"),
        },
        _ => Reply::text(404, "not found\n"),
    }
}

/// `/thumb/<sender>/<device>.png` → its stream key.
fn thumb_key(path: &str) -> Option<StreamKey> {
    let rest = path.strip_prefix("/thumb/")?;
    let (sender, file) = rest.split_once('/')?;
    let device = file.strip_suffix(".png")?.parse().ok()?;
    rdmastream::proto::handshake::valid_sender_name(sender).then(|| StreamKey {
        sender: sender.to_string(),
        device,
    })
}

/// What `/api/status` returns.
pub fn status_json(monitor: &Monitor, thumbs: Option<&Thumbnails>) -> serde_json::Value {
    let rows = monitor.rows();
    let total = |f: fn(&crate::monitor::DeviceRow) -> f64| rows.iter().map(f).sum::<f64>();
    let devices: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            let mut v = serde_json::to_value(r).unwrap_or_default();
            let key = StreamKey {
                sender: r.sender.clone(),
                device: r.device,
            };
            if let (Some(t), Some(map)) = (thumbs, v.as_object_mut()) {
                let thumb = t.get(&key);
                map.insert(
                    "thumb".into(),
                    thumb
                        .as_ref()
                        .map(|_| format!("/thumb/{}/{}.png", r.sender, r.device))
                        .into(),
                );
                map.insert("thumb_frame".into(), thumb.as_ref().map(|t| t.frame).into());
                map.insert("thumb_kind".into(), thumb.as_ref().map(|t| t.kind).into());
                map.insert("format".into(), t.format(&key).into());
            }
            v
        })
        .collect();
    serde_json::json!({
        "role": match monitor.role() { Role::Sender => "sender", Role::Receiver => "receiver" },
        "uptime_s": monitor.uptime().as_secs_f64(),
        "ready": monitor.ready(),
        "alive": monitor.alive(),
        "totals": {
            "devices": rows.len(),
            "fps": total(|r| r.fps),
            "mbps": total(|r| r.mbps),
            "frames": total(|r| r.frames as f64),
            "drops": total(|r| r.drops as f64),
            "gaps": total(|r| r.gaps as f64),
        },
        "devices": devices,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::monitor::{Engine, ReceiverEngine};
    use rdmastream::stats::DeviceCounters;
    use std::io::{Read, Write};

    /// A raw HTTP/1.0 GET: status code and body.
    fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String, Vec<u8>) {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
        let mut all = Vec::new();
        s.read_to_end(&mut all).unwrap();
        let split = all.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
        let head = String::from_utf8_lossy(&all[..split]).to_string();
        let code = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        (code, head, all[split + 4..].to_vec())
    }

    #[test]
    fn the_endpoints_answer() {
        let ready = Arc::new(AtomicBool::new(false));
        let m = Monitor::new(Role::Receiver, Duration::from_secs(1), ready.clone());
        let thumbs = Thumbnails::new();
        let key = StreamKey {
            sender: "edge-1".into(),
            device: 2,
        };
        let c = Arc::new(DeviceCounters::default());
        c.frame(12, None);
        m.tick(
            vec![(key.clone(), c)],
            Engine::Receiver(ReceiverEngine::default()),
            Duration::from_secs(1),
        );
        let server = HttpServer::start("127.0.0.1:0", m.clone(), Some(thumbs.clone())).unwrap();
        let addr = server.local_addr();
        assert_eq!(get(addr, "/healthz").0, 200);
        assert_eq!(get(addr, "/readyz").0, 503);
        ready.store(true, Ordering::Release);
        assert_eq!(get(addr, "/readyz").0, 200);
        let (code, head, body) = get(addr, "/metrics");
        assert_eq!(code, 200);
        assert!(head.contains("application/openmetrics-text"), "{head}");
        assert!(
            String::from_utf8_lossy(&body)
                .contains("rdmastream_frames_total{sender=\"edge-1\",device=\"2\"} 1")
        );
        let (code, _, body) = get(addr, "/");
        assert!(code == 200 && String::from_utf8_lossy(&body).contains("<script>"));
        assert_eq!(get(addr, "/thumb/edge-1/2.png").0, 404);
        let fmt = rdmastream::proto::Format::rgb_video(2, 1, 25, 1)
            .to_string()
            .into_bytes();
        thumbs.observe(
            &key,
            &rdmastream::proto::StreamEvent::Format {
                frame_index: 0,
                descriptor: fmt,
                ack: None,
            },
        );
        thumbs.observe(
            &key,
            &rdmastream::proto::StreamEvent::Frame(rdmastream::proto::Frame {
                device: 2,
                index: 0,
                timestamp_ns: 0,
                duration_ns: 0,
                pts_ns: None,
                data: vec![200; 6].into(),
                reliable: false,
                ack: None,
            }),
        );
        let (code, head, body) = get(addr, "/thumb/edge-1/2.png");
        assert!(
            code == 200 && head.contains("image/png") && &body[1..4] == b"PNG",
            "{head}"
        );
        let (_, _, body) = get(addr, "/api/status");
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["devices"][0]["thumb"], "/thumb/edge-1/2.png");
        assert_eq!(v["devices"][0]["frames"], 1);
        assert_eq!(get(addr, "/nothing").0, 404);
        assert_eq!(get(addr, "/thumb/../etc/passwd.png").0, 404);
        m.finish();
        assert_eq!(get(addr, "/healthz").0, 503);
        assert_eq!(get(addr, "/readyz").0, 503);
        // A port in use is an error naming the address.
        let e = HttpServer::start(&addr.to_string(), m, None).err().unwrap();
        assert!(e.to_string().contains(&addr.to_string()), "{e}");
    }

    /// What the server answers to `raw`, read until it closes the connection.
    fn exchange(addr: std::net::SocketAddr, raw: &[u8]) -> String {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(raw).unwrap();
        let mut all = Vec::new();
        s.read_to_end(&mut all)
            .expect("the server closes the connection");
        String::from_utf8_lossy(&all).into_owned()
    }

    #[test]
    fn one_request_per_connection_with_bounded_requests() {
        let server = HttpServer::start_metrics("127.0.0.1:0", Arc::new(|| "m 1\n".into())).unwrap();
        let addr = server.local_addr();
        // HTTP/1.1 keeps connections alive by default: this server closes after each answer.
        let got = exchange(addr, b"GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(got.starts_with("HTTP/1.1 200 OK\r\n"), "{got}");
        assert!(
            got.contains("Connection: close\r\n") && got.ends_with("m 1\n"),
            "{got}"
        );
        // HEAD: the headers, no body.
        let got = exchange(addr, b"HEAD /metrics HTTP/1.1\r\n\r\n");
        assert!(
            got.contains("Content-Length: 4\r\n") && got.ends_with("\r\n\r\n"),
            "{got}"
        );
        assert!(exchange(addr, b"POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
        // Malformed request lines, and a request that never ends, are refused.
        for bad in [
            &b"GET\r\n\r\n"[..],
            b"GET metrics HTTP/1.1\r\n\r\n",
            b"\xff\xfe / HTTP/1.1\r\n\r\n",
        ] {
            let got = exchange(addr, bad);
            assert!(
                got.starts_with("HTTP/1.1 400"),
                "{:?}: {got}",
                String::from_utf8_lossy(bad)
            );
        }
        let mut long = b"GET / HTTP/1.1\r\nX: ".to_vec();
        long.resize(MAX_REQUEST + 100, b'a');
        assert!(exchange(addr, &long).starts_with("HTTP/1.1 431"));
    }

    /// Clients that connect and send nothing hold a thread each, never the server: a request
    /// beside them is answered at once, and beyond [`MAX_CONNECTIONS`] the server says 503
    /// instead of queueing; once they go, requests are answered again.
    #[test]
    fn idle_connections_do_not_hold_up_requests() {
        let server = HttpServer::start_metrics("127.0.0.1:0", Arc::new(String::new)).unwrap();
        let addr = server.local_addr();
        let get = || exchange(addr, b"GET /healthz HTTP/1.1\r\n\r\n");
        let mut idle: Vec<_> = (0..MAX_CONNECTIONS - 1)
            .map(|_| std::net::TcpStream::connect(addr).unwrap())
            .collect();
        assert!(get().starts_with("HTTP/1.1 200"));
        // More idle clients until the server is full (a connection counts from its accept until
        // its thread ends, so the count is only known once a request is refused).
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            idle.push(std::net::TcpStream::connect(addr).unwrap());
            let got = get();
            if got.starts_with("HTTP/1.1 503") {
                assert!(got.contains("too many connections"), "{got}");
                break;
            }
            assert!(got.starts_with("HTTP/1.1 200"), "{got}");
            assert!(std::time::Instant::now() < deadline, "never full");
        }
        assert!(
            idle.len() <= 2 * MAX_CONNECTIONS,
            "{} idle clients",
            idle.len()
        );
        drop(idle);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !get().starts_with("HTTP/1.1 200") {
            assert!(
                std::time::Instant::now() < deadline,
                "the idle connections were never let go"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
