//! Reductions, arg-reductions, softmax and the fusion plan's row kernels:
//! the generated row kernels of `codegen::rows` and `codegen::fused_rows`.

use tessera::error::Result;
use tessera::ir::kernel::RowKernel;
use tessera::ir::{ArgReduceOp, DType, ReduceOp};
use tessera::runtime::array::Array;
use tessera::runtime::cpu::arena;
use tessera::runtime::device::DeviceStorage;
use tessera::tensor::Layout;

use super::memo_key::{buffer_addresses, operands_at, Generator, Key};
use super::{base, device_err, unsupported};
use crate::codegen::pointwise::Operand;
use crate::codegen::{fused_rows, rows, softmax};
use crate::CudaBackend;

impl CudaBackend {
    /// `r` over `dims` of `x` into a new tensor of `shape`: one pass, or
    /// (a long reduction over few outputs) partial results in scratch, then
    /// their reduction.
    pub(super) fn reduce(
        &self,
        name: &str,
        r: ReduceOp,
        dims: &[usize],
        x: &Array,
        dtype: DType,
        shape: &[usize],
    ) -> Result<Array> {
        let x = self.on_device(x)?;
        let out = self.empty(dtype, shape.iter().product())?;
        let sms = self.gpu.sms;
        let parts = rows::parts_for(x.layout(), dims, sms);
        if parts == 1 {
            let mut key = Key::new(Generator::Reduce, sms);
            key.word(r as u64)
                .dtype(x.dtype())
                .layout(x.layout())
                .dims(dims)
                .dtype(dtype);
            let generate = |p: &[u64]| {
                Ok(rows::reduce(
                    r,
                    x.dtype(),
                    x.layout(),
                    dims,
                    dtype,
                    p[0],
                    p[1],
                    sms,
                ))
            };
            self.gpu
                .launch_memoised(key.into_words(), &[base(&x), out.ptr()], generate)
                .map_err(|m| device_err(name, m))?;
        } else {
            let n_out: usize = shape.iter().product();
            // The partial results: the kernel's scratch.
            let tmp = arena::scratch(|| self.empty(rows::accumulator(x.dtype()), n_out * parts))?;
            let (xd, layout) = (x.dtype(), x.layout());
            let parted = |p: &[u64]| {
                rows::reduce_in_parts(r, xd, layout, dims, dtype, parts, p[0], p[1], p[2], sms)
            };
            let ptrs = [base(&x), tmp.ptr(), out.ptr()];
            for (which, generator) in [(0, Generator::ReduceParts), (1, Generator::PartsReduced)] {
                let mut key = Key::new(generator, sms);
                key.word(r as u64)
                    .dtype(xd)
                    .layout(layout)
                    .dims(dims)
                    .dtype(dtype)
                    .word(parts as u64);
                let generate = |p: &[u64]| {
                    let (first, second, _) = parted(p);
                    Ok(if which == 0 { first } else { second })
                };
                self.gpu
                    .launch_memoised(key.into_words(), &ptrs, generate)
                    .map_err(|m| device_err(name, m))?;
            }
        }
        Ok(Array::from_device_storage(out, shape))
    }

    /// The index of `r` along `dim` of `x` (i64) into a new tensor of `shape`.
    pub(super) fn arg_reduce(
        &self,
        name: &str,
        r: ArgReduceOp,
        dim: usize,
        x: &Array,
        shape: &[usize],
    ) -> Result<Array> {
        let x = self.on_device(x)?;
        let out = self.empty(DType::I64, shape.iter().product())?;
        if x.numel() > 0 {
            let launch = rows::arg_reduce(
                r,
                x.dtype(),
                x.layout(),
                dim,
                base(&x),
                out.ptr(),
                self.gpu.sms,
            );
            self.launch(name, &launch)?;
        }
        Ok(Array::from_device_storage(out, shape))
    }

    /// (Log-)softmax of `x` along `dim` into a new contiguous tensor.
    pub(super) fn softmax(
        &self,
        name: &str,
        x: &Array,
        dim: usize,
        log: bool,
        dtype: DType,
        shape: &[usize],
    ) -> Result<Array> {
        let x = self.on_device(x)?;
        let out = self.empty(dtype, x.numel())?;
        if x.numel() > 0 {
            let launch = self.softmax_launch(name, &x, dim, log, out.ptr())?;
            self.launch(name, &launch)?;
        }
        Ok(Array::from_device_storage(out, shape))
    }

    /// The softmax launch: the generator's default, or under `max-autotune`
    /// the register-row plan with the tuned threads per row (the trials
    /// write `y`, which the launch overwrites anyway).
    pub(super) fn softmax_launch(
        &self,
        op: &str,
        x: &Array,
        dim: usize,
        log: bool,
        y: u64,
    ) -> Result<crate::codegen::Launch> {
        let (dtype, layout, sms) = (x.dtype(), x.layout(), self.gpu.sms);
        let default = softmax::softmax(dtype, layout, dim, log, base(x), y, sms);
        // Only a register-row softmax has a threads-per-row choice.
        if softmax::row_plan(dtype, layout, dim, base(x), y, None).is_none() {
            return Ok(default);
        }
        let plan = |t| softmax::row_plan(dtype, layout, dim, base(x), y, Some(t));
        let candidates: Vec<usize> = softmax::THREAD_CANDIDATES
            .into_iter()
            .filter(|&t| plan(t).is_some())
            .collect();
        let rows_of =
            |t| plan(t).map(|p| softmax::softmax_rows(p, dtype, layout, dim, log, base(x), y, sms));
        let chosen = self.tuned_choice(op, &default, &layout.shape, &candidates, |t| {
            rows_of(t).ok_or_else(|| format!("no row plan of {t} threads"))
        })?;
        Ok(chosen.and_then(rows_of).unwrap_or(default))
    }

    /// Runs a fused row kernel of the fusion plan as one generated kernel
    /// (see `codegen::fused_rows`), its outputs allocated in the kernel's
    /// output order (the memory plan's).
    pub(crate) fn rows(&self, kernel: &RowKernel, inputs: &[&Array]) -> Result<Vec<Array>> {
        let full = kernel.checked_shape(inputs)?;
        kernel.check(inputs.len())?;
        let operands: Vec<_> = inputs.iter().map(|t| self.operand(t, &full)).collect();
        let storages: Vec<(DeviceStorage, &Vec<usize>)> = kernel
            .outputs
            .iter()
            .map(|(_, dtype, shape)| Ok((self.empty(*dtype, shape.iter().product())?, shape)))
            .collect::<Result<_>>()?;
        if full.iter().product::<usize>() > 0 {
            let ptrs: Vec<u64> = storages.iter().map(|(s, _)| s.ptr()).collect();
            match tessera::runtime::device::tuning() {
                true => self.tuned_rows(kernel, &operands, &ptrs, &full)?,
                false => self.memoised_rows(kernel, &operands, &ptrs)?,
            }
        }
        Ok(storages
            .into_iter()
            .map(|(s, shape)| Array::from_device_storage(s, shape))
            .collect())
    }

    /// A row kernel's launch, memoised (`Gpu::launch_memoised`).
    fn memoised_rows(
        &self,
        kernel: &RowKernel,
        operands: &[Operand],
        outputs: &[u64],
    ) -> Result<()> {
        let mut key = Key::new(Generator::FusedRows, self.gpu.sms);
        key.row_kernel(kernel).operands(operands);
        let addresses: Vec<u64> = buffer_addresses(operands)
            .chain(outputs.iter().copied())
            .collect();
        let n_in = addresses.len() - outputs.len();
        let generate = |p: &[u64]| {
            let ins = operands_at(operands, &mut p[..n_in].iter().copied());
            fused_rows::fused_rows_threads(kernel, &ins, &p[n_in..], self.gpu.sms, None)
        };
        self.gpu
            .launch_memoised(key.into_words(), &addresses, generate)
            .map_err(|m| unsupported("fused_rows", m))
    }

    /// Under max-autotune, a row kernel with the tuned threads a row; the
    /// trials write the outputs, new buffers that no input shares. (Outside
    /// it no candidate is generated: a run has hundreds of row kernels.)
    fn tuned_rows(
        &self,
        kernel: &RowKernel,
        operands: &[Operand],
        outputs: &[u64],
        full: &[usize],
    ) -> Result<()> {
        let op = "fused_rows";
        let make = |threads| {
            fused_rows::fused_rows_threads(kernel, operands, outputs, self.gpu.sms, threads)
        };
        let default = make(None).map_err(|m| unsupported(op, m))?;
        let candidates: Vec<usize> = softmax::THREAD_CANDIDATES
            .into_iter()
            .filter(|&t| make(Some(t)).is_ok())
            .collect();
        let launch = match self.tuned_choice(op, &default, full, &candidates, |t| make(Some(t)))? {
            Some(t) => make(Some(t)).map_err(|m| unsupported(op, m))?,
            None => default,
        };
        self.launch(op, &launch)
    }
}

/// The bytes of the partial results a reduction over `dims` of `layout`
/// (elements of `dtype`) into `out_shape` keeps in scratch on `sms` SMs:
/// none in one pass.
pub(super) fn scratch_bytes(
    layout: &Layout,
    dtype: DType,
    dims: &[usize],
    out_shape: &[usize],
    sms: u32,
) -> usize {
    match rows::parts_for(layout, dims, sms) {
        1 => 0,
        parts => {
            let n_out: usize = out_shape.iter().product();
            n_out * parts * rows::accumulator(dtype).size_bytes()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_reduction_over_few_outputs_keeps_its_parts_in_scratch() {
        // 2 outputs of 2^20 elements each: cut into parts, whose partial
        // results (f32 for bf16, f64 for f64) are the scratch.
        let x = Layout::contiguous(&[2, 1 << 20]);
        let parts = rows::parts_for(&x, &[1], 132);
        assert!(parts > 1);
        assert_eq!(
            scratch_bytes(&x, DType::BF16, &[1], &[2], 132),
            2 * parts * 4
        );
        assert_eq!(
            scratch_bytes(&x, DType::F64, &[1], &[2], 132),
            2 * parts * rows::accumulator(DType::F64).size_bytes()
        );
        // Many short rows: one pass, nothing kept.
        let short = Layout::contiguous(&[4096, 128]);
        assert_eq!(scratch_bytes(&short, DType::F32, &[1], &[4096], 132), 0);
    }
}
