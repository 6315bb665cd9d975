//! User-defined custom ops: eager, traced, compiled, differentiated, and
//! their error paths. Values are checked against plain tensor code and
//! gradients against central finite differences in f64.

use std::sync::{Arc, OnceLock};

use tessera::custom_op::{self, Attrs, CustomOp};
use tessera::fusion::Kernel;
use tessera::ir::{DType, TensorType};
use tessera::tensor::{trace, Generator};
use tessera::{compile, Tensor};

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F64, &mut Generator::new(seed))
}

fn assert_close(a: &Tensor, b: &Tensor, tol: f64) {
    assert_eq!(a.shape(), b.shape());
    for (x, y) in a.to_f64_vec().iter().zip(b.to_f64_vec()) {
        assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{x} vs {y}");
    }
}

fn attr_f64(attrs: &Attrs, key: &str) -> f64 {
    attrs[key].as_f64().expect("a number")
}

/// `mylib::scaled_sin(x) {scale}` = scale·sin(x), with a backward. Its
/// kernel computes element by element on host values, like a user's own
/// kernel would, rather than through tessera ops.
fn scaled_sin() -> Arc<CustomOp> {
    static OP: OnceLock<Arc<CustomOp>> = OnceLock::new();
    OP.get_or_init(|| {
        CustomOp::builder("mylib::scaled_sin")
            .shape(|_, inputs| Ok(vec![inputs[0].clone()]))
            .cpu(|attrs, inputs| {
                let scale = attr_f64(attrs, "scale");
                let x = inputs[0].to_vec::<f64>()?;
                let y: Vec<f64> = x.iter().map(|v| scale * v.sin()).collect();
                Ok(vec![Tensor::from_vec(y, inputs[0].shape())])
            })
            .backward(|ctx| {
                let scale = attr_f64(ctx.attrs, "scale");
                Ok(vec![Some(&ctx.grads[0] * &(ctx.inputs[0].cos() * scale))])
            })
            .register()
            .expect("registers once")
    })
    .clone()
}

/// `mylib::sincos(x)` = (sin x, cos x): two outputs, with a backward.
fn sincos() -> Arc<CustomOp> {
    static OP: OnceLock<Arc<CustomOp>> = OnceLock::new();
    OP.get_or_init(|| {
        CustomOp::builder("mylib::sincos")
            .shape(|_, inputs| Ok(vec![inputs[0].clone(), inputs[0].clone()]))
            .cpu(|_, inputs| Ok(vec![inputs[0].sin(), inputs[0].cos()]))
            .backward(|ctx| {
                let x = &ctx.inputs[0];
                let g = &ctx.grads[0] * &x.cos() - &ctx.grads[1] * &x.sin();
                Ok(vec![Some(g)])
            })
            .register()
            .expect("registers once")
    })
    .clone()
}

/// `mylib::cossin_late(x)` = (sin x, cos x), its kernel allocating cos
/// first: in a compiled run cos takes the place planned for sin.
fn cossin_late() -> Arc<CustomOp> {
    static OP: OnceLock<Arc<CustomOp>> = OnceLock::new();
    OP.get_or_init(|| {
        CustomOp::builder("mylib::cossin_late")
            .shape(|_, inputs| Ok(vec![inputs[0].clone(), inputs[0].clone()]))
            .cpu(|_, inputs| {
                let c = inputs[0].cos();
                Ok(vec![inputs[0].sin(), c])
            })
            .register()
            .expect("registers once")
    })
    .clone()
}

/// sin dies at once, and values of its size are made while cos lives on:
/// the plan reuses sin's place, where the kernel put cos.
fn short_sin_long_cos(x: &[Tensor]) -> Vec<Tensor> {
    let [s, c] = cossin_late()
        .call(Attrs::new(), &[&x[0]])
        .unwrap()
        .try_into()
        .unwrap();
    let a = (s * 2.0).exp();
    let b = (&a * &a).tanh() + &a;
    vec![b * c]
}

/// A custom kernel that allocates its equal-size outputs out of the plan's
/// order still computes right when compiled (the executor moves an output
/// that took another's place to the pool), in every order.
#[test]
fn outputs_allocated_out_of_order_keep_their_values() {
    let x = randn(&[64], 4);
    let want = {
        let a = (x.sin() * 2.0).exp();
        ((&a * &a).tanh() + &a) * x.cos()
    };
    for strategy in ["bfs", "dfs", "strict"] {
        let strategy = tessera::schedule::Strategy::from_name(strategy).unwrap();
        let f = compile(short_sin_long_cos).schedule(strategy);
        for _ in 0..2 {
            assert_close(&f.call(std::slice::from_ref(&x))[0], &want, 1e-12);
        }
    }
}

/// `mylib::no_backward(x)` = 2x, with no backward registered.
fn no_backward() -> Arc<CustomOp> {
    static OP: OnceLock<Arc<CustomOp>> = OnceLock::new();
    OP.get_or_init(|| {
        CustomOp::builder("mylib::no_backward")
            .shape(|_, inputs| Ok(vec![inputs[0].clone()]))
            .cpu(|_, inputs| Ok(vec![inputs[0] * 2.0]))
            .register()
            .expect("registers once")
    })
    .clone()
}

fn scale_attrs(scale: f64) -> Attrs {
    let mut a = Attrs::new();
    a.insert("scale".into(), scale.into());
    a
}

fn user_fn(x: &[Tensor]) -> Vec<Tensor> {
    let y = scaled_sin().call(scale_attrs(1.5), &[&x[0]]).unwrap();
    let [s, c] = sincos()
        .call(Attrs::new(), &[&y[0]])
        .unwrap()
        .try_into()
        .unwrap();
    vec![(s * &c + &x[0]).sum(&[], false)]
}

fn reference(x: &Tensor) -> Tensor {
    let y = x.sin() * 1.5;
    (y.sin() * y.cos() + x).sum(&[], false)
}

#[test]
fn eager_values_match_plain_tensor_code() {
    let x = randn(&[3, 4], 0);
    assert_close(&user_fn(std::slice::from_ref(&x))[0], &reference(&x), 1e-12);
}

#[test]
fn eager_gradients_match_finite_differences() {
    let x = randn(&[5], 1).set_requires_grad(true);
    user_fn(std::slice::from_ref(&x))[0].backward();
    let grad = x.grad().expect("a gradient").to_f64_vec();
    let values = x.to_f64_vec();
    let h = 1e-6;
    for i in 0..values.len() {
        let at = |d: f64| {
            let mut v = values.clone();
            v[i] += d;
            reference(&Tensor::from_vec(v, &[5])).item()
        };
        let fd = (at(h) - at(-h)) / (2.0 * h);
        assert!((grad[i] - fd).abs() < 1e-6, "d/dx{i}: {} vs {fd}", grad[i]);
    }
}

#[test]
fn compiled_values_and_gradients_match_eager() {
    let f = compile(user_fn);
    let x = randn(&[2, 3], 2);
    assert_close(&f.call(std::slice::from_ref(&x))[0], &reference(&x), 1e-12);

    let xe = x.set_requires_grad(true);
    user_fn(std::slice::from_ref(&xe))[0].backward();
    let xc = x.set_requires_grad(true);
    f.call(std::slice::from_ref(&xc))[0].backward();
    assert_close(&xc.grad().unwrap(), &xe.grad().unwrap(), 1e-12);
}

#[test]
fn a_traced_custom_op_is_one_node_and_round_trips_as_text() {
    let x = ("x".to_string(), TensorType::new(DType::F64, vec![4]));
    let traced = trace::trace("f", &[x], |x| {
        let outs = sincos().call(Attrs::new(), &[&x[0]])?;
        Ok(vec![
            ("s".into(), outs[0].clone()),
            ("c".into(), outs[1].clone()),
        ])
    })
    .unwrap();
    let text = traced.graph.to_string();
    assert!(
        text.contains(r#"custom(%x) {op="mylib::sincos", attrs="{}"}"#),
        "{text}"
    );
    assert!(text.contains("custom_output("), "{text}");
    let parsed = tessera::ir::text::parse(&text).unwrap();
    assert_eq!(parsed.to_string(), text);

    let plan = tessera::fusion::fuse(&traced.graph);
    let customs: Vec<_> = plan
        .kernels
        .iter()
        .filter(|k| matches!(k, Kernel::Custom { .. }))
        .collect();
    assert_eq!(customs.len(), 1, "one kernel writes both outputs");
    assert_eq!(customs[0].writes().len(), 2);
}

#[test]
fn backward_without_a_formula_names_the_op() {
    let x = randn(&[3], 3).set_requires_grad(true);
    let y = no_backward().call(Attrs::new(), &[&x]).unwrap();
    assert_close(&y[0], &(&x.detach() * 2.0), 0.0);
    let err = y[0].sum(&[], false).try_backward(None).unwrap_err();
    assert!(
        err.to_string().contains(
            "Trying to backward through mylib::no_backward but no autograd formula was registered"
        ),
        "{err}"
    );
}

#[test]
fn a_shape_function_that_disagrees_with_the_kernel_is_an_error() {
    let op = CustomOp::builder("mylib::liar")
        .shape(|_, inputs| Ok(vec![inputs[0].clone()]))
        .cpu(|_, inputs| Ok(vec![inputs[0].sum(&[], false)]))
        .register()
        .unwrap();
    let err = op.call(Attrs::new(), &[&randn(&[2, 2], 4)]).unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with("mylib::liar: output 0"), "{msg}");
    assert!(
        msg.contains("f64[] but the shape function says f64[2,2]"),
        "{msg}"
    );
    assert!(msg.contains("custom_op.rs"), "the user's line: {msg}");
}

#[test]
fn names_are_checked_and_unique() {
    let bad = CustomOp::builder("no_namespace")
        .shape(|_, i| Ok(i.to_vec()))
        .cpu(|_, i| Ok(vec![i[0].clone()]))
        .register()
        .unwrap_err();
    assert!(bad.to_string().contains("namespace::name"), "{bad}");
    scaled_sin();
    let twice = CustomOp::builder("mylib::scaled_sin")
        .shape(|_, i| Ok(i.to_vec()))
        .cpu(|_, i| Ok(vec![i[0].clone()]))
        .register()
        .unwrap_err();
    assert!(twice.to_string().contains("already registered"), "{twice}");
    let unknown = custom_op::call("mylib::missing", Attrs::new(), &[]).unwrap_err();
    assert!(unknown.to_string().contains("no custom op"), "{unknown}");
}

#[test]
fn a_shape_function_error_is_reported_at_trace_time_with_the_op_name() {
    let op = CustomOp::builder("mylib::square_only")
        .shape(|_, inputs| {
            let s = inputs[0].shape.as_concrete().unwrap_or_default();
            match s.as_slice() {
                [a, b] if a == b => Ok(vec![inputs[0].clone()]),
                _ => Err(tessera::Error::new(
                    tessera::ErrorKind::Shape,
                    format!("needs a square matrix, got {}", inputs[0]),
                )),
            }
        })
        .cpu(|_, i| Ok(vec![i[0].clone()]))
        .register()
        .unwrap();
    let err = op.call(Attrs::new(), &[&randn(&[2, 3], 5)]).unwrap_err();
    assert_eq!(
        err.to_string().split(" (at").next().unwrap(),
        "mylib::square_only: needs a square matrix, got f64[2,3]"
    );
}

/// `mylib::sincos_reversed(x)` = (sin x, cos x), its kernel making the
/// second output before the first.
fn sincos_reversed() -> Arc<CustomOp> {
    static OP: OnceLock<Arc<CustomOp>> = OnceLock::new();
    OP.get_or_init(|| {
        CustomOp::builder("mylib::sincos_reversed")
            .shape(|_, inputs| Ok(vec![inputs[0].clone(), inputs[0].clone()]))
            .cpu(|_, inputs| {
                let c = inputs[0].cos();
                Ok(vec![inputs[0].sin(), c])
            })
            .register()
            .expect("registers once")
    })
    .clone()
}

#[test]
fn outputs_made_in_another_order_than_declared_keep_their_values_when_compiled() {
    // sin dies at the first matmul while cos stays alive to the end; the
    // plan puts the second matmul's output where sin was: if the kernel's
    // first allocation (cos) took sin's arena slot, that matmul would
    // overwrite it.
    let body = |a: &[Tensor]| {
        let [s, c] = sincos_reversed()
            .call(Attrs::new(), &[&a[0]])
            .unwrap()
            .try_into()
            .unwrap();
        let w = &a[1];
        let e = s.matmul(w).matmul(w).matmul(w);
        vec![&e + &c]
    };
    let mut gen = Generator::new(3);
    let args = [
        Tensor::randn(&[64, 32], DType::F32, &mut gen),
        Tensor::randn(&[32, 32], DType::F32, &mut gen) * 0.2,
    ];
    let want = body(&args);
    let got = compile(body).call(&args);
    assert_close(&got[0], &want[0], 1e-5);
}

#[test]
fn outputs_made_in_another_order_than_declared_are_not_overwritten_in_place() {
    // `u = s * c` could be written in place of `s`; but `s` really sits in
    // the slot planned for `c`, which the plan hands to the first matmul's
    // output once `c` dies: that matmul would write over `u`, its operand
    // and the epilogue's.
    let body = |a: &[Tensor]| {
        let [s, c] = sincos_reversed()
            .call(Attrs::new(), &[&a[0]])
            .unwrap()
            .try_into()
            .unwrap();
        let u = &s * &c;
        let w = u.matmul(&a[1]);
        vec![&w.matmul(&a[1]) + &u]
    };
    let mut gen = Generator::new(5);
    let args = [
        Tensor::randn(&[64, 32], DType::F32, &mut gen),
        Tensor::randn(&[32, 32], DType::F32, &mut gen) * 0.2,
    ];
    let want = body(&args);
    let got = compile(body).call(&args);
    assert_close(&got[0], &want[0], 1e-5);
}
