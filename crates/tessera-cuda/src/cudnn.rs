//! Convolutions through cuDNN: the forward, the input gradient and the
//! weight gradient of `tessera::conv2d` (NCHW, f32, f16, bf16; strides,
//! symmetric padding, dilation, groups — depthwise included).
//!
//! Why cuDNN rather than kernels of our own: its implicit-GEMM,
//! Winograd and FFT engines on tensor cores are what PyTorch runs, tuned
//! per architecture, and they are many times faster than the direct
//! kernels of `codegen::conv` (which stay as the fallback, see
//! [`Dnn::conv`]). The legacy API (descriptors + `*_v7` heuristics) is
//! used, as PyTorch with `cudnn.benchmark = False`: its choice is made on
//! the host, without running trial kernels, so it is safe inside a CUDA
//! graph capture and costs no device time.
//!
//! Precision: f32 convolutions run with `CUDNN_FMA_MATH` (no TF32, the
//! same arithmetic as tessera's f32 matmul and the CPU); f16/bf16 ones on
//! tensor cores, accumulating in f32.
//!
//! libcudnn is loaded at run time by `cudnn_lib.rs` (a cuDNN already
//! in the process first, so tessera and PyTorch share one): when it is
//! missing, too old or lacks a symbol, the first convolution warns once
//! (stderr) and every convolution runs the direct kernels — never a panic.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;

use cudarc::cudnn::sys;
use sys::cudnnStatus_t as Status;
use tessera::runtime::device::DeviceMemory;
use tessera::DType;

use crate::codegen::conv::ConvShape;
use crate::cudnn_lib::{cudnn, Cudnn, EntryPoints};
use crate::gpu::Gpu;

/// The most workspace one convolution may take (PyTorch bounds it by the
/// free memory; a fixed bound keeps the memory predictable).
const MAX_WORKSPACE: usize = 1 << 30;

/// The oldest cuDNN the legacy calls below are checked against (8.0).
const MIN_VERSION: usize = 8000;

/// Which implementation runs the convolutions (`TESSERA_CUDA_CONV`, or
/// [`set_conv_path`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvPath {
    /// cuDNN where it can, the direct kernels otherwise (the default).
    Auto,
    /// The direct kernels only.
    Direct,
    /// cuDNN only: a convolution it cannot run is an error (for tests and
    /// benchmarks that must measure cuDNN).
    Cudnn,
}

static PATH: AtomicU8 = AtomicU8::new(u8::MAX);
static RAN_CUDNN: AtomicU64 = AtomicU64::new(0);
static RAN_DIRECT: AtomicU64 = AtomicU64::new(0);

/// The convolution path in force: [`set_conv_path`]'s, else
/// `TESSERA_CUDA_CONV` (`auto`, `direct`, `cudnn`), else `Auto`.
pub fn conv_path() -> ConvPath {
    match PATH.load(Ordering::Relaxed) {
        0 => ConvPath::Auto,
        1 => ConvPath::Direct,
        2 => ConvPath::Cudnn,
        _ => match std::env::var("TESSERA_CUDA_CONV").as_deref() {
            Ok("direct") => ConvPath::Direct,
            Ok("cudnn") => ConvPath::Cudnn,
            _ => ConvPath::Auto,
        },
    }
}

/// Chooses the convolution path for the rest of the process.
pub fn set_conv_path(path: ConvPath) {
    PATH.store(path as u8, Ordering::Relaxed);
}

/// Convolution passes run so far: (by cuDNN, by the direct kernels).
pub fn conv_runs() -> (u64, u64) {
    (
        RAN_CUDNN.load(Ordering::Relaxed),
        RAN_DIRECT.load(Ordering::Relaxed),
    )
}

/// Counts a pass the direct kernels ran.
pub(crate) fn count_direct() {
    RAN_DIRECT.fetch_add(1, Ordering::Relaxed);
}

/// One of a convolution's three computations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pass {
    /// `y` from `x` and `w`.
    Forward,
    /// `dx` from `dy` and `w`.
    BackwardData,
    /// `dw` from `x` and `dy`.
    BackwardFilter,
}

impl Pass {
    fn name(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::BackwardData => "input gradient",
            Pass::BackwardFilter => "weight gradient",
        }
    }
}

/// Why cuDNN cannot run convolution `s` (the direct kernels then do), or
/// `None` when it can.
pub fn unsupported(s: &ConvShape) -> Option<String> {
    let c = &s.conv;
    if data_type(s.dtype).is_none() {
        return Some(format!("{} (cuDNN runs f32, f16 and bf16)", s.dtype));
    }
    if c.padding[0] != c.padding[1] || c.padding[2] != c.padding[3] {
        return Some(format!(
            "uneven padding {:?} (cuDNN pads both sides alike)",
            c.padding
        ));
    }
    if s.input.contains(&0) || s.weight.contains(&0) || s.out_hw.contains(&0) {
        return Some("an empty operand".into());
    }
    let sizes = s.input.iter().chain(&s.weight).chain(&s.out_hw);
    let geometry = c.stride.iter().chain(&c.padding).chain(&c.dilation);
    if sizes.chain(geometry).any(|&v| c_int::try_from(v).is_err())
        || s.input.iter().product::<usize>() > i32::MAX as usize
    {
        return Some("a size past cuDNN's 32-bit limits".into());
    }
    None
}

fn data_type(dtype: DType) -> Option<sys::cudnnDataType_t> {
    use sys::cudnnDataType_t as D;
    match dtype {
        DType::F32 => Some(D::CUDNN_DATA_FLOAT),
        DType::F16 => Some(D::CUDNN_DATA_HALF),
        DType::BF16 => Some(D::CUDNN_DATA_BFLOAT16),
        _ => None,
    }
}

/// The math a pass may use: no TF32 for f32 (see the module's doc).
fn math(dtype: DType) -> sys::cudnnMathType_t {
    match dtype {
        DType::F32 => sys::cudnnMathType_t::CUDNN_FMA_MATH,
        _ => sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    pass: Pass,
    dtype: DType,
    input: [usize; 4],
    weight: [usize; 4],
    out_hw: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    groups: usize,
}

impl Key {
    fn of(pass: Pass, s: &ConvShape) -> Key {
        let c = &s.conv;
        Key {
            pass,
            dtype: s.dtype,
            input: s.input,
            weight: s.weight,
            out_hw: s.out_hw,
            stride: c.stride,
            padding: [c.padding[0], c.padding[2]],
            dilation: c.dilation,
            groups: c.groups,
        }
    }
}

/// The algorithm of one pass, whichever its kind.
#[derive(Clone, Copy, Debug)]
enum Algo {
    Forward(sys::cudnnConvolutionFwdAlgo_t),
    Data(sys::cudnnConvolutionBwdDataAlgo_t),
    Filter(sys::cudnnConvolutionBwdFilterAlgo_t),
}

/// A pass's descriptors and algorithm (kept for the process: shapes
/// repeat from step to step).
struct Plan {
    x: sys::cudnnTensorDescriptor_t,
    y: sys::cudnnTensorDescriptor_t,
    w: sys::cudnnFilterDescriptor_t,
    conv: sys::cudnnConvolutionDescriptor_t,
    algo: Algo,
    workspace: usize,
}

enum State {
    Unopened,
    /// Why cuDNN cannot be used in this process.
    Missing(String),
    Open {
        lib: &'static Cudnn,
        handle: sys::cudnnHandle_t,
        /// `Err`: cuDNN has no algorithm for this problem (the reason).
        plans: HashMap<Key, std::result::Result<Plan, String>>,
    },
}

// SAFETY: the handle and descriptors are used under the mutex only.
unsafe impl Send for State {}

/// cuDNN, opened on the first convolution.
pub struct Dnn {
    state: Mutex<State>,
}

impl Default for Dnn {
    fn default() -> Self {
        Dnn {
            state: Mutex::new(State::Unopened),
        }
    }
}

fn dnn_error(what: &str, status: Status) -> String {
    format!("cuDNN {what} failed: {status:?}")
}

/// `Ok` on `CUDNN_STATUS_SUCCESS`, else the status.
fn check(status: Status) -> std::result::Result<(), Status> {
    match status {
        Status::CUDNN_STATUS_SUCCESS => Ok(()),
        failed => Err(failed),
    }
}

/// The value a cuDNN call writes through its last (out) argument.
fn written<T>(call: impl FnOnce(*mut T) -> Status) -> std::result::Result<T, Status> {
    let mut out = std::mem::MaybeUninit::<T>::uninit();
    check(call(out.as_mut_ptr()))?;
    // SAFETY: cuDNN wrote the value (it returned success).
    Ok(unsafe { out.assume_init() })
}

/// Opens the process's cuDNN and a handle on the current device.
fn open() -> std::result::Result<(&'static Cudnn, sys::cudnnHandle_t), String> {
    let lib = cudnn(MIN_VERSION)?;
    tessera::logging::log("cudnn", || {
        format!("cuDNN {} from {}", lib.version, lib.origin)
    });
    // SAFETY: cudnnCreate writes the handle.
    let handle = written(|h| unsafe { (lib.api.create)(h) })
        .map_err(|e| dnn_error(&format!("handle creation ({})", lib.origin), e))?;
    Ok((lib, handle))
}

impl Dnn {
    /// Runs `pass` of convolution `s` through cuDNN on the current lane's
    /// stream: `a`, `b` its operands (forward: x, w; input gradient: dy,
    /// w; weight gradient: x, dy), `out` its result, all contiguous NCHW
    /// device buffers. `Ok(false)` when cuDNN cannot (missing library,
    /// shape it does not take, no algorithm; [`unsupported`] says which
    /// shapes): the caller runs the direct kernels. Errors are cuDNN's
    /// failures on a problem it accepted.
    #[allow(clippy::too_many_arguments)]
    pub fn conv(
        &self,
        gpu: &Gpu,
        pass: Pass,
        s: &ConvShape,
        a: u64,
        b: u64,
        out: u64,
    ) -> std::result::Result<bool, String> {
        let path = conv_path();
        let refuse = |why: String| match path {
            ConvPath::Cudnn => Err(format!(
                "TESSERA_CUDA_CONV=cudnn, but cuDNN cannot run this convolution's {}: {why}",
                pass.name()
            )),
            _ => Ok(false),
        };
        if path == ConvPath::Direct {
            return Ok(false);
        }
        if let Some(why) = unsupported(s) {
            return refuse(why);
        }
        // Tensor-core engines read 16-byte vectors; a view at an odd offset
        // goes to the direct kernels.
        if [a, b, out].iter().any(|p| p % 16 != 0) {
            return refuse("an operand not 16-byte aligned".into());
        }
        gpu.bind();
        let mut state = self.state.lock().expect("cuDNN state poisoned");
        if let State::Unopened = *state {
            *state = match open() {
                Ok((lib, handle)) => State::Open {
                    lib,
                    handle,
                    plans: HashMap::new(),
                },
                Err(why) => {
                    // Once per process: a silent fallback would hide a
                    // many-fold slowdown.
                    eprintln!("tessera: cuDNN is unavailable, convolutions run tessera's direct kernels (slower): {why}");
                    State::Missing(why)
                }
            };
        }
        let (api, handle, plans) = match &mut *state {
            State::Open { lib, handle, plans } => (&lib.api, *handle, plans),
            State::Missing(why) => return refuse(why.clone()),
            State::Unopened => unreachable!("opened above"),
        };
        let key = Key::of(pass, s);
        let plan = plans
            .entry(key)
            .or_insert_with_key(|k| unsafe { make_plan(api, handle, k) });
        let plan = match plan {
            Ok(p) => p,
            Err(why) => return refuse(why.clone()),
        };
        let workspace = gpu.alloc(plan.workspace)?;
        // SAFETY: the handle is live; the stream is the current lane's.
        check(unsafe { (api.set_stream)(handle, gpu.stream() as sys::cudaStream_t) })
            .map_err(|e| dnn_error("stream", e))?;
        // SAFETY: the plan's descriptors describe `a`, `b` and `out`, live
        // device buffers; the workspace holds `plan.workspace` bytes and is
        // freed into the stream-ordered cache after the queued call.
        unsafe { execute(api, handle, plan, a, b, out, workspace.ptr()) }
            .map_err(|e| dnn_error(&format!("convolution {} ({:?})", pass.name(), s), e))?;
        RAN_CUDNN.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }
}

/// Queues one pass.
///
/// # Safety
/// As [`Dnn::conv`]'s call site says.
unsafe fn execute(
    api: &EntryPoints,
    handle: sys::cudnnHandle_t,
    p: &Plan,
    a: u64,
    b: u64,
    out: u64,
    workspace: u64,
) -> std::result::Result<(), Status> {
    let (one, zero) = (1.0f32, 0.0f32);
    let alpha = &one as *const f32 as *const c_void;
    let beta = &zero as *const f32 as *const c_void;
    let ws = workspace as *mut c_void;
    let (a, b, out) = (a as *const c_void, b as *const c_void, out as *mut c_void);
    check(match p.algo {
        Algo::Forward(algo) => (api.forward)(
            handle,
            alpha,
            p.x,
            a,
            p.w,
            b,
            p.conv,
            algo,
            ws,
            p.workspace,
            beta,
            p.y,
            out,
        ),
        Algo::Data(algo) => (api.backward_data)(
            handle,
            alpha,
            p.w,
            b,
            p.y,
            a,
            p.conv,
            algo,
            ws,
            p.workspace,
            beta,
            p.x,
            out,
        ),
        Algo::Filter(algo) => (api.backward_filter)(
            handle,
            alpha,
            p.x,
            a,
            p.y,
            b,
            p.conv,
            algo,
            ws,
            p.workspace,
            beta,
            p.w,
            out,
        ),
    })
}

fn ints<const N: usize>(v: [usize; N]) -> [c_int; N] {
    // `unsupported` checked that every size fits.
    v.map(|x| x as c_int)
}

/// The descriptors of `k` and the first algorithm cuDNN's heuristic ranks
/// that succeeds within [`MAX_WORKSPACE`] with the math `k`'s dtype
/// allows; `Err` (the reason) when there is none.
///
/// # Safety
/// `handle` is a live cuDNN handle.
unsafe fn make_plan(
    api: &EntryPoints,
    handle: sys::cudnnHandle_t,
    k: &Key,
) -> std::result::Result<Plan, String> {
    use sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW as NCHW;
    let ty = data_type(k.dtype).ok_or("no cuDNN data type")?;
    let e = |what: &'static str| move |err| dnn_error(what, err);
    let x = written(|d| (api.create_tensor_descriptor)(d)).map_err(e("descriptor"))?;
    let y = written(|d| (api.create_tensor_descriptor)(d)).map_err(e("descriptor"))?;
    let w = written(|d| (api.create_filter_descriptor)(d)).map_err(e("descriptor"))?;
    let conv = written(|d| (api.create_convolution_descriptor)(d)).map_err(e("descriptor"))?;
    let [n, _, _, _] = k.input;
    let out = [n, k.weight[0], k.out_hw[0], k.out_hw[1]];
    let tensor4d =
        |d, [n, c, h, w]: [c_int; 4]| check((api.set_tensor4d_descriptor)(d, NCHW, ty, n, c, h, w));
    tensor4d(x, ints(k.input)).map_err(e("input descriptor"))?;
    tensor4d(y, ints(out)).map_err(e("output descriptor"))?;
    let [o, i, kh, kw] = ints(k.weight);
    check((api.set_filter4d_descriptor)(w, ty, NCHW, o, i, kh, kw))
        .map_err(e("weight descriptor"))?;
    let [ph, pw] = ints(k.padding);
    let [sh, sw] = ints(k.stride);
    let [dh, dw] = ints(k.dilation);
    check((api.set_convolution2d_descriptor)(
        conv,
        ph,
        pw,
        sh,
        sw,
        dh,
        dw,
        sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
        sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
    ))
    .map_err(e("convolution descriptor"))?;
    check((api.set_convolution_group_count)(conv, k.groups as i32)).map_err(e("group count"))?;
    let allowed = math(k.dtype);
    check((api.set_convolution_math_type)(conv, allowed)).map_err(e("math type"))?;
    let mut plan = Plan {
        x,
        y,
        w,
        conv,
        algo: Algo::Forward(
            sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        ),
        workspace: 0,
    };
    for (algo, status, math_type) in ranked(api, handle, k.pass, &plan)? {
        let tf32 = k.dtype == DType::F32 && math_type != sys::cudnnMathType_t::CUDNN_FMA_MATH;
        if status != sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS || tf32 {
            continue;
        }
        if check((api.set_convolution_math_type)(conv, math_type)).is_err() {
            continue;
        }
        plan.algo = algo;
        match workspace_size(api, handle, &plan) {
            Ok(bytes) if bytes <= MAX_WORKSPACE => {
                plan.workspace = bytes;
                return Ok(plan);
            }
            _ => continue,
        }
    }
    Err(format!(
        "cuDNN's heuristic offers no {} algorithm for {k:?} within {} MiB of workspace",
        k.pass.name(),
        MAX_WORKSPACE >> 20
    ))
}

/// cuDNN's ranking of the algorithms of `pass`: (algorithm, status, math).
///
/// # Safety
/// `handle` and the plan's descriptors are live.
unsafe fn ranked(
    api: &EntryPoints,
    handle: sys::cudnnHandle_t,
    pass: Pass,
    p: &Plan,
) -> std::result::Result<Vec<(Algo, sys::cudnnStatus_t, sys::cudnnMathType_t)>, String> {
    const MAX: usize = 16;
    let mut count: c_int = 0;
    let e = |err| dnn_error("algorithm heuristic", err);
    Ok(match pass {
        Pass::Forward => {
            let mut perf = [std::mem::zeroed::<sys::cudnnConvolutionFwdAlgoPerf_t>(); MAX];
            check((api.forward_algorithms)(
                handle,
                p.x,
                p.w,
                p.conv,
                p.y,
                MAX as c_int,
                &mut count,
                perf.as_mut_ptr(),
            ))
            .map_err(e)?;
            perf[..count.clamp(0, MAX as c_int) as usize]
                .iter()
                .map(|r| (Algo::Forward(r.algo), r.status, r.mathType))
                .collect()
        }
        Pass::BackwardData => {
            let mut perf = [std::mem::zeroed::<sys::cudnnConvolutionBwdDataAlgoPerf_t>(); MAX];
            check((api.backward_data_algorithms)(
                handle,
                p.w,
                p.y,
                p.conv,
                p.x,
                MAX as c_int,
                &mut count,
                perf.as_mut_ptr(),
            ))
            .map_err(e)?;
            perf[..count.clamp(0, MAX as c_int) as usize]
                .iter()
                .map(|r| (Algo::Data(r.algo), r.status, r.mathType))
                .collect()
        }
        Pass::BackwardFilter => {
            let mut perf = [std::mem::zeroed::<sys::cudnnConvolutionBwdFilterAlgoPerf_t>(); MAX];
            check((api.backward_filter_algorithms)(
                handle,
                p.x,
                p.y,
                p.conv,
                p.w,
                MAX as c_int,
                &mut count,
                perf.as_mut_ptr(),
            ))
            .map_err(e)?;
            perf[..count.clamp(0, MAX as c_int) as usize]
                .iter()
                .map(|r| (Algo::Filter(r.algo), r.status, r.mathType))
                .collect()
        }
    })
}

/// The workspace the plan's algorithm needs, in bytes.
///
/// # Safety
/// `handle` and the plan's descriptors are live.
unsafe fn workspace_size(
    api: &EntryPoints,
    handle: sys::cudnnHandle_t,
    p: &Plan,
) -> std::result::Result<usize, Status> {
    written(|bytes| match p.algo {
        Algo::Forward(a) => (api.forward_workspace)(handle, p.x, p.w, p.conv, p.y, a, bytes),
        Algo::Data(a) => (api.backward_data_workspace)(handle, p.w, p.y, p.conv, p.x, a, bytes),
        Algo::Filter(a) => (api.backward_filter_workspace)(handle, p.x, p.y, p.conv, p.w, a, bytes),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera::ir::custom::conv::{Activation, Conv2d};

    fn shape(dtype: DType, padding: [usize; 4]) -> ConvShape {
        ConvShape {
            dtype,
            input: [2, 4, 7, 6],
            weight: [6, 2, 3, 3],
            out_hw: [4, 6],
            conv: Conv2d {
                stride: [2, 1],
                padding,
                dilation: [1, 1],
                groups: 2,
                activation: Activation::None,
            },
        }
    }

    #[test]
    fn cudnn_takes_the_float_types_and_even_padding_only() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            assert_eq!(unsupported(&shape(dtype, [1, 1, 1, 1])), None, "{dtype}");
        }
        let why = unsupported(&shape(DType::F64, [1, 1, 1, 1])).unwrap();
        assert!(why.contains("f64"), "{why}");
        let why = unsupported(&shape(DType::F32, [1, 2, 1, 1])).unwrap();
        assert!(why.contains("uneven padding"), "{why}");
        let mut big = shape(DType::F32, [1, 1, 1, 1]);
        big.input = [1 << 20, 4, 1 << 10, 1 << 10];
        assert!(unsupported(&big).unwrap().contains("32-bit"));
    }

    #[test]
    fn the_path_comes_from_the_setting() {
        set_conv_path(ConvPath::Direct);
        assert_eq!(conv_path(), ConvPath::Direct);
        set_conv_path(ConvPath::Cudnn);
        assert_eq!(conv_path(), ConvPath::Cudnn);
        set_conv_path(ConvPath::Auto);
        assert_eq!(conv_path(), ConvPath::Auto);
    }

    #[test]
    fn f32_convolutions_never_use_tf32() {
        assert_eq!(math(DType::F32), sys::cudnnMathType_t::CUDNN_FMA_MATH);
        assert_eq!(
            math(DType::BF16),
            sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH
        );
    }
}
