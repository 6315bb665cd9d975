//! Where computation runs: the [`Backend`] trait every device implements
//! (the CPU too: [`super::cpu::CpuBackend`]), [`DeviceBackend`], what a
//! device with memory of its own adds (uploads, downloads, allocation), the
//! registry that maps a [`Device`] to its backend at run time, and
//! [`DeviceStorage`], the bytes of an array that lives on a device.
//!
//! Callers never branch on the device to compute: they ask [`backend`] for
//! the inputs' device and call it. The core crate knows no device API: a
//! backend crate (`tessera-cuda`) implements [`DeviceBackend`] and
//! registers it with [`register`]. Arrays on a
//! device carry a [`DeviceStorage`]; an op whose inputs live on a device is
//! sent to that device's backend (see `Tensor::apply`), and a compiled
//! executable runs each kernel on its inputs' device. Backends take and
//! return [`Array`]s, never the user-facing `Tensor`.

use std::cell::Cell;
use std::fmt;
use std::sync::{Arc, RwLock};

use super::array::Array;
use super::cpu::{DescribedProduct, MemoryStats, Storage};
use super::layout::Layout;
use crate::error::{Error, ErrorKind, Result};
use crate::ir::kernel::{FusedKernel, FusedRegisters, RowKernel, RowRegisters};
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

/// The memory of [`DeviceStorage::no_elements`]: no bytes at address 0.
struct NoBytes;

impl DeviceMemory for NoBytes {
    fn ptr(&self) -> u64 {
        0
    }

    fn len(&self) -> usize {
        0
    }
}

/// The bytes behind one or more device tensors (views share a storage).
pub struct DeviceStorage {
    device: Device,
    dtype: DType,
    numel: usize,
    bytes: Bytes,
}

/// Where a storage's bytes are.
enum Bytes {
    /// A block of its own.
    Own(Box<dyn DeviceMemory>),
    /// In another storage's block (an output written over an input), which
    /// it keeps alive; that one always has a block of its own.
    Over(Arc<DeviceStorage>),
}

impl DeviceStorage {
    /// Storage for `numel` elements of `dtype` in `memory`. Panics when
    /// `memory` is too small for them or `numel` is past the size limit
    /// ([`crate::limits`]; a backend allocates for checked shapes only), so
    /// [`DeviceStorage::size_bytes`] never overflows and no kernel reads
    /// past the block.
    pub fn new(device: Device, dtype: DType, numel: usize, memory: Box<dyn DeviceMemory>) -> Self {
        Self::checked(device, dtype, numel, memory.len());
        DeviceStorage {
            device,
            dtype,
            numel,
            bytes: Bytes::Own(memory),
        }
    }

    /// Storage for `numel` elements of `dtype` in the bytes of `under`: a
    /// kernel's output written over its input, which it keeps alive. Over a
    /// storage that is itself in another's bytes it holds that other one,
    /// so a training step that writes each parameter over the last stays
    /// one level deep however many steps run. Panics as
    /// [`DeviceStorage::new`] when the bytes are too few.
    pub fn over(under: &Arc<DeviceStorage>, dtype: DType, numel: usize) -> Self {
        let owner = under.owner().unwrap_or(under).clone();
        Self::checked(owner.device, dtype, numel, owner.size_bytes());
        DeviceStorage {
            device: owner.device,
            dtype,
            numel,
            bytes: Bytes::Over(owner),
        }
    }

    /// Storage of no elements that holds no memory: nothing is allocated
    /// and no kernel ever reads it (kernels over no elements do not run).
    pub fn no_elements(device: Device, dtype: DType) -> Self {
        Self::new(device, dtype, 0, Box::new(NoBytes))
    }

    fn checked(device: Device, dtype: DType, numel: usize, bytes: usize) {
        let fits = numel <= crate::limits::MAX_ELEMENTS && bytes >= numel * dtype.size_bytes();
        assert!(
            fits,
            "internal error: {numel} elements of {dtype} in a {device} block of {bytes} bytes"
        );
    }

    /// The storage whose bytes these are, when they are another's (see
    /// [`DeviceStorage::over`]).
    pub fn owner(&self) -> Option<&Arc<DeviceStorage>> {
        match &self.bytes {
            Bytes::Own(_) => None,
            Bytes::Over(owner) => Some(owner),
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
        match &self.bytes {
            Bytes::Own(memory) => memory.ptr(),
            Bytes::Over(owner) => owner.ptr(),
        }
    }

    pub fn size_bytes(&self) -> usize {
        self.numel * self.dtype.size_bytes()
    }
}

/// One argument of a fused kernel.
pub enum FusedArg<'a> {
    /// An array the kernel reads (broadcast to the kernel's shape).
    Shared(&'a Array),
    /// A dense array that nothing else holds (its buffer is unique), of the
    /// kernel's shape, which output `output` (of the same dtype) overwrites:
    /// the memory plan's in-place write. The output keeps its buffer and
    /// allocates nothing. In place is safe because every block of a fused
    /// kernel loads all of its inputs before it stores its outputs, at the
    /// same element range, and blocks are disjoint.
    Donated { array: Array, output: usize },
}

impl FusedArg<'_> {
    /// The array read, donated or not.
    pub fn array(&self) -> &Array {
        match self {
            FusedArg::Shared(a) => a,
            FusedArg::Donated { array, .. } => array,
        }
    }
}

/// What every device implements, the CPU included: its kernels on arrays,
/// its clock (synchronisation, streams) and its memory accounting. Every
/// method that takes arrays gets them on this backend's device, except
/// 0-dim host arrays, which stand for scalars (as in PyTorch) and which
/// the backend reads on the host.
pub trait Backend: Send + Sync {
    fn device(&self) -> Device;

    /// Computes `op(inputs)` whose output has `dtype` and `shape` (inferred
    /// and checked). Views are handled by the caller: `op` is never a view
    /// here. An op the backend has no kernel for is an `Unsupported` error
    /// that names it.
    fn eval(&self, op: &Op, inputs: &[&Array], dtype: DType, shape: &[usize]) -> Result<Array>;

    /// Runs a fused elementwise kernel (see [`FusedKernel`]) on `inputs`,
    /// numbered by its loads, writing donated inputs over in place. Under
    /// [`tuning`], a backend may first pick the kernel's launch shape (the
    /// CPU its block size) by trial runs on these inputs.
    fn run_fused(&self, kernel: &FusedKernel, inputs: Vec<FusedArg<'_>>) -> Result<Vec<Array>>;

    /// [`Backend::run_fused`] with the kernel's register slots allocated
    /// by the caller, once for all its runs (the executor's, per plan):
    /// `registers[0]` as `FusedRegisters::allocate` makes them without the
    /// outputs' own slots, `registers[1]` with them. A backend that
    /// allocates no registers ignores them (the default).
    fn run_fused_in(
        &self,
        kernel: &FusedKernel,
        registers: &[FusedRegisters; 2],
        inputs: Vec<FusedArg<'_>>,
    ) -> Result<Vec<Array>> {
        let _ = registers;
        self.run_fused(kernel, inputs)
    }

    /// `op` (a matmul) of `a` and `b` plus `bias`, a contiguous `[n]` of
    /// the product's dtype added to every row of the product (`shape`), in
    /// one kernel where the device has one (cuBLASLt's bias epilogue: the
    /// bias is added before the product is rounded to its dtype, one
    /// rounding fewer than the gemm and the add). `None`: no such kernel
    /// for these operands; the caller runs the gemm, then the add.
    fn matmul_bias(
        &self,
        op: &Op,
        a: &Array,
        b: &Array,
        bias: &Array,
        shape: &[usize],
    ) -> Option<Result<Array>> {
        let _ = (op, a, b, bias, shape);
        None
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

    /// [`Backend::run_rows`] with the kernel's register slots allocated by
    /// the caller (`RowRegisters::allocate`), once for all its runs. A
    /// backend that allocates no registers ignores them (the default).
    fn run_rows_in(
        &self,
        kernel: &RowKernel,
        registers: &RowRegisters,
        inputs: &[&Array],
    ) -> Result<Vec<Array>> {
        let _ = registers;
        self.run_rows(kernel, inputs)
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

    /// Bytes of offloaded values this backend keeps in host memory (its
    /// pinned pool; the CPU's separately accounted host pool), now and the
    /// most at once since the last [`Backend::reset_peak`]. None by default.
    fn host_memory_stats(&self) -> MemoryStats {
        MemoryStats {
            live_bytes: 0,
            peak_bytes: 0,
        }
    }

    /// Gives cached free blocks back to the driver.
    fn empty_cache(&self);

    /// A copy of `array` in host memory, accounted apart from this
    /// device's own (offload: a saved activation waiting for the backward).
    /// The default copies to the host through [`Array::to_host`]; the CPU
    /// copies into its host pool (`cpu::host_memory_stats`), so that what
    /// offloading saves shows in [`Backend::memory_stats`]. Synchronous.
    fn offload(&self, array: &Array) -> Result<Array> {
        array.to_host()
    }

    /// `array` (made by [`Backend::offload`]) back in this device's memory
    /// (prefetch, before its first use). Synchronous.
    fn prefetch(&self, array: &Array) -> Result<Array> {
        let _ = array;
        Err(unsupported(self.device(), "prefetching offloaded values"))
    }

    /// [`Backend::offload`] started, not finished: the host copy, and the
    /// copy in flight (`None`: it is done). A device copies on a stream of
    /// its own after the work queued so far (the value's producer) and
    /// holds the device bytes until the compute waits for the copy
    /// ([`Transfer::wait`]) and the transfer drops. The host copy's bytes
    /// are not to be read on the host before that (a device's host storage
    /// waits for its copy when read there). The default runs
    /// [`Backend::offload`].
    fn offload_start(&self, array: &Array) -> Result<(Array, Option<Box<dyn Transfer>>)> {
        Ok((self.offload(array)?, None))
    }

    /// [`Backend::prefetch`] started, not finished: the device copy, which
    /// no kernel may read before the compute waits for the transfer
    /// ([`Transfer::wait`]). The default runs [`Backend::prefetch`].
    fn prefetch_start(&self, array: &Array) -> Result<(Array, Option<Box<dyn Transfer>>)> {
        Ok((self.prefetch(array)?, None))
    }

    /// How many streams (lanes) the kernels of one schedule step may be
    /// spread over; 1 runs everything in order on one stream.
    fn lanes(&self) -> usize {
        1
    }

    /// Whether the kernels of one schedule step may run at once on host
    /// threads (the CPU's; a device queues its kernels from one thread and
    /// spreads them over [`Backend::lanes`] instead).
    fn runs_on_host_threads(&self) -> bool {
        false
    }

    /// Runs `kernel` with the products of `products` (row-major `[.., m,
    /// n]` of each matmul: its op, its operands, its output shape) fed to
    /// it block of rows by block of rows, never made whole, if this backend
    /// can (`None`: the caller makes the products and calls
    /// [`Backend::run_rows`]). `row_args[i]` is load `i`'s array, `None`
    /// for the loads `fed` names (the products, in `products`' order).
    fn run_rows_fed(
        &self,
        kernel: &RowKernel,
        products: &[(&Op, [&Array; 2], &[usize])],
        row_args: &[Option<&Array>],
        fed: &[usize],
    ) -> Option<Result<Vec<Array>>> {
        let _ = (kernel, products, row_args, fed);
        None
    }

    /// Whether [`Backend::run_rows_fed`] takes matmul products like these
    /// (each: its operands' layouts and dtypes, its transposes, its output
    /// shape) of a row kernel that is not wide: the memory plan then
    /// reserves no scratch for them.
    fn feeds_products(&self, products: &[DescribedProduct<'_>]) -> bool {
        let _ = products;
        false
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

    /// Records event `slot` on the current lane's stream: it completes
    /// when the work queued there so far has (a kernel whose value a
    /// kernel on another lane reads). Between a [`Backend::fork`] and its
    /// [`Backend::join`]; nothing to do without streams.
    fn record(&self, slot: usize) -> Result<()> {
        let _ = slot;
        Ok(())
    }

    /// The work queued on the current lane from now on waits for event
    /// `slot`'s last [`Backend::record`] (a device-side wait: the host
    /// goes on queueing).
    fn wait_for(&self, slot: usize) -> Result<()> {
        let _ = slot;
        Ok(())
    }

    /// How many times so far the host waited for the device
    /// (synchronisations, downloads): what a recording
    /// ([`Backend::begin_capture`]) cannot contain. A device-graph replayer
    /// compares it before and after a run to learn whether that run could
    /// be recorded. 0 on a backend without recordings.
    fn host_waits(&self) -> u64 {
        0
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

/// A copy between host and device memory in flight
/// ([`Backend::offload_start`], [`Backend::prefetch_start`]). Dropping it
/// releases what the copy reads (an offload's device bytes) to the work
/// queued after the last [`Transfer::wait`]; a transfer dropped without a
/// wait first makes the main stream wait for it.
pub trait Transfer: Send {
    /// The work queued on the current lane from now on waits for the copy
    /// (a device-side wait: no host synchronisation).
    fn wait(&self) -> Result<()>;
}

/// What a device with memory of its own adds to [`Backend`]: allocation
/// and the copies between it and the host.
pub trait DeviceBackend: Backend {
    /// Storage for `numel` elements of `dtype` (contents undefined; kernels
    /// overwrite what they hand out). Out of memory is an error that names
    /// the bytes asked for and the bytes free.
    fn alloc(&self, dtype: DType, numel: usize) -> Result<DeviceStorage>;

    /// A copy of host storage on the device.
    fn upload(&self, host: &Storage) -> Result<DeviceStorage>;

    /// A copy of device storage on the host (waits for pending work).
    fn download(&self, storage: &DeviceStorage) -> Result<Storage>;

    /// Queues a copy of `src`'s bytes into `dst` (same size) on the device.
    fn copy(&self, dst: &DeviceStorage, src: &DeviceStorage) -> Result<()>;
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

static CUDA: RwLock<Option<Arc<dyn DeviceBackend>>> = RwLock::new(None);

/// Makes `backend` the one that runs arrays on `backend.device()`.
pub fn register(backend: Arc<dyn DeviceBackend>) -> Result<()> {
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

/// The backend that computes on `device`: the CPU's, or the one registered
/// for a device (an error when none is).
pub fn backend(device: Device) -> Result<Arc<dyn Backend>> {
    match device {
        Device::Cpu => Ok(super::cpu::cpu_backend()),
        d => Ok(device_backend(d)?),
    }
}

/// The backend registered for a device with memory of its own; an error
/// for the CPU (host memory is not a device's) and for a device nobody
/// registered.
pub fn device_backend(device: Device) -> Result<Arc<dyn DeviceBackend>> {
    let slot = match device {
        Device::Cpu => {
            return Err(Error::new(
                ErrorKind::Argument,
                "the CPU has no device memory: its arrays are host arrays",
            ))
        }
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

/// Computes `op(inputs)` (its output `dtype` and `shape` inferred) on
/// `device`'s backend; views are made here, with one rule
/// ([`super::cpu::view_layout`]), so every device aliases alike.
pub fn eval(
    device: Device,
    op: &Op,
    inputs: &[&Array],
    dtype: DType,
    shape: &[usize],
) -> Result<Array> {
    if let Some(x) = inputs.first() {
        if x.device() == device {
            let input = (x.layout(), x.dtype(), x.storage_numel());
            if let Some(layout) = super::cpu::view_layout(op, input, shape) {
                return Ok(x.view(layout));
            }
        }
    }
    backend(device)?.eval(op, inputs, dtype, shape)
}

/// Whether a backend computes on `device` (the CPU's always does).
pub fn is_available(device: Device) -> bool {
    backend(device).is_ok()
}

/// Memory accounting of `device` (the host pool for the CPU).
pub fn memory_stats(device: Device) -> Result<MemoryStats> {
    Ok(backend(device)?.memory_stats())
}

/// Bytes of `device`'s offloaded values in host memory
/// ([`Backend::host_memory_stats`]).
pub fn host_memory_stats(device: Device) -> Result<MemoryStats> {
    Ok(backend(device)?.host_memory_stats())
}

/// Starts a new peak measurement on `device` (its host pool's too).
pub fn reset_peak(device: Device) -> Result<()> {
    backend(device)?.reset_peak();
    Ok(())
}

/// Waits for the work queued on `device` (nothing to wait for on the CPU).
pub fn synchronize(device: Device) -> Result<()> {
    backend(device)?.synchronize()
}

thread_local! {
    static TUNING: Cell<bool> = const { Cell::new(false) };
}

/// Whether the kernels run or queued from this thread now belong to a
/// `max-autotune` run: backends then tune them (the CPU the block of its
/// fused kernels, a device its launches) and cache what they chose.
pub fn tuning() -> bool {
    TUNING.with(Cell::get)
}

/// Sets [`tuning`] on this thread while alive; dropping it (also
/// in a panic's unwinding) restores the previous setting.
#[must_use = "the setting lasts while the guard lives"]
pub struct Tuning(bool);

impl Tuning {
    pub fn set(on: bool) -> Tuning {
        Tuning(TUNING.with(|t| t.replace(on)))
    }
}

impl Drop for Tuning {
    fn drop(&mut self) {
        TUNING.with(|t| t.set(self.0));
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

/// The device `op` runs on given its inputs: [`of_inputs`], except for the
/// random ops, whose one input (the seed) is a parameter of the draw, not
/// data: with a host seed they create their values on [`current`], as every
/// creation op does, and with a seed on a device, on that device.
pub fn of_op<T: Placed>(op: &Op, inputs: &[&T]) -> Result<Device> {
    let on = of_inputs(op.name(), inputs)?;
    let host_scalars = inputs
        .iter()
        .all(|t| t.device() == Device::Cpu && t.rank() == 0);
    Ok(match op {
        Op::Rand { .. } | Op::Randn { .. } if host_scalars => current(),
        _ => on,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block at a made-up address (never dereferenced).
    struct At(u64, usize);

    impl DeviceMemory for At {
        fn ptr(&self) -> u64 {
            self.0
        }

        fn len(&self) -> usize {
            self.1
        }
    }

    #[test]
    fn storage_written_over_storage_stays_one_level_deep() {
        let own = Arc::new(DeviceStorage::new(
            Device::Cuda,
            DType::F32,
            4,
            Box::new(At(0x1000, 16)),
        ));
        let mut last = own.clone();
        for _ in 0..3 {
            last = Arc::new(DeviceStorage::over(&last, DType::F32, 4));
            let owner = last.owner().expect("written over another");
            assert!(Arc::ptr_eq(owner, &own), "held: the block's owner");
            assert_eq!(last.ptr(), 0x1000);
        }
        // The block's owner, the last storage over it, nothing between.
        assert_eq!(Arc::strong_count(&own), 2);
        let reread = DeviceStorage::over(&own, DType::I32, 4);
        assert_eq!((reread.dtype(), reread.ptr()), (DType::I32, 0x1000));
        let too_big = std::panic::catch_unwind(|| DeviceStorage::over(&own, DType::F64, 4));
        assert!(too_big.is_err(), "8 f64 bytes each do not fit 16 bytes");
    }

    #[test]
    fn a_random_op_with_a_host_seed_creates_on_the_current_device() {
        let seed = Array::from_storage(Storage::from_slice(&[7i64]), &[]);
        let rand = Op::Rand {
            shape: crate::ir::Shape::from_concrete(&[2]),
            dtype: DType::F32,
        };
        let neg = Op::Unary(crate::ir::UnaryOp::Neg);
        assert_eq!(of_op(&rand, &[&seed]).unwrap(), Device::Cpu);
        with_device(Device::Cuda, || {
            assert_eq!(of_op(&rand, &[&seed]).unwrap(), Device::Cuda);
            // Other ops of host scalars stay on the host.
            assert_eq!(of_op(&neg, &[&seed]).unwrap(), Device::Cpu);
            assert_eq!(of_inputs("rand", &[&seed]).unwrap(), Device::Cpu);
        });
    }

    #[test]
    fn tuning_is_scoped_to_the_thread_and_the_call() {
        assert!(!tuning());
        {
            let _on = Tuning::set(true);
            assert!(tuning());
            // Another thread queues no kernels of this run.
            assert!(!std::thread::spawn(tuning).join().unwrap());
            {
                let _off = Tuning::set(false);
                assert!(!tuning());
            }
            assert!(tuning());
        }
        assert!(!tuning());
        let _ = std::panic::catch_unwind(|| {
            let _on = Tuning::set(true);
            panic!("boom")
        });
        assert!(!tuning());
    }
}
