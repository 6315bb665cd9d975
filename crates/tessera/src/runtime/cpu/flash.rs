//! Flash attention on the CPU: `softmax(scale · Q Kᵀ + mask) V` and its
//! gradients, tiled so that no `q_len × kv_len` matrix is ever formed.
//!
//! Semantics are PyTorch's `F.scaled_dot_product_attention(q, k, v,
//! attn_mask, is_causal, scale)`:
//!
//! - scores `s_ij = scale · q_i·k_j + mask_ij`; with `causal`, key `j` is
//!   visible to query `i` only when `j <= i` (the top-left aligned mask
//!   PyTorch uses, also when `q_len != kv_len`); both may be given;
//! - `out_i = Σ_j softmax_j(s_i) v_j` and `lse_i = log Σ_j e^{s_ij}` (the
//!   residual the backward needs);
//! - a row that sees no key at all (`kv_len == 0`, or a mask of `-inf`
//!   across the whole row) has `out_i = 0`, `lse_i = -inf`, and contributes
//!   nothing to any gradient: never NaN. (PyTorch's math backend gives NaN.)
//!
//! The forward runs the online softmax (FlashAttention, Dao et al. 2022)
//! over query blocks × key blocks; the backward recomputes the
//! probabilities block by block from `q`, `k` and `lse` (FlashAttention-2:
//! `D_i = rowsum(dO ∘ O)`, `dS = P ∘ (dP − D)`). Working memory is a few
//! `BLOCK × BLOCK` and `BLOCK × head_dim` tiles per task, plus, per call,
//! f32 copies of the operands that are not f32 already and one f32 dQ
//! accumulator: O(bh · len · dim), like the inputs, never `len²`.
//!
//! Every product is one micro-tiled kernel (`Gemm`) written once over a
//! small SIMD abstraction (`Simd`) and compiled for AVX-512 and AVX2
//! (picked at run time: the build's floor is x86-64-v3, the dev machines
//! have AVX-512) and for plain Rust elsewhere; the softmax's exp is
//! `fastmath`'s, whose vector forms inline into these kernels. Half-precision inputs are converted to f32 once;
//! all accumulation is f32.
//!
//! Parallelism: the forward has one task per (batch × head, query block);
//! the backward one per (batch × head, run of key blocks), see
//! `blocks_per_task`.

use std::borrow::Cow;

use rayon::prelude::*;

use super::element::Float;
use super::fastmath::{exp_f32, exp_nonpositive_f32};
use crate::error::{op_err, Result};
use crate::ir::DType;

/// Query rows per block (a forward task's rows, the backward's inner step).
const BR: usize = 64;
/// Keys per block. A multiple of every SIMD width: packed `Kᵀ`/`Vᵀ` blocks
/// and score tiles are `BC` wide, zero-padded past the last key.
const BC: usize = 64;

/// Shapes of one attention call: `q [bh, q_len, head_dim]`, `k [bh, kv_len,
/// head_dim]`, `v [bh, kv_len, v_dim]`, `out [bh, q_len, v_dim]`, `lse [bh,
/// q_len]` (always f32). All row-major and contiguous; `bh` is batch × heads
/// flattened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub bh: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub head_dim: usize,
    pub v_dim: usize,
}

/// An additive f32 mask `[mask_bh, q_len, kv_len]` added to the scaled
/// scores: `mask_bh` is 1 when `shared` (one mask for every batch × head),
/// else `bh`. `-inf` hides a key.
#[derive(Clone, Copy, Debug)]
pub struct AdditiveMask<'a> {
    pub values: &'a [f32],
    pub shared: bool,
}

/// `causal`: query `i` sees keys `j <= i`. `scale` multiplies `q·k`
/// (PyTorch's default is `1 / sqrt(head_dim)`).
#[derive(Clone, Copy, Debug)]
pub struct AttentionParams {
    pub causal: bool,
    pub scale: f32,
}

impl AttentionShape {
    /// Checks slice lengths against the shape: an error naming the operand
    /// and both lengths. The kernels assert the same (callers validate
    /// first, so a failure there is a bug in the caller, not bad user input).
    pub fn check(&self, lens: &[(&str, usize)], mask: Option<&AdditiveMask>) -> Result<()> {
        let &AttentionShape {
            bh,
            q_len: nq,
            kv_len: nk,
            head_dim: d,
            v_dim: dv,
        } = self;
        if d == 0 || dv == 0 {
            return Err(op_err!(
                Shape,
                "scaled_dot_product_attention",
                "head dims must be at least 1, got {self:?}"
            ));
        }
        for &(name, len) in lens {
            let want = match name {
                "q" | "dq" => bh * nq * d,
                "k" | "dk" => bh * nk * d,
                "v" | "dv" => bh * nk * dv,
                "out" | "d_out" => bh * nq * dv,
                "lse" => bh * nq,
                _ => continue,
            };
            if len != want {
                return Err(op_err!(
                    Shape,
                    "scaled_dot_product_attention",
                    "{name} has {len} elements, but {self:?} needs {want}"
                ));
            }
        }
        if let Some(m) = mask {
            let want = if m.shared { 1 } else { bh } * nq * nk;
            if m.values.len() != want {
                return Err(op_err!(
                    Shape,
                    "scaled_dot_product_attention",
                    "the mask has {} elements, but {self:?} needs {want} ({})",
                    m.values.len(),
                    if m.shared {
                        "shared"
                    } else {
                        "one per batch × head"
                    }
                ));
            }
        }
        Ok(())
    }
}

/// Computes `out` and `lse` (see the module docs).
///
/// # Panics
/// When a slice's length does not match `shape` (see [`AttentionShape::check`]).
#[allow(clippy::too_many_arguments)]
pub fn flash_forward<T: Float<Acc = f32>>(
    shape: &AttentionShape,
    p: &AttentionParams,
    q: &[T],
    k: &[T],
    v: &[T],
    mask: Option<AdditiveMask>,
    out: &mut [T],
    lse: &mut [f32],
) {
    forward_with(Isa::detect(), shape, p, q, k, v, mask, out, lse)
}

/// Computes `dq`, `dk` and `dv` from the forward's inputs, its `out` and
/// `lse`, and the output gradient `d_out`. Rows with `lse = -inf` (no
/// visible key) contribute nothing.
///
/// # Panics
/// When a slice's length does not match `shape` (see [`AttentionShape::check`]).
#[allow(clippy::too_many_arguments)]
pub fn flash_backward<T: Float<Acc = f32>>(
    shape: &AttentionShape,
    p: &AttentionParams,
    q: &[T],
    k: &[T],
    v: &[T],
    mask: Option<AdditiveMask>,
    out: &[T],
    lse: &[f32],
    d_out: &[T],
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
) {
    backward_with(
        Isa::detect(),
        shape,
        p,
        q,
        k,
        v,
        mask,
        out,
        lse,
        d_out,
        dq,
        dk,
        dv,
    )
}

fn assert_lens(shape: &AttentionShape, lens: &[(&str, usize)], mask: Option<&AdditiveMask>) {
    if let Err(e) = shape.check(lens, mask) {
        panic!("flash attention kernel called with bad operands: {e}");
    }
}

// ---------------------------------------------------------------------------
// Operands
// ---------------------------------------------------------------------------

/// `x` as f32: borrowed when it is f32 already, else converted (in parallel).
fn to_f32<T: Float<Acc = f32>>(x: &[T]) -> Cow<'_, [f32]> {
    if T::DTYPE == DType::F32 {
        Cow::Borrowed(bytemuck::cast_slice(x))
    } else {
        Cow::Owned(x.par_iter().map(|v| v.to_acc()).collect())
    }
}

/// Writes f32 values into `dst` of element type `T`.
fn store<T: Float<Acc = f32>>(dst: &mut [T], src: &[f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = T::from_acc(s);
    }
}

/// `scale · x` for the `rows × dim` row-major `x`, transposed into `dst`
/// (`dim × ld`, zero past `rows`): the right-hand operand of a product
/// whose columns are `x`'s rows. Packed once per task, it is read by every
/// tile of the task.
fn pack_transposed<T: Float<Acc = f32>>(
    x: &[T],
    dim: usize,
    scale: f32,
    dst: &mut [f32],
    ld: usize,
) {
    dst.fill(0.0);
    for (r, row) in x.chunks_exact(dim).enumerate() {
        for (e, v) in row.iter().enumerate() {
            dst[e * ld + r] = scale * v.to_acc();
        }
    }
}

/// What a batch × head's queries see: causal limits and the additive mask.
#[derive(Clone, Copy)]
struct Visibility<'a> {
    causal: bool,
    /// The mask of this batch × head (`[q_len, kv_len]`), if any.
    mask: Option<&'a [f32]>,
    kv_len: usize,
}

impl<'a> Visibility<'a> {
    fn new(
        p: &AttentionParams,
        mask: Option<&AdditiveMask<'a>>,
        s: &AttentionShape,
        b: usize,
    ) -> Self {
        let per = s.q_len * s.kv_len;
        Visibility {
            causal: p.causal,
            mask: mask.map(|m| &m.values[if m.shared { 0 } else { b * per }..][..per]),
            kv_len: s.kv_len,
        }
    }

    /// Of the `cols` keys from `c0`, how many query `i` sees before the
    /// causal cut-off (all of them without `causal`).
    #[inline(always)]
    fn visible(&self, i: usize, c0: usize, cols: usize) -> usize {
        if self.causal {
            (i + 1).saturating_sub(c0).min(cols)
        } else {
            cols
        }
    }

    /// Of the `rows` queries from `r0`, how many come before key `j` becomes
    /// visible (0 without `causal`).
    #[inline(always)]
    fn hidden_before(&self, j: usize, r0: usize, rows: usize) -> usize {
        if self.causal {
            j.saturating_sub(r0).min(rows)
        } else {
            0
        }
    }

    /// The keys visible to some query below `r1`.
    fn kv_end(&self, r1: usize) -> usize {
        if self.causal {
            r1.min(self.kv_len)
        } else {
            self.kv_len
        }
    }
}

// ---------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------

#[allow(clippy::too_many_arguments)]
fn forward_with<T: Float<Acc = f32>>(
    isa: Isa,
    shape: &AttentionShape,
    p: &AttentionParams,
    q: &[T],
    k: &[T],
    v: &[T],
    mask: Option<AdditiveMask>,
    out: &mut [T],
    lse: &mut [f32],
) {
    let s = *shape;
    assert_lens(
        &s,
        &[
            ("q", q.len()),
            ("k", k.len()),
            ("v", v.len()),
            ("out", out.len()),
            ("lse", lse.len()),
        ],
        mask.as_ref(),
    );
    if s.bh * s.q_len == 0 {
        return;
    }
    let (k, v) = (to_f32(k), to_f32(v));
    let ops = ForwardOperands {
        s,
        scale: p.scale,
        q,
        k: &k,
        v: &v,
    };
    // One task per (batch × head, query block): independent rows of out.
    out.par_chunks_mut(s.q_len * s.v_dim)
        .zip(lse.par_chunks_mut(s.q_len))
        .enumerate()
        .for_each(|(b, (out_b, lse_b))| {
            let vis = Visibility::new(p, mask.as_ref(), &s, b);
            out_b
                .par_chunks_mut(BR * s.v_dim)
                .zip(lse_b.par_chunks_mut(BR))
                .enumerate()
                .for_each(|(ib, (out_i, lse_i))| {
                    let mut o = vec![0.0f32; lse_i.len() * s.v_dim];
                    isa.forward_block(&ops, &vis, b, ib * BR, &mut o, lse_i);
                    store(out_i, &o);
                });
        });
}

/// The operands of the forward: `k` and `v` as f32; `q` is packed per task.
struct ForwardOperands<'a, T> {
    s: AttentionShape,
    scale: f32,
    q: &'a [T],
    k: &'a [f32],
    v: &'a [f32],
}

/// One query block's forward: rows `r0..r0 + lse.len()` of batch × head `b`
/// into `o` (f32, `[rows, v_dim]`) and `lse`.
///
/// It works on transposed scores `Sᵀ = K_j (scale · Q_i)ᵀ` (keys × queries):
/// the packed `Qᵀ` is the task's own block, packed once, and K is read in
/// place; the softmax statistics are then per column, which vectorises
/// across queries without horizontal reductions.
#[inline(always)]
unsafe fn forward_block<S: Simd, T: Float<Acc = f32>>(
    ops: &ForwardOperands<T>,
    vis: &Visibility,
    b: usize,
    r0: usize,
    o: &mut [f32],
    lse: &mut [f32],
) {
    let AttentionShape {
        q_len: nq,
        kv_len: nk,
        head_dim: d,
        v_dim: dv,
        ..
    } = ops.s;
    let rows = lse.len();
    let mut qt = vec![0.0f32; d * BR];
    pack_transposed(
        &ops.q[(b * nq + r0) * d..][..rows * d],
        d,
        ops.scale,
        &mut qt,
        BR,
    );
    let mut st = vec![0.0f32; BC * BR];
    let mut stats = ColumnStats::new();
    for c0 in (0..vis.kv_end(r0 + rows)).step_by(BC) {
        let cols = BC.min(nk - c0);
        let st = &mut st[..cols * BR];
        let k = &ops.k[(b * nk + c0) * d..][..cols * d];
        S::gemm(&Gemm::rows(cols, BR, d, k, d, &qt, BR, st, BR, Mode::Set));
        for (j, row) in st.chunks_exact_mut(BR).enumerate() {
            if let Some(mask) = vis.mask {
                let m = &mask[r0 * nk + c0 + j..];
                for (r, x) in row[..rows].iter_mut().enumerate() {
                    *x += m[r * nk];
                }
            }
            row[..vis.hidden_before(c0 + j, r0, rows)].fill(f32::NEG_INFINITY);
        }
        stats.update::<S>(st);
        // O = diag(alpha) O + P V_j, with P = (Sᵀ)ᵀ read by columns.
        let v = &ops.v[(b * nk + c0) * dv..][..cols * dv];
        let alpha = &stats.alpha[..rows];
        S::gemm(&Gemm::cols_of(
            rows,
            dv,
            cols,
            st,
            BR,
            v,
            dv,
            o,
            dv,
            Mode::ScaleAdd(alpha),
        ));
    }
    for (r, o_r) in o.chunks_exact_mut(dv).enumerate() {
        let (max, sum) = (stats.max[r], stats.sum[r]);
        let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
        o_r.iter_mut().for_each(|x| *x *= inv);
        lse[r] = if sum > 0.0 {
            max + sum.ln()
        } else {
            f32::NEG_INFINITY
        };
    }
}

/// The online softmax's running statistics of a query block, one column
/// per query.
struct ColumnStats {
    /// The running max of each query's scores (−inf before any is seen).
    max: [f32; BR],
    /// The running sum of `e^{s − max}`.
    sum: [f32; BR],
    /// The factor `e^{max_old − max_new}` the last update rescaled by.
    alpha: [f32; BR],
    /// The max to subtract: `max`, or 0 where that is −inf (so that hidden
    /// scores give e^{−inf} = 0 rather than NaN).
    shift: [f32; BR],
    /// Per-tile scratch: column sums of the new probabilities.
    tile_sum: [f32; BR],
}

impl ColumnStats {
    fn new() -> Self {
        ColumnStats {
            max: [f32::NEG_INFINITY; BR],
            sum: [0.0; BR],
            alpha: [0.0; BR],
            shift: [0.0; BR],
            tile_sum: [0.0; BR],
        }
    }

    /// Folds in a tile of scaled, masked scores `st` (keys × `BR` queries,
    /// `-inf` where hidden), which it turns into `e^{s − max}`.
    #[inline(always)]
    unsafe fn update<S: Simd>(&mut self, st: &mut [f32]) {
        let l = S::LANES;
        let mut new_max = self.max;
        for row in st.chunks_exact(BR) {
            for v in (0..BR).step_by(l) {
                let m = S::max(
                    S::load(new_max.as_ptr().add(v)),
                    S::load(row.as_ptr().add(v)),
                );
                S::store(new_max.as_mut_ptr().add(v), m);
            }
        }
        for (r, &m) in new_max.iter().enumerate() {
            let shift = if m == f32::NEG_INFINITY { 0.0 } else { m };
            self.alpha[r] = exp_f32(self.max[r] - shift);
            self.shift[r] = shift;
        }
        self.max = new_max;
        self.tile_sum = [0.0; BR];
        for row in st.chunks_exact_mut(BR) {
            for v in (0..BR).step_by(l) {
                let x = row.as_mut_ptr().add(v);
                let p = S::exp(S::sub(S::load(x), S::load(self.shift.as_ptr().add(v))));
                S::store(x, p);
                let acc = self.tile_sum.as_mut_ptr().add(v);
                S::store(acc, S::add(S::load(acc), p));
            }
        }
        for r in 0..BR {
            self.sum[r] = self.sum[r] * self.alpha[r] + self.tile_sum[r];
        }
    }
}

// ---------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------

/// The operands of the backward: `q` and `d_out` as f32; `k` and `v` are
/// packed per key block.
struct BackwardOperands<'a, T> {
    s: AttentionShape,
    scale: f32,
    q: &'a [f32],
    k: &'a [T],
    v: &'a [T],
    d_out: &'a [f32],
    lse: &'a [f32],
    /// `D_i = Σ_d dO_id · O_id` per row.
    delta: &'a [f32],
}

/// Split of the backward: tasks own a run of key blocks of one batch × head
/// and compute their dK, dV rows completely (no sharing), while dQ, which
/// every key block adds to, goes into a per-task f32 accumulator summed at
/// the end. With many batch × heads there is one task per batch × head
/// (accumulating straight into an f32 dq), so nothing is recomputed; with
/// few (bh == 1), the key blocks split into enough tasks to keep every
/// thread busy, at one partial dQ each. The alternative, a second pass over
/// query blocks for dQ, would recompute P and dP: 2 more tile products on
/// top of 5. Returns the key blocks per task.
fn blocks_per_task(bh: usize, key_blocks: usize) -> usize {
    let want_tasks = 4 * rayon::current_num_threads();
    let chunks = want_tasks.div_ceil(bh).clamp(1, key_blocks);
    key_blocks.div_ceil(chunks)
}

#[allow(clippy::too_many_arguments)]
fn backward_with<T: Float<Acc = f32>>(
    isa: Isa,
    shape: &AttentionShape,
    p: &AttentionParams,
    q: &[T],
    k: &[T],
    v: &[T],
    mask: Option<AdditiveMask>,
    out: &[T],
    lse: &[f32],
    d_out: &[T],
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
) {
    let s = *shape;
    assert_lens(
        &s,
        &[
            ("q", q.len()),
            ("k", k.len()),
            ("v", v.len()),
            ("out", out.len()),
            ("lse", lse.len()),
            ("d_out", d_out.len()),
            ("dq", dq.len()),
            ("dk", dk.len()),
            ("dv", dv.len()),
        ],
        mask.as_ref(),
    );
    let zero = T::from_acc(0.0);
    if s.bh * s.q_len * s.kv_len == 0 {
        dq.fill(zero);
        dk.fill(zero);
        dv.fill(zero);
        return;
    }
    let (qf, d_out_f) = (to_f32(q), to_f32(d_out));
    let delta: Vec<f32> = out
        .par_chunks(s.v_dim)
        .zip(d_out.par_chunks(s.v_dim))
        .map(|(o, g)| o.iter().zip(g).map(|(a, b)| a.to_acc() * b.to_acc()).sum())
        .collect();
    let ops = BackwardOperands {
        s,
        scale: p.scale,
        q: &qf,
        k,
        v,
        d_out: &d_out_f,
        lse,
        delta: &delta,
    };
    let key_blocks = s.kv_len.div_ceil(BC);
    let per_task = blocks_per_task(s.bh, key_blocks);
    let chunks = key_blocks.div_ceil(per_task);
    let chunk_keys = per_task * BC;
    let dq_len = s.q_len * s.head_dim;
    // dQ accumulators: dq itself when it is f32 and has one task per batch
    // × head, else f32 partials summed below.
    let direct = chunks == 1 && T::DTYPE == DType::F32;
    let mut parts = Vec::new();
    let acc: &mut [f32] = if direct {
        let dq: &mut [f32] = bytemuck::cast_slice_mut(dq);
        dq.fill(0.0);
        dq
    } else {
        parts.resize(s.bh * chunks * dq_len, 0.0);
        &mut parts
    };
    dk.par_chunks_mut(s.kv_len * s.head_dim)
        .zip(dv.par_chunks_mut(s.kv_len * s.v_dim))
        .zip(acc.par_chunks_mut(chunks * dq_len))
        .enumerate()
        .for_each(|(b, ((dk_b, dv_b), acc_b))| {
            let vis = Visibility::new(p, mask.as_ref(), &s, b);
            dk_b.par_chunks_mut(chunk_keys * s.head_dim)
                .zip(dv_b.par_chunks_mut(chunk_keys * s.v_dim))
                .zip(acc_b.par_chunks_mut(dq_len))
                .enumerate()
                .for_each(|(g, ((dk_g, dv_g), dq_acc))| {
                    let c0 = g * chunk_keys;
                    for (jb, (dk_j, dv_j)) in dk_g
                        .chunks_mut(BC * s.head_dim)
                        .zip(dv_g.chunks_mut(BC * s.v_dim))
                        .enumerate()
                    {
                        isa.backward_block(&ops, &vis, b, c0 + jb * BC, dq_acc, dk_j, dv_j);
                    }
                });
        });
    if !direct {
        dq.par_chunks_mut(dq_len)
            .zip(parts.par_chunks(chunks * dq_len))
            .for_each(|(dq_b, parts)| {
                let mut sum = parts[..dq_len].to_vec();
                for part in parts.chunks_exact(dq_len).skip(1) {
                    sum.iter_mut().zip(part).for_each(|(a, x)| *a += x);
                }
                store(dq_b, &sum);
            });
    }
}

/// One key block's backward: keys `c0..` of batch × head `b` against every
/// query block that sees them; writes their dK and dV rows, adds to dQ.
///
/// Works on scores `S = Q_i (scale · K_j)ᵀ` (queries × keys), so that the
/// packed `Kᵀ` and `Vᵀ` are this block's own, packed once for all query
/// blocks. `dS` is left unscaled: dQ uses `scale · K_j` and dK is scaled
/// once at the end.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn backward_block<S: Simd, T: Float<Acc = f32>>(
    ops: &BackwardOperands<T>,
    vis: &Visibility,
    b: usize,
    c0: usize,
    dq: &mut [f32],
    dk_out: &mut [T],
    dv_out: &mut [T],
) {
    let AttentionShape {
        q_len: nq,
        kv_len: nk,
        head_dim: d,
        v_dim: dv,
        ..
    } = ops.s;
    let cols = BC.min(nk - c0);
    let k = &ops.k[(b * nk + c0) * d..][..cols * d];
    let v = &ops.v[(b * nk + c0) * dv..][..cols * dv];
    let mut kt = vec![0.0f32; d * BC];
    pack_transposed(k, d, ops.scale, &mut kt, BC);
    let mut vt = vec![0.0f32; dv * BC];
    pack_transposed(v, dv, 1.0, &mut vt, BC);
    let k_scaled: Vec<f32> = k.iter().map(|x| ops.scale * x.to_acc()).collect();
    let mut p = vec![0.0f32; BR * BC];
    let mut ds = vec![0.0f32; BR * BC];
    let mut dk = vec![0.0f32; cols * d];
    let mut dv_acc = vec![0.0f32; cols * dv];
    // Causal: rows before c0 see none of these keys.
    let first = if vis.causal { c0 / BR * BR } else { 0 };
    for r0 in (first..nq).step_by(BR) {
        let rows = BR.min(nq - r0);
        let (p, ds) = (&mut p[..rows * BC], &mut ds[..rows * BC]);
        let q = &ops.q[(b * nq + r0) * d..][..rows * d];
        let d_out = &ops.d_out[(b * nq + r0) * dv..][..rows * dv];
        let lse = &ops.lse[b * nq + r0..][..rows];
        let delta = &ops.delta[b * nq + r0..][..rows];
        // P = exp(Q_i (scale K_j)ᵀ + mask − lse)
        S::gemm(&Gemm::rows(rows, BC, d, q, d, &kt, BC, p, BC, Mode::Set));
        for (r, row) in p.chunks_exact_mut(BC).enumerate() {
            let i = r0 + r;
            let seen = vis.visible(i, c0, cols);
            if let Some(mask) = vis.mask {
                let m = &mask[i * nk + c0..][..seen];
                row.iter_mut().zip(m).for_each(|(x, a)| *x += a);
            }
            probabilities_row::<S>(row, seen, lse[r]);
        }
        // dV_j += Pᵀ dO_i
        S::gemm(&Gemm::cols_of(
            cols,
            dv,
            rows,
            p,
            BC,
            d_out,
            dv,
            &mut dv_acc,
            dv,
            Mode::Add,
        ));
        // dS = P ∘ (dO_i V_jᵀ − D)
        S::gemm(&Gemm::rows(
            rows,
            BC,
            dv,
            d_out,
            dv,
            &vt,
            BC,
            ds,
            BC,
            Mode::Set,
        ));
        for ((ds_r, p_r), &dl) in ds.chunks_exact_mut(BC).zip(p.chunks_exact(BC)).zip(delta) {
            softmax_grad_row::<S>(ds_r, p_r, dl);
        }
        // dQ_i += dS (scale K_j); dK_j += dSᵀ Q_i (scaled below)
        let dq_i = &mut dq[r0 * d..][..rows * d];
        S::gemm(&Gemm::rows(
            rows,
            d,
            cols,
            ds,
            BC,
            &k_scaled,
            d,
            dq_i,
            d,
            Mode::Add,
        ));
        S::gemm(&Gemm::cols_of(
            cols,
            d,
            rows,
            ds,
            BC,
            q,
            d,
            &mut dk,
            d,
            Mode::Add,
        ));
    }
    dk.iter_mut().for_each(|x| *x *= ops.scale);
    store(dk_out, &dk);
    store(dv_out, &dv_acc);
}

/// One row of recomputed probabilities: `row` holds `BC` scaled, masked
/// scores, the first `seen` visible; leaves `e^{s − lse}` there and 0 in the
/// rest (everywhere when `lse = -inf`: the row saw no key).
#[inline(always)]
unsafe fn probabilities_row<S: Simd>(row: &mut [f32], seen: usize, lse: f32) {
    if lse == f32::NEG_INFINITY {
        row.fill(0.0);
        return;
    }
    let shift = S::splat(lse);
    for v in (0..BC).step_by(S::LANES) {
        let x = row.as_mut_ptr().add(v);
        S::store(x, S::exp(S::sub(S::load(x), shift)));
    }
    row[seen..].fill(0.0);
}

/// `ds ← p ∘ (ds − delta)`: the softmax's backward on one row of `BC`.
#[inline(always)]
unsafe fn softmax_grad_row<S: Simd>(ds: &mut [f32], p: &[f32], delta: f32) {
    let delta = S::splat(delta);
    for v in (0..BC).step_by(S::LANES) {
        let x = ds.as_mut_ptr().add(v);
        S::store(
            x,
            S::mul(S::load(p.as_ptr().add(v)), S::sub(S::load(x), delta)),
        );
    }
}

// ---------------------------------------------------------------------------
// The tile product for plain matmuls
// ---------------------------------------------------------------------------

/// Whether this machine runs [`tile_product`] with SIMD micro-tiles (AVX2
/// or AVX-512); without, the matmul kernel keeps to the gemm crate.
pub(super) fn simd_tiles() -> bool {
    Isa::detect() != Isa::Portable
}

/// Columns of `B` that [`tile_product`] wants per call: one micro-tile's
/// width (64 with AVX-512, 32 otherwise), so that each row of `A` is read
/// once per panel.
pub(super) fn tile_cols() -> usize {
    match Isa::detect() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => 64,
        _ => 32,
    }
}

/// `C (m × n) = A · B`, or `C += A · B` when `accumulate`, f32, by the
/// micro-kernel of flash attention's tiles, on the best instruction set the
/// machine has. `A[r, kk] = a[r·a_rs + kk·a_cs]` (any strides); `B`'s rows
/// are contiguous, `ldb` apart; `C`'s rows `ldc` apart. It does not pack
/// or block: the caller (`matmul`'s thin path) hands it `B` panels that
/// stay in L1. With AVX-512 the micro-tiles are 6 rows × 4 vectors (24
/// accumulators, 10 loads per 24 FMAs) rather than flash attention's
/// 8 × 2: a matmul's panels are [`tile_cols`] = 64 wide, and the wider
/// tile reads each broadcast of `A` for twice the columns (attention's
/// products at head dim 64 ran 5-30 % faster per core: BENCHMARKS.md at 321f0c1).
#[allow(clippy::too_many_arguments)]
pub(super) fn tile_product(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    (a_rs, a_cs): (usize, usize),
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    let mode = if accumulate { Mode::Add } else { Mode::Set };
    let g = Gemm::checked(m, n, k, a, a_rs, a_cs, b, ldb, c, ldc, mode);
    // SAFETY: `detect` found the instruction set; `checked` bounds-checked
    // the operands against the product's extents.
    unsafe {
        match Isa::detect() {
            Isa::Portable => Portable::gemm(&g),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => x86::gemm_avx2(&g),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => x86::gemm_avx512_wide(&g),
        }
    }
}

// ---------------------------------------------------------------------------
// Instruction sets
// ---------------------------------------------------------------------------

/// The instruction set the kernels run with, detected at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    /// Plain Rust (whatever the build's target vectorises to).
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Every instruction set this machine runs (for the tests).
    #[cfg(test)]
    fn available() -> Vec<Isa> {
        #[allow(unused_mut)]
        let mut all = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                all.push(Isa::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                all.push(Isa::Avx512);
            }
        }
        all
    }

    fn forward_block<T: Float<Acc = f32>>(
        self,
        ops: &ForwardOperands<T>,
        vis: &Visibility,
        b: usize,
        r0: usize,
        o: &mut [f32],
        lse: &mut [f32],
    ) {
        // SAFETY: `detect` (or `available`) found the instruction set.
        unsafe {
            match self {
                Isa::Portable => forward_block::<Portable, T>(ops, vis, b, r0, o, lse),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => x86::forward_block_avx2(ops, vis, b, r0, o, lse),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => x86::forward_block_avx512(ops, vis, b, r0, o, lse),
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_block<T: Float<Acc = f32>>(
        self,
        ops: &BackwardOperands<T>,
        vis: &Visibility,
        b: usize,
        c0: usize,
        dq: &mut [f32],
        dk: &mut [T],
        dv: &mut [T],
    ) {
        // SAFETY: `detect` (or `available`) found the instruction set.
        unsafe {
            match self {
                Isa::Portable => backward_block::<Portable, T>(ops, vis, b, c0, dq, dk, dv),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => x86::backward_block_avx2(ops, vis, b, c0, dq, dk, dv),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => x86::backward_block_avx512(ops, vis, b, c0, dq, dk, dv),
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Tile products
// ---------------------------------------------------------------------------

/// What a product does with the destination `C`.
#[derive(Clone, Copy)]
enum Mode<'a> {
    /// `C = A B`
    Set,
    /// `C += A B`
    Add,
    /// `C = diag(s) C + A B`: the online softmax's rescaling of the output.
    ScaleAdd(&'a [f32]),
}

/// One tile product `C (m × n) ⊕= A (m × k) · B (k × n)`, f32. `A` is read
/// one element at a time (broadcast), so any strides do: `A[r, kk] =
/// a[r·a_rs + kk·a_cs]`. `B` rows and `C` rows are contiguous, `ldb` and `ldc`
/// apart; columns past a multiple of the SIMD width are masked, so `n` is
/// free.
struct Gemm<'a> {
    m: usize,
    n: usize,
    k: usize,
    a: &'a [f32],
    a_rs: usize,
    a_cs: usize,
    b: &'a [f32],
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    mode: Mode<'a>,
}

impl<'a> Gemm<'a> {
    /// `C ⊕= A B` with `A` row-major (`lda` apart).
    #[allow(clippy::too_many_arguments)]
    fn rows(
        m: usize,
        n: usize,
        k: usize,
        a: &'a [f32],
        lda: usize,
        b: &'a [f32],
        ldb: usize,
        c: &'a mut [f32],
        ldc: usize,
        mode: Mode<'a>,
    ) -> Self {
        Self::checked(m, n, k, a, lda, 1, b, ldb, c, ldc, mode)
    }

    /// `C ⊕= Aᵀ B` for a row-major `A` (`k × m`, `lda` apart).
    #[allow(clippy::too_many_arguments)]
    fn cols_of(
        m: usize,
        n: usize,
        k: usize,
        a: &'a [f32],
        lda: usize,
        b: &'a [f32],
        ldb: usize,
        c: &'a mut [f32],
        ldc: usize,
        mode: Mode<'a>,
    ) -> Self {
        Self::checked(m, n, k, a, 1, lda, b, ldb, c, ldc, mode)
    }

    /// Bounds checks once per product, so that the micro-kernel's unchecked
    /// reads and writes stay inside the slices.
    #[allow(clippy::too_many_arguments)]
    fn checked(
        m: usize,
        n: usize,
        k: usize,
        a: &'a [f32],
        a_rs: usize,
        a_cs: usize,
        b: &'a [f32],
        ldb: usize,
        c: &'a mut [f32],
        ldc: usize,
        mode: Mode<'a>,
    ) -> Self {
        let last = |rows: usize, ld: usize, cols: usize| (rows > 0).then(|| (rows - 1) * ld + cols);
        if m > 0 && k > 0 {
            assert!((m - 1) * a_rs + (k - 1) * a_cs < a.len(), "A out of bounds");
        }
        assert!(
            last(k, ldb, n).is_none_or(|e| e <= b.len()),
            "B out of bounds"
        );
        assert!(
            last(m, ldc, n).is_none_or(|e| e <= c.len()),
            "C out of bounds"
        );
        if let Mode::ScaleAdd(s) = mode {
            assert!(s.len() >= m);
        }
        Gemm {
            m,
            n,
            k,
            a,
            a_rs,
            a_cs,
            b,
            ldb,
            c: c.as_mut_ptr(),
            ldc,
            mode,
        }
    }
}

/// The vector operations the micro-kernel needs, per instruction set. All
/// functions are `unsafe`: the caller guarantees the instruction set is
/// present and the pointers valid for `LANES` floats (the masked lanes only,
/// for the masked forms).
trait Simd: Copy {
    const LANES: usize;
    type V: Copy;
    /// Which lanes of a partial vector are live.
    type M: Copy;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    /// The first `n` (< LANES) lanes.
    unsafe fn mask(n: usize) -> Self::M;
    unsafe fn load_masked(p: *const f32, m: Self::M) -> Self::V;
    unsafe fn store_masked(p: *mut f32, v: Self::V, m: Self::M);
    /// `a · b + c`
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// e^x for the softmax's x <= ~0: `fastmath::exp_nonpositive_f32` on
    /// every lane (its vector forms, the same bits; tested there).
    unsafe fn exp(x: Self::V) -> Self::V;
    /// The tile product with this instruction set's micro-tile shape.
    unsafe fn gemm(g: &Gemm);
}

/// `g` by micro-tiles of `MR` rows × `NV` vectors: each keeps its `MR · NV`
/// accumulators in registers through the whole `k` loop. Column panels are
/// the outer loop, so a panel of `B` stays in L1 across all rows of `A`.
#[inline(always)]
unsafe fn gemm_tiled<S: Simd, const MR: usize, const NV: usize>(g: &Gemm) {
    let l = S::LANES;
    let (full, tail) = (g.n / l, g.n % l);
    let mask = S::mask(tail);
    let mut v0 = 0;
    while v0 < full + (tail > 0) as usize {
        let nv = (full + (tail > 0) as usize - v0).min(NV);
        let masked = tail > 0 && v0 + nv > full;
        for r0 in (0..g.m).step_by(MR) {
            let rows = MR.min(g.m - r0);
            let c0 = v0 * l;
            match (nv, masked) {
                (n, false) if n == NV => micro::<S, MR, NV, false>(g, r0, rows, c0, mask),
                (1, false) => micro::<S, MR, 1, false>(g, r0, rows, c0, mask),
                (2, false) => micro::<S, MR, 2, false>(g, r0, rows, c0, mask),
                (3, false) => micro::<S, MR, 3, false>(g, r0, rows, c0, mask),
                (1, true) => micro::<S, MR, 1, true>(g, r0, rows, c0, mask),
                (2, true) => micro::<S, MR, 2, true>(g, r0, rows, c0, mask),
                (3, true) => micro::<S, MR, 3, true>(g, r0, rows, c0, mask),
                (4, true) => micro::<S, MR, 4, true>(g, r0, rows, c0, mask),
                _ => unreachable!("micro-tiles are at most 4 vectors wide"),
            }
        }
        v0 += nv;
    }
}

/// One micro-tile: rows `r0..r0 + rows` (`rows <= MR`) and `NV` vectors of
/// columns from `c0`, the last one masked when `MASKED`. Rows past `rows`
/// repeat the last row's reads and are not stored, so the loop body is the
/// same for every tile.
#[inline(always)]
unsafe fn micro<S: Simd, const MR: usize, const NV: usize, const MASKED: bool>(
    g: &Gemm,
    r0: usize,
    rows: usize,
    c0: usize,
    mask: S::M,
) {
    let l = S::LANES;
    let mut acc = [[S::zero(); NV]; MR];
    let a: [*const f32; MR] =
        std::array::from_fn(|r| g.a.as_ptr().add((r0 + r.min(rows - 1)) * g.a_rs));
    let mut b = g.b.as_ptr().add(c0);
    for kk in 0..g.k {
        let bv: [S::V; NV] = std::array::from_fn(|v| {
            if MASKED && v == NV - 1 {
                S::load_masked(b.add(v * l), mask)
            } else {
                S::load(b.add(v * l))
            }
        });
        let off = kk * g.a_cs;
        for r in 0..MR {
            let x = S::splat(*a[r].add(off));
            for v in 0..NV {
                acc[r][v] = S::fma(x, bv[v], acc[r][v]);
            }
        }
        b = b.add(g.ldb);
    }
    for (r, acc_r) in acc.iter().enumerate().take(rows) {
        let c = g.c.add((r0 + r) * g.ldc + c0);
        for (v, &x) in acc_r.iter().enumerate() {
            let p = c.add(v * l);
            let last = MASKED && v == NV - 1;
            let old = |p| {
                if last {
                    S::load_masked(p, mask)
                } else {
                    S::load(p)
                }
            };
            let y = match g.mode {
                Mode::Set => x,
                Mode::Add => S::add(old(p), x),
                Mode::ScaleAdd(s) => S::fma(old(p), S::splat(s[r0 + r]), x),
            };
            if last {
                S::store_masked(p, y, mask)
            } else {
                S::store(p, y)
            }
        }
    }
}

/// Plain Rust vectors of 8 lanes, for targets without a dedicated path.
#[derive(Clone, Copy)]
struct Portable;

impl Simd for Portable {
    const LANES: usize = 8;
    type V = [f32; 8];
    type M = usize;
    unsafe fn zero() -> Self::V {
        [0.0; 8]
    }
    unsafe fn splat(x: f32) -> Self::V {
        [x; 8]
    }
    unsafe fn load(p: *const f32) -> Self::V {
        p.cast::<[f32; 8]>().read_unaligned()
    }
    unsafe fn store(p: *mut f32, v: Self::V) {
        p.cast::<[f32; 8]>().write_unaligned(v)
    }
    unsafe fn mask(n: usize) -> usize {
        n
    }
    unsafe fn load_masked(p: *const f32, n: usize) -> Self::V {
        std::array::from_fn(|i| if i < n { *p.add(i) } else { 0.0 })
    }
    unsafe fn store_masked(p: *mut f32, v: Self::V, n: usize) {
        std::ptr::copy_nonoverlapping(v.as_ptr(), p, n)
    }
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] + b[i])
    }
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] - b[i])
    }
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] * b[i])
    }
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| if b[i] > a[i] { b[i] } else { a[i] })
    }
    unsafe fn exp(x: Self::V) -> Self::V {
        std::array::from_fn(|i| exp_nonpositive_f32(x[i]))
    }
    unsafe fn gemm(g: &Gemm) {
        gemm_tiled::<Self, 4, 2>(g)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! AVX2 and AVX-512 vectors, and the entry points compiled with those
    //! features enabled (the generic kernels inline into them).

    use super::*;
    use crate::runtime::cpu::fastmath::{avx2, avx512, NONPOSITIVE_EXP_MIN};
    use std::arch::x86_64::*;

    /// 8 lanes; micro-tiles 6 × 2 vectors: 12 accumulators of 16 registers.
    #[derive(Clone, Copy)]
    pub(super) struct Avx2;

    /// 16 lanes; micro-tiles 8 × 2 vectors: 16 accumulators of 32 registers,
    /// 10 loads per 16 FMAs (the FMA ports, not the loads, are the limit).
    #[derive(Clone, Copy)]
    pub(super) struct Avx512;

    impl Simd for Avx2 {
        const LANES: usize = 8;
        type V = __m256;
        type M = __m256i;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            _mm256_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn mask(n: usize) -> __m256i {
            let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lane)
        }
        #[inline(always)]
        unsafe fn load_masked(p: *const f32, m: __m256i) -> __m256 {
            _mm256_maskload_ps(p, m)
        }
        #[inline(always)]
        unsafe fn store_masked(p: *mut f32, v: __m256, m: __m256i) {
            _mm256_maskstore_ps(p, m, v)
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            _mm256_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sub(a: __m256, b: __m256) -> __m256 {
            _mm256_sub_ps(a, b)
        }
        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            _mm256_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn max(a: __m256, b: __m256) -> __m256 {
            _mm256_max_ps(a, b)
        }
        #[inline(always)]
        unsafe fn exp(x: __m256) -> __m256 {
            avx2::exp_nonpositive(x, NONPOSITIVE_EXP_MIN)
        }
        #[inline(always)]
        unsafe fn gemm(g: &Gemm) {
            gemm_avx2(g)
        }
    }

    impl Simd for Avx512 {
        const LANES: usize = 16;
        type V = __m512;
        type M = __mmask16;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            _mm512_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn mask(n: usize) -> __mmask16 {
            ((1u32 << n) - 1) as __mmask16
        }
        #[inline(always)]
        unsafe fn load_masked(p: *const f32, m: __mmask16) -> __m512 {
            _mm512_maskz_loadu_ps(m, p)
        }
        #[inline(always)]
        unsafe fn store_masked(p: *mut f32, v: __m512, m: __mmask16) {
            _mm512_mask_storeu_ps(p, m, v)
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            _mm512_add_ps(a, b)
        }
        #[inline(always)]
        unsafe fn sub(a: __m512, b: __m512) -> __m512 {
            _mm512_sub_ps(a, b)
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
        #[inline(always)]
        unsafe fn max(a: __m512, b: __m512) -> __m512 {
            _mm512_max_ps(a, b)
        }
        #[inline(always)]
        unsafe fn exp(x: __m512) -> __m512 {
            avx512::exp_nonpositive(x, NONPOSITIVE_EXP_MIN)
        }
        #[inline(always)]
        unsafe fn gemm(g: &Gemm) {
            gemm_avx512(g)
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gemm_avx2(g: &Gemm) {
        gemm_tiled::<Avx2, 6, 2>(g)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gemm_avx512(g: &Gemm) {
        gemm_tiled::<Avx512, 8, 2>(g)
    }

    /// The matmul path's AVX-512 tile (see [`super::tile_product`]).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gemm_avx512_wide(g: &Gemm) {
        gemm_tiled::<Avx512, 6, 4>(g)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn forward_block_avx2<T: Float<Acc = f32>>(
        ops: &ForwardOperands<T>,
        vis: &Visibility,
        b: usize,
        r0: usize,
        o: &mut [f32],
        lse: &mut [f32],
    ) {
        forward_block::<Avx2, T>(ops, vis, b, r0, o, lse)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn forward_block_avx512<T: Float<Acc = f32>>(
        ops: &ForwardOperands<T>,
        vis: &Visibility,
        b: usize,
        r0: usize,
        o: &mut [f32],
        lse: &mut [f32],
    ) {
        forward_block::<Avx512, T>(ops, vis, b, r0, o, lse)
    }

    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn backward_block_avx2<T: Float<Acc = f32>>(
        ops: &BackwardOperands<T>,
        vis: &Visibility,
        b: usize,
        c0: usize,
        dq: &mut [f32],
        dk: &mut [T],
        dv: &mut [T],
    ) {
        backward_block::<Avx2, T>(ops, vis, b, c0, dq, dk, dv)
    }

    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn backward_block_avx512<T: Float<Acc = f32>>(
        ops: &BackwardOperands<T>,
        vis: &Visibility,
        b: usize,
        c0: usize,
        dq: &mut [f32],
        dk: &mut [T],
        dv: &mut [T],
    ) {
        backward_block::<Avx512, T>(ops, vis, b, c0, dq, dk, dv)
    }
}

#[cfg(test)]
mod tests {
    //! Values and all three gradients against a plain f64 evaluation of
    //! `softmax(scale · Q Kᵀ + mask) V` and its analytic gradient (itself
    //! checked by central differences), on every instruction set the machine
    //! has.

    use super::*;
    use half::{bf16, f16};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// One test problem, its inputs already rounded to the element type.
    struct Case {
        s: AttentionShape,
        p: AttentionParams,
        q: Vec<f64>,
        k: Vec<f64>,
        v: Vec<f64>,
        d_out: Vec<f64>,
        mask: Option<(Vec<f32>, bool)>,
    }

    /// The f64 results: out, lse, dq, dk, dv.
    struct Grads {
        out: Vec<f64>,
        lse: Vec<f64>,
        dq: Vec<f64>,
        dk: Vec<f64>,
        dv: Vec<f64>,
    }

    impl Case {
        /// Random inputs, scores spread over several units (std ≈ 2) so the
        /// softmax is far from uniform; a mask in [-2, 0] with 10 % `-inf`.
        #[allow(clippy::too_many_arguments)]
        fn new<T: Float<Acc = f32>>(
            s: AttentionShape,
            causal: bool,
            mask: Option<bool>,
            seed: u64,
        ) -> Case {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let mut draw = |n: usize, sd: f64| -> Vec<f64> {
                (0..n)
                    .map(|_| {
                        let x: f64 = rng.sample::<f64, _>(rand_distr::StandardNormal) * sd;
                        T::from_f64(x).to_f64()
                    })
                    .collect()
            };
            let q = draw(s.bh * s.q_len * s.head_dim, 1.5);
            let k = draw(s.bh * s.kv_len * s.head_dim, 1.5);
            let v = draw(s.bh * s.kv_len * s.v_dim, 1.0);
            let d_out = draw(s.bh * s.q_len * s.v_dim, 1.0);
            let mask = mask.map(|shared| {
                let n = if shared { 1 } else { s.bh } * s.q_len * s.kv_len;
                let vals = (0..n)
                    .map(|_| {
                        if rng.random::<f64>() < 0.1 {
                            f32::NEG_INFINITY
                        } else {
                            -2.0 * rng.random::<f32>()
                        }
                    })
                    .collect();
                (vals, shared)
            });
            let scale = 0.8 / (s.head_dim as f32).sqrt();
            Case {
                s,
                p: AttentionParams { causal, scale },
                q,
                k,
                v,
                d_out,
                mask,
            }
        }

        fn mask(&self) -> Option<AdditiveMask<'_>> {
            self.mask.as_ref().map(|(values, shared)| AdditiveMask {
                values,
                shared: *shared,
            })
        }

        /// The scaled, masked scores of row `i` of batch × head `b`
        /// (`-inf` where hidden).
        fn scores(&self, q: &[f64], k: &[f64], b: usize, i: usize) -> Vec<f64> {
            let AttentionShape {
                bh,
                q_len: nq,
                kv_len: nk,
                head_dim: d,
                ..
            } = self.s;
            let _ = bh;
            (0..nk)
                .map(|j| {
                    if self.p.causal && j > i {
                        return f64::NEG_INFINITY;
                    }
                    let dot: f64 = (0..d)
                        .map(|e| q[(b * nq + i) * d + e] * k[(b * nk + j) * d + e])
                        .sum();
                    let m = self.mask.as_ref().map_or(0.0, |(m, shared)| {
                        let mb = if *shared { 0 } else { b };
                        m[(mb * nq + i) * nk + j] as f64
                    });
                    self.p.scale as f64 * dot + m
                })
                .collect()
        }

        /// out and lse from `q`, `k`, `v` in f64.
        fn forward(&self, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<Vec<f64>>) {
            let AttentionShape {
                bh,
                q_len: nq,
                kv_len: nk,
                v_dim: dv,
                ..
            } = self.s;
            let mut out = vec![0.0; bh * nq * dv];
            let mut lse = vec![f64::NEG_INFINITY; bh * nq];
            let mut probs = vec![];
            for b in 0..bh {
                for i in 0..nq {
                    let s = self.scores(q, k, b, i);
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let mut p = vec![0.0; nk];
                    if m > f64::NEG_INFINITY {
                        let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                        for j in 0..nk {
                            p[j] = (s[j] - m).exp() / z;
                            for e in 0..dv {
                                out[(b * nq + i) * dv + e] += p[j] * v[(b * nk + j) * dv + e];
                            }
                        }
                        lse[b * nq + i] = m + z.ln();
                    }
                    probs.push(p);
                }
            }
            (out, lse, probs)
        }

        /// The f64 reference: forward and the analytic gradient of
        /// `Σ d_out ∘ out`.
        fn reference(&self) -> Grads {
            let AttentionShape {
                bh,
                q_len: nq,
                kv_len: nk,
                head_dim: d,
                v_dim: dv,
            } = self.s;
            let (q, k, v, g) = (&self.q, &self.k, &self.v, &self.d_out);
            let (out, lse, probs) = self.forward(q, k, v);
            let (mut dq, mut dk, mut dv_) =
                (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
            let sc = self.p.scale as f64;
            for b in 0..bh {
                for i in 0..nq {
                    let p = &probs[b * nq + i];
                    let g_i = &g[(b * nq + i) * dv..][..dv];
                    let dp: Vec<f64> = (0..nk)
                        .map(|j| (0..dv).map(|e| g_i[e] * v[(b * nk + j) * dv + e]).sum())
                        .collect();
                    let delta: f64 = (0..nk).map(|j| p[j] * dp[j]).sum();
                    for j in 0..nk {
                        let ds = p[j] * (dp[j] - delta);
                        for e in 0..d {
                            dq[(b * nq + i) * d + e] += sc * ds * k[(b * nk + j) * d + e];
                            dk[(b * nk + j) * d + e] += sc * ds * q[(b * nq + i) * d + e];
                        }
                        for e in 0..dv {
                            dv_[(b * nk + j) * dv + e] += p[j] * g_i[e];
                        }
                    }
                }
            }
            Grads {
                out,
                lse,
                dq,
                dk,
                dv: dv_,
            }
        }

        /// The kernels' results with element type `T` on `isa`, as f64.
        fn run<T: Float<Acc = f32>>(&self, isa: Isa) -> Grads {
            let t = |x: &[f64]| x.iter().map(|&v| T::from_f64(v)).collect::<Vec<T>>();
            let (q, k, v, g) = (t(&self.q), t(&self.k), t(&self.v), t(&self.d_out));
            let zero = T::from_f64(0.0);
            let mut out = vec![zero; g.len()];
            let mut lse = vec![0.0f32; self.s.bh * self.s.q_len];
            forward_with(
                isa,
                &self.s,
                &self.p,
                &q,
                &k,
                &v,
                self.mask(),
                &mut out,
                &mut lse,
            );
            let (mut dq, mut dk, mut dv) = (
                vec![zero; q.len()],
                vec![zero; k.len()],
                vec![zero; v.len()],
            );
            backward_with(
                isa,
                &self.s,
                &self.p,
                &q,
                &k,
                &v,
                self.mask(),
                &out,
                &lse,
                &g,
                &mut dq,
                &mut dk,
                &mut dv,
            );
            let f = |x: &[T]| x.iter().map(|v| v.to_f64()).collect::<Vec<f64>>();
            Grads {
                out: f(&out),
                lse: lse.iter().map(|&x| x as f64).collect(),
                dq: f(&dq),
                dk: f(&dk),
                dv: f(&dv),
            }
        }
    }

    /// Asserts `got` is within `tol · max|want|` of `want` everywhere, with
    /// infinities (lse of rows that see nothing) matching exactly.
    fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) -> f64 {
        assert_eq!(got.len(), want.len(), "{what}: length");
        let scale = want
            .iter()
            .filter(|x| x.is_finite())
            .fold(1e-30f64, |m, x| m.max(x.abs()));
        let mut worst = 0.0f64;
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(!g.is_nan(), "{what}[{i}] is NaN (want {w})");
            if w.is_infinite() {
                assert_eq!(g, w, "{what}[{i}]");
                continue;
            }
            worst = worst.max((g - w).abs() / scale);
            assert!(
                (g - w).abs() <= tol * scale,
                "{what}[{i}] = {g}, want {w} (error {:.2e} of max |{what}| {scale:.3}, tolerance {tol:.0e})",
                (g - w).abs() / scale
            );
        }
        worst
    }

    /// Relative tolerances (of each tensor's largest magnitude):
    /// - f32: the kernels round every product to f32 (2^-24 ≈ 6e-8) over
    ///   sums of up to 256 (head dim) and ~300 (keys) terms, and the fast
    ///   exp is within 2 ulp; 2e-5 is ~300 ulp of the largest value, room
    ///   for those sums' worst case, yet 100× below any indexing or masking
    ///   mistake (which moves values by O(1) of the max).
    /// - bf16/f16: the inputs are exact in both computations; what differs
    ///   is the rounding of out, dq, dk, dv to the element type (half an ulp:
    ///   2^-9 for bf16, 2^-12 for f16, relative to each value) and the
    ///   backward's `D = rowsum(dO ∘ out)` taken from the rounded out, as
    ///   PyTorch does. Three ulps of the element type cover both.
    fn tolerance<T: Float<Acc = f32>>() -> f64 {
        match T::DTYPE {
            DType::F32 => 2e-5,
            DType::BF16 => 3.0 * 2f64.powi(-8),
            DType::F16 => 3.0 * 2f64.powi(-11),
            d => unreachable!("{d:?}"),
        }
    }

    fn check<T: Float<Acc = f32>>(case: &Case) {
        let want = case.reference();
        let tol = tolerance::<T>();
        for isa in Isa::available() {
            let got = case.run::<T>(isa);
            let at = |t: &str| format!("{t} ({isa:?}, {:?}, {:?}, {:?})", T::DTYPE, case.s, case.p);
            let worst = [
                assert_close(&at("out"), &got.out, &want.out, tol),
                assert_close(&at("lse"), &got.lse, &want.lse, tol),
                assert_close(&at("dq"), &got.dq, &want.dq, tol),
                assert_close(&at("dk"), &got.dk, &want.dk, tol),
                assert_close(&at("dv"), &got.dv, &want.dv, tol),
            ];
            // Seen with --nocapture: how much of the tolerance is used.
            let worst = worst.map(|w| format!("{w:.1e}")).join(", ");
            eprintln!("{}: worst errors (out, lse, dq, dk, dv) [{worst}]", at(""));
        }
    }

    fn shape(
        bh: usize,
        q_len: usize,
        kv_len: usize,
        head_dim: usize,
        v_dim: usize,
    ) -> AttentionShape {
        AttentionShape {
            bh,
            q_len,
            kv_len,
            head_dim,
            v_dim,
        }
    }

    #[test]
    fn reference_gradient_matches_finite_differences() {
        // The analytic gradient the kernels are checked against, checked
        // itself: central differences of Σ d_out ∘ out (h = 1e-5: error
        // ~h² · |f'''| ≈ 1e-10 and rounding ~1e-16 / h ≈ 1e-11).
        for (causal, mask) in [(false, None), (true, Some(false))] {
            let c = Case::new::<f32>(shape(2, 5, 7, 3, 4), causal, mask, 7);
            let r = c.reference();
            let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
                let (out, _, _) = c.forward(q, k, v);
                out.iter().zip(&c.d_out).map(|(a, b)| a * b).sum()
            };
            let h = 1e-5;
            for which in 0..3 {
                let (base, grad) = match which {
                    0 => (&c.q, &r.dq),
                    1 => (&c.k, &r.dk),
                    _ => (&c.v, &r.dv),
                };
                for idx in 0..base.len() {
                    let at = |dx: f64| {
                        let mut x = base.clone();
                        x[idx] += dx;
                        match which {
                            0 => loss(&x, &c.k, &c.v),
                            1 => loss(&c.q, &x, &c.v),
                            _ => loss(&c.q, &c.k, &x),
                        }
                    };
                    let fd = (at(h) - at(-h)) / (2.0 * h);
                    assert!(
                        (fd - grad[idx]).abs() <= 1e-7 * (1.0 + fd.abs()),
                        "input {which}[{idx}]: finite difference {fd}, analytic {}",
                        grad[idx]
                    );
                }
            }
        }
    }

    #[test]
    fn f32_matches_reference_causal_and_masks() {
        // Odd lengths, not multiples of the blocks; q_len < and > kv_len.
        for (i, s) in [
            shape(3, 37, 53, 16, 16),
            shape(2, 130, 67, 16, 24),
            shape(2, 67, 130, 16, 8),
        ]
        .into_iter()
        .enumerate()
        {
            for causal in [false, true] {
                for mask in [None, Some(true), Some(false)] {
                    check::<f32>(&Case::new::<f32>(s, causal, mask, i as u64));
                }
            }
        }
    }

    #[test]
    fn f32_matches_reference_head_dims() {
        // Head dims across the SIMD widths (1 and 3 are all tail), v_dim
        // independent of head_dim, and bh = 1 with several key blocks (the
        // backward then splits keys over tasks and sums partial dQs).
        for (i, (d, dv)) in [(1, 3), (64, 64), (80, 80), (128, 96), (256, 256), (72, 40)]
            .into_iter()
            .enumerate()
        {
            for causal in [false, true] {
                check::<f32>(&Case::new::<f32>(
                    shape(1, 90, 200, d, dv),
                    causal,
                    None,
                    10 + i as u64,
                ));
            }
        }
    }

    #[test]
    fn half_types_match_reference() {
        for (i, s) in [
            shape(2, 45, 70, 16, 16),
            shape(1, 70, 45, 64, 80),
            shape(1, 33, 33, 256, 128),
        ]
        .into_iter()
        .enumerate()
        {
            for causal in [false, true] {
                let mask = causal.then_some(false);
                check::<bf16>(&Case::new::<bf16>(s, causal, mask, 20 + i as u64));
                check::<f16>(&Case::new::<f16>(s, causal, mask, 30 + i as u64));
            }
        }
    }

    #[test]
    fn rows_that_see_no_key_are_zero_without_nan() {
        // Rows 0, 5 and 64 (a second query block) fully masked; the rest of
        // the mask random. Their out and gradients are 0, lse is -inf; the
        // other rows still match the reference.
        let s = shape(2, 70, 40, 16, 16);
        for causal in [false, true] {
            let mut case = Case::new::<f32>(s, causal, Some(false), 40);
            let (m, _) = case.mask.as_mut().unwrap();
            for b in 0..2 {
                for i in [0, 5, 64] {
                    m[(b * 70 + i) * 40..][..40].fill(f32::NEG_INFINITY);
                }
            }
            check::<f32>(&case);
            let want = case.reference();
            for b in 0..2 {
                for i in [0, 5, 64] {
                    assert_eq!(want.lse[b * 70 + i], f64::NEG_INFINITY);
                }
            }
            for isa in Isa::available() {
                let got = case.run::<f32>(isa);
                for b in 0..2 {
                    for i in [0, 5, 64] {
                        let row = b * 70 + i;
                        assert_eq!(got.lse[row], f64::NEG_INFINITY);
                        assert!(got.out[row * 16..][..16].iter().all(|&x| x == 0.0));
                        assert!(got.dq[row * 16..][..16].iter().all(|&x| x == 0.0));
                    }
                }
            }
        }
        // kv_len = 0: every row sees nothing.
        let s0 = shape(2, 3, 0, 4, 5);
        let (mut out, mut lse) = (vec![1.0f32; 30], vec![0.0f32; 6]);
        let p = AttentionParams {
            causal: false,
            scale: 1.0,
        };
        flash_forward::<f32>(&s0, &p, &[0.0; 24], &[], &[], None, &mut out, &mut lse);
        assert!(out.iter().all(|&x| x == 0.0) && lse.iter().all(|&x| x == f32::NEG_INFINITY));
    }

    #[test]
    fn bad_lengths_are_named() {
        let s = shape(2, 3, 4, 5, 6);
        let e = s
            .check(&[("q", 30), ("k", 41)], None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("k has 41 elements") && e.contains("needs 40"),
            "{e}"
        );
        let m = AdditiveMask {
            values: &[0.0; 13],
            shared: true,
        };
        let e = s.check(&[], Some(&m)).unwrap_err().to_string();
        assert!(
            e.contains("mask has 13 elements") && e.contains("needs 12"),
            "{e}"
        );
    }

    /// Every instruction set with both of its tile shapes.
    fn each_tile(f: &dyn Fn(Isa, bool)) {
        for isa in Isa::available() {
            f(isa, false);
            f(isa, true);
        }
    }

    impl Isa {
        /// The tile product with flash attention's micro-tile, or with the
        /// matmul path's (`wide`, different only with AVX-512).
        fn gemm(self, g: &Gemm, wide: bool) {
            // SAFETY: available() found the instruction set.
            unsafe {
                match self {
                    Isa::Portable => Portable::gemm(g),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => x86::Avx2::gemm(g),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 if wide => x86::gemm_avx512_wide(g),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => x86::Avx512::gemm(g),
                }
            }
        }
    }

    #[test]
    fn tile_products_match_f64() {
        // Sizes around the micro-tile shapes (rows 1..MR+1, columns across
        // full and masked vectors, 8 × 2 and 6 × 4 vectors), both A layouts
        // and all three modes.
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut draw =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random::<f32>() - 0.5).collect() };
        for (m, n, k) in [
            (1, 1, 1),
            (5, 7, 3),
            (9, 17, 33),
            (13, 40, 64),
            (8, 64, 5),
            (7, 70, 9),
            (17, 100, 20),
            (12, 128, 40),
        ] {
            let (a, b, c0, s) = (
                draw(m * k + k * m),
                draw(k * (n + 3)),
                draw(m * (n + 2)),
                draw(m),
            );
            for transposed in [false, true] {
                for mode in [Mode::Set, Mode::Add, Mode::ScaleAdd(&s)] {
                    // A[r, kk] from a row-major m × k (or, transposed, k × m) buffer.
                    let a_at = |r: usize, kk: usize| {
                        if transposed {
                            a[kk * m + r]
                        } else {
                            a[r * k + kk]
                        }
                    };
                    let want: Vec<f64> = (0..m * n)
                        .map(|i| {
                            let (r, col) = (i / n, i % n);
                            let dot: f64 = (0..k)
                                .map(|kk| a_at(r, kk) as f64 * b[kk * (n + 3) + col] as f64)
                                .sum();
                            let old = c0[r * (n + 2) + col] as f64;
                            match mode {
                                Mode::Set => dot,
                                Mode::Add => old + dot,
                                Mode::ScaleAdd(s) => s[r] as f64 * old + dot,
                            }
                        })
                        .collect();
                    each_tile(&|isa, wide| {
                        let mut c = c0.clone();
                        let g = if transposed {
                            Gemm::cols_of(m, n, k, &a, m, &b, n + 3, &mut c, n + 2, mode)
                        } else {
                            Gemm::rows(m, n, k, &a, k, &b, n + 3, &mut c, n + 2, mode)
                        };
                        isa.gemm(&g, wide);
                        for r in 0..m {
                            for col in 0..n + 2 {
                                let (got, i) = (c[r * (n + 2) + col] as f64, r * (n + 2) + col);
                                if col >= n {
                                    // Past n: untouched (the masked stores).
                                    assert_eq!(
                                        got, c0[i] as f64,
                                        "{isa:?} (wide: {wide}) {m}x{n}x{k} wrote past n"
                                    );
                                    continue;
                                }
                                let w = want[r * n + col];
                                assert!(
                                    (got - w).abs() <= 1e-5 * (1.0 + w.abs()),
                                    "{isa:?} (wide: {wide}) {m}x{n}x{k} transposed={transposed}: C[{r},{col}] = {got}, want {w}"
                                );
                            }
                        }
                    });
                }
            }
        }
    }
}
