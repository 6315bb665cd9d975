//! What a training run does: the task, the model, the optimizer, the
//! schedule and where the artifacts go.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::schedule::{Decay, LrSchedule};
use super::task::{ReversalTask, VOCAB};
use tessera::error::{Error, ErrorKind, Result};
use tessera::nn::TransformerConfig;

/// A training run. The defaults are the run recorded in `BENCHMARKS.md`:
/// they reach ≥ 95 % held-out exact match within two minutes on a 2-core
/// machine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Digits per string to reverse.
    pub digits: usize,
    pub steps: usize,
    /// Strings per training batch.
    pub batch: usize,
    /// The peak learning rate (AdamW).
    pub lr: f64,
    /// Steps of linear warmup to the peak.
    pub warmup: usize,
    pub decay: Decay,
    /// The last step's rate as a fraction of the peak.
    pub final_lr_ratio: f64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// The largest global gradient norm; larger gradients are scaled down.
    pub grad_clip: f64,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_layers: usize,
    pub d_ff: usize,
    /// The number of learned positions: at least `2 · digits`.
    pub max_len: usize,
    pub dropout: f64,
    /// Seeds the initialisation and the training batches.
    pub seed: u64,
    /// Evaluate on the held-out set every this many steps (and at the end).
    pub eval_every: usize,
    /// Strings in the held-out set.
    pub eval_size: usize,
    /// Where to write the final parameters (safetensors), if anywhere.
    pub checkpoint: Option<PathBuf>,
    /// Where to write the loss curve (PNG), if anywhere.
    pub plot: Option<PathBuf>,
}

impl Default for TrainConfig {
    fn default() -> TrainConfig {
        TrainConfig {
            digits: 8,
            steps: 600,
            batch: 64,
            lr: 3e-3,
            warmup: 50,
            decay: Decay::Cosine,
            final_lr_ratio: 0.05,
            weight_decay: 0.01,
            grad_clip: 1.0,
            d_model: 64,
            n_heads: 4,
            n_layers: 2,
            d_ff: 128,
            max_len: 16,
            dropout: 0.0,
            seed: 0,
            eval_every: 50,
            eval_size: 1000,
            checkpoint: None,
            plot: None,
        }
    }
}

impl TrainConfig {
    pub fn task(&self) -> ReversalTask {
        ReversalTask {
            digits: self.digits,
        }
    }

    /// The model this config trains (and a checkpoint of it loads into).
    pub fn model_config(&self) -> TransformerConfig {
        TransformerConfig {
            vocab: VOCAB,
            d_model: self.d_model,
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            d_ff: self.d_ff,
            max_len: self.max_len,
            dropout: self.dropout,
        }
    }

    pub fn schedule(&self) -> LrSchedule {
        LrSchedule {
            peak: self.lr,
            final_ratio: self.final_lr_ratio,
            warmup: self.warmup,
            steps: self.steps,
            decay: self.decay,
        }
    }

    /// Model input tokens per training step.
    pub fn tokens_per_step(&self) -> usize {
        self.batch * self.task().seq_len()
    }

    /// Checks the whole config; the error lists every problem, so one
    /// attempt fixes them all.
    pub fn validate(&self) -> Result<()> {
        let problems = self.problems();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(Error::op(ErrorKind::Argument, "train", problems.join("; ")))
        }
    }

    fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let mut check = |ok: bool, message: String| {
            if !ok {
                problems.push(message);
            }
        };
        let positive = [
            ("digits", self.digits),
            ("steps", self.steps),
            ("batch", self.batch),
            ("d_model", self.d_model),
            ("n_heads", self.n_heads),
            ("n_layers", self.n_layers),
            ("d_ff", self.d_ff),
            ("eval_every", self.eval_every),
            ("eval_size", self.eval_size),
        ];
        for (name, value) in positive {
            check(value > 0, format!("{name} must be at least 1, got {value}"));
        }
        let seq = self.task().seq_len();
        check(
            self.max_len >= seq,
            format!(
                "max_len {} is shorter than the {seq} tokens the model reads for {} digits \
                 (2 × digits): raise max_len or lower digits",
                self.max_len, self.digits
            ),
        );
        check(
            self.n_heads == 0 || self.d_model.is_multiple_of(self.n_heads),
            format!(
                "d_model {} must be a multiple of n_heads {}",
                self.d_model, self.n_heads
            ),
        );
        let half = self.task().num_strings() / 2;
        check(
            self.eval_size as u128 <= half,
            format!(
                "eval_size {} is more than half of the {} distinct {}-digit strings; \
                 use at most {half} or more digits",
                self.eval_size,
                self.task().num_strings(),
                self.digits
            ),
        );
        check(
            self.lr.is_finite() && self.lr > 0.0,
            format!("lr must be positive, got {}", self.lr),
        );
        check(
            self.warmup <= self.steps,
            format!("warmup {} exceeds steps {}", self.warmup, self.steps),
        );
        check(
            (0.0..=1.0).contains(&self.final_lr_ratio),
            format!(
                "final_lr_ratio must be in [0, 1], got {}",
                self.final_lr_ratio
            ),
        );
        check(
            self.weight_decay >= 0.0 && self.weight_decay.is_finite(),
            format!("weight_decay must be >= 0, got {}", self.weight_decay),
        );
        check(
            self.grad_clip > 0.0,
            format!("grad_clip must be positive, got {}", self.grad_clip),
        );
        check(
            (0.0..1.0).contains(&self.dropout),
            format!("dropout must be in [0, 1), got {}", self.dropout),
        );
        problems
    }
}
