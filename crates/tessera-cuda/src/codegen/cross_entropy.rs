//! The fused cross-entropy kernels (`tessera::cross_entropy` and its
//! backward; see `tessera::ir::custom::cross_entropy`). A block per row:
//! the forward keeps a running maximum and a sum of exponentials relative
//! to it per thread (one pass over the row: the online softmax), merges
//! them across the block and writes the row's log-sum-exp and loss; the
//! backward writes `(exp(x − lse) − onehot) · d` for each element of the
//! row. The logits are read in their own dtype; rows compute in f32 (f64
//! for f64 logits). Targets are checked on the device, as the index
//! kernels check theirs (see [`super::index::IndexCheck`]).

use tessera::DType;

use super::index::IndexCheck;
use super::{c_type, convert, load, prelude, Compute, Launch, Words, ENTRY, REPORT_ERROR};

/// Threads per row.
const BLOCK: u32 = 256;

/// A cross-entropy call's operands: `logits [n, classes]` (row stride
/// `stride` elements), `targets [n]`, the per-row outputs (of the compute
/// type: f32, f64 for f64 logits).
#[derive(Clone, Copy, Debug)]
pub struct Rows {
    pub logits_dtype: DType,
    pub target_dtype: DType,
    pub n: usize,
    pub classes: usize,
    pub stride: usize,
    pub ignore_index: Option<i64>,
}

impl Rows {
    fn compute(&self) -> Compute {
        Compute::of(self.logits_dtype)
    }

    /// `exp` and `log` of the compute type.
    fn math(&self) -> (&'static str, &'static str) {
        match self.compute() {
            Compute::F64 => ("exp", "log"),
            _ => ("expf", "logf"),
        }
    }

    /// The row's target, checked: `t` in range, or the row ignored
    /// (`skip` true); a bad one is reported and the row skipped.
    fn target(&self) -> String {
        let ignore = match self.ignore_index {
            Some(i) => format!("t == {i}LL"),
            None => "false".into(),
        };
        format!(
            "long long t = {load};\n\
             bool skip = {ignore};\n\
             if (!skip && (t < 0 || t >= a.c)) {{ if (threadIdx.x == 0) tessera_report(a.report, (unsigned)a.site, t); skip = true; }}\n",
            load = load(self.target_dtype, Compute::I64, "a.t", "r"),
        )
    }

    /// A block per row (grid-stride past 16 per SM) running `source`, whose
    /// `Args` are the sizes, `ptrs` in order, then the error record and
    /// site (both kernels' layout).
    fn launch(&self, source: String, ptrs: &[u64], check: IndexCheck, sms: u32) -> Launch {
        let mut args = Words::default();
        args.int(self.n as i64)
            .int(self.classes as i64)
            .int(self.stride as i64);
        for &p in ptrs {
            args.ptr(p);
        }
        args.ptr(check.report).int(i64::from(check.site));
        Launch {
            source,
            args,
            grid: self.n.clamp(1, sms as usize * 16) as u32,
            block: BLOCK,
        }
    }
}

/// The forward: `nll[r] = lse[r] − x[r, t]` (0 for an ignored row) and
/// `lse[r]` for each row.
pub fn forward(
    rows: &Rows,
    logits: u64,
    targets: u64,
    nll: u64,
    lse: u64,
    check: IndexCheck,
    sms: u32,
) -> Launch {
    let acc = rows.compute().c_type();
    let (exp, log) = rows.math();
    let x = load(rows.logits_dtype, rows.compute(), "a.x", "r * a.stride + c");
    let xt = load(rows.logits_dtype, rows.compute(), "a.x", "r * a.stride + t");
    let mut source = prelude(&[rows.logits_dtype, rows.target_dtype]);
    source.push_str(REPORT_ERROR);
    source.push_str(&format!(
        "struct Args {{ long long n; long long c; long long stride; const void* x; const void* t; void* nll; void* lse; void* report; long long site; }};\n\
         __device__ void merge({acc}& m, {acc}& s, {acc} m2, {acc} s2) {{\n\
         {acc} hi = m > m2 ? m : m2;\n\
         if (hi == -({acc})TS_INF) {{ s = 0; m = hi; return; }}\n\
         s = s * {exp}(m - hi) + s2 * {exp}(m2 - hi); m = hi;\n}}\n\
         extern \"C\" __global__ void {ENTRY}(Args a) {{\n\
         __shared__ {acc} sm[32]; __shared__ {acc} ss[32];\n\
         int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;\n\
         for (long long r = blockIdx.x; r < a.n; r += gridDim.x) {{\n\
         {acc} m = -({acc})TS_INF, s = 0;\n\
         for (long long c = threadIdx.x; c < a.c; c += blockDim.x) {{\n\
         {acc} v = {x};\n\
         if (v > m) {{ s = s * {exp}(m - v) + 1; m = v; }} else if (v != -({acc})TS_INF) {{ s += {exp}(v - m); }}\n\
         }}\n\
         for (int o = 16; o > 0; o >>= 1) merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));\n\
         if (lane == 0) {{ sm[warp] = m; ss[warp] = s; }}\n\
         __syncthreads();\n\
         if (warp == 0) {{\n\
         int warps = blockDim.x >> 5;\n\
         m = lane < warps ? sm[lane] : -({acc})TS_INF; s = lane < warps ? ss[lane] : 0;\n\
         for (int o = 16; o > 0; o >>= 1) merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));\n\
         if (lane == 0) {{\n\
         {target}\
         {acc} l = m + {log}(s);\n\
         (({acc}*)a.lse)[r] = l;\n\
         (({acc}*)a.nll)[r] = skip ? ({acc})0 : l - {xt};\n\
         }}\n}}\n\
         __syncthreads();\n}}\n}}\n",
        target = rows.target(),
    ));
    rows.launch(source, &[logits, targets, nll, lse], check, sms)
}

/// The backward: `dx[r, c] = (exp(x[r, c] − lse[r]) − [c = t]) · d[r]`,
/// 0 for an ignored row; `dx` is dense `[n, classes]` of the logits' dtype.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    rows: &Rows,
    logits: u64,
    targets: u64,
    lse: u64,
    d_nll: u64,
    dx: u64,
    check: IndexCheck,
    sms: u32,
) -> Launch {
    let acc = rows.compute().c_type();
    let (exp, _) = rows.math();
    let x = load(rows.logits_dtype, rows.compute(), "a.x", "r * a.stride + c");
    let mut source = prelude(&[rows.logits_dtype, rows.target_dtype]);
    source.push_str(REPORT_ERROR);
    source.push_str(&format!(
        "struct Args {{ long long n; long long c; long long stride; const void* x; const void* t; const void* lse; const void* d; void* dx; void* report; long long site; }};\n\
         extern \"C\" __global__ void {ENTRY}(Args a) {{\n\
         for (long long r = blockIdx.x; r < a.n; r += gridDim.x) {{\n\
         {target}\
         {acc} l = ((const {acc}*)a.lse)[r];\n\
         {acc} g = skip ? ({acc})0 : ((const {acc}*)a.d)[r];\n\
         {ct}* out = (({ct}*)a.dx) + r * a.c;\n\
         for (long long c = threadIdx.x; c < a.c; c += blockDim.x) {{\n\
         {acc} p = {exp}({x} - l) - (c == t ? ({acc})1 : ({acc})0);\n\
         out[c] = {store};\n\
         }}\n}}\n}}\n",
        target = rows.target(),
        ct = c_type(rows.logits_dtype),
        store = convert(rows.logits_dtype, rows.compute(), "p * g"),
    ));
    rows.launch(source, &[logits, targets, lse, d_nll, dx], check, sms)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHECK: IndexCheck = IndexCheck {
        bound: 10,
        site: 2,
        report: 7,
    };

    fn rows(dtype: DType, ignore_index: Option<i64>) -> Rows {
        Rows {
            logits_dtype: dtype,
            target_dtype: DType::I64,
            n: 6,
            classes: 10,
            stride: 12,
            ignore_index,
        }
    }

    #[test]
    fn the_forward_merges_maxima_and_checks_targets() {
        let l = forward(&rows(DType::BF16, Some(-100)), 1, 2, 3, 4, CHECK, 132);
        assert!(l.source.contains("__bfloat162float"), "{}", l.source);
        assert!(
            l.source.contains("bool skip = t == -100LL;"),
            "{}",
            l.source
        );
        assert!(l.source.contains("tessera_report(a.report"), "{}", l.source);
        assert!(l.source.contains("expf(m - hi)"), "{}", l.source);
        assert_eq!(l.args.0, [6, 10, 12, 1, 2, 3, 4, 7, 2]);
        assert_eq!((l.grid, l.block), (6, BLOCK));
    }

    #[test]
    fn f64_rows_compute_in_double_and_the_backward_stores_the_logits_dtype() {
        let l = backward(&rows(DType::F64, None), 1, 2, 3, 4, 5, CHECK, 132);
        assert!(
            l.source.contains("double l = ((const double*)a.lse)[r];"),
            "{}",
            l.source
        );
        assert!(l.source.contains(" exp("), "{}", l.source);
        assert!(
            l.source.contains(
                "const void* lse; const void* d; void* dx; void* report; long long site;"
            ),
            "{}",
            l.source
        );
        assert_eq!(l.args.0, [6, 10, 12, 1, 2, 3, 4, 5, 7, 2]);
        assert!(l.source.contains("bool skip = false;"), "{}", l.source);
        let h = backward(&rows(DType::F16, None), 1, 2, 3, 4, 5, CHECK, 132);
        assert!(
            h.source.contains("__float2half_rn((float)(p * g))"),
            "{}",
            h.source
        );
    }
}
