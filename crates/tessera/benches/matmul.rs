//! f32 matmul through `Tensor::matmul` (the whole eager path: type
//! inference, dispatch, output allocation) against a direct call of the gemm
//! crate on the same buffers: it must stay within a few percent of raw gemm
//! (no copies, no zero-fill of the output).
//!
//! `cargo bench -p tessera --bench matmul`; throughput is in FLOP/s
//! (criterion's "elem/s", 2·n³ per product).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;
use std::time::Duration;
use tessera::Tensor;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

fn raw_gemm(n: usize, a: &[f32], b: &[f32], dst: &mut [f32]) {
    // SAFETY: a, b and dst are row-major n×n buffers.
    unsafe {
        gemm::gemm(
            n,
            n,
            n,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            n as isize,
            b.as_ptr(),
            1,
            n as isize,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(rayon::current_num_threads()),
        )
    }
}

fn bench(c: &mut Criterion) {
    let n = 2048;
    let (av, bv) = (values(n * n, 1), values(n * n, 2));
    let a = Tensor::from_vec(av.clone(), &[n, n]);
    let b = Tensor::from_vec(bv.clone(), &[n, n]);
    let mut dst = vec![0.0f32; n * n];

    let mut group = c.benchmark_group("matmul_f32_2048");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(8))
        .throughput(Throughput::Elements(2 * (n * n * n) as u64));
    group.bench_function("Tensor::matmul", |bench| {
        bench.iter(|| black_box(a.matmul(&b)))
    });
    group.bench_function("raw_gemm", |bench| {
        bench.iter(|| raw_gemm(n, black_box(&av), black_box(&bv), &mut dst))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
