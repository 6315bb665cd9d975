//! Backends that run ops and graphs.

pub mod cpu;
pub mod interpret;
