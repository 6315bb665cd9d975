//! The IR text parser: valid graphs (the seed files beside this one,
//! `examples/*.tir`, the example of `docs/IR.md`, random graphs of
//! `graph_gen`) mutated at the level of characters, tokens, numbers, names,
//! shapes, hints and lines.
//!
//! Properties, for any text:
//! - `parse_named` returns; an error is a `Parse` error with a message,
//!   located in the file at an existing line;
//! - a graph it accepts verifies, prints, and parses back to itself;
//! - a graph it accepts whose values all fit in 2^16 elements (symbols bound
//!   to 0..3 by the inputs) runs in the interpreter (the path of
//!   `tessera run`) to outputs of the declared shapes, or fails with an
//!   error.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, OnceLock};

use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use tessera::ir::text::{parse, parse_named};
use tessera::ir::{Dim, Graph};
use tessera::tensor::interpret;
use tessera::tensor::Generator;
use tessera::{DType, ErrorKind, Tensor};

use super::hints::random_hint_json;
use super::support::{Rng, Target};
use crate::graph_gen;

/// The file name errors must point into.
const FILE: &str = "fuzz.tir";

/// Largest value (in elements) a graph may hold for the run to be tried.
const RUN_LIMIT: u64 = 1 << 16;

pub fn target() -> Target<String> {
    Target {
        test: "ir_text_parser",
        ci_cases: 100_000,
        generate,
        check: |text| check(text),
        show: |text| text.clone(),
    }
}

// ------------------------------------------------------------------ seeds

const SEED_FILES: &[&str] = &[
    include_str!("seeds/creation.tir"),
    include_str!("seeds/elementwise.tir"),
    include_str!("seeds/shapes.tir"),
    include_str!("seeds/indexing.tir"),
    include_str!("seeds/minimal.tir"),
    include_str!("../../../../examples/mlp.tir"),
];

const IR_DOC: &str = include_str!("../../../../docs/IR.md");

/// The valid graphs that mutations start from.
pub fn seeds() -> &'static [String] {
    static SEEDS: OnceLock<Vec<String>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let mut seeds: Vec<String> = SEED_FILES.iter().map(|s| s.to_string()).collect();
        seeds.extend(doc_graphs());
        let mut runner = TestRunner::new_with_rng(
            Config::default(),
            TestRng::from_seed(RngAlgorithm::ChaCha, &[15; 32]),
        );
        for _ in 0..48 {
            let spec = graph_gen::spec_strategy()
                .new_tree(&mut runner)
                .expect("graph_gen generates")
                .current();
            seeds.push(graph_gen::build(&spec).to_string());
        }
        seeds
    })
}

/// The ```text blocks of docs/IR.md that hold a whole graph.
fn doc_graphs() -> Vec<String> {
    IR_DOC
        .split("```text\n")
        .skip(1)
        .filter_map(|block| block.split("```").next())
        .filter(|block| block.lines().any(|l| l.starts_with("graph ")))
        .map(str::to_string)
        .collect()
}

// -------------------------------------------------------------- mutations

const NUMBERS: &[&str] = &[
    "0",
    "1",
    "-1",
    "2",
    "3",
    "7",
    "255",
    "65536",
    "2147483647",
    "2147483648",
    "-2147483649",
    "3000000000",
    "4294967296",
    "9007199254740993",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775808",
    "-9223372036854775809",
    "18446744073709551615",
    "18446744073709551616",
    "70368744177664",
    "70368744177665",
    "35184372088832",
    "1000000",
    "4611686018427387904",
    "99999999999999999999999999999",
    "1e308",
    "1e309",
    "-1e-320",
    "0.0",
    "-0.0",
    "nan",
    "-nan",
    "inf",
    "-inf",
    "1.5",
    "1e",
    "1.e5",
    "00",
    "007",
    "+3",
    "0x10",
];

const WORDS: &[&str] = &[
    // ops
    "input",
    "constant",
    "full",
    "arange",
    "rand",
    "randn",
    "cast",
    "neg",
    "exp",
    "log",
    "sqrt",
    "relu",
    "add",
    "sub",
    "mul",
    "div",
    "pow",
    "maximum",
    "eq",
    "lt",
    "where",
    "sum",
    "mean",
    "max",
    "prod",
    "argmax",
    "argmin",
    "softmax",
    "log_softmax",
    "matmul",
    "matmul_t",
    "reshape",
    "permute",
    "expand",
    "slice",
    "cat",
    "contiguous",
    "tril",
    "triu",
    "index_select",
    "gather",
    "index_add",
    "scatter_add",
    "custom",
    "custom_output",
    // dtypes
    "f32",
    "f64",
    "f16",
    "bf16",
    "i64",
    "i32",
    "bool",
    "u8",
    // keywords and attribute names
    "graph",
    "return",
    "as",
    "hints",
    "true",
    "false",
    "dim",
    "dims",
    "keepdim",
    "value",
    "shape",
    "dtype",
    "start",
    "end",
    "step",
    "seed",
    "perm",
    "diagonal",
    "transpose_a",
    "transpose_b",
    "op",
    "attrs",
    "index",
    // symbols
    "s0",
    "s1",
    "s9",
    "batch",
];

const TOKENS: &[&str] = &[
    " : f32[2,3]",
    " : i64[]",
    " : bool[s0]",
    "{dim=0}",
    "{dims=[0], keepdim=true}",
    "{shape=[s0,2]}",
    "{value=[1,2]}",
    "{value=1.0}",
    "(%x, %x)",
    "(%0)",
    "()",
    "# a.rs:1:1",
    "# \"q\\\"uote\":1:2",
    "#:1:2",
    " hints={}",
    " hints={\"order\":\"strict\"}",
    " hints={",
    "\"quoted name\"",
    "\"\\u0000\"",
    "\"unterminated",
    "%x = input : f32[2]\n",
    "%c = constant {value=[3000000000]} : i32[1]\n",
    "%f = full {value=1, shape=[1000000,1000000], dtype=f32} : f32[1000000,1000000]\n",
    "return\n",
    "}\n",
    "graph g() {\n",
    "// comment\n",
    "\r\n",
    "\t",
    ",",
    "=",
    "%",
    "[",
    "]",
    "(",
    ")",
    "{",
    "}",
    "*",
    "+",
    "-",
    ":",
    "\u{0}",
    "\u{feff}",
    "\u{202e}",
    "é",
    "𝕏",
    "\\",
];

const DIMS: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "4",
    "5",
    "s0",
    "s1",
    "2*s0",
    "s0*s1+3",
    "s0+s1",
    "s0*s0",
    "0*s2",
    "70368744177664",
    "4611686018427387904",
    "-1",
    "",
    "s0*s0*s0*s0*s0*s0*s0*s0*s0*s0*s0*s0",
    "s0*s0+1",
    "1000000",
];

/// The byte ranges of the maximal runs of `text` where `inside` holds.
fn runs(text: &str, inside: impl Fn(char) -> bool) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, c) in text.char_indices().chain([(text.len(), ' ')]) {
        match (inside(c) && i < text.len(), start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                out.push((s, i));
                start = None;
            }
            _ => {}
        }
    }
    out
}

/// A char boundary of `text` at or before byte `at`.
fn boundary(text: &str, mut at: usize) -> usize {
    at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

fn replace_run(text: &mut String, rng: &mut Rng, inside: impl Fn(char) -> bool, with: &str) {
    let found = runs(text, inside);
    if !found.is_empty() {
        let (s, e) = *rng.pick(&found);
        text.replace_range(s..e, with);
    }
}

fn random_shape(rng: &mut Rng) -> String {
    let rank = rng.below(6);
    let dims: Vec<&str> = (0..rank).map(|_| *rng.pick(DIMS)).collect();
    format!("[{}]", dims.join(","))
}

fn random_char(rng: &mut Rng) -> char {
    match rng.below(4) {
        0 => *rng.pick(&[
            '\0', '\r', '\t', '\n', 'é', '∞', '\u{feff}', '\u{202e}', '𝕏', '"', '\\', '%', '{',
            '}', '[', ']', '(', ')', ',', '=', ':', '#', '*', '+', '-', '.',
        ]),
        _ => char::from(b' ' + rng.below(95) as u8),
    }
}

fn mutate(text: &mut String, rng: &mut Rng) {
    let len = text.len();
    let at = boundary(text, rng.below(len + 1));
    let lines: Vec<String> = text.split('\n').map(str::to_string).collect();
    match rng.below(16) {
        0 => {
            let end = boundary(text, at + 1 + rng.below(16));
            text.replace_range(at..end, "");
        }
        1 => text.insert(at, random_char(rng)),
        2 => {
            let end = boundary(text, at + 1).max(at);
            let end = text[at..].chars().next().map_or(end, |c| at + c.len_utf8());
            text.replace_range(at..end, &random_char(rng).to_string());
        }
        3 | 4 => {
            let n = *rng.pick(NUMBERS);
            replace_run(text, rng, |c| c.is_ascii_digit(), n);
        }
        5 => {
            let w = *rng.pick(WORDS);
            replace_run(text, rng, |c| c.is_ascii_alphabetic() || c == '_', w);
        }
        6 => {
            let token = *rng.pick(TOKENS);
            text.insert_str(at, token);
        }
        7 => {
            // A shape: the text between a `[` and the next `]`.
            let opens: Vec<usize> = text.match_indices('[').map(|(i, _)| i).collect();
            if !opens.is_empty() {
                let s = *rng.pick(&opens);
                if let Some(e) = text[s..].find(']') {
                    let shape = random_shape(rng);
                    text.replace_range(s..s + e + 1, &shape);
                }
            }
        }
        8 => {
            // A label: `%name` → another label, a fresh one or a bare `%`.
            let labels = runs(text, |c| c.is_ascii_alphanumeric() || c == '_' || c == '%');
            let labels: Vec<_> = labels
                .into_iter()
                .filter(|&(s, _)| text[s..].starts_with('%'))
                .collect();
            if !labels.is_empty() {
                let (s, e) = *rng.pick(&labels);
                let (s2, e2) = *rng.pick(&labels);
                let other = text[s2..e2].to_string();
                let with = match rng.below(4) {
                    0 => "%".to_string(),
                    1 => "%99".to_string(),
                    2 => "%fresh".to_string(),
                    _ => other,
                };
                text.replace_range(s..e, &with);
            }
        }
        9 => {
            // Hints on a random node line.
            let hint = format!(" hints={}", random_hint_json(rng));
            let mut lines = lines;
            let i = rng.below(lines.len());
            match lines[i].find('#') {
                Some(p) => lines[i].insert_str(p, &hint),
                None => lines[i].push_str(&hint),
            }
            *text = lines.join("\n");
        }
        10 => {
            // Delete, duplicate or swap lines.
            let mut lines = lines;
            let (i, j) = (rng.below(lines.len()), rng.below(lines.len()));
            match rng.below(3) {
                0 => {
                    lines.remove(i);
                }
                1 => {
                    let copy = lines[i].clone();
                    lines.insert(j, copy);
                }
                _ => lines.swap(i, j),
            }
            *text = lines.join("\n");
        }
        11 => {
            // A line of another seed.
            let other = rng.pick(seeds());
            let other: Vec<&str> = other.split('\n').collect();
            let mut lines = lines;
            let i = rng.below(lines.len() + 1);
            lines.insert(i, rng.pick(&other).to_string());
            *text = lines.join("\n");
        }
        12 => text.truncate(at),
        13 => {
            // Repeat a stretch: long lists, repeated names.
            let end = boundary(text, at + rng.below(40));
            let copy = text[at..end].repeat(1 + rng.below(4));
            text.insert_str(at, &copy);
        }
        14 => {
            // A long run of one token.
            let token = *rng.pick(&["[", "s0*", "%x, ", "1,", "{", "\"a\":[", "s0+"]);
            text.insert_str(at, &token.repeat(1 + rng.below(1500)));
        }
        _ => {
            // Dtypes and attribute values.
            let w = *rng.pick(&["f32", "f64", "f16", "bf16", "i64", "i32", "bool"]);
            replace_run(text, rng, |c| c.is_ascii_alphanumeric(), w);
        }
    }
}

/// Families of ops that take the same inputs and give the same type, so
/// that one can replace another in a valid graph.
const FAMILIES: &[&[&str]] = &[
    &[
        "neg",
        "abs",
        "exp",
        "log",
        "sqrt",
        "rsqrt",
        "reciprocal",
        "sin",
        "cos",
        "tanh",
        "sigmoid",
        "relu",
        "gelu",
        "gelu_tanh",
        "silu",
        "contiguous",
    ],
    &["add", "sub", "mul", "div", "pow", "maximum", "minimum"],
    &["eq", "ne", "lt", "le", "gt", "ge"],
    &["sum", "mean", "max", "min", "prod"],
    &["argmax", "argmin"],
    &["softmax", "log_softmax"],
    &["tril", "triu"],
    &["rand", "randn"],
    &["index_add", "scatter_add"],
];

/// A change that keeps a valid graph valid more often than not.
fn gentle(text: &mut String, rng: &mut Rng) {
    match rng.below(5) {
        4 => {
            // A node line repeated under a new label (a dead twin).
            let mut lines: Vec<String> = text.split('\n').map(str::to_string).collect();
            let nodes: Vec<usize> = (0..lines.len())
                .filter(|&i| lines[i].trim_start().starts_with('%'))
                .collect();
            if !nodes.is_empty() {
                let i = *rng.pick(&nodes);
                let line = &lines[i];
                if let Some(end) = line.find(" =").or_else(|| line.find(" \"")) {
                    let start = line.find('%').unwrap_or(0) + 1;
                    let twin = format!("{}twin{}{}", &line[..start], rng.below(1000), &line[end..]);
                    lines.insert(i + 1, twin);
                    *text = lines.join("\n");
                }
            }
        }
        0 => {
            // An op replaced by one of its family.
            let words = runs(text, |c| c.is_ascii_alphanumeric() || c == '_');
            let ops: Vec<(usize, usize, &[&str])> = words
                .into_iter()
                .filter_map(|(s, e)| {
                    let family = FAMILIES.iter().find(|f| f.contains(&&text[s..e]))?;
                    Some((s, e, *family))
                })
                .collect();
            if !ops.is_empty() {
                let (s, e, family) = *rng.pick(&ops);
                let with = *rng.pick(family);
                text.replace_range(s..e, with);
            }
        }
        1 => {
            // A value that is not part of a type: after `value=`, `seed=`,
            // `diagonal=`, `start=`, in constant lists.
            let keys = ["value=", "value=[", "seed=", "diagonal=", ","];
            let places: Vec<usize> = keys
                .iter()
                .flat_map(|k| text.match_indices(k).map(|(i, k)| i + k.len()))
                .filter(|&i| text[i..].starts_with(|c: char| c.is_ascii_digit() || c == '-'))
                .collect();
            if !places.is_empty() {
                let at = *rng.pick(&places);
                let len = text[at..]
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '.' || c == '-'))
                    .unwrap_or(text.len() - at);
                let n = *rng.pick(NUMBERS);
                text.replace_range(at..at + len, n);
            }
        }
        2 => {
            // Hints on a node line.
            let hint = format!(" hints={}", random_hint_json(rng));
            let mut lines: Vec<String> = text.split('\n').map(str::to_string).collect();
            let nodes: Vec<usize> = (0..lines.len())
                .filter(|&i| lines[i].trim_start().starts_with('%') && !lines[i].contains("hints="))
                .collect();
            if !nodes.is_empty() {
                let i = *rng.pick(&nodes);
                match lines[i].find(" #") {
                    Some(p) => lines[i].insert_str(p, &hint),
                    None => lines[i].push_str(&hint),
                }
                *text = lines.join("\n");
            }
        }
        _ => {
            // A comment, a blank line, CRLF, or tabs.
            let mut lines: Vec<String> = text.split('\n').map(str::to_string).collect();
            let i = rng.below(lines.len());
            match rng.below(3) {
                0 => lines.insert(i, "  // a comment".into()),
                1 => lines.insert(i, String::new()),
                _ => lines[i] = lines[i].replace(' ', "\t") + "\r",
            }
            *text = lines.join("\n");
        }
    }
}

/// A random valid graph of `graph_gen`, printed.
fn fresh(rng: &mut Rng) -> String {
    let mut seed = [0u8; 32];
    for chunk in seed.chunks_mut(8) {
        chunk.copy_from_slice(&rng.u64().to_le_bytes());
    }
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed),
    );
    let spec = graph_gen::spec_strategy()
        .new_tree(&mut runner)
        .expect("graph_gen generates")
        .current();
    graph_gen::build(&spec).to_string()
}

fn generate(rng: &mut Rng) -> String {
    let roll = rng.below(100);
    if roll < 30 {
        let mut text = match roll < 15 {
            true => fresh(rng),
            false => rng.pick(seeds()).clone(),
        };
        for _ in 0..rng.below(4) {
            gentle(&mut text, rng);
        }
        return text;
    }
    if rng.chance(0.04) {
        // Token soup.
        let n = rng.below(60);
        return (0..n)
            .map(|_| match rng.below(3) {
                0 => rng.pick(WORDS).to_string(),
                1 => rng.pick(NUMBERS).to_string(),
                _ => rng.pick(TOKENS).to_string(),
            })
            .collect::<Vec<_>>()
            .join(" ");
    }
    let mut text = rng.pick(seeds()).clone();
    for _ in 0..1 + rng.below(4) {
        match rng.chance(0.3) {
            true => gentle(&mut text, rng),
            false => mutate(&mut text, rng),
        }
    }
    text
}

// ------------------------------------------------------------- properties

fn check(text: &str) -> Result<(), String> {
    let graph = match parse_named(text, FILE) {
        Err(e) => {
            let lines = text.split('\n').count() as u32;
            return match &e.location {
                _ if e.kind != ErrorKind::Parse => {
                    Err(format!("a {:?} error, not Parse: {e}", e.kind))
                }
                _ if e.message.trim().is_empty() => Err(format!("an empty message: {e:?}")),
                None => Err(format!("a parse error without a location: {e}")),
                Some(loc) if &*loc.file != FILE || loc.line == 0 || loc.line > lines => Err(
                    format!("a parse error located outside the file ({lines} lines): {e}"),
                ),
                Some(_) => Ok(()),
            };
        }
        Ok(g) => g,
    };
    graph
        .verify()
        .map_err(|e| format!("parsed but does not verify: {e}"))?;
    let printed = graph.to_string();
    match parse(&printed) {
        Ok(back) if back == graph => {}
        // NaN is not equal to itself: such graphs must print the same.
        Ok(back) if printed.contains("nan") && back.to_string() == printed => {}
        Ok(back) => {
            return Err(format!(
                "the printed graph parses to another graph:\n{printed}\n---\n{back}"
            ))
        }
        Err(e) => return Err(format!("the printed graph does not parse: {e}\n{printed}")),
    }
    run_small(&graph, text)
}

/// `dim` with `symbols`, in checked arithmetic (from its printed form,
/// `2*s0*s1+3`); `None` on overflow or an unbound symbol.
fn eval_dim(dim: &Dim, symbols: &HashMap<Arc<str>, usize>) -> Option<u64> {
    dim.to_string().split('+').try_fold(0u64, |sum, term| {
        let product = term.split('*').try_fold(1u64, |p, factor| {
            let v = match factor.parse::<u64>() {
                Ok(n) => n,
                Err(_) => *symbols.get(factor)? as u64,
            };
            p.checked_mul(v)
        })?;
        sum.checked_add(product)
    })
}

fn eval_shape(dims: &[Dim], symbols: &HashMap<Arc<str>, usize>) -> Option<Vec<u64>> {
    dims.iter().map(|d| eval_dim(d, symbols)).collect()
}

fn numel(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d))
}

/// Runs `graph` when everything in it is small; see the module doc.
fn run_small(graph: &Graph, text: &str) -> Result<(), String> {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut hasher);
    let hash = hasher.finish();
    // Every symbol of the inputs' types gets a value in 0..=3.
    let mut symbols: HashMap<Arc<str>, usize> = HashMap::new();
    for &id in &graph.inputs {
        for dim in graph.node(id).ty.shape.dims() {
            for s in dim.symbols() {
                let n = symbols.len() as u32;
                symbols
                    .entry(s)
                    .or_insert(((hash >> (2 * (n % 32))) & 3) as usize);
            }
        }
    }
    let mut shapes = Vec::new();
    for node in &graph.nodes {
        let small = eval_shape(node.ty.shape.dims(), &symbols)
            .filter(|s| numel(s).is_some_and(|n| n <= RUN_LIMIT));
        match small {
            Some(s) => shapes.push(s),
            // A value too large, or with symbols no input binds: not run
            // here (the tensor API target covers huge sizes).
            None => return Ok(()),
        }
    }
    let mut generator = Generator::new(hash);
    let mut inputs = Vec::new();
    for &id in &graph.inputs {
        let node = graph.node(id);
        let shape: Vec<usize> = shapes[id.index()].iter().map(|&d| d as usize).collect();
        let n = shape.iter().product::<usize>();
        let t = if node.ty.dtype.is_float() {
            Tensor::randn(&shape, DType::F32, &mut generator)
        } else {
            // Small non-negative values: valid indices, more often than not.
            let values: Vec<f32> = (0..n).map(|i| ((i as u64 + hash) % 3) as f32).collect();
            Tensor::from_vec(values, &shape)
        };
        inputs.push(
            t.try_cast(node.ty.dtype)
                .map_err(|e| format!("making input {}: {e}", graph.display_name(id)))?,
        );
    }
    match interpret::run_graph(graph, &inputs) {
        Ok(outputs) => {
            for (out, (name, t)) in graph.outputs.iter().zip(&outputs) {
                let want: Vec<usize> = shapes[out.node.index()]
                    .iter()
                    .map(|&d| d as usize)
                    .collect();
                if t.shape() != want.as_slice() || t.dtype() != graph.node(out.node).ty.dtype {
                    return Err(format!(
                        "output `{name}` is {}, declared {} (= {want:?} with {symbols:?})",
                        t.ty(),
                        graph.node(out.node).ty
                    ));
                }
                if t.to_f64_vec().len() != t.numel() {
                    return Err(format!("output `{name}` reads back the wrong count"));
                }
            }
            Ok(())
        }
        Err(e) if e.message.trim().is_empty() => Err(format!("an empty error message: {e:?}")),
        Err(_) => Ok(()),
    }
}

#[test]
fn seeds_are_valid_graphs() {
    for (i, seed) in seeds().iter().enumerate() {
        if let Err(e) = parse(seed) {
            panic!("seed {i} does not parse: {e}\n{seed}");
        }
        assert_eq!(check(seed), Ok(()), "seed {i}:\n{seed}");
    }
    assert!(!doc_graphs().is_empty(), "the graph of docs/IR.md is found");
}
