//! The fused pointwise kernel: a list of elementwise steps evaluated block
//! by block over the output, so intermediates live in a few cache-resident
//! blocks and never in memory. Only the kernel's inputs are read and its
//! outputs written.
//!
//! Speed: each step is one vectorised loop over a block (the dispatch on
//! the op is per block, not per element). Steps write into register slots
//! that are reused once their value is dead, and the block is sized so that
//! all live slots stay in L1: the kernel is then bound by memory, not by
//! the cache traffic between steps. A binary op with a constant operand
//! reads the constant as a scalar (such constants take no slot). A dense
//! input of the compute type is read where it is (no copy into a slot),
//! the part of it two blocks ahead prefetched into L2 while this one is
//! computed, and outputs far larger than the caches are written with
//! non-temporal stores (`super::stream`), each block's a piece at a time
//! while the next block is computed (see `Spread`). Every step computes exactly what the
//! eager kernel of its op computes (the same functions), so results are
//! bit-identical to op-by-op evaluation in the compute type.
//!
//! The kernel's description ([`FusedKernel`]: its [`Step`]s, its outputs,
//! its block size and its register slots) is IR data, in `ir::kernel`;
//! this file runs it.

use rayon::prelude::*;

use super::element::num_like::AccFloat;
use super::elementwise::{
    binary_const_into, binary_into, const_binary_into, unary_into, Transcendental,
};
use super::stream::{prefetch_l2, store_fence, stream_copy_unfenced, stream_min_bytes};
use super::{Element, Storage};
use crate::error::{op_err, Result};
use crate::ir::kernel::{FusedKernel, FusedRegisters, Step};
use crate::ir::{CompareOp, DType, UnaryOp};
use crate::runtime::array::Array;
use crate::runtime::layout::Layout;
use crate::with_dtype;

/// One input of a fused kernel.
pub enum FusedInput<'a> {
    /// An array the kernel reads (broadcast to the kernel's shape).
    Shared(&'a Array),
    /// The storage of an input that nobody else holds, dense over the
    /// kernel's shape, which output `output` (of the same dtype) overwrites.
    /// In place is safe here because every block loads all of its inputs
    /// before it stores its outputs, at the same element range, and blocks
    /// are disjoint.
    Donated { storage: Storage, output: usize },
}

impl FusedKernel {
    /// Runs the kernel; `inputs` as numbered by `Step::Load`.
    pub fn run(&self, inputs: &[&Array]) -> Result<Vec<Array>> {
        self.run_with(inputs.iter().map(|&t| FusedInput::Shared(t)).collect())
    }

    /// Runs the kernel, writing donated inputs' outputs in place.
    pub fn run_with(&self, inputs: Vec<FusedInput<'_>>) -> Result<Vec<Array>> {
        self.run_in(None, inputs)
    }

    /// [`FusedKernel::run_with`], with the kernel's `registers` allocated
    /// by the caller (`[own outputs: false, true]`, see
    /// [`FusedRegisters::allocate`]); `None`: allocated here.
    pub fn run_in(
        &self,
        registers: Option<&[FusedRegisters; 2]>,
        inputs: Vec<FusedInput<'_>>,
    ) -> Result<Vec<Array>> {
        let numel: usize = self.shape.iter().product();
        self.check(inputs.len())?;
        for (i, input) in inputs.iter().enumerate() {
            self.check_input(i, input, numel)?;
        }
        if registers.is_some_and(|r| r.iter().any(|r| r.slot.len() != self.steps.len())) {
            return Err(op_err!(
                Verify,
                "fused",
                "internal error: registers of another kernel given to one of {} steps",
                self.steps.len()
            ));
        }
        if self.wide {
            Ok(self.run_as::<f64>(registers, inputs))
        } else {
            Ok(self.run_as::<f32>(registers, inputs))
        }
    }

    fn check_input(&self, i: usize, input: &FusedInput<'_>, numel: usize) -> Result<()> {
        match input {
            FusedInput::Shared(t) => {
                let fits = t.rank() <= self.shape.len()
                    && t.shape()
                        .iter()
                        .rev()
                        .zip(self.shape.iter().rev())
                        .all(|(&a, &b)| a == b || a == 1);
                if !fits {
                    return Err(op_err!(
                        Shape,
                        "fused",
                        "input {i} {} does not broadcast to {:?}",
                        t.ty(),
                        self.shape
                    ));
                }
            }
            FusedInput::Donated { storage, output } => {
                let dtype = self.outputs.get(*output).map(|&(_, d)| d);
                if storage.numel() != numel || dtype != Some(storage.dtype()) {
                    return Err(op_err!(
                        Argument,
                        "fused",
                        "input {i} ({} x {}) cannot be reused for output {output} of {numel} elements",
                        storage.numel(),
                        storage.dtype()
                    ));
                }
            }
        }
        Ok(())
    }

    fn run_as<A: Transcendental>(
        &self,
        registers: Option<&[FusedRegisters; 2]>,
        inputs: Vec<FusedInput<'_>>,
    ) -> Vec<Array> {
        let numel: usize = self.shape.iter().product();
        let (sources, mut outs) = self.sources_and_outputs(inputs, numel);
        let sinks: Vec<Sink> = outs
            .iter_mut()
            .map(|s| Sink {
                ptr: s.as_bytes_mut().as_mut_ptr(),
                dtype: s.dtype(),
            })
            .collect();
        // A kernel smaller than its block runs one block of its own size
        // (the same one block, with a smaller register file to set up).
        let bs = self.block.max(64).min(numel.div_ceil(64).max(1) * 64);
        let blocks = numel.div_ceil(bs);
        // Addresses (as integers, so the closure is Sync) of direct inputs.
        let direct: Vec<Option<usize>> = sources
            .iter()
            .map(|s| s.direct::<A>().map(|p| p as usize))
            .collect();
        let stream = numel * std::mem::size_of::<A>() >= stream_min_bytes();
        let allocated;
        let regs = match registers {
            Some(registers) => &registers[usize::from(stream)],
            None => {
                allocated = FusedRegisters::allocate(&self.steps, &self.outputs, stream);
                &allocated
            }
        };
        let spread = Spread::new(&self.steps, &direct);
        let run = Run {
            sources: &sources,
            direct: &direct,
            sinks: &sinks,
            regs,
            spread: &spread,
        };
        let run_blocks = |range: std::ops::Range<usize>| {
            with_thread_file(regs.count.max(1) * bs, |file: &mut [A]| {
                // Constants are filled once per task, not once per block.
                for (i, step) in self.steps.iter().enumerate() {
                    if let (&Step::Const(c), true) = (step, regs.filled[i]) {
                        let r = regs.slot[i] * bs;
                        file[r..r + bs].fill(A::from_f64(c));
                    }
                }
                // Streamed: the previous block, whose outputs are still in
                // their slots and stored during this block's steps.
                let mut pending = None;
                for b in range {
                    let start = b * bs;
                    let len = bs.min(numel - start);
                    let block = Block { bs, start, len };
                    self.eval_block(&run, file, block, pending);
                    if stream {
                        pending = Some(block);
                        continue;
                    }
                    for (&(step, _), sink) in self.outputs.iter().zip(&sinks) {
                        let r = regs.slot[step] * bs;
                        // SAFETY: each block writes its own disjoint range of every
                        // output, after it has loaded that range of every input.
                        unsafe { sink.store(start, &file[r..r + len], false) };
                    }
                }
                if let Some(last) = pending {
                    for (&(step, _), sink) in self.outputs.iter().zip(&sinks) {
                        let r = regs.slot[step] * bs;
                        // SAFETY: as above.
                        unsafe { sink.store(last.start, &file[r..r + last.len], true) };
                    }
                    store_fence();
                }
            })
        };
        let tasks = rayon::current_num_threads().max(1) * 4;
        if numel < super::copy::PAR_THRESHOLD || blocks < 2 {
            run_blocks(0..blocks);
        } else {
            let per = blocks.div_ceil(tasks);
            (0..tasks)
                .into_par_iter()
                .for_each(|t| run_blocks(t * per..((t + 1) * per).min(blocks)));
        }
        outs.into_iter()
            .map(|s| Array::from_storage(s, &self.shape))
            .collect()
    }

    /// Where each input is read from, and the outputs' storages: donated
    /// inputs' storages where given, new ones otherwise.
    fn sources_and_outputs<'a>(
        &self,
        inputs: Vec<FusedInput<'a>>,
        numel: usize,
    ) -> (Vec<Source<'a>>, Vec<Storage>) {
        let mut reused: Vec<Option<Storage>> = self.outputs.iter().map(|_| None).collect();
        let mut sources: Vec<Source<'a>> = Vec::with_capacity(inputs.len());
        for input in inputs {
            match input {
                FusedInput::Shared(t) => {
                    sources.push(Source::Shared(t, t.layout().expanded(&self.shape)))
                }
                FusedInput::Donated { storage, output } => {
                    reused[output] = Some(storage);
                    sources.push(Source::Output(output));
                }
            }
        }
        let outs = reused
            .into_iter()
            .zip(&self.outputs)
            .map(|(s, &(_, d))| s.unwrap_or_else(|| Storage::new(d, numel)))
            .collect();
        (sources, outs)
    }

    /// Evaluates every step over elements `start..start+len` of `block`
    /// into the register `file` (slots of `bs` elements); a load from an
    /// input with a `direct` address is that memory itself. The outputs of
    /// the `pending` block, still in their slots, are stored (streamed) a
    /// piece before each step, the last piece before the output's step.
    fn eval_block<A: Transcendental>(
        &self,
        run: &Run<'_, '_>,
        file: &mut [A],
        block: Block,
        pending: Option<Block>,
    ) {
        let Run {
            sources,
            direct,
            sinks,
            regs,
            spread,
            ..
        } = *run;
        let Block { bs, start, len } = block;
        let base = file.as_mut_ptr();
        let slots = file.len() / bs;
        let reg = |j: usize| {
            if let Step::Load(k) = self.steps[j] {
                if let Some(p) = direct[k] {
                    let p = p as *const A;
                    // SAFETY: a direct source holds the kernel's elements
                    // densely, `start..start+len` among them; nothing
                    // writes it while the block runs (a donated input is
                    // never direct: its output is stored after the block).
                    return unsafe { std::slice::from_raw_parts(p.add(start), len) };
                }
            }
            debug_assert!(regs.slot[j] < slots);
            // SAFETY: slot j is in the file; no step writes it while it is read
            // (a step's destination slot differs from its operands').
            unsafe { std::slice::from_raw_parts(base.add(regs.slot[j] * bs), len) }
        };
        let constant = |j: usize| match self.steps[j] {
            Step::Const(c) => Some(A::from_f64(c)),
            _ => None,
        };
        // The direct inputs of the block after next are fetched into L2
        // while this one is computed, a share before each step (see
        // `Spread`). Two blocks ahead: one block's compute is shorter than
        // a fetch from memory takes to arrive. (A hint: past the end is
        // harmless.)
        let size = std::mem::size_of::<A>();
        let last = self.steps.len() - 1;
        for (i, step) in self.steps.iter().enumerate() {
            for &p in direct.iter().flatten() {
                let share = spread.part(i, last, bs * size, 64);
                let ahead = p + (start + 2 * bs) * size + share.start;
                prefetch_l2(ahead as *const u8, share.len());
            }
            if let Some(prev) = pending {
                for (&(out, _), sink) in self.outputs.iter().zip(sinks) {
                    if i > out {
                        continue;
                    }
                    let part = spread.part(i, out, prev.len, 16);
                    // SAFETY: the output's slot is its own (`FusedRegisters`),
                    // written again only by step `out` of this block, after
                    // its last piece is stored; `prev`'s range of the output
                    // is this task's.
                    unsafe {
                        let vals = std::slice::from_raw_parts(
                            base.add(regs.slot[out] * bs + part.start),
                            part.len(),
                        );
                        sink.store(prev.start + part.start, vals, true);
                    }
                }
            }
            debug_assert!(regs.slot[i] < slots);
            // SAFETY: as above; this slot is not among the step's operands'.
            let dst = unsafe { std::slice::from_raw_parts_mut(base.add(regs.slot[i] * bs), len) };
            match *step {
                Step::Load(k) if direct[k].is_some() => {} // read where it is
                Step::Load(k) => match &sources[k] {
                    Source::Shared(t, layout) => load(t, layout, start, dst),
                    // SAFETY: this task owns `start..start+len` of the sink,
                    // which it stores only after every load of the block.
                    Source::Output(o) => unsafe { sinks[*o].load(start, dst) },
                },
                Step::Const(_) => {}
                Step::Unary(op, a) => unary_into(op, reg(a), dst),
                Step::Binary(op, a, b) => match (constant(a), constant(b)) {
                    (_, Some(c)) => binary_const_into(op, reg(a), c, dst),
                    (Some(c), None) => const_binary_into(op, c, reg(b), dst),
                    (None, None) => binary_into(op, reg(a), reg(b), dst),
                },
                Step::Compare(op, a, b) => compare_block(op, reg(a), reg(b), dst),
                Step::Where(c, a, b) => {
                    for (((d, &c), &x), &y) in dst.iter_mut().zip(reg(c)).zip(reg(a)).zip(reg(b)) {
                        *d = if c != A::ZERO { x } else { y };
                    }
                }
                Step::Round(dtype, a) => {
                    dst.copy_from_slice(reg(a));
                    round_block(dtype, dst);
                }
            }
        }
    }
}

thread_local! {
    /// This thread's register file (see [`with_thread_file`]), in words of
    /// 8 bytes: aligned for both compute types.
    static FILE: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on a register file of `len` elements of `A`: this thread's,
/// kept from kernel to kernel (a fresh file per task was an allocation and
/// a memset per kernel, much of a small kernel's time), or a fresh one if
/// this thread's is in use. What it holds is left from earlier kernels,
/// which no kernel sees: every slot is written by its step before a later
/// step of the block reads it, and constants are filled once per task
/// (`FusedRegisters`, `RowRegisters`).
pub(crate) fn with_thread_file<A: AccFloat, R>(len: usize, f: impl FnOnce(&mut [A]) -> R) -> R {
    const { assert!(std::mem::size_of::<A>() <= 8 && std::mem::align_of::<A>() <= 8) };
    let words = (len * std::mem::size_of::<A>()).div_ceil(8);
    FILE.with(|file| {
        let Ok(mut file) = file.try_borrow_mut() else {
            return f(&mut vec![A::ZERO; len]);
        };
        if file.len() < words {
            file.resize(words, 0);
        }
        // SAFETY: the words hold at least `len` elements of `A` (a float:
        // every bit pattern is a value), aligned (checked above), borrowed
        // mutably here alone.
        let file = unsafe { std::slice::from_raw_parts_mut(file.as_mut_ptr().cast::<A>(), len) };
        f(file)
    })
}

pub(crate) fn compare_block<A: AccFloat>(op: CompareOp, a: &[A], b: &[A], dst: &mut [A]) {
    let test = |x: A, y: A| match op {
        CompareOp::Eq => x == y,
        CompareOp::Ne => x != y,
        CompareOp::Lt => x < y,
        CompareOp::Le => x <= y,
        CompareOp::Gt => x > y,
        CompareOp::Ge => x >= y,
    };
    for ((d, &x), &y) in dst.iter_mut().zip(a).zip(b) {
        *d = if test(x, y) { A::ONE } else { A::ZERO };
    }
}

/// Rounds values to `dtype`'s precision (a cast inside the kernel).
pub(crate) fn round_block<A: AccFloat>(dtype: DType, xs: &mut [A]) {
    with_dtype!(dtype, T => {
        for x in xs.iter_mut() {
            *x = A::from_f64(Element::to_f64(<T as Element>::from_f64(x.to_f64())));
        }
    })
}

/// Whether element type `T` is the compute type `A` (f32 or f64, the only
/// `AccFloat`s): then loads and stores are plain copies.
fn same_repr<T: Element, A: AccFloat>() -> bool {
    let a = std::mem::size_of::<A>();
    (T::DTYPE == DType::F32 && a == 4) || (T::DTYPE == DType::F64 && a == 8)
}

/// Reads elements `start..start+dst.len()` (row-major over the kernel's
/// shape) of `t` through its broadcast layout.
pub(crate) fn load<A: AccFloat>(t: &Array, layout: &Layout, start: usize, dst: &mut [A]) {
    with_dtype!(t.dtype(), T => {
        let src = t.storage().as_slice::<T>();
        if let Some(range) = layout.contiguous_range() {
            let base = range.start + start;
            let n = dst.len();
            if same_repr::<T, A>() {
                // SAFETY: T and A are the same float type (checked).
                dst.copy_from_slice(unsafe { std::slice::from_raw_parts(src[base..].as_ptr() as *const A, n) });
                return;
            }
            for (d, s) in dst.iter_mut().zip(&src[base..base + n]) {
                *d = A::from_f64(Element::to_f64(*s));
            }
        } else if layout.strides.iter().all(|&s| s == 0) {
            dst.fill(A::from_f64(Element::to_f64(src[layout.offset])));
        } else {
            load_runs(src, layout, start, dst);
        }
    })
}

/// The most dims [`load_runs`] walks with an index on the stack.
const RUN_RANK: usize = 8;

/// [`load`] through a strided (broadcast, permuted) layout: the index of
/// element `start` is computed once, then the elements are read in runs
/// along the last dim (a fill for a broadcast dim, a copy for a dense one)
/// and the index carried from run to run, instead of dividing by every
/// dim for each element.
fn load_runs<T: Element, A: AccFloat>(src: &[T], layout: &Layout, start: usize, dst: &mut [A]) {
    let rank = layout.rank();
    if rank > RUN_RANK || dst.is_empty() {
        for (k, d) in dst.iter_mut().enumerate() {
            *d = A::from_f64(Element::to_f64(src[layout.offset_of(start + k)]));
        }
        return;
    }
    let (shape, strides) = (&layout.shape, &layout.strides);
    let mut index = [0usize; RUN_RANK];
    let (mut rest, mut offset) = (start, layout.offset);
    for d in (0..rank).rev() {
        index[d] = rest % shape[d];
        rest /= shape[d];
        offset += index[d] * strides[d];
    }
    let last = rank - 1;
    let (len, stride) = (shape[last], strides[last]);
    let mut done = 0;
    loop {
        let run = (len - index[last]).min(dst.len() - done);
        let out = &mut dst[done..done + run];
        match stride {
            0 => out.fill(A::from_f64(Element::to_f64(src[offset]))),
            1 if same_repr::<T, A>() => {
                // SAFETY: T and A are the same float type (checked).
                let from =
                    unsafe { std::slice::from_raw_parts(src[offset..].as_ptr() as *const A, run) };
                out.copy_from_slice(from);
            }
            _ => {
                for (j, d) in out.iter_mut().enumerate() {
                    *d = A::from_f64(Element::to_f64(src[offset + j * stride]));
                }
            }
        }
        done += run;
        if done == dst.len() {
            return;
        }
        // The next run starts at index 0 of the last dim: carry outwards.
        offset -= index[last] * stride;
        index[last] = 0;
        let mut d = last;
        while d > 0 {
            d -= 1;
            index[d] += 1;
            offset += strides[d];
            if index[d] < shape[d] {
                break;
            }
            offset -= shape[d] * strides[d];
            index[d] = 0;
        }
    }
}

/// Where a `Step::Load` reads: a shared tensor through its broadcast
/// layout, or the buffer of output `o` (a donated input, read in place).
enum Source<'a> {
    Shared(&'a Array, Layout),
    Output(usize),
}

impl Source<'_> {
    /// The address of element 0 of a shared input that holds the kernel's
    /// elements densely in the compute type `A`: blocks read it in place.
    fn direct<A: AccFloat>(&self) -> Option<*const A> {
        let Source::Shared(t, layout) = self else {
            return None;
        };
        let range = layout.contiguous_range()?;
        with_dtype!(t.dtype(), T => {
            if !same_repr::<T, A>() {
                return None;
            }
            Some(t.storage().as_slice::<T>()[range.start..].as_ptr() as *const A)
        })
    }
}

/// What every block of one run reads: the inputs, the outputs, the slots
/// and the spread of the memory traffic over the steps.
struct Run<'r, 'a> {
    sources: &'r [Source<'a>],
    direct: &'r [Option<usize>],
    sinks: &'r [Sink],
    regs: &'r FusedRegisters,
    spread: &'r Spread,
}

/// How one block's memory traffic (the prefetches of a later block's
/// inputs, the streamed stores of the previous block's outputs) is spread
/// over its steps: in proportion to each step's compute. Issued evenly per
/// step instead, the transfers of the steps that cost nothing (constants,
/// inputs read in place) and of the cheap arithmetic ones queue behind
/// each other on the core's few outstanding misses and stall it, while
/// the transcendental steps, most of the time, overlap none.
struct Spread {
    /// `cost[i]`: the summed weights of the steps before step `i`.
    cost: Vec<usize>,
}

impl Spread {
    fn new(steps: &[Step], direct: &[Option<usize>]) -> Spread {
        let mut cost = vec![0];
        for step in steps {
            let weight = match *step {
                Step::Const(_) => 0,
                Step::Load(k) if direct[k].is_some() => 0,
                // A polynomial or two and a reciprocal or a division: about
                // eight arithmetic steps (measured for tanh and sigmoid).
                Step::Unary(op, _)
                    if !matches!(op, UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Relu) =>
                {
                    8
                }
                _ => 1,
            };
            cost.push(cost[cost.len() - 1] + weight);
        }
        Spread { cost }
    }

    /// The piece of `0..total` that goes before step `i` of steps `0..=last`
    /// (`i <= last`): the pieces of those steps cover it, in order, and all
    /// but the last piece's ends are multiples of `align`.
    fn part(&self, i: usize, last: usize, total: usize, align: usize) -> std::ops::Range<usize> {
        let all = self.cost[last + 1];
        let at = |j: usize| match j {
            0 => 0,
            j if j > last => total,
            // Without cost (only free steps), everything goes at the last.
            _ if all == 0 => 0,
            j => total * self.cost[j] / all / align * align,
        };
        at(i)..at(i + 1)
    }
}

/// The elements one block covers: `start..start+len`, in slots of `bs`.
#[derive(Clone, Copy)]
struct Block {
    bs: usize,
    start: usize,
    len: usize,
}

/// Where one output goes: its storage's bytes and dtype.
struct Sink {
    ptr: *mut u8,
    dtype: DType,
}

// SAFETY: sinks are written at disjoint element ranges by different tasks.
unsafe impl Send for Sink {}
unsafe impl Sync for Sink {}

impl Sink {
    /// Reads `start..start+dst.len()` of the output (a donated input).
    ///
    /// # Safety
    /// The range is in bounds and no other task writes it meanwhile.
    unsafe fn load<A: AccFloat>(&self, start: usize, dst: &mut [A]) {
        with_dtype!(self.dtype, T => {
            if same_repr::<T, A>() {
                dst.copy_from_slice(std::slice::from_raw_parts((self.ptr as *const A).add(start), dst.len()));
                return;
            }
            let src = std::slice::from_raw_parts((self.ptr as *const T).add(start), dst.len());
            for (d, s) in dst.iter_mut().zip(src) {
                *d = A::from_f64(Element::to_f64(*s));
            }
        })
    }

    /// Writes `vals` at `start`, with non-temporal stores if `stream`
    /// (unfenced: the caller fences with `store_fence` before it returns).
    ///
    /// # Safety
    /// `start..start+vals.len()` is in bounds and written by no other task.
    unsafe fn store<A: AccFloat>(&self, start: usize, vals: &[A], stream: bool) {
        with_dtype!(self.dtype, T => {
            if same_repr::<T, A>() {
                let dst = std::slice::from_raw_parts_mut((self.ptr as *mut A).add(start), vals.len());
                if stream {
                    stream_copy_unfenced(dst, vals);
                } else {
                    dst.copy_from_slice(vals);
                }
                return;
            }
            let dst = std::slice::from_raw_parts_mut((self.ptr as *mut T).add(start), vals.len());
            for (d, v) in dst.iter_mut().zip(vals) {
                *d = <T as Element>::from_f64(v.to_f64());
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::kernel::MAX_BLOCK;
    use crate::ir::BinaryOp;
    use crate::tensor::Tensor;

    /// Strided loads in runs read what the per-element index reads, for
    /// permuted, broadcast and offset layouts, from any start, in the
    /// compute type and converted.
    #[test]
    fn strided_loads_in_runs_match_the_element_index() {
        let src: Vec<f32> = (0..400).map(|i| i as f32 * 0.5 - 7.0).collect();
        let wide: Vec<f64> = src.iter().map(|&v| f64::from(v)).collect();
        let layouts = [
            // [4, 5] transposed from [5, 4], offset 3.
            Layout {
                shape: vec![4, 5],
                strides: vec![1, 4],
                offset: 3,
            },
            // A row of 7 broadcast over 6 rows.
            Layout {
                shape: vec![6, 7],
                strides: vec![0, 1],
                offset: 10,
            },
            // A column broadcast along the last dim.
            Layout {
                shape: vec![3, 4, 5],
                strides: vec![20, 1, 0],
                offset: 0,
            },
            // Broadcast in the middle, a stride of 2 last.
            Layout {
                shape: vec![2, 3, 2, 4],
                strides: vec![60, 0, 17, 2],
                offset: 5,
            },
            // Length-1 dims.
            Layout {
                shape: vec![1, 9, 1],
                strides: vec![0, 3, 1],
                offset: 1,
            },
        ];
        for layout in &layouts {
            let n = layout.numel();
            let want: Vec<f32> = (0..n).map(|i| src[layout.offset_of(i)]).collect();
            for start in [0, 1, n / 3, n - 1] {
                for len in [1, 2, 5, n - start] {
                    let len = len.min(n - start);
                    let mut got = vec![0f32; len];
                    load_runs(&src, layout, start, &mut got);
                    assert_eq!(got, want[start..start + len], "{layout:?} {start}+{len}");
                    let mut converted = vec![0f32; len];
                    load_runs(&wide, layout, start, &mut converted);
                    assert_eq!(converted, want[start..start + len], "f64 {layout:?}");
                }
            }
        }
    }

    #[test]
    fn a_chain_with_broadcast_and_two_outputs() {
        // y = exp(x * w) + 1 (w broadcast over rows); z = y > 2
        let x = Tensor::from_vec(vec![0.0f32, 1.0, 2.0, -1.0, 0.5, 3.0], &[2, 3]);
        let w = Tensor::from_vec(vec![1.0f32, 0.5, -1.0], &[3]);
        let k = FusedKernel {
            shape: vec![2, 3],
            steps: vec![
                Step::Load(0),
                Step::Load(1),
                Step::Binary(BinaryOp::Mul, 0, 1),
                Step::Unary(UnaryOp::Exp, 2),
                Step::Const(1.0),
                Step::Binary(BinaryOp::Add, 3, 4),
                Step::Const(2.0),
                Step::Compare(CompareOp::Gt, 5, 6),
            ],
            outputs: vec![(5, DType::F32), (7, DType::Bool)],
            wide: false,
            block: 64,
        };
        let out = k.run(&[x.array(), w.array()]).unwrap();
        let want: Vec<f64> = [0.0f64, 0.5, -2.0, -1.0, 0.25, -3.0]
            .iter()
            .map(|v| v.exp() + 1.0)
            .collect();
        for (g, w) in out[0].to_f64_vec().iter().zip(&want) {
            assert!((g - w).abs() < 1e-6, "{g} vs {w}");
        }
        let flags: Vec<f64> = want.iter().map(|&v| (v > 2.0) as u8 as f64).collect();
        assert_eq!(out[1].to_f64_vec(), flags);
    }

    #[test]
    fn a_donated_input_is_overwritten_in_place_with_the_same_result() {
        // y = tanh(x) * x + w over more than one block, x donated to y.
        let n = 3 * MAX_BLOCK + 17;
        let xs: Vec<f32> = (0..n).map(|i| (i % 97) as f32 / 50.0 - 1.0).collect();
        let x = Tensor::from_vec(xs, &[n]);
        let w = Tensor::from_vec(vec![0.25f32], &[1]);
        let k = FusedKernel {
            shape: vec![n],
            steps: vec![
                Step::Load(0),
                Step::Unary(UnaryOp::Tanh, 0),
                Step::Binary(BinaryOp::Mul, 1, 0),
                Step::Load(1),
                Step::Binary(BinaryOp::Add, 2, 3),
            ],
            outputs: vec![(4, DType::F32)],
            wide: false,
            block: MAX_BLOCK,
        };
        let want = k.run(&[x.array(), w.array()]).unwrap()[0].to_f64_vec();
        let storage = (x.into_unique_array().ok())
            .and_then(|a| a.into_unique_storage())
            .expect("x is not shared");
        let address = storage.as_bytes().as_ptr();
        let got = k
            .run_with(vec![
                FusedInput::Donated { storage, output: 0 },
                FusedInput::Shared(w.array()),
            ])
            .unwrap();
        assert_eq!(
            got[0].storage().as_bytes().as_ptr(),
            address,
            "written in place"
        );
        assert_eq!(got[0].to_f64_vec(), want);
    }

    #[test]
    fn every_block_size_gives_the_same_bits_and_slots_are_reused() {
        // where(x > 0.5, tanh(x) * 3, x - 1) + 2: constants read by a compare
        // and by binary ops, over several blocks and a ragged end.
        let n = 5 * 1024 + 3;
        let xs: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0)
            .collect();
        let x = Tensor::from_vec(xs.clone(), &[n]);
        let steps = vec![
            Step::Load(0),
            Step::Const(0.5),
            Step::Compare(CompareOp::Gt, 0, 1),
            Step::Unary(UnaryOp::Tanh, 0),
            Step::Const(3.0),
            Step::Binary(BinaryOp::Mul, 3, 4),
            Step::Const(1.0),
            Step::Binary(BinaryOp::Sub, 0, 6),
            Step::Where(2, 5, 7),
            Step::Const(2.0),
            Step::Binary(BinaryOp::Add, 8, 9),
        ];
        let regs = FusedRegisters::allocate(&steps, &[(10, DType::F32)], false);
        assert!(regs.count < steps.len(), "dead values' slots are reused");
        let mut k = FusedKernel::new(vec![n], steps, vec![(10, DType::F32)], false);
        let want: Vec<f64> = xs
            .iter()
            .map(|&v| {
                let t = if v > 0.5 {
                    super::super::fastmath::tanh_f32(v) * 3.0
                } else {
                    v - 1.0
                };
                (t + 2.0) as f64
            })
            .collect();
        for block in [64, 256, 1024, 4096] {
            k.block = block;
            assert_eq!(
                k.run(&[x.array()]).unwrap()[0].to_f64_vec(),
                want,
                "block {block}"
            );
        }
    }

    #[test]
    fn inputs_read_in_place_and_streamed_outputs_give_the_eager_bits() {
        // Past the streaming threshold: x a view at an offset (read in
        // place), w broadcast (loaded), the output stored non-temporally;
        // and an f64 output of the same values (converted, not streamed).
        let min = 1 << 20;
        let n = min / 4 + 1037;
        let all: Vec<f32> = (0..n + 3)
            .map(|i| ((i * 7919) % 2000) as f32 / 500.0 - 2.0)
            .collect();
        let x = Tensor::from_vec(all, &[n + 3]).narrow(0, 3, n);
        let w = Tensor::from_vec(vec![0.75f32], &[1]);
        let k = FusedKernel::new(
            vec![n],
            vec![
                Step::Load(0),
                Step::Unary(UnaryOp::Sigmoid, 0),
                Step::Load(1),
                Step::Binary(BinaryOp::Mul, 1, 2),
                Step::Const(0.5),
                Step::Binary(BinaryOp::Sub, 3, 4),
                Step::Unary(UnaryOp::Tanh, 5),
                Step::Binary(BinaryOp::Add, 6, 0),
            ],
            vec![(7, DType::F32), (7, DType::F64)],
            false,
        );
        let got = super::super::stream::with_stream_min_bytes(min, || {
            k.run(&[x.array(), w.array()]).unwrap()
        });
        let want = ((x.sigmoid() * &w - 0.5).tanh() + &x).to_f64_vec();
        assert_eq!(got[0].to_f64_vec(), want);
        assert_eq!(got[1].to_f64_vec(), want);
    }

    /// The benchmark's chain, per element with the scalar functions, and
    /// the value after its tanh step (a second output, stored by an earlier
    /// step than the last).
    fn chain_by_element(x: f32) -> (f32, f32) {
        let t = super::super::fastmath::tanh_f32(x * 1.5 + 0.25);
        let r = t * x - 0.5;
        // relu as the kernels compute it: NaN stays NaN.
        let r = if r < 0.0 { 0.0 } else { r };
        let y = super::super::elementwise::sigmoid(r) * 2.0;
        (y, t)
    }

    #[test]
    fn streamed_and_plain_outputs_equal_the_scalar_chain_at_every_size() {
        // Sizes: a single element, a part of one vector, ragged tails of one
        // and of several blocks, and more than one task's worth; each with
        // outputs stored plainly and streamed (a piece at a time during the
        // next block), at several block sizes, with three outputs stored at
        // different steps (f32, f32 and a converted f64).
        let (x1, c15, c025) = (0, 1, 2);
        let steps = vec![
            Step::Load(0),
            Step::Const(1.5),
            Step::Const(0.25),
            Step::Binary(BinaryOp::Mul, x1, c15),
            Step::Binary(BinaryOp::Add, 3, c025),
            Step::Unary(UnaryOp::Tanh, 4),
            Step::Binary(BinaryOp::Mul, 5, x1),
            Step::Const(0.5),
            Step::Binary(BinaryOp::Sub, 6, 7),
            Step::Unary(UnaryOp::Relu, 8),
            Step::Unary(UnaryOp::Sigmoid, 9),
            Step::Const(2.0),
            Step::Binary(BinaryOp::Mul, 10, 11),
        ];
        let outputs = vec![(12, DType::F32), (5, DType::F32), (12, DType::F64)];
        for n in [1, 13, 64 * 3 + 7, 4096 + 13, (1 << 15) + 4099] {
            // Every kind of value: both tanh branches, relu's zero, NaN, ±inf.
            let xs: Vec<f32> = (0..n)
                .map(|i| match i % 101 {
                    0 => f32::NAN,
                    1 => f32::INFINITY,
                    2 => f32::NEG_INFINITY,
                    k => (k as f32 - 50.0) / 9.0,
                })
                .collect();
            let x = Tensor::from_vec(xs.clone(), &[n]);
            let want: Vec<(f32, f32)> = xs.iter().map(|&v| chain_by_element(v)).collect();
            for block in [64, 256, 2048] {
                let k = FusedKernel {
                    shape: vec![n],
                    steps: steps.clone(),
                    outputs: outputs.clone(),
                    wide: false,
                    block,
                };
                for min in [usize::MAX, 64] {
                    let got = super::super::stream::with_stream_min_bytes(min, || {
                        k.run(&[x.array()]).unwrap()
                    });
                    let y = got[0].to_vec::<f32>().unwrap();
                    let t = got[1].to_vec::<f32>().unwrap();
                    let y64 = got[2].to_vec::<f64>().unwrap();
                    for i in 0..n {
                        let (wy, wt) = want[i];
                        let at = format!(
                            "n {n}, block {block}, streaming from {min}, x[{i}] = {}",
                            xs[i]
                        );
                        // The same bits, or NaN where NaN is due (its payload is not specified).
                        let same = |g: f64, w: f64| {
                            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan())
                        };
                        assert!(same(y[i] as f64, wy as f64), "{} vs {wy}, {at}", y[i]);
                        assert!(
                            same(t[i] as f64, wt as f64),
                            "tanh output {} vs {wt}, {at}",
                            t[i]
                        );
                        assert!(
                            same(y64[i], wy as f64),
                            "f64 output {} vs {wy}, {at}",
                            y64[i]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn spread_parts_cover_the_range_in_order() {
        let direct = [Some(0)];
        let steps = [
            Step::Load(0),
            Step::Const(1.0),
            Step::Binary(BinaryOp::Add, 0, 1),
            Step::Unary(UnaryOp::Tanh, 2),
            Step::Unary(UnaryOp::Relu, 3),
        ];
        let spread = Spread::new(&steps, &direct);
        for (last, total, align) in [(4, 8192, 64), (3, 1000, 16), (0, 100, 16), (1, 77, 16)] {
            let parts: Vec<_> = (0..=last)
                .map(|i| spread.part(i, last, total, align))
                .collect();
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts[last].end, total);
            for w in parts.windows(2) {
                assert_eq!(w[0].end, w[1].start, "{parts:?}");
                assert!(w[0].start <= w[0].end && w[0].end % align == 0, "{parts:?}");
            }
        }
        // Nothing before the steps that cost nothing; the tanh gets most.
        let parts: Vec<_> = (0..5).map(|i| spread.part(i, 4, 8192, 64)).collect();
        assert!(parts[0].is_empty() && parts[1].is_empty(), "{parts:?}");
        assert!(parts[3].len() > 4 * parts[2].len(), "{parts:?}");
    }

    #[test]
    fn a_constant_output_is_the_constant() {
        // A constant that is an output and read by nothing: it has a slot
        // of its own, filled once, whatever the other steps write.
        let n = 2 * MAX_BLOCK + 5;
        let x = Tensor::from_vec((0..n).map(|i| i as f32).collect(), &[n]);
        let k = FusedKernel::new(
            vec![n],
            vec![
                Step::Load(0),
                Step::Const(2.5),
                Step::Unary(UnaryOp::Neg, 0),
            ],
            vec![(1, DType::F32), (2, DType::F32)],
            false,
        );
        for min in [usize::MAX, 64] {
            let got =
                super::super::stream::with_stream_min_bytes(min, || k.run(&[x.array()]).unwrap());
            assert_eq!(got[0].to_f64_vec(), vec![2.5; n], "streaming from {min}");
            assert_eq!(got[1].to_f64_vec(), x.neg().to_f64_vec());
        }
    }

    #[test]
    fn a_donation_of_the_wrong_size_is_an_error() {
        let k = FusedKernel {
            shape: vec![4],
            steps: vec![Step::Load(0)],
            outputs: vec![(0, DType::F32)],
            wide: false,
            block: 64,
        };
        let small = Storage::new(DType::F32, 3);
        let e = k
            .run_with(vec![FusedInput::Donated {
                storage: small,
                output: 0,
            }])
            .unwrap_err();
        assert!(e.message.contains("cannot be reused"), "{e}");
    }
}
