//! A complete training run on a task the program generates and checks
//! itself: a [`TransformerLM`] learns to reverse digit strings
//! (`3 1 4 1 5 9 |` → `9 5 1 4 1 3`).
//!
//! [`train`] builds the model from a [`TrainConfig`], trains it with AdamW
//! under a warmup + decay schedule ([`schedule`]) on seeded batches
//! ([`task`]), evaluates greedy decoding on a fixed held-out set
//! ([`eval`]), and writes a checkpoint and a loss curve ([`plot`]). It
//! reports every step to a callback (the CLI's progress bar) and returns a
//! [`TrainReport`].
//!
//! Each step ([`step`]) runs whole as one compiled graph (the default,
//! [`Execution::Compiled`]: `tessera::compile::train_step`, forward,
//! loss, backward, clipping, f16 loss scaling and the AdamW update) or op
//! by op ([`Execution::Eager`]), in the config's precision (f32, or
//! bf16/f16 autocast; eagerly through `tessera::optim::MixedPrecision`).
//!
//! [`train_rank`] runs as one rank of data-parallel training (compiled
//! steps only: `TrainStep::data_parallel`): every rank draws the same
//! global batch of `config.batch` strings and trains on its share of it
//! (rank r the r-th `batch / world` rows); the gradients and the loss are
//! averaged over the ranks, so the run computes what one rank computes
//! on the global batch. Rank 0 alone evaluates and writes the artifacts.
//!
//! ```no_run
//! use tessera_apps::train::{train, TrainConfig};
//!
//! let config = TrainConfig { steps: 300, ..TrainConfig::default() };
//! let report = train(&config, |p| {
//!     if let Some(e) = p.eval {
//!         println!("step {}: exact match {:.3}", e.step, e.accuracy.exact_match);
//!     }
//! })?;
//! println!("{:.1} ms/step", report.ms_per_step);
//! # Ok::<(), tessera::Error>(())
//! ```

mod config;
pub mod digits;
pub mod eval;
pub mod plot;
pub mod schedule;
pub mod step;
pub mod task;

use std::path::Path;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub use config::{Execution, TrainConfig};
pub use eval::{Accuracy, EvalPoint};
pub use schedule::{Decay, LrSchedule};
pub use step::CompileReport;
pub use task::{ReversalTask, IGNORE_INDEX, SEP, VOCAB};

use step::Stepper;
use task::{Batch, Digits, Sampler};
use tessera::compile::DataParallel;
use tessera::error::{Error, ErrorKind, Result};
use tessera::nn::{ParamStore, TransformerLM};
use tessera::runtime::device::{self, Device};
use tessera::tensor::Generator;

/// What the callback of [`train`] sees after each step.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    /// Steps done (1 after the first).
    pub step: usize,
    pub steps: usize,
    pub loss: f64,
    /// The learning rate this step used.
    pub lr: f64,
    /// Training throughput so far: model input tokens per second of
    /// training (evaluation time excluded).
    pub tokens_per_s: f64,
    /// The held-out accuracy, on the steps that evaluated.
    pub eval: Option<EvalPoint>,
}

/// The outcome of a run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainReport {
    pub config: TrainConfig,
    /// Where it ran (`cpu`, `cuda`).
    #[serde(default)]
    pub device: String,
    pub num_parameters: usize,
    /// The training loss of every step.
    pub losses: Vec<f64>,
    /// Held-out accuracies, every `eval_every` steps and after the last.
    pub evals: Vec<EvalPoint>,
    /// Held-out exact match after the last step.
    pub final_accuracy: f64,
    /// The whole run: setup, steps, evaluations, checkpoint and plot.
    pub wall_time_s: f64,
    /// The training steps alone (batches, forward, backward, update),
    /// the first step's compile included.
    pub train_time_s: f64,
    /// `train_time_s` per step.
    pub ms_per_step: f64,
    /// The median step's time: the steady state, without the outliers
    /// (the compile of the first step, a load spike).
    #[serde(default)]
    pub median_step_ms: f64,
    /// Model input tokens per second of training (`train_time_s`).
    pub tokens_per_s: f64,
    /// What the compiler did for the step: compile and trace time,
    /// compiles and recompiles (compiled runs; `None` for eager ones).
    #[serde(default)]
    pub compile: Option<CompileReport>,
    /// Steps the f16 loss scaler skipped (their gradients overflowed).
    #[serde(default)]
    pub skipped_steps: usize,
    /// The f16 loss scale after the last step (f16 runs).
    #[serde(default)]
    pub loss_scale: Option<f64>,
    /// The ranks of a data-parallel run (1: not one); the throughput
    /// figures count every rank's tokens.
    #[serde(default = "one")]
    pub ranks: usize,
    /// Data parallel with the optimizer state sharded over the ranks
    /// (ZeRO-1).
    #[serde(default)]
    pub zero: bool,
}

fn one() -> usize {
    1
}

/// Trains a model as `config` says, calling `progress` after every step.
/// Errors on an invalid config (every problem listed) and on failing to
/// write the checkpoint or the plot.
pub fn train(config: &TrainConfig, progress: impl FnMut(&Progress)) -> Result<TrainReport> {
    train_on(config, Device::Cpu, progress)
}

/// [`train`] on `device`: the parameters are created there (drawn on the
/// host from the same seeds, so they start equal to the CPU's), the
/// optimizer state and every step's work stay there, and each batch and
/// the held-out prompts are copied up. The loss and the accuracy are read
/// back each step.
pub fn train_on(
    config: &TrainConfig,
    device: Device,
    progress: impl FnMut(&Progress),
) -> Result<TrainReport> {
    train_rank(config, device, None, progress)
}

/// [`train_on`] as one rank of data-parallel training over `dp`'s group
/// (see the module docs), or alone without `dp`. Every rank must call it
/// with the same `config`; `config.batch` is the global batch, which must
/// split evenly over the ranks. Each rank's report has the run's losses
/// (the global batch's), rank 0's alone its evaluations.
pub fn train_rank(
    config: &TrainConfig,
    device: Device,
    dp: Option<DataParallel>,
    progress: impl FnMut(&Progress),
) -> Result<TrainReport> {
    device::with_device(device, || train_here(config, device, dp, progress))
}

/// Whether `config` can train data-parallel over `world` ranks: compiled
/// steps, a global batch that splits evenly.
pub fn check_data_parallel(config: &TrainConfig, world: usize) -> Result<()> {
    let problem = if world == 0 {
        Some("data parallel over 0 ranks".to_string())
    } else if world > 1 && config.execution != Execution::Compiled {
        Some("data-parallel training runs compiled steps, not eager ones".to_string())
    } else if !config.batch.is_multiple_of(world) {
        Some(format!(
            "batch {} (the global batch) does not split evenly over {world} ranks",
            config.batch
        ))
    } else {
        None
    };
    match problem {
        Some(p) => Err(Error::op(ErrorKind::Argument, "train", p)),
        None => Ok(()),
    }
}

/// Which rows of the global batch a rank trains on.
#[derive(Clone, Copy, Debug)]
struct Shard {
    rank: usize,
    world: usize,
}

impl Shard {
    /// `dp`'s shard of `config`'s batch, checked ([`check_data_parallel`]).
    fn of(config: &TrainConfig, dp: Option<&DataParallel>) -> Result<Shard> {
        let Some(dp) = dp else {
            return Ok(Shard { rank: 0, world: 1 });
        };
        let (rank, world) = (dp.group.rank(), dp.group.world());
        check_data_parallel(config, world)?;
        Ok(Shard { rank, world })
    }

    /// This rank's rows of the global batch `samples`.
    fn rows<'s>(&self, samples: &'s [Digits]) -> &'s [Digits] {
        let share = samples.len() / self.world;
        &samples[self.rank * share..(self.rank + 1) * share]
    }
}

fn train_here(
    config: &TrainConfig,
    device: Device,
    dp: Option<DataParallel>,
    mut progress: impl FnMut(&Progress),
) -> Result<TrainReport> {
    config.validate()?;
    let shard = Shard::of(config, dp.as_ref())?;
    let zero = dp.as_ref().is_some_and(|dp| dp.zero);
    let start = Instant::now();
    let task = config.task();
    let eval_set = task.eval_set(config.eval_size);
    let mut g = Generator::new(config.seed);
    let mut store = ParamStore::new();
    let model = TransformerLM::new(&mut store, "", config.model_config(), &mut g);
    let mut sampler = Sampler::new(task, g.next_seed(), &eval_set);
    let mut stepper = Stepper::new(config, &model, &store, dp)?;
    let schedule = config.schedule();
    let mut losses = Vec::with_capacity(config.steps);
    let mut step_times = Vec::with_capacity(config.steps);
    let mut evals = Vec::new();
    let mut skipped_steps = 0;
    let mut train_time = Duration::ZERO;
    for step in 0..config.steps {
        let lr = schedule.at(step);
        let t0 = Instant::now();
        let samples = sampler.next_samples(config.batch);
        let batch = task.batch(shard.rows(&samples));
        let batch = Batch {
            inputs: batch.inputs.to(device)?,
            targets: batch.targets.to(device)?,
        };
        let outcome = stepper.step(&batch, lr)?;
        let took = t0.elapsed();
        train_time += took;
        step_times.push(took);
        losses.push(outcome.loss);
        skipped_steps += usize::from(!outcome.stepped);

        let done = step + 1;
        let due = done % config.eval_every == 0 || done == config.steps;
        let eval = if due && shard.rank == 0 {
            let accuracy = evaluate_model(&model, &task, &eval_set)?;
            let point = EvalPoint {
                step: done,
                accuracy,
            };
            evals.push(point);
            Some(point)
        } else {
            None
        };
        progress(&Progress {
            step: done,
            steps: config.steps,
            loss: outcome.loss,
            lr,
            tokens_per_s: tokens_per_s(config, done, train_time),
            eval,
        });
    }
    if shard.rank == 0 {
        write_artifacts(config, &store, &losses, &evals)?;
    }
    let final_accuracy = evals.last().map_or(0.0, |e| e.accuracy.exact_match);
    Ok(TrainReport {
        config: config.clone(),
        device: device.name().to_string(),
        num_parameters: store.num_parameters(),
        tokens_per_s: tokens_per_s(config, config.steps, train_time),
        ms_per_step: train_time.as_secs_f64() * 1e3 / config.steps as f64,
        median_step_ms: median(&mut step_times).as_secs_f64() * 1e3,
        train_time_s: train_time.as_secs_f64(),
        wall_time_s: start.elapsed().as_secs_f64(),
        compile: stepper.compile_report(),
        skipped_steps,
        loss_scale: stepper.loss_scale(),
        ranks: shard.world,
        zero,
        losses,
        evals,
        final_accuracy,
    })
}

/// Greedy-decodes the held-out set with `model` (dropout off) and scores it.
pub fn evaluate_model(
    model: &TransformerLM,
    task: &ReversalTask,
    set: &[Digits],
) -> Result<Accuracy> {
    eval::evaluate(task, set, |ids| model.try_forward(ids, false))
}

/// The middle of `times` (sorted in place); zero for none.
fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times.get(times.len() / 2).copied().unwrap_or_default()
}

fn tokens_per_s(config: &TrainConfig, steps: usize, time: Duration) -> f64 {
    (steps * config.tokens_per_step()) as f64 / time.as_secs_f64().max(1e-9)
}

fn write_artifacts(
    config: &TrainConfig,
    store: &ParamStore,
    losses: &[f64],
    evals: &[EvalPoint],
) -> Result<()> {
    if let Some(path) = &config.checkpoint {
        create_parent(path)?;
        store.save_safetensors(path)?;
    }
    if let Some(path) = &config.plot {
        create_parent(path)?;
        let title = format!(
            "tessera train: reversing {} digits, {} steps",
            config.digits, config.steps
        );
        plot::plot_losses(path, &title, losses, evals)?;
    }
    Ok(())
}

fn create_parent(path: &Path) -> Result<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("{}: cannot create the folder: {e}", dir.display()))),
        _ => Ok(()),
    }
}
