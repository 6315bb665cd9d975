//! tessera: a deep-learning graph compiler.
//!
//! - [`ir`]: the graph IR (dtypes, shapes, ops, graphs, text form, verifier);
//! - [`tensor`]: the eager `Tensor` API, tracing, the autograd tape and
//!   the graph interpreter ([`tensor::interpret`]); mixed precision
//!   ([`autocast`], policy in [`tensor::autocast`]);
//! - [`autograd`]: VJP rules, the backward engine, ahead-of-time
//!   forward/backward graphs; [`custom_op`]: user-defined ops;
//! - [`runtime`]: the backends (the CPU's kernels, the device trait) and
//!   the executor of compiled plans;
//! - [`io`]: `.npy` and safetensors files;
//! - [`nn`]: modules, parameters and losses; [`optim`]: optimizers;
//! - [`passes`]: graph rewrites and the pass manager;
//! - [`hints`]: the user's context hints; [`schedule`]: kernel orders and
//!   the memory plan;
//! - [`limits`]: the size limit every tensor is held to.
//!
//! The applications built on it (the seed experiment's table, a complete
//! training run with its plot) live in the `tessera-apps` crate.

pub mod autograd;
pub mod compile;
pub mod custom_op;
pub mod error;
pub mod fusion;
pub mod hints;
pub mod io;
pub mod ir;
pub mod limits;
pub mod logging;
pub mod nn;
pub mod optim;
pub mod passes;
pub mod runtime;
pub mod schedule;
pub mod tensor;

pub use compile::compile;
pub use custom_op::flash_attention::{
    scaled_dot_product_attention, try_scaled_dot_product_attention, SdpaOptions,
};
pub use error::{Error, ErrorKind, Result, SourceLoc};
pub use ir::{DType, Graph};
pub use runtime::cpu::U8;
pub use tensor::autocast::{autocast, try_autocast};
pub use tensor::Tensor;
