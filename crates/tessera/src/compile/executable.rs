//! What a compile produces: the graph(s) to run and how to hook them into
//! autograd.

use std::sync::Arc;

use super::{Backend, CompileOptions};
use crate::autograd::{self, aot_autograd};
use crate::error::Result;
use crate::ir::{Graph, NodeId};
use crate::runtime::interpret::run_graph;
use crate::tensor::trace::Traced;
use crate::tensor::Tensor;

/// The backward half of an AOT-compiled function.
struct BackwardGraph {
    graph: Arc<Graph>,
    /// Which forward-graph inputs get gradients.
    wrt: Vec<usize>,
    /// Which outputs feed a tangent to the backward (the float ones).
    tangent_outputs: Vec<usize>,
}

/// A compiled function: a forward graph over (user inputs, lifted tensors,
/// values read at graph breaks) and, when something requires grad, the
/// backward graph.
pub struct Executable {
    name: String,
    forward: Arc<Graph>,
    backward: Option<BackwardGraph>,
    /// Run the captured ops with the eager tape (backend `eager`).
    eager_autograd: bool,
    num_outputs: usize,
    num_lifted: usize,
}

impl Executable {
    /// Builds the forward-only executable for `traced`.
    pub fn build(traced: &Traced, options: &CompileOptions) -> Result<Executable> {
        let graph = cut_at_breaks(traced)?;
        let num_outputs = graph.outputs.len();
        let name = graph.name.clone();
        Ok(Executable {
            name,
            forward: Arc::new(graph),
            backward: None,
            eager_autograd: options.backend == Backend::Eager,
            num_outputs,
            num_lifted: traced.lifted.len(),
        })
    }

    /// Adds the AOT backward for the inputs at `wrt` (positions in the
    /// forward graph's inputs), unless the backend runs the eager tape.
    pub(super) fn with_backward(
        mut self,
        wrt: Vec<usize>,
        options: &CompileOptions,
    ) -> Result<Executable> {
        if wrt.is_empty() || self.eager_autograd {
            return Ok(self);
        }
        let aot = aot_autograd(&self.forward, &wrt, options.partition)?;
        let tangent_outputs = (0..self.num_outputs)
            .filter(|&i| {
                self.forward
                    .node(self.forward.outputs[i].node)
                    .ty
                    .dtype
                    .is_float()
            })
            .collect();
        self.forward = Arc::new(aot.forward);
        self.backward = Some(BackwardGraph {
            graph: Arc::new(aot.backward),
            wrt,
            tangent_outputs,
        });
        Ok(self)
    }

    pub(super) fn has_lifted(&self) -> bool {
        self.num_lifted > 0
    }

    /// Runs on the user's `inputs` followed by `extra` (lifted tensors and
    /// graph-break values, in the trace's order).
    pub fn run(&self, inputs: &[Tensor], extra: &[Tensor]) -> Result<Vec<Tensor>> {
        let args: Vec<Tensor> = inputs.iter().chain(extra).cloned().collect();
        if self.eager_autograd {
            // The interpreter's ops record on the tape like eager code.
            return Ok(run_graph(&self.forward, &args)?
                .into_iter()
                .map(|(_, t)| t)
                .collect());
        }
        let detached: Vec<Tensor> = args.iter().map(Tensor::detach).collect();
        let outs = autograd::no_grad(|| run_graph(&self.forward, &detached))?;
        let mut outs: Vec<Tensor> = outs.into_iter().map(|(_, t)| t).collect();
        let saved = outs.split_off(self.num_outputs);
        let Some(bwd) = &self.backward else {
            return Ok(outs);
        };
        let wrt: Vec<&Tensor> = bwd.wrt.iter().map(|&i| &args[i]).collect();
        let graph = bwd.graph.clone();
        let tangent_outputs = bwd.tangent_outputs.clone();
        let backward = move |grads: &[Tensor]| -> Result<Vec<Option<Tensor>>> {
            let mut feed = saved.clone();
            feed.extend(tangent_outputs.iter().map(|&i| grads[i].clone()));
            Ok(run_graph(&graph, &feed)?
                .into_iter()
                .map(|(_, g)| Some(g))
                .collect())
        };
        Ok(autograd::custom_function(
            &self.name,
            &wrt,
            outs,
            Arc::new(backward),
        ))
    }
}

/// The traced graph with the nodes read at graph breaks turned into inputs
/// (after the user inputs and lifted tensors), so they are not recomputed.
fn cut_at_breaks(traced: &Traced) -> Result<Graph> {
    if traced.materialized.is_empty() {
        return Ok(traced.graph.clone());
    }
    let g = &traced.graph;
    let mut inputs: Vec<(String, NodeId)> = g
        .inputs
        .iter()
        .map(|&id| (g.display_name(id), id))
        .collect();
    inputs.extend(
        traced
            .materialized
            .iter()
            .enumerate()
            .map(|(i, (id, _))| (format!("break{i}"), *id)),
    );
    let outputs: Vec<(String, NodeId)> =
        g.outputs.iter().map(|o| (o.name.clone(), o.node)).collect();
    autograd::aot::extract(g, &g.name, &inputs, &outputs)
}
