//! The min-cut partitioner: which forward values to save for the backward,
//! and which to recompute there, as a minimum s–t cut (as AOTAutograd does).
//!
//! Every forward value v is split into v_in → v_out with capacity = its
//! bytes (0 for graph inputs, which stay alive anyway). Cutting that edge
//! means "save v". Edges u_out → w_in (u feeds w) are uncuttable, so a value
//! recomputed in the backward (v_in on the sink side) has all its inputs
//! available there too. The source feeds the inputs and every op that may
//! not be recomputed; every value a backward op reads drains to the sink.

use std::collections::{HashSet, VecDeque};

use super::aot::bytes_of;
use crate::ir::{Graph, NodeId, Op, UnaryOp};

const INF: u64 = u64::MAX / 4;

/// How costly an op is to recompute; `None`: never recomputed.
fn recompute_cost(op: &Op) -> Option<u8> {
    Some(match op {
        Op::MatMul
        | Op::MatMulT { .. }
        | Op::IndexSelect { .. }
        | Op::Gather { .. }
        | Op::IndexAdd { .. }
        | Op::ScatterAdd { .. }
        // Opaque, and the kernel writes all outputs at once.
        | Op::Custom(_)
        | Op::CustomOutput { .. }
        | Op::Input => return None,
        Op::Reduce { .. } | Op::ArgReduce { .. } | Op::Softmax { .. } | Op::LogSoftmax { .. } => 3,
        Op::Unary(u) if !matches!(u, UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Relu) => 2,
        Op::Binary(crate::ir::BinaryOp::Pow) => 2,
        Op::Unary(_)
        | Op::Binary(_)
        | Op::Compare(_)
        | Op::Where
        | Op::Cast(_)
        | Op::Tril { .. }
        | Op::Triu { .. } => 1,
        _ => 0,
    })
}

/// The forward values to save, sorted, for `budget` in 0.0–1.0.
pub(crate) fn choose_saved(
    joint: &Graph,
    forward: &HashSet<NodeId>,
    needed: &[NodeId],
    budget: f64,
) -> Vec<NodeId> {
    let mut candidates: Vec<NodeId> = forward
        .iter()
        .copied()
        .filter(|&id| recompute_cost(&joint.node(id).op).is_some())
        .collect();
    // Most expensive to recompute first: those are the first to be saved as
    // the budget grows.
    candidates.sort_by_key(|&id| (std::cmp::Reverse(recompute_cost(&joint.node(id).op)), id));
    let cut = |banned: usize| min_cut(joint, forward, needed, &candidates[..banned]);
    let (least, most) = (cut(0), cut(candidates.len()));
    let target = least.1 as f64 + budget * (most.1 - least.1) as f64;
    // Saved bytes grow with the banned prefix: binary-search the longest
    // prefix that fits the target.
    let (mut lo, mut hi) = (0, candidates.len());
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if cut(mid).1 as f64 <= target + 0.5 {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    cut(lo).0
}

/// The saved set and its bytes when `banned` (plus the never-recomputed ops)
/// must be computed in the forward.
fn min_cut(
    joint: &Graph,
    forward: &HashSet<NodeId>,
    needed: &[NodeId],
    banned: &[NodeId],
) -> (Vec<NodeId>, u64) {
    let n = joint.len();
    let (source, sink) = (2 * n, 2 * n + 1);
    let mut net = FlowNetwork::new(2 * n + 2);
    let banned: HashSet<NodeId> = banned.iter().copied().collect();
    for &id in forward {
        let node = joint.node(id);
        let (v_in, v_out) = (2 * id.index(), 2 * id.index() + 1);
        let is_input = matches!(node.op, Op::Input);
        let bytes = if is_input {
            0
        } else {
            bytes_of(&node.ty) as u64
        };
        net.add_edge(v_in, v_out, bytes);
        if is_input || banned.contains(&id) || recompute_cost(&node.op).is_none() {
            net.add_edge(source, v_in, INF);
        }
        for u in &node.inputs {
            if forward.contains(u) {
                net.add_edge(2 * u.index() + 1, v_in, INF);
            }
        }
    }
    for id in needed {
        net.add_edge(2 * id.index() + 1, sink, INF);
    }
    let flow = net.max_flow(source, sink);
    let reach = net.reachable(source);
    let cut: HashSet<NodeId> = forward
        .iter()
        .copied()
        .filter(|id| reach[2 * id.index()] && !reach[2 * id.index() + 1])
        .collect();
    // An input's edge has capacity 0, so every input lies on the cut, read
    // by the backward or not. Keep the cut values the backward reads: walk
    // back from the needed values through what it recomputes, stopping at
    // cut values. (Without this, every input, every weight, became a
    // backward input.)
    let mut read = HashSet::new();
    let mut stack: Vec<NodeId> = needed.to_vec();
    while let Some(id) = stack.pop() {
        if !read.insert(id) || cut.contains(&id) {
            continue;
        }
        stack.extend(
            joint
                .node(id)
                .inputs
                .iter()
                .copied()
                .filter(|x| forward.contains(x)),
        );
    }
    let mut saved: Vec<NodeId> = cut.intersection(&read).copied().collect();
    saved.sort();
    (saved, flow)
}

/// Dinic's max-flow on an adjacency list of edges with residual pairs.
struct FlowNetwork {
    adj: Vec<Vec<usize>>,
    to: Vec<usize>,
    cap: Vec<u64>,
}

impl FlowNetwork {
    fn new(n: usize) -> FlowNetwork {
        FlowNetwork {
            adj: vec![Vec::new(); n],
            to: Vec::new(),
            cap: Vec::new(),
        }
    }

    fn add_edge(&mut self, a: usize, b: usize, c: u64) {
        self.adj[a].push(self.to.len());
        self.to.push(b);
        self.cap.push(c);
        self.adj[b].push(self.to.len());
        self.to.push(a);
        self.cap.push(0);
    }

    fn levels(&self, s: usize) -> Vec<Option<usize>> {
        let mut level = vec![None; self.adj.len()];
        level[s] = Some(0);
        let mut queue = VecDeque::from([s]);
        while let Some(v) = queue.pop_front() {
            for &e in &self.adj[v] {
                let w = self.to[e];
                if self.cap[e] > 0 && level[w].is_none() {
                    level[w] = Some(level[v].unwrap() + 1);
                    queue.push_back(w);
                }
            }
        }
        level
    }

    fn reachable(&self, s: usize) -> Vec<bool> {
        self.levels(s).iter().map(Option::is_some).collect()
    }

    fn push(
        &mut self,
        v: usize,
        t: usize,
        f: u64,
        level: &[Option<usize>],
        next: &mut [usize],
    ) -> u64 {
        if v == t {
            return f;
        }
        while next[v] < self.adj[v].len() {
            let e = self.adj[v][next[v]];
            let w = self.to[e];
            if self.cap[e] > 0 && level[w] == level[v].map(|l| l + 1) {
                let pushed = self.push(w, t, f.min(self.cap[e]), level, next);
                if pushed > 0 {
                    self.cap[e] -= pushed;
                    self.cap[e ^ 1] += pushed;
                    return pushed;
                }
            }
            next[v] += 1;
        }
        0
    }

    fn max_flow(&mut self, s: usize, t: usize) -> u64 {
        let mut total = 0;
        loop {
            let level = self.levels(s);
            if level[t].is_none() {
                return total;
            }
            let mut next = vec![0; self.adj.len()];
            loop {
                let f = self.push(s, t, INF, &level, &mut next);
                if f == 0 {
                    break;
                }
                total += f;
            }
        }
    }
}
