//! The convolutional-network ops against PyTorch (`tests/fixtures/cnn.json`,
//! float64, written by `scripts/gen_cnn_fixtures.py`): values and gradients
//! of conv2d/conv1d/conv_transpose2d (strides, padding incl. "same",
//! dilation, groups, depthwise), max/avg/adaptive pooling, batch norm
//! (training with the running update, eval), group norm, pad, interpolate
//! and local response norm — eagerly in f64 and f32, by central finite
//! differences in f64, and compiled (`tessera::compile`, forward and
//! backward) against eager. Bad input gives errors naming the op, the
//! shapes and the caller's line.

use serde_json::Value;
use tessera::tensor::{BatchNormStats, ConvOptions, Interpolation, PadMode, PoolOptions};
use tessera::{compile, DType, Tensor};

struct Case {
    name: String,
    op: String,
    params: Value,
    inputs: Vec<(String, Tensor)>,
    wrt: Vec<usize>,
    cotangent: Tensor,
    output: Tensor,
    grads: Vec<Tensor>,
    raw: Value,
}

fn tensor(v: &Value) -> Tensor {
    let shape: Vec<usize> = v["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect();
    let data: Vec<f64> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    Tensor::from_vec(data, &shape)
}

fn cases() -> Vec<Case> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/cnn.json");
    let json: serde_json::Map<String, Value> =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    json.into_iter()
        .map(|(name, c)| {
            let inputs: Vec<(String, Tensor)> = c["inputs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| (i["name"].as_str().unwrap().to_string(), tensor(i)))
                .collect();
            let wrt_names: Vec<String> = c["wrt"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| n.as_str().unwrap().to_string())
                .collect();
            let wrt = wrt_names
                .iter()
                .map(|w| inputs.iter().position(|(n, _)| n == w).unwrap())
                .collect();
            let grads = wrt_names.iter().map(|w| tensor(&c["grads"][w])).collect();
            Case {
                name,
                op: c["op"].as_str().unwrap().to_string(),
                params: c["params"].clone(),
                inputs,
                wrt,
                cotangent: tensor(&c["cotangent"]),
                output: tensor(&c["output"]),
                grads,
                raw: c,
            }
        })
        .collect()
}

fn pair(v: &Value) -> [usize; 2] {
    match v {
        Value::Array(a) => [
            a[0].as_u64().unwrap() as usize,
            a[1].as_u64().unwrap() as usize,
        ],
        v => [v.as_u64().unwrap() as usize; 2],
    }
}

fn conv_options(p: &Value) -> ConvOptions {
    let o = ConvOptions {
        stride: pair(&p["stride"]),
        dilation: pair(&p["dilation"]),
        groups: p["groups"].as_u64().unwrap() as usize,
        ..ConvOptions::default()
    };
    let mut o = match &p["padding"] {
        Value::String(s) if s == "same" => o.same(),
        Value::String(s) if s == "valid" => o.valid(),
        v => {
            let [h, w] = pair(v);
            o.padding_hw(h, w)
        }
    };
    if let Some(op) = p.get("output_padding") {
        o.output_padding = pair(op);
    }
    o
}

fn pool_options(p: &Value) -> PoolOptions {
    let [kh, kw] = pair(&p["kernel"]);
    let [sh, sw] = pair(&p["stride"]);
    let [ph, pw] = pair(&p["padding"]);
    let mut o = PoolOptions::hw(kh, kw)
        .stride_hw(sh, sw)
        .padding_hw(ph, pw)
        .ceil_mode(p["ceil_mode"].as_bool().unwrap())
        .count_include_pad(p["count_include_pad"].as_bool().unwrap());
    o.dilation = pair(&p["dilation"]);
    if let Some(d) = p["divisor_override"].as_u64() {
        o = o.divisor_override(d as usize);
    }
    o
}

/// The case's op on `x` (every input, in the fixture's order): its output,
/// and the running statistics batch norm in training returns.
fn run(op: &str, p: &Value, x: &[Tensor]) -> (Tensor, Option<BatchNormStats>) {
    let y = match op {
        "conv2d" => x[0].conv2d(&x[1], x.get(2), conv_options(p)),
        "conv1d" => {
            let mut o = conv_options(&{
                let mut q = p.clone();
                if let Some(pad) = q["padding"].as_u64() {
                    q["padding"] = Value::from(vec![0, pad]);
                }
                q
            });
            o.stride = [1, o.stride[1]];
            x[0].conv1d(&x[1], x.get(2), o)
        }
        "conv_transpose2d" => x[0].conv_transpose2d(&x[1], x.get(2), conv_options(p)),
        "max_pool2d" => x[0].max_pool2d(pool_options(p)),
        "avg_pool2d" => x[0].avg_pool2d(pool_options(p)),
        "adaptive_avg_pool2d" => x[0].adaptive_avg_pool2d(pair(&p["size"])),
        "batch_norm" => {
            let running = (x.len() == 5).then(|| BatchNormStats {
                mean: x[3].clone(),
                var: x[4].clone(),
            });
            let (y, stats) = x[0].batch_norm(
                running.as_ref(),
                Some(&x[1]),
                Some(&x[2]),
                p["training"].as_bool().unwrap(),
                p["momentum"].as_f64().unwrap(),
                p["eps"].as_f64().unwrap(),
            );
            return (y, stats);
        }
        "group_norm" => x[0].group_norm(
            p["groups"].as_u64().unwrap() as usize,
            Some(&x[1]),
            Some(&x[2]),
            p["eps"].as_f64().unwrap(),
        ),
        "pad" => {
            let pads: Vec<usize> = p["pad"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            let mode = match p["mode"].as_str().unwrap() {
                "constant" => PadMode::Constant(p["value"].as_f64().unwrap()),
                "reflect" => PadMode::Reflect,
                "replicate" => PadMode::Replicate,
                m => panic!("mode {m}"),
            };
            x[0].pad(&pads, mode)
        }
        "interpolate" => {
            let mode = match p["mode"].as_str().unwrap() {
                "nearest" => Interpolation::Nearest,
                _ => Interpolation::Bilinear {
                    align_corners: p["align_corners"].as_bool().unwrap(),
                },
            };
            x[0].interpolate(pair(&p["size"]), mode)
        }
        "local_response_norm" => x[0].local_response_norm(
            p["size"].as_u64().unwrap() as usize,
            p["alpha"].as_f64().unwrap(),
            p["beta"].as_f64().unwrap(),
            p["k"].as_f64().unwrap(),
        ),
        other => panic!("no op {other}"),
    };
    (y, None)
}

/// The largest `|got − want| / (1 + |want|)`.
fn max_error(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.shape(), want.shape());
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

/// The inputs in `dtype`, the differentiated ones requiring grad.
fn leaves(c: &Case, dtype: DType) -> Vec<Tensor> {
    c.inputs
        .iter()
        .enumerate()
        .map(|(i, (_, t))| {
            let t = t.cast(dtype);
            if c.wrt.contains(&i) {
                t.set_requires_grad(true)
            } else {
                t
            }
        })
        .collect()
}

fn check_eager(c: &Case, dtype: DType, tol: f64) {
    let x = leaves(c, dtype);
    let (y, stats) = run(&c.op, &c.params, &x);
    assert_eq!(y.dtype(), dtype, "{}", c.name);
    let e = max_error(&y.cast(DType::F64), &c.output);
    assert!(e < tol, "{} {dtype}: output error {e}", c.name);
    (&y * &c.cotangent.cast(dtype)).sum(&[], false).backward();
    for (k, &i) in c.wrt.iter().enumerate() {
        let g = x[i].grad().expect("a gradient");
        let e = max_error(&g.cast(DType::F64), &c.grads[k]);
        assert!(
            e < tol,
            "{} {dtype}: grad of {} error {e}",
            c.name,
            c.inputs[i].0
        );
    }
    if let Some(stats) = stats {
        for (got, key) in [
            (&stats.mean, "new_running_mean"),
            (&stats.var, "new_running_var"),
        ] {
            let e = max_error(&got.cast(DType::F64), &tensor(&c.raw[key]));
            assert!(e < tol, "{} {dtype}: {key} error {e}", c.name);
        }
    }
}

#[test]
fn values_and_gradients_match_pytorch_in_f64_and_f32() {
    let cases = cases();
    assert!(cases.len() >= 30);
    for c in &cases {
        check_eager(c, DType::F64, 1e-9);
        check_eager(c, DType::F32, 2e-4);
    }
}

/// `sum(f(x) · cot)` in f64.
fn objective(c: &Case, x: &[Tensor]) -> f64 {
    let (y, _) = run(&c.op, &c.params, x);
    (&y * &c.cotangent).sum(&[], false).item()
}

#[test]
fn gradients_match_central_differences() {
    let h = 1e-6;
    for c in cases() {
        let x = leaves(&c, DType::F64);
        let (y, _) = run(&c.op, &c.params, &x);
        (&y * &c.cotangent).sum(&[], false).backward();
        for &i in &c.wrt {
            let analytic = x[i].grad().unwrap().to_f64_vec();
            let base = c.inputs[i].1.to_f64_vec();
            // Every element of small inputs, a spread of them of larger ones.
            let step = (base.len() / 48).max(1);
            for j in (0..base.len()).step_by(step) {
                let at = |d: f64| {
                    let mut v = base.clone();
                    v[j] += d;
                    let mut inputs: Vec<Tensor> = c.inputs.iter().map(|(_, t)| t.clone()).collect();
                    inputs[i] = Tensor::from_vec(v, c.inputs[i].1.shape());
                    objective(&c, &inputs)
                };
                let numeric = (at(h) - at(-h)) / (2.0 * h);
                let err = (numeric - analytic[j]).abs() / (1.0 + analytic[j].abs());
                assert!(
                    err < 1e-5,
                    "{} d/d{}[{j}]: numeric {numeric} vs analytic {}",
                    c.name,
                    c.inputs[i].0,
                    analytic[j]
                );
            }
        }
    }
}

#[test]
fn compiled_forward_and_backward_match_eager() {
    for c in cases() {
        // Batch norm's running update is an output of its own; the
        // function returns the normalised tensor.
        let (op, params) = (c.op.clone(), c.params.clone());
        let f = compile(move |x: &[Tensor]| vec![run(&op, &params, x).0]);
        let x = leaves(&c, DType::F32);
        let y = f.call(&x)[0].clone();
        let (want, _) = run(&c.op, &c.params, &leaves(&c, DType::F32));
        let e = max_error(&y.cast(DType::F64), &want.cast(DType::F64));
        assert!(e < 1e-5, "{}: compiled output error {e}", c.name);
        (&y * &c.cotangent.cast(DType::F32))
            .sum(&[], false)
            .backward();
        for (k, &i) in c.wrt.iter().enumerate() {
            let g = x[i].grad().expect("a gradient through the compiled graph");
            let e = max_error(&g.cast(DType::F64), &c.grads[k]);
            assert!(
                e < 2e-4,
                "{}: compiled grad of {} error {e}",
                c.name,
                c.inputs[i].0
            );
        }
    }
}

/// The weight-gradient op's own backward (what a second derivative of a
/// convolution runs) against central differences, called as a custom op.
#[test]
fn the_weight_gradient_op_differentiates() {
    let attrs: tessera::custom_op::Attrs = serde_json::from_str(
        r#"{"stride":[2,1],"padding":[1,0,1,1],"dilation":[1,2],"groups":1,"activation":"none","kernel_hw":[2,3]}"#,
    )
    .unwrap();
    let vals = |n: usize, k: usize| -> Vec<f64> {
        (0..n).map(|i| ((i * k % 13) as f64 - 6.0) / 6.0).collect()
    };
    let x = Tensor::from_vec(vals(2 * 2 * 5 * 6, 7), &[2, 2, 5, 6]);
    // Output size: ((5 + 1 − 2)/2 + 1, (6 + 2 − 5)/1 + 1) = (3, 4).
    let dy = Tensor::from_vec(vals(2 * 3 * 3 * 4, 5), &[2, 3, 3, 4]);
    let v = Tensor::from_vec(vals(3 * 2 * 2 * 3, 3), &[3, 2, 2, 3]);
    let f = |x: &Tensor, dy: &Tensor| {
        let dw =
            tessera::custom_op::call("tessera::conv2d_backward_weight", attrs.clone(), &[x, dy])
                .unwrap();
        (&dw[0] * &v).sum(&[], false)
    };
    let (xg, dyg) = (x.set_requires_grad(true), dy.set_requires_grad(true));
    f(&xg, &dyg).backward();
    let h = 1e-6;
    for (which, base, analytic) in [(0, &x, xg.grad().unwrap()), (1, &dy, dyg.grad().unwrap())] {
        let analytic = analytic.to_f64_vec();
        let b = base.to_f64_vec();
        for j in 0..b.len() {
            let at = |d: f64| {
                let mut p = b.clone();
                p[j] += d;
                let t = Tensor::from_vec(p, base.shape());
                match which {
                    0 => f(&t, &dy).item(),
                    _ => f(&x, &t).item(),
                }
            };
            let numeric = (at(h) - at(-h)) / (2.0 * h);
            assert!(
                (numeric - analytic[j]).abs() < 1e-6,
                "{which} {j}: {numeric} vs {}",
                analytic[j]
            );
        }
    }
}

#[test]
fn bad_input_names_the_op_the_shapes_and_the_line() {
    let x = Tensor::zeros(&[1, 3, 5, 5], DType::F32);
    let cases: Vec<(Tensor, ConvOptions, &str)> = vec![
        (
            Tensor::zeros(&[4, 2, 3, 3], DType::F32),
            ConvOptions::default(),
            "f32[4,2,3,3]",
        ),
        (
            Tensor::zeros(&[4, 3, 7, 3], DType::F32),
            ConvOptions::default(),
            "larger than the padded input",
        ),
        (
            Tensor::zeros(&[4, 1, 3, 3], DType::F32),
            ConvOptions::default().groups(2),
            "groups (2) must divide",
        ),
        (
            Tensor::zeros(&[4, 3, 3, 3], DType::F32),
            ConvOptions::default().same().stride(2),
            "strided",
        ),
    ];
    for (w, opts, want) in cases {
        let line = line!() + 1;
        let e = x.try_conv2d(&w, None, opts).unwrap_err();
        let text = e.to_string();
        assert!(text.contains(want), "{text}");
        assert!(text.contains("conv2d"), "{text}");
        assert!(text.contains(&format!("cnn_ops.rs:{line}")), "{text}");
    }
    let e = x
        .try_max_pool2d(PoolOptions::new(7))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("max_pool2d") && e.contains("f32[1,3,5,5]"),
        "{e}"
    );
    let e = x
        .try_pad(&[5, 0], PadMode::Reflect)
        .unwrap_err()
        .to_string();
    assert!(e.contains("reflect"), "{e}");
    let e = Tensor::zeros(&[1, 3, 1, 1], DType::F32)
        .try_batch_norm(None, None, None, true, 0.1, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(e.contains("more than 1 value per channel"), "{e}");
    let e = x
        .try_group_norm(2, None, None, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("group_norm") && e.contains("f32[1,3,5,5]"),
        "{e}"
    );
}
