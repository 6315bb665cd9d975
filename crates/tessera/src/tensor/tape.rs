//! The autograd tape: what eager ops record for a later backward.
//!
//! A tensor that takes part in autograd carries an [`AutogradMeta`]: the
//! gradient a leaf accumulates, or the [`GradNode`] that computed it. A
//! node is one recorded op (its saved inputs and output) or a custom
//! function with several outputs and its own backward (a compiled graph, a
//! custom op). Recording is data only: whether an op is recorded depends
//! on the op ([`Op::has_gradient`], the IR's table), the output's dtype, the
//! inputs and the grad mode ([`no_grad`]) — never on the VJP rules, which
//! the engine (`autograd`, the layer above) applies at backward time.

use std::cell::Cell;
use std::panic::Location;
use std::sync::{Arc, Mutex};
use std::thread::LocalKey;

use super::recompute::{Recompute, Replays};
use super::{offload, trace, Tensor};
use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::ir::{DType, NodeMeta, Op};
use crate::runtime::array::Array;
use crate::runtime::cpu::Storage;
use crate::runtime::device::{self, Device};

/// Autograd state of a tensor that requires grad.
pub(crate) struct AutogradMeta {
    /// The accumulated gradient of a leaf.
    pub(crate) grad: Mutex<Option<Tensor>>,
    /// The node that computed this tensor and which of its outputs it is;
    /// `None` for a leaf.
    pub(crate) grad_fn: Option<(Arc<GradNode>, usize)>,
}

/// A backward function for [`custom_function`]: output gradients (zeros
/// where an output got none) → one optional gradient per input.
pub type BackwardFn =
    dyn Fn(&[Tensor]) -> Result<Vec<Option<Tensor>>> + Send + Sync + std::panic::RefUnwindSafe;

/// How a node's input gradients are computed from its output gradients.
pub(crate) enum Backward {
    /// One IR op, differentiated by its VJP rule.
    Op(Op),
    /// A custom function's own backward ([`Saved::function`]).
    Custom { name: String },
}

/// What a node's backward reads. A `backward` that does not retain the
/// graph releases it node by node as it goes ([`GradNode::release`]), as
/// PyTorch frees saved tensors: the values stay alive no longer than the
/// backward needs them, even while the user still holds the graph's
/// output.
#[derive(Clone)]
pub(crate) struct Saved {
    /// The inputs, as the backward sees them: the values it reads, else
    /// stand-ins (see [`saved`]) that keep the autograd edge.
    pub(crate) inputs: Vec<Tensor>,
    /// An op node's output, kept detached (no reference cycle); a
    /// stand-in where the rule does not read it. `None` for a custom node.
    pub(crate) output: Option<Tensor>,
    /// A custom node's backward (which holds what it reads); `None` for an
    /// op node and once released.
    pub(crate) function: Option<Arc<BackwardFn>>,
}

/// One recorded computation.
pub(crate) struct GradNode {
    pub(crate) backward: Backward,
    saved: Mutex<Saved>,
    /// Shapes and dtypes of the outputs, to make zero gradients.
    pub(crate) outputs: Vec<(Vec<usize>, DType)>,
    /// The forward op's call site and hints, as its backward ops inherit
    /// them (see `backward_origin`).
    pub(crate) origin: NodeMeta,
    /// Where a `backward` that did not retain the graph went through this
    /// node: a second one through it is an error (see `Tensor::backward`).
    pub(crate) used_by: Mutex<Option<SourceLoc>>,
    /// Which saved values wait in host memory (an op of an offload region).
    pub(crate) moved: Option<Moved>,
    /// Which inputs the backward recomputes instead of keeping (an op of a
    /// recompute region).
    pub(crate) recompute: Option<Recompute>,
}

/// The saved values of a node that wait in host memory, and the device
/// they come back to.
pub(crate) struct Moved {
    device: Device,
    /// Per input: in host memory.
    inputs: Vec<bool>,
    output: bool,
}

impl GradNode {
    /// A stable identity for this node.
    pub(crate) fn id(&self) -> usize {
        self as *const Self as usize
    }

    /// `saved`'s inputs and `output` (an op node's) as its rule reads
    /// them, on its device: those waiting in host memory are copied back
    /// (see [`Moved`]), those of a recompute region that the node does not
    /// keep are recomputed (`replays`, see [`Recompute`]); the others, which
    /// the rule does not read, stay stand-ins.
    pub(crate) fn saved_values(
        &self,
        saved: &Saved,
        output: &Tensor,
        replays: &mut Replays,
    ) -> Result<(Vec<Tensor>, Tensor)> {
        let inputs = (0..saved.inputs.len())
            .map(|i| match &self.recompute {
                Some(r) if r.recomputes_input(i) => {
                    // With the input's autograd state: a rule asks which
                    // inputs want a gradient.
                    let edge = &saved.inputs[i];
                    let values = replays.output(&edge.grad_fn().expect("an edge").0)?;
                    Ok(edge.with_values(values.array().clone()))
                }
                _ => replays.kept_input(self, saved, i),
            })
            .collect::<Result<Vec<_>>>()?;
        let output = match (&self.recompute, &self.moved) {
            (Some(r), _) => replays
                .take_output(self, r.recomputes_output())?
                .unwrap_or_else(|| output.clone()),
            (_, Some(moved)) if moved.output => offload::to_device(output, moved.device)?,
            _ => output.clone(),
        };
        Ok((inputs, output))
    }

    /// Whether input `i` waits in host memory.
    pub(crate) fn in_host_memory(&self, i: usize) -> bool {
        self.moved.as_ref().is_some_and(|m| m.inputs[i])
    }

    /// Input `i` as the node keeps it, on its device (copied back when it
    /// waits in host memory).
    pub(crate) fn kept_input(&self, saved: &Saved, i: usize) -> Result<Tensor> {
        match &self.moved {
            Some(moved) if moved.inputs[i] => offload::to_device(&saved.inputs[i], moved.device),
            _ => Ok(saved.inputs[i].clone()),
        }
    }

    /// The op's name, or the custom function's.
    pub(crate) fn name(&self) -> &str {
        match &self.backward {
            Backward::Op(op) => op.name(),
            Backward::Custom { name } => name,
        }
    }

    /// What the backward reads (handles: the values stay shared).
    pub(crate) fn saved(&self) -> Saved {
        self.saved.lock().expect("saved lock").clone()
    }

    /// The inputs as autograd edges (values or stand-ins).
    pub(crate) fn inputs(&self) -> Vec<Tensor> {
        self.saved.lock().expect("saved lock").inputs.clone()
    }

    /// Drops the values the backward reads (its inputs and output become
    /// stand-ins that keep the edges, a custom backward is dropped with
    /// what it holds), once a backward that does not retain the graph has
    /// gone through this node, which `used_by` then names (so a later
    /// backward through it is the usual error, never a run on stand-ins).
    pub(crate) fn release(&self, by: &SourceLoc) {
        *self.used_by.lock().expect("used_by lock") = Some(by.clone());
        let mut saved = self.saved.lock().expect("saved lock");
        for t in &mut saved.inputs {
            *t = kept(t, false);
        }
        if let Some(out) = &mut saved.output {
            *out = kept(out, false);
        }
        saved.function = None;
    }
}

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
    static CONSUMING: Cell<bool> = const { Cell::new(false) };
}

/// Whether the backward running on this thread is the last one through
/// its nodes (a `backward` that does not retain the graph): a custom
/// backward may then hand the values it holds over to its computation,
/// which frees each once read, instead of keeping them for another
/// backward (a compiled function's saved activations).
pub fn backward_consumes() -> bool {
    CONSUMING.with(Cell::get)
}

/// Runs `f` (a backward) with [`backward_consumes`] `on`.
pub(crate) fn consuming<R>(on: bool, f: impl FnOnce() -> R) -> R {
    with_flag(&CONSUMING, on, f)
}

/// Whether ops record for autograd on this thread.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(Cell::get)
}

/// Runs `f` with autograd recording off (like `torch.no_grad()`).
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    with_grad_mode(false, f)
}

/// Runs `f` with autograd recording on (like `torch.enable_grad()`), also
/// inside a [`no_grad`] region: e.g. the gradients a compiled training
/// step takes inside its trace, which compile's capture runs under
/// `no_grad`.
pub fn enable_grad<R>(f: impl FnOnce() -> R) -> R {
    with_grad_mode(true, f)
}

/// Runs `f` with the grad mode `on`, restoring the caller's after (also
/// when `f` panics).
fn with_grad_mode<R>(on: bool, f: impl FnOnce() -> R) -> R {
    with_flag(&GRAD_ENABLED, on, f)
}

/// Runs `f` with the thread's `flag` set to `on`, restoring the caller's
/// value after (also when `f` panics).
fn with_flag<R>(flag: &'static LocalKey<Cell<bool>>, on: bool, f: impl FnOnce() -> R) -> R {
    struct Restore(&'static LocalKey<Cell<bool>>, bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            self.0.with(|g| g.set(self.1));
        }
    }
    let _restore = Restore(flag, flag.with(|g| g.replace(on)));
    f()
}

/// Whether a node recording `inputs` → outputs of `dtypes` is worth keeping.
fn tracks(inputs: &[&Tensor], any_float_output: bool) -> bool {
    is_grad_enabled() && any_float_output && inputs.iter().any(|t| t.requires_grad())
}

/// Hangs the op's node on `out` when an input requires grad. The node
/// keeps what its rule reads ([`Op::backward_reads`]); inside a region
/// that recomputes ([`Recompute`]) it keeps instead what the region did
/// not make, and the backward recomputes the rest. Inside a region hinted
/// `{"offload": true}` what it keeps waits in host memory (see
/// [`offloaded`]).
pub(crate) fn record(
    op: &Op,
    inputs: &[&Tensor],
    out: Tensor,
    caller: &'static Location<'static>,
) -> Result<Tensor> {
    if !op.has_gradient() || !out.dtype().is_float() {
        // Remember the cut, so a later `backward` can name the op.
        return Ok(
            match inputs.iter().any(|t| t.requires_grad()) && is_grad_enabled() {
                true => out.cut_by(op.name()),
                false => inherit_cut(inputs, out),
            },
        );
    }
    if !tracks(inputs, true) {
        say_nothing_saved();
        return Ok(inherit_cut(inputs, out));
    }
    let meta = trace::node_meta(caller);
    let needs: Vec<bool> = inputs.iter().map(|t| t.requires_grad()).collect();
    let reads = op.backward_reads(&needs);
    let recompute = Recompute::of(meta.hints.as_ref(), inputs, &reads, &out);
    let origin = backward_origin(meta);
    let (keep, keep_output) = match &recompute {
        Some(r) => (r.keeps(), false),
        None => (reads.inputs, reads.output),
    };
    let mut held: Vec<Tensor> = inputs
        .iter()
        .zip(&keep)
        .map(|(&t, &k)| kept(t, k))
        .collect();
    let mut output = kept(&out, keep_output);
    let moved = match offloads(&origin) && !out.is_traced() {
        true => Some(offloaded(&keep, keep_output, &mut held, &mut output)?),
        false => None,
    };
    let node = Arc::new(GradNode {
        backward: Backward::Op(op.clone()),
        saved: Mutex::new(Saved {
            inputs: held,
            output: Some(output),
            function: None,
        }),
        outputs: vec![(out.shape().to_vec(), out.dtype())],
        origin,
        used_by: Mutex::new(None),
        moved,
        recompute,
    });
    Ok(attach(&out, &node, 0))
}

/// Whether ops attributed to `origin` keep their saved values in host memory.
fn offloads(origin: &NodeMeta) -> bool {
    origin
        .hints
        .as_ref()
        .is_some_and(|h| h.get("offload") == Some(&serde_json::Value::Bool(true)))
}

/// An op of a plain eager region that offloads or recomputes (not a
/// replayed graph's node, not a backward op: their runners report their
/// own) that records nothing has nothing to move or recompute: said once
/// per region (`TESSERA_LOGS=hints`) for each such key the region sets.
fn say_nothing_saved() {
    if trace::has_origin() || trace::is_active() {
        return;
    }
    let Some(region) = crate::hints::current() else {
        return;
    };
    for (key, what) in [
        ("offload", "move to host memory"),
        ("recompute", "recompute"),
    ] {
        if region.get(key) == Some(&serde_json::Value::Bool(true)) {
            crate::hints::not_honoured(
                "eager",
                &region,
                key,
                &format!(
                    "ops of the region that record nothing for a backward (grad mode off, or \
                     no input requires grad) save nothing to {what}"
                ),
            );
        }
    }
}

/// Moves the values a node keeps (`keep`, `keep_output`; the others are
/// already stand-ins without storage) to host memory, except leaves that
/// require grad (parameters, which stay on the device for the optimizer
/// anyway: a copy would free nothing). Returns which are in host memory.
fn offloaded(
    keep: &[bool],
    keep_output: bool,
    inputs: &mut [Tensor],
    output: &mut Tensor,
) -> Result<Moved> {
    let on = output.device();
    let mut host = vec![false; inputs.len()];
    for (i, t) in inputs.iter_mut().enumerate() {
        if keep[i] && !(t.is_leaf() && t.requires_grad()) && t.device() == on {
            *t = offload::to_host(t, on)?;
            host[i] = true;
        }
    }
    if keep_output {
        *output = offload::to_host(output, on)?;
    }
    Ok(Moved {
        device: on,
        inputs: host,
        output: keep_output,
    })
}

/// What a node keeps of `t`: `t` itself when its backward reads the
/// values (`read`), else a stand-in with `t`'s shape, dtype, device and
/// autograd edge but no storage of its own — a NaN broadcast from one
/// element, so that a rule reading it by mistake gives NaN gradients, not
/// plausible ones. Dropping the values is what lets eager training free
/// activations as PyTorch does (a node used to keep every input and its
/// output alive until the backward). Traced tensors have no values to keep
/// and stay as they are.
fn kept(t: &Tensor, read: bool) -> Tensor {
    if read || t.is_traced() || trace::is_active() || t.numel() <= 1 {
        return t.clone();
    }
    match stand_in_values(t) {
        Some(values) => Tensor::from_array(values).with_autograd(t.autograd_meta().cloned()),
        None => t.clone(),
    }
}

/// `t`'s shape over one NaN of its dtype on its device (cached per thread,
/// device and dtype: one element each, made once).
fn stand_in_values(t: &Tensor) -> Option<Array> {
    thread_local! {
        static SCALARS: std::cell::RefCell<Vec<Tensor>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let (device, dtype) = (t.device(), t.dtype());
    let scalar = SCALARS.with(|cache| {
        let found = cache
            .borrow()
            .iter()
            .find(|s| s.device() == device && s.dtype() == dtype)
            .cloned();
        found.or_else(|| {
            // Made by the CPU's kernel directly, not by a tensor op: it is
            // not an op of the user's region (hint reports, the tape).
            let nan = Array::from_storage(Storage::try_from_slice(&[f64::NAN]).ok()?, &[]);
            let one = device::eval(Device::Cpu, &Op::Cast(dtype), &[&nan], dtype, &[]).ok()?;
            let made = Tensor::from_array(one).to(device).ok()?;
            cache.borrow_mut().push(made.clone());
            Some(made)
        })
    })?;
    let layout = crate::tensor::Layout {
        shape: t.shape().to_vec(),
        strides: vec![0; t.rank()],
        offset: 0,
    };
    Some(scalar.try_array()?.view(layout))
}

/// A result of a cut tensor stays cut (by the same op).
fn inherit_cut(inputs: &[&Tensor], out: Tensor) -> Tensor {
    match inputs.iter().find_map(|t| t.cut_op()) {
        Some(op) => out.cut_by(op),
        None => out,
    }
}

/// What a node's backward ops inherit: the forward op's metadata (call
/// site and hints, `trace::node_meta`), with the hints'
/// `backward_group_id` as their `group_id` (the one place backward hints
/// are derived; see `hints::for_backward`).
fn backward_origin(mut meta: NodeMeta) -> NodeMeta {
    meta.hints = crate::hints::for_backward(meta.hints);
    meta
}

fn attach(out: &Tensor, node: &Arc<GradNode>, index: usize) -> Tensor {
    out.with_autograd(Some(Arc::new(AutogradMeta {
        grad: Mutex::new(None),
        grad_fn: Some((node.clone(), index)),
    })))
}

/// Connects `outputs` (computed from `inputs` without recording, e.g. by a
/// compiled graph or a custom kernel) to the autograd graph with one node
/// whose gradient is `backward`. Returns the outputs as tensors that carry
/// it (unchanged when no input requires grad or grad mode is off).
#[track_caller]
pub fn custom_function(
    name: &str,
    inputs: &[&Tensor],
    outputs: Vec<Tensor>,
    backward: Arc<BackwardFn>,
) -> Vec<Tensor> {
    custom_function_at(name, inputs, outputs, backward, Location::caller())
}

/// [`custom_function`] with the forward's call site given.
pub fn custom_function_at(
    name: &str,
    inputs: &[&Tensor],
    outputs: Vec<Tensor>,
    backward: Arc<BackwardFn>,
    caller: &'static Location<'static>,
) -> Vec<Tensor> {
    if !tracks(inputs, outputs.iter().any(|t| t.dtype().is_float())) {
        return outputs;
    }
    let node = Arc::new(GradNode {
        backward: Backward::Custom {
            name: name.to_string(),
        },
        saved: Mutex::new(Saved {
            // The backward closure holds what it reads: the inputs are edges.
            inputs: inputs.iter().map(|&t| kept(t, false)).collect(),
            output: None,
            function: Some(backward),
        }),
        outputs: outputs
            .iter()
            .map(|t| (t.shape().to_vec(), t.dtype()))
            .collect(),
        origin: backward_origin(trace::node_meta(caller)),
        used_by: Mutex::new(None),
        moved: None,
        recompute: None,
    });
    outputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if t.dtype().is_float() {
                attach(&t.detach(), &node, i)
            } else {
                t.clone()
            }
        })
        .collect()
}

impl Tensor {
    /// Whether gradients flow to this tensor.
    pub fn requires_grad(&self) -> bool {
        self.autograd_meta().is_some()
    }

    /// A new leaf handle over the same values that requires grad (`true`) or
    /// not (`false`). Gradients accumulate on the returned handle and its
    /// clones.
    #[track_caller]
    pub fn set_requires_grad(&self, requires: bool) -> Tensor {
        if requires && !self.dtype().is_float() {
            panic!(
                "{}",
                Error::op(
                    ErrorKind::DType,
                    "requires_grad",
                    format!("only float tensors can require grad, got {}", self.ty())
                )
                .at(SourceLoc::caller())
            );
        }
        let meta = requires.then(|| {
            Arc::new(AutogradMeta {
                grad: Mutex::new(None),
                grad_fn: None,
            })
        });
        self.with_autograd(meta)
    }

    /// The same values, cut from the autograd graph.
    pub fn detach(&self) -> Tensor {
        self.with_autograd(None)
    }

    /// A leaf: not computed by a recorded op.
    pub fn is_leaf(&self) -> bool {
        self.autograd_meta().is_none_or(|m| m.grad_fn.is_none())
    }

    /// The gradient accumulated in this leaf by `backward` calls.
    pub fn grad(&self) -> Option<Tensor> {
        self.autograd_meta()
            .and_then(|m| m.grad.lock().expect("grad lock").clone())
    }

    /// Replaces the accumulated gradient of this leaf (like assigning
    /// `p.grad` in PyTorch; gradient clipping needs it). The gradient must
    /// have this tensor's type.
    pub fn set_grad(&self, grad: Option<Tensor>) -> Result<()> {
        let meta = self
            .autograd_meta()
            .filter(|_| self.is_leaf())
            .ok_or_else(|| {
                Error::op(
                    ErrorKind::Argument,
                    "set_grad",
                    format!("{} is not a leaf that requires grad", self.ty()),
                )
            })?;
        if let Some(g) = grad.as_ref().filter(|g| g.ty() != self.ty()) {
            return Err(Error::op(
                ErrorKind::Shape,
                "set_grad",
                format!(
                    "the gradient {} does not match the tensor {}",
                    g.ty(),
                    self.ty()
                ),
            ));
        }
        *meta.grad.lock().expect("grad lock") = grad.map(|g| g.detach());
        Ok(())
    }

    /// Clears the accumulated gradient.
    pub fn zero_grad(&self) {
        if let Some(m) = self.autograd_meta() {
            *m.grad.lock().expect("grad lock") = None;
        }
    }

    /// The node that computed this tensor and which of its outputs it is;
    /// `None` for a leaf or a tensor outside autograd.
    pub(crate) fn grad_fn(&self) -> Option<&(Arc<GradNode>, usize)> {
        self.autograd_meta().and_then(|m| m.grad_fn.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::UnaryOp;

    fn leaf() -> Tensor {
        Tensor::from_vec(vec![1.0f32, 2.0], &[2]).set_requires_grad(true)
    }

    /// A node keeps the values its backward reads (exp's: its output;
    /// log's: its input) and, for the others, a stand-in of the same
    /// shape that still leads to the input's autograd state.
    #[test]
    fn an_op_on_a_leaf_records_what_its_backward_reads() {
        let x = leaf();
        let y = x.exp();
        let (node, index) = y.grad_fn().expect("recorded");
        assert_eq!((node.name(), *index), ("exp", 0));
        let saved = node.saved();
        assert_eq!(saved.inputs.len(), 1);
        let edge = &saved.inputs[0];
        assert!(!edge.shares_storage(&x) && edge.shape() == x.shape());
        let same_state = |a: &Tensor, b: &Tensor| {
            Arc::ptr_eq(a.autograd_meta().unwrap(), b.autograd_meta().unwrap())
        };
        assert!(same_state(edge, &x));
        assert_eq!(node.outputs, [(vec![2], DType::F32)]);
        match &node.backward {
            Backward::Op(op) => assert_eq!(*op, Op::Unary(UnaryOp::Exp)),
            Backward::Custom { .. } => panic!("an op node"),
        }
        let output = saved.output.expect("an op node keeps its output");
        assert!(output.shares_storage(&y) && output.grad_fn().is_none());
        assert!(x.is_leaf() && !y.is_leaf() && y.requires_grad());
        let z = x.log();
        let (node, _) = z.grad_fn().expect("recorded");
        let saved = node.saved();
        assert!(saved.inputs[0].shares_storage(&x) && same_state(&saved.inputs[0], &x));
        let output = saved.output.expect("an op node keeps its output");
        assert!(!output.shares_storage(&z) && output.shape() == z.shape());
        // Released, the node keeps its edges but none of the values.
        node.release(&SourceLoc::caller());
        let saved = node.saved();
        assert!(!saved.inputs[0].shares_storage(&x) && same_state(&saved.inputs[0], &x));
        assert!(saved.inputs[0].shape() == x.shape());
        assert!(node.used_by.lock().unwrap().is_some());
    }

    #[test]
    fn nothing_is_recorded_without_grad_or_under_no_grad() {
        let plain = Tensor::from_vec(vec![1.0f32], &[1]);
        assert!(plain.exp().grad_fn().is_none() && !plain.exp().requires_grad());
        let x = leaf();
        assert!(is_grad_enabled());
        assert!(no_grad(|| x.exp()).grad_fn().is_none());
        assert!(!no_grad(is_grad_enabled) && is_grad_enabled());
        assert!(x.detach().grad_fn().is_none() && !x.detach().requires_grad());
    }

    #[test]
    fn enable_grad_records_inside_no_grad_and_restores_the_mode() {
        let x = leaf();
        let y = no_grad(|| enable_grad(|| x.exp()));
        assert!(y.grad_fn().is_some());
        assert!(no_grad(|| {
            enable_grad(|| assert!(is_grad_enabled()));
            !is_grad_enabled()
        }));
        let caught = std::panic::catch_unwind(|| no_grad(|| enable_grad(|| panic!("inside"))));
        assert!(caught.is_err() && is_grad_enabled(), "restored on unwind");
    }

    #[test]
    fn an_op_without_a_gradient_cuts_and_its_results_stay_cut() {
        let x = leaf();
        let flag = x.try_gt(1.5).unwrap();
        assert_eq!(flag.cut_op(), Some("gt"));
        let n = flag.cast(DType::F32);
        assert_eq!(n.cut_op(), Some("gt"));
        assert!(!n.requires_grad());
    }

    #[test]
    fn set_grad_checks_the_leaf_and_the_type() {
        let x = leaf();
        x.set_grad(Some(Tensor::ones(&[2], DType::F32))).unwrap();
        assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), [1.0, 1.0]);
        let err = x
            .set_grad(Some(Tensor::ones(&[3], DType::F32)))
            .unwrap_err();
        assert!(err.to_string().contains("does not match"), "{err}");
        let err = x.exp().set_grad(None).unwrap_err();
        assert!(err.to_string().contains("not a leaf"), "{err}");
        x.zero_grad();
        assert!(x.grad().is_none());
    }
}
