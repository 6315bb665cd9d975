//! Symbolic shapes end to end: nn models under `tessera::compile` called at
//! many batch sizes and sequence lengths compile at most twice (the first
//! call, then one symbolic executable), with values and parameter
//! gradients equal to eager; what cannot be made symbolic says why.

use tessera::nn::{
    cross_entropy, Linear, MultiHeadAttention, ParamStore, Parameter, TransformerConfig,
    TransformerLM,
};
use tessera::tensor::Generator;
use tessera::{compile, DType, Tensor};

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F32, &mut Generator::new(seed))
}

fn ids(batch: usize, seq: usize, vocab: usize, seed: u64) -> Tensor {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    let data: Vec<i64> = (0..batch * seq)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % vocab as u64) as i64
        })
        .collect();
    Tensor::from_vec(data, &[batch, seq])
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.shape(), want.shape(), "{what}");
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= tol * (1.0 + b.abs()),
            "{what}[{i}]: compiled {a} vs eager {b}"
        );
    }
}

/// The loss (compiled, then eager) and every parameter's gradient of each.
fn compare_grads(params: &[Parameter], run: impl Fn() -> Tensor, eager: impl Fn() -> Tensor) {
    params.iter().for_each(Parameter::zero_grad);
    let loss = run();
    loss.backward();
    let compiled: Vec<Tensor> = params.iter().map(|p| p.grad().unwrap()).collect();
    params.iter().for_each(Parameter::zero_grad);
    let want = eager();
    want.backward();
    assert_close("loss", &loss, &want, 1e-5);
    for (p, g) in params.iter().zip(&compiled) {
        assert_close(p.name(), g, &p.grad().unwrap(), 1e-4);
    }
}

#[test]
fn an_mlp_of_linears_compiles_twice_over_five_batch_sizes_with_gradients() {
    let mut g = Generator::new(0);
    let mut store = ParamStore::new();
    let fc1 = Linear::new(&mut store, "fc1", 12, 20, true, &mut g);
    let fc2 = Linear::new(&mut store, "fc2", 20, 4, true, &mut g);
    let mlp = |x: &Tensor| fc2.forward(&fc1.forward(x).gelu()).sum(&[], false);
    let f = compile(|x: &[Tensor]| vec![mlp(&x[0])]);
    for (i, batch) in [3usize, 5, 6, 7, 9].into_iter().enumerate() {
        let x = randn(&[batch, 12], i as u64);
        compare_grads(
            &store.parameters(),
            || f.call(std::slice::from_ref(&x)).remove(0),
            || mlp(&x),
        );
    }
    let s = f.stats();
    assert_eq!(
        (s.compiles, s.recompiles),
        (2, 1),
        "{:?}",
        f.recompile_reasons()
    );
    assert_eq!(
        f.recompile_reasons(),
        vec!["input 0, dim 0: expected 3, got 5".to_string()]
    );
}

#[test]
fn dynamic_from_the_start_compiles_once_through_reshapes_of_3d_inputs() {
    // [B, T, 12] through Linear flattens to [B*T, 12] and back.
    let mut g = Generator::new(1);
    let mut store = ParamStore::new();
    let fc = Linear::new(&mut store, "fc", 12, 6, true, &mut g);
    let f =
        compile(|x: &[Tensor]| vec![fc.forward(&x[0]).tanh().mean(&[], false)]).dynamic(Some(true));
    for (i, (b, t)) in [(2usize, 3usize), (3, 5), (4, 7), (5, 3)]
        .into_iter()
        .enumerate()
    {
        let x = randn(&[b, t, 12], 10 + i as u64);
        compare_grads(
            &store.parameters(),
            || f.call(std::slice::from_ref(&x)).remove(0),
            || fc.forward(&x).tanh().mean(&[], false),
        );
    }
    assert_eq!(f.stats().compiles, 1, "{:?}", f.recompile_reasons());
}

#[test]
fn multi_head_attention_is_symbolic_in_batch_and_sequence() {
    let mut g = Generator::new(2);
    let mut store = ParamStore::new();
    let attn = MultiHeadAttention::new(&mut store, "attn", 16, 4, true, &mut g);
    let loss = |x: &Tensor| attn.forward(x).sum(&[], false);
    let f = compile(|x: &[Tensor]| vec![loss(&x[0])]);
    for (i, (b, t)) in [(2usize, 5usize), (3, 7), (5, 9), (6, 3)]
        .into_iter()
        .enumerate()
    {
        let x = randn(&[b, t, 16], 20 + i as u64);
        compare_grads(
            &store.parameters(),
            || f.call(std::slice::from_ref(&x)).remove(0),
            || loss(&x),
        );
    }
    assert_eq!(f.stats().compiles, 2, "{:?}", f.recompile_reasons());
}

#[test]
fn a_transformer_lm_over_5_batch_sizes_and_3_lengths_compiles_at_most_twice() {
    let config = TransformerConfig {
        vocab: 29,
        d_model: 24,
        n_heads: 4,
        n_layers: 2,
        d_ff: 40,
        max_len: 16,
        dropout: 0.0,
    };
    let mut g = Generator::new(3);
    let mut store = ParamStore::new();
    let model = TransformerLM::new(&mut store, "", config, &mut g);
    let loss = |x: &Tensor, y: &Tensor| {
        let logits = model.forward(x, true);
        cross_entropy(&logits.reshape(&[-1, 29]), &y.reshape(&[-1]), None)
    };
    let f = compile(|a: &[Tensor]| vec![loss(&a[0], &a[1])]);
    let mut seed = 100;
    for seq in [5usize, 9, 11] {
        for batch in [2usize, 3, 4, 7, 8] {
            seed += 1;
            let (x, y) = (ids(batch, seq, 29, seed), ids(batch, seq, 29, seed + 500));
            let args = [x.clone(), y.clone()];
            compare_grads(
                &store.parameters(),
                || f.call(&args).remove(0),
                || loss(&x, &y),
            );
        }
    }
    let s = f.stats();
    assert!(s.compiles <= 2, "{s:?}: {:?}", f.recompile_reasons());
    assert_eq!(s.eager_calls, 0);
}

#[test]
fn a_dim_that_cannot_be_symbolic_says_which_op_and_why() {
    // arange(n) is a size the trace bakes with no symbolic form.
    let f = compile(|x: &[Tensor]| {
        let n = x[0].shape()[0];
        let r = Tensor::arange(0.0, n as f64, 1.0, DType::F32);
        vec![&x[0] + &r]
    });
    for n in [3usize, 5, 7] {
        let x = randn(&[n], n as u64);
        let want = &x + &Tensor::arange(0.0, n as f64, 1.0, DType::F32);
        assert_close("out", &f.call(std::slice::from_ref(&x))[0], &want, 0.0);
    }
    let reasons = f.recompile_reasons();
    assert_eq!(f.stats().compiles, 3, "{reasons:?}");
    let last = reasons.last().unwrap();
    assert!(
        last.contains("the graph stays concrete") && last.contains("(add"),
        "{reasons:?}"
    );
}
