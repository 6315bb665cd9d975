//! One training step, and the one place that decides how it runs
//! ([`Execution`]): the loss eagerly op by op, or through
//! `tessera::compile` (its backward compiled ahead of time). Either way the
//! precision is a [`MixedPrecision`] (f32, bf16 or f16 autocast with loss
//! scaling) and the clipping and AdamW update run eagerly.

use std::cell::RefCell;
use std::rc::Rc;

use serde::{Deserialize, Serialize};

use super::config::{Execution, TrainConfig};
use super::task::{Batch, IGNORE_INDEX, VOCAB};
use tessera::compile::{CompileStats, Compiled};
use tessera::error::{Error, ErrorKind, Result};
use tessera::nn::{try_cross_entropy, ParamStore, TransformerLM};
use tessera::optim::{clip_grad_norm, AdamW, AdamWConfig, MixedPrecision, Optimizer};
use tessera::Tensor;

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
    fn of<F: Fn(&[Tensor]) -> Vec<Tensor>>(f: &Compiled<F>) -> CompileReport {
        let CompileStats {
            compile_seconds,
            trace_seconds,
            compiles,
            recompiles,
            cache_hits,
            graph_breaks,
            eager_calls,
            ..
        } = f.stats();
        CompileReport {
            compile_seconds,
            trace_seconds,
            compiles,
            recompiles,
            cache_hits,
            eager_calls,
            graph_breaks,
            recompile_reasons: f.recompile_reasons(),
        }
    }
}

/// A function of tensors compiled with `tessera::compile` whose body can
/// fail: `compile` takes a function returning tensors, so the body's error
/// is kept here and returned by [`Fallible::call`] instead of a panic.
pub(super) struct Fallible<'a> {
    compiled: Compiled<TracedFn<'a>>,
    error: Rc<RefCell<Option<Error>>>,
}

type TracedFn<'a> = Box<dyn Fn(&[Tensor]) -> Vec<Tensor> + 'a>;

impl<'a> Fallible<'a> {
    /// Compiles `f` under `name` (logs, `TESSERA_COMPILE_DEBUG` dumps).
    pub(super) fn compile(
        name: &str,
        f: impl Fn(&[Tensor]) -> Result<Vec<Tensor>> + 'a,
    ) -> Fallible<'a> {
        let error = Rc::new(RefCell::new(None));
        let kept = error.clone();
        let body: TracedFn<'a> = Box::new(move |inputs: &[Tensor]| match f(inputs) {
            Ok(outputs) => outputs,
            Err(e) => {
                // The first error of the call; no outputs (a graph of
                // nothing, which the caller never sees).
                kept.borrow_mut().get_or_insert(e);
                Vec::new()
            }
        });
        Fallible {
            compiled: tessera::compile(body).name(name),
            error,
        }
    }

    /// Runs the compiled function: its outputs, or the error of its body
    /// (at the user's line inside it) or of the compiler.
    pub(super) fn call(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let outputs = self.compiled.try_call(inputs);
        if let Some(e) = self.error.borrow_mut().take() {
            return Err(e);
        }
        outputs
    }

    pub(super) fn report(&self) -> CompileReport {
        CompileReport::of(&self.compiled)
    }
}

/// The loss as each [`Execution`] computes it.
enum LossFn<'a> {
    Eager(&'a TransformerLM),
    /// Boxed: the compiled function's cache is large beside a reference.
    Compiled(Box<Fallible<'a>>),
}

/// What one step did.
#[derive(Clone, Copy, Debug)]
pub(super) struct StepOutcome {
    pub loss: f64,
    /// Whether the optimizer updated the parameters (f16 skips the steps
    /// whose scaled gradients overflowed).
    pub stepped: bool,
}

/// Runs training steps of a model: the loss (eager or compiled), its
/// backward in the training precision, clipping and the AdamW update.
pub(super) struct Stepper<'a> {
    loss: LossFn<'a>,
    store: &'a ParamStore,
    optimizer: AdamW,
    precision: MixedPrecision,
    grad_clip: f64,
}

impl<'a> Stepper<'a> {
    /// The steps `config` asks for (its execution, dtype, optimizer and
    /// clipping) on `model`, whose parameters are `store`'s.
    pub(super) fn new(
        config: &TrainConfig,
        model: &'a TransformerLM,
        store: &'a ParamStore,
    ) -> Result<Stepper<'a>> {
        let loss = match config.execution {
            Execution::Eager => LossFn::Eager(model),
            Execution::Compiled => {
                LossFn::Compiled(Box::new(Fallible::compile("train_loss", |x| {
                    Ok(vec![loss(model, &x[0], &x[1])?])
                })))
            }
        };
        let optimizer = AdamW::new(
            store.parameters(),
            AdamWConfig {
                lr: config.lr,
                weight_decay: config.weight_decay,
                ..AdamWConfig::default()
            },
        );
        Ok(Stepper {
            loss,
            store,
            optimizer,
            precision: MixedPrecision::new(config.dtype, store.parameters())?,
            grad_clip: config.grad_clip,
        })
    }

    /// One optimizer step on `batch` at learning rate `lr`. Only the
    /// answer positions count: the prompt's targets are [`IGNORE_INDEX`].
    pub(super) fn step(&mut self, batch: &Batch, lr: f64) -> Result<StepOutcome> {
        self.optimizer.set_lr(lr);
        self.optimizer.zero_grad();
        let loss = self.precision.forward(|| match &self.loss {
            LossFn::Eager(model) => loss(model, &batch.inputs, &batch.targets),
            LossFn::Compiled(f) => f
                .call(&[batch.inputs.clone(), batch.targets.clone()])?
                .pop()
                .ok_or_else(|| {
                    Error::op(
                        ErrorKind::Verify,
                        "train_loss",
                        "the compiled loss has no output",
                    )
                }),
        })?;
        self.precision.backward(&loss)?;
        self.precision.unscale()?;
        clip_grad_norm(self.store, self.grad_clip);
        let stepped = self.precision.step(&mut self.optimizer)?;
        Ok(StepOutcome {
            loss: loss.item(),
            stepped,
        })
    }

    /// What the compiler did so far (compiled steps only).
    pub(super) fn compile_report(&self) -> Option<CompileReport> {
        match &self.loss {
            LossFn::Eager(_) => None,
            LossFn::Compiled(f) => Some(f.report()),
        }
    }

    /// The f16 loss scale after the last step (f16 only).
    pub(super) fn loss_scale(&self) -> Option<f64> {
        self.precision.scaler().map(|s| s.scale_factor())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera::DType;

    /// The body's error comes back from the call (kind, message, the line
    /// in the body), not as a panic; a good call after it still runs.
    #[test]
    fn a_failing_body_is_an_error_of_the_call() {
        let f = Fallible::compile("product", |x| Ok(vec![x[0].try_matmul(&x[1])?]));
        let a = Tensor::ones(&[2, 3], DType::F32);
        let err = f.call(&[a.clone(), a.clone()]).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Shape, "{err}");
        let message = err.to_string();
        assert!(
            message.contains("matmul") && message.contains("[2,3]"),
            "{message}"
        );
        assert!(message.contains("step.rs"), "the body's line: {message}");
        let b = Tensor::ones(&[3, 1], DType::F32);
        let out = f.call(&[a, b]).unwrap();
        assert_eq!(out[0].to_f64_vec(), vec![3.0, 3.0]);
    }
}
