//! The pass manager: an ordered list of passes run in rounds until a round
//! changes nothing (a fixed point) or a round cap is reached.
//!
//! Under `TESSERA_LOGS=graph` it logs each pass that changed the graph with
//! the node count before and after, and the graph it ends with. In debug
//! builds it verifies the graph after every pass and checks that the
//! graph's inputs and outputs kept their names and types, so a faulty pass
//! is named the moment it breaks an invariant.

use super::{by_name, Pass, PassContext, ALL, DEFAULT_PIPELINE};
use crate::error::{Error, ErrorKind, Result};
use crate::ir::{Graph, TensorType};
use crate::logging;

/// Passes to run, in order, to a fixed point.
#[derive(Clone, Debug)]
pub struct PassManager {
    passes: Vec<Pass>,
    /// The most rounds run; a pipeline still changing the graph after them
    /// stops there (reported as not converged).
    pub max_rounds: usize,
}

/// One pass's run within a round that changed the graph.
#[derive(Clone, Debug, PartialEq)]
pub struct PassRun {
    pub pass: &'static str,
    /// 1-based.
    pub round: usize,
    pub nodes_before: usize,
    pub nodes_after: usize,
}

/// What a pipeline did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PassReport {
    /// The passes that changed the graph, in the order they ran.
    pub runs: Vec<PassRun>,
    /// Rounds run, the last of which changed nothing if `converged`.
    pub rounds: usize,
    pub converged: bool,
}

impl PassReport {
    /// Per pass of the pipeline, how many of its runs changed the graph and
    /// by how many nodes it changed the count in total (negative: removed).
    pub fn changes_by_pass(&self, pipeline: &PassManager) -> Vec<(&'static str, usize, isize)> {
        pipeline
            .passes
            .iter()
            .map(|p| {
                let runs = self.runs.iter().filter(|r| r.pass == p.name);
                let (count, delta) = runs.fold((0, 0), |(c, d), r| {
                    (c + 1, d + r.nodes_after as isize - r.nodes_before as isize)
                });
                (p.name, count, delta)
            })
            .collect()
    }
}

impl PassManager {
    pub fn new(passes: Vec<Pass>) -> PassManager {
        PassManager {
            passes,
            max_rounds: 16,
        }
    }

    /// Every pass but `decompose` (see [`DEFAULT_PIPELINE`]).
    pub fn default_pipeline() -> PassManager {
        PassManager::from_names("default").expect("the default passes exist")
    }

    /// Passes by name, comma-separated, in order: `default` stands for the
    /// default pipeline (`default,decompose`, `cse,dce`). An unknown name is
    /// an error that lists the known ones.
    pub fn from_names(spec: &str) -> Result<PassManager> {
        let mut passes = Vec::new();
        for name in spec.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if name == "default" {
                passes.extend(DEFAULT_PIPELINE.iter().map(|n| by_name(n).expect("known")));
                continue;
            }
            let pass = by_name(name).ok_or_else(|| {
                let known: Vec<&str> = ALL.iter().map(|p| p.name).collect();
                Error::new(
                    ErrorKind::Argument,
                    format!(
                        "unknown pass `{name}`; the passes are default, {}",
                        known.join(", ")
                    ),
                )
            })?;
            passes.push(pass);
        }
        Ok(PassManager::new(passes))
    }

    /// This pipeline without the pass called `name` (as it is, if absent).
    pub fn without(mut self, name: &str) -> PassManager {
        self.passes.retain(|p| p.name != name);
        self
    }

    pub fn passes(&self) -> &[Pass] {
        &self.passes
    }

    /// Runs the passes in rounds until one changes nothing, at most
    /// `max_rounds` times.
    pub fn run(&self, graph: &mut Graph, ctx: &PassContext) -> Result<PassReport> {
        let signature = cfg!(debug_assertions).then(|| interface(graph));
        let mut report = PassReport::default();
        while report.rounds < self.max_rounds && !report.converged {
            report.rounds += 1;
            report.converged = true;
            for pass in &self.passes {
                let before = graph.len();
                if (pass.run)(graph, ctx)? {
                    report.converged = false;
                    report.runs.push(PassRun {
                        pass: pass.name,
                        round: report.rounds,
                        nodes_before: before,
                        nodes_after: graph.len(),
                    });
                    logging::log("graph", || {
                        format!(
                            "pass {} (round {}): {before} -> {} nodes",
                            pass.name,
                            report.rounds,
                            graph.len()
                        )
                    });
                }
                if let Some(sig) = &signature {
                    check_invariants(graph, sig, pass.name)?;
                }
            }
        }
        logging::log("graph", || {
            let state = match report.converged {
                true => format!("converged after {} rounds", report.rounds),
                false => format!("stopped at the cap of {} rounds", self.max_rounds),
            };
            format!("after passes ({state}):\n{graph}")
        });
        Ok(report)
    }
}

/// A graph's calling convention: its inputs and outputs, by name and type.
type Interface = (Vec<(String, TensorType)>, Vec<(String, TensorType)>);

fn interface(g: &Graph) -> Interface {
    let inputs = g
        .inputs
        .iter()
        .map(|&id| (g.display_name(id), g.node(id).ty.clone()))
        .collect();
    let outputs = g
        .outputs
        .iter()
        .map(|o| (o.name.clone(), g.node(o.node).ty.clone()))
        .collect();
    (inputs, outputs)
}

/// The graph verifies and kept its interface; otherwise an error naming
/// the pass.
fn check_invariants(g: &Graph, before: &Interface, pass: &str) -> Result<()> {
    let blame = |e: String| {
        Error::new(
            ErrorKind::Verify,
            format!("pass `{pass}` broke the graph: {e}"),
        )
    };
    g.verify().map_err(|e| blame(e.to_string()))?;
    if &interface(g) != before {
        return Err(blame("its inputs or outputs changed".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::text::parse;

    const MODEL: &str = r#"graph g(%x, %w, %b) {
  %x = input : f32[4,8]
  %w = input : f32[3,8]
  %b = input : f32[3]
  %wt = permute(%w) {perm=[1,0]} : f32[8,3]
  %h = matmul(%x, %wt) : f32[4,3]                          # model.rs:2:5
  %one = full {value=1.0, shape=[], dtype=f32} : f32[]
  %h1 = mul(%h, %one) : f32[4,3]
  %c1 = full {value=2.0, shape=[], dtype=f32} : f32[]
  %c2 = full {value=3.0, shape=[], dtype=f32} : f32[]
  %s = add(%h1, %c1) : f32[4,3]
  %t = add(%s, %c2) : f32[4,3]
  %u = add(%t, %b) : f32[4,3]
  %v = add(%t, %b) : f32[4,3]
  %y = add(%u, %v) : f32[4,3]
  %dead = exp(%y) : f32[4,3]
  return %y as y
}"#;

    #[test]
    fn the_default_pipeline_reaches_a_fixed_point() {
        let mut g = parse(MODEL).unwrap();
        let pm = PassManager::default_pipeline();
        let report = pm.run(&mut g, &PassContext::default()).unwrap();
        let expected = r#"graph g(%x, %w, %b) {
  %x = input : f32[4,8]
  %w = input : f32[3,8]
  %b = input : f32[3]
  %h = matmul_t(%x, %w) {transpose_a=false, transpose_b=true} : f32[4,3]  # model.rs:2:5
  %4 = full {value=5.0, shape=[], dtype=f32} : f32[]
  %t = add(%h, %4) : f32[4,3]
  %u = add(%t, %b) : f32[4,3]
  %7 = constant {value=2.0} : f32[]
  %y = mul(%u, %7) : f32[4,3]
  return %y as y
}
"#;
        assert_eq!(g.to_string(), expected);
        assert!(report.converged);
        let changed: Vec<&str> = report.runs.iter().map(|r| r.pass).collect();
        for pass in [
            "neutral_elements",
            "constant_fold",
            "constant_propagation",
            "node_reduction",
            "transpose_matmul",
            "cse",
        ] {
            assert!(changed.contains(&pass), "{pass} did not run: {changed:?}");
        }
        let by_pass = report.changes_by_pass(&pm);
        assert_eq!(by_pass.len(), DEFAULT_PIPELINE.len());
        let total: isize = by_pass.iter().map(|(_, _, d)| d).sum();
        assert_eq!(
            total,
            g.len() as isize - parse(MODEL).unwrap().len() as isize
        );
    }

    #[test]
    fn passes_are_chosen_by_name() {
        let pm = PassManager::from_names("cse, dce").unwrap();
        let names: Vec<&str> = pm.passes().iter().map(|p| p.name).collect();
        assert_eq!(names, ["cse", "dce"]);
        let pm = PassManager::from_names("default,decompose").unwrap();
        assert_eq!(pm.passes().len(), DEFAULT_PIPELINE.len() + 1);
        let without = PassManager::default_pipeline().without("attention");
        assert_eq!(without.passes().len(), DEFAULT_PIPELINE.len() - 1);
        assert!(without.passes().iter().all(|p| p.name != "attention"));
        let err = PassManager::from_names("cse,fold").unwrap_err().to_string();
        assert!(
            err.starts_with("unknown pass `fold`; the passes are default, slice, movement,"),
            "{err}"
        );
    }

    /// The invariant checks run in debug builds only.
    #[cfg(debug_assertions)]
    #[test]
    fn a_pass_that_breaks_the_interface_is_named() {
        fn renames_output(g: &mut Graph, _: &PassContext) -> Result<bool> {
            g.outputs[0].name = "other".into();
            Ok(true)
        }
        let pm = PassManager::new(vec![Pass {
            name: "renamer",
            run: renames_output,
        }]);
        let mut g = parse(MODEL).unwrap();
        let err = pm.run(&mut g, &PassContext::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "pass `renamer` broke the graph: its inputs or outputs changed"
        );
    }

    #[test]
    fn a_pipeline_that_never_settles_stops_at_the_cap() {
        fn always_changes(_: &mut Graph, _: &PassContext) -> Result<bool> {
            Ok(true)
        }
        let mut pm = PassManager::new(vec![Pass {
            name: "restless",
            run: always_changes,
        }]);
        pm.max_rounds = 3;
        let mut g = parse(MODEL).unwrap();
        let report = pm.run(&mut g, &PassContext::default()).unwrap();
        assert_eq!((report.rounds, report.converged), (3, false));
    }
}
