//! Bandwidth of generated kernels on the GPU: an elementwise exp (one
//! read, one write), an add (two reads, one write), a fused-style chain
//! `relu(x * 2 + y)` as eager ops, a last-dim softmax and sum, on N elements
//! (default 64 Mi; softmax over rows of 4096). 3 warm-ups, then 20 runs
//! between two synchronizations, as scripts/anchors/torch_rows_rate.py
//! times PyTorch. GB/s counts bytes read plus bytes written once.
//!
//! `cargo run --release -p tessera-cuda --example rows_rate -- bf16 67108864`

use std::time::Instant;

use tessera::runtime::device::{self, Device};
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

fn time(what: &str, dtype: DType, bytes: f64, f: impl Fn() -> Tensor) -> tessera::Result<()> {
    for _ in 0..3 {
        f();
    }
    device::synchronize(Device::Cuda)?;
    let reps = 20;
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    device::synchronize(Device::Cuda)?;
    let s = t.elapsed().as_secs_f64() / reps as f64;
    println!(
        "{{\"who\": \"tessera\", \"op\": \"{what}\", \"dtype\": \"{dtype}\", \"ms\": {:.3}, \"gbs\": {:.0}}}",
        s * 1e3,
        bytes / s / 1e9
    );
    Ok(())
}

fn main() -> tessera::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dtype: DType = args
        .get(1)
        .map_or(Ok(DType::BF16), |s| s.parse())
        .expect("a dtype");
    let n: usize = args.get(2).map_or(1 << 26, |s| s.parse().expect("a size"));
    tessera_cuda::register()?;
    let mut g = Generator::new(0);
    let x = Tensor::randn(&[n / 4096, 4096], dtype, &mut g).to(Device::Cuda)?;
    let y = Tensor::randn(&[n / 4096, 4096], dtype, &mut g).to(Device::Cuda)?;
    let b = (n * dtype.size_bytes()) as f64;
    time("exp", dtype, 2.0 * b, || x.exp())?;
    time("add", dtype, 3.0 * b, || &x + &y)?;
    time("chain relu(x*2+y) eager", dtype, 3.0 * b, || {
        ((&x * 2.0) + &y).relu()
    })?;
    time("softmax(-1)", dtype, 2.0 * b, || x.softmax(-1))?;
    time("sum(-1)", dtype, b, || x.sum(&[-1], false))?;
    Ok(())
}
