//! Autograd: one VJP rule per op ([`rules`]), applied by the eager engine
//! when it walks the tape back (`Tensor::backward`, [`grad`]) and — by
//! running the same engine on traced tensors — by the ahead-of-time
//! forward/backward graphs ([`aot`]).
//!
//! The tape itself (what ops record, the grad mode, custom functions) is
//! the tensor layer's (`tensor::tape`); its public items are re-exported
//! here.

pub mod aot;
mod engine;
mod mincut;
pub mod rules;

pub use crate::tensor::tape::{
    backward_consumes, custom_function, custom_function_at, enable_grad, is_grad_enabled, no_grad,
    BackwardFn,
};
pub use aot::{
    aot_autograd, aot_autograd_choosing, AotGraphs, Partition, SaveChoice, SavedAs, SavedCandidate,
};
pub use engine::grad;
