//! The reader on models written here: dynamic dims stay symbolic through a
//! computed reshape, ops read each opset's form of their arguments,
//! unsupported ops come back in one error, bad models name their node.

use tessera::compile::{compile_graph, CompileOptions};
use tessera::tensor::interpret::run_graph;
use tessera::Tensor;
use tessera_onnx::build::{attr_int, attr_ints, f32_tensor, i64_tensor, model, node, value, D};
use tessera_onnx::proto::data_type::FLOAT;
use tessera_onnx::{import, ImportOptions, Model};

/// y = relu(x @ w + b) reshaped to [batch, 4, 5], the batch taken from
/// `Shape(x)` as PyTorch exports it.
fn dynamic_mlp() -> Vec<u8> {
    let w: Vec<f32> = (0..80).map(|i| (i as f32 - 40.0) / 10.0).collect();
    let b: Vec<f32> = (0..20).map(|i| i as f32 / 4.0 - 2.0).collect();
    model(
        13,
        vec![
            node("MatMul", &["x", "w"], &["xw"], vec![]),
            node("Add", &["xw", "b"], &["h"], vec![]),
            node("Relu", &["h"], &["r"], vec![]),
            node("Shape", &["x"], &["s"], vec![]),
            node("Gather", &["s", "zero"], &["n"], vec![attr_int("axis", 0)]),
            node("Unsqueeze", &["n", "axes0"], &["n1"], vec![]),
            node(
                "Concat",
                &["n1", "rest"],
                &["shape"],
                vec![attr_int("axis", 0)],
            ),
            node("Reshape", &["r", "shape"], &["y"], vec![]),
        ],
        vec![value("x", FLOAT, &[D::Param("batch"), D::Size(4)])],
        vec![value(
            "y",
            FLOAT,
            &[D::Param("batch"), D::Size(4), D::Size(5)],
        )],
        vec![
            f32_tensor("w", &[4, 20], &w),
            f32_tensor("b", &[20], &b),
            i64_tensor("zero", &[], &[0]),
            i64_tensor("axes0", &[1], &[0]),
            i64_tensor("rest", &[2], &[4, 5]),
        ],
    )
}

fn reference(x: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * 20];
    for r in 0..n {
        for j in 0..20 {
            let mut acc = j as f32 / 4.0 - 2.0;
            for k in 0..4 {
                acc += x[r * 4 + k] * ((k * 20 + j) as f32 - 40.0) / 10.0;
            }
            out[r * 20 + j] = acc.max(0.0);
        }
    }
    out
}

#[test]
fn a_dynamic_batch_stays_symbolic_and_one_compile_serves_every_size() {
    let m = Model::from_bytes(&dynamic_mlp(), "mlp.onnx").unwrap();
    let imported = import(&m, &ImportOptions::default()).unwrap();
    let g = &imported.graph;
    let x_ty = g.node(g.inputs[0]).ty.to_string();
    assert_eq!(x_ty, "f32[batch,4]");
    let y_ty = g.node(g.outputs[0].node).ty.to_string();
    assert_eq!(y_ty, "f32[batch,4,5]");
    // The 80-element weight is a parameter, the bias a constant.
    assert_eq!(imported.params.len(), 1);
    assert_eq!(imported.params[0].0, "w");
    assert!(imported.specialised.is_empty());
    let compiled = compile_graph(g.clone(), CompileOptions::default()).unwrap();
    for n in [2usize, 3, 2] {
        let xv: Vec<f32> = (0..n * 4).map(|i| (i as f32 * 0.37).sin()).collect();
        let x = Tensor::from_vec(xv.clone(), &[n, 4]);
        let args = imported.inputs(vec![("x".into(), x)]).unwrap();
        let want = reference(&xv, n);
        let interpreted = run_graph(g, &args).unwrap();
        let out = compiled.try_call(&args).unwrap();
        for got in [&interpreted[0].1, &out[0]] {
            assert_eq!(got.shape(), &[n, 4, 5]);
            let v = got.to_vec::<f32>().unwrap();
            for (a, b) in v.iter().zip(&want) {
                assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
            }
        }
    }
}

#[test]
fn unsupported_ops_are_listed_in_one_error() {
    let bytes = model(
        17,
        vec![
            node("Relu", &["x"], &["a"], vec![]),
            node("StringNormalizer", &["a"], &["b"], vec![]),
            node("NonMaxSuppression", &["b"], &["c"], vec![]),
            node("StringNormalizer", &["c"], &["y"], vec![]),
        ],
        vec![value("x", FLOAT, &[D::Size(2)])],
        vec![value("y", FLOAT, &[D::Size(2)])],
        vec![],
    );
    let m = Model::from_bytes(&bytes, "m.onnx").unwrap();
    let e = import(&m, &ImportOptions::default()).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("2 op types without a mapping"), "{msg}");
    assert!(
        msg.contains("StringNormalizer (node `StringNormalizer_b`, `StringNormalizer_y`)"),
        "{msg}"
    );
    assert!(
        msg.contains("NonMaxSuppression (node `NonMaxSuppression_c`)"),
        "{msg}"
    );
}

fn run1(bytes: &[u8], x: Tensor) -> Tensor {
    let m = Model::from_bytes(bytes, "m.onnx").unwrap();
    let imported = import(&m, &ImportOptions::default()).unwrap();
    let args = imported.inputs(vec![("x".into(), x)]).unwrap();
    run_graph(&imported.graph, &args).unwrap().remove(0).1
}

#[test]
fn each_opset_reads_its_own_form_of_an_argument() {
    let x = || Tensor::from_vec((0..6).map(|v| v as f32).collect(), &[1, 2, 3]);
    let io = |out: &[D]| {
        (
            vec![value("x", FLOAT, &[D::Size(1), D::Size(2), D::Size(3)])],
            vec![value("y", FLOAT, out)],
        )
    };
    // Squeeze: axes an attribute in opset 11, an input from 13.
    let (i, o) = io(&[D::Size(2), D::Size(3)]);
    let v11 = model(
        11,
        vec![node(
            "Squeeze",
            &["x"],
            &["y"],
            vec![attr_ints("axes", &[0])],
        )],
        i,
        o,
        vec![],
    );
    let (i, o) = io(&[D::Size(2), D::Size(3)]);
    let v13 = model(
        13,
        vec![node("Squeeze", &["x", "ax"], &["y"], vec![])],
        i,
        o,
        vec![i64_tensor("ax", &[1], &[0])],
    );
    assert_eq!(run1(&v11, x()).shape(), &[2, 3]);
    assert_eq!(run1(&v13, x()).shape(), &[2, 3]);
    // ReduceSum: axes an attribute in 11, an input from 13.
    let (i, o) = io(&[D::Size(1), D::Size(3)]);
    let r11 = model(
        11,
        vec![node(
            "ReduceSum",
            &["x"],
            &["y"],
            vec![attr_ints("axes", &[1]), attr_int("keepdims", 0)],
        )],
        i,
        o,
        vec![],
    );
    let (i, o) = io(&[D::Size(1), D::Size(3)]);
    let r13 = model(
        13,
        vec![node(
            "ReduceSum",
            &["x", "ax"],
            &["y"],
            vec![attr_int("keepdims", 0)],
        )],
        i,
        o,
        vec![i64_tensor("ax", &[1], &[1])],
    );
    for m in [r11, r13] {
        assert_eq!(run1(&m, x()).to_vec::<f32>().unwrap(), vec![3.0, 5.0, 7.0]);
    }
    // Softmax: the input seen as 2-D before 13 (axis 1 covers dims 1 and
    // 2), one axis from 13 on.
    let (i, o) = io(&[D::Size(1), D::Size(2), D::Size(3)]);
    let s11 = model(
        11,
        vec![node("Softmax", &["x"], &["y"], vec![attr_int("axis", 1)])],
        i,
        o,
        vec![],
    );
    let (i, o) = io(&[D::Size(1), D::Size(2), D::Size(3)]);
    let s13 = model(
        13,
        vec![node("Softmax", &["x"], &["y"], vec![attr_int("axis", 1)])],
        i,
        o,
        vec![],
    );
    let whole: f32 = run1(&s11, x()).to_vec::<f32>().unwrap().iter().sum();
    let per_column: f32 = run1(&s13, x()).to_vec::<f32>().unwrap().iter().sum();
    assert!((whole - 1.0).abs() < 1e-5, "{whole}");
    assert!((per_column - 3.0).abs() < 1e-5, "{per_column}");
}

#[test]
fn bad_models_are_errors_naming_the_node() {
    let bytes = model(
        13,
        vec![
            node("Relu", &["x"], &["a"], vec![]),
            node("Reshape", &["a", "shape"], &["y"], vec![]),
        ],
        vec![value("x", FLOAT, &[D::Size(2), D::Size(3)])],
        vec![value("y", FLOAT, &[D::Size(4), D::Size(2)])],
        vec![i64_tensor("shape", &[2], &[4, 2])],
    );
    let m = Model::from_bytes(&bytes, "bad.onnx").unwrap();
    let msg = import(&m, &ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("node `Reshape_y`"), "{msg}");
    assert!(msg.contains("f32[2,3]"), "{msg}");
    assert!(msg.contains("bad.onnx:2"), "{msg}");
    // A shape fed by an input needs its value.
    let bytes = model(
        13,
        vec![node("Reshape", &["x", "s"], &["y"], vec![])],
        vec![
            value("x", FLOAT, &[D::Size(6)]),
            value("s", tessera_onnx::proto::data_type::INT64, &[D::Size(2)]),
        ],
        vec![value("y", FLOAT, &[D::Size(2), D::Size(3)])],
        vec![],
    );
    let m = Model::from_bytes(&bytes, "s.onnx").unwrap();
    let msg = import(&m, &ImportOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("must be known when the model is imported"),
        "{msg}"
    );
    let mut options = ImportOptions::default();
    options.known_inputs.insert(
        "s".into(),
        tessera::ir::Literal {
            dtype: tessera::DType::I64,
            shape: vec![2],
            data: tessera::ir::LiteralData::Int(vec![2, 3]),
        },
    );
    let imported = import(&m, &options).unwrap();
    assert_eq!(imported.specialised, vec!["s".to_string()]);
    assert!(Model::from_bytes(b"not a model", "x.onnx").is_err());
}

#[test]
fn ops_along_a_concrete_dim_take_a_symbolic_batch() {
    // Split (as PyTorch exports q, k, v), Softmax, TopK and CumSum along the
    // last dim of a [batch, 6] input.
    let bytes = model(
        13,
        vec![
            node(
                "Split",
                &["x", "sizes"],
                &["a", "b"],
                vec![attr_int("axis", 1)],
            ),
            node("Softmax", &["b"], &["s"], vec![attr_int("axis", -1)]),
            node("CumSum", &["a", "one"], &["cs"], vec![]),
        ],
        vec![value("x", FLOAT, &[D::Param("batch"), D::Size(6)])],
        vec![
            value("s", FLOAT, &[D::Param("batch"), D::Size(4)]),
            value("cs", FLOAT, &[D::Param("batch"), D::Size(2)]),
        ],
        vec![
            i64_tensor("sizes", &[2], &[2, 4]),
            i64_tensor("one", &[], &[1]),
        ],
    );
    let m = Model::from_bytes(&bytes, "split.onnx").unwrap();
    let imported = import(&m, &ImportOptions::default()).unwrap();
    let g = &imported.graph;
    let tys: Vec<String> = g
        .outputs
        .iter()
        .map(|o| g.node(o.node).ty.to_string())
        .collect();
    assert_eq!(tys, vec!["f32[batch,4]", "f32[batch,2]"]);
    let x = Tensor::from_vec((0..18).map(|v| v as f32).collect(), &[3, 6]);
    let out = run_graph(g, &imported.inputs(vec![("x".into(), x)]).unwrap()).unwrap();
    assert_eq!(
        out[1].1.to_vec::<f32>().unwrap(),
        vec![0., 1., 6., 13., 12., 25.]
    );
}

/// Erf, decomposed (a series near 0, the gelu elsewhere), against libm's
/// f64 erf: within 4 ulp in f32 and f64 over [−6, 6] (tiny values too),
/// NaN and ±∞ handled.
#[test]
fn erf_is_accurate_to_a_few_ulp() {
    use tessera_onnx::proto::data_type::DOUBLE;
    let mut xs: Vec<f64> = (-600..=600).map(|i| i as f64 / 100.0 + 0.003).collect();
    xs.extend([
        0.0, 1e-30, -1e-20, 0.4999, 0.5, 0.5001, -0.5, 3.9, 10.0, 1e10,
    ]);
    for (elem, f32_type) in [(FLOAT, true), (DOUBLE, false)] {
        let n = xs.len() as i64;
        let bytes = model(
            13,
            vec![node("Erf", &["x"], &["y"], vec![])],
            vec![value("x", elem, &[D::Size(n)])],
            vec![value("y", elem, &[D::Size(n)])],
            vec![],
        );
        let m = Model::from_bytes(&bytes, "erf.onnx").unwrap();
        let imported = import(&m, &ImportOptions::default()).unwrap();
        let x = if f32_type {
            Tensor::from_vec(xs.iter().map(|&v| v as f32).collect(), &[xs.len()])
        } else {
            Tensor::from_vec(xs.clone(), &[xs.len()])
        };
        let got = run_graph(&imported.graph, &[x]).unwrap()[0].1.to_f64_vec();
        for (&v, &g) in xs.iter().zip(&got) {
            let (v, want, ulp) = if f32_type {
                let v = v as f32 as f64;
                let w = libm::erf(v) as f32 as f64;
                (
                    v,
                    w,
                    (w.abs() as f32).max(f32::MIN_POSITIVE) as f64 * f32::EPSILON as f64,
                )
            } else {
                let w = libm::erf(v);
                (v, w, w.abs().max(f64::MIN_POSITIVE) * f64::EPSILON)
            };
            assert!((g - want).abs() <= 4.0 * ulp, "erf({v}) = {g}, libm {want}");
        }
        let specials = if f32_type {
            Tensor::from_vec(vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY], &[3])
        } else {
            Tensor::from_vec(vec![f64::NAN, f64::INFINITY, f64::NEG_INFINITY], &[3])
        };
        let bytes = model(
            13,
            vec![node("Erf", &["x"], &["y"], vec![])],
            vec![value("x", elem, &[D::Size(3)])],
            vec![value("y", elem, &[D::Size(3)])],
            vec![],
        );
        let m = Model::from_bytes(&bytes, "erf.onnx").unwrap();
        let g = import(&m, &ImportOptions::default()).unwrap().graph;
        let s = run_graph(&g, &[specials]).unwrap()[0].1.to_f64_vec();
        assert!(s[0].is_nan() && s[1] == 1.0 && s[2] == -1.0, "{s:?}");
    }
}

/// PyTorch's exact GELU, `Div √2 → Erf → Add 1 → Mul x → Mul ½`, becomes
/// tessera's gelu op; with an intermediate also a graph output it stays
/// as written. Both compute the same values.
#[test]
fn the_exported_gelu_chain_becomes_one_gelu() {
    let chain = |extra_output: bool| {
        let mut outputs = vec![value("y", FLOAT, &[D::Size(5)])];
        if extra_output {
            outputs.push(value("e", FLOAT, &[D::Size(5)]));
        }
        model(
            13,
            vec![
                node("Div", &["x", "sqrt2"], &["d"], vec![]),
                node("Erf", &["d"], &["e"], vec![]),
                node("Add", &["e", "one"], &["a"], vec![]),
                node("Mul", &["x", "a"], &["m"], vec![]),
                node("Mul", &["m", "half"], &["y"], vec![]),
            ],
            vec![value("x", FLOAT, &[D::Size(5)])],
            outputs,
            vec![
                f32_tensor("sqrt2", &[], &[std::f32::consts::SQRT_2]),
                f32_tensor("one", &[], &[1.0]),
                f32_tensor("half", &[], &[0.5]),
            ],
        )
    };
    let x = || Tensor::from_vec(vec![-3.0f32, -0.5, 0.0, 0.25, 2.0], &[5]);
    let mut results = Vec::new();
    for extra in [false, true] {
        let m = Model::from_bytes(&chain(extra), "gelu.onnx").unwrap();
        let g = import(&m, &ImportOptions::default()).unwrap().graph;
        let gelus = g.nodes.iter().filter(|n| n.op.name() == "gelu").count();
        let divs = g.nodes.iter().filter(|n| n.op.name() == "div").count();
        if extra {
            assert!(divs > 0, "the chain is kept when `e` is an output:\n{g}");
        } else {
            assert_eq!((gelus, divs), (1, 0), "{g}");
        }
        results.push(run_graph(&g, &[x()]).unwrap()[0].1.to_vec::<f32>().unwrap());
    }
    // Both against x·½·(1 + erf(x/√2)) in f64 (the written chain loses
    // digits to 1 + erf near −3; the gelu op does not).
    for (i, &v) in [-3.0f64, -0.5, 0.0, 0.25, 2.0].iter().enumerate() {
        let want = v * 0.5 * (1.0 + libm::erf(v / std::f64::consts::SQRT_2));
        let (fused, chain) = (results[0][i] as f64, results[1][i] as f64);
        assert!(
            (fused - want).abs() <= 1e-6 * want.abs().max(1e-6),
            "{fused} vs {want}"
        );
        assert!(
            (chain - want).abs() <= 1e-5 * want.abs().max(1e-6),
            "{chain} vs {want}"
        );
    }
}

/// Single-node models with inputs of the wrong rank or attributes out of
/// range: each import is an error naming the op and the node, never a
/// panic.
#[test]
fn malformed_nodes_are_errors_not_panics() {
    let x = || vec![value("x", FLOAT, &[D::Size(2), D::Size(3)])];
    let y = || vec![value("y", FLOAT, &[D::Size(2), D::Size(3)])];
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "LSTM",
            model(
                17,
                vec![node(
                    "LSTM",
                    &["x", "x", "x"],
                    &["y"],
                    vec![attr_int("hidden_size", 3)],
                )],
                x(),
                y(),
                vec![],
            ),
        ),
        (
            "GRU",
            model(
                17,
                vec![node("GRU", &["x", "x", "x"], &["y"], vec![])],
                x(),
                y(),
                vec![],
            ),
        ),
        (
            "GridSample",
            model(
                17,
                vec![node("GridSample", &["x", "x"], &["y"], vec![])],
                x(),
                y(),
                vec![],
            ),
        ),
        (
            "RotaryEmbedding",
            model(
                23,
                vec![node("RotaryEmbedding", &["x", "x", "x"], &["y"], vec![])],
                x(),
                y(),
                vec![],
            ),
        ),
        (
            "InstanceNormalization",
            model(
                17,
                vec![node(
                    "InstanceNormalization",
                    &["x", "s", "s"],
                    &["y"],
                    vec![],
                )],
                vec![value("x", FLOAT, &[D::Size(1), D::Size(2), D::Size(3)])],
                y(),
                vec![f32_tensor("s", &[], &[1.0])],
            ),
        ),
        (
            "Transpose",
            model(
                17,
                vec![node(
                    "Transpose",
                    &["x"],
                    &["y"],
                    vec![attr_ints("perm", &[0, 5])],
                )],
                x(),
                y(),
                vec![],
            ),
        ),
        (
            "Softmax",
            model(
                17,
                vec![node("Softmax", &["x"], &["y"], vec![attr_int("axis", 7)])],
                x(),
                y(),
                vec![],
            ),
        ),
        (
            "Attention",
            model(
                23,
                vec![node("Attention", &["x", "x", "x"], &["y"], vec![])],
                x(),
                y(),
                vec![],
            ),
        ),
        (
            "DFT",
            model(
                20,
                vec![node("DFT", &["x"], &["y"], vec![])],
                x(),
                y(),
                vec![],
            ),
        ),
    ];
    for (op, bytes) in cases {
        let m = Model::from_bytes(&bytes, "bad.onnx").unwrap();
        let e = import(&m, &ImportOptions::default()).expect_err(op);
        let msg = e.to_string();
        assert!(
            msg.contains(op) && msg.contains("bad.onnx:1"),
            "{op}: {msg}"
        );
        assert!(!msg.contains("internal error"), "{op}: {msg}");
    }
}

/// Conv (SAME_LOWER, stride 2) → BatchNormalization → Relu → MaxPool
/// (per-side pads, ceil mode) → AveragePool (dilated, padding not
/// counted) on `[batch, 3, 9, 9]`.
fn small_cnn() -> Vec<u8> {
    let w: Vec<f32> = (0..108)
        .map(|i| ((i * 37 % 17) as f32 - 8.0) / 20.0)
        .collect();
    let per = |k: f32| -> Vec<f32> { (0..4).map(|c| k + c as f32 / 8.0).collect() };
    model(
        13,
        vec![
            node(
                "Conv",
                &["x", "w", "b"],
                &["c"],
                vec![
                    attr_ints("strides", &[2, 2]),
                    tessera_onnx::build::attr_string("auto_pad", "SAME_LOWER"),
                ],
            ),
            node(
                "BatchNormalization",
                &["c", "scale", "bias", "mean", "var"],
                &["n"],
                vec![],
            ),
            node("Relu", &["n"], &["r"], vec![]),
            node(
                "MaxPool",
                &["r"],
                &["m"],
                vec![
                    attr_ints("kernel_shape", &[3, 3]),
                    attr_ints("strides", &[2, 2]),
                    attr_ints("pads", &[0, 1, 1, 0]),
                    attr_int("ceil_mode", 1),
                ],
            ),
            node(
                "AveragePool",
                &["m"],
                &["y"],
                vec![
                    attr_ints("kernel_shape", &[2, 2]),
                    attr_ints("dilations", &[2, 2]),
                    attr_ints("pads", &[1, 1, 1, 1]),
                ],
            ),
        ],
        vec![value(
            "x",
            FLOAT,
            &[D::Param("batch"), D::Size(3), D::Size(9), D::Size(9)],
        )],
        vec![value(
            "y",
            FLOAT,
            &[D::Param("batch"), D::Size(4), D::Size(3), D::Size(3)],
        )],
        vec![
            f32_tensor("w", &[4, 3, 3, 3], &w),
            f32_tensor("b", &[4], &per(-0.1)),
            f32_tensor("scale", &[4], &per(0.9)),
            f32_tensor("bias", &[4], &per(0.05)),
            f32_tensor("mean", &[4], &per(-0.2)),
            f32_tensor("var", &[4], &per(0.7)),
        ],
    )
}

#[test]
fn a_cnn_with_a_symbolic_batch_serves_every_size() {
    let m = Model::from_bytes(&small_cnn(), "cnn.onnx").unwrap();
    let imported = import(&m, &ImportOptions::default()).unwrap();
    let g = &imported.graph;
    assert_eq!(g.node(g.outputs[0].node).ty.to_string(), "f32[batch,4,3,3]");
    let compiled = compile_graph(g.clone(), CompileOptions::default()).unwrap();
    let sample = |s: usize| -> Vec<f32> {
        (0..243)
            .map(|i| (((i + 97 * s) as f32) * 0.61).sin())
            .collect()
    };
    let mut alone = Vec::new();
    for s in 0..2 {
        let x = Tensor::from_vec(sample(s), &[1, 3, 9, 9]);
        let args = imported.inputs(vec![("x".into(), x)]).unwrap();
        let y = compiled.try_call(&args).unwrap().remove(0);
        let want = run_graph(g, &args).unwrap().remove(0).1;
        let (a, b) = (y.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
        for (p, q) in a.iter().zip(&b) {
            assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "{p} vs {q}");
        }
        assert!(b.iter().any(|v| *v != 0.0));
        alone.extend(b);
    }
    // Both samples in one batch: each as alone.
    let x = Tensor::from_vec([sample(0), sample(1)].concat(), &[2, 3, 9, 9]);
    let args = imported.inputs(vec![("x".into(), x)]).unwrap();
    let y = compiled.try_call(&args).unwrap().remove(0);
    assert_eq!(y.shape(), &[2, 4, 3, 3]);
    for (p, q) in y.to_vec::<f32>().unwrap().iter().zip(&alone) {
        assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "{p} vs {q}");
    }
}

#[test]
fn cnn_ops_outside_what_maps_are_errors_naming_the_node() {
    let x4 = |batch: D| {
        vec![value(
            "x",
            FLOAT,
            &[batch, D::Size(2), D::Size(4), D::Size(4)],
        )]
    };
    let import_err = |bytes: Vec<u8>| {
        let m = Model::from_bytes(&bytes, "cnn.onnx").unwrap();
        import(&m, &ImportOptions::default())
            .unwrap_err()
            .to_string()
    };
    // MaxPool's flat Indices count across the batch: a symbolic one cannot.
    let msg = import_err(model(
        13,
        vec![node(
            "MaxPool",
            &["x"],
            &["y", "i"],
            vec![attr_ints("kernel_shape", &[2, 2])],
        )],
        x4(D::Param("batch")),
        vec![],
        vec![],
    ));
    assert!(msg.contains("node `MaxPool_y`"), "{msg}");
    assert!(msg.contains("concrete batch"), "{msg}");
    assert!(msg.contains("f32[batch,2,4,4]"), "{msg}");
    // Pads of the wrong length.
    let msg = import_err(model(
        13,
        vec![node(
            "Conv",
            &["x", "w"],
            &["y"],
            vec![attr_ints("pads", &[1, 1])],
        )],
        x4(D::Size(1)),
        vec![],
        vec![f32_tensor("w", &[3, 2, 3, 3], &[0.5; 54])],
    ));
    assert!(
        msg.contains("node `Conv_y`") && msg.contains("`pads`"),
        "{msg}"
    );
    assert!(msg.contains("[1, 1]"), "{msg}");
    // A window larger than the padded input.
    let msg = import_err(model(
        13,
        vec![node(
            "AveragePool",
            &["x"],
            &["y"],
            vec![attr_ints("kernel_shape", &[5, 5])],
        )],
        x4(D::Size(1)),
        vec![],
        vec![],
    ));
    assert!(
        msg.contains("node `AveragePool_y`") && msg.contains("larger than the padded input"),
        "{msg}"
    );
}
