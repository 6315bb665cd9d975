//! Differential tests of the graph passes: random valid graphs are run by
//! the interpreter before and after each pass alone, after the default
//! pipeline, and after the default pipeline with `decompose`, under the
//! default context and with `unsafe_math`; the outputs must agree.
//!
//! Every graph is built in f32 and, op for op, in f64. A pass may change
//! rounding (reassociation, decomposition), so each dtype is compared with
//! its own tolerance: the f64 check is tight (|Δ| ≤ 1e-8·(1 + |before|))
//! and catches any rewrite that is more than a rounding change; the f32
//! check (|Δ| ≤ 2e-3·(1 + |before|)) catches dtype-specific mistakes.
//! Graphs whose f64 values (any node's) are not finite or exceed 1e3 in
//! magnitude are discarded, so rounding stays small next to the tolerance
//! and no overflow can make a legal reassociation look wrong.
//!
//! The generator mixes all op families (elementwise with broadcasting,
//! reductions, softmax, matmul, reshape/permute/slice/cat/expand,
//! constants) with the patterns the passes look for (`x+x+x`, constant
//! chains, common factors, broadcast pairs, transposed matmul operands,
//! identity views, attention whole or per slice), some nodes carrying
//! hints. The attention pass does not fire on f64 graphs (the flash
//! attention op computes in f32 and up), so it is checked by the f32
//! comparison; causal attention has `-inf` scores, which the tameness
//! filter below discards (`tests/attention_pass.rs` checks its values). A second test checks that
//! every pass actually fires on these graphs.

use std::collections::HashMap;

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use tessera::ir::{NodeId, Op};
use tessera::passes::{self, PassContext, PassManager};

mod graph_gen;
use graph_gen::*;

fn compare(
    what: &str,
    before: &[(String, Vec<f64>)],
    after: &[(String, Vec<f64>)],
    rel: f64,
) -> std::result::Result<(), String> {
    for ((name, b), (name2, a)) in before.iter().zip(after) {
        if name != name2 || a.len() != b.len() {
            return Err(format!("{what}: output {name} changed shape or name"));
        }
        for (i, (x, y)) in b.iter().zip(a).enumerate() {
            if (x - y).abs() > rel * (1.0 + x.abs()) {
                return Err(format!("{what}: output {name}[{i}]: {x} before, {y} after"));
            }
        }
    }
    Ok(())
}

/// Every configuration under test: one pass alone, the default pipeline,
/// and the default pipeline with decomposition.
fn configurations() -> Vec<(String, PassManager)> {
    let mut out: Vec<(String, PassManager)> = passes::ALL
        .iter()
        .map(|p| (p.name.to_string(), PassManager::new(vec![*p])))
        .collect();
    out.push(("default".into(), PassManager::default_pipeline()));
    out.push((
        "default,decompose".into(),
        PassManager::from_names("default,decompose").unwrap(),
    ));
    out
}

fn contexts() -> [(&'static str, PassContext); 2] {
    let unsafe_math = PassContext {
        unsafe_math: true,
        ..PassContext::default()
    };
    [
        ("default", PassContext::default()),
        ("unsafe_math", unsafe_math),
    ]
}

fn check(spec: &Spec, seed: u64) -> std::result::Result<(), TestCaseError> {
    let g32 = build(spec);
    let g64 = in_f64(&g32);
    let (in32, in64) = (inputs(&g32, seed), inputs(&g64, seed));
    prop_assume!(tame(&g64, &in64, 1e3));
    let (ref32, ref64) = (run(&g32, &in32), run(&g64, &in64));
    for (name, pm) in configurations() {
        for (ctx_name, ctx) in contexts() {
            for (g, inputs, reference, tol) in
                [(&g64, &in64, &ref64, 1e-8), (&g32, &in32, &ref32, 2e-3)]
            {
                let mut opt = g.clone();
                pm.run(&mut opt, &ctx)
                    .map_err(|e| TestCaseError::fail(format!("{name}: {e}\n{g}")))?;
                let what = format!("{name} under {ctx_name}");
                compare(&what, reference, &run(&opt, inputs), tol).map_err(|e| {
                    TestCaseError::fail(format!("{e}\nbefore:\n{g}\nafter:\n{opt}"))
                })?;
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        max_global_rejects: 4096,
        ..ProptestConfig::default()
    })]

    #[test]
    fn passes_preserve_values(spec in spec_strategy(), seed in any::<u64>()) {
        check(&spec, seed)?;
    }
}

/// Under [`PassContext::exact`] the default pipeline promises results
/// identical bit for bit (NaN and the sign of zero included) in f32.
fn check_exact(spec: &Spec, seed: u64) -> std::result::Result<(), TestCaseError> {
    let g = build(spec);
    let inputs = inputs(&g, seed);
    let before = run(&g, &inputs);
    let mut opt = g.clone();
    PassManager::default_pipeline()
        .run(&mut opt, &PassContext::exact())
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let after = run(&opt, &inputs);
    // gemm's summation order depends on its operands' strides, and passes
    // may change a matmul operand's layout (a folded constant is dense where
    // the original was a transposed view): matmul results may then differ
    // in the last bits (a few f32 ulps of the result scale). Everything
    // else must be bit-identical.
    let has_matmul = g
        .nodes
        .iter()
        .any(|n| matches!(n.op, Op::MatMul | Op::MatMulT { .. }));
    for ((name, b), (_, a)) in before.iter().zip(&after) {
        let close = |x: f64, y: f64| {
            x.to_bits() == y.to_bits()
                || (x.is_nan() && y.is_nan())
                || (has_matmul && (x - y).abs() <= 4.0 * f32::EPSILON as f64 * (1.0 + x.abs()))
        };
        let same = b.len() == a.len() && b.iter().zip(a).all(|(x, y)| close(*x, *y));
        prop_assert!(
            same,
            "output {name}: {b:?} before, {a:?} after\nbefore:\n{g}\nafter:\n{opt}"
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn exact_passes_preserve_bits(spec in spec_strategy(), seed in any::<u64>()) {
        check_exact(&spec, seed)?;
    }
}

/// The differential test means something only if the passes fire on the
/// generated graphs: over a fixed sample, each must change some graph.
#[test]
fn every_pass_fires_on_generated_graphs() {
    let mut runner = TestRunner::deterministic();
    let strategy = spec_strategy();
    let mut fired: HashMap<&str, usize> = HashMap::new();
    let unsafe_math = PassContext {
        unsafe_math: true,
        ..PassContext::default()
    };
    for _ in 0..200 {
        let g = build(&strategy.new_tree(&mut runner).unwrap().current());
        for pass in passes::ALL {
            let mut h = g.clone();
            // `batch_attention` merges what `attention` makes of live
            // per-slice attention: run that first, every `cat` an output.
            if pass.name == "batch_attention" {
                for i in 0..h.len() {
                    if matches!(h.nodes[i].op, Op::Cat { .. }) {
                        h.add_output(format!("cat{i}"), NodeId(i as u32));
                    }
                }
                passes::attention::run(&mut h, &unsafe_math).unwrap();
            }
            if (pass.run)(&mut h, &unsafe_math).unwrap() {
                *fired.entry(pass.name).or_default() += 1;
            }
        }
    }
    // `slice` rewrites only regions hinted `slice` (tests/hints_memory.rs
    // and its unit tests); generated graphs carry no hints. The generator
    // makes no convolutions: `conv_epilogue` has its own differential test
    // below (and tests/cnn_fusion.rs, compiled against eager).
    for pass in passes::ALL
        .iter()
        .filter(|p| p.name != "slice" && p.name != "conv_epilogue")
    {
        let n = fired.get(pass.name).copied().unwrap_or(0);
        assert!(n > 0, "{} never fired: {fired:?}", pass.name);
    }
    eprintln!("graphs changed per pass, of 200: {fired:?}");
}

/// `conv_epilogue` on every combination of a per-channel scale, a bias
/// and a ReLU after a convolution (with and without its own bias): the
/// pass fires, leaves one convolution, and the interpreter's results
/// before and after agree (exactly, but for the scale, which rounds
/// differently folded into the weights, and a bias added to a conv's own).
#[test]
fn conv_epilogue_keeps_values() {
    use tessera::ir::text::parse;
    use tessera::tensor::interpret::run_graph;
    use tessera::tensor::Generator;
    use tessera::{DType, Tensor};
    let attrs = r#"{op="tessera::conv2d", attrs="{\"activation\":\"none\",\"dilation\":[1,2],\"groups\":2,\"padding\":[1,0,1,2],\"stride\":[2,1]}"}"#;
    for mode in 0..16u8 {
        let bias = mode & 8 != 0;
        let mut text = String::from(
            "graph g(%x, %w, %b, %s, %t) {\n  %x = input : f32[2,4,7,6]\n  %w = input : f32[6,2,3,3]\n  %b = input : f32[6]\n  %s = input : f32[6]\n  %t = input : f32[6]\n",
        );
        let operands = if bias { "%x, %w, %b" } else { "%x, %w" };
        text.push_str(&format!(
            "  %y = custom({operands}) {attrs} : f32[2,6,3,5]\n"
        ));
        let mut last = "%y".to_string();
        if mode & 4 != 0 {
            text.push_str("  %s4 = reshape(%s) {shape=[1,6,1,1]} : f32[1,6,1,1]\n");
            text.push_str(&format!("  %m = mul({last}, %s4) : f32[2,6,3,5]\n"));
            last = "%m".into();
        }
        if mode & 1 != 0 {
            text.push_str("  %t4 = reshape(%t) {shape=[1,6,1,1]} : f32[1,6,1,1]\n");
            text.push_str(&format!("  %a = add(%t4, {last}) : f32[2,6,3,5]\n"));
            last = "%a".into();
        }
        if mode & 2 != 0 {
            text.push_str(&format!("  %r = relu({last}) : f32[2,6,3,5]\n"));
            last = "%r".into();
        }
        text.push_str(&format!("  return {last} as out\n}}"));
        let g = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let mut h = g.clone();
        let fired = passes::conv_epilogue::run(&mut h, &PassContext::default()).unwrap();
        let folds = mode & 7 != 0;
        assert_eq!(fired, folds, "mode {mode}:\n{h}");
        let remaining = h
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Custom(_)))
            .count();
        assert_eq!(remaining, 1, "mode {mode}:\n{h}");
        let on_activations = h
            .nodes
            .iter()
            .filter(|n| {
                !matches!(n.op, Op::Custom(_)) && n.ty.shape.as_concrete() == Some(vec![2, 6, 3, 5])
            })
            .count();
        assert_eq!(
            on_activations, 0,
            "an op on the activations is left, mode {mode}:\n{h}"
        );
        let mut gen = Generator::new(u64::from(mode));
        let inputs: Vec<Tensor> = g
            .inputs
            .iter()
            .map(|&id| {
                Tensor::randn(
                    &g.node(id).ty.shape.as_concrete().unwrap(),
                    DType::F32,
                    &mut gen,
                )
            })
            .collect();
        let before = run_graph(&g, &inputs).unwrap();
        let after = run_graph(&h, &inputs).unwrap();
        // The scale rounds differently folded into the weights, and a
        // second bias is summed with the first before it is added.
        let regrouped = mode & 4 != 0 || (bias && mode & 1 != 0);
        let tol = if regrouped { 1e-5 } else { 0.0 };
        for ((_, a), (_, b)) in before.iter().zip(&after) {
            for (x, y) in a.to_f64_vec().iter().zip(b.to_f64_vec()) {
                assert!(
                    (x - y).abs() <= tol * (1.0 + x.abs()),
                    "mode {mode}: {x} vs {y}"
                );
            }
        }
    }
}
