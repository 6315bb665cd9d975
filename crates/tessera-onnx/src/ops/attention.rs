//! The fused `Attention` op (opsets 23–25) as tessera ops, following ONNX's
//! reference: 3-D inputs split into heads, the key/value cache joined,
//! grouped-query heads repeated, `√scale` applied to Q and K each, softcap,
//! the bias from the mask, causality (bottom-right aligned by the cache or
//! the per-batch `nonpad_kv_seqlen`), sliding windows and padding, a
//! softmax whose fully masked rows are zeros, the optional
//! `qk_matmul_output` in each of its modes.

use tessera::ir::{BinaryOp as B, CompareOp as C, Dim, NodeId, Op, ReduceOp as R, UnaryOp as U};
use tessera::{DType, Result};

use crate::builder::{Ctx, Val};

fn opt(c: &mut Ctx, i: usize) -> Result<Option<NodeId>> {
    if c.has_input(i) {
        Ok(Some(c.x(i)?))
    } else {
        Ok(None)
    }
}

fn heads(c: &mut Ctx, x: NodeId, n: usize, what: &str) -> Result<NodeId> {
    let d = c.dims(x);
    let hidden = d[2]
        .as_const()
        .ok_or_else(|| c.unsupported(format!("a symbolic hidden size of {what}")))?;
    if n == 0 || hidden % n != 0 {
        return Err(c.bad(format!("{what} {} does not split into {n} heads", c.ty(x))));
    }
    let y = c.reshape(
        x,
        vec![
            d[0].clone(),
            d[1].clone(),
            Dim::Const(n),
            Dim::Const(hidden / n),
        ],
    )?;
    c.permute(y, vec![0, 2, 1, 3])
}

/// −∞ where `allowed` is false, 0 where true, in `dtype`.
fn bias_of(c: &mut Ctx, allowed: NodeId, dtype: DType) -> Result<NodeId> {
    let zero = c.scalar(0.0, dtype)?;
    let ninf = c.scalar(f64::NEG_INFINITY, dtype)?;
    c.where_(allowed, zero, ninf)
}

/// `(i + offset) − j` for a query `i` and key `j`: `[q, kv]` for a constant
/// offset, `[B, 1, q, kv]` for a per-batch one (an i64 `[B]` tensor).
fn diagonal_distance(
    c: &mut Ctx,
    q: usize,
    kv: usize,
    offset: Result<i64, NodeId>,
) -> Result<NodeId> {
    let base: Vec<i64> = (0..q as i64)
        .flat_map(|i| (0..kv as i64).map(move |j| i - j))
        .collect();
    match offset {
        Ok(o) => {
            let v: Vec<i64> = base.iter().map(|d| d + o).collect();
            Ok(c.constant(tessera::ir::Literal {
                dtype: DType::I64,
                shape: vec![q, kv],
                data: tessera::ir::LiteralData::Int(v),
            })?)
        }
        Err(per_batch) => {
            let d = c.constant(tessera::ir::Literal {
                dtype: DType::I64,
                shape: vec![q, kv],
                data: tessera::ir::LiteralData::Int(base),
            })?;
            let b = c.dims(per_batch)[0].clone();
            let o = c.reshape(
                per_batch,
                vec![b, Dim::Const(1), Dim::Const(1), Dim::Const(1)],
            )?;
            c.binary(B::Add, d, o)
        }
    }
}

fn add_bias(c: &mut Ctx, bias: Option<NodeId>, extra: NodeId) -> Result<NodeId> {
    match bias {
        Some(b) => c.binary(B::Add, b, extra),
        None => Ok(extra),
    }
}

pub(super) fn attention(c: &mut Ctx) -> Result<Vec<Val>> {
    let (mut q, mut k, mut v) = (c.x(0)?, c.x(1)?, c.x(2)?);
    let mask = opt(c, 3)?;
    let (past_k, past_v) = (opt(c, 4)?, opt(c, 5)?);
    let nonpad = opt(c, 6)?;
    if past_k.is_some() != past_v.is_some() {
        return Err(c.bad("past_key and past_value come together"));
    }
    let dtype = c.dtype(q);
    let rank3 = c.rank(q) == 3;
    if rank3 {
        let qh = c.attr_i("q_num_heads", 0) as usize;
        let kvh = c.attr_i("kv_num_heads", 0) as usize;
        q = heads(c, q, qh, "Q")?;
        k = heads(c, k, kvh, "K")?;
        v = heads(c, v, kvh, "V")?;
    } else if c.rank(q) != 4 || c.rank(k) != 4 || c.rank(v) != 4 {
        return Err(c.bad(format!(
            "Q, K, V of ranks {}, {}, {}",
            c.rank(q),
            c.rank(k),
            c.rank(v)
        )));
    }
    let head = c.dims(q)[3]
        .as_const()
        .ok_or_else(|| c.unsupported("a symbolic head size"))?;
    let scale = match c.attr("scale") {
        Some(a) => a.f as f64,
        None => 1.0 / (head as f64).sqrt(),
    };
    let s = scale.sqrt();
    let past_len = match past_k {
        Some(pk) => Some(
            c.dims(pk)[2]
                .as_const()
                .ok_or_else(|| c.unsupported("a symbolic cache length"))?,
        ),
        None => None,
    };
    let present_k = match past_k {
        Some(pk) => c.cat(&[pk, k], 2)?,
        None => k,
    };
    let present_v = match past_v {
        Some(pv) => c.cat(&[pv, v], 2)?,
        None => v,
    };
    let (k, v) = (present_k, present_v);
    let qd = c.concrete(q, "Attention")?;
    let kd = c.concrete(k, "Attention")?;
    let (q_len, kv_len) = (qd[2], kd[2]);
    // The bias.
    let mut mask = mask;
    if let Some(m) = mask {
        let last = *c.concrete(m, "an attention mask")?.last().unwrap_or(&0);
        if last < kv_len {
            // A shorter mask is padded with "masked".
            let mut pd = c.dims(m);
            *pd.last_mut().expect("rank ≥ 1") = Dim::Const(kv_len - last);
            let mdt = c.dtype(m);
            let value = if mdt == DType::Bool {
                tessera::ir::Scalar::Bool(false)
            } else {
                tessera::ir::Scalar::Float(f64::NEG_INFINITY)
            };
            let pad = c.add(
                Op::Full {
                    value,
                    shape: tessera::ir::Shape::new(pd),
                    dtype: mdt,
                },
                &[],
            )?;
            let r = c.rank(m) - 1;
            mask = Some(c.cat(&[m, pad], r)?);
        }
    }
    let mask = match mask {
        Some(m) if c.dtype(m) == DType::Bool => Some(bias_of(c, m, dtype)?),
        m => m,
    };
    let offset: Result<i64, NodeId> = match (past_len, nonpad) {
        (None, Some(n)) => {
            let n = c.cast(n, DType::I64)?;
            Err(c.binary_c(B::Sub, n, q_len as f64)?)
        }
        (p, _) => Ok(p.unwrap_or(0) as i64),
    };
    let mut bias = mask;
    if c.attr_i("is_causal", 0) != 0 {
        let d = diagonal_distance(c, q_len, kv_len, offset)?;
        let allowed = c.compare_c(C::Ge, d, 0.0)?;
        let causal = bias_of(c, allowed, dtype)?;
        bias = Some(add_bias(c, bias, causal)?);
    }
    let (left, right) = (
        c.attr_i("left_window_size", -1),
        c.attr_i("right_window_size", -1),
    );
    if left >= 0 || right >= 0 {
        let d = diagonal_distance(c, q_len, kv_len, offset)?;
        let t = c.scalar(1.0, DType::Bool)?;
        let mut allowed = c.expand(t, c.dims(d))?;
        if left >= 0 {
            let ok = c.compare_c(C::Le, d, left as f64)?;
            allowed = c.where_(ok, allowed, ok)?;
        }
        if right >= 0 {
            let nd = c.unary(U::Neg, d)?;
            let ok = c.compare_c(C::Le, nd, right as f64)?;
            allowed = c.where_(ok, allowed, ok)?;
        }
        let w = bias_of(c, allowed, dtype)?;
        bias = Some(add_bias(c, bias, w)?);
    }
    if let Some(n) = nonpad {
        let n = c.cast(n, DType::I64)?;
        let b = c.dims(n)[0].clone();
        let n = c.reshape(n, vec![b, Dim::Const(1), Dim::Const(1), Dim::Const(1)])?;
        let r = c.add(
            Op::Arange {
                start: 0.0,
                end: kv_len as f64,
                step: 1.0,
                dtype: DType::I64,
            },
            &[],
        )?;
        let allowed = c.compare(C::Lt, r, n)?;
        let p = bias_of(c, allowed, dtype)?;
        bias = Some(add_bias(c, bias, p)?);
    }
    // Grouped-query heads: each K/V head serves consecutive Q heads.
    let (qh, kh) = (qd[1], kd[1]);
    let (k, v) = if qh != kh && kh > 0 && qh % kh == 0 {
        let rep = |c: &mut Ctx, x: NodeId| -> Result<NodeId> {
            let d = c.dims(x);
            let y = c.reshape(
                x,
                vec![
                    d[0].clone(),
                    d[1].clone(),
                    Dim::Const(1),
                    d[2].clone(),
                    d[3].clone(),
                ],
            )?;
            let y = c.expand(
                y,
                vec![
                    d[0].clone(),
                    d[1].clone(),
                    Dim::Const(qh / kh),
                    d[2].clone(),
                    d[3].clone(),
                ],
            )?;
            let y = c.add(Op::Contiguous, &[y])?;
            c.reshape(
                y,
                vec![d[0].clone(), Dim::Const(qh), d[2].clone(), d[3].clone()],
            )
        };
        (rep(c, k)?, rep(c, v)?)
    } else {
        (k, v)
    };
    let qs = c.binary_c(B::Mul, q, s)?;
    let ks = c.binary_c(B::Mul, k, s)?;
    let kt = c.permute(ks, vec![0, 1, 3, 2])?;
    let mut qk = c.add(Op::MatMul, &[qs, kt])?;
    let softcap = c.attr_f("softcap", 0.0);
    if softcap > 0.0 {
        let y = c.binary_c(B::Div, qk, softcap)?;
        let y = c.unary(U::Tanh, y)?;
        qk = c.binary_c(B::Mul, y, softcap)?;
    }
    let with_bias = match bias {
        Some(b) => c.binary(B::Add, qk, b)?,
        None => qk,
    };
    let mode = c.attr_i("qk_matmul_output_mode", 0);
    let mut x = with_bias;
    if let Some(p) = c.attr("softmax_precision").map(|a| a.i) {
        let pd = crate::tensor::dtype_of(p as i32, "softmax_precision")
            .map_err(|e| c.unsupported(e.message))?;
        x = c.cast(x, pd)?;
    }
    let last = c.rank(x) - 1;
    let mut probs = c.add(Op::Softmax { dim: last }, &[x])?;
    if let Some(b) = bias {
        // Rows the bias masks entirely are zeros.
        let lastb = c.rank(b) - 1;
        let m = c.add(
            Op::Reduce {
                op: R::Max,
                dims: vec![lastb],
                keepdim: true,
            },
            &[b],
        )?;
        let all = c.compare_c(C::Eq, m, f64::NEG_INFINITY)?;
        let zero = c.scalar_like(0.0, probs)?;
        probs = c.where_(all, zero, probs)?;
    }
    let probs = c.cast(probs, dtype)?;
    let qk_out = match mode {
        2 => with_bias,
        3 => probs,
        _ => qk,
    };
    let qk_out = c.cast(qk_out, dtype)?;
    let mut y = c.add(Op::MatMul, &[probs, v])?;
    if rank3 {
        let yd = c.dims(y);
        y = c.permute(y, vec![0, 2, 1, 3])?;
        y = c.add(Op::Contiguous, &[y])?;
        let hidden = yd[1].checked_mul(&yd[3]).ok_or_else(|| c.bad("overflow"))?;
        y = c.reshape(y, vec![yd[0].clone(), yd[2].clone(), hidden])?;
    }
    Ok(vec![
        Val::node(y),
        Val::node(present_k),
        Val::node(present_v),
        Val::node(qk_out),
    ])
}
