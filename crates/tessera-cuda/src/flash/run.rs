//! The entry points: the device facts the plan needs, the module of the call's dtype
//! (from [`crate::compiler`]'s cache), and the launches queued on the caller's stream
//! (the grouped backward's also on auxiliary lanes, ordered with events).

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{
    CUdevice_attribute, CUdeviceptr, CUevent, CUevent_flags, CUevent_wait_flags, CUstream,
};
use cudarc::driver::{result, CudaContext, CudaStream};
use tessera::error::{Error, ErrorKind};

use super::plan::{
    backward_launches, check_dims, forward_launches, launches_for, Launch, Step, TILE_ROWS,
};
use super::select::{arch_for, select, FwdKernel, Selection, WgFwd};
use super::work::{
    backward_plan, backward_workspace_bytes_for, forward_splits, forward_workspace_bytes_for,
    group_dims, BwdLayout, BwdSplit, LANES,
};
use super::{device_err, program, FlashDType, FlashDims, Result, OP};
use crate::compiler::{self, Module};

/// Where the kernels are queued: a context and one of its streams, given raw so that a
/// stream the caller created outside cudarc (the CUDA backend's own) serves as well as a
/// cudarc one. The stream must belong to `ctx`.
#[derive(Clone, Copy)]
pub struct Queue<'a> {
    pub ctx: &'a Arc<CudaContext>,
    pub stream: CUstream,
}

impl<'a> From<&'a Arc<CudaStream>> for Queue<'a> {
    fn from(s: &'a Arc<CudaStream>) -> Queue<'a> {
        Queue {
            ctx: s.context(),
            stream: s.cu_stream(),
        }
    }
}

/// The device facts the launch plan depends on: compute capability and SM count.
fn device_facts(ctx: &CudaContext) -> Result<((i32, i32), u32)> {
    let cc = ctx
        .compute_capability()
        .map_err(|e| device_err("reading the compute capability", e))?;
    let sms = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| device_err("reading the multiprocessor count", e))?;
    Ok((cc, sms.max(1) as u32))
}

/// Bytes of scratch [`flash_forward`] needs on `ctx`'s device (0 unless the forward is
/// split over the key tiles, which it is when batch x heads is too small to fill it).
pub fn forward_workspace_bytes(
    ctx: &CudaContext,
    dtype: FlashDType,
    dims: &FlashDims,
) -> Result<usize> {
    let (cc, sms) = device_facts(ctx)?;
    Ok(forward_workspace_bytes_for(
        &select(dtype, dims.head_dim, cc)?,
        dims,
        sms,
    ))
}

/// Bytes of scratch [`flash_backward`] needs on `ctx`'s device.
pub fn backward_workspace_bytes(
    ctx: &CudaContext,
    dtype: FlashDType,
    dims: &FlashDims,
) -> Result<usize> {
    let (cc, sms) = device_facts(ctx)?;
    Ok(backward_workspace_bytes_for(
        &select(dtype, dims.head_dim, cc)?,
        dims,
        sms,
    ))
}

/// Device pointers of a forward call (all on the queue's context, contiguous).
#[derive(Clone, Copy, Debug)]
pub struct FwdPtrs {
    /// `[B, H, q_len, D]` of `dtype`.
    pub q: CUdeviceptr,
    /// `[B, H, kv_len, D]` of `dtype`.
    pub k: CUdeviceptr,
    /// `[B, H, kv_len, D]` of `dtype`.
    pub v: CUdeviceptr,
    /// `[B, H, q_len, D]` of `dtype`, written.
    pub out: CUdeviceptr,
    /// `[B, H, q_len]` f32, written (natural-log logsumexp of each scaled score row).
    pub lse: CUdeviceptr,
    /// Scratch of [`forward_workspace_bytes`] bytes, 256-byte aligned (unused when 0).
    pub workspace: CUdeviceptr,
}

/// Device pointers of a backward call.
#[derive(Clone, Copy, Debug)]
pub struct BwdPtrs {
    pub q: CUdeviceptr,
    pub k: CUdeviceptr,
    pub v: CUdeviceptr,
    /// The forward's output.
    pub out: CUdeviceptr,
    /// Gradient of the output, `[B, H, q_len, D]` of `dtype`.
    pub d_out: CUdeviceptr,
    /// The forward's logsumexp, `[B, H, q_len]` f32.
    pub lse: CUdeviceptr,
    /// Written: `[B, H, q_len, D]`, `[B, H, kv_len, D]`, `[B, H, kv_len, D]` of `dtype`.
    pub dq: CUdeviceptr,
    pub dk: CUdeviceptr,
    pub dv: CUdeviceptr,
    /// Scratch of [`backward_workspace_bytes`] bytes, 256-byte aligned.
    pub workspace: CUdeviceptr,
}

/// A kernel argument: the driver takes a pointer to each argument's value.
trait KernelArg {
    fn param(&self) -> *mut c_void;
}
macro_rules! kernel_arg {
    ($($t:ty),*) => {$(
        impl KernelArg for $t {
            fn param(&self) -> *mut c_void {
                self as *const $t as *mut c_void
            }
        }
    )*};
}
kernel_arg!(u64, i32, i64, f32);

/// The module of `dtype`'s kernels for `ctx`'s device (compute capability `cc`), which
/// this binds to the thread: compiled and loaded on first use, then from the crate's
/// module cache.
fn module_for(ctx: &Arc<CudaContext>, dtype: FlashDType, cc: (i32, i32)) -> Result<Arc<Module>> {
    ctx.bind_to_thread()
        .map_err(|e| device_err("binding the context", e))?;
    let target = arch_for(cc);
    let key = module_key(dtype, &target);
    compiler::module(ctx.cu_ctx(), &key, &program(dtype), &target)
        .map_err(|m| Error::op(ErrorKind::Device, OP, m))
}

/// The cache key of `dtype`'s program for `target`, hashed once per pair: hashing the
/// source on every call would cost more than a small call's kernels take.
fn module_key(dtype: FlashDType, target: &str) -> String {
    static KEYS: OnceLock<Mutex<HashMap<(FlashDType, String), String>>> = OnceLock::new();
    let mut keys = KEYS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    keys.entry((dtype, target.to_string()))
        .or_insert_with(|| program(dtype).key(target))
        .clone()
}

fn run(q: Queue<'_>, module: &Module, launch: &Launch, args: &[&dyn KernelArg]) -> Result<()> {
    if launch.grid.0 == 0 || launch.grid.1 == 0 {
        return Ok(()); // nothing to do (an empty sequence)
    }
    q.ctx
        .bind_to_thread()
        .map_err(|e| device_err("binding the context", e))?;
    let f = module
        .function(&launch.name, launch.smem)
        .map_err(|m| Error::op(ErrorKind::Device, OP, m))?;
    let mut params: Vec<*mut c_void> = args.iter().map(|a| a.param()).collect();
    // SAFETY: the argument list matches the kernel's signature (checked by the names
    // and orders in this file against the .cu; the values outlive the call, which
    // copies them), the stream belongs to the function's context, and the caller of
    // the public entry points vouches for the pointers.
    unsafe {
        result::launch_kernel(
            f,
            launch.grid,
            (launch.block, 1, 1),
            launch.smem,
            q.stream,
            &mut params,
        )
    }
    .map_err(|e| device_err(&format!("launching {}", launch.name), e))
}
/// Attention forward: `out = softmax(scale * q k^T [+ causal mask]) v` and
/// `lse = logsumexp(scale * q k^T [+ mask])` per query row, enqueued on the queue's
/// stream (nothing waits for it).
///
/// # Safety
/// Every pointer in `ptrs` must be a live device allocation on the queue's context of
/// at least the size its field documents for `dims` and `dtype`, contiguous, and not be
/// freed or written by other work until the enqueued kernels finish.
pub unsafe fn flash_forward(
    q: Queue<'_>,
    dtype: FlashDType,
    dims: FlashDims,
    causal: bool,
    scale: f32,
    ptrs: FwdPtrs,
) -> Result<()> {
    flash_forward_variant(q, dtype, dims, causal, scale, ptrs, None)
}

/// [`flash_forward`] with the wgmma forward's `variant` (`None`: the default;
/// ignored where another kernel family runs).
///
/// # Safety
/// As for [`flash_forward`].
pub unsafe fn flash_forward_variant(
    q: Queue<'_>,
    dtype: FlashDType,
    dims: FlashDims,
    causal: bool,
    scale: f32,
    ptrs: FwdPtrs,
    variant: Option<WgFwd>,
) -> Result<()> {
    check_dims(&dims, scale)?;
    let (cc, sms) = device_facts(q.ctx)?;
    let mut sel = select(dtype, dims.head_dim, cc)?;
    if let (Some(v), FwdKernel::Wgmma(_)) = (variant, sel.fwd) {
        sel.fwd = FwdKernel::Wgmma(v);
    }
    let launches = forward_launches(&sel, &dims, sms)?;
    if dims.q_len == 0 {
        return Ok(());
    }
    let module = module_for(q.ctx, dtype, cc)?;
    let (nq, nk) = (dims.q_len as i32, dims.kv_len as i32);
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let causal = causal as i32;
    let splits = forward_splits(&sel, &dims, sms) as i32;
    let bh = (dims.batch * dims.heads) as i32;
    let o_part = ptrs.workspace;
    let ml_part = ptrs.workspace
        + (dims.q_len.div_ceil(TILE_ROWS) * TILE_ROWS * bh as usize * dims.head_dim * 4) as u64
            * splits as u64;
    let p = &ptrs;
    for launch in &launches {
        match launch.step {
            Step::Forward => {
                let a: [&dyn KernelArg; 9] = [
                    &p.q,
                    &p.k,
                    &p.v,
                    &p.out,
                    &p.lse,
                    &nq,
                    &nk,
                    &scale_log2,
                    &causal,
                ];
                run(q, &module, launch, &a)?
            }
            Step::ForwardSplit => {
                let a: [&dyn KernelArg; 9] = [
                    &p.q,
                    &p.k,
                    &p.v,
                    &o_part,
                    &ml_part,
                    &nq,
                    &nk,
                    &scale_log2,
                    &causal,
                ];
                run(q, &module, launch, &a)?
            }
            Step::Combine => {
                let a: [&dyn KernelArg; 7] = [&o_part, &ml_part, &p.out, &p.lse, &splits, &bh, &nq];
                run(q, &module, launch, &a)?
            }
            s => unreachable!("{s:?} is no forward step"),
        }
    }
    Ok(())
}

/// Attention backward (FlashAttention-2): from q, k, v, the forward's out and lse, and
/// d_out, writes dq, dk, dv; enqueued on the queue's stream (nothing waits for it).
/// When it runs in several launch groups, they alternate between the queue's stream and
/// auxiliary ones of the context ([`LANES`]), forked from and joined back into the
/// queue's stream with events: the results are complete in the queue's stream order.
///
/// # Safety
/// As for [`flash_forward`], for every pointer in `ptrs`; `workspace` must hold
/// [`backward_workspace_bytes`] bytes.
pub unsafe fn flash_backward(
    q: Queue<'_>,
    dtype: FlashDType,
    dims: FlashDims,
    causal: bool,
    scale: f32,
    ptrs: BwdPtrs,
) -> Result<()> {
    check_dims(&dims, scale)?;
    let (cc, sms) = device_facts(q.ctx)?;
    let sel = select(dtype, dims.head_dim, cc)?;
    backward_launches(&sel, &dims, sms, causal)?; // shape errors before anything is queued
    let module = module_for(q.ctx, dtype, cc)?;
    let plan = backward_plan(&sel, &dims, sms, causal);
    let lane_stride = plan.lane_stride(&sel, &dims) as u64;
    let (q_row, k_row) = (dims.q_len * dims.head_dim, dims.kv_len * dims.head_dim);
    let es = dtype.size();
    let enqueue = |lanes: &[CUstream]| -> Result<()> {
        for (i, g) in plan.groups.iter().enumerate() {
            let lane = i % lanes.len();
            let at = |p: CUdeviceptr, per_bh: usize| p + (g.first * per_bh) as u64;
            let part_ptrs = BwdPtrs {
                q: at(ptrs.q, q_row * es),
                k: at(ptrs.k, k_row * es),
                v: at(ptrs.v, k_row * es),
                out: at(ptrs.out, q_row * es),
                d_out: at(ptrs.d_out, q_row * es),
                lse: at(ptrs.lse, dims.q_len * 4),
                dq: at(ptrs.dq, q_row * es),
                dk: at(ptrs.dk, k_row * es),
                dv: at(ptrs.dv, k_row * es),
                workspace: ptrs.workspace + lane as u64 * lane_stride,
            };
            let lq = Queue {
                ctx: q.ctx,
                stream: lanes[lane],
            };
            let part = group_dims(&dims, g.n);
            enqueue_backward(lq, &module, &sel, part, g.split, causal, scale, part_ptrs)?;
        }
        Ok(())
    };
    if plan.lanes == 1 {
        return enqueue(&[q.stream]);
    }
    let mut all = aux_lanes().lock().unwrap_or_else(|p| p.into_inner());
    let aux = aux_lanes_for(&mut all, q.ctx)?;
    // The auxiliary streams start after what the caller queued before (the inputs, the
    // workspace's previous use) and the caller's stream continues after all of them:
    // each lane's groups are ordered by its own stream, nothing waits on the host.
    aux.fork(q.stream)?;
    let mut lanes = vec![q.stream];
    lanes.extend(aux.streams.iter().map(|s| s.0));
    let queued = enqueue(&lanes);
    aux.join(q.stream)?;
    queued
}

/// A raw driver handle (stream or event) kept in a process-wide map: only used under
/// the map's lock, on its own context.
#[derive(Clone, Copy)]
struct Handle<T>(T);
// SAFETY: driver handles may be used from any thread; the map's lock orders the uses.
unsafe impl<T> Send for Handle<T> {}

/// The auxiliary streams of one context's backward lanes ([`LANES`] - 1, created
/// once, never destroyed, like the loaded modules) and the events that order them
/// against the caller's stream.
struct AuxLanes {
    streams: Vec<Handle<CUstream>>,
    fork: Handle<CUevent>,
    joins: Vec<Handle<CUevent>>,
}

impl AuxLanes {
    /// Every auxiliary stream waits for the work queued on `stream` so far.
    fn fork(&self, stream: CUstream) -> Result<()> {
        // SAFETY: the handles are live (never destroyed) and of the stream's context.
        unsafe {
            result::event::record(self.fork.0, stream)
                .map_err(|e| device_err("recording the backward's fork event", e))?;
            for s in &self.streams {
                result::stream::wait_event(
                    s.0,
                    self.fork.0,
                    CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
                .map_err(|e| device_err("ordering a backward lane after the caller", e))?;
            }
        }
        Ok(())
    }

    /// `stream` waits for the work queued on every auxiliary stream so far.
    fn join(&self, stream: CUstream) -> Result<()> {
        // SAFETY: as in `fork`.
        unsafe {
            for (s, e) in self.streams.iter().zip(&self.joins) {
                result::event::record(e.0, s.0)
                    .map_err(|e| device_err("recording a backward lane's join event", e))?;
                result::stream::wait_event(stream, e.0, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                    .map_err(|e| device_err("ordering the caller after a backward lane", e))?;
            }
        }
        Ok(())
    }
}

fn aux_lanes() -> &'static Mutex<HashMap<usize, AuxLanes>> {
    static LANE_MAP: OnceLock<Mutex<HashMap<usize, AuxLanes>>> = OnceLock::new();
    LANE_MAP.get_or_init(Default::default)
}

/// `ctx`'s auxiliary lanes, created on first use. Raw driver streams rather than
/// cudarc's `new_stream`, which would put the whole context into cudarc's multi-stream
/// mode (an event recorded on every allocation's use).
fn aux_lanes_for<'m>(
    all: &'m mut HashMap<usize, AuxLanes>,
    ctx: &Arc<CudaContext>,
) -> Result<&'m AuxLanes> {
    let slot = match all.entry(ctx.cu_ctx() as usize) {
        Entry::Occupied(e) => return Ok(e.into_mut()),
        Entry::Vacant(v) => v,
    };
    ctx.bind_to_thread()
        .map_err(|e| device_err("binding the context", e))?;
    let event = || {
        result::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map(Handle)
            .map_err(|e| device_err("creating a backward lane event", e))
    };
    let mut lanes = AuxLanes {
        streams: Vec::new(),
        fork: event()?,
        joins: Vec::new(),
    };
    for _ in 1..LANES {
        let s = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| device_err("creating a backward lane stream", e))?;
        lanes.streams.push(Handle(s));
        lanes.joins.push(event()?);
    }
    Ok(slot.insert(lanes))
}

/// The backward's launches for `dims` (one group of batch x heads), in stream order.
#[allow(clippy::too_many_arguments)]
fn enqueue_backward(
    q: Queue<'_>,
    module: &Module,
    sel: &Selection,
    dims: FlashDims,
    split: BwdSplit,
    causal: bool,
    scale: f32,
    ptrs: BwdPtrs,
) -> Result<()> {
    let launches = launches_for(sel, &dims, split)?;
    let layout = BwdLayout::new(sel, &dims, split);
    let (nq, nk) = (dims.q_len as i32, dims.kv_len as i32);
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let causal = causal as i32;
    let rows = dims.rows() as i64;
    let delta = ptrs.workspace;
    let dq_acc = ptrs.workspace + layout.acc as u64;
    let kv_acc = dq_acc + layout.dq_acc as u64;
    let counters = kv_acc + layout.kv_acc as u64;
    let acc_float4s = (layout.zeroed() / 16) as i64;
    let (whole, splits) = (split.whole as i32, split.splits as i32);
    let p = &ptrs;
    for launch in &launches {
        match launch.step {
            Step::PreF32 => run(q, module, launch, &[&p.out, &p.d_out, &delta, &rows])?,
            Step::Pre => {
                let a: [&dyn KernelArg; 6] =
                    [&p.out, &p.d_out, &delta, &dq_acc, &acc_float4s, &rows];
                run(q, module, launch, &a)?
            }
            Step::DqF32 => {
                let a: [&dyn KernelArg; 12] = [
                    &p.q,
                    &p.k,
                    &p.v,
                    &p.d_out,
                    &p.lse,
                    &delta,
                    &p.dq,
                    &nq,
                    &nk,
                    &scale,
                    &scale_log2,
                    &causal,
                ];
                run(q, module, launch, &a)?
            }
            Step::DkvF32 => {
                let a: [&dyn KernelArg; 13] = [
                    &p.q,
                    &p.k,
                    &p.v,
                    &p.d_out,
                    &p.lse,
                    &delta,
                    &p.dk,
                    &p.dv,
                    &nq,
                    &nk,
                    &scale,
                    &scale_log2,
                    &causal,
                ];
                run(q, module, launch, &a)?
            }
            Step::BackwardMma => {
                let a: [&dyn KernelArg; 14] = [
                    &p.q,
                    &p.k,
                    &p.v,
                    &p.d_out,
                    &p.lse,
                    &delta,
                    &dq_acc,
                    &p.dk,
                    &p.dv,
                    &nq,
                    &nk,
                    &scale,
                    &scale_log2,
                    &causal,
                ];
                run(q, module, launch, &a)?
            }
            Step::BackwardWgmma => {
                let a: [&dyn KernelArg; 18] = [
                    &p.q,
                    &p.k,
                    &p.v,
                    &p.d_out,
                    &p.lse,
                    &delta,
                    &dq_acc,
                    &p.dk,
                    &p.dv,
                    &kv_acc,
                    &counters,
                    &nq,
                    &nk,
                    &scale,
                    &scale_log2,
                    &causal,
                    &whole,
                    &splits,
                ];
                run(q, module, launch, &a)?
            }
            Step::Post => {
                let n = (dims.rows() * dims.head_dim) as i64;
                run(q, module, launch, &[&dq_acc, &p.dq, &n, &scale])?
            }
            Step::PostTiled => run(q, module, launch, &[&dq_acc, &p.dq, &nq, &scale])?,
            s => unreachable!("{s:?} is no backward step"),
        }
    }
    Ok(())
}
