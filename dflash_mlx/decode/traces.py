"""What a model pair's cycles keep across calls.

A cycle compiled with mx.compile (cycle.py) is traced once per block size,
sampling setting and buffer width; a backend builds its kernels' graphs once
per shape. Both outlive a call: a request that met a block size before
neither retraces it nor pays its builds again, and ``auto``'s clock (which
leaves a cycle that built new graphs untimed) knows which shapes are built.
This module keeps that per pair, like block_size.py keeps what ``auto``
learned, and forgets it with the drafter or when the weights change.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlx.utils import tree_flatten

if TYPE_CHECKING:
    from ..draft.dflash import DFlashDraft
    from ..targets import DenseTarget


@dataclass
class Traces:
    """What one model pair's cycles keep across calls: the compiled cycles
    (one per block size and sampling setting, each holding a trace per
    buffer width) and the (block size, buffer width) pairs met so far, whose
    graphs the backend has built. Valid while the pair's weights are the
    arrays they were made with (``weights``, held so that their ids stay
    theirs; the old ones are let go at the next call): compiled graphs hold
    weights as constants, so new weights (a LoRA adapter, a training step, a
    quantization) start afresh.

    Bounded: the ``most_settings`` settings used last are kept, and a
    setting's compiled cycle starts afresh after ``most_widths`` buffer
    widths (a long conversation), so a server meeting many sampling
    settings and lengths does not grow without end."""

    weights: list
    compiled: OrderedDict = field(default_factory=OrderedDict)  # key -> (compiled step, widths it traced)
    shapes: set = field(default_factory=set)
    # what a trace reads when it runs: the call's cycle, caches and bound
    # (set for the length of one compiled call, under ``lock``)
    now: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    most_settings = 16
    most_widths = 32

    def compiled_step(self, key: tuple, width: int, make) -> Callable:
        """The compiled cycle for ``key`` (made by ``make`` when missing, too
        wide, or evicted), marked as used last."""
        fn, widths = self.compiled.get(key, (None, set()))
        if fn is None or (width not in widths and len(widths) >= self.most_widths):
            fn, widths = make(), set()
        widths.add(width)
        self.compiled[key] = (fn, widths)
        self.compiled.move_to_end(key)
        while len(self.compiled) > self.most_settings:
            self.compiled.popitem(last=False)
        return fn


_traces: dict[int, tuple[weakref.ref, Traces]] = {}


def traces_for(target: DenseTarget, draft: DFlashDraft) -> Traces:
    """The traces kept for this pair (see Traces); forgotten with the drafter.
    Weights other than the last call's, or new since the adapter was made (a
    cast after ``load``), also remake the target's fused layers, so an
    adapter kept across them (``adapt`` returns one it is given) does not run
    old ones (making them again from unchanged weights reuses what was made)."""
    draft.fused_projections()  # (fusing makes the layers' projections views: their weights after it)
    weights = _weights(target, draft)
    key = id(draft)
    entry = _traces.get(key)
    if entry is None or entry[0]() is not draft or not _same(entry[1].weights, weights):
        target.make_blocks()
        weights = _weights(target, draft)
        entry = (weakref.ref(draft, lambda _, key=key: _traces.pop(key, None)), Traces(weights))
        _traces[key] = entry
    return entry[1]


def forget_traces(draft: DFlashDraft) -> None:
    """Drop the traces kept for ``draft``'s pair: the next call builds afresh."""
    _traces.pop(id(draft), None)


def _weights(target: DenseTarget, draft: DFlashDraft) -> list:
    """Every weight array of the pair, in a fixed order."""
    return [a for m in (target.model, draft) for _, a in tree_flatten(m.parameters())]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
