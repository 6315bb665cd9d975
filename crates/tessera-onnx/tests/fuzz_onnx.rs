//! Fuzzing the ONNX importer (with the runner of tessera's own fuzz
//! targets, `crates/tessera/tests/fuzz/support.rs`: each case in a child
//! process under an address-space limit, crashes reported with their case).
//!
//! Inputs: small random models — one to three nodes of ops tessera maps,
//! wired to graph inputs of random shapes (empty, scalar, symbolic) and to
//! initializers (float and int64, their data sometimes the wrong length),
//! with random attributes, extreme values among them (0, -1, huge,
//! `i64::MIN`) — and the committed light SqueezeNet with one node's
//! attribute, a dim or an initializer damaged; and, for each, the encoded
//! bytes sometimes cut or flipped.
//!
//! Properties, for any input:
//! - `Model::from_bytes` and `import` return (a graph or an error): no panic,
//!   no abort; an error never says "internal error" (a mapping's panic,
//!   caught: a bug);
//! - an imported graph whose inputs are concrete and small runs in the
//!   interpreter (the path of `tessera run --interpret`) to a value or an
//!   error, and compiled (`tessera run`'s default) to the same outcome: both
//!   values, equal (floats within 1e-4, NaN where NaN), or both errors.
//!
//! CI runs a fixed seed and 50,000 cases (about 8 s); longer runs as for tessera's
//! targets, e.g.
//! `TESSERA_FUZZ_SECONDS=600 TESSERA_FUZZ_SEED=random cargo test --release -p tessera-onnx --test fuzz_onnx -- --nocapture`.

#[path = "../../tessera/tests/fuzz/support.rs"]
#[allow(dead_code)]
mod support;

use prost::Message;
use support::{Rng, Target};
use tessera::compile::{compile_graph, CompileOptions};
use tessera::tensor::interpret::run_graph;
use tessera::tensor::Generator;
use tessera::{DType, Tensor};
use tessera_onnx::build::{attr_float, attr_int, attr_ints, attr_string, node, value, D};
use tessera_onnx::proto::data_type::{
    BOOL, DOUBLE, FLOAT, FLOAT16, INT32, INT64, INT8, UINT16, UINT64, UINT8,
};
use tessera_onnx::proto::{ModelProto, TensorProto};
use tessera_onnx::{import, ImportOptions, Model};

#[test]
fn onnx_importer() {
    support::fuzz(Target {
        test: "onnx_importer",
        ci_cases: 50_000,
        generate,
        check: |bytes| check(bytes),
        show: |bytes| hex(bytes),
    });
}

/// Ops tessera maps (a sample across its families).
const OPS: &[&str] = &[
    "Abs",
    "Acos",
    "Add",
    "And",
    "ArgMax",
    "ArgMin",
    "AveragePool",
    "BatchNormalization",
    "BitCast",
    "BitShift",
    "BitwiseAnd",
    "BitwiseNot",
    "BitwiseXor",
    "Cast",
    "Ceil",
    "Clip",
    "Concat",
    "Constant",
    "ConstantOfShape",
    "Conv",
    "ConvTranspose",
    "Cos",
    "CumSum",
    "DepthToSpace",
    "DequantizeLinear",
    "Div",
    "Dropout",
    "DynamicQuantizeLinear",
    "Einsum",
    "Elu",
    "Equal",
    "Erf",
    "Exp",
    "Expand",
    "EyeLike",
    "Flatten",
    "Floor",
    "Gather",
    "GatherElements",
    "GatherND",
    "Gelu",
    "Gemm",
    "GlobalAveragePool",
    "GlobalMaxPool",
    "Greater",
    "GroupNormalization",
    "HardSigmoid",
    "Hardmax",
    "Identity",
    "InstanceNormalization",
    "IsInf",
    "IsNaN",
    "LRN",
    "LayerNormalization",
    "LeakyRelu",
    "Less",
    "Log",
    "LogSoftmax",
    "LpNormalization",
    "LpPool",
    "MatMul",
    "MatMulInteger",
    "Max",
    "MaxPool",
    "Mean",
    "Min",
    "Mod",
    "Mul",
    "Neg",
    "Not",
    "OneHot",
    "Or",
    "Pad",
    "Pow",
    "PRelu",
    "QLinearMatMul",
    "QuantizeLinear",
    "Range",
    "Reciprocal",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSumExp",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
    "ReduceProd",
    "ReduceSum",
    "ReduceSumSquare",
    "Relu",
    "Reshape",
    "Resize",
    "ScatterElements",
    "ScatterND",
    "Selu",
    "Shape",
    "Sigmoid",
    "Sign",
    "Sin",
    "Size",
    "Slice",
    "Softmax",
    "Softplus",
    "Softsign",
    "SpaceToDepth",
    "Split",
    "Sqrt",
    "Squeeze",
    "Sub",
    "Sum",
    "Tanh",
    "Tile",
    "TopK",
    "Transpose",
    "Trilu",
    "Unsqueeze",
    "Upsample",
    "Where",
    "Xor",
];

const INT_ATTRS: &[&str] = &[
    "axis",
    "keepdims",
    "group",
    "transA",
    "transB",
    "to",
    "blocksize",
    "upper",
    "exclusive",
    "reverse",
    "ceil_mode",
    "count_include_pad",
    "storage_order",
    "select_last_index",
    "largest",
    "sorted",
    "p",
    "size",
    "num_groups",
    "stash_type",
    "noop_with_empty_axes",
    "allowzero",
];
const INTS_ATTRS: &[&str] = &[
    "axes",
    "perm",
    "kernel_shape",
    "strides",
    "pads",
    "dilations",
    "output_padding",
    "output_shape",
    "shape",
    "starts",
    "ends",
    "split",
];
const FLOAT_ATTRS: &[&str] = &[
    "alpha", "beta", "gamma", "epsilon", "momentum", "bias", "min", "max",
];
const STRING_ATTRS: &[(&str, &[&str])] = &[
    (
        "auto_pad",
        &["NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID", "BOGUS"],
    ),
    (
        "mode",
        &[
            "constant", "reflect", "edge", "nearest", "linear", "cubic", "DCR", "CRD", "x",
        ],
    ),
    (
        "equation",
        &["ij,jk->ik", "i,i->", "ii->i", "ab->ba", "...", ""],
    ),
    (
        "coordinate_transformation_mode",
        &["half_pixel", "asymmetric", "align_corners"],
    ),
];

/// An integer, mostly small, sometimes extreme.
fn int(rng: &mut Rng) -> i64 {
    match rng.below(10) {
        0 => *rng.pick(&[
            i64::MIN,
            i64::MAX,
            -1,
            0,
            1 << 40,
            -(1 << 40),
            i32::MAX as i64,
        ]),
        1 => rng.between(-8, -1),
        _ => rng.between(0, 5),
    }
}

fn float(rng: &mut Rng) -> f32 {
    match rng.below(8) {
        0 => *rng.pick(&[
            f32::NAN,
            f32::INFINITY,
            -f32::INFINITY,
            0.0,
            -0.0,
            1e30,
            -1e-30,
        ]),
        _ => (rng.f64() * 4.0 - 2.0) as f32,
    }
}

fn dims(rng: &mut Rng) -> Vec<i64> {
    (0..rng.below(5))
        .map(|_| match rng.below(12) {
            0 => 0,
            1 => int(rng),
            _ => rng.between(1, 4),
        })
        .collect()
}

/// A random small model's encoded bytes, or a damaged light SqueezeNet.
fn generate(rng: &mut Rng) -> Vec<u8> {
    let mut bytes = match rng.below(6) {
        0 => damaged_squeezenet(rng),
        _ => random_model(rng),
    };
    match rng.below(12) {
        0 if !bytes.is_empty() => {
            let n = rng.below(bytes.len());
            bytes.truncate(n);
        }
        1 if !bytes.is_empty() => {
            for _ in 0..=rng.below(4) {
                let at = rng.below(bytes.len());
                bytes[at] ^= 1 << rng.below(8);
            }
        }
        _ => {}
    }
    bytes
}

/// Float ops by arity, for well-formed chains (most of which import, so
/// that the interpreter and the compiler are compared on them).
const UNARY: &[&str] = &[
    "Abs",
    "Atan",
    "Asin",
    "Ceil",
    "Cos",
    "Elu",
    "Erf",
    "Exp",
    "Floor",
    "Gelu",
    "HardSigmoid",
    "Identity",
    "LeakyRelu",
    "Log",
    "Neg",
    "Reciprocal",
    "Relu",
    "Selu",
    "Sigmoid",
    "Sign",
    "Sin",
    "Softplus",
    "Softsign",
    "Sqrt",
    "Tanh",
    "Softmax",
    "LogSoftmax",
    "Hardmax",
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL2",
    "ReduceLogSumExp",
    "Transpose",
    "Flatten",
    "IsNaN",
    "IsInf",
    "Not",
    "GlobalAveragePool",
    "LpNormalization",
    "InstanceNormalization",
    "ArgMax",
    "ArgMin",
    "Dropout",
];
const BINARY: &[&str] = &[
    "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mean", "Sum", "MatMul", "PRelu", "Greater",
    "Less", "Equal", "Mod",
];

/// A chain of float ops of the right arities over inputs of one shape.
fn chain_model(rng: &mut Rng) -> Vec<u8> {
    let shape: Vec<D> = (0..rng.below(4))
        .map(|_| D::Size(rng.between(1, 4)))
        .collect();
    let mut names: Vec<String> = (0..1 + rng.below(2)).map(|i| format!("x{i}")).collect();
    let inputs = names.iter().map(|n| value(n, FLOAT, &shape)).collect();
    let mut nodes = Vec::new();
    for k in 0..1 + rng.below(4) {
        let out = format!("y{k}");
        let (op, ins): (&str, Vec<String>) = match rng.below(2) {
            0 => (*rng.pick(UNARY), vec![rng.pick(&names).clone()]),
            _ => (
                *rng.pick(BINARY),
                vec![rng.pick(&names).clone(), rng.pick(&names).clone()],
            ),
        };
        let attrs = match rng.chance(0.3) {
            true => vec![attribute(rng)],
            false => Vec::new(),
        };
        let ins: Vec<&str> = ins.iter().map(String::as_str).collect();
        nodes.push(node(op, &ins, &[out.as_str()], attrs));
        names.push(out);
    }
    let last = names.last().expect("a node").clone();
    tessera_onnx::build::model(
        17,
        nodes,
        inputs,
        vec![value(&last, FLOAT, &[])],
        Vec::new(),
    )
}

fn random_model(rng: &mut Rng) -> Vec<u8> {
    if rng.chance(0.5) {
        return chain_model(rng);
    }
    let n_inputs = 1 + rng.below(3);
    let mut inputs = Vec::new();
    let mut names: Vec<String> = Vec::new();
    for i in 0..n_inputs {
        let name = format!("x{i}");
        let elem = *rng.pick(&[
            FLOAT, FLOAT, FLOAT, INT64, BOOL, DOUBLE, FLOAT16, INT32, UINT8, INT8, UINT16, UINT64,
        ]);
        let shape: Vec<D> = dims(rng)
            .into_iter()
            .map(|d| match rng.below(10) {
                0 => D::Param("batch"),
                _ => D::Size(d),
            })
            .collect();
        inputs.push(value(&name, elem, &shape));
        names.push(name);
    }
    let mut initializers = Vec::new();
    for i in 0..rng.below(3) {
        let name = format!("c{i}");
        initializers.push(initializer(rng, &name));
        names.push(name);
    }
    let mut nodes = Vec::new();
    for k in 0..1 + rng.below(3) {
        let op = *rng.pick(OPS);
        let ins: Vec<String> = (0..rng.below(4))
            .map(|_| match rng.below(12) {
                0 => String::new(),
                _ => rng.pick(&names).clone(),
            })
            .collect();
        let out = format!("y{k}");
        let attrs = (0..rng.below(4)).map(|_| attribute(rng)).collect();
        let ins: Vec<&str> = ins.iter().map(String::as_str).collect();
        let mut n = node(op, &ins, &[out.as_str()], attrs);
        if rng.chance(0.1) {
            n.output.push(format!("extra{k}"));
        }
        nodes.push(n);
        names.push(out);
    }
    let last = names.last().expect("a node").clone();
    let outputs = vec![value(&last, FLOAT, &[])];
    let opset = match rng.below(6) {
        0 => rng.between(0, 30),
        _ => rng.between(7, 22),
    };
    tessera_onnx::build::model(opset, nodes, inputs, outputs, initializers)
}

fn initializer(rng: &mut Rng, name: &str) -> TensorProto {
    let shape = dims(rng);
    let want: i64 = shape.iter().map(|&d| d.clamp(0, 8)).product();
    let len = match rng.below(8) {
        0 => rng.below(10),
        _ => want as usize,
    };
    match rng.below(2) {
        0 => {
            let data: Vec<f32> = (0..len).map(|_| float(rng)).collect();
            let mut t = tessera_onnx::build::f32_tensor(name, &[], &data);
            t.dims = shape;
            t
        }
        _ => {
            let data: Vec<i64> = (0..len).map(|_| int(rng)).collect();
            let mut t = tessera_onnx::build::i64_tensor(name, &[], &data);
            t.dims = shape;
            t
        }
    }
}

fn attribute(rng: &mut Rng) -> tessera_onnx::proto::AttributeProto {
    match rng.below(4) {
        0 => {
            let name = *rng.pick(INT_ATTRS);
            attr_int(name, int(rng))
        }
        1 => {
            let v: Vec<i64> = (0..rng.below(7)).map(|_| int(rng)).collect();
            let name = *rng.pick(INTS_ATTRS);
            attr_ints(name, &v)
        }
        2 => {
            let name = *rng.pick(FLOAT_ATTRS);
            attr_float(name, float(rng))
        }
        _ => {
            let (name, values) = *rng.pick(STRING_ATTRS);
            let v = *rng.pick(values);
            attr_string(name, v)
        }
    }
}

const SQUEEZENET: &[u8] = include_bytes!("data/light/light_squeezenet.onnx");

/// The light SqueezeNet with one thing damaged: an attribute of a node,
/// a dim of the input, or an initializer's dims.
fn damaged_squeezenet(rng: &mut Rng) -> Vec<u8> {
    let mut m = ModelProto::decode(SQUEEZENET).expect("the committed model decodes");
    let g = m.graph.as_mut().expect("a graph");
    match rng.below(3) {
        0 if !g.node.is_empty() => {
            let at = rng.below(g.node.len());
            let n = &mut g.node[at];
            if n.attribute.is_empty() || rng.chance(0.3) {
                n.attribute.push(attribute(rng));
            } else {
                let a = rng.below(n.attribute.len());
                let attr = &mut n.attribute[a];
                attr.i = int(rng);
                for v in attr.ints.iter_mut() {
                    if rng.chance(0.5) {
                        *v = int(rng);
                    }
                }
            }
        }
        1 => {
            let shape = g.input.first_mut().and_then(|v| match &mut v.r#type {
                Some(tessera_onnx::proto::TypeProto {
                    value: Some(tessera_onnx::proto::type_proto::Value::TensorType(t)),
                    ..
                }) => t.shape.as_mut(),
                _ => None,
            });
            if let Some(shape) = shape {
                if !shape.dim.is_empty() {
                    let d = rng.below(shape.dim.len());
                    shape.dim[d].value = Some(
                        tessera_onnx::proto::tensor_shape_proto::dimension::Value::DimValue(int(
                            rng,
                        )),
                    );
                }
            }
        }
        _ if !g.initializer.is_empty() => {
            let at = rng.below(g.initializer.len());
            let t = &mut g.initializer[at];
            if !t.dims.is_empty() {
                let d = rng.below(t.dims.len());
                t.dims[d] = int(rng);
            }
        }
        _ => {}
    }
    m.encode_to_vec()
}

/// Inputs the interpreter is tried on: at most this many elements each.
const RUN_LIMIT: usize = 1 << 14;

fn check(bytes: &[u8]) -> Result<(), String> {
    let Ok(model) = Model::from_bytes(bytes, "fuzz.onnx") else {
        return Ok(());
    };
    let imported = match import(&model, &ImportOptions::default()) {
        Ok(i) => i,
        Err(e) => return no_internal_error("import", &e.to_string()),
    };
    let mut g = Generator::new(7);
    let mut named = Vec::new();
    for name in &imported.model_inputs {
        let Some(&id) = imported
            .graph
            .inputs
            .iter()
            .find(|&&id| imported.graph.display_name(id) == *name)
        else {
            return Ok(());
        };
        let ty = &imported.graph.node(id).ty;
        let Some(shape) = ty.shape.as_concrete() else {
            return Ok(());
        };
        if shape.iter().product::<usize>() > RUN_LIMIT {
            return Ok(());
        }
        // Integers and booleans: normal draws cast (-3..3, mostly nonzero).
        let Ok(t) = Tensor::try_randn(&shape, DType::F32, &mut g).map(|t| (t * 2.0).cast(ty.dtype))
        else {
            return Ok(());
        };
        named.push((name.clone(), t));
    }
    let Ok(args) = imported.inputs(named) else {
        return Ok(());
    };
    if args.iter().any(|t| t.numel() > RUN_LIMIT) {
        return Ok(());
    }
    let interpreted = run_graph(&imported.graph, &args);
    let compiled = compile_graph(imported.graph.clone(), CompileOptions::default())
        .and_then(|c| c.try_call(&args));
    match (interpreted, compiled) {
        (Ok(a), Ok(b)) => {
            let b: Vec<Tensor> = b;
            if a.len() != b.len() {
                return Err(format!(
                    "{} outputs interpreted, {} compiled",
                    a.len(),
                    b.len()
                ));
            }
            for (i, ((_, x), y)) in a.iter().zip(&b).enumerate() {
                same(x, y).map_err(|e| format!("output {i}: interpreted vs compiled: {e}"))?;
            }
            Ok(())
        }
        (Err(e), Ok(_)) => Err(format!(
            "the interpreter failed ({e}), the compiled graph ran"
        )),
        (Ok(_), Err(e)) => Err(format!(
            "the compiled graph failed ({e}), the interpreter ran"
        )),
        (Err(a), Err(b)) => {
            no_internal_error("the interpreter", &a.to_string())?;
            no_internal_error("the compiled graph", &b.to_string())
        }
    }
}

fn no_internal_error(stage: &str, message: &str) -> Result<(), String> {
    match message.contains("internal error") {
        true => Err(format!("{stage}: {message}")),
        false => Ok(()),
    }
}

fn same(x: &Tensor, y: &Tensor) -> Result<(), String> {
    if x.shape() != y.shape() || x.dtype() != y.dtype() {
        return Err(format!("{} vs {}", x.ty(), y.ty()));
    }
    for (i, (a, b)) in x.to_f64_vec().iter().zip(y.to_f64_vec()).enumerate() {
        let close = (a - b).abs() <= 1e-4 * (1.0 + a.abs().max(b.abs()));
        if !(a == &b || close || (a.is_nan() && b.is_nan())) {
            return Err(format!("element {i}: {a} vs {b}"));
        }
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    let text: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    match Model::from_bytes(bytes, "fuzz.onnx") {
        Ok(m) => format!("{:#?}\n{text}", m.proto.graph.map(|g| g.node)),
        Err(_) => text,
    }
}
