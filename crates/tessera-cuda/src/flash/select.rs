//! Which kernels serve a call: by dtype, head dim and compute capability (pure).

use super::plan::WG_FWD_SMEM;
use super::work::forward_splits;
use super::{unsupported, FlashDType, FlashDims, Result};

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
    pub(super) fn suffix(self) -> &'static str {
        match self {
            WgFwd::Ring => "_ring",
            WgFwd::RingTurns => "_ring_t",
            WgFwd::Barrier => "_g4_c64",
        }
    }

    /// Dynamic shared memory: Q (256 rows) and the K/V stages (2 for the barrier
    /// version, 4 for the ring plus its 8 mbarriers).
    pub(super) fn smem(self) -> u32 {
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
        return Err(unsupported(format!(
            "needs a GPU of compute capability 8.0 or newer (cp.async, bf16 tensor cores); \
             this one is {}.{}",
            cc.0, cc.1
        )));
    }
    let (fwd, bwd) = match dtype {
        FlashDType::F32 => {
            if head_dim == 0 || !head_dim.is_multiple_of(32) || head_dim > 256 {
                return Err(unsupported(format!(
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
                return Err(unsupported(format!(
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

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::*;
    use tessera::error::ErrorKind;

    #[test]
    fn hopper_target_is_the_architecture_specific_one() {
        assert_eq!(arch_for((9, 0)), "sm_90a");
        assert_eq!(arch_for((8, 6)), "sm_86");
        assert_eq!(arch_for((10, 0)), "sm_100");
    }

    #[test]
    fn the_families_by_dtype_head_dim_and_device() {
        let sel = |t, d, cc| {
            let s = select(t, d, cc).unwrap();
            (s.fwd, s.bwd)
        };
        assert_eq!(
            sel(FlashDType::BF16, 128, HOPPER),
            (FwdKernel::Wgmma(WgFwd::Ring), BwdKernel::Wgmma)
        );
        let mma = |key_tile, q_tile| {
            (
                FwdKernel::Mma { warps: 4, key_tile },
                BwdKernel::Mma { warps: 8, q_tile },
            )
        };
        assert_eq!(sel(FlashDType::F16, 128, AMPERE), mma(64, 32));
        assert_eq!(sel(FlashDType::BF16, 64, HOPPER), mma(64, 64));
        assert_eq!(
            sel(FlashDType::F32, 128, HOPPER),
            (FwdKernel::F32, BwdKernel::F32)
        );
        for d in (32..=256).step_by(32) {
            assert_eq!(
                sel(FlashDType::F32, d, AMPERE),
                (FwdKernel::F32, BwdKernel::F32)
            );
        }
    }

    #[test]
    fn unsupported_combinations_are_errors_that_say_what() {
        let e = select(FlashDType::BF16, 96, HOPPER).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Unsupported);
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
        for d in [0, 16, 48, 288] {
            let e = select(FlashDType::F32, d, HOPPER).unwrap_err();
            assert_eq!(e.kind, ErrorKind::Unsupported, "{e}");
            assert!(
                e.to_string().contains(&format!("head dim {d} with f32")),
                "{e}"
            );
        }
    }

    #[test]
    fn the_tuner_chooses_only_where_the_unsplit_wgmma_forward_runs() {
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
        assert!(forward_variants(FlashDType::BF16, &dims(96), HOPPER, SMS).is_empty());
    }
}
