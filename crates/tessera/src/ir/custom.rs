//! Custom ops as the IR knows them: a name `ns::name` and a shape function
//! (a [`Signature`]), and one call of such an op with its attributes (a
//! [`CustomCall`], the payload of `Op::Custom`).
//!
//! The signatures live in a process-wide registry here, so that type
//! inference, the verifier and the text parser find them without reaching
//! up into the layers that run ops. What runs a call (the kernels of each
//! backend, the backward, eager execution and tracing) belongs to the
//! tensor layer (`tensor::custom`, public as `tessera::custom_op`):
//! registering an op there registers its signature here. The built-in ops'
//! signatures ([`flash_attention`]) are here from the start, so a graph
//! naming them parses before anything else runs.

pub mod collective;
pub mod conv;
pub mod cross_entropy;
pub mod flash_attention;

use std::collections::HashMap;
use std::fmt;
use std::panic::RefUnwindSafe;
use std::sync::{Arc, LazyLock, RwLock};

use super::infer::TensorType;
use crate::error::{op_err, Error, Result};

/// A custom op's attributes: a JSON object (ordered by key, so that equal
/// attributes print, hash and compare alike).
pub type Attrs = serde_json::Map<String, serde_json::Value>;

/// The shape function: input types → output types (may be symbolic).
pub type ShapeFn =
    dyn Fn(&Attrs, &[TensorType]) -> Result<Vec<TensorType>> + Send + Sync + RefUnwindSafe;

/// What the IR knows of a custom op: its name and its shape function.
pub struct Signature {
    name: String,
    shape_fn: Arc<ShapeFn>,
}

impl fmt::Debug for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Signature({})", self.name)
    }
}

impl Signature {
    /// A signature called `name` (`namespace::name`, checked).
    pub(crate) fn new(name: &str, shape_fn: Arc<ShapeFn>) -> Result<Signature> {
        check_name(name)?;
        Ok(Signature {
            name: name.to_string(),
            shape_fn,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The output types for `inputs`, from the shape function; at least
    /// one. Its errors name this op.
    pub fn infer(&self, attrs: &Attrs, inputs: &[TensorType]) -> Result<Vec<TensorType>> {
        let types = (self.shape_fn)(attrs, inputs).map_err(|e| self.own(e))?;
        if types.is_empty() {
            return Err(op_err!(
                Verify,
                self.name.clone(),
                "the shape function returned no outputs"
            ));
        }
        for ty in &types {
            ty.check_size(&self.name)?;
        }
        Ok(types)
    }

    /// `e`, naming this op when it names none (errors from user functions).
    pub(crate) fn own(&self, mut e: Error) -> Error {
        if e.op.is_none() {
            e.op = Some(self.name.clone());
        }
        e
    }
}

/// `ns::name`: two identifiers joined by `::`.
pub(crate) fn check_name(name: &str) -> Result<()> {
    let ident = |s: &str| {
        !s.is_empty()
            && !s.starts_with(|c: char| c.is_ascii_digit())
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    match name.split_once("::") {
        Some((ns, op)) if ident(ns) && ident(op) => Ok(()),
        _ => Err(op_err!(
            Argument,
            name,
            "a custom op's name must be `namespace::name` (identifiers), got {name:?}"
        )),
    }
}

static SIGNATURES: LazyLock<RwLock<HashMap<String, Arc<Signature>>>> = LazyLock::new(|| {
    let mut builtins = flash_attention::signatures();
    builtins.extend(cross_entropy::signatures());
    builtins.extend(conv::signatures());
    builtins.extend(collective::signatures());
    RwLock::new(
        builtins
            .into_iter()
            .map(|s| (s.name.clone(), Arc::new(s)))
            .collect(),
    )
});

/// Adds `signature` to the registry. A name already registered is an
/// error (ops are looked up by name when graphs are parsed). Only
/// the tensor layer's registry (`tensor::custom`) registers, together with
/// the op's kernels.
pub(crate) fn register(signature: Signature) -> Result<Arc<Signature>> {
    let mut registry = SIGNATURES.write().expect("custom op signatures");
    if registry.contains_key(&signature.name) {
        return Err(op_err!(
            Argument,
            signature.name.clone(),
            "a custom op of this name is already registered"
        ));
    }
    let signature = Arc::new(signature);
    registry.insert(signature.name.clone(), signature.clone());
    Ok(signature)
}

/// The signature of the registered op called `name`.
pub fn lookup(name: &str) -> Result<Arc<Signature>> {
    SIGNATURES
        .read()
        .expect("custom op signatures")
        .get(name)
        .cloned()
        .ok_or_else(|| {
            op_err!(
                Argument,
                name,
                "no custom op of this name is registered (register it before using or parsing it)"
            )
        })
}

/// One call of a custom op with its attributes: the payload of `Op::Custom`.
/// Two calls are equal when they name the same op with equal attributes.
#[derive(Clone)]
pub struct CustomCall {
    pub op: Arc<Signature>,
    pub attrs: Arc<Attrs>,
}

impl CustomCall {
    /// A call of the registered op `name` with `attrs`.
    pub fn new(name: &str, attrs: Attrs) -> Result<CustomCall> {
        Ok(CustomCall {
            op: lookup(name)?,
            attrs: Arc::new(attrs),
        })
    }

    pub fn name(&self) -> &str {
        &self.op.name
    }

    /// The attributes as compact JSON (the text form and cache keys use it).
    pub fn attrs_json(&self) -> String {
        serde_json::Value::Object((*self.attrs).clone()).to_string()
    }

    pub fn infer(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>> {
        self.op.infer(&self.attrs, inputs)
    }
}

impl PartialEq for CustomCall {
    fn eq(&self, other: &CustomCall) -> bool {
        self.op.name == other.op.name && self.attrs == other.attrs
    }
}

impl fmt::Debug for CustomCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.op.name, self.attrs_json())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DType;

    fn identity(_: &Attrs, inputs: &[TensorType]) -> Result<Vec<TensorType>> {
        Ok(inputs.to_vec())
    }

    #[test]
    fn builtins_are_registered_from_the_start() {
        for name in [flash_attention::FORWARD, flash_attention::BACKWARD] {
            assert_eq!(lookup(name).unwrap().name(), name);
        }
    }

    #[test]
    fn names_are_checked_and_registered_once() {
        for bad in ["plain", "ns::", "::op", "ns::1op", "ns::a-b", "a::b::c"] {
            let err = Signature::new(bad, Arc::new(identity)).unwrap_err();
            assert!(err.to_string().contains("namespace::name"), "{bad}: {err}");
        }
        let sig = || Signature::new("ir_custom_test::twice", Arc::new(identity)).unwrap();
        register(sig()).unwrap();
        let err = register(sig()).unwrap_err();
        assert!(err.to_string().contains("already registered"), "{err}");
        let err = lookup("ir_custom_test::missing").unwrap_err();
        assert!(err.to_string().contains("no custom op"), "{err}");
    }

    #[test]
    fn infer_names_the_op_and_wants_an_output() {
        let none: Arc<ShapeFn> = Arc::new(|_, _| Ok(vec![]));
        let sig = Signature::new("ir_custom_test::none", none).unwrap();
        let err = sig.infer(&Attrs::new(), &[]).unwrap_err();
        assert_eq!(err.op.as_deref(), Some("ir_custom_test::none"));
        assert!(err.to_string().contains("no outputs"), "{err}");
        let x = TensorType::new(DType::F32, vec![2usize, 3]);
        let sig = Signature::new("ir_custom_test::same", Arc::new(identity)).unwrap();
        let types = sig.infer(&Attrs::new(), std::slice::from_ref(&x)).unwrap();
        assert_eq!(types, vec![x]);
    }

    #[test]
    fn calls_compare_by_name_and_attributes() {
        let mut attrs = flash_attention::attrs(true, 0.5);
        let a = CustomCall::new(flash_attention::FORWARD, attrs.clone()).unwrap();
        let b = CustomCall::new(flash_attention::FORWARD, attrs.clone()).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.attrs_json(), r#"{"causal":true,"scale":0.5}"#);
        attrs.insert("causal".into(), false.into());
        assert_ne!(a, CustomCall::new(flash_attention::FORWARD, attrs).unwrap());
        let err = CustomCall::new("ir_custom_test::unknown", Attrs::new()).unwrap_err();
        assert!(err.to_string().contains("no custom op"), "{err}");
    }
}
