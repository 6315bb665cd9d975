//! Building a cache entry: the recompile decision, then the pipeline —
//! AOT autograd, the passes, fusion and the schedule, all in
//! [`Executable::build`] — timed, logged and cached under its key.

use std::sync::Arc;

use super::cache::Entry;
use super::debug;
use super::dynamic::{DynamicDims, Generalised, Refusal};
use super::guards::needs_grad;
use super::recompile::{self, Decision};
use super::{guards_device, Compiled, Executable, InputGuard};
use crate::error::Result;
use crate::logging::log;
use crate::schedule::Donations;
use crate::tensor::trace::Traced;
use crate::tensor::Tensor;

impl<F: Fn(&[Tensor]) -> Vec<Tensor>> Compiled<F> {
    /// Compiles the generalised trace; if that fails to build (a pass or
    /// the AOT partition needing concrete sizes), the concrete one. One
    /// recompile either way.
    pub(super) fn compile_generalised(
        &self,
        view: &Generalised,
        guards: &[InputGuard],
        traced: &Traced,
    ) -> Result<Option<Arc<Executable>>> {
        let lifted: Vec<InputGuard> = traced.lifted.iter().map(InputGuard::of).collect();
        if let Some(refusal) = &view.refusal {
            log("recompiles", || {
                format!(
                    "{}: the graph stays concrete for these sizes: {refusal}",
                    self.name
                )
            });
        }
        if !self.admit(guards, &lifted, view.refusal.as_ref()) {
            return Ok(None);
        }
        let concrete = |key| self.build_entry(key, guards, &lifted, traced, &DynamicDims::new());
        let Some(general) = &view.traced else {
            return concrete(view.key).map(Some);
        };
        match self.build_entry(view.key, guards, &lifted, general, &view.dims) {
            Err(e) => {
                let mut state = self.state.lock().expect("compile cache");
                state.symbolic_failed.push(view.key);
                drop(state);
                log("recompiles", || {
                    format!(
                        "{}: the symbolic graph does not build ({e}); compiling it for these sizes",
                        self.name
                    )
                });
                concrete(super::cache::structure_key(
                    &traced.graph,
                    guards,
                    &traced.lifted,
                ))
                .map(Some)
            }
            done => done.map(Some),
        }
    }

    /// Builds and caches an executable for a concrete trace, or `None` past
    /// the recompile limit (then every later call runs eagerly).
    #[cfg(test)]
    pub(super) fn compile_entry(
        &self,
        key: u64,
        guards: &[InputGuard],
        traced: &Traced,
    ) -> Result<Option<Arc<Executable>>> {
        let lifted: Vec<InputGuard> = traced.lifted.iter().map(InputGuard::of).collect();
        if !self.admit(guards, &lifted, None) {
            return Ok(None);
        }
        self.build_entry(key, guards, &lifted, traced, &DynamicDims::new())
            .map(Some)
    }

    /// The recompile decision for a miss: counts and logs a recompile with
    /// its reason (and why the graph stays concrete, if it does), or falls
    /// back to eager past the limit. Whether to build.
    fn admit(
        &self,
        guards: &[InputGuard],
        lifted: &[InputGuard],
        refusal: Option<&Refusal>,
    ) -> bool {
        let mut state = self.state.lock().expect("compile cache");
        let limit = self.options.recompile_limit;
        let decision = recompile::decide(&state.seen(), guards, lifted, limit);
        let with_refusal = |reason: String| match refusal {
            Some(r) => format!("{reason} (the graph stays concrete: {r})"),
            None => reason,
        };
        match decision {
            Decision::First => true,
            Decision::FallBack(reason) => {
                state.fell_back = true;
                eprintln!(
                    "{}",
                    recompile::fallback_warning(&self.name, limit, &with_refusal(reason))
                );
                false
            }
            Decision::Recompile(reason) => {
                let reason = with_refusal(reason);
                state.stats.recompiles += 1;
                log("recompiles", || {
                    recompile::recompile_message(&self.name, &reason)
                });
                state.recompile_reasons.push(reason);
                true
            }
        }
    }

    /// Builds the executable for `traced` and caches it under `key`.
    fn build_entry(
        &self,
        key: u64,
        guards: &[InputGuard],
        lifted: &[InputGuard],
        traced: &Traced,
        dynamic: &DynamicDims,
    ) -> Result<Arc<Executable>> {
        let mut state = self.state.lock().expect("compile cache");
        debug::log_inputs(&self.name, guards, traced);
        let wrt = grad_inputs(guards, &traced.lifted);
        let started = std::time::Instant::now();
        let on = guards_device(guards, &traced.lifted);
        let donated = Donations {
            inputs: (0..guards.len()).filter(|&i| guards[i].donated).collect(),
            becomes: (0..guards.len())
                .filter_map(|i| Some((i, guards[i].becomes?)))
                .collect(),
        };
        let exe = Arc::new(Executable::build(traced, wrt, &self.options, on, &donated)?);
        state.stats.compile_seconds += started.elapsed().as_secs_f64();
        state.stats.compiles += 1;
        debug::log_output(&exe);
        if debug::dump_requested() {
            debug::dump(&self.name, state.stats.compiles, traced, guards, &exe);
        }
        state.insert(Entry {
            key,
            guards: guards.to_vec(),
            lifted: lifted.to_vec(),
            dynamic: dynamic.clone(),
            had_breaks: !traced.breaks.is_empty(),
            autocast: crate::tensor::autocast::current(),
            exe: exe.clone(),
        });
        Ok(exe)
    }
}

/// The graph inputs gradients flow to: the user inputs, then the lifted
/// tensors, that require grad.
fn grad_inputs(guards: &[InputGuard], lifted: &[Tensor]) -> Vec<usize> {
    guards
        .iter()
        .map(|g| g.requires_grad)
        .chain(lifted.iter().map(needs_grad))
        .enumerate()
        .filter_map(|(i, r)| r.then_some(i))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::compile;
    use crate::ir::DType;

    fn input(shape: &[usize]) -> Tensor {
        Tensor::ones(shape, DType::F64)
    }

    #[test]
    fn gradients_go_to_inputs_then_lifted_tensors_that_require_them() {
        let (a, b) = (input(&[2]), input(&[2]).set_requires_grad(true));
        let guards = [InputGuard::of(&a), InputGuard::of(&b)];
        assert_eq!(grad_inputs(&guards, &[]), vec![1]);
        let lifted = [input(&[1]).set_requires_grad(true), input(&[1])];
        assert_eq!(grad_inputs(&guards, &lifted), vec![1, 2]);
        assert!(grad_inputs(&guards[..1], &lifted[1..]).is_empty());
    }

    #[test]
    fn entries_are_cached_with_their_reasons_until_the_limit() {
        let f = compile(|x: &[Tensor]| vec![x[0].exp()]).recompile_limit(1);
        let build = |n: usize| {
            let x = [input(&[n])];
            let traced = f.capture(&x).unwrap();
            let guards = [InputGuard::of(&x[0])];
            f.compile_entry(n as u64, &guards, &traced).unwrap()
        };
        let first = build(2).expect("the first compile");
        {
            let state = f.state.lock().unwrap();
            assert_eq!((state.entries.len(), state.last_key), (1, Some(2)));
            assert!(Arc::ptr_eq(&state.entries[0].exe, &first));
            assert!(!state.entries[0].had_breaks);
        }
        assert!(build(3).is_some(), "one recompile is allowed");
        assert_eq!(
            f.recompile_reasons(),
            vec!["input 0, dim 0: expected 2, got 3".to_string()]
        );
        assert!(build(4).is_none(), "past the limit");
        let s = f.stats();
        assert_eq!((s.compiles, s.recompiles), (2, 1));
        let state = f.state.lock().unwrap();
        assert!(state.fell_back);
        assert_eq!(state.entries.len(), 2, "nothing cached past the limit");
        assert_eq!(state.recompile_reasons.len(), 1);
    }

    #[test]
    fn an_entry_remembers_its_graph_breaks() {
        let f = compile(|x: &[Tensor]| {
            let s = x[0].sum(&[], false).item();
            vec![&x[0] * s]
        });
        let x = [input(&[3])];
        let traced = f.capture(&x).unwrap();
        let exe = f
            .compile_entry(9, &[InputGuard::of(&x[0])], &traced)
            .unwrap()
            .unwrap();
        assert!(f.state.lock().unwrap().entries[0].had_breaks);
        // The break's value is an input of the executable.
        let extra: Vec<Tensor> = traced.materialized.iter().map(|(_, t)| t.clone()).collect();
        assert_eq!(extra.len(), 1);
        assert_eq!(exe.run(&x, &extra).unwrap()[0].to_f64_vec(), vec![3.0; 3]);
    }
}
