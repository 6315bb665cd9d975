//! Reductions, arg-reductions, softmax and its relatives, cumulative sums.

use tessera::ir::{ArgReduceOp, BinaryOp as B, CompareOp as C, Op, ReduceOp as R, UnaryOp as U};
use tessera::ir::{Dim, NodeId};
use tessera::{DType, Result};

use super::{one, Converter};
use crate::builder::{Ctx, Val};

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "ReduceSum" => |c| reduce(c, Kind::Sum),
        "ReduceMean" => |c| reduce(c, Kind::Mean),
        "ReduceMax" => |c| reduce(c, Kind::Max),
        "ReduceMin" => |c| reduce(c, Kind::Min),
        "ReduceProd" => |c| reduce(c, Kind::Prod),
        "ReduceL1" => |c| reduce(c, Kind::L1),
        "ReduceL2" => |c| reduce(c, Kind::L2),
        "ReduceLogSum" => |c| reduce(c, Kind::LogSum),
        "ReduceLogSumExp" => |c| reduce(c, Kind::LogSumExp),
        "ReduceSumSquare" => |c| reduce(c, Kind::SumSquare),
        "ArgMax" => |c| arg(c, ArgReduceOp::ArgMax),
        "ArgMin" => |c| arg(c, ArgReduceOp::ArgMin),
        "Softmax" => |c| softmax(c, Soft::Softmax),
        "LogSoftmax" => |c| softmax(c, Soft::LogSoftmax),
        "Hardmax" => |c| softmax(c, Soft::Hardmax),
        "CumSum" => cumsum,
        _ => return None,
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Sum,
    Mean,
    Max,
    Min,
    Prod,
    L1,
    L2,
    LogSum,
    LogSumExp,
    SumSquare,
}

/// The reduced axes: an input from opset 18 on (ReduceSum: 13), an
/// attribute before; `None` means all (or none, with
/// `noop_with_empty_axes`).
fn reduce_axes(c: &mut Ctx, kind: Kind) -> Result<Option<Vec<i64>>> {
    let from_input = c.opset >= if kind == Kind::Sum { 13 } else { 18 };
    let axes = if from_input {
        if c.has_input(1) {
            Some(c.ints(1, "axes")?)
        } else {
            None
        }
    } else {
        c.attr_ints("axes")
    };
    Ok(axes.filter(|a| !a.is_empty()))
}

fn reduce(c: &mut Ctx, kind: Kind) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    if c.dtype(x) == DType::Bool && matches!(kind, Kind::Max | Kind::Min) {
        // any / all: through i32 (an empty one is false / true).
        let dims = match reduce_axes(c, kind)? {
            Some(a) => c.axes(&a, c.rank(x))?,
            None => (0..c.rank(x)).collect(),
        };
        if dims.iter().any(|&d| c.dims(x)[d] == Dim::Const(0)) {
            let i = c.cast(x, DType::I32)?;
            c.inputs[0] = Some(Val::node(i));
            let out = reduce(c, Kind::Sum)?;
            let y = c.materialise(&out[0])?;
            let ty = c.ty(y).shape.clone();
            return one(c.add(
                Op::Full {
                    value: tessera::ir::Scalar::Bool(kind == Kind::Min),
                    shape: ty,
                    dtype: DType::Bool,
                },
                &[],
            )?);
        }
        let i = c.cast(x, DType::I32)?;
        c.inputs[0] = Some(Val::node(i));
        let out = reduce(c, kind)?;
        let y = c.materialise(&out[0])?;
        return one(c.cast(y, DType::Bool)?);
    }
    let rank = c.rank(x);
    let keep = c.attr_i("keepdims", 1) != 0;
    let dims = match reduce_axes(c, kind)? {
        Some(a) => c.axes(&a, rank)?,
        None if c.attr_i("noop_with_empty_axes", 0) != 0 => return one(x),
        None => (0..rank).collect(),
    };
    let r = |c: &mut Ctx, op: R, x: NodeId, keep: bool| -> Result<NodeId> {
        if dims.is_empty() {
            return Ok(x);
        }
        c.add(
            Op::Reduce {
                op,
                dims: dims.clone(),
                keepdim: keep,
            },
            &[x],
        )
    };
    // An empty reduction: the op's identity (ONNX's reference values).
    let empty = dims.iter().any(|&d| c.dims(x)[d] == Dim::Const(0));
    if empty {
        let identity = match kind {
            Kind::Sum | Kind::L1 | Kind::L2 | Kind::SumSquare => 0.0,
            Kind::Prod => 1.0,
            Kind::Max | Kind::LogSumExp | Kind::LogSum => f64::NEG_INFINITY,
            Kind::Min => f64::INFINITY,
            Kind::Mean => f64::NAN,
        };
        let mut shape = c.dims(x);
        for &d in dims.iter().rev() {
            if keep {
                shape[d] = Dim::Const(1);
            } else {
                shape.remove(d);
            }
        }
        let dtype = c.dtype(x);
        let value = if dtype.is_float() {
            tessera::ir::Scalar::Float(identity)
        } else {
            let big = if dtype == DType::I32 {
                i32::MAX as i64
            } else {
                i64::MAX
            };
            tessera::ir::Scalar::Int(match kind {
                Kind::Max => -big - 1,
                Kind::Min => big,
                _ => identity as i64,
            })
        };
        return one(c.add(
            Op::Full {
                value,
                shape: tessera::ir::Shape::new(shape),
                dtype,
            },
            &[],
        )?);
    }
    one(match kind {
        Kind::Sum => r(c, R::Sum, x, keep)?,
        Kind::Mean => r(c, R::Mean, x, keep)?,
        Kind::Max => r(c, R::Max, x, keep)?,
        Kind::Min => r(c, R::Min, x, keep)?,
        Kind::Prod => r(c, R::Prod, x, keep)?,
        Kind::L1 => {
            let a = c.unary(U::Abs, x)?;
            r(c, R::Sum, a, keep)?
        }
        Kind::L2 => {
            let sq = c.binary(B::Mul, x, x)?;
            let s = r(c, R::Sum, sq, keep)?;
            if c.dtype(s).is_float() {
                c.unary(U::Sqrt, s)?
            } else {
                // Integer L2: the square root in f64, truncated.
                let dtype = c.dtype(s);
                let f = c.cast(s, DType::F64)?;
                let q = c.unary(U::Sqrt, f)?;
                c.cast(q, dtype)?
            }
        }
        Kind::LogSum => {
            let s = r(c, R::Sum, x, keep)?;
            c.unary(U::Log, s)?
        }
        Kind::SumSquare => {
            let sq = c.binary(B::Mul, x, x)?;
            r(c, R::Sum, sq, keep)?
        }
        Kind::LogSumExp => {
            // max + log Σ exp(x − max), the max kept finite.
            let m = r(c, R::Max, x, true)?;
            let finite = c.compare_c(C::Ne, m, f64::NEG_INFINITY)?;
            let zero = c.scalar_like(0.0, m)?;
            let m = c.where_(finite, m, zero)?;
            let d = c.binary(B::Sub, x, m)?;
            let e = c.unary(U::Exp, d)?;
            let s = r(c, R::Sum, e, keep)?;
            let l = c.unary(U::Log, s)?;
            let m = if keep {
                m
            } else {
                let dims_kept: Vec<Dim> = c
                    .dims(m)
                    .into_iter()
                    .enumerate()
                    .filter(|(i, _)| !dims.contains(i))
                    .map(|(_, d)| d)
                    .collect();
                c.reshape(m, dims_kept)?
            };
            c.binary(B::Add, l, m)?
        }
    })
}

fn arg(c: &mut Ctx, op: ArgReduceOp) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let rank = c.rank(x);
    let dim = c.axis(c.attr_i("axis", 0), rank)?;
    let keepdim = c.attr_i("keepdims", 1) != 0;
    if c.attr_i("select_last_index", 0) == 0 {
        return one(c.add(Op::ArgReduce { op, dim, keepdim }, &[x])?);
    }
    // The last index: the first of the reversed input, counted back.
    let n = c.dims(x)[dim]
        .as_const()
        .ok_or_else(|| c.unsupported("select_last_index over a symbolic dim"))?;
    let rev = reverse(c, x, dim, n)?;
    let i = c.add(Op::ArgReduce { op, dim, keepdim }, &[rev])?;
    let last = c.scalar((n as f64) - 1.0, DType::I64)?;
    one(c.binary(B::Sub, last, i)?)
}

/// `x` reversed along `dim` (of size `n`).
pub(super) fn reverse(c: &mut Ctx, x: NodeId, dim: usize, n: usize) -> Result<NodeId> {
    let idx: Vec<i64> = (0..n as i64).rev().collect();
    let i = c.int_constant(&idx, false)?;
    c.add(Op::IndexSelect { dim }, &[x, i])
}

#[derive(Clone, Copy, PartialEq)]
enum Soft {
    Softmax,
    LogSoftmax,
    Hardmax,
}

/// Before opset 13 the input is seen as 2-D, `[d0·…·d(axis−1),
/// d(axis)·…]`, and normalised over its second dim (axis default 1); from
/// 13 on, over `axis` alone (default −1).
fn softmax(c: &mut Ctx, kind: Soft) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let rank = c.rank(x);
    let legacy = c.opset < 13;
    let axis = c.attr_i("axis", if legacy { 1 } else { -1 });
    let apply = |c: &mut Ctx, x: NodeId, dim: usize| -> Result<NodeId> {
        match kind {
            Soft::Softmax => c.add(Op::Softmax { dim }, &[x]),
            Soft::LogSoftmax => c.add(Op::LogSoftmax { dim }, &[x]),
            Soft::Hardmax => {
                let i = c.add(
                    Op::ArgReduce {
                        op: ArgReduceOp::ArgMax,
                        dim,
                        keepdim: true,
                    },
                    &[x],
                )?;
                let n = c.dims(x)[dim]
                    .as_const()
                    .ok_or_else(|| c.unsupported("Hardmax over a symbolic dim"))?;
                let mut shape = vec![1usize; c.rank(x)];
                shape[dim] = n;
                let r = c.add(
                    Op::Arange {
                        start: 0.0,
                        end: n as f64,
                        step: 1.0,
                        dtype: DType::I64,
                    },
                    &[],
                )?;
                let r = c.reshape(r, shape.into_iter().map(Dim::Const).collect())?;
                let hit = c.compare(C::Eq, r, i)?;
                let dtype = c.dtype(x);
                c.cast(hit, dtype)
            }
        }
    };
    if rank == 0 {
        return Err(c.bad("needs an input of rank ≥ 1"));
    }
    if !legacy {
        let dim = c.axis(axis, rank)?;
        return one(apply(c, x, dim)?);
    }
    let a = if axis < 0 { axis + rank as i64 } else { axis };
    if a < 0 || a > rank as i64 {
        return Err(c.bad(format!("axis {axis} for {}", c.ty(x))));
    }
    let a = a as usize;
    let dims = c.dims(x);
    let prod = |ds: &[Dim]| -> Option<Dim> {
        ds.iter()
            .try_fold(Dim::Const(1), |acc, d| acc.checked_mul(d))
    };
    let (lead, tail) = match (prod(&dims[..a]), prod(&dims[a..])) {
        (Some(l), Some(t)) => (l, t),
        _ => return Err(c.bad(format!("the size of {} overflows", c.ty(x)))),
    };
    let flat = c.reshape(x, vec![lead, tail])?;
    let y = apply(c, flat, 1)?;
    one(c.reshape(y, dims)?)
}

/// CumSum along an axis (an input), `exclusive` and `reverse` as
/// attributes: log₂(n) shifted additions (Hillis–Steele), exact for
/// integers and in the usual rounding for floats.
fn cumsum(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let rank = c.rank(x);
    let axis = c.ints(1, "axis")?;
    let dim = c.axis(*axis.first().ok_or_else(|| c.bad("an empty axis"))?, rank)?;
    let n = c.dims(x)[dim]
        .as_const()
        .ok_or_else(|| c.unsupported("CumSum over a symbolic dim"))?;
    let (exclusive, rev) = (c.attr_i("exclusive", 0) != 0, c.attr_i("reverse", 0) != 0);
    let mut y = if rev { reverse(c, x, dim, n)? } else { x };
    if exclusive && n > 0 {
        // Shift by one: a zero first, the last element dropped.
        y = shift(c, y, dim, n, 1)?;
    }
    let mut k = 1;
    while k < n {
        let s = shift(c, y, dim, n, k)?;
        y = c.binary(B::Add, y, s)?;
        k *= 2;
    }
    if rev {
        y = reverse(c, y, dim, n)?;
    }
    one(y)
}

/// `x` shifted by `k` along `dim` (size `n`): `k` zeros first.
fn shift(c: &mut Ctx, x: NodeId, dim: usize, n: usize, k: usize) -> Result<NodeId> {
    let head = c.slice(x, dim, 0, n - k, 1)?;
    let mut zshape = c.dims(x);
    zshape[dim] = Dim::Const(k);
    let dtype = c.dtype(x);
    let z = c.add(
        Op::Full {
            value: if dtype.is_float() {
                tessera::ir::Scalar::Float(0.0)
            } else {
                tessera::ir::Scalar::Int(0)
            },
            shape: tessera::ir::Shape::new(zshape),
            dtype,
        },
        &[],
    )?;
    c.cat(&[z, head], dim)
}
