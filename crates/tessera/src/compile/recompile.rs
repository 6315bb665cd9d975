//! Recompilation policy: what a miss on a known function does. A miss
//! recompiles, logged with its reason (the first guard that fails, or a
//! changed graph); past `recompile_limit` the function runs eagerly from
//! then on, with one warning. In automatic dynamic mode the dims whose
//! sizes changed become symbolic first, so one executable may serve the
//! miss and every later size.

use super::dynamic::{self, DynamicDims};
use super::{miss_reason, InputGuard};

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

/// The decision for a miss with `guards`, when `cached` executables exist,
/// the last built for `last` (its guards), under `limit` recompiles.
pub(super) fn decide(
    last: Option<&[InputGuard]>,
    guards: &[InputGuard],
    cached: usize,
    limit: usize,
) -> Decision {
    let Some(last) = last else {
        return Decision::First;
    };
    let reason = miss_reason(last, guards).unwrap_or_else(|| GRAPH_CHANGED.into());
    if cached > limit {
        Decision::FallBack(reason)
    } else {
        Decision::Recompile(reason)
    }
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

/// Automatic dynamic dims, on a miss: adds the dims whose sizes changed
/// since the last compile (`last`, its guards) to `dims`. Whether any new
/// dim was added (then the trace is generalised again before compiling).
pub(super) fn widen(
    dims: &mut DynamicDims,
    last: Option<&[InputGuard]>,
    guards: &[InputGuard],
) -> bool {
    let Some(last) = last else {
        return false;
    };
    let before = dims.len();
    dims.extend(dynamic::changed_dims(last, guards));
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

    #[test]
    fn the_first_compile_is_no_recompile() {
        assert_eq!(decide(None, &guards(&[&[2]]), 0, 8), Decision::First);
        // Even with a limit of zero.
        assert_eq!(decide(None, &guards(&[&[2]]), 0, 0), Decision::First);
    }

    #[test]
    fn a_recompile_names_the_first_failing_guard() {
        let (old, new) = (guards(&[&[8, 4], &[4]]), guards(&[&[16, 4], &[5]]));
        assert_eq!(
            decide(Some(&old), &new, 1, 8),
            Decision::Recompile("input 0, dim 0: expected 8, got 16".into())
        );
        let fewer = guards(&[&[8, 4]]);
        assert_eq!(
            decide(Some(&old), &fewer, 1, 8),
            Decision::Recompile("expected 2 inputs, got 1".into())
        );
    }

    #[test]
    fn passing_guards_mean_the_graph_changed() {
        let g = guards(&[&[3]]);
        let Decision::Recompile(reason) = decide(Some(&g), &g, 1, 8) else {
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
        let (old, new) = (guards(&[&[1]]), guards(&[&[2]]));
        let reason = "input 0, dim 0: expected 1, got 2".to_string();
        // Limit 2: the first compile and 2 recompiles make 3 executables;
        // the miss after them falls back.
        assert_eq!(
            decide(Some(&old), &new, 2, 2),
            Decision::Recompile(reason.clone())
        );
        assert_eq!(
            decide(Some(&old), &new, 3, 2),
            Decision::FallBack(reason.clone())
        );
        // Limit 0: the first miss falls back.
        assert_eq!(
            decide(Some(&old), &new, 1, 0),
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
    fn widening_adds_only_changed_dims_of_equal_rank() {
        let mut dims = DynamicDims::new();
        assert!(
            !widen(&mut dims, None, &guards(&[&[8, 4]])),
            "nothing to compare"
        );
        let old = guards(&[&[8, 4], &[3]]);
        assert!(widen(&mut dims, Some(&old), &guards(&[&[16, 4], &[3, 1]])));
        assert_eq!(
            dims,
            DynamicDims::from([(0, 0)]),
            "rank changes are not dims"
        );
        // The same change again adds nothing: the recompile is not dynamic.
        assert!(!widen(&mut dims, Some(&old), &guards(&[&[32, 4], &[3]])));
        assert!(widen(&mut dims, Some(&old), &guards(&[&[8, 5], &[3]])));
        assert_eq!(dims, DynamicDims::from([(0, 0), (0, 1)]));
    }
}
