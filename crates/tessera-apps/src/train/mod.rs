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
use tessera::error::{Error, Result};
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
    device::with_device(device, || train_here(config, device, progress))
}

fn train_here(
    config: &TrainConfig,
    device: Device,
    mut progress: impl FnMut(&Progress),
) -> Result<TrainReport> {
    config.validate()?;
    let start = Instant::now();
    let task = config.task();
    let eval_set = task.eval_set(config.eval_size);
    let mut g = Generator::new(config.seed);
    let mut store = ParamStore::new();
    let model = TransformerLM::new(&mut store, "", config.model_config(), &mut g);
    let mut sampler = Sampler::new(task, g.next_seed(), &eval_set);
    let mut stepper = Stepper::new(config, &model, &store)?;
    let schedule = config.schedule();
    let mut losses = Vec::with_capacity(config.steps);
    let mut step_times = Vec::with_capacity(config.steps);
    let mut evals = Vec::new();
    let mut skipped_steps = 0;
    let mut train_time = Duration::ZERO;
    for step in 0..config.steps {
        let lr = schedule.at(step);
        let t0 = Instant::now();
        let batch = sampler.next_batch(config.batch);
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
        let eval = if done % config.eval_every == 0 || done == config.steps {
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
    write_artifacts(config, &store, &losses, &evals)?;
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
