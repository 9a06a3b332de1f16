//! The files a directory sink has on disk, in the order they were written, so that `keep`
//! (newest N per device) and `disk_budget` (bytes over the whole output directory) hold across
//! devices, senders and receiver restarts. Over the disk budget, the oldest frame of the sender
//! that holds the most bytes goes first: one sender flooding the disk pushes out its own frames
//! before anyone else's.
//!
//! Shared by the writer threads. It costs about 40 bytes per frame file on disk, which the disk
//! budget bounds.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};

/// One frame file.
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Global write order.
    seq: u64,
    number: u64,
    bytes: u64,
    ext: &'static str,
}

#[derive(Debug, Default)]
struct DeviceFiles {
    files: VecDeque<Entry>,
}

/// Why files were deleted.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Evictions {
    /// Files deleted because a device had more than `keep`.
    pub keep: u64,
    /// Files deleted to stay within `disk_budget`.
    pub disk_budget: u64,
}

/// Frame files on disk, per device directory, in write order.
#[derive(Debug)]
pub struct Ledger {
    disk_budget: Option<u64>,
    used: u64,
    /// Bytes per sender directory (`<out>/<sender>`).
    per_sender: HashMap<PathBuf, u64>,
    next_seq: u64,
    devices: HashMap<PathBuf, DeviceFiles>,
    evictions: Evictions,
}

/// The frame number and extension of a frame file's name (`<number>.<ext>`), or `None` for
/// anything else (temporaries, the session record, ...).
pub fn frame_file(name: &str) -> Option<(u64, &'static str)> {
    let (stem, ext) = name.split_once('.')?;
    let ext = match ext {
        "raw" => "raw",
        "ppm" => "ppm",
        "png" => "png",
        _ => return None,
    };
    if stem.is_empty() || !stem.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((stem.parse().ok()?, ext))
}

fn file_path(dir: &Path, number: u64, ext: &str) -> PathBuf {
    dir.join(format!("{number:08}.{ext}"))
}

impl Ledger {
    /// A ledger for `out` that keeps its files within `disk_budget` bytes (if any). Frame files
    /// already under `out` (from an earlier receiver) are counted, oldest first by
    /// modification time.
    pub fn scan(out: &Path, disk_budget: Option<u64>) -> Ledger {
        let mut found: Vec<(std::time::SystemTime, PathBuf, u64, u64, &'static str)> = Vec::new();
        for sender in std::fs::read_dir(out).into_iter().flatten().flatten() {
            for device in std::fs::read_dir(sender.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let dir = device.path();
                if !dir.is_dir() {
                    continue;
                }
                for f in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                    let name = f.file_name();
                    let Some((number, ext)) = name.to_str().and_then(frame_file) else {
                        continue;
                    };
                    let Ok(meta) = f.metadata() else { continue };
                    let time = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
                    found.push((time, dir.clone(), number, meta.len(), ext));
                }
            }
        }
        found.sort_by(|a, b| (a.0, &a.1, a.2).cmp(&(b.0, &b.1, b.2)));
        let mut ledger = Ledger {
            disk_budget,
            used: 0,
            per_sender: HashMap::new(),
            next_seq: 0,
            devices: HashMap::new(),
            evictions: Evictions::default(),
        };
        for (_, dir, number, bytes, ext) in found {
            ledger.push(dir, number, bytes, ext);
        }
        ledger
    }

    fn sender_of(dir: &Path) -> PathBuf {
        dir.parent().unwrap_or(dir).to_path_buf()
    }

    fn account(&mut self, dir: &Path, added: u64, removed: u64) {
        self.used = self.used + added - removed;
        let s = self.per_sender.entry(Self::sender_of(dir)).or_insert(0);
        *s = *s + added - removed;
    }

    fn push(&mut self, dir: PathBuf, number: u64, bytes: u64, ext: &'static str) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.account(&dir, bytes, 0);
        self.devices.entry(dir).or_default().files.push_back(Entry {
            seq,
            number,
            bytes,
            ext,
        });
    }

    /// The newest frame number in `dir`, if it has any frame file.
    pub fn newest(&self, dir: &Path) -> Option<u64> {
        self.devices
            .get(dir)
            .and_then(|d| d.files.iter().map(|e| e.number).max())
    }

    /// Records a frame file just written (or rewritten: a frame number already there is not
    /// counted twice), then deletes files beyond `keep` in its directory and beyond the disk
    /// budget anywhere, oldest first. Returns the paths to delete (the caller deletes them,
    /// outside the lock).
    pub fn written(
        &mut self,
        dir: &Path,
        number: u64,
        bytes: u64,
        ext: &'static str,
        keep: Option<usize>,
    ) -> Vec<PathBuf> {
        let rewritten = self.devices.get_mut(dir).and_then(|d| {
            d.files
                .iter_mut()
                .rev()
                .take(64)
                .find(|e| e.number == number && e.ext == ext)
        });
        match rewritten {
            Some(e) => {
                let old = std::mem::replace(&mut e.bytes, bytes);
                self.account(dir, bytes, old);
            }
            None => self.push(dir.to_path_buf(), number, bytes, ext),
        }
        let mut gone = Vec::new();
        if let Some(keep) = keep
            && let Some(d) = self.devices.get_mut(dir)
        {
            let mut freed = 0;
            while d.files.len() > keep {
                let e = d.files.pop_front().expect("longer than keep");
                freed += e.bytes;
                self.evictions.keep += 1;
                gone.push(file_path(dir, e.number, e.ext));
            }
            self.account(dir, 0, freed);
        }
        if let Some(limit) = self.disk_budget {
            while self.used > limit {
                // The sender holding the most bytes, and its oldest file.
                let Some(heaviest) = self
                    .per_sender
                    .iter()
                    .max_by_key(|(_, b)| **b)
                    .map(|(s, _)| s.clone())
                else {
                    break;
                };
                let Some(oldest_dir) = self
                    .devices
                    .iter()
                    .filter(|(dir, _)| dir.parent() == Some(heaviest.as_path()))
                    .filter_map(|(dir, d)| Some((dir, d.files.front()?.seq)))
                    .min_by_key(|(_, seq)| *seq)
                    .map(|(dir, _)| dir.clone())
                else {
                    self.per_sender.remove(&heaviest);
                    continue;
                };
                let d = self.devices.get_mut(&oldest_dir).expect("found above");
                let e = d.files.pop_front().expect("has a front");
                self.account(&oldest_dir, 0, e.bytes);
                self.evictions.disk_budget += 1;
                gone.push(file_path(&oldest_dir, e.number, e.ext));
            }
        }
        gone
    }

    /// Bytes of frame files tracked.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Files deleted so far, by reason.
    pub fn evictions(&self) -> Evictions {
        self.evictions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_and_disk_budget_delete_the_oldest_first() {
        let mut l = Ledger::scan(Path::new("/nonexistent"), Some(250));
        let (a, b) = (Path::new("/o/s/device-000"), Path::new("/o/s/device-001"));
        assert!(l.written(a, 0, 100, "raw", None).is_empty());
        assert!(l.written(b, 0, 100, "raw", None).is_empty());
        // Rewriting the same frame does not count it twice.
        assert!(l.written(b, 0, 100, "raw", None).is_empty());
        assert_eq!(l.used(), 200);
        let gone = l.written(b, 1, 100, "raw", None);
        assert_eq!(gone, vec![PathBuf::from("/o/s/device-000/00000000.raw")]);
        let gone = l.written(b, 2, 10, "raw", Some(2));
        assert_eq!(gone, vec![PathBuf::from("/o/s/device-001/00000000.raw")]);
        assert_eq!(l.used(), 110);
        assert_eq!(
            l.evictions(),
            Evictions {
                keep: 1,
                disk_budget: 1
            }
        );
        assert_eq!(l.newest(b), Some(2));
        assert_eq!(frame_file("00000012.ppm"), Some((12, "ppm")));
        assert_eq!(frame_file(".00000012.ppm.tmp"), None);
        assert_eq!(frame_file(".session"), None);
    }

    #[test]
    fn a_flooding_sender_pushes_out_its_own_frames_first() {
        let mut l = Ledger::scan(Path::new("/nonexistent"), Some(300));
        let honest = Path::new("/o/honest/device-000");
        let flood = Path::new("/o/flood/device-007");
        l.written(honest, 0, 100, "raw", None);
        l.written(flood, 0, 100, "raw", None);
        l.written(flood, 1, 100, "raw", None);
        let gone = l.written(flood, 2, 100, "raw", None);
        assert_eq!(
            gone,
            vec![PathBuf::from("/o/flood/device-007/00000000.raw")]
        );
        let gone = l.written(flood, 3, 100, "raw", None);
        assert_eq!(
            gone,
            vec![PathBuf::from("/o/flood/device-007/00000001.raw")]
        );
        assert_eq!(l.newest(honest), Some(0));
    }

    #[test]
    fn files_of_an_earlier_receiver_count() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("edge-1/device-003");
        std::fs::create_dir_all(&dir).unwrap();
        for n in 0..5u64 {
            std::fs::write(dir.join(format!("{n:08}.raw")), [0u8; 10]).unwrap();
        }
        std::fs::write(dir.join(".00000005.raw.tmp"), [0u8; 10]).unwrap();
        let mut l = Ledger::scan(tmp.path(), None);
        assert_eq!(l.used(), 50);
        assert_eq!(l.newest(&dir), Some(4));
        let gone = l.written(&dir, 5, 10, "raw", Some(5));
        assert_eq!(gone, vec![dir.join("00000000.raw")]);
    }
}
