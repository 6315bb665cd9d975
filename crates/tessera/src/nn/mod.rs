//! Neural-network modules, parameters and losses, written with plain
//! `Tensor` ops so the autograd differentiates them.
//!
//! # Conventions
//!
//! - A module is a struct built by `new(store, name, …, generator)`: it
//!   registers its parameters in a [`ParamStore`] under `name.<param>`
//!   (`blocks.0.attn.q.weight`) and keeps [`Parameter`] handles to them.
//!   Constructors panic on a bad configuration (a duplicate parameter name,
//!   `d_model` not divisible by `n_heads`): those are programming errors.
//! - `forward` panics on bad input with the same message `try_forward`
//!   returns; messages name the module, its name in the store and the shapes.
//! - Parameters take the store's dtype ([`ParamStore::with_dtype`]; f32 by
//!   default). Initialisation follows PyTorch's defaults.
//! - Randomness is explicit: modules that need it (dropout) own a
//!   [`Generator`](crate::tensor::Generator) seeded from the one passed to
//!   their constructor, so a model built from the same seed replays exactly.
//!
//! # A training step
//!
//! ```
//! use tessera::nn::{cross_entropy, ParamStore, TransformerConfig, TransformerLM};
//! use tessera::optim::{clip_grad_norm, AdamW, AdamWConfig, Optimizer};
//! use tessera::tensor::Generator;
//! use tessera::{DType, Tensor};
//!
//! let config = TransformerConfig {
//!     vocab: 16, d_model: 32, n_heads: 4, n_layers: 1, d_ff: 64, max_len: 8, dropout: 0.1,
//! };
//! let mut g = Generator::new(0);
//! let mut store = ParamStore::new();
//! let model = TransformerLM::new(&mut store, "", config, &mut g);
//! let mut opt = AdamW::new(store.parameters(), AdamWConfig { lr: 3e-3, ..Default::default() });
//! let ids = Tensor::from_vec(vec![1i64, 2, 3, 4, 5, 6, 7, 8], &[1, 8]);
//! let inputs = ids.narrow(1, 0, 7);
//! let targets = ids.narrow(1, 1, 7).reshape(&[-1]);
//!
//! opt.zero_grad();
//! let logits = model.forward(&inputs, true); // [1, 7, 16]
//! let loss = cross_entropy(&logits.reshape(&[-1, 16]), &targets, None);
//! loss.backward();
//! clip_grad_norm(&store, 1.0);
//! opt.step();
//! ```

mod attention;
mod conv;
mod dropout;
mod embedding;
mod linear;
pub mod loss;
mod norm;
mod param;
mod resnet;
mod transformer;

pub use attention::MultiHeadAttention;
pub use conv::{AdaptiveAvgPool2d, AvgPool2d, BatchNorm2d, Conv1d, Conv2d, MaxPool2d};
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use linear::Linear;
pub use loss::{cross_entropy, mse, try_cross_entropy, try_mse};
pub use norm::{LayerNorm, RMSNorm};
pub use param::{join_name, ParamStore, Parameter};
pub use resnet::{Block, ResNet, ResNetConfig};
pub use transformer::{Mlp, TransformerBlock, TransformerConfig, TransformerLM};

use crate::error::{Error, ErrorKind};

/// An error about the input of module `kind` registered as `name`:
/// `Linear \`fc1\`: input f32[2,3] must end in 4 features (weight f32[4,8])`.
fn input_error(kind: &str, name: &str, message: String) -> Error {
    Error::op(ErrorKind::Shape, module_label(kind, name), message)
}

/// Adds the module to an error raised by one of its ops, so a failure deep
/// in a model still says which layer it came from.
fn within(mut e: Error, kind: &str, name: &str) -> Error {
    e.message = format!("{} (in {})", e.message, module_label(kind, name));
    e
}

/// `Linear \`fc1\``, or just the kind for a root module (empty name).
fn module_label(kind: &str, name: &str) -> String {
    if name.is_empty() {
        kind.to_string()
    } else {
        format!("{kind} `{name}`")
    }
}
