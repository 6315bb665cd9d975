//! Quantisation: QuantizeLinear and DequantizeLinear (per tensor, per
//! axis, blocked), DynamicQuantizeLinear, and the integer products
//! MatMulInteger, QLinearMatMul, ConvInteger, QLinearConv. Each is the
//! ONNX reference's arithmetic step by step: scales divide in their own
//! float type, rounding is to nearest even (numpy's `rint`), results
//! saturate to the target type's range; integer products are exact (int32
//! matmuls, convolutions of integers in f64, whose sums stay below 2⁵³).

use tessera::ir::{BinaryOp as B, CompareOp as C, Dim, NodeId, ReduceOp};
use tessera::{DType, Result};

use super::cnn::conv_of;
use super::elementwise::round_even64;
use super::{one, Converter};
use crate::builder::{Ctx, Val};

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "QuantizeLinear" => quantize_linear,
        "DequantizeLinear" => dequantize_linear,
        "DynamicQuantizeLinear" => dynamic_quantize_linear,
        "MatMulInteger" => matmul_integer,
        "QLinearMatMul" => qlinear_matmul,
        "ConvInteger" => conv_integer,
        "QLinearConv" => qlinear_conv,
        _ => return None,
    })
}

/// The integer types ONNX quantises to.
fn quantised(c: &Ctx, dtype: DType, what: &str) -> Result<DType> {
    match dtype {
        DType::U8 | DType::I8 | DType::U16 | DType::I16 => Ok(dtype),
        _ => Err(c.unsupported(format!(
            "{what} of type {dtype}: tessera quantises to uint8, int8, uint16 and int16"
        ))),
    }
}

/// Input `i` if the node has it.
fn opt(c: &mut Ctx, i: usize) -> Result<Option<NodeId>> {
    if c.has_input(i) {
        Ok(Some(c.x(i)?))
    } else {
        Ok(None)
    }
}

/// A scale or zero point `v` shaped to broadcast against `x`: as it is
/// when it has one element, along `axis` when 1-D (per axis), or each
/// element repeated `block` times along `axis` and cut to `x`'s extent
/// there (blocked: `v` has `x`'s rank).
fn along(c: &mut Ctx, v: NodeId, x: NodeId, axis: i64, block: i64) -> Result<NodeId> {
    let vd = c.concrete(v, "a quantisation scale or zero point")?;
    let xd = c.dims(x);
    let rank = xd.len();
    if vd.iter().product::<usize>() == 1 {
        return c.reshape(v, Vec::new());
    }
    let axis = c.axis(axis, rank)?;
    if block <= 0 {
        if vd.len() != 1 || xd[axis].as_const() != Some(vd[0]) {
            return Err(c.bad(format!(
                "a per-axis scale or zero point must be 1-D of x's size along axis {axis}, \
                 got {} for x {}",
                c.ty(v),
                c.ty(x)
            )));
        }
        let mut dims = vec![Dim::Const(1); rank];
        dims[axis] = Dim::Const(vd[0]);
        return c.reshape(v, dims);
    }
    let block = block as usize;
    let extent = xd[axis]
        .as_const()
        .ok_or_else(|| c.unsupported("blocked quantisation along a symbolic dim"))?;
    let fits = vd.len() == rank
        && vd[axis].checked_mul(block).is_some_and(|n| n >= extent)
        && (0..rank).all(|d| d == axis || xd[d].as_const() == Some(vd[d]));
    if !fits {
        return Err(c.bad(format!(
            "a blocked scale or zero point must have x's shape but ceil(n / {block}) along \
             axis {axis}, got {} for x {}",
            c.ty(v),
            c.ty(x)
        )));
    }
    let u = c.unsqueeze(v, axis + 1)?;
    let mut wide: Vec<Dim> = vd.iter().map(|&d| Dim::Const(d)).collect();
    wide.insert(axis + 1, Dim::Const(block));
    let e = c.expand(u, wide)?;
    let mut flat: Vec<Dim> = vd.iter().map(|&d| Dim::Const(d)).collect();
    flat[axis] = Dim::Const(vd[axis] * block);
    let r = c.reshape(e, flat)?;
    c.slice(r, axis, 0, extent, 1)
}

/// `v` (a float whose values are integers or ±inf/NaN) clamped to
/// `dtype`'s range and cast to it.
fn saturate(c: &mut Ctx, v: NodeId, dtype: DType) -> Result<NodeId> {
    let (lo, hi) = dtype.int_range().expect("an integer type");
    let lo = c.binary_c(B::Maximum, v, lo as f64)?;
    let clamped = c.binary_c(B::Minimum, lo, hi as f64)?;
    c.cast(clamped, dtype)
}

/// `x / scale` rounded to even, plus `zp`, saturated to `dtype`; the
/// division in `x`'s float type, the rest exact in f64.
fn quantize(
    c: &mut Ctx,
    x: NodeId,
    scale: NodeId,
    zp: Option<NodeId>,
    dtype: DType,
) -> Result<NodeId> {
    let xt = c.dtype(x);
    let s = c.cast(scale, xt)?;
    let q = c.binary(B::Div, x, s)?;
    let q64 = c.cast(q, DType::F64)?;
    let mut r = round_even64(c, q64)?;
    if let Some(zp) = zp {
        let z = c.cast(zp, DType::F64)?;
        r = c.binary(B::Add, r, z)?;
    }
    saturate(c, r, dtype)
}

fn quantize_linear(c: &mut Ctx) -> Result<Vec<Val>> {
    let (x, scale, zp) = (c.x(0)?, c.x(1)?, opt(c, 2)?);
    if !c.dtype(x).is_float() {
        return Err(c.unsupported(format!(
            "QuantizeLinear of {}: tessera quantises float tensors",
            c.ty(x)
        )));
    }
    let (axis, block) = (c.attr_i("axis", 1), c.attr_i("block_size", 0));
    let dtype = match zp {
        Some(z) => c.dtype(z),
        None => match c.attr("output_dtype").map(|a| a.i as i32) {
            Some(t) if t != 0 => crate::tensor::dtype_of(t, "QuantizeLinear's output_dtype")
                .map_err(|e| c.unsupported(e.message))?,
            _ => DType::U8,
        },
    };
    let dtype = quantised(c, dtype, "a quantised output")?;
    if c.attr("precision").is_some_and(|a| a.i != 0) {
        return Err(c.unsupported("QuantizeLinear's `precision` attribute"));
    }
    let s = along(c, scale, x, axis, block)?;
    let z = zp.map(|z| along(c, z, x, axis, block)).transpose()?;
    one(quantize(c, x, s, z, dtype)?)
}

fn dequantize_linear(c: &mut Ctx) -> Result<Vec<Val>> {
    let (x, scale, zp) = (c.x(0)?, c.x(1)?, opt(c, 2)?);
    let xt = c.dtype(x);
    if !matches!(xt, DType::I32) {
        quantised(c, xt, "x")?;
    }
    let out = match c.attr("output_dtype").map(|a| a.i as i32) {
        Some(t) if t != 0 => crate::tensor::dtype_of(t, "DequantizeLinear's output_dtype")
            .map_err(|e| c.unsupported(e.message))?,
        _ => c.dtype(scale),
    };
    let (axis, block) = (c.attr_i("axis", 1), c.attr_i("block_size", 0));
    // As the reference: (f32(x) − f32(zp)) · f32(scale), then the output type.
    let mut d = c.cast(x, DType::F32)?;
    if let Some(zp) = zp {
        let z = along(c, zp, x, axis, block)?;
        let z = c.cast(z, DType::F32)?;
        d = c.binary(B::Sub, d, z)?;
    }
    let s = along(c, scale, x, axis, block)?;
    let s = c.cast(s, DType::F32)?;
    let y = c.binary(B::Mul, d, s)?;
    one(c.cast(y, out)?)
}

/// uint8 quantisation with a scale and zero point from x's range (which
/// always includes 0), in f32 as the reference computes them.
fn dynamic_quantize_linear(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let xt = c.dtype(x);
    if xt != DType::F32 {
        return Err(c.unsupported(format!(
            "DynamicQuantizeLinear of {}: the op takes float32",
            c.ty(x)
        )));
    }
    let all: Vec<usize> = (0..c.rank(x)).collect();
    let reduce = |c: &mut Ctx, op| {
        c.add(
            tessera::ir::Op::Reduce {
                op,
                dims: all.clone(),
                keepdim: false,
            },
            &[x],
        )
    };
    let hi = reduce(c, ReduceOp::Max)?;
    let lo = reduce(c, ReduceOp::Min)?;
    let maxx = c.binary_c(B::Maximum, hi, 0.0)?;
    let minx = c.binary_c(B::Minimum, lo, 0.0)?;
    let range = c.binary(B::Sub, maxx, minx)?;
    let same = c.compare(C::Eq, maxx, minx)?;
    let one_ = c.scalar(1.0, DType::F32)?;
    let range = c.where_(same, one_, range)?;
    let scale = c.binary_c(B::Div, range, 255.0)?;
    let ms = c.binary(B::Div, minx, scale)?;
    let zp0 = c.unary(tessera::ir::UnaryOp::Neg, ms)?;
    let zp0 = c.binary_c(B::Maximum, zp0, 0.0)?;
    let zp0 = c.binary_c(B::Minimum, zp0, 255.0)?;
    let zp64 = c.cast(zp0, DType::F64)?;
    let zpi = round_even64(c, zp64)?;
    let y = quantize(c, x, scale, Some(zpi), DType::U8)?;
    let zp = c.cast(zpi, DType::U8)?;
    Ok(vec![Val::node(y), Val::node(scale), Val::node(zp)])
}

/// `v` as int32 less its zero point `zp` (which broadcasts against it).
fn centred(c: &mut Ctx, v: NodeId, zp: Option<NodeId>) -> Result<NodeId> {
    let v32 = c.cast(v, DType::I32)?;
    match zp {
        Some(z) => {
            let z32 = c.cast(z, DType::I32)?;
            c.binary(B::Sub, v32, z32)
        }
        None => Ok(v32),
    }
}

/// A's zero point: a scalar, or one per row of A (`[M]` → `[M, 1]`).
fn row_zero_point(c: &mut Ctx, zp: Option<NodeId>) -> Result<Option<NodeId>> {
    let Some(z) = zp else { return Ok(None) };
    let d = c.dims(z);
    if d.len() == 1 && d[0].as_const() != Some(1) {
        let dims = vec![d[0].clone(), Dim::Const(1)];
        return Ok(Some(c.reshape(z, dims)?));
    }
    Ok(Some(c.reshape(z, Vec::new())?))
}

fn int8_operand(c: &Ctx, v: NodeId, what: &str) -> Result<()> {
    match c.dtype(v) {
        DType::U8 | DType::I8 => Ok(()),
        _ => Err(c.bad(format!("{what} must be uint8 or int8, got {}", c.ty(v)))),
    }
}

/// (A − a_zp) @ (B − b_zp) in int32, exactly (the operands are 8-bit).
fn integer_product(
    c: &mut Ctx,
    a: NodeId,
    a_zp: Option<NodeId>,
    b: NodeId,
    b_zp: Option<NodeId>,
) -> Result<NodeId> {
    int8_operand(c, a, "A")?;
    int8_operand(c, b, "B")?;
    let a_zp = row_zero_point(c, a_zp)?;
    let a32 = centred(c, a, a_zp)?;
    let b32 = centred(c, b, b_zp)?;
    c.add(tessera::ir::Op::MatMul, &[a32, b32])
}

fn matmul_integer(c: &mut Ctx) -> Result<Vec<Val>> {
    let (a, b) = (c.x(0)?, c.x(1)?);
    let (a_zp, b_zp) = (opt(c, 2)?, opt(c, 3)?);
    one(integer_product(c, a, a_zp, b, b_zp)?)
}

/// An int32 product `acc` requantised: `acc · (s_a · s_b / s_y)` (the
/// multiplier in the scales' type, the product in f64 as numpy promotes
/// int32 with a float), plus y's zero point, rounded to even, saturated.
fn requantise(
    c: &mut Ctx,
    acc: NodeId,
    scales: [NodeId; 3],
    y_zp: Option<NodeId>,
    dtype: DType,
) -> Result<NodeId> {
    let [sa, sb, sy] = scales;
    let st = c.dtype(sa);
    let sb = c.cast(sb, st)?;
    let sy = c.cast(sy, st)?;
    let ab = c.binary(B::Mul, sa, sb)?;
    let m = c.binary(B::Div, ab, sy)?;
    let m64 = c.cast(m, DType::F64)?;
    let acc64 = c.cast(acc, DType::F64)?;
    let mut d = c.binary(B::Mul, acc64, m64)?;
    if let Some(z) = y_zp {
        let z = c.cast(z, DType::F64)?;
        d = c.binary(B::Add, d, z)?;
    }
    let r = round_even64(c, d)?;
    saturate(c, r, dtype)
}

fn qlinear_matmul(c: &mut Ctx) -> Result<Vec<Val>> {
    let (a, sa, a_zp) = (c.x(0)?, c.x(1)?, opt(c, 2)?);
    let (b, sb, b_zp) = (c.x(3)?, c.x(4)?, opt(c, 5)?);
    let (sy, y_zp) = (c.x(6)?, opt(c, 7)?);
    for s in [sa, sb, sy] {
        if c.concrete(s, "a scale")?.iter().product::<usize>() != 1 {
            return Err(c.unsupported(
                "QLinearMatMul with per-row or per-column scales (tessera takes one per tensor)",
            ));
        }
    }
    let [sa, sb, sy] = [sa, sb, sy].map(|s| c.reshape(s, Vec::new()));
    let b_zp = b_zp.map(|z| c.reshape(z, Vec::new())).transpose()?;
    let acc = integer_product(c, a, a_zp, b, b_zp)?;
    let dtype = match y_zp {
        Some(z) => c.dtype(z),
        None => c.dtype(a),
    };
    one(requantise(c, acc, [sa?, sb?, sy?], y_zp, dtype)?)
}

/// `w` as f64 less its zero point: a scalar, or one per output channel.
fn centred_weight(c: &mut Ctx, w: NodeId, zp: Option<NodeId>) -> Result<NodeId> {
    let w64 = c.cast(w, DType::F64)?;
    let Some(z) = zp else { return Ok(w64) };
    let rank = c.rank(w);
    let zd = c.dims(z);
    let z = if zd.len() == 1 && zd[0].as_const() != Some(1) {
        let mut dims = vec![Dim::Const(1); rank];
        dims[0] = zd[0].clone();
        c.reshape(z, dims)?
    } else {
        c.reshape(z, Vec::new())?
    };
    let z64 = c.cast(z, DType::F64)?;
    c.binary(B::Sub, w64, z64)
}

/// The convolution of (x − x_zp) by (w − w_zp), exact in f64 (8-bit
/// operands: every partial sum is an integer far below 2⁵³).
fn integer_conv(
    c: &mut Ctx,
    x: NodeId,
    x_zp: Option<NodeId>,
    w: NodeId,
    w_zp: Option<NodeId>,
) -> Result<NodeId> {
    int8_operand(c, x, "x")?;
    int8_operand(c, w, "w")?;
    let mut x64 = c.cast(x, DType::F64)?;
    if let Some(z) = x_zp {
        let z = c.reshape(z, Vec::new())?;
        let z64 = c.cast(z, DType::F64)?;
        x64 = c.binary(B::Sub, x64, z64)?;
    }
    let w64 = centred_weight(c, w, w_zp)?;
    conv_of(c, x64, w64, None)
}

fn conv_integer(c: &mut Ctx) -> Result<Vec<Val>> {
    let (x, w) = (c.x(0)?, c.x(1)?);
    let (x_zp, w_zp) = (opt(c, 2)?, opt(c, 3)?);
    let y = integer_conv(c, x, x_zp, w, w_zp)?;
    one(c.cast(y, DType::I32)?)
}

fn qlinear_conv(c: &mut Ctx) -> Result<Vec<Val>> {
    let (x, sx, x_zp) = (c.x(0)?, c.x(1)?, opt(c, 2)?);
    let (w, sw, w_zp) = (c.x(3)?, c.x(4)?, opt(c, 5)?);
    let (sy, y_zp) = (c.x(6)?, opt(c, 7)?);
    let bias = opt(c, 8)?;
    let mut acc = integer_conv(c, x, x_zp, w, w_zp)?;
    if let Some(b) = bias {
        // The int32 bias, one per output channel, added before scaling.
        let b64 = c.cast(b, DType::F64)?;
        let rank = c.rank(acc);
        let mut dims = vec![Dim::Const(1); rank];
        dims[1] = c.dims(b)[0].clone();
        let b64 = c.reshape(b64, dims)?;
        acc = c.binary(B::Add, acc, b64)?;
    }
    let sx = c.reshape(sx, Vec::new())?;
    let sy = c.reshape(sy, Vec::new())?;
    // w's scale: one, or one per output channel ([1, M, 1, …]).
    let swd = c.concrete(sw, "w's scale")?;
    let sw = if swd.iter().product::<usize>() == 1 {
        c.reshape(sw, Vec::new())?
    } else {
        let rank = c.rank(acc);
        let mut dims = vec![Dim::Const(1); rank];
        dims[1] = Dim::Const(swd.iter().product());
        c.reshape(sw, dims)?
    };
    let dtype = match y_zp {
        Some(z) => c.dtype(z),
        None => c.dtype(x),
    };
    let y_zp = y_zp.map(|z| c.reshape(z, Vec::new())).transpose()?;
    one(requantise(c, acc, [sx, sw, sy], y_zp, dtype)?)
}
