//! Flash attention forward+backward on the CPU at (B, H, N, D) = (4, 16,
//! 512, 64), f32, non-causal: the issue 6 target is ≤ 0.85× PyTorch's
//! `F.scaled_dot_product_attention` forward+backward on the same machine
//! (`python3 scripts/torch_sdpa_cpu.py`, run back to back with this).
//!
//! `cargo bench -p tessera --bench flash_attention`; throughput is in FLOP/s
//! (criterion's "elem/s"): 4·B·H·N²·D for the forward's two products, 3.5×
//! that for forward+backward (two more in the backward's recomputation of
//! P and dP, three for dQ, dK, dV).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;
use std::time::Duration;
use tessera::runtime::cpu::flash::{
    flash_backward, flash_forward, AttentionParams, AttentionShape,
};

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let (b, h, n, d) = (4, 16, 512, 64);
    let shape = AttentionShape {
        bh: b * h,
        q_len: n,
        kv_len: n,
        head_dim: d,
        v_dim: d,
    };
    let p = AttentionParams {
        causal: false,
        scale: 1.0 / (d as f32).sqrt(),
    };
    let len = b * h * n * d;
    let (q, k, v, d_out) = (
        values(len, 1),
        values(len, 2),
        values(len, 3),
        values(len, 4),
    );
    let (mut out, mut lse) = (vec![0.0f32; len], vec![0.0f32; b * h * n]);
    let (mut dq, mut dk, mut dv) = (vec![0.0f32; len], vec![0.0f32; len], vec![0.0f32; len]);
    let fwd_flop = 4 * b * h * n * n * d;

    let mut group = c.benchmark_group("flash_attention_f32_4x16x512x64");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(8));
    group.throughput(Throughput::Elements(fwd_flop as u64 * 7 / 2));
    group.bench_function("fwd+bwd", |bench| {
        bench.iter(|| {
            flash_forward(&shape, &p, &q, &k, &v, None, &mut out, &mut lse);
            flash_backward(
                &shape, &p, &q, &k, &v, None, &out, &lse, &d_out, &mut dq, &mut dk, &mut dv,
            );
            black_box((&dq, &dk, &dv));
        })
    });
    group.throughput(Throughput::Elements(fwd_flop as u64));
    group.bench_function("fwd", |bench| {
        bench.iter(|| {
            flash_forward(&shape, &p, &q, &k, &v, None, &mut out, &mut lse);
            black_box(&out);
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
