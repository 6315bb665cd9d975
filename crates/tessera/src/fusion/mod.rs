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
//! kernels in creation order respects every dependency.

use std::collections::{HashMap, HashSet};

use crate::ir::kernel::{FusedKernel, RowKernel, RowStep, Step, MAX_ROW};
use crate::ir::{CompareOp, DType, Graph, NodeId, Op, Scalar};
use crate::logging::log;

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
    /// the matmul's value is needed elsewhere (`matmul_out`), overwrites it.
    Epilogue {
        matmul: NodeId,
        matmul_out: bool,
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

/// A scalar constant that fused kernels take inline.
fn inline_scalar(graph: &Graph, id: NodeId) -> Option<f64> {
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
fn is_fusible(graph: &Graph, id: NodeId) -> bool {
    let node = graph.node(id);
    let float_or_bool = |d: DType| d.is_float() || d == DType::Bool;
    let elementwise = matches!(
        node.op,
        Op::Unary(_) | Op::Binary(_) | Op::Compare(_) | Op::Where | Op::Cast(_)
    );
    elementwise
        && node.ty.shape.as_concrete().is_some()
        && float_or_bool(node.ty.dtype)
        && node.inputs.iter().all(|&x| float_or_bool(graph.node(x).ty.dtype))
        // Binary ops on bools are not defined; compares of bools are fine.
        && !(matches!(node.op, Op::Binary(_)) && node.ty.dtype == DType::Bool)
}

/// The shorter rows are left to the reduction kernels: a row kernel's
/// per-row step dispatch would cost more than it saves.
const MIN_ROW: usize = 16;

/// What a group computes over.
#[derive(Clone, Debug, PartialEq)]
enum Domain {
    /// Elementwise over one shape.
    Point(Vec<usize>),
    /// Rows of `len` along the last dim, one per position of `outer`.
    Rows { outer: Vec<usize>, len: usize },
}

impl Domain {
    fn row_shapes(outer: &[usize], len: usize) -> (Vec<usize>, Vec<usize>) {
        let row: Vec<usize> = outer.iter().copied().chain([len]).collect();
        let scalar: Vec<usize> = outer.iter().copied().chain([1]).collect();
        (row, scalar)
    }
}

#[derive(Clone, Debug)]
struct Group {
    domain: Domain,
    members: Vec<NodeId>,
    /// A matmul whose epilogue the group is (its first member).
    head: Option<NodeId>,
    /// Matmuls whose products the row group takes (round 4; not members).
    products: Vec<NodeId>,
}

/// Which rounds run.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Rounds {
    reductions: bool,
    epilogues: bool,
}

/// A matmul whose output an epilogue may take: f32/f64, concrete.
fn is_epilogue_head(graph: &Graph, id: NodeId) -> bool {
    let node = graph.node(id);
    matches!(node.op, Op::MatMul | Op::MatMulT { .. })
        && matches!(node.ty.dtype, DType::F32 | DType::F64)
        && shape_of(graph, id).is_some()
}

/// The grouping: groups, and kernel slots in order (`Ok(group)` or
/// `Err(extern node)`).
struct Grouping {
    groups: Vec<Group>,
    order: Vec<Result<usize, NodeId>>,
}

/// The concrete shape of a node.
fn shape_of(graph: &Graph, id: NodeId) -> Option<Vec<usize>> {
    graph.node(id).ty.shape.as_concrete()
}

/// A softmax or reduction along the last dim of an f32/f64 row of
/// `MIN_ROW..=MAX_ROW` elements: its (outer, len).
fn row_reduction(graph: &Graph, id: NodeId) -> Option<(Vec<usize>, usize)> {
    let node = graph.node(id);
    let x = *node.inputs.first()?;
    let shape = shape_of(graph, x)?;
    let last = shape.len().checked_sub(1)?;
    let along_last = match &node.op {
        Op::Reduce { dims, .. } => dims.as_slice() == [last],
        Op::Softmax { dim } | Op::LogSoftmax { dim } => *dim == last,
        _ => false,
    };
    let real = |d: DType| matches!(d, DType::F32 | DType::F64);
    let len = shape[last];
    (along_last
        && real(node.ty.dtype)
        && real(graph.node(x).ty.dtype)
        && (MIN_ROW..=MAX_ROW).contains(&len))
    .then(|| (shape[..last].to_vec(), len))
}

/// Whether group `g` may take elementwise node `id`.
fn point_joins(graph: &Graph, group: &Group, id: NodeId) -> bool {
    let Some(shape) = shape_of(graph, id) else {
        return false;
    };
    match &group.domain {
        Domain::Point(s) => *s == shape,
        Domain::Rows { outer, len } => {
            let (row, scalar) = Domain::row_shapes(outer, *len);
            // Operands from the group must broadcast as rows or per-row
            // scalars (a reduction without keepdim does not).
            (shape == row || shape == scalar)
                && graph.node(id).inputs.iter().all(|x| {
                    !group.members.contains(x)
                        || shape_of(graph, *x).is_some_and(|s| s == row || s == scalar)
                })
        }
    }
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

fn group(graph: &Graph, rounds: Rounds) -> Grouping {
    group_with(graph, rounds, &HashSet::new())
}

/// The nodes that round 2 put into row kernels with others: round 3 leaves
/// them there. Started as a matmul's epilogue instead, such a node would
/// be written out in full for the row kernel to read back (and the product
/// too, when the row kernel reads it as well, as softmax's backward does),
/// where the row kernel computes it from the product it reads anyway.
fn in_row_kernels(rows: &Grouping) -> HashSet<NodeId> {
    rows.groups
        .iter()
        .filter(|g| matches!(g.domain, Domain::Rows { .. }) && g.members.len() > 1)
        .flat_map(|g| g.members.iter().copied())
        .collect()
}

/// [`group`], where round 3 starts no epilogue with a node of `in_rows`.
fn group_with(graph: &Graph, rounds: Rounds, in_rows: &HashSet<NodeId>) -> Grouping {
    let mut kernel_of: HashMap<NodeId, usize> = HashMap::new();
    let mut groups: Vec<Group> = Vec::new();
    let mut order: Vec<Result<usize, NodeId>> = Vec::new();
    for i in 0..graph.len() {
        let id = NodeId(i as u32);
        let node = graph.node(id);
        if matches!(node.op, Op::Input) || inline_scalar(graph, id).is_some() {
            continue;
        }
        if let Op::CustomOutput { .. } = node.op {
            // Written by its custom op's kernel.
            kernel_of.insert(id, kernel_of[&node.inputs[0]]);
            continue;
        }
        let reduction = if rounds.reductions {
            row_reduction(graph, id)
        } else {
            None
        };
        if !is_fusible(graph, id) && reduction.is_none() {
            kernel_of.insert(id, order.len());
            order.push(Err(id));
            continue;
        }
        let newest = node
            .inputs
            .iter()
            .filter_map(|x| kernel_of.get(x).copied())
            .max();
        // A kernel never mixes hints (as no pass merges nodes whose hints
        // differ): the scheduler orders kernels by their nodes' hints.
        let same_hints = |g: &Group| graph.node(g.members[0]).meta.hints == node.meta.hints;
        let joined = newest.and_then(|k| {
            let Ok(g) = order[k] else { return None };
            let group = &groups[g];
            if !same_hints(group) {
                return None;
            }
            let takes = match &reduction {
                Some((outer, len)) => {
                    let row = Domain::row_shapes(outer, *len).0;
                    group.head.is_none()
                        && (group.domain
                            == Domain::Rows {
                                outer: outer.clone(),
                                len: *len,
                            }
                            || group.domain == Domain::Point(row))
                }
                None => point_joins(graph, group, id),
            };
            takes.then_some((k, g))
        });
        // Round 3: a pointwise node that no group takes may start the
        // epilogue of the matmul it reads (the newest kernel, of its shape).
        let epilogue = match (joined, newest) {
            (None, Some(k))
                if rounds.epilogues && reduction.is_none() && !in_rows.contains(&id) =>
            {
                match order[k] {
                    Err(mm)
                        if is_epilogue_head(graph, mm)
                            && shape_of(graph, mm) == shape_of(graph, id)
                            && graph.node(mm).meta.hints == node.meta.hints =>
                    {
                        Some((k, mm))
                    }
                    _ => None,
                }
            }
            _ => None,
        };
        if let Some((k, mm)) = epilogue {
            order[k] = Ok(groups.len());
            groups.push(Group {
                domain: Domain::Point(shape_of(graph, id).expect("concrete")),
                members: vec![mm, id],
                head: Some(mm),
                products: Vec::new(),
            });
            kernel_of.insert(id, k);
            continue;
        }
        match joined {
            Some((k, g)) => {
                if let Some((outer, len)) = &reduction {
                    groups[g].domain = Domain::Rows {
                        outer: outer.clone(),
                        len: *len,
                    };
                }
                groups[g].members.push(id);
                kernel_of.insert(id, k);
            }
            None => {
                let domain = match reduction {
                    Some((outer, len)) => Domain::Rows { outer, len },
                    None => Domain::Point(shape_of(graph, id).expect("fusible nodes are concrete")),
                };
                kernel_of.insert(id, order.len());
                order.push(Ok(groups.len()));
                groups.push(Group {
                    domain,
                    members: vec![id],
                    head: None,
                    products: Vec::new(),
                });
            }
        }
    }
    Grouping { groups, order }
}

/// Round 4: a row group takes the matmuls whose products it reduces along
/// their rows, when nothing else reads them (see [`Kernel::MatmulRows`]);
/// the matmuls' own slots go. The group's slot comes after the matmuls'
/// and after every other producer of the group, and only the group reads
/// the products, so the order still respects every dependency. Returns
/// the number of matmuls taken.
fn take_products(graph: &Graph, grouping: &mut Grouping) -> usize {
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

/// Builds the kernels, adding extern kernels for inlined scalars that an
/// extern kernel or a graph output needs as a value.
fn assemble(graph: &Graph, grouping: &Grouping) -> Plan {
    let members: Vec<Vec<NodeId>> = grouping.groups.iter().map(|g| g.members.clone()).collect();
    let users = users_outside(graph, &members);
    let mut kernels = Vec::new();
    let mut materialised: HashSet<NodeId> = HashSet::new();
    let mut scalar_value = |kernels: &mut Vec<Kernel>, x: NodeId| {
        if inline_scalar(graph, x).is_some() && materialised.insert(x) {
            kernels.push(Kernel::Extern(x));
        }
    };
    for slot in &grouping.order {
        match slot {
            Err(id) => {
                for &x in &graph.node(*id).inputs {
                    scalar_value(&mut kernels, x);
                }
                kernels.push(match graph.node(*id).op {
                    Op::Custom(_) => Kernel::Custom {
                        node: *id,
                        outputs: custom_outputs(graph, *id),
                    },
                    _ => Kernel::Extern(*id),
                });
            }
            Ok(g) => kernels.push(group_kernel(graph, &grouping.groups[*g], &users)),
        }
    }
    for out in &graph.outputs {
        if inline_scalar(graph, out.node).is_some() && !materialised.contains(&out.node) {
            kernels.push(Kernel::Extern(out.node));
        }
    }
    Plan { kernels }
}

/// The `custom_output` nodes of the custom node `id`.
fn custom_outputs(graph: &Graph, id: NodeId) -> Vec<NodeId> {
    (0..graph.len())
        .map(|i| NodeId(i as u32))
        .filter(|&o| {
            let node = graph.node(o);
            matches!(node.op, Op::CustomOutput { .. }) && node.inputs[0] == id
        })
        .collect()
}

/// Nodes read by something other than their own group (or returned).
fn users_outside(graph: &Graph, groups: &[Vec<NodeId>]) -> HashSet<NodeId> {
    let group_of: HashMap<NodeId, usize> = groups
        .iter()
        .enumerate()
        .flat_map(|(g, m)| m.iter().map(move |&n| (n, g)))
        .collect();
    let mut out: HashSet<NodeId> = graph.outputs.iter().map(|o| o.node).collect();
    for (i, node) in graph.nodes.iter().enumerate() {
        let mine = group_of.get(&NodeId(i as u32));
        for x in &node.inputs {
            if group_of.contains_key(x) && group_of.get(x) != mine {
                out.insert(*x);
            }
        }
    }
    out
}

/// The steps of a group, in member order, with its loaded inputs.
struct Steps {
    steps: Vec<RowStep>,
    step_of: HashMap<NodeId, usize>,
    inputs: Vec<NodeId>,
    wide: bool,
}

fn build_steps(graph: &Graph, members: &[NodeId]) -> Steps {
    let mut b = Steps {
        steps: Vec::new(),
        step_of: HashMap::new(),
        inputs: Vec::new(),
        wide: false,
    };
    for &m in members {
        let node = graph.node(m);
        b.wide |= node.ty.dtype == DType::F64;
        let mut args = Vec::with_capacity(node.inputs.len());
        for &x in &node.inputs {
            b.wide |= graph.node(x).ty.dtype == DType::F64;
            let s = match b.step_of.get(&x) {
                Some(&s) => s,
                None => {
                    let step = match inline_scalar(graph, x) {
                        Some(c) => Step::Const(c),
                        None => {
                            b.inputs.push(x);
                            Step::Load(b.inputs.len() - 1)
                        }
                    };
                    b.steps.push(RowStep::Point(step));
                    b.step_of.insert(x, b.steps.len() - 1);
                    b.steps.len() - 1
                }
            };
            args.push(s);
        }
        let step = match &node.op {
            Op::Unary(u) => Step::Unary(*u, args[0]),
            Op::Binary(op) => Step::Binary(*op, args[0], args[1]),
            Op::Compare(c) => Step::Compare(*c, args[0], args[1]),
            Op::Where => Step::Where(args[0], args[1], args[2]),
            Op::Cast(DType::Bool) => {
                b.steps.push(RowStep::Point(Step::Const(0.0)));
                Step::Compare(CompareOp::Ne, args[0], b.steps.len() - 1)
            }
            Op::Cast(d) => Step::Round(*d, args[0]),
            Op::Reduce { op, .. } => {
                b.steps.push(RowStep::Reduce(*op, args[0]));
                b.step_of.insert(m, b.steps.len() - 1);
                continue;
            }
            Op::Softmax { .. } | Op::LogSoftmax { .. } => {
                let log = matches!(node.op, Op::LogSoftmax { .. });
                b.steps.push(RowStep::Softmax { log, arg: args[0] });
                b.step_of.insert(m, b.steps.len() - 1);
                continue;
            }
            other => unreachable!("{} is not fusible", other.name()),
        };
        b.steps.push(RowStep::Point(step));
        b.step_of.insert(m, b.steps.len() - 1);
    }
    b
}

fn group_kernel(graph: &Graph, group: &Group, users: &HashSet<NodeId>) -> Kernel {
    if let Some(mm) = group.head {
        return epilogue_kernel(graph, group, mm, users);
    }
    match own_kernel(graph, group, users) {
        Kernel::Rows {
            kernel,
            members,
            inputs,
            outputs,
        } if !group.products.is_empty() => Kernel::MatmulRows {
            matmuls: group.products.clone(),
            kernel,
            members: group.products.iter().copied().chain(members).collect(),
            inputs,
            outputs,
        },
        kernel => kernel,
    }
}

/// A group's pointwise or row kernel.
fn own_kernel(graph: &Graph, group: &Group, users: &HashSet<NodeId>) -> Kernel {
    let members = &group.members;
    let b = build_steps(graph, members);
    let outputs: Vec<NodeId> = members
        .iter()
        .copied()
        .filter(|m| users.contains(m))
        .collect();
    match &group.domain {
        Domain::Point(shape) => {
            let steps = b
                .steps
                .into_iter()
                .map(|s| match s {
                    RowStep::Point(p) => p,
                    other => unreachable!("{other:?} in a pointwise group"),
                })
                .collect();
            let outs = outputs
                .iter()
                .map(|&o| (b.step_of[&o], graph.node(o).ty.dtype))
                .collect();
            Kernel::Fused {
                kernel: FusedKernel::new(shape.clone(), steps, outs, b.wide),
                members: members.to_vec(),
                inputs: b.inputs,
                outputs,
            }
        }
        Domain::Rows { outer, len } => {
            let row = Domain::row_shapes(outer, *len).0;
            // A step is a row value when its node (or loaded input) spans
            // the row; constants, per-row inputs and reductions are scalars.
            let mut is_row = vec![false; b.steps.len()];
            for (&id, &s) in &b.step_of {
                let spans = shape_of(graph, id).is_some_and(|sh| {
                    sh.len() <= row.len()
                        && sh.last() == Some(len)
                        && inline_scalar(graph, id).is_none()
                });
                is_row[s] = spans && !matches!(b.steps[s], RowStep::Reduce(..));
            }
            let outs = outputs
                .iter()
                .map(|&o| {
                    let node = graph.node(o);
                    (
                        b.step_of[&o],
                        node.ty.dtype,
                        shape_of(graph, o).expect("concrete"),
                    )
                })
                .collect();
            Kernel::Rows {
                kernel: RowKernel {
                    outer: outer.clone(),
                    len: *len,
                    steps: b.steps,
                    is_row,
                    outputs: outs,
                    wide: b.wide,
                },
                members: members.to_vec(),
                inputs: b.inputs,
                outputs,
            }
        }
    }
}

/// A matmul and its epilogue: the epilogue's steps load the matmul's value
/// like any input.
fn epilogue_kernel(graph: &Graph, group: &Group, mm: NodeId, users: &HashSet<NodeId>) -> Kernel {
    let tail = &group.members[1..];
    let b = build_steps(graph, tail);
    let outputs: Vec<NodeId> = tail.iter().copied().filter(|m| users.contains(m)).collect();
    let steps = b
        .steps
        .into_iter()
        .map(|s| match s {
            RowStep::Point(p) => p,
            other => unreachable!("{other:?} in an epilogue"),
        })
        .collect();
    let outs = outputs
        .iter()
        .map(|&o| (b.step_of[&o], graph.node(o).ty.dtype))
        .collect();
    let shape = shape_of(graph, mm).expect("concrete");
    Kernel::Epilogue {
        matmul: mm,
        matmul_out: users.contains(&mm),
        kernel: FusedKernel::new(shape, steps, outs, b.wide),
        members: group.members.clone(),
        inputs: b.inputs,
        outputs,
    }
}

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
