//! The attention pass (`passes::attention`) on the code users write: the
//! seed's naive and sliced attention, causal or not, and
//! `nn::MultiHeadAttention`; and compiled results and gradients (with the
//! pass) against eager ones (without it).

use tessera::custom_op::flash_attention::FORWARD;
use tessera::hints;
use tessera::ir::{Graph, Op, TensorType};
use tessera::nn::{MultiHeadAttention, ParamStore};
use tessera::passes::{PassContext, PassManager};
use tessera::seed_table::{sdpa, SEED_HINT};
use tessera::tensor::{trace, Generator};
use tessera::{compile, DType, Tensor};

/// The graph of `f` on f32 inputs of `shapes`, after the default passes.
fn optimised(shapes: &[&[usize]], f: impl FnOnce(&[Tensor]) -> Tensor) -> Graph {
    optimised_by(PassManager::default_pipeline(), shapes, f)
}

fn optimised_by(
    passes: PassManager,
    shapes: &[&[usize]],
    f: impl FnOnce(&[Tensor]) -> Tensor,
) -> Graph {
    let inputs: Vec<(String, TensorType)> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("x{i}"), TensorType::new(DType::F32, s.to_vec())))
        .collect();
    let traced = trace::trace("attn", &inputs, |x| Ok(vec![("out".into(), f(x))])).unwrap();
    let mut graph = traced.graph;
    passes.run(&mut graph, &PassContext::default()).unwrap();
    graph
}

/// The `causal` attribute of each flash attention node of `g`.
fn flash_nodes(g: &Graph) -> Vec<bool> {
    g.nodes
        .iter()
        .filter_map(|n| match &n.op {
            Op::Custom(call) if call.name() == FORWARD => call.attrs["causal"].as_bool(),
            _ => None,
        })
        .collect()
}

fn softmaxes(g: &Graph) -> usize {
    g.nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Softmax { .. }))
        .count()
}

/// Each of the 64 slices becomes one op; `batch_attention` then merges
/// them back into one, unless the seed's `strict` hint asks for slices.
#[test]
fn fires_on_the_naive_and_every_slice_of_the_sliced_seed_code() {
    let shape: &[usize] = &[4, 16, 8, 4];
    let shapes = [shape, shape, shape];
    for causal in [false, true] {
        for slices in [1, 64] {
            let f = |x: &[Tensor]| sdpa(&x[0], &x[1], &x[2], causal, slices);
            let per_slice = PassManager::default_pipeline().without("batch_attention");
            let g = optimised_by(per_slice, &shapes, f);
            assert_eq!(
                flash_nodes(&g),
                vec![causal; slices],
                "causal {causal}, {slices} slices:\n{g}"
            );
            assert_eq!(softmaxes(&g), 0, "{g}");
            assert_eq!(flash_nodes(&optimised(&shapes, f)), vec![causal]);
            let hinted =
                |x: &[Tensor]| hints::scope(SEED_HINT, || f(x)).expect("the seed hint is valid");
            assert_eq!(
                flash_nodes(&optimised(&shapes, hinted)),
                vec![causal; slices]
            );
        }
    }
}

fn attention_module(causal: bool) -> MultiHeadAttention {
    let mut store = ParamStore::new();
    MultiHeadAttention::new(&mut store, "attn", 16, 4, causal, &mut Generator::new(7))
}

#[test]
fn fires_on_the_nn_attention_module() {
    for causal in [false, true] {
        let attn = attention_module(causal);
        let g = optimised(&[&[2, 6, 16]], |x| attn.forward(&x[0]));
        assert_eq!(flash_nodes(&g), vec![causal], "{g}");
        assert_eq!(softmaxes(&g), 0, "{g}");
    }
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F32, &mut Generator::new(seed))
}

/// Max |a - b| over all elements.
fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.shape(), b.shape());
    a.to_f64_vec()
        .iter()
        .zip(b.to_f64_vec())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// `f`'s output and the gradients of `sum(out · w)` for the `leaves`.
fn value_and_grads(
    f: &dyn Fn(&[Tensor]) -> Vec<Tensor>,
    args: &[Tensor],
    leaves: &[Tensor],
) -> Vec<Tensor> {
    leaves.iter().for_each(Tensor::zero_grad);
    let out = f(args).remove(0);
    let w = randn(out.shape(), 99);
    (&out * &w).sum(&[], false).backward();
    let mut results = vec![out.detach()];
    results.extend(leaves.iter().map(|l| l.grad().unwrap()));
    results
}

/// Whether the compiled forward runs the op and the backward its backward.
fn runs_the_op(artifacts: &[(String, String)]) -> bool {
    let text = |name: &str| {
        artifacts
            .iter()
            .find(|(n, _)| n == name)
            .map_or(String::new(), |(_, t)| t.clone())
    };
    let (forward, backward) = (text("forward.tir"), text("backward.tir"));
    forward.contains(FORWARD) && backward.contains("tessera::flash_attention_backward")
}

/// f32 values of size O(1) summed over ≤ 16 keys and 8 head dims: the op
/// and the composite differ by a few ulps of the largest terms; 2e-5 is
/// ~100 ulps of 1.
const TOL: f64 = 2e-5;

/// Naive, sliced (merged back into one op) and sliced under the seed's
/// `strict` hint (one op per slice), causal or not.
#[test]
fn compiled_seed_attention_matches_eager_with_gradients() {
    let shape = [2, 4, 16, 8];
    let args: Vec<Tensor> = (0..3)
        .map(|i| randn(&shape, i).set_requires_grad(true))
        .collect();
    let cases = [(1, false), (8, false), (8, true)];
    for causal in [false, true] {
        for (slices, hinted) in cases {
            let f = move |x: &[Tensor]| {
                let out = || sdpa(&x[0], &x[1], &x[2], causal, slices);
                match hinted {
                    true => vec![hints::scope(SEED_HINT, out).unwrap()],
                    false => vec![out()],
                }
            };
            let eager = value_and_grads(&f, &args, &args);
            let fused = compile(f);
            let compiled = value_and_grads(&|x| fused.call(x), &args, &args);
            assert!(runs_the_op(&fused.last_artifacts()));
            for (name, (c, e)) in ["out", "dq", "dk", "dv"]
                .iter()
                .zip(compiled.iter().zip(&eager))
            {
                let d = max_diff(c, e);
                assert!(
                    d < TOL,
                    "causal {causal}, {slices} slices, hinted {hinted}, {name}: {d}"
                );
            }
            let plain = compile(f).fuse_attention(false);
            let _ = value_and_grads(&|x| plain.call(x), &args, &args);
            assert!(!runs_the_op(&plain.last_artifacts()));
        }
    }
}

#[test]
fn compiled_attention_module_matches_eager_with_parameter_gradients() {
    for causal in [false, true] {
        let mut store = ParamStore::new();
        let attn =
            MultiHeadAttention::new(&mut store, "attn", 16, 4, causal, &mut Generator::new(3));
        let x = randn(&[2, 6, 16], 5).set_requires_grad(true);
        let mut leaves = vec![x.clone()];
        leaves.extend(store.parameters().iter().map(|p| p.get()));
        let f = |a: &[Tensor]| vec![attn.forward(&a[0])];
        let eager = value_and_grads(&f, std::slice::from_ref(&x), &leaves);
        let fused = compile(f);
        let compiled = value_and_grads(&|a| fused.call(a), std::slice::from_ref(&x), &leaves);
        assert!(runs_the_op(&fused.last_artifacts()));
        for (i, (c, e)) in compiled.iter().zip(&eager).enumerate() {
            let d = max_diff(c, e);
            assert!(d < TOL, "causal {causal}, result {i}: {d}");
        }
    }
}
