//! tessera: a deep-learning graph compiler.
//!
//! - [`ir`]: the graph IR (dtypes, shapes, ops, graphs, text form, verifier);
//! - [`tensor`]: the eager `Tensor` API;
//! - [`runtime`]: the CPU backend's kernels and the graph interpreter;
//! - [`io`]: `.npy` and safetensors files;
//! - [`nn`]: modules, parameters and losses; [`optim`]: optimizers;
//! - [`passes`]: graph rewrites and the pass manager;
//! - [`hints`]: the user's context hints; [`schedule`]: kernel orders and
//!   the memory plan;
//! - [`train`]: a complete training run on a self-checking synthetic task;
//! - [`limits`]: the size limit every tensor is held to.

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
pub mod seed_table;
pub mod tensor;
pub mod train;

pub use compile::compile;
pub use custom_op::flash_attention::{
    scaled_dot_product_attention, try_scaled_dot_product_attention, SdpaOptions,
};
pub use error::{Error, ErrorKind, Result, SourceLoc};
pub use ir::{DType, Graph};
pub use tensor::Tensor;
