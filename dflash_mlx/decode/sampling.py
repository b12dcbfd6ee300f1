"""The target's sampling and the lossless acceptance rules, on the device.

The distribution is mlx-lm's (make_sampler's top-p, min-p, XTC, top-k, then
the temperature). A sampled token is the Gumbel-max argmax of
logprobs_t(v) / temperature + g(seed, t, v), the noise fixed by seed and
absolute position t: a draft equal to the target's token is accepted, which
is rejection sampling for a one-hot proposal, so a seeded run's text is the
same at every block size. XTC's coin is fixed the same way, by seed and
position, so it holds with XTC too. ``accept_proposals`` keeps the general rule,
min(1, p/q), for drafters that propose from a distribution q.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..device import constant_arange


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    min_tokens_to_keep: int = 1
    xtc_special_tokens: tuple[int, ...] = ()


def apply_xtc(logprobs: mx.array, coins: mx.array, params: SamplingParams) -> mx.array:
    """mlx-lm's apply_xtc with the coin given per row: where ``coins`` [R] <=
    xtc_probability, every token above xtc_threshold but the least likely of
    them goes to -inf (none unless two are above); special tokens stay."""
    probs = mx.softmax(logprobs, axis=-1)
    least = mx.where(probs > params.xtc_threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    mask = probs > least
    if params.xtc_special_tokens:
        mask[..., list(params.xtc_special_tokens)] = False
    apply = (coins <= params.xtc_probability)[..., None]
    return mx.where(apply & mask, -mx.inf, logprobs)


def target_logprobs(logits: mx.array, params: SamplingParams, coins: mx.array | None = None) -> mx.array:
    """Unnormalised log-probabilities of the target's sampling distribution,
    filtered tokens at -inf; temperature > 0. ``coins`` [R] are the rows' XTC
    coins (``xtc_coins``), needed when xtc_probability > 0."""
    temperature, top_p, top_k, min_p = params.temperature, params.top_p, params.top_k, params.min_p
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < top_p < 1:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p > 0:
        logprobs = apply_min_p(logprobs, min_p, int(params.min_tokens_to_keep))
    if params.xtc_probability > 0:
        if coins is None:
            raise ValueError("XTC needs the rows' coins; pass coins=xtc_coins(seed, positions).")
        logprobs = apply_xtc(logprobs, coins, params)
    if 0 < top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, int(top_k))
    return logprobs * (1.0 / temperature)


def _mix(h: mx.array) -> mx.array:
    """MurmurHash3's 32-bit finaliser."""
    h = h ^ (h >> 16)
    h = h * mx.array(0x85EBCA6B, mx.uint32)
    h = h ^ (h >> 13)
    h = h * mx.array(0xC2B2AE35, mx.uint32)
    return h ^ (h >> 16)


def seed_words(seed: int) -> mx.array:
    seed %= 1 << 64
    return mx.array([seed & 0xFFFFFFFF, seed >> 32], mx.uint32)


def _word(seed: mx.array, i: int) -> mx.array:
    """``seed[i]`` as a view: an int index is a gather."""
    return seed[i : i + 1].squeeze(0)


def _row_hash(seed: mx.array, positions: mx.array) -> mx.array:
    """A 32-bit hash of ``seed`` and each position (same shape as ``positions``)."""
    return _mix(_mix(positions.astype(mx.uint32) ^ _word(seed, 0)) + _word(seed, 1))


def _uniform(bits: mx.array) -> mx.array:
    """Uniform floats in (0, 1) from the top 23 bits of ``bits``."""
    return ((bits >> 9).astype(mx.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel_noise(seed: mx.array, positions: mx.array, vocab: int) -> mx.array:
    """Gumbel noise [R, vocab] fixed by ``seed`` and ``positions`` [R] alone."""
    row = _row_hash(seed, positions[:, None])
    col = constant_arange(vocab, mx.uint32)[None] * mx.array(0x9E3779B9, mx.uint32)
    bits = _mix(_mix(row ^ col) + mx.array(0x632BE5AB, mx.uint32))
    return -mx.log(-mx.log(_uniform(bits)))


def xtc_coins(seed: mx.array, positions: mx.array) -> mx.array:
    """XTC's coin in (0, 1) for each of ``positions`` [R], fixed by ``seed``
    and position alone: a stream of its own, apart from gumbel_noise's."""
    row = _row_hash(seed, positions)
    return _uniform(_mix(_mix(row ^ mx.array(0x2545F491, mx.uint32)) + mx.array(0x6A09E667, mx.uint32)))


def position_key(seed: mx.array, position: mx.array) -> mx.array:
    """An mx.random key fixed by ``seed`` and a device-side position."""
    pos = position.astype(mx.uint32)
    return mx.stack([_mix(_word(seed, 0) ^ _mix(pos)), _mix(_word(seed, 1) + pos * mx.array(0x9E3779B9, mx.uint32))])


def greedy(logits: mx.array) -> mx.array:
    """The greedy token of each logits row as mlx-lm's step picks it: the
    argmax of the log-probabilities in the logits' dtype, where rounding ties
    tokens a fraction of a logit apart and the lowest id wins."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.argmax(logprobs, axis=-1).astype(mx.int32)


def pick(logits: mx.array, positions: mx.array, params: SamplingParams, seed: mx.array | None) -> mx.array:
    """The target's token for each logits row: argmax, or the seeded sample."""
    if params.temperature == 0:
        return greedy(logits)
    coins = xtc_coins(seed, positions) if params.xtc_probability > 0 else None
    scores = target_logprobs(logits, params, coins) + gumbel_noise(seed, positions, logits.shape[-1])
    return mx.argmax(scores, axis=-1).astype(mx.int32)


def accepted_count(drafts: mx.array, tokens: mx.array) -> mx.array:
    """How many leading drafts [bs-1] equal the target's ``tokens`` [bs]."""
    return mx.sum(mx.cumprod((drafts == tokens[: drafts.shape[0]]).astype(mx.int32)))


def accept_proposals(
    drafts: mx.array, q: mx.array, logits: mx.array, params: SamplingParams, key: mx.array
) -> mx.array:
    """Speculative rejection sampling of drafts [bs-1] drawn from q [bs-1, V]:
    accept with min(1, p/q), at the first rejection draw from max(p - q, 0).
    Returns [1 + bs]: accepted a, then tokens whose first a + 1 are committed."""
    bs = logits.shape[0]
    coins = None
    if params.xtc_probability > 0:  # split only then, so the keys without XTC stay as they are
        key, k_xtc = mx.random.split(key)
        coins = mx.random.uniform(shape=(bs,), key=k_xtc)
    logprobs = target_logprobs(logits, params, coins)
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
