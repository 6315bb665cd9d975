//! What fusion takes of a node: scalars it inlines as constants, the
//! elementwise nodes a fused kernel computes, concrete shapes.

use crate::ir::{DType, Graph, NodeId, Op, Scalar};

/// A scalar constant that fused kernels take inline.
pub(super) fn inline_scalar(graph: &Graph, id: NodeId) -> Option<f64> {
    let node = graph.node(id);
    if !node.ty.dtype.is_float() && node.ty.dtype != DType::Bool {
        return None;
    }
    match &node.op {
        Op::Full { value, .. } if node.ty.shape.rank() == 0 => Some(match value {
            Scalar::Float(v) => *v,
            Scalar::Int(v) => *v as f64,
            Scalar::Bool(v) => *v as u8 as f64,
        }),
        Op::Constant(lit) if lit.data.len() == 1 => match &lit.data {
            crate::ir::LiteralData::Float(v) => Some(v[0]),
            crate::ir::LiteralData::Bool(v) => Some(v[0] as u8 as f64),
            crate::ir::LiteralData::Int(_) => None,
        },
        _ => None,
    }
}

/// Elementwise nodes over float/bool values that a fused kernel computes.
pub(super) fn is_fusible(graph: &Graph, id: NodeId) -> bool {
    let node = graph.node(id);
    let float_or_bool = |d: DType| d.is_float() || d == DType::Bool;
    node.op.is_elementwise()
        && node.ty.shape.as_concrete().is_some()
        && float_or_bool(node.ty.dtype)
        && node.inputs.iter().all(|&x| float_or_bool(graph.node(x).ty.dtype))
        // Binary ops on bools are not defined; compares of bools are fine.
        && !(matches!(node.op, Op::Binary(_)) && node.ty.dtype == DType::Bool)
}

/// The concrete shape of a node.
pub(super) fn shape_of(graph: &Graph, id: NodeId) -> Option<Vec<usize>> {
    graph.node(id).ty.shape.as_concrete()
}

#[cfg(test)]
mod tests {
    use super::super::testing::{graph, id};
    use super::*;

    #[test]
    fn scalars_of_float_or_bool_are_inlined() {
        let g = graph(
            "%x",
            "  %x = input : f32[3]
  %a = full {value=2.5, shape=[], dtype=f32} : f32[]
  %b = full {value=true, shape=[], dtype=bool} : bool[]
  %c = constant {value=0.125} : f64[]
  %d = full {value=3, shape=[], dtype=i64} : i64[]
  %e = full {value=2.5, shape=[3], dtype=f32} : f32[3]
  %f = constant {value=[1.0,2.0]} : f32[2]
  %g1 = add(%x, %a) : f32[3]
  return %g1 as y",
        );
        let at = |n: &str| inline_scalar(&g, id(&g, n));
        assert_eq!(at("a"), Some(2.5));
        assert_eq!(at("b"), Some(1.0));
        assert_eq!(at("c"), Some(0.125));
        assert_eq!(at("d"), None, "integers are not inlined");
        assert_eq!(at("e"), None, "not a scalar");
        assert_eq!(at("f"), None);
        assert_eq!(at("x"), None);
        assert_eq!(at("g1"), None);
    }

    #[test]
    fn fusible_nodes_are_concrete_elementwise_float_or_bool() {
        let g = graph(
            "%x, %n, %s",
            "  %x = input : f32[3,4]
  %n = input : i64[3,4]
  %s = input : f32[s0,4]
  %e = exp(%x) : f32[3,4]
  %c = gt(%x, %e) : bool[3,4]
  %w = where(%c, %x, %e) : f32[3,4]
  %h = cast(%x) {dtype=bf16} : bf16[3,4]
  %i = add(%n, %n) : i64[3,4]
  %ci = cast(%n) {dtype=f32} : f32[3,4]
  %y = exp(%s) : f32[s0,4]
  %r = sum(%x) {dims=[1], keepdim=true} : f32[3,1]
  %t = permute(%x) {perm=[1,0]} : f32[4,3]
  return %w as w",
        );
        let fusible = |n: &str| is_fusible(&g, id(&g, n));
        for n in ["e", "c", "w", "h"] {
            assert!(fusible(n), "{n}");
        }
        assert!(!fusible("i"), "integer arithmetic");
        assert!(!fusible("ci"), "an integer operand");
        assert!(!fusible("y"), "a symbolic shape");
        assert!(!fusible("r") && !fusible("t") && !fusible("x"));
        assert_eq!(shape_of(&g, id(&g, "t")), Some(vec![4, 3]));
        assert_eq!(shape_of(&g, id(&g, "y")), None);
    }
}
