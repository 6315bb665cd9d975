//! Compiled vs eager: a chain of 8 pointwise ops over 64 Mi f32 elements
//! (fused into one kernel: one read, one write) and softmax over
//! (4096, 4096) against the copy floor, all in one run:
//! `cargo bench -p tessera --bench compile`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rayon::prelude::*;
use tessera::tensor::Generator;
use tessera::{compile, DType, Tensor};

const N: usize = 64 << 20;

/// Eight ops, two of them transcendental (tanh, sigmoid): compute-heavy.
fn chain(x: &[Tensor]) -> Vec<Tensor> {
    let y = ((&x[0] * 1.5 + 0.25).tanh() * &x[0] - 0.5).relu().sigmoid() * 2.0;
    vec![y]
}

/// Eight arithmetic ops: memory-bound, where fusion saves 7 of 8 round trips.
fn arith_chain(x: &[Tensor]) -> Vec<Tensor> {
    let y = (((&x[0] * 1.5 + 0.25).relu() * &x[0] - 0.5).maximum(-1.0) * 2.0).abs();
    vec![y]
}

fn bench_chain(c: &mut Criterion) {
    let mut group = c.benchmark_group("pointwise_chain_8ops_64M_f32");
    group.sample_size(10);
    let x = Tensor::randn(&[N], DType::F32, &mut Generator::new(0));
    let src = x.to_vec::<f32>().unwrap();
    let mut dst = vec![0f32; N];
    group.throughput(Throughput::Bytes((2 * N * 4) as u64));
    group.bench_function("copy (floor)", |b| {
        b.iter(|| {
            dst.par_chunks_mut(1 << 16)
                .zip(src.par_chunks(1 << 16))
                .for_each(|(d, s)| d.copy_from_slice(s))
        })
    });
    group.bench_function("eager", |b| b.iter(|| chain(std::slice::from_ref(&x))));
    let f = compile(chain);
    group.bench_function("compiled", |b| b.iter(|| f.call(std::slice::from_ref(&x))));
    // Block sizes searched on the first call and kept (`mode=max-autotune`).
    let tuned = compile(chain).mode(tessera::compile::Mode::MaxAutotune);
    group.bench_function("compiled max-autotune", |b| {
        b.iter(|| tuned.call(std::slice::from_ref(&x)))
    });
    group.bench_function("arith eager", |b| {
        b.iter(|| arith_chain(std::slice::from_ref(&x)))
    });
    let g = compile(arith_chain);
    group.bench_function("arith compiled", |b| {
        b.iter(|| g.call(std::slice::from_ref(&x)))
    });
    group.finish();
}

fn softmax(x: &[Tensor]) -> Vec<Tensor> {
    vec![x[0].softmax(-1)]
}

fn bench_softmax(c: &mut Criterion) {
    let mut group = c.benchmark_group("softmax_4096x4096_f32");
    group.sample_size(10);
    let n = 4096 * 4096;
    let x = Tensor::randn(&[4096, 4096], DType::F32, &mut Generator::new(1));
    let src = x.to_vec::<f32>().unwrap();
    let mut dst = vec![0f32; n];
    group.throughput(Throughput::Bytes((2 * n * 4) as u64));
    group.bench_function("copy (floor)", |b| {
        b.iter(|| {
            dst.par_chunks_mut(1 << 16)
                .zip(src.par_chunks(1 << 16))
                .for_each(|(d, s)| d.copy_from_slice(s))
        })
    });
    group.bench_function("eager", |b| b.iter(|| softmax(std::slice::from_ref(&x))));
    let f = compile(softmax);
    group.bench_function("compiled", |b| b.iter(|| f.call(std::slice::from_ref(&x))));
    group.finish();
}

criterion_group!(benches, bench_chain, bench_softmax);
criterion_main!(benches);
