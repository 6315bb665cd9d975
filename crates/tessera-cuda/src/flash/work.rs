//! How the work spreads (pure): the wgmma kernels' splits of key or query tiles over
//! several blocks when batch x heads is too small to fill the GPU, the backward's launch
//! groups and lanes when its f32 accumulators would not fit in [`ACC_BUDGET`], and the
//! workspaces all that takes.

use super::plan::{TILE_ROWS, WG_BWD_KEYS, WG_FWD_ROWS};
use super::select::{BwdKernel, FwdKernel, Selection};
use super::FlashDims;

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

/// Byte offsets of the parts of the backward's workspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct BwdLayout {
    /// f32 Delta per query row at 0; from `acc` on, zeroed by the pre-kernel: the f32
    /// dQ accumulator (`dq_acc` bytes), then for the wgmma backward's split items their
    /// dK/dV accumulators (`kv_acc` bytes: per item, each warpgroup's 64 x 128 dK tile
    /// then its dV tile) and their i32 piece counters (`counters` bytes).
    pub(super) acc: usize,
    pub(super) dq_acc: usize,
    pub(super) kv_acc: usize,
    pub(super) counters: usize,
}

impl BwdLayout {
    pub(super) fn new(sel: &Selection, dims: &FlashDims, split: BwdSplit) -> BwdLayout {
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
    pub(super) fn zeroed(&self) -> usize {
        self.dq_acc + self.kv_acc + self.counters
    }

    pub(super) fn bytes(&self) -> usize {
        self.acc + self.zeroed()
    }
}

/// Bytes of f32 scratch [`flash_backward`](super::flash_backward) needs for `sel` at `dims` on a device of
/// `sms` multiprocessors: per lane ([`backward_plan`]), for the largest of its launch
/// groups, Delta (one f32 per query row, padded to 256 bytes) and, for bf16/f16, the
/// f32 dQ accumulator (and dK, dV ones for split items).
pub fn backward_workspace_bytes_for(sel: &Selection, dims: &FlashDims, sms: u32) -> usize {
    // Without causal masking at least as many items split as with it.
    let plan = backward_plan(sel, dims, sms, false);
    plan.workspace_bytes(sel, dims)
}

/// `dims` narrowed to one launch group of `n` batch x heads.
pub(super) fn group_dims(dims: &FlashDims, n: usize) -> FlashDims {
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
/// ones ([`flash_backward`](super::flash_backward)). On one stream each group boundary cost the main kernel's
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
    pub(super) fn lane_stride(&self, sel: &Selection, dims: &FlashDims) -> usize {
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

/// Bytes of f32 scratch [`flash_forward`](super::flash_forward) needs: the split forward's partial outputs
/// (fragment-tiled f32) and per-row (max, sum) pairs; 0 when it does not split.
pub fn forward_workspace_bytes_for(sel: &Selection, dims: &FlashDims, sms: u32) -> usize {
    let (splits, bh) = (forward_splits(sel, dims, sms), dims.batch * dims.heads);
    if splits == 1 {
        return 0;
    }
    let part = dims.q_len.div_ceil(TILE_ROWS) * TILE_ROWS * bh * sel.head_dim * 4;
    splits * (part + bh * dims.q_len * 8)
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::*;
    use super::*;

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
}
