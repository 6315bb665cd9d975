//! Convolutional layers: `Conv1d`, `Conv2d`, `BatchNorm2d`, `MaxPool2d`,
//! `AvgPool2d`, `AdaptiveAvgPool2d` (NCHW, PyTorch's layouts and defaults).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use super::{input_error, join_name, within, ParamStore, Parameter};
use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::tensor::trace::{self, StateSlot};
use crate::tensor::{unwrap_or_panic, BatchNormStats, ConvOptions, Generator, PoolOptions, Tensor};

/// Registers a convolution's weight `[out, in/groups, k…]` and bias
/// `[out]`, drawn uniformly from `[-1/√fan_in, 1/√fan_in)` as PyTorch's
/// default initialisation gives.
fn conv_params(
    store: &mut ParamStore,
    name: &str,
    shape: &[usize],
    bias: bool,
    generator: &mut Generator,
) -> (Parameter, Option<Parameter>) {
    let fan_in: usize = shape[1..].iter().product();
    let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
    let weight = store.uniform(&join_name(name, "weight"), shape, bound, generator);
    let bias = bias.then(|| store.uniform(&join_name(name, "bias"), &shape[..1], bound, generator));
    (weight, bias)
}

#[track_caller]
fn check_input(kind: &str, name: &str, x: &Tensor, rank: usize, channels: usize) -> Result<()> {
    if x.rank() == rank && x.shape()[1] == channels && x.dtype().is_float() {
        return Ok(());
    }
    let dims = ["N", "C", "H", "W"];
    let layout = match rank {
        3 => "[N, C, L]".to_string(),
        _ => format!("[{}]", dims[..rank].join(", ")),
    };
    Err(input_error(
        kind,
        name,
        format!(
            "input {} must be a float {layout} tensor with C = {channels}",
            x.ty()
        ),
    )
    .at(SourceLoc::caller()))
}

/// `torch.nn.Conv2d`: weight `[out, in/groups, kh, kw]`, bias `[out]`.
pub struct Conv2d {
    name: String,
    pub weight: Parameter,
    pub bias: Option<Parameter>,
    in_channels: usize,
    options: ConvOptions,
}

impl Conv2d {
    #[allow(clippy::too_many_arguments)]
    /// Registers `name.weight` and, with `bias`, `name.bias`. Panics when
    /// `groups` does not divide both channel counts (a programming error).
    #[track_caller]
    pub fn new(
        store: &mut ParamStore,
        name: &str,
        in_channels: usize,
        out_channels: usize,
        kernel: [usize; 2],
        options: ConvOptions,
        bias: bool,
        generator: &mut Generator,
    ) -> Conv2d {
        let g = options.groups;
        assert!(
            g > 0 && in_channels.is_multiple_of(g) && out_channels.is_multiple_of(g),
            "Conv2d `{name}`: groups ({g}) must divide in_channels ({in_channels}) and out_channels ({out_channels})"
        );
        let shape = [out_channels, in_channels / g, kernel[0], kernel[1]];
        let (weight, bias) = conv_params(store, name, &shape, bias, generator);
        Conv2d {
            name: name.to_string(),
            weight,
            bias,
            in_channels,
            options,
        }
    }

    pub fn options(&self) -> ConvOptions {
        self.options
    }

    /// `x [N, in, H, W]` → `[N, out, Ho, Wo]`.
    #[track_caller]
    pub fn forward(&self, x: &Tensor) -> Tensor {
        unwrap_or_panic(self.try_forward(x))
    }

    /// [`Conv2d::forward`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        check_input("Conv2d", &self.name, x, 4, self.in_channels)?;
        let bias = self.bias.as_ref().map(|b| b.get());
        x.try_conv2d(&self.weight.get(), bias.as_ref(), self.options)
            .map_err(|e| within(e, "Conv2d", &self.name))
    }
}

/// `torch.nn.Conv1d`: weight `[out, in/groups, k]`, bias `[out]`; the
/// width entries of the options apply.
pub struct Conv1d {
    name: String,
    pub weight: Parameter,
    pub bias: Option<Parameter>,
    in_channels: usize,
    options: ConvOptions,
}

impl Conv1d {
    /// Registers `name.weight` and, with `bias`, `name.bias`.
    #[allow(clippy::too_many_arguments)]
    #[track_caller]
    pub fn new(
        store: &mut ParamStore,
        name: &str,
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        options: ConvOptions,
        bias: bool,
        generator: &mut Generator,
    ) -> Conv1d {
        let g = options.groups;
        assert!(
            g > 0 && in_channels.is_multiple_of(g) && out_channels.is_multiple_of(g),
            "Conv1d `{name}`: groups ({g}) must divide in_channels ({in_channels}) and out_channels ({out_channels})"
        );
        let shape = [out_channels, in_channels / g, kernel];
        let (weight, bias) = conv_params(store, name, &shape, bias, generator);
        Conv1d {
            name: name.to_string(),
            weight,
            bias,
            in_channels,
            options,
        }
    }

    /// `x [N, in, L]` → `[N, out, Lo]`.
    #[track_caller]
    pub fn forward(&self, x: &Tensor) -> Tensor {
        unwrap_or_panic(self.try_forward(x))
    }

    /// [`Conv1d::forward`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        check_input("Conv1d", &self.name, x, 3, self.in_channels)?;
        let bias = self.bias.as_ref().map(|b| b.get());
        x.try_conv1d(&self.weight.get(), bias.as_ref(), self.options)
            .map_err(|e| within(e, "Conv1d", &self.name))
    }
}

/// `torch.nn.BatchNorm2d` (and 1d: any `[N, C, …]` input): in training,
/// normalises with the batch's statistics and updates the running ones
/// (`momentum` 0.1, unbiased variance); in eval, uses the running
/// statistics. `affine` adds `weight` (ones) and `bias` (zeros).
///
/// The running statistics are module state, updated by a forward in
/// training mode. Eagerly the module writes them itself; inside a compiled
/// function (`tessera::compile`, `compile::train_step`) the new statistics
/// are extra outputs of the compiled graph, installed in the module after
/// each run (see `tensor::trace::write_state`), so a compiled step updates
/// them as the eager one does. A trace that cannot write state back (a
/// bare `trace::trace`) makes training mode an error.
pub struct BatchNorm2d {
    name: String,
    num_features: usize,
    pub eps: f64,
    pub momentum: f64,
    /// `(weight, bias)`.
    pub affine: Option<(Parameter, Parameter)>,
    running: Option<Arc<RunningStats>>,
    training: AtomicBool,
}

/// A batch norm's running statistics: the module's state slot.
struct RunningStats {
    name: String,
    stats: RwLock<BatchNormStats>,
}

impl RunningStats {
    fn get(&self) -> BatchNormStats {
        self.stats.read().expect("running statistics").clone()
    }

    fn set(&self, stats: BatchNormStats) {
        *self.stats.write().expect("running statistics") = stats;
    }

    /// The key of this slot in a trace.
    fn key(self: &Arc<Self>) -> usize {
        Arc::as_ptr(self) as usize
    }
}

impl StateSlot for RunningStats {
    fn install(&self, values: Vec<Tensor>) {
        // `try_forward` writes [mean, var].
        let mut values = values.into_iter();
        if let (Some(mean), Some(var)) = (values.next(), values.next()) {
            self.set(BatchNormStats { mean, var });
        }
    }

    fn describe(&self) -> String {
        format!("the running statistics of BatchNorm2d `{}`", self.name)
    }
}

impl BatchNorm2d {
    /// PyTorch's defaults: eps 1e-5, momentum 0.1, affine, running
    /// statistics (mean 0, variance 1), training mode.
    #[track_caller]
    pub fn new(store: &mut ParamStore, name: &str, num_features: usize) -> BatchNorm2d {
        BatchNorm2d::with_options(store, name, num_features, 1e-5, 0.1, true, true)
    }

    /// Every option of `torch.nn.BatchNorm2d`.
    #[track_caller]
    pub fn with_options(
        store: &mut ParamStore,
        name: &str,
        num_features: usize,
        eps: f64,
        momentum: f64,
        affine: bool,
        track_running_stats: bool,
    ) -> BatchNorm2d {
        let affine = affine.then(|| {
            (
                store.constant(&join_name(name, "weight"), &[num_features], 1.0),
                store.constant(&join_name(name, "bias"), &[num_features], 0.0),
            )
        });
        let running = track_running_stats.then(|| {
            Arc::new(RunningStats {
                name: name.to_string(),
                stats: RwLock::new(BatchNormStats {
                    mean: Tensor::zeros(&[num_features], store.dtype()),
                    var: Tensor::ones(&[num_features], store.dtype()),
                }),
            })
        });
        BatchNorm2d {
            name: name.to_string(),
            num_features,
            eps,
            momentum,
            affine,
            running,
            training: AtomicBool::new(true),
        }
    }

    /// Training (true) or eval (false) mode.
    pub fn train(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
    }

    pub fn is_training(&self) -> bool {
        self.training.load(Ordering::Relaxed)
    }

    /// The running statistics (`None` without `track_running_stats`).
    pub fn running_stats(&self) -> Option<BatchNormStats> {
        self.running.as_ref().map(|r| r.get())
    }

    /// Replaces the running statistics (loading a trained model).
    pub fn set_running_stats(&self, stats: BatchNormStats) -> Result<()> {
        let Some(r) = &self.running else {
            return Err(Error::op(
                ErrorKind::Argument,
                format!("BatchNorm2d `{}`", self.name),
                "has no running statistics (track_running_stats is off)".to_string(),
            ));
        };
        let want = [self.num_features];
        if stats.mean.shape() != want || stats.var.shape() != want {
            return Err(Error::op(
                ErrorKind::Shape,
                format!("BatchNorm2d `{}`", self.name),
                format!(
                    "running statistics must be [{}], got mean {}, var {}",
                    self.num_features,
                    stats.mean.ty(),
                    stats.var.ty()
                ),
            ));
        }
        r.set(stats);
        Ok(())
    }

    /// `x [N, C, …]` → the same shape.
    #[track_caller]
    pub fn forward(&self, x: &Tensor) -> Tensor {
        unwrap_or_panic(self.try_forward(x))
    }

    /// [`BatchNorm2d::forward`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        let at = SourceLoc::caller();
        if x.rank() < 2 || x.shape()[1] != self.num_features || !x.dtype().is_float() {
            return Err(input_error(
                "BatchNorm2d",
                &self.name,
                format!(
                    "input {} must be a float [N, {}, …] tensor",
                    x.ty(),
                    self.num_features
                ),
            )
            .at(at));
        }
        let training = self.is_training();
        let traced = trace::is_active();
        if training && self.running.is_some() && traced && !trace::accepts_state() {
            return Err(input_error(
                "BatchNorm2d",
                &self.name,
                "training mode updates the running statistics, which this trace cannot write back (a compiled function can): call `train(false)`, or compile with `tessera::compile`".to_string(),
            )
            .at(at));
        }
        // A second call in one traced call reads the first one's update.
        let stats = match (&self.running, traced) {
            (Some(r), true) => trace::state_written(r.key())
                .and_then(|v| <[Tensor; 2]>::try_from(v).ok())
                .map(|[mean, var]| BatchNormStats { mean, var })
                .or_else(|| self.running_stats()),
            _ => self.running_stats(),
        };
        let affine = self.affine.as_ref().map(|(w, b)| (w.get(), b.get()));
        let (y, update) = x
            .try_batch_norm(
                stats.as_ref(),
                affine.as_ref().map(|a| &a.0),
                affine.as_ref().map(|a| &a.1),
                training,
                self.momentum,
                self.eps,
            )
            .map_err(|e| within(e, "BatchNorm2d", &self.name))?;
        if let (Some(update), Some(r)) = (update, &self.running) {
            match traced {
                true => trace::write_state(r.key(), r.clone(), vec![update.mean, update.var])
                    .map_err(|e| within(e.at(at), "BatchNorm2d", &self.name))?,
                false => r.set(update),
            }
        }
        Ok(y)
    }
}

/// `torch.nn.MaxPool2d`.
pub struct MaxPool2d {
    pub options: PoolOptions,
}

impl MaxPool2d {
    pub fn new(options: PoolOptions) -> MaxPool2d {
        MaxPool2d { options }
    }

    #[track_caller]
    pub fn forward(&self, x: &Tensor) -> Tensor {
        x.max_pool2d(self.options)
    }

    #[track_caller]
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        x.try_max_pool2d(self.options)
    }
}

/// `torch.nn.AvgPool2d`.
pub struct AvgPool2d {
    pub options: PoolOptions,
}

impl AvgPool2d {
    pub fn new(options: PoolOptions) -> AvgPool2d {
        AvgPool2d { options }
    }

    #[track_caller]
    pub fn forward(&self, x: &Tensor) -> Tensor {
        x.avg_pool2d(self.options)
    }

    #[track_caller]
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        x.try_avg_pool2d(self.options)
    }
}

/// `torch.nn.AdaptiveAvgPool2d`.
pub struct AdaptiveAvgPool2d {
    pub output: [usize; 2],
}

impl AdaptiveAvgPool2d {
    pub fn new(output: [usize; 2]) -> AdaptiveAvgPool2d {
        AdaptiveAvgPool2d { output }
    }

    #[track_caller]
    pub fn forward(&self, x: &Tensor) -> Tensor {
        x.adaptive_avg_pool2d(self.output)
    }

    #[track_caller]
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        x.try_adaptive_avg_pool2d(self.output)
    }
}
