//! The op set of the IR.
//!
//! Ops are primitives with attributes; dims in attributes are already
//! normalised (non-negative). Composite conveniences of the `Tensor` API
//! lower to these: `transpose` → `permute`; `squeeze`, `unsqueeze`, `flatten`
//! and `view` → `reshape`; `stack` → `reshape` + `cat`; `tensor_split`,
//! `chunk` and `split` → one `slice` each; `embedding` → `index_select` +
//! `reshape`. Softmax and log_softmax stay single nodes so that later passes
//! can decompose or fuse them as they see fit.

use std::hash::{Hash, Hasher};

pub use super::custom::CustomCall;
use super::dtype::DType;
use super::shape::{Dim, Shape};

/// A scalar value in an op attribute.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    Float(f64),
    Int(i64),
    Bool(bool),
}

impl Scalar {
    pub fn as_f64(self) -> f64 {
        match self {
            Scalar::Float(v) => v,
            Scalar::Int(v) => v as f64,
            Scalar::Bool(v) => v as u8 as f64,
        }
    }

    pub fn as_i64(self) -> i64 {
        match self {
            Scalar::Float(v) => v as i64,
            Scalar::Int(v) => v,
            Scalar::Bool(v) => v as i64,
        }
    }
}

/// The data of a constant tensor, kept exactly (f64 holds every f32, f16 and
/// bf16 value; i64 every i32).
#[derive(Clone, Debug, PartialEq)]
pub enum LiteralData {
    Float(Vec<f64>),
    Int(Vec<i64>),
    Bool(Vec<bool>),
}

impl LiteralData {
    pub fn len(&self) -> usize {
        match self {
            LiteralData::Float(v) => v.len(),
            LiteralData::Int(v) => v.len(),
            LiteralData::Bool(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A constant tensor (a scalar has shape `[]`).
#[derive(Clone, Debug, PartialEq)]
pub struct Literal {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: LiteralData,
}

impl Literal {
    pub fn scalar(value: Scalar, dtype: DType) -> Literal {
        let data = if dtype.is_float() {
            LiteralData::Float(vec![value.as_f64()])
        } else if dtype.is_int() {
            LiteralData::Int(vec![value.as_i64()])
        } else {
            LiteralData::Bool(vec![value.as_f64() != 0.0])
        };
        Literal {
            dtype,
            shape: Vec::new(),
            data,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Neg,
    Abs,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Reciprocal,
    Sin,
    Cos,
    Tanh,
    Sigmoid,
    Relu,
    /// gelu with the exact erf form: x·Φ(x).
    Gelu,
    /// gelu with the tanh approximation.
    GeluTanh,
    Silu,
    Atan,
    /// NaN outside [-1, 1].
    Asin,
    /// NaN outside [-1, 1].
    Acos,
    /// Bitwise not (integers only).
    BitNot,
}

impl UnaryOp {
    pub const ALL: [UnaryOp; 19] = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Reciprocal,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Relu,
        UnaryOp::Gelu,
        UnaryOp::GeluTanh,
        UnaryOp::Silu,
        UnaryOp::Atan,
        UnaryOp::Asin,
        UnaryOp::Acos,
        UnaryOp::BitNot,
    ];

    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Abs => "abs",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Reciprocal => "reciprocal",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Relu => "relu",
            UnaryOp::Gelu => "gelu",
            UnaryOp::GeluTanh => "gelu_tanh",
            UnaryOp::Silu => "silu",
            UnaryOp::Atan => "atan",
            UnaryOp::Asin => "asin",
            UnaryOp::Acos => "acos",
            UnaryOp::BitNot => "bitwise_not",
        }
    }

    /// Ops that are defined on integers too (the rest need a float dtype).
    pub fn accepts_int(self) -> bool {
        matches!(
            self,
            UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Relu | UnaryOp::BitNot
        )
    }

    /// Ops defined on floats (all but the bitwise one).
    pub fn accepts_float(self) -> bool {
        self != UnaryOp::BitNot
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    /// True division on floats; on integers, division truncating toward zero.
    Div,
    Pow,
    Maximum,
    Minimum,
    /// The bitwise ops and shifts take integers only. A shift by a negative
    /// amount or by the width or more gives 0 (a right shift of a negative
    /// signed value: -1), as numpy's.
    BitAnd,
    BitOr,
    BitXor,
    Shl,
    /// Arithmetic on signed types, logical on unsigned ones.
    Shr,
}

impl BinaryOp {
    pub const ALL: [BinaryOp; 12] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Pow,
        BinaryOp::Maximum,
        BinaryOp::Minimum,
        BinaryOp::BitAnd,
        BinaryOp::BitOr,
        BinaryOp::BitXor,
        BinaryOp::Shl,
        BinaryOp::Shr,
    ];

    /// The ops defined on integers only (bitwise ops and shifts).
    pub fn is_bitwise(self) -> bool {
        matches!(
            self,
            BinaryOp::BitAnd | BinaryOp::BitOr | BinaryOp::BitXor | BinaryOp::Shl | BinaryOp::Shr
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Pow => "pow",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
            BinaryOp::BitAnd => "bitwise_and",
            BinaryOp::BitOr => "bitwise_or",
            BinaryOp::BitXor => "bitwise_xor",
            BinaryOp::Shl => "shift_left",
            BinaryOp::Shr => "shift_right",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CompareOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl CompareOp {
    pub const ALL: [CompareOp; 6] = [
        CompareOp::Eq,
        CompareOp::Ne,
        CompareOp::Lt,
        CompareOp::Le,
        CompareOp::Gt,
        CompareOp::Ge,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CompareOp::Eq => "eq",
            CompareOp::Ne => "ne",
            CompareOp::Lt => "lt",
            CompareOp::Le => "le",
            CompareOp::Gt => "gt",
            CompareOp::Ge => "ge",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Mean,
    Max,
    Min,
    Prod,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Mean,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Prod,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Prod => "prod",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArgReduceOp {
    ArgMax,
    ArgMin,
}

impl ArgReduceOp {
    pub fn name(self) -> &'static str {
        match self {
            ArgReduceOp::ArgMax => "argmax",
            ArgReduceOp::ArgMin => "argmin",
        }
    }
}

/// One node's operation. Inputs are positional; see each variant.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// A graph input; its type is the node's type.
    Input,
    /// A constant tensor (scalar or small tensor) embedded in the graph.
    Constant(Literal),
    /// A tensor filled with one value.
    Full {
        value: Scalar,
        shape: Shape,
        dtype: DType,
    },
    /// `start, start+step, …` below `end` (above it for a negative step).
    Arange {
        start: f64,
        end: f64,
        step: f64,
        dtype: DType,
    },
    /// (seed) → uniform samples in [0, 1) of `shape`, from a counter-based
    /// generator seeded by `seed`, an `i64[]` scalar whose 64 bits are the
    /// generator's `u64` seed (see [`Op::seed_bits`]). The seed is an
    /// operand, not an attribute, so that a compiled function draws new
    /// numbers on every call from one graph: its seed is an input of the
    /// executable (`Tensor::rand` makes it from a `Generator`).
    Rand { shape: Shape, dtype: DType },
    /// (seed) → standard normal samples, seeded like [`Op::Rand`].
    Randn { shape: Shape, dtype: DType },
    /// (x)
    Unary(UnaryOp),
    /// (x) → the same values in another dtype (floats to ints truncate).
    Cast(DType),
    /// (x) → the same bits read as another dtype of the same width
    /// (`f32` ↔ `i32`, `u16` ↔ `i16` …); not differentiable.
    BitCast(DType),
    /// (a, b), NumPy broadcasting, same dtype.
    Binary(BinaryOp),
    /// (a, b) → bool, NumPy broadcasting, same dtype.
    Compare(CompareOp),
    /// (cond: bool, a, b), broadcasting over all three.
    Where,
    /// (x) reduced over `dims` (sorted, unique; empty means none).
    Reduce {
        op: ReduceOp,
        dims: Vec<usize>,
        keepdim: bool,
    },
    /// (x) → i64 index of the max/min along `dim` (first on ties).
    ArgReduce {
        op: ArgReduceOp,
        dim: usize,
        keepdim: bool,
    },
    /// (x) softmax along `dim`, max-subtracted.
    Softmax { dim: usize },
    /// (x) log_softmax along `dim`, max-subtracted.
    LogSoftmax { dim: usize },
    /// (a, b) like `torch.matmul`: 1-D operands are promoted and the added
    /// dim removed; leading (batch) dims broadcast.
    MatMul,
    /// (a, b) `matmul(a', b')` where `a'` is `a` with its last two dims
    /// swapped when `transpose_a` (likewise `b'`); a transposed operand needs
    /// rank ≥ 2. Produced by the `transpose_matmul` pass from
    /// `matmul(permute(x), y)`: the kernel reads the transpose as a strided
    /// view, so the permute costs nothing.
    MatMulT {
        transpose_a: bool,
        transpose_b: bool,
    },
    /// (x) to `shape` (same number of elements); a view when x is contiguous.
    Reshape(Shape),
    /// (x) dims reordered: output dim i is input dim `perm[i]`. A view.
    Permute(Vec<usize>),
    /// (x) broadcast to `shape` (size-1 dims stretched, new leading dims). A view.
    Expand(Shape),
    /// (x) elements `start, start+step, …` below `end` along `dim`. A view.
    /// `end` may be symbolic (a graph generalised over a dynamic size slices
    /// `0..s1`) only with `start` 0 and `step` 1; the bound is then checked
    /// when the symbols are bound.
    Slice {
        dim: usize,
        start: usize,
        end: Dim,
        step: usize,
    },
    /// (x0, x1, …) joined along `dim`.
    Cat { dim: usize },
    /// (x) a contiguous (row-major) copy, or x itself if already contiguous.
    Contiguous,
    /// (x) zero above diagonal `diagonal` of the last two dims.
    Tril { diagonal: i64 },
    /// (x) zero below diagonal `diagonal` of the last two dims.
    Triu { diagonal: i64 },
    /// (x, index: i64/i32 1-D) rows of x along `dim`.
    IndexSelect { dim: usize },
    /// (x, index: i64/i32, same rank) `out[i][j] = x[index[i][j]][j]` for dim 0.
    Gather { dim: usize },
    /// (base, index: i64/i32 1-D, src) `base` with `src`'s slices added at
    /// `index` along `dim` (`torch.index_add`): the gradient of index_select.
    IndexAdd { dim: usize },
    /// (base, index: i64/i32, src of index's shape) `out[index[i][j]][j] +=
    /// src[i][j]` for dim 0 (`torch.scatter_add`): the gradient of gather.
    ScatterAdd { dim: usize },
    /// (x0, x1, …) a call of a registered custom op (`super::custom`);
    /// the node's value is the op's first output.
    Custom(CustomCall),
    /// (c) output `index` (≥ 1) of the `custom` node `c`, of the declared
    /// type; written by `c`'s kernel.
    CustomOutput {
        index: usize,
        dtype: DType,
        shape: Shape,
    },
}

impl Op {
    /// The op's name in the text form and in error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input => "input",
            Op::Constant(_) => "constant",
            Op::Full { .. } => "full",
            Op::Arange { .. } => "arange",
            Op::Rand { .. } => "rand",
            Op::Randn { .. } => "randn",
            Op::Unary(u) => u.name(),
            Op::Cast(_) => "cast",
            Op::BitCast(_) => "bitcast",
            Op::Binary(b) => b.name(),
            Op::Compare(c) => c.name(),
            Op::Where => "where",
            Op::Reduce { op, .. } => op.name(),
            Op::ArgReduce { op, .. } => op.name(),
            Op::Softmax { .. } => "softmax",
            Op::LogSoftmax { .. } => "log_softmax",
            Op::MatMul => "matmul",
            Op::MatMulT { .. } => "matmul_t",
            Op::Reshape(_) => "reshape",
            Op::Permute(_) => "permute",
            Op::Expand(_) => "expand",
            Op::Slice { .. } => "slice",
            Op::Cat { .. } => "cat",
            Op::Contiguous => "contiguous",
            Op::Tril { .. } => "tril",
            Op::Triu { .. } => "triu",
            Op::IndexSelect { .. } => "index_select",
            Op::Gather { .. } => "gather",
            Op::IndexAdd { .. } => "index_add",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::Custom(_) => "custom",
            Op::CustomOutput { .. } => "custom_output",
        }
    }

    /// Feeds everything that makes this op what it is (variant and every
    /// attribute; floats by their bits) to `h`, allocating nothing: the
    /// compile cache hashes every node of a trace on every call. Equal ops
    /// hash equally; the exhaustive match makes a new variant say how.
    pub fn hash_structure<H: Hasher>(&self, h: &mut H) {
        std::mem::discriminant(self).hash(h);
        match self {
            Op::Input | Op::Where | Op::MatMul | Op::Contiguous => {}
            Op::Constant(lit) => {
                lit.dtype.hash(h);
                lit.shape.hash(h);
                match &lit.data {
                    LiteralData::Float(v) => v.iter().for_each(|x| x.to_bits().hash(h)),
                    LiteralData::Int(v) => v.hash(h),
                    LiteralData::Bool(v) => v.hash(h),
                }
            }
            Op::Full {
                value,
                shape,
                dtype,
            } => {
                hash_scalar(*value, h);
                shape.hash(h);
                dtype.hash(h);
            }
            Op::Arange {
                start,
                end,
                step,
                dtype,
            } => {
                [start, end, step].iter().for_each(|x| x.to_bits().hash(h));
                dtype.hash(h);
            }
            Op::Rand { shape, dtype } | Op::Randn { shape, dtype } => {
                shape.hash(h);
                dtype.hash(h);
            }
            Op::Unary(u) => u.hash(h),
            Op::Cast(d) | Op::BitCast(d) => d.hash(h),
            Op::Binary(b) => b.hash(h),
            Op::Compare(c) => c.hash(h),
            Op::Reduce { op, dims, keepdim } => {
                op.hash(h);
                dims.hash(h);
                keepdim.hash(h);
            }
            Op::ArgReduce { op, dim, keepdim } => {
                op.hash(h);
                dim.hash(h);
                keepdim.hash(h);
            }
            Op::Softmax { dim }
            | Op::LogSoftmax { dim }
            | Op::Cat { dim }
            | Op::IndexSelect { dim }
            | Op::Gather { dim }
            | Op::IndexAdd { dim }
            | Op::ScatterAdd { dim } => dim.hash(h),
            Op::MatMulT {
                transpose_a,
                transpose_b,
            } => {
                transpose_a.hash(h);
                transpose_b.hash(h);
            }
            Op::Reshape(shape) | Op::Expand(shape) => shape.hash(h),
            Op::Permute(perm) => perm.hash(h),
            Op::Slice {
                dim,
                start,
                end,
                step,
            } => {
                [dim, start, step].hash(h);
                end.hash(h);
            }
            Op::Tril { diagonal } | Op::Triu { diagonal } => diagonal.hash(h),
            Op::Custom(call) => {
                call.name().hash(h);
                call.attrs_json().hash(h);
            }
            Op::CustomOutput {
                index,
                dtype,
                shape,
            } => {
                index.hash(h);
                dtype.hash(h);
                shape.hash(h);
            }
        }
    }

    /// How many inputs the op takes; `None` for variadic (`cat`).
    pub fn arity(&self) -> Option<usize> {
        match self {
            Op::Input | Op::Constant(_) | Op::Full { .. } | Op::Arange { .. } => Some(0),
            Op::Binary(_)
            | Op::Compare(_)
            | Op::MatMul
            | Op::MatMulT { .. }
            | Op::IndexSelect { .. }
            | Op::Gather { .. } => Some(2),
            Op::Where | Op::IndexAdd { .. } | Op::ScatterAdd { .. } => Some(3),
            Op::Cat { .. } | Op::Custom(_) => None,
            _ => Some(1),
        }
    }

    /// The dtype of a random op's seed operand (`rand`, `randn`): a rank-0
    /// `i64` holding the 64 bits of the generator's `u64` seed.
    pub const SEED_DTYPE: DType = DType::I64;

    /// The value a seed tensor holds for the `u64` seed `seed`: the same
    /// 64 bits (seeds above `i64::MAX` read as negative numbers).
    pub fn seed_value(seed: u64) -> i64 {
        seed as i64
    }

    /// The `u64` seed a seed tensor's value `value` stands for (the
    /// inverse of [`Op::seed_value`]).
    pub fn seed_bits(value: i64) -> u64 {
        value as u64
    }

    /// Whether each output element is a function of the inputs' elements at
    /// the same index (after broadcasting) alone: what a fused pointwise
    /// kernel can compute and what may read a broadcast view in place of a
    /// materialised copy.
    pub fn is_elementwise(&self) -> bool {
        matches!(
            self,
            Op::Unary(_) | Op::Binary(_) | Op::Compare(_) | Op::Where | Op::Cast(_)
        )
    }

    /// Whether the op's output carries a gradient back to (some of) its
    /// inputs through a VJP rule (`autograd::rules`). The tape records an
    /// op only when it has one; sources (inputs, constants, random
    /// numbers), comparisons and arg-reductions have none, and custom ops
    /// are differentiated by their registered backward instead.
    pub fn has_gradient(&self) -> bool {
        !matches!(
            self,
            Op::Input
                | Op::Constant(_)
                | Op::Full { .. }
                | Op::Arange { .. }
                | Op::Rand { .. }
                | Op::Randn { .. }
                | Op::Compare(_)
                | Op::BitCast(_)
                | Op::ArgReduce { .. }
                | Op::Custom(_)
                | Op::CustomOutput { .. }
        )
    }
}

/// The values an op's backward reads besides the output gradient (shapes
/// and dtypes it always has): which inputs, and whether its output. The
/// eager tape keeps only these alive until the backward (the others as
/// stand-ins without storage), as PyTorch's saved tensors are; the VJP
/// rules (`autograd::rules`) read nothing else, which their tests check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackwardReads {
    pub inputs: Vec<bool>,
    pub output: bool,
}

impl Op {
    /// [`BackwardReads`] of this op when `needs[i]` says whether input
    /// `i` wants a gradient (a product reads each operand only for the
    /// other's gradient).
    pub fn backward_reads(&self, needs: &[bool]) -> BackwardReads {
        let n = needs.len();
        let need = |i: usize| needs.get(i).copied().unwrap_or(false);
        let any = needs.iter().any(|&x| x);
        let mut inputs = vec![false; n];
        let mut read = |i: usize, yes: bool| {
            if let Some(slot) = inputs.get_mut(i) {
                *slot |= yes;
            }
        };
        let output = match self {
            Op::Unary(u) => {
                let (x, y) = unary_reads(*u);
                read(0, x);
                y
            }
            Op::Binary(b) => match b {
                BinaryOp::Mul => {
                    read(0, need(1));
                    read(1, need(0));
                    false
                }
                BinaryOp::Div => {
                    read(1, any);
                    need(1)
                }
                BinaryOp::Pow => {
                    read(0, any);
                    read(1, need(0));
                    need(1)
                }
                BinaryOp::Maximum | BinaryOp::Minimum => {
                    read(0, any);
                    read(1, any);
                    false
                }
                _ => false,
            },
            Op::MatMul | Op::MatMulT { .. } => {
                read(0, need(1));
                read(1, need(0));
                false
            }
            Op::Where => {
                read(0, true);
                false
            }
            Op::Reduce { op, .. } => {
                let extremal = matches!(op, ReduceOp::Max | ReduceOp::Min | ReduceOp::Prod);
                read(0, extremal);
                extremal
            }
            Op::Softmax { .. } | Op::LogSoftmax { .. } => true,
            Op::IndexSelect { .. }
            | Op::Gather { .. }
            | Op::IndexAdd { .. }
            | Op::ScatterAdd { .. } => {
                read(1, true);
                false
            }
            _ => false,
        };
        BackwardReads { inputs, output }
    }
}

/// (input, output) read by a unary op's VJP rule.
fn unary_reads(op: UnaryOp) -> (bool, bool) {
    match op {
        UnaryOp::Neg | UnaryOp::BitNot => (false, false),
        UnaryOp::Exp | UnaryOp::Sqrt | UnaryOp::Reciprocal | UnaryOp::Tanh | UnaryOp::Sigmoid => {
            (false, true)
        }
        UnaryOp::Rsqrt | UnaryOp::Gelu => (true, true),
        UnaryOp::Abs
        | UnaryOp::Log
        | UnaryOp::Sin
        | UnaryOp::Cos
        | UnaryOp::Relu
        | UnaryOp::GeluTanh
        | UnaryOp::Silu
        | UnaryOp::Atan
        | UnaryOp::Asin
        | UnaryOp::Acos => (true, false),
    }
}

fn hash_scalar<H: Hasher>(value: Scalar, h: &mut H) {
    match value {
        Scalar::Float(v) => (0u8, v.to_bits()).hash(h),
        Scalar::Int(v) => (1u8, v).hash(h),
        Scalar::Bool(v) => (2u8, v).hash(h),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::hash_map::DefaultHasher;

    fn digest(op: &Op) -> u64 {
        let mut h = DefaultHasher::new();
        op.hash_structure(&mut h);
        h.finish()
    }

    #[test]
    fn structure_hashes_tell_attributes_apart() {
        let slice = |start, end| Op::Slice {
            dim: 0,
            start,
            end: Dim::Const(end),
            step: 1,
        };
        assert_eq!(digest(&slice(0, 2)), digest(&slice(0, 2)));
        assert_ne!(digest(&slice(0, 2)), digest(&slice(2, 4)));
        assert_ne!(digest(&slice(0, 2)), digest(&slice(0, 3)));
        let full = |v: f64| Op::Full {
            value: Scalar::Float(v),
            shape: Shape::from_concrete(&[2]),
            dtype: DType::F32,
        };
        assert_ne!(digest(&full(0.5)), digest(&full(0.25)));
        assert_ne!(
            digest(&Op::Softmax { dim: 1 }),
            digest(&Op::LogSoftmax { dim: 1 })
        );
        assert_ne!(
            digest(&Op::Softmax { dim: 1 }),
            digest(&Op::Softmax { dim: 0 })
        );
        let lit = |v: f64| Op::Constant(Literal::scalar(Scalar::Float(v), DType::F64));
        assert_ne!(digest(&lit(1.0)), digest(&lit(-1.0)));
        // A random op is its kind, shape and dtype: the seed is an operand,
        // so the draws of different calls share one structure.
        let rand = |n: usize, dtype| Op::Rand {
            shape: Shape::from_concrete(&[n]),
            dtype,
        };
        assert_eq!(digest(&rand(2, DType::F32)), digest(&rand(2, DType::F32)));
        assert_ne!(digest(&rand(2, DType::F32)), digest(&rand(3, DType::F32)));
        assert_ne!(digest(&rand(2, DType::F32)), digest(&rand(2, DType::F16)));
        let randn = Op::Randn {
            shape: Shape::from_concrete(&[2]),
            dtype: DType::F32,
        };
        assert_ne!(digest(&rand(2, DType::F32)), digest(&randn));
        assert_eq!((randn.arity(), randn.has_gradient()), (Some(1), false));
    }
}
