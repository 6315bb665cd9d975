//! The convolution and pooling ops on the GPU (the direct kernels of
//! `codegen::conv`) against the CPU: conv2d with strides, uneven padding,
//! dilation, groups (depthwise), bias and the ReLU epilogue; conv1d and
//! conv_transpose2d; max/avg pooling (ceil mode, count_include_pad); every
//! gradient; f32, f64 and bf16; eagerly and compiled; and a small ResNet-18
//! training step. Runs only with `TESSERA_CUDA_TESTS=1` (on a GPU machine,
//! by `scripts/gpu-check.sh`); there a missing GPU is a failure, not a skip.

use std::sync::Once;

use tessera::nn::{cross_entropy, ParamStore, ResNet, ResNetConfig};
use tessera::runtime::device::{self, Device};
use tessera::tensor::{ConvOptions, Generator, PoolOptions};
use tessera::{compile, DType, Tensor};

fn gpu() -> bool {
    if std::env::var("TESSERA_CUDA_TESTS").as_deref() != Ok("1") {
        eprintln!("TESSERA_CUDA_TESTS is not 1: CUDA convolution tests do not run here");
        return false;
    }
    static OPEN: Once = Once::new();
    OPEN.call_once(|| tessera_cuda::register().expect("TESSERA_CUDA_TESTS=1 needs a GPU"));
    true
}

fn randn(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    Tensor::randn(shape, DType::F64, &mut Generator::new(seed)).cast(dtype)
}

fn close(what: &str, gpu: &Tensor, cpu: &Tensor, tol: f64) {
    assert_eq!(gpu.device(), Device::Cuda, "{what}: stayed on the GPU");
    assert_eq!(gpu.ty(), cpu.ty(), "{what}: type");
    let (g, c) = (gpu.to_f64_vec(), cpu.to_f64_vec());
    for (i, (a, b)) in g.iter().zip(&c).enumerate() {
        assert!(
            (a - b).abs() <= tol * (1.0 + b.abs()),
            "{what}: element {i}: gpu {a} vs cpu {b}"
        );
    }
}

fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        _ => 2e-2,
    }
}

/// `f` of inputs on both devices (the differentiated ones require grad),
/// then the backward of `sum(f · cot)`: outputs and gradients compared.
fn both(what: &str, dtype: DType, shapes: &[&[usize]], f: impl Fn(&[Tensor]) -> Tensor) {
    let host: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| randn(s, 10 + i as u64, dtype))
        .collect();
    let cpu: Vec<Tensor> = host.iter().map(|t| t.set_requires_grad(true)).collect();
    let dev: Vec<Tensor> = host
        .iter()
        .map(|t| t.to_device("cuda").unwrap().set_requires_grad(true))
        .collect();
    let (yc, yg) = (f(&cpu), f(&dev));
    close(&format!("{what} {dtype} output"), &yg, &yc, tol(dtype));
    let cot = randn(yc.shape(), 99, dtype);
    (&yc * &cot).sum(&[], false).backward();
    (&yg * &cot.to_device("cuda").unwrap())
        .sum(&[], false)
        .backward();
    for (i, (c, g)) in cpu.iter().zip(&dev).enumerate() {
        close(
            &format!("{what} {dtype} grad {i}"),
            &g.grad().unwrap(),
            &c.grad().unwrap(),
            tol(dtype) * 10.0,
        );
    }
}

#[test]
fn convolutions_match_the_cpu() {
    if !gpu() {
        return;
    }
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        both(
            "conv2d",
            dtype,
            &[&[2, 4, 9, 8], &[6, 2, 3, 2], &[6]],
            |a| {
                let o = ConvOptions::default()
                    .stride_hw(2, 1)
                    .padding_hw(1, 2)
                    .dilation_hw(2, 1)
                    .groups(2);
                a[0].conv2d(&a[1], Some(&a[2]), o).relu()
            },
        );
        both("depthwise", dtype, &[&[3, 4, 6, 5], &[4, 1, 3, 3]], |a| {
            a[0].conv2d(
                &a[1],
                None,
                ConvOptions::default().stride(2).padding(1).groups(4),
            )
        });
        both(
            "same even kernel",
            dtype,
            &[&[1, 2, 5, 6], &[3, 2, 4, 2]],
            |a| a[0].conv2d(&a[1], None, ConvOptions::default().same()),
        );
        both("1x1", dtype, &[&[2, 5, 4, 3], &[3, 5, 1, 1]], |a| {
            a[0].conv2d(&a[1], None, ConvOptions::default())
        });
        both("conv1d", dtype, &[&[2, 3, 11], &[4, 3, 3]], |a| {
            a[0].conv1d(
                &a[1],
                None,
                ConvOptions::default().stride(2).padding(1).dilation(2),
            )
        });
        both(
            "conv_transpose2d",
            dtype,
            &[&[2, 4, 3, 4], &[4, 3, 3, 3]],
            |a| {
                a[0].conv_transpose2d(
                    &a[1],
                    None,
                    ConvOptions::default()
                        .stride(2)
                        .padding(1)
                        .output_padding(1),
                )
            },
        );
    }
}

#[test]
fn pooling_matches_the_cpu() {
    if !gpu() {
        return;
    }
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        both("max_pool2d", dtype, &[&[2, 3, 7, 6]], |a| {
            a[0].max_pool2d(PoolOptions::new(3).stride(2).padding(1))
        });
        both("max_pool2d ceil dilated", dtype, &[&[1, 2, 8, 7]], |a| {
            a[0].max_pool2d(
                PoolOptions::hw(2, 3)
                    .stride(2)
                    .padding(1)
                    .dilation(2)
                    .ceil_mode(true),
            )
        });
        both("avg_pool2d", dtype, &[&[2, 3, 7, 6]], |a| {
            a[0].avg_pool2d(PoolOptions::new(3).stride(2).padding(1))
        });
        both(
            "avg_pool2d ceil exclude pad",
            dtype,
            &[&[1, 2, 7, 5]],
            |a| {
                a[0].avg_pool2d(
                    PoolOptions::new(3)
                        .stride(2)
                        .padding(1)
                        .ceil_mode(true)
                        .count_include_pad(false),
                )
            },
        );
    }
}

#[test]
fn a_compiled_conv_block_and_a_resnet_step_match_the_cpu() {
    if !gpu() {
        return;
    }
    let f = compile(|a: &[Tensor]| {
        let y = a[0].conv2d(&a[1], None, ConvOptions::default().padding(1));
        vec![(y + a[2].reshape(&[1, -1, 1, 1]))
            .relu()
            .max_pool2d(PoolOptions::new(2))]
    });
    let host = [
        randn(&[2, 3, 16, 16], 1, DType::F32),
        randn(&[8, 3, 3, 3], 2, DType::F32),
        randn(&[8], 3, DType::F32),
    ];
    let dev: Vec<Tensor> = host.iter().map(|t| t.to_device("cuda").unwrap()).collect();
    close("compiled block", &f.call(&dev)[0], &f.call(&host)[0], 1e-5);

    // One eager training step of a small ResNet-18 on each device (the
    // parameters and batch-norm statistics created there, from the same
    // host draws).
    let step = |device: Device| {
        device::with_device(device, || {
            let mut store = ParamStore::new();
            let config = ResNetConfig {
                width: 8,
                ..ResNetConfig::resnet18(10)
            };
            let model = ResNet::new(&mut store, "", config, &mut Generator::new(4));
            let x = randn(&[4, 3, 32, 32], 5, DType::F32).to(device).unwrap();
            let y = Tensor::from_vec(vec![1i64, 2, 3, 4], &[4])
                .to(device)
                .unwrap();
            let loss = cross_entropy(&model.forward(&x), &y, None);
            loss.backward();
            let grads: Vec<Tensor> = store
                .iter()
                .map(|p| p.grad().unwrap().to_host().unwrap())
                .collect();
            (loss.to_host().unwrap(), grads)
        })
    };
    let (lc, gc) = step(Device::Cpu);
    let (lg, gg) = step(Device::Cuda);
    assert!(
        (lc.item() - lg.item()).abs() < 1e-4,
        "{} vs {}",
        lc.item(),
        lg.item()
    );
    for (i, (c, g)) in gc.iter().zip(&gg).enumerate() {
        let worst = c
            .to_f64_vec()
            .iter()
            .zip(g.to_f64_vec())
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(worst < 1e-3, "parameter {i}: {worst}");
    }
}
