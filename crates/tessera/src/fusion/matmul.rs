//! Matmuls in fused kernels: round 3's epilogues (a matmul's pointwise
//! consumers of its shape, run over its output right after the gemm) and
//! round 4's products (a row kernel that alone reads a thin matmul's
//! product takes the matmul, see [`Kernel::MatmulRows`]).

use std::collections::{HashMap, HashSet};

use super::group::{Domain, Group, Grouping};
use super::nodes::shape_of;
use super::steps::fused_kernel;
use super::{Kernel, Plan};
use crate::ir::{DType, Graph, NodeId, Op};

/// A matmul whose output an epilogue may take: a float product, concrete.
/// (A half-precision product and a bias add is what a CUDA gemm adds
/// itself: see `Backend::matmul_bias`.)
pub(super) fn is_epilogue_head(graph: &Graph, id: NodeId) -> bool {
    let node = graph.node(id);
    matches!(node.op, Op::MatMul | Op::MatMulT { .. })
        && node.ty.dtype.is_float()
        && shape_of(graph, id).is_some()
}

/// A matmul and its epilogue: the epilogue's steps load the matmul's value
/// like any input.
pub(super) fn epilogue_kernel(
    graph: &Graph,
    group: &Group,
    mm: NodeId,
    users: &HashSet<NodeId>,
) -> Kernel {
    let tail = &group.members[1..];
    let outputs: Vec<NodeId> = tail.iter().copied().filter(|m| users.contains(m)).collect();
    let shape = shape_of(graph, mm).expect("concrete");
    let (kernel, inputs) = fused_kernel(graph, tail, shape, &outputs);
    let matmul_out = users.contains(&mm);
    let dtype = graph.node(mm).ty.dtype;
    Kernel::Epilogue {
        matmul: mm,
        matmul_out,
        product_into: (!matmul_out)
            .then(|| kernel.outputs.iter().position(|&(_, d)| d == dtype))
            .flatten(),
        kernel,
        members: group.members.clone(),
        inputs,
        outputs,
    }
}

/// Moves each epilogue's product off the outputs in `kept` (values a
/// caller wants written over inputs it donates, as a training step's new
/// parameters and moments): the product goes under another output of its
/// dtype, else into the kernel's scratch. Otherwise the weights' update
/// (an epilogue of their gradient's product) would write a moment into
/// the product's fresh buffer and the parameter over the moment's old
/// one, and the step would hand its values back in each other's storage.
pub fn keep_products_off(graph: &Graph, plan: &mut Plan, kept: &[NodeId]) {
    for kernel in &mut plan.kernels {
        let Kernel::Epilogue {
            matmul,
            product_into: into @ Some(_),
            kernel: code,
            outputs,
            ..
        } = kernel
        else {
            continue;
        };
        let dtype = graph.node(*matmul).ty.dtype;
        *into = code
            .outputs
            .iter()
            .zip(outputs.iter())
            .position(|(&(_, d), out)| d == dtype && !kept.contains(out));
    }
}

/// Round 4: a row group takes the matmuls whose products it reduces along
/// their rows, when nothing else reads them (see [`Kernel::MatmulRows`]);
/// the matmuls' own slots go. The group's slot comes after the matmuls'
/// and after every other producer of the group, and only the group reads
/// the products, so the order still respects every dependency. Returns
/// the number of matmuls taken.
pub(super) fn take_products(graph: &Graph, grouping: &mut Grouping) -> usize {
    let mut readers: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
    for (i, node) in graph.nodes.iter().enumerate() {
        for &x in &node.inputs {
            readers.entry(x).or_default().push(NodeId(i as u32));
        }
    }
    let outputs: HashSet<NodeId> = graph.outputs.iter().map(|o| o.node).collect();
    let externs: HashSet<NodeId> = grouping.order.iter().filter_map(|s| s.err()).collect();
    let mut taken = HashSet::new();
    for group in &mut grouping.groups {
        let Domain::Rows { outer, len } = &group.domain else {
            continue;
        };
        if group.head.is_some() {
            continue;
        }
        let row = Domain::row_shapes(outer, *len).0;
        let hints = &graph.node(group.members[0]).meta.hints;
        let members = &group.members;
        let mut products: Vec<NodeId> = members
            .iter()
            .flat_map(|&m| graph.node(m).inputs.iter().copied())
            .filter(|&x| {
                externs.contains(&x)
                    && !taken.contains(&x)
                    && is_row_product(graph, x, &row)
                    && graph.node(x).meta.hints == *hints
                    && !outputs.contains(&x)
                    && readers[&x].iter().all(|r| members.contains(r))
            })
            .collect();
        products.sort_unstable();
        products.dedup();
        taken.extend(products.iter().copied());
        group.products = products;
    }
    grouping
        .order
        .retain(|s| !matches!(s, Err(x) if taken.contains(x)));
    taken.len()
}

/// A matmul whose product a row kernel over rows of `row` may take: f32,
/// of that shape, both operands matrices (or batches of them), a thin
/// product (the CPU's matmul computes such products by blocks of rows).
fn is_row_product(graph: &Graph, id: NodeId, row: &[usize]) -> bool {
    let node = graph.node(id);
    if !matches!(node.op, Op::MatMul | Op::MatMulT { .. }) {
        return false;
    }
    let (ta, _) = crate::runtime::cpu::transposes(&node.op);
    let Some(a) = shape_of(graph, node.inputs[0]) else {
        return false;
    };
    let b_rank = graph.node(node.inputs[1]).ty.shape.rank();
    if node.ty.dtype != DType::F32 || a.len() < 2 || b_rank < 2 {
        return false;
    }
    let (rows, depth) = (a[a.len() - 2], a[a.len() - 1]);
    let (m, k) = if ta { (depth, rows) } else { (rows, depth) };
    let n = *row.last().expect("rows have a length");
    shape_of(graph, id).as_deref() == Some(row) && crate::runtime::cpu::thin_dims(m, n, k)
}

#[cfg(test)]
mod tests {
    use super::super::group::{group_with, Rounds};
    use super::super::testing::{graph, id, ids};
    use super::*;
    use crate::ir::kernel::Step;
    use crate::ir::{BinaryOp, UnaryOp};

    /// Round 3's grouping of `g`, then round 4: the matmuls each row group
    /// takes (by name), and the number taken.
    fn products(g: &Graph) -> (Vec<Vec<String>>, usize) {
        let rounds = Rounds {
            reductions: true,
            epilogues: true,
        };
        let mut grouping = group_with(g, rounds, &HashSet::new());
        let before = grouping.order.len();
        let taken = take_products(g, &mut grouping);
        assert_eq!(grouping.order.len(), before - taken, "their slots go");
        let names = grouping
            .groups
            .iter()
            .filter(|gr| matches!(gr.domain, Domain::Rows { .. }))
            .map(|gr| gr.products.iter().map(|&p| g.display_name(p)).collect())
            .collect();
        (names, taken)
    }

    /// softmax(q·kᵀ) with q `[m, e]` and k `[n, e]`, in `dtype`; `extra`
    /// more statements and `ret` the outputs.
    fn scores(m: usize, n: usize, e: usize, dtype: &str, extra: &str, ret: &str) -> Graph {
        graph(
            "%q, %k",
            &format!(
                "  %q = input : {dtype}[{m},{e}]
  %k = input : {dtype}[{n},{e}]
  %s = matmul_t(%q, %k) {{transpose_a=false, transpose_b=true}} : {dtype}[{m},{n}]
  %p = softmax(%s) {{dim=1}} : {dtype}[{m},{n}]
{extra}  return {ret}"
            ),
        )
    }

    #[test]
    fn a_row_kernel_takes_the_thin_f32_products_only_it_reads() {
        let g = scores(64, 128, 32, "f32", "", "%p as p");
        assert_eq!(products(&g), (vec![vec!["s".to_string()]], 1));
        // Read by another kernel too, returned, too wide, or f64: kept.
        let read = scores(
            64,
            128,
            32,
            "f32",
            "  %t = tanh(%s) : f32[64,128]\n",
            "%p as p, %t as t",
        );
        assert_eq!(products(&read), (vec![vec![]], 0));
        let returned = scores(64, 128, 32, "f32", "", "%p as p, %s as s");
        assert_eq!(products(&returned), (vec![vec![]], 0));
        let wide = scores(64, 512, 512, "f32", "", "%p as p");
        assert_eq!(
            products(&wide),
            (vec![vec![]], 0),
            "k and n above 256: not thin"
        );
        let double = scores(64, 128, 32, "f64", "", "%p as p");
        assert_eq!(products(&double), (vec![vec![]], 0));
        let few_rows = scores(8, 128, 32, "f32", "", "%p as p");
        assert_eq!(products(&few_rows), (vec![vec![]], 0), "fewer than 16 rows");
    }

    #[test]
    fn a_transposed_left_operand_counts_its_rows_from_its_last_dim() {
        // qᵀ·k with q stored [e, m]: m = 64 rows, depth e = 32.
        let g = graph(
            "%q, %k",
            "  %q = input : f32[32,64]
  %k = input : f32[32,128]
  %s = matmul_t(%q, %k) {transpose_a=true, transpose_b=false} : f32[64,128]
  %m = max(%s) {dims=[1], keepdim=true} : f32[64,1]
  return %m as m",
        );
        assert_eq!(products(&g).1, 1);
        assert!(is_row_product(&g, id(&g, "s"), &[64, 128]));
        assert!(
            !is_row_product(&g, id(&g, "s"), &[64, 64]),
            "another row shape"
        );
        assert!(!is_row_product(&g, id(&g, "m"), &[64, 1]), "not a matmul");
    }

    #[test]
    fn a_kept_output_moves_the_product_to_another_output_or_to_scratch() {
        // An update of `p` and `m` by the product `g = x·w`: p' and m' are
        // both f32 of its shape; the first of them takes the product.
        let g = graph(
            "%x, %w, %p, %m",
            "  %x = input : f32[8,4]
  %w = input : f32[4,8]
  %p = input : f32[8,8]
  %m = input : f32[8,8]
  %g = matmul(%x, %w) : f32[8,8]
  %m2 = add(%m, %g) : f32[8,8]
  %p2 = sub(%p, %m2) : f32[8,8]
  return %p2 as p2, %m2 as m2",
        );
        let into = |plan: &Plan| match plan.kernels[..] {
            [Kernel::Epilogue {
                product_into,
                ref kernel,
                ref outputs,
                ..
            }] => product_into.map(|o| {
                assert_eq!(kernel.outputs.len(), outputs.len());
                outputs[o]
            }),
            _ => panic!("one epilogue: {plan:?}"),
        };
        let [m2, p2] = ids(&g, &["m2", "p2"])[..] else {
            unreachable!()
        };
        let plan = crate::fusion::fuse(&g);
        let first = into(&plan).expect("an output over the product");
        let other = if first == m2 { p2 } else { m2 };
        let mut kept = plan.clone();
        keep_products_off(&g, &mut kept, &[first]);
        assert_eq!(into(&kept), Some(other));
        let mut both = plan.clone();
        keep_products_off(&g, &mut both, &[m2, p2]);
        assert_eq!(into(&both), None, "the product in scratch");
        let mut none = plan;
        keep_products_off(&g, &mut none, &[]);
        assert_eq!(into(&none), Some(first));
    }

    #[test]
    fn an_epilogue_loads_the_matmul_and_overwrites_it_unless_it_is_read() {
        let g = graph(
            "%x, %w, %b, %xi, %wi",
            "  %x = input : f32[8,4]
  %w = input : f32[4,8]
  %b = input : f32[8]
  %xi = input : i64[8,4]
  %wi = input : i64[4,8]
  %m = matmul(%x, %w) : f32[8,8]
  %h = add(%m, %b) : f32[8,8]
  %r = relu(%h) : f32[8,8]
  %n = matmul(%xi, %wi) : i64[8,8]
  return %r as r, %n as n",
        );
        let [m, h, r] = ids(&g, &["m", "h", "r"])[..] else {
            unreachable!()
        };
        assert!(is_epilogue_head(&g, m));
        assert!(!is_epilogue_head(&g, id(&g, "n")), "an integer matmul");
        assert!(!is_epilogue_head(&g, h), "not a matmul");
        let group = Group {
            domain: Domain::Point(vec![8, 8]),
            members: vec![m, h, r],
            head: Some(m),
            products: Vec::new(),
        };
        let users: HashSet<NodeId> = [r].into_iter().collect();
        let Kernel::Epilogue {
            matmul,
            matmul_out,
            product_into,
            kernel,
            members,
            inputs,
            outputs,
        } = epilogue_kernel(&g, &group, m, &users)
        else {
            panic!("not an epilogue")
        };
        assert_eq!((matmul, matmul_out, product_into), (m, false, Some(0)));
        assert_eq!(
            kernel.steps,
            [
                Step::Load(0),
                Step::Load(1),
                Step::Binary(BinaryOp::Add, 0, 1),
                Step::Unary(UnaryOp::Relu, 2),
            ]
        );
        assert_eq!(kernel.shape, [8, 8]);
        assert_eq!(kernel.outputs, [(3, DType::F32)]);
        assert_eq!(
            (members, inputs, outputs),
            (vec![m, h, r], ids(&g, &["m", "b"]), vec![r])
        );
        // The matmul's value read elsewhere too: it is written as well.
        let users: HashSet<NodeId> = [m, r].into_iter().collect();
        let Kernel::Epilogue {
            matmul_out,
            product_into,
            ..
        } = epilogue_kernel(&g, &group, m, &users)
        else {
            panic!("not an epilogue")
        };
        assert!(matmul_out);
        assert_eq!(product_into, None);
    }
}
