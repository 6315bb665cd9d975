//! The graph: an arena of SSA nodes with named inputs and outputs.

use std::fmt;
use std::sync::Arc;

use super::infer::TensorType;
use super::op::Op;
use crate::error::{Error, ErrorKind, Result, SourceLoc};

/// A node's index in its graph's arena.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// What a node remembers about where it came from.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeMeta {
    /// A readable name (`q`, `scores`); inputs are always named.
    pub name: Option<String>,
    /// The user's call site that created the node.
    pub location: Option<SourceLoc>,
    /// The context hints in force when the node was created (a JSON object),
    /// shared by every node of the scope (a trace records thousands).
    pub hints: Option<Arc<serde_json::Map<String, serde_json::Value>>>,
}

impl NodeMeta {
    /// Metadata carrying only a readable name.
    pub fn named(name: &str) -> NodeMeta {
        NodeMeta {
            name: Some(name.to_string()),
            ..NodeMeta::default()
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<NodeId>,
    pub ty: TensorType,
    pub meta: NodeMeta,
}

/// A named graph output.
#[derive(Clone, Debug, PartialEq)]
pub struct Output {
    pub name: String,
    pub node: NodeId,
}

/// An SSA graph: every node's inputs come before it in `nodes`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Graph {
    pub name: String,
    pub nodes: Vec<Node>,
    /// The `Op::Input` nodes, in call order.
    pub inputs: Vec<NodeId>,
    pub outputs: Vec<Output>,
}

impl Graph {
    pub fn new(name: impl Into<String>) -> Graph {
        Graph {
            name: name.into(),
            ..Graph::default()
        }
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.index()]
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Declares a named input of type `ty`.
    pub fn add_input(&mut self, name: impl Into<String>, ty: TensorType) -> NodeId {
        let id = self.push(Node {
            op: Op::Input,
            inputs: Vec::new(),
            ty,
            meta: NodeMeta {
                name: Some(name.into()),
                ..NodeMeta::default()
            },
        });
        self.inputs.push(id);
        id
    }

    /// Adds `op` applied to `inputs`, inferring its type; the error names the
    /// op, the input types and `meta.location`.
    pub fn add(&mut self, op: Op, inputs: &[NodeId], meta: NodeMeta) -> Result<NodeId> {
        let loc_err = |e: Error| match &meta.location {
            Some(loc) => e.at(loc.clone()),
            None => e,
        };
        if let Some(bad) = inputs.iter().find(|i| i.index() >= self.nodes.len()) {
            return Err(loc_err(Error::op(
                ErrorKind::Verify,
                op.name(),
                format!("input {bad:?} does not exist"),
            )));
        }
        let types: Vec<TensorType> = inputs.iter().map(|&i| self.node(i).ty.clone()).collect();
        let ty = op.infer(&types).map_err(loc_err)?;
        Ok(self.push(Node {
            op,
            inputs: inputs.to_vec(),
            ty,
            meta,
        }))
    }

    /// Appends a node as is (its type unchecked: run [`Graph::verify`]).
    pub fn push(&mut self, node: Node) -> NodeId {
        let id = NodeId(self.nodes.len() as u32);
        self.nodes.push(node);
        id
    }

    pub fn add_output(&mut self, name: impl Into<String>, node: NodeId) {
        self.outputs.push(Output {
            name: name.into(),
            node,
        });
    }

    /// The name of a node for messages: its own name or `%id`.
    pub fn display_name(&self, id: NodeId) -> String {
        match &self.node(id).meta.name {
            Some(n) => n.clone(),
            None => format!("%{}", id.0),
        }
    }
}
