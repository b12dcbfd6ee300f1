"""The DFlash decode loop: prefill, draft, verify, accept, roll back.

One host round trip per cycle: the drafter's proposals feed the verify pass on
the device, acceptance is computed there too, and a single small array (the
accepted count and the target's tokens) comes back. While the caller handles
a response, the next cycle is already running.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .block_size import BlockChooser
from .draft import DFlashDraft
from .stable_cache import stable_shapes_by_default
from .sampling import accept_greedy, accept_sampled, check_sampling, sample
from .targets import DenseTarget, adapt


@dataclass
class GenerationResponse:
    """One step of ``stream_generate``: the first token, then one verify cycle.

    text: the new text segment; tokens: ids committed by this response (an
    EOS id included, though its text is not); accepted: drafted tokens the
    target accepted this cycle (None for the first token); acceptance_length:
    mean tokens committed per cycle so far, bonus included; acceptance_rate:
    accepted / proposed drafts so far; peak_memory in GB; finish_reason:
    "stop" (EOS), "length" (max_tokens) or None.
    """

    text: str
    tokens: list[int]
    accepted: int | None
    block_size: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    acceptance_length: float
    acceptance_rate: float
    peak_memory: float
    finish_reason: str | None = None
    cycles: int = 0
    accepted_by_position: list[int] = field(default_factory=list)


class PromptCache:
    """Target and drafter caches that outlive one call, so a follow-up
    prompt that extends an earlier conversation re-reads only what is new.

    tokens: the ids whose keys/values the target cache holds, in order;
    pending: tapped target states of the tail of ``tokens`` that the drafter
    has not yet taken into its own cache."""

    def __init__(self, target: DenseTarget, draft: DFlashDraft, stable_shapes: bool | None = None):
        if stable_shapes is None:
            stable_shapes = stable_shapes_by_default()
        self.target = target.make_cache(stable_shapes)
        self.draft = draft.make_cache(stable_shapes)
        self.tokens: list[int] = []
        self.pending: mx.array | None = None

    @property
    def draft_len(self) -> int:
        return self.draft[0].offset

    def snapshot(self) -> tuple[int, int, mx.array | None, int]:
        return self.target[0].offset, self.draft_len, self.pending, len(self.tokens)

    def restore(self, snap) -> None:
        target_len, draft_len, pending, n_tokens = snap
        _trim(self.target, self.target[0].offset - target_len)
        _trim(self.draft, self.draft_len - draft_len)
        self.pending = pending
        del self.tokens[n_tokens:]

    def rewind(self, n: int) -> None:
        """Keep only the first ``n`` cached positions."""
        _trim(self.target, len(self.tokens) - n)
        if n <= self.draft_len:
            _trim(self.draft, self.draft_len - n)
            self.pending = None
        elif self.pending is not None:
            self.pending = self.pending[:, : n - self.draft_len]
        del self.tokens[n:]


def _trim(cache: list, n: int) -> None:
    if n > 0:
        for c in cache:
            c.trim(n)


def make_prompt_cache(model, draft: DFlashDraft, stable_shapes: bool | None = None) -> PromptCache:
    """A cache to pass to ``stream_generate`` across calls (multi-turn chat).

    stable_shapes: hand attention whole cache buffers (shapes fixed between
    growths, the unfilled tail masked); by default only on MLX's CUDA
    backend, where every new key length otherwise costs a graph rebuild."""
    target = adapt(model)
    draft.bind(target)
    return PromptCache(target, draft, stable_shapes)


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str | Sequence[int] | mx.array, vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        ids = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    else:
        ids = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
    if not ids:
        raise ValueError("the prompt is empty; give at least one token of text.")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"the prompt holds token ids outside the target's vocabulary [0, {vocab_size}).")
    return ids


def stream_generate(
    model,
    draft: DFlashDraft,
    tokenizer,
    prompt: str | Sequence[int] | mx.array,
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    block_size: int | None = None,
    seed: int | None = None,
    prompt_cache: PromptCache | None = None,
    prefill_step_size: int = 2048,
    prompt_progress: Callable[[int, int], None] | None = None,
) -> Iterator[GenerationResponse]:
    """Generate with DFlash, yielding a GenerationResponse for the first token
    and one per verify cycle. Output is exactly the target's own: its greedy
    decoding at temperature 0, its sampling distribution (mlx-lm's
    temperature, top-p, top-k) otherwise.

    prompt: a str (encoded as is, no chat template) or token ids.
    block_size: tokens per verify (last committed + block_size-1 drafts);
    defaults to the drafter's. "auto": chosen before every cycle between 4
    and the drafter's, from the acceptance and cycle times measured so far
    with this drafter (dflash_mlx/block_size.py; what is learned carries over
    to the next call in this process). Greedy output is the same whatever the
    block; a sampled one keeps its distribution, but with "auto" a seed no
    longer fixes the text. seed: makes a sampled run repeatable (fixed block size).
    prompt_cache: from ``make_prompt_cache``; pass the whole conversation as
    the prompt each time and only the part not already cached is prefilled.
    prompt_progress(done, total): called after each prefill chunk.
    """
    target = adapt(model)
    draft.bind(target)
    check_sampling(temperature, top_p, top_k)
    block_size = draft.config.block_size if block_size is None else block_size
    auto = block_size == "auto"
    if auto:
        block_size = draft.config.block_size
    if isinstance(block_size, str) or int(block_size) != block_size or block_size < 2:
        raise ValueError(f"block_size must be an integer >= 2 (one committed token plus drafts) or 'auto', got {block_size!r}.")
    if int(max_tokens) != max_tokens or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens}.")
    if prefill_step_size < 1:
        raise ValueError(f"prefill_step_size must be positive, got {prefill_step_size}.")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    ids = encode_prompt(tokenizer, prompt, target.vocab_size)
    if prompt_cache is None:
        prompt_cache = PromptCache(target, draft)
    if seed is None:
        seed = random.SystemRandom().getrandbits(63)
    loop = _Decoder(
        target, draft, tokenizer, prompt_cache,
        int(block_size), int(max_tokens), (temperature, top_p, int(top_k)), mx.random.key(seed),
        BlockChooser.for_draft(draft, min(4, int(block_size)), int(block_size)) if auto else None,
    )
    return loop.run(ids, prefill_step_size, prompt_progress)


def generate(model, draft: DFlashDraft, tokenizer, prompt, *, verbose: bool = False, **kwargs) -> str:
    """Like ``stream_generate`` (same arguments) but returns the whole text."""
    text, last = [], None
    for last in stream_generate(model, draft, tokenizer, prompt, **kwargs):
        text.append(last.text)
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print(
            f"\n{last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s, "
            f"acceptance length {last.acceptance_length:.2f}, "
            f"acceptance rate {last.acceptance_rate:.1%}, peak memory {last.peak_memory:.2f} GB"
        )
    return "".join(text)


class _Decoder:
    def __init__(self, target, draft, tokenizer, cache, block_size, max_tokens, sampling, key, chooser=None):
        self.target, self.draft, self.tokenizer, self.cache = target, draft, tokenizer, cache
        self.block_size, self.max_tokens = block_size, max_tokens
        self.chooser: BlockChooser | None = chooser
        self.temperature, self.top_p, self.top_k = sampling
        self.key = key
        self.taps = list(draft.config.target_layer_ids)
        self.mask_id = draft.config.mask_token_id
        self.eos = set(tokenizer.eos_token_ids)

    def _next_key(self) -> mx.array | None:
        if self.temperature == 0:
            return None
        self.key, sub = mx.random.split(self.key)
        return sub

    # -- prefill ------------------------------------------------------------
    def _prefill(self, ids: list[int], step: int, progress) -> mx.array:
        cache = self.cache
        reuse = 0
        for a, b in zip(cache.tokens, ids[:-1]):
            if a != b:
                break
            reuse += 1
        cache.rewind(reuse)
        new = ids[reuse:]
        logits = None
        for start in range(0, len(new), step):
            chunk = new[start : start + step]
            snap = cache.snapshot()
            try:
                logits, hidden = self.target(mx.array(chunk)[None], cache.target, self.taps, last_only=True)
                taps = hidden if cache.pending is None else mx.concatenate([cache.pending, hidden], axis=1)
                self.draft.extend(taps, cache.draft)
                cache.pending = None
                cache.tokens.extend(chunk)
                mx.eval(logits, [(c.keys, c.values) for c in cache.target + cache.draft])
            except BaseException:
                # Interrupted mid-chunk (Ctrl-C): keep the cache consistent.
                cache.restore(snap)
                raise
            if progress is not None:
                progress(start + len(chunk), len(new))
        return logits[0, -1]

    def _next_block(self) -> int:
        return self.chooser.choose() if self.chooser is not None else self.block_size

    # -- one cycle ------------------------------------------------------------
    def _launch(self, last: int, bs: int):
        """Queue draft + verify + acceptance for a block of ``bs``; returns the
        lazy result and the verify pass's tapped states."""
        cache = self.cache
        block = mx.array([[last] + [self.mask_id] * (bs - 1)])
        drafts = mx.argmax(self.draft(block, cache.pending, cache.draft)[0], axis=-1).astype(mx.int32)
        cache.pending = None
        verify = mx.concatenate([mx.array([last], mx.int32), drafts])[None]
        logits, hidden = self.target(verify, cache.target, self.taps)
        if self.temperature == 0:
            result = accept_greedy(drafts, logits[0])
        else:
            result = accept_sampled(drafts, logits[0], self.temperature, self.top_p, self.top_k, self._next_key())
        mx.async_eval(result, hidden)
        return result, hidden

    def run(self, ids: list[int], step: int, progress) -> Iterator[GenerationResponse]:
        with wired_limit(self.target.model, [generation_stream]):
            yield from self._run(ids, step, progress)

    def _run(self, ids, step, progress) -> Iterator[GenerationResponse]:
        cache, bs_max = self.cache, self.block_size
        detok = self.tokenizer.detokenizer
        tic = time.perf_counter()
        with mx.stream(generation_stream):
            last_logits = self._prefill(ids, step, progress)
            first = sample(last_logits, self.temperature, self.top_p, self.top_k, self._next_key())
        first = first.item()
        prompt_tps = len(ids) / max(time.perf_counter() - tic, 1e-9)
        tic = time.perf_counter()

        n, cycles, committed_in_cycles, accepted_total, proposed = 1, 0, 0, 0, 0
        by_position = [0] * (bs_max - 1)

        def response(text, tokens, accepted, bs, finish):
            return GenerationResponse(
                text=text,
                tokens=tokens,
                accepted=accepted,
                block_size=bs,
                prompt_tokens=len(ids),
                prompt_tps=prompt_tps,
                generation_tokens=n,
                generation_tps=n / max(time.perf_counter() - tic, 1e-9),
                acceptance_length=committed_in_cycles / cycles if cycles else 0.0,
                acceptance_rate=accepted_total / proposed if proposed else 0.0,
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish,
                cycles=cycles,
                accepted_by_position=list(by_position),
            )

        last = first
        if first in self.eos or self.max_tokens == 1:
            if first not in self.eos:
                detok.add_token(first)
            detok.finalize()
            yield response(detok.last_segment, [first], None, bs_max, "stop" if first in self.eos else "length")
            return
        detok.add_token(first)
        pending_response = response(detok.last_segment, [first], None, bs_max, None)

        snap = cache.snapshot()
        bs = min(self._next_block(), self.max_tokens - n + 1)
        started = time.perf_counter()
        with mx.stream(generation_stream):
            inflight = self._launch(last, bs)
        try:
            t = time.perf_counter()
            yield pending_response
            held = time.perf_counter() - t  # the caller's time, not the cycle's
            while inflight is not None:
                result, hidden = inflight
                values = result.tolist()
                seconds = max(time.perf_counter() - started - held, 0.0)
                accepted, proposals = values[0], values[1:]
                room = self.max_tokens - n
                new = proposals[: min(accepted + 1, room)]
                stop = next((i for i, t in enumerate(new) if t in self.eos), None)
                if stop is not None:
                    new = new[: stop + 1]
                k, cycle_bs = len(new), bs
                # The verify pass cached [last, drafts...]; keep the first k.
                self.target.rollback(cache.target, bs - k)
                cache.tokens.append(last)
                cache.tokens.extend(new[:-1])
                cache.pending = hidden[:, :k]
                last = new[-1]
                n += k
                cycles += 1
                committed_in_cycles += k
                accepted_total += accepted
                proposed += bs - 1
                for i in range(accepted):
                    by_position[i] += 1
                if self.chooser is not None:
                    self.chooser.record(bs, accepted, seconds)

                finish = "stop" if stop is not None else ("length" if n >= self.max_tokens else None)
                inflight = None
                if finish is None:
                    snap = cache.snapshot()
                    bs = min(self._next_block(), self.max_tokens - n + 1)
                    started = time.perf_counter()
                    with mx.stream(generation_stream):
                        inflight = self._launch(last, bs)
                for t in new:
                    if t not in self.eos:
                        detok.add_token(t)
                if finish is not None:
                    detok.finalize()
                t = time.perf_counter()
                yield response(detok.last_segment, new, accepted, cycle_bs, finish)
                held = time.perf_counter() - t
                if n // 256 != (n - k) // 256:
                    mx.clear_cache()
        finally:
            if inflight is not None:
                # Stopped by the caller mid-stream: undo the queued cycle so
                # the prompt cache holds exactly what was committed.
                mx.eval(inflight)
                cache.restore(snap)
