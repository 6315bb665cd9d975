//! Fusion is differentially tested: random graphs of elementwise chains
//! (broadcasting, compares, where, casts, scalars) mixed with reductions,
//! softmax and matmul give the same values through fused kernels as through
//! the interpreter, op by op — bit for bit where the kernels are the same
//! functions (pointwise chains and row kernels in f32), and against an f64
//! reference.

use proptest::prelude::*;
use tessera::fusion::{describe, fuse, Kernel};
use tessera::runtime::execute::run_plan;
use tessera::tensor::interpret::run_graph;
use tessera::tensor::trace::trace;
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

/// Applies op `code` to the running value `x` with the side inputs.
fn step(code: u8, x: &Tensor, row: &Tensor, col: &Tensor) -> Tensor {
    match code % 14 {
        0 => x + row,
        1 => x * col,
        2 => x.tanh(),
        3 => x.exp().minimum(4.0),
        4 => x.sigmoid() - 0.5,
        5 => x.gelu(),
        6 => Tensor::where_(&x.gt(row), x, &(x * 0.5)),
        7 => x.maximum(col).silu(),
        8 => x.cast(DType::BF16).cast(DType::F32),
        9 => x.softmax(-1),
        10 => x.sum(&[-1], true) + x,
        11 => x.matmul(&Tensor::ones(&[x.shape()[1], x.shape()[1]], DType::F32)) * 0.1,
        12 => (x * x + 1.0).sqrt().log(),
        _ => x.abs().reciprocal().minimum(3.0) - x.neg(),
    }
}

fn check(codes: &[u8], rows: usize, cols: usize, seed: u64) -> Result<(), TestCaseError> {
    let mut g = Generator::new(seed);
    let x = Tensor::randn(&[rows, cols], DType::F32, &mut g);
    let row = Tensor::randn(&[cols], DType::F32, &mut g);
    let col = Tensor::randn(&[rows, 1], DType::F32, &mut g);
    let types = [
        ("x".to_string(), x.ty()),
        ("row".to_string(), row.ty()),
        ("col".to_string(), col.ty()),
    ];
    let traced = trace("chain", &types, |a| {
        let mut v = a[0].clone();
        let mut outs = Vec::new();
        for (i, &c) in codes.iter().enumerate() {
            v = step(c, &v, &a[1], &a[2]);
            if i % 3 == 2 {
                outs.push((format!("o{i}"), v.clone()));
            }
        }
        outs.push(("out".into(), v));
        Ok(outs)
    })
    .unwrap();
    let args = [x, row, col];
    let want = run_graph(&traced.graph, &args).unwrap();
    let plan = fuse(&traced.graph);
    let got = run_plan(&traced.graph, &plan, &args).unwrap();
    for ((name, w), (_, g)) in want.iter().zip(&got) {
        prop_assert_eq!(w.shape(), g.shape());
        for (a, b) in w.to_f64_vec().iter().zip(g.to_f64_vec()) {
            // The fused kernel computes in f32 like the per-op kernels and
            // rounds where they round; it may differ by reassociation-free
            // rounding of transcendental approximations only.
            let ok = (a.is_nan() && b.is_nan()) || (a - b).abs() <= 1e-5 * (1.0 + a.abs());
            prop_assert!(ok, "{}: {} vs {} for {:?}", name, a, b, codes);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn fused_plans_match_the_interpreter(codes in prop::collection::vec(any::<u8>(), 1..12), rows in 1usize..9, cols in 1usize..40, seed in any::<u64>()) {
        check(&codes, rows, cols, seed)?;
    }
}

#[test]
fn a_pointwise_chain_is_one_kernel() {
    let x = Tensor::zeros(&[64, 64], DType::F32);
    let traced = trace("chain", &[("x".into(), x.ty())], |a| {
        let y = ((&a[0] * 2.0 + 1.0).tanh().exp() - 1.0)
            .relu()
            .sigmoid()
            .sqrt();
        Ok(vec![("y".into(), y)])
    })
    .unwrap();
    let plan = fuse(&traced.graph);
    let fused: Vec<&Kernel> = plan
        .kernels
        .iter()
        .filter(|k| matches!(k, Kernel::Fused { .. }))
        .collect();
    assert_eq!(fused.len(), 1, "{plan:?}");
    let Kernel::Fused {
        members, outputs, ..
    } = fused[0]
    else {
        unreachable!()
    };
    assert_eq!(members.len(), 8);
    assert_eq!(outputs.len(), 1, "intermediates stay in the kernel");
    // The only other kernels are none: scalars are inlined.
    assert_eq!(plan.kernels.len(), 1);
}

#[test]
fn a_large_parallel_chain_matches() {
    check(&[0, 2, 1, 6, 8, 12, 3], 300, 257, 3).unwrap();
}

/// Row-friendly ops: reductions along the last dim (kept or not), softmax
/// and log_softmax whole and decomposed, layer-norm-like chains, with
/// pointwise producers and consumers and broadcast inputs.
fn row_step(code: u8, x: &Tensor, row: &Tensor, col: &Tensor) -> Tensor {
    match code % 10 {
        0 => x * row + col,
        1 => x.softmax(-1),
        2 => {
            let m = x.max(&[-1], true);
            let e = (x - &m).exp();
            &e / &e.sum(&[-1], true)
        }
        3 => x.log_softmax(-1) * 0.5,
        4 => {
            let d = x - &x.mean(&[-1], true);
            &d * &((&d * &d).mean(&[-1], true) + 1e-5).rsqrt() * row
        }
        5 => x.sum(&[-1], true) + x.tanh(),
        6 => Tensor::where_(&x.gt(x.max(&[-1], true).neg()), x, &x.min(&[-1], true)),
        7 => (x.sigmoid() - 0.25).softmax(-1),
        8 => x.abs().sum(&[-1], false).unsqueeze(-1) - x,
        _ => x.exp().minimum(4.0),
    }
}

fn trace_rows(codes: &[u8], rows: usize, cols: usize) -> tessera::tensor::trace::Traced {
    let types = [
        (
            "x".to_string(),
            Tensor::zeros(&[rows, cols], DType::F32).ty(),
        ),
        ("row".to_string(), Tensor::zeros(&[cols], DType::F32).ty()),
        (
            "col".to_string(),
            Tensor::zeros(&[rows, 1], DType::F32).ty(),
        ),
    ];
    trace("rows", &types, |a| {
        let mut v = a[0].clone();
        let mut outs = Vec::new();
        for (i, &c) in codes.iter().enumerate() {
            v = row_step(c, &v, &a[1], &a[2]);
            if i % 2 == 1 {
                outs.push((format!("o{i}"), v.clone()));
            }
        }
        outs.push(("out".into(), v));
        Ok(outs)
    })
    .unwrap()
}

fn check_rows(codes: &[u8], rows: usize, cols: usize, seed: u64) -> Result<(), TestCaseError> {
    let mut g = Generator::new(seed);
    let args = [
        Tensor::randn(&[rows, cols], DType::F32, &mut g),
        Tensor::randn(&[cols], DType::F32, &mut g),
        Tensor::randn(&[rows, 1], DType::F32, &mut g),
    ];
    let traced = trace_rows(codes, rows, cols);
    let want = run_graph(&traced.graph, &args).unwrap();
    let plan = fuse(&traced.graph);
    let got = run_plan(&traced.graph, &plan, &args).unwrap();
    for ((name, w), (_, g)) in want.iter().zip(&got) {
        prop_assert_eq!(w.shape(), g.shape());
        for (a, b) in w.to_f64_vec().iter().zip(g.to_f64_vec()) {
            // The same kernels, the same order of operations: the same bits.
            prop_assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "{}: {} vs {} for {:?}\n{}",
                name,
                a,
                b,
                codes,
                describe(&traced.graph, &plan)
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn row_kernels_match_the_interpreter_bit_for_bit(codes in prop::collection::vec(any::<u8>(), 1..8), rows in 1usize..7, cols in 14usize..70, seed in any::<u64>()) {
        check_rows(&codes, rows, cols, seed)?;
    }
}

#[test]
fn many_rows_on_many_tasks_match() {
    check_rows(&[0, 2, 4, 1, 3, 6], 700, 129, 5).unwrap();
}

/// The kernel list of a fused graph, as logged.
fn kernels_of(codes: &[u8], rows: usize, cols: usize) -> String {
    let traced = trace_rows(codes, rows, cols);
    describe(&traced.graph, &fuse(&traced.graph))
}

#[test]
fn decomposed_softmax_with_its_producer_and_consumer_is_one_row_kernel() {
    // x * row + col (prologue), max, sub, exp, sum, div, then exp+minimum (epilogue)
    let text = kernels_of(&[0, 2, 9], 8, 64);
    assert_eq!(
        text,
        "graph `rows`: 10 ops -> 1 kernels\n  k0 rows [%3:mul, %4:add, %5:max, %6:sub, %7:exp, %8:sum, \
         %9:div, %10:exp, %12:minimum] reads 3 writes 2\n",
        "{text}"
    );
}

#[test]
fn softmax_and_layer_norm_fuse_and_short_rows_do_not() {
    let text = kernels_of(&[1, 4], 4, 32);
    assert!(
        text.contains("-> 1 kernels") && text.contains("k0 rows [%3:softmax"),
        "{text}"
    );
    // Rows shorter than 16 stay with the reduction kernels.
    let short = kernels_of(&[1], 4, 8);
    assert!(short.contains("k0 extern %3 (softmax)"), "{short}");
}

#[test]
fn fused_softmax_matches_an_f64_reference() {
    let (rows, cols) = (5, 300);
    let x = Tensor::randn(&[rows, cols], DType::F32, &mut Generator::new(9)) * 4.0;
    let traced = trace("sm", &[("x".into(), x.ty())], |a| {
        Ok(vec![
            ("p".into(), a[0].softmax(-1)),
            ("l".into(), a[0].log_softmax(-1)),
        ])
    })
    .unwrap();
    let plan = fuse(&traced.graph);
    // Two row kernels (siblings reading the same input are not merged).
    assert!(
        matches!(plan.kernels[..], [Kernel::Rows { .. }, Kernel::Rows { .. }]),
        "{plan:?}"
    );
    let got = run_plan(&traced.graph, &plan, std::slice::from_ref(&x)).unwrap();
    let xs = x.to_f64_vec();
    for (r, line) in xs.chunks(cols).enumerate() {
        let m = line.iter().cloned().fold(f64::MIN, f64::max);
        let s: f64 = line.iter().map(|v| (v - m).exp()).sum();
        for (j, v) in line.iter().enumerate() {
            let (p, l) = ((v - m).exp() / s, (v - m) - s.ln());
            let (gp, gl) = (
                got[0].1.to_f64_vec()[r * cols + j],
                got[1].1.to_f64_vec()[r * cols + j],
            );
            // f32 rounds x - max (relative eps·|x - max| in the exponent),
            // then exp and the scale add a few eps.
            let tol = f32::EPSILON as f64 * (4.0 + (v - m).abs());
            assert!((gp - p).abs() <= tol * p, "{gp} vs {p}");
            assert!((gl - l).abs() <= 1e-6 * (1.0 + l.abs()), "{gl} vs {l}");
        }
    }
}

#[test]
fn a_matmul_with_bias_activation_and_scale_is_one_kernel_with_the_same_bits() {
    let mut g = Generator::new(21);
    let args = [
        Tensor::randn(&[37, 24], DType::F32, &mut g),
        Tensor::randn(&[24, 19], DType::F32, &mut g),
        Tensor::randn(&[19], DType::F32, &mut g),
    ];
    let types: Vec<(String, tessera::ir::TensorType)> = ["x", "w", "b"]
        .iter()
        .zip(&args)
        .map(|(n, t)| (n.to_string(), t.ty()))
        .collect();
    let traced = trace("mlp", &types, |a| {
        let mm = a[0].matmul(&a[1]);
        let y = (&mm + &a[2]).gelu() * 0.5;
        // The product is needed again (an output), and a bool epilogue.
        Ok(vec![
            ("y".into(), y.clone()),
            ("mm".into(), mm),
            ("pos".into(), y.gt(0.1)),
        ])
    })
    .unwrap();
    let plan = fuse(&traced.graph);
    let text = describe(&traced.graph, &plan);
    assert!(text.starts_with("graph `mlp`: 7 ops -> 1 kernels\n  k0 matmul+epilogue [%3:matmul, %4:add, %5:gelu, %7:mul, %9:gt] reads 3 writes 3"), "{text}");
    let want = run_graph(&traced.graph, &args).unwrap();
    let got = run_plan(&traced.graph, &plan, &args).unwrap();
    for ((name, w), (_, g)) in want.iter().zip(&got) {
        assert_eq!(w.to_f64_vec(), g.to_f64_vec(), "{name}");
    }
    // Without the product as an output, the epilogue writes over it.
    let traced = trace("mlp2", &types, |a| {
        Ok(vec![("y".into(), (a[0].matmul(&a[1]) + &a[2]).relu())])
    })
    .unwrap();
    let plan = fuse(&traced.graph);
    assert!(
        matches!(
            &plan.kernels[..],
            [Kernel::Epilogue {
                matmul_out: false,
                ..
            }]
        ),
        "{plan:?}"
    );
    let want = run_graph(&traced.graph, &args).unwrap();
    let got = run_plan(&traced.graph, &plan, &args).unwrap();
    assert_eq!(want[0].1.to_f64_vec(), got[0].1.to_f64_vec());
}

/// Softmax's backward right after a matmul (`dP = dO·Vᵀ`, then `dS = P ⊙
/// (dP − rowsum(dP ⊙ P))`): the product's first consumer stays in the row
/// kernel, which reads `dP` anyway, instead of becoming the matmul's
/// epilogue, which would write `dP ⊙ P` out in full next to `dP`.
#[test]
fn a_row_kernels_first_op_is_not_taken_as_a_matmul_epilogue() {
    let mut g = Generator::new(22);
    let args = [
        Tensor::randn(&[3, 6, 8], DType::F32, &mut g),
        Tensor::randn(&[3, 20, 8], DType::F32, &mut g),
        Tensor::randn(&[3, 6, 20], DType::F32, &mut g),
    ];
    let types: Vec<(String, tessera::ir::TensorType)> = ["d_out", "v", "p"]
        .iter()
        .zip(&args)
        .map(|(n, t)| (n.to_string(), t.ty()))
        .collect();
    let traced = trace("softmax_backward", &types, |a| {
        let dp = a[0].matmul(&a[1].transpose(-2, -1));
        let ds = &a[2] * &(&dp - &(&dp * &a[2]).sum(&[2], true));
        Ok(vec![("ds".into(), ds)])
    })
    .unwrap();
    let plan = fuse(&traced.graph);
    let text = describe(&traced.graph, &plan);
    assert!(
        !text.contains("epilogue")
            && text.contains("rows [%5:mul, %6:sum, %7:sub, %8:mul] reads 2 writes 1"),
        "{text}"
    );
    let want = run_graph(&traced.graph, &args).unwrap();
    let got = run_plan(&traced.graph, &plan, &args).unwrap();
    let (w, g) = (want[0].1.to_f64_vec(), got[0].1.to_f64_vec());
    assert!(
        w.iter()
            .zip(&g)
            .all(|(a, b)| (a - b).abs() <= 1e-5 * (1.0 + a.abs())),
        "fused and unfused differ"
    );
}
