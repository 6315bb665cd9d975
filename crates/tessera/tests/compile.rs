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
    // Static shapes: each new size recompiles (automatic dynamic dims
    // would serve every size after the second from one executable).
    let f = compile(|x: &[Tensor]| vec![x[0].exp()])
        .recompile_limit(2)
        .dynamic(Some(false));
    for n in 1..=6 {
        let x = randn(&[n], n as u64);
        assert_close(&f.call(std::slice::from_ref(&x))[0], &x.exp(), 1e-12);
    }
    let s = f.stats();
    assert_eq!(s.compiles, 3, "the first compile and 2 recompiles");
    assert_eq!(s.eager_calls, 3);
}

/// A function whose graph depends on state it closes over, not on its
/// inputs: `parts` slices, each scaled by its own constant.
fn sliced_scaled(x: &Tensor, parts: usize) -> Tensor {
    let scaled: Vec<Tensor> = x
        .tensor_split(parts, 0)
        .iter()
        .enumerate()
        .map(|(i, p)| p.tanh() * (i + 1) as f64)
        .collect();
    Tensor::cat(&scaled.iter().collect::<Vec<_>>(), 0).sum(&[], false)
}

#[test]
fn captured_state_that_changes_the_graph_recompiles_with_right_values_and_gradients() {
    // The guards (the inputs) are the same every call; only the captured
    // `parts` changes the traced graph. A cached executable must never
    // serve a graph it was not built from, also when it was started before
    // the trace (speculation): its outputs are dropped on a changed graph.
    for speculate in [false, true] {
        let parts = std::cell::Cell::new(2);
        let f = compile(|x: &[Tensor]| vec![sliced_scaled(&x[0], parts.get())])
            .speculate(Some(speculate));
        let x = randn(&[6, 3], 4).set_requires_grad(true);
        for (call, k) in [2, 3, 3, 2, 2, 6].into_iter().enumerate() {
            parts.set(k);
            x.zero_grad();
            let eager = sliced_scaled(&x, k);
            eager.backward();
            let want_grad = x.grad().unwrap();
            x.zero_grad();
            let out = f.call(std::slice::from_ref(&x));
            assert_close(&out[0], &eager, 1e-12);
            out[0].backward();
            assert_close(&x.grad().unwrap(), &want_grad, 1e-12);
            let compiles = [1, 2, 2, 2, 2, 3][call];
            assert_eq!(f.stats().compiles, compiles, "call {call}, {k} parts");
        }
        let s = f.stats();
        assert_eq!(s.cache_hits, 3, "{s:?}");
        let reasons = f.recompile_reasons();
        assert_eq!(reasons.len(), 2);
        assert!(
            reasons[0].contains("the traced graph changed"),
            "{reasons:?}"
        );
        // Calls 2-6 start the last call's executable; those of calls 2, 4
        // and 6 (a changed graph) are dropped.
        let expected = if speculate { (5, 3) } else { (0, 0) };
        assert_eq!((s.speculations, s.speculation_misses), expected, "{s:?}");
    }
}

#[test]
fn a_captured_hint_that_changes_recompiles() {
    // Hints change no value, only how the graph is scheduled: still a
    // different graph, so a different executable.
    let group = std::cell::Cell::new(0);
    let f = compile(|x: &[Tensor]| {
        let hint = tessera::hints::Hint::strict().group(group.get());
        vec![tessera::hints::scope(hint, || (x[0].exp() * 2.0).sum(&[1], false)).unwrap()]
    });
    let x = randn(&[4, 5], 5);
    let want = (x.exp() * 2.0).sum(&[1], false);
    for (call, g) in [0, 0, 1, 1, 0].into_iter().enumerate() {
        group.set(g);
        assert_close(&f.call(std::slice::from_ref(&x))[0], &want, 1e-12);
        assert_eq!(f.stats().compiles, [1, 1, 2, 2, 2][call], "call {call}");
    }
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

/// Rows of softmax plus a broadcast bias, a sum, and a matmul with an
/// epilogue: everything a size change touches.
fn dyn_fn(x: &[Tensor]) -> Vec<Tensor> {
    let h = (x[0].matmul(&x[1]) + &x[2]).relu() * 0.5;
    vec![h.softmax(-1), (&x[0] * 2.0).sum(&[-1], true) + 1.0]
}

fn compiles_over_sizes(dynamic: Option<bool>) -> usize {
    let f = compile(dyn_fn).dynamic(dynamic);
    // (Sizes other than 8..64: with every dim symbolic, equal sizes share a
    // symbol, so a coincidence such as n == 16 == w's width would be a
    // different set of guards and recompile, as in torch.compile.)
    let (w, b) = (randn(&[24, 10], 1), randn(&[10], 2));
    for (i, n) in [8usize, 16, 32, 64].into_iter().enumerate() {
        let args = [randn(&[n, 24], 10 + i as u64), w.clone(), b.clone()];
        let got = f.call(&args);
        let want = dyn_fn(&args);
        for (g, e) in got.iter().zip(&want) {
            assert_eq!(g.shape(), e.shape());
            assert_close(g, e, 1e-12);
        }
    }
    f.stats().compiles
}

#[test]
fn automatic_dynamic_dims_serve_every_later_size_from_one_executable() {
    assert_eq!(
        compiles_over_sizes(None),
        2,
        "automatic: static, then symbolic"
    );
    assert_eq!(
        compiles_over_sizes(Some(true)),
        1,
        "symbolic from the start"
    );
    assert_eq!(compiles_over_sizes(Some(false)), 4, "one per size");
}

#[test]
fn a_reshape_to_a_size_from_the_trace_generalises() {
    // The reshape bakes 5n into the graph; value matching writes it as
    // 5*s0, so one executable serves every size (a size with no symbolic
    // form recompiles: see tests/compile_dynamic.rs).
    let f = compile(|x: &[Tensor]| vec![x[0].reshape(&[-1]) * 2.0]).dynamic(Some(true));
    for n in [2usize, 3, 4] {
        let x = randn(&[n, 5], n as u64);
        assert_close(
            &f.call(std::slice::from_ref(&x))[0],
            &(x.reshape(&[-1]) * 2.0),
            0.0,
        );
    }
    assert_eq!(f.stats().compiles, 1);
}

#[test]
fn max_autotune_keeps_the_results_bit_for_bit() {
    let chain = |x: &[Tensor]| {
        vec![(((&x[0] * 1.5 + 0.25).tanh() * &x[0] - 0.5).relu().sigmoid() * 2.0).maximum(&x[1])]
    };
    let mut g = Generator::new(4);
    let args = [
        Tensor::randn(&[300, 257], DType::F32, &mut g),
        Tensor::randn(&[257], DType::F32, &mut g),
    ];
    let before = tessera::runtime::cpu::autotune::tuned_count();
    let tuned = compile(chain).mode(Mode::MaxAutotune);
    let plain = compile(chain);
    let (a, b) = (tuned.call(&args), plain.call(&args));
    assert!(
        tessera::runtime::cpu::autotune::tuned_count() > before,
        "a block was tuned and cached"
    );
    assert_eq!(a[0].to_f64_vec(), b[0].to_f64_vec());
    assert_eq!(a[0].to_f64_vec(), chain(&args)[0].to_f64_vec());
    // The second call reuses the cached choice: the same bits again.
    assert_eq!(tuned.call(&args)[0].to_f64_vec(), b[0].to_f64_vec());
}

// ------------------------------------------------- randomness as graph ops

/// Dropout-style noise: a uniform mask, normal noise, and their use.
fn noisy(generator: &std::cell::RefCell<Generator>, x: &Tensor) -> Vec<Tensor> {
    let mut g = generator.borrow_mut();
    let u = Tensor::rand(x.shape(), DType::F32, &mut g);
    let n = Tensor::randn(x.shape(), DType::F32, &mut g);
    let keep = u.ge(0.25).cast(DType::F32) * (1.0 / 0.75);
    let y = x * &keep + &n * 0.5;
    vec![u, n, y]
}

/// `rand`/`randn` draw a new seed from the generator on every call; the
/// seed is an input of the executable (a lifted host scalar), not part of
/// the graph, so 50 calls compile once, and each call draws exactly what
/// eager code with an identically seeded generator draws.
#[test]
fn random_ops_draw_a_new_seed_per_call_from_one_executable() {
    let compiled_gen = std::cell::RefCell::new(Generator::new(11));
    let eager_gen = std::cell::RefCell::new(Generator::new(11));
    let f = compile(|x: &[Tensor]| noisy(&compiled_gen, &x[0]));
    let x = Tensor::randn(&[6, 40], DType::F32, &mut Generator::new(3));
    let mut previous: Option<Vec<f32>> = None;
    for call in 0..50 {
        let got = f.call(std::slice::from_ref(&x));
        let want = noisy(&eager_gen, &x);
        for (name, (g, w)) in ["u", "n", "y"].iter().zip(got.iter().zip(&want)) {
            assert_eq!(
                g.to_vec::<f32>().unwrap(),
                w.to_vec::<f32>().unwrap(),
                "call {call}, output {name}: compiled != eager"
            );
        }
        let u = got[0].to_vec::<f32>().unwrap();
        assert_ne!(previous.as_ref(), Some(&u), "call {call} drew new numbers");
        previous = Some(u);
    }
    let s = f.stats();
    assert_eq!(
        (s.compiles, s.recompiles, s.cache_hits, s.eager_calls),
        (1, 0, 49, 0),
        "{:?}",
        f.recompile_reasons()
    );
    // The seeds are inputs of the forward graph, not attributes.
    let artifacts = f.last_artifacts();
    let (_, forward) = artifacts
        .iter()
        .find(|(name, _)| name.ends_with(".tir"))
        .expect("a forward graph");
    assert!(forward.contains("= rand(%"), "{forward}");
    assert!(forward.contains("= randn(%"), "{forward}");
    assert!(!forward.contains("seed="), "{forward}");
}

/// A call that is traced and then runs eagerly (a graph break with an
/// input that requires grad) draws its random numbers once, as the eager
/// call does: the same numbers, and the generator left where eager code
/// leaves it, call after call.
#[test]
fn a_graph_break_that_runs_eagerly_draws_the_seeds_once() {
    let compiled_gen = std::cell::RefCell::new(Generator::new(12));
    let eager_gen = std::cell::RefCell::new(Generator::new(12));
    let with_break = |generator: &std::cell::RefCell<Generator>, x: &Tensor| {
        let mut out = noisy(generator, x);
        let scale = out[2].sum(&[], false).item(); // the break
        out.push(&out[2] * scale);
        out
    };
    let f = compile(|x: &[Tensor]| with_break(&compiled_gen, &x[0]));
    let x = Tensor::randn(&[4, 10], DType::F32, &mut Generator::new(3)).set_requires_grad(true);
    for call in 0..3 {
        let got = f.call(std::slice::from_ref(&x));
        let want = with_break(&eager_gen, &x);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_vec::<f32>().unwrap(),
                w.to_vec::<f32>().unwrap(),
                "call {call}, output {i}: compiled != eager"
            );
        }
        assert!(got[3].requires_grad(), "the eager run records the tape");
    }
    assert_eq!(f.stats().eager_calls, 3, "{:?}", f.stats());
    assert_eq!(
        compiled_gen.borrow_mut().next_seed(),
        eager_gen.borrow_mut().next_seed(),
        "the generators are at the same state"
    );
}

/// A small language model with dropout 0.1 and its loss compiled, trained
/// for 50 AdamW steps: it compiles once (dropout draws a new seed per step,
/// a new value of the same input), and its losses follow the eager run's,
/// whose dropout masks come from the same generator states.
#[test]
fn a_training_loop_with_dropout_compiles_once_and_tracks_eager() {
    use tessera::nn::{cross_entropy, ParamStore, TransformerConfig, TransformerLM};
    use tessera::optim::{AdamW, AdamWConfig, Optimizer};

    const STEPS: usize = 50;
    const TOL: f64 = 1e-5;
    let config = TransformerConfig {
        vocab: 16,
        d_model: 16,
        n_heads: 2,
        n_layers: 2,
        d_ff: 32,
        max_len: 8,
        dropout: 0.1,
    };
    let vocab = config.vocab as isize;
    // Token batches [4, 8] and their next-token targets, the same each run.
    let mut data = Generator::new(21);
    let batches: Vec<[Tensor; 2]> = (0..STEPS)
        .map(|_| {
            // Casts truncate: uniform [0, vocab) to a token id.
            let tokens = (Tensor::rand(&[4, 9], DType::F32, &mut data) * config.vocab as f64)
                .cast(DType::I64);
            let ids = tokens.narrow(1, 0, 8).contiguous();
            let targets = tokens.narrow(1, 1, 8).contiguous().reshape(&[-1]);
            [ids, targets]
        })
        .collect();
    let run = |compiled: bool, train: bool| {
        let mut store = ParamStore::new();
        let model = TransformerLM::new(&mut store, "lm", config.clone(), &mut Generator::new(5));
        let loss_fn = |x: &[Tensor]| {
            let logits = model.forward(&x[0], train).reshape(&[-1, vocab]);
            vec![cross_entropy(&logits, &x[1], None)]
        };
        let f = compile(loss_fn);
        let adamw = AdamWConfig {
            lr: 1e-2,
            ..AdamWConfig::default()
        };
        let mut opt = AdamW::new(store.parameters(), adamw);
        let mut losses = Vec::with_capacity(STEPS);
        for batch in &batches {
            opt.zero_grad();
            let loss = match compiled {
                true => f.call(batch).remove(0),
                false => loss_fn(batch).remove(0),
            };
            loss.backward();
            opt.step();
            losses.push(loss.item());
        }
        (losses, f.stats())
    };
    let (eager, _) = run(false, true);
    let (compiled, stats) = run(true, true);
    assert_eq!(
        (stats.compiles, stats.recompiles, stats.eager_calls),
        (1, 0, 0),
        "{stats:?}"
    );
    for (step, (c, e)) in compiled.iter().zip(&eager).enumerate() {
        assert!(
            (c - e).abs() <= TOL * e.abs(),
            "step {step}: compiled loss {c} vs eager {e}"
        );
    }
    assert!(eager[STEPS - 1] < eager[0], "it learns: {eager:?}");
    // The tolerance tells masks apart: without dropout the first loss
    // already differs by far more.
    let (no_dropout, _) = run(false, false);
    assert!(
        (no_dropout[0] - eager[0]).abs() > 10.0 * TOL * eager[0].abs(),
        "{} vs {}",
        no_dropout[0],
        eager[0]
    );
}

/// Under the min-cut partition with no activation budget the dropout mask
/// is recomputed in the backward instead of saved: from the same seed
/// input, so the gradients are those of the forward's mask (eager's).
#[test]
fn a_dropout_mask_recomputed_in_the_backward_is_the_forwards() {
    use tessera::nn::Dropout;
    let w = randn(&[8, 8], 1).set_requires_grad(true);
    let x = randn(&[4, 8], 2);
    let loss = |drop: &Dropout, x: &Tensor| {
        let h = drop.forward(&x.matmul(&w).tanh(), true);
        vec![(&h * &h).sum(&[], false)]
    };
    let (compiled, eager) = (
        Dropout::new(0.5, &mut Generator::new(2)),
        Dropout::new(0.5, &mut Generator::new(2)),
    );
    let f = compile(|x: &[Tensor]| loss(&compiled, &x[0])).activation_memory_budget(0.0);
    let mut grads = Vec::new();
    for call in 0..3 {
        w.zero_grad();
        let out = f.call(std::slice::from_ref(&x));
        out[0].backward();
        let got = w.grad().unwrap();
        w.zero_grad();
        let want = loss(&eager, &x);
        want[0].backward();
        assert_close(&out[0], &want[0], 1e-12);
        let want = w.grad().unwrap();
        assert_close(&got, &want, 1e-12);
        assert!(
            grads
                .iter()
                .all(|g: &Tensor| g.to_f64_vec() != got.to_f64_vec()),
            "call {call}: a new mask"
        );
        grads.push(got);
    }
    assert_eq!(f.stats().compiles, 1);
    let artifacts = f.last_artifacts();
    let backward = artifacts
        .iter()
        .find(|(name, _)| name == "backward.tir")
        .map(|(_, text)| text)
        .expect("a backward graph");
    assert!(backward.contains("= rand(%"), "recomputed: {backward}");
}

/// Under `no_grad` nothing needs a gradient, even a captured weight that
/// requires grad: the call compiles a forward without a backward (no saved
/// activations), and the same function with grad on compiles its own
/// executable, whose gradients are eager's.
#[test]
fn under_no_grad_a_captured_weight_gets_no_backward() {
    let w = randn(&[6, 3], 2).set_requires_grad(true);
    let f = compile(|x: &[Tensor]| vec![x[0].matmul(&w).tanh().sum(&[], false)]);
    let x = randn(&[4, 6], 1);
    let has_backward = |f: &tessera::compile::Compiled<_>| {
        f.last_artifacts()
            .iter()
            .any(|(n, _)| n.contains("backward"))
    };
    let y = tessera::autograd::no_grad(|| f.call(std::slice::from_ref(&x)).remove(0));
    assert!(!y.requires_grad());
    assert!(
        !has_backward(&f),
        "{:?}",
        f.last_artifacts().iter().map(|a| &a.0).collect::<Vec<_>>()
    );
    let want = x.matmul(&w).tanh().sum(&[], false);
    assert_eq!(y.to_vec::<f64>().unwrap(), want.to_vec::<f64>().unwrap());
    // With grad on: another executable, with a backward.
    let y = f.call(std::slice::from_ref(&x)).remove(0);
    assert!(has_backward(&f));
    y.backward();
    let compiled_grad = w.grad().expect("a gradient").to_vec::<f64>().unwrap();
    w.zero_grad();
    want.backward();
    let eager_grad = w.grad().expect("a gradient").to_vec::<f64>().unwrap();
    for (c, e) in compiled_grad.iter().zip(&eager_grad) {
        assert!((c - e).abs() <= 1e-12 * (1.0 + e.abs()), "{c} vs {e}");
    }
    assert_eq!(f.stats().compiles, 2, "{:?}", f.recompile_reasons());
}

/// `exp(x) + 1` and `tanh(2y)`: one fused kernel each, outputs of their
/// inputs' size.
fn two_chains(x: &[Tensor]) -> Vec<Tensor> {
    vec![x[0].exp() + 1.0, (&x[1] * 2.0).tanh()]
}

#[test]
fn a_donated_input_is_written_over_and_an_undonated_or_held_one_is_not() {
    let f = compile(two_chains);
    let make = |v: f64| Tensor::full(&[64], v, DType::F32);
    let want = |a: f64, b: f64| {
        (
            vec![(a.exp() + 1.0) as f32; 64],
            vec![(2.0 * b).tanh() as f32; 64],
        )
    };
    // Both donated; the second still held by the caller (a clone).
    let (a, b) = (make(0.5), make(0.25));
    let (a_at, b_at) = (a.array().buffer_addr(), b.array().buffer_addr());
    let held = b.clone();
    let mut args = vec![a, b];
    let out = f.try_call_donating(&mut args, &[0, 1]).unwrap();
    assert!(args.is_empty(), "the call took its arguments");
    assert_eq!(
        out[0].array().buffer_addr(),
        a_at,
        "written over the donated input"
    );
    assert_ne!(
        out[1].array().buffer_addr(),
        b_at,
        "the held input is not written over"
    );
    let (w0, w1) = want(0.5, 0.25);
    assert_eq!(out[0].to_vec::<f32>().unwrap(), w0);
    assert_eq!(out[1].to_vec::<f32>().unwrap(), w1);
    assert_eq!(held.to_vec::<f32>().unwrap(), vec![0.25; 64], "intact");
    let plan = f.last_artifacts();
    let memory = &plan
        .iter()
        .find(|(n, _)| n == "forward.memory.txt")
        .unwrap()
        .1;
    assert!(memory.contains("2 over donated inputs"), "{memory}");
    // Not donated (handed over by value all the same): a buffer of its own,
    // and another executable (donation is part of the guards).
    let a = make(0.5);
    let a_at = a.array().buffer_addr();
    let mut args = vec![a, make(0.25)];
    let out = f.try_call_donating(&mut args, &[1]).unwrap();
    assert_ne!(out[0].array().buffer_addr(), a_at);
    assert_eq!(out[0].to_vec::<f32>().unwrap(), w0);
    assert_eq!(f.stats().compiles, 2);
    assert_eq!(
        f.recompile_reasons(),
        vec!["input 0: expected donated, got not donated".to_string()]
    );
    // The same call again hits its entry.
    let mut args = vec![make(0.5), make(0.25)];
    f.try_call_donating(&mut args, &[0, 1]).unwrap();
    assert_eq!(f.stats().compiles, 2);
    // A plain call with donating guards' shapes reads every input.
    let x = [make(0.5), make(0.25)];
    let out = f.call(&x);
    assert_eq!(out[0].to_vec::<f32>().unwrap(), w0);
    assert_eq!(x[0].to_vec::<f32>().unwrap(), vec![0.5; 64]);
}

#[test]
fn a_donating_call_that_fails_before_running_keeps_its_arguments() {
    let f = compile(two_chains);
    let mut args = vec![Tensor::full(&[4], 1.0, DType::F32)];
    let e = f.try_call_donating(&mut args, &[3]).unwrap_err();
    assert!(
        e.to_string()
            .contains("cannot donate argument 3 of a call with 1 arguments"),
        "{e}"
    );
    assert_eq!(args.len(), 1);
    // The function fails while tracing (it reads a second input).
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        f.try_call_donating(&mut args, &[0])
    }));
    assert!(caught.is_err());
    assert_eq!(args.len(), 1, "untouched");
    assert_eq!(args[0].to_vec::<f32>().unwrap(), vec![1.0; 4]);
}
