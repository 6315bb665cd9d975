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
//! A description says what is computed, never how: the CPU runs these in
//! `runtime::cpu::{fused, rows}`, tessera-cuda generates CUDA C from them.
//! Both take the descriptions as they are; nothing here knows a backend.
//! Steps are numbered, each reading only earlier steps, so a kernel is a
//! small SSA program; [`FusedKernel::check`] and [`RowKernel::check`] say
//! whether a hand-built one keeps the rules the backends rely on.

mod fused;
mod rows;
pub mod slots;

pub use fused::{FusedKernel, FusedRegisters, Step, MAX_BLOCK, MIN_BLOCK};
pub use rows::{RowKernel, RowRegisters, RowStep, MAX_ROW};
