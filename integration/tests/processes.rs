//! The real `sender` and `receiver` processes over the `tcp` transport on loopback.

mod common;

use std::time::Duration;

use common::*;

fn receiver_config(dir: &std::path::Path, extra: &str) -> std::path::PathBuf {
    write(
        dir,
        "receiver.toml",
        &format!(
            "blocks = 16\nblock_size = 1048576\nformat = \"raw\"\nkeep = 0\nwriters = 2\n{extra}\n"
        ),
    )
}

/// Twelve 640×480 cameras at 25 fps and two radars for 5 s, lossless (`block` policy): every
/// frame each source produced arrives, in order, bit-exact (checked here, independently of the
/// receiver's own --verify).
#[test]
fn twelve_cameras_and_two_radars_arrive_complete_in_order_and_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let out = tmp.path().join("out");
    let rx_cfg = receiver_config(tmp.path(), "");
    let tx_cfg = write(
        tmp.path(),
        "sender.toml",
        &format!(
            "name = \"edge-it\"\nreceiver = \"127.0.0.1:{port}\"\ntransport = \"tcp\"\n\
             [[device]]\nid = 0\ncount = 12\nsource = \"camera-synthetic\"\npolicy = \"block\"\n\
             [[device]]\nid = 200\ncount = 2\nsource = \"radar-synthetic\"\npolicy = \"block\"\n"
        ),
    );
    let (rx_log, tx_log) = (tmp.path().join("rx.log"), tmp.path().join("tx.log"));
    let listen = format!("127.0.0.1:{port}");
    let mut rx = spawn(
        &bin("receiver"),
        &[
            "--config",
            rx_cfg.to_str().unwrap(),
            "--listen",
            &listen,
            "--out",
            out.to_str().unwrap(),
            "--verify",
            "--exit-after-eos",
        ],
        &rx_log,
    );
    let mut tx = spawn(
        &bin("sender"),
        &["--config", tx_cfg.to_str().unwrap(), "--duration", "5"],
        &tx_log,
    );
    assert_eq!(
        wait(&mut tx, Duration::from_secs(120), "sender", &tx_log),
        0,
        "sender failed:\n{}",
        tail(&tx_log)
    );
    assert_eq!(
        wait(&mut rx, Duration::from_secs(60), "receiver", &rx_log),
        0,
        "receiver failed:\n{}",
        tail(&rx_log)
    );
    let rx_text = std::fs::read_to_string(&rx_log).unwrap();
    assert!(rx_text.contains("verify: all"), "{}", tail(&rx_log));

    let mut total = 0;
    for device in (0u8..12).chain([200, 201]) {
        let files = frame_files(&out.join("edge-it").join(format!("device-{device:03}")));
        let indices: Vec<u64> = files.iter().map(|(i, _)| *i).collect();
        assert!(
            indices.len() >= 25,
            "device {device}: only {} frames in 5 s",
            indices.len()
        );
        assert_eq!(
            indices,
            (0..indices.len() as u64).collect::<Vec<_>>(),
            "device {device}: frames missing or out of order"
        );
        for (index, path) in &files {
            if device < 12 {
                check_camera_file(path, device, *index, 640, 480);
            } else {
                check_radar_file(path, device, *index, 65536);
            }
        }
        total += files.len();
    }
    assert!(rx_text.contains(&format!(
        "{} frames",
        frame_files(&out.join("edge-it/device-000")).len()
    )));
    eprintln!("verified {total} frames");
}

/// The receiver is killed (SIGKILL) mid-stream and started again: the sender reconnects with
/// backoff and carries on numbering; every file on disk is a complete, correct frame, files
/// keep increasing, and the restarted receiver sees the streams end.
#[test]
fn receiver_killed_and_restarted_mid_stream() {
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let out = tmp.path().join("out");
    let rx_cfg = receiver_config(tmp.path(), "reorder_timeout_ms = 100");
    let tx_cfg = write(
        tmp.path(),
        "sender.toml",
        &format!(
            "name = \"edge-kill\"\nreceiver = \"127.0.0.1:{port}\"\ntransport = \"tcp\"\n\
             [[device]]\nid = 1\ncount = 2\nsource = \"camera-synthetic\"\nwidth = 320\nheight = 240\nfps = 50\n\
             [[device]]\nid = 9\nsource = \"radar-synthetic\"\nsize = 3000000\nrate = 20\n"
        ),
    );
    let listen = format!("127.0.0.1:{port}");
    let rx_args = [
        "--config",
        rx_cfg.to_str().unwrap(),
        "--listen",
        &listen,
        "--out",
        out.to_str().unwrap(),
        "--verify",
        "--exit-after-eos",
    ];
    let (rx1_log, rx2_log, tx_log) = (
        tmp.path().join("rx1.log"),
        tmp.path().join("rx2.log"),
        tmp.path().join("tx.log"),
    );
    let mut rx1 = spawn(&bin("receiver"), &rx_args, &rx1_log);
    let mut tx = spawn(
        &bin("sender"),
        &["--config", tx_cfg.to_str().unwrap(), "--duration", "6"],
        &tx_log,
    );
    let dev1 = out.join("edge-kill/device-001");
    assert!(
        wait_for(Duration::from_secs(30), || frame_files(&dev1).len() >= 20),
        "no frames before the kill:\n{}",
        tail(&rx1_log)
    );
    rx1.kill().unwrap();
    rx1.wait().unwrap();
    let before = frame_files(&dev1).len();
    std::thread::sleep(Duration::from_millis(500));
    let mut rx2 = spawn(&bin("receiver"), &rx_args, &rx2_log);
    assert_eq!(
        wait(&mut tx, Duration::from_secs(120), "sender", &tx_log),
        0,
        "sender failed:\n{}",
        tail(&tx_log)
    );
    assert_eq!(
        wait(&mut rx2, Duration::from_secs(60), "receiver", &rx2_log),
        0,
        "restarted receiver failed:\n{}",
        tail(&rx2_log)
    );
    let tx_text = std::fs::read_to_string(&tx_log).unwrap();
    assert!(
        tx_text.contains("2 connections") || tx_text.contains("3 connections"),
        "sender did not reconnect:\n{}",
        tail(&tx_log)
    );
    for (device, radar) in [(1u8, false), (2, false), (9, true)] {
        let dir = out.join(format!("edge-kill/device-{device:03}"));
        let files = frame_files(&dir);
        let indices: Vec<u64> = files.iter().map(|(i, _)| *i).collect();
        assert!(
            indices.windows(2).all(|w| w[0] < w[1]),
            "device {device}: indices not increasing"
        );
        for (index, path) in &files {
            if radar {
                check_radar_file(path, device, *index, 3_000_000);
            } else {
                check_camera_file(path, device, *index, 320, 240);
            }
        }
        let leftovers = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .count();
        assert_eq!(leftovers, 0, "device {device}: temporary files left behind");
    }
    assert!(
        frame_files(&dev1).len() > before + 20,
        "no frames after the restart:\n{}",
        tail(&rx2_log)
    );
}

/// A bad config exits with code 2 and names the file, the key and the reason.
#[test]
fn bad_config_names_file_key_and_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        (
            "sender",
            "name = \"a\"\nreceiver = \"x:1\"\n[[device]]\nid = 0\nsource = \"camera-synthetic\"\nfps = -3\n",
            "device[0].fps",
        ),
        (
            "sender",
            "name = \"../etc\"\nreceiver = \"x:1\"\n",
            "`name`",
        ),
        (
            "sender",
            "name = \"a\"\nreceiver = \"x:1\"\nblok_size = 5\n",
            "blok_size",
        ),
        (
            "receiver",
            "blocks = 4\nreserved_blocks = [7]\n",
            "reserved_blocks",
        ),
        ("receiver", "format = \"gif\"\n", "`format`"),
    ];
    for (n, (binary, text, key)) in cases.iter().enumerate() {
        let cfg = write(tmp.path(), &format!("{n}.toml"), text);
        let out = std::process::Command::new(bin(binary))
            .args(["--config", cfg.to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{binary} {text:?}: {err}");
        assert!(
            err.contains(&format!("{n}.toml")) && err.contains(key),
            "{binary}: message {err:?} should name the file and {key}"
        );
    }
}

/// With no receiver, a sender asked to stop still stops (bounded flush) and says why it failed,
/// naming the receiver.
#[test]
fn sender_without_receiver_stops_and_names_the_peer() {
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let log = tmp.path().join("tx.log");
    let peer = format!("127.0.0.1:{port}");
    let mut tx = spawn(
        &bin("sender"),
        &["--receiver", &peer, "--duration", "1"],
        &log,
    );
    let code = wait(&mut tx, Duration::from_secs(60), "sender", &log);
    assert_eq!(code, 1, "{}", tail(&log));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains(&format!("cannot connect to receiver {peer}")),
        "{}",
        tail(&log)
    );
    assert!(text.contains("could not be delivered"), "{}", tail(&log));
}
