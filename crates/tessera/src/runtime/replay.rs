//! Graph replay for `mode=reduce-overhead` on a device: the kernel launches
//! of a compiled run, captured once into a device graph (a CUDA graph) and
//! queued again as one launch on later calls.
//!
//! Per input signature (device, dtype, shape, strides, offset and storage
//! size of each input; the value of each host scalar, which kernels take as
//! a constant):
//!
//! 1. the first call runs normally: it compiles the kernels, makes the
//!    cuBLASLt plans and loads the modules, none of which may happen while
//!    capturing;
//! 2. the second call copies the inputs into static input buffers, runs the
//!    program on them while the device records instead of running, and
//!    keeps the graph with those inputs and the outputs the recording
//!    wrote. The planned arena makes every intermediate's address the same
//!    on each replay; the device allocator hands the capture's other
//!    temporaries to the graph, which owns them from then on;
//! 3. every call from then on copies its inputs into the static ones,
//!    replays the graph and returns copies of the static outputs (so that
//!    a later replay never overwrites what a caller holds).
//!
//! Where recording is impossible (an op synchronises with the host or
//! copies to it, e.g. a bounds check of indices, a value drawn on the host,
//! or a kernel on another stream that waits for the host) the capture fails
//! and that signature runs normally from then on; the reason is logged under
//! `TESSERA_LOGS=cudagraphs`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::device::{self, Device, DeviceBackend, DeviceGraph};
use crate::error::Result;
use crate::ir::DType;
use crate::logging::log;
use crate::tensor::Tensor;

/// What identifies the recording an input list can replay.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct ArgKey {
    device: Device,
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
    storage_numel: Option<usize>,
    /// A host scalar's value (its bits): kernels take it as a constant.
    scalar: Option<u64>,
}

impl ArgKey {
    fn of(t: &Tensor) -> ArgKey {
        let host_scalar = t.device() == Device::Cpu && t.rank() == 0;
        ArgKey {
            device: t.device(),
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            strides: t.strides().to_vec(),
            offset: t.layout().offset,
            storage_numel: t.storage_numel(),
            scalar: host_scalar.then(|| t.item().to_bits()),
        }
    }

    /// The key with no scalar value: the input's layout only.
    fn without_scalar(&self) -> ArgKey {
        ArgKey {
            scalar: None,
            ..self.clone()
        }
    }
}

enum Entry {
    /// Ran once; the next call records.
    Warm,
    Recorded(Recording),
    /// Recording failed: runs normally, for this reason.
    Normal(String),
}

/// A graph with the inputs it reads and the outputs it writes. Fields drop
/// in order: the graph before the buffers it uses.
struct Recording {
    graph: Box<dyn DeviceGraph>,
    inputs: Vec<Tensor>,
    outputs: Vec<Tensor>,
}

/// What the replayer did, for tests and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayStats {
    /// Calls that ran normally (first calls, and signatures not recorded).
    pub normal_runs: usize,
    pub recordings: usize,
    pub replays: usize,
    /// Recordings that failed (the signature then runs normally).
    pub fallbacks: usize,
}

impl std::ops::AddAssign for ReplayStats {
    fn add_assign(&mut self, other: ReplayStats) {
        self.normal_runs += other.normal_runs;
        self.recordings += other.recordings;
        self.replays += other.replays;
        self.fallbacks += other.fallbacks;
    }
}

/// Distinct host-scalar values one input layout records before it stops
/// recording. Kernels take host scalars as constants, so each value is a
/// recording of its own: a few fixed ones (a flag, a constant scale) replay,
/// but a value that changes every call (a random op's seed, a scheduled
/// learning rate) would record on every call and keep every recording.
pub const MAX_SCALAR_VARIANTS: usize = 4;

/// The recordings of one compiled program, by input signature.
#[derive(Default)]
pub struct Replayer {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    entries: HashMap<Vec<ArgKey>, Entry>,
    /// Per input layout (the signature without scalar values), how many
    /// distinct scalar values it has seen.
    variants: HashMap<Vec<ArgKey>, usize>,
    stats: ReplayStats,
}

/// What a call does, by its signature's entry.
enum Step {
    Normal,
    Record,
    Replay,
}

impl State {
    /// What the call of signature `key` does, the entries and counts
    /// updated for it.
    fn step(&mut self, key: &[ArgKey]) -> Step {
        let layout: Vec<ArgKey> = key.iter().map(ArgKey::without_scalar).collect();
        if layout != key {
            if let Some(Entry::Normal(_)) = self.entries.get(&layout) {
                return Step::Normal;
            }
            if !self.entries.contains_key(key) {
                let seen = self.variants.entry(layout.clone()).or_default();
                *seen += 1;
                if *seen > MAX_SCALAR_VARIANTS {
                    let why = format!(
                        "host scalars (a seed, a learning rate) took {seen} values: kernels take them as constants, so each value would need a recording of its own; this input layout runs kernel by kernel"
                    );
                    log("cudagraphs", || why.clone());
                    self.entries.retain(|k, _| {
                        k.iter()
                            .map(ArgKey::without_scalar)
                            .ne(layout.iter().cloned())
                    });
                    self.entries.insert(layout, Entry::Normal(why));
                    self.stats.fallbacks += 1;
                    return Step::Normal;
                }
            }
        }
        match self.entries.get(key) {
            None => {
                self.entries.insert(key.to_vec(), Entry::Warm);
                Step::Normal
            }
            Some(Entry::Normal(_)) => Step::Normal,
            Some(Entry::Recorded(_)) => Step::Replay,
            Some(Entry::Warm) => Step::Record,
        }
    }
}

impl Replayer {
    pub fn new() -> Replayer {
        Replayer::default()
    }

    pub fn stats(&self) -> ReplayStats {
        self.state.lock().expect("replayer poisoned").stats
    }

    /// Why recording failed for the signatures that run normally.
    pub fn fallback_reasons(&self) -> Vec<String> {
        let state = self.state.lock().expect("replayer poisoned");
        state
            .entries
            .values()
            .filter_map(|e| match e {
                Entry::Normal(why) => Some(why.clone()),
                _ => None,
            })
            .collect()
    }

    /// `run(args)`, recorded and replayed as the module docs say when the
    /// inputs live on a device; on the host it is simply `run(args)`.
    pub fn run(
        &self,
        args: &[Tensor],
        run: impl Fn(&[Tensor]) -> Result<Vec<Tensor>>,
    ) -> Result<Vec<Tensor>> {
        let refs: Vec<&Tensor> = args.iter().collect();
        let on = match device::of_inputs("input", &refs) {
            Ok(d) if d != Device::Cpu && !args.is_empty() => d,
            _ => return run(args),
        };
        let backend = device::device_backend(on)?;
        let key: Vec<ArgKey> = args.iter().map(ArgKey::of).collect();
        // Held throughout: replays share the static buffers.
        let mut state = self.state.lock().expect("replayer poisoned");
        match state.step(&key) {
            Step::Normal => {
                state.stats.normal_runs += 1;
                run(args)
            }
            Step::Replay => {
                state.stats.replays += 1;
                match state.entries.get(&key) {
                    Some(Entry::Recorded(r)) => r.replay(backend.as_ref(), args),
                    _ => unreachable!("a replayed signature has its recording"),
                }
            }
            Step::Record => match record(backend.as_ref(), args, &run) {
                Ok(r) => {
                    state.stats.recordings += 1;
                    state.stats.replays += 1;
                    let out = r.replay(backend.as_ref(), args);
                    state.entries.insert(key, Entry::Recorded(r));
                    out
                }
                Err(e) => {
                    let why = e.message;
                    log("cudagraphs", || {
                        format!("not recorded, runs kernel by kernel: {why}")
                    });
                    state.stats.fallbacks += 1;
                    state.stats.normal_runs += 1;
                    state.entries.insert(key, Entry::Normal(why));
                    run(args)
                }
            },
        }
    }
}

/// Records `run` on static copies of `args`.
fn record(
    backend: &dyn DeviceBackend,
    args: &[Tensor],
    run: &impl Fn(&[Tensor]) -> Result<Vec<Tensor>>,
) -> Result<Recording> {
    let inputs: Vec<Tensor> = args
        .iter()
        .map(|t| copy_of(backend, t))
        .collect::<Result<_>>()?;
    backend.begin_capture()?;
    let outputs = run(&inputs);
    // Always ends the capture, also when the run failed.
    let graph = backend.end_capture();
    let outputs = outputs?;
    Ok(Recording {
        graph: graph?,
        inputs,
        outputs,
    })
}

/// A copy of `t` with the same layout in storage of its own (host tensors
/// are immutable values: shared).
fn copy_of(backend: &dyn DeviceBackend, t: &Tensor) -> Result<Tensor> {
    let Some(src) = t.device_storage() else {
        return Ok(t.clone());
    };
    let dst = backend.alloc(src.dtype(), src.numel())?;
    backend.copy(&dst, src)?;
    Ok(Tensor::from_device_parts(Arc::new(dst), t.layout().clone()))
}

impl Recording {
    fn replay(&self, backend: &dyn DeviceBackend, args: &[Tensor]) -> Result<Vec<Tensor>> {
        for (fixed, arg) in self.inputs.iter().zip(args) {
            if let (Some(dst), Some(src)) = (fixed.device_storage(), arg.device_storage()) {
                if !Arc::ptr_eq(dst, src) {
                    backend.copy(dst, src)?;
                }
            }
        }
        self.graph.replay()?;
        self.outputs.iter().map(|t| copy_of(backend, t)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device input's key and a host scalar's of value `v`.
    fn signature(v: Option<f64>) -> Vec<ArgKey> {
        let input = ArgKey {
            device: Device::Cpu,
            dtype: DType::F32,
            shape: vec![4],
            strides: vec![1],
            offset: 0,
            storage_numel: Some(4),
            scalar: None,
        };
        let scalar = ArgKey {
            shape: vec![],
            strides: vec![],
            storage_numel: Some(1),
            scalar: v.map(f64::to_bits),
            ..input.clone()
        };
        vec![input, scalar]
    }

    fn steps(state: &mut State, key: &[ArgKey], n: usize) -> Vec<&'static str> {
        (0..n)
            .map(|_| {
                let step = state.step(key);
                // A recording needs a device: a normal entry stands in.
                if let Step::Record = step {
                    state
                        .entries
                        .insert(key.to_vec(), Entry::Normal("recorded".into()));
                }
                match step {
                    Step::Normal => "normal",
                    Step::Record => "record",
                    Step::Replay => "replay",
                }
            })
            .collect()
    }

    #[test]
    fn a_fixed_signature_warms_up_then_records() {
        let mut state = State::default();
        let key = signature(Some(0.5));
        assert_eq!(steps(&mut state, &key, 2), ["normal", "record"]);
    }

    #[test]
    fn a_scalar_that_changes_every_call_stops_recording_its_layout() {
        let mut state = State::default();
        for v in 0..MAX_SCALAR_VARIANTS {
            let key = signature(Some(v as f64));
            assert_eq!(
                steps(&mut state, &key, 2),
                ["normal", "record"],
                "value {v}"
            );
        }
        // One value too many: the layout runs normally from now on, its
        // recordings dropped, whatever the value (old ones too).
        let next = signature(Some(MAX_SCALAR_VARIANTS as f64));
        assert_eq!(steps(&mut state, &next, 3), ["normal"; 3]);
        assert_eq!(steps(&mut state, &signature(Some(0.0)), 2), ["normal"; 2]);
        assert_eq!(state.entries.len(), 1, "only the layout's entry is left");
        assert_eq!(state.stats.fallbacks, 1);
        let why = match state.entries.values().next() {
            Some(Entry::Normal(why)) => why.clone(),
            _ => panic!("a normal entry"),
        };
        assert!(why.contains("host scalars"), "{why}");
        // A signature without scalars is not affected.
        let mut plain = State::default();
        assert_eq!(steps(&mut plain, &signature(None), 2), ["normal", "record"]);
    }
}
