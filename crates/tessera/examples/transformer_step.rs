//! Times one training step of a small TransformerLM (forward, backward,
//! AdamW) on the CPU, split by phase.
//!
//! `cargo run --release -p tessera --example transformer_step [steps] [dropout]`

use std::time::{Duration, Instant};

use tessera::nn::{cross_entropy, ParamStore, TransformerConfig, TransformerLM};
use tessera::optim::{AdamW, AdamWConfig, Optimizer};
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

const BATCH: usize = 64;
const SEQ: usize = 16;

fn main() {
    let arg = |i: usize, default: f64| {
        std::env::args()
            .nth(i)
            .map_or(default, |s| s.parse().expect("arguments are numbers"))
    };
    let steps = arg(1, 20.0) as usize;
    let config = TransformerConfig {
        vocab: 16,
        d_model: 64,
        n_heads: 4,
        n_layers: 2,
        d_ff: 256,
        max_len: SEQ,
        dropout: arg(2, 0.0),
    };
    let mut g = Generator::new(0);
    let mut store = ParamStore::new();
    let model = TransformerLM::new(&mut store, "", config.clone(), &mut g);
    let mut opt = AdamW::new(store.parameters(), AdamWConfig::default());
    println!(
        "TransformerLM {config:?}: {} parameters, batch {BATCH}, seq {SEQ}, {} rayon threads",
        store.num_parameters(),
        rayon::current_num_threads()
    );
    // Next-token data: a random sequence and the same sequence shifted.
    let ids = (Tensor::rand(&[BATCH, SEQ + 1], DType::F32, &mut g) * config.vocab as f64)
        .cast(DType::I64);
    let inputs = ids.narrow(1, 0, SEQ).contiguous();
    let targets = ids.narrow(1, 1, SEQ).contiguous().reshape(&[-1]);

    let mut phases = [Duration::ZERO; 3];
    let mut losses = Vec::new();
    for step in 0..steps + 3 {
        let t0 = Instant::now();
        let logits = model.forward(&inputs, true);
        let loss = cross_entropy(
            &logits.reshape(&[-1, config.vocab as isize]),
            &targets,
            None,
        );
        let t1 = Instant::now();
        loss.backward();
        let t2 = Instant::now();
        opt.step();
        let t3 = Instant::now();
        losses.push(loss.item());
        // The first steps warm the allocator and the thread pool.
        if step >= 3 {
            phases[0] += t1 - t0;
            phases[1] += t2 - t1;
            phases[2] += t3 - t2;
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3 / steps as f64;
    println!(
        "per step: forward {:.2} ms, backward {:.2} ms, AdamW {:.2} ms, total {:.2} ms",
        ms(phases[0]),
        ms(phases[1]),
        ms(phases[2]),
        ms(phases.iter().sum())
    );
    println!(
        "loss: first {:.4}, last {:.4}",
        losses[0],
        losses[losses.len() - 1]
    );
}
