//! The sliding-window baseline through the real `sender` and `receiver` processes, over the tcp
//! transport on loopback: the same devices, block layout, sources and sinks as the status-byte
//! tests in processes.rs, only `mechanism = "sliding-window"` on both ends (one connection per
//! device, WRITE WITH IMMEDIATE, ACKs). `scripts/test-vm.sh` runs them over verbs on Soft-RoCE
//! too (`RDMASTREAM_IT_TRANSPORT=verbs`, smaller frames).

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

/// Checks that `dir` holds frames 0..n of a synthetic device, every one bit-exact; returns n.
fn check_device(
    dir: &Path,
    device: u8,
    camera: Option<(usize, usize)>,
    radar_size: usize,
) -> usize {
    let files = frame_files(dir);
    let indices: Vec<u64> = files.iter().map(|(i, _)| *i).collect();
    assert_eq!(
        indices,
        (0..indices.len() as u64).collect::<Vec<_>>(),
        "{}: frames missing or out of order",
        dir.display()
    );
    for (index, path) in &files {
        match camera {
            Some((w, h)) => check_camera_file(path, device, *index, w, h),
            None => check_radar_file(path, device, *index, radar_size),
        }
    }
    files.len()
}

/// Lossless cameras and multi-block radars, several devices, packet numbers wrapping past
/// 65535: every frame arrives once, in order, bit-exact, each device over its own connection;
/// the receiver posted work requests (its receives and ACKs), unlike the status-byte receiver.
/// Over the transport the run uses (tcp on the host, verbs in the VM).
#[test]
fn several_devices_arrive_complete_in_order_bit_exact_over_the_sliding_window() {
    let it = it();
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let out = tmp.path().join("out");
    let rx_cfg = receiver_config(tmp.path(), &it, "mechanism = \"sliding-window\"");
    let (cams, (w, h), fps, cam_frames, radar, radar_frames) = if it.small {
        (3, (160, 120), 10, 30, 300_000, 10)
    } else {
        (4, (320, 240), 25, 60, 1_500_000, 12)
    };
    let devices = format!(
        "mechanism = \"sliding-window\"\nfirst_packet = 65500\n\
         [[device]]\nid = 0\ncount = {cams}\nsource = \"camera-synthetic\"\nwidth = {w}\nheight = {h}\nfps = {fps}\npolicy = \"block\"\nframes = {cam_frames}\n\
         [[device]]\nid = 200\ncount = 2\nsource = \"radar-synthetic\"\nsize = {radar}\nrate = 5\npolicy = \"block\"\nframes = {radar_frames}\n"
    );
    let tx_cfg = sender_config(tmp.path(), &it, "sender.toml", "edge-sw", port, &devices);
    let (rx_log, tx_log) = (tmp.path().join("rx.log"), tmp.path().join("tx.log"));
    let listen = it.addr(port);
    let mut rx = spawn(
        &bin("receiver"),
        &receiver_args(&rx_cfg, &listen, &out),
        &rx_log,
    );
    let mut tx = spawn(
        &bin("sender"),
        &["--config", tx_cfg.to_str().unwrap()],
        &tx_log,
    );
    exits_ok(&mut tx, Duration::from_secs(300), "sender", &tx_log);
    exits_ok(&mut rx, Duration::from_secs(60), "receiver", &rx_log);
    let rx_text = std::fs::read_to_string(&rx_log).unwrap();
    assert!(rx_text.contains("verify: all"), "{}", tail(&rx_log));
    assert!(
        rx_text.contains(&format!("(transport {})", it.transport)),
        "{}",
        tail(&rx_log)
    );
    assert!(
        !rx_text.contains(" 0 work requests posted by the receiver"),
        "the sliding-window receiver posts receives and ACKs: {}",
        tail(&rx_log)
    );
    let mut total = 0;
    for device in 0..cams as u8 {
        let n = check_device(
            &out.join(format!("edge-sw/device-{device:03}")),
            device,
            Some((w, h)),
            0,
        );
        assert_eq!(n, cam_frames, "device {device}");
        total += n;
    }
    for device in [200u8, 201] {
        let n = check_device(
            &out.join(format!("edge-sw/device-{device:03}")),
            device,
            None,
            radar,
        );
        assert_eq!(n, radar_frames, "device {device}");
        total += n;
    }
    let tx_text = std::fs::read_to_string(&tx_log).unwrap();
    let connected = tx_text
        .lines()
        .filter(|l| {
            l.contains("sliding window connected")
                && l.contains(&format!("transport=\"{}\"", it.transport))
        })
        .count();
    assert_eq!(
        connected,
        cams + 2,
        "one connection per device: {}",
        tail(&tx_log)
    );
    eprintln!("verified {total} frames over the sliding window");
}

/// A sender and a receiver of different mechanisms: the sender stops with the receiver's
/// refusal, which names both mechanisms.
#[test]
fn a_mechanism_mismatch_stops_the_sender_naming_both() {
    let it = it();
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let out = tmp.path().join("out");
    let rx_cfg = receiver_config(tmp.path(), &it, "");
    let devices = "mechanism = \"sliding-window\"\n\
                   [[device]]\nid = 1\nsource = \"radar-synthetic\"\nsize = 1000\nrate = 50\nframes = 5\n";
    let tx_cfg = sender_config(tmp.path(), &it, "sender.toml", "edge-sw", port, devices);
    let (rx_log, tx_log) = (tmp.path().join("rx.log"), tmp.path().join("tx.log"));
    let listen = it.addr(port);
    let mut rx = spawn(
        &bin("receiver"),
        &receiver_args(&rx_cfg, &listen, &out),
        &rx_log,
    );
    rdmastream_testkit::wait_listening(&rx_log);
    let mut tx = spawn(
        &bin("sender"),
        &["--config", tx_cfg.to_str().unwrap()],
        &tx_log,
    );
    let code = wait(&mut tx, Duration::from_secs(60), "sender", &tx_log);
    assert_ne!(code, 0, "{}", tail(&tx_log));
    let tx_text = std::fs::read_to_string(&tx_log).unwrap();
    assert!(
        tx_text.contains("sliding-window") && tx_text.contains("runs status-byte"),
        "{}",
        tail(&tx_log)
    );
    let _ = rx.kill();
    let _ = rx.wait();
}
