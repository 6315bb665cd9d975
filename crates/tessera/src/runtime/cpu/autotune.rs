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

/// What [`race`] found.
pub struct Race<R> {
    /// The index of the fastest candidate.
    pub winner: usize,
    /// Each candidate's best time, in seconds.
    pub best: Vec<f64>,
    /// The winner's result of its last run.
    pub result: R,
}

/// Runs each of `candidates` `TRIALS` (3) times, taking turns (so that a
/// passing disturbance of the machine falls on all of them alike), and
/// returns the fastest by its best time, with its last result. The
/// candidates must compute the same thing.
pub fn race<R>(candidates: &[impl Fn() -> Result<R>]) -> Result<Race<R>> {
    let mut best = vec![f64::INFINITY; candidates.len()];
    let mut last: Vec<Option<R>> = candidates.iter().map(|_| None).collect();
    for _ in 0..TRIALS {
        for (i, run) in candidates.iter().enumerate() {
            let started = Instant::now();
            let result = run()?;
            best[i] = best[i].min(started.elapsed().as_secs_f64());
            last[i] = Some(result);
        }
    }
    let winner = (0..candidates.len())
        .min_by(|&a, &b| best[a].total_cmp(&best[b]))
        .expect("at least one candidate");
    let result = last[winner].take().expect("every candidate ran");
    Ok(Race {
        winner,
        best,
        result,
    })
}

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
    let runs: Vec<Box<dyn Fn() -> Result<()> + '_>> = CANDIDATES
        .iter()
        .map(|&block| {
            let mut candidate = kernel.clone();
            candidate.block = block;
            Box::new(move || {
                let shared = inputs.iter().map(|&t| FusedInput::Shared(t)).collect();
                candidate.run_with(shared).map(drop)
            }) as Box<dyn Fn() -> Result<()>>
        })
        .collect();
    let race = race(&runs)?;
    let block = CANDIDATES[race.winner];
    log("autotune", || {
        let tried: Vec<String> = CANDIDATES
            .iter()
            .zip(&race.best)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Error, ErrorKind};
    use std::cell::Cell;
    use std::time::Duration;

    #[test]
    fn a_race_keeps_the_fastest_candidates_result_and_runs_each_in_turn() {
        let runs = Cell::new(Vec::new());
        let log = |i: usize| {
            let mut v = runs.take();
            v.push(i);
            runs.set(v);
        };
        // A sleep of 5 ms against none: no machine noise reverses that.
        let slow = || {
            log(0);
            std::thread::sleep(Duration::from_millis(5));
            Ok("slow")
        };
        let fast = || {
            log(1);
            Ok("fast")
        };
        let candidates: [&dyn Fn() -> Result<&'static str>; 2] = [&slow, &fast];
        let race = race(&candidates).unwrap();
        assert_eq!((race.winner, race.result), (1, "fast"));
        assert!(race.best[0] >= 0.005 && race.best[1] < race.best[0]);
        assert_eq!(
            runs.take(),
            [0, 1, 0, 1, 0, 1],
            "alternating, {TRIALS} each"
        );
    }

    #[test]
    fn a_failing_candidate_fails_the_race() {
        let fails = || Err::<(), _>(Error::new(ErrorKind::Verify, "candidate failed"));
        let candidates: [&dyn Fn() -> Result<()>; 1] = [&fails];
        let err = race(&candidates).err().expect("an error");
        assert!(err.to_string().contains("candidate failed"), "{err}");
    }
}
