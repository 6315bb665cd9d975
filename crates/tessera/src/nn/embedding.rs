//! `Embedding`: a learned table of vectors looked up by id.

use super::{input_error, join_name, within, ParamStore, Parameter};
use crate::error::{Result, SourceLoc};
use crate::tensor::{unwrap_or_panic, Generator, Tensor};

/// A `[num_embeddings, dim]` table; `forward(ids)` returns its rows.
pub struct Embedding {
    name: String,
    pub weight: Parameter,
}

impl Embedding {
    /// Registers `name.weight`, drawn from N(0, 1) as PyTorch does.
    #[track_caller]
    pub fn new(
        store: &mut ParamStore,
        name: &str,
        num_embeddings: usize,
        dim: usize,
        generator: &mut Generator,
    ) -> Embedding {
        let shape = [num_embeddings, dim];
        let weight = store.normal(&join_name(name, "weight"), &shape, 1.0, generator);
        Embedding {
            name: name.to_string(),
            weight,
        }
    }

    /// `ids` (i64/i32, any shape) → `ids.shape + [dim]`.
    #[track_caller]
    pub fn forward(&self, ids: &Tensor) -> Tensor {
        unwrap_or_panic(self.try_forward(ids))
    }

    /// [`Embedding::forward`], returning the error instead of panicking
    /// (also for an id outside the table).
    #[track_caller]
    pub fn try_forward(&self, ids: &Tensor) -> Result<Tensor> {
        if !ids.dtype().is_int() {
            return Err(input_error(
                "Embedding",
                &self.name,
                format!("ids must be i64 or i32, got {}", ids.ty()),
            )
            .at(SourceLoc::caller()));
        }
        self.lookup(ids)
            .map_err(|e| within(e, "Embedding", &self.name))
    }

    fn lookup(&self, ids: &Tensor) -> Result<Tensor> {
        self.weight.get().try_embedding(ids)
    }
}
