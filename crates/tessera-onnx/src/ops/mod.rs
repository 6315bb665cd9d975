//! Each ONNX op's mapping to tessera ops, by family. A converter reads the
//! current node from the [`Ctx`] (its inputs, attributes and the opset
//! version) and returns the node's outputs in order.

mod attention;
mod cnn;
mod control;
mod elementwise;
mod gelu;
mod grid_sample;
mod more;
mod nn;
mod quant;
mod reduce;
mod resize;
mod rnn;
mod shape;
mod signal;

use crate::builder::{Ctx, Val, WithContext};
use tessera::ir::NodeMeta;
use tessera::{Error, ErrorKind, Result, SourceLoc};

use crate::proto::NodeProto;

type Converter = fn(&mut Ctx) -> Result<Vec<Val>>;

/// The converter of an op of the default domain, if it has one.
fn converter(op_type: &str) -> Option<Converter> {
    elementwise::converter(op_type)
        .or_else(|| reduce::converter(op_type))
        .or_else(|| shape::converter(op_type))
        .or_else(|| nn::converter(op_type))
        .or_else(|| cnn::converter(op_type))
        .or_else(|| more::converter(op_type))
        .or_else(|| signal::converter(op_type))
        .or_else(|| quant::converter(op_type))
        .or(match op_type {
            "Attention" => Some(attention::attention as Converter),
            "Resize" => Some(resize::resize as Converter),
            "Upsample" => Some(resize::upsample as Converter),
            "If" => Some(control::if_op as Converter),
            "RNN" => Some(rnn::rnn as Converter),
            "GRU" => Some(rnn::gru as Converter),
            "LSTM" => Some(rnn::lstm as Converter),
            "GridSample" => Some(grid_sample::grid_sample as Converter),
            "Loop" => Some(control::loop_op as Converter),
            "Scan" => Some(control::scan as Converter),
            _ => None,
        })
}

/// Whether an op has a mapping to tessera.
pub fn is_supported(domain: &str, op_type: &str) -> bool {
    matches!(domain, "" | "ai.onnx") && converter(op_type).is_some()
}

/// Converts `nodes` in order, each output name bound to its value in
/// `ctx.values` (a subgraph's nodes see the enclosing graphs' values).
pub fn convert_nodes(ctx: &mut Ctx, nodes: &[NodeProto], outputs: &[String]) -> Result<()> {
    let plans = gelu::plan(ctx, nodes, outputs);
    for (i, node) in nodes.iter().enumerate() {
        if plans[i] == gelu::Plan::Skip {
            continue;
        }
        let label = if node.name.is_empty() {
            format!("#{i}")
        } else {
            format!("`{}`", node.name)
        };
        let file = ctx.file.clone();
        let mut inputs = Vec::with_capacity(node.input.len());
        // A recognised chain's end reads only its `x`.
        let reads: &[String] = match plans[i] {
            gelu::Plan::Gelu(_) => &[],
            _ => &node.input,
        };
        for name in reads {
            if name.is_empty() {
                inputs.push(None);
                continue;
            }
            match ctx.values.get(name) {
                Some(v) => inputs.push(Some(v.clone())),
                None => {
                    return Err(Error::new(
                        ErrorKind::Parse,
                        format!(
                            "{file}: node {label} ({}) reads `{name}`, which no earlier node, \
                             input or initializer defines (the nodes must be in topological order)",
                            node.op_type
                        ),
                    ))
                }
            }
        }
        ctx.node = node.clone();
        ctx.inputs = inputs;
        let loc = SourceLoc {
            file,
            line: ctx.sub_line.unwrap_or(i as u32 + 1),
            column: 0,
        };
        ctx.meta = NodeMeta {
            name: node.output.first().filter(|o| !o.is_empty()).cloned(),
            location: Some(loc.clone()),
            hints: None,
        };
        let converted = match &plans[i] {
            gelu::Plan::Gelu(x) => match ctx.values.get(x).cloned() {
                Some(v) => ctx
                    .materialise(&v)
                    .and_then(|x| ctx.unary(tessera::ir::UnaryOp::Gelu, x))
                    .map(|y| vec![Val::node(y)]),
                None => convert(ctx),
            },
            _ => convert(ctx),
        };
        let outs = converted.map_err(|e| {
            let e = e.with_context(&format!("node {label}"));
            if e.location.is_some() {
                e
            } else {
                e.at(loc.clone())
            }
        })?;
        for (k, name) in node.output.iter().enumerate() {
            if name.is_empty() {
                continue;
            }
            let v = outs.get(k).cloned().ok_or_else(|| {
                Error::op(
                    ErrorKind::Unsupported,
                    node.op_type.clone(),
                    format!(
                        "node {label}: output {k} (`{name}`) is not computed by tessera's mapping"
                    ),
                )
                .at(loc.clone())
            })?;
            if let Some(id) = v.id {
                let n = &mut ctx.g.nodes[id.index()];
                if n.meta.name.is_none() {
                    n.meta.name = Some(name.clone());
                }
            }
            ctx.values.insert(name.clone(), v);
        }
    }
    Ok(())
}

/// Converts the context's current node. A panic in a mapping (a bug: each
/// checks its inputs) comes back as an error naming the op, never as a
/// crash of the caller.
pub fn convert(ctx: &mut Ctx) -> Result<Vec<Val>> {
    let f = converter(&ctx.node.op_type).expect("unsupported ops are refused before converting");
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(ctx))) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(ctx.err(
                ErrorKind::Verify,
                format!("internal error in tessera-onnx's mapping (a bug): {msg}"),
            ))
        }
    }
}

/// One output.
pub(crate) fn one(id: tessera::ir::NodeId) -> Result<Vec<Val>> {
    Ok(vec![Val::node(id)])
}
