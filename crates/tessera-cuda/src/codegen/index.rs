//! Indexing kernels: `tril`/`triu`, and one template for `index_select`,
//! `gather`, `index_add` and `scatter_add`.
//!
//! The four indexed ops are the same loop: walk an iteration shape, find
//! a source offset, an index offset and a destination offset through three
//! stride lists, then move the dim `dim` coordinate of the source (select,
//! gather) or of the destination (the two adds) by the index value. The
//! adds use atomics because two index entries may name the same row.
//! The kernel checks each index value and reports a bad one through the
//! error record (`crate::kernel_errors`), skipping its element.

use tessera::DType;

use super::{
    c_type, convert, decompose, grid_for, index_type, load, padded, prelude, Compute, Launch,
    Words, ENTRY, REPORT_ERROR,
};

/// `tril` (`upper` false) or `triu` of the last two dims of `x` (read
/// through `shape`/`strides`/`offset`) into a contiguous output.
#[allow(clippy::too_many_arguments)]
pub fn triangle(
    dtype: DType,
    shape: &[usize],
    strides: &[usize],
    offset: usize,
    diagonal: i64,
    upper: bool,
    x: u64,
    y: u64,
    sms: u32,
) -> Launch {
    let n: usize = shape.iter().product();
    let rank = shape.len().max(1);
    let compute = Compute::of(dtype);
    let mut src = prelude(&[dtype]);
    src.push_str(&format!(
        "struct Args {{ long long n; long long shape[{rank}]; long long str[{rank}]; long long off; long long diag; const void* x; void* y; }};\n\
         extern \"C\" __global__ void {ENTRY}(Args a) {{\n\
         for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += (long long)gridDim.x * blockDim.x) {{\n\
         long long idx[{rank}]; long long off = a.off;\n{dec}\
         long long row = {row}, col = idx[{last}];\n\
         bool keep = {keep};\n\
         (({ct}*)a.y)[i] = keep ? {value} : {zero};\n}}\n}}\n",
        dec = decompose("i", "shape", rank, &[("off".into(), "str".into())], true, index_type(n)),
        row = if shape.len() >= 2 { format!("idx[{}]", rank - 2) } else { "0".into() },
        last = rank - 1,
        keep = if upper { "col - row >= a.diag" } else { "col - row <= a.diag" },
        ct = c_type(dtype),
        value = convert(dtype, compute, &load(dtype, compute, "a.x", "off")),
        zero = convert(dtype, compute, "0"),
    ));
    let mut args = Words::default();
    args.int(n as i64)
        .ints(padded(shape, rank, 1))
        .ints(padded(strides, rank, 0))
        .int(offset as i64)
        .int(diagonal)
        .ptr(x)
        .ptr(y);
    Launch {
        source: src,
        args,
        grid: grid_for(n, 256, sms),
        block: 256,
    }
}

/// Which of the indexed ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Indexed {
    /// `dst[d] = src[s + index·src_dim_stride]` (index_select, gather).
    Read,
    /// `dst[d + index·dst_dim_stride] += src[s]` (index_add, scatter_add).
    Add,
}

/// A strided operand over the iteration shape.
#[derive(Clone, Debug)]
pub struct Strided {
    pub dtype: DType,
    pub ptr: u64,
    pub offset: usize,
    pub strides: Vec<usize>,
}

/// How a kernel checks its index values: each must be in `0..bound`; a
/// thread that reads one outside skips its element (no access out of
/// bounds) and the first such value, with `site` (what the host knows of
/// the launch), is written to the error record at `report` (host memory
/// mapped into the device, read at the next synchronisation: see
/// `crate::kernel_errors`).
#[derive(Clone, Copy, Debug)]
pub struct IndexCheck {
    pub bound: usize,
    pub site: u32,
    pub report: u64,
}

/// The indexed loop over `shape`: `dim_stride` is the stride, in the
/// operand the index moves (source for reads, destination for adds), of
/// one step along the indexed dim.
#[allow(clippy::too_many_arguments)]
pub fn indexed(
    kind: Indexed,
    shape: &[usize],
    src: &Strided,
    index: &Strided,
    dst: &Strided,
    dim_stride: usize,
    check: IndexCheck,
    sms: u32,
) -> Result<Launch, String> {
    let n: usize = shape.iter().product();
    let rank = shape.len().max(1);
    let dtype = dst.dtype;
    let compute = Compute::of(dtype);
    let value = load(src.dtype, compute, "a.src", "so");
    let iv = format!(
        "((long long){})",
        load(index.dtype, Compute::I64, "a.idx", "io")
    );
    let checked = format!(
        "long long iv = {iv};\n\
         if (iv < 0 || iv >= a.bound) {{ tessera_report(a.report, (unsigned)a.site, iv); continue; }}\n"
    );
    let iv = "iv";
    let body = match kind {
        Indexed::Read => format!(
            "so += {iv} * a.dim_stride;\n(({ct}*)a.dst)[dO] = {v};",
            ct = c_type(dtype),
            v = convert(dtype, compute, &load(src.dtype, compute, "a.src", "so")),
        ),
        Indexed::Add => {
            let ptr = format!("(({}*)a.dst) + dO", c_type(dtype));
            let v = convert(dtype, compute, &value);
            let add = match dtype {
                DType::F32
                | DType::F64
                | DType::F16
                | DType::BF16
                | DType::I32
                | DType::U32
                | DType::U64 => format!("atomicAdd({ptr}, {v});"),
                DType::I64 => {
                    format!("atomicAdd((unsigned long long*)({ptr}), (unsigned long long)({v}));")
                }
                // CUDA has no 8- or 16-bit integer atomics.
                d @ (DType::Bool | DType::I16 | DType::I8 | DType::U8 | DType::U16) => {
                    return Err(format!("an indexed add of {d} is not supported on the GPU"))
                }
            };
            format!("dO += {iv} * a.dim_stride;\n{add}")
        }
    };
    let mut source = prelude(&[src.dtype, dtype]);
    source.push_str(REPORT_ERROR);
    source.push_str(&format!(
        "struct Args {{ long long n; long long shape[{rank}]; long long soff; long long sstr[{rank}]; long long ioff; long long istr[{rank}]; \
         long long doff; long long dstr[{rank}]; long long dim_stride; long long bound; const void* src; const void* idx; void* dst; void* report; long long site; }};\n\
         extern \"C\" __global__ void {ENTRY}(Args a) {{\n\
         for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += (long long)gridDim.x * blockDim.x) {{\n\
         long long so = a.soff, io = a.ioff, dO = a.doff;\n{dec}{checked}{body}\n}}\n}}\n",
        dec = decompose(
            "i",
            "shape",
            rank,
            &[
                ("so".into(), "sstr".into()),
                ("io".into(), "istr".into()),
                ("dO".into(), "dstr".into()),
            ],
            false,
            index_type(n),
        ),
    ));
    let mut args = Words::default();
    args.int(n as i64).ints(padded(shape, rank, 1));
    for op in [src, index, dst] {
        args.int(op.offset as i64)
            .ints(padded(&op.strides, rank, 0));
    }
    args.int(dim_stride as i64)
        .int(check.bound as i64)
        .ptr(src.ptr)
        .ptr(index.ptr)
        .ptr(dst.ptr)
        .ptr(check.report)
        .int(i64::from(check.site));
    Ok(Launch {
        source,
        args,
        grid: grid_for(n, 256, sms),
        block: 256,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHECK: IndexCheck = IndexCheck {
        bound: 4,
        site: 9,
        report: 3,
    };

    #[test]
    fn an_add_of_bf16_uses_the_bf16_atomic_and_bools_are_refused() {
        let op = |dtype| Strided {
            dtype,
            ptr: 1,
            offset: 0,
            strides: vec![4, 1],
        };
        let idx = Strided {
            dtype: DType::I64,
            ptr: 2,
            offset: 0,
            strides: vec![1, 0],
        };
        let l = indexed(
            Indexed::Add,
            &[3, 4],
            &op(DType::BF16),
            &idx,
            &op(DType::BF16),
            4,
            CHECK,
            132,
        )
        .unwrap();
        assert!(
            l.source.contains("atomicAdd(((__nv_bfloat16*)a.dst) + dO"),
            "{}",
            l.source
        );
        assert!(l.source.contains("dO += iv * a.dim_stride"), "{}", l.source);
        // The value is checked before it moves the offset; the bound, the
        // record and the site are the last arguments.
        let check = l.source.find("if (iv < 0 || iv >= a.bound)").unwrap();
        assert!(check < l.source.find("dO += iv").unwrap(), "{}", l.source);
        assert_eq!(l.args.0[l.args.0.len() - 2..], [3, 9]);
        let e = indexed(
            Indexed::Add,
            &[3, 4],
            &op(DType::Bool),
            &idx,
            &op(DType::Bool),
            4,
            CHECK,
            132,
        )
        .unwrap_err();
        assert!(e.contains("indexed add of bool"), "{e}");
    }

    #[test]
    fn tril_compares_column_minus_row_with_the_diagonal() {
        let l = triangle(DType::F32, &[3, 3], &[3, 1], 0, -1, false, 1, 2, 132);
        assert!(l.source.contains("col - row <= a.diag"));
        assert_eq!(l.args.0[..7], [9, 3, 3, 3, 1, 0, (-1i64) as u64]);
    }
}
