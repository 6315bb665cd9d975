//! A decoder-only transformer language model (GPT-style, pre-norm).

use super::{
    input_error, join_name, within, Dropout, Embedding, LayerNorm, Linear, MultiHeadAttention,
    ParamStore,
};
use crate::error::{Result, SourceLoc};
use crate::tensor::{unwrap_or_panic, Generator, Tensor};

/// The LayerNorm epsilon of every norm in the model (PyTorch's default).
const LN_EPS: f64 = 1e-5;

/// `Linear(d_model, d_ff) → gelu (erf) → Linear(d_ff, d_model)`.
pub struct Mlp {
    pub fc1: Linear,
    pub fc2: Linear,
}

impl Mlp {
    /// Registers `name.fc1` and `name.fc2` (both biased).
    #[track_caller]
    pub fn new(
        store: &mut ParamStore,
        name: &str,
        d_model: usize,
        d_ff: usize,
        generator: &mut Generator,
    ) -> Mlp {
        Mlp {
            fc1: Linear::new(
                store,
                &join_name(name, "fc1"),
                d_model,
                d_ff,
                true,
                generator,
            ),
            fc2: Linear::new(
                store,
                &join_name(name, "fc2"),
                d_ff,
                d_model,
                true,
                generator,
            ),
        }
    }

    /// `x [..., d_model]` → the same shape.
    #[track_caller]
    pub fn forward(&self, x: &Tensor) -> Tensor {
        unwrap_or_panic(self.try_forward(x))
    }

    /// [`Mlp::forward`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        let hidden = self.fc1.try_forward(x)?;
        self.fc2.try_forward(&hidden.try_gelu()?)
    }
}

/// A pre-norm block: `x + drop(attn(ln1(x)))`, then `x + drop(mlp(ln2(x)))`.
/// Dropout is on the two residual branches (as GPT-2), not on the
/// attention weights.
pub struct TransformerBlock {
    pub ln1: LayerNorm,
    pub attn: MultiHeadAttention,
    pub ln2: LayerNorm,
    pub mlp: Mlp,
    drop: Dropout,
}

impl TransformerBlock {
    /// Registers `name.{ln1,attn,ln2,mlp}`; the attention is causal.
    #[track_caller]
    pub fn new(
        store: &mut ParamStore,
        name: &str,
        config: &TransformerConfig,
        generator: &mut Generator,
    ) -> TransformerBlock {
        let d = config.d_model;
        TransformerBlock {
            ln1: LayerNorm::new(store, &join_name(name, "ln1"), d, LN_EPS, true),
            attn: MultiHeadAttention::new(
                store,
                &join_name(name, "attn"),
                d,
                config.n_heads,
                true,
                generator,
            ),
            ln2: LayerNorm::new(store, &join_name(name, "ln2"), d, LN_EPS, true),
            mlp: Mlp::new(store, &join_name(name, "mlp"), d, config.d_ff, generator),
            drop: Dropout::new(config.dropout, generator),
        }
    }

    /// `x [B, T, d_model]` → the same shape; `train` turns dropout on.
    #[track_caller]
    pub fn forward(&self, x: &Tensor, train: bool) -> Tensor {
        unwrap_or_panic(self.try_forward(x, train))
    }

    /// [`TransformerBlock::forward`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let attended = self.attn.try_forward(&self.ln1.try_forward(x)?)?;
        let x = x.try_add(self.drop.forward(&attended, train))?;
        let transformed = self.mlp.try_forward(&self.ln2.try_forward(&x)?)?;
        x.try_add(self.drop.forward(&transformed, train))
    }
}

/// The shape of a [`TransformerLM`].
#[derive(Clone, Debug, PartialEq)]
pub struct TransformerConfig {
    pub vocab: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_layers: usize,
    /// The hidden width of each block's MLP (commonly `4 * d_model`).
    pub d_ff: usize,
    /// The longest sequence (the number of learned positions).
    pub max_len: usize,
    /// The dropout probability on embeddings and residual branches.
    pub dropout: f64,
}

/// A decoder-only language model: token + learned position embeddings,
/// `n_layers` causal [`TransformerBlock`]s, a final LayerNorm and an output
/// head without bias (`ids [B, T]` → logits `[B, T, vocab]`).
///
/// Parameter names under `name`: `tok_emb.weight`, `pos_emb.weight`,
/// `blocks.{i}.…`, `ln_f.{weight,bias}`, `head.weight`. Every module keeps
/// PyTorch's default initialisation.
pub struct TransformerLM {
    pub config: TransformerConfig,
    name: String,
    pub tok_emb: Embedding,
    pub pos_emb: Embedding,
    pub blocks: Vec<TransformerBlock>,
    pub ln_f: LayerNorm,
    pub head: Linear,
    drop: Dropout,
}

impl TransformerLM {
    /// Panics on an inconsistent config (`n_heads` not dividing `d_model`,
    /// a dropout outside `[0, 1]`).
    #[track_caller]
    pub fn new(
        store: &mut ParamStore,
        name: &str,
        config: TransformerConfig,
        generator: &mut Generator,
    ) -> TransformerLM {
        let c = &config;
        let tok_emb = Embedding::new(
            store,
            &join_name(name, "tok_emb"),
            c.vocab,
            c.d_model,
            generator,
        );
        let pos_emb = Embedding::new(
            store,
            &join_name(name, "pos_emb"),
            c.max_len,
            c.d_model,
            generator,
        );
        let drop = Dropout::new(c.dropout, generator);
        let blocks = (0..c.n_layers)
            .map(|i| {
                let block = join_name(name, &format!("blocks.{i}"));
                TransformerBlock::new(store, &block, c, generator)
            })
            .collect();
        let ln_f = LayerNorm::new(store, &join_name(name, "ln_f"), c.d_model, LN_EPS, true);
        let head = Linear::new(
            store,
            &join_name(name, "head"),
            c.d_model,
            c.vocab,
            false,
            generator,
        );
        TransformerLM {
            config,
            name: name.to_string(),
            tok_emb,
            pos_emb,
            blocks,
            ln_f,
            head,
            drop,
        }
    }

    /// `ids` (i64/i32 `[B, T]`, `T <= max_len`) → logits `[B, T, vocab]`;
    /// `train` turns dropout on.
    #[track_caller]
    pub fn forward(&self, ids: &Tensor, train: bool) -> Tensor {
        unwrap_or_panic(self.try_forward(ids, train))
    }

    /// [`TransformerLM::forward`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_forward(&self, ids: &Tensor, train: bool) -> Result<Tensor> {
        let shape_ok = ids.rank() == 2 && (1..=self.config.max_len).contains(&ids.shape()[1]);
        if !ids.dtype().is_int() || !shape_ok {
            return Err(input_error(
                "TransformerLM",
                &self.name,
                format!(
                    "ids {} must be i64/i32 [batch, seq] with 1 <= seq <= max_len {}",
                    ids.ty(),
                    self.config.max_len
                ),
            )
            .at(SourceLoc::caller()));
        }
        self.run(ids, train)
            .map_err(|e| within(e, "TransformerLM", &self.name))
    }

    fn run(&self, ids: &Tensor, train: bool) -> Result<Tensor> {
        let t = ids.shape()[1];
        // Positions 0..t are the first t rows of the position table: a view,
        // broadcast over the batch.
        let positions = self.pos_emb.weight.get().try_narrow(0, 0, t)?;
        let x = self.tok_emb.try_forward(ids)?.try_add(&positions)?;
        let mut x = self.drop.forward(&x, train);
        for block in &self.blocks {
            x = block.try_forward(&x, train)?;
        }
        self.head.try_forward(&self.ln_f.try_forward(&x)?)
    }
}
