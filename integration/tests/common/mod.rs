//! What the process tests share: where they run, and checks of the frames written.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

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

/// The key both ends use when the host is not loopback (in the Soft-RoCE VM): the receiver
/// refuses to listen on a non-loopback address without keys.
pub const TEST_KEY: &str = "test-key-0123456789abcdef";

impl It {
    /// A `key = ...` line for a config file when the host is not loopback, else nothing.
    pub fn key_line(&self, already: &str) -> String {
        if rdmastream_app::cli::is_loopback(&self.host) || already.contains("key =") {
            String::new()
        } else {
            format!("key = \"{TEST_KEY}\"\n")
        }
    }

    /// `host:port` on the test host.
    pub fn addr(&self, port: u16) -> String {
        format!("{}:{port}", self.host)
    }
}

#[allow(unused_imports)]
pub use rdmastream_testkit::{bin, exits_ok, free_port, spawn, tail, wait, wait_for};

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
    rdmastream_app::source::camera_pattern(device, index, w, h, &mut want);
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
    rdmastream_app::source::radar_pattern(device, index, &mut want);
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

/// The number of frames the sender's summary says it wrote ("...: N frames written"), from its
/// log.
pub fn frames_written(log: &Path) -> u64 {
    let text = String::from_utf8_lossy(&std::fs::read(log).unwrap()).into_owned();
    text.lines()
        .find_map(|l| {
            l.split_once("s: ")?
                .1
                .split_once(" frames written")?
                .0
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no 'frames written' in the sender's log:\n{}", tail(log)))
}
