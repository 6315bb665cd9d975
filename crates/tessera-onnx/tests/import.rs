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
