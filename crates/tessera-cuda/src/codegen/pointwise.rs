//! Pointwise kernels from a fused step list (the fusion plan's
//! [`FusedKernel`](tessera::runtime::cpu::fused::FusedKernel) steps): one
//! thread per output element in a grid-stride loop, every step a register,
//! inputs read through their own (broadcast, strided) layouts, outputs
//! written through theirs. Eager elementwise ops, casts, copies and `cat`
//! are one-step instances of the same kernel.

use tessera::ir::{BinaryOp, CompareOp, UnaryOp};
use tessera::runtime::cpu::fused::Step;
use tessera::tensor::Layout;
use tessera::DType;

use super::{
    at_least_one, c_type, convert, decompose, grid_for, index_type, load, padded, prelude, Compute,
    Launch, Words, ENTRY,
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

/// One output: a device buffer written through `layout` (the kernel's
/// shape; contiguous for new tensors, a strided view for `cat`).
#[derive(Clone, Debug)]
pub struct Output {
    pub step: usize,
    pub dtype: DType,
    pub ptr: u64,
    pub layout: Layout,
}

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
    src.push_str(&format!(
        "struct Args {{ long long n; long long shape[{rank}]; long long ioff[{ni1}]; long long istr[{ni1}][{rank}]; \
         long long ooff[{no1}]; long long ostr[{no1}][{rank}]; double c[{nc1}]; const void* in[{ni1}]; void* out[{no1}]; }};\n",
        ni1 = at_least_one(ni),
        no1 = at_least_one(no),
        nc1 = at_least_one(nc),
    ));
    let vector = vector_width(&buffers, outputs, n, any_strided);
    src.push_str(&format!(
        "extern \"C\" __global__ void __launch_bounds__(256) {ENTRY}(Args a) {{\n"
    ));
    let body = |load_at: &dyn Fn(usize) -> (String, String),
                store_at: &dyn Fn(usize) -> String|
     -> Result<String, String> {
        step_lines(
            steps,
            &buffers,
            compute,
            &const_of_step,
            outputs,
            load_at,
            store_at,
        )
    };
    let tail_start = if vector > 1 {
        // Packs of `vector` elements per thread: one 16-byte access per
        // 16 bytes of every buffer (all contiguous and 16-byte aligned).
        for (b, (_, d, _, _)) in buffers.iter().enumerate() {
            src.push_str(&format!(
                "struct __align__(16) PI{b} {{ {} v[{vector}]; }};\n",
                c_type(*d)
            ));
        }
        for (o, out) in outputs.iter().enumerate() {
            src.push_str(&format!(
                "struct __align__(16) PO{o} {{ {} v[{vector}]; }};\n",
                c_type(out.dtype)
            ));
        }
        src.push_str(&format!(
            "long long nv = a.n / {vector};\n\
             for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < nv; j += (long long)gridDim.x * blockDim.x) {{\n"
        ));
        for (b, (_, d, _, _)) in buffers.iter().enumerate() {
            src.push_str(&format!(
                "PI{b} x{b} = ((const PI{b}*)((const {t}*)a.in[{b}] + a.ioff[{b}]))[j];\n",
                t = c_type(*d)
            ));
        }
        for o in 0..outputs.len() {
            src.push_str(&format!("PO{o} y{o};\n"));
        }
        src.push_str(&format!(
            "#pragma unroll\nfor (int e = 0; e < {vector}; e++) {{\n"
        ));
        src.push_str(&body(&|b| (format!("x{b}.v"), "e".to_string()), &|o| {
            format!("y{o}.v[e]")
        })?);
        src.push_str("}\n");
        for (o, out) in outputs.iter().enumerate() {
            src.push_str(&format!(
                "((PO{o}*)(({t}*)a.out[{o}] + a.ooff[{o}]))[j] = y{o};\n",
                t = c_type(out.dtype)
            ));
        }
        src.push_str("}\n");
        format!("nv * {vector} + ")
    } else {
        String::new()
    };
    // Element by element: every layout, and the tail of the packed path.
    src.push_str(&format!(
        "for (long long i = {tail_start}(long long)blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += (long long)gridDim.x * blockDim.x) {{\n"
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
    src.push_str(&body(
        &|b| (format!("a.in[{b}]"), format!("io{b}")),
        &|o| format!("(({}*)a.out[{o}])[oo{o}]", c_type(outputs[o].dtype)),
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
    Ok(Launch {
        source: src,
        args,
        grid: grid_for(n.div_ceil(vector), 256, sms),
        block: 256,
    })
}

/// Elements per thread of the packed path: 16 bytes of the narrowest dtype
/// (4 f32, 8 bf16/f16, 2 f64), when every buffer is contiguous, starts
/// 16-byte aligned and there is at least one whole pack; else 1 (element
/// by element).
fn vector_width(
    buffers: &[(usize, DType, &Layout, u64)],
    outputs: &[Output],
    n: usize,
    any_strided: bool,
) -> usize {
    let starts = buffers
        .iter()
        .map(|&(_, d, l, p)| (d, p + (l.offset * d.size_bytes()) as u64))
        .chain(outputs.iter().map(|o| {
            (
                o.dtype,
                o.ptr + (o.layout.offset * o.dtype.size_bytes()) as u64,
            )
        }));
    let mut narrowest = 16;
    for (d, start) in starts {
        if start % 16 != 0 {
            return 1;
        }
        narrowest = narrowest.min(d.size_bytes());
    }
    let v = 16 / narrowest;
    if any_strided || v < 2 || n < v || !packing() {
        return 1;
    }
    v
}

/// `TESSERA_CUDA_PACK=0` turns the packed path off (to measure it).
fn packing() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TESSERA_CUDA_PACK").map_or(true, |v| v != "0"))
}

/// The computation of one element: every step a register, then every
/// output stored. `load_at(b)` gives buffer `b`'s (pointer, index) and
/// `store_at(o)` output `o`'s lvalue.
fn step_lines(
    steps: &[Step],
    buffers: &[(usize, DType, &Layout, u64)],
    compute: Compute,
    const_of_step: &[Option<usize>],
    outputs: &[Output],
    load_at: &dyn Fn(usize) -> (String, String),
    store_at: &dyn Fn(usize) -> String,
) -> Result<String, String> {
    let buffer_pos = |k: usize| buffers.iter().position(|b| b.0 == k);
    let acc = compute.c_type();
    let mut src = String::new();
    for (s, step) in steps.iter().enumerate() {
        let expr = match *step {
            Step::Load(k) => match buffer_pos(k) {
                Some(b) => {
                    let (ptr, at) = load_at(b);
                    load(buffers[b].1, compute, &ptr, &at)
                }
                None => format!("({acc})a.c[{}]", const_of_step[s].expect("a scalar")),
            },
            Step::Const(_) => format!("({acc})a.c[{}]", const_of_step[s].expect("a const")),
            Step::Unary(op, x) => unary(op, compute, &format!("v{x}"))?,
            Step::Binary(op, x, y) => binary(op, compute, &format!("v{x}"), &format!("v{y}"))?,
            Step::Compare(op, x, y) => {
                format!(
                    "(({}) ? ({acc})1 : ({acc})0)",
                    compare(op, &format!("v{x}"), &format!("v{y}"))
                )
            }
            Step::Where(c, x, y) => format!("((v{c} != ({acc})0) ? v{x} : v{y})"),
            Step::Round(d, x) => round(d, compute, &format!("v{x}"))?,
        };
        src.push_str(&format!("{acc} v{s} = {expr};\n"));
    }
    for (o, out) in outputs.iter().enumerate() {
        src.push_str(&format!(
            "{} = {};\n",
            store_at(o),
            convert(out.dtype, compute, &format!("v{}", out.step))
        ));
    }
    Ok(src)
}

/// `name` for double, `namef` for float.
fn f(name: &str, compute: Compute) -> String {
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
    if c == Compute::I64 {
        return match op {
            UnaryOp::Neg => Ok(format!("(long long)(0ull - (unsigned long long){x})")),
            UnaryOp::Abs => Ok(format!(
                "({x} < 0 ? (long long)(0ull - (unsigned long long){x}) : {x})"
            )),
            UnaryOp::Relu => Ok(format!("({x} < 0 ? 0ll : {x})")),
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
    })
}

/// A binary op as CPU computes it; NaN-propagating maximum/minimum.
fn binary(op: BinaryOp, c: Compute, x: &str, y: &str) -> Result<String, String> {
    if c == Compute::I64 {
        let wrap = |sym: &str| {
            format!("(long long)((unsigned long long){x} {sym} (unsigned long long){y})")
        };
        return match op {
            BinaryOp::Add => Ok(wrap("+")),
            BinaryOp::Sub => Ok(wrap("-")),
            BinaryOp::Mul => Ok(wrap("*")),
            BinaryOp::Maximum => Ok(format!("({x} > {y} ? {x} : {y})")),
            BinaryOp::Minimum => Ok(format!("({x} < {y} ? {x} : {y})")),
            // The CPU reports a division by zero as an error; a kernel
            // cannot, so integer div and pow stay on the CPU.
            BinaryOp::Div | BinaryOp::Pow => Err(format!(
                "integer {} is not supported on the GPU (it cannot report a division by zero); \
                 run it on the CPU",
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

    fn buffer(dtype: DType, layout: Layout) -> Operand {
        Operand::Buffer {
            dtype,
            ptr: 0x1000,
            layout,
        }
    }

    #[test]
    fn a_contiguous_chain_has_no_index_arithmetic_and_packs_its_words_in_field_order() {
        // y = exp(x) * 2, x and y contiguous f32 [4, 8].
        let steps = [
            Step::Load(0),
            Step::Unary(UnaryOp::Exp, 0),
            Step::Const(2.0),
            Step::Binary(BinaryOp::Mul, 1, 2),
        ];
        let x = buffer(DType::F32, Layout::contiguous(&[4, 8]));
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
        let a = buffer(DType::BF16, Layout::contiguous(&[3]).expanded(&[2, 3]));
        let b = buffer(DType::F32, Layout::contiguous(&[3, 2]).permuted(&[1, 0]));
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
        let x = buffer(DType::F32, Layout::contiguous(&[5]));
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
    fn aligned_contiguous_kernels_move_16_byte_packs_and_others_do_not() {
        let steps = [Step::Load(0), Step::Unary(UnaryOp::Exp, 0)];
        let run = |dtype: DType, out_ptr: u64, layout: Layout, n: usize| {
            let x = buffer(dtype, layout.clone());
            let y = Output {
                step: 1,
                dtype,
                ptr: out_ptr,
                layout: Layout::contiguous(&[n]),
            };
            pointwise(&steps, &[x], &[y], &[n], Compute::F32, 132).unwrap()
        };
        // 4 f32 or 8 bf16 per thread, then the element-by-element tail.
        let f = run(DType::F32, 0x2000, Layout::contiguous(&[1030]), 1030);
        assert!(
            f.source
                .contains("struct __align__(16) PI0 { float v[4]; };"),
            "{}",
            f.source
        );
        assert!(
            f.source.contains("for (long long i = nv * 4 + "),
            "{}",
            f.source
        );
        let h = run(DType::BF16, 0x2000, Layout::contiguous(&[1030]), 1030);
        assert!(
            h.source.contains("PO0 { __nv_bfloat16 v[8]; };"),
            "{}",
            h.source
        );
        // A misaligned output, a strided input, or too few elements: none.
        let odd = run(DType::F32, 0x2004, Layout::contiguous(&[1030]), 1030);
        let strided = run(
            DType::F32,
            0x2000,
            Layout::contiguous(&[1030]).sliced(0, 0, 515, 2),
            515,
        );
        let short = run(DType::F32, 0x2000, Layout::contiguous(&[3]), 3);
        for l in [odd, strided, short] {
            assert!(!l.source.contains("PI0"), "{}", l.source);
        }
    }

    #[test]
    fn integer_division_is_refused_with_a_reason() {
        let x = buffer(DType::I64, Layout::contiguous(&[2]));
        let steps = [
            Step::Load(0),
            Step::Load(0),
            Step::Binary(BinaryOp::Div, 0, 1),
        ];
        let out = Output {
            step: 2,
            dtype: DType::I64,
            ptr: 1,
            layout: Layout::contiguous(&[2]),
        };
        let e = pointwise(&steps, &[x], &[out], &[2], Compute::I64, 1).unwrap_err();
        assert!(e.contains("integer div"), "{e}");
    }
}
