//! Kernel descriptions: what fusion produces and every backend compiles,
//! as plain data.
//!
//! - [`FusedKernel`]: a list of pointwise [`Step`]s over one shape, its
//!   outputs and its block size (`fused`);
//! - [`RowKernel`]: reductions along the last dim with their pointwise
//!   producers and consumers, as [`RowStep`]s over rows (`rows`);
//! - [`slots`]: the one register allocator both kernels' evaluations use
//!   ([`FusedRegisters`], [`RowRegisters`]).
//!
//! A description is data: what a kernel computes, and the few choices of
//! how that are plain arithmetic over it (the block size the CPU evaluates
//! a fused kernel by, the register slot of each value). Nothing here knows
//! a backend: the CPU runs the descriptions in `runtime::cpu::{fused,
//! rows}` (their `run` methods are defined there), and tessera-cuda
//! generates CUDA C from them (a C variable per step, which NVRTC gives
//! registers). Steps are numbered, each reading only earlier steps, so a
//! kernel is a small SSA program; [`FusedKernel::check`] and
//! [`RowKernel::check`] say whether a hand-built one keeps the rules the
//! backends rely on.

mod fused;
mod rows;
pub mod slots;

pub use fused::{FusedKernel, FusedRegisters, Step, MAX_BLOCK, MIN_BLOCK};
pub use rows::{RowKernel, RowRegisters, RowStep, MAX_ROW};
