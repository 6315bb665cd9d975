//! `mode=max-autotune`: the block size of each fused pointwise kernel is
//! chosen by timing candidates on the kernel's real inputs the first time
//! it runs, and the fastest is kept in an in-memory cache keyed by the
//! kernel's signature (its code, shape and inputs' types and layouts), so
//! later runs and later compiles of the same kernel reuse it. Log topic
//! `autotune`. A block size changes only how the work is cut, never the
//! arithmetic: results are the same bits whatever is chosen.
//!
//! A max-autotune run marks the threads that run its kernels
//! ([`crate::runtime::device::tuning`]); the CPU backend then tunes its
//! fused kernels here, and a device backend tunes and caches its launches
//! itself (tessera-cuda's `autotune`).

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::Instant;

use super::fused::FusedInput;
use crate::error::Result;
use crate::ir::kernel::FusedKernel;
use crate::logging::log;
use crate::runtime::array::Array;

/// The block sizes tried (elements).
pub const CANDIDATES: [usize; 5] = [256, 512, 1024, 2048, 4096];
/// Timed runs per candidate; the fastest counts.
const TRIALS: usize = 3;

static TUNED: Mutex<Option<HashMap<u64, usize>>> = Mutex::new(None);

/// A kernel's signature: its code (not its block) and its inputs' dtypes,
/// shapes and strides.
fn signature(kernel: &FusedKernel, inputs: &[&Array]) -> u64 {
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
pub fn cached(kernel: &FusedKernel, inputs: &[&Array]) -> Option<usize> {
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
pub fn tune(kernel: &FusedKernel, inputs: &[&Array]) -> Result<FusedKernel> {
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
            let shared = inputs.iter().map(|&t| FusedInput::Shared(t)).collect();
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
