"""What a cycle's graph does not do: copy the logits before reading them.

``x[0]`` with an int index is a gather in MLX (a kernel that copies the
row block: on a GPU, 16 rows of a 151,936-token vocabulary took ~27 us and a
launch, twice a cycle); a squeeze is a view. Read off the graph MLX would
run (``mx.export_to_dot``), built uncompiled so that every op is a node."""

import re
from collections import defaultdict

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import make_prompt_cache
from dflash_mlx.decode.cycle import Cycle
from dflash_mlx.decode.loop import prefill
from dflash_mlx.decode.sampling import SamplingParams
from dflash_mlx.kv.buffer import SharedPositions, positions_mask
from dflash_mlx.targets import adapt

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
# ops that pass an array on without computing over it: a gather behind these still reads the product
VIEWS = {"Unflatten", "Reshape", "Squeeze", "ExpandDims", "AsType", "Slice", "Transpose"}


def graph(path, *outputs):
    """(primitive of each node, producer node of each array, input arrays of each node)."""
    mx.export_to_dot(str(path), *outputs)
    text = path.read_text()
    kind = dict(re.findall(r'\{ (\w+) \[label ="?([A-Za-z]+)', text))
    made_by, inputs = {}, defaultdict(list)
    for a, b in re.findall(r'^("?\w+"?) -> ("?\w+"?)$', text, re.M):
        if a.strip('"') in kind:  # node -> array
            made_by[b] = a
        else:  # array -> node
            inputs[b.strip('"')].append(a)
    return kind, made_by, inputs


def source(array, kind, made_by, inputs):
    """The op that computed ``array``, looking through VIEWS."""
    node = made_by.get(array)
    while node is not None and kind[node.strip('"')] in VIEWS:
        node = made_by.get(inputs[node.strip('"')][0])
    return None if node is None else kind[node.strip('"')]


def cycle_outputs(pair, temperature: float) -> tuple:
    """A block-8 cycle's graph after PROMPT, built uncompiled: (result, last, length)."""
    model, draft = pair
    target = adapt(model)
    cache = make_prompt_cache(model, draft)
    prefill(target, draft, cache, PROMPT, 2048, None)
    cycle = Cycle(target, draft, cache, SamplingParams(temperature), 7)
    return cycle._build(
        8, mx.array([2], mx.int32), mx.array(len(PROMPT), mx.int32), len(PROMPT), cycle.seed, read="bound"
    )[:3]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_cycle_reads_the_logits_of_both_models_without_copying_them(agreeing_pair, tmp_path, temperature):
    kind, made_by, inputs = graph(tmp_path / "cycle.dot", *cycle_outputs(agreeing_pair, temperature))
    products = [n for n, k in kind.items() if k == "Matmul"]
    assert products and "ArgReduce" in kind.values()
    gathers = [n for n, k in kind.items() if k == "Gather"]
    copied = [n for n in gathers if any(source(a, kind, made_by, inputs) == "Matmul" for a in inputs[n][:1])]
    assert copied == []  # (with logits[0] in the cycle, both heads' logits were gathered here)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_cycle_makes_no_filled_arrays_and_its_positions_read_constants(agreeing_pair, tmp_path, temperature):
    """Positions and the drafter's block come from constants made once
    (device.constant_arange): inside a compiled cycle on a GPU an arange, a
    filled array or a concatenation is a launch every cycle, and launches are
    what a small pair's cycle is bound by."""
    kind, made_by, inputs = graph(tmp_path / "cycle.dot", *cycle_outputs(agreeing_pair, temperature))
    ops = list(kind.values())
    assert "Full" not in ops and "Select" in ops  # the block's tokens: one select of the last token and the mask id
    # positions and masks read constants: nothing made per cycle (the aranges
    # left in this graph are the CPU's RoPE, which mx.fast.rope builds from
    # ops here; a GPU runs a kernel)
    positions = SharedPositions(mx.array(5, mx.int32))
    for i, made in enumerate([positions.at(4), positions_mask(4, mx.array(5, mx.int32), 16)]):
        assert "Arange" not in graph(tmp_path / f"made{i}.dot", made)[0].values()
    assert np.array(positions.at(4)).tolist() == [5, 6, 7, 8]
