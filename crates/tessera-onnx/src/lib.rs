//! ONNX import: a `.onnx` model read into tessera's graph IR.
//!
//! [`Model::load`] parses the protobuf (the messages in [`proto`], written
//! with prost's derive attributes: no `protoc` at build time) and
//! [`import`] builds a [`Graph`]: every ONNX node becomes tessera ops
//! (one op, or an exact decomposition into several), with its type
//! inferred by tessera's own type inference. A dim the model leaves
//! dynamic (`dim_param: "batch"`, or no dim at all) becomes a symbolic
//! [`tessera::ir::Dim`], so one graph serves every size; shapes
//! computed from it (`Shape` → `Gather` → `Concat` → `Reshape`, as PyTorch
//! exports them) are followed symbolically.
//!
//! Opsets up to [`MAX_OPSET`] of the default domain are read, each op by
//! the rules of the opset version the model imports (attributes that later
//! versions turned into inputs, as for `Reshape`, `Slice`, `Squeeze`,
//! `ReduceSum` and `Clip`, are read from where that version keeps them;
//! before opset 7, the `broadcast`/`axis` attributes of binary ops, a
//! string `to` of `Cast` before 6 and `Concat`'s default axis before 4).
//! Ops that take a shape, an axis list or a count as an input need its
//! value when the model is imported: a constant, an initializer, something
//! computed from them, or a graph input whose value the caller passes in
//! [`ImportOptions::known_inputs`] (the graph is then specialised to it:
//! [`Imported::specialised`]).
//!
//! Ops without a mapping — sequences, strings, control flow, training-only
//! and random ops among them — are reported all at once: one error listing
//! each by name and node.
//!
//! Large initializers (weights) become graph inputs whose values are in
//! [`Imported::params`], so that printed graphs stay readable and the
//! compile cache does not hash megabytes; [`Imported::inputs`] puts the
//! caller's inputs and the parameters in the graph's order.

pub mod proto;

pub mod backend_test;
pub mod build;
mod builder;
mod ops;
mod tensor;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tessera::ir::{Dim, Literal, NodeMeta, Shape, TensorType};
use tessera::{Error, ErrorKind, Graph, Result, Tensor};

pub use builder::tensor_literal;
pub use tensor::{decode_tensor, dtype_of, onnx_type_of, read_literal, read_tensor};

use builder::{Ctx, Val, WithContext};
use proto::{type_proto, ModelProto, ValueInfoProto};

/// The newest opset of the default domain this reader knows.
pub const MAX_OPSET: i64 = 28;
/// The oldest opset of the default domain this reader knows.
pub const MIN_OPSET: i64 = 1;

/// A parsed ONNX model.
#[derive(Clone, Debug)]
pub struct Model {
    pub proto: ModelProto,
    /// The folder external data is read from (the model file's folder).
    pub dir: Option<PathBuf>,
    /// The model's file name (in error locations and the graph's name).
    pub file: String,
}

impl Model {
    /// Reads and parses a `.onnx` file.
    pub fn load(path: impl AsRef<Path>) -> Result<Model> {
        let path = path.as_ref();
        let bytes =
            std::fs::read(path).map_err(|e| Error::io(format!("{}: {e}", path.display())))?;
        let file = path.file_name().map_or_else(
            || path.display().to_string(),
            |f| f.to_string_lossy().into_owned(),
        );
        let mut model = Model::from_bytes(&bytes, &file)?;
        model.dir = Some(
            path.parent()
                .map_or_else(|| PathBuf::from("."), Path::to_path_buf),
        );
        Ok(model)
    }

    /// Parses a model from its bytes; `file` names it in messages.
    pub fn from_bytes(bytes: &[u8], file: &str) -> Result<Model> {
        let proto: ModelProto = prost::Message::decode(bytes).map_err(|e| {
            Error::new(
                ErrorKind::Parse,
                format!("{file}: not an ONNX model (protobuf: {e})"),
            )
        })?;
        if proto.graph.is_none() {
            return Err(Error::new(
                ErrorKind::Parse,
                format!("{file}: the model has no graph"),
            ));
        }
        Ok(Model {
            proto,
            dir: None,
            file: file.to_string(),
        })
    }

    /// The version of the default domain (`""` or `ai.onnx`) the model
    /// imports.
    pub fn opset(&self) -> Option<i64> {
        self.proto
            .opset_import
            .iter()
            .find(|o| o.domain.is_empty() || o.domain == "ai.onnx")
            .map(|o| o.version)
    }

    /// The op types of the graph's nodes with no mapping to tessera, each
    /// with the nodes that use it (by name, or by number when unnamed).
    pub fn unsupported_ops(&self) -> Vec<(String, Vec<String>)> {
        let graph = self.proto.graph.as_ref().expect("checked when parsed");
        let mut out: Vec<(String, Vec<String>)> = Vec::new();
        // The nodes of the graph and of every subgraph (If branches, Loop
        // and Scan bodies), depth first.
        let mut nodes: Vec<(usize, &proto::NodeProto)> = Vec::new();
        fn walk<'a>(
            g: &'a proto::GraphProto,
            top: Option<usize>,
            out: &mut Vec<(usize, &'a proto::NodeProto)>,
        ) {
            for (i, n) in g.node.iter().enumerate() {
                out.push((top.unwrap_or(i), n));
                for a in &n.attribute {
                    for sub in a.g.iter().map(|b| &**b).chain(a.graphs.iter()) {
                        walk(sub, Some(top.unwrap_or(i)), out);
                    }
                }
            }
        }
        walk(graph, None, &mut nodes);
        for (i, node) in nodes {
            if ops::is_supported(&node.domain, &node.op_type) {
                continue;
            }
            let op = match node.domain.as_str() {
                "" | "ai.onnx" => node.op_type.clone(),
                d => format!("{d}.{}", node.op_type),
            };
            let who = node_label(&node.name, i);
            match out.iter_mut().find(|(o, _)| *o == op) {
                Some((_, nodes)) => nodes.push(who),
                None => out.push((op, vec![who])),
            }
        }
        out
    }
}

fn node_label(name: &str, i: usize) -> String {
    if name.is_empty() {
        format!("#{i}")
    } else {
        format!("`{name}`")
    }
}

/// How to import.
#[derive(Clone, Debug)]
pub struct ImportOptions {
    /// Values of graph inputs that ops may need when the model is imported
    /// (a shape fed by an input): used only where needed.
    pub known_inputs: HashMap<String, Literal>,
    /// Initializers with more elements than this become graph inputs
    /// ([`Imported::params`]); smaller ones are constants of the graph.
    pub max_constant_elements: usize,
}

impl Default for ImportOptions {
    fn default() -> ImportOptions {
        ImportOptions {
            known_inputs: HashMap::new(),
            max_constant_elements: 64,
        }
    }
}

/// An imported model.
#[derive(Debug)]
pub struct Imported {
    pub graph: Graph,
    /// The initializers that are graph inputs, with their values.
    pub params: Vec<(String, Tensor)>,
    /// The graph inputs whose values the import used (from
    /// [`ImportOptions::known_inputs`]): the graph computes the right
    /// thing only for those values.
    pub specialised: Vec<String>,
    /// The model's own inputs (the graph's inputs less the parameters), in
    /// the model's order.
    pub model_inputs: Vec<String>,
}

impl Imported {
    /// The graph's inputs in order: the caller's `named` inputs (each model
    /// input once) and the parameters.
    pub fn inputs(&self, named: Vec<(String, Tensor)>) -> Result<Vec<Tensor>> {
        let mut all = named;
        all.extend(self.params.iter().cloned());
        tessera::tensor::interpret::inputs_by_name(&self.graph, all)
    }
}

/// Imports `model` into a tessera graph (see the crate's documentation).
pub fn import(model: &Model, options: &ImportOptions) -> Result<Imported> {
    let file = model.file.as_str();
    let opset = model.opset().unwrap_or(1);
    if !(MIN_OPSET..=MAX_OPSET).contains(&opset) {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "{file}: the model imports opset {opset} of the default domain; \
                 this reader knows opsets {MIN_OPSET} to {MAX_OPSET}"
            ),
        ));
    }
    let unsupported = model.unsupported_ops();
    if !unsupported.is_empty() {
        let list: Vec<String> = unsupported
            .iter()
            .map(|(op, nodes)| format!("{op} (node {})", nodes.join(", ")))
            .collect();
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "{file}: {} op type{} without a mapping to tessera: {}",
                unsupported.len(),
                if unsupported.len() == 1 { "" } else { "s" },
                list.join("; ")
            ),
        ));
    }
    let graph = model.proto.graph.as_ref().expect("checked when parsed");
    let name = if graph.name.is_empty() {
        file.trim_end_matches(".onnx").to_string()
    } else {
        graph.name.clone()
    };
    let mut ctx = Ctx::new(&name, opset, &options.known_inputs);
    ctx.file = Arc::from(file);
    let dir = model.dir.as_deref();
    let mut params = Vec::new();
    let initialised: HashSet<&str> = graph.initializer.iter().map(|t| t.name.as_str()).collect();
    // The model's inputs (an input with an initializer is a constant with
    // a default value in ONNX: the initializer is used).
    let mut symbols = Symbols::default();
    let mut model_inputs = Vec::new();
    for vi in &graph.input {
        if initialised.contains(vi.name.as_str()) {
            continue;
        }
        let ty = value_type(vi, &mut symbols)
            .map_err(|e| e.with_context(&format!("{file}: graph input `{}`", vi.name)))?;
        let id = ctx.g.add_input(vi.name.clone(), ty);
        ctx.values.insert(vi.name.clone(), Val::node(id));
        model_inputs.push(vi.name.clone());
    }
    for t in &graph.initializer {
        let what = format!("{file}: initializer `{}`", t.name);
        let lit = read_literal(t, dir, &what)?;
        let id = if lit.data.len() > options.max_constant_elements {
            let value = Tensor::from_literal(lit.clone());
            let ty = TensorType::new(lit.dtype, Shape::from_concrete(&lit.shape));
            params.push((t.name.clone(), value));
            ctx.g.add_input(t.name.clone(), ty)
        } else {
            ctx.constant(lit)?
        };
        ctx.values.insert(t.name.clone(), Val::node(id));
    }
    if let Some(t) = graph.sparse_initializer.first() {
        let name = t.values.as_ref().map_or("", |v| v.name.as_str());
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!("{file}: sparse initializer `{name}`"),
        ));
    }
    let output_names: Vec<String> = graph.output.iter().map(|o| o.name.clone()).collect();
    ops::convert_nodes(&mut ctx, &graph.node, &output_names)?;
    for vi in &graph.output {
        let v = ctx.values.get(&vi.name).cloned().ok_or_else(|| {
            Error::new(
                ErrorKind::Parse,
                format!("{file}: graph output `{}` is computed by no node", vi.name),
            )
        })?;
        ctx.meta = NodeMeta::named(&vi.name);
        let id = ctx
            .materialise(&v)
            .map_err(|e| e.with_context(&format!("{file}: graph output `{}`", vi.name)))?;
        check_declared(&ctx.g, vi, id, &mut symbols)
            .map_err(|e| e.with_context(&format!("{file}: graph output `{}`", vi.name)))?;
        ctx.g.add_output(vi.name.clone(), id);
    }
    ctx.g.verify()?;
    let mut specialised: Vec<String> = ctx.specialised.into_iter().collect();
    specialised.sort();
    Ok(Imported {
        graph: ctx.g,
        params,
        specialised,
        model_inputs,
    })
}

/// The names given to dynamic dims: `dim_param`s by their name (made a
/// valid symbol), anonymous dims `d0`, `d1` … .
#[derive(Default)]
struct Symbols {
    by_param: HashMap<String, Dim>,
    anonymous: usize,
}

impl Symbols {
    fn param(&mut self, p: &str) -> Dim {
        if let Some(d) = self.by_param.get(p) {
            return d.clone();
        }
        let mut name: String = p
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        if !name.starts_with(|c: char| c.is_ascii_alphabetic()) {
            name = format!("p{name}");
        }
        while self
            .by_param
            .values()
            .any(|d| d.symbols().iter().any(|s| **s == *name))
        {
            name.push('_');
        }
        let d = Dim::sym(&name);
        self.by_param.insert(p.to_string(), d.clone());
        d
    }

    fn fresh(&mut self) -> Dim {
        loop {
            let name = format!("d{}", self.anonymous);
            self.anonymous += 1;
            if !self.by_param.contains_key(&name) {
                return self.param(&name);
            }
        }
    }
}

/// The tessera type of a graph input's declared type.
fn value_type(vi: &ValueInfoProto, symbols: &mut Symbols) -> Result<TensorType> {
    let tensor = match vi.r#type.as_ref().and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => t,
        Some(other) => {
            let kind = match other {
                type_proto::Value::SequenceType(_) => "a sequence",
                type_proto::Value::MapType(_) => "a map",
                type_proto::Value::OptionalType(_) => "an optional",
                type_proto::Value::SparseTensorType(_) => "a sparse tensor",
                _ => "an opaque value",
            };
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("is {kind}; tessera imports tensors only"),
            ));
        }
        None => {
            return Err(Error::new(ErrorKind::Parse, "has no type".to_string()));
        }
    };
    let dtype = dtype_of(tensor.elem_type, "it")?;
    let shape = match &tensor.shape {
        Some(s) => s
            .dim
            .iter()
            .map(|d| match &d.value {
                Some(proto::tensor_shape_proto::dimension::Value::DimValue(v)) if *v >= 0 => {
                    Dim::Const(*v as usize)
                }
                Some(proto::tensor_shape_proto::dimension::Value::DimParam(p)) if !p.is_empty() => {
                    symbols.param(p)
                }
                _ => symbols.fresh(),
            })
            .collect(),
        None => {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "has no shape (not even a rank); tessera needs each input's rank",
            ))
        }
    };
    Ok(TensorType::new(dtype, Shape::new(shape)))
}

/// Checks an output's inferred type against the model's declaration: the
/// dtype, the rank and every concrete dim both give.
fn check_declared(
    g: &Graph,
    vi: &ValueInfoProto,
    id: tessera::ir::NodeId,
    _: &mut Symbols,
) -> Result<()> {
    let Some(type_proto::Value::TensorType(t)) = vi.r#type.as_ref().and_then(|t| t.value.as_ref())
    else {
        return Ok(());
    };
    let got = &g.node(id).ty;
    if t.elem_type != 0 && onnx_type_of(got.dtype) != t.elem_type {
        return Err(Error::new(
            ErrorKind::DType,
            format!(
                "the model declares element type {}, tessera computes {}",
                proto::data_type::name(t.elem_type),
                got
            ),
        ));
    }
    if let Some(s) = &t.shape {
        let declared: Vec<Option<i64>> = s
            .dim
            .iter()
            .map(|d| match &d.value {
                Some(proto::tensor_shape_proto::dimension::Value::DimValue(v)) => Some(*v),
                _ => None,
            })
            .collect();
        let fits = declared.len() == got.shape.rank()
            && declared
                .iter()
                .zip(got.shape.dims())
                .all(|(d, g)| match (d, g.as_const()) {
                    (Some(d), Some(g)) => *d as usize == g,
                    _ => true,
                });
        if !fits {
            return Err(Error::new(
                ErrorKind::Shape,
                format!(
                    "the model declares shape {declared:?}, tessera infers {}",
                    got
                ),
            ));
        }
    }
    Ok(())
}

/// `graph` with every `from` float value made a `to` value: inputs,
/// constants, fills and casts to `from` retyped, every other node's type
/// inferred again (to run a model in bf16 or f16). Values computed in
/// another float type on purpose (an exact decomposition in f64) stay so.
pub fn convert_float_dtype(
    graph: &Graph,
    from: tessera::DType,
    to: tessera::DType,
) -> Result<Graph> {
    use tessera::ir::Op;
    let mut out = Graph::new(graph.name.clone());
    let mut map = Vec::with_capacity(graph.len());
    let swap = |d: tessera::DType| if d == from { to } else { d };
    for node in &graph.nodes {
        let inputs: Vec<tessera::ir::NodeId> = node.inputs.iter().map(|i| map[i.index()]).collect();
        let id = match &node.op {
            Op::Input => {
                let ty = TensorType::new(swap(node.ty.dtype), node.ty.shape.clone());
                let name = node.meta.name.clone().unwrap_or_default();
                out.add_input(name, ty)
            }
            op => {
                let op = match op.clone() {
                    Op::Constant(mut lit) => {
                        lit.dtype = swap(lit.dtype);
                        Op::Constant(lit)
                    }
                    Op::Full {
                        value,
                        shape,
                        dtype,
                    } => Op::Full {
                        value,
                        shape,
                        dtype: swap(dtype),
                    },
                    Op::Arange {
                        start,
                        end,
                        step,
                        dtype,
                    } => Op::Arange {
                        start,
                        end,
                        step,
                        dtype: swap(dtype),
                    },
                    Op::Cast(d) => Op::Cast(swap(d)),
                    other => other,
                };
                out.add(op, &inputs, node.meta.clone())?
            }
        };
        map.push(id);
    }
    for o in &graph.outputs {
        out.add_output(o.name.clone(), map[o.node.index()]);
    }
    Ok(out)
}
