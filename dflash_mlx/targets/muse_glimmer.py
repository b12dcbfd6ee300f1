"""Muse Glimmer: mlx-lm's ``muse_glimmer`` (its text model; the target of the
Muse-Glimmer-30B DFlash 2 drafter).

A dense loop with three differences, all inside or around mlx-lm's layers:
[local, local, local, global] attention (the sliding layers keep a plain
buffer each, the window in the mask; the global layers use no RoPE, inside
mlx-lm's module), token embeddings passed through a scaleless RMSNorm before
the first layer, and logits multiplied by ``output_multiplier`` then soft-capped.

What the drafter shares is the raw embedding table and the raw output head,
as Z Lab's reference feeds its drafters (their own config carries the output
multiplier and softcap, applied by the drafter): so ``embed`` and ``lm_head``
are the raw ones, and the target's own forward adds the norm, the multiplier
and the cap."""

import mlx.core as mx

from .base import DenseTarget


class MuseGlimmerTarget(DenseTarget):
    family = "muse_glimmer"

    def __init__(self, model):
        super().__init__(model)
        args = self.text.args
        self.tied = bool(args.tie_word_embeddings)
        self.multiplier, self.softcap = args.output_multiplier, args.final_logit_softcapping

    def windows(self):
        return [self.inner.window if layer.self_attn.is_sliding else None for layer in self.inner.layers]

    def first_input(self, tokens: mx.array) -> mx.array:
        return mx.fast.rms_norm(self.embed(tokens), None, self.inner.embed_eps)

    def logits(self, h: mx.array) -> mx.array:
        logits = self.lm_head(h) * self.multiplier
        return mx.tanh(logits / self.softcap) * self.softcap
