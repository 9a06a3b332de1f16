//! Helpers for the tests that run real processes: building and finding the workspace's
//! artifacts, free ports, starting processes with a log, waiting with a deadline.
//!
//! Deadlines here exist so that a hang fails a test instead of stalling CI; they are generous
//! and never meant to fail a slow machine.

pub mod hostile;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit lives in the workspace")
        .to_path_buf()
}

/// The directory the running test's profile builds into (`target/<profile>`): the test
/// executable lives in its `deps/`.
pub fn artifacts() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("test executable under target/<profile>/deps")
        .to_path_buf()
}

/// Artifact `name` of the workspace, after `cargo build <cargo_args>` in the test's profile, run
/// once per process for each distinct `cargo_args`. With `RDMASTREAM_PREBUILT` set (inside the
/// Soft-RoCE VM, where cargo cannot run) nothing is built: the artifact must already be there.
pub fn built(name: &str, cargo_args: &[&str]) -> PathBuf {
    static BUILT: Mutex<Option<HashSet<Vec<String>>>> = Mutex::new(None);
    if std::env::var_os("RDMASTREAM_PREBUILT").is_none() {
        let key: Vec<String> = cargo_args.iter().map(|a| a.to_string()).collect();
        let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
        if built.get_or_insert_with(HashSet::new).insert(key) {
            let mut cmd = Command::new(env!("CARGO"));
            cmd.args(["build", "--quiet"]).args(cargo_args);
            if !cfg!(debug_assertions) {
                cmd.arg("--release");
            }
            let status = cmd
                .current_dir(workspace())
                .status()
                .expect("running cargo build");
            assert!(status.success(), "cargo build {cargo_args:?} failed");
        }
    }
    let path = artifacts().join(name);
    assert!(path.exists(), "{} was not built", path.display());
    path
}

/// The `sender` or `receiver` binary.
pub fn bin(name: &str) -> PathBuf {
    built(
        name,
        &["-p", "rdmastream-sender", "-p", "rdmastream-receiver"],
    )
}

/// A free TCP port on loopback, never one this process was given before.
///
/// The kernel may hand the same ephemeral port to two `bind(0)` calls once the first socket is
/// closed, and tests running in parallel in one process would then share it: over tcp one of
/// them fails to bind, but over the `mem` transport, where the port only names a fabric entry
/// that a second `listen` replaces, two tests silently talk to each other's elements.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// Starts `bin` with `args` in the workspace root, stdout and stderr to `log`, `RUST_LOG=info`.
pub fn spawn(bin: &Path, args: &[&str], log: &Path) -> Child {
    let out =
        std::fs::File::create(log).unwrap_or_else(|e| panic!("creating {}: {e}", log.display()));
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

/// Waits for `child` to exit and returns its exit code (-1: killed by a signal); after
/// `timeout` kills it and panics with the tail of `log`.
pub fn wait(child: &mut Child, timeout: Duration, what: &str, log: &Path) -> i32 {
    let end = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code().unwrap_or(-1);
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{what} did not exit within {timeout:?}; log:\n{}",
                tail(log)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits for `child` like [`wait`] and asserts it exited 0, showing the tail of `log` if not.
pub fn exits_ok(child: &mut Child, timeout: Duration, what: &str, log: &Path) {
    let code = wait(child, timeout, what, log);
    assert_eq!(code, 0, "{what} exited with {code}; log:\n{}", tail(log));
}

/// Polls `cond` until it holds (true) or `timeout` passes (false).
pub fn wait_for(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    cond()
}

/// Waits until the receiver that logs to `log` says it listens (for receivers the test cannot
/// connect to, e.g. in another network namespace); fails with the log's tail after 30 s.
pub fn wait_listening(log: &Path) {
    assert!(
        wait_for(Duration::from_secs(30), || std::fs::read_to_string(log)
            .unwrap_or_default()
            .contains("receiver listening on")),
        "the receiver did not start listening:\n{}",
        tail(log)
    );
}

/// The last 40 lines of a log file.
pub fn tail(log: &Path) -> String {
    // Lossy: a process killed mid-line may leave half a UTF-8 character behind.
    let text = String::from_utf8_lossy(&std::fs::read(log).unwrap_or_default()).into_owned();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}
