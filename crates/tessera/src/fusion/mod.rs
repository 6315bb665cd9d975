//! Fusion: grouping a graph's nodes into kernels, in rounds logged under
//! `TESSERA_LOGS=fusion` (the candidates of each round, what fused, and the
//! kernel count before and after):
//!
//! 1. pointwise: chains of elementwise ops over one shape become one
//!    [`FusedKernel`] (intermediates never reach memory);
//! 2. reductions: a reduction or softmax along the last dim takes in its
//!    pointwise producers (prologue) and consumers (epilogue) as one
//!    [`RowKernel`], evaluated row by row with the row in cache (softmax,
//!    whole or decomposed, reads its input once and writes once);
//! 3. matmul epilogues: a matmul's pointwise consumers of its shape (bias,
//!    activation, scale) run in the same kernel, over the matmul's output
//!    right after the gemm and in its buffer (no intermediate in memory);
//! 4. matmul row kernels: a row kernel that alone reads a (thin, f32)
//!    matmul's product, reducing along its rows, takes the matmul: the
//!    product is made a block of rows at a time and each block reduced
//!    while in cache ([`Kernel::MatmulRows`]: attention's scores and their
//!    softmax never reach memory).
//!
//! Every other node is an extern kernel run by the op dispatcher.
//!
//! Grouping walks the nodes in order and puts a node into the newest kernel
//! among its producers when that kernel's domain takes it (same shape and
//! hints); all its other inputs then come from older kernels, so running
//! kernels in creation order respects every dependency. A pointwise node
//! that reads no kernel's value (only graph inputs and scalars: `m·β1` in
//! an optimizer's update) waits, and joins the kernel of its first
//! consumer when that kernel takes it; otherwise it is placed just before
//! that consumer. It reads only inputs, so either place respects the
//! dependencies, and a chain over several inputs stays one kernel.
//!
//! - `nodes`: what fusion takes of a node (inlined scalars, fusible ops);
//! - `group`: grouping and domains, rounds 1 to 3;
//! - `steps`: a group's nodes as kernel steps, its pointwise kernel;
//! - `rows`: row reductions and the row kernel of a group (round 2);
//! - `matmul`: epilogues (round 3) and products fed to row kernels (round 4);
//! - `assemble`: the plan's kernels in order;
//! - `describe`: the plan as the log prints it.

mod assemble;
mod describe;
mod group;
mod matmul;
mod nodes;
mod rows;
mod steps;

pub use describe::describe;

use crate::ir::kernel::{FusedKernel, RowKernel};
use crate::ir::{Graph, NodeId, Op};
use crate::logging::log;
use assemble::assemble;
use group::{group, group_with, in_row_kernels, Domain, Rounds};
pub use matmul::keep_products_off;
use matmul::{is_epilogue_head, take_products};
use nodes::is_fusible;
use rows::row_reduction;

/// One unit of execution.
#[derive(Clone, Debug, PartialEq)]
pub enum Kernel {
    /// A fused elementwise group: reads `inputs`, writes `outputs`.
    Fused {
        kernel: FusedKernel,
        members: Vec<NodeId>,
        inputs: Vec<NodeId>,
        outputs: Vec<NodeId>,
    },
    /// Reductions along the last dim with their pointwise producers and
    /// consumers: reads `inputs`, writes `outputs`.
    Rows {
        kernel: RowKernel,
        members: Vec<NodeId>,
        inputs: Vec<NodeId>,
        outputs: Vec<NodeId>,
    },
    /// A matmul followed by a pointwise epilogue over its output: the
    /// epilogue reads the matmul's result (its input `matmul`) and, unless
    /// the matmul's value is needed elsewhere (`matmul_out`), writes its
    /// output `product_into` over it (else the product is the kernel's
    /// scratch).
    Epilogue {
        matmul: NodeId,
        matmul_out: bool,
        /// The fused output (position in `kernel.outputs`) written over the
        /// product: the first of the product's dtype, unless that one must
        /// go over a donated input ([`keep_products_off`]); `None` when
        /// `matmul_out` or no output may.
        product_into: Option<usize>,
        kernel: FusedKernel,
        members: Vec<NodeId>,
        /// The epilogue's inputs (the matmul among them).
        inputs: Vec<NodeId>,
        /// The epilogue's outputs (the matmul's value not among them).
        outputs: Vec<NodeId>,
    },
    /// Matmuls whose products only a row kernel reads, the row kernel
    /// reducing along the products' last dim: the products are computed a
    /// block of rows at a time, each block handed to the row kernel while
    /// in cache, so they never reach memory (attention's `q·kᵀ` and its
    /// softmax; `dO·vᵀ` and softmax's backward, with the recomputed `q·kᵀ`
    /// under a recompute hint). The row kernel loads each product as its
    /// input `matmuls[i]`.
    MatmulRows {
        matmuls: Vec<NodeId>,
        kernel: RowKernel,
        /// The matmuls, then the row kernel's members.
        members: Vec<NodeId>,
        /// The row kernel's inputs (the matmuls among them).
        inputs: Vec<NodeId>,
        outputs: Vec<NodeId>,
    },
    /// One node through the op dispatcher.
    Extern(NodeId),
    /// A custom op's node, whose kernel also writes the `custom_output`
    /// nodes in `outputs` (the op's further outputs that are read).
    Custom { node: NodeId, outputs: Vec<NodeId> },
}

impl Kernel {
    /// The values the kernel reads, in operand order (inlined scalars of a
    /// fused kernel are not read: they are constants of its code).
    pub fn reads(&self, graph: &Graph) -> Vec<NodeId> {
        match self {
            Kernel::Extern(id) | Kernel::Custom { node: id, .. } => graph.node(*id).inputs.clone(),
            Kernel::Fused { inputs, .. } | Kernel::Rows { inputs, .. } => inputs.clone(),
            Kernel::Epilogue { matmul, inputs, .. } => {
                let mut reads = graph.node(*matmul).inputs.clone();
                reads.extend(inputs.iter().filter(|&x| x != matmul));
                reads
            }
            Kernel::MatmulRows {
                matmuls, inputs, ..
            } => {
                let mut reads: Vec<NodeId> = matmuls
                    .iter()
                    .flat_map(|&m| graph.node(m).inputs.iter().copied())
                    .collect();
                reads.extend(inputs.iter().filter(|x| !matmuls.contains(x)));
                reads
            }
        }
    }

    /// The values the kernel writes.
    pub fn writes(&self) -> Vec<NodeId> {
        match self {
            Kernel::Extern(id) => vec![*id],
            Kernel::Fused { outputs, .. }
            | Kernel::Rows { outputs, .. }
            | Kernel::MatmulRows { outputs, .. } => outputs.clone(),
            Kernel::Custom { node, outputs } => {
                [*node].into_iter().chain(outputs.iter().copied()).collect()
            }
            Kernel::Epilogue {
                matmul,
                matmul_out,
                outputs,
                ..
            } => matmul_out
                .then_some(*matmul)
                .into_iter()
                .chain(outputs.iter().copied())
                .collect(),
        }
    }

    /// The graph nodes the kernel computes.
    pub fn members(&self) -> &[NodeId] {
        match self {
            Kernel::Extern(id) | Kernel::Custom { node: id, .. } => std::slice::from_ref(id),
            Kernel::Fused { members, .. }
            | Kernel::Rows { members, .. }
            | Kernel::Epilogue { members, .. }
            | Kernel::MatmulRows { members, .. } => members,
        }
    }
}

/// The kernels of a graph, in an order that respects dependencies.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    pub kernels: Vec<Kernel>,
}

/// Groups `graph` (concrete shapes) into kernels, in rounds, each logged.
pub fn fuse(graph: &Graph) -> Plan {
    let ops = graph
        .nodes
        .iter()
        .filter(|n| !matches!(n.op, Op::Input))
        .count();
    let pointwise = group(
        graph,
        Rounds {
            reductions: false,
            epilogues: false,
        },
    );
    let rows = group(
        graph,
        Rounds {
            reductions: true,
            epilogues: false,
        },
    );
    let mut all = group_with(
        graph,
        Rounds {
            reductions: true,
            epilogues: true,
        },
        &in_row_kernels(&rows),
    );
    let before_products = all.order.len();
    let products = take_products(graph, &mut all);
    log("fusion", || {
        let candidates = (0..graph.len())
            .filter(|&i| is_fusible(graph, NodeId(i as u32)))
            .count();
        let reductions = (0..graph.len())
            .filter(|&i| row_reduction(graph, NodeId(i as u32)).is_some())
            .count();
        format!(
            "graph `{}`: round 1 (pointwise): {candidates} candidates, {} groups; {ops} ops -> {} kernels\n\
             graph `{}`: round 2 (reductions): {reductions} candidates, {} row groups; {} -> {} kernels\n",
            graph.name,
            pointwise.groups.iter().filter(|g| g.members.len() > 1).count(),
            pointwise.order.len(),
            graph.name,
            rows.groups
                .iter()
                .filter(|g| matches!(g.domain, Domain::Rows { .. }))
                .count(),
            pointwise.order.len(),
            rows.order.len(),
        )
    });
    log("fusion", || {
        let heads = (0..graph.len())
            .filter(|&i| is_epilogue_head(graph, NodeId(i as u32)))
            .count();
        format!(
            "graph `{}`: round 3 (matmul epilogues): {heads} candidates, {} epilogues; {} -> {} kernels\n",
            graph.name,
            all.groups.iter().filter(|g| g.head.is_some()).count(),
            rows.order.len(),
            before_products,
        )
    });
    log("fusion", || {
        let row_groups = all
            .groups
            .iter()
            .filter(|g| matches!(g.domain, Domain::Rows { .. }))
            .count();
        format!(
            "graph `{}`: round 4 (matmul row kernels): {row_groups} candidates, {products} products fed; {before_products} -> {} kernels\n",
            graph.name,
            all.order.len(),
        )
    });
    let plan = assemble(graph, &all);
    log("fusion", || describe(graph, &plan));
    plan
}

/// Graphs for the unit tests of fusion's files, from their text form.
#[cfg(test)]
mod testing {
    use crate::ir::{Graph, NodeId};

    /// The graph of `body` (statements, then `return`s) with `inputs`.
    pub(super) fn graph(inputs: &str, body: &str) -> Graph {
        let text = format!("graph g({inputs}) {{\n{body}\n}}");
        crate::ir::text::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
    }

    /// The node named `name`.
    pub(super) fn id(graph: &Graph, name: &str) -> NodeId {
        (0..graph.len())
            .map(|i| NodeId(i as u32))
            .find(|&n| graph.node(n).meta.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no node `{name}`"))
    }

    /// One kernel of each kind: a matmul with its bias + relu epilogue, a
    /// matmul fed to its softmax row kernel (then scaled), a pointwise chain
    /// ending in a view, and a matmul whose product is an output.
    pub(super) fn every_kind() -> Graph {
        graph(
            "%x, %w, %b, %v",
            "  %x = input : f32[32,32]
  %w = input : f32[32,32]
  %b = input : f32[32]
  %v = input : f32[32,32]
  %two = full {value=2.0, shape=[], dtype=f32} : f32[]
  %m = matmul(%x, %w) : f32[32,32]
  %h = add(%m, %b) : f32[32,32]
  %r = relu(%h) : f32[32,32]
  %s = matmul(%r, %v) : f32[32,32]
  %p = softmax(%s) {dim=1} : f32[32,32]
  %q = mul(%p, %two) : f32[32,32]
  %e = exp(%x) : f32[32,32]
  %f = tanh(%e) : f32[32,32]
  %t = permute(%f) {perm=[1,0]} : f32[32,32]
  return %q as q, %t as t, %m as m",
        )
    }

    /// The nodes named `names`.
    pub(super) fn ids(graph: &Graph, names: &[&str]) -> Vec<NodeId> {
        names.iter().map(|n| id(graph, n)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{every_kind, graph, id, ids};
    use super::*;
    use crate::ir::kernel::{RowStep, Step};

    /// Every value a kernel reads is an input or written by an earlier kernel.
    fn assert_ordered(g: &Graph, plan: &Plan) {
        let mut ready: Vec<NodeId> = g.inputs.clone();
        for (k, kernel) in plan.kernels.iter().enumerate() {
            for x in kernel.reads(g) {
                assert!(ready.contains(&x), "k{k} reads {x:?} before it is written");
            }
            ready.extend(kernel.writes());
        }
        for out in &g.outputs {
            assert!(
                ready.contains(&out.node),
                "output {} is never written",
                out.name
            );
        }
    }

    #[test]
    fn each_kind_of_kernel_reads_and_writes_its_values() {
        let g = every_kind();
        let plan = fuse(&g);
        assert_ordered(&g, &plan);
        let kinds: Vec<&str> = plan
            .kernels
            .iter()
            .map(|k| match k {
                Kernel::Fused { .. } => "fused",
                Kernel::Rows { .. } => "rows",
                Kernel::Epilogue { .. } => "epilogue",
                Kernel::MatmulRows { .. } => "matmul+rows",
                Kernel::Extern(_) => "extern",
                Kernel::Custom { .. } => "custom",
            })
            .collect();
        assert_eq!(kinds, ["epilogue", "matmul+rows", "fused", "extern"]);
        let [x, w, b, v, m, h, r, s, p, q, e, f, t] = ids(
            &g,
            &[
                "x", "w", "b", "v", "m", "h", "r", "s", "p", "q", "e", "f", "t",
            ],
        )[..] else {
            unreachable!()
        };
        // The epilogue reads the matmul's operands and the bias; it writes
        // the matmul (an output) and the relu (read by the next matmul).
        let epi = &plan.kernels[0];
        assert_eq!(epi.reads(&g), [x, w, b]);
        assert_eq!(epi.writes(), [m, r]);
        assert_eq!(epi.members(), [m, h, r]);
        // The product and its softmax: reads the product's operands only.
        let rows = &plan.kernels[1];
        assert_eq!(rows.reads(&g), [r, v]);
        assert_eq!(rows.writes(), [q]);
        assert_eq!(rows.members(), [s, p, q]);
        assert_eq!(plan.kernels[2].reads(&g), [x]);
        assert_eq!(plan.kernels[2].writes(), [f]);
        assert_eq!(plan.kernels[2].members(), [e, f]);
        assert_eq!(plan.kernels[3], Kernel::Extern(t));
        assert_eq!(plan.kernels[3].reads(&g), [f]);
        // The scalar is a constant of the row kernel, not a kernel of its own.
        let Kernel::MatmulRows { kernel, .. } = rows else {
            unreachable!()
        };
        assert!(kernel.steps.contains(&RowStep::Point(Step::Const(2.0))));
    }

    #[test]
    fn a_custom_kernel_writes_its_read_outputs() {
        let g = graph(
            "%q, %k, %v",
            r#"  %q = input : f32[4,8]
  %k = input : f32[6,8]
  %v = input : f32[6,8]
  %o = custom(%q, %k, %v) {op="tessera::flash_attention", attrs="{\"causal\":false,\"scale\":0.5}"} : f32[4,8]
  %lse = custom_output(%o) {index=1, dtype=f32, shape=[4]} : f32[4]
  %y = exp(%lse) : f32[4]
  return %o as o, %y as y"#,
        );
        let plan = fuse(&g);
        assert_ordered(&g, &plan);
        let (o, lse) = (id(&g, "o"), id(&g, "lse"));
        assert_eq!(
            plan.kernels[0],
            Kernel::Custom {
                node: o,
                outputs: vec![lse]
            }
        );
        assert_eq!(plan.kernels[0].writes(), [o, lse]);
        assert_eq!(plan.kernels[0].reads(&g), ids(&g, &["q", "k", "v"]));
        assert_eq!(plan.kernels[1].reads(&g), [lse]);
    }
}
