//! Graph-to-graph rewrites ("passes") and the [`PassManager`] that runs them.
//!
//! A pass is a named function `fn(&mut Graph, &PassContext) -> Result<bool>`
//! that returns whether it changed the graph ([`Pass`]). Each lives in its
//! own file with golden before/after tests in the IR text form; all of them
//! edit graphs only through [`rewrite`], so every pass leaves a verified graph
//! in SSA order, keeps the graph's inputs (even unused ones) and outputs, and
//! gives each node it creates the call site and hints of the node it replaces.
//! No pass merges nodes whose `meta.hints` differ.
//!
//! | pass | rewrites |
//! |---|---|
//! | [`slice`](mod@slice) | a region hinted `{"slice": {"dim": D, "parts": P}}` → P slices along D, concatenated |
//! | [`dce`] | removes nodes no output depends on |
//! | [`cse`] | merges nodes with the same op, attributes, inputs and hints |
//! | [`constant_fold`] | evaluates ops on constants once (small results) |
//! | [`constant_propagation`] | `(x + c2) + c1` → `x + (c1 + c2)`, same for `*` |
//! | [`neutral_elements`] | `x*1`, `x+0`, `x-0`, `x/1`, `pow(x,1)`, no-op views and casts |
//! | [`absorbing_elements`] | `x*0` → 0, `x-x` → 0 (floats: `unsafe_math`), `pow(x,0)` → 1 |
//! | [`hoisting`] | `x*a + x*b` → `x*(a+b)` |
//! | [`node_reduction`] | `x+x+x` → `3*x` |
//! | [`broadcast_minimisation`] | `(m1+s1)+(m2+s2)` → `(m1+m2)+(s1+s2)` for broadcast `s` |
//! | [`transpose_matmul`] | `matmul(permute(x), y)` → `matmul_t` with a transpose flag; `permute(matmul(a, b))` → `matmul_t(b, a)` |
//! | [`movement`] | composes permutes, reshapes, expands and slices; drops full slices |
//! | [`conv_epilogue`] | `conv(x, w) · s + c` per channel, then `relu` → `conv(x, w·s, c)` with its ReLU epilogue (batch norm folded for inference; bias, squeeze + bias) |
//! | [`attention`] | `softmax(q·kᵀ·scale [+ mask] [causal]) · v` → the flash attention op |
//! | [`batch_attention`] | per-slice flash attention ops concatenated back → one op (under `strict` or a budget only when its memory estimate allows) |
//! | [`decompose`] | softmax, log_softmax, silu into primitives (only when asked) |
//!
//! # Floating-point honesty
//!
//! Integer arithmetic wraps (two's complement), so every rewrite above is
//! exact on integers and runs whatever the flags say. On floats, a rewrite
//! that rounds differently runs only under
//! [`PassContext::allow_reassociation`], and one that changes results for
//! NaN or infinite inputs only under [`PassContext::unsafe_math`]. The rest
//! (CSE, DCE, folding with the runtime's own kernels, `x*1`, `x-0`, `x+(-0)`,
//! views, `x+x` → `2*x`, `x+x+x` → `3*x`, `pow(x,0)` → 1) give bit-identical
//! results. [`decompose`] changes rounding (a composite kernel and its
//! primitives round differently) and runs only when a pipeline names it.

pub mod absorbing_elements;
pub mod attention;
pub mod batch_attention;
pub mod broadcast_minimisation;
pub mod constant_fold;
pub mod constant_propagation;
pub mod conv_epilogue;
pub mod cse;
pub mod dce;
pub mod decompose;
pub mod hoisting;
mod manager;
pub mod movement;
pub mod neutral_elements;
pub mod node_reduction;
pub mod pattern;
pub mod rewrite;
pub mod slice;
pub mod transpose_matmul;

pub use manager::{PassManager, PassReport, PassRun};

use crate::error::Result;
use crate::ir::Graph;

/// What the passes may assume about floating-point arithmetic.
#[derive(Clone, Debug, PartialEq)]
pub struct PassContext {
    /// Allows float rewrites that are exact in real arithmetic but round
    /// differently: reassociation (`(x+c1)+c2` → `x+(c1+c2)`), distribution
    /// (`x*a+x*b` → `x*(a+b)`), regrouping of broadcast operands, `n*x` for a
    /// sum of more than 3 copies of `x`, `x + 0.0` → `x` (which differs
    /// only in the sign of a zero result: `-0.0 + 0.0` is `+0.0`), and the
    /// flash attention op in place of attention's composite (its tiles sum
    /// in another order). Results
    /// move by a few ulps of the terms involved; an intermediate that
    /// overflows in one order may stay finite in the other. On by default,
    /// as in TensorFlow's Grappler (its arithmetic optimizer hoists and
    /// regroups by default); off gives results bit-identical to eager.
    pub allow_reassociation: bool,
    /// Allows float rewrites that are exact for finite inputs only:
    /// `x*0` → `0` and `x-x` → `0` (NaN when `x` is NaN or ±inf, and `x*0`
    /// is `-0.0` for negative `x`). Off by default.
    pub unsafe_math: bool,
    /// The most elements a folded constant may have: larger results are
    /// left to run (a graph should not carry megabytes of literals).
    pub fold_limit: usize,
    /// The positions of the graph inputs that gradients will be taken with
    /// respect to; `None`: unknown, any may be. A rewrite into an op that
    /// does not differentiate one of its operands (the attention mask)
    /// only happens where that operand depends on none of them.
    pub grad_inputs: Option<Vec<usize>>,
}

impl Default for PassContext {
    fn default() -> PassContext {
        PassContext {
            allow_reassociation: true,
            unsafe_math: false,
            fold_limit: 4096,
            grad_inputs: None,
        }
    }
}

impl PassContext {
    /// Only rewrites that keep every result bit-identical — except matmul,
    /// whose last bits may change when a pass changes an operand's layout
    /// (gemm's summation order depends on strides).
    pub fn exact() -> PassContext {
        PassContext {
            allow_reassociation: false,
            ..PassContext::default()
        }
    }
}

/// A graph rewrite: its name (as `--passes` spells it) and its function,
/// which returns whether it changed the graph.
#[derive(Clone, Copy)]
pub struct Pass {
    pub name: &'static str,
    pub run: fn(&mut Graph, &PassContext) -> Result<bool>,
}

impl std::fmt::Debug for Pass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

/// Every pass, in the default pipeline's order, then the ones it leaves out.
pub const ALL: &[Pass] = &[
    Pass {
        name: "slice",
        run: slice::run,
    },
    Pass {
        name: "movement",
        run: movement::run,
    },
    Pass {
        name: "neutral_elements",
        run: neutral_elements::run,
    },
    Pass {
        name: "absorbing_elements",
        run: absorbing_elements::run,
    },
    Pass {
        name: "constant_fold",
        run: constant_fold::run,
    },
    Pass {
        name: "cse",
        run: cse::run,
    },
    Pass {
        name: "conv_epilogue",
        run: conv_epilogue::run,
    },
    Pass {
        name: "attention",
        run: attention::run,
    },
    Pass {
        name: "batch_attention",
        run: batch_attention::run,
    },
    Pass {
        name: "constant_propagation",
        run: constant_propagation::run,
    },
    Pass {
        name: "node_reduction",
        run: node_reduction::run,
    },
    Pass {
        name: "hoisting",
        run: hoisting::run,
    },
    Pass {
        name: "broadcast_minimisation",
        run: broadcast_minimisation::run,
    },
    Pass {
        name: "transpose_matmul",
        run: transpose_matmul::run,
    },
    Pass {
        name: "dce",
        run: dce::run,
    },
    Pass {
        name: "decompose",
        run: decompose::run,
    },
];

/// The passes of [`PassManager::default_pipeline`]: all but `decompose`,
/// which fusion asks for when it wants primitives. `slice` runs first: it
/// slices the user's code as written, before the others reshape it.
/// `attention` runs after
/// the clean-ups that put attention into the form it matches (permutes
/// composed, constants folded and shared) and, like every pass here, before
/// `decompose`, which would split the softmax it looks for.
pub const DEFAULT_PIPELINE: &[&str] = &[
    "slice",
    "movement",
    "neutral_elements",
    "absorbing_elements",
    "constant_fold",
    "cse",
    "conv_epilogue",
    "attention",
    "batch_attention",
    "constant_propagation",
    "node_reduction",
    "hoisting",
    "broadcast_minimisation",
    "transpose_matmul",
    "dce",
];

/// The pass called `name`.
pub fn by_name(name: &str) -> Option<Pass> {
    ALL.iter().copied().find(|p| p.name == name)
}

#[cfg(test)]
pub(crate) mod testing {
    //! Golden tests: a graph in the text form before and after one pass.

    use super::PassContext;
    use crate::error::Result;
    use crate::ir::text::parse;
    use crate::ir::Graph;

    type PassFn = fn(&mut Graph, &PassContext) -> Result<bool>;

    /// Runs `pass` on `before` and returns whether it said it changed the
    /// graph and the graph's text afterwards (verified).
    pub fn rewrite(pass: PassFn, ctx: &PassContext, before: &str) -> (bool, String) {
        let mut g = parse(before).unwrap_or_else(|e| panic!("bad test graph: {e}\n{before}"));
        let changed = pass(&mut g, ctx).unwrap();
        g.verify()
            .unwrap_or_else(|e| panic!("pass left an invalid graph: {e}\n{g}"));
        (changed, g.to_string())
    }

    /// `pass` turns `before` into exactly `after` and says so.
    #[track_caller]
    pub fn assert_rewrites(pass: PassFn, ctx: &PassContext, before: &str, after: &str) {
        let (changed, text) = rewrite(pass, ctx, before);
        assert_eq!(text, after, "\ngot:\n{text}\nexpected:\n{after}");
        assert!(changed, "the pass changed the graph but said it did not");
    }

    /// `pass` leaves `before` as it is and says so.
    #[track_caller]
    pub fn assert_unchanged(pass: PassFn, ctx: &PassContext, before: &str) {
        let (changed, text) = rewrite(pass, ctx, before);
        let expected = parse(before).unwrap().to_string();
        assert_eq!(text, expected, "\nthe pass rewrote:\n{text}");
        assert!(!changed, "the pass said it changed an unchanged graph");
    }
}
