//! The options of a compiled function: what runs it ([`Backend`]), how much
//! host work a call may do ([`Mode`]), and the knobs of the pipeline, with
//! the builder methods of [`Compiled`] that set them and the decisions that
//! follow from them alone (which dims are dynamic, whether to speculate).

use super::dynamic::{self, DynamicDims};
use super::{Compiled, InputGuard};
use crate::autograd::Partition;
use crate::runtime::device::Device;
use crate::schedule::Strategy;
use crate::tensor::Tensor;

/// What runs the captured graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The captured ops one by one (autograd by the eager tape).
    Eager,
    /// Ahead-of-time forward/backward graphs, no optimisation.
    AotEager,
    /// The full pipeline: graph passes, then the AOT graphs.
    Default,
}

/// How much host work each call may do (as torch.compile's modes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Default,
    /// Skip re-tracing when the guards match a cached executable. Assumes
    /// the function's graph depends only on its inputs' guards (no
    /// captured state that changes the ops), like CUDA-graph replay.
    ReduceOverhead,
    /// Search kernel parameters (the block size of fused pointwise
    /// kernels) by timing candidates on the real inputs at the first run,
    /// keep the fastest, cached per kernel signature (log topic `autotune`).
    MaxAutotune,
}

/// The options of a compiled function.
#[derive(Clone, Debug)]
pub struct CompileOptions {
    pub backend: Backend,
    pub mode: Mode,
    /// A graph break (a data read while tracing) is an error, not a split.
    pub fullgraph: bool,
    /// How many recompiles before falling back to eager.
    pub recompile_limit: usize,
    /// How the AOT partition chooses saved values.
    pub partition: Partition,
    /// How the default backend orders kernels (context hints override it
    /// in their regions). Default `Auto`: memory-aware, as Inductor's
    /// `reorder_for_peak_memory` — the lowest predicted peak among the
    /// level order (bfs) and the sequential orders, made as parallel as
    /// that peak allows (bfs itself wherever it is as low).
    pub schedule: Strategy,
    /// The most bytes a graph's intermediates may hold at once (default
    /// backend): the most parallel order that fits is chosen.
    pub memory_budget: Option<usize>,
    /// Replace attention written with plain ops by the flash attention op
    /// (the `attention` pass of the default backend; on by default).
    pub fuse_attention: bool,
    /// Dynamic dims: `None` automatic (after a size recompile), `Some(true)`
    /// all dims from the start, `Some(false)` never.
    pub dynamic: Option<bool>,
    /// Start the executable of the last hit before re-tracing (see
    /// [`Compiled::speculate`]); `None`: when the inputs are on a device,
    /// whose kernels run while the host traces.
    pub speculate: Option<bool>,
    /// Trace every call to find its executable (the default); `false`
    /// serves a call whose guards match a cached executable without a
    /// trace (see [`Compiled::retrace`]).
    pub retrace: bool,
}

impl Default for CompileOptions {
    fn default() -> CompileOptions {
        CompileOptions {
            backend: Backend::Default,
            mode: Mode::Default,
            fullgraph: false,
            recompile_limit: 8,
            partition: Partition::SaveAll,
            schedule: Strategy::Auto,
            memory_budget: None,
            fuse_attention: true,
            dynamic: None,
            speculate: None,
            retrace: true,
        }
    }
}

impl CompileOptions {
    /// The dims to generalise the trace over: none (`dynamic = Some(false)`),
    /// every dim of every input (`Some(true)`), or those made dynamic so
    /// far by size recompiles (`None`, automatic: `automatic`).
    pub(super) fn dynamic_dims(
        &self,
        guards: &[InputGuard],
        automatic: impl FnOnce() -> DynamicDims,
    ) -> DynamicDims {
        match self.dynamic {
            Some(false) => DynamicDims::new(),
            Some(true) => dynamic::all_dims(guards),
            None => automatic(),
        }
    }

    /// Whether size changes widen the dynamic dims (automatic mode only).
    pub(super) fn widens_dynamic_dims(&self) -> bool {
        self.dynamic.is_none()
    }

    /// Whether a call with `inputs` starts the last entry's executable
    /// before tracing: as asked, or (`None`) when an input is on a device.
    pub(super) fn speculates(&self, inputs: &[Tensor]) -> bool {
        self.speculate
            .unwrap_or_else(|| inputs.iter().any(|t| t.device() != Device::Cpu))
    }
}

impl<F: Fn(&[Tensor]) -> Vec<Tensor>> Compiled<F> {
    pub fn backend(mut self, backend: Backend) -> Self {
        self.options.backend = backend;
        self
    }

    pub fn mode(mut self, mode: Mode) -> Self {
        self.options.mode = mode;
        self
    }

    pub fn fullgraph(mut self, on: bool) -> Self {
        self.options.fullgraph = on;
        self
    }

    /// `None`: automatic dynamic dims; `Some(true)`: all dims symbolic from
    /// the first compile; `Some(false)`: a recompile for every new size.
    pub fn dynamic(mut self, dynamic: Option<bool>) -> Self {
        self.options.dynamic = dynamic;
        self
    }

    pub fn recompile_limit(mut self, limit: usize) -> Self {
        self.options.recompile_limit = limit;
        self
    }

    /// The min-cut partition with this budget (0.0–1.0) instead of saving
    /// everything the backward needs.
    pub fn activation_memory_budget(mut self, budget: f64) -> Self {
        self.options.partition = Partition::MinCut {
            activation_memory_budget: budget,
        };
        self
    }

    /// How kernels are ordered (default `Auto`); see [`crate::schedule`].
    pub fn schedule(mut self, strategy: Strategy) -> Self {
        self.options.schedule = strategy;
        self
    }

    /// Runs each graph in the most parallel order whose predicted peak of
    /// intermediates fits `bytes` (or the lowest peak, with a warning).
    pub fn memory_budget(mut self, bytes: usize) -> Self {
        self.options.memory_budget = Some(bytes);
        self
    }

    /// Whether attention written with plain ops becomes the flash
    /// attention op (default on; see [`crate::passes::attention`]).
    pub fn fuse_attention(mut self, on: bool) -> Self {
        self.options.fuse_attention = on;
        self
    }

    /// Mode `default` re-traces on every call to find its executable. With
    /// speculation, a call whose inputs pass the guards of the entry that
    /// served the last call starts that executable first and traces after:
    /// on a device the kernels run while the host traces. The outputs are
    /// returned only when the trace's key is that entry's; otherwise they
    /// (and the autograd node they carry) are dropped and the call goes on
    /// as without speculation, so a changed graph is never served stale
    /// results. The default (`None`) speculates when the inputs are on a
    /// device: on the CPU the run is not asynchronous, so it would only
    /// cost a wasted run on a miss.
    pub fn speculate(mut self, on: Option<bool>) -> Self {
        self.options.speculate = on;
        self
    }

    /// Whether every call traces the function to find its executable
    /// (default `true`: a graph that changes with state the guards do not
    /// see, a closure's captured value, is always found). With `false` a
    /// call whose inputs pass the guards of a cached executable runs it
    /// without tracing, as `Mode::ReduceOverhead` does (but without CUDA
    /// graphs) and as torch.compile's guards do: for a function whose ops
    /// depend only on its inputs' dtypes, shapes and layouts. GPT-2
    /// small's training step took 6–13 ms of host time per call to
    /// trace (`bench gpt`'s `trace_s`, BENCHMARKS.md run G14).
    pub fn retrace(mut self, on: bool) -> Self {
        self.options.retrace = on;
        self
    }

    /// A readable name for logs and dumps (default: file and line).
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.to_string();
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::compile;
    use crate::ir::DType;

    fn guards(shapes: &[&[usize]]) -> Vec<InputGuard> {
        shapes
            .iter()
            .map(|s| InputGuard::of(&Tensor::zeros(s, DType::F32)))
            .collect()
    }

    #[test]
    fn the_defaults_are_the_documented_ones() {
        let o = CompileOptions::default();
        assert_eq!((o.backend, o.mode), (Backend::Default, Mode::Default));
        assert!(!o.fullgraph);
        assert_eq!(o.recompile_limit, 8);
        assert!(matches!(o.partition, Partition::SaveAll));
        assert_eq!(o.schedule, Strategy::Auto, "the memory-aware order");
        assert_eq!(o.memory_budget, None);
        assert!(o.fuse_attention, "the attention pass is on by default");
        assert_eq!((o.dynamic, o.speculate), (None, None));
    }

    #[test]
    fn each_builder_sets_its_option_and_only_it() {
        let f = compile(|x: &[Tensor]| x.to_vec())
            .backend(Backend::AotEager)
            .mode(Mode::MaxAutotune)
            .fullgraph(true)
            .dynamic(Some(true))
            .recompile_limit(3)
            .activation_memory_budget(0.25)
            .schedule(Strategy::Dfs)
            .memory_budget(1 << 20)
            .fuse_attention(false)
            .speculate(Some(false))
            .name("block");
        let o = &f.options;
        assert_eq!((o.backend, o.mode), (Backend::AotEager, Mode::MaxAutotune));
        assert!(o.fullgraph && !o.fuse_attention);
        assert_eq!((o.dynamic, o.speculate), (Some(true), Some(false)));
        assert_eq!(o.recompile_limit, 3);
        assert!(matches!(
            o.partition,
            Partition::MinCut { activation_memory_budget } if activation_memory_budget == 0.25
        ));
        assert_eq!(o.schedule, Strategy::Dfs);
        assert_eq!(o.memory_budget, Some(1 << 20));
        assert_eq!(f.name, "block");
        // A builder leaves the others at their defaults.
        let g = compile(|x: &[Tensor]| x.to_vec()).mode(Mode::ReduceOverhead);
        assert_eq!(g.options.mode, Mode::ReduceOverhead);
        assert_eq!(g.options.backend, Backend::Default);
        assert_eq!(g.options.recompile_limit, 8);
    }

    #[test]
    fn dynamic_decides_which_dims_generalise() {
        let g = guards(&[&[8, 4], &[3]]);
        let automatic = || DynamicDims::from([(0, 0)]);
        let mut o = CompileOptions::default();
        assert_eq!(o.dynamic_dims(&g, automatic), DynamicDims::from([(0, 0)]));
        assert!(o.widens_dynamic_dims());
        o.dynamic = Some(true);
        assert_eq!(
            o.dynamic_dims(&g, automatic),
            DynamicDims::from([(0, 0), (0, 1), (1, 0)])
        );
        assert!(!o.widens_dynamic_dims());
        o.dynamic = Some(false);
        assert!(o.dynamic_dims(&g, automatic).is_empty());
        assert!(!o.widens_dynamic_dims());
    }

    #[test]
    fn speculation_by_default_only_for_device_inputs() {
        let host = [Tensor::zeros(&[2], DType::F32)];
        let mut o = CompileOptions::default();
        assert!(!o.speculates(&host), "host inputs run synchronously");
        assert!(!o.speculates(&[]));
        o.speculate = Some(true);
        assert!(o.speculates(&host));
        o.speculate = Some(false);
        assert!(!o.speculates(&host));
    }
}
