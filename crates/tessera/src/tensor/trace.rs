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
use std::sync::Arc;

use super::{interpret, Data, Layout, Tensor};
use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::ir::extract::extract;
use crate::ir::{Graph, Node, NodeId, NodeMeta, Op, TensorType};

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
    /// Values of nodes known during the trace (inputs given with values,
    /// lifted tensors, values read at graph breaks); `None`: a pure trace,
    /// where reading a value is an error.
    known: Option<HashMap<NodeId, Tensor>>,
    /// Where the traced code read a value (a graph break), in order.
    breaks: Vec<SourceLoc>,
    /// Whether the caller writes module state back ([`write_state`]):
    /// only a compiled function's capture does.
    accepts_state: bool,
    /// Module state written by the traced code, in order of first write:
    /// the slot's key, the slot, its latest values.
    state: Vec<(usize, Arc<dyn StateSlot>, Vec<Tensor>)>,
}

/// Module state that a traced function updates (a batch norm's running
/// statistics): the new values are extra outputs of the traced graph, and
/// whoever runs the graph hands them to the slot ([`StateWrite`]).
pub trait StateSlot: Send + Sync {
    /// Installs the values a run of the graph computed.
    fn install(&self, values: Vec<Tensor>);
    /// What the slot holds, for messages.
    fn describe(&self) -> String;
}

/// A slot written by a traced function: its values are `count` graph
/// outputs, after the function's own outputs and the slots before it.
#[derive(Clone)]
pub struct StateWrite {
    pub slot: Arc<dyn StateSlot>,
    pub count: usize,
}

impl std::fmt::Debug for StateWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({} values)", self.slot.describe(), self.count)
    }
}

/// Whether the active trace writes module state back (a compiled
/// function's capture); false outside a trace.
pub fn accepts_state() -> bool {
    CURRENT.with(|c| c.borrow().as_ref().is_some_and(|s| s.accepts_state))
}

/// The values written to the slot `key` earlier in the active trace, if
/// any: what a second use of the same module in one traced call reads.
pub fn state_written(key: usize) -> Option<Vec<Tensor>> {
    CURRENT.with(|c| {
        c.borrow().as_ref().and_then(|s| {
            s.state
                .iter()
                .find(|(k, _, _)| *k == key)
                .map(|(_, _, v)| v.clone())
        })
    })
}

/// Records that the traced code writes `values` to module state `slot`
/// (identified by `key`, e.g. its address): they become outputs of the
/// graph, installed in the slot after each run. A later write to the same
/// key replaces the values. An error outside a trace that accepts state
/// ([`accepts_state`]).
pub fn write_state(key: usize, slot: Arc<dyn StateSlot>, values: Vec<Tensor>) -> Result<()> {
    CURRENT.with(|c| {
        let mut guard = c.borrow_mut();
        match guard.as_mut() {
            Some(s) if s.accepts_state => {
                match s.state.iter_mut().find(|(k, _, _)| *k == key) {
                    Some(entry) => entry.2 = values,
                    None => s.state.push((key, slot, values)),
                }
                Ok(())
            }
            _ => Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{} is written by traced code, but this trace cannot write it back \
                     (only a compiled function's capture can)",
                    slot.describe()
                ),
            )),
        }
    })
}

thread_local! {
    static CURRENT: RefCell<Option<TraceState>> = const { RefCell::new(None) };
    static ORIGIN: RefCell<Option<NodeMeta>> = const { RefCell::new(None) };
}

/// The origin ops are attributed to now ([`with_origin`]), if any.
pub(crate) fn current_origin() -> Option<NodeMeta> {
    ORIGIN.with(|o| o.borrow().clone())
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

/// Whether ops are attributed to an origin now (a replayed graph node, a
/// backward op), rather than to the caller and the open `hints::scope`s.
pub(crate) fn has_origin() -> bool {
    ORIGIN.with(|o| o.borrow().is_some())
}

/// The metadata a new node gets: the origin in force (with its own hints),
/// else the caller with the hints of the open `hints::scope`s.
pub(crate) fn node_meta(caller: &'static Location<'static>) -> NodeMeta {
    ORIGIN
        .with(|o| o.borrow().clone())
        .unwrap_or_else(|| NodeMeta {
            name: None,
            location: Some(SourceLoc::from_static(caller)),
            hints: crate::hints::current(),
        })
}

static NEXT_TRACE: AtomicU64 = AtomicU64::new(1);

/// What a trace produced: the graph (user inputs first, then lifted inputs
/// in `graph.inputs`) and the host tensors to feed to the lifted inputs.
pub struct Traced {
    pub graph: Graph,
    /// One per lifted input, in `graph.inputs` order after the user inputs.
    pub lifted: Vec<Tensor>,
    /// Nodes whose values the traced code read (graph breaks), with the
    /// values computed then; empty for a pure trace.
    pub materialized: Vec<(NodeId, Tensor)>,
    /// The call sites of those reads.
    pub breaks: Vec<SourceLoc>,
    /// The seeds the traced code drew from generators, in order: what an
    /// eager run of the same call must take instead of drawing again
    /// ([`super::creation::replay_seeds`]).
    pub seeds: Vec<u64>,
    /// Module state the traced code wrote: the graph's last outputs, in
    /// this order.
    pub state: Vec<StateWrite>,
}

impl Traced {
    /// How many of the graph's outputs (the last ones) are state values.
    pub fn num_state_outputs(&self) -> usize {
        self.state.iter().map(|w| w.count).sum()
    }
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
/// returns the named outputs. Reading a traced value is an error. Traces do
/// not nest.
pub fn trace(
    name: &str,
    inputs: &[(String, TensorType)],
    f: impl FnOnce(&[Tensor]) -> Result<Vec<(String, Tensor)>>,
) -> Result<Traced> {
    trace_core(name, inputs, None, false, f)
}

/// Like [`trace`], with the inputs' values known: where the traced code
/// reads a value (`item()`, `to_vec()`), the graph so far is run to produce
/// it and tracing goes on — a graph break, recorded in [`Traced::breaks`].
/// Module state the code writes ([`write_state`]) becomes outputs after
/// `f`'s ([`Traced::state`]): the caller installs them after each run.
pub fn trace_with_values(
    name: &str,
    inputs: &[(String, Tensor)],
    f: impl FnOnce(&[Tensor]) -> Result<Vec<(String, Tensor)>>,
) -> Result<Traced> {
    let types: Vec<(String, TensorType)> =
        inputs.iter().map(|(n, t)| (n.clone(), t.ty())).collect();
    let values: Vec<Tensor> = inputs.iter().map(|(_, t)| t.detach()).collect();
    trace_core(name, &types, Some(values), true, f)
}

fn trace_core(
    name: &str,
    inputs: &[(String, TensorType)],
    values: Option<Vec<Tensor>>,
    accepts_state: bool,
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
    let known = values.map(|v| graph.inputs.iter().copied().zip(v).collect());
    CURRENT.with(|c| {
        *c.borrow_mut() = Some(TraceState {
            id,
            graph,
            lifted: Vec::new(),
            lifted_by_id: HashMap::new(),
            known,
            breaks: Vec::new(),
            accepts_state,
            state: Vec::new(),
        })
    });
    let guard = ActiveTrace;
    let (outputs, seeds) = super::creation::record_seeds(|| f(&args));
    let outputs = outputs?;
    let mut outs = Vec::with_capacity(outputs.len());
    for (out_name, t) in &outputs {
        outs.push((out_name.clone(), node_of(t)?));
    }
    let written =
        CURRENT.with(|c| std::mem::take(&mut c.borrow_mut().as_mut().expect("trace state").state));
    let mut writes = Vec::with_capacity(written.len());
    for (i, (_, slot, values)) in written.into_iter().enumerate() {
        for (j, t) in values.iter().enumerate() {
            outs.push((format!("state{i}_{j}"), node_of(t)?));
        }
        writes.push(StateWrite {
            slot,
            count: values.len(),
        });
    }
    let mut state = CURRENT
        .with(|c| c.borrow_mut().take())
        .expect("trace state");
    drop(guard);
    for (out_name, node) in outs {
        state.graph.add_output(out_name, node);
    }
    let lifted_ids: std::collections::HashSet<NodeId> =
        state.lifted.iter().map(|(n, _)| *n).collect();
    let mut materialized: Vec<(NodeId, Tensor)> = state
        .known
        .unwrap_or_default()
        .into_iter()
        .filter(|(n, _)| !matches!(state.graph.node(*n).op, Op::Input) && !lifted_ids.contains(n))
        .collect();
    materialized.sort_by_key(|(n, _)| *n);
    Ok(Traced {
        graph: state.graph,
        lifted: state.lifted.into_iter().map(|(_, t)| t).collect(),
        materialized,
        breaks: state.breaks,
        seeds,
        state: writes,
    })
}

/// The value of traced tensor `t`, for a data read at `caller` (a graph
/// break): the nodes it depends on are run with the values known so far.
pub(crate) fn materialize(t: &Tensor, what: &str, caller: SourceLoc) -> Result<Tensor> {
    let node = node_of(t)?;
    // Suspend the trace: the partial graph runs eagerly, recording nothing.
    let mut state = CURRENT
        .with(|c| c.borrow_mut().take())
        .expect("a trace is active");
    let result = super::tape::no_grad(|| read_node(&mut state, node, t, what, caller));
    CURRENT.with(|c| *c.borrow_mut() = Some(state));
    result
}

fn read_node(
    state: &mut TraceState,
    node: NodeId,
    t: &Tensor,
    what: &str,
    caller: SourceLoc,
) -> Result<Tensor> {
    let Some(known) = state.known.as_mut() else {
        return Err(Error::op(
            ErrorKind::Unsupported,
            what,
            format!(
                "cannot read the values of {} while tracing: it is a graph node, not data",
                t.ty()
            ),
        )
        .at(caller));
    };
    if let Some(v) = known.get(&node) {
        return Ok(v.clone());
    }
    let boundary: Vec<(String, NodeId)> = known.keys().map(|n| (format!("v{}", n.0), *n)).collect();
    let part = extract(
        &state.graph,
        "graph_break",
        &boundary,
        &[("value".into(), node)],
    )?;
    // `extract` takes every boundary value as an input, in boundary order.
    let feed: Vec<Tensor> = boundary.iter().map(|(_, n)| known[n].clone()).collect();
    let value = interpret::run_graph(&part, &feed)?.remove(0).1;
    known.insert(node, value.clone());
    state.breaks.push(caller);
    Ok(value)
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
    let layout = Layout {
        strides: super::layout::contiguous_strides(&shape),
        shape,
        offset: 0,
    };
    Ok(Tensor::from_data(Data::Traced {
        dtype: ty.dtype,
        layout,
        value: TracedValue { trace, node },
    }))
}

/// The node of `t` in the current trace, lifting a host tensor to an input.
fn node_of(t: &Tensor) -> Result<NodeId> {
    CURRENT.with(|c| {
        let mut guard = c.borrow_mut();
        let state = guard.as_mut().expect("a trace is active");
        match t.data() {
            Data::Traced { value, .. } if value.trace == state.id => Ok(value.node),
            Data::Traced { .. } => Err(Error::new(
                ErrorKind::Argument,
                format!(
                    "a tensor {} from another trace was used in this one",
                    t.ty()
                ),
            )),
            Data::Values(_) => Ok(lift(state, t)),
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
    if let Some(known) = state.known.as_mut() {
        known.insert(node, t.detach());
    }
    node
}

/// Records `op(inputs)` (already type-checked: `ty`) in the current trace.
pub(crate) fn record(
    op: &Op,
    inputs: &[&Tensor],
    ty: TensorType,
    caller: &'static Location<'static>,
) -> Result<Tensor> {
    let ids = inputs
        .iter()
        .map(|t| node_of(t))
        .collect::<Result<Vec<_>>>()?;
    let meta = node_meta(caller);
    CURRENT.with(|c| {
        let mut guard = c.borrow_mut();
        let state = guard.as_mut().expect("a trace is active");
        // `ty` is the op's type rule applied to these inputs' types (by
        // `Tensor::apply`), and the ids are this trace's nodes: the node
        // goes in as is, without inferring its type a second time.
        let id = NodeId(state.graph.nodes.len() as u32);
        let out = traced_tensor(state.id, id, &ty)?;
        state.graph.push(Node {
            op: op.clone(),
            inputs: ids,
            ty,
            meta,
        });
        Ok(out)
    })
}
