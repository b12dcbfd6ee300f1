"""A cycle's lengths, as its kernels read them: on CUDA, views of 16-byte
arrays the device wrote (MLX keeps arrays of 8 bytes or less in managed
memory, whose reads cost a custom kernel ~20 us a launch), made once a
cycle and once per length the layers share; elsewhere the arrays themselves.
The output stays the target's own either way."""

import re

import mlx.core as mx
import numpy as np
import pytest
from test_cycle_graph import VIEWS, graph
from tiny import greedy_reference, make_tokenizer

from dflash_mlx import device, stream_generate
from dflash_mlx.decode.cycle import Cycle
from dflash_mlx.decode.sampling import SamplingParams
from dflash_mlx.decode.traces import forget_traces
from dflash_mlx.kv.buffer import BufferKVCache, set_lengths


@pytest.fixture
def cuda_lengths(monkeypatch):
    """device_scalar as it runs on CUDA (the rest of the pair stays on the CPU's paths)."""
    monkeypatch.setattr(device, "backend", lambda: "cuda")


def test_a_scalar_stays_itself_off_cuda(monkeypatch):
    monkeypatch.setattr(device, "backend", lambda: "cpu")
    x = mx.array(41, mx.int32)
    assert device.device_scalar(x) is x
    assert device.device_scalar(41) == 41
    assert device.device_scalar(x, 3).item() == 44 and device.device_scalar(41, 3) == 44


def test_on_cuda_a_scalar_is_read_from_a_wider_array_the_device_wrote(cuda_lengths, tmp_path):
    x = mx.array(41, mx.int32)
    y = device.device_scalar(x)
    kind, made_by, inputs = graph(tmp_path / "scalar.dot", y)  # (before evaluating it: that drops its graph)
    (sink,) = re.findall(r"rank=sink; (\S+);", (tmp_path / "scalar.dot").read_text())
    # walk back from the result: views (a slice of the wide array, a reshape), then the op that wrote it
    node, passed = made_by[sink], []
    while kind[node.strip('"')] in VIEWS:
        passed.append(kind[node.strip('"')])
        node = made_by[inputs[node.strip('"')][0]]
    assert "Slice" in passed and kind[node.strip('"')] == "Add"
    # the add's other side is a constant, not a filled array (a launch of its own on a GPU)
    made = [kind[made_by[i].strip('"')] for i in inputs[node.strip('"')] if i in made_by]
    assert "Full" not in made, made
    assert y is not x and y.shape == () and y.dtype == mx.int32 and y.item() == 41
    assert device.device_scalar(x, 5).item() == 46  # a length n positions on, in the same one add
    # host ints and arrays of other shapes pass through
    assert device.device_scalar(7) == 7
    v = mx.array([1, 2], mx.int32)
    assert device.device_scalar(v) is v


def test_layers_set_together_share_one_length_after_their_writes(cuda_lengths):
    caches = [BufferKVCache() for _ in range(3)]
    kv = mx.ones((1, 2, 5, 8))
    for c in caches:
        c.update_and_fetch(kv, kv)
    set_lengths(caches, device.device_scalar(mx.array(5, mx.int32)), 5)
    new = mx.full((1, 2, 3, 8), 2.0)
    for c in caches:
        c.update_and_fetch(new, new)
    assert caches[0].offset is caches[1].offset is caches[2].offset  # one add for every layer, not one each
    assert caches[0].offset.item() == 8
    keys = np.array(caches[2].keys[0, 0, :9, 0])
    assert keys.tolist() == [1, 1, 1, 1, 1, 2, 2, 2, 0]
    # a second write moves each cache on from there
    for c in caches:
        c.update_and_fetch(kv[:, :, :1], kv[:, :, :1])
    assert [c.offset.item() for c in caches] == [9, 9, 9]


@pytest.mark.parametrize("compiled", [False, True])
def test_wide_lengths_keep_the_output_the_targets(cuda_lengths, monkeypatch, agreeing_pair, compiled):
    monkeypatch.setattr(Cycle, "compile_graphs", compiled)
    model, draft = agreeing_pair
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for block in (4, 16):
        out = stream_generate(model, draft, make_tokenizer(24), prompt, max_tokens=40, block_size=block)
        assert [t for r in out for t in r.tokens] == greedy_reference(model, prompt, 40), block
    # sampled: the same text as with narrow lengths (device_scalar off CUDA), for one seed
    texts = []
    for where in ("cuda", "cpu"):
        monkeypatch.setattr(device, "backend", lambda where=where: where)
        forget_traces(draft)  # (a compiled cycle keeps the lengths it was traced with)
        out = stream_generate(
            model, draft, make_tokenizer(24), prompt, max_tokens=30, block_size=8, temperature=0.9, seed=11
        )
        texts.append([t for r in out for t in r.tokens])
    assert texts[0] == texts[1]


def wide(array, tmp_path) -> bool:
    """Whether ``array`` is read from a wider array the device wrote: a
    slice (through views) of an Add's output."""
    kind, made_by, inputs = graph(tmp_path / "length.dot", array)
    (sink,) = re.findall(r"rank=sink; (\S+);", (tmp_path / "length.dot").read_text())
    node, passed = made_by.get(sink), []
    while node is not None and kind[node.strip('"')] in VIEWS:
        passed.append(kind[node.strip('"')])
        node = made_by.get(inputs[node.strip('"')][0])
    return node is not None and "Slice" in passed and kind[node.strip('"')] == "Add"


def test_a_cycles_attention_reads_wide_lengths_shared_by_its_layers(cuda_lengths, monkeypatch, agreeing_pair, tmp_path):
    """Every layer's attention, the target's and the drafter's, is handed
    its start and its length with the block as device scalars (what the
    CUDA kernels read), one of each a forward for all its layers."""
    from dflash_mlx import make_prompt_cache
    from dflash_mlx.decode.loop import prefill
    from dflash_mlx.draft import dflash as draft_module
    from dflash_mlx.layers import attention
    from dflash_mlx.layers import blocks as layers
    from dflash_mlx.targets import adapt

    model, draft = agreeing_pair
    target = adapt(model)
    cache = make_prompt_cache(model, draft)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    prefill(target, draft, cache, prompt, 2048, None)
    seen = []
    real = attention.attention_output

    def spy(queries, keys, values, *, cache, start, length=None, **kw):
        seen.append((start, cache.offset if length is None else length))
        return real(queries, keys, values, cache=cache, start=start, length=length, **kw)

    monkeypatch.setattr(layers, "attention_output", spy)  # the target's layers
    monkeypatch.setattr(draft_module, "cache_attention", spy)  # the drafter's
    cycle = Cycle(target, draft, cache, SamplingParams(), 0)
    cycle._build(8, mx.array([2], mx.int32), mx.array(len(prompt), mx.int32), len(prompt), cycle.seed, read="bound")
    layers = len(cache.target) + len(cache.draft)
    assert len(seen) == layers
    starts, ends = {id(s) for s, _ in seen}, {id(e) for _, e in seen}
    assert (
        len(starts) == 1 and len(ends) == 2
    )  # one length a cycle; one end for the target's forward, one the drafter's
    assert wide(seen[0][0], tmp_path) and all(wide(e, tmp_path) for e in {id(e): e for _, e in seen}.values())


def test_a_hybrid_targets_attention_layers_share_their_lengths():
    """A hybrid target (delta-net layers between attention layers) sets its
    attention buffers' length together: one write position and one end a
    forward for all of them, as a dense target's layers share."""
    from test_hybrid import make_pair

    from dflash_mlx import make_prompt_cache
    from dflash_mlx.decode.loop import prefill
    from dflash_mlx.targets import adapt

    model, draft = make_pair("qwen3_5")
    target = adapt(model)
    cache = make_prompt_cache(model, draft)
    prefill(target, draft, cache, [5, 3, 9, 2, 7], 2048, None)
    buffers = [c for c in cache.target if type(c) is BufferKVCache]
    assert len(buffers) >= 2
    target.set_length(cache.target, mx.array(5, mx.int32), 5)
    assert buffers[0].shared is not None and all(c.shared is buffers[0].shared for c in buffers)
    assert all(c.after(3) is buffers[0].after(3) for c in buffers)
