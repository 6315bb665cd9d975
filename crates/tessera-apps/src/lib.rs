//! Applications built on the tessera library, kept out of it so that the
//! library carries no plotting crate or font:
//!
//! - [`seed_table`]: the seed experiment (sliced scaled dot-product
//!   attention, eager and compiled, hinted and fused) measured for working
//!   memory, time, compile time and error; `tessera seed-table` prints it;
//! - [`bench`](mod@bench): a GPT training step timed eagerly or compiled, in f32 or
//!   bf16/f16 autocast, on the CPU or the GPU; `tessera bench gpt` prints
//!   it as one JSON line, beside PyTorch's (`scripts/anchors/gpt_torch.py`);
//! - [`train`]: a complete training run on a self-checking synthetic task,
//!   with a checkpoint and a loss-curve plot; `tessera train` runs it.
//!
//! Both use only tessera's public API.

pub mod bench;
pub mod bench_resnet;
pub mod seed_table;
pub mod train;
