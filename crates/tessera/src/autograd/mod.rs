//! Autograd: one VJP rule per op ([`rules`]), used by eager `backward()`
//! and — by running backward on traced tensors — by the ahead-of-time
//! forward/backward graphs.

mod engine;
pub mod rules;

pub use engine::{is_grad_enabled, no_grad};
pub(crate) use engine::{record, AutogradMeta};
