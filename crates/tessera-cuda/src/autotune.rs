//! `mode=max-autotune` on the GPU: the launch variants of a kernel (block
//! sizes of a generated kernel, flash attention's forward variants) are
//! timed once on the device, the fastest is kept, and the choice is cached
//! in memory and on disk (`<cache dir>/autotune/<key>.txt`, beside the
//! compiled images of `compiler`), keyed by the kernel's source, its shape
//! and the device's name. A later run, or a later process, reuses it with
//! no timing. Choices and timings are logged under `TESSERA_LOGS=autotune`.
//!
//! This module holds only the selection and the cache (no CUDA call), so
//! that it is unit-tested without a GPU; the backend passes the timing.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use tessera::logging::log;

use crate::compiler;

/// Timed launches per candidate (after one warm-up); the mean counts.
pub const REPS: usize = 5;

/// Chooses among candidates and remembers the choice.
pub struct Tuner {
    chosen: Mutex<HashMap<String, String>>,
    dir: Option<PathBuf>,
    timed: AtomicUsize,
    from_disk: AtomicUsize,
}

/// The cache key of a kernel: a hash of its source (with the default
/// launch's choice), its shape and the device's name.
pub fn key(source: &str, shape: &str, device: &str) -> String {
    compiler::source_hash(source, &format!("{shape}|{device}"))
}

impl Tuner {
    /// A tuner keeping its choices in `dir` too (`None`: memory only).
    pub fn new(dir: Option<PathBuf>) -> Tuner {
        if let Some(d) = &dir {
            // A folder that cannot be made only costs re-tuning next process.
            let _ = std::fs::create_dir_all(d);
        }
        Tuner {
            chosen: Mutex::new(HashMap::new()),
            dir,
            timed: AtomicUsize::new(0),
            from_disk: AtomicUsize::new(0),
        }
    }

    /// The process's tuner, on disk under the compiled-image cache.
    pub fn global() -> &'static Tuner {
        static TUNER: OnceLock<Tuner> = OnceLock::new();
        TUNER.get_or_init(|| Tuner::new(compiler::cache_dir().map(|d| d.join("autotune"))))
    }

    /// How many choices were made by timing (not found in a cache).
    pub fn timed(&self) -> usize {
        self.timed.load(Ordering::Relaxed)
    }

    /// How many choices were read back from the disk cache.
    pub fn from_disk(&self) -> usize {
        self.from_disk.load(Ordering::Relaxed)
    }

    /// The remembered choice for `key`, if any (memory only).
    pub fn cached(&self, key: &str) -> Option<String> {
        self.chosen.lock().ok()?.get(key).cloned()
    }

    /// Every (key, choice) in memory.
    pub fn entries(&self) -> Vec<(String, String)> {
        self.chosen
            .lock()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    }

    fn file(&self, key: &str) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(format!("{key}.txt")))
    }

    /// The index of the candidate to use for `key`: the one remembered in
    /// memory or on disk if it is still a candidate, else the fastest by
    /// `time(i)` (seconds per launch of candidate `i`), which is then
    /// remembered. `what` names the kernel in the log.
    pub fn choose(
        &self,
        what: &str,
        key: &str,
        candidates: &[String],
        mut time: impl FnMut(usize) -> Result<f64, String>,
    ) -> Result<usize, String> {
        if candidates.len() < 2 {
            return Ok(0);
        }
        let position = |c: &str| candidates.iter().position(|x| x == c);
        if let Some(i) = self.cached(key).and_then(|c| position(&c)) {
            return Ok(i);
        }
        if let Some(i) = self.read(key).and_then(|c| position(&c)) {
            self.from_disk.fetch_add(1, Ordering::Relaxed);
            self.remember(key, &candidates[i]);
            log("autotune", || {
                format!("{what}: {} (from the disk cache)", candidates[i])
            });
            return Ok(i);
        }
        let mut times = Vec::with_capacity(candidates.len());
        for i in 0..candidates.len() {
            times.push(time(i)?);
        }
        let best = fastest(&times);
        self.timed.fetch_add(1, Ordering::Relaxed);
        self.remember(key, &candidates[best]);
        let report: Vec<String> = candidates
            .iter()
            .zip(&times)
            .map(|(c, t)| format!("{c}: {:.4} ms", t * 1e3))
            .collect();
        self.write(key, &candidates[best], &report.join(", "));
        log("autotune", || {
            format!(
                "{what}: {}; chose {} (key {key})",
                report.join(", "),
                candidates[best]
            )
        });
        Ok(best)
    }

    fn remember(&self, key: &str, choice: &str) {
        if let Ok(mut m) = self.chosen.lock() {
            m.insert(key.to_string(), choice.to_string());
        }
    }

    /// The choice stored for `key`: the first line of its file.
    fn read(&self, key: &str) -> Option<String> {
        let text = std::fs::read_to_string(self.file(key)?).ok()?;
        text.lines()
            .next()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(String::from)
    }

    /// Stores the choice (first line) and the timings (second line, for
    /// people); written to a temporary name and renamed, so a reader never
    /// sees half a file.
    fn write(&self, key: &str, choice: &str, timings: &str) {
        let Some(file) = self.file(key) else { return };
        let tmp = file.with_extension(format!("txt.{}", std::process::id()));
        if std::fs::write(&tmp, format!("{choice}\n{timings}\n")).is_ok() {
            let _ = std::fs::rename(&tmp, &file);
        }
    }

    /// The folder the choices are kept in.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }
}

/// The index of the smallest time; the first of equals (a NaN never wins).
fn fastest(times: &[f64]) -> usize {
    let mut best = 0;
    for (i, &t) in times.iter().enumerate() {
        if t < times[best] || times[best].is_nan() {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("tessera-autotune-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn labels(xs: &[u32]) -> Vec<String> {
        xs.iter().map(u32::to_string).collect()
    }

    /// A fake device: candidate `i` takes `times[i]` seconds; counts calls.
    fn fake<'a>(
        times: &[f64],
        calls: &'a mut usize,
    ) -> impl FnMut(usize) -> Result<f64, String> + 'a {
        let times = times.to_vec();
        move |i| {
            *calls += 1;
            Ok(times[i])
        }
    }

    #[test]
    fn the_fastest_candidate_is_chosen_once_then_reused_from_memory() {
        let tuner = Tuner::new(None);
        let cands = labels(&[128, 256, 512, 1024]);
        let mut calls = 0;
        let i = tuner
            .choose("k", "key1", &cands, fake(&[3.0, 1.0, 2.0, 1.0], &mut calls))
            .unwrap();
        assert_eq!(
            (i, calls),
            (1, 4),
            "the first of the fastest, each timed once"
        );
        assert_eq!(tuner.timed(), 1);
        let mut again = 0;
        let j = tuner
            .choose("k", "key1", &cands, fake(&[0.0; 4], &mut again))
            .unwrap();
        assert_eq!((j, again, tuner.timed()), (1, 0, 1), "reused, not timed");
        assert_eq!(tuner.cached("key1").as_deref(), Some("256"));
        // Another key is tuned on its own.
        let mut other = 0;
        let k = tuner
            .choose("k", "key2", &cands, fake(&[1.0, 2.0, 3.0, 0.5], &mut other))
            .unwrap();
        assert_eq!((k, other, tuner.timed()), (3, 4, 2));
    }

    #[test]
    fn a_new_process_reads_the_choice_from_disk() {
        let dir = temp_dir("disk");
        let cands = labels(&[64, 128]);
        let first = Tuner::new(Some(dir.clone()));
        let mut calls = 0;
        assert_eq!(
            first
                .choose("k", "abc", &cands, fake(&[2.0, 1.0], &mut calls))
                .unwrap(),
            1
        );
        let text = std::fs::read_to_string(dir.join("abc.txt")).unwrap();
        assert!(
            text.starts_with("128\n") && text.contains("64: 2000.0000 ms"),
            "{text}"
        );
        // A fresh tuner (a later process) on the same folder: no timing.
        let second = Tuner::new(Some(dir.clone()));
        let mut none = 0;
        let i = second
            .choose("k", "abc", &cands, fake(&[0.0, 9.0], &mut none))
            .unwrap();
        assert_eq!((i, none, second.timed(), second.from_disk()), (1, 0, 0, 1));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_stored_choice_that_is_no_longer_a_candidate_is_tuned_again() {
        let dir = temp_dir("stale");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("k1.txt"), "4096\n").unwrap();
        std::fs::write(dir.join("k2.txt"), "").unwrap();
        let tuner = Tuner::new(Some(dir.clone()));
        let cands = labels(&[256, 512]);
        for key in ["k1", "k2"] {
            let mut calls = 0;
            let i = tuner
                .choose("k", key, &cands, fake(&[1.0, 0.5], &mut calls))
                .unwrap();
            assert_eq!((i, calls), (1, 2), "{key}");
        }
        assert_eq!(
            std::fs::read_to_string(dir.join("k1.txt"))
                .unwrap()
                .lines()
                .next(),
            Some("512")
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn one_candidate_is_not_timed_and_errors_pass_through() {
        let tuner = Tuner::new(None);
        let mut calls = 0;
        assert_eq!(
            tuner
                .choose("k", "one", &labels(&[256]), fake(&[1.0], &mut calls))
                .unwrap(),
            0
        );
        assert_eq!(calls, 0);
        let err = tuner
            .choose("k", "bad", &labels(&[1, 2]), |_| {
                Err("launch failed".to_string())
            })
            .unwrap_err();
        assert_eq!(err, "launch failed");
        assert_eq!(
            tuner.cached("bad"),
            None,
            "a failed tuning remembers nothing"
        );
    }

    #[test]
    fn nan_times_never_win_and_keys_differ_by_source_shape_and_device() {
        assert_eq!(fastest(&[f64::NAN, 2.0, 1.0]), 2);
        assert_eq!(fastest(&[1.0, f64::NAN]), 0);
        let k = key("src", "[8, 4]", "NVIDIA H200");
        assert_eq!(k, key("src", "[8, 4]", "NVIDIA H200"));
        assert_ne!(k, key("src2", "[8, 4]", "NVIDIA H200"));
        assert_ne!(k, key("src", "[8, 5]", "NVIDIA H200"));
        assert_ne!(k, key("src", "[8, 4]", "NVIDIA H100"));
    }
}
