//! Kernels that combine many elements into one: reductions (sum, mean,
//! max, min, prod over any dims), arg-reductions and softmax/log_softmax
//! along one dim.
//!
//! The input is seen as `kept dims × reduced dims`, each a (shape, strides)
//! list taken from the input's layout, so any view reduces in place with
//! no copy. Two schedules: a block per output (threads stride over the
//! reduced elements, then a shuffle tree) when the reduced elements are
//! adjacent in memory or many; a thread per output when the outputs are
//! adjacent and the reduced elements are not (a column sum), so that a
//! warp's loads stay coalesced. A block-per-output row that is one
//! contiguous aligned run is read in 16-byte packs.
//!
//! Softmax, a row kernel too, is in [`super::softmax`].

use tessera::ir::{ArgReduceOp, ReduceOp};
use tessera::tensor::Layout;
use tessera::DType;

use super::{
    c_type, convert, decompose, grid_for, index_type, load, padded, prelude, Compute, Launch,
    Words, ENTRY,
};

/// The input split into the dims that stay and the dims reduced.
#[derive(Clone, Debug)]
pub struct Split {
    pub kept_shape: Vec<usize>,
    pub kept_strides: Vec<usize>,
    pub red_shape: Vec<usize>,
    pub red_strides: Vec<usize>,
    pub offset: usize,
}

impl Split {
    pub fn new(layout: &Layout, dims: &[usize]) -> Split {
        let mut s = Split {
            kept_shape: vec![],
            kept_strides: vec![],
            red_shape: vec![],
            red_strides: vec![],
            offset: layout.offset,
        };
        for (d, (&n, &st)) in layout.shape.iter().zip(&layout.strides).enumerate() {
            if dims.contains(&d) {
                s.red_shape.push(n);
                s.red_strides.push(st);
            } else {
                s.kept_shape.push(n);
                s.kept_strides.push(st);
            }
        }
        s
    }

    /// The same split with each class's dims merged where their strides
    /// allow (`stride[d] == stride[d+1] · shape[d+1]`: the pair walks
    /// memory as one dim) and size-1 dims dropped, so a reduction
    /// decomposes fewer indices per element. Valid for reductions only:
    /// the output index walks the kept dims in the same row-major order,
    /// but a caller that pairs two splits dim by dim (softmax's input and
    /// output) must not merge one of them.
    pub fn merged(self) -> Split {
        let merge = |shape: &[usize], strides: &[usize]| {
            let mut out: Vec<(usize, usize)> = Vec::new();
            for (&n, &st) in shape.iter().zip(strides) {
                if n == 1 {
                    continue;
                }
                match out.last_mut() {
                    Some((pn, ps)) if *ps == st * n => {
                        *pn *= n;
                        *ps = st;
                    }
                    _ => out.push((n, st)),
                }
            }
            out.into_iter().unzip::<_, _, Vec<_>, Vec<_>>()
        };
        let (kept_shape, kept_strides) = merge(&self.kept_shape, &self.kept_strides);
        let (red_shape, red_strides) = merge(&self.red_shape, &self.red_strides);
        Split {
            kept_shape,
            kept_strides,
            red_shape,
            red_strides,
            offset: self.offset,
        }
    }

    pub(super) fn n_out(&self) -> usize {
        self.kept_shape.iter().product()
    }

    pub(super) fn n_red(&self) -> usize {
        self.red_shape.iter().product()
    }

    /// A thread per output pays off when neighbouring outputs are
    /// neighbours in memory and neighbouring reduced elements are not.
    fn columns(&self) -> bool {
        let inner = |shape: &[usize], strides: &[usize]| {
            shape
                .iter()
                .zip(strides)
                .rev()
                .find(|(&n, _)| n > 1)
                .map(|(_, &s)| s)
        };
        inner(&self.kept_shape, &self.kept_strides) == Some(1)
            && inner(&self.red_shape, &self.red_strides) != Some(1)
            && self.n_out() >= 32
    }

    fn words(&self, args: &mut Words) -> (usize, usize) {
        let k = self.kept_shape.len().max(1);
        let r = self.red_shape.len().max(1);
        args.int(self.n_out() as i64)
            .int(self.n_red() as i64)
            .int(self.offset as i64)
            .ints(padded(&self.kept_shape, k, 1))
            .ints(padded(&self.kept_strides, k, 0))
            .ints(padded(&self.red_shape, r, 1))
            .ints(padded(&self.red_strides, r, 0));
        (k, r)
    }
}

/// A column reduction's threads per SM (over all its parts).
const COLUMN_THREADS_PER_SM: usize = 1024;
/// The fewest rows of a column reduction's part.
const COLUMN_PART: usize = 32;
/// The most parts of a column reduction (the second pass walks them).
const MAX_COLUMN_PARTS: usize = 256;

/// Threads per block for `n` reduced elements: a power of two, 32..=256.
pub(super) fn block_for(n: usize) -> u32 {
    (n.next_power_of_two()).clamp(32, 256) as u32
}

/// Warp and block combining of `ACC` values with `COMBINE(a, b)`; the block
/// result is handed to every thread.
const TREE: &str = r#"
__device__ __forceinline__ ACC warp_all(ACC v) {
  for (int o = 16; o > 0; o >>= 1) { ACC w = __shfl_xor_sync(0xffffffffu, v, o); v = COMBINE(v, w); }
  return v;
}
__device__ ACC block_all(ACC v) {
  __shared__ ACC sh[32];
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_all(v);
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  v = lane < nw ? sh[lane] : IDENTITY;
  v = warp_all(v);
  return v;
}
"#;

/// `op` over `dims` of the input (`layout`, `dtype`) into a contiguous
/// output of `out_dtype`.
#[allow(clippy::too_many_arguments)]
pub fn reduce(
    op: ReduceOp,
    dtype: DType,
    layout: &Layout,
    dims: &[usize],
    out_dtype: DType,
    x: u64,
    y: u64,
    sms: u32,
) -> Launch {
    let split = Split::new(layout, dims).merged();
    let scale = (op == ReduceOp::Mean).then(|| 1.0 / split.n_red().max(1) as f64);
    reduce_impl(op, scale, 1, dtype, &split, Some(out_dtype), x, y, sms)
}

/// How many parts to cut each output's reduced elements into, so that a
/// few outputs over many elements still fill the GPU (a full sum over a
/// billion elements must not be one block's work); 1 when no cut pays.
pub fn parts_for(layout: &Layout, dims: &[usize], sms: u32) -> usize {
    let split = Split::new(layout, dims).merged();
    let (n_out, n_red) = (split.n_out().max(1), split.n_red());
    if split.columns() {
        // A thread per (column, part): enough threads to fill every SM
        // (a bias gradient, 768 columns × 8192 rows, is otherwise 768
        // threads walking 8192 rows each), each part at least
        // COLUMN_PART rows so the partial results stay few.
        let want = (sms as usize * COLUMN_THREADS_PER_SM).div_ceil(n_out);
        return want.min(n_red / COLUMN_PART).clamp(1, MAX_COLUMN_PARTS);
    }
    if n_out >= sms as usize * 2 || n_red < 1 << 16 {
        return 1;
    }
    (sms as usize * 4).div_ceil(n_out).min(n_red / 4096).max(1)
}

/// The two launches of a reduction cut into `parts`: partial results (of
/// the accumulator type, returned) into `tmp` (`n_out × parts`), then their
/// reduction into `y`.
#[allow(clippy::too_many_arguments)]
pub fn reduce_in_parts(
    op: ReduceOp,
    dtype: DType,
    layout: &Layout,
    dims: &[usize],
    out_dtype: DType,
    parts: usize,
    x: u64,
    tmp: u64,
    y: u64,
    sms: u32,
) -> (Launch, Launch, DType) {
    let split = Split::new(layout, dims).merged();
    let acc = accumulator(dtype);
    let first = reduce_impl(op, None, parts, dtype, &split, None, x, tmp, sms);
    // Partial sums are summed; the mean divides by the whole count.
    let (second_op, scale) = match op {
        ReduceOp::Mean => (ReduceOp::Sum, Some(1.0 / split.n_red().max(1) as f64)),
        other => (other, None),
    };
    // A column reduction writes its partials part-major (coalesced
    // stores), `[parts, n_out]`; a row reduction output-major.
    let partials = match split.columns() {
        true => Split::new(&Layout::contiguous(&[parts, split.n_out()]), &[0]),
        false => Split::new(&Layout::contiguous(&[split.n_out(), parts]), &[1]),
    };
    let second = reduce_impl(
        second_op,
        scale,
        1,
        acc,
        &partials,
        Some(out_dtype),
        tmp,
        y,
        sms,
    );
    (first, second, acc)
}

/// The dtype a reduction of `dtype` accumulates in.
pub fn accumulator(dtype: DType) -> DType {
    match Compute::of(dtype) {
        Compute::F32 => DType::F32,
        Compute::F64 => DType::F64,
        Compute::I64 => DType::I64,
        Compute::U64 => DType::U64,
    }
}

/// A reduction over `split`; with `parts > 1` each output's elements are
/// cut into that many ranges, one block each, whose partial results (no
/// scale; `out_dtype` None: the accumulator type) go to `y[o·parts + p]`.
#[allow(clippy::too_many_arguments)]
fn reduce_impl(
    op: ReduceOp,
    scale: Option<f64>,
    parts: usize,
    dtype: DType,
    split: &Split,
    out_dtype: Option<DType>,
    x: u64,
    y: u64,
    sms: u32,
) -> Launch {
    let compute = Compute::of(dtype);
    let acc = compute.c_type();
    let out_dtype = out_dtype.unwrap_or_else(|| accumulator(dtype));
    let (identity, combine) = match (op, compute.is_float()) {
        (ReduceOp::Sum | ReduceOp::Mean, _) => ("0".to_string(), "((a_) + (b_))"),
        (ReduceOp::Prod, _) => ("1".to_string(), "((a_) * (b_))"),
        (ReduceOp::Max, true) => (
            "-TS_INF".to_string(),
            "(((a_) > (b_) || (a_) != (a_)) ? (a_) : (b_))",
        ),
        (ReduceOp::Min, true) => (
            "TS_INF".to_string(),
            "(((a_) < (b_) || (a_) != (a_)) ? (a_) : (b_))",
        ),
        (ReduceOp::Max, false) if compute == Compute::U64 => {
            ("0".to_string(), "((a_) > (b_) ? (a_) : (b_))")
        }
        (ReduceOp::Min, false) if compute == Compute::U64 => (
            "18446744073709551615ull".to_string(),
            "((a_) < (b_) ? (a_) : (b_))",
        ),
        (ReduceOp::Max, false) => (
            "(-9223372036854775807ll - 1)".to_string(),
            "((a_) > (b_) ? (a_) : (b_))",
        ),
        (ReduceOp::Min, false) => (
            "9223372036854775807ll".to_string(),
            "((a_) < (b_) ? (a_) : (b_))",
        ),
    };
    let mut args = Words::default();
    let (k, r) = split.words(&mut args);
    args.float(scale.unwrap_or(1.0))
        .int(parts as i64)
        .ptr(x)
        .ptr(y);
    let mut src = prelude(&[dtype, out_dtype]);
    src.push_str(&format!(
        "typedef {acc} ACC;\n#define IDENTITY (({acc}){identity})\n#define COMBINE(a_, b_) {combine}\n{TREE}\
         struct Args {{ long long n_out; long long n_red; long long off; long long kshape[{k}]; long long kstr[{k}]; \
         long long rshape[{r}]; long long rstr[{r}]; double scale; long long parts; const void* x; void* y; }};\n"
    ));
    let idx_k = index_type(split.n_out());
    let idx_r = index_type(split.n_red());
    // One dim (the usual case once merged) needs no division.
    let kept = match k {
        1 => "base += o * a.kstr[0];\n".to_string(),
        _ => decompose(
            "o",
            "kshape",
            k,
            &[("base".into(), "kstr".into())],
            false,
            idx_k,
        ),
    };
    let red = match r {
        1 => "off += j * a.rstr[0];\n".to_string(),
        _ => decompose(
            "j",
            "rshape",
            r,
            &[("off".into(), "rstr".into())],
            false,
            idx_r,
        ),
    };
    let value = load(dtype, compute, "a.x", "off");
    let finish = match scale {
        Some(_) => format!("(ACC)(acc * ({acc})a.scale)"),
        None => "acc".to_string(),
    };
    let store = format!(
        "(({}*)a.y)[w] = {};",
        c_type(out_dtype),
        convert(out_dtype, compute, &finish)
    );
    let columns = split.columns();
    // A whole contiguous row on 16-byte accesses: each thread reads packs.
    let inner = match packed_row(dtype, split, parts, x) {
        Some(vec) => {
            let ct = c_type(dtype);
            let lane = super::widen(dtype, compute, "p.v[e]");
            format!(
                "for (long long j = (long long)threadIdx.x * {vec}; j < a.n_red; j += (long long)blockDim.x * {vec}) {{\n\
                 const Pack<{ct}, {vec}> p = *(const Pack<{ct}, {vec}>*)((const {ct}*)a.x + base + j);\n\
                 #pragma unroll\nfor (int e = 0; e < {vec}; ++e) {{ ACC v = {lane}; acc = COMBINE(acc, v); }} }}\n"
            )
        }
        None if r == 2 => two_dim_walk(dtype, compute, idx_r),
        None => format!(
            "for (long long j = lo + threadIdx.x; j < hi; j += blockDim.x) {{ long long off = base;\n{red}ACC v = {value}; acc = COMBINE(acc, v); }}\n"
        ),
    };
    if columns {
        // A thread per (output, part), outputs fastest: a warp reads
        // neighbouring columns of one row, and part p's result goes to
        // y[p·n_out + o].
        src.push_str(&format!(
            "extern \"C\" __global__ void {ENTRY}(Args a) {{\n\
             long long chunk = (a.n_red + a.parts - 1) / a.parts;\n\
             for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < a.n_out * a.parts; t += (long long)gridDim.x * blockDim.x) {{\n\
             long long p = t / a.n_out, o = t - p * a.n_out, w = t;\n\
             long long lo = p * chunk, hi = lo + chunk < a.n_red ? lo + chunk : a.n_red;\n\
             long long base = a.off;\n{kept}ACC acc = IDENTITY;\n\
             for (long long j = lo; j < hi; ++j) {{ long long off = base;\n{red}ACC v = {value}; acc = COMBINE(acc, v); }}\n\
             {store}\n}}\n}}\n"
        ));
    } else {
        src.push_str(&format!(
            "extern \"C\" __global__ void {ENTRY}(Args a) {{\n\
             long long chunk = (a.n_red + a.parts - 1) / a.parts;\n\
             for (long long w = blockIdx.x; w < a.n_out * a.parts; w += gridDim.x) {{\n\
             long long o = w / a.parts, p = w - o * a.parts;\n\
             long long lo = p * chunk, hi = lo + chunk < a.n_red ? lo + chunk : a.n_red;\n\
             long long base = a.off;\n{kept}ACC acc = IDENTITY;\n\
             {inner}\
             acc = block_all(acc);\nif (threadIdx.x == 0) {{ {store} }}\n}}\n}}\n"
        ));
    }
    let (grid, block) = if columns {
        (grid_for(split.n_out() * parts.max(1), 256, sms), 256)
    } else {
        let per = split.n_red().div_ceil(parts.max(1));
        let block = block_for(per);
        (
            (split.n_out().max(1) * parts).min(sms as usize * 64) as u32,
            block,
        )
    };
    Launch {
        source: src,
        args,
        grid,
        block,
    }
}

/// A block's walk over two reduced dims (batch norm's `(0, 2, 3)` of
/// NCHW: the batch, then the contiguous H·W run) without a division per
/// element: each thread splits its first index once, then steps its
/// (row, column) pair by the block's width, and keeps `UNROLL` loads in
/// flight per step (one scalar load at a time left H200's bandwidth at
/// ~170 GB/s, the latency of a single load per thread).
fn two_dim_walk(dtype: DType, compute: Compute, idx: &str) -> String {
    let unroll = if dtype.size_bytes() <= 2 { 8 } else { 4 };
    let value = load(
        dtype,
        compute,
        "a.x",
        "base + row * a.rstr[0] + col * a.rstr[1]",
    );
    format!(
        "{{ const {idx} inner = ({idx})a.rshape[1];\n\
         const {idx} jump_rows = ({idx})blockDim.x / inner, jump_cols = ({idx})blockDim.x - jump_rows * inner;\n\
         long long j = lo + threadIdx.x;\n\
         {idx} row = inner ? ({idx})(j / inner) : 0, col = ({idx})(j - (long long)row * inner);\n\
         for (; inner != 0 && j < hi; j += (long long)blockDim.x * {unroll}) {{\n\
         ACC v[{unroll}];\n\
         #pragma unroll\nfor (int u = 0; u < {unroll}; ++u) {{\n\
         v[u] = j + (long long)u * blockDim.x < hi ? (ACC)({value}) : IDENTITY;\n\
         col += jump_cols; row += jump_rows; if (col >= inner) {{ col -= inner; ++row; }} }}\n\
         #pragma unroll\nfor (int u = 0; u < {unroll}; ++u) acc = COMBINE(acc, v[u]); }} }}\n"
    )
}

/// Elements per 16-byte access when each output's reduced elements are one
/// contiguous run (a single reduced dim of stride 1, no cut into parts),
/// of whole accesses, at aligned addresses; `None` otherwise.
fn packed_row(dtype: DType, split: &Split, parts: usize, x: u64) -> Option<usize> {
    let vec = super::vector_width(&[dtype])?;
    let size = dtype.size_bytes();
    let ok = parts == 1
        && split.red_shape.len() == 1
        && split.red_strides[0] == 1
        && split.n_red().is_multiple_of(vec)
        && super::aligned(x + (split.offset * size) as u64, dtype, vec)
        && split
            .kept_shape
            .iter()
            .zip(&split.kept_strides)
            .all(|(&n, &st)| n == 1 || st.is_multiple_of(vec));
    ok.then_some(vec)
}

/// The index of the max/min along `dim` (first on ties; NaN counts as the
/// largest and the smallest, as on the CPU), as i64.
pub fn arg_reduce(
    op: ArgReduceOp,
    dtype: DType,
    layout: &Layout,
    dim: usize,
    x: u64,
    y: u64,
    sms: u32,
) -> Launch {
    let split = Split::new(layout, &[dim]);
    let compute = Compute::of(dtype);
    let acc = compute.c_type();
    let better = match op {
        ArgReduceOp::ArgMax => "(v > bv)",
        ArgReduceOp::ArgMin => "(v < bv)",
    };
    let nan = if compute.is_float() {
        "|| (v != v && bv == bv)"
    } else {
        ""
    };
    let mut args = Words::default();
    let (k, r) = split.words(&mut args);
    args.float(0.0).ptr(x).ptr(y);
    let mut src = prelude(&[dtype]);
    src.push_str(&format!(
        "struct Args {{ long long n_out; long long n_red; long long off; long long kshape[{k}]; long long kstr[{k}]; \
         long long rshape[{r}]; long long rstr[{r}]; double scale; const void* x; void* y; }};\n\
         __device__ __forceinline__ void pick({acc}& bv, long long& bi, {acc} v, long long i) {{\n\
           if ({better} {nan} || ((v == bv || (v != v && bv != bv)) && i < bi)) {{ bv = v; bi = i; }}\n}}\n"
    ));
    let kept = decompose(
        "o",
        "kshape",
        k,
        &[("base".into(), "kstr".into())],
        false,
        index_type(split.n_out()),
    );
    let value = load(dtype, compute, "a.x", "off");
    src.push_str(&format!(
        "extern \"C\" __global__ void {ENTRY}(Args a) {{\n\
         __shared__ {acc} sv[32]; __shared__ long long si[32];\n\
         for (long long o = blockIdx.x; o < a.n_out; o += gridDim.x) {{\n\
         long long base = a.off;\n{kept}\
         {acc} bv = {value0}; long long bi = 0;\n\
         for (long long j = threadIdx.x; j < a.n_red; j += blockDim.x) {{ long long off = base + j * a.rstr[0]; {acc} v = {value}; pick(bv, bi, v, j); }}\n\
         if (threadIdx.x >= a.n_red) bi = 0x7fffffffffffffffll;\n\
         for (int s = 16; s > 0; s >>= 1) {{ {acc} v = __shfl_xor_sync(0xffffffffu, bv, s); long long i = __shfl_xor_sync(0xffffffffu, bi, s); if (i != 0x7fffffffffffffffll) pick(bv, bi, v, i); }}\n\
         __syncthreads();\n\
         if ((threadIdx.x & 31) == 0) {{ sv[threadIdx.x >> 5] = bv; si[threadIdx.x >> 5] = bi; }}\n\
         __syncthreads();\n\
         if (threadIdx.x == 0) {{ for (int w = 1; w < (int)((blockDim.x + 31) >> 5); ++w) if (si[w] != 0x7fffffffffffffffll) pick(bv, bi, sv[w], si[w]); ((long long*)a.y)[o] = bi; }}\n\
         }}\n}}\n",
        value0 = load(dtype, compute, "a.x", "base"),
    ));
    let block = block_for(split.n_red());
    let grid = (split.n_out().max(1)).min(sms as usize * 64) as u32;
    Launch {
        source: src,
        args,
        grid,
        block,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_sum_takes_a_block_per_row_and_a_column_sum_a_thread_per_column() {
        let rows = reduce(
            ReduceOp::Sum,
            DType::F32,
            &Layout::contiguous(&[4096, 512]),
            &[1],
            DType::F32,
            1,
            2,
            132,
        );
        assert!(
            rows.source.contains("acc = block_all(acc);"),
            "{}",
            rows.source
        );
        assert_eq!((rows.block, rows.grid), (256, 4096));
        let cols = reduce(
            ReduceOp::Sum,
            DType::F32,
            &Layout::contiguous(&[4096, 2048]),
            &[0],
            DType::F32,
            1,
            2,
            132,
        );
        assert!(!cols.source.contains("block_all(acc);"), "{}", cols.source);
        assert_eq!(cols.block, 256);
    }

    #[test]
    fn a_column_sum_is_cut_into_parts_that_fill_the_gpu() {
        // A bias gradient: 768 columns of 8192 rows on 132 SMs.
        let bias = Layout::contiguous(&[8192, 768]);
        let parts = parts_for(&bias, &[0], 132);
        assert_eq!(parts, (132 * COLUMN_THREADS_PER_SM).div_ceil(768));
        // A layer norm's: [8, 1024, 768] over (0, 1) merges to the same.
        let ln = Layout::contiguous(&[8, 1024, 768]);
        assert_eq!(parts_for(&ln, &[0, 1], 132), parts);
        let (first, second, acc) = reduce_in_parts(
            ReduceOp::Sum,
            DType::BF16,
            &ln,
            &[0, 1],
            DType::BF16,
            parts,
            1,
            2,
            3,
            132,
        );
        assert_eq!(acc, DType::F32);
        assert!(
            first.source.contains("off += j * a.rstr[0];"),
            "{}",
            first.source
        );
        assert!(
            !first.source.contains("block_all(acc);"),
            "{}",
            first.source
        );
        // A thread per column and part.
        assert_eq!(first.grid as usize, (768 * parts).div_ceil(256));
        // The partials are [parts, 768], reduced over the parts.
        assert!(
            !second.source.contains("block_all(acc);"),
            "{}",
            second.source
        );
        // Few rows: no cut.
        assert_eq!(parts_for(&Layout::contiguous(&[40, 768]), &[0], 132), 1);
        // A short column count still takes the column schedule.
        assert!(Split::new(&Layout::contiguous(&[5000, 37]), &[0])
            .merged()
            .columns());
    }

    #[test]
    fn a_contiguous_aligned_row_is_read_in_16_byte_packs() {
        let l = Layout::contiguous(&[64, 4096]);
        let sum = |layout: &Layout, x| {
            reduce(
                ReduceOp::Sum,
                DType::BF16,
                layout,
                &[1],
                DType::BF16,
                x,
                2,
                132,
            )
        };
        let packed = sum(&l, 0x1000);
        assert!(
            packed.source.contains("const Pack<__nv_bfloat16, 8> p = "),
            "{}",
            packed.source
        );
        // An odd address or an odd row length: element by element.
        assert!(!sum(&l, 0x1002).source.contains("Pack<__nv"));
        assert!(!sum(&Layout::contiguous(&[64, 4095]), 0x1000)
            .source
            .contains("Pack<__nv"));
        // f64 has no pack: element by element.
        let f64_sum = reduce(ReduceOp::Sum, DType::F64, &l, &[1], DType::F64, 0, 2, 132);
        assert!(!f64_sum.source.contains("Pack<double"));
    }

    /// Batch norm's `(0, 2, 3)` over NCHW: two reduced dims after merging,
    /// walked without a division per element, loads unrolled.
    #[test]
    fn two_reduced_dims_are_walked_by_steps_not_divisions() {
        let l = Layout::contiguous(&[32, 64, 56, 56]);
        let s = reduce(
            ReduceOp::Sum,
            DType::BF16,
            &l,
            &[0, 2, 3],
            DType::BF16,
            0,
            2,
            132,
        );
        assert!(s.source.contains("jump_rows"), "{}", s.source);
        assert!(s.source.contains("ACC v[8];"), "{}", s.source);
        assert!(!s.source.contains("q_ = r_ / n_"), "{}", s.source);
        // n_out, n_red, off, kshape, kstr, rshape[2], rstr[2]
        assert_eq!(
            s.args.0[..9],
            [64, 32 * 3136, 0, 64, 3136, 32, 3136, 64 * 3136, 1]
        );
        let f = reduce(
            ReduceOp::Max,
            DType::F32,
            &l,
            &[0, 2, 3],
            DType::F32,
            0,
            2,
            132,
        );
        assert!(f.source.contains("ACC v[4];"), "{}", f.source);
    }

    #[test]
    fn mean_scales_by_the_reduced_count_and_bf16_accumulates_in_f32() {
        let l = reduce(
            ReduceOp::Mean,
            DType::BF16,
            &Layout::contiguous(&[3, 10]),
            &[1],
            DType::BF16,
            1,
            2,
            132,
        );
        assert!(l.source.contains("typedef float ACC;"));
        // n_out, n_red, off, kshape, kstr, rshape, rstr, scale, parts, x, y
        assert_eq!(l.args.0[..7], [3, 10, 0, 3, 10, 10, 1]);
        assert_eq!(f64::from_bits(l.args.0[7]), 0.1);
        assert_eq!(l.args.0[8], 1);
    }

    #[test]
    fn a_full_sum_of_many_elements_is_cut_into_parts_and_the_mean_scales_once() {
        let l = Layout::contiguous(&[1 << 30]);
        let parts = parts_for(&l, &[0], 132);
        assert_eq!(parts, 528);
        let (first, second, acc) = reduce_in_parts(
            ReduceOp::Mean,
            DType::BF16,
            &l,
            &[0],
            DType::BF16,
            parts,
            1,
            2,
            3,
            132,
        );
        assert_eq!(acc, DType::F32);
        assert_eq!(first.grid, 528);
        assert_eq!(
            f64::from_bits(first.args.0[7]),
            1.0,
            "no scale on the partials"
        );
        assert!(
            first.source.contains("((float*)a.y)[w] = (float)(acc);"),
            "{}",
            first.source
        );
        assert_eq!(f64::from_bits(second.args.0[7]), 1.0 / (1u64 << 30) as f64);
        assert!(second.source.contains("__float2bfloat16_rn"));
        // Many outputs: no cut.
        assert_eq!(parts_for(&Layout::contiguous(&[4096, 512]), &[1], 132), 1);
    }
}
