//! The fused pointwise kernel: a list of elementwise steps evaluated block
//! by block over the output, so intermediates live in a few cache-resident
//! blocks and never in memory. Only the kernel's inputs are read and its
//! outputs written.

use rayon::prelude::*;

use super::element::num_like::AccFloat;
use super::elementwise::{binary_into, unary_into, Transcendental};
use super::{Element, Storage};
use crate::error::{op_err, Result};
use crate::ir::{BinaryOp, CompareOp, DType, UnaryOp};
use crate::tensor::{Layout, Tensor};
use crate::with_dtype;

/// Elements per block: 16 KiB of f32 per register, so a dozen registers
/// stay in L2.
const BLOCK: usize = 4096;

/// One step; operands are indices of earlier steps.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// Kernel input `i`, broadcast to the kernel's shape.
    Load(usize),
    Const(f64),
    Unary(UnaryOp, usize),
    Binary(BinaryOp, usize, usize),
    /// 1.0 where the comparison holds, else 0.0.
    Compare(CompareOp, usize, usize),
    /// `a` where `cond != 0`, else `b`.
    Where(usize, usize, usize),
    /// A rounding to a narrower float dtype (the value stays in the block's type).
    Round(DType, usize),
}

/// A fused elementwise kernel over one output shape.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedKernel {
    pub shape: Vec<usize>,
    pub steps: Vec<Step>,
    /// The steps written to memory, with their dtypes.
    pub outputs: Vec<(usize, DType)>,
    /// Compute in f64 (any f64 value involved), else f32.
    pub wide: bool,
}

/// One input of a fused kernel.
pub enum FusedInput<'a> {
    /// A tensor the kernel reads (broadcast to the kernel's shape).
    Shared(&'a Tensor),
    /// The storage of an input that nobody else holds, dense over the
    /// kernel's shape, which output `output` (of the same dtype) overwrites.
    /// In place is safe here because every block loads all of its inputs
    /// before it stores its outputs, at the same element range, and blocks
    /// are disjoint.
    Donated { storage: Storage, output: usize },
}

impl FusedKernel {
    /// Runs the kernel; `inputs` as numbered by `Step::Load`.
    pub fn run(&self, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        self.run_with(inputs.iter().map(|&t| FusedInput::Shared(t)).collect())
    }

    /// Runs the kernel, writing donated inputs' outputs in place.
    pub fn run_with(&self, inputs: Vec<FusedInput<'_>>) -> Result<Vec<Tensor>> {
        let numel: usize = self.shape.iter().product();
        for (i, input) in inputs.iter().enumerate() {
            self.check_input(i, input, numel)?;
        }
        if self.wide {
            Ok(self.run_as::<f64>(inputs))
        } else {
            Ok(self.run_as::<f32>(inputs))
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

    fn run_as<A: Transcendental>(&self, inputs: Vec<FusedInput<'_>>) -> Vec<Tensor> {
        let numel: usize = self.shape.iter().product();
        let (sources, mut outs) = self.sources_and_outputs(inputs, numel);
        let sinks: Vec<Sink> = outs
            .iter_mut()
            .map(|s| Sink {
                ptr: s.as_bytes_mut().as_mut_ptr(),
                dtype: s.dtype(),
            })
            .collect();
        let blocks = numel.div_ceil(BLOCK);
        let run_blocks = |range: std::ops::Range<usize>| {
            let mut regs = vec![A::ZERO; self.steps.len() * BLOCK];
            // Constants are filled once per task, not once per block.
            for (i, step) in self.steps.iter().enumerate() {
                if let Step::Const(c) = *step {
                    regs[i * BLOCK..(i + 1) * BLOCK].fill(A::from_f64(c));
                }
            }
            for b in range {
                let start = b * BLOCK;
                let len = BLOCK.min(numel - start);
                self.eval_block(&sources, &sinks, &mut regs, start, len);
                for (&(step, _), sink) in self.outputs.iter().zip(&sinks) {
                    // SAFETY: each block writes its own disjoint range of every
                    // output, after it has loaded that range of every input.
                    unsafe { sink.store(start, &regs[step * BLOCK..step * BLOCK + len]) };
                }
            }
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
            .map(|s| Tensor::from_storage(s, &self.shape))
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

    fn eval_block<A: Transcendental>(
        &self,
        sources: &[Source<'_>],
        sinks: &[Sink],
        regs: &mut [A],
        start: usize,
        len: usize,
    ) {
        for (i, step) in self.steps.iter().enumerate() {
            let (before, after) = regs.split_at_mut(i * BLOCK);
            let dst = &mut after[..len];
            let reg = |j: usize| &before[j * BLOCK..j * BLOCK + len];
            match *step {
                Step::Load(k) => match &sources[k] {
                    Source::Shared(t, layout) => load(t, layout, start, dst),
                    // SAFETY: this task owns `start..start+len` of the sink,
                    // which it stores only after every load of the block.
                    Source::Output(o) => unsafe { sinks[*o].load(start, dst) },
                },
                Step::Const(_) => {}
                Step::Unary(op, a) => unary_into(op, reg(a), dst),
                Step::Binary(op, a, b) => binary_into(op, reg(a), reg(b), dst),
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

fn compare_block<A: AccFloat>(op: CompareOp, a: &[A], b: &[A], dst: &mut [A]) {
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
fn round_block<A: AccFloat>(dtype: DType, xs: &mut [A]) {
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
fn load<A: AccFloat>(t: &Tensor, layout: &Layout, start: usize, dst: &mut [A]) {
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
            for (k, d) in dst.iter_mut().enumerate() {
                *d = A::from_f64(Element::to_f64(src[layout.offset_of(start + k)]));
            }
        }
    })
}

/// Where a `Step::Load` reads: a shared tensor through its broadcast
/// layout, or the buffer of output `o` (a donated input, read in place).
enum Source<'a> {
    Shared(&'a Tensor, Layout),
    Output(usize),
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

    /// # Safety
    /// `start..start+vals.len()` is in bounds and written by no other task.
    unsafe fn store<A: AccFloat>(&self, start: usize, vals: &[A]) {
        with_dtype!(self.dtype, T => {
            if same_repr::<T, A>() {
                let dst = std::slice::from_raw_parts_mut((self.ptr as *mut A).add(start), vals.len());
                dst.copy_from_slice(vals);
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
        };
        let out = k.run(&[&x, &w]).unwrap();
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
        let n = 3 * BLOCK + 17;
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
        };
        let want = k.run(&[&x, &w]).unwrap()[0].to_f64_vec();
        let storage = x.into_unique_storage().expect("x is not shared");
        let address = storage.as_bytes().as_ptr();
        let got = k
            .run_with(vec![
                FusedInput::Donated { storage, output: 0 },
                FusedInput::Shared(&w),
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
    fn a_donation_of_the_wrong_size_is_an_error() {
        let k = FusedKernel {
            shape: vec![4],
            steps: vec![Step::Load(0)],
            outputs: vec![(0, DType::F32)],
            wide: false,
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
