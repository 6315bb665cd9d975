//! Fused row kernels: a [`RowKernel`] of the fusion plan (reductions and
//! softmax along the last dim with their pointwise producers and
//! consumers: softmax decomposed into max, sub, exp, sum, div; softmax's
//! backward; layer norm) as one CUDA kernel, so that no intermediate
//! reaches device memory.
//!
//! The row schedule is the register-row softmax's ([`RowPlan`]): a warp per
//! row for short rows, a block per row for long ones, each thread holding
//! `IT × V` elements of every row value in registers (`V` per 16-byte
//! access when the streams allow it). An input row is read once; a
//! reduction folds the thread's elements and then the row's threads
//! ([`ROW_ALL`]), leaving the per-row scalar in every thread; row outputs
//! are written once. Steps are written by the pointwise generator's
//! `point_expr`, so a step computes here what it computes there.
//!
//! Inputs are read through their layouts broadcast to `outer ++ [len]`
//! (per-row scalars, full rows, any view); outputs are new contiguous
//! buffers of the kernel's output shapes. f16/bf16/f32 compute in f32,
//! `wide` kernels in f64, as on the CPU.
//!
//! Registers (ptxas for sm_90 through NVRTC 13.0, 2026-11-21, on a softmax
//! backward followed by a softmax, two row outputs): rows of 2048 take 56
//! (f32) and 95 (bf16) registers, rows of [`MAX_ROW`] 64 (f32, 1024
//! threads) and 114 (bf16, 512 threads), none spilled; f64 rows of
//! [`MAX_ROW`] (16 doubles a thread per row value) spill about 600 bytes
//! a thread to local memory: correct, slower.

use tessera::ir::kernel::{RowKernel, RowStep, Step, MAX_ROW};
use tessera::ir::ReduceOp;
use tessera::tensor::Layout;
use tessera::DType;

use super::pointwise::{f, point_expr, Operand};
use super::softmax::{RowPlan, ROW_ALL};
use super::{
    aligned, at_least_one, c_type, convert, decompose, index_type, load, padded, prelude,
    vector_width, widen, Compute, Launch, Words, ENTRY,
};

/// The compute type of `kernel`.
pub fn compute_of(kernel: &RowKernel) -> Compute {
    if kernel.wide {
        Compute::F64
    } else {
        Compute::F32
    }
}

/// Why the generator does not take `kernel`, if it does not (the executor
/// then runs the group's ops one by one and logs this reason).
pub fn refusal(kernel: &RowKernel) -> Option<String> {
    if kernel.len > MAX_ROW {
        return Some(format!(
            "rows of {} elements (at most {MAX_ROW} stay in registers)",
            kernel.len
        ));
    }
    let compute = compute_of(kernel);
    for (s, step) in kernel.steps.iter().enumerate() {
        let why = match step {
            RowStep::Point(Step::Load(_) | Step::Const(_)) => None,
            RowStep::Point(p) => point_expr(p, compute, |x| format!("v{x}")).err(),
            RowStep::Reduce(_, x) | RowStep::Softmax { arg: x, .. } => (!kernel.is_row[*x])
                .then(|| format!("step {s} reduces step {x}, a per-row scalar, not a row")),
        };
        if let Some(why) = why {
            return Some(why);
        }
    }
    None
}

/// The rows of `kernel` over `inputs` (numbered by its loads, each a
/// device buffer with its layout broadcast to `outer ++ [len]`, or a host
/// scalar) into `outputs` (the device addresses of new contiguous buffers,
/// in `kernel.outputs` order). Errors with [`refusal`]'s reason.
pub fn fused_rows(
    kernel: &RowKernel,
    inputs: &[Operand],
    outputs: &[u64],
    sms: u32,
) -> Result<Launch, String> {
    fused_rows_threads(kernel, inputs, outputs, sms, None)
}

/// Accesses a thread keeps per row value at most, for a tuner's thread
/// count (the default plan keeps at most 16, at 1024 threads a row).
const ITEMS_MAX: usize = 16;

/// [`fused_rows`] with `threads` per row (a tuner's choice among
/// [`super::softmax::THREAD_CANDIDATES`]; `None`: about four accesses a
/// thread). A choice that would keep more than 16 accesses a thread per row
/// value is refused.
pub fn fused_rows_threads(
    kernel: &RowKernel,
    inputs: &[Operand],
    outputs: &[u64],
    sms: u32,
    threads: Option<usize>,
) -> Result<Launch, String> {
    if let Some(why) = refusal(kernel) {
        return Err(why);
    }
    if outputs.len() != kernel.outputs.len() {
        return Err(format!(
            "{} output buffers for {} outputs",
            outputs.len(),
            kernel.outputs.len()
        ));
    }
    let rows: usize = kernel.outer.iter().product();
    let rank = kernel.outer.len().max(1);
    let compute = compute_of(kernel);
    let acc = compute.c_type();

    // Device buffers (by position among buffers) and constants (kernel
    // constants and host scalars, both parameters).
    let mut buffers: Vec<(DType, &Layout, u64)> = Vec::new();
    let mut consts: Vec<f64> = Vec::new();
    let mut place: Vec<Place> = Vec::with_capacity(kernel.steps.len());
    for (s, step) in kernel.steps.iter().enumerate() {
        place.push(match step {
            RowStep::Point(Step::Const(c)) => {
                consts.push(*c);
                Place::Const(consts.len() - 1)
            }
            RowStep::Point(Step::Load(k)) => match inputs.get(*k) {
                Some(Operand::Scalar(v)) => {
                    consts.push(*v);
                    Place::Const(consts.len() - 1)
                }
                Some(Operand::Buffer { dtype, ptr, layout }) => {
                    if layout.shape.len() != kernel.outer.len() + 1 {
                        return Err(format!(
                            "input {k} has layout {:?}, not broadcast to {:?} ++ [{}]",
                            layout.shape, kernel.outer, kernel.len
                        ));
                    }
                    buffers.push((*dtype, layout, *ptr));
                    Place::Buffer(buffers.len() - 1)
                }
                None => return Err(format!("step {s} loads input {k} of {}", inputs.len())),
            },
            _ => Place::Computed,
        });
    }
    let plan = schedule(kernel, &buffers, &place, threads);
    if threads.is_some() && plan.items > ITEMS_MAX {
        return Err(format!(
            "{} threads a row keep {} accesses a thread (at most {ITEMS_MAX})",
            plan.threads, plan.items
        ));
    }
    let packed = |b: usize| {
        let (d, l, p) = buffers[b];
        plan.vec > 1 && on_packs(d, l, p, plan.vec)
    };

    let mut dtypes: Vec<DType> = buffers.iter().map(|b| b.0).collect();
    dtypes.extend(kernel.outputs.iter().map(|o| o.1));
    dtypes.extend(kernel.steps.iter().filter_map(|s| match s {
        RowStep::Point(Step::Round(d, _)) => Some(*d),
        _ => None,
    }));
    let (nb, no, nc) = (buffers.len(), outputs.len(), consts.len());
    let block = plan.block();
    let mut src = prelude(&dtypes);
    src.push_str(&format!(
        "typedef {acc} ACC;\n#define V {vec}\n#define IT {items}\n#define TPR {threads}\n{ROW_ALL}\
         struct Args {{ long long rows; long long len; long long oshape[{rank}]; long long ioff[{nb1}]; \
         long long istr[{nb1}][{rank}]; long long ilast[{nb1}]; double c[{nc1}]; const void* in[{nb1}]; void* out[{no1}]; }};\n\
         extern \"C\" __global__ void __launch_bounds__({block}) {ENTRY}(Args a) {{\n\
         __shared__ ACC sh[32];\n\
         const int lane = threadIdx.x % TPR, rpb = blockDim.x / TPR;\n\
         for (long long o = (long long)blockIdx.x * rpb + threadIdx.x / TPR; o < a.rows; o += (long long)gridDim.x * rpb) {{\n",
        vec = plan.vec,
        items = plan.items,
        threads = plan.threads,
        nb1 = at_least_one(nb),
        no1 = at_least_one(no),
        nc1 = at_least_one(nc),
    ));
    // Each buffer's row: `ib{b}` is the offset of element 0 of row `o`.
    let mut targets = Vec::new();
    for b in 0..nb {
        src.push_str(&format!("long long ib{b} = a.ioff[{b}];\n"));
        targets.push((format!("ib{b}"), format!("istr[{b}]")));
    }
    if nb > 0 {
        src.push_str(&decompose(
            "o",
            "oshape",
            rank,
            &targets,
            false,
            index_type(rows),
        ));
    }
    // Which of a thread's accesses fall inside the row (the last may not).
    src.push_str(
        "bool ok[IT];\n#pragma unroll\n\
         for (int it = 0; it < IT; ++it) ok[it] = ((long long)it * TPR + lane) * V < a.len;\n",
    );
    let arg = |x: usize| match kernel.is_row[x] {
        true => format!("v{x}[k]"),
        false => format!("v{x}"),
    };
    let each = |body: &str| format!("#pragma unroll\nfor (int k = 0; k < IT * V; ++k) {body}\n");
    let access = "const long long j = ((long long)it * TPR + lane) * V;";
    for (s, step) in kernel.steps.iter().enumerate() {
        let row = kernel.is_row[s];
        let code = match (step, place[s], row) {
            (_, Place::Const(c), false) => format!("ACC v{s} = (ACC)a.c[{c}];\n"),
            (_, Place::Const(c), true) => {
                format!(
                    "ACC v{s}[IT * V];\n{}",
                    each(&format!("v{s}[k] = (ACC)a.c[{c}];"))
                )
            }
            (_, Place::Buffer(b), false) => {
                let (d, _, _) = buffers[b];
                format!(
                    "ACC v{s} = {};\n",
                    load(d, compute, &format!("a.in[{b}]"), &format!("ib{b}"))
                )
            }
            (_, Place::Buffer(b), true) => {
                let (d, _, _) = buffers[b];
                let ct = c_type(d);
                let fill = if packed(b) {
                    format!(
                        "const Pack<{ct}, V> p = *(const Pack<{ct}, V>*)((const {ct}*)a.in[{b}] + ib{b} + j);\n\
                         #pragma unroll\nfor (int e = 0; e < V; ++e) v{s}[it * V + e] = {};",
                        widen(d, compute, "p.v[e]")
                    )
                } else {
                    format!(
                        "#pragma unroll\nfor (int e = 0; e < V; ++e) v{s}[it * V + e] = {};",
                        load(
                            d,
                            compute,
                            &format!("a.in[{b}]"),
                            &format!("ib{b} + (j + e) * a.ilast[{b}]")
                        )
                    )
                };
                format!(
                    "ACC v{s}[IT * V];\n#pragma unroll\nfor (int it = 0; it < IT; ++it) {{ {access}\n\
                     if (ok[it]) {{\n{fill} }}\n\
                     else {{\n#pragma unroll\nfor (int e = 0; e < V; ++e) v{s}[it * V + e] = (ACC)0; }} }}\n"
                )
            }
            (RowStep::Point(p), Place::Computed, false) => {
                format!("ACC v{s} = {};\n", point_expr(p, compute, arg)?)
            }
            (RowStep::Point(p), Place::Computed, true) => format!(
                "ACC v{s}[IT * V];\n{}",
                each(&format!("v{s}[k] = {};", point_expr(p, compute, arg)?))
            ),
            (RowStep::Reduce(op, x), _, _) => reduction(s, *op, *x),
            (RowStep::Softmax { log, arg: x }, _, _) => softmax(s, *log, *x, compute),
        };
        src.push_str(&code);
    }
    for (o, &(s, dtype, _)) in kernel.outputs.iter().enumerate() {
        let ct = c_type(dtype);
        let code = if !kernel.is_row[s] {
            format!(
                "if (lane == 0) (({ct}*)a.out[{o}])[o] = {};\n",
                convert(dtype, compute, &format!("v{s}"))
            )
        } else if plan.vec > 1
            && vector_width(&[dtype]).is_some()
            && aligned(outputs[o], dtype, plan.vec)
        {
            format!(
                "#pragma unroll\nfor (int it = 0; it < IT; ++it) if (ok[it]) {{ {access}\n\
                 Pack<{ct}, V> q;\n#pragma unroll\nfor (int e = 0; e < V; ++e) q.v[e] = {};\n\
                 *(Pack<{ct}, V>*)(({ct}*)a.out[{o}] + o * a.len + j) = q; }}\n",
                convert(dtype, compute, &format!("v{s}[it * V + e]"))
            )
        } else {
            format!(
                "#pragma unroll\nfor (int it = 0; it < IT; ++it) if (ok[it]) {{ {access}\n\
                 #pragma unroll\nfor (int e = 0; e < V; ++e) (({ct}*)a.out[{o}])[o * a.len + j + e] = {}; }}\n",
                convert(dtype, compute, &format!("v{s}[it * V + e]"))
            )
        };
        src.push_str(&code);
    }
    src.push_str("}\n}\n");

    let mut args = Words::default();
    args.int(rows as i64)
        .int(kernel.len as i64)
        .ints(padded(&kernel.outer, rank, 1));
    for (_, l, _) in &buffers {
        args.int(l.offset as i64);
    }
    args.zeros(at_least_one(nb) - nb);
    for (_, l, _) in &buffers {
        args.ints(padded(&l.strides[..kernel.outer.len()], rank, 0));
    }
    args.zeros((at_least_one(nb) - nb) * rank);
    for (_, l, _) in &buffers {
        args.int(*l.strides.last().expect("rank >= 1") as i64);
    }
    args.zeros(at_least_one(nb) - nb);
    for &c in &consts {
        args.float(c);
    }
    args.zeros(at_least_one(nc) - nc);
    for (_, _, p) in &buffers {
        args.ptr(*p);
    }
    args.zeros(at_least_one(nb) - nb);
    for &p in outputs {
        args.ptr(p);
    }
    args.zeros(at_least_one(no) - no);
    let rpb = block / plan.threads;
    let grid = rows.div_ceil(rpb).min(sms as usize * 64).max(1) as u32;
    Ok(Launch {
        source: src,
        args,
        grid,
        block: block as u32,
    })
}

/// Where a step's value comes from.
#[derive(Clone, Copy, Debug)]
enum Place {
    /// A parameter (`a.c[i]`): a kernel constant or a host scalar.
    Const(usize),
    /// Device buffer `b` (by position among the buffers).
    Buffer(usize),
    /// Computed from other steps.
    Computed,
}

/// The row plan: `V` elements an access when the kernel computes in f32,
/// the row length is a whole number of accesses (`V` from the 2- and
/// 4-byte float rows streamed: row inputs read contiguously, row outputs);
/// else one element an access. Rows that are not on packs (a strided,
/// misaligned or non-float input, a bool output, an output at an odd
/// address) are read and written element by element at those positions.
fn schedule(
    kernel: &RowKernel,
    buffers: &[(DType, &Layout, u64)],
    place: &[Place],
    threads: Option<usize>,
) -> RowPlan {
    let packable = |d: DType| vector_width(&[d]).is_some();
    let mut streams: Vec<DType> = Vec::new();
    for (s, p) in place.iter().enumerate() {
        if let (Place::Buffer(b), true) = (p, kernel.is_row[s]) {
            let (d, l, _) = buffers[*b];
            if l.strides.last() == Some(&1) && packable(d) {
                streams.push(d);
            }
        }
    }
    for &(s, d, _) in &kernel.outputs {
        if kernel.is_row[s] && packable(d) {
            streams.push(d);
        }
    }
    let vec = match compute_of(kernel) {
        Compute::F32 => vector_width(&streams)
            .filter(|&v| kernel.len.is_multiple_of(v))
            .unwrap_or(1),
        _ => 1,
    };
    RowPlan::of(kernel.len.div_ceil(vec), vec, threads)
}

/// Whether a row input of `dtype` through `layout` at `ptr` is read in
/// `vec`-element packs: its row contiguous, every row start on a whole
/// access.
fn on_packs(dtype: DType, layout: &Layout, ptr: u64, vec: usize) -> bool {
    let size = dtype.size_bytes();
    let rank = layout.shape.len();
    vector_width(&[dtype]).is_some()
        && layout.strides[rank - 1] == 1
        && aligned(ptr + (layout.offset * size) as u64, dtype, vec)
        && layout.shape[..rank - 1]
            .iter()
            .zip(&layout.strides)
            .all(|(&n, &st)| n == 1 || st.is_multiple_of(vec))
}

/// Step `s`, `op` over row value `x`: the thread's elements of the row,
/// then the row's threads.
fn reduction(s: usize, op: ReduceOp, x: usize) -> String {
    let (kind, identity) = match op {
        ReduceOp::Sum | ReduceOp::Mean => ("ROW_SUM", "(ACC)0"),
        ReduceOp::Prod => ("ROW_PROD", "(ACC)1"),
        ReduceOp::Max => ("ROW_MAX", "(ACC)(-TS_INF)"),
        ReduceOp::Min => ("ROW_MIN", "(ACC)TS_INF"),
    };
    let mean = match op {
        ReduceOp::Mean => format!("v{s} = v{s} / (ACC)a.len;\n"),
        _ => String::new(),
    };
    format!(
        "ACC v{s} = {identity};\n#pragma unroll\n\
         for (int k = 0; k < IT * V; ++k) if (ok[k / V]) v{s} = row_combine<{kind}>(v{s}, v{x}[k]);\n\
         v{s} = row_all<{kind}>(v{s}, sh);\n{mean}"
    )
}

/// Step `s`, softmax (or log_softmax) of row value `x`: the row's max, the
/// sum of `exp(x - max)` (kept per element for softmax), then the result.
fn softmax(s: usize, log: bool, x: usize, compute: Compute) -> String {
    let (exp, ln) = (f("exp", compute), f("log", compute));
    let result = if log {
        format!("v{s}[k] = v{x}[k] - m{s} - {ln}(z{s});")
    } else {
        format!("v{s}[k] = v{s}[k] / z{s};")
    };
    format!(
        "ACC m{s} = (ACC)(-TS_INF);\n#pragma unroll\n\
         for (int k = 0; k < IT * V; ++k) if (ok[k / V]) m{s} = row_combine<ROW_MAX>(m{s}, v{x}[k]);\n\
         m{s} = row_all<ROW_MAX>(m{s}, sh);\n\
         ACC v{s}[IT * V]; ACC z{s} = (ACC)0;\n#pragma unroll\n\
         for (int k = 0; k < IT * V; ++k) {{ v{s}[k] = {exp}(v{x}[k] - m{s}); if (ok[k / V]) z{s} += v{s}[k]; }}\n\
         z{s} = row_all<ROW_SUM>(z{s}, sh);\n#pragma unroll\n\
         for (int k = 0; k < IT * V; ++k) {result}\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera::ir::{BinaryOp, UnaryOp};

    /// m = max(x); e = exp(x - m); s = sum(e); y = e / s, with y and the
    /// sum written (the fusion plan's decomposed softmax).
    fn decomposed_softmax(outer: &[usize], len: usize, out: DType) -> RowKernel {
        let rows: usize = outer.iter().product();
        RowKernel {
            outer: outer.to_vec(),
            len,
            steps: vec![
                RowStep::Point(Step::Load(0)),
                RowStep::Reduce(ReduceOp::Max, 0),
                RowStep::Point(Step::Binary(BinaryOp::Sub, 0, 1)),
                RowStep::Point(Step::Unary(UnaryOp::Exp, 2)),
                RowStep::Reduce(ReduceOp::Sum, 3),
                RowStep::Point(Step::Binary(BinaryOp::Div, 3, 4)),
            ],
            is_row: vec![true, false, true, true, false, true],
            outputs: vec![
                (5, out, outer.iter().copied().chain([len]).collect()),
                (4, DType::F32, vec![rows, 1]),
            ],
            wide: false,
        }
    }

    #[test]
    fn a_decomposed_softmax_reads_its_row_once_in_packs_and_reduces_twice() {
        let k = decomposed_softmax(&[64], 2048, DType::BF16);
        let x = Operand::test_buffer(DType::BF16, Layout::contiguous(&[64, 2048]));
        let l = fused_rows(&k, &[x], &[0x2000, 0x3000], 132).unwrap();
        let src = &l.source;
        // bf16 in and out: 8 a pack, 256 packs, 64 threads of 4 packs.
        assert!(
            src.contains("#define V 8\n#define IT 4\n#define TPR 64"),
            "{src}"
        );
        assert_eq!((l.block, l.grid), (64, 64));
        assert_eq!(
            src.matches("const Pack<__nv_bfloat16, V> p").count(),
            1,
            "{src}"
        );
        assert!(src.contains("v1 = row_all<ROW_MAX>(v1, sh);"), "{src}");
        assert!(src.contains("v4 = row_all<ROW_SUM>(v4, sh);"), "{src}");
        assert!(src.contains("v3[k] = expf(v2[k]);"), "{src}");
        assert!(src.contains("v2[k] = (v0[k] - v1);"), "{src}");
        // The row output in packs, the per-row sum by one lane.
        assert!(
            src.contains(
                "*(Pack<__nv_bfloat16, V>*)((__nv_bfloat16*)a.out[0] + o * a.len + j) = q;"
            ),
            "{src}"
        );
        assert!(
            src.contains("if (lane == 0) ((float*)a.out[1])[o] = (float)(v4);"),
            "{src}"
        );
        // rows, len, oshape[1], ioff[1], istr[1][1], ilast[1], c[1], in[1], out[2]
        assert_eq!(
            l.args.0,
            vec![64, 2048, 64, 0, 2048, 1, 0, 0x1000, 0x2000, 0x3000]
        );
    }

    #[test]
    fn short_rows_take_a_warp_each_and_odd_lengths_one_element_an_access() {
        let k = decomposed_softmax(&[1000], 40, DType::F32);
        let x = Operand::test_buffer(DType::F32, Layout::contiguous(&[1000, 40]));
        let l = fused_rows(&k, std::slice::from_ref(&x), &[0x2000, 0x3000], 132).unwrap();
        // 10 packs of 4: a warp per row, 8 rows a block.
        assert!(
            l.source
                .contains("#define V 4\n#define IT 1\n#define TPR 32"),
            "{}",
            l.source
        );
        assert_eq!((l.block, l.grid), (256, 125));
        let odd = decomposed_softmax(&[3], 45, DType::F32);
        let x = Operand::test_buffer(DType::F32, Layout::contiguous(&[3, 45]));
        let l = fused_rows(&odd, &[x], &[0x2000, 0x3000], 132).unwrap();
        assert!(
            l.source
                .contains("#define V 1\n#define IT 2\n#define TPR 32"),
            "{}",
            l.source
        );
        assert!(!l.source.contains("Pack<float, V> p"), "{}", l.source);
        assert!(
            l.source
                .contains("((const float*)a.in[0])[ib0 + (j + e) * a.ilast[0]]"),
            "{}",
            l.source
        );
    }

    #[test]
    fn per_row_scalars_views_and_host_scalars_are_read_through_their_layouts() {
        // y = (x - mu) * rstd * w + 0.5: x a transposed view, mu a per-row
        // [rows, 1] buffer, rstd a host scalar, w a [len] row broadcast.
        let (rows, len) = (6, 32);
        let k = RowKernel {
            outer: vec![rows],
            len,
            steps: vec![
                RowStep::Point(Step::Load(0)),
                RowStep::Point(Step::Load(1)),
                RowStep::Point(Step::Binary(BinaryOp::Sub, 0, 1)),
                RowStep::Point(Step::Load(2)),
                RowStep::Point(Step::Binary(BinaryOp::Mul, 2, 3)),
                RowStep::Point(Step::Load(3)),
                RowStep::Point(Step::Binary(BinaryOp::Mul, 4, 5)),
                RowStep::Point(Step::Const(0.5)),
                RowStep::Point(Step::Binary(BinaryOp::Add, 6, 7)),
                RowStep::Reduce(ReduceOp::Mean, 8),
            ],
            is_row: vec![
                true, false, true, false, true, true, true, false, true, false,
            ],
            outputs: vec![
                (8, DType::F16, vec![rows, len]),
                (9, DType::F32, vec![rows]),
            ],
            wide: false,
        };
        let full = [rows, len];
        let x = Operand::test_buffer(
            DType::F32,
            Layout::contiguous(&[len, rows]).permuted(&[1, 0]),
        );
        let mu = Operand::test_buffer(DType::F32, Layout::contiguous(&[rows, 1]).expanded(&full));
        let w = Operand::test_buffer(DType::F16, Layout::contiguous(&[len]).expanded(&full));
        let ins = [x, mu, Operand::Scalar(2.0), w];
        let l = fused_rows(&k, &ins, &[0x2000, 0x3000], 132).unwrap();
        let src = &l.source;
        assert!(src.contains("#include <cuda_fp16.h>"), "{src}");
        assert!(
            src.contains("ACC v1 = (float)((const float*)a.in[1])[ib1];"),
            "{src}"
        );
        assert!(src.contains("ACC v3 = (ACC)a.c[0];"), "{src}");
        assert!(src.contains("ACC v7 = (ACC)a.c[1];"), "{src}");
        assert!(src.contains("v9 = v9 / (ACC)a.len;"), "{src}");
        // The transposed x element by element, w (contiguous f16) in packs.
        assert!(
            src.contains("a.in[0])[ib0 + (j + e) * a.ilast[0]]"),
            "{src}"
        );
        assert!(
            src.contains(
                "Pack<__half, V> p = *(const Pack<__half, V>*)((const __half*)a.in[2] + ib2 + j)"
            ),
            "{src}"
        );
        // istr: x [1], mu [1], w [0]; ilast: x 6, mu 0, w 1.
        assert_eq!(&l.args.0[3..12], &[0, 0, 0, 1, 1, 0, rows as u64, 0, 1]);
        assert_eq!(f64::from_bits(l.args.0[12]), 2.0);
        assert_eq!(f64::from_bits(l.args.0[13]), 0.5);
    }

    #[test]
    fn wide_kernels_compute_in_f64_one_element_an_access() {
        let mut k = decomposed_softmax(&[4], 64, DType::F64);
        k.wide = true;
        k.steps.push(RowStep::Softmax { log: true, arg: 0 });
        k.is_row.push(true);
        k.outputs.push((6, DType::F64, vec![4, 64]));
        let x = Operand::test_buffer(DType::F64, Layout::contiguous(&[4, 64]));
        let l = fused_rows(&k, &[x], &[8, 16, 24], 132).unwrap();
        assert!(
            l.source.contains("typedef double ACC;\n#define V 1"),
            "{}",
            l.source
        );
        assert!(
            l.source.contains("v6[k] = v0[k] - m6 - log(z6);"),
            "{}",
            l.source
        );
        assert!(l.source.contains("exp(v0[k] - m6)"), "{}", l.source);
    }

    #[test]
    fn a_tuned_thread_count_reshapes_the_rows_within_the_register_limit() {
        let k = decomposed_softmax(&[64], 2048, DType::F32);
        let x = Operand::test_buffer(DType::F32, Layout::contiguous(&[64, 2048]));
        let with = |t| fused_rows_threads(&k, std::slice::from_ref(&x), &[8, 16], 132, Some(t));
        // 512 packs of 4: 1024 threads keep 1 each, 32 keep 16.
        let wide = with(1024).unwrap();
        assert!(
            wide.source.contains("#define IT 1\n#define TPR 1024"),
            "{}",
            wide.source
        );
        assert_eq!((wide.block, wide.grid), (1024, 64));
        let warp = with(32).unwrap();
        assert!(
            warp.source.contains("#define IT 16\n#define TPR 32"),
            "{}",
            warp.source
        );
        assert_eq!((warp.block, warp.grid), (256, 8));
        let long = decomposed_softmax(&[2], MAX_ROW, DType::F32);
        let x = Operand::test_buffer(DType::F32, Layout::contiguous(&[2, MAX_ROW]));
        let e = fused_rows_threads(&long, &[x], &[8, 16], 132, Some(64)).unwrap_err();
        assert!(e.contains("64 accesses a thread"), "{e}");
    }

    #[test]
    fn what_the_generator_does_not_take_is_refused_with_a_reason() {
        let mut k = decomposed_softmax(&[4], 64, DType::F32);
        assert_eq!(refusal(&k), None);
        k.steps.push(RowStep::Reduce(ReduceOp::Sum, 4));
        k.is_row.push(false);
        let why = refusal(&k).unwrap();
        assert!(why.contains("per-row scalar"), "{why}");
        let mut k = decomposed_softmax(&[4], 64, DType::F32);
        k.steps.push(RowStep::Point(Step::Round(DType::I64, 5)));
        k.is_row.push(true);
        assert!(refusal(&k).unwrap().contains("rounding to i64"));
        let x = Operand::test_buffer(DType::F32, Layout::contiguous(&[4, 64]));
        assert!(fused_rows(&k, &[x], &[1, 2], 132).is_err());
    }
}
