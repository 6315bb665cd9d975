//! Regression tests for miscompiles an outside test suite found (issue 15):
//! each reproducer runs compiled under every schedule and is compared with
//! eager autograd / the interpreter.

use tessera::compile::{Backend, Mode};
use tessera::hints;
use tessera::schedule::Strategy;
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

const STRATEGIES: [Strategy; 4] = [
    Strategy::Bfs,
    Strategy::Dfs,
    Strategy::Strict,
    Strategy::Auto,
];

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

fn random(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F32, &mut Generator::new(seed))
}

/// Gradients of every input of `f` under `sum(outputs · w)` with fixed
/// random weights `w`.
fn grads(f: &dyn Fn(&[Tensor]) -> Vec<Tensor>, inputs: &[Tensor]) -> Vec<Vec<f64>> {
    let args: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.detach().set_requires_grad(true))
        .collect();
    let outs = f(&args);
    let loss = outs
        .iter()
        .enumerate()
        .map(|(i, o)| (o * &random(o.shape(), 100 + i as u64)).sum(&[], false))
        .reduce(|a, b| a + b)
        .unwrap();
    loss.backward();
    args.iter()
        .map(|a| a.grad().unwrap().to_f64_vec())
        .collect()
}

/// Defect 1: a `group_id` hint on one op of a graph whose backward reads
/// it; the default backend's bfs schedule gave wrong gradients.
fn grouped(a: &[Tensor]) -> Vec<Tensor> {
    let s = a[1].add(&a[1]);
    let h = hints::scope(r#"{"group_id":0}"#, || a[1].tanh()).unwrap();
    vec![s.add(&a[0]).mul(&h), s.expand(&[2, 2, 4, 3])]
}

#[test]
fn group_hint_gradients_match_eager_under_every_schedule() {
    for seed in 0..4 {
        let inputs = [random(&[4, 3], seed), random(&[2, 4, 3], seed + 50)];
        let want = grads(&grouped, &inputs);
        for strategy in STRATEGIES {
            for mode in [Mode::Default, Mode::ReduceOverhead] {
                let f = tessera::compile(grouped)
                    .backend(Backend::Default)
                    .mode(mode)
                    .schedule(strategy);
                // Twice: the second call runs the cached executable.
                for call in 0..2 {
                    let got = grads(&|a: &[Tensor]| f.call(a), &inputs);
                    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                        let d = max_diff(w, g);
                        assert!(
                            d < 1e-5,
                            "{strategy:?}/{mode:?} call {call}, seed {seed}: grad of input {i} differs by {d}"
                        );
                    }
                }
            }
        }
    }
}

/// Defect 2: a fused kernel with two outputs, `y = relu(v)` and `y*y`,
/// where `v` is a reshape view of an intermediate that dies there; the
/// plan wrote `y` in place of that intermediate's buffer and later
/// kernels overwrote it while `y` was still to be read.
fn reshape_inplace(a: &[Tensor]) -> Vec<Tensor> {
    let t = a[0].matmul(&a[1]); // [8, 6]
    let v = t.reshape(&[6, 8]);
    let y = v.relu();
    let sq = y.mul(&y);
    let s = sq.sum(&[1], true); // [6, 1]
    let m = s.matmul(&a[2]); // [6, 8]
    let n = m.exp().matmul(&a[3]); // [6, 8]
    vec![n.add(&y).mul(&m)]
}

/// The local-response-normalisation shape: `x / (k + α·avg(x²))^β`, with
/// the square taken through a reshape.
fn lrn(a: &[Tensor]) -> Vec<Tensor> {
    let x = a[0].matmul(&a[1]); // [8, 12]
    let v = x.reshape(&[2, 4, 12]);
    let y = v.relu();
    let sq = y.mul(&y);
    let den = sq.mean(&[1], true).mul(1e-2).add(1.0).pow(0.75);
    let z = y.div(&den).reshape(&[8, 12]);
    vec![z.matmul(&a[2])]
}

fn values(f: &dyn Fn(&[Tensor]) -> Vec<Tensor>, inputs: &[Tensor]) -> Vec<Vec<f64>> {
    f(inputs).iter().map(|t| t.to_f64_vec()).collect()
}

fn check_values_everywhere(f: fn(&[Tensor]) -> Vec<Tensor>, inputs: &[Tensor]) {
    let want = values(&f, inputs);
    for strategy in STRATEGIES {
        for backend in [Backend::AotEager, Backend::Default] {
            let c = tessera::compile(f).backend(backend).schedule(strategy);
            for call in 0..2 {
                let got = values(&|a: &[Tensor]| c.call(a), inputs);
                for (w, g) in want.iter().zip(&got) {
                    let d = max_diff(w, g);
                    assert!(
                        d < 1e-4,
                        "{backend:?}/{strategy:?} call {call}: differs by {d}"
                    );
                }
            }
        }
    }
}

#[test]
fn reshape_view_inplace_reuse_keeps_values() {
    let inputs = [
        random(&[8, 5], 1),
        random(&[5, 6], 2),
        random(&[1, 8], 3),
        random(&[8, 8], 4),
    ];
    check_values_everywhere(reshape_inplace, &inputs);
}

#[test]
fn lrn_pattern_keeps_values() {
    let inputs = [random(&[8, 5], 1), random(&[5, 12], 2), random(&[12, 3], 3)];
    check_values_everywhere(lrn, &inputs);
}
