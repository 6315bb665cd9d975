//! Times a small GPT's training step (forward, cross-entropy, backward,
//! AdamW) eagerly and compiled whole (`tessera::compile::train_step`) on
//! the CPU, from the same initial weights, and checks the two give the
//! same losses.
//!
//! `cargo run --release -p tessera --example train_step [steps] [layers] [d_model] [batch] [seq] [vocab]`
//!
//! The defaults are issue 17's GPT: 4 layers, d256 (4 heads, MLP 1024),
//! batch 8×128, vocab 1024 — the shapes of `../shared/anchors/gpt_torch.py`.
//! `STEP_SCHEDULE=strict|dfs|bfs` picks the compiled step's kernel order
//! (default: compile's, `auto`).

use std::time::Instant;

use tessera::compile::train_step;
use tessera::hints::Strategy;
use tessera::nn::{cross_entropy, ParamStore, TransformerConfig, TransformerLM};
use tessera::optim::{AdamW, AdamWConfig, Optimizer};
use tessera::runtime::cpu::{memory_stats, reset_peak};
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

/// Steps run before timing: the compile, the allocator and the pools.
const WARMUP: usize = 2;

fn main() {
    let arg = |i: usize, default: usize| {
        std::env::args()
            .nth(i)
            .map_or(default, |s| s.parse().expect("arguments are integers"))
    };
    let steps = arg(1, 5);
    let (layers, d_model, batch, seq, vocab) =
        (arg(2, 4), arg(3, 256), arg(4, 8), arg(5, 128), arg(6, 1024));
    let config = TransformerConfig {
        vocab,
        d_model,
        n_heads: (d_model / 64).max(1),
        n_layers: layers,
        d_ff: 4 * d_model,
        max_len: seq,
        dropout: 0.0,
    };
    let model = || {
        let mut store = ParamStore::new();
        let lm = TransformerLM::new(&mut store, "", config.clone(), &mut Generator::new(0));
        (store, lm)
    };
    let mut g = Generator::new(1);
    let ids = (Tensor::rand(&[batch, seq + 1], DType::F32, &mut g) * vocab as f64).cast(DType::I64);
    let data = [
        ids.narrow(1, 0, seq).contiguous(),
        ids.narrow(1, 1, seq).contiguous().reshape(&[-1]),
    ];
    let loss_of = |lm: &TransformerLM, b: &[Tensor]| {
        cross_entropy(
            &lm.forward(&b[0], true).reshape(&[-1, vocab as isize]),
            &b[1],
            None,
        )
    };
    let (store, _) = model();
    println!(
        "TransformerLM {config:?}: {} parameters ({} tensors), batch {batch}x{seq}, {} rayon threads, load average {}",
        store.num_parameters(),
        store.len(),
        rayon::current_num_threads(),
        load_average()
    );

    // Eager: PyTorch's loop.
    let (store, lm) = model();
    let mut opt = AdamW::new(store.parameters(), AdamWConfig::default());
    let mut eager_ms = Vec::new();
    let mut optimizer_ms = Vec::new();
    let mut eager_losses = Vec::new();
    for i in 0..WARMUP + steps {
        let t0 = Instant::now();
        opt.zero_grad();
        let loss = loss_of(&lm, &data);
        loss.backward();
        let t1 = Instant::now();
        opt.step();
        eager_losses.push(loss.item());
        if i >= WARMUP {
            eager_ms.push(t0.elapsed().as_secs_f64() * 1e3);
            optimizer_ms.push((Instant::now() - t1).as_secs_f64() * 1e3);
        }
    }
    drop((store, lm, opt));

    // Compiled: one graph per step, with the parameters and AdamW's state
    // donated (the default) and without.
    let compiled_run = |donate: bool| {
        let (store, lm) = model();
        let opt = AdamW::new(store.parameters(), AdamWConfig::default());
        let mut step = train_step(|b: &[Tensor]| loss_of(&lm, b), opt).donate(donate);
        if let Ok(order) = std::env::var("STEP_SCHEDULE") {
            step = step.schedule(match order.as_str() {
                "strict" => Strategy::Strict,
                "dfs" => Strategy::Dfs,
                "bfs" => Strategy::Bfs,
                other => panic!("STEP_SCHEDULE: strict, dfs or bfs, got {other}"),
            });
        }
        let mut ms_per_step = Vec::new();
        let mut losses = Vec::new();
        let mut first = 0.0;
        let mut measured = 0;
        for i in 0..WARMUP + steps {
            let live = memory_stats().live_bytes;
            reset_peak();
            let t0 = Instant::now();
            let loss = step.step(&data);
            // The most bytes the step added over what was alive before it
            // (the parameters and state among them).
            measured = memory_stats().peak_bytes - live;
            losses.push(loss.item());
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            if i == 0 {
                first = ms;
            }
            if i >= WARMUP {
                ms_per_step.push(ms);
            }
        }
        let artifact = |file: &str| {
            step.last_artifacts()
                .into_iter()
                .find(|(name, _)| name == file)
                .and_then(|(_, text)| text.lines().next().map(str::to_string))
                .unwrap_or_default()
        };
        let memory = artifact("forward.memory.txt");
        let kernels = artifact("forward.kernels.txt");
        (
            ms_per_step,
            losses,
            first,
            step.stats(),
            kernels,
            (memory, measured),
        )
    };
    let (mut kept_ms, kept_losses, _, _, _, (kept_memory, kept_measured)) = compiled_run(false);
    let (mut compiled_ms, compiled_losses, first, stats, kernels, (memory, measured)) =
        compiled_run(true);
    assert_eq!(kept_losses, compiled_losses, "donation changes no bit");
    println!("memory plan, donating:     {memory}");
    println!("memory plan, not donating: {kept_memory}");
    println!(
        "measured peak over the step's start: donating {measured} bytes, not donating {kept_measured} bytes"
    );
    println!(
        "compiled step not donating: median {:.1} ms over {steps} steps {kept_ms:.1?}",
        median(&mut kept_ms)
    );

    let (eager, compiled) = (median(&mut eager_ms), median(&mut compiled_ms));
    println!(
        "eager step:    median {eager:.1} ms over {steps} steps {eager_ms:.1?}, of which AdamW.step {:.1} ms",
        median(&mut optimizer_ms)
    );
    println!(
        "compiled step (donating): median {compiled:.1} ms over {steps} steps {compiled_ms:.1?}"
    );
    println!(
        "compiled/eager: {:.2}x; first compiled step {:.0} ms (compile {:.0} ms); trace per step {:.1} ms; {kernels}",
        compiled / eager,
        first,
        stats.compile_seconds * 1e3,
        stats.trace_seconds * 1e3 / (WARMUP + steps) as f64
    );
    println!(
        "losses eager {:?}\n       compiled {:?}\ncompiles {}, cache hits {}; load average {}",
        eager_losses,
        compiled_losses,
        stats.compiles,
        stats.cache_hits,
        load_average()
    );
    let worst = eager_losses
        .iter()
        .zip(&compiled_losses)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(worst <= 1e-4, "the losses differ by {worst}");
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}
