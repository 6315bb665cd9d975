//! Autocast on the GPU against the CPU: a bf16/f16 matmul (cuBLASLt, f32
//! compute) and the softmax autocast runs in f32 after it, eagerly and
//! compiled, and a short mixed-precision training run of a small
//! TransformerLM. Runs only with `TESSERA_CUDA_TESTS=1` (on a GPU machine,
//! by `scripts/gpu-check.sh`); there a missing GPU is a failure, not a skip.
//!
//! Tolerances: the matmul's operands are rounded to the same half values on
//! both devices and both accumulate in f32, so the products differ by the
//! summation order and then at most one rounding of the result: 2 units in
//! the last place of the half type relative, plus an absolute term for
//! results near zero. The f32 softmax is checked on the GPU's own product
//! (1e-5), and end to end with the product's rounding carried through exp.

use std::sync::Once;

use tessera::nn::{cross_entropy, ParamStore, TransformerConfig, TransformerLM};
use tessera::optim::{AdamW, AdamWConfig, MixedPrecision, Optimizer};
use tessera::runtime::device::{self, Device};
use tessera::tensor::Generator;
use tessera::{autocast, compile, DType, Tensor};

fn gpu() -> bool {
    if std::env::var("TESSERA_CUDA_TESTS").as_deref() != Ok("1") {
        eprintln!("TESSERA_CUDA_TESTS is not 1: CUDA autocast tests do not run here");
        return false;
    }
    static OPEN: Once = Once::new();
    OPEN.call_once(|| tessera_cuda::register().expect("TESSERA_CUDA_TESTS=1 needs a GPU"));
    true
}

/// One unit in the last place at 1 (2⁻⁷ for bf16, 2⁻¹⁰ for f16).
fn ulp(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-7),
        DType::F16 => 2f64.powi(-10),
        d => panic!("not a half type: {d}"),
    }
}

fn close(what: &str, gpu: &Tensor, cpu: &Tensor, rtol: f64, atol: f64) {
    assert_eq!(gpu.device(), Device::Cuda, "{what}: stayed on the GPU");
    assert_eq!(gpu.ty(), cpu.ty(), "{what}: type");
    let (g, c) = (gpu.to_f64_vec(), cpu.to_f64_vec());
    let mut worst: f64 = 0.0;
    for (i, (a, b)) in g.iter().zip(&c).enumerate() {
        let err = (a - b).abs();
        assert!(
            err <= atol + rtol * b.abs(),
            "{what}: element {i}: gpu {a} vs cpu {b} (rtol {rtol}, atol {atol})"
        );
        worst = worst.max(err);
    }
    eprintln!("{what}: max |gpu - cpu| = {worst:.2e}");
}

fn product_then_softmax(x: &[Tensor]) -> Vec<Tensor> {
    let c = x[0].matmul(&x[1]);
    vec![c.softmax(-1), c]
}

#[test]
fn autocast_matmul_and_softmax_on_the_gpu_follow_the_cpu() {
    if !gpu() {
        return;
    }
    // Products of about unit size (|c| < ~4), so a unit in the last place
    // of c moves the softmax by about as much relatively.
    let g = &mut Generator::new(1);
    let a = Tensor::randn(&[96, 128], DType::F32, g) * (1.0 / 128f64.sqrt());
    let b = Tensor::randn(&[128, 80], DType::F32, g);
    let (ad, bd) = (a.to(Device::Cuda).unwrap(), b.to(Device::Cuda).unwrap());
    let compiled = compile(product_then_softmax);
    for dtype in [DType::BF16, DType::F16] {
        let cpu = autocast(dtype, || product_then_softmax(&[a.clone(), b.clone()]));
        let eager = autocast(dtype, || product_then_softmax(&[ad.clone(), bd.clone()]));
        let traced = autocast(dtype, || compiled.call(&[ad.clone(), bd.clone()]));
        assert_eq!((cpu[0].dtype(), cpu[1].dtype()), (DType::F32, dtype));
        let u = ulp(dtype);
        for (mode, gpu) in [("eager", &eager), ("compiled", &traced)] {
            close(
                &format!("{dtype} {mode} matmul"),
                &gpu[1],
                &cpu[1],
                2.0 * u,
                u / 8.0,
            );
            // The f32 softmax of the GPU's own product, against the CPU's.
            let reference = gpu[1].to_host().unwrap().cast(DType::F32).softmax(-1);
            close(
                &format!("{dtype} {mode} softmax of the GPU's product"),
                &gpu[0],
                &reference,
                1e-5,
                1e-7,
            );
            // End to end: two units of c's rounding through exp.
            close(
                &format!("{dtype} {mode} softmax"),
                &gpu[0],
                &cpu[0],
                4.0 * 4.0 * u,
                1e-6,
            );
        }
    }
    assert_eq!(compiled.stats().compiles, 2, "one entry per autocast dtype");
}

/// bf16 and f16 (with loss scaling) training on the GPU against the same
/// run on the CPU: same initial parameters and batches; the losses agree
/// within the half type's rounding, step by step.
#[test]
fn mixed_precision_training_on_the_gpu_follows_the_cpu() {
    if !gpu() {
        return;
    }
    const VOCAB: usize = 16;
    let config = TransformerConfig {
        vocab: VOCAB,
        d_model: 64,
        n_heads: 4,
        n_layers: 2,
        d_ff: 128,
        max_len: 16,
        dropout: 0.0,
    };
    let batch = |step: usize, on: Device| {
        let ids: Vec<i64> = (0..8 * 17)
            .map(|i| ((i * 7 + step * 3 + i / 17) % VOCAB) as i64)
            .collect();
        let ids = Tensor::from_vec(ids, &[8, 17]);
        let inputs = ids.narrow(1, 0, 16).contiguous().to(on).unwrap();
        let targets = ids.narrow(1, 1, 16).reshape(&[-1]).to(on).unwrap();
        (inputs, targets)
    };
    let train = |dtype: DType, on: Device| -> Vec<f64> {
        device::with_device(on, || {
            let mut store = ParamStore::new();
            let model = TransformerLM::new(&mut store, "", config.clone(), &mut Generator::new(0));
            let mut opt = AdamW::new(
                store.parameters(),
                AdamWConfig {
                    lr: 3e-3,
                    ..AdamWConfig::default()
                },
            );
            let mut amp = MixedPrecision::new(dtype, store.parameters()).unwrap();
            (0..20)
                .map(|step| {
                    let (inputs, targets) = batch(step, on);
                    opt.zero_grad();
                    let loss = amp.forward(|| {
                        let logits = model.forward(&inputs, true);
                        cross_entropy(&logits.reshape(&[-1, VOCAB as isize]), &targets, None)
                    });
                    amp.backward(&loss).unwrap();
                    assert!(
                        amp.step(&mut opt).unwrap(),
                        "{dtype} step {step} on {on}: not skipped"
                    );
                    loss.item()
                })
                .collect()
        })
    };
    for (dtype, tolerance) in [(DType::BF16, 2e-2), (DType::F16, 4e-3)] {
        let cpu = train(dtype, Device::Cpu);
        let gpu = train(dtype, Device::Cuda);
        let worst = gpu
            .iter()
            .zip(&cpu)
            .fold(0.0f64, |m, (g, c)| m.max((g - c).abs() / c.abs()));
        eprintln!(
            "{dtype} training: worst relative loss gap gpu vs cpu {worst:.2e}; loss {:.4} -> {:.4}",
            gpu[0],
            gpu[gpu.len() - 1]
        );
        assert!(
            worst <= tolerance,
            "{dtype}: {worst}\ngpu {gpu:?}\ncpu {cpu:?}"
        );
    }
}
