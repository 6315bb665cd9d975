//! Automatic mixed precision: `tessera::autocast(DType::BF16, || …)`.
//!
//! Inside an autocast scope the op methods of [`Tensor`] cast their inputs
//! before the op, following PyTorch's autocast lists (one policy, here):
//!
//! - **low precision** (`matmul`, and `scaled_dot_product_attention` and the
//!   nn modules' projections through [`cast_low`]): f32 (and the other
//!   half type's) operands are cast to the scope's dtype, so the product
//!   runs in bf16/f16 and returns bf16/f16. The kernels accumulate in f32
//!   (the CPU multiplies half types through f32, cuBLASLt computes in
//!   `CUBLAS_COMPUTE_32F`), so only the operands and the result are
//!   rounded;
//! - **f32** (`softmax`, `log_softmax`, `sum`, `mean`, `prod`, `exp`,
//!   `log`, `rsqrt`, `reciprocal`, `pow`; the norms and losses of `nn`
//!   through [`cast_f32`]): f16/bf16 operands are cast up to f32 and the
//!   result is f32;
//! - **promote** (the binary ops, compares, `where`, `cat`): operands of
//!   different float dtypes meet in the wider one (bf16 with f16 in f32),
//!   as PyTorch's type promotion — a 0-dim operand counts only when every
//!   float operand is 0-dim, so `x_bf16 * Tensor::scalar(2.0, F32)` stays
//!   bf16. `x + linear(x)` with an f32 `x` and a bf16 `linear` is f32.
//!   Outside autocast tessera never promotes (see [`DType`]).
//!
//! f64 tensors are never cast (as in PyTorch), integers and bools neither.
//! Every other op runs in its inputs' dtype.
//!
//! The casts are ordinary [`Op::Cast`] ops: a traced function records them
//! (so the compiled graph, and the compile cache's key, differ between a
//! call inside and one outside autocast), and autograd's cast rule returns
//! f32 gradients to f32 parameters — the optimizer keeps f32 master weights
//! with no code of its own. The autograd engine runs every backward with
//! autocast [`disabled`]: backward ops take the dtypes of the forward's
//! values, whatever scope `backward()` is called in.
//!
//! The scope is per thread, nests (the innermost wins; [`disabled`] turns
//! it off inside), and is restored when the closure returns, returns early
//! or panics.

use std::cell::Cell;
use std::panic::Location;

use super::Tensor;
use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::ir::{BinaryOp, DType, Op, ReduceOp, UnaryOp};

thread_local! {
    /// The dtype of the innermost autocast scope on this thread, if any.
    static DTYPE: Cell<Option<DType>> = const { Cell::new(None) };
}

/// Runs `f` with autocast to `dtype` (bf16 or f16) on this thread, and
/// returns what it returns. Panics, at the caller's line, on another dtype
/// (see [`try_autocast`]).
#[track_caller]
pub fn autocast<R>(dtype: DType, f: impl FnOnce() -> R) -> R {
    match try_autocast(dtype, f) {
        Ok(r) => r,
        Err(e) => panic!("{e}"),
    }
}

/// [`autocast`], returning an error (before running `f`) when `dtype` is
/// not a low-precision float.
#[track_caller]
pub fn try_autocast<R>(dtype: DType, f: impl FnOnce() -> R) -> Result<R> {
    if !matches!(dtype, DType::BF16 | DType::F16) {
        return Err(Error::op(
            ErrorKind::DType,
            "autocast",
            format!("runs in bf16 or f16, got {dtype}"),
        )
        .at(SourceLoc::caller()));
    }
    let _scope = Scope::enter(Some(dtype));
    Ok(f())
}

/// Runs `f` with autocast off on this thread (inside an autocast scope: a
/// region that must run in its inputs' dtypes).
pub fn disabled<R>(f: impl FnOnce() -> R) -> R {
    let _scope = Scope::enter(None);
    f()
}

/// The dtype autocast casts to on this thread, `None` outside a scope.
pub fn current() -> Option<DType> {
    DTYPE.with(Cell::get)
}

/// Whether this thread is inside an autocast scope.
pub fn is_enabled() -> bool {
    current().is_some()
}

/// Sets the scope's dtype and puts the outer one back when dropped (also
/// on a panic or an early return out of the scope).
struct Scope(Option<DType>);

impl Scope {
    fn enter(dtype: Option<DType>) -> Scope {
        Scope(DTYPE.with(|d| d.replace(dtype)))
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        DTYPE.with(|d| d.set(self.0));
    }
}

/// What autocast does to an op's float inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Policy {
    /// Cast to the scope's dtype.
    Low,
    /// Cast half types up to f32.
    F32,
    /// Cast to the widest float dtype among the operands.
    Promote,
}

fn policy(op: &Op) -> Option<Policy> {
    Some(match op {
        Op::MatMul | Op::MatMulT { .. } => Policy::Low,
        Op::Softmax { .. } | Op::LogSoftmax { .. } => Policy::F32,
        Op::Reduce {
            op: ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Prod,
            ..
        } => Policy::F32,
        Op::Unary(UnaryOp::Exp | UnaryOp::Log | UnaryOp::Rsqrt | UnaryOp::Reciprocal) => {
            Policy::F32
        }
        Op::Binary(BinaryOp::Pow) => Policy::F32,
        Op::Binary(_) | Op::Compare(_) | Op::Where | Op::Cat { .. } => Policy::Promote,
        _ => return None,
    })
}

/// Whether a low-precision op casts a tensor of dtype `d` to `to`: floats
/// other than f64 (PyTorch's eligibility rule).
fn casts_down(d: DType, to: DType) -> bool {
    d.is_float() && d != DType::F64 && d != to
}

fn is_half(d: DType) -> bool {
    matches!(d, DType::BF16 | DType::F16)
}

/// The wider of two float dtypes: f64 over f32 over the half types; bf16
/// and f16 meet in f32 (neither holds the other).
fn wider(a: DType, b: DType) -> DType {
    match (a, b) {
        _ if a == b => a,
        (DType::F64, _) | (_, DType::F64) => DType::F64,
        _ => DType::F32,
    }
}

/// The dtype promoted operands meet in, when their float dtypes differ.
fn promoted(inputs: &[&Tensor]) -> Option<DType> {
    let floats = || inputs.iter().filter(|t| t.dtype().is_float());
    let dimensioned = floats().any(|t| t.rank() > 0);
    let to = floats()
        .filter(|t| !dimensioned || t.rank() > 0)
        .map(|t| t.dtype())
        .reduce(wider)?;
    floats().any(|t| t.dtype() != to).then_some(to)
}

/// The inputs `op` runs on inside the current scope: `None` when autocast
/// is off or changes nothing (the common case costs one thread-local read),
/// else the inputs with the policy's casts applied (recorded at `caller`).
pub(crate) fn cast_inputs(
    op: &Op,
    inputs: &[&Tensor],
    caller: &'static Location<'static>,
) -> Result<Option<Vec<Tensor>>> {
    let Some(scope) = current() else {
        return Ok(None);
    };
    let Some(policy) = policy(op) else {
        return Ok(None);
    };
    let target = |d: DType| -> Option<DType> {
        match policy {
            Policy::Low => casts_down(d, scope).then_some(scope),
            Policy::F32 => is_half(d).then_some(DType::F32),
            Policy::Promote => None,
        }
    };
    let promote_to = match policy {
        Policy::Promote => promoted(inputs),
        _ => None,
    };
    let to_of = |t: &Tensor| match promote_to {
        Some(to) => (t.dtype().is_float() && t.dtype() != to).then_some(to),
        None => target(t.dtype()),
    };
    if inputs.iter().all(|t| to_of(t).is_none()) {
        return Ok(None);
    }
    inputs
        .iter()
        .map(|t| match to_of(t) {
            Some(to) => Tensor::apply(&Op::Cast(to), &[t], caller),
            None => Ok((*t).clone()),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// `t` as a low-precision op takes it in the current scope: cast to the
/// scope's dtype when autocast is on and `t` is an eligible float (not f64),
/// else `t` itself. For ops that autocast runs in low precision but that are
/// not single IR ops (attention, a linear layer's bias).
#[track_caller]
pub fn cast_low(t: &Tensor) -> Result<Tensor> {
    match current() {
        Some(to) if casts_down(t.dtype(), to) => t.try_cast(to),
        _ => Ok(t.clone()),
    }
}

/// `t` as an f32 op takes it in the current scope: f16/bf16 cast up to f32
/// when autocast is on, else `t` itself. For the norms and losses, which
/// autocast runs in f32.
#[track_caller]
pub fn cast_f32(t: &Tensor) -> Result<Tensor> {
    match current() {
        Some(_) if is_half(t.dtype()) => t.try_cast(DType::F32),
        _ => Ok(t.clone()),
    }
}

/// The dtype [`cast_f32`] gives a tensor of `dtype` in the current scope
/// (for an op that computes in f32 itself and casts only its result).
pub fn f32_dtype(dtype: DType) -> DType {
    match current() {
        Some(_) if is_half(dtype) => DType::F32,
        _ => dtype,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(dtype: DType, shape: &[usize]) -> Tensor {
        Tensor::zeros(shape, dtype)
    }

    #[test]
    fn scopes_nest_and_restore() {
        assert_eq!(current(), None);
        autocast(DType::BF16, || {
            assert_eq!(current(), Some(DType::BF16));
            autocast(DType::F16, || assert_eq!(current(), Some(DType::F16)));
            assert_eq!(current(), Some(DType::BF16));
            disabled(|| assert_eq!(current(), None));
            assert_eq!(current(), Some(DType::BF16));
        });
        assert_eq!(current(), None);
    }

    #[test]
    fn a_panic_inside_restores_the_outer_scope() {
        autocast(DType::F16, || {
            let caught = std::panic::catch_unwind(|| autocast(DType::BF16, || panic!("inside")));
            assert!(caught.is_err());
            assert_eq!(current(), Some(DType::F16));
        });
        assert_eq!(current(), None);
    }

    #[test]
    fn only_half_types_open_a_scope() {
        for d in [DType::F32, DType::F64, DType::I64, DType::Bool] {
            let e = try_autocast(d, || ()).unwrap_err();
            assert_eq!(e.kind, ErrorKind::DType);
            assert!(
                e.to_string().contains(&format!("bf16 or f16, got {d}")),
                "{e}"
            );
            assert!(e.to_string().contains("autocast.rs"), "names the line: {e}");
        }
        assert_eq!(current(), None);
    }

    #[test]
    fn promotion_follows_pytorch() {
        let (bf, h, f, d) = (DType::BF16, DType::F16, DType::F32, DType::F64);
        assert_eq!(promoted(&[&t(bf, &[2]), &t(f, &[2])]), Some(f));
        assert_eq!(promoted(&[&t(bf, &[2]), &t(h, &[2])]), Some(f));
        assert_eq!(promoted(&[&t(f, &[2]), &t(d, &[2])]), Some(d));
        assert_eq!(promoted(&[&t(bf, &[2]), &t(bf, &[2])]), None);
        // A 0-dim operand does not widen a dimensioned one …
        assert_eq!(promoted(&[&t(bf, &[2]), &t(f, &[])]), Some(bf));
        // … but 0-dim operands alone promote among themselves.
        assert_eq!(promoted(&[&t(bf, &[]), &t(f, &[])]), Some(f));
        // Non-floats (a where's condition) take no part.
        assert_eq!(
            promoted(&[&t(DType::Bool, &[2]), &t(bf, &[2]), &t(f, &[2])]),
            Some(f)
        );
    }

    #[test]
    fn nothing_is_cast_outside_a_scope_or_for_other_ops() {
        let (a, b) = (t(DType::F32, &[2, 2]), t(DType::F32, &[2, 2]));
        let at = Location::caller();
        assert!(cast_inputs(&Op::MatMul, &[&a, &b], at).unwrap().is_none());
        autocast(DType::BF16, || {
            let cast = cast_inputs(&Op::MatMul, &[&a, &b], at).unwrap().unwrap();
            assert!(cast.iter().all(|c| c.dtype() == DType::BF16));
            let relu = Op::Unary(UnaryOp::Relu);
            assert!(cast_inputs(&relu, &[&a], at).unwrap().is_none());
            let f64s = t(DType::F64, &[2, 2]);
            assert!(cast_inputs(&Op::MatMul, &[&f64s, &f64s], at)
                .unwrap()
                .is_none());
        });
    }
}
