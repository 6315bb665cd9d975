//! Attention recognition (Inductor's `fuse_attention`): scaled dot-product
//! attention written with plain ops,
//!
//! ```text
//! softmax(where(causal, matmul(q, kᵀ) · scale + mask, -inf), dim=-1) · v
//! ```
//!
//! becomes one `tessera::flash_attention` node (see
//! `crate::custom_op::flash_attention`; its signature is
//! `crate::ir::custom::flash_attention`): tiled, no `[Lq, Lk]` scores in
//! memory, and differentiated by the op's registered backward, which
//! recomputes the probabilities. The pipeline runs before AOT autograd, so
//! the backward graph gets the op's backward instead of the composite's.
//!
//! What matches, walking up from the final `matmul(p, v)`:
//! - `p = softmax(s, dim=-1)`, or, as autocast writes it with bf16/f16
//!   scores, `p = cast(softmax(cast(s, f32), dim=-1), half)` (the softmax
//!   in f32, the probabilities back in `s`'s half type: the op computes its
//!   softmax in f32 tiles);
//! - optionally `s = where(keep, s', -inf)` with `keep` lower-triangular
//!   (`tril(ones)`, a folded bool constant, or `cast(tril(ones), bool)`):
//!   the op's `causal` (top-left aligned, query `i` sees keys `j <= i`);
//! - optionally `s = s' + mask` (either side) with an f32 mask of shape
//!   `[Lq, Lk]`, `[1, …, 1, Lq, Lk]` or the scores' shape, computed from
//!   nothing that gradients are taken with respect to (the op gives the
//!   mask no gradient; see [`PassContext::grad_inputs`]), and either a
//!   constant that leaves every query a key to see or any mask under
//!   [`PassContext::unsafe_math`] (a row that sees no key is NaN in the
//!   composite and zeros in the op);
//! - `s = scores · c`, `c · scores` or `scores / c` with `c` a scalar
//!   constant, and/or `q = q' · c` (how `nn::MultiHeadAttention` scales):
//!   the op's `scale`; without any scale nothing matches;
//! - `scores = matmul(q, kᵀ)` where `kᵀ` is a permute that reads its
//!   input's last two dims in reverse order (a transpose, possibly composed
//!   with a permute of the batch dims, as `movement` leaves the heads of
//!   `nn::MultiHeadAttention`: the op then reads `k` through a new permute,
//!   a view), or `matmul_t(q, k) {transpose_b}` (after `transpose_matmul`).
//!
//! The scores, the scaled and masked scores and the probabilities must have
//! no other reader (they vanish), `v` must not be transposed (a permute
//! reversing its last two dims, or `matmul_t`), every node the
//! op absorbs must carry the final matmul's hints (no rewrite mixes hint
//! groups), and the op's shape rules must accept the operands (f32, f16 or
//! bf16, one rank, shared leading dims, head dims ≤ 256). The new node takes
//! the final matmul's name, call site and hints. Each replacement is logged
//! under `TESSERA_LOGS=fusion`.
//!
//! Not exact: the op multiplies `q·k` by the scale in its f32 tiles and
//! sums the softmax in another order, so results move by rounding; it runs
//! only under [`PassContext::allow_reassociation`] (the default).

use super::pattern::{same_hints, uniform_value};
use super::rewrite::{append, use_counts, Replacements};
use super::PassContext;
use crate::error::Result;
use crate::ir::custom::flash_attention::{self, FORWARD};
use crate::ir::custom::CustomCall;
use crate::ir::{BinaryOp, DType, Dim, Graph, LiteralData, NodeId, Op, Scalar, Shape, TensorType};
use crate::logging::log;

pub fn run(graph: &mut Graph, ctx: &PassContext) -> Result<bool> {
    if !ctx.allow_reassociation {
        return Ok(false);
    }
    let uses = use_counts(graph);
    let tainted = depends_on_grad_inputs(graph, ctx);
    let mut r = Replacements::new();
    for i in 0..graph.len() {
        let id = NodeId(i as u32);
        if let Some(m) = attention_at(graph, ctx, &uses, &tainted, id) {
            replace(graph, &mut r, id, &m)?;
        }
    }
    r.apply(graph)
}

/// How the op reads `k`: a node as it is, or a permute of one (a view).
#[derive(Debug)]
enum KeyOperand {
    Node(NodeId),
    Permuted(NodeId, Vec<usize>),
}

/// How the op reads the mask: a node as it is, or reshaped to `[Lq, Lk]`.
#[derive(Debug)]
enum MaskOperand {
    Node(NodeId),
    Reshaped(NodeId, Shape),
}

/// A matched attention: the op's operands and attributes.
#[derive(Debug)]
struct Attention {
    q: NodeId,
    k: KeyOperand,
    v: NodeId,
    mask: Option<MaskOperand>,
    causal: bool,
    scale: f64,
    /// The nodes the op stands for (by id), for the hint check and the log.
    absorbed: Vec<NodeId>,
}

/// The attention whose final `matmul(p, v)` is `id`, if the whole pattern
/// matches (see the module docs).
fn attention_at(
    g: &Graph,
    ctx: &PassContext,
    uses: &[usize],
    tainted: &[bool],
    id: NodeId,
) -> Option<Attention> {
    let node = g.node(id);
    if node.op != Op::MatMul || transposed(g, node.inputs[1]).is_some() {
        return None;
    }
    let v = node.inputs[1];
    let probs = only_use(uses, node.inputs[0])?;
    let mut absorbed = vec![id];
    let (p, up) = match autocast_softmax(g, uses, probs) {
        Some((p, up)) => {
            absorbed.extend([probs, up]);
            (p, Some(up))
        }
        None => (probs, None),
    };
    let Op::Softmax { dim } = g.node(p).op else {
        return None;
    };
    if dim + 1 != g.node(p).ty.rank() {
        return None;
    }
    absorbed.push(p);
    let mut s = only_use(uses, g.node(up.unwrap_or(p)).inputs[0])?;
    let causal = match causal_fill(g, s) {
        Some(inner) => {
            absorbed.push(s);
            s = only_use(uses, inner)?;
            true
        }
        None => false,
    };
    let mask_allowed = |mask: NodeId| {
        !tainted[mask.index()] && (ctx.unsafe_math || every_row_sees_a_key(g, mask, causal))
    };
    let (scores, mask) = match masked(g, uses, &mask_allowed, s) {
        Some((inner, mask)) => {
            absorbed.push(s);
            (inner, Some(mask))
        }
        None => (s, None),
    };
    let (product, scale) = match scaled(g, scores) {
        Some((inner, c)) => {
            absorbed.push(scores);
            (only_use(uses, inner)?, Some(c))
        }
        None => (scores, None),
    };
    absorbed.push(product);
    let (q, k, q_scale) = query_and_key(g, product, &mut absorbed)?;
    let scale = match (scale, q_scale) {
        (None, None) => return None,
        (a, b) => a.unwrap_or(1.0) * b.unwrap_or(1.0),
    };
    absorbed.sort();
    if !same_hints(g, &absorbed) {
        return None;
    }
    let m = Attention {
        q,
        k,
        v,
        mask,
        causal,
        scale,
        absorbed,
    };
    (operand_types(g, &m)?[0] == node.ty).then_some(m)
}

/// `(softmax, up)` when `id` is autocast's softmax of half scores:
/// `cast(softmax(up), h)` with `up = cast(s, f32)`, `s` of the half type
/// `h`, each read once.
fn autocast_softmax(g: &Graph, uses: &[usize], id: NodeId) -> Option<(NodeId, NodeId)> {
    let down = g.node(id);
    let Op::Cast(half @ (DType::BF16 | DType::F16)) = down.op else {
        return None;
    };
    let p = only_use(uses, down.inputs[0])?;
    let softmax = g.node(p);
    if !matches!(softmax.op, Op::Softmax { .. }) || softmax.ty.dtype != DType::F32 {
        return None;
    }
    let up = only_use(uses, softmax.inputs[0])?;
    let cast = g.node(up);
    let from_half = g.node(*cast.inputs.first()?).ty.dtype == half;
    (cast.op == Op::Cast(DType::F32) && from_half).then_some((p, up))
}

/// `id` when it is read exactly once (so it vanishes with its reader).
fn only_use(uses: &[usize], id: NodeId) -> Option<NodeId> {
    (uses[id.index()] == 1).then_some(id)
}

/// The scores inside `where(keep, scores, -inf)` with `keep` causal.
fn causal_fill(g: &Graph, id: NodeId) -> Option<NodeId> {
    let node = g.node(id);
    if node.op != Op::Where {
        return None;
    }
    let (keep, scores, fill) = (node.inputs[0], node.inputs[1], node.inputs[2]);
    let fill_is_neg_inf = scalar_value(g, fill).is_some_and(|x| x == f64::NEG_INFINITY);
    let same_type = g.node(scores).ty == node.ty;
    (fill_is_neg_inf && same_type && is_causal_keep(g, keep)).then_some(scores)
}

/// Whether the bool `id` is `true` exactly on and below the diagonal of its
/// last two dims (its leading dims, if any, of size 1).
fn is_causal_keep(g: &Graph, id: NodeId) -> bool {
    let node = g.node(id);
    let dims = node.ty.shape.dims();
    if node.ty.dtype != DType::Bool || dims.len() < 2 {
        return false;
    }
    if dims[..dims.len() - 2].iter().any(|d| *d != Dim::Const(1)) {
        return false;
    }
    match &node.op {
        Op::Tril { diagonal: 0 } => all_nonzero(g, node.inputs[0]),
        Op::Cast(DType::Bool) => {
            let x = g.node(node.inputs[0]);
            matches!(x.op, Op::Tril { diagonal: 0 }) && all_nonzero(g, x.inputs[0])
        }
        Op::Constant(lit) => {
            let (r, c) = match dims[dims.len() - 2..] {
                [Dim::Const(r), Dim::Const(c)] => (r, c),
                _ => return false,
            };
            let LiteralData::Bool(values) = &lit.data else {
                return false;
            };
            values.len() == r * c
                && values
                    .iter()
                    .enumerate()
                    .all(|(n, &keep)| keep == (n % c <= n / c))
        }
        _ => false,
    }
}

/// Whether every element of `id` is a known nonzero (true) value.
fn all_nonzero(g: &Graph, id: NodeId) -> bool {
    match uniform_value(g, id) {
        Some(Scalar::Bool(b)) => b,
        Some(v) => v.as_f64() != 0.0,
        None => false,
    }
}

/// The value of `id` when it is a constant with one element (of any rank).
fn scalar_value(g: &Graph, id: NodeId) -> Option<f64> {
    let node = g.node(id);
    let one_element = node.ty.shape.dims().iter().all(|d| *d == Dim::Const(1));
    match uniform_value(g, id)? {
        Scalar::Float(x) if one_element => Some(x),
        _ => None,
    }
}

/// `(scores, mask)` when `id` is `scores + mask` (either side) with a
/// mask the op can take.
fn masked(
    g: &Graph,
    uses: &[usize],
    allowed: &dyn Fn(NodeId) -> bool,
    id: NodeId,
) -> Option<(NodeId, MaskOperand)> {
    let node = g.node(id);
    if node.op != Op::Binary(BinaryOp::Add) {
        return None;
    }
    let (a, b) = (node.inputs[0], node.inputs[1]);
    [(a, b), (b, a)].into_iter().find_map(|(scores, mask)| {
        let fits = g.node(scores).ty == node.ty && is_scores(g, scores) && allowed(mask);
        let operand = mask_operand(g, mask, &node.ty)?;
        (fits && only_use(uses, scores).is_some()).then_some((scores, operand))
    })
}

/// Whether the constant mask `id` leaves every query row a key to see
/// (a finite entry; with `causal`, at or below the diagonal). The op gives
/// a row that sees no key zeros where the composite's softmax gives NaN, so
/// a mask that may hide whole rows (any mask computed at run time) is only
/// absorbed under [`PassContext::unsafe_math`].
fn every_row_sees_a_key(g: &Graph, id: NodeId, causal: bool) -> bool {
    let node = g.node(id);
    let dims = node.ty.shape.dims();
    match (&node.op, &dims[dims.len().saturating_sub(1)..]) {
        (Op::Full { value, .. }, _) => value.as_f64().is_finite(),
        (Op::Constant(lit), [Dim::Const(cols)]) => {
            let LiteralData::Float(values) = &lit.data else {
                return false;
            };
            let rows_per_matrix = match dims {
                [.., Dim::Const(r), _] => *r,
                _ => 1,
            };
            values.chunks(*cols).enumerate().all(|(row, entries)| {
                let visible = match causal {
                    true => &entries[..(row % rows_per_matrix + 1).min(*cols)],
                    false => entries,
                };
                visible.iter().any(|x| x.is_finite())
            })
        }
        _ => false,
    }
}

/// Whether `id` can be (scaled) attention scores: the pattern's next step.
fn is_scores(g: &Graph, id: NodeId) -> bool {
    matches!(
        g.node(id).op,
        Op::Binary(BinaryOp::Mul | BinaryOp::Div) | Op::MatMul | Op::MatMulT { .. }
    )
}

/// The mask as the op takes it, for scores of type `scores`: f32, and
/// `[Lq, Lk]`, the scores' shape, or `[1, …, 1, Lq, Lk]` (reshaped).
fn mask_operand(g: &Graph, mask: NodeId, scores: &TensorType) -> Option<MaskOperand> {
    let ty = &g.node(mask).ty;
    let (m, s) = (ty.shape.dims(), scores.shape.dims());
    if ty.dtype != DType::F32 || m.len() < 2 || m.len() > s.len() {
        return None;
    }
    let last2 = &s[s.len() - 2..];
    if m == s || m == last2 {
        return Some(MaskOperand::Node(mask));
    }
    let leading_ones = m[..m.len() - 2].iter().all(|d| *d == Dim::Const(1));
    (leading_ones && &m[m.len() - 2..] == last2)
        .then(|| MaskOperand::Reshaped(mask, Shape(last2.to_vec())))
}

/// `(scores, scale)` when `id` is `scores · c`, `c · scores` or `scores / c`
/// for a finite scalar constant `c` (nonzero for `/`).
fn scaled(g: &Graph, id: NodeId) -> Option<(NodeId, f64)> {
    let node = g.node(id);
    let (a, b) = (*node.inputs.first()?, *node.inputs.get(1)?);
    let keeps_type = |x: NodeId| g.node(x).ty == node.ty;
    let finite = |x: NodeId| scalar_value(g, x).filter(|c| c.is_finite());
    match node.op {
        Op::Binary(BinaryOp::Mul) => match (finite(a), finite(b)) {
            (None, Some(c)) if keeps_type(a) => Some((a, c)),
            (Some(c), None) if keeps_type(b) => Some((b, c)),
            _ => None,
        },
        Op::Binary(BinaryOp::Div) => finite(b)
            .filter(|&c| c != 0.0 && keeps_type(a))
            .map(|c| (a, 1.0 / c)),
        _ => None,
    }
}

/// `(q, k, scale of q)` of the scores product `id`: `matmul(q, kᵀ)` or
/// `matmul_t(q, k) {transpose_b}`, with `q` possibly scaled by a constant.
/// Adds the transpose and the scaling of `q` to `absorbed`.
fn query_and_key(
    g: &Graph,
    id: NodeId,
    absorbed: &mut Vec<NodeId>,
) -> Option<(NodeId, KeyOperand, Option<f64>)> {
    let node = g.node(id);
    if !matches!(node.op, Op::MatMul | Op::MatMulT { .. }) {
        return None;
    }
    let (q, kt) = (node.inputs[0], node.inputs[1]);
    let k = match node.op {
        Op::MatMulT {
            transpose_a: false,
            transpose_b: true,
        } => KeyOperand::Node(kt),
        Op::MatMul => {
            let (x, perm) = transposed(g, kt)?;
            absorbed.push(kt);
            match perm.iter().enumerate().all(|(i, &p)| i == p) {
                true => KeyOperand::Node(x),
                false => KeyOperand::Permuted(x, perm),
            }
        }
        _ => return None,
    };
    match scaled(g, q) {
        Some((inner, c)) => {
            absorbed.push(q);
            Some((inner, k, Some(c)))
        }
        None => Some((q, k, None)),
    }
}

/// When `id` is a permute that reads its input's last two dims in reverse
/// order (a transpose, possibly composed with a permute of the other dims),
/// `(input, perm)` where `perm`, the permute with its last two entries
/// exchanged, gives the untransposed operand: `k` when `id` is `kᵀ`.
fn transposed(g: &Graph, id: NodeId) -> Option<(NodeId, Vec<usize>)> {
    let node = g.node(id);
    let Op::Permute(perm) = &node.op else {
        return None;
    };
    let r = perm.len();
    if r < 2 || perm[r - 2] < perm[r - 1] {
        return None;
    }
    let mut untransposed = perm.clone();
    untransposed.swap(r - 2, r - 1);
    Some((node.inputs[0], untransposed))
}

/// The op's output types for `m`'s operands (`None` where its shape rules
/// refuse them).
fn operand_types(g: &Graph, m: &Attention) -> Option<Vec<TensorType>> {
    let ty = |id: NodeId| g.node(id).ty.clone();
    let k = match &m.k {
        KeyOperand::Node(k) => ty(*k),
        KeyOperand::Permuted(x, perm) => Op::Permute(perm.clone()).infer(&[ty(*x)]).ok()?,
    };
    let mut types = vec![ty(m.q), k, ty(m.v)];
    types.extend(m.mask.as_ref().map(|mask| match mask {
        MaskOperand::Node(id) => ty(*id),
        MaskOperand::Reshaped(_, shape) => TensorType::new(DType::F32, shape.clone()),
    }));
    call(m).ok()?.infer(&types).ok()
}

fn call(m: &Attention) -> Result<CustomCall> {
    CustomCall::new(FORWARD, flash_attention::attrs(m.causal, m.scale))
}

/// Replaces the final matmul `id` by the op (the checks are done).
fn replace(g: &mut Graph, r: &mut Replacements, id: NodeId, m: &Attention) -> Result<()> {
    let k = match &m.k {
        KeyOperand::Node(k) => *k,
        KeyOperand::Permuted(x, perm) => append(g, Op::Permute(perm.clone()), &[*x], id)?,
    };
    let mut inputs = vec![m.q, k, m.v];
    match &m.mask {
        Some(MaskOperand::Node(mask)) => inputs.push(*mask),
        Some(MaskOperand::Reshaped(mask, shape)) => {
            inputs.push(append(g, Op::Reshape(shape.clone()), &[*mask], id)?)
        }
        None => {}
    }
    log("fusion", || describe(g, id, m, &inputs));
    r.replace_with(g, id, Op::Custom(call(m)?), &inputs)?;
    Ok(())
}

/// One line for the fusion log: what was replaced by what.
fn describe(g: &Graph, id: NodeId, m: &Attention, inputs: &[NodeId]) -> String {
    let operand = |name: &str, x: NodeId| format!("{name} {} {}", g.display_name(x), g.node(x).ty);
    let mut operands = vec![
        operand("q", inputs[0]),
        operand("k", inputs[1]),
        operand("v", inputs[2]),
    ];
    operands.extend(inputs.get(3).map(|&x| operand("mask", x)));
    let absorbed: Vec<String> = m
        .absorbed
        .iter()
        .map(|&x| format!("{} {}", g.node(x).op.name(), g.display_name(x)))
        .collect();
    let at = g
        .node(id)
        .meta
        .location
        .as_ref()
        .map_or(String::new(), |l| format!(" at {l}"));
    format!(
        "attention: {} ({}){at} -> {FORWARD} {{causal: {}, scale: {}}} on {}; replaces {}",
        g.display_name(id),
        g.node(id).ty,
        m.causal,
        m.scale,
        operands.join(", "),
        absorbed.join(", ")
    )
}

/// For each node, whether its value depends on a graph input that
/// gradients are taken with respect to (every input when unknown).
fn depends_on_grad_inputs(g: &Graph, ctx: &PassContext) -> Vec<bool> {
    let mut tainted = vec![false; g.len()];
    for (i, &input) in g.inputs.iter().enumerate() {
        tainted[input.index()] = ctx.grad_inputs.as_ref().is_none_or(|w| w.contains(&i));
    }
    for (i, node) in g.nodes.iter().enumerate() {
        if node.inputs.iter().any(|x| tainted[x.index()]) {
            tainted[i] = true;
        }
    }
    tainted
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::passes::testing::{assert_rewrites, assert_unchanged, rewrite};
    use crate::passes::PassContext;

    /// The seed's attention as traced: `matmul(q, permute(k))`, times a
    /// scalar, softmax over the last dim, times `v`.
    const SEED: &str = r#"graph g(%q, %k, %v) {
  %q = input : f32[2,8,4]
  %k = input : f32[2,8,4]
  %v = input : f32[2,8,4]
  %kt = permute(%k) {perm=[0,2,1]} : f32[2,4,8]
  %s = matmul(%q, %kt) : f32[2,8,8]
  %c = full {value=0.5, shape=[], dtype=f32} : f32[]
  %ss = mul(%s, %c) : f32[2,8,8]
  %p = softmax(%ss) {dim=2} : f32[2,8,8]
  %o = matmul(%p, %v) : f32[2,8,4]  # attn.rs:9:5
  return %o as o
}"#;

    const OP: &str = r#"op="tessera::flash_attention""#;

    #[test]
    fn the_seed_attention_becomes_the_op() {
        let after = format!(
            r#"graph g(%q, %k, %v) {{
  %q = input : f32[2,8,4]
  %k = input : f32[2,8,4]
  %v = input : f32[2,8,4]
  %o = custom(%q, %k, %v) {{{OP}, attrs="{{\"causal\":false,\"scale\":0.5}}"}} : f32[2,8,4]  # attn.rs:9:5
  return %o as o
}}
"#
        );
        assert_rewrites(run, &PassContext::default(), SEED, &after);
    }

    /// Autocast's attention: half scores, the softmax in f32 between two
    /// casts, half probabilities times `v`: the op in the half type.
    #[test]
    fn autocast_casts_around_the_softmax_are_absorbed() {
        for half in ["bf16", "f16"] {
            let before = format!(
                r#"graph g(%q, %k, %v) {{
  %q = input : {half}[2,8,4]
  %k = input : {half}[2,8,4]
  %v = input : {half}[2,8,4]
  %kt = permute(%k) {{perm=[0,2,1]}} : {half}[2,4,8]
  %s = matmul(%q, %kt) : {half}[2,8,8]
  %c = full {{value=0.5, shape=[], dtype={half}}} : {half}[]
  %ss = mul(%s, %c) : {half}[2,8,8]
  %up = cast(%ss) {{dtype=f32}} : f32[2,8,8]
  %p = softmax(%up) {{dim=2}} : f32[2,8,8]
  %ph = cast(%p) {{dtype={half}}} : {half}[2,8,8]
  %o = matmul(%ph, %v) : {half}[2,8,4]  # attn.rs:9:5
  return %o as o
}}"#
            );
            let after = format!(
                r#"graph g(%q, %k, %v) {{
  %q = input : {half}[2,8,4]
  %k = input : {half}[2,8,4]
  %v = input : {half}[2,8,4]
  %o = custom(%q, %k, %v) {{{OP}, attrs="{{\"causal\":false,\"scale\":0.5}}"}} : {half}[2,8,4]  # attn.rs:9:5
  return %o as o
}}
"#
            );
            assert_rewrites(run, &PassContext::default(), &before, &after);
            // The f32 probabilities or scores read elsewhere: no match.
            for other in ["%p as p", "%up as up"] {
                let graph = before.replace("return %o as o", &format!("return %o as o, {other}"));
                assert_unchanged(run, &PassContext::default(), &graph);
            }
        }
    }

    /// After `transpose_matmul` (`matmul_t`), a division, and the scale on
    /// `q` with `k` read through composed permutes (`nn::MultiHeadAttention`
    /// after `movement`): the op reads `k` through a new permute.
    #[test]
    fn matmul_t_division_and_a_scaled_query() {
        let before = r#"graph g(%q, %k, %x, %y, %w) {
  %q = input : f32[2,8,4]
  %k = input : f32[2,8,4]
  %x = input : f32[2,8,2,4]
  %y = input : f32[2,8,2,4]
  %w = input : f32[2,2,8,4]
  %c = constant {value=2.0} : f32[]
  %s = matmul_t(%q, %k) {transpose_a=false, transpose_b=true} : f32[2,8,8]
  %ss = div(%s, %c) : f32[2,8,8]
  %p = softmax(%ss) {dim=2} : f32[2,8,8]
  %o = matmul(%p, %k) : f32[2,8,4]
  %hq = permute(%x) {perm=[0,2,1,3]} : f32[2,2,8,4]
  %h = constant {value=0.5} : f32[]
  %hs = mul(%h, %hq) : f32[2,2,8,4]
  %kt = permute(%y) {perm=[0,2,3,1]} : f32[2,2,4,8]
  %t = matmul(%hs, %kt) : f32[2,2,8,8]
  %pt = softmax(%t) {dim=3} : f32[2,2,8,8]
  %a = matmul(%pt, %w) : f32[2,2,8,4]
  return %o as o, %a as a
}"#;
        let after = format!(
            r#"graph g(%q, %k, %x, %y, %w) {{
  %q = input : f32[2,8,4]
  %k = input : f32[2,8,4]
  %x = input : f32[2,8,2,4]
  %y = input : f32[2,8,2,4]
  %w = input : f32[2,2,8,4]
  %o = custom(%q, %k, %k) {{{OP}, attrs="{{\"causal\":false,\"scale\":0.5}}"}} : f32[2,8,4]
  %hq = permute(%x) {{perm=[0,2,1,3]}} : f32[2,2,8,4]
  %7 = permute(%y) {{perm=[0,2,1,3]}} : f32[2,2,8,4]
  %a = custom(%hq, %7, %w) {{{OP}, attrs="{{\"causal\":false,\"scale\":0.5}}"}} : f32[2,2,8,4]
  return %o as o, %a as a
}}
"#
        );
        assert_rewrites(run, &PassContext::default(), before, &after);
    }

    /// `where(tril(ones), s, -inf)` as traced, and as a folded constant.
    #[test]
    fn causal_fills_become_the_causal_flag() {
        let before = r#"graph g(%q, %k, %v) {
  %q = input : f32[1,3,4]
  %k = input : f32[1,3,4]
  %v = input : f32[1,3,4]
  %kt = permute(%k) {perm=[0,2,1]} : f32[1,4,3]
  %s = matmul(%q, %kt) : f32[1,3,3]
  %c = full {value=0.5, shape=[], dtype=f32} : f32[]
  %ss = mul(%s, %c) : f32[1,3,3]
  %ones = full {value=1, shape=[3,3], dtype=bool} : bool[3,3]
  %keep = tril(%ones) {diagonal=0} : bool[3,3]
  %ninf = full {value=-inf, shape=[], dtype=f32} : f32[]
  %m = where(%keep, %ss, %ninf) : f32[1,3,3]
  %p = softmax(%m) {dim=2} : f32[1,3,3]
  %o = matmul(%p, %v) : f32[1,3,4]
  %t = matmul(%q, %kt) : f32[1,3,3]
  %ts = mul(%c, %t) : f32[1,3,3]
  %folded = constant {value=[true,false,false,true,true,false,true,true,true]} : bool[3,3]
  %tm = where(%folded, %ts, %ninf) : f32[1,3,3]
  %tp = softmax(%tm) {dim=2} : f32[1,3,3]
  %a = matmul(%tp, %v) : f32[1,3,4]
  return %o as o, %a as a
}"#;
        let after = format!(
            r#"graph g(%q, %k, %v) {{
  %q = input : f32[1,3,4]
  %k = input : f32[1,3,4]
  %v = input : f32[1,3,4]
  %o = custom(%q, %k, %v) {{{OP}, attrs="{{\"causal\":true,\"scale\":0.5}}"}} : f32[1,3,4]
  %a = custom(%q, %k, %v) {{{OP}, attrs="{{\"causal\":true,\"scale\":0.5}}"}} : f32[1,3,4]
  return %o as o, %a as a
}}
"#
        );
        assert_rewrites(run, &PassContext::default(), before, &after);
    }

    /// Scores `[2, 2, 3]` plus `mask`, optionally causal.
    fn masked(mask: &str, mask_type: &str, causal: bool) -> String {
        let (fill, probs) = match causal {
            true => (
                "  %keep = constant {value=[true,false,false,true,true,false]} : bool[2,3]
  %ninf = full {value=-inf, shape=[], dtype=f32} : f32[]
  %f = where(%keep, %sm, %ninf) : f32[2,2,3]
",
                "%f",
            ),
            false => ("", "%sm"),
        };
        format!(
            r#"graph g(%q, %k, %v, %in) {{
  %q = input : f32[2,2,4]
  %k = input : f32[2,3,4]
  %v = input : f32[2,3,4]
  %in = input : f32[1,2,3]
  %kt = permute(%k) {{perm=[0,2,1]}} : f32[2,4,3]
  %s = matmul(%q, %kt) : f32[2,2,3]
  %c = full {{value=0.5, shape=[], dtype=f32}} : f32[]
  %ss = mul(%s, %c) : f32[2,2,3]
  %mask = {mask} : {mask_type}
  %sm = add(%mask, %ss) : f32[2,2,3]
{fill}  %p = softmax({probs}) {{dim=2}} : f32[2,2,3]
  %o = matmul(%p, %v) : f32[2,2,4]
  return %o as o
}}"#
        )
    }

    fn fused_inputs(ctx: &PassContext, before: &str) -> Option<String> {
        let (changed, text) = rewrite(run, ctx, before);
        let line = text.lines().find(|l| l.contains("%o = "))?;
        (changed && line.contains(OP)).then(|| {
            let args = &line[line.find('(').unwrap() + 1..line.find(')').unwrap()];
            format!("{args} causal={}", line.contains(r#"\"causal\":true"#))
        })
    }

    /// A constant mask that leaves each row a key becomes the op's mask;
    /// one that hides a row (with the causal fill), a mask computed from a
    /// differentiated input, or one of unknown values without `unsafe_math`
    /// leave the pattern alone.
    #[test]
    fn additive_masks_that_fit() {
        let ctx = PassContext::default();
        let finite = r#"constant {value=[0.0,-1.0,-inf,-inf,0.5,-inf]}"#;
        let graph = masked(finite, "f32[2,3]", false);
        assert_eq!(
            fused_inputs(&ctx, &graph).unwrap(),
            "%q, %k, %v, %mask causal=false"
        );
        let graph = masked(finite, "f32[2,3]", true);
        assert_eq!(
            fused_inputs(&ctx, &graph).unwrap(),
            "%q, %k, %v, %mask causal=true"
        );
        let hides_row_0 = r#"constant {value=[-inf,0.0,0.0,0.0,0.0,0.0]}"#;
        assert_unchanged(run, &ctx, &masked(hides_row_0, "f32[2,3]", true));
        assert!(fused_inputs(&ctx, &masked(hides_row_0, "f32[2,3]", false)).is_some());

        let from_input = masked("neg(%in)", "f32[1,2,3]", false);
        assert_unchanged(run, &ctx, &from_input);
        let unsafe_math = PassContext {
            unsafe_math: true,
            ..PassContext::default()
        };
        assert_unchanged(run, &unsafe_math, &from_input);
        let not_differentiated = PassContext {
            grad_inputs: Some(vec![0, 1, 2]),
            ..unsafe_math.clone()
        };
        let (changed, text) = rewrite(run, &not_differentiated, &from_input);
        assert!(changed, "{text}");
        assert!(
            text.contains("reshape(%mask) {shape=[2,3]} : f32[2,3]")
                && text.contains("custom(%q, %k, %v, %5)"),
            "{text}"
        );
        let differentiated = PassContext {
            grad_inputs: Some(vec![3]),
            ..unsafe_math
        };
        assert_unchanged(run, &differentiated, &from_input);
    }

    /// `SEED` with one line replaced.
    fn seed_with(line: &str, replacement: &str) -> String {
        assert!(SEED.contains(line), "{line}");
        SEED.replace(line, replacement)
    }

    #[test]
    fn near_misses_stay() {
        let ctx = PassContext::default();
        let cases = [
            (
                "softmax over another dim",
                seed_with(
                    "softmax(%ss) {dim=2}",
                    "softmax(%ss) {dim=1}",
                ),
            ),
            (
                "no scale",
                seed_with(
                    "%ss = mul(%s, %c) : f32[2,8,8]",
                    "%ss = exp(%s) : f32[2,8,8]",
                )
                .replace("softmax(%ss)", "softmax(%s)"),
            ),
            (
                "a transposed v",
                seed_with(
                    "%o = matmul(%p, %v) : f32[2,8,4]",
                    "%vt = permute(%v) {perm=[0,2,1]} : f32[2,8,8]\n  %o = matmul(%p, %vt) : f32[2,8,8]",
                )
                .replace("%v = input : f32[2,8,4]", "%v = input : f32[2,8,8]"),
            ),
            (
                "a second reader of the scores",
                seed_with("return %o as o", "return %o as o, %ss as ss"),
            ),
            (
                "a scale of many elements",
                seed_with(
                    "%c = full {value=0.5, shape=[], dtype=f32} : f32[]",
                    "%c = full {value=0.5, shape=[8], dtype=f32} : f32[8]",
                ),
            ),
            (
                "a scale that is not a constant",
                seed_with("%ss = mul(%s, %c)", "%ss = mul(%s, %s)"),
            ),
            (
                "the softmax in another hint group",
                seed_with(
                    "%p = softmax(%ss) {dim=2} : f32[2,8,8]",
                    r#"%p = softmax(%ss) {dim=2} : f32[2,8,8]  hints={"group_id":1}"#,
                ),
            ),
            (
                "f64",
                SEED.replace("f32", "f64"),
            ),
        ];
        for (name, graph) in cases {
            let (changed, text) = rewrite(run, &ctx, &graph);
            assert!(!changed && !text.contains(OP), "{name}:\n{text}");
        }
        assert_unchanged(run, &PassContext::exact(), SEED);
    }
}
