"""A sliding-window layer reads its window, not the whole context, wherever the
host knows its rows' positions (a prompt's chunks, a plain step), as mlx-lm's
rotating cache holds it: the keys it is handed are the window's (a chunk's:
the window before it and the chunk), a plain step's exactly the window with no
mask; full-attention layers read everything; tokens stay mlx-lm's."""

import mlx.core as mx
import pytest
from test_attention_routing_families import pair
from tiny import greedy_reference

from dflash_mlx.cache.prompt import make_prompt_cache
from dflash_mlx.decode.cycle import Cycle
from dflash_mlx.decode.loop import prefill
from dflash_mlx.decode.sampling import SamplingParams
from dflash_mlx.layers import attention
from dflash_mlx.targets import adapt

WINDOW = 8  # the tiny configs' sliding window

# Per family, which attention layers slide, in layer order.
SLIDING = {
    "gpt_oss": [True, False] * 2,
    "gemma3_text": [True, True, False] * 2,
    "gemma4_text": [True, True, False] * 2,  # (its last two layers read layers 3 and 2's keys)
    "muse_glimmer": [True, True, True, False],
}


@pytest.fixture
def reads(monkeypatch):
    """(query rows, keys, mask given) of each call of MLX's attention, which it still computes."""
    calls = []
    real = attention.scaled_dot_product_attention

    def recorded(queries, keys, values, *, mask, **kw):
        calls.append((queries.shape[2], keys.shape[2], mask is not None))
        return real(queries, keys, values, mask=mask, **kw)

    monkeypatch.setattr(attention, "scaled_dot_product_attention", recorded)
    return calls


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_a_sliding_layer_reads_its_window_in_a_prompt_and_a_plain_step(reads, family):
    model, draft = pair(family, seed=23)
    target = adapt(model)
    prompt = list(range(1, 41))
    cache = make_prompt_cache(model, draft)
    last_logits = prefill(target, draft, cache, prompt, 16, None)
    sliding = SLIDING[family]
    # the prompt's chunks (16, 16 and 7 rows, then its last token): a sliding
    # layer reads the 7 keys before a chunk and the chunk, a full one all
    want = []
    for start, rows in ((0, 16), (16, 16), (32, 7), (39, 1)):
        want += [(rows, min(start, WINDOW - 1) + rows if s else start + rows) for s in sliding]
    assert [(r, k) for r, k, _ in reads] == want
    reads.clear()
    cycle = Cycle(target, draft, cache, SamplingParams(), 0)
    last = cycle.first_token(last_logits, len(prompt))
    flight = cycle.launch(1, last, mx.array(len(prompt), mx.int32), len(prompt), exact=True)
    mx.eval(flight.result)
    # a plain step: the window exactly, unmasked (as mlx-lm's one-row step); full layers all 41 keys
    assert reads[: len(sliding)] == [(1, WINDOW, False) if s else (1, len(prompt) + 1, False) for s in sliding]
    assert [last.item(), flight.result.tolist()[1]] == greedy_reference(model, prompt, 2)
