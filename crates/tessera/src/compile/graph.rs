//! A graph that a front end built — a `.tir` file, a PyTorch FX graph
//! converted by `tessera-py` — compiled as a function of its inputs, with
//! the same pipeline as [`super::compile`]: the graph is run through the
//! interpreter under tracing, which records it again node by node with its
//! metadata (call sites and context hints), and the trace is compiled
//! (passes, fusion, the schedule under the hints, the memory plan).
//!
//! The graph's ops depend only on its inputs' types, so a call whose inputs
//! pass the guards of a cached executable runs it without re-tracing
//! ([`super::Compiled::retrace`] off).
//!
//! A graph whose inputs declare symbolic dims (`f32[s0,16]`, as tessera-py
//! writes a PyTorch graph with dynamic sizes) is compiled once over those
//! symbols (`dynamic::trace_symbolic`: traced at probe sizes, where
//! value matching is unambiguous), and that executable serves every call
//! whose sizes bind the symbols, without a trace. When it cannot be built
//! (logged under `recompiles`), the calls take the traced path with those
//! dims dynamic from the start (automatic dynamic shapes).

use std::sync::{Arc, Mutex};

use super::cache::{CacheState, CompileStats};
use super::dynamic::{self, DynamicDims};
use super::raised::{catching, raise};
use super::Executable;
use super::{CompileOptions, Compiled};
use crate::error::{Error, ErrorKind, Result};
use crate::ir::Graph;
use crate::logging::log;
use crate::runtime::device::Device;
use crate::schedule::Donations;
use crate::tensor::interpret::{bind_symbols, run_graph};
use crate::tensor::Tensor;

/// The traced function of a [`CompiledGraph`]: the interpreter over it.
pub type GraphFn = Box<dyn Fn(&[Tensor]) -> Vec<Tensor> + Send + Sync>;

/// A graph compiled by [`compile_graph`]; call it with
/// [`CompiledGraph::try_call`].
pub struct CompiledGraph {
    graph: Arc<Graph>,
    compiled: Compiled<GraphFn>,
    /// The executable over the graph's declared symbols, when it has some
    /// and it built.
    symbolic: Option<Arc<Executable>>,
    /// Why a graph with declared symbols has no symbolic executable.
    refusal: Option<String>,
}

/// Compiles `graph` (verified first: an invalid graph is an error naming
/// its node, op and line) as a function of its inputs, in `graph.inputs`
/// order, to its outputs, in `graph.outputs` order, under `options`
/// (its `retrace` is turned off: see the module doc).
pub fn compile_graph(graph: Graph, options: CompileOptions) -> Result<CompiledGraph> {
    graph.verify()?;
    let graph = Arc::new(graph);
    let traced = Arc::clone(&graph);
    let f: GraphFn = Box::new(move |inputs: &[Tensor]| match run_graph(&traced, inputs) {
        Ok(outs) => outs.into_iter().map(|(_, t)| t).collect(),
        Err(e) => raise(e),
    });
    let compiled = Compiled {
        f,
        name: graph.name.clone(),
        options: CompileOptions {
            retrace: false,
            ..options
        },
        state: Mutex::new(CacheState {
            dynamic_dims: declared_dynamic_dims(&graph),
            ..CacheState::default()
        }),
    };
    let (symbolic, refusal) = match options.dynamic {
        Some(false) => (None, None),
        _ => match build_symbolic(&compiled, &graph) {
            Ok(exe) => (exe, None),
            Err(why) => (None, Some(why)),
        },
    };
    Ok(CompiledGraph {
        graph,
        compiled,
        symbolic,
        refusal,
    })
}

/// The executable of a graph with declared symbolic input dims, counted as
/// a compile; `None` for a graph without them; why (logged) for one that
/// does not build symbolically.
fn build_symbolic(
    compiled: &Compiled<GraphFn>,
    graph: &Graph,
) -> std::result::Result<Option<Arc<Executable>>, String> {
    if declared_dynamic_dims(graph).is_empty() {
        return Ok(None);
    }
    let started = std::time::Instant::now();
    let built = dynamic::trace_symbolic(graph).and_then(|traced| {
        Executable::build(
            &traced,
            Vec::new(),
            &compiled.options,
            Device::Cpu,
            &Donations::default(),
        )
    });
    match built {
        Ok(exe) => {
            let mut state = compiled.state.lock().expect("compile cache");
            state.stats.compiles += 1;
            state.stats.compile_seconds += started.elapsed().as_secs_f64();
            Ok(Some(Arc::new(exe)))
        }
        Err(e) => {
            log("recompiles", || {
                format!("{}: compiled per size ({e})", graph.name)
            });
            Err(e.to_string())
        }
    }
}

/// The (input, dim) pairs whose declared dim is symbolic.
fn declared_dynamic_dims(graph: &Graph) -> DynamicDims {
    graph
        .inputs
        .iter()
        .enumerate()
        .flat_map(|(i, &id)| {
            let dims = graph.node(id).ty.shape.dims();
            (0..dims.len())
                .filter(move |&d| !dims[d].is_const())
                .map(move |d| (i, d))
        })
        .collect()
}

impl CompiledGraph {
    /// The graph as given (before the passes).
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Runs the compiled graph on `inputs`, one per graph input, each of
    /// its declared dtype and shape (symbolic dims bind to any size used
    /// consistently); anything else is an error naming the input.
    pub fn try_call(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        if inputs.len() != self.graph.inputs.len() {
            return Err(Error::new(
                ErrorKind::Argument,
                format!(
                    "graph `{}` takes {} inputs, got {}",
                    self.graph.name,
                    self.graph.inputs.len(),
                    inputs.len()
                ),
            ));
        }
        let given: Vec<Option<&Tensor>> = inputs.iter().map(Some).collect();
        bind_symbols(&self.graph, &given)?;
        let on_host = inputs.iter().all(|t| t.device() == Device::Cpu);
        if let (Some(exe), true) = (&self.symbolic, on_host) {
            self.compiled
                .state
                .lock()
                .expect("compile cache")
                .stats
                .cache_hits += 1;
            return exe.run(inputs, &[]);
        }
        catching(|| self.compiled.try_call(inputs))
    }

    pub fn stats(&self) -> CompileStats {
        self.compiled.stats()
    }

    /// Every stage's artifact of the executable built last (see
    /// [`Compiled::last_artifacts`]).
    pub fn last_artifacts(&self) -> Vec<(String, String)> {
        match &self.symbolic {
            Some(exe) => exe.artifacts(),
            None => self.compiled.last_artifacts(),
        }
    }

    /// Why a graph whose inputs declare symbolic dims is not compiled once
    /// over them (its calls then trace, and compile per size where the
    /// trace does not generalise); `None` when it is, or has none.
    pub fn symbolic_refusal(&self) -> Option<&str> {
        self.refusal.as_deref()
    }

    /// Why each recompile happened.
    pub fn recompile_reasons(&self) -> Vec<String> {
        self.compiled.recompile_reasons()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::text::parse;
    use crate::ir::DType;

    const MLP: &str = "graph mlp(%x, %w) {
  %x = input : f32[2,3]
  %w = input : f32[3,4]
  %y = matmul(%x, %w) : f32[2,4]  hints={\"order\":\"strict\"}
  %r = relu(%y) : f32[2,4]
  return %r as r
}
";

    #[test]
    fn a_parsed_graph_compiles_and_runs_like_the_interpreter() {
        let g = compile_graph(parse(MLP).unwrap(), CompileOptions::default()).unwrap();
        let x = Tensor::from_vec(vec![1.0f32, -2.0, 3.0, 0.5, 0.0, -1.0], &[2, 3]);
        let w = Tensor::from_vec((0..12).map(|i| i as f32 - 6.0).collect::<Vec<_>>(), &[3, 4]);
        let out = g.try_call(&[x.clone(), w.clone()]).unwrap();
        let want = run_graph(g.graph(), &[x.clone(), w.clone()]).unwrap();
        assert_eq!(
            out[0].to_vec::<f32>().unwrap(),
            want[0].1.to_vec::<f32>().unwrap()
        );
        // The second call is served by the cache, without a trace.
        g.try_call(&[x, w]).unwrap();
        let stats = g.stats();
        assert_eq!((stats.compiles, stats.cache_hits), (1, 1));
        // The hint reached the compiled graph.
        let artifacts = g.last_artifacts();
        let forward = artifacts
            .iter()
            .find(|(name, _)| name.ends_with(".tir"))
            .expect("a graph artifact");
        assert!(forward.1.contains("\"order\":\"strict\""), "{}", forward.1);
    }

    /// The MLP over a batch of `s0` rows, flattened to `[4*s0]` (a size
    /// computed from the symbol) and back.
    const SYMBOLIC: &str = "graph mlp(%x, %w) {
  %x = input : f32[s0,3]
  %w = input : f32[3,4]
  %y = matmul(%x, %w) : f32[s0,4]
  %f = reshape(%y) {shape=[4*s0]} : f32[4*s0]
  %r = relu(%f) : f32[4*s0]
  %o = reshape(%r) {shape=[s0,4]} : f32[s0,4]
  return %o as r
}
";

    #[test]
    fn declared_symbolic_dims_compile_once_for_every_size() {
        let g = compile_graph(parse(SYMBOLIC).unwrap(), CompileOptions::default()).unwrap();
        let w = Tensor::from_vec((0..12).map(|i| i as f32 - 6.0).collect::<Vec<_>>(), &[3, 4]);
        for rows in [5usize, 2, 9] {
            let x = Tensor::from_vec(
                (0..rows * 3)
                    .map(|i| (i as f32 * 0.7).sin())
                    .collect::<Vec<_>>(),
                &[rows, 3],
            );
            let out = g.try_call(&[x.clone(), w.clone()]).unwrap();
            let want = run_graph(g.graph(), &[x, w.clone()]).unwrap();
            assert_eq!(out[0].shape(), &[rows, 4]);
            assert_eq!(
                out[0].to_vec::<f32>().unwrap(),
                want[0].1.to_vec::<f32>().unwrap()
            );
        }
        let stats = g.stats();
        assert_eq!((stats.compiles, stats.recompiles), (1, 0), "{stats:?}");
        // Without declared symbols every size compiles anew (the first
        // recompile then makes the dim dynamic: automatic mode).
        assert!(declared_dynamic_dims(&parse(MLP).unwrap()).is_empty());
        assert_eq!(
            declared_dynamic_dims(&parse(SYMBOLIC).unwrap()),
            DynamicDims::from([(0, 0)])
        );
    }

    #[test]
    fn bad_graphs_and_inputs_are_errors_naming_them() {
        let e = compile_graph(wrongly_typed(), CompileOptions::default())
            .err()
            .expect("a declared type that is wrong");
        assert!(e.to_string().contains("matmul"), "{e}");
        let g = compile_graph(parse(MLP).unwrap(), CompileOptions::default()).unwrap();
        let x = Tensor::zeros(&[2, 3], DType::F32);
        let e = g.try_call(std::slice::from_ref(&x)).unwrap_err();
        assert!(e.to_string().contains("takes 2 inputs, got 1"), "{e}");
        let w = Tensor::zeros(&[4, 4], DType::F32);
        let e = g.try_call(&[x, w]).unwrap_err();
        assert!(e.to_string().contains("w"), "{e}");
    }

    /// The MLP with its matmul declared `f32[2,5]` (`parse` would refuse
    /// it: it verifies).
    fn wrongly_typed() -> Graph {
        let mut g = parse(MLP).unwrap();
        let relu = g.outputs[0].node;
        let matmul = g.node(relu).inputs[0];
        g.nodes[matmul.index()].ty =
            crate::ir::TensorType::new(DType::F32, crate::ir::Shape::from_concrete(&[2, 5]));
        g
    }
}
