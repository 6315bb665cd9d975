//! The layering rule of `docs/ARCHITECTURE.md`: a module of the `tessera`
//! crate imports only from its own layer's module or from layers below it.
//!
//! The test reads every `crate::…` path in `crates/tessera/src` (in `use`
//! trees, brace groups included, and in expressions), maps the importing
//! file and the imported path to their layers (longest module-path prefix
//! in [`LAYERS`]) and fails on an import that goes up. Imports inside one
//! layer's own module are free; two modules of the same rank may not
//! import each other (each layer is one module, so that cannot happen).
//! There are no exceptions.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The layers, lowest first: (module path prefix, rank). A file belongs to
/// the longest prefix of its module path; so does an imported path.
const LAYERS: &[(&str, usize)] = &[
    ("error", 0),
    ("logging", 0),
    ("limits", 0),
    ("lib", 0),
    ("ir", 1),
    ("hints", 2),
    ("runtime::array", 3),
    ("runtime::cpu", 3),
    ("runtime::device", 3),
    ("runtime::layout", 3),
    ("runtime", 3),
    ("tensor", 4),
    ("autograd", 5),
    ("custom_op", 6),
    ("dist", 6),
    ("io", 7),
    ("nn", 8),
    ("optim", 9),
    ("passes", 10),
    ("fusion", 11),
    ("schedule", 12),
    ("runtime::execute", 13),
    ("runtime::replay", 13),
    ("compile", 14),
];

fn rank(module: &str) -> (&'static str, usize) {
    LAYERS
        .iter()
        .filter(|(prefix, _)| {
            module == *prefix
                || module
                    .strip_prefix(prefix)
                    .is_some_and(|rest| rest.starts_with("::"))
        })
        .max_by_key(|(prefix, _)| prefix.len())
        .map(|&(prefix, rank)| (prefix, rank))
        .unwrap_or_else(|| panic!("module `{module}` has no layer in LAYERS"))
}

/// `crates/tessera/src/runtime/cpu/fused.rs` → `runtime::cpu::fused`.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("a file under src");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts.join("::")
}

/// Every full `crate::…` path in `text`, brace groups expanded
/// (`crate::{ir::{Op, Graph}, error}` → `ir::Op`, `ir::Graph`, `error`).
/// Comments are skipped.
pub fn crate_paths(text: &str) -> Vec<String> {
    crate_paths_from(text, "")
}

/// [`crate_paths`] of a file of module `module`, with its `super::` paths
/// resolved against it (`super::cpu::copy` in `runtime::execute` is
/// `runtime::cpu::copy`).
fn crate_paths_from(text: &str, module: &str) -> Vec<String> {
    let code: String = text
        .lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = Vec::new();
    found.extend(super_paths(&code, module));
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().last();
        rest = &rest[i + "crate::".len()..];
        // `$crate::` in a macro is the crate itself, not a module path.
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let (paths, used) = use_tree(rest);
        found.extend(paths);
        rest = &rest[used..];
    }
    found
}

/// The `super::…` paths of a file of module `module`, as crate paths.
fn super_paths(code: &str, module: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("super::") {
        let before = rest[..i].chars().last();
        let mut after = &rest[i..];
        let mut base: Vec<&str> = module.split("::").collect();
        while let Some(tail) = after.strip_prefix("super::") {
            base.pop();
            after = tail;
        }
        rest = after;
        if module.is_empty() || before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':')
        {
            continue;
        }
        let (paths, _) = use_tree(after);
        let base: Vec<String> = base.iter().map(|s| s.to_string()).collect();
        found.extend(paths.iter().map(|p| join(&base, p)));
    }
    found
}

/// Parses a use tree at the start of `s`: returns its paths and the bytes
/// read.
fn use_tree(s: &str) -> (Vec<String>, usize) {
    let bytes = s.as_bytes();
    let mut i = 0;
    let mut prefix: Vec<String> = Vec::new();
    loop {
        while i < bytes.len() && bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        if i < bytes.len() && bytes[i] == b'{' {
            let mut paths = Vec::new();
            i += 1;
            loop {
                let (inner, used) = use_tree(&s[i..]);
                i += used;
                paths.extend(inner.into_iter().map(|p| join(&prefix, &p)));
                while i < bytes.len() && bytes[i].is_ascii_whitespace() {
                    i += 1;
                }
                match bytes.get(i) {
                    Some(b',') => i += 1,
                    Some(b'}') => {
                        i += 1;
                        break;
                    }
                    _ => break,
                }
                while i < bytes.len() && bytes[i].is_ascii_whitespace() {
                    i += 1;
                }
                if bytes.get(i) == Some(&b'}') {
                    i += 1;
                    break;
                }
            }
            return (paths, i);
        }
        let start = i;
        while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
            i += 1;
        }
        if start == i {
            return (
                vec![prefix.join("::")]
                    .into_iter()
                    .filter(|p| !p.is_empty())
                    .collect(),
                i,
            );
        }
        prefix.push(s[start..i].to_string());
        if s[i..].starts_with("::") {
            i += 2;
            continue;
        }
        return (vec![prefix.join("::")], i);
    }
}

fn join(prefix: &[String], path: &str) -> String {
    match (prefix.is_empty(), path.is_empty() || path == "self") {
        (true, _) => path.to_string(),
        (false, true) => prefix.join("::"),
        (false, false) => format!("{}::{path}", prefix.join("::")),
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a readable source dir") {
        let path = entry.expect("a dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The file before its unit tests (`#[cfg(test)]` then `mod …`): tests
/// may use the whole crate (a kernel's test builds its inputs as tensors).
fn without_tests(text: &str) -> &str {
    let mut at = 0;
    let mut lines = text.split_inclusive('\n').peekable();
    while let Some(line) = lines.next() {
        if line.trim() == "#[cfg(test)]"
            && lines
                .peek()
                .is_some_and(|l| l.trim_start().starts_with("mod "))
        {
            return &text[..at];
        }
        at += line.len();
    }
    text
}

/// The upward imports of one file: (imported layer prefix, the path).
fn upward(module: &str, text: &str) -> Vec<(&'static str, String)> {
    let (own, own_rank) = rank(module);
    let mut up = Vec::new();
    for path in crate_paths_from(without_tests(text), module) {
        // A crate-root item (`crate::with_dtype!`, `crate::Tensor`) is a
        // re-export or macro of lib.rs: checked where it is defined.
        let first = path.split("::").next().unwrap_or_default();
        if !LAYERS
            .iter()
            .any(|(p, _)| p.split("::").next() == Some(first))
        {
            continue;
        }
        let (layer, r) = rank(&path);
        if r > own_rank && layer != own {
            up.push((layer, path));
        }
    }
    up
}

#[test]
fn imports_only_go_down() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut found: BTreeSet<(String, &'static str)> = BTreeSet::new();
    let mut report = Vec::new();
    for file in &files {
        let module = module_of(&src, file);
        let text = std::fs::read_to_string(file).expect("a readable file");
        let rel = file
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .to_string();
        for (layer, path) in upward(&module, &text) {
            if found.insert((rel.clone(), layer)) {
                report.push(format!(
                    "{rel} ({}, rank {}) imports crate::{path} ({layer}, rank {})",
                    rank(&module).0,
                    rank(&module).1,
                    rank(layer).1
                ));
            }
        }
    }
    assert!(
        report.is_empty(),
        "upward imports (see docs/ARCHITECTURE.md):\n{}",
        report
            .iter()
            .map(|l| format!("  {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The test of the test: an upward import is found, in a plain `use`, in
/// a brace group and in an expression path; a downward one and comments
/// are not.
#[test]
fn an_upward_import_is_caught() {
    let text = "use crate::ir::{Graph, Op};\n\
                use crate::{error::Result, compile::Compiled};\n\
                // use crate::schedule::Strategy;\n\
                fn f() { crate::fusion::fuse(todo); }\n";
    let up = upward("passes::cse", text);
    let layers: Vec<&str> = up.iter().map(|(l, _)| *l).collect();
    assert_eq!(layers, ["compile", "fusion"], "{up:?}");
    assert!(upward("compile", text).is_empty());
    let tested =
        "use crate::ir::Op;\n#[cfg(test)]\nmod tests {\n    use crate::compile::compile;\n}\n";
    assert!(upward("passes::cse", tested).is_empty());
    assert_eq!(
        crate_paths("use crate::runtime::{cpu::{self, Storage}, execute};"),
        ["runtime::cpu", "runtime::cpu::Storage", "runtime::execute"]
    );
    assert_eq!(
        crate_paths_from(
            "use super::super::execute::run;\nuse super::copy;",
            "runtime::cpu::fused"
        ),
        ["runtime::execute::run", "runtime::cpu::copy"]
    );
    assert_eq!(
        upward("runtime::cpu::fused", "use super::super::execute::run;").len(),
        1
    );
    // The tape, tracing and custom calls are the tensor layer's: reaching
    // up into the engine or the user-facing custom-op module is caught.
    assert_eq!(
        upward("tensor::trace", "use crate::autograd::no_grad;").len(),
        1
    );
    assert_eq!(
        upward("tensor", "fn f() { crate::custom_op::call(n, a, i); }").len(),
        1
    );
    assert!(upward("autograd::engine", "use crate::tensor::tape::GradNode;").is_empty());
    assert_eq!(rank("runtime::execute::run").0, "runtime::execute");
    assert_eq!(rank("runtime::cpu::fused").0, "runtime::cpu");
}
