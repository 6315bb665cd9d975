//! The state of one import: the graph being built, each ONNX value's node,
//! the values known while importing (constants, and shapes whose dims may be
//! symbolic), and the helpers every op's conversion uses.

use std::collections::{HashMap, HashSet};

use tessera::ir::{
    BinaryOp, CompareOp, Dim, Literal, LiteralData, NodeId, NodeMeta, Op, Scalar, Shape,
    TensorType, UnaryOp,
};
use tessera::tensor::interpret::run_graph;
use tessera::{DType, Error, ErrorKind, Graph, Result, Tensor};

use crate::proto::{attribute_type as at, AttributeProto, NodeProto};

/// A 1-D (or scalar) int64 value known at import time element by element,
/// as dims that may be symbolic: what `Shape` of a tensor with a dynamic
/// dim gives, and what `Reshape`, `Expand` and friends take.
#[derive(Clone, Debug, PartialEq)]
pub struct DimsVal {
    pub dims: Vec<DimOrNeg>,
    /// A rank-0 value (one dim) rather than a 1-D one.
    pub scalar: bool,
}

/// An ONNX value: its node in the graph (absent for a shape whose dims are
/// symbolic, which exists only at import time) and its dims when known.
#[derive(Clone, Debug)]
pub struct Val {
    pub id: Option<NodeId>,
    pub dims: Option<DimsVal>,
}

impl Val {
    pub fn node(id: NodeId) -> Val {
        Val {
            id: Some(id),
            dims: None,
        }
    }
}

/// One import in progress.
pub struct Ctx<'a> {
    pub g: Graph,
    pub values: HashMap<String, Val>,
    /// Graph inputs whose values the caller gave, usable where an op needs
    /// a value at import time (a `Reshape`'s shape fed by an input).
    pub known_inputs: &'a HashMap<String, Literal>,
    /// The graph inputs whose value an op needed at import time.
    pub specialised: HashSet<String>,
    /// The default domain's opset version.
    pub opset: i64,
    /// Metadata of the nodes the current ONNX node becomes.
    pub meta: NodeMeta,
    /// The current ONNX node and its inputs (`None` for an omitted optional
    /// input, named `""`).
    pub node: NodeProto,
    pub inputs: Vec<Option<Val>>,
    /// The model file's name (the file of every node's location).
    pub file: std::sync::Arc<str>,
    /// Inside a subgraph (an If branch, a Loop or Scan body): the line of
    /// the node that owns it, which its nodes' locations take.
    pub sub_line: Option<u32>,
    folded: HashMap<NodeId, Option<Literal>>,
}

impl<'a> Ctx<'a> {
    pub fn new(name: &str, opset: i64, known_inputs: &'a HashMap<String, Literal>) -> Ctx<'a> {
        Ctx {
            g: Graph::new(name),
            values: HashMap::new(),
            known_inputs,
            specialised: HashSet::new(),
            opset,
            meta: NodeMeta::default(),
            node: NodeProto::default(),
            inputs: Vec::new(),
            file: std::sync::Arc::from("model.onnx"),
            sub_line: None,
            folded: HashMap::new(),
        }
    }

    // ---- errors ----

    /// An error about the current node's op.
    pub fn err(&self, kind: ErrorKind, msg: impl Into<String>) -> Error {
        Error::op(kind, self.node.op_type.clone(), msg.into())
    }

    pub fn unsupported(&self, msg: impl Into<String>) -> Error {
        self.err(ErrorKind::Unsupported, msg)
    }

    pub fn bad(&self, msg: impl Into<String>) -> Error {
        self.err(ErrorKind::Argument, msg)
    }

    // ---- attributes ----

    pub fn attr(&self, name: &str) -> Option<&AttributeProto> {
        self.node.attribute.iter().find(|a| a.name == name)
    }

    pub fn attr_i(&self, name: &str, default: i64) -> i64 {
        self.attr(name).map_or(default, |a| a.i)
    }

    pub fn attr_f(&self, name: &str, default: f64) -> f64 {
        self.attr(name).map_or(default, |a| a.f as f64)
    }

    pub fn attr_ints(&self, name: &str) -> Option<Vec<i64>> {
        self.attr(name).map(|a| a.ints.clone())
    }

    pub fn attr_s(&self, name: &str, default: &str) -> String {
        self.attr(name).map_or(default.to_string(), |a| {
            String::from_utf8_lossy(&a.s).into_owned()
        })
    }

    // ---- inputs ----

    pub fn has_input(&self, i: usize) -> bool {
        matches!(self.inputs.get(i), Some(Some(_)))
    }

    pub fn val(&self, i: usize) -> Result<&Val> {
        self.inputs
            .get(i)
            .and_then(|v| v.as_ref())
            .ok_or_else(|| self.bad(format!("input {i} is missing")))
    }

    /// Input `i` as a graph node.
    pub fn x(&mut self, i: usize) -> Result<NodeId> {
        let v = self.val(i)?.clone();
        self.materialise(&v)
            .map_err(|e| e.with_context(&format!("input {i}")))
    }

    /// A value's node, making a constant of known concrete dims.
    pub fn materialise(&mut self, v: &Val) -> Result<NodeId> {
        if let Some(id) = v.id {
            return Ok(id);
        }
        let d = v.dims.as_ref().expect("a value has a node or dims");
        match d.ints() {
            Some(ints) => Ok(self.int_constant(&ints, d.scalar)?),
            None => Err(self.unsupported(format!(
                "a shape with symbolic dims ({}) used as data: tessera computes \
                 symbolic sizes only where ops take them as shapes",
                fmt_entries(&d.dims)
            ))),
        }
    }

    pub fn ty(&self, id: NodeId) -> &TensorType {
        &self.g.node(id).ty
    }

    pub fn rank(&self, id: NodeId) -> usize {
        self.ty(id).shape.rank()
    }

    pub fn dtype(&self, id: NodeId) -> DType {
        self.ty(id).dtype
    }

    pub fn dims(&self, id: NodeId) -> Vec<Dim> {
        self.ty(id).shape.0.clone()
    }

    /// The concrete dims of `id`, or an error naming what needs them.
    pub fn concrete(&self, id: NodeId, what: &str) -> Result<Vec<usize>> {
        self.ty(id).shape.as_concrete().ok_or_else(|| {
            self.unsupported(format!("{what} needs concrete dims, got {}", self.ty(id)))
        })
    }

    /// The value of input `i` at import time, as integers (a constant, an
    /// initializer, a computation on them, or a graph input whose value the
    /// caller gave).
    pub fn ints(&mut self, i: usize, what: &str) -> Result<Vec<i64>> {
        let v = self.val(i)?.clone();
        if let Some(ints) = v.dims.as_ref().and_then(DimsVal::ints) {
            return Ok(ints);
        }
        let lit = self.literal_of(i, what)?;
        Ok(lit_ints(&lit))
    }

    /// Input `i`, known at import time, as one integer (a scalar or a
    /// one-element tensor, as ONNX's `k`, `axis` … inputs are).
    pub fn int_scalar(&mut self, i: usize, what: &str) -> Result<i64> {
        match self.ints(i, what)?[..] {
            [v] => Ok(v),
            ref other => Err(self.bad(format!(
                "input {i} ({what}) must hold one value, got {} values",
                other.len()
            ))),
        }
    }

    /// Input `i`, known at import time, as one number (see
    /// [`Ctx::int_scalar`]).
    pub fn float_scalar(&mut self, i: usize, what: &str) -> Result<f64> {
        let lit = self.literal_of(i, what)?;
        match lit_floats(&lit)[..] {
            [v] => Ok(v),
            ref other => Err(self.bad(format!(
                "input {i} ({what}) must hold one value, got {} values",
                other.len()
            ))),
        }
    }

    /// Input `i` as dims (its known dims, or its integer value).
    pub fn dims_input(&mut self, i: usize, what: &str) -> Result<Vec<DimOrNeg>> {
        let v = self.val(i)?.clone();
        if let Some(d) = v.dims {
            return Ok(d.dims);
        }
        Ok(self
            .ints(i, what)?
            .into_iter()
            .map(DimOrNeg::from_int)
            .collect())
    }

    /// The literal value of input `i`, or an error saying that `what` must
    /// be known when the model is imported.
    pub fn literal_of(&mut self, i: usize, what: &str) -> Result<Literal> {
        let id = self.x(i)?;
        match self.fold(id)? {
            Some(lit) => Ok(lit),
            None => Err(self.unsupported(format!(
                "{what} (input {i}, `{}`) must be known when the model is imported: \
                 a constant, an initializer or a graph input whose value is given",
                self.node.input.get(i).map(String::as_str).unwrap_or("")
            ))),
        }
    }

    /// The value of `id` if it depends on no graph input without a given
    /// value, computed with tessera's interpreter.
    pub fn fold(&mut self, id: NodeId) -> Result<Option<Literal>> {
        if let Some(v) = self.folded.get(&id) {
            return Ok(v.clone());
        }
        let value = self.compute_fold(id)?;
        self.folded.insert(id, value.clone());
        Ok(value)
    }

    fn compute_fold(&mut self, id: NodeId) -> Result<Option<Literal>> {
        if let Op::Constant(lit) = &self.g.node(id).op {
            return Ok(Some(lit.clone()));
        }
        // The ancestors of `id`, every one computable.
        let mut need = vec![false; id.index() + 1];
        need[id.index()] = true;
        let mut used_inputs = Vec::new();
        for i in (0..=id.index()).rev() {
            if !need[i] {
                continue;
            }
            let node = &self.g.nodes[i];
            match &node.op {
                Op::Input => {
                    let name = node.meta.name.clone().unwrap_or_default();
                    if !self.known_inputs.contains_key(&name) {
                        return Ok(None);
                    }
                    used_inputs.push(name);
                }
                Op::Rand { .. } | Op::Randn { .. } => return Ok(None),
                _ => {}
            }
            if node.ty.shape.as_concrete().is_none() {
                return Ok(None);
            }
            for x in &node.inputs {
                need[x.index()] = true;
            }
        }
        let mut sub = Graph::new("fold");
        let mut map: HashMap<usize, NodeId> = HashMap::new();
        for (i, _) in need.iter().enumerate().filter(|(_, n)| **n) {
            let node = &self.g.nodes[i];
            let op = match &node.op {
                Op::Input => {
                    let name = node.meta.name.clone().unwrap_or_default();
                    Op::Constant(self.known_inputs[&name].clone())
                }
                op => op.clone(),
            };
            let inputs: Vec<NodeId> = node.inputs.iter().map(|x| map[&x.index()]).collect();
            let new = sub.add(op, &inputs, NodeMeta::default())?;
            map.insert(i, new);
        }
        sub.add_output("value", map[&id.index()]);
        let out = run_graph(&sub, &[])?;
        self.specialised.extend(used_inputs);
        Ok(Some(tensor_literal(&out[0].1)?))
    }

    // ---- building ----

    pub fn add(&mut self, op: Op, inputs: &[NodeId]) -> Result<NodeId> {
        self.g.add(op, inputs, self.meta.clone())
    }

    /// A constant node; an error (naming the current node) when the
    /// literal does not fit its type: a model's data of the wrong length,
    /// a value out of its dtype's range, a size over the limit.
    pub fn constant(&mut self, lit: Literal) -> Result<NodeId> {
        self.g
            .add(Op::Constant(lit), &[], self.meta.clone())
            .map_err(|e| self.bad(format!("a constant it needs: {}", e.message)))
    }

    pub fn int_constant(&mut self, ints: &[i64], scalar: bool) -> Result<NodeId> {
        let shape = if scalar { vec![] } else { vec![ints.len()] };
        self.constant(Literal {
            dtype: DType::I64,
            shape,
            data: LiteralData::Int(ints.to_vec()),
        })
    }

    /// A rank-0 constant of `dtype`.
    pub fn scalar(&mut self, v: f64, dtype: DType) -> Result<NodeId> {
        let value = if dtype.is_float() {
            Scalar::Float(v)
        } else if dtype.is_int() {
            Scalar::Int(v as i64)
        } else {
            Scalar::Bool(v != 0.0)
        };
        self.constant(Literal::scalar(value, dtype))
    }

    /// A rank-0 constant of `like`'s dtype.
    pub fn scalar_like(&mut self, v: f64, like: NodeId) -> Result<NodeId> {
        let dtype = self.dtype(like);
        self.scalar(v, dtype)
    }

    pub fn unary(&mut self, op: UnaryOp, x: NodeId) -> Result<NodeId> {
        self.add(Op::Unary(op), &[x])
    }

    pub fn binary(&mut self, op: BinaryOp, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.add(Op::Binary(op), &[a, b])
    }

    /// `a op c` for a scalar constant `c` of `a`'s dtype.
    pub fn binary_c(&mut self, op: BinaryOp, a: NodeId, c: f64) -> Result<NodeId> {
        let s = self.scalar_like(c, a)?;
        self.binary(op, a, s)
    }

    pub fn compare(&mut self, op: CompareOp, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.add(Op::Compare(op), &[a, b])
    }

    pub fn compare_c(&mut self, op: CompareOp, a: NodeId, c: f64) -> Result<NodeId> {
        let s = self.scalar_like(c, a)?;
        self.compare(op, a, s)
    }

    pub fn where_(&mut self, c: NodeId, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.add(Op::Where, &[c, a, b])
    }

    pub fn cast(&mut self, x: NodeId, dtype: DType) -> Result<NodeId> {
        if self.dtype(x) == dtype {
            return Ok(x);
        }
        self.add(Op::Cast(dtype), &[x])
    }

    pub fn reshape(&mut self, x: NodeId, dims: Vec<Dim>) -> Result<NodeId> {
        if self.dims(x) == dims {
            return Ok(x);
        }
        self.add(Op::Reshape(Shape::new(dims)), &[x])
    }

    pub fn permute(&mut self, x: NodeId, perm: Vec<usize>) -> Result<NodeId> {
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(x);
        }
        self.add(Op::Permute(perm), &[x])
    }

    pub fn expand(&mut self, x: NodeId, dims: Vec<Dim>) -> Result<NodeId> {
        if self.dims(x) == dims {
            return Ok(x);
        }
        self.add(Op::Expand(Shape::new(dims)), &[x])
    }

    /// `x[start..end]` along `dim` with a positive step (bounds in range).
    pub fn slice(
        &mut self,
        x: NodeId,
        dim: usize,
        start: usize,
        end: usize,
        step: usize,
    ) -> Result<NodeId> {
        let size = self.dims(x)[dim].as_const();
        if start == 0 && step == 1 && size == Some(end) {
            return Ok(x);
        }
        self.add(
            Op::Slice {
                dim,
                start,
                end: Dim::Const(end),
                step,
            },
            &[x],
        )
    }

    pub fn cat(&mut self, xs: &[NodeId], dim: usize) -> Result<NodeId> {
        if xs.len() == 1 {
            return Ok(xs[0]);
        }
        self.add(Op::Cat { dim }, xs)
    }

    /// `x` with a dim of size 1 inserted at `at`.
    pub fn unsqueeze(&mut self, x: NodeId, at: usize) -> Result<NodeId> {
        let mut dims = self.dims(x);
        dims.insert(at, Dim::Const(1));
        self.reshape(x, dims)
    }

    /// A normalised axis of a rank-`rank` tensor (ONNX counts negative
    /// axes from the end).
    pub fn axis(&self, axis: i64, rank: usize) -> Result<usize> {
        let r = rank as i64;
        let a = if axis < 0 { axis + r } else { axis };
        if a < 0 || a >= r {
            return Err(self.bad(format!("axis {axis} is out of range for rank {rank}")));
        }
        Ok(a as usize)
    }

    /// Normalised, sorted, unique axes.
    pub fn axes(&self, axes: &[i64], rank: usize) -> Result<Vec<usize>> {
        let mut out = axes
            .iter()
            .map(|&a| self.axis(a, rank))
            .collect::<Result<Vec<_>>>()?;
        out.sort_unstable();
        let len = out.len();
        out.dedup();
        if out.len() != len {
            return Err(self.bad(format!("axes {axes:?} repeat an axis")));
        }
        Ok(out)
    }

    /// The node's attributes of type `t` (a tensor attribute's value).
    pub fn attr_tensor(&self, name: &str) -> Option<&crate::proto::TensorProto> {
        self.attr(name).and_then(|a| {
            if a.r#type == at::TENSOR || a.t.is_some() {
                a.t.as_ref()
            } else {
                None
            }
        })
    }
}

/// An entry of a shape input: a dim, or a negative number (`-1`: infer).
#[derive(Clone, Debug, PartialEq)]
pub enum DimOrNeg {
    Dim(Dim),
    Neg(i64),
}

impl DimOrNeg {
    /// The entry as an integer, when it is one.
    pub fn as_int(&self) -> Option<i64> {
        match self {
            DimOrNeg::Dim(d) => d.as_const().map(|c| c as i64),
            DimOrNeg::Neg(v) => Some(*v),
        }
    }

    pub fn from_int(v: i64) -> DimOrNeg {
        match usize::try_from(v) {
            Ok(c) => DimOrNeg::Dim(Dim::Const(c)),
            Err(_) => DimOrNeg::Neg(v),
        }
    }
}

impl std::fmt::Display for DimOrNeg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DimOrNeg::Dim(d) => write!(f, "{d}"),
            DimOrNeg::Neg(v) => write!(f, "{v}"),
        }
    }
}

impl DimsVal {
    /// The entries as integers, when none is symbolic.
    pub fn ints(&self) -> Option<Vec<i64>> {
        self.dims.iter().map(DimOrNeg::as_int).collect()
    }

    /// Whether some entry is symbolic.
    pub fn is_symbolic(&self) -> bool {
        self.ints().is_none()
    }
}

pub fn fmt_entries(dims: &[DimOrNeg]) -> String {
    let parts: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

/// A literal's values as integers (floats truncated).
pub fn lit_ints(lit: &Literal) -> Vec<i64> {
    match &lit.data {
        LiteralData::Int(v) => v.clone(),
        LiteralData::Float(v) => v.iter().map(|&x| x as i64).collect(),
        LiteralData::Bool(v) => v.iter().map(|&b| b as i64).collect(),
    }
}

/// A literal's values as floats.
pub fn lit_floats(lit: &Literal) -> Vec<f64> {
    match &lit.data {
        LiteralData::Int(v) => v.iter().map(|&x| x as f64).collect(),
        LiteralData::Float(v) => v.clone(),
        LiteralData::Bool(v) => v.iter().map(|&b| b as u8 as f64).collect(),
    }
}

/// A host tensor's values as a literal.
pub fn tensor_literal(t: &Tensor) -> Result<Literal> {
    t.to_literal()
}

/// Adds context to an error's message.
pub trait WithContext {
    fn with_context(self, what: &str) -> Self;
}

impl WithContext for Error {
    fn with_context(mut self, what: &str) -> Error {
        self.message = format!("{what}: {}", self.message);
        self
    }
}
