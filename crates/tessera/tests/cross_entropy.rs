//! The fused cross-entropy op behind `nn::cross_entropy`
//! (`tessera::cross_entropy` and its backward) against an f64 reference
//! written here (log-sum-exp per row over the logits' exact values), in
//! every float dtype, on strided logits, with ignored rows and extreme
//! values; the compiled loss and gradients against eager's; the gradient
//! against finite differences.

use tessera::compile::compile;
use tessera::nn::{cross_entropy, try_cross_entropy};
use tessera::tensor::Generator;
use tessera::{autocast, DType, Tensor};

const IGNORE: i64 = -100;

/// The mean loss and the gradient of the logits, in f64, from the values
/// as stored (`logits` row-major `[n, c]`).
fn reference(logits: &[f64], c: usize, targets: &[i64]) -> (f64, Vec<f64>) {
    let kept = targets.iter().filter(|&&t| t != IGNORE).count().max(1) as f64;
    let mut loss = 0.0;
    let mut grad = vec![0.0; logits.len()];
    for (r, &t) in targets.iter().enumerate() {
        if t == IGNORE {
            continue;
        }
        let row = &logits[r * c..(r + 1) * c];
        let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
        loss += lse - row[t as usize];
        for (j, x) in row.iter().enumerate() {
            let hot = if j as i64 == t { 1.0 } else { 0.0 };
            grad[r * c + j] = ((x - lse).exp() - hot) / kept;
        }
    }
    (loss / kept, grad)
}

fn random_logits(n: usize, c: usize, dtype: DType, seed: u64) -> Tensor {
    let mut g = Generator::new(seed);
    (Tensor::randn(&[n, c], DType::F64, &mut g) * 3.0).cast(dtype)
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Loss and gradient of `cross_entropy` on `logits` against the f64
/// reference, within `tol` (the gradient also within one rounding of the
/// logits' dtype).
fn check(logits: &Tensor, targets: &[i64], tol: f64) {
    let (n, c) = (logits.shape()[0], logits.shape()[1]);
    let t = Tensor::from_vec(targets.to_vec(), &[n]);
    let x = logits.detach().set_requires_grad(true);
    let loss = cross_entropy(&x, &t, Some(IGNORE));
    assert_eq!(
        loss.dtype(),
        logits.dtype(),
        "outside autocast: the logits' dtype"
    );
    loss.backward();
    let values = logits.contiguous().to_f64_vec();
    let (want, want_grad) = reference(&values, c, targets);
    // One rounding of the logits' dtype (the loss and the gradient are
    // stored in it).
    let eps = match logits.dtype() {
        DType::BF16 => 1.0 / 256.0,
        DType::F16 => 1.0 / 2048.0,
        _ => 0.0,
    };
    let got = loss.item();
    assert!(
        (got - want).abs() <= (tol + eps) * want.abs().max(1.0),
        "{}: loss {got} vs {want}",
        logits.dtype()
    );
    let grad = x.grad().unwrap().contiguous().to_f64_vec();
    let scale = want_grad.iter().fold(0.0f64, |m, g| m.max(g.abs()));
    let err = max_abs_diff(&grad, &want_grad);
    assert!(
        err <= tol + eps * scale,
        "{}: gradient off by {err} (scale {scale})",
        logits.dtype()
    );
}

#[test]
fn matches_the_f64_reference_in_every_float_dtype_with_ignored_rows() {
    let targets = [3, IGNORE, 0, 32, 17, 5, IGNORE];
    for (dtype, tol) in [
        (DType::F64, 1e-12),
        (DType::F32, 2e-6),
        (DType::BF16, 2e-6),
        (DType::F16, 2e-6),
    ] {
        check(&random_logits(7, 33, dtype, 1), &targets, tol);
    }
}

#[test]
fn strided_logits_and_extreme_values_are_exact_and_finite() {
    // A transposed view: rows that are not contiguous.
    let t = random_logits(33, 7, DType::F32, 2).transpose(0, 1);
    check(&t, &[0, 1, 2, 3, 4, 5, 6], 2e-6);
    // Large logits and -inf entries (a masked vocabulary): no overflow.
    let mut v: Vec<f64> = (0..24).map(|i| 1e4 + i as f64).collect();
    v[5] = f64::NEG_INFINITY;
    v[13] = f64::NEG_INFINITY;
    let logits = Tensor::from_vec(v, &[3, 8]);
    check(&logits, &[7, 2, IGNORE], 1e-12);
}

#[test]
fn under_autocast_half_logits_give_an_f32_loss() {
    let logits = random_logits(4, 9, DType::BF16, 3);
    let t = Tensor::from_vec(vec![1i64, 2, 3, 8], &[4]);
    let loss = autocast(DType::BF16, || cross_entropy(&logits, &t, None));
    assert_eq!(loss.dtype(), DType::F32);
    let (want, _) = reference(&logits.to_f64_vec(), 9, &[1, 2, 3, 8]);
    assert!(
        (loss.item() - want).abs() < 2e-6,
        "{} vs {want}",
        loss.item()
    );
}

#[test]
fn the_gradient_matches_finite_differences() {
    let logits = random_logits(3, 5, DType::F64, 4);
    let t = Tensor::from_vec(vec![4i64, 0, 2], &[3]);
    let x = logits.detach().set_requires_grad(true);
    cross_entropy(&x, &t, None).backward();
    let grad = x.grad().unwrap().to_f64_vec();
    let base = logits.to_f64_vec();
    let h = 1e-6;
    for i in 0..base.len() {
        let at = |d: f64| {
            let mut v = base.clone();
            v[i] += d;
            cross_entropy(&Tensor::from_vec(v, &[3, 5]), &t, None).item()
        };
        let fd = (at(h) - at(-h)) / (2.0 * h);
        assert!(
            (fd - grad[i]).abs() < 1e-8,
            "element {i}: {fd} vs {}",
            grad[i]
        );
    }
}

#[test]
fn compiled_loss_and_gradients_equal_eager() {
    let f = |x: &[Tensor]| {
        let loss = cross_entropy(&x[0], &x[1], Some(IGNORE));
        vec![loss]
    };
    let compiled = compile(f);
    for (n, seed) in [(6, 5), (6, 6)] {
        let logits = random_logits(n, 11, DType::F32, seed).set_requires_grad(true);
        let t = Tensor::from_vec(vec![1i64, IGNORE, 10, 0, 3, 3], &[n]);
        let eager = f(&[logits.clone(), t.clone()]).remove(0);
        eager.backward();
        let eager_grad = logits.grad().unwrap().to_f64_vec();
        let x = logits.detach().set_requires_grad(true);
        let got = compiled.call(&[x.clone(), t]).remove(0);
        got.backward();
        assert_eq!(got.item().to_bits(), eager.item().to_bits());
        assert_eq!(x.grad().unwrap().to_f64_vec(), eager_grad);
    }
}

#[test]
fn a_target_out_of_range_is_an_error_naming_the_op() {
    let logits = random_logits(2, 4, DType::F32, 7);
    let bad = Tensor::from_vec(vec![1i64, 4], &[2]);
    let e = try_cross_entropy(&logits, &bad, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cross_entropy") && e.contains("target 4 is out of range for 4 classes"),
        "{e}"
    );
    let negative = Tensor::from_vec(vec![-1i64, 0], &[2]);
    assert!(try_cross_entropy(&logits, &negative, Some(IGNORE)).is_err());
}
