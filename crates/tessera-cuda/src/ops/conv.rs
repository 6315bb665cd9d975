//! The CUDA kernel slots of the convolution and pooling custom ops
//! (`tessera::conv2d`, its input and weight gradients, `max_pool2d`,
//! `avg_pool2d` and their gradients) on the backend's stream. Operands are
//! made contiguous first; the attributes and sizes are checked by the ops'
//! signatures before a kernel runs.
//!
//! A convolution pass runs through cuDNN (`crate::cudnn`: tensor-core
//! engines, many times faster) when it can, then the bias and activation
//! the compiler fused into the op (`conv_epilogue`) as one pass over the
//! output; otherwise — f64, uneven padding, no libcudnn, an unaligned view,
//! `TESSERA_CUDA_CONV=direct` — through the direct kernels of
//! `codegen::conv`, which fuse the epilogue themselves. Pooling always runs
//! the direct kernels (memory-bound: one pass either way).

use tessera::custom_op::{self, Attrs, Backend};
use tessera::error::{Error, ErrorKind, Result};
use tessera::ir::custom::conv::{
    check_conv, check_pool, Activation, Conv2d, Pool2d, AVG_POOL2D, AVG_POOL2D_BACKWARD, CONV2D,
    CONV2D_BACKWARD_INPUT, CONV2D_BACKWARD_WEIGHT, MAX_POOL2D, MAX_POOL2D_BACKWARD,
};
use tessera::ir::TensorType;
use tessera::{DType, Tensor};

use super::{device_err, first};
use crate::codegen::conv::{self as kernels, ConvShape, PoolShape};
use crate::codegen::Launch;
use crate::cudnn::{self, Pass};
use crate::CudaBackend;

/// Fills the CUDA slots of the convolution and pooling ops.
pub(crate) fn register() -> Result<()> {
    custom_op::lookup(CONV2D)?.set_kernel(Backend::Cuda, conv2d);
    custom_op::lookup(CONV2D_BACKWARD_INPUT)?.set_kernel(Backend::Cuda, backward_input);
    custom_op::lookup(CONV2D_BACKWARD_WEIGHT)?.set_kernel(Backend::Cuda, backward_weight);
    custom_op::lookup(MAX_POOL2D)?.set_kernel(Backend::Cuda, max_pool2d);
    custom_op::lookup(MAX_POOL2D_BACKWARD)?.set_kernel(Backend::Cuda, max_pool2d_backward);
    custom_op::lookup(AVG_POOL2D)?.set_kernel(Backend::Cuda, avg_pool2d);
    custom_op::lookup(AVG_POOL2D_BACKWARD)?.set_kernel(Backend::Cuda, avg_pool2d_backward);
    Ok(())
}

fn dense(t: &Tensor) -> Result<Tensor> {
    match t.is_contiguous() {
        true => Ok(t.clone()),
        false => t.try_contiguous(),
    }
}

fn empty(backend: &CudaBackend, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let storage = backend.empty(dtype, shape.iter().product())?;
    Ok(Tensor::from_device_storage(storage, shape))
}

fn address(t: &Tensor) -> u64 {
    first(t.array())
}

fn four(s: &[usize]) -> [usize; 4] {
    [s[0], s[1], s[2], s[3]]
}

fn pair(op: &str, attrs: &Attrs, key: &str) -> Result<[usize; 2]> {
    let bad = || {
        Error::op(
            ErrorKind::Argument,
            op,
            format!("needs attribute `{key}`: [height, width]"),
        )
    };
    let v = attrs.get(key).and_then(|v| v.as_array()).ok_or_else(bad)?;
    match v.as_slice() {
        [h, w] => Ok([
            h.as_u64().ok_or_else(bad)? as usize,
            w.as_u64().ok_or_else(bad)? as usize,
        ]),
        _ => Err(bad()),
    }
}

/// The sizes of a convolution of input `x` by weight `w`, checked.
fn conv_shape(
    op: &str,
    conv: Conv2d,
    dtype: DType,
    x: [usize; 4],
    w: [usize; 4],
) -> Result<ConvShape> {
    let (_, _, out_hw) = check_conv(
        op,
        &conv,
        &TensorType::new(dtype, &x[..]),
        &TensorType::new(dtype, &w[..]),
    )?;
    Ok(ConvShape {
        dtype,
        input: x,
        weight: w,
        out_hw,
        conv,
    })
}

/// Queues `launch` unless it has nothing to compute.
fn run(backend: &CudaBackend, op: &str, items: usize, launch: Launch) -> Result<()> {
    match items {
        0 => Ok(()),
        _ => backend.launch(op, &launch),
    }
}

/// Runs `pass` of convolution `s` (operands `a`, `b`, result `out`, see
/// `cudnn::Dnn::conv`) through cuDNN when it can, else through the direct
/// kernel `direct()` builds; `Ok(true)` when cuDNN ran it.
fn conv_pass(
    backend: &CudaBackend,
    op: &str,
    pass: Pass,
    s: &ConvShape,
    [a, b, out]: [u64; 3],
    direct: impl FnOnce() -> Launch,
) -> Result<bool> {
    let fast = backend
        .dnn
        .conv(&backend.gpu, pass, s, a, b, out)
        .map_err(|m| device_err(op, m))?;
    if !fast {
        backend.launch(op, &direct())?;
        cudnn::count_direct();
    }
    Ok(fast)
}

fn conv2d(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let backend = crate::backend()?;
    let conv = Conv2d::from_attrs(CONV2D, attrs)?;
    let (x, w) = (dense(inputs[0])?, dense(inputs[1])?);
    let b = inputs.get(2).map(|b| dense(b)).transpose()?;
    let s = conv_shape(CONV2D, conv, x.dtype(), four(x.shape()), four(w.shape()))?;
    let shape = [s.input[0], s.weight[0], s.out_hw[0], s.out_hw[1]];
    let y = empty(&backend, x.dtype(), &shape)?;
    if y.numel() == 0 {
        return Ok(vec![y]);
    }
    let (xa, wa, ya, ba) = (
        address(&x),
        address(&w),
        address(&y),
        b.as_ref().map(address),
    );
    let sms = backend.gpu.sms;
    let direct = || kernels::conv2d_forward(&s, xa, wa, ba, ya, sms);
    let fast = conv_pass(&backend, CONV2D, Pass::Forward, &s, [xa, wa, ya], direct)?;
    // cuDNN computed the bare convolution: the bias and activation follow.
    if fast && (ba.is_some() || s.conv.activation != Activation::None) {
        let sizes = [shape[0], shape[1], shape[2] * shape[3]];
        let epilogue = kernels::conv2d_epilogue(s.dtype, sizes, ba, s.conv.activation, ya, sms);
        backend.launch(CONV2D, &epilogue)?;
    }
    Ok(vec![y])
}

fn backward_input(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let op = CONV2D_BACKWARD_INPUT;
    let backend = crate::backend()?;
    let conv = Conv2d::from_attrs(op, attrs)?;
    let [h, wd] = pair(op, attrs, "input_hw")?;
    let (dy, w) = (dense(inputs[0])?, dense(inputs[1])?);
    let x = [dy.shape()[0], w.shape()[1] * conv.groups, h, wd];
    let s = conv_shape(op, conv, dy.dtype(), x, four(w.shape()))?;
    let dx = empty(&backend, dy.dtype(), &x)?;
    if dx.numel() == 0 {
        return Ok(vec![dx]);
    }
    let operands = [address(&dy), address(&w), address(&dx)];
    let [dya, wa, dxa] = operands;
    let sms = backend.gpu.sms;
    let direct = || kernels::conv2d_backward_input(&s, dya, wa, dxa, sms);
    conv_pass(&backend, op, Pass::BackwardData, &s, operands, direct)?;
    Ok(vec![dx])
}

fn backward_weight(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let op = CONV2D_BACKWARD_WEIGHT;
    let backend = crate::backend()?;
    let conv = Conv2d::from_attrs(op, attrs)?;
    let [kh, kw] = pair(op, attrs, "kernel_hw")?;
    let (x, dy) = (dense(inputs[0])?, dense(inputs[1])?);
    let w = [dy.shape()[1], x.shape()[1] / conv.groups, kh, kw];
    let s = conv_shape(op, conv, x.dtype(), four(x.shape()), w)?;
    let dw = empty(&backend, x.dtype(), &w)?;
    if dw.numel() == 0 {
        return Ok(vec![dw]);
    }
    let operands = [address(&x), address(&dy), address(&dw)];
    let [xa, dya, dwa] = operands;
    let sms = backend.gpu.sms;
    let direct = || kernels::conv2d_backward_weight(&s, xa, dya, dwa, sms);
    conv_pass(&backend, op, Pass::BackwardFilter, &s, operands, direct)?;
    Ok(vec![dw])
}

/// The sizes of a pooling of an input `[n, c, h, w]`, checked.
fn pool_shape(op: &str, pool: Pool2d, dtype: DType, x: [usize; 4]) -> Result<PoolShape> {
    let (_, out_hw) = check_pool(op, &pool, &TensorType::new(dtype, &x[..]))?;
    Ok(PoolShape {
        dtype,
        planes: x[0] * x[1],
        hw: [x[2], x[3]],
        out_hw,
        pool,
    })
}

fn max_pool2d(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let backend = crate::backend()?;
    let pool = Pool2d::from_attrs(MAX_POOL2D, attrs)?;
    let x = dense(inputs[0])?;
    let s = pool_shape(MAX_POOL2D, pool, x.dtype(), four(x.shape()))?;
    let shape = [x.shape()[0], x.shape()[1], s.out_hw[0], s.out_hw[1]];
    let y = empty(&backend, x.dtype(), &shape)?;
    let idx = empty(&backend, DType::I64, &shape)?;
    let launch =
        kernels::max_pool2d_forward(&s, address(&x), address(&y), address(&idx), backend.gpu.sms);
    run(&backend, MAX_POOL2D, y.numel(), launch)?;
    Ok(vec![y, idx])
}

fn max_pool2d_backward(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let op = MAX_POOL2D_BACKWARD;
    let backend = crate::backend()?;
    let pool = Pool2d::from_attrs(op, attrs)?;
    let [h, w] = pair(op, attrs, "input_hw")?;
    let (dy, idx) = (dense(inputs[0])?, dense(inputs[1])?);
    let x = [dy.shape()[0], dy.shape()[1], h, w];
    let s = pool_shape(op, pool, dy.dtype(), x)?;
    let dx = empty(&backend, dy.dtype(), &x)?;
    let launch = kernels::max_pool2d_backward(
        &s,
        address(&dy),
        address(&idx),
        address(&dx),
        backend.gpu.sms,
    );
    run(&backend, op, dx.numel(), launch)?;
    Ok(vec![dx])
}

fn avg_pool2d(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let backend = crate::backend()?;
    let pool = Pool2d::from_attrs(AVG_POOL2D, attrs)?;
    let x = dense(inputs[0])?;
    let s = pool_shape(AVG_POOL2D, pool, x.dtype(), four(x.shape()))?;
    let shape = [x.shape()[0], x.shape()[1], s.out_hw[0], s.out_hw[1]];
    let y = empty(&backend, x.dtype(), &shape)?;
    let launch = kernels::avg_pool2d_forward(&s, address(&x), address(&y), backend.gpu.sms);
    run(&backend, AVG_POOL2D, y.numel(), launch)?;
    Ok(vec![y])
}

fn avg_pool2d_backward(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let op = AVG_POOL2D_BACKWARD;
    let backend = crate::backend()?;
    let pool = Pool2d::from_attrs(op, attrs)?;
    let [h, w] = pair(op, attrs, "input_hw")?;
    let dy = dense(inputs[0])?;
    let x = [dy.shape()[0], dy.shape()[1], h, w];
    let s = pool_shape(op, pool, dy.dtype(), x)?;
    let dx = empty(&backend, dy.dtype(), &x)?;
    let launch = kernels::avg_pool2d_backward(&s, address(&dy), address(&dx), backend.gpu.sms);
    run(&backend, op, dx.numel(), launch)?;
    Ok(vec![dx])
}
