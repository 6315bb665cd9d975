//! Backends that run ops and graphs.

pub mod autotune;
pub mod cpu;
pub mod execute;
pub mod interpret;
