//! `mode=max-autotune`: the block size of each fused pointwise kernel is
//! chosen by timing candidates on the kernel's real inputs the first time
//! it runs, and the fastest is kept in an in-memory cache keyed by the
//! kernel's signature (its code, shape and inputs' types and layouts), so
//! later runs and later compiles of the same kernel reuse it. Log topic
//! `autotune`. A block size changes only how the work is cut, never the
//! arithmetic: results are the same bits whatever is chosen.
//!
//! On a device the kernels are the backend's own: a max-autotune run marks
//! the thread that queues them ([`device_tuning`]) and the backend tunes
//! and caches its launches itself (tessera-cuda's `autotune`).

use std::cell::Cell;
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::Instant;

use super::cpu::fused::{FusedInput, FusedKernel};
use crate::error::Result;
use crate::logging::log;
use crate::tensor::Tensor;

/// The block sizes tried (elements).
pub const CANDIDATES: [usize; 5] = [256, 512, 1024, 2048, 4096];
/// Timed runs per candidate; the fastest counts.
const TRIALS: usize = 3;

static TUNED: Mutex<Option<HashMap<u64, usize>>> = Mutex::new(None);

/// A kernel's signature: its code (not its block) and its inputs' dtypes,
/// shapes and strides.
fn signature(kernel: &FusedKernel, inputs: &[&Tensor]) -> u64 {
    let mut h = DefaultHasher::new();
    format!(
        "{:?}|{:?}|{:?}|{}",
        kernel.shape, kernel.steps, kernel.outputs, kernel.wide
    )
    .hash(&mut h);
    for t in inputs {
        (t.dtype().to_string(), t.shape(), &t.layout().strides).hash(&mut h);
    }
    h.finish()
}

/// The cached block for this kernel on inputs like these, if tuned.
pub fn cached(kernel: &FusedKernel, inputs: &[&Tensor]) -> Option<usize> {
    let sig = signature(kernel, inputs);
    TUNED.lock().ok()?.as_ref()?.get(&sig).copied()
}

/// How many kernels have a tuned block.
pub fn tuned_count() -> usize {
    TUNED
        .lock()
        .ok()
        .and_then(|t| t.as_ref().map(HashMap::len))
        .unwrap_or(0)
}

/// The kernel with its tuned block: from the cache, or found by timing
/// every candidate on `inputs` (which are only read).
pub fn tune(kernel: &FusedKernel, inputs: &[&Tensor]) -> Result<FusedKernel> {
    let mut tuned = kernel.clone();
    if let Some(block) = cached(kernel, inputs) {
        tuned.block = block;
        return Ok(tuned);
    }
    let mut timings = Vec::with_capacity(CANDIDATES.len());
    for &block in &CANDIDATES {
        tuned.block = block;
        let mut best = f64::INFINITY;
        for _ in 0..TRIALS {
            let shared = inputs
                .iter()
                .map(|&t| FusedInput::Shared(t.array()))
                .collect();
            let started = Instant::now();
            drop(tuned.run_with(shared)?);
            best = best.min(started.elapsed().as_secs_f64());
        }
        timings.push((block, best));
    }
    let (block, _) = timings
        .iter()
        .copied()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .expect("candidates");
    log("autotune", || {
        let tried: Vec<String> = timings
            .iter()
            .map(|(b, t)| format!("{b}: {:.3} ms", t * 1e3))
            .collect();
        format!(
            "fused kernel {:?} ({} steps, default block {}): {}; chose {block}",
            kernel.shape,
            kernel.steps.len(),
            kernel.block,
            tried.join(", ")
        )
    });
    let sig = signature(kernel, inputs);
    if let Ok(mut t) = TUNED.lock() {
        t.get_or_insert_with(HashMap::new).insert(sig, block);
    }
    tuned.block = block;
    Ok(tuned)
}

thread_local! {
    static DEVICE_TUNING: Cell<bool> = const { Cell::new(false) };
}

/// Whether device kernels queued from this thread now belong to a
/// `max-autotune` run (device backends then tune their launches).
pub fn device_tuning() -> bool {
    DEVICE_TUNING.with(Cell::get)
}

/// Sets [`device_tuning`] on this thread while alive; dropping it (also
/// in a panic's unwinding) restores the previous setting.
#[must_use = "the setting lasts while the guard lives"]
pub struct DeviceTuning(bool);

impl DeviceTuning {
    pub fn set(on: bool) -> DeviceTuning {
        DeviceTuning(DEVICE_TUNING.with(|t| t.replace(on)))
    }
}

impl Drop for DeviceTuning {
    fn drop(&mut self) {
        DEVICE_TUNING.with(|t| t.set(self.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_tuning_is_scoped_to_the_thread_and_the_call() {
        assert!(!device_tuning());
        {
            let _on = DeviceTuning::set(true);
            assert!(device_tuning());
            // Another thread queues no kernels of this run.
            assert!(!std::thread::spawn(device_tuning).join().unwrap());
            {
                let _off = DeviceTuning::set(false);
                assert!(!device_tuning());
            }
            assert!(device_tuning());
        }
        assert!(!device_tuning());
        let _ = std::panic::catch_unwind(|| {
            let _on = DeviceTuning::set(true);
            panic!("boom")
        });
        assert!(!device_tuning());
    }
}
