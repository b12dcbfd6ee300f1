"""Samplers and the lossless acceptance rules, all computed on the device.

The target's own distribution is mlx-lm's: log-softmax of the logits, then
top-p (on the temperature-1 distribution), then top-k, then softmax of the
result divided by the temperature (mlx_lm.sample_utils.make_sampler).

Proposals are the drafter's argmax, i.e. a one-hot draft distribution q, so
speculative rejection sampling reduces to: accept draft d with probability
p(d); on the first rejection draw from p with d removed, renormalised; when
every draft is accepted draw the bonus token from p at the last position.
Every committed token is then distributed exactly as the target samples it.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}.")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    if top_k < 0 or int(top_k) != top_k:
        raise ValueError(f"top_k must be a non-negative integer (0 disables it), got {top_k}.")


def target_logprobs(logits: mx.array, temperature: float, top_p: float = 1.0, top_k: int = 0) -> mx.array:
    """Unnormalised log-probabilities of the target's sampling distribution
    (rows of ``logits``), with filtered tokens at -inf. temperature > 0."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < top_p < 1:
        logprobs = apply_top_p(logprobs, top_p)
    if 0 < top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, int(top_k))
    return logprobs * (1.0 / temperature)


def sample(logits: mx.array, temperature: float, top_p: float, top_k: int, key: mx.array | None) -> mx.array:
    """One token per row of ``logits``: argmax at temperature 0, else a draw
    from the target's distribution."""
    if temperature == 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(target_logprobs(logits, temperature, top_p, top_k), key=key)


def accept_greedy(drafts: mx.array, logits: mx.array) -> mx.array:
    """drafts: [bs-1] proposals; logits: [bs, V] the target's verify logits
    (row i predicts the token after input i). Returns [1 + bs]: the number of
    accepted drafts a, then the target's tokens, whose first a+1 are committed
    (equal to the drafts where accepted, then the target's correction/bonus)."""
    target = mx.argmax(logits, axis=-1).astype(mx.int32)
    accepted = mx.sum(mx.cumprod((drafts == target[:-1]).astype(mx.int32)))
    return mx.concatenate([accepted[None], target])


def accept_sampled(
    drafts: mx.array,
    logits: mx.array,
    temperature: float,
    top_p: float,
    top_k: int,
    key: mx.array,
) -> mx.array:
    """Speculative rejection sampling for one-hot (argmax) proposals. Same
    inputs and output layout as ``accept_greedy``."""
    bs, vocab = logits.shape
    logprobs = target_logprobs(logits, temperature, top_p, top_k)
    probs = mx.softmax(logprobs, axis=-1)
    p_draft = mx.take_along_axis(probs[:-1], drafts[:, None], axis=-1)[:, 0]
    k_accept, k_resample = mx.random.split(key)
    keep = mx.random.uniform(shape=(bs - 1,), key=k_accept) < p_draft
    accepted = mx.sum(mx.cumprod(keep.astype(mx.int32)))
    # Row i < bs-1: the residual max(p - onehot(d), 0), i.e. p without d.
    # Row bs-1: p itself, for the bonus token when every draft is accepted.
    is_draft = mx.concatenate([drafts, mx.array([-1], drafts.dtype)])[:, None] == mx.arange(vocab)[None]
    residual = mx.where(is_draft, -mx.inf, logprobs)
    corrections = mx.random.categorical(residual, key=k_resample).astype(mx.int32)
    position = mx.arange(bs)
    padded = mx.concatenate([drafts.astype(mx.int32), mx.array([0], mx.int32)])
    tokens = mx.where(position < accepted, padded, corrections)
    return mx.concatenate([accepted[None], tokens])
