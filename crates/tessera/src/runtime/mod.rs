//! Backends that run ops and graphs: the CPU's kernels, and the
//! [`device::Backend`] trait other devices (CUDA) implement.

pub mod array;
pub mod autotune;
pub mod cpu;
pub mod device;
pub mod execute;
pub mod interpret;
pub mod layout;
pub mod replay;
