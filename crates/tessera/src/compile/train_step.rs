//! The whole training step compiled: forward, loss, backward, gradient
//! clipping and the optimizer's update traced as ONE graph and compiled
//! by the ordinary pipeline (a [`Compiled`] function: guards, cache,
//! passes, fusion, schedule, memory plan), so that a training loop runs
//! one executable per step and nothing comes back to the host but the
//! loss, when asked for.
//!
//! ```text
//! inputs:  batch…, step scalars…, [lr, scale, good steps, skipped, counts…], parameters…, optimizer state…
//! graph:   loss = loss_fn(batch)          (the parameters stand in as leaves)
//!          grads = autograd::grad(loss [· scale], parameters)   (inside the trace)
//!          [grads = grads · 1/scale; found_inf = any(!isfinite(grads))]
//!          [norm, grads = clip(grads)]
//!          parameters', state' = optimizer.update(parameters, grads, state, scalars)
//!          [parameters', state' = where(found_inf, parameters, state | parameters', state');
//!           scale', good steps', skipped', counts' as GradScaler::update]
//! outputs: loss, [norm], [scale', good steps', skipped', counts'…], parameters'…, state'…
//! ```
//!
//! - **Parameters are inputs.** While `loss_fn` is traced, each
//!   [`Parameter`] of the optimizer holds the graph input of its value (a
//!   leaf that requires grad), so the model reads it where it reads its
//!   weights; the original values are put back right after, also when
//!   `loss_fn` panics. The gradients are the eager engine's
//!   ([`autograd::grad`]) run on the traced tensors under
//!   [`enable_grad`] (compile's capture traces under `no_grad`), so the
//!   backward ops are part of the graph and the executable itself is
//!   forward-only: no AOT split, the whole step goes through passes and
//!   fusion together.
//! - **Per-step hyper-parameters are inputs.** The learning rate (and
//!   AdamW's bias corrections, which depend on the step count) enter as
//!   0-dim tensors computed on the host in f64 exactly as the eager
//!   optimizer computes them ([`TraceableOptimizer::step_scalars`]), so one
//!   executable serves a whole run with a learning-rate schedule.
//!   Parameters whose scalars are equal share them (normally: all).
//! - **The optimizer's arithmetic is the eager one.** The update is
//!   [`TraceableOptimizer::update`], the function the eager `step` runs,
//!   with tensors for scalars; clipping is [`global_grad_norm`] and
//!   [`clip_factor`], which the eager [`crate::optim::clip_grad_norm`]
//!   runs. The state starts as zeros, from which the update computes what
//!   the eager first step computes.
//! - **Results are installed without copies.** The new values go into the
//!   parameters' slots with [`Parameter::set`], which shares the output's
//!   buffer (no copy; on a device nothing moves to the host), and the new
//!   state into the optimizer ([`TraceableOptimizer::advance`]).
//! - **Parameters and state are updated in place (buffer donation).** By
//!   default ([`TrainStep::donate`]) the step takes the parameters' values
//!   and the optimizer's state out of their slots
//!   ([`TraceableOptimizer::take_state`]; the slots hold empty
//!   placeholders meanwhile) and hands them to the executable by value
//!   ([`Compiled::try_call_donating`]), so it holds their only handles:
//!   each update kernel writes its new value, m and v over the old ones
//!   (a weight's matmul-epilogue update writes one of them into its
//!   gradient's product instead, and the old weight is freed right after
//!   its last read). Without donation two copies of every parameter and
//!   state tensor are alive at the end of the step; with it, about one:
//!   on issue 17's GPT (3.7M parameters, AdamW) the step's memory plan
//!   needs 122.8 MB instead of 166.3 MB for a run. Values are bit for bit
//!   those of the step without donation. A parameter whose value the
//!   caller still holds elsewhere (a clone) is read, not written over.
//!   If the step fails before the executable starts (a bad loss, a trace,
//!   guard or compile error, a panic of the loss function), everything is
//!   put back as it was. Once it has started, a failure (out of memory, a
//!   device error: the batch's data errors happen in the forward, before
//!   any update) loses the values handed over, and the error says so;
//!   `donate(false)` keeps them.
//!
//! - **f16 loss scaling on the device** ([`TrainStep::loss_scaler`]).
//!   The dynamic loss scaler of [`crate::optim::GradScaler`] runs inside
//!   the step: its scale, its count of good steps in a row and its count
//!   of skipped steps are 0-dim f64 tensors on the parameters' device,
//!   inputs of each step and outputs of it, so no step reads anything back
//!   (the scale is read only when asked, [`TrainStep::loss_scale`],
//!   [`TrainStep::skipped_steps`]). The traced step multiplies the loss by
//!   the scale ([`crate::optim::scale_loss`]), unscales the gradients and
//!   checks them in one reduction per gradient
//!   ([`crate::optim::unscale_grads`]), clips the unscaled ones, and
//!   selects every new parameter and state tensor with
//!   `where(found_inf, old, new)`: a step with an inf or a NaN gradient
//!   changes no bit, as the eager `GradScaler::step` skips the optimizer.
//!   The next scale is [`crate::optim::next_scale`], `GradScaler::update`'s
//!   arithmetic. The values are eager's (the scale sequence and skipped
//!   steps exactly; with the uncompiled backend the losses bit for bit).
//!   These scalars are not donated: 8 bytes each, nothing to gain.
//! - **Step counts on the device under a scaler.** A skipped step is no
//!   step of the optimizer (PyTorch's `optimizer.step` is not called), so
//!   AdamW's bias corrections must not count it — but only the device
//!   knows whether a step was skipped, and reading that back would stall
//!   every step. So with a scaler the step counts live on the device too,
//!   as PyTorch's fused AdamW keeps its `step` tensor under a GradScaler:
//!   one 0-dim f64 count per class of parameters that took the same steps
//!   (normally one for all), advanced by 1 − found_inf; the step's scalars
//!   are computed in the graph from it and the learning rate (an f64
//!   input) by [`TraceableOptimizer::counted_step_scalars`], in f64 and
//!   then cast, as the host computes them (`βᵗ` is an f64 `pow` where the
//!   host takes `powi`: at most an f64 ulp apart). The cost: a handful of
//!   scalar ops per class in the graph, no host round trip. The optimizer
//!   gets the counts back in [`TrainStep::into_optimizer`]; until then its
//!   own counts include the skipped steps.
//!
//! - **Data parallel** ([`TrainStep::data_parallel`], [`DataParallel`]).
//!   Each rank of a [`ProcessGroup`] traces the same step on its share of
//!   the batch; the graph averages the loss and the gradients over the
//!   ranks with `tessera::all_reduce` nodes, one per bucket of gradients
//!   ([`buckets`]: reverse parameter order, 25 MiB), traced under a
//!   `stream` hint so that the schedule runs each beside the rest of the
//!   backward, and chained (each call orders after the one before) so
//!   that every rank makes its calls in one order, as NCCL requires.
//!   Without clipping or a loss scaler (which need every gradient first)
//!   each parameter's update is on that stream too, behind its bucket's
//!   reduction: the optimizer step overlaps the backward as well. With
//!   ZeRO-1 each rank updates only the parameters it owns (whole buckets,
//!   [`bucket_owners`]), keeps an empty state for the others and
//!   broadcasts its new values on the same stream: without clipping or a
//!   scaler each bucket is reduced to its owner alone (`reduce`, not
//!   `all_reduce`: with the broadcast, one all-reduce's traffic), updated
//!   and broadcast right after (one chain of calls: bucket b's reduce, its
//!   owner's broadcast, bucket b + 1's …), so that the broadcasts overlap
//!   the backward too; otherwise every bucket is all-reduced and the
//!   broadcasts follow the last.
//!   Before the first step the parameters are broadcast from rank 0.
//!
//! Parameters without a gradient in the traced step (unused by the loss)
//! keep their value and state, as in the eager step. Tensors the model
//! uses that are not the optimizer's parameters are constants of the step
//! (lifted inputs); should one require grad, the executable also gets a
//! backward for it, which nothing runs.
//!
//! While a step traces, the optimizer's parameters hold graph values:
//! another thread must not run the model at the same time.

use super::raised::{catching, raise};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{compile, Backend, CompileStats, Compiled, Mode};
use crate::autograd::{self, enable_grad, no_grad};
use crate::dist::{bucket_owners, buckets, Kind, ProcessGroup, ReduceOp};
use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::ir::{DType, TensorType};
use crate::nn::Parameter;
use crate::optim::{
    clip_factor, global_grad_norm, next_scale, scale_loss, unscale_grads, GradScalerConfig,
    TraceableOptimizer,
};
use crate::runtime::device::{with_device, Device};
use crate::schedule::Strategy;
use crate::tensor::{autocast, Tensor};

/// The traced function of a [`TrainStep`]: step inputs to step outputs.
pub type StepFn<'a> = Box<dyn Fn(&[Tensor]) -> Vec<Tensor> + 'a>;

/// A training step compiled whole; made by [`train_step`], run with
/// [`TrainStep::step`].
pub struct TrainStep<'a, O: TraceableOptimizer> {
    compiled: Compiled<StepFn<'a>>,
    shared: Arc<Shared<O>>,
    max_grad_norm: Option<f64>,
    last_grad_norm: Option<Tensor>,
    /// Hand the parameters and state over to the executable (the default).
    donate: bool,
    /// The dynamic loss scaler, when on ([`TrainStep::loss_scaler`]).
    scaler: Option<Scaler>,
    /// Whether the parameters were broadcast from rank 0 (data parallel).
    synced: bool,
}

/// Data-parallel training ([`TrainStep::data_parallel`]): the group, how
/// gradients are bucketed and where their collectives run, and whether
/// the optimizer's state is sharded (ZeRO-1).
#[derive(Clone, Debug)]
pub struct DataParallel {
    pub group: ProcessGroup,
    /// A bucket's most bytes of gradients (PyTorch DDP's 25 MiB).
    pub bucket_bytes: usize,
    /// The stream hint of the collectives (`None`: the hints in force
    /// where the step is traced place them).
    pub stream: Option<i64>,
    /// Each rank keeps the optimizer state of its own parameters only
    /// ([`bucket_owners`]), updates them and broadcasts their new values.
    pub zero: bool,
}

impl DataParallel {
    /// Data parallel over `group`: 25 MiB buckets on stream 1, no sharding.
    pub fn new(group: ProcessGroup) -> DataParallel {
        DataParallel {
            group,
            bucket_bytes: 25 << 20,
            stream: Some(1),
            zero: false,
        }
    }

    /// Shards the optimizer's state over the ranks (ZeRO-1).
    pub fn zero(mut self, on: bool) -> DataParallel {
        self.zero = on;
        self
    }

    pub fn bucket_bytes(mut self, bytes: usize) -> DataParallel {
        self.bucket_bytes = bytes;
        self
    }

    pub fn stream(mut self, stream: Option<i64>) -> DataParallel {
        self.stream = stream;
        self
    }
}

/// The loss scaler of a step: its settings and its state, 0-dim f64
/// tensors on the parameters' device that each step takes as inputs and
/// gives back updated (created on the first step).
struct Scaler {
    config: GradScalerConfig,
    state: Option<ScalerState>,
}

#[derive(Clone)]
struct ScalerState {
    scale: Tensor,
    /// Good steps in a row (the growth tracker).
    good_steps: Tensor,
    /// Steps skipped so far.
    skipped: Tensor,
    /// Steps taken, per class of parameters that took the same steps.
    counts: Vec<Tensor>,
    /// Per parameter, its class in `counts`.
    count_of: Vec<usize>,
}

/// What the traced function and the step share.
struct Shared<O> {
    optimizer: Mutex<O>,
    /// How the inputs of the call under way are laid out.
    layout: Mutex<Layout>,
    /// Per parameter, whether the last traced step gave it a gradient.
    has_grad: Mutex<Vec<bool>>,
    /// Data parallel, when on.
    dp: Mutex<Option<DataParallel>>,
}

/// The order of a step's inputs (after the batch): the scalar groups'
/// scalars, the parameters' values, then their state.
#[derive(Clone, Debug, Default)]
struct Layout {
    n_batch: usize,
    /// Per parameter, its scalar group.
    group_of: Vec<usize>,
    n_groups: usize,
    /// Scalars per group.
    n_scalars: usize,
    /// State tensors per parameter.
    state_len: usize,
    max_grad_norm: Option<f64>,
    /// With a loss scaler: its settings and each parameter's step-count
    /// class (then there are no scalar groups: the scalars are computed
    /// in the step from the learning rate and the counts).
    scaler: Option<ScaledLayout>,
    /// With a sharded optimizer: each parameter's owner (its state is
    /// empty on every other rank).
    owner: Option<Vec<usize>>,
}

#[derive(Clone, Debug)]
struct ScaledLayout {
    config: GradScalerConfig,
    count_of: Vec<usize>,
    n_counts: usize,
}

impl ScaledLayout {
    /// The learning rate, the scale, the good steps, the skipped steps and
    /// the counts.
    fn n_inputs(&self) -> usize {
        4 + self.n_counts
    }

    /// The scale, the good steps, the skipped steps and the counts.
    fn n_outputs(&self) -> usize {
        3 + self.n_counts
    }
}

impl Layout {
    /// Parameter `i`'s optimizer scalars (its group's) among the step's.
    fn scalars_of<'s>(&self, scalars: &'s [Tensor], i: usize) -> &'s [Tensor] {
        let group = self.group_of[i] * self.n_scalars;
        &scalars[group..group + self.n_scalars]
    }

    fn n_inputs(&self, n_params: usize) -> usize {
        self.n_batch
            + self.n_groups * self.n_scalars
            + self.scaler.as_ref().map_or(0, ScaledLayout::n_inputs)
            + n_params * (1 + self.state_len)
    }

    fn n_outputs(&self, n_params: usize) -> usize {
        1 + usize::from(self.max_grad_norm.is_some())
            + self.scaler.as_ref().map_or(0, ScaledLayout::n_outputs)
            + n_params * (1 + self.state_len)
    }
}

/// Compiles the training step of `loss_fn` (the batch tensors to a float
/// scalar loss, through modules whose parameters `optimizer` updates):
/// each [`TrainStep::step`] computes the loss, the gradients of every
/// parameter, optionally clips them ([`TrainStep::clip_grad_norm`]) and
/// applies `optimizer`'s update, as one compiled graph — what
/// `zero_grad(); loss.backward(); clip_grad_norm(…); step()` computes
/// eagerly.
///
/// ```
/// use tessera::compile::train_step;
/// use tessera::nn::{mse, Linear, ParamStore};
/// use tessera::optim::{Optimizer, Sgd, SgdConfig};
/// use tessera::tensor::Generator;
/// use tessera::{DType, Tensor};
///
/// let (mut store, mut g) = (ParamStore::new(), Generator::new(0));
/// let layer = Linear::new(&mut store, "fc", 4, 1, true, &mut g);
/// let sgd = Sgd::new(store.parameters(), SgdConfig { lr: 0.1, ..SgdConfig::default() });
/// let mut step = train_step(|b: &[Tensor]| mse(&layer.forward(&b[0]), &b[1]), sgd);
/// let (x, y) = (Tensor::ones(&[8, 4], DType::F32), Tensor::zeros(&[8, 1], DType::F32));
/// for i in 0..3 {
///     step.optimizer().set_lr(0.1 / (i + 1) as f64); // an input: no recompile
///     let loss = step.step(&[x.clone(), y.clone()]);
///     assert!(loss.item().is_finite());
/// }
/// assert_eq!(step.stats().compiles, 1);
/// ```
#[track_caller]
pub fn train_step<'a, L, O>(loss_fn: L, optimizer: O) -> TrainStep<'a, O>
where
    L: Fn(&[Tensor]) -> Tensor + 'a,
    O: TraceableOptimizer + 'a,
{
    let shared = Arc::new(Shared {
        optimizer: Mutex::new(optimizer),
        layout: Mutex::new(Layout::default()),
        has_grad: Mutex::new(Vec::new()),
        dp: Mutex::new(None),
    });
    let inner = shared.clone();
    let f: StepFn<'a> = Box::new(
        move |args: &[Tensor]| match step_graph(&inner, &loss_fn, args) {
            Ok(outputs) => outputs,
            Err(e) => raise(e),
        },
    );
    TrainStep {
        compiled: compile(f),
        shared,
        max_grad_norm: None,
        last_grad_norm: None,
        donate: true,
        scaler: None,
        synced: false,
    }
}

impl<'a, O: TraceableOptimizer> TrainStep<'a, O> {
    /// Clips the gradients to a global L2 norm of at most `max_norm` before
    /// the update (as [`crate::optim::clip_grad_norm`]); the norm before
    /// clipping is then [`TrainStep::last_grad_norm`].
    pub fn clip_grad_norm(mut self, max_norm: f64) -> Self {
        self.max_grad_norm = Some(max_norm);
        self
    }

    /// Whether the step hands the parameters' values and the optimizer's
    /// state over to the executable, which writes their new values over
    /// them (the default; see the module docs). Off, it reads them as the
    /// caller's and allocates the new ones: one more copy of both while it
    /// runs, and a failure mid-run leaves every parameter as it was.
    pub fn donate(mut self, on: bool) -> Self {
        self.donate = on;
        self
    }

    /// Trains with a dynamic loss scaler (for f16 autocast), as
    /// [`crate::optim::GradScaler`] does eagerly, inside the compiled
    /// step: the loss is multiplied by the scale before the gradients, the
    /// gradients divided by it again (before clipping), a step whose
    /// gradients hold an inf or a NaN changes no parameter and no state
    /// (and does not count as a step of the optimizer), and the scale
    /// adapts — all on the device, nothing read back (see the module docs).
    /// The configuration is checked by the first step.
    pub fn loss_scaler(mut self, config: GradScalerConfig) -> Self {
        self.scaler = Some(Scaler {
            config,
            state: None,
        });
        self
    }

    /// Trains data-parallel: each rank (a thread or process of `dp.group`)
    /// runs this step on its own share of the batch; the first step
    /// broadcasts the parameters from rank 0; each step averages the
    /// gradients over the ranks — bucketed in reverse parameter order, one
    /// `tessera::all_reduce` node per bucket, placed by the `stream` hint
    /// so that a bucket's reduction runs while the rest of the backward
    /// does — and the loss (so every rank returns the global batch's mean
    /// loss when the ranks' batches are equal). With `dp.zero`, each rank
    /// keeps the optimizer state of the parameters it owns only, updates
    /// those, and broadcasts their new values (ZeRO-1).
    pub fn data_parallel(self, dp: DataParallel) -> Self {
        *lock(&self.shared.dp) = Some(dp);
        self
    }

    /// The loss scale the next step uses (the configuration's initial
    /// scale before the first step), read from the device; `None` without
    /// a loss scaler.
    pub fn loss_scale(&self) -> Result<Option<f64>> {
        let Some(scaler) = &self.scaler else {
            return Ok(None);
        };
        match &scaler.state {
            Some(state) => Ok(Some(read_scalar(&state.scale)?)),
            None => Ok(Some(scaler.config.init_scale)),
        }
    }

    /// How many steps the loss scaler skipped so far (their gradients were
    /// not finite), read from the device; `None` without a loss scaler.
    pub fn skipped_steps(&self) -> Result<Option<usize>> {
        let Some(scaler) = &self.scaler else {
            return Ok(None);
        };
        match &scaler.state {
            Some(state) => Ok(Some(read_scalar(&state.skipped)? as usize)),
            None => Ok(Some(0)),
        }
    }

    /// Runs one step on `batch` (the arguments of the loss function):
    /// updates the parameters and the optimizer's state and returns the
    /// loss (a 0-dim tensor on the parameters' device). Panics with the
    /// error, like an eager op.
    #[track_caller]
    pub fn step(&mut self, batch: &[Tensor]) -> Tensor {
        match self.try_step(batch) {
            Ok(loss) => loss,
            Err(e) => panic!("{}", e.at(SourceLoc::caller())),
        }
    }

    /// [`TrainStep::step`], returning the error (a loss that is not a float
    /// scalar, one that no parameter influences, a compile or run error)
    /// instead of panicking. Panics of the loss function pass on.
    pub fn try_step(&mut self, batch: &[Tensor]) -> Result<Tensor> {
        if let Some(max) = self.max_grad_norm.filter(|m| m.is_nan() || *m < 0.0) {
            return Err(Error::op(
                ErrorKind::Argument,
                "train_step",
                format!("clip_grad_norm needs a max norm >= 0, got {max}"),
            ));
        }
        if let Some(scaler) = &self.scaler {
            scaler.config.validate().map_err(|e| {
                Error::op(
                    ErrorKind::Argument,
                    "train_step",
                    format!("loss_scaler: {}", e.message),
                )
            })?;
        }
        self.sync_parameters()?;
        let (inputs, layout, params, taken) = self.inputs(batch)?;
        let n = params.len();
        *lock(&self.shared.layout) = layout.clone();
        let first = layout.n_inputs(n) - n * (1 + layout.state_len);
        let types: Vec<TensorType> = inputs[first..].iter().map(Tensor::ty).collect();
        let mut lent = Lent {
            args: inputs,
            first,
            params: &params,
            state_len: layout.state_len,
            optimizer: &self.shared.optimizer,
            donated: taken,
        };
        // Each parameter and state tensor handed over becomes the output
        // in its place among the step's last outputs (same order).
        let first_out = layout.n_outputs(n) - n * (1 + layout.state_len);
        let updates: Vec<(usize, usize)> = match taken {
            true => (first..lent.args.len())
                .map(|i| (i, first_out + i - first))
                .collect(),
            false => Vec::new(),
        };
        let compiled = &self.compiled;
        let called = catching(|| compiled.try_call_updating(&mut lent.args, &updates));
        let started = lent.args.is_empty();
        // Not started: everything back where it was (also on a panic).
        drop(lent);
        let mut outputs = called.map_err(|mut e| {
            if started && taken {
                e.message = format!(
                    "{} (the step failed while running: the parameters and optimizer state \
                     it was handed may be partly overwritten and are lost; \
                     `TrainStep::donate(false)` keeps them)",
                    e.message
                );
            }
            e
        })?;
        if outputs.len() != layout.n_outputs(n) {
            return Err(Error::new(
                ErrorKind::Verify,
                format!(
                    "train_step: the step gave {} outputs, expected {}",
                    outputs.len(),
                    layout.n_outputs(n)
                ),
            ));
        }
        let mut states = outputs.split_off(outputs.len() - n * layout.state_len);
        let values = outputs.split_off(outputs.len() - n);
        let scaled = outputs
            .split_off(outputs.len() - layout.scaler.as_ref().map_or(0, ScaledLayout::n_outputs));
        let loss = outputs.remove(0);
        self.last_grad_norm = outputs.pop();
        let has_grad = lock(&self.shared.has_grad).clone();
        if let Some(scaler) = &mut self.scaler {
            scaler.advance(scaled, &has_grad)?;
        }
        let mut optimizer = lock(&self.shared.optimizer);
        for (o, (t, want)) in values.iter().chain(&states).zip(&types).enumerate() {
            if t.ty() != *want {
                return Err(Error::new(
                    ErrorKind::Verify,
                    format!(
                        "train_step: output {o} of the parameters and state is {}, expected {want}",
                        t.ty()
                    ),
                ));
            }
        }
        for (i, (param, value)) in params.iter().zip(values).enumerate().rev() {
            let state = states.split_off(i * layout.state_len);
            let donated = taken;
            match has_grad.get(i).copied().unwrap_or(false) {
                true if donated => {
                    param.install(&value);
                    optimizer.advance(i, state)?;
                }
                true => {
                    param.try_set(&value)?;
                    optimizer.advance(i, state)?;
                }
                // Handed over and given back unchanged (the outputs are the
                // inputs).
                false if donated => {
                    param.install(&value);
                    optimizer.restore_state(i, state);
                }
                false => {}
            }
        }
        Ok(loss)
    }

    /// Data parallel: before the first step, every rank's parameters
    /// become rank 0's (one broadcast of them all).
    fn sync_parameters(&mut self) -> Result<()> {
        let dp = lock(&self.shared.dp).clone();
        let Some(dp) = dp.filter(|_| !self.synced) else {
            return Ok(());
        };
        let params = lock(&self.shared.optimizer).params().to_vec();
        let values: Vec<Tensor> = params.iter().map(|p| p.get().detach()).collect();
        let refs: Vec<&Tensor> = values.iter().collect();
        let synced = no_grad(|| {
            dp.group
                .collective(Kind::Broadcast { root: 0 }, TAG_SYNC, &refs)
        })?;
        for (p, v) in params.iter().zip(&synced) {
            p.try_set(v)?;
        }
        self.synced = true;
        Ok(())
    }

    /// The step's inputs for `batch`: the batch, the scalar groups, the
    /// parameters' values and the optimizer's state — when donating, taken
    /// out of the parameters and the optimizer (see [`Lent`]), after every
    /// check that can fail.
    #[allow(clippy::type_complexity)]
    fn inputs(&mut self, batch: &[Tensor]) -> Result<(Vec<Tensor>, Layout, Vec<Parameter>, bool)> {
        let mut optimizer = lock(&self.shared.optimizer);
        let params = optimizer.params().to_vec();
        let state_len = optimizer.state_len();
        let mut inputs: Vec<Tensor> = batch.iter().map(Tensor::detach).collect();
        let mut groups: Vec<(DType, Device, Vec<u64>)> = Vec::new();
        let mut group_of = Vec::with_capacity(params.len());
        let mut values = Vec::with_capacity(params.len());
        let scaled = self.scaler.is_some();
        for (i, param) in params.iter().enumerate() {
            let value = param.get().detach();
            if scaled {
                // The scalars are computed in the step (from the device's
                // step counts): no host groups.
                values.push(value);
                continue;
            }
            let scalars: Vec<u64> = optimizer
                .step_scalars(i)
                .into_iter()
                .map(f64::to_bits)
                .collect();
            let key = (value.dtype(), value.device(), scalars);
            let group = match groups.iter().position(|g| *g == key) {
                Some(at) => at,
                None => {
                    groups.push(key);
                    groups.len() - 1
                }
            };
            group_of.push(group);
            values.push(value);
        }
        let n_scalars = groups.first().map_or(0, |g| g.2.len());
        if groups.iter().any(|g| g.2.len() != n_scalars) {
            return Err(Error::op(
                ErrorKind::Argument,
                "train_step",
                "the optimizer gives its parameters different numbers of step scalars",
            ));
        }
        for (dtype, device, scalars) in &groups {
            for &bits in scalars {
                let v = f64::from_bits(bits);
                inputs.push(with_device(*device, || Tensor::try_full(&[], v, *dtype))?);
            }
        }
        let scaled = match &mut self.scaler {
            Some(scaler) => {
                let config = scaler.config.clone();
                let state = scaler.prepare(&*optimizer, &values)?;
                let lr = with_device(state.scale.device(), || {
                    Tensor::try_full(&[], optimizer.lr(), DType::F64)
                })?;
                inputs.push(lr);
                inputs.extend([&state.scale, &state.good_steps, &state.skipped].map(Tensor::clone));
                inputs.extend(state.counts.iter().cloned());
                Some(ScaledLayout {
                    config,
                    count_of: state.count_of.clone(),
                    n_counts: state.counts.len(),
                })
            }
            None => None,
        };
        for (i, param) in params.iter().enumerate() {
            let state = optimizer.state(i);
            if state.len() != state_len {
                return Err(Error::op(
                    ErrorKind::Argument,
                    "train_step",
                    format!(
                        "the optimizer gave {} state tensors for `{}`, expected {state_len}",
                        state.len(),
                        param.name()
                    ),
                ));
            }
        }
        let owner = lock(&self.shared.dp)
            .as_ref()
            .filter(|dp| dp.zero)
            .map(|dp| {
                let sizes = param_bytes(&params);
                let owner = bucket_owners(&sizes, dp.bucket_bytes, dp.group.world());
                (dp.group.rank(), owner)
            });
        let taken = self.donate && !has_duplicates(&params);
        let first_state = inputs.len() + params.len();
        if taken {
            drop(values);
            // The state first: before its first step it is zeros of the
            // parameter's type, which `take_state` reads from the parameter.
            let states: Vec<Vec<Tensor>> =
                (0..params.len()).map(|i| optimizer.take_state(i)).collect();
            inputs.extend(params.iter().map(Parameter::take));
            inputs.extend(states.into_iter().flatten().map(|t| t.detach()));
        } else {
            inputs.extend(values);
            for i in 0..params.len() {
                inputs.extend(optimizer.state(i).iter().map(Tensor::detach));
            }
        }
        if let Some((rank, owner)) = &owner {
            for (i, _) in owner.iter().enumerate().filter(|(_, o)| *o != rank) {
                for s in 0..state_len {
                    let at = first_state + i * state_len + s;
                    // After the first step the state given back is empty
                    // already: no new tensor (and no device allocation)
                    // per state tensor per step.
                    if inputs[at].numel() != 0 {
                        inputs[at] = unowned_state(&inputs[at]);
                    }
                }
            }
        }
        let layout = Layout {
            n_batch: batch.len(),
            group_of,
            n_groups: groups.len(),
            n_scalars,
            state_len,
            max_grad_norm: self.max_grad_norm,
            scaler: scaled,
            owner: owner.map(|(_, o)| o),
        };
        debug_assert_eq!(inputs.len(), layout.n_inputs(params.len()));
        Ok((inputs, layout, params, taken))
    }

    /// The optimizer (e.g. to change its learning rate: an input of the
    /// step, so no recompile). With a loss scaler its step counts include
    /// the skipped steps until [`TrainStep::into_optimizer`] (see the
    /// module docs).
    pub fn optimizer(&self) -> MutexGuard<'_, O> {
        lock(&self.shared.optimizer)
    }

    /// The optimizer back, with the state the steps gave it.
    ///
    /// With a loss scaler, the steps each parameter has taken are counted
    /// on the device (a skipped step does not count) and read back here
    /// into the optimizer ([`TraceableOptimizer::set_steps_taken`]): until
    /// then the optimizer's own counts, as [`TrainStep::optimizer`] shows
    /// them, include the skipped steps. Panics if the device cannot be
    /// read.
    pub fn into_optimizer(self) -> O {
        let TrainStep {
            compiled,
            shared,
            scaler,
            ..
        } = self;
        // The traced function holds the other handle.
        drop(compiled);
        let mut optimizer = match Arc::try_unwrap(shared) {
            Ok(shared) => shared
                .optimizer
                .into_inner()
                .unwrap_or_else(|e| e.into_inner()),
            Err(_) => unreachable!("the compiled function was the only other owner"),
        };
        if let Some(state) = scaler.and_then(|s| s.state) {
            for (i, &class) in state.count_of.iter().enumerate() {
                let steps = read_scalar(&state.counts[class])
                    .unwrap_or_else(|e| panic!("train_step: reading the step counts: {e}"));
                optimizer.set_steps_taken(i, steps as u64);
            }
        }
        optimizer
    }

    /// The global gradient norm before clipping of the last step (an f64
    /// 0-dim tensor on the parameters' device), when clipping.
    pub fn last_grad_norm(&self) -> Option<&Tensor> {
        self.last_grad_norm.as_ref()
    }

    pub fn stats(&self) -> CompileStats {
        self.compiled.stats()
    }

    /// What the device-graph replay of `mode=reduce-overhead` did (see
    /// [`Compiled::replay_stats`]).
    pub fn replay_stats(&self) -> crate::runtime::replay::ReplayStats {
        self.compiled.replay_stats()
    }

    /// Why each recompile happened.
    pub fn recompile_reasons(&self) -> Vec<String> {
        self.compiled.recompile_reasons()
    }

    /// The compiled step's artifacts: its graph after the passes
    /// (`forward.tir`: the whole step is one forward graph), kernels,
    /// schedule and memory plan (see [`Compiled::last_artifacts`]).
    pub fn last_artifacts(&self) -> Vec<(String, String)> {
        self.compiled.last_artifacts()
    }

    pub fn backend(mut self, backend: Backend) -> Self {
        self.compiled = self.compiled.backend(backend);
        self
    }

    /// `Mode::ReduceOverhead` skips the trace when the inputs' guards match
    /// (the step's graph must then depend on nothing else).
    pub fn mode(mut self, mode: Mode) -> Self {
        self.compiled = self.compiled.mode(mode);
        self
    }

    /// Whether each step traces `loss_fn` to find its executable (the
    /// default); `false` runs the cached executable of matching inputs
    /// without a trace (see [`Compiled::retrace`]): for a loss function
    /// whose ops depend on nothing but its inputs' types and layouts, it
    /// saves the trace's host time each step.
    pub fn retrace(mut self, on: bool) -> Self {
        self.compiled = self.compiled.retrace(on);
        self
    }

    pub fn schedule(mut self, strategy: Strategy) -> Self {
        self.compiled = self.compiled.schedule(strategy);
        self
    }

    pub fn fullgraph(mut self, on: bool) -> Self {
        self.compiled = self.compiled.fullgraph(on);
        self
    }

    pub fn dynamic(mut self, dynamic: Option<bool>) -> Self {
        self.compiled = self.compiled.dynamic(dynamic);
        self
    }

    pub fn memory_budget(mut self, bytes: usize) -> Self {
        self.compiled = self.compiled.memory_budget(bytes);
        self
    }

    pub fn speculate(mut self, on: Option<bool>) -> Self {
        self.compiled = self.compiled.speculate(on);
        self
    }

    pub fn name(mut self, name: &str) -> Self {
        self.compiled = self.compiled.name(name);
        self
    }
}

impl Scaler {
    /// The state for the next step: made on the first (the initial scale,
    /// no good or skipped steps, the optimizer's step counts on the
    /// parameters' device, whose `values` these are).
    fn prepare<O: TraceableOptimizer>(
        &mut self,
        optimizer: &O,
        values: &[Tensor],
    ) -> Result<&ScalerState> {
        if let Some(state) = &self.state {
            if state.count_of.len() == values.len() {
                return Ok(self.state.as_ref().expect("checked"));
            }
            return Err(Error::op(
                ErrorKind::Argument,
                "train_step",
                format!(
                    "the optimizer has {} parameters, the loss scaler counts steps of {}",
                    values.len(),
                    state.count_of.len()
                ),
            ));
        }
        let device = values.first().map_or(Device::Cpu, Tensor::device);
        if let Some(other) = values.iter().find(|v| v.device() != device) {
            return Err(Error::op(
                ErrorKind::Argument,
                "train_step",
                format!(
                    "the loss scaler needs every parameter on one device, got {} and {}",
                    device.name(),
                    other.device().name()
                ),
            ));
        }
        let scalar = |v: f64| with_device(device, || Tensor::try_full(&[], v, DType::F64));
        let mut classes: Vec<u64> = Vec::new();
        let mut count_of = Vec::with_capacity(values.len());
        for i in 0..values.len() {
            let steps = optimizer.steps_taken(i);
            let class = match classes.iter().position(|&c| c == steps) {
                Some(at) => at,
                None => {
                    classes.push(steps);
                    classes.len() - 1
                }
            };
            count_of.push(class);
        }
        let state = ScalerState {
            scale: scalar(self.config.init_scale)?,
            good_steps: scalar(0.0)?,
            skipped: scalar(0.0)?,
            counts: classes
                .iter()
                .map(|&c| scalar(c as f64))
                .collect::<Result<_>>()?,
            count_of,
        };
        Ok(self.state.insert(state))
    }

    /// Takes a step's scaler outputs (`outputs`: the scale, good steps,
    /// skipped steps and one count per class) as the next state. A class
    /// whose parameters did not all have a gradient splits: those that did
    /// take its new count, the others keep the old one (the counts are not
    /// donated, so the old tensor is intact).
    fn advance(&mut self, outputs: Vec<Tensor>, has_grad: &[bool]) -> Result<()> {
        let Some(state) = &mut self.state else {
            return Ok(());
        };
        let n_counts = state.counts.len();
        if outputs.len() != 3 + n_counts
            || outputs
                .iter()
                .any(|t| t.dtype() != DType::F64 || t.rank() != 0)
        {
            return Err(Error::new(
                ErrorKind::Verify,
                format!(
                    "train_step: the loss scaler's outputs are {:?}, expected {} f64 scalars",
                    outputs.iter().map(Tensor::ty).collect::<Vec<_>>(),
                    3 + n_counts
                ),
            ));
        }
        let mut outputs = outputs.into_iter();
        let mut next = || outputs.next().expect("counted above");
        state.scale = next();
        state.good_steps = next();
        state.skipped = next();
        let new_counts: Vec<Tensor> = (0..n_counts).map(|_| next()).collect();
        // (class, stepped) → new class.
        let mut classes: Vec<((usize, bool), Tensor)> = Vec::new();
        for (i, class) in state.count_of.iter_mut().enumerate() {
            let stepped = has_grad.get(i).copied().unwrap_or(false);
            let key = (*class, stepped);
            *class = match classes.iter().position(|(k, _)| *k == key) {
                Some(at) => at,
                None => {
                    let count = match stepped {
                        true => new_counts[key.0].clone(),
                        false => state.counts[key.0].clone(),
                    };
                    classes.push((key, count));
                    classes.len() - 1
                }
            };
        }
        state.counts = classes.into_iter().map(|(_, t)| t).collect();
        Ok(())
    }
}

/// The value of a 0-dim f64 tensor, read back to the host.
fn read_scalar(t: &Tensor) -> Result<f64> {
    Ok(t.to_vec::<f64>()?[0])
}

/// The parameters' values and the optimizer's state handed over to a
/// donating call (`args`, from `first` on): put back into the parameters
/// and the optimizer when dropped with `args` still whole, i.e. the call
/// failed (or panicked) before the executable took them.
struct Lent<'p, O: TraceableOptimizer> {
    args: Vec<Tensor>,
    first: usize,
    params: &'p [Parameter],
    state_len: usize,
    optimizer: &'p Mutex<O>,
    /// They were taken out (else the parameters still hold their own).
    donated: bool,
}

impl<O: TraceableOptimizer> Drop for Lent<'_, O> {
    fn drop(&mut self) {
        if !self.donated || self.args.is_empty() {
            return;
        }
        let n = self.params.len();
        let mut rest = self.args.split_off(self.first);
        let states = rest.split_off(n);
        let mut optimizer = lock(self.optimizer);
        for (i, (param, value)) in self.params.iter().zip(rest).enumerate() {
            param.install(&value);
            let state = states[i * self.state_len..(i + 1) * self.state_len].to_vec();
            optimizer.restore_state(i, state);
        }
    }
}

/// Whether a parameter is listed twice (its value cannot be handed over
/// twice: such a step reads them as the caller's).
fn has_duplicates(params: &[Parameter]) -> bool {
    params
        .iter()
        .enumerate()
        .any(|(i, p)| params[..i].iter().any(|q| q.same_slot(p)))
}

/// The step as tensor ops on `args` (laid out as the shared [`Layout`]
/// says): traced on each call, or run eagerly past the recompile limit.
fn step_graph<O: TraceableOptimizer>(
    shared: &Shared<O>,
    loss_fn: &dyn Fn(&[Tensor]) -> Tensor,
    args: &[Tensor],
) -> Result<Vec<Tensor>> {
    let layout = lock(&shared.layout).clone();
    let params = lock(&shared.optimizer).params().to_vec();
    let n = params.len();
    if args.len() != layout.n_inputs(n) {
        return Err(Error::new(
            ErrorKind::Verify,
            format!(
                "train_step: {} inputs for a layout of {}",
                args.len(),
                layout.n_inputs(n)
            ),
        ));
    }
    let (batch, rest) = args.split_at(layout.n_batch);
    let (scalars, rest) = rest.split_at(layout.n_groups * layout.n_scalars);
    let (scaler_args, rest) =
        rest.split_at(layout.scaler.as_ref().map_or(0, ScaledLayout::n_inputs));
    let (values, states) = rest.split_at(n);
    // The scaler's inputs: lr, scale, good steps, skipped steps, counts.
    let scaler = layout.scaler.as_ref().map(|l| (l, scaler_args));
    let leaves: Vec<Tensor> = values
        .iter()
        .map(|v| v.detach().set_requires_grad(true))
        .collect();
    let (loss, grads) = {
        let _standing = StandIn::new(&params, &leaves);
        let scale = scaler.map(|(_, a)| &a[1]);
        enable_grad(|| gradients(loss_fn(batch), &leaves, scale))?
    };
    let has_grad: Vec<bool> = grads.iter().map(Option::is_some).collect();
    let dp = lock(&shared.dp).clone();
    // ZeRO-1 with plain updates: each bucket reduced to its owner, updated
    // and broadcast right after (see `ZeroBucket`).
    let mut early: Vec<Option<(Tensor, Vec<Tensor>)>> = vec![None; n];
    // With data parallel: the last collective so far (the next follows it).
    let (loss, grads, chain) = match &dp {
        Some(dp) => {
            let plain = layout.max_grad_norm.is_none() && scaler.is_none();
            let (loss, grads, last) = match (&layout.owner, plain) {
                (Some(owner), true) => {
                    let mut bucket = ZeroBucket {
                        dp,
                        owner,
                        layout: &layout,
                        scalars,
                        values,
                        states,
                        current: values.to_vec(),
                    };
                    let mut after_bucket = |present: &[usize], grads: &[Option<Tensor>], after| {
                        let optimizer = lock(&shared.optimizer);
                        bucket.update_and_broadcast(&*optimizer, present, grads, after, &mut early)
                    };
                    let hook = Some((owner.as_slice(), &mut after_bucket as &mut AfterBucket<'_>));
                    no_grad(|| reduced(dp, loss, grads, hook))?
                }
                _ => no_grad(|| reduced(dp, loss, grads, None))?,
            };
            (loss, grads, Some(last))
        }
        None => (loss, grads, None),
    };
    let updated_early = early.iter().any(Option::is_some);
    // Outside any autocast scope of the caller's: the scaler, clipping and
    // update run in their inputs' dtypes, as the eager ones do.
    let outputs = autocast::disabled(|| {
        no_grad(|| -> Result<Vec<Tensor>> {
            let mut grads = grads;
            let mut outputs = vec![loss.detach()];
            // Unscaled before anything reads them; whether any is not finite.
            let found_inf = match scaler {
                Some((_, a)) => {
                    let present: Vec<Tensor> = grads.iter().flatten().cloned().collect();
                    let (unscaled, found) = unscale_grads(&present, &a[1])?;
                    for (g, u) in grads.iter_mut().flatten().zip(unscaled) {
                        *g = u;
                    }
                    Some(found)
                }
                None => None,
            };
            if let Some(max_norm) = layout.max_grad_norm {
                let present: Vec<Tensor> = grads.iter().flatten().cloned().collect();
                let norm = global_grad_norm(&present)?;
                let factor = clip_factor(&norm, max_norm)?;
                for g in grads.iter_mut().flatten() {
                    *g = g.try_mul(&factor.try_cast(g.dtype())?)?;
                }
                outputs.push(norm);
            }
            // With a scaler: each count class's new count (+1 on a step
            // that counts, where some parameter of the class has a
            // gradient) and the scaler's next state.
            let mut new_counts: Vec<Tensor> = Vec::new();
            let mut scaler_outputs: Vec<Tensor> = Vec::new();
            let mut lr = None;
            if let (Some((l, a)), Some(found)) = (scaler, &found_inf) {
                let (scale, good_steps) = next_scale(&l.config, &a[1], &a[2], found)?;
                let skipped_one = found.try_cast(DType::F64)?;
                // 1 on a step that counts, 0 on a skipped one.
                let counts_one = skipped_one.try_neg()?.try_add(1.0)?;
                scaler_outputs.extend([scale, good_steps, a[3].try_add(&skipped_one)?]);
                for class in 0..l.n_counts {
                    let count = &a[4 + class];
                    let stepped = (0..n).any(|i| l.count_of[i] == class && has_grad[i]);
                    new_counts.push(match stepped {
                        true => count.try_add(&counts_one)?,
                        false => count.clone(),
                    });
                }
                scaler_outputs.extend(new_counts.iter().cloned());
                // The step's learning rate: times 1 (exact) on a step that
                // counts, times 0 on a skipped one, whose update is
                // discarded anyway.
                lr = Some(a[0].try_mul(&counts_one)?);
            }
            let optimizer = lock(&shared.optimizer);
            // With a scaler: per (count class, dtype), the step's scalars
            // from the learning rate and the class's new count: this
            // step's number t on a step that counts. (On a skipped one it
            // is the old count, 0 before the first step, and the scalars
            // may be inf: the update's values are discarded then.) Computed
            // from the new count and the step's learning rate, they follow
            // the inf check in the graph, which keeps each parameter's
            // update one fused kernel: scalars computed from the inputs
            // alone would be placed between its ops and split it.
            let mut counted: Vec<((usize, DType), Vec<Tensor>)> = Vec::new();
            let mut new_values = Vec::with_capacity(n);
            let mut new_states = Vec::with_capacity(states.len());
            let rank = dp.as_ref().map_or(0, |dp| dp.group.rank());
            for (i, (value, grad)) in values.iter().zip(&grads).enumerate() {
                if let Some((next, next_state)) = early[i].take() {
                    new_values.push(next);
                    new_states.extend(next_state);
                    continue;
                }
                let state = &states[i * layout.state_len..(i + 1) * layout.state_len];
                let unowned = layout.owner.as_ref().is_some_and(|o| o[i] != rank);
                let (Some(g), false) = (grad, unowned) else {
                    new_values.push(value.clone());
                    new_states.extend(state.iter().cloned());
                    continue;
                };
                let (next, next_state) = match scaler {
                    None => {
                        let scalars = layout.scalars_of(scalars, i);
                        let update = || optimizer.update(value, g, state, scalars);
                        match (&dp, layout.max_grad_norm) {
                            // Right behind its bucket's reduction, on the
                            // communication stream: the update overlaps the
                            // rest of the backward instead of waiting for
                            // its end (a clipped update needs every bucket).
                            (Some(dp), None) => on_comm_stream(dp, update)?,
                            _ => update()?,
                        }
                    }
                    Some((l, _)) => {
                        let key = (l.count_of[i], value.dtype());
                        let at = match counted.iter().position(|(k, _)| *k == key) {
                            Some(at) => at,
                            None => {
                                let t = &new_counts[key.0];
                                let lr = lr.as_ref().expect("a scaler's learning rate");
                                let f64s = optimizer.counted_step_scalars(lr, t)?;
                                let cast = f64s
                                    .iter()
                                    .map(|s| s.try_cast(key.1))
                                    .collect::<Result<Vec<_>>>()?;
                                counted.push((key, cast));
                                counted.len() - 1
                            }
                        };
                        // A step with non-finite gradients changes nothing:
                        // its outputs are the inputs (below). The update
                        // reads the gradient through the same check (0 on
                        // such a step, the same value otherwise), so that
                        // all of it waits for the check and fuses with the
                        // selection into one kernel, rather than its first
                        // ops joining the check's kernel and writing their
                        // values out for a second one.
                        let found = found_inf.as_ref().expect("a scaler checks");
                        let zero = Tensor::try_full(&[], 0.0, g.dtype())?;
                        let g = Tensor::try_where(found, &zero, g)?;
                        let (next, next_state) =
                            optimizer.update(value, &g, state, &counted[at].1)?;
                        let keep = |old: &Tensor, new: &Tensor| Tensor::try_where(found, old, new);
                        let kept_state = state
                            .iter()
                            .zip(&next_state)
                            .map(|(old, new)| keep(old, new))
                            .collect::<Result<Vec<_>>>()?;
                        (keep(value, &next)?, kept_state)
                    }
                };
                new_values.push(next);
                new_states.extend(next_state);
            }
            if let (Some(dp), Some(owner), Some(last), false) =
                (&dp, &layout.owner, &chain, updated_early)
            {
                new_values = gathered(dp, owner, &has_grad, new_values, last.clone())?;
            }
            outputs.extend(scaler_outputs);
            outputs.extend(new_values);
            outputs.extend(new_states);
            Ok(outputs)
        })
    })?;
    *lock(&shared.has_grad) = has_grad;
    Ok(outputs)
}

/// The tag of the broadcast of the parameters before the first step.
const TAG_SYNC: u64 = 0;
/// The tag of the loss's all-reduce; the buckets' are `TAG_BUCKETS + b`.
const TAG_LOSS: u64 = 1;
const TAG_BUCKETS: u64 = 1 << 16;
/// The tag of a sharded optimizer's broadcast from rank r: `TAG_OWNED + r`.
const TAG_OWNED: u64 = 1 << 32;

/// Each parameter's size in bytes.
fn param_bytes(params: &[Parameter]) -> Vec<usize> {
    params
        .iter()
        .map(|p| p.numel().saturating_mul(p.get().dtype().size_bytes()))
        .collect()
}

/// What stands for a state tensor of a parameter another rank owns: an
/// empty tensor of its dtype on its device (the step passes it through).
fn unowned_state(state: &Tensor) -> Tensor {
    Tensor::no_elements(state.device(), state.dtype())
}

/// The loss and gradients averaged over `dp`'s ranks: one all-reduce per
/// bucket of gradients (reverse parameter order, [`buckets`]), traced
/// under `dp`'s stream hint so that each runs as soon as its gradients
/// exist, beside the rest of the backward. Also the last call's first
/// output, which the step's next collective follows.
///
/// With a sharded optimizer's `owner`s and `after_bucket` (traced right
/// after each bucket's reduction, given the bucket's present parameters,
/// the gradients so far and that reduction's first output, returning the
/// collective the next bucket's follows), a bucket of one owner is reduced
/// to that owner alone (`reduce`: half an all-reduce's traffic; the other
/// ranks keep their own gradients, which they do not use).
#[allow(clippy::type_complexity)]
fn reduced(
    dp: &DataParallel,
    loss: Tensor,
    mut grads: Vec<Option<Tensor>>,
    mut sharded: Option<(&[usize], &mut AfterBucket<'_>)>,
) -> Result<(Tensor, Vec<Option<Tensor>>, Tensor)> {
    let sizes: Vec<usize> = grads
        .iter()
        .map(|g| {
            g.as_ref()
                .map_or(0, |g| g.numel().saturating_mul(g.dtype().size_bytes()))
        })
        .collect();
    let avg = Kind::AllReduce(ReduceOp::Avg);
    let run = || -> Result<(Tensor, Tensor)> {
        let loss = dp.group.collective(avg, TAG_LOSS, &[&loss])?;
        let loss = loss.into_iter().next().expect("one output");
        // Each call after the one before: one order on every rank.
        let mut last = loss.clone();
        for (b, bucket) in buckets(&sizes, dp.bucket_bytes).iter().enumerate() {
            let present: Vec<usize> = bucket
                .iter()
                .copied()
                .filter(|&i| grads[i].is_some())
                .collect();
            if present.is_empty() {
                continue;
            }
            let args: Vec<&Tensor> = present.iter().filter_map(|&i| grads[i].as_ref()).collect();
            let kind = match sharded.as_ref().and_then(|(o, _)| one_owner(o, &present)) {
                Some(root) => Kind::Reduce {
                    op: ReduceOp::Avg,
                    root,
                },
                None => avg,
            };
            let out = dp
                .group
                .collective_after(kind, TAG_BUCKETS + b as u64, &args, &[&last])?;
            last = out[0].clone();
            for (&i, g) in present.iter().zip(out) {
                grads[i] = Some(g);
            }
            if let Some((_, f)) = sharded.as_mut() {
                last = f(&present, &grads, last)?;
            }
        }
        Ok((loss, last))
    };
    let (loss, last) = on_comm_stream(dp, run)?;
    Ok((loss, grads, last))
}

/// The rank owning every parameter of `bucket`, if one does.
fn one_owner(owner: &[usize], bucket: &[usize]) -> Option<usize> {
    let first = owner[*bucket.first()?];
    bucket.iter().all(|&i| owner[i] == first).then_some(first)
}

/// `f` traced under `dp`'s stream hint (the communication stream), or
/// under the hints in force without one.
fn on_comm_stream<R>(dp: &DataParallel, f: impl FnOnce() -> Result<R>) -> Result<R> {
    match dp.stream {
        Some(n) => crate::hints::scope(crate::hints::Hint::default().stream(n), f)?,
        None => f(),
    }
}

/// A sharded optimizer's new parameter values: each rank broadcasts those
/// it owns and updated (`new_values` holds the old value of the others),
/// the broadcasts chained after `after` (the last gradient bucket's
/// reduction) and each other: the ranks' graphs differ here (each updates
/// its own parameters), their schedules with them, but not the order of
/// their calls. On the communication stream, as the gradients' buckets:
/// a rank's broadcasts from the others (which read nothing of its own
/// update) run beside its own updates instead of queueing among them.
fn gathered(
    dp: &DataParallel,
    owner: &[usize],
    has_grad: &[bool],
    new_values: Vec<Tensor>,
    after: Tensor,
) -> Result<Vec<Tensor>> {
    on_comm_stream(dp, || {
        broadcast_owned(dp, owner, has_grad, new_values, after)
    })
}

/// [`gathered`]'s broadcasts, traced where the caller's hints say.
fn broadcast_owned(
    dp: &DataParallel,
    owner: &[usize],
    has_grad: &[bool],
    mut new_values: Vec<Tensor>,
    after: Tensor,
) -> Result<Vec<Tensor>> {
    let updated: Vec<usize> = (0..owner.len()).filter(|&i| has_grad[i]).collect();
    broadcast_from_owners(dp, owner, &updated, &mut new_values, after)?;
    Ok(new_values)
}

/// The new values of the parameters `updated` (in `new_values`: each
/// owner's update, the old value elsewhere) broadcast from their owners,
/// one call per owner in rank order, chained after `after`; the last
/// call's first output (the next collective follows it).
fn broadcast_from_owners(
    dp: &DataParallel,
    owner: &[usize],
    updated: &[usize],
    new_values: &mut [Tensor],
    after: Tensor,
) -> Result<Tensor> {
    let mut last = after;
    for root in 0..dp.group.world() {
        let mine: Vec<usize> = updated
            .iter()
            .copied()
            .filter(|&i| owner[i] == root)
            .collect();
        if mine.is_empty() {
            continue;
        }
        let args: Vec<&Tensor> = mine.iter().map(|&i| &new_values[i]).collect();
        let kind = Kind::Broadcast { root };
        let out = dp
            .group
            .collective_after(kind, TAG_OWNED + root as u64, &args, &[&last])?;
        last = out[0].clone();
        for (i, v) in mine.into_iter().zip(out) {
            new_values[i] = v;
        }
    }
    Ok(last)
}

/// What [`reduced`] traces after each bucket's reduction.
type AfterBucket<'a> = dyn FnMut(&[usize], &[Option<Tensor>], Tensor) -> Result<Tensor> + 'a;

/// A sharded optimizer's work on one reduced bucket, when the updates need
/// no other bucket (no clipping, no loss scaler): the owner updates its
/// parameters of the bucket and each owner broadcasts their new values,
/// chained after the bucket's reduction. Traced under the communication
/// stream's hint with the reductions, so that the broadcasts run beside
/// the rest of the backward instead of after its end.
struct ZeroBucket<'s> {
    dp: &'s DataParallel,
    owner: &'s [usize],
    layout: &'s Layout,
    scalars: &'s [Tensor],
    values: &'s [Tensor],
    states: &'s [Tensor],
    /// Each parameter's latest value: the old one until its bucket is
    /// updated and broadcast (what the broadcasts read and write, kept
    /// from bucket to bucket).
    current: Vec<Tensor>,
}

impl ZeroBucket<'_> {
    /// Updates and broadcasts `present` (the bucket's parameters with a
    /// gradient), putting each one's new value and state in `done`; the
    /// last broadcast's first output.
    fn update_and_broadcast<O: TraceableOptimizer>(
        &mut self,
        optimizer: &O,
        present: &[usize],
        grads: &[Option<Tensor>],
        after: Tensor,
        done: &mut [Option<(Tensor, Vec<Tensor>)>],
    ) -> Result<Tensor> {
        let rank = self.dp.group.rank();
        let len = self.layout.state_len;
        let mut new_states: Vec<Vec<Tensor>> = Vec::with_capacity(present.len());
        for &i in present {
            let state = &self.states[i * len..(i + 1) * len];
            let grad = grads[i].as_ref().expect("a present gradient");
            let next_state = match self.owner[i] == rank {
                true => {
                    let scalars = self.layout.scalars_of(self.scalars, i);
                    let (next, next_state) = autocast::disabled(|| {
                        optimizer.update(&self.values[i], grad, state, scalars)
                    })?;
                    self.current[i] = next;
                    next_state
                }
                // Another rank's: its empty state passes through.
                false => state.to_vec(),
            };
            new_states.push(next_state);
        }
        let last = broadcast_from_owners(self.dp, self.owner, present, &mut self.current, after)?;
        for (&i, state) in present.iter().zip(new_states) {
            done[i] = Some((self.current[i].clone(), state));
        }
        Ok(last)
    }
}

/// The loss and its gradients with respect to `leaves` (`None` for those
/// it does not depend on), checked to be a float scalar that some leaf
/// influences.
///
/// With a loss `scale` (an f64 0-dim tensor) the gradients are those of
/// the scaled loss ([`scale_loss`]); the loss returned is the unscaled one.
fn gradients(
    loss: Tensor,
    leaves: &[Tensor],
    scale: Option<&Tensor>,
) -> Result<(Tensor, Vec<Option<Tensor>>)> {
    if loss.numel() != 1 || !loss.dtype().is_float() {
        return Err(Error::op(
            ErrorKind::Shape,
            "train_step",
            format!(
                "the loss function must return a float scalar, got {}",
                loss.ty()
            ),
        ));
    }
    if !loss.requires_grad() {
        return Err(Error::op(
            ErrorKind::Argument,
            "train_step",
            format!(
                "the loss {} depends on none of the optimizer's {} parameters{}",
                loss.ty(),
                leaves.len(),
                loss.cut_op()
                    .map(|op| format!(" (it was computed through `{op}`, which has no gradient)"))
                    .unwrap_or_default()
            ),
        ));
    }
    let target = match scale {
        Some(scale) => scale_loss(&loss, scale)?,
        None => loss.clone(),
    };
    let seed = with_device(target.device(), || {
        Tensor::try_full(target.shape(), 1.0, target.dtype())
    })?;
    let grads = autograd::grad(std::slice::from_ref(&target), &[seed], leaves)?;
    Ok((loss, grads))
}

/// The optimizer's parameters holding other values (the step's traced
/// inputs) until dropped, when the originals go back.
struct StandIn<'p> {
    params: &'p [Parameter],
    originals: Vec<Tensor>,
}

impl<'p> StandIn<'p> {
    fn new(params: &'p [Parameter], values: &[Tensor]) -> StandIn<'p> {
        let originals = params
            .iter()
            .zip(values)
            .map(|(p, v)| p.replace(v.clone()))
            .collect();
        StandIn { params, originals }
    }
}

impl Drop for StandIn<'_> {
    fn drop(&mut self) {
        // In reverse, so that a parameter listed twice ends with its own
        // value, not the first stand-in.
        let originals = std::mem::take(&mut self.originals);
        for (p, original) in self.params.iter().zip(originals).rev() {
            p.replace(original);
        }
    }
}

/// A lock that a panic of another holder does not poison for good: every
/// value behind these locks is whole between statements.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_counts_inputs_and_outputs() {
        let layout = Layout {
            n_batch: 2,
            group_of: vec![0, 0, 1],
            n_groups: 2,
            n_scalars: 3,
            state_len: 2,
            max_grad_norm: Some(1.0),
            scaler: None,
            owner: None,
        };
        // batch, 2 groups of 3 scalars, 3 values and 3·2 state tensors.
        assert_eq!(layout.n_inputs(3), 2 + 6 + 3 + 6);
        // loss, norm, 3 values, 6 state tensors.
        assert_eq!(layout.n_outputs(3), 1 + 1 + 3 + 6);
    }
}
