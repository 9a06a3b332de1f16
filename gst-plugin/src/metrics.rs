//! Prometheus metrics of the elements: an element whose `metrics` property names an
//! `address:port` is listed on that address's `/metrics` for as long as it runs (from `start` to
//! `stop`). Every element of the process naming the same address shares one small HTTP server
//! (`rdmastream_app::http`), which stops when the last of them stops.
//!
//! Each scrape reads every listed element's `stats` property, so the metrics are exactly what
//! the `stats` property and the `stats-interval` messages say: per element (labels `element`,
//! `factory`, `sender`, `device`) frames, payload bytes, drops, connections, and the gauges
//! in-flight / queued / connected.
//!
//! What it does not do: no counters of its own, no status page (that is the receiver binary's).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, LazyLock, Mutex, Weak};

use gst::glib;
use gst::prelude::*;

use rdmastream_app::http::HttpServer;
use rdmastream_app::metrics::{Family, render_families};

/// The elements an exporter lists, by registration number.
type ElementList = Mutex<BTreeMap<u64, glib::WeakRef<gst::Element>>>;

/// One HTTP server and the elements it lists.
struct Exporter {
    elements: Arc<ElementList>,
    _server: HttpServer,
}

/// The exporters of this process, by address.
static EXPORTERS: LazyLock<Mutex<HashMap<String, Weak<Exporter>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// An element's place on an exporter; dropping it takes the element off (and stops the server
/// when it was the last).
pub struct Listed {
    exporter: Arc<Exporter>,
    id: u64,
}

impl Drop for Listed {
    fn drop(&mut self) {
        self.exporter.elements.lock().unwrap().remove(&self.id);
    }
}

/// Lists `element` on the metrics server at `addr`, starting the server if this process has
/// none there yet.
pub fn list(addr: &str, element: &gst::Element) -> Result<Listed, rdmastream_app::Error> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut exporters = EXPORTERS.lock().unwrap();
    let exporter = match exporters.get(addr).and_then(Weak::upgrade) {
        Some(e) => e,
        None => {
            let elements = Arc::new(ElementList::default());
            let listed = elements.clone();
            let server = HttpServer::start_metrics(addr, Arc::new(move || render(&listed)))?;
            let e = Arc::new(Exporter {
                elements,
                _server: server,
            });
            exporters.retain(|_, w| w.strong_count() > 0);
            exporters.insert(addr.to_string(), Arc::downgrade(&e));
            e
        }
    };
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    exporter
        .elements
        .lock()
        .unwrap()
        .insert(id, element.downgrade());
    Ok(Listed { exporter, id })
}

/// `stats` fields and the metric each becomes: field, metric name (without `_total`), help,
/// counter (else gauge). rdmasink and rdmasrc name some counts differently; they share a
/// metric (the `factory` label tells them apart).
const FIELDS: [(&str, &str, &str, bool); 11] = [
    (
        "frames-written",
        "rdmastream_element_frames",
        "Frames: written to the receiver (rdmasink), received (rdmasrc)",
        true,
    ),
    ("frames", "rdmastream_element_frames", "", true),
    (
        "bytes-written",
        "rdmastream_element_payload_bytes",
        "Payload bytes of those frames",
        true,
    ),
    ("bytes", "rdmastream_element_payload_bytes", "", true),
    (
        "frames-dropped",
        "rdmastream_element_dropped_frames",
        "Frames dropped by the element's drop-policy",
        true,
    ),
    (
        "frames-before-caps",
        "rdmastream_element_frames_before_caps",
        "Frames received before the stream's caps (rdmasrc)",
        true,
    ),
    (
        "connections",
        "rdmastream_element_connections",
        "Connections made (rdmasink) or accepted by the shared listener (rdmasrc)",
        true,
    ),
    (
        "in-flight",
        "rdmastream_element_in_flight_frames",
        "Frames handed to the sender and not yet written (rdmasink)",
        false,
    ),
    (
        "copies-waited",
        "rdmastream_element_copies_waited",
        "Buffers from elsewhere that found no send block free and waited for one to copy into (rdmasink)",
        true,
    ),
    (
        "queued",
        "rdmastream_element_queued_frames",
        "Frames queued for the element's source pad (rdmasrc)",
        false,
    ),
    (
        "connected",
        "rdmastream_element_connected",
        "1 while connected to the receiver (rdmasink)",
        false,
    ),
];

/// The metrics of the listed elements that are still alive.
fn render(list: &ElementList) -> String {
    // Upgraded outside the lock: reading `stats` takes the element's own lock.
    let elements: Vec<gst::Element> = list
        .lock()
        .unwrap()
        .values()
        .filter_map(|w| w.upgrade())
        .collect();
    let mut families: Vec<Family> = Vec::new();
    for e in &elements {
        let stats = e.property::<gst::Structure>("stats");
        let factory = e
            .factory()
            .map(|f| f.name().to_string())
            .unwrap_or_default();
        let sender = ["sender-name", "sender"]
            .iter()
            .find_map(|f| stats.get::<String>(*f).ok())
            .unwrap_or_default();
        let device = e.property::<u32>("device-id").to_string();
        let labels = vec![
            ("element", e.name().to_string()),
            ("factory", factory),
            ("sender", sender),
            ("device", device),
        ];
        for (field, name, help, counter) in FIELDS {
            let Ok(v) = stats.value(field) else {
                continue;
            };
            let Some(v) = v
                .get::<u64>()
                .ok()
                .or_else(|| v.get::<u32>().ok().map(u64::from))
                .or_else(|| v.get::<bool>().ok().map(u64::from))
            else {
                continue;
            };
            match families.iter_mut().find(|f| f.name == name) {
                Some(f) => f.series.push((labels.clone(), v)),
                None => families.push(Family {
                    name,
                    help: if help.is_empty() {
                        FIELDS.iter().find(|f| f.1 == name).map_or("", |f| f.2)
                    } else {
                        help
                    },
                    counter,
                    series: vec![(labels.clone(), v)],
                }),
            }
        }
    }
    render_families(families)
}
