//! Flash attention on the GPU: the launcher for `kernels/flash_attention.cu`.
//!
//! Semantics are PyTorch's `F.scaled_dot_product_attention(q, k, v, is_causal, scale)`
//! on contiguous `[B, H, N, D]` tensors (causal masking top-left aligned; `q_len` and
//! `kv_len` may differ). [`flash_forward`] writes the output and the f32 logsumexp per
//! query row; [`flash_backward`] takes q, k, v, out, d_out and that logsumexp and writes
//! dq, dk, dv, recomputing the probabilities block by block.
//!
//! The source is compiled once per (context, architecture, dtype) with NVRTC for the
//! device's own architecture (`sm_90a` on Hopper, so that the wgmma kernels exist) into
//! a cubin, and the loaded module is kept for the life of the process. Kernels are chosen
//! by dtype, head dim and architecture ([`select`]); what is not covered is an error
//! naming the dtype and head dim, never a launch.
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
//! Everything goes through cudarc's dynamic loading: the crate builds with no CUDA
//! installed, and the first call checks for the driver and NVRTC and says which is
//! missing.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use std::ffi::c_void;

use cudarc::driver::sys::{
    CUdevice_attribute, CUdeviceptr, CUevent, CUevent_flags, CUevent_wait_flags,
    CUfunction_attribute_enum, CUstream,
};
use cudarc::driver::{result, CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys, Ptx};

/// The kernels' CUDA C source.
pub const SOURCE: &str = include_str!("../kernels/flash_attention.cu");

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
    fn skip_others(self) -> [&'static str; 2] {
        match self {
            FlashDType::F32 => ["-DTF_SKIP_BF16", "-DTF_SKIP_F16"],
            FlashDType::F16 => ["-DTF_SKIP_BF16", "-DTF_SKIP_F32"],
            FlashDType::BF16 => ["-DTF_SKIP_F16", "-DTF_SKIP_F32"],
        }
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

/// What went wrong, in one line a user can act on.
#[derive(Clone, Debug, PartialEq)]
pub enum FlashError {
    /// A dtype / head dim / device combination with no kernel.
    Unsupported(String),
    /// Dimensions the kernels cannot take (too large for the grid, or inconsistent).
    Shape(String),
    /// A bad scalar argument.
    Argument(String),
    /// The driver or NVRTC is missing, or a CUDA call failed.
    Device(String),
}

impl fmt::Display for FlashError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FlashError::Unsupported(m)
            | FlashError::Shape(m)
            | FlashError::Argument(m)
            | FlashError::Device(m) => write!(f, "flash_attention: {m}"),
        }
    }
}

impl std::error::Error for FlashError {}

type Result<T> = std::result::Result<T, FlashError>;

fn device_err(what: &str, e: impl fmt::Debug) -> FlashError {
    FlashError::Device(format!("{what}: {e:?}"))
}

// ---------------------------------------------------------------------------------------
// Kernel choice and launch geometry (pure: unit-tested without a GPU)
// ---------------------------------------------------------------------------------------

/// Forward kernel families.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FwdKernel {
    /// sm_90a wgmma, 4 warpgroups x 64 query rows, key tiles of 64 (head dim 128).
    Wgmma(WgFwd),
    /// mma.sync: `warps` warps x 16 query rows, key tiles of `key_tile`.
    Mma { warps: u32, key_tile: u32 },
    /// CUDA cores, one warp per query row.
    F32,
}

/// How the wgmma forward's warpgroups share the K/V tiles (same tiles, same
/// arithmetic, same results). At (8, 32, 2048, 128) bf16 on an H200 the ring
/// took 1.27 ms, the ring with turns 1.29 and the barrier version 1.57
/// (docs/perf/cuda-flash.md, session 3); `max-autotune` times all three.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WgFwd {
    /// A 4-stage K/V ring under mbarriers: warpgroups drift up to two tiles.
    Ring,
    /// The ring, warpgroups also taking turns to issue their products.
    RingTurns,
    /// Two K/V buffers and a block barrier per key tile.
    Barrier,
}

impl WgFwd {
    /// Every variant, the default first.
    pub const ALL: [WgFwd; 3] = [WgFwd::Ring, WgFwd::RingTurns, WgFwd::Barrier];

    /// The entry point's suffix after `flash_fwd_wg_<t>_d128`.
    fn suffix(self) -> &'static str {
        match self {
            WgFwd::Ring => "_ring",
            WgFwd::RingTurns => "_ring_t",
            WgFwd::Barrier => "_g4_c64",
        }
    }

    /// Dynamic shared memory: Q (256 rows) and the K/V stages (2 for the barrier
    /// version, 4 for the ring plus its 8 mbarriers).
    fn smem(self) -> u32 {
        match self {
            WgFwd::Barrier => WG_FWD_SMEM,
            WgFwd::Ring | WgFwd::RingTurns => (256 * 128 + 8 * 64 * 128) * 2 + 64,
        }
    }
}

/// Backward kernel families.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BwdKernel {
    /// sm_90a wgmma, 2 warpgroups x 64 keys per block, query tiles of 64 (head dim 128).
    Wgmma,
    /// mma.sync: `warps` warps x 16 keys per block, query tiles of `q_tile` rows.
    Mma { warps: u32, q_tile: u32 },
    /// CUDA cores: a dQ kernel (warp per query) and a dK/dV kernel (warp per key).
    F32,
}

/// The kernels for one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Selection {
    pub dtype: FlashDType,
    pub head_dim: usize,
    pub fwd: FwdKernel,
    pub bwd: BwdKernel,
}

/// The NVRTC target for a compute capability: Hopper gets `sm_90a` (wgmma needs the
/// architecture-specific target), everything else its plain `sm_XY`.
pub fn arch_for(cc: (i32, i32)) -> String {
    if cc == (9, 0) {
        "sm_90a".to_string()
    } else {
        format!("sm_{}{}", cc.0, cc.1)
    }
}

/// Picks the kernels by dtype, head dim and compute capability. The choices are the
/// fastest measured on an H200 at (8, 32, 2048, 128) bf16 (docs/perf/cuda-flash.md); the mma.sync
/// ones serve every other sm_80+ device.
pub fn select(dtype: FlashDType, head_dim: usize, cc: (i32, i32)) -> Result<Selection> {
    if cc.0 < 8 {
        return Err(FlashError::Unsupported(format!(
            "needs a GPU of compute capability 8.0 or newer (cp.async, bf16 tensor cores); \
             this one is {}.{}",
            cc.0, cc.1
        )));
    }
    let (fwd, bwd) = match dtype {
        FlashDType::F32 => {
            if head_dim == 0 || !head_dim.is_multiple_of(32) || head_dim > 256 {
                return Err(FlashError::Unsupported(format!(
                    "head dim {head_dim} with f32: supported are multiples of 32 up to 256"
                )));
            }
            (FwdKernel::F32, BwdKernel::F32)
        }
        FlashDType::F16 | FlashDType::BF16 => match (head_dim, cc == (9, 0)) {
            (128, true) => (FwdKernel::Wgmma(WgFwd::Ring), BwdKernel::Wgmma),
            (128, false) => (
                FwdKernel::Mma {
                    warps: 4,
                    key_tile: 64,
                },
                BwdKernel::Mma {
                    warps: 8,
                    q_tile: 32,
                },
            ),
            (64, _) => (
                FwdKernel::Mma {
                    warps: 4,
                    key_tile: 64,
                },
                BwdKernel::Mma {
                    warps: 8,
                    q_tile: 64,
                },
            ),
            _ => {
                return Err(FlashError::Unsupported(format!(
                    "head dim {head_dim} with {}: the tensor-core kernels cover head dims 64 \
                     and 128 (f32 covers multiples of 32 up to 256)",
                    dtype.name()
                )))
            }
        },
    };
    Ok(Selection {
        dtype,
        head_dim,
        fwd,
        bwd,
    })
}

/// What a launch computes; decides its argument list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// The forward writing out and lse.
    Forward,
    /// The split wgmma forward writing partial results into the forward workspace.
    ForwardSplit,
    /// Merges the split forward's partials into out and lse.
    Combine,
    /// Delta, and zeroes the backward's f32 accumulators (bf16/f16).
    Pre,
    /// Delta (f32).
    PreF32,
    /// The mma.sync backward (dQ into the row-major accumulator, dK and dV written).
    BackwardMma,
    /// The wgmma backward (dQ into the fragment-tiled accumulator; dK and dV written,
    /// those of split items summed in their accumulators by the items' last blocks).
    BackwardWgmma,
    /// f32: dQ, and dK with dV.
    DqF32,
    DkvF32,
    /// Row-major f32 dQ accumulator to dq.
    Post,
    /// Fragment-tiled f32 dQ accumulator to dq.
    PostTiled,
}

/// One kernel launch: entry point, grid, block and dynamic shared memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub step: Step,
    pub name: String,
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub smem: u32,
}

fn blocks(n: usize, per_block: usize) -> Result<u32> {
    u32::try_from(n.div_ceil(per_block))
        .map_err(|_| FlashError::Shape(format!("{n} rows need more than 2^32 blocks")))
}

/// Rows per fragment tile of the wgmma kernels' f32 workspaces (64 x 128 f32, 32 KB).
const TILE_ROWS: usize = 64;
/// Query rows per block of the bf16/f16 pre-kernel (`PRE_ROWS` in the .cu).
const PRE_ROWS: usize = 64;
const WG_FWD_ROWS: usize = 256;
const WG_BWD_KEYS: usize = 128;
const WG_FWD_SMEM: u32 = (256 * 128 + 4 * 64 * 128) * 2;
/// The wgmma backward: K and V, 3 ring stages of Q/dO tiles, 2 dS^T buffers (bf16),
/// 3 stages of lse/Delta (f32) and 5 mbarriers.
const WG_BWD_SMEM: u32 = (2 * 128 * 128 + 6 * 64 * 128 + 2 * 128 * 64) * 2 + 6 * 64 * 4 + 5 * 8;

/// How many z blocks split the wgmma forward's key tiles: when the query blocks fill
/// less than half of the `sms` multiprocessors, enough splits for about half of them
/// (each split then costs its partial results and the merge: at (1, 1, 2048, 128) on
/// an H200, 8 splits took 0.044 ms, 16 took 0.050, none 0.106), keeping at least two
/// key tiles per split.
pub fn forward_splits(sel: &Selection, dims: &FlashDims, sms: u32) -> usize {
    if !matches!(sel.fwd, FwdKernel::Wgmma(_)) {
        return 1;
    }
    let blocks = dims.q_len.div_ceil(WG_FWD_ROWS) * dims.batch * dims.heads;
    let by_sms = sms as usize / (2 * blocks.max(1));
    let by_tiles = dims.kv_len.div_ceil(64) / 2;
    let s = by_sms.min(by_tiles);
    if s >= 2 {
        s
    } else {
        1
    }
}

/// How one wgmma backward launch spreads its work items -- (batch x head, key block)
/// pairs of equal cost, batch x head major -- over blocks: the first `whole` items take
/// a block each, every later item `splits` blocks, each with an equal share of the
/// item's query tiles (its dK and dV summed in f32 by the item's last block).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdSplit {
    pub items: usize,
    pub whole: usize,
    pub splits: usize,
}

impl BwdSplit {
    /// Items split over several blocks (each has a slot in the dK/dV accumulator).
    pub fn split_items(&self) -> usize {
        self.items - self.whole
    }

    /// Blocks of the launch.
    pub fn blocks(&self) -> usize {
        self.whole + self.split_items() * self.splits
    }
}

/// How the wgmma backward at `dims` splits its items on `sms` multiprocessors (each
/// piece keeps at least two query tiles):
/// - too few items to fill the SMs (one slice of a sliced graph): every item, into
///   enough pieces to cover them about once (at (1, 1, 2048, 128) on an H200: 8 splits
///   0.062 ms, 4 0.071, 16 0.070, none 0.152);
/// - otherwise, without causal masking, the items past the last whole wave, into as
///   many pieces as fill one wave: at (8, 32, 2048, 128) the 4096 items make 31 waves
///   of 132 and 4 items, whose wave would otherwise take as long as a full one.
///
/// Causal items differ in cost (a key block sees the queries from its own on), so the
/// whole-wave count says nothing there and only the first rule applies.
pub fn backward_split(sel: &Selection, dims: &FlashDims, sms: u32, causal: bool) -> BwdSplit {
    let items = dims.kv_len.div_ceil(WG_BWD_KEYS) * dims.batch * dims.heads;
    let none = BwdSplit {
        items,
        whole: items,
        splits: 1,
    };
    if sel.bwd != BwdKernel::Wgmma || items == 0 {
        return none;
    }
    let (sms, max_splits) = (sms.max(1) as usize, dims.q_len.div_ceil(TILE_ROWS) / 2);
    let all = (sms / items).min(max_splits);
    if all >= 2 {
        return BwdSplit {
            items,
            whole: 0,
            splits: all,
        };
    }
    tail_split(sel, dims, sms as u32, causal, items % sms)
}

/// The wgmma backward at `dims` with its last `tail` items split into as many pieces as
/// fill one wave of `sms` (each piece keeping two query tiles), the rest one block
/// each; nothing split when causal (items of unequal cost), when `tail` is 0 or covers
/// every item, or when fewer than 2 pieces would fit. `tail` is the items past the
/// last whole wave: of the launch alone, or of all the lanes' launches when it ends
/// them ([`backward_plan`]).
fn tail_split(sel: &Selection, dims: &FlashDims, sms: u32, causal: bool, tail: usize) -> BwdSplit {
    let items = dims.kv_len.div_ceil(WG_BWD_KEYS) * dims.batch * dims.heads;
    let none = BwdSplit {
        items,
        whole: items,
        splits: 1,
    };
    if sel.bwd != BwdKernel::Wgmma || causal || tail == 0 || tail >= items {
        return none;
    }
    let max_splits = dims.q_len.div_ceil(TILE_ROWS) / 2;
    match (sms.max(1) as usize / tail).min(max_splits) {
        s if s >= 2 => BwdSplit {
            items,
            whole: items - tail,
            splits: s,
        },
        _ => none,
    }
}

/// The forward launches for `sel` at `dims` on a device of `sms` multiprocessors.
/// Shared memory sizes follow the table at the end of the .cu file.
pub fn forward_launches(sel: &Selection, dims: &FlashDims, sms: u32) -> Result<Vec<Launch>> {
    let d = sel.head_dim;
    let t = sel.dtype.name();
    let bh = bh_dim(dims)?;
    let launch = |step, name, grid, block, smem| Launch {
        step,
        name,
        grid,
        block,
        smem,
    };
    Ok(match sel.fwd {
        FwdKernel::Wgmma(variant) => {
            let qb = blocks(dims.q_len, WG_FWD_ROWS)?;
            let splits = forward_splits(sel, dims, sms);
            if splits == 1 {
                vec![launch(
                    Step::Forward,
                    format!("flash_fwd_wg_{t}_d{d}{}", variant.suffix()),
                    (qb, bh, 1),
                    512,
                    variant.smem(),
                )]
            } else {
                let tiles = dims.q_len.div_ceil(TILE_ROWS) * bh as usize;
                vec![
                    launch(
                        Step::ForwardSplit,
                        format!("flash_fwd_wg_split_{t}_d{d}"),
                        (qb, bh, splits as u32),
                        512,
                        WG_FWD_SMEM,
                    ),
                    launch(
                        Step::Combine,
                        format!("flash_fwd_combine_{t}_d{d}"),
                        (blocks(tiles * 2048, 256)?, 1, 1),
                        256,
                        0,
                    ),
                ]
            }
        }
        FwdKernel::Mma { warps, key_tile } => {
            let (w, c) = (warps as usize, key_tile as usize);
            vec![launch(
                Step::Forward,
                format!("flash_fwd_{t}_d{d}_w{w}_c{c}"),
                (blocks(dims.q_len, 16 * w)?, bh, 1),
                32 * warps,
                ((16 * w * (d + 8) + 4 * c * (d + 8)) * 2) as u32,
            )]
        }
        FwdKernel::F32 => vec![launch(
            Step::Forward,
            format!("flash_fwd_f32_d{d}"),
            (blocks(dims.q_len, 8)?, bh, 1),
            256,
            ((2 * 32 * (d + 1) + 8 * d) * 4) as u32,
        )],
    })
}

/// The backward launches in order: Delta (and zeroed accumulators), the main kernel(s),
/// and for bf16/f16 the conversion of the f32 accumulators.
pub fn backward_launches(
    sel: &Selection,
    dims: &FlashDims,
    sms: u32,
    causal: bool,
) -> Result<Vec<Launch>> {
    launches_for(sel, dims, backward_split(sel, dims, sms, causal))
}

/// [`backward_launches`] of one launch group whose wgmma items spread as `split` says.
fn launches_for(sel: &Selection, dims: &FlashDims, split: BwdSplit) -> Result<Vec<Launch>> {
    let d = sel.head_dim;
    let t = sel.dtype.name();
    let bh = bh_dim(dims)?;
    let rows = dims.rows();
    // Rows per block: the f32 pre-kernel has one warp per row, the bf16/f16 one
    // PRE_ROWS (D / 8 lanes per row).
    let pre_grid = |step| -> Result<(u32, u32, u32)> {
        let per_block = if step == Step::PreF32 { 8 } else { PRE_ROWS };
        Ok((blocks(rows, per_block)?, 1, 1))
    };
    let pre = |step, name| -> Result<Launch> {
        Ok(Launch {
            step,
            name,
            grid: pre_grid(step)?,
            block: 256,
            smem: 0,
        })
    };
    Ok(match sel.bwd {
        BwdKernel::F32 => vec![
            pre(Step::PreF32, format!("flash_bwd_pre_f32_d{d}"))?,
            Launch {
                step: Step::DqF32,
                name: format!("flash_bwd_dq_f32_d{d}"),
                grid: (blocks(dims.q_len, 8)?, bh, 1),
                block: 256,
                smem: ((2 * 32 * (d + 1) + 16 * d) * 4) as u32,
            },
            Launch {
                step: Step::DkvF32,
                name: format!("flash_bwd_dkv_f32_d{d}"),
                grid: (blocks(dims.kv_len, 8)?, bh, 1),
                block: 256,
                smem: ((2 * 32 * (d + 1) + 16 * d + 64) * 4) as u32,
            },
        ],
        BwdKernel::Mma { warps, q_tile } => {
            let (w, r) = (warps as usize, q_tile as usize);
            vec![
                pre(Step::Pre, format!("flash_bwd_pre_{t}_d{d}"))?,
                Launch {
                    step: Step::BackwardMma,
                    name: format!("flash_bwd_{t}_d{d}_w{w}_r{r}"),
                    grid: (blocks(dims.kv_len, 16 * w)?, bh, 1),
                    block: 32 * warps,
                    smem: ((2 * 16 * w * (d + 8) + 4 * r * (d + 8) + 16 * w * (r + 8)) * 2 + 16 * r)
                        as u32,
                },
                Launch {
                    step: Step::Post,
                    name: format!("flash_bwd_post_{t}"),
                    grid: (blocks(rows * d / 4, 256)?, 1, 1),
                    block: 256,
                    smem: 0,
                },
            ]
        }
        BwdKernel::Wgmma => {
            let main = u32::try_from(split.blocks())
                .ok()
                .filter(|&b| b <= i32::MAX as u32)
                .ok_or_else(|| {
                    FlashError::Shape(format!(
                        "{} (batch x head, key block) items exceed the backward's 2^31 blocks",
                        split.items
                    ))
                })?;
            // One post block per 64 x 128 fragment tile of dQ.
            let tiles = dims.q_len.div_ceil(TILE_ROWS) * bh as usize;
            vec![
                pre(Step::Pre, format!("flash_bwd_pre_{t}_d{d}"))?,
                Launch {
                    step: Step::BackwardWgmma,
                    name: format!("flash_bwd_wg_{t}_d{d}"),
                    grid: (main, 1, 1),
                    block: 256,
                    smem: WG_BWD_SMEM,
                },
                Launch {
                    step: Step::PostTiled,
                    name: format!("flash_bwd_post_wg_{t}"),
                    grid: (blocks(tiles, 1)?, 1, 1),
                    block: 256,
                    smem: 0,
                },
            ]
        }
    })
}

fn bh_dim(dims: &FlashDims) -> Result<u32> {
    let bh = dims.batch * dims.heads;
    if bh > 65_535 {
        return Err(FlashError::Shape(format!(
            "batch x heads = {} x {} = {bh} exceeds the 65535 blocks of a grid's y dimension",
            dims.batch, dims.heads
        )));
    }
    Ok(bh as u32)
}

/// Byte offsets of the parts of the backward's workspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct BwdLayout {
    /// f32 Delta per query row at 0; from `acc` on, zeroed by the pre-kernel: the f32
    /// dQ accumulator (`dq_acc` bytes), then for the wgmma backward's split items their
    /// dK/dV accumulators (`kv_acc` bytes: per item, each warpgroup's 64 x 128 dK tile
    /// then its dV tile) and their i32 piece counters (`counters` bytes).
    acc: usize,
    dq_acc: usize,
    kv_acc: usize,
    counters: usize,
}

impl BwdLayout {
    fn new(sel: &Selection, dims: &FlashDims, split: BwdSplit) -> BwdLayout {
        let bh = dims.batch * dims.heads;
        let d = sel.head_dim;
        let acc = (dims.rows() * 4).div_ceil(256) * 256;
        let (dq_acc, kv_acc, counters) = match sel.bwd {
            BwdKernel::F32 => (0, 0, 0),
            BwdKernel::Mma { .. } => (dims.rows() * d * 4, 0, 0),
            BwdKernel::Wgmma => {
                let n = split.split_items();
                (
                    dims.q_len.div_ceil(TILE_ROWS) * TILE_ROWS * bh * d * 4,
                    n * 4 * TILE_ROWS * d * 4,
                    (n * 4).div_ceil(16) * 16,
                )
            }
        };
        BwdLayout {
            acc,
            dq_acc,
            kv_acc,
            counters,
        }
    }

    /// Bytes the pre-kernel zeroes (a multiple of 16).
    fn zeroed(&self) -> usize {
        self.dq_acc + self.kv_acc + self.counters
    }

    fn bytes(&self) -> usize {
        self.acc + self.zeroed()
    }
}

/// Bytes of f32 scratch [`flash_backward`] needs for `sel` at `dims` on a device of
/// `sms` multiprocessors: per lane ([`backward_plan`]), for the largest of its launch
/// groups, Delta (one f32 per query row, padded to 256 bytes) and, for bf16/f16, the
/// f32 dQ accumulator (and dK, dV ones for split items).
pub fn backward_workspace_bytes_for(sel: &Selection, dims: &FlashDims, sms: u32) -> usize {
    // Without causal masking at least as many items split as with it.
    let plan = backward_plan(sel, dims, sms, false);
    plan.workspace_bytes(sel, dims)
}

/// `dims` narrowed to one launch group of `n` batch x heads.
fn group_dims(dims: &FlashDims, n: usize) -> FlashDims {
    FlashDims {
        batch: 1,
        heads: n,
        ..*dims
    }
}

/// Bytes of f32 dQ accumulator the backward's launch groups may hold at once: a larger
/// batch x heads runs in groups that reuse [`LANES`] workspaces (mostly L2-resident).
/// At the seed's (8, 32, 2048, 128) the dQ accumulator would otherwise take 256 MB;
/// 32 MB is 32 heads, 16 per lane.
pub const ACC_BUDGET: usize = 32 << 20;

/// Streams a grouped backward spreads its launch groups over, round robin, each with
/// its own workspace of 1/LANES of [`ACC_BUDGET`]: the caller's stream and auxiliary
/// ones ([`flash_backward`]). On one stream each group boundary cost the main kernel's
/// drain and the next group's pre-kernel and ramp, serialized (~0.02 ms at the seed on
/// an H200, docs/perf/cuda-flash.md session 6); with two, one group's main kernel fills the SMs while
/// the other lane drains, converts its dQ and zeroes its workspace for the next group.
pub const LANES: usize = 2;

/// batch x heads per backward launch group: all of them when their accumulators fit
/// in [`ACC_BUDGET`], otherwise as many as fit in one lane's share of it.
pub fn backward_group(sel: &Selection, dims: &FlashDims) -> usize {
    let bh = dims.batch * dims.heads;
    let per_bh = match sel.bwd {
        BwdKernel::F32 => return bh.max(1),
        BwdKernel::Mma { .. } => dims.q_len * sel.head_dim * 4,
        BwdKernel::Wgmma => dims.q_len.div_ceil(TILE_ROWS) * TILE_ROWS * sel.head_dim * 4,
    }
    .max(1);
    if bh * per_bh <= ACC_BUDGET {
        return bh.max(1);
    }
    (ACC_BUDGET / LANES / per_bh).clamp(1, bh)
}

/// One launch group of the backward: batch x heads `first..first + n`, its wgmma items
/// spread as `split` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdGroup {
    pub first: usize,
    pub n: usize,
    pub split: BwdSplit,
}

/// The backward's launch groups in order and the lanes they alternate over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BwdPlan {
    pub lanes: usize,
    pub groups: Vec<BwdGroup>,
}

impl BwdPlan {
    /// One lane's workspace: the largest group's layout.
    fn lane_bytes(&self, sel: &Selection, dims: &FlashDims) -> usize {
        self.groups
            .iter()
            .map(|g| BwdLayout::new(sel, &group_dims(dims, g.n), g.split).bytes())
            .max()
            .unwrap_or(0)
    }

    /// Bytes between the lanes' workspaces (whole 256-byte units: each starts aligned).
    fn lane_stride(&self, sel: &Selection, dims: &FlashDims) -> usize {
        self.lane_bytes(sel, dims).div_ceil(256) * 256
    }

    /// Bytes of the whole workspace: the lanes' one after another.
    fn workspace_bytes(&self, sel: &Selection, dims: &FlashDims) -> usize {
        (self.lanes - 1) * self.lane_stride(sel, dims) + self.lane_bytes(sel, dims)
    }
}

/// The backward's plan at `dims` on `sms` multiprocessors: one group and lane when
/// the accumulators fit in [`ACC_BUDGET`] (split as [`backward_split`] says); otherwise
/// groups of [`backward_group`] on [`LANES`] lanes, whose launches overlap so that
/// only the last group ends on a drain: it alone splits, its share of the items past
/// the last whole wave of all groups' items together. At (8, 32, 2048, 128) on 132 SMs:
/// 16 groups of 16 heads; of the 4096 items the last 4 run in 16 pieces each.
pub fn backward_plan(sel: &Selection, dims: &FlashDims, sms: u32, causal: bool) -> BwdPlan {
    let bh = dims.batch * dims.heads;
    let group = backward_group(sel, dims);
    if group >= bh {
        let split = backward_split(sel, dims, sms, causal);
        return BwdPlan {
            lanes: 1,
            groups: vec![BwdGroup {
                first: 0,
                n: bh,
                split,
            }],
        };
    }
    let tail = (dims.kv_len.div_ceil(WG_BWD_KEYS) * bh) % sms.max(1) as usize;
    let groups = (0..bh)
        .step_by(group)
        .map(|first| {
            let n = group.min(bh - first);
            let last = first + n == bh;
            let d = group_dims(dims, n);
            BwdGroup {
                first,
                n,
                split: tail_split(sel, &d, sms, causal, if last { tail } else { 0 }),
            }
        })
        .collect();
    BwdPlan {
        lanes: LANES,
        groups,
    }
}

/// Bytes of f32 scratch [`flash_forward`] needs: the split forward's partial outputs
/// (fragment-tiled f32) and per-row (max, sum) pairs; 0 when it does not split.
pub fn forward_workspace_bytes_for(sel: &Selection, dims: &FlashDims, sms: u32) -> usize {
    let (splits, bh) = (forward_splits(sel, dims, sms), dims.batch * dims.heads);
    if splits == 1 {
        return 0;
    }
    let part = dims.q_len.div_ceil(TILE_ROWS) * TILE_ROWS * bh * sel.head_dim * 4;
    splits * (part + bh * dims.q_len * 8)
}

fn check_dims(dims: &FlashDims, scale: f32) -> Result<()> {
    let lens = [dims.q_len, dims.kv_len];
    if lens.iter().any(|&n| n > i32::MAX as usize) {
        return Err(FlashError::Shape(format!(
            "q_len {} / kv_len {} exceed the kernels' 32-bit row indices",
            dims.q_len, dims.kv_len
        )));
    }
    if !scale.is_finite() {
        return Err(FlashError::Argument(format!(
            "scale must be finite, got {scale}"
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Compilation and module cache
// ---------------------------------------------------------------------------------------

/// Directories searched for `cuda_fp16.h` / `cuda_bf16.h`: `$TESSERA_CUDA_INCLUDE`
/// (`:`-separated), `$CUDA_HOME/include`, `/usr/local/cuda/include`; those that exist.
pub fn include_dirs() -> Vec<String> {
    let mut dirs: Vec<String> = std::env::var("TESSERA_CUDA_INCLUDE")
        .map(|v| v.split(':').map(String::from).collect())
        .unwrap_or_default();
    if let Ok(home) = std::env::var("CUDA_HOME") {
        dirs.push(format!("{home}/include"));
    }
    dirs.push("/usr/local/cuda/include".into());
    dirs.retain(|d| !d.is_empty() && std::path::Path::new(d).join("cuda_bf16.h").is_file());
    dirs.dedup();
    dirs
}

/// Whether libnvrtc can be loaded (cudarc panics on a missing library).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { nvrtc_sys::is_culib_present() }
}

/// Compiles the kernels of one dtype for `target` (`sm_90a`, `sm_80`, ...: a cubin;
/// `compute_90a`, ...: PTX text). Errors carry NVRTC's log.
pub fn compile(dtype: FlashDType, target: &str) -> Result<Vec<u8>> {
    if !nvrtc_present() {
        return Err(FlashError::Device(
            "NVRTC (libnvrtc) not found: install the CUDA toolkit or put libnvrtc on \
             LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let src = CString::new(SOURCE).expect("the kernel source holds no NUL byte");
    let prog = nvrtc::create_program(&src, Some(c"flash_attention.cu"))
        .map_err(|e| device_err("nvrtcCreateProgram", e))?;
    let mut options = vec![
        format!("--gpu-architecture={target}"),
        "--std=c++17".to_string(),
    ];
    options.extend(dtype.skip_others().iter().map(|s| s.to_string()));
    options.extend(
        include_dirs()
            .into_iter()
            .map(|d| format!("--include-path={d}")),
    );
    // SAFETY: `prog` stays alive until destroyed at the end of this function.
    let out = match unsafe { nvrtc::compile_program(prog, &options) } {
        Ok(()) => unsafe { program_image(prog, target.starts_with("sm_")) },
        Err(e) => {
            let log = unsafe { nvrtc::get_program_log(prog) }
                .map(|l| c_chars_to_string(&l))
                .unwrap_or_default();
            Err(FlashError::Device(format!(
                "NVRTC failed ({e:?}) for {target} ({}):\n{log}",
                dtype.name()
            )))
        }
    };
    // SAFETY: created above and destroyed once.
    unsafe {
        let _ = nvrtc::destroy_program(prog);
    }
    out
}

/// The compiled cubin, or the PTX text (NUL-terminated as the driver wants it).
///
/// # Safety
/// `prog` was compiled successfully and is not destroyed.
unsafe fn program_image(prog: nvrtc_sys::nvrtcProgram, cubin: bool) -> Result<Vec<u8>> {
    if cubin {
        let mut size = 0usize;
        nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
            .result()
            .map_err(|e| device_err("nvrtcGetCUBINSize", e))?;
        let mut buf = vec![0 as c_char; size];
        nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr())
            .result()
            .map_err(|e| device_err("nvrtcGetCUBIN", e))?;
        Ok(buf.into_iter().map(|c| c as u8).collect())
    } else {
        let ptx = nvrtc::get_ptx(prog).map_err(|e| device_err("nvrtcGetPTX", e))?;
        Ok(ptx.into_iter().map(|c| c as u8).collect())
    }
}

fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A loaded module and the functions taken from it (with their shared-memory limit
/// already raised).
struct Loaded {
    module: Arc<CudaModule>,
    functions: Mutex<HashMap<String, CudaFunction>>,
}

type ModuleKey = (usize, FlashDType);

fn modules() -> &'static Mutex<HashMap<ModuleKey, Arc<Loaded>>> {
    static MODULES: OnceLock<Mutex<HashMap<ModuleKey, Arc<Loaded>>>> = OnceLock::new();
    MODULES.get_or_init(Default::default)
}

/// The module for this context and dtype, compiled and loaded on first use.
fn module_for(ctx: &Arc<CudaContext>, dtype: FlashDType, cc: (i32, i32)) -> Result<Arc<Loaded>> {
    let key = (ctx.cu_ctx() as usize, dtype);
    let mut map = modules().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(m) = map.get(&key) {
        return Ok(m.clone());
    }
    let image = compile(dtype, &arch_for(cc))?;
    let module = ctx
        .load_module(Ptx::from_binary(image))
        .map_err(|e| device_err("loading the flash attention module", e))?;
    let loaded = Arc::new(Loaded {
        module,
        functions: Mutex::new(HashMap::new()),
    });
    map.insert(key, loaded.clone());
    Ok(loaded)
}

fn function(loaded: &Loaded, launch: &Launch) -> Result<CudaFunction> {
    let mut funcs = loaded.functions.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(f) = funcs.get(&launch.name) {
        return Ok(f.clone());
    }
    let f = loaded
        .module
        .load_function(&launch.name)
        .map_err(|e| device_err(&format!("kernel {}", launch.name), e))?;
    // Above 48 KB a block gets dynamic shared memory only after opting in.
    if launch.smem > 48 * 1024 {
        f.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            launch.smem as i32,
        )
        .map_err(|e| device_err(&format!("shared memory limit of {}", launch.name), e))?;
    }
    funcs.insert(launch.name.clone(), f.clone());
    Ok(f)
}

// ---------------------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------------------

/// Where the kernels are queued: a context and one of its streams, given raw so that a
/// stream the caller created outside cudarc (the CUDA backend's own) serves as well as a
/// cudarc one. The stream must belong to `ctx`.
#[derive(Clone, Copy)]
pub struct Queue<'a> {
    pub ctx: &'a Arc<CudaContext>,
    pub stream: CUstream,
}

impl<'a> From<&'a Arc<CudaStream>> for Queue<'a> {
    fn from(s: &'a Arc<CudaStream>) -> Queue<'a> {
        Queue {
            ctx: s.context(),
            stream: s.cu_stream(),
        }
    }
}

/// The device facts the launch plan depends on: compute capability and SM count.
fn device_facts(ctx: &CudaContext) -> Result<((i32, i32), u32)> {
    let cc = ctx
        .compute_capability()
        .map_err(|e| device_err("reading the compute capability", e))?;
    let sms = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| device_err("reading the multiprocessor count", e))?;
    Ok((cc, sms.max(1) as u32))
}

/// Bytes of scratch [`flash_forward`] needs on `ctx`'s device (0 unless the forward is
/// split over the key tiles, which it is when batch x heads is too small to fill it).
pub fn forward_workspace_bytes(
    ctx: &CudaContext,
    dtype: FlashDType,
    dims: &FlashDims,
) -> Result<usize> {
    let (cc, sms) = device_facts(ctx)?;
    Ok(forward_workspace_bytes_for(
        &select(dtype, dims.head_dim, cc)?,
        dims,
        sms,
    ))
}

/// Bytes of scratch [`flash_backward`] needs on `ctx`'s device.
pub fn backward_workspace_bytes(
    ctx: &CudaContext,
    dtype: FlashDType,
    dims: &FlashDims,
) -> Result<usize> {
    let (cc, sms) = device_facts(ctx)?;
    Ok(backward_workspace_bytes_for(
        &select(dtype, dims.head_dim, cc)?,
        dims,
        sms,
    ))
}

/// Device pointers of a forward call (all on the queue's context, contiguous).
#[derive(Clone, Copy, Debug)]
pub struct FwdPtrs {
    /// `[B, H, q_len, D]` of `dtype`.
    pub q: CUdeviceptr,
    /// `[B, H, kv_len, D]` of `dtype`.
    pub k: CUdeviceptr,
    /// `[B, H, kv_len, D]` of `dtype`.
    pub v: CUdeviceptr,
    /// `[B, H, q_len, D]` of `dtype`, written.
    pub out: CUdeviceptr,
    /// `[B, H, q_len]` f32, written (natural-log logsumexp of each scaled score row).
    pub lse: CUdeviceptr,
    /// Scratch of [`forward_workspace_bytes`] bytes, 256-byte aligned (unused when 0).
    pub workspace: CUdeviceptr,
}

/// Device pointers of a backward call.
#[derive(Clone, Copy, Debug)]
pub struct BwdPtrs {
    pub q: CUdeviceptr,
    pub k: CUdeviceptr,
    pub v: CUdeviceptr,
    /// The forward's output.
    pub out: CUdeviceptr,
    /// Gradient of the output, `[B, H, q_len, D]` of `dtype`.
    pub d_out: CUdeviceptr,
    /// The forward's logsumexp, `[B, H, q_len]` f32.
    pub lse: CUdeviceptr,
    /// Written: `[B, H, q_len, D]`, `[B, H, kv_len, D]`, `[B, H, kv_len, D]` of `dtype`.
    pub dq: CUdeviceptr,
    pub dk: CUdeviceptr,
    pub dv: CUdeviceptr,
    /// Scratch of [`backward_workspace_bytes`] bytes, 256-byte aligned.
    pub workspace: CUdeviceptr,
}

/// A kernel argument: the driver takes a pointer to each argument's value.
trait KernelArg {
    fn param(&self) -> *mut c_void;
}
macro_rules! kernel_arg {
    ($($t:ty),*) => {$(
        impl KernelArg for $t {
            fn param(&self) -> *mut c_void {
                self as *const $t as *mut c_void
            }
        }
    )*};
}
kernel_arg!(u64, i32, i64, f32);

fn run(q: Queue<'_>, loaded: &Loaded, launch: &Launch, args: &[&dyn KernelArg]) -> Result<()> {
    if launch.grid.0 == 0 || launch.grid.1 == 0 {
        return Ok(()); // nothing to do (an empty sequence)
    }
    let f = function(loaded, launch)?;
    let mut params: Vec<*mut c_void> = args.iter().map(|a| a.param()).collect();
    q.ctx
        .bind_to_thread()
        .map_err(|e| device_err("binding the context", e))?;
    // SAFETY: the argument list matches the kernel's signature (checked by the names
    // and orders in this file against the .cu; the values outlive the call, which
    // copies them), the stream belongs to the function's context, and the caller of
    // the public entry points vouches for the pointers.
    unsafe {
        result::launch_kernel(
            f.cu_function(),
            launch.grid,
            (launch.block, 1, 1),
            launch.smem,
            q.stream,
            &mut params,
        )
    }
    .map_err(|e| device_err(&format!("launching {}", launch.name), e))
}

/// Attention forward: `out = softmax(scale * q k^T [+ causal mask]) v` and
/// `lse = logsumexp(scale * q k^T [+ mask])` per query row, enqueued on the queue's
/// stream (nothing waits for it).
///
/// # Safety
/// Every pointer in `ptrs` must be a live device allocation on the queue's context of
/// at least the size its field documents for `dims` and `dtype`, contiguous, and not be
/// freed or written by other work until the enqueued kernels finish.
pub unsafe fn flash_forward(
    q: Queue<'_>,
    dtype: FlashDType,
    dims: FlashDims,
    causal: bool,
    scale: f32,
    ptrs: FwdPtrs,
) -> Result<()> {
    flash_forward_variant(q, dtype, dims, causal, scale, ptrs, None)
}

/// The wgmma forward variants a call at `dims` can take (a tuner times them):
/// none but the default when another kernel family or the split forward runs.
pub fn forward_variants(
    dtype: FlashDType,
    dims: &FlashDims,
    cc: (i32, i32),
    sms: u32,
) -> Vec<WgFwd> {
    match select(dtype, dims.head_dim, cc) {
        Ok(sel)
            if matches!(sel.fwd, FwdKernel::Wgmma(_)) && forward_splits(&sel, dims, sms) == 1 =>
        {
            WgFwd::ALL.to_vec()
        }
        _ => Vec::new(),
    }
}

/// [`flash_forward`] with the wgmma forward's `variant` (`None`: the default;
/// ignored where another kernel family runs).
///
/// # Safety
/// As for [`flash_forward`].
pub unsafe fn flash_forward_variant(
    q: Queue<'_>,
    dtype: FlashDType,
    dims: FlashDims,
    causal: bool,
    scale: f32,
    ptrs: FwdPtrs,
    variant: Option<WgFwd>,
) -> Result<()> {
    check_dims(&dims, scale)?;
    let (cc, sms) = device_facts(q.ctx)?;
    let mut sel = select(dtype, dims.head_dim, cc)?;
    if let (Some(v), FwdKernel::Wgmma(_)) = (variant, sel.fwd) {
        sel.fwd = FwdKernel::Wgmma(v);
    }
    let launches = forward_launches(&sel, &dims, sms)?;
    if dims.q_len == 0 {
        return Ok(());
    }
    let loaded = module_for(q.ctx, dtype, cc)?;
    let (nq, nk) = (dims.q_len as i32, dims.kv_len as i32);
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let causal = causal as i32;
    let splits = forward_splits(&sel, &dims, sms) as i32;
    let bh = (dims.batch * dims.heads) as i32;
    let o_part = ptrs.workspace;
    let ml_part = ptrs.workspace
        + (dims.q_len.div_ceil(TILE_ROWS) * TILE_ROWS * bh as usize * dims.head_dim * 4) as u64
            * splits as u64;
    let p = &ptrs;
    for launch in &launches {
        match launch.step {
            Step::Forward => {
                let a: [&dyn KernelArg; 9] = [
                    &p.q,
                    &p.k,
                    &p.v,
                    &p.out,
                    &p.lse,
                    &nq,
                    &nk,
                    &scale_log2,
                    &causal,
                ];
                run(q, &loaded, launch, &a)?
            }
            Step::ForwardSplit => {
                let a: [&dyn KernelArg; 9] = [
                    &p.q,
                    &p.k,
                    &p.v,
                    &o_part,
                    &ml_part,
                    &nq,
                    &nk,
                    &scale_log2,
                    &causal,
                ];
                run(q, &loaded, launch, &a)?
            }
            Step::Combine => {
                let a: [&dyn KernelArg; 7] = [&o_part, &ml_part, &p.out, &p.lse, &splits, &bh, &nq];
                run(q, &loaded, launch, &a)?
            }
            s => unreachable!("{s:?} is no forward step"),
        }
    }
    Ok(())
}

/// Attention backward (FlashAttention-2): from q, k, v, the forward's out and lse, and
/// d_out, writes dq, dk, dv; enqueued on the queue's stream (nothing waits for it).
/// When it runs in several launch groups, they alternate between the queue's stream and
/// auxiliary ones of the context ([`LANES`]), forked from and joined back into the
/// queue's stream with events: the results are complete in the queue's stream order.
///
/// # Safety
/// As for [`flash_forward`], for every pointer in `ptrs`; `workspace` must hold
/// [`backward_workspace_bytes`] bytes.
pub unsafe fn flash_backward(
    q: Queue<'_>,
    dtype: FlashDType,
    dims: FlashDims,
    causal: bool,
    scale: f32,
    ptrs: BwdPtrs,
) -> Result<()> {
    check_dims(&dims, scale)?;
    let (cc, sms) = device_facts(q.ctx)?;
    let sel = select(dtype, dims.head_dim, cc)?;
    backward_launches(&sel, &dims, sms, causal)?; // shape errors before anything is queued
    let loaded = module_for(q.ctx, dtype, cc)?;
    let plan = backward_plan(&sel, &dims, sms, causal);
    let lane_stride = plan.lane_stride(&sel, &dims) as u64;
    let (q_row, k_row) = (dims.q_len * dims.head_dim, dims.kv_len * dims.head_dim);
    let es = dtype.size();
    let enqueue = |lanes: &[CUstream]| -> Result<()> {
        for (i, g) in plan.groups.iter().enumerate() {
            let lane = i % lanes.len();
            let at = |p: CUdeviceptr, per_bh: usize| p + (g.first * per_bh) as u64;
            let part_ptrs = BwdPtrs {
                q: at(ptrs.q, q_row * es),
                k: at(ptrs.k, k_row * es),
                v: at(ptrs.v, k_row * es),
                out: at(ptrs.out, q_row * es),
                d_out: at(ptrs.d_out, q_row * es),
                lse: at(ptrs.lse, dims.q_len * 4),
                dq: at(ptrs.dq, q_row * es),
                dk: at(ptrs.dk, k_row * es),
                dv: at(ptrs.dv, k_row * es),
                workspace: ptrs.workspace + lane as u64 * lane_stride,
            };
            let lq = Queue {
                ctx: q.ctx,
                stream: lanes[lane],
            };
            let part = group_dims(&dims, g.n);
            enqueue_backward(lq, &loaded, &sel, part, g.split, causal, scale, part_ptrs)?;
        }
        Ok(())
    };
    if plan.lanes == 1 {
        return enqueue(&[q.stream]);
    }
    let mut all = aux_lanes().lock().unwrap_or_else(|p| p.into_inner());
    let aux = aux_lanes_for(&mut all, q.ctx)?;
    // The auxiliary streams start after what the caller queued before (the inputs, the
    // workspace's previous use) and the caller's stream continues after all of them:
    // each lane's groups are ordered by its own stream, nothing waits on the host.
    aux.fork(q.stream)?;
    let mut lanes = vec![q.stream];
    lanes.extend(aux.streams.iter().map(|s| s.0));
    let queued = enqueue(&lanes);
    aux.join(q.stream)?;
    queued
}

/// A raw driver handle (stream or event) kept in a process-wide map: only used under
/// the map's lock, on its own context.
#[derive(Clone, Copy)]
struct Handle<T>(T);
// SAFETY: driver handles may be used from any thread; the map's lock orders the uses.
unsafe impl<T> Send for Handle<T> {}

/// The auxiliary streams of one context's backward lanes ([`LANES`] - 1, created
/// once, never destroyed, like the loaded modules) and the events that order them
/// against the caller's stream.
struct AuxLanes {
    streams: Vec<Handle<CUstream>>,
    fork: Handle<CUevent>,
    joins: Vec<Handle<CUevent>>,
}

impl AuxLanes {
    /// Every auxiliary stream waits for the work queued on `stream` so far.
    fn fork(&self, stream: CUstream) -> Result<()> {
        // SAFETY: the handles are live (never destroyed) and of the stream's context.
        unsafe {
            result::event::record(self.fork.0, stream)
                .map_err(|e| device_err("recording the backward's fork event", e))?;
            for s in &self.streams {
                result::stream::wait_event(
                    s.0,
                    self.fork.0,
                    CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
                .map_err(|e| device_err("ordering a backward lane after the caller", e))?;
            }
        }
        Ok(())
    }

    /// `stream` waits for the work queued on every auxiliary stream so far.
    fn join(&self, stream: CUstream) -> Result<()> {
        // SAFETY: as in `fork`.
        unsafe {
            for (s, e) in self.streams.iter().zip(&self.joins) {
                result::event::record(e.0, s.0)
                    .map_err(|e| device_err("recording a backward lane's join event", e))?;
                result::stream::wait_event(stream, e.0, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                    .map_err(|e| device_err("ordering the caller after a backward lane", e))?;
            }
        }
        Ok(())
    }
}

fn aux_lanes() -> &'static Mutex<HashMap<usize, AuxLanes>> {
    static LANE_MAP: OnceLock<Mutex<HashMap<usize, AuxLanes>>> = OnceLock::new();
    LANE_MAP.get_or_init(Default::default)
}

/// `ctx`'s auxiliary lanes, created on first use. Raw driver streams rather than
/// cudarc's `new_stream`, which would put the whole context into cudarc's multi-stream
/// mode (an event recorded on every allocation's use).
fn aux_lanes_for<'m>(
    all: &'m mut HashMap<usize, AuxLanes>,
    ctx: &Arc<CudaContext>,
) -> Result<&'m AuxLanes> {
    let slot = match all.entry(ctx.cu_ctx() as usize) {
        Entry::Occupied(e) => return Ok(e.into_mut()),
        Entry::Vacant(v) => v,
    };
    ctx.bind_to_thread()
        .map_err(|e| device_err("binding the context", e))?;
    let event = || {
        result::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map(Handle)
            .map_err(|e| device_err("creating a backward lane event", e))
    };
    let mut lanes = AuxLanes {
        streams: Vec::new(),
        fork: event()?,
        joins: Vec::new(),
    };
    for _ in 1..LANES {
        let s = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| device_err("creating a backward lane stream", e))?;
        lanes.streams.push(Handle(s));
        lanes.joins.push(event()?);
    }
    Ok(slot.insert(lanes))
}

/// The backward's launches for `dims` (one group of batch x heads), in stream order.
#[allow(clippy::too_many_arguments)]
fn enqueue_backward(
    q: Queue<'_>,
    loaded: &Loaded,
    sel: &Selection,
    dims: FlashDims,
    split: BwdSplit,
    causal: bool,
    scale: f32,
    ptrs: BwdPtrs,
) -> Result<()> {
    let launches = launches_for(sel, &dims, split)?;
    let layout = BwdLayout::new(sel, &dims, split);
    let (nq, nk) = (dims.q_len as i32, dims.kv_len as i32);
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let causal = causal as i32;
    let rows = dims.rows() as i64;
    let delta = ptrs.workspace;
    let dq_acc = ptrs.workspace + layout.acc as u64;
    let kv_acc = dq_acc + layout.dq_acc as u64;
    let counters = kv_acc + layout.kv_acc as u64;
    let acc_float4s = (layout.zeroed() / 16) as i64;
    let (whole, splits) = (split.whole as i32, split.splits as i32);
    let p = &ptrs;
    for launch in &launches {
        match launch.step {
            Step::PreF32 => run(q, loaded, launch, &[&p.out, &p.d_out, &delta, &rows])?,
            Step::Pre => {
                let a: [&dyn KernelArg; 6] =
                    [&p.out, &p.d_out, &delta, &dq_acc, &acc_float4s, &rows];
                run(q, loaded, launch, &a)?
            }
            Step::DqF32 => {
                let a: [&dyn KernelArg; 12] = [
                    &p.q,
                    &p.k,
                    &p.v,
                    &p.d_out,
                    &p.lse,
                    &delta,
                    &p.dq,
                    &nq,
                    &nk,
                    &scale,
                    &scale_log2,
                    &causal,
                ];
                run(q, loaded, launch, &a)?
            }
            Step::DkvF32 => {
                let a: [&dyn KernelArg; 13] = [
                    &p.q,
                    &p.k,
                    &p.v,
                    &p.d_out,
                    &p.lse,
                    &delta,
                    &p.dk,
                    &p.dv,
                    &nq,
                    &nk,
                    &scale,
                    &scale_log2,
                    &causal,
                ];
                run(q, loaded, launch, &a)?
            }
            Step::BackwardMma => {
                let a: [&dyn KernelArg; 14] = [
                    &p.q,
                    &p.k,
                    &p.v,
                    &p.d_out,
                    &p.lse,
                    &delta,
                    &dq_acc,
                    &p.dk,
                    &p.dv,
                    &nq,
                    &nk,
                    &scale,
                    &scale_log2,
                    &causal,
                ];
                run(q, loaded, launch, &a)?
            }
            Step::BackwardWgmma => {
                let a: [&dyn KernelArg; 18] = [
                    &p.q,
                    &p.k,
                    &p.v,
                    &p.d_out,
                    &p.lse,
                    &delta,
                    &dq_acc,
                    &p.dk,
                    &p.dv,
                    &kv_acc,
                    &counters,
                    &nq,
                    &nk,
                    &scale,
                    &scale_log2,
                    &causal,
                    &whole,
                    &splits,
                ];
                run(q, loaded, launch, &a)?
            }
            Step::Post => {
                let n = (dims.rows() * dims.head_dim) as i64;
                run(q, loaded, launch, &[&dq_acc, &p.dq, &n, &scale])?
            }
            Step::PostTiled => run(q, loaded, launch, &[&dq_acc, &p.dq, &nq, &scale])?,
            s => unreachable!("{s:?} is no backward step"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOPPER: (i32, i32) = (9, 0);
    const AMPERE: (i32, i32) = (8, 0);

    fn dims(d: usize) -> FlashDims {
        FlashDims {
            batch: 8,
            heads: 32,
            q_len: 2048,
            kv_len: 1000,
            head_dim: d,
        }
    }

    /// The H200's multiprocessor count.
    const SMS: u32 = 132;

    fn names(launches: &[Launch]) -> Vec<&str> {
        launches.iter().map(|l| l.name.as_str()).collect()
    }

    #[test]
    fn hopper_bf16_d128_uses_the_wgmma_kernels() {
        let sel = select(FlashDType::BF16, 128, HOPPER).unwrap();
        assert_eq!(
            (sel.fwd, sel.bwd),
            (FwdKernel::Wgmma(WgFwd::Ring), BwdKernel::Wgmma)
        );
        let f = forward_launches(&sel, &dims(128), SMS).unwrap();
        assert_eq!(names(&f), ["flash_fwd_wg_bf16_d128_ring"]);
        // Q (256 x 128), 4 stages of K and V (64 x 128 each), 8 mbarriers.
        assert_eq!(
            (f[0].grid, f[0].block, f[0].smem),
            ((8, 256, 1), 512, 196_672)
        );
        let variant = |v| {
            let sel = Selection {
                fwd: FwdKernel::Wgmma(v),
                ..sel
            };
            let l = forward_launches(&sel, &dims(128), SMS).unwrap().remove(0);
            (l.name, l.smem)
        };
        assert_eq!(
            variant(WgFwd::RingTurns),
            ("flash_fwd_wg_bf16_d128_ring_t".to_string(), 196_672)
        );
        assert_eq!(
            variant(WgFwd::Barrier),
            ("flash_fwd_wg_bf16_d128_g4_c64".to_string(), 131_072)
        );
        // The tuner's choices: all three where the forward runs unsplit, none
        // where it splits (one slice) or another family runs.
        assert_eq!(
            forward_variants(FlashDType::BF16, &dims(128), HOPPER, SMS),
            WgFwd::ALL
        );
        let slice = FlashDims {
            batch: 1,
            heads: 1,
            ..dims(128)
        };
        assert!(forward_variants(FlashDType::BF16, &slice, HOPPER, SMS).is_empty());
        assert!(forward_variants(FlashDType::BF16, &dims(128), AMPERE, SMS).is_empty());
        assert!(forward_variants(FlashDType::F32, &dims(128), HOPPER, SMS).is_empty());
        let b = backward_launches(&sel, &dims(128), SMS, false).unwrap();
        assert_eq!(
            names(&b),
            [
                "flash_bwd_pre_bf16_d128",
                "flash_bwd_wg_bf16_d128",
                "flash_bwd_post_wg_bf16"
            ]
        );
        // ceil(1000 / 128) = 8 key blocks x 256 = 2048 items = 15 waves of 132 and 68
        // items, which split in 132 / 68 = 1: all whole.
        assert_eq!((b[1].grid, b[1].smem), ((2048, 1, 1), 198_184));
        assert_eq!(b[0].grid.0 as usize, (8 * 32 * 2048usize).div_ceil(64));
        // One block per fragment tile of dQ: 32 tiles of 64 rows x 256 (batch x heads).
        assert_eq!(b[2].grid.0 as usize, 32 * 256);
        assert_eq!(forward_workspace_bytes_for(&sel, &dims(128), SMS), 0);
    }

    #[test]
    fn small_batch_times_heads_splits_the_wgmma_kernels() {
        let sel = select(FlashDType::BF16, 128, HOPPER).unwrap();
        // One (1, 1, 2048, 128) slice: 8 query blocks of 256, 16 key blocks of 128.
        let slice = FlashDims {
            batch: 1,
            heads: 1,
            q_len: 2048,
            kv_len: 2048,
            head_dim: 128,
        };
        assert_eq!(forward_splits(&sel, &slice, SMS), 8); // 132 / (2 * 8)
        let all = BwdSplit {
            items: 16,
            whole: 0,
            splits: 8, // 132 / 16
        };
        for causal in [false, true] {
            assert_eq!(backward_split(&sel, &slice, SMS, causal), all);
        }
        let f = forward_launches(&sel, &slice, SMS).unwrap();
        assert_eq!(
            names(&f),
            [
                "flash_fwd_wg_split_bf16_d128",
                "flash_fwd_combine_bf16_d128"
            ]
        );
        assert_eq!(f[0].grid, (8, 1, 8));
        assert_eq!(f[1].grid, (32 * 2048 / 256, 1, 1));
        let b = backward_launches(&sel, &slice, SMS, false).unwrap();
        assert_eq!(b[1].grid, (16 * 8, 1, 1));
        // dK and dV are summed by each item's last block: only dQ is converted.
        let steps: Vec<Step> = b.iter().map(|l| l.step).collect();
        assert_eq!(steps, [Step::Pre, Step::BackwardWgmma, Step::PostTiled]);
        // Partials: 8 splits x (2048 x 128 f32 + 2048 (max, sum) pairs).
        assert_eq!(
            forward_workspace_bytes_for(&sel, &slice, SMS),
            8 * (2048 * 128 * 4 + 2048 * 8)
        );
        // Delta, the dQ accumulator, 16 items' dK and dV tiles (2 warpgroups x 64 keys
        // each), their 16 counters.
        assert_eq!(
            backward_workspace_bytes_for(&sel, &slice, SMS),
            2048 * 4 + 2048 * 128 * 4 + 16 * 4 * 64 * 128 * 4 + 64
        );
        // Too few key tiles to split: a 100-key sequence stays whole.
        let short = FlashDims {
            kv_len: 100,
            q_len: 100,
            ..slice
        };
        assert_eq!(forward_splits(&sel, &short, SMS), 1);
        assert_eq!(backward_split(&sel, &short, SMS, false).split_items(), 0);
        // Other kernel families never split.
        let mma = select(FlashDType::BF16, 64, HOPPER).unwrap();
        assert_eq!(forward_splits(&mma, &slice, SMS), 1);
        assert_eq!(backward_split(&mma, &slice, SMS, false).split_items(), 0);
    }

    #[test]
    fn other_devices_and_head_dims_use_mma_sync() {
        let sel = select(FlashDType::F16, 128, AMPERE).unwrap();
        let f = &forward_launches(&sel, &dims(128), SMS).unwrap()[0];
        assert_eq!(f.name, "flash_fwd_f16_d128_w4_c64");
        assert_eq!(f.smem, (64 * 136 + 4 * 64 * 136) * 2);
        let b = backward_launches(&sel, &dims(128), SMS, false).unwrap();
        assert_eq!(b[1].name, "flash_bwd_f16_d128_w8_r32");
        assert_eq!(
            b[1].smem,
            (2 * 128 * 136 + 4 * 32 * 136 + 128 * 40) * 2 + 16 * 32
        );
        assert_eq!(b[1].grid.0, 8);
        assert_eq!(b[2].name, "flash_bwd_post_f16");
        let sel = select(FlashDType::BF16, 64, HOPPER).unwrap();
        let b = backward_launches(&sel, &dims(64), SMS, false).unwrap();
        assert_eq!(b[1].name, "flash_bwd_bf16_d64_w8_r64");
    }

    #[test]
    fn f32_covers_multiples_of_32_up_to_256() {
        for d in (32..=256).step_by(32) {
            let sel = select(FlashDType::F32, d, HOPPER).unwrap();
            let b = backward_launches(&sel, &dims(d), SMS, false).unwrap();
            assert_eq!(b.len(), 3);
            assert_eq!(b[2].name, format!("flash_bwd_dkv_f32_d{d}"));
        }
        for d in [0, 16, 48, 288] {
            let e = select(FlashDType::F32, d, HOPPER).unwrap_err();
            assert!(matches!(e, FlashError::Unsupported(_)), "{e}");
            assert!(
                e.to_string().contains(&format!("head dim {d} with f32")),
                "{e}"
            );
        }
    }

    #[test]
    fn unsupported_combinations_are_errors_that_say_what() {
        let e = select(FlashDType::BF16, 96, HOPPER).unwrap_err();
        assert_eq!(
            e.to_string(),
            "flash_attention: head dim 96 with bf16: the tensor-core kernels cover head dims \
             64 and 128 (f32 covers multiples of 32 up to 256)"
        );
        let e = select(FlashDType::F16, 64, (7, 5)).unwrap_err();
        assert!(
            e.to_string().contains("compute capability 8.0 or newer"),
            "{e}"
        );
        assert!(e.to_string().contains("7.5"), "{e}");
        let huge = FlashDims {
            batch: 300,
            heads: 256,
            ..dims(64)
        };
        let sel = select(FlashDType::F16, 64, HOPPER).unwrap();
        let e = forward_launches(&sel, &huge, SMS).unwrap_err();
        assert!(e.to_string().contains("300 x 256 = 76800"), "{e}");
        assert!(check_dims(&dims(64), f32::NAN).is_err());
    }

    #[test]
    fn workspace_holds_delta_and_the_f32_dq_accumulator() {
        let d = dims(128);
        let rows = 8 * 32 * 2048;
        let ws = |t, cc, d: &FlashDims| {
            backward_workspace_bytes_for(&select(t, d.head_dim, cc).unwrap(), d, SMS)
        };
        assert_eq!(ws(FlashDType::F32, HOPPER, &d), rows * 4);
        // bf16 at (8, 32, 2048, D 128), kv_len 2048: the backward runs in 16 groups of 16
        // heads (256 items) on two lanes; only the last group splits, its last 4 items
        // (4096 = 31 x 132 + 4) in 16 pieces each. Each lane's workspace holds its
        // largest group's Delta and dQ accumulator (and the last group's dK/dV slots).
        let sel = select(FlashDType::BF16, 128, HOPPER).unwrap();
        let seed = FlashDims { kv_len: 2048, ..d };
        assert_eq!(backward_group(&sel, &seed), 16);
        let plan = backward_plan(&sel, &seed, SMS, false);
        assert_eq!(plan.lanes, 2);
        assert_eq!(plan.groups.len(), 16);
        let unsplit = |items| BwdSplit {
            items,
            whole: items,
            splits: 1,
        };
        for (i, g) in plan.groups[..15].iter().enumerate() {
            assert_eq!((g.first, g.n, g.split), (16 * i, 16, unsplit(256)));
        }
        let last = plan.groups[15];
        assert_eq!((last.first, last.n), (240, 16));
        assert_eq!(
            last.split,
            BwdSplit {
                items: 256,
                whole: 252,
                splits: 16
            }
        );
        assert_eq!(last.split.blocks(), 252 + 4 * 16);
        // Causal items differ in cost: none split.
        let causal = backward_plan(&sel, &seed, SMS, true);
        assert!(causal.groups.iter().all(|g| g.split.split_items() == 0));
        let layout = |n, split| BwdLayout::new(&sel, &group_dims(&seed, n), split).bytes();
        assert_eq!(
            layout(16, last.split),
            16 * 2048 * 4 + 16 * 2048 * 128 * 4 + 4 * 4 * 64 * 128 * 4 + 16
        );
        assert_eq!(
            ws(FlashDType::BF16, HOPPER, &seed),
            layout(16, last.split).div_ceil(256) * 256 + layout(16, last.split)
        );
        // Within the budget everything is one group on the caller's stream, split as
        // one launch.
        let one = FlashDims {
            heads: 1,
            batch: 1,
            ..seed
        };
        let thirty_two = FlashDims { heads: 32, ..one };
        assert_eq!(backward_group(&sel, &thirty_two), 32);
        let plan = backward_plan(&sel, &thirty_two, SMS, false);
        assert_eq!(plan.lanes, 1);
        assert_eq!(plan.groups.len(), 1);
        assert_eq!(
            plan.groups[0].split,
            backward_split(&sel, &thirty_two, SMS, false)
        );
        // 40 heads: two lanes' groups of 16, 16 and 8 (640 items = 4 x 132 + 112: the
        // last group's 128 items, 112 of them past the last wave, one piece each fits).
        let forty = FlashDims { heads: 40, ..one };
        let plan = backward_plan(&sel, &forty, SMS, false);
        let ns: Vec<usize> = plan.groups.iter().map(|g| g.n).collect();
        assert_eq!(ns, [16, 16, 8]);
        assert_eq!(plan.groups[2].split, unsplit(128));
        // 33 heads: 16, 16 and 1 (528 items = 4 waves exactly): nothing split.
        let plan = backward_plan(&sel, &FlashDims { heads: 33, ..one }, SMS, false);
        assert!(plan.groups.iter().all(|g| g.split.split_items() == 0));
        // wgmma: dQ in whole 64-row tiles; mma.sync: row-major.
        let odd = FlashDims {
            q_len: 3,
            batch: 1,
            heads: 1,
            kv_len: 1000,
            ..d
        };
        assert_eq!(ws(FlashDType::F16, HOPPER, &odd), 256 + 64 * 128 * 4);
        assert_eq!(ws(FlashDType::F16, AMPERE, &odd), 256 + 3 * 128 * 4);
    }

    #[test]
    fn hopper_target_is_the_architecture_specific_one() {
        assert_eq!(arch_for((9, 0)), "sm_90a");
        assert_eq!(arch_for((8, 6)), "sm_86");
        assert_eq!(arch_for((10, 0)), "sm_100");
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
                let ptx = compile(dtype, target).unwrap_or_else(|e| panic!("{e}"));
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
