//! Helpers to build and run the real binaries.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Once;
use std::time::{Duration, Instant};

static BUILD: Once = Once::new();

/// Where and how the tests run: `RDMASTREAM_IT_TRANSPORT` (tcp, verbs), `RDMASTREAM_IT_HOST`
/// (the address the receiver listens on), `RDMASTREAM_IT_SMALL` (fewer and smaller frames, for
/// the Soft-RoCE VM under software CPU emulation; implied by verbs).
pub struct It {
    pub transport: String,
    pub host: String,
    pub small: bool,
}

/// The test environment.
pub fn it() -> It {
    let transport = std::env::var("RDMASTREAM_IT_TRANSPORT").unwrap_or_else(|_| "tcp".into());
    let small = std::env::var_os("RDMASTREAM_IT_SMALL").is_some() || transport == "verbs";
    let host = std::env::var("RDMASTREAM_IT_HOST").unwrap_or_else(|_| "127.0.0.1".into());
    It {
        transport,
        host,
        small,
    }
}

impl It {
    /// `host:port` on the test host.
    pub fn addr(&self, port: u16) -> String {
        format!("{}:{port}", self.host)
    }
}

/// Path of binary `name`, next to the test's own target directory; built (in this test's profile)
/// on first use unless `RDMASTREAM_PREBUILT` is set (inside the VM, where cargo cannot run).
pub fn bin(name: &str) -> PathBuf {
    let release = !cfg!(debug_assertions);
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let beside = exe.parent().and_then(|d| d.parent()).map(|d| d.join(name));
    if std::env::var_os("RDMASTREAM_PREBUILT").is_some() {
        return beside.expect("binary next to the test executable");
    }
    BUILD.call_once(|| {
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
            .current_dir(workspace())
            .status()
            .expect("running cargo build");
        assert!(status.success(), "building the binaries failed");
    });
    beside.expect("binary next to the test executable")
}

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// A free TCP port on loopback.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `bin` with `args`, logging to `log`.
pub fn spawn(bin: &Path, args: &[&str], log: &Path) -> Child {
    let out = std::fs::File::create(log).unwrap();
    Command::new(bin)
        .args(args)
        .current_dir(workspace())
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()))
}

/// Waits for `child` to exit, up to `timeout`; kills it and panics after that.
pub fn wait(child: &mut Child, timeout: Duration, what: &str, log: &Path) -> i32 {
    let end = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code().unwrap_or(-1);
        }
        if Instant::now() > end {
            let _ = child.kill();
            panic!(
                "{what} did not exit within {timeout:?}; log:\n{}",
                tail(log)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls `cond` until it holds or `timeout` passes.
pub fn wait_for(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cond()
}

/// Last lines of a log file.
pub fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Frame indices of the files in `dir` (sorted), ignoring temporaries.
pub fn frame_files(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut v: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| {
                    let p = e.path();
                    let stem = p.file_stem()?.to_str()?.to_string();
                    if stem.starts_with('.') {
                        return None;
                    }
                    Some((stem.parse().ok()?, p))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Checks one written file against the reference pattern, independently of the receiver.
pub fn check_camera_file(path: &Path, device: u8, index: u64, w: usize, h: usize) {
    let data = std::fs::read(path).unwrap();
    let mut want = vec![0u8; w * h * 3];
    rdmastream::source::camera_pattern(device, index, w, h, &mut want);
    assert!(
        data == want,
        "{} is not frame {index} of camera {device}",
        path.display()
    );
}

/// Checks one radar file.
pub fn check_radar_file(path: &Path, device: u8, index: u64, size: usize) {
    let data = std::fs::read(path).unwrap();
    let mut want = vec![0u8; size];
    rdmastream::source::radar_pattern(device, index, &mut want);
    assert!(
        data == want,
        "{} is not frame {index} of radar {device}",
        path.display()
    );
}

/// Writes a file and returns its path.
pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}
