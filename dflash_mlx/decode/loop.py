"""The token loop: prefill, queue cycles, commit, stop.

Cycle n+1 is queued from cycle n's device state before the host reads cycle
n's tokens, so the host learns each cycle's tokens one cycle late; a cycle
queued past the end is dropped. Across ranks every cycle also carries the
ranks' agreement to stop (distributed.AgreedStop), so an interrupt on some
ranks ends every rank's loop after the same cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import generation_stream

from ..auto.chooser import BlockChooser
from ..cache.prompt import PromptCache
from ..distributed import AgreedStop
from ..draft.dflash import DFlashDraft
from ..draft.lookup import LookupGate, LookupParams
from ..draft.tree import TreeParams
from ..layers.linear import prompt_products
from ..targets import DenseTarget
from .clock import CycleClock
from .cycle import Cycle, Flight
from .sampling import SamplingParams


@dataclass
class Step:
    tokens: list[int]
    accepted: int | None
    block_size: int
    finish: str | None
    # With log-probs asked for, aligned with ``tokens``: the target's log-prob
    # of each, and (k > 0) the top k (token, log-prob) pairs at its position.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    lookup_hit: bool = False  # the cycle's drafts were looked up
    rows: int = 1  # the target rows it verified (a tree's nodes, or the block)


@dataclass(frozen=True)
class LookupSetting:
    """Prompt lookup in a decode: how it matches, and ``auto`` (beside a
    drafter: per reply, only while it pays; see LookupGate)."""

    params: LookupParams = LookupParams()
    auto: bool = False


def _scores(logprobs: mx.array | None, top_ids: mx.array | None, n: int):
    """The first ``n`` rows' (log-probs, top pairs) as Step holds them."""
    if logprobs is None:
        return None, None
    rows = logprobs[:n].tolist()
    if top_ids is None:
        return [r[0] for r in rows], None
    ids = top_ids[:n].tolist()
    return [r[0] for r in rows], [list(zip(i, r[1:])) for i, r in zip(ids, rows)]


def prefill(
    target: DenseTarget,
    draft: DFlashDraft,
    cache: PromptCache,
    ids: list[int],
    step: int,
    progress: Callable[[int, int], None] | None,
) -> mx.array:
    """Prefill what the cache lacks of ``ids``; returns the last logits [V]."""
    taps = list(draft.config.target_layer_ids)
    new = ids[cache.keep_prefix(ids) :]
    logits = None
    done = 0
    for chunk in cache.chunks(new, step):
        cache.expect(len(ids))  # (each chunk: layers quantized by the last one take it too)
        with prompt_products():
            logits, hidden = target(mx.array(chunk)[None], cache.target, taps, last_only=True)
        # the target's graph first: the extend's scratch would add to its attention's peak
        mx.eval(logits, hidden, [a for c in cache.target for a in c.state if a is not None])
        draft.extend(hidden, cache.draft)
        mx.eval(logits, cache.arrays())
        cache.tokens.extend(chunk)  # only now: an interrupt above leaves the chunk out
        cache.maybe_quantize()
        mx.clear_cache()  # as mlx-lm's prefill: a chunk's scratch is not the next one's
        done += len(chunk)
        if progress is not None:
            progress(done, len(new))
    return logits[0, -1]


def decode(
    target: DenseTarget,
    draft: DFlashDraft,
    cache: PromptCache,
    ids: list[int],
    *,
    max_tokens: int,
    sampling: SamplingParams,
    seed: int,
    block: int | BlockChooser,
    eos: set[int],
    prefill_step_size: int = 2048,
    progress: Callable[[int, int], None] | None = None,
    logprobs: int | None = None,
    lookup: LookupSetting | None = None,
    tree: TreeParams | None = None,
) -> Iterator[Step]:
    """Yield the first token's Step, then one per cycle. At each Step the
    target cache holds every committed token but the last; the drafter's
    context catches up (deferred plain steps) when the generator ends.
    ``logprobs``: None, or k to fill each Step's log-probs and top k;
    ``lookup``: None (off; a lookup-only drafter looks up anyway) or how;
    ``tree``: None (blocks) or the draft trees whose rows ``block`` gives.
    Across ranks, Ctrl-C or closing the generator on any rank ends every
    rank's loop after the same cycle, whose tokens are kept but not yielded."""
    owner = object()
    cache.claim(owner)
    try:
        params = lookup.params if lookup is not None else None
        cycle = Cycle(target, draft, cache, sampling, seed, logprobs, lookup=params, tree=tree)
        gate = LookupGate() if lookup is not None and lookup.auto and not cycle.lookup_only else None
        group = getattr(target, "group", None)
        agreed = AgreedStop(group) if group is not None else None
        steps = _settled(
            cycle,
            ids,
            owner=owner,
            max_tokens=max_tokens,
            block=block,
            eos=eos,
            step=prefill_step_size,
            progress=progress,
            gate=gate,
            agreed=agreed,
        )
        yield from steps if agreed is None else agreed.run(steps)
    finally:
        cache.release(owner)


def _settled(cycle: Cycle, ids: list[int], **loop):
    cache, owner = cycle.caches, loop["owner"]
    try:
        yield from _cycles(cycle, ids, **loop)
    finally:
        if cache.owner is owner:  # a newer call that took the cache over settles it
            with mx.stream(generation_stream):
                cycle.feed_deferred(len(cache.tokens))


def settle(clock: CycleClock, flight: Flight) -> None:
    """Wait for ``flight``'s result. Before a change of size ``auto`` waits
    so: the next cycle's launch, queued ahead of the read, would otherwise
    hide in this one's wait (a block before a plain step's slower,
    uncompiled launch looked cheaper by that launch)."""
    clock.wait(flight.result)


def _cycles(
    cycle: Cycle, ids: list[int], *, owner, max_tokens: int, block, eos: set[int], step: int, progress, gate, agreed
):
    target, draft, cache = cycle.target, cycle.draft, cycle.caches
    chooser = block if isinstance(block, BlockChooser) else None

    def launch(bs: int, last, length, bound: int, exact: bool) -> tuple[Flight, mx.array | None]:
        """The cycle queued, and with a group, the ranks' flag to stop after it."""
        with mx.stream(generation_stream):
            flight = clock.launch(lambda: cycle.launch(bs, last, length, bound, exact))
            return flight, None if agreed is None else agreed.flag()

    def choose(bound: int) -> int:
        """The size of the next cycle, which launches at ``bound``."""
        if chooser is None:
            return block

        def would_build(size: int) -> bool:
            return cycle.would_build(size, bound)

        if agreed is None:
            return chooser.choose(would_build)
        # across ranks rank 0's choice comes through an exchange queued behind the cycle in flight
        return clock.wait_for(lambda: chooser.choose(would_build))

    if chooser is not None:
        chooser.new_reply(len(ids))

    with mx.stream(generation_stream):
        last_logits = prefill(target, draft, cache, ids, step, progress)
        last = cycle.first_token(last_logits, len(ids))
        first_scores = cycle.first_logprobs(last_logits, last)
    first = last.item()
    first_scores = _scores(*first_scores, 1)
    clock = CycleClock()
    n = 1
    if first in eos or max_tokens == 1:
        yield Step([first], None, 1, "stop" if first in eos else "length", *first_scores)
        return
    cycle.start_lookup(ids + [first])
    flight, flag = launch(
        cache.block_from_here(choose(len(ids))), last, mx.array(len(ids), mx.int32), len(ids), exact=True
    )
    with clock.caller():
        yield Step([first], None, 1, None, *first_scores)
    cache.check_owner(owner)
    last_host = first
    while True:
        # Queue the next cycle before reading this one. Blocks are not cut
        # near the end (another graph to build): what passes max_tokens is dropped.
        following = None
        if n + 1 < max_tokens:
            bound = len(cache.tokens) + flight.block_size
            bs = choose(bound)
            exact = flight.block_size == 1
            if cache.may_queue(bound, bs):  # not across the start of KV quantization
                if chooser is not None and bs != flight.block_size:
                    settle(clock, flight)
                    if bs == 1:  # the length is known now: a plain step reads it as mlx-lm's does
                        bound, exact = len(cache.tokens) + flight.result[0].item() + 1, True
                following = launch(bs, flight.last, flight.length, bound, exact=exact)
        clock.wait(flight.result, *([] if flag is None else [flag]))
        values = flight.result.tolist()
        took = clock.cost(flight)
        if chooser is not None:
            chooser.record(
                flight.block_size,
                values[0],
                None if flight.new_shape else took,
                built=took if flight.new_shape else None,
            )
        accepted, proposals = values[0], values[1:]
        hit = False
        if flight.lookup is not None:
            matched, hit, other = flight.lookup.tolist()
            if gate is not None:
                gate.record(bool(matched), bool(hit), accepted, other)
                cycle.enable_lookup(gate.enabled)
        new = proposals[: min(accepted + 1, max_tokens - n)]
        stop = next((i for i, t in enumerate(new) if t in eos), None)
        if stop is not None:
            new = new[: stop + 1]
        cache.tokens.append(last_host)
        cache.tokens.extend(new[:-1])
        last_host = new[-1]
        n += len(new)
        if flag is not None and flag.item():
            return  # on every rank alike; the cycle queued after it is dropped
        finish = "stop" if stop is not None else ("length" if n >= max_tokens else None)
        scores = _scores(flight.logprobs, flight.top_ids, len(new))
        with clock.caller():
            yield Step(
                new,
                min(accepted, len(new) - 1),
                flight.block_size,
                finish,
                *scores,
                lookup_hit=bool(hit),
                rows=flight.rows,
            )
        if finish is not None:
            return
        cache.check_owner(owner)
        if following is None:
            following = launch(cache.block_from_here(bs), flight.last, flight.length, len(cache.tokens), exact=True)
        flight, flag = following
        if n // 256 != (n - len(new)) // 256:
            mx.clear_cache()
