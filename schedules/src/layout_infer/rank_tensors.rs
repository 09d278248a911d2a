//! Every tensor of one inference rank, in the engine's order: the embedding, the decoder layers
//! ([`LayerTensors`]), the final norm, the lm_head.
//!
//! Why its own file: the walk is the one place that knows both the rank builder's vocabulary
//! (`rank`) and a decoder layer (`layer`, which itself builds on `rank`); kept apart, each of
//! those imports only downward.

use super::EmbedLayout;
use super::layer::LayerTensors;
use super::rank::{RankBuilder, part};
use crate::error::PlanError;
use crate::model::Role;
use crate::table::TensorBox;

impl RankBuilder<'_> {
    /// Every tensor of the rank, in the engine's order: embedding, decoder layers, final norm,
    /// lm_head.
    pub(super) fn build_rank(&mut self) -> Result<(), PlanError> {
        let model = self.model;
        let c = &model.config;
        let h = c.hidden;
        let emb = self.param(Role::Embed);
        // transformers' tp plan leaves the embedding whole; engines split it by vocab.
        let (bx, n) = if self.hf() && self.spec.embed != EmbedLayout::Vocab {
            (TensorBox::full(self.shape(emb)), c.vocab)
        } else {
            self.vocab_rows(emb)
        };
        if n > 0 {
            self.add(
                "model.embed_tokens.weight".into(),
                &[n, h],
                false,
                vec![part(emb, bx, &[0, 0])],
            )?;
        }
        for l in 0..c.layers {
            let mut layer = LayerTensors {
                pre: format!("model.layers.{l}."),
                l,
                b: self,
            };
            layer.build()?;
        }
        let norm = self.param(Role::FinalNorm);
        self.add(
            "model.norm.weight".into(),
            &[h],
            false,
            vec![part(norm, TensorBox::full(self.shape(norm)), &[0])],
        )?;
        if let Some(&lm) = self.index.get(&Role::LmHead) {
            let (bx, n) = self.vocab_rows(lm);
            if n > 0 {
                self.add(
                    "lm_head.weight".into(),
                    &[n, h],
                    false,
                    vec![part(lm, bx, &[0, 0])],
                )?;
            }
        }
        Ok(())
    }
}
