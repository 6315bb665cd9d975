//! The one table of op names and their attributes, shared by the printer and
//! the parser so that the two cannot drift apart: [`signature`] says which
//! attributes an op takes (names, order, kinds), [`attrs_of`] takes them out
//! of an [`Op`] and [`build`] puts them back. A unit test checks that the
//! three agree for every op.

use std::fmt;

use crate::ir::dtype::DType;
use crate::ir::infer::TensorType;
use crate::ir::op::{
    ArgReduceOp, BinaryOp, CompareOp, Literal, LiteralData, Op, ReduceOp, Scalar, UnaryOp,
};
use crate::ir::shape::{Dim, Shape};

/// How an attribute's value is written (and so how the parser reads it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum AttrKind {
    /// A non-negative integer: a dim index, a slice bound.
    Usize,
    /// A signed integer (a diagonal offset).
    I64,
    /// A float; `nan`, `inf` and `-inf` included.
    Float,
    Bool,
    /// A number or a bool whose spelling gives its kind: `1` is an int,
    /// `1.0` a float, `true` a bool.
    Scalar,
    DType,
    /// `[2*s0,4]`
    Shape,
    /// One dim: `8`, `s1`, `2*s0+1`.
    Dim,
    /// `[0,2]`
    Dims,
    /// A constant's data: one value for a rank-0 constant, else a flat
    /// row-major list. Its dtype and shape are the node's type.
    Data,
    /// A JSON string: a custom op's name, its attributes as JSON.
    Str,
}

/// An attribute value, as printed and as parsed.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Attr {
    Usize(usize),
    I64(i64),
    Float(f64),
    Bool(bool),
    Scalar(Scalar),
    DType(DType),
    Shape(Shape),
    Dim(Dim),
    Dims(Vec<usize>),
    /// `list` says whether the values were written as a list (`[1.0]`) or
    /// as a single value (`1.0`).
    Data {
        values: Vec<Scalar>,
        list: bool,
    },
    Str(String),
}

/// The ops that take no attributes, by name.
fn plain_op(name: &str) -> Option<Op> {
    let op = match name {
        "input" => Op::Input,
        "where" => Op::Where,
        "matmul" => Op::MatMul,
        "contiguous" => Op::Contiguous,
        _ => {
            let unary = UnaryOp::ALL.into_iter().find(|u| u.name() == name);
            let binary = BinaryOp::ALL.into_iter().find(|b| b.name() == name);
            let compare = CompareOp::ALL.into_iter().find(|c| c.name() == name);
            return unary
                .map(Op::Unary)
                .or(binary.map(Op::Binary))
                .or(compare.map(Op::Compare));
        }
    };
    Some(op)
}

fn reduce_op(name: &str) -> Option<ReduceOp> {
    ReduceOp::ALL.into_iter().find(|r| r.name() == name)
}

fn arg_reduce_op(name: &str) -> Option<ArgReduceOp> {
    [ArgReduceOp::ArgMax, ArgReduceOp::ArgMin]
        .into_iter()
        .find(|r| r.name() == name)
}

/// The attributes `op_name` takes, in printing order; `None` for an unknown op.
pub(super) fn signature(op_name: &str) -> Option<&'static [(&'static str, AttrKind)]> {
    use AttrKind::*;
    if plain_op(op_name).is_some() {
        return Some(&[]);
    }
    if reduce_op(op_name).is_some() {
        return Some(&[("dims", Dims), ("keepdim", Bool)]);
    }
    if arg_reduce_op(op_name).is_some() {
        return Some(&[("dim", Usize), ("keepdim", Bool)]);
    }
    Some(match op_name {
        "constant" => &[("value", Data)],
        "full" => &[("value", Scalar), ("shape", Shape), ("dtype", DType)],
        "arange" => &[
            ("start", Float),
            ("end", Float),
            ("step", Float),
            ("dtype", DType),
        ],
        "rand" | "randn" => &[("shape", Shape), ("dtype", DType)],
        "cast" | "bitcast" => &[("dtype", DType)],
        "softmax" | "log_softmax" | "cat" | "index_select" | "gather" | "index_add"
        | "scatter_add" => &[("dim", Usize)],
        "reshape" | "expand" => &[("shape", Shape)],
        "permute" => &[("perm", Dims)],
        "slice" => &[
            ("dim", Usize),
            ("start", Usize),
            ("end", Dim),
            ("step", Usize),
        ],
        "tril" | "triu" => &[("diagonal", I64)],
        "matmul_t" => &[("transpose_a", Bool), ("transpose_b", Bool)],
        "custom" => &[("op", Str), ("attrs", Str)],
        "custom_output" => &[("index", Usize), ("dtype", DType), ("shape", Shape)],
        _ => return None,
    })
}

/// What to write instead of attribute `attr` of `op_name`, which that op
/// took in an earlier version of the text form: a file written then gets
/// this, not a bare "unknown attribute".
pub(super) fn retired_attribute(op_name: &str, attr: &str) -> Option<&'static str> {
    match (op_name, attr) {
        ("rand" | "randn", "seed") => Some(
            "the seed is the op's operand now: write `rand(%seed) {shape=…, dtype=…}` \
             with `%seed` an i64[] value (an input, or e.g. `%seed = constant {value=7} : i64[]`)",
        ),
        _ => None,
    }
}

/// The attribute values of `op`, in [`signature`] order.
pub(super) fn attrs_of(op: &Op) -> Vec<Attr> {
    use Attr as A;
    match op {
        Op::Input
        | Op::Unary(_)
        | Op::Binary(_)
        | Op::Compare(_)
        | Op::Where
        | Op::MatMul
        | Op::Contiguous => vec![],
        Op::Constant(lit) => vec![A::Data {
            values: literal_values(&lit.data),
            list: !lit.shape.is_empty(),
        }],
        Op::Full {
            value,
            shape,
            dtype,
        } => vec![A::Scalar(*value), A::Shape(shape.clone()), A::DType(*dtype)],
        Op::Arange {
            start,
            end,
            step,
            dtype,
        } => vec![
            A::Float(*start),
            A::Float(*end),
            A::Float(*step),
            A::DType(*dtype),
        ],
        Op::Rand { shape, dtype } | Op::Randn { shape, dtype } => {
            vec![A::Shape(shape.clone()), A::DType(*dtype)]
        }
        Op::Cast(dtype) | Op::BitCast(dtype) => vec![A::DType(*dtype)],
        Op::Reduce { dims, keepdim, .. } => vec![A::Dims(dims.clone()), A::Bool(*keepdim)],
        Op::ArgReduce { dim, keepdim, .. } => vec![A::Usize(*dim), A::Bool(*keepdim)],
        Op::Softmax { dim }
        | Op::LogSoftmax { dim }
        | Op::Cat { dim }
        | Op::IndexSelect { dim }
        | Op::Gather { dim }
        | Op::IndexAdd { dim }
        | Op::ScatterAdd { dim } => vec![A::Usize(*dim)],
        Op::Reshape(shape) | Op::Expand(shape) => vec![A::Shape(shape.clone())],
        Op::Permute(perm) => vec![A::Dims(perm.clone())],
        Op::Slice {
            dim,
            start,
            end,
            step,
        } => vec![
            A::Usize(*dim),
            A::Usize(*start),
            A::Dim(end.clone()),
            A::Usize(*step),
        ],
        Op::Tril { diagonal } | Op::Triu { diagonal } => vec![A::I64(*diagonal)],
        Op::MatMulT {
            transpose_a,
            transpose_b,
        } => vec![A::Bool(*transpose_a), A::Bool(*transpose_b)],
        Op::Custom(call) => vec![A::Str(call.name().to_string()), A::Str(call.attrs_json())],
        Op::CustomOutput {
            index,
            dtype,
            shape,
        } => vec![A::Usize(*index), A::DType(*dtype), A::Shape(shape.clone())],
    }
}

/// The op named `op_name` with `attrs` (in [`signature`] order, already
/// checked against it); `ty` is the node's declared type, which a constant
/// takes its dtype and shape from. The error is a message for the parser.
pub(super) fn build(op_name: &str, attrs: &[Attr], ty: &TensorType) -> Result<Op, String> {
    use Attr as A;
    let mismatch = || format!("`{op_name}` does not take these attributes");
    if let Some(op) = plain_op(op_name).filter(|_| attrs.is_empty()) {
        return Ok(op);
    }
    let op = match (op_name, attrs) {
        ("constant", [A::Data { values, list }]) => Op::Constant(literal(values, *list, ty)?),
        ("full", [A::Scalar(value), A::Shape(shape), A::DType(dtype)]) => Op::Full {
            value: *value,
            shape: shape.clone(),
            dtype: *dtype,
        },
        ("arange", [A::Float(start), A::Float(end), A::Float(step), A::DType(dtype)]) => {
            Op::Arange {
                start: *start,
                end: *end,
                step: *step,
                dtype: *dtype,
            }
        }
        ("rand", [A::Shape(shape), A::DType(dtype)]) => Op::Rand {
            shape: shape.clone(),
            dtype: *dtype,
        },
        ("randn", [A::Shape(shape), A::DType(dtype)]) => Op::Randn {
            shape: shape.clone(),
            dtype: *dtype,
        },
        ("cast", [A::DType(dtype)]) => Op::Cast(*dtype),
        ("bitcast", [A::DType(dtype)]) => Op::BitCast(*dtype),
        ("softmax", [A::Usize(dim)]) => Op::Softmax { dim: *dim },
        ("log_softmax", [A::Usize(dim)]) => Op::LogSoftmax { dim: *dim },
        ("cat", [A::Usize(dim)]) => Op::Cat { dim: *dim },
        ("index_select", [A::Usize(dim)]) => Op::IndexSelect { dim: *dim },
        ("gather", [A::Usize(dim)]) => Op::Gather { dim: *dim },
        ("index_add", [A::Usize(dim)]) => Op::IndexAdd { dim: *dim },
        ("scatter_add", [A::Usize(dim)]) => Op::ScatterAdd { dim: *dim },
        ("reshape", [A::Shape(shape)]) => Op::Reshape(shape.clone()),
        ("expand", [A::Shape(shape)]) => Op::Expand(shape.clone()),
        ("permute", [A::Dims(perm)]) => Op::Permute(perm.clone()),
        ("slice", [A::Usize(dim), A::Usize(start), A::Dim(end), A::Usize(step)]) => Op::Slice {
            dim: *dim,
            start: *start,
            end: end.clone(),
            step: *step,
        },
        ("tril", [A::I64(diagonal)]) => Op::Tril {
            diagonal: *diagonal,
        },
        ("triu", [A::I64(diagonal)]) => Op::Triu {
            diagonal: *diagonal,
        },
        ("matmul_t", [A::Bool(transpose_a), A::Bool(transpose_b)]) => Op::MatMulT {
            transpose_a: *transpose_a,
            transpose_b: *transpose_b,
        },
        ("custom", [A::Str(name), A::Str(attrs)]) => Op::Custom(custom_call(name, attrs)?),
        ("custom_output", [A::Usize(index), A::DType(dtype), A::Shape(shape)]) => {
            Op::CustomOutput {
                index: *index,
                dtype: *dtype,
                shape: shape.clone(),
            }
        }
        (name, [A::Dims(dims), A::Bool(keepdim)]) => Op::Reduce {
            op: reduce_op(name).ok_or_else(mismatch)?,
            dims: dims.clone(),
            keepdim: *keepdim,
        },
        (name, [A::Usize(dim), A::Bool(keepdim)]) => Op::ArgReduce {
            op: arg_reduce_op(name).ok_or_else(mismatch)?,
            dim: *dim,
            keepdim: *keepdim,
        },
        _ => return Err(mismatch()),
    };
    Ok(op)
}

/// The registered custom op `name` with `attrs` (a JSON object).
fn custom_call(name: &str, attrs: &str) -> Result<crate::ir::custom::CustomCall, String> {
    let op = crate::ir::custom::lookup(name).map_err(|e| e.to_string())?;
    let attrs = match serde_json::from_str::<serde_json::Value>(attrs) {
        Ok(serde_json::Value::Object(map)) => map,
        _ => {
            return Err(format!(
                "the attributes of `{name}` must be a JSON object, got {attrs}"
            ))
        }
    };
    Ok(crate::ir::custom::CustomCall {
        op,
        attrs: std::sync::Arc::new(attrs),
    })
}

fn literal_values(data: &LiteralData) -> Vec<Scalar> {
    match data {
        LiteralData::Float(v) => v.iter().map(|&x| Scalar::Float(x)).collect(),
        LiteralData::Int(v) => v.iter().map(|&x| Scalar::Int(x)).collect(),
        LiteralData::Bool(v) => v.iter().map(|&x| Scalar::Bool(x)).collect(),
    }
}

/// A constant of type `ty` holding `values`.
fn literal(values: &[Scalar], list: bool, ty: &TensorType) -> Result<Literal, String> {
    let shape = ty
        .shape
        .as_concrete()
        .ok_or_else(|| format!("a constant needs a concrete shape, found {ty}"))?;
    let scalar = shape.is_empty();
    if list == scalar {
        return Err(match list {
            true => format!("a constant of type {ty} is written as one value, not a list"),
            false => format!("a constant of type {ty} is written as a list of values"),
        });
    }
    let numel = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    if numel != Some(values.len()) {
        return Err(format!(
            "a constant of type {ty} needs {} values, found {}",
            numel.map_or("too many".to_string(), |n| n.to_string()),
            values.len()
        ));
    }
    let data = literal_data(values, ty.dtype)?;
    Ok(Literal {
        dtype: ty.dtype,
        shape,
        data,
    })
}

/// Floats accept integers (`1` is `1.0`); ints and bools take only their own kind.
fn literal_data(values: &[Scalar], dtype: DType) -> Result<LiteralData, String> {
    let wrong = |v: &Scalar| {
        format!(
            "a constant of dtype {dtype} cannot hold `{}`",
            ScalarText(*v)
        )
    };
    let data = if dtype.is_float() {
        let floats = values.iter().map(|v| match v {
            Scalar::Float(x) => Ok(*x),
            Scalar::Int(i) => Ok(*i as f64),
            Scalar::Bool(_) => Err(wrong(v)),
        });
        LiteralData::Float(floats.collect::<Result<_, _>>()?)
    } else if dtype.is_int() {
        let ints = values.iter().map(|v| match v {
            Scalar::Int(i) => Ok(*i),
            _ => Err(wrong(v)),
        });
        LiteralData::Int(ints.collect::<Result<_, _>>()?)
    } else {
        let bools = values.iter().map(|v| match v {
            Scalar::Bool(b) => Ok(*b),
            _ => Err(wrong(v)),
        });
        LiteralData::Bool(bools.collect::<Result<_, _>>()?)
    };
    Ok(data)
}

/// A float as the text form writes it: Rust's shortest round-trip form
/// (`0.1`, `1e-7`, `-0.0`), and `nan`, `inf`, `-inf`.
pub(super) struct FloatText(pub f64);

impl fmt::Display for FloatText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            x if x.is_nan() => f.write_str("nan"),
            x if x.is_infinite() => f.write_str(if x > 0.0 { "inf" } else { "-inf" }),
            x => write!(f, "{x:?}"),
        }
    }
}

/// A scalar whose spelling keeps its kind: `1`, `1.0`, `true`.
pub(super) struct ScalarText(pub Scalar);

impl fmt::Display for ScalarText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Scalar::Float(x) => FloatText(x).fmt(f),
            Scalar::Int(i) => write!(f, "{i}"),
            Scalar::Bool(b) => write!(f, "{b}"),
        }
    }
}

/// `[a,b,c]`
fn write_list<T>(
    f: &mut fmt::Formatter<'_>,
    items: &[T],
    each: impl Fn(&T, &mut fmt::Formatter<'_>) -> fmt::Result,
) -> fmt::Result {
    f.write_str("[")?;
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            f.write_str(",")?;
        }
        each(item, f)?;
    }
    f.write_str("]")
}

impl fmt::Display for Attr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attr::Usize(v) => write!(f, "{v}"),
            Attr::I64(v) => write!(f, "{v}"),
            Attr::Float(v) => FloatText(*v).fmt(f),
            Attr::Bool(v) => write!(f, "{v}"),
            Attr::Scalar(v) => ScalarText(*v).fmt(f),
            Attr::DType(d) => write!(f, "{d}"),
            Attr::Shape(s) => write!(f, "{s}"),
            Attr::Dim(d) => write!(f, "{d}"),
            Attr::Dims(dims) => write_list(f, dims, |d, f| write!(f, "{d}")),
            Attr::Data { values, list: true } => {
                write_list(f, values, |v, f| ScalarText(*v).fmt(f))
            }
            Attr::Data {
                values,
                list: false,
            } => match values.as_slice() {
                [v] => ScalarText(*v).fmt(f),
                // A rank-0 constant holds exactly one value; anything else
                // is printed as a list so the parser reports the count.
                _ => write_list(f, values, |v, f| ScalarText(*v).fmt(f)),
            },
            Attr::Str(text) => write!(f, "{}", serde_json::Value::from(text.as_str())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::shape::Dim;

    fn kind(attr: &Attr) -> AttrKind {
        match attr {
            Attr::Usize(_) => AttrKind::Usize,
            Attr::I64(_) => AttrKind::I64,
            Attr::Float(_) => AttrKind::Float,
            Attr::Bool(_) => AttrKind::Bool,
            Attr::Scalar(_) => AttrKind::Scalar,
            Attr::DType(_) => AttrKind::DType,
            Attr::Shape(_) => AttrKind::Shape,
            Attr::Dim(_) => AttrKind::Dim,
            Attr::Dims(_) => AttrKind::Dims,
            Attr::Data { .. } => AttrKind::Data,
            Attr::Str(_) => AttrKind::Str,
        }
    }

    /// One op of every variant, with the type a constant needs.
    fn samples() -> Vec<(Op, TensorType)> {
        let f = TensorType::new(DType::F32, vec![2, 3]);
        let sym = Shape(vec![Dim::sym("s0"), Dim::Const(2)]);
        let mut ops = vec![
            Op::Input,
            Op::Full {
                value: Scalar::Int(3),
                shape: sym.clone(),
                dtype: DType::I32,
            },
            Op::Arange {
                start: 0.5,
                end: -3.0,
                step: -0.25,
                dtype: DType::F64,
            },
            Op::Rand {
                shape: sym.clone(),
                dtype: DType::F16,
            },
            Op::Randn {
                shape: sym.clone(),
                dtype: DType::BF16,
            },
            Op::Cast(DType::Bool),
            Op::BitCast(DType::U16),
            Op::Where,
            Op::Reduce {
                op: ReduceOp::Mean,
                dims: vec![0, 2],
                keepdim: true,
            },
            Op::Softmax { dim: 1 },
            Op::LogSoftmax { dim: 0 },
            Op::MatMul,
            Op::MatMulT {
                transpose_a: true,
                transpose_b: false,
            },
            Op::Reshape(sym.clone()),
            Op::Permute(vec![1, 0]),
            Op::Expand(sym),
            Op::Slice {
                dim: 1,
                start: 0,
                end: Dim::Const(3),
                step: 2,
            },
            Op::Slice {
                dim: 0,
                start: 0,
                end: Dim::sym("s1"),
                step: 1,
            },
            Op::Cat { dim: 0 },
            Op::Contiguous,
            Op::Tril { diagonal: -1 },
            Op::Triu { diagonal: 2 },
            Op::IndexSelect { dim: 0 },
            Op::Gather { dim: 1 },
            Op::IndexAdd { dim: 0 },
            Op::ScatterAdd { dim: 1 },
        ];
        ops.extend(UnaryOp::ALL.map(Op::Unary));
        ops.extend(BinaryOp::ALL.map(Op::Binary));
        ops.extend(CompareOp::ALL.map(Op::Compare));
        ops.extend(ReduceOp::ALL.map(|op| Op::Reduce {
            op,
            dims: vec![1],
            keepdim: false,
        }));
        ops.extend(
            [ArgReduceOp::ArgMax, ArgReduceOp::ArgMin].map(|op| Op::ArgReduce {
                op,
                dim: 0,
                keepdim: true,
            }),
        );
        let mut out: Vec<_> = ops.into_iter().map(|op| (op, f.clone())).collect();
        let constant = Literal {
            dtype: DType::F32,
            shape: vec![2, 3],
            data: LiteralData::Float(vec![0.5, -0.0, f64::INFINITY, 1e-300, 2.0, 3.0]),
        };
        out.push((Op::Constant(constant), f));
        out
    }

    #[test]
    fn table_printer_and_builder_agree_on_every_op() {
        for (op, ty) in samples() {
            let attrs = attrs_of(&op);
            let kinds: Vec<_> = attrs.iter().map(kind).collect();
            let sig = signature(op.name()).unwrap_or_else(|| panic!("no signature: {op:?}"));
            let sig_kinds: Vec<_> = sig.iter().map(|(_, k)| *k).collect();
            assert_eq!(kinds, sig_kinds, "{op:?}");
            assert_eq!(build(op.name(), &attrs, &ty), Ok(op.clone()));
        }
    }

    #[test]
    fn unknown_ops_and_wrong_attributes_are_refused() {
        let ty = TensorType::new(DType::F32, vec![2]);
        assert!(signature("softmaxx").is_none());
        assert!(build("softmax", &[Attr::Bool(true)], &ty).is_err());
        assert!(build("relu", &[Attr::Usize(1)], &ty).is_err());
    }

    #[test]
    fn constants_check_their_data_against_the_type() {
        let ty = TensorType::new(DType::I64, vec![2]);
        let ints = [Scalar::Int(1), Scalar::Int(2)];
        assert!(literal(&ints, true, &ty).is_ok());
        assert!(literal(&ints[..1], true, &ty)
            .unwrap_err()
            .contains("needs 2 values, found 1"));
        assert!(literal(&ints, false, &ty)
            .unwrap_err()
            .contains("list of values"));
        let err = literal(&[Scalar::Float(1.5), Scalar::Int(2)], true, &ty).unwrap_err();
        assert!(
            err.contains("a constant of dtype i64 cannot hold `1.5`"),
            "{err}"
        );
    }

    #[test]
    fn floats_print_so_they_parse_back() {
        for x in [0.1, -0.0, 1e-7, 1e300, f64::MIN_POSITIVE / 3.0, 2.5] {
            let text = FloatText(x).to_string();
            assert_eq!(
                text.parse::<f64>().unwrap().to_bits(),
                x.to_bits(),
                "{text}"
            );
        }
        assert_eq!(FloatText(f64::NAN).to_string(), "nan");
        assert_eq!(FloatText(f64::NEG_INFINITY).to_string(), "-inf");
        assert_eq!(ScalarText(Scalar::Float(1.0)).to_string(), "1.0");
        assert_eq!(ScalarText(Scalar::Int(1)).to_string(), "1");
    }
}
