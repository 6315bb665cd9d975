//! CPU kernels of the convolution and pooling ops (NCHW, contiguous
//! operands; the ops' rules are `ir::custom::conv`'s).
//!
//! A convolution is one GEMM per (sample, group) through the `gemm` crate:
//! `y[Og, Ho·Wo] = w[Og, K] · col[K, Ho·Wo]` with `K = C/g · kh · kw`,
//! where `col` is the im2col matrix of the sample's group (a 1×1 kernel of
//! stride 1 without padding reads the input itself: no copy). Samples run
//! in parallel (rayon) when there are enough of them, each GEMM alone;
//! otherwise the GEMMs are parallel themselves. The backward of the input
//! is `col = wᵀ · dy` scattered back (col2im); the backward of the weight
//! sums `dy · colᵀ` over samples, in a fixed split of the batch so results
//! do not depend on scheduling. The bias and the ReLU epilogue are applied
//! to each GEMM's output while it is in cache.
//!
//! Kernels take f32 or f64 (`ConvFloat`); the caller widens f16/bf16.
//! Pooling kernels take any float type and compute in its accumulation
//! type.

use std::ops::Range;

use rayon::prelude::*;

use super::element::num_like::AccFloat;
use super::element::Float;
use crate::ir::custom::conv::{Activation, Conv2d, Pool2d};

/// The element types the convolution kernels compute in (gemm's f32 and
/// f64).
pub trait ConvFloat: Float<Acc = Self> + AccFloat {}
impl ConvFloat for f32 {}
impl ConvFloat for f64 {}

/// The sizes of one convolution: input `[n, c, h, w]`, weight `[o, c/g,
/// kh, kw]`, output `[n, o, ho, wo]`.
#[derive(Clone, Copy, Debug)]
pub struct ConvDims {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub o: usize,
    pub kh: usize,
    pub kw: usize,
    pub ho: usize,
    pub wo: usize,
    pub conv: Conv2d,
}

impl ConvDims {
    fn cg(&self) -> usize {
        self.c / self.conv.groups
    }
    fn og(&self) -> usize {
        self.o / self.conv.groups
    }
    /// Rows of a group's im2col matrix.
    fn k(&self) -> usize {
        self.cg() * self.kh * self.kw
    }
    /// Columns of the im2col matrix: output positions.
    fn p(&self) -> usize {
        self.ho * self.wo
    }
    /// Whether the im2col matrix is the input itself.
    fn direct(&self) -> bool {
        let c = &self.conv;
        self.kh == 1 && self.kw == 1 && c.stride == [1, 1] && c.padding == [0; 4]
    }
    /// One input and one output channel per group.
    fn depthwise(&self) -> bool {
        self.conv.groups == self.c && self.o == self.c && self.c > 1
    }
    /// Output rows per im2col block: the whole image when its matrix is
    /// small, else blocks of about [`COL_BLOCK`] elements (at least one
    /// row), so that the matrix a GEMM reads is still in cache (a GEMM
    /// that runs on all threads gets a block per thread).
    fn block_rows(&self, parallel: bool) -> usize {
        let per_row = (self.k() * self.wo).max(1);
        let budget = match parallel {
            true => COL_BLOCK * rayon::current_num_threads(),
            false => COL_BLOCK,
        };
        (budget / per_row).clamp(1, self.ho.max(1))
    }
    fn in_sample(&self) -> usize {
        self.c * self.h * self.w
    }
    fn out_sample(&self) -> usize {
        self.o * self.p()
    }
}

/// Elements of an im2col block (1 MiB of f32).
const COL_BLOCK: usize = 1 << 18;

/// Work (multiply-adds) below which a GEMM runs on one thread.
const PAR_WORK: usize = 1 << 20;

/// `dst[m×n] (+)= a[m×k] · b[k×n]`, each operand given by row and column
/// strides; `dst` row-major with rows `dst_rs` apart.
#[allow(clippy::too_many_arguments)]
fn gemm<T: ConvFloat>(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (&mut [T], usize),
    accumulate: bool,
    a: &[T],
    (a_rs, a_cs): (usize, usize),
    b: &[T],
    (b_rs, b_cs): (usize, usize),
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    let reach = |rows: usize, cols: usize, rs: usize, cs: usize| (rows - 1) * rs + (cols - 1) * cs;
    if k == 0 {
        if !accumulate {
            dst.chunks_mut(dst_rs)
                .take(m)
                .for_each(|r| r[..n].fill(T::ZERO));
        }
        return;
    }
    assert!(
        dst.len() > reach(m, n, dst_rs, 1)
            && a.len() > reach(m, k, a_rs, a_cs)
            && b.len() > reach(k, n, b_rs, b_cs),
        "internal error: a convolution GEMM does not fit its buffers"
    );
    let par = match parallel && m * n * k >= PAR_WORK {
        true => gemm::Parallelism::Rayon(rayon::current_num_threads()),
        false => gemm::Parallelism::None,
    };
    // SAFETY: `T` is f32 or f64 (ConvFloat). The assertion above shows
    // every element the strides address lies inside `a`, `b` and `dst`;
    // m, n, k > 0. With `read_dst` gemm computes dst = 1·dst + 1·a·b,
    // without it dst = a·b.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            par,
        )
    }
}

/// The outputs `lo..hi` along one axis (of `out` outputs) whose input
/// position `o·stride + offset` lies in `0..size`.
fn valid_range(out: usize, size: usize, stride: usize, offset: isize) -> (usize, usize) {
    // o·s + off >= 0  ⇔  o >= ceil(-off / s);  o·s + off < size  ⇔  o < ceil((size - off) / s)
    let s = stride as isize;
    let ceil_div = |a: isize| if a <= 0 { -((-a) / s) } else { (a + s - 1) / s };
    let lo = ceil_div(-offset).clamp(0, out as isize) as usize;
    let hi = ceil_div(size as isize - offset).clamp(lo as isize, out as isize) as usize;
    (lo, hi)
}

/// The columns of output rows `rows` of the im2col matrix `[K, P]` of
/// group `g` of one sample `x` (`[c, h, w]`), as a `[K, rows·wo]` block.
/// Each row segment is the valid range of its output row, copied (a slice
/// copy at stride 1), with zeros for the padding on either side.
fn im2col<T: ConvFloat>(d: &ConvDims, x: &[T], g: usize, rows: Range<usize>, col: &mut [T]) {
    let cg = d.cg();
    let p = rows.len() * d.wo;
    let [sh, sw] = d.conv.stride;
    let [dh, dw] = d.conv.dilation;
    let (pt, pl) = (d.conv.padding[0] as isize, d.conv.padding[2] as isize);
    for ci in 0..cg {
        let plane = &x[(g * cg + ci) * d.h * d.w..][..d.h * d.w];
        for ki in 0..d.kh {
            let (h_lo, h_hi) = valid_range(d.ho, d.h, sh, (ki * dh) as isize - pt);
            for kj in 0..d.kw {
                let off = (kj * dw) as isize - pl;
                let (lo, hi) = valid_range(d.wo, d.w, sw, off);
                let row = ((ci * d.kh + ki) * d.kw + kj) * p;
                let row = &mut col[row..row + p];
                let (h_lo, h_hi) = (
                    h_lo.clamp(rows.start, rows.end),
                    h_hi.clamp(rows.start, rows.end),
                );
                let h_hi = h_hi.max(h_lo);
                row[..(h_lo - rows.start) * d.wo].fill(T::ZERO);
                row[(h_hi - rows.start) * d.wo..].fill(T::ZERO);
                for oh in h_lo..h_hi {
                    let ih = (oh * sh + ki * dh) as isize - pt;
                    let r = oh - rows.start;
                    let out = &mut row[r * d.wo..(r + 1) * d.wo];
                    let src = &plane[ih as usize * d.w..][..d.w];
                    out[..lo].fill(T::ZERO);
                    out[hi..].fill(T::ZERO);
                    if lo == hi {
                        continue;
                    }
                    let first = (lo as isize * sw as isize + off) as usize;
                    match sw {
                        1 => out[lo..hi].copy_from_slice(&src[first..first + hi - lo]),
                        _ => {
                            for (o, v) in
                                out[lo..hi].iter_mut().zip(src[first..].iter().step_by(sw))
                            {
                                *o = *v;
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Adds the im2col-shaped block `col` (`[K, rows·wo]`, output rows
/// `rows`) of group `g` back into one sample's `dx`.
fn col2im<T: ConvFloat>(d: &ConvDims, col: &[T], g: usize, rows: Range<usize>, dx: &mut [T]) {
    let cg = d.cg();
    let p = rows.len() * d.wo;
    let [sh, sw] = d.conv.stride;
    let [dh, dw] = d.conv.dilation;
    let (pt, pl) = (d.conv.padding[0] as isize, d.conv.padding[2] as isize);
    for ci in 0..cg {
        let plane = &mut dx[(g * cg + ci) * d.h * d.w..][..d.h * d.w];
        for ki in 0..d.kh {
            let (h_lo, h_hi) = valid_range(d.ho, d.h, sh, (ki * dh) as isize - pt);
            for kj in 0..d.kw {
                let off = (kj * dw) as isize - pl;
                let (lo, hi) = valid_range(d.wo, d.w, sw, off);
                if lo == hi {
                    continue;
                }
                let first = (lo as isize * sw as isize + off) as usize;
                let row = &col[((ci * d.kh + ki) * d.kw + kj) * p..][..p];
                for oh in h_lo.max(rows.start)..h_hi.min(rows.end) {
                    let ih = (oh * sh + ki * dh) as isize - pt;
                    let dst = &mut plane[ih as usize * d.w..][..d.w];
                    let r = oh - rows.start;
                    let src = &row[r * d.wo + lo..r * d.wo + hi];
                    for (o, &v) in dst[first..].iter_mut().step_by(sw).zip(src) {
                        *o = *o + v;
                    }
                }
            }
        }
    }
}

/// Runs `f(sample, its chunk of out)` for every sample: in parallel over
/// samples when there are at least as many as threads (each GEMM then
/// alone), else one after another with parallel GEMMs (`f`'s flag).
fn per_sample<T: Send>(out: &mut [T], per: usize, f: impl Fn(usize, &mut [T], bool) + Sync) {
    if per == 0 {
        return;
    }
    let n = out.len() / per;
    if n >= rayon::current_num_threads() && n > 1 {
        out.par_chunks_mut(per)
            .enumerate()
            .for_each(|(i, o)| f(i, o, false));
    } else {
        for (i, o) in out.chunks_mut(per).enumerate() {
            f(i, o, true);
        }
    }
}

/// `y = conv(x, w) (+ bias) (then the activation)`; `y` has `n·o·ho·wo`
/// elements.
pub fn conv2d_forward<T: ConvFloat>(
    d: &ConvDims,
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    y: &mut [T],
) {
    if d.depthwise() {
        return depthwise_forward(d, x, w, bias, y);
    }
    let (k, p, og) = (d.k(), d.p(), d.og());
    per_sample(y, d.out_sample(), |s, y, parallel| {
        let x = &x[s * d.in_sample()..][..d.in_sample()];
        let block = d.block_rows(parallel);
        let mut col = match d.direct() {
            true => Vec::new(),
            false => vec![T::ZERO; k * block * d.wo],
        };
        for g in 0..d.conv.groups {
            let out = &mut y[g * og * p..][..og * p];
            let wg = &w[g * og * k..][..og * k];
            match d.direct() {
                true => {
                    let xg = &x[g * k * p..][..k * p];
                    gemm(
                        (og, p, k),
                        (out, p),
                        false,
                        wg,
                        (k, 1),
                        xg,
                        (p, 1),
                        parallel,
                    );
                }
                false => {
                    for rows in row_blocks(d.ho, block) {
                        let n = rows.len() * d.wo;
                        let dst = &mut out[rows.start * d.wo..];
                        im2col(d, x, g, rows, &mut col[..k * n]);
                        gemm(
                            (og, n, k),
                            (dst, p),
                            false,
                            wg,
                            (k, 1),
                            &col,
                            (n, 1),
                            parallel,
                        );
                    }
                }
            }
            for (oc, row) in out.chunks_mut(p).enumerate() {
                let b = bias.map_or(T::ZERO, |b| b[g * og + oc]);
                epilogue(row, b, d.conv.activation);
            }
        }
    });
}

/// Output rows `0..ho` in blocks of `block`.
fn row_blocks(ho: usize, block: usize) -> impl Iterator<Item = Range<usize>> {
    (0..ho)
        .step_by(block.max(1))
        .map(move |r| r..(r + block.max(1)).min(ho))
}

/// A depthwise convolution (one input and one output channel per group),
/// directly: each output plane is the sum over the kernel's taps of a
/// weight times the input plane shifted (a row segment per output row,
/// the padding skipped), in parallel over planes. The same sums as the
/// im2col path's GEMM of `K = kh·kw`, in the same tap order.
fn depthwise_forward<T: ConvFloat>(
    d: &ConvDims,
    x: &[T],
    w: &[T],
    bias: Option<&[T]>,
    y: &mut [T],
) {
    let [sh, sw] = d.conv.stride;
    let [dh, dw] = d.conv.dilation;
    let (pt, pl) = (d.conv.padding[0] as isize, d.conv.padding[2] as isize);
    let (p, plane) = (d.p(), d.h * d.w);
    let taps = d.kh * d.kw;
    y.par_chunks_mut(p.max(1)).enumerate().for_each(|(i, out)| {
        let c = i % d.c;
        let src = &x[i * plane..][..plane];
        let wc = &w[c * taps..][..taps];
        out.fill(T::ZERO);
        for ki in 0..d.kh {
            let (h_lo, h_hi) = valid_range(d.ho, d.h, sh, (ki * dh) as isize - pt);
            for kj in 0..d.kw {
                let off = (kj * dw) as isize - pl;
                let (lo, hi) = valid_range(d.wo, d.w, sw, off);
                if lo == hi {
                    continue;
                }
                let wv = wc[ki * d.kw + kj];
                let first = (lo as isize * sw as isize + off) as usize;
                for oh in h_lo..h_hi {
                    let ih = (oh * sh + ki * dh) as isize - pt;
                    let row = &src[ih as usize * d.w..][..d.w];
                    let o = &mut out[oh * d.wo + lo..oh * d.wo + hi];
                    match sw {
                        1 => o
                            .iter_mut()
                            .zip(&row[first..first + (hi - lo)])
                            .for_each(|(o, &v)| *o = *o + wv * v),
                        _ => o
                            .iter_mut()
                            .zip(row[first..].iter().step_by(sw))
                            .for_each(|(o, &v)| *o = *o + wv * v),
                    }
                }
            }
        }
        epilogue(out, bias.map_or(T::ZERO, |b| b[c]), d.conv.activation);
    });
}

fn epilogue<T: ConvFloat>(row: &mut [T], bias: T, activation: Activation) {
    match activation {
        Activation::None => {
            if bias != T::ZERO {
                row.iter_mut().for_each(|v| *v = *v + bias);
            }
        }
        // max(v, 0) that keeps a NaN, as `relu` does.
        Activation::Relu => row.iter_mut().for_each(|v| {
            let t = *v + bias;
            *v = if t < T::ZERO { T::ZERO } else { t };
        }),
    }
}

/// The gradient of the input, `dx` (`n·c·h·w`), from `dy` and `w`.
pub fn conv2d_backward_input<T: ConvFloat>(d: &ConvDims, dy: &[T], w: &[T], dx: &mut [T]) {
    let (k, p, og) = (d.k(), d.p(), d.og());
    per_sample(dx, d.in_sample(), |s, dx, parallel| {
        let dy = &dy[s * d.out_sample()..][..d.out_sample()];
        dx.fill(T::ZERO);
        let block = d.block_rows(parallel);
        let mut col = match d.direct() {
            true => Vec::new(),
            false => vec![T::ZERO; k * block * d.wo],
        };
        for g in 0..d.conv.groups {
            let wg = &w[g * og * k..][..og * k];
            let dyg = &dy[g * og * p..][..og * p];
            // col[K, P] = wgᵀ[K, Og] · dyg[Og, P], a block of rows at a time
            match d.direct() {
                true => {
                    let dst = &mut dx[g * k * p..][..k * p];
                    gemm(
                        (k, p, og),
                        (dst, p),
                        false,
                        wg,
                        (1, k),
                        dyg,
                        (p, 1),
                        parallel,
                    );
                }
                false => {
                    for rows in row_blocks(d.ho, block) {
                        let n = rows.len() * d.wo;
                        let b = &dyg[rows.start * d.wo..];
                        let c = &mut col[..k * n];
                        gemm((k, n, og), (c, n), false, wg, (1, k), b, (p, 1), parallel);
                        col2im(d, c, g, rows, dx);
                    }
                }
            }
        }
    });
}

/// The gradient of the weight, `dw` (`o·c/g·kh·kw`), from `x` and `dy`.
pub fn conv2d_backward_weight<T: ConvFloat>(d: &ConvDims, x: &[T], dy: &[T], dw: &mut [T]) {
    let (k, p, og) = (d.k(), d.p(), d.og());
    let parts = d.n.min(rayon::current_num_threads()).max(1);
    let per_part = d.n.div_ceil(parts);
    // One partial sum per part of the batch, added in order: the result
    // does not depend on which thread ran which part.
    let partial = |part: usize, parallel: bool| -> Vec<T> {
        let mut acc = vec![T::ZERO; dw.len()];
        let block = d.block_rows(parallel);
        let mut col = match d.direct() {
            true => Vec::new(),
            false => vec![T::ZERO; k * block * d.wo],
        };
        for s in part * per_part..((part + 1) * per_part).min(d.n) {
            let x = &x[s * d.in_sample()..][..d.in_sample()];
            let dy = &dy[s * d.out_sample()..][..d.out_sample()];
            for g in 0..d.conv.groups {
                let dst = &mut acc[g * og * k..][..og * k];
                let dyg = &dy[g * og * p..][..og * p];
                // dw[Og, K] += dy[Og, P] · colᵀ[P, K], a block of rows at a time
                match d.direct() {
                    true => {
                        let xg = &x[g * k * p..][..k * p];
                        gemm(
                            (og, k, p),
                            (dst, k),
                            true,
                            dyg,
                            (p, 1),
                            xg,
                            (1, p),
                            parallel,
                        );
                    }
                    false => {
                        for rows in row_blocks(d.ho, block) {
                            let n = rows.len() * d.wo;
                            let a = &dyg[rows.start * d.wo..];
                            im2col(d, x, g, rows, &mut col[..k * n]);
                            let c = &col[..k * n];
                            gemm(
                                (og, k, n),
                                (&mut *dst, k),
                                true,
                                a,
                                (p, 1),
                                c,
                                (1, n),
                                parallel,
                            );
                        }
                    }
                }
            }
        }
        acc
    };
    let sums: Vec<Vec<T>> = match parts {
        1 => vec![partial(0, true)],
        _ => (0..parts)
            .into_par_iter()
            .map(|part| partial(part, false))
            .collect(),
    };
    dw.fill(T::ZERO);
    for s in sums {
        for (o, v) in dw.iter_mut().zip(s) {
            *o = *o + v;
        }
    }
}

/// The sizes of one pooling: input planes `n·c` of `h × w`, output `ho × wo`.
#[derive(Clone, Copy, Debug)]
pub struct PoolDims {
    pub planes: usize,
    pub h: usize,
    pub w: usize,
    pub ho: usize,
    pub wo: usize,
    pub pool: Pool2d,
}

impl PoolDims {
    /// The window of output `(oh, ow)` along `axis`: the positions
    /// `start + i·dilation` for `i < k` (some may be outside the input).
    fn start(&self, axis: usize, o: usize) -> isize {
        (o * self.pool.stride[axis]) as isize - self.pool.padding[axis] as isize
    }
    fn in_plane(&self) -> usize {
        self.h * self.w
    }
    fn out_plane(&self) -> usize {
        self.ho * self.wo
    }
}

/// The input positions of output `o`'s window along one axis (`k`
/// positions `start + i·dilation`), clipped to `0..size`: the first valid
/// `i` and one past the last.
fn window_taps(start: isize, k: usize, dilation: usize, size: usize) -> (usize, usize) {
    valid_range(k, size, dilation, start)
}

/// Max pooling: `y` and the flat index in its plane of each maximum (the
/// first on ties; a NaN wins, as in PyTorch). Each window's valid taps are
/// found once per row and column, so the inner loop has no bounds tests.
pub fn max_pool2d_forward<T: Float>(d: &PoolDims, x: &[T], y: &mut [T], idx: &mut [i64]) {
    let [kh, kw] = d.pool.kernel;
    let [dh, dw] = d.pool.dilation;
    // Per output column: its first input column and valid taps.
    let cols: Vec<(isize, usize, usize)> = (0..d.wo)
        .map(|ow| {
            let ws = d.start(1, ow);
            let (j0, j1) = window_taps(ws, kw, dw, d.w);
            (ws, j0, j1)
        })
        .collect();
    y.par_chunks_mut(d.out_plane().max(1))
        .zip(idx.par_chunks_mut(d.out_plane().max(1)))
        .enumerate()
        .for_each(|(pl, (y, idx))| {
            let x = &x[pl * d.in_plane()..][..d.in_plane()];
            for oh in 0..d.ho {
                let hs = d.start(0, oh);
                let (i0, i1) = window_taps(hs, kh, dh, d.h);
                let y = &mut y[oh * d.wo..(oh + 1) * d.wo];
                let idx = &mut idx[oh * d.wo..(oh + 1) * d.wo];
                for (ow, &(ws, j0, j1)) in cols.iter().enumerate() {
                    if i0 == i1 || j0 == j1 {
                        // A window wholly in the padding (PyTorch forbids it).
                        y[ow] = T::from_acc(T::Acc::NEG_INFINITY);
                        idx[ow] = -1;
                        continue;
                    }
                    let first = (hs + (i0 * dh) as isize) as usize * d.w
                        + (ws + (j0 * dw) as isize) as usize;
                    let mut best = x[first].to_acc();
                    let mut at = first;
                    for i in i0..i1 {
                        let base = (hs + (i * dh) as isize) as usize * d.w;
                        let row = &x[base..][..d.w];
                        for j in j0..j1 {
                            let col = (ws + (j * dw) as isize) as usize;
                            let v = row[col].to_acc();
                            // v > best, or v a NaN over a number; a NaN stays.
                            #[allow(clippy::neg_cmp_op_on_partial_ord)]
                            let replace = !(v <= best) && !best.is_nan();
                            if replace {
                                best = v;
                                at = base + col;
                            }
                        }
                    }
                    y[ow] = T::from_acc(best);
                    idx[ow] = at as i64;
                }
            }
        });
}

/// The gradient of max pooling: each `dy` added at its maximum's index.
pub fn max_pool2d_backward<T: Float>(d: &PoolDims, dy: &[T], idx: &[i64], dx: &mut [T]) {
    dx.par_chunks_mut(d.in_plane().max(1))
        .enumerate()
        .for_each(|(pl, dx)| {
            let mut acc = vec![T::Acc::ZERO; dx.len()];
            let dy = &dy[pl * d.out_plane()..][..d.out_plane()];
            let idx = &idx[pl * d.out_plane()..][..d.out_plane()];
            for (&g, &i) in dy.iter().zip(idx) {
                if i >= 0 && (i as usize) < acc.len() {
                    acc[i as usize] = acc[i as usize] + g.to_acc();
                }
            }
            for (o, a) in dx.iter_mut().zip(acc) {
                *o = T::from_acc(a);
            }
        });
}

/// An average-pooling window along one axis: its clipped range and the
/// length PyTorch counts with `count_include_pad` (the window clipped to
/// the padded input).
fn avg_window(d: &PoolDims, axis: usize, o: usize) -> (usize, usize, usize) {
    let size = [d.h, d.w][axis] as isize;
    let start = d.start(axis, o);
    let end = (start + d.pool.kernel[axis] as isize).min(size + d.pool.padding[axis] as isize);
    let padded_len = (end - start) as usize;
    (
        start.max(0) as usize,
        end.min(size).max(0) as usize,
        padded_len,
    )
}

/// The divisor of output `(oh, ow)`.
fn avg_divisor(d: &PoolDims, oh: usize, ow: usize) -> f64 {
    let (h0, h1, hp) = avg_window(d, 0, oh);
    let (w0, w1, wp) = avg_window(d, 1, ow);
    match (d.pool.divisor_override, d.pool.count_include_pad) {
        (Some(v), _) => v as f64,
        (None, true) => (hp * wp) as f64,
        (None, false) => (h1.saturating_sub(h0) * w1.saturating_sub(w0)) as f64,
    }
}

/// Average pooling.
pub fn avg_pool2d_forward<T: Float>(d: &PoolDims, x: &[T], y: &mut [T]) {
    y.par_chunks_mut(d.out_plane().max(1))
        .enumerate()
        .for_each(|(pl, y)| {
            let x = &x[pl * d.in_plane()..][..d.in_plane()];
            for oh in 0..d.ho {
                let (h0, h1, _) = avg_window(d, 0, oh);
                for ow in 0..d.wo {
                    let (w0, w1, _) = avg_window(d, 1, ow);
                    let mut sum = T::Acc::ZERO;
                    for ih in h0..h1 {
                        for v in &x[ih * d.w + w0..ih * d.w + w1.max(w0)] {
                            sum = sum + v.to_acc();
                        }
                    }
                    let div = T::Acc::from_f64(avg_divisor(d, oh, ow));
                    y[oh * d.wo + ow] = T::from_acc(sum / div);
                }
            }
        });
}

/// The gradient of average pooling: each `dy / divisor` spread over its
/// window.
pub fn avg_pool2d_backward<T: Float>(d: &PoolDims, dy: &[T], dx: &mut [T]) {
    dx.par_chunks_mut(d.in_plane().max(1))
        .enumerate()
        .for_each(|(pl, dx)| {
            let dy = &dy[pl * d.out_plane()..][..d.out_plane()];
            let mut acc = vec![T::Acc::ZERO; dx.len()];
            for oh in 0..d.ho {
                let (h0, h1, _) = avg_window(d, 0, oh);
                for ow in 0..d.wo {
                    let (w0, w1, _) = avg_window(d, 1, ow);
                    let g = dy[oh * d.wo + ow].to_acc() / T::Acc::from_f64(avg_divisor(d, oh, ow));
                    for ih in h0..h1 {
                        for a in &mut acc[ih * d.w + w0..ih * d.w + w1.max(w0)] {
                            *a = *a + g;
                        }
                    }
                }
            }
            for (o, a) in dx.iter_mut().zip(acc) {
                *o = T::from_acc(a);
            }
        });
}

#[cfg(test)]
mod tests_support {
    use super::*;

    /// The convolution by its definition, in f64.
    pub fn naive(d: &ConvDims, x: &[f64], w: &[f64]) -> Vec<f64> {
        let (cg, og) = (d.cg(), d.og());
        let mut y = vec![0.0; d.n * d.out_sample()];
        for n in 0..d.n {
            for o in 0..d.o {
                let g = o / og;
                for oh in 0..d.ho {
                    for ow in 0..d.wo {
                        let mut s = 0.0;
                        for ci in 0..cg {
                            for i in 0..d.kh {
                                for j in 0..d.kw {
                                    let ih = (oh * d.conv.stride[0] + i * d.conv.dilation[0])
                                        as isize
                                        - d.conv.padding[0] as isize;
                                    let iw = (ow * d.conv.stride[1] + j * d.conv.dilation[1])
                                        as isize
                                        - d.conv.padding[2] as isize;
                                    if ih < 0 || iw < 0 || ih >= d.h as isize || iw >= d.w as isize
                                    {
                                        continue;
                                    }
                                    let c = g * cg + ci;
                                    s += x[((n * d.c + c) * d.h + ih as usize) * d.w + iw as usize]
                                        * w[((o * cg + ci) * d.kh + i) * d.kw + j];
                                }
                            }
                        }
                        y[((n * d.o + o) * d.ho + oh) * d.wo + ow] = s;
                    }
                }
            }
        }
        y
    }

    pub fn values(n: usize, seed: u64) -> Vec<f64> {
        (0..n)
            .map(|i| (((i as u64 * 2654435761 + seed) % 1000) as f64 / 500.0) - 1.0)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::*;
    use super::*;

    #[test]
    fn forward_and_its_adjoints_match_the_definition() {
        let conv = Conv2d {
            stride: [2, 1],
            padding: [1, 2, 0, 1],
            dilation: [1, 2],
            groups: 2,
            activation: Activation::None,
        };
        let (n, c, h, w, o, kh, kw) = (3, 4, 7, 6, 6, 3, 2);
        let ho = conv.out_size("t", 0, h, kh).unwrap();
        let wo = conv.out_size("t", 1, w, kw).unwrap();
        let d = ConvDims {
            n,
            c,
            h,
            w,
            o,
            kh,
            kw,
            ho,
            wo,
            conv,
        };
        let x = values(n * c * h * w, 1);
        let wt = values(o * 2 * kh * kw, 7);
        let mut y = vec![0.0; n * o * ho * wo];
        conv2d_forward(&d, &x, &wt, None, &mut y);
        let want = naive(&d, &x, &wt);
        for (a, b) in y.iter().zip(&want) {
            assert!((a - b).abs() < 1e-12, "{a} vs {b}");
        }
        // <dy, conv(x, w)> = <conv_bwd_input(dy, w), x> = <conv_bwd_weight(x, dy), w>
        let dy = values(y.len(), 3);
        let lhs: f64 = dy.iter().zip(&y).map(|(a, b)| a * b).sum();
        let mut dx = vec![0.0; x.len()];
        conv2d_backward_input(&d, &dy, &wt, &mut dx);
        let mut dw = vec![0.0; wt.len()];
        conv2d_backward_weight(&d, &x, &dy, &mut dw);
        let via_x: f64 = dx.iter().zip(&x).map(|(a, b)| a * b).sum();
        let via_w: f64 = dw.iter().zip(&wt).map(|(a, b)| a * b).sum();
        assert!((lhs - via_x).abs() < 1e-9 && (lhs - via_w).abs() < 1e-9);
    }
}

#[cfg(test)]
mod shape_tests {
    use super::tests_support::*;
    use super::*;

    /// The im2col fast paths (valid ranges, stride-1 copies, strided
    /// gathers), the depthwise direct kernel and col2im, over geometries
    /// whose windows leave the input on either side.
    #[test]
    fn every_path_matches_the_definition() {
        // (c, o, groups, h, w, kh, kw, stride, padding [t, b, l, r], dilation)
        let cases = [
            (3, 4, 1, 9, 8, 7, 7, [2, 2], [3, 3, 3, 3], [1, 1]),
            (4, 4, 4, 7, 6, 3, 3, [1, 1], [1, 1, 1, 1], [1, 1]),
            (4, 4, 4, 7, 9, 3, 3, [2, 2], [1, 1, 1, 1], [1, 1]),
            (6, 6, 6, 8, 5, 3, 2, [2, 1], [0, 2, 2, 0], [2, 1]),
            (4, 6, 2, 5, 5, 1, 1, [2, 2], [0, 0, 0, 0], [1, 1]),
            (2, 3, 1, 4, 11, 2, 5, [1, 3], [1, 0, 4, 4], [1, 2]),
            (2, 2, 2, 3, 3, 5, 5, [1, 1], [2, 2, 2, 2], [1, 1]),
            // An im2col matrix of several blocks (COL_BLOCK).
            (16, 4, 1, 70, 66, 3, 3, [1, 1], [1, 1, 1, 1], [1, 1]),
            (32, 4, 2, 66, 130, 3, 3, [1, 2], [0, 1, 1, 1], [1, 1]),
        ];
        for (i, &(c, o, groups, h, w, kh, kw, stride, padding, dilation)) in
            cases.iter().enumerate()
        {
            let conv = Conv2d {
                stride,
                padding,
                dilation,
                groups,
                activation: Activation::None,
            };
            let ho = conv.out_size("t", 0, h, kh).unwrap();
            let wo = conv.out_size("t", 1, w, kw).unwrap();
            let d = ConvDims {
                n: 2,
                c,
                h,
                w,
                o,
                kh,
                kw,
                ho,
                wo,
                conv,
            };
            let x = values(2 * c * h * w, 1 + i as u64);
            let wt = values(o * (c / groups) * kh * kw, 7);
            let bias = values(o, 5);
            let mut y = vec![0.0; 2 * o * ho * wo];
            conv2d_forward(&d, &x, &wt, Some(&bias), &mut y);
            let want = naive(&d, &x, &wt);
            for (j, (a, b)) in y.iter().zip(&want).enumerate() {
                let b = b + bias[(j / (ho * wo)) % o];
                assert!((a - b).abs() < 1e-12, "case {i}: {a} vs {b}");
            }
            let dy = values(y.len(), 3);
            let lhs: f64 = dy.iter().zip(&want).map(|(a, b)| a * b).sum();
            let mut dx = vec![0.0; x.len()];
            conv2d_backward_input(&d, &dy, &wt, &mut dx);
            let via_x: f64 = dx.iter().zip(&x).map(|(a, b)| a * b).sum();
            assert!((lhs - via_x).abs() < 1e-9, "case {i}: {lhs} vs {via_x}");
            let mut dw = vec![0.0; wt.len()];
            conv2d_backward_weight(&d, &x, &dy, &mut dw);
            let via_w: f64 = dw.iter().zip(&wt).map(|(a, b)| a * b).sum();
            assert!((lhs - via_w).abs() < 1e-9, "case {i}: {lhs} vs {via_w}");
        }
    }

    #[test]
    fn valid_ranges_are_the_outputs_inside_the_input() {
        for out in 0..6 {
            for size in 1..6 {
                for stride in 1..4 {
                    for offset in -4isize..4 {
                        let (lo, hi) = valid_range(out, size, stride, offset);
                        let want: Vec<usize> = (0..out)
                            .filter(|&o| {
                                (0..size as isize)
                                    .contains(&(o as isize * stride as isize + offset))
                            })
                            .collect();
                        assert_eq!((lo..hi).collect::<Vec<_>>(), want);
                    }
                }
            }
        }
    }
}
