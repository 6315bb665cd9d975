//! Fusion is differentially tested: random graphs of elementwise chains
//! (broadcasting, compares, where, casts, scalars) mixed with reductions,
//! softmax and matmul give the same values through fused kernels as through
//! the interpreter, op by op.

use proptest::prelude::*;
use tessera::fusion::{fuse, Kernel};
use tessera::runtime::execute::run_plan;
use tessera::runtime::interpret::run_graph;
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
