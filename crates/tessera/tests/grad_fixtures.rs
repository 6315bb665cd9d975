//! Composite functions against JAX: values and gradients (of
//! `sum(f(x) * cotangent)`, eager `backward_with`) of attention (plain,
//! causal, and the seed's sliced form), layer norm, cross entropy with an
//! ignore index, and an MLP with gelu, compared with `tests/fixtures/grads.json`
//! (JAX in float64; see `scripts/gen_grad_fixtures.py`).

mod common;

use common::{fixtures, max_error, model, sdpa_sliced, Fixture};
use tessera::{DType, Tensor};

/// f64 against f64: the two differ only in rounding (summation order, libm),
/// a few ulps through these shallow functions; 1e-10 (absolute + relative)
/// leaves a wide margin and still catches any wrong rule.
const TOL_F64: f64 = 1e-10;
/// The same functions in f32 against the f64 reference: f32 rounding
/// (u ≈ 6e-8) amplified by a few ops and O(1)–O(10) values stays below 1e-4.
const TOL_F32: f64 = 1e-4;

/// Runs `f` eagerly on the fixture's inputs (as `dtype`; class ids stay i64),
/// returns the output and the gradients of the `wrt` inputs, all as f64.
fn eager(
    fx: &Fixture,
    f: fn(&[Tensor]) -> Tensor,
    dtype: DType,
    transposed: bool,
) -> (Tensor, Vec<Tensor>) {
    let inputs: Vec<Tensor> = fx
        .inputs
        .iter()
        .enumerate()
        .map(|(i, (_, t))| {
            if !fx.wrt.contains(&i) {
                return t.clone();
            }
            let t = t.cast(dtype);
            // The same values stored in reversed dim order.
            let t = if transposed && t.rank() >= 2 {
                let rev: Vec<isize> = (0..t.rank() as isize).rev().collect();
                t.permute(&rev).contiguous().permute(&rev)
            } else {
                t
            };
            t.set_requires_grad(true)
        })
        .collect();
    let out = f(&inputs);
    out.backward_with(&fx.cotangent.cast(dtype));
    let grads = fx
        .wrt
        .iter()
        .map(|&i| {
            let g = inputs[i].grad().expect("every wrt input gets a gradient");
            assert_eq!(g.dtype(), dtype);
            g.cast(DType::F64)
        })
        .collect();
    (out.cast(DType::F64), grads)
}

fn compare(
    fx: &Fixture,
    f: fn(&[Tensor]) -> Tensor,
    dtype: DType,
    transposed: bool,
    tol: f64,
) -> Vec<String> {
    let (out, grads) = eager(fx, f, dtype, transposed);
    let mut errors = Vec::new();
    let what = format!("{} {dtype} transposed={transposed}", fx.name);
    let e = max_error(&out, &fx.output);
    if e > tol {
        errors.push(format!("{what}: output off by {e:e}"));
    }
    for (k, (g, want)) in grads.iter().zip(&fx.grads).enumerate() {
        let e = max_error(g, want);
        if e > tol {
            let name = &fx.inputs[fx.wrt[k]].0;
            errors.push(format!("{what}: gradient of {name} off by {e:e}"));
        }
    }
    errors
}

#[test]
fn fixtures_match_jax() {
    let all = fixtures();
    let names: Vec<&str> = all.iter().map(|f| f.name.as_str()).collect();
    for want in ["sdpa", "sdpa_causal", "layer_norm", "cross_entropy", "mlp"] {
        assert!(names.contains(&want), "grads.json lacks {want}");
    }
    let mut errors = Vec::new();
    for fx in &all {
        for transposed in [false, true] {
            errors.extend(compare(
                fx,
                model(&fx.name),
                DType::F64,
                transposed,
                TOL_F64,
            ));
        }
        errors.extend(compare(fx, model(&fx.name), DType::F32, false, TOL_F32));
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// The seed's sliced attention computes the same function as plain
/// attention, so it must match the same JAX values and gradients.
#[test]
fn sliced_attention_matches_jax() {
    let all = fixtures();
    let mut errors = Vec::new();
    for (name, f) in [
        (
            "sdpa",
            (|a: &[Tensor]| sdpa_sliced(&a[0], &a[1], &a[2], false)) as fn(&[Tensor]) -> Tensor,
        ),
        ("sdpa_causal", |a: &[Tensor]| {
            sdpa_sliced(&a[0], &a[1], &a[2], true)
        }),
    ] {
        let fx = all.iter().find(|f| f.name == name).unwrap();
        for transposed in [false, true] {
            errors.extend(compare(fx, f, DType::F64, transposed, TOL_F64));
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// The ignored rows get exactly zero gradient, and the loss is the mean over
/// the kept rows only (a sanity check of the fixture itself).
#[test]
fn cross_entropy_ignores_rows() {
    let all = fixtures();
    let fx = all.iter().find(|f| f.name == "cross_entropy").unwrap();
    let targets = fx.inputs[1].1.to_vec::<i64>().unwrap();
    let g = fx.grads[0].to_f64_vec();
    let classes = fx.inputs[0].1.shape()[1];
    let kept = targets.iter().filter(|&&t| t != common::IGNORE).count();
    assert!(kept > 0 && kept < targets.len());
    for (row, &t) in targets.iter().enumerate() {
        let row_g = &g[row * classes..(row + 1) * classes];
        if t == common::IGNORE {
            assert!(row_g.iter().all(|&v| v == 0.0), "row {row}: {row_g:?}");
        } else {
            // d/dlogits of -log_softmax[t] / kept sums to 0 over the row.
            assert!(row_g.iter().sum::<f64>().abs() < 1e-12);
        }
    }
    let (out, grads) = eager(fx, model("cross_entropy"), DType::F64, false);
    assert!(max_error(&out, &fx.output) <= TOL_F64);
    assert!(max_error(&grads[0], &fx.grads[0]) <= TOL_F64);
}
