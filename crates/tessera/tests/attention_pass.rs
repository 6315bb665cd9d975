//! The attention pass (`passes::attention`) on the code users write: the
//! seed's naive and sliced attention, causal or not, and
//! `nn::MultiHeadAttention`; and compiled results and gradients (with the
//! pass) against eager ones (without it).

use tessera::custom_op::flash_attention::FORWARD;
use tessera::hints;
use tessera::ir::{Graph, Op, TensorType};
use tessera::nn::{MultiHeadAttention, ParamStore};
use tessera::passes::{PassContext, PassManager};
use tessera::tensor::{trace, Generator};
use tessera::{compile, DType, Tensor};
use tessera_apps::seed_table::{sdpa, SEED_HINT};

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
/// them back into one, under the seed's `strict` hint too (one call holds
/// no more than the slices at their `cat`: see `passes::batch_attention`).
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
            assert_eq!(flash_nodes(&optimised(&shapes, hinted)), vec![causal]);
        }
    }
}

/// The seed's sliced attention with slice `i` under `hint_of(i)`, the
/// split and the concatenation under `hint_of(0)`.
fn sliced_under(x: &[Tensor], slices: usize, hint_of: &dyn Fn(usize) -> String) -> Tensor {
    let scale = 1.0 / (x[0].shape()[3] as f64).sqrt();
    let split =
        |t: &Tensor| hints::scope(&hint_of(0), || t.flatten(0, 1).tensor_split(slices, 0)).unwrap();
    let (qs, ks, vs) = (split(&x[0]), split(&x[1]), split(&x[2]));
    let outs: Vec<Tensor> = (0..slices)
        .map(|i| {
            hints::scope(&hint_of(i), || {
                (qs[i].matmul(&ks[i].transpose(-2, -1)) * scale)
                    .softmax(-1)
                    .matmul(&vs[i])
            })
            .unwrap()
        })
        .collect();
    let refs: Vec<&Tensor> = outs.iter().collect();
    hints::scope(&hint_of(0), || Tensor::cat(&refs, 0)).unwrap()
}

/// Under `strict` hints, slices of two groups stay one op per slice, and
/// so do those of one group under a memory budget one call would exceed.
#[test]
fn strict_slices_of_two_groups_or_over_a_budget_stay_per_slice() {
    let shape: &[usize] = &[2, 4, 8, 4];
    let shapes = [shape, shape, shape];
    let two_groups = |i: usize| format!(r#"{{"order": "strict", "group_id": {}}}"#, i % 2);
    let g = optimised(&shapes, |x| sliced_under(x, 8, &two_groups));
    assert_eq!(flash_nodes(&g), vec![false; 8], "{g}");
    let one_group = |_| r#"{"order": "strict", "group_id": 0}"#.to_string();
    let g = optimised(&shapes, |x| sliced_under(x, 8, &one_group));
    assert_eq!(flash_nodes(&g), vec![false], "{g}");
    let g = optimised(&shapes, |x| sliced_under(x, 8, &|_| TIGHT.to_string()));
    assert_eq!(flash_nodes(&g), vec![false; 8], "{g}");
}

/// The seed's hint with a memory budget (1 byte) that one call over every
/// slice exceeds: `batch_attention` keeps the slices.
const TIGHT: &str =
    r#"{"order": "strict", "group_id": 0, "backward_group_id": 1, "memory_budget_mb": 0.000001}"#;

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

/// Under bf16/f16 autocast the module calls the flash op itself (so a
/// backward traced through it, as `compile::train_step` does, gets the op's
/// backward); in f32 it writes plain ops, which the pass may rewrite.
#[test]
fn the_module_calls_the_flash_op_in_half_precision_and_plain_ops_in_f32() {
    for causal in [false, true] {
        let attn = attention_module(causal);
        let traced = |dtype: Option<DType>| {
            let inputs = [("x".to_string(), TensorType::new(DType::F32, vec![2, 6, 16]))];
            trace::trace("attn", &inputs, |x| {
                let y = match dtype {
                    Some(d) => tessera::autocast(d, || attn.forward(&x[0])),
                    None => attn.forward(&x[0]),
                };
                Ok(vec![("out".into(), y)])
            })
            .unwrap()
            .graph
        };
        for half in [DType::BF16, DType::F16] {
            let g = traced(Some(half));
            assert_eq!(flash_nodes(&g), vec![causal], "{half}: {g}");
            assert_eq!(softmaxes(&g), 0, "{half}: {g}");
        }
        let g = traced(None);
        assert!(flash_nodes(&g).is_empty(), "f32: {g}");
        assert_eq!(softmaxes(&g), 1, "f32: {g}");
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
/// `strict` hint (merged too), causal or not.
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

/// The flash attention ops in a compiled function's last forward.
fn forward_flash_ops(artifacts: &[(String, String)]) -> usize {
    artifacts
        .iter()
        .find(|(n, _)| n == "forward.tir")
        .map_or(0, |(_, t)| t.matches(&format!(r#"op="{FORWARD}""#)).count())
}

/// Differential: the seed's hinted sliced code merged into one call equals
/// the same code kept per slice (by a budget one call exceeds), output and
/// gradients, causal or not. The op computes each row from the same
/// operands whatever the batch, so the results are identical.
#[test]
fn merged_strict_slices_equal_the_per_slice_graph() {
    let shape = [2, 4, 16, 8];
    let args: Vec<Tensor> = (0..3)
        .map(|i| randn(&shape, 10 + i).set_requires_grad(true))
        .collect();
    for causal in [false, true] {
        let under = |hint: &'static str| {
            move |x: &[Tensor]| {
                vec![hints::scope(hint, || sdpa(&x[0], &x[1], &x[2], causal, 8)).unwrap()]
            }
        };
        let merged = compile(under(SEED_HINT));
        let per_slice = compile(under(TIGHT));
        let a = value_and_grads(&|x| merged.call(x), &args, &args);
        let b = value_and_grads(&|x| per_slice.call(x), &args, &args);
        assert_eq!(forward_flash_ops(&merged.last_artifacts()), 1);
        assert_eq!(forward_flash_ops(&per_slice.last_artifacts()), 8);
        for (name, (x, y)) in ["out", "dq", "dk", "dv"].iter().zip(a.iter().zip(&b)) {
            assert_eq!(max_diff(x, y), 0.0, "causal {causal}, {name}");
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
