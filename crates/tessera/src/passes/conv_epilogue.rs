//! Convolution epilogues: what follows a `tessera::conv2d` per output
//! channel is folded into the convolution itself (seed 001's Conv2D +
//! BiasAdd + Activation, Conv2D + FusedBatchNorm + Activation and Conv2D +
//! Squeeze + BiasAdd patterns), each fold logged under
//! `TESSERA_LOGS=fusion`:
//!
//! - **bias**: `conv(x, w[, b]) + c`, `c` one value per output channel
//!   (`[1, O, 1, 1]`, `[O, 1, 1]`), becomes `conv(x, w, b + c)`; also after
//!   a squeeze of the spatial dims (`reshape(conv)` to `[N, O]` or `[N, O,
//!   L]` plus `[O]` or `[O, 1]`), which becomes `reshape(conv(x, w, b +
//!   c))`. The kernel adds the bias to each output it writes, as the add
//!   did: exact. A conv that has a bias already gets `b + c`, which
//!   regroups the sum (`(y + b) + c` against `y + (b + c)`): only under
//!   [`PassContext::allow_reassociation`].
//! - **activation**: `relu(conv(…))` becomes the conv with its `relu`
//!   epilogue: exact.
//! - **scale** (batch norm folded for inference): `conv(x, w[, b]) · s`,
//!   `s` per output channel, becomes `conv(x, w · s, b · s)`: the weights
//!   are rewritten in the graph (the product is over the weights, not the
//!   activations, and `constant_fold` evaluates it once when the weights
//!   are constants). Eval-mode `batch_norm` is `x · scale + shift` per
//!   channel, so conv + batch norm (+ ReLU) becomes one convolution with
//!   bias and epilogue. The products round differently (`(x·w)·s` against
//!   `x·(w·s)`), so this fold runs only under
//!   [`PassContext::allow_reassociation`].
//!
//! Each fold needs the convolution (and a squeeze) to have no other reader
//! (a value saved for a backward pass keeps its producer as it is) and
//! every node merged to carry the same hints.

use super::pattern::same_hints;
use super::rewrite::{append, use_counts, Replacements};
use super::PassContext;
use crate::error::Result;
use crate::ir::custom::conv::{Activation, Conv2d, CONV2D};
use crate::ir::custom::CustomCall;
use crate::ir::{BinaryOp, Dim, Graph, NodeId, Op, Shape, UnaryOp};
use crate::logging::log;

pub fn run(graph: &mut Graph, ctx: &PassContext) -> Result<bool> {
    let uses = use_counts(graph);
    let mut r = Replacements::new();
    for i in 0..graph.len() {
        let id = NodeId(i as u32);
        let node = graph.node(id).clone();
        match node.op {
            Op::Unary(UnaryOp::Relu) => {
                let src = node.inputs[0];
                let Some((conv, geometry)) = fusable_conv(graph, &r, &uses, src, id) else {
                    continue;
                };
                let call = with_activation(geometry, Activation::Relu)?;
                let inputs = graph.node(conv).inputs.clone();
                r.replace_with(graph, id, Op::Custom(call), &inputs)?;
                log("fusion", || {
                    format!(
                        "conv epilogue: relu {} into conv {}",
                        graph.display_name(id),
                        graph.display_name(conv)
                    )
                });
            }
            Op::Binary(BinaryOp::Add) => {
                for (a, c) in [(0, 1), (1, 0)] {
                    let at = (id, node.inputs[a], node.inputs[c]);
                    if fold_bias(graph, &mut r, &uses, ctx, at)? {
                        break;
                    }
                }
            }
            Op::Binary(BinaryOp::Mul) if ctx.allow_reassociation => {
                for (a, c) in [(0, 1), (1, 0)] {
                    if fold_scale(graph, &mut r, &uses, id, node.inputs[a], node.inputs[c])? {
                        break;
                    }
                }
            }
            _ => {}
        }
    }
    r.apply(graph)
}

/// The convolution `src` stands for (after this sweep's replacements),
/// with its geometry, when it has no epilogue yet, `src` has no other
/// reader than `user`, and they share hints.
fn fusable_conv(
    g: &Graph,
    r: &Replacements,
    uses: &[usize],
    src: NodeId,
    user: NodeId,
) -> Option<(NodeId, Conv2d)> {
    let conv = r.resolve(src);
    let Op::Custom(call) = &g.node(conv).op else {
        return None;
    };
    if call.name() != CONV2D || uses[src.index()] != 1 || !same_hints(g, &[conv, user]) {
        return None;
    }
    let geometry = Conv2d::from_attrs(CONV2D, &call.attrs).ok()?;
    (geometry.activation == Activation::None).then_some((conv, geometry))
}

fn with_activation(geometry: Conv2d, activation: Activation) -> Result<CustomCall> {
    CustomCall::new(
        CONV2D,
        Conv2d {
            activation,
            ..geometry
        }
        .attrs(),
    )
}

/// The output channels of convolution `conv` (its weight's dim 0).
fn channels(g: &Graph, conv: NodeId) -> Option<usize> {
    let w = g.node(conv).inputs[1];
    g.node(w).ty.shape.0[0].as_const()
}

/// Whether `c` holds one value per channel of an output of rank `rank`
/// whose channel dim is 1 and has `o` channels: its shape, left-padded
/// with 1s to `rank`, is `[1, o, 1, …]`.
fn per_channel(g: &Graph, c: NodeId, rank: usize, o: usize) -> bool {
    let dims = &g.node(c).ty.shape.0;
    if dims.len() > rank {
        return false;
    }
    let pad = rank - dims.len();
    (0..rank).all(|d| {
        let size = if d < pad {
            Dim::Const(1)
        } else {
            dims[d - pad].clone()
        };
        size == Dim::Const(if d == 1 { o } else { 1 })
    })
}

/// `add(src, c)` at `id` → the conv with `c` in its bias, directly or
/// under a squeeze of its spatial dims.
fn fold_bias(
    g: &mut Graph,
    r: &mut Replacements,
    uses: &[usize],
    ctx: &PassContext,
    (id, src, c): (NodeId, NodeId, NodeId),
) -> Result<bool> {
    // The conv itself, or a reshape of it that only drops spatial 1s.
    let (conv_src, squeeze) = match &g.node(r.resolve(src)).op {
        Op::Reshape(shape) if uses[src.index()] == 1 => (
            g.node(r.resolve(src)).inputs[0],
            Some((r.resolve(src), shape.clone())),
        ),
        _ => (src, None),
    };
    let user = squeeze.as_ref().map_or(id, |(s, _)| *s);
    let Some((conv, geometry)) = fusable_conv(g, r, uses, conv_src, user) else {
        return Ok(false);
    };
    let Some(o) = channels(g, conv) else {
        return Ok(false);
    };
    let out_ty = g.node(id).ty.clone();
    let value_ty = g.node(r.resolve(src)).ty.clone();
    if out_ty != value_ty
        || g.node(c).ty.dtype != out_ty.dtype
        || !per_channel(g, c, out_ty.rank(), o)
        || !same_hints(g, &[conv, id])
    {
        return Ok(false);
    }
    if let Some((_, shape)) = &squeeze {
        if !drops_spatial_ones(&g.node(conv).ty.shape, shape) {
            return Ok(false);
        }
    }
    let inputs = g.node(conv).inputs.clone();
    // A second bias is added to the first before the product is: that
    // regroups the sum.
    if inputs.len() == 3 && !ctx.allow_reassociation {
        return Ok(false);
    }
    let flat = flat(g, c, o, id)?;
    let bias = match inputs.get(2) {
        Some(&b) => append(g, Op::Binary(BinaryOp::Add), &[b, flat], id)?,
        None => flat,
    };
    let call = CustomCall::new(CONV2D, geometry.attrs())?;
    let new_inputs = [inputs[0], inputs[1], bias];
    match squeeze {
        None => {
            r.replace_with(g, id, Op::Custom(call), &new_inputs)?;
        }
        Some((_, shape)) => {
            let fused = append(g, Op::Custom(call), &new_inputs, id)?;
            r.replace_with(g, id, Op::Reshape(shape), &[fused])?;
        }
    }
    log("fusion", || {
        format!(
            "conv epilogue: bias {} into conv {}{}",
            g.display_name(c),
            g.display_name(conv),
            if inputs.len() == 3 {
                " (added to its bias)"
            } else {
                ""
            }
        )
    });
    Ok(true)
}

/// `c` (one value per channel) as `[o]`.
fn flat(g: &mut Graph, c: NodeId, o: usize, from: NodeId) -> Result<NodeId> {
    let shape = Shape::from_concrete(&[o]);
    match g.node(c).ty.shape == shape {
        true => Ok(c),
        false => append(g, Op::Reshape(shape), &[c], from),
    }
}

/// Whether `to` is `from` ([N, O, H, W]) with some of H, W (each 1)
/// dropped.
fn drops_spatial_ones(from: &Shape, to: &Shape) -> bool {
    let (f, t) = (&from.0, &to.0);
    if t.len() < 2 || t.len() > 4 || f.len() != 4 || t[..2] != f[..2] {
        return false;
    }
    let kept: Vec<&Dim> = f[2..].iter().filter(|d| **d != Dim::Const(1)).collect();
    let rest: Vec<&Dim> = t[2..].iter().filter(|d| **d != Dim::Const(1)).collect();
    kept == rest && t.len() < 4
}

/// `mul(src, s)` at `id` → the conv with `s` folded into its weights and
/// bias.
fn fold_scale(
    g: &mut Graph,
    r: &mut Replacements,
    uses: &[usize],
    id: NodeId,
    src: NodeId,
    s: NodeId,
) -> Result<bool> {
    let Some((conv, geometry)) = fusable_conv(g, r, uses, src, id) else {
        return Ok(false);
    };
    let Some(o) = channels(g, conv) else {
        return Ok(false);
    };
    let out_ty = g.node(id).ty.clone();
    if out_ty != g.node(conv).ty || g.node(s).ty.dtype != out_ty.dtype || !per_channel(g, s, 4, o) {
        return Ok(false);
    }
    let inputs = g.node(conv).inputs.clone();
    let per_o = append(
        g,
        Op::Reshape(Shape::from_concrete(&[o, 1, 1, 1])),
        &[s],
        id,
    )?;
    let w = append(g, Op::Binary(BinaryOp::Mul), &[inputs[1], per_o], id)?;
    let mut new_inputs = vec![inputs[0], w];
    if let Some(&b) = inputs.get(2) {
        let flat = flat(g, s, o, id)?;
        new_inputs.push(append(g, Op::Binary(BinaryOp::Mul), &[b, flat], id)?);
    }
    let call = CustomCall::new(CONV2D, geometry.attrs())?;
    r.replace_with(g, id, Op::Custom(call), &new_inputs)?;
    log("fusion", || {
        format!(
            "conv epilogue: scale {} folded into the weights of conv {}",
            g.display_name(s),
            g.display_name(conv)
        )
    });
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::passes::testing::{assert_rewrites, assert_unchanged};
    use crate::passes::PassContext;

    const PLAIN: &str = r#"{op="tessera::conv2d", attrs="{\"activation\":\"none\",\"dilation\":[1,1],\"groups\":1,\"padding\":[1,1,1,1],\"stride\":[1,1]}"}"#;
    const RELU: &str = r#"{op="tessera::conv2d", attrs="{\"activation\":\"relu\",\"dilation\":[1,1],\"groups\":1,\"padding\":[1,1,1,1],\"stride\":[1,1]}"}"#;

    #[test]
    fn folds_batch_norm_bias_and_relu_into_the_conv() {
        let before = format!(
            "graph g(%x, %w, %s, %t) {{
  %x = input : f32[2,3,5,5]
  %w = input : f32[4,3,3,3]
  %s = input : f32[4]
  %t = input : f32[4]
  %y = custom(%x, %w) {PLAIN} : f32[2,4,5,5]
  %s4 = reshape(%s) {{shape=[1,4,1,1]}} : f32[1,4,1,1]
  %t4 = reshape(%t) {{shape=[1,4,1,1]}} : f32[1,4,1,1]
  %scaled = mul(%y, %s4) : f32[2,4,5,5]
  %shifted = add(%scaled, %t4) : f32[2,4,5,5]
  %out = relu(%shifted) : f32[2,4,5,5]
  return %out as out
}}"
        );
        let after = format!(
            "graph g(%x, %w, %s, %t) {{
  %x = input : f32[2,3,5,5]
  %w = input : f32[4,3,3,3]
  %s = input : f32[4]
  %t = input : f32[4]
  %s4 = reshape(%s) {{shape=[1,4,1,1]}} : f32[1,4,1,1]
  %t4 = reshape(%t) {{shape=[1,4,1,1]}} : f32[1,4,1,1]
  %6 = reshape(%s4) {{shape=[4,1,1,1]}} : f32[4,1,1,1]
  %7 = mul(%w, %6) : f32[4,3,3,3]
  %8 = reshape(%t4) {{shape=[4]}} : f32[4]
  %out = custom(%x, %7, %8) {RELU} : f32[2,4,5,5]
  return %out as out
}}
"
        );
        assert_rewrites(run, &PassContext::default(), &before, &after);
        // Exact arithmetic only: the scale stays, and with it the shift and
        // the relu that follow it.
        assert_unchanged(run, &PassContext::exact(), &before);
    }

    #[test]
    fn folds_a_bias_after_a_squeeze() {
        let before = format!(
            "graph g(%x, %w, %b) {{
  %x = input : f32[2,3,3,3]
  %w = input : f32[4,3,3,3]
  %b = input : f32[4]
  %y = custom(%x, %w) {} : f32[2,4,1,1]
  %sq = reshape(%y) {{shape=[2,4]}} : f32[2,4]
  %out = add(%sq, %b) : f32[2,4]
  return %out as out
}}",
            PLAIN.replace("[1,1,1,1]", "[0,0,0,0]")
        );
        let (changed, text) = crate::passes::testing::rewrite(run, &PassContext::exact(), &before);
        assert!(changed, "{text}");
        assert!(
            text.contains("custom(%x, %w, %b)") && text.contains("%out = reshape("),
            "{text}"
        );
    }

    #[test]
    fn leaves_a_conv_read_elsewhere_or_a_full_tensor_add() {
        let before = format!(
            "graph g(%x, %w, %t, %z) {{
  %x = input : f32[2,3,5,5]
  %w = input : f32[4,3,3,3]
  %t = input : f32[1,4,1,1]
  %z = input : f32[2,4,5,5]
  %y = custom(%x, %w) {PLAIN} : f32[2,4,5,5]
  %a = add(%y, %t) : f32[2,4,5,5]
  %y2 = custom(%x, %w) {PLAIN} : f32[2,4,5,5]
  %b = add(%y2, %z) : f32[2,4,5,5]
  return %a as a, %y as y, %b as b
}}"
        );
        assert_unchanged(run, &PassContext::default(), &before);
    }
}
