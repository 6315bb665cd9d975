//! Softmax and log_softmax along one dim, and the register-row plan the
//! fusion plan's row kernels share (`fused_rows`).
//!
//! Softmax over a contiguous last dim that fits in registers reads its row
//! once ([`softmax_rows`]: a warp per row for short rows, a block for long
//! ones); any other softmax takes the two-pass online kernel.

use tessera::tensor::Layout;
use tessera::DType;

use super::rows::{block_for, Split};
use super::{
    c_type, convert, decompose, index_type, load, padded, prelude, Compute, Launch, Words, ENTRY,
};

/// Softmax (or log_softmax) along `dim`. A contiguous row on whole
/// 16-byte accesses that fits in registers takes [`softmax_rows`] (one
/// read); any other row a block per row, one pass for the running max and
/// sum (online softmax), one to write.
pub fn softmax(
    dtype: DType,
    layout: &Layout,
    dim: usize,
    log: bool,
    x: u64,
    y: u64,
    sms: u32,
) -> Launch {
    if let Some(plan) = row_plan(dtype, layout, dim, x, y, None) {
        return softmax_rows(plan, dtype, layout, dim, log, x, y, sms);
    }
    let split = Split::new(layout, &[dim]);
    let out = Split::new(&Layout::contiguous(&layout.shape), &[dim]);
    let compute = Compute::of(dtype);
    let acc = compute.c_type();
    let e = if compute == Compute::F32 {
        "expf"
    } else {
        "exp"
    };
    let lg = if compute == Compute::F32 {
        "logf"
    } else {
        "log"
    };
    let k = split.kept_shape.len().max(1);
    let mut args = Words::default();
    args.int(split.n_out() as i64)
        .int(split.n_red() as i64)
        .int(split.offset as i64)
        .ints(padded(&split.kept_shape, k, 1))
        .ints(padded(&split.kept_strides, k, 0))
        .ints(padded(&out.kept_strides, k, 0))
        .int(split.red_strides[0] as i64)
        .int(out.red_strides[0] as i64)
        .ptr(x)
        .ptr(y);
    let mut src = prelude(&[dtype]);
    src.push_str(&format!(
        "typedef {acc} ACC;\n\
         struct Args {{ long long rows; long long len; long long off; long long kshape[{k}]; long long kstr[{k}]; long long ostr[{k}]; \
         long long sd; long long osd; const void* x; void* y; }};\n\
         // (max, sum of exp(x - max)) of two parts of a row.\n\
         __device__ __forceinline__ void merge(ACC& m, ACC& s, ACC m2, ACC s2) {{\n\
           ACC mm = m > m2 ? m : m2;\n\
           if (mm == -TS_INF) return;\n\
           s = (m == -TS_INF ? (ACC)0 : s * {e}(m - mm)) + (m2 == -TS_INF ? (ACC)0 : s2 * {e}(m2 - mm));\n\
           m = mm;\n}}\n"
    ));
    let kept = decompose(
        "o",
        "kshape",
        k,
        &[
            ("base".into(), "kstr".into()),
            ("obase".into(), "ostr".into()),
        ],
        false,
        index_type(split.n_out()),
    );
    let value = load(dtype, compute, "a.x", "base + j * a.sd");
    let result = if log {
        format!("v - m - {lg}(s)")
    } else {
        format!("{e}(v - m) / s")
    };
    src.push_str(&format!(
        "extern \"C\" __global__ void {ENTRY}(Args a) {{\n\
         __shared__ ACC shm[32]; __shared__ ACC shs[32];\n\
         for (long long o = blockIdx.x; o < a.rows; o += gridDim.x) {{\n\
         long long base = a.off, obase = 0;\n{kept}\
         ACC m = -TS_INF, s = 0;\n\
         for (long long j = threadIdx.x; j < a.len; j += blockDim.x) {{ ACC v = {value}; merge(m, s, v, (ACC)1); if (v != v) {{ m = v; }} }}\n\
         for (int d = 16; d > 0; d >>= 1) {{ ACC m2 = __shfl_xor_sync(0xffffffffu, m, d); ACC s2 = __shfl_xor_sync(0xffffffffu, s, d); merge(m, s, m2, s2); }}\n\
         __syncthreads();\n\
         if ((threadIdx.x & 31) == 0) {{ shm[threadIdx.x >> 5] = m; shs[threadIdx.x >> 5] = s; }}\n\
         __syncthreads();\n\
         m = -TS_INF; s = 0;\n\
         for (int w = 0; w < (int)((blockDim.x + 31) >> 5); ++w) merge(m, s, shm[w], shs[w]);\n\
         for (long long j = threadIdx.x; j < a.len; j += blockDim.x) {{ ACC v = {value}; (({ct}*)a.y)[obase + j * a.osd] = {store}; }}\n\
         }}\n}}\n",
        ct = c_type(dtype),
        store = convert(dtype, compute, &result),
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

/// One value per thread combined over the `TPR` threads of a row (`TPR` a
/// `#define`: 32 for a warp per row, more for a block per row), the result
/// handed to every one of them: `row_all<ROW_SUM | ROW_MAX | ROW_MIN |
/// ROW_PROD>(v, sh)`, `sh` 32 entries of shared memory of `v`'s type (used
/// by block rows). Max and min propagate NaN, as the CPU's do. Each thread
/// ends with the same bits (the block step reads the warps' results in one
/// order), so every thread of a row computes on the same scalars.
pub const ROW_ALL: &str = r#"
#define ROW_SUM 0
#define ROW_MAX 1
#define ROW_MIN 2
#define ROW_PROD 3
template <int OP, typename T> __device__ __forceinline__ T row_combine(T v, T w) {
  return OP == ROW_SUM ? v + w : OP == ROW_PROD ? v * w
       : OP == ROW_MAX ? ((w > v || w != w) ? w : v) : ((w < v || w != w) ? w : v);
}
template <int OP, typename T> __device__ __forceinline__ T row_all(T v, T* sh) {
  #pragma unroll
  for (int d = 16; d > 0; d >>= 1) v = row_combine<OP>(v, __shfl_xor_sync(0xffffffffu, v, d));
  if (TPR > 32) {
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = sh[0];
    for (int w = 1; w < TPR / 32; ++w) v = row_combine<OP>(v, sh[w]);
  }
  return v;
}
"#;

/// Threads per row `max-autotune` times for a register-row plan (those
/// whose plan fits).
pub const THREAD_CANDIDATES: [usize; 6] = [32, 64, 128, 256, 512, 1024];

/// Vectors each thread keeps in registers at most (rows longer than
/// `8 × block × vec` take the two-pass kernel).
const ROW_ITEMS_MAX: usize = 8;

/// The register-resident plan of a softmax row: `vec` elements per 16-byte
/// access, `threads` per row (32: a warp per row, 8 rows a block; more: a
/// block per row), `items` accesses per thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowPlan {
    pub vec: usize,
    pub threads: usize,
    pub items: usize,
}

/// The plan for rows of `len` read with `layout` along `dim` from `x`, or
/// `None` when the row is not contiguous, not on whole 16-byte accesses, or
/// too long to keep in registers. `threads`: a tuner's choice of
/// threads per row (any power of two from 32 to 1024);
/// `None`: about four accesses a thread.
pub fn row_plan(
    dtype: DType,
    layout: &Layout,
    dim: usize,
    x: u64,
    y: u64,
    threads: Option<usize>,
) -> Option<RowPlan> {
    let vec = super::vector_width(&[dtype])?;
    let split = Split::new(layout, &[dim]);
    let len = split.n_red();
    let size = dtype.size_bytes();
    // The output is contiguous in the input's shape: its row is
    // contiguous only when `dim` is the last dim of more than one element.
    let out_row = Layout::contiguous(&layout.shape).strides[dim];
    let on_packs = split.red_strides[0] == 1
        && out_row == 1
        && len.is_multiple_of(vec)
        && super::aligned(x + (split.offset * size) as u64, dtype, vec)
        && super::aligned(y, dtype, vec)
        && split
            .kept_shape
            .iter()
            .zip(&split.kept_strides)
            .all(|(&n, &s)| n == 1 || s.is_multiple_of(vec));
    if !on_packs || len == 0 {
        return None;
    }
    let plan = RowPlan::of(len / vec, vec, threads);
    (plan.items <= ROW_ITEMS_MAX).then_some(plan)
}

impl RowPlan {
    /// Rows of `packs` accesses of `vec` elements: `threads` per row
    /// (`None`: about four accesses a thread, 32 to 1024), and the accesses
    /// each thread keeps.
    pub fn of(packs: usize, vec: usize, threads: Option<usize>) -> RowPlan {
        let threads =
            threads.unwrap_or_else(|| packs.div_ceil(4).next_power_of_two().clamp(32, 1024));
        RowPlan {
            vec,
            threads,
            items: packs.div_ceil(threads).max(1),
        }
    }

    /// Threads per block: a block per row, or 8 warps (8 rows) when a warp
    /// takes a row (the block reduction assumes one row a block).
    pub fn block(self) -> usize {
        if self.threads <= 32 {
            256
        } else {
            self.threads
        }
    }
}

/// Softmax along a contiguous last dim with the row in registers: one read
/// of the row (16-byte packs), a max and a sum over the registers, shuffle
/// (and for a block, shared-memory) reductions, one write.
#[allow(clippy::too_many_arguments)]
pub fn softmax_rows(
    plan: RowPlan,
    dtype: DType,
    layout: &Layout,
    dim: usize,
    log: bool,
    x: u64,
    y: u64,
    sms: u32,
) -> Launch {
    let split = Split::new(layout, &[dim]);
    let out = Split::new(&Layout::contiguous(&layout.shape), &[dim]);
    let compute = Compute::F32;
    let k = split.kept_shape.len().max(1);
    let mut args = Words::default();
    args.int(split.n_out() as i64)
        .int(split.n_red() as i64)
        .int(split.offset as i64)
        .ints(padded(&split.kept_shape, k, 1))
        .ints(padded(&split.kept_strides, k, 0))
        .ints(padded(&out.kept_strides, k, 0))
        .int(1)
        .int(1)
        .ptr(x)
        .ptr(y);
    let RowPlan {
        vec,
        threads,
        items,
    } = plan;
    let block = plan.block();
    let ct = c_type(dtype);
    let kept = decompose(
        "o",
        "kshape",
        k,
        &[
            ("base".into(), "kstr".into()),
            ("obase".into(), "ostr".into()),
        ],
        false,
        index_type(split.n_out()),
    );
    let value = super::widen(dtype, compute, "p.v[e]");
    let result = if log {
        "r[it * V + e] - m - logf(s)"
    } else {
        "expf(r[it * V + e] - m) / s"
    };
    let store = convert(dtype, compute, result);
    let mut src = prelude(&[dtype]);
    src.push_str(&format!(
        "#define V {vec}\n#define IT {items}\n#define TPR {threads}\n\
         struct Args {{ long long rows; long long len; long long off; long long kshape[{k}]; long long kstr[{k}]; long long ostr[{k}]; \
         long long sd; long long osd; const void* x; void* y; }};\n\
         {ROW_ALL}\
         extern \"C\" __global__ void __launch_bounds__({block}) {ENTRY}(Args a) {{\n\
         __shared__ float sh[32];\n\
         const int lane = threadIdx.x % TPR, rpb = blockDim.x / TPR;\n\
         for (long long o = (long long)blockIdx.x * rpb + threadIdx.x / TPR; o < a.rows; o += (long long)gridDim.x * rpb) {{\n\
         long long base = a.off, obase = 0;\n{kept}\
         float r[IT * V];\n\
         #pragma unroll\n\
         for (int it = 0; it < IT; ++it) {{\n\
           long long j = ((long long)it * TPR + lane) * V;\n\
           if (j < a.len) {{ const Pack<{ct}, V> p = *(const Pack<{ct}, V>*)((const {ct}*)a.x + base + j);\n\
             #pragma unroll\n for (int e = 0; e < V; ++e) r[it * V + e] = {value}; }}\n\
           else {{\n #pragma unroll\n for (int e = 0; e < V; ++e) r[it * V + e] = -TS_INF; }}\n\
         }}\n\
         float m = -TS_INF;\n\
         #pragma unroll\n\
         for (int e = 0; e < IT * V; ++e) m = (r[e] > m || r[e] != r[e]) ? r[e] : m;\n\
         m = row_all<ROW_MAX>(m, sh);\n\
         float s = 0.f;\n\
         #pragma unroll\n\
         for (int e = 0; e < IT * V; ++e) s += r[e] == -TS_INF ? 0.f : expf(r[e] - m);\n\
         s = row_all<ROW_SUM>(s, sh);\n\
         #pragma unroll\n\
         for (int it = 0; it < IT; ++it) {{\n\
           long long j = ((long long)it * TPR + lane) * V;\n\
           if (j < a.len) {{ Pack<{ct}, V> q;\n\
             #pragma unroll\n for (int e = 0; e < V; ++e) q.v[e] = {store};\n\
             *(Pack<{ct}, V>*)(({ct}*)a.y + obase + j) = q; }}\n\
         }}\n\
         }}\n}}\n"
    ));
    let rpb = block / threads;
    let grid = split.n_out().div_ceil(rpb).min(sms as usize * 64).max(1) as u32;
    Launch {
        source: src,
        args,
        grid,
        block: block as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_contiguous_row_stays_in_registers_a_warp_or_a_block_per_row() {
        // bf16 rows of 4096: 512 packs of 8, 128 threads x 4 packs.
        let l = Layout::contiguous(&[64, 4096]);
        let plan = row_plan(DType::BF16, &l, 1, 0x1000, 0x2000, None).unwrap();
        assert_eq!(
            plan,
            RowPlan {
                vec: 8,
                threads: 128,
                items: 4
            }
        );
        let k = softmax(DType::BF16, &l, 1, false, 0x1000, 0x2000, 132);
        assert!(k.source.contains("#define IT 4"), "{}", k.source);
        assert!(
            k.source.contains("const Pack<__nv_bfloat16, V> p"),
            "{}",
            k.source
        );
        assert_eq!((k.block, k.grid), (128, 64));
        // Short f32 rows: a warp per row, 8 rows a block.
        let short = Layout::contiguous(&[1000, 256]);
        let plan = row_plan(DType::F32, &short, 1, 0, 0, None).unwrap();
        assert_eq!(
            plan,
            RowPlan {
                vec: 4,
                threads: 32,
                items: 2
            }
        );
        let k = softmax(DType::F32, &short, 1, true, 0, 0, 132);
        assert_eq!((k.block, k.grid), (256, 125));
        assert!(k.source.contains("- m - logf(s)"), "{}", k.source);
        // Not on whole packs (odd length, odd address, a strided row, a
        // row too long for registers): the two-pass kernel.
        let odd = Layout::contiguous(&[4, 4095]);
        assert!(row_plan(DType::F32, &odd, 1, 0, 0, None).is_none());
        assert!(row_plan(DType::F32, &l, 1, 0x1004, 0, None).is_none());
        let col = Layout::contiguous(&[4096, 64]);
        assert!(row_plan(DType::F32, &col, 0, 0, 0, None).is_none());
        // A transposed input whose dim 0 is contiguous in memory: the
        // output's row is strided, so not this kernel.
        let t = Layout::contiguous(&[6, 33, 40]).permuted(&[2, 1, 0]);
        assert!(row_plan(DType::F32, &t, 0, 0, 0, None).is_none());
        let long = Layout::contiguous(&[2, 1 << 16]);
        assert!(row_plan(DType::F32, &long, 1, 0, 0, None).is_none());
        assert!(!softmax(DType::F32, &long, 1, false, 0, 0, 132)
            .source
            .contains("Pack<float"));
        // A tuned thread count changes the items each thread keeps.
        let tuned = row_plan(
            DType::F32,
            &Layout::contiguous(&[8, 4096]),
            1,
            0,
            0,
            Some(1024),
        )
        .unwrap();
        assert_eq!(tuned.items, 1);
    }

    #[test]
    fn softmax_of_a_middle_dim_reads_with_that_dims_stride() {
        let l = softmax(
            DType::F32,
            &Layout::contiguous(&[2, 5, 3]),
            1,
            true,
            1,
            2,
            132,
        );
        // rows, len, off, kshape[2], kstr[2], ostr[2], sd, osd
        assert_eq!(l.args.0[..11], [6, 5, 0, 2, 3, 15, 1, 15, 1, 3, 3]);
        assert!(l.source.contains("v - m - logf(s)"), "{}", l.source);
    }
}
