//! `tessera bench gpt`: the training step of a GPT-2-shaped
//! [`TransformerLM`] (forward, cross-entropy, backward, AdamW) timed
//! eagerly or compiled whole, on the CPU or the GPU, in f32 or under
//! bf16/f16 autocast — the same model, batch and loop as
//! `scripts/anchors/gpt_torch.py`, PyTorch's side, so that the two print
//! comparable JSON lines.
//!
//! The model against `gpt_torch.py`'s: token + learned position
//! embeddings, pre-LN blocks (LayerNorm eps 1e-5, causal attention,
//! GELU (erf) MLP, biased linears), a final LayerNorm and an untied head
//! without bias — the same parameter count. Two differences in form, not
//! in what is computed: the attention projects q, k and v with three
//! `d × d` linears where PyTorch has one `d × 3d` (the same weights and
//! FLOPs, split), and it scales q by `1/√d_head` before the product where
//! PyTorch scales the scores after it. The initial values are PyTorch's
//! distributions drawn from tessera's generator, so the losses agree in
//! size, not digit for digit.
//!
//! The batch is random tokens (`ids [B, T+1]` uniform over the vocabulary,
//! `x = ids[:, :-1]`, `y = ids[:, 1:]`), the loss the mean cross-entropy
//! of the flattened logits, the optimizer AdamW with PyTorch's defaults
//! (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01). As the
//! PyTorch script, `warmup` steps run first, then `steps` timed ones; the
//! median of the timed steps is the figure, and every step reads its loss
//! back (and waits for the device) before the clock stops.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use tessera::compile::{
    compile, train_step, Compiled, DataParallel, Mode as CompileMode, TrainStep,
};
use tessera::dist::ProcessGroup;
use tessera::error::{Error, ErrorKind, Result};
use tessera::hints::Strategy;
use tessera::nn::{try_cross_entropy, ParamStore, TransformerConfig, TransformerLM};
use tessera::optim::{AdamW, AdamWConfig, GradScalerConfig, MixedPrecision, Optimizer};
use tessera::runtime::device::{self, Device};
use tessera::runtime::replay::ReplayStats;
use tessera::tensor::Generator;
use tessera::{autocast, DType, Tensor};

/// How each step runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// `zero_grad`, forward, loss, backward, AdamW step: op by op.
    Eager,
    /// The whole step (forward, loss, backward, AdamW update) as one
    /// graph: `tessera::compile::train_step`.
    #[default]
    Compiled,
    /// The model and its loss compiled (`tessera::compile`: a forward and
    /// an ahead-of-time backward graph, the activations the backward
    /// needs saved between them), the AdamW update eager: what
    /// `torch.compile(model)` does, and the form in which a memory budget
    /// can recompute saved activations or move them to host memory.
    CompiledModel,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Eager => "eager",
            Mode::Compiled => "compiled",
            Mode::CompiledModel => "compiled-model",
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Mode, String> {
        match s {
            "eager" => Ok(Mode::Eager),
            "compiled" => Ok(Mode::Compiled),
            "compiled-model" => Ok(Mode::CompiledModel),
            _ => Err(format!(
                "unknown mode `{s}` (expected eager, compiled or compiled-model)"
            )),
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Parses a kernel order for the compiled step: `bfs`, `dfs`, `strict` or
/// `auto` (compile's default).
pub fn parse_schedule(s: &str) -> std::result::Result<Strategy, String> {
    match s {
        "bfs" => Ok(Strategy::Bfs),
        "dfs" => Ok(Strategy::Dfs),
        "strict" => Ok(Strategy::Strict),
        "auto" => Ok(Strategy::Auto),
        _ => Err(format!(
            "unknown schedule `{s}` (expected bfs, dfs, strict or auto)"
        )),
    }
}

/// What `tessera bench gpt` runs. The defaults are GPT-2 small (163 M
/// parameters with the untied head, batch 8 × 1024): a GPU's size; on
/// the CPU use a few layers of d256 (see the README).
#[derive(Clone, Debug, PartialEq)]
pub struct GptBenchConfig {
    pub layers: usize,
    pub d_model: usize,
    pub heads: usize,
    /// The MLP's hidden width (GPT-2: `4 × d_model`).
    pub d_ff: usize,
    pub vocab: usize,
    pub batch: usize,
    /// Tokens per sequence (also the number of learned positions).
    pub seq: usize,
    /// Timed steps.
    pub steps: usize,
    /// Untimed steps before them (the compile, the allocator's pools).
    pub warmup: usize,
    /// f32, or the forward under bf16 / f16 autocast (f32 master weights;
    /// f16 with a loss scaler).
    pub dtype: DType,
    pub mode: Mode,
    /// Seeds the initial weights and the batch.
    pub seed: u64,
    /// The compiled step's kernel order; `None`: the compiler's default.
    pub schedule: Option<Strategy>,
    /// The compiled step traces the model every step (the default); with
    /// `false` a step whose inputs pass the cached executable's guards runs
    /// it untraced ([`tessera::compile::TrainStep::retrace`]).
    pub retrace: bool,
    /// The compiled step recorded once as a CUDA graph and replayed
    /// (`mode=reduce-overhead`, see `tessera::runtime::replay`).
    pub cuda_graphs: bool,
    /// The compiled step's memory budget in MiB (the most parallel order
    /// whose predicted peak fits; `TESSERA_LOGS=schedule,memory` says what
    /// was chosen).
    pub memory_budget_mb: Option<f64>,
    /// Data parallel: this process's rank of the group (each rank runs
    /// `batch` sequences of its own; the figures are the group's: global
    /// batch = world × batch). Compiled mode only.
    pub group: Option<ProcessGroup>,
    /// With a group: shard AdamW's state over the ranks (ZeRO-1).
    pub zero: bool,
    /// With a group: the gradient buckets' most MiB (`None`: DataParallel's
    /// default, PyTorch DDP's 25).
    pub bucket_mb: Option<f64>,
}

impl Default for GptBenchConfig {
    fn default() -> GptBenchConfig {
        GptBenchConfig {
            layers: 12,
            d_model: 768,
            heads: 12,
            d_ff: 4 * 768,
            vocab: 50304,
            batch: 8,
            seq: 1024,
            steps: 10,
            warmup: 3,
            dtype: DType::F32,
            mode: Mode::Compiled,
            seed: 0,
            schedule: None,
            retrace: true,
            cuda_graphs: false,
            memory_budget_mb: None,
            group: None,
            zero: false,
            bucket_mb: None,
        }
    }
}

impl GptBenchConfig {
    /// Every problem of the config in one error (before anything runs).
    pub fn validate(&self) -> Result<()> {
        let mut problems = Vec::new();
        let sizes = [
            ("layers", self.layers),
            ("d_model", self.d_model),
            ("heads", self.heads),
            ("d_ff", self.d_ff),
            ("vocab", self.vocab),
            ("batch", self.batch),
            ("seq", self.seq),
            ("steps", self.steps),
        ];
        for (name, value) in sizes {
            if value == 0 {
                problems.push(format!("{name} must be at least 1, got 0"));
            }
        }
        if self.heads > 0 && !self.d_model.is_multiple_of(self.heads) {
            problems.push(format!(
                "d_model {} must be a multiple of heads {}",
                self.d_model, self.heads
            ));
        }
        if !matches!(self.dtype, DType::F32 | DType::BF16 | DType::F16) {
            problems.push(format!(
                "dtype must be f32, bf16 or f16, got {}",
                self.dtype
            ));
        }
        if self.schedule.is_some() && self.mode == Mode::Eager {
            problems.push(
                "--schedule orders the compiled step's kernels: not with --mode eager".into(),
            );
        }
        if !self.retrace && self.mode != Mode::Compiled {
            problems.push(format!(
                "--no-retrace is about the whole compiled step: only with --mode compiled, \
                 not {}",
                self.mode
            ));
        }
        if self.cuda_graphs && self.mode != Mode::Compiled {
            problems.push(format!(
                "--cuda-graphs records the whole compiled step: only with --mode compiled, \
                 not {}",
                self.mode
            ));
        }
        if self.group.is_some() && self.mode != Mode::Compiled {
            problems.push(format!(
                "--gpus trains the whole compiled step data-parallel: only with --mode \
                 compiled, not {}",
                self.mode
            ));
        }
        match self.bucket_mb {
            Some(_) if self.group.is_none() => problems.push(
                "--bucket-mb sizes the gradients' all-reduces: needs --gpus 2 or more".into(),
            ),
            Some(mb) if !(mb.is_finite() && mb > 0.0) => problems.push(format!(
                "--bucket-mb must be a positive number of MiB, got {mb}"
            )),
            _ => {}
        }
        if self.zero && self.group.is_none() {
            problems.push(
                "--zero shards the optimizer over several GPUs: needs --gpus 2 or more".into(),
            );
        }
        match self.memory_budget_mb {
            Some(_) if self.mode == Mode::Eager => problems.push(
                "--memory-budget-mb plans the compiled step's memory: not with --mode eager".into(),
            ),
            Some(mb) if !(mb.is_finite() && mb >= 0.0) => problems.push(format!(
                "--memory-budget-mb must be a number of MiB ≥ 0, got {mb}"
            )),
            _ => {}
        }
        if problems.is_empty() && self.param_count().is_none() {
            problems.push(format!(
                "the model of {} layers, d_model {}, d_ff {}, vocab {}, seq {} has more \
                 parameters than a usize counts",
                self.layers, self.d_model, self.d_ff, self.vocab, self.seq
            ));
        }
        let logits = self
            .batch
            .checked_mul(self.seq.saturating_add(1))
            .and_then(|n| n.checked_mul(self.vocab));
        if logits.is_none() {
            problems.push(format!(
                "batch {} × seq {} × vocab {} logits are more than a usize counts",
                self.batch, self.seq, self.vocab
            ));
        }
        if i64::try_from(self.vocab).is_err() {
            problems.push(format!("vocab {} does not fit token ids (i64)", self.vocab));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(Error::op(
                ErrorKind::Argument,
                "bench gpt",
                problems.join("; "),
            ))
        }
    }

    /// The parameters of the model (gpt_torch.py's count); `None` past
    /// `usize`.
    pub fn param_count(&self) -> Option<usize> {
        let (d, f, v) = (self.d_model, self.d_ff, self.vocab);
        let linear = |i: usize, o: usize| i.checked_mul(o)?.checked_add(o);
        let norm = d.checked_mul(2)?;
        // ln1, q/k/v/o, ln2, fc1, fc2.
        let block = [
            Some(norm),
            linear(d, d)?.checked_mul(4),
            Some(norm),
            linear(d, f),
            linear(f, d),
        ]
        .into_iter()
        .try_fold(0usize, |sum, n| sum.checked_add(n?))?;
        // Embeddings, blocks, the final norm and the head.
        [
            v.checked_mul(d),
            self.seq.checked_mul(d),
            block.checked_mul(self.layers),
            Some(norm),
            d.checked_mul(v),
        ]
        .into_iter()
        .try_fold(0usize, |sum, n| sum.checked_add(n?))
    }

    fn model_config(&self) -> TransformerConfig {
        TransformerConfig {
            vocab: self.vocab,
            d_model: self.d_model,
            n_heads: self.heads,
            n_layers: self.layers,
            d_ff: self.d_ff,
            max_len: self.seq,
            dropout: 0.0,
        }
    }
}

/// One line of results; the keys that `gpt_torch.py` also prints mean the
/// same thing there.
#[derive(Clone, Debug, Serialize)]
pub struct GptBenchReport {
    /// `tessera`.
    pub system: String,
    /// `eager` or `compiled`.
    pub mode: String,
    pub dtype: String,
    /// `cpu` or `cuda`.
    pub device: String,
    pub params: usize,
    /// The median of the timed steps, in ms.
    pub ms_median: f64,
    /// `batch × seq` tokens per second of the median step.
    pub tokens_per_s: u64,
    /// The most memory (MiB) the device's allocator had handed out from
    /// the moment before the first step to the end (the CPU's: the host
    /// pool's).
    pub peak_mb: f64,
    /// What was allocated before the first step (MiB): the parameters and
    /// the batch.
    pub base_mb: f64,
    /// The first step's time in seconds (with the compile, for compiled).
    pub first_step_s: f64,
    /// Seconds spent building the step's executable (compiled only): the
    /// passes, autograd's graph, fusion, the schedule and memory plan. The
    /// first trace and what the first run tunes (the CPU's matmul tiles)
    /// are in `first_step_s`, not here.
    pub compile_s: Option<f64>,
    /// Seconds spent tracing the step, all steps together (compiled only:
    /// every call traces to find its executable unless `retrace` is off;
    /// inside `step_ms`).
    pub trace_s: Option<f64>,
    pub loss_first: f64,
    pub loss_last: f64,
    /// The timed steps' times, in ms, in order.
    pub step_ms: Vec<f64>,
    /// The median time the host took to queue a timed step, in ms (until
    /// the step returned its loss, before reading it): near `ms_median`
    /// when the host's dispatch, not the device, bounds the step.
    pub host_ms_median: f64,
    pub layers: usize,
    pub d_model: usize,
    pub heads: usize,
    pub d_ff: usize,
    pub vocab: usize,
    pub batch: usize,
    pub seq: usize,
    pub warmup: usize,
    /// The compiled step's kernel order (`default`: the compiler's).
    pub schedule: Option<String>,
    /// Whether the compiled step traced every step (compiled only).
    pub retrace: Option<bool>,
    /// The compiled step's memory budget (MiB), when one was set.
    pub memory_budget_mb: Option<f64>,
    /// Ranks (GPUs) of a data-parallel run; tokens_per_s is all of theirs.
    pub gpus: usize,
    /// The optimizer's state sharded over them (ZeRO-1).
    pub zero: bool,
    /// The gradient buckets' most MiB, when set (`--bucket-mb`).
    pub bucket_mb: Option<f64>,
    /// Compiled with `--cuda-graphs`: steps replayed from the recorded CUDA
    /// graph, and recordings that failed (the step then ran kernel by
    /// kernel; `TESSERA_LOGS=cudagraphs` says why).
    pub cuda_graph_replays: Option<usize>,
    pub cuda_graph_fallbacks: Option<usize>,
    /// Executables built (compiled only): 1 when nothing recompiled.
    pub compiles: Option<usize>,
    /// The loss scale after the last step (f16 only: its dynamic loss
    /// scaler, eager or inside the compiled step).
    pub loss_scale: Option<f64>,
    /// Steps the f16 loss scaler skipped, warmup included (their gradients
    /// overflowed).
    pub skipped_steps: Option<usize>,
}

/// What the progress callback sees after each step.
#[derive(Clone, Copy, Debug)]
pub struct StepProgress {
    /// From 1; warmup steps included.
    pub step: usize,
    pub total: usize,
    pub warmup: bool,
    pub loss: f64,
    pub ms: f64,
}

/// Runs the benchmark `config` describes on `device` (registered already
/// for CUDA), calling `progress` after each step.
pub fn run_gpt(
    config: &GptBenchConfig,
    on: Device,
    progress: impl FnMut(&StepProgress),
) -> Result<GptBenchReport> {
    config.validate()?;
    if !device::is_available(on) {
        return Err(Error::op(
            ErrorKind::Unsupported,
            "bench gpt",
            format!("no backend for device `{on}`"),
        ));
    }
    device::with_device(on, || run_here(config, on, progress))
}

/// The random-token batch: `[x [B, T], y [B·T]]` on `on`.
fn batch(config: &GptBenchConfig, seed: u64, on: Device) -> Result<Vec<Tensor>> {
    let (b, t) = (config.batch, config.seq);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let vocab = config.vocab as i64;
    // validate() checked that b·(t+1) counts; memory may still refuse it.
    let n = b * (t + 1);
    let mut ids: Vec<i64> = Vec::new();
    ids.try_reserve_exact(n).map_err(|e| {
        Error::op(
            ErrorKind::OutOfMemory,
            "bench gpt",
            format!("{n} token ids of batch {b} × seq {t} do not fit in host memory: {e}"),
        )
    })?;
    ids.extend((0..n).map(|_| rng.random_range(0..vocab)));
    let rows = ids.chunks(t + 1);
    let x: Vec<i64> = rows.clone().flat_map(|r| r[..t].to_vec()).collect();
    let y: Vec<i64> = rows.flat_map(|r| r[1..].to_vec()).collect();
    Ok(vec![
        Tensor::from_vec(x, &[b, t]).to(on)?,
        Tensor::from_vec(y, &[b * t]).to(on)?,
    ])
}

/// The loss of `gpt_torch.py`: cross-entropy of the flattened logits
/// (in f32 under autocast: the norms and losses autocast to f32).
fn loss(model: &TransformerLM, vocab: usize, data: &[Tensor]) -> Result<Tensor> {
    let logits = model.try_forward(&data[0], true)?;
    let flat = logits.try_reshape(&[-1, vocab as isize])?;
    try_cross_entropy(&flat, &data[1], None)
}

/// The forward in `dtype`'s precision: autocast for bf16/f16.
fn in_precision<R>(dtype: DType, f: impl FnOnce() -> R) -> R {
    match dtype {
        DType::BF16 | DType::F16 => autocast(dtype, f),
        _ => f(),
    }
}

/// A step of either mode.
enum Stepper<'a> {
    Eager {
        model: &'a TransformerLM,
        optimizer: AdamW,
        precision: MixedPrecision,
    },
    Compiled {
        step: Box<TrainStep<'a, AdamW>>,
        /// The first error of the loss function inside the traced step
        /// (which must return a tensor): returned by the step instead of
        /// the compiler's complaint about the empty stand-in loss.
        error: Rc<RefCell<Option<Error>>>,
    },
    CompiledModel {
        loss: Box<Compiled<LossFn<'a>>>,
        optimizer: AdamW,
        precision: MixedPrecision,
        /// As `Compiled`'s.
        error: Rc<RefCell<Option<Error>>>,
    },
}

/// The compiled loss function of [`Mode::CompiledModel`].
type LossFn<'a> = Box<dyn Fn(&[Tensor]) -> Vec<Tensor> + 'a>;

/// The loss of `model` as a function a compiler traces: it must return
/// tensors, so an error is kept in `error` and an empty tensor returned
/// in its place (which the caller reports as that error).
fn kept_loss<'a>(
    model: &'a TransformerLM,
    vocab: usize,
    dtype: DType,
    error: Rc<RefCell<Option<Error>>>,
) -> impl Fn(&[Tensor]) -> Tensor + 'a {
    move |data: &[Tensor]| match in_precision(dtype, || loss(model, vocab, data)) {
        Ok(l) => l,
        Err(e) => {
            error.borrow_mut().get_or_insert(e);
            // Not a scalar: the compiled step stops with an error.
            Tensor::zeros(&[0], DType::F32)
        }
    }
}

impl<'a> Stepper<'a> {
    fn new(
        config: &GptBenchConfig,
        model: &'a TransformerLM,
        store: &ParamStore,
    ) -> Result<Stepper<'a>> {
        let optimizer = AdamW::new(store.parameters(), AdamWConfig::default());
        let dtype = config.dtype;
        let vocab = config.vocab;
        Ok(match config.mode {
            Mode::Eager => Stepper::Eager {
                model,
                optimizer,
                precision: MixedPrecision::new(dtype, store.parameters())?,
            },
            Mode::CompiledModel => {
                let error = Rc::new(RefCell::new(None));
                let loss_fn = kept_loss(model, vocab, dtype, error.clone());
                let traced: LossFn<'a> = Box::new(move |data: &[Tensor]| vec![loss_fn(data)]);
                let mut loss = compile(traced);
                if let Some(mb) = config.memory_budget_mb {
                    loss = loss.memory_budget(mib_to_bytes(mb));
                }
                if let Some(order) = config.schedule {
                    loss = loss.schedule(order);
                }
                Stepper::CompiledModel {
                    loss: Box::new(loss),
                    optimizer,
                    precision: MixedPrecision::new(dtype, store.parameters())?,
                    error,
                }
            }
            Mode::Compiled => {
                let error = Rc::new(RefCell::new(None));
                let loss_fn = kept_loss(model, vocab, dtype, error.clone());
                let mut step = train_step(loss_fn, optimizer).name("bench_gpt_step");
                if let Some(mb) = config.memory_budget_mb {
                    step = step.memory_budget(mib_to_bytes(mb));
                }
                if let Some(order) = config.schedule {
                    step = step.schedule(order);
                }
                step = step.retrace(config.retrace);
                if config.cuda_graphs {
                    step = step.mode(CompileMode::ReduceOverhead);
                }
                if dtype == DType::F16 {
                    // As eager's `MixedPrecision`: PyTorch's defaults.
                    step = step.loss_scaler(GradScalerConfig::default());
                }
                if let Some(group) = &config.group {
                    let mut dp = DataParallel::new(group.clone()).zero(config.zero);
                    if let Some(mb) = config.bucket_mb {
                        dp = dp.bucket_bytes(mib_to_bytes(mb));
                    }
                    step = step.data_parallel(dp);
                }
                Stepper::Compiled {
                    step: Box::new(step),
                    error,
                }
            }
        })
    }

    /// Queues one step and returns its loss (not read: on a device the
    /// step may still be running).
    fn step(&mut self, data: &[Tensor], vocab: usize) -> Result<Tensor> {
        match self {
            Stepper::Eager {
                model,
                optimizer,
                precision,
            } => {
                optimizer.zero_grad();
                let l = precision.forward(|| loss(model, vocab, data))?;
                precision.backward(&l)?;
                precision.step(optimizer)?;
                Ok(l)
            }
            Stepper::Compiled { step, error } => {
                let result = step.try_step(data);
                if let Some(e) = error.borrow_mut().take() {
                    return Err(e);
                }
                result
            }
            Stepper::CompiledModel {
                loss,
                optimizer,
                precision,
                error,
            } => {
                optimizer.zero_grad();
                // The autocast scope is the trace's: compile traces the
                // loss inside it on every call.
                let l = precision.forward(|| loss.try_call(data));
                if let Some(e) = error.borrow_mut().take() {
                    return Err(e);
                }
                let l = l?.swap_remove(0);
                precision.backward(&l)?;
                precision.step(optimizer)?;
                Ok(l)
            }
        }
    }

    /// The f16 loss scale after the last step and the steps it skipped
    /// (f16 only).
    fn loss_scaler(&self) -> Result<Option<(f64, usize)>> {
        match self {
            Stepper::Eager { precision, .. } | Stepper::CompiledModel { precision, .. } => {
                Ok(precision
                    .scaler()
                    .map(|s| (s.scale_factor(), s.skipped_steps())))
            }
            Stepper::Compiled { step, .. } => Ok(step.loss_scale()?.zip(step.skipped_steps()?)),
        }
    }

    /// Compile seconds, trace seconds and executables built.
    fn compile_stats(&self) -> Option<(f64, f64, usize)> {
        match self {
            Stepper::Eager { .. } => None,
            Stepper::Compiled { step, .. } => {
                let s = step.stats();
                Some((s.compile_seconds, s.trace_seconds, s.compiles))
            }
            Stepper::CompiledModel { loss, .. } => {
                let s = loss.stats();
                Some((s.compile_seconds, s.trace_seconds, s.compiles))
            }
        }
    }

    fn replay_stats(&self) -> Option<ReplayStats> {
        match self {
            Stepper::Eager { .. } | Stepper::CompiledModel { .. } => None,
            Stepper::Compiled { step, .. } => Some(step.replay_stats()),
        }
    }
}

fn too_large(params: usize, why: String) -> Error {
    Error::op(
        ErrorKind::OutOfMemory,
        "bench gpt",
        format!(
            "the model's {params} f32 parameters, their gradients and AdamW's moments \
             do not fit on this device: {why}"
        ),
    )
}

/// `mb` MiB in bytes (validated finite and non-negative).
fn mib_to_bytes(mb: f64) -> usize {
    (mb * (1u64 << 20) as f64) as usize
}

fn mib(bytes: usize) -> f64 {
    round(bytes as f64 / (1u64 << 20) as f64, 1)
}

fn round(x: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (x * f).round() / f
}

fn run_here(
    config: &GptBenchConfig,
    on: Device,
    mut progress: impl FnMut(&StepProgress),
) -> Result<GptBenchReport> {
    // The model's constructor cannot fail: see first that the device has
    // room for the weights, their gradients and AdamW's two moments.
    let params = config.param_count().unwrap_or(usize::MAX);
    let room = params
        .checked_mul(4)
        .ok_or_else(|| too_large(params, "more elements than a usize counts".into()))
        .and_then(|n| {
            Tensor::try_zeros(&[n], DType::F32).map_err(|e| too_large(params, e.to_string()))
        })?;
    drop(room);
    let mut g = Generator::new(config.seed);
    let mut store = ParamStore::new();
    let model = TransformerLM::new(&mut store, "", config.model_config(), &mut g);
    // Each rank its own tokens (the weights are rank 0's after the first
    // step's broadcast).
    let rank = config.group.as_ref().map_or(0, ProcessGroup::rank);
    let data = batch(config, g.next_seed().wrapping_add(rank as u64), on)?;
    let mut stepper = Stepper::new(config, &model, &store)?;
    device::synchronize(on)?;
    device::reset_peak(on)?;
    let base = device::memory_stats(on)?.live_bytes;

    let total = config.warmup + config.steps;
    let mut losses = Vec::with_capacity(total);
    let mut step_ms = Vec::with_capacity(config.steps);
    let mut host_ms = Vec::with_capacity(config.steps);
    let mut first_step_s = 0.0;
    for i in 0..total {
        let t0 = Instant::now();
        let l = stepper.step(&data, config.vocab)?;
        let queued = t0.elapsed().as_secs_f64();
        let l = l.item();
        device::synchronize(on)?;
        let took = t0.elapsed().as_secs_f64();
        if i == 0 {
            first_step_s = took;
        }
        let warmup = i < config.warmup;
        if !warmup {
            step_ms.push(took * 1e3);
            host_ms.push(queued * 1e3);
        }
        losses.push(l);
        progress(&StepProgress {
            step: i + 1,
            total,
            warmup,
            loss: l,
            ms: took * 1e3,
        });
    }
    let peak = device::memory_stats(on)?.peak_bytes;
    let median = median_of(&step_ms);
    let compile = stepper.compile_stats();
    let replays = stepper.replay_stats().filter(|_| config.cuda_graphs);
    let scaler = stepper.loss_scaler()?;
    let gpus = config.group.as_ref().map_or(1, ProcessGroup::world);
    Ok(GptBenchReport {
        system: "tessera".into(),
        mode: config.mode.name().into(),
        dtype: config.dtype.name().into(),
        device: on.name().into(),
        params: store.num_parameters(),
        ms_median: round(median, 2),
        tokens_per_s: ((gpus * config.batch * config.seq) as f64 / (median / 1e3).max(1e-12))
            .round() as u64,
        peak_mb: mib(peak),
        base_mb: mib(base),
        first_step_s: round(first_step_s, 3),
        compile_s: compile.map(|(s, _, _)| round(s, 3)),
        trace_s: compile.map(|(_, s, _)| round(s, 3)),
        loss_first: round(losses[0], 6),
        loss_last: round(losses[losses.len() - 1], 6),
        step_ms: step_ms.iter().map(|&ms| round(ms, 2)).collect(),
        host_ms_median: round(median_of(&host_ms), 2),
        layers: config.layers,
        d_model: config.d_model,
        heads: config.heads,
        d_ff: config.d_ff,
        vocab: config.vocab,
        batch: config.batch,
        seq: config.seq,
        warmup: config.warmup,
        schedule: match config.mode {
            Mode::Eager => None,
            Mode::Compiled | Mode::CompiledModel => {
                Some(config.schedule.map_or("default", Strategy::name).into())
            }
        },
        retrace: (config.mode == Mode::Compiled).then_some(config.retrace && !config.cuda_graphs),
        memory_budget_mb: config.memory_budget_mb,
        gpus,
        zero: config.zero,
        bucket_mb: config.bucket_mb,
        cuda_graph_replays: replays.map(|r| r.replays),
        cuda_graph_fallbacks: replays.map(|r| r.fallbacks),
        compiles: compile.map(|(_, _, n)| n),
        loss_scale: scaler.map(|(scale, _)| scale),
        skipped_steps: scaler.map(|(_, skipped)| skipped),
    })
}

/// The median of `values` (the upper one of an even count); 0 when empty.
fn median_of(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(mode: Mode) -> GptBenchConfig {
        GptBenchConfig {
            layers: 1,
            d_model: 16,
            heads: 2,
            d_ff: 32,
            vocab: 32,
            batch: 2,
            seq: 8,
            steps: 2,
            warmup: 1,
            mode,
            ..GptBenchConfig::default()
        }
    }

    /// The batch is next-token pairs: `y` is `x` shifted by one.
    #[test]
    fn the_targets_are_the_inputs_shifted() {
        let c = tiny(Mode::Eager);
        let data = batch(&c, 7, Device::Cpu).unwrap();
        let (x, y) = (data[0].to_f64_vec(), data[1].to_f64_vec());
        assert_eq!(data[0].shape(), &[2, 8]);
        assert_eq!(data[1].shape(), &[16]);
        for row in 0..2 {
            assert_eq!(x[row * 8 + 1..row * 8 + 8], y[row * 8..row * 8 + 7]);
        }
        assert!(x.iter().chain(&y).all(|&v| (0.0..32.0).contains(&v)));
    }

    #[test]
    fn every_problem_of_a_config_is_named() {
        let c = GptBenchConfig {
            heads: 3,
            batch: 0,
            ..tiny(Mode::Compiled)
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("batch must be at least 1"), "{e}");
        assert!(
            e.contains("d_model 16 must be a multiple of heads 3"),
            "{e}"
        );
        // Every precision in both modes (f16 compiled: the step's loss
        // scaler).
        for mode in [Mode::Eager, Mode::Compiled, Mode::CompiledModel] {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let c = GptBenchConfig {
                    dtype,
                    ..tiny(mode)
                };
                assert!(c.validate().is_ok(), "{mode} {dtype}");
            }
        }
        let c = GptBenchConfig {
            schedule: Some(Strategy::Dfs),
            dtype: DType::I64,
            ..tiny(Mode::Eager)
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("not with --mode eager"), "{e}");
        assert!(e.contains("dtype must be f32, bf16 or f16, got i64"), "{e}");
        let c = GptBenchConfig {
            bucket_mb: Some(50.0),
            ..tiny(Mode::Compiled)
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("--bucket-mb sizes the gradients' all-reduces"),
            "{e}"
        );
        let group = tessera::dist::ProcessGroup::threads(2).unwrap().remove(0);
        for (mb, ok) in [(0.5, true), (0.0, false), (f64::NAN, false)] {
            let c = GptBenchConfig {
                bucket_mb: Some(mb),
                group: Some(group.clone()),
                ..tiny(Mode::Compiled)
            };
            let e = c.validate().err().map(|e| e.to_string());
            assert_eq!(e.is_none(), ok, "{mb}: {e:?}");
            if let Some(e) = e {
                assert!(
                    e.contains("--bucket-mb must be a positive number of MiB"),
                    "{e}"
                );
            }
        }
        let c = GptBenchConfig {
            cuda_graphs: true,
            retrace: false,
            ..tiny(Mode::CompiledModel)
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("--cuda-graphs records the whole compiled step"),
            "{e}"
        );
        assert!(
            e.contains("--no-retrace is about the whole compiled step"),
            "{e}"
        );
    }

    /// The compiled model (forward and ahead-of-time backward, AdamW eager)
    /// trains as the eager loop does, step for step; under a memory budget
    /// too small for its saved activations it recomputes or offloads some
    /// (the log says which) and still trains the same.
    #[test]
    fn the_compiled_model_steps_as_eager_does() {
        let steps = |mode, budget| {
            let c = GptBenchConfig {
                memory_budget_mb: budget,
                ..tiny(mode)
            };
            run_gpt(&c, Device::Cpu, |_| {}).unwrap()
        };
        let eager = steps(Mode::Eager, None);
        for budget in [None, Some(0.0)] {
            let compiled = steps(Mode::CompiledModel, budget);
            assert_eq!(compiled.mode, "compiled-model");
            assert_eq!(compiled.compiles, Some(1));
            for (a, b) in [
                (compiled.loss_first, eager.loss_first),
                (compiled.loss_last, eager.loss_last),
            ] {
                assert!(
                    (a - b).abs() <= 1e-4 * b.abs(),
                    "{budget:?}: {a} vs eager {b}"
                );
            }
        }
    }

    /// The parameter count is gpt_torch.py's, the one the model has.
    #[test]
    fn the_parameter_count_is_the_models() {
        let c = tiny(Mode::Eager);
        let mut store = ParamStore::new();
        TransformerLM::new(&mut store, "", c.model_config(), &mut Generator::new(0));
        assert_eq!(c.param_count(), Some(store.num_parameters()));
        let gpt2 = GptBenchConfig::default();
        // GPT-2 small with an untied head (issue 18's 163 M).
        assert_eq!(gpt2.param_count(), Some(163_109_376));
        let huge = GptBenchConfig {
            vocab: usize::MAX / 2,
            ..tiny(Mode::Eager)
        };
        assert_eq!(huge.param_count(), None);
        let e = huge.validate().unwrap_err().to_string();
        assert!(e.contains("more parameters than a usize counts"), "{e}");
    }

    /// bf16 and f16, eager and compiled, run and give finite losses near
    /// the f32 ones; f16 reports its loss scale, and the compiled f16
    /// step's scaler follows the eager one's.
    #[test]
    fn mixed_precision_steps_run() {
        let f32_run = run_gpt(&tiny(Mode::Eager), Device::Cpu, |_| {}).unwrap();
        assert_eq!((f32_run.loss_scale, f32_run.skipped_steps), (None, None));
        let f32_loss = f32_run.loss_first;
        let mut f16_scalers = Vec::new();
        for (mode, dtype) in [
            (Mode::Compiled, DType::BF16),
            (Mode::Eager, DType::F16),
            (Mode::Compiled, DType::F16),
        ] {
            let c = GptBenchConfig {
                dtype,
                ..tiny(mode)
            };
            let r = run_gpt(&c, Device::Cpu, |_| {}).unwrap();
            assert!(r.loss_last.is_finite(), "{mode} {dtype}: {r:?}");
            assert!(
                (r.loss_first - f32_loss).abs() < 0.05,
                "{mode} {dtype}: {} vs f32 {f32_loss}",
                r.loss_first
            );
            assert_eq!(r.dtype, dtype.name());
            if dtype == DType::F16 {
                let scale = r.loss_scale.expect("f16 reports its scale");
                f16_scalers.push((scale, r.skipped_steps));
            }
        }
        // PyTorch's initial 65536, unchanged over 3 good steps (or halved
        // per skipped one), the same eagerly and compiled.
        assert_eq!(f16_scalers[0], f16_scalers[1]);
        let (scale, skipped) = f16_scalers[0];
        assert_eq!(scale, 65536.0 / 2f64.powi(skipped.unwrap() as i32));
    }
}
