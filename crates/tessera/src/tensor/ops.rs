//! The op methods of `Tensor`, PyTorch-named.
//!
//! Every op `foo` comes as `foo` (panics with the error, at the user's line)
//! and `try_foo` (returns the error). Dims are `isize` and may be negative
//! (`-1` is the last dim). Each method lowers to IR ops through
//! [`Tensor::apply`], so eager and captured code share one definition.

use std::panic::Location;

use super::{unwrap_or_panic, Tensor};
use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::ir::{ArgReduceOp, BinaryOp, CompareOp, DType, Dim, Op, ReduceOp, Shape, UnaryOp};

/// The second operand of a binary op: a tensor or a scalar. A scalar becomes
/// a 0-dim tensor of the other operand's dtype.
/// A scalar that the dtype cannot hold (NaN or 1e30 against an integer
/// tensor) is the op's error, as any other bad argument.
pub trait Operand {
    fn into_operand(self, like: &Tensor) -> Result<Tensor>;
}

impl Operand for &Tensor {
    fn into_operand(self, _: &Tensor) -> Result<Tensor> {
        Ok(self.clone())
    }
}

impl Operand for Tensor {
    fn into_operand(self, _: &Tensor) -> Result<Tensor> {
        Ok(self)
    }
}

macro_rules! scalar_operand {
    ($($t:ty),*) => {$(
        impl Operand for $t {
            #[track_caller]
            fn into_operand(self, like: &Tensor) -> Result<Tensor> {
                Tensor::try_full(&[], self as f64, like.dtype())
            }
        }
    )*};
}
scalar_operand!(f64, f32, i64, i32, usize);

/// Runs one IR op with the caller's location, on its inputs as the
/// autocast scope in force casts them (see [`super::autocast`]).
#[track_caller]
fn run(op: Op, inputs: &[&Tensor]) -> Result<Tensor> {
    let caller = Location::caller();
    match super::autocast::cast_inputs(&op, inputs, caller)? {
        Some(cast) => {
            let cast: Vec<&Tensor> = cast.iter().collect();
            Tensor::apply(&op, &cast, caller)
        }
        None => Tensor::apply(&op, inputs, caller),
    }
}

#[track_caller]
fn arg_error(op: &str, message: String) -> Error {
    Error::op(ErrorKind::Argument, op, message).at(SourceLoc::caller())
}

/// Normalises a possibly negative dim against `rank`.
#[track_caller]
pub(crate) fn norm_dim(op: &str, dim: isize, rank: usize) -> Result<usize> {
    let d = if dim < 0 { dim + rank as isize } else { dim };
    if d < 0 || d as usize >= rank.max(1) {
        return Err(arg_error(
            op,
            format!("dim {dim} is out of range for a tensor of rank {rank}"),
        ));
    }
    Ok(d as usize)
}

/// `tensor_split` makes at most this many parts, or one per element of
/// a larger dim.
const MAX_EMPTY_PARTS: usize = 1 << 16;

/// [`norm_dim`] for ops that index the shape at `dim` (slicing,
/// splitting, concatenating, indexing): a 0-dim tensor has no dim to index.
#[track_caller]
fn norm_indexed_dim(op: &str, dim: isize, rank: usize) -> Result<usize> {
    if rank == 0 {
        return Err(arg_error(
            op,
            format!("cannot be applied to a 0-dim tensor (dim {dim})"),
        ));
    }
    norm_dim(op, dim, rank)
}

#[track_caller]
fn norm_dims(op: &str, dims: &[isize], rank: usize) -> Result<Vec<usize>> {
    let mut out = dims
        .iter()
        .map(|&d| norm_dim(op, d, rank))
        .collect::<Result<Vec<_>>>()?;
    out.sort_unstable();
    if out.windows(2).any(|w| w[0] == w[1]) {
        return Err(arg_error(
            op,
            format!("dims {dims:?} name the same dim twice"),
        ));
    }
    Ok(out)
}

/// Generates `foo` (panicking) and `try_foo` (Result) from one body.
macro_rules! tensor_ops {
    ($(
        $(#[$meta:meta])*
        fn $name:ident / $try_name:ident (&$self:ident $(, $arg:ident : $ty:ty)*) $body:block
    )*) => {
        impl Tensor {$(
            $(#[$meta])*
            #[track_caller]
            pub fn $name(&$self $(, $arg: $ty)*) -> Tensor {
                unwrap_or_panic($self.$try_name($($arg),*))
            }

            #[doc = concat!("[`Tensor::", stringify!($name), "`], returning the error instead of panicking.")]
            #[track_caller]
            pub fn $try_name(&$self $(, $arg: $ty)*) -> Result<Tensor> $body
        )*}
    };
}

macro_rules! unary_ops {
    ($($name:ident / $try_name:ident => $op:ident),* $(,)?) => {
        tensor_ops! {$(
            #[doc = concat!("Elementwise `", stringify!($name), "`.")]
            fn $name / $try_name(&self) { run(Op::Unary(UnaryOp::$op), &[self]) }
        )*}
    };
}

unary_ops! {
    neg / try_neg => Neg,
    abs / try_abs => Abs,
    exp / try_exp => Exp,
    log / try_log => Log,
    sqrt / try_sqrt => Sqrt,
    rsqrt / try_rsqrt => Rsqrt,
    reciprocal / try_reciprocal => Reciprocal,
    sin / try_sin => Sin,
    cos / try_cos => Cos,
    tanh / try_tanh => Tanh,
    sigmoid / try_sigmoid => Sigmoid,
    relu / try_relu => Relu,
    gelu / try_gelu => Gelu,
    gelu_tanh / try_gelu_tanh => GeluTanh,
    silu / try_silu => Silu,
    atan / try_atan => Atan,
    asin / try_asin => Asin,
    acos / try_acos => Acos,
    bitwise_not / try_bitwise_not => BitNot,
}

macro_rules! binary_ops {
    ($($name:ident / $try_name:ident => $op:expr),* $(,)?) => {
        tensor_ops! {$(
            #[doc = concat!("Elementwise `", stringify!($name), "` with NumPy broadcasting; `other` is a tensor or a scalar.")]
            fn $name / $try_name(&self, other: impl Operand) {
                let other = other.into_operand(self)?;
                run($op, &[self, &other])
            }
        )*}
    };
}

binary_ops! {
    add / try_add => Op::Binary(BinaryOp::Add),
    sub / try_sub => Op::Binary(BinaryOp::Sub),
    mul / try_mul => Op::Binary(BinaryOp::Mul),
    div / try_div => Op::Binary(BinaryOp::Div),
    pow / try_pow => Op::Binary(BinaryOp::Pow),
    maximum / try_maximum => Op::Binary(BinaryOp::Maximum),
    minimum / try_minimum => Op::Binary(BinaryOp::Minimum),
    bitwise_and / try_bitwise_and => Op::Binary(BinaryOp::BitAnd),
    bitwise_or / try_bitwise_or => Op::Binary(BinaryOp::BitOr),
    bitwise_xor / try_bitwise_xor => Op::Binary(BinaryOp::BitXor),
    shift_left / try_shift_left => Op::Binary(BinaryOp::Shl),
    shift_right / try_shift_right => Op::Binary(BinaryOp::Shr),
    eq / try_eq => Op::Compare(CompareOp::Eq),
    ne / try_ne => Op::Compare(CompareOp::Ne),
    lt / try_lt => Op::Compare(CompareOp::Lt),
    le / try_le => Op::Compare(CompareOp::Le),
    gt / try_gt => Op::Compare(CompareOp::Gt),
    ge / try_ge => Op::Compare(CompareOp::Ge),
}

macro_rules! reduce_ops {
    ($($name:ident / $try_name:ident => $op:ident),* $(,)?) => {
        tensor_ops! {$(
            #[doc = concat!("`", stringify!($name), "` over `dims` (empty: all dims), keeping them as size 1 with `keepdim`.")]
            fn $name / $try_name(&self, dims: &[isize], keepdim: bool) {
                let dims = if dims.is_empty() {
                    (0..self.rank()).collect()
                } else {
                    norm_dims(stringify!($name), dims, self.rank())?
                };
                run(Op::Reduce { op: ReduceOp::$op, dims, keepdim }, &[self])
            }
        )*}
    };
}

reduce_ops! {
    sum / try_sum => Sum,
    mean / try_mean => Mean,
    max / try_max => Max,
    min / try_min => Min,
    prod / try_prod => Prod,
}

tensor_ops! {
    /// The same values as `dtype`.
    fn cast / try_cast(&self, dtype: DType) { run(Op::Cast(dtype), &[self]) }
    /// The same bits read as `dtype`, which has the same width (`f32` ↔
    /// `i32` …).
    fn bitcast / try_bitcast(&self, dtype: DType) { run(Op::BitCast(dtype), &[self]) }

    /// Index of the largest value along `dim` (first on ties), as i64.
    fn argmax / try_argmax(&self, dim: isize, keepdim: bool) {
        let dim = norm_dim("argmax", dim, self.rank())?;
        run(Op::ArgReduce { op: ArgReduceOp::ArgMax, dim, keepdim }, &[self])
    }

    /// Index of the smallest value along `dim` (first on ties), as i64.
    fn argmin / try_argmin(&self, dim: isize, keepdim: bool) {
        let dim = norm_dim("argmin", dim, self.rank())?;
        run(Op::ArgReduce { op: ArgReduceOp::ArgMin, dim, keepdim }, &[self])
    }

    /// Softmax along `dim` (max-subtracted).
    fn softmax / try_softmax(&self, dim: isize) {
        let dim = norm_dim("softmax", dim, self.rank())?;
        run(Op::Softmax { dim }, &[self])
    }

    /// Log-softmax along `dim` (max-subtracted).
    fn log_softmax / try_log_softmax(&self, dim: isize) {
        let dim = norm_dim("log_softmax", dim, self.rank())?;
        run(Op::LogSoftmax { dim }, &[self])
    }

    /// Matrix product like `torch.matmul` (batched, broadcasting, 1-D promoted).
    fn matmul / try_matmul(&self, other: &Tensor) { run(Op::MatMul, &[self, other]) }

    /// Same elements, new shape; one dim may be `-1` (inferred). A view when
    /// the layout allows, else a copy.
    fn reshape / try_reshape(&self, shape: &[isize]) {
        let shape = infer_reshape("reshape", self, shape)?;
        run(Op::Reshape(Shape::from_concrete(&shape)), &[self])
    }

    /// Like `reshape`, but an error when the result cannot be a view.
    fn view / try_view(&self, shape: &[isize]) {
        let shape = infer_reshape("view", self, shape)?;
        if self.layout().reshaped(&shape).is_none() {
            return Err(arg_error("view", format!(
                "{} with strides {:?} cannot be viewed as {:?}; use reshape (copies)",
                self.ty(), self.strides(), shape
            )));
        }
        run(Op::Reshape(Shape::from_concrete(&shape)), &[self])
    }

    /// Dims `start..=end` merged into one.
    fn flatten / try_flatten(&self, start: isize, end: isize) {
        let rank = self.rank();
        if rank == 0 {
            return self.try_reshape(&[1]);
        }
        let (s, e) = (norm_dim("flatten", start, rank)?, norm_dim("flatten", end, rank)?);
        if s > e {
            return Err(arg_error("flatten", format!("start dim {start} comes after end dim {end}")));
        }
        let dims = self.shape();
        let mut shape: Vec<usize> = dims[..s].to_vec();
        shape.push(dims[s..=e].iter().product());
        shape.extend_from_slice(&dims[e + 1..]);
        run(Op::Reshape(Shape::from_concrete(&shape)), &[self])
    }

    /// A new size-1 dim at `dim` (`-1` appends).
    fn unsqueeze / try_unsqueeze(&self, dim: isize) {
        let d = norm_dim("unsqueeze", dim, self.rank() + 1)?;
        let mut shape = self.shape().to_vec();
        shape.insert(d, 1);
        run(Op::Reshape(Shape::from_concrete(&shape)), &[self])
    }

    /// Removes `dim` if it has size 1 (else returns the same shape, as torch).
    fn squeeze / try_squeeze(&self, dim: isize) {
        let d = norm_dim("squeeze", dim, self.rank())?;
        let mut shape = self.shape().to_vec();
        if shape.get(d) == Some(&1) {
            shape.remove(d);
        }
        run(Op::Reshape(Shape::from_concrete(&shape)), &[self])
    }

    /// Removes every size-1 dim.
    fn squeeze_all / try_squeeze_all(&self) {
        let shape: Vec<usize> = self.shape().iter().copied().filter(|&s| s != 1).collect();
        run(Op::Reshape(Shape::from_concrete(&shape)), &[self])
    }

    /// Dims reordered: output dim i is input dim `perm[i]`. A view.
    fn permute / try_permute(&self, perm: &[isize]) {
        if perm.len() != self.rank() {
            return Err(arg_error("permute", format!("{perm:?} does not list the {} dims of {}", self.rank(), self.ty())));
        }
        let perm = perm.iter().map(|&d| norm_dim("permute", d, self.rank())).collect::<Result<Vec<_>>>()?;
        run(Op::Permute(perm), &[self])
    }

    /// Dims `a` and `b` swapped. A view.
    fn transpose / try_transpose(&self, a: isize, b: isize) {
        let (a, b) = (norm_indexed_dim("transpose", a, self.rank())?, norm_indexed_dim("transpose", b, self.rank())?);
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        run(Op::Permute(perm), &[self])
    }

    /// The last two dims swapped (a 1-D tensor is returned as is).
    fn t / try_t(&self) {
        if self.rank() < 2 {
            return Ok(self.clone());
        }
        self.try_transpose(-2, -1)
    }

    /// Broadcast to `shape` (`-1` keeps a dim). A view.
    fn expand / try_expand(&self, shape: &[isize]) {
        let lead = shape.len().checked_sub(self.rank()).ok_or_else(|| {
            arg_error("expand", format!("{} has more dims than the target {shape:?}", self.ty()))
        })?;
        let target = shape.iter().enumerate().map(|(i, &s)| match s {
            -1 if i >= lead => Ok(self.shape()[i - lead]),
            s if s >= 0 => Ok(s as usize),
            _ => Err(arg_error("expand", format!("bad size {s} in {shape:?}"))),
        }).collect::<Result<Vec<_>>>()?;
        run(Op::Expand(Shape::from_concrete(&target)), &[self])
    }

    /// Broadcast to `shape`. A view.
    fn broadcast_to / try_broadcast_to(&self, shape: &[usize]) {
        run(Op::Expand(Shape::from_concrete(shape)), &[self])
    }

    /// Python-style slice `start:end:step` along `dim` (negative bounds count
    /// from the end, bounds are clamped; `step` must be positive). A view.
    fn slice / try_slice(&self, dim: isize, start: isize, end: isize, step: usize) {
        let d = norm_indexed_dim("slice", dim, self.rank())?;
        if step == 0 {
            return Err(arg_error("slice", "step must be positive".into()));
        }
        let size = self.shape()[d] as isize;
        let clamp = |i: isize| (if i < 0 { i + size } else { i }).clamp(0, size) as usize;
        let (start, end) = (clamp(start), clamp(end).max(clamp(start)));
        run(Op::Slice { dim: d, start, end: Dim::Const(end), step }, &[self])
    }

    /// `len` elements from `start` along `dim`. A view.
    fn narrow / try_narrow(&self, dim: isize, start: usize, len: usize) {
        let d = norm_indexed_dim("narrow", dim, self.rank())?;
        run(Op::Slice { dim: d, start, end: Dim::Const(start + len), step: 1 }, &[self])
    }

    /// A row-major dense copy (or the tensor itself if already one).
    fn contiguous / try_contiguous(&self) { run(Op::Contiguous, &[self]) }

    /// Zeros above diagonal `diagonal` of the last two dims.
    fn tril / try_tril(&self, diagonal: i64) { run(Op::Tril { diagonal }, &[self]) }

    /// Zeros below diagonal `diagonal` of the last two dims.
    fn triu / try_triu(&self, diagonal: i64) { run(Op::Triu { diagonal }, &[self]) }

    /// Entries along `dim` picked by the 1-D i64/i32 `index`.
    fn index_select / try_index_select(&self, dim: isize, index: &Tensor) {
        let dim = norm_indexed_dim("index_select", dim, self.rank())?;
        run(Op::IndexSelect { dim }, &[self, index])
    }

    /// `torch.gather`: `out[i][j] = self[index[i][j]][j]` for dim 0.
    fn gather / try_gather(&self, dim: isize, index: &Tensor) {
        let dim = norm_indexed_dim("gather", dim, self.rank())?;
        run(Op::Gather { dim }, &[self, index])
    }

    /// `torch.index_add`: `src`'s slices along `dim` added at `index`.
    fn index_add / try_index_add(&self, dim: isize, index: &Tensor, src: &Tensor) {
        let dim = norm_indexed_dim("index_add", dim, self.rank())?;
        run(Op::IndexAdd { dim }, &[self, index, src])
    }

    /// `torch.scatter_add`: `out[index[i][j]][j] += src[i][j]` for dim 0.
    fn scatter_add / try_scatter_add(&self, dim: isize, index: &Tensor, src: &Tensor) {
        let dim = norm_indexed_dim("scatter_add", dim, self.rank())?;
        run(Op::ScatterAdd { dim }, &[self, index, src])
    }

    /// Rows of this `[vocab, d]` table for each id of `ids` (any shape, i64/i32):
    /// the result has shape `ids.shape + [d]`.
    fn embedding / try_embedding(&self, ids: &Tensor) {
        if self.rank() != 2 {
            return Err(arg_error("embedding", format!("the table must be 2-D, got {}", self.ty())));
        }
        let flat = ids.try_reshape(&[-1])?;
        let rows = run(Op::IndexSelect { dim: 0 }, &[self, &flat])?;
        let mut shape: Vec<isize> = ids.shape().iter().map(|&s| s as isize).collect();
        shape.push(self.shape()[1] as isize);
        rows.try_reshape(&shape)
    }
}

/// Resolves a `-1` in a reshape target.
#[track_caller]
fn infer_reshape(op: &str, x: &Tensor, shape: &[isize]) -> Result<Vec<usize>> {
    let numel = x.numel();
    let given: Vec<usize> = shape
        .iter()
        .filter(|&&s| s >= 0)
        .map(|&s| s as usize)
        .collect();
    // Checked: a product past the size limit cannot equal `numel`.
    let known = crate::limits::numel(&given);
    let holes = shape.iter().filter(|&&s| s == -1).count();
    let bad = shape.iter().any(|&s| s < -1) || holes > 1 || known.is_none();
    let fill = match known {
        Some(k) if holes == 1 && k > 0 && numel.is_multiple_of(k) => numel / k,
        _ => 0,
    };
    let out: Vec<usize> = shape
        .iter()
        .map(|&s| if s == -1 { fill } else { s as usize })
        .collect();
    if bad || crate::limits::numel(&out) != Some(numel) {
        return Err(Error::op(
            ErrorKind::Shape,
            op,
            format!("cannot reshape {} ({numel} elements) to {shape:?}", x.ty()),
        )
        .at(SourceLoc::caller()));
    }
    Ok(out)
}

/// Joining and splitting.
impl Tensor {
    /// `tensors` joined along `dim`.
    #[track_caller]
    pub fn cat(tensors: &[&Tensor], dim: isize) -> Tensor {
        unwrap_or_panic(Tensor::try_cat(tensors, dim))
    }

    #[track_caller]
    pub fn try_cat(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let first = tensors
            .first()
            .ok_or_else(|| arg_error("cat", "needs at least one tensor".into()))?;
        let dim = norm_indexed_dim("cat", dim, first.rank())?;
        run(Op::Cat { dim }, tensors)
    }

    /// `tensors` (all the same shape) stacked along a new dim `dim`.
    #[track_caller]
    pub fn stack(tensors: &[&Tensor], dim: isize) -> Tensor {
        unwrap_or_panic(Tensor::try_stack(tensors, dim))
    }

    #[track_caller]
    pub fn try_stack(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let first = tensors
            .first()
            .ok_or_else(|| arg_error("stack", "needs at least one tensor".into()))?;
        if let Some(t) = tensors.iter().find(|t| t.shape() != first.shape()) {
            return Err(Error::op(
                ErrorKind::Shape,
                "stack",
                format!(
                    "all tensors must have the same shape, got {} and {}",
                    first.ty(),
                    t.ty()
                ),
            )
            .at(SourceLoc::caller()));
        }
        let d = norm_dim("stack", dim, first.rank() + 1)?;
        let expanded = tensors
            .iter()
            .map(|t| t.try_unsqueeze(d as isize))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor> = expanded.iter().collect();
        run(Op::Cat { dim: d }, &refs)
    }

    /// `torch.tensor_split(x, n, dim)`: `n` parts whose sizes differ by at
    /// most one (the first `size % n` parts are one longer). Views.
    #[track_caller]
    pub fn tensor_split(&self, n: usize, dim: isize) -> Vec<Tensor> {
        unwrap_or_panic_vec(self.try_tensor_split(n, dim))
    }

    #[track_caller]
    pub fn try_tensor_split(&self, n: usize, dim: isize) -> Result<Vec<Tensor>> {
        if n == 0 {
            return Err(arg_error(
                "tensor_split",
                "the number of parts must be at least 1".into(),
            ));
        }
        let d = norm_indexed_dim("tensor_split", dim, self.rank())?;
        let size = self.shape()[d];
        // Parts past the size are empty; a bound keeps a huge `n` from
        // asking for a list of parts no memory holds.
        let most = size.max(MAX_EMPTY_PARTS);
        if n > most {
            return Err(arg_error(
                "tensor_split",
                format!("{n} parts of a dim of size {size}: at most {most} parts"),
            ));
        }
        let sizes: Vec<usize> = (0..n)
            .map(|i| size / n + usize::from(i < size % n))
            .collect();
        self.split_at_sizes("tensor_split", d, &sizes)
    }

    /// `torch.chunk`: parts of `ceil(size / n)` (the last may be smaller;
    /// fewer than `n` parts when the size does not allow `n`). Views.
    #[track_caller]
    pub fn chunk(&self, n: usize, dim: isize) -> Vec<Tensor> {
        unwrap_or_panic_vec(self.try_chunk(n, dim))
    }

    #[track_caller]
    pub fn try_chunk(&self, n: usize, dim: isize) -> Result<Vec<Tensor>> {
        if n == 0 {
            return Err(arg_error(
                "chunk",
                "the number of chunks must be at least 1".into(),
            ));
        }
        let d = norm_indexed_dim("chunk", dim, self.rank())?;
        let size = self.shape()[d];
        self.try_split(size.div_ceil(n).max(1), dim)
    }

    /// `torch.split` with one part size (the last part may be smaller). Views.
    #[track_caller]
    pub fn split(&self, part: usize, dim: isize) -> Vec<Tensor> {
        unwrap_or_panic_vec(self.try_split(part, dim))
    }

    #[track_caller]
    pub fn try_split(&self, part: usize, dim: isize) -> Result<Vec<Tensor>> {
        if part == 0 {
            return Err(arg_error(
                "split",
                "the part size must be at least 1".into(),
            ));
        }
        let d = norm_indexed_dim("split", dim, self.rank())?;
        let size = self.shape()[d];
        let sizes: Vec<usize> = (0..size)
            .step_by(part)
            .map(|s| part.min(size - s))
            .collect();
        self.split_at_sizes("split", d, &sizes)
    }

    /// `torch.split` with explicit part sizes, which must sum to the dim. Views.
    #[track_caller]
    pub fn split_sizes(&self, sizes: &[usize], dim: isize) -> Vec<Tensor> {
        unwrap_or_panic_vec(self.try_split_sizes(sizes, dim))
    }

    #[track_caller]
    pub fn try_split_sizes(&self, sizes: &[usize], dim: isize) -> Result<Vec<Tensor>> {
        let d = norm_indexed_dim("split", dim, self.rank())?;
        if sizes.iter().sum::<usize>() != self.shape()[d] {
            return Err(Error::op(
                ErrorKind::Shape,
                "split",
                format!("sizes {sizes:?} do not add up to dim {d} of {}", self.ty()),
            )
            .at(SourceLoc::caller()));
        }
        self.split_at_sizes("split", d, sizes)
    }

    #[track_caller]
    fn split_at_sizes(&self, _op: &str, dim: usize, sizes: &[usize]) -> Result<Vec<Tensor>> {
        let mut start = 0;
        sizes
            .iter()
            .map(|&len| {
                let part = run(
                    Op::Slice {
                        dim,
                        start,
                        end: Dim::Const(start + len),
                        step: 1,
                    },
                    &[self],
                );
                start += len;
                part
            })
            .collect()
    }

    /// `torch.where(cond, a, b)`: `a` where `cond` (bool) holds, else `b`.
    #[track_caller]
    pub fn where_(cond: &Tensor, a: &Tensor, b: &Tensor) -> Tensor {
        unwrap_or_panic(Tensor::try_where(cond, a, b))
    }

    #[track_caller]
    pub fn try_where(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        run(Op::Where, &[cond, a, b])
    }
}

#[track_caller]
fn unwrap_or_panic_vec(r: Result<Vec<Tensor>>) -> Vec<Tensor> {
    match r {
        Ok(t) => t,
        Err(e) => panic!("{e}"),
    }
}

macro_rules! operator {
    ($trait:ident, $method:ident, $op:ident) => {
        impl<R: Operand> std::ops::$trait<R> for &Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: R) -> Tensor {
                self.$op(rhs)
            }
        }
        impl<R: Operand> std::ops::$trait<R> for Tensor {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: R) -> Tensor {
                (&self).$op(rhs)
            }
        }
        impl std::ops::$trait<&Tensor> for f64 {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: &Tensor) -> Tensor {
                Tensor::scalar(self, rhs.dtype()).$op(rhs)
            }
        }
        impl std::ops::$trait<Tensor> for f64 {
            type Output = Tensor;
            #[track_caller]
            fn $method(self, rhs: Tensor) -> Tensor {
                Tensor::scalar(self, rhs.dtype()).$op(&rhs)
            }
        }
    };
}

operator!(Add, add, add);
operator!(Sub, sub, sub);
operator!(Mul, mul, mul);
operator!(Div, div, div);

impl std::ops::Neg for &Tensor {
    type Output = Tensor;
    #[track_caller]
    fn neg(self) -> Tensor {
        Tensor::neg(self)
    }
}

impl std::ops::Neg for Tensor {
    type Output = Tensor;
    #[track_caller]
    fn neg(self) -> Tensor {
        Tensor::neg(&self)
    }
}
