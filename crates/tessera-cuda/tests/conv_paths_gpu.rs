//! Every CUDA convolution path against the CPU: cuDNN (forced with
//! `set_conv_path(ConvPath::Cudnn)`, so a silent fallback fails the test)
//! and the direct kernels, for the forward, the input gradient and the
//! weight gradient, over strides, paddings, dilations, groups (depthwise
//! included), bias and the fused ReLU epilogue, in f32, f16 and bf16 (f64:
//! the direct kernels). f32 within 1e-5 (outputs) and 1e-4 (gradients)
//! relative. Runs only with `TESSERA_CUDA_TESTS=1`; there a missing GPU is
//! a failure, not a skip.

use std::sync::{Mutex, Once};

use tessera::runtime::device::Device;
use tessera::tensor::{ConvOptions, Generator};
use tessera::{compile, DType, Tensor};
use tessera_cuda::cudnn::{conv_runs, set_conv_path, ConvPath};

/// The path is process-wide: the tests of this file take turns.
static PATH_LOCK: Mutex<()> = Mutex::new(());

fn gpu() -> bool {
    if std::env::var("TESSERA_CUDA_TESTS").as_deref() != Ok("1") {
        eprintln!("TESSERA_CUDA_TESTS is not 1: CUDA convolution path tests do not run here");
        return false;
    }
    static OPEN: Once = Once::new();
    OPEN.call_once(|| tessera_cuda::register().expect("TESSERA_CUDA_TESTS=1 needs a GPU"));
    true
}

fn randn(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    Tensor::randn(shape, DType::F64, &mut Generator::new(seed)).cast(dtype)
}

/// Output and gradient tolerances (relative, plus the same absolute).
fn tol(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F64 => (1e-12, 1e-11),
        DType::F32 => (1e-5, 1e-4),
        // One rounding of the output (and of the cotangent's products) to
        // 8 or 11 bits.
        _ => (2e-2, 5e-2),
    }
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

/// One convolution case: input, weight, optional bias, options.
struct Case {
    name: &'static str,
    x: [usize; 4],
    w: [usize; 4],
    bias: bool,
    options: ConvOptions,
}

fn cases() -> Vec<Case> {
    let o = ConvOptions::default;
    vec![
        Case {
            name: "3x3 pad 1",
            x: [2, 8, 9, 10],
            w: [16, 8, 3, 3],
            bias: false,
            options: o().padding(1),
        },
        Case {
            name: "stride 2x1, pad 1x2, dilation 2x1, groups 2, bias",
            x: [2, 4, 9, 8],
            w: [6, 2, 3, 2],
            bias: true,
            options: o()
                .stride_hw(2, 1)
                .padding_hw(1, 2)
                .dilation_hw(2, 1)
                .groups(2),
        },
        Case {
            name: "depthwise stride 2",
            x: [3, 8, 7, 6],
            w: [8, 1, 3, 3],
            bias: true,
            options: o().stride(2).padding(1).groups(8),
        },
        Case {
            name: "1x1 stride 2",
            x: [2, 16, 8, 8],
            w: [32, 16, 1, 1],
            bias: false,
            options: o().stride(2),
        },
        Case {
            name: "7x7 stride 2 pad 3 (a ResNet stem)",
            x: [2, 3, 20, 20],
            w: [8, 3, 7, 7],
            bias: false,
            options: o().stride(2).padding(3),
        },
        Case {
            name: "dilation 3, no padding",
            x: [1, 6, 12, 11],
            w: [4, 6, 3, 3],
            bias: true,
            options: o().dilation(3),
        },
    ]
}

/// The case's conv, its output and the gradients of `sum(y · cot)` with
/// respect to x, w (and b), on the device of `inputs`.
fn run(c: &Case, inputs: &[Tensor], cot: &Tensor) -> (Tensor, Vec<Tensor>) {
    let y = inputs[0].conv2d(&inputs[1], inputs.get(2), c.options);
    (&y * cot).sum(&[], false).backward();
    let grads = inputs
        .iter()
        .map(|t| t.grad().expect("a gradient"))
        .collect();
    (y, grads)
}

fn check_case(c: &Case, dtype: DType, path: ConvPath) {
    let what = format!("{} {dtype} {path:?}", c.name);
    let mut host = vec![randn(&c.x, 1, dtype), randn(&c.w, 2, dtype)];
    if c.bias {
        host.push(randn(&c.w[..1], 3, dtype));
    }
    let cpu: Vec<Tensor> = host.iter().map(|t| t.set_requires_grad(true)).collect();
    let dev: Vec<Tensor> = host
        .iter()
        .map(|t| t.to_device("cuda").unwrap().set_requires_grad(true))
        .collect();
    let before = conv_runs();
    let out_shape = host[0]
        .conv2d(&host[1], host.get(2), c.options)
        .shape()
        .to_vec();
    let cot = randn(&out_shape, 9, dtype);
    let (yc, gc) = run(c, &cpu, &cot);
    let (yg, gg) = run(c, &dev, &cot.to_device("cuda").unwrap());
    let (out_tol, grad_tol) = tol(dtype);
    close(&format!("{what}: output"), &yg, &yc, out_tol);
    for (i, (g, h)) in gg.iter().zip(&gc).enumerate() {
        close(&format!("{what}: gradient {i}"), g, h, grad_tol);
    }
    let after = conv_runs();
    match path {
        // The forward, the input gradient and the weight gradient.
        ConvPath::Cudnn => assert!(
            after.0 >= before.0 + 3,
            "{what}: cuDNN ran {before:?} → {after:?}"
        ),
        ConvPath::Direct => assert!(
            after.1 >= before.1 + 3,
            "{what}: direct ran {before:?} → {after:?}"
        ),
        ConvPath::Auto => {}
    }
}

/// The compiled conv + bias + ReLU (one op with the fused epilogue) on the
/// GPU against the CPU's.
fn check_epilogue(dtype: DType, path: ConvPath) {
    let f = compile(|a: &[Tensor]| {
        let o = ConvOptions::default().stride(2).padding(1);
        vec![a[0].conv2d(&a[1], Some(&a[2]), o).relu()]
    });
    let host = [
        randn(&[2, 6, 11, 9], 4, dtype),
        randn(&[10, 6, 3, 3], 5, dtype),
        randn(&[10], 6, dtype),
    ];
    let dev: Vec<Tensor> = host.iter().map(|t| t.to_device("cuda").unwrap()).collect();
    let before = conv_runs();
    let y = f.call(&dev)[0].clone();
    let after = conv_runs();
    if path == ConvPath::Cudnn {
        assert!(
            after.0 > before.0,
            "compiled conv+bias+relu {dtype}: cuDNN ran"
        );
    }
    let what = format!("compiled conv+bias+relu {dtype} {path:?}");
    close(&what, &y, &f.call(&host)[0], tol(dtype).0);
    assert!(
        y.to_f64_vec().iter().all(|v| *v >= 0.0),
        "{what}: the ReLU ran"
    );
}

#[test]
fn every_convolution_path_matches_the_cpu() {
    if !gpu() {
        return;
    }
    let _turn = PATH_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    for path in [ConvPath::Cudnn, ConvPath::Direct] {
        set_conv_path(path);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for c in cases() {
                check_case(&c, dtype, path);
            }
            check_epilogue(dtype, path);
        }
    }
    // f64 and uneven padding: cuDNN's auto path hands them to the direct
    // kernels.
    set_conv_path(ConvPath::Auto);
    let same = Case {
        name: "same even kernel (uneven padding)",
        x: [1, 2, 5, 6],
        w: [3, 2, 4, 2],
        bias: false,
        options: ConvOptions::default().same(),
    };
    let before = conv_runs();
    check_case(&same, DType::F32, ConvPath::Auto);
    check_case(&cases()[1], DType::F64, ConvPath::Auto);
    let after = conv_runs();
    assert!(
        after.1 >= before.1 + 6,
        "the fallback ran: {before:?} → {after:?}"
    );
}

#[test]
fn a_forced_cudnn_path_refuses_what_cudnn_cannot_run() {
    if !gpu() {
        return;
    }
    let _turn = PATH_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    set_conv_path(ConvPath::Cudnn);
    let x = randn(&[1, 2, 5, 6], 1, DType::F64)
        .to_device("cuda")
        .unwrap();
    let w = randn(&[3, 2, 3, 3], 2, DType::F64)
        .to_device("cuda")
        .unwrap();
    let e = x
        .try_conv2d(&w, None, ConvOptions::default().padding(1))
        .expect_err("cuDNN does not run f64");
    set_conv_path(ConvPath::Auto);
    let m = e.to_string();
    assert!(
        m.contains("tessera::conv2d") && m.contains("cuDNN cannot run") && m.contains("f64"),
        "{m}"
    );
}
