//! Custom ops: user-defined operations that eager mode, graph capture, AOT
//! autograd and the compiler carry like built-ins (PyTorch's
//! `torch.library.custom_op` with `register_fake` and `register_autograd`).
//! Users reach this module as `tessera::custom_op`.
//!
//! A [`CustomOp`] has a name `ns::name`, a shape function run at trace time
//! (it sees only dtypes and possibly symbolic shapes), a kernel per backend
//! (`cpu` now; the `cuda` slot is filled by the CUDA backend), an optional
//! backward written with tensor ops (other custom ops included), and it may
//! return several outputs. Ops are built with [`CustomOp::builder`] and
//! registered in a process-wide registry. The name and the shape function
//! (the op's [`Signature`]) go to the IR's registry (`crate::ir::custom`),
//! where type inference, the verifier and the text parser find them; the
//! kernels and the backward are here, found by name when a call runs
//! ([`apply`], which `Tensor::apply` and the interpreter dispatch
//! `Op::Custom` to). The built-in ops' implementations ([`flash_attention`])
//! are in the registry from the start. The compiler treats a custom op as
//! one opaque extern kernel.
//!
//! In the IR a call is one `custom` node whose value is the op's first
//! output; every further output that something reads is a `custom_output`
//! node whose only input is the `custom` node. The kernel writes all of
//! them at once (see `fusion::Kernel::Custom`).

/// Runs `$body` with `$T` bound to the element type of float `$dtype`
/// (the CPU kernels of the custom ops that have an f64 kernel; the
/// callers import `DType`, `f16`, `bf16` and `op_err`).
macro_rules! with_float_type {
    ($op:expr, $dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
            other => Err(op_err!(DType, $op, "has no kernel for {other}")),
        }
    };
}

pub mod collective;
pub mod conv;
pub mod cross_entropy;
pub mod flash_attention;

use std::collections::HashMap;
use std::fmt;
use std::panic::{Location, RefUnwindSafe};
use std::sync::{Arc, LazyLock, RwLock};

use super::{tape, trace, Tensor};
use crate::error::{op_err, Error, ErrorKind, Result, SourceLoc};
use crate::ir::custom::{self, Attrs, CustomCall, ShapeFn, Signature};
use crate::ir::infer::TensorType;
use crate::ir::Op;

/// A kernel: concrete inputs → outputs, of the types the shape function said.
pub type KernelFn = dyn Fn(&Attrs, &[&Tensor]) -> Result<Vec<Tensor>> + Send + Sync + RefUnwindSafe;

/// What a backward sees: the forward's attributes, inputs and outputs, and
/// one gradient per output (zeros for an output nothing differentiated).
pub struct BackwardCtx<'a> {
    pub attrs: &'a Attrs,
    pub inputs: &'a [Tensor],
    pub outputs: &'a [Tensor],
    pub grads: &'a [Tensor],
}

/// A backward: one optional gradient per input. It is ordinary tensor code,
/// so it runs eagerly and is captured by AOT autograd like any other.
pub type CustomBackwardFn =
    dyn Fn(&BackwardCtx<'_>) -> Result<Vec<Option<Tensor>>> + Send + Sync + RefUnwindSafe;

/// The backends a custom op can have a kernel for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    Cpu,
    Cuda,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
        }
    }
}

/// A registered custom op: its signature (the IR's) and its
/// implementation (kernels, backward).
pub struct CustomOp {
    signature: Arc<Signature>,
    kernels: RwLock<HashMap<Backend, Arc<KernelFn>>>,
    backward: Option<Arc<CustomBackwardFn>>,
}

impl fmt::Debug for CustomOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CustomOp({})", self.name())
    }
}

/// Builds a [`CustomOp`]; see the module docs and `docs/custom_ops.md`.
pub struct CustomOpBuilder {
    name: String,
    shape_fn: Option<Arc<ShapeFn>>,
    kernels: HashMap<Backend, Arc<KernelFn>>,
    backward: Option<Arc<CustomBackwardFn>>,
}

impl CustomOpBuilder {
    /// The shape/dtype function, run at trace time (like `register_fake`).
    pub fn shape(
        mut self,
        f: impl Fn(&Attrs, &[TensorType]) -> Result<Vec<TensorType>>
            + Send
            + Sync
            + RefUnwindSafe
            + 'static,
    ) -> Self {
        self.shape_fn = Some(Arc::new(f));
        self
    }

    /// The kernel for `backend`.
    pub fn kernel(
        mut self,
        backend: Backend,
        f: impl Fn(&Attrs, &[&Tensor]) -> Result<Vec<Tensor>> + Send + Sync + RefUnwindSafe + 'static,
    ) -> Self {
        self.kernels.insert(backend, Arc::new(f));
        self
    }

    /// The CPU kernel.
    pub fn cpu(
        self,
        f: impl Fn(&Attrs, &[&Tensor]) -> Result<Vec<Tensor>> + Send + Sync + RefUnwindSafe + 'static,
    ) -> Self {
        self.kernel(Backend::Cpu, f)
    }

    /// The backward (like `register_autograd`).
    pub fn backward(
        mut self,
        f: impl Fn(&BackwardCtx<'_>) -> Result<Vec<Option<Tensor>>>
            + Send
            + Sync
            + RefUnwindSafe
            + 'static,
    ) -> Self {
        self.backward = Some(Arc::new(f));
        self
    }

    /// Checks the op and adds it to the registry, its signature to the
    /// IR's. A name already registered is an error (ops are looked up by
    /// name when graphs are parsed).
    pub fn register(self) -> Result<Arc<CustomOp>> {
        let name = self.name;
        custom::check_name(&name)?;
        let shape_fn = self.shape_fn.ok_or_else(|| {
            op_err!(
                Argument,
                name.clone(),
                "needs a shape function (`.shape(…)`)"
            )
        })?;
        let signature = Signature::new(&name, shape_fn)?;
        check_kernels(&name, &self.kernels)?;
        // The implementation registry's lock is held across the IR's
        // registration, so that the two registries agree at every moment.
        let mut registry = REGISTRY.write().expect("custom op registry");
        let op = Arc::new(CustomOp {
            signature: custom::register(signature)?,
            kernels: RwLock::new(self.kernels),
            backward: self.backward,
        });
        registry.insert(name, op.clone());
        Ok(op)
    }

    /// The implementation of a built-in op, whose signature the IR
    /// registers itself (`ir::custom`): no shape function of its own.
    fn implement_builtin(self) -> Result<Arc<CustomOp>> {
        let signature = custom::lookup(&self.name)?;
        check_kernels(&self.name, &self.kernels)?;
        Ok(Arc::new(CustomOp {
            signature,
            kernels: RwLock::new(self.kernels),
            backward: self.backward,
        }))
    }
}

fn check_kernels(name: &str, kernels: &HashMap<Backend, Arc<KernelFn>>) -> Result<()> {
    match kernels.is_empty() {
        true => Err(op_err!(
            Argument,
            name,
            "needs at least one kernel (`.cpu(…)`)"
        )),
        false => Ok(()),
    }
}

/// The implementations, by name; every name is also in the IR's registry.
static REGISTRY: LazyLock<RwLock<HashMap<String, Arc<CustomOp>>>> = LazyLock::new(|| {
    let mut builtins = flash_attention::builtins();
    builtins.extend(cross_entropy::builtins());
    builtins.extend(conv::builtins());
    builtins.extend(collective::builtins());
    RwLock::new(
        builtins
            .into_iter()
            .map(|op| (op.name().to_string(), op))
            .collect(),
    )
});

/// The registered op called `name`.
pub fn lookup(name: &str) -> Result<Arc<CustomOp>> {
    REGISTRY
        .read()
        .expect("custom op registry")
        .get(name)
        .cloned()
        .ok_or_else(|| {
            op_err!(
                Argument,
                name,
                "no custom op of this name is registered (register it before using or parsing it)"
            )
        })
}

/// Calls the registered op `name` (see [`CustomOp::call`]).
#[track_caller]
pub fn call(name: &str, attrs: Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let at = SourceLoc::caller();
    lookup(name).map_err(|e| e.at(at))?.call(attrs, inputs)
}

impl CustomOp {
    /// Starts building an op called `name` (`namespace::name`).
    pub fn builder(name: &str) -> CustomOpBuilder {
        CustomOpBuilder {
            name: name.to_string(),
            shape_fn: None,
            kernels: HashMap::new(),
            backward: None,
        }
    }

    pub fn name(&self) -> &str {
        self.signature.name()
    }

    /// The op's name and shape function, as the IR has them.
    pub fn signature(&self) -> &Arc<Signature> {
        &self.signature
    }

    /// Whether a backward is registered.
    pub fn has_backward(&self) -> bool {
        self.backward.is_some()
    }

    /// Adds or replaces the kernel for `backend` (how a backend crate fills
    /// the CUDA slot of an op registered elsewhere).
    pub fn set_kernel(
        &self,
        backend: Backend,
        f: impl Fn(&Attrs, &[&Tensor]) -> Result<Vec<Tensor>> + Send + Sync + RefUnwindSafe + 'static,
    ) {
        self.kernels
            .write()
            .expect("custom op kernels")
            .insert(backend, Arc::new(f));
    }

    /// The output types for `inputs`, from the shape function.
    pub fn infer(&self, attrs: &Attrs, inputs: &[TensorType]) -> Result<Vec<TensorType>> {
        self.signature.infer(attrs, inputs)
    }

    /// Runs the op on `inputs`: eagerly (the kernel of the inputs' backend),
    /// or recorded into the active trace. Outputs are connected to autograd
    /// when an input requires grad.
    #[track_caller]
    pub fn call(self: &Arc<Self>, attrs: Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let call = CustomCall {
            op: self.signature.clone(),
            attrs: Arc::new(attrs),
        };
        apply_op(self, &call, inputs, Location::caller())
    }

    /// Errors from the user's functions name this op.
    fn own(&self, e: Error) -> Error {
        self.signature.own(e)
    }

    fn kernel(&self, backend: Backend) -> Result<Arc<KernelFn>> {
        self.kernels
            .read()
            .expect("custom op kernels")
            .get(&backend)
            .cloned()
            .ok_or_else(|| {
                op_err!(
                    Unsupported,
                    self.name().to_string(),
                    "has no {} kernel registered",
                    backend.name()
                )
            })
    }

    /// Runs the kernel and checks its outputs against the shape function.
    fn run_kernel(
        &self,
        attrs: &Attrs,
        inputs: &[&Tensor],
        expected: &[TensorType],
    ) -> Result<Vec<Tensor>> {
        // The kernel of the inputs' device (host scalars go with any).
        let backend = match crate::runtime::device::of_inputs(self.name(), inputs)? {
            crate::runtime::device::Device::Cpu => Backend::Cpu,
            crate::runtime::device::Device::Cuda => Backend::Cuda,
        };
        let kernel = self.kernel(backend)?;
        let outputs = crate::runtime::cpu::alloc::catching(|| kernel(attrs, inputs))
            .and_then(|r| r)
            .map_err(|e| {
                let output = expected.iter().map(|t| t.to_string()).collect::<Vec<_>>();
                crate::runtime::cpu::in_kernel(e, self.name(), &output.join(", "))
            })
            .map_err(|e| self.own(e))?;
        if outputs.len() != expected.len() {
            return Err(op_err!(
                Verify,
                self.name().to_string(),
                "the kernel returned {} outputs but the shape function declares {}",
                outputs.len(),
                expected.len()
            ));
        }
        for (i, (t, ty)) in outputs.iter().zip(expected).enumerate() {
            if t.ty() != *ty {
                return Err(op_err!(
                    Verify,
                    self.name().to_string(),
                    "output {i}: the kernel produced {} but the shape function says {ty}",
                    t.ty()
                ));
            }
        }
        Ok(outputs)
    }
}

/// Runs (or records) `call` on `inputs`; every output, the first included.
/// The one place custom ops enter eager execution, tracing and autograd.
pub(crate) fn apply(
    call: &CustomCall,
    inputs: &[&Tensor],
    caller: &'static Location<'static>,
) -> Result<Vec<Tensor>> {
    let at = |e: Error| e.at(SourceLoc::from_location(caller));
    let op = lookup(call.name()).map_err(at)?;
    apply_op(&op, call, inputs, caller)
}

/// [`apply`] with the op's implementation at hand.
fn apply_op(
    op: &Arc<CustomOp>,
    call: &CustomCall,
    inputs: &[&Tensor],
    caller: &'static Location<'static>,
) -> Result<Vec<Tensor>> {
    let at = |e: Error| e.at(SourceLoc::from_location(caller));
    let types: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let expected = call.infer(&types).map_err(at)?;
    let outputs = if trace::is_active() {
        record(call, inputs, &expected, caller).map_err(at)?
    } else {
        if let Some(t) = inputs.iter().find(|t| t.is_traced()) {
            return Err(at(op_err!(
                Argument,
                call.name(),
                "input {} is a traced tensor used outside its trace",
                t.ty()
            )));
        }
        crate::error::dispatching(caller, || {
            tape::no_grad(|| op.run_kernel(&call.attrs, inputs, &expected))
        })
        .map_err(at)?
    };
    Ok(connect_autograd(op, call, inputs, outputs, caller))
}

/// Records the `custom` node and a `custom_output` node per further output.
fn record(
    call: &CustomCall,
    inputs: &[&Tensor],
    types: &[TensorType],
    caller: &'static Location<'static>,
) -> Result<Vec<Tensor>> {
    let first = trace::record(&Op::Custom(call.clone()), inputs, types[0].clone(), caller)?;
    let mut outputs = vec![first.clone()];
    for (index, ty) in types.iter().enumerate().skip(1) {
        let op = Op::CustomOutput {
            index,
            dtype: ty.dtype,
            shape: ty.shape.clone(),
        };
        outputs.push(trace::record(&op, &[&first], ty.clone(), caller)?);
    }
    Ok(outputs)
}

fn connect_autograd(
    op: &Arc<CustomOp>,
    call: &CustomCall,
    inputs: &[&Tensor],
    outputs: Vec<Tensor>,
    caller: &'static Location<'static>,
) -> Vec<Tensor> {
    let op = op.clone();
    let attrs = call.attrs.clone();
    let saved_inputs: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
    let saved_outputs: Vec<Tensor> = outputs.iter().map(|t| t.detach()).collect();
    let backward = move |grads: &[Tensor]| -> Result<Vec<Option<Tensor>>> {
        let Some(backward) = &op.backward else {
            return Err(Error::op(
                ErrorKind::Unsupported,
                op.name(),
                format!(
                    "Trying to backward through {} but no autograd formula was registered",
                    op.name()
                ),
            ));
        };
        let ctx = BackwardCtx {
            attrs: &attrs,
            inputs: &saved_inputs,
            outputs: &saved_outputs,
            grads,
        };
        backward(&ctx).map_err(|e| op.own(e))
    };
    tape::custom_function_at(call.name(), inputs, outputs, Arc::new(backward), caller)
}
