//! Shared by `grad_fixtures.rs` and `aot.rs`: the composite functions of
//! `tests/fixtures/grads.json` (written by `scripts/gen_grad_fixtures.py`,
//! where each has its JAX twin) and a loader for that file; by the eager
//! hint tests: the eager backend's notes on a region's hints.
//!
//! Not every test file uses every item.
#![allow(dead_code)]

use serde_json::Value;
use tessera::{DType, Tensor};

/// The class id that `cross_entropy` skips (torch's `ignore_index`).
pub const IGNORE: i64 = -100;

/// Scaled dot-product attention over `[batch, heads, seq, dim]`; the causal
/// mask is built from `tril(ones)` and applied with `where(mask, s, -inf)`.
pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Tensor {
    let scale = 1.0 / (q.shape()[q.rank() - 1] as f64).sqrt();
    let s = q.matmul(&k.transpose(-2, -1)) * scale;
    let s = if causal { causal_mask(&s) } else { s };
    s.softmax(-1).matmul(v)
}

pub use tessera_apps::seed_table::causal_mask;

/// The seed's sliced attention (one slice per batch·head), as the seed
/// table runs it.
pub fn sdpa_sliced(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Tensor {
    tessera_apps::seed_table::sdpa(q, k, v, causal, q.shape()[0] * q.shape()[1])
}

/// Layer norm over the last dim: biased variance, eps = 1e-5, affine.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
    let mean = x.mean(&[-1], true);
    let d = x - &mean;
    let var = (&d * &d).mean(&[-1], true);
    &d / &(var + 1e-5).sqrt() * w + b
}

/// Mean negative log-likelihood of `targets` (i64 class ids) under
/// `log_softmax(logits)`, over the rows whose target is not [`IGNORE`].
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Tensor {
    let lsm = logits.log_softmax(-1);
    let keep = targets.ne(IGNORE);
    let safe = Tensor::where_(&keep, targets, &Tensor::zeros(&[], DType::I64));
    let picked = lsm.gather(1, &safe.unsqueeze(1)).squeeze(1);
    let mask = keep.cast(logits.dtype());
    -((picked * &mask).sum(&[], false) / mask.sum(&[], false))
}

/// Two linear layers with the exact (erf) gelu between them.
pub fn mlp(x: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor, b2: &Tensor) -> Tensor {
    (x.matmul(w1) + b1).gelu().matmul(w2) + b2
}

/// The function named `name` in grads.json, on its inputs in file order.
pub fn model(name: &str) -> fn(&[Tensor]) -> Tensor {
    match name {
        "sdpa" => |a| sdpa(&a[0], &a[1], &a[2], false),
        "sdpa_causal" => |a| sdpa(&a[0], &a[1], &a[2], true),
        "layer_norm" => |a| layer_norm(&a[0], &a[1], &a[2]),
        "cross_entropy" => |a| cross_entropy(&a[0], &a[1]),
        "mlp" => |a| mlp(&a[0], &a[1], &a[2], &a[3], &a[4]),
        _ => panic!("no model {name}"),
    }
}

/// One function of grads.json.
pub struct Fixture {
    pub name: String,
    /// Named inputs in the function's order: f64, or i64 for class ids.
    pub inputs: Vec<(String, Tensor)>,
    /// Positions in `inputs` of the inputs differentiated.
    pub wrt: Vec<usize>,
    pub cotangent: Tensor,
    pub output: Tensor,
    /// One per `wrt`: the gradient of `sum(f(inputs) * cotangent)`.
    pub grads: Vec<Tensor>,
}

fn tensor(v: &Value) -> Tensor {
    let shape: Vec<usize> = v["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect();
    let data = v["data"].as_array().unwrap();
    if !data.is_empty() && data.iter().all(|x| x.is_i64()) {
        let ints: Vec<i64> = data.iter().map(|x| x.as_i64().unwrap()).collect();
        return Tensor::from_vec(ints, &shape);
    }
    let floats: Vec<f64> = data.iter().map(|x| x.as_f64().unwrap()).collect();
    Tensor::from_vec(floats, &shape)
}

/// Every function of grads.json, in the file's order.
pub fn fixtures() -> Vec<Fixture> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/grads.json");
    let text = std::fs::read_to_string(path).expect("tests/fixtures/grads.json");
    let json: serde_json::Map<String, Value> = serde_json::from_str(&text).unwrap();
    json.iter()
        .map(|(name, f)| {
            let inputs: Vec<(String, Tensor)> = f["inputs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| (i["name"].as_str().unwrap().to_string(), tensor(i)))
                .collect();
            let wrt_names: Vec<&str> = f["wrt"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| n.as_str().unwrap())
                .collect();
            let wrt = wrt_names
                .iter()
                .map(|w| inputs.iter().position(|(n, _)| n == w).unwrap())
                .collect();
            let grads = wrt_names.iter().map(|w| tensor(&f["grads"][*w])).collect();
            Fixture {
                name: name.clone(),
                inputs,
                wrt,
                cotangent: tensor(&f["cotangent"]),
                output: tensor(&f["output"]),
                grads,
            }
        })
        .collect()
}

/// The largest `|got − want| / (1 + |want|)` (∞ on a shape mismatch or NaN).
pub fn max_error(got: &Tensor, want: &Tensor) -> f64 {
    if got.shape() != want.shape() {
        return f64::INFINITY;
    }
    got.to_f64_vec()
        .iter()
        .zip(want.to_f64_vec())
        .map(|(g, w)| {
            let e = (g - w).abs() / (1.0 + w.abs());
            if e.is_nan() {
                f64::INFINITY
            } else {
                e
            }
        })
        .fold(0.0, f64::max)
}

/// The eager backend's notes on the hints it did not honour in the region
/// of `group_id`, and of those the ones about hint `hint`.
pub fn eager_notes(group_id: &str, hint: &str) -> (Vec<String>, Vec<String>) {
    let said: Vec<String> = tessera::hints::not_honoured_messages()
        .into_iter()
        .filter(|m| m.starts_with("eager:") && m.contains(group_id))
        .collect();
    let about = format!("hint \"{hint}\"");
    let on_hint = said
        .iter()
        .filter(|m| m.contains(&about))
        .cloned()
        .collect();
    (said, on_hint)
}
