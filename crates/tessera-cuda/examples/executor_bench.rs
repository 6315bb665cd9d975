//! The compiled executor's host overhead on the GPU: milliseconds per call
//! of compiled functions kernel by kernel (`mode=default`) and replayed
//! from a CUDA graph (`mode=reduce-overhead`), each call followed by a
//! synchronisation; median of `reps` calls after 3 warm-ups (the replay's
//! warm-up includes its recording). Next to it
//! `scripts/anchors/torch_replay.py` times the same functions in PyTorch
//! (eager and through a torch.cuda.CUDAGraph). The lanes `bfs` steps use
//! come from `TESSERA_CUDA_LANES` (default 4); `strict` runs one kernel
//! at a time on one stream. The attention pass is off (the composite's
//! kernels are measured, not the flash kernel).
//!
//! `cargo run --release -p tessera-cuda --example executor_bench -- 200`

use std::time::Instant;

use tessera::compile::Mode;
use tessera::runtime::device::{self, Device};
use tessera::schedule::Strategy;
use tessera::tensor::Generator;
use tessera::{compile, DType, Tensor};

/// The small MLP of the executor tests: a matmul with a bias + gelu
/// epilogue, softmaxes, elementwise chains and a reduction (8 kernels).
fn mlp(a: &[Tensor]) -> Vec<Tensor> {
    let h = (a[0].matmul(&a[1]) + &a[2]).gelu();
    let g = (&h.softmax(0) * 2.0).tanh() + 1.0;
    let p = g.t().softmax(-1);
    vec![p.reshape(&[-1]), (g.exp() - 1.0).sum(&[0], false)]
}

/// The seed's attention in 16 slices (bfs runs the slices side by side).
fn sliced(a: &[Tensor]) -> Vec<Tensor> {
    vec![tessera_apps::seed_table::sdpa(
        &a[0], &a[1], &a[2], false, 16,
    )]
}

fn randn(shape: &[usize], dtype: DType, seed: u64) -> tessera::Result<Tensor> {
    Tensor::randn(shape, dtype, &mut Generator::new(seed)).to(Device::Cuda)
}

/// Median milliseconds per synchronised call.
fn time(reps: usize, mut call: impl FnMut()) -> tessera::Result<f64> {
    for _ in 0..3 {
        call();
    }
    device::synchronize(Device::Cuda)?;
    let mut ms = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        call();
        device::synchronize(Device::Cuda)?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[reps / 2])
}

fn bench(
    name: &str,
    f: fn(&[Tensor]) -> Vec<Tensor>,
    inputs: &[Tensor],
    reps: usize,
) -> tessera::Result<()> {
    let lanes = std::env::var("TESSERA_CUDA_LANES").unwrap_or_else(|_| "4".into());
    let runs = [
        (Mode::Default, Strategy::Bfs),
        (Mode::Default, Strategy::Strict),
        (Mode::ReduceOverhead, Strategy::Bfs),
    ];
    for (mode, order) in runs {
        let g = compile(f).mode(mode).schedule(order).fuse_attention(false);
        let ms = time(reps, || {
            g.call(inputs);
        })?;
        let s = g.replay_stats();
        let mode = match mode {
            Mode::ReduceOverhead => "reduce-overhead",
            _ => "default",
        };
        println!(
            "{{\"who\": \"tessera\", \"case\": \"{name}\", \"mode\": \"{mode}\", \"order\": \"{}\", \
             \"lanes\": {lanes}, \"ms_per_call\": {ms:.4}, \"replays\": {}, \"fallbacks\": {}}}",
            order.name(),
            s.replays,
            s.fallbacks
        );
    }
    Ok(())
}

/// Eager pointwise kernels on 2^26 elements against a device copy: GB/s
/// counting each input read once and the output written once (the copy:
/// bytes read + written).
fn bandwidth(reps: usize) -> tessera::Result<()> {
    let n = 1usize << 26;
    let backend = device::device_backend(Device::Cuda)?;
    for dtype in [DType::F32, DType::BF16] {
        let a = randn(&[n], dtype, 40)?;
        let b = randn(&[n], dtype, 41)?;
        let bytes = (n * dtype.size_bytes()) as f64;
        let add = time(reps, || {
            let _ = &a + &b;
        })?;
        let exp = time(reps, || {
            let _ = a.exp();
        })?;
        let dst = backend.alloc(dtype, n)?;
        let src = a.device_storage().expect("on the device").clone();
        let copy = time(reps, || backend.copy(&dst, &src).expect("a copy"))?;
        let gbs = |moved: f64, ms: f64| moved / ms / 1e6;
        println!(
            "{{\"who\": \"tessera\", \"case\": \"pointwise {dtype} 2^26\", \
             \"add_ms\": {add:.4}, \"add_gbs\": {:.0}, \"exp_ms\": {exp:.4}, \"exp_gbs\": {:.0}, \
             \"copy_ms\": {copy:.4}, \"copy_gbs\": {:.0}}}",
            gbs(3.0 * bytes, add),
            gbs(2.0 * bytes, exp),
            gbs(2.0 * bytes, copy)
        );
    }
    Ok(())
}

fn main() -> tessera::Result<()> {
    let reps: usize = std::env::args()
        .nth(1)
        .map_or(200, |s| s.parse().expect("a count"));
    tessera_cuda::register()?;
    bandwidth(20)?;
    if std::env::args().nth(2).as_deref() == Some("bandwidth") {
        return Ok(());
    }
    let mlp_inputs = [
        randn(&[64, 128], DType::F32, 1)?,
        randn(&[128, 96], DType::F32, 2)?,
        randn(&[96], DType::F32, 3)?,
    ];
    bench("mlp f32 64x128x96", mlp, &mlp_inputs, reps)?;
    let qkv: Vec<Tensor> = (0..3)
        .map(|i| randn(&[4, 16, 1024, 64], DType::BF16, 10 + i))
        .collect::<tessera::Result<_>>()?;
    bench(
        "sliced attention bf16 4x16x1024x64 /16",
        sliced,
        &qkv,
        reps / 4,
    )?;
    Ok(())
}
