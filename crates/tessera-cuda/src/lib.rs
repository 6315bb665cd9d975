//! The CUDA backend of tessera. On this branch only the flash attention
//! launcher ([`flash`]); the backend itself lives on the `cuda` branch, whose
//! lib.rs adds `pub mod flash;`.

pub mod flash;
