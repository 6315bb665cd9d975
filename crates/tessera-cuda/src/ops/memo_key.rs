//! Keys of memoised launches (`Gpu::launch_memoised`): every input of a
//! kernel generator but the device addresses written out as words, so
//! that two calls with equal keys generate the same launch up to those
//! addresses (which the memo patches in), and the addresses in order.

use tessera::ir::kernel::{RowKernel, RowStep, Step};
use tessera::tensor::Layout;
use tessera::DType;

use crate::codegen::pointwise::{Operand, Output};
use crate::codegen::Compute;

/// The words of a key, tagged with the generator they are for.
pub(super) struct Key(Vec<u64>);

/// Which generator a key is for (keys of different ones never meet).
#[derive(Clone, Copy)]
pub(super) enum Generator {
    Pointwise = 1,
    DenseCopy = 2,
    Reduce = 3,
    /// A reduction cut into parts: the parts' launch…
    ReduceParts = 4,
    /// … and the launch that reduces the parts' results.
    PartsReduced = 5,
    FusedRows = 6,
}

impl Key {
    pub(super) fn new(generator: Generator, sms: u32) -> Key {
        Key(vec![generator as u64, sms as u64])
    }

    pub(super) fn into_words(self) -> Vec<u64> {
        self.0
    }

    pub(super) fn word(&mut self, w: u64) -> &mut Self {
        self.0.push(w);
        self
    }

    pub(super) fn dims(&mut self, dims: &[usize]) -> &mut Self {
        self.0.push(dims.len() as u64);
        self.0.extend(dims.iter().map(|&d| d as u64));
        self
    }

    pub(super) fn dtype(&mut self, d: DType) -> &mut Self {
        self.word(d as u64)
    }

    pub(super) fn layout(&mut self, l: &Layout) -> &mut Self {
        self.dims(&l.shape).dims(&l.strides).word(l.offset as u64)
    }

    pub(super) fn compute(&mut self, c: Compute) -> &mut Self {
        self.word(c as u64)
    }

    pub(super) fn steps(&mut self, steps: &[Step]) -> &mut Self {
        self.word(steps.len() as u64);
        for step in steps {
            match *step {
                Step::Load(i) => self.word(0).word(i as u64),
                Step::Const(v) => self.word(1).word(v.to_bits()),
                Step::Unary(op, a) => self.word(2).word(op as u64).word(a as u64),
                Step::Binary(op, a, b) => {
                    self.word(3).word(op as u64).word(a as u64).word(b as u64)
                }
                Step::Compare(op, a, b) => {
                    self.word(4).word(op as u64).word(a as u64).word(b as u64)
                }
                Step::Where(c, a, b) => self.word(5).word(c as u64).word(a as u64).word(b as u64),
                Step::Round(d, a) => self.word(6).dtype(d).word(a as u64),
            };
        }
        self
    }

    /// A row kernel (its steps, rows and outputs).
    pub(super) fn row_kernel(&mut self, k: &RowKernel) -> &mut Self {
        self.dims(&k.outer).word(k.len as u64).word(k.wide as u64);
        self.word(k.steps.len() as u64);
        for step in &k.steps {
            match step {
                RowStep::Point(p) => self.word(0).steps(std::slice::from_ref(p)),
                RowStep::Reduce(op, a) => self.word(1).word(*op as u64).word(*a as u64),
                RowStep::Softmax { log, arg } => self.word(2).word(*log as u64).word(*arg as u64),
            };
        }
        self.word(k.is_row.len() as u64);
        for &r in &k.is_row {
            self.word(r as u64);
        }
        self.word(k.outputs.len() as u64);
        for (step, dtype, shape) in &k.outputs {
            self.word(*step as u64).dtype(*dtype).dims(shape);
        }
        self
    }

    /// The error-report sites a checked kernel passes (see
    /// `codegen::pointwise::ArithCheck`): argument words, not addresses.
    pub(super) fn sites(&mut self, sites: &[u32]) -> &mut Self {
        self.word(sites.len() as u64);
        for &s in sites {
            self.word(u64::from(s));
        }
        self
    }

    /// The operands without their addresses (see [`addresses`]).
    pub(super) fn operands(&mut self, operands: &[Operand]) -> &mut Self {
        self.word(operands.len() as u64);
        for o in operands {
            match o {
                Operand::Buffer { dtype, layout, .. } => self.word(0).dtype(*dtype).layout(layout),
                Operand::Scalar(v) => self.word(1).word(v.to_bits()),
            };
        }
        self
    }

    /// The outputs without their addresses (see [`addresses`]).
    pub(super) fn outputs(&mut self, outputs: &[Output]) -> &mut Self {
        self.word(outputs.len() as u64);
        for o in outputs {
            self.word(o.step as u64).dtype(o.dtype).layout(&o.layout);
        }
        self
    }
}

/// The device addresses of a pointwise launch: the buffer operands', then
/// the outputs'.
pub(super) fn addresses(operands: &[Operand], outputs: &[Output]) -> Vec<u64> {
    buffer_addresses(operands)
        .chain(outputs.iter().map(|o| o.ptr))
        .collect()
}

/// The addresses of the buffer operands, in order.
pub(super) fn buffer_addresses(operands: &[Operand]) -> impl Iterator<Item = u64> + '_ {
    operands.iter().filter_map(|o| match o {
        Operand::Buffer { ptr, .. } => Some(*ptr),
        Operand::Scalar(_) => None,
    })
}

/// `operands` and `outputs` with the addresses `ptrs` (as [`addresses`]
/// orders them) instead of theirs.
pub(super) fn with_addresses(
    operands: &[Operand],
    outputs: &[Output],
    ptrs: &[u64],
) -> (Vec<Operand>, Vec<Output>) {
    let mut next = ptrs.iter().copied();
    let operands = operands_at(operands, &mut next);
    let outputs = outputs
        .iter()
        .map(|o| Output {
            step: o.step,
            dtype: o.dtype,
            ptr: next.next().expect("an address per output"),
            layout: o.layout.clone(),
        })
        .collect();
    (operands, outputs)
}

/// `operands` with their buffers' addresses taken from `next` in order.
pub(super) fn operands_at(
    operands: &[Operand],
    next: &mut impl Iterator<Item = u64>,
) -> Vec<Operand> {
    operands
        .iter()
        .map(|o| match o {
            Operand::Buffer { dtype, layout, .. } => Operand::Buffer {
                dtype: *dtype,
                ptr: next.next().expect("an address per buffer"),
                layout: layout.clone(),
            },
            Operand::Scalar(v) => Operand::Scalar(*v),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(steps: &[Step], ptr: u64) -> Vec<u64> {
        let l = Layout::contiguous(&[4, 8]);
        let ops = [Operand::Buffer {
            dtype: DType::F32,
            ptr,
            layout: l.clone(),
        }];
        let out = [Output {
            step: steps.len() - 1,
            dtype: DType::F32,
            ptr: 64,
            layout: l,
        }];
        let mut k = Key::new(Generator::Pointwise, 132);
        k.steps(steps)
            .operands(&ops)
            .outputs(&out)
            .dims(&[4, 8])
            .compute(Compute::F32);
        k.into_words()
    }

    /// Everything a generator reads tells keys apart: the op, a constant,
    /// an operand's address.
    #[test]
    fn keys_differ_with_any_input_of_the_generator() {
        use tessera::ir::UnaryOp;
        let exp = [Step::Load(0), Step::Unary(UnaryOp::Exp, 0)];
        let log = [Step::Load(0), Step::Unary(UnaryOp::Log, 0)];
        assert_eq!(key(&exp, 0), key(&exp, 0));
        assert_ne!(key(&exp, 0), key(&log, 0));
        // Addresses are not in the key (the memo adds their low bits).
        assert_eq!(key(&exp, 0), key(&exp, 16));
        let c1 = [Step::Const(1.0)];
        let c2 = [Step::Const(2.0)];
        assert_ne!(key(&c1, 0), key(&c2, 0));
    }

    /// A checked kernel's sites are argument words the memo does not patch:
    /// two launches that report at different sites have different keys.
    #[test]
    fn keys_differ_with_the_sites_a_checked_kernel_reports_at() {
        let site = |sites: &[u32]| {
            let mut k = Key::new(Generator::Pointwise, 132);
            k.compute(Compute::I64).sites(sites);
            k.into_words()
        };
        assert_eq!(site(&[3]), site(&[3]));
        assert_ne!(site(&[3]), site(&[4]));
        assert_ne!(site(&[]), site(&[0]));
    }
}
