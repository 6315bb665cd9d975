//! Elementwise ops and the fusion plan's pointwise kernels: step lists run
//! by one generated kernel over a shape, outputs new or written over a
//! donated input.

use tessera::error::Result;
use tessera::ir::kernel::{FusedKernel, Step};
use tessera::ir::{DType, Op};
use tessera::runtime::array::Array;
use tessera::runtime::device::{Device, DeviceStorage};
use tessera::tensor::Layout;

use tessera::ir::BinaryOp;

use super::memo_key::{addresses, with_addresses, Generator, Key};
use super::{base, device_err, unsupported};
use crate::codegen::pointwise::{self, checked_steps, ArithCheck, Operand, Output};
use crate::codegen::Compute;
use crate::kernel_errors::{launched_at, Check, Site};
use crate::CudaBackend;

/// Builds a pointwise launch writing `outputs` with a block size (`None`:
/// the generator's default).
type MakeLaunch<'a> =
    dyn Fn(&[Output], Option<u32>) -> std::result::Result<crate::codegen::Launch, String> + 'a;

impl CudaBackend {
    /// An elementwise op (`full`, unary, cast, binary, compare, `where`)
    /// as one pointwise kernel.
    pub(super) fn elementwise(
        &self,
        op: &Op,
        inputs: &[&Array],
        dtype: DType,
        shape: &[usize],
    ) -> Result<Array> {
        let name = op.name();
        let (steps, compute) = elementwise_steps(op, inputs.first().map(|t| t.dtype()), dtype)
            .ok_or_else(|| unsupported(name, "is no elementwise op of the CUDA kernels"))?;
        let out = (steps.len() - 1, dtype);
        Ok(self
            .pointwise(name, &steps, inputs, &[out], shape, compute)?
            .remove(0))
    }

    /// A pointwise operand: a device tensor through its broadcast layout,
    /// or a host scalar as a constant.
    pub(super) fn operand(&self, t: &Array, shape: &[usize]) -> Operand {
        match t.device() {
            // A 0-dim host array: a scalar operand (checked by the caller).
            Device::Cpu => Operand::Scalar(t.to_f64_vec()[0]),
            Device::Cuda => Operand::Buffer {
                dtype: t.dtype(),
                ptr: base(t),
                layout: t.layout().expanded(shape),
            },
        }
    }

    /// Runs `steps` over `shape` on `inputs`, into new contiguous outputs.
    pub(super) fn pointwise(
        &self,
        op: &str,
        steps: &[Step],
        inputs: &[&Array],
        outputs: &[(usize, DType)],
        shape: &[usize],
        compute: Compute,
    ) -> Result<Vec<Array>> {
        self.pointwise_into(op, steps, inputs, outputs, shape, compute, &[])
    }

    /// [`Self::pointwise`], output `o` written over input `i`'s storage for
    /// each `(i, o)` of `donated` that fits (see `Backend::run_fused`).
    /// Each thread reads its element of every input before it writes that
    /// element of the outputs, so an output may overwrite an input of its
    /// own shape and dense layout.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn pointwise_into(
        &self,
        op: &str,
        steps: &[Step],
        inputs: &[&Array],
        outputs: &[(usize, DType)],
        shape: &[usize],
        compute: Compute,
        donated: &[(usize, usize)],
    ) -> Result<Vec<Array>> {
        let numel: usize = shape.iter().product();
        let operands: Vec<Operand> = inputs.iter().map(|t| self.operand(t, shape)).collect();
        let check = self.arith_check(op, steps, inputs, shape, compute);
        let storages: Vec<DeviceStorage> = outputs
            .iter()
            .enumerate()
            .map(|(o, &(_, d))| {
                let over = donated
                    .iter()
                    .find(|&&(_, out)| out == o)
                    .and_then(|&(i, _)| {
                        let x = inputs[i];
                        let s = x.device_storage()?;
                        let fits = donation_fits(x.layout(), x.dtype(), s.numel(), d, shape);
                        fits.then(|| DeviceStorage::over(s, d, numel))
                    });
                over.map_or_else(|| self.empty(d, numel), Ok)
            })
            .collect::<Result<_>>()?;
        let outs: Vec<Output> = outputs
            .iter()
            .zip(&storages)
            .map(|(&(step, dtype), s)| Output {
                step,
                dtype,
                ptr: s.ptr(),
                layout: Layout::contiguous(shape),
            })
            .collect();
        if numel > 0 {
            let make = |outs: &[Output], block| {
                pointwise::pointwise_checked(
                    steps,
                    &operands,
                    outs,
                    shape,
                    compute,
                    self.gpu.sms,
                    block,
                    &check,
                )
            };
            if tessera::runtime::device::tuning() {
                let default = make(&outs, None).map_err(|m| unsupported(op, m))?;
                let block = self.tune_pointwise(op, &default, shape, &outs, &make)?;
                let launch = match block {
                    Some(b) => make(&outs, Some(b)).map_err(|m| unsupported(op, m))?,
                    None => default,
                };
                self.launch(op, &launch)?;
            } else {
                let mut key = Key::new(Generator::Pointwise, self.gpu.sms);
                key.steps(steps)
                    .operands(&operands)
                    .outputs(&outs)
                    .dims(shape)
                    .compute(compute)
                    .sites(&check.sites);
                let ptrs = addresses(&operands, &outs);
                let generate = |p: &[u64]| {
                    let (ins, outs) = with_addresses(&operands, &outs, p);
                    pointwise::pointwise_checked(
                        steps,
                        &ins,
                        &outs,
                        shape,
                        compute,
                        self.gpu.sms,
                        None,
                        &check,
                    )
                };
                self.gpu
                    .launch_memoised(key.into_words(), &ptrs, generate)
                    .map_err(|m| unsupported(op, m))?;
            }
        }
        Ok(storages
            .into_iter()
            .map(|s| Array::from_device_storage(s, shape))
            .collect())
    }

    /// How the kernel of `steps` reports what its checked steps find (a
    /// zero divisor, a negative exponent): a site for each, noted now with
    /// its operands and the user's line, and the error record.
    fn arith_check(
        &self,
        op: &str,
        steps: &[Step],
        inputs: &[&Array],
        shape: &[usize],
        compute: Compute,
    ) -> ArithCheck {
        let checked = checked_steps(steps, compute);
        if checked.is_empty() {
            return ArithCheck::default();
        }
        let at = launched_at();
        let sites = checked
            .iter()
            .map(|&s| {
                self.gpu
                    .errors
                    .site(arith_site(op, steps, s, inputs, shape, &at))
            })
            .collect();
        ArithCheck {
            report: self.gpu.errors.device,
            sites,
        }
    }

    /// The tuned block of a pointwise kernel (see [`Self::tuned_choice`]).
    /// The trials write scratch outputs: an output may overwrite an input,
    /// and running such a kernel twice would change the input.
    pub(super) fn tune_pointwise(
        &self,
        op: &str,
        default: &crate::codegen::Launch,
        shape: &[usize],
        outs: &[Output],
        make: &MakeLaunch<'_>,
    ) -> Result<Option<u32>> {
        if !tessera::runtime::device::tuning() {
            return Ok(None);
        }
        let numel: usize = shape.iter().product();
        // From the allocator, never from a planned arena's places.
        let scratch: Vec<_> = outs
            .iter()
            .map(|o| self.gpu.alloc(numel * o.dtype.size_bytes()))
            .collect::<std::result::Result<_, String>>()
            .map_err(|m| device_err(op, m))?;
        let trial_outs: Vec<Output> = outs
            .iter()
            .zip(&scratch)
            .map(|(o, s)| Output {
                ptr: tessera::runtime::device::DeviceMemory::ptr(s),
                ..o.clone()
            })
            .collect();
        self.tuned_choice(op, default, shape, &pointwise::BLOCK_CANDIDATES, |b| {
            make(&trial_outs, Some(b))
        })
    }

    /// Runs a fused kernel of the fusion plan (outputs over the `donated`
    /// inputs' storages, see `Backend::run_fused`).
    pub(crate) fn fused(
        &self,
        kernel: &FusedKernel,
        inputs: &[&Array],
        donated: &[(usize, usize)],
    ) -> Result<Vec<Array>> {
        kernel.check(inputs.len())?;
        let compute = if kernel.wide {
            Compute::F64
        } else {
            Compute::F32
        };
        self.pointwise_into(
            "fused",
            &kernel.steps,
            inputs,
            &kernel.outputs,
            &kernel.shape,
            compute,
            donated,
        )
    }
}

/// The steps of an elementwise op whose first input (if any) has dtype
/// `input`, and the type they compute in; `None` for other ops.
fn elementwise_steps(op: &Op, input: Option<DType>, dtype: DType) -> Option<(Vec<Step>, Compute)> {
    let own = Compute::of(dtype);
    Some(match op {
        Op::Full { value, .. } => (vec![Step::Const(value.as_f64())], own),
        Op::Unary(u) => (vec![Step::Load(0), Step::Unary(*u, 0)], own),
        Op::Cast(to) => (vec![Step::Load(0)], cast_compute(input?, *to)),
        Op::Binary(b) => (
            vec![Step::Load(0), Step::Load(1), Step::Binary(*b, 0, 1)],
            own,
        ),
        Op::Compare(c) => (
            vec![Step::Load(0), Step::Load(1), Step::Compare(*c, 0, 1)],
            Compute::of(input?),
        ),
        Op::Where => (
            vec![
                Step::Load(0),
                Step::Load(1),
                Step::Load(2),
                Step::Where(0, 1, 2),
            ],
            own,
        ),
        _ => return None,
    })
}

/// What a report of checked step `s` (an integer div or pow) names: the
/// op, its operands' dtypes and shapes (an input the step loads; else the
/// kernel's shape) and `at`, the user's line.
fn arith_site(
    op: &str,
    steps: &[Step],
    s: usize,
    inputs: &[&Array],
    shape: &[usize],
    at: &str,
) -> Site {
    let Step::Binary(b, x, y) = steps[s] else {
        unreachable!("checked steps are binary")
    };
    let operand = |v: usize| match steps[v] {
        Step::Load(i) if i < inputs.len() => {
            format!("{} {:?}", inputs[i].dtype(), inputs[i].shape())
        }
        _ => format!("a value of {shape:?}"),
    };
    let (check, joint) = match b {
        BinaryOp::Div => (Check::DivisionByZero, "by"),
        _ => (Check::NegativePower, "to the power"),
    };
    let name = b.name();
    let within = if op == name {
        String::new()
    } else {
        format!(" in {op}")
    };
    Site {
        op: name.to_string(),
        check,
        context: format!(
            "{name} of {} {joint} {}{within}{at}",
            operand(x),
            operand(y)
        ),
    }
}

/// Whether output `o` may be written over input `x`'s storage (see
/// `Backend::run_fused`): `x` is of the output's dtype and `shape`,
/// dense from element 0 of a storage of exactly its elements, so each
/// thread reads its element of `x` before writing the same element.
fn donation_fits(
    x: &Layout,
    x_dtype: DType,
    storage_numel: usize,
    dtype: DType,
    shape: &[usize],
) -> bool {
    let numel: usize = shape.iter().product();
    x_dtype == dtype
        && x.shape == shape
        && x.is_contiguous()
        && x.offset == 0
        && storage_numel == numel
}

/// The compute type of a cast: wide enough for both ends.
fn cast_compute(from: DType, to: DType) -> Compute {
    let int = |d: DType| !d.is_float();
    if from == DType::F64 || to == DType::F64 || (int(from) && !int(to)) {
        Compute::F64
    } else if int(from) && int(to) {
        Compute::I64
    } else {
        Compute::F32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera::ir::{BinaryOp, CompareOp, Scalar, Shape, UnaryOp};

    #[test]
    fn casts_compute_wide_enough() {
        assert_eq!(cast_compute(DType::I64, DType::F32), Compute::F64);
        assert_eq!(cast_compute(DType::I64, DType::I32), Compute::I64);
        assert_eq!(cast_compute(DType::F32, DType::BF16), Compute::F32);
        assert_eq!(cast_compute(DType::F16, DType::F64), Compute::F64);
    }

    #[test]
    fn elementwise_ops_are_step_lists_ending_in_their_output() {
        let (steps, c) =
            elementwise_steps(&Op::Unary(UnaryOp::Exp), Some(DType::BF16), DType::BF16).unwrap();
        assert_eq!(steps, [Step::Load(0), Step::Unary(UnaryOp::Exp, 0)]);
        assert_eq!(c, Compute::of(DType::BF16));
        let (steps, _) =
            elementwise_steps(&Op::Binary(BinaryOp::Add), Some(DType::F32), DType::F32).unwrap();
        assert_eq!(steps.last(), Some(&Step::Binary(BinaryOp::Add, 0, 1)));
        // A comparison computes in its inputs' type, not in bool.
        let (_, c) =
            elementwise_steps(&Op::Compare(CompareOp::Lt), Some(DType::F64), DType::Bool).unwrap();
        assert_eq!(c, Compute::F64);
        // A cast in a type wide enough for both ends.
        let (steps, c) =
            elementwise_steps(&Op::Cast(DType::F32), Some(DType::I64), DType::F32).unwrap();
        assert_eq!((steps, c), (vec![Step::Load(0)], Compute::F64));
        let full = Op::Full {
            value: Scalar::Float(2.5),
            shape: Shape::from_concrete(&[3]),
            dtype: DType::F32,
        };
        assert_eq!(
            elementwise_steps(&full, None, DType::F32).unwrap().0,
            [Step::Const(2.5)]
        );
        let (steps, _) = elementwise_steps(&Op::Where, Some(DType::Bool), DType::F32).unwrap();
        assert_eq!(steps.last(), Some(&Step::Where(0, 1, 2)));
        // Not elementwise, or a cast with no input to read: none.
        assert!(elementwise_steps(&Op::MatMul, Some(DType::F32), DType::F32).is_none());
        assert!(elementwise_steps(&Op::Cast(DType::F32), None, DType::F32).is_none());
    }

    #[test]
    fn a_division_report_names_the_op_the_operands_and_the_line() {
        use tessera::runtime::cpu::Storage;
        let array = |dtype, shape: &[usize]| {
            let n = shape.iter().product();
            Array::from_storage(Storage::try_new(dtype, n).unwrap(), shape)
        };
        let (a, b) = (array(DType::I64, &[2, 3]), array(DType::I64, &[]));
        let steps = [
            Step::Load(0),
            Step::Load(1),
            Step::Binary(BinaryOp::Div, 0, 1),
            Step::Binary(BinaryOp::Pow, 2, 1),
        ];
        let site = arith_site("div", &steps, 2, &[&a, &b], &[2, 3], " at m.rs:4:2");
        assert_eq!(site.op, "div");
        assert_eq!(site.check, Check::DivisionByZero);
        assert_eq!(site.context, "div of i64 [2, 3] by i64 [] at m.rs:4:2");
        let site = arith_site("fused", &steps, 3, &[&a, &b], &[2, 3], " in a compiled run");
        assert_eq!(site.op, "pow");
        assert_eq!(site.check, Check::NegativePower);
        assert_eq!(
            site.context,
            "pow of a value of [2, 3] to the power i64 [] in fused in a compiled run"
        );
    }

    #[test]
    fn only_a_dense_input_of_the_outputs_type_and_shape_is_written_over() {
        let dense = Layout::contiguous(&[4, 3]);
        assert!(donation_fits(&dense, DType::F32, 12, DType::F32, &[4, 3]));
        // Another dtype, shape, a view into a larger storage, a permuted or
        // offset one: each thread could overwrite what another still reads.
        assert!(!donation_fits(&dense, DType::F32, 12, DType::F16, &[4, 3]));
        assert!(!donation_fits(&dense, DType::F32, 12, DType::F32, &[3, 4]));
        assert!(!donation_fits(&dense, DType::F32, 24, DType::F32, &[4, 3]));
        let permuted = Layout::contiguous(&[3, 4]).permuted(&[1, 0]);
        assert!(!donation_fits(
            &permuted,
            DType::F32,
            12,
            DType::F32,
            &[4, 3]
        ));
        let mut offset = dense.clone();
        offset.offset = 12;
        assert!(!donation_fits(&offset, DType::F32, 24, DType::F32, &[4, 3]));
        // A broadcast input is no place for an output.
        let expanded = Layout::contiguous(&[1, 3]).expanded(&[4, 3]);
        assert!(!donation_fits(
            &expanded,
            DType::F32,
            3,
            DType::F32,
            &[4, 3]
        ));
    }
}
