//! The CPU as a [`Backend`]: the host's kernels behind the same trait a
//! device implements, so that eager dispatch and the executor ask
//! `device::backend(device)` and never branch on the device.

use std::sync::Arc;

use super::fused::FusedInput;
use super::{autotune, matmul, BlockedProduct, DescribedProduct, MemoryStats};
use crate::error::Result;
use crate::ir::kernel::{FusedKernel, FusedRegisters, RowKernel, RowRegisters};
use crate::ir::{DType, Op};
use crate::runtime::array::Array;
use crate::runtime::device::{self, Backend, Device, FusedArg};

/// The host's kernels (`cpu::eval`, fused and row kernels) and its memory
/// pool's accounting.
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn eval(&self, op: &Op, inputs: &[&Array], dtype: DType, shape: &[usize]) -> Result<Array> {
        super::eval(op, inputs, dtype, shape)
    }

    /// Donated arrays give their storage to the kernel by value, which then
    /// writes its output over it; under [`device::tuning`] the block size
    /// is tuned on these inputs first (see [`autotune`]).
    fn run_fused(&self, kernel: &FusedKernel, inputs: Vec<FusedArg<'_>>) -> Result<Vec<Array>> {
        run_fused(kernel, None, inputs)
    }

    fn run_fused_in(
        &self,
        kernel: &FusedKernel,
        registers: &[FusedRegisters; 2],
        inputs: Vec<FusedArg<'_>>,
    ) -> Result<Vec<Array>> {
        run_fused(kernel, Some(registers), inputs)
    }

    /// The CPU runs every row kernel fusion makes.
    fn row_kernel_refusal(&self, _kernel: &RowKernel) -> Option<String> {
        None
    }

    fn run_rows(&self, kernel: &RowKernel, inputs: &[&Array]) -> Result<Vec<Array>> {
        kernel.run(inputs)
    }

    fn run_rows_in(
        &self,
        kernel: &RowKernel,
        registers: &RowRegisters,
        inputs: &[&Array],
    ) -> Result<Vec<Array>> {
        kernel.run_in(registers, inputs)
    }

    /// Thin f32 products are fed to the row kernel a block of rows at a
    /// time ([`BlockedProduct`]): attention's scores never reach memory.
    fn run_rows_fed(
        &self,
        kernel: &RowKernel,
        products: &[(&Op, [&Array; 2], &[usize])],
        row_args: &[Option<&Array>],
        fed: &[usize],
    ) -> Option<Result<Vec<Array>>> {
        if kernel.wide {
            return None;
        }
        let blocked: Vec<BlockedProduct<'_>> = products
            .iter()
            .map(|(op, [a, b], shape)| BlockedProduct::new(a, b, matmul::transposes(op), shape))
            .collect::<Option<_>>()?;
        if !matmul::alike(&blocked) {
            return None;
        }
        Some(kernel.run_fed(row_args, fed, |each| matmul::for_each_block(&blocked, each)))
    }

    fn feeds_products(&self, products: &[DescribedProduct<'_>]) -> bool {
        matmul::blocks_products(products)
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn memory_stats(&self) -> MemoryStats {
        super::memory_stats()
    }

    fn reset_peak(&self) {
        super::reset_peak()
    }

    fn host_memory_stats(&self) -> MemoryStats {
        super::host_memory_stats()
    }

    fn empty_cache(&self) {
        super::empty_cache()
    }

    /// Into the host pool: a copy of the whole storage, same layout.
    fn offload(&self, array: &Array) -> Result<Array> {
        let host = array.to_host()?;
        let storage = host.storage().try_copy(true)?;
        Ok(Array::from_parts(Arc::new(storage), array.layout().clone()))
    }

    /// Out of the host pool into ordinary storage.
    fn prefetch(&self, array: &Array) -> Result<Array> {
        let host = array.to_host()?;
        let storage = host.storage().try_copy(false)?;
        Ok(Array::from_parts(Arc::new(storage), array.layout().clone()))
    }

    fn runs_on_host_threads(&self) -> bool {
        true
    }
}

/// The one CPU backend.
pub(crate) fn cpu_backend() -> Arc<dyn Backend> {
    static CPU: std::sync::LazyLock<Arc<dyn Backend>> =
        std::sync::LazyLock::new(|| Arc::new(CpuBackend));
    CPU.clone()
}

/// [`Backend::run_fused`] on the CPU, with the kernel's `registers` when
/// the caller has them (a tuned kernel differs only in its block size:
/// the same registers).
fn run_fused(
    kernel: &FusedKernel,
    registers: Option<&[FusedRegisters; 2]>,
    inputs: Vec<FusedArg<'_>>,
) -> Result<Vec<Array>> {
    let tuned;
    let kernel = match device::tuning() {
        true => {
            let arrays: Vec<&Array> = inputs.iter().map(FusedArg::array).collect();
            tuned = autotune::tune(kernel, &arrays)?;
            &tuned
        }
        false => kernel,
    };
    let inputs = inputs
        .into_iter()
        .map(|arg| match arg {
            FusedArg::Shared(a) => FusedInput::Shared(a),
            FusedArg::Donated { array, output } => {
                let ty = array.ty();
                // The executor donates only arrays it holds alone.
                let storage = array.into_unique_storage().unwrap_or_else(|| {
                    panic!("internal error: a donated input ({ty}) of a fused kernel is shared")
                });
                FusedInput::Donated { storage, output }
            }
        })
        .collect();
    kernel.run_in(registers, inputs)
}
