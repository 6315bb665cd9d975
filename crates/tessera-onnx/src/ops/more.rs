//! Ops built from gathers, scatters and repeated arg-reductions: TopK,
//! GatherND, ScatterElements, Compress, CumProd, RotaryEmbedding, SwiGLU.

use tessera::ir::{
    ArgReduceOp, BinaryOp as B, CompareOp as C, Dim, Literal, LiteralData, NodeId, Op, Scalar,
    Shape, UnaryOp as U,
};
use tessera::{DType, Result};

use super::{one, Converter};
use crate::builder::{lit_ints, Ctx, Val};

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "TopK" => top_k,
        "GatherND" => gather_nd,
        "ScatterND" => scatter_nd,
        "ScatterElements" | "Scatter" => scatter_elements,
        "Compress" => compress,
        "CumProd" => cumprod,
        "RotaryEmbedding" => rotary,
        "SwiGLU" => swiglu,
        "CausalConvWithState" => causal_conv,
        "AffineGrid" => affine_grid,
        "ReverseSequence" => reverse_sequence,
        "LinearAttention" => linear_attention,
        _ => return None,
    })
}

/// The k largest (or smallest) along an axis, in order, ties to the lower
/// index: k rounds of arg-max, each taking its winner out of the running.
/// k is known at import and at most 64.
fn top_k(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let k = if c.opset >= 10 {
        c.int_scalar(1, "k")?
    } else {
        c.attr_i("k", 0)
    };
    let rank = c.rank(x);
    let dim = c.axis(c.attr_i("axis", -1), rank)?;
    let n = c.dims(x)[dim]
        .as_const()
        .ok_or_else(|| c.unsupported("TopK over a symbolic dim"))?;
    if k < 0 || k as usize > n {
        return Err(c.bad(format!("k = {k} for a dim of {n}")));
    }
    if k > 64 {
        return Err(c.unsupported(format!("k = {k} (at most 64: tessera has no sort)")));
    }
    let largest = c.attr_i("largest", 1) != 0;
    let dtype = c.dtype(x);

    let op = if largest {
        ArgReduceOp::ArgMax
    } else {
        ArgReduceOp::ArgMin
    };
    let mut shape1 = vec![Dim::Const(1); rank];
    shape1[dim] = Dim::Const(n);
    let r = c.add(
        Op::Arange {
            start: 0.0,
            end: n as f64,
            step: 1.0,
            dtype: DType::I64,
        },
        &[],
    )?;
    let r = c.reshape(r, shape1)?;
    // The value a taken element is replaced by: one no other beats.
    let gone = match dtype.int_range() {
        Some((lo, hi)) => c.constant(Literal {
            dtype,
            shape: Vec::new(),
            // A u64 travels as its bit pattern in i64.
            data: LiteralData::Int(vec![if largest { lo } else { hi } as u64 as i64]),
        })?,
        None => c.scalar(
            if largest {
                f64::NEG_INFINITY
            } else {
                f64::INFINITY
            },
            dtype,
        )?,
    };
    let mut running = x;
    let (mut values, mut indices) = (Vec::new(), Vec::new());
    for _ in 0..k {
        let i = c.add(
            Op::ArgReduce {
                op,
                dim,
                keepdim: true,
            },
            &[running],
        )?;
        let v = c.add(Op::Gather { dim }, &[x, i])?;
        values.push(v);
        indices.push(i);
        let hit = c.compare(C::Eq, r, i)?;
        running = c.where_(hit, gone, running)?;
    }
    if k == 0 {
        let mut s = c.dims(x);
        s[dim] = Dim::Const(0);
        let v = c.slice(x, dim, 0, 0, 1)?;
        let i = c.add(
            Op::Full {
                value: Scalar::Int(0),
                shape: Shape::new(s),
                dtype: DType::I64,
            },
            &[],
        )?;
        return Ok(vec![Val::node(v), Val::node(i)]);
    }
    let v = c.cat(&values, dim)?;
    let i = c.cat(&indices, dim)?;
    Ok(vec![Val::node(v), Val::node(i)])
}

/// GatherND: each index tuple (the last dim of `indices`) addresses a
/// slice of `data` after `batch_dims` shared leading dims; one row gather
/// of the flattened data with linear indices.
fn gather_nd(c: &mut Ctx) -> Result<Vec<Val>> {
    let (data, idx) = (c.x(0)?, c.x(1)?);
    let dd = c.concrete(data, "GatherND")?;
    let id = c.concrete(idx, "GatherND")?;
    let b = c.attr_i("batch_dims", 0) as usize;
    let m = *id.last().ok_or_else(|| c.bad("scalar indices"))?;
    if id.len() < b + 1 || dd.len() < b + m || dd[..b] != id[..b] {
        return Err(c.bad(format!(
            "indices {:?} for data {:?} with batch_dims {b}",
            id, dd
        )));
    }
    let batch: usize = dd[..b].iter().product();
    let inner: Vec<usize> = dd[b..b + m].to_vec();
    let rest: Vec<usize> = dd[b + m..].to_vec();
    let per_batch: usize = inner.iter().product();
    let tuples: usize = id[b..id.len() - 1].iter().product();
    // Linear index = batch · per_batch + Σ idx_t · stride_t (negatives from the end).
    let idx = c.cast(idx, DType::I64)?;
    let flat_idx = c.reshape(idx, vec![Dim::Const(batch * tuples), Dim::Const(m)])?;
    let mut lin: Option<NodeId> = None;
    let mut stride = per_batch;
    for (t, &size) in inner.iter().enumerate() {
        stride /= size.max(1);
        let col = c.slice(flat_idx, 1, t, t + 1, 1)?;
        let neg = c.compare_c(C::Lt, col, 0.0)?;
        let wrapped = c.binary_c(B::Add, col, size as f64)?;
        let col = c.where_(neg, wrapped, col)?;
        let term = c.binary_c(B::Mul, col, stride as f64)?;
        lin = Some(match lin {
            Some(l) => c.binary(B::Add, l, term)?,
            None => term,
        });
    }
    let offsets: Vec<i64> = (0..batch * tuples)
        .map(|r| ((r / tuples.max(1)) * per_batch) as i64)
        .collect();
    let off = c.constant(Literal {
        dtype: DType::I64,
        shape: vec![batch * tuples, 1],
        data: LiteralData::Int(offsets),
    })?;
    let lin = match lin {
        Some(l) => c.binary(B::Add, l, off)?,
        None => off,
    };
    let lin = c.reshape(lin, vec![Dim::Const(batch * tuples)])?;
    let mut flat_shape = vec![Dim::Const(batch * per_batch)];
    flat_shape.extend(rest.iter().map(|&v| Dim::Const(v)));
    let flat = c.reshape(data, flat_shape)?;
    let picked = c.add(Op::IndexSelect { dim: 0 }, &[flat, lin])?;
    let mut out: Vec<Dim> = id[..id.len() - 1].iter().map(|&v| Dim::Const(v)).collect();
    out.extend(rest.iter().map(|&v| Dim::Const(v)));
    one(c.reshape(picked, out)?)
}

/// ScatterElements with `reduction` none (indices assumed unique, as ONNX
/// requires) or add; the others are not mapped.
fn scatter_elements(c: &mut Ctx) -> Result<Vec<Val>> {
    let (data, idx, upd) = (c.x(0)?, c.x(1)?, c.x(2)?);
    let rank = c.rank(data);
    let dim = c.axis(c.attr_i("axis", 0), rank)?;
    let n = c.dims(data)[dim]
        .clone()
        .as_const()
        .ok_or_else(|| c.unsupported("a symbolic scatter dim"))?;
    let idx = c.cast(idx, DType::I64)?;
    let neg = c.compare_c(C::Lt, idx, 0.0)?;
    let wrapped = c.binary_c(B::Add, idx, n as f64)?;
    let idx = c.where_(neg, wrapped, idx)?;
    let reduction = c.attr_s("reduction", "none");
    match reduction.as_str() {
        "add" => one(c.add(Op::ScatterAdd { dim }, &[data, idx, upd])?),
        "none" => {
            let dtype = c.dtype(data);
            let zero = c.scalar(0.0, dtype)?;
            let zeros = c.expand(zero, c.dims(data))?;
            let placed = c.add(Op::ScatterAdd { dim }, &[zeros, idx, upd])?;
            let ones = c.scalar(1.0, DType::F32)?;
            let ones = c.expand(ones, c.dims(idx))?;
            let fz = c.scalar(0.0, DType::F32)?;
            let fzeros = c.expand(fz, c.dims(data))?;
            let hits = c.add(Op::ScatterAdd { dim }, &[fzeros, idx, ones])?;
            let hit = c.compare_c(C::Gt, hits, 0.0)?;
            one(c.where_(hit, placed, data)?)
        }
        "mul" | "max" | "min" => scatter_reduce(c, data, idx, upd, dim, &reduction),
        other => Err(c.bad(format!("reduction `{other}`"))),
    }
}

/// Scatter with `mul`, `max` or `min`: with the axis last, each update is
/// compared with every position (`[…, J, N]`), the matches reduced over
/// the updates (the reduction's identity elsewhere) and combined with the
/// data. Needs the indices to span the data in every other dim.
fn scatter_reduce(
    c: &mut Ctx,
    data: NodeId,
    idx: NodeId,
    upd: NodeId,
    dim: usize,
    how: &str,
) -> Result<Vec<Val>> {
    let dd = c.concrete(data, "ScatterElements")?;
    let id = c.concrete(idx, "ScatterElements")?;
    let rank = dd.len();
    if (0..rank).any(|i| i != dim && dd[i] != id[i]) {
        return Err(c.unsupported(format!(
            "reduction `{how}` with indices {:?} smaller than the data {:?}",
            id, dd
        )));
    }
    let mut perm: Vec<usize> = (0..rank).filter(|&i| i != dim).collect();
    perm.push(dim);
    let (d2, i2, u2) = (
        c.permute(data, perm.clone())?,
        c.permute(idx, perm.clone())?,
        c.permute(upd, perm.clone())?,
    );
    let (n, j) = (dd[dim], id[dim]);
    let i3 = c.unsqueeze(i2, rank)?;
    let u3 = c.unsqueeze(u2, rank)?;
    let mut rs = vec![Dim::Const(1); rank + 1];
    rs[rank] = Dim::Const(n);
    let r = c.add(
        Op::Arange {
            start: 0.0,
            end: n as f64,
            step: 1.0,
            dtype: DType::I64,
        },
        &[],
    )?;
    let r = c.reshape(r, rs)?;
    let hit = c.compare(C::Eq, i3, r)?;
    let dtype = c.dtype(data);
    let (identity, op, combine) = match how {
        "mul" => (1.0, tessera::ir::ReduceOp::Prod, B::Mul),
        "max" => (
            if dtype.is_float() {
                f64::NEG_INFINITY
            } else {
                i64::MIN as f64
            },
            tessera::ir::ReduceOp::Max,
            B::Maximum,
        ),
        _ => (
            if dtype.is_float() {
                f64::INFINITY
            } else {
                i64::MAX as f64
            },
            tessera::ir::ReduceOp::Min,
            B::Minimum,
        ),
    };
    let idv = c.scalar(identity, dtype)?;
    let vals = c.where_(hit, u3, idv)?;
    let _ = j;
    let red = c.add(
        Op::Reduce {
            op,
            dims: vec![rank - 1],
            keepdim: false,
        },
        &[vals],
    )?;
    let out = c.binary(combine, d2, red)?;
    let mut back = vec![0; rank];
    for (i, &p) in perm.iter().enumerate() {
        back[p] = i;
    }
    one(c.permute(out, back)?)
}

/// Compress with a condition known at import (a constant, or a given
/// input: the graph is specialised to it).
fn compress(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let cond = lit_ints(&c.literal_of(1, "the condition")?);
    let (x, dim) = match c.attr("axis").map(|a| a.i) {
        Some(a) => (x, c.axis(a, c.rank(x))?),
        None => {
            let n = c
                .ty(x)
                .shape
                .checked_numel()
                .ok_or_else(|| c.bad("overflow"))?;
            (c.reshape(x, vec![n])?, 0)
        }
    };
    let keep: Vec<i64> = cond
        .iter()
        .enumerate()
        .filter(|(_, &v)| v != 0)
        .map(|(i, _)| i as i64)
        .collect();
    let size = c.concrete(x, "Compress")?[dim];
    if keep.iter().any(|&i| i as usize >= size) {
        return Err(c.bad(format!("a condition of {} for a dim of {size}", cond.len())));
    }
    let i = c.int_constant(&keep, false)?;
    one(c.add(Op::IndexSelect { dim }, &[x, i])?)
}

/// CumProd like CumSum: log₂(n) shifted products, ones shifted in.
fn cumprod(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let rank = c.rank(x);
    let axis = c.ints(1, "axis")?;
    let dim = c.axis(*axis.first().ok_or_else(|| c.bad("an empty axis"))?, rank)?;
    let n = c.dims(x)[dim]
        .as_const()
        .ok_or_else(|| c.unsupported("CumProd over a symbolic dim"))?;
    let (exclusive, rev) = (c.attr_i("exclusive", 0) != 0, c.attr_i("reverse", 0) != 0);
    let mut y = if rev {
        super::reduce::reverse(c, x, dim, n)?
    } else {
        x
    };
    let shift = |c: &mut Ctx, y: NodeId, k: usize| -> Result<NodeId> {
        let head = c.slice(y, dim, 0, n - k, 1)?;
        let mut s = c.dims(y);
        s[dim] = Dim::Const(k);
        let one_ = c.scalar_like(1.0, y)?;
        let ones = c.expand(one_, s)?;
        c.cat(&[ones, head], dim)
    };
    if exclusive && n > 0 {
        y = shift(c, y, 1)?;
    }
    let mut k = 1;
    while k < n {
        let s = shift(c, y, k)?;
        y = c.binary(B::Mul, y, s)?;
        k *= 2;
    }
    if rev {
        y = super::reduce::reverse(c, y, dim, n)?;
    }
    one(y)
}

/// RotaryEmbedding after ONNX's reference: rotate the first
/// `rotary_embedding_dim` features of each head by the cached angles.
fn rotary(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let (mut cos, mut sin) = (c.x(1)?, c.x(2)?);
    let xd = c.concrete(x, "RotaryEmbedding")?;
    if !(xd.len() == 3 || xd.len() == 4) {
        return Err(c.bad(format!("needs a 3-D or 4-D input, got {}", c.ty(x))));
    }
    let four = xd.len() == 4;
    // To [B, S, H, D].
    let y = if four {
        c.permute(x, vec![0, 2, 1, 3])?
    } else {
        let h = c.attr_i("num_heads", 0) as usize;
        if h == 0 || xd[2] % h != 0 {
            return Err(c.bad(format!("num_heads {h} for {}", c.ty(x))));
        }
        c.reshape(
            x,
            [xd[0], xd[1], h, xd[2] / h]
                .into_iter()
                .map(Dim::Const)
                .collect(),
        )?
    };
    let yd = c.concrete(y, "RotaryEmbedding")?;
    let head = yd[3];
    let rd = match c.attr_i("rotary_embedding_dim", 0) {
        0 => head,
        v => v as usize,
    };
    let half = rd / 2;
    if c.has_input(3) {
        let pos = c.x(3)?;
        let pd = c.concrete(pos, "position_ids")?;
        let count: usize = pd.iter().product();
        let flat = c.reshape(pos, vec![Dim::Const(count)])?;
        let gather = |c: &mut Ctx, t: NodeId| -> Result<NodeId> {
            let g = c.add(Op::IndexSelect { dim: 0 }, &[t, flat])?;
            let mut s: Vec<Dim> = pd.iter().map(|&v| Dim::Const(v)).collect();
            s.push(Dim::Const(half));
            c.reshape(g, s)
        };
        cos = gather(c, cos)?;
        sin = gather(c, sin)?;
    }
    let cd = c.concrete(cos, "cos_cache")?;
    if cd.last() != Some(&half) {
        return Err(c.bad(format!("a cos cache of {:?} for rotary dim {rd}", cd)));
    }
    let unsq = |c: &mut Ctx, t: NodeId| -> Result<NodeId> {
        let r = c.rank(t);
        c.unsqueeze(t, r - 1)
    };
    let (cos, sin) = (unsq(c, cos)?, unsq(c, sin)?);
    let rot = c.slice(y, 3, 0, rd, 1)?;
    let (x1, x2) = if c.attr_i("interleaved", 0) != 0 {
        (c.slice(rot, 3, 0, rd, 2)?, c.slice(rot, 3, 1, rd, 2)?)
    } else {
        (c.slice(rot, 3, 0, half, 1)?, c.slice(rot, 3, half, rd, 1)?)
    };
    let a = c.binary(B::Mul, cos, x1)?;
    let b = c.binary(B::Mul, sin, x2)?;
    let real = c.binary(B::Sub, a, b)?;
    let a = c.binary(B::Mul, sin, x1)?;
    let b = c.binary(B::Mul, cos, x2)?;
    let imag = c.binary(B::Add, a, b)?;
    let rotated = if c.attr_i("interleaved", 0) != 0 {
        let r5 = c.unsqueeze(real, 4)?;
        let i5 = c.unsqueeze(imag, 4)?;
        let j = c.cat(&[r5, i5], 4)?;
        let mut s: Vec<Dim> = yd[..3].iter().map(|&v| Dim::Const(v)).collect();
        s.push(Dim::Const(rd));
        c.reshape(j, s)?
    } else {
        c.cat(&[real, imag], 3)?
    };
    let out = if rd < head {
        let pass = c.slice(y, 3, rd, head, 1)?;
        c.cat(&[rotated, pass], 3)?
    } else {
        rotated
    };
    one(if four {
        c.permute(out, vec![0, 2, 1, 3])?
    } else {
        let o = c.add(Op::Contiguous, &[out])?;
        c.reshape(o, xd.iter().map(|&v| Dim::Const(v)).collect())?
    })
}

/// a·σ(α·a)·b.
fn swiglu(c: &mut Ctx) -> Result<Vec<Val>> {
    let (a, b) = (c.x(0)?, c.x(1)?);
    if c.dims(a) != c.dims(b) {
        return Err(c.bad(format!("A {} and B {} differ", c.ty(a), c.ty(b))));
    }
    let alpha = c.attr_f("alpha", 1.0);
    let s = c.binary_c(B::Mul, a, alpha)?;
    let s = c.unary(U::Sigmoid, s)?;
    let sw = c.binary(B::Mul, a, s)?;
    one(c.binary(B::Mul, sw, b)?)
}

/// ScatterND with `reduction` none (index tuples assumed unique, as ONNX
/// requires) or add: the data flattened over the indexed dims, one
/// `index_add` of the updates' rows.
fn scatter_nd(c: &mut Ctx) -> Result<Vec<Val>> {
    let (data, idx, upd) = (c.x(0)?, c.x(1)?, c.x(2)?);
    let dd = c.concrete(data, "ScatterND")?;
    let id = c.concrete(idx, "ScatterND")?;
    let m = *id.last().ok_or_else(|| c.bad("scalar indices"))?;
    if m > dd.len() {
        return Err(c.bad(format!("index tuples of {m} for data {:?}", dd)));
    }
    let inner: Vec<usize> = dd[..m].to_vec();
    let rest: Vec<usize> = dd[m..].to_vec();
    let rows: usize = inner.iter().product();
    let tuples: usize = id[..id.len() - 1].iter().product();
    let idx = c.cast(idx, DType::I64)?;
    let flat_idx = c.reshape(idx, vec![Dim::Const(tuples), Dim::Const(m)])?;
    let mut lin: Option<NodeId> = None;
    let mut stride = rows;
    for (t, &size) in inner.iter().enumerate() {
        stride /= size.max(1);
        let col = c.slice(flat_idx, 1, t, t + 1, 1)?;
        let neg = c.compare_c(C::Lt, col, 0.0)?;
        let wrapped = c.binary_c(B::Add, col, size as f64)?;
        let col = c.where_(neg, wrapped, col)?;
        let term = c.binary_c(B::Mul, col, stride as f64)?;
        lin = Some(match lin {
            Some(l) => c.binary(B::Add, l, term)?,
            None => term,
        });
    }
    let lin = match lin {
        Some(l) => c.reshape(l, vec![Dim::Const(tuples)])?,
        None => c.int_constant(&vec![0; tuples], false)?,
    };
    let mut fs = vec![Dim::Const(rows)];
    fs.extend(rest.iter().map(|&v| Dim::Const(v)));
    let mut us = vec![Dim::Const(tuples)];
    us.extend(rest.iter().map(|&v| Dim::Const(v)));
    let flat = c.reshape(data, fs.clone())?;
    let u = c.reshape(upd, us.clone())?;
    let out = match c.attr_s("reduction", "none").as_str() {
        "add" => c.add(Op::IndexAdd { dim: 0 }, &[flat, lin, u])?,
        "none" => {
            let dtype = c.dtype(data);
            let z = c.scalar(0.0, dtype)?;
            let zeros = c.expand(z, fs.clone())?;
            let placed = c.add(Op::IndexAdd { dim: 0 }, &[zeros, lin, u])?;
            let o = c.scalar(1.0, DType::F32)?;
            let ones = c.expand(o, us)?;
            let fz = c.scalar(0.0, DType::F32)?;
            let fzeros = c.expand(fz, fs)?;
            let hits = c.add(Op::IndexAdd { dim: 0 }, &[fzeros, lin, ones])?;
            let hit = c.compare_c(C::Gt, hits, 0.0)?;
            c.where_(hit, placed, flat)?
        }
        how @ ("mul" | "max" | "min") => {
            // Each update row against every data row: [T, rows, R…].
            let nr = rest.len();
            let mut ls = vec![Dim::Const(tuples), Dim::Const(1)];
            ls.extend(std::iter::repeat_n(Dim::Const(1), nr));
            let l = c.reshape(lin, ls)?;
            let mut rs = vec![Dim::Const(1), Dim::Const(rows)];
            rs.extend(std::iter::repeat_n(Dim::Const(1), nr));
            let r = c.add(
                Op::Arange {
                    start: 0.0,
                    end: rows as f64,
                    step: 1.0,
                    dtype: DType::I64,
                },
                &[],
            )?;
            let r = c.reshape(r, rs)?;
            let hit = c.compare(C::Eq, l, r)?;
            let u3 = c.unsqueeze(u, 1)?;
            let dtype = c.dtype(data);
            let (identity, op, combine) = match how {
                "mul" => (1.0, tessera::ir::ReduceOp::Prod, B::Mul),
                "max" => (
                    if dtype.is_float() {
                        f64::NEG_INFINITY
                    } else {
                        i64::MIN as f64
                    },
                    tessera::ir::ReduceOp::Max,
                    B::Maximum,
                ),
                _ => (
                    if dtype.is_float() {
                        f64::INFINITY
                    } else {
                        i64::MAX as f64
                    },
                    tessera::ir::ReduceOp::Min,
                    B::Minimum,
                ),
            };
            let idv = c.scalar(identity, dtype)?;
            let vals = c.where_(hit, u3, idv)?;
            let red = c.add(
                Op::Reduce {
                    op,
                    dims: vec![0],
                    keepdim: false,
                },
                &[vals],
            )?;
            c.binary(combine, flat, red)?
        }
        other => return Err(c.bad(format!("reduction `{other}`"))),
    };
    one(c.reshape(out, dd.iter().map(|&v| Dim::Const(v)).collect())?)
}

fn opt(c: &mut Ctx, i: usize) -> Result<Option<NodeId>> {
    if c.has_input(i) {
        Ok(Some(c.x(i)?))
    } else {
        Ok(None)
    }
}

/// CausalConvWithState: a depthwise 1-D convolution over `[B, C, T]` with
/// the `k − 1` previous steps (`past_state`, or zeros) in front, as `k`
/// shifted products; the last `k − 1` steps are the new state.
fn causal_conv(c: &mut Ctx) -> Result<Vec<Val>> {
    let (x, w) = (c.x(0)?, c.x(1)?);
    let bias = opt(c, 2)?;
    let past = opt(c, 3)?;
    let xd = c.concrete(x, "CausalConvWithState")?;
    let wd = c.concrete(w, "CausalConvWithState")?;
    if xd.len() != 3 || wd.len() != 3 || wd[0] != xd[1] || wd[1] != 1 {
        return Err(c.bad(format!("input {:?} and weight {:?}", xd, wd)));
    }
    let (b, ch, t, k) = (xd[0], xd[1], xd[2], wd[2]);
    let padded = if k > 1 {
        let pad = match past {
            Some(p) => p,
            None => {
                let z = c.scalar_like(0.0, x)?;
                c.expand(z, [b, ch, k - 1].into_iter().map(Dim::Const).collect())?
            }
        };
        c.cat(&[pad, x], 2)?
    } else {
        x
    };
    // The sum of products in f32 at least, rounded once (as ONNX's
    // reference convolution).
    let dtype = c.dtype(x);
    let wide = if matches!(dtype, DType::F16 | DType::BF16) {
        DType::F32
    } else {
        dtype
    };
    let pw = c.cast(padded, wide)?;
    let ww = c.cast(w, wide)?;
    let mut acc: Option<NodeId> = None;
    for j in 0..k {
        let tap = c.slice(pw, 2, j, j + t, 1)?;
        let wj = c.slice(ww, 2, j, j + 1, 1)?;
        let wj = c.reshape(wj, vec![Dim::Const(1), Dim::Const(ch), Dim::Const(1)])?;
        let p = c.binary(B::Mul, tap, wj)?;
        acc = Some(match acc {
            Some(a) => c.binary(B::Add, a, p)?,
            None => p,
        });
    }
    let mut y = acc.expect("k >= 1");
    if let Some(bv) = bias {
        let bv = c.cast(bv, wide)?;
        let bv = c.reshape(bv, vec![Dim::Const(1), Dim::Const(ch), Dim::Const(1)])?;
        y = c.binary(B::Add, y, bv)?;
    }
    let mut y = c.cast(y, dtype)?;
    match c.attr_s("activation", "none").as_str() {
        "none" => {}
        "silu" | "swish" => {
            let dtype = c.dtype(y);
            let y32 = c.cast(y, DType::F32)?;
            let s = c.unary(U::Sigmoid, y32)?;
            let m = c.binary(B::Mul, y32, s)?;
            y = c.cast(m, dtype)?;
        }
        other => return Err(c.bad(format!("activation `{other}`"))),
    }
    let total = t + k - 1;
    let state = c.slice(padded, 2, total - (k - 1), total, 1)?;
    Ok(vec![Val::node(y), Val::node(state)])
}

/// `[B, T, H·D]` → `[B, H, T, D]` in f32.
fn heads4(c: &mut Ctx, x: NodeId, h: usize) -> Result<NodeId> {
    let d = c.concrete(x, "LinearAttention")?;
    if d.len() != 3 || h == 0 || d[2] % h != 0 {
        return Err(c.bad(format!("{} for {h} heads", c.ty(x))));
    }
    let y = c.reshape(
        x,
        [d[0], d[1], h, d[2] / h]
            .into_iter()
            .map(Dim::Const)
            .collect(),
    )?;
    let y = c.permute(y, vec![0, 2, 1, 3])?;
    c.cast(y, DType::F32)
}

/// LinearAttention (linear, gated, delta, gated delta rules) after ONNX's
/// reference: the recurrence over time unrolled, the state `[B, H, dk, dv]`
/// in f32.
fn linear_attention(c: &mut Ctx) -> Result<Vec<Val>> {
    let (q, k, v) = (c.x(0)?, c.x(1)?, c.x(2)?);
    let past = opt(c, 3)?;
    let decay = opt(c, 4)?;
    let beta = opt(c, 5)?;
    let rule = c.attr_s("update_rule", "gated_delta");
    let (gating, delta) = match rule.as_str() {
        "linear" => (false, false),
        "gated" => (true, false),
        "delta" => (false, true),
        "gated_delta" => (true, true),
        other => return Err(c.bad(format!("update_rule `{other}`"))),
    };
    if gating != decay.is_some() || delta != beta.is_some() {
        return Err(c.bad(format!(
            "update_rule `{rule}` with decay {} and beta {}",
            decay.is_some(),
            beta.is_some()
        )));
    }
    let qh = c.attr_i("q_num_heads", 0) as usize;
    let kvh = c.attr_i("kv_num_heads", 0) as usize;
    if qh == 0 || kvh == 0 || !qh.is_multiple_of(kvh) {
        return Err(c.bad(format!("q_num_heads {qh}, kv_num_heads {kvh}")));
    }
    let out_dtype = c.dtype(q);
    let qd = c.concrete(q, "LinearAttention")?;
    let (b, t) = (qd[0], qd[1]);
    let dk = qd[2] / qh;
    let dv = c.concrete(v, "LinearAttention")?[2] / kvh;
    let group = qh / kvh;
    let q4 = heads4(c, q, qh)?;
    let k4 = heads4(c, k, kvh)?;
    let v4 = heads4(c, v, kvh)?;
    let decay4 = match decay {
        Some(g) => {
            let last = c.concrete(g, "decay")?[2];
            Some(if last == kvh {
                let y = c.reshape(g, [b, t, kvh, 1].into_iter().map(Dim::Const).collect())?;
                let y = c.permute(y, vec![0, 2, 1, 3])?;
                c.cast(y, DType::F32)?
            } else if last == kvh * dk {
                heads4(c, g, kvh)?
            } else {
                return Err(c.bad(format!("decay's last dim {last}")));
            })
        }
        None => None,
    };
    let beta4 = match beta {
        Some(bt) => {
            let last = c.concrete(bt, "beta")?[2];
            let y = c.reshape(bt, [b, t, last, 1].into_iter().map(Dim::Const).collect())?;
            let y = c.permute(y, vec![0, 2, 1, 3])?;
            Some(c.cast(y, DType::F32)?)
        }
        None => None,
    };
    let state_dtype = match past {
        Some(p) => c.dtype(p),
        None => out_dtype,
    };
    let mut state = match past {
        Some(p) => c.cast(p, DType::F32)?,
        None => {
            let z = c.scalar(0.0, DType::F32)?;
            c.expand(z, [b, kvh, dk, dv].into_iter().map(Dim::Const).collect())?
        }
    };
    let scale = match c.attr("scale").map(|a| a.f as f64) {
        Some(s) if s != 0.0 => s,
        _ => 1.0 / (dk as f64).sqrt(),
    };
    // Step i of a [B, H, T, D] tensor: [B, H, D].
    let at = |c: &mut Ctx, x: NodeId, i: usize| -> Result<NodeId> {
        let s = c.slice(x, 2, i, i + 1, 1)?;
        let d = c.dims(s);
        c.reshape(s, vec![d[0].clone(), d[1].clone(), d[3].clone()])
    };
    let mut outs = Vec::with_capacity(t);
    for i in 0..t {
        let q_t = at(c, q4, i)?;
        let k_t = at(c, k4, i)?;
        let mut v_t = at(c, v4, i)?;
        if let Some(g) = decay4 {
            let g_t = at(c, g, i)?;
            let e = c.unary(U::Exp, g_t)?;
            let e = c.unsqueeze(e, 3)?;
            state = c.binary(B::Mul, state, e)?;
        }
        let k_col = c.unsqueeze(k_t, 3)?;
        if let Some(bt) = beta4 {
            let prod = c.binary(B::Mul, state, k_col)?;
            let retrieved = c.add(
                Op::Reduce {
                    op: tessera::ir::ReduceOp::Sum,
                    dims: vec![2],
                    keepdim: false,
                },
                &[prod],
            )?;
            let diff = c.binary(B::Sub, v_t, retrieved)?;
            let b_t = at(c, bt, i)?;
            v_t = c.binary(B::Mul, b_t, diff)?;
        }
        let v_row = c.unsqueeze(v_t, 2)?;
        let outer = c.binary(B::Mul, k_col, v_row)?;
        state = c.binary(B::Add, state, outer)?;
        let read = if group == 1 {
            state
        } else {
            let y = c.reshape(
                state,
                [b, kvh, 1, dk, dv].into_iter().map(Dim::Const).collect(),
            )?;
            let y = c.expand(
                y,
                [b, kvh, group, dk, dv]
                    .into_iter()
                    .map(Dim::Const)
                    .collect(),
            )?;
            let y = c.add(Op::Contiguous, &[y])?;
            c.reshape(y, [b, qh, dk, dv].into_iter().map(Dim::Const).collect())?
        };
        let q_col = c.unsqueeze(q_t, 3)?;
        let prod = c.binary(B::Mul, q_col, read)?;
        let o = c.add(
            Op::Reduce {
                op: tessera::ir::ReduceOp::Sum,
                dims: vec![2],
                keepdim: true,
            },
            &[prod],
        )?;
        let o = c.binary_c(B::Mul, o, scale)?;
        outs.push(o);
    }
    // [B, H, T, dv] → [B, T, H·dv].
    let all = c.cat(&outs, 2)?;
    let all = c.permute(all, vec![0, 2, 1, 3])?;
    let all = c.add(Op::Contiguous, &[all])?;
    let y = c.reshape(all, [b, t, qh * dv].into_iter().map(Dim::Const).collect())?;
    let y = c.cast(y, out_dtype)?;
    let st = c.cast(state, state_dtype)?;
    Ok(vec![Val::node(y), Val::node(st)])
}

/// AffineGrid: θ (`[N, 2, 3]` or `[N, 3, 4]`) times the homogeneous
/// coordinates of a `size` grid in [−1, 1] (x first), as the reference
/// builds them.
fn affine_grid(c: &mut Ctx) -> Result<Vec<Val>> {
    let theta = c.x(0)?;
    let size = c.ints(1, "size")?;
    let align = c.attr_i("align_corners", 0) != 0;
    let spatial: Vec<usize> = size.iter().skip(2).map(|&v| v.max(0) as usize).collect();
    let k = spatial.len();
    let td = c.concrete(theta, "AffineGrid")?;
    if !(k == 2 || k == 3) || td.len() != 3 || td[1] != k || td[2] != k + 1 {
        return Err(c.bad(format!("theta {:?} for size {size:?}", td)));
    }
    let axis_values = |len: usize| -> Vec<f64> {
        if align {
            let step = 2.0 / (len as f64 - 1.0);
            (0..len).map(|i| -1.0 + i as f64 * step).collect()
        } else {
            let step = 2.0 / len as f64;
            (0..len)
                .map(|i| -1.0 + step / 2.0 + i as f64 * step)
                .collect()
        }
    };
    let vals: Vec<Vec<f64>> = spatial.iter().map(|&l| axis_values(l)).collect();
    let points: usize = spatial.iter().product();
    // [k + 1, points]: rows x (the last spatial dim), y, (z), 1.
    let mut homo = vec![0.0; (k + 1) * points];
    for p in 0..points {
        let mut rem = p;
        let mut coord = vec![0usize; k];
        for d in (0..k).rev() {
            coord[d] = rem % spatial[d];
            rem /= spatial[d];
        }
        for (row, d) in (0..k).rev().enumerate() {
            homo[row * points + p] = vals[d][coord[d]];
        }
        homo[k * points + p] = 1.0;
    }
    let dtype = c.dtype(theta);
    let h = c.constant(Literal {
        dtype: DType::F64,
        shape: vec![k + 1, points],
        data: LiteralData::Float(homo),
    })?;
    let t64 = c.cast(theta, DType::F64)?;
    let g = c.add(Op::MatMul, &[t64, h])?;
    let g = c.permute(g, vec![0, 2, 1])?;
    let g = c.add(Op::Contiguous, &[g])?;
    let mut out = vec![Dim::Const(td[0])];
    out.extend(spatial.iter().map(|&v| Dim::Const(v)));
    out.push(Dim::Const(k));
    let g = c.reshape(g, out)?;
    one(c.cast(g, dtype)?)
}

/// ReverseSequence with known lengths: per batch entry, its first `len`
/// time steps reversed (a gather along the time axis).
fn reverse_sequence(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let lens = c.ints(1, "sequence_lens")?;
    let d = c.concrete(x, "ReverseSequence")?;
    let rank = d.len();
    let bax = c.axis(c.attr_i("batch_axis", 1), rank)?;
    let tax = c.axis(c.attr_i("time_axis", 0), rank)?;
    let (b, t) = (d[bax], d[tax]);
    if lens.len() != b || bax == tax {
        return Err(c.bad(format!("{} lengths for batch {b}", lens.len())));
    }
    let mut shape = vec![1usize; rank];
    shape[bax] = b;
    shape[tax] = t;
    let mut idx = vec![0i64; b * t];
    for (bi, &l) in lens.iter().enumerate() {
        let l = l.clamp(0, t as i64);
        for ti in 0..t as i64 {
            let src = if ti < l { l - 1 - ti } else { ti };
            let pos = if bax < tax {
                bi * t + ti as usize
            } else {
                ti as usize * b + bi
            };
            idx[pos] = src;
        }
    }
    let i = c.constant(Literal {
        dtype: DType::I64,
        shape,
        data: LiteralData::Int(idx),
    })?;
    let i = c.expand(i, c.dims(x))?;
    let i = c.add(Op::Contiguous, &[i])?;
    one(c.add(Op::Gather { dim: tax }, &[x, i])?)
}
