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
    fn in_sample(&self) -> usize {
        self.c * self.h * self.w
    }
    fn out_sample(&self) -> usize {
        self.o * self.p()
    }
}

/// Work (multiply-adds) below which a GEMM runs on one thread.
const PAR_WORK: usize = 1 << 20;

/// `dst[m×n] (+)= a[m×k] · b[k×n]`, each operand given by row and column
/// strides; `dst` row-major.
#[allow(clippy::too_many_arguments)]
fn gemm<T: ConvFloat>(
    (m, n, k): (usize, usize, usize),
    dst: &mut [T],
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
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(T::ZERO);
        }
        return;
    }
    let reach = |rows: usize, cols: usize, rs: usize, cs: usize| (rows - 1) * rs + (cols - 1) * cs;
    assert!(
        dst.len() >= m * n
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
            n as isize,
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

/// The im2col matrix `[K, P]` of group `g` of one sample `x` (`[c, h, w]`).
fn im2col<T: ConvFloat>(d: &ConvDims, x: &[T], g: usize, col: &mut [T]) {
    let (cg, p) = (d.cg(), d.p());
    let [sh, sw] = d.conv.stride;
    let [dh, dw] = d.conv.dilation;
    let (pt, pl) = (d.conv.padding[0] as isize, d.conv.padding[2] as isize);
    for ci in 0..cg {
        let plane = &x[(g * cg + ci) * d.h * d.w..][..d.h * d.w];
        for ki in 0..d.kh {
            for kj in 0..d.kw {
                let row = ((ci * d.kh + ki) * d.kw + kj) * p;
                let row = &mut col[row..row + p];
                for oh in 0..d.ho {
                    let ih = (oh * sh + ki * dh) as isize - pt;
                    let out = &mut row[oh * d.wo..(oh + 1) * d.wo];
                    if ih < 0 || ih >= d.h as isize {
                        out.fill(T::ZERO);
                        continue;
                    }
                    let src = &plane[ih as usize * d.w..][..d.w];
                    for (ow, o) in out.iter_mut().enumerate() {
                        let iw = (ow * sw + kj * dw) as isize - pl;
                        *o = match iw >= 0 && iw < d.w as isize {
                            true => src[iw as usize],
                            false => T::ZERO,
                        };
                    }
                }
            }
        }
    }
}

/// Adds the im2col-shaped `col` of group `g` back into one sample's `dx`.
fn col2im<T: ConvFloat>(d: &ConvDims, col: &[T], g: usize, dx: &mut [T]) {
    let (cg, p) = (d.cg(), d.p());
    let [sh, sw] = d.conv.stride;
    let [dh, dw] = d.conv.dilation;
    let (pt, pl) = (d.conv.padding[0] as isize, d.conv.padding[2] as isize);
    for ci in 0..cg {
        let plane = &mut dx[(g * cg + ci) * d.h * d.w..][..d.h * d.w];
        for ki in 0..d.kh {
            for kj in 0..d.kw {
                let row = &col[((ci * d.kh + ki) * d.kw + kj) * p..][..p];
                for oh in 0..d.ho {
                    let ih = (oh * sh + ki * dh) as isize - pt;
                    if ih < 0 || ih >= d.h as isize {
                        continue;
                    }
                    let dst = &mut plane[ih as usize * d.w..][..d.w];
                    for (ow, &v) in row[oh * d.wo..(oh + 1) * d.wo].iter().enumerate() {
                        let iw = (ow * sw + kj * dw) as isize - pl;
                        if iw >= 0 && iw < d.w as isize {
                            dst[iw as usize] = dst[iw as usize] + v;
                        }
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
    let (k, p, og) = (d.k(), d.p(), d.og());
    per_sample(y, d.out_sample(), |s, y, parallel| {
        let x = &x[s * d.in_sample()..][..d.in_sample()];
        let mut col = match d.direct() {
            true => Vec::new(),
            false => vec![T::ZERO; k * p],
        };
        for g in 0..d.conv.groups {
            let cols: &[T] = match d.direct() {
                true => &x[g * k * p..][..k * p],
                false => {
                    im2col(d, x, g, &mut col);
                    &col
                }
            };
            let out = &mut y[g * og * p..][..og * p];
            let wg = &w[g * og * k..][..og * k];
            gemm((og, p, k), out, false, wg, (k, 1), cols, (p, 1), parallel);
            for (oc, row) in out.chunks_mut(p).enumerate() {
                let b = bias.map_or(T::ZERO, |b| b[g * og + oc]);
                epilogue(row, b, d.conv.activation);
            }
        }
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
        let mut col = match d.direct() {
            true => Vec::new(),
            false => vec![T::ZERO; k * p],
        };
        for g in 0..d.conv.groups {
            let wg = &w[g * og * k..][..og * k];
            let dyg = &dy[g * og * p..][..og * p];
            // col[K, P] = wgᵀ[K, Og] · dyg[Og, P]
            match d.direct() {
                true => {
                    let dst = &mut dx[g * k * p..][..k * p];
                    gemm((k, p, og), dst, false, wg, (1, k), dyg, (p, 1), parallel);
                }
                false => {
                    gemm(
                        (k, p, og),
                        &mut col,
                        false,
                        wg,
                        (1, k),
                        dyg,
                        (p, 1),
                        parallel,
                    );
                    col2im(d, &col, g, dx);
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
        let mut col = match d.direct() {
            true => Vec::new(),
            false => vec![T::ZERO; k * p],
        };
        for s in part * per_part..((part + 1) * per_part).min(d.n) {
            let x = &x[s * d.in_sample()..][..d.in_sample()];
            let dy = &dy[s * d.out_sample()..][..d.out_sample()];
            for g in 0..d.conv.groups {
                let cols: &[T] = match d.direct() {
                    true => &x[g * k * p..][..k * p],
                    false => {
                        im2col(d, x, g, &mut col);
                        &col
                    }
                };
                let dst = &mut acc[g * og * k..][..og * k];
                let dyg = &dy[g * og * p..][..og * p];
                // dw[Og, K] += dy[Og, P] · colᵀ[P, K]
                gemm((og, k, p), dst, true, dyg, (p, 1), cols, (1, p), parallel);
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

/// Max pooling: `y` and the flat index in its plane of each maximum (the
/// first on ties; a NaN wins, as in PyTorch).
pub fn max_pool2d_forward<T: Float>(d: &PoolDims, x: &[T], y: &mut [T], idx: &mut [i64]) {
    let [kh, kw] = d.pool.kernel;
    let [dh, dw] = d.pool.dilation;
    y.par_chunks_mut(d.out_plane().max(1))
        .zip(idx.par_chunks_mut(d.out_plane().max(1)))
        .enumerate()
        .for_each(|(pl, (y, idx))| {
            let x = &x[pl * d.in_plane()..][..d.in_plane()];
            for oh in 0..d.ho {
                let hs = d.start(0, oh);
                for ow in 0..d.wo {
                    let ws = d.start(1, ow);
                    let mut best = T::Acc::NEG_INFINITY;
                    let mut at = -1i64;
                    for i in 0..kh {
                        let ih = hs + (i * dh) as isize;
                        if ih < 0 || ih >= d.h as isize {
                            continue;
                        }
                        for j in 0..kw {
                            let iw = ws + (j * dw) as isize;
                            if iw < 0 || iw >= d.w as isize {
                                continue;
                            }
                            let flat = ih as usize * d.w + iw as usize;
                            let v = x[flat].to_acc();
                            if at < 0 || v > best || (v.is_nan() && !best.is_nan()) {
                                best = v;
                                at = flat as i64;
                            }
                        }
                    }
                    y[oh * d.wo + ow] = T::from_acc(best);
                    idx[oh * d.wo + ow] = at;
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
mod tests {
    use super::*;

    /// The convolution by its definition, in f64.
    fn naive(d: &ConvDims, x: &[f64], w: &[f64]) -> Vec<f64> {
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

    fn values(n: usize, seed: u64) -> Vec<f64> {
        (0..n)
            .map(|i| (((i as u64 * 2654435761 + seed) % 1000) as f64 / 500.0) - 1.0)
            .collect()
    }

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
