//! The CUDA kernel slot of tessera's flash attention custom ops: the
//! `tessera::flash_attention` forward and `tessera::flash_attention_backward`
//! run the tensor-core kernels of [`crate::flash`] on device tensors.
//!
//! The kernels go onto the backend's own stream, in order with every other
//! kernel and with the caching allocator's reuse of blocks (see `gpu`), so a
//! call neither waits for the GPU nor makes it wait: the 256 per-slice calls
//! of a sliced graph used to synchronise twice each. The module is loaded
//! through cudarc into the device's primary context, the one the backend
//! retains too, so pointers and stream are shared.

use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaContext;
use tessera::custom_op::flash_attention::{self, BACKWARD, FORWARD};
use tessera::custom_op::{self, Attrs, Backend};
use tessera::error::{Error, ErrorKind, Result};
use tessera::ir::DType;
use tessera::runtime::device::DeviceStorage;
use tessera::Tensor;

use crate::flash::{self, BwdPtrs, FlashDType, FlashDims, FwdPtrs, Queue};
use crate::CudaBackend;

/// Fills the CUDA slots of the flash attention ops.
pub(crate) fn register() -> Result<()> {
    custom_op::lookup(FORWARD)?.set_kernel(Backend::Cuda, forward);
    custom_op::lookup(BACKWARD)?.set_kernel(Backend::Cuda, backward);
    Ok(())
}

fn err(op: &str, message: impl Into<String>) -> Error {
    Error::op(ErrorKind::Device, op, message.into())
}

/// A launcher error (about `flash_attention`) as one about the custom op `op`, its
/// kind and message kept.
fn about(op: &str) -> impl Fn(Error) -> Error + '_ {
    move |e| Error {
        op: Some(op.to_string()),
        ..e
    }
}

/// cudarc's handle on the primary context (loads and caches the module).
fn context() -> Result<Arc<CudaContext>> {
    static CTX: OnceLock<std::result::Result<Arc<CudaContext>, String>> = OnceLock::new();
    CTX.get_or_init(|| {
        CudaContext::new(0).map_err(|e| format!("opening the primary context: {e:?}"))
    })
    .clone()
    .map_err(|m| err(FORWARD, m))
}

fn params(attrs: &Attrs) -> Result<(bool, f32)> {
    let p = flash_attention::params(attrs)?;
    Ok((p.causal, p.scale))
}

fn dtype_of(t: &Tensor) -> Result<FlashDType> {
    match t.dtype() {
        DType::F32 => Ok(FlashDType::F32),
        DType::F16 => Ok(FlashDType::F16),
        DType::BF16 => Ok(FlashDType::BF16),
        d => Err(Error::op(
            ErrorKind::DType,
            FORWARD,
            format!("has no CUDA kernel for {d}"),
        )),
    }
}

/// `[B, H, L, D]` dims of q and k (rank-3 `[BH, L, D]` reads as B = 1).
fn dims(q: &Tensor, k: &Tensor) -> FlashDims {
    let r = q.rank();
    let d = q.shape()[r - 1];
    let lead = &q.shape()[..r - 2];
    let (batch, heads) = match lead {
        [] => (1, 1),
        [h] => (1, *h),
        [b, rest @ ..] => (*b, rest.iter().product()),
    };
    FlashDims {
        batch,
        heads,
        q_len: q.shape()[r - 2],
        kv_len: k.shape()[r - 2],
        head_dim: d,
    }
}

/// Why the kernels cannot take a call that the op itself allows (the
/// composite then runs it): an additive mask, or v's head dim unlike q's.
fn beyond_the_kernels(q: &Tensor, v: &Tensor, masked: bool) -> Option<String> {
    let r = q.rank();
    if masked {
        return Some("an additive mask (the kernels take none)".into());
    }
    (v.shape()[r - 1] != q.shape()[r - 1]).then(|| {
        format!(
            "v's head dim differs from q's (q {}, v {}; the kernels need them equal)",
            q.ty(),
            v.ty()
        )
    })
}

/// The device address of `t`'s first element (a device tensor with values).
fn ptr(t: &Tensor) -> u64 {
    crate::ops::first(t.array())
}

fn empty(backend: &CudaBackend, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let storage: DeviceStorage = backend.empty(dtype, shape.iter().product())?;
    Ok(Tensor::from_device_storage(storage, shape))
}

/// Queues `launch` on the backend's stream.
fn on_backend_stream(
    backend: &CudaBackend,
    op: &str,
    launch: impl FnOnce(Queue<'_>) -> Result<()>,
) -> Result<()> {
    let ctx = context()?;
    let queue = Queue {
        ctx: &ctx,
        stream: backend.gpu.stream(),
    };
    launch(queue).map_err(about(op))
}

/// `t` itself when already dense row-major (the kernels take its first element's
/// address), else a contiguous copy. `contiguous()` always copies: at the seed's
/// shape that was nine 128 MB copies per forward + backward.
fn dense(t: &Tensor) -> Tensor {
    if t.is_contiguous() {
        t.clone()
    } else {
        t.contiguous()
    }
}

/// A scratch tensor of at least `bytes` bytes (f32 elements).
fn scratch(backend: &CudaBackend, bytes: usize) -> Result<Tensor> {
    empty(backend, DType::F32, &[bytes.div_ceil(4)])
}

fn forward(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let (causal, scale) = params(attrs)?;
    let backend = crate::backend()?;
    let (q, k, v) = (dense(inputs[0]), dense(inputs[1]), dense(inputs[2]));
    let mask = inputs.get(3).copied();
    if let Some(why) = beyond_the_kernels(&q, &v, mask.is_some()) {
        log_fallback(&why);
        return composite_forward(&q, &k, &v, mask, causal, scale);
    }
    let dims = dims(&q, &k);
    let dtype = dtype_of(&q)?;
    if let Err(why) = supported(&backend, dtype, &dims) {
        log_fallback(&why);
        return composite_forward(&q, &k, &v, None, causal, scale);
    }
    let r = q.rank();
    let out = empty(&backend, q.dtype(), q.shape())?;
    let lse = empty(&backend, DType::F32, &q.shape()[..r - 1])?;
    let work_bytes =
        flash::forward_workspace_bytes(&*context()?, dtype, &dims).map_err(about(FORWARD))?;
    let workspace = scratch(&backend, work_bytes)?;
    let ptrs = FwdPtrs {
        q: ptr(&q),
        k: ptr(&k),
        v: ptr(&v),
        out: ptr(&out),
        lse: ptr(&lse),
        workspace: ptr(&workspace),
    };
    let variant = tuned_variant(&backend, dtype, &dims, causal, scale, &ptrs)?;
    // SAFETY: every pointer is a live contiguous device allocation of the
    // size `dims` gives; blocks freed after this returns are reused only by
    // work queued behind these kernels on the same stream.
    let arrays = [q.array(), k.array(), v.array()];
    crate::profile::timed(
        &backend,
        || FORWARD.to_string(),
        &arrays,
        || {
            on_backend_stream(&backend, FORWARD, |q| unsafe {
                flash::flash_forward_variant(q, dtype, dims, causal, scale, ptrs, variant)
            })
        },
    )?;
    Ok(vec![out, lse])
}

/// Under a `max-autotune` run, the fastest wgmma forward variant for this
/// call's dtype, shape and causality on this device: cached (memory and
/// disk, keyed by the kernels' source too), or timed once (see
/// `crate::autotune`). The trials write out and lse, which the call
/// overwrites anyway. `None` outside such runs or where there is no choice.
fn tuned_variant(
    backend: &CudaBackend,
    dtype: FlashDType,
    dims: &FlashDims,
    causal: bool,
    scale: f32,
    ptrs: &FwdPtrs,
) -> Result<Option<flash::WgFwd>> {
    if !tessera::runtime::device::tuning() {
        return Ok(None);
    }
    let variants =
        flash::forward_variants(dtype, dims, backend.compute_capability(), backend.gpu.sms);
    if variants.len() < 2 {
        return Ok(None);
    }
    static SOURCE_HASH: OnceLock<String> = OnceLock::new();
    let source = SOURCE_HASH.get_or_init(|| crate::compiler::source_hash(flash::SOURCE, ""));
    let shape = format!("{} {dims:?} causal={causal}", dtype.name());
    let key = crate::autotune::key(source, &shape, &backend.gpu.name);
    let labels: Vec<String> = variants.iter().map(|v| format!("{v:?}")).collect();
    let ctx = context()?;
    let stream = backend.gpu.stream();
    let i = crate::autotune::Tuner::global()
        .choose(
            &format!("flash attention forward {shape}"),
            &key,
            &labels,
            |i| {
                crate::gpu::time_on_stream(stream, crate::autotune::REPS, || {
                    let queue = Queue { ctx: &ctx, stream };
                    // SAFETY: as for the call itself (same pointers and sizes).
                    unsafe {
                        flash::flash_forward_variant(
                            queue,
                            dtype,
                            *dims,
                            causal,
                            scale,
                            *ptrs,
                            Some(variants[i]),
                        )
                    }
                    .map_err(|e| e.to_string())
                })
            },
        )
        .map_err(|m| err(FORWARD, m))?;
    Ok(Some(variants[i]))
}

fn backward(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let (causal, scale) = params(attrs)?;
    let backend = crate::backend()?;
    let c: Vec<Tensor> = inputs.iter().map(|t| dense(t)).collect();
    let (q, k, v, out, lse, d_out) = (&c[0], &c[1], &c[2], &c[3], &c[4], &c[5]);
    let mask = c.get(6);
    if let Some(why) = beyond_the_kernels(q, v, mask.is_some()) {
        log_fallback(&why);
        return composite_backward(q, k, v, mask, out, lse, d_out, causal, scale);
    }
    let dims = dims(q, k);
    let dtype = dtype_of(q)?;
    if let Err(why) = supported(&backend, dtype, &dims) {
        log_fallback(&why);
        return composite_backward(q, k, v, None, out, lse, d_out, causal, scale);
    }
    let dq = empty(&backend, q.dtype(), q.shape())?;
    let dk = empty(&backend, k.dtype(), k.shape())?;
    let dv = empty(&backend, v.dtype(), v.shape())?;
    let work_bytes =
        flash::backward_workspace_bytes(&*context()?, dtype, &dims).map_err(about(BACKWARD))?;
    let workspace = scratch(&backend, work_bytes)?;
    let ptrs = BwdPtrs {
        q: ptr(q),
        k: ptr(k),
        v: ptr(v),
        out: ptr(out),
        d_out: ptr(d_out),
        lse: ptr(lse),
        dq: ptr(&dq),
        dk: ptr(&dk),
        dv: ptr(&dv),
        workspace: ptr(&workspace),
    };
    // SAFETY: as in `forward`; the workspace holds `backward_workspace_bytes`.
    let arrays = [q.array(), k.array(), v.array()];
    crate::profile::timed(
        &backend,
        || BACKWARD.to_string(),
        &arrays,
        || {
            on_backend_stream(&backend, BACKWARD, |q| unsafe {
                flash::flash_backward(q, dtype, dims, causal, scale, ptrs)
            })
        },
    )?;
    Ok(vec![dq, dk, dv])
}

/// Whether the tensor-core launcher has a kernel for this call.
fn supported(
    backend: &CudaBackend,
    dtype: FlashDType,
    dims: &FlashDims,
) -> std::result::Result<(), String> {
    let cc = backend.compute_capability();
    flash::select(dtype, dims.head_dim, cc)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn log_fallback(why: &str) {
    tessera::logging::log("fusion", || {
        format!("flash attention on cuda: {why}; running the composite (scores in memory)")
    });
}

/// Scores `q·kᵀ·scale` plus the additive mask (f32, of the scores'
/// shape or `[Lq, Lk]`), causal positions hidden, in f32.
fn scores(
    q: &Tensor,
    k: &Tensor,
    mask: Option<&Tensor>,
    causal: bool,
    scale: f32,
) -> Result<Tensor> {
    let s = q
        .try_cast(DType::F32)?
        .try_matmul(&k.try_cast(DType::F32)?.try_transpose(-2, -1)?)?
        * scale as f64;
    let s = match mask {
        Some(m) => s.try_add(m)?,
        None => s,
    };
    if !causal {
        return Ok(s);
    }
    let r = s.rank();
    let (lq, lk) = (s.shape()[r - 2], s.shape()[r - 1]);
    let keep = tessera::runtime::device::with_device(s.device(), || {
        Tensor::ones(&[lq, lk], DType::F32)
            .tril(0)
            .cast(DType::Bool)
    });
    let hidden = Tensor::scalar(f64::NEG_INFINITY, DType::F32);
    Tensor::try_where(&keep, &s, &hidden)
}

/// The forward with plain device ops, for calls the launcher has no kernel
/// for: out and the log-sum-exp residual, as the CPU kernel returns them —
/// a row that sees no key (a mask of `-inf` across it) has out 0 and lse
/// `-inf`, never NaN.
fn composite_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    causal: bool,
    scale: f32,
) -> Result<Vec<Tensor>> {
    let s = scores(q, k, mask, causal, scale)?;
    // lse = m + log Σ exp(s − m), m the row max (0 where the row saw no
    // key: there Σ = 0 and lse = -inf).
    let m = s.try_max(&[-1], true)?;
    let unseen = m.try_eq(Tensor::scalar(f64::NEG_INFINITY, DType::F32))?;
    let shift = Tensor::try_where(&unseen, &Tensor::scalar(0.0, DType::F32), &m)?;
    let lse = s
        .try_sub(&shift)?
        .try_exp()?
        .try_sum(&[-1], true)?
        .try_log()?
        .try_add(&shift)?;
    let p = probabilities(&s, &lse)?;
    let out = p
        .try_matmul(&v.try_cast(DType::F32)?)?
        .try_cast(q.dtype())?;
    Ok(vec![out, lse.try_squeeze(-1)?])
}

/// `exp(s − lse)` by rows (`lse` with a trailing dim of 1), 0 in a row
/// whose lse is `-inf` (it saw no key).
fn probabilities(s: &Tensor, lse: &Tensor) -> Result<Tensor> {
    let unseen = lse.try_eq(Tensor::scalar(f64::NEG_INFINITY, DType::F32))?;
    let zero = Tensor::scalar(0.0, DType::F32);
    let safe = Tensor::try_where(&unseen, &zero, lse)?;
    let p = s.try_sub(&safe)?.try_exp()?;
    Tensor::try_where(&unseen, &zero, &p)
}

/// The backward with plain device ops, recomputing P from the residual.
#[allow(clippy::too_many_arguments)]
fn composite_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    out: &Tensor,
    lse: &Tensor,
    d_out: &Tensor,
    causal: bool,
    scale: f32,
) -> Result<Vec<Tensor>> {
    let f = |t: &Tensor| t.try_cast(DType::F32);
    let (qf, kf, vf, of, gf) = (f(q)?, f(k)?, f(v)?, f(out)?, f(d_out)?);
    let p = probabilities(&scores(q, k, mask, causal, scale)?, &lse.try_unsqueeze(-1)?)?;
    let dv = p.try_transpose(-2, -1)?.try_matmul(&gf)?;
    let dp = gf.try_matmul(&vf.try_transpose(-2, -1)?)?;
    let delta = gf.try_mul(&of)?.try_sum(&[-1], true)?;
    let ds = p.try_mul(&dp.try_sub(&delta)?)? * scale as f64;
    let dq = ds.try_matmul(&kf)?;
    let dk = ds.try_transpose(-2, -1)?.try_matmul(&qf)?;
    Ok(vec![
        dq.try_cast(q.dtype())?,
        dk.try_cast(k.dtype())?,
        dv.try_cast(v.dtype())?,
    ])
}
