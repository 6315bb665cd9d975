//! `tessera bench`: benchmarks that print one JSON line each on stdout
//! (progress and diagnostics on stderr).
//!
//! `tessera bench gpt`: a GPT training step (forward, cross-entropy,
//! backward, AdamW), eager or compiled whole, in f32 or bf16/f16 autocast,
//! on the CPU or the GPU; the PyTorch side is
//! `scripts/anchors/gpt_torch.py` (`scripts/bench_gpt.sh` runs both).

use anyhow::Result;
use clap::{Args, Subcommand};
use tessera::hints::Strategy;
use tessera::runtime::device::Device;
use tessera::DType;
use tessera_apps::bench::{parse_schedule, run_gpt, GptBenchConfig, Mode};
use tessera_apps::bench_resnet::{run_resnet, ResNetBenchConfig, ResNetTask};

use crate::launch::Role;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Time the training step of a GPT-2-shaped TransformerLM (forward,
    /// cross-entropy, backward, AdamW) on a random token batch; print
    /// ms/step, tokens/s, peak memory and compile time as one JSON line.
    /// The defaults are GPT-2 small (12 layers, d768, 12 heads, vocab
    /// 50304, batch 8 × 1024): a GPU's size. On the CPU use e.g.
    /// `--layers 4 --d-model 256 --heads 4 --vocab 1024 --seq 128`.
    Gpt(GptArgs),
    /// Time a ResNet-18/50 on the CPU or the GPU: the compiled eval-mode forward
    /// (`--task inference`) or a compiled training step (`--task train`:
    /// forward, cross-entropy, backward, SGD with momentum, batch norm's
    /// batch statistics and running update) on a random batch; print
    /// ms/step as one JSON line. PyTorch's side:
    /// `scripts/anchors/resnet_torch.py` with the same flags.
    Resnet(ResNetArgs),
}

#[derive(Args)]
pub struct ResNetArgs {
    /// 18 or 50.
    #[arg(long, default_value_t = 50)]
    depth: usize,
    /// inference or train.
    #[arg(long, default_value = "inference", value_parser = str::parse::<ResNetTask>)]
    task: ResNetTask,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// The input's side (3 × image × image).
    #[arg(long, default_value_t = 224)]
    image: usize,
    #[arg(long, default_value_t = 1000)]
    classes: usize,
    /// Timed runs (their median is ms_median).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Untimed runs first (the compile).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// cpu or cuda: where the model and the runs live.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32, bf16 or f16: the parameters', batch-norm statistics' and
    /// batch's dtype (PyTorch's `model.to(dtype)`).
    #[arg(long, default_value_t = DType::F32)]
    dtype: DType,
    /// --device cuda: record each run once as a CUDA graph and replay it
    /// (tessera::compile's mode=reduce-overhead).
    #[arg(long)]
    cuda_graphs: bool,
}

fn defaults() -> GptBenchConfig {
    GptBenchConfig::default()
}

#[derive(Args)]
pub struct GptArgs {
    /// Transformer blocks.
    #[arg(long, default_value_t = defaults().layers)]
    layers: usize,
    /// Model width.
    #[arg(long, default_value_t = defaults().d_model)]
    d_model: usize,
    /// Attention heads (must divide --d-model).
    #[arg(long, default_value_t = defaults().heads)]
    heads: usize,
    /// The MLP's hidden width [default: 4 × d-model].
    #[arg(long)]
    d_ff: Option<usize>,
    /// Vocabulary size (the untied head's width).
    #[arg(long, default_value_t = defaults().vocab)]
    vocab: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = defaults().batch)]
    batch: usize,
    /// Tokens per sequence (also the learned positions).
    #[arg(long, default_value_t = defaults().seq)]
    seq: usize,
    /// Timed steps (their median is ms_median).
    #[arg(long, default_value_t = defaults().steps)]
    steps: usize,
    /// Untimed steps first (the compile, the allocator's pools).
    #[arg(long, default_value_t = defaults().warmup)]
    warmup: usize,
    /// f32, or the forward under bf16 or f16 autocast (f32 master weights;
    /// f16 with a dynamic loss scaler, eager or inside the compiled step).
    #[arg(long, default_value_t = defaults().dtype)]
    dtype: DType,
    /// eager (op by op), compiled (the whole step as one graph:
    /// tessera::compile::train_step) or compiled-model (the model and loss
    /// compiled with an ahead-of-time backward, AdamW eager: what
    /// torch.compile(model) does; a memory budget can then recompute the
    /// saved activations or move them to host memory).
    #[arg(long, default_value_t = defaults().mode, value_parser = str::parse::<Mode>)]
    mode: Mode,
    /// cpu or cuda: where the model, the optimizer state and the steps run.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Seeds the initial weights and the token batch.
    #[arg(long, default_value_t = defaults().seed)]
    seed: u64,
    /// The compiled step's kernel order: bfs, dfs, strict or auto [default:
    /// the compiler's, auto].
    #[arg(long, value_parser = parse_schedule)]
    schedule: Option<Strategy>,
    /// Compiled: run the cached executable of a step whose inputs pass its
    /// guards without tracing the model again (the model's ops depend on
    /// nothing else); saves the trace's host time each step.
    #[arg(long)]
    no_retrace: bool,
    /// Compiled: record the step once as a CUDA graph and replay it
    /// (tessera::compile's mode=reduce-overhead): no host dispatch per
    /// kernel. Steps whose recording fails run kernel by kernel
    /// (TESSERA_LOGS=cudagraphs says why).
    #[arg(long)]
    cuda_graphs: bool,
    /// Compiled: the memory budget in MiB of the step's graph (compiled)
    /// or of the model's forward graph (compiled-model: saved activations
    /// over it are recomputed or offloaded, by estimated cost); the JSON's
    /// `peak_mb` is what the device's allocator then measured.
    #[arg(long)]
    memory_budget_mb: Option<f64>,
    /// Data parallel over this many GPUs (--device cuda): one process per
    /// GPU, each with --batch sequences of its own (global batch = gpus ×
    /// batch), gradients all-reduced over NCCL while the backward runs;
    /// tokens_per_s counts every GPU's tokens.
    #[arg(long, default_value_t = 1)]
    gpus: usize,
    /// With --gpus: shard AdamW's state over the GPUs (ZeRO-1).
    #[arg(long)]
    zero: bool,
    /// With --gpus: the gradient buckets' most MiB (each bucket one
    /// all-reduce; a parameter larger than it is a bucket of its own)
    /// [default: 25, PyTorch DDP's].
    #[arg(long)]
    bucket_mb: Option<f64>,
}

impl GptArgs {
    fn config(&self) -> GptBenchConfig {
        GptBenchConfig {
            layers: self.layers,
            d_model: self.d_model,
            heads: self.heads,
            d_ff: self.d_ff.unwrap_or(4 * self.d_model),
            vocab: self.vocab,
            batch: self.batch,
            seq: self.seq,
            steps: self.steps,
            warmup: self.warmup,
            dtype: self.dtype,
            mode: self.mode,
            seed: self.seed,
            schedule: self.schedule,
            retrace: !self.no_retrace,
            cuda_graphs: self.cuda_graphs,
            memory_budget_mb: self.memory_budget_mb,
            group: None,
            zero: self.zero,
            bucket_mb: self.bucket_mb,
        }
    }
}

pub fn run(command: &BenchCommand) -> Result<()> {
    match command {
        BenchCommand::Gpt(args) => gpt(args),
        BenchCommand::Resnet(args) => resnet(args),
    }
}

fn resnet(a: &ResNetArgs) -> Result<()> {
    let device = crate::device::open(&a.device)?;
    let config = ResNetBenchConfig {
        depth: a.depth,
        task: a.task,
        batch: a.batch,
        image: a.image,
        classes: a.classes,
        steps: a.steps,
        warmup: a.warmup,
        seed: a.seed,
        device,
        dtype: a.dtype,
        cuda_graphs: a.cuda_graphs,
    };
    eprintln!(
        "bench resnet: resnet{} {}, batch {} × 3 × {}², {} on {device}, {} + {} warmup runs; load average {}",
        a.depth,
        a.task.name(),
        a.batch,
        a.image,
        a.dtype,
        a.steps,
        a.warmup,
        load_average()
    );
    let report = run_resnet(&config, |i, ms| {
        // TESSERA_CUDA_PROFILE=1 times the timed runs only.
        if i + 1 == a.warmup {
            tessera_cuda::profile::reset();
        }
        eprintln!(
            "run {i:>3}{}  {ms:.1} ms",
            if i < a.warmup { " (warmup)" } else { "" }
        )
    })?;
    let profile = tessera_cuda::profile::report(40);
    if !profile.is_empty() {
        eprintln!("over the {} timed runs: {profile}", a.steps);
    }
    eprintln!("load average {}", load_average());
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

fn gpt(args: &GptArgs) -> Result<()> {
    let mut config = args.config();
    let device = match crate::launch::role(args.gpus, &args.device)? {
        Role::Launched => return Ok(()),
        Role::Alone => {
            // Bad flags fail here, before the device opens or anything runs.
            config.validate()?;
            crate::device::open(&args.device)?
        }
        Role::Rank(group) => {
            config.group = Some(group);
            config.validate()?;
            Device::Cuda
        }
    };
    let rank = config.group.as_ref().map_or(0, |g| g.rank());
    let c = &config;
    eprintln!(
        "bench gpt: {} layers, d_model {}, {} heads, d_ff {}, vocab {}; batch {} × {}; \
         {} + {} warmup steps, {} {} on {device}, seed {}; load average {}",
        c.layers,
        c.d_model,
        c.heads,
        c.d_ff,
        c.vocab,
        c.batch,
        c.seq,
        c.steps,
        c.warmup,
        c.mode,
        c.dtype,
        c.seed,
        load_average()
    );
    let report = run_gpt(&config, device, |p| {
        // TESSERA_CUDA_PROFILE=1 times the timed steps only.
        if p.warmup && p.step == c.warmup {
            tessera_cuda::profile::reset();
        }
        eprintln!(
            "step {:>3}/{}{}  loss {:.4}  {:.1} ms",
            p.step,
            p.total,
            if p.warmup { " (warmup)" } else { "" },
            p.loss,
            p.ms
        );
    })?;
    let profile = tessera_cuda::profile::report(80);
    if !profile.is_empty() {
        eprintln!("over the {} timed steps: {profile}", c.steps);
    }
    eprintln!("load average {}", load_average());
    if rank == 0 {
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(())
}

/// The 1, 5 and 15 minute load averages (Linux), for the diagnostics.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}
