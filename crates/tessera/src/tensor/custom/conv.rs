//! The built-in convolution and pooling ops' implementation: CPU kernels
//! (through `runtime::cpu::conv`) and backward rules (their signatures are
//! `ir::custom::conv`'s; the user-facing calls are `Tensor::conv2d` and
//! friends in `tensor::cnn`).
//!
//! Backward rules, written with the ops themselves so they run eagerly and
//! are captured by AOT autograd alike:
//! - `conv2d(x, w[, b])`: `g = dy` (`dy · [y > 0]` under the ReLU
//!   epilogue), `dx = conv2d_backward_input(g, w)`, `dw =
//!   conv2d_backward_weight(x, g)`, `db = Σ g` over N, H, W;
//! - `conv2d_backward_input(a, w)` (also `conv_transpose2d`'s forward):
//!   `da = conv2d(G, w)`, `dw = conv2d_backward_weight(G, a)`;
//! - `conv2d_backward_weight(x, a)`: `dx = conv2d_backward_input(a, G)`,
//!   `da = conv2d(x, G)` (so convolutions have second derivatives);
//! - `max_pool2d`: `dx = max_pool2d_backward(dy, indices)`;
//! - `avg_pool2d`: `dx = avg_pool2d_backward(dy)`.
//!
//! The convolution kernels compute in f32 (f64 for f64): f16 and bf16
//! operands are widened to f32 and the result rounded once.

use std::sync::Arc;

use half::{bf16, f16};

use super::{Attrs, BackwardCtx, CustomOp};
use crate::error::{op_err, Result};
use crate::ir::custom::conv::{
    check_conv, check_pool, Activation, Conv2d, Pool2d, AVG_POOL2D, AVG_POOL2D_BACKWARD, CONV2D,
    CONV2D_BACKWARD_INPUT, CONV2D_BACKWARD_WEIGHT, MAX_POOL2D, MAX_POOL2D_BACKWARD,
};
use crate::ir::DType;
use crate::runtime::cpu::conv::{self as kernels, ConvDims, ConvFloat, PoolDims};
use crate::runtime::cpu::{Element, Float, Storage};
use crate::tensor::Tensor;

/// The built-in ops this module implements.
pub(super) fn builtins() -> Vec<Arc<CustomOp>> {
    let op = |name: &str,
              kernel: fn(&Attrs, &[&Tensor]) -> Result<Vec<Tensor>>,
              backward: fn(&BackwardCtx<'_>) -> Result<Vec<Option<Tensor>>>| {
        CustomOp::builder(name)
            .cpu(kernel)
            .backward(backward)
            .implement_builtin()
            .expect("a built-in signature")
    };
    vec![
        op(CONV2D, conv2d_kernel, conv2d_backward),
        op(
            CONV2D_BACKWARD_INPUT,
            backward_input_kernel,
            backward_input_backward,
        ),
        op(
            CONV2D_BACKWARD_WEIGHT,
            backward_weight_kernel,
            backward_weight_backward,
        ),
        op(MAX_POOL2D, max_pool2d_kernel, max_pool2d_backward),
        op(
            MAX_POOL2D_BACKWARD,
            max_pool2d_backward_kernel,
            max_pool2d_backward_backward,
        ),
        op(AVG_POOL2D, avg_pool2d_kernel, avg_pool2d_backward),
        op(
            AVG_POOL2D_BACKWARD,
            avg_pool2d_backward_kernel,
            avg_pool2d_backward_backward,
        ),
    ]
}

/// Calls built-in op `name`.
fn call(name: &str, attrs: Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    super::lookup(name)?.call(attrs, inputs)
}

/// The attributes of a convolution op derived from `attrs`: the same
/// geometry without epilogue, plus `extra`.
fn derived(conv: &Conv2d, extra: Option<(&str, [usize; 2])>) -> Attrs {
    let plain = Conv2d {
        activation: Activation::None,
        ..*conv
    };
    let mut a = plain.attrs();
    if let Some((key, hw)) = extra {
        a.insert(key.into(), hw.to_vec().into());
    }
    a
}

fn hw(t: &Tensor) -> [usize; 2] {
    [t.shape()[2], t.shape()[3]]
}

/// `t` row-major in f32 (f64 for f64): what the convolution kernels read.
fn wide(t: &Tensor) -> Result<Tensor> {
    let t = match t.dtype() {
        DType::F16 | DType::BF16 => t.try_cast(DType::F32)?,
        _ => t.clone(),
    };
    match t.is_contiguous() {
        true => Ok(t),
        false => t.try_contiguous(),
    }
}

/// A new tensor of `shape` whose `ConvFloat` elements `fill` writes, in
/// the kernels' dtype, then rounded to `dtype`.
fn conv_output(
    op: &str,
    dtype: DType,
    shape: &[usize],
    fill_f32: impl FnOnce(&mut [f32]),
    fill_f64: impl FnOnce(&mut [f64]),
) -> Result<Tensor> {
    let n = shape.iter().product();
    let wide = match dtype {
        DType::F64 => {
            let mut s = Storage::new(DType::F64, n);
            fill_f64(s.as_mut_slice::<f64>());
            s
        }
        DType::F32 | DType::F16 | DType::BF16 => {
            let mut s = Storage::new(DType::F32, n);
            fill_f32(s.as_mut_slice::<f32>());
            s
        }
        other => return Err(op_err!(DType, op, "has no kernel for {other}")),
    };
    let t = Tensor::from_storage(wide, shape);
    match dtype {
        DType::F16 | DType::BF16 => t.try_cast(dtype),
        _ => Ok(t),
    }
}

fn slice<T: ConvFloat>(t: &Tensor) -> &[T] {
    t.contiguous_slice::<T>()
        .expect("made contiguous in the kernel's dtype")
}

/// The sizes of a convolution of input `[n, c, h, w]` by weight `w`.
fn dims(op: &str, conv: Conv2d, x: &[usize], w: &[usize]) -> Result<ConvDims> {
    let xt = crate::ir::TensorType::new(DType::F32, x);
    let wt = crate::ir::TensorType::new(DType::F32, w);
    let (_, [o, _, kh, kw], [ho, wo]) = check_conv(op, &conv, &xt, &wt)?;
    Ok(ConvDims {
        n: x[0],
        c: x[1],
        h: x[2],
        w: x[3],
        o,
        kh,
        kw,
        ho,
        wo,
        conv,
    })
}

fn conv2d_kernel(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let conv = Conv2d::from_attrs(CONV2D, attrs)?;
    let d = dims(CONV2D, conv, inputs[0].shape(), inputs[1].shape())?;
    let x = wide(inputs[0])?;
    let w = wide(inputs[1])?;
    let b = inputs.get(2).map(|b| wide(b)).transpose()?;
    let shape = [d.n, d.o, d.ho, d.wo];
    let y = conv_output(
        CONV2D,
        inputs[0].dtype(),
        &shape,
        |y| kernels::conv2d_forward(&d, slice(&x), slice(&w), b.as_ref().map(slice), y),
        |y| kernels::conv2d_forward(&d, slice(&x), slice(&w), b.as_ref().map(slice), y),
    )?;
    Ok(vec![y])
}

fn backward_input_kernel(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let op = CONV2D_BACKWARD_INPUT;
    let conv = Conv2d::from_attrs(op, attrs)?;
    let (dy, w) = (inputs[0], inputs[1]);
    let [h, wd] = input_hw(op, attrs, "input_hw")?;
    let x_shape = [dy.shape()[0], w.shape()[1] * conv.groups, h, wd];
    let d = dims(op, conv, &x_shape, w.shape())?;
    let (dy, w) = (wide(dy)?, wide(w)?);
    let dx = conv_output(
        op,
        inputs[0].dtype(),
        &x_shape,
        |dx| kernels::conv2d_backward_input(&d, slice(&dy), slice(&w), dx),
        |dx| kernels::conv2d_backward_input(&d, slice(&dy), slice(&w), dx),
    )?;
    Ok(vec![dx])
}

fn backward_weight_kernel(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let op = CONV2D_BACKWARD_WEIGHT;
    let conv = Conv2d::from_attrs(op, attrs)?;
    let (x, dy) = (inputs[0], inputs[1]);
    let [kh, kw] = input_hw(op, attrs, "kernel_hw")?;
    let w_shape = [dy.shape()[1], x.shape()[1] / conv.groups, kh, kw];
    let d = dims(op, conv, x.shape(), &w_shape)?;
    let (x, dy) = (wide(x)?, wide(dy)?);
    let dw = conv_output(
        op,
        inputs[0].dtype(),
        &w_shape,
        |dw| kernels::conv2d_backward_weight(&d, slice(&x), slice(&dy), dw),
        |dw| kernels::conv2d_backward_weight(&d, slice(&x), slice(&dy), dw),
    )?;
    Ok(vec![dw])
}

fn input_hw(op: &str, attrs: &Attrs, key: &str) -> Result<[usize; 2]> {
    let bad = || op_err!(Argument, op, "needs attribute `{key}`: [height, width]");
    let list = attrs.get(key).and_then(|v| v.as_array()).ok_or_else(bad)?;
    match list.as_slice() {
        [h, w] => Ok([
            h.as_u64().ok_or_else(bad)? as usize,
            w.as_u64().ok_or_else(bad)? as usize,
        ]),
        _ => Err(bad()),
    }
}

fn conv2d_backward(ctx: &BackwardCtx<'_>) -> Result<Vec<Option<Tensor>>> {
    let conv = Conv2d::from_attrs(CONV2D, ctx.attrs)?;
    let (x, w, y) = (&ctx.inputs[0], &ctx.inputs[1], &ctx.outputs[0]);
    let g = match conv.activation {
        Activation::None => ctx.grads[0].clone(),
        Activation::Relu => {
            let zero = Tensor::try_full(&[], 0.0, y.dtype())?;
            Tensor::try_where(&y.try_gt(&zero)?, &ctx.grads[0], &zero)?
        }
    };
    let dx = call(
        CONV2D_BACKWARD_INPUT,
        derived(&conv, Some(("input_hw", hw(x)))),
        &[&g, w],
    )?;
    let kernel = [w.shape()[2], w.shape()[3]];
    let dw = call(
        CONV2D_BACKWARD_WEIGHT,
        derived(&conv, Some(("kernel_hw", kernel))),
        &[x, &g],
    )?;
    let mut grads = vec![dx.into_iter().next(), dw.into_iter().next()];
    if ctx.inputs.len() == 3 {
        grads.push(Some(g.try_sum(&[0, 2, 3], false)?));
    }
    Ok(grads)
}

fn backward_input_backward(ctx: &BackwardCtx<'_>) -> Result<Vec<Option<Tensor>>> {
    let conv = Conv2d::from_attrs(CONV2D_BACKWARD_INPUT, ctx.attrs)?;
    let (a, w, g) = (&ctx.inputs[0], &ctx.inputs[1], &ctx.grads[0]);
    let da = call(CONV2D, derived(&conv, None), &[g, w])?;
    let kernel = [w.shape()[2], w.shape()[3]];
    let dw = call(
        CONV2D_BACKWARD_WEIGHT,
        derived(&conv, Some(("kernel_hw", kernel))),
        &[g, a],
    )?;
    Ok(vec![da.into_iter().next(), dw.into_iter().next()])
}

fn backward_weight_backward(ctx: &BackwardCtx<'_>) -> Result<Vec<Option<Tensor>>> {
    let conv = Conv2d::from_attrs(CONV2D_BACKWARD_WEIGHT, ctx.attrs)?;
    let (x, a, g) = (&ctx.inputs[0], &ctx.inputs[1], &ctx.grads[0]);
    let dx = call(
        CONV2D_BACKWARD_INPUT,
        derived(&conv, Some(("input_hw", hw(x)))),
        &[a, g],
    )?;
    let da = call(CONV2D, derived(&conv, None), &[x, g])?;
    Ok(vec![dx.into_iter().next(), da.into_iter().next()])
}

fn contiguous(t: &Tensor) -> Result<Tensor> {
    match t.is_contiguous() {
        true => Ok(t.clone()),
        false => t.try_contiguous(),
    }
}

fn pool_dims(op: &str, pool: Pool2d, x: &[usize]) -> Result<PoolDims> {
    let ty = crate::ir::TensorType::new(DType::F32, x);
    let (_, [ho, wo]) = check_pool(op, &pool, &ty)?;
    Ok(PoolDims {
        planes: x[0] * x[1],
        h: x[2],
        w: x[3],
        ho,
        wo,
        pool,
    })
}

fn elements<T: Float>(t: &Tensor) -> &[T] {
    t.contiguous_slice::<T>().expect("made contiguous")
}

fn max_pool2d_kernel(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let pool = Pool2d::from_attrs(MAX_POOL2D, attrs)?;
    let x = contiguous(inputs[0])?;
    let d = pool_dims(MAX_POOL2D, pool, x.shape())?;
    let shape = [x.shape()[0], x.shape()[1], d.ho, d.wo];
    let n = d.planes * d.ho * d.wo;
    with_float_type!(MAX_POOL2D, x.dtype(), T => {
        let mut y = Storage::new(T::DTYPE, n);
        let mut idx = Storage::new(DType::I64, n);
        kernels::max_pool2d_forward(&d, elements::<T>(&x), y.as_mut_slice::<T>(), idx.as_mut_slice::<i64>());
        Ok(vec![Tensor::from_storage(y, &shape), Tensor::from_storage(idx, &shape)])
    })
}

fn max_pool2d_backward_kernel(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let op = MAX_POOL2D_BACKWARD;
    let pool = Pool2d::from_attrs(op, attrs)?;
    let [h, w] = input_hw(op, attrs, "input_hw")?;
    let (dy, idx) = (contiguous(inputs[0])?, contiguous(inputs[1])?);
    let shape = [dy.shape()[0], dy.shape()[1], h, w];
    let d = pool_dims(op, pool, &shape)?;
    with_float_type!(op, dy.dtype(), T => {
        let mut dx = Storage::new(T::DTYPE, d.planes * h * w);
        let idx = idx.contiguous_slice::<i64>().expect("made contiguous");
        kernels::max_pool2d_backward(&d, elements::<T>(&dy), idx, dx.as_mut_slice::<T>());
        Ok(vec![Tensor::from_storage(dx, &shape)])
    })
}

fn avg_pool2d_kernel(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let pool = Pool2d::from_attrs(AVG_POOL2D, attrs)?;
    let x = contiguous(inputs[0])?;
    let d = pool_dims(AVG_POOL2D, pool, x.shape())?;
    let shape = [x.shape()[0], x.shape()[1], d.ho, d.wo];
    with_float_type!(AVG_POOL2D, x.dtype(), T => {
        let mut y = Storage::new(T::DTYPE, d.planes * d.ho * d.wo);
        kernels::avg_pool2d_forward(&d, elements::<T>(&x), y.as_mut_slice::<T>());
        Ok(vec![Tensor::from_storage(y, &shape)])
    })
}

fn avg_pool2d_backward_kernel(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let op = AVG_POOL2D_BACKWARD;
    let pool = Pool2d::from_attrs(op, attrs)?;
    let [h, w] = input_hw(op, attrs, "input_hw")?;
    let dy = contiguous(inputs[0])?;
    let shape = [dy.shape()[0], dy.shape()[1], h, w];
    let d = pool_dims(op, pool, &shape)?;
    with_float_type!(op, dy.dtype(), T => {
        let mut dx = Storage::new(T::DTYPE, d.planes * h * w);
        kernels::avg_pool2d_backward(&d, elements::<T>(&dy), dx.as_mut_slice::<T>());
        Ok(vec![Tensor::from_storage(dx, &shape)])
    })
}

fn max_pool2d_backward(ctx: &BackwardCtx<'_>) -> Result<Vec<Option<Tensor>>> {
    let mut attrs = ctx.attrs.clone();
    attrs.insert("input_hw".into(), hw(&ctx.inputs[0]).to_vec().into());
    let dx = call(
        MAX_POOL2D_BACKWARD,
        attrs,
        &[&ctx.grads[0], &ctx.outputs[1]],
    )?;
    Ok(vec![dx.into_iter().next()])
}

fn avg_pool2d_backward(ctx: &BackwardCtx<'_>) -> Result<Vec<Option<Tensor>>> {
    let mut attrs = ctx.attrs.clone();
    attrs.insert("input_hw".into(), hw(&ctx.inputs[0]).to_vec().into());
    let dx = call(AVG_POOL2D_BACKWARD, attrs, &[&ctx.grads[0]])?;
    Ok(vec![dx.into_iter().next()])
}

/// Average pooling's backward is linear in `dy`; its adjoint is average
/// pooling again.
fn avg_pool2d_backward_backward(ctx: &BackwardCtx<'_>) -> Result<Vec<Option<Tensor>>> {
    let mut attrs = ctx.attrs.clone();
    attrs.remove("input_hw");
    let d = call(AVG_POOL2D, attrs, &[&ctx.grads[0]])?;
    Ok(vec![d.into_iter().next()])
}

/// The max-pool backward is linear in `dy`: its adjoint gathers the
/// gradient at the indices.
fn max_pool2d_backward_backward(ctx: &BackwardCtx<'_>) -> Result<Vec<Option<Tensor>>> {
    let (dy, idx, g) = (&ctx.inputs[0], &ctx.inputs[1], &ctx.grads[0]);
    let s = g.shape();
    let planes = g.try_reshape(&[s[0] as isize, s[1] as isize, -1])?;
    let at = idx.try_reshape(&[s[0] as isize, s[1] as isize, -1])?;
    let shape: Vec<isize> = dy.shape().iter().map(|&d| d as isize).collect();
    let d = planes.try_gather(2, &at)?.try_reshape(&shape)?;
    Ok(vec![Some(d), None])
}
