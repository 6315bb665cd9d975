//! The fused pointwise kernel's description: elementwise [`Step`]s over one
//! output shape, the steps written to memory, the compute type and the
//! block size the CPU evaluates it by (see `runtime::cpu::fused`).

use super::slots::{self, Hold};
use crate::error::{op_err, Result};
use crate::ir::{BinaryOp, CompareOp, DType, UnaryOp};

/// The bytes of live register slots a block should fit in: most of a
/// 32-48 KiB L1 data cache.
const L1_BYTES: usize = 24 << 10;
/// Block sizes (elements) the default choice stays within: below 256 the
/// per-step dispatch shows, above 4096 nothing is gained.
pub const MIN_BLOCK: usize = 256;
pub const MAX_BLOCK: usize = 4096;

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

impl Step {
    /// The steps this one reads.
    pub fn operands(&self) -> Vec<usize> {
        match *self {
            Step::Load(_) | Step::Const(_) => vec![],
            Step::Unary(_, a) | Step::Round(_, a) => vec![a],
            Step::Binary(_, a, b) | Step::Compare(_, a, b) => vec![a, b],
            Step::Where(c, a, b) => vec![c, a, b],
        }
    }
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
    /// Elements per block (a multiple of 64); see [`FusedKernel::default_block`].
    pub block: usize,
}

impl FusedKernel {
    /// A kernel with the default block size.
    pub fn new(
        shape: Vec<usize>,
        steps: Vec<Step>,
        outputs: Vec<(usize, DType)>,
        wide: bool,
    ) -> FusedKernel {
        let mut k = FusedKernel {
            shape,
            steps,
            outputs,
            wide,
            block: MIN_BLOCK,
        };
        k.block = k.default_block();
        k
    }

    /// The largest block (in [256, 4096], a multiple of 64) whose live
    /// register slots fit in `L1_BYTES` (24 KiB: most of an L1 data cache).
    pub fn default_block(&self) -> usize {
        let slots = FusedRegisters::allocate(&self.steps, &self.outputs, false)
            .count
            .max(1);
        let width = if self.wide { 8 } else { 4 };
        (L1_BYTES / (slots * width) / 64 * 64).clamp(MIN_BLOCK, MAX_BLOCK)
    }

    /// The number of inputs the kernel loads (one more than its highest
    /// `Load` index).
    pub fn input_count(&self) -> usize {
        self.steps
            .iter()
            .filter_map(|s| match s {
                Step::Load(k) => Some(k + 1),
                _ => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// Whether the kernel keeps the rules its evaluation relies on, given
    /// `inputs` inputs: it has a step, every step reads only earlier steps,
    /// loads an input that is given, and every output is a step.
    pub fn check(&self, inputs: usize) -> Result<()> {
        if self.steps.is_empty() {
            return Err(op_err!(Verify, "fused", "a fused kernel without steps"));
        }
        for (i, step) in self.steps.iter().enumerate() {
            if let Some(a) = step.operands().into_iter().find(|&a| a >= i) {
                return Err(op_err!(
                    Verify,
                    "fused",
                    "step {i} ({step:?}) reads step {a}, which is not an earlier step"
                ));
            }
            if let Step::Load(k) = step {
                if *k >= inputs {
                    return Err(op_err!(
                        Argument,
                        "fused",
                        "step {i} loads input {k}, but the kernel was given {inputs} inputs"
                    ));
                }
            }
        }
        if let Some(&(o, _)) = self.outputs.iter().find(|(o, _)| *o >= self.steps.len()) {
            return Err(op_err!(
                Verify,
                "fused",
                "output step {o} of a kernel of {} steps",
                self.steps.len()
            ));
        }
        Ok(())
    }
}

/// The register slot of each step (see [`super::slots`]): a slot is
/// reused once its value has been read for the last time. Constants read
/// as blocks or stored (filled once per task) and outputs (stored after
/// the block) keep theirs; outputs streamed while the next block runs have slots of
/// their own, which no step of that block writes before the output's own
/// step.
#[derive(Clone, Debug)]
pub struct FusedRegisters {
    /// Each step's slot (0 for a constant read only as a scalar, which
    /// never reads or writes its slot).
    pub slot: Vec<usize>,
    pub count: usize,
    /// The constants with a slot: their slots are filled once per task.
    pub filled: Vec<bool>,
}

/// The operands step `i` reads as blocks (a binary op's constant operand
/// is read as a scalar instead, see `eval_block` in `runtime::cpu::fused`).
fn block_operands(steps: &[Step], i: usize) -> Vec<usize> {
    let is_const = |j: usize| matches!(steps[j], Step::Const(_));
    match steps[i] {
        Step::Binary(_, a, b) => match (is_const(a), is_const(b)) {
            (_, true) => vec![a],
            (true, false) => vec![b],
            (false, false) => vec![a, b],
        },
        ref step => step.operands(),
    }
}

impl FusedRegisters {
    /// `own_outputs`: the outputs' slots are reserved for them (see above).
    pub fn allocate(
        steps: &[Step],
        outputs: &[(usize, DType)],
        own_outputs: bool,
    ) -> FusedRegisters {
        let n = steps.len();
        let mut output = vec![false; n];
        for &(o, _) in outputs {
            output[o] = true;
        }
        // Constants read as blocks somewhere, or stored, get a slot filled
        // once; the others are scalars of the steps that read them.
        let mut filled = output.clone();
        for i in 0..n {
            for a in block_operands(steps, i) {
                filled[a] = true;
            }
        }
        let hold: Vec<Hold> = (0..n)
            .map(|i| match (&steps[i], output[i]) {
                (Step::Const(_), _) if filled[i] => Hold::Own,
                (Step::Const(_), _) => Hold::Nothing,
                (_, true) if own_outputs => Hold::Own,
                (_, true) => Hold::ToEnd,
                (_, false) => Hold::UntilLastRead,
            })
            .collect();
        let slots = slots::allocate(|i| steps[i].operands(), &hold);
        for (i, step) in steps.iter().enumerate() {
            filled[i] &= matches!(step, Step::Const(_));
        }
        FusedRegisters {
            slot: slots.slot.iter().map(|s| s.unwrap_or(0)).collect(),
            count: slots.count,
            filled,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `relu(x * 2) + y`.
    fn small() -> FusedKernel {
        FusedKernel::new(
            vec![1000],
            vec![
                Step::Load(0),
                Step::Const(2.0),
                Step::Binary(BinaryOp::Mul, 0, 1),
                Step::Unary(UnaryOp::Relu, 2),
                Step::Load(1),
                Step::Binary(BinaryOp::Add, 3, 4),
            ],
            vec![(5, DType::F32)],
            false,
        )
    }

    #[test]
    fn operands_are_the_steps_read() {
        assert!(Step::Load(3).operands().is_empty());
        assert!(Step::Const(1.0).operands().is_empty());
        assert_eq!(Step::Round(DType::BF16, 4).operands(), [4]);
        assert_eq!(Step::Compare(CompareOp::Lt, 1, 2).operands(), [1, 2]);
        assert_eq!(Step::Where(0, 1, 2).operands(), [0, 1, 2]);
    }

    #[test]
    fn the_default_block_fills_l1_with_the_live_slots_within_bounds() {
        let k = small();
        let slots = FusedRegisters::allocate(&k.steps, &k.outputs, false).count;
        // A constant read by a binary op is a scalar: no slot; the add
        // takes its slot before its operands give theirs back.
        assert_eq!(slots, 3);
        assert_eq!(
            k.block,
            (L1_BYTES / (slots * 4)).clamp(MIN_BLOCK, MAX_BLOCK)
        );
        assert_eq!(k.block % 64, 0);
        let wide = FusedKernel::new(k.shape.clone(), k.steps.clone(), k.outputs.clone(), true);
        assert_eq!(wide.block, k.block / 2, "f64 values take twice the bytes");
        // Many live values: the smallest block.
        let mut steps: Vec<Step> = (0..64).map(Step::Load).collect();
        steps.extend(
            (0..63).map(|i| Step::Binary(BinaryOp::Add, if i == 0 { 0 } else { 63 + i }, i + 1)),
        );
        let many = FusedKernel::new(vec![10], steps, vec![(126, DType::F32)], false);
        assert_eq!(many.block, MIN_BLOCK);
        assert_eq!(many.input_count(), 64);
    }

    #[test]
    fn registers_fill_constants_once_and_keep_outputs() {
        // x; 0.5; x > 0.5 (reads the constant as a block); tanh(x) * 3 (3
        // a scalar); 7 (an output itself); where(...) an output read later.
        let steps = vec![
            Step::Load(0),
            Step::Const(0.5),
            Step::Compare(CompareOp::Gt, 0, 1),
            Step::Unary(UnaryOp::Tanh, 0),
            Step::Const(3.0),
            Step::Binary(BinaryOp::Mul, 3, 4),
            Step::Const(7.0),
            Step::Where(2, 5, 0),
            Step::Unary(UnaryOp::Exp, 7),
        ];
        let outputs = [(7, DType::F32), (6, DType::F32), (8, DType::F64)];
        for own in [false, true] {
            let r = FusedRegisters::allocate(&steps, &outputs, own);
            let filled: Vec<usize> = (0..steps.len()).filter(|&i| r.filled[i]).collect();
            assert_eq!(filled, [1, 6], "constants read as blocks or stored");
            // No other step ever writes a filled constant's slot, nor an
            // output's after it is computed.
            for (i, &s) in r.slot.iter().enumerate() {
                if matches!(steps[i], Step::Const(_)) {
                    continue;
                }
                assert!(s != r.slot[1] && s != r.slot[6], "step {i}: {r:?}");
                assert!(
                    i <= 7 || s != r.slot[7],
                    "step {i} overwrites output 7: {r:?}"
                );
            }
            assert!(r.count <= steps.len() && r.slot.iter().all(|&s| s < r.count));
            if own {
                // Streamed outputs: no step writes their slots at all.
                for (i, &s) in r.slot.iter().enumerate() {
                    for &(o, _) in &outputs {
                        assert!(
                            i == o || s != r.slot[o],
                            "step {i} shares output {o}'s slot: {r:?}"
                        );
                    }
                }
            }
        }
        // Without streaming, the where takes the tanh's slot (the mul read
        // it last) and the constant 3, a scalar of the mul, has none.
        let r = FusedRegisters::allocate(&steps, &outputs, false);
        assert_eq!(r.slot[7], r.slot[3], "{r:?}");
        assert!(!r.filled[4]);
    }

    #[test]
    fn check_names_the_broken_rule() {
        assert!(small().check(2).is_ok());
        let e = small().check(1).unwrap_err();
        assert!(e.message.contains("step 4 loads input 1"), "{e}");
        let mut forward = small();
        forward.steps[2] = Step::Binary(BinaryOp::Mul, 0, 3);
        let e = forward.check(2).unwrap_err();
        assert!(
            e.message
                .contains("reads step 3, which is not an earlier step"),
            "{e}"
        );
        let mut itself = small();
        itself.steps[3] = Step::Unary(UnaryOp::Relu, 3);
        assert!(itself.check(2).is_err());
        let mut output = small();
        output.outputs.push((6, DType::F32));
        let e = output.check(2).unwrap_err();
        assert!(
            e.message.contains("output step 6 of a kernel of 6 steps"),
            "{e}"
        );
        let empty = FusedKernel::new(vec![4], vec![], vec![], false);
        assert!(empty.check(0).is_err());
    }
}
