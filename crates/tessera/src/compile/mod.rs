//! `tessera::compile(f)`: capture `f` by tracing, guard and cache what was
//! compiled, and run it — with autograd through the compiled graphs.
//!
//! Every call re-traces `f` (cheap: the ops are recorded, not computed),
//! hashes the graph's structure together with the inputs' guards, and looks
//! the executable up in the cache: the key *is* the guard set, so a closure
//! whose traced graph changes (captured state, data-dependent control flow)
//! is never served a stale executable. A miss on a known function is a
//! recompile, logged with its reason. Past `recompile_limit` the function
//! runs eagerly from then on, with one warning.
//!
//! Dynamic shapes (`dynamic`: `None` = automatic, `Some(true)` = every dim
//! symbolic from the start, `Some(false)` = never): after a recompile caused
//! by changed sizes, those dims become symbolic and the graph is generalised
//! over them ([`dynamic`]), so one executable then serves every size.

mod dynamic;
mod executable;
mod guards;

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

pub use executable::Executable;
pub use guards::{miss_reason, InputGuard};

use crate::autograd::Partition;
use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::hints::HintMap;
use crate::ir::Graph;
use crate::logging::log;
use crate::runtime::device::Device;
use crate::schedule::Strategy;
use crate::tensor::trace::{self, Traced};
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
    /// in their regions).
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
}

impl Default for CompileOptions {
    fn default() -> CompileOptions {
        CompileOptions {
            backend: Backend::Default,
            mode: Mode::Default,
            fullgraph: false,
            recompile_limit: 8,
            partition: Partition::SaveAll,
            schedule: Strategy::Bfs,
            memory_budget: None,
            fuse_attention: true,
            dynamic: None,
            speculate: None,
        }
    }
}

/// Counters of what the cache did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CompileStats {
    /// Seconds spent building executables (passes, AOT autograd, fusion).
    pub compile_seconds: f64,
    /// Seconds spent tracing (every call traces; see the module doc).
    pub trace_seconds: f64,
    /// Executables built (the first compile and every recompile).
    pub compiles: usize,
    pub recompiles: usize,
    pub cache_hits: usize,
    pub graph_breaks: usize,
    /// Calls run eagerly (after the recompile limit, or a graph break with
    /// inputs that require grad).
    pub eager_calls: usize,
    /// Runs started before the trace (see [`Compiled::speculate`]), and
    /// those whose trace then differed (their outputs were dropped).
    pub speculations: usize,
    pub speculation_misses: usize,
}

struct Entry {
    key: u64,
    guards: Vec<InputGuard>,
    /// Whether the trace had graph breaks (then it is always re-traced).
    had_breaks: bool,
    exe: Arc<Executable>,
}

#[derive(Default)]
struct CacheState {
    entries: Vec<Entry>,
    stats: CompileStats,
    fell_back: bool,
    /// Why each recompile happened, in order.
    recompile_reasons: Vec<String>,
    /// The (input, dim) pairs made symbolic so far (automatic mode).
    dynamic_dims: dynamic::DynamicDims,
    /// The key of the entry that served the last call.
    last_key: Option<u64>,
}

/// A function compiled with [`compile`]; call it with [`Compiled::call`].
pub struct Compiled<F> {
    f: F,
    name: String,
    options: CompileOptions,
    state: Mutex<CacheState>,
}

/// Compiles `f`, a function of tensors to tensors, on first call.
#[track_caller]
pub fn compile<F: Fn(&[Tensor]) -> Vec<Tensor>>(f: F) -> Compiled<F> {
    let loc = SourceLoc::caller();
    let file = loc
        .file
        .rsplit('/')
        .next()
        .unwrap_or("f")
        .trim_end_matches(".rs")
        .to_string();
    Compiled {
        f,
        name: format!("{file}_{}", loc.line),
        options: CompileOptions::default(),
        state: Mutex::new(CacheState::default()),
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

    /// How kernels are ordered (default `Bfs`); see [`crate::schedule`].
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

    /// A readable name for logs and dumps (default: file and line).
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.to_string();
        self
    }

    pub fn stats(&self) -> CompileStats {
        self.state.lock().expect("compile cache").stats
    }

    /// What the device-graph replay of `mode=reduce-overhead` did, over
    /// every executable of the cache (see `runtime::replay`).
    pub fn replay_stats(&self) -> crate::runtime::replay::ReplayStats {
        let state = self.state.lock().expect("compile cache");
        let mut sum = crate::runtime::replay::ReplayStats::default();
        for entry in &state.entries {
            sum += entry.exe.replay_stats();
        }
        sum
    }

    /// Every stage's artifact of the executable built last, as (file name,
    /// text): the forward and backward graphs after the passes (`*.tir`),
    /// their kernels, schedules and memory plans. Empty before the first
    /// compile.
    pub fn last_artifacts(&self) -> Vec<(String, String)> {
        let state = self.state.lock().expect("compile cache");
        state
            .entries
            .last()
            .map_or_else(Vec::new, |entry| entry.exe.artifacts())
    }

    /// Why each recompile happened (`input 0, dim 0: expected 8, got 16`).
    pub fn recompile_reasons(&self) -> Vec<String> {
        self.state
            .lock()
            .expect("compile cache")
            .recompile_reasons
            .clone()
    }

    /// Runs the compiled function; panics with the error like an eager op.
    #[track_caller]
    pub fn call(&self, inputs: &[Tensor]) -> Vec<Tensor> {
        match self.try_call(inputs) {
            Ok(out) => out,
            Err(e) => panic!("{e}"),
        }
    }

    #[track_caller]
    pub fn try_call(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let guards: Vec<InputGuard> = inputs.iter().map(InputGuard::of).collect();
        if self.state.lock().expect("compile cache").fell_back {
            return self.run_eagerly(inputs);
        }
        if self.options.mode == Mode::ReduceOverhead {
            if let Some(exe) = self.lookup_by_guards(&guards) {
                return exe.run(inputs, &[]);
            }
        }
        let early = self
            .speculation(inputs, &guards)
            .map(|(key, exe)| (key, exe.run(inputs, &[])));
        let started = std::time::Instant::now();
        let traced = self.capture(inputs)?;
        self.state
            .lock()
            .expect("compile cache")
            .stats
            .trace_seconds += started.elapsed().as_secs_f64();
        if !traced.breaks.is_empty() {
            if let Some(out) = self.handle_breaks(&traced, inputs)? {
                return Ok(out);
            }
        }
        let mut view = self.generalised(&traced, &guards);
        if let Some((key, out)) = early {
            let mut state = self.state.lock().expect("compile cache");
            if key == view.key {
                state.stats.cache_hits += 1;
                return out;
            }
            // The graph changed: `out` is dropped unused.
            state.stats.speculation_misses += 1;
        }
        let mut exe = self.lookup(view.key);
        if exe.is_none() && self.widen_dynamic_dims(&guards) {
            view = self.generalised(&traced, &guards);
            exe = self.lookup(view.key);
        }
        let exe = match exe {
            Some(exe) => exe,
            None => match self.compile_generalised(&view, &guards, &traced)? {
                Some(exe) => exe,
                None => return self.run_eagerly(inputs),
            },
        };
        let mut extra: Vec<Tensor> = traced.lifted.clone();
        extra.extend(traced.materialized.iter().map(|(_, t)| t.clone()));
        exe.run(inputs, &extra)
    }

    fn capture(&self, inputs: &[Tensor]) -> Result<Traced> {
        let named: Vec<(String, Tensor)> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| (format!("arg{i}"), t.clone()))
            .collect();
        // The trace records ops; autograd is the executable's business.
        crate::autograd::no_grad(|| {
            trace::trace_with_values(&self.name, &named, |args| {
                Ok((self.f)(args)
                    .into_iter()
                    .enumerate()
                    .map(|(i, t)| (format!("out{i}"), t))
                    .collect())
            })
        })
    }

    /// Graph breaks: an error under `fullgraph`; an eager run when inputs
    /// require grad (the values read before the break were computed without
    /// a tape); otherwise `None`: the executable takes the values read at
    /// the breaks as inputs, so the part before them is not computed twice.
    fn handle_breaks(&self, traced: &Traced, inputs: &[Tensor]) -> Result<Option<Vec<Tensor>>> {
        let at = traced.breaks[0].clone();
        if self.options.fullgraph {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "graph break under fullgraph: the traced code reads a tensor's values (item/to_vec)",
            )
            .at(at));
        }
        let mut state = self.state.lock().expect("compile cache");
        state.stats.graph_breaks += traced.breaks.len();
        log("graph_breaks", || {
            format!(
                "{}: graph break at {at} (a value read while tracing)",
                self.name
            )
        });
        let needs_grad = inputs
            .iter()
            .chain(&traced.lifted)
            .any(Tensor::requires_grad);
        drop(state);
        if needs_grad {
            log("graph_breaks", || {
                format!("{}: inputs require grad: this call runs eagerly", self.name)
            });
            return self.run_eagerly(inputs).map(Some);
        }
        Ok(None)
    }

    /// The trace as the cache sees it: generalised over the dynamic dims
    /// (when there are any and the graph generalises), with its key.
    fn generalised(&self, traced: &Traced, guards: &[InputGuard]) -> Generalised {
        let dims = match self.options.dynamic {
            Some(false) => dynamic::DynamicDims::new(),
            Some(true) => dynamic::all_dims(guards),
            None => self
                .state
                .lock()
                .expect("compile cache")
                .dynamic_dims
                .clone(),
        };
        let general = traced
            .breaks
            .is_empty()
            .then(|| dynamic::generalise(&traced.graph, guards, &dims))
            .flatten();
        match general {
            Some((graph, masked)) => Generalised {
                key: structure_key(&graph, &masked, &traced.lifted),
                traced: Some(Traced {
                    graph,
                    lifted: traced.lifted.clone(),
                    materialized: Vec::new(),
                    breaks: Vec::new(),
                }),
            },
            None => Generalised {
                key: structure_key(&traced.graph, guards, &traced.lifted),
                traced: None,
            },
        }
    }

    /// Compiles the generalised trace; if that fails to build (a pass or
    /// the AOT partition needing concrete sizes), the concrete one.
    fn compile_generalised(
        &self,
        view: &Generalised,
        guards: &[InputGuard],
        traced: &Traced,
    ) -> Result<Option<Arc<Executable>>> {
        let Some(general) = &view.traced else {
            return self.compile_entry(view.key, guards, traced);
        };
        match self.compile_entry(view.key, guards, general) {
            Err(e) => {
                log("recompiles", || {
                    format!(
                        "{}: the symbolic graph does not build ({e}); compiling it for these sizes",
                        self.name
                    )
                });
                let key = structure_key(&traced.graph, guards, &traced.lifted);
                self.compile_entry(key, guards, traced)
            }
            done => done,
        }
    }

    /// Automatic mode, on a miss: the dims whose sizes changed since the
    /// last compile become dynamic. Whether any new dim was added.
    fn widen_dynamic_dims(&self, guards: &[InputGuard]) -> bool {
        if self.options.dynamic.is_some() {
            return false;
        }
        let mut state = self.state.lock().expect("compile cache");
        let Some(last) = state.entries.last() else {
            return false;
        };
        let changed = dynamic::changed_dims(&last.guards, guards);
        let before = state.dynamic_dims.len();
        state.dynamic_dims.extend(changed);
        let widened = state.dynamic_dims.len() > before;
        if widened {
            let dims = state.dynamic_dims.clone();
            log("recompiles", || {
                format!("{}: dims now dynamic (input, dim): {dims:?}", self.name)
            });
        }
        widened
    }

    fn lookup(&self, key: u64) -> Option<Arc<Executable>> {
        let mut state = self.state.lock().expect("compile cache");
        let exe = state
            .entries
            .iter()
            .find(|e| e.key == key)
            .map(|e| e.exe.clone())?;
        state.stats.cache_hits += 1;
        state.last_key = Some(key);
        Some(exe)
    }

    /// The key and executable to start before tracing (see
    /// [`Compiled::speculate`]): the last call's entry, when these inputs
    /// pass its guards and it needs nothing from the trace (no lifted
    /// tensors, no graph-break values).
    fn speculation(
        &self,
        inputs: &[Tensor],
        guards: &[InputGuard],
    ) -> Option<(u64, Arc<Executable>)> {
        let on = self.options.speculate.unwrap_or_else(|| {
            inputs
                .iter()
                .any(|t| t.device() != crate::runtime::device::Device::Cpu)
        });
        if !on {
            return None;
        }
        let mut state = self.state.lock().expect("compile cache");
        let key = state.last_key?;
        let exe = state
            .entries
            .iter()
            .find(|e| e.key == key && !e.had_breaks && !e.exe.has_lifted() && e.guards == guards)
            .map(|e| e.exe.clone())?;
        state.stats.speculations += 1;
        Some((key, exe))
    }

    fn lookup_by_guards(&self, guards: &[InputGuard]) -> Option<Arc<Executable>> {
        let mut state = self.state.lock().expect("compile cache");
        let exe = state
            .entries
            .iter()
            .find(|e| !e.had_breaks && !e.exe.has_lifted() && e.guards == guards)
            .map(|e| e.exe.clone())?;
        state.stats.cache_hits += 1;
        Some(exe)
    }

    /// Builds and caches an executable, or `None` past the recompile limit.
    fn compile_entry(
        &self,
        key: u64,
        guards: &[InputGuard],
        traced: &Traced,
    ) -> Result<Option<Arc<Executable>>> {
        let mut state = self.state.lock().expect("compile cache");
        if let Some(last) = state.entries.last() {
            let reason = miss_reason(&last.guards, guards).unwrap_or_else(|| {
                "the traced graph changed (captured state or data-dependent control flow)".into()
            });
            if state.entries.len() > self.options.recompile_limit {
                state.fell_back = true;
                eprintln!(
                    "tessera: warning: {} recompiled more than {} times (last: {reason}); running it eagerly from now on",
                    self.name, self.options.recompile_limit
                );
                return Ok(None);
            }
            state.stats.recompiles += 1;
            log("recompiles", || {
                format!("{}: recompiling: {reason}", self.name)
            });
            state.recompile_reasons.push(reason);
        }
        log("guards", || format!("{}: guards {guards:?}", self.name));
        log("graph", || {
            format!("{}: captured graph:\n{}", self.name, traced.graph)
        });
        // Gradients flow to the user inputs and lifted tensors that require grad.
        let wrt: Vec<usize> = guards
            .iter()
            .map(|g| g.requires_grad)
            .chain(traced.lifted.iter().map(Tensor::requires_grad))
            .enumerate()
            .filter_map(|(i, r)| r.then_some(i))
            .collect();
        let started = std::time::Instant::now();
        let on = guards_device(guards, &traced.lifted);
        let exe = Arc::new(Executable::build(traced, wrt, &self.options, on)?);
        state.stats.compile_seconds += started.elapsed().as_secs_f64();
        state.stats.compiles += 1;
        log("output_code", || {
            exe.artifacts()
                .iter()
                .filter(|(n, _)| n.ends_with(".kernels.txt") || n.ends_with(".schedule.txt"))
                .map(|(_, t)| t.clone())
                .collect::<String>()
        });
        if std::env::var("TESSERA_COMPILE_DEBUG").is_ok_and(|v| v == "1") {
            dump_debug(&self.name, state.stats.compiles, traced, guards, &exe);
        }
        state.last_key = Some(key);
        state.entries.push(Entry {
            key,
            guards: guards.to_vec(),
            had_breaks: !traced.breaks.is_empty(),
            exe: exe.clone(),
        });
        Ok(Some(exe))
    }

    fn run_eagerly(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.state.lock().expect("compile cache").stats.eager_calls += 1;
        Ok((self.f)(inputs))
    }
}

/// The device the executable's kernels run on: its inputs' (as
/// `device::of_inputs` decides: 0-dim host tensors are scalars, read on any
/// device), the host when none says otherwise.
fn guards_device(guards: &[InputGuard], lifted: &[Tensor]) -> Device {
    let user = guards
        .iter()
        .filter(|g| !(g.device == Device::Cpu.name() && g.shape.is_empty()))
        .map(|g| Device::parse(g.device).unwrap_or_default());
    let captured = lifted
        .iter()
        .filter(|t| !(t.device() == Device::Cpu && t.rank() == 0))
        .map(Tensor::device);
    user.chain(captured).next().unwrap_or_default()
}

/// A trace as the cache sees it.
struct Generalised {
    key: u64,
    /// The generalised trace, when the dynamic dims generalise the graph.
    traced: Option<Traced>,
}

/// Writes every stage's artifact into `tessera_debug/<name>_<n>/` and says
/// where once per compile. A failure to write is reported, not fatal.
fn dump_debug(name: &str, n: usize, traced: &Traced, guards: &[InputGuard], exe: &Executable) {
    let dir = std::path::PathBuf::from("tessera_debug").join(format!("{name}_{n}"));
    let mut files = vec![
        ("captured.tir".to_string(), traced.graph.to_string()),
        ("guards.txt".to_string(), format!("{guards:#?}\n")),
    ];
    files.extend(exe.artifacts());
    let written = std::fs::create_dir_all(&dir).and_then(|_| {
        files
            .iter()
            .try_for_each(|(f, text)| std::fs::write(dir.join(f), text))
    });
    match written {
        Ok(()) => eprintln!(
            "tessera: compile debug artifacts of {name} in {}",
            dir.display()
        ),
        Err(e) => eprintln!(
            "tessera: could not write compile debug artifacts to {}: {e}",
            dir.display()
        ),
    }
}

/// A hash of the graph's structure (ops, attributes, wiring, types, hints —
/// not names or call sites), the inputs' guards and which lifted tensors
/// require grad.
///
/// It runs on every call (the cache lookup), so it allocates nothing per
/// node: ops hash their attributes directly ([`crate::ir::Op::hash_structure`]),
/// and each distinct hint object (shared by the nodes of its scope) is
/// spelled once.
fn structure_key(graph: &Graph, guards: &[InputGuard], lifted: &[Tensor]) -> u64 {
    let mut h = DefaultHasher::new();
    let mut hint_digests: Vec<(*const HintMap, u64)> = Vec::new();
    for node in &graph.nodes {
        node.op.hash_structure(&mut h);
        node.inputs.hash(&mut h);
        node.ty.hash(&mut h);
        node.meta
            .hints
            .as_ref()
            .map(|m| hint_digest(m, &mut hint_digests))
            .hash(&mut h);
    }
    for out in &graph.outputs {
        out.node.hash(&mut h);
    }
    guards.hash(&mut h);
    lifted
        .iter()
        .map(|t| (t.requires_grad(), t.is_contiguous()))
        .collect::<Vec<_>>()
        .hash(&mut h);
    h.finish()
}

/// The hash of a hint object's JSON text, computed once per distinct object
/// (`seen` holds those met so far in this graph).
fn hint_digest(map: &Arc<HintMap>, seen: &mut Vec<(*const HintMap, u64)>) -> u64 {
    let ptr = Arc::as_ptr(map);
    if let Some(&(_, digest)) = seen.iter().find(|(p, _)| *p == ptr) {
        return digest;
    }
    let mut h = DefaultHasher::new();
    serde_json::to_string(&**map)
        .expect("a JSON object prints")
        .hash(&mut h);
    let digest = h.finish();
    seen.push((ptr, digest));
    digest
}
