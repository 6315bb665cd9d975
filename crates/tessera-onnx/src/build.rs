//! Writing small ONNX models from Rust: what tests and examples use to make
//! a model without Python (the messages of [`crate::proto`], encoded).

use crate::proto::{
    attribute_type as at, tensor_shape_proto::dimension::Value as DimValue,
    tensor_shape_proto::Dimension, type_proto, AttributeProto, GraphProto, ModelProto, NodeProto,
    OperatorSetIdProto, TensorProto, TensorShapeProto, TypeProto, ValueInfoProto,
};

/// A dim of a declared shape: a size or a named dynamic dim.
#[derive(Clone, Debug)]
pub enum D {
    Size(i64),
    Param(&'static str),
}

/// A node `op(inputs) -> outputs` with attributes.
pub fn node(op: &str, inputs: &[&str], outputs: &[&str], attrs: Vec<AttributeProto>) -> NodeProto {
    NodeProto {
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        name: format!("{op}_{}", outputs.first().copied().unwrap_or("")),
        op_type: op.to_string(),
        domain: String::new(),
        attribute: attrs,
    }
}

pub fn attr_int(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: at::INT,
        i: v,
        ..AttributeProto::default()
    }
}

pub fn attr_ints(name: &str, v: &[i64]) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: at::INTS,
        ints: v.to_vec(),
        ..AttributeProto::default()
    }
}

pub fn attr_string(name: &str, v: &str) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: at::STRING,
        s: v.as_bytes().to_vec(),
        ..AttributeProto::default()
    }
}

pub fn attr_float(name: &str, v: f32) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        r#type: at::FLOAT,
        f: v,
        ..AttributeProto::default()
    }
}

/// A declared tensor value of element type `elem` (a `data_type`).
pub fn value(name: &str, elem: i32, dims: &[D]) -> ValueInfoProto {
    ValueInfoProto {
        name: name.into(),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: elem,
                shape: Some(TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|d| Dimension {
                            value: Some(match d {
                                D::Size(v) => DimValue::DimValue(*v),
                                D::Param(p) => DimValue::DimParam(p.to_string()),
                            }),
                        })
                        .collect(),
                }),
            })),
        }),
    }
}

/// A float32 tensor (an initializer) in raw little-endian bytes.
pub fn f32_tensor(name: &str, dims: &[i64], data: &[f32]) -> TensorProto {
    TensorProto {
        name: name.into(),
        dims: dims.to_vec(),
        data_type: crate::proto::data_type::FLOAT,
        raw_data: data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ..TensorProto::default()
    }
}

/// An int64 tensor in the typed field.
pub fn i64_tensor(name: &str, dims: &[i64], data: &[i64]) -> TensorProto {
    TensorProto {
        name: name.into(),
        dims: dims.to_vec(),
        data_type: crate::proto::data_type::INT64,
        int64_data: data.to_vec(),
        ..TensorProto::default()
    }
}

/// A model of one graph importing `opset` of the default domain, encoded.
pub fn model(
    opset: i64,
    nodes: Vec<NodeProto>,
    inputs: Vec<ValueInfoProto>,
    outputs: Vec<ValueInfoProto>,
    initializers: Vec<TensorProto>,
) -> Vec<u8> {
    let m = ModelProto {
        ir_version: 8,
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: opset,
        }],
        producer_name: "tessera-onnx".into(),
        graph: Some(GraphProto {
            node: nodes,
            name: "g".into(),
            initializer: initializers,
            input: inputs,
            output: outputs,
            ..GraphProto::default()
        }),
        ..ModelProto::default()
    };
    prost::Message::encode_to_vec(&m)
}
