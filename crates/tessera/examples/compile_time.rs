//! Compile time of the seed's sliced attention, forward + backward.
//!
//! `cargo run --release -p tessera --example compile_time -- 4 16 512 64 64`
//! (B H N D slices). Prints the trace time and the build time (passes, AOT
//! autograd, fusion) of the first call, and the steady-state step time.
//! The attention pass is off: this measures the composite graph the seed
//! writes (with it on, each slice becomes one flash attention op).

use std::time::Instant;

use tessera::tensor::Generator;
use tessera::{compile, DType, Tensor};
use tessera_apps::seed_table::sdpa;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("sizes are integers"))
        .collect();
    let [b, h, n, d, slices] = args[..] else {
        panic!("usage: compile_time B H N D SLICES");
    };
    let mut g = Generator::new(0);
    let shape = [b, h, n, d];
    let q = Tensor::randn(&shape, DType::F32, &mut g).set_requires_grad(true);
    let k = Tensor::randn(&shape, DType::F32, &mut g).set_requires_grad(true);
    let v = Tensor::randn(&shape, DType::F32, &mut g).set_requires_grad(true);
    let grad = Tensor::randn(&shape, DType::F32, &mut g);
    let f = compile(move |x: &[Tensor]| vec![sdpa(&x[0], &x[1], &x[2], false, slices)])
        .fuse_attention(false);
    let step = || {
        let out = f.call(&[q.clone(), k.clone(), v.clone()]);
        out[0].backward_with(&grad);
    };
    let t0 = Instant::now();
    step();
    let first = t0.elapsed().as_secs_f64();
    let stats = f.stats();
    let mut steady = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        step();
        steady.push(t.elapsed().as_secs_f64());
    }
    steady.sort_by(f64::total_cmp);
    println!(
        "sliced attention ({b},{h},{n},{d}), {slices} slices, fwd+bwd: build {:.1} ms, first trace {:.1} ms, first call {:.1} ms, steady step {:.1} ms (median of 3, incl. re-trace)",
        stats.compile_seconds * 1e3,
        stats.trace_seconds * 1e3,
        first * 1e3,
        steady[1] * 1e3
    );
}
