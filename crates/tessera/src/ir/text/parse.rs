//! The parser: statements (header, nodes, `return`), name resolution, and the
//! final verification with errors mapped to the offending line.

use std::collections::HashMap;
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::ir::graph::{Graph, Node, NodeId, NodeMeta};
use crate::ir::op::Op;

use super::cursor::{is_blank, parse_error, Cursor};
use super::ops::{self, Attr, AttrKind};
use super::values::{self, MAX_ELEMENTS};

/// Parses the text form; errors name the file `<input>`.
pub fn parse(src: &str) -> Result<Graph> {
    parse_named(src, "<input>")
}

/// Parses the text form; errors are `ErrorKind::Parse` located at
/// `file_name`, line and column.
pub fn parse_named(src: &str, file_name: &str) -> Result<Graph> {
    Parser::new(src, file_name).graph()
}

/// At most this many inputs per node: with every dim bounded by
/// [`MAX_ELEMENTS`], `cat` can then sum them without overflowing an `i64`.
const MAX_INPUTS: usize = (i64::MAX as u64 / MAX_ELEMENTS / 2) as usize;

struct Parser<'a> {
    /// The lines left, numbered from 0.
    lines: std::iter::Enumerate<std::str::Split<'a, char>>,
    file: Arc<str>,
    graph: Graph,
    /// Value label (without `%`) → node and where it was defined.
    labels: HashMap<&'a str, (NodeId, SourceLoc)>,
    /// Where each node's op is written: verification errors point there.
    positions: Vec<SourceLoc>,
    /// The graph's input list as written in the header, resolved at the end.
    header_inputs: Vec<(&'a str, SourceLoc)>,
    header: Option<SourceLoc>,
    /// The end of the last line, for "found end of input" errors.
    end: SourceLoc,
}

impl<'a> Parser<'a> {
    fn new(src: &'a str, file_name: &str) -> Parser<'a> {
        let file: Arc<str> = Arc::from(file_name);
        Parser {
            lines: src.split('\n').enumerate(),
            end: SourceLoc {
                file: file.clone(),
                line: 1,
                column: 1,
            },
            file,
            graph: Graph::default(),
            labels: HashMap::new(),
            positions: Vec::new(),
            header_inputs: Vec::new(),
            header: None,
        }
    }

    /// The next line that holds a statement (blank lines and `//` comment
    /// lines are skipped), or `None` at the end of the input.
    fn next_statement(&mut self) -> Option<Cursor<'a>> {
        for (index, line) in self.lines.by_ref() {
            let line = line.strip_suffix('\r').unwrap_or(line);
            let number = u32::try_from(index + 1).unwrap_or(u32::MAX);
            let cursor = Cursor::new(line, number, self.file.clone());
            self.end = cursor.loc_at(line.len());
            let content = line.trim_start_matches(is_blank);
            if !content.is_empty() && !content.starts_with("//") {
                return Some(cursor);
            }
        }
        None
    }

    fn expect_statement(&mut self, what: &str) -> Result<Cursor<'a>> {
        self.next_statement().ok_or_else(|| {
            parse_error(
                self.end.clone(),
                format!("expected {what}, found end of input"),
            )
        })
    }

    fn graph(mut self) -> Result<Graph> {
        let mut cur = self.expect_statement("`graph`")?;
        self.header(&mut cur)?;
        loop {
            let mut cur = self.expect_statement("a node or `return`")?;
            if cur.keyword("return") {
                self.outputs(&mut cur)?;
                break;
            }
            if cur.peek() != Some('%') {
                return Err(cur.expected("a node (`%name = op …`) or `return`"));
            }
            self.node(&mut cur)?;
        }
        let mut cur = self.expect_statement("`}` closing the graph")?;
        cur.expect('}', "closing the graph")?;
        cur.expect_end()?;
        if let Some(mut cur) = self.next_statement() {
            return Err(cur.expected("end of input after the graph"));
        }
        self.resolve_inputs()?;
        self.verify()?;
        Ok(self.graph)
    }

    /// `graph NAME(%a, %b) {`
    fn header(&mut self, cur: &mut Cursor<'a>) -> Result<()> {
        self.header = Some(cur.loc());
        if !cur.keyword("graph") {
            return Err(cur.expected("`graph`"));
        }
        self.graph.name = cur.name("the graph's name")?;
        cur.expect('(', "opening the graph's input list")?;
        self.header_inputs = labels_until(cur, ')')?;
        cur.expect('{', "opening the graph body")?;
        cur.expect_end()
    }

    fn resolve(&self, label: &str, loc: &SourceLoc) -> Result<NodeId> {
        match self.labels.get(label) {
            Some((id, _)) => Ok(*id),
            None => Err(parse_error(
                loc.clone(),
                format!("undefined value `%{label}` (values must be defined on an earlier line)"),
            )),
        }
    }

    /// `%label ["name"] = op[(inputs)] [{attrs}] : type [hints={…}] [# loc]`
    fn node(&mut self, cur: &mut Cursor<'a>) -> Result<()> {
        let label_loc = cur.loc();
        let label = cur.label()?;
        if let Some((_, first)) = self.labels.get(label) {
            let msg = format!(
                "duplicate name `%{label}` (first defined at line {})",
                first.line
            );
            return Err(parse_error(label_loc, msg));
        }
        let name = match cur.string()? {
            Some(name) => Some(name),
            None if label.starts_with(|c: char| c.is_ascii_digit()) => None,
            None => Some(label.to_string()),
        };
        cur.expect('=', "after the value name")?;
        let op_pos = cur.start();
        let op_name = cur.expect_word("an op name")?;
        let signature = ops::signature(op_name)
            .ok_or_else(|| cur.error_at(op_pos, format!("unknown op `{op_name}`")))?;
        let inputs = self.inputs(cur)?;
        let attrs = attributes(cur, op_name, signature)?;
        cur.expect(':', "before the node's type")?;
        let ty = values::tensor_type(cur)?;
        let (hints, location) = trailer(cur)?;
        let op = ops::build(op_name, &attrs, &ty).map_err(|m| cur.error_at(op_pos, m))?;
        let id = self.graph.push(Node {
            op,
            inputs,
            ty,
            meta: NodeMeta {
                name,
                location,
                hints,
            },
        });
        self.labels.insert(label, (id, label_loc));
        self.positions.push(cur.loc_at(op_pos));
        Ok(())
    }

    /// The optional `(%a, %b)` after an op name, resolved.
    fn inputs(&mut self, cur: &mut Cursor<'a>) -> Result<Vec<NodeId>> {
        if !cur.eat('(') {
            return Ok(Vec::new());
        }
        let start = cur.loc();
        let labels = labels_until(cur, ')')?;
        if labels.len() > MAX_INPUTS {
            let msg = format!("too many inputs (at most {MAX_INPUTS})");
            return Err(parse_error(start, msg));
        }
        labels
            .iter()
            .map(|(label, loc)| self.resolve(label, loc))
            .collect()
    }

    /// `return %a as name, %b as "other name"`
    fn outputs(&mut self, cur: &mut Cursor<'a>) -> Result<()> {
        let mut seen: HashMap<String, u32> = HashMap::new();
        if cur.peek().is_none() {
            return Ok(());
        }
        loop {
            let loc = cur.loc();
            let node = self.resolve(cur.label()?, &loc)?;
            if !cur.keyword("as") {
                return Err(cur.expected("`as` and the output's name"));
            }
            let name_loc = cur.loc();
            let name = cur.name("the output's name")?;
            if let Some(column) = seen.insert(name.clone(), name_loc.column) {
                let msg = format!("output name `{name}` is used twice (first at column {column})");
                return Err(parse_error(name_loc, msg));
            }
            self.graph.add_output(name, node);
            if cur.peek().is_none() {
                return Ok(());
            }
            cur.expect(',', "between outputs")?;
        }
    }

    /// Checks the header's input list against the input nodes and stores it.
    fn resolve_inputs(&mut self) -> Result<()> {
        let mut listed = vec![false; self.graph.len()];
        for (label, loc) in &self.header_inputs {
            let id = self.resolve(label, loc)?;
            let node = self.graph.node(id);
            if !matches!(node.op, Op::Input) {
                let msg = format!(
                    "`%{label}` is listed as a graph input but is a `{}` node",
                    node.op.name()
                );
                return Err(parse_error(loc.clone(), msg));
            }
            if std::mem::replace(&mut listed[id.index()], true) {
                let msg = format!("graph input `%{label}` is listed twice");
                return Err(parse_error(loc.clone(), msg));
            }
            self.graph.inputs.push(id);
        }
        let unlisted = self
            .graph
            .nodes
            .iter()
            .enumerate()
            .find(|(i, node)| matches!(node.op, Op::Input) && !listed[*i]);
        if let Some((i, _)) = unlisted {
            let msg = "this input is missing from the graph's input list `graph name(…)`";
            return Err(parse_error(self.positions[i].clone(), msg));
        }
        Ok(())
    }

    /// Runs [`Graph::verify`] on a copy whose nodes are located at their
    /// lines, so that an error points into the text, not at the call site
    /// the node records.
    fn verify(&self) -> Result<()> {
        let mut probe = self.graph.clone();
        for (node, loc) in probe.nodes.iter_mut().zip(&self.positions) {
            node.meta.location = Some(loc.clone());
        }
        probe.verify().map_err(|e| Error {
            kind: ErrorKind::Parse,
            location: e.location.clone().or_else(|| self.header.clone()),
            ..e
        })
    }
}

/// `%a, %b, …)` up to and including `close`: labels with their places.
fn labels_until<'a>(cur: &mut Cursor<'a>, close: char) -> Result<Vec<(&'a str, SourceLoc)>> {
    let mut labels = Vec::new();
    if cur.eat(close) {
        return Ok(labels);
    }
    loop {
        let loc = cur.loc();
        labels.push((cur.label()?, loc));
        if cur.eat(close) {
            return Ok(labels);
        }
        if !cur.eat(',') {
            return Err(cur.expected(&format!("`,` or `{close}` (unterminated list)")));
        }
    }
}

/// The optional `{name=value, …}` of an op, checked against its signature
/// and returned in signature order.
fn attributes(
    cur: &mut Cursor,
    op_name: &str,
    signature: &[(&'static str, AttrKind)],
) -> Result<Vec<Attr>> {
    let mut found: Vec<Option<Attr>> = vec![None; signature.len()];
    let block = cur.start();
    if cur.eat('{') && !cur.eat('}') {
        loop {
            attribute(cur, op_name, signature, &mut found)?;
            if cur.eat('}') {
                break;
            }
            if !cur.eat(',') {
                return Err(cur.expected("`,` or `}` (unterminated attributes)"));
            }
        }
    }
    let missing = signature.iter().zip(&found).find(|(_, v)| v.is_none());
    if let Some(((name, _), _)) = missing {
        let msg = format!("missing attribute `{name}` of `{op_name}`");
        return Err(cur.error_at(block, msg));
    }
    Ok(found.into_iter().flatten().collect())
}

/// One `name=value`, stored into its slot of `found`.
fn attribute(
    cur: &mut Cursor,
    op_name: &str,
    signature: &[(&'static str, AttrKind)],
    found: &mut [Option<Attr>],
) -> Result<()> {
    let start = cur.start();
    let name = cur.expect_word("an attribute name")?;
    let Some(slot) = signature.iter().position(|(n, _)| *n == name) else {
        let expected: Vec<_> = signature.iter().map(|(n, _)| *n).collect();
        let msg = match (ops::retired_attribute(op_name, name), expected.is_empty()) {
            (Some(instead), _) => format!("`{op_name}` no longer takes `{name}`: {instead}"),
            (None, true) => format!("unknown attribute `{name}`: `{op_name}` takes none"),
            (None, false) => format!(
                "unknown attribute `{name}` of `{op_name}` (it takes {})",
                expected.join(", ")
            ),
        };
        return Err(cur.error_at(start, msg));
    };
    if found[slot].is_some() {
        let msg = format!("attribute `{name}` is given twice");
        return Err(cur.error_at(start, msg));
    }
    cur.expect('=', &format!("after `{name}`"))?;
    found[slot] = Some(values::attr(cur, signature[slot].1)?);
    Ok(())
}

/// The end of a node line: `[hints={…}] [# file:line:column]`.
fn trailer(cur: &mut Cursor) -> Result<(Option<std::sync::Arc<Hints>>, Option<SourceLoc>)> {
    let hints = if cur.keyword("hints") {
        cur.expect('=', "after `hints`")?;
        Some(std::sync::Arc::new(hints(cur)?))
    } else {
        None
    };
    let location = if cur.eat('#') {
        Some(location(cur)?)
    } else {
        None
    };
    cur.expect_end()?;
    Ok((hints, location))
}

type Hints = serde_json::Map<String, serde_json::Value>;

/// A JSON object, to the end of its closing brace.
fn hints(cur: &mut Cursor) -> Result<Hints> {
    let start = cur.start();
    if !cur.rest().starts_with('{') {
        return Err(cur.expected("a JSON object after `hints=`"));
    }
    let mut stream = serde_json::Deserializer::from_str(cur.rest()).into_iter();
    match stream.next() {
        Some(Ok(map)) => {
            cur.advance(stream.byte_offset());
            Ok(map)
        }
        Some(Err(e)) => {
            // serde_json's columns count bytes from `start`, on this one line.
            let pos = start + e.column().saturating_sub(1);
            let pos = pos.min(start + cur.rest().len());
            let message = e.to_string();
            let message = message.split(" at line ").next().unwrap_or(&message);
            Err(cur.error_at(pos, format!("bad hints JSON: {message}")))
        }
        None => Err(cur.expected("a JSON object after `hints=`")),
    }
}

/// After `#`: `file:line:column`, the file bare (everything up to the last
/// two colons) or a JSON string.
fn location(cur: &mut Cursor) -> Result<SourceLoc> {
    let file = match cur.string()? {
        Some(file) => file,
        None => {
            cur.skip_blanks();
            let rest = cur.rest().trim_end_matches(is_blank);
            let mut parts = rest.rsplitn(3, ':');
            let (column, line) = (parts.next(), parts.next());
            match (parts.next(), line, column) {
                (Some(file), Some(_), Some(_)) if !file.is_empty() => {
                    cur.advance(file.len());
                    file.to_string()
                }
                _ => return Err(cur.expected("a call site `file:line:column` after `#`")),
            }
        }
    };
    cur.expect(':', "after the call site's file")?;
    let line = location_number(cur, "a line number")?;
    cur.expect(':', "after the call site's line")?;
    let column = location_number(cur, "a column number")?;
    Ok(SourceLoc {
        file: Arc::from(file),
        line,
        column,
    })
}

fn location_number(cur: &mut Cursor, what: &str) -> Result<u32> {
    values::integer(cur, &format!("{what} in the call site"))
}
