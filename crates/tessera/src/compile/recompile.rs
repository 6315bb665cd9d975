//! Recompilation policy: what a miss on a known function does. A miss
//! recompiles, logged with its reason (the first guard that fails, or a
//! changed graph); past `recompile_limit` the function runs eagerly from
//! then on, with one warning. In automatic dynamic mode the dims whose
//! sizes changed become symbolic first, so one executable may serve the
//! miss and every later size.

use super::dynamic::{self, DynamicDims};
use super::guards::miss_reason_with;
use super::InputGuard;

/// The reason of a miss whose inputs pass the last entry's guards.
pub(super) const GRAPH_CHANGED: &str =
    "the traced graph changed (captured state or data-dependent control flow)";

/// What a miss leads to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Decision {
    /// Nothing cached yet: the first compile.
    First,
    /// Build another executable, for this reason.
    Recompile(String),
    /// The limit is reached: run eagerly from now on (the reason is that
    /// of the miss that crossed it).
    FallBack(String),
}

/// What a cached executable was built for: its inputs' guards, its lifted
/// tensors' and the dims it has symbolic.
#[derive(Clone, Copy)]
pub(super) struct Seen<'a> {
    pub inputs: &'a [InputGuard],
    pub lifted: &'a [InputGuard],
    pub dynamic: &'a DynamicDims,
}

/// The decision for a miss of a call with `inputs` and `lifted` guards,
/// given what the cached executables were built for (`seen`, oldest
/// first), under `limit` recompiles.
pub(super) fn decide(
    seen: &[Seen],
    inputs: &[InputGuard],
    lifted: &[InputGuard],
    limit: usize,
) -> Decision {
    if seen.is_empty() {
        return Decision::First;
    }
    let reason = closest_miss(seen, inputs, lifted);
    if seen.len() > limit {
        Decision::FallBack(reason)
    } else {
        Decision::Recompile(reason)
    }
}

/// The reason of the miss of the executable the call comes closest to
/// (least [`InputGuard::distance`] summed; the latest on ties): a call at a
/// new size whose other inputs match one executable is reported against
/// that one, not against whichever was built last.
fn closest_miss(seen: &[Seen], inputs: &[InputGuard], lifted: &[InputGuard]) -> String {
    let none = DynamicDims::new();
    let misses = |s: &Seen| -> (usize, Option<String>) {
        let count = |e: &[InputGuard], a: &[InputGuard], dynamic: &DynamicDims| {
            if e.len() != a.len() {
                return e.len().max(a.len());
            }
            (0..e.len())
                .map(|i| e[i].distance(&a[i], &|d| dynamic.contains(&(i, d))))
                .sum()
        };
        let n = count(s.inputs, inputs, s.dynamic) + count(s.lifted, lifted, &none);
        let reason = miss_reason_with(s.inputs, inputs, "input", s.dynamic)
            .or_else(|| miss_reason_with(s.lifted, lifted, "captured tensor", &none));
        (n, reason)
    };
    let mut best: Option<(usize, Option<String>)> = None;
    for s in seen.iter().rev() {
        let m = misses(s);
        if best.as_ref().is_none_or(|b| m.0 < b.0) {
            best = Some(m);
        }
    }
    best.and_then(|(_, r)| r)
        .unwrap_or_else(|| GRAPH_CHANGED.into())
}

/// The one warning printed when a function falls back to eager.
pub(super) fn fallback_warning(name: &str, limit: usize, reason: &str) -> String {
    format!(
        "tessera: warning: {name} recompiled more than {limit} times (last: {reason}); running it eagerly from now on"
    )
}

/// The log line of a recompile (topic `recompiles`).
pub(super) fn recompile_message(name: &str, reason: &str) -> String {
    format!("{name}: recompiling: {reason}")
}

/// Automatic dynamic dims, on a miss: once any size has changed since the
/// last compile (`last`, its guards), every dim of every input becomes
/// dynamic, so that one symbolic executable serves whichever size changes
/// next (the batch first, the sequence length later). Dims that meet a
/// constant of their size (a feature dim meeting a weight) are specialised
/// again when the graph is generalised (see `dynamic::generalise`).
/// Whether any new dim was added (then the trace is generalised again).
pub(super) fn widen(
    dims: &mut DynamicDims,
    last: Option<&[InputGuard]>,
    guards: &[InputGuard],
) -> bool {
    let Some(last) = last else {
        return false;
    };
    if dynamic::changed_dims(last, guards).is_empty() {
        return false;
    }
    let before = dims.len();
    dims.extend(dynamic::all_dims(guards));
    dims.len() > before
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DType;
    use crate::tensor::Tensor;

    fn guards(shapes: &[&[usize]]) -> Vec<InputGuard> {
        shapes
            .iter()
            .map(|s| InputGuard::of(&Tensor::zeros(s, DType::F32)))
            .collect()
    }

    fn seen<'a>(inputs: &'a [InputGuard], dynamic: &'a DynamicDims) -> Seen<'a> {
        Seen {
            inputs,
            lifted: &[],
            dynamic,
        }
    }

    #[test]
    fn the_first_compile_is_no_recompile() {
        assert_eq!(decide(&[], &guards(&[&[2]]), &[], 8), Decision::First);
        // Even with a limit of zero.
        assert_eq!(decide(&[], &guards(&[&[2]]), &[], 0), Decision::First);
    }

    #[test]
    fn a_recompile_names_the_first_failing_guard() {
        let none = DynamicDims::new();
        let (old, new) = (guards(&[&[8, 4], &[4]]), guards(&[&[16, 4], &[5]]));
        assert_eq!(
            decide(&[seen(&old, &none)], &new, &[], 8),
            Decision::Recompile("input 0, dim 0: expected 8, got 16".into())
        );
        let fewer = guards(&[&[8, 4]]);
        assert_eq!(
            decide(&[seen(&old, &none)], &fewer, &[], 8),
            Decision::Recompile("expected 2 inputs, got 1".into())
        );
    }

    #[test]
    fn the_reason_is_that_of_the_closest_executable() {
        let none = DynamicDims::new();
        let f64_call = vec![InputGuard::of(&Tensor::zeros(&[4], DType::F64))];
        let f32_call = guards(&[&[4]]);
        let f32_grad = vec![InputGuard::of(
            &Tensor::zeros(&[4], DType::F32).set_requires_grad(true),
        )];
        // Built for f32, then for f64: a requires_grad change of the f32
        // call is reported as that, not as a dtype change against the f64.
        let built = [seen(&f32_call, &none), seen(&f64_call, &none)];
        assert_eq!(
            decide(&built, &f32_grad, &[], 8),
            Decision::Recompile("input 0: expected requires_grad=false, got true".into())
        );
        // A dynamic dim is no reason; a captured tensor's change is.
        let dynamic = DynamicDims::from([(0, 0)]);
        let lifted = guards(&[&[3]]);
        let lifted_grad = vec![InputGuard::of(
            &Tensor::zeros(&[3], DType::F32).set_requires_grad(true),
        )];
        let symbolic = [Seen {
            inputs: &f32_call,
            lifted: &lifted,
            dynamic: &dynamic,
        }];
        assert_eq!(
            decide(&symbolic, &guards(&[&[9]]), &lifted_grad, 8),
            Decision::Recompile("captured tensor 0: expected requires_grad=false, got true".into())
        );
    }

    #[test]
    fn passing_guards_mean_the_graph_changed() {
        let none = DynamicDims::new();
        let g = guards(&[&[3]]);
        let Decision::Recompile(reason) = decide(&[seen(&g, &none)], &g, &[], 8) else {
            panic!("a recompile")
        };
        assert!(reason.starts_with("the traced graph changed"), "{reason}");
        assert_eq!(
            recompile_message("f_3", &reason),
            format!("f_3: recompiling: {reason}")
        );
    }

    #[test]
    fn the_limit_counts_recompiles_not_executables() {
        let none = DynamicDims::new();
        let (old, new) = (guards(&[&[1]]), guards(&[&[2]]));
        let reason = "input 0, dim 0: expected 1, got 2".to_string();
        let built = |n: usize| vec![seen(&old, &none); n];
        // Limit 2: the first compile and 2 recompiles make 3 executables;
        // the miss after them falls back.
        assert_eq!(
            decide(&built(2), &new, &[], 2),
            Decision::Recompile(reason.clone())
        );
        assert_eq!(
            decide(&built(3), &new, &[], 2),
            Decision::FallBack(reason.clone())
        );
        // Limit 0: the first miss falls back.
        assert_eq!(
            decide(&built(1), &new, &[], 0),
            Decision::FallBack(reason.clone())
        );
        let warning = fallback_warning("model_12", 2, &reason);
        assert_eq!(
            warning,
            "tessera: warning: model_12 recompiled more than 2 times \
             (last: input 0, dim 0: expected 1, got 2); running it eagerly from now on"
        );
    }

    #[test]
    fn a_size_change_makes_every_dim_dynamic() {
        let mut dims = DynamicDims::new();
        assert!(
            !widen(&mut dims, None, &guards(&[&[8, 4]])),
            "nothing to compare"
        );
        let old = guards(&[&[8, 4], &[3]]);
        assert!(!widen(&mut dims, Some(&old), &old), "no size changed");
        assert!(widen(&mut dims, Some(&old), &guards(&[&[16, 4], &[3]])));
        assert_eq!(dims, DynamicDims::from([(0, 0), (0, 1), (1, 0)]));
        // Again: nothing new, the recompile is not a dynamic one.
        assert!(!widen(&mut dims, Some(&old), &guards(&[&[32, 4], &[3]])));
    }
}
