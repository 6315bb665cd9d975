//! Matrix products and normalisations: MatMul, Gemm, Einsum, and the
//! normalisation layers as reductions and elementwise ops.

use tessera::ir::{BinaryOp as B, Dim, NodeId, Op, ReduceOp as R, UnaryOp as U};
use tessera::{DType, Result};

use super::{one, Converter};
use crate::builder::{Ctx, Val};

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "MatMul" => matmul_op,
        "Gemm" => gemm,
        "Einsum" => einsum,
        "LayerNormalization" => layer_norm,
        "RMSNormalization" => rms_norm,
        "InstanceNormalization" => instance_norm,
        "GroupNormalization" => group_norm,
        "MeanVarianceNormalization" => mean_variance_norm,
        "LpNormalization" => lp_norm,
        "NegativeLogLikelihoodLoss" => |c| {
            let x = c.x(0)?;
            nll(c, x, None)
        },
        "SoftmaxCrossEntropyLoss" => |c| {
            let x = c.x(0)?;
            if c.rank(x) < 2 {
                return Err(c.bad(format!("needs scores [N, C, …], got {}", c.ty(x))));
            }
            let log_prob = c.add(Op::LogSoftmax { dim: 1 }, &[x])?;
            nll(c, log_prob, Some(log_prob))
        },
        _ => return None,
    })
}

/// `a @ b`; integer products computed in f64 (exact below 2⁵³) and cast
/// back.
fn matmul(c: &mut Ctx, a: NodeId, b: NodeId) -> Result<NodeId> {
    let dtype = c.dtype(a);
    if dtype.is_float() {
        return c.add(Op::MatMul, &[a, b]);
    }
    let (a, b) = (c.cast(a, DType::F64)?, c.cast(b, DType::F64)?);
    let p = c.add(Op::MatMul, &[a, b])?;
    c.cast(p, dtype)
}

fn matmul_op(c: &mut Ctx) -> Result<Vec<Val>> {
    let (a, b) = (c.x(0)?, c.x(1)?);
    one(matmul(c, a, b)?)
}

/// α·A'·B' + β·C.
fn gemm(c: &mut Ctx) -> Result<Vec<Val>> {
    let (mut a, mut b) = (c.x(0)?, c.x(1)?);
    if c.rank(a) != 2 || c.rank(b) != 2 {
        return Err(c.bad(format!(
            "needs 2-D A and B, got {} and {}",
            c.ty(a),
            c.ty(b)
        )));
    }
    if c.attr_i("transA", 0) != 0 {
        a = c.permute(a, vec![1, 0])?;
    }
    if c.attr_i("transB", 0) != 0 {
        b = c.permute(b, vec![1, 0])?;
    }
    let (alpha, beta) = (c.attr_f("alpha", 1.0), c.attr_f("beta", 1.0));
    let mut y = matmul(c, a, b)?;
    if alpha != 1.0 {
        y = c.binary_c(B::Mul, y, alpha)?;
    }
    if c.has_input(2) {
        let mut bias = c.x(2)?;
        if beta != 1.0 {
            bias = c.binary_c(B::Mul, bias, beta)?;
        }
        y = c.binary(B::Add, y, bias)?;
    }
    one(y)
}

/// Mean and variance of `x` over `dims` (kept), in `x`'s dtype.
fn moments(c: &mut Ctx, x: NodeId, dims: &[usize]) -> Result<(NodeId, NodeId)> {
    let red = |c: &mut Ctx, x: NodeId| {
        c.add(
            Op::Reduce {
                op: R::Mean,
                dims: dims.to_vec(),
                keepdim: true,
            },
            &[x],
        )
    };
    let mean = red(c, x)?;
    let d = c.binary(B::Sub, x, mean)?;
    let sq = c.binary(B::Mul, d, d)?;
    let var = red(c, sq)?;
    Ok((mean, var))
}

/// 1/√(var + ε).
fn inv_std(c: &mut Ctx, var: NodeId, eps: f64) -> Result<NodeId> {
    let v = c.binary_c(B::Add, var, eps)?;
    c.unary(U::Rsqrt, v)
}

/// The dtype statistics are computed in: f32 for half inputs when
/// `stash_type` is 1 (the default).
fn stash(c: &Ctx, x: NodeId) -> DType {
    let dtype = c.dtype(x);
    if c.attr_i("stash_type", 1) == 1 && matches!(dtype, DType::F16 | DType::BF16) {
        DType::F32
    } else {
        dtype
    }
}

fn layer_norm(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let scale = c.x(1)?;
    let rank = c.rank(x);
    let axis = c.axis(c.attr_i("axis", -1), rank)?;
    let eps = c.attr_f("epsilon", 1e-5);
    let dtype = c.dtype(x);
    let xs = c.cast(x, stash(c, x))?;
    let dims: Vec<usize> = (axis..rank).collect();
    let (mean, var) = moments(c, xs, &dims)?;
    let inv = inv_std(c, var, eps)?;
    let d = c.binary(B::Sub, xs, mean)?;
    let n = c.binary(B::Mul, d, inv)?;
    let n = c.cast(n, dtype)?;
    let mut y = c.binary(B::Mul, n, scale)?;
    if c.has_input(2) {
        let b = c.x(2)?;
        y = c.binary(B::Add, y, b)?;
    }
    Ok(vec![Val::node(y), Val::node(mean), Val::node(inv)])
}

fn rms_norm(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let scale = c.x(1)?;
    let rank = c.rank(x);
    let axis = c.axis(c.attr_i("axis", -1), rank)?;
    let eps = c.attr_f("epsilon", 1e-5);
    let dtype = c.dtype(x);
    let xs = c.cast(x, stash(c, x))?;
    let sq = c.binary(B::Mul, xs, xs)?;
    let ms = c.add(
        Op::Reduce {
            op: R::Mean,
            dims: (axis..rank).collect(),
            keepdim: true,
        },
        &[sq],
    )?;
    let inv = inv_std(c, ms, eps)?;
    let n = c.binary(B::Mul, xs, inv)?;
    let n = c.cast(n, dtype)?;
    one(c.binary(B::Mul, n, scale)?)
}

/// Scale and bias of shape `[C]` broadcast over `[N, C, …]`.
fn per_channel(c: &mut Ctx, v: NodeId, rank: usize) -> Result<NodeId> {
    if c.rank(v) != 1 {
        return Err(c.bad(format!("a per-channel scale or bias of {}", c.ty(v))));
    }
    let mut dims = vec![Dim::Const(1); rank];
    dims[1] = c.dims(v)[0].clone();
    c.reshape(v, dims)
}

fn instance_norm(c: &mut Ctx) -> Result<Vec<Val>> {
    let (x, scale, bias) = (c.x(0)?, c.x(1)?, c.x(2)?);
    let rank = c.rank(x);
    if rank < 3 {
        return Err(c.bad(format!("needs [N, C, D…], got {}", c.ty(x))));
    }
    let eps = c.attr_f("epsilon", 1e-5);
    let (mean, var) = moments(c, x, &(2..rank).collect::<Vec<_>>())?;
    let inv = inv_std(c, var, eps)?;
    let d = c.binary(B::Sub, x, mean)?;
    let n = c.binary(B::Mul, d, inv)?;
    let s = per_channel(c, scale, rank)?;
    let b = per_channel(c, bias, rank)?;
    let y = c.binary(B::Mul, n, s)?;
    one(c.binary(B::Add, y, b)?)
}

/// GroupNormalization: scale and bias per group before opset 21, per
/// channel from 21 on.
fn group_norm(c: &mut Ctx) -> Result<Vec<Val>> {
    let (x, scale, bias) = (c.x(0)?, c.x(1)?, c.x(2)?);
    let d = c.concrete(x, "GroupNormalization")?;
    let g = c.attr_i("num_groups", 0) as usize;
    if d.len() < 2 || g == 0 || d[1] % g != 0 {
        return Err(c.bad(format!("{g} groups for {}", c.ty(x))));
    }
    let eps = c.attr_f("epsilon", 1e-5);
    let dtype = c.dtype(x);
    let xs = c.cast(x, stash(c, x))?;
    let rest: usize = d[1] / g * d[2..].iter().product::<usize>();
    let grouped = c.reshape(xs, vec![Dim::Const(d[0]), Dim::Const(g), Dim::Const(rest)])?;
    let (mean, var) = moments(c, grouped, &[2])?;
    let inv = inv_std(c, var, eps)?;
    let diff = c.binary(B::Sub, grouped, mean)?;
    let n = c.binary(B::Mul, diff, inv)?;
    let n = c.cast(n, dtype)?;
    let rank = d.len();
    let y = if c.opset >= 21 {
        let n = c.reshape(n, d.iter().map(|&v| Dim::Const(v)).collect())?;
        let s = per_channel(c, scale, rank)?;
        let b = per_channel(c, bias, rank)?;
        let y = c.binary(B::Mul, n, s)?;
        c.binary(B::Add, y, b)?
    } else {
        let s = c.reshape(scale, vec![Dim::Const(1), Dim::Const(g), Dim::Const(1)])?;
        let b = c.reshape(bias, vec![Dim::Const(1), Dim::Const(g), Dim::Const(1)])?;
        let y = c.binary(B::Mul, n, s)?;
        let y = c.binary(B::Add, y, b)?;
        c.reshape(y, d.iter().map(|&v| Dim::Const(v)).collect())?
    };
    one(y)
}

fn mean_variance_norm(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let rank = c.rank(x);
    let axes = c.attr_ints("axes").unwrap_or_else(|| vec![0, 2, 3]);
    let dims = c.axes(&axes, rank)?;
    let (mean, var) = moments(c, x, &dims)?;
    let d = c.binary(B::Sub, x, mean)?;
    let sd = c.unary(U::Sqrt, var)?;
    let sd = c.binary_c(B::Add, sd, 1e-9)?;
    one(c.binary(B::Div, d, sd)?)
}

fn lp_norm(c: &mut Ctx) -> Result<Vec<Val>> {
    let x = c.x(0)?;
    let rank = c.rank(x);
    let dim = c.axis(c.attr_i("axis", -1), rank)?;
    let p = c.attr_i("p", 2);
    let sum = |c: &mut Ctx, v: NodeId| {
        c.add(
            Op::Reduce {
                op: R::Sum,
                dims: vec![dim],
                keepdim: true,
            },
            &[v],
        )
    };
    let norm = match p {
        1 => {
            let a = c.unary(U::Abs, x)?;
            sum(c, a)?
        }
        2 => {
            let sq = c.binary(B::Mul, x, x)?;
            let s = sum(c, sq)?;
            c.unary(U::Sqrt, s)?
        }
        other => return Err(c.bad(format!("p = {other} (1 or 2)"))),
    };
    // A zero norm gives zeros (ONNX's reference), not NaN.
    let zero = c.compare_c(tessera::ir::CompareOp::Eq, norm, 0.0)?;
    let one_ = c.scalar_like(1.0, norm)?;
    let safe = c.where_(zero, one_, norm)?;
    one(c.binary(B::Div, x, safe)?)
}

/// One operand of an einsum: its node and the letter of each dim.
#[derive(Clone)]
struct Term {
    id: NodeId,
    letters: Vec<char>,
}

/// Einsum without ellipses or repeated letters within an operand: each
/// operand's private letters summed out, then the operands multiplied
/// pairwise as batched matmuls, then the output's order.
fn einsum(c: &mut Ctx) -> Result<Vec<Val>> {
    let eq: String = c
        .attr_s("equation", "")
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect();
    let (lhs, out) = match eq.split_once("->") {
        Some((l, r)) => (l.to_string(), Some(r.to_string())),
        None => (eq.clone(), None),
    };
    let raw: Vec<&str> = lhs.split(',').collect();
    if raw.len() != c.node.input.len() {
        return Err(c.bad(format!(
            "`{eq}` names {} operands, the node has {}",
            raw.len(),
            c.node.input.len()
        )));
    }
    // An ellipsis stands for the dims no letter names, right-aligned across
    // operands: letters of their own (from a private range) replace it.
    let ell = |k: usize| char::from_u32(0xE000 + k as u32).expect("a private-use char");
    let mut ell_count = 0;
    let mut specs: Vec<Vec<char>> = Vec::new();
    for (i, r) in raw.iter().enumerate() {
        let id = c.x(i)?;
        let rank = c.rank(id);
        let spec: Vec<char> = match r.split_once("...") {
            Some((a, b)) => {
                let named = a.chars().count() + b.chars().count();
                let n = rank
                    .checked_sub(named)
                    .ok_or_else(|| c.bad(format!("operand {i} is {} for `{r}`", c.ty(id))))?;
                ell_count = ell_count.max(n);
                a.chars()
                    .chain((0..n).map(|k| ell(ell_count.max(n) - n + k)))
                    .chain(b.chars())
                    .collect()
            }
            None => r.chars().collect(),
        };
        specs.push(spec);
    }
    // Right-align: an operand with fewer ellipsis dims takes the last ones.
    for (i, r) in raw.iter().enumerate() {
        if let Some((a, _)) = r.split_once("...") {
            let id = c.x(i)?;
            let n = c.rank(id) - (r.chars().count() - 3);
            let start = a.chars().count();
            for k in 0..n {
                specs[i][start + k] = ell(ell_count - n + k);
            }
        }
    }
    let ell_letters: Vec<char> = (0..ell_count).map(ell).collect();
    let out: Vec<char> = match out {
        Some(o) => match o.split_once("...") {
            Some((a, b)) => a
                .chars()
                .chain(ell_letters.iter().copied())
                .chain(b.chars())
                .collect(),
            None => o.chars().collect(),
        },
        None => {
            let mut once: Vec<char> = specs
                .iter()
                .flatten()
                .copied()
                .filter(|ch| !ell_letters.contains(ch))
                .filter(|ch| specs.iter().flatten().filter(|x| *x == ch).count() == 1)
                .collect();
            once.sort_unstable();
            ell_letters.iter().copied().chain(once).collect()
        }
    };
    let mut terms = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        let id = c.x(i)?;
        if c.rank(id) != s.len() {
            return Err(c.bad(format!("operand {i} is {} for `{}`", c.ty(id), raw[i])));
        }
        let mut t = Term {
            id,
            letters: s.clone(),
        };
        // A letter twice in one operand: its diagonal.
        while let Some((p, q)) = repeated(&t.letters) {
            t = diagonal(c, &t, p, q)?;
        }
        terms.push(t);
    }
    // Sum out each operand's letters that nothing else needs.
    let needed_after = |terms: &[Term], k: usize, out: &[char]| -> Vec<char> {
        let mut v: Vec<char> = out.to_vec();
        for (j, t) in terms.iter().enumerate() {
            if j != k {
                v.extend(&t.letters);
            }
        }
        v
    };
    for k in 0..terms.len() {
        let keep = needed_after(&terms, k, &out);
        terms[k] = sum_out(c, &terms[k], &keep)?;
    }
    let mut acc = terms[0].clone();
    for k in 1..terms.len() {
        let mut keep: Vec<char> = out.clone();
        for t in &terms[k + 1..] {
            keep.extend(&t.letters);
        }
        acc = contract(c, &acc, &terms[k], &keep)?;
    }
    let acc = sum_out(c, &acc, &out)?;
    let perm: Vec<usize> = out
        .iter()
        .map(|ch| {
            acc.letters
                .iter()
                .position(|x| x == ch)
                .ok_or_else(|| c.bad(format!("output letter `{ch}` is in no operand")))
        })
        .collect::<Result<_>>()?;
    one(c.permute(acc.id, perm)?)
}

fn sum_out(c: &mut Ctx, t: &Term, keep: &[char]) -> Result<Term> {
    let dims: Vec<usize> = (0..t.letters.len())
        .filter(|&i| !keep.contains(&t.letters[i]))
        .collect();
    if dims.is_empty() {
        return Ok(t.clone());
    }
    let id = c.add(
        Op::Reduce {
            op: R::Sum,
            dims: dims.clone(),
            keepdim: false,
        },
        &[t.id],
    )?;
    let letters = (0..t.letters.len())
        .filter(|i| !dims.contains(i))
        .map(|i| t.letters[i])
        .collect();
    Ok(Term { id, letters })
}

/// The product of two terms, summing the shared letters `keep` lacks.
fn contract(c: &mut Ctx, a: &Term, b: &Term, keep: &[char]) -> Result<Term> {
    let in_a = |ch: &char| a.letters.contains(ch);
    let in_b = |ch: &char| b.letters.contains(ch);
    let batch: Vec<char> = a
        .letters
        .iter()
        .copied()
        .filter(|ch| in_b(ch) && keep.contains(ch))
        .collect();
    let summed: Vec<char> = a
        .letters
        .iter()
        .copied()
        .filter(|ch| in_b(ch) && !keep.contains(ch))
        .collect();
    let a_free: Vec<char> = a.letters.iter().copied().filter(|ch| !in_b(ch)).collect();
    let b_free: Vec<char> = b.letters.iter().copied().filter(|ch| !in_a(ch)).collect();
    let size = |c: &Ctx, t: &Term, ch: char| -> Dim {
        let i = t
            .letters
            .iter()
            .position(|x| *x == ch)
            .expect("a letter of the term");
        c.dims(t.id)[i].clone()
    };
    let prod = |c: &Ctx, t: &Term, chs: &[char]| -> Result<Dim> {
        chs.iter()
            .try_fold(Dim::Const(1), |acc, &ch| acc.checked_mul(&size(c, t, ch)))
            .ok_or_else(|| c.bad("a size overflows"))
    };
    let order = |t: &Term, groups: &[&[char]]| -> Vec<usize> {
        groups
            .iter()
            .flat_map(|g| {
                g.iter()
                    .map(|ch| t.letters.iter().position(|x| x == ch).expect("present"))
            })
            .collect()
    };
    let pa = c.permute(a.id, order(a, &[&batch, &a_free, &summed]))?;
    let pb = c.permute(b.id, order(b, &[&batch, &summed, &b_free]))?;
    let bdims: Vec<Dim> = batch.iter().map(|&ch| size(c, a, ch)).collect();
    for &ch in &batch {
        if size(c, a, ch) != size(c, b, ch) {
            return Err(c.bad(format!(
                "letter `{ch}` has sizes {} and {}",
                size(c, a, ch),
                size(c, b, ch)
            )));
        }
    }
    let (m, k, n) = (
        prod(c, a, &a_free)?,
        prod(c, a, &summed)?,
        prod(c, b, &b_free)?,
    );
    let mut sa = bdims.clone();
    sa.extend([m, k.clone()]);
    let mut sb = bdims.clone();
    sb.extend([k, n]);
    let ra = c.reshape(pa, sa)?;
    let rb = c.reshape(pb, sb)?;
    let p = matmul(c, ra, rb)?;
    let mut dims = bdims;
    dims.extend(a_free.iter().map(|&ch| size(c, a, ch)));
    dims.extend(b_free.iter().map(|&ch| size(c, b, ch)));
    let id = c.reshape(p, dims)?;
    let mut letters = batch;
    letters.extend(a_free);
    letters.extend(b_free);
    Ok(Term { id, letters })
}

/// The negative log-likelihood of `logp` ([N, C, d…]) at the targets
/// (input 1, [N, d…]), weighted per class by input 2 when given, targets
/// equal to `ignore_index` counting for nothing; reduced by `reduction`
/// (`mean`: the weighted mean). `extra` is a second output (the
/// log-probabilities of SoftmaxCrossEntropyLoss).
fn nll(c: &mut Ctx, logp: NodeId, extra: Option<NodeId>) -> Result<Vec<Val>> {
    use tessera::ir::CompareOp as C;
    let t = c.x(1)?;
    let t = c.cast(t, DType::I64)?;
    let dtype = c.dtype(logp);
    let ignore = c.attr("ignore_index").map(|a| a.i);
    let (t_safe, mask) = match ignore {
        Some(ii) => {
            let keep = c.compare_c(C::Ne, t, ii as f64)?;
            let zero = c.scalar(0.0, DType::I64)?;
            (c.where_(keep, t, zero)?, Some(keep))
        }
        None => (t, None),
    };
    let idx = c.unsqueeze(t_safe, 1)?;
    let picked = c.add(Op::Gather { dim: 1 }, &[logp, idx])?;
    let tdims = c.dims(t_safe);
    let picked = c.reshape(picked, tdims.clone())?;
    let w = if c.has_input(2) {
        let weight = c.x(2)?;
        let count = tdims
            .iter()
            .try_fold(Dim::Const(1), |a, d| a.checked_mul(d))
            .ok_or_else(|| c.bad("the target's size overflows"))?;
        let flat = c.reshape(t_safe, vec![count])?;
        let wt = c.add(Op::IndexSelect { dim: 0 }, &[weight, flat])?;
        Some(c.reshape(wt, tdims.clone())?)
    } else {
        None
    };
    let w = match (w, mask) {
        (Some(w), Some(m)) => {
            let zero = c.scalar(0.0, dtype)?;
            Some(c.where_(m, w, zero)?)
        }
        (None, Some(m)) => Some(c.cast(m, dtype)?),
        (w, None) => w,
    };
    let neg = c.unary(U::Neg, picked)?;
    let loss = match w {
        Some(w) => c.binary(B::Mul, neg, w)?,
        None => neg,
    };
    let all: Vec<usize> = (0..c.rank(loss)).collect();
    let sum = |c: &mut Ctx, v: NodeId| {
        c.add(
            Op::Reduce {
                op: R::Sum,
                dims: all.clone(),
                keepdim: false,
            },
            &[v],
        )
    };
    let out = match c.attr_s("reduction", "mean").as_str() {
        "none" => loss,
        "sum" => sum(c, loss)?,
        "mean" => match w {
            Some(w) => {
                let total = sum(c, loss)?;
                let weight = sum(c, w)?;
                c.binary(B::Div, total, weight)?
            }
            None => c.add(
                Op::Reduce {
                    op: R::Mean,
                    dims: all.clone(),
                    keepdim: false,
                },
                &[loss],
            )?,
        },
        other => return Err(c.bad(format!("reduction `{other}` (none, sum or mean)"))),
    };
    let mut outs = vec![Val::node(out)];
    if let Some(e) = extra {
        outs.push(Val::node(e));
    }
    Ok(outs)
}

/// The first pair of positions holding the same letter.
fn repeated(letters: &[char]) -> Option<(usize, usize)> {
    (0..letters.len()).find_map(|p| {
        (p + 1..letters.len())
            .find(|&q| letters[q] == letters[p])
            .map(|q| (p, q))
    })
}

/// The diagonal of dims `p` and `q` (equal sizes): both moved last,
/// flattened, every (n+1)-th element; the letter kept once, last.
fn diagonal(c: &mut Ctx, t: &Term, p: usize, q: usize) -> Result<Term> {
    let dims = c.dims(t.id);
    let n = dims[p]
        .as_const()
        .ok_or_else(|| c.unsupported("the diagonal of a symbolic dim"))?;
    if dims[q] != dims[p] {
        return Err(c.bad(format!(
            "letter `{}` has sizes {} and {}",
            t.letters[p], dims[p], dims[q]
        )));
    }
    let mut perm: Vec<usize> = (0..dims.len()).filter(|&i| i != p && i != q).collect();
    let kept: Vec<char> = perm.iter().map(|&i| t.letters[i]).collect();
    perm.extend([p, q]);
    let y = c.permute(t.id, perm.clone())?;
    let y = c.add(Op::Contiguous, &[y])?;
    let mut flat: Vec<Dim> = perm[..perm.len() - 2]
        .iter()
        .map(|&i| dims[i].clone())
        .collect();
    flat.push(Dim::Const(n * n));
    let y = c.reshape(y, flat)?;
    let last = c.rank(y) - 1;
    let y = if n == 0 {
        y
    } else {
        c.slice(y, last, 0, n * n, n + 1)?
    };
    let mut letters = kept;
    letters.push(t.letters[p]);
    Ok(Term { id: y, letters })
}
