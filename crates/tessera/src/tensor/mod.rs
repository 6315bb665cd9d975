//! The `Tensor` handle and eager execution.
//!
//! A `Tensor` is a cheap, clonable handle to a strided view over a shared
//! storage. Every op goes through one path, [`Tensor::apply`]: type inference
//! with the IR's rule (so eager and graph mode agree on every shape), then
//! the kernel of the inputs' backend — or, while a [`trace`] is active, a
//! node of the traced graph — and then the autograd tape.
//!
//! The tensor layer also holds what that path needs: creation
//! ([`creation`]), the mixed-precision scope the op methods obey
//! ([`autocast`]), the tape ops record on (`tape`: the data of autograd;
//! the engine that walks it back is the `autograd` layer above), custom
//! ops' implementations and their registry (`custom`, public as
//! `tessera::custom_op`), what the tape does in hinted regions (saved
//! values in host memory, [`offload`]; recomputed in the backward,
//! [`recompute`]), tracing ([`trace`]), and the interpreter that
//! runs a graph node by node through `Tensor::apply` ([`interpret`]: the
//! reference for compiled code, and what a graph break runs).
//!
//! # Errors: panic or `Result`
//!
//! Op methods (`a.matmul(&b)`, `&a + &b`, `x.reshape(..)`) panic on bad input
//! with the same message the error carries — the op, the shapes/dtypes and
//! the user's line — as PyTorch raises. Ops whose validity depends on runtime
//! shapes also come as `try_*` methods returning [`Result`] (`try_matmul`,
//! `try_reshape`, `try_cat` …). File I/O and parsing always return `Result`.

pub mod autocast;
mod cnn;
pub mod creation;
pub(crate) mod custom;
pub mod interpret;
pub mod offload;
mod ops;
pub mod recompute;
pub(crate) mod tape;
pub mod trace;

use std::fmt;
use std::panic::Location;
use std::sync::Arc;

/// Strided layouts live with the backends (`runtime::layout`); the public
/// paths `tensor::layout` and `tensor::Layout` name the same items.
pub use crate::runtime::layout::{self, Layout};
pub use cnn::{BatchNormStats, ConvOptions, ConvPadding, Interpolation, PadMode, PoolOptions};
pub use creation::Generator;
pub use ops::Operand;

use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::ir::{DType, Op, Shape, TensorType};
use crate::runtime::array::Array;
use crate::runtime::cpu::{self, Element, Storage};
use crate::runtime::device::{self, Device, DeviceStorage};
use tape::AutogradMeta;

/// An n-dimensional array: values on the CPU or a device, or a node of a
/// graph being traced (see [`trace`]).
#[derive(Clone)]
pub struct Tensor(Arc<TensorImpl>);

struct TensorImpl {
    data: Data,
    /// Present when the tensor takes part in autograd (a leaf that requires
    /// grad, or the result of a differentiable op on one).
    autograd: Option<Arc<AutogradMeta>>,
    /// The op without a gradient (argmax, a compare …) that cut this tensor
    /// off from inputs that require grad, for the error of a `backward`.
    cut_by: Option<&'static str>,
}

/// What a tensor is.
#[derive(Clone)]
pub(crate) enum Data {
    /// Values, on the host or a device: what backends compute with.
    Values(Array),
    /// A node of the graph traced on this thread; it has a type but no
    /// values.
    Traced {
        dtype: DType,
        layout: Layout,
        value: trace::TracedValue,
    },
}

impl Tensor {
    /// A tensor over `storage` with `layout` (a view when the storage is
    /// shared). Panics when the layout reaches outside the storage
    /// ([`Layout::fits`]): reading it would read out of bounds.
    pub fn from_parts(storage: Arc<Storage>, layout: Layout) -> Tensor {
        Tensor::from_array(Array::from_parts(storage, layout))
    }

    /// A tensor holding `array`'s values.
    pub fn from_array(array: Array) -> Tensor {
        Tensor::from_data(Data::Values(array))
    }

    pub(crate) fn from_data(data: Data) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            data,
            autograd: None,
            cut_by: None,
        }))
    }

    pub(crate) fn data(&self) -> &Data {
        &self.0.data
    }

    /// The values as the backends' [`Array`], if this tensor has values
    /// (a traced one has none).
    pub fn try_array(&self) -> Option<&Array> {
        match &self.0.data {
            Data::Values(a) => Some(a),
            Data::Traced { .. } => None,
        }
    }

    /// The values as the backends' [`Array`]. Kernels only ever see
    /// tensors with values; calling this on a traced tensor is a bug in
    /// tessera (see [`Tensor::try_array`]).
    pub fn array(&self) -> &Array {
        match &self.0.data {
            Data::Values(a) => a,
            Data::Traced { .. } => panic!(
                "internal error: a traced tensor ({}) has no values",
                self.ty()
            ),
        }
    }

    pub(crate) fn autograd_meta(&self) -> Option<&Arc<AutogradMeta>> {
        self.0.autograd.as_ref()
    }

    /// The same values under a new handle carrying `meta` (none: detached).
    pub(crate) fn with_autograd(&self, meta: Option<Arc<AutogradMeta>>) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            data: self.0.data.clone(),
            autograd: meta,
            cut_by: None,
        }))
    }

    /// `values` (the same shape and dtype: a copy elsewhere) under a new
    /// handle with this one's autograd state.
    pub(crate) fn with_values(&self, values: Array) -> Tensor {
        debug_assert_eq!(
            (values.shape(), values.dtype()),
            (self.shape(), self.dtype())
        );
        Tensor(Arc::new(TensorImpl {
            data: Data::Values(values),
            autograd: self.0.autograd.clone(),
            cut_by: self.0.cut_by,
        }))
    }

    /// The same values, marked as cut from autograd by `op`.
    pub(crate) fn cut_by(&self, op: &'static str) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            data: self.0.data.clone(),
            autograd: None,
            cut_by: Some(op),
        }))
    }

    /// The op that cut this tensor off from inputs requiring grad, if any.
    pub(crate) fn cut_op(&self) -> Option<&'static str> {
        self.0.cut_by
    }

    /// A stable identity for this handle (clones share it).
    pub(crate) fn id(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
    }

    /// The values of a tensor that no other handle, view or autograd record
    /// holds and that cover their buffer densely, by value, on any device:
    /// a kernel may write over them (the memory plan's in-place reuse). The
    /// tensor back otherwise.
    pub(crate) fn into_unique_array(self) -> std::result::Result<Array, Tensor> {
        let dense = match &self.0.data {
            Data::Values(a) => a.is_dense(),
            Data::Traced { .. } => false,
        };
        if !dense || self.0.autograd.is_some() {
            return Err(self);
        }
        let inner = Arc::try_unwrap(self.0).map_err(Tensor)?;
        // Checked once the handle is ours: until then another handle could
        // still have made a view of the buffer.
        match inner.data {
            Data::Values(array) if array.buffer().is_unique() => {
                // Its values change: a host copy made of them is stale.
                offload::forget(array.buffer_addr());
                Ok(array)
            }
            data => Err(Tensor(Arc::new(TensorImpl { data, ..inner }))),
        }
    }

    /// Whether [`Tensor::into_unique_array`] would hand this tensor's
    /// buffer over: its only handle, dense, outside autograd.
    pub(crate) fn is_sole_dense_handle(&self) -> bool {
        let Data::Values(array) = &self.0.data else {
            return false;
        };
        array.is_dense()
            && self.0.autograd.is_none()
            && Arc::strong_count(&self.0) == 1
            && array.buffer().is_unique()
    }

    /// Whether this handle is its tensor's only one (no clone, and no
    /// autograd record): its storage may still be shared by other tensors.
    pub(crate) fn is_only_handle(&self) -> bool {
        Arc::strong_count(&self.0) == 1 && self.0.autograd.is_none()
    }

    /// Whether this tensor is a node of a graph being traced.
    pub fn is_traced(&self) -> bool {
        matches!(self.0.data, Data::Traced { .. })
    }

    /// A contiguous tensor owning `storage`, which must hold exactly the
    /// elements of `shape` (else a panic: see [`Tensor::from_parts`]).
    pub fn from_storage(storage: Storage, shape: &[usize]) -> Tensor {
        Tensor::from_array(Array::from_storage(storage, shape))
    }

    pub fn dtype(&self) -> DType {
        match &self.0.data {
            Data::Values(a) => a.dtype(),
            Data::Traced { dtype, .. } => *dtype,
        }
    }

    pub fn shape(&self) -> &[usize] {
        &self.layout().shape
    }

    pub fn strides(&self) -> &[usize] {
        &self.layout().strides
    }

    pub fn layout(&self) -> &Layout {
        match &self.0.data {
            Data::Values(a) => a.layout(),
            Data::Traced { layout, .. } => layout,
        }
    }

    /// The storage behind a host tensor. CPU kernels only ever see host
    /// tensors; calling this on a traced or device tensor is a bug in
    /// tessera (public readers copy device tensors to the host first).
    pub fn storage(&self) -> &Arc<Storage> {
        self.array().storage()
    }

    /// A tensor over device `storage` with `layout` (checked as in
    /// [`Tensor::from_parts`]).
    pub fn from_device_parts(storage: Arc<DeviceStorage>, layout: Layout) -> Tensor {
        Tensor::from_array(Array::from_device_parts(storage, layout))
    }

    /// A contiguous tensor owning device `storage`, which must hold exactly
    /// the elements of `shape`.
    pub fn from_device_storage(storage: DeviceStorage, shape: &[usize]) -> Tensor {
        Tensor::from_array(Array::from_device_storage(storage, shape))
    }

    /// The storage behind a device tensor, if it is one.
    pub fn device_storage(&self) -> Option<&Arc<DeviceStorage>> {
        self.try_array().and_then(Array::device_storage)
    }

    /// Where the values are (a traced tensor reports the CPU: it has none).
    pub fn device(&self) -> Device {
        match &self.0.data {
            Data::Values(a) => a.device(),
            Data::Traced { .. } => Device::Cpu,
        }
    }

    /// The elements of storage behind this tensor (host or device).
    pub(crate) fn storage_numel(&self) -> Option<usize> {
        self.try_array().map(Array::storage_numel)
    }

    /// This tensor on `device` ("cpu" or "cuda"): the same tensor when it
    /// is there already, else a copy (`requires_grad` is not carried: the
    /// copy is a new leaf). Under tracing the tensor is returned as is: a
    /// compiled program runs on its inputs' device.
    #[track_caller]
    pub fn to_device(&self, device: &str) -> Result<Tensor> {
        let at = SourceLoc::caller();
        let target = Device::parse(device).map_err(|e| e.at(at.clone()))?;
        self.to(target).map_err(|e| e.at(at))
    }

    /// This tensor on `target` (see [`Tensor::to_device`]).
    pub fn to(&self, target: Device) -> Result<Tensor> {
        if self.is_traced() || self.device() == target {
            return Ok(self.clone());
        }
        match target {
            Device::Cpu => self.to_host(),
            d => {
                let backend = device::device_backend(d)?;
                let host = if self.device() == Device::Cpu {
                    self.clone()
                } else {
                    self.to_host()?
                };
                let dense = cpu::copy::contiguous(host.array());
                let storage = backend.upload(dense.storage())?;
                Ok(Tensor::from_device_storage(storage, host.shape()))
            }
        }
    }

    /// A host copy of a device tensor (the tensor itself when on the host).
    pub fn to_host(&self) -> Result<Tensor> {
        let Some(storage) = self.device_storage() else {
            return Ok(self.clone());
        };
        let backend = device::device_backend(storage.device())?;
        let dense = storage.numel() == self.numel() && self.is_contiguous();
        let (storage, layout) = if dense || self.numel() * 2 > storage.numel() {
            (backend.download(storage)?, self.layout().clone())
        } else {
            // A small view of a large buffer: gather it on the device first.
            let c = Tensor::apply(&Op::Contiguous, &[self], Location::caller())?;
            let s = c.device_storage().expect("on the device");
            (backend.download(s)?, c.layout().clone())
        };
        Ok(Tensor::from_parts(Arc::new(storage), layout))
    }

    pub fn rank(&self) -> usize {
        self.layout().rank()
    }

    pub fn numel(&self) -> usize {
        self.layout().numel()
    }

    pub fn is_contiguous(&self) -> bool {
        self.layout().is_contiguous()
    }

    /// The IR type of this tensor.
    pub fn ty(&self) -> TensorType {
        TensorType {
            dtype: self.dtype(),
            shape: Shape::from_concrete(self.shape()),
        }
    }

    /// Whether two tensors share storage (one is a view of the other).
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        match (self.try_array(), other.try_array()) {
            (Some(a), Some(b)) => a.shares_buffer(b),
            _ => false,
        }
    }

    /// The whole storage as `&[T]` (index it through [`Tensor::layout`]).
    /// Errors when `T` is not this tensor's element type.
    pub fn storage_slice<T: Element>(&self) -> Result<&[T]> {
        self.expect_dtype::<T>()?;
        self.expect_host("storage_slice")?;
        if self.device() != Device::Cpu {
            return Err(Error::op(
                ErrorKind::Unsupported,
                "storage_slice",
                format!(
                    "{} is on {}: copy it with .to_host() first",
                    self.ty(),
                    self.device()
                ),
            ));
        }
        Ok(self.storage().as_slice::<T>())
    }

    /// The elements as `&[T]` in row-major order, if contiguous.
    pub fn contiguous_slice<T: Element>(&self) -> Option<&[T]> {
        self.try_array()?.contiguous_slice()
    }

    /// Reading values needs a host tensor: a traced one has none yet.
    pub(crate) fn expect_host(&self, what: &str) -> Result<()> {
        if self.is_traced() {
            return Err(Error::op(
                ErrorKind::Unsupported,
                what,
                format!(
                    "cannot read the values of {} while tracing: it is a graph node, not data",
                    self.ty()
                ),
            ));
        }
        Ok(())
    }

    fn expect_dtype<T: Element>(&self) -> Result<()> {
        if T::DTYPE != self.dtype() {
            return Err(Error::new(
                ErrorKind::DType,
                format!("tensor is {} but was read as {}", self.ty(), T::DTYPE),
            ));
        }
        Ok(())
    }

    /// Runs `op` on `inputs` eagerly: the IR's type rule, then the kernel of
    /// the inputs' device (see [`device::of_op`]). Errors carry `caller`
    /// as the user's line.
    pub fn apply(
        op: &Op,
        inputs: &[&Tensor],
        caller: &'static Location<'static>,
    ) -> Result<Tensor> {
        let at = |e: Error| e.at(SourceLoc::from_location(caller));
        match op {
            // The first output; a graph's later `custom_output` nodes are
            // bound by whoever runs the graph (see [`interpret`]).
            Op::Custom(call) => {
                return custom::apply(call, inputs, caller).map(|mut o| o.swap_remove(0))
            }
            Op::CustomOutput { .. } => {
                return Err(at(Error::op(
                    ErrorKind::Verify,
                    op.name(),
                    "is computed with its custom op, never on its own",
                )))
            }
            _ => {}
        }
        let types: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
        let ty = op.infer(&types).map_err(at)?;
        let shape = ty.shape.as_concrete().ok_or_else(|| {
            at(Error::op(
                ErrorKind::Unsupported,
                op.name(),
                format!("eager execution needs concrete shapes, got {}", ty.shape),
            ))
        })?;
        let out = if trace::is_active() {
            trace::record(op, inputs, ty, caller).map_err(at)?
        } else {
            // Plain eager inside a hint scope: say once per region what it
            // does not honour.
            if let Some(region) = crate::hints::current() {
                crate::hints::eager_op_in(&region);
            }
            crate::error::dispatching(caller, || {
                with_arrays(op, inputs, |arrays| {
                    let on = device::of_op(op, arrays)?;
                    Ok(Tensor::from_array(device::eval(
                        on, op, arrays, ty.dtype, &shape,
                    )?))
                })
            })
            .map_err(at)?
        };
        tape::record(op, inputs, out, caller).map_err(at)
    }
}

impl device::Placed for Tensor {
    fn device(&self) -> Device {
        Tensor::device(self)
    }
    fn rank(&self) -> usize {
        Tensor::rank(self)
    }
    fn ty(&self) -> TensorType {
        Tensor::ty(self)
    }
}

/// Calls `f` with the arrays of `inputs`, which must all have values (a
/// traced tensor outside its trace is an error naming `op`). Up to
/// [`STACK_INPUTS`] inputs are passed on the stack: eager dispatch
/// allocates nothing for them.
fn with_arrays<R>(
    op: &Op,
    inputs: &[&Tensor],
    f: impl FnOnce(&[&Array]) -> Result<R>,
) -> Result<R> {
    fn get<'a>(op: &Op, t: &'a Tensor) -> Result<&'a Array> {
        t.try_array().ok_or_else(|| {
            Error::op(
                ErrorKind::Argument,
                op.name(),
                format!("input {} is a traced tensor used outside its trace", t.ty()),
            )
        })
    }
    let Some(first) = inputs.first() else {
        return f(&[]);
    };
    if inputs.len() > STACK_INPUTS {
        let arrays = inputs.iter().map(|t| get(op, t));
        return f(&arrays.collect::<Result<Vec<_>>>()?);
    }
    let mut arrays = [get(op, first)?; STACK_INPUTS];
    for (slot, t) in arrays.iter_mut().zip(inputs).skip(1) {
        *slot = get(op, t)?;
    }
    f(&arrays[..inputs.len()])
}

/// Inputs of one eager op whose arrays [`with_arrays`] keeps on the stack.
const STACK_INPUTS: usize = 8;

/// Panics with the error's message; used by the panicking op methods so the
/// panic points at the user's line.
#[track_caller]
pub(crate) fn unwrap_or_panic(r: Result<Tensor>) -> Tensor {
    match r {
        Ok(t) => t,
        Err(e) => panic!("{e}"),
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({}", self.ty())?;
        if self.numel() <= 16 {
            let values = self.to_f64_vec();
            write!(f, ", {values:?}")?;
        }
        write!(f, ")")
    }
}
