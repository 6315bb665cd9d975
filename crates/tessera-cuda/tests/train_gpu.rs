//! `tessera_apps::train::train_on(.., Device::Cuda, ..)` against the same run on
//! the CPU: same initial parameters (drawn on the host from the same seeds),
//! same batches and dropout masks, so the losses agree step by step up to
//! f32 rounding (cuBLASLt and the generated kernels sum in other orders).
//! Runs only with `TESSERA_CUDA_TESTS=1` (on a GPU machine).

use tessera::runtime::device::Device;
use tessera_apps::train::{train_on, TrainConfig};

#[test]
fn a_short_training_run_on_the_gpu_follows_the_cpu() {
    if std::env::var("TESSERA_CUDA_TESTS").as_deref() != Ok("1") {
        eprintln!("TESSERA_CUDA_TESTS is not 1: the GPU training test does not run here");
        return;
    }
    tessera_cuda::register().expect("TESSERA_CUDA_TESTS=1 needs a GPU");
    let config = TrainConfig {
        steps: 40,
        warmup: 10,
        eval_every: 40,
        eval_size: 200,
        checkpoint: None,
        plot: None,
        ..TrainConfig::default()
    };
    let cpu = train_on(&config, Device::Cpu, |_| {}).unwrap();
    let gpu = train_on(&config, Device::Cuda, |_| {}).unwrap();
    assert_eq!(gpu.device, "cuda");
    assert_eq!(gpu.losses.len(), cpu.losses.len());
    for (step, (g, c)) in gpu.losses.iter().zip(&cpu.losses).enumerate() {
        assert!(
            (g - c).abs() <= 1e-4 * c.abs(),
            "step {}: loss on the GPU {g} vs the CPU {c}",
            step + 1
        );
    }
    eprintln!(
        "losses step 1 / {}: cpu {:.6} / {:.6}, gpu {:.6} / {:.6}; {:.2} vs {:.2} ms/step",
        config.steps,
        cpu.losses[0],
        cpu.losses[config.steps - 1],
        gpu.losses[0],
        gpu.losses[config.steps - 1],
        cpu.ms_per_step,
        gpu.ms_per_step
    );
}
