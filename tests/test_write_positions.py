"""A cycle makes the positions its caches write at once per length, not once
per layer: every layer of a forward writes at the same positions, and on a
GPU each copy of them was two more kernels to launch per layer."""

import mlx.core as mx
from tiny import greedy_reference

from dflash_mlx import make_prompt_cache
from dflash_mlx.decode.cycle import Cycle
from dflash_mlx.decode.loop import prefill
from dflash_mlx.decode.sampling import SamplingParams
from dflash_mlx.kv import buffer as kv_cache
from dflash_mlx.targets import adapt

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def prefilled_cycle(pair, monkeypatch):
    """A greedy Cycle over a cache holding PROMPT, and the positions arrays
    its buffer caches' writes are given, as they are given."""
    model, draft = pair
    target = adapt(model)
    cache = make_prompt_cache(model, draft)
    prefill(target, draft, cache, PROMPT, 2048, None)
    seen = []
    real = kv_cache.put_positions
    monkeypatch.setattr(kv_cache, "put_positions", lambda buf, new, at: (seen.append(at), real(buf, new, at))[1])
    return Cycle(target, draft, cache, SamplingParams(), 0), cache, seen


def test_a_cycle_makes_its_write_positions_once_per_length(agreeing_pair, monkeypatch):
    model, _ = agreeing_pair
    prompt = PROMPT
    cycle, cache, seen = prefilled_cycle(agreeing_pair, monkeypatch)
    block = 8
    flight = cycle.launch(block, mx.array([2], mx.int32), mx.array(len(prompt), mx.int32), len(prompt))
    mx.eval(flight.result)

    target_layers, draft_layers = len(cache.target), len(cache.draft)
    # keys and values of every target layer, and of every drafter layer twice
    # (the block, then the verified positions into its context)
    assert len(seen) == 2 * target_layers + 4 * draft_layers
    # one positions array for the target's caches, one for the drafter's
    assert len({id(at) for at in seen}) == 2
    for at in seen:
        assert at.tolist() == list(range(len(prompt), len(prompt) + block))
    # and the cycle still commits the target's own tokens
    accepted, *tokens = flight.result.tolist()
    want = greedy_reference(model, prompt + [2], block)
    assert tokens[: accepted + 1] == want[: accepted + 1]


def test_caches_given_another_length_do_not_share_its_positions():
    shared, alone = kv_cache.BufferKVCache(), kv_cache.BufferKVCache()
    length = mx.array(5, mx.int32)
    kv_cache.set_lengths([shared], length, 5)
    alone.shared = shared.shared  # a stale share: its length is not this cache's
    alone.set_length(mx.array(7, mx.int32), 7)
    assert shared.positions(length, 3).tolist() == [5, 6, 7]
    assert alone.positions(alone.offset, 3).tolist() == [7, 8, 9]
    assert shared.positions(length, 3) is shared.positions(length, 3)


def test_a_plain_step_at_an_exact_length_writes_at_the_host_length(agreeing_pair, monkeypatch):
    """A plain step whose length the host knows (after a plain step, or the
    prompt) writes its keys and values at that int, as mlx-lm's own step
    does: no positions on the device at all. One queued after a drafting
    cycle (its length still on the device) writes at the device length."""
    model, _ = agreeing_pair
    prompt = PROMPT
    cycle, cache, seen = prefilled_cycle(agreeing_pair, monkeypatch)
    P = len(prompt)
    exact = cycle.launch(1, mx.array([2], mx.int32), mx.array(P, mx.int32), P, exact=True)
    mx.eval(exact.result)
    assert seen == []
    assert exact.result.tolist()[1:] == greedy_reference(model, prompt + [2], 1)
    assert exact.length.item() == P + 1
    queued = cycle.launch(1, exact.last, exact.length, P + 1)
    mx.eval(queued.result)
    assert len(seen) == 2 * len(cache.target)
    assert queued.result.tolist()[1:] == greedy_reference(model, prompt + [2] + exact.result.tolist()[1:], 1)
