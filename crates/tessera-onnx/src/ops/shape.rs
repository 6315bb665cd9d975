//! Shape and data-movement ops: reshape and its relatives, slicing,
//! gathering, concatenation and splitting, padding, constants and ranges.
//!
//! A value made of a tensor's dims (`Shape`, and what `Gather`, `Slice`,
//! `Concat`, `Unsqueeze`, `Squeeze` and integer arithmetic make of it)
//! is followed at import time, so that a shape computed from a dynamic
//! (symbolic) dim reaches `Reshape`, `Expand` or `ConstantOfShape` as
//! symbolic dims rather than data.

use tessera::ir::{
    BinaryOp as B, CompareOp as C, Dim, Literal, LiteralData, NodeId, Op, Scalar, Shape,
};
use tessera::{DType, Result};

use super::{one, Converter};
use crate::builder::{fmt_entries, lit_ints, Ctx, DimOrNeg, DimsVal, Val};

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "Reshape" => reshape,
        "Flatten" => flatten,
        "Squeeze" => squeeze,
        "Unsqueeze" => unsqueeze,
        "Transpose" => transpose,
        "Concat" => concat,
        "Split" => split,
        "Slice" => slice,
        "Expand" => expand,
        "Tile" => tile,
        "Gather" => gather,
        "GatherElements" => gather_elements,
        "Shape" => shape,
        "Size" => size,
        "Constant" => constant,
        "ConstantOfShape" => constant_of_shape,
        "Range" => range,
        "EyeLike" => eye_like,
        "Trilu" => trilu,
        "OneHot" => one_hot,
        "Pad" => pad,
        "DepthToSpace" => depth_to_space,
        "SpaceToDepth" => space_to_depth,
        _ => return None,
    })
}

/// A value of known entries: a constant node too when none is symbolic.
pub(super) fn dims_val(c: &mut Ctx, dims: Vec<DimOrNeg>, scalar: bool) -> Val {
    let d = DimsVal { dims, scalar };
    // Without a node when the constant cannot be made (over the size
    // limit): materialising it later reports the error.
    let id = d.ints().and_then(|ints| c.int_constant(&ints, scalar).ok());
    Val { id, dims: Some(d) }
}

/// The known entries of input `i` when it is a dims value or a small
/// integer constant; `None` otherwise.
pub(super) fn known_entries(c: &mut Ctx, i: usize) -> Result<Option<DimsVal>> {
    let v = c.val(i)?.clone();
    if let Some(d) = v.dims {
        return Ok(Some(d));
    }
    let id = c.x(i)?;
    if !c.dtype(id).is_int() || c.rank(id) > 1 {
        return Ok(None);
    }
    Ok(c.fold(id)?.map(|lit| DimsVal {
        scalar: lit.shape.is_empty(),
        dims: lit_ints(&lit).into_iter().map(DimOrNeg::from_int).collect(),
    }))
}

/// Whether some input is a dims value with a symbolic entry.
fn any_symbolic(c: &Ctx) -> bool {
    c.inputs
        .iter()
        .flatten()
        .any(|v| v.dims.as_ref().is_some_and(DimsVal::is_symbolic))
}

/// The output dims of a reshape of `from` to `target` (0 copies the input
/// dim unless `allow_zero`, one −1 is inferred).
fn reshape_target(
    c: &Ctx,
    from: &[Dim],
    target: &[DimOrNeg],
    allow_zero: bool,
) -> Result<Vec<Dim>> {
    let mut out: Vec<Option<Dim>> = Vec::with_capacity(target.len());
    let mut infer = None;
    for (i, t) in target.iter().enumerate() {
        match t {
            DimOrNeg::Dim(Dim::Const(0)) if !allow_zero => {
                let d = from.get(i).ok_or_else(|| {
                    c.bad(format!(
                        "shape {} copies dim {i} of a rank-{} input",
                        fmt_entries(target),
                        from.len()
                    ))
                })?;
                out.push(Some(d.clone()));
            }
            DimOrNeg::Dim(d) => out.push(Some(d.clone())),
            DimOrNeg::Neg(-1) if infer.is_none() => {
                infer = Some(i);
                out.push(None);
            }
            DimOrNeg::Neg(v) => {
                return Err(c.bad(format!("shape {} has entry {v}", fmt_entries(target))))
            }
        }
    }
    if let Some(i) = infer {
        let numel = from
            .iter()
            .try_fold(Dim::Const(1), |a, d| a.checked_mul(d))
            .ok_or_else(|| c.bad("the input's size overflows"))?;
        let known = out
            .iter()
            .flatten()
            .try_fold(Dim::Const(1), |a, d| a.checked_mul(d))
            .ok_or_else(|| c.bad("the shape's size overflows"))?;
        let d = match (&numel, &known) {
            (_, Dim::Const(0)) => Dim::Const(0),
            (Dim::Const(n), Dim::Const(k)) if n % k == 0 => Dim::Const(n / k),
            _ => numel.div_exact(&known).ok_or_else(|| {
                c.unsupported(format!(
                    "cannot infer the −1 of shape {}: {numel} elements over {known}",
                    fmt_entries(target)
                ))
            })?,
        };
        out[i] = Some(d);
    }
    Ok(out.into_iter().map(|d| d.expect("filled")).collect())
}

fn reshape(c: &mut Ctx) -> Result<Vec<Val>> {
    let target: Vec<DimOrNeg> = if c.opset < 5 {
        c.attr_ints("shape")
            .unwrap_or_default()
            .into_iter()
            .map(DimOrNeg::from_int)
            .collect()
    } else {
        c.dims_input(1, "the shape")?
    };
    let allow_zero = c.attr_i("allowzero", 0) != 0;
    // A dims value reshaped (to [n] or []) stays a dims value.
    if let Some(d) = c.val(0)?.dims.clone() {
        if target.len() <= 1 {
            return Ok(vec![dims_val(c, d.dims, target.is_empty())]);
        }
    }
    let x = c.x(0)?;
    let from = c.dims(x);
    let dims = reshape_target(c, &from, &target, allow_zero)?;
    one(c.reshape(x, dims)?)
}

fn flatten(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let rank = c.rank(x);
    let axis = c.attr_i("axis", 1);
    let a = if axis < 0 { axis + rank as i64 } else { axis };
    if a < 0 || a > rank as i64 {
        return Err(c.bad(format!("axis {axis} for {}", c.ty(x))));
    }
    let a = a as usize;
    let dims = c.dims(x);
    let prod = |ds: &[Dim]| {
        ds.iter()
            .try_fold(Dim::Const(1), |acc, d| acc.checked_mul(d))
    };
    let (l, r) = prod(&dims[..a])
        .zip(prod(&dims[a..]))
        .ok_or_else(|| c.bad("the input's size overflows"))?;
    one(c.reshape(x, vec![l, r])?)
}

/// Axes from an attribute before `input_from`, from input 1 after.
fn axes_arg(c: &mut Ctx, input_from: i64) -> Result<Option<Vec<i64>>> {
    if c.opset >= input_from {
        if c.has_input(1) {
            Ok(Some(c.ints(1, "axes")?))
        } else {
            Ok(None)
        }
    } else {
        Ok(c.attr_ints("axes"))
    }
}

fn squeeze(c: &mut Ctx) -> Result<Vec<Val>> {
    let axes = axes_arg(c, 13)?;
    if let Some(d) = c.val(0)?.dims.clone() {
        if !d.scalar && d.dims.len() == 1 {
            return Ok(vec![dims_val(c, d.dims, true)]);
        }
    }
    let x = c.x(0)?;
    let rank = c.rank(x);
    let dims = c.dims(x);
    let drop: Vec<usize> = match axes {
        Some(a) => {
            let a = c.axes(&a, rank)?;
            if let Some(&bad) = a.iter().find(|&&i| dims[i] != Dim::Const(1)) {
                return Err(c.bad(format!("dim {bad} of {} is not 1", c.ty(x))));
            }
            a
        }
        None => (0..rank).filter(|&i| dims[i] == Dim::Const(1)).collect(),
    };
    let kept = dims
        .into_iter()
        .enumerate()
        .filter(|(i, _)| !drop.contains(i))
        .map(|(_, d)| d)
        .collect();
    one(c.reshape(x, kept)?)
}

fn unsqueeze(c: &mut Ctx) -> Result<Vec<Val>> {
    let axes = axes_arg(c, 13)?.ok_or_else(|| c.bad("no axes"))?;
    if let Some(d) = c.val(0)?.dims.clone() {
        if d.scalar && axes.len() == 1 {
            return Ok(vec![dims_val(c, d.dims, false)]);
        }
    }
    let x = c.x(0)?;
    let out_rank = c.rank(x) + axes.len();
    let axes = c.axes(&axes, out_rank)?;
    let mut src = c.dims(x).into_iter();
    let dims = (0..out_rank)
        .map(|i| {
            if axes.contains(&i) {
                Dim::Const(1)
            } else {
                src.next().expect("ranks add up")
            }
        })
        .collect();
    one(c.reshape(x, dims)?)
}

fn transpose(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let rank = c.rank(x);
    let perm: Vec<usize> = match c.attr_ints("perm") {
        Some(p) => p.iter().map(|&a| c.axis(a, rank)).collect::<Result<_>>()?,
        None => (0..rank).rev().collect(),
    };
    one(c.permute(x, perm)?)
}

fn concat(c: &mut Ctx) -> Result<Vec<Val>> {
    let n = c.node.input.len();
    if any_symbolic(c) {
        let mut dims = Vec::new();
        for i in 0..n {
            let d = known_entries(c, i)?.ok_or_else(|| {
                c.unsupported("joins a symbolic shape with a value unknown at import time")
            })?;
            dims.extend(d.dims);
        }
        return Ok(vec![dims_val(c, dims, false)]);
    }
    let xs = (0..n).map(|i| c.x(i)).collect::<Result<Vec<_>>>()?;
    let Some(&first) = xs.first() else {
        return Err(c.bad("needs at least one input"));
    };
    let rank = c.rank(first);
    let default_axis = if c.opset < 4 { 1 } else { 0 };
    let dim = c.axis(c.attr_i("axis", default_axis), rank)?;
    // ONNX allows empty inputs in a concat; tessera's cat takes them too,
    // but skipping them keeps graphs small.
    let nonempty: Vec<NodeId> = xs
        .iter()
        .copied()
        .filter(|&x| c.dims(x).get(dim) != Some(&Dim::Const(0)))
        .collect();
    let xs = if nonempty.is_empty() {
        vec![xs[0]]
    } else {
        nonempty
    };
    one(c.cat(&xs, dim)?)
}

fn split(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let rank = c.rank(x);
    let dim = c.axis(c.attr_i("axis", 0), rank)?;
    let size = c.dims(x)[dim]
        .as_const()
        .ok_or_else(|| c.unsupported(format!("splitting symbolic dim {dim} of {}", c.ty(x))))?;
    let outputs = c.node.output.len();
    let sizes: Vec<usize> = {
        let given = if c.opset >= 13 || (c.opset < 2 && c.has_input(1)) {
            if c.has_input(1) {
                Some(c.ints(1, "split")?)
            } else {
                None
            }
        } else {
            c.attr_ints("split")
        };
        match given {
            Some(s) => s
                .iter()
                .map(|&v| usize::try_from(v).map_err(|_| c.bad(format!("split {s:?}"))))
                .collect::<Result<_>>()?,
            None => {
                let n = c.attr("num_outputs").map_or(outputs as i64, |a| a.i) as usize;
                if n == 0 {
                    return Err(c.bad("zero outputs"));
                }
                let chunk = size.div_ceil(n);
                if c.opset < 18 && size % n != 0 {
                    return Err(c.bad(format!("cannot split {size} evenly into {n}")));
                }
                (0..n)
                    .map(|i| chunk.min(size.saturating_sub(i * chunk)))
                    .collect()
            }
        }
    };
    if sizes.iter().sum::<usize>() != size {
        return Err(c.bad(format!("split {sizes:?} does not add up to {size}")));
    }
    let mut out = Vec::new();
    let mut start = 0;
    for s in sizes {
        out.push(Val::node(c.slice(x, dim, start, start + s, 1)?));
        start += s;
    }
    Ok(out)
}

/// Clamped slice bounds of one axis (ONNX's rules), as a list of indices
/// when the step is negative.
enum Range1 {
    Forward {
        start: usize,
        end: usize,
        step: usize,
    },
    Indices(Vec<i64>),
}

fn slice_range(size: i64, start: i64, end: i64, step: i64) -> Range1 {
    let norm = |v: i64| if v < 0 { v.saturating_add(size) } else { v };
    if step > 0 {
        let s = norm(start).clamp(0, size);
        let e = norm(end).clamp(0, size);
        Range1::Forward {
            start: s as usize,
            end: e.max(s) as usize,
            step: step as usize,
        }
    } else {
        let s = norm(start).clamp(0, size - 1);
        let e = norm(end).clamp(-1, size - 1);
        let mut idx = Vec::new();
        let mut i = s;
        while i > e {
            idx.push(i);
            i += step;
        }
        Range1::Indices(idx)
    }
}

fn slice(c: &mut Ctx) -> Result<Vec<Val>> {
    let (starts, ends, axes, steps) = if c.opset < 10 {
        (
            c.attr_ints("starts").unwrap_or_default(),
            c.attr_ints("ends").unwrap_or_default(),
            c.attr_ints("axes"),
            None,
        )
    } else {
        let starts = c.ints(1, "starts")?;
        let ends = c.ints(2, "ends")?;
        let axes = if c.has_input(3) {
            Some(c.ints(3, "axes")?)
        } else {
            None
        };
        let steps = if c.has_input(4) {
            Some(c.ints(4, "steps")?)
        } else {
            None
        };
        (starts, ends, axes, steps)
    };
    let n = starts.len();
    if ends.len() != n {
        return Err(c.bad(format!(
            "starts {starts:?} and ends {ends:?} differ in length"
        )));
    }
    let steps = steps.unwrap_or_else(|| vec![1; n]);
    let axes = axes.unwrap_or_else(|| (0..n as i64).collect());
    if axes.len() != n || steps.len() != n {
        return Err(c.bad("starts, ends, axes and steps differ in length"));
    }
    if let Some(&0) = steps.iter().find(|&&s| s == 0) {
        return Err(c.bad("a step of 0"));
    }
    // A slice of a dims value.
    if let Some(d) = c.val(0)?.dims.clone() {
        if !d.scalar && n == 1 {
            let size = d.dims.len() as i64;
            if let Range1::Forward { start, end, step } =
                slice_range(size, starts[0], ends[0], steps[0])
            {
                let dims = d.dims[start..end].iter().step_by(step).cloned().collect();
                return Ok(vec![dims_val(c, dims, false)]);
            }
        }
    }
    let mut x = c.x(0)?;
    let rank = c.rank(x);
    for k in 0..n {
        let dim = c.axis(axes[k], rank)?;
        let size = match c.dims(x)[dim].clone() {
            Dim::Const(s) => s,
            sym => {
                // A symbolic dim: whole, or `0..size−k`.
                let (s, e, st) = (starts[k], ends[k], steps[k]);
                if s == 0 && st == 1 && e >= i32::MAX as i64 {
                    continue;
                }
                if s == 0 && st == 1 && e < 0 {
                    let end = sym.checked_sub(&Dim::Const(e.unsigned_abs() as usize));
                    if let Some(end) = end {
                        x = c.add(
                            Op::Slice {
                                dim,
                                start: 0,
                                end,
                                step: 1,
                            },
                            &[x],
                        )?;
                        continue;
                    }
                }
                return Err(c.unsupported(format!(
                    "slicing {s}..{e} step {st} of symbolic dim {dim} of {}",
                    c.ty(x)
                )));
            }
        };
        x = match slice_range(size as i64, starts[k], ends[k], steps[k]) {
            Range1::Forward { start, end, step } => c.slice(x, dim, start, end, step)?,
            Range1::Indices(idx) => {
                let i = c.int_constant(&idx, false)?;
                c.add(Op::IndexSelect { dim }, &[x, i])?
            }
        };
    }
    one(x)
}

fn expand(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let target = c.dims_input(1, "the shape")?;
    let target: Vec<Dim> = target
        .into_iter()
        .map(|d| match d {
            DimOrNeg::Dim(d) => Ok(d),
            DimOrNeg::Neg(v) => Err(c.bad(format!("shape entry {v}"))),
        })
        .collect::<Result<_>>()?;
    let shape = tessera::ir::broadcast_shapes(&c.ty(x).shape, &Shape::new(target.clone()))
        .ok_or_else(|| {
            c.bad(format!(
                "cannot broadcast {} to {}",
                c.ty(x),
                Shape::new(target)
            ))
        })?;
    one(c.expand(x, shape.0)?)
}

fn tile(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let reps = c.ints(1, "repeats")?;
    let dims = c.dims(x);
    if reps.len() != dims.len() || reps.iter().any(|&r| r < 0) {
        return Err(c.bad(format!("repeats {reps:?} for {}", c.ty(x))));
    }
    let mut inter = Vec::new();
    let mut big = Vec::new();
    let mut out = Vec::new();
    for (d, &r) in dims.iter().zip(&reps) {
        inter.extend([Dim::Const(1), d.clone()]);
        big.extend([Dim::Const(r as usize), d.clone()]);
        out.push(
            d.checked_mul(&Dim::Const(r as usize))
                .ok_or_else(|| c.bad("the tiled size overflows"))?,
        );
    }
    let y = c.reshape(x, inter)?;
    let y = c.expand(y, big)?;
    let y = c.add(Op::Contiguous, &[y])?;
    one(c.reshape(y, out)?)
}

/// Indices with negative entries counted from the end of a dim of size `n`.
fn normalise_indices(c: &mut Ctx, idx: NodeId, n: &Dim) -> Result<NodeId> {
    if let Some(lit) = c.fold(idx)? {
        if let Some(n) = n.as_const() {
            let mut v = lit_ints(&lit);
            for i in v.iter_mut() {
                if *i < 0 {
                    *i += n as i64;
                }
            }
            return c.constant(Literal {
                dtype: lit.dtype,
                shape: lit.shape,
                data: LiteralData::Int(v),
            });
        }
    }
    let n = n
        .as_const()
        .ok_or_else(|| c.unsupported("indices into a symbolic dim"))?;
    let neg = c.compare_c(C::Lt, idx, 0.0)?;
    let wrapped = c.binary_c(B::Add, idx, n as f64)?;
    c.where_(neg, wrapped, idx)
}

fn gather(c: &mut Ctx) -> Result<Vec<Val>> {
    // Entries of a dims value picked by constant indices.
    if let Some(d) = c.val(0)?.dims.clone() {
        if let Some(idx) = known_entries(c, 1)?.and_then(|i| i.ints().map(|v| (v, i.scalar))) {
            let len = d.dims.len() as i64;
            let picked = idx
                .0
                .iter()
                .map(|&i| {
                    let j = if i < 0 { i + len } else { i };
                    d.dims
                        .get(j as usize)
                        .cloned()
                        .ok_or_else(|| c.bad(format!("index {i}")))
                })
                .collect::<Result<Vec<_>>>()?;
            return Ok(vec![dims_val(c, picked, idx.1)]);
        }
    }
    let x = c.x(0)?;
    let idx = c.x(1)?;
    let rank = c.rank(x);
    let dim = c.axis(c.attr_i("axis", 0), rank)?;
    let n = c.dims(x)[dim].clone();
    let idx = normalise_indices(c, idx, &n)?;
    let idx_dims = c.dims(idx);
    let count = idx_dims
        .iter()
        .try_fold(Dim::Const(1), |a, d| a.checked_mul(d))
        .ok_or_else(|| c.bad("the indices' size overflows"))?;
    let flat = c.reshape(idx, vec![count])?;
    let picked = c.add(Op::IndexSelect { dim }, &[x, flat])?;
    let xd = c.dims(x);
    let mut out: Vec<Dim> = xd[..dim].to_vec();
    out.extend(idx_dims);
    out.extend(xd[dim + 1..].iter().cloned());
    one(c.reshape(picked, out)?)
}

fn gather_elements(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let idx = c.x(1)?;
    let rank = c.rank(x);
    let dim = c.axis(c.attr_i("axis", 0), rank)?;
    let n = c.dims(x)[dim].clone();
    let idx = normalise_indices(c, idx, &n)?;
    one(c.add(Op::Gather { dim }, &[x, idx])?)
}

fn shape(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let dims = c.dims(x);
    let rank = dims.len() as i64;
    let clampi = |v: i64| (if v < 0 { v + rank } else { v }).clamp(0, rank) as usize;
    let start = clampi(c.attr_i("start", 0));
    let end = c.attr("end").map_or(rank as usize, |a| clampi(a.i));
    let picked = dims[start..end.max(start)]
        .iter()
        .cloned()
        .map(DimOrNeg::Dim)
        .collect();
    Ok(vec![dims_val(c, picked, false)])
}

fn size(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let n = c
        .ty(x)
        .shape
        .checked_numel()
        .ok_or_else(|| c.bad("the size overflows"))?;
    Ok(vec![dims_val(c, vec![DimOrNeg::Dim(n)], true)])
}

fn constant(c: &mut Ctx) -> Result<Vec<Val>> {
    let f32s = |v: &[f32]| LiteralData::Float(v.iter().map(|&x| x as f64).collect());
    let lit = if let Some(t) = c.attr_tensor("value") {
        crate::tensor::read_literal(t, None, "the constant")
            .map_err(|e| c.unsupported(e.message))?
    } else if let Some(a) = c.attr("value_float") {
        Literal::scalar(Scalar::Float(a.f as f64), DType::F32)
    } else if let Some(a) = c.attr("value_int") {
        Literal::scalar(Scalar::Int(a.i), DType::I64)
    } else if let Some(a) = c.attr("value_floats") {
        Literal {
            dtype: DType::F32,
            shape: vec![a.floats.len()],
            data: f32s(&a.floats),
        }
    } else if let Some(a) = c.attr("value_ints") {
        Literal {
            dtype: DType::I64,
            shape: vec![a.ints.len()],
            data: LiteralData::Int(a.ints.clone()),
        }
    } else {
        let which = c
            .node
            .attribute
            .first()
            .map_or("none".into(), |a| a.name.clone());
        return Err(c.unsupported(format!("a constant given by attribute `{which}`")));
    };
    let small_ints = lit.dtype == DType::I64 && lit.shape.len() <= 1;
    let entries = small_ints.then(|| lit_ints(&lit));
    let scalar = lit.shape.is_empty();
    let id = c.constant(lit)?;
    Ok(vec![Val {
        id: Some(id),
        dims: entries.map(|e| DimsVal {
            dims: e.into_iter().map(DimOrNeg::from_int).collect(),
            scalar,
        }),
    }])
}

fn constant_of_shape(c: &mut Ctx) -> Result<Vec<Val>> {
    let dims: Vec<Dim> = c
        .dims_input(0, "the shape")?
        .into_iter()
        .map(|d| match d {
            DimOrNeg::Dim(d) => Ok(d),
            DimOrNeg::Neg(v) => Err(c.bad(format!("shape entry {v}"))),
        })
        .collect::<Result<_>>()?;
    let (value, dtype) = match c.attr_tensor("value") {
        Some(t) => {
            let lit = crate::tensor::read_literal(t, None, "the value")
                .map_err(|e| c.unsupported(e.message))?;
            let v = match lit.data {
                LiteralData::Float(v) => v.first().map(|&x| Scalar::Float(x)),
                LiteralData::Int(v) => v.first().map(|&x| Scalar::Int(x)),
                LiteralData::Bool(v) => v.first().map(|&x| Scalar::Bool(x)),
            }
            .ok_or_else(|| c.bad("attribute `value` holds no value"))?;
            (v, lit.dtype)
        }
        None => (Scalar::Float(0.0), DType::F32),
    };
    one(c.add(
        Op::Full {
            value,
            shape: Shape::new(dims),
            dtype,
        },
        &[],
    )?)
}

/// Most elements a `Range` or `EyeLike` computed at import may have (its
/// values are a constant of the graph): 2^24, 128 MiB as f64 while
/// computed.
const MAX_IMPORT_CONSTANT: usize = 1 << 24;
const MAX_RANGE: f64 = MAX_IMPORT_CONSTANT as f64;

fn range(c: &mut Ctx) -> Result<Vec<Val>> {
    let dtype = c.literal_of(0, "start")?.dtype;
    let s = c.float_scalar(0, "start")?;
    let l = c.float_scalar(1, "limit")?;
    let d = c.float_scalar(2, "delta")?;
    if d == 0.0 || !d.is_finite() || !s.is_finite() || !l.is_finite() {
        return Err(c.bad(format!("start {s}, limit {l}, delta {d}: no range")));
    }
    let count = ((l - s) / d).ceil().max(0.0);
    if count > MAX_RANGE {
        return Err(c.unsupported(format!(
            "start {s}, limit {l}, delta {d}: {count} elements, more than tessera computes \
             at import ({MAX_RANGE})"
        )));
    }
    let n = count as usize;
    // Values start + i·delta, computed exactly as ONNX's reference does.
    let data =
        if dtype.is_float() {
            LiteralData::Float((0..n).map(|i| s + i as f64 * d).collect())
        } else {
            let (s, d) = (c.int_scalar(0, "start")?, c.int_scalar(2, "delta")?);
            let values: Option<Vec<i64>> = (0..n as i64)
                .map(|i| i.checked_mul(d).and_then(|v| v.checked_add(s)))
                .collect();
            LiteralData::Int(values.ok_or_else(|| {
                c.bad(format!("start {s}, delta {d}: the range overflows {dtype}"))
            })?)
        };
    let lit = Literal {
        dtype,
        shape: vec![n],
        data,
    };
    // Rounded to the dtype by a cast of the f64 values.
    one(c.constant(lit)?)
}

fn eye_like(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let d = c.concrete(x, "EyeLike")?;
    if d.len() != 2 {
        return Err(c.bad(format!("needs a 2-D input, got {}", c.ty(x))));
    }
    let dtype = match c.attr("dtype") {
        Some(a) => crate::tensor::dtype_of(a.i as i32, "the dtype")
            .map_err(|e| c.unsupported(e.message))?,
        None => c.dtype(x),
    };
    let k = c.attr_i("k", 0);
    let elements = d[0].checked_mul(d[1]).filter(|&n| n <= MAX_IMPORT_CONSTANT);
    let Some(elements) = elements else {
        return Err(c.unsupported(format!(
            "an identity of {} × {} elements, computed at import, is more than {MAX_IMPORT_CONSTANT}",
            d[0], d[1]
        )));
    };
    let mut v = vec![0.0; elements];
    for i in 0..d[0] as i64 {
        let j = i + k;
        if (0..d[1] as i64).contains(&j) {
            v[i as usize * d[1] + j as usize] = 1.0;
        }
    }
    let data = if dtype.is_float() {
        LiteralData::Float(v)
    } else if dtype.is_int() {
        LiteralData::Int(v.iter().map(|&x| x as i64).collect())
    } else {
        LiteralData::Bool(v.iter().map(|&x| x != 0.0).collect())
    };
    one(c.constant(Literal {
        dtype,
        shape: d,
        data,
    })?)
}

fn trilu(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let k = if c.has_input(1) {
        c.int_scalar(1, "k")?
    } else {
        0
    };
    let op = if c.attr_i("upper", 1) != 0 {
        Op::Triu { diagonal: k }
    } else {
        Op::Tril { diagonal: k }
    };
    one(c.add(op, &[x])?)
}

fn one_hot(c: &mut Ctx) -> Result<Vec<Val>> {
    let idx = c.x(0)?;
    let depth = c.float_scalar(1, "depth")? as i64;
    let values = c.x(2)?;
    if depth < 0 {
        return Err(c.bad(format!("depth {depth}")));
    }
    if c.dims(values) != [Dim::Const(2)] {
        return Err(c.bad(format!(
            "`values` must be [off, on] (2 elements), got {}",
            c.ty(values)
        )));
    }
    let rank = c.rank(idx);
    let axis = c.axis(c.attr_i("axis", -1), rank + 1)?;
    // Indices as i64 (floats truncate), negatives from the end.
    let i = c.cast(idx, DType::I64)?;
    let neg = c.compare_c(C::Lt, i, 0.0)?;
    let wrapped = c.binary_c(B::Add, i, depth as f64)?;
    let i = c.where_(neg, wrapped, i)?;
    let i = c.unsqueeze(i, axis)?;
    let r = c.add(
        Op::Arange {
            start: 0.0,
            end: depth as f64,
            step: 1.0,
            dtype: DType::I64,
        },
        &[],
    )?;
    let mut rs = vec![Dim::Const(1); rank + 1];
    rs[axis] = Dim::Const(depth as usize);
    let r = c.reshape(r, rs)?;
    let hit = c.compare(C::Eq, i, r)?;
    let off = c.slice(values, 0, 0, 1, 1)?;
    let on = c.slice(values, 0, 1, 2, 1)?;
    let off = c.reshape(off, vec![])?;
    let on = c.reshape(on, vec![])?;
    one(c.where_(hit, on, off)?)
}

fn pad(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let rank = c.rank(x);
    let mode = c.attr_s("mode", "constant");
    let (pads, value, axes) = if c.opset < 11 {
        let pads = c
            .attr_ints("pads")
            .or_else(|| c.attr_ints("paddings"))
            .unwrap_or_default();
        let v = c.attr_f("value", 0.0);
        let v = c.scalar_like(v, x)?;
        (pads, v, None)
    } else {
        let pads = c.ints(1, "pads")?;
        let v = if c.has_input(2) {
            let v = c.x(2)?;
            c.reshape(v, vec![])?
        } else {
            c.scalar_like(0.0, x)?
        };
        let axes = if c.has_input(3) {
            Some(c.ints(3, "axes")?)
        } else {
            None
        };
        (pads, v, axes)
    };
    let axes: Vec<usize> = match axes {
        Some(a) => a.iter().map(|&v| c.axis(v, rank)).collect::<Result<_>>()?,
        None => (0..rank).collect(),
    };
    if pads.len() != 2 * axes.len() {
        return Err(c.bad(format!("pads {pads:?} for {} axes", axes.len())));
    }
    let mut y = x;
    for (k, &dim) in axes.iter().enumerate() {
        let (before, after) = (pads[k], pads[k + axes.len()]);
        if before == 0 && after == 0 {
            continue;
        }
        // Negative pads crop first.
        if before < 0 || after < 0 {
            let n = c.concrete(y, "a negative pad")?[dim] as i64;
            let s = (-before).max(0);
            let e = n - (-after).max(0);
            if e < s {
                return Err(c.bad(format!("pads {pads:?} crop more than dim {dim} holds")));
            }
            y = c.slice(y, dim, s as usize, e as usize, 1)?;
        }
        let (b, a) = (before.max(0) as usize, after.max(0) as usize);
        if b == 0 && a == 0 {
            continue;
        }
        let mut parts = Vec::new();
        let piece = |c: &mut Ctx, count: usize, front: bool| -> Result<Option<NodeId>> {
            if count == 0 {
                return Ok(None);
            }
            Ok(Some(match mode.as_str() {
                "constant" => {
                    let mut s = c.dims(y);
                    s[dim] = Dim::Const(count);
                    c.expand(value, s)?
                }
                "reflect" | "edge" | "wrap" => {
                    let n = c.concrete(y, "a reflect, edge or wrap pad")?[dim] as i64;
                    if n == 0 || (mode == "reflect" && n < 2) {
                        return Err(c.bad(format!("{mode} pad of an axis of size {n}")));
                    }
                    let count = count as i64;
                    let idx: Vec<i64> = match (mode.as_str(), front) {
                        ("edge", true) => vec![0; count as usize],
                        ("edge", false) => vec![n - 1; count as usize],
                        ("reflect", true) => (0..count).map(|i| reflect(count - i, n)).collect(),
                        ("reflect", false) => (0..count).map(|i| reflect(n - 2 - i, n)).collect(),
                        (_, true) => (0..count).map(|i| (n - count + i).rem_euclid(n)).collect(),
                        (_, false) => (0..count).map(|i| i.rem_euclid(n)).collect(),
                    };
                    let i = c.int_constant(&idx, false)?;
                    c.add(Op::IndexSelect { dim }, &[y, i])?
                }
                other => return Err(c.unsupported(format!("pad mode `{other}`"))),
            }))
        };
        if let Some(p) = piece(c, b, true)? {
            parts.push(p);
        }
        parts.push(y);
        if let Some(p) = piece(c, a, false)? {
            parts.push(p);
        }
        y = c.cat(&parts, dim)?;
    }
    one(y)
}

/// Index `i` reflected into `0..n` (no edge repeat).
fn reflect(i: i64, n: i64) -> i64 {
    let period = 2 * (n - 1);
    let m = i.rem_euclid(period);
    if m < n {
        m
    } else {
        period - m
    }
}

fn depth_to_space(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let d = c.concrete(x, "DepthToSpace")?;
    let blocksize = c.attr_i("blocksize", 0);
    let b = usize::try_from(blocksize).unwrap_or(0);
    let square = b.checked_mul(b).filter(|&s| s > 0);
    let Some(square) = square.filter(|&s| d.len() == 4 && d[1] % s == 0) else {
        return Err(c.bad(format!("blocksize {blocksize} for {}", c.ty(x))));
    };
    let (n, ch, h, w) = (d[0], d[1], d[2], d[3]);
    let oc = ch / square;
    let crd = c.attr_s("mode", "DCR") == "CRD";
    let (inner, perm) = if crd {
        (vec![n, oc, b, b, h, w], vec![0, 1, 4, 2, 5, 3])
    } else {
        (vec![n, b, b, oc, h, w], vec![0, 3, 4, 1, 5, 2])
    };
    let y = c.reshape(x, inner.into_iter().map(Dim::Const).collect())?;
    let y = c.permute(y, perm)?;
    let y = c.add(Op::Contiguous, &[y])?;
    one(c.reshape(
        y,
        [n, oc, h * b, w * b].into_iter().map(Dim::Const).collect(),
    )?)
}

fn space_to_depth(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let d = c.concrete(x, "SpaceToDepth")?;
    let blocksize = c.attr_i("blocksize", 0);
    let b = usize::try_from(blocksize).unwrap_or(0);
    if d.len() != 4 || b == 0 || d[2] % b != 0 || d[3] % b != 0 {
        return Err(c.bad(format!("blocksize {blocksize} for {}", c.ty(x))));
    }
    let (n, ch, h, w) = (d[0], d[1], d[2], d[3]);
    let y = c.reshape(
        x,
        [n, ch, h / b, b, w / b, b]
            .into_iter()
            .map(Dim::Const)
            .collect(),
    )?;
    // DCR: channel (bh·b + bw)·C + c; CRD (opset 28): c·b² + bh·b + bw.
    let perm = if c.attr_s("mode", "DCR") == "CRD" {
        vec![0, 1, 3, 5, 2, 4]
    } else {
        vec![0, 3, 5, 1, 2, 4]
    };
    let y = c.permute(y, perm)?;
    let y = c.add(Op::Contiguous, &[y])?;
    one(c.reshape(
        y,
        [n, ch * b * b, h / b, w / b]
            .into_iter()
            .map(Dim::Const)
            .collect(),
    )?)
}

/// Integer arithmetic on dims values (`Shape(x)[0] * 4`), kept symbolic;
/// `None` when neither operand is a dims value with a symbolic entry.
pub(super) fn dims_arith(c: &mut Ctx, op: B) -> Result<Option<Val>> {
    if !any_symbolic(c) || c.node.input.len() != 2 {
        return Ok(None);
    }
    let (Some(a), Some(b)) = (known_entries(c, 0)?, known_entries(c, 1)?) else {
        return Err(
            c.unsupported("arithmetic on a symbolic shape and a value unknown at import time")
        );
    };
    let n = a.dims.len().max(b.dims.len());
    let pick = |d: &DimsVal, i: usize| d.dims[if d.dims.len() == 1 { 0 } else { i }].clone();
    if (a.dims.len() != n && a.dims.len() != 1) || (b.dims.len() != n && b.dims.len() != 1) {
        return Err(c.bad("operands of different lengths"));
    }
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let (x, y) = (pick(&a, i), pick(&b, i));
        let r = match (&x, &y) {
            (DimOrNeg::Dim(x), DimOrNeg::Dim(y)) => match op {
                B::Add => x.checked_add(y),
                B::Sub => x.checked_sub(y),
                B::Mul => x.checked_mul(y),
                B::Div => x.div_exact(y),
                _ => None,
            }
            .map(DimOrNeg::Dim),
            _ => match (x.as_int(), y.as_int()) {
                (Some(p), Some(q)) => match op {
                    B::Add => p.checked_add(q),
                    B::Sub => p.checked_sub(q),
                    B::Mul => p.checked_mul(q),
                    B::Div if q != 0 => Some(p / q),
                    _ => None,
                }
                .map(DimOrNeg::from_int),
                _ => None,
            },
        };
        out.push(r.ok_or_else(|| {
            c.unsupported(format!("{} of symbolic sizes {x} and {y}", op.name()))
        })?);
    }
    Ok(Some(dims_val(c, out, a.scalar && b.scalar)))
}
