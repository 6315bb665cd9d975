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
//! by changed sizes, every dim becomes symbolic (those that meet constants of
//! their size are specialised again) and the graph is generalised
//! over them (`compile/dynamic.rs`), so one executable then serves every size.
//!
//! Buffer donation ([`Compiled::try_call_donating`], as JAX's
//! `donate_argnums`): a call may hand some arguments over by value. The
//! memory plan then treats each donated input as a buffer of the run, alive
//! until its last read, which a fused kernel (or a matmul's epilogue)
//! reading it last may overwrite with an output of its size and dtype — a
//! graph output too, which then lives on in the caller's storage instead
//! of a fresh allocation, and a donated input that nothing overwrites is
//! freed after its last read. Donation is checked, not trusted: an input is
//! written over only if the call's tensor is its only handle and dense, so
//! a clone the caller kept reads as before (the output gets its own buffer,
//! and `TESSERA_LOGS=memory` says the input was still shared). Which
//! inputs are donated is part of the guards (a donating call and a plain
//! one get different executables). An executable with a backward does not
//! donate (it saves its inputs for the backward). The memory plan's log
//! counts the values written over donated inputs, and its bytes for a run
//! (arena + escaping) no longer include them. [`train_step`] donates the
//! parameters and the optimizer's state.

mod build;
mod cache;
mod capture;
mod debug;
mod dynamic;
mod executable;
mod graph;
mod guards;
mod hint_report;
mod options;
mod raised;
mod recompile;
mod train_step;

use std::sync::{Arc, Mutex};

pub use cache::CompileStats;
pub use executable::Executable;
pub use graph::{compile_graph, CompiledGraph, GraphFn};
pub use guards::{miss_reason, InputGuard};
pub use options::{Backend, CompileOptions, Mode};
pub use train_step::{train_step, DataParallel, StepFn, TrainStep};

use crate::error::{Result, SourceLoc};
use crate::ir::Graph;
use crate::logging::log;
use crate::schedule::Donations;
use crate::tensor::trace::{StateWrite, Traced};
use crate::tensor::Tensor;
use cache::CacheState;
use dynamic::Generalised;
use guards::guards_device;

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
    pub fn stats(&self) -> CompileStats {
        self.state.lock().expect("compile cache").stats
    }

    /// How often values computed from frozen tensors alone (a batch norm
    /// folded into a convolution's weights, in inference) were computed,
    /// over every executable of the cache: once per executable until a
    /// tensor they read is replaced (see `executable::frozen`).
    pub fn frozen_computes(&self) -> usize {
        let state = self.state.lock().expect("compile cache");
        state.entries.iter().map(|e| e.exe.frozen_computes()).sum()
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

    /// Runs the compiled function: the cached executable whose key the
    /// trace of this call has, compiled on a miss (or `f` itself past the
    /// recompile limit).
    #[track_caller]
    pub fn try_call(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.call_with(&mut inputs.to_vec(), &Donations::default())
    }

    /// [`Compiled::try_call`] donating the arguments at positions `donate`
    /// (buffer donation, as JAX's `donate_argnums`): the call takes `args`
    /// (leaving it empty) when the executable starts, and its memory plan
    /// writes outputs of their size and dtype over the donated ones after
    /// their last read instead of allocating — a training step's new
    /// parameters over the old ones. An argument is written over only if
    /// its tensor in `args` is its only handle (no clone, view or
    /// autograd record elsewhere) and dense; otherwise its output gets a
    /// buffer of its own (`TESSERA_LOGS=memory` says so), and values are
    /// the same either way.
    ///
    /// Should the call fail before the executable starts (a trace, guard
    /// or compile error, a panic of `f`), `args` is untouched; once it has
    /// started, a failure loses the donated values (some may be
    /// overwritten). A donating call does not speculate, and the eager
    /// fallback and graph breaks do not donate; a device-graph replay
    /// (`mode=reduce-overhead`) records in place the donated inputs its
    /// memory plan writes outputs over, and copies the rest (see
    /// `runtime::replay`).
    /// Donation is part of the guards: a call donating other positions
    /// compiles its own executable (the reason says `donated`).
    #[track_caller]
    pub fn try_call_donating(
        &self,
        args: &mut Vec<Tensor>,
        donate: &[usize],
    ) -> Result<Vec<Tensor>> {
        let donations = checked_donations(args.len(), donate, &[])?;
        self.call_with(args, &donations)
    }

    /// [`Compiled::try_call_donating`] the arguments at `updates`' first
    /// positions, each pair `(argument, output)` saying that the output is
    /// that argument's next value (JAX's `input_output_aliases`; a
    /// training step's new parameters and optimizer state, fed back at the
    /// next call): the memory plan writes each such output over its own
    /// argument where the kernel making it may, and no other value there.
    /// The caller's buffers then stay where they are from call to call
    /// (what a device-graph replay records). Part of the guards, as
    /// donation is.
    #[track_caller]
    pub fn try_call_updating(
        &self,
        args: &mut Vec<Tensor>,
        updates: &[(usize, usize)],
    ) -> Result<Vec<Tensor>> {
        let donate: Vec<usize> = updates.iter().map(|&(i, _)| i).collect();
        let donations = checked_donations(args.len(), &donate, updates)?;
        self.call_with(args, &donations)
    }

    /// The call path: `args` are taken when the executable runs.
    #[track_caller]
    fn call_with(&self, args: &mut Vec<Tensor>, donate: &Donations) -> Result<Vec<Tensor>> {
        let becomes = |i: usize| donate.becomes.iter().find(|p| p.0 == i).map(|p| p.1);
        let guards: Vec<InputGuard> = args
            .iter()
            .enumerate()
            .map(|(i, t)| match donate.contains(i) {
                true => InputGuard::donated(t, becomes(i)),
                false => InputGuard::of(t),
            })
            .collect();
        let inputs: &[Tensor] = args;
        if self.state.lock().expect("compile cache").fell_back {
            return self.run_eagerly(inputs);
        }
        if self.options.mode == Mode::ReduceOverhead || !self.options.retrace {
            let hit = self
                .state
                .lock()
                .expect("compile cache")
                .lookup_by_guards(&guards);
            if let Some(exe) = hit {
                return exe.run_owned(std::mem::take(args));
            }
        }
        let early = match donate.is_empty() {
            true => self
                .speculation(inputs, &guards)
                .map(|(key, exe)| (key, exe.run(inputs, &[]))),
            false => None,
        };
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
                return out.map(|out| install_state(&traced.state, out));
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
                None => return self.run_eagerly_after(&traced, inputs),
            },
        };
        let mut owned = std::mem::take(args);
        owned.extend(traced.lifted);
        owned.extend(traced.materialized.into_iter().map(|(_, t)| t));
        let graphs = [Some(traced.graph), view.traced.map(|t| t.graph)];
        let out = freeing_beside(graphs, || exe.run_owned(owned))?;
        Ok(install_state(&traced.state, out))
    }

    /// The trace as the cache sees it: generalised over the dynamic dims
    /// the options and the recompiles so far make (see [`dynamic::view`]),
    /// unless that graph's symbolic build failed before.
    fn generalised(&self, traced: &Traced, guards: &[InputGuard]) -> Generalised {
        let dims = self.options.dynamic_dims(guards, || {
            self.state
                .lock()
                .expect("compile cache")
                .dynamic_dims
                .clone()
        });
        let view = dynamic::view(traced, guards, &dims);
        let failed = self
            .state
            .lock()
            .expect("compile cache")
            .symbolic_failed
            .contains(&view.key);
        match failed {
            true => dynamic::view(traced, guards, &dynamic::DynamicDims::new()),
            false => view,
        }
    }

    /// Automatic mode, on a miss: the dims whose sizes changed since the
    /// last compile become dynamic. Whether any new dim was added.
    fn widen_dynamic_dims(&self, guards: &[InputGuard]) -> bool {
        if !self.options.widens_dynamic_dims() {
            return false;
        }
        let mut state = self.state.lock().expect("compile cache");
        let state = &mut *state;
        let last = state.last_guards().map(<[InputGuard]>::to_vec);
        let widened = recompile::widen(&mut state.dynamic_dims, last.as_deref(), guards);
        if widened {
            let dims = state.dynamic_dims.clone();
            log("recompiles", || {
                format!("{}: dims now dynamic (input, dim): {dims:?}", self.name)
            });
        }
        widened
    }

    fn lookup(&self, key: u64) -> Option<Arc<Executable>> {
        self.state.lock().expect("compile cache").lookup(key)
    }

    /// The key and executable to start before tracing (see
    /// [`Compiled::speculate`]), when the options ask for speculation.
    fn speculation(
        &self,
        inputs: &[Tensor],
        guards: &[InputGuard],
    ) -> Option<(u64, Arc<Executable>)> {
        if !self.options.speculates(inputs) {
            return None;
        }
        self.state
            .lock()
            .expect("compile cache")
            .speculation(guards)
    }

    fn run_eagerly(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.state.lock().expect("compile cache").stats.eager_calls += 1;
        Ok((self.f)(inputs))
    }

    /// [`Self::run_eagerly`] for a call already traced: its random ops
    /// take the seeds the trace drew, so the call draws from the
    /// generators once, as an eager call does.
    fn run_eagerly_after(&self, traced: &Traced, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        crate::tensor::creation::replay_seeds(traced.seeds.clone(), || self.run_eagerly(inputs))
    }
}

/// The fewest nodes of a traced graph that [`freeing_beside`] frees on a
/// thread of its own: a training step's thousands of nodes took about a
/// millisecond to free (their shapes, names and inputs: several
/// allocations each), a tenth of a small compiled step's host time; a
/// small graph's frees cost less than starting the thread.
const FREE_BESIDE_MIN_NODES: usize = 1024;

/// Runs `run` (the executable) while another thread frees the trace that
/// found it, when that trace is large: its frees then take no time of the
/// call's (the executor's workers run the kernels meanwhile, and the
/// caller's thread would only wait for them).
/// (Only graphs go there: a tensor dropped meanwhile could change which
/// buffers the run may write over.)
fn freeing_beside<R>(graphs: [Option<Graph>; 2], run: impl FnOnce() -> R) -> R {
    let nodes: usize = graphs.iter().flatten().map(|g| g.nodes.len()).sum();
    if nodes < FREE_BESIDE_MIN_NODES {
        let out = run();
        drop(graphs);
        return out;
    }
    std::thread::scope(|s| {
        s.spawn(move || drop(graphs));
        run()
    })
}

/// Splits the module state the traced call wrote ([`Traced::state`]: the
/// last outputs) off a run's outputs and installs it in its slots: a batch
/// norm's running statistics, updated as the eager call updates them.
fn install_state(state: &[StateWrite], mut out: Vec<Tensor>) -> Vec<Tensor> {
    let n: usize = state.iter().map(|w| w.count).sum();
    if n == 0 {
        return out;
    }
    let mut values = out.split_off(out.len() - n).into_iter();
    for write in state {
        let v: Vec<Tensor> = values
            .by_ref()
            .take(write.count)
            .map(|t| t.detach())
            .collect();
        write.slot.install(v);
    }
    out
}

/// The donations of a call with `n_args` arguments: the positions `donate`
/// (each once, in range) and the `(argument, output)` pairs `updates`
/// (each argument and each output paired once).
fn checked_donations(
    n_args: usize,
    donate: &[usize],
    updates: &[(usize, usize)],
) -> Result<Donations> {
    let bad = |message: String| {
        crate::error::Error::op(crate::error::ErrorKind::Argument, "compile", message)
    };
    if let Some(&i) = donate.iter().find(|&&i| i >= n_args) {
        return Err(bad(format!(
            "cannot donate argument {i} of a call with {n_args} arguments"
        )));
    }
    let mut inputs = donate.to_vec();
    inputs.sort_unstable();
    inputs.dedup();
    let mut outputs: Vec<usize> = updates.iter().map(|&(_, o)| o).collect();
    outputs.sort_unstable();
    outputs.dedup();
    if !updates.is_empty() && (inputs.len() != donate.len() || outputs.len() != updates.len()) {
        return Err(bad(format!(
            "an argument or an output paired twice in {updates:?}"
        )));
    }
    Ok(Donations {
        inputs,
        becomes: updates.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DType;
    use std::cell::Cell;

    #[test]
    fn donations_are_checked_in_range_and_paired_once() {
        let d = checked_donations(3, &[2, 0], &[]).unwrap();
        assert_eq!(d.inputs, [0, 2]);
        let e = checked_donations(2, &[2], &[]).unwrap_err();
        assert!(
            e.to_string()
                .contains("cannot donate argument 2 of a call with 2"),
            "{e}"
        );
        let d = checked_donations(3, &[1, 2], &[(1, 0), (2, 1)]).unwrap();
        assert_eq!(d.becomes, [(1, 0), (2, 1)]);
        for twice in [[(1, 0), (1, 1)], [(1, 0), (2, 0)]] {
            let donate: Vec<usize> = twice.iter().map(|p| p.0).collect();
            let e = checked_donations(3, &donate, &twice).unwrap_err();
            assert!(e.to_string().contains("paired twice"), "{e}");
        }
    }

    fn x(n: usize) -> [Tensor; 1] {
        [Tensor::from_vec((0..n).map(|i| i as f64).collect(), &[n])]
    }

    #[test]
    fn the_default_name_is_the_callers_file_and_line() {
        let f = compile(|x: &[Tensor]| x.to_vec());
        assert_eq!(f.name, format!("mod_{}", line!() - 1));
    }

    #[test]
    fn after_the_fallback_every_call_runs_f_without_tracing() {
        let f = compile(|x: &[Tensor]| vec![x[0].exp()]);
        f.state.lock().unwrap().fell_back = true;
        let out = f.call(&x(3));
        assert_eq!(out[0].to_f64_vec(), x(3)[0].exp().to_f64_vec());
        let s = f.stats();
        assert_eq!((s.eager_calls, s.compiles, s.trace_seconds), (1, 0, 0.0));
    }

    /// `f` (which multiplies by `scale`, now 2) serves a guard hit without
    /// a trace. The assumption made visible: captured state that changes
    /// the graph is not seen while the guards match; other guards trace and
    /// see it.
    fn serves_guard_hits_untraced<F: Fn(&[Tensor]) -> Vec<Tensor>>(
        f: Compiled<F>,
        scale: &Cell<f64>,
    ) {
        assert_eq!(f.call(&x(3))[0].to_f64_vec(), vec![0.0, 2.0, 4.0]);
        let traced = f.stats().trace_seconds;
        scale.set(3.0);
        assert_eq!(f.call(&x(3))[0].to_f64_vec(), vec![0.0, 2.0, 4.0]);
        let s = f.stats();
        assert_eq!((s.compiles, s.cache_hits, s.trace_seconds), (1, 1, traced));
        assert_eq!(f.call(&x(2))[0].to_f64_vec(), vec![0.0, 3.0]);
        assert_eq!(f.stats().compiles, 2);
    }

    #[test]
    fn reduce_overhead_and_retrace_false_serve_matching_guards_without_a_trace() {
        let scale = Cell::new(2.0);
        let f = compile(|x: &[Tensor]| vec![&x[0] * scale.get()]).mode(Mode::ReduceOverhead);
        serves_guard_hits_untraced(f, &scale);
        scale.set(2.0);
        let f = compile(|x: &[Tensor]| vec![&x[0] * scale.get()]).retrace(false);
        serves_guard_hits_untraced(f, &scale);
        // The default traces every call and sees the change.
        scale.set(2.0);
        let g = compile(|x: &[Tensor]| vec![&x[0] * scale.get()]);
        g.call(&x(3));
        scale.set(3.0);
        assert_eq!(g.call(&x(3))[0].to_f64_vec(), vec![0.0, 3.0, 6.0]);
    }

    /// A chain of `2 × links` ops: `x ↦ (x + 1)·0.5`, repeated (exact in
    /// any order of evaluation: no product to contract into an FMA).
    fn chain(x: &Tensor, links: usize) -> Tensor {
        (0..links).fold(x.clone(), |y, _| (&y + 1.0) * 0.5)
    }

    #[test]
    fn a_large_trace_is_freed_beside_the_run_with_eagers_values() {
        let f = compile(|x: &[Tensor]| vec![chain(&x[0], FREE_BESIDE_MIN_NODES / 2)]);
        let nodes = f.capture(&x(5)).unwrap().graph.nodes.len();
        assert!(nodes >= FREE_BESIDE_MIN_NODES, "{nodes} nodes");
        let want = chain(&x(5)[0], FREE_BESIDE_MIN_NODES / 2).to_f64_vec();
        for _ in 0..3 {
            assert_eq!(f.call(&x(5))[0].to_f64_vec(), want);
        }
        assert_eq!(f.stats().compiles, 1);
    }

    #[test]
    fn a_speculative_run_counts_as_a_hit_when_the_trace_agrees() {
        let f = compile(|x: &[Tensor]| vec![x[0].tanh()]).speculate(Some(true));
        for _ in 0..3 {
            assert_eq!(f.call(&x(4))[0].to_f64_vec(), x(4)[0].tanh().to_f64_vec());
        }
        let s = f.stats();
        assert_eq!((s.compiles, s.cache_hits), (1, 2));
        assert_eq!((s.speculations, s.speculation_misses), (2, 0));
    }

    #[test]
    fn a_size_recompile_makes_the_dims_dynamic_in_automatic_mode() {
        let f = compile(|x: &[Tensor]| vec![x[0].exp() * 2.0]);
        let g = |n: usize| vec![InputGuard::of(&Tensor::zeros(&[n], DType::F64))];
        assert!(!f.widen_dynamic_dims(&g(3)), "nothing compiled yet");
        f.call(&x(8));
        assert!(f.widen_dynamic_dims(&g(16)));
        assert_eq!(
            f.state.lock().unwrap().dynamic_dims,
            dynamic::DynamicDims::from([(0, 0)])
        );
        assert!(!f.widen_dynamic_dims(&g(32)), "already dynamic");
        let fixed = compile(|x: &[Tensor]| vec![x[0].exp()]).dynamic(Some(false));
        fixed.call(&x(8));
        assert!(!fixed.widen_dynamic_dims(&g(16)));
    }
}
