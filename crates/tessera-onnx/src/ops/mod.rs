//! Each ONNX op's mapping to tessera ops, by family. A converter reads the
//! current node from the [`Ctx`] (its inputs, attributes and the opset
//! version) and returns the node's outputs in order.

mod attention;
mod elementwise;
mod more;
mod nn;
mod reduce;
mod resize;
mod shape;
mod signal;

use crate::builder::{Ctx, Val};
use tessera::Result;

type Converter = fn(&mut Ctx) -> Result<Vec<Val>>;

/// The converter of an op of the default domain, if it has one.
fn converter(op_type: &str) -> Option<Converter> {
    elementwise::converter(op_type)
        .or_else(|| reduce::converter(op_type))
        .or_else(|| shape::converter(op_type))
        .or_else(|| nn::converter(op_type))
        .or_else(|| more::converter(op_type))
        .or_else(|| signal::converter(op_type))
        .or(match op_type {
            "Attention" => Some(attention::attention as Converter),
            "Resize" => Some(resize::resize as Converter),
            "Upsample" => Some(resize::upsample as Converter),
            _ => None,
        })
}

/// Whether an op has a mapping to tessera.
pub fn is_supported(domain: &str, op_type: &str) -> bool {
    matches!(domain, "" | "ai.onnx") && converter(op_type).is_some()
}

/// Converts the context's current node.
pub fn convert(ctx: &mut Ctx) -> Result<Vec<Val>> {
    let f = converter(&ctx.node.op_type).expect("unsupported ops are refused before converting");
    f(ctx)
}

/// One output.
pub(crate) fn one(id: tessera::ir::NodeId) -> Result<Vec<Val>> {
    Ok(vec![Val::node(id)])
}
