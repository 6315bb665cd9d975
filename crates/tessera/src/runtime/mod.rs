//! Backends that run ops and graphs: the [`device::Backend`] trait every
//! device implements (the CPU's kernels in [`cpu`], CUDA in tessera-cuda),
//! the arrays they compute on, and the executors above them.

pub mod array;
pub mod cpu;
pub mod device;
pub mod execute;
pub mod layout;
pub mod replay;
