//! `tessera._tessera`: the Python module over tessera's public API, a thin
//! binding for the `tessera` Python package (`python/tessera/`), whose
//! torch.compile backend converts PyTorch's ATen graphs to tessera's text
//! IR and runs them through [`tessera::compile::CompiledGraph`]:
//!
//! - `CompiledGraph(text, ...)`: a `.tir` graph parsed (errors at their
//!   line and column) and compiled with [`tessera::compile::compile_graph`]
//!   under options that map to [`CompileOptions`]; `run_dlpack` runs it on
//!   DLPack capsules and returns capsules (zero copy, host and CUDA
//!   memory);
//! - `Tensor`: a tessera tensor (`from_dlpack`, `to_dlpack`, `to_list`);
//! - `check_hints`: a hint object validated and normalised by
//!   [`tessera::hints::Hint`] (unknown keys come back as warnings);
//! - `memory_stats`/`reset_peak_memory`: the host allocator's accounting;
//! - `cuda_*`: tessera's CUDA backend (`cuda.rs`: opened on first use, its
//!   stream for ordering PyTorch's work with tessera's, its memory stats;
//!   `torch_alloc.rs`: PyTorch's caching allocator as its memory).
//!
//! Every tessera error is raised as `tessera.TesseraError` with tessera's
//! message (the op, the shapes and dtypes, the line).

mod cuda;
mod dlpack;
mod torch_alloc;

use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use tessera::compile::{compile_graph, CompileOptions, CompiledGraph as Compiled, Mode};
use tessera::hints::{Hint, Strategy};
use tessera::ir::text::parse_named;
use tessera::{DType, Tensor};

create_exception!(_tessera, TesseraError, PyRuntimeError);

/// A tessera error as a Python exception.
pub(crate) fn to_py(e: tessera::Error) -> PyErr {
    TesseraError::new_err(e.to_string())
}

/// A device error (a message) as a Python exception.
pub(crate) fn device_error(message: String) -> PyErr {
    to_py(tessera::Error::new(tessera::ErrorKind::Device, message))
}

fn argument(message: String) -> PyErr {
    to_py(tessera::Error::new(tessera::ErrorKind::Argument, message))
}

/// A tessera tensor with values (host or GPU memory).
#[pyclass(name = "Tensor", module = "tessera._tessera", frozen)]
struct PyTensor(Tensor);

#[pymethods]
impl PyTensor {
    /// A tensor over a `"dltensor"` capsule's memory (no copy).
    #[staticmethod]
    fn from_dlpack(capsule: &Bound<'_, PyAny>) -> PyResult<PyTensor> {
        dlpack::import(capsule).map(PyTensor)
    }

    /// A `"dltensor"` capsule over this tensor's memory (no copy).
    fn to_dlpack<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        dlpack::export(py, &self.0)
    }

    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.0.shape().to_vec()
    }

    #[getter]
    fn dtype(&self) -> String {
        self.0.dtype().to_string()
    }

    /// Where the values are: `cpu` or `cuda`.
    #[getter]
    fn device(&self) -> String {
        self.0.device().to_string()
    }

    /// The values as a flat list of floats (row-major), for tests.
    fn to_list(&self) -> Vec<f64> {
        self.0.to_f64_vec()
    }

    fn __repr__(&self) -> String {
        format!("tessera.Tensor({})", self.0.ty())
    }
}

fn mode_of(name: &str) -> PyResult<Mode> {
    match name {
        "default" => Ok(Mode::Default),
        "reduce-overhead" => Ok(Mode::ReduceOverhead),
        "max-autotune" | "max-autotune-no-cudagraphs" => Ok(Mode::MaxAutotune),
        other => Err(argument(format!(
            "unknown mode `{other}`: expected default, reduce-overhead or max-autotune"
        ))),
    }
}

fn strategy_of(name: &str) -> PyResult<Strategy> {
    Strategy::from_name(name).ok_or_else(|| {
        argument(format!(
            "unknown schedule `{name}`: expected bfs, dfs, strict or auto"
        ))
    })
}

/// A graph in tessera's text form, compiled with tessera's pipeline.
#[pyclass(name = "CompiledGraph", module = "tessera._tessera", frozen)]
struct PyCompiledGraph(Compiled);

#[pymethods]
impl PyCompiledGraph {
    /// Parses `text` (errors name `source`, the line and the column) and
    /// compiles it. `mode`: default | reduce-overhead | max-autotune;
    /// `dynamic`: None (automatic), True or False; `schedule`: bfs | dfs |
    /// strict | auto; `memory_budget_mb`: the most MiB a graph's
    /// intermediates may hold at once; `fuse_attention`: the attention
    /// pattern pass.
    #[new]
    #[pyo3(signature = (text, source = "<torch graph>", mode = "default", dynamic = None,
        fullgraph = false, schedule = None, memory_budget_mb = None, fuse_attention = true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        text: &str,
        source: &str,
        mode: &str,
        dynamic: Option<bool>,
        fullgraph: bool,
        schedule: Option<&str>,
        memory_budget_mb: Option<f64>,
        fuse_attention: bool,
    ) -> PyResult<PyCompiledGraph> {
        let mut options = CompileOptions {
            mode: mode_of(mode)?,
            dynamic,
            fullgraph,
            fuse_attention,
            ..CompileOptions::default()
        };
        if let Some(s) = schedule {
            options.schedule = strategy_of(s)?;
        }
        if let Some(mb) = memory_budget_mb {
            if !(mb.is_finite() && mb >= 0.0) {
                return Err(argument(format!(
                    "memory_budget_mb must be a finite number >= 0, got {mb}"
                )));
            }
            options.memory_budget = Some((mb * 1024.0 * 1024.0) as usize);
        }
        let graph = parse_named(text, source).map_err(to_py)?;
        compile_graph(graph, options)
            .map(PyCompiledGraph)
            .map_err(to_py)
    }

    /// Runs on `"dltensor"` capsules (one per graph input) and returns one
    /// capsule per output; the GIL is released while tessera runs.
    /// `torch_stream`: the `CUstream` of PyTorch's work around a call on
    /// the GPU (`torch.cuda.current_stream().cuda_stream`), which tessera's
    /// work is ordered with (see `cuda::foreign_call`).
    #[pyo3(signature = (capsules, torch_stream = None))]
    fn run_dlpack<'py>(
        &self,
        py: Python<'py>,
        capsules: Vec<Bound<'py, PyAny>>,
        torch_stream: Option<u64>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let inputs: Vec<Tensor> = capsules
            .iter()
            .map(dlpack::import)
            .collect::<PyResult<_>>()?;
        let outputs = py
            .detach(|| cuda::foreign_call(torch_stream, || self.0.try_call(&inputs)))
            .map_err(to_py)?;
        drop(inputs);
        outputs.iter().map(|t| dlpack::export(py, t)).collect()
    }

    /// Runs on tessera tensors (`torch_stream` as in `run_dlpack`).
    #[pyo3(signature = (inputs, torch_stream = None))]
    fn run(
        &self,
        py: Python<'_>,
        inputs: Vec<Py<PyTensor>>,
        torch_stream: Option<u64>,
    ) -> PyResult<Vec<PyTensor>> {
        let inputs: Vec<Tensor> = inputs.iter().map(|t| t.get().0.clone()).collect();
        let outputs = py
            .detach(|| cuda::foreign_call(torch_stream, || self.0.try_call(&inputs)))
            .map_err(to_py)?;
        Ok(outputs.into_iter().map(PyTensor).collect())
    }

    /// The graph as parsed, in tessera's text form.
    fn graph_text(&self) -> String {
        self.0.graph().to_string()
    }

    /// Every stage's artifact of the executable built last, as (name,
    /// text) pairs: the graph after the passes, kernels, schedule, memory
    /// plan.
    fn artifacts(&self) -> Vec<(String, String)> {
        self.0.last_artifacts()
    }

    /// The compile cache's counters.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.0.stats();
        let d = PyDict::new(py);
        d.set_item("compiles", s.compiles)?;
        d.set_item("recompiles", s.recompiles)?;
        d.set_item("cache_hits", s.cache_hits)?;
        d.set_item("eager_calls", s.eager_calls)?;
        d.set_item("compile_seconds", s.compile_seconds)?;
        d.set_item("trace_seconds", s.trace_seconds)?;
        Ok(d)
    }

    /// Why a graph with symbolic dims is not compiled once over them
    /// (None when it is, or has none).
    fn symbolic_refusal(&self) -> Option<String> {
        self.0.symbolic_refusal().map(str::to_string)
    }

    fn recompile_reasons(&self) -> Vec<String> {
        self.0.recompile_reasons()
    }
}

/// Validates a hint object (JSON text) and returns it normalised, with
/// the warnings for unknown keys; a wrong type is a `TesseraError` naming
/// the key.
#[pyfunction]
fn check_hints(json: &str) -> PyResult<(String, Vec<String>)> {
    let (hint, warnings) = Hint::parse_with_warnings(json).map_err(to_py)?;
    Ok((hint.to_json(), warnings))
}

/// The hints a backward op inherits from a forward op with hints `json`
/// ([`tessera::hints::for_backward`]: `backward_group_id` becomes the
/// `group_id`).
#[pyfunction]
fn backward_hints(json: &str) -> PyResult<String> {
    let map: tessera::hints::HintMap = serde_json::from_str(json)
        .map_err(|e| argument(format!("hints {json}: not a JSON object: {e}")))?;
    let back = tessera::hints::for_backward(Some(std::sync::Arc::new(map)))
        .map(|m| serde_json::Value::Object((*m).clone()).to_string())
        .unwrap_or_else(|| "{}".to_string());
    Ok(back)
}

/// The host allocator's (live bytes, peak bytes).
#[pyfunction]
fn memory_stats() -> (usize, usize) {
    let s = tessera::runtime::cpu::memory_stats();
    (s.live_bytes, s.peak_bytes)
}

/// Starts a new peak measurement from the bytes alive now.
#[pyfunction]
fn reset_peak_memory() {
    tessera::runtime::cpu::reset_peak();
}

/// The dtypes tessera has, by name (`f32` …).
#[pyfunction]
fn dtypes() -> Vec<String> {
    [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::Bool,
    ]
    .iter()
    .map(|d| d.to_string())
    .collect()
}

#[pymodule]
fn _tessera(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("TesseraError", m.py().get_type::<TesseraError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<PyTensor>()?;
    m.add_class::<PyCompiledGraph>()?;
    m.add_function(wrap_pyfunction!(check_hints, m)?)?;
    m.add_function(wrap_pyfunction!(backward_hints, m)?)?;
    m.add_function(wrap_pyfunction!(memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(reset_peak_memory, m)?)?;
    m.add_function(wrap_pyfunction!(dtypes, m)?)?;
    cuda::add(m)?;
    torch_alloc::add(m)?;
    Ok(())
}
