//! Matmul with `torch.matmul` semantics.
//!
//! Floats go through the `gemm` crate, which takes arbitrary element strides
//! for both operands: transposed and sliced views are multiplied in place,
//! and a broadcast batch dim is just a repeated base offset. Nothing is
//! copied on the f32/f64/f16 path except the output being written.
//!
//! Thin f32 products (a short inner dim or a narrow result: attention's
//! `q·kᵀ`, `p·v` and their gradients, whose head dim is 64) take another
//! path ([`thin_storage`]): flash attention's register micro-tiles over
//! 64-column panels of `B` (32 without AVX-512), packed 32 KiB at a time on
//! the stack when `B`'s rows are not contiguous. gemm packs both operands
//! for every call, which at these sizes costs as much as the product
//! (BENCHMARKS.md has the six attention products next to PyTorch's).

use std::collections::HashMap;
use std::sync::Mutex;

use rayon::prelude::*;

use super::element::Int;
use super::element::{Element, Float};
use super::Storage;
use crate::error::{op_err, Result};
use crate::ir::{DType, Op};
use crate::logging::log;
use crate::runtime::array::Array;
use crate::runtime::layout::Layout;

/// Per-matmul work (m·n·k) from which one gemm call is split over threads;
/// gemm's own default threading threshold, so we never ask for threads it
/// would not use.
const GEMM_PAR_WORK: usize = 48 * 48 * 256;

/// Work (m·n·k summed over a task's matmuls) below which a rayon task is not
/// worth its fork.
const TASK_WORK: usize = 1 << 16;

/// `a @ b` into a new contiguous tensor of `out_shape`.
pub fn matmul(a: &Array, b: &Array, out_shape: &[usize]) -> Result<Array> {
    let plan = Plan::new(a.layout(), b.layout(), out_shape);
    let out = match a.dtype() {
        DType::F32 if is_thin(&plan) => thin_or_gemm(&plan, a.storage(), b.storage()),
        DType::F32 => gemm_storage::<f32>(&plan, a.storage(), b.storage()),
        DType::F64 => gemm_storage::<f64>(&plan, a.storage(), b.storage()),
        DType::F16 => return Ok(matmul_via_f32::<half::f16>(a, b, out_shape)),
        DType::BF16 => return Ok(matmul_via_f32::<half::bf16>(a, b, out_shape)),
        d => crate::with_int_dtype!(d, T => int_storage::<T>(&plan, a.storage(), b.storage()),
            _ => return Err(op_err!(DType, "matmul", "is not defined for {d}"))),
    };
    Ok(Array::from_storage(out, out_shape))
}

/// `a' @ b'` where `a'` is `a` with its last two dims swapped when
/// `transpose_a` (likewise `b'`). The swap is a strided view, which gemm
/// reads in place: nothing is copied.
pub fn matmul_t(
    a: &Array,
    b: &Array,
    transpose_a: bool,
    transpose_b: bool,
    out_shape: &[usize],
) -> Result<Array> {
    matmul(
        &swapped_last2(a, transpose_a),
        &swapped_last2(b, transpose_b),
        out_shape,
    )
}

/// The operand transposes of a matmul op (`matmul_t`'s flags; none for
/// `matmul` and any other op).
pub fn transposes(op: &Op) -> (bool, bool) {
    match *op {
        Op::MatMulT {
            transpose_a,
            transpose_b,
        } => (transpose_a, transpose_b),
        _ => (false, false),
    }
}

/// A view of `x` with its last two dims swapped (`x` itself unless `swap`).
fn swapped_last2(x: &Array, swap: bool) -> Array {
    if !swap {
        return x.clone();
    }
    Array::from_parts(x.storage().clone(), swapped_layout(x.layout(), true))
}

/// `l` with its last two dims swapped when `swap`.
fn swapped_layout(l: &Layout, swap: bool) -> Layout {
    let r = l.rank();
    if !swap || r < 2 {
        return l.clone();
    }
    let mut perm: Vec<usize> = (0..r).collect();
    perm.swap(r - 2, r - 1);
    l.permuted(&perm)
}

/// One batched matmul in strided form: `batch` products of an m×k and a k×n
/// matrix, written row-major and back to back into the output.
#[derive(Debug)]
struct Plan {
    m: usize,
    n: usize,
    k: usize,
    /// Row and column strides of the left and right matrices.
    a_rs: usize,
    a_cs: usize,
    b_rs: usize,
    b_cs: usize,
    /// Where each batch's matrices start: `offset_of(batch index)`.
    a_batch: Layout,
    b_batch: Layout,
}

impl Plan {
    fn new(a: &Layout, b: &Layout, out_shape: &[usize]) -> Plan {
        let a = promote(a, 0);
        let b = promote(b, 1);
        let (ra, rb) = (a.rank(), b.rank());
        let batch_shape = &out_shape[..ra.max(rb) - 2];
        let plan = Plan {
            m: a.shape[ra - 2],
            n: b.shape[rb - 1],
            k: a.shape[ra - 1],
            a_rs: a.strides[ra - 2],
            a_cs: a.strides[ra - 1],
            b_rs: b.strides[rb - 2],
            b_cs: b.strides[rb - 1],
            a_batch: batch_layout(&a, batch_shape),
            b_batch: batch_layout(&b, batch_shape),
        };
        plan.fold_batch_into_rows()
    }

    fn batch(&self) -> usize {
        self.a_batch.numel()
    }

    /// (batch, rows per matrix, columns): blocked products alike in these
    /// are split into the same blocks of rows.
    fn rows(&self) -> (usize, usize, usize) {
        (self.batch(), self.m, self.n)
    }

    /// When every batch shares the right matrix and the left matrices' rows
    /// follow one another at a uniform stride (e.g. `[B, T, C] @ [C, D]`),
    /// the batch is one tall matmul: a single, better-parallelised gemm call.
    /// The output rows are contiguous, so they always line up.
    fn fold_batch_into_rows(mut self) -> Plan {
        let b = &self.b_batch;
        let b_shared = b
            .shape
            .iter()
            .zip(&b.strides)
            .all(|(&n, &s)| n == 1 || s == 0);
        if self.batch() <= 1 || !b_shared {
            return self;
        }
        let dims = self.a_batch.shape.iter().zip(&self.a_batch.strides);
        let rows: Vec<(usize, usize)> = dims
            .map(|(&s, &st)| (s, st))
            .chain([(self.m, self.a_rs)])
            .filter(|&(s, _)| s != 1)
            .collect();
        let uniform = rows.windows(2).all(|w| w[0].1 == w[1].0 * w[1].1);
        if !uniform {
            return self;
        }
        self.m *= self.batch();
        self.a_rs = rows.last().map_or(self.a_rs, |&(_, st)| st);
        self.a_batch = Layout {
            shape: vec![],
            strides: vec![],
            offset: self.a_batch.offset,
        };
        self.b_batch.shape.clear();
        self.b_batch.strides.clear();
        self
    }

    /// The storage offsets of batch `i`'s left and right matrices.
    fn offsets(&self, i: usize) -> (usize, usize) {
        (self.a_batch.offset_of(i), self.b_batch.offset_of(i))
    }

    /// Batches per rayon task, or `None` when the batch loop should stay on
    /// this thread (few matmuls, or ones large enough to split internally).
    fn batches_per_task(&self) -> Option<usize> {
        let work = self.m * self.n * self.k;
        let parallel = self.batch() > 1 && work < GEMM_PAR_WORK && work * self.batch() > TASK_WORK;
        parallel.then(|| (TASK_WORK / work.max(1)).max(1))
    }
}

/// `x`'s layout with a 1-D operand promoted to a matrix: `[k]` becomes
/// `[1, k]` on the left (`at = 0`) and `[k, 1]` on the right (`at = 1`).
fn promote(x: &Layout, at: usize) -> Layout {
    let mut l = x.clone();
    if l.rank() == 1 {
        l.shape.insert(at, 1);
        l.strides.insert(at, 0);
    }
    l
}

/// The batch dims of the (promoted) operand `x`, broadcast to `batch_shape`.
fn batch_layout(x: &Layout, batch_shape: &[usize]) -> Layout {
    let r = x.rank() - 2;
    Layout {
        shape: x.shape[..r].to_vec(),
        strides: x.strides[..r].to_vec(),
        offset: x.offset,
    }
    .expanded(batch_shape)
}

/// The element types the gemm crate multiplies natively (gemm panics on
/// any other `T`; this bound makes that a compile error instead).
trait GemmElement: Element {}
impl GemmElement for f32 {}
impl GemmElement for f64 {}
impl GemmElement for half::f16 {}

/// Columns of `B` per panel, at most (`flash::tile_cols`: one micro-tile's
/// width), and rows of `B` per pass over the result: a panel is at most
/// 32 KiB, in L1.
const PANEL_COLS: usize = 64;
const PANEL_K: usize = 128;

/// Whether `plan` is a thin f32 product for [`thin_storage`]: an inner dim
/// or a result width of at most 256 (one that gemm's packing does not pay
/// for), and at least a micro-tile's worth of rows and columns.
fn is_thin(plan: &Plan) -> bool {
    thin_dims(plan.m, plan.n, plan.k) && super::flash::simd_tiles()
}

/// Whether an m×k by k×n product has thin dims (see `is_thin`).
pub fn thin_dims(m: usize, n: usize, k: usize) -> bool {
    m >= 16 && n >= 16 && k > 0 && k.min(n) <= 256
}

/// Work (m·n·k) from which a single thin product is raced (see
/// [`thin_or_gemm`]): a linear layer's over a thousand tokens.
const RACE_WORK: usize = 1 << 24;

/// The layouts of a raced product: (m, n, k) and the operands' row and
/// column strides.
type RaceKey = (usize, usize, usize, [usize; 4]);

/// The kernel each raced layout runs with: `true` for the micro-tiles.
static RACED: Mutex<Option<HashMap<RaceKey, bool>>> = Mutex::new(None);

/// `plan`'s thin f32 product by the micro-tiles or by gemm. The tiles win
/// at attention's sizes (many small products), but a single large product
/// (a linear layer over a thousand tokens: `x·W`, `dy·Wᵀ`, `xᵀ·dy`) runs
/// up to 1.7× faster one way or the other depending on its layouts and
/// the machine, with no rule that held across the GPT's products (example
/// `gpt_matmuls`). So the first product of each layout is timed both ways,
/// alternately, best of three, and the faster kept for the process (as
/// cuDNN's benchmark mode does; `autotune::race`); the race's own
/// products are the results.
/// Both sum in f32; their roundings differ, so one process's choice is
/// fixed once made (eager and compiled calls share it).
fn thin_or_gemm(plan: &Plan, a: &Storage, b: &Storage) -> Storage {
    if plan.batch() != 1 || plan.m * plan.n * plan.k < RACE_WORK {
        return thin_storage(plan, a, b);
    }
    let key = (
        plan.m,
        plan.n,
        plan.k,
        [plan.a_rs, plan.a_cs, plan.b_rs, plan.b_cs],
    );
    let known = RACED
        .lock()
        .ok()
        .and_then(|r| r.as_ref()?.get(&key).copied());
    match known {
        Some(true) => return thin_storage(plan, a, b),
        Some(false) => return gemm_storage::<f32>(plan, a, b),
        None => {}
    }
    let kernels: [&dyn Fn() -> Result<Storage>; 2] = [&|| Ok(thin_storage(plan, a, b)), &|| {
        Ok(gemm_storage::<f32>(plan, a, b))
    }];
    let race = match super::autotune::race(&kernels) {
        Ok(race) => race,
        Err(_) => unreachable!("the kernels do not fail"),
    };
    let (best_thin, best_gemm) = (race.best[0], race.best[1]);
    let tiles = race.winner == 0;
    log("autotune", || {
        format!(
            "matmul {}x{}x{} strides {:?}: micro-tiles {:.3} ms, gemm {:.3} ms; chose {}",
            plan.m,
            plan.n,
            plan.k,
            key.3,
            best_thin * 1e3,
            best_gemm * 1e3,
            if tiles { "micro-tiles" } else { "gemm" }
        )
    });
    if let Ok(mut raced) = RACED.lock() {
        raced.get_or_insert_with(HashMap::new).insert(key, tiles);
    }
    race.result
}

/// `plan`'s f32 product by flash attention's micro-tiles: tasks are
/// (batch, block of rows) pairs spread over rayon; each walks `B` in
/// `PANEL_K × PANEL_COLS` panels and multiplies its rows of `A` by each.
fn thin_storage(plan: &Plan, a: &Storage, b: &Storage) -> Storage {
    let (m, n) = (plan.m, plan.n);
    let mut out = Storage::new(DType::F32, plan.batch() * m * n);
    let (a, b) = (a.as_slice::<f32>(), b.as_slice::<f32>());
    let rows = rows_per_task(plan);
    let block = |i: usize, r0: usize, dst: &mut [f32]| {
        let (a_off, b_off) = plan.offsets(i);
        let r1 = (r0 + rows).min(m);
        thin_block(
            plan,
            &a[a_off + r0 * plan.a_rs..],
            &PanelsOfB::Strided(&b[b_off..]),
            r1 - r0,
            dst,
        );
    };
    let dst = out.as_mut_slice::<f32>();
    if plan.batch() * m * n * plan.k < TASK_WORK {
        for (i, mat) in dst.chunks_mut(m * n).enumerate() {
            for (j, d) in mat.chunks_mut(rows * n).enumerate() {
                block(i, j * rows, d);
            }
        }
    } else {
        dst.par_chunks_mut(m * n).enumerate().for_each(|(i, mat)| {
            mat.par_chunks_mut(rows * n)
                .enumerate()
                .for_each(|(j, d)| block(i, j * rows, d))
        });
    }
    out
}

/// A thin f32 product computed a block of output rows at a time and
/// handed to a consumer while the block is in cache, never written whole:
/// the matmuls of a `matmul + row kernel` (fusion's `Kernel::MatmulRows`,
/// e.g. attention's `q·kᵀ` with its softmax). Same micro-tiles, panels and
/// task split as `thin_storage`.
pub struct BlockedProduct<'a> {
    plan: Plan,
    a: &'a [f32],
    b: &'a [f32],
}

/// Rows of a [`BlockedProduct`]'s block: a multiple of both micro-tile
/// heights (6 and 8) and of the prefetch runs; at a 512-column result
/// 96 KiB, in L2 beside the row kernel's other rows.
pub const BLOCK_ROWS: usize = PREFETCH_ROWS;

impl<'a> BlockedProduct<'a> {
    /// `a' @ b'` of `out_shape` (`a'`, `b'`: `a`, `b` with their last two
    /// dims swapped when `transpose_a`, `transpose_b`), when it is a thin
    /// f32 product this machine computes by tiles (else `None`: the caller
    /// computes it whole).
    pub fn new(
        a: &'a Array,
        b: &'a Array,
        (transpose_a, transpose_b): (bool, bool),
        out_shape: &[usize],
    ) -> Option<BlockedProduct<'a>> {
        let described = [(a.layout(), a.dtype()), (b.layout(), b.dtype())];
        let plan = blocked_plan(described, (transpose_a, transpose_b), out_shape)?;
        Some(BlockedProduct {
            plan,
            a: a.storage().as_slice::<f32>(),
            b: b.storage().as_slice::<f32>(),
        })
    }

    fn rows(&self) -> (usize, usize, usize) {
        self.plan.rows()
    }
}

/// Calls `each(first row, blocks)` for consecutive blocks of at most
/// `BLOCK_ROWS` rows of the `products` (alike: [`alike`]), `blocks[i]`
/// the rows of product `i` (rows of all batches counted row-major, `n`
/// values each), covering every row once, from rayon's threads. Each task
/// packs the `B`s it multiplies once, for all its blocks.
pub fn for_each_block(products: &[BlockedProduct<'_>], each: &(dyn Fn(usize, &[&[f32]]) + Sync)) {
    let Some(first) = products.first() else {
        return;
    };
    assert!(
        alike(products),
        "internal error: blocked products of different rows"
    );
    let (batch, m, n) = first.rows();
    let rows = products
        .iter()
        .map(|p| rows_per_task(&p.plan))
        .min()
        .unwrap_or(m);
    let task = |(i, r0): (usize, usize)| {
        let mut scratch = TASK_SCRATCH.with(|s| s.take());
        scratch.resize_with(products.len(), Default::default);
        let (mut blocks, packs): (Vec<&mut Vec<f32>>, Vec<&mut Vec<f32>>) =
            scratch.iter_mut().map(|(b, p)| (b, p)).unzip();
        let bs: Vec<(PanelsOfB<'_>, usize)> = products
            .iter()
            .zip(packs)
            .map(|(p, pack)| {
                let (a_off, b_off) = p.plan.offsets(i);
                (PanelsOfB::packed(&p.plan, &p.b[b_off..], pack), a_off)
            })
            .collect();
        for block in blocks.iter_mut() {
            block.resize(BLOCK_ROWS.min(m) * n, 0.0);
        }
        let end = (r0 + rows).min(m);
        for s in (r0..end).step_by(BLOCK_ROWS) {
            let count = BLOCK_ROWS.min(end - s);
            for ((p, (b, a_off)), block) in products.iter().zip(&bs).zip(blocks.iter_mut()) {
                let a = &p.a[a_off + s * p.plan.a_rs..];
                thin_block(&p.plan, a, b, count, &mut block[..count * n]);
            }
            let views: Vec<&[f32]> = blocks.iter().map(|b| &b[..count * n]).collect();
            each(i * m + s, &views);
        }
        drop(bs); // its borrows of the packed `B`s end before `scratch` goes back
        TASK_SCRATCH.with(|s| s.set(scratch));
    };
    let tasks: Vec<(usize, usize)> = (0..batch)
        .flat_map(|i| (0..m).step_by(rows).map(move |r| (i, r)))
        .collect();
    let work: usize = products.iter().map(|p| batch * m * n * p.plan.k).sum();
    if work < TASK_WORK {
        tasks.into_iter().for_each(task);
    } else {
        tasks.into_par_iter().for_each(task);
    }
}

/// Whether `products` split into the same blocks of rows (as
/// [`for_each_block`] needs).
pub fn alike(products: &[BlockedProduct<'_>]) -> bool {
    products.windows(2).all(|w| w[0].rows() == w[1].rows())
}

thread_local! {
    /// A [`for_each_block`] task's blocks of the products and their packed
    /// `B`s, kept for the thread's next task: fresh buffers of 100 KiB and
    /// more come from `mmap`, page-faulted and zeroed on first touch (15 %
    /// of the seed's step in `perf` when every task made its own). Taken
    /// out while a task runs, so a nested task would only allocate anew.
    static TASK_SCRATCH: std::cell::Cell<Vec<(Vec<f32>, Vec<f32>)>> =
        const { std::cell::Cell::new(Vec::new()) };
}

/// A product as the memory planner knows it: its operands' layouts and
/// dtypes, their transposes and the output shape.
pub type DescribedProduct<'a> = ([(&'a Layout, DType); 2], (bool, bool), &'a [usize]);

/// Whether [`BlockedProduct::new`] takes each of the products of operands
/// with these layouts and dtypes, and they split alike (the memory planner
/// asks: products the CPU does not take by blocks are computed whole, as
/// the kernel's scratch).
pub fn blocks_products(products: &[DescribedProduct<'_>]) -> bool {
    let plans: Option<Vec<Plan>> = products
        .iter()
        .map(|&(described, transposes, shape)| blocked_plan(described, transposes, shape))
        .collect();
    plans.is_some_and(|plans| plans.windows(2).all(|w| w[0].rows() == w[1].rows()))
}

fn blocked_plan(
    [(a, a_dtype), (b, b_dtype)]: [(&Layout, DType); 2],
    (transpose_a, transpose_b): (bool, bool),
    out_shape: &[usize],
) -> Option<Plan> {
    let f32s = a_dtype == DType::F32 && b_dtype == DType::F32;
    if !f32s || a.rank() < 2 || b.rank() < 2 {
        return None;
    }
    let (a, b) = (
        swapped_layout(a, transpose_a),
        swapped_layout(b, transpose_b),
    );
    let plan = Plan::new(&a, &b, out_shape);
    is_thin(&plan).then_some(plan)
}

/// Rows per task: whole matrices when the batch alone gives every thread a
/// few tasks, else blocks (a multiple of 8 rows, at least 32) that do. Each
/// task packs the `B` panels it uses (when `B`'s rows are strided), a cost
/// of one scalar copy per `rows` vector FMAs: then only one task per thread.
fn rows_per_task(plan: &Plan) -> usize {
    let threads = rayon::current_num_threads();
    let wanted = if plan.b_cs == 1 { 4 * threads } else { threads };
    let per_matrix = wanted.div_ceil(plan.batch().max(1));
    plan.m
        .div_ceil(per_matrix)
        .next_multiple_of(8)
        .max(32)
        .min(plan.m)
}

/// `B` as [`thin_block`] reads it: from its storage (starting at `B`),
/// packed one panel at a time when its rows are strided; or with every
/// panel packed beforehand, in the order `thin_block` walks them (a task
/// that multiplies several blocks of rows by one `B` packs it once).
enum PanelsOfB<'a> {
    Strided(&'a [f32]),
    Packed(&'a [f32]),
}

impl<'a> PanelsOfB<'a> {
    /// `b` (starting at `B`) with its panels packed into `packed` when its
    /// rows are strided.
    fn packed(plan: &Plan, b: &'a [f32], packed: &'a mut Vec<f32>) -> PanelsOfB<'a> {
        if plan.b_cs == 1 {
            return PanelsOfB::Strided(b);
        }
        packed.resize(plan.k * plan.n, 0.0);
        let mut at = 0;
        for_each_panel(plan, |k0, c0, kc, nc| {
            let first = k0 * plan.b_rs + c0 * plan.b_cs;
            let panel = &mut packed[at..at + kc * nc];
            pack_panel(&b[first..], (plan.b_rs, plan.b_cs), kc, nc, panel);
            at += kc * nc;
        });
        let packed: &'a Vec<f32> = packed;
        PanelsOfB::Packed(packed)
    }
}

/// Calls `f(k0, c0, kc, nc)` for `B`'s panels in [`thin_block`]'s order.
fn for_each_panel(plan: &Plan, mut f: impl FnMut(usize, usize, usize, usize)) {
    let (n, k) = (plan.n, plan.k);
    let cols = super::flash::tile_cols().min(PANEL_COLS);
    for k0 in (0..k).step_by(PANEL_K) {
        let kc = PANEL_K.min(k - k0);
        for c0 in (0..n).step_by(cols) {
            f(k0, c0, kc, cols.min(n - c0));
        }
    }
}

/// `dst (rows × n) = A (rows × k) · B (k × n)`, `a` starting at the
/// block's first row of `A`.
fn thin_block(plan: &Plan, a: &[f32], b: &PanelsOfB<'_>, rows: usize, dst: &mut [f32]) {
    let mut panel = [0f32; PANEL_K * PANEL_COLS];
    let mut packed_at = 0;
    for_each_panel(plan, |k0, c0, kc, nc| {
        let first = k0 * plan.b_rs + c0 * plan.b_cs;
        let (bp, ldb): (&[f32], usize) = match b {
            PanelsOfB::Strided(b) if plan.b_cs == 1 => (&b[first..], plan.b_rs),
            PanelsOfB::Strided(b) => {
                pack_panel(&b[first..], (plan.b_rs, plan.b_cs), kc, nc, &mut panel);
                (&panel[..kc * nc], nc)
            }
            PanelsOfB::Packed(all) => {
                packed_at += kc * nc;
                (&all[packed_at - kc * nc..packed_at], nc)
            }
        };
        thin_rows(
            plan,
            &a[k0 * plan.a_cs..],
            kc,
            rows,
            (bp, ldb, nc),
            &mut dst[c0..],
            k0 > 0,
        );
    });
}

/// Rows of `A` per tile product when its next rows are prefetched (see
/// [`thin_rows`]): a multiple of both micro-tile heights (6 and 8).
const PREFETCH_ROWS: usize = 48;

/// Depth from which the rows of a row-major `A` are prefetched: its rows
/// (1 KiB and more) then span many lines that the run reads a few floats
/// at a time.
const PREFETCH_MIN_K: usize = 256;

/// `dst (rows × nc, rows n apart) ⊕= A (rows × kc) · B`, `B` one panel
/// (`bp`, `ldb`, `nc`), in runs of `PREFETCH_ROWS` rows whose next run's
/// lines of `A` are asked for before this one is multiplied, when `A` is
/// large: a transposed `A` (`a_rs == 1`: attention's `Pᵀ` and `dSᵀ`) is
/// read down columns of the stored matrix, one cache line per element of
/// `kc` and a page every few lines, which the hardware prefetcher does not
/// follow; a row-major one with long rows (`P`, `dS`) is read as many
/// streams at once. dV = Pᵀ·dO and dK = dSᵀ·Q ran ~1.5× faster per core,
/// O = P·V 1–56 % (BENCHMARKS.md at 321f0c1, branch cpuseed).
fn thin_rows(
    plan: &Plan,
    a: &[f32],
    kc: usize,
    rows: usize,
    (bp, ldb, nc): (&[f32], usize, usize),
    dst: &mut [f32],
    accumulate: bool,
) {
    let (a_rs, a_cs, n) = (plan.a_rs, plan.a_cs, plan.n);
    let transposed = a_rs == 1 && a_cs > 1;
    let long_rows = a_cs == 1 && plan.k >= PREFETCH_MIN_K;
    let run = if transposed || long_rows {
        PREFETCH_ROWS
    } else {
        rows.max(1)
    };
    let size = std::mem::size_of::<f32>();
    for r in (0..rows).step_by(run) {
        let next = r + run;
        if next < rows {
            let count = run.min(rows - next);
            // Hints: the addresses are never dereferenced.
            if transposed {
                for kk in 0..kc {
                    let line = a.as_ptr().wrapping_add(kk * a_cs + next);
                    super::stream::prefetch(line.cast(), count * size);
                }
            } else {
                for row in next..next + count {
                    let start = a.as_ptr().wrapping_add(row * a_rs);
                    super::stream::prefetch(start.cast(), kc * size);
                }
            }
        }
        super::flash::tile_product(
            run.min(rows - r),
            nc,
            kc,
            &a[r * a_rs..],
            (a_rs, a_cs),
            bp,
            ldb,
            &mut dst[r * n..],
            n,
            accumulate,
        );
    }
}

/// `panel (kc × nc, row-major) = B[..kc, ..nc]` for `B[kk, j] = b[kk·rs +
/// j·cs]`, walking `b` along its unit stride when it has one (a transposed
/// `B`'s columns are contiguous: `kᵀ` in `q·kᵀ`).
fn pack_panel(b: &[f32], (rs, cs): (usize, usize), kc: usize, nc: usize, panel: &mut [f32]) {
    let panel = &mut panel[..kc * nc];
    if rs == 1 {
        for (j, col) in (0..nc).map(|j| (j, &b[j * cs..])) {
            for (kk, &x) in col[..kc].iter().enumerate() {
                panel[kk * nc + j] = x;
            }
        }
    } else {
        for (kk, row) in panel.chunks_exact_mut(nc).enumerate() {
            for (j, p) in row.iter_mut().enumerate() {
                *p = b[kk * rs + j * cs];
            }
        }
    }
}

/// The output storage of `plan` for a float type gemm supports.
fn gemm_storage<T: GemmElement>(plan: &Plan, a: &Storage, b: &Storage) -> Storage {
    let mut out = Storage::new(T::DTYPE, plan.batch() * plan.m * plan.n);
    let dst = out.as_mut_slice::<T>();
    if dst.is_empty() {
        return out;
    }
    if plan.k == 0 {
        dst.fill(T::from_f64(0.0));
        return out;
    }
    run_batches(plan, dst, |i, dst, par| {
        gemm_one(plan, i, a.as_slice::<T>(), b.as_slice::<T>(), dst, par)
    });
    out
}

/// Calls `f(batch index, output matrix, gemm parallelism)` for every batch,
/// spreading the batches over rayon when there are many small ones.
fn run_batches<T: Send>(
    plan: &Plan,
    dst: &mut [T],
    f: impl Fn(usize, &mut [T], gemm::Parallelism) + Sync,
) {
    let mat = plan.m * plan.n;
    match plan.batches_per_task() {
        Some(per_task) => dst
            .par_chunks_mut(mat)
            .enumerate()
            .with_min_len(per_task)
            .for_each(|(i, d)| f(i, d, gemm::Parallelism::None)),
        None => {
            let par = if plan.m * plan.n * plan.k >= GEMM_PAR_WORK {
                gemm::Parallelism::Rayon(rayon::current_num_threads())
            } else {
                gemm::Parallelism::None
            };
            for (i, d) in dst.chunks_mut(mat).enumerate() {
                f(i, d, par);
            }
        }
    }
}

/// One gemm call: `dst = a_i @ b_i`, `dst` row-major m×n.
fn gemm_one<T: GemmElement>(
    plan: &Plan,
    i: usize,
    a: &[T],
    b: &[T],
    dst: &mut [T],
    par: gemm::Parallelism,
) {
    let (a_off, b_off) = plan.offsets(i);
    assert!(
        dst.len() == plan.m * plan.n && a_off < a.len() && b_off < b.len(),
        "internal error: matmul plan does not fit its buffers"
    );
    // SAFETY: `T` is f32, f64 or half::f16 (== gemm::f16, the same `half`
    // crate version). The operand layouts come from live tensors over `a` and `b`,
    // so every (row, col) they address lies inside those storages; `dst`
    // holds exactly m×n elements at row stride n. m, n, k > 0 here.
    // `read_dst = false` with alpha = 0, beta = 1: dst = a·b, never read.
    unsafe {
        gemm::gemm(
            plan.m,
            plan.n,
            plan.k,
            dst.as_mut_ptr(),
            1,
            plan.n as isize,
            false,
            a.as_ptr().add(a_off),
            plan.a_cs as isize,
            plan.a_rs as isize,
            b.as_ptr().add(b_off),
            plan.b_cs as isize,
            plan.b_rs as isize,
            T::from_f64(0.0),
            T::from_f64(1.0),
            false,
            false,
            false,
            par,
        )
    }
}

/// f16 and bf16: multiply in f32 and round once at the end. (bf16 has no
/// gemm kernel; gemm's f16 kernel accumulates in f16, which loses ~1% at
/// k = 129 — we promise f32 accumulation for the half types.)
fn matmul_via_f32<T: Float<Acc = f32>>(a: &Array, b: &Array, out_shape: &[usize]) -> Array {
    // The f32 operands and product are the kernel's scratch (see
    // `scratch_bytes`).
    let wide = super::arena::scratch(|| {
        let (a32, b32) = (to_f32::<T>(a), to_f32::<T>(b));
        let plan = Plan::new(a32.layout(), b32.layout(), out_shape);
        gemm_storage::<f32>(&plan, a32.storage(), b32.storage())
    });
    let mut out = Storage::new(T::DTYPE, wide.numel());
    let dst = out.as_mut_slice::<T>();
    for (o, &v) in dst.iter_mut().zip(wide.as_slice::<f32>()) {
        *o = T::from_acc(v);
    }
    Array::from_storage(out, out_shape)
}

/// A half-precision tensor converted to f32 with the same shape. Broadcast (stride-0)
/// dims stay broadcast, so an expanded operand is not materialised.
fn to_f32<T: Float<Acc = f32>>(x: &Array) -> Array {
    let l = x.layout();
    let compact: Vec<usize> = (0..l.rank())
        .map(|d| if l.strides[d] == 0 { 1 } else { l.shape[d] })
        .collect();
    let src = Layout {
        shape: compact.clone(),
        ..l.clone()
    };
    let data = x.storage().as_slice::<T>();
    // Tracked storage (not a Vec): the memory plan and the size limit see it.
    let mut storage = Storage::new(DType::F32, src.numel());
    let values = storage.as_mut_slice::<f32>();
    let mut at = 0;
    src.for_each_run(|start, stride, len| {
        for (j, v) in values[at..at + len].iter_mut().enumerate() {
            *v = data[start + j * stride].to_acc();
        }
        at += len;
    });
    let storage = std::sync::Arc::new(storage);
    Array::from_parts(storage, Layout::contiguous(&compact).expanded(&l.shape))
}

/// Integer matmul: not performance critical, a plain loop in i-k-j order
/// (unit stride over the output row). Wraps on overflow like torch.
fn int_storage<T: Int>(plan: &Plan, a: &Storage, b: &Storage) -> Storage {
    let mut out = Storage::new(T::DTYPE, plan.batch() * plan.m * plan.n);
    let dst = out.as_mut_slice::<T>();
    if dst.is_empty() {
        return out;
    }
    let (a, b) = (a.as_slice::<T>(), b.as_slice::<T>());
    run_batches(plan, dst, |i, dst, _| int_one(plan, i, a, b, dst));
    out
}

fn int_one<T: Int>(plan: &Plan, i: usize, a: &[T], b: &[T], dst: &mut [T]) {
    let (a_off, b_off) = plan.offsets(i);
    for (r, row) in dst.chunks_mut(plan.n).enumerate() {
        row.fill(T::ZERO);
        for p in 0..plan.k {
            let av = a[a_off + r * plan.a_rs + p * plan.a_cs];
            let b_row = b_off + p * plan.b_rs;
            for (c, o) in row.iter_mut().enumerate() {
                *o = o.wrapping_add(av.wrapping_mul(b[b_row + c * plan.b_cs]));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;

    use crate::runtime::cpu::test_values as values;

    /// Row-major m×k times k×n in f64, the textbook triple loop.
    fn naive(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    out[i * n + j] += a[i * k + p] * b[p * n + j];
                }
            }
        }
        out
    }

    fn f32_tensor(v: &[f64], shape: &[usize]) -> Tensor {
        Tensor::from_vec(v.iter().map(|&x| x as f32).collect(), shape)
    }

    /// A view of `data` (given in the view's row-major order) whose storage
    /// holds it transposed in the last two dims.
    fn transposed_view(v: &[f64], shape: &[usize]) -> Tensor {
        let r = shape.len();
        let (rows, cols) = (shape[r - 2], shape[r - 1]);
        let mut phys = Vec::with_capacity(v.len());
        for mat in v.chunks(rows * cols) {
            for c in 0..cols {
                phys.extend((0..rows).map(|r| mat[r * cols + c] as f32));
            }
        }
        let mut pshape = shape.to_vec();
        pshape.swap(r - 2, r - 1);
        let t = Tensor::from_vec(phys, &pshape);
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(r - 2, r - 1);
        let view = Tensor::from_parts(t.storage().clone(), t.layout().permuted(&perm));
        assert!(!view.is_contiguous());
        view
    }

    fn assert_close(got: &[f64], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= tol * (1.0 + w.abs()), "at {i}: {g} vs {w}");
        }
    }

    fn run(a: &Tensor, b: &Tensor, shape: &[usize]) -> Tensor {
        let out = matmul(a.array(), b.array(), shape).unwrap();
        assert_eq!(out.shape(), shape);
        Tensor::from_array(out)
    }

    #[test]
    fn hand_2x2() {
        let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2]);
        let b = Tensor::from_vec(vec![5.0f32, 6.0, 7.0, 8.0], &[2, 2]);
        let out = run(&a, &b, &[2, 2]);
        assert_eq!(out.to_vec::<f32>().unwrap(), vec![19.0, 22.0, 43.0, 50.0]);
    }

    #[test]
    fn odd_sizes_f32_and_f64() {
        for &(m, k, n) in &[
            (1, 7, 33),
            (7, 1, 1),
            (33, 129, 7),
            (129, 33, 129),
            (129, 129, 129),
        ] {
            let (a, b) = (values(m * k, 1), values(k * n, 2));
            let want = naive(&a, &b, m, k, n);
            let got = run(&f32_tensor(&a, &[m, k]), &f32_tensor(&b, &[k, n]), &[m, n]);
            assert_close(&got.to_f64_vec(), &want, 1e-5);
            let a64 = Tensor::from_vec(a.clone(), &[m, k]);
            let b64 = Tensor::from_vec(b.clone(), &[k, n]);
            assert_close(&run(&a64, &b64, &[m, n]).to_f64_vec(), &want, 1e-12);
        }
    }

    /// The thin path (flash's micro-tiles) on the attention products'
    /// layouts against f64: plain, `A` transposed, `B` transposed (packed
    /// panels), both; inner dims across panel passes (k = 300: 128 + 128 +
    /// 44), widths with masked tails and several panels (n = 19, 45, 70),
    /// rows not a multiple of the micro-tile (m = 37), runs of prefetched
    /// rows (m = 100 and 130, transposed or k = 260), a batch of one (row
    /// blocks as tasks) and of many (whole matrices as tasks), a right side
    /// with no unit stride, and a batch broadcast on one side.
    #[test]
    fn thin_products_in_every_layout() {
        let shapes = [
            (37, 300, 19),
            (64, 64, 70),
            (130, 45, 256),
            (16, 8, 16),
            (100, 260, 64),
        ];
        for (case, &(m, k, n)) in shapes.iter().enumerate() {
            for batch in [1, 9] {
                let plan = Plan::new(
                    &Layout::contiguous(&[batch, m, k]),
                    &Layout::contiguous(&[batch, k, n]),
                    &[batch, m, n],
                );
                assert!(
                    is_thin(&plan) || !super::super::flash::simd_tiles(),
                    "{m}x{k}x{n}"
                );
                let seed = 10 * case as u64 + batch as u64;
                let (a, b) = (values(batch * m * k, seed), values(batch * k * n, seed + 1));
                let want: Vec<f64> = (0..batch)
                    .flat_map(|i| {
                        naive(&a[i * m * k..][..m * k], &b[i * k * n..][..k * n], m, k, n)
                    })
                    .collect();
                for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                    let x = match ta {
                        true => transposed_view(&a, &[batch, m, k]),
                        false => f32_tensor(&a, &[batch, m, k]),
                    };
                    let y = match tb {
                        true => transposed_view(&b, &[batch, k, n]),
                        false => f32_tensor(&b, &[batch, k, n]),
                    };
                    let got = run(&x, &y, &[batch, m, n]);
                    assert_close(&got.to_f64_vec(), &want, 1e-5);
                }
            }
        }
        // A right side with no unit stride (every other column of a wider
        // matrix): packed element by element.
        let (m, k, n) = (24, 40, 20);
        let (a, wide) = (values(m * k, 80), values(k * 2 * n, 81));
        let b: Vec<f64> = (0..k * n)
            .map(|i| wide[(i / n) * 2 * n + 2 * (i % n)])
            .collect();
        let base = f32_tensor(&wide, &[k, 2 * n]);
        let strided = Layout {
            shape: vec![k, n],
            strides: vec![2 * n, 2],
            offset: 0,
        };
        let y = Tensor::from_parts(base.storage().clone(), strided);
        let got = run(&f32_tensor(&a, &[m, k]), &y, &[m, n]);
        assert_close(&got.to_f64_vec(), &naive(&a, &b, m, k, n), 1e-5);
        // [3, m, k] @ [k, n] with the left side transposed (not foldable
        // into one tall product): the right matrix is every batch's.
        let (m, k, n) = (40, 24, 33);
        let (a, b) = (values(3 * m * k, 90), values(k * n, 91));
        let got = run(
            &transposed_view(&a, &[3, m, k]),
            &f32_tensor(&b, &[k, n]),
            &[3, m, n],
        );
        let want: Vec<f64> = (0..3)
            .flat_map(|i| naive(&a[i * m * k..][..m * k], &b, m, k, n))
            .collect();
        assert_close(&got.to_f64_vec(), &want, 1e-5);
    }

    #[test]
    fn raced_products_are_right_and_keep_their_kernel() {
        // A linear layer's three products at the race's size, in their
        // layouts (`x·W`, `dy·Wᵀ`, `xᵀ·dy`): the race's result, and a
        // second call's (the kept kernel's), equal the f64 product, and the
        // second is the first bit for bit.
        let (m, k, n) = (512, 256, 128);
        assert!(m * n * k >= RACE_WORK);
        let (a, b) = (values(m * k, 7), values(k * n, 8));
        let want = naive(&a, &b, m, k, n);
        for (ta, tb) in [(false, false), (false, true), (true, false)] {
            let x = match ta {
                true => transposed_view(&a, &[m, k]),
                false => f32_tensor(&a, &[m, k]),
            };
            let y = match tb {
                true => transposed_view(&b, &[k, n]),
                false => f32_tensor(&b, &[k, n]),
            };
            let first = run(&x, &y, &[m, n]).to_vec::<f32>().unwrap();
            let again = run(&x, &y, &[m, n]).to_vec::<f32>().unwrap();
            let first_f64: Vec<f64> = first.iter().map(|&v| v as f64).collect();
            assert_close(&first_f64, &want, 1e-5);
            assert_eq!(first, again, "transposes {ta} {tb}");
        }
    }

    #[test]
    fn one_dim_operands() {
        let v = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3]);
        let dot = run(&v, &v, &[]);
        assert_eq!(dot.to_vec::<f32>().unwrap(), vec![14.0]);
        let m = Tensor::from_vec((1..=6).map(|x| x as f32).collect(), &[2, 3]);
        // [[1,2,3],[4,5,6]] @ [1,2,3] = [14, 32]
        assert_eq!(run(&m, &v, &[2]).to_vec::<f32>().unwrap(), vec![14.0, 32.0]);
        // [1,2] @ [[1,2,3],[4,5,6]] = [9, 12, 15]
        let u = Tensor::from_vec(vec![1.0f32, 2.0], &[2]);
        assert_eq!(
            run(&u, &m, &[3]).to_vec::<f32>().unwrap(),
            vec![9.0, 12.0, 15.0]
        );
        // [3] @ [2, 3, 2]: batched, the vector's dim dropped.
        let bm = values(12, 3);
        let got = run(&v, &f32_tensor(&bm, &[2, 3, 2]), &[2, 2]);
        let mut want = naive(&[1.0, 2.0, 3.0], &bm[..6], 1, 3, 2);
        want.extend(naive(&[1.0, 2.0, 3.0], &bm[6..], 1, 3, 2));
        assert_close(&got.to_f64_vec(), &want, 1e-6);
    }

    #[test]
    fn broadcast_batch() {
        // [2,1,3,4] @ [5,4,6] -> [2,5,3,6]: out[i,j] = a[i,0] @ b[j].
        let (a, b) = (values(2 * 12, 4), values(5 * 24, 5));
        let got = run(
            &f32_tensor(&a, &[2, 1, 3, 4]),
            &f32_tensor(&b, &[5, 4, 6]),
            &[2, 5, 3, 6],
        );
        let mut want = Vec::new();
        for i in 0..2 {
            for j in 0..5 {
                want.extend(naive(&a[i * 12..][..12], &b[j * 24..][..24], 3, 4, 6));
            }
        }
        assert_close(&got.to_f64_vec(), &want, 1e-6);
    }

    #[test]
    fn shared_rhs_folds_batch_and_expanded_lhs() {
        // [4,33,7] @ [7,5]: one tall gemm.
        let (a, b) = (values(4 * 33 * 7, 6), values(35, 7));
        let got = run(
            &f32_tensor(&a, &[4, 33, 7]),
            &f32_tensor(&b, &[7, 5]),
            &[4, 33, 5],
        );
        assert_close(&got.to_f64_vec(), &naive(&a, &b, 132, 7, 5), 1e-6);
        // The same with the batch dims transposed (not foldable): [3,4,5,6]
        // viewed as [4,3,5,6].
        let a = values(3 * 4 * 30, 8);
        let base = f32_tensor(&a, &[3, 4, 5, 6]);
        let view = Tensor::from_parts(
            base.storage().clone(),
            base.layout().permuted(&[1, 0, 2, 3]),
        );
        let b = values(6 * 2, 9);
        let got = run(&view, &f32_tensor(&b, &[6, 2]), &[4, 3, 5, 2]);
        let mut want = Vec::new();
        for i in 0..4 {
            for j in 0..3 {
                want.extend(naive(&a[(j * 4 + i) * 30..][..30], &b, 5, 6, 2));
            }
        }
        assert_close(&got.to_f64_vec(), &want, 1e-6);
        // A stride-0 (expanded) left batch against a real right batch.
        let (a, b) = (values(12, 10), values(5 * 24, 11));
        let x = f32_tensor(&a, &[3, 4]);
        let ex = Tensor::from_parts(x.storage().clone(), x.layout().expanded(&[5, 3, 4]));
        let got = run(&ex, &f32_tensor(&b, &[5, 4, 6]), &[5, 3, 6]);
        let want: Vec<f64> = (0..5)
            .flat_map(|j| naive(&a, &b[j * 24..][..24], 3, 4, 6))
            .collect();
        assert_close(&got.to_f64_vec(), &want, 1e-6);
    }

    #[test]
    fn many_small_batches_in_parallel() {
        let (bt, m, k, n) = (256, 8, 9, 10);
        let (a, b) = (values(bt * m * k, 12), values(bt * k * n, 13));
        let got = run(
            &f32_tensor(&a, &[bt, m, k]),
            &f32_tensor(&b, &[bt, k, n]),
            &[bt, m, n],
        );
        let want: Vec<f64> = (0..bt)
            .flat_map(|i| naive(&a[i * m * k..][..m * k], &b[i * k * n..][..k * n], m, k, n))
            .collect();
        assert_close(&got.to_f64_vec(), &want, 1e-6);
    }

    #[test]
    fn transposed_and_sliced_operands() {
        // q @ k^T with k stored [n, d]: the view is passed to gemm as is.
        let (m, d, n) = (33, 7, 129);
        let (q, kt) = (values(2 * m * d, 14), values(2 * d * n, 15));
        let got = run(
            &f32_tensor(&q, &[2, m, d]),
            &transposed_view(&kt, &[2, d, n]),
            &[2, m, n],
        );
        let want: Vec<f64> = (0..2)
            .flat_map(|i| naive(&q[i * m * d..][..m * d], &kt[i * d * n..][..d * n], m, d, n))
            .collect();
        assert_close(&got.to_f64_vec(), &want, 1e-5);
        // Both operands transposed.
        let (a, b) = (values(7 * 33, 16), values(33 * 5, 17));
        let got = run(
            &transposed_view(&a, &[7, 33]),
            &transposed_view(&b, &[33, 5]),
            &[7, 5],
        );
        assert_close(&got.to_f64_vec(), &naive(&a, &b, 7, 33, 5), 1e-5);
        // Every other column of a [5, 14] tensor: a [5, 7] view, stride 2.
        let wide = values(5 * 14, 18);
        let t = f32_tensor(&wide, &[5, 14]);
        let sliced = Tensor::from_parts(t.storage().clone(), t.layout().sliced(1, 1, 7, 2));
        let a: Vec<f64> = (0..5)
            .flat_map(|r| (0..7).map(move |c| (r, c)))
            .map(|(r, c)| wide[r * 14 + 1 + 2 * c])
            .collect();
        let b = values(7 * 3, 19);
        let got = run(&sliced, &f32_tensor(&b, &[7, 3]), &[5, 3]);
        assert_close(&got.to_f64_vec(), &naive(&a, &b, 5, 7, 3), 1e-6);
    }

    /// |got − want| within `rel` of the magnitude of the products summed.
    fn assert_low_precision(
        got: &[f64],
        a: &[f64],
        b: &[f64],
        (m, k, n): (usize, usize, usize),
        rel: f64,
    ) {
        let want = naive(a, b, m, k, n);
        let abs_a: Vec<f64> = a.iter().map(|x| x.abs()).collect();
        let abs_b: Vec<f64> = b.iter().map(|x| x.abs()).collect();
        let scale = naive(&abs_a, &abs_b, m, k, n);
        for i in 0..want.len() {
            assert!(
                (got[i] - want[i]).abs() <= rel * scale[i] + 1e-6,
                "at {i}: {} vs {}",
                got[i],
                want[i]
            );
        }
    }

    #[test]
    fn f16_and_bf16() {
        let (m, k, n) = (33, 129, 7);
        let (a, b) = (values(m * k, 20), values(k * n, 21));
        let a16: Vec<half::f16> = a.iter().map(|&x| half::f16::from_f64(x)).collect();
        let b16: Vec<half::f16> = b.iter().map(|&x| half::f16::from_f64(x)).collect();
        let got = run(
            &Tensor::from_vec(a16, &[m, k]),
            &Tensor::from_vec(b16, &[k, n]),
            &[m, n],
        );
        // Inputs are exact in f16; one rounding of the result (2^-11) plus
        // gemm's f16 accumulation.
        assert_low_precision(&got.to_f64_vec(), &a, &b, (m, k, n), 2e-3);
        let abf: Vec<half::bf16> = a.iter().map(|&x| half::bf16::from_f64(x)).collect();
        let bbf: Vec<half::bf16> = b.iter().map(|&x| half::bf16::from_f64(x)).collect();
        let ta = Tensor::from_vec(abf, &[m, k]);
        let got = run(&ta, &Tensor::from_vec(bbf, &[k, n]), &[m, n]);
        assert_eq!(got.dtype(), DType::BF16);
        // f32 accumulation, one bf16 rounding (2^-9 relative).
        assert_low_precision(&got.to_f64_vec(), &a, &b, (m, k, n), 2.0f64.powi(-8));
        // bf16 with an expanded (stride-0) left operand.
        let ex = Tensor::from_parts(ta.storage().clone(), ta.layout().expanded(&[2, m, k]));
        let bb: Vec<half::bf16> = values(2 * k * n, 22)
            .iter()
            .map(|&x| half::bf16::from_f64(x))
            .collect();
        let got = run(&ex, &Tensor::from_vec(bb.clone(), &[2, k, n]), &[2, m, n]).to_f64_vec();
        let bb: Vec<f64> = bb.iter().map(|x| x.to_f64()).collect();
        for i in 0..2 {
            assert_low_precision(
                &got[i * m * n..][..m * n],
                &a,
                &bb[i * k * n..][..k * n],
                (m, k, n),
                2.0f64.powi(-8),
            );
        }
    }

    #[test]
    fn integers() {
        let a = Tensor::from_vec(vec![1i64, -2, 3, 4, 5, -6], &[2, 3]);
        let b = Tensor::from_vec(vec![7i64, 8, 9, 10, -11, 12], &[3, 2]);
        // [[1,-2,3],[4,5,-6]] @ [[7,8],[9,10],[-11,12]]
        assert_eq!(
            run(&a, &b, &[2, 2]).to_vec::<i64>().unwrap(),
            vec![-44, 24, 139, 10]
        );
        let bt = Tensor::from_parts(
            b.storage().clone(),
            Layout::contiguous(&[2, 3]).permuted(&[1, 0]),
        );
        // b's storage read as [2,3] then transposed: [[7,10],[8,-11],[9,12]].
        assert_eq!(
            run(&a, &bt, &[2, 2]).to_vec::<i64>().unwrap(),
            vec![18, 68, 14, -87]
        );
        let a32 = Tensor::from_vec(vec![2i32, 3], &[1, 2]);
        let b32 = Tensor::from_vec(vec![i32::MAX, 1], &[2, 1]);
        // 2·MAX + 3 wraps like i32 arithmetic: 2·(2^31 − 1) + 3 − 2^32 = 1.
        assert_eq!(run(&a32, &b32, &[1, 1]).to_vec::<i32>().unwrap(), vec![1]);
    }

    #[test]
    fn empty_and_zero_k() {
        // Dirty a pooled buffer of the output's size so stale bytes would show.
        drop(Tensor::from_vec(vec![7.0f32; 12], &[12]));
        let a = Tensor::from_vec(Vec::<f32>::new(), &[3, 0]);
        let b = Tensor::from_vec(Vec::<f32>::new(), &[0, 4]);
        assert_eq!(run(&a, &b, &[3, 4]).to_vec::<f32>().unwrap(), vec![0.0; 12]);
        let ai = Tensor::from_vec(Vec::<i64>::new(), &[2, 0]);
        let bi = Tensor::from_vec(Vec::<i64>::new(), &[0, 2]);
        assert_eq!(run(&ai, &bi, &[2, 2]).to_vec::<i64>().unwrap(), vec![0; 4]);
        let a = Tensor::from_vec(Vec::<f32>::new(), &[0, 3]);
        let b = f32_tensor(&values(12, 23), &[3, 4]);
        assert_eq!(run(&a, &b, &[0, 4]).numel(), 0);
        let b0 = Tensor::from_vec(Vec::<f32>::new(), &[3, 0]);
        assert_eq!(
            run(&f32_tensor(&values(6, 24), &[2, 3]), &b0, &[2, 0]).numel(),
            0
        );
        let bat = Tensor::from_vec(Vec::<f32>::new(), &[0, 2, 3]);
        assert_eq!(run(&bat, &b, &[0, 2, 4]).numel(), 0);
    }

    #[test]
    fn via_dispatcher() {
        let a = f32_tensor(&values(6, 25), &[2, 3]);
        let b = f32_tensor(&values(3, 26), &[3]);
        let out = crate::runtime::cpu::eval(
            &crate::ir::Op::MatMul,
            &[a.array(), b.array()],
            DType::F32,
            &[2],
        )
        .unwrap();
        assert_close(
            &out.to_f64_vec(),
            &naive(&a.to_f64_vec(), &b.to_f64_vec(), 2, 3, 1),
            1e-6,
        );
    }

    #[test]
    fn matmul_t_reads_transposed_views() {
        let a = f32_tensor(&values(12, 27), &[2, 3, 2]); // a' is [2, 2, 3]
        let b = f32_tensor(&values(12, 28), &[4, 3]); // b' is [3, 4]
        let out = matmul_t(a.array(), b.array(), true, true, &[2, 2, 4]).unwrap();
        let a_t = swapped_last2(a.array(), true).to_f64_vec();
        let b_t = swapped_last2(b.array(), true).to_f64_vec();
        let mut want = naive(&a_t[..6], &b_t, 2, 3, 4);
        want.extend(naive(&a_t[6..], &b_t, 2, 3, 4));
        assert_close(&out.to_f64_vec(), &want, 1e-6);
    }

    #[test]
    fn plans_fold_and_split_as_intended() {
        let c = Layout::contiguous;
        let folded = Plan::new(&c(&[4, 33, 7]), &c(&[7, 5]), &[4, 33, 5]);
        assert_eq!((folded.batch(), folded.m, folded.a_rs), (1, 132, 7));
        let kept = Plan::new(
            &c(&[3, 4, 5, 6]).permuted(&[1, 0, 2, 3]),
            &c(&[6, 2]),
            &[4, 3, 5, 2],
        );
        assert_eq!((kept.batch(), kept.m), (12, 5));
        let unit_b = Plan::new(&c(&[2, 1, 33, 7]), &c(&[1, 1, 7, 5]), &[2, 1, 33, 5]);
        assert_eq!((unit_b.batch(), unit_b.m), (1, 66));
        let batched = Plan::new(&c(&[2, 5, 3]), &c(&[2, 3, 4]), &[2, 5, 4]);
        assert_eq!((batched.batch(), batched.m), (2, 5));
        let small = Plan::new(&c(&[256, 8, 9]), &c(&[256, 9, 10]), &[256, 8, 10]);
        assert!(small.batches_per_task().is_some());
        let large = Plan::new(&c(&[2, 128, 128]), &c(&[2, 128, 128]), &[2, 128, 128]);
        assert!(large.batches_per_task().is_none());
    }
}

#[cfg(test)]
mod scratch_tests {
    use crate::compile::{compile_graph, CompileOptions};
    use crate::ir::{DType, Graph, NodeMeta, Op, TensorType, UnaryOp};
    use crate::runtime::layout::Layout;
    use crate::tensor::Tensor;

    /// The widened operands of a half-precision matmul are placed 64-byte
    /// aligned one after the other: the scratch estimate counts the padding
    /// (3×4 @ 4×20 in bf16: 48 + 320 + 240 bytes, placed in 64 + 320 + 256).
    #[test]
    fn half_matmul_scratch_counts_the_alignment_of_each_piece() {
        let (a, b) = (Layout::contiguous(&[3, 4]), Layout::contiguous(&[4, 20]));
        let inputs = [(&a, DType::BF16, 12), (&b, DType::BF16, 80)];
        assert_eq!(
            super::super::scratch_bytes(&Op::MatMul, &inputs, &[3, 20]),
            640
        );
        // The compiled kernel runs within its planned scratch.
        let mut g = Graph::new("mm");
        let x = g.add_input("x", TensorType::new(DType::BF16, vec![3, 4]));
        let w = g.add_input("w", TensorType::new(DType::BF16, vec![4, 20]));
        let h = g.add(Op::MatMul, &[x, w], NodeMeta::default()).unwrap();
        let y = g
            .add(Op::Unary(UnaryOp::Relu), &[h], NodeMeta::default())
            .unwrap();
        g.add_output("y", y);
        let compiled = compile_graph(g, CompileOptions::default()).unwrap();
        let xv = Tensor::full(&[3, 4], 0.5, DType::BF16);
        let wv = Tensor::full(&[4, 20], 0.25, DType::BF16);
        let out = compiled.try_call(&[xv, wv]).unwrap();
        assert_eq!(out[0].to_f64_vec(), vec![0.5; 60]);
    }
}
