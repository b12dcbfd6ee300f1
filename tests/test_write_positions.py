"""A cycle makes the positions its caches write at once per length, not once
per layer: every layer of a forward writes at the same positions, and on a
GPU each copy of them was two more kernels to launch per layer."""

import mlx.core as mx

from dflash_mlx import kv_cache, make_prompt_cache
from dflash_mlx.cycle import Cycle
from dflash_mlx.decode import prefill
from dflash_mlx.targets import adapt
from tiny import greedy_reference


def test_a_cycle_makes_its_write_positions_once_per_length(agreeing_pair, monkeypatch):
    model, draft = agreeing_pair
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    target = adapt(model)
    cache = make_prompt_cache(model, draft)
    prefill(target, draft, cache, prompt, 2048, None)
    seen = []
    real = kv_cache.put_positions
    monkeypatch.setattr(kv_cache, "put_positions", lambda buf, new, at: (seen.append(at), real(buf, new, at))[1])

    block = 8
    cycle = Cycle(target, draft, cache, (0.0, 1.0, 0, 0.0), 0)
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
