//! Running the ONNX project's backend test cases (a folder holding
//! `model.onnx` and `test_data_set_N/{input,output}_M.pb`) through the
//! reader, the interpreter and the compiler, and comparing with the
//! expected outputs: what `tests/onnx_backend.rs` and
//! `tessera onnx-test` share.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tessera::compile::{compile_graph, CompileOptions};
use tessera::ir::Literal;
use tessera::runtime::device::Device;
use tessera::tensor::interpret::run_graph;
use tessera::{Error, ErrorKind, Tensor};

use crate::{decode_tensor, import, read_literal, ImportOptions, Model};

/// How one case ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Interpreted and compiled outputs equal the expected ones.
    Pass,
    /// Op types without a mapping (the first error's list).
    UnsupportedOps(Vec<String>),
    /// An input, output or value of an element type tessera lacks.
    UnsupportedType(String),
    /// Anything else: a wrong value, an error, a panic.
    Fail(String),
}

/// Tolerances of the comparison: |got − want| ≤ atol + rtol·|want|
/// (the ONNX backend test's defaults for node cases); for half-precision
/// outputs `rtol` is [`half_rtol`]'s.
pub const RTOL: f64 = 1e-3;
pub const ATOL: f64 = 1e-7;

/// The relative tolerance for an output of `dtype`: [`RTOL`], or at least
/// two ulps of a half-precision type (2^-6 for bf16, 2^-9 for f16: times
/// |want|, two to four ulps of its binade), on every device alike.
///
/// The `onnx` package's own runner (`onnx.backend.test.runner`,
/// `assert_similar_outputs`) compares bf16 outputs with
/// `rtol = max(rtol, 2**-6)`, "two bfloat16 ULPs", because its reference
/// computes each intermediate in the half type (numpy step by step) and so
/// carries several roundings: in `test_attention_4d_causal_bf16` it lies
/// up to 1.65 bf16 ulps from the exact (f64) attention of the same inputs,
/// and the exact value rounded once differs from it at 48 of 192 outputs;
/// in `test_attention_4d_causal_fp16`, up to 1.42 f16 ulps, 40 of 192
/// (measured with numpy, f64 arithmetic on the cases' inputs). So a
/// result within the reference's own error of the exact value may lie two
/// ulps from the reference: the CUDA f16 result 0.468994 at output 12 is
/// 0.8 ulp from exact (0.469190) where the reference (0.469482) is 1.2 ulps
/// off, two ulps apart; the CUDA bf16 result 0.375 at output 172 is 1.44
/// ulps from exact (0.377807), within the reference's 1.65, one ulp from
/// the reference (0.376953). f16 outputs get the same two ulps as bf16:
/// numpy's f16 steps round as its bf16 ones do, and 1e-3 is barely one
/// f16 ulp.
pub fn half_rtol(dtype: tessera::DType) -> f64 {
    match dtype {
        tessera::DType::BF16 => RTOL.max(2f64.powi(-6)),
        tessera::DType::F16 => RTOL.max(2f64.powi(-9)),
        _ => RTOL,
    }
}

/// The test case folders under `root/<kind>/`, sorted.
pub fn cases(root: &Path, kind: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(root.join(kind))
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.join("model.onnx").is_file())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

fn read_pb(path: &Path) -> Result<Literal, Error> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(format!("{}: {e}", path.display())))?;
    let what = path.display().to_string();
    read_literal(&decode_tensor(&bytes, &what)?, None, &what)
}

fn data_files(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut v: Vec<(usize, PathBuf)> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let n = name
                        .strip_prefix(prefix)?
                        .strip_suffix(".pb")?
                        .parse()
                        .ok()?;
                    Some((n, e.path()))
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v.into_iter().map(|(_, p)| p).collect()
}

/// Runs one case folder: every data set, interpreted and compiled, with
/// the inputs (and weights) on `device`.
pub fn run_case(dir: &Path, device: Device) -> Outcome {
    match std::panic::catch_unwind(|| run_case_inner(dir, device)) {
        Ok(o) => o,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Outcome::Fail(format!("panic: {msg}"))
        }
    }
}

fn unsupported_type(e: &Error) -> bool {
    e.kind == ErrorKind::Unsupported && e.message.contains("which tessera does not have")
}

fn run_case_inner(dir: &Path, device: Device) -> Outcome {
    let model = match Model::load(dir.join("model.onnx")) {
        Ok(m) => m,
        Err(e) => return Outcome::Fail(e.to_string()),
    };
    let unsupported = model.unsupported_ops();
    if !unsupported.is_empty() {
        return Outcome::UnsupportedOps(unsupported.into_iter().map(|(op, _)| op).collect());
    }
    let graph = model.proto.graph.as_ref().expect("parsed");
    for vi in graph.input.iter().chain(&graph.output) {
        use crate::proto::type_proto::Value;
        let kind = match vi.r#type.as_ref().and_then(|t| t.value.as_ref()) {
            Some(Value::SequenceType(_)) => "sequence",
            Some(Value::OptionalType(_)) => "optional",
            Some(Value::MapType(_)) => "map",
            Some(Value::SparseTensorType(_)) => "sparse tensor",
            _ => continue,
        };
        return Outcome::UnsupportedType(format!("element type {kind} (`{}`)", vi.name));
    }
    // Data set inputs are the graph inputs that have no initializer.
    let initialised: Vec<&str> = graph.initializer.iter().map(|t| t.name.as_str()).collect();
    let input_names: Vec<String> = graph
        .input
        .iter()
        .filter(|i| !initialised.contains(&i.name.as_str()))
        .map(|i| i.name.clone())
        .collect();
    let mut sets: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.is_dir()
                        && p.file_name()
                            .is_some_and(|n| n.to_string_lossy().starts_with("test_data_set_"))
                })
                .collect()
        })
        .unwrap_or_default();
    sets.sort();
    if sets.is_empty() {
        return Outcome::Fail("no test data set".into());
    }
    for set in sets {
        let mut inputs = Vec::new();
        for p in data_files(&set, "input_") {
            match read_pb(&p) {
                Ok(l) => inputs.push(l),
                Err(e) if unsupported_type(&e) => return Outcome::UnsupportedType(e.message),
                Err(e) => return Outcome::Fail(e.to_string()),
            }
        }
        let mut expected = Vec::new();
        for p in data_files(&set, "output_") {
            match read_pb(&p) {
                Ok(l) => expected.push(l),
                Err(e) if unsupported_type(&e) => return Outcome::UnsupportedType(e.message),
                Err(e) => return Outcome::Fail(e.to_string()),
            }
        }
        if inputs.len() != input_names.len() {
            return Outcome::Fail(format!(
                "{} input files for {} graph inputs",
                inputs.len(),
                input_names.len()
            ));
        }
        let known: HashMap<String, Literal> = input_names
            .iter()
            .cloned()
            .zip(inputs.iter().cloned())
            .collect();
        let options = ImportOptions {
            known_inputs: known,
            ..ImportOptions::default()
        };
        let imported = match import(&model, &options) {
            Ok(i) => i,
            Err(e) if unsupported_type(&e) => return Outcome::UnsupportedType(e.message),
            // Training-only behaviour (a random dropout mask).
            Err(e) if e.kind == ErrorKind::Unsupported && e.message.contains("training mode") => {
                let op = e.op.clone().unwrap_or_default();
                return Outcome::UnsupportedOps(vec![format!("{op} (training mode)")]);
            }
            Err(e) => return Outcome::Fail(format!("import: {e}")),
        };
        let named: Vec<(String, Tensor)> = input_names
            .iter()
            .cloned()
            .zip(inputs.into_iter().map(Tensor::from_literal))
            .collect();
        let args = match imported.inputs(named).and_then(|a| {
            a.iter()
                .map(|t| t.to(device))
                .collect::<Result<Vec<_>, _>>()
        }) {
            Ok(a) => a,
            Err(e) => return Outcome::Fail(format!("inputs: {e}")),
        };
        let interpreted = match run_graph(&imported.graph, &args) {
            Ok(o) => o.into_iter().map(|(_, t)| t).collect::<Vec<_>>(),
            Err(e) => return Outcome::Fail(format!("interpreted: {e}")),
        };
        if let Some(msg) = compare(&interpreted, &expected) {
            return Outcome::Fail(format!("interpreted: {msg}"));
        }
        let compiled = match compile_graph(imported.graph.clone(), CompileOptions::default())
            .and_then(|g| {
                let out = g.try_call(&args)?;
                let stats = g.stats();
                if stats.eager_calls > 0 || stats.compiles != 1 {
                    return Err(Error::new(
                        ErrorKind::Verify,
                        format!("the call was not compiled: {stats:?}"),
                    ));
                }
                Ok(out)
            }) {
            Ok(o) => o,
            Err(e) => return Outcome::Fail(format!("compiled: {e}")),
        };
        if let Some(msg) = compare(&compiled, &expected) {
            return Outcome::Fail(format!("compiled: {msg}"));
        }
    }
    Outcome::Pass
}

/// The first difference between outputs and expected values, if any.
pub fn compare(got: &[Tensor], want: &[Literal]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} outputs, expected {}", got.len(), want.len()));
    }
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        if g.dtype() != w.dtype || g.shape() != w.shape.as_slice() {
            return Some(format!(
                "output {k} is {}, expected {}{:?}",
                g.ty(),
                w.dtype,
                w.shape
            ));
        }
        let host = match g.to(tessera::runtime::device::Device::Cpu) {
            Ok(h) => h,
            Err(e) => return Some(format!("output {k}: {e}")),
        };
        if w.dtype.is_int() {
            // Integers compare exactly as i64 (a u64 as its bit pattern,
            // as the literal holds it).
            let gv = match host
                .try_cast(tessera::DType::I64)
                .and_then(|t| t.to_vec::<i64>())
            {
                Ok(v) => v,
                Err(e) => return Some(format!("output {k}: {e}")),
            };
            let wv = crate::builder::lit_ints(w);
            if let Some(i) = (0..gv.len()).find(|&i| gv[i] != wv[i]) {
                return Some(format!("output {k}[{i}] = {}, expected {}", gv[i], wv[i]));
            }
            continue;
        }
        let gv = host.to_f64_vec();
        let wv = crate::builder::lit_floats(w);
        let exact = !w.dtype.is_float();
        let rtol = half_rtol(w.dtype);
        for (i, (a, b)) in gv.iter().zip(&wv).enumerate() {
            let ok = if exact {
                a == b
            } else {
                (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= ATOL + rtol * b.abs()
            };
            if !ok {
                return Some(format!("output {k}[{i}] = {a}, expected {b}"));
            }
        }
    }
    None
}

/// Replaces each `ConstantOfShape` whose shape is an initializer (how the
/// `onnx` package's `light/` models hold their weights: one constant value
/// per tensor, which hides most errors) by an initializer of random f32
/// values from `seed`, scaled by the weight's role so that activations
/// stay of order one: He-scaled convolution weights (`N(0, 2/fan_in)`),
/// Gemm weights `N(0, 1/fan_in)`, batch-norm scales and variances in
/// `[0.5, 1.5)`, everything else `N(0, 0.01)`. Returns how many it
/// replaced. `scripts/onnx_light_models.py` does the same in Python (with
/// numpy's generator, so not the same values).
pub fn randomise_constant_weights(model: &mut Model, seed: u64) -> Result<usize, Error> {
    use crate::proto::{NodeProto, TensorProto};
    use tessera::tensor::Generator;
    let dir = model.dir.clone();
    let graph = model.proto.graph.as_mut().expect("parsed");
    let inits: HashMap<String, TensorProto> = graph
        .initializer
        .iter()
        .map(|t| (t.name.clone(), t.clone()))
        .collect();
    // Who reads each value first: (op type, input index, transB).
    let mut reader: HashMap<String, (String, usize, bool)> = HashMap::new();
    for n in &graph.node {
        let trans_b = n.attribute.iter().any(|a| a.name == "transB" && a.i == 1);
        for (i, name) in n.input.iter().enumerate() {
            reader
                .entry(name.clone())
                .or_insert_with(|| (n.op_type.clone(), i, trans_b));
        }
    }
    let mut generator = Generator::new(seed);
    let mut kept: Vec<NodeProto> = Vec::new();
    let mut replaced = 0;
    let nodes = std::mem::take(&mut graph.node);
    for n in nodes {
        let shape_init = n.input.first().and_then(|s| inits.get(s));
        let (true, Some(shape_t)) = (n.op_type == "ConstantOfShape", shape_init) else {
            kept.push(n);
            continue;
        };
        let lit = read_literal(shape_t, dir.as_deref(), &shape_t.name)?;
        let shape: Vec<usize> = crate::builder::lit_ints(&lit)
            .into_iter()
            .map(|v| v.max(0) as usize)
            .collect();
        let count: usize = shape.iter().product();
        let out = n.output[0].clone();
        let role = reader.get(&out).cloned().unwrap_or_default();
        let normal =
            |g: &mut Generator| Tensor::randn(&[count], tessera::DType::F64, g).to_f64_vec();
        let values: Vec<f64> = match (role.0.as_str(), role.1) {
            ("Conv", 1) => {
                let fan_in: usize = shape[1..].iter().product();
                let s = (2.0 / fan_in.max(1) as f64).sqrt();
                normal(&mut generator).into_iter().map(|v| v * s).collect()
            }
            ("Gemm", 1) => {
                let fan_in = if role.2 { shape[1] } else { shape[0] };
                let s = (1.0 / fan_in.max(1) as f64).sqrt();
                normal(&mut generator).into_iter().map(|v| v * s).collect()
            }
            ("BatchNormalization", 1 | 4) => {
                Tensor::rand(&[count], tessera::DType::F64, &mut generator)
                    .to_f64_vec()
                    .into_iter()
                    .map(|v| 0.5 + v)
                    .collect()
            }
            _ => normal(&mut generator)
                .into_iter()
                .map(|v| 0.1 * v)
                .collect(),
        };
        graph.initializer.push(TensorProto {
            dims: shape.iter().map(|&d| d as i64).collect(),
            data_type: 1, // FLOAT
            float_data: values.into_iter().map(|v| v as f32).collect(),
            name: out,
            ..TensorProto::default()
        });
        replaced += 1;
    }
    graph.node = kept;
    Ok(replaced)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera::ir::LiteralData;
    use tessera::DType;

    fn lit(dtype: DType, v: f64) -> Literal {
        Literal {
            dtype,
            shape: vec![1],
            data: LiteralData::Float(vec![v]),
        }
    }

    /// Two half-precision ulps pass (the reference rounds each step), six
    /// or eight do not; f32 keeps the runner's 1e-3.
    #[test]
    fn half_outputs_are_compared_within_two_ulps() {
        let got = |dtype, v: f64| vec![Tensor::from_vec(vec![v], &[1]).cast(dtype)];
        // bf16 ulp in [0.25, 0.5) is 2^-9; f16's is 2^-12.
        let w = 0.376953125;
        assert!(compare(&got(DType::BF16, w - 2f64.powi(-8)), &[lit(DType::BF16, w)]).is_none());
        assert!(compare(
            &got(DType::BF16, w - 3.0 * 2f64.powi(-8)),
            &[lit(DType::BF16, w)]
        )
        .is_some());
        let w = 0.469482421875;
        assert!(compare(&got(DType::F16, w - 2f64.powi(-11)), &[lit(DType::F16, w)]).is_none());
        assert!(compare(&got(DType::F16, w - 2f64.powi(-9)), &[lit(DType::F16, w)]).is_some());
        assert!(compare(&got(DType::F32, w * (1.0 - 2e-3)), &[lit(DType::F32, w)]).is_some());
    }
}
