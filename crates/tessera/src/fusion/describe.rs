//! The fusion log's plan: each kernel with the nodes it computes.

use super::{Kernel, Plan};
use crate::ir::{Graph, Op};

/// The fusion log: what fused, and the node count before and after.
pub fn describe(graph: &Graph, plan: &Plan) -> String {
    let mut text = String::new();
    let ops = graph
        .nodes
        .iter()
        .filter(|n| !matches!(n.op, Op::Input))
        .count();
    text.push_str(&format!(
        "graph `{}`: {ops} ops -> {} kernels\n",
        graph.name,
        plan.kernels.len()
    ));
    for (k, kernel) in plan.kernels.iter().enumerate() {
        match kernel {
            Kernel::Fused {
                members,
                inputs,
                outputs,
                ..
            }
            | Kernel::Rows {
                members,
                inputs,
                outputs,
                ..
            }
            | Kernel::Epilogue {
                members,
                inputs,
                outputs,
                ..
            }
            | Kernel::MatmulRows {
                members,
                inputs,
                outputs,
                ..
            } => {
                let names: Vec<String> = members
                    .iter()
                    .map(|&m| format!("{}:{}", graph.display_name(m), graph.node(m).op.name()))
                    .collect();
                let kind = match kernel {
                    Kernel::Rows { .. } => "rows",
                    Kernel::Epilogue { .. } => "matmul+epilogue",
                    Kernel::MatmulRows { .. } => "matmul+rows",
                    _ => "fused",
                };
                debug_assert!(inputs.len() <= kernel.reads(graph).len());
                debug_assert!(outputs.len() <= kernel.writes().len());
                text.push_str(&format!(
                    "  k{k} {kind} [{}] reads {} writes {}\n",
                    names.join(", "),
                    kernel.reads(graph).len(),
                    kernel.writes().len()
                ));
            }
            Kernel::Extern(id) => text.push_str(&format!(
                "  k{k} extern {} ({})\n",
                graph.display_name(*id),
                graph.node(*id).op.name()
            )),
            Kernel::Custom { node, outputs } => {
                let Op::Custom(call) = &graph.node(*node).op else {
                    unreachable!("a custom kernel's node is a custom op")
                };
                text.push_str(&format!(
                    "  k{k} custom {} ({}) writes {}\n",
                    graph.display_name(*node),
                    call.name(),
                    1 + outputs.len()
                ));
            }
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::super::fuse;
    use super::super::testing::{every_kind, graph};
    use super::*;

    #[test]
    fn each_kernel_is_a_line_with_its_nodes() {
        let g = every_kind();
        assert_eq!(
            describe(&g, &fuse(&g)),
            "graph `g`: 10 ops -> 4 kernels
  k0 matmul+epilogue [m:matmul, h:add, r:relu] reads 3 writes 2
  k1 matmul+rows [s:matmul, p:softmax, q:mul] reads 2 writes 1
  k2 fused [e:exp, f:tanh] reads 1 writes 1
  k3 extern t (permute)
"
        );
        let g = graph(
            "%q, %k, %v, %x",
            r#"  %q = input : f32[4,8]
  %k = input : f32[6,8]
  %v = input : f32[6,8]
  %x = input : f32[4,32]
  %o = custom(%q, %k, %v) {op="tessera::flash_attention", attrs="{\"causal\":true,\"scale\":0.25}"} : f32[4,8]
  %lse = custom_output(%o) {index=1, dtype=f32, shape=[4]} : f32[4]
  %s = sum(%x) {dims=[1], keepdim=true} : f32[4,1]
  %d = div(%x, %s) : f32[4,32]
  return %o as o, %lse as lse, %d as d"#,
        );
        assert_eq!(
            describe(&g, &fuse(&g)),
            "graph `g`: 4 ops -> 2 kernels
  k0 custom o (tessera::flash_attention) writes 2
  k1 rows [s:sum, d:div] reads 1 writes 1
"
        );
    }
}
