//! Parameters and the store modules register them in.
//!
//! Tensors are immutable, so a parameter is a shared slot holding its
//! current value: a leaf that requires grad. A forward pass reads the leaf
//! ([`Parameter::get`]) so `backward` accumulates the gradient on it; an
//! optimizer computes the next value and puts a fresh leaf in the slot
//! ([`Parameter::set`]), which also drops the old gradient.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::{Arc, RwLock};

use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::ir::{DType, TensorType};
use crate::runtime::device::Device;
use crate::tensor::{Generator, Tensor};

/// A named, shared, replaceable trainable tensor. Clones share the slot.
#[derive(Clone)]
pub struct Parameter(Arc<Slot>);

struct Slot {
    name: String,
    value: RwLock<Tensor>,
}

impl Parameter {
    /// A parameter outside any store (modules use [`ParamStore::add`]).
    pub fn new(name: impl Into<String>, value: &Tensor) -> Parameter {
        Parameter(Arc::new(Slot {
            name: name.into(),
            value: RwLock::new(as_leaf(value)),
        }))
    }

    /// The full name, e.g. `blocks.0.attn.q.weight`.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// The current value: a leaf that requires grad, so the gradients of
    /// every forward pass that uses it accumulate in its `grad()`.
    pub fn get(&self) -> Tensor {
        self.0.value.read().expect("parameter lock").clone()
    }

    /// The type the value always keeps.
    pub fn ty(&self) -> TensorType {
        self.get().ty()
    }

    pub fn numel(&self) -> usize {
        self.get().numel()
    }

    /// The gradient accumulated on the current value, if any.
    pub fn grad(&self) -> Option<Tensor> {
        self.get().grad()
    }

    pub fn zero_grad(&self) {
        self.get().zero_grad();
    }

    /// Replaces the value with a new leaf holding `value`'s values (cut from
    /// any graph). Nothing is copied: the leaf shares `value`'s buffer (on a
    /// device too), so installing an optimizer's or a compiled step's output
    /// moves no data. Panics when the dtype or shape differs.
    #[track_caller]
    pub fn set(&self, value: &Tensor) {
        if let Err(e) = self.try_set(value) {
            panic!("{}", e.at(SourceLoc::caller()));
        }
    }

    /// [`Parameter::set`], returning the error instead of panicking.
    pub fn try_set(&self, value: &Tensor) -> Result<()> {
        let expected = self.ty();
        if value.ty() != expected {
            return Err(Error::op(
                ErrorKind::Shape,
                "Parameter::set",
                format!("{}: expected {expected}, got {}", self.name(), value.ty()),
            ));
        }
        *self.0.value.write().expect("parameter lock") = as_leaf(value);
        Ok(())
    }

    /// Puts `value` in the slot as it is (no new leaf) and returns the
    /// value it held: for code that stands a parameter in for a while and
    /// then puts the original back, its gradient included (a compiled
    /// training step traces the model with its parameters as the graph's
    /// inputs). The caller keeps the type.
    pub(crate) fn replace(&self, value: Tensor) -> Tensor {
        std::mem::replace(&mut *self.0.value.write().expect("parameter lock"), value)
    }

    /// The value handed over: cut from autograd (its gradient dropped),
    /// the slot holding an empty placeholder of its dtype instead, so that
    /// the tensor returned is the only handle of its buffer unless the
    /// caller holds others — for a compiled step that writes the new value
    /// over the old (buffer donation). [`Parameter::install`] puts a value
    /// back.
    pub(crate) fn take(&self) -> Tensor {
        let value = self.get();
        let empty = Tensor::no_elements(value.device(), value.dtype());
        drop(value);
        self.replace(empty).detach()
    }

    /// Installs `value` as a new leaf (as [`Parameter::set`]) after
    /// [`Parameter::take`], whose placeholder has another type: the caller
    /// checks that `value` has the type taken.
    /// Whether `other` is this parameter (one slot), not a copy.
    pub(crate) fn same_slot(&self, other: &Parameter) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    pub(crate) fn install(&self, value: &Tensor) {
        self.replace(as_leaf(value));
    }
}

impl std::fmt::Debug for Parameter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Parameter({}: {})", self.name(), self.ty())
    }
}

fn as_leaf(value: &Tensor) -> Tensor {
    value.detach().set_requires_grad(true)
}

/// `prefix.name`, or `name` alone when the prefix is empty (a root module).
pub fn join_name(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// The parameters of a model, by name, in registration order (the order
/// modules create them, which is the same on every run).
pub struct ParamStore {
    dtype: DType,
    params: Vec<Parameter>,
    by_name: HashMap<String, usize>,
}

impl Default for ParamStore {
    fn default() -> ParamStore {
        ParamStore::new()
    }
}

impl ParamStore {
    /// An empty store whose modules create f32 parameters.
    pub fn new() -> ParamStore {
        ParamStore::with_dtype(DType::F32)
    }

    /// An empty store whose modules create parameters of `dtype` (a float).
    #[track_caller]
    pub fn with_dtype(dtype: DType) -> ParamStore {
        assert!(
            dtype.is_float(),
            "ParamStore: parameters must be floats, got {dtype}"
        );
        ParamStore {
            dtype,
            params: Vec::new(),
            by_name: HashMap::new(),
        }
    }

    /// The dtype modules create their parameters in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Registers `value` as parameter `name`. Panics on a duplicate name.
    #[track_caller]
    pub fn add(&mut self, name: &str, value: &Tensor) -> Parameter {
        match self.try_add(name, value) {
            Ok(p) => p,
            Err(e) => panic!("{}", e.at(SourceLoc::caller())),
        }
    }

    /// [`ParamStore::add`], returning the error instead of panicking.
    pub fn try_add(&mut self, name: &str, value: &Tensor) -> Result<Parameter> {
        if self.by_name.contains_key(name) {
            return Err(Error::op(
                ErrorKind::Argument,
                "ParamStore::add",
                format!("a parameter named `{name}` is already registered"),
            ));
        }
        if !value.dtype().is_float() {
            return Err(Error::op(
                ErrorKind::DType,
                "ParamStore::add",
                format!("`{name}`: parameters must be floats, got {}", value.ty()),
            ));
        }
        let p = Parameter::new(name, value);
        self.by_name.insert(name.to_string(), self.params.len());
        self.params.push(p.clone());
        Ok(p)
    }

    /// A parameter of `shape` drawn uniformly from `[-bound, bound)`.
    #[track_caller]
    pub fn uniform(
        &mut self,
        name: &str,
        shape: &[usize],
        bound: f64,
        generator: &mut Generator,
    ) -> Parameter {
        let u = Tensor::rand(shape, self.dtype, generator);
        self.add(name, &(u * (2.0 * bound) - bound))
    }

    /// A parameter of `shape` drawn from N(0, std²).
    #[track_caller]
    pub fn normal(
        &mut self,
        name: &str,
        shape: &[usize],
        std: f64,
        generator: &mut Generator,
    ) -> Parameter {
        let n = Tensor::randn(shape, self.dtype, generator);
        self.add(name, &(n * std))
    }

    /// A parameter of `shape` filled with `value`.
    #[track_caller]
    pub fn constant(&mut self, name: &str, shape: &[usize], value: f64) -> Parameter {
        self.add(name, &Tensor::full(shape, value, self.dtype))
    }

    pub fn get(&self, name: &str) -> Option<&Parameter> {
        self.by_name.get(name).map(|&i| &self.params[i])
    }

    /// Handles to every parameter, in registration order (for optimizers).
    pub fn parameters(&self) -> Vec<Parameter> {
        self.params.clone()
    }

    pub fn iter(&self) -> std::slice::Iter<'_, Parameter> {
        self.params.iter()
    }

    pub fn len(&self) -> usize {
        self.params.len()
    }

    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// The total number of scalar values in all parameters.
    pub fn num_parameters(&self) -> usize {
        self.params.iter().map(Parameter::numel).sum()
    }

    pub fn zero_grad(&self) {
        self.params.iter().for_each(Parameter::zero_grad);
    }

    /// Writes every parameter to a safetensors file under its name.
    pub fn save_safetensors(&self, path: impl AsRef<Path>) -> Result<()> {
        // Device parameters are written from a host copy.
        let values: Vec<(String, Tensor)> = self
            .params
            .iter()
            .map(|p| Ok((p.name().to_string(), p.get().to(Device::Cpu)?)))
            .collect::<Result<_>>()?;
        let named: Vec<(&str, &Tensor)> = values.iter().map(|(n, t)| (n.as_str(), t)).collect();
        crate::io::save_safetensors(path, &named)
    }

    /// Sets every parameter from a safetensors file. The file must hold
    /// exactly this store's names with the same dtypes and shapes; otherwise
    /// nothing is changed and the error lists every problem
    /// (`blocks.0.attn.q.weight: expected f32[64,64], file has f32[64,32]`).
    pub fn load_safetensors(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let file: HashMap<String, Tensor> =
            crate::io::load_safetensors(path)?.into_iter().collect();
        let problems = self.mismatches(&file);
        if !problems.is_empty() {
            return Err(Error::io(format!(
                "{}: does not match the parameters: {}",
                path.display(),
                problems.join("; ")
            )));
        }
        for p in &self.params {
            p.try_set(&file[p.name()])?;
        }
        Ok(())
    }

    /// What keeps `file` from loading into this store: missing tensors (in
    /// store order), mis-typed ones, then unexpected ones (sorted).
    fn mismatches(&self, file: &HashMap<String, Tensor>) -> Vec<String> {
        let mut problems = Vec::new();
        for p in &self.params {
            match file.get(p.name()) {
                None => problems.push(format!("missing tensor `{}`", p.name())),
                Some(t) if t.ty() != p.ty() => problems.push(format!(
                    "{}: expected {}, file has {}",
                    p.name(),
                    p.ty(),
                    t.ty()
                )),
                Some(_) => {}
            }
        }
        let unexpected: BTreeSet<&String> = file
            .keys()
            .filter(|n| !self.by_name.contains_key(*n))
            .collect();
        problems.extend(
            unexpected
                .into_iter()
                .map(|n| format!("unexpected tensor `{n}`")),
        );
        problems
    }
}

impl<'a> IntoIterator for &'a ParamStore {
    type Item = &'a Parameter;
    type IntoIter = std::slice::Iter<'a, Parameter>;

    fn into_iter(self) -> Self::IntoIter {
        self.params.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_shares_the_values_buffer_and_starts_a_fresh_leaf() {
        let p = Parameter::new("p", &Tensor::from_vec(vec![1.0f32, 2.0], &[2]));
        (p.get() * 3.0).sum(&[], false).backward();
        assert!(p.grad().is_some());
        let next = Tensor::from_vec(vec![5.0f32, 6.0], &[2]);
        p.set(&next);
        let leaf = p.get();
        assert!(leaf.shares_storage(&next), "no copy");
        assert!(leaf.is_leaf() && leaf.requires_grad() && leaf.grad().is_none());
        let err = p.try_set(&Tensor::zeros(&[3], DType::F32)).unwrap_err();
        assert!(
            err.to_string().contains("p: expected f32[2], got f32[3]"),
            "{err}"
        );
    }

    #[test]
    fn replace_swaps_the_handle_itself_and_gives_back_the_old_one() {
        let p = Parameter::new("p", &Tensor::from_vec(vec![1.0f64], &[1]));
        let original = p.get();
        original.exp().sum(&[], false).backward();
        let stand_in = Tensor::from_vec(vec![2.0f64], &[1]);
        let old = p.replace(stand_in.clone());
        assert!(p.get().shares_storage(&stand_in) && !p.get().requires_grad());
        p.replace(old);
        assert!(
            p.get().grad().is_some(),
            "the original leaf, its gradient kept"
        );
        assert!(p.get().shares_storage(&original));
    }
}
