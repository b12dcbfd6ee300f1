"""What a model pair's cycles keep across calls: compiled cycles and the
shapes whose graphs are built, forgotten with the drafter or new weights."""

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
    """Valid while the pair's weights are the arrays in ``weights`` (held so
    their ids stay theirs): compiled graphs hold weights as constants. Bounded
    to ``most_settings`` keys, each retraced afresh past ``most_widths`` widths."""

    weights: list
    compiled: OrderedDict = field(default_factory=OrderedDict)  # key -> (compiled step, input widths it traced)
    shapes: set = field(default_factory=set)  # (block size, buffer width) pairs built
    now: dict = field(default_factory=dict)  # what a running trace reads; set under ``lock``
    lock: threading.Lock = field(default_factory=threading.Lock)

    most_settings = 16
    most_widths = 32

    def compiled_step(self, key: tuple, width: tuple, make) -> tuple[Callable, bool]:
        """The compiled cycle for ``key``, made by ``make`` when missing or
        full, and whether calling it now traces: ``width`` (the shapes of its
        inputs that vary) is new to it."""
        fn, widths = self.compiled.get(key, (None, set()))
        if fn is None or (width not in widths and len(widths) >= self.most_widths):
            fn, widths = make(), set()
        traces = width not in widths
        widths.add(width)
        self.compiled[key] = (fn, widths)
        self.compiled.move_to_end(key)
        while len(self.compiled) > self.most_settings:
            self.compiled.popitem(last=False)
        return fn, traces


_traces: dict[int, tuple[weakref.ref, Traces]] = {}


def traces_for(target: DenseTarget, draft: DFlashDraft) -> Traces:
    """The traces kept for this pair. New weights also remake the target's
    fused layers, so a kept adapter does not run old ones."""
    draft.fused_projections()  # fusing makes the projections views: weights after it
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
    _traces.pop(id(draft), None)


def _weights(target: DenseTarget, draft: DFlashDraft) -> list:
    return [a for m in (target.model, draft) for _, a in tree_flatten(m.parameters())]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
