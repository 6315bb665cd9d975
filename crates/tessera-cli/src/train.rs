//! `tessera train`: trains a small transformer to reverse digit strings
//! (`--task reverse`, the default) or a small CNN on scikit-learn's 8×8
//! handwritten digits (`--task digits`), and writes a checkpoint, the loss
//! curve and a JSON summary.
//!
//! Data parallel: `--gpus N` (one process per GPU, the launcher of
//! `bench gpt`, NCCL) or `--ranks N` (N threads of this process over the
//! in-memory communicator, on the CPU: the same code path, testable
//! without GPUs); `--batch` is then the global batch, each rank trains on
//! its share, rank 0 alone prints and writes the artifacts.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use tessera::compile::DataParallel;
use tessera::dist::{self, ProcessGroup};
use tessera::runtime::device::Device;
use tessera::DType;
use tessera_apps::train::digits::{train_digits, DigitsConfig, DigitsProgress, DigitsReport};
use tessera_apps::train::{
    check_data_parallel, train_rank, Decay, Execution, Progress, TrainConfig, TrainReport,
};

use crate::launch::Role;

/// The defaults of every flag: one place, the library's.
fn defaults() -> TrainConfig {
    TrainConfig::default()
}

/// What `tessera train` trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Task {
    /// A transformer reverses digit strings (self-checking, generated).
    Reverse,
    /// A CNN classifies scikit-learn's 8×8 handwritten digits (1,797 real
    /// images; every sixth held out).
    Digits,
}

#[derive(Args)]
pub struct TrainArgs {
    /// What to train: `reverse` (a transformer reversing digit strings) or
    /// `digits` (a CNN on 8×8 handwritten digit images).
    #[arg(long, value_enum, default_value = "reverse")]
    task: Task,
    /// Digits per string to reverse (the model reads 2 × digits tokens).
    #[arg(long, default_value_t = defaults().digits)]
    digits: usize,
    /// Training steps [default: 2000 for reverse, 400 for digits].
    #[arg(long)]
    steps: Option<usize>,
    /// Examples per batch [default: 64 for both tasks].
    #[arg(long)]
    batch: Option<usize>,
    /// Peak learning rate (AdamW) [default: 3e-3 for reverse, 1e-2 for digits].
    #[arg(long)]
    lr: Option<f64>,
    /// Steps of linear warmup [default: 100 for reverse, 20 for digits].
    #[arg(long)]
    warmup: Option<usize>,
    /// Decay after warmup: cosine, linear or constant.
    #[arg(long, default_value_t = defaults().decay, value_parser = str::parse::<Decay>)]
    decay: Decay,
    /// The last step's learning rate as a fraction of the peak.
    #[arg(long, default_value_t = defaults().final_lr_ratio)]
    final_lr_ratio: f64,
    /// AdamW weight decay.
    #[arg(long, default_value_t = defaults().weight_decay)]
    weight_decay: f64,
    /// Largest global gradient norm.
    #[arg(long, default_value_t = defaults().grad_clip)]
    grad_clip: f64,
    /// Model width.
    #[arg(long, default_value_t = defaults().d_model)]
    d_model: usize,
    /// Attention heads per block (must divide d_model).
    #[arg(long, default_value_t = defaults().n_heads)]
    n_heads: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = defaults().n_layers)]
    n_layers: usize,
    /// Hidden width of each block's MLP.
    #[arg(long, default_value_t = defaults().d_ff)]
    d_ff: usize,
    /// Learned positions; at least 2 × digits.
    #[arg(long, default_value_t = defaults().max_len)]
    max_len: usize,
    /// Dropout on embeddings and residual branches.
    #[arg(long, default_value_t = defaults().dropout)]
    dropout: f64,
    /// Run every step op by op instead of compiling the loss (forward and
    /// cross entropy through tessera::compile, the backward compiled ahead
    /// of time): to compare.
    #[arg(long)]
    eager: bool,
    /// Training precision: f32, or the forward under bf16 or f16 autocast
    /// (f16 with dynamic loss scaling); weights and optimizer state stay f32.
    #[arg(long, default_value_t = defaults().dtype)]
    dtype: DType,
    /// Seeds the initialisation and the training batches.
    #[arg(long, default_value_t = defaults().seed)]
    seed: u64,
    /// Evaluate on the held-out set every N steps (and after the last)
    /// [default: 100 for reverse, 50 for digits].
    #[arg(long, value_name = "N")]
    eval_every: Option<usize>,
    /// Strings in the held-out set.
    #[arg(long, default_value_t = defaults().eval_size)]
    eval_size: usize,
    /// Where to write model.safetensors, loss.png and summary.json
    /// (created if missing).
    #[arg(long, value_name = "DIR", default_value = "train-out")]
    out_dir: PathBuf,
    /// cpu or cuda: where the model, the optimizer state and every step run.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Data parallel over this many GPUs (--device cuda): one process per
    /// GPU, each training on --batch ÷ gpus strings of every batch (--batch
    /// is the global batch), gradients all-reduced over NCCL while the
    /// backward runs; rank 0 prints and writes the artifacts.
    #[arg(long, default_value_t = 1)]
    gpus: usize,
    /// Data parallel over this many ranks on the CPU (--device cpu):
    /// threads of this process, each with its share of the cores and of
    /// every batch, over the in-memory communicator (what --gpus does with
    /// processes and NCCL).
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// With --gpus or --ranks: shard AdamW's state over the ranks (ZeRO-1).
    #[arg(long)]
    zero: bool,
}

impl TrainArgs {
    fn config(&self) -> TrainConfig {
        let d = defaults();
        TrainConfig {
            digits: self.digits,
            steps: self.steps.unwrap_or(d.steps),
            batch: self.batch.unwrap_or(d.batch),
            lr: self.lr.unwrap_or(d.lr),
            warmup: self.warmup.unwrap_or(d.warmup),
            decay: self.decay,
            final_lr_ratio: self.final_lr_ratio,
            weight_decay: self.weight_decay,
            grad_clip: self.grad_clip,
            d_model: self.d_model,
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            d_ff: self.d_ff,
            max_len: self.max_len,
            dropout: self.dropout,
            execution: match self.eager {
                true => Execution::Eager,
                false => Execution::Compiled,
            },
            dtype: self.dtype,
            seed: self.seed,
            eval_every: self.eval_every.unwrap_or(d.eval_every),
            eval_size: self.eval_size,
            checkpoint: Some(self.out_dir.join("model.safetensors")),
            plot: Some(self.out_dir.join("loss.png")),
        }
    }

    /// The digits task's settings: its own defaults, the shared flags
    /// (steps, batch, lr, warmup, weight decay, eager, seed, eval every,
    /// output folder) where given.
    fn digits_config(&self) -> DigitsConfig {
        let d = DigitsConfig::default();
        DigitsConfig {
            steps: self.steps.unwrap_or(d.steps),
            batch: self.batch.unwrap_or(d.batch),
            lr: self.lr.unwrap_or(d.lr),
            warmup: self.warmup.unwrap_or(d.warmup),
            weight_decay: d.weight_decay,
            channels: d.channels,
            execution: match self.eager {
                true => Execution::Eager,
                false => Execution::Compiled,
            },
            seed: self.seed,
            eval_every: self.eval_every.unwrap_or(d.eval_every),
            checkpoint: Some(self.out_dir.join("model.safetensors")),
            plot: Some(self.out_dir.join("loss.png")),
        }
    }
}

pub fn run(args: &TrainArgs) -> Result<()> {
    if args.task == Task::Digits {
        return run_digits(args);
    }
    let config = args.config();
    // Bad flags fail here, before any output, process or training.
    config.validate()?;
    let (gpus, ranks) = (args.gpus, args.ranks);
    if gpus == 0 || ranks == 0 {
        return Err(anyhow!("--gpus and --ranks must be at least 1"));
    }
    if gpus > 1 && ranks > 1 {
        return Err(anyhow!(
            "--gpus {gpus} and --ranks {ranks}: one or the other (GPUs, or CPU threads)"
        ));
    }
    if args.zero && gpus.max(ranks) == 1 {
        return Err(anyhow!(
            "--zero shards the optimizer over ranks: needs --gpus or --ranks 2 or more"
        ));
    }
    check_data_parallel(&config, gpus.max(ranks))?;
    match (gpus, ranks) {
        (1, r) if r > 1 => run_threads(args, &config, r),
        (g, _) => match crate::launch::role(g, &args.device)? {
            Role::Launched => Ok(()),
            Role::Alone => run_reverse(args, &config, crate::device::open(&args.device)?, None),
            Role::Rank(group) => run_reverse(args, &config, Device::Cuda, Some(dp(args, group))),
        },
    }
}

fn dp(args: &TrainArgs, group: ProcessGroup) -> DataParallel {
    DataParallel::new(group).zero(args.zero)
}

/// `--ranks N`: N threads of this process, each a rank with an equal share
/// of the cores (as the launcher gives each GPU's process).
fn run_threads(args: &TrainArgs, config: &TrainConfig, ranks: usize) -> Result<()> {
    if args.device != "cpu" {
        return Err(anyhow!(
            "--ranks {ranks} trains on CPU threads: needs --device cpu (for GPUs, --gpus)"
        ));
    }
    let cores = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let per_rank = (cores / ranks).max(1);
    let results = dist::spawn(ranks, per_rank, |group| {
        run_reverse(args, config, Device::Cpu, Some(dp(args, group)))
    })
    .map_err(|e| anyhow!("--ranks {ranks}: {}", e.message))?;
    results.into_iter().collect()
}

/// Trains the reversal task, alone or as one rank of `dp`; only rank 0
/// prints and writes.
fn run_reverse(
    args: &TrainArgs,
    config: &TrainConfig,
    device: Device,
    dp: Option<DataParallel>,
) -> Result<()> {
    let lead = dp.as_ref().is_none_or(|dp| dp.group.rank() == 0);
    let parallel = dp.as_ref().map(|dp| {
        let world = dp.group.world();
        let unit = if args.gpus > 1 { "GPUs" } else { "CPU ranks" };
        let zero = if dp.zero {
            ", AdamW state sharded (ZeRO-1)"
        } else {
            ""
        };
        format!(
            "; data parallel over {world} {unit}, {} strings each{zero}",
            config.batch / world
        )
    });
    let c = config;
    if !lead {
        return train_rank(config, device, dp, |_| {})
            .map(drop)
            .map_err(Into::into);
    }
    println!(
        "reversing {}-digit strings: TransformerLM d_model {}, {} heads, {} layers, d_ff {}; \
         {} steps of batch {}, lr {} ({} decay, warmup {}), seed {}, {} {}, on {device}{}",
        c.digits,
        c.d_model,
        c.n_heads,
        c.n_layers,
        c.d_ff,
        c.steps,
        c.batch,
        c.lr,
        c.decay,
        c.warmup,
        c.seed,
        c.execution,
        c.dtype,
        parallel.unwrap_or_default()
    );
    let bar = progress_bar(c.steps as u64);
    let mut last_accuracy = None;
    let report = train_rank(config, device, dp, |p| {
        if let Some(e) = p.eval {
            last_accuracy = Some(e.accuracy.exact_match);
            bar.suspend(|| println!("{}", eval_line(p)));
        }
        bar.set_position(p.step as u64);
        bar.set_message(status(p, last_accuracy));
    });
    bar.finish_and_clear();
    let report = report?;
    write_summary(&args.out_dir.join("summary.json"), &report)?;
    print_summary(&report, &args.out_dir);
    Ok(())
}

/// `tessera train --task digits`.
fn run_digits(args: &TrainArgs) -> Result<()> {
    if args.gpus != 1 || args.ranks != 1 || args.zero {
        return Err(anyhow!(
            "--task digits trains on one CPU: --gpus, --ranks and --zero are for --task reverse"
        ));
    }
    if args.dtype != DType::F32 || args.device != "cpu" {
        return Err(anyhow!(
            "--task digits trains in f32 on the cpu (got --dtype {}, --device {})",
            args.dtype,
            args.device
        ));
    }
    let config = args.digits_config();
    config.validate()?;
    let c = &config;
    println!(
        "8x8 digits: CNN conv3x3({}) relu maxpool, conv3x3({}) relu maxpool, linear(10); \
         {} steps of batch {}, lr {} (cosine decay, warmup {}), seed {}, {} f32, on cpu",
        c.channels[0], c.channels[1], c.steps, c.batch, c.lr, c.warmup, c.seed, c.execution
    );
    let bar = progress_bar(c.steps as u64);
    let mut last_accuracy = None;
    let report = train_digits(&config, |p| {
        if let Some(e) = p.eval {
            last_accuracy = Some(e.accuracy.exact_match);
            bar.suspend(|| println!("{}", digits_eval_line(p)));
        }
        bar.set_position(p.step as u64);
        let acc = last_accuracy.map_or("-".to_string(), |a| format!("{:.1}%", a * 100.0));
        bar.set_message(format!(
            "loss {:.4}  acc {acc}  {:.0} img/s",
            p.loss, p.images_per_s
        ));
    });
    bar.finish_and_clear();
    let report = report?;
    write_json(&args.out_dir.join("summary.json"), &report)?;
    print_digits_summary(&report, &args.out_dir);
    Ok(())
}

fn digits_eval_line(p: &DigitsProgress) -> String {
    let e = p.eval.expect("called on eval steps");
    format!(
        "step {:>5}/{}  loss {:.4}  lr {:.2e}  test accuracy {:6.2}%  {:.0} img/s",
        e.step,
        p.steps,
        p.loss,
        p.lr,
        e.accuracy.exact_match * 100.0,
        p.images_per_s
    )
}

fn print_digits_summary(report: &DigitsReport, out_dir: &Path) {
    println!(
        "final test accuracy {:.2}% ({} test images, {} training); {} parameters",
        report.final_accuracy * 100.0,
        report.test_images,
        report.train_images,
        report.num_parameters
    );
    println!(
        "wall time {:.1} s (training {:.1} s, {:.2} ms/step, {:.0} images/s; {} f32)",
        report.wall_time_s,
        report.train_time_s,
        report.ms_per_step,
        report.images_per_s,
        report.config.execution
    );
    if let Some(c) = &report.compile {
        println!(
            "compile: {} compile{} ({} recompile{}) in {:.1} ms",
            c.compiles,
            plural(c.compiles),
            c.recompiles,
            plural(c.recompiles),
            c.compile_seconds * 1e3
        );
    }
    println!(
        "wrote {0}/model.safetensors, {0}/loss.png, {0}/summary.json",
        out_dir.display()
    );
}

fn write_json(path: &Path, report: &DigitsReport) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| anyhow!("{}: {e}", dir.display()))?;
    }
    let json = serde_json::to_string_pretty(report)?;
    std::fs::write(path, json + "\n").map_err(|e| anyhow!("{}: {e}", path.display()))
}

/// Drawn on stderr, and only on a terminal: piped output (CI, logs) gets
/// the eval lines and the summary alone.
fn progress_bar(steps: u64) -> ProgressBar {
    let bar = ProgressBar::new(steps);
    let style = ProgressStyle::with_template(
        "{bar:30.cyan/blue} {pos:>5}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
    )
    .expect("a valid progress template")
    .progress_chars("=> ");
    bar.set_style(style);
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

fn status(p: &Progress, accuracy: Option<f64>) -> String {
    let acc = accuracy.map_or("-".to_string(), |a| format!("{:.1}%", a * 100.0));
    format!("loss {:.4}  acc {acc}  {:.0} tok/s", p.loss, p.tokens_per_s)
}

fn eval_line(p: &Progress) -> String {
    let e = p.eval.expect("called on eval steps");
    format!(
        "step {:>5}/{}  loss {:.4}  lr {:.2e}  exact match {:6.2}%  token accuracy {:6.2}%  {:.0} tok/s",
        e.step,
        p.steps,
        p.loss,
        p.lr,
        e.accuracy.exact_match * 100.0,
        e.accuracy.token * 100.0,
        p.tokens_per_s
    )
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

fn write_summary(path: &Path, report: &TrainReport) -> Result<()> {
    let json = serde_json::to_string_pretty(report)?;
    std::fs::write(path, json + "\n").map_err(|e| anyhow!("{}: {e}", path.display()))
}

fn print_summary(report: &TrainReport, out_dir: &Path) {
    println!(
        "final held-out exact match {:.2}% ({} strings); {} parameters",
        report.final_accuracy * 100.0,
        report.config.eval_size,
        report.num_parameters
    );
    println!(
        "wall time {:.1} s (training {:.1} s, {:.2} ms/step, median {:.2} ms, {:.0} tokens/s; {} {})",
        report.wall_time_s,
        report.train_time_s,
        report.ms_per_step,
        report.median_step_ms,
        report.tokens_per_s,
        report.config.execution,
        report.config.dtype
    );
    if report.ranks > 1 {
        println!(
            "data parallel: {} ranks of {} strings each{} (tokens/s counts every rank's)",
            report.ranks,
            report.config.batch / report.ranks,
            if report.zero { ", ZeRO-1" } else { "" }
        );
    }
    if let Some(c) = &report.compile {
        println!(
            "compile: {} compile{} ({} recompile{}) in {:.1} ms, tracing {:.1} ms over {} steps{}",
            c.compiles,
            plural(c.compiles),
            c.recompiles,
            plural(c.recompiles),
            c.compile_seconds * 1e3,
            c.trace_seconds * 1e3,
            report.losses.len(),
            match c.eager_calls {
                0 => String::new(),
                n => format!(", {n} eager calls past the recompile limit"),
            }
        );
    }
    if let Some(c) = report.compile.as_ref().filter(|c| c.recompiles > 0) {
        println!("recompiled: {}", c.recompile_reasons.join("; "));
    }
    if let Some(scale) = report.loss_scale {
        println!(
            "f16 loss scale {scale} at the end; {} step{} skipped (overflowing gradients)",
            report.skipped_steps,
            plural(report.skipped_steps)
        );
    }
    println!(
        "wrote {0}/model.safetensors, {0}/loss.png, {0}/summary.json",
        out_dir.display()
    );
}
