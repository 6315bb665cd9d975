//! Every op of the Tensor API against values computed independently by numpy
//! (in float64, from inputs already rounded to the tested dtype), committed in
//! `tests/fixtures/ops.json` by `scripts/gen_op_fixtures.py`.
//!
//! Each case runs twice: with contiguous inputs, and with every input of rank
//! ≥ 2 stored in reversed dim order and viewed back through `permute`, so the
//! kernels' strided paths see the same values.

use serde_json::Value;
use tessera::{DType, Tensor};

fn values(v: &Value) -> Vec<f64> {
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| match x {
            Value::Bool(b) => *b as u8 as f64,
            Value::Number(n) => n.as_f64().unwrap(),
            Value::String(s) => s
                .parse::<f64>()
                .unwrap_or_else(|_| panic!("bad number {s}")),
            _ => panic!("bad value {x}"),
        })
        .collect()
}

fn shape(v: &Value) -> Vec<usize> {
    v["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect()
}

/// Builds the input tensor: bools as bool; numpy integer arrays (JSON
/// integers) in the case's dtype when it is an integer dtype, else as i64
/// (indices); float arrays in the case's dtype.
fn input(v: &Value, dtype: DType, strided: bool) -> Tensor {
    let dims = shape(v);
    let data = v["data"].as_array().unwrap();
    let target = if data.iter().any(Value::is_boolean) {
        DType::Bool
    } else if data.iter().all(|x| x.is_i64() || x.is_u64()) {
        if dtype.is_int() {
            dtype
        } else {
            DType::I64
        }
    } else {
        dtype
    };
    let t = Tensor::from_vec(values(v), &dims).cast(target);
    if strided && dims.len() >= 2 {
        // Same logical tensor, non-contiguous strides.
        let rev: Vec<isize> = (0..dims.len() as isize).rev().collect();
        let back = t.permute(&rev).contiguous().permute(&rev);
        assert!(!back.is_contiguous() || dims.iter().filter(|&&d| d > 1).count() < 2);
        back
    } else {
        t
    }
}

fn attr_i(c: &Value, k: &str) -> isize {
    c["attrs"][k]
        .as_i64()
        .unwrap_or_else(|| panic!("missing attr {k}")) as isize
}

fn attr_dims(c: &Value, k: &str) -> Vec<isize> {
    c["attrs"][k]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_i64().unwrap() as isize)
        .collect()
}

fn run(c: &Value, x: &[Tensor]) -> Tensor {
    let op = c["op"].as_str().unwrap();
    let keep = || c["attrs"]["keepdim"].as_bool().unwrap();
    match op {
        "neg" => x[0].neg(),
        "abs" => x[0].abs(),
        "exp" => x[0].exp(),
        "log" => x[0].log(),
        "sqrt" => x[0].sqrt(),
        "rsqrt" => x[0].rsqrt(),
        "reciprocal" => x[0].reciprocal(),
        "sin" => x[0].sin(),
        "cos" => x[0].cos(),
        "tanh" => x[0].tanh(),
        "sigmoid" => x[0].sigmoid(),
        "relu" => x[0].relu(),
        "gelu" => x[0].gelu(),
        "gelu_tanh" => x[0].gelu_tanh(),
        "silu" => x[0].silu(),
        "add" => &x[0] + &x[1],
        "sub" => &x[0] - &x[1],
        "mul" => &x[0] * &x[1],
        "div" => &x[0] / &x[1],
        "pow" => x[0].pow(&x[1]),
        "maximum" => x[0].maximum(&x[1]),
        "minimum" => x[0].minimum(&x[1]),
        "eq" => x[0].eq(&x[1]),
        "ne" => x[0].ne(&x[1]),
        "lt" => x[0].lt(&x[1]),
        "le" => x[0].le(&x[1]),
        "gt" => x[0].gt(&x[1]),
        "ge" => x[0].ge(&x[1]),
        "where" => Tensor::where_(&x[0], &x[1], &x[2]),
        "sum" => x[0].sum(&attr_dims(c, "dims"), keep()),
        "mean" => x[0].mean(&attr_dims(c, "dims"), keep()),
        "max" => x[0].max(&attr_dims(c, "dims"), keep()),
        "min" => x[0].min(&attr_dims(c, "dims"), keep()),
        "prod" => x[0].prod(&attr_dims(c, "dims"), keep()),
        "argmax" => x[0].argmax(attr_i(c, "dim"), keep()),
        "argmin" => x[0].argmin(attr_i(c, "dim"), keep()),
        "softmax" => x[0].softmax(attr_i(c, "dim")),
        "log_softmax" => x[0].log_softmax(attr_i(c, "dim")),
        "matmul" => x[0].matmul(&x[1]),
        "permute" => x[0].permute(&attr_dims(c, "perm")),
        "transpose" => x[0].transpose(attr_i(c, "a"), attr_i(c, "b")),
        "slice" => x[0].slice(
            attr_i(c, "dim"),
            attr_i(c, "start"),
            attr_i(c, "end"),
            attr_i(c, "step") as usize,
        ),
        "reshape" => x[0].reshape(&attr_dims(c, "shape")),
        "flatten" => x[0].flatten(attr_i(c, "start"), attr_i(c, "end")),
        "unsqueeze" => x[0].unsqueeze(attr_i(c, "dim")),
        "expand" => x[0].expand(&attr_dims(c, "shape")),
        "cat" => Tensor::cat(&[&x[0], &x[1]], attr_i(c, "dim")),
        "stack" => Tensor::stack(&[&x[0], &x[1]], attr_i(c, "dim")),
        "tril" => x[0].tril(attr_i(c, "diagonal") as i64),
        "triu" => x[0].triu(attr_i(c, "diagonal") as i64),
        "index_select" => x[0].index_select(attr_i(c, "dim"), &x[1]),
        "gather" => x[0].gather(attr_i(c, "dim"), &x[1]),
        "embedding" => x[0].embedding(&x[1]),
        "cast" => x[0].cast(c["attrs"]["to"].as_str().unwrap().parse().unwrap()),
        other => panic!("fixture op {other} has no mapping"),
    }
}

fn check(c: &Value, strided: bool) -> Result<(), String> {
    let dtype: DType = c["dtype"].as_str().unwrap().parse().unwrap();
    let inputs: Vec<Tensor> = c["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| input(v, dtype, strided))
        .collect();
    let got = run(c, &inputs);
    let (want, want_shape) = (values(&c["expected"]), shape(&c["expected"]));
    if got.shape() != want_shape.as_slice() {
        return Err(format!("shape {:?}, want {:?}", got.shape(), want_shape));
    }
    let tol = c["tol"].as_f64().unwrap();
    for (i, (g, w)) in got.to_f64_vec().iter().zip(&want).enumerate() {
        let ok = (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= tol * w.abs().max(1.0);
        if !ok {
            return Err(format!("element {i}: got {g}, want {w} (tol {tol})"));
        }
    }
    Ok(())
}

#[test]
fn ops_match_numpy() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/ops.json"
    ))
    .unwrap();
    let fixtures: Value = serde_json::from_str(&text).unwrap();
    let cases = fixtures["cases"].as_array().unwrap();
    assert!(cases.len() > 150);
    let mut failures = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        for strided in [false, true] {
            if let Err(e) = check(c, strided) {
                failures.push(format!(
                    "case {i} {} {} strided={strided}: {e}",
                    c["op"], c["dtype"]
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
