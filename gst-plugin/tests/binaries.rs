//! The `sender` binary's `gstreamer` source and the `receiver` binary's `gstreamer` sink, as
//! real processes over tcp on loopback.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::free_port;

const EXIT_DEADLINE: Duration = Duration::from_secs(180);

/// The `sender` and `receiver` binaries, built (in this test's profile) on first use.
fn bin(name: &str) -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    let dir = BUILT.get_or_init(|| {
        let release = !cfg!(debug_assertions);
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args([
            "build",
            "--quiet",
            "-p",
            "rdmastream-sender",
            "-p",
            "rdmastream-receiver",
        ]);
        if release {
            cmd.arg("--release");
        }
        let status = cmd
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("running cargo build");
        assert!(status.success(), "building the binaries failed");
        std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
            .join(if release { "release" } else { "debug" })
    });
    dir.join(name)
}

fn spawn(dir: &Path, name: &str, args: &[&str]) -> Child {
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    Command::new(bin(name))
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"))
}

fn wait_success(mut child: Child, dir: &Path, name: &str) {
    let end = Instant::now() + EXIT_DEADLINE;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let log = std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default();
    assert!(status.success(), "{name} exited with {status}; log:\n{log}");
}

#[test]
fn a_gstreamer_source_feeds_a_gstreamer_sink_through_the_binaries() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let port = free_port();
    let raw = "videotestsrc num-buffers=30 pattern=ball ! \
               video/x-raw,format=RGB,width=320,height=240,framerate=25/1";
    let status = Command::new("gst-launch-1.0")
        .args(
            format!(
                "-q {raw} ! filesink location={}",
                d.join("ref.raw").display()
            )
            .split(' '),
        )
        .status()
        .expect("gst-launch-1.0");
    assert!(status.success());
    let receiver_toml = d.join("receiver.toml");
    std::fs::write(
        &receiver_toml,
        format!(
            r#"listen = "127.0.0.1:{port}"
transport = "tcp"
out = "{out}"
[[device]]
id = 3
pipeline = "filesink location={dir}/dev{{device}}-{{sender}}.raw"
[[device]]
id = 4
pipeline = "jpegdec ! videoconvert ! video/x-raw,format=I420 ! filesink location={dir}/dev{{device}}.yuv"
"#,
            out = d.join("out").display(),
            dir = d.display()
        ),
    )
    .unwrap();
    let sender_toml = d.join("sender.toml");
    std::fs::write(
        &sender_toml,
        format!(
            r#"name = "cams"
receiver = "127.0.0.1:{port}"
transport = "tcp"
[[device]]
id = 3
source = "gstreamer"
pipeline = "{raw} ! appsink sync=false"
policy = "block"
[[device]]
id = 4
source = "gstreamer"
pipeline = "videotestsrc num-buffers=20 ! video/x-raw,width=320,height=240,framerate=25/1 ! jpegenc ! appsink sync=false"
policy = "block"
"#
        ),
    )
    .unwrap();
    let rx = spawn(
        d,
        "receiver",
        &[
            "--config",
            receiver_toml.to_str().unwrap(),
            "--exit-after-eos",
        ],
    );
    let tx = spawn(d, "sender", &["--config", sender_toml.to_str().unwrap()]);
    wait_success(tx, d, "sender");
    wait_success(rx, d, "receiver");
    let got = std::fs::read(d.join("dev3-cams.raw")).unwrap();
    assert!(
        got == std::fs::read(d.join("ref.raw")).unwrap(),
        "device 3 differs"
    );
    // The jpeg stream's caps reached the appsrc: jpegdec decoded every frame.
    let yuv = std::fs::read(d.join("dev4.yuv")).unwrap();
    assert_eq!(yuv.len(), 20 * 320 * 240 * 3 / 2);
}

#[test]
fn a_gstreamer_source_without_appsink_is_a_config_error() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let toml = d.join("sender.toml");
    std::fs::write(
        &toml,
        r#"name = "x"
receiver = "127.0.0.1:1"
transport = "tcp"
[[device]]
id = 0
source = "gstreamer"
pipeline = "videotestsrc ! fakesink"
"#,
    )
    .unwrap();
    let out = Command::new(bin("sender"))
        .args(["--config", toml.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        text.contains("appsink") && text.contains("device 0"),
        "{text}"
    );
}
