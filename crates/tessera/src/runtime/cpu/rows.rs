//! The fused row kernel: reductions along the last dim together with their
//! pointwise producers (prologue) and consumers (epilogue), evaluated one
//! row at a time. A row (at most [`MAX_ROW`] elements) stays in cache from
//! its load to its store, so e.g. softmax — as one op or decomposed into
//! max, sub, exp, sum, div — reads its input once and writes its output
//! once.
//!
//! Values are of two kinds: *row* values (`[outer.., len]`, one register of
//! `len` elements per row) and *scalar* values (`[outer.., 1]` or `[outer..]`,
//! one number per row). Pointwise steps broadcast scalars over rows. Every
//! step computes what the eager kernel of its op computes (the same
//! functions; reductions fold each contiguous row as eager `reduce` does),
//! so the results equal op-by-op evaluation in the compute type.

use std::borrow::Cow;

use rayon::prelude::*;

use super::element::num_like::AccFloat;
use super::elementwise::{
    binary_const_into, binary_into, const_binary_into, unary_into, Transcendental,
};
use super::fused::{compare_block, load, round_block, with_thread_file};
use super::reduce::{reduce_row, softmax_row, Arith, RowIo, SoftmaxExp, ROW_MAX};
use super::stream::stream_min_bytes;
use super::{Element, Storage};
use crate::error::{op_err, Result};
use crate::ir::kernel::{RowKernel, RowRegisters, RowStep, Step, MAX_ROW};
use crate::ir::DType;
use crate::runtime::array::Array;
use crate::runtime::layout::Layout;
use crate::with_dtype;

// The row kernel's limit (`ir::kernel::MAX_ROW`) is the longest row the
// fold of `reduce_row` takes in one pass.
const _: () = assert!(MAX_ROW == ROW_MAX);

impl RowKernel {
    /// The kernel's full shape, `outer ++ [len]`, once every input is
    /// checked to broadcast to it (every backend's row kernel reads its
    /// inputs through that broadcast).
    pub fn checked_shape(&self, inputs: &[&Array]) -> Result<Vec<usize>> {
        let full: Vec<usize> = self.outer.iter().copied().chain([self.len]).collect();
        for (i, t) in inputs.iter().enumerate() {
            let fits = t.rank() <= full.len()
                && t.shape()
                    .iter()
                    .rev()
                    .zip(full.iter().rev())
                    .all(|(&a, &b)| a == b || a == 1);
            if !fits {
                return Err(op_err!(
                    Shape,
                    "fused_rows",
                    "input {i} {} does not broadcast to {full:?}",
                    t.ty()
                ));
            }
        }
        Ok(full)
    }

    /// Runs the kernel on `inputs` (numbered by `Step::Load`), each
    /// broadcastable to `outer ++ [len]`.
    pub fn run(&self, inputs: &[&Array]) -> Result<Vec<Array>> {
        self.run_registers(None, inputs)
    }

    /// [`RowKernel::run`] with the kernel's `registers` allocated by the
    /// caller ([`RowRegisters::allocate`]), once for all its runs.
    pub fn run_in(&self, registers: &RowRegisters, inputs: &[&Array]) -> Result<Vec<Array>> {
        self.run_registers(Some(registers), inputs)
    }

    fn run_registers(
        &self,
        registers: Option<&RowRegisters>,
        inputs: &[&Array],
    ) -> Result<Vec<Array>> {
        let full = self.checked_shape(inputs)?;
        self.check(inputs.len())?;
        if registers.is_some_and(|r| r.slot.len() != self.steps.len()) {
            return Err(op_err!(
                Verify,
                "fused_rows",
                "internal error: registers of another kernel given to one of {} steps",
                self.steps.len()
            ));
        }
        let registers = match registers {
            Some(r) => Cow::Borrowed(r),
            None => Cow::Owned(RowRegisters::allocate(self)),
        };
        let sources: Vec<Option<Source<'_>>> =
            inputs.iter().map(|t| Some(Source::new(t, &full))).collect();
        Ok(if self.wide {
            self.run_as::<f64>(&sources, registers)
        } else {
            self.run_as::<f32>(&sources, registers)
        })
    }

    /// Runs the kernel with the inputs `fed` (row values spanning
    /// `outer ++ [len]`, of the f32 compute type) not read from memory but
    /// handed over block by block: `feed(each)` calls `each(first row,
    /// values)` with consecutive rows' values (`len` each, `values[i]` of
    /// input `fed[i]`) for every row once, from any thread, and the rows
    /// are evaluated right away while in cache. The fed inputs are `None`
    /// in `inputs`; the others are as for [`run`].
    ///
    /// [`run`]: RowKernel::run
    pub fn run_fed(
        &self,
        inputs: &[Option<&Array>],
        fed: &[usize],
        feed: impl FnOnce(&(dyn Fn(usize, &[&[f32]]) + Sync)),
    ) -> Result<Vec<Array>> {
        let read: Vec<&Array> = inputs.iter().flatten().copied().collect();
        let full = self.checked_shape(&read)?;
        let unread = inputs.iter().filter(|t| t.is_none()).count();
        self.check(inputs.len())?;
        let steps: Option<Vec<usize>> = fed
            .iter()
            .map(|&j| {
                let step = self
                    .steps
                    .iter()
                    .position(|s| *s == RowStep::Point(Step::Load(j)))?;
                let fits = inputs.get(j).is_some_and(Option::is_none) && self.is_row[step];
                fits.then_some(step)
            })
            .collect();
        let Some(steps) = steps.filter(|_| unread == fed.len() && !self.wide) else {
            return Err(op_err!(
                Verify,
                "fused_rows",
                "internal error: inputs {fed:?} of an f32 row kernel cannot be fed by blocks"
            ));
        };
        let sources: Vec<Option<Source<'_>>> = inputs
            .iter()
            .map(|t| t.map(|t| Source::new(t, &full)))
            .collect();
        let registers = Cow::Owned(RowRegisters::allocate(self));
        let eval = Evaluation::<f32>::new(self, &sources, registers, steps);
        feed(&|first: usize, values: &[&[f32]]| {
            let count = values.first().map_or(0, |v| v.len() / self.len.max(1));
            eval.rows(first..first + count, values);
        });
        Ok(eval.finish())
    }

    fn run_as<A: Transcendental + SoftmaxExp>(
        &self,
        sources: &[Option<Source<'_>>],
        registers: Cow<'_, RowRegisters>,
    ) -> Vec<Array> {
        let rows = self.rows();
        let eval = Evaluation::<A>::new(self, sources, registers, Vec::new());
        let per_task = (super::copy::PAR_THRESHOLD / self.len.max(1)).max(1);
        if rows * self.len < super::copy::PAR_THRESHOLD || rows < 2 {
            eval.rows(0..rows, &[]);
        } else {
            let tasks = rows.div_ceil(per_task);
            (0..tasks)
                .into_par_iter()
                .for_each(|t| eval.rows(t * per_task..((t + 1) * per_task).min(rows), &[]));
        }
        eval.finish()
    }

    /// Evaluates row `r`: row step `i` lives at `at[i]` (a register slot,
    /// or the input or output memory itself, see [`Direct`]). `io`: where
    /// the values live, whether outputs in memory are streamed, and the
    /// scratch row a streamed softmax needs.
    fn eval_row<A: Transcendental + SoftmaxExp>(
        &self,
        r: usize,
        sources: &[Option<Source<'_>>],
        io: (&Direct, bool, &mut [A]),
        at: &[*mut A],
        scalars: &mut [A],
    ) {
        let (direct, stream, scratch) = io;
        let len = self.len;
        let row = |j: usize| {
            // SAFETY: `at[j]` holds `len` elements (see `Direct::place_row`),
            // and no step writes where one of its operands lives.
            unsafe { std::slice::from_raw_parts(at[j] as *const A, len) }
        };
        for (i, step) in self.steps.iter().enumerate() {
            if !self.is_row[i] {
                scalars[i] = self.eval_scalar(step, r, sources, scalars, &row);
                continue;
            }
            if direct.input[i] {
                continue; // an input read where it is
            }
            // SAFETY: as above; this step's place is none of its operands'.
            let dst = unsafe { std::slice::from_raw_parts_mut(at[i], len) };
            match step {
                RowStep::Point(p) => self.eval_point(p, r, sources, dst, &row, scalars),
                RowStep::Softmax { log, arg } => {
                    let io = RowIo {
                        stream: stream && direct.in_output[i],
                        // Input rows read in place follow one another.
                        prefetch_next: direct.input[*arg] && !direct.fed.contains(arg),
                    };
                    softmax_row(row(*arg), dst, *log, scratch, io)
                }
                RowStep::Reduce(..) => unreachable!("reductions are scalar values"),
            }
        }
    }

    /// A row-valued pointwise step; scalar operands are broadcast.
    fn eval_point<'f, A: Transcendental + 'f>(
        &self,
        step: &Step,
        r: usize,
        sources: &[Option<Source<'_>>],
        dst: &mut [A],
        row: &impl Fn(usize) -> &'f [A],
        scalars: &[A],
    ) {
        let is_row = |j: usize| self.is_row[j];
        match *step {
            Step::Load(k) => source(sources, k).load_row(r * self.len, dst),
            Step::Unary(op, a) => unary_into(op, row(a), dst),
            Step::Binary(op, a, b) => match (is_row(a), is_row(b)) {
                (true, true) => binary_into(op, row(a), row(b), dst),
                (true, false) => binary_const_into(op, row(a), scalars[b], dst),
                (false, true) => const_binary_into(op, scalars[a], row(b), dst),
                (false, false) => unreachable!("a row value has a row operand"),
            },
            Step::Compare(op, a, b) => {
                let (x, y) = (self.spread(a, row, scalars), self.spread(b, row, scalars));
                compare_block(op, &x, &y, dst);
            }
            Step::Where(c, a, b) => {
                let c = self.spread(c, row, scalars);
                let (x, y) = (self.spread(a, row, scalars), self.spread(b, row, scalars));
                for (((d, &c), &x), &y) in dst.iter_mut().zip(c.iter()).zip(x.iter()).zip(y.iter())
                {
                    *d = if c != <A as AccFloat>::ZERO { x } else { y };
                }
            }
            Step::Round(dtype, a) => {
                dst.copy_from_slice(row(a));
                round_block(dtype, dst);
            }
            Step::Const(_) => unreachable!("constants are scalar values"),
        }
    }

    /// Operand `j` as a row: its register, or its scalar repeated.
    fn spread<'f, A: AccFloat>(
        &self,
        j: usize,
        row: &impl Fn(usize) -> &'f [A],
        scalars: &[A],
    ) -> std::borrow::Cow<'f, [A]> {
        if self.is_row[j] {
            std::borrow::Cow::Borrowed(row(j))
        } else {
            std::borrow::Cow::Owned(vec![scalars[j]; self.len])
        }
    }

    /// A scalar step of row `r`, by the same functions as the row steps.
    fn eval_scalar<'f, A: Transcendental + Arith + 'f>(
        &self,
        step: &RowStep,
        r: usize,
        sources: &[Option<Source<'_>>],
        scalars: &[A],
        row: &impl Fn(usize) -> &'f [A],
    ) -> A {
        let one = |s: usize| [scalars[s]];
        let mut out = [<A as AccFloat>::ZERO];
        match step {
            RowStep::Reduce(op, a) => return reduce_row(*op, row(*a)),
            RowStep::Softmax { .. } => unreachable!("softmax is a row value"),
            RowStep::Point(p) => match *p {
                Step::Load(k) => return source(sources, k).load_one(r),
                Step::Const(c) => return A::from_f64(c),
                Step::Unary(op, a) => unary_into(op, &one(a), &mut out),
                Step::Binary(op, a, b) => binary_into(op, &one(a), &one(b), &mut out),
                Step::Compare(op, a, b) => compare_block(op, &one(a), &one(b), &mut out),
                Step::Where(c, a, b) => {
                    out[0] = if scalars[c] != <A as AccFloat>::ZERO {
                        scalars[a]
                    } else {
                        scalars[b]
                    }
                }
                Step::Round(dtype, a) => {
                    out[0] = scalars[a];
                    round_block(dtype, &mut out);
                }
            },
        }
        out[0]
    }

    fn store_row<A: AccFloat>(
        &self,
        r: usize,
        sinks: &Sinks,
        direct: &Direct,
        at: &[*mut A],
        scalars: &[A],
    ) {
        for (o, (&(s, dtype, _), &(ptr, _))) in self.outputs.iter().zip(&sinks.0).enumerate() {
            if direct.output[o] {
                continue;
            }
            if self.is_row[s] {
                // SAFETY: `at[s]` holds the row; row r of every output is
                // written by this task only.
                let vals = unsafe { std::slice::from_raw_parts(at[s] as *const A, self.len) };
                unsafe { store(ptr, dtype, r * self.len, vals) };
            } else {
                // SAFETY: as above.
                unsafe { store(ptr, dtype, r, &[scalars[s]]) };
            }
        }
    }
}

/// A row kernel's evaluation into its (allocated) outputs, a range of
/// rows at a time from any thread (each row once).
struct Evaluation<'k, 's, A> {
    kernel: &'k RowKernel,
    sources: &'k [Option<Source<'s>>],
    outs: Vec<Storage>,
    sinks: Sinks,
    slots: Cow<'k, RowRegisters>,
    direct: Direct,
    /// Rows written straight into outputs far larger than the caches are
    /// stored non-temporally (softmax, through a scratch row).
    stream: bool,
    softmax: bool,
    _compute: std::marker::PhantomData<A>,
}

impl<'k, 's, A: Transcendental + SoftmaxExp> Evaluation<'k, 's, A> {
    /// `fed`: the steps whose rows [`Evaluation::rows`] is handed (`Load`s
    /// of the inputs that have no source).
    fn new(
        kernel: &'k RowKernel,
        sources: &'k [Option<Source<'s>>],
        slots: Cow<'k, RowRegisters>,
        fed: Vec<usize>,
    ) -> Evaluation<'k, 's, A> {
        let rows = kernel.rows();
        let mut outs: Vec<Storage> = kernel
            .outputs
            .iter()
            .map(|(s, d, _)| {
                let numel = if kernel.is_row[*s] {
                    rows * kernel.len
                } else {
                    rows
                };
                Storage::new(*d, numel)
            })
            .collect();
        let sinks = Sinks(
            outs.iter_mut()
                .map(|s| (s.as_bytes_mut().as_mut_ptr(), s.dtype()))
                .collect(),
        );
        let direct = Direct::find::<A>(kernel, sources, &sinks, fed);
        let bytes: usize = outs.iter().map(|s| s.as_bytes().len()).sum();
        Evaluation {
            kernel,
            sources,
            slots,
            direct,
            stream: bytes >= stream_min_bytes(),
            softmax: kernel
                .steps
                .iter()
                .any(|s| matches!(s, RowStep::Softmax { .. })),
            outs,
            sinks,
            _compute: std::marker::PhantomData,
        }
    }

    /// Evaluates and stores `range`'s rows; `fed[i]` holds fed step `i`'s
    /// values of these rows (`len` per row).
    fn rows(&self, range: std::ops::Range<usize>, fed: &[&[A]]) {
        with_thread_file(self.slots.count * self.kernel.len, |file: &mut [A]| {
            self.rows_in(range, fed, file)
        })
    }

    /// [`Evaluation::rows`] with the register `file` of its slots.
    fn rows_in(&self, range: std::ops::Range<usize>, fed: &[&[A]], file: &mut [A]) {
        let k = self.kernel;
        let len = k.len;
        let mut scalars = vec![<A as AccFloat>::ZERO; k.steps.len()];
        let mut at = vec![std::ptr::null_mut::<A>(); k.steps.len()];
        let scratch_len = if self.stream && self.softmax { len } else { 0 };
        let mut scratch = vec![<A as AccFloat>::ZERO; scratch_len];
        let start = range.start;
        for r in range {
            self.direct.place_row(r, len, &self.slots, file, &mut at);
            for (&step, values) in self.direct.fed.iter().zip(fed) {
                // Read only: no step writes where an input lives.
                at[step] = values[(r - start) * len..][..len].as_ptr() as *mut A;
            }
            let io = (&self.direct, self.stream, &mut scratch[..]);
            k.eval_row(r, self.sources, io, &at, &mut scalars);
            k.store_row(r, &self.sinks, &self.direct, &at, &scalars);
        }
    }

    fn finish(self) -> Vec<Array> {
        self.outs
            .into_iter()
            .zip(&self.kernel.outputs)
            .map(|(s, (_, _, shape))| Array::from_storage(s, shape))
            .collect()
    }
}

/// Row values that live in memory rather than in a register slot: a
/// contiguous input of the compute type is read where it is (no copy), and
/// a row output of the compute type is computed into the output buffer.
struct Direct {
    /// Per step: the base address of its rows (`row r` at `base + r * len`).
    base: Vec<Option<usize>>,
    /// Per step: an input read in place (nothing to load).
    input: Vec<bool>,
    /// Per output: written in place by its step (nothing to store).
    output: Vec<bool>,
    /// Per step: computed straight into an output's memory.
    in_output: Vec<bool>,
    /// The steps whose rows are handed over (see [`RowKernel::run_fed`]).
    fed: Vec<usize>,
}

impl Direct {
    /// `fed`: the steps whose rows are handed to the evaluation (inputs
    /// without a source, read where they are handed).
    fn find<A: AccFloat>(
        k: &RowKernel,
        sources: &[Option<Source<'_>>],
        sinks: &Sinks,
        fed: Vec<usize>,
    ) -> Direct {
        let width = std::mem::size_of::<A>();
        let same = |d: DType| d.size_bytes() == width && d.is_float();
        let mut base: Vec<Option<usize>> = vec![None; k.steps.len()];
        for (i, step) in k.steps.iter().enumerate() {
            if let (RowStep::Point(Step::Load(j)), true) = (step, k.is_row[i]) {
                let Some(source) = &sources[*j] else { continue };
                let t = source.tensor;
                if let (Some(range), true) = (source.full.contiguous_range(), same(t.dtype())) {
                    let bytes = t.storage().as_bytes();
                    base[i] = Some(bytes.as_ptr() as usize + range.start * width);
                }
            }
        }
        let mut input: Vec<bool> = base.iter().map(Option::is_some).collect();
        for &f in &fed {
            input[f] = true;
        }
        let mut output = vec![false; k.outputs.len()];
        let mut in_output = vec![false; k.steps.len()];
        for (o, &(s, dtype, _)) in k.outputs.iter().enumerate() {
            // An output step computed once into the buffer (a step that is
            // two outputs is stored for the second).
            if k.is_row[s] && same(dtype) && !input[s] {
                base[s] = Some(sinks.0[o].0 as usize);
                output[o] = true;
                in_output[s] = true;
            }
        }
        Direct {
            base,
            input,
            output,
            in_output,
            fed,
        }
    }

    /// Points each row step of row `r` at its place.
    fn place_row<A>(
        &self,
        r: usize,
        len: usize,
        slots: &RowRegisters,
        file: &mut [A],
        at: &mut [*mut A],
    ) {
        let width = std::mem::size_of::<A>();
        for (i, place) in at.iter_mut().enumerate() {
            *place = match self.base[i] {
                Some(b) => (b + r * len * width) as *mut A,
                None if slots.used[i] => file[slots.slot[i] * len..].as_mut_ptr(),
                None => std::ptr::null_mut(),
            };
        }
    }
}

/// Input `k`'s source: every input has one but the fed input, which is
/// never loaded (its rows are handed over, see [`Direct::fed`]).
fn source<'a, 's>(sources: &'a [Option<Source<'s>>], k: usize) -> &'a Source<'s> {
    sources[k]
        .as_ref()
        .expect("only a fed input has no source, and it is read where it is handed")
}

/// Output buffers, written at disjoint rows by the tasks.
struct Sinks(Vec<(*mut u8, DType)>);
// SAFETY: tasks write disjoint ranges (their own rows).
unsafe impl Sync for Sinks {}

/// # Safety
/// `start..start + vals.len()` is in bounds of the buffer and written by no
/// other task.
unsafe fn store<A: AccFloat>(ptr: *mut u8, dtype: DType, start: usize, vals: &[A]) {
    with_dtype!(dtype, T => {
        let dst = std::slice::from_raw_parts_mut((ptr as *mut T).add(start), vals.len());
        for (d, v) in dst.iter_mut().zip(vals) {
            *d = <T as Element>::from_f64(v.to_f64());
        }
    })
}

/// An input, with its layout broadcast to `outer ++ [len]` (row loads) and
/// to `outer ++ [1]` (scalar loads).
struct Source<'a> {
    tensor: &'a Array,
    full: Layout,
    per_row: Layout,
}

impl<'a> Source<'a> {
    fn new(t: &'a Array, full: &[usize]) -> Source<'a> {
        let mut per_row_shape = full.to_vec();
        *per_row_shape.last_mut().expect("rank >= 1") = 1;
        let layout = t.layout();
        let per_row = if layout.shape.last().is_some_and(|&n| n != 1) {
            // A row input is never loaded as a scalar; keep a valid layout.
            layout.expanded(full)
        } else {
            layout.expanded(&per_row_shape)
        };
        Source {
            tensor: t,
            full: layout.expanded(full),
            per_row,
        }
    }

    fn load_row<A: AccFloat>(&self, start: usize, dst: &mut [A]) {
        load(self.tensor, &self.full, start, dst)
    }

    fn load_one<A: AccFloat>(&self, r: usize) -> A {
        let mut v = [<A as AccFloat>::ZERO];
        with_dtype!(self.tensor.dtype(), T => {
            let src = self.tensor.storage().as_slice::<T>();
            v[0] = A::from_f64(Element::to_f64(src[self.per_row.offset_of(r)]));
        });
        v[0]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{BinaryOp, ReduceOp};
    use crate::tensor::Tensor;

    #[test]
    fn a_streamed_softmax_row_kernel_gives_the_eager_bits() {
        // The input read in place with the next row prefetched, the output
        // written in place through the scratch row with non-temporal stores.
        let (rows, len) = (300, 1000);
        let xs: Vec<f32> = (0..rows * len)
            .map(|i| ((i * 7919) % 1013) as f32 * 0.02 - 10.0)
            .collect();
        let x = Tensor::from_vec(xs, &[rows, len]);
        for log in [false, true] {
            let k = RowKernel {
                outer: vec![rows],
                len,
                steps: vec![
                    RowStep::Point(Step::Load(0)),
                    RowStep::Softmax { log, arg: 0 },
                ],
                is_row: vec![true, true],
                outputs: vec![(1, DType::F32, vec![rows, len])],
                wide: false,
            };
            let run = || k.run(&[x.array()]).unwrap();
            let got = super::super::stream::with_stream_min_bytes(1 << 20, run);
            let eager = if log {
                x.log_softmax(-1)
            } else {
                x.softmax(-1)
            };
            assert_eq!(got[0].to_f64_vec(), eager.to_f64_vec(), "log {log}");
        }
    }

    #[test]
    fn decomposed_softmax_in_one_row_kernel_matches_the_softmax_kernel() {
        // m = max(x); e = exp(x - m); s = sum(e); y = e / s  vs  softmax(x)
        let xs: Vec<f32> = (0..3 * 40)
            .map(|i| ((i * 37) % 23) as f32 * 0.3 - 3.0)
            .collect();
        let x = Tensor::from_vec(xs, &[3, 40]);
        let k = RowKernel {
            outer: vec![3],
            len: 40,
            steps: vec![
                RowStep::Point(Step::Load(0)),
                RowStep::Reduce(ReduceOp::Max, 0),
                RowStep::Point(Step::Binary(BinaryOp::Sub, 0, 1)),
                RowStep::Point(Step::Unary(crate::ir::UnaryOp::Exp, 2)),
                RowStep::Reduce(ReduceOp::Sum, 3),
                RowStep::Point(Step::Binary(BinaryOp::Div, 3, 4)),
                RowStep::Softmax { log: false, arg: 0 },
            ],
            is_row: vec![true, false, true, true, false, true, true],
            outputs: vec![
                (5, DType::F32, vec![3, 40]),
                (6, DType::F32, vec![3, 40]),
                (4, DType::F32, vec![3, 1]),
            ],
            wide: false,
        };
        let out = k.run(&[x.array()]).unwrap();
        let (dec, sm) = (out[0].to_f64_vec(), out[1].to_f64_vec());
        let eager = x.softmax(-1).to_f64_vec();
        assert_eq!(sm, eager, "the softmax step is the eager kernel");
        for (a, b) in dec.iter().zip(&eager) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        let sums = out[2].to_f64_vec();
        let want = x
            .sub(x.max(&[-1], true))
            .exp()
            .sum(&[-1], true)
            .to_f64_vec();
        assert_eq!(sums, want, "the row sum is eager's");
    }
}
