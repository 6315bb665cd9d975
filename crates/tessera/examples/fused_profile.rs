//! Where the time of the compiled pointwise chain goes: the chain over 64 Mi
//! elements (from memory) next to the same number of elements done as many
//! runs over a cache-resident size (compute only), and the copy floor.
//!
//! `RAYON_NUM_THREADS=1 cargo run --release -p tessera --example fused_profile`

mod common;
use common::cpu_ms;
use std::time::Instant;

use rayon::prelude::*;
use tessera::tensor::Generator;
use tessera::{compile, DType, Tensor};

const N: usize = 64 << 20;

fn chain(x: &[Tensor]) -> Vec<Tensor> {
    vec![((&x[0] * 1.5 + 0.25).tanh() * &x[0] - 0.5).relu().sigmoid() * 2.0]
}

fn arith_chain(x: &[Tensor]) -> Vec<Tensor> {
    vec![(((&x[0] * 1.5 + 0.25).relu() * &x[0] - 0.5).maximum(-1.0) * 2.0).abs()]
}

fn softmax(x: &[Tensor]) -> Vec<Tensor> {
    vec![x[0].softmax(-1)]
}

/// The best of `reps` timings of `f`: (wall ms, CPU ms).
fn best(reps: usize, mut f: impl FnMut()) -> (f64, f64) {
    (0..reps)
        .map(|_| {
            let (t, c) = (Instant::now(), cpu_ms());
            f();
            (t.elapsed().as_secs_f64() * 1e3, cpu_ms() - c)
        })
        .fold((f64::INFINITY, f64::INFINITY), |a, b| {
            (a.0.min(b.0), a.1.min(b.1))
        })
}

fn show((wall, cpu): (f64, f64)) -> String {
    format!("{wall:.1} ms ({cpu:.1} ms cpu)")
}

fn copy_floor(src: &[f32], dst: &mut [f32]) -> (f64, f64) {
    best(5, || {
        dst.par_chunks_mut(1 << 16)
            .zip(src.par_chunks(1 << 16))
            .for_each(|(d, s)| d.copy_from_slice(s))
    })
}

fn main() {
    let which = std::env::args().nth(1).unwrap_or_else(|| "all".into());
    let mut g = Generator::new(0);
    println!("threads {}", rayon::current_num_threads());
    let x = Tensor::randn(&[N], DType::F32, &mut g);
    let small = 1 << 16;
    let xs = Tensor::randn(&[small], DType::F32, &mut g);
    if which != "softmax" {
        let src = x.to_vec::<f32>().unwrap();
        let mut dst = vec![0f32; N];
        println!("copy floor 64Mi: {}", show(copy_floor(&src, &mut dst)));
    }
    for (name, f) in [
        ("transcendental", chain as fn(&[Tensor]) -> Vec<Tensor>),
        ("arith", arith_chain),
    ] {
        if which != "all" && which != name {
            continue;
        }
        let c = compile(f);
        if std::env::var("ONLY_COMPILED").is_ok() {
            // For a profiler: nothing but the compiled call over 64 Mi.
            println!(
                "{name} compiled: {}",
                show(best(20, || drop(c.call(std::slice::from_ref(&x)))))
            );
            continue;
        }
        let eager = best(3, || drop(f(std::slice::from_ref(&x))));
        let big = best(5, || drop(c.call(std::slice::from_ref(&x))));
        let c2 = compile(f);
        let cached = best(3, || {
            for _ in 0..N / small {
                drop(c2.call(std::slice::from_ref(&xs)));
            }
        });
        println!(
            "{name}: eager {}, compiled {} ({:.2}x wall), in-cache compute {}",
            show(eager),
            show(big),
            eager.0 / big.0,
            show(cached)
        );
    }
    if which == "all" || which == "softmax" {
        let x = Tensor::randn(&[4096, 4096], DType::F32, &mut g);
        let src = x.to_vec::<f32>().unwrap();
        let mut dst = vec![0f32; src.len()];
        let floor = copy_floor(&src, &mut dst);
        let c = compile(softmax);
        if std::env::var("ONLY_COMPILED").is_ok() {
            println!(
                "softmax compiled: {}",
                show(best(200, || drop(c.call(std::slice::from_ref(&x)))))
            );
            return;
        }
        let eager = best(10, || drop(softmax(std::slice::from_ref(&x))));
        let comp = best(10, || drop(c.call(std::slice::from_ref(&x))));
        let xs = Tensor::randn(&[16, 4096], DType::F32, &mut g);
        let c2 = compile(softmax);
        let cached = best(3, || {
            for _ in 0..256 {
                drop(c2.call(std::slice::from_ref(&xs)));
            }
        });
        println!(
            "softmax: floor {}, eager {}, compiled {} ({:.2}x floor wall), in-cache {}",
            show(floor),
            show(eager),
            show(comp),
            comp.0 / floor.0,
            show(cached)
        );
    }
}
