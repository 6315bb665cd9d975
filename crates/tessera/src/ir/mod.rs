//! The intermediate representation: dtypes, shapes, ops, graphs, their text
//! form and the verifier, the signatures of custom ops (`custom`), and
//! graph surgery (`extract`).

pub mod custom;
pub mod dtype;
pub mod extract;
pub mod graph;
pub mod infer;
pub mod kernel;
pub mod op;
pub mod shape;
pub mod text;
mod verify;

pub use dtype::DType;
pub use graph::{Graph, Node, NodeId, NodeMeta, Output};
pub use infer::{broadcast_shapes, TensorType};
pub use op::{
    ArgReduceOp, BackwardReads, BinaryOp, CompareOp, Literal, LiteralData, Op, ReduceOp, Scalar,
    UnaryOp,
};
pub use shape::{Dim, EvalError, Shape};
