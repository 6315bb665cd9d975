//! Elementwise throughput against the machine's copy bandwidth, in one run.
//!
//! Bytes counted are bytes moved (read + written), for the copy as for the
//! ops, so criterion's GiB/s figures compare directly:
//! `cargo bench -p tessera --bench elementwise`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rayon::prelude::*;
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

const N: usize = 64 << 20; // 64 Mi elements, 256 MiB per f32 tensor

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("elementwise_64M_f32");
    group.sample_size(10);
    let mut g = Generator::new(0);
    let a = Tensor::randn(&[N], DType::F32, &mut g);
    let b = Tensor::randn(&[N], DType::F32, &mut g);

    // The ceiling: a parallel memcpy into a preallocated buffer, on the same
    // rayon pool and chunking the kernels use.
    let src = a.to_vec::<f32>().unwrap();
    let mut dst = vec![0f32; N];
    group.throughput(Throughput::Bytes((2 * N * 4) as u64));
    group.bench_function("copy (memcpy ceiling)", |bench| {
        bench.iter(|| {
            dst.par_chunks_mut(1 << 16)
                .zip(src.par_chunks(1 << 16))
                .for_each(|(d, s)| d.copy_from_slice(s))
        })
    });
    group.bench_function("relu (unary)", |bench| bench.iter(|| a.relu()));
    group.bench_function("mul by scalar", |bench| bench.iter(|| &a * 2.0));
    group.throughput(Throughput::Bytes((3 * N * 4) as u64));
    group.bench_function("add (binary)", |bench| bench.iter(|| &a + &b));
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
