//! Random programs through the `Tensor` API: creation ops, then a sequence
//! of `try_*` calls on a pool of tensors, with arguments that are mostly
//! sensible and often not (dims out of range, negative sizes, bad
//! permutations, mismatched dtypes and shapes, empty lists, steps of 0),
//! sometimes gradients and a backward pass; and calls whose other
//! arguments are fitted to the operand (`Step::Fit`), to get past the
//! argument checks into the kernels.
//!
//! Two targets share the generator:
//! - `tensor_api_small`: every shape has at most a few thousand elements;
//! - `tensor_api_huge_sizes`: dims and sizes like 2^31, 2^62, `usize::MAX`,
//!   0 beside huge dims, `from_vec` shapes whose element count wraps, and
//!   `full` of `[1000000,1000000]`: the overflow and allocation cases.
//!
//! Properties: no call panics (the panicking forms are never called, except
//! `from_vec`, whose documented panic on a bad shape is accepted); every
//! error has a message; every tensor returned has as many elements as its
//! shape says, a storage that holds every element its layout can reach,
//! and (when small) reads back; gradients have their tensor's type.
//!
//! Not a property: how long a legal call takes. A reduction over a huge
//! broadcast view is legal and would run for hours, so calls whose work
//! (elements read) passes [`MAX_WORK`] are skipped; their operands stay in
//! the pool for other calls.

use std::panic::{self, AssertUnwindSafe, Location};

use tessera::ir::{Op, Scalar, Shape};
use tessera::{DType, Error, SdpaOptions, Tensor};

use super::support::{note, take_last_panic, Rng, Target};

pub fn small() -> Target<Program> {
    Target {
        test: "tensor_api_small",
        ci_cases: 40_000,
        generate: |rng| generate(rng, false),
        check,
        show,
    }
}

pub fn huge() -> Target<Program> {
    Target {
        test: "tensor_api_huge_sizes",
        ci_cases: 10_000,
        generate: |rng| generate(rng, true),
        check,
        show,
    }
}

/// Elements a call may read (see the module doc).
const MAX_WORK: u128 = 1 << 24;

/// Elements a tensor may have for its values to be read back.
const MAX_READ: u128 = 1 << 16;

/// Tensors kept for later steps.
const POOL: usize = 10;

const DTYPES: &[DType] = &[
    DType::F32,
    DType::F32,
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::I32,
    DType::Bool,
];

#[derive(Clone, Copy, Debug)]
pub enum Unary {
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
    Gelu,
    GeluTanh,
    Silu,
    Contiguous,
    T,
    SqueezeAll,
}

const UNARY: &[Unary] = &[
    Unary::Neg,
    Unary::Abs,
    Unary::Exp,
    Unary::Log,
    Unary::Sqrt,
    Unary::Rsqrt,
    Unary::Reciprocal,
    Unary::Sin,
    Unary::Cos,
    Unary::Tanh,
    Unary::Sigmoid,
    Unary::Relu,
    Unary::Gelu,
    Unary::GeluTanh,
    Unary::Silu,
    Unary::Contiguous,
    Unary::T,
    Unary::SqueezeAll,
];

#[derive(Clone, Copy, Debug)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Maximum,
    Minimum,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    MatMul,
}

const BINARY: &[Binary] = &[
    Binary::Add,
    Binary::Sub,
    Binary::Mul,
    Binary::Div,
    Binary::Pow,
    Binary::Maximum,
    Binary::Minimum,
    Binary::Eq,
    Binary::Ne,
    Binary::Lt,
    Binary::Le,
    Binary::Gt,
    Binary::Ge,
    Binary::MatMul,
];

#[derive(Clone, Copy, Debug)]
pub enum Reduce {
    Sum,
    Mean,
    Max,
    Min,
    Prod,
}

const REDUCE: &[Reduce] = &[
    Reduce::Sum,
    Reduce::Mean,
    Reduce::Max,
    Reduce::Min,
    Reduce::Prod,
];

#[derive(Clone, Copy, Debug)]
pub enum Index {
    Select,
    Gather,
    Add,
    ScatterAdd,
}

/// One call; `usize` operands pick from the pool (modulo its size at that
/// step, which only grows by the calls that succeed).
#[derive(Clone, Debug)]
pub enum Step {
    /// `Tensor::full` through `Tensor::apply` (its fallible form).
    Full {
        shape: Vec<usize>,
        value: f64,
        dtype: DType,
    },
    Arange {
        start: f64,
        end: f64,
        step: f64,
        dtype: DType,
    },
    Random {
        shape: Vec<usize>,
        dtype: DType,
        normal: bool,
        seed: u64,
    },
    /// `Tensor::from_vec` of `len` f32 values.
    FromVec {
        len: usize,
        shape: Vec<usize>,
    },
    /// An index tensor (i64 or i32) holding `values`.
    Indices {
        values: Vec<i64>,
        shape: Vec<usize>,
        i32: bool,
    },
    RequiresGrad(usize),
    Unary(Unary, usize),
    Binary(Binary, usize, usize),
    Scalar(Binary, usize, f64),
    Reduce(Reduce, usize, Vec<isize>, bool),
    Cast(usize, DType),
    ArgMax(usize, isize, bool, bool),
    Softmax(usize, isize, bool),
    Reshape(usize, Vec<isize>),
    View(usize, Vec<isize>),
    Flatten(usize, isize, isize),
    Unsqueeze(usize, isize),
    Squeeze(usize, isize),
    Permute(usize, Vec<isize>),
    Transpose(usize, isize, isize),
    Expand(usize, Vec<isize>),
    BroadcastTo(usize, Vec<usize>),
    Slice(usize, isize, isize, isize, usize),
    Narrow(usize, isize, usize, usize),
    Tril(usize, i64, bool),
    Index(Index, usize, isize, usize, usize),
    Embedding(usize, usize),
    Cat(Vec<usize>, isize),
    Stack(Vec<usize>, isize),
    TensorSplit(usize, usize, isize),
    Chunk(usize, usize, isize),
    Split(usize, usize, isize),
    SplitSizes(usize, Vec<usize>, isize),
    Where(usize, usize, usize),
    Attention {
        q: usize,
        k: usize,
        v: usize,
        mask: Option<usize>,
        causal: bool,
        scale: Option<f64>,
    },
    ToDevice(usize, &'static str),
    Backward(usize),
    /// A call whose other arguments are made to fit the operand's actual
    /// type (valid more often than not), from a seed: see [`fit`].
    Fit(Fit, usize, u64),
}

/// The calls [`Step::Fit`] makes.
#[derive(Clone, Copy, Debug)]
pub enum Fit {
    /// A reshape to a factorisation of the element count (maybe a `-1`).
    Reshape,
    /// An expand of size-1 dims (and new leading dims).
    Expand,
    /// A binary op with a broadcast-compatible operand of the same dtype.
    Binary(Binary),
    /// A matmul with an operand of matching inner size.
    MatMul,
    /// `where` with a condition and an other of broadcastable shapes.
    Where,
    /// The index ops with in-range (sometimes out-of-range) indices.
    Index(Index),
    Embedding,
    /// A cat of the operand with views of itself along a dim.
    Cat,
    /// `split_sizes` with sizes that add up (or are one off).
    SplitSizes,
    /// Attention over `[batch, heads, len, dim]` operands derived from the
    /// seed, with a bool or float mask, causal or not.
    Attention,
}

const FITS: &[Fit] = &[
    Fit::Reshape,
    Fit::Reshape,
    Fit::Expand,
    Fit::Binary(Binary::Add),
    Fit::Binary(Binary::Mul),
    Fit::Binary(Binary::Pow),
    Fit::Binary(Binary::Maximum),
    Fit::Binary(Binary::Lt),
    Fit::MatMul,
    Fit::MatMul,
    Fit::Where,
    Fit::Index(Index::Select),
    Fit::Index(Index::Gather),
    Fit::Index(Index::Add),
    Fit::Index(Index::ScatterAdd),
    Fit::Embedding,
    Fit::Cat,
    Fit::SplitSizes,
    Fit::Attention,
];

#[derive(Debug)]
pub struct Program {
    huge: bool,
    steps: Vec<Step>,
}

fn show(p: &Program) -> String {
    let mut text = format!(
        "({} sizes; operands index the pool of tensors made so far, modulo its size; \
         the pool keeps the last {POOL})\n",
        if p.huge { "huge" } else { "small" }
    );
    for (i, s) in p.steps.iter().enumerate() {
        text += &format!("{i:>3}: {s:?}\n");
    }
    text
}

// -------------------------------------------------------------- generator

struct Gen<'a> {
    rng: &'a mut Rng,
    huge: bool,
}

/// Device names for `to_device`, real and not.
const DEVICES: &[&str] = &["cpu", "cuda", "cuda:7", "tpu", ""];

const HUGE_DIMS: &[usize] = &[
    1 << 31,
    1 << 32,
    1 << 33,
    1 << 40,
    1 << 46,
    1 << 47,
    1 << 62,
    (1 << 62) + 1,
    1 << 63,
    usize::MAX,
    usize::MAX / 2,
];

const HUGE_ISIZES: &[isize] = &[
    isize::MIN,
    isize::MIN + 1,
    -(1 << 62),
    1 << 31,
    1 << 62,
    isize::MAX,
];

impl Gen<'_> {
    /// Whether this argument is hostile (huge mode only).
    fn wild(&mut self) -> bool {
        self.huge && self.rng.chance(0.25)
    }

    fn dim(&mut self) -> usize {
        if self.wild() && self.rng.chance(0.4) {
            *self.rng.pick(HUGE_DIMS)
        } else {
            *self.rng.pick(&[0, 1, 1, 2, 2, 3, 3, 4, 5])
        }
    }

    fn shape(&mut self) -> Vec<usize> {
        let rank = *self.rng.pick(&[0, 1, 1, 2, 2, 2, 3, 3, 4]);
        (0..rank).map(|_| self.dim()).collect()
    }

    /// A dim argument: mostly in -4..4, at times far out.
    fn axis(&mut self) -> isize {
        if self.wild() || self.rng.chance(0.03) {
            *self.rng.pick(HUGE_ISIZES)
        } else {
            self.rng.between(-4, 4) as isize
        }
    }

    fn axes(&mut self) -> Vec<isize> {
        let n = self.rng.below(4);
        (0..n).map(|_| self.axis()).collect()
    }

    fn size_arg(&mut self) -> isize {
        if self.wild() {
            return *self.rng.pick(HUGE_ISIZES);
        }
        match self.rng.below(12) {
            0 => -1,
            1 => -2,
            _ => self.rng.between(0, 6) as isize,
        }
    }

    fn sizes(&mut self) -> Vec<isize> {
        let n = self.rng.below(5);
        (0..n).map(|_| self.size_arg()).collect()
    }

    fn count(&mut self) -> usize {
        if self.wild() {
            *self.rng.pick(HUGE_DIMS)
        } else {
            self.rng.below(6)
        }
    }

    fn operand(&mut self) -> usize {
        self.rng.below(POOL)
    }

    fn value(&mut self) -> f64 {
        *self.rng.pick(&[
            0.0,
            1.0,
            -1.5,
            2.0,
            0.5,
            1e30,
            -1e-30,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            3e9,
            -0.0,
        ])
    }

    fn creation(&mut self) -> Step {
        match self.rng.below(10) {
            0..=2 => Step::Full {
                shape: self.shape(),
                value: self.value(),
                dtype: *self.rng.pick(DTYPES),
            },
            3 => {
                let (start, end, step) = if self.wild() {
                    *self.rng.pick(&[
                        (0.0, 4611686018427387904.0, 1.0),
                        (0.0, 1e300, 1e-300),
                        (0.0, f64::INFINITY, 1.0),
                        (0.0, 10.0, f64::NAN),
                        (0.0, 10.0, 0.0),
                        (0.0, 1e19, 1.0),
                        (-1e19, 1e19, 1e18),
                        (0.0, 1e6, 1e-6),
                    ])
                } else {
                    let start = self.rng.between(-4, 4) as f64 / 2.0;
                    let end = self.rng.between(-6, 12) as f64 / 2.0;
                    let step = *self.rng.pick(&[1.0, 0.5, -1.0, 2.0, 0.0, 0.3]);
                    (start, end, step)
                };
                Step::Arange {
                    start,
                    end,
                    step,
                    dtype: *self.rng.pick(DTYPES),
                }
            }
            4 | 5 => Step::Random {
                shape: self.shape(),
                dtype: *self.rng.pick(DTYPES),
                normal: self.rng.chance(0.5),
                seed: self.rng.u64(),
            },
            6 if self.huge => {
                // Shapes whose element count wraps around to `len`.
                let (len, shape): (usize, &[usize]) = *self.rng.pick(&[
                    (16, &[(1usize << 62) + 1, 16][..]),
                    (0, &[1 << 32, 1 << 32]),
                    (4, &[(1 << 63) + 1, 4]),
                    (1, &[usize::MAX, usize::MAX]),
                    (6, &[2, 3]),
                    (0, &[0, usize::MAX]),
                ]);
                Step::FromVec {
                    len,
                    shape: shape.to_vec(),
                }
            }
            6 => {
                let shape = self.shape();
                let n = checked_numel(&shape).unwrap_or(0);
                let len = if self.rng.chance(0.8) {
                    n
                } else {
                    self.rng.below(8)
                };
                Step::FromVec { len, shape }
            }
            _ => {
                let shape = match self.rng.below(3) {
                    0 => vec![self.dim()],
                    1 => vec![self.dim(), self.dim()],
                    _ => self.shape(),
                };
                let full = checked_numel(&shape);
                let n = full.unwrap_or(64).min(64);
                let values = (0..n)
                    .map(|_| match self.rng.below(10) {
                        0 => -1,
                        1 => *self.rng.pick(&[i64::MAX, i64::MIN, 1 << 40, 7]),
                        _ => self.rng.below(4) as i64,
                    })
                    .collect();
                let shape = if Some(n) == full { shape } else { vec![n] };
                Step::Indices {
                    values,
                    shape,
                    i32: self.rng.chance(0.3),
                }
            }
        }
    }

    fn step(&mut self) -> Step {
        let x = self.operand();
        let y = self.operand();
        let z = self.operand();
        match self.rng.below(48) {
            40..=47 => Step::Fit(*self.rng.pick(FITS), x, self.rng.u64()),
            0..=5 => self.creation(),
            6 | 7 => Step::Unary(*self.rng.pick(UNARY), x),
            8..=10 => Step::Binary(*self.rng.pick(BINARY), x, y),
            11 => Step::Scalar(*self.rng.pick(BINARY), x, self.value()),
            12 | 13 => Step::Reduce(*self.rng.pick(REDUCE), x, self.axes(), self.rng.chance(0.5)),
            14 => Step::Cast(x, *self.rng.pick(DTYPES)),
            15 => Step::ArgMax(x, self.axis(), self.rng.chance(0.5), self.rng.chance(0.5)),
            16 => Step::Softmax(x, self.axis(), self.rng.chance(0.5)),
            17 | 18 => Step::Reshape(x, self.sizes()),
            19 => Step::View(x, self.sizes()),
            20 => Step::Flatten(x, self.axis(), self.axis()),
            21 => match self.rng.chance(0.5) {
                true => Step::Unsqueeze(x, self.axis()),
                false => Step::Squeeze(x, self.axis()),
            },
            22 => {
                let n = self.rng.below(5);
                let perm = match self.rng.chance(0.7) {
                    true => {
                        let mut p: Vec<isize> = (0..n as isize).collect();
                        for i in (1..p.len()).rev() {
                            p.swap(i, self.rng.below(i + 1));
                        }
                        p
                    }
                    false => (0..n).map(|_| self.axis()).collect(),
                };
                Step::Permute(x, perm)
            }
            23 => Step::Transpose(x, self.axis(), self.axis()),
            24 | 25 => Step::Expand(x, self.sizes()),
            26 => Step::BroadcastTo(x, self.shape()),
            27 | 28 => {
                let step = if self.wild() {
                    *self.rng.pick(HUGE_DIMS)
                } else {
                    *self.rng.pick(&[1, 1, 2, 3, 0])
                };
                Step::Slice(x, self.axis(), self.size_arg(), self.size_arg(), step)
            }
            29 => Step::Narrow(x, self.axis(), self.count(), self.count()),
            30 => Step::Tril(
                x,
                match self.wild() {
                    true => *self.rng.pick(&[i64::MIN, i64::MAX, 1 << 40]),
                    false => self.rng.between(-3, 3),
                },
                self.rng.chance(0.5),
            ),
            31 => {
                let kind =
                    *self
                        .rng
                        .pick(&[Index::Select, Index::Gather, Index::Add, Index::ScatterAdd]);
                Step::Index(kind, x, self.axis(), y, z)
            }
            32 => Step::Embedding(x, y),
            33 => {
                let n = self.rng.below(4);
                let list = (0..n).map(|_| self.operand()).collect();
                match self.rng.chance(0.5) {
                    true => Step::Cat(list, self.axis()),
                    false => Step::Stack(list, self.axis()),
                }
            }
            34 => match self.rng.below(4) {
                0 => Step::TensorSplit(x, self.count(), self.axis()),
                1 => Step::Chunk(x, self.count(), self.axis()),
                2 => Step::Split(x, self.count(), self.axis()),
                _ => {
                    let n = self.rng.below(4);
                    Step::SplitSizes(x, (0..n).map(|_| self.count()).collect(), self.axis())
                }
            },
            35 => Step::Where(x, y, z),
            36 => Step::Attention {
                q: x,
                k: y,
                v: z,
                mask: self.rng.chance(0.3).then(|| self.operand()),
                causal: self.rng.chance(0.5),
                scale: self.rng.chance(0.3).then(|| self.value()),
            },
            37 => Step::ToDevice(x, DEVICES[self.rng.below(DEVICES.len())]),
            38 if !self.huge => Step::RequiresGrad(x),
            39 if !self.huge => Step::Backward(x),
            _ => self.creation(),
        }
    }
}

fn generate(rng: &mut Rng, huge: bool) -> Program {
    let mut g = Gen { rng, huge };
    let mut steps: Vec<Step> = (0..2 + g.rng.below(3)).map(|_| g.creation()).collect();
    let n = 4 + g.rng.below(24);
    steps.extend((0..n).map(|_| g.step()));
    if huge && g.rng.chance(0.05) {
        // The reproducer: an allocation larger than any memory.
        steps.insert(
            0,
            Step::Full {
                shape: vec![1_000_000, 1_000_000],
                value: 1.0,
                dtype: DType::F32,
            },
        );
    }
    Program { huge, steps }
}

// -------------------------------------------------------------- execution

/// The element count of `shape` (`u128::MAX` past that).
fn numel(shape: &[usize]) -> u128 {
    shape
        .iter()
        .try_fold(1u128, |n, &d| n.checked_mul(d as u128))
        .unwrap_or(u128::MAX)
}

/// The element count of `shape`, if it fits a `usize`.
fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// The elements `step` reads from its operands, roughly: the guard against
/// legal calls that would run for hours.
fn work(step: &Step, pool: &[Tensor]) -> u128 {
    let get = |i: &usize| -> &Tensor { &pool[i % pool.len()] };
    let n = |i: &usize| numel(get(i).shape());
    match step {
        Step::Reduce(_, x, ..) | Step::ArgMax(x, ..) | Step::Backward(x) => n(x),
        Step::Binary(Binary::MatMul, x, y) => {
            let (a, b) = (get(x).shape(), get(y).shape());
            let inner = a.last().copied().unwrap_or(1) as u128;
            let outer = numel(a) / inner.max(1) * (b.last().copied().unwrap_or(1) as u128);
            n(x).max(n(y)).max(outer.saturating_mul(inner))
        }
        Step::Attention { q, k, v, .. } => n(q).max(n(k)).max(n(v)).saturating_mul(4),
        Step::Index(_, x, _, y, z) => n(x).max(n(y)).max(n(z)),
        Step::Embedding(x, y) => n(x).max(n(y)),
        Step::Fit(Fit::MatMul, x, _) => n(x).saturating_mul(4),
        Step::Fit(_, x, _) => n(x),
        _ => 0,
    }
}

/// The invariants of a tensor a call returned.
fn check_tensor(t: &Tensor) -> Result<(), String> {
    let n = numel(t.shape());
    if n != t.numel() as u128 {
        return Err(format!(
            "{} claims {} elements; its shape has {n}",
            t.ty(),
            t.numel()
        ));
    }
    if n > 0 && t.device() == tessera::runtime::device::Device::Cpu {
        let layout = t.layout();
        let last = layout
            .shape
            .iter()
            .zip(&layout.strides)
            .fold(layout.offset as u128, |sum, (&d, &s)| {
                sum.saturating_add((d as u128 - 1) * s as u128)
            });
        let held = t.storage().numel() as u128;
        if last >= held {
            return Err(format!(
                "{} with strides {:?} and offset {} reaches element {last} of a storage of {held}",
                t.ty(),
                layout.strides,
                layout.offset
            ));
        }
    }
    if n <= MAX_READ {
        let values = t.to_f64_vec();
        if values.len() as u128 != n {
            return Err(format!("{} reads back {} values", t.ty(), values.len()));
        }
        if n == 1 {
            let _ = t.item();
        }
    }
    Ok(())
}

fn f32_values(n: usize) -> Vec<f32> {
    (0..n).map(|i| (i % 7) as f32 - 3.0).collect()
}

/// Runs one step; `Ok(results)` or the error (a `String` for the
/// documented panics accepted as errors).
fn run(step: &Step, pool: &[Tensor]) -> Result<Vec<Tensor>, Error> {
    let get = |i: &usize| -> &Tensor { &pool[i % pool.len()] };
    let one = |r: Result<Tensor, Error>| r.map(|t| vec![t]);
    let here = Location::caller();
    match step {
        Step::Full {
            shape,
            value,
            dtype,
        } => {
            let value = match dtype {
                d if d.is_float() => Scalar::Float(*value),
                d if d.is_int() => Scalar::Int(*value as i64),
                _ => Scalar::Bool(*value != 0.0),
            };
            let op = Op::Full {
                value,
                shape: Shape::from_concrete(shape),
                dtype: *dtype,
            };
            one(Tensor::apply(&op, &[], here))
        }
        Step::Arange {
            start,
            end,
            step,
            dtype,
        } => {
            let op = Op::Arange {
                start: *start,
                end: *end,
                step: *step,
                dtype: *dtype,
            };
            one(Tensor::apply(&op, &[], here))
        }
        Step::Random {
            shape,
            dtype,
            normal,
            seed,
        } => {
            let shape = Shape::from_concrete(shape);
            let dtype = *dtype;
            let op = match normal {
                true => Op::Randn { shape, dtype },
                false => Op::Rand { shape, dtype },
            };
            let seed = Tensor::from_slice(&[Op::seed_value(*seed)], &[]);
            one(Tensor::apply(&op, &[&seed], here))
        }
        Step::FromVec { len, shape } => {
            let data = f32_values(*len);
            let made = panic::catch_unwind(|| Tensor::from_vec(data, shape));
            match made {
                Ok(t) => Ok(vec![t]),
                Err(_) => {
                    let message = take_last_panic().unwrap_or_default();
                    // `from_vec` panics on a bad shape, by its contract.
                    if message.contains("from_vec") {
                        Ok(vec![])
                    } else {
                        panic::resume_unwind(Box::new(message))
                    }
                }
            }
        }
        Step::Indices { values, shape, i32 } => {
            let t = Tensor::try_from_vec(values.clone(), shape)?;
            match i32 {
                true => one(t.try_cast(DType::I32)),
                false => Ok(vec![t]),
            }
        }
        Step::RequiresGrad(x) => {
            let t = get(x);
            match t.dtype().is_float() {
                true => Ok(vec![t.set_requires_grad(true)]),
                false => Ok(vec![]),
            }
        }
        Step::Unary(op, x) => {
            let x = get(x);
            one(match op {
                Unary::Neg => x.try_neg(),
                Unary::Abs => x.try_abs(),
                Unary::Exp => x.try_exp(),
                Unary::Log => x.try_log(),
                Unary::Sqrt => x.try_sqrt(),
                Unary::Rsqrt => x.try_rsqrt(),
                Unary::Reciprocal => x.try_reciprocal(),
                Unary::Sin => x.try_sin(),
                Unary::Cos => x.try_cos(),
                Unary::Tanh => x.try_tanh(),
                Unary::Sigmoid => x.try_sigmoid(),
                Unary::Relu => x.try_relu(),
                Unary::Gelu => x.try_gelu(),
                Unary::GeluTanh => x.try_gelu_tanh(),
                Unary::Silu => x.try_silu(),
                Unary::Contiguous => x.try_contiguous(),
                Unary::T => x.try_t(),
                Unary::SqueezeAll => x.try_squeeze_all(),
            })
        }
        Step::Binary(op, x, y) => {
            let (x, y) = (get(x), get(y));
            one(match op {
                Binary::Add => x.try_add(y),
                Binary::Sub => x.try_sub(y),
                Binary::Mul => x.try_mul(y),
                Binary::Div => x.try_div(y),
                Binary::Pow => x.try_pow(y),
                Binary::Maximum => x.try_maximum(y),
                Binary::Minimum => x.try_minimum(y),
                Binary::Eq => x.try_eq(y),
                Binary::Ne => x.try_ne(y),
                Binary::Lt => x.try_lt(y),
                Binary::Le => x.try_le(y),
                Binary::Gt => x.try_gt(y),
                Binary::Ge => x.try_ge(y),
                Binary::MatMul => x.try_matmul(y),
            })
        }
        Step::Scalar(op, x, c) => {
            let (x, c) = (get(x), *c);
            one(match op {
                Binary::Add => x.try_add(c),
                Binary::Sub => x.try_sub(c),
                Binary::Mul => x.try_mul(c),
                Binary::Div => x.try_div(c),
                Binary::Pow => x.try_pow(c),
                Binary::Maximum => x.try_maximum(c),
                Binary::Minimum => x.try_minimum(c),
                Binary::Eq => x.try_eq(c),
                Binary::Ne => x.try_ne(c),
                Binary::Lt => x.try_lt(c),
                Binary::Le => x.try_le(c),
                Binary::Gt => x.try_gt(c),
                Binary::Ge => x.try_ge(c),
                Binary::MatMul => x.try_matmul(&Tensor::try_full(&[], c, x.dtype())?),
            })
        }
        Step::Reduce(op, x, dims, keepdim) => {
            let x = get(x);
            one(match op {
                Reduce::Sum => x.try_sum(dims, *keepdim),
                Reduce::Mean => x.try_mean(dims, *keepdim),
                Reduce::Max => x.try_max(dims, *keepdim),
                Reduce::Min => x.try_min(dims, *keepdim),
                Reduce::Prod => x.try_prod(dims, *keepdim),
            })
        }
        Step::Cast(x, dtype) => one(get(x).try_cast(*dtype)),
        Step::ArgMax(x, dim, keepdim, max) => one(match max {
            true => get(x).try_argmax(*dim, *keepdim),
            false => get(x).try_argmin(*dim, *keepdim),
        }),
        Step::Softmax(x, dim, log) => one(match log {
            true => get(x).try_log_softmax(*dim),
            false => get(x).try_softmax(*dim),
        }),
        Step::Reshape(x, shape) => one(get(x).try_reshape(shape)),
        Step::View(x, shape) => one(get(x).try_view(shape)),
        Step::Flatten(x, s, e) => one(get(x).try_flatten(*s, *e)),
        Step::Unsqueeze(x, d) => one(get(x).try_unsqueeze(*d)),
        Step::Squeeze(x, d) => one(get(x).try_squeeze(*d)),
        Step::Permute(x, perm) => one(get(x).try_permute(perm)),
        Step::Transpose(x, a, b) => one(get(x).try_transpose(*a, *b)),
        Step::Expand(x, shape) => one(get(x).try_expand(shape)),
        Step::BroadcastTo(x, shape) => one(get(x).try_broadcast_to(shape)),
        Step::Slice(x, dim, start, end, step) => one(get(x).try_slice(*dim, *start, *end, *step)),
        Step::Narrow(x, dim, start, len) => one(get(x).try_narrow(*dim, *start, *len)),
        Step::Tril(x, diagonal, lower) => one(match lower {
            true => get(x).try_tril(*diagonal),
            false => get(x).try_triu(*diagonal),
        }),
        Step::Index(kind, x, dim, index, src) => {
            let (x, index, src) = (get(x), get(index), get(src));
            one(match kind {
                Index::Select => x.try_index_select(*dim, index),
                Index::Gather => x.try_gather(*dim, index),
                Index::Add => x.try_index_add(*dim, index, src),
                Index::ScatterAdd => x.try_scatter_add(*dim, index, src),
            })
        }
        Step::Embedding(table, ids) => one(get(table).try_embedding(get(ids))),
        Step::Cat(list, dim) => {
            let list: Vec<&Tensor> = list.iter().map(get).collect();
            one(Tensor::try_cat(&list, *dim))
        }
        Step::Stack(list, dim) => {
            let list: Vec<&Tensor> = list.iter().map(get).collect();
            one(Tensor::try_stack(&list, *dim))
        }
        Step::TensorSplit(x, n, dim) => get(x).try_tensor_split(*n, *dim),
        Step::Chunk(x, n, dim) => get(x).try_chunk(*n, *dim),
        Step::Split(x, n, dim) => get(x).try_split(*n, *dim),
        Step::SplitSizes(x, sizes, dim) => get(x).try_split_sizes(sizes, *dim),
        Step::Where(c, a, b) => one(Tensor::try_where(get(c), get(a), get(b))),
        Step::Attention {
            q,
            k,
            v,
            mask,
            causal,
            scale,
        } => {
            let options = SdpaOptions {
                mask: mask.as_ref().map(get),
                causal: *causal,
                scale: *scale,
            };
            one(tessera::try_scaled_dot_product_attention(
                get(q),
                get(k),
                get(v),
                options,
            ))
        }
        Step::ToDevice(x, device) => one(get(x).to_device(device)),
        Step::Fit(kind, x, seed) => fit(*kind, get(x), *seed),
        Step::Backward(x) => {
            let x = get(x);
            if !x.requires_grad() {
                return Ok(vec![]);
            }
            let loss = x.try_sum(&[], false)?;
            loss.try_backward(None)?;
            Ok(vec![])
        }
    }
}

/// A random tensor of `shape` and `dtype` (small values; for ints, 0..3).
/// Past a few thousand elements (huge shapes), a `full` made by tessera:
/// the harness itself never allocates a size it is given.
fn made(rng: &mut Rng, shape: &[usize], dtype: DType) -> Result<Tensor, Error> {
    let n = match checked_numel(shape) {
        Some(n) if n <= 4096 => n,
        _ => {
            let op = Op::Full {
                value: Scalar::Int(1),
                shape: Shape::from_concrete(shape),
                dtype: DType::I64,
            };
            return Tensor::apply(&op, &[], Location::caller())?.try_cast(dtype);
        }
    };
    let values: Vec<f32> = match dtype.is_float() {
        true => (0..n).map(|_| rng.between(-8, 8) as f32 / 4.0).collect(),
        false => (0..n).map(|_| rng.below(3) as f32).collect(),
    };
    // Fallible: a 0-element shape can still be past the size limit.
    Tensor::try_from_vec(values, shape)?.try_cast(dtype)
}

/// An index tensor of `shape` (always small) with values below `bound`
/// (now and then one out of range, or negative).
fn indices(rng: &mut Rng, shape: &[usize], bound: usize) -> Tensor {
    let n = checked_numel(shape).expect("index shapes are small");
    let values: Vec<i64> = (0..n)
        .map(|_| match rng.below(20) {
            0 => bound as i64,
            1 => -1,
            _ => rng.below(bound.max(1)) as i64,
        })
        .collect();
    Tensor::from_vec(values, shape)
}

/// A shape `x` broadcasts with: some dims 1, some leading dims dropped.
fn broadcastable(rng: &mut Rng, shape: &[usize]) -> Vec<usize> {
    let drop = rng.below(shape.len() + 1);
    shape[drop..]
        .iter()
        .map(|&d| if rng.chance(0.3) { 1 } else { d })
        .collect()
}

/// Runs a [`Step::Fit`]; the fitted arguments come from `seed`.
fn fit(kind: Fit, x: &Tensor, seed: u64) -> Result<Vec<Tensor>, Error> {
    let rng = &mut Rng::for_case(seed, 0);
    let shape = x.shape().to_vec();
    let rank = shape.len();
    let dim = if rank == 0 { 0 } else { rng.below(rank) };
    let one = |r: Result<Tensor, Error>| r.map(|t| vec![t]);
    match kind {
        Fit::Reshape => {
            // Split the element count into up to four factors.
            let mut left = x.numel();
            let mut target: Vec<isize> = Vec::new();
            for _ in 0..rng.below(4) {
                let divisors: Vec<usize> = (1..=left.min(8))
                    .filter(|&d| left.is_multiple_of(d))
                    .collect();
                let d = if left == 0 { 0 } else { *rng.pick(&divisors) };
                target.push(d as isize);
                left = left.checked_div(d).unwrap_or(0);
            }
            target.push(left as isize);
            if rng.chance(0.3) {
                let i = rng.below(target.len());
                target[i] = -1;
            }
            one(x.try_reshape(&target))
        }
        Fit::Expand => {
            let mut target: Vec<isize> = (0..rng.below(3)).map(|_| rng.below(3) as isize).collect();
            target.extend(shape.iter().map(|&d| match (d, rng.below(3)) {
                (1, 0) => rng.below(4) as isize,
                (_, 1) => -1,
                (d, _) => d as isize,
            }));
            one(x.try_expand(&target))
        }
        Fit::Binary(op) => {
            let y_shape = broadcastable(rng, &shape);
            let y = made(rng, &y_shape, x.dtype())?;
            let (a, b) = if rng.chance(0.5) { (x, &y) } else { (&y, x) };
            run(&Step::Binary(op, 0, 1), &[a.clone(), b.clone()])
        }
        Fit::MatMul => {
            let inner = shape.last().copied().unwrap_or(1);
            let mut other = match rank {
                0 | 1 => vec![inner],
                _ => broadcastable(rng, &shape[..rank - 2]),
            };
            if rank >= 1 {
                if rank > 1 || rng.chance(0.5) {
                    other.push(inner);
                    other.push(rng.below(4));
                }
                if rank == 1 && other.len() == 1 {
                    other = vec![inner];
                }
            }
            let y = made(rng, &other, x.dtype())?;
            one(x.try_matmul(&y))
        }
        Fit::Where => {
            let cond_shape = broadcastable(rng, &shape);
            let cond = made(rng, &cond_shape, DType::Bool)?;
            let other_shape = broadcastable(rng, &shape);
            let other = made(rng, &other_shape, x.dtype())?;
            one(Tensor::try_where(&cond, x, &other))
        }
        Fit::Index(op) => {
            let size = shape.get(dim).copied().unwrap_or(1);
            let d = dim as isize;
            match op {
                Index::Select => {
                    let n = rng.below(5);
                    one(x.try_index_select(d, &indices(rng, &[n], size)))
                }
                Index::Add => {
                    let n = rng.below(5);
                    let mut src_shape = shape.clone();
                    if rank > 0 {
                        src_shape[dim] = n;
                    }
                    let src = made(rng, &src_shape, x.dtype())?;
                    one(x.try_index_add(d, &indices(rng, &[n], size), &src))
                }
                Index::Gather | Index::ScatterAdd => {
                    let index_shape: Vec<usize> =
                        shape.iter().map(|&s| rng.below(s.min(4) + 1)).collect();
                    let index = indices(rng, &index_shape, size);
                    match op {
                        Index::Gather => one(x.try_gather(d, &index)),
                        _ => {
                            let src = made(rng, &index_shape, x.dtype())?;
                            one(x.try_scatter_add(d, &index, &src))
                        }
                    }
                }
            }
        }
        Fit::Embedding => {
            let rows = shape.first().copied().unwrap_or(1);
            let ids_shape: Vec<usize> = (0..rng.below(3)).map(|_| rng.below(4)).collect();
            one(x.try_embedding(&indices(rng, &ids_shape, rows)))
        }
        Fit::Cat => {
            let size = shape.get(dim).copied().unwrap_or(0);
            let start = rng.below(size + 1) as isize;
            let part = x.try_slice(dim as isize, start, size as isize, 1)?;
            let list = [x, &part, x];
            let n = 1 + rng.below(3);
            one(Tensor::try_cat(
                &list[..n],
                dim as isize - rank as isize * rng.below(2) as isize,
            ))
        }
        Fit::SplitSizes => {
            let mut left = shape.get(dim).copied().unwrap_or(0);
            let mut sizes = Vec::new();
            while left > 0 && sizes.len() < 4 {
                let s = 1 + rng.below(left);
                sizes.push(s);
                left -= s;
            }
            if rng.chance(0.2) {
                sizes.push(1);
            }
            x.try_split_sizes(&sizes, dim as isize)
        }
        Fit::Attention => {
            let dtype = *rng.pick(&[DType::F32, DType::F32, DType::F16, DType::BF16, DType::F64]);
            let (b, h, lq, lk, e) = (
                rng.below(3),
                1 + rng.below(2),
                rng.below(5),
                rng.below(5),
                1 + rng.below(8),
            );
            let q = made(rng, &[b, h, lq, e], dtype)?;
            let k = made(rng, &[b, h, lk, e], dtype)?;
            let v = made(rng, &[b, h, lk, e], dtype)?;
            let mask = match rng.below(3) {
                0 => Some(made(rng, &[lq, lk], DType::Bool)?),
                1 => Some(made(rng, &[b, 1, lq, lk], dtype)?),
                _ => None,
            };
            let options = SdpaOptions {
                mask: mask.as_ref(),
                causal: rng.chance(0.5),
                scale: rng.chance(0.3).then(|| rng.f64()),
            };
            one(tessera::try_scaled_dot_product_attention(
                &q, &k, &v, options,
            ))
        }
    }
}

fn check(program: &Program) -> Result<(), String> {
    let mut pool: Vec<Tensor> = Vec::new();
    let mut leaves: Vec<Tensor> = Vec::new();
    let mut log = String::new();
    for (i, step) in program.steps.iter().enumerate() {
        let needs_pool = !matches!(
            step,
            Step::Full { .. }
                | Step::Arange { .. }
                | Step::Random { .. }
                | Step::FromVec { .. }
                | Step::Indices { .. }
        );
        if needs_pool && pool.is_empty() {
            continue;
        }
        if needs_pool && work(step, &pool) > MAX_WORK {
            log += &format!("{i:>3}: skipped (too much work): {step:?}\n");
            continue;
        }
        let name = format!("{step:?}");
        let kind = name
            .split(|c: char| !c.is_alphanumeric())
            .next()
            .unwrap_or_default();
        note(kind, &format!("step {i}: {name}"));
        let outcome = panic::catch_unwind(AssertUnwindSafe(|| run(step, &pool)));
        let results = match outcome {
            Err(_) => {
                let message = take_last_panic().unwrap_or_else(|| "panic".into());
                return Err(format!("{message}\n  in step {i}: {step:?}\n{log}"));
            }
            Ok(Err(e)) if e.message.trim().is_empty() => {
                return Err(format!(
                    "an error without a message: {e:?}\n  in step {i}: {step:?}\n{log}"
                ));
            }
            Ok(Err(e)) => {
                log += &format!("{i:>3}: {step:?} -> error: {e}\n");
                continue;
            }
            Ok(Ok(results)) => results,
        };
        let types: Vec<String> = results.iter().map(|t| t.ty().to_string()).collect();
        log += &format!("{i:>3}: {step:?} -> {}\n", types.join(", "));
        for t in results {
            if let Err(e) = check_tensor(&t) {
                return Err(format!("{e}\n  made by step {i}: {step:?}\n{log}"));
            }
            if t.requires_grad() && t.is_leaf() {
                leaves.push(t.clone());
            }
            if pool.len() == POOL {
                pool.remove(0);
            }
            pool.push(t);
        }
    }
    for leaf in &leaves {
        if let Some(g) = leaf.grad() {
            if g.ty() != leaf.ty() {
                return Err(format!(
                    "a gradient {} for a leaf {}\n{log}",
                    g.ty(),
                    leaf.ty()
                ));
            }
            check_tensor(&g).map_err(|e| format!("a gradient: {e}\n{log}"))?;
        }
    }
    Ok(())
}
