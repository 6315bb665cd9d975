//! One fused kernel alone (no compile, no executor), in CPU time, which a
//! shared, loaded machine disturbs less than wall time:
//!
//! - by default, the cost of each kind of step in cache: kernels of one
//!   step (a copy, a multiply, tanh, sigmoid), four arithmetic steps and the
//!   benchmark's chain, each run over `SMALL` (default 16 Ki) elements as
//!   many times as make 64 Mi;
//! - with `CHAIN=1`, the chain in cache (16 Ki and 64 Ki elements) and from
//!   memory (64 Mi): the difference is what memory costs it (`BIG=1`: only
//!   64 Mi, for A/B runs and `perf record`).
//!
//! `RAYON_NUM_THREADS=1 cargo run --release -p tessera --example fused_probe`
mod common;
use common::cpu_ms;
use tessera::ir::kernel::{FusedKernel, Step};
use tessera::ir::{BinaryOp, DType, UnaryOp};
use tessera::tensor::Generator;
use tessera::Tensor;
use Step::*;

fn chain() -> Vec<Step> {
    vec![
        Load(0),
        Const(1.5),
        Binary(BinaryOp::Mul, 0, 1),
        Const(0.25),
        Binary(BinaryOp::Add, 2, 3),
        Unary(UnaryOp::Tanh, 4),
        Binary(BinaryOp::Mul, 5, 0),
        Const(0.5),
        Binary(BinaryOp::Sub, 6, 7),
        Unary(UnaryOp::Relu, 8),
        Unary(UnaryOp::Sigmoid, 9),
        Const(2.0),
        Binary(BinaryOp::Mul, 10, 11),
    ]
}

/// The least CPU time (ms) of `reps` rounds of `runs` runs of `k` over `x`.
fn best_cpu_ms(reps: usize, runs: usize, k: &FusedKernel, x: &Tensor) -> f64 {
    (0..reps)
        .map(|_| {
            let t = cpu_ms();
            for _ in 0..runs {
                drop(k.run(&[x.array()]).unwrap());
            }
            cpu_ms() - t
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let total = 64usize << 20;
    let small: usize = std::env::var("SMALL")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1 << 14);
    let mut g = Generator::new(0);
    let xs = Tensor::randn(&[small], DType::F32, &mut g);
    let kernels: Vec<(&str, Vec<Step>)> = vec![
        ("copy", vec![Load(0), Unary(UnaryOp::Relu, 0)]),
        (
            "1 mulc",
            vec![Load(0), Const(1.5), Binary(BinaryOp::Mul, 0, 1)],
        ),
        (
            "4 constops",
            vec![
                Load(0),
                Const(1.5),
                Binary(BinaryOp::Mul, 0, 1),
                Const(0.25),
                Binary(BinaryOp::Add, 2, 3),
                Binary(BinaryOp::Mul, 4, 1),
                Binary(BinaryOp::Sub, 5, 3),
            ],
        ),
        ("tanh", vec![Load(0), Unary(UnaryOp::Tanh, 0)]),
        ("sigmoid", vec![Load(0), Unary(UnaryOp::Sigmoid, 0)]),
        ("chain", chain()),
    ];
    let only_chain = std::env::var("CHAIN").is_ok();
    for _ in 0..2 {
        if only_chain {
            let sizes: Vec<usize> = if std::env::var("BIG").is_ok() {
                vec![total]
            } else {
                vec![1 << 14, 1 << 16, total]
            };
            for size in sizes {
                let x = Tensor::randn(&[size], DType::F32, &mut g);
                let k = FusedKernel::new(vec![size], chain(), vec![(12, DType::F32)], false);
                let best = best_cpu_ms(5, total / size, &k, &x);
                println!("chain at {size:>9}: {best:6.1} ms cpu per 64Mi");
            }
            continue;
        }
        for (name, steps) in &kernels {
            let out = steps.len() - 1;
            let k = FusedKernel::new(vec![small], steps.clone(), vec![(out, DType::F32)], false);
            let best = best_cpu_ms(3, total / small, &k, &xs);
            println!(
                "{name:>12}: {best:6.1} ms cpu per 64Mi ({:.3} ns/elem), block {}",
                best * 1e6 / total as f64,
                k.block
            );
        }
    }
}
