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
//! One thread answers, with `tiny_http` reading requests; every answer is computed from the
//! [`Monitor`] and the thumbnail store, never from the engine, so a slow client cannot slow
//! frames down. Stopped (and joined) when the [`HttpServer`] is dropped.

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use rdmastream::engine::StreamKey;
use tiny_http::{Header, Method, Request, Response};

use crate::Error;
use crate::monitor::{Monitor, Role};
use crate::thumbs::Thumbnails;

/// The status page.
const PAGE: &str = include_str!("status_page.html");

/// A running HTTP server; stops when dropped.
pub struct HttpServer {
    addr: std::net::SocketAddr,
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
        let server = tiny_http::Server::from_listener(listener, None)
            .map_err(|e| io(std::io::Error::other(e.to_string())))?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("http".into())
                .spawn(move || {
                    while !stop.load(Ordering::Acquire) {
                        match server.recv_timeout(Duration::from_millis(100)) {
                            Ok(Some(request)) => match &site {
                                Site::Binary { monitor, thumbs } => {
                                    answer(request, monitor, thumbs.as_deref())
                                }
                                Site::Metrics(render) => answer_metrics(request, render),
                            },
                            Ok(None) => {}
                            Err(e) => {
                                rdmastream::warn_limited!("http", "metrics server: {e}");
                            }
                        }
                    }
                })
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
    pub fn local_addr(&self) -> std::net::SocketAddr {
        self.addr
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
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

/// Answers one request of a metrics-only server.
fn answer_metrics(request: Request, render: &MetricsFn) {
    let path = request.url().split('?').next().unwrap_or("");
    let response = match (request.method(), path) {
        (Method::Get | Method::Head, "/metrics") => Response::from_string(render())
            .with_header(header("Content-Type", crate::metrics::CONTENT_TYPE)),
        (Method::Get | Method::Head, "/healthz" | "/readyz") => text(200, "ok\n"),
        (Method::Get | Method::Head, _) => text(404, "not found\n"),
        _ => text(405, "only GET\n"),
    };
    let _ = request.respond(response.with_header(header("Cache-Control", "no-store")));
}

fn header(name: &str, value: &str) -> Header {
    Header::from_bytes(name.as_bytes(), value.as_bytes()).expect("valid header")
}

fn text(code: u16, body: &str) -> Response<std::io::Cursor<Vec<u8>>> {
    Response::from_string(body)
        .with_status_code(code)
        .with_header(header("Content-Type", "text/plain; charset=utf-8"))
}

/// Answers one request (errors writing the answer mean the client went away).
fn answer(request: Request, monitor: &Arc<Monitor>, thumbs: Option<&Thumbnails>) {
    let path = request.url().split('?').next().unwrap_or("").to_string();
    let no_store = header("Cache-Control", "no-store");
    let response = match (request.method(), path.as_str()) {
        (Method::Get | Method::Head, "/metrics") => {
            Response::from_string(crate::metrics::render(monitor))
                .with_header(header("Content-Type", crate::metrics::CONTENT_TYPE))
        }
        (Method::Get | Method::Head, "/healthz") => match monitor.alive() {
            true => text(200, "ok\n"),
            false => text(503, "not running\n"),
        },
        (Method::Get | Method::Head, "/readyz") => match (monitor.ready(), monitor.role()) {
            (true, _) => text(200, "ready\n"),
            (false, Role::Sender) => text(503, "not connected to the receiver\n"),
            (false, Role::Receiver) => text(503, "not listening\n"),
        },
        (Method::Get | Method::Head, "/api/status") => {
            Response::from_string(status_json(monitor, thumbs).to_string())
                .with_header(header("Content-Type", "application/json"))
        }
        (Method::Get | Method::Head, "/") if thumbs.is_some() => Response::from_string(PAGE)
            .with_header(header("Content-Type", "text/html; charset=utf-8")),
        (Method::Get | Method::Head, "/") => text(
            200,
            "rdmastream sender: /metrics /healthz /readyz /api/status (the status page is the receiver's)\n",
        ),
        (Method::Get | Method::Head, p) if p.starts_with("/thumb/") => {
            match (thumb_key(p), thumbs) {
                (Some(key), Some(t)) => match t.png(&key) {
                    Some(png) => {
                        Response::from_data(png).with_header(header("Content-Type", "image/png"))
                    }
                    None => text(404, "no thumbnail (yet) for this device\n"),
                },
                _ => text(404, "not found\n"),
            }
        }
        (Method::Get | Method::Head, _) => text(404, "not found\n"),
        _ => text(405, "only GET\n"),
    };
    let _ = request.respond(response.with_header(no_store));
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
}
