//! Tracing: running user code with tensors that record ops into a graph
//! instead of computing.
//!
//! While a trace is active on a thread, every op goes to the trace (see
//! `Tensor::apply`): inputs that are nodes of the trace are used as they are;
//! host tensors the code closes over (weights, constants made earlier) are
//! *lifted* into extra graph inputs, and handed back with the graph so the
//! caller can feed them. Autograd works during tracing exactly as eagerly,
//! which is how the ahead-of-time backward graph is built.

use std::cell::RefCell;
use std::collections::HashMap;
use std::panic::Location;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Data, Layout, Tensor};
use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::ir::{Graph, NodeId, NodeMeta, Op, TensorType};

/// A traced tensor's place: which trace, which node.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TracedValue {
    trace: u64,
    pub(crate) node: NodeId,
}

struct TraceState {
    id: u64,
    graph: Graph,
    /// Host tensors lifted into inputs, by tensor identity. The tensors are
    /// kept alive so that identities stay unique for the whole trace.
    lifted: Vec<(NodeId, Tensor)>,
    lifted_by_id: HashMap<usize, NodeId>,
}

thread_local! {
    static CURRENT: RefCell<Option<TraceState>> = const { RefCell::new(None) };
    static ORIGIN: RefCell<Option<NodeMeta>> = const { RefCell::new(None) };
}

/// Runs `f` with the ops it creates attributed to `origin` (its call site and
/// hints; not its name): a replayed graph node keeps the user's line, and the
/// backward ops of a forward op point at that op's line and inherit its hints.
pub fn with_origin<R>(origin: &NodeMeta, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<NodeMeta>);
    impl Drop for Restore {
        fn drop(&mut self) {
            ORIGIN.with(|o| *o.borrow_mut() = self.0.take());
        }
    }
    let meta = NodeMeta {
        name: None,
        location: origin.location.clone(),
        hints: origin.hints.clone(),
    };
    let _restore = Restore(ORIGIN.with(|o| o.borrow_mut().replace(meta)));
    f()
}

/// The metadata a new node gets: the origin in force, else the caller.
pub(crate) fn node_meta(caller: &'static Location<'static>) -> NodeMeta {
    ORIGIN
        .with(|o| o.borrow().clone())
        .unwrap_or_else(|| NodeMeta {
            location: Some(SourceLoc::from_location(caller)),
            ..NodeMeta::default()
        })
}

static NEXT_TRACE: AtomicU64 = AtomicU64::new(1);

/// What a trace produced: the graph (user inputs first, then lifted inputs
/// in `graph.inputs`) and the host tensors to feed to the lifted inputs.
pub struct Traced {
    pub graph: Graph,
    /// One per lifted input, in `graph.inputs` order after the user inputs.
    pub lifted: Vec<Tensor>,
}

pub(crate) fn is_active() -> bool {
    CURRENT.with(|c| c.borrow().is_some())
}

/// Resets the thread's trace even when the traced code panics.
struct ActiveTrace;

impl Drop for ActiveTrace {
    fn drop(&mut self) {
        CURRENT.with(|c| c.borrow_mut().take());
    }
}

/// Traces `f` on fresh traced inputs of the given names and types; `f`
/// returns the named outputs. Traces do not nest.
pub fn trace(
    name: &str,
    inputs: &[(String, TensorType)],
    f: impl FnOnce(&[Tensor]) -> Result<Vec<(String, Tensor)>>,
) -> Result<Traced> {
    if is_active() {
        return Err(Error::new(
            ErrorKind::Unsupported,
            "trace: traces do not nest",
        ));
    }
    let id = NEXT_TRACE.fetch_add(1, Ordering::Relaxed);
    let mut graph = Graph::new(name);
    let mut args = Vec::with_capacity(inputs.len());
    for (input_name, ty) in inputs {
        let node = graph.add_input(input_name.clone(), ty.clone());
        args.push(traced_tensor(id, node, ty)?);
    }
    CURRENT.with(|c| {
        *c.borrow_mut() = Some(TraceState {
            id,
            graph,
            lifted: Vec::new(),
            lifted_by_id: HashMap::new(),
        })
    });
    let guard = ActiveTrace;
    let outputs = f(&args)?;
    let mut outs = Vec::with_capacity(outputs.len());
    for (out_name, t) in &outputs {
        outs.push((out_name.clone(), node_of(t)?));
    }
    let mut state = CURRENT
        .with(|c| c.borrow_mut().take())
        .expect("trace state");
    drop(guard);
    for (out_name, node) in outs {
        state.graph.add_output(out_name, node);
    }
    Ok(Traced {
        graph: state.graph,
        lifted: state.lifted.into_iter().map(|(_, t)| t).collect(),
    })
}

fn traced_tensor(trace: u64, node: NodeId, ty: &TensorType) -> Result<Tensor> {
    let shape = ty.shape.as_concrete().ok_or_else(|| {
        Error::new(
            ErrorKind::Unsupported,
            format!(
                "trace: symbolic shape {} (tracing needs concrete shapes for now)",
                ty.shape
            ),
        )
    })?;
    Ok(Tensor::from_data(
        ty.dtype,
        Layout::contiguous(&shape),
        Data::Traced(TracedValue { trace, node }),
    ))
}

/// The node of `t` in the current trace, lifting a host tensor to an input.
fn node_of(t: &Tensor) -> Result<NodeId> {
    CURRENT.with(|c| {
        let mut guard = c.borrow_mut();
        let state = guard.as_mut().expect("a trace is active");
        match t.data() {
            Data::Traced(v) if v.trace == state.id => Ok(v.node),
            Data::Traced(_) => Err(Error::new(
                ErrorKind::Argument,
                format!(
                    "a tensor {} from another trace was used in this one",
                    t.ty()
                ),
            )),
            Data::Host(_) => Ok(lift(state, t)),
        }
    })
}

fn lift(state: &mut TraceState, t: &Tensor) -> NodeId {
    if let Some(&node) = state.lifted_by_id.get(&t.id()) {
        return node;
    }
    let name = format!("lifted{}", state.lifted.len());
    let node = state.graph.add_input(name, t.ty());
    state.lifted_by_id.insert(t.id(), node);
    state.lifted.push((node, t.clone()));
    node
}

/// Records `op(inputs)` (already type-checked: `ty`) in the current trace.
pub(crate) fn record(
    op: &Op,
    inputs: &[&Tensor],
    ty: TensorType,
    _shape: &[usize],
    caller: &'static Location<'static>,
) -> Result<Tensor> {
    let ids = inputs
        .iter()
        .map(|t| node_of(t))
        .collect::<Result<Vec<_>>>()?;
    CURRENT.with(|c| {
        let mut guard = c.borrow_mut();
        let state = guard.as_mut().expect("a trace is active");
        let node = state.graph.add(op.clone(), &ids, node_meta(caller))?;
        debug_assert_eq!(state.graph.node(node).ty, ty);
        traced_tensor(state.id, node, &ty)
    })
}
