//! The text form of the IR (printer and parser). (stub: being written)

use std::fmt;

use super::graph::Graph;
use crate::error::{Error, ErrorKind, Result};

/// Parses the text form; errors carry the line and column.
pub fn parse(_src: &str) -> Result<Graph> {
    Err(Error::new(ErrorKind::Unsupported, "parse: not yet"))
}

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "graph {}", self.name)
    }
}
