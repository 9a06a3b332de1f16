//! The real `sender` and `receiver` processes. On the host they run over the `tcp` transport on
//! loopback; `scripts/test-vm.sh` runs the same tests over `verbs` on Soft-RoCE inside a VM
//! (`RDMASTREAM_IT_TRANSPORT=verbs`, smaller frames). The `_over_shm` tests run the same
//! scenarios over the shm transport (`unix:` addresses, shared memory) wherever they run.

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

/// Lossless (`block` policy) cameras and radars for a few seconds: every frame each source
/// produced arrives, in order, bit-exact (checked here, independently of the receiver's own
/// --verify), although two receiver blocks are unavailable (status 2) from the start, packet
/// numbers start at 65500 so every device wraps past 65535, and a radar frame spans several
/// blocks. The receiver posts no work request.
#[test]
fn frames_arrive_complete_in_order_bit_exact_across_retained_blocks_and_packet_wrap() {
    frames_arrive_complete_in_order_bit_exact_across_retained_blocks_and_packet_wrap_on(it());
}

#[test]
fn frames_arrive_complete_in_order_bit_exact_across_retained_blocks_and_packet_wrap_over_shm() {
    frames_arrive_complete_in_order_bit_exact_across_retained_blocks_and_packet_wrap_on(It::shm());
}

fn frames_arrive_complete_in_order_bit_exact_across_retained_blocks_and_packet_wrap_on(it: It) {
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let out = tmp.path().join("out");
    let rx_cfg = receiver_config(tmp.path(), &it, "reserved_blocks = [1, 3]");
    // Each source makes a fixed number of frames (4 s and 5 s of them) and then ends the device,
    // so how many arrive does not depend on how fast this machine is: all of them must.
    let (cams, (w, h), fps, cam_frames, radar, radar_frames) = if it.small {
        (3, (160, 120), 10, 40, 300_000, 20)
    } else {
        (12, (640, 480), 25, 125, 1_500_000, 25)
    };
    let devices = format!(
        "first_packet = 65500\n\
         [[device]]\nid = 0\ncount = {cams}\nsource = \"camera-synthetic\"\nwidth = {w}\nheight = {h}\nfps = {fps}\npolicy = \"block\"\nframes = {cam_frames}\n\
         [[device]]\nid = 200\ncount = 2\nsource = \"radar-synthetic\"\nsize = {radar}\nrate = 5\npolicy = \"block\"\nframes = {radar_frames}\n"
    );
    let tx_cfg = sender_config(tmp.path(), &it, "sender.toml", "edge-it", port, &devices);
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
        rx_text.contains(" 0 work requests posted by the receiver"),
        "{}",
        tail(&rx_log)
    );
    assert!(
        rx_text.contains(&format!("(transport {})", it.transport)),
        "{}",
        tail(&rx_log)
    );
    let mut total = 0;
    for device in 0..cams as u8 {
        let n = check_device(
            &out.join(format!("edge-it/device-{device:03}")),
            device,
            Some((w, h)),
            0,
        );
        // 36 frames take packet numbers 65500..=65535; the rest have wrapped past 0.
        assert_eq!(n, cam_frames, "device {device}");
        total += n;
    }
    for device in [200u8, 201] {
        let n = check_device(
            &out.join(format!("edge-it/device-{device:03}")),
            device,
            None,
            radar,
        );
        // A radar frame spans several blocks: its packet numbers wrap too.
        assert_eq!(n, radar_frames, "device {device}");
        total += n;
    }
    let tx_text = std::fs::read_to_string(&tx_log).unwrap();
    assert!(
        tx_text.contains("retained-skipped") && !tx_text.contains("retained-skipped 0\n"),
        "{}",
        tail(&tx_log)
    );
    eprintln!("verified {total} frames over {}", it.transport);
}

/// The receiver is killed (SIGKILL) mid-stream and started again: the sender reconnects with
/// backoff and carries on; its devices are `block` (lossless), so every frame the sender
/// produced is on disk exactly once, bit-exact and in order, across the crash. Then the sender is
/// interrupted (SIGINT, as Ctrl-C): it exits 0 and the restarted receiver sees the streams end.
/// (scripts/test-vm.sh runs this over verbs too.)
#[test]
fn receiver_killed_and_restarted_mid_stream() {
    receiver_killed_and_restarted_mid_stream_on(it());
}

#[test]
fn receiver_killed_and_restarted_mid_stream_over_shm() {
    receiver_killed_and_restarted_mid_stream_on(It::shm());
}

fn receiver_killed_and_restarted_mid_stream_on(it: It) {
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let out = tmp.path().join("out");
    let rx_cfg = receiver_config(tmp.path(), &it, "reorder_timeout_ms = 100");
    let (w, h, fps, radar, before_kill) = if it.small {
        (160, 120, 10, 300_000, 8)
    } else {
        (320, 240, 50, 3_000_000, 20)
    };
    let devices = format!(
        "[[device]]\nid = 1\ncount = 2\nsource = \"camera-synthetic\"\nwidth = {w}\nheight = {h}\nfps = {fps}\n\
         policy = \"block\"\n\
         [[device]]\nid = 9\nsource = \"radar-synthetic\"\nsize = {radar}\nrate = 10\n\
         policy = \"block\"\n"
    );
    let tx_cfg = sender_config(tmp.path(), &it, "sender.toml", "edge-kill", port, &devices);
    let listen = it.addr(port);
    let rx_args = receiver_args(&rx_cfg, &listen, &out);
    let (rx1_log, rx2_log, tx_log) = (
        tmp.path().join("rx1.log"),
        tmp.path().join("rx2.log"),
        tmp.path().join("tx.log"),
    );
    let mut rx1 = spawn(&bin("receiver"), &rx_args, &rx1_log);
    // No --duration: the sender runs until it is interrupted below, once the restarted
    // receiver has frames, however slow this machine is.
    let mut tx = spawn(
        &bin("sender"),
        &["--config", tx_cfg.to_str().unwrap()],
        &tx_log,
    );
    let dev1 = out.join("edge-kill/device-001");
    assert!(
        wait_for(Duration::from_secs(60), || frame_files(&dev1).len()
            >= before_kill),
        "no frames before the kill:\n{}",
        tail(&rx1_log)
    );
    rx1.kill().unwrap();
    rx1.wait().unwrap();
    let before = frame_files(&dev1).len();
    // Not to let anything settle: the receiver stays down for a while, so the sender sees its
    // connection fail and goes through backoff and reconnect, as after a real crash.
    std::thread::sleep(Duration::from_millis(500));
    let mut rx2 = spawn(&bin("receiver"), &rx_args, &rx2_log);
    assert!(
        wait_for(Duration::from_secs(120), || frame_files(&dev1).len()
            > before + 5),
        "no frames after the restart:\n{}",
        tail(&rx2_log)
    );
    // Ctrl-C: the sender stops cleanly, ending every device's stream, and exits 0; the
    // restarted receiver sees the ends and exits too (--exit-after-eos).
    let interrupted = std::process::Command::new("kill")
        .args(["-INT", &tx.id().to_string()])
        .status()
        .unwrap();
    assert!(interrupted.success());
    exits_ok(&mut tx, Duration::from_secs(60), "sender", &tx_log);
    exits_ok(&mut rx2, Duration::from_secs(60), "receiver", &rx2_log);
    let tx_text = std::fs::read_to_string(&tx_log).unwrap();
    assert!(
        !tx_text.contains(" 1 connections"),
        "sender did not reconnect:\n{}",
        tail(&tx_log)
    );
    let mut on_disk = 0;
    for (device, radar_size) in [(1u8, 0), (2, 0), (9, radar)] {
        let dir = out.join(format!("edge-kill/device-{device:03}"));
        let files = frame_files(&dir);
        let indices: Vec<u64> = files.iter().map(|(i, _)| *i).collect();
        assert_eq!(
            indices,
            (0..files.len() as u64).collect::<Vec<_>>(),
            "device {device}: frames missing, duplicated or out of order across the crash"
        );
        on_disk += files.len() as u64;
        for (index, path) in &files {
            if radar_size > 0 {
                check_radar_file(path, device, *index, radar_size);
            } else {
                check_camera_file(path, device, *index, w, h);
            }
        }
        let leftovers = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .count();
        assert_eq!(leftovers, 0, "device {device}: temporary files left behind");
    }
    assert_eq!(
        on_disk,
        frames_written(&tx_log),
        "files on disk vs frames the sender says it wrote"
    );
}

/// Two senders (two edge nodes) into one receiver, with the same device numbers: each gets its
/// own region and output directory.
#[test]
fn two_senders_into_one_receiver() {
    two_senders_into_one_receiver_on(it());
}

#[test]
fn two_senders_into_one_receiver_over_shm() {
    two_senders_into_one_receiver_on(It::shm());
}

fn two_senders_into_one_receiver_on(it: It) {
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let out = tmp.path().join("out");
    let rx_cfg = receiver_config(tmp.path(), &it, "");
    let listen = it.addr(port);
    let rx_log = tmp.path().join("rx.log");
    let mut rx = spawn(
        &bin("receiver"),
        &receiver_args(&rx_cfg, &listen, &out),
        &rx_log,
    );
    let devices = "[[device]]\nid = 4\nsource = \"camera-synthetic\"\nwidth = 128\nheight = 96\nfps = 20\npolicy = \"block\"\nframes = 60\n\
                   [[device]]\nid = 5\nsource = \"radar-synthetic\"\nsize = 50000\nrate = 10\npolicy = \"block\"\nframes = 30\n";
    let mut senders = Vec::new();
    // One sender keeps at most 6 of the receiver's 16 blocks FULL, the other has no limit; over
    // tcp the key means nothing: both keep tcp's own budget (8 MiB: 8 of 16 blocks of 1 MiB).
    for (name, budget) in [("node-a", "6 MiB"), ("node-b", "off")] {
        let cfg = sender_config(
            tmp.path(),
            &it,
            &format!("{name}.toml"),
            name,
            port,
            &format!("shm_cache_budget = \"{budget}\"\n{devices}"),
        );
        let log = tmp.path().join(format!("{name}.log"));
        senders.push((
            spawn(&bin("sender"), &["--config", cfg.to_str().unwrap()], &log),
            log,
        ));
    }
    for (n, (mut s, log)) in senders.into_iter().enumerate() {
        exits_ok(&mut s, Duration::from_secs(120), "sender", &log);
        let text = std::fs::read_to_string(&log).unwrap();
        let limited = text.contains("remote blocks full at once");
        if it.transport == "shm" && n == 0 && !it.small {
            assert!(
                text.contains("at most 6 of the 16 remote blocks full at once"),
                "shm_cache_budget = \"6 MiB\" not applied:\n{}",
                tail(&log)
            );
        } else if it.transport == "tcp" && !it.small {
            assert!(
                text.contains("at most 8 of the 16 remote blocks full at once"),
                "tcp's cache budget (8 MiB) not applied:\n{}",
                tail(&log)
            );
        } else {
            assert!(
                !limited,
                "a cache budget where none applies:\n{}",
                tail(&log)
            );
        }
    }
    exits_ok(&mut rx, Duration::from_secs(60), "receiver", &rx_log);
    for name in ["node-a", "node-b"] {
        let cams = check_device(
            &out.join(format!("{name}/device-004")),
            4,
            Some((128, 96)),
            0,
        );
        let radars = check_device(&out.join(format!("{name}/device-005")), 5, None, 50000);
        assert_eq!((cams, radars), (60, 30), "{name}: camera and radar frames");
    }
}

/// Handshakes the receiver must refuse — garbage on its port, a wrong key, no key — are logged with
/// the peer and refused without disturbing it; the refused sender exits with a message naming the
/// receiver and the reason; a correct sender is served afterwards.
#[test]
fn bad_handshakes_are_refused_and_the_receiver_carries_on() {
    use std::io::{Read, Write};
    let it = it();
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let out = tmp.path().join("out");
    let rx_cfg = receiver_config(tmp.path(), &it, "key = \"s3cret-s3cret-s3cret\"");
    let listen = it.addr(port);
    let rx_log = tmp.path().join("rx.log");
    let mut rx = spawn(
        &bin("receiver"),
        &receiver_args(&rx_cfg, &listen, &out),
        &rx_log,
    );
    let devices = "[[device]]\nid = 0\nsource = \"radar-synthetic\"\nsize = 1000\nrate = 20\npolicy = \"block\"\nframes = 40\n";
    // No key at all: the sender hangs up at the challenge and says what to set; the receiver's
    // log says what happened. (Once the receiver listens: `--duration 2` is all it tries for.)
    rdmastream_testkit::wait_listening(&rx_log);
    // Written here: `sender_config` gives a sender to a non-loopback receiver (verbs in the
    // VM) the suite's key.
    let keyless = write(
        tmp.path(),
        "keyless.toml",
        &format!(
            "name = \"keyless\"\nreceiver = \"{listen}\"\ntransport = \"{}\"\nblock_size = {}\nsend_blocks = 4\n{devices}",
            it.transport,
            if it.small { 262144 } else { 1048576 }
        ),
    );
    // A sender the receiver refuses, given `cfg`, for 2 s: it exits 1; what it logged.
    let refused = |cfg: &Path, what: &str| -> String {
        let log = tmp.path().join(format!("{what}.log"));
        let mut s = spawn(
            &bin("sender"),
            &["--config", cfg.to_str().unwrap(), "--duration", "2"],
            &log,
        );
        assert_eq!(
            wait(&mut s, Duration::from_secs(60), what, &log),
            1,
            "{}",
            tail(&log)
        );
        std::fs::read_to_string(&log).unwrap()
    };
    let text = refused(&keyless, "keyless sender");
    assert!(
        text.contains("requires a key for sender 'keyless'"),
        "{text}"
    );
    // Garbage: a length prefix announcing a short body of junk.
    let mut junk = loop {
        if let Ok(s) = std::net::TcpStream::connect(&listen) {
            break s;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    junk.write_all(&[
        12, 0, 0, 0, b'G', b'E', b'T', b' ', b'/', b' ', b'H', b'T', b'T', b'P', b'/', b'1',
    ])
    .unwrap();
    let mut answer = Vec::new();
    let _ = junk.read_to_end(&mut answer);
    assert!(
        String::from_utf8_lossy(&answer).contains("bad handshake"),
        "{answer:?}"
    );
    // A wrong key.
    let bad = sender_config(
        tmp.path(),
        &it,
        "bad.toml",
        "intruder",
        port,
        &format!("key = \"guess-guess-guess-guess\"\n{devices}"),
    );
    let text = refused(&bad, "refused sender");
    assert!(
        text.contains(&format!("receiver {listen} refused"))
            && text.contains("authentication failed"),
        "{text}"
    );
    // The right key.
    let good = sender_config(
        tmp.path(),
        &it,
        "good.toml",
        "friend",
        port,
        &format!("key = \"s3cret-s3cret-s3cret\"\n{devices}"),
    );
    let good_log = tmp.path().join("good.log");
    let mut s = spawn(
        &bin("sender"),
        &["--config", good.to_str().unwrap()],
        &good_log,
    );
    exits_ok(&mut s, Duration::from_secs(60), "sender", &good_log);
    exits_ok(&mut rx, Duration::from_secs(60), "receiver", &rx_log);
    assert_eq!(
        check_device(&out.join("friend/device-000"), 0, None, 1000),
        40
    );
    let rx_text = std::fs::read_to_string(&rx_log).unwrap();
    // One line per kind of refusal in a while (the junk's bad-handshake line is the keyless
    // sender's kind, logged first), every refusal counted.
    assert_eq!(
        rx_text.matches("refused connection").count(),
        2,
        "{}",
        tail(&rx_log)
    );
    assert!(
        rx_text.contains("3 connections refused")
            && rx_text.contains("sender 'keyless' hung up at the key challenge"),
        "{}",
        tail(&rx_log)
    );
    assert!(
        !out.join("intruder").exists(),
        "nothing may be written for a refused sender"
    );
}

/// Runs `binary` with `args` to its end: its exit code and what it wrote to stderr.
fn exits(binary: &str, args: &[&str]) -> (Option<i32>, String) {
    let out = std::process::Command::new(bin(binary))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
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
            "sender",
            "name = \"a\"\nreceiver = \"x:1\"\n[[device]]\nid = 0\nsource = \"gstreamer\"\npipeline = \"videotestsrc ! appsink\"\nframes = 10\n",
            "device[0].frames",
        ),
        (
            "receiver",
            "blocks = 4\nreserved_blocks = [7]\n",
            "reserved_blocks",
        ),
        ("receiver", "format = \"gif\"\n", "`format`"),
        ("receiver", "transport = \"infiniband\"\n", "`transport`"),
        // Issue 7: no keys on a non-loopback address, a short key, a key file that is not there.
        ("receiver", "listen = \"0.0.0.0:7471\"\n", "allow_anonymous"),
        (
            "receiver",
            "[[sender]]\nname = \"edge-1\"\nkey = \"short\"\n",
            "sender[0].key",
        ),
        (
            "sender",
            "name = \"a\"\nreceiver = \"x:1\"\nkey_file = \"missing.key\"\n[[device]]\nid = 0\nsource = \"radar-synthetic\"\n",
            "missing.key",
        ),
        ("receiver", "memory_budget = \"1 MiB\"\n", "`memory_budget`"),
        (
            "sender",
            "name = \"a\"\nreceiver = \"x:1\"\nshm_cache_budget = \"lots\"\n",
            "`shm_cache_budget`",
        ),
        (
            "sender",
            "name = \"a\"\nreceiver = \"x:1\"\n[[device]]\nid = 4\nsource = \"camera-synthetic\"\nstart = \"soon\"\n",
            "`device[0].start`",
        ),
        // `name` and `receiver` may come from the flags instead; without either, the key.
        (
            "sender",
            "receiver = \"x:1\"\n[[device]]\nid = 0\nsource = \"radar-synthetic\"\n",
            "`name`: missing",
        ),
        (
            "sender",
            "name = \"a\"\n[[device]]\nid = 0\nsource = \"radar-synthetic\"\n",
            "`receiver`: missing",
        ),
        // A source that cannot be built is bad input too (exit 2), naming the device.
        (
            "sender",
            "name = \"a\"\nreceiver = \"x:1\"\n[[device]]\nid = 4\nsource = \"images\"\ndir = \"/nonexistent-dir\"\n",
            "`device[0].dir`: device 4: /nonexistent-dir",
        ),
        (
            "sender",
            "name = \"a\"\nreceiver = \"x:1\"\n[[device]]\nid = 0\nsource = \"radar-synthetic\"\n[[device]]\nid = 1\nsource = \"gstreamer\"\npipeline = \"videotestsrc ! no-such-element ! appsink\"\n",
            "`device[1].pipeline`: device 1: cannot parse pipeline",
        ),
        // What TOML itself cannot read names its line and the key with its table.
        (
            "sender",
            "name = \"a\"\nreceiver = \"x:1\"\n[[device]]\nid = 0\nsource = \"radar-synthetic\"\n[[device]]\nsource = \"radar-synthetic\"\n",
            "`device[1].id`: line 6: missing field `id`",
        ),
    ];
    for (n, (binary, text, key)) in cases.iter().enumerate() {
        let cfg = write(tmp.path(), &format!("{n}.toml"), text);
        let (code, err) = exits(binary, &["--config", cfg.to_str().unwrap()]);
        assert_eq!(code, Some(2), "{binary} {text:?}: {err}");
        assert!(
            err.contains(&format!("{n}.toml")) && err.contains(key),
            "{binary}: message {err:?} should name the file and {key}"
        );
    }
    // A receiver's sink pipeline that does not parse names its `[[device]]` entry (on a socket
    // of its own: the check comes after the listener is up).
    let text = format!(
        "listen = \"unix:{}\"\nout = \"{}\"\n[[device]]\nid = 2\nformat = \"ppm\"\n\
         [[device]]\nid = 5\npipeline = \"videoconvert ! no-such-element ! fakesink\"\n",
        tmp.path().join("rx.sock").display(),
        tmp.path().join("out").display()
    );
    let cfg = write(tmp.path(), "pipeline.toml", &text);
    let (code, err) = exits("receiver", &["--config", cfg.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{text:?}: {err}");
    assert!(
        err.contains("pipeline.toml: key `device[1].pipeline`: device 5: cannot parse pipeline"),
        "{err}"
    );
    // A bad value given on the command line is blamed on the flag, not on the config file,
    // and exits 2 like any bad input.
    let good = write(
        tmp.path(),
        "good.toml",
        "keep = 0
",
    );
    for (flags, flag) in [
        (&["--listen", "nonsense"][..], "--listen"),
        (&["--listen", "127.0.0.1:99999"][..], "--listen"),
        (&["--transport", "carrier-pigeon"][..], "--transport"),
    ] {
        let (code, err) = exits(
            "receiver",
            &[&["--config", good.to_str().unwrap()], flags].concat(),
        );
        assert_eq!(code, Some(2), "{flags:?}: {err}");
        assert!(
            err.contains(&format!("{flag}: ")) && !err.contains("good.toml"),
            "{flags:?}: {err:?} should blame {flag}, not the file"
        );
    }
    // An address that parses but cannot be listened on names the flag and the address.
    let nowhere = tmp.path().join("no-such-dir/rx.sock");
    let nowhere = format!("unix:{}", nowhere.display());
    let (code, err) = exits(
        "receiver",
        &["--config", good.to_str().unwrap(), "--listen", &nowhere],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("--listen") && err.contains(&format!("cannot listen on {nowhere}")),
        "{err:?} should name --listen and {nowhere}"
    );
    // A file that leaves `name` and `receiver` to the flags: the sender runs with them (it
    // tries the receiver, which is not there, and says so naming the flag's address).
    let devices_only = write(
        tmp.path(),
        "devices-only.toml",
        "shutdown_grace = 0.2\n[[device]]\nid = 0\nsource = \"radar-synthetic\"\n",
    );
    let port = free_port();
    let peer = format!("127.0.0.1:{port}");
    let (code, err) = exits(
        "sender",
        &[
            "--config",
            devices_only.to_str().unwrap(),
            "--name",
            "edge-9",
            "--receiver",
            &peer,
            "--duration",
            "0.5",
        ],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!("cannot connect to receiver {peer}")) && !err.contains("missing"),
        "{err}"
    );
    // A receiver address that can never work is refused at start, not retried forever.
    for (addr, why) in [("nohost:99999", "port"), ("10.0.0.2", "no port")] {
        let (code, err) = exits("sender", &["--receiver", addr, "--duration", "1"]);
        assert_eq!(code, Some(2), "--receiver {addr}: {err}");
        assert!(
            err.contains("--receiver: ") && err.contains(why),
            "--receiver {addr}: {err:?} should blame --receiver and say why"
        );
    }
}

/// Runs a sender with `--duration 1` against `peer`, where nothing listens, with `args` before
/// that, and returns its exit code (1: frames undelivered) and its log; fails after 60 s.
fn sender_to_nobody(dir: &Path, peer: &str, args: &[&str]) -> (i32, String) {
    let it = it();
    let log = dir.join("tx.log");
    let mut all = args.to_vec();
    all.extend([
        "--receiver",
        peer,
        "--transport",
        &it.transport,
        "--duration",
        "1",
    ]);
    let mut tx = spawn(&bin("sender"), &all, &log);
    let code = wait(&mut tx, Duration::from_secs(60), "sender", &log);
    (code, std::fs::read_to_string(&log).unwrap())
}

/// With no receiver, a sender asked to stop still stops (bounded flush) and says why it failed,
/// naming the receiver.
#[test]
fn sender_without_receiver_stops_and_names_the_peer() {
    let tmp = tempfile::tempdir().unwrap();
    let peer = it().addr(free_port());
    let (code, text) = sender_to_nobody(tmp.path(), &peer, &[]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains(&format!("cannot connect to receiver {peer}")),
        "{text}"
    );
    assert!(
        text.contains(&format!("were not delivered to receiver {peer}")),
        "{text}"
    );
}

/// `--duration` stops the sender at the deadline, not at the next status line: with a status
/// interval of 120 s, a `--duration 1` run (no receiver, so the frames are undelivered and the
/// exit code is 1 after `shutdown_grace`) ends within 60 s; it used to wait for the 120 s tick.
#[test]
fn duration_stops_the_sender_between_status_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("sender.toml");
    std::fs::write(
        &config,
        "status_interval = 120\nshutdown_grace = 1\n\
         [[device]]\nid = 1\nsource = \"radar-synthetic\"\n",
    )
    .unwrap();
    let peer = it().addr(free_port());
    let args = ["--config", config.to_str().unwrap(), "--name", "timed"];
    let (code, text) = sender_to_nobody(tmp.path(), &peer, &args);
    assert_eq!(code, 1, "{text}");
}

/// Copied binaries, run from an empty directory without any config file, stream with their
/// built-in defaults (those of the shipped configs): nothing depends on the source tree.
#[test]
fn copied_binaries_stream_with_built_in_defaults_from_an_empty_directory() {
    if it().transport != "tcp" {
        // The defaults' 12 full-size cameras are too much for the VM's emulated CPU; what is
        // tested here does not depend on the transport.
        eprintln!("skipped over {}: runs on the host", it().transport);
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for name in ["sender", "receiver"] {
        std::fs::copy(bin(name), dir.join(name)).unwrap();
    }
    let listen = format!("127.0.0.1:{}", free_port());
    let run = |name: &str, args: &[&str]| {
        let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
        std::process::Command::new(dir.join(name))
            .args(args)
            .current_dir(dir)
            .env("RUST_LOG", "info")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap()
    };
    let mut rx = run("receiver", &["--listen", &listen, "--exit-after-eos"]);
    let mut tx = run("sender", &["--receiver", &listen, "--duration", "2"]);
    exits_ok(
        &mut tx,
        Duration::from_secs(60),
        "sender",
        &dir.join("sender.log"),
    );
    exits_ok(
        &mut rx,
        Duration::from_secs(60),
        "receiver",
        &dir.join("receiver.log"),
    );
    for name in ["sender", "receiver"] {
        let log = std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap();
        assert!(log.contains("built-in defaults"), "{name}:\n{log}");
    }
    // The shipped sender.toml: 12 cameras (devices 0-11) and 2 radars (100, 101), as `edge-1`,
    // into ./out.
    for device in (0..12).chain([100, 101]) {
        let files = frame_files(&dir.join(format!("out/edge-1/device-{device:03}")));
        assert!(!files.is_empty(), "device {device}: no frames");
    }
}

/// Over shm the sender writes straight into the receiver's memory. One killed (SIGKILL) in the
/// middle of a stream of multi-block frames leaves no torn frame file: a block it had not
/// finished has no FULL status byte, and a frame missing blocks is never written. The receiver
/// notices the socket closing and frees the region; a restarted sender (a new session) streams
/// again, every frame of its lossless devices arrives bit-exact and in order after the first
/// run's files, and those stay exactly as they were.
#[test]
fn sender_killed_mid_frame_and_restarted_over_shm() {
    let it = It::shm();
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let out = tmp.path().join("out");
    let rx_cfg = receiver_config(tmp.path(), &it, "");
    let (w, h) = (320, 240);
    let radar = 3_000_000; // three 1 MiB blocks a frame: most kills land mid-frame
    let devices = |frames: &str| {
        format!(
            "[[device]]\nid = 1\nsource = \"camera-synthetic\"\nwidth = {w}\nheight = {h}\nfps = 50\n\
             policy = \"block\"\n{frames}\
             [[device]]\nid = 9\nsource = \"radar-synthetic\"\nsize = {radar}\nrate = 20\n\
             policy = \"block\"\n{frames}"
        )
    };
    let tx1_cfg = sender_config(
        tmp.path(),
        &it,
        "tx1.toml",
        "edge-crash",
        port,
        &devices(""),
    );
    let tx2_cfg = sender_config(
        tmp.path(),
        &it,
        "tx2.toml",
        "edge-crash",
        port,
        &devices("frames = 30\n"),
    );
    let (rx_log, tx1_log, tx2_log) = (
        tmp.path().join("rx.log"),
        tmp.path().join("tx1.log"),
        tmp.path().join("tx2.log"),
    );
    let listen = it.addr(port);
    // Killed when the test ends (its senders do not all end their streams, so it would wait
    // sender_gone_after for the killed one).
    let _rx = KillOnDrop(spawn(
        &bin("receiver"),
        &receiver_args(&rx_cfg, &listen, &out),
        &rx_log,
    ));
    rdmastream_testkit::wait_listening(&rx_log);
    let mut tx1 = spawn(
        &bin("sender"),
        &["--config", tx1_cfg.to_str().unwrap()],
        &tx1_log,
    );
    let (cam, rad) = (
        out.join("edge-crash/device-001"),
        out.join("edge-crash/device-009"),
    );
    assert!(
        wait_for(Duration::from_secs(60), || frame_files(&cam).len() >= 10
            && frame_files(&rad).len() >= 3),
        "no frames before the kill:\n{}\n{}",
        tail(&rx_log),
        tail(&tx1_log)
    );
    tx1.kill().unwrap();
    tx1.wait().unwrap();
    assert!(
        wait_for(Duration::from_secs(30), || std::fs::read_to_string(&rx_log)
            .unwrap_or_default()
            .contains("sender disconnected")),
        "the receiver did not notice the killed sender:\n{}",
        tail(&rx_log)
    );
    let first: Vec<Vec<(u64, Vec<u8>)>> = [&cam, &rad]
        .iter()
        .map(|dir| {
            frame_files(dir)
                .into_iter()
                .map(|(i, p)| (i, std::fs::read(p).unwrap()))
                .collect()
        })
        .collect();
    for (dir, files) in [&cam, &rad].iter().zip(&first) {
        let indices: Vec<u64> = files.iter().map(|(i, _)| *i).collect();
        assert_eq!(
            indices,
            (0..files.len() as u64).collect::<Vec<_>>(),
            "{}: first run's frames missing or out of order",
            dir.display()
        );
    }
    // Every file the killed sender left is a whole frame, bit-exact.
    for (index, path) in frame_files(&cam) {
        check_camera_file(&path, 1, index, w, h);
    }
    for (index, path) in frame_files(&rad) {
        check_radar_file(&path, 9, index, radar);
    }
    let mut tx2 = spawn(
        &bin("sender"),
        &["--config", tx2_cfg.to_str().unwrap()],
        &tx2_log,
    );
    exits_ok(&mut tx2, Duration::from_secs(120), "sender", &tx2_log);
    // Where the new session starts, as the receiver says: frames of the killed session that
    // were still on their way when the snapshot above was taken may have been written after it.
    let rx_text = std::fs::read_to_string(&rx_log).unwrap_or_default();
    let base: Vec<u64> = [&cam, &rad]
        .iter()
        .zip(&first)
        .map(|(dir, files)| {
            let marker = format!("dir={}", dir.display());
            let from = rx_text
                .lines()
                .filter(|l| l.contains("a new session of this sender") && l.contains(&marker))
                .find_map(|l| {
                    l.split("numbered from ")
                        .nth(1)?
                        .split_whitespace()
                        .next()?
                        .parse::<u64>()
                        .ok()
                })
                .unwrap_or_else(|| {
                    panic!("no new session in {}:\n{}", dir.display(), tail(&rx_log))
                });
            assert!(
                from >= files.len() as u64,
                "{}: the new session starts at {from}, inside the first run's {} frames",
                dir.display(),
                files.len()
            );
            from
        })
        .collect();
    assert!(
        wait_for(Duration::from_secs(60), || frame_files(&cam).len() as u64
            == base[0] + 30
            && frame_files(&rad).len() as u64 == base[1] + 30),
        "the restarted sender's frames did not all arrive:\n{}",
        tail(&rx_log)
    );
    for ((dir, files), base) in [&cam, &rad].iter().zip(&first).zip(&base) {
        let after = frame_files(dir);
        for (i, data) in files {
            let path = &after.iter().find(|(j, _)| j == i).unwrap().1;
            assert!(
                &std::fs::read(path).unwrap() == data,
                "{} was overwritten",
                path.display()
            );
        }
        // The second session's frames follow, each the source's frame 0.. again.
        for (k, (_, path)) in after.iter().filter(|(i, _)| i >= base).enumerate() {
            if *dir == &cam {
                check_camera_file(path, 1, k as u64, w, h);
            } else {
                check_radar_file(path, 9, k as u64, radar);
            }
        }
        let leftovers = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .count();
        assert_eq!(leftovers, 0, "{}: temporary files left", dir.display());
    }
}

/// The `sender` binary's GStreamer source over the suite's transport (verbs in the Soft-RoCE
/// VM): `videotestsrc` draws every frame straight into a send block of the pool the `appsink`
/// proposes (registered memory over verbs), and every frame arrives bit-exact against the same
/// pipeline written to a file.
#[test]
fn a_gstreamer_source_draws_into_the_send_blocks() {
    let raw = "videotestsrc num-buffers=20 pattern=ball ! \
               video/x-raw,format=RGB,width=320,height=240,framerate=25/1";
    gstreamer_source_arrives_bit_exact(raw, raw, 320 * 240 * 3, 20, "");
}

/// A real kernel camera driver (`vivid` in the VM) captures straight into the `sender`
/// binary's send blocks: `v4l2src io-mode=userptr` queues the appsink pool's buffers to the
/// driver. Skipped without a vivid camera unless `RDMASTREAM_REQUIRE_CAMERA` is set.
#[test]
fn a_v4l2_camera_captures_into_the_sender_binarys_send_blocks() {
    const DEVICE: &str = "/dev/video0";
    let name = std::fs::read_to_string("/sys/class/video4linux/video0/name").unwrap_or_default();
    if !(name.starts_with("vivid") && Path::new(DEVICE).exists()) {
        assert!(
            std::env::var_os("RDMASTREAM_REQUIRE_CAMERA").is_none(),
            "RDMASTREAM_REQUIRE_CAMERA is set but {DEVICE} is not a vivid camera (name {name:?})"
        );
        eprintln!("no vivid camera at {DEVICE}: skipped (scripts/test-vm.sh runs this in its VM)");
        return;
    }
    // vivid's pattern held still, so every frame equals the reference capture.
    let src = format!(
        "v4l2src device={DEVICE} extra-controls=c,horizontal_movement=3,vertical_movement=3,osd_text_mode=2"
    );
    let caps = "video/x-raw,format=RGB,width=640,height=480";
    gstreamer_source_arrives_bit_exact(
        &format!("{src} num-buffers=1 ! {caps}"),
        &format!("{src} io-mode=userptr num-buffers=20 ! {caps}"),
        640 * 480 * 3,
        20,
        "in_place_blocks = 4",
    );
}

/// Runs `reference ! filesink` (frames of `frame` bytes), then a sender whose one lossless
/// device is `source ! appsink` (with `sender_keys`) into a receiver, both over the suite's
/// transport with blocks that hold one frame; checks that `frames` frames arrived, each equal to the reference's frame of the
/// same index (or its only frame), and that the sender says all were written in place.
fn gstreamer_source_arrives_bit_exact(
    reference: &str,
    source: &str,
    frame: usize,
    frames: usize,
    sender_keys: &str,
) {
    let it = it();
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let status = std::process::Command::new("gst-launch-1.0")
        .args(
            format!(
                "-q {reference} ! filesink location={}",
                d.join("ref.raw").display()
            )
            .split(' '),
        )
        .status()
        .expect("gst-launch-1.0");
    assert!(status.success(), "{reference} failed");
    let reference = std::fs::read(d.join("ref.raw")).unwrap();
    let port = free_port();
    let out = d.join("out");
    let block_size = if frame > 200_000 { 1048576 } else { 262144 };
    let rx_cfg = write(
        d,
        "receiver.toml",
        &format!(
            "transport = \"{}\"\n{}blocks = 8\nblock_size = {block_size}\nformat = \"raw\"\nkeep = 0\n",
            it.transport,
            it.key_line("")
        ),
    );
    let listen = it.addr(port);
    let rx_log = d.join("rx.log");
    let mut rx = spawn(
        &bin("receiver"),
        &receiver_args(&rx_cfg, &listen, &out),
        &rx_log,
    );
    let tx_cfg = write(
        d,
        "sender.toml",
        &format!(
            "name = \"cam\"\nreceiver = \"{listen}\"\ntransport = \"{}\"\nblock_size = {block_size}\nsend_blocks = 4\n{sender_keys}\n{}\
             [[device]]\nid = 2\nsource = \"gstreamer\"\npolicy = \"block\"\npipeline = \"{source} ! appsink\"\n",
            it.transport,
            it.key_line("")
        ),
    );
    let tx_log = d.join("tx.log");
    let mut tx = spawn(
        &bin("sender"),
        &["--config", tx_cfg.to_str().unwrap()],
        &tx_log,
    );
    exits_ok(&mut tx, Duration::from_secs(180), "sender", &tx_log);
    exits_ok(&mut rx, Duration::from_secs(60), "receiver", &rx_log);
    let files = frame_files(&out.join("cam/device-002"));
    assert_eq!(
        files.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        (0..frames as u64).collect::<Vec<_>>(),
        "frames missing or out of order"
    );
    for (index, path) in &files {
        let at = if reference.len() == frame {
            0
        } else {
            *index as usize * frame
        };
        assert!(
            std::fs::read(path).unwrap()[..] == reference[at..at + frame],
            "frame {index} differs from the reference"
        );
    }
    let log = std::fs::read_to_string(&tx_log).unwrap();
    let line = format!(
        "device 2: {frames} frames from the pipeline: {frames} written by it straight into send blocks"
    );
    assert!(
        log.contains(&line),
        "not every frame was written in place:\n{}",
        tail(&tx_log)
    );
}
