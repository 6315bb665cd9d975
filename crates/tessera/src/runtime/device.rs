//! Devices other than the host: the [`Backend`] trait a device implements,
//! the registry that maps a [`Device`] to its backend at run time, and
//! [`DeviceStorage`], the bytes of a tensor that lives on a device.
//!
//! The core crate knows no device API: a backend crate (`tessera-cuda`)
//! implements [`Backend`] and registers it with [`register`]. Arrays on a
//! device carry a [`DeviceStorage`]; an op whose inputs live on a device is
//! sent to that device's backend (see `Tensor::apply`), and a compiled
//! executable runs each kernel on its inputs' device. Backends take and
//! return [`Array`]s, never the user-facing `Tensor`.

use std::cell::Cell;
use std::fmt;
use std::sync::{Arc, RwLock};

use super::array::Array;
use super::cpu::fused::FusedKernel;
use super::cpu::rows::RowKernel;
use super::cpu::{MemoryStats, Storage};
use super::layout::Layout;
use crate::error::{Error, ErrorKind, Result};
use crate::ir::{DType, Op, TensorType};

/// Where a tensor's values are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory, CPU kernels.
    #[default]
    Cpu,
    /// The first CUDA GPU, through the backend `tessera-cuda` registers.
    Cuda,
}

impl Device {
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }

    /// `"cpu"` or `"cuda"` (`"cuda:0"` too: one GPU is supported).
    pub fn parse(name: &str) -> Result<Device> {
        match name {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "cuda:0" => Ok(Device::Cuda),
            other => Err(Error::new(
                ErrorKind::Argument,
                format!("unknown device `{other}`; expected `cpu` or `cuda`"),
            )),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A block of device memory. Dropping it gives the bytes back to the
/// backend's allocator (which keeps the accounting).
pub trait DeviceMemory: Send + Sync + std::panic::RefUnwindSafe + std::panic::UnwindSafe {
    /// The device address of the first byte.
    fn ptr(&self) -> u64;
    /// The bytes asked for (what the accounting counts).
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The bytes behind one or more device tensors (views share a storage).
pub struct DeviceStorage {
    device: Device,
    dtype: DType,
    numel: usize,
    memory: Box<dyn DeviceMemory>,
}

impl DeviceStorage {
    /// Storage for `numel` elements of `dtype` in `memory`. Panics when
    /// `memory` is too small for them or `numel` is past the size limit
    /// ([`crate::limits`]; a backend allocates for checked shapes only), so
    /// [`DeviceStorage::size_bytes`] never overflows and no kernel reads
    /// past the block.
    pub fn new(device: Device, dtype: DType, numel: usize, memory: Box<dyn DeviceMemory>) -> Self {
        let fits =
            numel <= crate::limits::MAX_ELEMENTS && memory.len() >= numel * dtype.size_bytes();
        assert!(
            fits,
            "internal error: {numel} elements of {dtype} in a device block of {} bytes",
            memory.len()
        );
        DeviceStorage {
            device,
            dtype,
            numel,
            memory,
        }
    }

    pub fn device(&self) -> Device {
        self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn numel(&self) -> usize {
        self.numel
    }

    /// The device address of element 0.
    pub fn ptr(&self) -> u64 {
        self.memory.ptr()
    }

    pub fn size_bytes(&self) -> usize {
        self.numel * self.dtype.size_bytes()
    }
}

/// What a device implements. Every method that takes arrays gets them on
/// this backend's device, except 0-dim host arrays, which stand for
/// scalars (as in PyTorch) and which the backend reads on the host.
pub trait Backend: Send + Sync {
    fn device(&self) -> Device;

    /// Storage for `numel` elements of `dtype` (contents undefined; kernels
    /// overwrite what they hand out). Out of memory is an error that names
    /// the bytes asked for and the bytes free.
    fn alloc(&self, dtype: DType, numel: usize) -> Result<DeviceStorage>;

    /// A copy of host storage on the device.
    fn upload(&self, host: &Storage) -> Result<DeviceStorage>;

    /// A copy of device storage on the host (waits for pending work).
    fn download(&self, storage: &DeviceStorage) -> Result<Storage>;

    /// Computes `op(inputs)` whose output has `dtype` and `shape` (inferred
    /// and checked). Views are handled by the caller: `op` is never a view
    /// here. An op the backend has no kernel for is an `Unsupported` error
    /// that names it.
    fn eval(&self, op: &Op, inputs: &[&Array], dtype: DType, shape: &[usize]) -> Result<Array>;

    /// Runs a fused elementwise kernel (see [`FusedKernel`]); `inputs` as
    /// numbered by its loads.
    fn run_fused(&self, kernel: &FusedKernel, inputs: &[&Array]) -> Result<Vec<Array>>;

    /// [`Backend::run_fused`], where each `(input, output)` of `donated`
    /// says that output `output` may be written over input `input`'s
    /// storage (a dense buffer of the output's shape and dtype that nothing
    /// else holds: the memory plan's in-place writes). The output then
    /// keeps that storage; it allocates nothing.
    fn run_fused_into(
        &self,
        kernel: &FusedKernel,
        inputs: &[&Array],
        donated: &[(usize, usize)],
    ) -> Result<Vec<Array>> {
        let _ = donated;
        self.run_fused(kernel, inputs)
    }

    /// Why this backend does not run `kernel` as one kernel, if it does not
    /// (the executor then runs the group's ops one by one through
    /// [`Backend::eval`], with intermediates the memory plan does not hold,
    /// and logs this reason under `fusion`).
    fn row_kernel_refusal(&self, kernel: &RowKernel) -> Option<String> {
        let _ = kernel;
        Some(format!(
            "the `{}` backend has no row kernels",
            self.device()
        ))
    }

    /// Runs a fused row kernel (see [`RowKernel`]) that
    /// [`Backend::row_kernel_refusal`] takes; `inputs` as numbered by its
    /// loads, each broadcastable to `outer ++ [len]`. Its outputs are
    /// allocated in `kernel.outputs` order (the memory plan's order).
    fn run_rows(&self, kernel: &RowKernel, inputs: &[&Array]) -> Result<Vec<Array>> {
        let _ = (kernel, inputs);
        Err(unsupported(self.device(), "row kernels"))
    }

    /// Bytes `op`'s kernel on this device allocates for its own use while
    /// it runs, besides its output, inside `cpu::arena::scratch` (`inputs`:
    /// each input's layout, dtype and storage element count): the scratch
    /// a memory plan made for this device reserves. The default is the CPU
    /// kernels' ([`super::cpu::scratch_bytes`]), right for a backend that
    /// runs them; a backend whose kernels allocate otherwise answers its own.
    fn scratch_bytes(
        &self,
        op: &Op,
        inputs: &[(&Layout, DType, usize)],
        out_shape: &[usize],
    ) -> usize {
        super::cpu::scratch_bytes(op, inputs, out_shape)
    }

    /// Waits for all work queued on the device.
    fn synchronize(&self) -> Result<()>;

    /// Bytes of tensor data alive on the device and the most alive at once
    /// since the last [`Backend::reset_peak`].
    fn memory_stats(&self) -> MemoryStats;

    fn reset_peak(&self);

    /// Gives cached free blocks back to the driver.
    fn empty_cache(&self);

    /// Queues a copy of `src`'s bytes into `dst` (same size) on the device.
    fn copy(&self, dst: &DeviceStorage, src: &DeviceStorage) -> Result<()> {
        let _ = (dst, src);
        Err(unsupported(self.device(), "device-to-device copies"))
    }

    /// How many streams (lanes) the kernels of one schedule step may be
    /// spread over; 1 runs everything in order on one stream.
    fn lanes(&self) -> usize {
        1
    }

    /// Starts a step on `lanes` lanes: each lane waits for the work queued
    /// so far. Lane 0 is the main stream. The executor then sends each
    /// kernel to a lane with [`Backend::lane`] and ends with
    /// [`Backend::join`].
    fn fork(&self, lanes: usize) -> Result<()> {
        let _ = lanes;
        Ok(())
    }

    /// The work queued from now on goes to lane `lane`.
    fn lane(&self, lane: usize) -> Result<()> {
        let _ = lane;
        Ok(())
    }

    /// Ends a step: the main stream waits for every lane, and work goes to
    /// it again. Memory freed during the step is reused only after this.
    fn join(&self) -> Result<()> {
        Ok(())
    }

    /// Starts recording the work queued from now on into a [`DeviceGraph`]
    /// instead of running it (CUDA stream capture).
    fn begin_capture(&self) -> Result<()> {
        Err(unsupported(self.device(), "graph capture"))
    }

    /// Ends the recording that [`Backend::begin_capture`] started; an error
    /// when something recorded cannot be captured (a host synchronisation,
    /// a copy to the host), which also ends the recording.
    fn end_capture(&self) -> Result<Box<dyn DeviceGraph>> {
        Err(unsupported(self.device(), "graph capture"))
    }
}

/// Recorded device work that can be queued again with the same buffers.
pub trait DeviceGraph: Send + Sync {
    /// Queues the recorded work once more.
    fn replay(&self) -> Result<()>;
}

fn unsupported(device: Device, what: &str) -> Error {
    Error::new(
        ErrorKind::Unsupported,
        format!("the `{device}` backend has no {what}"),
    )
}

static CUDA: RwLock<Option<Arc<dyn Backend>>> = RwLock::new(None);

/// Makes `backend` the one that runs tensors on `backend.device()`.
pub fn register(backend: Arc<dyn Backend>) -> Result<()> {
    match backend.device() {
        Device::Cpu => Err(Error::new(
            ErrorKind::Argument,
            "the CPU backend is built in; only devices can be registered",
        )),
        Device::Cuda => {
            *CUDA.write().expect("backend registry poisoned") = Some(backend);
            Ok(())
        }
    }
}

/// The backend registered for `device`; an error when none is (the CPU
/// has no `Backend` object: its kernels are called directly).
pub fn backend(device: Device) -> Result<Arc<dyn Backend>> {
    let slot = match device {
        Device::Cpu => None,
        Device::Cuda => CUDA.read().expect("backend registry poisoned").clone(),
    };
    slot.ok_or_else(|| {
        Error::new(
            ErrorKind::Unsupported,
            format!(
                "no backend is registered for device `{device}` \
                 (link tessera-cuda and call tessera_cuda::register())"
            ),
        )
    })
}

/// Whether a backend is registered for `device` (the CPU always is).
pub fn is_available(device: Device) -> bool {
    device == Device::Cpu || backend(device).is_ok()
}

/// Memory accounting of `device` (host pool for the CPU).
pub fn memory_stats(device: Device) -> Result<MemoryStats> {
    match device {
        Device::Cpu => Ok(super::cpu::memory_stats()),
        d => Ok(backend(d)?.memory_stats()),
    }
}

/// Starts a new peak measurement on `device`.
pub fn reset_peak(device: Device) -> Result<()> {
    match device {
        Device::Cpu => super::cpu::reset_peak(),
        d => backend(d)?.reset_peak(),
    }
    Ok(())
}

/// Waits for the work queued on `device` (nothing to wait for on the CPU).
pub fn synchronize(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        d => backend(d)?.synchronize(),
    }
}

thread_local! {
    static CURRENT: Cell<Device> = const { Cell::new(Device::Cpu) };
}

/// The device eager ops without tensor inputs (`zeros`, `full`, `randn` …)
/// create their results on, on this thread: the CPU unless inside
/// [`with_device`].
pub fn current() -> Device {
    CURRENT.with(|c| c.get())
}

/// Runs `f` with `device` as the device that creation ops use (restored
/// afterwards, also on panic). Autograd runs each backward step under the
/// gradient's device, so the zeros a rule creates live beside it.
pub fn with_device<R>(device: Device, f: impl FnOnce() -> R) -> R {
    struct Restore(Device);
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CURRENT.with(|c| c.replace(device)));
    f()
}

/// What [`of_inputs`] reads of an op's input: its device and type. Arrays
/// have it, and so do the tensors of the layers above.
pub trait Placed {
    /// Where the values are.
    fn device(&self) -> Device;
    fn rank(&self) -> usize;
    fn ty(&self) -> TensorType;
}

impl Placed for Array {
    fn device(&self) -> Device {
        Array::device(self)
    }
    fn rank(&self) -> usize {
        Array::rank(self)
    }
    fn ty(&self) -> TensorType {
        Array::ty(self)
    }
}

/// The device an op runs on: the device of its inputs, where 0-dim host
/// values (scalars) go with any device; [`current`] for an op without
/// inputs. Inputs on different devices are an error naming the op.
pub fn of_inputs<T: Placed>(op: &str, inputs: &[&T]) -> Result<Device> {
    let mut found: Option<(Device, usize)> = None;
    for (i, t) in inputs.iter().enumerate() {
        let d = t.device();
        if d == Device::Cpu && t.rank() == 0 {
            continue;
        }
        match found {
            None => found = Some((d, i)),
            Some((f, j)) if f != d => {
                return Err(Error::op(
                    ErrorKind::Argument,
                    op,
                    format!(
                        "inputs on different devices: input {j} {} is on {f}, input {i} {} is on {d}; \
                         move them with .to_device(..) first",
                        inputs[j].ty(),
                        t.ty()
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    Ok(match found {
        Some((d, _)) => d,
        None if inputs.is_empty() => current(),
        // Only 0-dim host values: a host op.
        None => Device::Cpu,
    })
}
