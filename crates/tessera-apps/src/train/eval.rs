//! Evaluation: greedy decoding and the accuracy of its outputs.

use serde::{Deserialize, Serialize};

use super::task::{answer, Digits, ReversalTask};
use tessera::autograd::no_grad;
use tessera::error::Result;
use tessera::tensor::Tensor;

/// How well the decoded outputs match the answers.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Accuracy {
    /// The fraction of sequences whose every output token is right.
    pub exact_match: f64,
    /// The fraction of output tokens that are right.
    pub token: f64,
}

/// The held-out accuracy after `step` training steps.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalPoint {
    pub step: usize,
    pub accuracy: Accuracy,
}

/// Extends each prompt of `prompts` (i64 `[B, P]`) by `new_tokens` tokens,
/// each the argmax of the last position's logits, and returns the new
/// tokens (`[B, new_tokens]`). `logits` maps ids `[B, T]` to logits
/// `[B, T, V]` (a model's forward pass). The model sees only its own
/// outputs, never the answer: no teacher forcing.
pub fn greedy_decode(
    prompts: &Tensor,
    new_tokens: usize,
    mut logits: impl FnMut(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    no_grad(|| {
        let mut ids = prompts.clone();
        for _ in 0..new_tokens {
            let t = ids.shape()[1];
            let next = logits(&ids)?
                .try_narrow(1, t - 1, 1)?
                .try_argmax(-1, false)?;
            ids = Tensor::try_cat(&[&ids, &next], 1)?;
        }
        ids.try_narrow(1, prompts.shape()[1], new_tokens)
    })
}

/// Scores `predicted` (row-major `[B, n]`) against `expected` (the same
/// shape); `n` is the length of one output.
pub fn score(predicted: &[i64], expected: &[i64], n: usize) -> Accuracy {
    assert_eq!(predicted.len(), expected.len(), "one prediction per answer");
    assert!(
        n > 0 && expected.len().is_multiple_of(n),
        "whole rows of {n}"
    );
    if expected.is_empty() {
        return Accuracy {
            exact_match: 0.0,
            token: 0.0,
        };
    }
    let rows = expected.len() / n;
    let exact = predicted
        .chunks(n)
        .zip(expected.chunks(n))
        .filter(|(p, e)| p == e)
        .count();
    let tokens = predicted
        .iter()
        .zip(expected)
        .filter(|(p, e)| p == e)
        .count();
    Accuracy {
        exact_match: exact as f64 / rows as f64,
        token: tokens as f64 / expected.len() as f64,
    }
}

/// Decodes every string of `set` greedily with `logits` and scores the
/// outputs against the reversals. The prompts go to the current device
/// (`runtime::device::current`).
pub fn evaluate(
    task: &ReversalTask,
    set: &[Digits],
    logits: impl FnMut(&Tensor) -> Result<Tensor>,
) -> Result<Accuracy> {
    // On the current device (`train_on` runs there).
    let prompts = task.prompts(set).to(tessera::runtime::device::current())?;
    let outputs = greedy_decode(&prompts, task.digits, logits)?;
    let expected: Vec<i64> = set.iter().flat_map(|d| answer(d)).collect();
    Ok(score(&outputs.to_vec::<i64>()?, &expected, task.digits))
}
