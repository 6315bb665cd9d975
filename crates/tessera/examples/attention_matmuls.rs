//! The six matmuls of attention's forward and backward at the seed table's
//! shape, eager, one batched call each and one call per slice: wall and
//! process CPU milliseconds, GFLOP/s. Compare with
//! `scripts/anchors/torch_attention_matmuls.py` run right after.
//!
//! `cargo run --release -p tessera --example attention_matmuls -- 64 512 64 20`
//! (batch×heads, N, D, reps).

use std::time::Instant;

use tessera::tensor::Generator;
use tessera::{DType, Tensor};

/// User + system CPU seconds of this process (Linux `/proc/self/stat`).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(vec![], |(_, rest)| rest.split_whitespace().collect());
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

fn main() {
    let dims: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("sizes are integers"))
        .collect();
    let [bh, n, d, reps] = dims[..] else {
        panic!("usage: attention_matmuls BH N D REPS");
    };
    let mut g = Generator::new(0);
    let mut randn = |s: &[usize]| Tensor::randn(s, DType::F32, &mut g);
    let (q, k, v, d_out) = (
        randn(&[bh, n, d]),
        randn(&[bh, n, d]),
        randn(&[bh, n, d]),
        randn(&[bh, n, d]),
    );
    let p = randn(&[bh, n, n]);
    let t = |x: &Tensor| x.transpose(-2, -1);
    let cases: Vec<(&str, Tensor, Tensor)> = vec![
        ("S = Q Kt", q.clone(), t(&k)),
        ("O = P V", p.clone(), v.clone()),
        ("dP = dO Vt", d_out.clone(), t(&v)),
        ("dV = Pt dO", t(&p), d_out.clone()),
        ("dQ = dS K", p.clone(), k.clone()),
        ("dK = dSt Q", t(&p), q.clone()),
    ];
    for (name, a, b) in &cases {
        let flop = 2.0 * (bh * a.shape()[1] * a.shape()[2] * b.shape()[2]) as f64;
        for per_slice in [false, true] {
            let run = || {
                if per_slice {
                    for i in 0..bh {
                        let (ai, bi) = (a.narrow(0, i, 1), b.narrow(0, i, 1));
                        std::hint::black_box(ai.matmul(&bi));
                    }
                } else {
                    std::hint::black_box(a.matmul(b));
                }
            };
            run();
            let (t0, c0) = (Instant::now(), cpu_seconds());
            for _ in 0..reps {
                run();
            }
            let wall = t0.elapsed().as_secs_f64() / reps as f64;
            let cpu = (cpu_seconds() - c0) / reps as f64;
            println!(
                "{name:<12} {:<9} wall {:7.2} ms  cpu {:7.2} ms  {:6.1} GFLOP/s",
                if per_slice { "per slice" } else { "batched" },
                wall * 1e3,
                cpu * 1e3,
                flop / wall / 1e9
            );
        }
    }
}
