//! Custom ops: user-defined operations that eager mode, graph capture, AOT
//! autograd and the compiler carry like built-ins (PyTorch's
//! `torch.library.custom_op` with `register_fake` and `register_autograd`).
//!
//! A [`CustomOp`] has a name `ns::name`, a shape function run at trace time
//! (it sees only dtypes and possibly symbolic shapes), a kernel per backend
//! (`cpu` now; the `cuda` slot is filled by the CUDA backend), an optional
//! backward written with tensor ops (other custom ops included), and it may
//! return several outputs. Ops are built with [`CustomOp::builder`] and
//! registered in a process-wide registry so that the IR text form can name
//! them. The compiler treats a custom op as one opaque extern kernel.
//!
//! In the IR a call is one `custom` node whose value is the op's first
//! output; every further output that something reads is a `custom_output`
//! node whose only input is the `custom` node. The kernel writes all of
//! them at once (see `fusion::Kernel::Custom`).

pub mod flash_attention;

use std::collections::HashMap;
use std::fmt;
use std::panic::{Location, RefUnwindSafe};
use std::sync::{Arc, LazyLock, RwLock};

use crate::autograd;
use crate::error::{op_err, Error, ErrorKind, Result, SourceLoc};
use crate::ir::infer::TensorType;
use crate::ir::Op;
use crate::tensor::{trace, Tensor};

/// A custom op's attributes: a JSON object (ordered by key, so that equal
/// attributes print, hash and compare alike).
pub type Attrs = serde_json::Map<String, serde_json::Value>;

/// The shape function: input types → output types (may be symbolic).
pub type ShapeFn =
    dyn Fn(&Attrs, &[TensorType]) -> Result<Vec<TensorType>> + Send + Sync + RefUnwindSafe;

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

/// A registered custom op.
pub struct CustomOp {
    name: String,
    shape_fn: Arc<ShapeFn>,
    kernels: RwLock<HashMap<Backend, Arc<KernelFn>>>,
    backward: Option<Arc<CustomBackwardFn>>,
}

impl fmt::Debug for CustomOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CustomOp({})", self.name)
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

    /// Checks the op and adds it to the registry. A name already registered
    /// is an error (ops are looked up by name when graphs are parsed).
    pub fn register(self) -> Result<Arc<CustomOp>> {
        let op = self.build()?;
        let mut registry = REGISTRY.write().expect("custom op registry");
        if registry.contains_key(&op.name) {
            return Err(op_err!(
                Argument,
                op.name.clone(),
                "a custom op of this name is already registered"
            ));
        }
        registry.insert(op.name.clone(), op.clone());
        Ok(op)
    }

    fn build(self) -> Result<Arc<CustomOp>> {
        check_name(&self.name)?;
        let shape_fn = self.shape_fn.ok_or_else(|| {
            op_err!(
                Argument,
                self.name.clone(),
                "needs a shape function (`.shape(…)`)"
            )
        })?;
        if self.kernels.is_empty() {
            return Err(op_err!(
                Argument,
                self.name.clone(),
                "needs at least one kernel (`.cpu(…)`)"
            ));
        }
        Ok(Arc::new(CustomOp {
            name: self.name,
            shape_fn,
            kernels: RwLock::new(self.kernels),
            backward: self.backward,
        }))
    }
}

/// `ns::name`: two identifiers joined by `::`.
fn check_name(name: &str) -> Result<()> {
    let ident = |s: &str| {
        !s.is_empty()
            && !s.starts_with(|c: char| c.is_ascii_digit())
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    match name.split_once("::") {
        Some((ns, op)) if ident(ns) && ident(op) => Ok(()),
        _ => Err(op_err!(
            Argument,
            name,
            "a custom op's name must be `namespace::name` (identifiers), got {name:?}"
        )),
    }
}

static REGISTRY: LazyLock<RwLock<HashMap<String, Arc<CustomOp>>>> = LazyLock::new(|| {
    let builtins = flash_attention::builtins();
    RwLock::new(
        builtins
            .into_iter()
            .map(|op| (op.name.clone(), op))
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
        &self.name
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
        let types = (self.shape_fn)(attrs, inputs).map_err(|e| self.own(e))?;
        if types.is_empty() {
            return Err(op_err!(
                Verify,
                self.name.clone(),
                "the shape function returned no outputs"
            ));
        }
        for ty in &types {
            ty.check_size(&self.name)?;
        }
        Ok(types)
    }

    /// Runs the op on `inputs`: eagerly (the kernel of the inputs' backend),
    /// or recorded into the active trace. Outputs are connected to autograd
    /// when an input requires grad.
    #[track_caller]
    pub fn call(self: &Arc<Self>, attrs: Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let call = CustomCall {
            op: self.clone(),
            attrs: Arc::new(attrs),
        };
        apply(&call, inputs, Location::caller())
    }

    /// Errors from the user's functions name this op.
    fn own(&self, mut e: Error) -> Error {
        if e.op.is_none() {
            e.op = Some(self.name.clone());
        }
        e
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
                    self.name.clone(),
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
        let backend = match crate::runtime::device::of_inputs(&self.name, inputs)? {
            crate::runtime::device::Device::Cpu => Backend::Cpu,
            crate::runtime::device::Device::Cuda => Backend::Cuda,
        };
        let kernel = self.kernel(backend)?;
        let outputs = crate::runtime::cpu::alloc::catching(|| kernel(attrs, inputs))
            .and_then(|r| r)
            .map_err(|e| {
                let output = expected.iter().map(|t| t.to_string()).collect::<Vec<_>>();
                crate::runtime::cpu::in_kernel(e, &self.name, &output.join(", "))
            })
            .map_err(|e| self.own(e))?;
        if outputs.len() != expected.len() {
            return Err(op_err!(
                Verify,
                self.name.clone(),
                "the kernel returned {} outputs but the shape function declares {}",
                outputs.len(),
                expected.len()
            ));
        }
        for (i, (t, ty)) in outputs.iter().zip(expected).enumerate() {
            if t.ty() != *ty {
                return Err(op_err!(
                    Verify,
                    self.name.clone(),
                    "output {i}: the kernel produced {} but the shape function says {ty}",
                    t.ty()
                ));
            }
        }
        Ok(outputs)
    }
}

/// One call of a custom op with its attributes: the payload of `Op::Custom`.
/// Two calls are equal when they name the same op with equal attributes.
#[derive(Clone)]
pub struct CustomCall {
    pub op: Arc<CustomOp>,
    pub attrs: Arc<Attrs>,
}

impl CustomCall {
    pub fn name(&self) -> &str {
        &self.op.name
    }

    /// The attributes as compact JSON (the text form and cache keys use it).
    pub fn attrs_json(&self) -> String {
        serde_json::Value::Object((*self.attrs).clone()).to_string()
    }

    pub fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>> {
        self.op.infer(&self.attrs, inputs)
    }
}

impl PartialEq for CustomCall {
    fn eq(&self, other: &CustomCall) -> bool {
        self.op.name == other.op.name && self.attrs == other.attrs
    }
}

impl fmt::Debug for CustomCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.op.name, self.attrs_json())
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
        autograd::no_grad(|| call.op.run_kernel(&call.attrs, inputs, &expected)).map_err(at)?
    };
    Ok(connect_autograd(call, inputs, outputs, caller))
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
    call: &CustomCall,
    inputs: &[&Tensor],
    outputs: Vec<Tensor>,
    caller: &'static Location<'static>,
) -> Vec<Tensor> {
    let op = call.op.clone();
    let attrs = call.attrs.clone();
    let saved_inputs: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
    let saved_outputs: Vec<Tensor> = outputs.iter().map(|t| t.detach()).collect();
    let backward = move |grads: &[Tensor]| -> Result<Vec<Option<Tensor>>> {
        let Some(backward) = &op.backward else {
            return Err(Error::op(
                ErrorKind::Unsupported,
                op.name.clone(),
                format!(
                    "Trying to backward through {} but no autograd formula was registered",
                    op.name
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
    autograd::custom_function_at(call.name(), inputs, outputs, Arc::new(backward), caller)
}
