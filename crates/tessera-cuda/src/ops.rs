//! The op dispatcher of the CUDA backend: each IR op to the generated
//! kernel (or cuBLASLt call) that computes it. Views never get here (the
//! core makes them, with the CPU's rule); creation ops whose values come
//! from the host generator (`rand`, `randn`, `arange`, `constant`) are made
//! by the CPU kernel and copied up, so both devices draw the same numbers.

use std::sync::Arc;

use tessera::error::{Error, ErrorKind, Result};
use tessera::ir::{DType, Op};
use tessera::runtime::cpu::fused::{FusedKernel, Step};
use tessera::runtime::cpu::rows::RowKernel;
use tessera::runtime::cpu::{self, arena, Storage};
use tessera::runtime::device::{Device, DeviceStorage};
use tessera::tensor::layout::contiguous_strides;
use tessera::tensor::{Layout, Tensor};

use crate::codegen::index::{self, Indexed, Strided};
use crate::codegen::pointwise::{self, Operand, Output};
use crate::codegen::Compute;
use crate::codegen::{fused_rows, rows};
use crate::matmul::{Epilogue, Mat};
use crate::{autotune, CudaBackend};

/// Builds a pointwise launch writing `outputs` with a block size (`None`:
/// the generator's default).
type MakeLaunch<'a> =
    dyn Fn(&[Output], Option<u32>) -> std::result::Result<crate::codegen::Launch, String> + 'a;

/// The memory of a storage that an output overwrites: the output keeps
/// the storage alive and counts no bytes of its own.
struct Over(Arc<DeviceStorage>);

impl tessera::runtime::device::DeviceMemory for Over {
    fn ptr(&self) -> u64 {
        self.0.ptr()
    }

    fn len(&self) -> usize {
        self.0.size_bytes()
    }
}

/// A device failure about `op`.
pub fn device_err(op: &str, message: impl Into<String>) -> Error {
    Error::op(ErrorKind::Device, op, message.into())
}

fn unsupported(op: &str, message: impl Into<String>) -> Error {
    Error::op(ErrorKind::Unsupported, op, message.into())
}

/// The device address of element 0 of `t`'s storage.
fn base(t: &Tensor) -> u64 {
    t.device_storage().map_or(0, |s| s.ptr())
}

/// The address of `t`'s first element (its layout's offset applied).
pub(crate) fn first(t: &Tensor) -> u64 {
    base(t) + (t.layout().offset * t.dtype().size_bytes()) as u64
}

impl CudaBackend {
    /// A new contiguous device tensor's storage: at its planned place in
    /// a compiled run's arena (see `tessera::runtime::cpu::arena`), else
    /// from the caching allocator.
    pub(crate) fn empty(&self, dtype: DType, numel: usize) -> Result<DeviceStorage> {
        let bytes = numel * dtype.size_bytes();
        if let Some(region) = arena::take_device(bytes) {
            return Ok(DeviceStorage::new(
                Device::Cuda,
                dtype,
                numel,
                Box::new(region),
            ));
        }
        let mem = self
            .gpu
            .alloc(bytes)
            .map_err(|m| Error::new(ErrorKind::Device, m))?;
        Ok(DeviceStorage::new(
            Device::Cuda,
            dtype,
            numel,
            Box::new(mem),
        ))
    }

    fn launch(&self, op: &str, launch: &crate::codegen::Launch) -> Result<()> {
        self.gpu.launch(launch).map_err(|m| device_err(op, m))
    }

    /// Under a `max-autotune` run (see `tessera::runtime::autotune`), the
    /// block choice among `candidates` for the kernel whose default launch
    /// is `default`: cached, or timed once on the device with `trial(c)`,
    /// a launch of candidate `c` that writes only what it may overwrite
    /// any number of times. `None` outside such runs.
    fn tuned_choice<C: Copy + ToString>(
        &self,
        op: &str,
        default: &crate::codegen::Launch,
        shape: &[usize],
        candidates: &[C],
        trial: impl Fn(C) -> std::result::Result<crate::codegen::Launch, String>,
    ) -> Result<Option<C>> {
        if !tessera::runtime::autotune::device_tuning() || candidates.len() < 2 {
            return Ok(None);
        }
        let key = autotune::key(&default.source, &format!("{shape:?}"), &self.gpu.name);
        let labels: Vec<String> = candidates.iter().map(ToString::to_string).collect();
        let what = format!(
            "{op} {shape:?} (block of {} threads by default)",
            default.block
        );
        let i = autotune::Tuner::global()
            .choose(&what, &key, &labels, |i| {
                let launch = trial(candidates[i])?;
                crate::gpu::time_on_stream(self.gpu.stream(), autotune::REPS, || {
                    self.gpu.launch(&launch)
                })
            })
            .map_err(|m| device_err(op, m))?;
        Ok(Some(candidates[i]))
    }

    /// A pointwise operand: a device tensor through its broadcast layout,
    /// or a host scalar as a constant.
    fn operand(&self, t: &Tensor, shape: &[usize]) -> Operand {
        match t.device() {
            Device::Cpu => Operand::Scalar(t.item()),
            Device::Cuda => Operand::Buffer {
                dtype: t.dtype(),
                ptr: base(t),
                layout: t.layout().expanded(shape),
            },
        }
    }

    /// Runs `steps` over `shape` on `inputs`, into new contiguous outputs.
    fn pointwise(
        &self,
        op: &str,
        steps: &[Step],
        inputs: &[&Tensor],
        outputs: &[(usize, DType)],
        shape: &[usize],
        compute: Compute,
    ) -> Result<Vec<Tensor>> {
        self.pointwise_into(op, steps, inputs, outputs, shape, compute, &[])
    }

    /// [`Self::pointwise`], output `o` written over input `i`'s storage for
    /// each `(i, o)` of `donated` that fits (see `Backend::run_fused_into`).
    /// Each thread reads its element of every input before it writes that
    /// element of the outputs, so an output may overwrite an input of its
    /// own shape and dense layout.
    #[allow(clippy::too_many_arguments)]
    fn pointwise_into(
        &self,
        op: &str,
        steps: &[Step],
        inputs: &[&Tensor],
        outputs: &[(usize, DType)],
        shape: &[usize],
        compute: Compute,
        donated: &[(usize, usize)],
    ) -> Result<Vec<Tensor>> {
        let numel: usize = shape.iter().product();
        let operands: Vec<Operand> = inputs.iter().map(|t| self.operand(t, shape)).collect();
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
                        let fits = x.dtype() == d
                            && x.shape() == shape
                            && x.is_contiguous()
                            && x.layout().offset == 0
                            && s.numel() == numel;
                        fits.then(|| {
                            DeviceStorage::new(Device::Cuda, d, numel, Box::new(Over(s.clone())))
                        })
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
                pointwise::pointwise_block(
                    steps,
                    &operands,
                    outs,
                    shape,
                    compute,
                    self.gpu.sms,
                    block,
                )
            };
            let default = make(&outs, None).map_err(|m| unsupported(op, m))?;
            let block = self.tune_pointwise(op, &default, shape, &outs, &make)?;
            let launch = match block {
                Some(b) => make(&outs, Some(b)).map_err(|m| unsupported(op, m))?,
                None => default,
            };
            self.launch(op, &launch)?;
        }
        Ok(storages
            .into_iter()
            .map(|s| Tensor::from_device_storage(s, shape))
            .collect())
    }

    /// The tuned block of a pointwise kernel (see [`Self::tuned_choice`]).
    /// The trials write scratch outputs: an output may overwrite an input,
    /// and running such a kernel twice would change the input.
    fn tune_pointwise(
        &self,
        op: &str,
        default: &crate::codegen::Launch,
        shape: &[usize],
        outs: &[Output],
        make: &MakeLaunch<'_>,
    ) -> Result<Option<u32>> {
        if !tessera::runtime::autotune::device_tuning() {
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

    /// Copies `x` (any layout, on the device) into `dst` written through
    /// `layout` (of `x`'s shape).
    fn copy_into(&self, op: &str, x: &Tensor, dst: u64, layout: Layout) -> Result<()> {
        if x.numel() == 0 {
            return Ok(());
        }
        let size = x.dtype().size_bytes();
        if x.is_contiguous() && layout.is_contiguous() {
            let src = first(x);
            let dst = dst + (layout.offset * size) as u64;
            return self
                .gpu
                .copy(dst, src, x.numel() * size)
                .map_err(|m| device_err(op, m));
        }
        let out = Output {
            step: 0,
            dtype: x.dtype(),
            ptr: dst,
            layout,
        };
        let launch = pointwise::pointwise(
            &[Step::Load(0)],
            &[self.operand(x, x.shape())],
            &[out],
            x.shape(),
            Compute::of(x.dtype()),
            self.gpu.sms,
        )
        .map_err(|m| unsupported(op, m))?;
        self.launch(op, &launch)
    }

    /// A contiguous copy of device tensor `x`.
    pub(crate) fn contiguous(&self, op: &str, x: &Tensor) -> Result<Tensor> {
        let s = self.empty(x.dtype(), x.numel())?;
        self.copy_into(op, x, s.ptr(), Layout::contiguous(x.shape()))?;
        Ok(Tensor::from_device_storage(s, x.shape()))
    }

    fn upload_tensor(&self, host: &Tensor) -> Result<Tensor> {
        let dense = cpu::copy::contiguous(host);
        let s = self.upload_storage(dense.storage())?;
        Ok(Tensor::from_device_storage(s, host.shape()))
    }

    pub(crate) fn upload_storage(&self, host: &Storage) -> Result<DeviceStorage> {
        let s = self.empty(host.dtype(), host.numel())?;
        let bytes = &host.as_bytes()[..host.numel() * host.dtype().size_bytes()];
        self.gpu
            .upload(s.ptr(), bytes)
            .map_err(|m| device_err("to_device", m))?;
        Ok(s)
    }

    pub(crate) fn download_storage(&self, s: &DeviceStorage) -> Result<Storage> {
        let mut host = Storage::try_new(s.dtype(), s.numel())?;
        let n = s.size_bytes();
        self.gpu
            .download(&mut host.as_bytes_mut()[..n], s.ptr())
            .map_err(|m| device_err("to_host", m))?;
        Ok(host)
    }

    /// The backend's `eval`: `op` (never a view) on device inputs.
    pub(crate) fn eval_op(
        &self,
        op: &Op,
        inputs: &[&Tensor],
        dtype: DType,
        shape: &[usize],
    ) -> Result<Tensor> {
        let name = op.name();
        let one = |steps: &[Step], compute: Compute| -> Result<Tensor> {
            Ok(self
                .pointwise(
                    name,
                    steps,
                    inputs,
                    &[(steps.len() - 1, dtype)],
                    shape,
                    compute,
                )?
                .remove(0))
        };
        match op {
            Op::Constant(_) | Op::Arange { .. } | Op::Rand { .. } | Op::Randn { .. } => {
                let host = cpu::eval(op, &[], dtype, shape)?;
                self.upload_tensor(&host)
            }
            Op::Full { value, .. } => one(&[Step::Const(value.as_f64())], Compute::of(dtype)),
            Op::Unary(u) => one(&[Step::Load(0), Step::Unary(*u, 0)], Compute::of(dtype)),
            Op::Cast(to) => one(&[Step::Load(0)], cast_compute(inputs[0].dtype(), *to)),
            Op::Binary(b) => one(&[Step::Load(0), Step::Load(1), Step::Binary(*b, 0, 1)], Compute::of(dtype)),
            Op::Compare(c) => one(
                &[Step::Load(0), Step::Load(1), Step::Compare(*c, 0, 1)],
                Compute::of(inputs[0].dtype()),
            ),
            Op::Where => one(
                &[Step::Load(0), Step::Load(1), Step::Load(2), Step::Where(0, 1, 2)],
                Compute::of(dtype),
            ),
            Op::Contiguous | Op::Reshape(_) => {
                let x = self.on_device(inputs[0])?;
                let c = self.contiguous(name, &x)?;
                Ok(c.view_of_shape(shape))
            }
            Op::Reduce { op: r, dims, .. } => {
                let x = self.on_device(inputs[0])?;
                let out = self.empty(dtype, shape.iter().product())?;
                let sms = self.gpu.sms;
                let parts = rows::parts_for(x.layout(), dims, sms);
                if parts == 1 {
                    let launch = rows::reduce(*r, x.dtype(), x.layout(), dims, dtype, base(&x), out.ptr(), sms);
                    self.launch(name, &launch)?;
                } else {
                    let n_out: usize = shape.iter().product();
                    // The partial results: the kernel's scratch.
                    let tmp = arena::scratch(|| self.empty(rows::accumulator(x.dtype()), n_out * parts))?;
                    let (first, second, _) = rows::reduce_in_parts(
                        *r, x.dtype(), x.layout(), dims, dtype, parts, base(&x), tmp.ptr(), out.ptr(), sms,
                    );
                    self.launch(name, &first)?;
                    self.launch(name, &second)?;
                }
                Ok(Tensor::from_device_storage(out, shape))
            }
            Op::ArgReduce { op: r, dim, .. } => {
                let x = self.on_device(inputs[0])?;
                let out = self.empty(DType::I64, shape.iter().product())?;
                if x.numel() > 0 {
                    let launch = rows::arg_reduce(*r, x.dtype(), x.layout(), *dim, base(&x), out.ptr(), self.gpu.sms);
                    self.launch(name, &launch)?;
                }
                Ok(Tensor::from_device_storage(out, shape))
            }
            Op::Softmax { dim } | Op::LogSoftmax { dim } => {
                let x = self.on_device(inputs[0])?;
                let out = self.empty(dtype, x.numel())?;
                if x.numel() > 0 {
                    let log = matches!(op, Op::LogSoftmax { .. });
                    let launch = self.softmax_launch(name, &x, *dim, log, out.ptr())?;
                    self.launch(name, &launch)?;
                }
                Ok(Tensor::from_device_storage(out, shape))
            }
            Op::MatMul => self.matmul(name, inputs[0], inputs[1], false, false, shape, None, Epilogue::None),
            Op::MatMulT { transpose_a, transpose_b } => self.matmul(
                name,
                inputs[0],
                inputs[1],
                *transpose_a,
                *transpose_b,
                shape,
                None,
                Epilogue::None,
            ),
            Op::Cat { dim } => {
                let out = self.empty(dtype, shape.iter().product())?;
                let full = Layout::contiguous(shape);
                let mut at = 0;
                for x in inputs {
                    let x = self.on_device(x)?;
                    let len = x.shape()[*dim];
                    let part = full.sliced(*dim, at, len, 1);
                    self.copy_into(name, &x, out.ptr(), part)?;
                    at += len;
                }
                Ok(Tensor::from_device_storage(out, shape))
            }
            Op::Tril { diagonal } | Op::Triu { diagonal } => {
                let x = self.on_device(inputs[0])?;
                let out = self.empty(dtype, x.numel())?;
                if x.numel() > 0 {
                    let l = x.layout();
                    let launch = index::triangle(
                        dtype,
                        &l.shape,
                        &l.strides,
                        l.offset,
                        *diagonal,
                        matches!(op, Op::Triu { .. }),
                        base(&x),
                        out.ptr(),
                        self.gpu.sms,
                    );
                    self.launch(name, &launch)?;
                }
                Ok(Tensor::from_device_storage(out, shape))
            }
            Op::IndexSelect { dim } | Op::Gather { dim } => self.read_indexed(op, inputs, *dim, dtype, shape),
            Op::IndexAdd { dim } | Op::ScatterAdd { dim } => self.add_indexed(op, inputs, *dim, dtype, shape),
            Op::Input | Op::Permute(_) | Op::Expand(_) | Op::Slice { .. } => Err(unsupported(
                name,
                "reached the CUDA kernels (inputs are bound and views are made by the caller)",
            )),
            // Custom ops run their own CUDA kernel slot (custom_op::CustomOp::set_kernel).
            Op::Custom(_) | Op::CustomOutput { .. } => Err(unsupported(
                name,
                "reached the built-in CUDA kernels; a custom op runs the kernel registered for `cuda`",
            )),
        }
    }

    /// The softmax launch: the generator's default, or under `max-autotune`
    /// the register-row plan with the tuned threads per row (the trials
    /// write `y`, which the launch overwrites anyway).
    fn softmax_launch(
        &self,
        op: &str,
        x: &Tensor,
        dim: usize,
        log: bool,
        y: u64,
    ) -> Result<crate::codegen::Launch> {
        let (dtype, layout, sms) = (x.dtype(), x.layout(), self.gpu.sms);
        let default = rows::softmax(dtype, layout, dim, log, base(x), y, sms);
        // Only a register-row softmax has a threads-per-row choice.
        if rows::row_plan(dtype, layout, dim, base(x), y, None).is_none() {
            return Ok(default);
        }
        let plan = |t| rows::row_plan(dtype, layout, dim, base(x), y, Some(t));
        let candidates: Vec<usize> = rows::THREAD_CANDIDATES
            .into_iter()
            .filter(|&t| plan(t).is_some())
            .collect();
        let rows_of =
            |t| plan(t).map(|p| rows::softmax_rows(p, dtype, layout, dim, log, base(x), y, sms));
        let chosen = self.tuned_choice(op, &default, &layout.shape, &candidates, |t| {
            rows_of(t).ok_or_else(|| format!("no row plan of {t} threads"))
        })?;
        Ok(chosen.and_then(rows_of).unwrap_or(default))
    }

    /// `x` on the device (a host scalar is copied up).
    fn on_device(&self, x: &Tensor) -> Result<Tensor> {
        match x.device() {
            Device::Cuda => Ok(x.clone()),
            Device::Cpu => self.upload_tensor(x),
        }
    }

    /// Runs a fused kernel of the fusion plan (outputs over the `donated`
    /// inputs' storages, see `Backend::run_fused_into`).
    pub(crate) fn fused(
        &self,
        kernel: &FusedKernel,
        inputs: &[&Tensor],
        donated: &[(usize, usize)],
    ) -> Result<Vec<Tensor>> {
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

    /// Runs a fused row kernel of the fusion plan as one generated kernel
    /// (see `codegen::fused_rows`), its outputs allocated in the kernel's
    /// output order (the memory plan's).
    pub(crate) fn rows(&self, kernel: &RowKernel, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let op = "fused_rows";
        let full = kernel.checked_shape(inputs)?;
        let operands: Vec<_> = inputs.iter().map(|t| self.operand(t, &full)).collect();
        let storages: Vec<(DeviceStorage, &Vec<usize>)> = kernel
            .outputs
            .iter()
            .map(|(_, dtype, shape)| Ok((self.empty(*dtype, shape.iter().product())?, shape)))
            .collect::<Result<_>>()?;
        if full.iter().product::<usize>() > 0 {
            let ptrs: Vec<u64> = storages.iter().map(|(s, _)| s.ptr()).collect();
            let make = |threads| {
                fused_rows::fused_rows_threads(kernel, &operands, &ptrs, self.gpu.sms, threads)
            };
            let default = make(None).map_err(|m| unsupported(op, m))?;
            // Under max-autotune, the threads a row; the trials write the
            // outputs, new buffers that no input shares. (Outside it no
            // candidate is generated: a run has hundreds of row kernels.)
            let chosen = match tessera::runtime::autotune::device_tuning() {
                true => {
                    let candidates: Vec<usize> = rows::THREAD_CANDIDATES
                        .into_iter()
                        .filter(|&t| make(Some(t)).is_ok())
                        .collect();
                    self.tuned_choice(op, &default, &full, &candidates, |t| make(Some(t)))?
                }
                false => None,
            };
            let launch = match chosen {
                Some(t) => make(Some(t)).map_err(|m| unsupported(op, m))?,
                None => default,
            };
            self.launch(op, &launch)?;
        }
        Ok(storages
            .into_iter()
            .map(|(s, shape)| Tensor::from_device_storage(s, shape))
            .collect())
    }

    /// `a·b` (either transposed) into a new tensor of `shape`, with an
    /// optional bias (a vector over the last dim) and activation.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul(
        &self,
        name: &str,
        a: &Tensor,
        b: &Tensor,
        ta: bool,
        tb: bool,
        shape: &[usize],
        bias: Option<&Tensor>,
        epilogue: Epilogue,
    ) -> Result<Tensor> {
        let dtype = a.dtype();
        let la = matrix_layout(a.layout(), ta, true);
        let lb = matrix_layout(b.layout(), tb, false);
        let (ra, rb) = (la.rank(), lb.rank());
        let (m, k, n) = (la.shape[ra - 2], la.shape[ra - 1], lb.shape[rb - 1]);
        let batch_shape = broadcast(&la.shape[..ra - 2], &lb.shape[..rb - 2]);
        let batch: usize = batch_shape.iter().product();
        if k == 0 && batch * m * n > 0 {
            // Zeros, allocated as the product would be (its planned place).
            let zero = self.eval_op(
                &Op::Full {
                    value: tessera::ir::Scalar::Float(0.0),
                    shape: tessera::ir::Shape::from_concrete(shape),
                    dtype,
                },
                &[],
                dtype,
                shape,
            )?;
            return Ok(zero);
        }
        let out = self.empty(dtype, batch * m * n)?;
        let result = Tensor::from_device_storage(out, shape);
        if batch * m * n == 0 {
            return Ok(result);
        }
        // Operands that cuBLASLt cannot read in place are copied
        // (contiguous): the kernel's scratch, after its output
        // (`matmul_scratch_bytes` says how much).
        let mut keep: Vec<Tensor> = Vec::new();
        let mut operand = |t: &Tensor, l: Layout, rows: usize, cols: usize| -> Result<Mat> {
            let full: Vec<usize> = batch_shape.iter().copied().chain([rows, cols]).collect();
            let e = l.expanded(&full);
            if let Some(mat) = as_mat(&e, base(t), dtype) {
                return Ok(mat);
            }
            let view = t.view_with_layout(e.clone());
            let c = arena::scratch(|| self.contiguous(name, &view))?;
            let mat = as_mat(c.layout(), base(&c), dtype).expect("a contiguous batch of matrices");
            keep.push(c);
            Ok(mat)
        };
        let mut ma = operand(a, la, m, k)?;
        let mb = operand(b, lb, k, n)?;
        let (mut batch_n, mut m_n) = (batch, m);
        // A shared right operand: fold the batch into the rows of A.
        if batch > 1
            && mb.batch_stride == 0
            && ma.col_stride == 1
            && ma.batch_stride == m * ma.row_stride
        {
            ma.rows = batch * m;
            m_n = batch * m;
            batch_n = 1;
        }
        let bias_ptr = bias.map(first);
        self.blas
            .gemm(
                &self.gpu,
                dtype,
                batch_n,
                ma,
                mb,
                base(&result),
                bias_ptr,
                epilogue,
            )
            .map_err(|msg| {
                device_err(
                    name,
                    format!("{msg} (a {:?}, b {:?}, m {m_n})", a.shape(), b.shape()),
                )
            })?;
        drop(keep);
        Ok(result)
    }

    /// index_select and gather.
    fn read_indexed(
        &self,
        op: &Op,
        inputs: &[&Tensor],
        dim: usize,
        dtype: DType,
        shape: &[usize],
    ) -> Result<Tensor> {
        let name = op.name();
        let x = self.on_device(inputs[0])?;
        let idx = self.on_device(inputs[1])?;
        check_indices(name, &idx, x.shape()[dim])?;
        let out = self.empty(dtype, shape.iter().product())?;
        let numel: usize = shape.iter().product();
        if numel > 0 {
            let mut xs = x.strides().to_vec();
            let dim_stride = std::mem::replace(&mut xs[dim], 0);
            let src = Strided {
                dtype,
                ptr: base(&x),
                offset: x.layout().offset,
                strides: xs,
            };
            let istrides = match op {
                Op::IndexSelect { .. } => one_hot_stride(shape.len(), dim, idx.strides()[0]),
                _ => idx.strides().to_vec(),
            };
            let index = Strided {
                dtype: idx.dtype(),
                ptr: base(&idx),
                offset: idx.layout().offset,
                strides: istrides,
            };
            let dst = Strided {
                dtype,
                ptr: out.ptr(),
                offset: 0,
                strides: contiguous_strides(shape),
            };
            let launch = index::indexed(
                Indexed::Read,
                shape,
                &src,
                &index,
                &dst,
                dim_stride,
                self.gpu.sms,
            )
            .map_err(|m| unsupported(name, m))?;
            self.launch(name, &launch)?;
        }
        Ok(Tensor::from_device_storage(out, shape))
    }

    /// index_add and scatter_add: a copy of the base, then atomic adds.
    fn add_indexed(
        &self,
        op: &Op,
        inputs: &[&Tensor],
        dim: usize,
        dtype: DType,
        shape: &[usize],
    ) -> Result<Tensor> {
        let name = op.name();
        let basis = self.on_device(inputs[0])?;
        let idx = self.on_device(inputs[1])?;
        let src = self.on_device(inputs[2])?;
        check_indices(name, &idx, shape[dim])?;
        let out = self.contiguous(name, &basis)?;
        let iter: Vec<usize> = match op {
            Op::IndexAdd { .. } => src.shape().to_vec(),
            _ => idx.shape().to_vec(),
        };
        if iter.iter().product::<usize>() > 0 {
            let mut ds = contiguous_strides(shape);
            let dim_stride = std::mem::replace(&mut ds[dim], 0);
            let istrides = match op {
                Op::IndexAdd { .. } => one_hot_stride(iter.len(), dim, idx.strides()[0]),
                _ => idx.strides().to_vec(),
            };
            let s = Strided {
                dtype,
                ptr: base(&src),
                offset: src.layout().offset,
                strides: src.strides().to_vec(),
            };
            let index = Strided {
                dtype: idx.dtype(),
                ptr: base(&idx),
                offset: idx.layout().offset,
                strides: istrides,
            };
            let dst = Strided {
                dtype,
                ptr: base(&out),
                offset: 0,
                strides: ds,
            };
            let launch = index::indexed(
                Indexed::Add,
                &iter,
                &s,
                &index,
                &dst,
                dim_stride,
                self.gpu.sms,
            )
            .map_err(|m| unsupported(name, m))?;
            self.launch(name, &launch)?;
        }
        Ok(out)
    }
}

/// Index values must be in `0..bound` (checked on the host, as the CPU
/// does: a kernel cannot report the error).
fn check_indices(op: &str, index: &Tensor, bound: usize) -> Result<()> {
    let host = index.to_host()?;
    let values: Vec<i64> = match host.dtype() {
        DType::I32 => host.to_vec::<i32>()?.into_iter().map(i64::from).collect(),
        DType::I64 => host.to_vec::<i64>()?,
        d => {
            return Err(Error::op(
                ErrorKind::DType,
                op,
                format!("indices must be i64 or i32, got {d}"),
            ))
        }
    };
    if let Some(bad) = values.iter().find(|&&v| v < 0 || v as usize >= bound) {
        return Err(Error::op(
            ErrorKind::Argument,
            op,
            format!("index {bad} is out of range for a dim of size {bound}"),
        ));
    }
    Ok(())
}

/// Strides over `rank` dims that are zero except `stride` at `dim`.
fn one_hot_stride(rank: usize, dim: usize, stride: usize) -> Vec<usize> {
    let mut s = vec![0; rank];
    s[dim] = stride;
    s
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

/// An operand's layout as a batch of matrices: the last two dims swapped
/// when transposed; a vector made a row (`a`) or a column (`b`).
fn matrix_layout(l: &Layout, transposed: bool, is_a: bool) -> Layout {
    let mut l = l.clone();
    if l.rank() == 1 {
        let (n, s) = (l.shape[0], l.strides[0]);
        l = if is_a {
            Layout {
                shape: vec![1, n],
                strides: vec![n * s.max(1), s],
                offset: l.offset,
            }
        } else {
            Layout {
                shape: vec![n, 1],
                strides: vec![s, 1],
                offset: l.offset,
            }
        };
    }
    if transposed {
        let r = l.rank();
        l.shape.swap(r - 2, r - 1);
        l.strides.swap(r - 2, r - 1);
    }
    l
}

/// NumPy broadcasting of two batch shapes (already checked by inference).
fn broadcast(a: &[usize], b: &[usize]) -> Vec<usize> {
    let r = a.len().max(b.len());
    (0..r)
        .map(|i| {
            let x = if i + a.len() >= r {
                a[i + a.len() - r]
            } else {
                1
            };
            let y = if i + b.len() >= r {
                b[i + b.len() - r]
            } else {
                1
            };
            x.max(y)
        })
        .collect()
}

/// A batch of matrices (`layout` = batch dims ++ [rows, cols]) as one
/// uniform batch stride, if its batch dims collapse to one.
fn as_mat(layout: &Layout, base: u64, dtype: DType) -> Option<Mat> {
    let r = layout.rank();
    let (rows, cols) = (layout.shape[r - 2], layout.shape[r - 1]);
    let mut batch_stride: Option<usize> = None;
    let mut expected: Option<usize> = None;
    for d in (0..r - 2).rev() {
        let (n, s) = (layout.shape[d], layout.strides[d]);
        if n == 1 {
            continue;
        }
        match expected {
            None => batch_stride = Some(s),
            Some(e) if e == s => {}
            Some(_) => return None,
        }
        expected = Some(s * n);
    }
    let mat = Mat {
        ptr: base + (layout.offset * dtype.size_bytes()) as u64,
        rows,
        cols,
        row_stride: layout.strides[r - 2],
        col_stride: layout.strides[r - 1],
        batch_stride: batch_stride.unwrap_or(0),
    };
    mat.direct().then_some(mat)
}

/// Bytes the kernel of `op` allocates inside `arena::scratch` on a GPU of
/// `sms` SMs (the backend's `Backend::scratch_bytes`; `inputs`: each
/// input's layout, dtype and storage element count): the partial results
/// of a reduction cut into parts, the contiguous copies of matmul operands
/// cuBLASLt cannot read in place. Softmax reads strided rows in place,
/// half-precision matmuls need no f32 copies, and cuBLASLt's workspace is
/// the backend's own (one per lane, for the process, outside the
/// allocator's accounting), so none of them is a kernel's scratch.
pub(crate) fn scratch_bytes(
    op: &Op,
    inputs: &[(&Layout, DType, usize)],
    out_shape: &[usize],
    sms: u32,
) -> usize {
    match op {
        Op::Reduce { dims, .. } => {
            let (layout, dtype, _) = inputs[0];
            match rows::parts_for(layout, dims, sms) {
                1 => 0,
                parts => {
                    let n_out: usize = out_shape.iter().product();
                    n_out * parts * rows::accumulator(dtype).size_bytes()
                }
            }
        }
        Op::MatMul => matmul_scratch_bytes(inputs, false, false),
        Op::MatMulT {
            transpose_a,
            transpose_b,
        } => matmul_scratch_bytes(inputs, *transpose_a, *transpose_b),
        _ => 0,
    }
}

/// The bytes of the operand copies `CudaBackend::matmul` makes for `a·b`
/// (either transposed): an operand whose matrices, broadcast over the
/// batch, `as_mat` cannot read is copied whole, the second copy placed at
/// the 64-byte boundary after the first (as `arena::scratch` places them).
fn matmul_scratch_bytes(inputs: &[(&Layout, DType, usize)], ta: bool, tb: bool) -> usize {
    let dtype = inputs[0].1;
    let la = matrix_layout(inputs[0].0, ta, true);
    let lb = matrix_layout(inputs[1].0, tb, false);
    let (ra, rb) = (la.rank(), lb.rank());
    let (m, k, n) = (la.shape[ra - 2], la.shape[ra - 1], lb.shape[rb - 1]);
    let batch_shape = broadcast(&la.shape[..ra - 2], &lb.shape[..rb - 2]);
    if k == 0 || batch_shape.iter().product::<usize>() * m * n == 0 {
        return 0;
    }
    let copy = |l: &Layout, rows: usize, cols: usize| -> usize {
        let full: Vec<usize> = batch_shape.iter().copied().chain([rows, cols]).collect();
        match as_mat(&l.expanded(&full), 0, dtype) {
            Some(_) => 0,
            None => full.iter().product::<usize>() * dtype.size_bytes(),
        }
    };
    match (copy(&la, m, k), copy(&lb, k, n)) {
        (0, one) | (one, 0) => one,
        (a, b) => a.div_ceil(64) * 64 + b,
    }
}

/// Shared-ownership helpers the dispatcher needs on tensors.
trait ViewExt {
    fn view_with_layout(&self, layout: Layout) -> Tensor;
    fn view_of_shape(&self, shape: &[usize]) -> Tensor;
}

impl ViewExt for Tensor {
    fn view_with_layout(&self, layout: Layout) -> Tensor {
        let s: Arc<DeviceStorage> = self.device_storage().expect("a device tensor").clone();
        Tensor::from_device_parts(s, layout)
    }

    /// A contiguous tensor seen with another shape of the same size.
    fn view_of_shape(&self, shape: &[usize]) -> Tensor {
        let mut l = Layout::contiguous(shape);
        l.offset = self.layout().offset;
        self.view_with_layout(l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_dims_collapse_to_one_stride_or_refuse() {
        // [2, 3, 4, 5] contiguous: batch stride 20 over 6 matrices.
        let l = Layout::contiguous(&[2, 3, 4, 5]);
        let m = as_mat(&l, 0, DType::F32).unwrap();
        assert_eq!((m.batch_stride, m.row_stride, m.col_stride), (20, 5, 1));
        // A permuted batch ([3, 2] of a [2, 3] batch) does not collapse.
        let p = l.permuted(&[1, 0, 2, 3]);
        assert!(as_mat(&p, 0, DType::F32).is_none());
        // A broadcast batch: stride 0.
        let e = Layout::contiguous(&[4, 5]).expanded(&[6, 4, 5]);
        assert_eq!(as_mat(&e, 0, DType::F32).unwrap().batch_stride, 0);
    }

    #[test]
    fn scratch_is_what_the_kernels_allocate_inside_arena_scratch() {
        let dense = |shape: &[usize]| Layout::contiguous(shape);
        let described = |l: &Layout, d: DType| (l.clone(), d, l.numel());
        let mm = |a: &Layout, b: &Layout, d: DType, op: &Op, out: &[usize]| {
            let (a, b) = (described(a, d), described(b, d));
            scratch_bytes(op, &[(&a.0, a.1, a.2), (&b.0, b.1, b.2)], out, 132)
        };
        // bf16 matmuls read their operands as they are: no f32 copies
        // (the CPU reserves (64·32 + 32·16 + 64·16)·4 bytes).
        let (a, b) = (dense(&[64, 32]), dense(&[32, 16]));
        assert_eq!(mm(&a, &b, DType::BF16, &Op::MatMul, &[64, 16]), 0);
        // A transposed operand is read transposed, not copied.
        let bt = dense(&[16, 32]).permuted(&[1, 0]);
        assert_eq!(mm(&a, &bt, DType::F32, &Op::MatMul, &[64, 16]), 0);
        // A batch that does not collapse to one stride is copied whole,
        // the second copy at the 64-byte boundary after the first.
        let ap = dense(&[3, 2, 5, 7]).permuted(&[1, 0, 2, 3]);
        let bp = dense(&[3, 2, 7, 1]).permuted(&[1, 0, 2, 3]);
        let op = Op::MatMul;
        assert_eq!(
            mm(&ap, &dense(&[2, 3, 7, 1]), DType::F32, &op, &[2, 3, 5, 1]),
            2 * 3 * 5 * 7 * 4
        );
        assert_eq!(
            mm(&ap, &bp, DType::F32, &op, &[2, 3, 5, 1]),
            (2 * 3 * 5 * 7 * 4usize).div_ceil(64) * 64 + 2 * 3 * 7 * 4
        );
        // A long reduction over few outputs is cut into parts: their
        // partial results (f32 for bf16 input) are the scratch.
        let x = dense(&[2, 1 << 20]);
        let reduce = Op::Reduce {
            op: tessera::ir::ReduceOp::Sum,
            dims: vec![1],
            keepdim: false,
        };
        let parts = rows::parts_for(&x, &[1], 132);
        assert!(parts > 1);
        let input = [(&x, DType::BF16, x.numel())];
        assert_eq!(scratch_bytes(&reduce, &input, &[2], 132), 2 * parts * 4);
        // A short one is one pass; softmax of strided rows reads in place.
        let short = dense(&[64, 128]);
        assert_eq!(
            scratch_bytes(&reduce, &[(&short, DType::F32, 64 * 128)], &[64], 132),
            0
        );
        let t = short.permuted(&[1, 0]);
        let softmax = Op::Softmax { dim: 1 };
        assert_eq!(
            scratch_bytes(&softmax, &[(&t, DType::F32, 64 * 128)], &[128, 64], 132),
            0
        );
    }

    #[test]
    fn casts_compute_wide_enough() {
        assert_eq!(cast_compute(DType::I64, DType::F32), Compute::F64);
        assert_eq!(cast_compute(DType::I64, DType::I32), Compute::I64);
        assert_eq!(cast_compute(DType::F32, DType::BF16), Compute::F32);
        assert_eq!(cast_compute(DType::F16, DType::F64), Compute::F64);
    }
}
