//! The CUDA kernel slot of the fused cross-entropy custom ops
//! (`tessera::cross_entropy`, `tessera::cross_entropy_backward`): the
//! generated kernels of `codegen::cross_entropy` on the backend's stream.

use tessera::custom_op::{self, Attrs, Backend};
use tessera::error::{Error, ErrorKind, Result};
use tessera::ir::custom::cross_entropy::{ignore_index, row_dtype, BACKWARD, FORWARD};
use tessera::runtime::array::Array;
use tessera::Tensor;

use super::first;
use crate::codegen::cross_entropy::{self, Rows};
use crate::codegen::index::IndexCheck;
use crate::kernel_errors::{launched_at, Check, Site};
use crate::CudaBackend;

/// Fills the CUDA slots of the cross-entropy ops.
pub(crate) fn register() -> Result<()> {
    custom_op::lookup(FORWARD)?.set_kernel(Backend::Cuda, forward);
    custom_op::lookup(BACKWARD)?.set_kernel(Backend::Cuda, backward);
    Ok(())
}

/// `t` itself when its last dim is dense (the kernels take a row stride
/// for the logits; the per-row operands are 1-D), else a copy.
fn dense_rows(t: &Tensor) -> Tensor {
    let last = t.rank() - 1;
    match t.strides()[last] == 1 || t.shape()[last] <= 1 {
        true => t.clone(),
        false => t.contiguous(),
    }
}

/// A new device tensor of `dtype` and `shape`.
fn empty(backend: &CudaBackend, dtype: tessera::DType, shape: &[usize]) -> Result<Tensor> {
    let storage = backend.empty(dtype, shape.iter().product())?;
    Ok(Tensor::from_device_storage(storage, shape))
}

/// The operands of a call as the kernels see them, and the target check.
fn rows_of(
    backend: &CudaBackend,
    op: &str,
    attrs: &Attrs,
    logits: &Tensor,
    targets: &Tensor,
) -> Result<(Rows, IndexCheck)> {
    let (n, classes) = (logits.shape()[0], logits.shape()[1]);
    let rows = Rows {
        logits_dtype: logits.dtype(),
        target_dtype: targets.dtype(),
        n,
        classes,
        stride: if n > 1 { logits.strides()[0] } else { classes },
        ignore_index: ignore_index(op, attrs)?,
    };
    let at = launched_at();
    let site = backend.gpu.errors.site(Site {
        op: op.to_string(),
        check: Check::Index(format!("out of range for {classes} classes (a target)")),
        context: format!(
            "targets {} {:?} for logits {} {:?}{at}",
            targets.dtype(),
            targets.shape(),
            logits.dtype(),
            logits.shape()
        ),
    });
    let check = IndexCheck {
        bound: classes,
        site,
        report: backend.gpu.errors.device,
    };
    Ok((rows, check))
}

fn address(t: &Tensor) -> u64 {
    first(t.array())
}

fn forward(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let backend = crate::backend()?;
    let (logits, targets) = (dense_rows(inputs[0]), dense_rows(inputs[1]));
    let (rows, check) = rows_of(&backend, FORWARD, attrs, &logits, &targets)?;
    let dtype = row_dtype(logits.dtype());
    let (nll, lse) = (
        empty(&backend, dtype, &[rows.n])?,
        empty(&backend, dtype, &[rows.n])?,
    );
    if rows.n > 0 {
        if rows.classes == 0 {
            return Err(Error::op(
                ErrorKind::Argument,
                FORWARD,
                format!("logits {:?} have no classes", logits.shape()),
            ));
        }
        let launch = cross_entropy::forward(
            &rows,
            address(&logits),
            address(&targets),
            address(&nll),
            address(&lse),
            check,
            backend.gpu.sms,
        );
        timed(
            &backend,
            FORWARD,
            &[logits.array(), targets.array()],
            || backend.launch(FORWARD, &launch),
        )?;
    }
    Ok(vec![nll, lse])
}

fn backward(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let backend = crate::backend()?;
    let (logits, targets) = (dense_rows(inputs[0]), dense_rows(inputs[1]));
    let (lse, d_nll) = (dense_rows(inputs[2]), dense_rows(inputs[3]));
    let (rows, check) = rows_of(&backend, BACKWARD, attrs, &logits, &targets)?;
    let dx = empty(&backend, logits.dtype(), logits.shape())?;
    if rows.n > 0 && rows.classes > 0 {
        let launch = cross_entropy::backward(
            &rows,
            address(&logits),
            address(&targets),
            address(&lse),
            address(&d_nll),
            address(&dx),
            check,
            backend.gpu.sms,
        );
        timed(
            &backend,
            BACKWARD,
            &[logits.array(), targets.array()],
            || backend.launch(BACKWARD, &launch),
        )?;
    }
    Ok(vec![dx])
}

/// `run` timed under `TESSERA_CUDA_PROFILE` as `op` on `inputs`.
fn timed(
    backend: &CudaBackend,
    op: &str,
    inputs: &[&Array],
    run: impl FnOnce() -> Result<()>,
) -> Result<()> {
    crate::profile::timed(backend, || op.to_string(), inputs, run)
}
