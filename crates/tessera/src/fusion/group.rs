//! Grouping: the nodes in order, each put into the newest kernel among
//! its producers when that kernel's domain takes it, in rounds (pointwise
//! only; with reductions; with matmul epilogues).

use std::collections::{BTreeSet, HashMap, HashSet};

use super::matmul::is_epilogue_head;
use super::nodes::{inline_scalar, is_fusible, shape_of};
use super::rows::row_reduction;
use crate::ir::{Graph, NodeId, Op};

/// What a group computes over.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Domain {
    /// Elementwise over one shape.
    Point(Vec<usize>),
    /// Rows of `len` along the last dim, one per position of `outer`.
    Rows { outer: Vec<usize>, len: usize },
}

impl Domain {
    /// The shapes of a row value and of a per-row scalar.
    pub(super) fn row_shapes(outer: &[usize], len: usize) -> (Vec<usize>, Vec<usize>) {
        let row: Vec<usize> = outer.iter().copied().chain([len]).collect();
        let scalar: Vec<usize> = outer.iter().copied().chain([1]).collect();
        (row, scalar)
    }
}

/// The nodes of one kernel to be.
#[derive(Clone, Debug)]
pub(super) struct Group {
    pub(super) domain: Domain,
    pub(super) members: Vec<NodeId>,
    /// A matmul whose epilogue the group is (its first member).
    pub(super) head: Option<NodeId>,
    /// Matmuls whose products the row group takes (round 4; not members).
    pub(super) products: Vec<NodeId>,
}

/// Which rounds run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Rounds {
    pub(super) reductions: bool,
    pub(super) epilogues: bool,
}

/// The grouping: groups, and kernel slots in order (`Ok(group)` or
/// `Err(extern node)`).
pub(super) struct Grouping {
    pub(super) groups: Vec<Group>,
    pub(super) order: Vec<Result<usize, NodeId>>,
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

/// The grouping of `graph` under `rounds`.
pub(super) fn group(graph: &Graph, rounds: Rounds) -> Grouping {
    group_with(graph, rounds, &HashSet::new())
}

/// The nodes that round 2 put into row kernels with others: round 3 leaves
/// them there. Started as a matmul's epilogue instead, such a node would
/// be written out in full for the row kernel to read back (and the product
/// too, when the row kernel reads it as well, as softmax's backward does),
/// where the row kernel computes it from the product it reads anyway.
pub(super) fn in_row_kernels(rows: &Grouping) -> HashSet<NodeId> {
    rows.groups
        .iter()
        .filter(|g| matches!(g.domain, Domain::Rows { .. }) && g.members.len() > 1)
        .flat_map(|g| g.members.iter().copied())
        .collect()
}

/// [`group`], where round 3 starts no epilogue with a node of `in_rows`.
pub(super) fn group_with(graph: &Graph, rounds: Rounds, in_rows: &HashSet<NodeId>) -> Grouping {
    let mut grouper = Grouper {
        graph,
        rounds,
        in_rows,
        kernel_of: HashMap::new(),
        groups: Vec::new(),
        order: Vec::new(),
        pending: BTreeSet::new(),
    };
    for i in 0..graph.len() {
        grouper.visit(NodeId(i as u32));
    }
    let rest: Vec<NodeId> = grouper.pending.iter().copied().collect();
    grouper.flush(&rest);
    Grouping {
        groups: grouper.groups,
        order: grouper.order,
    }
}

/// The grouping under way.
struct Grouper<'g> {
    graph: &'g Graph,
    rounds: Rounds,
    in_rows: &'g HashSet<NodeId>,
    /// The kernel slot (index into `order`) of each placed node.
    kernel_of: HashMap<NodeId, usize>,
    groups: Vec<Group>,
    order: Vec<Result<usize, NodeId>>,
    /// Pointwise nodes that read no kernel's value (only graph inputs,
    /// inlined scalars and other such nodes), not placed yet. Each joins
    /// the kernel its first consumer goes to, when that kernel's domain and
    /// hints take it: so `p·d − m/√v` over inputs `p, m, v` and a computed
    /// `g` is one kernel, where placing each node as it comes would start a
    /// kernel at every node that reads only inputs (`p·d`, `m·β1`, `v·β2`)
    /// and split the chain. Otherwise it is placed as it would have been,
    /// just before that consumer (it reads only inputs, so any place
    /// before its consumers respects the dependencies).
    pending: BTreeSet<NodeId>,
}

/// Where a node goes: into a group of slot `.0` (group `.1`), as the
/// epilogue of matmul `.1` (slot `.0`), or into a new group.
enum Target {
    Join(usize, usize),
    Epilogue(usize, NodeId),
    New(Domain),
}

impl Grouper<'_> {
    fn visit(&mut self, id: NodeId) {
        let graph = self.graph;
        let node = graph.node(id);
        if matches!(node.op, Op::Input) || inline_scalar(graph, id).is_some() {
            return;
        }
        if let Op::CustomOutput { .. } = node.op {
            // Written by its custom op's kernel.
            self.kernel_of.insert(id, self.kernel_of[&node.inputs[0]]);
            return;
        }
        let reduction = if self.rounds.reductions {
            row_reduction(graph, id)
        } else {
            None
        };
        if !is_fusible(graph, id) && reduction.is_none() {
            let ancestors = self.pending_ancestors(id);
            self.flush(&ancestors);
            self.kernel_of.insert(id, self.order.len());
            self.order.push(Err(id));
            return;
        }
        // To a node of rank > 0, a 0-dim value of a kernel placed already
        // counts as an input: a node reading only such values and inputs
        // (`p · decay`, the decay computed in the graph) can still join its
        // consumer's kernel, placed after that value's. (0-dim nodes are
        // placed as they come: scalars computed early stay early.)
        let scalar_only = node.ty.shape.rank() != 0;
        let reads_a_kernel = node.inputs.iter().any(|x| {
            self.kernel_of.contains_key(x) && !(scalar_only && graph.node(*x).ty.shape.rank() == 0)
        });
        if reduction.is_none() && !reads_a_kernel {
            self.pending.insert(id);
            return;
        }
        self.settle(id, &reduction);
    }

    /// Places `id` (not pending) with the pending nodes it reads that its
    /// kernel takes; those it does not take are placed first, on their own.
    fn settle(&mut self, id: NodeId, reduction: &Option<(Vec<usize>, usize)>) {
        loop {
            let ancestors = self.pending_ancestors(id);
            let target = self.target(id, reduction);
            let taken = self.takes(&target, reduction, id, &ancestors);
            if taken.len() == ancestors.len() {
                for a in &taken {
                    self.pending.remove(a);
                }
                self.place(id, target, reduction, &taken);
                return;
            }
            let rest: Vec<NodeId> = ancestors
                .into_iter()
                .filter(|a| !taken.contains(a))
                .collect();
            self.flush(&rest);
        }
    }

    /// The pending nodes `id` reads, directly or through other pending
    /// nodes, in node order.
    fn pending_ancestors(&self, id: NodeId) -> Vec<NodeId> {
        let mut found = BTreeSet::new();
        let mut stack: Vec<NodeId> = self.graph.node(id).inputs.clone();
        while let Some(x) = stack.pop() {
            if self.pending.contains(&x) && found.insert(x) {
                stack.extend(self.graph.node(x).inputs.iter().copied());
            }
        }
        found.into_iter().collect()
    }

    /// Places the pending nodes among `nodes` (in node order), consumers
    /// first: each takes what it can of the pending nodes it reads.
    fn flush(&mut self, nodes: &[NodeId]) {
        let mut nodes = nodes.to_vec();
        while let Some(x) = nodes.pop() {
            if self.pending.remove(&x) {
                self.settle(x, &None);
            }
        }
    }

    /// Where node `id` goes, given its placed producers.
    fn target(&self, id: NodeId, reduction: &Option<(Vec<usize>, usize)>) -> Target {
        let graph = self.graph;
        let node = graph.node(id);
        let newest = node
            .inputs
            .iter()
            .filter_map(|x| self.kernel_of.get(x).copied())
            .max();
        // A kernel never mixes hints (as no pass merges nodes whose hints
        // differ): the scheduler orders kernels by their nodes' hints.
        let same_hints = |g: &Group| graph.node(g.members[0]).meta.hints == node.meta.hints;
        let joined = newest.and_then(|k| {
            let Ok(g) = self.order[k] else { return None };
            let group = &self.groups[g];
            if !same_hints(group) {
                return None;
            }
            let takes = match reduction {
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
        if let Some((k, g)) = joined {
            return Target::Join(k, g);
        }
        // Round 3: a pointwise node that no group takes may start the
        // epilogue of the matmul it reads (the newest kernel, of its shape).
        if let Some(k) = newest {
            if self.rounds.epilogues && reduction.is_none() && !self.in_rows.contains(&id) {
                if let Err(mm) = self.order[k] {
                    if is_epilogue_head(graph, mm)
                        && shape_of(graph, mm) == shape_of(graph, id)
                        && graph.node(mm).meta.hints == node.meta.hints
                    {
                        return Target::Epilogue(k, mm);
                    }
                }
            }
        }
        Target::New(match reduction {
            Some((outer, len)) => Domain::Rows {
                outer: outer.clone(),
                len: *len,
            },
            None => Domain::Point(shape_of(graph, id).expect("fusible nodes are concrete")),
        })
    }

    /// The pending nodes of `ancestors` (those `id` reads) that the kernel
    /// `target` makes of `id` takes, in node order: of its domain and
    /// hints, reading no kernel placed after it, and with every pending
    /// node between it and `id` taken too (so the rest, placed before, never
    /// reads a node placed after it).
    fn takes(
        &self,
        target: &Target,
        reduction: &Option<(Vec<usize>, usize)>,
        id: NodeId,
        ancestors: &[NodeId],
    ) -> Vec<NodeId> {
        let graph = self.graph;
        let (domain, slot) = match target {
            Target::Join(k, g) => {
                let domain = match reduction {
                    Some((outer, len)) => Domain::Rows {
                        outer: outer.clone(),
                        len: *len,
                    },
                    None => self.groups[*g].domain.clone(),
                };
                (domain, Some(*k))
            }
            Target::Epilogue(k, mm) => (
                Domain::Point(shape_of(graph, *mm).expect("an epilogue head is concrete")),
                Some(*k),
            ),
            Target::New(domain) => (domain.clone(), None),
        };
        let empty = Group {
            domain,
            members: Vec::new(),
            head: None,
            products: Vec::new(),
        };
        let hints = &graph.node(id).meta.hints;
        let epilogue = matches!(target, Target::Epilogue(..));
        let mut taken: HashSet<NodeId> = HashSet::new();
        for &a in ancestors.iter().rev() {
            let node = graph.node(a);
            let fits = node.meta.hints == *hints
                && point_joins(graph, &empty, a)
                && !(epilogue && self.in_rows.contains(&a))
                && node
                    .inputs
                    .iter()
                    .all(|x| match (self.kernel_of.get(x), slot) {
                        (Some(&k), Some(at)) => k <= at,
                        _ => true,
                    });
            let consumers_taken = ancestors
                .iter()
                .filter(|&&c| graph.node(c).inputs.contains(&a))
                .all(|c| taken.contains(c));
            if fits && consumers_taken {
                taken.insert(a);
            }
        }
        ancestors
            .iter()
            .copied()
            .filter(|a| taken.contains(a))
            .collect()
    }

    /// Puts `id`, after the pending nodes `absorbed`, where `target` says.
    fn place(
        &mut self,
        id: NodeId,
        target: Target,
        reduction: &Option<(Vec<usize>, usize)>,
        absorbed: &[NodeId],
    ) {
        let members = || absorbed.iter().copied().chain([id]);
        let k = match target {
            Target::Join(k, g) => {
                if let Some((outer, len)) = reduction {
                    self.groups[g].domain = Domain::Rows {
                        outer: outer.clone(),
                        len: *len,
                    };
                }
                self.groups[g].members.extend(members());
                k
            }
            Target::Epilogue(k, mm) => {
                self.order[k] = Ok(self.groups.len());
                self.groups.push(Group {
                    domain: Domain::Point(shape_of(self.graph, id).expect("concrete")),
                    members: [mm].into_iter().chain(members()).collect(),
                    head: Some(mm),
                    products: Vec::new(),
                });
                k
            }
            Target::New(domain) => {
                let k = self.order.len();
                self.order.push(Ok(self.groups.len()));
                self.groups.push(Group {
                    domain,
                    members: members().collect(),
                    head: None,
                    products: Vec::new(),
                });
                k
            }
        };
        for x in members() {
            self.kernel_of.insert(x, k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{graph, ids};
    use super::*;

    const POINTWISE: Rounds = Rounds {
        reductions: false,
        epilogues: false,
    };
    const ROWS: Rounds = Rounds {
        reductions: true,
        epilogues: false,
    };
    const ALL: Rounds = Rounds {
        reductions: true,
        epilogues: true,
    };

    /// The kernel slots in order: `extern m`, `point a b`, `rows a b`,
    /// `epilogue m a` (by node name).
    fn slots(g: &Graph, grouping: &Grouping) -> Vec<String> {
        let names =
            |ids: &[NodeId]| -> Vec<String> { ids.iter().map(|&i| g.display_name(i)).collect() };
        grouping
            .order
            .iter()
            .map(|slot| match *slot {
                Err(id) => format!("extern {}", g.display_name(id)),
                Ok(k) => {
                    let group = &grouping.groups[k];
                    let kind = match (&group.domain, group.head) {
                        (_, Some(_)) => "epilogue",
                        (Domain::Point(_), None) => "point",
                        (Domain::Rows { .. }, None) => "rows",
                    };
                    format!("{kind} {}", names(&group.members).join(" "))
                }
            })
            .collect()
    }

    #[test]
    fn pointwise_chains_of_one_shape_and_hints_form_groups() {
        let g = graph(
            "%x, %r",
            r#"  %x = input : f32[4,8]
  %r = input : f32[8]
  %a = exp(%r) : f32[8]
  %b = add(%x, %a) : f32[4,8]
  %c = tanh(%b) : f32[4,8]
  %s = sum(%c) {dims=[1], keepdim=true} : f32[4,1]
  %d = mul(%c, %s) : f32[4,8]
  %e = neg(%d) : f32[4,8]  hints={"order":"strict"}
  %f = abs(%e) : f32[4,8]  hints={"order":"strict"}
  return %f as f"#,
        );
        // The broadcast add starts a new group (another shape); the sum is
        // an extern kernel in round 1 and the mul reads it, so it starts
        // a group of its own; the strict region is a group of its own.
        assert_eq!(
            slots(&g, &group(&g, POINTWISE)),
            ["point a", "point b c", "extern s", "point d", "point e f"]
        );
    }

    #[test]
    fn a_row_reduction_takes_its_producers_and_consumers() {
        let g = graph(
            "%x",
            "  %x = input : f32[4,32]
  %a = exp(%x) : f32[4,32]
  %s = sum(%a) {dims=[1], keepdim=true} : f32[4,1]
  %d = div(%a, %s) : f32[4,32]
  %m = mean(%d) {dims=[1], keepdim=false} : f32[4]
  %n = neg(%m) : f32[4]
  %t = sum(%d) {dims=[0], keepdim=true} : f32[1,32]
  return %n as n, %t as t",
        );
        let rows = group(&g, ROWS);
        // The mean without keepdim is taken, but its [4] value does not
        // broadcast as a per-row scalar: the neg starts a group of its own.
        assert_eq!(slots(&g, &rows), ["rows a s d m", "point n", "extern t"]);
        assert_eq!(
            rows.groups[0].domain,
            Domain::Rows {
                outer: vec![4],
                len: 32
            }
        );
        let taken: HashSet<NodeId> = ids(&g, &["a", "s", "d", "m"]).into_iter().collect();
        assert_eq!(in_row_kernels(&rows), taken);
    }

    #[test]
    fn a_matmul_takes_its_pointwise_consumers_unless_a_row_kernel_has_them() {
        let g = graph(
            "%x, %w, %b",
            "  %x = input : f32[32,16]
  %w = input : f32[16,32]
  %b = input : f32[32]
  %m = matmul(%x, %w) : f32[32,32]
  %h = add(%m, %b) : f32[32,32]
  %r = relu(%h) : f32[32,32]
  %p = softmax(%m) {dim=1} : f32[32,32]
  %q = mul(%p, %h) : f32[32,32]
  return %r as r, %q as q",
        );
        // Without round 3 the add starts a pointwise group; with it, the
        // matmul's epilogue.
        assert_eq!(
            slots(&g, &group(&g, ROWS)),
            ["extern m", "point h r", "rows p q"]
        );
        assert_eq!(
            slots(&g, &group_with(&g, ALL, &HashSet::new())),
            ["epilogue m h r", "rows p q"]
        );
        // A node that round 2 put into a row kernel starts no epilogue.
        let in_rows: HashSet<NodeId> = ids(&g, &["h"]).into_iter().collect();
        assert_eq!(
            slots(&g, &group_with(&g, ALL, &in_rows)),
            ["extern m", "point h r", "rows p q"]
        );
    }

    #[test]
    fn nodes_that_read_only_inputs_join_their_first_consumers_kernel() {
        // AdamW's update of `p` from inputs p, m, v and a computed
        // gradient g: `m·β1`, `v·β2` and `p·d` read only inputs. Placed as
        // they come, each would start a kernel and split the chain in four.
        let g = graph(
            "%p, %m, %v, %x, %d",
            "  %p = input : f32[4,8]
  %m = input : f32[4,8]
  %v = input : f32[4,8]
  %x = input : f32[4,8]
  %d = input : f32[]
  %g = exp(%x) : f32[4,8]
  %b1 = full {value=0.9, shape=[], dtype=f32} : f32[]
  %mb = mul(%m, %b1) : f32[4,8]
  %m2 = add(%mb, %g) : f32[4,8]
  %gg = mul(%g, %g) : f32[4,8]
  %vb = mul(%v, %b1) : f32[4,8]
  %v2 = add(%vb, %gg) : f32[4,8]
  %pd = mul(%p, %d) : f32[4,8]
  %s = sqrt(%v2) : f32[4,8]
  %u = div(%m2, %s) : f32[4,8]
  %p2 = sub(%pd, %u) : f32[4,8]
  return %p2 as p2, %m2 as m2, %v2 as v2",
        );
        assert_eq!(
            slots(&g, &group(&g, POINTWISE)),
            ["point g mb m2 gg vb v2 pd s u p2"]
        );
        // With no computed value at all, the chain is one kernel too: each
        // pending node waits for its consumer, the last one takes them all.
        let g = graph(
            "%p, %m, %d",
            "  %p = input : f32[4,8]
  %m = input : f32[4,8]
  %d = input : f32[]
  %mb = mul(%m, %d) : f32[4,8]
  %pd = mul(%p, %d) : f32[4,8]
  %p2 = sub(%pd, %mb) : f32[4,8]
  return %p2 as p2, %mb as mb",
        );
        assert_eq!(slots(&g, &group(&g, ALL)), ["point mb pd p2"]);
    }

    #[test]
    fn a_node_reading_a_computed_scalar_and_inputs_joins_its_consumers_kernel() {
        // The decay `d` computed in the graph (from a learning-rate input):
        // `p·d` reads it and an input. Placed as it comes it would start a
        // kernel of its own and split the update in two.
        // (`s` and `t` are extern kernels, so `d` and `m2` read kernels.)
        let g = graph(
            "%p, %m, %x",
            "  %p = input : f32[4,8]
  %m = input : f32[4,8]
  %x = input : f32[4,8]
  %s = sum(%x) {dims=[0,1], keepdim=false} : f32[]
  %e = exp(%s) : f32[]
  %d = neg(%e) : f32[]
  %t = contiguous(%x) : f32[4,8]
  %m2 = add(%m, %t) : f32[4,8]
  %pd = mul(%p, %d) : f32[4,8]
  %p2 = sub(%pd, %m2) : f32[4,8]
  return %p2 as p2, %m2 as m2",
        );
        assert_eq!(
            slots(&g, &group(&g, POINTWISE)),
            ["extern s", "point e d", "extern t", "point m2 pd p2"]
        );
    }

    #[test]
    fn a_waiting_node_its_consumer_cannot_take_is_placed_just_before_it() {
        // `a` (shape [8]) cannot join the [4,8] kernel of `b`: it is placed
        // on its own just before `b`'s, which takes `e`. `c` feeds a sum (an
        // extern kernel in round 1) and is placed just before it.
        let g = graph(
            "%x, %r",
            "  %x = input : f32[4,8]
  %r = input : f32[8]
  %e = exp(%x) : f32[4,8]
  %a = neg(%r) : f32[8]
  %b = add(%e, %a) : f32[4,8]
  %c = abs(%x) : f32[4,8]
  %s = sum(%c) {dims=[0], keepdim=false} : f32[8]
  return %b as b, %s as s",
        );
        assert_eq!(
            slots(&g, &group(&g, POINTWISE)),
            ["point c", "extern s", "point a", "point e b"]
        );
        // A waiting node that feeds one the consumer's kernel does not take
        // (`q`, under other hints) is not taken either: it would be placed
        // after `q`, which reads it.
        let g = graph(
            "%x",
            r#"  %x = input : f32[4,8]
  %e = exp(%x) : f32[4,8]
  %q = neg(%e) : f32[4,8]  hints={"order":"strict"}
  %b = add(%e, %q) : f32[4,8]
  return %b as b"#,
        );
        assert_eq!(
            slots(&g, &group(&g, POINTWISE)),
            ["point e", "point q", "point b"]
        );
    }
}
