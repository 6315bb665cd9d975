//! Custom ops, as users write and call them: user-defined operations that
//! eager mode, graph capture, AOT autograd and the compiler carry like
//! built-ins (PyTorch's `torch.library.custom_op` with `register_fake` and
//! `register_autograd`); see `docs/custom_ops.md`.
//!
//! An op's signature (its name and shape function) is the IR's
//! (`ir::custom`); its implementation (kernels per backend, backward) and
//! the registry that runs calls are the tensor layer's (`tensor::custom`),
//! since `Tensor::apply` dispatches every custom call there. This module is
//! their public face, with the built-in attention's user-facing call
//! ([`flash_attention`]).

pub mod flash_attention;

pub use crate::ir::custom::{Attrs, CustomCall, ShapeFn, Signature};
pub use crate::tensor::custom::{
    call, lookup, Backend, BackwardCtx, CustomBackwardFn, CustomOp, CustomOpBuilder, KernelFn,
};
