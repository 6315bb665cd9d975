//! GridSample after ONNX's reference: grid coordinates denormalised per
//! spatial dim, out-of-range coordinates clamped or reflected by the
//! padding mode, then each output a weighted sum of input pixels (one for
//! nearest, 2 per dim for linear, 4 for cubic) fetched with a gather, the
//! padding mode applied to each pixel index. Coordinates and weights in
//! f64.

use tessera::ir::{BinaryOp as B, CompareOp as C, Dim, NodeId, Op, UnaryOp as U};
use tessera::{DType, Result};

use super::elementwise::floor64;
use super::one;
use crate::builder::{Ctx, Val};

/// `x` reflected into `[lo, hi]` by the near border, as the reference's
/// `_gs_reflect` (identity inside).
fn reflect(c: &mut Ctx, x: NodeId, lo: f64, hi: f64) -> Result<NodeId> {
    let rng = hi - lo;
    let side = |c: &mut Ctx, dx: NodeId, near: f64, far: f64, sign: f64| -> Result<NodeId> {
        // n = trunc(dx / rng) (dx ≥ 0 where used), r = dx − n·rng; even n:
        // near + sign·r, odd: far − sign·r.
        let q = c.binary_c(B::Div, dx, rng)?;
        let n = floor64(c, q)?;
        let nr = c.binary_c(B::Mul, n, rng)?;
        let r = c.binary(B::Sub, dx, nr)?;
        let half = c.binary_c(B::Mul, n, 0.5)?;
        let fh = floor64(c, half)?;
        let twice = c.binary_c(B::Mul, fh, 2.0)?;
        let even = c.compare(C::Eq, twice, n)?;
        let sr = c.binary_c(B::Mul, r, sign)?;
        let a = c.binary_c(B::Add, sr, near)?;
        let nsr = c.unary(U::Neg, sr)?;
        let b = c.binary_c(B::Add, nsr, far)?;
        c.where_(even, a, b)
    };
    let lo_c = c.scalar(lo, DType::F64)?;
    let below_dx = c.binary(B::Sub, lo_c, x)?;
    let below = side(c, below_dx, lo, hi, 1.0)?;
    let above_dx = c.binary_c(B::Sub, x, hi)?;
    let above = side(c, above_dx, hi, lo, -1.0)?;
    let is_below = c.compare_c(C::Lt, x, lo)?;
    let is_above = c.compare_c(C::Gt, x, hi)?;
    let y = c.where_(is_above, above, x)?;
    c.where_(is_below, below, y)
}

fn clamp(c: &mut Ctx, x: NodeId, lo: f64, hi: f64) -> Result<NodeId> {
    let y = c.binary_c(B::Maximum, x, lo)?;
    c.binary_c(B::Minimum, y, hi)
}

/// Round half to even (`np.rint`).
fn rint(c: &mut Ctx, x: NodeId) -> Result<NodeId> {
    let h = c.binary_c(B::Add, x, 0.5)?;
    let r = floor64(c, h)?;
    let d = c.binary(B::Sub, r, x)?;
    let tie = c.compare_c(C::Eq, d, 0.5)?;
    let half = c.binary_c(B::Mul, r, 0.5)?;
    let fh = floor64(c, half)?;
    let twice = c.binary_c(B::Mul, fh, 2.0)?;
    let odd = c.compare(C::Ne, twice, r)?;
    let fix = c.where_(tie, odd, tie)?;
    let r1 = c.binary_c(B::Sub, r, 1.0)?;
    c.where_(fix, r1, r)
}

/// Truncation toward zero of a float tensor.
fn trunc(c: &mut Ctx, x: NodeId) -> Result<NodeId> {
    let i = c.cast(x, DType::I64)?;
    c.cast(i, DType::F64)
}

/// One tap of one dim: a pixel index (integral f64, after the padding
/// mode) and its weight; `valid` false where zeros padding reads nothing.
struct Tap {
    index: NodeId,
    weight: NodeId,
    valid: Option<NodeId>,
}

pub(super) fn grid_sample(c: &mut Ctx) -> Result<Vec<Val>> {
    let (x, grid) = (c.x(0)?, c.x(1)?);
    let xd = c.concrete(x, "GridSample")?;
    let gd = c.concrete(grid, "GridSample")?;
    if xd.len() < 3 {
        return Err(c.bad(format!("needs [N, C, D…], got {}", c.ty(x))));
    }
    let k = xd.len() - 2;
    if gd.len() != k + 2 || gd[k + 1] != k || gd[0] != xd[0] {
        return Err(c.bad(format!("input {:?} and grid {:?}", xd, gd)));
    }
    let mode = match c
        .attr_s("mode", if c.opset >= 20 { "linear" } else { "bilinear" })
        .as_str()
    {
        "bilinear" | "linear" => "linear",
        "nearest" => "nearest",
        "bicubic" | "cubic" => "cubic",
        other => return Err(c.bad(format!("mode `{other}`"))),
    };
    let padding = c.attr_s("padding_mode", "zeros");
    let align = c.attr_i("align_corners", 0) != 0;
    let (n, ch) = (xd[0], xd[1]);
    let dims = &xd[2..];
    let points: usize = gd[1..=k].iter().product();
    let g = c.cast(grid, DType::F64)?;
    let g = c.reshape(g, vec![Dim::Const(n), Dim::Const(points), Dim::Const(k)])?;
    // Per spatial dim i (the grid lists them last first): its taps.
    let mut per_dim: Vec<Vec<Tap>> = Vec::new();
    for (i, &len) in dims.iter().enumerate() {
        let col = c.slice(g, 2, k - 1 - i, k - i, 1)?;
        let col = c.reshape(col, vec![Dim::Const(n), Dim::Const(points)])?;
        let lenf = len as f64;
        let p1 = c.binary_c(B::Add, col, 1.0)?;
        let mut xc = if align {
            c.binary_c(B::Mul, p1, 0.5 * (lenf - 1.0))?
        } else {
            let t = c.binary_c(B::Mul, p1, lenf)?;
            let t = c.binary_c(B::Sub, t, 1.0)?;
            c.binary_c(B::Mul, t, 0.5)?
        };
        if mode == "nearest" {
            xc = rint(c, xc)?;
        }
        let (lo, hi) = if align {
            (0.0, lenf - 1.0)
        } else {
            (-0.5, lenf - 0.5)
        };
        xc = match padding.as_str() {
            "border" => clamp(c, xc, 0.0, lenf - 1.0)?,
            "reflection" => reflect(c, xc, lo, hi)?,
            _ => xc,
        };
        // The taps: offsets from floor(x) and their weights.
        let (base, offs, weights): (NodeId, Vec<i64>, Vec<NodeId>) = match mode {
            "nearest" => {
                let b = trunc(c, xc)?;
                let one_ = c.scalar(1.0, DType::F64)?;
                let w = c.expand(one_, c.dims(b))?;
                (b, vec![0], vec![w])
            }
            "linear" => {
                let f = floor64(c, xc)?;
                let t = c.binary(B::Sub, xc, f)?;
                let one_ = c.scalar(1.0, DType::F64)?;
                let w0 = c.binary(B::Sub, one_, t)?;
                (f, vec![0, 1], vec![w0, t])
            }
            _ => {
                let f = floor64(c, xc)?;
                let t = c.binary(B::Sub, xc, f)?;
                let a = -0.75;
                // Keys' cubic coefficients at distances t+1, t, 1−t, 2−t.
                let cubic_far = |c: &mut Ctx, d: NodeId| -> Result<NodeId> {
                    // ((a·d − 5a)·d + 8a)·d − 4a
                    let e = c.binary_c(B::Mul, d, a)?;
                    let e = c.binary_c(B::Sub, e, 5.0 * a)?;
                    let e = c.binary(B::Mul, e, d)?;
                    let e = c.binary_c(B::Add, e, 8.0 * a)?;
                    let e = c.binary(B::Mul, e, d)?;
                    c.binary_c(B::Sub, e, 4.0 * a)
                };
                let cubic_near = |c: &mut Ctx, d: NodeId| -> Result<NodeId> {
                    // ((a+2)·d − (a+3))·d·d + 1
                    let e = c.binary_c(B::Mul, d, a + 2.0)?;
                    let e = c.binary_c(B::Sub, e, a + 3.0)?;
                    let e = c.binary(B::Mul, e, d)?;
                    let e = c.binary(B::Mul, e, d)?;
                    c.binary_c(B::Add, e, 1.0)
                };
                let one_ = c.scalar(1.0, DType::F64)?;
                let two = c.scalar(2.0, DType::F64)?;
                let t1 = c.binary_c(B::Add, t, 1.0)?;
                let m1 = c.binary(B::Sub, one_, t)?;
                let m2 = c.binary(B::Sub, two, t)?;
                let w0 = cubic_far(c, t1)?;
                let w1 = cubic_near(c, t)?;
                let w2 = cubic_near(c, m1)?;
                let w3 = cubic_far(c, m2)?;
                (f, vec![-1, 0, 1, 2], vec![w0, w1, w2, w3])
            }
        };
        let mut taps = Vec::new();
        for (off, w) in offs.into_iter().zip(weights) {
            let i = c.binary_c(B::Add, base, off as f64)?;
            let (index, valid) = match padding.as_str() {
                "border" => (clamp(c, i, 0.0, lenf - 1.0)?, None),
                "reflection" => {
                    let r = reflect(c, i, lo, hi)?;
                    (trunc(c, r)?, None)
                }
                _ => {
                    let ge = c.compare_c(C::Ge, i, 0.0)?;
                    let lt = c.compare_c(C::Lt, i, lenf)?;
                    let ok = c.where_(ge, lt, ge)?;
                    (clamp(c, i, 0.0, lenf - 1.0)?, Some(ok))
                }
            };
            taps.push(Tap {
                index,
                weight: w,
                valid,
            });
        }
        per_dim.push(taps);
    }
    // Every combination of taps: the flat pixel index and the weight.
    let total: usize = dims.iter().product();
    let xf = c.reshape(x, vec![Dim::Const(n), Dim::Const(ch), Dim::Const(total)])?;
    let dtype = c.dtype(x);
    let mut acc: Option<NodeId> = None;
    let counts: Vec<usize> = per_dim.iter().map(|t| t.len()).collect();
    let combos: usize = counts.iter().product();
    for combo in 0..combos {
        let mut rem = combo;
        let mut flat: Option<NodeId> = None;
        let mut weight: Option<NodeId> = None;
        let mut stride = total;
        for (i, taps) in per_dim.iter().enumerate() {
            let t = &taps[rem % counts[i]];
            rem /= counts[i];
            stride /= dims[i];
            let term = c.binary_c(B::Mul, t.index, stride as f64)?;
            flat = Some(match flat {
                Some(f) => c.binary(B::Add, f, term)?,
                None => term,
            });
            let mut w = t.weight;
            if let Some(v) = t.valid {
                let zero = c.scalar(0.0, DType::F64)?;
                w = c.where_(v, w, zero)?;
            }
            weight = Some(match weight {
                Some(a) => c.binary(B::Mul, a, w)?,
                None => w,
            });
        }
        let flat = c.cast(flat.expect("k ≥ 1"), DType::I64)?;
        let flat = c.unsqueeze(flat, 1)?;
        let flat = c.expand(
            flat,
            vec![Dim::Const(n), Dim::Const(ch), Dim::Const(points)],
        )?;
        let flat = c.add(Op::Contiguous, &[flat])?;
        let picked = c.add(Op::Gather { dim: 2 }, &[xf, flat])?;
        let picked = c.cast(picked, DType::F64)?;
        let w = c.unsqueeze(weight.expect("k ≥ 1"), 1)?;
        let term = c.binary(B::Mul, picked, w)?;
        acc = Some(match acc {
            Some(a) => c.binary(B::Add, a, term)?,
            None => term,
        });
    }
    let mut out = vec![Dim::Const(n), Dim::Const(ch)];
    out.extend(gd[1..=k].iter().map(|&v| Dim::Const(v)));
    let y = c.reshape(acc.expect("at least one tap"), out)?;
    one(c.cast(y, dtype)?)
}
