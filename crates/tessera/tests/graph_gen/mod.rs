//! Random valid graphs for differential tests (`passes_differential.rs`,
//! `compile_differential.rs`): a [`Spec`] from [`spec_strategy`] is built
//! into an f32 graph by [`build`] (and into its f64 twin by [`in_f64`]);
//! [`inputs`], [`run`] and [`tame`] evaluate it with the interpreter.
//!
//! The generator mixes all op families (elementwise with broadcasting,
//! reductions, softmax, matmul, reshape/permute/slice/cat/expand,
//! constants) with the patterns the passes look for (`x+x+x`, constant
//! chains, common factors, broadcast pairs, transposed matmul operands,
//! identity views, attention whole or per slice), some nodes carrying
//! hints.
//!
//! Not every test file uses every item.
#![allow(dead_code)]

pub mod focused;

use proptest::prelude::*;
use serde_json::json;
use tessera::ir::{
    BinaryOp, CompareOp, DType, Dim, Graph, Literal, LiteralData, NodeId, NodeMeta, Op, ReduceOp,
    Scalar, Shape, UnaryOp,
};
use tessera::tensor::interpret::run_graph;
use tessera::tensor::Generator;
use tessera::Tensor;

// ------------------------------------------------------------- generator

pub const SHAPES: &[&[usize]] = &[&[4, 3], &[3], &[2, 4, 3], &[1, 3], &[4, 1], &[3, 4], &[]];

pub const UNARY: &[UnaryOp] = &[
    UnaryOp::Neg,
    UnaryOp::Abs,
    UnaryOp::Relu,
    UnaryOp::Tanh,
    UnaryOp::Sigmoid,
    UnaryOp::Exp,
    UnaryOp::Sin,
    UnaryOp::Silu,
    UnaryOp::GeluTanh,
    UnaryOp::Gelu,
];

pub const BINARY: &[BinaryOp] = &[
    BinaryOp::Add,
    BinaryOp::Sub,
    BinaryOp::Mul,
    BinaryOp::Div,
    BinaryOp::Maximum,
    BinaryOp::Minimum,
];

/// One step of graph building; `usize` fields pick operands from the pool
/// of values built so far (modulo its length).
#[derive(Clone, Debug)]
pub enum Step {
    Unary(u8, usize),
    /// cast to the graph's own dtype (a no-op)
    CastSame(usize),
    Binary(u8, usize, usize),
    /// `x op c`, or `c op x` when the flag is set
    BinaryConst(u8, usize, u8, bool),
    Reduce(u8, usize, u8, bool),
    Softmax(bool, usize, u8),
    /// matmul with 0–2 operands transposed by a permute first, and its
    /// result transposed by one after (mode bits 1, 2 and 4)
    MatMul(usize, usize, u8),
    Permute(usize, u8),
    Reshape(usize, u8),
    Slice(usize, u8, u8, u8, u8),
    Cat(usize, usize, u8),
    Expand(usize, u8),
    Contiguous(usize),
    Where(usize, usize, bool),
    /// `x + x + …` with 2–5 terms
    SelfSum(usize, u8),
    /// `(x op c2) op c1` for op add or mul
    ConstChain(bool, usize, u8, u8),
    /// `x*a op b*x` for op add or sub
    Hoist(bool, usize, usize, usize),
    /// `(m1 + s1) + (m2 + s2)` with broadcast `s`
    BroadcastPair(usize, usize),
    /// an op on constants only: `exp(c1 op c2)`
    ConstExpr(u8, u8, u8),
    /// `softmax(q·kᵀ·c [causal]) · v` (see [`Builder::attention`])
    Attention(usize, usize, usize, u8),
}

pub fn step_strategy() -> impl Strategy<Value = Step> {
    let ix = || 0usize..64;
    let b = || any::<u8>();
    prop_oneof![
        3 => (b(), ix()).prop_map(|(o, a)| Step::Unary(o, a)),
        1 => ix().prop_map(Step::CastSame),
        3 => (b(), ix(), ix()).prop_map(|(o, a, c)| Step::Binary(o, a, c)),
        3 => (b(), ix(), b(), any::<bool>()).prop_map(|(o, a, k, f)| Step::BinaryConst(o, a, k, f)),
        2 => (b(), ix(), b(), any::<bool>()).prop_map(|(o, a, m, k)| Step::Reduce(o, a, m, k)),
        1 => (any::<bool>(), ix(), b()).prop_map(|(l, a, d)| Step::Softmax(l, a, d)),
        2 => (ix(), ix(), b()).prop_map(|(a, c, m)| Step::MatMul(a, c, m)),
        2 => (ix(), b()).prop_map(|(a, p)| Step::Permute(a, p)),
        2 => (ix(), b()).prop_map(|(a, m)| Step::Reshape(a, m)),
        2 => (ix(), b(), b(), b(), b()).prop_map(|(a, d, s, l, st)| Step::Slice(a, d, s, l, st)),
        1 => (ix(), ix(), b()).prop_map(|(a, c, d)| Step::Cat(a, c, d)),
        1 => (ix(), b()).prop_map(|(a, m)| Step::Expand(a, m)),
        1 => ix().prop_map(Step::Contiguous),
        1 => (ix(), ix(), any::<bool>()).prop_map(|(a, c, f)| Step::Where(a, c, f)),
        1 => (ix(), b()).prop_map(|(a, n)| Step::SelfSum(a, n)),
        1 => (any::<bool>(), ix(), b(), b()).prop_map(|(m, a, c1, c2)| Step::ConstChain(m, a, c1, c2)),
        1 => (any::<bool>(), ix(), ix(), ix()).prop_map(|(s, x, a, c)| Step::Hoist(s, x, a, c)),
        1 => (ix(), ix()).prop_map(|(m, s)| Step::BroadcastPair(m, s)),
        1 => (b(), b(), b()).prop_map(|(o, k1, k2)| Step::ConstExpr(o, k1, k2)),
        1 => (ix(), ix(), ix(), b()).prop_map(|(q, k, v, m)| Step::Attention(q, k, v, m)),
    ]
}

/// A graph to build: input shapes, steps, which values to return, and
/// which steps' nodes carry hints (`group_id` 0 or 1).
#[derive(Clone, Debug)]
pub struct Spec {
    pub inputs: Vec<usize>,
    pub steps: Vec<(Step, Option<u8>)>,
    pub outputs: Vec<usize>,
}

pub fn spec_strategy() -> impl Strategy<Value = Spec> {
    let hint = prop::option::weighted(0.15, 0u8..2);
    (
        prop::collection::vec(0..SHAPES.len(), 2..4),
        prop::collection::vec((step_strategy(), hint), 4..22),
        prop::collection::vec(0usize..64, 0..3),
    )
        .prop_map(|(inputs, steps, outputs)| Spec {
            inputs,
            steps,
            outputs,
        })
}

/// Builds graphs in f32, skipping steps whose shapes do not fit.
pub struct Builder {
    g: Graph,
    /// The float values built so far.
    pool: Vec<NodeId>,
    meta: NodeMeta,
}

impl Builder {
    fn pick(&self, i: usize) -> NodeId {
        self.pool[i % self.pool.len()]
    }

    fn shape(&self, id: NodeId) -> Vec<usize> {
        self.g.node(id).ty.shape.as_concrete().expect("concrete")
    }

    fn add(&mut self, op: Op, inputs: &[NodeId]) -> Option<NodeId> {
        self.g.add(op, inputs, self.meta.clone()).ok()
    }

    fn constant(&mut self, kind: u8, like: NodeId) -> Option<NodeId> {
        let scalar = |v: f64| Op::Full {
            value: Scalar::Float(v),
            shape: Shape::scalar(),
            dtype: DType::F32,
        };
        let op = match kind % 9 {
            0 => scalar(0.0),
            1 => scalar(1.0),
            2 => scalar(2.0),
            3 => Op::Constant(Literal::scalar(Scalar::Float(-0.0), DType::F32)),
            4 => Op::Constant(Literal {
                dtype: DType::F32,
                shape: vec![3],
                data: LiteralData::Float(vec![0.5, -1.5, 2.0]),
            }),
            5 => Op::Full {
                value: Scalar::Float(1.0),
                shape: self.g.node(like).ty.shape.clone(),
                dtype: DType::F32,
            },
            6 => Op::Full {
                value: Scalar::Float(0.0),
                shape: Shape::from_concrete(&[2, 1, 1]),
                dtype: DType::F32,
            },
            7 => Op::Arange {
                start: 0.0,
                end: 3.0,
                step: 1.0,
                dtype: DType::F32,
            },
            _ => scalar(-0.75),
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

    /// Runs one step; returns the value it made, if its shapes fit.
    fn step(&mut self, step: &Step) -> Option<NodeId> {
        match *step {
            Step::Unary(o, a) => {
                let op = Op::Unary(UNARY[o as usize % UNARY.len()]);
                self.add(op, &[self.pick(a)])
            }
            Step::CastSame(a) => self.add(Op::Cast(DType::F32), &[self.pick(a)]),
            Step::Binary(o, a, b) => {
                let op = Op::Binary(BINARY[o as usize % BINARY.len()]);
                self.add(op, &[self.pick(a), self.pick(b)])
            }
            Step::BinaryConst(o, a, k, swap) => {
                let ops = [
                    BinaryOp::Add,
                    BinaryOp::Sub,
                    BinaryOp::Mul,
                    BinaryOp::Div,
                    BinaryOp::Pow,
                ];
                let op = ops[o as usize % ops.len()];
                let x = self.pick(a);
                let c = self.constant(k, x)?;
                let (l, r) = if swap && op != BinaryOp::Pow && op != BinaryOp::Div {
                    (c, x)
                } else {
                    (x, c)
                };
                self.add(Op::Binary(op), &[l, r])
            }
            Step::Reduce(o, a, mask, keepdim) => {
                let ops = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];
                let x = self.pick(a);
                let rank = self.shape(x).len();
                let dims = (0..rank).filter(|d| mask & (1 << d) != 0).collect();
                let op = ops[o as usize % ops.len()];
                self.add(Op::Reduce { op, dims, keepdim }, &[x])
            }
            Step::Softmax(log, a, d) => {
                let x = self.pick(a);
                let rank = self.shape(x).len();
                let dim = d as usize % rank.max(1);
                let op = match log {
                    true => Op::LogSoftmax { dim },
                    false => Op::Softmax { dim },
                };
                self.add(op, &[x])
            }
            Step::MatMul(a, b, mode) => {
                let (mut x, mut y) = (self.pick(a), self.pick(b));
                if mode & 1 != 0 {
                    x = self.swap_last2(x)?;
                }
                if mode & 2 != 0 {
                    y = self.swap_last2(y)?;
                }
                let product = self.add(Op::MatMul, &[x, y])?;
                match mode & 4 != 0 {
                    true => self.swap_last2(product),
                    false => Some(product),
                }
            }
            Step::Permute(a, p) => {
                let x = self.pick(a);
                let rank = self.shape(x).len();
                let perm = nth_permutation(rank, p as usize);
                self.add(Op::Permute(perm), &[x])
            }
            Step::Reshape(a, mode) => {
                let x = self.pick(a);
                let shape = self.shape(x);
                let numel = shape.iter().product::<usize>();
                let target = match mode % 4 {
                    0 => vec![numel],
                    1 => [vec![1], shape.clone()].concat(),
                    2 if shape.len() >= 2 => {
                        [vec![shape[0] * shape[1]], shape[2..].to_vec()].concat()
                    }
                    _ => {
                        let flat = self.add(Op::Reshape(vec![numel].into()), &[x])?;
                        return self.add(Op::Reshape(shape.into()), &[flat]);
                    }
                };
                self.add(Op::Reshape(target.into()), &[x])
            }
            Step::Slice(a, d, s, l, st) => {
                let x = self.pick(a);
                let shape = self.shape(x);
                if shape.is_empty() {
                    return None;
                }
                let dim = d as usize % shape.len();
                let size = shape[dim];
                let (start, end, step) = if s % 3 == 0 {
                    (0, size, 1)
                } else {
                    let start = s as usize % (size + 1);
                    let len = l as usize % (size - start + 1);
                    (start, start + len, 1 + st as usize % 2)
                };
                self.add(
                    Op::Slice {
                        dim,
                        start,
                        end: Dim::Const(end),
                        step,
                    },
                    &[x],
                )
            }
            Step::Cat(a, b, d) => {
                let (x, y) = (self.pick(a), self.pick(b));
                let rank = self.shape(x).len();
                if rank == 0 {
                    return None;
                }
                let dim = d as usize % rank;
                self.add(Op::Cat { dim }, &[x, y])
                    .or_else(|| self.add(Op::Cat { dim }, &[x, x]))
            }
            Step::Expand(a, mode) => {
                let x = self.pick(a);
                let shape = self.shape(x);
                let target = match mode % 3 {
                    0 => [vec![2], shape].concat(),
                    1 => shape.iter().map(|&d| if d == 1 { 3 } else { d }).collect(),
                    _ => shape,
                };
                self.add(Op::Expand(target.into()), &[x])
            }
            Step::Contiguous(a) => self.add(Op::Contiguous, &[self.pick(a)]),
            Step::Where(a, b, flip) => {
                let (x, y) = (self.pick(a), self.pick(b));
                let cond = self.add(Op::Compare(CompareOp::Gt), &[x, y])?;
                let (p, q) = if flip { (y, x) } else { (x, y) };
                self.add(Op::Where, &[cond, p, q])
            }
            Step::SelfSum(a, n) => {
                let x = self.pick(a);
                let mut sum = self.add(Op::Binary(BinaryOp::Add), &[x, x])?;
                for _ in 2..2 + n % 4 {
                    sum = self.add(Op::Binary(BinaryOp::Add), &[sum, x])?;
                }
                Some(sum)
            }
            Step::ConstChain(mul, a, k1, k2) => {
                let op = Op::Binary(if mul { BinaryOp::Mul } else { BinaryOp::Add });
                let x = self.pick(a);
                let c2 = self.constant(k2, x)?;
                let inner = self.add(op.clone(), &[x, c2])?;
                let c1 = self.constant(k1, x)?;
                self.add(op, &[c1, inner])
            }
            Step::Hoist(sub, x, a, b) => {
                let (x, a, b) = (self.pick(x), self.pick(a), self.pick(b));
                let xa = self.add(Op::Binary(BinaryOp::Mul), &[x, a])?;
                let bx = self.add(Op::Binary(BinaryOp::Mul), &[b, x])?;
                let op = if sub { BinaryOp::Sub } else { BinaryOp::Add };
                self.add(Op::Binary(op), &[xa, bx])
            }
            Step::ConstExpr(o, k1, k2) => {
                let like = self.pick(0);
                let (c1, c2) = (self.constant(k1, like)?, self.constant(k2, like)?);
                let op = Op::Binary(BINARY[o as usize % BINARY.len()]);
                let c = self.add(op, &[c1, c2])?;
                self.add(Op::Unary(UnaryOp::Exp), &[c])
            }
            Step::BroadcastPair(m, s) => {
                let m1 = self.pick(m);
                let full = self.g.node(m1).ty.shape.clone();
                let m2 = self.add(Op::Unary(UnaryOp::Tanh), &[m1])?;
                let s1 = self.constant(8, m1)?;
                // A smaller value of the pool that broadcasts to m's shape.
                let fits = |b: &Builder, id: NodeId| {
                    let t = &b.g.node(id).ty.shape;
                    t != &full && tessera::ir::broadcast_shapes(t, &full).as_ref() == Some(&full)
                };
                let s2 = (0..self.pool.len())
                    .map(|i| self.pick(s + i))
                    .find(|&id| fits(self, id))
                    .map_or_else(|| self.constant(2, m1), Some)?;
                let l = self.add(Op::Binary(BinaryOp::Add), &[m1, s1])?;
                let r = self.add(Op::Binary(BinaryOp::Add), &[s2, m2])?;
                self.add(Op::Binary(BinaryOp::Add), &[l, r])
            }
            Step::Attention(q, k, v, mode) => self.attention(q, k, v, mode),
        }
    }
}

impl Builder {
    /// Attention as users write it, for the `attention` and
    /// `batch_attention` passes. `mode` bits: 1 causal (`where(tril(ones),
    /// s, -inf)`), 2 per slice of dim 0 (two halves, concatenated), 4 scale
    /// by division, 8 scale `q` instead of the scores, 16/32 separate `k`/`v`
    /// values (else `k = q`, `v = k`).
    fn attention(&mut self, q: usize, k: usize, v: usize, mode: u8) -> Option<NodeId> {
        // Per slice: the first rank-3 value with an even dim 0 from `q` on.
        let sliceable = |b: &Builder, id: NodeId| {
            let shape = b.shape(id);
            shape.len() == 3 && shape[0].is_multiple_of(2)
        };
        let q = match mode & 2 {
            0 => self.pick(q),
            _ => (0..self.pool.len())
                .map(|i| self.pick(q + i))
                .find(|&id| sliceable(self, id))?,
        };
        let k = if mode & 16 != 0 { self.pick(k) } else { q };
        let v = if mode & 32 != 0 { self.pick(v) } else { k };
        if mode & 2 == 0 {
            return self.attend(q, k, v, mode);
        }
        let rows = self.shape(q)[0];
        let mut halves = Vec::new();
        for start in [0, rows / 2] {
            let half = |b: &mut Builder, x: NodeId| {
                let slice = Op::Slice {
                    dim: 0,
                    start,
                    end: Dim::Const(start + rows / 2),
                    step: 1,
                };
                b.add(slice, &[x])
            };
            let (qh, kh, vh) = (half(self, q)?, half(self, k)?, half(self, v)?);
            halves.push(self.attend(qh, kh, vh, mode)?);
        }
        self.add(Op::Cat { dim: 0 }, &halves)
    }

    fn attend(&mut self, q: NodeId, k: NodeId, v: NodeId, mode: u8) -> Option<NodeId> {
        let (op, c) = match mode & 4 {
            0 => (BinaryOp::Mul, 0.5),
            _ => (BinaryOp::Div, 2.0),
        };
        let scale = |b: &mut Builder, x: NodeId| {
            let c = b.add(
                Op::Full {
                    value: Scalar::Float(c),
                    shape: Shape::scalar(),
                    dtype: DType::F32,
                },
                &[],
            )?;
            b.add(Op::Binary(op), &[x, c])
        };
        let q = if mode & 8 != 0 { scale(self, q)? } else { q };
        let kt = self.swap_last2(k)?;
        let mut s = self.add(Op::MatMul, &[q, kt])?;
        if mode & 8 == 0 {
            s = scale(self, s)?;
        }
        let shape = self.shape(s);
        let rank = shape.len();
        if rank < 2 {
            return None;
        }
        if mode & 1 != 0 {
            let ones = Op::Full {
                value: Scalar::Bool(true),
                shape: Shape::from_concrete(&shape[rank - 2..]),
                dtype: DType::Bool,
            };
            let ones = self.add(ones, &[])?;
            let keep = self.add(Op::Tril { diagonal: 0 }, &[ones])?;
            let hidden = Op::Full {
                value: Scalar::Float(f64::NEG_INFINITY),
                shape: Shape::scalar(),
                dtype: DType::F32,
            };
            let hidden = self.add(hidden, &[])?;
            s = self.add(Op::Where, &[keep, s, hidden])?;
        }
        let p = self.add(Op::Softmax { dim: rank - 1 }, &[s])?;
        self.add(Op::MatMul, &[p, v])
    }
}

/// The `n`-th permutation (mod rank!) of `0..rank`.
pub fn nth_permutation(rank: usize, mut n: usize) -> Vec<usize> {
    let mut left: Vec<usize> = (0..rank).collect();
    let mut out = Vec::with_capacity(rank);
    while !left.is_empty() {
        out.push(left.remove(n % left.len()));
        n /= left.len().max(1);
    }
    out
}

pub fn build(spec: &Spec) -> Graph {
    let mut b = Builder {
        g: Graph::new("random"),
        pool: Vec::new(),
        meta: NodeMeta::default(),
    };
    for (i, &s) in spec.inputs.iter().enumerate() {
        let ty = tessera::ir::TensorType::new(DType::F32, SHAPES[s].to_vec());
        let id = b.g.add_input(format!("in{i}"), ty);
        b.pool.push(id);
    }
    for (step, hint) in &spec.steps {
        b.meta.hints = hint
            .map(|h| std::sync::Arc::new(json!({ "group_id": h }).as_object().unwrap().clone()));
        if let Some(id) = b.step(step) {
            b.pool.push(id);
        }
    }
    let last = *b.pool.last().unwrap();
    b.g.add_output("out", last);
    for (i, &o) in spec.outputs.iter().enumerate() {
        let id = b.pick(o);
        b.g.add_output(format!("extra{i}"), id);
    }
    b.g.verify().unwrap();
    b.g
}

/// The same graph computing in f64: every f32 in a type or attribute
/// becomes f64.
pub fn in_f64(g: &Graph) -> Graph {
    let wide = |d: &mut DType| {
        if *d == DType::F32 {
            *d = DType::F64;
        }
    };
    let mut g = g.clone();
    for node in &mut g.nodes {
        wide(&mut node.ty.dtype);
        match &mut node.op {
            Op::Constant(lit) => wide(&mut lit.dtype),
            Op::Full { dtype, .. } | Op::Arange { dtype, .. } | Op::Cast(dtype) => wide(dtype),
            _ => {}
        }
    }
    g.verify().unwrap();
    g
}

/// Inputs for `g` from `seed`: standard normal f32 samples, widened
/// exactly for an f64 graph.
pub fn inputs(g: &Graph, seed: u64) -> Vec<Tensor> {
    let mut gen = Generator::new(seed);
    g.inputs
        .iter()
        .map(|&id| {
            let ty = &g.node(id).ty;
            let shape = ty.shape.as_concrete().unwrap();
            let t = Tensor::randn(&shape, DType::F32, &mut gen);
            t.cast(ty.dtype)
        })
        .collect()
}

pub fn run(g: &Graph, inputs: &[Tensor]) -> Vec<(String, Vec<f64>)> {
    run_graph(g, inputs)
        .unwrap_or_else(|e| panic!("{e}\n{g}"))
        .into_iter()
        .map(|(n, t)| (n, t.to_f64_vec()))
        .collect()
}

/// Whether every value of every node of `g` is finite and at most `bound`
/// in magnitude.
pub fn tame(g: &Graph, inputs: &[Tensor], bound: f64) -> bool {
    let mut all = g.clone();
    all.outputs.clear();
    for i in 0..all.len() {
        if all.nodes[i].ty.dtype.is_float() {
            all.add_output(format!("n{i}"), NodeId(i as u32));
        }
    }
    match run_graph(&all, inputs) {
        Ok(outs) => outs.iter().all(|(_, t)| {
            t.to_f64_vec()
                .iter()
                .all(|v| v.is_finite() && v.abs() <= bound)
        }),
        Err(_) => false,
    }
}
