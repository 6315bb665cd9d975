//! The models `run` and `inspect` read: a graph file in tessera's text
//! form (`.tir`, or any other name) or an ONNX model (`.onnx`), both as a
//! tessera `Graph` plus the values a model carries (an ONNX model's
//! weights, which become graph inputs).

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, Result};
use tessera::{Graph, Tensor};

/// A loaded model.
pub struct Loaded {
    pub graph: Graph,
    /// Inputs the model supplies itself (ONNX initializers).
    pub params: Vec<(String, Tensor)>,
    /// Whether it came from an ONNX file.
    pub onnx: bool,
}

pub fn is_onnx(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("onnx"))
}

/// Reads a model; `given` are the user's inputs, which an ONNX model may
/// need at import time (an input used as a shape: the graph is then
/// specialised to that value, and a note says so).
pub fn load(path: &Path, given: &[(String, Tensor)]) -> Result<Loaded> {
    if !is_onnx(path) {
        return Ok(Loaded {
            graph: super::load_graph(path)?,
            params: Vec::new(),
            onnx: false,
        });
    }
    let model = tessera_onnx::Model::load(path)?;
    let mut known = HashMap::new();
    for (name, t) in given {
        known.insert(
            name.clone(),
            tessera_onnx::tensor_literal(&t.to(tessera::runtime::device::Device::Cpu)?)?,
        );
    }
    let options = tessera_onnx::ImportOptions {
        known_inputs: known,
        ..tessera_onnx::ImportOptions::default()
    };
    let imported =
        tessera_onnx::import(&model, &options).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    if !imported.specialised.is_empty() {
        eprintln!(
            "note: the graph is specialised to the values given for {} (used as shapes or counts)",
            imported
                .specialised
                .iter()
                .map(|s| format!("`{s}`"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(Loaded {
        graph: imported.graph,
        params: imported.params,
        onnx: true,
    })
}
