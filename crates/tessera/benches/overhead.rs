//! Per-op eager overhead on tiny tensors (16 elements): the time of one op
//! when the arithmetic is negligible. `cargo bench -p tessera --bench overhead`.

use criterion::{criterion_group, criterion_main, Criterion};
use tessera::Tensor;

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("eager_overhead_16_elems");
    let a = Tensor::from_vec((0..16).map(|i| i as f32).collect::<Vec<_>>(), &[4, 4]);
    let b = Tensor::from_vec((0..16).map(|i| 1.0 + i as f32).collect::<Vec<_>>(), &[4, 4]);
    group.bench_function("add", |bench| bench.iter(|| &a + &b));
    group.bench_function("exp", |bench| bench.iter(|| a.exp()));
    group.bench_function("mul scalar", |bench| bench.iter(|| &a * 2.0));
    group.bench_function("sum all", |bench| bench.iter(|| a.sum(&[], false)));
    group.bench_function("matmul 4x4", |bench| bench.iter(|| a.matmul(&b)));
    group.bench_function("transpose (view)", |bench| bench.iter(|| a.transpose(0, 1)));
    group.bench_function("softmax", |bench| bench.iter(|| a.softmax(-1)));
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
