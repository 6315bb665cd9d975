//! The text form of the IR: the printer (`impl Display for Graph`) and the
//! parser ([`parse`]), which reads the printed form back to an equal graph.
//!
//! ```text
//! graph mlp(%x, %w) {
//!   %x = input : f32[4,8]
//!   %w = input : f32[8,s0]
//!   %3 = matmul(%x, %w) : f32[4,s0]                # examples/mlp.rs:12:9
//!   %y = softmax(%3) {dim=1} : f32[4,s0]  hints={"order":"strict"}
//!   return %y as probs
//! }
//! ```
//!
//! One statement per line; `docs/IR.md` has the grammar and every op.
//! - `cursor`: the lexer, over one line;
//! - `ops`: the one table of op names and attributes, shared by both sides;
//! - `values`: attribute values, types, shapes and dims;
//! - `parse`: statements, name resolution and verification;
//! - `print`: the printer.

mod cursor;
mod ops;
mod parse;
mod print;
mod values;

pub use parse::{parse, parse_named};
