//! What a training run does: the task, the model, the optimizer, the
//! schedule and where the artifacts go.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::schedule::{Decay, LrSchedule};
use super::task::{ReversalTask, VOCAB};
use tessera::error::{Error, ErrorKind, Result};
use tessera::nn::TransformerConfig;
use tessera::DType;

/// How each training step runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Execution {
    /// The whole step (the forward under autocast, the cross entropy, the
    /// backward, clipping, the f16 loss scaler and the AdamW update) as
    /// one graph, `tessera::compile::train_step`: traced each step,
    /// compiled on the first, the parameters and state donated.
    #[default]
    Compiled,
    /// Every op of the forward, the backward and the update run one by one.
    Eager,
}

impl Execution {
    pub fn name(self) -> &'static str {
        match self {
            Execution::Compiled => "compiled",
            Execution::Eager => "eager",
        }
    }

    /// What runs recorded before the field existed were.
    fn before_the_field() -> Execution {
        Execution::Eager
    }
}

impl std::fmt::Display for Execution {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

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
    /// Compiled (the default) or eager steps.
    #[serde(default = "Execution::before_the_field")]
    pub execution: Execution,
    /// The training precision (`optim::MixedPrecision`): f32, or the
    /// forward under bf16 or f16 autocast (f16 with dynamic loss scaling);
    /// the parameters and the optimizer state stay f32.
    #[serde(default = "f32", with = "dtype_name")]
    pub dtype: DType,
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
            execution: Execution::Compiled,
            dtype: DType::F32,
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
        check(
            matches!(self.dtype, DType::F32 | DType::BF16 | DType::F16),
            format!(
                "dtype must be f32, bf16 or f16 (the precision of the forward), got {}",
                self.dtype
            ),
        );
        problems
    }
}

fn f32() -> DType {
    DType::F32
}

/// A dtype as its name (`"bf16"`) in JSON.
mod dtype_name {
    use serde::{de, Deserialize, Deserializer, Serializer};
    use tessera::DType;

    pub fn serialize<S: Serializer>(dtype: &DType, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(dtype.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DType, D::Error> {
        String::deserialize(d)?.parse().map_err(de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn execution_and_dtype_read_and_write_as_names() {
        let config = TrainConfig {
            execution: Execution::Eager,
            dtype: DType::BF16,
            ..TrainConfig::default()
        };
        let json = serde_json::to_value(&config).unwrap();
        assert_eq!(json["execution"], "eager");
        assert_eq!(json["dtype"], "bf16");
        let back: TrainConfig = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(back, config);
        // A summary written before the fields existed: an eager f32 run.
        let mut old = json;
        let fields = old.as_object_mut().unwrap();
        fields.remove("execution");
        fields.remove("dtype");
        let old: TrainConfig = serde_json::from_value(old).unwrap();
        assert_eq!((old.execution, old.dtype), (Execution::Eager, DType::F32));
        let mut bad = serde_json::to_value(&config).unwrap();
        bad["dtype"] = "f8".into();
        let err = serde_json::from_value::<TrainConfig>(bad).unwrap_err();
        assert!(err.to_string().contains("unknown dtype `f8`"), "{err}");
    }
}
