//! Autograd: one VJP rule per op ([`rules`]), used by eager `backward()`
//! and — by running the same engine on traced tensors — by the ahead-of-time
//! forward/backward graphs ([`aot`]).

pub mod aot;
mod engine;
mod mincut;
pub mod rules;

pub use aot::{aot_autograd, AotGraphs, Partition};
pub use engine::{custom_function, custom_function_at, grad, is_grad_enabled, no_grad, BackwardFn};
pub(crate) use engine::{record, AutogradMeta};
