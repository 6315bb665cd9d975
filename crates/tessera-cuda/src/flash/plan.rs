//! The kernels' launches: entry points, grids, blocks and dynamic shared memory for a
//! selection at given dims (pure). Shared memory sizes follow the table at the end of
//! the .cu file.

use tessera::error::{Error, ErrorKind};

use super::select::{BwdKernel, FwdKernel, Selection};
use super::work::{backward_split, forward_splits, BwdSplit};
use super::{shape_err, FlashDims, Result, OP};

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

pub(super) fn blocks(n: usize, per_block: usize) -> Result<u32> {
    u32::try_from(n.div_ceil(per_block))
        .map_err(|_| shape_err(format!("{n} rows need more than 2^32 blocks")))
}

/// Rows per fragment tile of the wgmma kernels' f32 workspaces (64 x 128 f32, 32 KB).
pub(super) const TILE_ROWS: usize = 64;
/// Query rows per block of the bf16/f16 pre-kernel (`PRE_ROWS` in the .cu).
const PRE_ROWS: usize = 64;
pub(super) const WG_FWD_ROWS: usize = 256;
pub(super) const WG_BWD_KEYS: usize = 128;
pub(super) const WG_FWD_SMEM: u32 = (256 * 128 + 4 * 64 * 128) * 2;
/// The wgmma backward: K and V, 3 ring stages of Q/dO tiles, 2 dS^T buffers (bf16),
/// 3 stages of lse/Delta (f32) and 5 mbarriers.
const WG_BWD_SMEM: u32 = (2 * 128 * 128 + 6 * 64 * 128 + 2 * 128 * 64) * 2 + 6 * 64 * 4 + 5 * 8;

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
pub(super) fn launches_for(
    sel: &Selection,
    dims: &FlashDims,
    split: BwdSplit,
) -> Result<Vec<Launch>> {
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
                    shape_err(format!(
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

pub(super) fn bh_dim(dims: &FlashDims) -> Result<u32> {
    let bh = dims.batch * dims.heads;
    if bh > 65_535 {
        return Err(shape_err(format!(
            "batch x heads = {} x {} = {bh} exceeds the 65535 blocks of a grid's y dimension",
            dims.batch, dims.heads
        )));
    }
    Ok(bh as u32)
}

/// Dims and scale the kernels can take: lengths within their 32-bit row indices, a
/// finite scale.
pub(super) fn check_dims(dims: &FlashDims, scale: f32) -> Result<()> {
    let lens = [dims.q_len, dims.kv_len];
    if lens.iter().any(|&n| n > i32::MAX as usize) {
        return Err(shape_err(format!(
            "q_len {} / kv_len {} exceed the kernels' 32-bit row indices",
            dims.q_len, dims.kv_len
        )));
    }
    if !scale.is_finite() {
        return Err(Error::op(
            ErrorKind::Argument,
            OP,
            format!("scale must be finite, got {scale}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::*;
    use super::*;

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
    fn f32_runs_three_kernels_for_every_head_dim() {
        for d in (32..=256).step_by(32) {
            let sel = select(FlashDType::F32, d, HOPPER).unwrap();
            let b = backward_launches(&sel, &dims(d), SMS, false).unwrap();
            assert_eq!(
                names(&b),
                [
                    format!("flash_bwd_pre_f32_d{d}"),
                    format!("flash_bwd_dq_f32_d{d}"),
                    format!("flash_bwd_dkv_f32_d{d}")
                ]
            );
            let f = forward_launches(&sel, &dims(d), SMS).unwrap();
            assert_eq!(names(&f), [format!("flash_fwd_f32_d{d}")]);
        }
    }

    #[test]
    fn dims_beyond_the_grid_or_the_indices_are_errors_that_say_what() {
        let huge = FlashDims {
            batch: 300,
            heads: 256,
            ..dims(64)
        };
        let sel = select(FlashDType::F16, 64, HOPPER).unwrap();
        let e = forward_launches(&sel, &huge, SMS).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Shape);
        assert!(e.to_string().contains("300 x 256 = 76800"), "{e}");
        let e = check_dims(&dims(64), f32::NAN).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Argument);
        assert_eq!(
            e.to_string(),
            "flash_attention: scale must be finite, got NaN"
        );
        let long = FlashDims {
            kv_len: 1 << 31,
            ..dims(64)
        };
        let e = check_dims(&long, 1.0).unwrap_err();
        assert!(e.to_string().contains("32-bit row indices"), "{e}");
        assert!(check_dims(&dims(64), 0.125).is_ok());
    }
}
