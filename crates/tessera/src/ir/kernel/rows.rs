//! The fused row kernel's description: reductions along the last dim with
//! their pointwise producers (prologue) and consumers (epilogue), as
//! [`RowStep`]s over `outer` rows of `len` elements (see
//! `runtime::cpu::rows` for the CPU's evaluation).
//!
//! Values are of two kinds: *row* values (`[outer.., len]`, `len` numbers
//! per row) and *scalar* values (`[outer.., 1]` or `[outer..]`, one number
//! per row). Pointwise steps broadcast scalars over rows.

use super::fused::Step;
use super::slots::{self, Hold};
use crate::error::{op_err, Result};
use crate::ir::{DType, ReduceOp};

/// The longest row a row kernel takes: the CPU folds a row of up to this
/// many elements in one pass with the row's registers in L2, and the CUDA
/// generator keeps it in registers.
pub const MAX_ROW: usize = 1 << 14;

/// One step of a row kernel; operands are indices of earlier steps.
#[derive(Clone, Debug, PartialEq)]
pub enum RowStep {
    /// A pointwise step (`Step::Load(i)` loads kernel input `i`).
    Point(Step),
    /// A row value reduced to one scalar per row.
    Reduce(ReduceOp, usize),
    /// softmax (or log_softmax) of a row value.
    Softmax { log: bool, arg: usize },
}

impl RowStep {
    /// The steps this one reads.
    pub fn operands(&self) -> Vec<usize> {
        match self {
            RowStep::Point(s) => s.operands(),
            RowStep::Reduce(_, a) | RowStep::Softmax { arg: a, .. } => vec![*a],
        }
    }
}

/// A row kernel over `rows` rows of `len` elements.
#[derive(Clone, Debug, PartialEq)]
pub struct RowKernel {
    /// The leading (outer) dims; the rows are their row-major positions.
    pub outer: Vec<usize>,
    pub len: usize,
    pub steps: Vec<RowStep>,
    /// Whether each step is a row value (else a scalar per row).
    pub is_row: Vec<bool>,
    /// The steps written to memory: (step, dtype, shape).
    pub outputs: Vec<(usize, DType, Vec<usize>)>,
    /// Compute in f64 (any f64 value involved), else f32.
    pub wide: bool,
}

impl RowKernel {
    /// The number of rows: the product of the outer dims.
    pub fn rows(&self) -> usize {
        self.outer.iter().product()
    }

    /// The number of inputs the kernel loads (one more than its highest
    /// `Load` index).
    pub fn input_count(&self) -> usize {
        self.steps
            .iter()
            .filter_map(|s| match s {
                RowStep::Point(Step::Load(k)) => Some(k + 1),
                _ => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// Whether the kernel keeps the rules its evaluation relies on, given
    /// `inputs` inputs: every step reads only earlier steps and loads an
    /// input that is given; reductions and constants are scalars, softmax
    /// a row, and both reduce a row; a row step reads a row (a unary step
    /// or a rounding its operand, a binary step one of its two); a scalar
    /// step reads only scalars; every output is a step, of `rows × len`
    /// elements for a row and `rows` for a scalar.
    pub fn check(&self, inputs: usize) -> Result<()> {
        let err = |i: usize, what: String| {
            Err(op_err!(
                Verify,
                "fused_rows",
                "step {i} ({:?}) {what}",
                self.steps[i]
            ))
        };
        if self.is_row.len() != self.steps.len() {
            return Err(op_err!(
                Verify,
                "fused_rows",
                "{} row flags for {} steps",
                self.is_row.len(),
                self.steps.len()
            ));
        }
        let row = |j: usize| self.is_row[j];
        for (i, step) in self.steps.iter().enumerate() {
            let operands = step.operands();
            if let Some(a) = operands.iter().find(|&&a| a >= i) {
                return err(i, format!("reads step {a}, which is not an earlier step"));
            }
            let fits = match step {
                RowStep::Point(Step::Load(k)) if *k >= inputs => {
                    return Err(op_err!(
                        Argument,
                        "fused_rows",
                        "step {i} loads input {k}, but the kernel was given {inputs} inputs"
                    ))
                }
                RowStep::Point(Step::Load(_)) => true,
                RowStep::Point(Step::Const(_)) => !row(i),
                RowStep::Reduce(_, a) => !row(i) && row(*a),
                RowStep::Softmax { arg, .. } => row(i) && row(*arg),
                RowStep::Point(Step::Unary(_, a) | Step::Round(_, a)) => row(i) == row(*a),
                RowStep::Point(Step::Binary(_, a, b)) => {
                    if row(i) {
                        row(*a) || row(*b)
                    } else {
                        !row(*a) && !row(*b)
                    }
                }
                RowStep::Point(Step::Compare(..) | Step::Where(..)) => {
                    row(i) || operands.iter().all(|&a| !row(a))
                }
            };
            if !fits {
                let kinds: Vec<&str> = std::iter::once(i)
                    .chain(operands)
                    .map(|j| if row(j) { "row" } else { "scalar" })
                    .collect();
                return err(
                    i,
                    format!(
                        "is a {} of operands {:?}, which no row kernel computes",
                        kinds[0],
                        &kinds[1..]
                    ),
                );
            }
        }
        for (s, _, shape) in &self.outputs {
            let Some(&is_row) = self.is_row.get(*s) else {
                return Err(op_err!(
                    Verify,
                    "fused_rows",
                    "output step {s} of a kernel of {} steps",
                    self.steps.len()
                ));
            };
            let want = if is_row {
                self.rows() * self.len
            } else {
                self.rows()
            };
            if shape.iter().product::<usize>() != want {
                return Err(op_err!(
                    Verify,
                    "fused_rows",
                    "output step {s} has shape {shape:?}, not of the {want} elements of its {}",
                    if is_row { "rows" } else { "per-row scalars" }
                ));
            }
        }
        Ok(())
    }
}

impl RowKernel {
    /// The input gradient of softmax (`log`: log_softmax) along the last
    /// dim of `outer` rows of `len`, from its output `y` (input 0) and the
    /// output gradient `g` (input 1), both `dtype`, as one kernel: `y ·
    /// (g − Σ g·y)` (log: `g − exp(y) · Σ g`). What fusion makes of the
    /// decomposed rule; eager backward runs it as is, so no full-size
    /// temporary is made.
    pub fn softmax_backward(outer: Vec<usize>, len: usize, dtype: DType, log: bool) -> RowKernel {
        use crate::ir::{BinaryOp::*, UnaryOp::Exp};
        use RowStep::{Point, Reduce};
        let (steps, is_row) = match log {
            false => (
                vec![
                    Point(Step::Load(0)),
                    Point(Step::Load(1)),
                    Point(Step::Binary(Mul, 1, 0)),
                    Reduce(ReduceOp::Sum, 2),
                    Point(Step::Binary(Sub, 1, 3)),
                    Point(Step::Binary(Mul, 0, 4)),
                ],
                vec![true, true, true, false, true, true],
            ),
            true => (
                vec![
                    Point(Step::Load(0)),
                    Point(Step::Load(1)),
                    Reduce(ReduceOp::Sum, 1),
                    Point(Step::Unary(Exp, 0)),
                    Point(Step::Binary(Mul, 3, 2)),
                    Point(Step::Binary(Sub, 1, 4)),
                ],
                vec![true, true, false, true, true, true],
            ),
        };
        let mut shape = outer.clone();
        shape.push(len);
        RowKernel {
            outer,
            len,
            steps,
            is_row,
            outputs: vec![(5, dtype, shape)],
            wide: dtype == DType::F64,
        }
    }
}

/// The register slot of each row value (see [`super::slots`]), reused
/// once the value is dead; outputs keep theirs (they are stored after the
/// row). Scalars take no slot.
#[derive(Clone, Debug)]
pub struct RowRegisters {
    /// Each step's slot (0 for a scalar, which has none).
    pub slot: Vec<usize>,
    /// Whether the step has a slot (row values do).
    pub used: Vec<bool>,
    pub count: usize,
}

impl RowRegisters {
    pub fn allocate(k: &RowKernel) -> RowRegisters {
        let mut hold: Vec<Hold> = k
            .is_row
            .iter()
            .map(|&row| match row {
                true => Hold::UntilLastRead,
                false => Hold::Nothing,
            })
            .collect();
        for &(o, _, _) in &k.outputs {
            if k.is_row[o] {
                hold[o] = Hold::ToEnd;
            }
        }
        let slots = slots::allocate(|i| k.steps[i].operands(), &hold);
        RowRegisters {
            slot: slots.slot.iter().map(|s| s.unwrap_or(0)).collect(),
            used: slots.slot.iter().map(Option::is_some).collect(),
            count: slots.count,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{BinaryOp, UnaryOp};

    /// `y = x - max(x)` and `exp(y) / sum(exp(y))`, 3 rows of 40.
    fn softmax() -> RowKernel {
        RowKernel {
            outer: vec![3],
            len: 40,
            steps: vec![
                RowStep::Point(Step::Load(0)),
                RowStep::Reduce(ReduceOp::Max, 0),
                RowStep::Point(Step::Binary(BinaryOp::Sub, 0, 1)),
                RowStep::Point(Step::Unary(UnaryOp::Exp, 2)),
                RowStep::Reduce(ReduceOp::Sum, 3),
                RowStep::Point(Step::Binary(BinaryOp::Div, 3, 4)),
            ],
            is_row: vec![true, false, true, true, false, true],
            outputs: vec![(5, DType::F32, vec![3, 40]), (4, DType::F32, vec![3, 1])],
            wide: false,
        }
    }

    #[test]
    fn softmax_backward_kernels_keep_the_rules() {
        for log in [false, true] {
            let k = RowKernel::softmax_backward(vec![2, 3], 40, DType::F32, log);
            k.check(2).unwrap();
            assert_eq!((k.input_count(), k.rows(), k.wide), (2, 6, false));
            assert_eq!(k.outputs, [(5, DType::F32, vec![2, 3, 40])]);
        }
        assert!(RowKernel::softmax_backward(vec![1], 16, DType::F64, false).wide);
    }

    #[test]
    fn rows_inputs_and_operands() {
        let k = softmax();
        assert_eq!(k.rows(), 3);
        assert_eq!(k.input_count(), 1);
        assert_eq!(k.steps[5].operands(), [3, 4]);
        assert_eq!(RowStep::Softmax { log: true, arg: 2 }.operands(), [2]);
        assert_eq!(RowStep::Reduce(ReduceOp::Sum, 1).operands(), [1]);
        let scalar = RowKernel {
            outer: vec![],
            ..softmax()
        };
        assert_eq!(scalar.rows(), 1, "no outer dims: one row");
    }

    #[test]
    fn row_registers_hold_row_values_and_keep_row_outputs() {
        let k = softmax();
        let r = RowRegisters::allocate(&k);
        assert_eq!(r.used, k.is_row, "scalars take no slot");
        // x, x - max, exp: x's slot goes to exp once the sub read it; the
        // division (an output) takes the sub's.
        assert_eq!(r.slot[3], r.slot[0], "{r:?}");
        assert_eq!(r.slot[5], r.slot[2], "{r:?}");
        assert_eq!(r.count, 2);
        // A step after the division takes the exp's slot, unless the exp
        // is an output: then it keeps its slot and the step needs a third.
        let mut k = softmax();
        k.steps.push(RowStep::Point(Step::Unary(UnaryOp::Neg, 5)));
        k.is_row.push(true);
        let r = RowRegisters::allocate(&k);
        assert_eq!((r.slot[6], r.count), (r.slot[3], 2), "{r:?}");
        k.outputs.push((3, DType::F32, vec![3, 40]));
        let r = RowRegisters::allocate(&k);
        assert_eq!(r.count, 3, "{r:?}");
        assert!(
            (4..7).all(|i| r.slot[i] != r.slot[3] || !r.used[i]),
            "{r:?}"
        );
    }

    #[test]
    fn a_well_formed_kernel_passes_and_each_broken_rule_is_named() {
        let k = softmax();
        assert!(k.check(1).is_ok());
        let e = k.check(0).unwrap_err();
        assert!(e.message.contains("step 0 loads input 0"), "{e}");
        let broken = |f: &dyn Fn(&mut RowKernel)| {
            let mut k = softmax();
            f(&mut k);
            k.check(1).unwrap_err().message
        };
        let m = broken(&|k| {
            k.is_row.pop();
        });
        assert!(m.contains("5 row flags for 6 steps"), "{m}");
        let m = broken(&|k| k.steps[2] = RowStep::Point(Step::Binary(BinaryOp::Sub, 0, 3)));
        assert!(
            m.contains("reads step 3, which is not an earlier step"),
            "{m}"
        );
        // A reduction kept as a row, a reduction of a scalar, a softmax of
        // a scalar, a row exp of a scalar, a scalar of a row.
        let m = broken(&|k| k.is_row[1] = true);
        assert!(m.contains("step 1"), "{m}");
        let m = broken(&|k| k.steps[4] = RowStep::Reduce(ReduceOp::Sum, 1));
        assert!(m.contains("step 4") && m.contains("[\"scalar\"]"), "{m}");
        let m = broken(&|k| k.steps[3] = RowStep::Softmax { log: false, arg: 1 });
        assert!(m.contains("step 3"), "{m}");
        let m = broken(&|k| k.steps[3] = RowStep::Point(Step::Unary(UnaryOp::Exp, 1)));
        assert!(m.contains("is a row of operands [\"scalar\"]"), "{m}");
        let m = broken(&|k| k.is_row[5] = false);
        assert!(
            m.contains("is a scalar of operands [\"row\", \"scalar\"]"),
            "{m}"
        );
        let m = broken(&|k| k.outputs[1].0 = 6);
        assert!(m.contains("output step 6 of a kernel of 6 steps"), "{m}");
        let m = broken(&|k| k.outputs[0].2 = vec![3, 1]);
        assert!(m.contains("not of the 120 elements of its rows"), "{m}");
        // A constant is a scalar; a compare of a row and a scalar is a row.
        let m = broken(&|k| {
            k.steps.push(RowStep::Point(Step::Const(1.0)));
            k.is_row.push(true);
        });
        assert!(m.contains("step 6"), "{m}");
        let mut compare = softmax();
        compare.steps.push(RowStep::Point(Step::Compare(
            crate::ir::CompareOp::Gt,
            0,
            1,
        )));
        compare.is_row.push(true);
        assert!(compare.check(1).is_ok());
    }
}
