//! The synthetic task: reverse a string of digits.
//!
//! An example is `digits SEP reversed`, e.g. `3 1 4 1 5 9 | 9 5 1 4 1 3`
//! (2·n + 1 tokens for n digits). The decoder-only model reads all but the
//! last token and predicts the next one at every position; only the
//! predictions of the reversed half are trained, the prompt positions are
//! masked with [`IGNORE_INDEX`]. The answer of every prompt is known, so
//! the program checks the model itself: no data files.

use std::collections::HashSet;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use tessera::tensor::Tensor;

/// The separator token between the digits and their reversal (the digits
/// are tokens 0–9).
pub const SEP: i64 = 10;

/// Ten digits and the separator.
pub const VOCAB: usize = 11;

/// The target of a position whose prediction is not trained (the prompt),
/// PyTorch's default `ignore_index`.
pub const IGNORE_INDEX: i64 = -100;

/// The seed of the held-out set: fixed, so runs with different training
/// seeds are scored on the same sequences.
const EVAL_SEED: u64 = 0x0E7A_15E7;

/// A digit string, one digit (0–9) per element.
pub type Digits = Vec<u8>;

/// Reversal of `digits`-long strings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReversalTask {
    pub digits: usize,
}

/// One training batch: model inputs and next-token targets.
pub struct Batch {
    /// i64 `[B, seq_len]`: each example without its last token.
    pub inputs: Tensor,
    /// i64 `[B * seq_len]`: the next token, or [`IGNORE_INDEX`] in the prompt.
    pub targets: Tensor,
}

impl ReversalTask {
    /// The number of tokens the model reads per example (`2 · digits`): the
    /// whole example but its last token, which is only ever a target.
    pub fn seq_len(&self) -> usize {
        2 * self.digits
    }

    /// The digits and the separator: what greedy decoding starts from.
    pub fn prompt_len(&self) -> usize {
        self.digits + 1
    }

    /// The number of distinct digit strings.
    pub fn num_strings(&self) -> u128 {
        10u128.saturating_pow(self.digits as u32)
    }

    /// The whole example: `digits SEP reversed`.
    pub fn example(&self, digits: &[u8]) -> Vec<i64> {
        let mut tokens = self.prompt(digits);
        tokens.extend(answer(digits));
        tokens
    }

    /// `digits SEP`.
    pub fn prompt(&self, digits: &[u8]) -> Vec<i64> {
        assert_eq!(digits.len(), self.digits, "a {}-digit task", self.digits);
        let mut tokens: Vec<i64> = digits.iter().map(|&d| i64::from(d)).collect();
        tokens.push(SEP);
        tokens
    }

    /// The targets of one example's `seq_len` input positions: position `i`
    /// predicts token `i + 1`, trained only where that token is an answer.
    pub fn targets(&self, digits: &[u8]) -> Vec<i64> {
        let mut targets = vec![IGNORE_INDEX; self.digits];
        targets.extend(answer(digits));
        targets
    }

    /// Inputs and targets for `samples`.
    pub fn batch(&self, samples: &[Digits]) -> Batch {
        let (b, t) = (samples.len(), self.seq_len());
        let mut inputs = Vec::with_capacity(b * t);
        let mut targets = Vec::with_capacity(b * t);
        for digits in samples {
            let example = self.example(digits);
            inputs.extend_from_slice(&example[..t]);
            targets.extend(self.targets(digits));
        }
        Batch {
            inputs: Tensor::from_vec(inputs, &[b, t]),
            targets: Tensor::from_vec(targets, &[b * t]),
        }
    }

    /// The prompts of `samples` as i64 `[B, prompt_len]`.
    pub fn prompts(&self, samples: &[Digits]) -> Tensor {
        let flat: Vec<i64> = samples.iter().flat_map(|d| self.prompt(d)).collect();
        Tensor::from_vec(flat, &[samples.len(), self.prompt_len()])
    }

    /// The fixed held-out set: `size` distinct strings (at most half of all
    /// strings, so training still has the other half).
    pub fn eval_set(&self, size: usize) -> Vec<Digits> {
        assert!(
            size as u128 <= self.num_strings() / 2,
            "an eval set of {size} {}-digit strings leaves too few for training",
            self.digits
        );
        let mut rng = ChaCha8Rng::seed_from_u64(EVAL_SEED);
        let mut seen = HashSet::new();
        let mut set = Vec::with_capacity(size);
        while set.len() < size {
            let digits = random_digits(&mut rng, self.digits);
            if seen.insert(digits.clone()) {
                set.push(digits);
            }
        }
        set
    }
}

/// The expected output: the digits reversed.
pub fn answer(digits: &[u8]) -> Vec<i64> {
    digits.iter().rev().map(|&d| i64::from(d)).collect()
}

fn random_digits(rng: &mut ChaCha8Rng, n: usize) -> Digits {
    (0..n).map(|_| rng.random_range(0..10u8)).collect()
}

/// Seeded training batches that never contain a held-out string, so the
/// eval accuracy measures generalisation, not memory.
pub struct Sampler {
    task: ReversalTask,
    rng: ChaCha8Rng,
    held_out: HashSet<Digits>,
}

impl Sampler {
    pub fn new(task: ReversalTask, seed: u64, held_out: &[Digits]) -> Sampler {
        Sampler {
            task,
            rng: ChaCha8Rng::seed_from_u64(seed),
            held_out: held_out.iter().cloned().collect(),
        }
    }

    /// The next `size` training strings (drawn uniformly, with replacement,
    /// from the strings outside the held-out set).
    pub fn next_samples(&mut self, size: usize) -> Vec<Digits> {
        let mut samples = Vec::with_capacity(size);
        while samples.len() < size {
            let digits = random_digits(&mut self.rng, self.task.digits);
            if !self.held_out.contains(&digits) {
                samples.push(digits);
            }
        }
        samples
    }

    pub fn next_batch(&mut self, size: usize) -> Batch {
        let samples = self.next_samples(size);
        self.task.batch(&samples)
    }
}
