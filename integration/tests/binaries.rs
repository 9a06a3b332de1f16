//! The `sender` binary's `gstreamer` source and the `receiver` binary's `gstreamer` sink, as
//! real processes over tcp on loopback.

use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use rdmastream_testkit::{bin, exits_ok, free_port};

const EXIT_DEADLINE: Duration = Duration::from_secs(180);

fn spawn(dir: &Path, name: &str, args: &[&str]) -> Child {
    rdmastream_testkit::spawn(&bin(name), args, &dir.join(format!("{name}.log")))
}

/// The receiver binary with `config`, exiting once every stream it got has ended.
fn spawn_receiver(dir: &Path, config: &Path) -> Child {
    spawn(
        dir,
        "receiver",
        &["--config", config.to_str().unwrap(), "--exit-after-eos"],
    )
}

fn wait_success(mut child: Child, dir: &Path, name: &str) {
    exits_ok(
        &mut child,
        EXIT_DEADLINE,
        name,
        &dir.join(format!("{name}.log")),
    );
}

#[test]
fn a_gstreamer_source_feeds_a_gstreamer_sink_through_the_binaries() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let port = free_port();
    let raw = "videotestsrc num-buffers=30 pattern=ball ! \
               video/x-raw,format=RGB,width=320,height=240,framerate=25/1";
    reference(d, raw);
    let receiver_toml = d.join("receiver.toml");
    std::fs::write(
        &receiver_toml,
        format!(
            r#"listen = "127.0.0.1:{port}"
transport = "tcp"
out = "{out}"
[[device]]
id = 3
pipeline = "filesink location={dir}/dev{{device}}-{{sender}}-{{session}}.raw"
[[device]]
id = 4
pipeline = "jpegdec ! videoconvert ! video/x-raw,format=I420 ! filesink location={dir}/dev{{device}}-{{session}}.yuv"
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
pipeline = "videotestsrc num-buffers=20 ! video/x-raw,width=320,height=240,framerate=25/1 ! jpegenc ! appsink sync=false drop=true"
policy = "block"
"#
        ),
    )
    .unwrap();
    let rx = spawn_receiver(d, &receiver_toml);
    let tx = spawn(d, "sender", &["--config", sender_toml.to_str().unwrap()]);
    wait_success(tx, d, "sender");
    wait_success(rx, d, "receiver");
    let got = std::fs::read(only_file(d, "dev3-cams-", ".raw")).unwrap();
    assert!(
        got == std::fs::read(d.join("ref.raw")).unwrap(),
        "device 3 differs"
    );
    // The jpeg stream's caps reached the appsrc: jpegdec decoded every frame.
    let yuv = std::fs::read(only_file(d, "dev4-", ".yuv")).unwrap();
    assert_eq!(yuv.len(), 20 * 320 * 240 * 3 / 2);
    // videotestsrc rendered device 3's frames straight into send blocks of the pool the
    // appsink proposed (and they still matched, above); jpegenc allocates its own buffers,
    // which were copied.
    let log = std::fs::read_to_string(d.join("sender.log")).unwrap();
    for line in [
        "device 3: 30 frames from the pipeline: 30 written by it straight into send blocks (0 of them the receiver's memory), 0 copied",
        "device 4: 20 frames from the pipeline: 0 written by it straight into send blocks (0 of them the receiver's memory), 20 copied",
        // appsink's own dropping no longer applies (the frames are taken before it queues):
        // a pipeline that asks for it is told what does.
        "device 4: the pipeline's appsink drop=true drops nothing",
    ] {
        assert!(
            log.contains(line),
            "no {line:?} in the sender's log:\n{log}"
        );
    }
}

/// Over shm a live (`drop-oldest`) GStreamer source's frames are drawn by `videotestsrc`
/// straight into blocks of the receiver's memory, lent through the appsink's pool: every frame
/// that arrives matches the reference drawn by itself.
#[test]
fn a_gstreamer_source_draws_into_the_receivers_memory_over_shm() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let raw = "videotestsrc num-buffers=30 pattern=ball ! \
               video/x-raw,format=RGB,width=320,height=240,framerate=25/1";
    let reference = reference(d, raw);
    let address = format!("unix:{}", d.join("rx.sock").display());
    let receiver_toml = d.join("receiver.toml");
    std::fs::write(
        &receiver_toml,
        format!(
            "listen = \"{address}\"\nout = \"{}\"\nformat = \"raw\"\n",
            d.join("out").display()
        ),
    )
    .unwrap();
    let sender_toml = d.join("sender.toml");
    std::fs::write(
        &sender_toml,
        format!(
            r#"name = "cam"
receiver = "{address}"
[[device]]
id = 1
source = "gstreamer"
pipeline = "{raw} ! appsink"
"#
        ),
    )
    .unwrap();
    let rx = spawn_receiver(d, &receiver_toml);
    rdmastream_testkit::wait_listening(&d.join("receiver.log"));
    let tx = spawn(d, "sender", &["--config", sender_toml.to_str().unwrap()]);
    wait_success(tx, d, "sender");
    wait_success(rx, d, "receiver");
    let frame = 320 * 240 * 3;
    let mut got = 0;
    for entry in std::fs::read_dir(d.join("out/cam/device-001")).unwrap() {
        let path = entry.unwrap().path();
        let Some(index) = path
            .file_name()
            .and_then(|n| n.to_str()?.strip_suffix(".raw")?.parse::<usize>().ok())
        else {
            continue; // the stream's ledger and format files
        };
        let bytes = std::fs::read(&path).unwrap();
        assert!(
            bytes[..] == reference[index * frame..(index + 1) * frame],
            "frame {index} differs from videotestsrc's"
        );
        got += 1;
    }
    // A live device may drop a frame on a busy machine, not most of them.
    assert!(got >= 20, "only {got} of 30 frames arrived");
    let log = std::fs::read_to_string(d.join("sender.log")).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("device 1: 30 frames from the pipeline: 30 written by it straight into send blocks ("))
        .unwrap_or_else(|| panic!("not every frame was written in place:\n{log}"));
    let in_receiver: u64 = line
        .split(" written by it straight into send blocks (")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(in_receiver > 0, "none into the receiver's memory: {line}");
}

/// Runs `raw ! filesink` into `dir`/ref.raw and returns its bytes: the frames a source
/// pipeline's stream must match.
fn reference(dir: &Path, raw: &str) -> Vec<u8> {
    let path = dir.join("ref.raw");
    let status = Command::new("gst-launch-1.0")
        .args(format!("-q {raw} ! filesink location={}", path.display()).split(' '))
        .status()
        .expect("gst-launch-1.0");
    assert!(status.success(), "{raw} failed");
    std::fs::read(path).unwrap()
}

/// The one file in `dir` named `<prefix><session stamp><suffix>`.
fn only_file(dir: &std::path::Path, prefix: &str, suffix: &str) -> std::path::PathBuf {
    let found: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            n.starts_with(prefix) && n.ends_with(suffix)
        })
        .collect();
    assert_eq!(found.len(), 1, "{prefix}*{suffix}: {found:?}");
    found.into_iter().next().unwrap()
}

/// Runs binary `name` with `--config config` to its exit: its exit code and its stderr.
fn run_with_config(name: &str, config: &Path) -> (Option<i32>, String) {
    let out = Command::new(bin(name))
        .args(["--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A sink pipeline that writes a file must name it per stream ({session}): a later stream of
/// the device would replace the earlier one's file.
#[test]
fn a_sink_pipeline_writing_a_file_without_session_is_a_config_error() {
    let dir = tempfile::tempdir().unwrap();
    let toml = dir.path().join("receiver.toml");
    std::fs::write(
        &toml,
        "listen = \"127.0.0.1:1\"\n[[device]]\nid = 3\npipeline = \"filesink location=dev{device}.raw\"\n",
    )
    .unwrap();
    let (code, text) = run_with_config("receiver", &toml);
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("device[0].pipeline") && text.contains("{session}"),
        "{text}"
    );
}

/// A sink pipeline that does not parse is reported before the receiver takes its port or
/// creates its output directory: with the port busy too, the pipeline is the error named.
#[test]
fn a_bad_sink_pipeline_is_reported_before_the_receiver_listens() {
    let dir = tempfile::tempdir().unwrap();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let toml = dir.path().join("receiver.toml");
    let out_dir = dir.path().join("out");
    std::fs::write(
        &toml,
        format!(
            "listen = \"{}\"\nout = \"{}\"\n[[device]]\nid = 2\npipeline = \"fakesink\"\n[[device]]\nid = 5\npipeline = \"nosuchelement ! fakesink\"\n",
            busy.local_addr().unwrap(),
            out_dir.display()
        ),
    )
    .unwrap();
    let (code, text) = run_with_config("receiver", &toml);
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("device[1].pipeline") && text.contains("nosuchelement"),
        "{text}"
    );
    assert!(
        !out_dir.exists(),
        "the output directory was created: {text}"
    );
    drop(busy);
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
    let (code, text) = run_with_config("sender", &toml);
    assert_ne!(code, Some(0), "{text}");
    assert!(
        text.contains("appsink") && text.contains("device 0"),
        "{text}"
    );
}
