"""Gated delta-net layers with exact rollback (Qwen3.5 / 3.6, Qwen3-Next).

A delta-net layer keeps a recurrent and a convolution state instead of keys
and values, so each write keeps its recurrence inputs and the state it began
from. Keeping the first ``s`` of its ``T`` steps (``s`` possibly an array the
host never reads) is a slice of the convolution input plus either a masked
re-run of ``gated_delta_update`` from the saved state (``replay``) or a take
from the per-step states kept during the verify (``per-step``, the default,
only for writes of at most ``per_step_longest`` steps). ``set_length`` with
an int restores an exact state from the last writes or a few checkpoints;
``restore`` says when none has it, and the adapter re-reads (hybrid.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import compute_g, gated_delta_kernel, gated_delta_ops, gated_delta_update, normalize_qk

ROLLBACKS = ("replay", "per-step")


def _value(n) -> int:
    return n if isinstance(n, int) else int(n.item())


def per_step_update(q, k, v, a, b, *, layer: nn.Module, state: mx.array | None):
    """mlx-lm's ``gated_delta_update`` one step at a time: returns the outputs
    [B, T, Hv, Dv], the T+1 states stacked [T+1, B, Hv, Dv, Dk], and the last
    state on its own (the cache's next state must not hold the stack)."""
    B, _, _, Dk = q.shape
    if state is None:
        state = mx.zeros((B, *v.shape[-2:], Dk), mx.float32)
    beta, g = mx.sigmoid(b), compute_g(layer.A_log, a, layer.dt_bias)
    kernel = _metal_kernel(k, layer)
    if not kernel and (repeat := v.shape[-2] // q.shape[-2]) > 1:
        q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
    step = gated_delta_kernel if kernel else gated_delta_ops
    states, ys = [state], []
    for t in range(q.shape[1]):
        one = slice(t, t + 1)
        y, state = step(q[:, one], k[:, one], v[:, one], g[:, one], beta[:, one], state)
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1), mx.stack(states), state


def _metal_kernel(k: mx.array, layer: nn.Module) -> bool:
    """Whether ``gated_delta_update`` would run its Metal kernel here (mlx-lm
    0.32's rule): the steps must run the same arithmetic to give the same states."""
    Dk = k.shape[-1]
    return (
        not layer.training and mx.default_device() == mx.gpu and mx.metal.is_available() and Dk >= 32 and Dk % 32 == 0
    )


@dataclass
class Write:
    """One write of T steps starting at ``start`` (an int or an array)."""

    start: int | mx.array
    layer: nn.Module
    conv_input: mx.array  # [1, K-1+T, C]: the convolution state before, then the T new inputs
    q: mx.array
    k: mx.array
    v: mx.array
    a: mx.array
    b: mx.array
    state0: mx.array | None  # the recurrent state before the write
    state: mx.array  # ... and after all T steps
    states: mx.array | None = None  # per-step rollback: the states after 0..T steps, stacked [T+1, ...]

    @property
    def steps(self) -> int:
        return self.q.shape[1]

    def after(self, s) -> tuple[mx.array, mx.array]:
        """(convolution state, recurrent state) after the first ``s`` steps."""
        keep = self.conv_input.shape[1] - self.steps
        if isinstance(s, int):
            conv = self.conv_input[:, s : s + keep]
            if s == self.steps:
                return conv, self.state
            if s == 0 and self.state0 is not None:
                return conv, self.state0
        else:
            conv = mx.take(self.conv_input, s + mx.arange(keep), axis=1)
        if self.states is not None:
            return conv, self.states[s] if isinstance(s, int) else mx.take(self.states, s, axis=0)
        mask = (mx.arange(self.steps) < s)[None]
        layer = self.layer
        _, state = gated_delta_update(
            self.q,
            self.k,
            self.v,
            self.a,
            self.b,
            layer.A_log,
            layer.dt_bias,
            self.state0,
            mask,
            use_kernel=not layer.training,
        )
        return conv, state


class DeltaCache:
    """A gated delta-net layer's state at ``offset`` positions (``bound`` a
    host-side upper bound), with the last writes and a few checkpoints."""

    keep = 3
    checkpoints = 4
    # Longer writes (prefill chunks) keep only a checkpoint: their inputs cost more than a state.
    longest_write = 64
    rollback = "per-step"
    per_step_longest = 16

    def __init__(self, rollback: str | None = None):
        if rollback is not None:
            if rollback not in ROLLBACKS:
                raise ValueError(f"unknown rollback {rollback!r}; choose one of: {', '.join(ROLLBACKS)}.")
            self.rollback = rollback
        self.conv: mx.array | None = None  # [1, K-1, C]
        self.ssm: mx.array | None = None  # [1, Hv, Dv, Dk]
        self.offset: int | mx.array = 0
        self.bound = 0
        self.floor = 0
        self.pending: Write | None = None  # the last write, not yet kept or cut
        self.writes: deque[Write] = deque(maxlen=self.keep)
        self.saved: list[tuple[int, mx.array | None, mx.array | None]] = [(0, None, None)]

    def forward(self, layer: nn.Module, x: mx.array) -> mx.array:
        """mlx-lm's GatedDeltaNet ``layer`` over x [1, T, H], run from its parts
        so the recurrence inputs are kept."""
        self._settle_pending()
        if isinstance(self.offset, int):
            self._checkpoint(self.offset, self.conv, self.ssm)
        B, T, _ = x.shape
        if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next: fused projections
            q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
            qkv = mx.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)
        else:  # Qwen3.5 / 3.6
            qkv = layer.in_proj_qkv(x)
            z = layer.in_proj_z(x).reshape(B, T, layer.num_v_heads, layer.head_v_dim)
            b, a = layer.in_proj_b(x), layer.in_proj_a(x)
        conv = (
            self.conv if self.conv is not None else mx.zeros((B, layer.conv_kernel_size - 1, layer.conv_dim), x.dtype)
        )
        conv_input = mx.concatenate([conv, qkv], axis=1)
        conv_out = nn.silu(layer.conv1d(conv_input))
        q, k, v = [
            t.reshape(B, T, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
                [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
                [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=layer.head_k_dim**-0.5, eps=1e-6)
        states = None
        if self.rollback == "per-step" and T <= self.per_step_longest:
            out, states, state = per_step_update(q, k, v, a, b, layer=layer, state=self.ssm)
        else:
            out, state = gated_delta_update(
                q, k, v, a, b, layer.A_log, layer.dt_bias, self.ssm, use_kernel=not layer.training
            )
        if T <= self.longest_write:
            self.pending = Write(self.offset, layer, conv_input, q, k, v, a, b, self.ssm, state, states)
        self.offset = self.offset + T
        self.bound += T
        self.conv, self.ssm = conv_input[:, T:], state
        out = layer.norm(out, z)
        return layer.out_proj(out.reshape(B, T, -1))

    def _settle_pending(self) -> None:
        """Keep the pending write whole."""
        if self.pending is not None:
            self.pending.states = None  # T states are too many to keep: an older write replays
            self.writes.append(self.pending)
            self.pending = None

    def set_length(self, length: int | mx.array, bound: int | None = None) -> None:
        """Keep the first ``length`` positions: an array cuts the pending write
        on the device; an int restores the exact state or raises LookupError."""
        if isinstance(length, int):
            if not self.restore(length):
                raise LookupError(f"no state kept at length {length}")
            return
        if isinstance(self.offset, int) and self.pending is None:
            self._checkpoint(self.offset, self.conv, self.ssm)
        if self.pending is not None:
            w = self.pending
            s = mx.clip(length - w.start, 0, w.steps)
            self.conv, self.ssm = w.after(s)
            self._settle_pending()
        self.offset, self.bound = length, bound

    def restore(self, n: int) -> bool:
        """Make the state exactly the one after ``n`` positions; False if none is kept."""
        found = None
        if self.pending is None and _value(self.offset) == n:
            found = self.conv, self.ssm
        else:
            for w in ([self.pending] if self.pending is not None else []) + list(reversed(self.writes)):
                start = _value(w.start)
                if start <= n <= start + w.steps:
                    found = w.after(n - start)
                    break
        if found is None:
            found = next(((c, s) for m, c, s in self.saved if m == n), None)
        if found is None:
            return False
        self.pending = None
        self.writes = deque((w for w in self.writes if _value(w.start) < n), maxlen=self.keep)
        self.saved = [t for t in self.saved if t[0] <= n]
        self.conv, self.ssm = found
        self.offset = self.bound = n
        return True

    def restorable(self, n: int) -> int:
        """The longest length <= n restorable from checkpoints alone."""
        return max(m for m, _, _ in self.saved if m <= n)

    def _checkpoint(self, n: int, conv, state) -> None:
        self.saved = [t for t in self.saved if t[0] != n] + [(n, conv, state)]
        if len(self.saved) > self.checkpoints + 1:  # the empty state stays
            del self.saved[1]

    @property
    def capacity(self) -> int:
        return self.bound

    def reserve(self, n: int) -> None:
        pass

    @property
    def state(self):
        return self.conv, self.ssm

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.conv, self.ssm) if a is not None)
