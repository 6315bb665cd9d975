//! Capture: tracing the user's function into a graph on every call, and
//! what a graph break (a tensor's values read while tracing) does to it.

use super::Compiled;
use crate::error::{Error, ErrorKind, Result};
use crate::logging::log;
use crate::tensor::trace::{self, Traced};
use crate::tensor::Tensor;

impl<F: Fn(&[Tensor]) -> Vec<Tensor>> Compiled<F> {
    /// Traces `f` on `inputs` (named `arg0…`, outputs `out0…`), with their
    /// values known so that a read is a graph break, not an error.
    pub(super) fn capture(&self, inputs: &[Tensor]) -> Result<Traced> {
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
    pub(super) fn handle_breaks(
        &self,
        traced: &Traced,
        inputs: &[Tensor],
    ) -> Result<Option<Vec<Tensor>>> {
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
            .any(super::guards::needs_grad);
        drop(state);
        if needs_grad {
            log("graph_breaks", || {
                format!("{}: inputs require grad: this call runs eagerly", self.name)
            });
            return self.run_eagerly_after(traced, inputs).map(Some);
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use crate::compile::compile;
    use crate::error::ErrorKind;
    use crate::tensor::Tensor;

    /// The line of the read in [`reads`].
    const READ_LINE: u32 = line!() + 3;

    fn reads(x: &[Tensor]) -> Vec<Tensor> {
        let scale = x[0].sum(&[], false).item(); // READ_LINE: the break
        vec![&x[0] * scale, x[0].exp()]
    }

    #[test]
    fn the_capture_names_inputs_and_outputs_and_records_reads() {
        let f = compile(|x: &[Tensor]| vec![&x[0] + &x[1]]);
        let args = [
            Tensor::from_vec(vec![1.0], &[1]),
            Tensor::from_vec(vec![2.0], &[1]),
        ];
        let t = f.capture(&args).unwrap();
        let g = &t.graph;
        let names: Vec<String> = g.inputs.iter().map(|&i| g.display_name(i)).collect();
        assert_eq!(names, ["arg0", "arg1"]);
        assert_eq!(g.outputs[0].name, "out0");
        assert!(t.breaks.is_empty() && t.materialized.is_empty());
        let f = compile(reads);
        let t = f.capture(&args[..1]).unwrap();
        assert_eq!(t.breaks.len(), 1);
        assert_eq!(
            (t.breaks[0].file.ends_with("capture.rs"), t.breaks[0].line),
            (true, READ_LINE)
        );
        assert_eq!(t.graph.outputs.len(), 2);
    }

    #[test]
    fn a_break_under_fullgraph_is_an_error_at_the_read() {
        let f = compile(reads).fullgraph(true);
        let x = [Tensor::from_vec(vec![1.0, 2.0], &[2])];
        let err = f.handle_breaks(&f.capture(&x).unwrap(), &x).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Unsupported);
        assert_eq!(
            err.location.as_ref().map(|l| l.line),
            Some(READ_LINE),
            "{err}"
        );
        assert!(
            err.to_string().contains("graph break under fullgraph"),
            "{err}"
        );
        assert_eq!(f.stats().graph_breaks, 0, "an error, not a counted break");
    }

    #[test]
    fn a_break_runs_eagerly_only_when_gradients_are_needed() {
        let f = compile(reads);
        let x = [Tensor::from_vec(vec![1.0, 2.0], &[2])];
        assert!(f
            .handle_breaks(&f.capture(&x).unwrap(), &x)
            .unwrap()
            .is_none());
        let s = f.stats();
        assert_eq!((s.graph_breaks, s.eager_calls), (1, 0));
        let g = [x[0].set_requires_grad(true)];
        let out = f.handle_breaks(&f.capture(&g).unwrap(), &g).unwrap();
        let out = out.expect("run eagerly");
        assert_eq!(out[0].to_f64_vec(), vec![3.0, 6.0]);
        assert!(out[0].requires_grad(), "on the tape");
        let s = f.stats();
        assert_eq!((s.graph_breaks, s.eager_calls), (2, 1));
    }
}
