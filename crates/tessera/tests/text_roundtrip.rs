//! The IR text form: `parse(print(g)) == g` on random valid graphs, golden
//! printed text, parse errors with their line and column, and parsing of
//! malformed input without panics. Graphs are only built, printed and
//! parsed here, never run.

use std::sync::Arc;

use proptest::prelude::*;
use serde_json::{json, Map, Value};
use tessera::ir::text::{parse, parse_named};
use tessera::ir::{
    ArgReduceOp, BinaryOp, CompareOp, DType, Dim, Graph, Literal, LiteralData, NodeId, NodeMeta,
    Op, ReduceOp, Scalar, Shape, TensorType, UnaryOp,
};
use tessera::{ErrorKind, SourceLoc};

// ---------------------------------------------------------------- helpers

fn loc(file: &str, line: u32, column: u32) -> SourceLoc {
    SourceLoc {
        file: Arc::from(file),
        line,
        column,
    }
}

fn named(name: &str) -> NodeMeta {
    NodeMeta::named(name)
}

fn ty(dtype: DType, dims: &[&str]) -> TensorType {
    let dims = dims.iter().map(|d| Dim::parse(d).unwrap()).collect();
    TensorType {
        dtype,
        shape: Shape(dims),
    }
}

fn f32s(dims: &[usize]) -> TensorType {
    TensorType::new(DType::F32, dims.to_vec())
}

/// Parses `text` and checks it gives `g` back, showing the text otherwise.
fn assert_round_trip(g: &Graph) {
    g.verify()
        .unwrap_or_else(|e| panic!("test graph is invalid: {e}"));
    let text = g.to_string();
    let back = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(&back, g, "\n{text}");
}

// ----------------------------------------------------------------- golden

/// The attention-like graph of the design notes.
fn attention() -> Graph {
    let mut g = Graph::new("attention");
    let t = f32s(&[4, 16, 512, 64]);
    let q = g.add_input("q", t.clone());
    let k = g.add_input("k", t);
    let at = |line, column| NodeMeta {
        location: Some(loc("examples/attention.rs", line, column)),
        ..NodeMeta::default()
    };
    let kt_meta = NodeMeta {
        name: Some("kt".into()),
        ..at(41, 13)
    };
    let kt = g.add(Op::Permute(vec![0, 1, 3, 2]), &[k], kt_meta).unwrap();
    let s = g.add(Op::MatMul, &[q, kt], at(42, 9)).unwrap();
    let scale = Literal::scalar(Scalar::Float(0.125), DType::F32);
    let c = g
        .add(Op::Constant(scale), &[], NodeMeta::default())
        .unwrap();
    let hints = json!({"order": "strict", "group_id": 0});
    let hinted = NodeMeta {
        hints: hints.as_object().cloned().map(std::sync::Arc::new),
        ..NodeMeta::default()
    };
    let scaled = g.add(Op::Binary(BinaryOp::Mul), &[s, c], hinted).unwrap();
    let p = g
        .add(Op::Softmax { dim: 3 }, &[scaled], named("s"))
        .unwrap();
    g.add_output("out", p);
    g
}

#[test]
fn golden_attention() {
    let g = attention();
    let expected = r#"graph attention(%q, %k) {
  %q = input : f32[4,16,512,64]
  %k = input : f32[4,16,512,64]
  %kt = permute(%k) {perm=[0,1,3,2]} : f32[4,16,64,512]  # examples/attention.rs:41:13
  %3 = matmul(%q, %kt) : f32[4,16,512,512]               # examples/attention.rs:42:9
  %4 = constant {value=0.125} : f32[]
  %5 = mul(%3, %4) : f32[4,16,512,512]  hints={"group_id":0,"order":"strict"}
  %s = softmax(%5) {dim=3} : f32[4,16,512,512]
  return %s as out
}
"#;
    assert_eq!(g.to_string(), expected);
    assert_eq!(parse(expected).unwrap(), g);
}

/// Names that cannot be labels, inputs declared out of arena order,
/// quoted output, graph and file names.
#[test]
fn golden_awkward_names() {
    let mut g = Graph::new("my graph");
    let t = ty(DType::F16, &["2*s0", "3"]);
    let b = g.add_input("b", t.clone());
    let relu = g.add(Op::Unary(UnaryOp::Relu), &[b], named("b")).unwrap();
    let a = g.add_input("3", t);
    g.inputs.reverse();
    let meta = NodeMeta {
        name: Some("a b".into()),
        location: Some(loc("dir with space/x:y.rs", 7, 1)),
        ..NodeMeta::default()
    };
    let sum = g.add(Op::Binary(BinaryOp::Add), &[relu, a], meta).unwrap();
    let meta = NodeMeta {
        location: Some(loc(" lead\n", 1, 2)),
        ..NodeMeta::default()
    };
    let e = g.add(Op::Unary(UnaryOp::Exp), &[sum], meta).unwrap();
    g.add_output("out put", e);
    g.add_output("b", relu);
    let expected = r#"graph "my graph"(%2, %b) {
  %b = input : f16[2*s0,3]
  %1 "b" = relu(%b) : f16[2*s0,3]
  %2 "3" = input : f16[2*s0,3]
  %3 "a b" = add(%1, %2) : f16[2*s0,3]  # dir with space/x:y.rs:7:1
  %4 = exp(%3) : f16[2*s0,3]            # " lead\n":1:2
  return %4 as "out put", %1 as b
}
"#;
    assert_eq!(g.to_string(), expected);
    assert_round_trip(&g);
}

#[test]
fn golden_constants_and_special_floats() {
    let mut g = Graph::new("c");
    let data = vec![1.0, -0.0, f64::INFINITY, f64::NEG_INFINITY, 5e-324, 0.1];
    let lit = Literal {
        dtype: DType::F64,
        shape: vec![2, 3],
        data: LiteralData::Float(data),
    };
    let c = g.add(Op::Constant(lit), &[], named("c")).unwrap();
    let ints = Literal {
        dtype: DType::I32,
        shape: vec![0, 2],
        data: LiteralData::Int(vec![]),
    };
    g.add(Op::Constant(ints), &[], NodeMeta::default()).unwrap();
    let full = Op::Full {
        value: Scalar::Int(i64::MIN),
        shape: Shape(vec![Dim::sym("s0")]),
        dtype: DType::I64,
    };
    g.add(full, &[], NodeMeta::default()).unwrap();
    let arange = Op::Arange {
        start: -0.0,
        end: 1e-3,
        step: 2.5e-4,
        dtype: DType::F32,
    };
    g.add(arange, &[], NodeMeta::default()).unwrap();
    // A u64 seed above i64::MAX is held as the i64 of the same bits.
    let seed = Literal::scalar(Scalar::Int(Op::seed_value(u64::MAX)), DType::I64);
    let seed = g.add(Op::Constant(seed), &[], named("seed")).unwrap();
    let rand = Op::Rand {
        shape: Shape(vec![&Dim::sym("s1") * &Dim::sym("s0"), Dim::Const(2)]),
        dtype: DType::BF16,
    };
    g.add(rand, &[seed], NodeMeta::default()).unwrap();
    let b = Literal::scalar(Scalar::Bool(true), DType::Bool);
    g.add(Op::Constant(b), &[], NodeMeta::default()).unwrap();
    g.add_output("c", c);
    let expected = "graph c() {
  %c = constant {value=[1.0,-0.0,inf,-inf,5e-324,0.1]} : f64[2,3]
  %1 = constant {value=[]} : i32[0,2]
  %2 = full {value=-9223372036854775808, shape=[s0], dtype=i64} : i64[s0]
  %3 = arange {start=-0.0, end=0.001, step=0.00025, dtype=f32} : f32[4]
  %seed = constant {value=-1} : i64[]
  %5 = rand(%seed) {shape=[s0*s1,2], dtype=bf16} : bf16[s0*s1,2]
  %6 = constant {value=true} : bool[]
  return %c as c
}
";
    assert_eq!(g.to_string(), expected);
    assert_round_trip(&g);
}

#[test]
fn nan_prints_as_nan_and_parses_back() {
    let mut g = Graph::new("n");
    let lit = Literal::scalar(Scalar::Float(f64::NAN), DType::F32);
    let c = g.add(Op::Constant(lit), &[], NodeMeta::default()).unwrap();
    let full = Op::Full {
        value: Scalar::Float(f64::NAN),
        shape: Shape::scalar(),
        dtype: DType::F32,
    };
    g.add(full, &[], NodeMeta::default()).unwrap();
    g.add_output("y", c);
    let text = g.to_string();
    assert!(text.contains("constant {value=nan} : f32[]"), "{text}");
    let back = parse(&text).unwrap();
    match &back.nodes[0].op {
        Op::Constant(Literal {
            data: LiteralData::Float(v),
            ..
        }) => assert!(v[0].is_nan()),
        other => panic!("{other:?}"),
    }
    assert!(matches!(back.nodes[1].op, Op::Full { value: Scalar::Float(x), .. } if x.is_nan()));
    // NaN != NaN, so compare the texts instead of the graphs.
    assert_eq!(back.to_string(), text);
}

/// One node of every op kind, so that each is printed and parsed at least
/// once whatever the random tests draw.
#[test]
fn every_op_kind_round_trips() {
    let mut g = Graph::new("all");
    let x = g.add_input("x", ty(DType::F32, &["2", "3", "4"]));
    let s = g.add_input("s", ty(DType::F32, &["s0", "4"]));
    let add = |g: &mut Graph, op: Op, inputs: &[NodeId]| {
        let name = op.name();
        g.add(op, inputs, NodeMeta::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let mut seen: Vec<&str> = vec!["input"];
    let mut used = |op: &Op| seen.push(op.name());
    let nullary = [
        Op::Constant(Literal::scalar(Scalar::Int(-7), DType::I64)),
        Op::Full {
            value: Scalar::Bool(false),
            shape: Shape(vec![Dim::sym("s0")]),
            dtype: DType::Bool,
        },
        Op::Arange {
            start: 0.0,
            end: 5.0,
            step: 1.0,
            dtype: DType::I32,
        },
    ];
    for op in nullary {
        used(&op);
        add(&mut g, op, &[]);
    }
    // The random ops read their seed, an i64 scalar: a graph input here.
    let seed = g.add_input("seed", ty(DType::I64, &[]));
    let random = [
        Op::Rand {
            shape: Shape::from_concrete(&[2]),
            dtype: DType::F16,
        },
        Op::Randn {
            shape: Shape(vec![Dim::sym("s0"), Dim::Const(2)]),
            dtype: DType::F64,
        },
    ];
    for op in random {
        used(&op);
        add(&mut g, op, &[seed]);
    }
    let mut unary_like: Vec<Op> = UnaryOp::ALL
        .into_iter()
        .filter(|u| u.accepts_float())
        .map(Op::Unary)
        .collect();
    unary_like.extend(ReduceOp::ALL.map(|op| Op::Reduce {
        op,
        dims: vec![0, 2],
        keepdim: true,
    }));
    unary_like.extend(
        [ArgReduceOp::ArgMax, ArgReduceOp::ArgMin].map(|op| Op::ArgReduce {
            op,
            dim: 1,
            keepdim: false,
        }),
    );
    unary_like.extend([
        Op::Cast(DType::BF16),
        Op::Softmax { dim: 2 },
        Op::LogSoftmax { dim: 0 },
        Op::Reshape(Shape::from_concrete(&[6, 4])),
        Op::Permute(vec![2, 0, 1]),
        Op::Expand(Shape::from_concrete(&[5, 2, 3, 4])),
        Op::Slice {
            dim: 2,
            start: 1,
            end: Dim::Const(4),
            step: 2,
        },
        Op::Cat { dim: 1 },
        Op::Contiguous,
        Op::Tril { diagonal: -1 },
        Op::Triu { diagonal: i64::MAX },
    ]);
    for op in unary_like {
        used(&op);
        add(&mut g, op, &[x]);
    }
    for op in BinaryOp::ALL.into_iter().filter(|b| !b.is_bitwise()) {
        let op = Op::Binary(op);
        used(&op);
        add(&mut g, op, &[x, x]);
    }
    // The integer-only ops, on the bits of x as u32.
    let bits = Op::BitCast(DType::U32);
    used(&bits);
    let xi = add(&mut g, bits, &[x]);
    used(&Op::Unary(UnaryOp::BitNot));
    add(&mut g, Op::Unary(UnaryOp::BitNot), &[xi]);
    for op in BinaryOp::ALL.into_iter().filter(|b| b.is_bitwise()) {
        let op = Op::Binary(op);
        used(&op);
        add(&mut g, op, &[xi, xi]);
    }
    let mut last_bool = x;
    for op in CompareOp::ALL.map(Op::Compare) {
        used(&op);
        last_bool = add(&mut g, op, &[s, s]);
    }
    used(&Op::Where);
    add(&mut g, Op::Where, &[last_bool, s, s]);
    let t = add(&mut g, Op::Permute(vec![1, 0]), &[s]);
    used(&Op::MatMul);
    let mm = add(&mut g, Op::MatMul, &[s, t]);
    let mm_t = Op::MatMulT {
        transpose_a: false,
        transpose_b: true,
    };
    used(&mm_t);
    add(&mut g, mm_t, &[s, s]);
    used(&Op::Cat { dim: 0 });
    add(&mut g, Op::Cat { dim: 0 }, &[s, s, s]);
    let index = Literal {
        dtype: DType::I64,
        shape: vec![3],
        data: LiteralData::Int(vec![0, 1, 1]),
    };
    let index = add(&mut g, Op::Constant(index), &[]);
    used(&Op::IndexSelect { dim: 0 });
    add(&mut g, Op::IndexSelect { dim: 1 }, &[x, index]);
    let int_x = add(&mut g, Op::Cast(DType::I32), &[x]);
    used(&Op::Gather { dim: 0 });
    add(&mut g, Op::Gather { dim: 2 }, &[x, int_x]);
    g.add_output("mm", mm);
    assert_round_trip(&g);
    let text = g.to_string();
    for name in seen {
        assert!(
            text.contains(&format!(" = {name}")),
            "{name} missing:\n{text}"
        );
    }
}

// ---------------------------------------------------------- example file

const MLP: &str = include_str!("../../../examples/mlp.tir");

#[test]
fn example_mlp_parses() {
    let g = parse_named(MLP, "examples/mlp.tir").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(g.name, "mlp");
    let inputs: Vec<String> = g.inputs.iter().map(|&i| g.display_name(i)).collect();
    assert_eq!(inputs, ["x", "w1", "b1", "w2", "b2"]);
    let outputs: Vec<(&str, String)> = g
        .outputs
        .iter()
        .map(|o| (o.name.as_str(), g.node(o.node).ty.to_string()))
        .collect();
    assert_eq!(
        outputs,
        [
            ("probs", "f32[4,3]".to_string()),
            ("mean", "f32[]".to_string())
        ]
    );
    let gelu = g.nodes.iter().find(|n| n.op == Op::Unary(UnaryOp::Gelu));
    let gelu = gelu.expect("the MLP has a gelu");
    assert_eq!(gelu.meta.location, Some(loc("examples/mlp.rs", 22, 13)));
    assert_round_trip(&g);
}

/// The example in docs/IR.md is valid text.
#[test]
fn doc_example_parses() {
    let doc = include_str!("../../../docs/IR.md");
    let example = doc
        .split("```text\n")
        .nth(1)
        .and_then(|block| block.split("```").next())
        .expect("docs/IR.md has a text block");
    let g = parse(example).unwrap_or_else(|e| panic!("{e}\n{example}"));
    assert_eq!(g.outputs.len(), 2);
    assert_eq!(g.nodes[12].meta.name.as_deref(), Some("scaled logits"));
    assert_round_trip(&g);
}

// ----------------------------------------------------------------- errors

/// Parses `body` inside a graph with inputs `x: f32[2]` and `i: i64[2]`
/// (lines 1–3), and checks the error's kind, line:column and message.
#[track_caller]
fn assert_error(body: &str, at: &str, message: &str) {
    let src = format!(
        "graph g(%x, %i) {{\n  %x = input : f32[2]\n  %i = input : i64[2]\n{body}\n  return\n}}\n"
    );
    assert_error_in(&src, at, message);
}

#[track_caller]
fn assert_error_in(src: &str, at: &str, message: &str) {
    let err = match parse(src) {
        Ok(g) => panic!("parsed:\n{src}\nas\n{g}"),
        Err(e) => e,
    };
    assert_eq!(err.kind, ErrorKind::Parse, "{err}");
    let location = err.location.as_ref().expect("a parse error has a location");
    assert_eq!(&*location.file, "<input>");
    let text = err.to_string();
    assert!(
        text.contains(&format!("(at <input>:{at})")),
        "want {at}: {text}"
    );
    assert!(text.contains(message), "want `{message}`: {text}");
}

#[test]
fn errors_in_node_lines() {
    let cases = [
        (
            "  %y = frobnicate(%x) : f32[2]",
            "4:8",
            "unknown op `frobnicate`",
        ),
        (
            "  %y = softmax(%x) {dimm=0} : f32[2]",
            "4:21",
            "unknown attribute `dimm` of `softmax` (it takes dim)",
        ),
        (
            "  %y = relu(%x) {dim=0} : f32[2]",
            "4:18",
            "`relu` takes none",
        ),
        // The seed was an attribute before it became the operand.
        (
            "  %y = rand {seed=7, shape=[2], dtype=f32} : f32[2]",
            "4:14",
            "`rand` no longer takes `seed`: the seed is the op's operand now",
        ),
        (
            "  %y = softmax(%x) : f32[2]",
            "4:20",
            "missing attribute `dim` of `softmax`",
        ),
        (
            "  %y = add(%x, %z) : f32[2]",
            "4:16",
            "undefined value `%z`",
        ),
        (
            "  %y = add(%x, %y) : f32[2]",
            "4:16",
            "undefined value `%y`",
        ),
        (
            "  %x = relu(%x) : f32[2]",
            "4:3",
            "duplicate name `%x` (first defined at line 2)",
        ),
        (
            "  %y = softmax(%x) {dim=1.5} : f32[2]",
            "4:25",
            "expected a non-negative integer, found `1.5`",
        ),
        (
            "  %y = softmax(%x) {dim=0, dim=0} : f32[2]",
            "4:28",
            "attribute `dim` is given twice",
        ),
        (
            "  %y = sum(%x) {dims=[0], keepdim=1} : f32[]",
            "4:35",
            "expected `true` or `false`, found `1`",
        ),
        ("  %y = relu(%x) : f31[2]", "4:19", "unknown dtype `f31`"),
        ("  %y = relu(%x) : f32[-2]", "4:23", "expected a dim"),
        ("  %y = relu(%x) : f32[2*s.0]", "4:25", "bad dim: `s.0`"),
        (
            "  %y = relu(%x) : f32[140737488355328]",
            "4:23",
            "too large",
        ),
        (
            "  %y = permute(%x) {perm=[0 : f32[2]",
            "4:29",
            "expected `,` or `]` (unterminated list), found `:`",
        ),
        (
            "  %y = relu(%x, : f32[2]",
            "4:17",
            "expected `%` starting a value name",
        ),
        (
            "  %y = relu(%x) : f32[2] extra",
            "4:26",
            "expected end of line, found `extra`",
        ),
        (
            "  %y = relu(%x) f32[2]",
            "4:17",
            "expected `:` before the node's type, found `f32`",
        ),
        (
            "  %y \"unterminated = relu(%x) : f32[2]",
            "4:6",
            "unterminated string",
        ),
        (
            "  %y = relu(%x) : f32[2]  hints={\"a\":}",
            "4:38",
            "bad hints JSON: expected value",
        ),
        (
            "  %y = relu(%x) : f32[2]  hints=[1]",
            "4:33",
            "expected a JSON object",
        ),
        (
            "  %y = relu(%x) : f32[2]  # nowhere",
            "4:29",
            "expected a call site",
        ),
        (
            "  %y = relu(%x) : f32[2]  # a.rs:x:1",
            "4:34",
            "expected a line number",
        ),
        (
            "  %c = constant {value=[1.0,2.0]} : f32[3]",
            "4:8",
            "a constant of type f32[3] needs 3 values, found 2",
        ),
        (
            "  %c = constant {value=1} : f32[1]",
            "4:8",
            "is written as a list of values",
        ),
        (
            "  %c = constant {value=[1,2]} : i64[s0]",
            "4:8",
            "a constant needs a concrete shape",
        ),
        (
            "  %c = constant {value=[1.5,2]} : i32[2]",
            "4:8",
            "a constant of dtype i32 cannot hold `1.5`",
        ),
        (
            "  %y = relu(%x)",
            "4:16",
            "expected `:` before the node's type, found end of line",
        ),
        (
            "  y = relu(%x) : f32[2]",
            "4:3",
            "expected a node (`%name = op …`) or `return`",
        ),
    ];
    for (body, at, message) in cases {
        assert_error(body, at, message);
    }
}

#[test]
fn verification_errors_point_at_the_node() {
    assert_error(
        "  %y = add(%x, %x) : f32[3]",
        "4:8",
        "declared type f32[3] but its inputs give f32[2]",
    );
    assert_error(
        "  %y = add(%x, %i) : f32[2]",
        "4:8",
        "add: dtypes differ (f32[2], i64[2])",
    );
    assert_error(
        "  %y = relu(%x, %x) : f32[2]",
        "4:8",
        "takes 1 inputs, got 2",
    );
    assert_error(
        "  %y = softmax(%x) {dim=1} : f32[2]",
        "4:8",
        "dim 1 is out of range",
    );
    assert_error(
        "  %y = randn(%i) {shape=[2], dtype=f32} : f32[2]",
        "4:8",
        "randn: the seed must be an i64[] scalar, got i64[2]",
    );
    // The node's own call site is kept out of the message's location.
    assert_error(
        "  %y = neg(%x) : f32[3]  # src/model.rs:10:4",
        "4:8",
        "declared type f32[3]",
    );
}

#[test]
fn errors_in_the_frame() {
    let node = "  %x = input : f32[2]\n";
    assert_error_in("", "1:1", "expected `graph`, found end of input");
    assert_error_in("grph g() {", "1:1", "expected `graph`, found `grph`");
    assert_error_in(
        "graph g() {\n  return\n",
        "3:1",
        "expected `}` closing the graph",
    );
    assert_error_in(
        &format!("graph g(%x) {{\n{node}"),
        "3:1",
        "expected a node or `return`, found end of input",
    );
    assert_error_in(
        &format!("graph g(%x) {{\n{node}  return\n}}\njunk\n"),
        "5:1",
        "expected end of input after the graph, found `junk`",
    );
    assert_error_in(
        &format!("graph g() {{\n{node}  return\n}}\n"),
        "2:8",
        "this input is missing from the graph's input list",
    );
    assert_error_in(
        &format!("graph g(%x, %x) {{\n{node}  return\n}}\n"),
        "1:13",
        "graph input `%x` is listed twice",
    );
    assert_error_in(
        &format!("graph g(%x, %y) {{\n{node}  %y = neg(%x) : f32[2]\n  return\n}}\n"),
        "1:13",
        "`%y` is listed as a graph input but is a `neg` node",
    );
    assert_error_in(
        &format!("graph g(%x, %q) {{\n{node}  return\n}}\n"),
        "1:13",
        "undefined value `%q`",
    );
    assert_error_in(
        &format!("graph g(%x) {{\n{node}  return %x as a, %x as a\n}}\n"),
        "3:25",
        "output name `a` is used twice (first at column 16)",
    );
    assert_error_in(
        &format!("graph g(%x) {{\n{node}  return %x a\n}}\n"),
        "3:13",
        "expected `as` and the output's name, found `a`",
    );
    assert_error_in(
        "graph g(%0) {\n  %0 = input : f32[2]\n  return\n}\n",
        "2:8",
        "inputs must be named",
    );
}

#[test]
fn errors_carry_the_given_file_name() {
    let err = parse_named("graph g() {\n  bad\n", "model.tir").unwrap_err();
    assert_eq!(err.location, Some(loc("model.tir", 2, 3)));
}

#[test]
fn comments_blank_lines_and_crlf_are_accepted() {
    let src = "// leading comment\r\n\r\ngraph g(%x) {\r\n  // a comment\r\n  %x = input : f32[2]\r\n\t%y=neg( %x ):f32[2]#a.rs:1:2\r\n  return %y as y\r\n}\r\n// trailing\r\n";
    let g = parse(src).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(g.nodes[1].meta.location, Some(loc("a.rs", 1, 2)));
    assert_eq!(g.outputs[0].name, "y");
}

// ------------------------------------------------------- random graphs

const NAMES: &[&str] = &[
    "x",
    "y",
    "q",
    "h.0",
    "layer1.weight",
    "_t",
    "3",
    "",
    "a b",
    "é",
    "quo\"te",
    "new\nline",
    "%x",
    "return",
    "graph",
    "as",
    "hints",
    "#",
    "tab\t",
    "x",
    "back\\slash",
    "-",
];
const FILES: &[&str] = &[
    "examples/attention.rs",
    "src/a-b/c.d.rs",
    "C:\\x\\y.rs",
    "with space.rs",
    " lead.rs",
    "trail.rs ",
    "",
    "\"q.rs",
    "a:1:2",
    "#h.rs",
    "tab\t.rs",
    "x // y.rs",
    "ü/ß.rs",
];
const KEYS: &[&str] = &[
    "order",
    "group_id",
    "memory_budget_mb",
    "",
    "k\"ey",
    "\u{1}",
];

fn text_strategy(pool: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(pool).prop_map(str::to_string),
        1 => ".{0,6}",
    ]
}

/// Floats with an exact short decimal form, as JSON hints hold.
fn json_number() -> impl Strategy<Value = f64> {
    (any::<i16>(), 0u32..10).prop_map(|(m, e)| f64::from(m) / 2f64.powi(e as i32))
}

fn json_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        json_number().prop_map(Value::from),
        ".{0,5}".prop_map(Value::from),
    ]
}

fn hints_strategy() -> impl Strategy<Value = Map<String, Value>> {
    let value = prop_oneof![
        3 => json_leaf(),
        1 => prop::collection::vec(json_leaf(), 0..3).prop_map(Value::from),
    ];
    prop::collection::vec((text_strategy(KEYS), value), 0..4)
        .prop_map(|pairs| pairs.into_iter().collect())
}

fn meta_strategy() -> impl Strategy<Value = NodeMeta> {
    let location = (text_strategy(FILES), any::<u32>(), any::<u32>())
        .prop_map(|(file, line, column)| loc(&file, line, column));
    (
        prop::option::of(text_strategy(NAMES)),
        prop::option::of(location),
        prop::option::weighted(0.3, hints_strategy()),
    )
        .prop_map(|(name, location, hints)| NodeMeta {
            name,
            location,
            hints: hints.map(std::sync::Arc::new),
        })
}

/// Any float but NaN (NaN != NaN would fail the equality; a test of its own
/// covers it), with the awkward ones often.
fn float_strategy() -> impl Strategy<Value = f64> {
    prop_oneof![
        3 => any::<f64>().prop_map(|x| if x.is_nan() { 0.5 } else { x }),
        1 => prop::sample::select(vec![
            -0.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
            5e-324,
            f64::MAX,
            0.1,
            1e21,
        ]),
    ]
}

/// One random step: which op, operand and parameter picks, and the meta.
#[derive(Clone, Debug)]
struct Step {
    kind: u8,
    picks: [usize; 3],
    int: i64,
    float: f64,
    meta: NodeMeta,
}

fn step_strategy() -> impl Strategy<Value = Step> {
    (
        0u8..24,
        any::<[usize; 3]>(),
        any::<i64>(),
        float_strategy(),
        meta_strategy(),
    )
        .prop_map(|(kind, picks, int, float, meta)| Step {
            kind,
            picks,
            int,
            float,
            meta,
        })
}

const DTYPES: [DType; 9] = [
    DType::F32,
    DType::F32,
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::I32,
    DType::Bool,
];

/// A shape from dim codes: small constants, `s0`, `s1`, `2*s0`.
fn shape_of(codes: &[u8]) -> Shape {
    let dim = |c: &u8| match c % 7 {
        4 => Dim::sym("s0"),
        5 => Dim::sym("s1"),
        6 => &Dim::Const(2) * &Dim::sym("s0"),
        n => Dim::Const(usize::from(n) + 1),
    };
    Shape(codes.iter().map(dim).collect())
}

/// Builds a valid graph from random steps; a step whose op does not fit the
/// picked operands is skipped (type inference refuses it).
struct Builder {
    g: Graph,
}

impl Builder {
    fn pick(&self, r: usize) -> NodeId {
        NodeId((r % self.g.len()) as u32)
    }

    fn ty(&self, id: NodeId) -> &TensorType {
        &self.g.node(id).ty
    }

    fn add(&mut self, op: Op, inputs: &[NodeId], meta: &NodeMeta) -> Option<NodeId> {
        self.g.add(op, inputs, meta.clone()).ok()
    }

    /// Inputs are always named, uniquely among inputs.
    fn input(&mut self, dtype: DType, shape: Shape, meta: &NodeMeta) {
        let mut name = meta.name.clone().unwrap_or_else(|| "in".to_string());
        let taken = |g: &Graph, n: &str| g.inputs.iter().any(|&i| g.display_name(i) == n);
        while taken(&self.g, &name) {
            name.push('_');
        }
        let id = self.g.add_input(name, TensorType { dtype, shape });
        let node = &mut self.g.nodes[id.index()];
        node.meta.location = meta.location.clone();
        node.meta.hints = meta.hints.clone();
    }

    fn step(&mut self, s: &Step) {
        let [a, b, c] = s.picks;
        let x = self.pick(b);
        let y = self.pick(c);
        let rank = self.ty(x).rank();
        let m = &s.meta;
        match s.kind {
            0 => self.input(DTYPES[a % 9], shape_of(&[b as u8, c as u8][..a % 3]), m),
            1 => self.constant(s),
            2 => {
                let value = match a % 3 {
                    0 => Scalar::Float(s.float),
                    1 => Scalar::Int(s.int),
                    _ => Scalar::Bool(s.int % 2 == 0),
                };
                let shape = shape_of(&[b as u8, c as u8][..a % 3]);
                let op = Op::Full {
                    value,
                    shape,
                    dtype: DTYPES[c % 9],
                };
                self.add(op, &[], m);
            }
            3 => {
                let step = [1.0, -0.5, 0.25, 3.0, s.float][a % 5];
                let start = if s.float.is_finite() { s.float } else { 1.0 };
                let end = start + step * (b % 10) as f64;
                let op = Op::Arange {
                    start,
                    end,
                    step,
                    dtype: DTYPES[c % 8],
                };
                self.add(op, &[], m);
            }
            4 | 5 => {
                let (shape, dtype) = (shape_of(&[b as u8][..a % 2]), DTYPES[c % 6]);
                // The seed: the picked value when it is an i64 scalar (an
                // input, another seed), else a new constant.
                let seed_ty = TensorType::new(DType::I64, Shape::scalar());
                let seed = match *self.ty(x) == seed_ty {
                    true => Some(x),
                    false => {
                        let lit = Literal::scalar(Scalar::Int(s.int), DType::I64);
                        self.add(Op::Constant(lit), &[], m)
                    }
                };
                let op = match s.kind {
                    4 => Op::Rand { shape, dtype },
                    _ => Op::Randn { shape, dtype },
                };
                if let Some(seed) = seed {
                    self.add(op, &[seed], m);
                }
            }
            6 => {
                self.add(Op::Unary(UnaryOp::ALL[a % UnaryOp::ALL.len()]), &[x], m);
            }
            7 => {
                self.add(Op::Cast(DTYPES[a % 9]), &[x], m);
            }
            8 => {
                let op = BinaryOp::ALL[a % BinaryOp::ALL.len()];
                self.add(Op::Binary(op), &[x, y], m)
                    .or_else(|| self.add(Op::Binary(op), &[x, x], m));
            }
            9 => {
                self.add(Op::Compare(CompareOp::ALL[a % 6]), &[x, y], m)
                    .or_else(|| self.add(Op::Compare(CompareOp::ALL[a % 6]), &[x, x], m));
            }
            10 => {
                if let Some(cond) = self.add(Op::Compare(CompareOp::Lt), &[x, x], m) {
                    self.add(Op::Where, &[cond, x, y], m)
                        .or_else(|| self.add(Op::Where, &[cond, x, x], m));
                }
            }
            11 => {
                let dims = (0..rank).filter(|d| c >> d & 1 == 1).collect();
                let op = Op::Reduce {
                    op: ReduceOp::ALL[a % 5],
                    dims,
                    keepdim: s.int % 2 == 0,
                };
                self.add(op, &[x], m);
            }
            12 if rank > 0 => {
                let op = Op::ArgReduce {
                    op: [ArgReduceOp::ArgMax, ArgReduceOp::ArgMin][a % 2],
                    dim: c % rank,
                    keepdim: s.int % 2 == 0,
                };
                self.add(op, &[x], m);
            }
            13 if rank > 0 => {
                let dim = c % rank;
                let op = [Op::Softmax { dim }, Op::LogSoftmax { dim }][a % 2].clone();
                self.add(op, &[x], m);
            }
            14 => self.matmul(x, y, m),
            15 => {
                let numel = self.ty(x).shape.numel();
                let shape = match a % 2 {
                    0 => Shape(vec![numel]),
                    _ => Shape(vec![Dim::Const(1), numel, Dim::Const(1)]),
                };
                self.add(Op::Reshape(shape), &[x], m);
            }
            16 => {
                let mut perm: Vec<usize> = (0..rank).collect();
                if rank > 0 {
                    perm.rotate_left(c % rank);
                }
                if a % 2 == 1 {
                    perm.reverse();
                }
                self.add(Op::Permute(perm), &[x], m);
            }
            17 => {
                let mut dims = vec![Dim::Const(2)];
                let stretch = |d: &Dim| {
                    if *d == Dim::Const(1) {
                        Dim::Const(3)
                    } else {
                        d.clone()
                    }
                };
                dims.extend(self.ty(x).shape.0.iter().map(stretch));
                self.add(Op::Expand(Shape(dims)), &[x], m);
            }
            18 if rank > 0 => {
                let dim = c % rank;
                if let Some(size) = self.ty(x).shape.0[dim].as_const() {
                    let start = a % (size + 1);
                    let end = start + b % (size - start + 1);
                    let step = 1 + (s.int.unsigned_abs() % 3) as usize;
                    self.add(
                        Op::Slice {
                            dim,
                            start,
                            end: Dim::Const(end),
                            step,
                        },
                        &[x],
                        m,
                    );
                }
            }
            19 if rank > 0 => {
                let inputs = vec![x; 1 + a % 3];
                self.add(Op::Cat { dim: c % rank }, &inputs, m);
            }
            20 => {
                self.add(Op::Contiguous, &[x], m);
            }
            21 => {
                let op = match a % 2 {
                    0 => Op::Tril { diagonal: s.int },
                    _ => Op::Triu { diagonal: s.int },
                };
                self.add(op, &[x], m);
            }
            22 if rank > 0 => {
                let index = Literal {
                    dtype: DType::I64,
                    shape: vec![2],
                    data: LiteralData::Int(vec![0, s.int]),
                };
                if let Some(index) = self.add(Op::Constant(index), &[], &NodeMeta::default()) {
                    self.add(Op::IndexSelect { dim: c % rank }, &[x, index], m);
                }
            }
            23 if rank > 0 => {
                if let Some(index) = self.add(Op::Cast(DType::I64), &[x], &NodeMeta::default()) {
                    self.add(Op::Gather { dim: c % rank }, &[x, index], m);
                }
            }
            _ => {}
        }
    }

    fn constant(&mut self, s: &Step) {
        let [a, b, _] = s.picks;
        let shape: Vec<usize> = [b % 3, (b / 3) % 3][..a % 3].to_vec();
        let n: usize = shape.iter().product();
        let dtype = DTYPES[a % 9];
        let data = if dtype.is_float() {
            LiteralData::Float((0..n).map(|i| s.float / (i as f64 + 1.0)).collect())
        } else if dtype.is_int() {
            LiteralData::Int((0..n).map(|i| s.int.wrapping_mul(i as i64 + 1)).collect())
        } else {
            LiteralData::Bool((0..n).map(|i| (s.int >> (i % 64)) & 1 == 1).collect())
        };
        let lit = Literal { dtype, shape, data };
        self.add(Op::Constant(lit), &[], &s.meta);
    }

    /// `x @ y`, or else `x @ xᵀ`, which fits any x of rank 2 or more.
    fn matmul(&mut self, x: NodeId, y: NodeId, m: &NodeMeta) {
        if self.add(Op::MatMul, &[x, y], m).is_some() {
            return;
        }
        let rank = self.ty(x).rank();
        if rank >= 2 {
            let mut perm: Vec<usize> = (0..rank).collect();
            perm.swap(rank - 2, rank - 1);
            if let Some(t) = self.add(Op::Permute(perm), &[x], &NodeMeta::default()) {
                self.add(Op::MatMul, &[x, t], m);
            }
        }
    }
}

#[derive(Clone, Debug)]
struct GraphSpec {
    name: String,
    inputs: Vec<(usize, Vec<u8>, NodeMeta)>,
    steps: Vec<Step>,
    outputs: Vec<(usize, String)>,
    input_order: usize,
}

fn graph_strategy() -> impl Strategy<Value = GraphSpec> {
    let input = (
        any::<usize>(),
        prop::collection::vec(any::<u8>(), 0..4),
        meta_strategy(),
    );
    (
        text_strategy(NAMES),
        prop::collection::vec(input, 1..4),
        prop::collection::vec(step_strategy(), 0..24),
        prop::collection::vec((any::<usize>(), text_strategy(NAMES)), 0..4),
        any::<usize>(),
    )
        .prop_map(|(name, inputs, steps, outputs, input_order)| GraphSpec {
            name,
            inputs,
            steps,
            outputs,
            input_order,
        })
}

fn build(spec: &GraphSpec) -> Graph {
    let mut b = Builder {
        g: Graph::new(spec.name.clone()),
    };
    for (dtype, dims, meta) in &spec.inputs {
        b.input(DTYPES[dtype % 9], shape_of(dims), meta);
    }
    for step in &spec.steps {
        b.step(step);
    }
    for (pick, name) in &spec.outputs {
        let mut name = name.clone();
        while b.g.outputs.iter().any(|o| o.name == name) {
            name.push('\'');
        }
        let node = b.pick(*pick);
        b.g.add_output(name, node);
    }
    let n = b.g.inputs.len();
    b.g.inputs.rotate_left(spec.input_order % n);
    if spec.input_order % 2 == 1 {
        b.g.inputs.reverse();
    }
    b.g
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn print_then_parse_gives_the_graph_back(spec in graph_strategy()) {
        let g = build(&spec);
        prop_assert!(g.verify().is_ok(), "generated graph is invalid: {:?}", g.verify());
        let text = g.to_string();
        let back = parse(&text);
        prop_assert!(back.is_ok(), "{}\n{}", back.unwrap_err(), text);
        prop_assert_eq!(back.unwrap(), g, "\n{}", text);
    }
}

// ------------------------------------------------------ malformed input

/// Pieces of the syntax, so that random sequences get past the first token.
const TOKENS: &[&str] = &[
    "graph",
    " g",
    "(",
    ")",
    "{",
    "}",
    "%x",
    "%0",
    "%y",
    " = ",
    "add",
    "input",
    "constant",
    "cat",
    "reshape",
    "softmax",
    " : ",
    "f32",
    "i64",
    "[",
    "]",
    ",",
    "2",
    "s0",
    "*",
    "+",
    "-",
    "1.5",
    "nan",
    "#",
    " a.rs:1:2",
    "hints=",
    "{\"k\":[1,",
    "\"",
    "\\",
    "\n",
    "return",
    " as ",
    "dim=",
    "value=",
    "shape=",
    "99999999999999999999",
    "4294967296",
    "é",
    "\t",
    "//",
];

fn mutate(text: &str, edits: &[(u8, usize, usize)]) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    for &(kind, at, arg) in edits {
        let at = at % (chars.len() + 1);
        match kind % 4 {
            0 => {
                let end = (at + arg % 8).min(chars.len());
                chars.drain(at..end);
            }
            1 => {
                let token = TOKENS[arg % TOKENS.len()];
                chars.splice(at..at, token.chars());
            }
            2 if at < chars.len() => chars[at] = char::from(b' ' + (arg % 95) as u8),
            _ => {
                // Duplicate a stretch: repeated names, lists and lines.
                let end = (at + arg % 40).min(chars.len());
                let copy: Vec<char> = chars[at..end].to_vec();
                chars.splice(at..at, copy);
            }
        }
    }
    chars.into_iter().collect()
}

fn rich_text() -> String {
    let mut g = attention();
    g.name = "rich \"graph\"".into();
    g.nodes[2].meta.location = Some(loc("a:b c.rs", 1, 2));
    format!("{g}{MLP}")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_text_never_panics(text in "\\PC{0,80}") {
        let _ = parse(&text);
    }

    #[test]
    fn random_token_soup_never_panics(tokens in prop::collection::vec(prop::sample::select(TOKENS), 0..60)) {
        let _ = parse(&tokens.concat());
    }

    #[test]
    fn mutated_files_never_panic(
        edits in prop::collection::vec((any::<u8>(), any::<usize>(), any::<usize>()), 1..6),
        which in any::<bool>(),
    ) {
        let base = if which { MLP.to_string() } else { attention().to_string() };
        let _ = parse(&mutate(&base, &edits));
        let _ = parse(&mutate(&rich_text(), &edits));
    }
}

/// Inputs that would overflow the shape algebra are errors, not panics.
#[test]
fn huge_shapes_are_errors() {
    let cases = [
        "graph g(%x) {\n  %x = input : f32[8388608,8388608,8388608]\n  return\n}",
        "graph g(%x) {\n  %x = input : f32[4611686018427387904*s0]\n  return\n}",
        "graph g(%x) {\n  %x = input : f32[s0]\n  %y = reshape(%x) {shape=[70368744177664,2]} : f32[s0]\n  return\n}",
    ];
    for src in cases {
        let err = parse(src).unwrap_err();
        assert!(err.to_string().contains("too large"), "{err}");
    }
    // A cat of the largest allowed dims sums without overflow.
    let src = format!(
        "graph g(%x) {{\n  %x = input : f32[35184372088832*s0]\n  %y = cat({}) {{dim=0}} : f32[2*s0]\n  return\n}}",
        vec!["%x"; 64].join(", ")
    );
    let err = parse(&src).unwrap_err();
    assert!(err.to_string().contains("declared type f32[2*s0]"), "{err}");
}
