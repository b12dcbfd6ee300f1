"""A checked gated delta-net kernel on the CPU, for tests of what runs it:
mlx-lm's ops in its place, limited and tree-shaped as the kernel is."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops

from dflash_mlx.kernels import gated_delta
from dflash_mlx.kernels.dispatch import CheckResult


class OpsKernel:
    """In place of a checked kernel on this backend: mlx-lm's ops, a write's
    limited by ``steps`` and a tree's node by node from the state
    ``parent_of(t, parent)`` names (its parent's, as the kernel runs them);
    each launch recorded as (kind, T), kind "write", "limited" or "tree"."""

    def __init__(self, parent_of=lambda t, parent: parent):
        self.parent_of = parent_of
        self.launches = []

    def __call__(self, q, k, v, g, beta, state, steps=None):
        self.launches.append(("limited" if steps is not None else "write", q.shape[1]))
        mask = None if steps is None else mx.broadcast_to(mx.arange(q.shape[1]) < steps, q.shape[:2])
        return gated_delta_ops(q, k, v, g, beta, state, mask)

    def tree(self, q, k, v, g, beta, state, parents, keep_all=True):
        self.launches.append(("tree", q.shape[1]))
        states, ys = [state], []
        for t, parent in enumerate(parents.tolist()):
            one = slice(t, t + 1)
            before = states[self.parent_of(t, parent) + 1 if t else 0]
            y, s = gated_delta_ops(q[:, one], k[:, one], v[:, one], g[:, one], beta[:, one], before)
            ys.append(y)
            states.append(s)
        return mx.concatenate(ys, axis=1), mx.stack(states)


@pytest.fixture
def checked_kernel(monkeypatch):
    """An OpsKernel that passed its check here (as on a GPU: it runs every write), for Dk 32 in float32."""
    kernel = OpsKernel()
    gated_delta.reset()
    monkeypatch.setitem(gated_delta._kernels, "cpu", kernel)
    monkeypatch.setitem(
        gated_delta._checks, ("cpu", mx.float32, 32), CheckResult("cpu", "float32", 32, False, True, "stand-in")
    )
    yield kernel
    gated_delta.reset()
