//! `tessera::compile`: the cache and its guards, recompiles, the eager
//! fallback, graph breaks, backends, and gradients through compiled graphs —
//! every result checked against eager execution.

use tessera::compile::{Backend, Mode};
use tessera::tensor::Generator;
use tessera::{compile, DType, Tensor};

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F64, &mut Generator::new(seed))
}

fn assert_close(a: &Tensor, b: &Tensor, tol: f64) {
    assert_eq!(a.shape(), b.shape());
    for (x, y) in a.to_f64_vec().iter().zip(b.to_f64_vec()) {
        assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{x} vs {y}");
    }
}

fn mlp(x: &[Tensor]) -> Vec<Tensor> {
    let h = (x[0].matmul(&x[1]) + &x[2]).gelu();
    vec![h.softmax(-1), h.sum(&[], false)]
}

#[test]
fn same_shapes_hit_the_cache() {
    let f = compile(mlp);
    let args = [randn(&[4, 3], 0), randn(&[3, 5], 1), randn(&[5], 2)];
    for _ in 0..3 {
        let out = f.call(&args);
        let eager = mlp(&args);
        assert_close(&out[0], &eager[0], 1e-12);
        assert_close(&out[1], &eager[1], 1e-12);
    }
    let s = f.stats();
    assert_eq!((s.compiles, s.recompiles, s.cache_hits), (1, 0, 2));
}

#[test]
fn a_new_shape_recompiles_with_its_reason() {
    let f = compile(mlp);
    f.call(&[randn(&[8, 3], 0), randn(&[3, 5], 1), randn(&[5], 2)]);
    let out = f.call(&[randn(&[16, 3], 0), randn(&[3, 5], 1), randn(&[5], 2)]);
    assert_eq!(out[0].shape(), &[16, 5]);
    assert_eq!(f.stats().recompiles, 1);
    assert_eq!(
        f.recompile_reasons(),
        vec!["input 0, dim 0: expected 8, got 16".to_string()]
    );
}

#[test]
fn past_the_recompile_limit_it_runs_eagerly() {
    let f = compile(|x: &[Tensor]| vec![x[0].exp()]).recompile_limit(2);
    for n in 1..=6 {
        let x = randn(&[n], n as u64);
        assert_close(&f.call(std::slice::from_ref(&x))[0], &x.exp(), 1e-12);
    }
    let s = f.stats();
    assert_eq!(s.compiles, 3, "the first compile and 2 recompiles");
    assert_eq!(s.eager_calls, 3);
}

fn branchy(x: &[Tensor]) -> Vec<Tensor> {
    // A data-dependent branch: a graph break.
    let total = x[0].sum(&[], false).item();
    if total > 0.0 {
        vec![&x[0] * 2.0]
    } else {
        vec![&x[0] * -3.0]
    }
}

#[test]
fn graph_breaks_give_the_right_answer() {
    let f = compile(branchy);
    let pos = Tensor::from_vec(vec![1.0, 2.0, 3.0], &[3]);
    let neg = Tensor::from_vec(vec![-1.0, -2.0, 0.5], &[3]);
    assert_eq!(
        f.call(std::slice::from_ref(&pos))[0].to_f64_vec(),
        vec![2.0, 4.0, 6.0]
    );
    assert_eq!(
        f.call(std::slice::from_ref(&neg))[0].to_f64_vec(),
        vec![3.0, 6.0, -1.5]
    );
    assert_eq!(
        f.call(std::slice::from_ref(&pos))[0].to_f64_vec(),
        vec![2.0, 4.0, 6.0]
    );
    assert!(f.stats().graph_breaks >= 3);
}

#[test]
fn fullgraph_turns_a_break_into_an_error_at_the_line() {
    let f = compile(branchy).fullgraph(true);
    let err = f
        .try_call(&[Tensor::from_vec(vec![1.0], &[1])])
        .unwrap_err();
    let loc = err.location.clone().expect("the read's location");
    assert!(loc.file.ends_with("compile.rs"), "{err}");
    assert!(
        err.to_string().contains("graph break under fullgraph"),
        "{err}"
    );
}

#[test]
fn every_backend_matches_eager() {
    let args = [randn(&[4, 3], 5), randn(&[3, 5], 6), randn(&[5], 7)];
    let eager = mlp(&args);
    for backend in [Backend::Eager, Backend::AotEager, Backend::Default] {
        for mode in [Mode::Default, Mode::ReduceOverhead, Mode::MaxAutotune] {
            let f = compile(mlp).backend(backend).mode(mode);
            for _ in 0..2 {
                let out = f.call(&args);
                assert_close(&out[0], &eager[0], 1e-12);
                assert_close(&out[1], &eager[1], 1e-12);
            }
        }
    }
}

#[test]
fn gradients_through_compiled_graphs_match_eager() {
    let w = randn(&[3, 5], 1).set_requires_grad(true); // closed over: lifted
    let loss_fn = |x: &[Tensor]| vec![(x[0].matmul(&w).tanh() * &x[1]).sum(&[], false)];
    let x = randn(&[4, 3], 2).set_requires_grad(true);
    let s = randn(&[4, 5], 3);
    let eager = loss_fn(&[x.clone(), s.clone()]);
    eager[0].backward();
    let (gx, gw) = (x.grad().unwrap(), w.grad().unwrap());
    for backend in [Backend::Eager, Backend::AotEager, Backend::Default] {
        x.zero_grad();
        w.zero_grad();
        let f = compile(loss_fn).backend(backend);
        let out = f.call(&[x.clone(), s.clone()]);
        assert_close(&out[0], &eager[0], 1e-12);
        out[0].backward();
        assert_close(&x.grad().unwrap(), &gx, 1e-12);
        assert_close(&w.grad().unwrap(), &gw, 1e-12);
    }
}
