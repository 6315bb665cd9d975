//! CUDA against CPU: every op family, fused kernels, compiled programs and
//! gradients computed on the GPU must equal the CPU's within the stated
//! tolerance. Runs only with `TESSERA_CUDA_TESTS=1` (on a GPU machine, by
//! `scripts/gpu-check.sh`); there a missing GPU is a failure, not a skip.
//!
//! Tolerances: |gpu - cpu| <= atol + rtol·|cpu| with (rtol, atol) of
//! (1e-5, 1e-6) for f64-exact paths, (2e-5, 1e-5) for f32 elementwise,
//! (1e-4, 1e-4) for f32 reductions and matmul (summation order differs),
//! one unit in the last place of f16 (2^-10) and bf16 (2^-7) relative, plus
//! an absolute term for results near zero.

use std::sync::Once;

#[path = "../../tessera/tests/schedule_util/mod.rs"]
mod schedule_util;

use schedule_util::traced;

use tessera::ir::DType;
use tessera::runtime::device::{self, Device};
use tessera::tensor::Generator;
use tessera::{compile, Tensor};

fn gpu() -> bool {
    if std::env::var("TESSERA_CUDA_TESTS").as_deref() != Ok("1") {
        eprintln!("TESSERA_CUDA_TESTS is not 1: CUDA differential tests do not run here");
        return false;
    }
    static OPEN: Once = Once::new();
    OPEN.call_once(|| tessera_cuda::register().expect("TESSERA_CUDA_TESTS=1 needs a GPU"));
    true
}

fn tol(dtype: DType, heavy: bool) -> (f64, f64) {
    match (dtype, heavy) {
        (DType::F64, _) => (1e-9, 1e-9),
        (DType::F32, false) => (2e-5, 1e-5),
        (DType::F32, true) => (1e-4, 1e-4),
        (DType::F16, _) => (2.0 / 1024.0, 2e-3),
        (DType::BF16, _) => (2.0 / 128.0, 2e-2),
        _ => (0.0, 0.0),
    }
}

fn close(what: &str, gpu: &Tensor, cpu: &Tensor, (rtol, atol): (f64, f64)) {
    assert_eq!(
        gpu.device(),
        Device::Cuda,
        "{what}: the result stayed on the GPU"
    );
    assert_eq!(gpu.shape(), cpu.shape(), "{what}: shape");
    assert_eq!(gpu.dtype(), cpu.dtype(), "{what}: dtype");
    let (g, c) = (gpu.to_f64_vec(), cpu.to_f64_vec());
    for (i, (a, b)) in g.iter().zip(&c).enumerate() {
        let ok = (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= atol + rtol * b.abs();
        assert!(
            ok,
            "{what}: element {i}: gpu {a} vs cpu {b} (rtol {rtol}, atol {atol})"
        );
    }
}

fn cuda(t: &Tensor) -> Tensor {
    t.to(Device::Cuda).unwrap()
}

fn randn(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F64, &mut Generator::new(seed)).cast(dtype)
}

/// Runs `f` on CPU tensors and on their GPU copies; compares every output.
fn both(what: &str, inputs: &[Tensor], heavy: bool, f: impl Fn(&[Tensor]) -> Vec<Tensor>) {
    let cpu = f(inputs);
    let on: Vec<Tensor> = inputs.iter().map(cuda).collect();
    let gpu = f(&on);
    for (i, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
        close(&format!("{what} output {i}"), g, c, tol(c.dtype(), heavy));
    }
}

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

#[test]
fn unary_binary_compare_where_and_casts() {
    if !gpu() {
        return;
    }
    for d in FLOATS {
        let x = randn(&[5, 7], d, 1);
        let y = randn(&[7], d, 2); // broadcast over rows
        let pos = x.abs() + 0.5;
        both("unary", &[x.clone(), pos], false, |a| {
            let (x, p) = (&a[0], &a[1]);
            vec![
                x.neg(),
                x.abs(),
                x.exp(),
                p.log(),
                p.sqrt(),
                p.rsqrt(),
                p.reciprocal(),
                x.sin(),
                x.cos(),
                x.tanh(),
                x.sigmoid(),
                x.relu(),
                x.gelu(),
                x.gelu_tanh(),
                x.silu(),
            ]
        });
        both("binary", &[x.clone(), y.clone()], false, |a| {
            let (x, y) = (&a[0], &a[1]);
            let t = x.transpose(0, 1).contiguous().transpose(0, 1); // a strided view
            vec![
                x + y,
                x - y,
                x * y,
                x / &(y.abs() + 1.0),
                x.abs().pow(&(y * 0.5)),
                x.maximum(y),
                x.minimum(&t),
                x * 3.0,
                x.gt(y).cast(d),
                Tensor::where_(&x.lt(y), x, y),
            ]
        });
        for to in DType::ALL {
            both("cast", &[x.clone() * 4.0], false, |a| {
                vec![a[0].cast(to).cast(DType::F64)]
            });
        }
    }
    let i = Tensor::from_vec(vec![3i64, -7, 0, 12, 5, -1], &[2, 3]);
    both("integers", &[i], false, |a| {
        let x = &a[0];
        vec![
            x + x,
            x * x,
            x.neg(),
            x.abs(),
            x.relu(),
            x.maximum(x.neg()),
            x.gt(x.neg()).cast(DType::I64),
        ]
    });
}

/// Integer division and power on the GPU: the CPU's values (truncation
/// toward zero for negative operands, `MIN / -1` wrapping to `MIN`,
/// wrapping powers) eagerly, with a host scalar divisor and compiled; a
/// zero divisor or a negative exponent is found by the kernel and reported
/// at the next synchronisation naming the op, the operands and the user's
/// line (the memoised launch of an earlier line does not lend it its
/// site), once, and the device stays usable.
#[test]
fn integer_division_and_power_match_the_cpu_and_report_bad_operands() {
    if !gpu() {
        return;
    }
    let a = vec![7i64, -7, 7, -7, 3, -2, 5, 0, i64::MIN, i64::MIN, -9, 9];
    let b = vec![2i64, 2, -2, -2, 4, 3, -1, 1, -1, 1, 4, -4];
    let base = vec![3i64, -2, 5, 0, 2, -1, 7, -3, 0, 1, 2, -5];
    let exp = vec![4i64, 3, 0, 0, 10, 7, 40, 63, 5, 9, 62, 1];
    let compiled = compile(|x: &[Tensor]| vec![&x[0] / &x[1], x[2].pow(&x[3]) + &x[0]]);
    for d in [DType::I64, DType::I32] {
        let t = |v: &[i64]| {
            let m = if d == DType::I32 {
                i32::MIN as i64
            } else {
                i64::MIN
            };
            let v: Vec<i64> = v
                .iter()
                .map(|&x| if x == i64::MIN { m } else { x })
                .collect();
            Tensor::from_vec(v, &[3, 4]).cast(d)
        };
        let ins = [t(&a), t(&b), t(&base), t(&exp)];
        // Compared exactly (wrapped values lie beyond f64's integers).
        let exact = |what: &str, f: &dyn Fn(&[Tensor]) -> Vec<Tensor>| {
            let cpu = f(&ins);
            let on: Vec<Tensor> = ins.iter().map(cuda).collect();
            for (i, (g, c)) in f(&on).iter().zip(&cpu).enumerate() {
                assert_eq!(g.device(), Device::Cuda, "{what} output {i}");
                assert_eq!(
                    g.to_vec::<i64>().unwrap(),
                    c.to_vec::<i64>().unwrap(),
                    "{what} {d} output {i}"
                );
            }
        };
        let widen =
            |v: Vec<Tensor>| -> Vec<Tensor> { v.iter().map(|t| t.cast(DType::I64)).collect() };
        exact("integer div/pow", &|x| {
            let scalar = Tensor::from_vec(vec![-3i64], &[]).cast(d);
            widen(vec![
                &x[0] / &x[1],
                &x[0] / &scalar,
                // A broadcast divisor and a strided dividend.
                &x[0].transpose(0, 1) / &x[1].narrow(0, 1, 1).reshape(&[4, 1]),
                x[2].pow(&x[3]),
            ])
        });
        exact("compiled integer div/pow", &|x| widen(compiled.call(x)));
    }
    let x = cuda(&Tensor::from_vec(vec![6i64, -6, 9], &[3]));
    let ok = cuda(&Tensor::from_vec(vec![4i64, 4, -4], &[3]));
    let zero = cuda(&Tensor::from_vec(vec![4i64, 0, -4], &[3]));
    // The same kernel shape first at a line whose divisors are fine…
    let fine = x.try_div(&ok).unwrap();
    assert_eq!(fine.to_vec::<i64>().unwrap(), [1, -1, -2]);
    let line = line!() + 1;
    let q = x.try_div(&zero).unwrap();
    let e = q.to_vec::<i64>().unwrap_err();
    let m = e.to_string();
    assert_eq!(e.op.as_deref(), Some("div"), "{m}");
    assert!(m.contains("integer division by zero (-6 / 0)"), "{m}");
    assert!(m.contains("div of i64 [3] by i64 [3]"), "{m}");
    assert!(m.contains(&format!("differential.rs:{line}")), "{m}");
    // Reported once; the device and the same kernel work on.
    assert_eq!(x.to_vec::<i64>().unwrap(), [6, -6, 9]);
    assert_eq!(
        x.try_div(&ok).unwrap().to_vec::<i64>().unwrap(),
        [1, -1, -2]
    );
    let neg = cuda(&Tensor::from_vec(vec![2i64, -1, 0], &[3]));
    let e = x.try_pow(&neg).unwrap().to_vec::<i64>().unwrap_err();
    let m = e.to_string();
    assert_eq!(e.op.as_deref(), Some("pow"), "{m}");
    assert!(
        m.contains("integers to negative integer powers are not allowed (exponent -1)"),
        "{m}"
    );
    // An explicit synchronisation reports it too, and a compiled run's
    // division by zero says where it ran.
    let _ = x.try_div(&zero).unwrap();
    let e = device::synchronize(Device::Cuda).unwrap_err();
    assert!(e.to_string().contains("integer division by zero"), "{e}");
    // (Exponents >= 0: the program's pow checks them too.)
    let exps = cuda(&Tensor::from_vec(vec![2i64, 0, 3], &[3]));
    let out = compiled.call(&[x.clone(), zero.clone(), x.clone(), exps.clone()]);
    let e = out[0].to_vec::<i64>().unwrap_err();
    assert!(e.to_string().contains("integer division by zero"), "{e}");
    assert_eq!(
        compiled.call(&[x.clone(), ok.clone(), x.clone(), exps.clone()])[0]
            .to_vec::<i64>()
            .unwrap(),
        [1, -1, -2]
    );
}

/// Attention calls the CUDA flash kernels cannot take — v's head dim
/// unlike q's (ONNX's test_attention_4d_diff_heads_sizes), an additive
/// mask, a row the mask hides entirely — run the composite on the device:
/// the CPU kernel's values and gradients (zeros, not NaN, for the hidden
/// row), eagerly and compiled, never an error.
#[test]
fn attention_beyond_the_flash_kernels_falls_back_to_the_composite() {
    use tessera::custom_op::flash_attention::{scaled_dot_product_attention, SdpaOptions};
    if !gpu() {
        return;
    }
    let q = randn(&[2, 3, 4, 8], DType::F32, 60);
    let k = randn(&[2, 3, 6, 8], DType::F32, 61);
    let v = randn(&[2, 3, 6, 10], DType::F32, 62);
    let g = randn(&[2, 3, 4, 10], DType::F32, 63);
    let mut m = randn(&[4, 6], DType::F64, 64).to_vec::<f64>().unwrap();
    m[6..12].fill(f64::NEG_INFINITY); // row 1 sees no key
    let mask = Tensor::from_vec(m, &[4, 6]).cast(DType::F32);
    let attend = |x: &[Tensor], masked: bool, causal: bool| {
        let leaves: Vec<Tensor> = x[..3].iter().map(|t| t.set_requires_grad(true)).collect();
        let options = SdpaOptions {
            mask: masked.then_some(&x[4]),
            causal,
            scale: Some(0.3),
        };
        let out = scaled_dot_product_attention(&leaves[0], &leaves[1], &leaves[2], options);
        out.backward_with(&x[3]);
        let mut r = vec![out.detach()];
        r.extend(leaves.iter().map(|l| l.grad().unwrap()));
        r
    };
    let ins = [q, k, v, g, mask];
    for (masked, causal) in [(false, false), (false, true), (true, false)] {
        let what = format!("attention, v dim 10, mask {masked}, causal {causal}");
        both(&what, &ins, true, |x| attend(x, masked, causal));
        for (i, t) in attend(&ins.iter().map(cuda).collect::<Vec<_>>(), masked, causal)
            .iter()
            .enumerate()
        {
            assert!(
                t.to_f64_vec().iter().all(|x| x.is_finite()),
                "{what}: output {i} not finite"
            );
        }
    }
    let f = compile(|x: &[Tensor]| {
        let options = SdpaOptions {
            mask: None,
            causal: false,
            scale: None,
        };
        vec![scaled_dot_product_attention(&x[0], &x[1], &x[2], options)]
    });
    both("compiled attention, v dim 10", &ins[..3], true, |x| {
        f.call(x)
    });
}

#[test]
fn reductions_softmax_and_arg_reductions() {
    if !gpu() {
        return;
    }
    for d in FLOATS {
        let x = randn(&[6, 33, 40], d, 3);
        both("reduce", std::slice::from_ref(&x), true, |a| {
            let x = &a[0];
            let t = x.transpose(0, 2); // strided
            vec![
                x.sum(&[-1], false),
                x.sum(&[0], true),
                x.mean(&[0, 2], false),
                x.max(&[1], false),
                x.min(&[-1], true),
                (x * 0.1).exp().prod(&[0], false),
                t.sum(&[1], false),
                x.sum(&[], false),
                x.argmax(1, false).cast(DType::F64),
                x.argmin(-1, true).cast(DType::F64),
                x.softmax(-1),
                x.log_softmax(1),
                t.softmax(0),
            ]
        });
    }
    // A long row (block schedule) and a tall column sum (thread schedule).
    let big = randn(&[3, 70000], DType::F32, 4);
    both("long rows", &[big], true, |a| {
        vec![a[0].sum(&[1], false), a[0].softmax(-1)]
    });
    // A full reduction of many elements (cut into parts, two launches).
    for d in FLOATS {
        let many = randn(&[300, 1000], d, 6);
        both("full reductions", &[many], true, |a| {
            vec![
                a[0].sum(&[], false),
                a[0].mean(&[], false),
                a[0].max(&[], false),
                a[0].min(&[0, 1], true),
            ]
        });
    }
    let tall = randn(&[5000, 3000], DType::F32, 5);
    both("tall columns", &[tall], true, |a| {
        vec![a[0].sum(&[0], false), a[0].max(&[0], false)]
    });
    // Column reductions cut into parts (a thread per column and part, then
    // the parts' reduction): bias and layer-norm gradients' shapes, odd
    // widths, a NaN that must survive the parts, and a strided view.
    for d in FLOATS {
        for (shape, dims) in [
            (vec![2048usize, 768], vec![0usize]),
            (vec![4, 512, 96], vec![0, 1]),
            (vec![3001, 37], vec![0]),
            (vec![700, 33, 5], vec![0]),
        ] {
            let mut v = randn(&shape, DType::F64, 11).to_f64_vec();
            v[shape.iter().product::<usize>() / 2] = f64::NAN;
            let x = Tensor::from_vec(v, &shape).cast(d);
            both("parted columns", &[x], true, |a| {
                let x = &a[0];
                let dims: Vec<isize> = dims.iter().map(|&d| d as isize).collect();
                vec![
                    x.sum(&dims, false),
                    x.mean(&dims, true),
                    x.max(&dims, false),
                    x.min(&dims, false),
                ]
            });
        }
        // Batch norm's (0, 2, 3) over NCHW: two reduced dims walked by
        // steps; H·W shorter and longer than a block, cut into parts
        // (few channels, many elements), a NaN that must survive.
        for shape in [
            [8usize, 16, 28, 28],
            [32, 4, 56, 56],
            [5, 3, 7, 7],
            [2, 300, 1, 3],
        ] {
            let mut v = randn(&shape, DType::F64, 13).to_f64_vec();
            v[shape.iter().product::<usize>() / 3] = f64::NAN;
            let x = Tensor::from_vec(v, &shape).cast(d);
            both("batch-norm reductions", &[x], true, |a| {
                let x = &a[0];
                vec![
                    x.sum(&[0, 2, 3], false),
                    x.mean(&[0, 2, 3], true),
                    x.max(&[0, 2, 3], false),
                    x.min(&[0, 3], false),
                ]
            });
        }
        let wide = randn(&[64, 2048], d, 12);
        both("strided columns", &[wide], true, |a| {
            let t = a[0].transpose(0, 1); // [2048, 64]: rows of stride 1
            vec![t.sum(&[1], false), a[0].sum(&[0], false)]
        });
    }
}

/// Strided views made dense a word at a time (a head merge, slices of
/// whole and partial rows, an offset that breaks the alignment and falls
/// back to the element copy), every float dtype.
#[test]
fn word_copies_of_strided_views() {
    if !gpu() {
        return;
    }
    for d in FLOATS {
        let heads = randn(&[2, 3, 16, 8], d, 13);
        let rows = randn(&[10, 12], d, 14);
        both("word copies", &[heads, rows], false, |a| {
            vec![
                a[0].permute(&[0, 2, 1, 3]).contiguous(),
                a[0].permute(&[0, 2, 1, 3]).reshape(&[2, 16, 24]),
                a[1].narrow(1, 0, 4).contiguous(),
                a[1].narrow(1, 4, 8).contiguous(),
                a[1].narrow(1, 1, 6).contiguous(),
                a[1].narrow(0, 2, 5).contiguous(),
                a[1].slice(1, 0, 12, 2).contiguous(),
            ]
        });
    }
}

/// The vectorised paths: pointwise chains on 16-byte packs with a scalar
/// tail (and a broadcast scalar buffer), softmax rows kept in registers (a
/// warp per row, a block per row), row reductions on packs, rows with -inf
/// and NaN.
#[test]
fn vectorised_pointwise_and_softmax_rows() {
    if !gpu() {
        return;
    }
    for d in [DType::F32, DType::BF16, DType::F16] {
        for shape in [[3usize, 1001], [8, 256], [4, 4096], [2, 8192]] {
            let x = randn(&shape, d, 7);
            let y = randn(&[1], d, 8);
            both("packed chain", &[x.clone(), y], true, |a| {
                let (x, y) = (&a[0], &a[1]);
                vec![
                    ((x * 2.0) + y).relu(),
                    x.exp(),
                    x.softmax(-1),
                    x.log_softmax(-1),
                    x.sum(&[-1], false),
                    x.mean(&[-1], true),
                    x.max(&[-1], false),
                    x.min(&[-1], false),
                ]
            });
        }
        let mut v = randn(&[4, 256], DType::F64, 9).to_f64_vec();
        v[0] = f64::NEG_INFINITY;
        v[256..512].fill(f64::NEG_INFINITY);
        v[600] = f64::NAN;
        let x = Tensor::from_vec(v, &[4, 256]).cast(d);
        both("rows with -inf and NaN", &[x], true, |a| {
            vec![a[0].softmax(-1), a[0].log_softmax(-1)]
        });
    }
}

#[test]
fn matmul_batched_transposed_broadcast_and_vectors() {
    if !gpu() {
        return;
    }
    for d in FLOATS {
        let a = randn(&[3, 17, 24], d, 6);
        let b = randn(&[3, 24, 9], d, 7);
        let w = randn(&[24, 9], d, 8);
        let v = randn(&[24], d, 9);
        both("matmul", &[a, b, w, v], true, |x| {
            let (a, b, w, v) = (&x[0], &x[1], &x[2], &x[3]);
            vec![
                a.matmul(b),
                a.matmul(w),                                      // shared right operand
                b.transpose(-2, -1).matmul(&a.transpose(-2, -1)), // both transposed
                a.matmul(v),                                      // matrix·vector
                v.matmul(w),                                      // vector·matrix
                a.narrow(2, 4, 12).matmul(&b.narrow(1, 0, 12)),   // column slices
                a.permute(&[1, 0, 2]).matmul(w),                  // batch dims permuted
            ]
        });
    }
}

/// Integer products (a generated kernel: cuBLASLt has none for these
/// forms) wrap as on the CPU; floats cast to integers saturate as on the
/// CPU (NaN to 0, beyond the range to its bound).
#[test]
fn integer_matmul_and_saturating_casts_match_the_cpu() {
    if !gpu() {
        return;
    }
    let ints = [
        DType::I8,
        DType::U8,
        DType::I16,
        DType::U16,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
    ];
    // Integers in [-60, 60]: i8 and u8 products and sums wrap.
    // (Cast truncates toward zero; unsigned types saturate negatives to 0.)
    let small = |shape: &[usize], seed: u64| randn(shape, DType::F64, seed) * 30.0;
    for d in ints {
        let (a, b, w) = (
            small(&[3, 7, 5], 1).cast(d),
            small(&[3, 5, 4], 2).cast(d),
            small(&[5, 4], 3).cast(d),
        );
        both(&format!("{d} matmul"), &[a, b, w], false, |x| {
            let (a, b, w) = (&x[0], &x[1], &x[2]);
            vec![
                a.matmul(b),
                a.matmul(w),                                      // shared right operand
                b.transpose(-2, -1).matmul(&a.transpose(-2, -1)), // both transposed
                a.narrow(2, 1, 3).matmul(&b.narrow(1, 0, 3)),     // column slices
            ]
        });
    }
    let edges = vec![
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        -1e30,
        1e30,
        -129.7,
        128.9,
        255.5,
        256.0,
        -0.9,
        0.9,
        65_535.9,
        -40_000.0,
        3e9,
        -3e9,
        1e19,
        2e19,
    ];
    let n = edges.len();
    for float in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let x = Tensor::from_vec(edges.clone(), &[n]).cast(float);
        both(&format!("{float} to integers"), &[x], false, |x| {
            ints.iter().map(|&d| x[0].cast(d)).collect()
        });
    }
}

#[test]
fn matmul_epilogue_matches_the_composed_ops() {
    if !gpu() {
        return;
    }
    let backend = tessera_cuda::backend().unwrap();
    for d in [DType::F32, DType::BF16, DType::F16] {
        let (a, b, bias) = (
            randn(&[2, 33, 64], d, 10),
            randn(&[64, 48], d, 11),
            randn(&[48], d, 12),
        );
        let base = a.matmul(&b) + &bias;
        for (epi, want) in [
            (tessera_cuda::Epilogue::None, base.clone()),
            (tessera_cuda::Epilogue::Relu, base.relu()),
            (tessera_cuda::Epilogue::Gelu, base.gelu_tanh()),
        ] {
            let got = backend
                .matmul_epilogue(&cuda(&a), &cuda(&b), Some(&cuda(&bias)), epi)
                .unwrap();
            close(&format!("epilogue {epi:?} {d}"), &got, &want, tol(d, true));
        }
    }
}

#[test]
fn movement_indexing_and_creation() {
    if !gpu() {
        return;
    }
    for d in [DType::F32, DType::BF16, DType::I64] {
        let x = (randn(&[4, 5, 6], DType::F64, 13) * 10.0).cast(d);
        let idx = Tensor::from_vec(vec![2i64, 0, 2, 1], &[4]);
        let gidx = Tensor::from_vec(
            (0..4 * 5 * 6).map(|i| (i * 7 % 5) as i64).collect(),
            &[4, 5, 6],
        );
        both("movement", &[x.clone(), idx, gidx], false, |a| {
            let (x, idx, g) = (&a[0], &a[1], &a[2]);
            vec![
                x.transpose(0, 2).contiguous(),
                x.transpose(1, 2).reshape(&[4, 30]),
                Tensor::cat(&[x, &x.narrow(0, 1, 2)], 0),
                Tensor::cat(&[&x.transpose(1, 2), &x.transpose(1, 2)], 2),
                x.tril(0),
                x.triu(1),
                x.index_select(1, idx),
                x.gather(1, g),
            ]
        });
    }
    let base = randn(&[4, 5], DType::F32, 14);
    let src = randn(&[4, 3], DType::F32, 15);
    let idx = Tensor::from_vec(vec![4i64, 0, 4], &[3]);
    let sidx = Tensor::from_vec(vec![1i64, 1, 0, 3, 3, 3, 2, 0, 1, 0, 0, 2], &[4, 3]);
    both("scatter", &[base, src, idx, sidx], true, |a| {
        vec![
            a[0].index_add(1, &a[2], &a[1]),
            a[0].scatter_add(1, &a[3], &a[1]),
        ]
    });
    // Out of range is an error naming the op, the value, the dim, the
    // operands and the user's line, as on the CPU — found by the kernel and
    // reported at the next synchronisation (a read); the device stays
    // usable and the error is reported once.
    let x = cuda(&randn(&[3, 4], DType::F32, 16));
    let bad = cuda(&Tensor::from_vec(vec![5i64], &[1]));
    let line = line!() + 1;
    let selected = x.try_index_select(1, &bad).unwrap();
    let e = selected.to_vec::<f32>().unwrap_err();
    let m = e.to_string();
    assert!(
        m.contains("index_select") && m.contains("index 5 is out of range for a dim of size 4"),
        "{m}"
    );
    assert!(m.contains("indices i64 [1] into f32 [3, 4]"), "{m}");
    assert!(m.contains(&format!("differential.rs:{line}")), "{m}");
    assert_eq!(
        x.to_vec::<f32>().unwrap(),
        randn(&[3, 4], DType::F32, 16).to_vec::<f32>().unwrap()
    );
    let neg = cuda(&Tensor::from_vec(vec![0i64, -1, 1, 0], &[1, 4]));
    let added = x.try_scatter_add(0, &neg, &x.narrow(0, 0, 1)).unwrap();
    let e = added.to_vec::<f32>().unwrap_err();
    assert!(
        e.to_string().contains("scatter_add") && e.to_string().contains("index -1"),
        "{e}"
    );
    // Creation on the device: the same values as on the CPU.
    let on_gpu = device::with_device(Device::Cuda, || {
        let mut g = Generator::new(3);
        vec![
            Tensor::randn(&[100], DType::F32, &mut g),
            Tensor::full(&[3, 2], 1.5, DType::BF16),
            Tensor::arange(0.0, 5.0, 1.0, DType::I64),
        ]
    });
    let mut g = Generator::new(3);
    let on_cpu = [
        Tensor::randn(&[100], DType::F32, &mut g),
        Tensor::full(&[3, 2], 1.5, DType::BF16),
        Tensor::arange(0.0, 5.0, 1.0, DType::I64),
    ];
    for (a, b) in on_gpu.iter().zip(&on_cpu) {
        close("creation", a, b, (0.0, 0.0));
    }
}

/// Random ops read their seed operand on the host: with a host seed or
/// one on the device, eagerly or compiled, the GPU draws what the CPU
/// draws, bit for bit; a compiled function with dropout on GPU inputs takes
/// a new seed per call from one executable, with the masks of eager code.
#[test]
fn random_ops_read_their_seed_like_the_cpu() {
    if !gpu() {
        return;
    }
    let seed = Generator::new(8).next_seed_tensor();
    let shape = [37, 129];
    for d in FLOATS {
        let cpu_u = Tensor::rand_seeded(&seed, &shape, d);
        let cpu_n = Tensor::randn_seeded(&seed, &shape, d);
        // A host seed, the GPU the current device.
        let (u, n) = device::with_device(Device::Cuda, || {
            (
                Tensor::rand_seeded(&seed, &shape, d),
                Tensor::randn_seeded(&seed, &shape, d),
            )
        });
        close(&format!("rand {d}, host seed"), &u, &cpu_u, (0.0, 0.0));
        close(&format!("randn {d}, host seed"), &n, &cpu_n, (0.0, 0.0));
        // A seed on the device is read back.
        let on = cuda(&seed);
        let u = Tensor::rand_seeded(&on, &shape, d);
        close(&format!("rand {d}, device seed"), &u, &cpu_u, (0.0, 0.0));
    }
    let x = randn(&[16, 64], DType::F32, 30);
    let xg = cuda(&x);
    let module = || tessera::nn::Dropout::new(0.3, &mut Generator::new(4));
    let (compiled, eager_gpu, eager_cpu) = (module(), module(), module());
    let f = compile(|a: &[Tensor]| vec![compiled.forward(&a[0], true) * 2.0]);
    for call in 0..5 {
        let got = f.call(std::slice::from_ref(&xg));
        let want = eager_cpu.forward(&x, true) * 2.0;
        let what = format!("compiled dropout, call {call}");
        close(&what, &got[0], &want, tol(DType::F32, false));
        let eager = eager_gpu.forward(&xg, true) * 2.0;
        close(
            &format!("eager dropout, call {call}"),
            &eager,
            &want,
            tol(DType::F32, false),
        );
    }
    let s = f.stats();
    assert_eq!(
        (s.compiles, s.recompiles, s.eager_calls),
        (1, 0, 0),
        "{s:?}"
    );
}

fn mlp_loss(x: &[Tensor]) -> Vec<Tensor> {
    let h = (x[0].matmul(&x[1]) + &x[2]).gelu();
    let logits = h.matmul(&x[3]);
    let lsm = logits.log_softmax(-1);
    vec![-lsm.gather(1, &x[4]).mean(&[], false)]
}

#[test]
fn eager_gradients_match() {
    if !gpu() {
        return;
    }
    let inputs = [
        randn(&[8, 16], DType::F32, 20),
        randn(&[16, 32], DType::F32, 21),
        randn(&[32], DType::F32, 22),
        randn(&[32, 10], DType::F32, 23),
        Tensor::from_vec((0..8).map(|i| (i * 3 % 10) as i64).collect(), &[8, 1]),
    ];
    let grads = |x: &[Tensor]| -> Vec<Tensor> {
        let leaves: Vec<Tensor> = x[..4].iter().map(|t| t.set_requires_grad(true)).collect();
        let mut all = leaves.clone();
        all.push(x[4].clone());
        let loss = mlp_loss(&all).remove(0);
        loss.backward();
        let mut out = vec![loss.detach()];
        out.extend(leaves.iter().map(|l| l.grad().unwrap()));
        out
    };
    both("mlp gradients", &inputs, true, grads);
    // Attention, forward + backward, naive and sliced, causal and not.
    for causal in [false, true] {
        for slices in [1, 6] {
            let qkv: Vec<Tensor> = (0..4)
                .map(|s| randn(&[2, 3, 16, 8], DType::F32, 30 + s))
                .collect();
            both(
                &format!("sdpa causal={causal} slices={slices}"),
                &qkv,
                true,
                |x| {
                    let leaves: Vec<Tensor> =
                        x[..3].iter().map(|t| t.set_requires_grad(true)).collect();
                    let out = tessera_apps::seed_table::sdpa(
                        &leaves[0], &leaves[1], &leaves[2], causal, slices,
                    );
                    out.backward_with(&x[3]);
                    let mut r = vec![out.detach()];
                    r.extend(leaves.iter().map(|l| l.grad().unwrap()));
                    r
                },
            );
        }
    }
}

#[test]
fn fused_cross_entropy_values_gradients_and_bad_targets() {
    if !gpu() {
        return;
    }
    // Every float dtype, a row wider than a block, ignored rows, a strided
    // (transposed) view, a masked (-inf) entry: loss and gradient as on
    // the CPU.
    let targets = Tensor::from_vec(vec![3i64, -100, 0, 299, 17, 5, -100], &[7]);
    for d in FLOATS {
        let logits = randn(&[7, 300], d, 40) * 3.0;
        let masked = Tensor::where_(
            &Tensor::arange(0.0, 300.0, 1.0, DType::F64).eq(7.0),
            &Tensor::full(&[], f64::NEG_INFINITY, d),
            &logits,
        );
        for (name, x) in [("dense", logits.clone()), ("masked", masked)] {
            both(
                &format!("cross_entropy {name} {d}"),
                &[x, targets.clone()],
                true,
                |a| {
                    let x = a[0].set_requires_grad(true);
                    let loss = tessera::nn::cross_entropy(&x, &a[1], Some(-100));
                    loss.backward();
                    vec![loss.detach(), x.grad().unwrap()]
                },
            );
        }
    }
    let wide = randn(&[300, 7], DType::F32, 41).transpose(0, 1);
    both(
        "cross_entropy strided",
        &[wide, targets.clone()],
        true,
        |a| {
            let x = a[0].set_requires_grad(true);
            let loss = tessera::nn::cross_entropy(&x, &a[1], Some(-100));
            loss.backward();
            vec![loss.detach(), x.grad().unwrap()]
        },
    );
    // A bad target: reported at the next read, naming the op and the value.
    let x = cuda(&randn(&[2, 5], DType::F32, 42));
    let bad = cuda(&Tensor::from_vec(vec![1i64, 5], &[2]));
    let loss = tessera::nn::try_cross_entropy(&x, &bad, None).unwrap();
    let e = loss.to_vec::<f32>().unwrap_err().to_string();
    assert!(
        e.contains("cross_entropy") && e.contains("index 5 is out of range for 5 classes"),
        "{e}"
    );
}

#[test]
fn compiled_bias_epilogues_match_the_cpu() {
    if !gpu() {
        return;
    }
    // A linear layer's matmul + bias, compiled: on CUDA one cuBLASLt call
    // with the bias epilogue (the bias added before the product's
    // rounding), on the CPU the gemm and the add; plain and transposed,
    // with batch dims, in every dtype the epilogue takes.
    for d in [DType::F32, DType::F16, DType::BF16] {
        let linear = compile(|a: &[Tensor]| vec![a[0].matmul(&a[1].transpose(0, 1)) + &a[2]]);
        let inputs = [
            randn(&[2, 5, 16], d, 50),
            randn(&[8, 16], d, 51),
            randn(&[8], d, 52),
        ];
        both(&format!("compiled linear {d}"), &inputs, true, |a| {
            linear.call(a)
        });
        let plain = compile(|a: &[Tensor]| vec![(a[0].matmul(&a[1]) + &a[2]).relu()]);
        let inputs = [
            randn(&[7, 16], d, 53),
            randn(&[16, 8], d, 54),
            randn(&[8], d, 55),
        ];
        both(
            &format!("compiled matmul + bias, relu {d}"),
            &inputs,
            true,
            |a| plain.call(a),
        );
    }
}

#[test]
fn compiled_programs_run_their_kernels_on_the_inputs_device() {
    if !gpu() {
        return;
    }
    for d in [DType::F32, DType::BF16] {
        let qkv: Vec<Tensor> = (0..4).map(|s| randn(&[2, 2, 32, 16], d, 40 + s)).collect();
        // A fused chain with a broadcast, a reduction and a matmul.
        let f = compile(|x: &[Tensor]| {
            vec![((&x[0] * 0.5 + &x[1])
                .tanh()
                .softmax(-1)
                .matmul(&x[2].transpose(-2, -1)))
            .sum(&[1], false)]
        });
        both(&format!("compiled chain {d}"), &qkv[..3], true, |x| {
            f.call(x)
        });
        // The seed's hinted sliced graph, forward + backward.
        let g = compile(|x: &[Tensor]| {
            let out = tessera::hints::scope(tessera_apps::seed_table::SEED_HINT, || {
                tessera_apps::seed_table::sdpa(&x[0], &x[1], &x[2], false, 4)
            });
            vec![out.unwrap()]
        });
        both(&format!("compiled hinted sdpa {d}"), &qkv, true, |x| {
            let leaves: Vec<Tensor> = x[..3].iter().map(|t| t.set_requires_grad(true)).collect();
            let out = g.call(&leaves).remove(0);
            out.backward_with(&x[3]);
            let mut r = vec![out.detach()];
            r.extend(leaves.iter().map(|l| l.grad().unwrap()));
            r
        });
    }
}

#[test]
fn devices_do_not_mix_and_memory_is_accounted() {
    if !gpu() {
        return;
    }
    let a = cuda(&randn(&[4, 4], DType::F32, 50));
    let b = randn(&[4, 4], DType::F32, 51);
    let e = a.try_matmul(&b).unwrap_err().to_string();
    assert!(
        e.contains("matmul") && e.contains("different devices"),
        "{e}"
    );
    // A host scalar goes with a device tensor (as in PyTorch).
    close(
        "scalar",
        &(&a * &Tensor::scalar(2.0, DType::F32)),
        &(a.to_host().unwrap() * 2.0),
        (0.0, 0.0),
    );

    device::synchronize(Device::Cuda).unwrap();
    let before = device::memory_stats(Device::Cuda).unwrap().live_bytes;
    device::reset_peak(Device::Cuda).unwrap();
    let t = device::with_device(Device::Cuda, || Tensor::zeros(&[1000, 1000], DType::F32));
    let during = device::memory_stats(Device::Cuda).unwrap();
    assert_eq!(during.live_bytes - before, 4_000_000);
    drop(t);
    assert_eq!(
        device::memory_stats(Device::Cuda).unwrap().live_bytes,
        before
    );
    assert!(device::memory_stats(Device::Cuda).unwrap().peak_bytes >= before + 4_000_000);

    let backend = tessera_cuda::backend().unwrap();
    let e = match tessera::runtime::device::DeviceBackend::alloc(&*backend, DType::F32, 1 << 44) {
        Ok(_) => panic!("64 TiB allocated"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("out of memory")
            && e.contains("asked from the driver for 70368744177664 bytes")
            && e.contains("free"),
        "{e}"
    );
}

/// The graph of `f` on inputs like `args` after the default passes (the
/// attention pass off), and its fusion plan, which must hold a row kernel.
fn row_graph(
    name: &str,
    args: &[Tensor],
    f: &dyn Fn(&[Tensor]) -> Vec<Tensor>,
) -> (tessera::ir::Graph, tessera::fusion::Plan) {
    let graph = traced(name, args, |a| f(a));
    let plan = tessera::fusion::fuse(&graph);
    let rows = plan
        .kernels
        .iter()
        .filter(|k| matches!(k, tessera::fusion::Kernel::Rows { .. }))
        .count();
    assert!(rows > 0, "{name}: no row kernel in\n{graph}");
    (graph, plan)
}

/// `f`'s fusion plan run on the GPU (its row kernels as generated kernels)
/// against the same plan on the CPU (the CPU row kernel).
fn rows_both(name: &str, inputs: &[Tensor], f: &dyn Fn(&[Tensor]) -> Vec<Tensor>) {
    let (graph, plan) = row_graph(name, inputs, f);
    let run = |args: &[Tensor]| -> Vec<Tensor> {
        tessera::runtime::execute::run_plan(&graph, &plan, args)
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    };
    let cpu = run(inputs);
    let on: Vec<Tensor> = inputs.iter().map(cuda).collect();
    let gpu = run(&on);
    for (i, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
        close(&format!("{name} output {i}"), g, c, tol(c.dtype(), true));
    }
}

/// Half-precision inputs computed in f32 (row groups reduce f32/f64) and
/// rounded back, as models do.
fn up(x: &Tensor) -> Tensor {
    match x.dtype() {
        DType::F16 | DType::BF16 => x.cast(DType::F32),
        _ => x.clone(),
    }
}

fn down(y: Tensor, like: &Tensor) -> Tensor {
    y.cast(like.dtype())
}

#[test]
fn fused_row_kernels_match_the_cpu() {
    if !gpu() {
        return;
    }
    // Odd, warp-sized, block-sized and the longest rows.
    let shapes: [&[usize]; 4] = [&[3, 5, 45], &[40, 96], &[4, 2048], &[2, 16384]];
    for d in FLOATS {
        for (si, &shape) in shapes.iter().enumerate() {
            let len = *shape.last().unwrap();
            let seed = 100 + si as u64 * 10;
            let x = randn(shape, d, seed);
            let what = |w: &str| format!("{w} {d} {shape:?}");
            // Softmax decomposed: max, sub, exp, sum, div (and the sum out).
            rows_both(
                &what("softmax decomposed"),
                std::slice::from_ref(&x),
                &|a| {
                    let x = up(&a[0]);
                    let e = (&x - &x.max(&[-1], true)).exp();
                    let s = e.sum(&[-1], true);
                    vec![down(&e / &s, &a[0]), s]
                },
            );
            // Softmax backward: p * (dp - sum(dp * p)).
            let p = randn(shape, d, seed + 1).softmax(-1);
            let dp = randn(shape, d, seed + 2);
            rows_both(&what("softmax backward"), &[p, dp], &|a| {
                let (p, dp) = (up(&a[0]), up(&a[1]));
                let s = (&dp * &p).sum(&[-1], true);
                vec![down(&p * &(&dp - &s), &a[0])]
            });
            // Layer norm with a weight and bias broadcast over the rows.
            let w = randn(&[len], d, seed + 3);
            let b = randn(&[len], d, seed + 4);
            rows_both(&what("layer norm"), &[x.clone(), w, b], &|a| {
                let (x, w, b) = (up(&a[0]), up(&a[1]), up(&a[2]));
                let xc = &x - &x.mean(&[-1], true);
                let var = (&xc * &xc).mean(&[-1], true);
                let y = &(&xc * &(var + 1e-5).rsqrt()) * &w + &b;
                vec![down(y, &a[0])]
            });
        }
        // Views and per-row scalars: a transposed input, a [rows, 1]
        // input, a constant; softmax, log_softmax and every reduction.
        let (rows, len) = (24, 333);
        let xt = randn(&[len, rows], d, 7);
        let c = randn(&[rows, 1], d, 8);
        rows_both(&format!("views and scalars {d}"), &[xt, c], &|a| {
            let x = up(&a[0]).transpose(0, 1);
            let z = (&x - &up(&a[1])) * 0.5;
            let near_one = &z * 0.01 + 1.0;
            vec![
                down(z.softmax(-1), &a[0]),
                down(z.log_softmax(-1) * 2.0, &a[0]),
                z.max(&[-1], false),
                z.min(&[-1], true),
                near_one.prod(&[-1], true),
                (&z - &z.mean(&[-1], true)).exp().sum(&[-1], false),
                z.gt(z.mean(&[-1], true)),
            ]
        });
    }
}
