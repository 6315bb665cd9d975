//! One training step, and the one place that decides how it runs
//! ([`Execution`]): eagerly op by op (the loss, its backward under a
//! [`MixedPrecision`], clipping and the AdamW update), or the whole step
//! as one compiled graph (`tessera::compile::train_step`: the forward
//! under autocast, the loss, the backward, clipping, the f16 loss scaler
//! and the AdamW update, the parameters and state donated).

use std::cell::RefCell;
use std::rc::Rc;

use serde::{Deserialize, Serialize};

use super::config::{Execution, TrainConfig};
use super::task::{Batch, IGNORE_INDEX, VOCAB};
use tessera::compile::{train_step, CompileStats, DataParallel, TrainStep};
use tessera::error::{Error, Result};
use tessera::nn::{try_cross_entropy, ParamStore, TransformerLM};
use tessera::optim::{
    clip_grad_norm, AdamW, AdamWConfig, GradScalerConfig, MixedPrecision, Optimizer,
};
use tessera::{autocast, DType, Tensor};

/// The mean cross entropy of the next-token predictions of `batch`'s
/// inputs (`[B, T]` ids) against its targets (`[B·T]`, [`IGNORE_INDEX`]
/// in the prompt): the function the compiled steps compile.
pub fn loss(model: &TransformerLM, inputs: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = model.try_forward(inputs, true)?;
    let flat = logits.try_reshape(&[-1, VOCAB as isize])?;
    try_cross_entropy(&flat, targets, Some(IGNORE_INDEX))
}

/// What a compiled function did: `tessera::compile`'s [`CompileStats`]
/// and why it recompiled.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CompileReport {
    /// Seconds spent building executables (passes, AOT autograd, fusion,
    /// schedules): the first compile and every recompile.
    pub compile_seconds: f64,
    /// Seconds spent tracing: every call traces to find its executable.
    pub trace_seconds: f64,
    /// Executables built (the first compile and every recompile).
    pub compiles: usize,
    pub recompiles: usize,
    pub cache_hits: usize,
    /// Calls that ran eagerly (past the recompile limit).
    pub eager_calls: usize,
    pub graph_breaks: usize,
    /// Why each recompile happened (`input 0, dim 0: expected 64, got 8`).
    pub recompile_reasons: Vec<String>,
}

impl CompileReport {
    pub(super) fn of(stats: CompileStats, recompile_reasons: Vec<String>) -> CompileReport {
        let CompileStats {
            compile_seconds,
            trace_seconds,
            compiles,
            recompiles,
            cache_hits,
            eager_calls,
            graph_breaks,
            ..
        } = stats;
        CompileReport {
            compile_seconds,
            trace_seconds,
            compiles,
            recompiles,
            cache_hits,
            eager_calls,
            graph_breaks,
            recompile_reasons,
        }
    }
}

/// What one step did.
#[derive(Clone, Copy, Debug)]
pub(super) struct StepOutcome {
    pub loss: f64,
    /// Whether the optimizer updated the parameters (f16 skips the steps
    /// whose scaled gradients overflowed).
    pub stepped: bool,
}

/// Runs training steps of a model as its [`Execution`] says.
pub(super) enum Stepper<'a> {
    /// The loss op by op, its backward in the training precision,
    /// clipping and the AdamW update, eagerly.
    Eager {
        model: &'a TransformerLM,
        store: &'a ParamStore,
        optimizer: AdamW,
        precision: MixedPrecision,
        grad_clip: f64,
    },
    /// The whole step (forward under autocast, loss, backward, clipping,
    /// f16 loss scaling, AdamW) as one compiled graph:
    /// `tessera::compile::train_step`. Boxed: its cache is large.
    Compiled {
        step: Box<TrainStep<'a, AdamW>>,
        /// The loss function's first error in the call under way.
        error: Rc<RefCell<Option<Error>>>,
        /// Skipped steps before the last one (f16).
        skipped: usize,
    },
}

impl<'a> Stepper<'a> {
    /// The steps `config` asks for (its execution, dtype, optimizer and
    /// clipping) on `model`, whose parameters are `store`'s; data parallel
    /// with `dp` (compiled steps only: the caller checks).
    pub(super) fn new(
        config: &TrainConfig,
        model: &'a TransformerLM,
        store: &'a ParamStore,
        dp: Option<DataParallel>,
    ) -> Result<Stepper<'a>> {
        let optimizer = AdamW::new(
            store.parameters(),
            AdamWConfig {
                lr: config.lr,
                weight_decay: config.weight_decay,
                ..AdamWConfig::default()
            },
        );
        // Checks the dtype (f32, bf16 or f16) for both executions.
        let precision = MixedPrecision::new(config.dtype, store.parameters())?;
        Ok(match config.execution {
            Execution::Eager => Stepper::Eager {
                model,
                store,
                optimizer,
                precision,
                grad_clip: config.grad_clip,
            },
            Execution::Compiled => {
                let dtype = config.dtype;
                let error = Rc::new(RefCell::new(None));
                let kept = error.clone();
                let loss_fn = move |x: &[Tensor]| {
                    let l = match dtype {
                        DType::BF16 | DType::F16 => autocast(dtype, || loss(model, &x[0], &x[1])),
                        _ => loss(model, &x[0], &x[1]),
                    };
                    l.unwrap_or_else(|e| {
                        kept.borrow_mut().get_or_insert(e);
                        // Not a scalar: train_step stops with an error.
                        Tensor::zeros(&[0], DType::F32)
                    })
                };
                let mut step = train_step(loss_fn, optimizer)
                    .name("train_step")
                    .clip_grad_norm(config.grad_clip);
                if dtype == DType::F16 {
                    // As the eager `MixedPrecision`: PyTorch's defaults.
                    step = step.loss_scaler(GradScalerConfig::default());
                }
                if let Some(dp) = dp {
                    step = step.data_parallel(dp);
                }
                Stepper::Compiled {
                    step: Box::new(step),
                    error,
                    skipped: 0,
                }
            }
        })
    }

    /// One optimizer step on `batch` at learning rate `lr`. Only the
    /// answer positions count: the prompt's targets are [`IGNORE_INDEX`].
    pub(super) fn step(&mut self, batch: &Batch, lr: f64) -> Result<StepOutcome> {
        match self {
            Stepper::Eager {
                model,
                store,
                optimizer,
                precision,
                grad_clip,
            } => {
                optimizer.set_lr(lr);
                optimizer.zero_grad();
                let loss = precision.forward(|| loss(model, &batch.inputs, &batch.targets))?;
                precision.backward(&loss)?;
                precision.unscale()?;
                clip_grad_norm(*store, *grad_clip);
                let stepped = precision.step(optimizer)?;
                Ok(StepOutcome {
                    loss: loss.item(),
                    stepped,
                })
            }
            Stepper::Compiled {
                step,
                error,
                skipped,
            } => {
                step.optimizer().set_lr(lr);
                let result = step.try_step(&[batch.inputs.clone(), batch.targets.clone()]);
                if let Some(e) = error.borrow_mut().take() {
                    return Err(e);
                }
                let loss = result?.item();
                let now = step.skipped_steps()?.unwrap_or(0);
                let stepped = now == *skipped;
                *skipped = now;
                Ok(StepOutcome { loss, stepped })
            }
        }
    }

    /// What the compiler did so far (compiled steps only).
    pub(super) fn compile_report(&self) -> Option<CompileReport> {
        match self {
            Stepper::Eager { .. } => None,
            Stepper::Compiled { step, .. } => {
                Some(CompileReport::of(step.stats(), step.recompile_reasons()))
            }
        }
    }

    /// The f16 loss scale after the last step (f16 only).
    pub(super) fn loss_scale(&self) -> Option<f64> {
        match self {
            Stepper::Eager { precision, .. } => precision.scaler().map(|s| s.scale_factor()),
            Stepper::Compiled { step, .. } => step.loss_scale().ok().flatten(),
        }
    }
}
