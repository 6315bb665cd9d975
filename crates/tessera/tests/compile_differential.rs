//! Differential tests of `tessera::compile` on random graphs: each graph of
//! the shared generator (`graph_gen`: every op family, broadcasting, views,
//! reductions, softmax, matmul, attention, hints) is the body of a compiled
//! function, run under every backend × mode and compared with the eager
//! run (the interpreter) and with the graph's f64 twin; gradients through
//! the compiled function are compared with eager autograd's.
//!
//! Tolerances: compiled vs eager f32 |Δ| ≤ 1e-4·(1 + |eager|) (fusion and
//! passes may reassociate and decompose, and the attention pass replaces
//! attention by the flash kernel, which sums in another order); vs f64
//! |Δ| ≤ 2e-3·(1 + |f64|) (the f32 rounding of a whole graph). Graphs with
//! non-finite or large (> 1e3) values anywhere are discarded, as in
//! `passes_differential.rs`, so rounding stays small next to the tolerance.

mod graph_gen;

use graph_gen::*;
use proptest::prelude::*;
use tessera::compile::{Backend, Mode};
use tessera::ir::Graph;
use tessera::tensor::interpret::run_graph;
use tessera::tensor::Generator;
use tessera::{DType, Tensor};

/// The graph as a traceable function: the interpreter applies its ops to
/// the arguments, so `compile` captures exactly the graph.
fn body(g: &Graph) -> impl Fn(&[Tensor]) -> Vec<Tensor> {
    let g = g.clone();
    move |args: &[Tensor]| {
        run_graph(&g, args)
            .unwrap_or_else(|e| panic!("{e}"))
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    }
}

fn close(
    what: &str,
    want: &[f64],
    got: &[f64],
    rel: f64,
) -> std::result::Result<(), TestCaseError> {
    prop_assert_eq!(want.len(), got.len(), "{}: lengths", what);
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        let ok = (w.is_nan() && g.is_nan()) || (w - g).abs() <= rel * (1.0 + w.abs());
        prop_assert!(ok, "{}[{}]: expected {}, got {}", what, i, w, g);
    }
    Ok(())
}

const BACKENDS: [Backend; 3] = [Backend::Eager, Backend::AotEager, Backend::Default];
const MODES: [Mode; 3] = [Mode::Default, Mode::ReduceOverhead, Mode::MaxAutotune];

fn check_values(spec: &Spec, seed: u64) -> std::result::Result<(), TestCaseError> {
    let g = build(spec);
    let args = inputs(&g, seed);
    prop_assume!(tame(&g, &args, 1e3));
    let eager = run(&g, &args);
    let wide = in_f64(&g);
    let reference = run(&wide, &inputs(&wide, seed));
    for backend in BACKENDS {
        for mode in MODES {
            let f = tessera::compile(body(&g)).backend(backend).mode(mode);
            // Twice: the second call runs the cached executable.
            for call in 0..2 {
                let out = f
                    .try_call(&args)
                    .map_err(|e| TestCaseError::fail(format!("{backend:?}/{mode:?}: {e}\n{g}")))?;
                for (((name, want), t), (_, wide)) in eager.iter().zip(&out).zip(&reference) {
                    let what = format!("{backend:?}/{mode:?} call {call}, {name}\n{g}");
                    let got = t.to_f64_vec();
                    close(&what, want, &got, 1e-4)?;
                    close(&format!("{what} vs f64"), wide, &got, 2e-3)?;
                }
            }
            prop_assert_eq!(
                f.stats().compiles,
                1,
                "{:?}/{:?}: one compile",
                backend,
                mode
            );
        }
    }
    Ok(())
}

/// Calls donating each input paired with an output of its type
/// (`try_call_updating`, as a training step feeds its new parameters back),
/// three in a row, each call's paired outputs the next call's inputs: every
/// call's outputs equal the interpreter's on the same values, under the
/// default mode and reduce-overhead (whose replays record donated inputs in
/// place).
fn check_donated(spec: &Spec, seed: u64) -> std::result::Result<(), TestCaseError> {
    let g = build(spec);
    let first = inputs(&g, seed);
    prop_assume!(tame(&g, &first, 1e3));
    let types: Vec<_> = run_graph(&g, &first)
        .map_err(|e| TestCaseError::fail(format!("{e}")))?
        .iter()
        .map(|(_, t)| t.ty())
        .collect();
    let mut taken = vec![false; types.len()];
    let mut pairs = Vec::new();
    for (i, a) in first.iter().enumerate() {
        if let Some(o) = (0..types.len()).find(|&o| !taken[o] && types[o] == a.ty()) {
            taken[o] = true;
            pairs.push((i, o));
        }
    }
    prop_assume!(!pairs.is_empty());
    drop(first);
    for mode in [Mode::Default, Mode::ReduceOverhead] {
        let f = tessera::compile(body(&g)).mode(mode);
        let mut args = inputs(&g, seed);
        for call in 0..3 {
            if !tame(&g, &args, 1e3) {
                break;
            }
            let want = run(&g, &args);
            let mut given = std::mem::take(&mut args);
            let out = f
                .try_call_updating(&mut given, &pairs)
                .map_err(|e| TestCaseError::fail(format!("{mode:?} call {call}: {e}\n{g}")))?;
            for ((name, want), t) in want.iter().zip(&out) {
                let what = format!("{mode:?} call {call} (pairs {pairs:?}), {name}\n{g}");
                close(&what, want, &t.to_f64_vec(), 1e-4)?;
            }
            args = inputs(&g, seed.wrapping_add(call + 1));
            let mut out: Vec<Option<Tensor>> = out.into_iter().map(Some).collect();
            for &(i, o) in &pairs {
                args[i] = out[o].take().expect("each output paired once");
            }
        }
    }
    Ok(())
}

/// A scalar loss mixing every output with fixed random weights, so that
/// each output's gradient is non-trivial.
fn loss(outs: &[Tensor], seed: u64) -> Tensor {
    let mut gen = Generator::new(seed ^ 0x9e37_79b9);
    outs.iter()
        .map(|o| {
            let w = Tensor::randn(o.shape(), DType::F32, &mut gen).cast(o.dtype());
            (o * &w).sum(&[], false)
        })
        .reduce(|a, b| a + b)
        .expect("graphs have outputs")
}

fn grads_of(f: impl Fn(&[Tensor]) -> Vec<Tensor>, g: &Graph, seed: u64) -> Option<Vec<Vec<f64>>> {
    let args: Vec<Tensor> = inputs(g, seed)
        .iter()
        .map(|t| t.set_requires_grad(true))
        .collect();
    let outs = f(&args);
    // Graphs whose outputs do not depend on a differentiable path (or use
    // an op without a gradient) have nothing to compare.
    loss(&outs, seed).try_backward(None).ok()?;
    Some(
        args.iter()
            .map(|a| a.grad().map_or_else(Vec::new, |t| t.to_f64_vec()))
            .collect(),
    )
}

fn check_grads(spec: &Spec, seed: u64) -> std::result::Result<(), TestCaseError> {
    let g = build(spec);
    prop_assume!(tame(&g, &inputs(&g, seed), 1e3));
    let eager = grads_of(body(&g), &g, seed);
    prop_assume!(eager.is_some());
    let eager = eager.expect("checked");
    for backend in BACKENDS {
        let f = tessera::compile(body(&g)).backend(backend);
        let compiled = grads_of(|a: &[Tensor]| f.call(a), &g, seed);
        let compiled = compiled.ok_or_else(|| {
            TestCaseError::fail(format!(
                "{backend:?}: backward failed where eager's ran\n{g}"
            ))
        })?;
        for (i, (want, got)) in eager.iter().zip(&compiled).enumerate() {
            close(
                &format!("{backend:?}: grad of input {i}\n{g}"),
                want,
                got,
                1e-4,
            )?;
        }
    }
    Ok(())
}

proptest! {
    // 96 cases unless PROPTEST_CASES asks for more (an explicit `cases`
    // would override the variable).
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(96),
        max_global_rejects: 4096,
        ..ProptestConfig::default()
    })]

    #[test]
    fn compiled_graphs_match_eager_and_f64(spec in spec_strategy(), seed in any::<u64>()) {
        check_values(&spec, seed)?;
    }

    #[test]
    fn donated_inputs_paired_with_outputs_match_eager(
        spec in spec_strategy(),
        seed in any::<u64>(),
    ) {
        check_donated(&spec, seed)?;
    }

    // Its saved cases (compile_differential.proptest-regressions) include a
    // custom op's output written in place at a slot the plan had given
    // another buffer, and pow's gradient at a zero exponent.
    #[test]
    fn compiled_gradients_match_eager(spec in spec_strategy(), seed in any::<u64>()) {
        check_grads(&spec, seed)?;
    }
}
