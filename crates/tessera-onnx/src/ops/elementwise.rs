//! Elementwise ops: arithmetic, comparisons and logic, activations, casts.
//! Ops tessera has no primitive for are exact decompositions (`Floor`
//! through an integer cast, guarded where the float is already integral),
//! computed in f64 where the decomposition would cancel digits in the
//! input's precision, or accurate to a few ulp in the input's type (`Erf`:
//! a series near 0, the exact gelu elsewhere).

use tessera::ir::{BinaryOp as B, CompareOp as C, NodeId, Op, Scalar, UnaryOp as U};
use tessera::DType;
use tessera::Result;

use super::{one, Converter};
use crate::builder::{Ctx, Val};

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "Abs" => |c| unary(c, U::Abs),
        "Neg" => |c| unary(c, U::Neg),
        "Exp" => |c| unary(c, U::Exp),
        "Log" => |c| unary(c, U::Log),
        "Sqrt" => |c| unary(c, U::Sqrt),
        "Reciprocal" => |c| unary(c, U::Reciprocal),
        "Sin" => |c| unary(c, U::Sin),
        "Cos" => |c| unary(c, U::Cos),
        "Tanh" => |c| unary(c, U::Tanh),
        "Sigmoid" => |c| unary(c, U::Sigmoid),
        "Relu" => |c| unary(c, U::Relu),
        "Atan" => |c| unary(c, U::Atan),
        "Asin" => |c| unary(c, U::Asin),
        "Acos" => |c| unary(c, U::Acos),
        "BitwiseNot" => |c| unary(c, U::BitNot),
        "BitwiseAnd" => |c| binary(c, B::BitAnd),
        "BitwiseOr" => |c| binary(c, B::BitOr),
        "BitwiseXor" => |c| binary(c, B::BitXor),
        "BitShift" => bit_shift,
        "Tan" => tan,
        "Sinh" => |c| hyperbolic(c, false),
        "Cosh" => |c| hyperbolic(c, true),
        "Asinh" => asinh,
        "Acosh" => acosh,
        "Atanh" => atanh,
        "Erf" => erf_op,
        "Floor" => |c| rounding(c, Rounding::Floor),
        "Ceil" => |c| rounding(c, Rounding::Ceil),
        "Round" => |c| rounding(c, Rounding::Even),
        "Sign" => sign,
        "IsNaN" => is_nan,
        "IsInf" => is_inf,
        "Not" => not,
        "And" => |c| logic(c, "and"),
        "Or" => |c| logic(c, "or"),
        "Xor" => |c| logic(c, "xor"),
        "Add" => |c| binary(c, B::Add),
        "Sub" => |c| binary(c, B::Sub),
        "Mul" => |c| binary(c, B::Mul),
        "Div" => |c| binary(c, B::Div),
        "Pow" => pow,
        "Mod" => modulo,
        "Max" => |c| variadic(c, Some(B::Maximum), false),
        "Min" => |c| variadic(c, Some(B::Minimum), false),
        "Sum" => |c| variadic(c, Some(B::Add), false),
        "Mean" => |c| variadic(c, Some(B::Add), true),
        "Equal" => |c| compare(c, C::Eq),
        "Less" => |c| compare(c, C::Lt),
        "LessOrEqual" => |c| compare(c, C::Le),
        "Greater" => |c| compare(c, C::Gt),
        "GreaterOrEqual" => |c| compare(c, C::Ge),
        "Where" => where_op,
        "LeakyRelu" => leaky_relu,
        "PRelu" => prelu,
        "Elu" => elu,
        "Selu" => selu,
        "Celu" => celu,
        "ThresholdedRelu" => thresholded_relu,
        "HardSigmoid" => hard_sigmoid,
        "HardSwish" => hard_swish,
        "Softplus" => softplus_op,
        "Softsign" => softsign,
        "Mish" => mish,
        "Gelu" => gelu,
        "Swish" => swish,
        "Shrink" => shrink,
        "Clip" => clip,
        "Identity" => identity,
        "Dropout" => dropout,
        "Cast" => cast,
        "CastLike" => cast_like,
        "BitCast" => bitcast,
        _ => return None,
    })
}

/// Applies a decomposition `f` to input 0 in f32 when it is f16 or bf16
/// (one rounding at the end, as the op itself would), in its own dtype
/// otherwise.
fn in_f32(c: &mut Ctx, f: impl FnOnce(&mut Ctx, NodeId) -> Result<NodeId>) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let dtype = c.dtype(x);
    let wide = if matches!(dtype, DType::F16 | DType::BF16) {
        c.cast(x, DType::F32)?
    } else {
        x
    };
    let y = f(c, wide)?;
    one(c.cast(y, dtype)?)
}

fn unary(c: &mut Ctx, op: U) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    one(c.unary(op, x)?)
}

/// BitShift: `direction` LEFT or RIGHT (the unsigned types: logical).
fn bit_shift(c: &mut Ctx) -> Result<Vec<Val>> {
    let op = match c.attr_s("direction", "").as_str() {
        "LEFT" => B::Shl,
        "RIGHT" => B::Shr,
        other => return Err(c.bad(format!("direction `{other}` (expected LEFT or RIGHT)"))),
    };
    binary(c, op)
}

fn tan(c: &mut Ctx) -> Result<Vec<Val>> {
    in_f32(c, |c, x| {
        let (s, co) = (c.unary(U::Sin, x)?, c.unary(U::Cos, x)?);
        c.binary(B::Div, s, co)
    })
}

/// sinh = (eˣ − e⁻ˣ)/2, cosh = (eˣ + e⁻ˣ)/2.
fn hyperbolic(c: &mut Ctx, cosh: bool) -> Result<Vec<Val>> {
    in_f32(c, |c, x| {
        let e = c.unary(U::Exp, x)?;
        let nx = c.unary(U::Neg, x)?;
        let en = c.unary(U::Exp, nx)?;
        let s = c.binary(if cosh { B::Add } else { B::Sub }, e, en)?;
        c.binary_c(B::Mul, s, 0.5)
    })
}

/// asinh x = sign(x)·ln(|x| + √(x² + 1)) (odd, so no cancellation for x < 0).
fn asinh(c: &mut Ctx) -> Result<Vec<Val>> {
    in_f32(c, |c, x| {
        let a = c.unary(U::Abs, x)?;
        let sq = c.binary(B::Mul, a, a)?;
        let p1 = c.binary_c(B::Add, sq, 1.0)?;
        let r = c.unary(U::Sqrt, p1)?;
        let s = c.binary(B::Add, a, r)?;
        let l = c.unary(U::Log, s)?;
        let neg = c.compare_c(C::Lt, x, 0.0)?;
        let nl = c.unary(U::Neg, l)?;
        c.where_(neg, nl, l)
    })
}

/// acosh x = ln(x + √(x² − 1)).
fn acosh(c: &mut Ctx) -> Result<Vec<Val>> {
    in_f32(c, |c, x| {
        let sq = c.binary(B::Mul, x, x)?;
        let m1 = c.binary_c(B::Sub, sq, 1.0)?;
        let r = c.unary(U::Sqrt, m1)?;
        let s = c.binary(B::Add, x, r)?;
        c.unary(U::Log, s)
    })
}

/// atanh x = ½·ln((1 + x)/(1 − x)).
fn atanh(c: &mut Ctx) -> Result<Vec<Val>> {
    in_f32(c, |c, x| {
        let one_ = c.scalar_like(1.0, x)?;
        let p = c.binary(B::Add, one_, x)?;
        let m = c.binary(B::Sub, one_, x)?;
        let q = c.binary(B::Div, p, m)?;
        let l = c.unary(U::Log, q)?;
        c.binary_c(B::Mul, l, 0.5)
    })
}

fn float_input(c: &mut Ctx) -> Result<NodeId> {
    let x = c.x(0)?;
    if !c.dtype(x).is_float() {
        return Err(c.bad(format!("needs a float input, got {}", c.ty(x))));
    }
    Ok(x)
}

/// erf y in the input's float type (f32 for half types), accurate to a few
/// ulp: below |y| = ½ its Maclaurin series (8 terms in f32, 14 in f64:
/// the first omitted term is under the type's rounding), above it
/// 2·Φ(y√2) − 1 with Φ(z) = gelu(z)/z (tessera's exact gelu is z·Φ(z)),
/// where the subtraction loses at most two bits. NaN stays NaN and ±∞
/// gives ±1 (the large branch reads |y| clamped to 10).
pub(super) fn erf(c: &mut Ctx, y: NodeId) -> Result<NodeId> {
    let dtype = c.dtype(y);
    let wide = if matches!(dtype, DType::F16 | DType::BF16) {
        DType::F32
    } else {
        dtype
    };
    let y = c.cast(y, wide)?;
    // Σ aₙ·y^(2n+1), aₙ = (−1)ⁿ·2/√π / (n!·(2n+1)), by Horner in y².
    let terms = if wide == DType::F64 { 14 } else { 8 };
    let coeff = |n: usize| {
        let fact: f64 = (1..=n).map(|k| k as f64).product();
        let sign = if n.is_multiple_of(2) { 1.0 } else { -1.0 };
        sign * std::f64::consts::FRAC_2_SQRT_PI / (fact * (2 * n + 1) as f64)
    };
    let y2 = c.binary(B::Mul, y, y)?;
    let mut p = c.scalar(coeff(terms - 1), wide)?;
    for n in (0..terms - 1).rev() {
        p = c.binary(B::Mul, p, y2)?;
        p = c.binary_c(B::Add, p, coeff(n))?;
    }
    let small = c.binary(B::Mul, p, y)?;
    let clamped = c.binary_c(B::Maximum, y, -10.0)?;
    let clamped = c.binary_c(B::Minimum, clamped, 10.0)?;
    let z = c.binary_c(B::Mul, clamped, std::f64::consts::SQRT_2)?;
    let g = c.unary(U::Gelu, z)?;
    let phi = c.binary(B::Div, g, z)?;
    let two_phi = c.binary_c(B::Mul, phi, 2.0)?;
    let large = c.binary_c(B::Sub, two_phi, 1.0)?;
    let a = c.unary(U::Abs, y)?;
    let is_small = c.compare_c(C::Lt, a, 0.5)?;
    let out = c.where_(is_small, small, large)?;
    let nan = c.compare(C::Ne, y, y)?;
    let out = c.where_(nan, y, out)?;
    c.cast(out, dtype)
}

fn erf_op(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = float_input(c)?;
    one(erf(c, x)?)
}

#[derive(Clone, Copy)]
enum Rounding {
    Floor,
    Ceil,
    Even,
}

/// floor x in f64: trunc(x) through an i64 cast, less one where that went
/// up; values of magnitude ≥ 2⁵² (integers already), infinities and NaN
/// pass through.
pub(super) fn floor64(c: &mut Ctx, x: NodeId) -> Result<NodeId> {
    let i = c.cast(x, DType::I64)?;
    let t = c.cast(i, DType::F64)?;
    let up = c.compare(C::Lt, x, t)?;
    let upf = c.cast(up, DType::F64)?;
    let fl = c.binary(B::Sub, t, upf)?;
    let a = c.unary(U::Abs, x)?;
    let small = c.compare_c(C::Lt, a, 4503599627370496.0)?;
    c.where_(small, fl, x)
}

fn rounding(c: &mut Ctx, mode: Rounding) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let dtype = c.dtype(x);
    if !dtype.is_float() {
        return one(x);
    }
    let x64 = c.cast(x, DType::F64)?;
    let r = match mode {
        Rounding::Floor => floor64(c, x64)?,
        Rounding::Ceil => {
            let n = c.unary(U::Neg, x64)?;
            let f = floor64(c, n)?;
            c.unary(U::Neg, f)?
        }
        Rounding::Even => round_even64(c, x64)?,
    };
    one(c.cast(r, dtype)?)
}

/// x (f64) rounded to the nearest integer, ties to even (numpy's `rint`):
/// floor(x + ½), one less at a tie that lands on an odd number.
pub(super) fn round_even64(c: &mut Ctx, x64: NodeId) -> Result<NodeId> {
    let h = c.binary_c(B::Add, x64, 0.5)?;
    let r = floor64(c, h)?;
    let d = c.binary(B::Sub, r, x64)?;
    let tie = c.compare_c(C::Eq, d, 0.5)?;
    let half = c.binary_c(B::Mul, r, 0.5)?;
    let fh = floor64(c, half)?;
    let twice = c.binary_c(B::Mul, fh, 2.0)?;
    let odd = c.compare(C::Ne, twice, r)?;
    let fix = c.where_(tie, odd, tie)?;
    let r1 = c.binary_c(B::Sub, r, 1.0)?;
    c.where_(fix, r1, r)
}

fn sign(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let pos = c.compare_c(C::Gt, x, 0.0)?;
    let neg = c.compare_c(C::Lt, x, 0.0)?;
    let p1 = c.scalar_like(1.0, x)?;
    let m1 = c.scalar_like(-1.0, x)?;
    // Zero and NaN are their own sign.
    let inner = c.where_(neg, m1, x)?;
    one(c.where_(pos, p1, inner)?)
}

fn is_nan(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = float_input(c)?;
    one(c.compare(C::Ne, x, x)?)
}

fn is_inf(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = float_input(c)?;
    let (pos, neg) = (
        c.attr_i("detect_positive", 1),
        c.attr_i("detect_negative", 1),
    );
    let p = c.compare_c(C::Eq, x, f64::INFINITY)?;
    let n = c.compare_c(C::Eq, x, f64::NEG_INFINITY)?;
    let f = c.scalar(0.0, DType::Bool)?;
    one(match (pos != 0, neg != 0) {
        (true, true) => c.where_(p, p, n)?,
        (true, false) => p,
        (false, true) => n,
        (false, false) => {
            let t = c.where_(p, f, f)?;
            c.where_(n, f, t)?
        }
    })
}

fn not(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let f = c.scalar(0.0, DType::Bool)?;
    one(c.compare(C::Eq, x, f)?)
}

fn logic(c: &mut Ctx, op: &str) -> Result<Vec<Val>> {
    let (a, b) = (c.x(0)?, c.x(1)?);
    one(match op {
        "and" => {
            let f = c.scalar(0.0, DType::Bool)?;
            c.where_(a, b, f)?
        }
        "or" => {
            let t = c.scalar(1.0, DType::Bool)?;
            c.where_(a, t, b)?
        }
        _ => c.compare(C::Ne, a, b)?,
    })
}

/// Before opset 7, `broadcast = 1` stretches B over A with B's dims
/// aligned at A's dim `axis` (trailing when absent); NumPy broadcasting
/// after.
pub(super) fn legacy_broadcast(c: &mut Ctx, a: NodeId, b: NodeId) -> Result<NodeId> {
    if c.opset >= 7 || c.attr_i("broadcast", 0) == 0 {
        return Ok(b);
    }
    let (ra, rb) = (c.rank(a), c.rank(b));
    let Some(axis) = c.attr("axis").map(|a| a.i) else {
        return Ok(b);
    };
    let axis = c.axis(axis, ra)?;
    if axis + rb > ra {
        return Err(c.bad(format!(
            "cannot broadcast {} over {} at axis {axis}",
            c.ty(b),
            c.ty(a)
        )));
    }
    let mut dims = c.dims(b);
    dims.extend(std::iter::repeat_n(
        tessera::ir::Dim::Const(1),
        ra - axis - rb,
    ));
    c.reshape(b, dims)
}

fn binary(c: &mut Ctx, op: B) -> Result<Vec<Val>> {
    if let Some(v) = super::shape::dims_arith(c, op)? {
        return Ok(vec![v]);
    }
    let (a, b) = (c.x(0)?, c.x(1)?);
    let b = legacy_broadcast(c, a, b)?;
    // Integer division rounds toward zero in tessera and in ONNX's
    // reference (numpy's floor division differs only for negative
    // operands, which ONNX leaves to the backend: truncation, as C does).
    one(c.binary(op, a, b)?)
}

/// Pow: the exponent cast to the base's type; integer powers computed in
/// f64 and rounded back.
fn pow(c: &mut Ctx) -> Result<Vec<Val>> {
    let (a, b) = (c.x(0)?, c.x(1)?);
    let b = legacy_broadcast(c, a, b)?;
    let dtype = c.dtype(a);
    if dtype.is_float() {
        let b = c.cast(b, dtype)?;
        return one(c.binary(B::Pow, a, b)?);
    }
    let a64 = c.cast(a, DType::F64)?;
    let b64 = c.cast(b, DType::F64)?;
    let p = c.binary(B::Pow, a64, b64)?;
    let h = c.binary_c(B::Add, p, 0.5)?;
    let r = floor64(c, h)?;
    one(c.cast(r, dtype)?)
}

/// Mod: `fmod = 1` is C's fmod (the sign of the dividend), else the sign
/// of the divisor (Python's %).
fn modulo(c: &mut Ctx) -> Result<Vec<Val>> {
    let (a, b) = (c.x(0)?, c.x(1)?);
    let dtype = c.dtype(a);
    let fmod = c.attr_i("fmod", 0) != 0;
    if dtype.is_float() {
        // C's fmod through a truncated quotient (an infinite divisor
        // leaves a finite dividend as it is), then, for fmod = 0, the
        // sign of the divisor as numpy's % (ONNX 28 allows it for floats).
        let (a64, b64) = (c.cast(a, DType::F64)?, c.cast(b, DType::F64)?);
        let q = c.binary(B::Div, a64, b64)?;
        let fl = floor64(c, q)?;
        let nq = c.unary(U::Neg, q)?;
        let nfl = floor64(c, nq)?;
        let ce = c.unary(U::Neg, nfl)?;
        let pos = c.compare_c(C::Ge, q, 0.0)?;
        let t = c.where_(pos, fl, ce)?;
        let tb = c.binary(B::Mul, t, b64)?;
        let r = c.binary(B::Sub, a64, tb)?;
        let ab = c.unary(U::Abs, b64)?;
        let b_inf = c.compare_c(C::Eq, ab, f64::INFINITY)?;
        let aa = c.unary(U::Abs, a64)?;
        let a_fin = c.compare_c(C::Lt, aa, f64::INFINITY)?;
        let f = c.scalar(0.0, DType::Bool)?;
        let keep_a = c.where_(b_inf, a_fin, f)?;
        let mut r = c.where_(keep_a, a64, r)?;
        if !fmod {
            let nz = c.compare_c(C::Ne, r, 0.0)?;
            let rn = c.compare_c(C::Lt, r, 0.0)?;
            let bn = c.compare_c(C::Lt, b64, 0.0)?;
            let differ = c.compare(C::Ne, rn, bn)?;
            let fix = c.where_(nz, differ, f)?;
            let rb = c.binary(B::Add, r, b64)?;
            r = c.where_(fix, rb, r)?;
        }
        return one(c.cast(r, dtype)?);
    }
    let q = c.binary(B::Div, a, b)?;
    let qb = c.binary(B::Mul, q, b)?;
    let r = c.binary(B::Sub, a, qb)?;
    if fmod {
        return one(r);
    }
    let nz = c.compare_c(C::Ne, r, 0.0)?;
    let rn = c.compare_c(C::Lt, r, 0.0)?;
    let bn = c.compare_c(C::Lt, b, 0.0)?;
    let differ = c.compare(C::Ne, rn, bn)?;
    let f = c.scalar(0.0, DType::Bool)?;
    let fix = c.where_(nz, differ, f)?;
    let rb = c.binary(B::Add, r, b)?;
    one(c.where_(fix, rb, r)?)
}

fn variadic(c: &mut Ctx, op: Option<B>, mean: bool) -> Result<Vec<Val>> {
    let n = c.node.input.len();
    let mut acc = c.x(0)?;
    for i in 1..n {
        let x = c.x(i)?;
        acc = c.binary(op.expect("a binary op"), acc, x)?;
    }
    if mean {
        acc = c.binary_c(B::Div, acc, n as f64)?;
    }
    one(acc)
}

fn compare(c: &mut Ctx, op: C) -> Result<Vec<Val>> {
    let (a, b) = (c.x(0)?, c.x(1)?);
    one(c.compare(op, a, b)?)
}

fn where_op(c: &mut Ctx) -> Result<Vec<Val>> {
    let (cond, a, b) = (c.x(0)?, c.x(1)?, c.x(2)?);
    one(c.where_(cond, a, b)?)
}

fn leaky_relu(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let alpha = c.attr_f("alpha", 0.01);
    let neg = c.compare_c(C::Lt, x, 0.0)?;
    let ax = c.binary_c(B::Mul, x, alpha)?;
    one(c.where_(neg, ax, x)?)
}

fn prelu(c: &mut Ctx) -> Result<Vec<Val>> {
    let (x, slope) = (c.x(0)?, c.x(1)?);
    let mut slope = legacy_broadcast(c, x, slope)?;
    // PRelu-6 and older: a [C] slope is per channel of [N, C, …].
    if c.opset < 7 && c.rank(slope) == 1 && c.rank(x) > 2 && c.dims(slope)[0] == c.dims(x)[1] {
        let mut dims = vec![tessera::ir::Dim::Const(1); c.rank(x) - 1];
        dims[0] = c.dims(slope)[0].clone();
        slope = c.reshape(slope, dims)?;
    }
    let neg = c.compare_c(C::Lt, x, 0.0)?;
    let sx = c.binary(B::Mul, x, slope)?;
    one(c.where_(neg, sx, x)?)
}

/// α·(eˣ − 1), the negative branch of elu.
fn exp_m1(c: &mut Ctx, x: NodeId, alpha: f64) -> Result<NodeId> {
    let e = c.unary(U::Exp, x)?;
    let m = c.binary_c(B::Sub, e, 1.0)?;
    c.binary_c(B::Mul, m, alpha)
}

fn elu(c: &mut Ctx) -> Result<Vec<Val>> {
    in_f32(c, |c, x| {
        let alpha = c.attr_f("alpha", 1.0);
        let neg = c.compare_c(C::Lt, x, 0.0)?;
        let e = exp_m1(c, x, alpha)?;
        c.where_(neg, e, x)
    })
}

fn selu(c: &mut Ctx) -> Result<Vec<Val>> {
    in_f32(c, |c, x| {
        let alpha = c.attr_f("alpha", 1.673_263_192_176_818_8);
        let gamma = c.attr_f("gamma", 1.050_701_022_148_132_3);
        let neg = c.compare_c(C::Le, x, 0.0)?;
        let e = exp_m1(c, x, alpha)?;
        let w = c.where_(neg, e, x)?;
        c.binary_c(B::Mul, w, gamma)
    })
}

fn celu(c: &mut Ctx) -> Result<Vec<Val>> {
    in_f32(c, |c, x| {
        let alpha = c.attr_f("alpha", 1.0);
        let xa = c.binary_c(B::Div, x, alpha)?;
        let e = exp_m1(c, xa, alpha)?;
        let zero = c.scalar_like(0.0, x)?;
        let pos = c.binary(B::Maximum, x, zero)?;
        let neg = c.binary(B::Minimum, e, zero)?;
        c.binary(B::Add, pos, neg)
    })
}

fn thresholded_relu(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let alpha = c.attr_f("alpha", 1.0);
    let above = c.compare_c(C::Gt, x, alpha)?;
    let zero = c.scalar_like(0.0, x)?;
    one(c.where_(above, x, zero)?)
}

/// max(0, min(1, αx + β)).
fn hard_sigmoid_of(c: &mut Ctx, x: NodeId, alpha: f64, beta: f64) -> Result<NodeId> {
    let ax = c.binary_c(B::Mul, x, alpha)?;
    let y = c.binary_c(B::Add, ax, beta)?;
    let m = c.binary_c(B::Minimum, y, 1.0)?;
    c.binary_c(B::Maximum, m, 0.0)
}

fn hard_sigmoid(c: &mut Ctx) -> Result<Vec<Val>> {
    in_f32(c, |c, x| {
        let (alpha, beta) = (c.attr_f("alpha", 0.2), c.attr_f("beta", 0.5));
        hard_sigmoid_of(c, x, alpha, beta)
    })
}

fn hard_swish(c: &mut Ctx) -> Result<Vec<Val>> {
    in_f32(c, |c, x| {
        let h = hard_sigmoid_of(c, x, 1.0 / 6.0, 0.5)?;
        c.binary(B::Mul, x, h)
    })
}

/// ln(1 + eˣ).
fn softplus(c: &mut Ctx, x: NodeId) -> Result<NodeId> {
    let e = c.unary(U::Exp, x)?;
    let p = c.binary_c(B::Add, e, 1.0)?;
    c.unary(U::Log, p)
}

fn softplus_op(c: &mut Ctx) -> Result<Vec<Val>> {
    in_f32(c, softplus)
}

fn softsign(c: &mut Ctx) -> Result<Vec<Val>> {
    in_f32(c, |c, x| {
        let a = c.unary(U::Abs, x)?;
        let d = c.binary_c(B::Add, a, 1.0)?;
        c.binary(B::Div, x, d)
    })
}

fn mish(c: &mut Ctx) -> Result<Vec<Val>> {
    in_f32(c, |c, x| {
        let s = softplus(c, x)?;
        let t = c.unary(U::Tanh, s)?;
        c.binary(B::Mul, x, t)
    })
}

fn gelu(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let op = match c.attr_s("approximate", "none").as_str() {
        "none" => U::Gelu,
        "tanh" => U::GeluTanh,
        other => return Err(c.bad(format!("approximate `{other}` (none or tanh)"))),
    };
    one(c.unary(op, x)?)
}

fn swish(c: &mut Ctx) -> Result<Vec<Val>> {
    in_f32(c, |c, x| {
        let alpha = c.attr_f("alpha", 1.0);
        let ax = c.binary_c(B::Mul, x, alpha)?;
        let s = c.unary(U::Sigmoid, ax)?;
        c.binary(B::Mul, x, s)
    })
}

fn shrink(c: &mut Ctx) -> Result<Vec<Val>> {
    in_f32(c, |c, x| {
        let (lambd, bias) = (c.attr_f("lambd", 0.5), c.attr_f("bias", 0.0));
        let below = c.compare_c(C::Lt, x, -lambd)?;
        let above = c.compare_c(C::Gt, x, lambd)?;
        let xb = c.binary_c(B::Add, x, bias)?;
        let xm = c.binary_c(B::Sub, x, bias)?;
        let zero = c.scalar_like(0.0, x)?;
        let inner = c.where_(above, xm, zero)?;
        c.where_(below, xb, inner)
    })
}

/// Clip: bounds in attributes before opset 11, optional inputs from it on.
fn clip(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let (lo, hi) = if c.opset < 11 {
        let lo = c.attr("min").map(|a| a.f as f64);
        let hi = c.attr("max").map(|a| a.f as f64);
        (
            lo.map(|v| c.scalar_like(v, x)).transpose()?,
            hi.map(|v| c.scalar_like(v, x)).transpose()?,
        )
    } else {
        let lo = if c.has_input(1) { Some(c.x(1)?) } else { None };
        let hi = if c.has_input(2) { Some(c.x(2)?) } else { None };
        (lo, hi)
    };
    let mut y = x;
    if let Some(lo) = lo {
        y = c.binary(B::Maximum, y, lo)?;
    }
    if let Some(hi) = hi {
        y = c.binary(B::Minimum, y, hi)?;
    }
    one(y)
}

fn identity(c: &mut Ctx) -> Result<Vec<Val>> {
    Ok(vec![c.val(0)?.clone()])
}

/// Dropout at inference: the input, and a mask of ones. Training mode (a
/// random mask) is not supported.
fn dropout(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let training = if c.opset >= 12 && c.has_input(2) {
        let t = c.ints(2, "training_mode")?;
        t.first().copied().unwrap_or(0) != 0
    } else {
        c.opset < 7 && c.attr_i("is_test", 0) == 0
    };
    if training {
        let ratio = if c.opset >= 12 && c.has_input(1) {
            c.float_scalar(1, "ratio")?
        } else if c.opset >= 12 {
            0.5
        } else {
            c.attr_f("ratio", 0.5)
        };
        if ratio != 0.0 {
            return Err(c.unsupported("training mode (a random mask)"));
        }
    }
    let shape = c.ty(x).shape.clone();
    let mask = c.add(
        Op::Full {
            value: Scalar::Bool(true),
            shape,
            dtype: DType::Bool,
        },
        &[],
    )?;
    Ok(vec![Val::node(x), Val::node(mask)])
}

fn cast(c: &mut Ctx) -> Result<Vec<Val>> {
    let attr = c.attr("to").cloned().ok_or_else(|| c.bad("no `to`"))?;
    let to = if !attr.s.is_empty() {
        // Before opset 6 the type is named (`FLOAT`, `INT64` …).
        let name = String::from_utf8_lossy(&attr.s).to_ascii_lowercase();
        (0..=16)
            .find(|&t| crate::proto::data_type::name(t) == name)
            .ok_or_else(|| c.bad(format!("unknown type `{name}`")))?
    } else {
        attr.i as i32
    };
    let dtype = crate::tensor::dtype_of(to, "the target of the cast")
        .map_err(|e| c.unsupported(e.message))?;
    cast_to(c, dtype)
}

/// BitCast: the same bits as `to`, a type of the same width (bool, of one
/// byte, reads as 0/1 in uint8 and int8: ONNX stores it so).
fn bitcast(c: &mut Ctx) -> Result<Vec<Val>> {
    let to = c.attr_i("to", 0) as i32;
    let dtype = crate::tensor::dtype_of(to, "the target of the bitcast")
        .map_err(|e| c.unsupported(e.message))?;
    let x = c.x(0)?;
    let from = c.dtype(x);
    if from == dtype {
        return one(x);
    }
    if from == DType::Bool || dtype == DType::Bool {
        // Bool's byte is 0 or 1, the value of the one-byte integer.
        if from.size_bytes() != 1 || dtype.size_bytes() != 1 {
            return Err(c.bad(format!("a bitcast of {} to {dtype}", c.ty(x))));
        }
        return one(c.cast(x, dtype)?);
    }
    one(c.add(Op::BitCast(dtype), &[x])?)
}

fn cast_like(c: &mut Ctx) -> Result<Vec<Val>> {
    let like = c.x(1)?;
    let dtype = c.dtype(like);
    cast_to(c, dtype)
}

fn cast_to(c: &mut Ctx, dtype: DType) -> Result<Vec<Val>> {
    let v = c.val(0)?.clone();
    // A known shape cast between integer types stays known.
    if v.dims.is_some() && dtype == DType::I64 {
        return Ok(vec![v]);
    }
    let x = c.x(0)?;
    one(c.cast(x, dtype)?)
}
