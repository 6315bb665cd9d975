//! The verifier: checks every invariant a later stage relies on.

use std::collections::HashSet;

use super::graph::{Graph, NodeId};
use super::op::Op;
use crate::error::{Error, ErrorKind, Result};

impl Graph {
    /// Checks SSA order, input/output bookkeeping, arities, and that every
    /// node's declared type is what inference gives for its inputs.
    pub fn verify(&self) -> Result<()> {
        let fail = |id: NodeId, msg: String| {
            let node = self.node(id);
            let mut e = Error::op(
                ErrorKind::Verify,
                node.op.name(),
                format!("node {} ({:?}): {msg}", self.display_name(id), id),
            );
            e.location = node.meta.location.clone();
            e
        };
        let declared: HashSet<NodeId> = self.inputs.iter().copied().collect();
        if declared.len() != self.inputs.len() {
            return Err(Error::new(ErrorKind::Verify, "an input is listed twice"));
        }
        let mut names = HashSet::new();
        // (custom node, output index) of each `custom_output` seen.
        let mut custom_outputs = HashSet::new();
        for (i, node) in self.nodes.iter().enumerate() {
            let id = NodeId(i as u32);
            if let Some(bad) = node.inputs.iter().find(|x| x.index() >= i) {
                return Err(fail(
                    id,
                    format!("uses {bad:?}, which is not defined before it"),
                ));
            }
            if matches!(node.op, Op::Input) {
                if !declared.contains(&id) {
                    return Err(fail(
                        id,
                        "is an input node missing from the graph's input list".into(),
                    ));
                }
                match &node.meta.name {
                    Some(n) if names.insert(n.clone()) => {}
                    Some(n) => return Err(fail(id, format!("input name `{n}` is used twice"))),
                    None => return Err(fail(id, "inputs must be named".into())),
                }
                continue;
            }
            if declared.contains(&id) {
                return Err(fail(
                    id,
                    "is listed as an input but is not an input node".into(),
                ));
            }
            let types: Vec<_> = node
                .inputs
                .iter()
                .map(|&x| self.node(x).ty.clone())
                .collect();
            let inferred = node.op.infer(&types).map_err(|e| {
                let mut e = e;
                if e.location.is_none() {
                    e.location = node.meta.location.clone();
                }
                e
            })?;
            if inferred != node.ty {
                return Err(fail(
                    id,
                    format!("declared type {} but its inputs give {inferred}", node.ty),
                ));
            }
            if let Op::CustomOutput { index, .. } = node.op {
                self.check_custom_output(node.inputs[0], index, &node.ty)
                    .map_err(|msg| fail(id, msg))?;
                if !custom_outputs.insert((node.inputs[0], index)) {
                    return Err(fail(
                        id,
                        format!(
                            "output {index} of {} is read by an earlier custom_output \
                             too; each output has one custom_output node",
                            self.display_name(node.inputs[0])
                        ),
                    ));
                }
            }
        }
        let mut out_names = HashSet::new();
        for out in &self.outputs {
            if out.node.index() >= self.nodes.len() {
                return Err(Error::new(
                    ErrorKind::Verify,
                    format!(
                        "output `{}` refers to missing node {:?}",
                        out.name, out.node
                    ),
                ));
            }
            if !out_names.insert(out.name.clone()) {
                return Err(Error::new(
                    ErrorKind::Verify,
                    format!("output name `{}` is used twice", out.name),
                ));
            }
        }
        Ok(())
    }
}

impl Graph {
    /// A `custom_output` reads a `custom` node that has output `index` of
    /// type `ty`.
    fn check_custom_output(
        &self,
        source: NodeId,
        index: usize,
        ty: &super::infer::TensorType,
    ) -> std::result::Result<(), String> {
        let node = self.node(source);
        let Op::Custom(call) = &node.op else {
            return Err(format!("reads {source:?}, which is not a custom op"));
        };
        let types: Vec<_> = node
            .inputs
            .iter()
            .map(|&x| self.node(x).ty.clone())
            .collect();
        let outputs = call.infer(&types).map_err(|e| e.to_string())?;
        match outputs.get(index) {
            Some(t) if t == ty => Ok(()),
            Some(t) => Err(format!(
                "declares {ty} but {} output {index} is {t}",
                call.name()
            )),
            None => Err(format!(
                "{} has {} outputs, not {}",
                call.name(),
                outputs.len(),
                index + 1
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::ir::{BinaryOp, DType, Graph, NodeMeta, Op, TensorType};

    #[test]
    fn catches_a_wrong_declared_type() {
        let mut g = Graph::new("g");
        let x = g.add_input("x", TensorType::new(DType::F32, vec![2, 3]));
        let y = g
            .add(Op::Binary(BinaryOp::Add), &[x, x], NodeMeta::default())
            .unwrap();
        g.add_output("y", y);
        g.verify().unwrap();
        g.nodes[1].ty = TensorType::new(DType::F32, vec![3, 2]);
        let err = g.verify().unwrap_err().to_string();
        assert!(
            err.contains("declared type f32[3,2] but its inputs give f32[2,3]"),
            "{err}"
        );
    }
}
