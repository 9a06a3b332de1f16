//! `--metrics` on the real `sender` and `receiver` processes over tcp on loopback: the probes
//! answer as the processes run, and the receiver's Prometheus metrics, parsed with a Prometheus
//! text parser, agree with its own end-of-run summary.

mod common;

use std::time::Duration;

use common::*;

/// A receiver and a sender, both with `--metrics`: the sender's /readyz turns 200 once it is
/// connected and its metrics carry its devices; once the sender has finished, the receiver's
/// /metrics says, per device, exactly what its summary says after Ctrl-C (frames received and
/// written, gaps, missing, duplicates, write errors, unwritten) and the totals (blocks,
/// refused connections, frames = what the sender wrote).
#[test]
fn metrics_agree_with_the_receivers_summary() {
    let it = it();
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let (rx_metrics, tx_metrics) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let out = tmp.path().join("out");
    let rx_cfg = receiver_config(tmp.path(), &it, "");
    // Lossless cameras and a radar with a fixed number of frames, and a live (drop-oldest)
    // camera whose source may drop: the counts the receiver ends with do not depend on timing.
    let devices = "[[device]]\nid = 0\ncount = 2\nsource = \"camera-synthetic\"\nwidth = 160\nheight = 120\nfps = 20\npolicy = \"block\"\nframes = 100\n\
         [[device]]\nid = 5\nsource = \"camera-synthetic\"\nwidth = 320\nheight = 240\nfps = 50\nframes = 250\n\
         [[device]]\nid = 100\nsource = \"radar-synthetic\"\nsize = 300000\nrate = 10\npolicy = \"block\"\nframes = 50\n";
    let tx_cfg = sender_config(tmp.path(), &it, "sender.toml", "edge-m", port, devices);
    let (rx_log, tx_log) = (tmp.path().join("rx.log"), tmp.path().join("tx.log"));
    let listen = it.addr(port);
    let rx_args = [
        "--config",
        rx_cfg.to_str().unwrap(),
        "--listen",
        &listen,
        "--out",
        out.to_str().unwrap(),
        "--verify",
        "--metrics",
        &rx_metrics,
    ];
    let mut rx = KillOnDrop(spawn(&bin("receiver"), &rx_args, &rx_log));
    assert!(
        wait_for(Duration::from_secs(60), || http_get(&rx_metrics, "/readyz")
            .is_some_and(|(code, _)| code == 200)),
        "the receiver's /readyz did not turn 200:\n{}",
        tail(&rx_log)
    );
    assert_eq!(http_get(&rx_metrics, "/healthz").unwrap().0, 200);
    let mut tx = KillOnDrop(spawn(
        &bin("sender"),
        &[
            "--config",
            tx_cfg.to_str().unwrap(),
            "--metrics",
            &tx_metrics,
        ],
        &tx_log,
    ));
    // The sender streams for at least 5 s (its sources' frame counts at their rates), connected
    // all that time.
    assert!(
        wait_for(Duration::from_secs(60), || http_get(&tx_metrics, "/readyz")
            .is_some_and(|(code, _)| code == 200)),
        "the sender's /readyz did not turn 200 while it streamed:\n{}",
        tail(&tx_log)
    );
    // Engine-wide counters are copied once per status interval.
    assert!(
        wait_for(Duration::from_secs(60), || {
            let s = scrape(&tx_metrics);
            metric(&s, "rdmastream_connections_total", &[]) == Some(1.0)
                && metric(&s, "rdmastream_syncs_total", &[]).is_some_and(|n| n > 0.0)
        }),
        "the sender's metrics do not show its connection:\n{}",
        tail(&tx_log)
    );
    let s = scrape(&tx_metrics);
    assert_eq!(metric(&s, "rdmastream_connected", &[]), Some(1.0));
    for device in ["0", "1", "5", "100"] {
        let labels = [("sender", "edge-m"), ("device", device)];
        assert!(
            metric(&s, "rdmastream_dropped_frames_total", &labels).is_some(),
            "sender metrics lack device {device}"
        );
    }
    exits_ok(&mut tx, Duration::from_secs(300), "sender", &tx_log);
    let written = frames_written(&tx_log);
    // Everything the sender wrote is received once its streams have ended (the receiver's
    // metrics are live; they settle here).
    assert!(
        wait_for(Duration::from_secs(60), || {
            let s = scrape(&rx_metrics);
            metric_sum(&s, "rdmastream_frames_total") as u64 == written
                && metric_sum(&s, "rdmastream_stream_ended") == 4.0
                && metric_sum(&s, "rdmastream_written_frames_total") as u64 == written
        }),
        "the receiver's metrics did not reach the {written} frames the sender wrote:\n{}",
        tail(&rx_log)
    );
    // SIGUSR1: the per-device table, at the next status line.
    let signalled = std::process::Command::new("kill")
        .args(["-USR1", &rx.id().to_string()])
        .status()
        .unwrap();
    assert!(signalled.success());
    assert!(
        wait_for(Duration::from_secs(60), || std::fs::read_to_string(&rx_log)
            .unwrap_or_default()
            .contains("devices:\ndevice ")),
        "no table after SIGUSR1:\n{}",
        tail(&rx_log)
    );
    // Engine-wide counters (blocks, refused connections) are copied once per status interval,
    // at the tick before its status line: the scrape is taken after the table's tick, which
    // came after every frame had settled, so no counter lags the summary.
    let s = scrape(&rx_metrics);
    // Ctrl-C: the receiver stops and prints its summary.
    let interrupted = std::process::Command::new("kill")
        .args(["-INT", &rx.id().to_string()])
        .status()
        .unwrap();
    assert!(interrupted.success());
    exits_ok(&mut rx, Duration::from_secs(60), "receiver", &rx_log);
    let summary = receiver_device_summary(&rx_log);
    assert_eq!(summary.len(), 4, "{summary:?}");
    for (key, d) in &summary {
        let (sender, device) = key.split_once("/d").unwrap();
        let device = device.parse::<u8>().unwrap().to_string();
        let labels = [("sender", sender), ("device", device.as_str())];
        let m = |name: &str| {
            metric(&s, name, &labels).unwrap_or_else(|| panic!("no {name} for {key}")) as u64
        };
        assert_eq!(m("rdmastream_frames_total"), d.received, "{key}");
        assert_eq!(m("rdmastream_written_frames_total"), d.written, "{key}");
        assert_eq!(m("rdmastream_gap_packets_total"), d.gaps, "{key}");
        assert_eq!(m("rdmastream_missing_frames_total"), d.missing, "{key}");
        assert_eq!(
            m("rdmastream_duplicate_frames_total"),
            d.duplicate_frames,
            "{key}"
        );
        assert_eq!(m("rdmastream_write_errors_total"), d.write_errors, "{key}");
        assert_eq!(m("rdmastream_unwritten_frames_total"), d.unwritten, "{key}");
        // The receiver drops nothing itself; its drops counter stays 0.
        assert_eq!(m("rdmastream_dropped_frames_total"), 0, "{key}");
        // Every frame had a capture timestamp: the latency histogram counts them all.
        assert_eq!(
            m("rdmastream_frame_latency_seconds_count"),
            d.received,
            "{key}"
        );
    }
    assert_eq!(
        metric(&s, "rdmastream_blocks_total", &[]).unwrap() as u64,
        receiver_total(&rx_log, "blocks")
    );
    assert_eq!(
        metric_sum(&s, "rdmastream_refused_connections_total") as u64,
        receiver_total(&rx_log, "connections refused")
    );
    assert_eq!(
        summary.values().map(|d| d.received).sum::<u64>(),
        written,
        "the receiver's summary disagrees with the sender's"
    );
    let rx_text = std::fs::read_to_string(&rx_log).unwrap();
    assert!(rx_text.contains("verify: all"), "{}", tail(&rx_log));
    // Both processes printed short status lines, and the per-device table at the end.
    let tx_text = std::fs::read_to_string(&tx_log).unwrap();
    for (text, log) in [(&rx_text, &rx_log), (&tx_text, &tx_log)] {
        let status: Vec<&str> = text
            .lines()
            .filter_map(|l| l.split_once("status: ").map(|(_, s)| s))
            .collect();
        assert!(!status.is_empty(), "no status line:\n{}", tail(log));
        assert!(
            status.iter().all(|s| s.chars().count() <= 160),
            "{status:#?}"
        );
        assert!(
            text.contains("devices:\ndevice "),
            "no table:\n{}",
            tail(log)
        );
    }
    // The receiver printed the table twice: on SIGUSR1 and at the end.
    assert_eq!(rx_text.matches("devices:\ndevice ").count(), 2, "{rx_text}");
    // The sender's table has a row per device.
    for device in ["d000", "d001", "d005", "d100"] {
        assert!(
            tx_text.contains(&format!("\n{device} ")),
            "{device}:\n{tx_text}"
        );
    }
}

/// A bad `--metrics` address is bad input: exit 2, naming the flag.
#[test]
fn a_bad_metrics_address_is_a_config_error_naming_the_flag() {
    for binary in ["sender", "receiver"] {
        let out = std::process::Command::new(bin(binary))
            .args(["--metrics", "not-an-address"])
            .current_dir(rdmastream_testkit::workspace())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{binary}: {err}");
        assert!(
            err.contains("--metrics") && err.contains("not-an-address"),
            "{binary}: {err}"
        );
    }
}
