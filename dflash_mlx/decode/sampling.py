"""The target's sampling and the lossless acceptance rules, on the device.

The target's distribution is mlx-lm's: log-softmax of the logits, then top-p
(on the temperature-1 distribution), then min-p, then top-k, then softmax of
the result divided by the temperature (mlx_lm.sample_utils.make_sampler).

Sampling uses the Gumbel-max trick with noise fixed by (seed, position): the
token at absolute position t is

    argmax_v  logprobs_t(v) / temperature + g(seed, t, v),

g standard Gumbel noise from a counter-based hash, so the same seed gives the
same noise at the same position however the positions are grouped into
blocks. For the drafter's argmax proposals the acceptance rule is then the
greedy one: a draft is accepted when it equals the target's token at its
position. This accepts d with probability p(d) and, on rejection, emits a
token distributed as p without d, which is speculative rejection sampling for
a one-hot proposal, and it makes a seeded run's text the same at every block
size and the same as the target sampling alone with that noise. Nothing the
loop commits depends on the noise of a later position, so every committed
token follows the target's distribution given the tokens before it.

``accept_proposals`` keeps the general rule, min(1, p/q), for drafters that
propose from a distribution q.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..device import constant_arange


@dataclass(frozen=True)
class SamplingParams:
    """The target's sampling: its argmax at temperature 0, else mlx-lm's
    filters (top-p, min-p, top-k, in that order) at ``temperature``."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


def target_logprobs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Unnormalised log-probabilities of the target's sampling distribution
    (rows of ``logits``), with filtered tokens at -inf. temperature > 0."""
    temperature, top_p, top_k, min_p = params.temperature, params.top_p, params.top_k, params.min_p
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < top_p < 1:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p > 0:
        logprobs = apply_min_p(logprobs, min_p)
    if 0 < top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, int(top_k))
    return logprobs * (1.0 / temperature)


def _mix(h: mx.array) -> mx.array:
    """MurmurHash3's 32-bit finaliser: a bijection that mixes every bit."""
    h = h ^ (h >> 16)
    h = h * mx.array(0x85EBCA6B, mx.uint32)
    h = h ^ (h >> 13)
    h = h * mx.array(0xC2B2AE35, mx.uint32)
    return h ^ (h >> 16)


def seed_words(seed: int) -> mx.array:
    """Any integer seed as two 32-bit words (folded modulo 2**64)."""
    seed %= 1 << 64
    return mx.array([seed & 0xFFFFFFFF, seed >> 32], mx.uint32)


def _word(seed: mx.array, i: int) -> mx.array:
    """``seed[i]`` as a view: an int index is a gather, a kernel launch a use on a GPU."""
    return seed[i : i + 1].squeeze(0)


def gumbel_noise(seed: mx.array, positions: mx.array, vocab: int) -> mx.array:
    """Standard Gumbel noise [R, vocab] for the tokens at ``positions`` [R]
    (int32), fixed by ``seed`` (from ``seed_words``) and the position alone."""
    pos = positions.astype(mx.uint32)[:, None]
    row = _mix(_mix(pos ^ _word(seed, 0)) + _word(seed, 1))
    col = constant_arange(vocab, mx.uint32)[None] * mx.array(0x9E3779B9, mx.uint32)
    bits = _mix(_mix(row ^ col) + mx.array(0x632BE5AB, mx.uint32))
    u = ((bits >> 9).astype(mx.float32) + 0.5) * (1.0 / (1 << 23))
    return -mx.log(-mx.log(u))


def position_key(seed: mx.array, position: mx.array) -> mx.array:
    """A key for mx.random (uint32 [2]) fixed by ``seed`` and a position
    that may live on the device: for draws that belong to a cycle rather
    than to a token (a drafter that samples its proposals)."""
    pos = position.astype(mx.uint32)
    return mx.stack([_mix(_word(seed, 0) ^ _mix(pos)), _mix(_word(seed, 1) + pos * mx.array(0x9E3779B9, mx.uint32))])


def pick(logits: mx.array, positions: mx.array, params: SamplingParams, seed: mx.array | None) -> mx.array:
    """The target's token at each of ``positions`` from its logits rows
    [R, V]: the argmax at temperature 0, else its seeded Gumbel-max sample."""
    if params.temperature == 0:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    scores = target_logprobs(logits, params) + gumbel_noise(seed, positions, logits.shape[-1])
    return mx.argmax(scores, axis=-1).astype(mx.int32)


def accepted_count(drafts: mx.array, tokens: mx.array) -> mx.array:
    """How many leading drafts [bs-1] equal the target's tokens at their
    positions (``tokens`` [bs]: row i is the target's token after input i)."""
    return mx.sum(mx.cumprod((drafts == tokens[: drafts.shape[0]]).astype(mx.int32)))


def accept_proposals(
    drafts: mx.array, q: mx.array, logits: mx.array, params: SamplingParams, key: mx.array
) -> mx.array:
    """Speculative rejection sampling for drafts [bs-1] drawn from proposal
    distributions q [bs-1, V]: accept d_i with probability min(1, p(d_i) /
    q(d_i)); at the first rejection draw from normalize(max(p - q, 0)); if
    all are accepted draw a bonus token from p at the last row. logits:
    [bs, V] the target's verify logits. Returns [1 + bs]: the number a of
    accepted drafts, then tokens whose first a + 1 are committed."""
    bs = logits.shape[0]
    logprobs = target_logprobs(logits, params)
    p = mx.softmax(logprobs, axis=-1)
    p_d = mx.take_along_axis(p[:-1], drafts[:, None], axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, drafts[:, None], axis=-1)[:, 0]
    k_accept, k_resample = mx.random.split(key)
    keep = mx.random.uniform(shape=(bs - 1,), key=k_accept) * q_d < p_d
    accepted = mx.sum(mx.cumprod(keep.astype(mx.int32)))
    residual = mx.concatenate([mx.maximum(p[:-1] - q, 0.0), p[-1:]], axis=0)
    corrections = mx.random.categorical(mx.log(residual), key=k_resample).astype(mx.int32)
    padded = mx.concatenate([drafts.astype(mx.int32), mx.array([0], mx.int32)])
    tokens = mx.where(constant_arange(bs) < accepted, padded, corrections)
    return mx.concatenate([accepted[None], tokens])
