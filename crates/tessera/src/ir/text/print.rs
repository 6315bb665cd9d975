//! The printer: `impl Display for Graph`.

use std::collections::HashSet;
use std::fmt::{self, Write};

use crate::error::SourceLoc;
use crate::ir::graph::{Graph, NodeId};

use super::cursor::{is_blank, is_plain_name};
use super::ops;

/// Call-site comments line up at this column at most; longer lines push
/// their comment further right.
const COMMENT_COLUMN_MAX: usize = 72;

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let labels = labels(self);
        let inputs: Vec<String> = self
            .inputs
            .iter()
            .map(|&id| reference(&labels, id))
            .collect();
        writeln!(f, "graph {}({}) {{", name(&self.name), inputs.join(", "))?;
        let bodies: Vec<String> = (0..self.nodes.len())
            .map(|i| node_body(self, &labels, i))
            .collect::<Result<_, _>>()?;
        let width = comment_column(self, &bodies);
        for (node, body) in self.nodes.iter().zip(&bodies) {
            match &node.meta.location {
                Some(loc) => writeln!(f, "  {body:width$}  # {}", location(loc))?,
                None => writeln!(f, "  {body}")?,
            }
        }
        let outputs: Vec<String> = self
            .outputs
            .iter()
            .map(|out| format!("{} as {}", reference(&labels, out.node), name(&out.name)))
            .collect();
        match outputs.is_empty() {
            true => writeln!(f, "  return")?,
            false => writeln!(f, "  return {}", outputs.join(", "))?,
        }
        writeln!(f, "}}")
    }
}

/// How each node is written: its label (without `%`) and, when the label is
/// not the node's name, the name as a string after it.
struct Label {
    label: String,
    quoted_name: Option<String>,
}

/// A node goes by its name when that is a plain word not taken by an earlier
/// node; otherwise by its index, with any name quoted after it (`%7 "x"`).
/// Index labels are digits and names start with a letter or `_`, so labels
/// never collide.
fn labels(g: &Graph) -> Vec<Label> {
    let mut taken = HashSet::new();
    let label = |(i, name): (usize, Option<&String>)| match name {
        Some(n) if is_plain_name(n) && taken.insert(n.clone()) => Label {
            label: n.clone(),
            quoted_name: None,
        },
        _ => Label {
            label: i.to_string(),
            quoted_name: name.map(|n| quote(n)),
        },
    };
    g.nodes
        .iter()
        .map(|n| n.meta.name.as_ref())
        .enumerate()
        .map(label)
        .collect()
}

/// `%label`; a reference to a node that does not exist (a malformed graph)
/// prints as its index so that the printer never panics.
fn reference(labels: &[Label], id: NodeId) -> String {
    match labels.get(id.index()) {
        Some(l) => format!("%{}", l.label),
        None => format!("%{}", id.0),
    }
}

/// A JSON string.
fn quote(s: &str) -> String {
    serde_json::Value::from(s).to_string()
}

/// A graph or output name: bare when it is a plain word, else quoted.
fn name(s: &str) -> String {
    match is_plain_name(s) {
        true => s.to_string(),
        false => quote(s),
    }
}

/// `%label ["name"] = op(%a, %b) {attr=v, …} : type  hints={…}`
fn node_body(g: &Graph, labels: &[Label], i: usize) -> Result<String, fmt::Error> {
    let node = &g.nodes[i];
    let mut out = format!("%{}", labels[i].label);
    if let Some(name) = &labels[i].quoted_name {
        write!(out, " {name}")?;
    }
    write!(out, " = {}", node.op.name())?;
    if !node.inputs.is_empty() {
        let inputs: Vec<String> = node
            .inputs
            .iter()
            .map(|&id| reference(labels, id))
            .collect();
        write!(out, "({})", inputs.join(", "))?;
    }
    let attrs = ops::attrs_of(&node.op);
    if let Some(signature) = ops::signature(node.op.name()).filter(|_| !attrs.is_empty()) {
        let pairs: Vec<String> = signature
            .iter()
            .zip(&attrs)
            .map(|((name, _), value)| format!("{name}={value}"))
            .collect();
        write!(out, " {{{}}}", pairs.join(", "))?;
    }
    write!(out, " : {}", node.ty)?;
    if let Some(hints) = &node.meta.hints {
        let json = serde_json::to_string(&**hints).map_err(|_| fmt::Error)?;
        write!(out, "  hints={json}")?;
    }
    Ok(out)
}

/// The column (after the indent) where call-site comments start.
fn comment_column(g: &Graph, bodies: &[String]) -> usize {
    g.nodes
        .iter()
        .zip(bodies)
        .filter(|(node, _)| node.meta.location.is_some())
        .map(|(_, body)| body.chars().count())
        .filter(|&width| width <= COMMENT_COLUMN_MAX)
        .max()
        .unwrap_or(0)
}

/// `file:line:column`, the file quoted when it could not be read back bare:
/// empty, starting with `"`, with blanks at either end or control characters.
fn location(loc: &SourceLoc) -> String {
    let file = &*loc.file;
    let bare = !file.is_empty()
        && !file.starts_with('"')
        && !file.starts_with(is_blank)
        && !file.ends_with(is_blank)
        && !file.chars().any(char::is_control);
    match bare {
        true => format!("{file}:{}:{}", loc.line, loc.column),
        false => format!("{}:{}:{}", quote(file), loc.line, loc.column),
    }
}
