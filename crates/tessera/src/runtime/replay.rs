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

/// The recordings of one compiled program, by input signature.
#[derive(Default)]
pub struct Replayer {
    state: Mutex<(HashMap<Vec<ArgKey>, Entry>, ReplayStats)>,
}

impl Replayer {
    pub fn new() -> Replayer {
        Replayer::default()
    }

    pub fn stats(&self) -> ReplayStats {
        self.state.lock().expect("replayer poisoned").1
    }

    /// Why recording failed for the signatures that run normally.
    pub fn fallback_reasons(&self) -> Vec<String> {
        let state = self.state.lock().expect("replayer poisoned");
        state
            .0
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
        let mut guard = self.state.lock().expect("replayer poisoned");
        let (entries, stats) = &mut *guard;
        match entries.get(&key) {
            None => {
                entries.insert(key, Entry::Warm);
                stats.normal_runs += 1;
                run(args)
            }
            Some(Entry::Normal(_)) => {
                stats.normal_runs += 1;
                run(args)
            }
            Some(Entry::Recorded(r)) => {
                stats.replays += 1;
                r.replay(backend.as_ref(), args)
            }
            Some(Entry::Warm) => match record(backend.as_ref(), args, &run) {
                Ok(r) => {
                    stats.recordings += 1;
                    stats.replays += 1;
                    let out = r.replay(backend.as_ref(), args);
                    entries.insert(key, Entry::Recorded(r));
                    out
                }
                Err(e) => {
                    let why = e.message;
                    log("cudagraphs", || {
                        format!("not recorded, runs kernel by kernel: {why}")
                    });
                    stats.fallbacks += 1;
                    stats.normal_runs += 1;
                    entries.insert(key, Entry::Normal(why));
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
