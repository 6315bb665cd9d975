//! tessera's cuBLASLt matmul rate at N×N×N on the GPU (default 8192, bf16):
//! 3 warm-ups, then 20 products between two synchronizations, as
//! scripts/anchors/torch_matmul.py times torch.matmul.
//!
//! `cargo run --release -p tessera-cuda --example matmul_rate -- 8192 bf16`

use std::time::Instant;

use tessera::runtime::device::{self, Device};
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

fn main() -> tessera::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args.get(1).map_or(8192, |s| s.parse().expect("a size"));
    let dtype: DType = args
        .get(2)
        .map_or(Ok(DType::BF16), |s| s.parse())
        .expect("a dtype");
    tessera_cuda::register()?;
    let mut g = Generator::new(0);
    let a = Tensor::randn(&[n, n], dtype, &mut g).to(Device::Cuda)?;
    let b = Tensor::randn(&[n, n], dtype, &mut g).to(Device::Cuda)?;
    for _ in 0..3 {
        a.try_matmul(&b)?;
    }
    device::synchronize(Device::Cuda)?;
    let reps = 20;
    let t = Instant::now();
    for _ in 0..reps {
        a.try_matmul(&b)?;
    }
    device::synchronize(Device::Cuda)?;
    let s = t.elapsed().as_secs_f64() / reps as f64;
    println!(
        "{{\"who\": \"tessera (cuBLASLt)\", \"n\": {n}, \"dtype\": \"{dtype}\", \"ms\": {:.3}, \"tflops\": {:.1}}}",
        s * 1e3,
        2.0 * (n as f64).powi(3) / s / 1e12
    );
    Ok(())
}
