//! Optimizers: single steps against PyTorch's formulas evaluated in numpy
//! (`scripts/nn_reference.py`), state handling, clipping, and two small fits.

use tessera::nn::{mse, Linear, ParamStore, Parameter};
use tessera::optim::{clip_grad_norm, AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

const SGD_STEP1: &[f64] = &[0.989, -1.968, 0.2995];
const SGD_STEP2: &[f64] = &[0.998111, -1.9772319999999999, 0.018750499999999948];
const ADAMW_STEP1: &[f64] = &[0.9890000009999999, -1.9880000003333334, 0.48950000005];
const ADAMW_STEP2: &[f64] = &[0.9916720360378488, -1.9879471043696357, 0.479688703720801];

const P0: [f64; 3] = [1.0, -2.0, 0.5];
const GRADS: [[f64; 3]; 2] = [[0.1, -0.3, 2.0], [-0.2, 0.4, 1.0]];

fn assert_close(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "element {i}: got {g}, want {w}");
    }
}

/// Gives `p` the gradient `g` by backpropagating `sum(p * g)`.
fn give_grad(p: &Parameter, g: &[f64]) {
    let g = Tensor::from_vec(g.to_vec(), &[g.len()]).cast(p.get().dtype());
    (p.get() * &g).sum(&[], false).backward();
}

/// Two steps of `opt` with the fixed gradients; the value after each.
fn two_steps(p: &Parameter, opt: &mut dyn Optimizer) -> [Vec<f64>; 2] {
    let mut after = [vec![], vec![]];
    for (grad, out) in GRADS.iter().zip(&mut after) {
        opt.zero_grad();
        give_grad(p, grad);
        opt.step();
        *out = p.get().to_f64_vec();
    }
    after
}

#[test]
fn sgd_with_momentum_and_weight_decay_matches_torch_formula() {
    let p = Parameter::new("p", &Tensor::from_vec(P0.to_vec(), &[3]));
    let config = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.01,
    };
    let mut opt = Sgd::new(vec![p.clone()], config);
    let [first, second] = two_steps(&p, &mut opt);
    assert_close(&first, SGD_STEP1, 1e-15);
    assert_close(&second, SGD_STEP2, 1e-15);
}

#[test]
fn adamw_matches_torch_formula() {
    let p = Parameter::new("p", &Tensor::from_vec(P0.to_vec(), &[3]));
    let config = AdamWConfig {
        lr: 0.01,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    assert_eq!(
        (config.betas, config.eps),
        ((0.9, 0.999), 1e-8),
        "torch defaults"
    );
    let mut opt = AdamW::new(vec![p.clone()], config);
    let [first, second] = two_steps(&p, &mut opt);
    assert_close(&first, ADAMW_STEP1, 1e-15);
    assert_close(&second, ADAMW_STEP2, 1e-15);
}

#[test]
fn adamw_in_f32_keeps_the_dtype_and_stays_close() {
    let p = Parameter::new("p", &Tensor::from_vec(P0.map(|v| v as f32).to_vec(), &[3]));
    let config = AdamWConfig {
        lr: 0.01,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(vec![p.clone()], config);
    let [_, second] = two_steps(&p, &mut opt);
    assert_eq!(p.get().dtype(), DType::F32);
    assert_close(&second, ADAMW_STEP2, 1e-6);
}

#[test]
fn parameters_without_a_gradient_are_skipped_and_keep_their_step_count() {
    let a = Parameter::new("a", &Tensor::from_vec(P0.to_vec(), &[3]));
    let b = Parameter::new("b", &Tensor::from_vec(P0.to_vec(), &[3]));
    let config = AdamWConfig {
        lr: 0.01,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(vec![a.clone(), b.clone()], config);
    // Step 1 updates only `a`; `b` stays put and then gets its own first step.
    give_grad(&a, &GRADS[0]);
    opt.step();
    assert_eq!(b.get().to_f64_vec(), P0.to_vec());
    assert_close(&a.get().to_f64_vec(), ADAMW_STEP1, 1e-15);
    give_grad(&b, &GRADS[0]);
    opt.step();
    assert_close(&b.get().to_f64_vec(), ADAMW_STEP1, 1e-15);
    assert_close(&a.get().to_f64_vec(), ADAMW_STEP1, 1e-15);
}

#[test]
fn clip_grad_norm_scales_to_the_max_norm_and_returns_the_old_norm() {
    let a = Parameter::new("a", &Tensor::zeros(&[2], DType::F64));
    let b = Parameter::new("b", &Tensor::zeros(&[1], DType::F64));
    let idle = Parameter::new("idle", &Tensor::zeros(&[1], DType::F64));
    give_grad(&a, &[3.0, 0.0]);
    give_grad(&b, &[4.0]);
    let params = [a.clone(), b.clone(), idle.clone()];
    let norm = clip_grad_norm(&params, 1.0);
    assert!((norm - 5.0).abs() < 1e-12, "{norm}");
    let k = 1.0 / (5.0 + 1e-6);
    assert_close(&a.grad().unwrap().to_f64_vec(), &[3.0 * k, 0.0], 1e-15);
    assert_close(&b.grad().unwrap().to_f64_vec(), &[4.0 * k], 1e-15);
    assert!(idle.grad().is_none());
    // Under the limit nothing changes.
    let norm = clip_grad_norm(&params, 10.0);
    assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    assert_close(&b.grad().unwrap().to_f64_vec(), &[4.0 * k], 1e-15);
}

/// Fits `y = 3x + 1` on 32 points in [-1, 1]; returns the final loss and
/// the learned (weight, bias).
fn fit_line(
    make: impl FnOnce(Vec<Parameter>) -> Box<dyn Optimizer>,
    steps: usize,
) -> (f64, f64, f64) {
    let mut store = ParamStore::new();
    let lin = Linear::new(&mut store, "lin", 1, 1, true, &mut Generator::new(0));
    let xs: Vec<f32> = (0..32).map(|i| -1.0 + 2.0 * i as f32 / 31.0).collect();
    let ys: Vec<f32> = xs.iter().map(|x| 3.0 * x + 1.0).collect();
    let (x, y) = (
        Tensor::from_vec(xs, &[32, 1]),
        Tensor::from_vec(ys, &[32, 1]),
    );
    let mut opt = make(store.parameters());
    let mut loss = f64::INFINITY;
    for _ in 0..steps {
        opt.zero_grad();
        let l = mse(&lin.forward(&x), &y);
        l.backward();
        opt.step();
        loss = l.item();
    }
    let w = lin.weight.get().item();
    let b = lin.bias.as_ref().unwrap().get().item();
    (loss, w, b)
}

#[test]
fn sgd_with_momentum_fits_a_line() {
    let (loss, w, b) = fit_line(
        |p| {
            Box::new(Sgd::new(
                p,
                SgdConfig {
                    lr: 0.1,
                    momentum: 0.9,
                    weight_decay: 0.0,
                },
            ))
        },
        200,
    );
    assert!(loss < 1e-6, "loss {loss}");
    assert!(
        (w - 3.0).abs() < 1e-3 && (b - 1.0).abs() < 1e-3,
        "w {w}, b {b}"
    );
}

#[test]
fn adamw_fits_a_line() {
    let (loss, w, b) = fit_line(
        |p| {
            Box::new(AdamW::new(
                p,
                AdamWConfig {
                    lr: 0.05,
                    weight_decay: 0.0,
                    ..AdamWConfig::default()
                },
            ))
        },
        400,
    );
    assert!(loss < 1e-4, "loss {loss}");
    assert!(
        (w - 3.0).abs() < 1e-2 && (b - 1.0).abs() < 1e-2,
        "w {w}, b {b}"
    );
}

#[test]
fn set_lr_changes_the_step() {
    let p = Parameter::new("p", &Tensor::from_vec(vec![1.0], &[1]));
    let mut opt = Sgd::new(vec![p.clone()], SgdConfig::default());
    opt.set_lr(0.5);
    assert_eq!(opt.lr(), 0.5);
    give_grad(&p, &[2.0]);
    opt.step();
    assert_eq!(p.get().item(), 0.0);
}
