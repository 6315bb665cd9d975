//! A user-defined custom op, end to end: `mylib::softplus_clip(x)
//! {limit}` = min(log(1 + eˣ), limit), with a hand-written CPU kernel, a
//! shape function and a backward; called eagerly, compiled, differentiated
//! both ways — and an op without a backward, whose gradient is an error.
//!
//! `cargo run --release -p tessera --example custom_op`

use tessera::custom_op::{Attrs, CustomOp};
use tessera::tensor::Generator;
use tessera::{compile, DType, Tensor};

fn limit_of(attrs: &Attrs) -> tessera::Result<f64> {
    attrs.get("limit").and_then(|v| v.as_f64()).ok_or_else(|| {
        tessera::Error::new(
            tessera::ErrorKind::Argument,
            "needs a number attribute `limit`",
        )
    })
}

fn main() -> tessera::Result<()> {
    let softplus_clip = CustomOp::builder("mylib::softplus_clip")
        // Runs at trace time on dtypes and (possibly symbolic) shapes.
        .shape(|attrs, inputs| {
            limit_of(attrs)?;
            match inputs {
                [x] if x.dtype == DType::F32 => Ok(vec![x.clone()]),
                _ => Err(tessera::Error::new(
                    tessera::ErrorKind::DType,
                    format!("takes one f32 tensor, got {inputs:?}"),
                )),
            }
        })
        // The kernel sees concrete host tensors and returns new ones.
        .cpu(|attrs, inputs| {
            let limit = limit_of(attrs)? as f32;
            let x = inputs[0].contiguous().to_vec::<f32>()?;
            let y: Vec<f32> = x.iter().map(|&v| v.exp().ln_1p().min(limit)).collect();
            Ok(vec![Tensor::from_vec(y, inputs[0].shape())])
        })
        // Ordinary tensor code: runs eagerly, and AOT autograd captures it.
        .backward(|ctx| {
            let limit = limit_of(ctx.attrs)?;
            let x = &ctx.inputs[0];
            let below = ctx.outputs[0].lt(limit);
            let slope = Tensor::where_(&below, &x.sigmoid(), &Tensor::scalar(0.0, DType::F32));
            Ok(vec![Some(&ctx.grads[0] * &slope)])
        })
        .register()?;

    let mut attrs = Attrs::new();
    attrs.insert("limit".into(), 2.0.into());
    let f = move |x: &[Tensor]| -> Vec<Tensor> {
        let y = softplus_clip
            .call(attrs.clone(), &[&x[0]])
            .expect("valid input");
        vec![y[0].sum(&[], false)]
    };

    let x = Tensor::randn(&[8], DType::F32, &mut Generator::new(0)).set_requires_grad(true);
    let eager = f(std::slice::from_ref(&x));
    eager[0].backward();
    println!(
        "eager:    y = {:.5}, dy/dx = {:?}",
        eager[0].item(),
        x.grad().unwrap().to_vec::<f32>()?
    );

    let compiled = compile(f);
    let xc = x.detach().set_requires_grad(true);
    let out = compiled.call(std::slice::from_ref(&xc));
    out[0].backward();
    println!(
        "compiled: y = {:.5}, dy/dx = {:?}",
        out[0].item(),
        xc.grad().unwrap().to_vec::<f32>()?
    );

    let double = CustomOp::builder("mylib::double")
        .shape(|_, inputs| Ok(inputs.to_vec()))
        .cpu(|_, inputs| Ok(vec![inputs[0] * 2.0]))
        .register()?;
    let y = double.call(Attrs::new(), &[&x])?;
    let err = y[0].sum(&[], false).try_backward(None).unwrap_err();
    println!("no backward registered: {err}");
    Ok(())
}
