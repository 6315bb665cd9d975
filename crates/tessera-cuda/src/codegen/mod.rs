//! CUDA C source for every kernel the backend launches, as plain strings
//! (no CUDA call here: the generator is unit-tested and its output compiled
//! to PTX on machines without a GPU).
//!
//! Every kernel is `extern "C" __global__ void tessera_kernel(Args a)`: one
//! parameter, a struct whose fields are all 8 bytes wide (`long long`,
//! `double`, pointers), so the host side packs it as a list of `u64` words
//! ([`Words`]) in field order with no padding to reason about. Shapes and
//! strides are parameters, not constants: one source serves every size of
//! the same rank, dtypes and op list, which keeps NVRTC off the hot path.

pub mod conv;
pub mod copy;
pub mod cross_entropy;
pub mod fused_rows;
pub mod index;
pub mod int_matmul;
pub mod pointwise;
pub mod rows;
pub mod softmax;

use tessera::DType;

/// The name of the entry point in every generated module.
pub const ENTRY: &str = "tessera_kernel";

/// The arithmetic type a kernel computes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Compute {
    F32,
    F64,
    I64,
    U64,
}

impl Compute {
    /// f16/bf16/f32 compute in f32 (as on the CPU), f64 in f64, u64 in
    /// `unsigned long long`, the other integers and bools in `long long`:
    /// sign- or zero-extended, their wrapping sums, products, shifts and
    /// quotients are those of their own width once truncated on store.
    pub fn of(dtype: DType) -> Compute {
        match dtype {
            DType::F64 => Compute::F64,
            DType::F32 | DType::F16 | DType::BF16 => Compute::F32,
            DType::U64 => Compute::U64,
            DType::I64
            | DType::I32
            | DType::I16
            | DType::I8
            | DType::U8
            | DType::U16
            | DType::U32
            | DType::Bool => Compute::I64,
        }
    }

    pub fn c_type(self) -> &'static str {
        match self {
            Compute::F32 => "float",
            Compute::F64 => "double",
            Compute::I64 => "long long",
            Compute::U64 => "unsigned long long",
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, Compute::F32 | Compute::F64)
    }
}

/// The C type a dtype is stored as.
pub fn c_type(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float",
        DType::F64 => "double",
        DType::F16 => "__half",
        DType::BF16 => "__nv_bfloat16",
        DType::I64 => "long long",
        DType::I32 => "int",
        DType::I16 => "short",
        DType::I8 => "signed char",
        DType::U8 | DType::Bool => "unsigned char",
        DType::U16 => "unsigned short",
        DType::U32 => "unsigned int",
        DType::U64 => "unsigned long long",
    }
}

/// Element `off` of `ptr` (a `const void*` expression) of `dtype`,
/// converted to the compute type.
pub fn load(dtype: DType, compute: Compute, ptr: &str, off: &str) -> String {
    widen(
        dtype,
        compute,
        &format!("((const {}*){ptr})[{off}]", c_type(dtype)),
    )
}

/// `raw` (an expression of `dtype`'s storage type) converted to the
/// compute type.
pub fn widen(dtype: DType, compute: Compute, raw: &str) -> String {
    let acc = compute.c_type();
    match dtype {
        DType::F16 => format!("({acc})__half2float({raw})"),
        DType::BF16 => format!("({acc})__bfloat162float({raw})"),
        _ => format!("({acc}){raw}"),
    }
}

/// `value` (of the compute type) converted to `dtype` for a store: one
/// rounding, from whatever the compute type is, as the CPU does.
pub fn convert(dtype: DType, compute: Compute, value: &str) -> String {
    match (dtype, compute) {
        (DType::F16, Compute::F64) => format!("__double2half({value})"),
        (DType::F16, _) => format!("__float2half_rn((float)({value}))"),
        (DType::BF16, Compute::F64) => format!("__double2bfloat16({value})"),
        (DType::BF16, _) => format!("__float2bfloat16_rn((float)({value}))"),
        (DType::Bool, _) => format!("(unsigned char)(({value}) != 0)"),
        (d, c) if c.is_float() && d.is_int() => {
            let (lo, hi) = d.int_range().expect("an integer dtype");
            let (t, f) = (c_type(d), c.c_type());
            let (lo, hi) = (c_literal(lo), c_literal(hi));
            format!(
                "tessera_saturate<{t}, {f}>({value}, ({f}){lo}, ({f}){hi}, ({t}){lo}, ({t}){hi})"
            )
        }
        (d, _) => format!("({})({value})", c_type(d)),
    }
}

/// An integer bound as a C literal of a type that holds it (`i64::MIN`
/// has no literal of its own: it is written as a difference).
fn c_literal(v: i128) -> String {
    match v {
        v if v == i64::MIN as i128 => "(-9223372036854775807LL - 1)".to_string(),
        v if v > i64::MAX as i128 => format!("{v}ULL"),
        v => format!("{v}LL"),
    }
}

/// The device side of the error record (`kernel_errors::ErrorRecord`'s
/// layout): the first thread to claim `flag` writes the site and the value
/// (a bad index, a dividend, an exponent: what the site's check says).
pub(crate) const REPORT_ERROR: &str = "struct TesseraErrorRecord { unsigned flag; unsigned site; long long value; };\n\
__device__ void tessera_report(void* at, unsigned site, long long value) {\n\
TesseraErrorRecord* r = (TesseraErrorRecord*)at;\n\
if (atomicCAS(&r->flag, 0u, 1u) == 0u) { r->site = site; r->value = value; __threadfence_system(); }\n}\n";

/// The `#include`s and helpers every kernel starts with; the f16/bf16
/// headers only when a dtype needs them (they cost NVRTC time).
pub fn prelude(dtypes: &[DType]) -> String {
    let mut s = String::from("// generated by tessera-cuda\n");
    if dtypes.iter().any(|d| matches!(d, DType::F16 | DType::BF16)) {
        s.push_str("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n");
    }
    s.push_str("#define TS_INF __int_as_float(0x7f800000)\n");
    s.push_str(PACK);
    s.push_str(SATURATE);
    s
}

/// A float converted to an integer type as the CPU (Rust's `as`) and
/// PyTorch's CPU do: toward zero, NaN to 0, out of range to the nearest
/// bound. A plain C cast is undefined out of range, and for types narrower
/// than 32 bits the GPU wraps the 32-bit result instead of clamping.
const SATURATE: &str = "template <typename T, typename F> __device__ __forceinline__ T tessera_saturate(F v, F lo, F hi, T tlo, T thi) \
{ return v != v ? (T)0 : v <= lo ? tlo : v >= hi ? thi : (T)v; }\n";

/// `V` elements of `T` moved as one 16-byte (or 8-byte) access: the
/// vectorised kernels load and store through it, indexing `v` only with
/// unrolled constants so that it stays in registers.
const PACK: &str =
    "template <typename T, int V> struct __align__(sizeof(T) * V) Pack { T v[V]; };\n";

/// Elements per 16-byte access for the vectorised kernels, if every dtype
/// is a 2- or 4-byte float (4 per access when any is f32, else 8).
pub fn vector_width(dtypes: &[DType]) -> Option<usize> {
    let mut widest = 0;
    for d in dtypes {
        match d {
            DType::F32 => widest = 4,
            DType::F16 | DType::BF16 => widest = widest.max(2),
            _ => return None,
        }
    }
    (widest > 0).then(|| 16 / widest)
}

/// Whether element 0 at `ptr` (a byte address) of `dtype` starts a whole
/// `vec`-element access.
pub fn aligned(ptr: u64, dtype: DType, vec: usize) -> bool {
    ptr.is_multiple_of((dtype.size_bytes() * vec) as u64)
}

/// Code that splits the linear index `lin` over `shape` (an array field of
/// `a`, `rank` long) from the last dim, adding `idx·stride` to each
/// `(offset variable, strides field)` pair, and storing the index of each
/// dim in `idx[d]` when `keep_idx`. `index_type` is `unsigned` when every
/// index fits in 32 bits (64-bit division is slow on the GPU).
pub fn decompose(
    lin: &str,
    shape: &str,
    rank: usize,
    targets: &[(String, String)],
    keep_idx: bool,
    index_type: &str,
) -> String {
    let mut s = format!("{{ {index_type} r_ = ({index_type})({lin});\n");
    for d in (0..rank).rev() {
        s.push_str(&format!(
            "  {{ {index_type} n_ = ({index_type})a.{shape}[{d}]; {index_type} q_ = r_ / n_; {index_type} i_ = r_ - q_ * n_; r_ = q_;"
        ));
        if keep_idx {
            s.push_str(&format!(" idx[{d}] = (long long)i_;"));
        }
        for (var, strides) in targets {
            s.push_str(&format!(" {var} += (long long)i_ * a.{strides}[{d}];"));
        }
        s.push_str(" }\n");
    }
    s.push_str("}\n");
    s
}

/// `unsigned` when every linear index below `n` fits 31 bits.
pub fn index_type(n: usize) -> &'static str {
    if n < (1 << 31) {
        "unsigned"
    } else {
        "unsigned long long"
    }
}

/// A kernel parameter struct, packed as 8-byte words in field order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Words(pub Vec<u64>);

impl Words {
    pub fn int(&mut self, v: i64) -> &mut Self {
        self.0.push(v as u64);
        self
    }

    pub fn ints(&mut self, vs: impl IntoIterator<Item = i64>) -> &mut Self {
        self.0.extend(vs.into_iter().map(|v| v as u64));
        self
    }

    pub fn float(&mut self, v: f64) -> &mut Self {
        self.0.push(v.to_bits());
        self
    }

    pub fn ptr(&mut self, p: u64) -> &mut Self {
        self.0.push(p);
        self
    }

    /// `n` words of padding (an array field of `max(len, 1)` entries).
    pub fn zeros(&mut self, n: usize) -> &mut Self {
        self.0.extend(std::iter::repeat_n(0, n));
        self
    }
}

/// A generated kernel: its source, the parameter words and the launch
/// shape. Nothing here touches the GPU.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    pub source: String,
    pub args: Words,
    pub grid: u32,
    pub block: u32,
}

/// `[..]` padded to at least one entry (C has no empty arrays).
pub fn at_least_one(n: usize) -> usize {
    n.max(1)
}

/// Strides of a layout over `rank` dims (a rank-0 tensor counts as `[1]`).
pub fn padded(values: &[usize], rank: usize, pad: usize) -> Vec<i64> {
    let mut v: Vec<i64> = values.iter().map(|&x| x as i64).collect();
    while v.len() < rank {
        v.insert(0, pad as i64);
    }
    v
}

/// Blocks for a grid-stride loop over `n` items, `block` threads each:
/// enough to fill the GPU a few times over, never more than the work.
pub fn grid_for(n: usize, block: u32, sms: u32) -> u32 {
    let needed = n.div_ceil(block as usize).max(1);
    needed.min(sms as usize * 32).max(1) as u32
}
