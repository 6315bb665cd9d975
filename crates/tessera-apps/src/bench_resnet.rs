//! `tessera bench resnet`: a ResNet-18 or ResNet-50 ([`ResNet`], the
//! torchvision architecture) on the CPU or a GPU, timed two ways —
//! inference (eval mode, batch norms folded into the convolutions by the
//! compiler, under `no_grad`) with `tessera::compile`, and a training step
//! (forward, cross-entropy, backward, SGD with momentum, batch statistics
//! and the running update) with `tessera::compile::train_step` — on a
//! random batch, in f32, bf16 or f16 (the parameters, the batch-norm
//! statistics and the batch in that dtype: PyTorch's
//! `model.to(dtype)`). `scripts/anchors/resnet_torch.py` is PyTorch's
//! side: the same architecture, batch, dtype, loss and optimizer, eager or
//! torch.compile, and prints the same JSON fields.
//!
//! `warmup` untimed runs first (the compile), then `steps` timed ones; the
//! median is the figure. Every run reads its result back (which waits for
//! the device) before the clock stops.

use std::time::Instant;

use serde::Serialize;

use tessera::compile::{compile, train_step, Mode};
use tessera::error::{Error, ErrorKind, Result};
use tessera::nn::{try_cross_entropy, ParamStore, ResNet, ResNetConfig};
use tessera::optim::{Sgd, SgdConfig};
use tessera::runtime::device::{self, Device};
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

/// What is timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResNetTask {
    /// The eval-mode forward, compiled.
    Inference,
    /// A whole training step, compiled (`train_step`).
    Train,
}

impl std::str::FromStr for ResNetTask {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<ResNetTask, String> {
        match s {
            "inference" => Ok(ResNetTask::Inference),
            "train" => Ok(ResNetTask::Train),
            _ => Err(format!("expected inference or train, got `{s}`")),
        }
    }
}

impl ResNetTask {
    pub fn name(self) -> &'static str {
        match self {
            ResNetTask::Inference => "inference",
            ResNetTask::Train => "train",
        }
    }
}

/// The benchmark's settings.
#[derive(Clone, Debug)]
pub struct ResNetBenchConfig {
    /// 18 or 50.
    pub depth: usize,
    pub task: ResNetTask,
    pub batch: usize,
    /// Square inputs of this side, 3 channels.
    pub image: usize,
    pub classes: usize,
    pub steps: usize,
    pub warmup: usize,
    pub seed: u64,
    /// Where the model and the runs live (a GPU registered already).
    pub device: Device,
    /// f32, bf16 or f16: the parameters', statistics' and batch's dtype.
    pub dtype: DType,
    /// Record each run as a CUDA graph and replay it
    /// (`Mode::ReduceOverhead`): no host dispatch per kernel.
    pub cuda_graphs: bool,
}

/// One JSON line.
#[derive(Debug, Serialize)]
pub struct ResNetReport {
    pub framework: &'static str,
    pub model: String,
    pub task: &'static str,
    pub batch: usize,
    pub image: usize,
    pub device: String,
    pub dtype: String,
    pub cuda_graphs: bool,
    pub threads: usize,
    pub ms_median: f64,
    pub ms_min: f64,
    pub images_per_s: f64,
    /// The first run (compile included).
    pub first_ms: f64,
    /// The last loss (train) or the logits' mean (inference).
    pub last_value: f64,
}

/// Runs the benchmark on `c.device`; `progress(run, ms)` after each run.
pub fn run_resnet(c: &ResNetBenchConfig, progress: impl FnMut(usize, f64)) -> Result<ResNetReport> {
    if !device::is_available(c.device) {
        return Err(Error::op(
            ErrorKind::Unsupported,
            "bench resnet",
            format!("no backend for device `{}`", c.device),
        ));
    }
    if !matches!(c.dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(Error::op(
            ErrorKind::DType,
            "bench resnet",
            format!("dtype must be f32, bf16 or f16, got {}", c.dtype),
        ));
    }
    device::with_device(c.device, || run_here(c, progress))
}

fn run_here(c: &ResNetBenchConfig, mut progress: impl FnMut(usize, f64)) -> Result<ResNetReport> {
    let config = match c.depth {
        18 => ResNetConfig::resnet18(c.classes),
        50 => ResNetConfig::resnet50(c.classes),
        d => {
            return Err(Error::op(
                ErrorKind::Argument,
                "bench resnet",
                format!("depth must be 18 or 50, got {d}"),
            ))
        }
    };
    if c.batch == 0 || c.steps == 0 || c.image < 32 || c.classes == 0 {
        return Err(Error::op(
            ErrorKind::Argument,
            "bench resnet",
            format!(
                "needs batch, steps and classes > 0 and an image side >= 32, got batch {}, steps {}, image {}, classes {}",
                c.batch, c.steps, c.image, c.classes
            ),
        ));
    }
    let mut store = ParamStore::with_dtype(c.dtype);
    let mut g = Generator::new(c.seed);
    let model = ResNet::new(&mut store, "", config, &mut g);
    let x = Tensor::randn(&[c.batch, 3, c.image, c.image], c.dtype, &mut g);
    let labels: Vec<i64> = (0..c.batch).map(|i| (i % c.classes) as i64).collect();
    let y = Tensor::from_vec(labels, &[c.batch]).to(c.device)?;
    let mut times = Vec::new();
    let mut last_value = 0.0;
    let mut first_ms = 0.0;
    let mut timed = |i: usize, run: &mut dyn FnMut() -> Result<f64>| -> Result<()> {
        let t = Instant::now();
        last_value = run()?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        if i == 0 {
            first_ms = ms;
        }
        if i >= c.warmup {
            times.push(ms);
        }
        progress(i, ms);
        Ok(())
    };
    match c.task {
        ResNetTask::Inference => {
            model.train(false);
            let mode = match c.cuda_graphs {
                true => Mode::ReduceOverhead,
                false => Mode::Default,
            };
            let f = compile(|a: &[Tensor]| vec![model.forward(&a[0])]).mode(mode);
            for i in 0..c.warmup + c.steps {
                timed(i, &mut || {
                    let out = tessera::autograd::no_grad(|| f.try_call(std::slice::from_ref(&x)))?;
                    Ok(out[0].try_mean(&[], false)?.item())
                })?;
            }
        }
        ResNetTask::Train => {
            model.train(true);
            let sgd = Sgd::new(
                store.parameters(),
                SgdConfig {
                    lr: 0.01,
                    momentum: 0.9,
                    weight_decay: 0.0,
                },
            );
            let loss_fn = |b: &[Tensor]| match model
                .try_forward(&b[0])
                .and_then(|l| try_cross_entropy(&l, &b[1], None))
            {
                Ok(l) => l,
                Err(e) => panic!("{e}"),
            };
            let mut step = train_step(loss_fn, sgd);
            if c.cuda_graphs {
                step = step.mode(Mode::ReduceOverhead);
            }
            let batch = [x.clone(), y.clone()];
            for i in 0..c.warmup + c.steps {
                timed(i, &mut || Ok(step.try_step(&batch)?.item()))?;
            }
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    Ok(ResNetReport {
        framework: "tessera",
        model: format!("resnet{}", c.depth),
        task: c.task.name(),
        batch: c.batch,
        image: c.image,
        device: c.device.name().into(),
        dtype: c.dtype.name().into(),
        cuda_graphs: c.cuda_graphs,
        threads: std::env::var("RAYON_NUM_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
            .unwrap_or(1),
        ms_median: median,
        ms_min: times[0],
        images_per_s: c.batch as f64 / (median / 1e3),
        first_ms,
        last_value,
    })
}
