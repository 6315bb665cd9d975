//! Flash attention on the GPU: the launcher for `kernels/flash_attention.cu`.
//!
//! Semantics are PyTorch's `F.scaled_dot_product_attention(q, k, v, is_causal, scale)`
//! on contiguous `[B, H, N, D]` tensors (causal masking top-left aligned; `q_len` and
//! `kv_len` may differ). [`flash_forward`] writes the output and the f32 logsumexp per
//! query row; [`flash_backward`] takes q, k, v, out, d_out and that logsumexp and writes
//! dq, dk, dv, recomputing the probabilities block by block.
//!
//! The source is compiled per (architecture, dtype) by the crate's one NVRTC compiler
//! ([`crate::compiler`], [`program`]: the dtype's `-D` options) for the device's own
//! architecture (`sm_90a` on Hopper, so that the wgmma kernels exist) into a cubin,
//! cached on disk, and the loaded module is kept for the life of the process with every
//! other kernel's. Kernels are chosen by dtype, head dim and architecture ([`select`]);
//! what is not covered is an error naming the dtype and head dim, never a launch.
//!
//! The launch plan also depends on the SM count: when batch x heads is too small to
//! fill the GPU (one slice of a sliced graph), the wgmma kernels split their key or
//! query tiles over several blocks ([`forward_splits`], [`backward_split`]); when it is
//! large, the backward runs in groups of heads whose f32 accumulators fit in
//! [`ACC_BUDGET`], alternating over [`LANES`] streams and workspaces so that the groups'
//! launches overlap ([`backward_plan`]), and splits the items past the last whole wave
//! ([`BwdSplit`]). Both need scratch from the caller
//! ([`forward_workspace_bytes`], [`backward_workspace_bytes`]). Launches are queued on a
//! [`Queue`] and nothing waits for them.
//!
//! - `select`: which kernels serve a dtype, head dim and device;
//! - `plan`: their launches (entry points, grids, shared memory);
//! - `work`: how the work spreads over blocks, launch groups and lanes, and the
//!   workspaces that takes;
//! - `run`: the entry points that queue the launches.
//!
//! The first three are pure and unit-tested without a GPU. Errors are tessera's
//! [`Error`] about the op `flash_attention`.
//!
//! Everything goes through cudarc's dynamic loading: the crate builds with no CUDA
//! installed, and the first call checks for the driver and NVRTC and says which is
//! missing.

mod plan;
mod run;
mod select;
mod work;

pub use plan::{backward_launches, forward_launches, Launch, Step};
pub use run::{
    backward_workspace_bytes, flash_backward, flash_forward, flash_forward_variant,
    forward_workspace_bytes, BwdPtrs, FwdPtrs, Queue,
};
pub use select::{arch_for, forward_variants, select, BwdKernel, FwdKernel, Selection, WgFwd};
pub use work::{
    backward_group, backward_plan, backward_split, backward_workspace_bytes_for, forward_splits,
    forward_workspace_bytes_for, BwdGroup, BwdPlan, BwdSplit, ACC_BUDGET, LANES,
};

use tessera::error::{Error, ErrorKind};

use crate::compiler::Program;

/// The kernels' CUDA C source.
pub const SOURCE: &str = include_str!("../../kernels/flash_attention.cu");

/// The op errors name.
const OP: &str = "flash_attention";

type Result<T> = tessera::error::Result<T>;

/// A dtype / head dim / device combination with no kernel.
fn unsupported(message: String) -> Error {
    Error::op(ErrorKind::Unsupported, OP, message)
}

/// Dimensions the kernels cannot take (too large for the grid, or inconsistent).
fn shape_err(message: String) -> Error {
    Error::op(ErrorKind::Shape, OP, message)
}

/// A CUDA call that failed (or the driver or NVRTC missing).
fn device_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::op(ErrorKind::Device, OP, format!("{what}: {e:?}"))
}

/// Element types of q, k, v, out and the gradients (lse and the workspace are f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlashDType {
    F32,
    F16,
    BF16,
}

impl FlashDType {
    /// The name used in kernel names (`flash_fwd_bf16_...`).
    pub fn name(self) -> &'static str {
        match self {
            FlashDType::F32 => "f32",
            FlashDType::F16 => "f16",
            FlashDType::BF16 => "bf16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            FlashDType::F32 => 4,
            FlashDType::F16 | FlashDType::BF16 => 2,
        }
    }

    /// NVRTC defines that leave the other dtypes' kernels out of a module.
    fn skip_others(self) -> &'static [&'static str] {
        match self {
            FlashDType::F32 => &["-DTF_SKIP_BF16", "-DTF_SKIP_F16"],
            FlashDType::F16 => &["-DTF_SKIP_BF16", "-DTF_SKIP_F32"],
            FlashDType::BF16 => &["-DTF_SKIP_F16", "-DTF_SKIP_F32"],
        }
    }
}

/// The program of one dtype's kernels for [`crate::compiler`]: the source with the
/// other dtypes' kernels left out.
pub fn program(dtype: FlashDType) -> Program<'static> {
    Program {
        source: SOURCE,
        name: "flash_attention.cu",
        options: dtype.skip_others(),
    }
}

/// Shapes: q and out are `[batch, heads, q_len, head_dim]`, k and v
/// `[batch, heads, kv_len, head_dim]`, lse `[batch, heads, q_len]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashDims {
    pub batch: usize,
    pub heads: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub head_dim: usize,
}

impl FlashDims {
    fn rows(&self) -> usize {
        self.batch * self.heads * self.q_len
    }
}

/// Shared by the submodules' tests.
#[cfg(test)]
mod testing {
    use super::{FlashDims, Launch};

    pub const HOPPER: (i32, i32) = (9, 0);
    pub const AMPERE: (i32, i32) = (8, 0);

    /// The seed's shape with 1000 keys and head dim `d`.
    pub fn dims(d: usize) -> FlashDims {
        FlashDims {
            batch: 8,
            heads: 32,
            q_len: 2048,
            kv_len: 1000,
            head_dim: d,
        }
    }

    /// The H200's multiprocessor count.
    pub const SMS: u32 = 132;

    pub fn names(launches: &[Launch]) -> Vec<&str> {
        launches.iter().map(|l| l.name.as_str()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;
    use crate::compiler::{compile_uncached, include_dirs, nvrtc_present};

    #[test]
    fn each_dtype_is_its_own_program() {
        let keys: Vec<String> = [FlashDType::F32, FlashDType::F16, FlashDType::BF16]
            .map(|t| program(t).key("sm_90a"))
            .to_vec();
        assert!(keys[0] != keys[1] && keys[1] != keys[2] && keys[0] != keys[2]);
        assert_eq!(
            program(FlashDType::BF16).options,
            ["-DTF_SKIP_F16", "-DTF_SKIP_F32"]
        );
    }

    /// Compiles the source to PTX with NVRTC for Hopper (wgmma kernels included) and for
    /// sm_80, per dtype, and checks that every kernel the launcher can pick is there.
    /// Needs libnvrtc and the fp16/bf16 headers (CI: the nvidia-cuda-nvrtc and
    /// nvidia-cuda-runtime wheels, TESSERA_CUDA_INCLUDE pointing at their include dir).
    #[test]
    fn every_selectable_kernel_compiles_to_ptx() {
        if !nvrtc_present() {
            println!("skipped: libnvrtc not found (set LD_LIBRARY_PATH to a CUDA 13.0 NVRTC)");
            return;
        }
        if include_dirs().is_empty() {
            println!("skipped: cuda_bf16.h not found (set TESSERA_CUDA_INCLUDE or CUDA_HOME)");
            return;
        }
        let probe = FlashDims {
            batch: 1,
            heads: 1,
            q_len: 500,
            kv_len: 700,
            head_dim: 0,
        };
        for (target, cc) in [("compute_90a", HOPPER), ("compute_80", AMPERE)] {
            for dtype in [FlashDType::BF16, FlashDType::F16, FlashDType::F32] {
                let ptx =
                    compile_uncached(&program(dtype), target).unwrap_or_else(|e| panic!("{e}"));
                let ptx = String::from_utf8_lossy(&ptx);
                let dims_list: &[usize] = match dtype {
                    FlashDType::F32 => &[32, 64, 96, 128, 160, 192, 224, 256],
                    _ => &[64, 128],
                };
                for &d in dims_list {
                    let sel = select(dtype, d, cc).unwrap();
                    let dims = FlashDims {
                        head_dim: d,
                        ..probe
                    };
                    // A whole plan, and one split both ways (sm count 1000), with
                    // every forward variant max-autotune may pick.
                    let mut names = Vec::new();
                    for sms in [1, 1000] {
                        names.extend(
                            forward_launches(&sel, &dims, sms)
                                .unwrap()
                                .into_iter()
                                .chain(backward_launches(&sel, &dims, sms, false).unwrap())
                                .map(|l| l.name),
                        );
                        for v in forward_variants(dtype, &dims, cc, sms) {
                            let sel = Selection {
                                fwd: FwdKernel::Wgmma(v),
                                ..sel
                            };
                            names.extend(
                                forward_launches(&sel, &dims, sms)
                                    .unwrap()
                                    .into_iter()
                                    .map(|l| l.name),
                            );
                        }
                    }
                    for name in names {
                        assert!(
                            ptx.contains(&format!(".entry {name}(")),
                            "{name} missing from the {target} PTX"
                        );
                    }
                }
            }
        }
    }
}
