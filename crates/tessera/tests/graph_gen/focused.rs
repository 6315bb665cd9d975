//! A second generator, focused on what the fusion, the schedule and the
//! memory planner can get wrong together (issue 15's two miscompiles):
//!
//! - views (reshape, transpose, permute, expand, slice) of intermediates
//!   that die at the fused kernel reading them, so that the planner may
//!   write that kernel's output in place of the viewed buffer;
//! - fused kernels with several outputs: `y = f(view(x))` used directly
//!   later and through further elementwise ops (`y*y`), with reductions,
//!   softmax and matmuls after them that force kernel boundaries, and `y`
//!   read again after later kernels allocated (`FStep::LateRead`);
//! - returned views (`expand`, `reshape`, … of a value as an extra
//!   output), whose backward sums and reshapes;
//! - hinted regions: `group_id`, `order`, `backward_group_id`,
//!   `memory_budget_mb` and `recompute` on a step's nodes (hints change
//!   fusion, the order and the backward's order), including ops whose
//!   backward reads the hinted op's value (`tanh`, `sigmoid`, `exp`,
//!   `x*x`);
//! - small graphs (≤ 24 elements a value, 2–10 steps), so that hundreds of
//!   cases run per second.
//!
//! Operands are picked mostly among the three newest values, so that
//! chains form and intermediates die where they are read; a matmul takes a
//! fresh weight input, so it always fits.

use proptest::prelude::*;
use serde_json::{json, Map, Value};
use tessera::ir::{
    broadcast_shapes, BinaryOp, DType, Dim, Graph, NodeId, NodeMeta, Op, ReduceOp, Scalar, Shape,
    TensorType, UnaryOp,
};

use super::nth_permutation;

/// Input shapes: every one small, several sharing a trailing dim of 3 so
/// that binary ops broadcast.
pub const INPUT_SHAPES: &[&[usize]] = &[
    &[4, 3],
    &[2, 4, 3],
    &[3, 4],
    &[6],
    &[2, 6],
    &[4, 1],
    &[1, 3],
    &[3],
    &[2, 3, 2],
];

/// Unary ops; the backward of most of them reads the op's input or output.
const UNARY: &[UnaryOp] = &[
    UnaryOp::Relu,
    UnaryOp::Tanh,
    UnaryOp::Sigmoid,
    UnaryOp::Exp,
    UnaryOp::Neg,
    UnaryOp::Abs,
    UnaryOp::Sin,
    UnaryOp::Silu,
];

const BINARY: &[BinaryOp] = &[
    BinaryOp::Add,
    BinaryOp::Mul,
    BinaryOp::Sub,
    BinaryOp::Div,
    BinaryOp::Maximum,
];

/// Picks an operand: below 192 one of the three newest values, else any.
pub type Pick = u8;

/// One step of building; see [`FocusedBuilder::step`].
#[derive(Clone, Debug)]
pub enum FStep {
    /// `op(x)`
    Unary(u8, Pick),
    /// `x op y`, `y` the first value from its pick on that broadcasts
    /// with `x` (else `x` itself), of another shape than `x` when the
    /// flag is set (the backward then reduces and reshapes); division is
    /// by `1 + y*y`
    Binary(u8, Pick, Pick, bool),
    /// `x + x` (defect 1's shape: a pass makes it `x * 2`)
    SelfAdd(Pick),
    /// `x op c`: `x*2`, `x+1`, `x*-0.5`, `x-0.25`
    Scale(u8, Pick),
    /// a view of `x` (see [`FocusedBuilder::view`]): kind, parameter
    View(u8, u8, Pick),
    /// A fused kernel with two outputs: `v = view(x)` (mostly a reshape;
    /// `x` made by an op), `y = op(v)`, `z = y*y` or `y op g(y)`; both `y`
    /// and `z` go to the pool, `y` last (later steps read it directly) —
    /// the shape of issue 15's defect 2.
    TwoOut(u8, u8, u8, Pick),
    /// A two-output kernel whose first output is read again after later
    /// kernels allocated: `v = view(x)`, `y = op(v)`, `z = y*y`,
    /// `r = sum(z, -1, keepdim)`, `m = op2(r @ w)` (`w: [1, n]`, a new
    /// weight), then `m op3 y` — defect 2 in general (view kind, ops).
    LateRead(u8, u8, u8, Pick),
    /// sum (half the time), mean or max, mostly over the last dim, else
    /// over the dims of a mask; keepdim or not
    Reduce(u8, u8, bool, Pick),
    /// softmax / log_softmax along the last dim (a row kernel)
    Softmax(bool, Pick),
    /// `x @ w` with a new weight input `w: [k, n]` (`x` made rank 2 first
    /// when it is a vector); then `relu` of the product (an epilogue), or
    /// both the product and its `tanh`, or the product alone
    MatMulW(u8, u8, Pick),
    /// `x @ y` when they fit, `x @ yᵀ` when that fits
    MatMul(Pick, Pick),
    Contiguous(Pick),
    /// `cat([x, y], dim)` when they fit, else `cat([x, x])`
    Cat(u8, Pick, Pick),
}

pub fn fstep_strategy() -> impl Strategy<Value = FStep> {
    let p = || any::<u8>();
    prop_oneof![
        4 => (p(), p()).prop_map(|(o, a)| FStep::Unary(o, a)),
        5 => (p(), p(), p(), any::<bool>()).prop_map(|(o, a, b, f)| FStep::Binary(o, a, b, f)),
        2 => p().prop_map(FStep::SelfAdd),
        2 => (p(), p()).prop_map(|(o, a)| FStep::Scale(o, a)),
        5 => (p(), p(), p()).prop_map(|(k, m, a)| FStep::View(k, m, a)),
        5 => (p(), p(), p(), p()).prop_map(|(v, o, c, a)| FStep::TwoOut(v, o, c, a)),
        3 => (p(), p(), p(), p()).prop_map(|(v, o, c, a)| FStep::LateRead(v, o, c, a)),
        3 => (p(), p(), any::<bool>(), p()).prop_map(|(o, m, k, a)| FStep::Reduce(o, m, k, a)),
        1 => (any::<bool>(), p()).prop_map(|(l, a)| FStep::Softmax(l, a)),
        3 => (p(), p(), p()).prop_map(|(n, e, a)| FStep::MatMulW(n, e, a)),
        1 => (p(), p()).prop_map(|(a, b)| FStep::MatMul(a, b)),
        1 => p().prop_map(FStep::Contiguous),
        1 => (p(), p(), p()).prop_map(|(d, a, b)| FStep::Cat(d, a, b)),
    ]
}

/// The hints on one step's nodes, as a user's `hints::scope` would set.
#[derive(Clone, Debug, PartialEq)]
pub struct FHint {
    pub group_id: Option<u8>,
    /// 0 strict, 1 dfs, 2 bfs, 3 auto
    pub order: Option<u8>,
    pub backward_group_id: Option<u8>,
    /// `memory_budget_mb`: 0 or 0.0005 (tighter than any step)
    pub budget: Option<bool>,
    /// `recompute`: the backward recomputes the region's values
    pub recompute: Option<bool>,
}

impl FHint {
    pub fn to_map(&self) -> Map<String, Value> {
        let mut map = Map::new();
        if let Some(g) = self.group_id {
            map.insert("group_id".into(), json!(g));
        }
        if let Some(o) = self.order {
            let name = ["strict", "dfs", "bfs", "auto"][o as usize % 4];
            map.insert("order".into(), json!(name));
        }
        if let Some(g) = self.backward_group_id {
            map.insert("backward_group_id".into(), json!(g));
        }
        if let Some(b) = self.budget {
            map.insert(
                "memory_budget_mb".into(),
                json!(if b { 0.0005 } else { 0.0 }),
            );
        }
        if let Some(r) = self.recompute {
            map.insert("recompute".into(), json!(r));
        }
        map
    }
}

/// A hint on about a third of the steps: mostly a `group_id` (0–2, so
/// that groups span several steps), else an `order`, both, a backward
/// group, a region budget, or `recompute` (with a group or an order: a
/// strict region recomputes by default, so `false` there keeps its values).
pub fn fhint_strategy() -> impl Strategy<Value = Option<FHint>> {
    let hint = |group_id, order, backward_group_id, budget, recompute| FHint {
        group_id,
        order,
        backward_group_id,
        budget,
        recompute,
    };
    prop_oneof![
        14 => Just(None),
        4 => (0u8..3).prop_map(move |g| Some(hint(Some(g), None, None, None, None))),
        1 => (0u8..4).prop_map(move |o| Some(hint(None, Some(o), None, None, None))),
        1 => (0u8..3, 0u8..4).prop_map(move |(g, o)| Some(hint(Some(g), Some(o), None, None, None))),
        1 => (0u8..3, 3u8..5).prop_map(move |(g, b)| Some(hint(Some(g), None, Some(b), None, None))),
        1 => (0u8..4, any::<bool>())
            .prop_map(move |(o, b)| Some(hint(None, Some(o), None, Some(b), None))),
        1 => (0u8..3, 0u8..5, any::<bool>()).prop_map(move |(g, o, r)| {
            // order 4: none
            let order = (o < 4).then_some(o);
            Some(hint(Some(g), order, None, None, Some(r)))
        }),
    ]
}

/// A graph to build: input shapes, hinted steps, extra outputs (the
/// newest value is always an output): a pick over the whole pool and,
/// below 10, the kind of a view of it to return instead (a returned
/// `expand` is summed and reshaped by the backward).
#[derive(Clone, Debug)]
pub struct FSpec {
    pub inputs: Vec<usize>,
    pub steps: Vec<(FStep, Option<FHint>)>,
    pub outputs: Vec<(u8, u8)>,
}

pub fn fspec_strategy() -> impl Strategy<Value = FSpec> {
    (
        prop::collection::vec(0..INPUT_SHAPES.len(), 1..4),
        prop::collection::vec((fstep_strategy(), fhint_strategy()), 2..11),
        prop::collection::vec((any::<u8>(), 0u8..20), 0..3),
    )
        .prop_map(|(inputs, steps, outputs)| FSpec {
            inputs,
            steps,
            outputs,
        })
}

/// Builds [`FSpec`]s into f32 graphs, skipping steps whose shapes do not
/// fit.
pub struct FocusedBuilder {
    pub g: Graph,
    /// The float values built so far, oldest first.
    pub pool: Vec<NodeId>,
    meta: NodeMeta,
}

impl FocusedBuilder {
    fn pick(&self, p: Pick) -> NodeId {
        let n = self.pool.len();
        let back = if p < 192 { p as usize % 3 } else { p as usize };
        self.pool[n - 1 - back % n]
    }

    /// Like [`Self::pick`], but a value made by an op when the pick is a
    /// graph input and one exists.
    fn made(&self, p: Pick) -> NodeId {
        let x = self.pick(p);
        if !self.g.inputs.contains(&x) {
            return x;
        }
        self.pool
            .iter()
            .rev()
            .find(|id| !self.g.inputs.contains(id))
            .copied()
            .unwrap_or(x)
    }

    fn shape(&self, id: NodeId) -> Vec<usize> {
        self.g.node(id).ty.shape.as_concrete().expect("concrete")
    }

    fn add(&mut self, op: Op, inputs: &[NodeId]) -> Option<NodeId> {
        self.g.add(op, inputs, self.meta.clone()).ok()
    }

    fn scalar(&mut self, v: f64) -> Option<NodeId> {
        let op = Op::Full {
            value: Scalar::Float(v),
            shape: Shape::scalar(),
            dtype: DType::F32,
        };
        self.add(op, &[])
    }

    fn swap_last2(&mut self, x: NodeId) -> Option<NodeId> {
        let r = self.shape(x).len();
        if r < 2 {
            return None;
        }
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(r - 2, r - 1);
        self.add(Op::Permute(perm), &[x])
    }

    /// A view of `x`. Kinds: 0 flatten, 1 reshape to the reversed dims
    /// (`[8,6]` → `[6,8]`), 2 split the first dim (or add a leading 1),
    /// 3 merge the first two dims, 4 transpose the last two, 5 any
    /// permutation, 6 expand a new leading dim of 2, 7 expand the
    /// size-1 dims to 3, 8 slice (start, length, step 1 or 2), 9 a
    /// round trip `reshape(reshape(x, [n]), shape)`.
    fn view(&mut self, kind: u8, m: u8, x: NodeId) -> Option<NodeId> {
        let shape = self.shape(x);
        let numel: usize = shape.iter().product();
        let reshape = |b: &mut Self, s: Vec<usize>| b.add(Op::Reshape(s.into()), &[x]);
        match kind % 10 {
            0 => reshape(self, vec![numel]),
            1 => reshape(self, shape.iter().rev().copied().collect()),
            2 => match shape.first() {
                Some(&d) if d % 2 == 0 => {
                    reshape(self, [vec![2, d / 2], shape[1..].to_vec()].concat())
                }
                _ => reshape(self, [vec![1], shape].concat()),
            },
            3 if shape.len() >= 2 => reshape(
                self,
                [vec![shape[0] * shape[1]], shape[2..].to_vec()].concat(),
            ),
            3 | 4 => self.swap_last2(x),
            5 => {
                let perm = nth_permutation(shape.len(), m as usize);
                self.add(Op::Permute(perm), &[x])
            }
            6 => self.add(Op::Expand([vec![2], shape].concat().into()), &[x]),
            7 => {
                let to: Vec<usize> = shape.iter().map(|&d| if d == 1 { 3 } else { d }).collect();
                self.add(Op::Expand(to.into()), &[x])
            }
            8 => {
                if shape.is_empty() {
                    return None;
                }
                let dim = m as usize % shape.len();
                let size = shape[dim];
                let start = (m as usize / 4) % size.max(1);
                let len = 1 + (m as usize / 16) % (size - start).max(1);
                let step = 1 + (m as usize / 128);
                let slice = Op::Slice {
                    dim,
                    start,
                    end: Dim::Const((start + len).min(size)),
                    step,
                };
                self.add(slice, &[x])
            }
            _ => {
                let flat = reshape(self, vec![numel])?;
                self.add(Op::Reshape(shape.into()), &[flat])
            }
        }
    }

    fn unary(&mut self, o: u8, x: NodeId) -> Option<NodeId> {
        self.add(Op::Unary(UNARY[o as usize % UNARY.len()]), &[x])
    }

    /// The first value from `p` on (in pick order, then oldest first)
    /// that broadcasts with `x` — preferring one of another shape when
    /// `other` is set — else `x`.
    fn partner(&self, x: NodeId, p: Pick, other: bool) -> NodeId {
        let xs = &self.g.node(x).ty.shape;
        let candidates = || {
            (0..self.pool.len())
                .map(move |i| self.pick(p.wrapping_add(i as u8)))
                .chain(self.pool.iter().copied())
                .filter(|&y| broadcast_shapes(xs, &self.g.node(y).ty.shape).is_some())
        };
        let differs = |&y: &NodeId| &self.g.node(y).ty.shape != xs;
        other
            .then(|| candidates().find(differs))
            .flatten()
            .or_else(|| candidates().next())
            .unwrap_or(x)
    }

    fn binary(&mut self, o: u8, x: NodeId, y: NodeId) -> Option<NodeId> {
        let op = BINARY[o as usize % BINARY.len()];
        if op == BinaryOp::Div {
            // x / (1 + y*y): no division by (nearly) zero.
            let yy = self.add(Op::Binary(BinaryOp::Mul), &[y, y])?;
            let one = self.scalar(1.0)?;
            let den = self.add(Op::Binary(BinaryOp::Add), &[yy, one])?;
            return self.add(Op::Binary(op), &[x, den]);
        }
        self.add(Op::Binary(op), &[x, y])
    }

    /// Runs one step; returns the values it made (the newest last).
    pub fn step(&mut self, step: &FStep) -> Option<Vec<NodeId>> {
        let one = |v: Option<NodeId>| v.map(|v| vec![v]);
        match *step {
            FStep::Unary(o, a) => one(self.unary(o, self.pick(a))),
            FStep::Binary(o, a, b, other) => {
                let x = self.pick(a);
                let y = self.partner(x, b, other);
                one(self.binary(o, x, y))
            }
            FStep::SelfAdd(a) => {
                let x = self.pick(a);
                one(self.add(Op::Binary(BinaryOp::Add), &[x, x]))
            }
            FStep::Scale(o, a) => {
                let x = self.pick(a);
                let (op, c) = [
                    (BinaryOp::Mul, 2.0),
                    (BinaryOp::Add, 1.0),
                    (BinaryOp::Mul, -0.5),
                    (BinaryOp::Sub, 0.25),
                ][o as usize % 4];
                let c = self.scalar(c)?;
                one(self.add(Op::Binary(op), &[x, c]))
            }
            FStep::View(k, m, a) => one(self.view(k, m, self.pick(a))),
            FStep::TwoOut(v, o, c, a) => {
                // The newest value a kernel made, when a pick lands on an
                // input (inputs are the caller's: never written in place).
                let x = self.made(a);
                // Mostly a reshape (dense: its fused reader may be planned
                // to write over the viewed buffer), else a transpose or no
                // view.
                let v = match v % 8 {
                    0..=4 => self.view([0, 1, 2, 3, 9][v as usize % 8], v / 8, x),
                    5 => self.view(4, 0, x),
                    6 => self.view(v / 8, v / 80, x),
                    _ => None,
                }
                .unwrap_or(x);
                let y = self.unary(o, v)?;
                let z = match c % 4 {
                    0 | 1 => self.add(Op::Binary(BinaryOp::Mul), &[y, y])?,
                    2 => {
                        let g = self.unary(c / 4, y)?;
                        self.add(Op::Binary(BinaryOp::Add), &[y, g])?
                    }
                    _ => {
                        let s = self.scalar(0.5)?;
                        let h = self.add(Op::Binary(BinaryOp::Mul), &[y, s])?;
                        self.add(Op::Binary(BinaryOp::Sub), &[h, y])?
                    }
                };
                Some(vec![z, y])
            }
            FStep::LateRead(v, o, c, a) => {
                let x = self.made(a);
                let v = match v % 4 {
                    3 => x,
                    k => self.view([1, 2, 9][k as usize], v / 4, x).unwrap_or(x),
                };
                let shape = self.shape(v);
                let n = *shape.last()?;
                let y = self.unary(o, v)?;
                let z = self.add(Op::Binary(BinaryOp::Mul), &[y, y])?;
                let dims = vec![shape.len() - 1];
                let r = self.add(
                    Op::Reduce {
                        op: ReduceOp::Sum,
                        dims,
                        keepdim: true,
                    },
                    &[z],
                )?;
                let w = self.g.add_input(
                    format!("w{}", self.g.inputs.len()),
                    TensorType::new(DType::F32, vec![1, n]),
                );
                let rw = self.add(Op::MatMul, &[r, w])?;
                let m = self.unary(o / 8, rw)?;
                let op = [BinaryOp::Add, BinaryOp::Mul, BinaryOp::Sub][c as usize % 3];
                let out = self.add(Op::Binary(op), &[m, y])?;
                Some(vec![y, out])
            }
            FStep::Reduce(o, mask, keepdim, a) => {
                let ops = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Sum];
                let x = self.pick(a);
                let rank = self.shape(x).len();
                // Mostly the last dim (a row kernel), else any dims.
                let dims: Vec<usize> = match mask % 4 {
                    0 | 1 if rank > 0 => vec![rank - 1],
                    _ => (0..rank).filter(|d| mask & (4 << d) != 0).collect(),
                };
                let op = Op::Reduce {
                    op: ops[o as usize % ops.len()],
                    dims,
                    keepdim,
                };
                one(self.add(op, &[x]))
            }
            FStep::Softmax(log, a) => {
                let x = self.pick(a);
                let rank = self.shape(x).len();
                if rank == 0 {
                    return None;
                }
                let dim = rank - 1;
                let op = if log {
                    Op::LogSoftmax { dim }
                } else {
                    Op::Softmax { dim }
                };
                one(self.add(op, &[x]))
            }
            FStep::MatMulW(n, epilogue, a) => {
                let mut x = self.pick(a);
                let shape = self.shape(x);
                let k = *shape.last()?;
                if shape.len() == 1 {
                    x = self.add(Op::Reshape(vec![1, k].into()), &[x])?;
                }
                let n = [1, 2, 3, 4, 6][n as usize % 5];
                let w = self.g.add_input(
                    format!("w{}", self.g.inputs.len()),
                    TensorType::new(DType::F32, vec![k, n]),
                );
                let product = self.add(Op::MatMul, &[x, w])?;
                match epilogue % 4 {
                    0 => one(self.add(Op::Unary(UnaryOp::Relu), &[product])),
                    1 => {
                        let t = self.add(Op::Unary(UnaryOp::Tanh), &[product])?;
                        Some(vec![product, t])
                    }
                    _ => Some(vec![product]),
                }
            }
            FStep::MatMul(a, b) => {
                let x = self.pick(a);
                let y = self.pick(b);
                let (xs, ys) = (self.shape(x), self.shape(y));
                if xs.len() < 2 || ys.len() < 2 {
                    return None;
                }
                let y = if xs[xs.len() - 1] == ys[ys.len() - 2] {
                    y
                } else {
                    self.swap_last2(y)?
                };
                one(self.add(Op::MatMul, &[x, y]))
            }
            FStep::Contiguous(a) => one(self.add(Op::Contiguous, &[self.pick(a)])),
            FStep::Cat(d, a, b) => {
                let (x, y) = (self.pick(a), self.pick(b));
                let rank = self.shape(x).len();
                if rank == 0 {
                    return None;
                }
                let dim = d as usize % rank;
                one(self
                    .add(Op::Cat { dim }, &[x, y])
                    .or_else(|| self.add(Op::Cat { dim }, &[x, x])))
            }
        }
    }
}

pub fn build_focused(spec: &FSpec) -> Graph {
    let mut b = FocusedBuilder {
        g: Graph::new("focused"),
        pool: Vec::new(),
        meta: NodeMeta::default(),
    };
    for (i, &s) in spec.inputs.iter().enumerate() {
        let ty = TensorType::new(DType::F32, INPUT_SHAPES[s].to_vec());
        let id = b.g.add_input(format!("in{i}"), ty);
        b.pool.push(id);
    }
    for (step, hint) in &spec.steps {
        b.meta.hints = hint.as_ref().map(|h| std::sync::Arc::new(h.to_map()));
        if let Some(ids) = b.step(step) {
            b.pool.extend(ids);
        }
    }
    let last = *b.pool.last().expect("inputs");
    b.g.add_output("out", last);
    b.meta.hints = None;
    for (i, &(o, view)) in spec.outputs.iter().enumerate() {
        let mut id = b.pool[o as usize % b.pool.len()];
        if view < 10 {
            id = b.view(view, o, id).unwrap_or(id);
        }
        b.g.add_output(format!("extra{i}"), id);
    }
    // Weights added by steps whose op then did not fit are unused inputs:
    // harmless (their gradient is zero, or none).
    b.g.verify().unwrap_or_else(|e| panic!("{e}\n{}", b.g));
    b.g
}
