//! `scaled_dot_product_attention` through the flash attention custom op:
//! values and gradients against the plain composite evaluated in f64, eager
//! and compiled, and its errors. (The kernels themselves are tested in
//! `runtime::cpu::flash`.)

use tessera::custom_op::flash_attention::{composite, FORWARD};
use tessera::tensor::{trace, Generator};
use tessera::{compile, scaled_dot_product_attention as sdpa, DType, SdpaOptions, Tensor};

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F64, &mut Generator::new(seed))
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

struct Case {
    q: [usize; 4],
    kv_len: usize,
    causal: bool,
    mask: Option<Vec<usize>>,
}

/// f32 through the op vs f64 through the composite: outputs, and the
/// gradients of `sum(out · w)` for a fixed random `w`. f32 rounding of
/// O(1) values accumulated over ≤ 100 terms stays below 1e-4.
fn check(case: &Case) {
    let [b, h, lq, e] = case.q;
    let q64 = randn(&[b, h, lq, e], 1);
    let k64 = randn(&[b, h, case.kv_len, e], 2);
    let v64 = randn(&[b, h, case.kv_len, e], 3);
    let w64 = randn(&[b, h, lq, e], 4);
    let mask64 = case.mask.as_ref().map(|s| randn(s, 5));
    let f32_of = |t: &Tensor| t.cast(DType::F32).set_requires_grad(true);
    let (q, k, v) = (f32_of(&q64), f32_of(&k64), f32_of(&v64));
    let mask = mask64.as_ref().map(|m| m.cast(DType::F32));
    let out = sdpa(
        &q,
        &k,
        &v,
        SdpaOptions {
            mask: mask.as_ref(),
            causal: case.causal,
            scale: None,
        },
    );
    (&out * &w64.cast(DType::F32)).sum(&[], false).backward();

    let (qr, kr, vr) = (
        q64.set_requires_grad(true),
        k64.set_requires_grad(true),
        v64.set_requires_grad(true),
    );
    let scale = 1.0 / (e as f64).sqrt();
    let reference = composite(&qr, &kr, &vr, mask64.as_ref(), case.causal, scale).unwrap();
    (&reference * &w64).sum(&[], false).backward();

    let tol = 1e-4;
    assert!(
        max_diff(&out, &reference) < tol,
        "out: {}",
        max_diff(&out, &reference)
    );
    for (name, got, want) in [("dq", &q, &qr), ("dk", &k, &kr), ("dv", &v, &vr)] {
        let d = max_diff(&got.grad().unwrap(), &want.grad().unwrap());
        assert!(d < tol, "{name}: {d}");
    }
}

#[test]
fn values_and_gradients_match_the_f64_composite() {
    let cases = [
        Case {
            q: [2, 3, 17, 16],
            kv_len: 17,
            causal: false,
            mask: None,
        },
        Case {
            q: [2, 3, 17, 16],
            kv_len: 17,
            causal: true,
            mask: None,
        },
        Case {
            q: [1, 2, 9, 32],
            kv_len: 70,
            causal: false,
            mask: None,
        },
        Case {
            q: [1, 2, 70, 8],
            kv_len: 9,
            causal: true,
            mask: None,
        },
        Case {
            q: [2, 2, 13, 16],
            kv_len: 11,
            causal: false,
            mask: Some(vec![13, 11]),
        },
        Case {
            q: [2, 2, 13, 16],
            kv_len: 11,
            causal: false,
            mask: Some(vec![2, 1, 13, 11]),
        },
    ];
    for case in &cases {
        check(case);
    }
}

#[test]
fn a_bool_mask_hides_keys_and_an_all_hidden_row_is_zero() {
    let q = randn(&[1, 1, 3, 8], 1).cast(DType::F32);
    let k = randn(&[1, 1, 4, 8], 2).cast(DType::F32);
    let v = randn(&[1, 1, 4, 8], 3).cast(DType::F32);
    // Row 0 sees keys 0 and 2, row 1 none, row 2 all.
    let keep: Vec<bool> = vec![
        true, false, true, false, false, false, false, false, true, true, true, true,
    ];
    let as_f32: Vec<f32> = keep.iter().map(|&k| k as u8 as f32).collect();
    let mask = Tensor::from_vec(as_f32, &[3, 4]).cast(DType::Bool);
    let out = sdpa(
        &q,
        &k,
        &v,
        SdpaOptions {
            mask: Some(&mask),
            ..Default::default()
        },
    );
    let values = out.to_f64_vec();
    assert!(values.iter().all(|x| x.is_finite()));
    assert!(
        values[8..16].iter().all(|&x| x == 0.0),
        "the hidden row is zero"
    );
    let additive: Vec<f64> = keep
        .iter()
        .map(|&k| if k { 0.0 } else { f64::NEG_INFINITY })
        .collect();
    let m64 = Tensor::from_vec(additive, &[3, 4]);
    let reference = composite(
        &q.cast(DType::F64),
        &k.cast(DType::F64),
        &v.cast(DType::F64),
        Some(&m64),
        false,
        8f64.sqrt().recip(),
    )
    .unwrap();
    let r = reference.to_f64_vec();
    for i in (0..8).chain(16..24) {
        assert!(
            (values[i] - r[i]).abs() < 1e-5,
            "{i}: {} vs {}",
            values[i],
            r[i]
        );
    }
}

#[test]
fn compiled_attention_is_one_custom_kernel_and_matches_eager() {
    let f = |x: &[Tensor]| {
        vec![sdpa(
            &x[0],
            &x[1],
            &x[2],
            SdpaOptions {
                causal: true,
                ..Default::default()
            },
        )]
    };
    let args: Vec<Tensor> = (0..3)
        .map(|i| randn(&[2, 2, 33, 16], i).cast(DType::F32))
        .collect();
    let eager = f(&args);
    let compiled = compile(f).call(&args);
    assert_eq!(max_diff(&compiled[0], &eager[0]), 0.0);

    let grads = |call: &dyn Fn(&[Tensor]) -> Vec<Tensor>| {
        let xs: Vec<Tensor> = args.iter().map(|a| a.set_requires_grad(true)).collect();
        call(&xs)[0].sum(&[], false).backward();
        xs.iter().map(|x| x.grad().unwrap()).collect::<Vec<_>>()
    };
    let c = compile(f);
    for (e, g) in grads(&f).iter().zip(grads(&|x| c.call(x))) {
        assert_eq!(max_diff(e, &g), 0.0);
    }

    let types: Vec<_> = ["q", "k", "v"]
        .iter()
        .map(|n| (n.to_string(), args[0].ty()))
        .collect();
    let traced = trace::trace("attn", &types, |x| {
        Ok(vec![("out".into(), f(x)[0].clone())])
    })
    .unwrap();
    let text = traced.graph.to_string();
    assert!(text.contains(FORWARD), "{text}");
}

#[test]
fn f64_runs_the_composite_and_bf16_runs_the_kernel() {
    let (q, k, v) = (
        randn(&[1, 2, 5, 8], 1),
        randn(&[1, 2, 6, 8], 2),
        randn(&[1, 2, 6, 8], 3),
    );
    let out = sdpa(&q, &k, &v, SdpaOptions::default());
    let reference = composite(&q, &k, &v, None, false, 8f64.sqrt().recip()).unwrap();
    assert_eq!(max_diff(&out, &reference), 0.0);
    let bf = |t: &Tensor| t.cast(DType::BF16);
    let out16 = sdpa(&bf(&q), &bf(&k), &bf(&v), SdpaOptions::default());
    assert_eq!(out16.dtype(), DType::BF16);
    // bf16 keeps 8 bits of mantissa: inputs and output round at 2^-8 relative.
    assert!(
        max_diff(&out16, &reference) < 3e-2,
        "{}",
        max_diff(&out16, &reference)
    );
}

#[test]
fn bad_operands_are_errors_naming_the_op_and_shapes() {
    let t = |s: &[usize]| randn(s, 0).cast(DType::F32);
    let err = |q: &Tensor, k: &Tensor, v: &Tensor, o: SdpaOptions| {
        tessera::try_scaled_dot_product_attention(q, k, v, o)
            .unwrap_err()
            .to_string()
    };
    let e = err(
        &t(&[2, 4, 8]),
        &t(&[2, 4, 7]),
        &t(&[2, 4, 8]),
        SdpaOptions::default(),
    );
    assert!(
        e.contains("tessera::flash_attention") && e.contains("f32[2,4,7]"),
        "{e}"
    );
    assert!(e.contains("flash_attention_op.rs"), "the user's line: {e}");
    let e = err(
        &t(&[1, 4, 300]),
        &t(&[1, 4, 300]),
        &t(&[1, 4, 300]),
        SdpaOptions::default(),
    );
    assert!(e.contains("head dims from 1 to 256"), "{e}");
    let m = t(&[3, 4]);
    let e = err(
        &t(&[1, 4, 8]),
        &t(&[1, 4, 8]),
        &t(&[1, 4, 8]),
        SdpaOptions {
            mask: Some(&m),
            ..Default::default()
        },
    );
    assert!(e.contains("does not broadcast"), "{e}");
    let m = t(&[4, 4]).set_requires_grad(true);
    let e = err(
        &t(&[1, 4, 8]),
        &t(&[1, 4, 8]),
        &t(&[1, 4, 8]),
        SdpaOptions {
            mask: Some(&m),
            ..Default::default()
        },
    );
    assert!(e.contains("no gradient"), "{e}");
}
