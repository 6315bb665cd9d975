//! Pointwise kernels from a fused step list (the fusion plan's
//! [`FusedKernel`](tessera::ir::kernel::FusedKernel) steps): one
//! thread per output element in a grid-stride loop, every step a register,
//! inputs read through their own (broadcast, strided) layouts, outputs
//! written through theirs. Eager elementwise ops, casts, copies and `cat`
//! are one-step instances of the same kernel.
//!
//! When every streamed operand is contiguous, aligned and a 2- or 4-byte
//! float, a first loop moves 16-byte packs (4 f32 or 8 bf16/f16 elements a
//! thread per iteration; the steps unrolled over the pack) and the scalar
//! loop takes only the tail: one 16-byte access instead of 4–8 narrow
//! ones is what gets these kernels to the copy rate (BENCHMARKS.md).
//!
//! Integer division and power are checked by the kernel, as the CPU checks
//! them: a zero divisor or a negative exponent is written to the error
//! record (`crate::kernel_errors`) with the site the host noted for that
//! step, the element gets 0, and the host reports the error at the next
//! synchronisation. Division truncates toward zero and `MIN / -1` wraps to
//! `MIN` (Rust's `wrapping_div`, which the CPU kernel uses; C leaves that
//! quotient undefined, so the kernel negates with unsigned wrapping
//! instead); a power is square-and-multiply with wrapping products.

use tessera::ir::kernel::Step;
use tessera::ir::{BinaryOp, CompareOp, UnaryOp};
use tessera::tensor::Layout;
use tessera::DType;

use super::{
    aligned, at_least_one, c_type, convert, decompose, grid_for, index_type, load, padded, prelude,
    vector_width, widen, Compute, Launch, Words, ENTRY, REPORT_ERROR,
};

/// One input of a pointwise kernel.
#[derive(Clone, Debug)]
pub enum Operand {
    /// A device buffer of `dtype` at `ptr`, read through `layout`, which is
    /// already broadcast to the kernel's shape (stride 0 on broadcast dims).
    Buffer {
        dtype: DType,
        ptr: u64,
        layout: Layout,
    },
    /// A host scalar (a 0-dim host tensor): a constant of this launch.
    Scalar(f64),
}

#[cfg(test)]
impl Operand {
    /// A buffer operand at a made-up address, for code-generator tests
    /// (the generated source only prints the address).
    pub(crate) fn test_buffer(dtype: DType, layout: Layout) -> Operand {
        Operand::Buffer {
            dtype,
            ptr: 0x1000,
            layout,
        }
    }
}

/// One output: a device buffer written through `layout` (the kernel's
/// shape; contiguous for new tensors, a strided view for `cat`).
#[derive(Clone, Debug)]
pub struct Output {
    pub step: usize,
    pub dtype: DType,
    pub ptr: u64,
    pub layout: Layout,
}

/// How a pointwise kernel reports what its checked steps find (see
/// [`checked_steps`]): the error record's device address and the site the
/// host noted for each checked step, in step order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ArithCheck {
    pub report: u64,
    pub sites: Vec<u32>,
}

/// The steps a kernel computing in `compute` checks, in order: integer
/// division (by zero) and power (to a negative exponent). Each needs a
/// site in the launch's [`ArithCheck`].
pub fn checked_steps(steps: &[Step], compute: Compute) -> Vec<usize> {
    if compute.is_float() {
        return Vec::new();
    }
    steps
        .iter()
        .enumerate()
        .filter(|(_, s)| matches!(s, Step::Binary(BinaryOp::Div | BinaryOp::Pow, _, _)))
        .map(|(i, _)| i)
        .collect()
}

/// Integer division and power as the CPU computes them (`wrapping_div`,
/// `wrapping_pow` over all 64 exponent bits), reporting a zero divisor
/// (with the dividend) or a negative exponent through the error record.
const INT_ARITH: &str =
    "__device__ long long tessera_idiv(long long x, long long y, void* report, unsigned site) {\n\
if (y == 0) { tessera_report(report, site, x); return 0; }\n\
if (y == -1) return (long long)(0ull - (unsigned long long)x);\n\
return x / y;\n}\n\
__device__ long long tessera_ipow(long long x, long long e, void* report, unsigned site) {\n\
if (e < 0) { tessera_report(report, site, e); return 0; }\n\
unsigned long long b = (unsigned long long)x, acc = 1ull, k = (unsigned long long)e;\n\
while (k) { if (k & 1ull) acc *= b; b *= b; k >>= 1; }\n\
return (long long)acc;\n}\n\
__device__ unsigned long long tessera_udiv(unsigned long long x, unsigned long long y, void* report, unsigned site) {\n\
if (y == 0ull) { tessera_report(report, site, (long long)x); return 0ull; }\n\
return x / y;\n}\n\
__device__ unsigned long long tessera_upow(unsigned long long x, unsigned long long e, void* report, unsigned site) {\n\
unsigned long long acc = 1ull;\n\
while (e) { if (e & 1ull) acc *= x; x *= x; e >>= 1; }\n\
return acc;\n}\n";

/// The kernel for `steps` over `shape`. Errors (as a message for the
/// caller to attach the op to) when a step has no meaning in `compute`.
pub fn pointwise(
    steps: &[Step],
    inputs: &[Operand],
    outputs: &[Output],
    shape: &[usize],
    compute: Compute,
    sms: u32,
) -> Result<Launch, String> {
    pointwise_block(steps, inputs, outputs, shape, compute, sms, None)
}

/// [`pointwise`] with `block` threads per block (a tuner's choice;
/// `None`: [`DEFAULT_BLOCK`]).
pub fn pointwise_block(
    steps: &[Step],
    inputs: &[Operand],
    outputs: &[Output],
    shape: &[usize],
    compute: Compute,
    sms: u32,
    block: Option<u32>,
) -> Result<Launch, String> {
    pointwise_checked(
        steps,
        inputs,
        outputs,
        shape,
        compute,
        sms,
        block,
        &ArithCheck::default(),
    )
}

/// [`pointwise_block`] whose checked steps ([`checked_steps`]) report
/// through `check` (one site each).
#[allow(clippy::too_many_arguments)]
pub fn pointwise_checked(
    steps: &[Step],
    inputs: &[Operand],
    outputs: &[Output],
    shape: &[usize],
    compute: Compute,
    sms: u32,
    block: Option<u32>,
    check: &ArithCheck,
) -> Result<Launch, String> {
    let checked = checked_steps(steps, compute);
    if check.sites.len() != checked.len() {
        let what = checked
            .first()
            .map(|&s| match steps[s] {
                Step::Binary(op, _, _) => format!("integer {}", op.name()),
                _ => unreachable!("checked steps are binary"),
            })
            .unwrap_or_else(|| "no step".into());
        return Err(format!(
            "{what} needs the kernel error record to report a division by zero or a negative \
             exponent: {} checked steps, {} sites",
            checked.len(),
            check.sites.len()
        ));
    }
    let n: usize = shape.iter().product();
    let rank = shape.len().max(1);
    let buffers: Vec<(usize, DType, &Layout, u64)> = inputs
        .iter()
        .enumerate()
        .filter_map(|(i, x)| match x {
            Operand::Buffer { dtype, ptr, layout } => Some((i, *dtype, layout, *ptr)),
            Operand::Scalar(_) => None,
        })
        .collect();
    // Constants: the kernel's own and the host scalars, both parameters.
    let mut consts: Vec<f64> = Vec::new();
    let mut const_of_step: Vec<Option<usize>> = vec![None; steps.len()];
    for (s, step) in steps.iter().enumerate() {
        let value = match *step {
            Step::Const(c) => Some(c),
            Step::Load(k) => match inputs.get(k) {
                Some(Operand::Scalar(v)) => Some(*v),
                Some(Operand::Buffer { .. }) => None,
                None => return Err(format!("step {s} loads input {k} of {}", inputs.len())),
            },
            _ => None,
        };
        if let Some(v) = value {
            const_of_step[s] = Some(consts.len());
            consts.push(v);
        }
    }
    let contiguous = |l: &Layout| l.is_contiguous();
    let any_strided = buffers.iter().any(|(_, _, l, _)| !contiguous(l))
        || outputs.iter().any(|o| !contiguous(&o.layout));
    let (ni, no, nc) = (buffers.len(), outputs.len(), consts.len());
    let idx = index_type(n);

    let mut dtypes: Vec<DType> = buffers.iter().map(|b| b.1).collect();
    dtypes.extend(outputs.iter().map(|o| o.dtype));
    dtypes.extend(steps.iter().filter_map(|s| match s {
        Step::Round(d, _) => Some(*d),
        _ => None,
    }));
    let mut src = prelude(&dtypes);
    let reports = if checked.is_empty() {
        String::new()
    } else {
        src.push_str(REPORT_ERROR);
        src.push_str(INT_ARITH);
        format!(" void* report; long long site[{}];", checked.len())
    };
    src.push_str(&format!(
        "struct Args {{ long long n; long long shape[{rank}]; long long ioff[{ni1}]; long long istr[{ni1}][{rank}]; \
         long long ooff[{no1}]; long long ostr[{no1}][{rank}]; double c[{nc1}]; const void* in[{ni1}]; void* out[{no1}];{reports} }};\n",
        ni1 = at_least_one(ni),
        no1 = at_least_one(no),
        nc1 = at_least_one(nc),
    ));
    let body = Body {
        steps,
        buffers: &buffers,
        outputs,
        const_of_step: &const_of_step,
        compute,
        checked: &checked,
    };
    let block = block.unwrap_or(DEFAULT_BLOCK);
    src.push_str(&format!(
        "extern \"C\" __global__ void __launch_bounds__({block}) {ENTRY}(Args a) {{\n\
         const long long stride = (long long)gridDim.x * blockDim.x;\n"
    ));
    let vec = vector_plan(&buffers, outputs, compute);
    let start = match vec {
        Some(v) => {
            src.push_str(&body.vectorised(v));
            format!("a.n / {v} * {v} + ")
        }
        None => String::new(),
    };
    src.push_str(&format!(
        "for (long long i = {start}(long long)blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += stride) {{\n"
    ));
    // Offsets of every buffer input (by position among buffers) and output.
    let mut targets = Vec::new();
    for (b, (_, _, layout, _)) in buffers.iter().enumerate() {
        if contiguous(layout) {
            src.push_str(&format!("long long io{b} = a.ioff[{b}] + i;\n"));
        } else {
            src.push_str(&format!("long long io{b} = a.ioff[{b}];\n"));
            targets.push((format!("io{b}"), format!("istr[{b}]")));
        }
    }
    for (o, out) in outputs.iter().enumerate() {
        if contiguous(&out.layout) {
            src.push_str(&format!("long long oo{o} = a.ooff[{o}] + i;\n"));
        } else {
            src.push_str(&format!("long long oo{o} = a.ooff[{o}];\n"));
            targets.push((format!("oo{o}"), format!("ostr[{o}]")));
        }
    }
    if any_strided {
        src.push_str(&decompose("i", "shape", rank, &targets, false, idx));
    }
    src.push_str(&body.steps(
        |b| {
            load(
                buffers[b].1,
                compute,
                &format!("a.in[{b}]"),
                &format!("io{b}"),
            )
        },
        |o, value| {
            format!(
                "(({}*)a.out[{o}])[oo{o}] = {value};\n",
                c_type(outputs[o].dtype)
            )
        },
    )?);
    src.push_str("}\n}\n");

    let mut args = Words::default();
    args.int(n as i64).ints(padded(shape, rank, 1));
    for (_, _, l, _) in &buffers {
        args.int(l.offset as i64);
    }
    args.zeros(at_least_one(ni) - ni);
    for (_, _, l, _) in &buffers {
        args.ints(padded(&l.strides, rank, 0));
    }
    args.zeros((at_least_one(ni) - ni) * rank);
    for o in outputs {
        args.int(o.layout.offset as i64);
    }
    args.zeros(at_least_one(no) - no);
    for o in outputs {
        args.ints(padded(&o.layout.strides, rank, 0));
    }
    args.zeros((at_least_one(no) - no) * rank);
    for &c in &consts {
        args.float(c);
    }
    args.zeros(at_least_one(nc) - nc);
    for (_, _, _, p) in &buffers {
        args.ptr(*p);
    }
    args.zeros(at_least_one(ni) - ni);
    for o in outputs {
        args.ptr(o.ptr);
    }
    args.zeros(at_least_one(no) - no);
    if !checked.is_empty() {
        args.ptr(check.report);
        for &site in &check.sites {
            args.int(i64::from(site));
        }
    }
    let per_thread = vec.unwrap_or(1);
    Ok(Launch {
        source: src,
        args,
        grid: grid_for(n.div_ceil(per_thread), block, sms),
        block,
    })
}

/// Threads per block when no tuned size is given.
pub const DEFAULT_BLOCK: u32 = 256;
/// The blocks `max-autotune` times.
pub const BLOCK_CANDIDATES: [u32; 4] = [128, 256, 512, 1024];

/// Elements per thread of the vectorised loop, when it applies: every
/// input contiguous or a broadcast scalar (all strides 0), every output
/// contiguous, all 2- or 4-byte floats computed in f32, and every
/// non-scalar address on a whole access. Otherwise the scalar loop alone.
fn vector_plan(
    buffers: &[(usize, DType, &Layout, u64)],
    outputs: &[Output],
    compute: Compute,
) -> Option<usize> {
    if compute != Compute::F32 {
        return None;
    }
    let streamed: Vec<(DType, &Layout, u64)> = buffers
        .iter()
        .filter(|(_, _, l, _)| !is_scalar(l))
        .map(|&(_, d, l, p)| (d, l, p))
        .chain(outputs.iter().map(|o| (o.dtype, &o.layout, o.ptr)))
        .collect();
    let all: Vec<DType> = buffers
        .iter()
        .map(|b| b.1)
        .chain(streamed.iter().map(|s| s.0))
        .collect();
    let vec = vector_width(&all)?;
    streamed
        .iter()
        .all(|(d, l, p)| {
            l.is_contiguous() && aligned(p + (l.offset * d.size_bytes()) as u64, *d, vec)
        })
        .then_some(vec)
}

/// A buffer every element of the kernel reads at the same address.
fn is_scalar(l: &Layout) -> bool {
    l.strides.iter().all(|&s| s == 0)
}

/// What the step list needs to be written out as C, in either loop.
struct Body<'a> {
    steps: &'a [Step],
    buffers: &'a [(usize, DType, &'a Layout, u64)],
    outputs: &'a [Output],
    const_of_step: &'a [Option<usize>],
    compute: Compute,
    /// The checked steps, in order (their sites are `a.site[j]`).
    checked: &'a [usize],
}

impl Body<'_> {
    /// The steps as C statements, buffer `b` read by `read(b)` and output
    /// `o` written by `write(o, value)` (value already of its dtype).
    fn steps(
        &self,
        read: impl Fn(usize) -> String,
        write: impl Fn(usize, String) -> String,
    ) -> Result<String, String> {
        let compute = self.compute;
        let acc = compute.c_type();
        let buffer_pos = |k: usize| self.buffers.iter().position(|b| b.0 == k);
        let mut src = String::new();
        for (s, step) in self.steps.iter().enumerate() {
            let expr = match *step {
                Step::Load(k) => match buffer_pos(k) {
                    Some(b) => read(b),
                    None => format!("({acc})a.c[{}]", self.const_of_step[s].expect("a scalar")),
                },
                Step::Const(_) => {
                    format!("({acc})a.c[{}]", self.const_of_step[s].expect("a const"))
                }
                Step::Binary(op, x, y) if self.checked.contains(&s) => {
                    let j = self.checked.iter().position(|&c| c == s).expect("checked");
                    let f = match (op, compute) {
                        (BinaryOp::Div, Compute::U64) => "tessera_udiv",
                        (BinaryOp::Div, _) => "tessera_idiv",
                        (_, Compute::U64) => "tessera_upow",
                        _ => "tessera_ipow",
                    };
                    format!("{f}(v{x}, v{y}, a.report, (unsigned)a.site[{j}])")
                }
                _ => point_expr(step, compute, |x| format!("v{x}"))?,
            };
            src.push_str(&format!("{acc} v{s} = {expr};\n"));
        }
        for (o, out) in self.outputs.iter().enumerate() {
            src.push_str(&write(
                o,
                convert(out.dtype, compute, &format!("v{}", out.step)),
            ));
        }
        Ok(src)
    }

    /// The grid-stride loop over whole `vec`-element accesses: one 16-byte
    /// load per streamed input and one store per output, the steps unrolled
    /// over the `vec` lanes. The scalar loop after it takes the tail.
    fn vectorised(&self, vec: usize) -> String {
        let mut src = format!(
            "for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < a.n / {vec}; t += stride) {{\n\
             const long long i = t * {vec};\n"
        );
        for (b, (_, d, l, _)) in self.buffers.iter().enumerate() {
            if !is_scalar(l) {
                let ct = c_type(*d);
                src.push_str(&format!(
                    "const Pack<{ct}, {vec}> p{b} = *(const Pack<{ct}, {vec}>*)((const {ct}*)a.in[{b}] + a.ioff[{b}] + i);\n"
                ));
            }
        }
        for (o, out) in self.outputs.iter().enumerate() {
            src.push_str(&format!("Pack<{}, {vec}> q{o};\n", c_type(out.dtype)));
        }
        let body = self
            .steps(
                |b| {
                    let (_, d, l, _) = self.buffers[b];
                    if is_scalar(l) {
                        load(
                            d,
                            self.compute,
                            &format!("a.in[{b}]"),
                            &format!("a.ioff[{b}]"),
                        )
                    } else {
                        widen(d, self.compute, &format!("p{b}.v[k]"))
                    }
                },
                |o, value| format!("q{o}.v[k] = {value};\n"),
            )
            .expect("the scalar loop was generated from the same steps");
        src.push_str(&format!(
            "#pragma unroll\nfor (int k = 0; k < {vec}; ++k) {{\n{body}}}\n"
        ));
        for (o, out) in self.outputs.iter().enumerate() {
            let ct = c_type(out.dtype);
            src.push_str(&format!(
                "*(Pack<{ct}, {vec}>*)(({ct}*)a.out[{o}] + a.ooff[{o}] + i) = q{o};\n"
            ));
        }
        src.push_str("}\n");
        src
    }
}

/// The C expression of an arithmetic step (not a load or a constant, which
/// depend on where the kernel keeps its inputs), operand `x` written as
/// `arg(x)`; every generated kernel computes steps through this one
/// function, so a step means the same in each.
pub(crate) fn point_expr(
    step: &Step,
    compute: Compute,
    arg: impl Fn(usize) -> String,
) -> Result<String, String> {
    let acc = compute.c_type();
    Ok(match *step {
        Step::Unary(op, x) => unary(op, compute, &arg(x))?,
        Step::Binary(op, x, y) => binary(op, compute, &arg(x), &arg(y))?,
        Step::Compare(op, x, y) => {
            format!(
                "(({}) ? ({acc})1 : ({acc})0)",
                compare(op, &arg(x), &arg(y))
            )
        }
        Step::Where(c, x, y) => format!("(({} != ({acc})0) ? {} : {})", arg(c), arg(x), arg(y)),
        Step::Round(d, x) => round(d, compute, &arg(x))?,
        Step::Load(_) | Step::Const(_) => {
            unreachable!("loads and constants are the caller's to write")
        }
    })
}

/// `name` for double, `namef` for float.
pub(crate) fn f(name: &str, compute: Compute) -> String {
    match compute {
        Compute::F32 => format!("{name}f"),
        _ => name.to_string(),
    }
}

fn lit(compute: Compute, v: f64) -> String {
    format!("(({}){v:?})", compute.c_type())
}

/// A unary op as CPU computes it (runtime/cpu/elementwise.rs).
fn unary(op: UnaryOp, c: Compute, x: &str) -> Result<String, String> {
    if c == Compute::U64 {
        return match op {
            UnaryOp::Neg => Ok(format!("(0ull - {x})")),
            UnaryOp::Abs | UnaryOp::Relu => Ok(x.to_string()),
            UnaryOp::BitNot => Ok(format!("(~{x})")),
            other => Err(format!("{} is not defined for integers", other.name())),
        };
    }
    if c == Compute::I64 {
        return match op {
            UnaryOp::Neg => Ok(format!("(long long)(0ull - (unsigned long long){x})")),
            UnaryOp::Abs => Ok(format!(
                "({x} < 0 ? (long long)(0ull - (unsigned long long){x}) : {x})"
            )),
            UnaryOp::Relu => Ok(format!("({x} < 0 ? 0ll : {x})")),
            UnaryOp::BitNot => Ok(format!("(~{x})")),
            other => Err(format!("{} is not defined for integers", other.name())),
        };
    }
    let one = lit(c, 1.0);
    let zero = lit(c, 0.0);
    let sigmoid = |x: &str| {
        let e = format!("{}(-{}({x}))", f("exp", c), f("fabs", c));
        format!("({x} >= {zero} ? {one} / ({one} + {e}) : {e} / ({one} + {e}))")
    };
    Ok(match op {
        UnaryOp::Neg => format!("(-{x})"),
        UnaryOp::Abs => format!("{}({x})", f("fabs", c)),
        UnaryOp::Exp => format!("{}({x})", f("exp", c)),
        UnaryOp::Log => format!("{}({x})", f("log", c)),
        UnaryOp::Sqrt => format!("{}({x})", f("sqrt", c)),
        UnaryOp::Rsqrt => format!("({one} / {}({x}))", f("sqrt", c)),
        UnaryOp::Reciprocal => format!("({one} / {x})"),
        UnaryOp::Sin => format!("{}({x})", f("sin", c)),
        UnaryOp::Cos => format!("{}({x})", f("cos", c)),
        UnaryOp::Tanh => format!("{}({x})", f("tanh", c)),
        UnaryOp::Sigmoid => sigmoid(x),
        UnaryOp::Relu => format!("({x} < {zero} ? {zero} : {x})"),
        UnaryOp::Gelu => format!(
            "({x} * {} * {}(-({x} * {})))",
            lit(c, 0.5),
            f("erfc", c),
            lit(c, std::f64::consts::FRAC_1_SQRT_2)
        ),
        UnaryOp::GeluTanh => format!(
            "({} * {x} * ({one} + {}({} * ({x} + {} * {x} * {x} * {x}))))",
            lit(c, 0.5),
            f("tanh", c),
            lit(c, (2.0 / std::f64::consts::PI).sqrt()),
            lit(c, 0.044715)
        ),
        UnaryOp::Silu => format!("({x} * {})", sigmoid(x)),
        UnaryOp::Atan => format!("{}({x})", f("atan", c)),
        UnaryOp::Asin => format!("{}({x})", f("asin", c)),
        UnaryOp::Acos => format!("{}({x})", f("acos", c)),
        UnaryOp::BitNot => return Err("bitwise_not is not defined for floats".into()),
    })
}

/// A binary op as CPU computes it; NaN-propagating maximum/minimum.
fn binary(op: BinaryOp, c: Compute, x: &str, y: &str) -> Result<String, String> {
    if !c.is_float() {
        let signed = c == Compute::I64;
        let wrap = |sym: &str| match signed {
            true => format!("(long long)((unsigned long long){x} {sym} (unsigned long long){y})"),
            false => format!("({x} {sym} {y})"),
        };
        // Shifts as numpy's (and the CPU's): by a negative amount or past
        // the width, 0 (a right shift of a negative value: -1). Past 63 is
        // past every width; a narrower type computed here, sign- or
        // zero-extended, gets the same bits once truncated on store.
        let past = match signed {
            true => format!("({y} < 0 || {y} > 63)"),
            false => format!("({y} > 63ull)"),
        };
        return match op {
            BinaryOp::Add => Ok(wrap("+")),
            BinaryOp::Sub => Ok(wrap("-")),
            BinaryOp::Mul => Ok(wrap("*")),
            BinaryOp::BitAnd => Ok(format!("({x} & {y})")),
            BinaryOp::BitOr => Ok(format!("({x} | {y})")),
            BinaryOp::BitXor => Ok(format!("({x} ^ {y})")),
            BinaryOp::Shl if signed => Ok(format!(
                "({past} ? 0ll : (long long)((unsigned long long){x} << {y}))"
            )),
            BinaryOp::Shl => Ok(format!("({past} ? 0ull : ({x} << {y}))")),
            BinaryOp::Shr if signed => Ok(format!("({x} >> ({past} ? 63ll : {y}))")),
            BinaryOp::Shr => Ok(format!("({past} ? 0ull : ({x} >> {y}))")),
            BinaryOp::Maximum => Ok(format!("({x} > {y} ? {x} : {y})")),
            BinaryOp::Minimum => Ok(format!("({x} < {y} ? {x} : {y})")),
            // Checked: only a pointwise kernel, which has the error
            // record, computes them (see `checked_steps`).
            BinaryOp::Div | BinaryOp::Pow => Err(format!(
                "integer {} needs the kernel error record to report a division by zero or a \
                 negative exponent, which only pointwise kernels have",
                op.name()
            )),
        };
    }
    Ok(match op {
        BinaryOp::Add => format!("({x} + {y})"),
        BinaryOp::Sub => format!("({x} - {y})"),
        BinaryOp::Mul => format!("({x} * {y})"),
        BinaryOp::Div => format!("({x} / {y})"),
        BinaryOp::Pow => format!("{}({x}, {y})", f("pow", c)),
        BinaryOp::Maximum => format!("(({x} > {y} || {x} != {x}) ? {x} : {y})"),
        BinaryOp::Minimum => format!("(({x} < {y} || {x} != {x}) ? {x} : {y})"),
        BinaryOp::BitAnd | BinaryOp::BitOr | BinaryOp::BitXor | BinaryOp::Shl | BinaryOp::Shr => {
            return Err(format!("{} is not defined for floats", op.name()))
        }
    })
}

fn compare(op: CompareOp, x: &str, y: &str) -> String {
    let sym = match op {
        CompareOp::Eq => "==",
        CompareOp::Ne => "!=",
        CompareOp::Lt => "<",
        CompareOp::Le => "<=",
        CompareOp::Gt => ">",
        CompareOp::Ge => ">=",
    };
    format!("{x} {sym} {y}")
}

/// `x` rounded to `dtype`'s precision and back (a cast inside a kernel).
fn round(dtype: DType, c: Compute, x: &str) -> Result<String, String> {
    let acc = c.c_type();
    Ok(match (dtype, c) {
        (DType::F64, _) => x.to_string(),
        (DType::F32, _) => format!("({acc})(float)({x})"),
        (DType::F16, _) => format!("({acc})__half2float({})", convert(DType::F16, c, x)),
        (DType::BF16, _) => format!("({acc})__bfloat162float({})", convert(DType::BF16, c, x)),
        (d, _) => return Err(format!("a rounding to {d} inside a fused kernel")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_contiguous_chain_has_no_index_arithmetic_and_packs_its_words_in_field_order() {
        // y = exp(x) * 2, x and y contiguous f32 [4, 8].
        let steps = [
            Step::Load(0),
            Step::Unary(UnaryOp::Exp, 0),
            Step::Const(2.0),
            Step::Binary(BinaryOp::Mul, 1, 2),
        ];
        let x = Operand::test_buffer(DType::F32, Layout::contiguous(&[4, 8]));
        let y = Output {
            step: 3,
            dtype: DType::F32,
            ptr: 0x2000,
            layout: Layout::contiguous(&[4, 8]),
        };
        let l = pointwise(&steps, &[x], &[y], &[4, 8], Compute::F32, 132).unwrap();
        assert!(
            l.source.contains("long long io0 = a.ioff[0] + i;"),
            "{}",
            l.source
        );
        assert!(
            !l.source.contains("r_ /"),
            "no division when all is contiguous:\n{}",
            l.source
        );
        assert!(l.source.contains("float v1 = expf(v0);"), "{}", l.source);
        assert!(
            l.source.contains("float v2 = (float)a.c[0];"),
            "{}",
            l.source
        );
        assert!(!l.source.contains("cuda_bf16"), "no f16 header for f32");
        // n, shape[2], ioff[1], istr[1][2], ooff[1], ostr[1][2], c[1], in[1], out[1]
        let want: Vec<u64> = vec![32, 4, 8, 0, 8, 1, 0, 8, 1, 2.0f64.to_bits(), 0x1000, 0x2000];
        assert_eq!(l.args.0, want);
        assert_eq!((l.block, l.grid), (256, 1));
    }

    #[test]
    fn broadcast_and_strided_inputs_decompose_the_index_and_bf16_converts_once() {
        // out[i, j] = a[j] + b[i, j] with b transposed in memory, bf16 out.
        let a = Operand::test_buffer(DType::BF16, Layout::contiguous(&[3]).expanded(&[2, 3]));
        let b = Operand::test_buffer(DType::F32, Layout::contiguous(&[3, 2]).permuted(&[1, 0]));
        let steps = [
            Step::Load(0),
            Step::Load(1),
            Step::Binary(BinaryOp::Add, 0, 1),
        ];
        let out = Output {
            step: 2,
            dtype: DType::BF16,
            ptr: 0x3000,
            layout: Layout::contiguous(&[2, 3]),
        };
        let l = pointwise(&steps, &[a, b], &[out], &[2, 3], Compute::F32, 132).unwrap();
        assert!(l.source.contains("#include <cuda_bf16.h>"));
        assert!(
            l.source.contains("io0 += (long long)i_ * a.istr[0][1];"),
            "{}",
            l.source
        );
        assert!(
            l.source.contains("__float2bfloat16_rn((float)(v2))"),
            "{}",
            l.source
        );
        assert!(
            l.source.contains("(float)__bfloat162float("),
            "{}",
            l.source
        );
        // istr: a = [0, 1] (broadcast rows), b = [1, 2] (transposed).
        assert_eq!(&l.args.0[5..9], &[0, 1, 1, 2]);
    }

    #[test]
    fn host_scalars_become_parameters_so_the_source_is_the_same_for_every_value() {
        let x = Operand::test_buffer(DType::F32, Layout::contiguous(&[5]));
        let steps = [
            Step::Load(0),
            Step::Load(1),
            Step::Binary(BinaryOp::Mul, 0, 1),
        ];
        let out = |p| Output {
            step: 2,
            dtype: DType::F32,
            ptr: p,
            layout: Layout::contiguous(&[5]),
        };
        let a = pointwise(
            &steps,
            &[x.clone(), Operand::Scalar(0.5)],
            &[out(1)],
            &[5],
            Compute::F32,
            1,
        )
        .unwrap();
        let b = pointwise(
            &steps,
            &[x, Operand::Scalar(3.0)],
            &[out(2)],
            &[5],
            Compute::F32,
            1,
        )
        .unwrap();
        assert_eq!(a.source, b.source);
        assert_ne!(a.args, b.args);
    }

    #[test]
    fn contiguous_aligned_floats_take_16_byte_packs_with_a_scalar_tail() {
        // y = x * s (s a broadcast bf16 buffer), x bf16, y bf16: 8 a pack.
        let shape = [3, 7];
        let x = Operand::test_buffer(DType::BF16, Layout::contiguous(&shape));
        let s = Operand::test_buffer(DType::BF16, Layout::contiguous(&[1]).expanded(&shape));
        let steps = [
            Step::Load(0),
            Step::Load(1),
            Step::Binary(BinaryOp::Mul, 0, 1),
        ];
        let y = |ptr, dtype| Output {
            step: 2,
            dtype,
            ptr,
            layout: Layout::contiguous(&shape),
        };
        let l = pointwise(
            &steps,
            &[x.clone(), s.clone()],
            &[y(0x2000, DType::BF16)],
            &shape,
            Compute::F32,
            132,
        )
        .unwrap();
        let src = &l.source;
        assert!(src.contains("t < a.n / 8;"), "{src}");
        assert!(
            src.contains("const Pack<__nv_bfloat16, 8> p0 = *(const Pack<__nv_bfloat16, 8>*)"),
            "{src}"
        );
        assert!(
            !src.contains("p1 ="),
            "a broadcast scalar is no stream:\n{src}"
        );
        assert!(
            src.contains("((const __nv_bfloat16*)a.in[1])[a.ioff[1]]"),
            "{src}"
        );
        assert!(src.contains("q0.v[k] = __float2bfloat16_rn"), "{src}");
        // The tail: the scalar loop starts after the last whole pack.
        assert!(src.contains("long long i = a.n / 8 * 8 + "), "{src}");
        // An f32 output makes it 4 a pack; an odd address, the scalar loop.
        let mixed = pointwise(
            &steps,
            &[x.clone(), s.clone()],
            &[y(0x2000, DType::F32)],
            &shape,
            Compute::F32,
            132,
        )
        .unwrap();
        assert!(mixed.source.contains("t < a.n / 4;"), "{}", mixed.source);
        let odd = pointwise(
            &steps,
            &[x, s],
            &[y(0x2002, DType::BF16)],
            &shape,
            Compute::F32,
            132,
        )
        .unwrap();
        assert!(!odd.source.contains("Pack<__nv"), "{}", odd.source);
        // Same words either way: the host side packs one struct.
        assert_eq!(l.args.0.len(), odd.args.0.len());
    }

    #[test]
    fn a_tuned_block_size_is_the_launch_bound_and_sizes_the_grid() {
        let shape = [1 << 20];
        let x = Operand::test_buffer(DType::F32, Layout::contiguous(&shape));
        let y = Output {
            step: 1,
            dtype: DType::F32,
            ptr: 0x2000,
            layout: Layout::contiguous(&shape),
        };
        let steps = [Step::Load(0), Step::Unary(UnaryOp::Exp, 0)];
        let l = pointwise_block(&steps, &[x], &[y], &shape, Compute::F32, 132, Some(512)).unwrap();
        assert!(l.source.contains("__launch_bounds__(512)"), "{}", l.source);
        // 2^20 elements, 4 a thread, 512 a block: 512 blocks, under 32 a SM.
        assert_eq!((l.block, l.grid), (512, 512));
    }

    #[test]
    fn integer_division_and_power_are_checked_through_the_error_record() {
        let x = Operand::test_buffer(DType::I32, Layout::contiguous(&[2]));
        let y = Operand::test_buffer(DType::I32, Layout::contiguous(&[1]).expanded(&[2]));
        let steps = [
            Step::Load(0),
            Step::Load(1),
            Step::Binary(BinaryOp::Div, 0, 1),
            Step::Binary(BinaryOp::Pow, 2, 1),
            Step::Binary(BinaryOp::Add, 3, 0),
        ];
        let out = Output {
            step: 4,
            dtype: DType::I32,
            ptr: 1,
            layout: Layout::contiguous(&[2]),
        };
        assert_eq!(checked_steps(&steps, Compute::I64), [2, 3]);
        // Float division and power are IEEE's: nothing to check.
        assert!(checked_steps(&steps, Compute::F32).is_empty());
        let ins = [x, y];
        // Without a site for each checked step: refused, saying why.
        let e = pointwise(
            &steps,
            &ins,
            std::slice::from_ref(&out),
            &[2],
            Compute::I64,
            1,
        )
        .unwrap_err();
        assert!(
            e.contains("integer div needs the kernel error record"),
            "{e}"
        );
        let check = ArithCheck {
            report: 0xe000,
            sites: vec![7, 8],
        };
        let l =
            pointwise_checked(&steps, &ins, &[out], &[2], Compute::I64, 1, None, &check).unwrap();
        let src = &l.source;
        assert!(
            src.contains("long long v2 = tessera_idiv(v0, v1, a.report, (unsigned)a.site[0]);"),
            "{src}"
        );
        assert!(
            src.contains("long long v3 = tessera_ipow(v2, v1, a.report, (unsigned)a.site[1]);"),
            "{src}"
        );
        assert!(src.contains("void* report; long long site[2]; };"), "{src}");
        // MIN / -1 wraps (no C division), a zero divisor reports the dividend.
        assert!(
            src.contains("if (y == -1) return (long long)(0ull - (unsigned long long)x);"),
            "{src}"
        );
        assert!(
            src.contains("if (y == 0) { tessera_report(report, site, x); return 0; }"),
            "{src}"
        );
        // The record and the sites are the last words.
        assert_eq!(l.args.0[l.args.0.len() - 3..], [0xe000, 7, 8]);
        // A kernel with no checked step has neither.
        let add = [
            Step::Load(0),
            Step::Load(1),
            Step::Binary(BinaryOp::Add, 0, 1),
        ];
        let plain = Output {
            step: 2,
            dtype: DType::I32,
            ptr: 1,
            layout: Layout::contiguous(&[2]),
        };
        let l = pointwise(&add, &ins, &[plain], &[2], Compute::I64, 1).unwrap();
        assert!(!l.source.contains("report"), "{}", l.source);
    }
}
