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
//! 2. the second call runs the program while the device records instead of
//!    running, and keeps the graph with the inputs it reads and the outputs
//!    it writes. The planned arena makes every intermediate's address the
//!    same on each replay; the device allocator hands the capture's other
//!    temporaries to the graph, which owns them from then on;
//! 3. every call from then on puts its inputs where the graph reads them,
//!    replays it and returns its outputs.
//!
//! Inputs are recorded in one of two ways. Most are copied into buffers of
//! the recording, and every replay copies its inputs there; the outputs
//! are copied out (so that a later replay never overwrites what a caller
//! holds). A *donated* input whose storage the memory plan hands on to an
//! output (a training step's parameters and optimizer state, written over
//! by their new values) is recorded *in place*: the graph reads the
//! caller's own buffer and writes the output over it, the output is handed
//! out as it is, and when the caller donates it back on the next call
//! nothing is copied at all — the replay updates the step's state where it
//! lies, with no second copy of it. Should the caller still hold such a
//! buffer elsewhere (a clone of a returned output), a replay would write
//! over a value someone reads: that call runs normally instead.
//!
//! In-place recording needs the first call to have run without waiting
//! for the device (no synchronisation or download), which is what a
//! recording fails on: the donated buffers are then handed to the capture,
//! and a capture that failed midway would lose their values. Otherwise, and
//! for the inputs that do not live on in outputs, the copies are used.
//!
//! Where recording is impossible (an op synchronises with the host or
//! copies to it, e.g. a bounds check of indices, a value drawn on the host,
//! or a kernel on another stream that waits for the host) the capture fails
//! and that signature runs normally from then on; the reason is logged under
//! `TESSERA_LOGS=cudagraphs`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use super::device::{self, Device, DeviceBackend, DeviceGraph, DeviceStorage};
use super::layout::Layout;
use crate::error::{Error, Result};
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
    /// Ran once (without waiting for the device: `lend`); the next call
    /// records.
    Warm {
        lend: bool,
    },
    Recorded(Recording),
    /// Recording failed: runs normally, for this reason.
    Normal(String),
}

/// A graph with the inputs it reads and the outputs it writes. Fields drop
/// in order: the graph before the buffers it uses.
struct Recording {
    graph: Box<dyn DeviceGraph>,
    /// Per input, what the graph reads: a buffer of the recording, or the
    /// storage of an input recorded in place (`in_place`).
    inputs: Vec<Tensor>,
    in_place: Vec<bool>,
    outputs: Vec<Tensor>,
    /// Per output, whether it is written over an input recorded in place:
    /// handed out as it is, not copied.
    handed_out: Vec<bool>,
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
    /// The signature's first call: runs normally.
    Warm,
    Normal,
    Record {
        /// Whether donated inputs may be recorded in place.
        lend: bool,
    },
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
                self.entries
                    .insert(key.to_vec(), Entry::Warm { lend: false });
                Step::Warm
            }
            Some(Entry::Normal(_)) => Step::Normal,
            Some(Entry::Recorded(_)) => Step::Replay,
            Some(Entry::Warm { lend }) => Step::Record { lend: *lend },
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
    /// `in_place`: the positions of the donated inputs whose storage the
    /// program's memory plan hands on to an output (see the module docs).
    pub fn run(
        &self,
        args: Vec<Tensor>,
        in_place: &[usize],
        run: impl Fn(Vec<Tensor>) -> Result<Vec<Tensor>>,
    ) -> Result<Vec<Tensor>> {
        let refs: Vec<&Tensor> = args.iter().collect();
        let on = match device::of_inputs("input", &refs) {
            Ok(d) if d != Device::Cpu && !args.is_empty() => d,
            _ => return run(args),
        };
        drop(refs);
        let backend = device::device_backend(on)?;
        let key: Vec<ArgKey> = args.iter().map(ArgKey::of).collect();
        // Held throughout: replays share the static buffers.
        let mut guard = self.state.lock().expect("replayer poisoned");
        let state = &mut *guard;
        match state.step(&key) {
            Step::Warm => {
                state.stats.normal_runs += 1;
                let before = backend.host_waits();
                let out = run(args)?;
                let lend = backend.host_waits() == before;
                state.entries.insert(key, Entry::Warm { lend });
                Ok(out)
            }
            Step::Normal => {
                state.stats.normal_runs += 1;
                run(args)
            }
            Step::Replay => {
                let Some(Entry::Recorded(r)) = state.entries.get(&key) else {
                    unreachable!("a replayed signature has its recording")
                };
                match r.holders_besides(&args) {
                    None => {
                        let out = r.replay(backend.as_ref(), args);
                        state.stats.replays += 1;
                        out
                    }
                    Some(why) => {
                        log("cudagraphs", || {
                            format!("runs kernel by kernel once: {why}")
                        });
                        state.stats.normal_runs += 1;
                        run(args)
                    }
                }
            }
            Step::Record { lend } => {
                let in_place = if lend { in_place } else { &[] };
                match record(backend.as_ref(), args, in_place, &run) {
                    Ok((r, args)) => {
                        state.stats.recordings += 1;
                        state.stats.replays += 1;
                        let out = r.replay(backend.as_ref(), args);
                        state.entries.insert(key, Entry::Recorded(r));
                        out
                    }
                    Err(Failed { why, args }) => {
                        log("cudagraphs", || {
                            format!("not recorded, runs kernel by kernel: {why}")
                        });
                        state.stats.fallbacks += 1;
                        let reason = why.message.clone();
                        state.entries.insert(key, Entry::Normal(reason));
                        match args {
                            Some(args) => {
                                state.stats.normal_runs += 1;
                                run(args)
                            }
                            None => Err(why),
                        }
                    }
                }
            }
        }
    }
}

/// A recording that failed, and the call's arguments if they are intact.
struct Failed {
    why: Error,
    /// `None` when inputs handed to the capture in place were lost with it.
    args: Option<Vec<Tensor>>,
}

/// Records `run` on `args` (those at `in_place` positions that are their
/// buffer's only handle in place, the rest on copies); on success the
/// recording and the arguments for its first replay.
fn record(
    backend: &dyn DeviceBackend,
    args: Vec<Tensor>,
    in_place: &[usize],
    run: &impl Fn(Vec<Tensor>) -> Result<Vec<Tensor>>,
) -> std::result::Result<(Recording, Vec<Tensor>), Failed> {
    let lent: Vec<bool> = args
        .iter()
        .enumerate()
        .map(|(i, t)| in_place.contains(&i) && lendable(t))
        .collect();
    let copies = args
        .iter()
        .zip(&lent)
        .map(|(t, &lent)| (!lent).then(|| copy_of(backend, t)).transpose())
        .collect::<Result<Vec<Option<Tensor>>>>();
    let copies = match copies {
        Ok(c) => c,
        Err(why) => {
            return Err(Failed {
                why,
                args: Some(args),
            })
        }
    };
    // What the lent inputs were: their storage lives on in an output.
    let lent_parts: Vec<Option<(Weak<DeviceStorage>, Layout)>> = args
        .iter()
        .zip(&lent)
        .map(|(t, &lent)| {
            let owner = owner_of(t).filter(|_| lent)?;
            Some((Arc::downgrade(owner), t.layout().clone()))
        })
        .collect();
    let mut kept = Vec::with_capacity(args.len());
    let mut run_args = Vec::with_capacity(args.len());
    for (t, copy) in args.into_iter().zip(&copies) {
        match copy {
            Some(copy) => {
                run_args.push(copy.clone());
                kept.push(Some(t));
            }
            None => {
                run_args.push(t);
                kept.push(None);
            }
        }
    }
    let any_lent = lent.iter().any(|&l| l);
    // The arguments again, while the lent ones are alive: for a normal run
    // after a capture that failed, or for the first replay.
    let args_again = |kept: Vec<Option<Tensor>>| -> Option<Vec<Tensor>> {
        kept.into_iter()
            .zip(&lent_parts)
            .map(|(t, parts)| match (t, parts) {
                (Some(t), _) => Some(t),
                (None, Some((weak, layout))) => {
                    Some(Tensor::from_device_parts(weak.upgrade()?, layout.clone()))
                }
                (None, None) => None,
            })
            .collect()
    };
    if let Err(why) = backend.begin_capture() {
        return Err(Failed {
            why,
            args: args_again(kept),
        });
    }
    let outputs = run(run_args);
    // Always ends the capture, also when the run failed.
    let graph = backend.end_capture();
    let (outputs, graph) = match (outputs, graph) {
        (Ok(outputs), Ok(graph)) => (outputs, graph),
        (outputs, graph) => {
            // Nothing recorded ran: the lent buffers still hold the inputs,
            // if an output still holds them.
            let why = match (&outputs, graph) {
                (Err(e), _) => e.clone(),
                (Ok(_), Err(e)) => e,
                (Ok(_), Ok(_)) => unreachable!("matched above"),
            };
            let args = args_again(kept);
            drop(outputs);
            let why = match (&args, any_lent) {
                (None, _) => Error::new(
                    why.kind,
                    format!(
                        "recording the device graph failed after the donated inputs were handed \
                         to it, so their values are lost (a donating call that fails once started \
                         loses them): {}",
                        why.message
                    ),
                ),
                _ => why,
            };
            return Err(Failed { why, args });
        }
    };
    let Some(replay_args) = args_again(kept) else {
        // A lent buffer did not live on in an output: the plan said it
        // would. Its values are in the graph's blocks, which only this
        // first replay reads, so the recording is not kept.
        return Err(Failed {
            why: Error::new(
                crate::error::ErrorKind::Device,
                "a donated input recorded in place was not written over by an output".to_string(),
            ),
            args: None,
        });
    };
    let inputs: Vec<Tensor> = replay_args
        .iter()
        .zip(copies)
        .map(|(t, copy)| copy.unwrap_or_else(|| fresh_handle(t)))
        .collect();
    // An output written over a lent input is handed out on that input's
    // own storage (not the wrapper the kernel made), so that every handle
    // on those bytes counts on one storage (see `holders_besides`).
    let owners: Vec<&Arc<DeviceStorage>> = (inputs.iter().zip(&lent))
        .filter(|(_, &lent)| lent)
        .filter_map(|(t, _)| t.device_storage())
        .collect();
    let (outputs, handed_out): (Vec<Tensor>, Vec<bool>) = outputs
        .into_iter()
        .map(|o| {
            let owner = owners
                .iter()
                .find(|r| owner_of(&o).is_some_and(|x| Arc::ptr_eq(x, r)));
            match owner {
                Some(r) if r.dtype() == o.dtype() => (
                    Tensor::from_device_parts((*r).clone(), o.layout().clone()),
                    true,
                ),
                _ => (o, false),
            }
        })
        .unzip();
    log("cudagraphs", || {
        format!(
            "recorded: inputs {:?} in place (asked {in_place:?}), outputs {:?} handed out",
            (0..lent.len()).filter(|&i| lent[i]).collect::<Vec<_>>(),
            (0..handed_out.len())
                .filter(|&i| handed_out[i])
                .collect::<Vec<_>>()
        )
    });
    Ok((
        Recording {
            graph,
            inputs,
            in_place: lent,
            outputs,
            handed_out,
        },
        replay_args,
    ))
}

/// A handle of its own on `t`'s values (its own tensor, the same storage):
/// what the recording keeps and hands out, so that storage handles count
/// who holds a buffer.
fn fresh_handle(t: &Tensor) -> Tensor {
    match t.device_storage() {
        Some(s) => Tensor::from_device_parts(s.clone(), t.layout().clone()),
        None => t.clone(),
    }
}

/// The storage that owns `t`'s bytes: its own, or the one it was written
/// over (see [`DeviceStorage::over`]).
fn owner_of(t: &Tensor) -> Option<&Arc<DeviceStorage>> {
    let s = t.device_storage()?;
    Some(s.owner().unwrap_or(s))
}

/// Whether two tensors' bytes are one storage's.
fn same_owner(a: &Tensor, b: &Tensor) -> bool {
    matches!((owner_of(a), owner_of(b)), (Some(x), Some(y)) if Arc::ptr_eq(x, y))
}

/// Whether `t` is its only handle and reaches `owner`'s bytes once: on
/// `owner` itself (whose handles the caller counts), or on a storage
/// written over it that only `t` holds.
fn reaches_once(t: &Tensor, owner: &Arc<DeviceStorage>) -> bool {
    let Some(storage) = t.device_storage() else {
        return false;
    };
    t.is_only_handle() && (Arc::ptr_eq(storage, owner) || Arc::strong_count(storage) == 1)
}

/// Whether `t` may be recorded in place: its only handle, on bytes nothing
/// else reaches (its storage's own, or those of a storage only it holds),
/// of the owner's dtype and size (so that a tensor of its layout on the
/// owner is `t`).
fn lendable(t: &Tensor) -> bool {
    let (Some(storage), Some(owner)) = (t.device_storage(), owner_of(t)) else {
        return false;
    };
    let owner_reached_once = Arc::ptr_eq(storage, owner) || Arc::strong_count(owner) == 1;
    t.is_sole_dense_handle()
        && owner_reached_once
        && owner.dtype() == storage.dtype()
        && owner.numel() == storage.numel()
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
    /// The storage handles the recording itself holds on `storage`.
    fn own_handles(&self, storage: &Arc<DeviceStorage>) -> usize {
        self.inputs
            .iter()
            .chain(&self.outputs)
            .filter(|t| t.device_storage().is_some_and(|s| Arc::ptr_eq(s, storage)))
            .count()
    }

    /// Why a replay with `args` would write over a buffer someone else
    /// still holds (an input recorded in place, shared beyond `args` and
    /// the recording), or `None`.
    fn holders_besides(&self, args: &[Tensor]) -> Option<String> {
        for (i, (fixed, arg)) in self.inputs.iter().zip(args).enumerate() {
            let Some(dst) = fixed.device_storage().filter(|_| self.in_place[i]) else {
                continue;
            };
            // Passed back in: the argument reaches the bytes once, by itself
            // (on the storage handed out, or on one written over it that only
            // it holds).
            let passed_in = same_owner(fixed, arg);
            let expected = self.own_handles(dst) + usize::from(passed_in);
            let arg_shared = passed_in && !reaches_once(arg, dst);
            if Arc::strong_count(dst) != expected || arg_shared {
                return Some(format!(
                    "input {i} is recorded in place, and its buffer is still held elsewhere \
                     ({} handles on it, {expected} expected; passed in: {passed_in}, \
                     that handle shared: {arg_shared})",
                    Arc::strong_count(dst)
                ));
            }
        }
        None
    }

    fn replay(&self, backend: &dyn DeviceBackend, args: Vec<Tensor>) -> Result<Vec<Tensor>> {
        for (fixed, arg) in self.inputs.iter().zip(&args) {
            if let (Some(dst), Some(src)) = (fixed.device_storage(), arg.device_storage()) {
                if !same_owner(fixed, arg) {
                    backend.copy(dst, src)?;
                }
            }
        }
        self.graph.replay()?;
        drop(args);
        self.outputs
            .iter()
            .zip(&self.handed_out)
            .map(|(t, &handed_out)| match handed_out {
                true => Ok(fresh_handle(t)),
                false => copy_of(backend, t),
            })
            .collect()
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
                if let Step::Record { .. } = step {
                    state
                        .entries
                        .insert(key.to_vec(), Entry::Normal("recorded".into()));
                }
                match step {
                    Step::Warm | Step::Normal => "normal",
                    Step::Record { .. } => "record",
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
